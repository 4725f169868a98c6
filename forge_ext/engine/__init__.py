"""The training engine: a torchtitan model driven through one microbatch core.

No Monarch imports here (actors wrap the engine, not the other way round).
"""

from forge_ext.engine.base import (
    MODEL_TYPE,
    BaseEngine,
    EngineRegistry,
    ForwardBackwardOutputs,
    InferOutputs,
    split_batch,
)
from forge_ext.engine.config import (
    EngineConfig,
    LoRAConfig,
    OffloadConfig,
    engine_config_from_mapping,
)
from forge_ext.engine.losses import IGNORE_INDEX, cross_entropy_loss, valid_tokens
from forge_ext.engine.titan import TitanEngine  # registers the "titan" backend
from forge_ext.engine.hf import HFEngine  # registers the "hf" backend  # noqa: E402


def build_engine(config: EngineConfig | dict) -> BaseEngine:
    """The engine ``config.engine`` names (``trainer.engine``), built from ``config``
    (:meth:`EngineRegistry.new` for a causal LM, ``MODEL_TYPE``).

    Raises:
        ValueError: a config error naming the field (an unknown ``trainer.engine`` too).
    """
    if not isinstance(config, EngineConfig):
        config = engine_config_from_mapping(config)
    return EngineRegistry.new(MODEL_TYPE, config.engine, config)


__all__ = [
    "BaseEngine",
    "EngineConfig",
    "EngineRegistry",
    "ForwardBackwardOutputs",
    "HFEngine",
    "IGNORE_INDEX",
    "InferOutputs",
    "LoRAConfig",
    "MODEL_TYPE",
    "OffloadConfig",
    "TitanEngine",
    "build_engine",
    "cross_entropy_loss",
    "engine_config_from_mapping",
    "split_batch",
    "valid_tokens",
]
