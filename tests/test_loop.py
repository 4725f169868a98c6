"""The RL loop template (forge_ext.rl.loop.RLLoop) with fake hooks: step order, resume, the
weight-sync gate, and teardown on success, on an exception and on cancellation (Ctrl-C)."""

import asyncio
import json
import os
import signal

import pytest

from forge_ext.rl.loop import LoopConfig, RLLoop
from forge_ext.runtime.interrupts import Interrupted, exit_status
from forge_ext.runtime.metrics import MetricsConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")


class FakeJob(RLLoop):
    """Records what the loop asks for; the generator serves whatever was last fetched."""

    def __init__(self, tmp_path, *, steps=5, resume_at=0, max_policy_age=0, fail_in=None,
                 fetch_delay=0.0, **loop):
        super().__init__(
            LoopConfig(steps=steps, max_policy_age=max_policy_age, **loop),
            MetricsConfig(log_dir=str(tmp_path), tensorboard=False, plot=None),
        )
        self.resume_at, self.fail_in, self.fetch_delay = resume_at, fail_in, fetch_delay
        self.events: list[tuple] = []
        self.served = -1
        self.stopped: list[str] = []

    async def setup(self):
        for name in ("store", "trainer", "generator"):
            self.track(name, lambda name=name: self.record_stop(name))

    async def record_stop(self, name):
        self.stopped.append(name)

    async def load_checkpoint(self):
        return self.resume_at

    def fast_forward(self, step):
        self.events.append(("fast_forward", step))

    async def build_rollouts(self, step):
        if self.fail_in == "rollouts":
            raise RuntimeError("generator died")
        self.events.append(("rollouts", step, self.trainer_version, self.served))
        return {"served": self.served}

    def policy_versions(self, rollouts):
        return [rollouts["served"]]

    async def train_step(self, step, rollouts):
        if self.fail_in == "train" and step == 2:
            raise FloatingPointError("injected")
        self.events.append(("train", step))
        return {"reward/mean": step / 10, "sampled_version": rollouts["served"]}

    async def push_weights(self, version):
        await asyncio.sleep(0)
        self.events.append(("push", version))

    async def fetch_weights(self, version):
        await asyncio.sleep(self.fetch_delay)
        self.served = version

    async def evaluate(self, step):
        self.events.append(("eval", step))
        return {"eval/accuracy": step / 100}

    async def save_checkpoint(self, step):
        self.events.append(("save", step))

    def write(self, line):
        pass


def kinds(events, kind):
    return [e[1] for e in events if e[0] == kind]


async def test_steps_run_in_order_and_resume_from_the_checkpoint_step(tmp_path):
    job = FakeJob(tmp_path, steps=5, resume_at=2, eval_every=2, save_every=2)
    await job.run()
    assert job.events[0] == ("fast_forward", 2)
    assert kinds(job.events, "rollouts") == [2, 3, 4]
    assert kinds(job.events, "train") == [2, 3, 4]
    assert kinds(job.events, "eval") == [2, 4, 5]  # baseline, periodic, last
    assert kinds(job.events, "save") == [4, 5]  # periodic, last
    assert kinds(job.events, "push") == [2, 3, 4, 5]  # start-up sync of the resumed weights
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 5]
    assert [r.get("policy_version") for r in rows[1:]] == [3, 4, 5]


async def test_on_policy_gate_samples_every_step_with_the_trainer_weights(tmp_path):
    job = FakeJob(tmp_path, steps=4, max_policy_age=0, fetch_delay=0.01)
    await job.run()
    for _, step, trainer_version, served in (e for e in job.events if e[0] == "rollouts"):
        assert served == trainer_version == step


async def test_gate_lets_the_generator_lag_by_at_most_max_policy_age(tmp_path):
    job = FakeJob(tmp_path, steps=6, max_policy_age=1, fetch_delay=0.05)
    await job.run()
    lags = [t - s for _, _, t, s in (e for e in job.events if e[0] == "rollouts")]
    assert max(lags) == 1, lags  # weight sync overlapped with the next rollouts
    assert min(lags) >= 0


