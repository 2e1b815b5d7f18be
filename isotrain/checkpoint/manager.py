"""The checkpoint manager a training loop uses: resume at start, save (sync or async), rotate.

Async saves (`checkpoint.async=true`) run in one background thread on their own gloo process
group: it first copies the state to host memory, then writes, hashes and commits. The loop waits
for the copy only before the next optimizer update (the one thing that would change the state
being copied), and at most one save is in flight. A failure in the background is raised in the
loop at its next call into the manager, never swallowed.
"""

from __future__ import annotations

import copy
import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from isotrain.checkpoint.layout import checkpoints_root, committed, remove_leftovers, set_aside_newer, write_latest
from isotrain.checkpoint.load import CheckpointReader, load_adapter, load_component, load_model, load_optimizer
from isotrain.checkpoint.manifest import verify_checkpoint
from isotrain.checkpoint.onepass import check_loaded
from isotrain.checkpoint.save import SaveRequest, broadcast_in_group, rotate, save
from isotrain.checkpoint.state import (
    Item,
    assign_owners,
    balance,
    collect_items,
    component_items,
    other_stage_keys,
    pipeline_items,
    rng_state,
    set_rng_state,
)
from isotrain.config import RunConfig, dump_config
from isotrain.errors import CheckpointError, ConfigError
from isotrain.models.unwrap import hf_model, is_lora, model_tensors
from isotrain.parallel.dims import restart_count
from isotrain.parallel.pp import ties_embeddings

MODEL_DIR = "model"
SFT_COUNTERS = ("tokens_seen", "trained_tokens", "samples_seen")


def _invalid_path(mode: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint.resume={mode} is not a valid checkpoint: {problem}; "
                           f"run `isotrain ckpt verify {mode}` for every problem")


@dataclass(frozen=True)
class CheckpointContract:
    """What a recipe's checkpoints hold beside the model and its optimizer, and what a resume must match."""

    # Written into state.json, checked on resume: sampler (batch size, seed, data size), schedule, fingerprints.
    extra_state: dict = field(default_factory=dict)
    counter_keys: tuple[str, ...] = SFT_COUNTERS  # saved with the step; a checkpoint without them is refused
    batch_field: str = "train.global_batch_size"  # the setting behind the sampler's batch size, named in errors
    # Other trained models of the run as (prefix, model, optimizer), e.g. PPO's critic.
    components: tuple[tuple[str, torch.nn.Module, torch.optim.Optimizer], ...] = ()
    # Files of the recipe's own state at the moment of a save (rank 0 writes them), e.g. asynchronous RL's
    # rollouts in flight: {path in the checkpoint: bytes}. The recipe reads them back from `Resumed.path`.
    state_files: Callable[[], dict[str, bytes]] | None = None


@dataclass
class Resumed:
    """What a resume restored, for the loop to continue from."""

    path: Path
    step: int
    counters: dict
    weights_only: bool
    # The checkpoint's own values of the contract's `extra_state` keys (those it has), as saved in its
    # train_state/state.json: what a recipe compares its current values against (e.g. RL's start_model_sha256).
    extra_state: dict = field(default_factory=dict)


