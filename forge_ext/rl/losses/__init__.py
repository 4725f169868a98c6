"""The losses a trainer trains with, in the engine's ``loss_fn(logits, mb)`` /
``loss_weight_fn(mb)`` contract (:meth:`forge_ext.engine.base.BaseEngine.forward_backward_batch`):

- :mod:`~forge_ext.rl.losses.config`: YAML ``loss:`` and the names of its modes (no torch);
- :mod:`~forge_ext.rl.losses.presets`: the named GRPO variants (``loss.preset``; no torch);
- :mod:`~forge_ext.rl.losses.grpo`: the GRPO policy loss, its aggregations, GSPO's sequence
  ratio and the off-policy correction;
- :mod:`~forge_ext.rl.losses.value`: PPO's clipped value loss, the critic's;
- :mod:`~forge_ext.rl.losses.registry`: a loss by name (``{"name": "grpo", **fields}``), as
  the trainer actor builds it, the engine's cross entropy included.

The package itself imports nothing, so that the two config modules load without torch
(issue 38).
"""
