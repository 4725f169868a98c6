"""Results a person reads: ``eval_results.json`` (every checkpoint, set, metric, the sampling
settings and seeds that produced them), ``eval_results.md`` (the same as a table) and, across
a run's checkpoints, ``eval_results.png`` (each metric per step, a line per set). Files are
replaced atomically; a full disk is the one-line :class:`forge_ext.runtime.disk.OutputWriteError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge_ext.runtime import disk

RESULTS_FILE = "eval_results.json"
TABLE_FILE = "eval_results.md"
PLOT_FILE = "eval_results.png"
SAMPLES_FILE = "samples.jsonl"

# Columns of the table in this order, then any other metric alphabetically.
_FIRST = ("greedy",)
_LAST = ("reward", "response_tokens", "truncated", "prompts")


def write_text(path: Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` through a staged file renamed into place."""
    staged = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(text)
        staged.replace(path)
    except OSError as e:
        staged.unlink(missing_ok=True)
        raise disk.write_failed(what, str(path), e) from None


def metric_columns(checkpoints: Sequence[dict[str, Any]]) -> list[str]:
    """Every metric of the results, in table order (:data:`_FIRST`, ``pass@k`` ... by kind
    and k, then :data:`_LAST`)."""
    names = {m for c in checkpoints for s in c["sets"].values() for m in s["metrics"]}

    def order(name: str) -> tuple:
        if name in _FIRST:
            return (0, _FIRST.index(name), 0)
        if name in _LAST:
            return (3, _LAST.index(name), 0)
        kind, _, k = name.partition("@")
        return (1, ("pass", "mean", "maj").index(kind) if kind in ("pass", "mean", "maj")
                else 9, int(k) if k.isdigit() else 0, name)

    return sorted(names, key=order)


def markdown_table(results: dict[str, Any]) -> str:
    """One row per checkpoint and set (and the overall mean when there are several sets)."""
    checkpoints = results["checkpoints"]
    columns = metric_columns(checkpoints)
    lines = ["| checkpoint | set | " + " | ".join(columns) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in columns) + " |"]
    for c in checkpoints:
        rows = [(name, s["metrics"]) for name, s in c["sets"].items()]
        if len(rows) > 1:
            rows.append(("overall", c["overall"]))
        for name, metrics in rows:
            cells = [_cell(col, metrics.get(col)) for col in columns]
            lines.append(f"| {c['label']} | {name} | " + " | ".join(cells) + " |")
    settings = []
    for name, s in checkpoints[0]["sets"].items():
        st = s["settings"]
        settings.append(f"- {name}: {st['rows']} prompts, n={st['n']}, temperature "
                        f"{st['temperature']}, top_p {st['top_p']}, max_new_tokens "
                        f"{st['max_new_tokens']}, seed {st['seed']}")
    return "\n".join(lines + ["", f"Seed {results['seed']}; sets:", *settings]) + "\n"


def _cell(column: str, value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if column == "prompts":
        return str(int(value))
    if column == "reward":
        return f"{value:.3f}"
    if column == "response_tokens":
        return f"{value:.1f}"
    return f"{100 * value:.1f}%"


def write_results(output_dir: str | Path, results: dict[str, Any],
                  samples: Sequence[dict[str, Any]] = ()) -> list[Path]:
    """Write ``eval_results.json``, ``eval_results.md``, with several checkpoints of known
    steps ``eval_results.png``, and with ``samples`` ``samples.jsonl``; returns the paths."""
    out = Path(output_dir)
    paths = [out / RESULTS_FILE, out / TABLE_FILE]
    write_text(paths[0], json.dumps(results, indent=1) + "\n", "the evaluation results")
    write_text(paths[1], markdown_table(results), "the evaluation table")
    if samples:
        paths.append(out / SAMPLES_FILE)
        write_text(paths[-1], "".join(json.dumps(s) + "\n" for s in samples),
                   "the evaluation samples")
    plot = plot_steps(results, out / PLOT_FILE)
    if plot is not None:
        paths.append(plot)
    return paths


def plot_steps(results: dict[str, Any], path: Path) -> Path | None:
    """Each metric against the checkpoints' steps, a line per set; None unless at least two
    checkpoints have a step (``step-N`` folders)."""
    from forge_ext.runtime.metrics import PlotPanel, plot_panels

    stepped = [c for c in results["checkpoints"] if c.get("step") is not None]
    if len(stepped) < 2:
        return None
    columns = [c for c in metric_columns(stepped) if c != "prompts"]
    panels = []
    for column in columns:
        series = {}
        for c in sorted(stepped, key=lambda c: c["step"]):
            for name, s in c["sets"].items():
                if column in s["metrics"]:
                    series.setdefault(name, []).append((c["step"], s["metrics"][column]))
        rate = column not in ("reward", "response_tokens")
        panels.append((PlotPanel(keys=list(series), ylabel=column,
                                 ylim=(-0.02, 1.02) if rate else None), series))
    try:
        return plot_panels(panels, path, title="evaluation per checkpoint step")
    except OSError as e:
        raise disk.write_failed("the evaluation plot", str(path), e) from None
