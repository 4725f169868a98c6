"""What a GRPO run reads and checks before anything is spawned: the task's rows, the rubric,
the checkpoint's tokenizer, every prompt's ids, the evaluation sets and where an episode must
fit (issue 38). ``python -m apps.grpo.main`` runs :func:`check_run` before it imports
torchtitan and Monarch, so a bad data file, column, reward module or a prompt longer than
``trainer.training.seq_len`` is a ``config error`` in seconds; the app then takes the
:class:`RunInputs` as they are (:class:`apps.grpo.main.GRPOApp`).

Light imports only: the task sources, the rubric and the tokenizer wrapper. The data checks
come first (a missing column or reward module in about 1.5 s: ``datasets`` is imported only
for a dataset task); the tokenizer's come after (``transformers.AutoTokenizer`` imports torch,
about 4 s on a 2-core machine).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from apps.grpo.config import GRPOConfig, check_config
from forge_ext.evaluation import build_sets, close_sets
from forge_ext.evaluation.sets import EvalSet, check_context, check_reward_models
from forge_ext.rollout import EpisodeRunner
from forge_ext.tasks import PromptRenderer, Row, Rubric, Task, build_task, episode_config
from forge_ext.tasks.prompts import render_splits
from forge_ext.tasks.tokenizer import CheckpointTokenizer


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

    def close(self) -> None:
        """Stop the rubrics' worker processes (the run's and the evaluation sets')."""
        close_sets(self.eval_sets)
        self.rubric.close()


def prepare(config: GRPOConfig) -> RunInputs:
    """Load and check what the run reads, in the order of the cost of the check: the task's
    rows and the rubric (its functions imported, the columns they name present), then the
    tokenizer, every prompt rendered (``<unk>`` in any is warned about on stderr), the
    longest prompt plus a response against the trainer's and vLLM's lengths, and the
    evaluation sets.

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
        tok = CheckpointTokenizer(config.model.hf_path)
        render = PromptRenderer(tok, config.prompt)
        # Every prompt renders (or the error names its row); <unk> in any is warned about.
        prompts, warning = render_splits(render, {"training": train_rows,
                                                  "held-out": eval_rows})
        if warning:  # e.g. the demo's character tokenizer on English prompts
            print(warning, file=sys.stderr)
        runner = EpisodeRunner(tok, render, rubric, episodes)
        eval_sets = build_sets(
            config.eval.sets, tok, prompt=config.prompt, reward=config.reward,
            max_new_tokens=config.generator.sampling.max_new_tokens)
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
        raise ValueError(f"{' and '.join(short)} < {longest} tokens (longest prompt + "
                         f"{what}); raise {' and '.join(s.split('=')[0] for s in short)}")
    return min((v for v in limits.values() if v is not None), default=None)


def check_run(path: str, overrides: list[str]) -> RunInputs:
    """:func:`apps.grpo.config.check_config` and :func:`prepare`: what ``python -m
    apps.grpo.main`` runs before its heavy imports (:func:`apps.fast_help.exit_on_config_error`).

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    return prepare(check_config(path, overrides))
