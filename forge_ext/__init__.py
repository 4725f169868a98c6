"""forge_ext: a TorchTitan engine inside a Monarch actor for RL post-training."""

from forge_ext.compat import torchtitan_cpu as _torchtitan_cpu

_torchtitan_cpu.apply()
