"""Weight publishing through a real torchstore and real Monarch procs (issues 4 and 15).

Each test publishes tensors built from a seed and compares what ``fetch_weights`` returns
with the same tensors built independently in the test process. Transports: ``direct`` over
Monarch RPC (``same_host: off``), ``direct`` into same-host shared-memory slots
(``same_host``), ``direct`` over torchstore's RDMA branch through Monarch's TCP fallback
(``rdma``, see ``forge_ext.compat.torchstore_rdma``), and ``dcp``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import cloudpickle
import pytest
import pytest_asyncio
import torch
import torchstore as ts
from conftest import gloo_ranks, one_proc_actor
from monarch.actor import Actor, endpoint, this_host
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.compat import torchstore_rdma
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights import publish as weights_publish
from forge_ext.weights import shm_files
from forge_ext.weights import store as weights_store
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.errors import (
    WeightsFetchError, WeightsPublishError, WeightsVersionNotFoundError,
)
from forge_ext.weights.transports import slots

pytestmark = pytest.mark.asyncio(loop_scope="module")

# pytest imports this file from tests/ via its own sys.path entry, which spawned Monarch procs
# do not have: ship this module's actor classes and helpers by value instead of by import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Test name -> WeightsConfig (transport, same_host), and whether torchstore uses RDMA.
VARIANTS = {
    "direct": ("direct", "off", False),  # chunks over Monarch RPC: readers on other hosts
    "same_host": ("direct", "auto", False),  # shared-memory slots (every process here shares a host)
    "rdma": ("direct", "off", True),  # chunks over torchstore's RDMA branch (TCP fallback)
    "dcp": ("dcp", "auto", False),
}
TRANSPORTS = ["direct", "same_host", "dcp"]
WITH_RDMA = [*TRANSPORTS, "rdma"]
CHUNK_MB = 1  # small chunks so that tensors span chunk boundaries and a push has many puts


@pytest.fixture(autouse=True)
def rdma_in_this_process(request):
    """torchstore's RDMA branch in the test process for the ``rdma`` variant of a test."""
    params = getattr(request.node, "callspec", None)
    enabled = params is not None and params.params.get("transport") == "rdma"
    torchstore_rdma.use_tcp_fallback(enabled or None)
    yield
    torchstore_rdma.use_tcp_fallback(None)


def slot_files(pid: int, key_prefix: str) -> list[str]:
    """Names of the same-host slot files in /dev/shm that process ``pid`` made for
    ``key_prefix`` (only this test's own files: other jobs share /dev/shm)."""
    start = f"{shm_files.PREFIX}-weights.{key_prefix}-{pid}-"
    return sorted(f for f in os.listdir(shm_files.SHM_DIR) if f.startswith(start))


