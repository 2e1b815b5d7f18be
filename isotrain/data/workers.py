"""Where the chunks of a corpus are tokenized while it is prepared (data/dataset.py build_store), and how many are
held at once.

    threads     text and prompt_completion: one worker thread tokenizes the next chunk while the caller writes the
                last one (the Rust tokenizer encodes a batch on its own threads, without the GIL).
    processes   chat: rendering a Jinja chat template is Python and holds the GIL, so chunks go to `workers`
                processes forked from this one, at most 2 per worker in flight.

Either way the caller gets, in chunk order, exactly what `work(chunk)` returns in this process (the same function
on the same chunk), and memory holds a bounded number of chunks, whatever the corpus's size: 2 with the thread,
2 × workers (each in its worker's memory) plus the one being written with processes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from itertools import chain, islice

_WORK: Callable | None = None  # the forked workers' task, inherited from the parent at fork time


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which a job scheduler sets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_workers(configured: int | None) -> int:
    """`data.prepare_workers`, or the available cores when unset."""
    return available_cores() if configured is None else configured


def tokenized_in_order(work: Callable, chunks: Iterable, processes: int) -> Iterator[tuple[object, object]]:
    """(chunk, work(chunk)) for each chunk, in order: in `processes` forked processes when > 1 and there are several
    chunks, else one chunk ahead in a thread (module docstring)."""
    chunks = iter(chunks)
    head = list(islice(chunks, 2))
    chunks = chain(head, chunks)
    if processes <= 1 or len(head) < 2:  # one chunk: forking would only add the workers' start
        with ThreadPoolExecutor(1, thread_name_prefix="isotrain-tokenize") as pool:
            yield from _ahead(pool, work, chunks, 1)
        return
    with _forked_pool(work, processes) as pool:
        yield from _ahead(pool, _run, chunks, 2 * processes)


def release_freed_memory() -> None:
    """Give the memory that this process has freed back to the system, in every malloc arena (glibc's malloc_trim;
    elsewhere nothing). A chunk's encoding is freed once its ids are out, but glibc keeps it, resident, in the arena
    of the tokenizer thread that made it: one thread per core, each keeping the largest chunk it ever encoded, so the
    peak would climb each time a long document lands on a thread that had not encoded one yet."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL(None).malloc_trim
            _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc
            _TRIM = False
    return _TRIM or None


_TRIM = None


def _run(chunk):
    return _WORK(chunk)


def _end_with(parent: int) -> None:
    """A worker's first act: end when the run's process does, even by SIGKILL (Linux), rather than live on with
    the chunk it was given."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the run ended before the line above
        os._exit(1)


def _ahead(pool: Executor, work: Callable, chunks: Iterable, depth: int) -> Iterator[tuple[object, object]]:
    """(chunk, work(chunk)) in order, with up to `depth` chunks submitted beyond the one the consumer holds."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk, pool.submit(work, chunk)))
        if len(pending) > depth:
            chunk, future = pending.popleft()
            yield chunk, future.result()
    while pending:
        chunk, future = pending.popleft()
        yield chunk, future.result()


@contextmanager
def _forked_pool(work: Callable, processes: int):
    """A pool of `processes` processes forked now, running `work` (a closure: fork shares it, nothing is pickled
    but the chunks and results). They are forked with TOKENIZERS_PARALLELISM=false, so that the Rust tokenizer
    encodes serially in them: a forked copy of its thread pool has no threads and would deadlock (and the library
    warns about it in every child otherwise)."""
    global _WORK
    _WORK = work
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), initializer=_end_with,
                                   initargs=(os.getpid(),))
        pool.submit(int).result()  # a fork-context pool starts all its processes at the first submit
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        with pool:
            yield pool
    finally:
        _WORK = None
