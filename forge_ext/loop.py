"""A synchronous RL loop template: apps override a few named hooks, never copy the loop.

:meth:`RLLoop.run` is the whole job, in the order of torchtitan's ``Trainer.train`` and
torchforge's GRPO ``main``::

    setup()                          spawn actors; each registers how it is stopped (track)
    step = load_checkpoint()         resume at the latest committed checkpoint (0 if none)
    fast_forward(step)               data iterators skip what the resumed steps consumed
    open metric loggers
    weight-sync gate                 the generator serves the trainer's weights
    evaluate(step)                   baseline
    for each step:
        build_rollouts(step)         generate, score, reference log-probs
        train_step(step, rollouts)   (waits for an in-flight push_weights first)
        push_weights / fetch_weights of the new policy version, in the background
        weight-sync gate             generator version >= trainer version - max_policy_age
        log, periodic evaluate, periodic save_checkpoint (last step always saved)
    finally: cancel in-flight syncs, close loggers, stop every tracked actor and proc mesh
             in reverse order -- also on an exception and on Ctrl-C

A part of the run that dies on its own (a role's process or host, reported by Monarch) is
not a Ctrl-C: the app calls :meth:`RLLoop.fail` with one error that says what died, the
awaited call is cancelled at once, teardown runs, and :meth:`RLLoop.run` raises that error
(:meth:`RLLoop.explain_error` maps an endpoint's own error to it when that arrives first).

Ctrl-C (SIGINT) once: the run stops at the next step boundary, saves a checkpoint there if
checkpoints are on (``save_every > 0``) and that step has none yet, and raises
KeyboardInterrupt after teardown; twice: the awaited call is cancelled at once (teardown
still runs). Why not rely on asyncio's own SIGINT handling (it cancels the main task): a
cancellation that arrives while the task awaits a Monarch endpoint call was seen to be
swallowed, and the run went on.

With ``max_policy_age: 0`` the gate waits for every sync before the next rollouts (fully
on-policy). With ``max_policy_age: k > 0`` rollouts may come from weights up to ``k``
versions old while the newer weights travel, which overlaps weight sync with generation.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from forge_ext.metrics import MetricLogger, MetricsConfig

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """YAML ``loop:`` section."""

    steps: int
    """Training steps; the run ends at policy version ``steps``."""
    eval_every: int = 0
    """Steps between held-out evaluations (0: only the baseline and the last step)."""
    save_every: int = 0
    """Steps between checkpoints (0: only the last step); needs trainer checkpointing."""
    max_policy_age: int = 0
    """Largest ``trainer version - generator version`` allowed when sampling."""

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "save_every", "max_policy_age"):
            if getattr(self, name) < 0:
                raise ValueError(f"loop.{name}={getattr(self, name)} must be >= 0")


class RLLoop(ABC):
    """Template of a synchronous RL job (see the module docstring for the order).

    Subclasses implement the abstract hooks; the loop owns ordering, the weight-sync gate,
    logging, and teardown. Versions: ``trainer_version`` is the number of optimizer steps
    (the trainer's policy version), ``generator_version`` the version the generator serves
    (-1 until the first sync).
    """

    def __init__(self, loop: LoopConfig, metrics: MetricsConfig) -> None:
        self.loop = loop
        self.metrics = MetricLogger(metrics)
        self.step = 0
        self.trainer_version = 0
        self.generator_version = -1
        self.sync_seconds: dict[str, float] = {}
        self._stop: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        self._push: asyncio.Task | None = None
        self._sync: asyncio.Task | None = None
        self._interrupts = 0
        self._saved_step: int | None = None  # the last step save_checkpoint was called for
        self._main_task: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._stopping = False  # teardown has begun

    # ---- hooks -------------------------------------------------------------------------
    @abstractmethod
    async def setup(self) -> None:
        """Spawn actors and proc meshes; call :meth:`track` for each right after spawning."""

    @abstractmethod
    async def load_checkpoint(self) -> int:
        """Restore the latest committed checkpoint; return its step (0 when none)."""

    def fast_forward(self, step: int) -> None:
        """Position data iterators as after ``step`` steps (default: nothing to do)."""

    @abstractmethod
    async def build_rollouts(self, step: int) -> Any:
        """Generate and score the rollouts trained on at ``step`` (0-based)."""

    @abstractmethod
    async def train_step(self, step: int, rollouts: Any) -> dict[str, float]:
        """One optimizer step on ``rollouts``; returns scalar metrics to log."""

    @abstractmethod
    async def push_weights(self, version: int) -> None:
        """Publish the trainer's weights as ``version``."""

    @abstractmethod
    async def fetch_weights(self, version: int) -> None:
        """Make the generator serve ``version``."""

    @abstractmethod
    async def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics of the current policy (the generator serves it)."""

    @abstractmethod
    async def save_checkpoint(self, step: int) -> None:
        """Commit a resumable checkpoint of ``step``."""

    def log_line(self, step: int, metrics: dict[str, float]) -> str | None:
        """The console line of a step (None: print nothing)."""
        return None

    def on_finish(self, completed: bool) -> None:
        """Called in ``finally`` after the loggers closed; ``completed`` if no error."""

    def write(self, line: str) -> None:
        """Print a console line (apps with progress bars override it)."""
        print(line, flush=True)

    def explain_error(self, error: BaseException) -> BaseException | None:
        """The error :meth:`run` should raise instead of ``error`` (e.g. the death of a
        process behind a failed endpoint call), or None to raise ``error`` itself."""
        return None

    # ---- helpers for hooks -------------------------------------------------------------
    def track(self, name: str, stop: Callable[[], Awaitable[Any]]) -> None:
        """Register ``stop`` (e.g. ``handle.stop``) to be awaited at teardown, in reverse
        order of registration."""
        self._stop.append((name, stop))

    @property
    def tracked(self) -> list[str]:
        """Names of what teardown will stop (for tests and logs)."""
        return [name for name, _ in self._stop]

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the run (see :meth:`fail`), None while none has."""
        return self._failure

    def fail(self, error: BaseException) -> None:
        """Stop the run at once because of ``error`` (a role's process or host died): the
        awaited call is cancelled, teardown stops everything, and :meth:`run` raises
        ``error``. Call on the event loop's thread; later calls are ignored."""
        if self._failure is not None:
            return
        self._failure = error
        if self._main_task is not None and not self._main_task.done() and not self._stopping:
            self._main_task.cancel()  # not during teardown: that must run to its end

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        """Run the whole job (module docstring). Re-raises the first error after teardown."""
        completed = False
        self._main_task = asyncio.current_task()
        sigint = self._install_sigint_handler()
        try:
            await self.setup()
            self.step = self.trainer_version = await self.load_checkpoint()
            if self.step:
                self._saved_step = self.step
                self.write(f"resumed from the checkpoint of step {self.step}")
                if self.step >= self.loop.steps:
                    self.write(
                        f"step {self.step} >= loop.steps={self.loop.steps}: nothing to train, "
                        "evaluating only (raise loop.steps to continue the run)"
                    )
            self.fast_forward(self.step)
            self.metrics.open(resume_step=self.step)
            await self._gate()
            self._log(self.step, await self.evaluate(self.step))
            while self.step < self.loop.steps:
                if self._interrupts:
                    await self._save_before_stopping()
                self._raise_if_interrupted()
                await self._run_step()
            completed = True
        except BaseException as error:
            failure = self._failure or self.explain_error(error)
            if failure is not None and failure is not error:
                self._failure = failure
                raise failure from None  # the one message a user should read
            raise
        finally:
            if sigint:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
            await self._teardown()
            self.on_finish(completed)

    async def _run_step(self) -> None:
        step = self.step
        rollouts = await self.build_rollouts(step)
        if self._push is not None:
            await self._push  # never train while the trainer is still publishing
        metrics = await self.train_step(step, rollouts)
        self.step += 1
        self.trainer_version = self.step
        self._start_sync(self.trainer_version)
        await self._gate()
        metrics.update(
            {f"time/{k}": v for k, v in self.sync_seconds.items()},
            policy_version=self.trainer_version,
        )
        last = self.step == self.loop.steps
        if (self.loop.eval_every and self.step % self.loop.eval_every == 0) or last:
            await self._drain()
            metrics.update(await self.evaluate(self.step))
        self._log(self.step, metrics)
        if (self.loop.save_every and self.step % self.loop.save_every == 0) or last:
            await self._drain()
            await self.save_checkpoint(self.step)
            self._saved_step = self.step

    async def _save_before_stopping(self) -> None:
        """On a graceful interrupt: keep the steps done since the last checkpoint."""
        if self.loop.save_every and self.step > 0 and self._saved_step != self.step:
            await self._drain()
            await self.save_checkpoint(self.step)
            self._saved_step = self.step
            self.write(f"saved the checkpoint of step {self.step}")

    # ---- Ctrl-C ------------------------------------------------------------------------
    def _install_sigint_handler(self) -> bool:
        """Route SIGINT to :meth:`interrupt`; False where signals cannot be handled (not
        the main thread, or no signal support)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self.interrupt)
        except (NotImplementedError, RuntimeError, ValueError):
            return False
        return True

    def interrupt(self) -> None:
        """First call: stop at the next step boundary; second: cancel the awaited call."""
        self._interrupts += 1
        if self._interrupts == 1:
            self.write("interrupt: stopping after this step (Ctrl-C again to stop now)")
        elif self._main_task is not None:
            self._main_task.cancel()

    def _raise_if_interrupted(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._interrupts:
            raise KeyboardInterrupt(f"interrupted before step {self.step + 1}")

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.log(step, metrics)
        line = self.log_line(step, metrics)
        if line:
            self.write(line)

    # ---- weight sync -------------------------------------------------------------------
    def _start_sync(self, version: int) -> None:
        """Push ``version`` then fetch it on the generator, in the background."""

        async def push() -> None:
            start = time.perf_counter()
            await self.push_weights(version)
            self.sync_seconds["push"] = time.perf_counter() - start

        async def sync(push_task: asyncio.Task) -> None:
            await push_task
            start = time.perf_counter()
            await self.fetch_weights(version)
            self.sync_seconds["fetch"] = time.perf_counter() - start
            self.generator_version = version

        self._push = asyncio.create_task(push())
        self._sync = asyncio.create_task(sync(self._push))

    async def _gate(self) -> None:
        """Wait until ``generator_version >= trainer_version - max_policy_age``, starting a
        sync of the trainer's version if none is in flight (at start-up and on resume)."""
        while self.trainer_version - self.generator_version > self.loop.max_policy_age:
            if self._sync is None or self._sync.done():
                if self._sync is not None:
                    self._sync.result()  # re-raises a failed sync's error
                self._start_sync(self.trainer_version)
            await self._sync

    async def _drain(self) -> None:
        """Wait for an in-flight sync (before evaluation and checkpoints)."""
        if self._sync is not None:
            await self._sync

    # ---- teardown ----------------------------------------------------------------------
    async def _teardown(self) -> None:
        self._stopping = True
        for task in (self._sync, self._push):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - cancelled or failed; we are stopping
                    pass
        try:
            self.metrics.close(**self.plot_spec())
        except Exception:  # noqa: BLE001 - never let logging block stopping the actors
            logger.exception("closing the metric loggers failed")
        while self._stop:
            name, stop = self._stop.pop()
            try:
                await stop()
            except BaseException:  # noqa: BLE001 - stop the rest regardless
                logger.exception("stopping %s failed", name)

    def plot_spec(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`MetricLogger.close` (which series to plot)."""
        return {}
