"""Evaluation sets: ``eval.sets`` of the GRPO app and of ``apps.eval``.

Each set is a task (any ``task:`` source, :mod:`forge_ext.tasks`: its held-out rows) sampled
``n`` times per prompt at its own temperature, top-p and length through the generator
replicas (:class:`forge_ext.rollout.runner.EpisodeRunner`, the path training samples take),
scored by its rubric (its own ``reward:``, default the config's), and summarised by its ``metrics``
(:mod:`forge_ext.evaluation.metrics`), plus the mean reward, response length and truncation
rate of its samples. A set's samples are seeded from the evaluation's seed and the set's name
(so adding a set changes no other set's samples); the same seed gives the same samples and
numbers (the engines seed each request, :func:`forge_ext.rollout.engines.base.derive_seed`).

Every field is checked before anything is spawned (:func:`check_sets`), naming the set:
a set without a task, an unknown metric, ``k > n``, two sets of one name.
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from forge_ext.evaluation.metrics import (
    final_answer, maj_at_k, mean_at_k, parse_metric, pass_at_k,
)
from forge_ext.rollout.engines.base import SamplingConfig, derive_seed
from forge_ext.rollout.runner import EpisodeBatch, EpisodeRunner
from forge_ext.tasks import PromptConfig, RewardConfig
from forge_ext.tasks.rubric import failures_of


RESERVED_NAMES = ("accuracy", "reward", "num_prompts", "episode", "rollout", "agent")
"""Names a set may not take: the held-out evaluation logs ``eval/<these>...``."""


@dataclass(kw_only=True, slots=True)
class EvalSetConfig:
    """One entry of ``eval.sets``."""

    name: str
    """The set's name in metrics (``eval/<name>/<metric>``), tables and plots."""
    task: dict[str, Any] | None = None
    """Any ``task:`` source (``{source: dataset, train_path: ..., num_eval: ...}``, a
    reasoning-gym task, ``"package.module:factory"``); its held-out rows are the set.
    Required."""
    n: int = 1
    """Samples per prompt (pass@k, mean@k and maj@k need ``k <= n``)."""
    temperature: float = 1.0
    """Sampling temperature of the set's ``n`` samples."""
    top_p: float = 1.0
    """Nucleus mass of the set's samples, in (0, 1]."""
    max_new_tokens: int | None = None
    """Longest response; default ``generator.sampling.max_new_tokens``."""
    metrics: list[str] | None = None
    """Among ``greedy`` (accuracy of one greedy completion per prompt), ``pass@k``,
    ``mean@k``, ``maj@k``; default ``[greedy, pass@1]`` plus ``pass@n`` when ``n > 1``."""
    reward: RewardConfig | None = None
    """How its completions are scored (default: the config's ``reward:``); the accuracy
    function's 1.0 rate is what the metrics count as correct."""
    prompt: PromptConfig | None = None
    """How its rows become prompts (default: the config's ``prompt:``)."""
    answer_pattern: str | None = None
    """maj@k: a regex whose last match's group is a completion's final answer (e.g.
    ``'\\\\boxed\\{(.*)\\}'``); default: after the last ``####``, else the last
    ``<answer>...</answer>``, else the whole completion."""
    max_rows: int | None = None
    """Evaluate only the first ``max_rows`` held-out rows (null: all)."""

    def metric_names(self) -> list[str]:
        """``metrics``, or its default (field docstring)."""
        if self.metrics is not None:
            return list(self.metrics)
        return ["greedy", "pass@1", *([f"pass@{self.n}"] if self.n > 1 else [])]

    def sampling(self, default_max_new_tokens: int) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens or default_max_new_tokens)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """YAML ``eval:`` section: the held-out evaluation of a run and its evaluation sets."""

    greedy: bool = True
    """Held-out accuracy with greedy decoding (false: one sample at the sampling settings)."""
    batch_size: int = 256
    """Prompts per request wave: at most this many prompts' requests are in flight at once."""
    sets: list[EvalSetConfig] = field(default_factory=list)
    """Evaluation sets (:class:`EvalSetConfig`); the GRPO app evaluates them with its
    held-out accuracy (``loop.eval_every``), ``apps.eval`` evaluates them, or when there are
    none the held-out split of ``task:`` as one set."""
    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size={self.batch_size} must be >= 1")