def decoder_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-style names and shapes of a tiny decoder, about 3 MB in float32."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = 128, 352, 1000
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        sd[p + "self_attn.k_proj.weight"] = torch.randn(hidden // 2, hidden, generator=g)
        sd[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        sd[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
    sd["model.rotary_emb.inv_freq"] = torch.rand(hidden // 2, generator=g, dtype=torch.float64)
    sd["model.position_ids"] = torch.arange(7)
    sd["lm_head.weight"] = torch.randn(vocab * 3, hidden, generator=g)  # > CHUNK_MB
    return sd


def sharded_state_dict(seed: int = 1) -> dict[str, torch.Tensor]:
    """Full tensors that the 2-rank test distributes (odd row counts: uneven shards)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(4097, 96, generator=g),  # Shard(0), 1.5 MB
        "model.layers.0.self_attn.o_proj.weight": torch.randn(33, 65, generator=g),  # Shard(1)
        "model.norm.weight": torch.randn(96, generator=g),  # Replicate
        "lm_head.bias": torch.randn(5, generator=g),  # plain tensor, same on both ranks
    }


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def versioned_state_dict(version: int) -> dict[str, torch.Tensor]:
    """~4 MB whose every element says which version and which element it is: any mix of two
    versions, within a tensor or across tensors, differs from every version."""
    return {
        "w": torch.arange(1 << 19, dtype=torch.float64).add_(version * 2.0**30),
        "b": torch.arange(1000, dtype=torch.int64) + version * 10**6,
    }


class WeightsReader(Actor):
    """A generator-side actor on its own proc."""

    def __init__(self) -> None:
        self.held = None  # an open_weights block entered by `hold`

    @endpoint
    async def fetch(
        self, version: int, key_prefix: str, rdma: bool = False
    ) -> dict[str, torch.Tensor]:
        torchstore_rdma.use_tcp_fallback(rdma or None)
        try:
            return await weights_fetch.fetch_weights(version, key_prefix=key_prefix)
        finally:
            torchstore_rdma.use_tcp_fallback(None)

    @endpoint
    async def hold(self, version: int, key_prefix: str) -> None:
        """Enter ``open_weights(version)`` and stay inside until :meth:`release`."""
        self.held = weights_fetch.open_weights(version, key_prefix=key_prefix)
        self.weights = await self.held.__aenter__()

    @endpoint
    async def release(self) -> dict[str, torch.Tensor]:
        """Copies of the held tensors as they are now, then leave the block."""
        tensors = {k: v.clone() for k, v in self.weights.tensors.items()}
        await self.held.__aexit__(None, None, None)
        self.held = self.weights = None
        return tensors

    @endpoint
    async def race(self, key_prefix: str, last: int, hold_s: float) -> dict[str, list]:
        """Read the newest version again and again, both ways (``fetch_weights``, then
        ``open_weights`` held for ``hold_s`` while the publisher goes on), until version
        ``last`` was read; returns the versions read each way and any that came back wrong."""
        copied, held, missing, wrong = [], [], 0, []
        while last not in held:
            version = await weights_fetch.latest_version(key_prefix=key_prefix)
            if version is None:
                await asyncio.sleep(0.001)
                continue
            want = versioned_state_dict(version)
            try:
                got = await weights_fetch.fetch_weights(version, key_prefix=key_prefix)
                ok = all(torch.equal(got[k], t) for k, t in want.items())
                (copied if ok else wrong).append(version)
                async with weights_fetch.open_weights(version, key_prefix=key_prefix) as weights:
                    await asyncio.sleep(hold_s)
                    ok = all(torch.equal(weights.tensors[k], t) for k, t in want.items())
                (held if ok else wrong).append(version)
            except WeightsVersionNotFoundError:
                missing += 1  # retired meanwhile: fine, the next one is newer
        return {"copied": copied, "held": held, "missing": [missing], "wrong": wrong}


class Publisher(Actor):
    """A trainer rank on its own proc, for the test that kills it mid-push."""

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def publish_and_stall(self, key_prefix: str, marker: str) -> None:
        """Publish version 1, then stall half-way through version 2 after touching
        ``marker``."""
        publisher = weights_publish.WeightsPublisher(
            WeightsConfig(key_prefix=key_prefix, keep_versions=1)
        )
        await publisher.publish(decoder_state_dict(seed=1), 1)

        def stall(stored_bytes: int, total_bytes: int) -> None:
            if stored_bytes >= total_bytes // 2:
                open(marker, "w").close()
                time.sleep(600)  # until killed

        await publisher.publish(decoder_state_dict(seed=2), 2, on_progress=stall)


class ShardedTrainer(Actor):
    """One rank of a 2-rank gloo trainer holding DTensor parameters."""

    def __init__(self) -> None:
        self.publishers: dict[str, weights_publish.WeightsPublisher] = {}  # by key_prefix

    @endpoint
    async def init_process_group(self) -> None:
        torch.distributed.init_process_group("gloo")

    @endpoint
    async def publish(
        self, version: int, variant: str, dcp_path: str, key_prefix: str, fail_on_rank: int = -1,
        rank1_host: str | None = None,
    ) -> dict[str, Any] | str:
        """``{"bytes": this rank wrote, "same_host"}``, or the WeightsPublishError message.
        ``rank1_host``: what rank 1 reports as its host (a group spanning two hosts)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        full = sharded_state_dict()
        placements = [Shard(0), Shard(1), Replicate()]
        state_dict = {
            name: distribute_tensor(tensor, mesh, [placement])
            for (name, tensor), placement in zip(full.items(), placements)
        }
        state_dict["lm_head.bias"] = full["lm_head.bias"]
        if key_prefix not in self.publishers:
            transport, same_host_, _ = VARIANTS[variant]
            config = WeightsConfig(
                transport=transport, dcp_path=dcp_path, key_prefix=key_prefix, chunk_mb=CHUNK_MB,
                same_host=same_host_,
            )
            self.publishers[key_prefix] = weights_publish.WeightsPublisher(config)

        def fail_here(stored_bytes: int, total_bytes: int) -> None:
            raise RuntimeError(f"injected failure on rank {fail_on_rank}")

        rank = torch.distributed.get_rank()
        hook = fail_here if rank == fail_on_rank else None
        real_host_id = slots.host_id
        if rank1_host is not None and rank == 1:
            slots.host_id = lambda: rank1_host
        try:
            result = await self.publishers[key_prefix].publish(state_dict, version, on_progress=hook)
        except WeightsPublishError as e:
            return str(e)
        finally:
            slots.host_id = real_host_id
        return {"bytes": result.bytes_written, "same_host": result.same_host}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reader(store):
    async with one_proc_actor("weights_reader", WeightsReader) as actor:
        yield actor


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(store):
    async with gloo_ranks("sharded_trainer", ShardedTrainer) as ranks:
        yield ranks


def make_publisher(variant: str, tmp_path, key_prefix: str, **overrides):
    """A publisher of one of :data:`VARIANTS` in the test process."""
    transport, same_host_, _ = VARIANTS[variant]
    config = WeightsConfig(
        transport=transport,
        dcp_path=str(tmp_path / "weights"),
        key_prefix=key_prefix,
        chunk_mb=CHUNK_MB,
        same_host=same_host_,
        **overrides,
    )
    return weights_publish.WeightsPublisher(config)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("transport", "foo", "weights.transport='foo' must be one of 'direct', 'dcp'"),
        ("keep_versions", 0, "weights.keep_versions=0 must be an int >= 1"),
        ("dtype", "int8", "weights.dtype='int8' must be None or a torch floating-point"),
        ("dtype", "bfloat", "weights.dtype='bfloat' must be None"),
        ("key_prefix", "policy.", "weights.key_prefix='policy.' must be non-empty"),
        ("chunk_mb", 0, "weights.chunk_mb=0 must be an int >= 1"),
        ("same_host", "on", "weights.same_host='on' must be one of 'auto', 'off'"),
        ("same_host", True, "weights.same_host=True must be one of 'auto', 'off'"),
        ("dtype", 5, "weights.dtype=5 must be None or a torch floating-point"),
        ("key_prefix", 123, "weights.key_prefix=123 must be non-empty"),
        ("dcp_path", 123, "weights.dcp_path=123 must be None or a path"),
    ],
)
async def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WeightsConfig(**{field: value})


async def test_same_host_off_read_by_yaml_as_false_means_off():
    assert WeightsConfig(same_host=False).same_host == "off"


async def test_a_torch_dtype_and_a_path_object_are_taken_from_python(tmp_path):
    config = WeightsConfig(dtype=torch.bfloat16, dcp_path=tmp_path)
    assert (config.dtype, config.torch_dtype, config.dcp_path) == (
        "bfloat16", torch.bfloat16, str(tmp_path)
    )


async def test_exclude_from_cast_as_one_str_is_refused(store, tmp_path):
    publisher = make_publisher("direct", tmp_path, "exclude_str", dtype="bfloat16")
    with pytest.raises(TypeError, match=r"pass a collection of names, e.g. \['inv_freq'\]"):
        await publisher.publish(decoder_state_dict(), 0, exclude_from_cast="inv_freq")


async def test_any_key_prefix_makes_valid_slot_file_names(store, tmp_path):
    """Slot files are named after weights.key_prefix: a long or non-ASCII prefix (fine for
    torchstore) must not exceed a file name's 255 bytes or leave ASCII."""
    prefix = "é" * 110 + "/sa"
    publisher = make_publisher("same_host", tmp_path, prefix)
    try:
        await publisher.publish(decoder_state_dict(), 0)
        names = [os.path.basename(s.path) for s in publisher._transport._ring.slots]
        assert names and all(n.isascii() and len(n.encode()) < 200 for n in names), names
        assert_same_tensors(
            await weights_fetch.fetch_weights(0, key_prefix=prefix), decoder_state_dict()
        )
    finally:
        publisher.close()
    assert slots.slot_tag("policy_weights") == "weights.policy_weights"


async def test_dcp_transport_requires_dcp_path():
    with pytest.raises(ValueError, match="weights.dcp_path must be set"):
        WeightsConfig(transport="dcp")


@pytest.mark.parametrize("transport", WITH_RDMA)
async def test_reader_on_another_proc_gets_exactly_the_published_tensors(
    store, reader, tmp_path, transport
):
    prefix = f"round_trip_{transport}"
    result = await make_publisher(transport, tmp_path, prefix).publish(decoder_state_dict(), 5)
    rdma = VARIANTS[transport][2]
    assert (result.rdma, result.same_host) == (rdma, transport == "same_host")
    assert_same_tensors(await reader.fetch.call_one(5, prefix, rdma), decoder_state_dict())
    client = await ts.client()
    if transport == "same_host":  # torchstore holds the commit record only
        assert await client.keys(f"{prefix}.v5") == [f"{prefix}.v5.commit"]
    if rdma:  # the chunks went through torchstore's RDMA branch: stored as uint8 tensors
        chunk = await ts.get(weights_store.chunk_key(prefix, 5, 0, 0))
        assert isinstance(chunk, torch.Tensor) and chunk.dtype == torch.uint8


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fetch_of_some_names_returns_only_those(store, tmp_path, transport):
    prefix = f"subset_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(decoder_state_dict(), 0)
    names = ["lm_head.weight", "model.position_ids"]
    got = await weights_fetch.fetch_weights(0, names, key_prefix=prefix)
    assert_same_tensors(got, {n: decoder_state_dict()[n] for n in names})


@pytest.mark.parametrize("transport", WITH_RDMA)
async def test_a_publisher_whose_tensors_change_publishes_each_version_as_given(
    store, tmp_path, transport
):
    """What a publisher keeps from one version to the next (same host: the slot layout, the
    commit record but for its version; every transport: the check that the pieces cover
    each tensor) must follow a change of names, shapes or dtypes: a resized vocabulary, a
    tensor more, a dtype changed, and back."""
    prefix = f"layout_change_{transport}"
    publisher = make_publisher(transport, tmp_path, prefix, keep_versions=1)  # 2 slots
    grown = decoder_state_dict(seed=2)
    grown["lm_head.weight"] = torch.randn(4000, 128)  # bigger than the first slot
    grown["model.norm.weight"] = torch.randn(128)
    recast = decoder_state_dict(seed=4)  # fits the second slot, laid out otherwise
    recast["model.rotary_emb.inv_freq"] = recast["model.rotary_emb.inv_freq"].float()
    # Only the order differs from the two before (one in each slot).
    reordered = dict(reversed(decoder_state_dict(seed=7).items()))
    versions = [
        decoder_state_dict(seed=1), grown, decoder_state_dict(seed=3), recast,
        decoder_state_dict(seed=5), decoder_state_dict(seed=6), reordered,
    ]
    try:
        for version, state_dict in enumerate(versions, start=1):
            await publisher.publish(state_dict, version)
            got = await weights_fetch.fetch_weights(version, key_prefix=prefix)
            assert list(got) == list(state_dict)  # in the order published
            assert_same_tensors(got, state_dict)
    finally:
        publisher.close()


async def test_a_damaged_dcp_folder_is_a_fetch_error(store, tmp_path):
    """DCP raises CheckpointException (a BaseException) from dcp.load: it must reach the
    caller as an Exception that names the version and the folder."""
    prefix = "damaged_dcp"
    await make_publisher("dcp", tmp_path, prefix).publish(decoder_state_dict(), 3)
    folder = tmp_path / "weights" / "3"
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            with open(folder / name, "r+b") as f:
                f.truncate(8)
    with pytest.raises(WeightsFetchError, match=r"policy_version=3.*weights/3"):
        await weights_fetch.fetch_weights(3, key_prefix=prefix)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_dtype_cast_skips_excluded_and_non_floating_tensors(store, tmp_path, transport):
    prefix = f"cast_{transport}"
    publisher = make_publisher(transport, tmp_path, prefix, dtype="bfloat16")
    excluded = {"model.rotary_emb.inv_freq", "model.layers.0.input_layernorm.weight"}
    await publisher.publish(decoder_state_dict(), 1, exclude_from_cast=excluded)
    want = {
        name: t if name in excluded or not t.is_floating_point() else t.to(torch.bfloat16)
        for name, t in decoder_state_dict().items()
    }
    assert want["model.rotary_emb.inv_freq"].dtype == torch.float64
    assert want["model.position_ids"].dtype == torch.int64
    assert_same_tensors(await weights_fetch.fetch_weights(1, key_prefix=prefix), want)


async def test_direct_chunks_tile_the_stream_and_go_as_bytes_over_rpc(store, tmp_path):
    prefix = "chunk_form"
    await make_publisher("direct", tmp_path, prefix).publish(decoder_state_dict(), 0)
    record = await weights_fetch.fetch_commit_record(
        0, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME
    )
    count = len(await (await ts.client()).keys(f"{prefix}.v0.r0"))
    chunks = [await ts.get(weights_store.chunk_key(prefix, 0, 0, i)) for i in range(count)]
    # Over Monarch RPC (no RDMA here) each chunk is an immutable bytes object: Monarch sends
    # it without the copies a tensor's storage takes (see weights.transports.direct.pack_chunk).
    assert all(isinstance(chunk, bytes) for chunk in chunks)
    assert all(len(chunk) == record["chunk_bytes"] for chunk in chunks[:-1])
    # The chunks concatenate to the stream: each tensor's bytes at its recorded offset.
    stream = b"".join(chunks)
    for name, tensor in decoder_state_dict().items():
        (piece,) = record["tensors"][name]["pieces"]
        offset, nbytes = piece[1], tensor.numel() * tensor.element_size()
        assert stream[offset : offset + nbytes] == tensor.numpy().tobytes(), name


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_strided_and_expanded_tensors_publish_exactly(store, tmp_path, transport):
    g = torch.Generator().manual_seed(4)
    sd = {
        "every_other_byte": torch.arange(40, dtype=torch.uint8)[::2],
        "column": torch.randn(64, 6, generator=g)[:, 1],
        "expanded": torch.randn(3, generator=g).expand(5, 3),
        "transposed_bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16).t(),
        "every_other_bool": (torch.randn(9, generator=g) > 0)[::2],
        "conjugate": torch.randn(6, dtype=torch.complex64, generator=g).conj(),
    }
    prefix = f"strided_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(sd, 0)
    assert_same_tensors(await weights_fetch.fetch_weights(0, key_prefix=prefix), sd)


@pytest.mark.parametrize("transport", ["direct", "same_host"])
async def test_fetched_tensors_own_their_memory(store, tmp_path, transport):
    # Chunks arrive as immutable bytes objects, same-host versions live in the publisher's
    # slot: a fetched tensor must be a copy of its bytes, not a view into a chunk or a slot,
    # so that the caller may write into it.
    prefix = f"owned_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(decoder_state_dict(), 0)
    first = await weights_fetch.fetch_weights(0, key_prefix=prefix)
    for name, tensor in first.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        tensor.zero_()
    again = await weights_fetch.fetch_weights(0, key_prefix=prefix)
    assert_same_tensors(again, decoder_state_dict())


@pytest.mark.parametrize("transport", WITH_RDMA)
async def test_push_failing_half_way_leaves_previous_version_and_hides_the_new_one(
    store, tmp_path, transport
):
    prefix = f"atomic_{transport}"
    publisher = make_publisher(transport, tmp_path, prefix)
    await publisher.publish(decoder_state_dict(seed=1), 1)

    calls = []

    def fail_after_half(stored_bytes: int, total_bytes: int) -> None:
        calls.append(stored_bytes)
        if stored_bytes >= total_bytes // 2:
            raise RuntimeError("injected failure")

    with pytest.raises(WeightsPublishError, match="policy_version=2"):
        await publisher.publish(decoder_state_dict(seed=2), 2, on_progress=fail_after_half)
    if transport != "dcp":
        assert len(calls) >= 2  # the failure came after some chunks (or tensors) were stored

    assert_same_tensors(
        await weights_fetch.fetch_weights(1, key_prefix=prefix), decoder_state_dict(seed=1)
    )
    with pytest.raises(WeightsVersionNotFoundError, match="committed versions: \\[1\\]"):
        await weights_fetch.fetch_weights(2, key_prefix=prefix)
    assert await weights_store.committed_versions(key_prefix=prefix) == [1]
    client = await ts.client()
    assert await client.keys(f"{prefix}.v2") == []  # the partial push was cleaned up
    assert not os.path.exists(tmp_path / "weights" / "2")

    # The publisher is still usable: the next version goes through.
    await publisher.publish(decoder_state_dict(seed=3), 3)
    assert await weights_store.committed_versions(key_prefix=prefix) == [1, 3]


async def keys_outside(prefix: str, versions: list[int]) -> list[str]:
    """torchstore keys under ``prefix`` that belong to none of ``versions``."""
    client = await ts.client()
    return sorted(
        key for key in await client.keys(prefix)
        if not any(key.startswith(f"{prefix}.v{v}.") for v in versions)
    )


@pytest.mark.parametrize("what", ["a failing", "a cancelled"])
@pytest.mark.parametrize("transport", ["direct", "same_host"])
async def test_a_commit_that_fails_or_is_cancelled_leaves_the_earlier_version(
    store, tmp_path, monkeypatch, transport, what
):
    """keep_versions=1: the commit of version 3 would retire version 2; when its put fails,
    or the publish is cancelled as the put starts (a caller's deadline, Ctrl-C), version 2
    stays readable, nothing of version 3 is left, and the publisher goes on retiring."""
    prefix = f"commit_{transport}_{what.split()[1]}"
    publisher = make_publisher(transport, tmp_path, prefix, keep_versions=1)
    for version in (1, 2):
        await publisher.publish(versioned_state_dict(version), version)
    real_put, task = ts.put, None

    async def put(key, value, **kwargs):
        if key == weights_store.commit_key(prefix, 3):
            if what == "a failing":
                raise RuntimeError("injected commit failure")
            task.cancel()
        return await real_put(key, value, **kwargs)

    monkeypatch.setattr(ts, "put", put)
    task = asyncio.ensure_future(publisher.publish(versioned_state_dict(3), 3))
    if what == "a failing":
        with pytest.raises(WeightsPublishError, match="injected commit failure"):
            await task
    else:
        with pytest.raises(asyncio.CancelledError):
            await task
    monkeypatch.setattr(ts, "put", real_put)

    assert await weights_store.committed_versions(key_prefix=prefix) == [2]
    assert publisher.published_versions == [2]
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(2)
    )
    assert await keys_outside(prefix, [2]) == []
    for version in (3, 4, 5):  # every slot is used again (same host)
        await publisher.publish(versioned_state_dict(version), version)
    assert await weights_store.committed_versions(key_prefix=prefix) == [5]
    assert await keys_outside(prefix, [5]) == []
    publisher.close()


class ReplyLost(ConnectionError):
    """The fault of a commit whose reply never came: the store holds the record."""


def lose_the_commit_reply(monkeypatch, client, prefix: str, version: int) -> list[str]:
    """The store client's put of ``version``'s commit record stores it, then raises (a
    timeout on the reply, a connection dropped after the write); returns the list of the
    keys whose reply was lost so far."""
    real_put, lost = client.put, []

    async def put(key, value, *args, **kwargs):
        result = await real_put(key, value, *args, **kwargs)
        if key == weights_store.commit_key(prefix, version):
            lost.append(key)
            raise ReplyLost(f"no reply to the put of {key}")
        return result

    monkeypatch.setattr(client, "put", put)
    return lost


@pytest.mark.parametrize("transport", WITH_RDMA)
async def test_a_commit_whose_reply_is_lost_is_reported_as_readers_see_it(
    store, tmp_path, monkeypatch, transport
):
    """Issue 26 (2): the commit record's put stores the record and then raises. What
    ``publish`` answers and what readers see agree: either the publish succeeded and the
    version reads back exactly, or it failed, the version is not visible, nothing of it is
    left and it can be published again."""
    prefix = f"lost_reply_{transport}"
    publisher = make_publisher(transport, tmp_path, prefix)
    await publisher.publish(versioned_state_dict(1), 1)
    client = await ts.client()
    lose_the_commit_reply(monkeypatch, client, prefix, 2)
    try:
        await publisher.publish(versioned_state_dict(2), 2)
        failed = False
    except WeightsPublishError:
        failed = True
    monkeypatch.undo()

    if failed:
        assert await weights_store.committed_versions(key_prefix=prefix) == [1]
        assert await client.keys(f"{prefix}.v2") == []
        await publisher.publish(versioned_state_dict(2), 2)  # may be published again
    assert await weights_store.committed_versions(key_prefix=prefix) == [1, 2]
    assert publisher.published_versions == [1, 2]
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(2)
    )
    # The publisher goes on publishing and retiring (keep_versions=2).
    await publisher.publish(versioned_state_dict(3), 3)
    assert await weights_store.committed_versions(key_prefix=prefix) == [2, 3]
    assert await keys_outside(prefix, [2, 3]) == []
    if transport == "dcp":
        assert sorted(os.listdir(tmp_path / "weights")) == ["2", "3"]
    publisher.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_commit_whose_outcome_cannot_be_checked_keeps_its_data_and_can_be_redone(
    store, tmp_path, monkeypatch, transport
):
    """The commit's reply is lost and the store cannot be asked whether the record is there:
    ``publish`` fails saying the outcome is unknown and deletes nothing a record may point
    at (readers of the stored record read the whole version); publishing the same version
    again replaces it."""
    prefix = f"unknown_commit_{transport}"
    publisher = make_publisher(transport, tmp_path, prefix)
    await publisher.publish(versioned_state_dict(1), 1)
    client = await ts.client()
    lost = lose_the_commit_reply(monkeypatch, client, prefix, 2)
    real_keys = client.keys

    async def keys(*args, **kwargs):  # unreachable from the lost reply on
        if lost:
            raise ConnectionError("store unreachable")
        return await real_keys(*args, **kwargs)

    monkeypatch.setattr(client, "keys", keys)
    with pytest.raises(WeightsPublishError, match="outcome is unknown"):
        await publisher.publish(versioned_state_dict(2), 2)
    monkeypatch.undo()

    assert await weights_store.committed_versions(key_prefix=prefix) == [1, 2]
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(2)
    )
    await publisher.publish(versioned_state_dict(12), 2)  # redone: the new data replace it
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(12)
    )
    await publisher.publish(versioned_state_dict(3), 3)
    assert await weights_store.committed_versions(key_prefix=prefix) == [2, 3]
    assert await keys_outside(prefix, [2, 3]) == []
    publisher.close()


