"""Multi-turn episodes without actors: forge_ext.rollout.runner.EpisodeRunner driving a real
transformers sampler (HFSampler) and real environments, a chat tokenizer trained here.

What must hold: every turn's prompt is exactly the episode's ids so far; the environment's
replies are the chat template's continuation, masked (0) and without log-probs; limits
(max_turns, max_episode_tokens, env_timeout_s) bound every episode; an environment that
raises or hangs costs its episode (reward.on_error, counted), not the batch; a template that
rewrites earlier turns is refused; and masked tokens carry no gradient through the GRPO loss.
"""

import asyncio
import os
import random
import time

import pytest
import torch
from conftest import assert_masked_tokens_carry_no_gradient, chat_checkpoint

from forge_ext.rl.episode import Episode, pack_episodes
from forge_ext.rollout.runner import EpisodeRunner
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.hf import HFEngine, HFSampler
from forge_ext.tasks import (
    EpisodeConfig, PromptConfig, PromptRenderer, RewardConfig, RewardFunctionConfig, Row,
    Rubric, episode_config,
)
from forge_ext.tasks.environments import CalculatorEnv, FeedbackEnv, calculate
from forge_ext.tasks.tokenizer import CheckpointTokenizer


class VaryingEnv:
    """Replies of varying length (seeded by the completion), done after ``turns`` turns."""

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    async def reset(self, row):
        return [{"role": "user", "content": row.prompt}]

    async def step(self, completion):
        self.seen += 1
        rng = random.Random(completion)
        reply = " ".join(rng.choice(["more", "please", "go on", "what?"])
                         for _ in range(rng.randint(1, 6)))
        return reply, 0.1, self.seen >= self.turns


class NeverDone:
    async def reset(self, row):
        return row.prompt

    async def step(self, completion):
        return "again", 0.0, False


class RaisesAtStep:
    async def reset(self, row):
        return row.prompt

    async def step(self, completion):
        raise RuntimeError("an environment bug")


class SyncEnv:
    """Plain ``def`` methods (a newcomer's first environment): run on a worker thread; a
    row whose answer is "slow" hangs its reset."""

    def reset(self, row):
        if row.answer == "slow":
            import time

            time.sleep(30)
        return row.prompt

    def step(self, completion):
        return None, 0.5, True


