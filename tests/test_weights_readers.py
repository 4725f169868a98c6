"""The reading side of published weights (``fetch_weights``, ``open_weights``): leases of
same-host slots held by several readers of one process, slots replaced while read, and
arguments that every transport treats alike.

Every reader here runs in the test process, next to the publisher: the cases are about what
one process does with its own leases and mappings (readers on other procs:
tests/test_weights_publish.py)."""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os

import pytest
import torch
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights.errors import (
    WeightsFetchError, WeightsPublishError, WeightsVersionNotFoundError,
)
from forge_ext.weights.transports import slots
from forge_ext.weights.transports.same_host import SameHostRecord
from forge_ext.weights.shared_buffer import open_shared_tensors, views_of
from test_weights_publish import (
    TRANSPORTS,
    assert_same_tensors,
    make_publisher,
    slot_files,
    versioned_state_dict,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def grown_state_dict(version: int) -> dict[str, torch.Tensor]:
    """:func:`versioned_state_dict` with ``w`` twice as long: its slot must be replaced by a
    bigger one."""
    return {
        "w": torch.arange(1 << 20, dtype=torch.float64).add_(version * 2.0**30),
        "b": torch.arange(1000, dtype=torch.int64) + version * 10**6,
    }


async def still_waiting(task: asyncio.Future, seconds: float = 0.5) -> bool:
    await asyncio.sleep(seconds)
    return not task.done()


async def test_every_lease_of_one_process_keeps_the_writer_out_until_it_ends(store, tmp_path):
    """Three readers of version 1 in the publisher's own process: an ``open_weights`` block,
    a ``fetch_weights`` and a second ``open_weights`` inside it (another task). Each holds
    the slot on its own: the readers that end first do not let the writer in under the
    others."""
    prefix = "leases"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)  # 2 slots
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        async with weights_fetch.open_weights(1, key_prefix=prefix) as outer:
            entered, leave = asyncio.Event(), asyncio.Event()

            async def second_reader() -> dict[str, torch.Tensor]:
                async with weights_fetch.open_weights(1, key_prefix=prefix) as inner:
                    entered.set()
                    await leave.wait()
                    return {name: t.clone() for name, t in inner.tensors.items()}

            second = asyncio.ensure_future(second_reader())
            try:
                await entered.wait()
                fetched = await weights_fetch.fetch_weights(1, key_prefix=prefix)
                await publisher.publish(versioned_state_dict(2), 2)  # other slot; retires 1
                third = asyncio.ensure_future(publisher.publish(versioned_state_dict(3), 3))
                waited_for_two = await still_waiting(third)
            finally:
                leave.set()
                inner = await second
            waited_for_one = await still_waiting(third)
            held = {name: t.clone() for name, t in outer.tensors.items()}
        assert waited_for_two, "version 3 overwrote a slot two readers held"
        assert waited_for_one, "version 3 overwrote the slot a reader held"
        for tensors in (fetched, inner, held):
            assert_same_tensors(tensors, versioned_state_dict(1))
        await third
        assert_same_tensors(
            await weights_fetch.fetch_weights(3, key_prefix=prefix), versioned_state_dict(3)
        )
    finally:
        publisher.close()


async def test_a_slot_replaced_by_a_bigger_one_stays_valid_for_the_block_that_holds_it(
    store, tmp_path
):
    """Version 3's tensors outgrow version 1's slot while an ``open_weights(1)`` block holds
    it, and a fetch of version 3 in the same process maps the new slot: the block's tensors
    and its shared handle (what vLLM's workers map) keep version 1 until the block ends, the
    block ends cleanly, and the old file goes at the next publish."""
    prefix = "grown_held"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        async with weights_fetch.open_weights(1, key_prefix=prefix) as held:
            await publisher.publish(versioned_state_dict(2), 2)
            await publisher.publish(grown_state_dict(3), 3)  # replaces version 1's slot
            assert_same_tensors(
                await weights_fetch.fetch_weights(3, key_prefix=prefix), grown_state_dict(3)
            )
            assert_same_tensors(held.tensors, versioned_state_dict(1))
            assert_same_tensors(open_shared_tensors(held.shared_handle), versioned_state_dict(1))
            assert len(slot_files(os.getpid(), prefix)) == 3  # the held one, 2 and 3
        await publisher.publish(grown_state_dict(4), 4)  # into version 2's slot, grown
        assert len(slot_files(os.getpid(), prefix)) == 2
        assert_same_tensors(
            await weights_fetch.fetch_weights(4, key_prefix=prefix), grown_state_dict(4)
        )
    finally:
        publisher.close()
    assert slot_files(os.getpid(), prefix) == []


