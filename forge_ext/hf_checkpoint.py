"""Write Hugging Face checkpoint directories (``config.json`` + ``model.safetensors`` +
tokenizer files) that both ``transformers`` and the engine's ``flavor: hf`` path load.

A directory is written under a temporary name and renamed into place when complete, so a
reader (or a "skip if the checkpoint exists" check) never sees half a checkpoint.

``config.json`` carries ``rope_theta`` at the top level as well as transformers 5's
``rope_parameters``: torchtitan-era readers (:func:`forge_ext.engine.models.decoder_config_from_hf`)
and hub checkpoints such as ``Qwen/Qwen3-0.6B`` use the former.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt",
)
# Copied with the tokenizer: the end ids a checkpoint declares there (Qwen3 and Llama-3
# instruct models list two; config.json names one) and its sampling defaults.
GENERATION_CONFIG = "generation_config.json"


def is_hf_checkpoint(directory: str | Path) -> bool:
    """True if ``directory`` holds a ``config.json`` and at least one ``*.safetensors``."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def hf_config_dict(model_type: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The full ``config.json`` mapping of a ``transformers`` config built from ``fields``,
    with ``architectures`` (the causal-LM class of ``model_type``) as ``save_pretrained``
    writes it.

    Args:
        model_type: e.g. ``"qwen3"``.
        fields: ``config.json`` fields (``hidden_size``, ``vocab_size``, ...); the rest take
            the transformers defaults of ``model_type``.

    Raises:
        ValueError: an unknown ``model_type``.
    """
    from transformers import AutoConfig

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type, **fields).to_dict()
    # Readers that pick a model class by name (vLLM) need it; save_pretrained writes it too.
    if not config.get("architectures") and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    return config


def save_hf_checkpoint(
    directory: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write an HF checkpoint directory, replacing any previous one atomically.

    Args:
        directory: target folder (its parent is created).
        state_dict: HF-layout tensors (``model.embed_tokens.weight``, ...); DTensors are
            gathered with ``full_tensor()`` (a collective under data/tensor parallelism).
        config: ``config.json`` contents (see :func:`hf_config_dict`).
        tokenizer_from: a folder whose tokenizer files (:data:`TOKENIZER_FILES`) and
            ``generation_config.json`` are copied (the checkpoint training started from).

    Returns:
        ``directory`` as a Path.
    """
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {}
        for name, value in state_dict.items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensors[name] = value.detach().to("cpu").contiguous().clone()
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / "config.json", "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
        if tokenizer_from is not None:
            for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
                source = Path(tokenizer_from) / name
                if source.is_file():
                    shutil.copy2(source, tmp / name)
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def init_hf_checkpoint(
    directory: str | Path,
    model_type: str,
    fields: Mapping[str, Any],
    *,
    seed: int,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """A randomly initialised ``transformers`` model (its own init, seeded) saved as an HF
    checkpoint: the starting point of a from-scratch run that then loads like any user
    checkpoint.

    Args:
        directory, tokenizer_from: as for :func:`save_hf_checkpoint`.
        model_type, fields: as for :func:`hf_config_dict`.
        seed: ``torch.manual_seed`` before building the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf_config_dict(model_type, fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **fields), dtype=torch.float32
    )
    state_dict = model.state_dict()
    if config.get("tie_word_embeddings"):
        state_dict.pop("lm_head.weight", None)  # tied: stored once, as in hub checkpoints
    return save_hf_checkpoint(directory, state_dict, config, tokenizer_from=tokenizer_from)
