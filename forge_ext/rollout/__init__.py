"""The rollout side: from task rows to scored episodes, on engines that sample tokens.

- :mod:`~forge_ext.rollout.episodes`: the episode runner (:class:`EpisodeRunner`), one turn or
  many, with environments, the rubric and the loss mask;
- :mod:`~forge_ext.rollout.engines`: the sampling engines behind the ``Generator`` actor
  (:class:`~forge_ext.rollout.engines.SamplingConfig`, :class:`~forge_ext.rollout.engines
  .Completion`, the transformers engine, vLLM's engine and the code that runs in its workers).
"""

from forge_ext.rollout.episodes import EpisodeBatch, EpisodeRunner, SampleFn, Trajectory

__all__ = ["EpisodeBatch", "EpisodeRunner", "SampleFn", "Trajectory"]
