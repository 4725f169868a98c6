"""DAPO's rollout shaping in the GRPO app's rollout hook. Dynamic sampling: with a reward
whose groups are often all equal, every group trained on has spread, dropped groups are
counted, and a run resumed from a checkpoint step consumes every prompt of the stream exactly
once. Soft overlong punishment (``reward.overlong``): each episode trains on its reward plus
the penalty of its length.

The generator is the Generator actor's own engine (``HFEngine``) called in this process,
not an actor (the rollout hook is what is under test; the app's actors are tested end to end
in test_grpo_app.py)."""

from pathlib import Path

import pytest
from grpo_reference import parity_reward, reference_advantages

from apps.grpo.config import load_config
from apps.grpo.main import RLApp

DEMO = str(Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml")
PROMPTS, GROUP = 3, 2


class InProcessGenerator:
    """The generator replicas' ``sample`` (``forge_ext.rollout.replicas``) over the Generator
    actor's own engine (``HFEngine``), in-process."""

    def __init__(self, config, tok):
        from forge_ext.rollout.engines.hf import HFEngine

        self.engine = HFEngine(config.generator.hf_path, sampling=config.generator.sampling,
                               stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)

    async def sample(self, prompt_ids, n, *, greedy=False, seed=None, session=None,
                     sampling=None):
        return await self.engine.sample(prompt_ids, n, greedy=greedy, seed=seed,
                                        sampling=sampling)

    async def step_metrics(self):
        return {}


def app_for(config, generator=None):
    app = RLApp(config)
    app.generator = generator or InProcessGenerator(config, app.tok)
    return app


def trained_and_filler_groups(rollouts):
    """``(trained, fillers)``: lists of groups (lists of episodes) of a step."""
    eps = rollouts.episodes
    groups = [eps[i : i + GROUP] for i in range(0, len(eps), GROUP)]
    fillers = [g for g in groups if all(
        m == 0 for ep in g
        for m in (ep.response_mask.tolist() if ep.response_mask is not None else [1]))]
    return [g for g in groups if g not in fillers], fillers


@pytest.mark.asyncio
async def test_dynamic_sampling_trains_groups_with_spread_and_resume_consumes_each_prompt_once(
    demo_checkpoint, tmp_path
):
    config = load_config(DEMO, [
        f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / 'run'}",
        f"grpo.prompts_per_step={PROMPTS}", f"grpo.group_size={GROUP}",
        "grpo.dynamic_sampling=true", "grpo.max_rollout_batches=3",
        f"trainer.training.local_batch_size={PROMPTS * GROUP}", "reference=null",
        "loss.kl_coef=0", "task.num_train=40", "task.num_eval=4", "procs.env={}",
        "reward.functions=[{fn: 'grpo_reference:parity_reward'}]",
    ])
    first = app_for(config)
    built = {}
    for step in range(4):
        if step == 2:
            first.stream.save_position(2)  # what save_checkpoint(2) records before saving
        built[step] = await first.build_rollouts(step)

    dropped = 0
    for step, rollouts in built.items():
        trained, fillers = trained_and_filler_groups(rollouts)
        assert len(trained) + len(fillers) == PROMPTS
        for group in trained:  # every group trained on has spread, and a nonzero advantage
            assert len({ep.reward for ep in group}) > 1, step
        for group in fillers:  # too few with spread: dropped groups, masked out of the loss
            assert len({ep.reward for ep in group}) == 1 and all(ep.advantage == 0 for ep in group)
        stats = rollouts.stats
        assert stats["rollout/short_groups"] == len(fillers)
        # Every prompt rolled out is consumed: trained, or dropped (and counted).
        assert stats["rollout/prompts_consumed"] == len(trained) + stats["rollout/dropped_groups"]
        dropped += stats["rollout/dropped_groups"]
    assert dropped > 0  # the reward made all-equal groups, and they were counted

    # Steps consume contiguous, non-overlapping ranges of the stream from position 0.
    ranges = [first.stream.ranges[s] for s in range(4)]
    assert ranges[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(b - a for a, b in ranges) == sum(built[s].stats["rollout/prompts_consumed"]
                                                for s in range(4))

    # A run resumed at the step-2 checkpoint starts step 2 where the first run did: across
    # the first run's steps 0-1 and the resumed run's steps 2-3 every prompt position up to
    # the end is consumed exactly once.
    resumed = app_for(config, first.generator)
    resumed.fast_forward(2)
    again = {step: await resumed.build_rollouts(step) for step in (2, 3)}
    consumed = [p for s in (0, 1) for p in range(*first.stream.ranges[s])]
    consumed += [p for s in (2, 3) for p in range(*resumed.stream.ranges[s])]
    assert consumed == list(range(ranges[-1][1]))
    for step in (2, 3):
        assert [r.prompt for r in again[step].rows] == [r.prompt for r in built[step].rows]
    # Without the record of the resumed step, resuming is refused (no guessing positions).
    with pytest.raises(ValueError, match="no prompt stream position for step 3"):
        app_for(config, first.generator).fast_forward(3)


@pytest.mark.asyncio
async def test_overlong_punishment_lowers_the_trained_reward_of_long_responses(
    demo_checkpoint, tmp_path
):
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13) applied by the app: with
    ``L_max`` = 5 (the demo's max_new_tokens) and ``L_cache`` = 4, a response of ``n`` tokens
    trains on the rubric's reward minus ``(n - 1) / 4``; group advantages come from those
    shaped rewards (a shorter response of a group gains over a longer one); the logged
    reward stays the rubric's and the step logs the mean penalty."""
    l_max, l_cache, group = 5, 4, 4
    config = load_config(DEMO, [
        f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / 'run'}",
        f"grpo.prompts_per_step={PROMPTS}", f"grpo.group_size={group}",
        f"trainer.training.local_batch_size={PROMPTS * group}", "reference=null",
        "loss.kl_coef=0", "task.num_train=40", "task.num_eval=4", "procs.env={}",
        "reward.functions=[{fn: 'grpo_reference:parity_reward'}]",
        "reward.overlong.enable=true", f"reward.overlong.cache_tokens={l_cache}",
    ])
    assert config.reward.overlong.max_tokens == l_max
    app = app_for(config)
    rollouts = await app.build_rollouts(0)

    def penalty(n):  # eq. 13
        if n <= l_max - l_cache:
            return 0.0
        return ((l_max - l_cache) - n) / l_cache if n <= l_max else -1.0

    lengths = [len(ep.response_ids) for ep in rollouts.episodes]
    penalties = [penalty(n) for n in lengths]
    rubric = [parity_reward(app.tok.completion_text(ep.response_ids.tolist())[0])
              for ep in rollouts.episodes]
    assert rollouts.rewards == rubric  # what reward/mean logs
    shaped = [r + p for r, p in zip(rubric, penalties)]
    assert [ep.reward for ep in rollouts.episodes] == pytest.approx(shaped)
    assert [ep.advantage for ep in rollouts.episodes] == pytest.approx(
        reference_advantages(shaped, group, "group_std"), rel=1e-5, abs=1e-6)
    assert rollouts.stats["reward/overlong_penalty"] == pytest.approx(
        sum(penalties) / len(penalties))
    # Not vacuous: some group holds responses of different penalties, so the shaping moves
    # advantages, not only rewards.
    assert any(len(set(penalties[i : i + group])) > 1 for i in range(0, len(lengths), group))
