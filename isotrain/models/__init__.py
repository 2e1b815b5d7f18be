"""Loading Hugging Face causal LMs and tokenizers, and training a tokenizer for a fresh model."""
