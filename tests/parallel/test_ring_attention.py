"""Ring attention (isotrain/parallel/ring.py) alone against SDPA over whole rows, fp64, on 2 and 4 real gloo ranks:
the output and the gradients of q, k and v, for 4 query heads with 4, 2 and 1 key/value heads (CP 4 with 1 KV head:
more ranks than KV heads, which Ulysses cannot split), plain causal rows and packed rows whose documents cross the
zig-zag pieces. Two deliberate breaks must fail the same comparison: blocks merged without their log-sum-exp
weights, and the diagonal block attended without its causal mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zygote import run_forked_ranks

WORKER = str(Path(__file__).with_name("ring_worker.py"))
FP64_RTOL = 1e-12
CASES = {f"kv{kv}-{kind}" for kv in (4, 2, 1) for kind in ("causal", "packed")}


def run(tmp_path, nproc: int, *flags: str) -> dict:
    out = tmp_path / f"ring-{nproc}-{'-'.join(flags)}.json"
    proc = run_forked_ranks(nproc, [str(out), *flags], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_attention_equals_whole_row_attention(tmp_path, nproc):
    errors = run(tmp_path, nproc)
    assert set(errors) == CASES
    for case, values in errors.items():
        assert set(values) == {"out", "dq", "dk", "dv"}
        assert max(values.values()) <= FP64_RTOL, (case, values)


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["nolse", "nodiagonal"])
def test_broken_ring_attention_fails_the_comparison(tmp_path, broken):
    errors = run(tmp_path, 2, f"break={broken}")
    for case, values in errors.items():
        assert values["out"] > 1e-3, (case, values)
