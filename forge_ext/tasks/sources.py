"""The ``dataset`` and ``reasoning_gym`` task sources (the ``addition`` one is
:mod:`forge_ext.tasks.addition`).

- :class:`DatasetTask`: local files read with HF ``datasets`` (``.jsonl``/``.json``,
  ``.parquet``, ``.csv``, or a ``save_to_disk`` folder); nothing is downloaded.
- :class:`ReasoningGymTask`: a procedural task of the ``reasoning-gym`` library by name,
  generated offline from a seed; scored by the ``score_answer`` of the dataset that made the
  rows (its config, not reasoning-gym's default one).

Both are pure functions of their config: the same rows in the same order in every process and
run (the prompt stream and a resume rely on it).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any

from forge_ext.tasks.base import RewardFn, Row, Task
from forge_ext.tasks.rewards import ReasoningGymScore

DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetTask(Task):
    """Rows of local dataset files (module docstring): the prompt from ``prompt_field`` (text,
    or a list of ``{role, content}`` messages), the answer from ``answer_field``, every column
    as metadata. A CSV file's fields are its text, every column a string (no type inference:
    ``0021`` stays ``0021``); the typed numbers of a ``.jsonl``, ``.json`` or ``.parquet``
    answer become their text, integral floats without ``.0`` (Arrow reads a column of mixed
    ints and floats as floats)."""

    name = "dataset"

    @dataclass(kw_only=True, slots=True)
    class Config:
        train_path: str
        """Training rows: a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file, or a folder
        written by ``datasets.Dataset.save_to_disk``."""
        eval_path: str | None = None
        """Held-out rows, in the same formats; default: ``num_eval`` rows held out from
        ``train_path``."""
        num_eval: int | None = None
        """Held-out rows: taken from ``train_path`` when ``eval_path`` is unset (default 100,
        chosen by ``seed``), else the first ``num_eval`` of ``eval_path`` (default all)."""
        num_train: int | None = None
        """Use only the first ``num_train`` training rows (default: all)."""
        prompt_field: str = "prompt"
        """Column with the prompt: text, or a list of ``{role, content}`` messages."""
        answer_field: str = "answer"
        """Column with the reference answer."""
        system_prompt: str | None = None
        """A system message put before every prompt (needs a chat tokenizer)."""
        split: str = "train"
        """The split of a ``save_to_disk`` folder that holds a ``DatasetDict``."""
        seed: int = 0
        """Chooses the rows held out from ``train_path``."""

        def __post_init__(self) -> None:
            for name in ("num_eval", "num_train"):
                value = getattr(self, name)
                if value is not None and value < (1 if name == "num_train" else 0):
                    raise ValueError(f"task.{name}={value} must be >= "
                                     f"{1 if name == 'num_train' else 0}")
            for name in ("train_path", "eval_path"):
                path = getattr(self, name)
                if path is None:
                    continue
                if not os.path.exists(path):
                    raise FileNotFoundError(f"task.{name}={path!r}: no such file or folder")
                if os.path.isfile(path) and _suffix(path) not in DATASET_FORMATS:
                    raise ValueError(
                        f"task.{name}={path!r}: unknown format; use one of "
                        f"{sorted(DATASET_FORMATS)} or a save_to_disk folder"
                    )

        def build(self) -> DatasetTask:
            return DatasetTask(self)

    def __init__(self, config: Config) -> None:
        self.config = c = config
        train = self._rows(c.train_path, "train_path")
        if c.eval_path is not None:
            held_out = self._rows(c.eval_path, "eval_path")[: c.num_eval]
        else:
            num_eval = 100 if c.num_eval is None else c.num_eval
            if num_eval >= len(train):
                raise ValueError(
                    f"task.num_eval={num_eval} rows held out of task.train_path={c.train_path!r}"
                    f" leave none of its {len(train)} rows to train on; lower task.num_eval or "
                    "set task.eval_path"
                )
            chosen = set(random.Random(c.seed).sample(range(len(train)), num_eval))
            held_out = [row for i, row in enumerate(train) if i in chosen]
            train = [row for i, row in enumerate(train) if i not in chosen]
        self._train = train[: c.num_train]
        self._eval = held_out

    def train_rows(self) -> list[Row]:
        return self._train

    def eval_rows(self) -> list[Row]:
        return self._eval

    def _rows(self, path: str, field_name: str) -> list[Row]:
        """Every record of ``path`` as a :class:`Row`.

        Raises:
            ValueError: a field missing from the columns or empty in a row (naming the row).
        """
        c = self.config
        records = _load_records(path, c.split, field_name, {
            "prompt_field": c.prompt_field, "answer_field": c.answer_field})
        if not records:
            raise ValueError(f"task.{field_name}={path!r} holds no rows")
        columns = list(records[0])
        for name in ("prompt_field", "answer_field"):
            if getattr(c, name) not in columns:
                raise ValueError(
                    f"task.{name}={getattr(c, name)!r} is not a column of task.{field_name}="
                    f"{path!r} (its columns: {columns}); set task.{name}=<one of them> (the "
                    f"{'prompt' if name == 'prompt_field' else 'reference answer'} of each row)"
                )
        rows = []
        for i, record in enumerate(records):
            prompt, answer = record.get(c.prompt_field), record.get(c.answer_field)
            where = f"row {i} of task.{field_name}={path!r}"
            for name, value in (("prompt_field", prompt), ("answer_field", answer)):
                if value is None:  # absent, null, or an empty CSV field: all read as None
                    raise ValueError(_no_value(where, record, getattr(c, name), name))
            if prompt == "" or prompt == []:
                raise ValueError(f"{where}: task.prompt_field {c.prompt_field!r} is empty")
            if isinstance(answer, float) and answer.is_integer():
                answer = str(int(answer))  # a column of mixed ints and floats reads as floats
            elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)
            if c.system_prompt is not None:
                turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                prompt = [{"role": "system", "content": c.system_prompt}, *turns]
            try:
                rows.append(Row(prompt=prompt, answer=answer, metadata=record))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        return rows


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _load_records(path: str, split: str, field_name: str,
                  needed: dict[str, str]) -> list[dict[str, Any]]:
    """The rows of a dataset file or ``save_to_disk`` folder, as dicts (HF ``datasets``);
    ``needed``: ``{task field: column}`` the rows must have.

    Raises:
        ValueError: the file does not read, naming the row without a column where that is
            why (:func:`_row_without_column`).
    """
    import datasets

    datasets.disable_progress_bars()
    if os.path.isdir(path):
        try:
            loaded = datasets.load_from_disk(path)
        except FileNotFoundError as e:
            raise ValueError(
                f"task.{field_name}={path!r} is a folder but not one written by "
                f"datasets' save_to_disk: {e}"
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(
                    f"task.split={split!r} is not a split of task.{field_name}={path!r} "
                    f"(its splits: {list(loaded)})"
                )
            loaded = loaded[split]
    else:
        try:
            loaded = datasets.load_dataset(
                DATASET_FORMATS[_suffix(path)], data_files=path, split="train",
                **(_csv_as_text(path) if _suffix(path) == ".csv" else {}),
            )
        except Exception as e:  # noqa: BLE001  (datasets' parse errors have many types)
            # datasets fails on a JSON row without a column the others have (a bare
            # KeyError); its other errors wrap their cause (pandas names the CSV line).
            gap = _row_without_column(path, needed) if DATASET_FORMATS[
                _suffix(path)] == "json" else None
            if gap is not None:
                where, record, column, name = gap
                raise ValueError(_no_value(f"{where} of task.{field_name}={path!r}", record,
                                           column, name)) from None
            cause = e.__cause__ or e.__context__ or e
            raise ValueError(f"task.{field_name}={path!r} does not read as "
                             f"{DATASET_FORMATS[_suffix(path)]}: {type(cause).__name__}: "
                             f"{str(cause).strip()}") from None
    return loaded.to_list()


def _no_value(where: str, record: dict[str, Any], column: str, name: str | None) -> str:
    """The message for a row (``where``) without a value in ``column`` (``task.<name>``'s,
    or one the file's other rows have when ``name`` is None), naming the columns it has."""
    have = [key for key, value in record.items() if value is not None]
    field_note = f"task.{name}" if name else "the other rows have it"
    return f"{where} has no {column!r} ({field_note}); the columns it has: {have}"


def _row_without_column(path: str, needed: dict[str, str]
                        ) -> tuple[str, dict[str, Any], str, str | None] | None:
    """The first row of a ``.jsonl``/``.json`` file that lacks a column of ``needed``
    (``{task field: column}``), else the first that lacks a column of an earlier row, as
    ``(where, row, column, task field or None)``; None if every row has the same columns
    (or the file does not read as JSON rows: datasets' own error then says why)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            if _suffix(path) == ".jsonl":
                rows = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
            else:
                rows = [(None, row) for row in json.load(f)]
    except (ValueError, TypeError):
        return None
    if not all(isinstance(row, dict) for _, row in rows):
        return None
    where = [f"row {i}" + (f" (line {n})" if n else "") for i, (n, _) in enumerate(rows)]
    for i, (_, row) in enumerate(rows):
        for name, column in needed.items():
            if column not in row:
                return where[i], row, column, name
    seen: dict[str, None] = {}
    for i, (_, row) in enumerate(rows):
        for column in seen:
            if column not in row:
                return where[i], row, column, None
        seen.update(dict.fromkeys(row))
    return None


def _csv_as_text(path: str) -> dict[str, Any]:
    """``load_dataset("csv")`` arguments that keep every field the file's text: pandas would
    infer types (``0021`` -> 21, ``0.50`` -> 0.5, a 21-digit id rounded through float64, ``NA``
    -> missing), quoted fields too. Every column of the header is a string column; only an
    empty field is missing."""
    import csv

    import datasets

    with open(path, newline="", encoding="utf-8-sig") as f:  # pandas drops a BOM too
        header = next(csv.reader(f), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "na_values": [""]}


class ReasoningGymTask(Task):
    """A reasoning-gym task (module docstring): held-out rows first, then training rows, all
    with distinct questions, from one dataset generated with ``seed``. Rows: the question, the
    answer, and the whole entry as metadata (what its ``score_answer`` reads)."""

    name = "reasoning_gym"

    @dataclass(kw_only=True, slots=True)
    class Config:
        name: str
        """A reasoning-gym task name (``chain_sum``, ``basic_arithmetic``, ``gsm_symbolic``,
        ...; ``reasoning_gym.factory.DATASETS`` lists them)."""
        config: dict[str, Any] = field(default_factory=dict)
        """That task's own config fields (e.g. ``{min_terms: 2, max_digits: 1}``)."""
        num_train: int = 1000
        """Training rows."""
        num_eval: int = 100
        """Held-out rows (their questions never occur in the training rows)."""
        seed: int = 0
        """Seed of the generator."""

        def __post_init__(self) -> None:
            if self.num_train < 1 or self.num_eval < 0:
                raise ValueError(f"task.num_train={self.num_train} must be >= 1 and "
                                 f"task.num_eval={self.num_eval} >= 0")
            reasoning_gym_config(self.name, self.config)  # raises on a bad name or field

        def build(self) -> ReasoningGymTask:
            return ReasoningGymTask(self)

    def __init__(self, config: Config) -> None:
        import reasoning_gym as rg

        self.config = c = config
        wanted = c.num_eval + c.num_train
        # Entries are drawn with Random(seed + index): one dataset, deduplicated by question,
        # keeps the two splits disjoint (datasets of neighbouring seeds overlap).
        size = 4 * wanted
        self._dataset_args = {**c.config, "seed": c.seed, "size": size}
        self._dataset = dataset = rg.create_dataset(c.name, **self._dataset_args)
        seen: set[str] = set()
        rows: list[Row] = []
        for index in range(size):
            entry = dataset[index]
            if entry["question"] in seen:
                continue
            seen.add(entry["question"])
            rows.append(Row(prompt=entry["question"], answer=str(entry["answer"]),
                            metadata=entry))
            if len(rows) == wanted:
                break
        else:
            raise ValueError(
                f"reasoning-gym {c.name!r} with task.config={c.config} gave {len(rows)} distinct "
                f"questions in {size} draws, fewer than task.num_eval + task.num_train = "
                f"{wanted}; ask for fewer rows or widen the task's config"
            )
        self._eval, self._train = rows[: c.num_eval], rows[c.num_eval :]

    def train_rows(self) -> list[Row]:
        return self._train

    def eval_rows(self) -> list[Row]:
        return self._eval

    def rewards(self) -> dict[str, RewardFn]:
        """``reasoning_gym``: the ``score_answer`` of the dataset that made the rows
        (:class:`~forge_ext.tasks.rewards.ReasoningGymScore`)."""
        return {"reasoning_gym": ReasoningGymScore(self.config.name, self._dataset_args,
                                                   self._dataset)}

    def default_rewards(self) -> list[str]:
        return ["reasoning_gym"]


def reasoning_gym_config(name: str, fields: dict[str, Any]) -> Any:
    """reasoning-gym's config object of task ``name`` with ``fields``, validated by it.

    Raises:
        ValueError: an unknown task name, a field its config lacks, or a value its own
            validation refuses, naming ``task.name`` / ``task.config.<field>``.
    """
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = [n for n in sorted(DATASETS) if name.split("_")[0] in n][:8]
        raise ValueError(
            f"task.name={name!r} is not a reasoning-gym task ({len(DATASETS)} are, e.g. "
            f"{close or sorted(DATASETS)[:8]})"
        )
    config_cls = DATASETS[name][1]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    for key in fields:
        if key not in known:
            raise ValueError(
                f"task.config.{key} is not a field of reasoning-gym's {config_cls.__name__} "
                f"(its fields: {sorted(known)}; task.seed and task.num_train set seed and size)"
            )
    try:
        config = config_cls(**fields)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"task.config={fields} is refused by reasoning-gym's "
                         f"{config_cls.__name__}: {e or type(e).__name__}") from None
    return config
