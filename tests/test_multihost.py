"""Roles on several (simulated) hosts, through ``forge_ext.runtime.placement`` and Monarch's
``ProcessJob`` (each host a worker process of its own on this machine):

- a DP=2 trainer over 2 hosts (1 proc each, FSDP: each host holds half of every parameter)
  and a PP=2 trainer with one stage per host give the loss and gradients of the same model
  on one host in one process (the full batch, no parallelism: what DP=2 on one host equals,
  tests/test_trainer_actor.py), from the same weights and a batch whose DP ranks hold 10
  and 120 valid tokens;
- its torch.distributed world spans both hosts (rank = host, MASTER_ADDR host 0's name);
- weights its ranks publish from both hosts are fetched on a third host, with the weight
  transport's same-host shortcut off (``weights.same_host: off``);
- its checkpoint saves and resumes;
- a proc that dies stops an RL loop with one error naming the role, rank and signal (not
  the Ctrl-C Monarch's default fault hook looked like), on the local launcher and on a host
  that two roles share: a dead proc is named by its own role, a dead host by both roles;
- config errors of the ``hosts:`` section come before any process starts.
"""

import asyncio
import copy
import functools
import glob
import os
import signal
import socket
import sys
from pathlib import Path

import cloudpickle
import psutil
import pytest
import pytest_asyncio
import torch
from conftest import full, make_lm_batch, random_state_dict
from monarch.actor import Actor, current_rank, endpoint

from forge_ext.actors import spawn_trainer
from forge_ext.rl.loop import LoopConfig, RLLoop
from forge_ext.runtime.metrics import MetricsConfig
from forge_ext.runtime.hosts import HostsConfig, RoleHosts
from forge_ext.runtime.placement import Placement
from forge_ext.runtime.supervision import UNANSWERED, FailureWatch, RoleFailure, watch_run

module_loop = pytest.mark.asyncio(loop_scope="module")
# Spawned procs cannot import test modules: ship the probe actors by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 8
TRAINER = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": BATCH, "seq_len": 64, "max_norm": 1.0e6, "steps": 100},
    "optimizer": {"lr": 3e-3},
    "seed": 7,
}
# Rows 0-3 (DP rank 0) hold 4+3+2+1 = 10 valid tokens, rows 4-7 (rank 1) 31+30+29+30 = 120.
DP_PREFIX = [27, 28, 29, 30, 0, 1, 2, 1]
WEIGHTS = {"transport": "direct", "key_prefix": "multihost", "same_host": "off"}


def config(dp=1, pp=1, **extra):
    c = copy.deepcopy(TRAINER)
    c["training"]["local_batch_size"] = BATCH // dp
    c["parallelism"] = {"data_parallel_shard_degree": dp, "pipeline_parallel_degree": pp}
    if pp > 1:
        c["parallelism"].update(pipeline_parallel_microbatch_size=2,
                                pipeline_parallel_schedule="1F1B")
    c.update(extra)
    return c


def split(batch, dp):
    return ([{"input_ids": t} for t in batch["input_ids"].chunk(dp)],
            [{"labels": t} for t in batch["labels"].chunk(dp)])


async def processes_placement(**roles) -> Placement:
    """A started ``processes`` placement: ``roles`` maps a role to its hosts (1 proc each)."""
    hosts = HostsConfig(launcher="processes", **{r: RoleHosts(hosts=n) for r, n in roles.items()})
    placement = Placement(hosts, dict(roles))
    await placement.start()
    return placement


class Probe(Actor):
    """Where a proc runs and what torch.distributed environment it was given."""

    @endpoint
    async def where(self) -> dict:
        return {"pid": os.getpid(), "parent": os.getppid(), "hostname": socket.gethostname(),
                "point": dict(current_rank()), **{k: os.environ.get(k) for k in
                                                  ("RANK", "WORLD_SIZE", "MASTER_ADDR")}}


