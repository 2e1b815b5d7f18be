"""Two "nodes" of 2 processes each on this machine, met by torchrun's c10d rendezvous, are the 4-process run of one
node (issue #32): the same counters, losses, weights and checkpoints. A node whose output_dir is not the directory
the other node sees (node-local disks, no shared file system) is refused before any training (its 4 ranks forked,
tests/zygote.py, each "node's" two in a directory of their own: how torchrun's agents of two nodes meet is the
first test's).

Each node is its own `torchrun --nnodes 2 --node-rank i --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`. The
rendezvous store on PORT is served by this test (`--rdzv-conf is_host=false`: both agents are its clients): the test
binds it on a port the system chooses and holds it for the whole launch, so no port has to stay free between
choosing and binding it. Who serves the rendezvous store changes nothing the workers see: the store they meet in
(MASTER_ADDR:MASTER_PORT) is created by the agent of node rank 0, on a port of its own choosing.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import HANG_S, REPO, TINY_RUN, counted_metrics, failure, model_weights, run_concurrently, \
    subprocess_env
from isotrain.checkpoint.layout import committed, leftovers, read_latest
from isotrain.checkpoint.manifest import read_manifest, verify_checkpoint
from isotrain.train.run_dir import SHARED_PROBE
from zygote import PORT_TAKEN, fork_ranks, run_forked_ranks, run_isotrain, shared_zygote

MAX_STEPS = 4
# HSDP, the usual layout of several machines: FSDP2 within a node, replicas across nodes. Every rank owns a share
# of the checkpoint's tensors, so each node writes files of its own into it.
LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=2", "train.deterministic=true"]


def train_args(output_dir, cache: Path) -> list[str]:
    return ["-m", "isotrain", "train", *TINY_RUN, *LAYOUT, "checkpoint.every_steps=2", f"train.max_steps={MAX_STEPS}",
            f"output_dir={output_dir}", f"data.cache_dir={cache}"]


def two_nodes(args: list[str], cwds: list[Path]) -> list[subprocess.CompletedProcess]:
    """Run `torchrun ... ARGS` as two nodes of 2 processes each, node i started in cwds[i]; both are waited for."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    run_id = f"isotrain-test-{uuid.uuid4().hex[:8]}"
    nodes = []
    for node_rank, cwd in enumerate(cwds):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false", "--rdzv-id", run_id, *args]
        nodes.append(subprocess.Popen(command, env=subprocess_env(), cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=HANG_S) for node in nodes]
    del store  # served until both nodes have ended
    return [subprocess.CompletedProcess(node.args, node.returncode, out, err)
            for node, (out, err) in zip(nodes, outputs)]


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_two_nodes_of_two_processes_equal_the_four_process_run(tmp_path):
    cache = tmp_path / "cache"
    # The one-node run is independent of the two nodes: it runs beside them (the longer launch first), its ranks
    # forked (tests/zygote.py): torchrun is what the nodes test.
    runs = run_concurrently({
        "nodes": lambda: two_nodes(train_args(tmp_path / "multi", cache), [REPO, REPO]),
        "single": lambda: run_forked_ranks(4, train_args(tmp_path / "single", cache)[2:])})
    for proc in [*runs["nodes"], runs["single"]]:
        assert proc.returncode == 0, failure(proc)
    multi, single = tmp_path / "multi", tmp_path / "single"

    assert counted_metrics(multi) == counted_metrics(single)  # counters, losses, grad norms: exact
    assert [r["step"] for r in counted_metrics(multi)] == list(range(1, MAX_STEPS + 1))
    assert model_weights(multi / "model").keys() == model_weights(single / "model").keys()
    for name, data in checkpoint_files(multi / "model").items():
        assert data == (single / "model" / name).read_bytes(), name

    # Every checkpoint committed once, with the files of every rank of both nodes, byte for byte those of one node.
    root = multi / "checkpoints"
    steps = [step for step, _ in committed(root)]
    assert steps == [2, 4] == [step for step, _ in committed(single / "checkpoints")]
    assert read_latest(root) == "step-00000004" and leftovers(root) == []
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    for step in steps:
        name = f"step-{step:08d}"
        files, expected = checkpoint_files(root / name), checkpoint_files(single / "checkpoints" / name)
        assert files.keys() == expected.keys()
        # Each rank writes its RNG state and owns one model and one optimizer shard: ranks 2-3 are the other node.
        for rank in range(4):
            assert f"train_state/rng-rank-{rank:05d}.json" in files
            assert f"model-{rank + 1:05d}-of-00004.safetensors" in files
            assert f"train_state/optimizer-{rank + 1:05d}-of-00004.safetensors" in files
        # Equal bytes, but for the config that names each run's output_dir (and the manifest entry of it).
        config = "train_state/config.yaml"
        assert [n for n, data in files.items() if data != expected[n]] == ["manifest.json", config], name
        assert files[config].replace(b"/multi\n", b"/single\n") == expected[config]
        listed, listed_single = (read_manifest(where / name)["files"] for where in (root, single / "checkpoints"))
        assert listed.keys() == files.keys() - {"manifest.json"}
        del listed[config], listed_single[config]
        assert listed == listed_single  # sizes and hashes
        assert verify_checkpoint(root / name) == []
    verified = run_isotrain(["ckpt", "verify", str(root / "step-00000004")])
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # Nothing of the start-up's check of the shared directory is left in it.
    assert sorted(p.name for p in multi.iterdir()) == sorted(p.name for p in single.iterdir())
    assert not [p for p in multi.iterdir() if p.name.startswith(SHARED_PROBE)]


