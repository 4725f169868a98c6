"""What a checkpoint folder on disk is, without torch (the apps read it before their heavy
imports, issue 38): which ``step-N`` DCP folders a folder holds and which are complete
(:mod:`forge_ext.engine.checkpoint` explains the rule), an HF checkpoint folder, a LoRA
adapter folder, the model of the run that wrote a DCP step. Local paths through ``os``,
remote URIs (``gs://``, ...) through fsspec, as ``torchtitan/tools/filesystem.py`` does
(importing torchtitan here would import torch).
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any

from forge_ext.config import RUN_CONFIG_FILE, WORKING_DIR_KEY, load_run_record


def _fs(path: str):
    """``(fsspec filesystem, path)`` of a remote URI (``"://"``: torch DCP's and torchtitan's
    rule), None for a local path (fsspec is imported only for a remote one)."""
    if "://" not in path:
        return None
    from fsspec.core import url_to_fs

    return url_to_fs(path)


def _isfile(path: str) -> bool:
    remote = _fs(path)
    return os.path.isfile(path) if remote is None else remote[0].isfile(remote[1])


def _isdir(path: str) -> bool:
    remote = _fs(path)
    return os.path.isdir(path) if remote is None else remote[0].isdir(remote[1])


def _listdir(path: str) -> list[str]:
    remote = _fs(path)
    if remote is None:
        return os.listdir(path)
    return [posixpath.basename(e.rstrip("/")) for e in remote[0].ls(remote[1], detail=False)]


def _join(path: str, *names: str) -> str:
    return os.path.join(path, *names) if _fs(path) is None else posixpath.join(path, *names)


ADAPTER_CONFIG_NAME = "adapter_config.json"
"""The file that makes a folder a PEFT LoRA adapter (:mod:`forge_ext.engine.lora`)."""
STEP_FOLDER = re.compile(r"step-(\d+)")
"""The name of a checkpoint folder (matched whole): ``step-<N>``."""
COMPLETE_MARKERS = (".metadata", "model.safetensors.index.json")
"""Files that only a finished save leaves in a step folder (DCP; torchtitan's HF save)."""
INCOMPLETE_SUFFIX = ".incomplete"
"""Appended to the name of an incomplete step folder set aside (``step-9.incomplete``)."""


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the step folder ``path`` holds a finished save (:data:`COMPLETE_MARKERS`)."""
    return any(_isfile(_join(str(path), m)) for m in COMPLETE_MARKERS)


def checkpoint_folders(folder: str | os.PathLike) -> dict[int, str]:
    """``{step: path}`` of every ``step-<N>`` folder in ``folder``, complete or not (none when
    ``folder`` does not exist)."""
    folder = str(folder)
    if not _isdir(folder):
        return {}
    found = {}
    for name in _listdir(folder):
        match = STEP_FOLDER.fullmatch(name)
        if match:
            found[int(match.group(1))] = _join(folder, name)
    return found


def complete_checkpoint_steps(folder: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, ascending."""
    return sorted(s for s, p in checkpoint_folders(folder).items() if is_complete_checkpoint(p))


def is_hf_checkpoint(directory: str | Path) -> bool:
    """True if ``directory`` holds a ``config.json`` and at least one ``*.safetensors``."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def not_hf_folder_message(field: str, path: str, fix: str) -> str:
    """Why ``<field>=<path>``, which has no ``config.json``, is not a Hugging Face checkpoint
    folder, and the fix: for a DCP training checkpoint (``<output_dir>/checkpoints/step-N``,
    a step folder with a ``.metadata`` or a run record two folders up), the HF folder the
    run wrote at that step (``<output_dir>/hf/step-N``) where it exists, else the
    ``python -m apps.export`` command that writes one (issue 50); otherwise ``fix``."""
    where = f"{field}={path!r} ({os.path.abspath(path)})"
    match = STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(path)))
    step, run = Path(path), Path(path).parent.parent
    if match and (_isfile(_join(path, ".metadata")) or (run / RUN_CONFIG_FILE).is_file()):
        hf = run / "hf" / step.name
        head = (f"{where} is a DCP training checkpoint (step {match.group(1)} of the run in "
                f"{run}), not a Hugging Face checkpoint folder (config.json + *.safetensors)")
        if is_hf_checkpoint(hf):
            return f"{head}; the run wrote that step as one: {field}={hf}"
        return (f"{head}; convert it first: python -m apps.export {path} {hf}, then "
                f"{field}={hf}")
    return f"{where} has no config.json; {fix}"


def run_model_of(step_folder: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer.model`` section of the run that wrote the DCP checkpoint ``step_folder``
    (``<output_dir>/<checkpoint folder>/step-N``), read from its ``run_config.yaml`` two or
    one folders up; relative paths count from the run's working directory.

    Raises:
        FileNotFoundError: no run record there, naming where it was looked for and the
            ``--model`` flag that replaces it.
    """
    step = Path(step_folder).resolve()
    candidates = [step.parent.parent / RUN_CONFIG_FILE, step.parent / RUN_CONFIG_FILE]
    for path in candidates:
        if path.is_file():
            record = load_run_record(path)
            model = dict((record.get("trainer") or {}).get("model") or {})
            hf_path = model.get("hf_path")
            if hf_path and not os.path.isabs(hf_path):
                model["hf_path"] = os.path.join(record.get(WORKING_DIR_KEY, os.getcwd()), hf_path)
            return model
    raise FileNotFoundError(
        f"no {RUN_CONFIG_FILE} in {candidates[0].parent} or {candidates[1].parent}: the model "
        f"of {step_folder} is unknown; pass --model <HF checkpoint folder of the run's "
        "model.hf_path>"
    )
