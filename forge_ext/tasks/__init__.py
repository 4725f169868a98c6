"""Tasks: where prompts, reference answers and rewards come from, for every app.

``task:`` (YAML) picks a source by ``task.source`` and gives its fields:

=====================  ==========================================================  ==========
source                 fields (its ``Config``)                                     rewards
=====================  ==========================================================  ==========
``addition``           :class:`~forge_ext.tasks.addition.AdditionTask.Config`      ``addition``
(default)              (the CPU demo's embedded task)
``dataset``            :class:`~forge_ext.tasks.sources.DatasetTask.Config`        none: set
                       (local ``.jsonl``/``.json``/``.parquet``/``.csv``/folder)   ``reward:``
``reasoning_gym``      :class:`~forge_ext.tasks.sources.ReasoningGymTask.Config`   ``reasoning_gym``
``"pkg.module:name"``  a user's factory, called with the other fields as keyword
                       arguments (or a class with a ``Config``, built from them)
=====================  ==========================================================  ==========

Every source also takes the multi-turn fields (:class:`~forge_ext.tasks.environments.
EpisodeConfig`: ``environment``, ``max_turns``, ``max_episode_tokens``, ``env_timeout_s``).

``reward:`` (:class:`~forge_ext.tasks.rubric.RewardConfig`) lists reward functions and weights
(:mod:`forge_ext.tasks.rewards`), ``prompt:`` (:class:`~forge_ext.tasks.prompts.PromptConfig`)
how a row's prompt becomes token ids, and :class:`PromptStream` the order rows are trained in.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from forge_ext.config import unknown_keys_message
from forge_ext.tasks.addition import AdditionTask
from forge_ext.tasks.base import Message, RewardFn, Row, Task
from forge_ext.tasks.environments import EPISODE_FIELDS, ENVIRONMENTS, EpisodeConfig
from forge_ext.tasks.prompts import PromptConfig, PromptRenderer
from forge_ext.tasks.rewards import BUILTIN_REWARDS, load_object
from forge_ext.tasks.rubric import RewardConfig, RewardFunctionConfig, Rubric, Sample, Scores
from forge_ext.tasks.sources import DatasetTask, ReasoningGymTask

SOURCES: dict[str, type] = {
    "addition": AdditionTask.Config,
    "dataset": DatasetTask.Config,
    "reasoning_gym": ReasoningGymTask.Config,
}
"""``task.source`` -> the source's ``Config`` (whose ``build()`` returns the task)."""


def task_section_variants() -> dict[str, type]:
    """The shapes of a ``task:`` section for an app's config reference
    (:func:`forge_ext.config_doc.sections`' ``expand``): one per ``task.source``
    (:data:`SOURCES`, the default marked), then the multi-turn fields every source takes
    (:class:`EpisodeConfig`)."""
    variants = {f"task.source: {name}" + (" (default)" if name == "addition" else ""): cls
                for name, cls in SOURCES.items()}
    return {**variants, "every source: multi-turn episodes": EpisodeConfig}


def task_config(mapping: Mapping[str, Any] | None, section: str = "task") -> Any:
    """The typed config of a ``task:`` section: the source's ``Config`` built strictly from
    the other fields, or for an import path a :class:`PluginTask` holding them. Reads no
    data (files are only checked to exist).

    Raises:
        ValueError / FileNotFoundError: an unknown source or field, a bad value, a missing
            file, an import path that does not import or names no callable.
    """
    from forge_ext.config import from_mapping

    fields = {k: v for k, v in dict(mapping or {}).items() if k not in EPISODE_FIELDS}
    source = fields.pop("source", "addition")
    if not isinstance(source, str):
        raise ValueError(f"{section}.source={source!r} must be a string")
    if source in SOURCES:
        return from_mapping(SOURCES[source], fields, path=section)
    if ":" not in source:
        raise ValueError(
            f"{section}.source={source!r} is not a task source: use one of {sorted(SOURCES)} "
            "or a 'package.module:factory' import path"
        )
    factory = load_object(source, f"{section}.source")
    if not callable(factory):
        raise ValueError(f"{section}.source={source!r} names a {type(factory).__name__}, "
                         "not a callable")
    config_cls = getattr(factory, "Config", None)
    if dataclasses.is_dataclass(config_cls):
        config = from_mapping(config_cls, fields, path=section)
        return PluginTask(source, lambda: config.build() if hasattr(config, "build")
                          else factory(config), dataclasses.asdict(config))
    return PluginTask(source, lambda: factory(**fields), fields)


def task_key_problems(mapping: Mapping[str, Any], section: str = "task") -> list[str]:
    """The unknown keys of a ``task:`` section of a built-in source (its ``Config`` and the
    multi-turn fields), as :func:`forge_ext.config.key_problems` words them; a
    :data:`forge_ext.config.SectionCheck` for an app's ``from_mapping``, so that they are
    reported with the config's other unknown keys. Nothing for a source of the user's
    (:func:`task_config` imports it and checks its fields)."""
    source = mapping.get("source", "addition")
    if not isinstance(source, str) or source not in SOURCES:
        return []
    fields = {k: v for k, v in mapping.items() if k != "source"}
    accepted = [f.name for f in dataclasses.fields(SOURCES[source])] + sorted(EPISODE_FIELDS)
    unknown = sorted(set(fields) - set(accepted), key=str)
    if not unknown:
        return []
    return [unknown_keys_message(section, unknown, ["source", *accepted])]


def episode_config(mapping: Mapping[str, Any] | None, section: str = "task") -> EpisodeConfig:
    """The multi-turn fields of a ``task:`` section (environment, limits), validated.

    Raises:
        ValueError: an unknown environment, a bad limit.
    """
    from forge_ext.config import from_mapping

    fields = {k: v for k, v in dict(mapping or {}).items() if k in EPISODE_FIELDS}
    return from_mapping(EpisodeConfig, fields, path=section)


