"""Every command shown in README.md and docs/ (fenced ``bash`` blocks) still works as written
(issue 28, test 2).

A block runs as written, in a fresh folder holding a link to ``configs/``, when all of its
commands take under a minute. Commands that take longer (training runs, the suite, an
install, a worker that serves until killed) are listed in :data:`SLOW` with the reason and
not run; an app command among them (``python -m apps.grpo.main --config ...``) is still
checked as far as it can be without running: its config file and every ``key=value``
override load and validate (the checkpoint it names may be elsewhere), after the block's
other commands (the files a heredoc writes) ran; ``python -m apps.eval --config ...`` too.
``python -m apps.<app>.main --help`` runs in this process. A command that matches no rule
fails the test: say how to check it here.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: (pattern at the start of a command, why it is not run here).
SLOW = [
    (r"make (demo|test|install|bench)\b", "minutes: installs, trains or runs the whole suite"),
    (r"make docs\b", "needs make install's .venv; its command, python -m apps.config_reference "
     "--write, is checked by tests/test_config_doc.py"),
    (r"python -m apps\.(grpo|ppo|sft)\.main .*--config", "a training run (minutes); its config and "
     "overrides are validated instead"),
    (r"python -m apps\.eval\b.*--config", "an evaluation (spawns generators: a minute or "
     "more); its config and overrides are validated instead"),
    (r"python -m apps\.export\b", "needs a run's DCP checkpoint (tests/test_eval_app.py "
     "converts one)"),
    (r"python -m bench\.", "a benchmark (minutes)"),
    (r"python -c .*run_worker_loop_forever", "starts a worker that serves until killed"),
    (r"(FORGE_\w+=1 )?(\S*/)?python -m pytest\b", "tests: run by the suite itself"),
    (r"tensorboard\b", "a server that runs until stopped"),
    (r"curl\b", "talks to a running run's endpoint"),
]
#: Commands run as written, in this process or a shell, under a minute.
QUICK = [
    r"python -m apps\.(grpo|ppo|sft)\.main --help$",
    r"python -m apps\.config_reference --check$",
    r"cat > \S+ <<",
    r"(ls|cat|head|tail|wc|mkdir|echo)\b",
    r"\w+=\S*$",  # a shell variable set for the next commands
]


@dataclass
class Block:
    page: str
    line: int
    commands: list[str]


def bash_blocks(path: Path) -> list[Block]:
    """The fenced ``bash`` blocks of a Markdown page, each as its commands: continuation
    lines joined, a heredoc kept with its command as one, comments and blank lines dropped."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        commands, j = [], 0
        while j < len(body):
            line = body[j]
            heredoc = re.search(r"<<\s*'?(\w+)'?", line)
            if heredoc:
                end = next(k for k in range(j + 1, len(body)) if body[k].strip() == heredoc[1])
                commands.append("\n".join(body[j : end + 1]))
                j = end + 1
                continue
            while line.endswith("\\") and j + 1 < len(body):
                j += 1
                line = line[:-1] + " " + body[j].strip()
            stripped = _without_comment(line).strip()
            if stripped:
                commands.append(stripped)
            j += 1
        blocks.append(Block(path.name, start, commands))
    return blocks


def _without_comment(line: str) -> str:
    try:
        return shlex.join(shlex.split(line, comments=True))
    except ValueError:  # unbalanced quotes: keep the line for the rules to reject
        return line


def _env_and_argv(command: str) -> tuple[dict[str, str], list[str]]:
    argv = shlex.split(command)
    env = {}
    while argv and re.match(r"^\w+=", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    return env, argv


def rule_of(command: str) -> tuple[str, str]:
    """``("slow", reason)``, ``("quick", "")``, or ``("unknown", "")``."""
    _, argv = _env_and_argv(command.split("\n", 1)[0]) if "<<" not in command else ({}, [])
    text = shlex.join(argv) if argv else command
    for pattern, reason in SLOW:
        if re.match(pattern, text):
            return "slow", reason
    for pattern in QUICK:
        if re.match(pattern, text):
            return "quick", ""
    return "unknown", ""


ALL_BLOCKS = [block for page in PAGES if page.is_file() for block in bash_blocks(page)]


def test_the_pages_show_commands_and_each_matches_a_rule():
    assert ALL_BLOCKS, "README.md shows no bash block"
    unknown = [f"{b.page}:{b.line}: {c}" for b in ALL_BLOCKS for c in b.commands
               if rule_of(c)[0] == "unknown"]
    assert not unknown, ("commands this test does not know how to check (add a rule to "
                         "SLOW or QUICK in tests/test_doc_commands.py): " + "; ".join(unknown))


def _validate_app_command(argv: list[str]) -> None:
    """Load and validate the config of ``python -m apps.<app>.main --config PATH k=v ...``
    as the app would before spawning, except reading the checkpoint."""
    from forge_ext.config import from_mapping, load_yaml, parse_cli

    module = argv[2]
    path, overrides = parse_cli(argv[3:])
    if module == "apps.eval":
        from apps.eval.config import load_eval_config

        load_eval_config(path, overrides)
    elif module in ("apps.grpo.main", "apps.ppo.main"):
        from apps.grpo.config import load_config

        load_config(path, overrides, check_model=False)
    else:
        from apps.sft.config import SFTConfig
        from forge_ext.tasks import task_config

        config = from_mapping(SFTConfig, load_yaml(path, overrides))
        task_config(config.task)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[f"{b.page}:{b.line}" for b in ALL_BLOCKS])
