"""The critic role: PPO's value model, on the trainer actor with a role's config.

The critic is :class:`forge_ext.actors.trainer.RLTrainer` on its own proc mesh, built from an
engine section (YAML ``critic:``, the fields of ``trainer:``) with ``model.value_head: true``
(:func:`forge_ext.engine.models.apply_value_head`: one value per position, from the policy's
checkpoint or ``critic.hf_path``) and the clipped value loss (``loss.name: value``,
:func:`forge_ext.rl.losses.value.value_loss_spec`). Nothing of the trainer is copied: its
endpoints give the values (``forward(output="values")``, forward only), train on the value
loss (``train_step``), save and load checkpoints that hold the critic's optimizer and LR
schedule, and its engine brings the microbatch core, gradient accumulation, DP, PP and the
token budget as they are.

A PPO step (:meth:`Critic.advantages_and_update`): the critic's values of the step's batch,
GAE advantages and returns from them (:class:`forge_ext.rl.advantages.GAE`), then one critic
update on those returns, clipped against those same values. The values are those of the
critic after the previous step's update, in both loop modes: the app calls this when it
trains a step, not when it builds its rollouts, so an asynchronous run's rollouts may come
from an older policy but never meet an older critic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.actors.critic_config import CriticConfig, critic_sections
from forge_ext.actors.reference import data_parallel_rows, forward_rows, split_for_data_parallel
from forge_ext.actors.trainer import TrainerHandle, spawn_trainer
from forge_ext.engine import EngineConfig, engine_config_from_mapping
from forge_ext.engine.schema import data_parallel_size
from forge_ext.rl.advantages import AdvantageEstimator
from forge_ext.rl.losses.value import value_loss_spec


@dataclass
class Critic:
    """Controller handle of the critic role (module docstring)."""

    trainer: TrainerHandle
    options: CriticConfig

    @property
    def config(self) -> EngineConfig:
        return self.trainer.config

    async def values(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[B, S]`` fp32 values of ``batch`` (``input_ids``, ``labels``), aligned with the
        labels (the value at ``t`` is that of the state before ``labels[:, t]``), in the
        batch's row order; 0 past each row's last label under a token budget."""
        return await forward_rows(self.trainer, batch, "values")

    async def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One critic update on ``input_ids``, ``labels``, ``returns`` and ``old_values``
        (``[B, S]`` each; rows split over the critic's DP ranks like the policy's). Returns
        the trainer's metrics: ``loss``, ``grad_norm``, ``lr``, ``loss/clip_fraction``,
        ``loss/values_mean``, ..."""
        keys = ("input_ids", "labels", "returns", "old_values")
        batch = {k: batch[k] for k in keys}
        dp = data_parallel_size(self.config, self.trainer.num_procs)
        rows = data_parallel_rows(batch, self.config, dp)
        return await self.trainer.train_step(
            *split_for_data_parallel(batch, dp, rows=rows), return_metrics=True)

    async def advantages_and_update(
        self, batch: Mapping[str, torch.Tensor], rewards: torch.Tensor,
        estimator: AdvantageEstimator, kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's part of a PPO step (module docstring): values, per-token advantages
        and returns (``estimator.token_advantages``), one critic update.

        Args:
            batch: the step's packed batch (``input_ids``, ``labels`` ``[B, S]``).
            rewards: ``[B]`` each row's episode reward.
            kl: ``[B, S]`` ``log pi_gen - log pi_ref`` for ``algorithm.kl_in_reward``.

        Returns:
            ``(advantages [B, S], metrics)``: the policy's advantages, and
            ``advantage/mean``, ``advantage/std`` (before whitening), ``critic/values_mean``,
            ``critic/returns_mean``, ``critic/explained_variance`` (of these values),
            ``critic/loss``, ``critic/clip_fraction``, ``critic/grad_norm``, ``critic/lr``.
        """
        values = await self.values(batch)
        out = estimator.token_advantages(rewards, batch["labels"], values, kl)
        result = await self.train_step({**batch, "returns": out.returns, "old_values": values})
        metrics = {
            **out.metrics, "critic/loss": result["loss"], "critic/grad_norm": result["grad_norm"],
            "critic/lr": result["lr"], "critic/clip_fraction": result["loss/clip_fraction"],
        }
        return out.advantages, metrics

    async def save_checkpoint(self, step: int) -> int:
        return await self.trainer.save_checkpoint(step)

    async def load_checkpoint(self, step: int | None = None) -> int:
        return await self.trainer.load_checkpoint(step)

    async def stop(self) -> None:
        await self.trainer.stop()


async def spawn_critic(
    critic: Mapping[str, Any], *, policy_hf_path: str, trainer: Mapping[str, Any],
    loss: Mapping[str, Any], num_procs: int | None = None, name: str = "critic",
    spawn_procs: Callable[[], Any] | None = None, master_addr: str | None = None,
) -> Critic:
    """Spawn the critic from a YAML ``critic:`` mapping (:func:`critic_sections`; the
    policy's ``trainer:`` and ``loss:`` sections give its defaults; ``spawn_procs`` and
    ``master_addr`` as in :func:`spawn_trainer`). Raises ValueError on a config error, before
    spawning."""
    engine, options = critic_sections(critic, policy_hf_path=policy_hf_path, trainer=trainer)
    handle = await spawn_trainer(engine, loss=value_loss_spec(options.clip_value, loss),
                                 num_procs=num_procs, name=name, spawn_procs=spawn_procs,
                                 master_addr=master_addr)
    return Critic(handle, options)


def critic_engine_config(critic: Mapping[str, Any], *, policy_hf_path: str,
                         trainer: Mapping[str, Any]) -> EngineConfig:
    """The critic's validated :class:`EngineConfig` (before any spawn; errors name
    ``critic``)."""
    engine, _ = critic_sections(critic, policy_hf_path=policy_hf_path, trainer=trainer)
    return engine_config_from_mapping(engine, section="critic")
