"""YAML configs: OmegaConf (interpolation, CLI ``key=value`` overrides) -> typed dataclasses.

Every app reads its config the same way::

    raw = load_yaml("configs/grpo_cpu_demo.yaml", ["loop.steps=5", "trainer.optimizer.lr=1e-3"])
    config = from_mapping(GRPOConfig, raw)          # raises before any process is spawned

:func:`load_yaml` resolves ``${...}`` interpolations after applying the overrides, so an
override of ``output_dir`` moves every path interpolated from it. :func:`from_mapping` rejects
unknown keys naming their full dotted path (``loop.stpes``), and wrong types naming the field.
Fields typed ``dict[str, Any]`` are left as plain mappings for a component that validates them
itself (the engine's ``trainer:`` section, :func:`forge_ext.engine.engine_config_from_mapping`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import dacite
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


def load_yaml(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read a YAML config, apply ``key=value`` overrides, resolve interpolations.

    Args:
        path: the YAML file. A top-level ``base: <file>`` (relative to it) names a config it
            extends: the base is loaded first and this file merged over it. A section whose
            ``source`` changes (``task.source``) is replaced, not merged (:func:`_merge`).
        overrides: dotted ``key=value`` strings (OmegaConf dotlist syntax, values parsed as
            YAML: ``loop.steps=5``, ``model.hf_path=/ckpt/Qwen3-0.6B``, ``reference=null``).

    Returns:
        A plain nested ``dict`` with every ``${...}`` resolved.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an override without ``=``, invalid YAML (the message names the file and
            the line), or an interpolation that does not resolve (the message names the key).
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must be key=value, e.g. output_dir=outputs/mine")
    try:
        config = _merge(_load_with_base(Path(path)), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(config, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as e:  # YAML syntax: a file or an override
        raise ValueError(f"{path}: {e}") from None


def _load_with_base(path: Path, seen: tuple[Path, ...] = ()):
    """Load ``path``; if it has a top-level ``base: other.yaml`` (relative to ``path``), load
    that first and merge ``path`` over it, so a variant states only what it changes."""
    if not path.is_file():
        raise FileNotFoundError(missing_config_message(path))
    if path.resolve() in seen:
        raise ValueError(f"config base cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    config = OmegaConf.load(path)
    base = config.pop("base", None)
    if base is None:
        return config
    return _merge(_load_with_base(path.parent / base, (*seen, path.resolve())), config)


def missing_config_message(path: Path) -> str:
    """``config file 'configs/x.yml' does not exist; did you mean 'configs/x.yaml'?``: the
    closest config file (``.yaml``/``.yml``, by name: another extension, a typo, another
    case) in the path's folder, else in ``./configs`` (a name given without its folder)."""
    message = f"config file {str(path)!r} does not exist"
    for folder in dict.fromkeys([path.parent, Path("configs")]):
        if not folder.is_dir():
            continue
        files = {f.stem.lower(): f.name for f in sorted(folder.iterdir())
                 if f.suffix in (".yaml", ".yml") and f.is_file()}
        close = difflib.get_close_matches(path.stem.lower(), files, n=1, cutoff=0.75)
        if close:
            return f"{message}; did you mean {str(folder / files[close[0]])!r}?"
    return message


def _merge(base, update):
    """``OmegaConf.merge(base, update)``, except that a top-level section whose ``source``
    the update changes (``task.source=dataset`` over the demo's addition task) replaces the
    base's section instead of merging into it: the other source's fields mean nothing to
    the new one."""
    for key in list(update.keys()) if OmegaConf.is_dict(update) else []:
        new, old = update.get(key), base.get(key) if OmegaConf.is_dict(base) else None
        if (OmegaConf.is_dict(new) and OmegaConf.is_dict(old) and "source" in new
                and new.get("source") != old.get("source", "addition" if key == "task" else None)):
            base = OmegaConf.merge(base, {})  # a copy; the caller's object stays as it was
            base.pop(key)
    return OmegaConf.merge(base, update)


