"""Make torchstore 0.1.2 usable with torchmonarch 0.7.0.

Why: torchstore 0.1.2 was written for torchmonarch 0.1.x. Its ``Controller`` actor declares
``init`` and ``teardown`` as ``async def`` endpoints but ``get_controller_strategy``, ``keys``,
``locate_volumes``, ``notify_delete`` and ``notify_put`` as plain ``def`` endpoints. Since
torchmonarch 0.2.0 an actor class may not mix the two (they can deadlock the actor's asyncio
loop), and ``torchstore.initialize()`` fails with ``ValueError: <class
'torchstore.controller.Controller'> mixes both async and sync endpoints``. Monarch checks this
in every process that spawns the class *or unpickles a handle to it* (``ActorMesh.__init__``
calls ``_actor_kind``), so the fix must be in place in each process that touches torchstore.

The fix re-declares those five endpoints as ``async def`` wrappers around the original
bodies (none of them awaits anything, so running them on the actor's loop is safe).
``apply()`` is idempotent and also registers itself as a Monarch proc start-up function, so
every proc mesh spawned after it (torchstore's storage volumes, trainer and reader procs)
applies it before any actor there runs. Remove this module once torchstore is released for
torchmonarch >= 0.2.

A second, performance fix: torchstore 0.1.2's ``LocalClient.put`` sends the index update to the
controller as ``request.meta_only()``, which drops a tensor's data but keeps a non-tensor
value (``Request.objects``). A ``ts.put`` of an object (``bytes``, a dict, ...) therefore
sends its whole payload twice over Monarch RPC, once to the storage volume and once to the
controller, which only reads ``is_object`` and ``tensor_slice`` from it
(``Controller.notify_put``). ``apply()`` replaces ``put`` with the same steps minus that echo;
on the project's CPU host a 16 MB ``bytes`` put goes from ~1.4 to ~2.3 GiB/s.

A third, also for speed: ``TorchStoreStrategy.get_storage_volume`` slices the storage-volume
mesh anew on every put, get and delete (``ActorMesh.slice``: a new ``ActorMesh`` whose
constructor walks the actor class's endpoints, and a new native region). ``apply()`` caches
the slice per strategy and volume id for as long as the strategy's mesh is the same object;
measured here, a small ``ts.put`` 3.5-4.3 -> 2.4-2.6 ms and a ``ts.delete`` 4.7-5.5 ->
3.3-3.6 ms, which is most of what a same-host weight publish waits for besides its copy.

A fourth, for runs that lose or stop a reader mid-call (a generator replica stopped or killed
during a weight fetch): the reply to it is undeliverable and Monarch returns it to the actor
that sent it, whose default is to fail. The actors that answer torchstore's callers are
singletons of the process: torchstore's ``Controller`` (``get_or_spawn_controller``), Monarch's
``_ControllerController`` that hands it out, and the ``StorageVolume``. Once one has failed,
every later ``ts`` call of the process fails (``Failure on TorchStore: MeshFailure ...
undeliverable message for TorchStore.locate_volumes()``; in a CI session of 2026-12-03,
every test after one run's stop that used torchstore). A returned reply never reaches the actor's
``_handle_undeliverable_message`` (measured: not called); Monarch's reply port has
``return_undeliverable`` for it, and ``apply()`` sets it False on the reply ports of those
three actors' endpoints (in ``monarch._src.actor.actor_mesh._Actor._prepare``, private, 0.7.0):
a reply to a caller that has gone is dropped, nothing else waits on it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

from monarch._src.actor.actor_mesh import _Actor as _MonarchActor
from monarch._src.actor.proc_mesh import _ControllerController
from monarch.actor import endpoint

import torchstore
from torchstore.client import LocalClient
from torchstore.controller import Controller
from torchstore.logging import LatencyTracker
from torchstore.storage_volume import StorageVolume
from torchstore.strategy import TorchStoreStrategy
from torchstore.transport import Pipe, Request

from forge_ext.compat import torchstore_rdma

# The sync endpoints of torchstore 0.1.2's Controller (see torchstore/controller.py).
SYNC_ENDPOINTS: tuple[str, ...] = (
    "get_controller_strategy",
    "keys",
    "locate_volumes",
    "notify_delete",
    "notify_put",
)

_PATCHED_MARKER = "_forge_ext_async_endpoints"

# The actors that answer torchstore's callers (the module docstring's fourth fix).
REPLYING_ACTORS: tuple[type, ...] = (Controller, StorageVolume, _ControllerController)
_monarch_prepare = _MonarchActor._prepare
_is_replying: dict[type, bool] = {}


def _as_async(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    return wrapper


def index_update(request: Request) -> Request:
    """What the controller needs to index a put: ``request`` without any payload (neither
    tensor data nor a non-tensor value)."""
    meta = request.meta_only()
    meta.objects = None
    return meta


async def _put(self: LocalClient, key: str, value: Any) -> None:
    # torchstore 0.1.2 LocalClient.put, except that the controller gets index_update(request)
    # instead of request.meta_only() (see the module docstring).
    latency_tracker = LatencyTracker(f"put:{key}")
    request = Request.from_any(value)
    storage_volume, volume_id = self.strategy.select_storage_volume()
    await Pipe(storage_volume).put_to_storage_volume(key, request)
    latency_tracker.track_step("put_to_storage_volume")
    await self._controller.notify_put.call(key, index_update(request), volume_id)
    latency_tracker.track_step("notify_put")
    latency_tracker.track_e2e()


def _prepare_dropping_returns(self: Any, *args: Any) -> Any:
    # Monarch's _Actor._prepare (the steps before an endpoint's body; it returns the body's
    # arguments and its reply port), with the reply port of REPLYING_ACTORS set not to return
    # an undeliverable reply (the module docstring's fourth fix).
    # Runs for every message of every actor: the class test is made once per actor class.
    prepared = _monarch_prepare(self, *args)
    if prepared is not None:
        cls = type(self.instance)
        replying = _is_replying.get(cls)
        if replying is None:
            replying = _is_replying[cls] = issubclass(cls, REPLYING_ACTORS)
        if replying:
            prepared[2].return_undeliverable = False
    return prepared


_uncached_get_storage_volume = TorchStoreStrategy.get_storage_volume
# strategy -> (its storage_volumes mesh when the slices were made, {volume_id: slice})
_volume_slices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _get_storage_volume(self: TorchStoreStrategy, volume_id: str) -> Any:
    # torchstore 0.1.2 TorchStoreStrategy.get_storage_volume, made once per volume id (see
    # the module docstring); a strategy given new volumes (set_storage_volumes) slices anew.
    mesh, slices = _volume_slices.get(self, (None, {}))
    if mesh is not self.storage_volumes:
        mesh, slices = self.storage_volumes, {}
        _volume_slices[self] = (mesh, slices)
    if volume_id not in slices:
        slices[volume_id] = _uncached_get_storage_volume(self, volume_id)
    return slices[volume_id]


def _startup_callable() -> Callable[[], None]:
    # Monarch pickles the returned callable by reference and calls it in each new proc.
    return apply


def apply() -> None:
    """Turn the Controller's sync endpoints into async ones, stop object puts from
    echoing their payload to the controller, reuse storage-volume slices, let the actors that
    answer the store's callers drop a reply to one that has gone, and install the
    RDMA switch of :mod:`forge_ext.compat.torchstore_rdma`, in this process and in every
    Monarch proc spawned afterwards. Idempotent. Must run before ``torchstore.initialize()``
    and before a process unpickles a torchstore Controller handle."""
    if not getattr(Controller, _PATCHED_MARKER, False):
        for name in SYNC_ENDPOINTS:
            prop = Controller.__dict__[name]
            setattr(Controller, name, endpoint(_as_async(prop._method)))
        setattr(Controller, _PATCHED_MARKER, True)
    LocalClient.put = _put
    if _MonarchActor._prepare is _monarch_prepare:
        _MonarchActor._prepare = _prepare_dropping_returns
    if TorchStoreStrategy.get_storage_volume is _uncached_get_storage_volume:
        TorchStoreStrategy.get_storage_volume = _get_storage_volume
    torchstore_rdma.apply()
    _register_startup_function()


def _register_startup_function() -> None:
    # Private Monarch API (monarch._src.actor.proc_mesh.SetupActor, 0.7.0); it is how Monarch
    # itself propagates mocks to new procs. Without it a spawned proc that never imports
    # forge_ext would reject torchstore's Controller on first use.
    from monarch._src.actor.proc_mesh import SetupActor

    if _startup_callable not in SetupActor._startup_functions:
        SetupActor.register_startup_function(_startup_callable)


async def initialize_store(**kwargs: Any) -> None:
    """``apply()`` then ``torchstore.initialize(**kwargs)`` (same arguments)."""
    apply()
    await torchstore.initialize(**kwargs)


class RunStore:
    """torchstore with its storage volume in a proc of the caller's own, stopped with the run.

    Given no mesh, ``torchstore.initialize()`` spawns a volume proc that nothing stops (it
    outlived every in-process run). :meth:`start` spawns one proc on this host for it;
    :meth:`stop` shuts torchstore down and stops that proc, except after a peer's process
    or host died:

    A dead peer may have been sent a reply by the volume (a push in flight). Monarch 0.7
    returns such a message to its sender after the 30 s delivery timeout; if the volume's proc
    is stopped by then, the return is undeliverable too and Monarch's client ends the whole
    calling process ("client received undeliverable message: crashing", status 1, nothing
    printed). So with ``peer_died`` the proc is kept (``self.procs``) to end with this
    process. (Since :func:`apply` turns ``return_undeliverable`` off on the volume's replies,
    the module docstring's fourth fix, such a reply is dropped rather than returned; the proc
    is still kept, which costs nothing after a failed run.)
    """

    def __init__(self, name: str = "torchstore"):
        self.name = name
        self.procs: Any = None

    async def start(self, **kwargs: Any) -> None:
        """Spawn the volume's proc and :func:`initialize_store` on it (``kwargs`` go to
        ``torchstore.initialize``, not ``mesh``)."""
        from monarch.actor import this_host

        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name=self.name)
        await initialize_store(mesh=self.procs, **kwargs)

    async def stop(self, *, peer_died: bool) -> None:
        """``torchstore.shutdown()``, then stop the volume's proc unless ``peer_died`` (a
        process or host of the run died: see the class docstring)."""
        try:
            await torchstore.shutdown()
        finally:
            if self.procs is not None and not peer_died:
                procs, self.procs = self.procs, None
                await procs.stop()
