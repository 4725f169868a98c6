"""``weights.delta`` (issue 48): delta versions through a real torchstore, a 2-rank gloo
trainer holding DTensor shards and a reader on its own proc.

The reference is the trainer's own tensors, rebuilt in the test process from the same seeds
and cast to the published dtype: after every version the reader's tensors must equal them bit
for bit, whatever mix of anchors and deltas carried them, and each fault (a lost or corrupted
delta, a reader restarted, a delta applied twice, a publisher resumed) must be refused or
detected, then healed by a full version."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import cloudpickle
import pytest
import pytest_asyncio
import torch
import torchstore as ts
from conftest import gloo_ranks, one_proc_actor
from monarch.actor import Actor, endpoint, this_host
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.rollout.config import GeneratorConfig
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.generator import Generator
from forge_ext.weights import delta as codec
from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights import publish as weights_publish
from forge_ext.weights import store as weights_store
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.errors import (
    WeightsChecksumError, WeightsDeltaBaseError, WeightsVersionNotFoundError,
)

module_loop = pytest.mark.asyncio(loop_scope="module")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHUNK_MB = 1
ANCHOR_EVERY = 4


def master(version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights at ``version``: a seeded start, then per version a small
    update of a seeded fraction of the elements (as an optimizer step at a small learning
    rate leaves most bf16 values unchanged)."""
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(4097, 96, generator=g),  # Shard(0), ~1.5 MB
        "model.layers.0.self_attn.o_proj.weight": torch.randn(33, 65, generator=g),  # Shard(1)
        "model.norm.weight": torch.randn(96, generator=g),  # Replicate
        "lm_head.bias": torch.randn(5, generator=g),  # plain tensor, rank 0 writes it
        "model.position_ids": torch.arange(7),  # not floating: never cast, never changes
    }
    for step in range(1, version + 1):
        g = torch.Generator().manual_seed(step)
        for tensor in weights.values():
            if tensor.is_floating_point():
                mask = torch.rand(tensor.shape, generator=g) < 0.02
                tensor.add_(mask * torch.randn(tensor.shape, generator=g) * 0.05)
    return weights


def published(version: int) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) if t.is_floating_point() else t
            for name, t in master(version).items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str):
    assert list(got) == list(want), what
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (what, name)
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), (what, name)


