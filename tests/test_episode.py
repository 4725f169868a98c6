"""Episodes as tensors from the rollout side to the trainer's batch (forge_ext.rl.episode,
forge_ext.rl.rollouts): the token data becomes tensors once, the packed batch equals the
list-based packing it replaced bit for bit, the reference's log-probs go back onto the
episodes as the slices of the packed rows, and a step's filler groups carry no label."""

import random

import pytest
import torch

from forge_ext.rl.advantages import GroupAdvantage
from forge_ext.rl.episode import Episode, pack_episodes, set_ref_logprobs
from forge_ext.rl.rollouts import Rollouts, episodes_from_trajectories
from forge_ext.rollout.agents import AgentRow
from forge_ext.rollout.runner import EpisodeBatch, Trajectory
from forge_ext.tasks import Row
from forge_ext.tasks.rubric import OverlongConfig, Scores

PAD = 0


def list_packing(episodes, pad_id, seq_len):
    """The packing of episodes held as Python lists, written out token by token: the
    independent reference (the layout of forge_ext.rl.episode's module docstring)."""
    rows = len(episodes)
    ids = [[pad_id] * seq_len for _ in range(rows)]
    labels = [[-100] * seq_len for _ in range(rows)]
    gen = [[0.0] * seq_len for _ in range(rows)]
    ref = [[0.0] * seq_len for _ in range(rows)]
    for b, ep in enumerate(episodes):
        prompt, response = ep["prompt"], ep["response"]
        for t, x in enumerate(prompt + response):
            ids[b][t] = x
        for i, o in enumerate(response):
            t = len(prompt) - 1 + i
            labels[b][t] = o if ep["mask"] is None or ep["mask"][i] else -100
            gen[b][t] = ep["logprobs"][i]
            ref[b][t] = ep["ref"][i]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
            "generator_logprobs": torch.tensor(gen), "ref_logprobs": torch.tensor(ref)}


def random_lists(rng, count, masked):
    out = []
    for _ in range(count):
        p, r = rng.randint(1, 6), rng.randint(1, 7)
        out.append({
            "prompt": [rng.randint(1, 50) for _ in range(p)],
            "response": [rng.randint(1, 50) for _ in range(r)],
            "logprobs": [-rng.random() * 4 for _ in range(r)],
            "ref": [-rng.random() * 4 for _ in range(r)],
            "mask": [rng.randint(0, 1) for _ in range(r)] if masked else None,
        })
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_packing_tensor_episodes_equals_the_list_packing_bit_for_bit(masked):
    lists = random_lists(random.Random(masked), 9, masked)
    episodes = [Episode(prompt_ids=e["prompt"], response_ids=e["response"],
                        generator_logprobs=e["logprobs"], ref_logprobs=e["ref"],
                        response_mask=e["mask"], advantage=0.5, policy_version=0)
                for e in lists]
    packed = pack_episodes(episodes, pad_id=PAD, seq_len=16)
    expected = list_packing(lists, PAD, 16)
    for key, value in expected.items():
        assert packed[key].dtype == value.dtype and torch.equal(packed[key], value), key


def test_episode_fields_are_tensors_of_their_dtypes():
    ep = Episode(prompt_ids=[1, 2], response_ids=[3], generator_logprobs=[-0.5],
                 response_mask=[1], advantage=1.0, policy_version=0)
    assert (ep.prompt_ids.dtype, ep.response_ids.dtype) == (torch.int64, torch.int64)
    assert ep.generator_logprobs.dtype == torch.float32
    assert ep.response_mask.dtype == torch.bool and ep.ref_logprobs is None
    same = torch.tensor([3], dtype=torch.int64)  # a tensor of the field's dtype is kept
    assert Episode(prompt_ids=[1], response_ids=same, generator_logprobs=[0.0], advantage=0,
                   policy_version=0).response_ids is same
    with pytest.raises(ValueError, match=r"generator_logprobs must be 1-D, got shape \(1, 1\)"):
        Episode(prompt_ids=[1], response_ids=[3], generator_logprobs=[[0.0]], advantage=0,
                policy_version=0)


