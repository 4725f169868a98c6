"""torchstore 0.1.2 works on torchmonarch 0.7.0 once forge_ext.compat.torchstore_monarch is
applied: a real store, a state-dict round trip, a reader on another proc, and shutdown."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import pytest_asyncio
import torch
import torchstore as ts
from monarch.actor import Actor, endpoint, this_host
from torchstore.controller import Controller

from forge_ext.compat import torchstore_monarch

pytestmark = pytest.mark.asyncio(loop_scope="module")

# pytest imports this file from tests/ via its own sys.path entry, which spawned Monarch procs
# do not have: ship this module's actor classes by value instead of by import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StoreReader(Actor):
    """Runs in a proc spawned after ``apply()``: checks the start-up hook patched it."""

    @endpoint
    async def controller_is_patched(self) -> bool:
        return all(
            getattr(Controller, name)._method.__code__.co_flags & 0x80  # CO_COROUTINE
            for name in torchstore_monarch.SYNC_ENDPOINTS
        )

    @endpoint
    async def get_state_dict(self, key: str) -> dict[str, torch.Tensor]:
        return await ts.get_state_dict(key)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store():
    await torchstore_monarch.initialize_store()
    yield
    await ts.shutdown()


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def _assert_exactly_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


async def test_apply_makes_every_controller_endpoint_async():
    torchstore_monarch.apply()
    torchstore_monarch.apply()  # idempotent: wrappers are not stacked
    for name in torchstore_monarch.SYNC_ENDPOINTS:
        wrapper = getattr(Controller, name)._method
        assert wrapper.__code__.co_flags & 0x80, name
        assert not getattr(wrapper.__wrapped__, "__wrapped__", None), name


async def test_state_dict_round_trip_is_exact(store):
    sd = _state_dict()
    await ts.put_state_dict(sd, "compat/round_trip")
    _assert_exactly_equal(await ts.get_state_dict("compat/round_trip"), sd)


async def test_reader_on_a_spawned_proc_gets_the_same_state_dict(store):
    sd = _state_dict()
    await ts.put_state_dict(sd, "compat/remote")
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        reader = procs.spawn("store_reader", StoreReader)
        assert await reader.controller_is_patched.call_one()
        _assert_exactly_equal(await reader.get_state_dict.call_one("compat/remote"), sd)
    finally:
        await procs.stop()


async def test_shutdown_then_initialize_gives_an_empty_store(store):
    await ts.put("compat/before_shutdown", torch.ones(3))
    await ts.shutdown()
    await torchstore_monarch.initialize_store()
    assert await ts.keys("compat/") == []