def reuse_slot_if_free(record, new_tensors) -> bool:
    """Be the writer that wants the slot of ``record``'s version: the non-blocking
    ``LOCK_EX`` that ``SlotRing.acquire`` takes before it overwrites a slot (granted only
    while no reader holds a lease on it), then, if granted, what a writer does next: stamp
    the slot as being written and put ``new_tensors`` (``record``'s names and shapes) in
    place. Returns whether the slot was free."""
    segment = record["segment"]
    fd = os.open(segment["path"], os.O_RDWR | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if new_tensors is not None:
            with mmap.mmap(fd, segment["size"]) as mapped:
                data = torch.frombuffer(mapped, dtype=torch.uint8)
                data[8:16].view(torch.int64)[0] = slots.WRITING
                entries = SameHostRecord.from_stored(record).entries(new_tensors)
                for name, view in views_of(data, entries).items():
                    view.copy_(new_tensors[name])
                del data, view
        return True
    finally:
        os.close(fd)  # drops the lock


async def test_fetch_copies_out_of_the_slot_before_its_lease_lets_a_writer_in(store, tmp_path):
    """``fetch_weights`` of a same-host version copies every tensor out of the slot while
    its lease still keeps writers out. Observed through ``allocate``: its tensors call back
    at every torch function applied to them (the copies into them included), and each time
    a writer tries to take the slot and, where it may, overwrites it with version 2, as a
    publisher reusing the slot would. A copy after the lease ended gets version 2's bytes."""
    prefix = "copy_in_lease"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        record = await weights_fetch.fetch_commit_record(
            1, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME
        )
        seen: dict[int, list[str]] = {}  # id(tensor) -> functions applied to it
        let_in: list[str] = []  # functions during which a writer could take the slot

        def observe(func, tensor) -> None:
            name = getattr(func, "__name__", str(func))
            if name == "__get__":  # a property (requires_grad, shape): name the property
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            seen.setdefault(id(tensor), []).append(name)
            if reuse_slot_if_free(record, None if let_in else versioned_state_dict(2)):
                let_in.append(seen[id(tensor)][-1])

        class Observed(torch.Tensor):
            armed = True

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                if cls.armed and args and isinstance(args[0], Observed):
                    observe(func, args[0])
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))

        allocated = {}

        def allocate(specs):
            allocated.update({name: torch.empty(shape, dtype=dtype).as_subclass(Observed)
                              for name, (shape, dtype) in specs.items()})
            return allocated

        try:
            got = await weights_fetch.fetch_weights(1, key_prefix=prefix, allocate=allocate)
        finally:
            Observed.armed = False
        assert let_in == [], (
            f"a writer could take the slot of version 1 while fetch_weights still applied "
            f"{', '.join(dict.fromkeys(let_in))} to the tensors it fills: copy out of the "
            "slot before the lease ends"
        )
        for name, tensor in allocated.items():
            assert "copy_" in seen.get(id(tensor), []), (
                f"{name}: no copy_ into allocate's tensor was observed; observe the function "
                "fetch_weights now fills it with"
            )
        assert_same_tensors({k: t.as_subclass(torch.Tensor) for k, t in got.items()},
                            versioned_state_dict(1))
        assert reuse_slot_if_free(record, None), "the test's writer never gets the slot"
    finally:
        publisher.close()