class DeltaTrainer(Actor):
    """One rank of a 2-rank gloo trainer publishing :func:`master` as DTensor shards."""

    def __init__(self) -> None:
        self.publishers: dict[str, weights_publish.WeightsPublisher] = {}

    @endpoint
    async def init_process_group(self) -> None:
        torch.distributed.init_process_group("gloo")

    @endpoint
    async def publish(self, version: int, key_prefix: str, reader_base: int | None,
                      new_publisher: bool = False, same_host: str = "off") -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        full = master(version)
        state_dict = {
            name: distribute_tensor(full[name], mesh, [placement]) for name, placement in zip(
                ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.norm.weight"], [Shard(0), Shard(1), Replicate()])
        }
        state_dict["lm_head.bias"] = full["lm_head.bias"]
        state_dict["model.position_ids"] = full["model.position_ids"]
        if new_publisher or key_prefix not in self.publishers:  # new_publisher: a resumed run
            if key_prefix in self.publishers:
                self.publishers[key_prefix].close()
            self.publishers[key_prefix] = weights_publish.WeightsPublisher(WeightsConfig(
                key_prefix=key_prefix, chunk_mb=CHUNK_MB, same_host=same_host, dtype="bfloat16",
                delta=True, delta_anchor_every=ANCHOR_EVERY, keep_versions=3,
            ))
        publisher = self.publishers[key_prefix]
        result = await publisher.publish(state_dict, version, reader_base=reader_base)
        snapshot = publisher._transport._snapshot
        local = sum(block.numel() * block.element_size() for block in snapshot.values())
        return {"bytes": result.bytes_written, "stats": result.delta, "snapshot_bytes": local}


class DeltaReader(Actor):
    """A generator-side reader on its own proc: keeps its tensors and the version they hold,
    applies deltas in place, and falls back to nothing held when a delta fails."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.holding: int | None = None

    @endpoint
    async def restart(self) -> None:
        self.tensors, self.holding = None, None

    @endpoint
    async def update(self, version: int, key_prefix: str) -> dict:
        """Fetch ``version``: ``{"holding", "tensors", "error"}`` after it."""
        error = None
        try:
            if self.tensors is None:
                self.tensors = await weights_fetch.fetch_weights(version, key_prefix=key_prefix)
            else:
                held = self.tensors
                await weights_fetch.fetch_weights(
                    version, key_prefix=key_prefix, holding=self.holding,
                    allocate=lambda specs: held,
                )
            self.holding = version
        except WeightsDeltaBaseError as e:  # not the base: the tensors are untouched
            error = type(e).__name__
        except WeightsVersionNotFoundError as e:  # a chunk lost: applied nothing
            error = type(e).__name__
        except WeightsChecksumError as e:  # applied, and wrong: hold nothing
            self.tensors, self.holding = None, None
            error = type(e).__name__
        return {"holding": self.holding, "tensors": self.tensors, "error": error}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(store):
    async with gloo_ranks("delta_trainer", DeltaTrainer) as ranks:
        yield ranks


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reader(store):
    async with one_proc_actor("delta_reader", DeltaReader) as actor:
        yield actor


async def publish(trainer, version, prefix, reader_base, **kwargs) -> list[dict]:
    if prefix.endswith("_auto"):  # anchors into the same-host slots, deltas in torchstore
        kwargs["same_host"] = "auto"
    return [r for _, r in (await trainer.publish.call(version, prefix, reader_base,
                                                      **kwargs)).items()]


def kinds(results: list[dict]) -> str:
    bases = {r["stats"].base_version for r in results}
    assert len(bases) == 1, results  # every rank published the same kind
    return "anchor" if bases == {None} else f"delta on {bases.pop()}"


SAME_HOST = pytest.mark.parametrize("same_host", ["off", "auto"])


async def transports(versions, prefix) -> list[str]:
    return [(await weights_fetch.fetch_commit_record(
        v, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME))["transport"] for v in versions]


@module_loop
@SAME_HOST
async def test_ten_versions_reach_the_reader_bitwise_as_full_versions_would(
    store, trainer, reader, same_host
):
    """Through torchstore chunks (``same_host: off``), or with the anchors in the same-host
    shared-memory slots and the deltas in torchstore (``auto``)."""
    prefix = f"delta_exact_{same_host}"
    await reader.restart.call_one()
    seen = []
    holding = None
    for version in range(10):
        results = await publish(trainer, version, prefix, holding)
        seen.append(kinds(results))
        got = await reader.update.call_one(version, prefix)
        assert got["error"] is None, (version, got["error"])
        assert_bitwise(got["tensors"], published(version), f"version {version}")
        holding = got["holding"]
        if results[0]["stats"].base_version is not None:
            sent = sum(r["bytes"] for r in results)
            full = sum(r["stats"].full_bytes for r in results)
            assert sent < 0.2 * full, (version, sent, full)  # ~2% of elements changed
    assert seen == ["anchor", *[f"delta on {v}" for v in range(3)], "anchor",
                    *[f"delta on {v}" for v in range(4, 7)], "anchor", "delta on 8"]
    anchor = "same_host" if same_host == "auto" else "direct"
    assert await transports([7, 8, 9], prefix) == ["delta", anchor, "delta"]
    # Each rank's snapshot of the base is its own shards, not the whole model.
    total = sum(t.numel() * t.element_size() for t in published(0).values())
    assert all(r["snapshot_bytes"] < 0.6 * total for r in results), results


@module_loop
@SAME_HOST
async def test_faults_are_refused_or_detected_and_a_full_version_heals_them(
    store, trainer, reader, same_host
):
    prefix = f"delta_faults_{same_host}"
    await reader.restart.call_one()

    state = {"holding": None}  # what the reader reported holding last

    async def step(version, expect_kind, **kwargs):
        """Publish ``version`` with the reader's version as the base."""
        results = await publish(trainer, version, prefix, state["holding"], **kwargs)
        assert kinds(results) == expect_kind, version

    async def read(version):
        got = await reader.update.call_one(version, prefix)
        state["holding"] = got["holding"]
        return got

    await step(0, expect_kind="anchor")
    assert (await read(0))["error"] is None
    await step(1, expect_kind="delta on 0")

    # A delta lost in transport (one chunk gone): nothing applied, the reader keeps version 0.
    await ts.delete(weights_store.chunk_key(prefix, 1, 0, 0))
    got = await read(1)
    assert got["error"] == "WeightsVersionNotFoundError" and got["holding"] == 0
    assert_bitwise(got["tensors"], published(0), "after a lost delta")
    # The publisher's base moved on to 1, the reader holds 0: an anchor heals it.
    await step(2, expect_kind="anchor")
    assert_bitwise((await read(2))["tensors"], published(2), "healed after a lost delta")

    # One flipped bit in a delta's values: the checksum catches it, the reader drops its
    # tensors, the next version is full.
    await step(3, expect_kind="delta on 2")
    key = weights_store.chunk_key(prefix, 3, 0, 0)
    chunk = bytearray(await ts.get(key))
    chunk[9] ^= 0x01  # in the first block's indices: a value lands on the wrong element
    await ts.put(key, bytes(chunk))
    got = await read(3)
    assert got["error"] == "WeightsChecksumError" and got["holding"] is None
    await step(4, expect_kind="anchor")
    assert_bitwise((await read(4))["tensors"], published(4), "healed after a flipped bit")

    # A delta applied twice: refused by version (its base is not what the reader holds).
    await step(5, expect_kind="delta on 4")
    assert (await read(5))["error"] is None
    got = await read(5)
    assert got["error"] == "WeightsDeltaBaseError" and got["holding"] == 5
    assert_bitwise(got["tensors"], published(5), "a delta read twice")

    # A replica restarted mid-run holds nothing: a delta is refused, an anchor heals.
    await step(6, expect_kind="delta on 5")
    await reader.restart.call_one()
    got = await read(6)
    assert got["error"] == "WeightsDeltaBaseError"
    await step(7, expect_kind="anchor")
    assert_bitwise((await read(7))["tensors"], published(7), "a restarted replica")

    # A resumed trainer (a new publisher: no snapshot) publishes full, whatever the reader holds.
    await step(8, expect_kind="anchor", new_publisher=True)
    assert_bitwise((await read(8))["tensors"], published(8), "after a resume")


class ServedGenerator(Generator):
    """The transformers generator as shipped, plus what its model serves."""

    @endpoint
    async def served(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.sampler.model.state_dict().items()}


async def spawn_hf_generator(checkpoint: str, key_prefix: str, name: str):
    """One transformers generator replica keeping a delta's base (as the GRPO app spawns it
    with ``weights.delta``), updated with ``weight_update: keep``."""
    config = GeneratorConfig(hf_path=checkpoint, backend="hf", weight_update="keep",
                             sampling=SamplingConfig(temperature=1.0, top_p=1.0,
                                                     max_new_tokens=4))
    procs = this_host().spawn_procs(per_host={"procs": 1}, name=name)
    actor = procs.spawn(name, ServedGenerator, dataclasses.asdict(config), [2], 0, key_prefix,
                        0, 1, True)
    await actor.setup.call_one(name)
    return actor, procs


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """2% of the elements moved a little, as an optimizer step at a small learning rate."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        mask = torch.rand(tensor.shape, generator=g) < 0.02
        out[name] = tensor + mask * torch.randn(tensor.shape, generator=g) * 0.05
    return out


def assert_serves(served: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], what: str):
    """The model holds ``weights`` as a full bf16 version of them loads: cast to bf16 (the
    published dtype), then to the model's fp32, bit for bit."""
    assert set(served) == set(weights), what
    for name, tensor in weights.items():
        want = tensor.to(torch.bfloat16).to(served[name].dtype)
        assert torch.equal(served[name].view(torch.uint8), want.view(torch.uint8)), (what, name)


@module_loop
@SAME_HOST
async def test_the_transformers_generator_serves_deltas_bitwise_as_full_versions(
    store, demo_checkpoint, same_host
):
    """``generator.backend: hf`` with ``weights.delta`` (anchors through torchstore, or the
    same-host slots), updated with ``weight_update: keep`` while a request is in flight: the
    model serves after every delta exactly what a full bf16 version of the same weights gives.
    A delta on another base is refused and a corrupted one detected, both leaving the model
    on the version it served (the delta is applied onto the engine's own buffer, and loaded
    only once its checksums match); a replica restarted mid-run refuses deltas and serves
    its checkpoint, saying so; a full version heals each."""
    prefix = f"delta_hf_{same_host}"
    generator, procs = await spawn_hf_generator(demo_checkpoint, prefix, f"delta_hf_{same_host}")
    publisher = weights_publish.WeightsPublisher(WeightsConfig(
        key_prefix=prefix, same_host=same_host, dtype="bfloat16", delta=True,
        delta_anchor_every=ANCHOR_EVERY, keep_versions=3))
    restarted = None
    try:
        weights = await generator.served.call_one()
        kinds, holding = [], None

        async def push(version, reader_base, to=generator):
            nonlocal weights
            weights = perturbed(weights, version)
            result = await publisher.publish(weights, version, reader_base=reader_base)
            kinds.append(result.delta.base_version)
            request = asyncio.ensure_future(to.sample.call_one([5, 6, 7], 4, False, version))
            info = await to.update_weights.call_one(version, "keep")
            await request  # the request in flight went on and ended
            return info

        for version in range(1, 5):
            info = await push(version, holding)
            assert (info["delta_refused"], info["holding"]) == (0, version), info
            holding = version
            assert_serves(await generator.served.call_one(), weights, f"version {version}")
        assert kinds == [None, 1, 2, 3]

        # A delta on a version the generator does not hold: refused before anything is read.
        served = dict(weights)
        await publisher.publish(perturbed(weights, 50), 5, reader_base=4)
        info = await push(6, 5)
        assert (info["delta_refused"], info["holding"], info["policy_version"]) == (1, 4, 4)
        assert_serves(await generator.served.call_one(), served, "a delta on another base")
        info = await push(7, 4)  # the publisher's base is 6: full
        assert kinds[-1] is None and info["holding"] == 7
        assert_serves(await generator.served.call_one(), weights, "healed")

        # One flipped bit in a delta: detected; the model keeps serving version 7.
        served = dict(weights)
        weights_next = perturbed(weights, 8)
        await publisher.publish(weights_next, 8, reader_base=7)
        key = weights_store.chunk_key(prefix, 8, 0, 0)
        chunk = bytearray(await ts.get(key))
        chunk[9] ^= 0x01
        await ts.put(key, bytes(chunk))
        info = await generator.update_weights.call_one(8, "keep")
        assert (info["delta_refused"], info["holding"], info["policy_version"]) == (1, None, 7)
        assert_serves(await generator.served.call_one(), served, "a corrupted delta")
        weights = weights_next
        info = await push(9, None)
        assert kinds[-1] is None and info["holding"] == 9
        assert_serves(await generator.served.call_one(), weights, "healed after a flipped bit")

        if same_host == "auto":  # a replica restarted mid-run (once: a spawn costs seconds)
            restarted, restarted_procs = await spawn_hf_generator(
                demo_checkpoint, prefix, "delta_hf_restarted")
            info = await push(10, 9, to=restarted)
            assert kinds[-1] == 9
            assert (info["delta_refused"], info["holding"], info["policy_version"]) == (
                1, None, 0)  # its checkpoint, as version 0: the staleness gate sees it
            info = await push(11, None, to=restarted)
            assert kinds[-1] is None and info["holding"] == 11
            assert_serves(await restarted.served.call_one(), weights, "a restarted replica")
    finally:
        publisher.close()
        if restarted is not None:
            await restarted_procs.stop()
        await procs.stop()


@module_loop
async def test_a_version_with_other_tensors_is_an_anchor(store):
    """A delta needs the snapshot's names, dtypes and shapes: a version that adds a tensor
    (or changes one's shape) is published full, and reads back whole."""
    publisher = weights_publish.WeightsPublisher(WeightsConfig(
        key_prefix="delta_names", same_host="off", delta=True))
    first = {"a": torch.arange(10.0)}
    await publisher.publish(first, 0)
    grown = {"a": torch.arange(10.0), "b": torch.ones(3)}
    result = await publisher.publish(grown, 1, reader_base=0)
    assert result.delta.base_version is None
    assert_bitwise(await weights_fetch.fetch_weights(1, key_prefix="delta_names"), grown, "v1")
    result = await publisher.publish({"a": torch.arange(10.0) + 1, "b": torch.ones(3)}, 2,
                                     reader_base=1)
    assert result.delta.base_version == 1
    publisher.close()


@module_loop
async def test_tied_names_are_encoded_once_and_stay_exact_when_untied(store, monkeypatch):
    """A tied embedding and LM head (one tensor under two names, as Qwen3-0.6B publishes it)
    share one snapshot and one encoding; when a later version unties them, each gets its own
    snapshot and every version still reads back bitwise."""
    blocks_encoded = []
    encode_blocks = codec.encode_blocks

    def counting(pairs):
        blocks_encoded.append(len(pairs))
        encoded.append(encode_blocks(pairs))
        return encoded[-1]

    encoded = []

    monkeypatch.setattr(codec, "encode_blocks", counting)
    publisher = weights_publish.WeightsPublisher(WeightsConfig(
        key_prefix="delta_tied", same_host="off", delta=True, dtype="bfloat16"))
    g = torch.Generator().manual_seed(2)
    embed, norm = torch.randn(300, 8, generator=g), torch.randn(8, generator=g)
    held, holding = None, None
    for version in range(5):
        if version:
            embed[torch.rand(300, 8, generator=g) < 0.03] += 0.1
        head = embed if version < 3 else embed.clone()  # untied from version 3 on
        if version >= 3:
            head[0, version] += 1.0  # the head apart from the embedding
        state_dict = {"model.embed_tokens.weight": embed, "lm_head.weight": head,
                      "model.norm.weight": norm}
        result = await publisher.publish(state_dict, version, reader_base=holding)
        assert (result.delta.base_version is None) == (version == 0), version
        if version:  # each encoding's payload is sent once, a tied group's too
            assert result.bytes_written == sum(c.payload.numel() for c in encoded[-1]), version
        if held is None:
            held = await weights_fetch.fetch_weights(version, key_prefix="delta_tied")
        else:
            await weights_fetch.fetch_weights(version, key_prefix="delta_tied",
                                              holding=holding, allocate=lambda specs: held)
        holding = version
        want = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
        assert_bitwise(held, want, f"version {version}")
        # The publisher's snapshot is the committed version exactly (a stale element would
        # only cost bytes while the readers stay right, so it is checked here).
        snapshot = publisher._transport._snapshot
        assert_bitwise({k: snapshot[k].view(v.shape) for k, v in want.items()}, want,
                       f"snapshot {version}")
    assert blocks_encoded == [2, 2, 3, 3]  # tied: embed+head once, norm; untied: three
    publisher.close()


@module_loop
async def test_a_delta_that_does_not_pay_warns_once_and_the_next_versions_go_full(
    store, caplog
):
    """fp32 published weights at a large learning rate change nearly every element: the
    delta is as big as a full version. One warning names the figure and why; the next
    ``delta_anchor_every`` versions are full (``skipped``, counted by the app); then a
    delta is tried again, and one that pays is kept."""
    prefix = "delta_unpaid"
    publisher = weights_publish.WeightsPublisher(WeightsConfig(
        key_prefix=prefix, same_host="off", delta=True, delta_anchor_every=3))
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(5000, generator=g)}

    def large_step():  # every element moves (an fp32 Adam step at lr 1e-3)
        weights["w"] = weights["w"] + 1e-3 * torch.randn(5000, generator=g)

    def small_step():  # 1% of the elements move
        weights["w"] = weights["w"].clone()
        weights["w"][torch.randperm(5000, generator=g)[:50]] += 1.0

    results = [await publisher.publish(dict(weights), 0)]
    held = await weights_fetch.fetch_weights(0, key_prefix=prefix)
    with caplog.at_level("WARNING", logger="forge_ext.weights.transports.delta"):
        for version, step in enumerate([large_step] * 4 + [small_step] * 2, start=1):
            step()
            results.append(await publisher.publish(dict(weights), version,
                                                    reader_base=version - 1))
            await weights_fetch.fetch_weights(version, key_prefix=prefix, holding=version - 1,
                                              allocate=lambda specs: held)
            assert torch.equal(held["w"].view(torch.int32), weights["w"].view(torch.int32))
    publisher.close()
    stats = [r.delta for r in results]
    # v1 a delta (all changed, dense), v2-v4 full and skipped, v5 a delta tried again (it
    # pays: 1% changed), v6 a delta.
    assert [s.base_version for s in stats] == [None, 0, None, None, None, 4, 5]
    assert [s.skipped for s in stats] == [False, False, True, True, True, False, False]
    assert stats[1].changed == 5000
    warnings = [r.getMessage() for r in caplog.records]  # (Monarch prefixes the actor)
    assert len(warnings) == 1 and warnings[0].endswith(stats[1].warning)
    assert [s.warning is not None for s in stats] == [False, True, *[False] * 5]
    assert stats[1].warning.startswith(
        "weights.delta: the delta of policy_version=1 took 100% of a full version's bytes "
        "(100.0% of the elements changed bit for bit): with fp32 published weights or a large "
        "learning rate nearly every element changes at each step, so a delta does not pay; "
        "the next weights.delta_anchor_every=3 versions are sent full"), stats[1].warning