async def test_a_publish_cancelled_while_its_chunks_are_put_leaves_none_of_them(
    store, tmp_path, monkeypatch
):
    """Chunk puts whose messages were sent land after a cancellation: the publish waits for
    them, then deletes them."""
    prefix = "cancel_chunks"
    publisher = make_publisher("direct", tmp_path, prefix)
    await publisher.publish(versioned_state_dict(1), 1)
    real_put, task, started = ts.put, None, []

    async def put(key, value, **kwargs):
        started.append(key)
        if len(started) == 3:  # chunks 0 and 1 are in flight
            task.cancel()
        return await real_put(key, value, **kwargs)

    monkeypatch.setattr(ts, "put", put)
    task = asyncio.ensure_future(publisher.publish(versioned_state_dict(2), 2))
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(ts, "put", real_put)
    assert len(started) >= 3
    await asyncio.sleep(0.5)  # time for puts that nobody waited for to land
    assert await keys_outside(prefix, [1]) == []
    assert await weights_store.committed_versions(key_prefix=prefix) == [1]
    await publisher.publish(versioned_state_dict(2), 2)
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(2)
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_retention_deletes_only_old_versions_this_publisher_created(
    store, tmp_path, transport
):
    prefix = f"retention_{transport}"
    dcp_path = tmp_path / "weights"
    # Look-alikes that a prefix-matching cleanup would delete: a sibling folder and a folder
    # inside dcp_path whose names start like version 1's, and a torchstore key under v1.
    sibling = tmp_path / "weights_backup" / "1"
    lookalike = dcp_path / "1-notes"
    for folder in (sibling, lookalike):
        folder.mkdir(parents=True)
        (folder / "keep.txt").write_text("not the publisher's")
    await ts.put(f"{prefix}.v1.notes", torch.ones(2))
    # Same host: look-alike slot files (this process's pid and the publisher's prefix with
    # another counter; a neighbouring prefix) and a neighbouring publisher's real slots.
    ns, pid = shm_files.pid_namespace(), os.getpid()
    lookalike_files = [
        os.path.join(shm_files.SHM_DIR, f"{shm_files.PREFIX}-weights.{prefix}-{pid}-999999-p{ns}"),
        os.path.join(shm_files.SHM_DIR, f"{shm_files.PREFIX}-weights.{prefix}x-{pid}-0-p{ns}"),
    ]
    neighbour = make_publisher(transport, tmp_path, f"{prefix}_neighbour")
    if transport == "same_host":
        for path in lookalike_files:
            with open(path, "wb") as f:
                f.write(b"not the publisher's")
        await neighbour.publish(decoder_state_dict(seed=9), 1)

    publisher = make_publisher(transport, tmp_path, prefix, keep_versions=2)
    for version in (1, 2, 3):
        await publisher.publish(decoder_state_dict(seed=version), version)

    assert await weights_store.committed_versions(key_prefix=prefix) == [2, 3]
    assert publisher.published_versions == [2, 3]
    with pytest.raises(WeightsVersionNotFoundError):
        await weights_fetch.fetch_weights(1, key_prefix=prefix)
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), decoder_state_dict(seed=2)
    )
    client = await ts.client()
    assert await client.keys(f"{prefix}.v1") == [f"{prefix}.v1.notes"]
    assert (sibling / "keep.txt").exists() and (lookalike / "keep.txt").exists()
    if transport == "dcp":
        assert sorted(os.listdir(dcp_path)) == ["1-notes", "2", "3"]
    if transport == "same_host":
        try:
            own = set(slot_files(pid, prefix)) - {os.path.basename(p) for p in lookalike_files}
            assert len(own) == 3  # keep_versions + 1 slots, reused from now on
            publisher.close()  # the publisher stops: its slots go, nothing else
            assert not own & set(os.listdir(shm_files.SHM_DIR))
            for path in lookalike_files:
                with open(path, "rb") as f:
                    assert f.read() == b"not the publisher's"
            assert_same_tensors(
                await weights_fetch.fetch_weights(1, key_prefix=f"{prefix}_neighbour"),
                decoder_state_dict(seed=9),
            )
        finally:
            neighbour.close()
            for path in lookalike_files:
                os.unlink(path)