def parse_cli(
    argv: Sequence[str] | None = None, description: str = "",
    reference: Callable[[], str] | None = None, prog: str | None = None,
) -> tuple[str, list[str]]:
    """``--config PATH [key=value ...]`` from the command line: ``(path, overrides)``.

    Args:
        reference: returns the config reference (:mod:`forge_ext.config_doc`) that
            ``--help`` prints after the usage: every section and field, with type, default
            and the first sentence of its docstring.
        prog: the command in the usage line, e.g. ``python -m apps.grpo.main``.
    """
    import argparse

    class _Help(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            text = parser.format_help()
            if reference is not None:
                text += "\nconfig reference (key: type = default; also docs/config.md):\n\n"
                text += reference()
            sys.stdout.write(text)
            parser.exit()

    parser = argparse.ArgumentParser(prog=prog, description=description.replace("``", ""),
                                     add_help=False)
    parser.add_argument("-h", "--help", nargs=0, action=_Help,
                        help="show this message and every config field, then exit")
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the fields below, e.g. output_dir=outputs/mine")
    args = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(args):
        bare = bare_config_path(args)
        if bare is not None:  # argparse would say only that --config is required
            others = " ".join(a for a in args if a != bare)
            parser.error(f"{bare} is a config file: give it with --config, e.g. "
                         f"{prog or parser.prog} --config {bare}" + (f" {others}" if others else ""))
    parsed = parser.parse_args(args)
    return parsed.config, parsed.overrides


def bare_config_path(args: Sequence[str]) -> str | None:
    """The first argument of a command line without ``--config`` that names a config file
    (ends in ``.yaml``/``.yml`` or is a file, and is no ``key=value`` override nor option);
    None if there is ``--config`` (``--config=PATH`` too) or no such argument."""
    if any(a == "--config" or a.startswith("--config=") for a in args):
        return None
    for a in args:
        if "=" not in a and not a.startswith("-") and (
            a.endswith((".yaml", ".yml")) or os.path.isfile(a)
        ):
            return a
    return None


#: Checks the keys of a section that a dataclass types ``dict[str, Any]`` (a component
#: validates it: an engine section, ``task:``): ``(mapping, dotted path) -> problems``.
SectionCheck = Callable[[Mapping[str, Any], str], list[str]]


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, path: str = "",
                 sections: Mapping[str, SectionCheck] | None = None) -> T:
    """Build the dataclass ``cls`` from a nested mapping, strictly.

    Args:
        cls: a dataclass whose fields may be dataclasses themselves.
        mapping: e.g. the result of :func:`load_yaml`; None means all defaults.
        path: dotted prefix used in error messages for a nested section.
        sections: ``{dotted path: check}`` for fields typed ``dict[str, Any]`` whose keys a
            component knows (:data:`SectionCheck`), so that their unknown keys are reported
            with the others (:func:`check_keys`).

    Raises:
        ValueError: every unknown key at once (``unknown key 'loop.stpes' (did you mean
            'loop.steps'?); accepted keys of loop: ...``, one line per section), else a
            missing required field, a value of the wrong type, or a ``__post_init__`` check.
    """
    mapping = dict(mapping or {})
    check_keys(cls, mapping, path, sections)
    try:
        return dacite.from_dict(cls, mapping, config=dacite.Config(strict=True, cast=[tuple]))
    except (dacite.WrongTypeError, dacite.MissingValueError) as e:
        where = _join(path, e.field_path)
        raise ValueError(f"{where}: {_describe(e)}{_brace_hint(e, where)}") from None


def _brace_hint(error: Exception, where: str) -> str:
    """For text in braces that YAML read as a mapping (``prompt.template={prompt}`` on the
    command line: ``{'prompt': None}``) where a string was due: how to quote it."""
    value = getattr(error, "value", None)
    if not (isinstance(error, dacite.WrongTypeError) and isinstance(value, Mapping) and value
            and all(v is None for v in value.values())):
        return ""
    text = "{" + ",".join(str(k) for k in value) + "}"
    return (f"; a value in braces reads as a YAML mapping: quote it, e.g. "
            f"\"{where}='{text}'\"")


