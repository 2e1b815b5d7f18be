"""What RL trains and samples with: the policy and its frozen reference, the rollout engine, and the
fingerprint of the starting weights that a resume must still find (the reference and a LoRA base are
rebuilt from them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from isotrain.config import RLRunConfig
from isotrain.disk import sha256_file
from isotrain.models.build import build
from isotrain.models.loading import model_dir
from isotrain.train.optim import build_optimizer
from isotrain.train.setup import compute_dtype, lora_adapter


def build_policy(cfg: RLRunConfig, device: torch.device, tokenizer, parallel):
    """(policy, its optimizer, the frozen reference or None): both models built on this rank's layout by the one
    model builder (the reference sharded like the policy, without gradients or optimizer)."""
    common = dict(compute_dtype=compute_dtype(cfg))
    model = build(cfg.model, tokenizer, cfg.train.seed, parallel, device, compile=cfg.train.compile,
                  activation_checkpointing=cfg.train.activation_checkpointing == "full",
                  adapt=lora_adapter(cfg, parallel.dims), **common)
    reference = None
    # With LoRA the KL reference is the policy with its adapters off: no second model.
    if cfg.lora.r == 0 and cfg.rl.kl_coef > 0:
        reference = build(cfg.model, tokenizer, cfg.train.seed, parallel, device, trainable=False, **common)
    return model, build_optimizer(model, cfg.train), reference


def make_engine(cfg: RLRunConfig, config, tokenizer, output_dir: Path, rank: int = 0):
    """The rollout engine, holding its own copy of the weights. It starts with none usable: the recipe sends
    the policy's weights before the first rollout, and after every update."""
    if cfg.rollout.engine == "process":
        from isotrain.rl.engine_process import ProcessEngine

        # The child process starts from the config and tokenizer files only; weights come by update_weights.
        tokenizer_dir = output_dir / "engine_tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        return ProcessEngine(config, tokenizer_dir, seed=cfg.train.seed, batch_size=cfg.rollout.batch_size,
                             num_threads=torch.get_num_threads())
    v = cfg.rollout.vllm
    if cfg.rollout.engine == "vllm" and v.url is not None:
        from isotrain.rl.engine_vllm_server import VLLMServerEngine

        from isotrain.parallel.dist import broadcast_from_main

        # One server for every rank: each samples its own prompts; rank 0 alone sends the weights (see the class).
        return VLLMServerEngine(v.url, v.weights_dir, tokenizer.eos_token_id, seed=cfg.train.seed, dtype=v.dtype,
                                temperature=cfg.rl.temperature, top_p=cfg.rl.top_p, bucket_bytes=v.bucket_bytes,
                                timeout_s=v.timeout_s, max_model_len=cfg.data.max_seq_len, lora_rank=cfg.lora.r,
                                writer=rank == 0, share=broadcast_from_main)
    if cfg.rollout.engine == "vllm":
        from isotrain.rl.engine_vllm import VLLMEngine, vllm_lora_rank

        # One engine per rank: each rank generates its own prompts' samples, like the in-process engine.
        return VLLMEngine(config, tokenizer.eos_token_id, python=v.python, seed=cfg.train.seed, dtype=v.dtype,
                          temperature=cfg.rl.temperature, top_p=cfg.rl.top_p, kv_cache_bytes=v.kv_cache_bytes,
                          engine_args=v.engine_args, bucket_bytes=v.bucket_bytes, timeout_s=v.timeout_s,
                          num_threads=torch.get_num_threads(), log_path=output_dir / f"vllm_engine.rank{rank}.log",
                          max_model_len=cfg.data.max_seq_len,  # prompt + response: the KV cache sized for it
                          max_lora_rank=vllm_lora_rank(cfg.lora.r))
    from isotrain.rl.rollout import HFEngine

    return HFEngine.from_config(config, tokenizer, batch_size=cfg.rollout.batch_size)


def start_fingerprint(cfg: RLRunConfig) -> str:
    """What the frozen reference is rebuilt from on resume: the starting weights' files, or the seeded config."""
    if cfg.model.name_or_path is None:
        return hashlib.sha256(json.dumps([cfg.model.config, cfg.train.seed], sort_keys=True).encode()).hexdigest()
    files = sorted(model_dir(cfg.model).glob("model*.safetensors"))
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()
