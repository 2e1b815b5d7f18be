"""What every memory estimate is made of: the dtypes it knows, a term, a rank's model states, the model on meta
(memory/estimate.py adds the step's terms; memory/pipeline.py a pipeline stage's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.config import TrainRunConfig
from isotrain.memory.shards import expert_parameter_names, local_numel, tp_split_dims
from isotrain.parallel.dims import ParallelDims

# The estimator's dtype choices: (parameter storage, compute) dtypes. float8 is the estimator's own option
# (1-byte weights + per-tensor fp32 scales, fp32 masters, bf16 compute); model.dtype has no float8 yet.
DTYPES = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.float32, torch.bfloat16),
    "float8": (torch.float8_e4m3fn, torch.bfloat16),
}
FP32_BYTES = torch.float32.itemsize


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str = ""


def model_state_terms(model, config, degrees: ParallelDims, dtype: str, tp_rank: int = 0,
                      shard_rank: int = 0) -> list[Term]:
    """Parameters, masters, gradients and AdamW moments of the rank at (tp_rank, shard_rank). A frozen parameter
    (requires_grad False: an encoder's unused pooler) has no gradient and no optimizer state."""
    storage, _ = DTYPES[dtype]
    split = tp_split_dims(model, config) if degrees.tp > 1 else {}
    # Measured: under TP the vocabulary-parallel embedding's gradient arrives whole on every TP rank (all
    # vocabulary rows, as a partial sum) and is split only by the update's redistribution.
    embedding = getattr(model.get_input_embeddings(), "weight", None)  # (a later pipeline stage has none)
    experts = expert_parameter_names(model)
    padded = unpadded = tensors = trained_tensors = grads = trained = 0
    for name, param in model.named_parameters():
        shape, expert = tuple(param.shape), name in experts
        local = local_numel(shape, split.get(name), degrees, tp_rank, shard_rank, padded=True, expert=expert)
        padded += local
        tensors += 1
        if not param.requires_grad:
            continue
        trained += local
        unpadded += local_numel(shape, split.get(name), degrees, tp_rank, shard_rank, padded=False, expert=expert)
        grad_split = None if param is embedding and not degrees.fsdp else split.get(name)
        grads += local_numel(shape, grad_split, degrees, tp_rank, shard_rank, padded=True, expert=expert)
        trained_tensors += 1
    low = storage.itemsize < FP32_BYTES
    frozen = f"; {padded - trained:,} frozen elements have none" if trained != padded else ""
    terms = [Term("parameters", padded * storage.itemsize + (tensors * FP32_BYTES if low else 0),
                  f"{padded:,} elements × {storage.itemsize} B" + (" + one fp32 scale per tensor" if low else "")),
             Term("fp32 master weights", padded * FP32_BYTES if low else 0,
                  "separate fp32 copy" if low else "the fp32 parameters are the masters"),
             Term("gradients", grads * FP32_BYTES,
                  "fp32" + ("; TP: the embedding's gradient is whole until the update" if grads != trained else "")
                  + frozen),
             Term("optimizer moments", unpadded * 2 * FP32_BYTES + trained_tensors * FP32_BYTES,
                  "AdamW exp_avg + exp_avg_sq fp32, step" + frozen)]
    return terms



def meta_model(cfg: TrainRunConfig, config):
    from transformers import AutoModelForCausalLM

    from isotrain.models.checks import attention_kernel

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=attention_kernel(cfg.model.attn_implementation,
                                                                                     config, AutoModelForCausalLM))
