"""Context parallelism: each of the `cp` ranks of a DP rank runs one piece of every sequence of a micro-batch, and
attention reaches across the pieces in one of two styles (parallel.cp_style).

Ulysses (`ulysses`): contiguous pieces, heads exchanged for sequence with two all-to-alls.

    piece r of a row of L tokens (padded to a multiple of cp): tokens [r·L/cp, (r+1)·L/cp)
    attention on rank r:  q, k, v [B, H, L/cp, D]  --all-to-all-->  [B, H/cp, L, D]  (heads r·H/cp ...)
                          causal SDPA over the whole sequence for those heads (per document when packed)
                          out [B, H/cp, L, D]  --all-to-all-->  [B, H, L/cp, D]

Ring (`ring`, parallel/ring.py): zig-zag pieces, key/value blocks passed around the ranks.

    rows padded to a multiple of 2·cp and cut into 2·cp chunks; rank r holds chunks r and 2·cp-1-r
    attention on rank r:  its q [B, H, L/cp, D] against every rank's k, v block in turn (cp - 1 sends),
                          the blocks' partial softmaxes merged by log-sum-exp; masks from global token indices

Everything outside attention is per token (embeddings, norms, MLP, RoPE with the piece's own position ids, the
head and the cross-entropy of pre-shifted labels), so any split changes no token's computation as long as input
ids, labels, position ids and loss weights are cut alike (`local_piece`, `piece_indices`). Ulysses sees the whole
sequence for its heads, so a contiguous split costs it nothing; ring attention skips the blocks in a rank's causal
future, so contiguous pieces would leave the last rank with cp blocks and the first with one, hence the zig-zag
(each rank pairs an early chunk with a late one: the same work on every rank). Under Ulysses, key/value heads
fewer than `cp` are repeated first (`cp` a multiple of them, checked in parallel/dims.py), so each rank receives
the KV head its query heads use; autograd sums the copies' gradients back. Ring attention keeps every head, so
any `cp` works (more ranks than heads included). Under TP, both run on the heads of their TP rank.

The backward of an all-to-all is the reverse all-to-all (`_AllToAll`), and ring attention sends each block's
dK, dV around the ring back home; both carry the gradient of the other ranks' losses into this rank's q/k/v, so a
replicated weight's gradient is the sum over the CP ranks of their parts (parallel/mesh.py: CP joins the
data-parallel gradient reduction).

The exchange happens only inside `context_parallel_attention(...)`, which the step enters around each micro-batch's
forward and backward (the recompute of activation checkpointing runs in the backward). Outside it, the registered
attention is plain SDPA over whatever the rank holds: the packing probe and evaluation run whole sequences.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isotrain.parallel.ring import ring_attention

NAME = "isotrain_ulysses"  # the transformers attention implementation a CP model runs (either style: a stable name)

IGNORE_INDEX = -100
_SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")


class _Active(threading.local):
    group = None  # the CP group while a CP micro-batch runs
    mask = None  # Ulysses: [B, 1, L, L] per-document causal mask of the whole rows, or None: plain causal
    pieces = None  # ring: [cp, L/cp] the global token indices of every rank's piece, on the CPU (None: Ulysses)
    segments = None  # ring: [cp, B, L/cp] the document of every token of every rank's piece, or None: plain causal


_active = _Active()


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut `x` into `cp` chunks along `scatter_dim`, send chunk j to rank j, and concatenate what every rank sent
    this one along `gather_dim`, in rank order."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with autograd: the gradient goes back by the reverse exchange (gather and scatter swapped)."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, L/cp, D] (this rank's piece, every head) -> [B, H/cp, L, D] (this rank's heads, the whole rows)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse: [B, H/cp, L, D] -> [B, H, L/cp, D]."""
    return _AllToAll.apply(x, group, 2, 1)


