"""Code that runs inside vLLM's worker processes: vLLM mixes :class:`WeightSyncExtension` into
its worker class (``vllm.LLM(worker_extension_cls=...)``, vLLM's supported extension point,
``vllm/v1/worker/worker_base.py``), and the generator calls its methods by name with
``LLM.collective_rpc("forge_load_weights", args=(handle,))``.

Only small, plain values cross that RPC (vLLM 0.32 refuses pickled functions and cannot
pickle tensors in arguments, and returns tensors in results as placeholders; shared
FINDINGS, "vLLM"). The tensors travel through a same-host shared-memory file
(:mod:`forge_ext.weights.shared_buffer`) that every worker maps.

Weights are loaded with ``model_runner.reload_weights(weights_iterator=...,
is_checkpoint_format=True)`` (``vllm/model_executor/model_loader/reload/inplace.py``): vLLM's
own per-parameter ``weight_loader`` fuses q/k/v and gate/up, narrows each tensor to this
worker's tensor-parallel rank and then runs ``process_weights_after_loading`` (on CPU, the
weight prepacking that leaves the fused parameters with shape ``[0]``). The HF tensors are
views of the shared file, so a worker only touches the pages of its own rank's rows or
columns: it copies about ``1 / tensor_parallel_size`` of the weights.

vLLM is imported lazily, inside the methods: this module is imported by name in the workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from forge_ext.runtime import disk
from forge_ext.weights.shared_buffer import open_shared_tensors


class WeightSyncExtension:
    """Methods vLLM adds to each of its workers (``self`` is the worker: ``self.model_runner``,
    ``self.rank``)."""

    def forge_load_weights(self, handle: Mapping[str, Any]) -> dict[str, Any]:
        """Load HF-layout weights from a shared buffer into this worker's model, in place.

        Args:
            handle: :meth:`forge_ext.weights.shared_buffer.SharedTensorBuffer.handle` of a
                buffer holding HF-named tensors (``model.layers.0.self_attn.q_proj.weight``,
                ...), full (unsharded).

        Returns:
            ``{"tp_rank", "seconds"}``.
        """
        from vllm.distributed import get_tensor_model_parallel_rank

        start = time.perf_counter()
        tensors = open_shared_tensors(handle)
        with torch.no_grad():
            self.model_runner.reload_weights(
                weights_iterator=iter(tensors.items()), is_checkpoint_format=True
            )
            retie_word_embeddings(
                self.model_runner.get_model(), self.model_runner.model_config.hf_config
            )
        return {"tp_rank": get_tensor_model_parallel_rank(), "seconds": time.perf_counter() - start}

    def forge_capture_loaded_weights(
        self, handle: Mapping[str, Any], out_path: str
    ) -> dict[str, Any]:
        """Test support: load like :meth:`forge_load_weights`, and write every parameter as
        vLLM's own loader filled it for this rank, *before* vLLM's CPU repacking, to
        ``<out_path>.rank<r>.safetensors``.

        Linear layers are captured inside ``UnquantizedLinearMethod
        .process_weights_after_loading`` (``vllm/model_executor/layers/linear.py``), which is
        where the CPU build replaces their weights by packed kernels; every other parameter is
        read after the reload.

        Returns:
            ``{"tp_rank", "path"}``.
        """
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        model = self.model_runner.get_model()
        module_names = {id(module): name for name, module in model.named_modules()}
        captured: dict[str, torch.Tensor] = {}
        original = UnquantizedLinearMethod.process_weights_after_loading

        def capture(method, layer):
            prefix = module_names[id(layer)]
            for name, param in layer.named_parameters(recurse=False):
                captured[f"{prefix}.{name}"] = param.detach().to("cpu").clone()
            return original(method, layer)

        UnquantizedLinearMethod.process_weights_after_loading = capture
        try:
            self.forge_load_weights(handle)
        finally:
            UnquantizedLinearMethod.process_weights_after_loading = original
        for name, param in model.named_parameters():
            if name not in captured and param.numel():
                captured[name] = param.detach().to("cpu").clone()
        return _save_rank(captured, out_path)

    def forge_served_weights(self, out_path: str) -> dict[str, Any]:
        """Test support: write every weight as this worker serves it now, in vLLM's layout
        for its rank (``hf_to_vllm(..., tp_size, tp_rank)``'s names and shapes), to
        ``<out_path>.rank<r>.safetensors``; loads nothing.

        Parameters are written as they are; each linear layer (and the LM head) is read back
        through the GEMM it serves with (``layer.quant_method.apply``), which on the CPU build
        is the packed kernel that replaced its weight (a parameter of shape ``[0]``): the
        identity ``I [K, K]`` through it gives ``W^T`` exactly (each output element is one
        product by 1 plus products by 0, in the weight's dtype), so a stale or corrupted
        packed kernel shows here, as a parameter that was reloaded but not repacked does. A
        ``-0.0`` weight reads back as ``0.0``. The readback of a layer is
        ``<module>.weight``; a tied LM head's is ``lm_head.weight``.

        Returns:
            ``{"tp_rank", "path"}``.
        """
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        model = self.model_runner.get_model()
        served: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for prefix, module in model.named_modules():
                prefix = prefix.replace(".base_layer", "")  # a LoRA engine's wrapped layers
                for name, param in module.named_parameters(recurse=False):
                    if param.numel():
                        served[f"{prefix}.{name}"] = param.detach().to("cpu").clone()
                if isinstance(module, LinearBase):
                    k = module.input_size_per_partition
                elif isinstance(module, ParallelLMHead):
                    k = module.embedding_dim
                else:
                    continue
                eye = torch.eye(k, dtype=module.weight.dtype, device=module.weight.device)
                gemm = module.quant_method.apply(module, eye)  # [K, N]: W^T
                served[f"{prefix}.weight"] = gemm.t().to("cpu").clone()
        return _save_rank(served, out_path)


def _save_rank(tensors: Mapping[str, torch.Tensor], out_path: str) -> dict[str, Any]:
    """Write ``tensors`` to ``<out_path>.rank<r>.safetensors`` (``r``: this worker's
    tensor-parallel rank); returns ``{"tp_rank", "path"}``."""
    from safetensors.torch import save_file
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    path = f"{out_path}.rank{rank}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    disk.follow_umask(path)  # safetensors writes 0600
    return {"tp_rank": rank, "path": path}


def retie_word_embeddings(model: torch.nn.Module, hf_config: Any) -> None:
    """Tie the LM head to the input embedding again after an in-place reload.

    vLLM's reload (``vllm/model_executor/model_loader/reload/layerwise.py``) gives every layer
    new tensors on its own. A tied ``lm_head`` receives no checkpoint tensor (its model's
    ``load_weights`` skips ``lm_head.*`` when ``tie_word_embeddings``), so vLLM logs
    "ParallelLMHead: Failed to load weights" and puts the head's old tensors back: the
    embedding is new, the head is not, and the logits come from the old weights (measured:
    log-probs off by 11-15 nats after one update). This re-ties the head, as the model's
    ``__init__`` does (``ParallelLMHead.tie_weights``), and redoes its weight processing (the
    CPU build prepacks the head for its GEMM from ``weight``).

    Raises:
        AttributeError: a tied model without ``lm_head`` and ``model.embed_tokens`` (the
            Qwen2/Qwen3/Llama layout of ``vllm/model_executor/models``).
    """
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    lm_head, embed_tokens = model.lm_head, model.model.embed_tokens
    lm_head.tie_weights(embed_tokens)
    lm_head.quant_method.process_weights_after_loading(lm_head)