class Reader(Actor):
    """A reader of published weights on its own host."""

    @endpoint
    async def fetch(self, version: int, key_prefix: str) -> dict:
        from forge_ext.weights.fetch import fetch_weights

        return await fetch_weights(version, key_prefix=key_prefix)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainers(store, tmp_path_factory):
    dp_hosts = await processes_placement(trainer=2, generator=1)  # generator: reader's host
    pp_hosts = await processes_placement(trainer=2)
    ckpt = {"checkpoint": {"enable": True, "folder": "ckpt"},
            "dump_folder": str(tmp_path_factory.mktemp("multihost_ckpt"))}
    handles = {}
    try:
        handles["dp2"], handles["pp2"] = await asyncio.gather(
            spawn_trainer(config(dp=2, **ckpt), weights=WEIGHTS,
                          spawn_procs=functools.partial(dp_hosts.spawn_procs, "trainer")),
            spawn_trainer(config(pp=2),
                          spawn_procs=functools.partial(pp_hosts.spawn_procs, "trainer")),
        )
        weights = random_state_dict(await handles["dp2"].get_hf_state_dict(), seed=4, std=0.05)
        yield {**handles, "dp_hosts": dp_hosts, "weights": weights}
    finally:
        # The proc meshes are stopped (Monarch's exit-time shutdown then has nothing left
        # to wait on) without the trainers' cleanup calls, then the jobs are killed.
        await asyncio.gather(*(h.procs.stop() for h in handles.values()),
                             return_exceptions=True)
        dp_hosts.stop()
        pp_hosts.stop()


def one_host_step(weights, batch):
    """Loss, valid tokens and gradients of the same model and batch in this process: one
    rank, the whole batch, no parallelism (the reference)."""
    from forge_ext.engine import TitanEngine, cross_entropy_loss, valid_tokens
    from forge_ext.engine.distributed import init_single_process_env

    init_single_process_env()
    engine = TitanEngine(config())
    engine.load_model_state_dict(engine.sd_adapter.from_hf(weights))
    engine.optimizer_zero_grad()
    out = engine.forward_backward_batch(engine.microbatches(batch), cross_entropy_loss,
                                        valid_tokens)
    grads = {n: full(p.grad).clone() for n, p in engine.model_parts[0].named_parameters()}
    engine.close()
    return out.loss, out.global_weight, grads


@pytest.mark.parametrize("name, dp", [("dp2", 2), ("pp2", 1)])
@module_loop
async def test_trainer_over_two_hosts_equals_one_process_on_one_host(trainers, name, dp):
    """Same weights and batch: the loss, valid-token count and every gradient of DP=2 over
    2 hosts (FSDP shards split between them) and of PP=2 with one stage per host equal one
    process's on the whole batch."""
    batch = make_lm_batch(BATCH, 32, 256, seed=11, ignore_prefix=DP_PREFIX)
    assert [int((t != -100).sum()) for t in batch["labels"].chunk(2)] == [10, 120]
    loss_ref, tokens_ref, g_ref = one_host_step(trainers["weights"], batch)
    other = trainers[name]
    await other.load_hf_state_dict(trainers["weights"])
    fb = await other.forward_backward(*split(batch, dp))
    g = await other.get_gradients()
    await other.optim_step()  # clears the gradients
    assert fb["loss"] == pytest.approx(loss_ref, rel=1e-5)
    assert fb["num_tokens"] == tokens_ref == 130
    assert set(g) == set(g_ref)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-5, atol=1e-6, msg=k)


@module_loop
async def test_the_world_spans_the_hosts(trainers):
    """Rank r runs on host r (a worker process of its own), and every rank's MASTER_ADDR is
    host 0's name, not localhost."""
    dp2, dp_hosts = trainers["dp2"], trainers["dp_hosts"]
    where = list((await dp2.procs.spawn("probe", Probe).where.call()).values())
    workers = [dp_hosts.job._host_to_pid[f"trainer_{h}"].pid for h in (0, 1)]
    assert [w["point"] for w in where] == [{"hosts": 0, "procs": 0}, {"hosts": 1, "procs": 0}]
    assert [w["parent"] for w in where] == workers
    assert [w["RANK"] for w in where] == ["0", "1"]
    assert {w["WORLD_SIZE"] for w in where} == {"2"}
    assert {w["MASTER_ADDR"] for w in where} == {where[0]["hostname"]}
    assert where[0]["hostname"] not in ("localhost", "127.0.0.1")


