"""LoRA adapters in PEFT's format: the contract between the trainer, the weights publisher,
the generators and the exported checkpoint.

A LoRA policy version is a flat state dict of adapter tensors under PEFT's names plus an
``adapter_config.json`` mapping; nothing else travels. For every adapted linear layer
``model.layers.{i}.{self_attn|mlp}.{proj}`` (HF names, ``proj`` one of
:data:`forge_ext.engine.schema.HF_TARGETS`):

- ``base_model.model.<module>.lora_A.weight``: ``[rank, in_features]``
- ``base_model.model.<module>.lora_B.weight``: ``[out_features, rank]``

and the layer computes ``y = x W^T + (alpha / rank) * x A^T B^T`` (Hu et al. 2021, "LoRA",
eq. 3; PEFT ``peft/tuners/lora/layer.py`` ``Linear.forward``, ``scaling = lora_alpha / r``).
The merged weight is ``W + (alpha / rank) B @ A``.

These are PEFT's own names and fields (``peft/utils/save_and_load.py``
``get_peft_model_state_dict`` drops the adapter name ``default``), so
``peft.PeftModel.from_pretrained(base, folder)`` and vLLM's ``LoRARequest(name, id, folder)``
(``vllm/lora/lora_model.py``) read a folder written by :func:`write_peft_folder`.

torchtitan's names for the same layers (``torchtitan/components/lora.py`` ``LoRAConverter``,
``target_modules`` matched on the last segment): :data:`forge_ext.engine.schema.TITAN_NAMES`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from forge_ext.engine.checkpoint_files import ADAPTER_CONFIG_NAME
from forge_ext.runtime import disk

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ENGINE_ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")
"""How the engine's own adapter parameters end (torchtitan's ``LoRALinear``, and the ``hf``
backend's, which copies its names): ``<module>.lora_a.weight`` is A, ``lora_b.weight`` B."""


def is_adapter_key(key: str) -> bool:
    """Whether an engine state-dict key is a LoRA adapter's (:data:`ENGINE_ADAPTER_SUFFIXES`)."""
    return key.endswith(ENGINE_ADAPTER_SUFFIXES)


def peft_adapter_config(rank: int, alpha: float, target_modules: Sequence[str],
                        base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` mapping of a LoRA adapter (PEFT ``LoraConfig`` fields that
    PEFT and vLLM read; the rest take PEFT's defaults when loaded)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }


def peft_key(module: str, matrix: str) -> str:
    """PEFT's tensor name for ``matrix`` (``"A"`` or ``"B"``) of the HF ``module``
    (``model.layers.0.self_attn.q_proj``)."""
    if matrix not in ("A", "B"):
        raise ValueError(f"matrix must be 'A' or 'B', got {matrix!r}")
    return f"{PEFT_PREFIX}{module}.lora_{matrix}.weight"


def scaling(config: Mapping[str, Any]) -> float:
    """``lora_alpha / r`` of an adapter config (PEFT's ``scaling`` without rsLoRA)."""
    if config.get("use_rslora"):
        raise ValueError("use_rslora adapters are not supported (scaling alpha/sqrt(r))")
    return float(config["lora_alpha"]) / int(config["r"])


def adapter_modules(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """HF module name -> (A key, B key) of a PEFT adapter state dict.

    Raises:
        ValueError: a key that is not a PEFT LoRA key, or a module missing A or B.
    """
    modules: dict[str, dict[str, str]] = {}
    for key in tensors:
        if not (key.startswith(PEFT_PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ValueError(f"{key!r} is not a PEFT LoRA tensor name "
                             f"({PEFT_PREFIX}<module>.lora_A.weight / lora_B.weight)")
        module, matrix = key[len(PEFT_PREFIX):].rsplit(".lora_", 1)
        modules.setdefault(module, {})[matrix[0]] = key
    incomplete = sorted(m for m, keys in modules.items() if set(keys) != {"A", "B"})
    if incomplete:
        raise ValueError(f"LoRA modules without both lora_A and lora_B: {incomplete[:4]}")
    return {m: (keys["A"], keys["B"]) for m, keys in modules.items()}


def merge_into(hf_state_dict: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
               config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A copy of ``hf_state_dict`` (HF names) with each adapted ``<module>.weight`` replaced by
    ``W + (alpha / r) B @ A``, computed in fp32 and cast back to ``W``'s dtype; the input is
    not modified.

    Raises:
        KeyError: an adapted module whose ``.weight`` is not in ``hf_state_dict``.
        ValueError: A/B shapes that do not fit the weight.
    """
    merged = dict(hf_state_dict)
    scale = scaling(config)
    for module, (a_key, b_key) in adapter_modules(tensors).items():
        name = f"{module}.weight"
        if name not in merged:
            raise KeyError(f"adapter module {module!r} has no {name!r} in the base state dict")
        weight, a, b = merged[name], tensors[a_key], tensors[b_key]
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(weight.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(f"{module}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit "
                             f"its weight {tuple(weight.shape)}")
        delta = scale * (b.to(device=weight.device, dtype=torch.float32)
                         @ a.to(device=weight.device, dtype=torch.float32))
        merged[name] = (weight.to(torch.float32) + delta).to(weight.dtype)
    return merged


def write_peft_folder(folder: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      config: Mapping[str, Any]) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``,
    atomically: the files are written into a sibling temporary folder that is renamed into
    place, replacing an existing ``folder`` only once the new one is complete. Returns the
    folder's path.

    Raises:
        ValueError: tensors that are not a PEFT LoRA state dict (:func:`adapter_modules`).
    """
    from safetensors.torch import save_file

    adapter_modules(tensors)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        disk.follow_umask(tmp / ADAPTER_WEIGHTS_NAME)  # safetensors writes 0600
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(dict(config), indent=2) + "\n")
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_peft_folder(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, adapter config)`` of a PEFT adapter folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    return load_file(str(folder / ADAPTER_WEIGHTS_NAME)), config
