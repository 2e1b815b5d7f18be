"""Preparing a text corpus at scale: isotrain's time to the first step and peak memory, cache cold and warm, next to
the `tokenizers` library's `encode_batch` alone and to the Hugging Face way of preparing a corpus.

    python bench/data_scale.py                       # 20 MB and 200 MB
    python bench/data_scale.py --sizes 20,200,2000   # and 2 GB (about 15 min of tokenizing per GB on 2 cores)
    python bench/data_scale.py --sizes 200,1000 --prepare-only   # isotrain's preparation alone (time, memory)

The corpus is real text that ships with this machine: the `.py` files of the Python installation and of the
installed packages, one document per file, as `text` JSONL, cycled until it reaches the size (sizes are
characters of text). The tokenizer is a byte-level BPE of 32 000 tokens trained by isotrain on the corpus's first
2 000 documents. Every measurement runs in a process of its own; peak memory is its peak resident set
(`ru_maxrss`; for the Hugging Face way, the largest of its processes), and "growth" subtracts what the same process
held right after its imports and the tokenizer, so it is what preparing the data costs.

- `encode_batch`: the texts read in batches of 1 000 rows, `Tokenizer.encode_batch` on every core, ids counted;
  `encode_batch_fast` (the same without character offsets: what isotrain calls) likewise.
- `isotrain prepare cold` / `warm`: `prepare_dataset` (data.packing=true, data.max_seq_len=1024, data.overflow=split,
  what `isotrain train` runs before its first step) with a fresh cache, then again with the store in place.
- `first step, warm`: the wall time of `isotrain train` with a tiny Llama for 1 step, store in place: the whole
  process (imports, tokenizer, data, model, one step). Cold, add the cold preparation.
- `HF map`: `datasets.load_dataset("json")` -> `map(tokenize, batched, num_proc=cores)` -> `map(group_texts,
  batched, num_proc=cores)` in blocks of 1024 tokens, as `run_clm.py` does, with a fresh `datasets` cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQ = 1024
TINY = ["model.config.model_type=llama", "model.config.hidden_size=64", "model.config.intermediate_size=128",
        "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1",
        f"model.config.max_position_embeddings={SEQ}"]

ENCODE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2] + "/tokenizer.json")
encode = getattr(tok, sys.argv[3])
start, tokens, batch = time.perf_counter(), 0, []
def flush():
    global tokens
    tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
    batch.clear()
with open(sys.argv[1]) as f:
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == 1000:
            flush()
flush()
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""

HF_MAP = """
import json, os, sys, time
from itertools import chain
import datasets
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[2])
start = time.perf_counter()
raw = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
cores = os.cpu_count()
tokenized = raw.map(lambda rows: tok(rows["text"]), batched=True, num_proc=cores, remove_columns=["text"])
def group_texts(examples):
    joined = {k: list(chain(*examples[k])) for k in examples.keys()}
    total = len(joined["input_ids"]) // %d * %d
    return {k: [t[i : i + %d] for i in range(0, total, %d)] for k, t in joined.items()}
grouped = tokenized.map(group_texts, batched=True, num_proc=cores)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": len(grouped) * %d}))
""" % (SEQ, SEQ, SEQ, SEQ, SEQ)

PREPARE = """
import json, sys, time
from transformers import AutoTokenizer
from isotrain.config import SFTDataConfig
from isotrain.data import prepare_dataset

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

tok = AutoTokenizer.from_pretrained(sys.argv[2])
cfg = SFTDataConfig(path=sys.argv[1], format="text", max_seq_len=%d, packing=True, cache_dir=sys.argv[3])
before, start = status_kib("VmRSS"), time.perf_counter()
dataset = prepare_dataset(cfg, tok, log=lambda *_: None)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "growth_mib": (status_kib("VmHWM") - before) / 1024, "samples": len(dataset),
                  "trained": dataset.stats.total_trained_tokens, "targets": dataset.stats.corpus_trained_tokens,
                  "tokens": dataset.stats.total_input_tokens}))
