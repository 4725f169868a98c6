"""``apps.eval``'s typed config (YAML top level, :class:`EvalAppConfig`) and its light checks:
no torch, so that ``python -m apps.eval`` reports a config error before its imports (issue 38,
:mod:`apps.fast_help`). :mod:`apps.eval.main` checks the rest (what each checkpoint is, the
tokenizer, the sets' rows, lengths) and runs the evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_ext.config import WORKING_DIR_KEY, from_mapping, load_yaml
from forge_ext.config_doc import SectionDoc, help_text, sections
from forge_ext.evaluation import EvalConfig, check_sets
from forge_ext.rollout.config import GeneratorConfig
from forge_ext.tasks import PromptConfig, RewardConfig, task_section_variants

RUN_SECTIONS = ("output_dir", "seed", "task", "reward", "prompt", "generator", "eval",
                "checkpoint", "base", "save_samples")
"""What this app reads from a GRPO run's config (``procs.env`` becomes ``env``)."""


@dataclass(kw_only=True, slots=True)
class EvalAppConfig:
    """``apps.eval``'s config (YAML top level)."""

    checkpoint: list[str] | str
    """What to evaluate (module docstring): an HF checkpoint folder, a DCP checkpoint step
    folder, a LoRA adapter folder, a folder of ``step-N`` folders of one of these, or a list."""
    output_dir: str
    """Where ``eval_results.json``, ``eval_results.md`` and ``eval_results.png`` go."""
    base: str | None = None
    """The HF checkpoint folder a LoRA adapter is served on (default: its
    ``base_model_name_or_path``), or a DCP checkpoint's ``model.hf_path`` (default: from the
    run's ``run_config.yaml``)."""
    seed: int = 0
    """Seeds every set's samples (each set's seed is derived from it and the set's name)."""
    task: dict[str, Any] = field(default_factory=lambda: {"source": "addition"})
    """The task whose held-out split is evaluated when ``eval.sets`` is empty."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How completions are scored (sets may set their own)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    """How rows become prompts (sets may set their own)."""
    generator: dict[str, Any] = field(default_factory=dict)
    """The generator section of the GRPO app (``backend``, ``sampling``, ``dtype``,
    ``vllm``, ``replicas``); its ``hf_path`` is the checkpoint's."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The evaluation sets (``eval.sets``) and the held-out split's decoding."""
    save_samples: bool = False
    """Also write every sample (prompt and response ids, log-probs, completion, answer,
    correct, reward) to ``samples.jsonl`` in ``output_dir``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set before anything is spawned (e.g. ``OMP_NUM_THREADS: "1"``)."""


def load_eval_config(path: str, overrides: list[str]) -> EvalAppConfig:
    """Read an evaluation config, or the sections this app reads from a GRPO run's config
    (:data:`RUN_SECTIONS`), and validate it (every set, :func:`forge_ext.evaluation
    .check_sets`).

    Raises:
        ValueError / FileNotFoundError: naming the field.
    """
    mapping = load_yaml(path, overrides)
    if "trainer" in mapping or "loop" in mapping:  # a GRPO run's config or run record
        env = ((mapping.get("procs") or {}).get("env")) or {}
        mapping = {k: v for k, v in mapping.items() if k in RUN_SECTIONS}
        mapping["env"] = env
    mapping.pop(WORKING_DIR_KEY, None)
    if mapping.get("checkpoint") is None:
        raise ValueError("checkpoint is not set: add checkpoint=<HF folder | DCP step folder | "
                         "LoRA adapter folder> to the command line")
    config = from_mapping(EvalAppConfig, mapping)
    check_sets(config.eval.sets)
    return config


def check_config(path: str, overrides: list[str]) -> EvalAppConfig:
    """The checks that need no torch: :func:`load_eval_config`, that each checkpoint path
    exists, and the ``generator:`` section; ``python -m apps.eval`` runs them before its
    imports (:mod:`apps.fast_help`), :class:`apps.eval.main.EvalApp` the rest (what each
    checkpoint is, the tokenizer, the sets' rows, lengths).

    Raises:
        ValueError / FileNotFoundError: naming the field.
    """
    config = load_eval_config(path, overrides)
    paths = [config.checkpoint] if isinstance(config.checkpoint, str) else list(config.checkpoint)
    for given in paths:
        if not Path(given).exists():
            raise FileNotFoundError(f"checkpoint={given} does not exist")
    section = {k: v for k, v in config.generator.items() if k != "hf_path"}
    from_mapping(GeneratorConfig, {**section, "hf_path": "."}, path="generator")
    return config


def eval_sections() -> list[SectionDoc]:
    """The evaluation app's config reference (``--help``, docs/config.md):
    :class:`EvalAppConfig`'s sections and ``task:`` as each source's."""
    return sections(EvalAppConfig, {"task": task_section_variants()})


def eval_help() -> str:
    """What ``python -m apps.eval --help`` prints after the usage."""
    return help_text(eval_sections())
