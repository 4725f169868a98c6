"""The training engine: a torchtitan model driven through one microbatch core.

No Monarch imports here (actors wrap the engine, not the other way round).
"""

from forge_ext.engine.base import BaseEngine, ForwardBackwardOutputs, split_batch
from forge_ext.engine.config import EngineConfig, LoRAConfig, engine_config_from_mapping
from forge_ext.engine.losses import IGNORE_INDEX, cross_entropy_loss, valid_tokens
from forge_ext.engine.titan import TitanEngine

__all__ = [
    "BaseEngine",
    "EngineConfig",
    "ForwardBackwardOutputs",
    "IGNORE_INDEX",
    "LoRAConfig",
    "TitanEngine",
    "cross_entropy_loss",
    "engine_config_from_mapping",
    "split_batch",
    "valid_tokens",
]