def check_sets(sets: list[EvalSetConfig], section: str = "eval.sets") -> None:
    """Check every set before anything is spawned: a name, unique; a task (its source,
    fields and files: :func:`forge_ext.tasks.task_config`; no agent); ``n >= 1``; sampling
    settings in range; known metrics with ``k <= n``; a valid ``answer_pattern``.

    Raises:
        ValueError / FileNotFoundError: one line naming the set, the field and the fix.
    """
    from forge_ext.tasks import episode_config, task_config

    seen = set()
    for i, s in enumerate(sets):
        where = f"{section}[{i}]" + (f" ({s.name})" if s.name else "")
        if not isinstance(s.name, str) or not s.name.strip() or "/" in s.name:
            raise ValueError(f"{where}.name={s.name!r} must be a non-empty name without '/'")
        if s.name in RESERVED_NAMES:
            raise ValueError(f"{where}.name={s.name!r} is taken by the held-out metrics "
                             f"(eval/{s.name}/...); choose another name")
        if s.name in seen:
            raise ValueError(f"{where}: two sets are named {s.name!r}; give each its own name")
        seen.add(s.name)
        if not s.task:
            raise ValueError(f"{where} has no task: give it task: {{source: ..., ...}} (any "
                             "task source, docs/tasks.md; its held-out rows are the set)")
        task_config(s.task, f"{section}[{i}].task")
        if episode_config(s.task, f"{section}[{i}].task").agent is not None:
            raise ValueError(f"{where}: task.agent is not supported in evaluation sets "
                             "(evaluation runs no agent endpoint)")
        if s.n < 1:
            raise ValueError(f"{where}.n={s.n} must be >= 1")
        if s.temperature <= 0:
            raise ValueError(f"{where}.temperature={s.temperature} must be > 0 (the "
                             "'greedy' metric is the greedy accuracy)")
        if not 0 < s.top_p <= 1:
            raise ValueError(f"{where}.top_p={s.top_p} must be in (0, 1]")
        if s.max_new_tokens is not None and s.max_new_tokens < 1:
            raise ValueError(f"{where}.max_new_tokens={s.max_new_tokens} must be >= 1")
        if s.max_rows is not None and s.max_rows < 1:
            raise ValueError(f"{where}.max_rows={s.max_rows} must be >= 1 (or null: all)")
        names = s.metric_names()
        if not names:
            raise ValueError(f"{where}.metrics is empty; list some of greedy, pass@k, mean@k, "
                             "maj@k")
        for name in names:
            try:
                kind, k = parse_metric(name)
            except ValueError as e:
                raise ValueError(f"{where}.metrics: {e}") from None
            if k is not None and k > s.n:
                raise ValueError(f"{where}.metrics: {name} needs at least {k} samples per "
                                 f"prompt but n={s.n}; raise n to {k} or lower k")
        if s.answer_pattern is not None:
            try:
                groups = re.compile(s.answer_pattern).groups
            except re.error as e:
                raise ValueError(f"{where}.answer_pattern={s.answer_pattern!r}: {e}") from None
            if groups != 1:
                raise ValueError(f"{where}.answer_pattern={s.answer_pattern!r} must have "
                                 f"exactly one group (the answer), it has {groups}")


def check_context(sets: list[EvalSet], generator: Any) -> None:
    """Each set's longest prompt plus its ``max_new_tokens`` fits a vLLM generator's
    ``generator.vllm.max_model_len`` (when set).

    Raises:
        ValueError: naming the set, the lengths and the fields to change.
    """
    limit = generator.vllm.get("max_model_len") if generator.backend == "vllm" else None
    if limit is None:
        return
    for i, s in enumerate(sets):
        longest = s.longest_prompt() + s.sampling.max_new_tokens
        if longest > limit:
            raise ValueError(
                f"eval.sets[{i}] ({s.name}): longest prompt + max_new_tokens = {longest} "
                f"tokens > generator.vllm.max_model_len={limit}; raise max_model_len or lower "
                "the set's max_new_tokens")


