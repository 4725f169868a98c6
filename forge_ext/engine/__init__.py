"""The training engine: a torchtitan model driven through one microbatch core.

No Monarch imports here (actors wrap the engine, not the other way round).
"""

# Everything below imports torch and torchtitan (seconds): on the first use of any name,
# all at once (so both backends are registered), and not when a light submodule
# (forge_ext.engine.schema, what a config is checked with before anything starts) is
# imported (issue 38).
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


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from forge_ext.engine import _all

    return getattr(_all, name)
