"""The sampling engines behind the ``Generator`` actor.

- :mod:`~forge_ext.rollout.engines.base`: :class:`SamplingConfig`, :class:`Completion`, seeds
  and the :class:`Engine` interface (requests one at a time, weights by version);
- :mod:`~forge_ext.rollout.engines.hf`: the transformers engine (:class:`HFEngine` over the
  batch sampler :class:`HFSampler`);
- :mod:`~forge_ext.rollout.engines.vllm`: vLLM's async engine (``VLLMEngine``; imports vLLM
  only when constructed);
- :mod:`~forge_ext.rollout.engines.vllm_worker`: code that runs inside vLLM's worker processes.
"""

from forge_ext.rollout.engines.base import (
    WEIGHT_UPDATE_MODES,
    Completion,
    Engine,
    SamplingConfig,
    WeightUpdateMode,
    derive_seed,
    make_completion,
    request_seeds,
)


def __getattr__(name: str):
    # The transformers engine imports torch and transformers (seconds): only when used, so
    # that configs (SamplingConfig) load without them (issue 38).
    if name in ("HFEngine", "HFSampler"):
        from forge_ext.rollout.engines import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "WEIGHT_UPDATE_MODES",
    "Completion",
    "Engine",
    "HFEngine",
    "HFSampler",
    "SamplingConfig",
    "WeightUpdateMode",
    "derive_seed",
    "make_completion",
    "request_seeds",
]
