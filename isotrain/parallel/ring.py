"""Ring attention: each of the `cp` ranks keeps its queries, and the key/value blocks travel around the ring.

    rank r holds q_r, k_r, v_r (its piece of every row, all heads; `pieces[r]` are their global token indices)
    step s = 0 .. cp-1:  the block held is rank j = r - s's (mod cp); send it to rank r+1, receive rank r-1's,
                         and meanwhile attend q_r to (k_j, v_j) under the mask of the global indices
    merge: with o_s, lse_s the block's softmax-normalised output and log-sum-exp (per query row),
           lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s - lse) · o_s
which is the softmax over the whole row written in blocks, exactly (fp32 for bf16/fp16 inputs, else the input
dtype: the merge of fp64 inputs is fp64).

Masks come from global token indices, so any split of the rows works: key j is attended by query i when
index(j) <= index(i) and, for packed rows, both lie in the same document (`segments`, from the whole rows). A block
with no allowed pair (entirely in the future) is not computed, and only the query rows and key columns that take
part in a block enter its matmuls. With the zig-zag split (parallel/cp.py: rank r holds chunks r and 2cp-1-r of
2cp) every rank then does the same work for causal attention: the diagonal block is causally masked, a block from
an earlier rank is half its keys, one from a later rank half its queries.

Backward: a custom autograd Function that recomputes each block from the saved q, k, v, the merged output and
log-sum-exp (flash attention's scheme; no [L, L] score matrix is kept). With P = exp(q·kᵀ·scale - lse) (masked
entries 0) and Δ = rowsum(dO ∘ O):  dV = Pᵀ dO,  dS = P ∘ (dO Vᵀ - Δ),  dQ = dS K · scale,  dK = dSᵀ Q · scale.
dQ stays on its rank; the gradients of a key/value block travel with it, each rank adding its queries' share:
after cp - 1 steps every rank has added to a block, and one last send brings dK, dV home. So the gradient of
every rank's loss reaches every key and value, as the all-to-all's backward does for Ulysses.

Grouped-query heads are never repeated: the q heads of one KV head attend it together ([B, Hkv, g, S, D]), and
only the Hkv key/value heads travel, which is why ring attention has no condition on the head count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 at least for the scores, the softmax and the merge (bf16 inputs are merged in fp32; fp64 stays)."""
    return torch.promote_types(dtype, torch.float32)


class _Ring:
    """Point-to-point exchange with the ring's neighbours: send to rank r+1, receive from rank r-1."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: torch.Tensor, tag: int = 0):
        """Send `tensor` on and receive the previous rank's tensor of the same shape; returns (received, works).
        One batch of both (NCCL then groups them, so two ranks that send to each other cannot block)."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return received, works

    @staticmethod
    def finish(works) -> None:
        for work in works:
            work.wait()


