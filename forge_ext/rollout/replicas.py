"""A run's generator replicas behind one router: what the rollout side calls to sample and to
take each policy version.

``generator.replicas: N`` engines (each a ``Generator`` actor in a process of its own, with its
own tensor parallelism) are spawned concurrently on the generator's hosts (``hosts.generator``:
hosts x procs_per_host = N; replica ``i`` on host ``i // per_host``). Every request goes through
:class:`forge_ext.rollout.router.Router`: least-loaded, sticky per session. A policy version
is loaded by every live replica at once (:meth:`GeneratorReplicas.update_weights`, one publish,
each replica reading the trainer's same-host slot or torchstore); the served version of the
set is the oldest a live replica serves, which is what the loop's sync gate and staleness
bound read.

A replica whose process dies costs only its requests in flight: they are sent to the others,
one warning line is printed, and ``generator/live_replicas`` drops; weight updates, the
served version and the metrics skip it from then on. Its death is learnt from whichever
comes first: a call to it failing with Monarch's ``SupervisionError`` (~2 s after a ``kill
-9`` on this machine, Monarch 0.7), or the run's failure watch reporting its proc
(:mod:`forge_ext.runtime.supervision`; also when no call is in flight). Only when none is left does
the run stop, with one error naming each (:class:`ReplicasLost`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from forge_ext.rollout.engines.base import (
    Completion,
    SamplingConfig,
    Scores,
    WeightUpdateMode,
    request_seeds,
)
from forge_ext.rollout.router import NoReplicaError, Router
from forge_ext.runtime.supervision import describe_death


class ReplicasLost(RuntimeError):
    """Every generator replica died; names each and why."""


@dataclass(slots=True)
class ReplicaLoss:
    replica: int
    name: str
    cause: str
    """What ended it, e.g. ``was killed by SIGKILL (signal 9)``."""
    hint: str = ""
    """Its likely cause (:func:`forge_ext.runtime.supervision.describe_exit`)."""


def replica_name(replica: int, replicas: int) -> str:
    """A replica's proc mesh and actor name: ``generator`` when it is the only one, else
    ``generator<i>`` (Monarch's failure reports carry it)."""
    return "generator" if replicas == 1 else f"generator{replica}"


class GeneratorReplicas:
    """The replicas of a run (module docstring).

    Args:
        handles: one :class:`forge_ext.rollout.generator.GeneratorHandle` per replica.
        max_new_tokens: the longest response (``generator.sampling.max_new_tokens``), for
            the router's load.
        is_dead: whether an error a replica's call raised means its process is gone
            (default: a Monarch ``SupervisionError`` or an ``ActorError`` wrapping one).
    """

    def __init__(self, handles: Sequence[Any], *, max_new_tokens: int,
                 is_dead: Callable[[BaseException], bool] | None = None) -> None:
        if not handles:
            raise ValueError("no generator replica to serve")
        self.handles = list(handles)
        self.router = Router(len(self.handles))
        self.max_new_tokens = max_new_tokens
        self.versions = [0] * len(self.handles)
        """The version each replica serves."""
        self.holding: list[int | None] = [None] * len(self.handles)
        """The version whose whole weights each replica holds, a delta's base (weights.delta)."""
        self.delta_refused = 0
        """Delta versions a replica did not load (another base, a failed checksum)."""
        self.losses: list[ReplicaLoss] = []
        self.retried = 0
        """Requests sent again because their replica died."""
        self._is_dead = is_dead or _is_supervision_error
        self._last_time = time.perf_counter()
        self._last_stats: dict[int, dict[str, float]] = {}

    @property
    def config(self):
        return self.handles[0].config

    @property
    def live(self) -> list[int]:
        return self.router.live

    @property
    def reader_base(self) -> int | None:
        """The version every live replica holds whole (the base of the trainer's next delta
        version, ``RLTrainer.push_weights(reader_base=...)``), None if they differ or one
        holds none (the next version is then full)."""
        held = {self.holding[r] for r in self.live}
        return held.pop() if len(held) == 1 else None

    # ---- requests --------------------------------------------------------------------------
    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, greedy: bool = False,
                     seed: int | None = None, session: Hashable | None = None,
                     sampling: SamplingConfig | None = None) -> list[Completion]:
        """One request (:meth:`forge_ext.rollout.generator.Generator.sample`) on the replica the
        router picks for ``session``; sent again to another replica if that one dies first.
        ``sampling`` overrides ``generator.sampling`` for this request (an evaluation set's
        temperature, top-p and length).

        Raises:
            ReplicasLost: no replica is left.
        """
        longest = sampling.max_new_tokens if sampling is not None else self.max_new_tokens
        cost = len(prompt_ids) + n * longest
        extra = () if sampling is None else (sampling,)
        while True:
            try:
                replica = self.router.route(session, cost)
            except NoReplicaError:
                raise self.all_lost() from None
            try:
                completions = await self.handles[replica].sample(list(prompt_ids), n, greedy,
                                                                 seed, *extra)
                for completion in completions:
                    completion.replica = replica
                return completions
            except Exception as error:  # noqa: BLE001  (a dead replica's request moves on)
                if not self._is_dead(error):
                    raise
                self.lose(replica, *death_of(error))
                self.retried += 1
            finally:
                self.router.done(replica, cost)

    async def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, *,
                       greedy: bool = False, seed: int | Sequence[int] | None = None
                       ) -> list[Completion]:
        """``n`` completions per prompt, prompt-major: one routed request per prompt, all at
        once, seeded by :func:`forge_ext.rollout.engines.base.request_seeds`."""
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        seeds = request_seeds(seed, len(prompts))
        results = await asyncio.gather(*(
            self.sample(p, n, greedy=greedy, seed=s) for p, s in zip(prompts, seeds)))
        return [c for completions in results for c in completions]

    async def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
                    replica: int) -> Scores | None:
        """Replica ``replica``'s teacher-forced log-probs of ``sequences`` and the version
        that scored them (:meth:`forge_ext.rollout.generator.Generator.score`); None when
        that replica is lost (now or before). Not routed: the caller names the replica whose
        side of the train-inference gap it measures (the one that sampled them)."""
        if not self.router.alive[replica]:
            return None
        try:
            return await self.handles[replica].score([(list(p), list(r)) for p, r in sequences])
        except Exception as error:  # noqa: BLE001  (a dead replica scores nothing)
            if not self._is_dead(error):
                raise
            self.lose(replica, *death_of(error))
            return None

    # ---- weights ---------------------------------------------------------------------------
    async def update_weights(self, policy_version: int,
                             mode: WeightUpdateMode | None = None) -> dict[str, float]:
        """Every live replica loads ``policy_version`` at once.

        Returns:
            The slowest replica's ``fetch_seconds``, ``load_seconds`` and
            ``paused_seconds`` (:meth:`forge_ext.rollout.generator.Generator.update_weights`).
        """
        live = self.live
        results = await asyncio.gather(
            *(self.handles[r].update_weights(policy_version, mode) for r in live),
            return_exceptions=True,
        )
        worst: dict[str, float] = {}
        for replica, result in zip(live, results):
            if isinstance(result, BaseException):
                if isinstance(result, Exception) and self._is_dead(result):
                    cause, hint = death_of(result)
                    self.lose(replica, f"{cause} during the update to v{policy_version}", hint)
                    continue
                raise result
            self.holding[replica] = result.get("holding")
            if result.get("delta_refused"):
                self.delta_refused += 1
                continue  # it serves the version it had
            self.versions[replica] = policy_version
            for key in ("fetch_seconds", "load_seconds", "paused_seconds"):
                worst[key] = max(worst.get(key, 0.0), result[key])
        if not self.live:
            raise self.all_lost()
        return {"policy_version": policy_version, **worst}

    async def load_adapter_folder(self, folder: str, policy_version: int) -> None:
        """Every live replica serves the PEFT adapter folder ``folder`` on its base weights
        as ``policy_version`` (:meth:`forge_ext.rollout.generator.Generator
        .load_adapter_folder`)."""
        await asyncio.gather(*(self.handles[r].load_adapter_folder(folder, policy_version)
                               for r in self.live))
        for r in self.live:
            self.versions[r] = policy_version

    async def get_policy_version(self) -> int:
        """The oldest version a live replica serves."""
        if not self.live:
            raise self.all_lost()
        return min(self.versions[r] for r in self.live)

    # ---- faults and metrics ----------------------------------------------------------------
    def lose(self, replica: int, cause: str, hint: str = "") -> None:
        """``replica`` died (a call to it failed that way, or Monarch reported its process):
        no request goes there again. The first time, one warning line says what ended it
        (``cause``, its likely cause ``hint``) while others are left; the last one's death is
        the run's error instead (:meth:`all_lost`)."""
        if not self.router.alive[replica]:
            return
        self.router.remove(replica)
        name = self.handles[replica].name
        stream = getattr(self.handles[replica], "stream", None)
        if stream is not None:  # its requests in flight fail now and go to the others
            from forge_ext.rollout.generator import ReplicaGone

            stream.close(ReplicaGone(f"generator replica {name} {cause}"))
        self.losses.append(ReplicaLoss(replica, name, cause, hint))
        left = len(self.live)
        if left:
            print(f"warning: generator replica {name} {cause}{': ' + hint if hint else ''}; "
                  f"its requests go to the {left} replica{'s' * (left != 1)} left",
                  file=sys.stderr, flush=True)

    def index(self, name: str) -> int:
        """The replica named ``name`` (:func:`replica_name`)."""
        return [h.name for h in self.handles].index(name)

    def all_lost(self) -> ReplicasLost:
        """The error of a run whose replicas all died: each one's name and cause."""
        lost = "; ".join(f"{x.name} {x.cause}" for x in self.losses)
        hints = "; ".join(dict.fromkeys(x.hint for x in self.losses if x.hint))
        return ReplicasLost(f"every generator replica died ({len(self.losses)} of "
                            f"{len(self.handles)}): {lost}" + (f" ({hints})" if hints else ""))

    async def step_metrics(self) -> dict[str, float]:
        """What the replicas did since the previous call (a training step): per live replica
        (``generator/<name>/...``) ``requests``, ``tokens_per_s``, ``idle_seconds`` (no
        request running), ``paused_seconds`` (requests held for an update),
        ``update_seconds``, ``resubmitted`` (samples an ``abort`` update cut), ``version``;
        and ``generator/live_replicas``, ``generator/resubmitted``,
        ``generator/retried_requests`` (sent again because their replica died),
        ``generator/delta_refused`` (delta versions not loaded, so far)."""
        live = self.live
        now = time.perf_counter()
        results = await asyncio.gather(*(self.handles[r].stats() for r in live),
                                       return_exceptions=True)
        seconds = max(now - self._last_time, 1e-9)
        self._last_time = now
        for replica, stats in zip(live, results):
            if isinstance(stats, Exception) and self._is_dead(stats):
                self.lose(replica, *death_of(stats))
        out = {"generator/live_replicas": float(len(self.live)),
               "generator/retried_requests": float(self.retried), "generator/resubmitted": 0.0,
               "generator/delta_refused": float(self.delta_refused)}
        for replica, stats in zip(live, results):
            if isinstance(stats, BaseException):
                continue  # died now (lost above), or an error the next request will show
            before = self._last_stats.get(replica, {})
            self._last_stats[replica] = stats
            delta = {k: v - before.get(k, 0.0) for k, v in stats.items()}
            name = self.handles[replica].name
            out.update({
                f"generator/{name}/requests": delta["requests"],
                f"generator/{name}/tokens_per_s": delta["tokens"] / seconds,
                f"generator/{name}/idle_seconds": max(seconds - delta["busy_seconds"], 0.0),
                f"generator/{name}/paused_seconds": delta["paused_seconds"],
                f"generator/{name}/update_seconds": delta["update_seconds"],
                f"generator/{name}/resubmitted": delta["resubmitted"],
                f"generator/{name}/version": stats["policy_version"],
            })
            out["generator/resubmitted"] += delta["resubmitted"]
        return out

    async def stop(self) -> None:
        """Stop every replica (their engines' processes too), concurrently."""
        await asyncio.gather(*(h.stop() for h in self.handles), return_exceptions=True)


