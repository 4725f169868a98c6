"""``weights.transport=dcp``: ``torch.distributed.checkpoint`` files on a shared filesystem,
and their handle in torchstore.

Rank 0 creates ``<dcp_path>/<version>`` (with :data:`DCP_MARKER`, refusing an existing folder
unless an earlier process of the same run left it, see :func:`create_version_dir`); every
rank then calls ``dcp.save`` into it (every rank writes its shards; DCP de-duplicates
replicas), and the commit record holds the checkpoint id, DCP's metadata and the names.
Readers need the folder on a filesystem they see; each loads the byte ranges of the
tensors it asks for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from forge_ext.runtime import disk
from forge_ext.weights.errors import WeightsFetchError
from forge_ext.weights.store import FORMAT
from forge_ext.weights.transports.base import (
    TRANSPORT_ERRORS, CommitRecord, ProgressHook, Specs, StoreLocation, Tensors, Transport,
    fillable,
)
from forge_ext.weights.transports.shards import local_nbytes

logger = logging.getLogger(__name__)

# File in each <dcp_path>/<version> folder a publisher creates, naming its run (run_id).
DCP_MARKER = ".forge_ext_weights.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpRecord(CommitRecord):
    """A ``dcp`` version: the checkpoint folder and DCP's ``Metadata`` of it (stored as
    ``checkpoint_id`` and ``metadata``)."""

    transport = "dcp"
    stored_as = {"dcp_metadata": "metadata"}
    checkpoint_id: str
    dcp_metadata: Any  # torch.distributed.checkpoint.metadata.Metadata

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        meta = self.dcp_metadata.state_dict_metadata[name]
        return tuple(meta.size), meta.properties.dtype


class DcpTransport(Transport):
    """DCP files under ``weights.dcp_path``; torchstore holds only the commit record."""

    name = "dcp"
    Record = DcpRecord

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._created: set[int] = set()  # versions whose folder this publisher created

    def version_dir(self, version: int) -> str:
        return os.path.join(os.path.abspath(self.config.dcp_path), str(version))

    async def prepare(self, version: int, tensors: Tensors) -> dict[str, Any]:
        """Rank 0 creates the version's folder."""
        if self.group.rank == 0:
            c = self.config
            marker = {"format": FORMAT, "key_prefix": c.key_prefix, "run_id": c.run_id}
            create_version_dir(self.version_dir(version), marker)
            self._created.add(version)
        return {}

    async def write(
        self, version: int, state_dict: Mapping[str, torch.Tensor], tensors: Tensors,
        prepared: list[dict[str, Any]], on_progress: ProgressHook | None, stored: list[str],
    ) -> tuple[int, dict[str, Any]]:
        """Collective ``dcp.save``; the manifest: rank 0's ``metadata``, the ``names``."""
        group, dcp_dir = self.group, self.version_dir(version)
        staged = {}
        for name, value in state_dict.items():
            dtype = tensors[name][0]
            staged[name] = value if value.dtype == dtype else value.to(dtype)
        # DCP reports a failure on any rank to every rank, so all ranks leave together.
        with warnings.catch_warnings():  # no_dist's "assuming ... a single process" notice
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            try:
                metadata = dcp.save(
                    staged, checkpoint_id=dcp_dir, process_group=group.group,
                    no_dist=group.size == 1,
                )
            except TRANSPORT_ERRORS as e:  # an OSError (full disk...) inside DCP's exception
                os_error = disk.os_error_in(e)
                if os_error is None:
                    raise
                raise disk.write_failed("the DCP weights", dcp_dir, os_error) from None
        written = sum(local_nbytes(t, group.rank) for t in staged.values())
        if on_progress is not None:
            on_progress(written, written)
        return written, {"metadata": metadata if group.rank == 0 else None, "names": list(staged)}

    def record(self, version: int, manifests: list[dict[str, Any]]) -> DcpRecord:
        metadata = manifests[0]["metadata"]
        # Every tensor DCP saved, from any rank: under pipeline parallelism each stage
        # publishes its own names, and the collective save merges them.
        return DcpRecord(version=version, names=list(metadata.state_dict_metadata),
                         checkpoint_id=self.version_dir(version), dcp_metadata=metadata)

    def abort(self, version: int) -> None:
        self.release(version)

    def release(self, version: int) -> None:
        """Remove the version's folder if this publisher created it."""
        if version in self._created:
            shutil.rmtree(self.version_dir(version), ignore_errors=True)
            self._created.discard(version)

    @classmethod
    async def read(
        cls, record: DcpRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> dict[str, torch.Tensor]:
        result = allocate()
        targets = {name: fillable(tensor) for name, tensor in result.items()}
        await asyncio.to_thread(_load, record, targets)
        return result


def _load(record: DcpRecord, state_dict: dict[str, torch.Tensor]) -> None:
    # no_dist: this reader loads alone even if its process is part of a process group.
    with warnings.catch_warnings():  # no_dist's "assuming ... a single process" notice
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(state_dict, checkpoint_id=record.checkpoint_id, no_dist=True)
        except CheckpointException as e:
            raise WeightsFetchError(
                f"policy_version={record.version}: reading its dcp checkpoint "
                f"{record.checkpoint_id!r} failed ({_first_line(e)}); the folder was "
                "removed or damaged after the version was committed"
            ) from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def create_version_dir(path: str, marker: dict[str, Any]) -> None:
    """Create ``path`` holding ``marker`` (:data:`DCP_MARKER`: format, key_prefix, run_id).

    A folder that exists already is refused (retention will delete it later), unless it holds
    the same marker with a run_id: then an earlier process of this run left it (a trainer
    that crashed and resumes from its checkpoint publishes the checkpoint's version again;
    the caller has checked that the version is not committed in this run's store), and it is
    replaced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        if marker["run_id"] is None or _read_marker(path) != marker:
            raise FileExistsError(
                f"{path} already exists and this run did not create it (weights.run_id="
                f"{marker['run_id']!r}); remove it or set weights.dcp_path to a fresh folder"
            ) from None
        logger.info("replacing %s, left by an earlier process of this run", path)
        shutil.rmtree(path)
        os.mkdir(path)
    with open(os.path.join(path, DCP_MARKER), "w") as f:
        json.dump(marker, f)


def _read_marker(path: str) -> dict[str, Any] | None:
    """The marker in ``path``, or None without a readable one."""
    try:
        with open(os.path.join(path, DCP_MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
