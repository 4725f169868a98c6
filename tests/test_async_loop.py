"""The RL loop in ``loop.mode: async`` (forge_ext.rl.loop) with fake hooks whose delays make the
trainer or the generator the slow side: the staleness bound over every trained sample,
stale rollouts dropped and rebuilt, every prompt trained exactly once across a kill and a
resume, async with max_policy_age 0 equal to sync, errors and cancellation in the background
tasks, and the per-step metrics (Ctrl-C in both modes: test_loop)."""

import asyncio
import json

import pytest

from test_loop import FakeJob

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS, GROUP = 3, 2  # prompts per step, samples per prompt


class Job(FakeJob):
    """A fake GRPO-shaped job (teardown, checkpoint and evaluation as test_loop's FakeJob).
    The rollouts of step s are ``PROMPTS`` prompts (stream positions ``s * PROMPTS ...``) x
    ``GROUP`` samples, ``(position, version)`` each, stamped with the version the fake
    generator serves when it samples; ``fetch_weights`` makes it serve the pushed version
    after ``fetch_s``. ``lie_at``: steps whose first build is stamped one version older than
    the staleness bound allows (a generator serving older weights than it reported)."""

    def __init__(self, tmp_path, *, mode="async", steps=10, max_policy_age=1, train_s=0.0,
                 generate_s=0.0, fetch_s=0.0, resume_at=0, fail_train_at=None,
                 fail_build_at=None, fail_fetch_at=None, lie_at=(), save_every=0):
        super().__init__(tmp_path, steps=steps, resume_at=resume_at,
                         max_policy_age=max_policy_age, mode=mode, save_every=save_every)
        self.train_s, self.generate_s, self.fetch_s = train_s, generate_s, fetch_s
        self.fail_train_at, self.fail_build_at = fail_train_at, fail_build_at
        self.fail_fetch_at = fail_fetch_at
        self.lie_at = set(lie_at)
        self.served = resume_at if resume_at else 0  # a fresh generator serves version 0
        self.built: list[int] = []  # steps, in the order build_rollouts was called
        self.trained: dict[int, tuple[int, list[tuple[int, int]]]] = {}

    @property
    def saved(self):
        return [e[1] for e in self.events if e[0] == "save"]

    async def build_rollouts(self, step):
        self.built.append(step)
        if step == self.fail_build_at:
            raise RuntimeError("generator died")
        version = self.served
        if step in self.lie_at:
            self.lie_at.discard(step)
            version = step - self.loop.max_policy_age - 1
        with self.busy("generator"):
            await asyncio.sleep(self.generate_s)
        return [(step * PROMPTS + p, version) for p in range(PROMPTS) for _ in range(GROUP)]

    def policy_versions(self, rollouts):
        return [version for _, version in rollouts]

    async def train_step(self, step, rollouts):
        await asyncio.sleep(self.train_s)
        if step == self.fail_train_at:
            raise FloatingPointError("injected")
        self.trained[step] = (self.trainer_version, list(rollouts))
        return {"loss": float(step)}

    async def push_weights(self, version):
        await asyncio.sleep(0)

    async def fetch_weights(self, version):
        await asyncio.sleep(self.fetch_s)
        if version == self.fail_fetch_at:
            raise ConnectionError("generator unreachable")
        self.served = version

    def rows(self):
        lines = (self.metrics.log_dir / "metrics.jsonl").read_text().splitlines()
        return {row["step"]: row for row in map(json.loads, lines) if "loss" in row}


async def run(job):
    """``job.run()``, failing after 20 s instead of hanging (a broken bound can deadlock)."""
    await asyncio.wait_for(job.run(), timeout=20)


def ages(job):
    """``trainer version - sample version`` of every trained sample."""
    return [version_at - v for version_at, samples in job.trained.values() for _, v in samples]


@pytest.mark.parametrize("max_policy_age", [1, 2])
@pytest.mark.parametrize(
    ("train_s", "generate_s"), [(0.02, 0.002), (0.002, 0.02)],
    ids=["slow_trainer", "slow_generator"],
)
@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_no_trained_sample_is_older_than_max_policy_age(
    tmp_path, mode, train_s, generate_s, max_policy_age
):
    # The weight sync is slower than a step: the generator would fall behind unbounded.
    job = Job(tmp_path, mode=mode, max_policy_age=max_policy_age, train_s=train_s,
              generate_s=generate_s, fetch_s=0.03)
    await run(job)
    assert sorted(job.trained) == list(range(10))
    for step, (version_at, samples) in job.trained.items():
        assert version_at == step
        for _, version in samples:  # every sample of the 10-step run
            assert step - max_policy_age <= version <= step, (step, version)
    rows = job.rows()
    assert [rows[s]["rollout/dropped_samples"] for s in range(1, 11)] == [0] * 10
    assert max(rows[s]["rollout/policy_age_max"] for s in rows) == max(ages(job))
    if mode == "async" and train_s > generate_s:
        # The generator ran ahead of the trainer as far as the bound allows.
        assert max(ages(job)) == max_policy_age


