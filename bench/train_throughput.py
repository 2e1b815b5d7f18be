"""Training throughput, side by side: a minimal PyTorch loop, isotrain and the Hugging Face Trainer.

All tools train the same fresh Llama (built by isotrain's `build_plain`, seed 0: vocab 8192, hidden
256, 4 layers, 4 heads / 4 kv heads, intermediate 688, untied embeddings; fp32) on the same token
ids (isotrain's own tokenized samples of a generated JSONL: every sample is exactly 256 tokens, so
no padding), 8 sequences per optimizer step, AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0, constant lr, gradient clipping at norm 1.0, with the same number of torch threads. The minimal
loop does the same maths by hand: HF's mean token loss / GA (every micro-batch has the same number of
trained tokens, so this is the global token mean), `clip_grad_norm_(1.0)`, fused AdamW (as isotrain and
the HF Trainer use on CPU).

    tokens/s = Σ non-padding input tokens / Σ step wall time, over the timed steps (warm-up excluded)

A step's time spans its forward/backward passes, gradient clipping and the optimizer step; building
the batch is outside it for every tool (isotrain: `step_s` of metrics.jsonl; HF Trainer: a callback
from `on_step_begin` to `on_step_end`; minimal loop: the same span by hand).

This machine's speed drifts by ±10 % over tens of seconds, more than the gaps measured, so the tools
are interleaved step by step: each runs its real loop in its own thread and they take turns (set-up
or one optimizer step per turn, only one thread running), so all tools sample the same drift. The
table shows the median over rounds of tokens/s and of each ratio taken within a round.

`--lengths NAME` trains on documents of long-tailed lengths instead (bench/sft_lengths.py says which
distribution and where its numbers come from; seeded): the same model, optimizer, clipping and loss (the
token mean over each optimizer step's trained tokens: HF's Trainer divides by the step's count of shifted
labels, isotrain by its global count), one epoch over the same documents for every tool:
- isotrain with data.packing=true: documents packed whole into rows of <= max_seq_len tokens, 2 rows per
  micro-batch; its global batch counts packed rows, so it is set to the number of rows that holds about
  16 documents (printed);
- the same, compiled (`train.compile=true`, unless --no-compile; every row padded to max_seq_len), and compiled
  with the chunked cross-entropy (`train.loss_chunk_tokens=1024`: the decoder layers and each loss chunk compiled);
- the HF Trainer with transformers' padding collator (`DataCollatorForLanguageModeling(mlm=False)`), and with
  `DataCollatorWithFlattening` (its packing: one row per micro-batch, position ids restarting per document):
  16 documents per step, 4 per micro-batch.
The steps of the tools therefore hold about, not exactly, the same documents; what is compared is the rate
over the same documents, real tokens/s = Σ real (non-padding) tokens / Σ step time over the timed steps.

    python bench/train_throughput.py [--steps 20] [--warmup 3] [--rounds 2] [--threads 2]
    python bench/train_throughput.py --lengths sharegpt [--steps 8] [--warmup 2]
    python bench/train_throughput.py --profile --ga 1   # where one step's time goes, per phase and per kind of op
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from isotrain.config import TrainConfig, build_config
from isotrain.data import GlobalBatchSampler, collate, prepare_dataset
from isotrain.data.packing import pack_examples
from isotrain.data.tokenize import Example
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain import session
from isotrain.recipes.sft import train
from isotrain.train.loss import loss_weights, token_losses
from isotrain.train.optim import build_optimizer
from isotrain.train.step import StepOptions, global_counts, grad_norm_and_clip, train_step
from sft_lengths import LENGTH_MODELS, document_lengths, length_summary, run_hf_variable, step_timer, write_documents

SEQ_LEN = 256
GLOBAL_BATCH = 8
ROW_CHARS = 300  # > SEQ_LEN: every row is truncated to exactly SEQ_LEN tokens (bos + 255 letters)
LLAMA = {
    "model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 688, "tie_word_embeddings": False,
}
LR, BETAS, EPS, SEED = 3e-4, (0.9, 0.95), 1e-8, 0
TARGET_VS_MINIMAL, TARGET_VS_HF = 0.98, 1.2
TARGET_VS_PADDED, TARGET_VS_FLATTENING = 1.5, 1.0  # --lengths: isotrain packed vs the HF Trainer's collators
CPU = torch.device("cpu")
# Optimizer implementation each tool uses (isotrain: train/optim.py; HF: its default `adamw_torch_fused`).
ADAMW_IMPL = {"minimal loop": "fused", "isotrain": "fused", "isotrain compile": "fused",
              "isotrain compile chunked": "fused", "HF Trainer": "fused"}
TARGET_COMPILED_VS_MINIMAL, TARGET_COMPILED_VS_FLATTENING = 1.15, 1.25  # train.compile=true rows
CHUNK_TOKENS = 1024  # train.loss_chunk_tokens of the "chunked" rows


def write_jsonl(path: Path, num_rows: int) -> None:
    """Rows of random lowercase letters; with a char tokenizer each is one token per letter."""
    rng = np.random.default_rng(SEED)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as f:
        for _ in range(num_rows):
            f.write(json.dumps({"text": "".join(rng.choice(letters, ROW_CHARS))}) + "\n")


def isotrain_config(work: Path, name: str, micro: int, steps: int, compile_model: bool, global_batch: int = GLOBAL_BATCH,
                    max_seq_len: int = SEQ_LEN, packing: bool = False, loss_chunk_tokens: int = 0):
    train_section = {
        "global_batch_size": global_batch, "micro_batch_size": micro, "max_steps": steps, "seed": SEED,
        "lr": LR, "schedule": "constant", "weight_decay": 0.0, "betas": list(BETAS), "eps": EPS,
        "grad_clip": 1.0, "log_every": 1,
    }
    if compile_model:
        train_section["compile"] = True
    if loss_chunk_tokens:
        train_section["loss_chunk_tokens"] = loss_chunk_tokens
    return build_config({
        "output_dir": str(work / "runs" / name),
        "model": {"config": dict(LLAMA)},
        "tokenizer": {"type": "char"},
        "data": {"path": str(work / "data.jsonl"), "format": "text", "max_seq_len": max_seq_len,
                 "cache_dir": str(work / "cache"), "packing": packing, "overflow": "truncate"},
        "eval": {"path": None},
        "train": train_section,
        "logging": {"progress": False},
    })


def shared_inputs(work: Path):
    """The tokenizer and samples isotrain trains on, for the other tools to use the same token ids."""
    cfg = isotrain_config(work, "shared", GLOBAL_BATCH, 1, False)
    texts = [json.loads(line)["text"] for line in (work / "data.jsonl").read_text().splitlines()]
    tokenizer = train_tokenizer(texts, "char", cfg.tokenizer.vocab_size)
    dataset = prepare_dataset(cfg.data, tokenizer, log=lambda *a, **k: None)
    if any(len(sample) != SEQ_LEN for sample in dataset.samples):
        raise SystemExit(f"every sample must be {SEQ_LEN} tokens long; the generated rows are too short")
    return cfg, tokenizer, dataset


def rate(tokens: list[int], seconds: list[float], warmup: int) -> float:
    return sum(tokens[warmup:]) / sum(seconds[warmup:])


def run_minimal(cfg, tokenizer, dataset, micro: int, steps: int, warmup: int, after_step) -> float:
    model = build_plain(cfg.model, tokenizer, SEED)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, SEED)
    ga = GLOBAL_BATCH // micro
    tokens, seconds = [], []
    for step in range(warmup + steps):
        batches = [collate([dataset[i] for i in index], tokenizer.pad_token_id)["input_ids"]
                   for index in sampler.micro_batches(step, 0, 1, micro)]
        start = time.perf_counter()
        for input_ids in batches:
            loss = model(input_ids=input_ids, labels=input_ids).loss / ga  # HF shifts the labels itself
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the same clipping as isotrain's grad_clip=1.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(b.numel() for b in batches))  # no padding: every sample is SEQ_LEN tokens
        after_step()
    return rate(tokens, seconds, warmup)


_thread_local = threading.local()


class TurnTakingWriter(session.MetricsWriter):
    """isotrain's metrics writer; after each step's row (log_every=1) it hands the turn on."""

    def write(self, row: dict) -> None:
        super().write(row)
        _thread_local.after_step()


def run_isotrain(work: Path, name: str, micro: int, steps: int, warmup: int, compile_model: bool, after_step,
                 **config) -> float:
    if compile_model:
        torch._dynamo.reset()  # a fresh model per run must not run into dynamo's recompile limit
    cfg = isotrain_config(work, name, micro, warmup + steps, compile_model, **config)
    _thread_local.after_step = after_step
    session.MetricsWriter = TurnTakingWriter  # the only hook the session offers; the step itself is untouched
    train(cfg, console=Console(file=io.StringIO()))
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    tokens = [row["tokens_seen"] - (rows[i - 1]["tokens_seen"] if i else 0) for i, row in enumerate(rows)]
    return rate(tokens, [row["step_s"] for row in rows], warmup)


def run_hf_trainer(work: Path, name: str, cfg, tokenizer, dataset, micro: int, steps: int, warmup: int, after_step):
    from transformers import PrinterCallback, Trainer, TrainingArguments, default_data_collator


    model = build_plain(cfg.model, tokenizer, SEED)
    rows = [{"input_ids": torch.from_numpy(s.input_ids), "labels": torch.from_numpy(s.input_ids)}
            for s in dataset.samples]
    args = TrainingArguments(
        output_dir=str(work / "runs" / name), per_device_train_batch_size=micro,
        gradient_accumulation_steps=GLOBAL_BATCH // micro, max_steps=warmup + steps, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, max_grad_norm=1.0, report_to=[], logging_steps=10**6, save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, seed=SEED, disable_tqdm=True,
    )
    timer = step_timer(after_step)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                      callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary would break up the table
    trainer.train()
    return rate([GLOBAL_BATCH * SEQ_LEN] * len(timer.seconds), timer.seconds, warmup)


def has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("HF Trainer rows skipped: transformers.Trainer needs accelerate (pip install accelerate)")
        return False
    return True


def run_tool(tool: str, args, work: Path, name: str, shared, micro: int, after_step) -> float:
    if tool == "minimal loop":
        return run_minimal(*shared, micro, args.steps, args.warmup, after_step)
    if tool == "HF Trainer":
        return run_hf_trainer(work, name, *shared, micro, args.steps, args.warmup, after_step)
    compiled = tool.startswith("isotrain compile")
    warmup = args.warmup + (args.compile_warmup if compiled else 0)
    return run_isotrain(work, name, micro, args.steps, warmup, compiled, after_step,
                        loss_chunk_tokens=CHUNK_TOKENS if tool.endswith("chunked") else 0)


class Turns:
    """Round-robin turns between tool threads: exactly one of them works at any time."""

    def __init__(self, names: list[str]):
        self._cond = threading.Condition()
        self._order, self._index = list(names), 0

    def _is_turn(self, name: str) -> bool:
        return self._order[self._index] == name

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._is_turn(name))

    def pass_on(self, name: str) -> None:
        with self._cond:
            self._index = (self._index + 1) % len(self._order)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._is_turn(name))

    def leave(self, name: str) -> None:
        with self._cond:  # called on this tool's turn: the index then names the next tool
            self._order.remove(name)
            self._index = self._index % len(self._order) if self._order else 0
            self._cond.notify_all()


def run_in_turns(tools: list[str], num_threads: int, run_one) -> dict:
    """`run_one(tool, pass_on)` for every tool at once, each in its own thread, in turns of one step."""
    turns, results, errors = Turns(tools), {}, []

    def worker(tool: str) -> None:
        turns.wait(tool)
        try:
            torch.set_num_threads(num_threads)  # per thread: OpenMP's thread count is a per-thread setting
            results[tool] = run_one(tool, lambda: turns.pass_on(tool))
            if torch.get_num_threads() != num_threads:
                print(f"warning: {tool} changed torch threads to {torch.get_num_threads()}")
        except BaseException as err:  # re-raised below, after the other tools finished
            errors.append(err)
        finally:
            turns.leave(tool)

    threads = [threading.Thread(target=worker, args=(tool,), name=tool) for tool in tools]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def run_interleaved(tools: list[str], args, work: Path, shared, ga: int, round_index: int) -> dict[str, float]:
    """tokens/s of each tool, all trained at once in turns of one optimizer step."""

    def run_one(tool: str, pass_on) -> float:
        name = f"{tool.replace(' ', '_')}_ga{ga}_r{round_index}"
        return run_tool(tool, args, work, name, shared, GLOBAL_BATCH // ga, pass_on)

    return run_in_turns(tools, args.threads, run_one)


def run_all(args, work: Path) -> dict[tuple[str, int], list[float]]:
    write_jsonl(work / "data.jsonl", GLOBAL_BATCH * (args.warmup + args.compile_warmup + args.steps))
    shared = shared_inputs(work)
    tools = ["minimal loop", "isotrain"]
    if args.compile and "compile" in TrainConfig.model_fields:
        tools += ["isotrain compile", "isotrain compile chunked"]
    if has_accelerate():
        tools.append("HF Trainer")
    results: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for ga in args.ga:
            # Odd rounds reverse the turn order, so no tool always follows the same neighbour.
            order = tools if round_index % 2 == 0 else tools[::-1]
            for tool, value in run_interleaved(order, args, work, shared, ga, round_index).items():
                results.setdefault((tool, ga), []).append(value)
                print(f"round {round_index + 1} GA {ga} {tool:<16} {value:8.0f} tokens/s", flush=True)
    return results


def paired_ratio(values: list[float], reference: list[float] | None) -> str:
    """Median (min-max) over rounds of value / reference of the same round: pairs cancel slow drift."""
    if not reference:
        return "-"
    ratios = [value / ref for value, ref in zip(values, reference)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def print_table(results: dict[tuple[str, int], list[float]], gas: list[int]) -> None:
    print(f"\ntargets: isotrain >= {TARGET_VS_MINIMAL} x minimal loop and >= {TARGET_VS_HF} x HF Trainer (same GA); "
          f"compiled >= {TARGET_COMPILED_VS_MINIMAL} x minimal loop")
    print("ratios: median (min-max) over rounds of the ratio within each round")
    print("| tool | GA x micro | AdamW | tokens/s median (min-max) | vs minimal loop | vs HF Trainer |")
    print("|---|---|---|---:|---:|---:|")
    for (tool, ga), values in sorted(results.items(), key=lambda item: gas.index(item[0][1])):
        print(f"| {tool} | {ga} x {GLOBAL_BATCH // ga} | {ADAMW_IMPL[tool]} | {statistics.median(values):.0f} "
              f"({min(values):.0f}-{max(values):.0f}) | {paired_ratio(values, results.get(('minimal loop', ga)))} | "
              f"{paired_ratio(values, results.get(('HF Trainer', ga)))} |")


DOCS_PER_STEP, DOCS_PER_MICRO = 16, 4  # --lengths: documents per optimizer step, per HF micro-batch
PACKED_ROWS_PER_MICRO = 2  # isotrain packed rows (of max_seq_len tokens) per micro-batch
LENGTH_TOOLS = ["isotrain packed", "HF Trainer padded", "HF Trainer flattening"]


def lengths_inputs(args, work: Path) -> dict:
    """Documents of `--lengths` and the packed global batch (in rows) that holds about DOCS_PER_STEP of them."""
    lengths = document_lengths(args.lengths, DOCS_PER_STEP * (args.warmup + args.steps), SEED)
    write_documents(work / "data.jsonl", lengths, SEED)
    max_seq_len = LENGTH_MODELS[args.lengths].max_seq_len
    cfg = isotrain_config(work, "shared", 1, 1, False, global_batch=1, max_seq_len=max_seq_len)
    texts = [json.loads(line)["text"] for line in (work / "data.jsonl").read_text().splitlines()]
    tokenizer = train_tokenizer(texts, "char", cfg.tokenizer.vocab_size)
    dataset = prepare_dataset(cfg.data, tokenizer, log=lambda *a, **k: None)  # one sample per document
    documents = [sample.input_ids.tolist() for sample in dataset.samples]
    if sorted(map(len, documents)) != sorted(lengths.tolist()):
        raise SystemExit("isotrain's tokenized documents do not have the drawn lengths")
    # The rows isotrain's run packs (pack_examples is deterministic in the lengths and their order).
    rows = pack_examples([Example(np.asarray(d), np.asarray(d), i) for i, d in enumerate(documents)], max_seq_len)
    rows_per_step = max(1, round(len(rows) * DOCS_PER_STEP / len(documents) / PACKED_ROWS_PER_MICRO))
    global_rows = rows_per_step * PACKED_ROWS_PER_MICRO
    iso_steps = len(rows) // global_rows
    # Real share of isotrain's slots: collate pads each micro-batch's rows to its longest.
    sampler = GlobalBatchSampler(len(rows), global_rows, SEED)
    micro_batches = [[len(rows[i]) for i in index] for step in range(iso_steps)
                     for index in sampler.micro_batches(step, 0, 1, PACKED_ROWS_PER_MICRO)]
    real_tokens = sum(map(sum, micro_batches))
    real_share = real_tokens / sum(len(mb) * max(mb) for mb in micro_batches)
    return {"cfg": cfg, "tokenizer": tokenizer, "documents": documents, "lengths": lengths, "num_rows": len(rows),
            "global_rows": global_rows, "max_seq_len": max_seq_len, "iso_steps": iso_steps,
            "iso_real_share": real_share,
            "iso_real_share_fixed": real_tokens / (sum(map(len, micro_batches)) * max_seq_len)}


def run_lengths_tool(tool: str, args, work: Path, inputs: dict, name: str, after_step) -> tuple[float, float]:
    """(real tokens/s over the timed steps, real share of the tensor slots) of one tool, one epoch."""
    if tool.startswith("isotrain packed"):
        compiled = tool.startswith("isotrain packed compile")
        warmup = args.warmup + (args.compile_warmup if compiled else 0)
        rate = run_isotrain(work, name, PACKED_ROWS_PER_MICRO, inputs["iso_steps"] - warmup, warmup, compiled,
                            after_step, global_batch=inputs["global_rows"], max_seq_len=inputs["max_seq_len"],
                            packing=True, loss_chunk_tokens=CHUNK_TOKENS if tool.endswith("chunked") else 0)
        # Compiled, every row is padded to max_seq_len (recipes/sft.py): one shape to compile.
        return rate, inputs["iso_real_share_fixed" if compiled else "iso_real_share"]
    hparams = {"learning_rate": LR, "lr_scheduler_type": "constant", "weight_decay": 0.0, "adam_beta1": BETAS[0],
               "adam_beta2": BETAS[1], "adam_epsilon": EPS, "max_grad_norm": 1.0, "seed": SEED}
    model = build_plain(inputs["cfg"].model, inputs["tokenizer"], SEED)
    rate, real_share = run_hf_variable(work, name, model, inputs["tokenizer"], inputs["documents"],
                                       tool == "HF Trainer flattening", DOCS_PER_MICRO,
                                       DOCS_PER_STEP // DOCS_PER_MICRO, hparams, args.warmup, after_step)
    return rate, real_share


def run_lengths(args, work: Path) -> tuple[dict, dict]:
    inputs = lengths_inputs(args, work)
    print(f"lengths {args.lengths}: {LENGTH_MODELS[args.lengths].source}; {length_summary(inputs['lengths'])}")
    print(f"isotrain packs them into {inputs['num_rows']} rows of <= {inputs['max_seq_len']} tokens: "
          f"{inputs['global_rows']} rows per step ({inputs['global_rows'] * len(inputs['documents']) / inputs['num_rows']:.1f} "
          f"documents), {inputs['iso_steps']} steps; HF: {DOCS_PER_STEP} documents per step, "
          f"{len(inputs['documents']) // DOCS_PER_STEP} steps", flush=True)
    tools = LENGTH_TOOLS if has_accelerate() else LENGTH_TOOLS[:1]
    if args.compile:
        tools = tools[:1] + ["isotrain packed compile", "isotrain packed compile chunked"] + tools[1:]
    rates: dict[str, list[float]] = {}
    shares: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        order = tools if round_index % 2 == 0 else tools[::-1]

        def run_one(tool: str, pass_on):
            return run_lengths_tool(tool, args, work, inputs, f"{tool.replace(' ', '_')}_r{round_index}", pass_on)

        for tool, (rate_value, share) in run_in_turns(order, args.threads, run_one).items():
            rates.setdefault(tool, []).append(rate_value)
            shares.setdefault(tool, []).append(share)
            print(f"round {round_index + 1} {tool:<22} {rate_value:8.0f} real tokens/s", flush=True)
    return rates, shares


def print_lengths_table(rates: dict, shares: dict) -> None:
    print(f"\ntargets: isotrain packed >= {TARGET_VS_PADDED} x HF Trainer padded and >= {TARGET_VS_FLATTENING} x "
          f"HF Trainer flattening; packed + compiled >= {TARGET_COMPILED_VS_FLATTENING} x HF Trainer flattening")
    print("ratios: median (min-max) over rounds of the ratio within each round")
    print("| tool | real tokens/s median (min-max) | real share of slots | vs HF padded | vs HF flattening |")
    print("|---|---:|---:|---:|---:|")
    for tool, values in rates.items():
        share = f"{statistics.median(shares[tool]):.2f}"
        print(f"| {tool} | {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f}) | {share} | "
              f"{paired_ratio(values, rates.get('HF Trainer padded'))} | "
              f"{paired_ratio(values, rates.get('HF Trainer flattening'))} |")


def _timed(phases: dict, name: str, fn):
    start = time.perf_counter()
    out = fn()
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
    return out


def isotrain_phases(model, optimizer, micro_samples, pad_id: int, phases: dict) -> None:
    """isotrain's step (train/step.py) cut into phases, with its own functions, single process."""
    params = list(model.parameters())
    micro_batches = _timed(phases, "collate", lambda: [collate(s, pad_id) for s in micro_samples])
    counts = _timed(phases, "global counts (all-reduce no-op)", lambda: global_counts(micro_batches, "token", CPU))
    for mb in micro_batches:
        logits = _timed(phases, "forward", lambda: model(
            input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits)

        def loss_fn():
            weights, _ = loss_weights(mb["labels"], mb["segment_ids"], "token")
            return (token_losses(logits, mb["labels"]) * weights).sum() / counts[2]

        loss = _timed(phases, "loss (CE none x weights)", loss_fn)
        _timed(phases, "backward", loss.backward)
    _timed(phases, "grad norm + clip", lambda: grad_norm_and_clip(params, 1.0))
    _timed(phases, "AdamW step + zero_grad", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))


