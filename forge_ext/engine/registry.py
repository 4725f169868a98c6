"""Engine backends by name, and the two calls that go through them: a config is checked by
the backend it names (:func:`engine_config_from_mapping`) and built by it
(:func:`build_engine`).

verl's ``EngineRegistry`` (``verl/workers/engine/base.py``): ``trainer.engine`` names the
backend, the actors build it with :meth:`EngineRegistry.new`, so a second backend plugs in
without touching them. A backend registers itself when its module is imported
(``@EngineRegistry.register``, :mod:`forge_ext.engine.titan`, :mod:`forge_ext.engine.hf`);
``forge_ext.engine`` imports both before it hands out any of its names. Each backend checks
its own config (``BaseEngine.validate_config``), so the config layer
(:mod:`forge_ext.engine.config`) never names one, as vLLM's model registry keeps its
configs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from forge_ext.engine.base import BaseEngine
from forge_ext.engine.config import EngineConfig, parse_engine_config

MODEL_TYPE = "language_model"
"""The model type of a causal LM policy or reference (verl's ``language_model``); a critic
would register as ``value_model``."""


class EngineRegistry:
    """Engine backends by model type and backend name::

        @EngineRegistry.register("language_model", "titan")
        class TitanEngine(BaseEngine): ...

        engine = EngineRegistry.new("language_model", "titan", config)
    """

    _engines: dict[str, dict[str, type]] = {}

    @classmethod
    def register(cls, model_type: str, backend: str | list[str]) -> Callable[[type], type]:
        """A class decorator registering a :class:`BaseEngine` subclass as ``backend`` (one
        name or several) for ``model_type``.

        Raises:
            TypeError: the class is not a :class:`BaseEngine`.
            ValueError: another class is registered under the same names already.
        """

        def decorator(engine_class: type) -> type:
            if not (isinstance(engine_class, type) and issubclass(engine_class, BaseEngine)):
                raise TypeError(f"{engine_class!r} is not a BaseEngine subclass")
            backends = cls._engines.setdefault(model_type, {})
            for name in [backend] if isinstance(backend, str) else backend:
                known = backends.get(name)
                if known is not None and known.__qualname__ != engine_class.__qualname__:
                    raise ValueError(f"engine backend {name!r} for {model_type!r} is "
                                     f"{known.__qualname__} already")
                backends[name] = engine_class
            return engine_class

        return decorator

    @classmethod
    def backends(cls, model_type: str = MODEL_TYPE) -> list[str]:
        """The backend names registered for ``model_type``, sorted."""
        return sorted(cls._engines.get(model_type, {}))

    @classmethod
    def get_engine_cls(cls, model_type: str, backend: str) -> type:
        """The class registered as ``backend`` for ``model_type``.

        Raises:
            ValueError: naming ``trainer.engine`` and the registered backends.
        """
        known = cls._engines.get(model_type, {})
        if backend not in known:
            raise ValueError(f"engine={backend!r} is not an engine backend for {model_type} "
                             f"(registered: {', '.join(sorted(known)) or 'none'}); set engine "
                             "to one of them")
        return known[backend]

    @classmethod
    def validate(cls, config: EngineConfig, model_type: str = MODEL_TYPE) -> None:
        """Check ``config`` before anything is spawned: the backend ``config.engine`` names
        must be registered, and its ``validate_config`` checks the rest (which includes
        :meth:`EngineConfig.validate`).

        Raises:
            ValueError: naming the offending field and the fix (an unknown backend too).
            FileNotFoundError: ``model.hf_path`` without a config.json.
        """
        cls.get_engine_cls(model_type, config.engine).validate_config(config)

    @classmethod
    def new(cls, model_type: str, backend: str, *args: Any, **kwargs: Any) -> BaseEngine:
        """Build the engine registered as ``backend`` for ``model_type`` with ``*args``,
        ``**kwargs`` (for the built-in backends: the engine config).

        Raises:
            ValueError: an unknown backend (:meth:`get_engine_cls`).
        """
        return cls.get_engine_cls(model_type, backend)(*args, **kwargs)


def engine_config_from_mapping(
    mapping: Mapping[str, Any] | None = None, section: str = "trainer"
) -> EngineConfig:
    """Build and validate an :class:`EngineConfig` from a nested mapping (YAML ``trainer:``):
    :func:`~forge_ext.engine.config.parse_engine_config`, then :meth:`EngineRegistry.validate`.

    Args:
        section: the YAML section the mapping came from, for error messages.

    Raises:
        ValueError: an unknown key or a value of the wrong type (named with its full path,
            e.g. ``trainer.training.foo``), or a failed check of the backend ``engine``
            names (prefixed ``trainer: ``).
        FileNotFoundError: ``model.hf_path`` without a config.json (prefixed the same way).
    """
    config = parse_engine_config(mapping, section)
    try:
        EngineRegistry.validate(config)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"{section}: {e}") from None
    return config


def build_engine(config: EngineConfig | Mapping[str, Any]) -> BaseEngine:
    """The engine ``config.engine`` names (``trainer.engine``), built from ``config``
    (:meth:`EngineRegistry.new` for a causal LM, :data:`MODEL_TYPE`).

    Raises:
        ValueError: a config error naming the field (an unknown ``trainer.engine`` too).
    """
    if not isinstance(config, EngineConfig):
        config = engine_config_from_mapping(config)
    return EngineRegistry.new(MODEL_TYPE, config.engine, config)
