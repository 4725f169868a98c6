"""Built-in reward functions and the lookup of a user's own by ``"package.module:function"``.

Every reward function takes keyword arguments (see :data:`forge_ext.tasks.base.RewardFn`)
and returns a number; the :class:`~forge_ext.tasks.rubric.Rubric` calls them, bounds their
time and counts their errors. Built-ins (``reward.functions[i].fn``):

- ``math_verify``: 1.0 if HF ``math-verify`` finds the completion's final answer equal to the
  reference, else 0.0. Both sides may be GSM8K-style (``... #### 42``: the text after the last
  ``####`` is the answer) or LaTeX (``\\boxed{42}``, ``$\\frac{1}{2}$``) or plain numbers; the
  reference may also be bare LaTeX as MATH stores it (``10\\sqrt{2}``: read as if in ``$...$``).
  A reference it reads no math in is an error (counted), not a 0.
  math-verify's own timeouts use SIGALRM, which fails off the main thread (Math-Verify issues
  #50, #55): they are turned off here, and the rubric bounds the call instead.
- ``exact_match``: 1.0 if the completion equals the reference answer after stripping white
  space on both, else 0.0.

A task may bring its own, looked up first: the addition task's ``addition``, the
``reasoning_gym`` source's ``reasoning_gym`` (:class:`ReasoningGymScore`: the ``score_answer``
of the dataset that made the rows, for the text inside the completion's last
``<answer>...</answer>``, else the stripped completion).

A reward may also be a learned model (``reward.functions[i].model``: an HF
sequence-classification checkpoint, run as its own role by
:mod:`forge_ext.actors.reward_model`); :func:`check_reward_model` is what is checked of its
checkpoint before anything is spawned.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
from typing import Any

from forge_ext.tasks.base import RewardFn, Row


def gsm8k_final(text: str) -> str:
    """The text after the last ``####`` (GSM8K's answer marker), or ``text`` itself."""
    return text.rsplit("####", 1)[1].strip() if "####" in text else text


# A ``$`` without a backslash before it (``\\$`` is a dollar sign, not a math delimiter).
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")


def _gold_latex(answer: str) -> str:
    """The reference answer as math-verify should read it: GSM8K's final answer (after the
    last ``####``), then as written if it marks its math (``\\boxed{}`` or ``$...$``), else
    wrapped as ``$...$``. math-verify's default extraction is meant for free-text completions:
    a bare-LaTeX gold as MATH stores it (``\\sqrt{2}``, ``10\\sqrt{2}``) reads as nothing or
    as its first number (verl and verifiers box the gold for the same reason)."""
    text = gsm8k_final(answer).strip()
    if "\\boxed" in text or _MATH_DELIMITER.search(text):
        return text
    return f"${text}$"


def math_verify(completion: str, answer: str, **_: Any) -> float:
    """1.0 if math-verify finds the completion's final answer equal to ``answer`` (module
    docstring), else 0.0.

    Raises:
        ValueError: math-verify reads no math in ``answer`` (empty, or LaTeX it cannot
            convert): every completion would score 0 on a reference nobody checked. The
            rubric counts it in ``reward/errors/<name>`` and prints the first, naming the
            answer. math-verify's own errors propagate alike.
    """
    from math_verify import parse, verify

    gold = parse(_gold_latex(answer), parsing_timeout=None)
    if not any(not isinstance(g, str) for g in gold):  # nothing, or only its raw text
        raise ValueError(
            f"math_verify: the reference answer {answer!r:.200} does not parse as math "
            f"(math-verify read {gold!r:.100}); fix the answer in the task's data, or score "
            "it with another reward function (exact_match, or your own)"
        )
    prediction = parse(gsm8k_final(completion), parsing_timeout=None)
    if not prediction:
        return 0.0
    return float(verify(gold, prediction, timeout_seconds=None))


def _prepare_math_verify() -> None:
    """Run in each reward worker process before its first call (outside ``reward.timeout_s``):
    import math-verify and read one answer (its grammar, sympy's first conversions: ~1 s),
    and mute its warning that its own timeouts are off (the rubric kills a worker whose call
    runs past ``reward.timeout_s``)."""
    import logging

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(
            lambda record: not record.getMessage().startswith("Timeout is disabled"))
    math_verify(completion=r"\boxed{\sqrt{2}}", answer=r"\frac{1}{2}")


math_verify.prepare = _prepare_math_verify


