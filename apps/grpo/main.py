"""GRPO on real Monarch actors: ``python -m apps.grpo.main --config configs/<name>.yaml [k=v ...]``.

The RL app (GRPO, RLOO, or PPO with a critic role: ``algorithm.advantage``; ``python -m
apps.ppo.main`` runs it under PPO's name) as config -> roles -> loop: the config and what
the run reads, checked before anything is spawned (:mod:`apps.grpo.config`,
:mod:`apps.grpo.prepare`); the roles (:mod:`apps.grpo.roles`); :class:`RLApp` fills the hooks
of :class:`forge_ext.rl.loop.RLLoop`'s template: ``build_rollouts`` (the step's prompts by
stream position, ``grpo.group_size`` samples each, rewards from the rubric, advantages,
reference log-probs), ``train_step`` (the rollouts through the replay buffer, which drops any
older than ``loop.max_policy_age``, into the trainer), ``push_weights`` / ``fetch_weights``
(``RLTrainer.push_weights(N)`` then ``Generator.update_weights(N)``), ``evaluate`` (held-out
accuracy and ``eval.sets``), and the checkpoints and exports (:mod:`apps.grpo.outputs`).

Output (:mod:`apps.grpo.console`): a progress bar, one console line per step, TensorBoard
events and ``metrics.jsonl`` in ``metrics.log_dir``, a PNG of the run, and a final line with
held-out accuracy before and after. ``<output_dir>/run_config.yaml`` records the resolved
config; a rerun in the same ``output_dir`` resumes from its last checkpoint and must match it
except for :data:`apps.grpo.prepare.MAY_CHANGE_ON_RESUME`. docs/grpo.md says more.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time

if __name__ == "__main__":  # --help and config errors before the imports below (seconds)
    from apps.fast_help import check_command_line

    # The config, the data, the rewards and every prompt, checked before torchtitan and
    # Monarch are imported; the app takes them as they are (main's inputs).
    _checked_inputs = check_command_line("grpo", "apps.grpo.prepare:check_run")

import forge_ext  # noqa: F401  (selects the CPU device before torchtitan is imported)
import torch

from apps.grpo.config import GRPOConfig, grpo_help, load_config
from apps.grpo.console import RunConsole, failure_message
from apps.grpo.outputs import RunOutputs
from apps.grpo.prepare import (
    MAY_CHANGE_ON_RESUME, FinishedRun, RunInputs, prepare, resume_point, run_record,
    warn_if_task_differs_from_warm_start,
)
from apps.grpo.roles import RunRoles
from forge_ext.config import parse_cli, record_run_config
from forge_ext.evaluation import as_logged, evaluate_held_out, evaluate_sets
from forge_ext.rl.advantages import build_estimator
from forge_ext.rl.episode import Episode, pack_episodes, set_ref_logprobs
from forge_ext.rl.loop import MismatchError, RLLoop
from forge_ext.rl.mismatch import Probe, probe_rows, step_mismatch
from forge_ext.rl.replay_buffer import ReplayBuffer
from forge_ext.rl.report import FlatGroupsWatch, KLDriftWatch
from forge_ext.rl.rollouts import Rollouts
from forge_ext.rl.sampling import DynamicSampling, check_training_rows, rollout_seed
from forge_ext.rollout.engines.base import Completion, derive_seed
from forge_ext.rollout.replicas import ReplicasLost
from forge_ext.rollout.runner import EpisodeBatch
from forge_ext.runtime import run_logs
from forge_ext.runtime.disk import find_output_write_error
from forge_ext.runtime.interrupts import exit_status
from forge_ext.runtime.metrics import MetricsConfig
from forge_ext.runtime.placement import PlacementError
from forge_ext.runtime.supervision import RoleFailure, shutdown_monarch
from forge_ext.tasks import PromptStream, Row
from forge_ext.tasks.rubric import RewardFailure, failures_of


class RLApp(RunRoles, RunOutputs, RunConsole, RLLoop):
    """The RL job on actors, GRPO, RLOO or PPO by ``algorithm.advantage`` (module
    docstring)."""

    def __init__(self, config: GRPOConfig, inputs: RunInputs | None = None) -> None:
        """Check ``config`` and what the run reads (``inputs``: :func:`apps.grpo.prepare
        .prepare` of it, done here unless given); nothing is spawned yet.

        Raises:
            ValueError / FileNotFoundError: naming the field and the fix.
        """
        metrics = config.metrics or MetricsConfig(log_dir=config.output_dir)
        super().__init__(config.loop, metrics)
        # Before anything is spawned: what this environment lacks (vllm), and whether a
        # rerun in output_dir matches the run recorded there (it resumes that run).
        config.generator.check_backend()
        resume_step = resume_point(config)
        # The task, its rubric and every prompt's ids, before anything is written or spawned:
        # a bad data file, field, reward or template is a config error now (python -m
        # apps.grpo.main has checked them before its heavy imports and passes them in).
        inputs = prepare(config) if inputs is None else inputs
        self.tok, self.render, self.runner = inputs.tok, inputs.render, inputs.runner
        self.eval_rows, self.eval_sets, self.context = (inputs.eval_rows, inputs.eval_sets,
                                                        inputs.context)
        record_run_config(config.output_dir, run_record(config),
                          may_change=MAY_CHANGE_ON_RESUME,
                          check=resume_step > 0)  # with nothing to resume, start over
        warn_if_task_differs_from_warm_start(config)
        self.config = config
        self.resume_step = resume_step
        """The checkpoint step the run resumes from (0: it starts over)."""
        self.task, self.rubric = inputs.task, inputs.rubric
        self.prompts = PromptStream(inputs.train_rows, config.seed)
        # Dynamic sampling: where each step's prompts begin and the range it consumed.
        self.stream = DynamicSampling(
            self.prompts, prompts_per_step=config.grpo.prompts_per_step,
            group_size=config.grpo.group_size, max_rollout_batches=config.grpo.max_rollout_batches,
            seed=config.seed, output_dir=config.output_dir, overlong=config.reward.overlong)
        self.buffer: ReplayBuffer[Episode] = ReplayBuffer(
            ReplayBuffer.Config(max_policy_age=config.loop.max_policy_age, seed=config.seed)
        )
        # The advantage estimator (algorithm.advantage); gae's needs the critic role.
        self.estimator = build_estimator(config.algorithm, group_size=config.grpo.group_size,
                                         scaling=config.grpo.advantage_scaling)
        self.trainer = self.reference = self.generator = self.critic = None
        self.push_metrics: dict[str, float] = {}  # the last push's, with weights.delta
        self.probe_failed = False  # a replica's scoring raised (said once: see probe)
        self.bar = None
        self.flat_groups = FlatGroupsWatch(config.grpo.group_size)
        self.kl_drift = KLDriftWatch()

    async def sample(self, prompt_ids: list[int], n: int, *, greedy: bool = False,
                     seed: int | None = None, session=None, sampling=None) -> list[Completion]:
        """One request to the generator replicas (:meth:`forge_ext.rollout.replicas
        .GeneratorReplicas.sample`), timed as generator-busy (:meth:`busy`)."""
        with self.busy("generator"):
            return await self.generator.sample(prompt_ids, n, greedy=greedy, seed=seed,
                                               session=session, sampling=sampling)

    def fast_forward(self, step: int) -> None:
        # Without dynamic sampling build_rollouts addresses the prompt stream by step; with
        # it, the position of the resumed step is the one recorded with its checkpoint.
        if self.config.grpo.dynamic_sampling and step > 0:
            self.stream.resume(step)
        self.start_bar(step)

    # ---- one step ------------------------------------------------------------------------
    async def build_rollouts(self, step: int) -> Rollouts:
        c, group = self.config, self.config.grpo.group_size
        start = time.perf_counter()
        with failures_of(f"the rollouts of step {step + 1}"):
            if c.grpo.dynamic_sampling:
                batches, chosen, fillers, stats = await self.stream.rollouts(step, self._rollout)
            else:
                rows = self.prompts.slice(step * c.grpo.prompts_per_step,
                                          c.grpo.prompts_per_step)
                batches = [await self._rollout(rows, rollout_seed(c.seed, step))]
                chosen = [(0, g) for g in range(c.grpo.prompts_per_step)]
                fillers, stats = [], {}
        rolled_out = time.perf_counter()
        rollouts = Rollouts.of(batches, chosen, fillers, group=group, estimator=self.estimator,
                               overlong=c.reward.overlong)
        rollouts.stats = {**stats, **rollouts.stats}
        batch = rollouts.batch
        # Episodes run side by side: "generate" is the wall time until the last one ended
        # (their environments' or agents' time included), "env" / "agent" the mean seconds
        # an episode waited for its environment / spent in its agent's run.
        rollouts.seconds = {"generate": rolled_out - start - batch.reward_seconds,
                            "reward": batch.reward_seconds, **batch.waited_seconds()}
        self._check_rows(len(rollouts.episodes))
        if self.reference is not None:
            start = time.perf_counter()
            packed = pack_episodes(rollouts.episodes, pad_id=self.tok.pad_id)
            set_ref_logprobs(rollouts.episodes, await self.reference.logprobs(packed))
            rollouts.seconds["reference"] = time.perf_counter() - start
        return rollouts

    def _check_rows(self, rows: int) -> None:
        """:func:`forge_ext.rl.sampling.check_training_rows` of a step's ``rows``."""
        check_training_rows(rows, self.config.grpo.batch_size, {
            role: getattr(self.config, role) for role in ("trainer", "reference", "critic")})

    async def _rollout(self, rows: list[Row], seed: int) -> EpisodeBatch:
        """``grpo.group_size`` episodes per row of ``rows``, sampled with ``seed`` on the
        generator at the trainer's version (a step's rollout, or one of dynamic sampling's)."""
        return await self.runner.run(rows, self.config.grpo.group_size, self.sample,
                                     seed=seed, version=self.trainer_version)

    def overlapping_rollouts(self) -> bool:
        # Dynamic sampling's steps begin where the previous step's prompts ended.
        return not self.config.grpo.dynamic_sampling

    def policy_versions(self, rollouts: Rollouts) -> list[int]:
        return [ep.policy_version for ep in rollouts.episodes]

    async def train_step(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        from forge_ext.actors.reference import (
            data_parallel_rows, in_batch_order, split_for_data_parallel,
        )
        from forge_ext.engine.schema import data_parallel_size

        c = self.config
        for episode in rollouts.episodes:
            self.buffer.add(episode)
        rows = len(rollouts.episodes)  # grpo.batch_size, or more with an agent's rows
        batch = self.buffer.sample(self.trainer_version, rows)
        if batch is None:
            raise RuntimeError(
                f"the replay buffer holds {len(self.buffer)} episodes within "
                f"loop.max_policy_age={c.loop.max_policy_age} of policy version "
                f"{self.trainer_version}, fewer than the {rows} a step trains on"
            )
        packed = pack_episodes(batch, pad_id=self.tok.pad_id)
        critic_metrics, seconds = {}, dict(rollouts.seconds)
        if self.critic is not None:
            start = time.perf_counter()
            critic_metrics = await self.critic_step(packed, batch)
            seconds["critic"] = time.perf_counter() - start
        if c.debug.fail_at_step == step + 1:
            packed["advantages"].fill_(math.nan)  # debug.fail_at_step: see DebugSection
        dp = data_parallel_size(self.trainer.config, self.trainer.num_procs)
        rows = data_parallel_rows(packed, self.trainer.config, dp)  # by tokens with a budget
        start = time.perf_counter()
        if self.critic is not None and step < self.critic.options.warmup_steps:
            # critic.warmup_steps: the critic learns the start policy's values first.
            result = {"loss": math.nan, "grad_norm": math.nan, "lr": 0.0}
        else:
            # The generator scores stale samples at the trainer's version while it trains.
            versions = [ep.policy_version for ep in batch]
            probe = asyncio.ensure_future(self.probe(batch, packed, probe_rows(
                versions, trainer_version=self.trainer_version,
                sequences=c.loop.mismatch_probe_sequences)))
            try:
                result = await self.trainer.train_step(
                    *split_for_data_parallel(packed, dp, rows=rows), return_metrics=True,
                    return_logprobs=True,
                )
                probed = await probe
            finally:
                probe.cancel()
            # The train-inference mismatch, from the step's forward before its update.
            result.update(step_mismatch(
                in_batch_order(result.pop("logprobs"), rows), packed, versions,
                [ep.replica for ep in batch], trainer_version=self.trainer_version,
                num_replicas=c.generator.replicas, probe=probed))
        seconds["train"] = time.perf_counter() - start
        metrics = {
            "reward/mean": sum(rollouts.rewards) / len(rollouts.rewards),
            "rollout/accuracy": sum(rollouts.correct) / len(rollouts.correct),
            "rollout/finished": sum(int(ep.response_ids[-1]) in self.tok.stop_ids for ep in batch)
            / len(batch),
            "rollout/response_tokens": sum(len(ep.response_ids) for ep in batch) / len(batch),
            "rollout/truncated": sum(ep.truncated for ep in batch) / len(batch),
            **rollouts.stats,
            # Each reward function's mean and its failed calls this step (the rubric's).
            **rollouts.batch.metrics(),
            # Per replica: requests, tokens/s, idle, paused and update seconds (the replicas').
            **await self.generator.step_metrics(),
            **self.push_metrics,
            **({"agent/rejected_calls": float(self.runner.endpoint.rejected)}
               if self.runner.endpoint is not None else {}),
            "generator_version": rollouts.generator_version,
            "loss": result["loss"],
            "grad_norm": result["grad_norm"],
            "lr": result["lr"],
            # The GRPO loss's own token means (kl to the reference, importance ratio, clip
            # fraction), from the trainer: loss/kl, loss/ratio_mean, loss/clip_fraction.
            **{k: v for k, v in result.items() if k.startswith("loss/")},
            # The train-inference mismatch (forge_ext.rl.mismatch): mismatch/*, offpolicy/*.
            **{k: v for k, v in result.items() if k.startswith(("mismatch/", "offpolicy/"))},
            **critic_metrics,
            **{f"time/{k}": v for k, v in seconds.items()},
        }
        self._write_samples(step + 1, rollouts)
        return metrics

    async def probe(self, batch: list[Episode], packed: dict[str, torch.Tensor],
                    rows: list[int]) -> Probe | None:
        """The mismatch probe (:mod:`forge_ext.rl.mismatch`): once the generator serves the
        trainer's version, each of ``rows`` (stale samples of ``batch``) scored by the
        replica that sampled it; a replica at another version, lost, or whose scoring
        raised (a measurement does not stop the run; the first such error is printed) is
        skipped. None when ``rows`` is empty."""
        if not rows:
            return None
        version = self.trainer_version
        if not await self.generator_serving(version):
            return Probe.of(batch, {}, packed["labels"].shape[1], skipped=len(rows))
        by_replica: dict[int, list[int]] = {}
        for row in rows:
            by_replica.setdefault(batch[row].replica, []).append(row)
        answers = await asyncio.gather(*(
            self.generator.score([(batch[r].prompt_ids.tolist(), batch[r].response_ids.tolist())
                                  for r in of], replica)
            for replica, of in by_replica.items()), return_exceptions=True)
        scores = {}
        for of, answer in zip(by_replica.values(), answers):
            if isinstance(answer, Exception):
                if not self.probe_failed:
                    self.probe_failed = True
                    self.write(f"warning: the mismatch probe could not score (counted in "
                               f"mismatch/probe_skipped): {type(answer).__name__}: {answer}")
                continue
            if isinstance(answer, BaseException):
                raise answer
            if answer is not None and answer.policy_version == version:
                scores.update({r: v for r, v in zip(of, answer.logprobs) if v is not None})
        return Probe.of(batch, scores, packed["labels"].shape[1],
                        skipped=len(rows) - len(scores))

    async def critic_step(self, packed: dict[str, torch.Tensor], batch: list[Episode]
                          ) -> dict[str, float]:
        """PPO: the critic's values of the step's batch, GAE advantages into
        ``packed["advantages"]`` (``[B, S]``), one critic update
        (:meth:`forge_ext.actors.critic.Critic.advantages_and_update`)."""
        kl = None
        if self.config.algorithm.kl_in_reward:
            kl = packed["generator_logprobs"] - packed["ref_logprobs"]
        rewards = torch.tensor([ep.reward for ep in batch], dtype=torch.float32)
        packed["advantages"], metrics = await self.critic.advantages_and_update(
            packed, rewards, self.estimator, kl)
        return metrics

    async def push_weights(self, version: int) -> None:
        info = await self.trainer.push_weights(version, self.generator.reader_base)
        if "delta_base" in info:  # weights.delta: what this version sent (trainer rank 0's)
            self.push_metrics = {
                "weights/bytes": float(info["bytes"]),
                "weights/full_bytes": float(info["full_bytes"]),
                "weights/changed_fraction": info["changed"] / max(info["elements"], 1),
                "weights/anchor": float(info["delta_base"] is None),
                "weights/delta_skipped": float(info["delta_skipped"]),
            }
            if info["delta_warning"]:  # deltas do not pay here (fp32, a large lr): once
                print(f"warning: {info['delta_warning']}", file=sys.stderr, flush=True)

    async def fetch_weights(self, version: int) -> dict[str, float]:
        info = await self.generator.update_weights(version)
        # Per update (the slowest replica's): fetch, load, and how long requests were held.
        return {"generator_update": info["fetch_seconds"] + info["load_seconds"],
                "generator_update_paused": info["paused_seconds"]}

    async def evaluate(self, step: int) -> dict[str, float]:
        c = self.config
        held_out = await evaluate_held_out(
            self.runner, self.eval_rows, self.sample, batch_size=c.eval.batch_size,
            greedy=c.eval.greedy, seed=c.seed * 1_000_003 + 999_983 + step,
            version=self.trainer_version, step=step)
        # The evaluation sets, each seeded from the run's seed, the step and its name.
        sets = await evaluate_sets(self.eval_sets, self.sample, batch_size=c.eval.batch_size,
                                   seed=derive_seed(c.seed, step))
        return {**held_out, **as_logged(sets)}


def main(argv: list[str] | None = None, inputs: RunInputs | FinishedRun | None = None, *,
         module: str = "apps.grpo.main", description: str = __doc__.splitlines()[0]) -> None:
    """The command line: ``--config PATH [key=value ...]`` (``argv``, default ``sys.argv``);
    ``inputs``: :func:`apps.grpo.prepare.check_run` of that command line, if already done;
    ``module``: the app's module, which ``--help`` and the resume command name
    (``apps.ppo.main`` runs this app too), ``description``: its ``--help`` line."""

    path, overrides = parse_cli(argv, description, reference=grpo_help,
                                prog=f"python -m {module}")
    if isinstance(inputs, FinishedRun):  # found before the imports: nothing to train
        print(inputs.message())
        return
    try:
        app = RLApp(load_config(path, overrides), inputs)
    except (ValueError, FileNotFoundError) as e:  # bad config: the message says the fix
        sys.exit(f"config error: {e}")
    if app.resume_step >= app.config.loop.steps > 0:  # nothing to train: nothing spawned
        print(FinishedRun(app.config, app.resume_step).message())
        return
    with run_logs.keep_console(app.config.output_dir):  # the screen, in <output_dir>/logs
        try:
            asyncio.run(app.run())
        except (KeyboardInterrupt, asyncio.CancelledError) as stop:  # Ctrl-C, SIGTERM
            print("interrupted: every actor and proc mesh was stopped; rerun the same command "
                  "to resume from the last checkpoint", file=sys.stderr)
            sys.exit(exit_status(stop))  # 130 after Ctrl-C, 143 after SIGTERM
        except (RoleFailure, ReplicasLost) as failure:  # a process or host died: one message
            sys.exit(failure_message(failure, app.config, argv, module))
        except PlacementError as error:  # the hosts did not start: the message says the fix
            sys.exit(f"error: {error}")
        except RewardFailure as failure:  # every call of a batch failed: count and traceback
            sys.exit(f"error: {failure}")
        except MismatchError as error:  # loop.max_mismatch_kl: the figure, step and causes
            sys.exit(f"error: {error}")
        except Exception as error:  # noqa: BLE001 - re-raised unless an output failed
            write_error = find_output_write_error(error)
            if write_error is None:
                raise
            # A full disk, a read-only folder, a quota: the line names what, where, the space
            # and the last complete checkpoint.
            sys.exit(f"error: {write_error}")


if __name__ == "__main__":
    try:
        main(inputs=_checked_inputs)
    finally:  # the program's end: not in Monarch's 1-second atexit hook (see shutdown_monarch)
        shutdown_monarch()
