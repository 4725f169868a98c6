"""forge_ext: a TorchTitan engine inside a Monarch actor for RL post-training."""

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