async def test_exception_stops_everything_in_reverse_order_and_propagates(tmp_path):
    job = FakeJob(tmp_path, steps=5, fail_in="train", save_every=1)
    with pytest.raises(FloatingPointError, match="injected"):
        await job.run()
    assert job.stopped == ["generator", "trainer", "store"]
    assert kinds(job.events, "save") == [1, 2]  # steps 0 and 1 committed, step 2 failed
    assert job.metrics._jsonl is None  # loggers closed


async def test_cancellation_like_ctrl_c_stops_everything(tmp_path):
    job = FakeJob(tmp_path, steps=1000, fetch_delay=0.001)
    task = asyncio.create_task(job.run())
    while len(kinds(job.events, "train")) < 3:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job.stopped == ["generator", "trainer", "store"]


async def test_a_failing_stop_does_not_prevent_the_others(tmp_path):
    job = FakeJob(tmp_path, steps=1, fail_in="rollouts")

    async def broken():
        raise RuntimeError("mesh already gone")

    async def setup():
        job.track("store", lambda: job.record_stop("store"))
        job.track("broken", broken)
        job.track("generator", lambda: job.record_stop("generator"))

    job.setup = setup
    with pytest.raises(RuntimeError, match="generator died"):
        await job.run()
    assert job.stopped == ["generator", "store"]



async def test_metric_history_resumes_at_the_checkpoint_step(tmp_path):
    from forge_ext.runtime.metrics import MetricLogger

    logger = MetricLogger(MetricsConfig(log_dir=str(tmp_path), tensorboard=False, plot="p.png"))
    logger.open()
    for step in range(6):
        logger.log(step, {"reward/mean": step / 10, "eval/accuracy": float("nan")})
    logger.close()
    # A crash after step 5; the last checkpoint is step 3: steps 4 and 5 will be redone.
    logger = MetricLogger(logger.config)
    logger.open(resume_step=3)
    logger.log(4, {"reward/mean": 0.9})
    assert logger.series("reward/mean") == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9)]
    assert logger.series("eval/accuracy") == []  # NaN is stored as null and skipped
    assert logger.close(plot_keys=["reward/mean"]) == tmp_path / "p.png"
    assert (tmp_path / "p.png").stat().st_size > 0


async def test_logging_a_step_again_updates_it_and_the_file_keeps_one_line_per_step(tmp_path):
    import json

    from forge_ext.runtime.metrics import MetricLogger

    config = MetricsConfig(log_dir=str(tmp_path), tensorboard=False, plot=None)
    logger = MetricLogger(config)
    logger.open()
    logger.log(0, {"eval/accuracy": 0.2})
    logger.log(1, {"reward/mean": 0.5, "eval/accuracy": 0.3})
    logger.close()
    # A rerun resumed at step 1 (the last checkpoint) evaluates step 1 again.
    logger = MetricLogger(config)
    logger.open(resume_step=1)
    logger.log(1, {"eval/accuracy": 0.4})
    assert logger.series("eval/accuracy") == [(0, 0.2), (1, 0.4)]
    assert logger.series("reward/mean") == [(1, 0.5)]
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [
        {"step": 0, "eval/accuracy": 0.2},
        {"step": 1, "reward/mean": 0.5, "eval/accuracy": 0.4},
    ]


