"""The config reference of the apps, from their code: ``--help`` and ``docs/config.md``.

    python -m apps.config_reference --write   # regenerate docs/config.md (also: make docs)
    python -m apps.config_reference --check   # exit 1 if docs/config.md differs from the code

Each app's sections are its config dataclass walked by :func:`forge_ext.config_doc.sections`,
with the mapping sections described by the dataclasses that validate them: the engine's
``trainer:`` (:class:`forge_ext.engine.config.EngineConfig`; ``reference:`` takes the same) and ``task:``
(one section per ``task.source``, :data:`forge_ext.tasks.SOURCES`, plus the multi-turn fields
every source takes).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from forge_ext.config_doc import SectionDoc, help_text, markdown, sections

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "config.md"
REGENERATE = "python -m apps.config_reference --write"

INTRO = f"""
Every section and field the apps read from YAML, with its type, its default and its
docstring, generated from the code (do not edit by hand: run `{REGENERATE}`, or `make docs`;
`tests/test_config_doc.py` fails when this page and the code disagree). The same reference,
one sentence per field, is printed by `python -m apps.grpo.main --help` and
`python -m apps.sft.main --help`.

Any field can be set on the command line as `key=value` (`loop.steps=5`,
`trainer.optimizer.lr=1e-4`). `trainer:` and `reference:` are engine sections: besides the
forge_ext fields, `training`, `parallelism`, `lr_scheduler`, `checkpoint` and `compile` are
torchtitan's own config dataclasses, documented here with torchtitan's docstrings.
Without an accelerator the engine changes two torchtitan defaults the YAML leaves unset:
`training.mixed_precision_param: float32` and `parallelism.spmd_backend: partial_dtensor`;
it always sets `training.disable_cuda_graphs: true`, `checkpoint.last_save_model_only: false`
and `lr_scheduler.warmup_steps: 0` unless given.
"""


def _task_variants() -> dict[str, type]:
    from forge_ext.tasks import SOURCES, EpisodeConfig

    variants = {f"task.source: {name}" + (" (default)" if name == "addition" else ""): cls
                for name, cls in SOURCES.items()}
    return {**variants, "every source: multi-turn episodes": EpisodeConfig}


def grpo_sections() -> list[SectionDoc]:
    from apps.grpo.config import GRPOConfig
    from forge_ext.actors.critic import CriticConfig
    from forge_ext.engine.config import EngineConfig

    # reference: takes the trainer's fields (its field docstring says so), not listed twice;
    # critic: lists its own fields (CriticConfig's), the engine's being the trainer's.
    return sections(GRPOConfig, {"trainer": EngineConfig, "critic": CriticConfig,
                                 "task": _task_variants()})


def sft_sections() -> list[SectionDoc]:
    from apps.sft.main import SFTConfig
    from forge_ext.engine.config import EngineConfig

    return sections(SFTConfig, {"trainer": EngineConfig, "task": _task_variants()})


APPS = {
    "GRPO (`python -m apps.grpo.main`)": grpo_sections,
    "SFT warm-start (`python -m apps.sft.main`)": sft_sections,
}


def grpo_help() -> str:
    return help_text(grpo_sections())


def sft_help() -> str:
    return help_text(sft_sections())


def render() -> str:
    """The text of ``docs/config.md``."""
    return markdown("Config reference", INTRO, {app: build() for app, build in APPS.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 if it differs from the code")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
        return
    current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
    if current != text:
        sys.stdout.writelines(difflib.unified_diff(
            current.splitlines(True), text.splitlines(True), str(DOC_PATH), "from the code"))
        sys.exit(f"{DOC_PATH} differs from the code; regenerate it: {REGENERATE}")
    print(f"{DOC_PATH} matches the code")


if __name__ == "__main__":
    main()