def _describe(error: Exception) -> str:
    """What is wrong with the value (the caller prefixes the field's path): the allowed
    values of a ``Literal`` field, the expected type otherwise."""
    hint = getattr(error, "field_type", None)
    if isinstance(error, dacite.WrongTypeError):
        if typing.get_origin(hint) is typing.Literal:
            allowed = ", ".join(repr(v) for v in typing.get_args(hint))
            return f"{error.value!r} is not one of {allowed}"
        expected = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        if dataclasses.is_dataclass(hint):
            fields = ", ".join(f.name for f in dataclasses.fields(hint))
            return f"{error.value!r} must be a mapping with keys among: {fields}"
        if error.value is None:  # `key=` or `key: null`
            return f"empty (null), but it needs a {expected} value"
        entry = next(iter(typing.get_args(hint)), None)
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(entry):
            names = [f.name for f in dataclasses.fields(entry)]
            return (f"{error.value!r} is not a valid {expected}: each entry is a mapping "
                    f"with keys among: {', '.join(names)} (e.g. [{{{names[0]}: ...}}])")
        return f"{error.value!r} is not a valid {expected}"
    if isinstance(error, dacite.MissingValueError):
        return "is required"
    return str(error)


def check_keys(cls: type, mapping: Any, path: str = "",
               sections: Mapping[str, SectionCheck] | None = None) -> None:
    """Raise one ValueError naming every key of ``mapping`` (recursively, and in the
    ``sections`` a component checks) that ``cls`` lacks: a config with two typos is told
    both in one run (issue 50), one line per section (:func:`key_problems`)."""
    problems = key_problems(cls, mapping, path, sections)
    if problems:
        raise ValueError("\n".join(problems))


def key_problems(cls: type, mapping: Any, path: str = "",
                 sections: Mapping[str, SectionCheck] | None = None) -> list[str]:
    """The key errors of ``mapping`` against the dataclass ``cls``, recursively: one message
    per section with unknown keys (:func:`unknown_keys_message`), a section that is not a
    mapping, a list field given a scalar. ``sections``: see :func:`from_mapping`."""
    where = path or "the config"
    if not isinstance(mapping, Mapping):
        return [f"{where} must be a mapping, got {type(mapping).__name__}"]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(mapping) - set(names), key=str)
    problems = [unknown_keys_message(path, unknown, names)] if unknown else []
    for key, value in mapping.items():
        if key not in hints:
            continue
        hint, where = hints[key], _join(path, key)
        if sections and where in sections:
            if isinstance(value, Mapping):
                problems += sections[where](value, where)
            continue
        is_list, item_cls = _list_of(hint)
        if is_list:
            if value is not None and not isinstance(value, (list, tuple)) and not (
                    isinstance(value, str) and _admits_str(hint)):
                problems.append(f"{where}: {value!r} is not a list; write a YAML list, e.g. "
                                f"{where}=[...]")
                continue
            for i, item in enumerate(value or []):
                if item_cls is not None and isinstance(item, Mapping):
                    problems += key_problems(item_cls, item, f"{where}[{i}]")
            continue
        field_cls = _dataclass_of(hint)
        if field_cls is not None and isinstance(value, Mapping):
            problems += key_problems(field_cls, value, where, sections)
    return problems


