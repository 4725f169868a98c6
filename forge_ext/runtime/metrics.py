"""Metric logging for apps: TensorBoard event files, a JSON-lines history, and a PNG plot.

One :class:`MetricLogger` per run, in the controller. ``log(step, {"reward/mean": ...})``
writes every scalar to TensorBoard (``<log_dir>/tensorboard``) and appends one line to
``<log_dir>/metrics.jsonl``; ``log_samples(step, records)`` appends sample completions to
``<log_dir>/samples.jsonl`` and shows them as a TensorBoard text (tag ``samples``: prompt,
completion, reward and each reward function's score). On resume, :meth:`MetricLogger.open`
keeps the history and the samples up to the resumed step and drops later lines (those steps
are about to be redone). Lines of the same step merge, later values winning (a resumed run
logs the held-out evaluation of its first step again), so the history and the final plot
show each step once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_ext.runtime import disk


SAMPLES_FILE = "samples.jsonl"
"""In ``log_dir``: sample completions per step (:meth:`MetricLogger.log_samples`)."""


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """YAML ``metrics:`` section."""

    log_dir: str
    """Folder of ``metrics.jsonl``, ``tensorboard/`` and the plot."""
    tensorboard: bool = True
    """Write TensorBoard event files (``tensorboard --logdir <log_dir>/tensorboard``)."""
    plot: str | None = "progress.png"
    """File name (in ``log_dir``) of the PNG plot written on close; null disables it."""
    samples_per_step: int = 4
    """GRPO: completions per training step appended to ``samples.jsonl`` in ``log_dir`` and
    shown in TensorBoard's Text tab (the first episode of each of the step's first prompts:
    prompt, answer, completion, reward and each reward function's score); 0: none."""

    def __post_init__(self) -> None:
        if self.samples_per_step < 0:
            raise ValueError(f"metrics.samples_per_step={self.samples_per_step} must be >= 0")


