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

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from forge_ext.runtime import disk
from forge_ext.weights.convert import vllm_layers
from forge_ext.weights.shared_buffer import open_shared_tensors


class WeightSyncExtension:
    """Methods vLLM adds to each of its workers (``self`` is the worker: ``self.model_runner``,
    ``self.rank``)."""

    def forge_load_weights(self, handle: Mapping[str, Any],
                           changed: Sequence[str] | None = None) -> dict[str, Any]:
        """Load HF-layout weights from a shared buffer into this worker's model, in place.

        Two ways, by what vLLM does with a parameter after loading it (:func:`load_plan`):

        - **in place**: the embedding and the norms, which vLLM serves as loaded, are loaded
          by their own ``weight_loader`` straight into the parameter (this rank's rows,
          padding zeroed), with no reload. Why: on CPU a reload re-runs the embedding's
          ``process_weights_after_loading``, which packs it for a GEMM that only a tied LM
          head uses (measured on a Qwen3-0.6B-shaped model: 0.5 s of a 1.45 s load);
        - **reloaded**: every other layer (the linear layers, whose CPU kernels are packed
          from their whole weight: they cannot be patched in place) through
          ``reload_weights``, which fuses, narrows and repacks; a layer that gets no tensor
          keeps the kernels it has (``reload/layerwise.py``).

        A tied LM head is re-tied and repacked whenever the embedding was loaded (a reload
        that leaves the embedding out keeps the head tied: both get their kernels back).

        Args:
            handle: :meth:`forge_ext.weights.shared_buffer.SharedTensorBuffer.handle` of a
                buffer holding HF-named tensors (``model.layers.0.self_attn.q_proj.weight``,
                ...), full (unsharded).
            changed: the names of the tensors whose data changed since the version this
                worker serves (a delta version, ``OpenedWeights.changed``): only the layers
                that load from one of them are loaded. None: every tensor.

        Returns:
            ``{"tp_rank", "seconds", "reloaded", "in_place"}``: the tensors reloaded and
            loaded in place.
        """
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        start = time.perf_counter()
        tensors = open_shared_tensors(handle)
        model = self.model_runner.get_model()
        config = self.model_runner.model_config
        reload, in_place = load_plan(model, config.hf_config, list(tensors), changed,
                                     quantized=config.quantization is not None)
        leaves_out = bool(in_place) or changed is not None
        with torch.no_grad(), _quiet_skipped_layers() if leaves_out else contextlib.nullcontext():
            self.model_runner.reload_weights(
                weights_iterator=((name, tensors[name]) for name in reload),
                is_checkpoint_format=True,
            )
            for name in in_place:  # as the model's load_weights loads them
                param = _live_parameter(model, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensors[name])
            if any(n.startswith("model.embed_tokens.") for n in reload + in_place):
                retie_word_embeddings(model, config.hf_config)
        return {"tp_rank": get_tensor_model_parallel_rank(),
                "seconds": time.perf_counter() - start,
                "reloaded": len(reload), "in_place": len(in_place)}

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


def load_plan(model: torch.nn.Module, hf_config: Any, names: Sequence[str],
              changed: Sequence[str] | None, quantized: bool) -> tuple[list[str], list[str]]:
    """Which of the HF tensors ``names`` a load reloads and which it loads in place
    (:meth:`WeightSyncExtension.forge_load_weights`): ``(reload, in_place)``.

    In place: a tensor whose vLLM parameter has its HF name and belongs to a module that is
    neither a linear layer nor an LM head (the embedding, the norms: served as loaded), on an
    unquantized model. Layers come from :func:`forge_ext.weights.convert.vllm_layers`: with
    ``changed``, a layer is loaded when one of its tensors changed, and then all of them (vLLM
    processes a layer once all its tensors arrived); on a model family it does not know,
    every tensor is reloaded (the safe way, as before).
    """
    try:
        layers = list(vllm_layers(hf_config).values())
    except ValueError:  # a family convert does not describe: no layer map, no in-place load
        return list(names), []
    present = set(names)
    wanted = present if changed is None else set(changed) & present
    load = [n for layer in layers if wanted.intersection(layer) for n in layer if n in present]
    load += sorted(wanted - set(load))  # tensors of no layer in the map (vLLM skips or loads)
    in_place = set() if quantized else {n for n in load if _in_place(model, n)}
    return [n for n in load if n not in in_place], [n for n in load if n in in_place]


def _live_parameter(model: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    """The parameter ``name`` (an HF name) as the model holds it now, None if it has no
    parameter of that name (a LoRA engine's wrapped layers: their ``base_layer``'s)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, BaseLayerWithLoRA):
        module = module.base_layer
    return module._parameters.get(param_name)


def _in_place(model: torch.nn.Module, name: str) -> bool:
    """Whether vLLM serves the parameter ``name`` as loaded (see :func:`load_plan`)."""
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    param = _live_parameter(model, name)
    if param is None or not param.numel():
        return False
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, BaseLayerWithLoRA):
        module = module.base_layer
    return not isinstance(module, (LinearBase, ParallelLMHead))


class _SkippedLayers(logging.Filter):
    """Drops vLLM's warnings about layers a reload gave no tensor: a load leaves them out on
    purpose (loaded in place, or unchanged), and they keep their weights."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not ("Failed to load weights" in message
                    or "were not loaded from checkpoint" in message)


@contextlib.contextmanager
def _quiet_skipped_layers():
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
               for name in ("layerwise", "inplace")]
    quiet = _SkippedLayers()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


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
