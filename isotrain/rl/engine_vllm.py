"""`rollout.engine=vllm`: vLLM in a process and a Python environment of its own, driven like `ProcessEngine`.

The engine environment may hold another torch and transformers than the trainer's (vllm-cpu pins
torch 2.13), so nothing torch-specific crosses the boundary: requests and answers are JSON lines over
the child's stdin/stdout (rl/vllm_server.py, run by path, imports no isotrain), and weights travel as
safetensors files in a private temporary directory, in /dev/shm where it exists (RAM, never the disk).

Weight sync, in acknowledged buckets like ProcessEngine's: the tensors of `update_weights` (the keys of a
Hugging Face checkpoint, full shapes, fp32: `saved_named_tensors`, which gathers FSDP2 shards one tensor at a
time and a MoE model's experts one expert at a time) are
written in files of at most `bucket_bytes` (one tensor larger than that goes alone); the child loads one,
deletes it and answers before the next is written, so the temporary directory never holds more than one
bucket. The child answers each bucket with the sha256 of every tensor it handed to vLLM (the checksum
definition of models/weights.py); `checksums()` returns them, and `rl/sync_check.py` compares them with
the trainer's and probes the loaded weights' log-probs after every sync.

Log-probs (rl/rollout.py's definition, log_softmax(logits / T) before top-p): vLLM reports the sampled
token's log-prob either from the raw logits (`raw_logprobs`: before temperature and top-p) or after
temperature *and* top-k/top-p (`processed_logprobs`). The first is the definition when T = 1 (and for
greedy decoding, whose log-probs are taken at T = 1); the second when top_p = 1. `logprobs_mode_for`
picks the one that holds for a run's (T, top_p); T != 1 together with top_p < 1 has no exact mode and is
refused before the run.

Seeds: sample j of prompt i in a call with seed s uses vLLM's per-request seed base(s) + i * n + j
(vLLM gives the n samples of a request seed + j), so a call's samples do not depend on how vLLM batches
them, and a resumed run that repeats a call's seed redraws the same samples. A call without a seed takes
`seed + k` for the k-th call, like ProcessEngine.
"""

from __future__ import annotations

import contextlib
import copy
import getpass
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from isotrain.errors import ConfigError, TrainingError
from isotrain.rl.rollout import Rollout, SamplingParams

SERVER = Path(__file__).with_name("vllm_server.py")
CPU_MIN_HEAD_DIM = 32
_RESERVED_ARGS = {"model", "skip_tokenizer_init", "load_format", "dtype", "seed", "max_model_len", "logprobs_mode",
                  "kv_cache_memory_bytes"}
BUILD_HINT = "build the CPU one with `python scripts/build_vllm_cpu_env.py`, or `pip install 'isotrain[vllm]'` on GPU"


class RequestSeeds:
    """vLLM's per-request seeds of successive generate calls, one definition for both vLLM engines so that the same
    call samples the same on either: a call's seed is params.seed, else (sampling) the engine's seed + the number of
    unseeded sampling calls so far; prompt i's request gets base(seed) + i * n (vLLM adds j for its sample j)."""

    def __init__(self, seed: int):
        self._seed, self._num_calls = seed, 0

    def of_call(self, params: SamplingParams, num_prompts: int) -> list[int]:
        call_seed = params.seed
        if call_seed is None and not params.greedy:
            call_seed = self._seed + self._num_calls
            self._num_calls += 1
        base = int.from_bytes(hashlib.sha256(f"isotrain-vllm-{call_seed or 0}".encode()).digest()[:7], "big")
        return [base + i * params.n for i in range(num_prompts)]


