"""What a GRPO run reads and checks before anything is spawned: whether it resumes a run in
``output_dir`` (and may), the task's rows, the rubric, the checkpoint's tokenizer, every
prompt's ids, the evaluation sets and where an episode must fit (issue 38).

``python -m apps.grpo.main`` runs :func:`check_run` before it imports torchtitan and Monarch:
a rerun of a finished run says so and exits, a rerun with another config is refused, a bad
data file, column, reward module or a prompt longer than ``trainer.training.seq_len`` is a
``config error`` in seconds; the app then takes the :class:`RunInputs` as they are
(:class:`apps.grpo.main.RLApp`).

Light imports only: the task sources, the rubric, the tokenizer wrapper, the checkpoint
folders' scan. The resume and data checks come first (a missing column or reward module in
about 1.4 s: ``datasets`` is imported only for a dataset task); the tokenizer's after
(``transformers.AutoTokenizer`` imports torch: about 5.7 s in all on a 2-core machine).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from apps.grpo.config import GRPOConfig, check_config
from forge_ext.actors.critic_config import critic_sections
from forge_ext.config import (
    RUN_CONFIG_FILE, config_changes, load_run_record, record_run_config,
)
from forge_ext.engine.checkpoint_files import complete_checkpoint_steps
from forge_ext.engine.schema import checkpoint_config, engine_view
from forge_ext.evaluation import build_sets, close_sets
from forge_ext.evaluation.sets import EvalSet, check_context, check_reward_models
from forge_ext.rollout.runner import EpisodeRunner
from forge_ext.tasks import (
    EPISODE_FIELDS, PromptRenderer, Row, Rubric, Task, build_task, episode_config, resolved_task,
)
from forge_ext.tasks.prompts import render_splits
from forge_ext.tasks.tokenizer import CheckpointTokenizer


# Config keys (dotted prefixes) that may differ when a run is resumed in its output_dir: how
# long it runs and how often it evaluates and saves, evaluation batching, logging, process
# environment, fault injection. Everything else (seed, task, model, optimizer, ...) defines
# the run, and a rerun with another value is refused (forge_ext.config.record_run_config).
# A new loop.steps also re-derives the LR schedule (warm-up and decay are laid out over
# trainer.training.steps), so an extended run is not the run it would have been had it been
# started with the new length.
MAY_CHANGE_ON_RESUME = (
    "loop.steps", "trainer.training.steps", "loop.eval_every", "loop.save_every",
    "loop.export_every", "eval.batch_size", "eval.sets", "export", "metrics", "procs",
    "hosts", "debug",
    "weights.same_host",  # how weights travel, not what they are: follows the placement
    # Left out, the name comes from config.json's model_type, and the checkpoint files are
    # fingerprinted (model_files): a run recorded with the name spelled out still resumes.
    "trainer.model.name", "reference.model.name",
    "critic.model.name",
    # How a batch is split into microbatches: any split gives the same gradient.
    *(f"{role}.training.{name}" for role in ("trainer", "reference", "critic") for name in (
        "microbatch_size", "gradient_accumulation_steps", "max_tokens_per_microbatch",
        "pad_to_multiple_of", "packing")),
)


@dataclass
class RunInputs:
    """A GRPO run's task, rubric, tokenizer, prompts and evaluation sets, checked."""

    task: Task
    rubric: Rubric
    tok: CheckpointTokenizer
    render: PromptRenderer
    runner: EpisodeRunner
    train_rows: list[Row]
    eval_rows: list[Row]
    eval_sets: list[EvalSet]
    context: int | None
    """Tokens an episode may hold: the least of ``trainer.training.seq_len`` and vLLM's
    ``max_model_len`` (None: neither is set)."""


def prepare(config: GRPOConfig) -> RunInputs:
    """Load and check what the run reads, in the order of the cost of the check: the task's
    rows and the rubric (its functions imported, the columns they name present) and the
    evaluation sets' rows and rubrics, then the tokenizer, every prompt rendered (``<unk>``
    in any is warned about on stderr), and the longest prompt plus a response against the
    trainer's and vLLM's lengths.

    Raises:
        ValueError / FileNotFoundError: naming the field, the row or the file, and the fix.
    """
    task = build_task(config.task)
    episodes = episode_config(config.task)
    # An environment's rewards may stand alone (no reward function).
    rubric = Rubric(config.reward, task, environment=episodes.environment is not None)
    eval_sets: list[EvalSet] = []
    try:
        train_rows, eval_rows = list(task.train_rows()), list(task.eval_rows())
        if not eval_rows:
            raise ValueError(f"the task ({task.name}) has no held-out rows; set task.num_eval "
                             "(or task.eval_path) to at least 1")
        loaded: list[CheckpointTokenizer] = []

        def load_tokenizer() -> CheckpointTokenizer:  # once the sets' rows are checked too
            loaded.append(CheckpointTokenizer(config.model.hf_path))
            return loaded[0]

        eval_sets = build_sets(
            config.eval.sets, load_tokenizer, prompt=config.prompt, reward=config.reward,
            max_new_tokens=config.generator.sampling.max_new_tokens, run_task=config.task)
        tok = loaded[0] if loaded else load_tokenizer()
        render = PromptRenderer(tok, config.prompt)
        # Every prompt renders (or the error names its row); <unk> in any is warned about.
        prompts, warning = render_splits(render, {"training": train_rows,
                                                  "held-out": eval_rows})
        if warning:  # e.g. the demo's character tokenizer on English prompts
            print(warning, file=sys.stderr)
        runner = EpisodeRunner(tok, render, rubric, episodes)
        context = _check_lengths(config, runner, episodes,
                                 max(len(ids) for split in prompts.values() for ids in split))
        check_context(eval_sets, config.generator)
        # The sets' reward models are the run's: spawned once, attached to every rubric.
        check_reward_models(eval_sets, {n: entry for n, (entry, _) in rubric.models.items()})
    except BaseException:
        close_sets(eval_sets)
        rubric.close()
        raise
    return RunInputs(task, rubric, tok, render, runner, train_rows, eval_rows, eval_sets,
                     context)


