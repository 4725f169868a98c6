"""Where the controller runs user code that may block: worker processes
(:class:`ProcessPool`, reward functions under ``reward.isolation: process``, the default) or
daemon threads (:class:`DaemonPool`, ``reward.isolation: thread`` and environments).

Why processes: one reward call can hold the GIL for minutes in a single C call (sympy's
big-int power under math-verify for ``\\boxed{9^{9^{9}}}``; ``10 ** 10**9`` in a user's
function). On a thread nothing can interrupt it, and the controller's event loop, its
timeouts and every other thread stop until it returns. A process can be killed at the call's
timeout (verl PR #5839 moved math-verify into a subprocess for this; UniRL PR #462 and
NeMo-Gym PR #1354 likewise).

:class:`ProcessPool` keeps ``workers`` processes, each driven by one daemon thread of the
controller that sends it one call at a time over a socket and waits for the answer for the
call's timeout; past it the thread SIGKILLs the process (counted as a timeout by the rubric)
and starts a new one before taking its next call. Calls wait in one queue, so the calls of a
batch spread over all workers. A call's timeout counts from when its worker receives it.

- **How a worker starts**: ``python -P workers.py FD PID``, this file as a script, not
  ``multiprocessing``: its spawn and forkserver children re-import the controller's
  ``__main__`` (for the GRPO app: torch and Monarch, seconds and hundreds of MB each), and
  ``fork`` copies a process that runs Monarch's threads. The worker imports the modules of its
  functions and nothing else: ``forge_ext``'s package ``__init__`` files (torch,
  transformers: ~2.5 s and ~260 MB) run only if a function uses a name they define.
- **Functions travel by reference**, pickled once when the rubric is built and sent once to
  each worker: a module-level function as its module and name (a user's
  ``package.module:function``), a callable object as its class and state (the addition
  task's :class:`~forge_ext.tasks.addition.AdditionReward`). A lambda or closure cannot
  travel: the rubric refuses it. A function's optional ``prepare()`` runs in each worker
  after loading, before its first call and outside the timeout (imports, a dataset).
- **Async functions** run in the worker too, one at a time, under ``asyncio.run``: a
  coroutine that blocks in a C call cannot stop the controller's loop either.
- **Lifetime**: :meth:`ProcessPool.close` kills the workers (the rubric's ``close``, or its
  finalizer when it is garbage collected); on Linux the kernel SIGKILLs a worker when the
  controller thread that started it ends (``PR_SET_PDEATHSIG``), so neither an exiting nor a
  SIGKILLed controller leaves one behind, even one stuck in a C call. Workers ignore SIGINT
  and SIGTERM (:data:`STOP_SIGNALS`): a stop is the controller's to handle (it finishes the
  step, then closes the pool), and a Ctrl-C or a ``kill``/``timeout``/scheduler stop sent to
  the whole process group must not end the workers mid-step (their samples would score
  ``reward.on_error``).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import math
import numbers
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 300.0
"""Longest a worker may take to start: import its functions' modules and run their
``prepare()``."""

#: The signals a worker ignores: Ctrl-C and the stop a ``kill``, ``timeout`` or a scheduler
#: sends, often to the whole process group (the controller's loop handles both,
#: :mod:`forge_ext.rl.loop`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RewardWorkerError(Exception):
    """A call failed in a worker process: the function raised there (the message holds its
    traceback), did not load there, or its worker died or did not start."""


# ------------------------------------------------------------------------------- threads
class DaemonPool:
    """Daemon worker threads for synchronous calls: no thread is made per call (a batch of
    512 calls took 0.3-0.9 s that way on 2 busy cores), and a call that never returns keeps
    its worker, which :meth:`call` replaces, without keeping the process from exiting (an
    executor's threads are joined at exit). A call that holds the GIL stops every thread of
    the process until it returns: :class:`ProcessPool` is the bound for those.
    """

    def __init__(self, workers: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="reward").start()

    def _work(self) -> None:
        while True:
            self._run(*self._jobs.get())

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, started: asyncio.Future, done: asyncio.Future,
             fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        # An error's traceback holds this frame, and the future holds the error: the
        # future must not stay a local here, nor the error (a cycle that keeps the awaiting
        # caller's frames, the rubric among them, until a gc pass).
        if done.cancelled():
            return
        try:
            loop.call_soon_threadsafe(_settle, started, True, None)
        except RuntimeError:  # the loop closed: nobody waits for this call
            return
        try:
            result = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001  (delivered to the awaiting task)
            _deliver(loop, done, None, e)
        else:
            _deliver(loop, done, result, None)
        del done

    async def call(self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float) -> Any:
        """``fn(**kwargs)`` on a worker; ``timeout`` seconds from when it starts running.

        Raises:
            asyncio.TimeoutError: it ran longer (its worker is replaced); whatever ``fn``
                raised.
        """
        loop = asyncio.get_running_loop()
        started, done = loop.create_future(), loop.create_future()
        self._jobs.put((loop, started, done, fn, kwargs))
        try:
            await started
            return await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            self._spawn()  # the stuck worker is lost to the pool; keep its size
            raise
        finally:
            if not done.done():
                done.cancel()
            del done  # (see ProcessPool.call)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # timed out and cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any,
             error: BaseException | None) -> None:
    """Settle ``future`` on its loop from another thread; nothing if the loop has closed."""
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop closed while the call ran: nobody waits for it
        pass


# ----------------------------------------------------------------------------- processes
def default_workers() -> int:
    """Worker processes when unset: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class ProcessPool:
    """``workers`` worker processes running the pickled ``functions`` (module docstring).

    Args:
        functions: name -> the function pickled (by reference).
        workers: processes (and controller threads driving them).
        timeout: seconds a call may run in its worker before the worker is killed.
    """

    def __init__(self, functions: dict[str, bytes], workers: int, timeout: float) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self._functions, self._size, self._timeout = dict(functions), workers, timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[_Worker] = set()
        self._closed = False

    def start(self) -> None:
        """Start the workers, all at once, without waiting for them (the first call does
        this too)."""
        with self._lock:
            if self._threads or self._closed:
                return
            for i in range(self._size):
                thread = threading.Thread(target=self._serve, daemon=True,
                                          name=f"reward-worker-{i}")
                thread.start()
                self._threads.append(thread)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers running now."""
        with self._lock:
            return sorted(w.process.pid for w in self._workers)

    async def call(self, name: str, kwargs: dict[str, Any]) -> float:
        """The reward ``functions[name](**kwargs)`` returned, as a finite float, from a worker.

        Raises:
            TimeoutError: it ran longer than ``timeout`` (its worker was killed).
            RewardWorkerError: it raised (the message holds the worker's traceback), or its
                worker died, did not start, or the pool is closed.
            pickle.PicklingError, TypeError: ``kwargs`` cannot be sent.
        """
        if self._closed:
            raise RewardWorkerError("the rubric is closed")
        self.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._jobs.put((loop, done, name, kwargs))
        try:
            return await done  # the worker's thread bounds the call: no timeout here
        finally:
            if not done.done():
                done.cancel()
            del done  # the future holds the error, whose traceback holds this frame: a
            # cycle that would keep the callers' frames (the rubric) until a gc pass

    def close(self) -> None:
        """Kill every worker and end their threads; calls still queued fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        for _ in self._threads:
            self._jobs.put(None)
        for worker in workers:
            worker.kill()

    def _serve(self) -> None:
        """One worker's thread: (re)start the worker, then run queued calls on it."""
        worker: _Worker | None = None
        try:
            while True:
                start_error = None
                if worker is None:
                    try:
                        worker = self._start_worker()
                    except Exception as e:  # noqa: BLE001  (the next call reports it)
                        start_error = str(e) if isinstance(e, RewardWorkerError) else (
                            f"the reward worker process did not start: {e!r}")
                job = self._jobs.get()
                if job is None:
                    return
                worker = self._run(worker, start_error, *job)
                del job  # (see DaemonPool._run)
        finally:
            if worker is not None:
                self._forget(worker)

    def _run(self, worker: _Worker | None, start_error: str | None,
             loop: asyncio.AbstractEventLoop, done: asyncio.Future, name: str,
             kwargs: dict[str, Any]) -> _Worker | None:
        """Run one call on ``worker`` and deliver its outcome; the worker, None if it died."""
        if done.cancelled():
            return worker
        try:  # no local keeps the error or the future (see DaemonPool._run)
            if start_error is not None:
                raise RewardWorkerError(start_error)
            result = worker.call(name, kwargs, self._timeout)
        except BaseException as e:  # noqa: BLE001  (delivered to the awaiting task)
            _deliver(loop, done, None, e)
        else:
            _deliver(loop, done, result, None)
        del done
        if worker is not None and worker.dead:
            self._forget(worker)
            worker = None
        return worker

    def _start_worker(self) -> _Worker:
        with self._lock:  # close() kills every worker registered before it
            if self._closed:
                raise RewardWorkerError("the rubric is closed")
            worker = _Worker(self._functions)
            self._workers.add(worker)
        try:
            worker.wait_ready(START_TIMEOUT_S)
        except RewardWorkerError:
            self._forget(worker)
            raise
        return worker

    def _forget(self, worker: _Worker) -> None:
        worker.close()
        with self._lock:
            self._workers.discard(worker)


class _Worker:
    """One worker process and the controller's end of its socket."""

    def __init__(self, functions: dict[str, bytes]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.dead = False
        self.not_loaded: dict[str, str] = {}
        try:
            self.conn.send((list(sys.path), functions))
        except OSError:  # it exited at once: wait_ready reports it
            pass

    def wait_ready(self, timeout: float) -> None:
        """Wait until the worker has loaded its functions.

        Raises:
            RewardWorkerError: it exited or took longer than ``timeout`` seconds.
        """
        if not self.conn.poll(timeout):
            self.kill()
            raise RewardWorkerError(f"the reward worker process did not start in {timeout} s "
                                    "(importing its functions' modules, their prepare())")
        try:
            _, self.not_loaded = self.conn.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise RewardWorkerError(f"the reward worker process exited (code {code}) while "
                                    "starting; its error is above") from None

    def call(self, name: str, kwargs: dict[str, Any], timeout: float) -> float:
        """``name``'s value for ``kwargs``, run in the worker (raises as
        :meth:`ProcessPool.call`)."""
        if name in self.not_loaded:
            raise RewardWorkerError(
                f"{name!r} did not load in the reward worker process:\n{self.not_loaded[name]}")
        try:
            self.conn.send((name, kwargs))  # pickles first: a kwargs error leaves it usable
        except OSError:
            raise RewardWorkerError(self._died()) from None
        if not self.conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"took longer than {timeout} s; its worker process was killed")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise RewardWorkerError(self._died()) from None
        if status == "error":
            raise RewardWorkerError(f"raised in the reward worker process:\n{value}")
        return value

    def _died(self) -> str:
        return f"the reward worker process died during the call (exit code {self.kill()})"

    def kill(self) -> int | None:
        """SIGKILL the worker and reap it (from any thread); its exit code."""
        self.dead = True
        try:
            self.process.kill()
        except ProcessLookupError:
            pass
        return self.process.wait()

    def close(self) -> None:
        """:meth:`kill`, and close the socket: only from the thread that drives the worker
        (another thread closing it while that one polls could close a reused descriptor)."""
        self.kill()
        self.conn.close()


# ------------------------------------------------------------------ the worker process
def as_reward(value: Any) -> float:
    """``value`` as a finite float (what a reward function must return).

    Raises:
        TypeError: not a real number (a string, None, a list, a tensor of several values).
        ValueError: NaN or infinite.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"a reward must be a number, got {type(value).__name__} {value!r:.80}")
    if not isinstance(value, numbers.Real):  # a one-element tensor or numpy array
        item = getattr(value, "item", None)
        try:
            scalar = item() if callable(item) else None
        except (ValueError, RuntimeError):  # more than one element
            scalar = None
        if not isinstance(scalar, numbers.Real):
            raise TypeError(f"a reward must be a number, got {type(value).__name__} {value!r:.80}")
        value = scalar
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value}")
    return value


def _worker_main(fd: int, controller_pid: int) -> None:
    """A worker's life: load the functions the controller sends, then answer calls until its
    socket closes. Answers ``("ok", float)`` or ``("error", traceback text)``."""
    _end_with_controller(controller_pid)
    for signum in STOP_SIGNALS:  # the controller's to handle; it ends workers itself
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(fd)
    sys_path, functions = conn.recv()
    sys.path[:] = sys_path
    _defer_package_inits("forge_ext", "forge_ext.tasks")
    loaded, not_loaded = {}, {}
    for name, payload in functions.items():
        try:
            fn = pickle.loads(payload)
            prepare = getattr(fn, "prepare", None)
            if callable(prepare):
                prepare()
            loaded[name] = fn
        except BaseException:  # noqa: BLE001  (reported with each call of it)
            not_loaded[name] = traceback.format_exc().rstrip()
    conn.send(("ready", not_loaded))
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:  # the controller closed the pool or exited
            return
        try:
            value = loaded[name](**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            reply = ("ok", as_reward(value))
        except BaseException as e:  # noqa: BLE001  (the user's error goes back to the rubric)
            reply = ("error", "".join(traceback.format_exception(e)).rstrip())
        conn.send(reply)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _end_with_controller(controller_pid: int) -> None:
    """Have the kernel SIGKILL this process when the controller thread that started it ends
    (Linux ``prctl(PR_SET_PDEATHSIG)``): no Python code runs for that, so a worker stuck in a
    C call holding the GIL ends too. Elsewhere a worker ends at its next read of the closed
    socket."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != controller_pid:  # it ended before prctl took effect
        os._exit(1)


class _DeferredPackage(types.ModuleType):
    """A package imported without running its ``__init__``: its submodules import as usual,
    and the first other name asked of it (``from forge_ext.tasks import Row``) runs the
    ``__init__`` then."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or self.__dict__.get("_init_ran"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        if importlib.util.find_spec(f"{self.__name__}.{attr}") is not None:
            return importlib.import_module(f"{self.__name__}.{attr}")
        self.__dict__["_init_ran"] = True
        self.__spec__.loader.exec_module(self)
        return getattr(self, attr)


def _defer_package_inits(*names: str) -> None:
    """Register the packages ``names`` (parents first) as :class:`_DeferredPackage`: a
    worker that runs ``forge_ext.tasks.rewards.math_verify`` imports ``rewards.py`` and
    ``base.py``, not the torch and transformers that ``forge_ext``'s ``__init__`` files
    import (~2.5 s and ~260 MB per worker start)."""
    for name in names:
        parent, _, child = name.rpartition(".")
        path = sys.modules[parent].__path__ if parent else None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if name in sys.modules or spec is None or spec.submodule_search_locations is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__class__ = _DeferredPackage
        sys.modules[name] = module
        if parent:
            setattr(sys.modules[parent], child, module)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
