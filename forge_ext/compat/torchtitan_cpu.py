"""Make torchtitan 0.3.0 importable and usable on a machine without an accelerator.

Why: ``torchtitan.tools.utils`` computes ``device_type`` at import time as
``torch._utils._get_available_device_type() or "cuda"``, and other torchtitan modules read
that value when they are imported. On a CPU-only build this yields ``"cuda"`` and
``torch.cuda.set_device`` then fails. Returning ``"cpu"`` when no accelerator is present,
before torchtitan is first imported, makes torchtitan pick ``torch.cpu`` as its device module.
With an accelerator present this is a no-op, so CPU and CUDA share one code path.

:func:`install` (``import forge_ext`` calls it) applies the fix just before ``torchtitan`` is
first imported, not at once: importing torch costs seconds, and a config error, ``--help``
or a finished run must not wait for it (issue 38).
"""

from __future__ import annotations

import importlib.abc
import sys

_original = None


def _available_device_type_or_cpu() -> str:
    return _original() or "cpu"


def apply() -> None:
    """Install the CPU fallback now (imports torch). Must run before ``torchtitan`` is
    imported.

    Raises:
        RuntimeError: if ``torchtitan.tools.utils`` was already imported with ``"cuda"``
            as its device type on a machine without CUDA (the fix would come too late).
    """
    global _original
    import torch._utils as torch_utils

    if torch_utils._get_available_device_type is not _available_device_type_or_cpu:
        _original = torch_utils._get_available_device_type
        torch_utils._get_available_device_type = _available_device_type_or_cpu
    tt_utils = sys.modules.get("torchtitan.tools.utils")
    if tt_utils is not None and _original() is None and tt_utils.device_type != "cpu":
        raise RuntimeError(
            "torchtitan was imported before forge_ext; import forge_ext first so that "
            "torchtitan selects the CPU device on a machine without an accelerator"
        )


class _BeforeTorchtitan(importlib.abc.MetaPathFinder):
    """Applies the fix when ``torchtitan`` is about to be imported, then steps aside (it
    finds nothing: the ordinary finders import torchtitan)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchtitan":
            sys.meta_path.remove(self)
            apply()
        return None


def install() -> None:
    """Apply the fix now if torch or torchtitan is already imported, else just before
    ``torchtitan`` is."""
    if "torch" in sys.modules or "torchtitan" in sys.modules:
        apply()
    elif not any(isinstance(f, _BeforeTorchtitan) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchtitan())