async def test_tensorboard_holds_every_scalar_and_the_sample_completions_as_text(tmp_path):
    """What issue 38 asks to see in TensorBoard: every logged scalar (loss, KL, each reward
    function, response length, clip fraction, dropped groups) and each step's sample
    completions as text (prompt, completion, reward and each function's score), the same
    records as samples.jsonl; a resumed run drops the samples of steps it redoes."""
    from conftest import tensorboard_events

    from forge_ext.runtime.metrics import MetricLogger

    logger = MetricLogger(MetricsConfig(log_dir=str(tmp_path), plot=None))
    logger.open()
    names = ["loss", "loss/kl", "reward/exact", "reward/short", "rollout/response_tokens",
             "loss/clip_fraction", "rollout/dropped_groups", "rollout/truncated/max_turns"]
    records = {step: [{"prompt": f"What is {step} plus 1?", "answer": str(step + 1),
                       "completion": f"<think>\n</think>\n{step + 1}", "reward": 1.1,
                       "rewards": {"exact": 1.0, "short": 0.1}}] for step in (1, 2, 3)}
    for step in (1, 2, 3):
        logger.log(step, {name: step + i / 10 for i, name in enumerate(names)})
        logger.log_samples(step, records[step])
    logger.close()
    scalars, texts = tensorboard_events(tmp_path / "tensorboard")
    for i, name in enumerate(names):
        assert scalars[name] == [(s, pytest.approx(s + i / 10)) for s in (1, 2, 3)], name
    assert [step for step, _ in texts["samples"]] == [1, 2, 3]
    for step, text in texts["samples"]:
        record = records[step][0]
        assert "reward 1.1 (exact 1, short 0.1)" in text
        for field in ("prompt", "answer"):
            assert record[field] in text
        assert "    <think>\n    </think>\n    " + record["answer"] in text  # verbatim block
    lines = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert lines == [{"step": s, **records[s][0]} for s in (1, 2, 3)]
    # Resumed at step 2's checkpoint: step 3's samples are about to be redone.
    logger = MetricLogger(logger.config)
    logger.open(resume_step=2)
    logger.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1, 2]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_ctrl_c_stops_at_the_next_step_boundary_after_teardown(tmp_path, mode):
    job = FakeJob(tmp_path, steps=10, save_every=1, mode=mode, max_policy_age=1)
    original = job.train_step

    async def train_step(step, rollouts):
        if step == 2:
            job.interrupt()  # what SIGINT calls, arriving in the middle of step 3
        return await original(step, rollouts)

    job.train_step = train_step
    with pytest.raises(KeyboardInterrupt, match="before step 4") as stop:
        await job.run()
    assert exit_status(stop.value) == 130  # 128 + SIGINT, as a shell reports a Ctrl-C
    assert kinds(job.events, "train") == [0, 1, 2]  # step 3 (index 2) completed and saved
    assert kinds(job.events, "save") == [1, 2, 3]
    assert job.stopped == ["generator", "trainer", "store"]
    if mode == "async":  # the rollout task, a step ahead, was stopped too
        assert job._rollout_task.task.done()


async def test_sigterm_during_setup_stops_at_once(tmp_path):
    """A SIGTERM while setup waits (a Slurm job in the queue for ever): the wait is
    cancelled at once, not after a step that will never come, and what setup had started
    is stopped."""
    job = FakeJob(tmp_path, steps=10)

    async def setup():
        job.track("hosts", lambda: job.record_stop("hosts"))
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(3600)

    job.setup = setup
    # In this task, as the app's asyncio.run has it: a KeyboardInterrupt (Interrupted is one)
    # out of another task would stop the event loop.
    with pytest.raises(Interrupted, match="stopped at once") as stop:
        async with asyncio.timeout(10):
            await job.run()
    assert (stop.value.signum, exit_status(stop.value)) == (signal.SIGTERM, 143)
    assert job.stopped == ["hosts"] and job.events == []


async def test_sigterm_stops_like_ctrl_c(tmp_path):
    """What a scheduler (Slurm, Kubernetes) or ``timeout`` sends first: a real SIGTERM to
    this process, in the middle of step 3."""
    job = FakeJob(tmp_path, steps=10, save_every=1)
    original, unhandled = job.train_step, []

    async def train_step(step, rollouts):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return await original(step, rollouts)

    job.train_step = train_step
    previous = signal.signal(signal.SIGTERM, lambda *_: unhandled.append(True))
    try:
        with pytest.raises(KeyboardInterrupt, match="before step 4") as stop:
            await job.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not unhandled
    # The command exits as one SIGTERM ended: 128 + 15 (it was 130, a Ctrl-C's).
    assert exit_status(stop.value) == 143
    assert kinds(job.events, "train") == [0, 1, 2]
    assert kinds(job.events, "save") == [1, 2, 3]
    assert job.stopped == ["generator", "trainer", "store"]


@pytest.mark.parametrize(("save_every", "saves"), [(10, [3]), (0, [])])
async def test_ctrl_c_saves_the_steps_done_since_the_last_checkpoint(tmp_path, save_every, saves):
    job = FakeJob(tmp_path, steps=20, save_every=save_every)
    original = job.train_step

    async def train_step(step, rollouts):
        if step == 2:
            job.interrupt()
        return await original(step, rollouts)

    job.train_step = train_step
    with pytest.raises(KeyboardInterrupt, match="before step 4"):
        await job.run()
    assert kinds(job.events, "save") == saves  # save_every=0: checkpoints are off
