"""The roles of an RL run, as a declarative list (:class:`forge_ext.runtime.roles.RoleSpec`)
read from the run's config: the ``RLTrainer`` (the policy, its loss and weight publisher),
the ``ReferenceModel`` (unless ``reference: null``), the critic (PPO), the ``Generator``
replicas, and one role per reward model of ``reward.functions``.

The config is the RL app's (:class:`apps.grpo.config.GRPOConfig`); the sections read:
``trainer``, ``reference``, ``critic``, ``generator``, ``weights``, ``loss``, ``model``,
``reward.functions``, ``procs`` and ``hosts.launcher``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from forge_ext.actors.critic import spawn_critic
from forge_ext.actors.reference import spawn_reference
from forge_ext.actors.reward_model import reward_model_role, spawn_reward_model
from forge_ext.actors.trainer import spawn_trainer
from forge_ext.rollout.replicas import spawn_replicas
from forge_ext.runtime.placement import Placement
from forge_ext.runtime.roles import RoleSpec


def role_names(config: Any) -> list[str]:
    """The model roles the run spawns, in start-up order: ``trainer``, ``reference`` (with a
    ``reference:`` section), ``critic`` (with a ``critic:`` section), ``generator``."""
    return ["trainer", *(["reference"] if config.reference else []),
            *(["critic"] if config.critic is not None else []), "generator"]


def trainer_weights(config: Any, placement: Placement) -> dict[str, Any]:
    """The trainer's ``weights`` argument: ``weights:`` with its ``run_id`` (default the
    output_dir's absolute path: a restarted run may replace the DCP weight folders its
    crashed process left), and ``same_host: off`` when the trainer and the generator are on
    different hosts (no same-host shortcut between hosts)."""
    weights = {**asdict(config.weights),
               "run_id": config.weights.run_id or os.path.abspath(config.output_dir)}
    if not placement.same_host("trainer", ["generator"]):
        weights["same_host"] = "off"
    return weights


def rl_role_specs(config: Any, placement: Placement, *, tok: Any, weights: dict[str, Any],
                  ready: Callable[[str, Any], None],
                  reward_model_ready: Callable[[str, Any], None]) -> list[RoleSpec]:
    """The specs of :func:`role_names` and of the reward models, spawned on ``placement``.

    Procs on other hosts get the run's and the role's environment (``procs.env``,
    ``procs.<role>.env``); on this machine a role's own is set while it spawns (its procs
    inherit it), as is a reward model's (``reward.functions[i].env``; reward models run on
    this machine, which :meth:`GRPOConfig.validate` checks).

    Args:
        tok: the policy's tokenizer (the generator's stop and pad ids).
        weights: :func:`trainer_weights`.
        ready: called with ``(role, handle)`` once a role is up.
        reward_model_ready: called with ``(reward.functions[i]'s metric name, handle)``.
    """
    c, local = config, config.hosts.launcher == "local"

    def procs(role: str, spawn=placement.spawn_procs):
        env = None if local else {**c.procs.env, **getattr(c.procs, role).env}
        return functools.partial(spawn, role, env=env)

    def role(name: str, spawn: Callable, **more: Any) -> RoleSpec:
        return RoleSpec(name=name, spawn=spawn, env=getattr(c.procs, name).env if local else {},
                        ready=functools.partial(ready, name), **more)

    specs = {
        "trainer": role("trainer", lambda: spawn_trainer(
            c.trainer, loss=c.loss_spec(), weights=weights,
            num_procs=placement.num_procs("trainer"), spawn_procs=procs("trainer"),
            master_addr=placement.master_addr)),
        "reference": role("reference", lambda: spawn_reference(
            c.reference, num_procs=placement.num_procs("reference"),
            spawn_procs=procs("reference"), master_addr=placement.master_addr)),
        "critic": role("critic", lambda: spawn_critic(
            c.critic, policy_hf_path=c.model.hf_path, trainer=c.trainer, loss=asdict(c.loss),
            num_procs=placement.num_procs("critic"), spawn_procs=procs("critic"),
            master_addr=placement.master_addr)),
        "generator": role("generator", lambda: spawn_replicas(
            c.generator, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id,
            key_prefix=c.weights.key_prefix, hosts=placement.layout["generator"][0],
            spawn_procs=procs("generator", placement.spawn_replica_procs),
            keep_base=c.weights.delta),
            meshes=lambda g: [h.procs for h in g.handles],  # each replica its own mesh
            setup_seconds=lambda g: max(h.startup.get("setup", 0.0) for h in g.handles)),
    }
    # Reward models (reward.functions[i].model): frozen classifiers the rubric calls once
    # per batch, stopped with the roles.
    return [specs[name] for name in role_names(c)] + [
        RoleSpec(name=reward_model_role(e.metric_name), env=e.env,
                 label=f"reward model {e.metric_name}",
                 spawn=functools.partial(spawn_reward_model, e, f"reward.functions[{i}]",
                                         name=reward_model_role(e.metric_name)),
                 ready=functools.partial(reward_model_ready, e.metric_name))
        for i, e in enumerate(c.reward.functions) if e.model is not None
    ]