async def test_stale_rollouts_are_dropped_counted_and_built_again(tmp_path):
    job = Job(tmp_path, max_policy_age=1, train_s=0.005, lie_at=(3, 6))
    await run(job)
    assert sorted(job.trained) == list(range(10))
    assert 0 <= min(ages(job)) and max(ages(job)) <= 1
    assert job.built.count(3) == job.built.count(6) == 2  # built again after the drop
    dropped = {step - 1: row["rollout/dropped_samples"] for step, row in job.rows().items()}
    assert dropped == {s: (PROMPTS * GROUP if s in (3, 6) else 0) for s in range(10)}
    positions = [p for _, samples in job.trained.values() for p, _ in samples]
    assert sorted(set(positions)) == list(range(10 * PROMPTS))  # still all trained, once
    assert len(positions) == 10 * PROMPTS * GROUP


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_every_prompt_is_trained_exactly_once_across_a_kill_and_resume(tmp_path, mode):
    # Killed while training step index 7, after the checkpoint of step 6 (indices 0-5).
    killed = Job(tmp_path / "run", mode=mode, max_policy_age=2, train_s=0.01,
                 generate_s=0.001, save_every=3, fail_train_at=7)
    with pytest.raises(FloatingPointError):
        await run(killed)
    assert killed.saved == [3, 6]
    committed = {s: v for s, v in killed.trained.items() if s < killed.saved[-1]}
    if mode == "async":
        # Rollouts ahead of the trainer were in flight or ready when it was killed.
        assert max(killed.built) > max(killed.trained) + 1
    resumed = Job(tmp_path / "run", mode=mode, max_policy_age=2, train_s=0.01,
                  generate_s=0.001, save_every=3, resume_at=killed.saved[-1])
    await run(resumed)
    assert resumed.built[0] == 6  # the killed run's step 7 onwards is regenerated
    trained = [p for _, samples in (*committed.values(), *resumed.trained.values())
               for p, _ in samples]
    counts = {p: trained.count(p) for p in set(trained)}
    assert counts == {p: GROUP for p in range(10 * PROMPTS)}  # each prompt once, whole group


async def test_async_with_max_policy_age_0_builds_and_trains_what_sync_does(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        job = Job(tmp_path / mode, mode=mode, max_policy_age=0, train_s=0.003,
                  generate_s=0.001, fetch_s=0.002)
        await run(job)
        runs[mode] = job
    assert runs["async"].built == runs["sync"].built == list(range(10))
    assert runs["async"].trained == runs["sync"].trained
    assert set(ages(runs["async"])) == {0}


@pytest.mark.parametrize(
    ("fault", "error"),
    [({"fail_build_at": 4}, RuntimeError), ({"fail_fetch_at": 3}, ConnectionError)],
    ids=["rollout_task", "weight_fetch"],
)
async def test_a_background_failure_stops_the_run_with_its_error(tmp_path, fault, error):
    job = Job(tmp_path, max_policy_age=1, train_s=0.005, **fault)
    with pytest.raises(error):
        await run(job)  # raised, not waited on forever
    assert job.stopped == ["generator", "trainer", "store"]
    assert job._rollout_task.task.done()


async def test_cancellation_like_ctrl_c_twice_stops_the_rollout_task(tmp_path):
    job = Job(tmp_path, steps=1000, max_policy_age=2, train_s=0.01, generate_s=0.001)
    task = asyncio.create_task(job.run())
    while len(job.trained) < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job._rollout_task.task.cancelled()
    assert job.stopped == ["generator", "trainer", "store"]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_step_metrics_are_logged_and_consistent(tmp_path, mode):
    job = Job(tmp_path, mode=mode, max_policy_age=1, train_s=0.004, generate_s=0.004)
    await run(job)
    for step, row in job.rows().items():
        seconds = row["time/step"]
        assert seconds > 0
        for role in ("trainer", "generator"):
            assert 0 <= row[f"time/{role}_idle"] <= seconds
        assert row["throughput/samples_per_s"] == pytest.approx(PROMPTS * GROUP / seconds)
        versions = [v for _, v in job.trained[step - 1][1]]
        assert row["rollout/policy_age_mean"] == pytest.approx(
            sum(step - 1 - v for v in versions) / len(versions)
        )
        assert row["rollout/policy_age_max"] == max(step - 1 - v for v in versions)
