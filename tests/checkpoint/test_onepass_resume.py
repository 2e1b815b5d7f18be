"""A resume reads the checkpoint once: the bytes the ranks load are hashed (BLAKE3 per 16 MiB piece) and
compared with the manifest before the first step, and every other byte is checked by exactly one rank.

A byte flipped in a tensor file between save and resume passes the checks made before the load
(manifest, sizes, headers) and is caught by the load itself, on 1 process and on 2 FSDP2 ranks: the
damaged file is named, no step runs on its bytes, and `resume=auto` reloads the previous checkpoint into
the same tensors and redoes the same steps. Checkpoints with a sha256 manifest (written before BLAKE3)
still resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN, counted_metrics, rewrite_as_sha256_manifest
from zygote import run_forked_ranks
from isotrain.checkpoint.digest import PIECE_BYTES
from isotrain.checkpoint.files import write_safetensors
from isotrain.checkpoint.manifest import read_manifest, write_manifest
from isotrain.checkpoint.onepass import assign, check_loaded

TINY = [*TINY_RUN, "train.deterministic=true", "checkpoint.every_steps=2", "train.micro_batch_size=2"]
LAYOUTS = {"1": (1, []), "2fsdp": (2, ["parallel.dp_shard=2"])}


def train(layout: str, run_dir, *overrides: str):
    nproc, extra = LAYOUTS[layout]
    return run_forked_ranks(nproc, ["train", *TINY, *extra, f"output_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per layout, 4 uninterrupted steps with checkpoints at 2 and 4 (built on first use)."""
    made = {}

    def get(layout: str):
        if layout not in made:
            run_dir = tmp_path_factory.mktemp(f"reference-{layout}") / "run"
            proc = train(layout, run_dir, "train.max_steps=4")
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[layout] = run_dir
        return made[layout]

    return get


def copy_of(reference, tmp_path):
    shutil.copytree(reference, tmp_path / "run")
    return tmp_path / "run"


def flip_data_byte(path) -> tuple[int, int]:
    """Flip one byte in the tensor data (past the header, the first piece); returns (offset, header end)."""
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    offset = (header_end + len(data)) // 2
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return offset, header_end


def tensor_files(checkpoint) -> list[str]:
    return sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1", "2fsdp"])