@pytest.mark.parametrize("slot", ["reused", "replaced", "publisher_stopped"])
async def test_a_version_whose_slot_is_gone_reads_as_retired_unless_still_committed(
    store, tmp_path, monkeypatch, slot
):
    """A reader that got version 1's commit record just before its slot changed: retired
    and its slot reused, or replaced by a bigger one, reads as not committed; a slot gone
    while the record is still in the store (the publisher closed) is a fetch error."""
    prefix = f"gone_{slot}"
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        stale = await weights_fetch.fetch_commit_record(
            1, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME
        )
        if slot == "publisher_stopped":
            publisher.close()
            error = pytest.raises(WeightsFetchError,
                                  match=r"policy_version=1: .* its publisher stopped")
        else:
            make = grown_state_dict if slot == "replaced" else versioned_state_dict
            for version in (2, 3):  # 3 goes into version 1's slot
                await publisher.publish(make(version), version)
            error = pytest.raises(WeightsVersionNotFoundError,
                                  match=r"policy_version=1 .*committed versions: \[3\]")

        async def stale_record(version, **kwargs):
            return stale

        monkeypatch.setattr(weights_fetch, "fetch_commit_record", stale_record)
        with error:
            await weights_fetch.fetch_weights(1, key_prefix=prefix)
        with error:
            async with weights_fetch.open_weights(1, key_prefix=prefix):
                pass
    finally:
        publisher.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_allocate_is_treated_alike_by_every_transport(store, tmp_path, transport):
    """Names ``allocate`` adds are ignored; tensors that require grad (parameters) are filled
    in place; exactly the requested names come back, as the allocated tensors."""
    prefix = f"allocate_{transport}"
    want = versioned_state_dict(1)
    await make_publisher(transport, tmp_path, prefix).publish(want, 1)
    allocated = {}

    def allocate(specs):
        allocated.update({name: torch.zeros(shape, dtype=dtype)
                          for name, (shape, dtype) in specs.items()})
        allocated["w"].requires_grad_(True)
        return {**allocated, "not_asked_for": torch.zeros(3)}

    got = await weights_fetch.fetch_weights(1, ["w", "b"], key_prefix=prefix, allocate=allocate)
    assert list(got) == ["w", "b"]
    assert all(got[name] is allocated[name] for name in got)
    assert got["w"].requires_grad and got["w"].grad_fn is None
    assert_same_tensors({name: t.detach() for name, t in got.items()}, {"w": want["w"],
                                                                        "b": want["b"]})
    with pytest.raises(TypeError, match="allocate returned a list, not a mapping"):
        await weights_fetch.fetch_weights(
            1, key_prefix=prefix, allocate=lambda specs: [torch.zeros(s, dtype=d)
                                                          for s, d in specs.values()]
        )


async def test_names_given_as_one_str_are_refused_asking_for_a_list():
    for read in (weights_fetch.fetch_weights, weights_fetch.open_weights):
        with pytest.raises(TypeError, match=r"names='model.w' is a str: pass a list of tensor "
                                            r"names, e.g. \['model.w'\]"):
            call = read(1, "model.w", key_prefix="no_such_prefix")
            if read is weights_fetch.open_weights:
                async with call:
                    pass
            else:
                await call


async def test_a_writer_kept_waiting_by_a_reader_says_who_and_what_to_do(
    store, tmp_path, monkeypatch
):
    prefix = "lease_timeout"
    monkeypatch.setattr(slots, "LEASE_TIMEOUT_S", 1.0)
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        async with weights_fetch.open_weights(1, key_prefix=prefix):
            await publisher.publish(versioned_state_dict(2), 2)
            with pytest.raises(
                WeightsPublishError,
                match=rf"TimeoutError: waited 1 s for readers of the retired policy_version=1 "
                      rf"to leave its shared-memory slot /dev/shm/\S+ \(held by pid "
                      rf"{os.getpid()} \(this process\)\): .*inside open_weights\(1\).* or "
                      rf"fetch_weights\(1\). End that block .*raise weights.keep_versions",
            ):
                await publisher.publish(versioned_state_dict(3), 3)
        await publisher.publish(versioned_state_dict(3), 3)  # once the reader has left
    finally:
        publisher.close()


def test_orphan_removal_takes_a_dead_generators_lora_folder_and_leaves_live_ones(tmp_path):
    """A vLLM generator killed with kill -9 where no watchdog ran leaves its LoRA folder
    (``forge_ext-lora-<pid>-...``, PEFT folders inside): ``make clean`` and the next
    publisher remove it like a file; a live process's folder stays."""
    import subprocess

    from forge_ext.weights import shm_files

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now a dead process's
    ns = shm_files.pid_namespace()
    orphan = tmp_path / f"{shm_files.PREFIX}-lora-{dead.pid}-0-p{ns}"
    (orphan / "policy-v3-id3").mkdir(parents=True)
    (orphan / "policy-v3-id3" / "adapter_config.json").write_text("{}")
    live = tmp_path / f"{shm_files.PREFIX}-lora-{os.getpid()}-0-p{ns}"
    live.mkdir()
    assert shm_files.remove_orphans(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and live.exists()
