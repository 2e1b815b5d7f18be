"""`isotrain ckpt list|inspect|verify|export|merge`: print what inspection.py, export.py and merge.py find."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from collections import defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table



def _console() -> Console:
    # Piped output (grep, files) keeps whole tensor names instead of rich's 80-column default.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def human_bytes(num: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num} B"


def _first_names(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def cmd_list(args) -> int:
    from isotrain.ckpt.inspection import list_run

    listing = list_run(args.run_dir)
    console = _console()
    if not (listing.checkpoints or listing.leftovers or listing.set_aside):
        console.print(f"{escape(str(listing.root))} holds no checkpoints")
        return 0
    table = Table(title=escape(str(listing.root)), title_justify="left")
    for column in ("checkpoint", "step", "tokens seen", "trained tokens", "samples", "size", "status"):
        table.add_column(column, justify="left" if column in ("checkpoint", "status") else "right",
                         no_wrap=column == "checkpoint", overflow="fold")
    for row in listing.checkpoints:
        status = "[green]ok[/]" if row.problem is None else f"[red]invalid:[/] {escape(row.problem)}"
        if row.latest:
            status += " (latest)"
        counters = [f"{row.counters[k]:,}" if k in row.counters else "-"
                    for k in ("tokens_seen", "trained_tokens", "samples_seen")]
        table.add_row(row.path.name, str(row.step), *counters, human_bytes(row.num_bytes), status)
    for path, num_bytes in listing.leftovers:
        table.add_row(path.name, "-", "-", "-", "-", human_bytes(num_bytes),
                      "[yellow]leftover of an interrupted save or rotation; removed when a run starts here[/]")
    for path, num_bytes in listing.set_aside:
        table.add_row(path.name, "-", "-", "-", "-", human_bytes(num_bytes),
                      "[yellow]set aside when the run resumed from an older checkpoint; never resumed from; "
                      "delete it when not needed[/]")
    console.print(table)
    console.print("status checks sizes and headers; `isotrain ckpt verify DIR` also checks every hash (BLAKE3)")
    return 0


def _layout_text(layout: dict | None) -> str:
    if not layout:
        return "unknown"
    parts = [f"{layout.get('world_size', '?')} process(es)"]
    parts += [f"{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp") if k in layout]
    return ", ".join(parts)


def cmd_inspect(args) -> int:
    from isotrain.ckpt.inspection import inspect_checkpoint

    found = inspect_checkpoint(args.directory)
    console = _console()
    info, state = found.manifest, found.state
    console.print(f"[bold]{escape(str(found.path))}[/]: {info.get('kind', '?')}, step {info.get('step', '?')}, "
                  f"saved from {_layout_text(info.get('layout'))}")
    if state:
        counters = ", ".join(f"{k} {state[k]:,}" for k in ("tokens_seen", "trained_tokens", "samples_seen") if k in state)
        console.print(f"model dtype {state.get('model_dtype', '?')}; optimizer "
                      f"{state.get('optimizer', {}).get('type', '?')}; {counters}")
    params = sum(math.prod(t.shape) for t in found.model)
    console.print(f"{params:,} parameters in {len(found.model)} tensors ({human_bytes(sum(t.num_bytes for t in found.model))}); "
                  f"{len(found.files)} files, {human_bytes(sum(found.files.values()))} in all")
    if found.experts:
        console.print(f"experts: {escape(found.experts)}")

    tensors = Table(title="model tensors", title_justify="left")
    for column in ("name", "dtype", "shape", "bytes", "file"):
        tensors.add_column(column, justify="right" if column == "bytes" else "left", overflow="fold")
    for t in found.model:
        tensors.add_row(escape(t.name), t.dtype, str(tuple(t.shape)), human_bytes(t.num_bytes), escape(t.file))
    console.print(tensors)

    if found.optimizer:
        groups: dict[tuple[str, str], list] = defaultdict(list)
        for t in found.optimizer:
            groups[(t.name.split(".", 1)[0], t.dtype)].append(t)
        state_table = Table(title="training state tensors (per parameter name, full logical shape)",
                            title_justify="left")
        for column in ("state", "dtype", "tensors", "bytes"):
            state_table.add_column(column, justify="left" if column in ("state", "dtype") else "right")
        for (kind, dtype), items in sorted(groups.items()):
            state_table.add_row(kind, dtype, str(len(items)), human_bytes(sum(t.num_bytes for t in items)))
        console.print(state_table)

    files = Table(title="files", title_justify="left")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    for name, num_bytes in sorted(found.files.items()):
        files.add_row(escape(name), human_bytes(num_bytes))
    console.print(files)
    return 0


def cmd_verify(args) -> int:
    from isotrain.checkpoint.manifest import is_legacy, read_manifest, verify_checkpoint

    problems = verify_checkpoint(args.directory, hash_files=not args.no_hash)
    if problems:
        err = Console(stderr=True, highlight=False)
        err.print(f"[bold red]error:[/] {escape(problems[0])}; this checkpoint cannot be trusted: "
                  f"resume from or export another one (`isotrain ckpt list RUN_DIR`)", soft_wrap=True)
        for problem in problems[1:]:
            err.print(f"  also: {escape(problem)}", soft_wrap=True)
        return 1
    manifest = read_manifest(args.directory)
    files = manifest["files"]
    total = sum(spec["bytes"] for spec in files.values())
    hashed = "sha256" if is_legacy(manifest) else "BLAKE3"
    checked = "sizes and headers" if args.no_hash else f"sizes, {hashed}, headers and indexes"
    _console().print(f"[green]valid[/]: {escape(str(args.directory))} ({len(files)} files, "
                                   f"{human_bytes(total)}; {checked} checked)")
    return 0


def cmd_export(args) -> int:
    from isotrain.ckpt.export import export_adapter, export_checkpoint
    from isotrain.errors import CheckpointError

    if args.adapter:
        if args.dtype or args.drop_keys:
            raise CheckpointError("--adapter exports the LoRA tensors as trained (fp32); leave out --dtype and "
                                  "--drop-keys")
        report = export_adapter(args.directory, args.out)
        _console().print(f"exported the LoRA adapter ({report.num_tensors} tensors, "
                         f"{human_bytes(report.source_model_bytes)}) to {escape(str(report.out))}; load it with "
                         "peft.PeftModel.from_pretrained(base_model, path)")
        return 0
    if args.max_shard_gb <= 0:
        raise CheckpointError(f"--max-shard-gb {args.max_shard_gb} must be positive, e.g. 5")
    report = export_checkpoint(args.directory, args.out, args.dtype, args.drop_keys, int(args.max_shard_gb * 1e9))
    console = _console()
    source = "fp32 master weights" if report.from_master else "model weights"
    console.print(f"exported {report.num_tensors} tensors ({source}) as {report.dtype} to {escape(str(report.out))}")
    if report.dropped:
        shown = _first_names(report.dropped)
        console.print(f"dropped {len(report.dropped)} tensors matching {escape(repr(args.drop_keys))}: {escape(shown)}")
    console.print(f"size: {human_bytes(report.source_bytes)} checkpoint (model files {human_bytes(report.source_model_bytes)}) "
                  f"-> {human_bytes(report.out_bytes)} exported")
    return 0


def cmd_merge(args) -> int:
    from isotrain.ckpt.merge import merge_models, read_recipe

    report = merge_models(read_recipe(args.recipe), processes=args.processes)
    console = _console()
    console.print(f"merged {report.merged} tensors -> {escape(str(report.out))}"
                  + (f"; {len(report.kept_from_base)} copied from the base" if report.kept_from_base else ""))
    if report.dropped:
        shown = _first_names(report.dropped)
        console.print(f"dropped {len(report.dropped)} tensors ({human_bytes(report.dropped_bytes)}): {escape(shown)}")
    console.print(f"size: {human_bytes(report.reference_bytes)} reference weights -> {human_bytes(report.out_bytes)} "
                  f"written; peak memory {human_bytes(report.peak_rss_bytes)}; recipe and input hashes in merge.json")
    return 0


def add_parser(commands) -> None:
    ckpt = commands.add_parser("ckpt", help="list, inspect, verify, export and merge checkpoints")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)

    listing = sub.add_parser("list", help="committed checkpoints of a run, their step, size, tokens seen, and leftovers")
    listing.add_argument("run_dir", type=Path, help="the output_dir of a run (or its checkpoints/ directory)")
    listing.set_defaults(func=cmd_list)

    inspect = sub.add_parser("inspect", help="tensors, dtypes, shapes, bytes and the layout a checkpoint was saved from")
    inspect.add_argument("directory", type=Path, help="a checkpoint, e.g. RUN/checkpoints/step-00000100, or RUN/model")
    inspect.set_defaults(func=cmd_inspect)

    verify = sub.add_parser("verify", help="check the manifest, sizes, hashes (BLAKE3; sha256 in older checkpoints), "
                            "safetensors headers and indexes")
    verify.add_argument("directory", type=Path, help="a checkpoint or model directory written by isotrain")
    verify.add_argument("--no-hash", action="store_true", help="skip hashing the file contents (fast)")
    verify.set_defaults(func=cmd_verify)

    export = sub.add_parser("export", help="write a plain Hugging Face model directory, without the training state")
    export.add_argument("directory", type=Path, help="a checkpoint or model directory written by isotrain")
    export.add_argument("out", type=Path, help="the new directory to write (must not exist or be empty)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="dtype of floating-point tensors (default: the checkpoint's model dtype)")
    export.add_argument("--drop-keys", metavar="REGEX", help="leave out tensors whose name matches REGEX")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of at most this size")
    export.add_argument("--adapter", action="store_true",
                        help="export only the LoRA adapter of a LoRA run, as a peft adapter directory")
    export.set_defaults(func=cmd_export)

    merge = sub.add_parser("merge", help="merge models (linear, task arithmetic, TIES, DARE, SLERP) tensor by tensor")
    merge.add_argument("recipe", type=Path, help="a YAML merge recipe (docs/merge.md)")
    merge.add_argument("--processes", type=int, default=1,
                       help="merge output shards in this many processes (the result is the same for any number)")
    merge.set_defaults(func=cmd_merge)