def resolved_task(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """``task:`` with every default filled in (what a run record keeps)."""
    config = task_config(mapping)
    source = dict(mapping or {}).get("source", "addition")
    fields = config.fields if isinstance(config, PluginTask) else dataclasses.asdict(config)
    return {"source": source, **fields, **dataclasses.asdict(episode_config(mapping))}


def build_task(mapping: Mapping[str, Any] | None, section: str = "task") -> Task:
    """The task of a ``task:`` section, rows loaded (see :func:`task_config` for errors;
    also ValueError for a user factory that returns no task). ``section``: where the section
    is (``eval.sets[0].task``); the sources' messages name their fields ``task.<field>``,
    said here as ``<section>.<field>``."""
    try:
        return task_config(mapping, section).build()
    except (ValueError, FileNotFoundError) as e:
        if section == "task":
            raise
        # The fields of this section, not of the top-level task: (a user edited task.* for
        # nothing when an evaluation set's column was wrong).
        raise type(e)(_in_section(str(e), section)) from None


# A quoted value in a message (a repr: a user's path or column), left as written.
_QUOTED = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def _in_section(message: str, section: str) -> str:
    """``message`` with its field names ``task.<field>`` said as ``<section>.<field>``,
    outside the quoted values only (``train_path='/data/task.jsonl'`` keeps its path)."""
    parts = _QUOTED.split(message)  # odd indices: the quoted values
    return "".join(part if i % 2 else re.sub(r"(?<![\w.])task\.(?=[a-z_])", f"{section}.", part)
                   for i, part in enumerate(parts))


class PluginTask:
    """A ``task.source: "package.module:factory"`` config: building calls the factory."""

    def __init__(self, source: str, make, fields: dict[str, Any]) -> None:
        self.source, self._make, self.fields = source, make, fields

    def build(self) -> Task:
        try:
            made = self._make()
        except TypeError as e:
            raise ValueError(f"task.source={self.source!r} refused the task fields "
                             f"{sorted(self.fields)}: {e}") from None
        return as_task(made, f"task.source={self.source!r}")


def as_task(obj: Any, where: str) -> Task:
    """``obj`` as a :class:`Task`: itself, or a wrapper of an object with ``train_rows()``
    and ``eval_rows()`` whose rows may be :class:`Row` or ``{prompt, answer, ...}`` dicts.

    Raises:
        ValueError: ``obj`` has no such methods, or a row is malformed (naming it).
    """
    if not (callable(getattr(obj, "train_rows", None)) and callable(getattr(obj, "eval_rows", None))):
        raise ValueError(f"{where} returned a {type(obj).__name__}, not a task (an object with "
                         "train_rows() and eval_rows(); see forge_ext.tasks.base.Task)")
    if isinstance(obj, Task):
        return obj
    return _WrappedTask(obj, where)


class _WrappedTask(Task):
    def __init__(self, inner: Any, where: str) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self._train = _as_rows(inner.train_rows(), f"{where} train_rows()")
        self._eval = _as_rows(inner.eval_rows(), f"{where} eval_rows()")

    def train_rows(self) -> list[Row]:
        return self._train

    def eval_rows(self) -> list[Row]:
        return self._eval

    def rewards(self) -> dict[str, RewardFn]:
        rewards = getattr(self.inner, "rewards", None)
        return dict(rewards()) if callable(rewards) else {}

    def default_rewards(self) -> list[str]:
        defaults = getattr(self.inner, "default_rewards", None)
        return list(defaults()) if callable(defaults) else []


def _as_rows(rows: Sequence[Any], where: str) -> list[Row]:
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, Row):
            out.append(row)
            continue
        if not isinstance(row, Mapping) or "prompt" not in row or "answer" not in row:
            raise ValueError(f"{where}[{i}] is not a Row or a {{prompt, answer, ...}} mapping: "
                             f"{row!r:.80}")
        try:
            out.append(Row(prompt=row["prompt"], answer=row["answer"], metadata=dict(row)))
        except ValueError as e:
            raise ValueError(f"{where}[{i}]: {e}") from None
    return out


class PromptStream:
    """Training rows in a reshuffled order each epoch, addressed by position: the prompts of
    step ``s`` are positions ``s * prompts_per_step`` on, whichever run, mode or call order
    builds them, so a resumed run continues with exactly the prompts an uninterrupted run
    would have used.

    Raises:
        ValueError: no rows.
    """

    def __init__(self, rows: Sequence[Any], seed: int) -> None:
        if not rows:
            raise ValueError("the task has no training rows (task.num_train must be >= 1)")
        self.rows = list(rows)
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run reads
        return self._orders[epoch]

    def slice(self, start: int, count: int) -> list[Any]:
        """The rows at stream positions ``start .. start + count - 1``."""
        out = []
        for position in range(start, start + count):
            epoch, index = divmod(position, len(self.rows))
            out.append(self.rows[self._order(epoch)[index]])
        return out


__all__ = [
    "ENVIRONMENTS", "EPISODE_FIELDS", "SOURCES", "AdditionTask", "BUILTIN_REWARDS", "DatasetTask", "EpisodeConfig",
    "Message", "PluginTask", "episode_config",
    "PromptConfig", "PromptRenderer", "PromptStream", "ReasoningGymTask", "RewardConfig",
    "RewardFn", "RewardFunctionConfig", "Row", "Rubric", "Sample", "Scores", "Task",
    "as_task", "build_task", "resolved_task", "task_config", "task_section_variants",
]
