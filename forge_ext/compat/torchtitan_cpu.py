"""Make torchtitan 0.3.0 importable and usable on a machine without an accelerator.

Why: ``torchtitan.tools.utils`` computes ``device_type`` at import time as
``torch._utils._get_available_device_type() or "cuda"``, and other torchtitan modules read
that value when they are imported. On a CPU-only build this yields ``"cuda"`` and
``torch.cuda.set_device`` then fails. Returning ``"cpu"`` when no accelerator is present,
before torchtitan is first imported, makes torchtitan pick ``torch.cpu`` as its device module.
With an accelerator present this is a no-op, so CPU and CUDA share one code path.
"""

from __future__ import annotations

import sys

import torch._utils as _torch_utils

_original = _torch_utils._get_available_device_type


def _available_device_type_or_cpu() -> str:
    return _original() or "cpu"


def apply() -> None:
    """Install the CPU fallback. Must run before ``torchtitan`` is imported.

    Raises:
        RuntimeError: if ``torchtitan.tools.utils`` was already imported with ``"cuda"``
            as its device type on a machine without CUDA (the fix would come too late).
    """
    if _torch_utils._get_available_device_type is not _available_device_type_or_cpu:
        _torch_utils._get_available_device_type = _available_device_type_or_cpu
    tt_utils = sys.modules.get("torchtitan.tools.utils")
    if tt_utils is not None and _original() is None and tt_utils.device_type != "cpu":
        raise RuntimeError(
            "torchtitan was imported before forge_ext; import forge_ext first so that "
            "torchtitan selects the CPU device on a machine without an accelerator"
        )