async def test_a_restarted_dcp_publisher_replaces_only_the_folders_its_run_left(
    store, tmp_path
):
    # A trainer that crashed and resumes from its checkpoint publishes that version again,
    # into a new store (the old one went with the old processes) and the same dcp_path.
    prefix, weights_dir = "restarted", str(tmp_path / "weights")

    def publisher(run_id, store_name, key_prefix=prefix):
        config = WeightsConfig(
            transport="dcp", dcp_path=weights_dir, key_prefix=key_prefix, run_id=run_id
        )
        return weights_publish.WeightsPublisher(config, store_name=store_name)

    await publisher("run-a", DEFAULT_TORCHSTORE_NAME).publish(decoder_state_dict(seed=1), 3)
    restarted_store = "restarted_store"
    await initialize_store(store_name=restarted_store)
    try:
        # Not this run's folder: another run_id, no run_id, another key_prefix; nor a folder
        # without a marker.
        for other in (
            publisher("run-b", restarted_store), publisher(None, restarted_store),
            publisher("run-a", restarted_store, key_prefix="someone_else"),
        ):
            with pytest.raises(WeightsPublishError, match="3 already exists"):
                await other.publish(decoder_state_dict(), 3)
        (tmp_path / "weights" / "4").mkdir()
        with pytest.raises(WeightsPublishError, match="4 already exists"):
            await publisher("run-a", restarted_store).publish(decoder_state_dict(), 4)
        assert_same_tensors(  # the first run's version 3 is intact
            await weights_fetch.fetch_weights(3, key_prefix=prefix), decoder_state_dict(seed=1)
        )

        # The same run, restarted: its leftover folder is replaced.
        await publisher("run-a", restarted_store).publish(decoder_state_dict(seed=2), 3)
        got = await weights_fetch.fetch_weights(3, key_prefix=prefix, store_name=restarted_store)
        assert_same_tensors(got, decoder_state_dict(seed=2))
    finally:
        await ts.shutdown(restarted_store)