def check_reward_models(sets: list[EvalSet], run_models: dict[str, Any]) -> None:
    """Each set's reward models (``reward.functions[i].model``) are among ``run_models``
    (``{name: entry}`` of the reward models the app spawns and attaches to the sets' rubrics:
    a GRPO run's own; none in ``apps.eval``), with the same entries: an unattached model
    would score every sample ``reward.on_error``.

    Raises:
        ValueError: naming the set, the reward model and the fix.
    """
    for i, s in enumerate(sets):
        for name, (entry, _) in s.runner.rubric.models.items():
            if run_models.get(name) == entry:
                continue
            runs = ("the run's reward models, which are the ones it spawns" if run_models
                    else "run here (apps.eval and a run without reward models spawn none)")
            raise ValueError(
                f"eval.sets[{i}] ({s.name}): its reward model {name!r} (reward.functions: "
                f"model: {entry.model}) is not {runs}; score the set with reward functions "
                "(fn: ...)" + (" or the run's reward" if run_models else ""))


def default_set(task: dict[str, Any], greedy: bool = True) -> EvalSetConfig:
    """The held-out split of the run's ``task:`` as an evaluation set: its greedy accuracy
    (or, with ``greedy`` false, pass@1 of one sample)."""
    return EvalSetConfig(name="held-out", task=task, n=1,
                         metrics=["greedy"] if greedy else ["pass@1"])


@dataclass
class SetResult:
    """One set's evaluation."""

    name: str
    metrics: dict[str, float]
    """Its metrics (``greedy``, ``pass@k``, ...), ``reward`` (mean), ``response_tokens``
    (mean), ``truncated`` (rate); ``prompts`` (count)."""
    settings: dict[str, Any]
    """What produced them: task, n, temperature, top_p, max_new_tokens, seed."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Per sample: ``row`` (index), ``greedy``, ``prompt_ids``, ``response_ids``,
    ``logprobs``, ``completion``, ``answer``, ``correct``, ``reward``, ``truncated``."""
    seconds: float = 0.0


