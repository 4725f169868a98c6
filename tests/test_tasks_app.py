"""A user's own task through the real apps (Monarch actors, torchstore, gloo): local dataset
files with a reward module of the user's (functions that work, and ones that raise, hang,
return NaN or a string), chat prompts through a chat tokenizer trained here, with the
transformers generator (a parquet file through vLLM: tests/test_multiturn_app.py); and a
reasoning-gym task through the SFT app and then the GRPO app, killed mid-run
and resumed.

What must hold: every sample's reward is what the user's function returned for that
completion (plus the other functions' known values), advantages come from those rewards,
failed calls score ``reward.on_error`` and are counted per function while the run finishes;
prompt ids are ``apply_chat_template`` of the messages and the on-policy importance ratio is
1; reasoning-gym rewards are its own ``score_answer``; a resumed run trains every prompt of
the stream exactly once.
"""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import pytest_asyncio
from conftest import Recording, chat_checkpoint, history, small

from apps.grpo.config import load_config
from forge_ext.rl.advantages import compute_group_advantages

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BASE = {"hf": str(CONFIGS / "grpo_cpu_demo.yaml"), "vllm": str(CONFIGS / "grpo_cpu_vllm.yaml")}

REWARDS = '''
import asyncio, math, time

def record(completion, prompt, answer, row, finished):
    # Any deterministic function of the completion: what the test checks the app stored (it
    # runs in a reward worker process: the test calls it again to know what it returned).
    return (sum(map(ord, completion)) % 7) / 6 + (0.5 if completion.strip() == answer else 0)

async def constant(completion):
    await asyncio.sleep(0)
    return 0.25

def raises(completion):
    raise ZeroDivisionError("a user's bug")

def hangs(completion):
    time.sleep(3)
    return 1.0

def nan(completion):
    return math.nan

def string(completion):
    return "0.5"
'''

FUNCTIONS = (
    "reward.functions=[{fn: 'user_rewards:record'}, {fn: 'user_rewards:constant'}, "
    "{fn: 'user_rewards:raises', weight: 0.5}, {fn: 'user_rewards:hangs', weight: 0.5}, "
    "{fn: 'user_rewards:nan', weight: 0.5}, {fn: 'user_rewards:string', weight: 0.5}]"
)
FAILING = ("raises", "hangs", "nan", "string")


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_task")
    (root / "user_rewards.py").write_text(textwrap.dedent(REWARDS))
    sys.path.insert(0, str(root))
    rows = [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": f"What is {i} plus {i}?"}],
             "question": f"Compute {i} times 2.", "answer": str(2 * i), "id": i}
            for i in range(12)]
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return root, chat_checkpoint(root)


# The parquet file and vLLM go through the app in tests/test_multiturn_app.py (a vLLM start
# costs ~90 s here: one module has it).
RUNS = {"hf": "jsonl"}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=sorted(RUNS))
async def user_run(request, user_data, tmp_path_factory):
    root, checkpoint = user_data
    backend, fmt = request.param, RUNS[request.param]
    prompt = "messages" if fmt == "jsonl" else "question"  # chat messages, or text
    output_dir = str(tmp_path_factory.mktemp(f"user_{backend}"))
    config = load_config(BASE[backend], small(
        output_dir, checkpoint, "task.source=dataset", f"task.train_path={root}/train.{fmt}",
        f"task.prompt_field={prompt}", "task.num_eval=4", FUNCTIONS, "reward.timeout_s=0.3",
        "reward.on_error=0.0", "trainer.training.seq_len=96",
        "reward.max_error_rate=null",  # functions failing every call: counted, not stopping
        "reference=null", "loss.kl_coef=0",  # no KL here: one process fewer to spawn
        "generator.sampling.max_new_tokens=6",
    ))
    app = Recording(config)
    await app.run()
    return app, output_dir


