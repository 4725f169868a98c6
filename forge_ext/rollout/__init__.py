"""The rollout side: from task rows to scored episodes, on engines that sample tokens.

- :mod:`~forge_ext.rollout.runner`: the episode runner (:class:`EpisodeRunner`), one turn or
  many, with environments, the rubric and the loss mask;
- :mod:`~forge_ext.rollout.engines`: the sampling engines behind the ``Generator`` actor
  (:class:`~forge_ext.rollout.engines.base.SamplingConfig`,
  :class:`~forge_ext.rollout.engines.base.Completion`, the transformers engine, vLLM's
  engine and the code that runs in its workers);
- :mod:`~forge_ext.rollout.router`: which replica serves a request (least-loaded, sticky per
  session);
- :mod:`~forge_ext.rollout.replicas`: a run's generator replicas behind the router, weights
  to all of them, replica faults, per-replica metrics.

The ``Generator`` actor (:mod:`forge_ext.rollout.generator`) is the thin adapter that serves
one engine as one replica.
"""
