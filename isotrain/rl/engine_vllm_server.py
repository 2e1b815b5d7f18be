"""`rollout.vllm.url`: an OpenAI-compatible vLLM server that is already running, driven like `VLLMEngine`.

The server is started by the user (docs/rl.md, A vLLM server) with isotrain's worker extension
(rl/vllm_worker.py) and VLLM_SERVER_DEV_MODE=1, which opens `/collective_rpc` and `/reset_prefix_cache`. HTTP
over the standard library only (http.client; a Unix socket for `unix:/path`), one connection per request.

Sampling: `/v1/completions`, one request per prompt (a request's seed is per prompt: vLLM gives sample j of a
request seed + j), sent concurrently, with the token-id prompt, n, max_tokens, temperature, top_p, the EOS as
stop token, `logprobs=0` (the sampled token's own log-prob) and `return_token_ids`. Seeds, the log-prob mode and
the refused (T, top_p) pairs are VLLMEngine's (rl/engine_vllm.py): the same call gives the same samples on
either engine. The server's logprobs_mode and dtype are read at the start (isotrain_info) and must be the run's.

Weight sync through a directory both sides see (`rollout.vllm.weights_dir`, a shared file system): the tensors
are written as safetensors files of at most `bucket_bytes` (the trainer holds one bucket at a time) into a
hidden directory that is renamed into place once complete, so the server never sees a partial sync; then one
`/collective_rpc isotrain_load` reloads them in place, reading one file at a time, and answers the sha256 of
every tensor it handed to vLLM; then `/reset_prefix_cache`. The sync's directory is removed once answered (or
failed), the engine's own directory on close().

LoRA (`lora.r` > 0; the server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): the base
weights once, as above, then after every update only the adapter, a peft directory in the shared folder loaded by
`/v1/load_lora_adapter` under a new name per version, which every later completion request names as its model.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch

from isotrain.errors import ConfigError, TrainingError
from isotrain.rl.engine_vllm import RequestSeeds, logprobs_mode_for
from isotrain.rl.rollout import Rollout, SamplingParams

SERVER_HINT = ("start it with VLLM_SERVER_DEV_MODE=1, isotrain/rl on PYTHONPATH and --worker-extension-cls "
               "vllm_worker.IsotrainWorkerExtension (docs/rl.md, A vLLM server)")


class UnixConnection(http.client.HTTPConnection):
    """http.client over a Unix domain socket (`unix:/path`: vLLM's --uds)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class VLLMServerEngine:
    """`RolloutEngine` backed by a running vLLM server at `url`; weights pass through `weights_dir`."""

    def __init__(self, url: str, weights_dir: str | Path, eos_id: int, *, seed: int = 0, dtype: str = "float32",
                 temperature: float = 1.0, top_p: float = 1.0, bucket_bytes: int = 256 * 2**20,
                 timeout_s: float = 600.0, max_model_len: int | None = None, lora_rank: int = 0,
                 max_concurrency: int = 64, writer: bool = True, share=None):
        """Several trainer processes share one server: each samples its own prompts, but only the `writer` (rank 0)
        writes and loads the weights; `share(value)` returns the writer's value on every process (a broadcast,
        rl/policy.py passes parallel/dist.py's broadcast_from_main), so every process learns the writer's
        checksums, adapter name or failure, and none samples before the writer's load is answered."""
        self.url, self._eos_id, self.timeout_s = url.rstrip("/"), eos_id, timeout_s
        self._bucket_bytes, self._request_seeds, self._checksums = bucket_bytes, RequestSeeds(seed), {}
        self._max_concurrency, self._num_syncs, self.failed = max_concurrency, 0, False
        self._writer, self._share = writer, share or (lambda value: value)
        self.adapter_version, self._lora_rank, self._adapter = 0, lora_rank, None  # _adapter: (name, directory)
        weights_dir = Path(weights_dir)
        if not weights_dir.is_dir():
            raise ConfigError(f"rollout.vllm.weights_dir={str(weights_dir)!r} is not a directory; create it on a file "
                              "system the vLLM server sees at the same path, or point the setting at one")
        started = time.perf_counter()
        models = self._request("GET", "/v1/models", None, "the model list")["data"]
        self.model_name = models[0]["id"]
        self.info = self._server_info()
        expected = {"logprobs_mode": logprobs_mode_for(temperature, top_p), "dtype": dtype}
        for key, value in expected.items():
            if self.info[key] != value:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"the vLLM server at {self.url} serves with {key}={self.info[key]}, but this run "
                                  f"needs {value} (rl.temperature={temperature:g}, rl.top_p={top_p:g}, "
                                  f"rollout.vllm.dtype={dtype}); restart it with {flag} {value}")
        if max_model_len and self.info["max_model_len"] < max_model_len:
            raise ConfigError(f"the vLLM server at {self.url} serves at most {self.info['max_model_len']} tokens per "
                              f"sequence but data.max_seq_len={max_model_len}; restart it with --max-model-len "
                              f"{max_model_len} or lower data.max_seq_len")
        if lora_rank and not (self.info["runtime_lora"] and self.info["max_lora_rank"] >= lora_rank):
            raise ConfigError(f"the vLLM server at {self.url} cannot load rank-{lora_rank} LoRA adapters at runtime "
                              f"(max_lora_rank={self.info['max_lora_rank']}, VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                              f"{'set' if self.info['runtime_lora'] else 'unset'}); restart it with "
                              f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora and --max-lora-rank "
                              f"{lora_rank} or more, or set lora.r=0")
        if self.info.get("moe_padding"):
            width, padded = self.info["moe_padding"]
            raise ConfigError(f"the vLLM server at {self.url} runs vLLM's CPU mixture-of-experts kernel, which pads "
                              f"the experts' width from {width} to {padded}, and its in-place weight reload cannot "
                              "fill padded experts, so no weight sync could succeed; use a model whose expert width "
                              "(moe_intermediate_size) is a multiple of 32, or rollout.engine=hf")
        self.info["start_s"] = time.perf_counter() - started
        # The writer's folder in the shared directory, removed by close().
        self.sync_root = Path(tempfile.mkdtemp(prefix="isotrain-vllm-sync-", dir=weights_dir)) if writer else None

    # ----- HTTP -------------------------------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        if self.url.startswith("unix:"):
            return UnixConnection(self.url[len("unix:"):], self.timeout_s)
        parts = urlsplit(self.url)
        return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.timeout_s)

    def _request(self, method: str, path: str, body: dict | None, what: str):
        """One request; unreachable, silent past timeout_s or an error status: one sentence, the run stops."""
        prefix = urlsplit(self.url).path if self.url.startswith("http") else ""
        connection = self._connection()
        try:
            connection.request(method, prefix + path, body=None if body is None else json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        except (TimeoutError, socket.timeout):
            self.failed = True
            raise TrainingError(f"the vLLM server at {self.url} gave no answer to {what} within rollout.vllm."
                                f"timeout_s={self.timeout_s:g} s; raise rollout.vllm.timeout_s if it is only slow, "
                                "else see the server's log") from None
        except (OSError, http.client.HTTPException) as err:
            self.failed = True
            raise TrainingError(f"the vLLM server at {self.url} is unreachable ({type(err).__name__}: {err}) for "
                                f"{what}; start it (docs/rl.md, A vLLM server) or correct rollout.vllm.url") from None
        finally:
            connection.close()
        if response.status >= 400:
            self.failed = True
            raise _ServerError(response.status, _error_message(data))
        if response.getheader("Content-Type", "").startswith("application/json"):
            return json.loads(data)
        return data.decode(errors="replace")  # the LoRA endpoints answer plain text

    def _call(self, method: str, path: str, body: dict | None, what: str):
        try:
            return self._request(method, path, body, what)
        except _ServerError as err:
            raise TrainingError(f"the vLLM server at {self.url} answered {what} with HTTP {err.status}: {err}; see "
                                "the server's log") from None

    def _rpc(self, method: str, what: str, **kwargs) -> list:
        """`/collective_rpc` of a worker-extension method: one result per worker."""
        body = {"method": method, "kwargs": kwargs, "timeout": self.timeout_s}
        try:
            return self._request("POST", "/collective_rpc", body, what)["results"]
        except _ServerError as err:
            if err.status == 404:
                raise ConfigError(f"the vLLM server at {self.url} has no /collective_rpc endpoint (HTTP 404), so "
                                  f"isotrain cannot send it weights; {SERVER_HINT}") from None
            if method in str(err) and ("has no attribute" in str(err) or "not found" in str(err).lower()):
                raise ConfigError(f"the vLLM server at {self.url} lacks isotrain's worker extension ({err}); "
                                  f"{SERVER_HINT}") from None
            raise TrainingError(f"the vLLM server at {self.url} answered {what} with HTTP {err.status}: {err}; see "
                                "the server's log") from None

    def _server_info(self) -> dict:
        results = self._rpc("isotrain_info", "isotrain_info (its serving settings)")
        return dict(results[0])

    # ----- RolloutEngine ----------------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollout:
        if not self._checksums:
            raise RuntimeError("the vLLM server has no weights from this trainer yet; call update_weights first")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate got an empty prompt; every prompt needs at least one token (e.g. bos)")
        seeds = self._request_seeds.of_call(params, len(prompt_ids))  # VLLMEngine's, request by request
        prompts = [list(map(int, p)) for p in prompt_ids]

        def one(index: int) -> list[dict]:
            model = self._adapter[0] if self._adapter else self.model_name  # LoRA: the newest adapter version
            body = {"model": model, "prompt": prompts[index], "n": params.n,
                    "max_tokens": params.max_new_tokens, "temperature": 0.0 if params.greedy else params.temperature,
                    "top_p": 1.0 if params.greedy else params.top_p, "logprobs": 0,
                    "stop_token_ids": [self._eos_id], "ignore_eos": False, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "detokenize": False}
            if not params.greedy:
                body["seed"] = seeds[index]
            return self._call("POST", "/v1/completions", body, "a completion request")["choices"]

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), self._max_concurrency))) as pool:
            answers = list(pool.map(one, range(len(prompts))))
        responses, logprobs, truncated = [], [], []
        for choices in answers:  # in prompt order; a request's n samples in sample order (vLLM aggregates by index)
            for choice in choices:
                ids = [int(t) for t in choice["token_ids"]]
                responses.append(ids)
                logprobs.append([float(x) for x in choice["logprobs"]["token_logprobs"]])
                truncated.append(not (ids and ids[-1] == self._eos_id))
        rows = [p for p in prompts for _ in range(params.n)]
        return Rollout(rows, responses, logprobs, truncated)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors as bucket files into a hidden directory, rename it into place, have the server load it.

        The checksums of the previous sync are forgotten first: until this sync completes, generate refuses."""
        self._checksums = {}
        if not self._writer:
            for _ in named_tensors:  # the gathers are collectives: take part, send nothing
                pass
            self._checksums = self._shared_result("weight sync")
            return
        named_tensors = iter(named_tensors)
        try:
            loaded = self._write_and_load(named_tensors)
        except BaseException as err:
            with contextlib.suppress(Exception):  # the rest of the gathers, which the other processes are in
                for _ in named_tensors:
                    pass
            self._share({"error": str(err)})
            raise
        self._share({"ok": loaded})
        self._checksums = loaded

    def _shared_result(self, what: str):
        """The writer's answer, on a process that is not the writer."""
        answer = self._share(None)
        if "error" in answer:
            self.failed = True
            raise TrainingError(f"the {what} of rank 0 to the vLLM server at {self.url} failed ({answer['error']}), "
                                "so this process stops too; see rank 0's error")
        return answer["ok"]

    def _write_and_load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        from safetensors.torch import save_file

        self._num_syncs += 1
        partial = self.sync_root / f".sync-{self._num_syncs:06d}.partial"
        ready = self.sync_root / f"sync-{self._num_syncs:06d}"
        partial.mkdir()
        try:
            bucket, size, index = {}, 0, 0
            for name, tensor in named_tensors:
                if hasattr(tensor, "full_tensor"):
                    raise ValueError("VLLMServerEngine.update_weights needs full tensors; use "
                                     "saved_named_tensors(model)")
                tensor = tensor.detach().to("cpu").contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > self._bucket_bytes:
                    save_file(bucket, str(partial / f"bucket-{index:05d}.safetensors"))
                    bucket, size, index = {}, 0, index + 1
                bucket[name], size = tensor, size + nbytes
            if bucket:
                save_file(bucket, str(partial / f"bucket-{index:05d}.safetensors"))
            os.rename(partial, ready)  # complete: the server only ever sees whole syncs
            results = self._rpc("isotrain_load", "a weight sync (isotrain_load)", weights_path=str(ready))
            self._call("POST", "/reset_prefix_cache", None, "reset_prefix_cache")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(ready, ignore_errors=True)
        first = results[0]
        if any(result != first for result in results[1:]):  # tensor-parallel workers each read every tensor
            raise TrainingError(f"the vLLM server at {self.url}'s workers loaded different bytes in one sync, so its "
                                "weights cannot be trusted; check the shared directory and the server's log")
        return dict(first)

    def update_adapter(self, save) -> dict[str, str]:
        """LoRA as adapters (VLLMEngine.update_adapter's contract): `save(directory)` writes a peft adapter; it is
        renamed into place complete in the shared directory, loaded by `/v1/load_lora_adapter` as a new adapter
        name (a new vLLM LoRA id, so no prefix-cache block of an older version is reused), and every later
        generate asks for it; the previous version is unloaded and its files removed. Returns the sha256 of each
        adapter tensor as the server's workers read the file it loaded from."""
        if not self._lora_rank:
            raise ValueError("update_adapter needs an engine created with lora_rank")
        self.adapter_version += 1
        if not self._writer:
            name, loaded = self._shared_result("LoRA adapter")
            self._adapter = (name, None)
            return loaded
        try:
            name, loaded = self._load_adapter(save)
        except BaseException as err:
            self._share({"error": str(err)})
            raise
        self._share({"ok": (name, loaded)})
        return loaded

    def _load_adapter(self, save) -> tuple[str, dict[str, str]]:
        name = f"{self.sync_root.name}-v{self.adapter_version}"
        partial = self.sync_root / f".adapter-{self.adapter_version:06d}.partial"
        ready = self.sync_root / f"adapter-{self.adapter_version:06d}"
        try:
            save(partial)
            os.rename(partial, ready)
            self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(ready)},
                       "loading a LoRA adapter")
            results = self._rpc("isotrain_file_checksums", "the checksums of a LoRA adapter",
                                path=str(ready / "adapter_model.safetensors"))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(ready, ignore_errors=True)
            raise
        previous, self._adapter = self._adapter, (name, ready)
        if previous is not None:
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": previous[0]}, "unloading a LoRA adapter")
            shutil.rmtree(previous[1], ignore_errors=True)
        return name, dict(results[0])

    def checksums(self) -> dict[str, str]:
        """sha256 of each tensor the server loaded in the last complete sync (fp32 bytes), by name."""
        return dict(self._checksums)

    def release_memory(self) -> None:
        """Sleep mode is not driven over HTTP: the server keeps its memory; the weights count as unsynced."""
        self._checksums = {}

    def close(self) -> None:
        """Unload this engine's adapter, remove its directory in the shared folder; the server, not ours, keeps
        running. Idempotent."""
        adapter, self._adapter = getattr(self, "_adapter", None), None
        if adapter is not None and self._writer and not self.failed:
            with contextlib.suppress(TrainingError, _ServerError):
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": adapter[0]}, "unloading an adapter")
        root = getattr(self, "sync_root", None)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def __enter__(self) -> VLLMServerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ServerError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error_message(data: bytes) -> str:
    """The first line of a server's error body (FastAPI's {"detail": ...} or vLLM's {"error": {"message": ...}})."""
    try:
        body = json.loads(data)
    except ValueError:
        text = data.decode(errors="replace")
    else:
        error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
        text = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    lines = text.strip().splitlines()
    return (lines[0] if lines else "no message")[:300]