def _block(pieces: torch.Tensor, segments, i: int, j: int, device: torch.device):
    """(rows, cols, mask) of rank i's queries against rank j's keys: the slice of query rows and the slice of key
    columns that take part (None when no pair is causally allowed: the block is skipped), and the mask of those
    [B or 1, 1, 1, rows, cols] on `device`, or None when every pair is allowed. `pieces` [cp, S] (on the CPU: the
    slices are found without a device sync) increase within a piece (parallel/cp.py), so the rows that attend
    anything are a suffix of the piece and the keys attended by anyone a prefix."""
    q_index, k_index = pieces[i], pieces[j]
    first_row = int(torch.searchsorted(q_index, k_index[0]))  # rows before it precede every key of the block
    if first_row == q_index.numel():
        return None
    num_cols = int(torch.searchsorted(k_index, q_index[-1], right=True))  # keys after them follow every query
    rows, cols = slice(first_row, None), slice(0, num_cols)
    causal = k_index[cols][None, :] <= q_index[rows][:, None]
    mask = None if bool(causal.all()) else causal.to(device)[None]
    if segments is not None:  # documents [cp, B, S] of every piece's tokens
        same = segments[i][:, rows, None] == segments[j][:, None, cols]
        mask = same if mask is None else same & mask
    return rows, cols, (None if mask is None else mask[:, None, None])


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """q5 [B, Hkv, g, S, D] · k [B, Hkv, T, D]ᵀ · scale -> [B, Hkv, g, S, T], masked entries -inf."""
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that attends nothing) replaced by 0, so exp(x - lse) is 0, never NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _forward_block(q5, k, v, scale, mask):
    """One block's normalised output [B, Hkv, g, S, D] and log-sum-exp [B, Hkv, g, S] (rows that attend
    nothing: output 0, lse -inf)."""
    scores = _scores(q5, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v.unsqueeze(2)), lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The softmax over the keys of both parts from each part's normalised output and log-sum-exp:
    lse' = log(e^lse + e^lse_b),  out' = e^(lse - lse')·out + e^(lse_b - lse')·out_b (a part that attends nothing
    has lse -inf and weighs 0)."""
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1),
            merged)


def _backward_block(q5, do5, k, v, lse, delta, scale, mask):
    """One block's share of the gradients: dq [B, Hkv, g, S, D], dk and dv [B, Hkv, T, D] (the q heads of a KV
    head summed), from the merged lse and Δ = rowsum(dO ∘ O) [B, Hkv, g, S]."""
    k5, v5 = k.unsqueeze(2), v.unsqueeze(2)
    probs = torch.exp(_scores(q5, k, scale, mask) - lse.unsqueeze(-1))
    dscores = probs * (torch.matmul(do5, v5.transpose(-1, -2)) - delta.unsqueeze(-1))
    return (torch.matmul(dscores, k5) * scale, torch.matmul(dscores.transpose(-1, -2), q5).sum(2) * scale,
            torch.matmul(probs.transpose(-1, -2), do5).sum(2))


def _ring_forward(ring: _Ring, q5, k, v, pieces, segments, scale):
    """The merged output and log-sum-exp [B, Hkv, g, S(, D)] of this rank's queries q5 over every rank's block."""
    dtype = q5.dtype
    out = torch.zeros(q5.shape, dtype=dtype, device=q5.device)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=dtype, device=q5.device)
    kv = torch.stack([k, v]).contiguous()
    for step in range(ring.size):
        works = None
        if step < ring.size - 1:  # the next block travels while this one is computed
            received, works = ring.start(kv)
        j = (ring.rank - step) % ring.size
        block = _block(pieces, segments, ring.rank, j, q5.device)
        if block is not None:
            rows, cols, mask = block
            o_b, lse_b = _forward_block(q5[..., rows, :], kv[0, :, :, cols].to(dtype), kv[1, :, :, cols].to(dtype),
                                        scale, mask)
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o_b, lse_b)
        if works is not None:
            _Ring.finish(works)
            kv = received
    return out, lse


def _ring_backward(ring: _Ring, q5, k, v, out, lse, do5, pieces, segments, scale):
    """dq5 of this rank's queries, and dk, dv of its own block, summed over every rank's queries."""
    dtype = out.dtype
    delta, lse = (do5 * out).sum(-1), _finite(lse)
    dq5 = torch.zeros_like(out)
    kv = torch.stack([k, v]).contiguous()
    grads = torch.zeros(kv.shape, dtype=dtype, device=kv.device)  # (dk, dv) of the block held, travelling with it
    for step in range(ring.size):
        kv_works = None
        if step < ring.size - 1:  # the next block travels while this one is computed (its gradients cannot)
            kv_received, kv_works = ring.start(kv, tag=0)
        j = (ring.rank - step) % ring.size
        block = _block(pieces, segments, ring.rank, j, q5.device)
        if block is not None:
            rows, cols, mask = block
            dq, dk, dv = _backward_block(q5[..., rows, :], do5[..., rows, :], kv[0, :, :, cols].to(dtype),
                                         kv[1, :, :, cols].to(dtype), lse[..., rows], delta[..., rows], scale, mask)
            dq5[..., rows, :] += dq
            grads[0, :, :, cols] += dk
            grads[1, :, :, cols] += dv
        # the gradients follow their block; the last send brings them home to the block's own rank
        received, works = ring.start(grads, tag=1)
        _Ring.finish(works)
        grads = received
        if kv_works is not None:
            _Ring.finish(kv_works)
            kv = kv_received
    return dq5, grads[0], grads[1]


class RingAttention(torch.autograd.Function):
    """q [B, H, S, D], k/v [B, Hkv, S, D] of this rank's piece -> out [B, H, S, D] (see the module docstring).
    Autocast is off inside: the scores, softmax and merge stay in `compute_dtype` whatever the region asks."""

    @staticmethod
    def forward(ctx, q, k, v, group, pieces, segments, scale):
        b, heads, s, d = q.shape
        with torch.autocast(q.device.type, enabled=False):
            # the q heads of each KV head together: [B, Hkv, g, S, D]
            q5 = q.to(compute_dtype(q.dtype)).reshape(b, k.shape[1], heads // k.shape[1], s, d)
            out, lse = _ring_forward(_Ring(group), q5, k, v, pieces, segments, scale)
        ctx.save_for_backward(q, k, v, out, lse, pieces, segments)
        ctx.group, ctx.scale = group, scale
        return out.reshape(b, heads, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, pieces, segments = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            q5, do5 = (t.to(out.dtype).reshape(out.shape) for t in (q, grad_out))
            dq5, dk, dv = _ring_backward(_Ring(ctx.group), q5, k, v, out, lse, do5, pieces, segments, ctx.scale)
        return dq5.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, pieces: torch.Tensor,
                   segments: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of rows split over the ranks of `group`: query [B, H, S, D], key/value [B, Hkv, S, D] of
    this rank's piece -> [B, H, S, D]. `pieces` [cp, S] (CPU): the global token index of every rank's piece,
    increasing within each; `segments` [cp, B, S] (on the device): the document of every token of every rank's
    piece (packed rows), or None for plain causal attention."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(query, key, value, group, pieces, segments, scale)