class HangsAtReset:
    async def reset(self, row):
        await asyncio.sleep(30)

    async def step(self, completion):
        return None, 0.0, True


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = chat_checkpoint(tmp_path_factory.mktemp("mt"), end_prone=2.0)
    tok = CheckpointTokenizer(path)
    sampler = HFSampler(path, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    return path, tok, sampler


def runner_for(setup, env, **limits):
    """A runner of ``env`` (a class of this module, by import path) with an exact_match
    rubric, and a ``sample`` over the real engine that records every request's prompt."""
    path, tok, sampler = setup
    render = PromptRenderer(tok, PromptConfig())
    # max_error_rate=None: these tests check what a failure costs its episode; a batch that
    # fails whole stopping the run is test_a_batch_whose_environment_always_fails_stops_the_run.
    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")],
                                 on_error=-1.0, max_error_rate=None), _NoTask())
    config = EpisodeConfig(environment=f"{__name__}:{env.__name__}", **limits)
    engine = HFEngine(path, sampling=SamplingConfig(max_new_tokens=16), sampler=sampler,
                      stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    engine.policy_version = 3
    prompts = []

    async def sample(prompt_ids, n, *, greedy=False, seed=None, session=None):
        prompts.append(list(prompt_ids))
        return await engine.sample(prompt_ids, n, greedy=greedy, seed=seed)

    return EpisodeRunner(tok, render, rubric, config), sample, prompts


class _NoTask:
    name = "t"

    def rewards(self):
        return {}

    def default_rewards(self):
        return []


ROWS = [Row(prompt="What is 12 plus 30?", answer="42"), Row(prompt="Compute 7 times 6.", answer="42")]


def test_every_turn_prompt_is_the_episode_so_far_and_replies_are_masked(setup):
    _, tok, _ = setup
    runner, generate, prompts = runner_for(setup, VaryingEnv, max_turns=5,
                                           max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=11))
    assert len(batch.trajectories) == 4
    render = runner.render
    for i, t in enumerate(batch.trajectories):
        assert t.turns == 3 and not t.truncated and t.env_error is None
        assert t.prompt_ids == render(Row(prompt=[{"role": "user", "content": t.row.prompt}],
                                          answer=""))
        assert len(t.response_ids) == len(t.response_mask) == len(t.logprobs)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.response_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.response_mask) if m == 1)
        assert t.versions == [3] * sum(t.response_mask) and t.policy_version == 3  # per token
        assert batch.rewards[i] == pytest.approx(batch.scores.rewards[i] + 0.3)
    # Turn k's prompt of an episode is exactly its ids before that turn's tokens: one request
    # per episode and turn, each with that prompt.
    expected = []
    for t in batch.trajectories:
        model_turn_starts = [j for j in range(len(t.response_mask))
                             if t.response_mask[j] == 1 and (j == 0 or t.response_mask[j - 1] == 0)]
        expected += [t.prompt_ids + t.response_ids[:start] for start in model_turn_starts]
    assert sorted(prompts) == sorted(expected) and len(prompts) == 12
    # Each environment run is the chat template's rendering of the reply after the turn.
    t = batch.trajectories[0]
    runs, j = [], 0
    while j < len(t.response_mask):
        k = j
        while k < len(t.response_mask) and t.response_mask[k] == t.response_mask[j]:
            k += 1
        runs.append((t.response_mask[j], t.response_ids[j:k]))
        j = k
    env_runs = [ids for m, ids in runs if m == 0]
    assert len(env_runs) == 2
    for ids in env_runs:
        text = tok.tokenizer.decode(ids)
        assert text.startswith("\n<|im_start|>user\n") and text.endswith(
            "<|im_end|>\n<|im_start|>assistant\n")
    metrics = batch.metrics()
    assert metrics["episode/turns_mean"] == 3 and metrics["episode/truncated"] == 0
    assert len({len(tr.response_ids) for tr in batch.trajectories}) > 1  # replies vary


def test_every_episode_turn_has_a_seed_of_its_own_and_a_step_replays_from_its_seed(setup):
    """One row twice, 4 episodes each, 3 turns: the runner gives each (episode, turn) its own
    seed, whichever episodes share a call, and the same step seed gives the same seeds and
    the same episodes. The fault (issue 32): one seed for every request of a turn, which vLLM
    (a generator per request) turned into a group of identical episodes."""
    runner, generate, _ = runner_for(setup, VaryingEnv, max_turns=3, max_episode_tokens=400)
    seeds = []

    async def recording(prompt_ids, n, *, greedy=False, seed=None, session=None):
        seeds.append(seed)
        return await generate(prompt_ids, n, greedy=greedy, seed=seed, session=session)

    rows = [ROWS[0], ROWS[0]]
    first = asyncio.run(runner.run(rows, 4, recording, seed=11))
    drawn = list(seeds)
    assert len(drawn) == len(set(drawn)) == sum(t.turns for t in first.trajectories) == 24
    seeds.clear()
    again = asyncio.run(runner.run(rows, 4, recording, seed=11))
    assert sorted(seeds) == sorted(drawn)
    assert [t.response_ids for t in again.trajectories] == [
        t.response_ids for t in first.trajectories]
    seeds.clear()
    asyncio.run(runner.run(rows, 4, recording, seed=12))
    assert not set(drawn) & set(seeds)


