"""Which ``step-N`` checkpoint folders a folder holds and which are complete, without torch
(:mod:`forge_ext.engine.checkpoint` explains the rule; the apps read it before their heavy
imports, issue 38). Local paths through ``os``, remote URIs (``gs://``, ...) through
fsspec, as torchtitan's ``torchtitan/tools/filesystem.py`` does (importing torchtitan here
would import torch).
"""

from __future__ import annotations

import os
import posixpath
import re


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
