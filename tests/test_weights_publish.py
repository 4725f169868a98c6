"""Weight publishing through a real torchstore and real Monarch procs (issue 4).

Each test publishes tensors built from a seed and compares what ``fetch_weights`` returns
with the same tensors built independently in the test process."""

from __future__ import annotations

import os
import sys

import cloudpickle
import monarch.spmd
import pytest
import pytest_asyncio
import torch
import torchstore as ts
from monarch.actor import Actor, endpoint, this_host
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights import publish as weights_publish

pytestmark = pytest.mark.asyncio(loop_scope="module")

# pytest imports this file from tests/ via its own sys.path entry, which spawned Monarch procs
# do not have: ship this module's actor classes and helpers by value instead of by import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRANSPORTS = ["direct", "dcp"]
CHUNK_MB = 1  # small chunks so that tensors span chunk boundaries and a push has many puts


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


class WeightsReader(Actor):
    """A generator-side actor on its own proc."""

    @endpoint
    async def fetch(self, version: int, key_prefix: str) -> dict[str, torch.Tensor]:
        return await weights_fetch.fetch_weights(version, key_prefix=key_prefix)


class ShardedTrainer(Actor):
    """One rank of a 2-rank gloo trainer holding DTensor parameters."""

    def __init__(self) -> None:
        self.publishers: dict[str, weights_publish.WeightsPublisher] = {}  # by key_prefix

    @endpoint
    async def init_process_group(self) -> None:
        torch.distributed.init_process_group("gloo")

    @endpoint
    async def publish(
        self, version: int, transport: str, dcp_path: str, key_prefix: str, fail_on_rank: int = -1
    ) -> int | str:
        """Bytes this rank wrote, or the WeightsPublishError message."""
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
            config = weights_publish.WeightsConfig(
                transport=transport, dcp_path=dcp_path, key_prefix=key_prefix, chunk_mb=CHUNK_MB
            )
            self.publishers[key_prefix] = weights_publish.WeightsPublisher(config)

        def fail_here(stored_bytes: int, total_bytes: int) -> None:
            raise RuntimeError(f"injected failure on rank {fail_on_rank}")

        rank = torch.distributed.get_rank()
        hook = fail_here if rank == fail_on_rank else None
        try:
            result = await self.publishers[key_prefix].publish(state_dict, version, on_progress=hook)
        except weights_publish.WeightsPublishError as e:
            return str(e)
        return result.bytes_written


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reader(store):
    procs = this_host().spawn_procs(per_host={"procs": 1})
    yield procs.spawn("weights_reader", WeightsReader)
    await procs.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(store):
    procs = this_host().spawn_procs(per_host={"procs": 2})
    await monarch.spmd.setup_torch_elastic_env_async(procs)
    ranks = procs.spawn("sharded_trainer", ShardedTrainer)
    await ranks.init_process_group.call()
    yield ranks
    await procs.stop()


def make_publisher(transport: str, tmp_path, key_prefix: str, **overrides):
    config = weights_publish.WeightsConfig(
        transport=transport,
        dcp_path=str(tmp_path / "weights"),
        key_prefix=key_prefix,
        chunk_mb=CHUNK_MB,
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
    ],
)
async def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        weights_publish.WeightsConfig(**{field: value})


async def test_dcp_transport_requires_dcp_path():
    with pytest.raises(ValueError, match="weights.dcp_path must be set"):
        weights_publish.WeightsConfig(transport="dcp")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_reader_on_another_proc_gets_exactly_the_published_tensors(
    store, reader, tmp_path, transport
):
    prefix = f"round_trip_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(decoder_state_dict(), 5)
    assert_same_tensors(await reader.fetch.call_one(5, prefix), decoder_state_dict())


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_fetch_of_some_names_returns_only_those(store, tmp_path, transport):
    prefix = f"subset_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(decoder_state_dict(), 0)
    names = ["lm_head.weight", "model.position_ids"]
    got = await weights_fetch.fetch_weights(0, names, key_prefix=prefix)
    assert_same_tensors(got, {n: decoder_state_dict()[n] for n in names})


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
    with pytest.raises(weights_fetch.WeightsFetchError, match=r"policy_version=3.*weights/3"):
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
    chunks = [await ts.get(weights_fetch.chunk_key(prefix, 0, 0, i)) for i in range(count)]
    # Over Monarch RPC (no RDMA here) each chunk is an immutable bytes object: Monarch sends
    # it without the copies a tensor's storage takes (see weights.publish._pack_chunk).
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
    }
    prefix = f"strided_{transport}"
    await make_publisher(transport, tmp_path, prefix).publish(sd, 0)
    assert_same_tensors(await weights_fetch.fetch_weights(0, key_prefix=prefix), sd)


