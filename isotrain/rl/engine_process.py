"""A rollout engine in a separate process: the weight-sync path an external engine (vLLM, SGLang) uses.

The child process ("spawn", so it shares nothing with the trainer but what we send) builds the
model from its config alone and refuses to generate until it has received every weight through
`update_weights` — exactly like a server that starts empty and is fed the trainer's weights.

Transport: commands and results are pickled over a `multiprocessing.Pipe`. Weight tensors cross
in torch shared memory: the parent copies each tensor once into a fresh shared-memory buffer
(never sharing the caller's own storage), torch's pickler sends a handle instead of the bytes,
and the child copies from the buffer into its parameters. Tensors go in buckets of at most
`bucket_bytes`, each acknowledged before the next, so shared memory never holds more than one
bucket.

Reproducibility: before the k-th generate call (k = 0, 1, ...) the child seeds torch's RNG with
`seed + k`, so a run with the same seed and the same calls samples the same rollouts. The child
computes with the caller's thread count unless told otherwise: a CPU matmul's rounding depends on
how its rows are split among threads (MKL's sgemm, torch 2.13 and 2.14 alike, rounds the rows past
the last multiple of 4 of a 5- to 11-row batch differently with 1 and 2 threads), so the thread
count is part of what makes the child's log-probs those of an in-process engine, bit for bit.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from isotrain.rl.rollout import Rollout, SamplingParams

_DEFAULT_BUCKET_BYTES = 256 * 2**20
_MAX_TENSORS_PER_BUCKET = 128  # each shared tensor is an open file descriptor while in flight
_CHILD_OPS = ("generate", "update_weights", "checksums", "release_memory")


class ProcessEngine:
    """`RolloutEngine` backed by an `HFEngine` in a child process."""

    def __init__(
        self,
        config: PretrainedConfig,
        tokenizer_dir: str | Path,
        seed: int = 0,
        batch_size: int = 64,
        num_threads: int | None = None,
        timeout_s: float = 600.0,
        bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
    ):
        if num_threads is None:
            num_threads = torch.get_num_threads()  # a spawned child starts at torch's default, not the caller's
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._timeout_s = timeout_s
        self._bucket_bytes = bucket_bytes
        # daemon: the engine dies with the trainer, never outlives it as an orphan.
        self._process = ctx.Process(
            target=_child_main,
            args=(child_conn, config, str(tokenizer_dir), seed, batch_size, num_threads),
            daemon=True,
            name="isotrain-rollout-engine",
        )
        self._process.start()
        child_conn.close()  # the parent keeps only its end, so a dead child shows up as EOF
        self._receive("start")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollout:
        return self._call("generate", [list(map(int, p)) for p in prompt_ids], params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the tensors in acknowledged buckets; a failure on either side leaves the child stale.

        The child marks everything stale itself when it rejects a tensor; when the caller's
        iterator fails half-way, the child's weights are released, so that a half-sent update
        never produces rollouts.
        """
        bucket, size = [], 0
        for name, tensor in self._released_on_error(named_tensors):
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self._bucket_bytes or len(bucket) >= _MAX_TENSORS_PER_BUCKET:
                self._call("update_weights", bucket)
                bucket, size = [], 0
        if bucket:
            self._call("update_weights", bucket)

    def _released_on_error(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """The caller's tensors; if producing one fails, the child's weights are released first."""
        try:
            for name, tensor in named_tensors:
                yield name, _shared_copy(tensor)
        except (Exception, KeyboardInterrupt):
            if self._process.is_alive():
                with contextlib.suppress(RuntimeError):
                    self._call("release_memory")
            raise

    def checksums(self) -> dict[str, str]:
        return self._call("checksums")

    def release_memory(self) -> None:
        self._call("release_memory")

    def close(self) -> None:
        """Ask the child to exit; terminate it if it does not within a few seconds. Idempotent."""
        if self._process.is_alive():
            try:
                self._conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, op: str, *args):
        if self._conn.closed:
            raise RuntimeError(f"rollout engine process: {op} called after close()")
        self._check_alive(op)
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, ConnectionResetError):
            self._raise_dead(op)
        return self._receive(op)

    def _receive(self, op: str):
        # Poll in short slices so that a child that dies mid-call is reported at once.
        waited_s = 0.0
        while not self._conn.poll(0.1):
            waited_s += 0.1
            self._check_alive(op)
            if waited_s > self._timeout_s:
                raise RuntimeError(f"rollout engine process: no answer to {op} within {self._timeout_s:.0f} s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, ConnectionResetError):
            self._raise_dead(op)
        if status == "error":
            raise RuntimeError(f"rollout engine process failed in {op}: {payload}")
        return payload

    def _check_alive(self, op: str) -> None:
        if not self._process.is_alive() and not self._conn.poll():
            self._raise_dead(op)

    def _raise_dead(self, op: str):
        self._process.join(timeout=1)
        raise RuntimeError(
            f"rollout engine process (pid {self._process.pid}) is dead (exit code {self._process.exitcode}) "
            f"during {op}; create a new engine and send the weights again"
        )


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """One copy of `tensor` into fresh CPU shared memory; pickling it then sends a handle, not bytes."""
    if hasattr(tensor, "full_tensor"):
        raise ValueError("ProcessEngine.update_weights needs full tensors; use sync_named_tensors(model)")
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    return buffer.copy_(tensor.detach())


def _child_main(conn, config, tokenizer_dir: str, seed: int, batch_size: int, num_threads: int) -> None:
    """The child's loop: one (op, args) message in, one ("ok", result) or ("error", text) out."""
    try:
        engine = _build_engine(config, tokenizer_dir, batch_size, num_threads)
    except BaseException as err:  # reported to the parent, which raises it as a RuntimeError
        conn.send(("error", _describe(err)))
        return
    conn.send(("ok", None))
    num_generate_calls = 0
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return  # the parent is gone
        if op == "close":
            engine.close()
            return
        try:
            if op not in _CHILD_OPS:
                raise ValueError(f"unknown engine operation {op!r}; expected one of {_CHILD_OPS}")
            if op == "generate":
                # A call seed (SamplingParams.seed) takes over inside HFEngine.generate.
                torch.manual_seed(seed + num_generate_calls)
                num_generate_calls += 1
            result = getattr(engine, op)(*args)
            del args  # drop the shared-memory handles before acknowledging, so the parent can free them
            conn.send(("ok", result))
        except Exception as err:
            conn.send(("error", _describe(err)))


def _build_engine(config, tokenizer_dir: str, batch_size: int, num_threads: int):
    # Imported here: the spawned child imports only what it needs, after choosing its thread count.
    torch.set_num_threads(num_threads)
    from isotrain.models.tokenizer import load_tokenizer
    from isotrain.rl.rollout import HFEngine

    return HFEngine.from_config(config, load_tokenizer(tokenizer_dir), batch_size)


def _describe(err: BaseException) -> str:
    """The child's error as one message; the last traceback frame says where it happened."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"