def _check_lengths(config: GRPOConfig, runner: EpisodeRunner, episodes: Any,
                   longest_prompt: int) -> int | None:
    """The tokens an episode may hold (:attr:`RunInputs.context`).

    Raises:
        ValueError: the longest prompt plus one turn's ``generator.sampling.max_new_tokens``
            (or a multi-turn episode's ``task.max_episode_tokens``) does not fit the
            trainer's ``seq_len`` or vLLM's ``max_model_len``, naming every limit at once.
    """
    # An episode after its first prompt: one turn, or up to task.max_episode_tokens.
    after = (episodes.max_episode_tokens if runner.multi_turn
             else config.generator.sampling.max_new_tokens)
    what = "task.max_episode_tokens" if runner.multi_turn else "generator.sampling.max_new_tokens"
    longest = longest_prompt + after
    # Where an episode must fit: the trainer's rows and vLLM's context. (An agent's calls are
    # checked one by one, by the endpoint.)
    limits = {"trainer.training.seq_len": config.trainer.get("training", {}).get("seq_len")}
    if config.generator.backend == "vllm":
        limits["generator.vllm.max_model_len"] = config.generator.vllm.get("max_model_len")
    short = [f"{field_name}={limit}" for field_name, limit in limits.items()
             if limit is not None and longest > limit and episodes.agent is None]
    if short:  # every limit at once (the reference's seq_len follows the trainer's)
        fix = f"raise {' and '.join(s.split('=')[0] for s in short)}"
        most = checkpoint_config(config.model.hf_path).get("max_position_embeddings")
        if isinstance(most, int) and longest > most:  # raising seq_len cannot help: say what can
            fix = (f"{config.model.hf_path}/config.json allows at most {most} "
                   f"(max_position_embeddings), so lower {what} to at most "
                   f"{most - longest_prompt} (the longest prompt is {longest_prompt} tokens) "
                   "or shorten the prompts")
        raise ValueError(f"{' and '.join(short)} < {longest} tokens (longest prompt + "
                         f"{what}); {fix}")
    return min((v for v in limits.values() if v is not None), default=None)


@dataclass
class FinishedRun:
    """``output_dir`` holds a checkpoint of the last step: nothing to train or spawn."""

    config: GRPOConfig
    step: int
    finished = True
    """Nothing to do (:func:`apps.fast_help.check_command_line` prints :meth:`message`)."""

    def message(self) -> str:
        """The one line the app prints: the run is finished, and what to do instead."""
        out = self.config.output_dir
        return (f"output_dir {out} holds a finished run: its checkpoint of step {self.step} is "
                f"the last of loop.steps={self.config.loop.steps}; nothing to do. Raise "
                f"loop.steps to train on, evaluate it with python -m apps.eval --config "
                f"{os.path.join(out, RUN_CONFIG_FILE)} checkpoint=<its hf/step-N or "
                "checkpoints/step-N folder>, or use a new output_dir")


def resume_step_of(config: GRPOConfig) -> int:
    """The step the trainer would resume from: its newest complete ``step-N`` checkpoint
    folder (with ``.metadata``, see :mod:`forge_ext.engine.checkpoint`), and with a critic the
    newest the critic's folder holds too; 0 if none or checkpoints are off."""
    engine = engine_view(config.trainer, "trainer")
    if not engine.checkpoint.enable:
        return 0
    steps = set(complete_checkpoint_steps(Path(engine.dump_folder) / engine.checkpoint.folder))
    if config.critic is not None:  # PPO: the newest step the critic has too
        section, _ = critic_sections(config.critic, policy_hf_path=config.model.hf_path,
                                     trainer=config.trainer)
        critic = engine_view(section, "critic")
        steps &= set(complete_checkpoint_steps(
            Path(critic.dump_folder) / critic.checkpoint.folder))
    return max(steps, default=0)