def static_files(model, tokenizer, save_dtype: torch.dtype) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files: the non-tensor part of an HF directory."""
    base = hf_model(model)
    config = copy.deepcopy(base.config)
    config.dtype = save_dtype
    config.use_cache = True
    config.architectures = [model_class_name(base)]
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def model_class_name(model) -> str:
    """The Hugging Face class of `model`: FSDP2's `fully_shard` swaps in a generated subclass (`FSDPLlamaForCausalLM`)
    whose name no library knows, so the first class of the MRO that is not FSDP2's is named."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls.__name__ for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _host_buffer(item: Item, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """The kept host buffer for `item`'s local part, allocated on first use."""
    host = buffers.get(item.key)
    if host is None or host.shape != item.local.shape or host.dtype != item.local.dtype:
        host = buffers[item.key] = torch.empty(item.local.shape, dtype=item.local.dtype, device="cpu",
                                               pin_memory=torch.cuda.is_available())
    return host


def _stages(item: Item, rank: int) -> bool:
    """Whether this rank copies `item` for an async save: what it writes (the tensors it owns, its own part
    of them) and the parts it sends to their owners — not parts that another replica sends."""
    return item.saved_by(rank)


def stage(items: list[Item], rank: int, buffers: dict[str, torch.Tensor], threads: int = 1) -> None:
    """Copy what this rank will write to host memory, on `threads` threads.

    The copy is bound by memory bandwidth, which one core does not fill (6.8 GB/s on one core,
    13 GB/s on two on the benchmark machine). The host buffers are kept for the next save:
    allocating (and, on CPU, page-faulting) fresh memory would cost more than the copy itself.
    """
    staged = []
    for item in items:
        if _stages(item, rank):
            _host_buffer(item, buffers)  # allocated here, before the threads share `buffers`
            staged.append(item)
        else:
            item.local = None

    def copy(share: list[Item]) -> None:
        for item in share:
            host = buffers[item.key]
            host.copy_(item.local)
            item.local = host

    shares = balance(staged, max(1, min(threads, len(staged))))
    with ThreadPoolExecutor(len(shares), thread_name_prefix="isotrain-ckpt-stage") as pool:
        for done in [pool.submit(copy, share) for share in shares]:
            done.result()


def allocate_staging(items: list[Item], rank: int, buffers: dict[str, torch.Tensor]) -> None:
    """Allocate and touch the host buffers `stage` will use, so that the first save blocks no longer
    than the later ones. Runs beside training: it writes only memory no one else uses yet."""
    for item in items:
        if _stages(item, rank):
            _host_buffer(item, buffers).zero_()  # the page faults happen here, not in the first save


class CheckpointManager:
    def __init__(self, cfg: RunConfig, rank: int, world_size: int, layout: dict, model, optimizer, tokenizer,
                 contract: CheckpointContract, log=print):
        self.cfg, self.rank, self.world_size, self.layout = cfg, rank, world_size, layout
        self.model, self.optimizer, self.contract, self.log = model, optimizer, contract, log
        self.root = checkpoints_root(cfg.output_dir)
        self.save_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        # Saves talk over their own group so a background save never interleaves with training collectives.
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.parallel.timeout_s))
                      if world_size > 1 else None)
        self.run_id = broadcast_in_group(uuid.uuid4().hex[:12], rank, self.group)
        self.static = static_files(model, tokenizer, self.save_dtype) if rank == 0 else {}
        self.last_saved_step: int | None = None
        self.blocked_s = 0.0  # time the loop spent waiting on saves
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._staging: dict[str, torch.Tensor] = {}  # host buffers of async saves, reused
        self._staging_started = False

    # ----- resume ---------------------------------------------------------------------------
    def clean_leftovers(self) -> None:
        if self.rank == 0:
            removed = remove_leftovers(self.root) + remove_leftovers(Path(self.cfg.output_dir))
            if removed:
                names = ", ".join(p.name for p in removed)
                self.log(f"removed {len(removed)} leftover(s) of an interrupted save: {names}")
        broadcast_in_group(None, self.rank, self.group)

    def _choose(self, failed: set[Path]) -> Path | None:
        """Rank 0 picks the checkpoint to resume from, or None to start fresh: the newest one whose
        manifest, sizes, small files and headers check out (its tensor data is checked as it is
        loaded, `onepass.py`), skipping those whose load already failed that check (`failed`)."""
        mode = self.cfg.checkpoint.resume
        if mode == "never" and restart_count() > 0:
            # torchrun restarted this job: its first start found no checkpoint here (`never` refuses one), so every
            # checkpoint now here is this job's own, and the restart continues from the newest.
            mode = "auto"
        if mode == "never":
            existing = committed(self.root)
            if existing:
                # A fresh run here would mix its checkpoints with the old run's (rotation, `latest`).
                raise CheckpointError(
                    f"checkpoint.resume=never but {self.root} already holds checkpoints (newest "
                    f"{existing[-1][1].name}); use a new output_dir or move them away"
                )
            return None
        if mode != "auto":
            path = Path(mode)
            problems = verify_checkpoint(path, defer_tensor_data=True)
            if problems:
                raise _invalid_path(mode, problems[0])
            return path
        candidates = list(reversed(committed(self.root)))
        for step, path in candidates:
            if path in failed:
                continue
            problems = verify_checkpoint(path, defer_tensor_data=True)
            if not problems:
                return path
            self._log_invalid(path, problems[0])
        if candidates:
            raise CheckpointError(
                f"no checkpoint in {self.root} is valid; move them away or set checkpoint.resume=never to start fresh"
            )
        return None

    def _log_invalid(self, path: Path, problem: str) -> None:
        self.log(f"[yellow]checkpoint {path.name} is invalid ({problem}); trying the previous one[/]")

    def resume(self) -> Resumed | None:
        """Load the checkpoint to continue from into the model and optimizer, checking every byte of it
        on the way (one read: see onepass.py). A checkpoint whose data fails the check is reported and
        the previous one is loaded into the same tensors, as when its manifest fails."""
        failed: set[Path] = set()
        while True:
            choice: str | BaseException | None = None
            if self.rank == 0:
                try:
                    path = self._choose(failed)
                    choice = str(path) if path else None
                except CheckpointError as err:
                    choice = err
            choice = broadcast_in_group(choice, self.rank, self.group)
            if isinstance(choice, BaseException):
                raise choice
            if choice is None:
                return None
            path = Path(choice)
            state, weights_only, problem = self._load(path)
            if problem is None:
                return self._resumed(path, state, weights_only)
            if self.cfg.checkpoint.resume != "auto":
                raise _invalid_path(self.cfg.checkpoint.resume, problem)
            if self.rank == 0:
                self._log_invalid(path, problem)
            failed.add(path)

    def _load(self, path: Path) -> tuple[dict, bool, str | None]:
        """Read checkpoint `path` into the live model and optimizer; (its state.json, whether only the
        weights were loaded, the first problem of its tensor data or None), the same on every rank."""
        reader = CheckpointReader(path, record=True)
        try:
            state = reader.state()
            weights_only = self.cfg.checkpoint.load_only == "model"
            if not weights_only:
                missing = [key for key in self.contract.counter_keys if key not in state]
                if missing:  # e.g. an SFT checkpoint given to an RL run
                    raise CheckpointError(f"checkpoint {path} was saved by another kind of run (no {missing[0]} "
                                          "counter); set checkpoint.load_only=model to start from its weights only")
                self._check_compatible(reader.directory, state)
            if is_lora(self.model):
                if weights_only:
                    raise CheckpointError(
                        f"checkpoint.load_only=model cannot load {path} under LoRA adapters; set model.name_or_path "
                        f"to {path} (an HF model directory) instead")
                load_adapter(reader, self.model, self.rank)  # the frozen base comes from model.name_or_path
            else:
                load_model(reader, self.model, self.rank, strict=True,
                           ignored=tuple(self.cfg.checkpoint.ignore_keys), elsewhere=self._other_stages_tensors())
            if not weights_only:
                load_optimizer(reader, self.model, self.optimizer, self.rank)
                for prefix, model, optimizer in self.contract.components:
                    load_component(reader, prefix, model, optimizer, self.rank)
            problem = check_loaded(path, reader.loaded, self.rank, self.world_size, self.group)
        finally:
            reader.close()
        return state, weights_only, problem

    def _shared_tensors(self) -> frozenset[str]:
        """Under pipeline parallelism, the names of this stage's model tensors of which another stage holds a copy
        (a tied embedding, on the first and last stage)."""
        model = hf_model(self.model)
        embedding = model.get_input_embeddings()  # (none on a stage in between: parallel/pp.py)
        if not ties_embeddings(model) or embedding is None:
            return frozenset()
        # (Hugging Face names, as the files hold them: a LoRA model's weight files hold its merged weights)
        return frozenset(name for name, t in model_tensors(model).items() if t is embedding.weight)

    def _other_stages_tensors(self) -> frozenset[str]:
        """Under pipeline parallelism, the saved keys of the tensors the other stages hold (`other_stage_keys`)."""
        if self.cfg.parallel.pp == 1:
            return frozenset()
        return other_stage_keys(self.model, self.group)

    def _resumed(self, path: Path, state: dict, weights_only: bool) -> Resumed:
        """Everything after a load whose bytes all checked out: RNG, newer checkpoints set aside, counters."""
        if weights_only:
            kept = "; tensors matching checkpoint.ignore_keys keep their fresh values" \
                if self.cfg.checkpoint.ignore_keys else ""
            self.log(f"started from the weights of {path} (step {state['step']}); optimizer and counters are "
                     f"new{kept}")
            return Resumed(path, 0, {}, True, self._saved_extra_state(state))
        self._restore_rng(path, state)
        if self.rank == 0 and path.parent.resolve() == self.root.resolve():
            moved = set_aside_newer(self.root, state["step"], self.run_id)
            if moved:
                write_latest(self.root, path.name)
            for old, new in moved:
                self.log(f"[yellow]moved {old.name} aside to {new.name}: this run continues from step "
                         f"{state['step']} and writes its own later checkpoints (delete it when not needed)[/]")
        self.last_saved_step = state["step"]
        self.log(f"resumed from {path} at step {state['step']} (saved on {state['layout']['world_size']} "
                 f"rank(s), now {self.world_size})")
        counters = {key: state[key] for key in self.contract.counter_keys}
        return Resumed(path, state["step"], counters, False, self._saved_extra_state(state))

    def _saved_extra_state(self, state: dict) -> dict:
        return {key: state[key] for key in self.contract.extra_state if key in state}

    def _check_compatible(self, directory: Path, state: dict) -> None:
        allowed = set(self.cfg.checkpoint.allow_changes)
        extra = self.contract.extra_state
        saved_sampler, sampler = state["sampler"], extra["sampler"]
        checks = [
            ("global_batch_size", saved_sampler["global_batch_size"], sampler["global_batch_size"],
             self.contract.batch_field),
            ("seed", saved_sampler["seed"], sampler["seed"], "train.seed"),
            ("data", (saved_sampler["num_samples"], state["data_fingerprint"]),
             (sampler["num_samples"], extra["data_fingerprint"]), "data (data.path or data.sources, or their settings)"),
            ("tokenizer", state["tokenizer_sha256"], extra["tokenizer_sha256"], "the tokenizer"),
        ]
        for name, saved, current, what in checks:
            if saved != current and name not in allowed:
                shown = f" ({saved} in the checkpoint, {current} now)" if name in ("global_batch_size", "seed") else ""
                raise ConfigError(
                    f"{what} differs from checkpoint {directory}{shown}, which changes the data order or the math; "
                    f"restore it, start a new output_dir, or add {name} to checkpoint.allow_changes to resume anyway"
                )

    def _restore_rng(self, directory: Path, state: dict) -> None:
        path = directory / "train_state" / f"rng-rank-{self.rank:05d}.json"
        if path.is_file():
            set_rng_state(json.loads(path.read_text()))
        elif self.rank == state["layout"]["world_size"]:  # first rank without a saved state says it once
            print(f"note: ranks >= {state['layout']['world_size']} keep their seeded RNG; "
                  f"{directory} was saved on {state['layout']['world_size']} rank(s)")

    # ----- save -----------------------------------------------------------------------------
    def _items(self, kind: str) -> list[Item]:
        """The tensors a save of this kind writes, each with its owner rank."""
        items = collect_items(self.model, self.optimizer, self.save_dtype)
        if self.cfg.parallel.pp > 1:  # every stage's tensors, each written by a rank of its stage
            items = pipeline_items(items, self.group, self._shared_tensors())
        if kind == "model":
            items = [item for item in items if item.kind == "model"]
        else:
            for prefix, model, optimizer in self.contract.components:
                items += component_items(prefix, model, optimizer)
        assign_owners(items, self.world_size)
        return items

    def _request(self, step: int, counters: dict, kind: str) -> SaveRequest:
        items = self._items(kind)
        info = {"kind": kind, "step": step, "layout": self.layout}
        rank_files, main_files = {}, dict(self.static)
        if kind == "checkpoint":
            rank_files[f"train_state/rng-rank-{self.rank:05d}.json"] = json.dumps(rng_state()).encode()
            if self.rank == 0:
                main_files["train_state/state.json"] = self._state_json(step, counters)
                main_files["train_state/config.yaml"] = dump_config(self.cfg).encode()
                if self.contract.state_files is not None:
                    main_files.update(self.contract.state_files())
        return SaveRequest(step, items, rank_files, main_files if self.rank == 0 else {}, info)

    def _state_json(self, step: int, counters: dict) -> bytes:
        tensors = model_tensors(self.model)
        names = {id(p): n for n, p in tensors.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        state = {
            "step": step,
            **counters,
            "layout": self.layout,
            "model_dtype": self.cfg.model.dtype,
            "tensors": {name: list(t.shape) for name, t in tensors.items()},
            "optimizer": {"type": type(self.optimizer).__name__, "param_groups": groups},
            **self.contract.extra_state,
        }
        return (json.dumps(state, indent=2, default=str) + "\n").encode()

    def save_due(self, step: int, stopping: bool = False) -> bool:
        """Whether the state after `step` steps is saved: every checkpoint.every_steps steps and after the last
        step; and always when a signal stops the run, even with checkpoint.every_steps=0 (a stop keeps the work)."""
        every = self.cfg.checkpoint.every_steps
        return stopping or (every > 0 and (step % every == 0 or step == self.cfg.train.max_steps))

    def maybe_save(self, step: int, counters: dict, stopping: bool = False) -> bool:
        """Save a checkpoint after `step` steps if one is due (`save_due`); returns whether it did."""
        if not self.save_due(step, stopping):
            return False
        self.save(step, counters)
        return True

    def save(self, step: int, counters: dict) -> None:
        """Save a checkpoint of the state after `step` optimizer steps (in the background when async).

        `counters` may hold more than the contract's counter keys; only those are saved."""
        self.wait()
        start = time.perf_counter()
        request = self._request(step, {key: counters[key] for key in self.contract.counter_keys}, "checkpoint")
        if self.cfg.checkpoint.async_save:
            request.transfer_budget, request.piece_bytes = 0, 4 << 20
            self._staged.clear()
            self._thread = threading.Thread(target=self._background, args=(request,), name="isotrain-ckpt",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(request)
        self.last_saved_step = step
        self.blocked_s += time.perf_counter() - start

    def _write(self, request: SaveRequest) -> None:
        final = save(self.root, request, self.rank, self.group, self.run_id)
        if self.rank == 0:
            removed = rotate(self.root, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every)
            self.log(f"saved checkpoint {final}" + (f" (removed {', '.join(p.name for p in removed)})" if removed else ""))

    def _background(self, request: SaveRequest) -> None:
        try:
            self._in_background(self._stage_and_write, request)
        finally:
            self._staged.set()

    def _stage_and_write(self, request: SaveRequest) -> None:
        stage(request.items, self.rank, self._staging, torch.get_num_threads())
        self._staged.set()
        self._write(request)

    def before_update(self) -> None:
        """Block until an async save has copied the weights the coming optimizer step will change."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.blocked_s += time.perf_counter() - start
        # A failure is not raised here: ranks learn of it at different times, and one rank leaving while the
        # others go on to the next collective would break them. The loop raises it on every rank at once.
        self._prepare_staging()

    def _prepare_staging(self) -> None:
        """Async saves: allocate the host buffers in the background as soon as the optimizer state exists
        (after the first update), rather than inside the first save."""
        if (self._staging_started or not self.cfg.checkpoint.async_save or self.cfg.checkpoint.every_steps <= 0
                or self._thread is not None or not self.optimizer.state):
            return
        self._staging_started = True
        items = self._items("checkpoint")  # listed here: the loop owns the optimizer's state dict
        self._thread = threading.Thread(target=self._in_background, args=(allocate_staging, items, self.rank,
                                                                          self._staging),
                                        name="isotrain-ckpt-staging", daemon=True)
        self._thread.start()

    @property
    def staging_bytes(self) -> int:
        """Host memory that async saves keep for their copies of this rank's state."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    def _in_background(self, function, *args) -> None:
        try:
            function(*args)
        except BaseException as err:  # handed to the loop by check()/wait()
            self._failure = err

    @property
    def failed(self) -> bool:
        """Whether this rank's background save (or staging) has failed; its error is not raised yet."""
        return self._failure is not None

    def raise_failure(self, step: int) -> None:
        """Raise the failed async work's error after `step`, on every rank once any rank has `failed`.

        A save's outcome is agreed inside it, so the other ranks' saves fail with the same sentence and waiting
        for them is short. A failure that no rank shares (staging memory on one rank) gets a sentence here."""
        self.wait()
        raise CheckpointError(f"the run stopped after step {step}: another rank's background checkpoint work "
                              "failed (its error is in that rank's output); earlier checkpoints are intact")

    def check(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def wait(self) -> None:
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.blocked_s += time.perf_counter() - start
        self.check()

    def save_model(self, directory: Path) -> Path:
        """The final weights as a plain Hugging Face directory (with a manifest), replaced atomically."""
        self.wait()
        request = self._request(0, {}, "model")
        return save(directory.parent, request, self.rank, self.group, self.run_id, name=directory.name)