def exact_match(completion: str, answer: str, **_: Any) -> float:
    """1.0 if ``completion.strip() == answer.strip()``, else 0.0."""
    return float(completion.strip() == answer.strip())


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The last ``<answer>...</answer>`` content of ``completion`` (reasoning-gym's answer
    format), stripped; the stripped completion if it has no such tag."""
    tags = _ANSWER_TAG.findall(completion)
    return (tags[-1] if tags else completion).strip()


class ReasoningGymScore:
    """The ``reasoning_gym`` reward of a :class:`~forge_ext.tasks.sources.ReasoningGymTask`:
    ``score_answer(answer, entry)`` of the reasoning-gym dataset that made the rows (built
    with the task's name, config, seed and size), for the completion's
    :func:`extract_answer`. Not reasoning-gym's ``get_score_answer_fn(name)``: that builds the
    dataset with the default config, and ``score_answer`` reads the config (the tolerance of
    ``decimal_arithmetic``, the partial credit of ``time_intervals``).

    Pickles as its name and dataset arguments: a reward worker process rebuilds the dataset
    once, in :meth:`prepare` (before its first call, outside ``reward.timeout_s``).

    Raises (on a call):
        ValueError: the row is not a reasoning-gym entry (a dict with an ``answer``).
    """

    def __init__(self, name: str, dataset_args: dict[str, Any], dataset: Any = None) -> None:
        self.name, self.dataset_args, self._dataset = name, dict(dataset_args), dataset

    def __reduce__(self) -> tuple:
        return ReasoningGymScore, (self.name, self.dataset_args)

    def prepare(self) -> None:
        """Build the dataset (imports reasoning-gym: seconds)."""
        if self._dataset is None:
            import reasoning_gym as rg

            self._dataset = rg.create_dataset(self.name, **self.dataset_args)

    def __call__(self, completion: str, row: Row) -> float:
        entry = row.metadata
        if not (isinstance(entry, dict) and "answer" in entry):
            raise ValueError(
                f"the reasoning_gym reward scores rows of task.source=reasoning_gym (a "
                f"reasoning-gym entry), not {type(entry).__name__} {entry!r:.80}"
            )
        self.prepare()
        return float(self._dataset.score_answer(extract_answer(completion), entry))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_verify": math_verify,
    "exact_match": exact_match,
}


def load_object(path: str, field: str) -> Any:
    """The object named by ``"package.module:name"`` (``name`` may be dotted: ``Class.attr``).

    Raises:
        ValueError: ``path`` has no ``:``, the module does not import, or it has no such
            name, each naming ``field`` and the path.
    """
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{field}={path!r} is not a 'package.module:name' import path")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error at import
        missing = isinstance(e, ModuleNotFoundError) and module_name.split(".")[0] == (
            e.name or "").split(".")[0]
        hint = (f"; is the folder holding {module_name.split('.')[0]!r} on PYTHONPATH (run "
                "from it with PYTHONPATH=.)?" if missing else "")
        raise ValueError(f"{field}={path!r}: module {module_name!r} does not import: "
                         f"{e!r}{hint}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            raise ValueError(
                f"{field}={path!r}: {module_name!r} has no attribute {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else
                   f" (it has {public[:12]})" if public else ""))
        obj = getattr(obj, part)
    return obj


def resolve_reward(fn: str, task_rewards: dict[str, RewardFn], field: str) -> RewardFn:
    """The reward function ``fn`` names: one of the task's, a built-in, or an import path.

    Raises:
        ValueError: an unknown name or an import path that does not name a callable, naming
            ``field`` and the names accepted.
    """
    if fn in task_rewards:
        return task_rewards[fn]
    if fn in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[fn]
    if ":" not in fn:
        names = sorted({*task_rewards, *BUILTIN_REWARDS})
        hint = (" (reasoning_gym is the reward of task.source=reasoning_gym: it scores with "
                "the dataset that made the rows)" if fn == "reasoning_gym" else "")
        raise ValueError(
            f"{field}={fn!r} is not a reward function{hint}: use one of {names} or a "
            "'package.module:function' import path"
        )
    obj = load_object(fn, field)
    if not callable(obj):
        raise ValueError(f"{field}={fn!r} names a {type(obj).__name__}, not a callable")
    return obj


REWARD_MODEL_ARCHITECTURES = {
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForSequenceClassification": "llama3",
}
"""The ``config.json`` ``architectures`` a reward model may have, with the engine's
``model.name`` that builds each (its trunk, plus ``score.weight`` as a one-column value head:
:func:`forge_ext.engine.models.apply_value_head`)."""


def check_reward_model(path: str, field: str) -> dict[str, Any]:
    """Check what a reward model's checkpoint directory shows before any spawn, and return
    its ``config.json``.

    Raises:
        ValueError: naming ``field`` and the fix: no ``config.json``; ``architectures`` not
            one of :data:`REWARD_MODEL_ARCHITECTURES` (a causal LM has no ``score`` head);
            ``num_labels`` other than 1 (``id2label``'s length, as transformers reads it; 2
            when absent, transformers' default); no ``score.weight`` in its
            ``*.safetensors``; no tokenizer files.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"{field}={path!r} has no config.json; point it at a Hugging Face "
            "sequence-classification checkpoint directory (config.json, *.safetensors, "
            "tokenizer)")
    with open(config_path) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not any(a in REWARD_MODEL_ARCHITECTURES for a in architectures):
        raise ValueError(
            f"{field}={path!r} is a {architectures or 'checkpoint without architectures'} "
            f"checkpoint; a reward model must be one of {list(REWARD_MODEL_ARCHITECTURES)} "
            "(a sequence classifier with num_labels: 1; a causal LM has no score head)")
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(
            f"{field}={path!r}: config.json has num_labels={labels}; a reward model gives one "
            "score per completion (num_labels: 1)")
    import glob

    from safetensors import safe_open

    names: set[str] = set()
    for tensors in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(tensors, framework="pt") as f:
            names.update(f.keys())
    if "score.weight" not in names:
        raise ValueError(
            f"{field}={path!r} holds no score.weight in its *.safetensors: a "
            "sequence-classification checkpoint's head is needed (the score it gives)")
    if not any(os.path.isfile(os.path.join(path, name))
               for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"{field}={path!r} has no tokenizer (tokenizer.json or tokenizer_config.json): "
            "completions are tokenized with the reward model's own tokenizer; save it beside "
            "the weights")
    return config