def run_record(config: GRPOConfig) -> dict[str, Any]:
    """What ``<output_dir>/run_config.yaml`` records of a run: its config, the task resolved,
    and the checkpoint files behind ``model.hf_path`` (the reference and the generator load
    them: rewritten weights at the same path are another run)."""
    return {**asdict(config), "task": resolved_task(config.task),
            "model_files": _file_fingerprints(config.model.hf_path)}


def resume_point(config: GRPOConfig) -> int:
    """The step the run resumes from (:func:`resume_step_of`; 0: it starts over), once a
    rerun in ``output_dir`` is known to be the recorded run.

    Raises:
        ValueError: the checkpoint is beyond ``loop.steps``, ``loop.mode`` changed, or a
            key outside :data:`MAY_CHANGE_ON_RESUME` differs from the record (naming each).
    """
    step = resume_step_of(config)
    if step > config.loop.steps:
        raise ValueError(
            f"output_dir={config.output_dir!r} holds a checkpoint of step {step} > "
            f"loop.steps={config.loop.steps}; set loop.steps >= {step} or use a new output_dir"
        )
    if step > 0:
        _refuse_mode_change(config, step)
        record_run_config(config.output_dir, run_record(config),
                          may_change=MAY_CHANGE_ON_RESUME, write=False)
    return step


def _file_fingerprints(hf_path: str) -> dict[str, str]:
    """``{file: "<size> bytes, mtime_ns <ns>"}`` of a checkpoint's config and weights."""
    folder = Path(hf_path)
    stats = {f.name: f.stat() for f in [folder / "config.json", *folder.glob("*.safetensors")]
             if f.is_file()}
    return {
        name: f"{st.st_size} bytes, mtime_ns {st.st_mtime_ns}" for name, st in sorted(stats.items())
    }


def _refuse_mode_change(config: GRPOConfig, resume_step: int) -> None:
    """A resumed run keeps its ``loop.mode``: its samples so far came from that schedule
    (a record written before ``loop.mode`` existed is a sync run).

    Raises:
        ValueError: naming ``loop.mode``, the recorded mode and the fix.
    """
    record = Path(config.output_dir) / RUN_CONFIG_FILE
    if not record.is_file():
        return
    recorded = (load_run_record(record).get("loop") or {}).get("mode", "sync")
    if recorded != config.loop.mode:
        raise ValueError(
            f"loop.mode={config.loop.mode} but output_dir={config.output_dir!r} holds a "
            f"loop.mode={recorded} run with a checkpoint of step {resume_step}; the mode cannot "
            f"change on resume. Rerun with loop.mode={recorded}, or use a new output_dir"
        )


def check_run(path: str, overrides: list[str]) -> RunInputs | FinishedRun:
    """What ``python -m apps.grpo.main`` runs before its heavy imports
    (:func:`apps.fast_help.exit_on_config_error`): :func:`apps.grpo.config.check_config`,
    :func:`resume_point`, then :func:`prepare`, unless the run in ``output_dir`` is finished.

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    config = check_config(path, overrides)
    step = resume_point(config)
    if step >= config.loop.steps > 0:
        return FinishedRun(config, step)
    return prepare(config)


def warn_if_task_differs_from_warm_start(config: GRPOConfig) -> None:
    """Say how this run's task relates to the one its warm-start was trained on (an apps.sft
    checkpoint records its config; other checkpoints say nothing). Another task source (your
    own data, a reasoning-gym task, a factory of yours on the demo's warm-start) is a choice:
    one ``note:`` line on stdout. The same source with other settings (more digits, another
    answer order, another data file) is allowed (a curriculum) but more often a slip: a
    ``warning:`` on stderr naming each change and the overrides that undo them."""
    record = Path(config.model.hf_path) / RUN_CONFIG_FILE
    try:
        warm_task = load_run_record(record).get("task") if record.is_file() else None
    except ValueError:  # an unreadable record: this check is best effort
        return
    if warm_task is None:
        return
    try:
        warm_task = resolved_task(warm_task)
    except (ValueError, FileNotFoundError):  # e.g. its data files are gone: best effort
        return
    task = resolved_task(config.task)
    path = config.model.hf_path
    if warm_task["source"] != task["source"]:
        print(f"note: model.hf_path={path} was warm-started on task.source="
              f"{warm_task['source']}; this run trains it on task.source={task['source']} "
              "(your own task: nothing to change)")
        return
    # The warm-start is single-turn: GRPO may add an environment and its limits.
    changes = config_changes(warm_task, task,
                             may_change=("num_eval", "partial_credit", *EPISODE_FIELDS))
    if changes:
        undo = [f"task.{c.split(':', 1)[0]}={_override_value(warm_task, c.split(':', 1)[0])}"
                for c in changes]
        print(
            f"warning: the task differs from the one model.hf_path={path} was warm-started "
            f"on ({'; '.join('task.' + c for c in changes)}): likely a mistake, unless meant "
            f"(a curriculum); to train on the warm-start's task, set {' '.join(undo)}",
            file=sys.stderr,
        )


def _override_value(mapping: dict[str, Any], dotted: str) -> str:
    """The value at ``dotted`` in ``mapping`` as a command-line override writes it."""
    value: Any = mapping
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)
