"""The reading side of published weights (``fetch_weights``, ``open_weights``): leases of
same-host slots held by several readers of one process, slots replaced while read, and
arguments that every transport treats alike.

Every reader here runs in the test process, next to the publisher: the cases are about what
one process does with its own leases and mappings (readers on other procs:
tests/test_weights_publish.py)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights import publish as weights_publish
from forge_ext.weights import same_host
from forge_ext.weights.shared_buffer import open_shared_tensors
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


async def test_a_writer_kept_waiting_by_a_reader_says_who_and_what_to_do(
    store, tmp_path, monkeypatch
):
    prefix = "lease_timeout"
    monkeypatch.setattr(same_host, "LEASE_TIMEOUT_S", 1.0)
    publisher = make_publisher("same_host", tmp_path, prefix, keep_versions=1)
    try:
        await publisher.publish(versioned_state_dict(1), 1)
        async with weights_fetch.open_weights(1, key_prefix=prefix):
            await publisher.publish(versioned_state_dict(2), 2)
            with pytest.raises(
                weights_publish.WeightsPublishError,
                match=rf"TimeoutError: waited 1 s for readers of the retired policy_version=1 "
                      rf"to leave its shared-memory slot /dev/shm/\S+ \(held by pid "
                      rf"{os.getpid()} \(this process\)\): .*inside open_weights\(1\).* or "
                      rf"fetch_weights\(1\). End that block .*raise weights.keep_versions",
            ):
                await publisher.publish(versioned_state_dict(3), 3)
        await publisher.publish(versioned_state_dict(3), 3)  # once the reader has left
    finally:
        publisher.close()