async def test_each_sample_gets_what_the_users_reward_function_returned(user_run):
    from user_rewards import record

    app, output_dir = user_run
    group = app.config.grpo.group_size
    values = []
    for step, rollouts in app.trained.items():
        expected = []
        for i, ep in enumerate(rollouts.episodes):
            row = rollouts.rows[i // group]
            text, finished = app.tok.completion_text(ep.response_ids)
            expected.append(record(text, row.prompt, row.answer, row, finished))
        # record's value + constant's 0.25; the failing functions scored on_error = 0.
        assert [ep.reward for ep in rollouts.episodes] == pytest.approx(
            [v + 0.25 for v in expected], abs=1e-12)
        rewards = [ep.reward for ep in rollouts.episodes]
        assert [ep.advantage for ep in rollouts.episodes] == pytest.approx(
            compute_group_advantages(__import__("torch").tensor(rewards), group).tolist())
        values += expected
    assert len({round(v, 6) for v in values}) > 1  # not vacuous: rewards vary


async def test_failing_reward_functions_are_counted_and_the_run_finishes(user_run):
    app, output_dir = user_run
    rows = {r["step"]: r for r in history(output_dir)}
    assert sorted(s for s, r in rows.items() if "loss" in r) == [1, 2]
    assert "eval/accuracy" in rows[2]
    for step in (1, 2):
        for name in FAILING:  # every call of each failed: 8 samples a step
            assert rows[step][f"reward/errors/{name}"] == 8, (step, name)
            assert rows[step][f"reward/{name}"] == 0.0
        assert rows[step]["reward/errors/record"] == 0
        assert rows[step]["reward/constant"] == 0.25
    assert app.rubric.error_counts["raises"] == 2 * 8 + 2 * 4  # two steps, two evaluations of 4


async def test_samples_and_tensorboard_hold_what_the_rubric_scored(user_run):
    """samples.jsonl and TensorBoard's ``samples`` text hold, per step, the first episode of
    each prompt as the rubric scored it: its completion decoded, each function's score
    (``record`` recomputed here) and the reward trained on; TensorBoard also holds the
    step's scalars issue 38 names, equal to metrics.jsonl's."""
    from conftest import tensorboard_events
    from user_rewards import record

    app, output_dir = user_run
    group = app.config.grpo.group_size
    samples = [json.loads(line) for line in open(Path(output_dir) / "samples.jsonl")]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]  # 2 prompts a step
    for k, sample in enumerate(samples):
        rollouts = app.trained[sample["step"] - 1]
        ep, row = rollouts.episodes[(k % 2) * group], rollouts.rows[k % 2]
        text, finished = app.tok.completion_text(ep.response_ids)
        assert sample["prompt"] == row.text and sample["completion"] == text
        assert sample["rewards"]["record"] == record(text, row.prompt, row.answer, row, finished)
        assert sample["rewards"]["constant"] == 0.25
        assert sample["reward"] == ep.reward
    scalars, texts = tensorboard_events(Path(output_dir) / "tensorboard")
    rows = {r["step"]: r for r in history(output_dir)}
    for name in ("loss", "reward/record", "reward/constant", "rollout/response_tokens",
                 "loss/clip_fraction", "rollout/groups_without_spread",
                 "rollout/truncated/max_new_tokens"):
        assert scalars[name] == [(s, pytest.approx(rows[s][name])) for s in (1, 2)], name
    assert [step for step, _ in texts["samples"]] == [1, 2]
    for step, text in texts["samples"]:
        for sample in samples:
            if sample["step"] == step:
                assert "    " + sample["completion"].replace("\n", "\n    ") in text


