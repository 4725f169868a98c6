"""``python -m apps.<app>.main --help`` in a fraction of a second: the app's saved ``--help``
output (``apps/<app>/help.txt``, written by ``python -m apps.config_reference --write`` and
kept current by tests/test_config_doc.py), printed before the app imports torch, torchtitan
and Monarch (10 s and more on a small machine). Standard library only: nothing of
``forge_ext`` is imported (its package imports torch)."""

from __future__ import annotations

import sys
from pathlib import Path


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