def test_the_codec_is_exact_for_every_float_dtype_and_overwrites_idempotently():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                  torch.float8_e4m3fn):
        base = torch.randn(3001, generator=g).to(dtype)
        new = base.clone()
        new[[0, 17, 3000]] = torch.tensor([1.0, -0.0, 2.0]).to(dtype)
        code = codec.encode(base, new)
        assert code.encoding == "sparse" and code.changed == 3 - int(base[17] == 0)
        target = base.clone()
        for _ in range(2):  # an overwrite encoding applied twice gives the same data
            codec.apply(target, code.encoding, code.count, code.payload, code.checksum, "w")
            assert torch.equal(target.view(torch.uint8), new.view(torch.uint8)), dtype
        # 5% changed: offsets within 256-element segments are the smaller index.
        spread = base.clone()
        moved = torch.randperm(3001, generator=g)[:150]
        spread[moved] = torch.randn(150, generator=g).to(dtype)
        code = codec.encode(base, spread)
        assert code.encoding == "sparse8", dtype
        target = base.clone()
        codec.apply(target, code.encoding, code.count, code.payload, code.checksum, "w")
        assert torch.equal(target.view(torch.uint8), spread.view(torch.uint8)), dtype
        dense = codec.encode(base, torch.randn(3001, generator=g).to(dtype))
        assert dense.encoding == "dense"
        assert dense.payload.numel() == 3001 * base.element_size()
        # Onto another base, the checksum refuses the result.
        with pytest.raises(WeightsChecksumError, match="w: the weights after applying"):
            codec.apply(torch.zeros_like(base), code.encoding, code.count, code.payload,
                        code.checksum, "w")