""" % SEQ


def corpus(workdir: Path, megabytes: int) -> Path:
    """`text` JSONL of the installed .py files, cycled to `megabytes` million characters (written once)."""
    path = workdir / f"corpus-{megabytes}mb.jsonl"
    if path.exists():
        return path
    roots = [Path(os.__file__).parent, *{Path(p) for p in sys.path if p.endswith("site-packages")}]
    files = sorted({p for root in roots for p in root.rglob("*.py") if p.is_file()})
    target, written = megabytes * 1_000_000, 0
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        while written < target:
            for file in files:
                try:
                    text = file.read_text()
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    out.write(json.dumps({"text": text}) + "\n")
                    written += len(text)
                    if written >= target:
                        break
    tmp.rename(path)
    return path


def tokenizer(workdir: Path, first_corpus: Path) -> Path:
    directory = workdir / "tokenizer"
    if not (directory / "tokenizer.json").exists():
        from isotrain.models.tokenizer import train_tokenizer

        with first_corpus.open() as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
        train_tokenizer(texts, "bpe", 32000).save_pretrained(directory)
    return directory


def measured(cmd: list[str], env: dict | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in MiB of the largest process, stdout) of a command run to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{err[-3000:]}")
    # RUSAGE_CHILDREN: the largest resident set of any descendant waited for (a process and its map workers).
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    return seconds, peak, out


def fresh_peak(cmd: list[str], env: dict | None = None) -> tuple[float, int, str]:
    """`measured` in a child of its own, so that RUSAGE_CHILDREN holds only that command's processes."""
    runner = ("import json, sys; sys.path.insert(0, %r); from data_scale import measured; "
              "print(json.dumps(measured(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))" % str(REPO / "bench"))
    out = subprocess.run([sys.executable, "-c", runner, json.dumps(cmd), json.dumps(env or dict(os.environ))],
                         capture_output=True, text=True, check=True).stdout
    seconds, peak, stdout = json.loads(out.splitlines()[-1])
    return seconds, peak, stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20,200", help="corpus sizes in MB of text, comma-separated")
    parser.add_argument("--workdir", default="/tmp/isotrain-data-scale", help="where corpora and caches go")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face map way")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only isotrain's preparation, cold and warm (its time and memory columns; the others '-')")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    corpora = {size: corpus(workdir, size) for size in sizes}
    tok = tokenizer(workdir, corpora[sizes[0]])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    print(f"cores: {os.cpu_count()}; tokenizer: BPE of {len(json.loads((tok / 'tokenizer.json').read_text())['model']['vocab'])} "
          "tokens")
    rows = ["| corpus | tokens | encode_batch s | encode_batch_fast s | isotrain prepare s | isotrain / encode_batch | trained share | "
            "prepare growth MiB | warm s | warm growth MiB | first step, warm s | HF map s | HF peak MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        path = corpora[size]
        cache, out_dir = workdir / f"cache-{size}", workdir / f"run-{size}"
        shutil.rmtree(cache, ignore_errors=True)
        cold, warm = (json.loads(fresh_peak([sys.executable, "-c", PREPARE, str(path), str(tok), str(cache)],
                                            env)[2].splitlines()[-1]) for _ in range(2))
        if args.prepare_only:
            rows.append(f"| {size} MB | {cold['tokens'] / 1e6:.1f} M | - | - | {cold['seconds']:.1f} | - | "
                        f"{cold['trained'] / cold['targets']:.1%} | {cold['growth_mib']:.0f} | {warm['seconds']:.2f} | "
                        f"{warm['growth_mib']:.0f} | - | - | - |")
            print(rows[-1], flush=True)
            continue
        enc_s, _, out = fresh_peak([sys.executable, "-c", ENCODE, str(path), str(tok), "encode_batch"], env)
        tokens = json.loads(out.splitlines()[-1])["tokens"]
        fast_s, _, _ = fresh_peak([sys.executable, "-c", ENCODE, str(path), str(tok), "encode_batch_fast"], env)
        shutil.rmtree(out_dir, ignore_errors=True)
        step_s, _, _ = fresh_peak([sys.executable, "-m", "isotrain", "train", *TINY, f"tokenizer.path={tok}",
                                   "data.format=text", f"data.path={path}", f"data.max_seq_len={SEQ}",
                                   "data.packing=true", f"data.cache_dir={cache}", "train.global_batch_size=1",
                                   "train.micro_batch_size=1", "train.max_steps=1", "eval.path=null",
                                   "logging.progress=false", "checkpoint.every_steps=0", f"output_dir={out_dir}"], env)
        shutil.rmtree(out_dir, ignore_errors=True)
        hf = ("-", "-")
        if not args.skip_hf:
            hf_cache = workdir / f"hf-cache-{size}"
            shutil.rmtree(hf_cache, ignore_errors=True)
            hf_s, hf_peak, _ = fresh_peak([sys.executable, "-c", HF_MAP, str(path), str(tok), str(hf_cache)], env)
            shutil.rmtree(hf_cache, ignore_errors=True)
            hf = (f"{hf_s:.1f}", f"{hf_peak}")
        rows.append(f"| {size} MB | {tokens / 1e6:.1f} M | {enc_s:.1f} | {fast_s:.1f} | {cold['seconds']:.1f} | "
                    f"{enc_s / cold['seconds']:.2f} | {cold['trained'] / cold['targets']:.1%} | "
                    f"{cold['growth_mib']:.0f} | {warm['seconds']:.2f} | {warm['growth_mib']:.0f} | {step_s:.1f} | "
                    f"{hf[0]} | {hf[1]} |")
        print(rows[-1], flush=True)
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