@module_loop
async def test_weights_published_from_two_hosts_are_fetched_on_a_third(trainers):
    """Each trainer host publishes its own FSDP shards (torchstore clients on both hosts,
    the store's volume on the controller's); a reader on a third host fetches the version
    whole and equal to the trainer's weights."""
    dp2, dp_hosts = trainers["dp2"], trainers["dp_hosts"]
    pushed = await dp2.actor.push_weights.call(7)
    assert all(r["bytes"] > 0 for r in pushed.values())  # both hosts wrote their shards
    reader = dp_hosts.spawn_procs("generator").spawn("reader", Reader)
    fetched = await reader.fetch.call_one(7, WEIGHTS["key_prefix"])
    expected = await dp2.get_hf_state_dict()
    assert set(fetched) == set(expected)
    for k in expected:
        assert torch.equal(fetched[k], expected[k]), k


@module_loop
async def test_a_two_host_checkpoint_saves_and_resumes(trainers):
    """Save, train a step; load the checkpoint and train the same step: the same loss and
    the same weights (the optimizer and LR state came back too)."""
    dp2 = trainers["dp2"]
    batch = make_lm_batch(BATCH, 32, 256, seed=12, ignore_prefix=DP_PREFIX)
    await dp2.train_step(*split(batch, 2))  # Adam moments exist before the save
    step = await dp2.save_checkpoint()
    first = await dp2.train_step(*split(batch, 2), return_metrics=True)
    w_first = await dp2.get_hf_state_dict()
    assert await dp2.load_checkpoint(step) == step
    again = await dp2.train_step(*split(batch, 2), return_metrics=True)
    for key in ("loss", "grad_norm", "lr"):
        assert again[key] == pytest.approx(first[key], rel=1e-6), key
    w_again = await dp2.get_hf_state_dict()
    for k in w_first:
        torch.testing.assert_close(w_again[k], w_first[k], rtol=0, atol=0, msg=k)


