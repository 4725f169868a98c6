"""forge_ext: a TorchTitan engine inside a Monarch actor for RL post-training."""

import logging as _logging
import os as _os

from forge_ext.compat import torchtitan_cpu as _torchtitan_cpu

# torchstore's import, when this Monarch frame limit is unset, sets it and also raises the
# root logger to INFO with a stdout handler, and warns that it did (torchstore/__init__.py,
# torchstore/logging.py): every process then printed every torchtitan INFO line (three per
# checkpoint save). The value torchstore sets, before torchstore is imported; procs inherit it.
_os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", "910737418240")

_torchtitan_cpu.install()  # just before torchtitan is imported

# vLLM logs its engine's start (config, thread binding, model loading: ~40 lines per engine)
# and every weight reload at INFO, and CPU-build notices at WARNING, on the run's console from
# the generator's processes. Only its errors by default; set VLLM_LOGGING_LEVEL to see more.
# Before vLLM is imported anywhere; procs and vLLM's own processes inherit it.
_os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vLLM 0.32 applies that level only when an engine configures its logging
# (vllm/logger.py, configure_logging_if_needed): a process that imports vLLM's modules
# without starting an engine (the controller's agents' endpoint, which uses its OpenAI
# protocol classes) printed its import-time warnings ("Triton is installed, but doesn't
# include CPU backend") through Python's last-resort handler. Its loggers' parent takes the
# level now; vLLM's own configuration, when an engine starts, sets the same.
_VLLM_LEVEL = _logging.getLevelName(_os.environ["VLLM_LOGGING_LEVEL"].upper())
if isinstance(_VLLM_LEVEL, int):  # a name vLLM itself would reject is left to it
    _logging.getLogger("vllm").setLevel(_VLLM_LEVEL)
