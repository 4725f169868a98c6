"""A run's roles as a declarative list (forge_ext.runtime.roles, issue 46): the roles without
an environment of their own spawn at once, each with one spawns alone with it set in this
process; the start-up lines name each part in spec order whatever order they came up in;
a failed stop is one line naming the role; and the RL run's list holds each model role and
reward model (forge_ext.actors.rl_roles), with their environments, on fakes (no process
is spawned)."""

import asyncio
import os
from types import SimpleNamespace

import pytest

from forge_ext.runtime.roles import Roles, RoleSpec


class Handle:
    def __init__(self, name, setup=None, fail_stop=False):
        self.name, self.fail_stop, self.stopped = name, fail_stop, False
        self.procs = f"{name} procs"
        self.startup = {"setup": setup} if setup is not None else {}

    async def stop(self):
        self.stopped = True
        if self.fail_stop:
            raise RuntimeError("mesh gone")


@pytest.mark.asyncio
async def test_roles_spawn_at_once_unless_they_bring_an_environment_and_report_in_spec_order():
    running, peak, seen_env = set(), [0], {}

    def spawner(name, delay, setup=None, fail_stop=False):
        async def spawn():
            running.add(name)
            peak[0] = max(peak[0], len(running))
            seen_env[name] = os.environ.get("FORGE_TEST_ROLE")
            await asyncio.sleep(delay)
            running.discard(name)
            return Handle(name, setup, fail_stop)
        return spawn

    ready = {}
    specs = [
        RoleSpec(name="trainer", spawn=spawner("trainer", 0.05, setup=0.01),
                 ready=lambda h: ready.setdefault("trainer", h)),
        RoleSpec(name="scorer", spawn=spawner("scorer", 0.0), env={"FORGE_TEST_ROLE": "x"},
                 label="reward model s"),
        RoleSpec(name="generator", spawn=spawner("generator", 0.0, fail_stop=True)),
    ]
    roles = Roles()
    await roles.timed("hosts", asyncio.sleep(0))
    await roles.start(specs)
    assert peak[0] == 2  # trainer and generator together; the scorer alone, after them
    assert seen_env == {"trainer": None, "generator": None, "scorer": "x"}
    assert "FORGE_TEST_ROLE" not in os.environ
    assert ready["trainer"] is roles.handles["trainer"]
    lines = roles.startup_lines()
    assert [line.split()[1] for line in lines] == ["hosts", "trainer", "scorer", "generator",
                                                   "all"]
    assert "(processes and imports " in lines[1] and ", setup 0.0s)" in lines[1]
    assert lines[2].endswith("s") and "setup" not in lines[2]
    assert lines[-1].startswith("start-up: all roles ready ") and lines[-1].endswith(
        "s after setup began")
    assert list(roles.meshes(first=("trainer", "generator"))) == [
        "trainer", "generator", "reward model s"]
    written = []
    await roles.stop(written.append)
    assert all(h.stopped for h in roles.handles.values())
    assert written == ["stopping the generator failed: RuntimeError('mesh gone')"]


def test_the_rl_run_lists_its_model_roles_then_its_reward_models_with_their_environments():
    from forge_ext.actors.rl_roles import rl_role_specs, role_names

    env = SimpleNamespace(env={})
    config = SimpleNamespace(
        reference={"engine": "titan"}, critic=None, hosts=SimpleNamespace(launcher="local"),
        procs=SimpleNamespace(env={"OMP_NUM_THREADS": "1"}, trainer=SimpleNamespace(
            env={"A": "1"}), reference=env, critic=env, generator=env),
        reward=SimpleNamespace(functions=[
            SimpleNamespace(model=None, metric_name="exact", env={}),
            SimpleNamespace(model="/rm", metric_name="my rm", env={"B": "2"})]))
    assert role_names(config) == ["trainer", "reference", "generator"]
    kept = []
    specs = rl_role_specs(config, SimpleNamespace(spawn_procs=None, spawn_replica_procs=None),
                          tok=None, weights={}, ready=lambda *a: kept.append(a),
                          reward_model_ready=lambda *a: kept.append(a))
    assert [(s.name, dict(s.env), s.label) for s in specs] == [
        ("trainer", {"A": "1"}, None), ("reference", {}, None), ("generator", {}, None),
        ("reward_model.my_rm", {"B": "2"}, "reward model my rm")]
    specs[0].ready("trainer handle")
    specs[-1].ready("model handle")
    assert kept == [("trainer", "trainer handle"), ("my rm", "model handle")]
