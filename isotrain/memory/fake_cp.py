"""Context parallelism in the fake forward: one rank's piece of every row through the run's own CP attention
(parallel/cp.py, parallel/ring.py), with the collectives answered on this one process.

A CP rank runs padded_length(L, cp, style) / cp tokens of every row: every per-token tensor (embeddings, norms,
MLP, head, loss) shrinks by cp, and attention is the style's own code, so what it saves is what the real rank saves:

- Ulysses: the all-to-alls hand SDPA q, k, v of heads / cp over the whole rows ([B, H/cp, L, D], the same
  elements as the piece's [B, H, L/cp, D]; fewer KV heads than cp are repeated first), and SDPA saves them, its
  output and log-sum-exp; the all-to-all itself saves nothing;
- ring: `RingAttention` saves q, k, v of the piece, the merged output in fp32 at least ([B, Hkv, g, L/cp, D]), its
  log-sum-exp, and the piece indices (and document ids of packed rows); its backward recomputes each block.

The exchanges' buffers live only while attention runs (`ExchangeBuffers`): an all-to-all's send and receive
buffers (the largest is q's or the output's, [B, H, L/cp, D]); ring attention's key/value block held and the one
arriving, and in backward the block's travelling dK, dV and the ones arriving beside them (fp32 at least).
Here the collectives move nothing: `_OneProcess` answers the world size and leaves the receive buffers as they are
(fake tensors have no values), recording their sizes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers.masking_utils import find_packed_sequence_indices as _FIND_PACKED


@dataclass
class ExchangeBuffers:
    """The largest bytes a CP rank's exchanges hold at once: the send and receive buffers of one all-to-all
    (Ulysses), or the ring's blocks in flight in its backward (ring)."""
    bytes: int = 0


class _OneProcess:
    """The part of torch.distributed that parallel/cp.py and parallel/ring.py call, on one process standing for rank
    0 of a CP group of `cp` ranks."""

    def __init__(self, cp: int, buffers: ExchangeBuffers):
        self.cp, self.buffers = cp, buffers
        self.isend, self.irecv = "isend", "irecv"

    def get_world_size(self, group=None) -> int:
        return self.cp

    def get_rank(self, group=None) -> int:
        return 0

    def get_global_rank(self, group, rank: int) -> int:
        return rank

    def all_to_all_single(self, output, input, group=None):
        # (backward's exchanges are of the forward's shapes and dtypes: the same bytes)
        self.buffers.bytes = max(self.buffers.bytes, output.nbytes + input.nbytes)

    @staticmethod
    def P2POp(op, tensor, peer, group=None, tag=0):  # noqa: N802 (torch's name)
        return op, tensor

    def batch_isend_irecv(self, ops) -> list:
        from isotrain.parallel.ring import compute_dtype

        # The forward sends the stacked key/value block; backward holds it and the one arriving beside the block's
        # gradients (fp32 at least) and the ones arriving (parallel/ring.py `_ring_backward`).
        kv = ops[0][1]
        grads = kv.numel() * compute_dtype(kv.dtype).itemsize
        self.buffers.bytes = max(self.buffers.bytes, 2 * kv.nbytes + 2 * grads)
        return []


@contextlib.contextmanager
def context_parallel_on_one_process(model, cp: int, style: str, micro_batch_size: int, seq_len: int):
    """Inside: `model` (built under FakeTensorMode) attends as rank 0 of `cp` CP ranks in `style` over rows of
    `seq_len` tokens (before padding), and yields the ExchangeBuffers its forward records. The piece indices are
    real tensors (ring attention reads them to skip blocks), as on a real rank."""
    import isotrain.parallel.cp as cp_module
    import isotrain.parallel.ring as ring_module

    buffers = ExchangeBuffers()
    shim = _OneProcess(cp, buffers)
    originals = cp_module.dist, ring_module.dist, ring_module._block
    block = ring_module._block

    def real_block(*args, **kwargs):  # which block is skipped is read off the real piece indices
        with unset_fake_temporarily():
            return block(*args, **kwargs)

    cp_module.dist = ring_module.dist = shim
    ring_module._block = real_block
    cp_module.apply_cp(model)
    try:
        with contextlib.ExitStack() as stack:
            with unset_fake_temporarily():
                length = cp_module.padded_length(seq_len, cp, style)
                positions = torch.arange(length).expand(micro_batch_size, length)
                stack.enter_context(cp_module.context_parallel_attention(object(), positions, style))
                piece = positions[:, cp_module.piece_indices(length, cp, style)[0]]
            stack.enter_context(_documents_of(piece))
            yield buffers
    finally:
        cp_module.dist, ring_module.dist, ring_module._block = originals


@contextlib.contextmanager
def _documents_of(piece: torch.Tensor):
    """transformers reads the rank's piece position ids as it reads any: ring's rank 0 holds chunks 0 and 2·cp-1,
    whose positions jump, so transformers takes them for two documents and builds a [B, 1, S, S] mask that the
    layers receive (and checkpointing keeps), although CP attention masks by global indices instead. Fake position
    ids cannot be read: the answer for the real piece's stands in."""
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices  # (fake_forward may have replaced it already)
    with unset_fake_temporarily():
        answer = _FIND_PACKED(piece)
    masking.find_packed_sequence_indices = lambda position_ids: answer
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def piece_length(seq_len: int, cp: int, style: str) -> int:
    """Tokens of a row on one CP rank: the padded row's share."""
    from isotrain.parallel.cp import padded_length

    return padded_length(seq_len, cp, style) // cp