def logprobs_mode_for(temperature: float, top_p: float) -> str:
    """The vLLM logprobs_mode whose numbers are log_softmax(logits / T)[y] before top-p, for this run."""
    if temperature == 1.0:
        return "raw_logprobs"
    if top_p == 1.0:
        return "processed_logprobs"
    raise ConfigError(
        f"rollout.engine=vllm reports log-probs either before temperature or after top-p, so rl.temperature="
        f"{temperature} with rl.top_p={top_p} has no exact engine log-prob; set rl.top_p=1 or rl.temperature=1"
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank accepts


def vllm_lora_rank(r: int) -> int | None:
    """The engine's max_lora_rank for LoRA rank r (0: no LoRA, the engine gets full weights only)."""
    if r == 0:
        return None
    fitting = [rank for rank in VLLM_LORA_RANKS if rank >= r]
    if not fitting:
        raise ConfigError(f"lora.r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower lora.r or use "
                          "rollout.engine=hf")
    return fitting[0]


def default_python() -> str:
    return os.environ.get("ISOTRAIN_VLLM_PYTHON") or sys.executable


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def causal_lm_config(config):
    """A copy of `config` that names its causal-LM class in `architectures`, which vLLM builds the model from: a
    fresh `model.config` has none, and vllm-cpu 0.32 then took Qwen3-MoE's base model, served as an embedding
    model (its start failed)."""
    if getattr(config, "architectures", None):
        return config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = copy.deepcopy(config)
    named.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return named


def check_settings(python: str | None, temperature: float, top_p: float, engine_args: dict | None) -> str:
    """What can be refused before any work: the interpreter, the log-prob mode, engine_args; returns the python."""
    python = python or default_python()
    if shutil.which(python) is None:
        raise ConfigError(f"rollout.vllm.python={python!r} is not an executable interpreter; {BUILD_HINT} and set "
                          "rollout.vllm.python to the path of its python")
    # Finding the package is quick (importing it takes seconds): an environment without it is refused now.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([python, "-c", probe],
                           capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if found.returncode != 0:
        raise ConfigError(f"rollout.vllm.python={python!r} has no vllm package; {BUILD_HINT}, and set "
                          "rollout.vllm.python to its interpreter")
    logprobs_mode_for(temperature, top_p)
    refused = _RESERVED_ARGS & set(engine_args or {})
    if refused:
        raise ConfigError(f"rollout.vllm.engine_args sets {sorted(refused)}, which isotrain sets itself; remove "
                          "them (rollout.vllm.dtype and kv_cache_bytes are fields of their own)")
    return python


def check_moe_lora(python: str | None, lora_r: int, config) -> None:
    """Refuse LoRA on a mixture-of-experts policy where the engine is vLLM's CPU build, before any work.

    With LoRA enabled, vLLM picks for every MoE layer an experts kernel that supports LoRA, and its only one is
    Triton's, which vLLM on CPU lacks: vllm-cpu 0.32 started, then failed at the first generate ("module
    'triton.language' has no attribute 'float32'"), whether or not the adapter touches the MoE layers. Reading the
    environment's package metadata takes a fraction of a second; importing vllm would take seconds."""
    from isotrain.parallel.dims import num_experts

    if not lora_r or config is None or num_experts(config) is None:
        return
    python = python or default_python()
    show = ("import importlib.metadata as m; names = m.packages_distributions().get('vllm', []); "
            "print(' '.join(f'{n} {m.version(n)}' for n in names))")
    found = subprocess.run([python, "-c", show], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    build = found.stdout.strip()
    if "cpu" in build:
        raise ConfigError(f"lora.r={lora_r} on a mixture-of-experts policy cannot run on vLLM's CPU build ({build} "
                          f"at rollout.vllm.python={python!r}), whose MoE layers need Triton once LoRA is enabled and "
                          "fail at the first generate; set lora.r=0 (the full weights are synced every step), or use "
                          "rollout.engine=hf, or a GPU vLLM environment")


class VLLMEngine:
    """`RolloutEngine` backed by `vllm.LLM` (in-process mode) in a child process under `python`."""

    def __init__(self, config, eos_id: int, *, python: str | None = None, seed: int = 0, dtype: str = "float32",
                 temperature: float = 1.0, top_p: float = 1.0, kv_cache_bytes: int | None = None,
                 engine_args: dict | None = None, bucket_bytes: int = 256 * 2**20, timeout_s: float = 600.0,
                 num_threads: int | None = None, log_path: str | Path | None = None, max_model_len: int | None = None,
                 max_lora_rank: int | None = None):
        python = check_settings(python, temperature, top_p, engine_args)
        check_moe_lora(python, max_lora_rank or 0, config)
        self.python, self._eos_id, self._seed, self.timeout_s = python, eos_id, seed, timeout_s
        self._bucket_bytes, self._request_seeds, self._checksums = bucket_bytes, RequestSeeds(seed), {}
        self._process, self._buffer, self._log, self.failed = None, b"", None, False
        self._max_lora_rank, self.adapter_version, self._adapter_checksums = max_lora_rank, 0, {}
        # The directory of the engine's config.json and of the weight buckets; removed by close().
        shm = Path("/dev/shm")
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="isotrain-vllm-", dir=shm if shm.is_dir() else None))
        self.log_path = Path(log_path) if log_path else self.tmp_dir / "engine.log"
        try:
            self._start(config, dtype, logprobs_mode_for(temperature, top_p), kv_cache_bytes, engine_args or {},
                        num_threads or torch.get_num_threads(), max_model_len or config.max_position_embeddings)
        except BaseException:
            self.close()
            raise

    # ----- start and the channel ----------------------------------------------------------------------------------

    def _start(self, config, dtype, logprobs_mode, kv_cache_bytes, engine_args, num_threads, max_model_len) -> None:
        model_dir = self.tmp_dir / "model"
        model_dir.mkdir()
        causal_lm_config(config).to_json_file(model_dir / "config.json")
        args = {"model_dir": str(model_dir), "dtype": dtype, "seed": self._seed,
                "max_model_len": max_model_len, "logprobs_mode": logprobs_mode,
                "kv_cache_bytes": kv_cache_bytes, "engine_args": engine_args, "head_dim": head_dim_of(config),
                "num_threads": num_threads, "max_lora_rank": self._max_lora_rank}
        # TMPDIR: vLLM's own temporary files (its process-group rendezvous file) go where close() removes them;
        # torch inductor's compile cache stays where torch keeps it by default, so that the next start reuses it.
        inductor_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
               "OMP_NUM_THREADS": str(num_threads), "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp_dir),
               "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
        env.pop("PYTHONPATH", None)  # the engine environment's own packages, never the trainer's
        self._log = open(self.log_path, "ab")
        # A session of its own: close() can end the engine and any helper it started as one group.
        self._process = subprocess.Popen([self.python, str(SERVER), json.dumps(args)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True)
        started = time.perf_counter()
        try:
            self.info = self._answer("start", timeout_s=self.timeout_s)
            self.info["start_s"] = time.perf_counter() - started
        except _EngineFailed as err:
            self.failed = err.kind not in ("no_vllm", "head_dim", "moe_width")  # those sentences say it all
            if err.kind == "no_vllm":
                raise ConfigError(f"rollout.vllm.python={self.python!r} cannot import vllm ({err}); {BUILD_HINT}, "
                                  "and set rollout.vllm.python to its interpreter") from None
            if err.kind == "head_dim":
                raise ConfigError(f"vLLM's CPU attention needs head_dim >= {CPU_MIN_HEAD_DIM} but the model has "
                                  f"{err}; use a model with larger heads or rollout.engine=hf") from None
            if err.kind == "moe_width":  # "<width> to <padded width>"
                raise ConfigError(f"vLLM's CPU mixture-of-experts kernel pads the experts' width from {err}, and its "
                                  "in-place weight reload cannot fill padded experts, so no weight sync could succeed; "
                                  "use a model whose expert width (moe_intermediate_size) is a multiple of 32, or "
                                  "rollout.engine=hf") from None
            raise TrainingError(f"the vLLM engine failed to start ({err}); see {self.log_path}") from None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _call(self, op: str, **request):
        if self._process is None or self._process.stdin.closed:
            raise TrainingError(f"the vLLM engine was closed before {op}; create a new engine")
        try:
            self._process.stdin.write((json.dumps({"op": op, **request}) + "\n").encode())
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            self._raise_dead(op)
        try:
            return self._answer(op, self.timeout_s)
        except _EngineFailed as err:
            self.failed = True
            raise TrainingError(f"the vLLM engine failed in {op}: {err}; see {self.log_path}") from None

    def _answer(self, op: str, timeout_s: float):
        """The next answer line; a dead child or one silent past `timeout_s` is stopped and reported."""
        deadline = time.monotonic() + timeout_s
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.failed = True
                self._stop()
                raise TrainingError(f"the vLLM engine gave no answer to {op} within rollout.vllm.timeout_s="
                                    f"{timeout_s:g} s and was stopped; raise rollout.vllm.timeout_s if it is only "
                                    f"slow, else see {self.log_path}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._raise_dead(op)
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message = json.loads(line)
        if "error" in message:
            raise _EngineFailed(message["error"], message.get("kind"))
        return message["ok"]

    def _raise_dead(self, op: str):
        self.failed = True
        code = self._process.wait(timeout=5) if self._process else None
        self._stop()
        if code is not None and code < 0:  # a signal (the OOM killer's SIGKILL, a crash's SIGSEGV): the log is mute
            raise TrainingError(f"the vLLM engine process (pid {self.pid}) was killed by "
                                f"{signal.Signals(-code).name} during {op}; see {self.log_path}")
        raise TrainingError(f"the vLLM engine process (pid {self.pid}) exited with code {code} during {op}: "
                            f"{_last_line(self.log_path)}; see {self.log_path}")

    # ----- RolloutEngine ------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollout:
        if not self._checksums:
            raise RuntimeError("the vLLM engine has no weights yet; call update_weights first")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate got an empty prompt; every prompt needs at least one token (e.g. bos)")
        prompts = [list(map(int, p)) for p in prompt_ids]
        out = self._call("generate", prompts=prompts, n=params.n, max_new_tokens=params.max_new_tokens,
                         temperature=params.temperature, top_p=params.top_p, greedy=params.greedy,
                         seeds=self._request_seeds.of_call(params, len(prompts)), eos_id=self._eos_id)
        rows = [p for p in prompts for _ in range(params.n)]  # prompt-major, like HFEngine
        return Rollout(rows, out["responses"], out["logprobs"], out["truncated"])

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors in bucket files of at most bucket_bytes; each is read and acknowledged before the next.

        The checksums of the previous sync are forgotten first: until this sync completes, generate refuses. If
        the caller's iterator fails half-way, the sync is ended (what arrived is loaded) and generate keeps
        refusing until a complete sync.
        """
        from safetensors.torch import save_file

        self._checksums = {}
        self._call("sync")
        loaded, bucket, size, index = {}, {}, 0, 0
        try:
            for name, tensor in named_tensors:
                if hasattr(tensor, "full_tensor"):
                    raise ValueError("VLLMEngine.update_weights needs full tensors; use saved_named_tensors(model)")
                tensor = tensor.detach().to("cpu").contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > self._bucket_bytes:
                    loaded.update(self._send_bucket(bucket, index, save_file))
                    bucket, size, index = {}, 0, index + 1
                bucket[name], size = tensor, size + nbytes
            if bucket:
                loaded.update(self._send_bucket(bucket, index, save_file))
        except TrainingError:
            raise  # the engine failed: its error ended the sync
        except BaseException:
            # The caller's tensors failed: end the sync; the checksums stay empty, so generate refuses.
            with contextlib.suppress(TrainingError):
                self._call("end")
            raise
        self._call("end")
        self._checksums = loaded

    def _send_bucket(self, bucket: dict, index: int, save_file) -> dict[str, str]:
        path = self.tmp_dir / f"bucket-{index:05d}.safetensors"
        try:
            save_file(bucket, str(path))
            return self._call("bucket", path=str(path))  # the child deletes the file once it has read it
        finally:
            path.unlink(missing_ok=True)

    def update_adapter(self, save) -> dict[str, str]:
        """LoRA as adapters (an engine started with max_lora_rank): `save(directory)` writes a peft adapter there
        (models/lora.py save_adapter); the engine serves it as a new adapter version, dropping the previous one.
        Only the adapter's tensors travel; the base weights stay those of the last update_weights. Returns the
        engine's sha256 of each adapter tensor, by peft name."""
        if not self._max_lora_rank:
            raise ValueError("update_adapter needs an engine started with max_lora_rank")
        previous = self.tmp_dir / f"adapter-{self.adapter_version:06d}"
        self.adapter_version += 1
        directory = self.tmp_dir / f"adapter-{self.adapter_version:06d}"
        save(directory)
        self._adapter_checksums = self._call("adapter", path=str(directory), version=self.adapter_version)
        shutil.rmtree(previous, ignore_errors=True)  # vLLM read it when it first served that version
        return dict(self._adapter_checksums)

    def checksums(self) -> dict[str, str]:
        """sha256 of each tensor the engine loaded in the last complete sync (fp32 bytes), by name."""
        return dict(self._checksums)

    def release_memory(self) -> None:
        """Sleep mode (freeing weights and KV cache while the trainer runs) is not offered: vLLM has none on CPU."""
        self._checksums = {}

    # ----- shutdown -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask the child to exit, stop its process group if it does not within seconds, remove the temporary files.
        Idempotent."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                process.stdin.write(b'{"op": "close"}\n')
                process.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self._stop()
        if self._log is not None:
            self._log.close()
        if not (self.failed and self.log_path.parent == self.tmp_dir):
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        elif self.tmp_dir.exists():  # a failure's message names the log: keep it, and nothing else
            for path in self.tmp_dir.iterdir():
                if path != self.log_path:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def _stop(self) -> None:
        """SIGKILL the child's whole process group (vLLM may have started helpers) and reap the child."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                stream.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a forgotten engine: its process group and files go with it
        try:
            self.close()
        except Exception:  # at interpreter exit module globals may already be gone
            pass


class _EngineFailed(Exception):
    def __init__(self, message: str, kind: str | None):
        super().__init__(message)
        self.kind = kind


def _last_line(path: Path) -> str:
    """The last non-empty line of the engine's log (a crash's reason), shortened."""
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1][:300]
    return "no output"