@pytest.mark.parametrize(
    ("state_dict", "message"),
    [
        ({}, "state_dict is empty"),
        ({"w": torch.empty(3, device="meta")}, r"state_dict\['w'\] is on the meta device"),
        ({"w": [1.0]}, r"state_dict\['w'\] is a list, not a tensor"),
    ],
)
async def test_bad_state_dicts_are_rejected_naming_the_tensor(store, tmp_path, state_dict, message):
    publisher = make_publisher("direct", tmp_path, "bad_input")
    with pytest.raises(WeightsPublishError, match=message):
        await publisher.publish(state_dict, 0)
    assert await weights_store.committed_versions(key_prefix="bad_input") == []


async def test_publishing_a_version_twice_is_rejected(store, tmp_path):
    publisher = make_publisher("direct", tmp_path, "twice")
    await publisher.publish(decoder_state_dict(), 4)
    with pytest.raises(WeightsPublishError, match="must be greater than"):
        await publisher.publish(decoder_state_dict(), 4)
    other = make_publisher("direct", tmp_path, "twice")
    with pytest.raises(WeightsPublishError, match="already committed"):
        await other.publish(decoder_state_dict(), 4)
    assert await weights_store.committed_versions(key_prefix="twice") == [4]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_ranks_publishing_dtensor_shards_give_the_full_tensors(
    store, trainer, reader, tmp_path, transport
):
    prefix = f"sharded_{transport}"
    written = await trainer.publish.call(7, transport, str(tmp_path / "weights"), prefix)
    per_rank = [result["bytes"] for result in written.values()]
    assert all(r["same_host"] == (transport == "same_host") for r in written.values())
    total = sum(t.numel() * t.element_size() for t in sharded_state_dict().values())
    # Each rank wrote its shards only: no rank gathered the whole model.
    assert all(b < 0.6 * total for b in per_rank), per_rank
    assert_same_tensors(await reader.fetch.call_one(7, prefix), sharded_state_dict())
    assert_same_tensors(
        await weights_fetch.fetch_weights(7, key_prefix=prefix), sharded_state_dict()
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_failure_on_one_rank_fails_the_push_on_every_rank(
    store, trainer, tmp_path, transport
):
    prefix = f"sharded_failure_{transport}"
    dcp_path = str(tmp_path / "weights")
    await trainer.publish.call(1, transport, dcp_path, prefix)
    outcomes = [o for _, o in (await trainer.publish.call(2, transport, dcp_path, prefix, 1)).items()]
    assert all(isinstance(o, str) and "failed on rank(s) {1:" in o for o in outcomes), outcomes
    assert await weights_store.committed_versions(key_prefix=prefix) == [1]
    assert await (await ts.client()).keys(f"{prefix}.v2") == []
    assert_same_tensors(
        await weights_fetch.fetch_weights(1, key_prefix=prefix), sharded_state_dict()
    )


async def test_a_group_spanning_hosts_publishes_through_torchstore(store, trainer, reader, tmp_path):
    """``same_host=auto`` with one rank on another host: the chunks go into torchstore,
    which any reader can fetch."""
    prefix = "two_hosts"
    written = await trainer.publish.call(1, "same_host", "", prefix, -1, "elsewhere/boot")
    assert [r["same_host"] for r in written.values()] == [False, False]
    assert len(await (await ts.client()).keys(f"{prefix}.v1")) > 1  # commit record + chunks
    assert_same_tensors(await reader.fetch.call_one(1, prefix), sharded_state_dict())


# ---- same host: slots, leases, leaks ------------------------------------------------------

async def test_a_reader_racing_a_publisher_over_20_versions_never_sees_a_torn_version(
    store, reader, tmp_path
):
    """Three slots (keep_versions=2), each overwritten every third version, while a reader
    on another proc reads the newest version over and over (and holds it for longer than the
    publisher takes for three versions)."""
    prefix = "race"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=2)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        await reader.race.call_one(prefix, 1, 0.0)  # the reader is up and has read version 1
        race = asyncio.ensure_future(reader.race.call_one(prefix, 20, 0.05))
        for version in range(2, 21):
            await publisher.publish(versioned_state_dict(version), version)
            await asyncio.sleep(0.002)
        result = await race
    finally:
        publisher.close()
    assert result["wrong"] == [], result
    # It read while the publisher went on, both ways.
    assert len(result["copied"]) >= 4 and len(result["held"]) >= 4, result


