"""The training engine: a model driven through one microbatch core, behind two backends.

No Monarch imports here (actors wrap the engine, not the other way round). The package reads
bottom to top: ``schema`` (a config section checked without torch), ``config`` (the typed
sections), ``core`` and ``base`` (the microbatch core and every verb written once),
``registry`` (backends by name: each checks and builds its own config), the backends
``titan`` and ``hf``; beside them models, checkpoints, LoRA, HF export.

Why this face is lazy: a config is checked before torch is imported (a misspelt key in under
2 s, issue 38) through ``forge_ext.engine.schema``, and Python imports a package before any
of its modules, so an ``__init__`` that imported the engine would import torch and
torchtitan (seconds) for every such check. So each public name is looked up in the module
that defines it on first use, and both backends are imported then too: they register
themselves with ``EngineRegistry``, which ``engine_config_from_mapping`` and
``build_engine`` ask.
"""

from typing import Any

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


def __getattr__(name: str) -> Any:
    # Checked first: ``from forge_ext.engine import titan`` asks for a submodule by this
    # route before importing it.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Deferred, not at the top: these import torch and torchtitan (module docstring).
    from forge_ext.engine import base, config, core, hf, losses, registry, titan

    home = {
        "BaseEngine": base, "EngineConfig": config, "LoRAConfig": config,
        "OffloadConfig": config, "EngineRegistry": registry, "MODEL_TYPE": registry,
        "build_engine": registry, "engine_config_from_mapping": registry,
        "ForwardBackwardOutputs": core, "InferOutputs": core, "split_batch": core,
        "IGNORE_INDEX": losses, "cross_entropy_loss": losses, "valid_tokens": losses,
        "TitanEngine": titan, "HFEngine": hf,
    }[name]
    return getattr(home, name)