async def test_fetched_tensors_own_their_memory(store, tmp_path):
    # Chunks arrive as immutable bytes objects: a fetched tensor must be a copy of its bytes,
    # not a view into a chunk, so that the caller may write into it.
    prefix = "owned"
    await make_publisher("direct", tmp_path, prefix).publish(decoder_state_dict(), 0)
    first = await weights_fetch.fetch_weights(0, key_prefix=prefix)
    for name, tensor in first.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        tensor.zero_()
    again = await weights_fetch.fetch_weights(0, key_prefix=prefix)
    assert_same_tensors(again, decoder_state_dict())


@pytest.mark.parametrize("transport", TRANSPORTS)
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

    with pytest.raises(weights_publish.WeightsPublishError, match="policy_version=2"):
        await publisher.publish(decoder_state_dict(seed=2), 2, on_progress=fail_after_half)
    if transport == "direct":
        assert len(calls) >= 2  # the failure came after some chunks were stored

    assert_same_tensors(
        await weights_fetch.fetch_weights(1, key_prefix=prefix), decoder_state_dict(seed=1)
    )
    with pytest.raises(weights_fetch.WeightsVersionNotFoundError, match="committed versions: \\[1\\]"):
        await weights_fetch.fetch_weights(2, key_prefix=prefix)
    assert await weights_fetch.committed_versions(key_prefix=prefix) == [1]
    client = await ts.client()
    assert await client.keys(f"{prefix}.v2") == []  # the partial push was cleaned up
    assert not os.path.exists(tmp_path / "weights" / "2")

    # The publisher is still usable: the next version goes through.
    await publisher.publish(decoder_state_dict(seed=3), 3)
    assert await weights_fetch.committed_versions(key_prefix=prefix) == [1, 3]


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

    publisher = make_publisher(transport, tmp_path, prefix, keep_versions=2)
    for version in (1, 2, 3):
        await publisher.publish(decoder_state_dict(seed=version), version)

    assert await weights_fetch.committed_versions(key_prefix=prefix) == [2, 3]
    assert publisher.published_versions == [2, 3]
    with pytest.raises(weights_fetch.WeightsVersionNotFoundError):
        await weights_fetch.fetch_weights(1, key_prefix=prefix)
    assert_same_tensors(
        await weights_fetch.fetch_weights(2, key_prefix=prefix), decoder_state_dict(seed=2)
    )
    client = await ts.client()
    assert await client.keys(f"{prefix}.v1") == [f"{prefix}.v1.notes"]
    assert (sibling / "keep.txt").exists() and (lookalike / "keep.txt").exists()
    if transport == "dcp":
        assert sorted(os.listdir(dcp_path)) == ["1-notes", "2", "3"]


async def test_a_restarted_dcp_publisher_replaces_only_the_folders_its_run_left(
    store, tmp_path
):
    # A trainer that crashed and resumes from its checkpoint publishes that version again,
    # into a new store (the old one went with the old processes) and the same dcp_path.
    prefix, weights_dir = "restarted", str(tmp_path / "weights")

    def publisher(run_id, store_name, key_prefix=prefix):
        config = weights_publish.WeightsConfig(
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
            with pytest.raises(weights_publish.WeightsPublishError, match="3 already exists"):
                await other.publish(decoder_state_dict(), 3)
        (tmp_path / "weights" / "4").mkdir()
        with pytest.raises(weights_publish.WeightsPublishError, match="4 already exists"):
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
    with pytest.raises(weights_publish.WeightsPublishError, match=message):
        await publisher.publish(state_dict, 0)
    assert await weights_fetch.committed_versions(key_prefix="bad_input") == []


async def test_publishing_a_version_twice_is_rejected(store, tmp_path):
    publisher = make_publisher("direct", tmp_path, "twice")
    await publisher.publish(decoder_state_dict(), 4)
    with pytest.raises(weights_publish.WeightsPublishError, match="must be greater than"):
        await publisher.publish(decoder_state_dict(), 4)
    other = make_publisher("direct", tmp_path, "twice")
    with pytest.raises(weights_publish.WeightsPublishError, match="already committed"):
        await other.publish(decoder_state_dict(), 4)
    assert await weights_fetch.committed_versions(key_prefix="twice") == [4]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_two_ranks_publishing_dtensor_shards_give_the_full_tensors(
    store, trainer, reader, tmp_path, transport
):
    prefix = f"sharded_{transport}"
    written = await trainer.publish.call(7, transport, str(tmp_path / "weights"), prefix)
    per_rank = [bytes_ for _, bytes_ in written.items()]
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
    assert await weights_fetch.committed_versions(key_prefix=prefix) == [1]
    assert await (await ts.client()).keys(f"{prefix}.v2") == []
    assert_same_tensors(
        await weights_fetch.fetch_weights(1, key_prefix=prefix), sharded_state_dict()
    )
