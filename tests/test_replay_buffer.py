"""Replay buffer: staleness eviction, sampling without replacement, determinism."""

from dataclasses import dataclass

import pytest

from forge_ext.rl.replay_buffer import ReplayBuffer


@dataclass
class Ep:
    name: str
    policy_version: int


def filled(versions, max_policy_age=1, seed=0) -> ReplayBuffer:
    buffer = ReplayBuffer(ReplayBuffer.Config(max_policy_age=max_policy_age, seed=seed))
    for i, version in enumerate(versions):
        buffer.add(Ep(f"e{i}", version))
    return buffer


def test_evict_drops_episodes_older_than_max_policy_age():
    buffer = filled([0, 1, 2, 3, 3, 4], max_policy_age=1)
    assert buffer.evict(curr_policy_version=3) == 2  # versions 0 and 1: age 3 and 2 > 1
    assert len(buffer) == 4
    left = buffer.sample(curr_policy_version=3, batch_size=4)
    assert sorted(ep.policy_version for ep in left) == [2, 3, 3, 4]


def test_max_policy_age_zero_is_on_policy_only():
    buffer = filled([4, 5, 5], max_policy_age=0)
    batch = buffer.sample(curr_policy_version=5, batch_size=2)
    assert [ep.policy_version for ep in batch] == [5, 5]
    assert len(buffer) == 0


def test_sample_returns_none_until_enough_fresh_episodes():
    buffer = filled([0, 0, 1], max_policy_age=1)
    assert buffer.sample(curr_policy_version=1, batch_size=4) is None
    assert len(buffer) == 3  # nothing removed by a failed sample
    # At version 2 the two version-0 episodes are evicted first, leaving one.
    assert buffer.sample(curr_policy_version=2, batch_size=2) is None
    assert len(buffer) == 1


def test_sample_removes_what_it_returns_without_duplicates():
    buffer = filled([0] * 10)
    first = buffer.sample(curr_policy_version=0, batch_size=4)
    second = buffer.sample(curr_policy_version=0, batch_size=6)
    names = [ep.name for ep in first + second]
    assert sorted(names) == sorted(f"e{i}" for i in range(10))
    assert len(buffer) == 0
    assert buffer.sample(curr_policy_version=0, batch_size=1) is None


def test_sampling_is_random_but_reproducible_from_the_seed():
    def draw(seed):
        return [ep.name for ep in filled([0] * 50, seed=seed).sample(0, batch_size=10)]

    assert draw(seed=1) == draw(seed=1)
    assert draw(seed=1) != draw(seed=2)
    assert draw(seed=1) != [f"e{i}" for i in range(10)]  # not simply the oldest first


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_policy_age=-1"):
        ReplayBuffer.Config(max_policy_age=-1)
    buffer = filled([0])
    with pytest.raises(ValueError, match="batch_size=0"):
        buffer.sample(curr_policy_version=0, batch_size=0)
    with pytest.raises(TypeError, match="policy_version"):
        buffer.add(object())


def test_clear_empties_the_buffer():
    buffer = filled([0, 1])
    buffer.clear()
    assert len(buffer) == 0
