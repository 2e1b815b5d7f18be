"""Invariant 6 for DTensor layouts: a checkpoint saved under one process, TP 2, FSDP2 2 or FSDP2 x TP
2x2 is the same Hugging Face directory of full tensors and loads exactly into every other layout;
each rank's box (state.shard_spec) is what DTensor holds there; a rank reads any box of a tensor
from its file; a Hugging Face directory loads into a TP model, each rank reading its own part.

Real processes on gloo (regions_worker.py), tensors of sizes that split unevenly (7 x 5 over 2 ranks).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_LLAMA, model_weights
from zygote import run_forked_ranks
from isotrain.checkpoint.files import write_safetensors
from isotrain.checkpoint.load import BLOCK_BYTES, CheckpointReader, RUN_BYTES, load_hf_weights, plan_reads
from isotrain.errors import CheckpointError
from isotrain.parallel.boxes import box_index

WORKER = str(Path(__file__).with_name("regions_worker.py"))


def _boxes(shape: tuple[int, ...]):
    """Every box made of torch.chunk pieces (of 1, 2 or 3 chunks) along each dim."""
    per_dim = []
    for size in shape:
        ranges = set()
        for parts in (1, 2, 3):
            start = 0
            for piece in torch.arange(size).chunk(parts):
                ranges.add((start, start + len(piece)))
                start += len(piece)
        ranges.add((size, size))  # the empty part a rank gets when a dim has fewer rows than ranks
        per_dim.append(sorted(ranges))
    return itertools.product(*per_dim)


@pytest.mark.parametrize("block_bytes,run_bytes", [
    (BLOCK_BYTES, RUN_BYTES),  # the defaults: tiny tensors go through whole-row blocks
    (BLOCK_BYTES, 1),  # every run its own pread, straight into the target
    (24, 64 << 10),  # blocks smaller than one row: recurse into each index of dim 0, then blocks
])
def test_any_box_of_any_tensor_reads_exactly(tmp_path, block_bytes, run_bytes):
    generator = torch.Generator().manual_seed(0)
    tensors = {"matrix": torch.randn(7, 5, generator=generator), "experts": torch.randn(3, 7, 5, generator=generator),
               "ids": torch.arange(6), "bf16": torch.randn(4, 3, generator=generator).bfloat16(),
               "scalar": torch.tensor(3.0)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    reader = CheckpointReader(tmp_path, block_bytes=block_bytes, run_bytes=run_bytes)
    for key, whole in tensors.items():
        for box in _boxes(tuple(whole.shape)):
            expected = whole[box_index(box)]
            assert torch.equal(reader.read(key, box), expected), (key, box)
            wider = torch.empty(expected.shape, dtype=torch.float64)  # another dtype goes through a copy
            reader.read_into(key, wider, box)
            assert torch.equal(wider, expected.double()), (key, box)
            planned = plan_reads(tuple(whole.shape), box, whole.element_size(), block_bytes, run_bytes)
            assert reader.prefetch(key, box) == sum(read.end - read.begin for read in planned)
            if run_bytes == 1:  # run by run: exactly the box's bytes are read
                assert sum(read.end - read.begin for read in planned) == expected.numel() * whole.element_size()
    reader.close()


def test_a_row_split_is_one_pread_and_a_column_split_reads_each_rows_part():
    assert [(r.begin, r.end, r.block) for r in plan_reads((7, 5), ((4, 7), (0, 5)), 4)] == [(80, 140, None)]
    runs = plan_reads((7, 5), ((0, 7), (3, 5)), 4, run_bytes=8)
    assert [(r.begin, r.end) for r in runs] == [(20 * i + 12, 20 * i + 20) for i in range(7)]
    blocks = plan_reads((1000, 5), ((0, 1000), (3, 5)), 4, block_bytes=8000)  # 400 rows of 20 bytes per block
    assert [(r.begin, r.end) for r in blocks] == [(0, 8000), (8000, 16000), (16000, 20000)]


def _reference(root: Path) -> dict[str, torch.Tensor]:
    from regions_worker import reference_step, save_as, state_of

    model, optimizer = reference_step()
    save_as(root, "single", model, optimizer, rank=0, world=1)
    expected = state_of(model, optimizer)
    torch.save(expected, root / "reference.pt")
    return expected


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "intermediate_size": 37, "tie_word_embeddings": True,
                                           **overrides}))


def test_checkpoints_move_between_every_layout(tmp_path):
    """1 process -> FSDP2 x TP -> TP 2 and FSDP2 2 -> 1 process (and 1 process -> TP 2, FSDP2 2 directly):
    every tensor of model and AdamW state equal exactly at each step, and every file holds full tensors."""
    from regions_worker import load_into, state_of

    expected = _reference(tmp_path)
    _tiny_llama().save_pretrained(tmp_path / "hf")
    proc = run_forked_ranks(4, ["regions,load-save", str(tmp_path), "single"], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_forked_ranks(2, ["load-save,hf", str(tmp_path), "single,fsdp2xtp2-from-single"], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = ["fsdp2xtp2-from-single", "tp2-from-single", "fsdp2-from-single", "tp2-from-fsdp2xtp2-from-single",
             "fsdp2-from-fsdp2xtp2-from-single"]
    for name in saved:
        directory = tmp_path / name
        files = model_weights(directory)
        for path in (directory / "train_state").glob("optimizer*.safetensors"):
            files.update(load_file(path))
        assert files.keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(files[key], value), (name, key)
        model, optimizer = load_into(directory, "single", rank=0)
        got = state_of(model, optimizer)
        for key, value in expected.items():
            assert torch.equal(got[key], value), (name, key)


def test_hf_directory_errors_name_the_tensor(tmp_path):
    _tiny_llama().save_pretrained(tmp_path / "hf")
    deeper = _tiny_llama(num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"has no tensor 'model\.layers\.2\..*' \(\d+ missing\)"):
        load_hf_weights(tmp_path / "hf", deeper, rank=0)
    wider = _tiny_llama(intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"has model\.layers\.0\.mlp\.gate_proj\.weight of shape \[37, 32\] "
                                              r"but the model has \[40, 32\]"):
        load_hf_weights(tmp_path / "hf", wider, rank=0)
    with pytest.raises(CheckpointError, match="holds no model.safetensors"):
        load_hf_weights(tmp_path, wider, rank=0)
    with torch.device("meta"):
        on_meta = _tiny_llama()
    with pytest.raises(CheckpointError, match="still on the meta device"):
        load_hf_weights(tmp_path / "hf", on_meta, rank=0)


def test_a_sharded_hf_directory_loads_into_a_plain_model(tmp_path):
    source = _tiny_llama()
    source.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    same = _tiny_llama()
    for param in same.parameters():
        param.data.zero_()
    load_hf_weights(tmp_path / "hf", same, rank=0)
    saved = model_weights(tmp_path / "hf")
    assert "lm_head.weight" not in saved  # tied: stored once, under the embedding's name
    for name, tensor in same.state_dict().items():
        assert torch.equal(tensor, saved["model.embed_tokens.weight" if name == "lm_head.weight" else name]), name
