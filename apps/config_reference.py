"""The config reference of the apps, from their code: ``--help`` and ``docs/config.md``.

    python -m apps.config_reference --write   # regenerate docs/config.md (also: make docs)
    python -m apps.config_reference --check   # exit 1 if docs/config.md differs from the code

``--write`` also saves each app's ``--help`` output (``apps/<app>/help.txt``), which ``python
-m apps.<app>.main --help`` prints without importing the app (:mod:`apps.fast_help`).

Each app's sections are its config dataclass walked by :func:`forge_ext.config_doc.sections`
in its config module (``apps.<app>.config.<app>_sections``, which its ``--help`` prints too),
with the mapping sections described by the dataclasses that validate them: the engine's
``trainer:`` (:class:`forge_ext.engine.config.EngineConfig`; ``reference:`` takes the same)
and ``task:`` (one section per ``task.source``, :func:`forge_ext.tasks.task_section_variants`,
plus the multi-turn fields every source takes).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import os
import sys
from pathlib import Path

from apps.eval.config import eval_sections
from apps.grpo.config import grpo_sections
from apps.sft.config import sft_sections
from forge_ext.config_doc import markdown

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


APPS = {
    "GRPO (`python -m apps.grpo.main`)": grpo_sections,
    "SFT warm-start (`python -m apps.sft.main`)": sft_sections,
    "Evaluation (`python -m apps.eval`)": eval_sections,
}
"""Each app's reference, from its config module (``<app>_sections``, which its ``--help``
prints too)."""


def render() -> str:
    """The text of ``docs/config.md``."""
    return markdown("Config reference", INTRO, {app: build() for app, build in APPS.items()})


HELP_PATHS = {app: ROOT / "apps" / app / "help.txt" for app in ("grpo", "ppo", "sft", "eval")}
"""Each app's ``--help`` output, saved: ``python -m apps.<app>.main --help`` (``python -m
apps.eval --help``) prints it without importing the app (torch, torchtitan, Monarch: 10 s and more on a small machine)."""


def help_output(app: str) -> str:
    """What ``apps.<app>.main``'s ``--help`` prints, at 80 columns (argparse wraps the usage
    to the terminal's width)."""
    module = importlib.import_module(f"apps.{app}.main")
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            module.main(["--help"])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 if it differs from the code")
    args = parser.parse_args(argv)
    outputs = {DOC_PATH: render(), **{path: help_output(app) for app, path in HELP_PATHS.items()}}
    if args.write:
        for path, text in outputs.items():
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        return
    for path, text in outputs.items():
        current = path.read_text() if path.is_file() else ""
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(True), text.splitlines(True), str(path), "from the code"))
            sys.exit(f"{path} differs from the code; regenerate it: {REGENERATE}")
        print(f"{path} matches the code")


if __name__ == "__main__":
    main()
