"""Save the trained model as a plain Hugging Face directory (until sharded checkpoints replace it).

Under DDP/FSDP2 the full state dict is gathered to rank 0 (CPU), loaded into an unwrapped copy of
the model, and written with `save_pretrained`, so the directory loads with `from_pretrained` alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from isotrain.parallel.dist import DistInfo, barrier


def save_final_model(model: torch.nn.Module, tokenizer, model_dir: Path, info: DistInfo):
    """Write model_dir on rank 0 and return a plain model there (None on other ranks)."""
    if info.is_distributed:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        plain = None
        if info.is_main:
            config = getattr(model, "module", model).config
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(state)
    else:
        plain = model
    if info.is_main:
        hf_logging.disable_progress_bar()  # our own output says what was written
        plain.config.use_cache = True
        plain.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    barrier()
    return plain
