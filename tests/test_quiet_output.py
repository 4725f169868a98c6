"""A run's console output is quiet and honest (issue 28, test 3): the GRPO demo run from the
command line, as a user types it, for 2 steps of a demo-shaped checkpoint, prints what it
will do first and where everything went last, and no traceback (Monarch's atexit shutdown,
vLLM's chat-template warm-up) nor torchtitan's notices about defaults that do not apply.

A SIGTERM to the run's process group (``timeout``, ``kill -- -PGID``) stops it with status 143.

A test session on spawned procs ends with pytest's status and nothing after its summary
(``tests/conftest.py``'s ``pytest_unconfigure``)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from forge_ext.engine.config import TITAN_NOTICES_NOT_APPLICABLE

ROOT = Path(__file__).resolve().parent.parent


def test_a_two_step_demo_run_says_what_it_does_first_where_it_wrote_last_and_no_traceback(
    demo_checkpoint, tmp_path
):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo_cpu_demo.yaml",
        f"model.hf_path={demo_checkpoint}", f"output_dir={out}", "loop.steps=2",
        "loop.eval_every=2", "loop.save_every=2",
        # Resized by grpo.prompts_per_step and group_size alone: the trainer's batch follows.
        "task.num_train=8", "task.num_eval=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "eval.batch_size=2",
        # No reference (one proc fewer to start, mostly torchtitan's import).
        "reference=null", "loss.kl_coef=0", "metrics.tensorboard=false",
    ]
    # A user's shell: not this process's environment, which torchstore's import (here, in
    # the test process) gave the frame-limit variable that hides its logging setup.
    env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_CODEC_MAX_FRAME_LENGTH"}
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**env, "PYTHONPATH": str(ROOT)}, umask=0o022,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output
    # Lines that said nothing to a user: torchtitan's about defaults that do not apply, its
    # INFO lines per checkpoint save (via torchstore's root-logger setup and Monarch's INFO
    # root level in procs), torchstore's note on the frame limit, transformers' loading bar
    # and min_length warning, torch's DTensor random-init notice before weights are loaded.
    # Monarch's "Monarch internal logs are being written to /tmp/<user>/..." (issue 38).
    for notice in (*TITAN_NOTICES_NOT_APPLICABLE, "INFO:root:", "HYPERACTOR_CODEC_MAX_FRAME",
                   "Loading weights", "min_new_tokens", "DTensor random operators",
                   "Monarch internal logs", "monarch_log"):
        assert notice not in output, notice
    # No progress bar on a pipe: a redirected log held its every carriage-return update
    # (issue 38); torchtitan's "Warmup (10) + decay ..." of a 2-step run is in the notices.
    assert "\r" not in result.stdout and "GRPO:   0%" not in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    first, last = lines[0], lines[-1]
    assert first.startswith(
        f"GRPO: 2 steps (sync) of 2 prompts x 2 samples from {demo_checkpoint} (qwen3); "
        f"output_dir {out}"
    ), first
    assert lines[1].startswith("task addition: 8 training rows, 2 held-out"), lines[1]
    assert lines[2].startswith("GRPO variant: none (field defaults) | loss.aggregation="), lines[2]
    assert lines[3] == ("spawning trainer (1 proc, titan engine), generator (hf, 1 replica, weight_update "
                        "between_requests) on this machine")
    # What the start-up spent, one line per part, before step 0 (issue 38).
    step0 = lines.index(next(line for line in lines if line.startswith("step   0/2")))
    startup = [line for line in lines[:step0] if line.startswith("start-up: ")]
    assert [line.split()[1] for line in startup] == [
        "hosts", "torchstore", "trainer", "generator", "all"], startup
    # Each role's split: its processes' start and imports, then its setup.
    for line in startup[2:4]:
        assert "s (processes and imports " in line and ", setup " in line, line
    assert "checkpoint of step 2 saved in " in result.stdout
    # The start is "step 0": this checkpoint is no SFT run's warm-start (no run_config.yaml).
    assert any(line.startswith("held-out accuracy (2 prompts, greedy): step 0 ")
               for line in lines), lines[-6:]
    assert "HF checkpoint of step 2 written in " in result.stdout
    assert last == (f"written to {out}: run config {out / 'run_config.yaml'}, metrics "
                    f"{out / 'metrics.jsonl'}, checkpoints {out / 'checkpoints'}, "
                    f"HF checkpoints {out / 'hf'}"), last
    assert (out / "metrics.jsonl").is_file() and (out / "run_config.yaml").is_file()
    # Monarch's log is the run's, in output_dir (not one file in /tmp shared by every run).
    monarch_log = out / "logs" / "monarch.log"
    assert monarch_log.is_file() and not monarch_log.is_symlink(), list((out / "logs").iterdir())
    assert monarch_log.stat().st_size > 0
    # Each role's own Python log too: torchtitan's INFO lines (kept off the console above)
    # are in the trainer's file; the generator's says what it served (issue 50: it was
    # empty), off the console too.
    trainer_log = (out / "logs" / "trainer-0.log").read_text()
    assert "Saving the checkpoint" in trainer_log and "Saving the checkpoint" not in output
    generator_log = (out / "logs" / "generator-0.log").read_text()
    for said in ("generator ready: hf engine", "serving policy version 1",
                 "serving policy version 2"):
        assert said in generator_log and said not in output, (said, generator_log)
    # Sample completions per step (issue 38): both prompts of each of the 2 steps.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    assert all(set(s["rewards"]) == {"addition"} and "completion" in s for s in samples)
    # The console is kept (issue 50): every line the run printed, in order, the closing
    # summary and the last line included, in <output_dir>/logs/console.log.
    kept = iter((out / "logs" / "console.log").read_text().splitlines())
    assert all(line in kept for line in result.stdout.splitlines()), result.stdout
    # Every file of the run follows the umask (issue 50: model.safetensors was 0600): the
    # checkpoint, the HF export, the plot, the logs, the metrics.
    files = [p for p in out.rglob("*") if not p.is_symlink()]
    assert {"model.safetensors", "progress.png", "console.log", "metrics.jsonl"} <= {
        p.name for p in files}
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644", "0o755"}, modes
    assert all(modes[str(p.relative_to(out))] == "0o755" for p in files if p.is_dir()), modes
    # The same command again: a finished run says so and spawns nothing (issue 38).
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**env, "PYTHONPATH": str(ROOT)})
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert again.stdout.startswith(f"output_dir {out} holds a finished run: its checkpoint of "
                                   "step 2 is the last of loop.steps=2; nothing to do"), again.stdout
    assert "spawning" not in again.stdout and "start-up:" not in again.stdout
    assert (again.stdout + again.stderr).count("\n") == 1, again.stdout + again.stderr


def test_a_sigterm_to_the_runs_process_group_stops_it_and_exits_143(demo_checkpoint, tmp_path):
    """What ``timeout`` and ``kill -- -PGID`` do: SIGTERM to the run's whole process group
    (the controller and every process it started), here while the roles start. The run
    stops at once, says so, and exits 143 (128 + SIGTERM) as a program SIGTERM ended, not
    130 (a Ctrl-C's); nothing of the group is left."""
    command = [
        sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo_cpu_demo.yaml",
        f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / 'run'}", "loop.steps=2",
        "task.num_train=8", "task.num_eval=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "eval.batch_size=2", "reference=null", "loss.kl_coef=0", "metrics.tensorboard=false",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_CODEC_MAX_FRAME_LENGTH"}
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**env, "PYTHONPATH": str(ROOT)},
                           start_new_session=True)  # its own group, as a shell's job
    try:
        for line in run.stdout:  # the plan's last line: the loop is setting up
            if line.startswith("spawning "):
                break
        os.killpg(run.pid, signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 143, (run.returncode, stdout[-2000:], stderr[-3000:])
    assert "SIGTERM: stopping now" in stdout, stdout[-2000:]
    assert "interrupted: every actor and proc mesh was stopped" in stderr, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _group_alive(run.pid):
        time.sleep(0.2)
    assert not _group_alive(run.pid), "a process of the run's group outlived it"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_test_session_on_spawned_procs_ends_with_its_status_and_no_traceback():
    """A pytest session that spawned procs, used torchstore and SIGKILLed a proc (as this
    suite does) ends with pytest's own exit status and nothing after its summary line: no
    Monarch atexit ``TimeoutError`` traceback, no report of the killed proc's undeliverable
    messages, no crash in the interpreter's teardown (``conftest``'s ``pytest_unconfigure``)."""
    test = ("tests/test_weights_publish.py::"
            "test_a_killed_publisher_leaves_no_slot_once_the_next_one_starts")
    env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_CODEC_MAX_FRAME_LENGTH"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT,
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT),
                                                          "PYTHONFAULTHANDLER": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "Fatal Python error" not in output, output
    summary = [i for i, line in enumerate(output.splitlines()) if " passed" in line]
    assert summary and output.splitlines()[summary[-1] + 1:] == [], output[-2000:]


def test_importing_vllm_after_forge_ext_prints_nothing():
    """Issue 50: the agent run printed ``Triton is installed, but doesn't include CPU backend``:
    the controller imports vLLM's OpenAI protocol classes (the agents' endpoint) without
    starting an engine, and vLLM 0.32 applies ``VLLM_LOGGING_LEVEL`` only when an engine
    configures its logging, so its import-time warnings reached the console through Python's
    last-resort handler. After ``import forge_ext`` they follow ``VLLM_LOGGING_LEVEL`` (ERROR
    unless the user sets it)."""
    code = ("import forge_ext\n"
            "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest\n"
            "from vllm.entrypoints.openai.completion.protocol import CompletionRequest\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout + result.stderr == "", result.stdout + result.stderr