@pytest.mark.parametrize("encoding_share", [0.001, 0.05])
def test_any_flipped_bit_of_a_payload_is_a_checksum_error(encoding_share):
    """Every bit of a sparse or sparse8 payload (indices, segment counts, offsets, values)
    flipped in turn: the reader gets WeightsChecksumError, never another exception or wrong
    weights without one."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2000, generator=g).to(torch.bfloat16)
    new = base.clone()
    moved = torch.randperm(2000, generator=g)[: int(2000 * encoding_share)]
    new[moved] = torch.randn(moved.numel(), generator=g).to(torch.bfloat16)
    code = codec.encode(base, new)
    assert code.encoding == ("sparse" if encoding_share < 0.01 else "sparse8")
    for byte in range(code.payload.numel()):
        for bit in (0, 7):
            payload = code.payload.clone()
            payload[byte] ^= 1 << bit
            target = base.clone()
            try:
                codec.apply(target, code.encoding, code.count, payload, code.checksum, "w")
            except WeightsChecksumError:
                continue
            # Padding bytes carry nothing: the result must then be exactly the new block.
            assert torch.equal(target.view(torch.int16), new.view(torch.int16)), (byte, bit)


def test_minus_zero_and_nan_payloads_count_as_changes():
    base = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])
    new.view(torch.int32)[1] += 1  # another NaN payload
    assert codec.encode(base, new).changed == 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"delta": True, "same_host": "off", "transport": "dcp", "dcp_path": "/tmp/x"},
     "weights.delta=true needs weights.transport='direct' \\(got 'dcp'\\)"),
    ({"delta": "yes"}, "weights.delta='yes' must be true or false"),
    ({"delta_anchor_every": 0}, "weights.delta_anchor_every=0 must be an int >= 1"),
])
def test_delta_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        WeightsConfig(**fields)


@pytest.mark.parametrize("fields", [
    [],  # the transformers generator, weights.same_host=auto: anchors in the slots
    ["generator.backend=vllm", "weights.same_host=off"],
])
def test_the_grpo_config_takes_delta_with_either_generator_and_either_path(fields):
    from apps.grpo.config import load_config

    config = load_config("configs/grpo_cpu_demo.yaml", ["weights.delta=true", *fields],
                         check_model=False, check_engines=False)
    assert config.weights.delta


def test_the_grpo_config_refuses_delta_with_lora_naming_the_fields():
    from apps.grpo.config import load_config

    with pytest.raises(ValueError, match="weights.delta=true with trainer.lora: a LoRA version "
                       "is the adapter alone, already small; set weights.delta=false"):
        load_config("configs/grpo_cpu_demo.yaml", ["weights.delta=true", "trainer.lora={rank: 4}"],
                    check_model=False, check_engines=False)
