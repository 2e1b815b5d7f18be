"""The GPU check: isotrain's promises and speed on one CUDA GPU, in one command of at most 8 minutes.

    python bench/gpu_check.py --out DIR              # on a machine with one NVIDIA GPU
    python bench/gpu_check.py --out DIR --dry-run    # the same code on CPU with tiny models, in seconds (CI runs it)
    python bench/gpu_check.py --out DIR --only tests # or memory / speed: a part again

It writes DIR/gpu_check.json and DIR/gpu_check.md (rewritten after every part, so a run cut short keeps what it
measured), DIR/cuda_tests.log and DIR/cuda_tests.xml. Parts, in this order:
1. tests: `pytest -m cuda tests/cuda` (tests/cuda/test_cuda.py says what each test proves), started in the
   background while part 2 runs (which reads only its own process's allocations);
2. memory: the memory estimate's terms against the same terms read off a live run, and its total beside
   `torch.cuda.max_memory_allocated` (bench/gpu_memory.py);
3. speed: tokens/s, MFU and peak memory of isotrain eager, packed and compiled next to a minimal PyTorch loop and
   the Hugging Face Trainer on a 1.1 B Llama, bf16, 4096-token rows (bench/gpu_speed.py), after the tests ended.
Exit status 0 when every test passed and every term agreed, 1 otherwise (the tables say what failed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tests", "memory", "speed")
SPEED_TOOLS = ["minimal loop", "isotrain eager", "HF Trainer", "isotrain packed", "isotrain packed varlen",
               "minimal loop (again)", "isotrain compiled"]


def environment() -> dict:
    import torch
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": "cpu", "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
    return env


def start_tests(out: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "tests/cuda", "-m", "cuda", "-o", "addopts=", "-p", "no:cacheprovider",
               "-ra", "-q", f"--junitxml={out / 'cuda_tests.xml'}"]
    log = (out / "cuda_tests.log").open("w")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish_tests(proc: subprocess.Popen, out: Path, timeout_s: float) -> dict:
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the test runs below it too
        proc.wait()
        timed_out = True
    cases = []
    report = out / "cuda_tests.xml"
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    detail = (found.get("message") or "").partition("\n")[0][:200]
                    break
            cases.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                          "detail": detail})
    return {"returncode": proc.returncode, "timed_out": timed_out, "cases": cases}


def tests_ok(tests: dict, dry_run: bool) -> bool:
    if tests["timed_out"] or not tests["cases"]:
        return False
    wanted = {"skipped"} if dry_run else {"passed"}
    return all(case["outcome"] in wanted for case in tests["cases"])


def memory_ok(memory: list[dict]) -> bool:
    return all(term["ok"] is not False for setting in memory for term in setting["terms"])


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# GPU check: {env['device']}, {env['date']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, Python {env['python']}, "
             f"{env['cpus']} CPUs" + (" — dry run (CPU, tiny models)" if result["dry_run"] else ""), ""]
    tests = result.get("tests")
    if tests:
        counts = {}
        for case in tests["cases"]:
            counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test reported"
        lines += [f"## CUDA tests: {summary}" + (" (timed out)" if tests["timed_out"] else ""), "",
                  "| test | outcome | s | detail |", "|---|---|---:|---|"]
        lines += [f"| {c['test']} | {c['outcome']} | {c['seconds']:.1f} | {c['detail']} |" for c in tests["cases"]]
        lines.append("")
    for setting in result.get("memory", []):
        title = (f"## Memory: {setting['dtype']}, activation checkpointing {setting['activation_checkpointing']}, "
                 f"micro-batch {setting['micro_batch']} × {setting['seq']}")
        lines += [title, "", "| term | estimate MB | measured MB | within 5 % (states: exact) |", "|---|---:|---:|---|"]
        for term in setting["terms"]:
            verdict = {True: "yes", False: "**no**", None: "not measured"}[term["ok"]]
            lines.append(f"| {term['term']} | {_mb(term['estimated'])} | {_mb(term['measured'])} | {verdict} |")
        peak = setting["peak_bytes"]
        ratio = f"{peak / setting['estimated_total_bytes']:.3f}" if peak else "-"
        lines += [f"| total / max_memory_allocated | {_mb(setting['estimated_total_bytes'])} | {_mb(peak)} | "
                  f"measured / estimate {ratio} |", ""]
    speed = result.get("speed")
    if speed:
        lines += [f"## Throughput: bf16, one {env['device']}, {speed['seq_len']}-token rows", "", "| tool | tokens/s | MFU | peak memory GB | s attended |",
                  "|---|---:|---:|---:|---:|"]
        for row in speed["rows"]:
            if "skipped" in row:
                lines.append(f"| {row['tool']} | skipped: {row['skipped']} | | | |")
                continue
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            peak = f"{row['peak_memory_bytes'] / 1e9:.1f}" if row["peak_memory_bytes"] else "-"
            lines.append(f"| {row['tool']} | {row['tokens_per_s']:,.0f} | {mfu} | {peak} | {row['attended_length']:,.0f} |")
        lines.append("")
        lines += [f"- {name}: {value:.3f}" for name, value in speed["ratios"].items()]
        lines.append("")
    for part, error in result.get("errors", {}).items():
        lines += [f"## {part}: failed", "", "```", error, "```", ""]
    lines += [f"Parts took: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items()), ""]
    return "\n".join(lines)


def write(out: Path, result: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(markdown(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Directory for gpu_check.json / .md and test logs.")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny models, a few seconds.")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="Run only these parts.")
    parser.add_argument("--tools", nargs="+", choices=SPEED_TOOLS, help="Speed: these tools only, in this order.")
    parser.add_argument("--warmup", type=int, default=2, help="Speed: untimed steps per tool.")
    parser.add_argument("--steps", type=int, default=5, help="Speed: timed steps per tool.")
    parser.add_argument("--tests-timeout", type=float, default=330.0, help="Seconds the CUDA tests may take.")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="Seconds for the whole check: speed tools that would end after it are skipped.")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1: the timed steps start where a warm-up step ended")
    sys.path[:0] = [str(Path(__file__).parent), str(REPO)]  # the sibling bench modules; isotrain, installed or not

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU is visible; run on a GPU machine, or pass --dry-run to check the script on CPU")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # runs, caches and models stay out of --out
    os.environ.setdefault("ISOTRAIN_CACHE", str(work / "cache"))
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    result = {"dry_run": args.dry_run, "environment": environment(), "seconds": {}, "errors": {}}
    write(args.out, result)
    tests_proc = start_tests(args.out) if "tests" in args.only else None
    started = time.perf_counter()

    if "memory" in args.only:
        import gpu_memory

        def report_memory(rows):
            result["memory"] = rows
            write(args.out, result)

        try:
            gpu_memory.run(args.dry_run, device, report_memory)
        except Exception:  # the other parts still run; the table shows the error
            result["errors"]["memory"] = traceback.format_exc()[-3000:]
        result["seconds"]["memory"] = time.perf_counter() - started
    if tests_proc is not None:
        result["tests"] = finish_tests(tests_proc, args.out, max(args.tests_timeout - (time.perf_counter() - started), 1))
        result["seconds"]["tests"] = time.perf_counter() - started
        write(args.out, result)
    if "speed" in args.only:
        import gpu_speed

        begun = time.perf_counter()
        setting = gpu_speed.setting(args.dry_run, args.warmup, args.steps)
        tools = [t for t in args.tools or SPEED_TOOLS
                 if not (args.dry_run and t == "isotrain compiled")]  # compiling takes minutes on CPU

        def report_speed(rows):
            result["speed"] = {"rows": rows, "ratios": gpu_speed.ratios(rows), "warmup": setting.warmup,
                               "steps": setting.steps, "model": setting.model, "seq_len": setting.seq_len}
            write(args.out, result)

        try:
            gpu_speed.measure(setting, work / "speed", tools, report_speed, deadline=started + args.budget_s)
        except Exception:
            result["errors"]["speed"] = traceback.format_exc()[-3000:]
        result["seconds"]["speed"] = time.perf_counter() - begun
    shutil.rmtree(work, ignore_errors=True)
    write(args.out, result)
    print(markdown(result))
    ok = not result["errors"] and ("tests" not in result or tests_ok(result["tests"], args.dry_run)) and memory_ok(result.get("memory", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