@pytest.mark.slow
def test_a_node_local_output_dir_is_refused_before_any_training(tmp_path):
    """No shared file system: both nodes are given output_dir=run, the ranks of each started in a directory of its
    own, so the same setting names a different directory on each node, as the same path on two machines' own disks
    does. Ranks 0-1 are node 0, ranks 2-3 node 1 (forked with torchrun's environment)."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for path in cwds:
        path.mkdir()
    for attempt in range(3):  # only a rendezvous port taken meanwhile (nothing written yet) is tried again
        errs = [tmp_path / f"try{attempt}-rank{rank}.err" for rank in range(4)]
        logs = [path.with_suffix(".out") for path in errs]
        forked = fork_ranks(shared_zygote(), 4, train_args("run", tmp_path / "cache")[2:], logs, errs=errs,
                            cwd=[cwds[0], cwds[0], cwds[1], cwds[1]])
        forked.finish(HANG_S)
        stderrs = [path.read_text() for path in errs]
        if not any(PORT_TAKEN in text for text in stderrs):
            break

    assert all(code not in (0, None) for code in forked.exit_codes()), forked.exit_codes()
    expected = ("output_dir run is not one directory that every node sees: the file rank 0 wrote into it is not "
                f"there for ranks 2-3 on host {socket.gethostname()}; all nodes must see the same output_dir, so put "
                "it on a file system that every node mounts at the same path")
    assert len(stderrs) == 4
    for text in stderrs:  # every worker: one line, the sentence, no traceback
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in text, text
        assert " ".join(lines[0].split()).endswith(f"error: {expected}"), text
    # Refused before any training: no metrics, no checkpoint, no config; the check's file is gone.
    for cwd in cwds:
        run = cwd / "run"
        left = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
        assert set(left) <= {".isotrain"}, left


def test_the_refusal_names_the_ranks_that_miss_the_file_by_host():
    from isotrain.train.run_dir import _ranks_on_hosts

    assert _ranks_on_hosts([(5, "b")]) == "rank 5 on host b"
    assert _ranks_on_hosts([(1, "a"), (3, "a"), (4, "a"), (5, "a"), (6, "b")]) == "ranks 1, 3-5 on host a, 6 on host b"
    many = [(rank, f"node{rank // 8}") for rank in range(8, 56)]  # 6 hosts of 8 ranks
    assert _ranks_on_hosts(many) == ("ranks 8-15 on host node1, 16-23 on host node2, 24-31 on host node3, "
                                     "32-39 on host node4, more on 2 other hosts")
