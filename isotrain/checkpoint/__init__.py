"""Unified checkpoints: Hugging Face model directories plus a layout-free training state."""
