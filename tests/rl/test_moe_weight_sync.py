"""What a vLLM engine receives from a mixture-of-experts policy in every layout: the keys and bytes of its Hugging
Face checkpoint, each expert gathered alone (tests/rl/test_vllm_moe.py serves them with real vLLM).

One launch of 4 forked ranks (moe_sync_worker.py) streams the tiny Qwen3-MoE policy with `saved_named_tensors` under
every way isotrain places experts on 4 ranks: EP over DDP, FSDP2 (experts sharded by FSDP2 itself, or by EP), EP × TP
over FSDP2 and over DDP, FSDP2 × TP, HSDP 2 × 2 with and without EP; and, on a 2 × 2 mesh, experts split on two mesh
dimensions or along another dim than the expert dim (assembled from their pieces, one expert at a time). In this
process the plain model streams too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import engine_models
from isotrain.models.weights import saved_named_tensors, sync_named_tensors, tensor_sha256
from zygote import run_forked_ranks


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-sync") / "streams.json"
    proc = run_forked_ranks(4, [str(out)], script=str(Path(__file__).with_name("moe_sync_worker.py")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_engine_gets_the_keys_and_bytes_of_the_hugging_face_checkpoint(tmp_path):
    """One process: the stream is `save_pretrained`'s files, key for key (per-expert keys, global ids), shape for
    shape and byte for byte, in the model's order, expert by expert."""
    model = engine_models.tiny_moe(engine_models.digits_tokenizer())
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        files = {key: tensor_sha256(saved.get_tensor(key)) for key in saved.keys()}
    sent = [(name, tensor_sha256(t)) for name, t in saved_named_tensors(model)]
    assert dict(sent) == files and len(sent) == len(files)
    names = [name for name, _ in sent]
    layer0 = [n.removeprefix("model.layers.0.mlp.experts.") for n in names if ".layers.0.mlp.experts." in n]
    assert layer0 == [f"{e}.{leaf}.weight" for e in range(4) for leaf in ("gate_proj", "up_proj")] + [
        f"{e}.down_proj.weight" for e in range(4)]
    # A dense model's stream is sync_named_tensors' own.
    dense = engine_models.tiny_model(engine_models.digits_tokenizer())
    assert [(n, tensor_sha256(t)) for n, t in saved_named_tensors(dense)] == [
        (n, tensor_sha256(t)) for n, t in sync_named_tensors(dense)]


# The experts' placements each layout gives (the branch of models/weights.py `_expert_blocks` it takes).
PLACEMENTS = {
    "ddp4_ep2": "(Shard(dim=0),)", "fsdp4_ep4": "(Shard(dim=0),)", "fsdp4": "(Shard(dim=0),)",
    "fsdp2_tp2_ep2": "(Shard(dim=0), Replicate())", "ddp2_tp2_ep2": "(Shard(dim=0), Replicate())",
    "fsdp2_tp2": "(Shard(dim=0), Replicate())", "hsdp2x2": "(Replicate(), Shard(dim=0))",
    "hsdp2x2_ep2": "(Shard(dim=0),)", "hsdp2x2_ep4": "(Shard(dim=0),)",
    "shard0_shard1": "(Shard(dim=0), Shard(dim=1))", "shard1_replicate": "(Shard(dim=1), Replicate())",
    "shard0_shard0": "(Shard(dim=0), Shard(dim=0))"}


@pytest.mark.slow
def test_every_layout_sends_the_one_process_weights_one_expert_at_a_time(streams):
    """Each rank of each layout streams exactly the one-process model's tensors (names, shapes, sha256, order): expert
    parallel, tensor parallel and FSDP2/HSDP shards gathered. No expert tensor is ever gathered whole (no 3-D
    `full_tensor`): each expert travels alone, the largest expert tensor a rank holds is one expert's [2I, H] block."""
    assert streams["reference"] and set(streams) == {"reference", *PLACEMENTS}
    for layout, placements in PLACEMENTS.items():
        for rank in streams[layout]:
            assert rank["placements"] == [placements], (layout, rank["placements"])
            assert rank["stream"] == streams["reference"], layout
            assert all(len(shape) < 3 for shape in rank["gathered"]), (layout, rank["gathered"])
        if layout.startswith(("fsdp", "hsdp")):  # FSDP2 gathers the dense tensors one at a time
            assert streams[layout][0]["gathered"], layout
