"""Ring attention alone against causal SDPA over whole rows, on the ranks of one launch (gloo).

    ring_worker.py OUT.json [break=nolse|nodiagonal]

Every rank draws the same q, k, v and output weights (fp64), runs SDPA with the per-document causal mask of the
whole rows and its gradients, then ring attention on its zig-zag piece; the pieces' outputs and gradients are
gathered back into rows. Rank 0 writes the largest relative error of the output and of dq, dk, dv for each case:
heads 4 with 4, 2 and 1 KV heads, plain causal rows and packed rows (documents across the pieces). `break=` replaces
a part of the ring on purpose (the control: the errors must then be large): `nolse` merges the blocks' outputs
without their log-sum-exp weights, `nodiagonal` attends the diagonal block without its causal mask.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import isotrain.parallel.ring as ring
from isotrain.parallel.cp import document_ids, document_mask, piece_indices
from isotrain.parallel.dist import init_distributed, shutdown_distributed

BATCH, HEADS, HEAD_DIM = 2, 4, 8


def positions(length: int, packed: bool) -> torch.Tensor:
    """Row 0: one document; row 1 (packed): documents of 5, length - 12 and 7 tokens, so they cross pieces."""
    plain = torch.arange(length)
    if not packed:
        return torch.stack([plain, plain])
    docs = torch.cat([torch.arange(5), torch.arange(length - 12), torch.arange(7)])
    return torch.stack([plain, docs])


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def one_case(group, cp: int, rank: int, kv_heads: int, packed: bool, length: int) -> dict:
    generator = torch.Generator().manual_seed(kv_heads * 10 + packed)
    q = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(BATCH, kv_heads, length, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in "kv")
    weights = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=generator, dtype=torch.float64)
    position_ids = positions(length, packed)
    mask = document_mask(position_ids)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=kv_heads != HEADS)
    (expected * weights).sum().backward()

    pieces = piece_indices(length, cp, "ring")
    mine = pieces[rank]
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    documents = document_ids(position_ids)  # [B, L] -> every piece's tokens' documents [cp, B, L/cp]
    segments = None if documents is None else documents[:, pieces].transpose(0, 1)
    out = ring.ring_attention(*local, group, pieces, segments)
    (out * weights[:, :, mine]).sum().backward()
    errors = {}
    for name, got, ref in [("out", out.detach(), expected.detach()),
                           *((f"d{n}", t.grad, w.grad) for n, t, w in zip("qkv", local, whole))]:
        gathered = [torch.empty_like(got) for _ in range(cp)]
        dist.all_gather(gathered, got.contiguous(), group=group)
        rows = torch.empty_like(ref)
        for r in range(cp):
            rows[:, :, pieces[r]] = gathered[r]
        errors[name] = relative(rows, ref)
    return errors


def naive_merge(out, lse, block_out, block_lse):
    """The break: block outputs added as they are, without their log-sum-exp weights."""
    return out + block_out, torch.logaddexp(lse, block_lse)


def main() -> None:
    out_path, *flags = sys.argv[1:]
    info = init_distributed()
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    if "break=nolse" in flags:
        ring.merge = naive_merge
    if "break=nodiagonal" in flags:
        block = ring._block

        def unmasked_diagonal(pieces, segments, i, j, device):
            found = block(pieces, segments, i, j, device)
            return found if found is None or i != j else (*found[:2], None)

        ring._block = unmasked_diagonal
    results = {f"kv{kv}-{'packed' if packed else 'causal'}": one_case(group, cp, rank, kv, packed, 8 * cp)
               for kv in (4, 2, 1) for packed in (False, True)}
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
