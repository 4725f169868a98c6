"""The sampling engines behind the ``Generator`` actor.

- :mod:`~forge_ext.rollout.engines.base`: :class:`SamplingConfig`, :class:`Completion`, seeds,
  stop ids and the :class:`Engine` interface (requests one at a time, weights by version);
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
    as_stop_ids,
    derive_seed,
    make_completion,
    request_seeds,
    stop_token_ids,
)
from forge_ext.rollout.engines.hf import HFEngine, HFSampler

__all__ = [
    "WEIGHT_UPDATE_MODES",
    "Completion",
    "Engine",
    "HFEngine",
    "HFSampler",
    "SamplingConfig",
    "WeightUpdateMode",
    "as_stop_ids",
    "derive_seed",
    "make_completion",
    "request_seeds",
    "stop_token_ids",
]
