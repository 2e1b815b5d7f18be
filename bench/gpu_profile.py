"""Where a training step's GPU time goes, isotrain eager next to isotrain compiled (`train.compile=true`), on the
model and rows of bench/gpu_speed.py (a 1.1 B Llama, bf16 autocast, 4096-token rows, 8 rows per step).

    python bench/gpu_profile.py --out DIR              # on a machine with one NVIDIA GPU, about 2 minutes
    python bench/gpu_profile.py --out DIR --dry-run    # the same code on CPU with a tiny model (CPU operator times)

For each tool, torch.profiler records the timed steps after the warm-up; every GPU kernel's time is put into one
category by its name (matrix products, attention, the compiler's fused kernels, the optimizer, other elementwise and
reductions, copies, communication) and the table gives milliseconds per step and the share of each. "GPU busy" is
the kernels' time over the steps' wall time under the profiler: well under 100 % means the GPU waits on the host
(launches, syncs), which compiling shortens; near 100 % means the step is bound by its kernels, and compiling can
only shorten the non-matmul share. The attention operators' input shapes are listed too: a mask among them means
SDPA ran masked rather than causal. Writes DIR/gpu_profile.json and DIR/gpu_profile.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import SEED, GLOBAL_BATCH, isotrain_config, run_isotrain, setting, write_rows  # noqa: E402

TOOLS = ("isotrain eager", "isotrain compiled")
# First match wins; GPU kernel names (cuBLAS/CUTLASS, flash, Triton) and, in a dry run, CPU operator names.
CATEGORIES = [
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product"),
    ("compiled (Triton)", r"^triton|triton_"),
    ("matrix products", r"gemm|cutlass|nvjet|xmma|cublas|wgmma|aten::(mm|addmm|bmm|matmul|linear)$"),
    ("copies and casts", r"memcpy|memset|copy|aten::(to|_to_copy|copy_|clone)$"),
    ("elementwise and reductions", r"elementwise|vectorized|reduce|softmax|norm|aten::"),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def profile_tool(s, work: Path, tool: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=0, warmup=s.warmup, active=s.steps, repeat=1),
                   record_shapes=True)
    if tool == "isotrain compiled":
        torch._dynamo.reset()
    cfg = isotrain_config(s, work, tool.replace(" ", "-"), work / "rows.jsonl", compile_model=tool.endswith("compiled"))
    with prof:
        clock = run_isotrain(s, cfg, on_step=prof.step)
    wall_s = clock.ends[-1] - clock.ends[s.warmup - 1]
    by_category: dict[str, float] = {}
    kernels: dict[str, float] = {}
    attention_calls: dict[str, int] = {}
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if not on_gpu and re.match(r"aten::_?(scaled_dot_product|_?flash|_?efficient|_?cudnn)", event.name):
            # which kernel attention dispatched to, and with what: a mask (attn_bias) makes cuDNN's kernel slower
            call = f"{event.name} {event.input_shapes} {getattr(event, 'concrete_inputs', '')}"
            attention_calls[call] = attention_calls.get(call, 0) + 1
        if s.cuda and (not on_gpu or getattr(event, "is_user_annotation", False) or "#" in event.name
                       or event.name.startswith("ProfilerStep")):
            continue  # kernels only: the profiler's step and optimizer ranges are annotations, not GPU work
        if not s.cuda and (not event.name.startswith("aten::") or _inside_operator(event)):
            continue  # CPU: outermost operators only, so that nothing is counted twice
        us = event.time_range.elapsed_us() if on_gpu else event.cpu_time_total
        by_category[category(event.name)] = by_category.get(category(event.name), 0.0) + us
        kernels[event.name] = kernels.get(event.name, 0.0) + us
    busy_us = sum(by_category.values())
    per_step = lambda us: us / 1e3 / s.steps  # noqa: E731
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"tool": tool, "step_ms": wall_s * 1e3 / s.steps, "busy_ms": per_step(busy_us),
            "busy_share": busy_us / 1e6 / wall_s if wall_s > 0 else None,
            "categories": {k: per_step(v) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "attention_calls": [{"call": call[:400], "count": n} for call, n in sorted(attention_calls.items())],
            "top": [{"name": name[:120], "category": category(name), "ms_per_step": per_step(us)} for name, us in top]}


def _inside_operator(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def markdown(result: dict) -> str:
    unit = "GPU kernels" if result["device"] != "cpu" else "CPU operators (dry run)"
    lines = [f"# Step profile: {result['device']}, {result['date']}", "",
             f"torch {result['torch']}; {result['steps']} profiled steps after {result['warmup']} warm-up, "
             f"{GLOBAL_BATCH} rows of {result['seq_len']} tokens per step; times are {unit}.", ""]
    rows = result["rows"]
    names = sorted({c for row in rows for c in row["categories"]},
                   key=lambda c: -max(row["categories"].get(c, 0.0) for row in rows))
    lines += ["| ms per step | " + " | ".join(row["tool"] for row in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    for name in names:
        cells = [f"{row['categories'].get(name, 0.0):,.1f} ({row['categories'].get(name, 0.0) / row['busy_ms']:.0%})"
                 for row in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **busy (sum)** | " + " | ".join(f"{row['busy_ms']:,.1f}" for row in rows) + " |")
    lines.append("| step wall time | " + " | ".join(f"{row['step_ms']:,.1f}" for row in rows) + " |")
    lines.append("| busy / wall | " + " | ".join(f"{row['busy_share']:.1%}" for row in rows) + " |")
    lines.append("")
    for row in rows:
        lines += [f"## Top {len(row['top'])}: {row['tool']}", "", "| kernel | category | ms per step |", "|---|---|---:|"]
        lines += [f"| `{k['name']}` | {k['category']} | {k['ms_per_step']:,.2f} |" for k in row["top"]]
        lines += ["", f"Attention operators of {row['tool']} (name, input shapes, calls in the profiled steps):", ""]
        lines += [f"- `{c['call']}` × {c['count']}" for c in row["attention_calls"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Directory for gpu_profile.json / .md.")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, seconds.")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="These tools, in this order.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps per tool (compiling happens in them).")
    parser.add_argument("--steps", type=int, default=3, help="Profiled steps per tool.")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA GPU is visible: run this on a GPU machine, or pass --dry-run to check the script on CPU")
        return 2
    import datetime

    s = setting(args.dry_run, args.warmup, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    write_rows(work / "rows.jsonl", GLOBAL_BATCH * (s.warmup + s.steps), s.seq_len + 100)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": torch.cuda.get_device_name(0) if s.cuda else "cpu", "torch": torch.__version__,
              "warmup": s.warmup, "steps": s.steps, "seq_len": s.seq_len, "seed": SEED, "rows": []}
    for tool in args.tools:
        result["rows"].append(profile_tool(s, work, tool))
        (args.out / "gpu_profile.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu_profile.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
