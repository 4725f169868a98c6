"""The SFT app's typed config (YAML top level, :class:`SFTConfig`) and its light check: standard
library, OmegaConf and dacite only, so that ``python -m apps.sft.main`` reports a config error
before it imports torch (issue 38, :mod:`apps.fast_help`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge_ext.config import from_mapping, load_yaml
from forge_ext.config_doc import SectionDoc, help_text, sections
from forge_ext.engine.schema import (
    check_engine_view, engine_key_problems, engine_view, world_size_of,
)
from forge_ext.runtime.metrics import MetricsConfig
from forge_ext.tasks import (
    PromptConfig, RewardConfig, Rubric, Task, build_task, task_config, task_key_problems,
    task_section_variants,
)


@dataclass(kw_only=True, slots=True)
class InitConfig:
    """Where training starts (YAML ``init:``)."""

    hf_path: str
    """HF checkpoint directory to start from; if it holds none, a random model is written."""
    model_type: str = "qwen3"
    """``transformers`` model type of the random model."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """HF ``config.json`` fields of the random model; ``vocab_size`` defaults to the task's
    character tokenizer's, special token ids to its ``<bos>``/``<eos>``/``<pad>``."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Steps between validation evaluations during training (0: only the final held-out one)."""
    num_validation: int = 200
    """Training rows whose greedy accuracy is the validation metric (the held-out set is
    never used to decide anything)."""
    stop_at_accuracy: float | None = None
    """Stop once the validation accuracy reaches this (needs ``every``): a warm-start that is
    partly right whatever the seed or the machine's numerics, rather than after a fixed number
    of steps (addition is learnt abruptly, at a step that varies with the seed)."""
    max_new_tokens: int | None = None
    """Longest greedy answer in tokens; default: the longest reference answer's, plus its
    end token."""

    def __post_init__(self) -> None:
        if self.stop_at_accuracy is not None and not self.every:
            raise ValueError("eval.stop_at_accuracy needs eval.every > 0")


# Keys that may differ from the run that wrote an existing warm-start, which is then kept.
MAY_CHANGE_ON_SKIP = ("skip_if_exists", "metrics", "env")


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """The SFT app's config (YAML top level)."""

    output_dir: str
    """The warm-start HF checkpoint directory written at the end; with ``trainer.lora`` the
    PEFT adapter folder ``<output_dir>/adapter`` (and, with ``trainer.lora.export_merged``,
    the merged HF checkpoint in ``output_dir`` itself)."""
    init: InitConfig
    trainer: dict[str, Any]
    """Engine config (:func:`forge_ext.engine.engine_config_from_mapping`);
    ``trainer.model`` should be ``{flavor: hf, hf_path: ${init.hf_path}}`` (``model.name``
    follows config.json's ``model_type``)."""
    skip_if_exists: bool = True
    """Keep an existing checkpoint in ``output_dir`` and do nothing."""
    seed: int = 0
    """Seeds the random init and the order of training rows."""
    task: dict[str, Any] = field(default_factory=lambda: {"source": "addition"})
    """``task.source`` and that source's fields (:mod:`forge_ext.tasks`), as in the GRPO app."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How completions are scored for the accuracy metric (as in the GRPO app)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation during training and the final held-out evaluation."""
    metrics: MetricsConfig | None = None
    """Where metrics go (null: none)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set before training, e.g. ``OMP_NUM_THREADS: "1"`` (see
    :func:`forge_ext.config.apply_env`)."""


def check_config(path: str, overrides: list[str] = ()) -> SFTConfig:
    """Read and check an SFT config without torch: every typed section, the task's source,
    fields and files, the ``trainer:`` section's keys, plain types, process count (one) and
    microbatch split. :func:`apps.sft.main.main` then checks the rest (the model, every
    training row's length).

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    config = from_mapping(SFTConfig, load_yaml(path, overrides), sections={
        "trainer": engine_key_problems, "task": task_key_problems})
    task_config(config.task)  # source, fields, files, import paths
    check_single_process(config.trainer)
    return config


def check_single_process(trainer: dict[str, Any]) -> None:
    """Raise ValueError unless the ``trainer:`` section trains in one process with a batch
    its microbatch fields split (:func:`forge_ext.engine.schema.engine_view`)."""
    view = engine_view(trainer, "trainer")
    processes = world_size_of(view, None)
    if processes != 1:
        raise ValueError(
            f"trainer.parallelism degrees multiply to {processes} processes, but the "
            "SFT app trains in this one process; set them to 1 (or leave them out)"
        )
    check_engine_view(view, "trainer")


def functions_only(rubric: Rubric) -> Rubric:
    """``rubric``, if it has no reward model: the SFT app scores its held-out answers in the
    controller, with reward functions only (a reward model is a role of the GRPO app).

    Raises:
        ValueError: naming the reward model's entry.
    """
    if rubric.models:
        name = next(iter(rubric.models))
        raise ValueError(
            f"reward.functions: {name!r} is a reward model (model: ...), which the SFT app "
            "does not run; its held-out accuracy needs a reward function (fn: ...)")
    return rubric


def check_data(config: SFTConfig) -> Task:
    """The task built and its rows read (columns present), the rubric's functions imported
    (the columns they name present): without torch, so ``python -m apps.sft.main`` says a
    data or reward error before its imports (issue 38).

    Raises:
        ValueError / FileNotFoundError: naming the field, the file or the column.
    """
    task = build_task(config.task)
    for rows in (task.train_rows(), task.eval_rows()):
        list(rows)  # every row converts (a row without an answer is named)
    with functions_only(Rubric(config.reward, task)):
        pass  # built: its functions import and take what the rows have
    return task


def check_run(path: str, overrides: list[str]) -> tuple[SFTConfig, Task | None]:
    """:func:`check_config`, then :func:`check_data` unless ``output_dir`` may hold a kept
    checkpoint (``skip_if_exists`` and anything there: the app decides, after its imports,
    whether it keeps it). What ``python -m apps.sft.main`` runs first.

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    import os

    config = check_config(path, overrides)
    out = config.output_dir
    if config.skip_if_exists and os.path.isdir(out) and os.listdir(out):
        return config, None
    return config, check_data(config)


def sft_sections() -> list[SectionDoc]:
    """The SFT app's config reference (``--help``, docs/config.md): :class:`SFTConfig`'s
    sections, ``trainer:`` as the engine's fields and ``task:`` as each source's."""
    # torchtitan's config dataclasses (torch, seconds): only when the reference is rendered.
    from forge_ext.engine.config import EngineConfig

    return sections(SFTConfig, {"trainer": EngineConfig, "task": task_section_variants()})


def sft_help() -> str:
    """What ``python -m apps.sft.main --help`` prints after the usage."""
    return help_text(sft_sections())
