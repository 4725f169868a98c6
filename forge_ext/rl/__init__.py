"""The RL algorithm: what turns scored rollouts into a policy update, and the loop that runs it.

- :mod:`~forge_ext.rl.algorithm`: ``algorithm:`` (the advantage estimator's config, no torch);
- :mod:`~forge_ext.rl.advantages`: the estimators (group, leave-one-out, GAE);
- :mod:`~forge_ext.rl.losses`: the GRPO loss with its variants and presets, the value loss;
- :mod:`~forge_ext.rl.episode`: an episode as tensors and its packing into the engine's batch;
- :mod:`~forge_ext.rl.rollouts`: a step's scored batches as the episodes it trains on;
- :mod:`~forge_ext.rl.replay_buffer`: episodes by policy version, stale ones dropped;
- :mod:`~forge_ext.rl.loop`: the RL loop template (sync and async) with its staleness gate;
- :mod:`~forge_ext.rl.sampling`: DAPO's dynamic sampling and overlong reward shaping;
- :mod:`~forge_ext.rl.report`: the step line, the plot's panels and the closing line.
"""