def test_the_controller_keeps_nothing_of_finished_episodes(setup):
    """30 multi-turn batches of 2 rows x 4 episodes: the prompt renderer's cache holds only
    rows still alive, and the memory forge_ext's code holds stays flat after a warm-up. The fault
    (issue 32): every episode's first-prompt row cached forever by ``id(row)``, a group of
    rows per prompt per step (about 6 MB a step at the demo's batch with 300-token
    prompts)."""
    import gc
    import tracemalloc

    import forge_ext

    runner, generate, _ = runner_for(setup, VaryingEnv, max_turns=2, max_episode_tokens=400)
    render, cached = runner.render, []
    # Only what forge_ext's own lines allocated: the process's other threads (Monarch's,
    # a previous test's) and the model's libraries allocate too, which made the total
    # traced memory of a whole-suite run grow past the bound without any leak of ours.
    ours = [tracemalloc.Filter(True, os.path.join(os.path.dirname(forge_ext.__file__), "*"))]
    tracemalloc.start(1)
    try:
        sizes = []
        for k in range(30):
            asyncio.run(runner.run(ROWS, 4, generate, seed=k))
            gc.collect()
            cached.append(render.cached_rows())
            snapshot = tracemalloc.take_snapshot().filter_traces(ours)
            sizes.append(sum(stat.size for stat in snapshot.statistics("filename")))
    finally:
        tracemalloc.stop()
    assert max(cached) <= len(ROWS), cached  # ROWS stay alive: their ids stay cached
    # Measured 2026-12-03: +8 KB over the 20 batches; keeping each batch's trajectories
    # adds ~15 KB a batch (0.30 MB), the bound's tenfold.
    growth = sizes[-1] - sizes[9]
    assert growth < 64 * 1024, f"{growth / 1e6:.2f} MB more after 20 batches: {sizes}"


def test_max_turns_and_max_episode_tokens_bound_every_episode(setup):
    runner, generate, _ = runner_for(setup, NeverDone, max_turns=3, max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=1))
    assert [t.turns for t in batch.trajectories] == [3] * 4
    assert all(t.truncated for t in batch.trajectories)
    assert batch.metrics()["episode/truncated"] == 1.0
    runner, generate, _ = runner_for(setup, NeverDone, max_turns=10, max_episode_tokens=20)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=1))
    for t in batch.trajectories:
        assert len(t.response_ids) <= 20 and t.truncated


def test_an_environment_that_raises_or_hangs_costs_its_episode_and_is_counted(setup, capsys):
    runner, generate, _ = runner_for(setup, RaisesAtStep, max_turns=3, max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=1))
    assert [t.env_error for t in batch.trajectories] == ["error"] * 4
    assert batch.rewards == [-1.0] * 4 and batch.scores.correct == [False] * 4
    assert batch.metrics()["episode/env_errors"] == 4
    assert capsys.readouterr().err.count("step() failed (error)") == 1  # one traceback
    runner, generate, _ = runner_for(setup, HangsAtReset, max_turns=3, max_episode_tokens=400,
                                     env_timeout_s=0.2)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=1, version=7))
    assert [t.env_error for t in batch.trajectories] == ["timeout"] * 4
    assert batch.metrics()["episode/env_timeouts"] == 4
    for t in batch.trajectories:  # kept, with no valid token, so the group stays whole
        assert t.response_mask == [0] and t.versions == [7]
        ep = Episode(prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                     generator_logprobs=t.logprobs, advantage=0.0, policy_version=7,
                     response_mask=t.response_mask)
        assert (pack_episodes([ep], pad_id=0)["labels"] != -100).sum() == 0


def test_an_environment_with_plain_methods_runs_and_its_hangs_time_out(setup):
    runner, generate, _ = runner_for(setup, SyncEnv, max_turns=3, max_episode_tokens=400,
                                     env_timeout_s=1.0)
    rows = [ROWS[0], Row(prompt="What is 1 plus 1?", answer="slow")]
    start = time.perf_counter()
    batch = asyncio.run(runner.run(rows, 2, generate, seed=3))
    assert time.perf_counter() - start < 20  # the hung resets cost their timeout, not 30 s
    normal, slow = batch.trajectories[:2], batch.trajectories[2:]
    assert [t.env_error for t in slow] == ["timeout", "timeout"]
    for t in normal:
        assert t.env_error is None
        assert t.truncated or (t.turns == 1 and t.env_reward == 0.5)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    from conftest import save_chat_tokenizer

    hf = save_chat_tokenizer(tmp_path)
    # Like Qwen3's: an assistant turn shows its content only while it is the last one.
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.save_pretrained(tmp_path)
    tok = CheckpointTokenizer(tmp_path)
    render = PromptRenderer(tok, PromptConfig())
    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")]), _NoTask())
    with pytest.raises(ValueError, match="not prefix-preserving"):
        EpisodeRunner(tok, render, rubric, EpisodeConfig(environment="feedback"))
    EpisodeRunner(tok, render, rubric, EpisodeConfig())  # single-turn: nothing to check


