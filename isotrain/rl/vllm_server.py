"""The vLLM side of `rollout.engine=vllm`: run by path under the engine environment's interpreter.

    <vllm python> vllm_server.py '<start arguments as JSON>'

It imports only the standard library, torch, safetensors and vllm (never isotrain, whose torch and
transformers may differ from the engine environment's), so it is started by its file path.

Protocol: one JSON object per line. Requests come on stdin; each gets exactly one answer line on the
original stdout, `{"ok": result}` or `{"error": sentence, "kind": k}`. Everything vLLM prints goes to
stderr (fd 1 is pointed at stderr before vllm is imported), so logs can never corrupt the channel.
The first answer, sent unasked, says whether the engine started. Floats cross as JSON numbers
(Python's repr: exact round trip of a double).

Requests:
    generate  prompts (token ids), n, max_new_tokens, temperature, top_p, greedy, seeds (one per prompt;
              vLLM derives sample j's seed as seed + j), eos_id -> responses, log-probs, truncated
    sync      a weight sync: answered at once, then the lines that follow are its buckets,
    bucket    {"path": a safetensors file of full tensors under Hugging Face names}: read, deleted, answered
              with the sha256 of each tensor (fp32 contiguous bytes, isotrain's checksum definition);
    end       the last bucket was sent: answered once vLLM has loaded and processed every tensor.
    adapter   {"path": a peft adapter directory, "version": k}: LoRA only, the adapter every later generate
              uses (vLLM's LoRARequest, a new id per version) -> sha256 of each adapter tensor
    close     exit
One sync is one `collective_rpc("reload_weights", weights_iterator=...)` whose iterator reads the buckets
as they come: vLLM reloads layer by layer and processes a layer (e.g. fuses q, k and v into qkv_proj) once
all its tensors arrived, so a fused layer split over two buckets must never be finalised in between. Then the
post-load steps a reload skips (vllm_worker.py: a tied head, the CPU MoE kernel's packing). The
prefix cache is reset after the sync: no KV computed with old weights is ever reused. If vLLM fails during a
sync, the error answers the line in flight and the rest of that sync's lines are ignored.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# This file's folder is sys.path[0] (it runs by path): the worker-side steps it shares with a vLLM server.
from vllm_worker import padded_moe_widths, repack_moe_experts, reprocess_shared_weights, sha256_of

CPU_MIN_HEAD_DIM = 32  # vLLM's CPU attention kernel: smaller heads fail at the first generate


def main() -> int:
    # The channel is a private duplicate of stdout; fd 1 then shows stderr, for vLLM's own prints.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _die_with_parent()
    args = json.loads(sys.argv[1])
    try:
        server = Server(args)
    except StartError as err:
        _send(channel, {"error": str(err), "kind": err.kind})
        return 1
    except Exception as err:  # any failure of vLLM's start-up, reported as one line
        traceback.print_exc()
        _send(channel, {"error": _describe(err), "kind": "start"})
        return 1
    _send(channel, {"ok": server.info})
    lines = iter(sys.stdin)
    for line in lines:
        request = json.loads(line)
        op = request.pop("op")
        if op == "close":
            _send(channel, {"ok": None})
            os._exit(0)  # nothing of vLLM's needs a teardown in-process; its atexit hooks can take seconds
        if op in ("bucket", "end"):
            continue  # the rest of a sync that failed (its error was answered): ignored
        try:
            if op == "sync":
                result = server.op_sync(channel, lines)
            else:
                result = getattr(server, "op_" + op)(**request)
            _send(channel, {"ok": result})
        except Exception as err:
            traceback.print_exc()
            _send(channel, {"error": _describe(err), "kind": op})
    return 0  # stdin closed: the trainer is gone


class StartError(Exception):
    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class Server:
    def __init__(self, args: dict):
        try:
            import safetensors.torch  # noqa: F401
            import torch
            import vllm
        except Exception as err:  # a broken install raises more than ImportError (an OSError of a missing .so, ...)
            raise StartError(_describe(err), "no_vllm") from err
        from vllm.platforms import current_platform

        torch.set_num_threads(args.get("num_threads") or torch.get_num_threads())
        platform = current_platform.device_type
        head_dim = args["head_dim"]
        if platform == "cpu" and head_dim < CPU_MIN_HEAD_DIM:
            raise StartError(f"head_dim={head_dim}", "head_dim")
        self.llm = vllm.LLM(
            model=args["model_dir"],
            skip_tokenizer_init=True,  # prompts and responses are token ids
            load_format="dummy",  # no weights on disk: the trainer sends them before the first generate
            dtype=args["dtype"],
            seed=args["seed"],
            max_model_len=args["max_model_len"],
            logprobs_mode=args["logprobs_mode"],
            **({"kv_cache_memory_bytes": args["kv_cache_bytes"]} if args.get("kv_cache_bytes") else {}),
            **({"enable_lora": True, "max_lora_rank": args["max_lora_rank"], "max_loras": 1}
               if args.get("max_lora_rank") else {}),
            # Eager unless the user asks for graphs (engine_args enforce_eager=false on a GPU): no compile wait.
            **{"enforce_eager": True, **args.get("engine_args", {})},
        )
        if platform == "cpu":
            padded = self.llm.collective_rpc(padded_moe_widths)[0]
            if padded:
                raise StartError(f"{padded[0]} to {padded[1]}", "moe_width")
        self.lora = None  # the LoRARequest of the adapter every generate uses, once one was sent
        self.info = {"vllm": vllm.__version__, "torch": torch.__version__, "platform": platform,
                     "pid": os.getpid()}

    def op_generate(self, prompts, n, max_new_tokens, temperature, top_p, greedy, seeds, eos_id):
        from vllm import SamplingParams, TokensPrompt

        requests, params = [], []
        for prompt, seed in zip(prompts, seeds):
            requests.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(SamplingParams(
                n=n,
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                seed=None if greedy else seed,
                logprobs=0,  # the sampled token's own log-prob only
                stop_token_ids=[eos_id],
                ignore_eos=False,
                detokenize=False,
            ))
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora)
        responses, logprobs, truncated = [], [], []
        for request_output in outputs:  # in prompt order; the n samples of a prompt in index order
            for sample in sorted(request_output.outputs, key=lambda o: o.index):
                ids = list(sample.token_ids)
                responses.append(ids)
                logprobs.append([float(step[token].logprob) for step, token in zip(sample.logprobs, ids)])
                truncated.append(not (ids and ids[-1] == eos_id))
        return {"responses": responses, "logprobs": logprobs, "truncated": truncated}

    def op_sync(self, channel, lines):
        """Answer the sync line, then load bucket after bucket through one reload_weights call."""
        import torch
        from safetensors.torch import load_file

        _send(channel, {"ok": None})
        names = []

        def buckets():
            for line in lines:
                request = json.loads(line)
                if request["op"] == "end":
                    return
                tensors = load_file(request["path"])
                os.unlink(request["path"])  # read: the trainer may write the next bucket
                _send(channel, {"ok": {name: sha256_of(torch, t) for name, t in tensors.items()}})
                names.extend(tensors)
                yield from tensors.items()
            raise EOFError("the trainer closed the channel during a weight sync")

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": buckets()})
        self.llm.collective_rpc(reprocess_shared_weights)
        self.llm.collective_rpc(repack_moe_experts, args=(names,))
        self.llm.reset_prefix_cache()
        return {"tensors": len(names)}


    def op_adapter(self, path, version):
        """A new adapter version (a peft directory): every later generate uses it; the previous one is dropped.
        -> sha256 of each adapter tensor as vLLM will read it."""
        import torch
        from safetensors.torch import load_file
        from vllm.lora.request import LoRARequest

        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
        self.lora = LoRARequest(f"isotrain-v{version}", version, path)
        self.llm.reset_prefix_cache()
        return {name: sha256_of(torch, t) for name, t in tensors.items()}


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the trainer dies, even mid-generate."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: stdin's EOF still ends the loop between requests


def _describe(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}{where}"


def _send(channel, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


if __name__ == "__main__":
    sys.exit(main())