def test_each_command_runs_as_written_or_its_config_validates(block, tmp_path, monkeypatch,
                                                             capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    skipped = []
    for command in block.commands:
        kind, reason = rule_of(command)
        env, argv = _env_and_argv(command) if "<<" not in command else ({}, [])
        is_app = len(argv) > 2 and argv[:2] == ["python", "-m"] and argv[2] in (
            "apps.grpo.main", "apps.ppo.main", "apps.sft.main", "apps.eval")
        if kind == "slow":
            if is_app and "--config" in argv:
                for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
                    if entry:  # the user's modules (an agent, a reward) the config names
                        monkeypatch.syspath_prepend(str(tmp_path / entry))
                _validate_app_command(argv)
            skipped.append(f"{command.splitlines()[0]} ({reason})")
        elif kind == "quick" and is_app:  # --help, in this process
            with pytest.raises(SystemExit) as done:
                importlib.import_module(argv[2]).main(argv[3:])
            assert done.value.code in (0, None), command
            assert "config reference" in capsys.readouterr().out
        elif kind == "quick" and argv[:3] == ["python", "-m", "apps.config_reference"]:
            from apps.config_reference import main

            monkeypatch.chdir(ROOT)
            main(argv[3:])
            monkeypatch.chdir(tmp_path)
        elif kind == "quick":
            result = subprocess.run(["bash", "-e", "-c", command], capture_output=True,
                                    text=True, timeout=60, env={**os.environ, **env})
            assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        else:
            pytest.fail(f"{block.page}:{block.line}: no rule for {command!r}")
    if skipped and len(skipped) == len(block.commands):
        print("not run (validated where an app command):", "; ".join(skipped))


def test_the_readme_own_data_example_runs_on_the_demo_model(demo_checkpoint, tmp_path,
                                                           monkeypatch, capsys):
    """Issue 50: the README's own-data example named a checkpoint that is nowhere and English
    prompts the demo's model reads as ``<unk>`` (every group flat). As written, on a model
    shaped like ``make demo``'s warm-start (its tokenizer, ``outputs/demo/warmstart``): the
    run's whole pre-spawn check passes (:func:`apps.grpo.prepare.check_run`: config, model,
    rows, reward functions, every prompt rendered) with no ``<unk>`` warning, and each row's
    answer is the sum as the model writes it, and the rewards score it full."""
    from apps.grpo.prepare import check_run
    from forge_ext.config import parse_cli

    block = next(b for b in bash_blocks(ROOT / "README.md")
                 if any("task.source=dataset" in c for c in b.commands))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "outputs" / "demo").mkdir(parents=True)
    (tmp_path / "outputs" / "demo" / "warmstart").symlink_to(demo_checkpoint)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=. of the command
    run = None
    for command in block.commands:
        if "<<" in command:
            subprocess.run(["bash", "-e", "-c", command], check=True, timeout=60)
        else:
            _, argv = _env_and_argv(command)
            run = check_run(*parse_cli(argv[3:]))
    assert run is not None, "the block runs no app"
    assert "warning" not in capsys.readouterr().err
    rows = run.train_rows + run.eval_rows
    assert rows
    for row in rows:  # as the demo's model writes a sum: its digits reversed (12+34= -> 64)
        a, b = map(int, row.prompt.removesuffix("=").split("+"))
        assert row.answer == str(a + b)[::-1], row
        assert run.tok.unknown_count(run.tok.tokenizer.encode(
            row.answer, add_special_tokens=False)) == 0, row.answer
    from forge_ext.tasks.rubric import Sample

    scores = run.rubric.score_sync([Sample(row, row.answer) for row in rows])
    assert scores.rewards == pytest.approx([1.1] * len(rows)), scores
    run.rubric.close()