def test_built_in_environments():
    async def play():
        feedback = FeedbackEnv(feedback="no")
        assert await feedback.reset(ROWS[0]) == ROWS[0].prompt
        assert await feedback.step(" 41 ") == ("no", 0.0, False)
        assert await feedback.step("<answer>42</answer>") == (None, 0.0, True)
        calc = CalculatorEnv()
        assert await calc.step("let me <calc>12*(3+4)</calc>") == ("<result>84</result>", 0.0,
                                                                    False)
        assert await calc.step("<calc>1/0</calc>") == ("<result>error</result>", 0.0, False)
        assert await calc.step("<calc>__import__('os')</calc>") == ("<result>error</result>",
                                                                   0.0, False)
        assert await calc.step("84") == (None, 0.0, True)

    asyncio.run(play())
    assert calculate("7/2") == 3.5 and calculate("-(2+3)*4") == -20
    with pytest.raises(ValueError):
        calculate("2**100000")


def test_episode_fields_are_checked_before_anything_runs():
    with pytest.raises(ValueError, match="task.environment='nope' is not an environment"):
        episode_config({"environment": "nope"})
    with pytest.raises(ValueError, match="task.max_turns=0 must be >= 1"):
        episode_config({"max_turns": 0})
    with pytest.raises(ValueError, match="task.environment='no_mod_z:Env': module"):
        episode_config({"environment": "no_mod_z:Env"})
    assert episode_config({"environment": "feedback", "max_digits": 2}).max_turns == 4


def test_environment_and_prompt_tokens_carry_no_gradient(setup):
    """The GRPO loss on packed multi-turn episodes through a real model: changing the
    log-prob inputs (generator's, reference's) at prompt and environment positions leaves
    every gradient bitwise unchanged; changing them at one model token does not."""
    path, tok, _ = setup
    runner, generate, _ = runner_for(setup, VaryingEnv, max_turns=3, max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=5))
    episodes = [Episode(prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                        generator_logprobs=t.logprobs, advantage=a, policy_version=3,
                        ref_logprobs=[lp - 0.1 for lp in t.logprobs],
                        response_mask=t.response_mask)
                for t, a in zip(batch.trajectories, [1.0, -0.5, 0.25, -1.0])]
    assert_masked_tokens_carry_no_gradient(path, episodes, tok.pad_id)


# --------------------------------------------------------------------------------- OpenEnv
# The OpenEnv run happens in a subprocess: importing openenv (it imports gradio) leaves a
# werkzeug context proxy among the process's module globals, and vLLM engines started in a
# process afterwards fail walking them (``register_triton_kernel_overrides``: "Working
# outside of application context"); the tests that start vLLM engines in the pytest process
# must not see it.
OPENENV_RUN = """
import asyncio, json, sys
# Without OpenEnv's optional web UI (openenv/core/env_server/__init__.py imports it only when
# gradio imports; the adapter never uses it): gradio's import is ~5 s of CPU here.
sys.modules["gradio"] = None
from forge_ext.rollout.runner import EpisodeRunner
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.hf import HFEngine, HFSampler
from forge_ext.tasks import (PromptConfig, PromptRenderer, RewardConfig, RewardFunctionConfig,
                             Row, Rubric, episode_config)
from forge_ext.tasks.tokenizer import CheckpointTokenizer

class NoTask:
    name = "t"
    def rewards(self): return {}
    def default_rewards(self): return []

path = sys.argv[1]
tok = CheckpointTokenizer(path)
sampler = HFSampler(path, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
render = PromptRenderer(tok, PromptConfig())
rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")]), NoTask())
config = episode_config({"environment": "openenv", "max_turns": 5, "environment_options": {
    "env": "openenv_guess:GuessEnv", "action": "openenv_guess:GuessAction",
    "env_options": {"greeting": "Guess a digit from 0 to 9."}}})
runner = EpisodeRunner(tok, render, rubric, config)

engine = HFEngine(path, sampling=SamplingConfig(max_new_tokens=16), sampler=sampler,
                  stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)

async def generate(prompt_ids, n, *, greedy=False, seed=None, session=None):
    return await engine.sample(prompt_ids, n, greedy=greedy, seed=seed)

batch = asyncio.run(runner.run([Row(prompt="unused", answer="7")], 3, generate, seed=2))
json.dump({
    "expected_prompt": render(Row(prompt="Guess a digit from 0 to 9.", answer="")),
    "episodes": [{"prompt_ids": t.prompt_ids, "turns": t.turns, "truncated": t.truncated,
                  "env_reward": t.env_reward, "reward": r, "rubric": s,
                  "replies": tok.tokenizer.decode(
                      [i for i, m in zip(t.response_ids, t.response_mask) if m == 0])}
                 for t, r, s in zip(batch.trajectories, batch.rewards, batch.scores.rewards)],
}, sys.stdout)
"""


