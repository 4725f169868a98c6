"""The engine package's names (``forge_ext.engine`` imports this module on first use: it
imports torch and torchtitan, and registers both backends)."""

from forge_ext.engine.base import (  # noqa: F401
    MODEL_TYPE,
    BaseEngine,
    EngineRegistry,
    ForwardBackwardOutputs,
    InferOutputs,
    split_batch,
)
from forge_ext.engine.config import (  # noqa: F401
    EngineConfig,
    LoRAConfig,
    OffloadConfig,
    engine_config_from_mapping,
)
from forge_ext.engine.losses import IGNORE_INDEX, cross_entropy_loss, valid_tokens  # noqa: F401
from forge_ext.engine.titan import TitanEngine  # noqa: F401  (registers the "titan" backend)
from forge_ext.engine.hf import HFEngine  # noqa: F401, E402  (registers the "hf" backend)


def build_engine(config: EngineConfig | dict) -> BaseEngine:
    """The engine ``config.engine`` names (``trainer.engine``), built from ``config``
    (:meth:`EngineRegistry.new` for a causal LM, ``MODEL_TYPE``).

    Raises:
        ValueError: a config error naming the field (an unknown ``trainer.engine`` too).
    """
    if not isinstance(config, EngineConfig):
        config = engine_config_from_mapping(config)
    return EngineRegistry.new(MODEL_TYPE, config.engine, config)