def test_a_flipped_byte_is_caught_by_the_load_and_the_previous_checkpoint_is_reloaded(references, tmp_path, layout):
    reference = references(layout)
    run_dir = copy_of(reference, tmp_path)
    step4 = run_dir / "checkpoints" / "step-00000004"
    # The last optimizer file: on 2 ranks, a file whose pieces the loads split between the ranks.
    damaged = tensor_files(step4)[-1]
    offset, header_end = flip_data_byte(step4 / damaged)
    assert offset > header_end

    proc = train(layout, run_dir, "train.max_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    # The piece named is a data piece (bytes header_end-...), which only the load checks.
    assert f"checkpoint step-00000004 is invalid ({step4 / damaged} (bytes {header_end}-" in output, output
    assert "does not match its blake3 in the manifest" in output and "trying the previous one" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} at step 2" in output
    assert "resumed from" in output and output.count("resumed from") == 1
    # Steps 3 and 4 are redone from step 2's model and optimizer exactly as the first time: nothing of
    # the damaged checkpoint's (already loaded) tensors survived into training.
    rows = counted_metrics(run_dir)
    assert rows[:4] == counted_metrics(reference) and [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1", "2fsdp"])
def test_a_flipped_byte_in_a_checkpoint_named_by_path_stops_the_run_before_any_step(references, tmp_path, layout):
    run_dir = copy_of(references(layout), tmp_path)
    step4 = run_dir / "checkpoints" / "step-00000004"
    damaged = tensor_files(step4)[0]  # a model file
    flip_data_byte(step4 / damaged)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()

    proc = train(layout, run_dir, "train.max_steps=6", f"checkpoint.resume={step4}")
    assert proc.returncode != 0
    # (torchrun adds its own traceback of the launcher; the workers print one sentence.)
    expected = f"error: checkpoint.resume={step4} is not a valid checkpoint: {step4 / damaged} (bytes"
    assert any(line.startswith(expected) for line in proc.stderr.splitlines()), proc.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # no step was taken


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1", "2fsdp"])
def test_a_sha256_checkpoint_from_before_blake3_still_resumes(references, tmp_path, layout):
    reference = references(layout)
    run_dir = copy_of(reference, tmp_path)
    root = run_dir / "checkpoints"
    for step in ("step-00000002", "step-00000004"):
        rewrite_as_sha256_manifest(root / step)
    resumed = tmp_path / "resumed"  # continue step 2 -> 4 from the sha256 checkpoint
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    (resumed / "checkpoints" / "latest").write_text("step-00000002\n")
    proc = train(layout, resumed, "train.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    assert counted_metrics(resumed) == counted_metrics(reference)
    assert read_manifest(resumed / "checkpoints" / "step-00000004")["hash"] == "blake3"  # new saves: BLAKE3

    # A damaged sha256 checkpoint is still refused (its whole-file sha256 is checked before the load).
    flip_data_byte(root / "step-00000004" / tensor_files(root / "step-00000004")[-1])
    proc = train(layout, run_dir, "train.max_steps=6")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "does not match its sha256 in the manifest" in output, output
    assert f"resumed from {root / 'step-00000002'} at step 2" in output


# ----- the plan and the hashing itself, in one process ------------------------------------------
def small_checkpoint(tmp_path, num_rows: int = 3 * 1024):
    """A directory with one safetensors file of a little more than two pieces, and its manifest."""
    tensor = torch.arange(num_rows * 1024 * 3, dtype=torch.float32).reshape(num_rows * 3, 1024)
    entry = write_safetensors(tmp_path / "model.safetensors", {"w": tensor})
    write_manifest(tmp_path, {"model.safetensors": entry}, {"kind": "model", "step": 0})
    header_end = entry.first_piece_bytes
    return tensor, header_end, json.loads((tmp_path / "manifest.json").read_text())


def test_the_load_hashes_the_bytes_in_memory_and_reads_only_what_it_did_not_load(tmp_path):
    tensor, header_end, manifest = small_checkpoint(tmp_path)
    assert len(manifest["files"]["model.safetensors"]["blake3"]) == 4  # header, 2 full pieces, a tail
    loaded_rows = tensor[: tensor.shape[0] // 2].clone()  # what a rank read: the first half of the rows
    view = memoryview(loaded_rows.numpy()).cast("B")
    record = {tmp_path / "model.safetensors": [(header_end, view)]}
    assert check_loaded(tmp_path, record, rank=0, world_size=1, group=None) is None

    loaded_rows[10, 3] += 1  # memory differs from the file: the hash is of what the load holds
    problem = check_loaded(tmp_path, record, rank=0, world_size=1, group=None)
    assert problem == (f"{tmp_path / 'model.safetensors'} (bytes {header_end}-{header_end + PIECE_BYTES}) does not "
                       "match its blake3 in the manifest (altered or corrupted)")
    loaded_rows[10, 3] -= 1

    data = bytearray((tmp_path / "model.safetensors").read_bytes())  # a byte nobody loaded: read from disk
    data[-5] ^= 0x01
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    problem = check_loaded(tmp_path, record, rank=0, world_size=1, group=None)
    assert problem is not None and f"(bytes {header_end + 2 * PIECE_BYTES}-{len(data)})" in problem


def test_each_piece_is_checked_once_by_the_rank_that_holds_most_of_it():
    # 3 ranks, 5 pieces of 10 bytes: counts of the bytes each rank holds.
    counts = [[10, 0, 4, 0, 10], [0, 10, 6, 0, 10], [0, 0, 0, 0, 0]]
    # Piece 3 nobody read: the least-loaded rank reads it. Piece 4: ranks 0 and 1 hold it all, and rank 0
    # has been given fewer bytes so far.
    assert assign(counts, [10] * 5) == [0, 1, 1, 2, 0]
    assert assign([[10, 10], [10, 10]], [10, 10]) == [0, 1]  # replicas (DDP) split the work


def _two_rank_check(rank: int, store: str, directory: str, num_rows: int, out: str) -> None:
    """Rank 1 loaded the whole tensor (and altered one value of its copy); rank 0 loaded nothing."""
    import torch.distributed as dist

    # A file store, not a TCP port: no other program can take it between choosing and binding.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    directory = Path(directory)
    record = {}
    if rank == 1:
        tensor = torch.arange(num_rows * 1024 * 3, dtype=torch.float32).reshape(num_rows * 3, 1024)
        tensor[-1, -1] += 1
        first = read_manifest(directory)["files"]["model.safetensors"]["first_piece_bytes"]
        record = {directory / "model.safetensors": [(first, memoryview(tensor.numpy()).cast("B"))]}
    problem = check_loaded(directory, record, rank, 2, None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(problem))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_problem_found_by_one_rank_is_every_ranks_verdict(tmp_path):
    import torch.multiprocessing as mp

    _, header_end, _ = small_checkpoint(tmp_path, num_rows=1024)  # header + one 12 MB piece
    mp.start_processes(_two_rank_check, args=(str(tmp_path / "store"), str(tmp_path), 1024, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    verdicts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    size = (tmp_path / "model.safetensors").stat().st_size
    expected = (f"{tmp_path / 'model.safetensors'} (bytes {header_end}-{size}) does not match its blake3 in the "
                "manifest (altered or corrupted)")
    assert verdicts == [expected, expected]  # only rank 1 held the piece, so only rank 1 hashed it
