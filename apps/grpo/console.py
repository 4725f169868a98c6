"""What the RL app (:class:`apps.grpo.main.RLApp`) shows on the console: its plan before
anything is spawned, the progress bar and one line per step (:mod:`forge_ext.rl.report`), the
plot's panels, the closing lines (held-out accuracy before and after, where everything was
written) and, when a process or host died, the message that says how to resume.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from apps.grpo.config import GRPOConfig
from apps.grpo.prepare import resume_step_of
from forge_ext.config import RUN_CONFIG_FILE
from forge_ext.engine import engine_config_from_mapping
from forge_ext.rl.report import ALGORITHM_NAMES, accuracy_summary, plot_spec, step_line
from forge_ext.tasks import episode_config


class RunConsole:
    """The console hooks of :class:`forge_ext.rl.loop.RLLoop` (``write``, ``log_line``,
    ``plot_spec``, ``on_finish``) and the run's first lines, for the RL app, which holds what
    they read: ``config``, ``loop``, ``metrics``, ``task``, ``prompts``, ``eval_rows``,
    ``eval_sets``, ``rubric``, ``runner``, ``resume_step``, ``reference``, ``critic``,
    ``flat_groups``, ``kl_drift`` and ``bar`` (the progress bar, None until :meth:`start_bar`)."""

    def start_bar(self, step: int) -> None:
        """The progress bar of the steps, at ``step``."""
        from tqdm import tqdm

        # No bar when stdout is not a terminal (disable=None): a redirected log would hold
        # its every carriage-return update; the per-step lines say the same.
        self.bar = tqdm(
            total=self.loop.steps, initial=step, unit="step", file=sys.stdout,
            desc=ALGORITHM_NAMES[self.config.algorithm.advantage], dynamic_ncols=True,
            disable=None,
        )

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def log_line(self, step: int, m: dict[str, float]) -> str | None:
        if self.bar is not None and "loss" in m:
            self.bar.update(1)
        c = self.config
        return step_line(step, m, steps=self.loop.steps, group_size=c.grpo.group_size,
                         replicas=c.generator.replicas, kl=self.reference is not None,
                         eval_sets=self.eval_sets, flat_groups=self.flat_groups,
                         kl_drift=self.kl_drift)

    def plot_spec(self) -> dict[str, Any]:
        c = self.config
        how = "greedy" if c.eval.greedy else "sampled"
        return plot_spec(
            title=f"{ALGORITHM_NAMES[c.algorithm.advantage]} ({self.loop.mode}, "
                  f"max_policy_age {self.loop.max_policy_age})",
            eval_label=f"held-out accuracy ({len(self.eval_rows)} prompts, {how})",
            reward_names=self.rubric.names, replicas=c.generator.replicas,
            multi_turn=self.runner.multi_turn, eval_sets=self.eval_sets,
            critic=self.critic is not None, on_policy=self.on_policy(),
            clip_can_bind=self.clip_can_bind(),
            truncation_causes=self.runner.truncation_causes)

    def on_policy(self) -> bool:
        """Every sample is drawn by the weights it is trained at: ``loop.mode: sync`` with
        ``loop.max_policy_age: 0`` (its policy ages are 0, none is dropped as stale)."""
        return self.loop.mode == "sync" and self.loop.max_policy_age == 0

    def clip_can_bind(self) -> bool:
        """Whether the clipped ratio can leave ``[1 - eps_low, 1 + eps_high]``: not with
        ``loss.off_policy_correction: token_tis`` (its ratio is against the trainer itself,
        1 in value), nor on-policy with the ``hf`` generator (transformers computing in the
        trainer's dtype: the ratio is 1 up to rounding); with vLLM's kernels it measures
        the generator's and the trainer's disagreement."""
        loss = self.config.loss
        return loss.off_policy_correction != "token_tis" and not (
            self.on_policy() and self.config.generator.backend == "hf")

    def model_name(self) -> str:
        """The policy's ``model.name``: as given, else the one the engine reads from
        config.json (``trainer.engine: hf``: its ``model_type``, any family; ``titan``:
        :func:`forge_ext.engine.models.model_name_of`)."""
        from forge_ext.engine.models import model_name_of, read_hf_config

        model = self.config.trainer.get("model", {})
        if model.get("name"):
            return model["name"]
        if self.config.trainer.get("engine") == "hf" and model.get("hf_path"):
            return read_hf_config(model["hf_path"]).get("model_type") or "?"
        return model_name_of(model.get("hf_path"))

    def plan_lines(self, roles: list[str], placement: Any) -> list[str]:
        """The run's first console lines: model, steps and batch, task, roles and where
        they run, output_dir."""
        c = self.config
        name = self.model_name()
        replicas = c.generator.replicas
        procs = ", ".join(
            f"{r} ({c.generator.backend}, {replicas} replica{'s' * (replicas > 1)}, "
            f"weight_update {c.generator.weight_update})" if r == "generator"
            else f"{r} ({placement.num_procs(r)} proc{'s' * (placement.num_procs(r) > 1)}, "
                 f"{(getattr(c, r) or {}).get('engine', 'titan')} engine)"
            for r in roles
        ) + "".join(
            f", reward model {rm} ({entry.procs or 1} proc{'s' * ((entry.procs or 1) > 1)})"
            for rm, (entry, _) in self.rubric.models.items()
        )
        where = "this machine" if c.hosts.launcher == "local" else ", ".join(
            f"{r} {placement.layout[r][0]}x{placement.layout[r][1]}" for r in roles
        ) + f" (hosts x procs, launcher {c.hosts.launcher})"
        rewards = ", ".join(self.rubric.names) or "the environment's"
        return [
            f"{ALGORITHM_NAMES[c.algorithm.advantage]}: {c.loop.steps} steps ({c.loop.mode}) "
            f"of {c.grpo.prompts_per_step} prompts x "
            f"{c.grpo.group_size} samples from {c.model.hf_path} ({name}); output_dir "
            f"{c.output_dir}",
            f"task {self.task.name}: {len(self.prompts.rows)} training rows, "
            f"{len(self.eval_rows)} held-out; rewards {rewards}",
            c.variant_summary(),  # the GRPO variant's resolved fields (loss.preset)
            *self.token_budget_lines(),
            *([f"resuming from the checkpoint of step {self.resume_step} in {c.output_dir}"]
              if self.resume_step else []),
            f"spawning {procs} on {where}" + (
                "; KL reference: the trainer's base (its LoRA adapters disabled)"
                if c.reference_is_trainer_base else ""),
        ]

    def token_budget_lines(self) -> list[str]:
        """Where a step's rows vary (``task.agent``), the token budgets the roles that take
        them train with (:meth:`apps.grpo.config.GRPOConfig._derive_token_budgets`)."""
        c = self.config
        if not episode_config(c.task).rows_vary:
            return []
        budgets = ", ".join(f"{role} {section['training']['max_tokens_per_microbatch']}"
                            for role, section in c.row_sections().items())
        return [f"rows per episode vary (task.agent: a call that does not extend an earlier "
                f"one is a row of its own): token-budget microbatches of {budgets} tokens "
                "(training.max_tokens_per_microbatch; where unset, training.seq_len x the rows "
                "of a fixed microbatch)"]

    def on_finish(self, completed: bool) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        evals = self.metrics.series("eval/accuracy")
        if not completed or not evals:
            return
        # "warm-start": a checkpoint an SFT run wrote (it records its config beside it).
        print(accuracy_summary(
            evals, warm_start=(Path(self.config.model.hf_path) / RUN_CONFIG_FILE).is_file(),
            how="greedy" if self.config.eval.greedy else "sampled",
            prompts=len(self.eval_rows), algorithm=self.config.algorithm.advantage))
        failed = {name: n for name, n in self.rubric.error_counts.items() if n}
        if failed:
            print("reward calls that failed and scored reward.on_error: " + ", ".join(
                f"{name} {n}" for name, n in failed.items()) + " (reward/errors/<name> per step)")
        log_dir = self.metrics.log_dir
        if self.metrics.config.plot:
            print(f"plot: {log_dir / self.metrics.config.plot}")
        if self.metrics.config.tensorboard:
            print(f"tensorboard --logdir {log_dir / 'tensorboard'}")
        print(self.outputs_line())

    def outputs_line(self) -> str:
        """The run's last console line: where everything was written."""
        out = Path(self.config.output_dir)
        parts = [f"run config {out / RUN_CONFIG_FILE}",
                 f"metrics {self.metrics.jsonl_path}"]
        if self.config.trainer.get("checkpoint", {}).get("enable"):
            parts.append(f"checkpoints {self.checkpoint_folder()}")
        if self.config.export.enable and not self.config.trainer.get("lora"):
            parts.append(f"HF checkpoints {out / 'hf'}")
        return f"written to {out}: " + ", ".join(parts)

    def checkpoint_folder(self) -> Path:
        """``<trainer.dump_folder>/<trainer.checkpoint.folder>`` (read once)."""
        if getattr(self, "_checkpoint_folder", None) is None:
            self._checkpoint_folder = checkpoint_folder(self.config)
        return self._checkpoint_folder


def checkpoint_folder(config: GRPOConfig) -> Path:
    """``<trainer.dump_folder>/<trainer.checkpoint.folder>`` of ``config``."""
    engine = engine_config_from_mapping(config.trainer)
    return Path(engine.dump_folder) / engine.checkpoint.folder


def failure_message(failure: Exception, config: GRPOConfig, argv: list[str] | None,
                    module: str = "apps.grpo.main") -> str:
    """What the console shows when a role's process or host died: what died and its likely
    cause, that everything else was stopped, the last checkpoint and the command that
    resumes from it (``python -m <module> <argv>``, default the command line's)."""
    step = resume_step_of(config)
    if step:
        last = f"last checkpoint: step {step} ({checkpoint_folder(config) / f'step-{step}'})"
    else:
        last = "no checkpoint yet: a rerun starts over"
    command = shlex.join([os.path.basename(sys.executable), "-m", module,
                          *(sys.argv[1:] if argv is None else argv)])
    return (f"error: {failure}.\nEvery other process of the run was stopped; {last}.\n"
            f"resume with: {command}")