def minimal_phases(model, optimizer, micro_samples, pad_id: int, phases: dict) -> None:
    batches = [collate(s, pad_id)["input_ids"] for s in micro_samples]
    for input_ids in batches:
        loss = _timed(phases, "forward + HF loss", lambda: model(input_ids=input_ids, labels=input_ids).loss)
        loss = loss / len(batches)
        _timed(phases, "backward", loss.backward)
    _timed(phases, "clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    _timed(phases, "AdamW step + zero_grad", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))


def profile(args, work: Path) -> None:
    """Median ms per optimizer step of each phase; isotrain, the minimal loop and whole steps interleaved."""
    write_jsonl(work / "data.jsonl", GLOBAL_BATCH * 4)
    cfg, tokenizer, dataset = shared_inputs(work)
    micro, pad_id = GLOBAL_BATCH // args.ga[0], tokenizer.pad_token_id
    micro_samples = [dataset.samples[i : i + micro] for i in range(0, GLOBAL_BATCH, micro)]
    model = build_plain(cfg.model, tokenizer, SEED)
    iso_opt = build_optimizer(model, TrainConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
    fused_opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    foreach_opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)
    options = StepOptions(loss_reduction="token", grad_clip=1.0)

    def whole_step(optimizer):
        return lambda ph: _timed(ph, "step", lambda: train_step(
            model, optimizer, [collate(s, pad_id) for s in micro_samples], LR, options, CPU))

    runs = {  # all on one model: the phases' cost does not depend on the weights' values
        f"isotrain ({ADAMW_IMPL['isotrain']} AdamW)": lambda ph: isotrain_phases(model, iso_opt, micro_samples, pad_id, ph),
        "isotrain train_step, whole": whole_step(iso_opt),
        "isotrain train_step, whole, foreach AdamW": whole_step(foreach_opt),
        "minimal loop (fused AdamW)": lambda ph: minimal_phases(model, fused_opt, micro_samples, pad_id, ph),
    }
    samples: dict[str, list[dict]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, run in runs.items():
            phases: dict = {}
            run(phases)
            if step >= args.warmup:
                samples[name].append(phases)
    print(f"\nprofile, GA {args.ga[0]} x micro {micro}: median ms per optimizer step over {args.steps} steps")
    for name, steps in samples.items():
        totals = [sum(p.values()) for p in steps]
        parts = ", ".join(f"{phase} {1e3 * statistics.median(p[phase] for p in steps):.1f}" for phase in steps[0])
        print(f"{name}: total {1e3 * statistics.median(totals):.1f} = {parts}")
    op_shares(lambda: minimal_phases(model, fused_opt, micro_samples, pad_id, {}), args.steps)


# aten ops by what a compiler can do about them: matmuls and attention run in the same library kernels compiled
# or not; the rest (norms, activations, rotary, residual adds, the loss's elementwise work, copies) is what
# inductor can fuse.
OP_KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
            "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                          "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
            "AdamW": ("aten::_fused_adamw_",)}


def op_shares(step, steps: int) -> None:
    """Share of an eager step's operator time by kind (torch.profiler, self CPU time of the aten ops), and what
    that leaves a compiler: if it removed all the time outside matmuls and attention, a step would be at most
    1 / (their share) times faster."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    kinds = dict.fromkeys([*OP_KINDS, "other aten ops"], 0.0)
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        kind = next((k for k, names in OP_KINDS.items() if event.key in names), "other aten ops")
        kinds[kind] += event.self_cpu_time_total
    total = sum(kinds.values())
    print(f"\nminimal loop, eager: operator time by kind over {steps} steps (self CPU time of aten ops)")
    for kind, us in kinds.items():
        print(f"  {kind:<15} {us / 1e3 / steps:8.1f} ms per step  {us / total:6.1%}")
    library = (kinds["matmul"] + kinds["attention"]) / total
    print(f"  matmul + attention: {library:.1%}; a compiler that removed all the rest would be at most "
          f"{1 / library:.2f} x faster")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="Timed optimizer steps per run.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed optimizer steps at the start of each run.")
    parser.add_argument("--compile-warmup", type=int, default=2, help="Extra untimed steps for compiled runs.")
    parser.add_argument("--rounds", type=int, default=2, help="Repetitions; the median is reported.")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every tool.")
    parser.add_argument("--ga", type=int, nargs="+", default=[1, 4], help="Gradient-accumulation steps to run.")
    parser.add_argument("--profile", action="store_true", help="Time the phases of one step (first --ga) instead.")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="Skip the isotrain compile rows.")
    parser.add_argument("--lengths", choices=sorted(LENGTH_MODELS),
                        help="Long-tailed document lengths (bench/sft_lengths.py): isotrain packed vs the HF Trainer "
                             "padded and with DataCollatorWithFlattening, in real tokens/s.")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="isotrain-bench-") as tmp:
        if args.profile:
            return profile(args, Path(tmp))
        if args.lengths:
            return print_lengths_table(*run_lengths(args, Path(tmp)))
        results = run_all(args, Path(tmp))
    print_table(results, args.ga)


if __name__ == "__main__":
    main()