def test_an_openenv_environment_runs_through_the_same_interface(setup):
    """An OpenEnv ``Environment`` (tests/openenv_guess.py: three guesses, 0.5 each) through
    the ``openenv`` adapter: its reset is the first prompt, its observations the replies,
    its rewards the episode's."""
    import json
    import os
    import subprocess
    import sys

    path = setup[0]
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", OPENENV_RUN, path], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])},
    )
    result = json.loads(out.stdout)
    episodes = result["episodes"]
    assert len(episodes) == 3 and any(not e["truncated"] for e in episodes)
    for e in episodes:
        assert e["prompt_ids"] == result["expected_prompt"]
        assert e["reward"] == pytest.approx(e["rubric"] + e["env_reward"])
        if not e["truncated"]:  # every turn was stepped: 0.5 each, done by the third
            assert e["env_reward"] == pytest.approx(0.5 * e["turns"]) and e["turns"] <= 3
        if e["turns"] > 1:
            assert "no, again" in e["replies"]


class BadReplies:
    """A reply that is neither text nor messages, and a step result of the wrong shape."""

    async def reset(self, row):
        return row.prompt

    async def step(self, completion):
        return (42, 0.0, False) if len(completion) % 2 else "just a string"


def test_a_step_result_or_reply_of_the_wrong_shape_costs_its_episode(setup):
    runner, generate, _ = runner_for(setup, BadReplies, max_turns=3, max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=4))
    for t in batch.trajectories:
        if not t.truncated:
            assert t.env_error == "error"
    assert batch.metrics()["episode/env_errors"] >= 1


# ----------------------------------------------------- failures that stop a run (issue 38)
class PaysOne:
    """An environment whose reward is the episode's only one: 1.0 for the answer."""

    async def reset(self, row):
        self.row = row
        return row.prompt

    async def step(self, completion):
        return None, float(completion.strip() == self.row["answer"]) + 0.25, True


def test_an_environments_rewards_suffice_without_a_reward_function(setup):
    """A task with an environment and no reward function: its rewards are the episode's, the
    accuracy its reward >= 1; without an environment the rubric is still refused."""
    path, tok, sampler = setup
    with pytest.raises(ValueError, match="reward.functions is empty"):
        Rubric(RewardConfig(), _NoTask())
    rubric = Rubric(RewardConfig(), _NoTask(), environment=True)
    assert rubric.names == []
    runner, generate, _ = runner_for(setup, PaysOne, max_turns=2, max_episode_tokens=400)
    runner.rubric = rubric
    rows = [Row(prompt=r.prompt, answer=r.answer) for r in ROWS]
    batch = asyncio.run(runner.run(rows, 2, generate, seed=5))
    for t, reward, correct in zip(batch.trajectories, batch.rewards, batch.scores.correct):
        text, _ = tok.completion_text(t.last_turn)
        expected = float(text.strip() == t.row.answer) + 0.25
        assert t.env_error is None and reward == t.env_reward == expected
        assert correct == (expected >= 1.0)


