"""`model.attn_implementation=varlen`: packed documents through flash attention's variable-length kernel.

With `sdpa`, a packed row of several documents gets a [B, 1, L, L] per-document mask from transformers, and
SDPA must take its memory-efficient kernel, which computes every masked block: on an H200, packed rows of
long-tailed documents trained 0.70 x the real tokens/s of full rows (docs/benchmarks.md). Here the rows of a
micro-batch are flattened into one sequence of B·L tokens cut at every document start (a position id that does
not go up by 1, and every row start), and `torch.nn.attention.varlen.varlen_attn` attends causally inside each
document only, computing no masked block.

The math is the mask's: each token attends to the tokens of its own document up to itself; padding continues
the last document, as for `sdpa`. Where the flash kernel does not run, the same cut is computed another way:
- a CUDA forward in fp32 without autocast (flash runs in bf16/fp16 only) takes SDPA with the mask transformers
  built, as `sdpa`; under bf16 autocast flash runs in bf16, as SDPA would;
- on CPU (no flash kernel) each document runs through SDPA on its own: slow, the reference the tests use;
- a forward that carries no document bounds (generation with a KV cache, a caller outside isotrain) is `sdpa`.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from isotrain.errors import ConfigError

# The name transformers knows the kernel by (model.config._attn_implementation); users write `varlen`.
NAME = "isotrain_varlen"
_BOUNDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); its masks are sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def check(config) -> None:
    """torch has the kernel, the model no sliding window and no attention dropout (the kernel does neither):
    refused before any work otherwise."""
    if not _HAS_VARLEN:
        raise ConfigError(f"model.attn_implementation=varlen needs torch.nn.attention.varlen, which torch "
                          f"{torch.__version__} does not have; upgrade torch or set model.attn_implementation=sdpa")
    if getattr(config, "sliding_window", None):
        raise ConfigError(f"model.attn_implementation=varlen attends to whole documents, and this "
                          f"{config.model_type} model has a sliding window of {config.sliding_window} tokens; set "
                          "model.attn_implementation=sdpa")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ConfigError(f"model.attn_implementation=varlen has no attention dropout, and this model's "
                          f"attention_dropout is {dropout}; set model.attn_implementation=sdpa or the model's "
                          "attention_dropout to 0")


def document_bounds(position_ids: torch.Tensor) -> dict:
    """Transformers' flash keyword arguments for the rows of `position_ids` [B, L] flattened into one sequence:
    cu_seq_lens (int32, the offsets of every document start and the end) and max_length. max_length is L, a
    bound rather than the longest document: one value per run, so a compiled layer is not recompiled for every
    micro-batch. Finding the starts (`nonzero`) waits for the device once per micro-batch."""
    rows, length = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::length] = True
    ends = torch.tensor([rows * length], device=flat.device)
    cu = torch.cat([starts.nonzero().flatten(), ends]).to(torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": length, "max_length_k": length}


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """transformers' attention interface: query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = {name: kwargs.pop(name, None) for name in _BOUNDS}
    cu = bounds["cu_seq_lens_q"]
    dtype = _flash_dtype(query)
    if cu is None or (query.is_cuda and dtype is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout > 0:
        raise ConfigError("model.attn_implementation=varlen has no attention dropout; set "
                          "model.attn_implementation=sdpa or the model's attention_dropout to 0")
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    if dtype is not None:
        out = _flash(q.to(dtype), k.to(dtype), v.to(dtype), cu, bounds["max_length_q"], scaling)
    else:
        out = _per_document(q, k, v, cu, scaling)
    return out.reshape(batch, length, heads, dim), None


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype flash runs this CUDA query in, or None. Under autocast the query is often fp32 (RoPE
    multiplies it by fp32 cos/sin of the fp32 residual stream) while SDPA would run it in the autocast dtype:
    flash takes that dtype too."""
    if not query.is_cuda:
        return None
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    else:
        dtype = query.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _flash(q, k, v, cu, max_length: int, scaling):
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if k.shape[1] != q.shape[1]:
        if _VARLEN_GQA:
            extra["enable_gqa"] = True
        else:  # torch before enable_gqa: the KV heads repeated, as transformers' repeat_kv does
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_length, max_length, scale=scaling, window_size=(-1, 0), **extra)


def _per_document(q, k, v, cu, scaling):
    """The reference: causal SDPA over each document alone ([T, H, D] in and out)."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if end == start:
            continue
        piece = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(*piece, is_causal=True, scale=scaling,
                                                        enable_gqa=gqa)[0].transpose(0, 1)
    return out


def _signature() -> inspect.Signature | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return inspect.signature(varlen_attn)


_SIGNATURE = _signature()
_HAS_VARLEN = _SIGNATURE is not None
_VARLEN_GQA = _HAS_VARLEN and "enable_gqa" in _SIGNATURE.parameters
