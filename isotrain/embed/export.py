"""The sentence-transformers files that make a Hugging Face model directory a SentenceTransformer directory.

Written beside config.json and model.safetensors in every checkpoint and in the final model, in the layout of
sentence-transformers 2.x (modules.json: Transformer at the root, Pooling in 1_Pooling/, Normalize), which current
releases still load: `SentenceTransformer(path)` gives the vectors isotrain trains (tests/embed/test_export.py).
"""

from __future__ import annotations

import json

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def _json(value) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def sentence_transformers_files(pooling: str, hidden_size: int, normalize: bool, max_seq_len: int) -> dict[str, bytes]:
    """{relative path: bytes} of the sentence-transformers module files."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:  # Normalize has no files of its own
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    flags = {flag: False for flag in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                                      "pooling_mode_mean_sqrt_len_tokens")}
    flags[POOLING_FLAGS[pooling]] = True
    return {
        "modules.json": _json(modules),
        "sentence_bert_config.json": _json({"max_seq_length": max_seq_len, "do_lower_case": False}),
        "config_sentence_transformers.json": _json({"prompts": {}, "default_prompt_name": None,
                                                    "similarity_fn_name": "cosine"}),
        "1_Pooling/config.json": _json({"word_embedding_dimension": hidden_size, **flags}),
    }