def death_of(error: BaseException) -> tuple[str, str]:
    """``(cause, likely cause)`` of a replica whose call failed with ``error`` (a
    ``SupervisionError``, whose text is Monarch's report)."""
    first_line = (str(error).splitlines() or [""])[0]
    return describe_death(str(error)) or (f"failed ({type(error).__name__}: {first_line})", "")


def _is_supervision_error(error: BaseException) -> bool:
    """A Monarch error that says the actor's process is gone, or a request stream's
    :class:`forge_ext.rollout.generator.ReplicaGone`."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in ("SupervisionError", "ActorMeshStoppedError",
                                    "ReplicaGone"):
            return True
        error = error.__cause__ or error.__context__ or getattr(error, "exception", None)
    return False


async def spawn_replicas(
    config: Any, *, stop_token_ids: int | list[int], pad_token_id: int, key_prefix: str,
    hosts: int = 1, spawn_procs: Callable[[int, str], Any] | None = None,
    keep_base: bool = False,
) -> GeneratorReplicas:
    """Spawn ``config.replicas`` generator replicas concurrently (module docstring).

    Args:
        config: the ``generator:`` section (:class:`forge_ext.rollout.config
            .GeneratorConfig`).
        hosts: the generator's hosts; ``config.replicas`` must be a multiple.
        spawn_procs: ``(host index, name) -> one-proc mesh`` (e.g.
            :meth:`forge_ext.runtime.placement.Placement.spawn_replica_procs`); default: procs on
            this host.
        keep_base: every replica keeps each version whole as a delta's base
            (``weights.delta``; :class:`forge_ext.rollout.generator.Generator`).

    Raises:
        ValueError: from :meth:`GeneratorConfig.check_backend`, or replicas that do not
            split over the hosts, before anything is spawned.
    """
    from forge_ext.rollout.generator import spawn_generator

    config.check_backend()
    if config.replicas % hosts:
        raise ValueError(f"generator.replicas={config.replicas} do not split over "
                         f"hosts.generator.hosts={hosts}; make it a multiple")
    per_host = config.replicas // hosts
    names = [replica_name(r, config.replicas) for r in range(config.replicas)]

    def procs_for(replica: int):
        if spawn_procs is None:
            return None
        return lambda: spawn_procs(replica // per_host, names[replica])

    results = await asyncio.gather(*(
        spawn_generator(
            config, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
            key_prefix=key_prefix, name=names[r], spawn_procs=procs_for(r),
            replica=r % per_host, replicas_on_host=per_host, keep_base=keep_base,
        )
        for r in range(config.replicas)
    ), return_exceptions=True)
    handles = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(h.stop() for h in handles), return_exceptions=True)
        raise failed[0]
    return GeneratorReplicas(handles, max_new_tokens=config.sampling.max_new_tokens)