def test_reference_logprobs_are_the_packed_rows_response_slices():
    lists = random_lists(random.Random(3), 5, masked=False)
    episodes = [Episode(prompt_ids=e["prompt"], response_ids=e["response"],
                        generator_logprobs=e["logprobs"], advantage=0.0, policy_version=0)
                for e in lists]
    packed = pack_episodes(episodes, pad_id=PAD)
    ref = torch.randn(packed["input_ids"].shape)
    set_ref_logprobs(episodes, ref)
    for b, (ep, e) in enumerate(zip(episodes, lists)):
        first = len(e["prompt"]) - 1
        assert ep.ref_logprobs.tolist() == ref[b, first : first + len(e["response"])].tolist()
    # Packed again (as the trainer's batch), they sit where the reference computed them.
    again = pack_episodes(episodes, pad_id=PAD)["ref_logprobs"]
    valid = packed["labels"] != -100
    assert torch.equal(again[valid], ref[valid]) and not again[~valid].any()
    with pytest.raises(ValueError, match="4 rows for 5 episodes"):
        set_ref_logprobs(episodes, ref[:4])


def trajectory(prompt, response, mask, logprobs, version=2, rows=None):
    return Trajectory(row=Row(prompt="p", answer="a"), prompt_ids=prompt,
                      response_ids=response, response_mask=mask, logprobs=logprobs,
                      versions=[version], rows=rows)


def test_fillers_are_masked_an_agents_rows_share_its_advantage_and_masks_follow_multi_turn():
    plain = trajectory([1, 2], [3, 4], [1, 1], [-0.1, -0.2])
    turns = trajectory([1], [5, 6, 7], [1, 0, 1], [-0.3, 0.0, -0.4])
    agent = trajectory([1], [8], [1], [-0.5], rows=[
        AgentRow(prompt_ids=[1], response_ids=[8], response_mask=[1], logprobs=[-0.5]),
        AgentRow(prompt_ids=[1, 8, 9], response_ids=[2], response_mask=[1], logprobs=[-0.6])])
    filler = trajectory([1], [9, 9], [1, 1], [-0.7, -0.8])
    episodes = episodes_from_trajectories([plain, turns, agent, filler], [1.0, 0.0, 0.5, 1.0],
                                          torch.tensor([0.25, -0.5, 0.75]), multi_turn=True)
    assert [ep.advantage for ep in episodes] == [0.25, -0.5, 0.75, 0.75, 0.0]
    assert [ep.reward for ep in episodes] == [1.0, 0.0, 0.5, 0.5, 1.0]
    assert [ep.response_mask.tolist() for ep in episodes] == [
        [True, True], [True, False, True], [True], [True], [False, False]]
    assert episodes[3].prompt_ids.tolist() == [1, 8, 9]
    assert episodes[1].generator_logprobs.tolist() == pytest.approx([-0.3, 0.0, -0.4])
    single = episodes_from_trajectories([plain], [1.0], torch.tensor([0.5]), multi_turn=False)
    assert single[0].response_mask is None
    with pytest.raises(ValueError, match="2 trajectories need as many rewards"):
        episodes_from_trajectories([plain, turns], [1.0], torch.tensor([0.5]), multi_turn=True)


def test_a_steps_rollouts_train_the_chosen_groups_then_the_fillers():
    def batch(rewards):
        ts = [trajectory([1], [3, 2], [1, 1], [-0.1, -0.2], version=4) for _ in rewards]
        n = len(rewards)
        return EpisodeBatch(trajectories=ts, scores=Scores(rewards=rewards, by_function={},
                                                           errors={}, correct=[True] * n),
                            rewards=rewards, env_seconds=0.0, reward_seconds=0.0,
                            multi_turn=False)

    batches = [batch([1.0, 1.0, 0.0, 1.0]), batch([0.0, 0.0, 1.0, 0.0])]
    rollouts = Rollouts.of(batches, chosen=[(0, 1), (1, 1)], fillers=[(0, 0)], group=2,
                           estimator=GroupAdvantage(group_size=2), overlong=OverlongConfig())
    assert rollouts.stats == {"rollout/groups_without_spread": 0.5}
    assert [ep.reward for ep in rollouts.episodes] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    advantages = [ep.advantage for ep in rollouts.episodes]
    assert advantages[:4] == pytest.approx([-1.0, 1.0, 1.0, -1.0], abs=1e-4)
    assert advantages[4:] == [0.0, 0.0]
    assert [ep.response_mask is None for ep in rollouts.episodes] == [True] * 4 + [False] * 2
    assert not any(ep.response_mask.any() for ep in rollouts.episodes[4:])
    assert rollouts.generator_version == 4 and len(rollouts.rows) == 3
    assert len(rollouts.batch.trajectories) == 8 and rollouts.seconds == {}
