"""The sampling engines behind the ``Generator`` actor.

- :mod:`~forge_ext.rollout.engines.base`: :class:`SamplingConfig`, :class:`Completion`, seeds
  and the :class:`Engine` interface (requests one at a time, weights by version);
- :mod:`~forge_ext.rollout.engines.hf`: the transformers engine (:class:`HFEngine` over the
  batch sampler :class:`HFSampler`);
- :mod:`~forge_ext.rollout.engines.vllm`: vLLM's async engine (``VLLMEngine``; imports vLLM
  only when constructed);
- :mod:`~forge_ext.rollout.engines.vllm_worker`: code that runs inside vLLM's worker processes.
"""
