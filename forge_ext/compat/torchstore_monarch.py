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
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from monarch.actor import endpoint

import torchstore
from torchstore.client import LocalClient
from torchstore.controller import Controller
from torchstore.logging import LatencyTracker
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


def _startup_callable() -> Callable[[], None]:
    # Monarch pickles the returned callable by reference and calls it in each new proc.
    return apply


def apply() -> None:
    """Turn the Controller's sync endpoints into async ones, stop object puts from
    echoing their payload to the controller, and install the RDMA switch of
    :mod:`forge_ext.compat.torchstore_rdma`, in this process and in every Monarch proc
    spawned afterwards. Idempotent. Must run before ``torchstore.initialize()``
    and before a process unpickles a torchstore Controller handle."""
    if not getattr(Controller, _PATCHED_MARKER, False):
        for name in SYNC_ENDPOINTS:
            prop = Controller.__dict__[name]
            setattr(Controller, name, endpoint(_as_async(prop._method)))
        setattr(Controller, _PATCHED_MARKER, True)
    LocalClient.put = _put
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
