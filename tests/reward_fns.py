"""Reward functions the rubric tests call by import path (``reward_fns:power``), as a user's
module would be called.

A module of their own: a reward worker process imports the module of each function it runs,
and this one imports nothing heavy (a test module's ``conftest`` imports torch and Monarch).
"""

import asyncio
import math
import os
import time

class NoTask:
    """A task with no reward functions of its own (the rubric's come from ``reward:``)."""

    name = "t"

    def rewards(self):
        return {}

    def default_rewards(self):
        return []


HUGE = "1000000000"
"""The completion that makes :func:`power` compute ``10 ** 10**9``: one C big-int call that
holds the GIL for minutes (CPython's ``long_pow`` never releases it)."""


def sync_reward(completion, answer):
    return float(completion == answer)


async def async_reward(completion, row):
    await asyncio.sleep(0)
    return 0.5 if row.answer in completion else 0.0


def raises(completion):
    raise RuntimeError("boom")


def hangs(completion):
    time.sleep(30)
    return 1.0


async def hangs_async(completion):
    await asyncio.sleep(30)
    return 1.0


def nan(completion):
    return math.nan


def string(completion):
    return "1.0"


def array(completion):
    import numpy

    return numpy.array([0.25])  # one element: a number


def pid(completion):
    """The process the call ran in; it takes 0.2 s, so that a batch needs several workers."""
    time.sleep(0.2)
    return float(os.getpid())


async def pid_async(completion):
    await asyncio.sleep(0.2)
    return float(os.getpid())


def power(completion):
    """1.0: ``10**n mod 9`` is 1 for every n >= 0. At :data:`HUGE` it runs for minutes."""
    return float(10 ** int(completion) % 9 == 1)


async def power_async(completion):
    """:func:`power` from an async function: a blocking C call inside a coroutine."""
    return power(completion)


# A user's functions reading a row's column ``gold``, the three ways TRL and our docs show.
def gold_by_key(completion, row):
    return float(completion == row["gold"])


def gold_by_keyword(completion, gold, level=-1):
    return float(completion == gold) + 10 * level  # level: another column, optional


def gold_by_kwargs(completion, **columns):
    return float(completion == columns["gold"]) + 100 * ("row" in columns)


class GoldTask:
    """Rows with columns ``gold`` and ``level`` beside the prompt and answer."""

    name = "gold"

    def train_rows(self):
        from forge_ext.tasks import Row

        return [Row(prompt=f"q{i}", answer="unused", metadata={"gold": str(i), "level": i})
                for i in range(3)]

    def eval_rows(self):
        return self.train_rows()[:1]

    def rewards(self):
        return {}

    def default_rewards(self):
        return []


FAIL_FLAG = "FORGE_TEST_REWARD_FAIL_FLAG"
"""The environment variable naming :func:`fails_when_flagged`'s flag file (reward worker
processes inherit the controller's environment)."""


def fails_when_flagged(completion):
    """0.0, and a ``RuntimeError`` on every call while the file named by ``$FORGE_TEST_REWARD_
    FAIL_FLAG`` exists: a reward that starts failing mid-run (a judge service gone down)."""
    flag = os.environ.get(FAIL_FLAG)
    if flag and os.path.exists(flag):
        raise RuntimeError("the judge service is down")
    return 0.0


def distinct_ids(completion_ids):
    """A dense reward for a random model that seldom finishes an answer: the number of
    distinct token ids in the response, so the samples of a group almost always differ
    (GRPO advantages not all zero) (tests/test_hf_families.py)."""
    return float(len(set(completion_ids)))