class EvalSet:
    """A set built: its rows, episode runner and sampling settings (:func:`build_sets`)."""

    def __init__(self, config: EvalSetConfig, task: Any, runner: Any, rows: list,
                 sampling: SamplingConfig, resolved_task: dict[str, Any]) -> None:
        self.config, self.task, self.runner, self.rows = config, task, runner, rows
        self.sampling, self.resolved_task = sampling, resolved_task
        self.metrics = config.metric_names()
        parsed = [parse_metric(m) for m in self.metrics]
        self.greedy = any(kind == "greedy" for kind, _ in parsed)
        self.sampled = any(kind != "greedy" for kind, _ in parsed)

    @property
    def name(self) -> str:
        return self.config.name

    def seed(self, seed: int) -> int:
        """The set's sampling seed under the evaluation's ``seed`` (module docstring)."""
        return derive_seed(seed, zlib.crc32(self.name.encode()))

    def longest_prompt(self) -> int:
        return max(len(self.runner.render(row)) for row in self.rows)

    async def evaluate(self, sample: Any, *, seed: int, batch_size: int,
                       keep_samples: bool = False) -> SetResult:
        """Sample, score and summarise the set (module docstring) through ``sample`` (a
        :data:`forge_ext.rollout.runner.SampleFn`, e.g. the replicas' ``sample``)."""
        start = time.perf_counter()
        set_seed = self.seed(seed)
        n = self.config.n
        greedy_batch = sampled_batch = None
        if self.greedy:
            greedy_batch = await self._run(sample, 1, batch_size, greedy=True, seed=None)
        if self.sampled:
            sampled_batch = await self._run(sample, n, batch_size, greedy=False, seed=set_seed)
        records = {"greedy": self._records(greedy_batch, 1, True),
                   "sampled": self._records(sampled_batch, n, False)}
        correct = [[r["correct"] for r in records["sampled"][i * n:(i + 1) * n]]
                   for i in range(len(self.rows))] if sampled_batch is not None else []
        answers = [[r["answer"] for r in records["sampled"][i * n:(i + 1) * n]]
                   for i in range(len(self.rows))] if sampled_batch is not None else []
        metrics: dict[str, float] = {}
        for name in self.metrics:
            kind, k = parse_metric(name)
            if kind == "greedy":
                values = [float(r["correct"]) for r in records["greedy"]]
            elif kind == "pass":
                values = [pass_at_k(n, sum(c), k) for c in correct]
            elif kind == "mean":
                values = [mean_at_k(n, sum(c), k) for c in correct]
            else:
                values = [maj_at_k(a, c, k, seed=derive_seed(set_seed, i))
                          for i, (a, c) in enumerate(zip(answers, correct))]
            metrics[name] = sum(values) / len(values)
        main_records = records["sampled" if sampled_batch is not None else "greedy"]
        metrics["reward"] = sum(r["reward"] for r in main_records) / len(main_records)
        metrics["response_tokens"] = (sum(r["tokens"] for r in main_records)
                                      / len(main_records))
        metrics["truncated"] = sum(r["truncated"] for r in main_records) / len(main_records)
        metrics["prompts"] = float(len(self.rows))
        settings = {
            "task": self.resolved_task, "rows": len(self.rows), "n": n,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "max_new_tokens": self.sampling.max_new_tokens, "seed": set_seed,
            "greedy": self.greedy, "metrics": self.metrics,
        }
        return SetResult(
            name=self.name, metrics=metrics, settings=settings,
            samples=(records["greedy"] + records["sampled"]) if keep_samples else [],
            seconds=time.perf_counter() - start,
        )

    async def _run(self, sample: Any, group: int, batch_size: int, *, greedy: bool,
                   seed: int | None):
        batches = []
        for lo in range(0, len(self.rows), batch_size):
            batches.append(await self.runner.run(
                self.rows[lo:lo + batch_size], group, sample, greedy=greedy,
                seed=None if seed is None else derive_seed(seed, lo), sampling=self.sampling,
            ))
        return EpisodeBatch.concat(batches)

    def _records(self, batch: Any, group: int, greedy: bool) -> list[dict[str, Any]]:
        if batch is None:
            return []
        tok, pattern = self.runner.tok, self.config.answer_pattern
        out = []
        for j, (t, ok, reward) in enumerate(zip(batch.trajectories, batch.scores.correct,
                                                batch.rewards)):
            text, finished = tok.completion_text(t.last_turn)
            out.append({
                "row": j // group, "greedy": greedy, "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids, "logprobs": t.logprobs,
                "completion": text, "answer": final_answer(text, finished and not t.truncated,
                                                           pattern),
                "correct": bool(ok), "reward": float(reward),
                "tokens": sum(t.response_mask), "truncated": bool(t.truncated),
            })
        return out