def _admits_str(hint: Any) -> bool:
    """Whether a field's type is a union with ``str`` (``list[str] | str | None``: a list, or
    one word such as ``all-linear``)."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or (
        typing.get_origin(hint) is typing.Union) else (hint,)
    return str in members


def _list_of(hint: Any) -> tuple[bool, type | None]:
    """``(True, X or None)`` for a ``list[X]`` (or ``list[X] | None``) field, X when it is a
    dataclass; ``(False, None)`` otherwise."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or (
        typing.get_origin(hint) is typing.Union) else (hint,)
    for member in members:
        if typing.get_origin(member) is list:
            args = typing.get_args(member)
            return True, (args[0] if args and dataclasses.is_dataclass(args[0]) else None)
    return False, None


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass in ``hint`` (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


#: The names other trainers and libraries give a field (HF ``TrainingArguments``, TRL, verl,
#: torchtitan), lowercase -> this project's names for it, in order of preference: a key
#: written in another's vocabulary gets "did you mean" where difflib finds nothing close
#: (``learning_rate`` -> ``lr``, issue 50). Only a name the section accepts is suggested.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("learning_rate", "learningrate", "lr_rate", "actor_lr"), ("lr",)),
    **dict.fromkeys(("max_seq_len", "max_seq_length", "max_length", "sequence_length",
                     "seq_length", "max_len", "context_length", "max_position_embeddings"),
                    ("seq_len",)),
    **dict.fromkeys(("max_grad_norm", "grad_clip", "clip_grad_norm", "gradient_clipping",
                     "grad_norm_clip", "clip_grad"), ("max_norm",)),
    **dict.fromkeys(("num_generations", "n_samples", "num_samples", "samples_per_prompt",
                     "rollout_n", "n", "num_samples_per_prompt"), ("group_size",)),
    **dict.fromkeys(("beta", "kl_beta", "kl_coeff", "init_kl_coef", "kl_loss_coef",
                     "kl_penalty_coef", "kl_weight"), ("kl_coef",)),
    **dict.fromkeys(("model_name_or_path", "model_path", "model_name",
                     "pretrained_model_name_or_path", "model_dir", "hf_model", "model_id"),
                    ("hf_path",)),
    **dict.fromkeys(("max_steps", "num_steps", "total_steps", "train_steps",
                     "num_train_steps", "total_training_steps", "iterations"), ("steps",)),
    **dict.fromkeys(("warmup", "num_warmup_steps", "lr_warmup_steps", "warmup_iters"),
                    ("warmup_steps",)),
    **dict.fromkeys(("micro_batch_size", "per_device_train_batch_size",
                     "micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                    ("microbatch_size",)),
    **dict.fromkeys(("batch_size", "train_batch_size", "per_device_batch_size"),
                    ("local_batch_size", "prompts_per_step")),
    **dict.fromkeys(("gradient_accumulation", "grad_accum_steps", "accumulation_steps",
                     "grad_accum", "gradient_accumulation_step"),
                    ("gradient_accumulation_steps",)),
    **dict.fromkeys(("max_tokens", "max_completion_length", "max_response_length",
                     "response_length", "max_new_token"), ("max_new_tokens",)),
    **dict.fromkeys(("eval_steps", "eval_interval", "eval_freq", "evaluation_steps",
                     "test_freq"), ("eval_every", "every")),
    **dict.fromkeys(("save_steps", "save_interval", "save_freq", "checkpoint_interval"),
                    ("save_every", "interval")),
    **dict.fromkeys(("epsilon", "clip_range", "cliprange", "clip_eps", "clip_ratio"),
                    ("clip_eps_low",)),
    **dict.fromkeys(("temp",), ("temperature",)),
    **dict.fromkeys(("wd",), ("weight_decay",)),
    **dict.fromkeys(("output_directory", "out_dir", "save_dir", "output_path", "outdir"),
                    ("output_dir",)),
    **dict.fromkeys(("random_seed", "rng_seed"), ("seed",)),
    **dict.fromkeys(("dataset", "data_path", "train_file", "train_data", "dataset_path",
                     "data_files", "train_files"), ("train_path",)),
    **dict.fromkeys(("prompt_key", "prompt_column", "input_field", "question_field"),
                    ("prompt_field",)),
    **dict.fromkeys(("answer_key", "answer_column", "label_field", "solution_field"),
                    ("answer_field",)),
}


def unknown_keys_message(path: str, unknown: Sequence[str], accepted: Sequence[str]) -> str:
    """The error for keys of the section at ``path`` that it does not have: ``unknown key
    'loop.stpes' (did you mean 'loop.steps'?); accepted keys of loop: [...]`` (the guess: the
    field's name here for a name other trainers use, :data:`FIELD_ALIASES`, else
    :func:`difflib.get_close_matches`, only where one is close)."""
    names, accepted_names = [], [str(a) for a in accepted]
    for key in unknown:
        close = [a for a in FIELD_ALIASES.get(str(key).lower(), ()) if a in accepted_names][:1]
        close = close or difflib.get_close_matches(str(key), accepted_names, n=1)
        guess = f" (did you mean {_join(path, close[0])!r}?)" if close else ""
        names.append(f"{_join(path, str(key))!r}{guess}")
    return (f"unknown key {', '.join(names)}; accepted keys of {path or 'the config'}: "
            f"{list(accepted)}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def apply_env(env: Mapping[str, Any]) -> None:
    """Set environment variables in this process, before any proc is spawned (Monarch procs
    inherit the controller's environment at spawn time). ``OMP_NUM_THREADS`` also sets this
    process's torch intra-op threads: on a small shared CPU one thread per process avoids
    OpenMP threads spinning against each other (10x slower steps were measured with 2
    threads per process on a loaded 2-core machine)."""
    import torch

    os.environ.update({k: str(v) for k, v in env.items()})
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


@contextlib.contextmanager
def scoped_env(env: Mapping[str, Any]):
    """Set ``env`` in ``os.environ`` for the duration of the block, then restore it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


RUN_CONFIG_FILE = "run_config.yaml"


# Key of the record holding the working directory that its relative paths are relative to.
WORKING_DIR_KEY = "working_dir"


def record_run_config(
    output_dir: str | Path, config: Any, *, may_change: Sequence[str] = (), check: bool = True,
    rerun: str = "resumes that run", write: bool = True,
) -> Path:
    """Keep the resolved config of the run in ``<output_dir>/run_config.yaml``.

    A rerun in the same ``output_dir`` resumes that run (its checkpoints, its metrics), so it
    must be the same run: if the file exists, every key must match except those under a
    dotted prefix in ``may_change`` (e.g. ``loop.steps`` to extend a run), and the file is
    then rewritten with the new values. Relative paths are compared as the absolute paths
    they named from each run's working directory (recorded as ``working_dir``). The file is
    replaced atomically.

    Args:
        output_dir: the run folder (created if missing).
        config: the run's config, a dataclass instance or a mapping of plain values.
        may_change: dotted key prefixes that may differ on resume.
        check: False overwrites an existing record without comparing (a run that starts over).
        rerun: what a rerun in ``output_dir`` does, for the error message.
        write: False only compares (a check before anything is spawned).

    Returns:
        The path of the record.

    Raises:
        ValueError: naming each differing key (``seed: 0 -> 1``) and the fix; or
            ``output_dir`` is a file; or the existing record is unreadable.
    """
    mapping = {**_plain(config), WORKING_DIR_KEY: os.getcwd()}
    folder = Path(output_dir)
    path = folder / RUN_CONFIG_FILE
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"output_dir={str(output_dir)!r} is a file; it must be a folder")
    if check and path.exists():
        changed = config_changes(load_run_record(path), mapping, may_change=may_change)
        if changed:
            allowed = ", ".join(may_change) or "nothing"
            raise ValueError(
                f"output_dir={str(output_dir)!r} holds a run started with another config "
                f"({'; '.join(changed[:8])}{'; ...' if len(changed) > 8 else ''}). A rerun "
                f"in the same output_dir {rerun}, so only these may change: {allowed}. Use "
                f"a new output_dir (e.g. output_dir={folder}_2) or delete {folder} to start "
                "over."
            )
    if not write:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(OmegaConf.to_yaml(OmegaConf.create(mapping)))
    staged.replace(path)
    return path


def load_run_record(path: str | Path) -> dict[str, Any]:
    """A run record written by :func:`record_run_config`, as plain containers.

    Raises:
        ValueError: the file is not a YAML mapping (corrupt, empty, hand-edited).
    """
    try:
        record = OmegaConf.to_container(OmegaConf.load(path))
        problem = None if isinstance(record, Mapping) and record else "not a YAML mapping"
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
        problem = f"{type(e).__name__}: {e}".replace("\n", " ")
    if problem:
        raise ValueError(
            f"{path} is not a readable run record ({problem}). Restore it, or use a new "
            "output_dir: without its record, this run's checkpoints could be resumed with "
            "another config"
        )
    return record


_UNSET = "<unset>"


def config_changes(
    previous: Any, current: Any, *, may_change: Sequence[str] = ()
) -> list[str]:
    """``["seed: 0 -> 1", "task.max_digits: 2 -> 3"]``: the leaves (dotted keys) whose values
    differ between two configs (mappings, OmegaConf objects or dataclass instances), except
    keys under a prefix in ``may_change``. Two strings naming the same path (``run`` and
    ``/abs/run``) are equal, each taken from its config's ``working_dir`` (default: the
    current one); ``True`` and ``1`` are not. Keys absent from ``previous`` are not compared
    (fields newer than a record). A list of entries (``reward.functions``) is compared field
    by field (``reward.functions[1].weight: 0.1 -> 0.2``), or, when entries were added or
    removed, as its entries without their unset fields (None, empty)."""
    before, after = _flatten(_plain(previous)), _flatten(_plain(current))
    dirs = [str(c.pop(WORKING_DIR_KEY, os.getcwd())) for c in (before, after)]
    # Lists of entries whose length changed: said whole (below), not entry field by field.
    resized = tuple(f"{key}[" for key, value in before.items()
                    if isinstance(value, _Entries) and not _same(value, after.get(key), *dirs))
    # Only the previous config's leaves: a leaf it lacks is a field newer than its record (a
    # section that became a mapping shows as its own leaf changing, e.g. None -> <unset>).
    return [
        f"{key}: {before[key]!r} -> {after.get(key, _UNSET)!r}"
        for key in sorted(before)
        if not _same(before[key], after.get(key, _UNSET), *dirs)
        and not key.startswith(resized)
        and not any(key == p or key.startswith((p + ".", p + "[")) for p in may_change)
    ]


class _Entries(list):
    """A list of mappings (``reward.functions``) as a leaf of :func:`_flatten`: equal to
    another of as many entries (their fields are leaves of their own), shown without the
    fields left unset (None, empty) when the number of entries differs."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Entries) and len(self) == len(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr([{k: v for k, v in entry.items() if v not in (None, {}, [])}
                     for entry in self])


def _same(a: Any, b: Any, dir_a: str, dir_b: str) -> bool:
    """Equal values; strings also when they name the same path from their working dirs."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if a == b:
        return True
    return (
        isinstance(a, str) and isinstance(b, str) and _UNSET not in (a, b)
        and os.path.normpath(os.path.join(dir_a, a)) == os.path.normpath(os.path.join(dir_b, b))
    )


def _plain(config: Any) -> Any:
    """Plain containers of YAML values from a dataclass, OmegaConf object or mapping."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return OmegaConf.to_container(OmegaConf.create(config))


def _flatten(mapping: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; scalars and lists of scalars are leaves; a list
    of mappings is an :class:`_Entries` leaf plus each entry's leaves (``a[0].b``)."""
    if isinstance(mapping, list) and prefix and all(isinstance(v, Mapping) for v in mapping):
        flat = {prefix: _Entries(mapping)}
        for i, entry in enumerate(mapping):
            flat.update(_flatten(entry, f"{prefix}[{i}]"))
        return flat
    if not isinstance(mapping, Mapping):
        return {prefix: mapping}
    if not mapping and prefix:
        return {prefix: {}}
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        flat.update(_flatten(value, _join(prefix, str(key))))
    return flat
