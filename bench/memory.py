"""The memory estimate next to a real process's peak resident memory, one process, a few models and settings.

For each case: VmRSS before building, VmHWM reset (5 > /proc/self/clear_refs), the model built by isotrain's
builder, isotrain's AdamW, two `train_step`s on random full-length micro-batches (the second one has the
optimizer moments from the start), then VmHWM − VmRSS-before = the measured peak increase. The estimate is
`isotrain estimate-memory` of the same config. glibc keeps freed blocks, allocator slack and the per-op
scratch of matmul/attention kernels are outside the estimate; MALLOC_MMAP_THRESHOLD_ is fixed so large frees
return to the system.

    MALLOC_MMAP_THRESHOLD_=1048576 OMP_NUM_THREADS=2 python bench/memory.py [dense] [moe]
"""

from __future__ import annotations

import gc
import sys

import torch
from rich.console import Console
from rich.table import Table

from isotrain.config import build_config
from isotrain.memory.estimate import estimate_memory
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.models.unwrap import hf_model
from isotrain.moe.settings import router_settings
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import single_process
from isotrain.train.optim import build_optimizer
from isotrain.train.step import step_options, train_step

CASES = [  # (hidden, layers, vocab, micro, seq, dtype, checkpointing, experts: 0 = dense Llama, else qwen3_moe top-2)
    (256, 4, 8192, 8, 256, "float32", "none", 0),
    (256, 4, 8192, 8, 256, "float32", "full", 0),
    (256, 4, 8192, 8, 256, "bfloat16", "none", 0),
    (512, 4, 8192, 4, 256, "float32", "none", 0),
    (256, 4, 8192, 8, 256, "float32", "none", 8),
]


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def case_config(hidden, layers, vocab, micro, seq, dtype, checkpointing, experts):
    model = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 16 * 16 + 16,
             "num_hidden_layers": layers, "num_attention_heads": max(hidden // 64, 4),
             "num_key_value_heads": max(hidden // 64, 4), "max_position_embeddings": seq, "vocab_size": vocab}
    if experts:
        model.update(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden,
                     decoder_sparse_step=1, mlp_only_layers=[])
    return build_config({"model": {"config": model, "dtype": dtype}, "data": {"max_seq_len": seq},
                         "train": {"micro_batch_size": micro, "global_batch_size": micro,
                                   "activation_checkpointing": checkpointing}})


def measure(cfg, tokenizer) -> int:
    micro, seq, vocab = cfg.train.micro_batch_size, cfg.data.max_seq_len, cfg.model.config["vocab_size"]
    ids = torch.randint(0, vocab, (micro, seq))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).expand(micro, seq).clone(),
             "segment_ids": torch.zeros(micro, seq, dtype=torch.long), "num_input_tokens": micro * seq,
             "num_trained_tokens": micro * seq}
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model = build_plain(cfg.model, tokenizer, 0, activation_checkpointing=cfg.train.activation_checkpointing == "full")
    optimizer = build_optimizer(model, cfg.train)
    options = step_options(cfg, single_process(ParallelDims(1, 1, 1)),
                           router=router_settings(cfg.moe, hf_model(model).config))
    for _ in range(2):
        train_step(model, optimizer, [batch], 1e-4, options, torch.device("cpu"))
    peak = _status("VmHWM") - before
    del model, optimizer
    gc.collect()
    return peak


def main() -> None:
    tokenizer = train_tokenizer(["0123456789 abcdefghij+="] * 4, "char", 64)
    table = Table(title="estimate vs measured peak RSS increase, 1 process (MB = 1e6 bytes)")
    for column in ("model", "dtype", "checkpointing", "micro × seq", "estimate MB", "measured MB", "measured / estimate"):
        table.add_column(column, justify="right")
    only = set(sys.argv[1:])  # e.g. `moe`: only the MoE rows
    for case in CASES:
        if only and ("moe" if case[-1] else "dense") not in only:
            continue
        cfg = case_config(*case)
        estimate = estimate_memory(cfg, 1, vocab_size=case[2]).total_bytes
        measured = measure(cfg, tokenizer)
        hidden, layers, vocab, micro, seq, dtype, checkpointing, experts = case
        name = f"h{hidden} L{layers} V{vocab}" + (f" MoE {experts}×top-2" if experts else "")
        table.add_row(name, dtype, checkpointing, f"{micro} × {seq}",
                      f"{estimate / 1e6:.1f}", f"{measured / 1e6:.1f}", f"{measured / estimate:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