async def test_a_reader_holding_a_version_keeps_its_slot_from_being_overwritten(
    store, reader, tmp_path
):
    prefix = "held"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        await reader.hold.call_one(1, prefix)  # e.g. a generator loading version 1
        await publisher.publish(versioned_state_dict(2), 2)  # the other slot; retires 1
        third = asyncio.ensure_future(publisher.publish(versioned_state_dict(3), 3))
        await asyncio.sleep(1.0)
        assert not third.done(), "version 3 overwrote the slot a reader holds"
        assert_same_tensors(await reader.release.call_one(), versioned_state_dict(1))
        await third
        assert_same_tensors(
            await weights_fetch.fetch_weights(3, key_prefix=prefix), versioned_state_dict(3)
        )
    finally:
        publisher.close()


async def test_a_version_whose_slot_was_reused_reads_as_not_committed(
    store, tmp_path, monkeypatch
):
    """A reader that got the commit record just before the version was retired and its slot
    reused: the slot's stamp says so, and the reader reports the version missing."""
    prefix = "reused"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        stale = await weights_fetch.fetch_commit_record(
            1, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME
        )
        for version in (2, 3):  # 3 goes into version 1's slot
            await publisher.publish(versioned_state_dict(version), version)

        async def stale_record(version, **kwargs):
            return stale

        monkeypatch.setattr(weights_fetch, "fetch_commit_record", stale_record)
        for read in (weights_fetch.fetch_weights, weights_fetch.open_weights):
            with pytest.raises(WeightsVersionNotFoundError,
                               match=r"policy_version=1 .*committed versions: \[3\]"):
                result = read(1, key_prefix=prefix)
                if read is weights_fetch.open_weights:
                    async with result:
                        pass
                else:
                    await result
    finally:
        publisher.close()


