"""Build models with isotrain's builder on one layout per launch step; rank 0 saves what the tests compare.

    build_worker.py OUT.pt weights LAYOUTS MODEL_DIR   every layout's full weights (fresh and from MODEL_DIR)
    build_worker.py OUT.pt memory LAYOUT               this rank's peak memory while building a larger model

LAYOUTS: RxSxT[,...] (dp_replicate x dp_shard x tp).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor import DTensor

from isotrain.config import ModelConfig
from isotrain.models.build import build, build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64,
        "tie_word_embeddings": True}
# ~42M parameters (168 MB in fp32), the largest tensor 4 MB: a rank's shard is far below the whole model.
LARGER = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64, "vocab_size": 8192}


def tokenizer():
    return train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)


def grown_tokenizer():
    """The tokenizer with more special tokens than TINY's 64 vocabulary rows: a loaded model grows its vocabulary."""
    from isotrain.models.tokenizer import add_special_tokens

    tok = tokenizer()
    add_special_tokens(tok, [f"<t{i}>" for i in range(64 - len(tok) + 6)])
    return tok


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def weights(model) -> dict:
    base = getattr(model, "module", model)
    return {name: full(t) for name, t in base.state_dict().items()}


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_build_bytes(build_fn) -> int:
    """The rise of this process's peak resident memory while `build_fn()` runs (VmHWM, reset first)."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    model = build_fn()
    peak = _status("VmHWM") - before
    del model
    return peak


def _model_bytes(cfg, tok) -> int:
    """fp32 bytes of every parameter of the whole model, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    from isotrain.models.loading import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(cfg, tok))
    return sum(4 * p.numel() for p in model.parameters())


def main() -> None:
    out, mode, layouts, *rest = sys.argv[1:]
    info = init_distributed()
    tok = tokenizer()
    results = {}
    for layout in layouts.split(","):
        dims = ParallelDims(*(int(x) for x in layout.split("x")))
        parallel = build_parallel(dims, info.device, info.rank)
        if mode == "weights":
            fresh = build(ModelConfig(config=TINY), tok, 3, parallel, info.device, loss_parallel=True)
            loaded = build(ModelConfig(name_or_path=rest[0]), tok, 3, parallel, info.device)
            grown = build(ModelConfig(name_or_path=rest[0]), grown_tokenizer(), 3, parallel, info.device)
            base = getattr(fresh, "module", fresh)  # inside DDP
            results[layout] = {"fresh": weights(fresh), "loaded": weights(loaded), "grown": weights(grown),
                               "tied": base.lm_head.weight is base.model.embed_tokens.weight}
        else:
            cfg = ModelConfig(config=LARGER)
            mine = peak_build_bytes(lambda: build(cfg, tok, 0, parallel, info.device))
            whole = peak_build_bytes(lambda: build_plain(cfg, tok, 0))  # the control: one process holds it all
            model_bytes = _model_bytes(cfg, tok)
            gathered = [None] * info.world_size
            torch.distributed.all_gather_object(gathered, (mine, whole, model_bytes))
            results[layout] = gathered
    if info.is_main:
        torch.save(results, out)
    if info.is_distributed:
        shutdown_distributed()
    # Skip the interpreter's teardown: once, a rank aborted there ("terminate called without an active
    # exception", a C++ thread destroyed at exit) after its work was done and the results were saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