async def test_prompt_ids_are_the_chat_template_and_the_ratio_is_one(user_run):
    from transformers import AutoTokenizer

    app, output_dir = user_run
    hf = AutoTokenizer.from_pretrained(app.config.model.hf_path)
    for rollouts in app.trained.values():
        for i, ep in enumerate(rollouts.episodes):
            row = rollouts.rows[i // app.config.grpo.group_size]
            messages = row.prompt if isinstance(row.prompt, list) else [
                {"role": "user", "content": row.prompt}]
            ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            assert ep.prompt_ids == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert max(app.gap.values()) <= 1e-4, app.gap
    for r in history(output_dir):
        if "loss" in r:
            assert r["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


# ------------------------------------------------------------------------- reasoning-gym
RG_TASK = ["task.source=reasoning_gym", "task.name=chain_sum", "task.num_train=40",
           "task.num_eval=6", "task.config={min_terms: 2, max_terms: 2, max_digits: 1}"]


@pytest.fixture(scope="module")
def rg_warmstart(tmp_path_factory):
    """One SFT step of the reasoning-gym task (configs/sft_cpu_chain_sum.yaml, smaller)."""
    from apps.sft.config import SFTConfig
    from apps.sft.main import run
    from forge_ext.config import from_mapping, load_yaml

    root = tmp_path_factory.mktemp("rg_sft")
    config = from_mapping(SFTConfig, load_yaml(CONFIGS / "sft_cpu_chain_sum.yaml", [
        f"output_dir={root / 'warm'}", f"init.hf_path={root / 'init'}", *RG_TASK,
        "trainer.training.steps=1", "trainer.training.local_batch_size=8",
        "eval.every=0", "eval.stop_at_accuracy=null", "metrics=null", "env={}",
        "init.architecture.hidden_size=64", "init.architecture.intermediate_size=128",
    ]))
    accuracy = run(config)
    assert 0.0 <= accuracy <= 1.0
    return str(root / "warm")


class Runs:
    def __init__(self):
        self.done = {}


@pytest.fixture(scope="module")
def rg_runs():
    return Runs()


class JudgeDownAtStep3(Recording):
    """The app, with the flag of ``reward_fns:fails_when_flagged`` raised before step 3's
    rollouts: from there on that reward function fails on every call."""

    def __init__(self, config, flag):
        super().__init__(config)
        self.flag = flag

    async def build_rollouts(self, step):
        if step == 2:
            self.flag.touch()
        return await super().build_rollouts(step)


async def rg_run(rg_runs, rg_warmstart, tmp_path_factory, which):
    """The reasoning-gym GRPO run of 3 steps whose second reward function (0.0 while it
    works) fails on every call from step 3 on ("crashed": the run stops there, with steps 1
    and 2 checkpointed), and its rerun in the same output_dir ("resumed")."""
    from reward_fns import FAIL_FLAG

    from forge_ext.tasks.rubric import RewardFailure

    if which not in rg_runs.done:
        if which == "crashed":
            output_dir = str(tmp_path_factory.mktemp("rg_grpo"))
            rg_runs.output_dir = output_dir
        output_dir = rg_runs.output_dir
        argv = small(output_dir, rg_warmstart, *RG_TASK, "loop.save_every=1",
                     "trainer.checkpoint.enable=true", "loop.steps=3", "reference=null",
                     "loss.kl_coef=0", "reward.functions=[{fn: reasoning_gym}, "
                     "{fn: 'reward_fns:fails_when_flagged'}]")
        if which == "crashed":
            flag = Path(output_dir) / "judge_down"
            app = JudgeDownAtStep3(load_config(str(CONFIGS / "grpo_cpu_chain_sum.yaml"), argv),
                                   flag)
            os.environ[FAIL_FLAG] = str(flag)  # the reward workers start with the run
            try:
                with pytest.raises(RewardFailure) as failure:
                    await app.run()
            finally:
                del os.environ[FAIL_FLAG]
                flag.unlink(missing_ok=True)
            rg_runs.failure = failure.value
        else:
            await rg_run(rg_runs, rg_warmstart, tmp_path_factory, "crashed")
            app = Recording(load_config(str(CONFIGS / "grpo_cpu_chain_sum.yaml"), argv))
            await app.run()
        rg_runs.done[which] = app
    return rg_runs.done[which]


async def test_reasoning_gym_rewards_are_its_own_score_answer(rg_runs, rg_warmstart,
                                                              tmp_path_factory):
    import reasoning_gym

    app = await rg_run(rg_runs, rg_warmstart, tmp_path_factory, "crashed")
    scorer = reasoning_gym.create_dataset("chain_sum", size=1, seed=0).score_answer
    scored = 0
    for rollouts in app.rollouts.values():
        for i, ep in enumerate(rollouts.episodes):
            row = rollouts.rows[i // app.config.grpo.group_size]
            text = app.tok.completion_text(ep.response_ids)[0]
            assert ep.reward == scorer(text.strip(), row.metadata), (text, row.answer)
            scored += 1
    assert scored >= 16


async def test_a_reward_function_failing_on_every_call_stops_the_run_before_training_on_it(
    rg_runs, rg_warmstart, tmp_path_factory
):
    """Issue 38: a run whose reward function fails on every call of a step's batch stops at
    that step, naming the function, the count and the first traceback and saying the fix;
    it does not train on ``reward.on_error`` values (steps 1 and 2 trained and logged, step
    3 neither), and a rerun resumes from step 2 (the next test)."""
    app = await rg_run(rg_runs, rg_warmstart, tmp_path_factory, "crashed")
    assert sorted(app.trained) == [0, 1] and sorted(app.rollouts) == [0, 1]
    message = str(rg_runs.failure)
    assert message.startswith(
        "the rollouts of step 3: reward function 'fails_when_flagged' failed on 8 of 8 calls "
        "of this batch (every call; reward.max_error_rate=1.0): the run stops rather than "
        "train on reward.on_error values; fix it, or set reward.max_error_rate null (never "
        "stop)."), message
    assert "Its first failure:\nTraceback" in message
    assert message.rstrip().endswith("RuntimeError: the judge service is down"), message
    rows = {r["step"]: r for r in history(rg_runs.output_dir)}
    assert sorted(s for s, r in rows.items() if "loss" in r) == [1, 2]
    assert rows[2]["reward/errors/fails_when_flagged"] == 0


async def test_a_killed_reasoning_gym_run_resumes_its_prompt_stream_exactly(
    rg_runs, rg_warmstart, tmp_path_factory
):
    from forge_ext.tasks import PromptStream, build_task

    crashed = await rg_run(rg_runs, rg_warmstart, tmp_path_factory, "crashed")
    resumed = await rg_run(rg_runs, rg_warmstart, tmp_path_factory, "resumed")
    assert sorted(crashed.trained) == [0, 1] and sorted(resumed.trained) == [2]
    trained = [row for run in (crashed, resumed) for rollouts in run.trained.values()
               for row in rollouts.rows]
    config = resumed.config
    expected = PromptStream(build_task(config.task).train_rows(), config.seed).slice(
        0, config.loop.steps * config.grpo.prompts_per_step)
    assert [r.prompt for r in trained] == [r.prompt for r in expected]
    assert len({r.prompt for r in trained}) == len(trained)  # so "each once" is what it says
