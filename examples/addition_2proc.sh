#!/usr/bin/env bash
# The addition recipe on 2 processes with FSDP2 (gloo on CPU, nccl on GPU). The global batch is
# unchanged (64 sequences), so each rank runs 32 per step and the loss curve matches 1 process.
# Use parallel.dp_shard=1 parallel.dp_replicate=-1 for DDP instead.
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --standalone --nproc-per-node 2 -m isotrain train examples/addition.yaml \
  parallel.dp_replicate=1 parallel.dp_shard=2 train.micro_batch_size=32 output_dir=runs/addition-2proc "$@"
