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

A save runs inside :func:`write_checkpoint` (issue 26, fault 3): refused before writing when
the free space is short of the last complete save, and an ``OSError`` during the write is one
line (:class:`forge_ext.runtime.disk.CheckpointWriteError`), the half-written folder removed.
Under LoRA the model's entry is :class:`AdapterModelWrapper`: checkpoints hold the adapters.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager as TitanCheckpointManager
from torchtitan.components.checkpoint import MODEL, ModelWrapper
from torchtitan.tools import filesystem

from forge_ext.engine.checkpoint_files import (
    INCOMPLETE_SUFFIX, checkpoint_folders, complete_checkpoint_steps, is_complete_checkpoint,
)
from forge_ext.engine.lora import is_adapter_key
from forge_ext.runtime import disk
from forge_ext.runtime.disk import CheckpointWriteError

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
    and loading count only complete checkpoints, and whose :meth:`save_step` refuses a save
    the disk cannot hold (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanCheckpointManager.Config):
        pass

    last_save_bytes: int | None = None
    """Size of the last complete save, for the free-space check before the next."""

    def save_step(self, step: int) -> None:
        """Save ``step`` to ``<folder>/step-<step>`` inside :func:`write_checkpoint`, every
        rank of the default group together (a collective).

        Raises:
            CheckpointWriteError: as :func:`write_checkpoint`.
        """
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Not last_step=True: torchtitan's last-step save skips the keep_latest_k purge.
        self.last_save_bytes = write_checkpoint(
            lambda: self.save(step),
            what=f"checkpoint step {step}",
            path=os.path.join(self.folder, f"step-{step}"),
            folder=self.folder,
            needed_bytes=self.last_save_bytes,
            gather=_all_gather if distributed else None,
        )

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


def _all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank of the default group (the ranks that save a checkpoint)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def build_checkpointer(config: Any, *, model_parts: list[Any], optimizers: Any,
                       lr_schedulers: Any, train_state: Any, sd_adapter: Any
                       ) -> CheckpointManager:
    """An engine's :class:`CheckpointManager` (``config``: its
    :class:`~forge_ext.engine.config.EngineConfig`) over its model parts, optimizers, LR
    schedulers and ``train_state`` (the step counter's ``state_dict`` owner); under LoRA the
    model entry holds the adapters only (:class:`AdapterModelWrapper`)."""
    checkpointer = config.checkpoint.build(
        dataloader=None,
        model_parts=model_parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=sd_adapter,
        base_folder=config.dump_folder,
    )
    # The engine has no dataloader (callers feed batches); a None entry would be saved
    # and then demanded on load.
    getattr(checkpointer, "states", {}).pop("dataloader", None)
    if config.lora is not None and checkpointer.enable:
        # The base is model.hf_path's, unchanged: checkpoints hold only the adapters
        # (the optimizer holds only them already).
        checkpointer.states[MODEL] = AdapterModelWrapper(model_parts)
    # The caller decides when to save (save_step(step)), so every step it passes must pass
    # torchtitan's interval check; its regular save path then also applies
    # checkpoint.keep_latest_k and checkpoint.async_mode.
    checkpointer.interval = 1
    return checkpointer


class AdapterModelWrapper(ModelWrapper):
    """torchtitan's checkpoint ``ModelWrapper`` restricted to the LoRA adapters: a save
    writes only them and a load restores only them (``ModelWrapper.load_state_dict`` loads
    non-strictly), the frozen base staying as loaded from ``model.hf_path``."""

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super()._get_state_dict().items() if is_adapter_key(k)}


def last_complete_checkpoint(folder: str) -> str | None:
    """The newest complete ``<folder>/step-N`` (module docstring: DCP's ``.metadata``,
    written last), None if there is none."""
    try:
        steps = complete_checkpoint_steps(folder)
    except OSError:
        return None
    return checkpoint_folders(folder)[steps[-1]] if steps else None


def write_checkpoint(
    write: Callable[[], object], *, what: str, path: str, folder: str,
    needed_bytes: int | None, gather: Callable[[object], list] | None = None,
) -> int:
    """Run ``write()`` (which writes the checkpoint folder ``path`` inside ``folder``) and
    return the bytes it wrote. ``needed_bytes``: the last complete save's size, None before
    the first. ``gather``: an all-gather over the ranks that save together (``write`` is a
    collective there): every rank then refuses if any rank is short of space, so none is
    left waiting inside the collective save; None for a single process.

    Raises:
        CheckpointWriteError: before writing, when the free space is measurably short of
            ``needed_bytes``; or when ``write`` raised an OSError (ENOSPC, EACCES, EROFS,
            EDQUOT...), directly or inside DCP's ``CheckpointException``. One line: what,
            where, the free and needed space, the last complete checkpoint.
    """
    last = last_complete_checkpoint(folder)
    last_text = f"last complete checkpoint: {last or 'none'}"
    free = disk.free_bytes(path)
    spaces = [(free, needed_bytes)] if gather is None else gather((free, needed_bytes))
    short = [(rank, f, n) for rank, (f, n) in enumerate(spaces)
             if f is not None and n is not None and f < n]
    if short:
        rank, free_there, needed_there = short[0]
        on_rank = "" if len(spaces) == 1 else f" (rank {rank})"
        raise CheckpointWriteError(
            f"not writing {what} to {path}: {disk.mib(free_there)} free on its filesystem"
            f"{on_rank}, {disk.mib(needed_there)} needed (the last checkpoint's size); free "
            f"space or point output_dir at a larger filesystem; {last_text}",
            path=path, errno=None, free_bytes=free_there, needed_bytes=needed_there,
            last_complete=last,
        )
    existed = os.path.exists(path)
    try:
        write()
    except BaseException as e:  # DCP's CheckpointException is one; re-raised unless an OSError
        os_error = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else disk.os_error_in(e)
        if os_error is None:
            raise
        if not existed:  # half-written: never loadable, and it holds the space
            shutil.rmtree(path, ignore_errors=True)
        free = disk.free_bytes(path)
        basis = "" if needed_bytes is None else " (the last checkpoint's size)"
        raise CheckpointWriteError(
            f"writing {what} to {path} failed: {disk.describe(os_error)}; "
            f"{disk.mib(free)} free, {disk.mib(needed_bytes)} needed{basis}; {last_text}",
            path=path, errno=os_error.errno, free_bytes=free, needed_bytes=needed_bytes,
            last_complete=last,
        ) from None
    return disk.tree_bytes(path)
