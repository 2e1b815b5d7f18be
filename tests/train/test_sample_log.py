"""data.log_samples: one line per step and rank; a resumed run first cuts every rank's file back to its step."""

import json
from types import SimpleNamespace

from isotrain.train.sample_log import SampleLog


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_cuts_every_rank_file_back_to_its_step(tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    for rank in (0, 1):  # an earlier run on 2 ranks, killed while writing step 5
        rows = [json.dumps({"step": step, "samples": [[step, [rank]]]}) for step in range(1, 6)]
        (samples / f"rank-{rank:05d}.jsonl").write_text("\n".join(rows) + '\n{"step": 6, "sam')
    log = SampleLog(tmp_path, rank=0, is_main=True, start_step=3)  # resumed at step 3 on 1 process
    log.write(4, [7, 2], [SimpleNamespace(row_ids=(11,)), SimpleNamespace(row_ids=(12, 13))])
    log.close()
    assert [row["step"] for row in lines(samples / "rank-00000.jsonl")] == [1, 2, 3, 4]
    assert lines(samples / "rank-00000.jsonl")[-1] == {"step": 4, "samples": [[7, [11]], [2, [12, 13]]]}
    assert [row["step"] for row in lines(samples / "rank-00001.jsonl")] == [1, 2, 3]
    SampleLog(tmp_path, rank=0, is_main=True, start_step=0).close()  # a fresh run starts the files anew
    assert [path.read_text() for path in sorted(samples.iterdir())] == ["", ""]
