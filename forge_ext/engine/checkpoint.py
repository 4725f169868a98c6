"""torchtitan's DCP checkpoint manager, with retention and loading that count only complete
checkpoints.

A checkpoint is the folder ``<dump_folder>/<checkpoint.folder>/step-<N>``. It is *complete*
when it holds DCP's ``.metadata``, which ``dcp.save`` writes last, once every rank's data is
written (or ``model.safetensors.index.json``, torchtitan's HF-format save): the test
torchtitan's own ``CheckpointManager._find_load_step`` applies. A save that crashed (the
process killed, the disk full) leaves a folder without it.

torchtitan 0.3.0 (``torchtitan/components/checkpointer/dcp.py``) counts every ``step-N``
folder in ``_purge_stale_checkpoints``: a leftover incomplete folder of a higher step than
the run's own saves stays among the newest ``keep_latest_k`` and the next saves delete
complete checkpoints in its place (issue 26; ``keep_latest_k: 2``, a leftover ``step-9``,
saves of steps 2 and 3 left ``step-3`` and ``step-9``). torchtitan fixed this after 0.3.0
(pytorch/torchtitan#4197). :class:`CheckpointManager` here:

- **sets incomplete folders aside** before each save (rank 0; the previous save, async or
  not, has finished by then): ``step-9`` becomes ``step-9.incomplete`` (``.incomplete.2``,
  ... if taken), which no step scan counts or loads. The folder of the step being saved is
  left alone (other ranks may be writing it already; DCP's ``.metadata`` names the files that
  belong to the new save, so leftovers of a crashed save of the same step are never read).
  Remote folders (``gs://``, ...) have no cheap rename: there they are removed;
- **keeps the newest** ``keep_latest_k`` **complete** checkpoints after each save and deletes
  older complete ones (torchtitan's purge thread). An async save still in flight is not yet
  complete, so it is not counted: ``keep_latest_k`` complete ones remain besides it;
- **loads only complete checkpoints**: the latest complete one when no step is given (as
  torchtitan), and a given step whose folder is incomplete is a ``FileNotFoundError``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager as TitanCheckpointManager
from torchtitan.tools import filesystem

# Which step folders are complete: no torch (the apps read them before their imports).
from forge_ext.engine.checkpoint_files import (  # noqa: F401  (imported from here too)
    COMPLETE_MARKERS, INCOMPLETE_SUFFIX, STEP_FOLDER, checkpoint_folders,
    complete_checkpoint_steps, is_complete_checkpoint,
)

logger = logging.getLogger(__name__)

def _set_aside(path: str) -> str | None:
    """Rename the incomplete step folder ``path`` to ``<path>.incomplete`` (the first free
    ``.incomplete.<n>``) and return the new path; on remote storage remove it (None)."""
    if filesystem.is_remote(path):
        filesystem.rmtree(path)
        return None
    target, n = path + INCOMPLETE_SUFFIX, 1
    while os.path.exists(target):
        n += 1
        target = f"{path}{INCOMPLETE_SUFFIX}.{n}"
    os.rename(path, target)
    return target


class CheckpointManager(TitanCheckpointManager):
    """torchtitan's ``CheckpointManager`` (same config fields, same files) whose retention
    and loading count only complete checkpoints (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanCheckpointManager.Config):
        pass

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # every folder but curr_step's is final from here on
        if _is_rank_zero():
            self._set_aside_incomplete(except_step=curr_step)
        return super()._save(curr_step, last_step)

    def _set_aside_incomplete(self, except_step: int) -> None:
        for step, path in checkpoint_folders(self.folder).items():
            if step != except_step and not is_complete_checkpoint(path):
                target = _set_aside(path)
                logger.warning(
                    "%s is an incomplete checkpoint (no .metadata: its save did not finish); "
                    "%s, so it is neither kept as one of checkpoint.keep_latest_k=%d nor loaded",
                    path, f"set aside as {target}" if target else "removed", self.keep_latest_k,
                )

    def _purge_stale_checkpoints(self) -> None:
        # Called by torchtitan's _save right after this step's save was written (sync:
        # complete now) or dispatched (async: still incomplete, so not counted). Incomplete
        # folders of other steps were set aside before the save.
        if not self._should_purge():
            return
        stale = complete_checkpoint_steps(self.folder)[: -self.keep_latest_k]
        folders = checkpoint_folders(self.folder)
        for step in stale:
            assert self.purge_thread is not None  # started by torchtitan when keep_latest_k > 0
            self.purge_queue.put(folders[step])

    def _find_load_step(self, folder: str = "") -> int:
        return max(complete_checkpoint_steps(folder or self.folder), default=-1)

    def _load(self, step: int = -1) -> bool:
        """torchtitan's load, refusing a given ``step`` whose folder is incomplete.

        Raises:
            FileNotFoundError: ``step`` was not saved, or its save did not finish.
        """
        if step != -1:
            path = self._create_checkpoint_id(step)
            if filesystem.isdir(path) and not is_complete_checkpoint(path):
                raise FileNotFoundError(
                    f"checkpoint {path} is incomplete (no .metadata: its save did not "
                    f"finish); load another step (complete: "
                    f"{complete_checkpoint_steps(self.folder)})"
                )
        return super()._load(step)


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