async def test_a_reader_on_another_host_is_told_to_set_same_host_off(
    store, tmp_path, monkeypatch
):
    prefix = "other_host"
    publisher = make_publisher("same_host", tmp_path, prefix)
    try:
        await publisher.publish(decoder_state_dict(), 1)
        monkeypatch.setattr(slots, "host_id", lambda: "elsewhere/boot")
        with pytest.raises(WeightsFetchError,
                           match=r"policy_version=1 was published into shared memory on host "
                                 r".*set weights.same_host=off"):
            await weights_fetch.fetch_weights(1, key_prefix=prefix)
    finally:
        publisher.close()


async def test_too_little_shared_memory_is_refused_naming_the_fields_and_the_bytes(
    store, tmp_path, monkeypatch
):
    prefix = "no_room"
    usage = shm_files.shutil.disk_usage(shm_files.SHM_DIR)
    monkeypatch.setattr(
        shm_files.shutil, "disk_usage", lambda directory: usage._replace(free=1 << 20)
    )
    publisher = make_publisher("same_host", tmp_path, prefix)
    with pytest.raises(WeightsPublishError,
                       match=r"weights.transport=direct with weights.same_host=auto \(keeps "
                             r"weights.keep_versions \+ 1 = 3 copies.*\) needs [\d,]+ MiB in "
                             r"/dev/shm, which has 1 MiB free.*weights.same_host=off"):
        await publisher.publish(decoder_state_dict(), 1)
    assert slot_files(os.getpid(), prefix) == []
    assert await weights_store.committed_versions(key_prefix=prefix) == []


