"""The GRPO app with trainer, reference and generator on 3 simulated hosts
(``hosts.launcher: processes``, Monarch's ``ProcessJob``: each host a worker process of its
own on this machine), the weights crossing hosts on the transport's cross-host path
(``weights.same_host: off``, set by the placement because trainer and generator are on
different hosts):

1. 3 steps, then the trainer's host is killed (SIGKILL of its worker process) mid-step 4:
   the run stops with one error naming the role, host and signal, and no process of the run
   (workers, procs) is left;
2. the same command resumes from the step-3 checkpoint and finishes, sampling what the
   killed run sampled at step 4.
"""

import os
import shlex
import signal
import sys
from pathlib import Path

import cloudpickle
import pytest
import pytest_asyncio
from conftest import task_checkpoint
from test_grpo_app import Probe, history, overrides, still_running

from apps.grpo.config import load_config
from apps.grpo.console import failure_message
from apps.grpo.main import RLApp
from forge_ext.runtime.supervision import RoleFailure

pytestmark = pytest.mark.asyncio(loop_scope="module")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEMO = str(Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml")
HOSTS = ["hosts.launcher=processes"]  # one host per role: 3 hosts


class HostKillingApp(RLApp):
    """The app as shipped, plus a record of each step's rollouts and of every process of the
    run; with ``kill_at`` it SIGKILLs the trainer's host (its worker process) once that
    step's rollouts are done, before the trainer's step."""

    def __init__(self, config, kill_at=None):
        super().__init__(config)
        self.kill_at = kill_at
        self.rollouts = {}
        self.pids = []

    async def setup(self):
        await super().setup()
        self.pids += [state.pid for state in self.placement.job._host_to_pid.values()]
        for procs in (self.trainer.procs, self.reference.trainer.procs,
                      *(h.procs for h in self.generator.handles)):
            self.pids += list((await procs.spawn("probe", Probe).pid.call()).values())

    async def build_rollouts(self, step):
        rollouts = await super().build_rollouts(step)
        self.rollouts[step] = rollouts
        if step == self.kill_at:
            os.kill(self.placement.job._host_to_pid["trainer_0"].pid, signal.SIGKILL)
        return rollouts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return task_checkpoint(tmp_path_factory.mktemp("multihost_app_ckpt"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def killed_run(checkpoint, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("multihost_run"))
    argv = ["--config", DEMO, *overrides(checkpoint, output_dir, *HOSTS)]
    app = HostKillingApp(load_config(DEMO, argv[2:]), kill_at=3)
    with pytest.raises(RoleFailure) as failure:
        await app.run()
    assert 3 in app.rollouts, f"the run failed before its host was killed: {failure.value}"
    return app, output_dir, failure.value, argv


async def test_three_steps_run_across_hosts_on_the_cross_host_weight_path(killed_run):
    app, output_dir, _, _ = killed_run
    assert app.placement.layout == {"trainer": (1, 1), "reference": (1, 1), "generator": (1, 1)}
    assert app.trainer_weights["same_host"] == "off"
    rows = {r["step"]: r for r in history(output_dir) if "loss" in r}
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        assert rows[step]["policy_version"] == step
        # On-policy: step k sampled with version k - 1, pushed by the trainer's host and
        # fetched by the generator's.
        assert rows[step]["generator_version"] == step - 1
        assert {ep.policy_version for ep in app.rollouts[step - 1].episodes} == {step - 1}


async def test_a_killed_host_is_one_clear_error_and_leaves_no_process(killed_run):
    app, output_dir, failure, argv = killed_run
    worker = app.pids[0]
    assert str(failure) == (
        f"the trainer's host 0 of 1 (worker pid {worker}) was killed by SIGKILL (signal 9): "
        "most often the kernel's out-of-memory killer (see `dmesg` or the node's memory), "
        "else a `kill -9` or the scheduler"
    )
    message = failure_message(failure, app.config, argv)
    checkpoint = Path(output_dir) / "checkpoints" / "step-3"
    assert f"last checkpoint: step 3 ({checkpoint})" in message
    assert message.endswith("-m apps.grpo.main " + shlex.join(argv))  # the same command
    assert app.tracked == []
    assert len(app.pids) == 6  # 3 workers, 3 procs
    alive = still_running(app.pids)
    assert alive == [], f"processes of the run still running: {alive}"
    assert app.placement.job is None and app.placement.reaper is None
    assert sorted(os.listdir(os.path.join(output_dir, "checkpoints"))) == ["step-3"]


async def test_rerun_resumes_from_the_last_checkpoint(killed_run, checkpoint):
    killed, output_dir, _, argv = killed_run
    app = HostKillingApp(load_config(DEMO, argv[2:]))
    await app.run()
    assert sorted(app.rollouts) == [3]  # only the step that had not been committed
    assert [r["step"] for r in history(output_dir) if "loss" in r] == [1, 2, 3, 4]
    assert history(output_dir)[-1]["policy_version"] == 4
    # From the restored version-3 weights, the same prompts and samples as the killed run's
    # step 4: the checkpoint written across hosts is exact.
    assert app.rollouts[3].rows == killed.rollouts[3].rows
    assert [ep.response_ids.tolist() for ep in app.rollouts[3].episodes] == [
        ep.response_ids.tolist() for ep in killed.rollouts[3].episodes
    ]