def ulysses_attention(query, key, value, group, mask: torch.Tensor | None = None, dropout: float = 0.0,
                      scaling: float | None = None) -> torch.Tensor:
    """Causal attention of the rows that the CP ranks of `group` hold in pieces: query [B, H, L/cp, D], key/value
    [B, Hkv, L/cp, D] -> [B, H, L/cp, D]. `mask`: [B, 1, L, L] boolean (True attends) over the whole rows, or None
    for plain causal attention."""
    cp = dist.get_world_size(group)
    if key.shape[1] % cp:  # fewer KV heads than ranks: rank r's query heads all read KV head r // (cp / Hkv)
        repeats = cp // key.shape[1]
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    q, k, v = (sequence_to_heads(t.contiguous(), group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                         scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return heads_to_sequence(out, group)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """transformers' attention interface: query [B, H, L/cp, D], key/value [B, Hkv, L/cp, D] ->
    ([B, L/cp, H, D], None). The mask transformers built for the piece alone is not used: causality and document
    bounds come from the whole rows (`context_parallel_attention`)."""
    if _active.group is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if _active.pieces is not None:  # dropout: refused with the ring style (parallel/dims.py)
        out = ring_attention(query, key, value, _active.group, _active.pieces, _active.segments, scaling)
    else:
        out = ulysses_attention(query, key, value, _active.group, _active.mask, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); its masks are sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def apply_cp(model: torch.nn.Module) -> None:
    """Run the model's attention through NAME (the SDPA the model was built with, sequence-parallel inside
    `context_parallel_attention`). The config object is shared by every module of a transformers model."""
    model.config._attn_implementation = register()


def padded_length(length: int, cp: int, style: str = "ulysses") -> int:
    """Rows are padded to a multiple of cp (Ulysses: cp pieces) or 2·cp (ring: 2·cp chunks, two per rank)."""
    chunks = 2 * cp if style == "ring" else cp
    return -(-length // chunks) * chunks


def piece_indices(length: int, cp: int, style: str = "ulysses") -> torch.Tensor:
    """[cp, length / cp]: the positions in the (padded) rows of every rank's piece, increasing within a piece.
    Ulysses: contiguous pieces. Ring: zig-zag, rank r holds chunks r and 2·cp-1-r of 2·cp, so that every rank
    attends causally to as many keys as every other (an early chunk paired with a late one)."""
    if style != "ring":
        return torch.arange(length).view(cp, length // cp)
    chunks = torch.arange(length).view(2 * cp, length // (2 * cp))
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, L] the index of every token's document in its row (a document starts wherever a position id does not go
    up by 1, transformers' rule), or None when no row holds more than one document (plain causal)."""
    starts = torch.diff(position_ids, dim=-1) != 1
    if not bool(starts.any()):
        return None
    return torch.cat([torch.zeros_like(position_ids[:, :1]), starts.cumsum(-1)], dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, L, L] causal mask within the documents of whole rows (`document_ids`), or None (plain causal)."""
    segments = document_ids(position_ids)
    if segments is None:
        return None
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def pad_rows(tensor: torch.Tensor, length: int, fill) -> torch.Tensor:
    """`tensor` [B, L, ...] extended to `length` along dim 1 with `fill`; position ids (fill=None) continue each
    row's count, so the padding belongs to the last document, as collate's does."""
    extra = length - tensor.shape[1]
    if extra == 0:
        return tensor
    if fill is None:
        tail = tensor[:, -1:] + torch.arange(1, extra + 1, device=tensor.device, dtype=tensor.dtype)
    else:
        tail = torch.full((tensor.shape[0], extra, *tensor.shape[2:]), fill, dtype=tensor.dtype,
                          device=tensor.device)
    return torch.cat([tensor, tail], dim=1)


_FILL = {"input_ids": 0, "labels": IGNORE_INDEX, "position_ids": None, "segment_ids": -1}


def pad_micro_batch(mb: dict, length: int) -> dict:
    """`mb` with its sequence tensors (those it has) right-padded to `length` as collate pads (label -100: trains
    nothing; at the end of a row no real token attends to it); its counts are those of the real tokens, unchanged."""
    padded = dict(mb)
    for key in _SEQUENCE_KEYS:
        if key in mb:
            padded[key] = pad_rows(mb[key], length, _FILL[key])
    return padded


def local_piece(mb: dict, cp_rank: int, cp: int, weights: torch.Tensor | None = None,
                style: str = "ulysses") -> tuple[dict, torch.Tensor]:
    """This rank's piece of micro-batch `mb` (its sequence tensors padded by `padded_length`, then cut by
    `piece_indices`) and of its per-token loss `weights`, which the caller computed on the whole rows (a
    sequence-mean weight 1/n_s counts the document's tokens in every piece). Input ids, labels (pre-shifted),
    position ids and weights are cut alike, so every token keeps its own label and position. Padding trains nothing
    (label -100, weight 0) and, at the end of a row, is attended by no real token. Other entries of `mb` are kept as
    they are (counts of the whole rows)."""
    piece = dict(mb)
    for key in _SEQUENCE_KEYS:
        piece[key] = cut_rows(mb[key], cp_rank, cp, style, _FILL[key])
    if weights is not None:
        weights = cut_rows(weights, cp_rank, cp, style, 0)
    return piece, weights


def cut_rows(tensor: torch.Tensor, cp_rank: int, cp: int, style: str, fill) -> torch.Tensor:
    """[B, L, ...] -> [B, padded_length(L) / cp, ...]: rank `cp_rank`'s piece of whole rows, padded with `fill` first
    (None: position ids, which continue each row's count)."""
    length = padded_length(tensor.shape[1], cp, style)
    index = piece_indices(length, cp, style)[cp_rank]
    return pad_rows(tensor, length, fill).index_select(1, index.to(tensor.device))


def whole_rows(piece: torch.Tensor, group, length: int, style: str) -> torch.Tensor:
    """The inverse of `cut_rows` for values without gradient: every CP rank's piece [B, S, ...] gathered over
    `group` and put back in place, the padding dropped -> [B, length, ...], the same on every rank of the group."""
    cp = dist.get_world_size(group)
    pieces = [torch.empty_like(piece) for _ in range(cp)]
    dist.all_gather(pieces, piece.contiguous(), group=group)
    index = piece_indices(piece.shape[1] * cp, cp, style).flatten().to(piece.device)
    rows = torch.empty((piece.shape[0], piece.shape[1] * cp, *piece.shape[2:]), dtype=piece.dtype,
                       device=piece.device)
    rows[:, index] = torch.cat(pieces, dim=1)
    return rows[:, :length]


@contextlib.contextmanager
def context_parallel_attention(group, position_ids: torch.Tensor | None, style: str = "ulysses"):
    """Inside: NAME attention runs over `group` in `style` (Ulysses exchanges heads, ring passes key/value blocks),
    attending causally within the documents of the whole rows whose position ids are `position_ids` [B, L]
    (already padded by `padded_length`). group None: nothing."""
    if group is None:
        yield
        return
    previous = (_active.group, _active.mask, _active.pieces, _active.segments)
    if style == "ring":
        pieces = piece_indices(position_ids.shape[1], dist.get_world_size(group), style)
        documents = document_ids(position_ids)
        _active.group, _active.mask, _active.pieces = group, None, pieces
        _active.segments = None if documents is None else documents[:, pieces.to(documents.device)].transpose(0, 1)
    else:
        _active.group, _active.mask, _active.pieces, _active.segments = group, document_mask(position_ids), None, None
    try:
        yield
    finally:
        _active.group, _active.mask, _active.pieces, _active.segments = previous