# ---- a dead proc or host: one error naming its role(s) ----------------------------------------
class Sleeper(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def work(self) -> None:
        await asyncio.sleep(120)


class KilledRun(RLLoop):
    """An RL loop whose roles (a :class:`Sleeper` each, spawned as the app spawns a role: a
    proc mesh and an actor both named after it, through :class:`Placement`, under
    :func:`watch_run`) lose a process mid-step: ``victim(run)`` is the pid SIGKILLed (a
    role's proc, or a host's worker process), as an out-of-memory kill would."""

    def __init__(self, log_dir, victim, hosts=None, processes=None):
        super().__init__(LoopConfig(steps=3), MetricsConfig(log_dir=str(log_dir),
                                                            tensorboard=False, plot=None))
        self.victim, self.hosts = victim, hosts or HostsConfig()
        self.processes = processes or {"trainer": 2}
        self.lines, self.actors, self.pids, self.workers = [], {}, {}, {}

    async def setup(self):
        self.placement = Placement(self.hosts, self.processes)
        self.watch = watch_run(self, self.placement)
        await self.placement.start()

        async def stop_hosts():
            self.placement.stop()

        self.track("hosts", stop_hosts)
        if self.placement.owns_workers:
            self.workers = {name: state.pid
                            for name, state in self.placement.job._host_to_pid.items()}
        for role in self.processes:
            procs = self.placement.spawn_procs(role)
            if not self.placement.owns_workers:  # else the job's kill stops them at once
                self.track(role, procs.stop)
            self.actors[role] = procs.spawn(role, Sleeper)
            self.pids[role] = list((await self.actors[role].pid.call()).values())

    async def build_rollouts(self, step):
        os.kill(self.victim(self), signal.SIGKILL)
        await asyncio.gather(*(actor.work.call() for actor in self.actors.values()))

    def policy_versions(self, rollouts):
        return []

    def write(self, line):
        self.lines.append(line)

    def explain_error(self, error):
        return self.watch.explain(error)

    async def load_checkpoint(self):
        return 0

    async def train_step(self, step, rollouts):
        return {}

    async def push_weights(self, version):
        pass

    async def fetch_weights(self, version):
        pass

    async def evaluate(self, step):
        return {}

    async def save_checkpoint(self, step):
        pass


SIGKILL_HINT = ("was killed by SIGKILL (signal 9): most often the kernel's out-of-memory "
                "killer (see `dmesg` or the node's memory), else a `kill -9` or the scheduler")


def sigkill_messages(what: str) -> set[str]:
    """What a SIGKILLed proc may be reported as: Monarch's report names the signal, unless
    its poll of the proc's state was in flight (then ~30 s later, without the signal)."""
    return {f"{what} {SIGKILL_HINT}", f"{what} {UNANSWERED[0]}: {UNANSWERED[1]}"}


@module_loop
async def test_a_dead_proc_on_this_machine_is_one_error_not_an_interrupt(tmp_path):
    run = KilledRun(tmp_path, victim=lambda run: run.pids["trainer"][1])
    with pytest.raises(RoleFailure) as failure:
        await asyncio.wait_for(run.run(), 90)
    assert str(failure.value) in sigkill_messages("the trainer's rank 1 on this machine")
    assert not any("interrupt" in line for line in run.lines), run.lines
    survivor = run.pids["trainer"][0]
    assert not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == \
        psutil.STATUS_ZOMBIE


async def until(condition, timeout_s: float) -> None:
    """Poll ``condition()`` every 0.1 s until true; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


@module_loop
async def test_a_report_of_a_proc_spawned_before_the_run_is_not_the_runs_failure():
    """Monarch reports a dead proc once per mesh on it, some long after the death, by the
    spawn name every run reuses (``trainer``): in CI a report of an earlier run's proc
    arriving as the next run started was taken for the next run's failure. A proc spawned
    before the run's watch began and killed during it costs the run nothing; the run's own
    proc, of the same name, is its failure."""
    from monarch.actor import this_host

    async def spawn_and_kill() -> None:
        procs = this_host().spawn_procs(per_host={"procs": 1}, name="trainer")
        pid = await procs.spawn("trainer", Sleeper).pid.call_one()
        os.kill(pid, signal.SIGKILL)

    def watch(**kwargs) -> FailureWatch:
        return FailureWatch({"trainer": "trainer"}, lambda role, host: "this machine",
                            lambda failure: None, **kwargs)

    earlier_procs = this_host().spawn_procs(per_host={"procs": 1}, name="trainer")
    earlier_pid = await earlier_procs.spawn("trainer", Sleeper).pid.call_one()
    # Every report reaches every active watch in one call of the hook: ``everything``
    # (told every mesh is its run's) shows when the earlier proc's report has come.
    with watch() as run, watch(spawned=lambda mesh_name: True) as everything:
        os.kill(earlier_pid, signal.SIGKILL)
        await until(lambda: everything.failure is not None, 90)
        await asyncio.sleep(0.5)
        assert run.failure is None, f"an earlier proc's death failed the run: {run.failure}"
        await spawn_and_kill()
        await until(lambda: run.failure is not None, 90)
    assert str(run.failure) in sigkill_messages("the trainer's rank 0 on this machine")


# Reference and generator share one host (hosts.<role>.group).
SHARED_HOST = HostsConfig(launcher="processes", reference=RoleHosts(group="rollout"),
                          generator=RoleHosts(group="rollout"))
SHARED_HOST_VICTIMS = {"reference": lambda run: run.pids["reference"][0],  # its proc
                       "host": lambda run: run.workers["rollout_0"]}  # the host's worker


@pytest.mark.parametrize("killed", ["reference", "host"])
@module_loop
async def test_the_dead_proc_or_host_is_named_by_its_own_roles(tmp_path, killed):
    """Reference and generator on one host: a dead reference proc is named by its role
    alone (not "the trainer's", not the other role on its host, not the host's group), a
    dead host by both roles, with the rank and the host."""
    run = KilledRun(tmp_path, victim=SHARED_HOST_VICTIMS[killed], hosts=SHARED_HOST,
                    processes={"reference": 1, "generator": 1})
    with pytest.raises(RoleFailure) as failure:
        await asyncio.wait_for(run.run(), 90)
    where = f"host 0 of 1 (worker pid {run.workers['rollout_0']})"
    if killed == "host":
        assert str(failure.value) == f"the reference and generator's {where} {SIGKILL_HINT}"
    else:
        assert str(failure.value) in sigkill_messages(f"the {killed}'s rank 0 on {where}")
        assert (failure.value.role, failure.value.rank) == (killed, 0)


# ---- config errors -------------------------------------------------------------------------
DEMO = str(Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from forge_ext.tasks.tokenizer import VOCAB_SIZE, save_tokenizer
    from forge_ext.engine.hf_checkpoint import init_hf_checkpoint

    root = tmp_path_factory.mktemp("multihost_ckpt_cfg")
    save_tokenizer(root / "tok")
    arch = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=64, tie_word_embeddings=False)
    return str(init_hf_checkpoint(root / "init", "qwen3", arch, seed=0,
                                  tokenizer_from=root / "tok"))


@pytest.mark.parametrize("overrides, message", [
    (["hosts.launcher=processes", "hosts.trainer.hosts=2", "hosts.trainer.procs_per_host=2",
      "trainer.parallelism.data_parallel_shard_degree=1"],
     "hosts.trainer.hosts=2 x hosts.trainer.procs_per_host=2 = 4 processes, but "
     "trainer.parallelism needs 1 (the product of its degrees"),
    (["hosts.launcher=processes", "hosts.reference.hosts=3",
      "reference.parallelism.data_parallel_shard_degree=2"],
     "reference: 2 processes do not split over hosts.reference.hosts=3"),
    (["hosts.launcher=kubernetes"],
     "hosts.launcher='kubernetes' must be one of 'local', 'processes', 'slurm', 'attach'"),
    (["hosts.launcher=slurm"], "hosts.launcher=slurm needs hosts.slurm.partition"),
    (["hosts.trainer.hosts=2"], "hosts.trainer.hosts=2 needs a multi-host launcher"),
    (["hosts.launcher=attach", "hosts.attach.trainer=[tcp://127.0.0.1:26600]"],
     "hosts.launcher=attach: hosts.attach.reference lists no worker addresses"),
    (["hosts.launcher=processes", "hosts.generator.hosts=2"],
     "generator: 1 processes do not split over hosts.generator.hosts=2"),
    (["hosts.launcher=processes", "hosts.generator.hosts=2", "generator.replicas=3"],
     "generator: 3 processes do not split over hosts.generator.hosts=2"),
    (["procs.generator.num_procs=2"],
     "procs.generator.num_procs=2: the generator runs one process per replica; set "
     "generator.replicas"),
    (["hosts.trainer.hostz=2"], "unknown key 'hosts.trainer.hostz'"),
    (["procs.trainer.num_procs=2", "hosts.trainer.procs_per_host=1"],
     "procs.trainer.num_procs=2 but hosts.trainer.hosts=1 x hosts.trainer.procs_per_host=1"),
    (["weights.same_host=never"], "weights.same_host='never' must be one of 'auto', 'off'"),
])
def test_hosts_config_errors_come_before_any_process_starts(tiny_checkpoint, tmp_path,
                                                            overrides, message):
    from apps.grpo.config import load_config
    from apps.grpo.main import RLApp

    children = {p.pid for p in psutil.Process().children(recursive=True)}
    jobs = set(glob.glob("/tmp/monarch_process_job_*"))
    with pytest.raises(ValueError) as error:
        RLApp(load_config(DEMO, [f"model.hf_path={tiny_checkpoint}",
                                   f"output_dir={tmp_path}", *overrides]))
    assert message in str(error.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    assert set(glob.glob("/tmp/monarch_process_job_*")) <= jobs
    assert not (tmp_path / "run_config.yaml").exists()


def test_two_node_gpu_config_validates_with_slurm_and_with_attached_workers(tmp_path,
                                                                            monkeypatch):
    """configs/grpo_qwen3_0.6b_2nodes.yaml, validated as the controller of a GPU cluster
    would (nothing is submitted): trainer and reference sharing one node x 8, the other node's
    8 GPUs all generation (8 replicas of tp=1, or 4 of tp=2); the trainer publishes with
    same_host off; replicas x tp beyond a node's GPUs, or no partition, are refused."""
    from test_configs import write_qwen3_config

    from apps.grpo.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = write_qwen3_config(tmp_path / "Qwen3-0.6B", "0.6b")
    two_nodes = str(Path(DEMO).parent / "grpo_qwen3_0.6b_2nodes.yaml")
    for extra in (["hosts.slurm.partition=gpu"],
                  ["hosts.launcher=attach", "hosts.attach.training=[tcp://node0:26600]",
                   "hosts.attach.generator=[tcp://node1:26600]"]):
        config = load_config(two_nodes, [f"model.hf_path={path}", *extra])
        placement = Placement(config.hosts, config.processes())
        assert placement.layout == {"trainer": (1, 8), "reference": (1, 8), "generator": (1, 8)}
        assert placement.groups == {"training": 1, "generator": 1}
        assert config.generator.replicas == 8
        assert not placement.same_host("trainer", ["generator"])
        assert placement.job is None and not placement.meshes  # nothing started
    tp2 = ["hosts.slurm.partition=gpu", "generator.replicas=4",
           "hosts.generator.procs_per_host=4", "generator.vllm.tensor_parallel_size=2"]
    assert load_config(two_nodes, [f"model.hf_path={path}", *tp2]).generator.replicas == 4
    with pytest.raises(ValueError, match=r"generator.replicas=8 over hosts.generator.hosts=1 "
                       r"\(8 per host\) x generator.vllm.tensor_parallel_size=2 needs 16 "
                       r"devices per host but hosts.slurm.gpus_per_host = 8"):
        load_config(two_nodes, [f"model.hf_path={path}", "hosts.slurm.partition=gpu",
                                "generator.vllm.tensor_parallel_size=2"])
    with pytest.raises(ValueError, match="hosts.slurm.partition"):
        load_config(two_nodes, [f"model.hf_path={path}"])


def test_monarch_reports_read_as_role_rank_host_and_cause():
    """The report texts Monarch 0.7.0 gives (seen on this machine) name the role, its rank,
    its host and what ended it; reports of a dead proc's helper actors name no role."""

    watch = FailureWatch({"trainer": "trainer", "generator": "generator"},
                         lambda role, host: f"host {host} of 2", lambda failure: None)
    killed = ("The actor <root>.<forge_ext.actors.trainer.RLTrainer trainer{'hosts': 1/2, "
              "'procs': 1/4}> and all its descendants have failed:\n  the process this actor "
              "was running on failed: Killed(sig=9)")
    assert str(watch.explain_text(killed)).startswith(
        "the trainer's rank 5 on host 1 of 2 was killed by SIGKILL (signal 9): most often")
    exited = killed.replace("failed: Killed(sig=9)", "exited with non-zero code 1")
    assert str(watch.explain_text(exited)) == (
        "the trainer's rank 5 on host 1 of 2 exited with code 1: its log says why")
    silent = ("Endpoint call generator.generate() failed, Supervision event: actor <root>."
              "<forge_ext.rollout.generator.Generator generator{'hosts': 0/1, 'procs': 0/1}> "
              "has status:\n  stopped: no status received from process")
    assert str(watch.explain_text(silent)) == (
        "the generator's rank 0 on host 0 of 2 stopped answering: its host died or cannot be "
        "reached (node failure, network)")
    helper = ("The actor logger-vit8G6phm8B{'hosts': 1/2, 'procs': 0/1} and all its "
              "descendants have failed:\n  the process this actor was running on failed: "
              "Killed(sig=9)")
    assert watch.explain_text(helper, roles_only=True) is None
    # A proc killed while Monarch's poll of its state was in flight (or one that hangs):
    # reported ~30 s later by its proc and the actor mesh polled, without signal or point.
    unanswered = ("Endpoint call trainer.work() failed, The actor trainer-3<Fg3oP5eihCy>@"
                  "trainer-3<Fg3oP5eihCy>.ipc:///tmp/monarch_process_job_eosnx8hs/trainer_1,"
                  "proc_agent and all its descendants have failed:\n  timeout waiting for "
                  "message from proc mesh agent while querying for \"{}\". The process "
                  "likely crashed")
    two_per_host = FailureWatch({"trainer": "trainer"}, lambda role, host: f"host {host} of 2",
                                lambda failure: None, procs_per_host={"trainer": 2})
    assert str(two_per_host.explain_text(unanswered.format("trainer-cXSgrxKEYJh"))) == (
        "the trainer's rank 3 on host 1 of 2 stopped answering: Monarch's poll of its state "
        "timed out, so it crashed or hangs while its host is up: its log says why, and "
        "`dmesg` whether the out-of-memory killer ended it")
    # The same about a helper actor of that proc (its logger) names the proc's role: the
    # proc meshes are named after their roles too.
    helper = unanswered.format("logger-y7AhvDHcjEf")
    assert str(two_per_host.explain_text(helper, roles_only=True)).startswith(
        "the trainer's rank 3 on host 1 of 2 stopped answering")
    other = helper.replace("trainer-3<", "anon-0<")
    assert two_per_host.explain_text(other, roles_only=True) is None
    assert watch.explain_text("no point in this text") is None
