"""The trained model as a Hugging Face checkpoint folder: from a running engine under any
parallelism (:func:`export_hf`, collective) or from a DCP checkpoint step on disk
(:func:`dcp_to_hf`, one process). Both write what :mod:`forge_ext.engine.hf_checkpoint` writes:
safetensors shards (HF's names, with ``model.safetensors.index.json`` when there are several),
``config.json``, and the tokenizer files and ``generation_config.json`` of ``model.hf_path``;
atomically (a staging folder renamed into place); a full disk is the one-line
:class:`forge_ext.runtime.disk.OutputWriteError`.

Weights go through the model's state-dict adapter (``to_hf``, torchtitan's
``Qwen3StateDictAdapter`` or :class:`forge_ext.engine.models.Llama3HFStateDictAdapter`), the
same conversion ``push_weights`` publishes, so the folder's logits are the trainer's.

Memory, in the engine: tensors are gathered one at a time (``DTensor.full_tensor()``, an
all-gather over the FSDP/TP ranks that hold its shards) and each pipeline stage's first rank
adds it to its shard writer; every other rank drops it at once. So no rank holds more than one
full tensor plus (the writers) one shard (``max_shard_bytes``). Pipeline stages write their own
shard files into the shared staging folder; rank 0 names them and writes the index.
A shared filesystem is assumed across hosts, as for DCP checkpoints.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from forge_ext.engine.checkpoint_files import is_complete_checkpoint, run_model_of
from forge_ext.engine.config import ModelConfig
from forge_ext.engine.hf_checkpoint import (
    DEFAULT_MAX_SHARD_BYTES, ShardWriter, finish_hf_folder, hf_config_dict, staging_folder,
    tensor_bytes, write_hf_folder,
)
from forge_ext.engine.lora import is_adapter_key
from forge_ext.engine.models import (
    HF_MODEL_TYPES, build_model_spec, hf_config_for, model_name_of, read_hf_config,
)
from forge_ext.runtime import disk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Export dtypes by name (``export.dtype``, ``--dtype``)."""


def export_dtype(name: str | None, field: str = "export.dtype") -> torch.dtype | None:
    """``DTYPES[name]``; None keeps the parameters' dtype.

    Raises:
        ValueError: an unknown name, naming ``field`` and the choices.
    """
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r} must be one of {sorted(DTYPES)} (or null: the "
                         "parameters' dtype)")
    return DTYPES[name]


def hf_config_of(model: Any) -> dict[str, Any]:
    """The ``config.json`` of the engine's model (a :class:`forge_ext.engine.config
    .ModelConfig`): ``model.hf_path``'s, with ``architectures`` filled in when absent (vLLM
    picks its model class by it), or a small flavor's.

    Raises:
        ValueError: neither (a torchtitan registry flavor without ``model.hf_path``).
    """
    # transformers takes seconds to import: only an export pays for it.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model.hf_path:
        config = read_hf_config(model.hf_path)
        model_type = config.get("model_type") or HF_MODEL_TYPES.get(model.name)
        if not config.get("architectures") and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
        return config
    fields = hf_config_for(model.name, model.flavor, None)
    if fields is None:
        raise ValueError(f"model.flavor={model.flavor!r} has no config.json to export with; "
                         "set model.hf_path")
    return hf_config_dict(HF_MODEL_TYPES[model.name], fields)


