"""What a vLLM engine receives from a mixture-of-experts policy in every layout: the keys and bytes of its Hugging
Face checkpoint, each expert gathered alone (tests/rl/test_vllm_moe.py serves them with real vLLM).

One launch of 2 forked ranks (moe_sync_worker.py) streams the tiny Qwen3-MoE policy with `saved_named_tensors` under
EP 2 over DDP, FSDP2 2 × EP 2 and FSDP2 2 (experts sharded by FSDP2); in this process the plain model streams too.
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
    proc = run_forked_ranks(2, [str(out)], script=str(Path(__file__).with_name("moe_sync_worker.py")))
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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp2_ep2", "fsdp2_ep2", "fsdp2"])
def test_every_layout_sends_the_one_process_weights_one_expert_at_a_time(streams, layout):
    """Each rank streams exactly the one-process model's tensors (names, shapes, sha256, order): expert parallel
    shards and FSDP2 shards gathered. No expert tensor is ever gathered whole (no 3-D `full_tensor`): each expert
    travels alone, the largest expert tensor a rank holds is one expert's [2I, H] block."""
    for rank in streams[layout]:
        assert rank["stream"] == streams["reference"]
        assert all(len(shape) < 3 for shape in rank["gathered"]), rank["gathered"]
    if layout.startswith("fsdp2"):  # FSDP2 gathers the dense tensors one at a time
        assert streams[layout][0]["gathered"]