class MetricLogger:
    """Scalar metrics per step: TensorBoard, ``metrics.jsonl``, in-memory history, PNG plot.

    Example::

        logger = MetricLogger(MetricsConfig(log_dir="outputs/run"))
        logger.open(resume_step=0)
        logger.log(1, {"reward/mean": 0.4, "loss": 0.1})
        logger.close(plot_keys=["reward/mean", "eval/accuracy"])
    """

    def __init__(self, config: MetricsConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir)
        self.history: list[dict[str, float]] = []
        self._writer = None
        self._jsonl = None

    @property
    def jsonl_path(self) -> Path:
        return self.log_dir / "metrics.jsonl"

    @property
    def samples_path(self) -> Path:
        return self.log_dir / SAMPLES_FILE

    def open(self, resume_step: int = 0) -> None:
        """Create the folder, reload the history up to ``resume_step``, open the writers."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.history = []
        if self.jsonl_path.exists():
            by_step: dict[int, dict[str, float]] = {}
            with open(self.jsonl_path) as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        by_step.setdefault(row["step"], {}).update(row)
            self.history = [row for step, row in sorted(by_step.items()) if step <= resume_step]
        with open(self.jsonl_path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.history)
        if self.samples_path.exists():  # the samples of steps about to be redone go too
            with open(self.samples_path) as f:
                kept = [line for line in f
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with open(self.samples_path, "w") as f:
                f.writelines(kept)
        self._jsonl = open(self.jsonl_path, "a")
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events after resume_step from earlier runs' files.
            self._writer = SummaryWriter(
                str(self.log_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record scalar ``metrics`` at ``step`` (NaN values are written as null); logging a
        step again updates its values."""
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._merge(row)
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(_nan_to_null(row)) + "\n")
                self._jsonl.flush()
            except OSError as e:  # e.g. a full disk: one line naming the file and the space
                raise disk.write_failed("the metrics file", str(self.jsonl_path), e) from None
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), step)
            self._writer.flush()

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` (sample completions of ``step``: ``prompt``, ``completion``,
        ``reward``, ``rewards`` per function, any other fields) to ``samples.jsonl``, one
        JSON object a line with its ``step``, and to TensorBoard as text (tag ``samples``,
        one markdown section per record)."""
        if not records:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps({"step": step, **r}) + "\n" for r in records)
        except OSError as e:  # e.g. a full disk: one line naming the file and the space
            raise disk.write_failed("the samples file", str(self.samples_path), e) from None
        if self._writer is not None:
            self._writer.add_text("samples", samples_markdown(records), step)
            self._writer.flush()

    def _merge(self, row: dict[str, float]) -> None:
        """Append ``row`` to the history, or update the last row if it has the same step
        (a run logs steps in order)."""
        if self.history and self.history[-1]["step"] == row["step"]:
            self.history[-1].update(row)
        else:
            self.history.append(dict(row))

    def series(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of ``key`` in step order (skipping nulls)."""
        return [
            (row["step"], row[key]) for row in self.history
            if row.get(key) is not None and not math.isnan(row[key])
        ]

    def close(
        self, plot_keys: Sequence[str] = (), title: str = "",
        labels: Mapping[str, str] | None = None, panels: Sequence[PlotPanel] = (),
    ) -> Path | None:
        """Close the writers; with ``plot_keys`` or ``panels`` and ``config.plot`` set, write
        the plot: ``plot_keys`` on a first panel scaled 0..1 (``labels``: legend text per
        key, default the key), then one panel per entry of ``panels``.

        Returns:
            The plot's path, or None if none was written.
        """
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            # Rewrite the lines compacted: one per step (see the module docstring).
            staged = self.jsonl_path.with_name(self.jsonl_path.name + ".tmp")
            try:
                jsonl.close()
                with open(staged, "w") as f:
                    f.writelines(json.dumps(_nan_to_null(row)) + "\n" for row in self.history)
                staged.replace(self.jsonl_path)
            except OSError as e:  # e.g. a full disk: the uncompacted file stays as written
                staged.unlink(missing_ok=True)
                raise disk.write_failed("the metrics file", str(self.jsonl_path), e) from None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        panels = list(panels)
        if plot_keys:
            panels.insert(0, PlotPanel(keys=plot_keys, labels=labels or {}, ylim=(-0.02, 1.02)))
        if not panels or not self.config.plot:
            return None
        return plot_panels(
            [(panel, {panel.labels.get(k, k): self.series(k) for k in panel.keys})
             for panel in panels],
            self.log_dir / self.config.plot, title,
        )


@dataclass(kw_only=True, slots=True)
class PlotPanel:
    """One set of axes of the plot: the series of ``keys`` against the step."""

    keys: Sequence[str]
    ylabel: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Legend text per key (default: the key)."""
    ylim: tuple[float, float] | None = None
    """Fixed y range (None: from the data)."""


def samples_markdown(records: Sequence[Mapping[str, Any]]) -> str:
    """Sample records as TensorBoard markdown: per record its reward and each function's
    score, then prompt, answer and completion as code blocks (kept verbatim: completions
    often hold markdown or template tokens)."""

    def block(text: Any) -> str:
        text = text if isinstance(text, str) else json.dumps(text)
        return "    " + str(text).replace("\n", "\n    ")  # an indented (code) block

    sections = []
    for i, r in enumerate(records):
        scores = ", ".join(f"{name} {value:.4g}" for name, value in r.get("rewards", {}).items())
        sections.append("\n\n".join([
            f"**sample {i}**: reward {r.get('reward', float('nan')):.4g}"
            + (f" ({scores})" if scores else ""),
            "prompt:", block(r.get("prompt", "")),
            *(["answer:", block(r["answer"])] if r.get("answer") is not None else []),
            "completion:", block(r.get("completion", "")),
        ]))
    return "\n\n---\n\n".join(sections)


def _nan_to_null(row: Mapping[str, float]) -> dict[str, float | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def plot_panels(
    panels: Sequence[tuple[PlotPanel, Mapping[str, Sequence[tuple[int, float]]]]],
    path: str | os.PathLike, title: str = "",
) -> Path | None:
    """Plot panels stacked over one step axis, each ``(panel, {legend: [(step, value)]})``,
    and save a PNG; panels whose series are all empty are left out.

    Returns:
        ``path``, or None if every series is empty.
    """
    panels = [(panel, series) for panel, series in panels if any(series.values())]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7, 4 if len(panels) == 1 else 2.6 * len(panels)),
        sharex=True, squeeze=False,
    )
    for ax, (panel, series) in zip(axes[:, 0], panels):
        for key, points in series.items():
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        if panel.ylabel:
            ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
