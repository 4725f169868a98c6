"""What an app answers before it imports torch, torchtitan and Monarch (10 s and more on a
small machine), issue 38:

- ``--help``: the app's saved output (``apps/<app>/help.txt``, written by ``python -m
  apps.config_reference --write`` and kept current by tests/test_config_doc.py), printed in
  a fraction of a second; standard library only;
- a usage error (no ``--config PATH``; a config path given bare is named with its fix),
  from the app's own parser (:func:`forge_ext.config.parse_cli`), in a fraction of a second;
- a config error: the app's light config check (YAML, overrides, every typed section, the
  cross-field checks and the derived sizes; no torch, see :mod:`forge_ext.engine.schema`),
  ``config error: ...`` in under 2 s. The app then loads the config again, whole (the checks
  that need the model's code included), which costs it a few hundredths of a second. A check
  may also read the run's data (the GRPO app's :func:`apps.grpo.prepare.check_run`: rows,
  reward functions, the tokenizer, every prompt) and return it for the app to use.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


def print_saved_help(app: str, argv: list[str] | None = None) -> None:
    """Print ``app``'s saved help and exit 0 if ``argv`` (default: the command line) asks
    for help; return otherwise, or if the saved text is missing (the app's own ``--help``
    then prints it)."""
    args = sys.argv[1:] if argv is None else argv
    if not {"-h", "--help"} & set(args):
        return
    path = Path(__file__).resolve().parent / app / "help.txt"
    if path.is_file():
        sys.stdout.write(path.read_text())
        sys.exit(0)


def exit_on_config_error(check: str, argv: list[str] | None = None, *,
                         prog: str | None = None) -> Any:
    """Run the app's light config check and exit with ``config error: <message>`` (status 1)
    if it raises ValueError or FileNotFoundError; return what the check returned otherwise
    (None if the command line names no config).

    Args:
        check: ``"module:function"``, a function of ``(path, overrides)`` that reads and
            checks the config without importing torch (e.g. ``apps.grpo.config:check_config``).
        argv: the command line (default ``sys.argv[1:]``): ``--config PATH [key=value ...]``;
            anything else is left to the app's own parser.
        prog: the command, e.g. ``python -m apps.grpo.main``: given, a command line without
            ``--config PATH`` gets the app's usage error now (status 2; a config path given
            bare is named with ``--config``), not after the heavy imports.
    """
    args = sys.argv[1:] if argv is None else argv
    if "--config" not in args[:-1]:
        if prog is not None:  # the parser's usage error (standard library and YAML only)
            from forge_ext.config import parse_cli

            parse_cli(args, prog=prog)
        return None  # the app's parser says what is missing
    at = args.index("--config")
    path, overrides = args[at + 1], [a for i, a in enumerate(args) if i not in (at, at + 1)]
    if any("=" not in a or a.startswith("-") for a in overrides):
        return None  # not a config error: the app's parser answers
    module, function = check.split(":")
    try:
        return getattr(importlib.import_module(module), function)(path, overrides)
    except (ValueError, FileNotFoundError) as e:  # bad config: the message says the fix
        sys.exit(f"config error: {e}")


def check_command_line(app: str, check: str, argv: list[str] | None = None) -> Any:
    """``python -m apps.<app>.main``'s first step, before its heavy imports: the saved
    ``--help`` (:func:`print_saved_help`), then ``check`` of the command line
    (:func:`exit_on_config_error`). A check that finds nothing to do returns what says so:
    an object whose ``finished`` is true (:class:`apps.grpo.prepare.FinishedRun`); its
    ``message()`` is printed and the process exits 0, before torch and Monarch are imported.

    Returns:
        what the check returned (None if the command line names no config).
    """
    print_saved_help(app, argv)
    checked = exit_on_config_error(check, argv, prog=f"python -m apps.{app}.main")
    if getattr(checked, "finished", False):  # nothing to train: no torch, no Monarch
        print(checked.message())
        sys.exit(0)
    return checked
