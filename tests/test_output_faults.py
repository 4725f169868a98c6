"""Outputs that cannot be written end the run in one line (issue 26, fault 3).

The disk is filled for real where the kernel lets a test do it without privileges:
``/dev/full`` answers every write with ENOSPC. Checkpoint saves are covered in
``test_engine.py``."""

from __future__ import annotations

import errno
import json
import os
from types import SimpleNamespace

import pytest

from forge_ext.engine.checkpoint import write_checkpoint
from forge_ext.runtime import disk
from forge_ext.runtime.metrics import MetricLogger, MetricsConfig

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


def open_logger(tmp_path) -> MetricLogger:
    logger = MetricLogger(MetricsConfig(log_dir=str(tmp_path), tensorboard=False, plot=None))
    logger.open()
    logger.log(0, {"reward/mean": 0.5})
    return logger


@needs_dev_full
def test_a_metric_line_that_cannot_be_written_is_one_line_naming_the_file(tmp_path):
    logger = open_logger(tmp_path)
    logger._jsonl.close()
    logger._jsonl = open("/dev/full", "a")  # the disk is full from now on
    with pytest.raises(disk.OutputWriteError) as raised:
        logger.log(1, {"reward/mean": 0.6})
    message = str(raised.value)
    assert "\n" not in message and raised.value.__cause__ is None
    assert message.startswith(
        f"writing the metrics file to {tmp_path / 'metrics.jsonl'} failed: ENOSPC"
    )
    assert " free" in message and raised.value.errno == errno.ENOSPC


@needs_dev_full
def test_closing_the_metrics_on_a_full_disk_keeps_the_written_file(tmp_path):
    """The compacting rewrite at close fails: one line, the file written so far intact, no
    staged file left."""
    logger = open_logger(tmp_path)
    staged = tmp_path / "metrics.jsonl.tmp"
    os.symlink("/dev/full", staged)
    with pytest.raises(disk.OutputWriteError, match="metrics.jsonl failed: ENOSPC"):
        logger.close()
    assert not os.path.lexists(staged)
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [
        {"step": 0, "reward/mean": 0.5}
    ]


def test_a_write_error_behind_a_remote_call_ends_the_app_in_one_line(monkeypatch, tmp_path):
    """What the trainer's endpoint raised reaches the controller inside Monarch's
    ActorError; the app prints the one line and exits, no traceback."""
    import pickle

    from monarch.actor import ActorError

    import apps.grpo.main as app_main

    line = ("writing checkpoint step 2 to /out/ckpt/step-2 failed: ENOSPC (No space left on "
            "device); 0.1 MiB free, 45.0 MiB needed (the last checkpoint's size); last "
            "complete checkpoint: /out/ckpt/step-1")
    sent = disk.CheckpointWriteError(line, path="/out/ckpt/step-2", errno=errno.ENOSPC)
    received = pickle.loads(pickle.dumps(sent))  # as it crosses from the actor
    assert type(received) is disk.CheckpointWriteError and received.errno == errno.ENOSPC

    class App:
        resume_step = 0  # a run to train (main() exits early on a finished one)

        def __init__(self, config, inputs=None):
            self.config = config

        async def run(self):
            raise ActorError(received)

    config = SimpleNamespace(loop=SimpleNamespace(steps=4), output_dir=str(tmp_path))
    monkeypatch.setattr(app_main, "load_config", lambda path, overrides: config)
    monkeypatch.setattr(app_main, "RLApp", App)
    with pytest.raises(SystemExit) as exited:
        app_main.main(["--config", str(tmp_path / "c.yaml")])
    assert exited.value.code == f"error: {line}"
    # The console is kept in <output_dir>/logs/console.log, the final line included (issue 50).
    assert (tmp_path / "logs" / "console.log").read_text() == f"error: {line}\n"