def test_a_batch_whose_reward_function_always_fails_stops_the_run(setup, capsys):
    from forge_ext.tasks.rubric import RewardFailure

    runner, generate, _ = runner_for(setup, PaysOne, max_turns=2, max_episode_tokens=400)
    runner.rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="reward_fns:raises"),
                                                   RewardFunctionConfig(fn="exact_match")],
                                        num_workers=1), _NoTask())
    with pytest.raises(RewardFailure, match=r"(?s)reward function 'raises' failed on 4 of 4 "
                                            r"calls.*reward.max_error_rate=1.0.*"
                                            r"RuntimeError: boom"):
        asyncio.run(runner.run(ROWS, 2, generate, seed=5))
    runner.rubric.close()


def test_a_batch_whose_environment_always_fails_stops_the_run(setup, capsys):
    """Every episode's environment raised: the batch stops the run with the count and the
    first traceback, which is not printed before it too (issue 38)."""
    from forge_ext.tasks.rubric import RewardFailure

    runner, generate, _ = runner_for(setup, RaisesAtStep, max_turns=3, max_episode_tokens=400)
    runner.rubric.config.max_error_rate = 1.0  # the default (runner_for turns it off)
    with pytest.raises(RewardFailure, match=r"(?s)the environment \(.*RaisesAtStep\) failed "
                                            r"on 4 of 4 calls.*an environment bug"):
        asyncio.run(runner.run(ROWS, 2, generate, seed=1))
    assert "failed (error)" not in capsys.readouterr().err


def test_the_samples_of_a_batch_are_what_the_rubric_scored(setup):
    """metrics.samples_per_step's records (samples.jsonl): each holds the completion the
    rubric scored and that function's score of it, recomputed here (issue 38)."""
    from forge_ext.tasks.rewards import exact_match

    _, tok, _ = setup
    runner, generate, _ = runner_for(setup, PaysOne, max_turns=2, max_episode_tokens=400)
    batch = asyncio.run(runner.run(ROWS, 2, generate, seed=5))
    records = batch.samples(tok, [0, 2])
    assert [r["prompt"] for r in records] == [ROWS[0].prompt, ROWS[1].prompt]
    for i, record in zip([0, 2], records):
        t = batch.trajectories[i]
        assert record["completion"] == tok.completion_text(t.last_turn)[0]
        assert record["rewards"] == {"exact_match": exact_match(record["completion"], "42")}
        assert record["reward"] == batch.rewards[i] == pytest.approx(
            record["rewards"]["exact_match"] + t.env_reward)
        assert record["response_tokens"] == len(t.response_ids) and record["turns"] == t.turns


# ------------------------------------ truncation by cause, unknown tokens in replies (issue 38)
# A scripted generator over the demo's character tokenizer (no model): what each turn returns
# is fixed, so each limit is reached exactly where the test says.
class ScriptedReplies:
    """Replies with the row's ``reply`` column, never done."""

    async def reset(self, row):
        self.reply = row["reply"]
        return row.prompt

    async def step(self, completion):
        return self.reply, 0.0, False


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    from forge_ext.tasks.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("chars")
    save_tokenizer(path)
    return CheckpointTokenizer(path)


def scripted_runner(char_tok, **limits):
    """A runner of :class:`ScriptedReplies` whose every turn is ``12<eos>`` (3 tokens,
    finished), except in groups listed in the returned ``unfinished`` set: ``12`` without an
    end token (cut at max_new_tokens)."""
    from forge_ext.rollout.engines.base import Completion

    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")],
                                 isolation="thread", max_error_rate=None), _NoTask())
    config = EpisodeConfig(environment=f"{__name__}:ScriptedReplies", **limits)
    unfinished = set()

    async def sample(prompt_ids, n, *, greedy=False, seed=None, session=None):
        cut = session[1] in unfinished
        ids = [5, 6] if cut else [5, 6, char_tok.eos_id]
        return [Completion(prompt_ids=list(prompt_ids), response_ids=ids,
                           logprobs=[-0.5] * len(ids), finished=not cut, policy_version=0)
                for _ in range(n)]

    return EpisodeRunner(char_tok, PromptRenderer(char_tok, PromptConfig()), rubric,
                         config), sample, unfinished


def test_a_truncated_episode_records_which_limit_cut_it(char_tok):
    """Four rows, one per way an episode ends early (max_turns=2, max_episode_tokens=12,
    turns of 3 tokens): a turn without an end token (max_new_tokens); a 1-token reply, two
    turns (max_turns); a 10-token reply, no room for a second turn (max_episode_tokens); a
    7-token reply, the second turn cut to fit (max_episode_tokens). The fault: one
    ``truncated`` flag for all three, and the no-room case counted as out of turns."""
    runner, sample, unfinished = scripted_runner(char_tok, max_turns=2, max_episode_tokens=12)
    unfinished.add(0)
    rows = [Row(prompt="1+2=", answer="3", metadata={"reply": reply})
            for reply in ("=", "=", "=" * 10, "=" * 7)]
    batch = asyncio.run(runner.run(rows, 2, sample))
    causes = [t.truncation for t in batch.trajectories]
    assert causes == ["max_new_tokens"] * 2 + ["max_turns"] * 2 + ["max_episode_tokens"] * 4
    assert all(t.truncated for t in batch.trajectories)
    assert [t.turns for t in batch.trajectories[::2]] == [1, 2, 1, 2]
    assert len(batch.trajectories[6].response_ids) == 12  # 3 + 7 + 2 of the second turn
    metrics = batch.metrics()
    assert metrics["rollout/truncated/max_new_tokens"] == 0.25
    assert metrics["rollout/truncated/max_turns"] == 0.25
    assert metrics["rollout/truncated/max_episode_tokens"] == 0.5
    assert metrics["episode/truncated"] == 1.0
    # Episodes the environment ends are not truncated, whatever they cost.
    runner, sample, _ = scripted_runner(char_tok, max_turns=3, max_episode_tokens=400)
    runner.config = EpisodeConfig(environment=f"{__name__}:PaysOne", max_turns=3)
    batch = asyncio.run(runner.run(rows[:1], 2, sample))
    assert [t.truncation for t in batch.trajectories] == [None, None]
    assert batch.metrics()["rollout/truncated/max_new_tokens"] == 0.0


def test_environment_text_the_tokenizer_cannot_read_is_warned_once_and_counted(
        char_tok, capsys):
    """Replies in English under the demo's character tokenizer are all ``<unk>``: one
    warning per environment with the text and the token count, every such reply counted;
    replies in its alphabet are not. The fault: no check, the episode's token budget spent
    on ``<unk>`` without a word."""
    runner, sample, _ = scripted_runner(char_tok, max_turns=3, max_episode_tokens=400)
    english = Row(prompt="1+2=", answer="3", metadata={"reply": "no, try again"})
    digits = Row(prompt="1+2=", answer="3", metadata={"reply": "=="})
    batch = asyncio.run(runner.run([english, digits], 2, sample))
    assert [t.unknown_replies for t in batch.trajectories] == [2, 2, 0, 0]  # 2 replies each
    assert batch.metrics()["episode/env_unk_replies"] == 4
    unk = char_tok.tokenizer.unk_token_id
    assert batch.trajectories[0].response_ids[3:16] == [unk] * 13  # the reply's 13 characters
    batch = asyncio.run(runner.run([english], 2, sample))
    assert batch.metrics()["episode/env_unk_replies"] == 4
    err = capsys.readouterr().err
    assert err.count("warning: the environment") == 1, err
    assert "step() gave text the tokenizer of model.hf_path maps to <unk> (13 of its 13 " \
           "tokens" in err and "'no, try again'" in err and "episode/env_unk_replies" in err


def test_the_step_line_names_the_limit_that_cut_episodes():
    """The console's step line (forge_ext.rl.report.step_line) shows truncation by cause,
    with the field to raise, and the replies holding <unk>; a single-turn run only when any
    was cut."""
    import functools

    from forge_ext.rl.report import FlatGroupsWatch, step_line

    log_line = functools.partial(step_line, steps=10, group_size=4, replicas=1, kl=False,
                                 eval_sets=[], flat_groups=FlatGroupsWatch(4))
    step = {"reward/mean": 0.5, "rollout/accuracy": 0.5, "rollout/groups_without_spread": 0.0,
            "loss": 0.1, "policy_version": 1, "generator_version": 0,
            "rollout/policy_age_mean": 0.0, "rollout/policy_age_max": 0,
            "rollout/dropped_samples": 0, "time/generator_idle": 0.0,
            "time/trainer_idle": 0.0, "throughput/samples_per_s": 1.0,
            "rollout/truncated/max_new_tokens": 0.0}
    assert "truncated" not in log_line(1, step)
    line = log_line(1, {**step, "rollout/truncated/max_new_tokens": 0.25})
    assert " | truncated max_new_tokens 25% | " in line, line
    multi = {**step, "episode/turns_mean": 2.5, "episode/turns_max": 3, "episode/truncated": 0.75,
             "episode/env_errors": 0, "episode/env_timeouts": 0, "episode/env_unk_replies": 5,
             "rollout/truncated/max_turns": 0.5, "rollout/truncated/max_episode_tokens": 0.25}
    line = log_line(1, multi)
    assert ("turns 2.50 (max 3, truncated 75%: max_episode_tokens 25% max_turns 50%, env "
            "replies with <unk> 5)") in line, line


def test_a_streak_of_steps_with_only_flat_groups_is_warned_once():
    """Three steps in a row whose every group scored alike: one warning, on the third;
    a step with spread restarts the count; groups of one (PPO) never warn."""
    from forge_ext.rl.report import FlatGroupsWatch

    watch = FlatGroupsWatch(group_size=4)
    flat, spread = {"rollout/groups_without_spread": 1.0}, {"rollout/groups_without_spread": 0.5}
    said = [watch.update(m) for m in (flat, flat, spread, flat, flat, flat, flat, flat)]
    assert [i for i, line in enumerate(said) if line] == [5]
    assert said[5].startswith("warning: every group of the last 3 steps scored alike")
    assert "nothing trains" in said[5] and "samples.jsonl" in said[5]
    ppo = FlatGroupsWatch(group_size=1)
    assert [ppo.update(flat) for _ in range(4)] == [None] * 4


def test_kl_climbing_while_accuracy_stays_flat_is_warned_once_on_the_step_line():
    """Issue 50: KL to the reference climbed to 2.2 with training accuracy flat, and nothing
    said so. Once the KL passes 1 while the accuracy of the last steps is within 2 points of
    the run's first steps, the step line is followed by one warning naming both and the
    fields to change; an accuracy that rose meanwhile, or a KL below 1, says nothing, and a
    KL that falls back and climbs again warns again."""
    import functools

    from forge_ext.rl.report import KLDriftWatch, step_line

    def step(kl: float, acc: float) -> dict[str, float]:
        return {"reward/mean": acc, "rollout/accuracy": acc,
                "rollout/groups_without_spread": 0.0, "loss": 0.0, "loss/kl": kl,
                "policy_version": 1, "generator_version": 0, "rollout/policy_age_mean": 0.0,
                "rollout/policy_age_max": 0, "rollout/dropped_samples": 0,
                "time/generator_idle": 0.0, "time/trainer_idle": 0.0,
                "throughput/samples_per_s": 1.0}

    watch = KLDriftWatch()
    line = functools.partial(step_line, steps=40, group_size=4, replicas=1, kl=True,
                             kl_drift=watch)
    flat = [line(i, step(kl, 0.12)) for i, kl in enumerate(
        [0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 1.3, 1.8, 2.2, 2.0, 0.2, 0.3, 1.5], start=1)]
    warned = [i for i, text in enumerate(flat) if "\nwarning:" in text]
    assert warned == [6, 12], flat
    warning = flat[6].split("\n", 1)[1]
    assert "KL to the reference 1.30" in warning and "accuracy 12.0%" in warning, warning
    assert "trainer.optimizer.lr" in warning and "loss.kl_coef" in warning, warning
    rising = KLDriftWatch()
    said = [rising.update(step(kl, acc)) for kl, acc in
            [(0.1, 0.10), (0.2, 0.12), (0.5, 0.2), (0.9, 0.3), (1.5, 0.4), (2.0, 0.45)]]
    assert said == [None] * 6