def build_sets(configs: list[EvalSetConfig], tok: Any, *, prompt: PromptConfig,
               reward: RewardConfig, max_new_tokens: int,
               run_task: dict[str, Any] | None = None) -> list[EvalSet]:
    """The sets' tasks (rows loaded), renderers, rubrics and runners; ``prompt``, ``reward``
    and ``max_new_tokens`` are the defaults of sets that do not set their own. Call
    :func:`close_sets` when done (the rubrics' worker processes).

    Args:
        tok: the tokenizer, or a function of no argument that loads it, called once every
            set's rows and rubric are built (a data error then comes before the seconds a
            tokenizer costs to import; issue 38).
        run_task: the config's own ``task:`` section: a set whose task is that one
            (``task: ${task}``, :func:`default_set`) has its errors named ``task.<field>``,
            the others ``eval.sets[i].task.<field>``.

    Raises:
        ValueError: a set with no held-out rows, or a row that does not render (naming the
            set and the row).
    """
    from forge_ext.tasks import PromptRenderer, Rubric, build_task, episode_config, resolved_task

    loaded, built = [], []
    try:
        for i, c in enumerate(configs):
            field = "task" if run_task is not None and c.task == run_task else (
                f"eval.sets[{i}].task")
            task = build_task(c.task, field)
            rows = list(task.eval_rows())[: c.max_rows]
            if not rows:
                raise ValueError(f"eval.sets[{i}] ({c.name}): its task ({task.name}) has no "
                                 "held-out rows; set task.num_eval or task.eval_path")
            episodes = episode_config(c.task)
            # An environment's rewards may stand alone (no reward functions), as in training.
            loaded.append((c, task, rows, episodes,
                           Rubric(c.reward or reward, task,
                                  environment=episodes.environment is not None)))
        if loaded and callable(tok) and not hasattr(tok, "encode_prompt"):
            tok = tok()
        for i, (c, task, rows, episodes, rubric) in enumerate(loaded):
            render = PromptRenderer(tok, c.prompt or prompt)
            for j, row in enumerate(rows):
                try:
                    render(row)
                except ValueError as e:
                    raise ValueError(f"eval.sets[{i}] ({c.name}) row {j}: {e}") from None
            runner = EpisodeRunner(tok, render, rubric, episodes)
            built.append(EvalSet(c, task, runner, rows, c.sampling(max_new_tokens),
                                 resolved_task(c.task)))
    except BaseException:
        for *_, rubric in loaded:
            rubric.close()
        raise
    return built


def close_sets(sets: list[EvalSet]) -> None:
    """Stop the sets' reward worker processes."""
    for s in sets:
        s.runner.rubric.close()


async def evaluate_sets(sets: list[EvalSet], sample: Any, *, seed: int, batch_size: int,
                        keep_samples: bool = False) -> list[SetResult]:
    """Every set, one after another (:meth:`EvalSet.evaluate`)."""
    return [await s.evaluate(sample, seed=seed, batch_size=batch_size,
                             keep_samples=keep_samples) for s in sets]


def overall(results: list[SetResult]) -> dict[str, float]:
    """Each metric's unweighted mean over the sets that have it (every set counts alike,
    whatever its size)."""
    names: dict[str, list[float]] = {}
    for r in results:
        for name, value in r.metrics.items():
            if name != "prompts":
                names.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in names.items()}


def as_logged(results: list[SetResult], prefix: str = "eval") -> dict[str, float]:
    """``{"<prefix>/<set>/<metric>": value}`` for metric logging."""
    return {f"{prefix}/{r.name}/{m}": v for r in results for m, v in r.metrics.items()}


async def evaluate_held_out(runner: Any, rows: list[Any], sample: Any, *, batch_size: int,
                            greedy: bool, seed: int, version: int,
                            step: int) -> dict[str, float]:
    """An RL run's held-out evaluation at ``step``: one episode of each of ``rows`` through
    ``runner`` (:class:`forge_ext.rollout.runner.EpisodeRunner`) and ``sample``, ``batch_size`` rows
    at a time, greedy or sampled with ``seed``, by the policy of ``version``.

    Returns:
        ``eval/accuracy`` (the rate at which the rubric's accuracy function scores 1),
        ``eval/reward`` (the mean reward), ``eval/num_prompts``, and the episodes' metrics
        (``eval/episode/...``, ``eval/reward/<function>``, ...).

    Raises:
        RewardFailure: every call of a batch failed (:func:`forge_ext.tasks.rubric
            .failures_of`, naming the step).
    """
    batches = []
    for lo in range(0, len(rows), batch_size):
        with failures_of(f"the held-out evaluation at step {step}"):
            batches.append(await runner.run(rows[lo : lo + batch_size], 1, sample,
                                            greedy=greedy, seed=None if greedy else seed,
                                            version=version))
    batch = EpisodeBatch.concat(batches)
    n = len(batch.rewards)
    return {
        "eval/accuracy": sum(batch.scores.correct) / n,
        "eval/reward": sum(batch.rewards) / n,
        "eval/num_prompts": n,
        **{"eval/" + k: v for k, v in batch.metrics().items()},
    }