def test_every_rank_refuses_a_save_when_one_rank_is_short_of_space(tmp_path):
    """The save is collective: a rank with enough space must not enter it alone (it would
    wait for the refusing rank forever), so the free-space check is agreed on by all."""
    (tmp_path / "ckpt" / "step-1").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-1" / ".metadata").write_bytes(b"")
    written = []
    gathered = lambda mine: [mine, (1 << 20, 8 << 20)]  # rank 1: 1 MiB free of 8 needed
    with pytest.raises(disk.CheckpointWriteError, match=(
        r"not writing checkpoint step 2 to .*step-2: 1.0 MiB free on its filesystem \(rank 1\), "
        r"8.0 MiB needed .*last complete checkpoint: .*step-1$"
    )):
        write_checkpoint(
            lambda: written.append(1), what="checkpoint step 2",
            path=str(tmp_path / "ckpt" / "step-2"), folder=str(tmp_path / "ckpt"),
            needed_bytes=8 << 20, gather=gathered,
        )
    assert written == []


@pytest.mark.parametrize("free_minus_needed, refused", [(-1, True), (0, False), (1, False)],
                         ids=["a_byte_short", "exactly_enough", "a_byte_more"])
def test_a_save_is_refused_exactly_when_free_space_is_short_of_the_last_checkpoints_size(
    tmp_path, monkeypatch, free_minus_needed, refused
):
    """The boundary of the pre-save check: one byte short of the last checkpoint's size is
    refused before writing; as much as it, or a byte more, is written."""
    import shutil

    needed = 8 << 20
    free = needed + free_minus_needed
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage._replace(free=free))
    step2 = tmp_path / "ckpt" / "step-2"

    def write():
        step2.mkdir(parents=True)
        (step2 / ".metadata").write_bytes(b"12345")

    save = lambda: write_checkpoint(write, what="checkpoint step 2", path=str(step2),
                                    folder=str(tmp_path / "ckpt"), needed_bytes=needed)
    if refused:
        with pytest.raises(disk.CheckpointWriteError) as raised:
            save()
        assert (raised.value.free_bytes, raised.value.needed_bytes) == (free, needed)
        assert not step2.exists()
    else:
        assert save() == 5


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_weights_written_by_every_writer_follow_the_umask(tmp_path, mask):
    """Issue 50: ``model.safetensors`` was written 0600 (safetensors' ``save_file``) while
    every other file of a run was 0644 under umask 022: a colleague on a shared filesystem
    could not load the trained model. An HF checkpoint (the trainer's export, ``apps.export``
    and the SFT warm-start write through it), a PEFT adapter folder, and tokenizer files
    copied from a checkpoint whose own files are 0600: each file gets ``0o666 & ~umask``."""
    import torch

    from forge_ext.engine.hf_checkpoint import save_hf_checkpoint
    from forge_ext.engine.lora import write_peft_folder

    from forge_ext.tasks.tokenizer import save_tokenizer

    source = tmp_path / "source"
    save_tokenizer(source)
    for path in source.iterdir():
        os.chmod(path, 0o600)
    saved = os.umask(mask)
    try:
        hf = save_hf_checkpoint(tmp_path / "hf", {"w.weight": torch.ones(2, 2)},
                                {"model_type": "qwen3"}, tokenizer_from=source)
        sharded = save_hf_checkpoint(tmp_path / "sharded", {"a": torch.ones(64),
                                                            "b": torch.ones(64)},
                                     {"model_type": "qwen3"}, max_shard_bytes=256)
        adapter = write_peft_folder(tmp_path / "adapter", {
            "base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4),
            "base_model.model.layers.0.q_proj.lora_B.weight": torch.ones(4, 2)},
            {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    finally:
        os.umask(saved)
    files = [p for folder in (hf, sharded, adapter) for p in folder.iterdir()]
    assert {p.name for p in files} >= {"model.safetensors", "tokenizer.json",
                                       "model-00001-of-00002.safetensors",
                                       "adapter_model.safetensors"}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes
