"""The final model and every checkpoint of `isotrain embed` are sentence-transformers directories that give
isotrain's own vectors; the held-out retrieval metrics are printed and written to metrics.jsonl."""

import json

import pytest
import torch

from embed.test_embed_cli import BERT
from zygote import run_isotrain



@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_sentence_transformers_round_trip(data, tmp_path, pooling):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from isotrain.embed.encode import EncodeOptions
    from isotrain.embed.evaluate import encode_texts

    run = tmp_path / "run"
    proc = run_isotrain(["embed", *BERT, f"data.path={data}", f"eval.path={data}", f"output_dir={run}",
                         f"embed.pooling={pooling}", "train.global_batch_size=8", "train.micro_batch_size=4",
                         "train.max_steps=2", "checkpoint.every_steps=1", "logging.progress=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "before training: retrieval on 40 held-out rows: recall@1" in proc.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and {"eval_recall@1", "eval_ndcg@10"} <= rows[0].keys() \
        and "eval_mrr@10" in rows[-1]
    texts = ["alpha beta gamma", "a text the model never saw, longer than the others by far", "pi rho"]
    for directory in (run / "model", run / "checkpoints" / "step-00000001"):
        st = SentenceTransformer(str(directory), device="cpu")
        got = st.encode(texts, convert_to_tensor=True, batch_size=2)
        model = AutoModel.from_pretrained(directory).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory)
        want = encode_texts(model, tokenizer, texts, EncodeOptions(pooling, tokenizer.pad_token_id), 32, torch.device("cpu"))
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-6


def test_eval_only_matches_the_runs_final_metrics(data, tmp_path):
    run = tmp_path / "run"
    common = [*BERT, f"data.path={data}", f"eval.path={data}", "train.global_batch_size=8",
              "train.micro_batch_size=8", "logging.progress=false"]
    proc = run_isotrain(["embed", *common, f"output_dir={run}", "train.max_steps=1", "checkpoint.every_steps=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    model_dir = run / "model"
    proc = run_isotrain(["embed", "--eval-only", f"model.name_or_path={model_dir}", f"eval.path={data}",
                         "data.max_seq_len=32", f"output_dir={tmp_path / 'unused'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if "retrieval on 40 held-out rows" in x][0]
    assert line.endswith(f"recall@1 {final['eval_recall@1']:.3f}, recall@10 {final['eval_recall@10']:.3f}, "
                         f"mrr@10 {final['eval_mrr@10']:.3f}, ndcg@10 {final['eval_ndcg@10']:.3f}")
    proc = run_isotrain(["embed", "--eval-only", f"model.name_or_path={model_dir}", "eval.path=null"])
    assert proc.returncode == 2 and "isotrain embed --eval-only needs held-out rows" in proc.stderr
