"""PPO end to end (issue 35 test 4): the GRPO app with ``algorithm.advantage: gae`` and a
critic role (``configs/ppo_cpu_demo.yaml``) on real Monarch actors, one sample per prompt,
``critic.warmup_steps: 1``. A run that crashes mid-step 4 (``debug.fail_at_step=4``: after
its critic update, before its policy update) leaves the checkpoints of step 2 (policy and
critic); the rerun resumes there, and its critic continues exactly: the critic loss of step 3
(restored weights) and of step 4 (restored Adam moments and LR schedule, which step 3's
update used) equal the crashed run's, which was never stopped before them."""

import math

import pytest
import pytest_asyncio
from conftest import history

from apps.grpo.config import load_config
from apps.grpo.main import RLApp

pytestmark = pytest.mark.asyncio(loop_scope="module")

PPO = "configs/ppo_cpu_demo.yaml"
CRITIC_KEYS = ("critic/loss", "critic/grad_norm", "critic/clip_fraction", "critic/lr",
               "critic/explained_variance", "critic/values_mean", "critic/returns_mean",
               "advantage/mean", "advantage/std")


class CriticRecording(RLApp):
    """The app as shipped, plus each step's critic metrics (recorded before the policy's
    update, so the crashing step's are kept) and the policy's own update count."""

    def __init__(self, config):
        super().__init__(config)
        self.critic_metrics, self.policy_updates = {}, {}

    async def critic_step(self, packed, batch):
        metrics = await super().critic_step(packed, batch)
        self.critic_metrics[self.step] = metrics
        return metrics

    async def train_step(self, step, rollouts):
        metrics = await super().train_step(step, rollouts)
        self.policy_updates[step] = await self.trainer.get_policy_version()
        return metrics


def overrides(checkpoint, output_dir, *extra):
    return [
        f"model.hf_path={checkpoint}", f"output_dir={output_dir}",
        "task.num_train=64", "task.num_eval=4",
        # About half the completions score 1 (a random model rarely adds up): returns vary.
        "reward.functions=[{fn: 'grpo_reference:parity_reward'}]",
        "grpo.prompts_per_step=8", "trainer.training.local_batch_size=8",
        "critic.training.local_batch_size=8",
        # No reference role: a run's time here is its procs' start (two runs x each role's
        # imports and model), and the critic's resume does not involve the KL reference.
        "reference=null", "loss.kl_coef=0",
        "critic.warmup_steps=1", "trainer.optimizer.lr=1e-3",
        "loop.steps=4", "loop.eval_every=0", "loop.save_every=2",
        "procs.env={}",  # leave the test process's thread settings alone
        *extra,
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runs(demo_checkpoint, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("ppo"))
    crashed = CriticRecording(load_config(PPO, overrides(demo_checkpoint, output_dir,
                                                         "debug.fail_at_step=4")))
    with pytest.raises(Exception, match="gradient norm is nan"):
        await crashed.run()
    rows = history(output_dir)
    resumed = CriticRecording(load_config(PPO, overrides(demo_checkpoint, output_dir)))
    await resumed.run()
    return crashed, resumed, rows, history(output_dir)


async def test_a_resumed_ppo_run_continues_the_critic_exactly(runs):
    crashed, resumed, _, _ = runs
    assert sorted(crashed.critic_metrics) == [0, 1, 2, 3]  # step 4's critic update ran
    assert sorted(resumed.critic_metrics) == [2, 3]  # resumed from the checkpoint of step 2
    for step in (2, 3):
        before, after = crashed.critic_metrics[step], resumed.critic_metrics[step]
        for key in ("critic/loss", "critic/grad_norm", "critic/values_mean",
                    "critic/explained_variance"):
            assert after[key] == pytest.approx(before[key], rel=1e-6, abs=1e-9), (step, key)
    # Not vacuous: the critic moved between the steps compared.
    assert crashed.critic_metrics[3]["critic/loss"] != crashed.critic_metrics[2]["critic/loss"]


async def test_ppo_steps_log_the_critic_and_advantage_metrics(runs):
    _, _, crashed_rows, rows = runs
    trained = {r["step"]: r for r in rows if "critic/loss" in r}
    assert sorted(trained) == [1, 2, 3, 4]
    for step, row in trained.items():
        for key in CRITIC_KEYS:
            assert math.isfinite(row[key]), (step, key)
        assert row["critic/explained_variance"] <= 1.0
        assert row["advantage/std"] > 0 and 0 <= row["critic/clip_fraction"] <= 1
    # The critic starts at V = 0 (a zero value head on the policy's trunk).
    assert trained[1]["critic/values_mean"] == 0.0


async def test_critic_warmup_steps_train_the_critic_before_the_policy_moves(runs):
    crashed, resumed, crashed_rows, _ = runs
    # critic.warmup_steps=1: step 1 updates the critic only; the policy's count of updates
    # lags the loop's by one, across the resume too.
    assert crashed.policy_updates == {0: 0, 1: 1, 2: 2}
    assert resumed.policy_updates == {2: 2, 3: 3}
    first = next(r for r in crashed_rows if r["step"] == 1)
    assert first["loss"] is None  # no policy loss (NaN, written as null)
    assert math.isfinite(first["critic/loss"])