@pytest.mark.parametrize("transport", ["direct", "dcp"])
async def test_the_first_publish_of_any_transport_removes_slots_of_dead_publishers(
    store, tmp_path, transport
):
    """A trainer killed with kill -9 while publishing into slots, restarted with
    weights.same_host=off or dcp: its slots go at the first publish too."""
    done = await asyncio.create_subprocess_exec("true")
    await done.wait()  # its pid is now a dead process's
    orphan = os.path.join(
        shm_files.SHM_DIR,
        f"{shm_files.PREFIX}-weights.orphan-{done.pid}-0-p{shm_files.pid_namespace()}",
    )
    open(orphan, "wb").close()
    try:
        publisher = make_publisher(transport, tmp_path, f"orphan_{transport}")
        await publisher.publish(decoder_state_dict(), 0)
        assert not os.path.exists(orphan)
    finally:
        if os.path.exists(orphan):
            os.unlink(orphan)


async def test_a_killed_publisher_leaves_no_slot_once_the_next_one_starts(
    store, tmp_path, mesh_failures
):
    """SIGKILL half-way through a push (as an out-of-memory kill): no cleanup runs; the next
    publisher (a restarted trainer) removes the dead one's slots at its first publish."""
    prefix = "killed"
    marker = tmp_path / "half_way"
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        actor = procs.spawn("killed_publisher", Publisher)
        pid = await actor.pid.call_one()
        push = asyncio.ensure_future(actor.publish_and_stall.call_one(prefix, str(marker)))
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = slot_files(pid, prefix)
        assert len(left) == 2, left  # version 1's slot and the half-written one
        os.kill(pid, signal.SIGKILL)
        push.cancel()  # its failure takes Monarch ~10 s to report
    finally:
        await procs.stop()
    assert slot_files(pid, prefix) == left  # a killed process cleans nothing up
    restarted = make_publisher("same_host", tmp_path, prefix)
    try:
        await restarted.publish(decoder_state_dict(), 3)
        assert slot_files(pid, prefix) == []
        with pytest.raises(WeightsFetchError, match="its publisher stopped"):
            await weights_fetch.fetch_weights(1, key_prefix=prefix)  # committed, slot gone
    finally:
        restarted.close()


async def test_a_dcp_publish_that_runs_out_of_space_is_one_line_naming_the_folder(
    store, tmp_path, monkeypatch
):
    """Issue 26 (3), the DCP weights transport: ENOSPC part-way through ``dcp.save`` fails
    the publish with a one-line ``OutputWriteError`` (the app prints it) naming the folder
    and the free space; the version is absent and the next publish goes through."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from forge_ext.runtime import disk

    prefix = "dcp_full_disk"
    publisher = make_publisher("dcp", tmp_path, prefix)
    await publisher.publish(versioned_state_dict(1), 1)

    def write_item(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    with pytest.raises(WeightsPublishError) as raised:
        await publisher.publish(versioned_state_dict(2), 2)
    monkeypatch.undo()
    error = raised.value
    folder = str(tmp_path / "weights" / "2")
    assert disk.find_output_write_error(error) is error and error.path == folder
    assert "\n" not in str(error)
    assert f"writing the DCP weights to {folder} failed: ENOSPC" in str(error)
    assert " MiB free" in str(error)
    assert await weights_store.committed_versions(key_prefix=prefix) == [1]
    assert not os.path.exists(folder)
    await publisher.publish(versioned_state_dict(2), 2)
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), versioned_state_dict(2)
    )


@pytest.mark.parametrize("transport", WITH_RDMA)
async def test_a_lora_version_is_the_adapter_alone_with_its_config_through_every_transport(
    store, reader, tmp_path, transport
):
    """Issue 25: a LoRA policy version is its PEFT tensors and ``adapter_config.json``
    mapping (the publish ``metadata``), nothing else; the bytes written are the adapter's."""
    from conftest import random_adapter

    from forge_ext.engine import lora

    prefix = f"lora_{transport}"
    adapter = random_adapter(decoder_state_dict(), rank=4, targets=("q_proj", "up_proj"))
    config = lora.peft_adapter_config(4, 8.0, ["q_proj", "up_proj"])
    publisher = make_publisher(transport, tmp_path, prefix)
    result = await publisher.publish(adapter, 3, metadata={"adapter_config": config})
    assert result.bytes_written == sum(t.numel() * t.element_size() for t in adapter.values())
    rdma = VARIANTS[transport][2]
    assert_same_tensors(await reader.fetch.call_one(3, prefix, rdma), adapter)
    assert await weights_fetch.fetch_metadata(3, key_prefix=prefix) == {"adapter_config": config}
    async with weights_fetch.open_weights(3, key_prefix=prefix) as opened:
        assert opened.metadata == {"adapter_config": config}
        assert_same_tensors(opened.tensors, adapter)
    # A version published without metadata has none (not the previous version's).
    await publisher.publish(decoder_state_dict(), 4)
    assert await weights_fetch.fetch_metadata(4, key_prefix=prefix) == {}
    publisher.close()
