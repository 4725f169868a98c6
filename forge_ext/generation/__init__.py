"""The generation side: sampling backends of the ``Generator`` actor.

- :mod:`~forge_ext.generation.sampling`: :class:`SamplingConfig`, :class:`Completion`, stop ids
  and the ``transformers`` backend (:class:`HFSampler`);
- :mod:`~forge_ext.generation.vllm_sampler`: the vLLM backend (``VLLMSampler``; imports vLLM
  only when constructed);
- :mod:`~forge_ext.generation.vllm_worker`: code that runs inside vLLM's worker processes.
"""

from forge_ext.generation.sampling import (
    Completion,
    HFSampler,
    SamplingConfig,
    as_stop_ids,
    derive_seed,
    make_completion,
    request_seeds,
    stop_token_ids,
)

__all__ = [
    "Completion",
    "HFSampler",
    "SamplingConfig",
    "as_stop_ids",
    "derive_seed",
    "make_completion",
    "request_seeds",
    "stop_token_ids",
]
