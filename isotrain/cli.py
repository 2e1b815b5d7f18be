"""`isotrain` command line: each subcommand maps to one function; user errors print one line."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.markup import escape

from isotrain.errors import IsotrainError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (default: the bundled tiny example)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.lr=3e-4")


def _split_config_and_overrides(args) -> tuple[str | None, list[str]]:
    # `isotrain train train.lr=1e-3` has an override but no config file.
    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def cmd_train(args) -> int:
    from isotrain.config import load_config

    path, overrides = _split_config_and_overrides(args)
    cfg = load_config(path, overrides, recipe="train")  # config errors come before the slow torch imports
    if args.dry_run:
        # The run's own layout (torchrun's WORLD_SIZE), printed once; nothing is trained, read or written.
        if os.environ.get("RANK", "0") == "0":
            _print_estimate(cfg, int(os.environ.get("WORLD_SIZE", "1")), None, as_json=False)
        return 0
    from isotrain.recipes.sft import train

    train(cfg)
    return 0


def cmd_rl(args) -> int:
    from isotrain.config import load_config

    path, overrides = _split_config_and_overrides(args)
    cfg = load_config(path, overrides, recipe="rl")  # no config: the bundled RL recipe
    if path is None:
        _warm_start(cfg)
    from isotrain.recipes.rl import rl_train

    rl_train(cfg)
    return 0


def cmd_embed(args) -> int:
    from isotrain.config import load_config

    path, overrides = _split_config_and_overrides(args)
    cfg = load_config(path, _embed_overrides(path, overrides), recipe="embed")
    from isotrain.recipes.embed import embed_evaluate, embed_train

    if args.eval_only:
        embed_evaluate(cfg)
    else:
        embed_train(cfg)
    return 0


def _embed_overrides(path: str | None, overrides: list[str]) -> list[str]:
    """With no config, the bundled example trains all-MiniLM-L6-v2 on standard-library docstrings: its model is
    set here, unless the overrides name a model source (which then needs no `embed` extra); other model
    settings (`model.dtype=bfloat16`) apply to the bundled model."""
    from isotrain.config import names_model_source

    if path is not None or any(names_model_source(text.split("=", 1)[0]) for text in overrides):
        return overrides
    from isotrain.recipes import bundled_embedder_path

    return [f"model.name_or_path={bundled_embedder_path()}", *overrides]


def _warm_start(cfg) -> None:
    """The bundled RL example starts from a briefly trained SFT model; train it when it is absent."""
    from pathlib import Path

    from isotrain.config import load_config
    from isotrain.errors import ConfigError
    from isotrain.recipes import RL_WARM_START

    model_dir, sft_overrides = RL_WARM_START
    if cfg.model.name_or_path != model_dir or (Path(model_dir) / "config.json").is_file():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{model_dir} does not exist yet; run `isotrain rl` once on one process to train it, "
                          "or set model.name_or_path to a model directory")
    print(f"{model_dir} is absent: training it first with the bundled SFT recipe ({' '.join(sft_overrides)})")
    from isotrain.recipes.sft import train

    train(load_config(None, sft_overrides, recipe="train"))


def cmd_config_show(args) -> int:
    from pathlib import Path

    from isotrain.config import EmbedRunConfig, RLRunConfig, build_config, dump_config, infer_recipe, load_tree
    from isotrain.errors import ConfigError
    from isotrain.hub import is_hub_id
    from isotrain.models.loading import check_layout_fits, checked_config, declared_config
    from isotrain.parallel.dims import resolve_dims
    from isotrain.sizes import plan_batches, plan_rl_batches

    path, overrides = _split_config_and_overrides(args)
    recipe = args.recipe or ("rl" if args.rl else None)
    if recipe == "embed":
        overrides = _embed_overrides(path, overrides)
    tree = load_tree(path, overrides, recipe=recipe or "train")
    # Without --recipe, a config names its recipe by the sections only that recipe reads (rl, rollout, embed).
    cfg = build_config(tree, recipe or infer_recipe(tree))
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} is invalid; pass the number of processes, 1 or more")
    degrees = resolve_dims(cfg.parallel, world_size)
    source = cfg.model.name_or_path
    if source is None or is_hub_id(source) or (Path(source) / "config.json").is_file():
        # An embedder may be an encoder: only the causal-LM recipes check for a causal LM.
        declared_config(cfg.model) if isinstance(cfg, EmbedRunConfig) else checked_config(cfg)
        check_layout_fits(cfg.model, degrees)
    else:  # e.g. the bundled RL recipe's start, trained by its first `isotrain rl`: the sizes still print
        print(f"# model checks skipped: {source} does not exist yet")
    plan = plan_rl_batches(cfg, degrees) if isinstance(cfg, RLRunConfig) else plan_batches(cfg, degrees)
    print(dump_config(cfg), end="")
    print("# derived sizes")
    for name, value in [*degrees.as_rows(), *plan.as_rows()]:
        print(f"# {name}: {value}")
    if isinstance(cfg, RLRunConfig):  # derived, so the printed (and saved) config leaves it null
        print(f"# train.global_batch_size: {plan.samples_per_optimizer_step} (rl.mini_batch_prompts × rl.group_size)")
    return 0


def _print_estimate(cfg, world_size: int, dtype: str | None, as_json: bool, device: str | None = None) -> None:
    from isotrain.config import EmbedRunConfig, RLRunConfig
    from isotrain.errors import ConfigError
    from isotrain.memory.estimate import estimate_memory, memory_table
    from isotrain.sizes import plan_batches, plan_rl_batches
    from isotrain.parallel.dims import resolve_dims

    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} is invalid; pass the number of processes, 1 or more")
    plan = plan_rl_batches if isinstance(cfg, RLRunConfig) else plan_batches
    plan(cfg, resolve_dims(cfg.parallel, world_size))  # the sizes the run would refuse, refused here too
    if isinstance(cfg, EmbedRunConfig):  # GradCache's step (docs/memory.md)
        from isotrain.memory.estimate_embed import estimate_embed_memory

        estimate = estimate_embed_memory(cfg, world_size, dtype, device=device)
    else:
        estimate = estimate_memory(cfg, world_size, dtype, device=device)
    if as_json:
        print(estimate.as_json())
    else:
        Console(highlight=False).print(memory_table(estimate))


def cmd_estimate_memory(args) -> int:
    from isotrain.config import build_config, infer_recipe, load_tree

    path, overrides = _split_config_and_overrides(args)
    if args.recipe == "embed":  # no config: the bundled embedding example, as `isotrain embed` runs it
        overrides = _embed_overrides(path, overrides)
    tree = load_tree(path, overrides, recipe=args.recipe or "train")
    recipe = args.recipe or infer_recipe(tree)  # as config show: told by the sections only one recipe reads
    cfg = build_config(tree, recipe)  # an SFT step, RL's policy update step or the embedding step (docs/memory.md)
    _print_estimate(cfg, int(os.environ.get("WORLD_SIZE", args.world_size)), args.dtype, args.json, args.device)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isotrain", description="Training whose math does not depend on the layout.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="pre-train or fine-tune a causal LM")
    _add_config_args(train)
    train.add_argument("--dry-run", action="store_true",
                       help="print the per-rank memory estimate of this run and exit before any work")
    train.set_defaults(func=cmd_train)

    rl = commands.add_parser("rl", help="RL post-training (GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++)")
    _add_config_args(rl)
    rl.set_defaults(func=cmd_rl)

    embed = commands.add_parser("embed", help="contrastive embedding training (negatives: the whole global batch)")
    _add_config_args(embed)
    embed.add_argument("--eval-only", action="store_true",
                       help="print the retrieval metrics of model.name_or_path on eval.path and exit")
    embed.set_defaults(func=cmd_embed)

    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the resolved config and every derived size")
    _add_config_args(show)
    show.add_argument("--world-size", type=int, default=1, help="number of processes to derive sizes for")
    show.add_argument("--recipe", choices=("train", "rl", "embed"), default=None,
                      help="the command whose config tree to show and whose sizes to derive (default: told by the "
                      "config's own sections: rl or rollout -> rl, embed -> embed, else train); no config: that "
                      "command's bundled recipe")
    show.add_argument("--rl", action="store_true", help="the same as --recipe rl")
    show.set_defaults(func=cmd_config_show)

    memory = commands.add_parser("estimate-memory", help="per-rank memory of a training run, term by term")
    _add_config_args(memory)
    memory.add_argument("--world-size", type=int, default=1, help="number of processes to estimate for")
    memory.add_argument("--dtype", choices=("float32", "bfloat16", "float8"), default=None,
                        help="storage/compute dtype to estimate (default: model.dtype); float8: 1-byte weights with "
                        "per-tensor scales, fp32 masters, bf16 compute")
    memory.add_argument("--json", action="store_true", help="print JSON instead of a table")
    memory.add_argument("--recipe", choices=("train", "rl", "embed"), default=None,
                        help="the command whose config tree to read (default: told by the config's own sections: rl "
                             "or rollout -> rl, embed -> embed, else train); rl estimates the policy's update step, "
                             "embed the GradCache step (float32 or bfloat16)")
    memory.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the run computes, which decides the attention kernel (default: a GPU if one is "
                             "visible here, else cpu)")
    memory.set_defaults(func=cmd_estimate_memory)

    from isotrain.ckpt.commands import add_parser as add_ckpt_parser

    add_ckpt_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    parser = build_parser()
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"] if debug else argv)
    # Overrides may also follow an option (`config show x.yaml --world-size 2 a.b=1`).
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
    except IsotrainError as err:
        if debug:
            raise
        _print_error(str(err))
        code = 2
    except OSError as err:
        # Disk full, permissions, vanished files: the system's own words, with the path.
        if debug:
            raise
        where = f" ({err.filename})" if err.filename else ""
        _print_error(f"{err.strerror or err}{where}; fix the file system problem and run again (--debug shows details)")
        code = 1
    except KeyboardInterrupt:
        _print_error("interrupted")
        code = 130
    sys.exit(code)


def _print_error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    Console(stderr=True, highlight=False).print(
        f"{escape(prefix)}[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True
    )