def export_hf(engine: Any, folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write ``engine``'s model (a :class:`forge_ext.engine.TitanEngine`, or the ``hf``
    backend's :class:`forge_ext.engine.hf.HFEngine`) as an HF checkpoint folder (module
    docstring). A collective: every rank of the engine calls it.

    Args:
        dtype: cast floating-point weights to it (None: the parameters' dtype).

    Returns:
        ``{"folder", "bytes", "files", "seconds"}`` (the same on every rank).

    Raises:
        ValueError: no ``config.json`` for the model (:func:`hf_config_of`), before any
            collective.
        forge_ext.runtime.disk.OutputWriteError: on every rank, when the free space is short of the
            folder's size or a write failed; nothing is left at ``folder`` (a previous folder
            there is kept).
    """
    start = time.perf_counter()
    folder = Path(folder)
    config = hf_config_of(engine.config.model)
    # With trainer.offload the parameters rest in host memory: on the device while exported.
    with engine.resident(optimizer=False), torch.no_grad():
        return _export(engine, folder, config, dtype, max_shard_bytes, start)


def _export(engine: Any, folder: Path, config: dict[str, Any], dtype: torch.dtype | None,
            max_shard_bytes: int, start: float) -> dict[str, Any]:
    state = engine.hf_state_dict()
    written = dtype or next((v.dtype for v in state.values() if v.is_floating_point()), None)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    # Without pipeline parallelism (the hf backend never has it) there is one stage.
    stage = engine.pp_mesh.get_local_rank() if engine.pp_mesh is not None else 0
    size = sum(tensor_bytes(v, dtype) for v in state.values())
    # Each stage's lowest rank writes its tensors; the folder's size is the stages' sum.
    peers = _gather((stage, size)) if distributed else [(stage, size)]
    writer_rank = min(r for r, (s, _) in enumerate(peers) if s == stage)
    needed = sum(dict((s, b) for s, b in peers).values())
    staging = staging_folder(folder, "export")
    error = None
    if rank == 0:
        try:
            disk.refuse_if_short("the HF checkpoint", str(folder), needed)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        except disk.OutputWriteError as e:
            error = e
        except OSError as e:
            error = disk.write_failed("the HF checkpoint", str(folder), e)
    _raise_if_any(error, distributed, staging)

    writer = None
    if rank == writer_rank:
        writer = ShardWriter(staging, prefix=f"stage{stage}", max_shard_bytes=max_shard_bytes,
                             dtype=dtype)
    for name, value in state.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective
        if writer is not None and error is None:
            try:
                writer.add(name, full)
            except OSError as e:  # keep gathering: the other ranks are in the collectives
                error = disk.write_failed("the HF checkpoint", str(folder), e)
        del full
    shards = []
    if writer is not None and error is None:
        try:
            shards = writer.close()
        except OSError as e:
            error = disk.write_failed("the HF checkpoint", str(folder), e)
    _raise_if_any(error, distributed, staging)

    by_stage = _gather((stage, shards)) if distributed else [(stage, shards)]
    if rank == 0:
        stages = {s: files for s, files in by_stage if files}
        try:
            finish_hf_folder(staging, [stages[s] for s in sorted(stages)], folder, config,
                             tokenizer_from=engine.config.model.hf_path or None, dtype=written)
        except OSError as e:
            error = disk.write_failed("the HF checkpoint", str(folder), e)
        except ValueError as e:  # the tokenizer's check: raised on every rank
            error = e
    _raise_if_any(error, distributed, staging)
    files = sum(len(f) for _, f in by_stage)
    return {"folder": str(folder), "bytes": needed, "files": files,
            "seconds": time.perf_counter() - start}


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _raise_if_any(error: Exception | None, distributed: bool, staging: Path) -> None:
    """Raise the first rank's error on every rank (so none waits in a later collective),
    after removing the staging folder."""
    errors = _gather(error) if distributed else [error]
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if not distributed or dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise first


# ---- from a DCP checkpoint on disk ------------------------------------------------------------

def dcp_to_hf(step_folder: str | os.PathLike, out: str | os.PathLike, *,
              model: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Convert the model weights of a DCP checkpoint step folder (a full fine-tuning run's
    ``trainer.checkpoint``) to an HF checkpoint folder ``out``, in this process, reading
    ``max_shard_bytes`` of tensors at a time (DCP reads only the keys asked for).

    Args:
        model: the run's ``trainer.model`` section (``name``, ``flavor``, ``hf_path``);
            default :func:`run_model_of`. ``config.json`` and the tokenizer files come from
            its ``hf_path``.

    Raises:
        FileNotFoundError: ``step_folder`` is not a complete DCP checkpoint (no
            ``.metadata``), or the run's model is unknown.
        ValueError: the checkpoint holds LoRA adapters only (a ``trainer.lora`` run), or
            tensors that are not the model's.
        forge_ext.runtime.disk.OutputWriteError: not enough space, or a write failed.
    """
    step = Path(step_folder)
    if not is_complete_checkpoint(step):
        raise FileNotFoundError(
            f"{step} is not a complete DCP checkpoint step folder (no .metadata): give a "
            "<output_dir>/checkpoints/step-N folder whose save finished")
    section = dict(model if model is not None else run_model_of(step))
    section.setdefault("name", model_name_of(section.get("hf_path")))
    section.setdefault("flavor", "hf" if section.get("hf_path") else "tiny")
    model_config = ModelConfig(**{k: v for k, v in section.items()
                                  if k in ("name", "flavor", "hf_path")})
    spec = build_model_spec(model_config.name, model_config.flavor,
                            hf_path=model_config.hf_path)
    adapter = spec.state_dict_adapter(spec.model, model_config.hf_path or None)
    with torch.device("meta"):
        names = list(spec.model.build().state_dict())
    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    if any(is_adapter_key(k) for k in stored):
        raise ValueError(
            f"{step} is a LoRA run's checkpoint (adapters only); its final adapter is the "
            "PEFT folder <output_dir>/adapter, which apps.eval takes as checkpoint= on its base")
    missing = [n for n in names if n not in stored]
    if missing:
        raise ValueError(f"{step} lacks the model's tensors {missing[:3]} ({len(missing)} in "
                         f"all): is --model the run's model ({section})?")
    config = hf_config_of(model_config)
    return write_hf_folder(
        out, _converted(step, names, stored, adapter, max_shard_bytes), config,
        needed_bytes=sum(_stored_bytes(stored[n], dtype) for n in names),
        tokenizer_from=model_config.hf_path or None, dtype=dtype,
        max_shard_bytes=max_shard_bytes)


def _converted(step: Path, names: list[str], stored: dict[str, Any], adapter: Any,
               max_bytes: int):
    """``(HF name, tensor)`` of the model tensors ``names`` of the DCP checkpoint ``step``,
    read ``max_bytes`` at a time (DCP reads only the keys asked for) and converted by the
    state-dict adapter."""
    for group in _groups(names, stored, max_bytes):
        tensors = {n: torch.empty(tuple(stored[n].size), dtype=stored[n].properties.dtype)
                   for n in group}
        with warnings.catch_warnings():  # "... assuming the intent is to load in a single
            warnings.simplefilter("ignore")  # process": it is
            dcp.load(tensors, checkpoint_id=str(step), no_dist=True)
        yield from adapter.to_hf(tensors).items()


def _stored_bytes(meta: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of a DCP tensor (its ``TensorStorageMetadata``) in ``dtype`` (None: as stored;
    only floating-point tensors are cast)."""
    stored = meta.properties.dtype
    target = dtype if dtype is not None and stored.is_floating_point else stored
    numel = 1
    for d in meta.size:
        numel *= int(d)
    return numel * torch.empty((), dtype=target).element_size()


def _groups(names: list[str], stored: dict[str, Any], max_bytes: int) -> list[list[str]]:
    """``names`` in consecutive groups of at most ``max_bytes`` as stored (a larger tensor
    alone)."""
    groups, current, size = [], [], 0
    for name in names:
        nbytes = _stored_bytes(stored[name])
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        groups.append(current)
    return groups
