"""Agents that ship with forge_ext (``task.agent: "forge_ext.tasks.agents:<name>"``); a
user's own is any ``async def run(client, row)`` (docs/agents.md).

An agent gets an ``openai.AsyncOpenAI`` bound to its episode's session and the task row, calls
the model as it likes, and returns a reward (a number), a final answer for the rubric (a
string) or None (the rubric scores its last completion).
"""

from __future__ import annotations

from typing import Any


async def answer_then_check(client: Any, row: Any) -> str:
    """The CPU demo's task as an agent: answer, then a "check your answer" call whose prompt
    is the question, the first answer and ``=`` (the task's own "try again" mark, as the
    ``feedback`` environment uses it). An empty reply confirms the first answer; anything
    else replaces it. The final answer is scored.

    Both calls are text completions, so the second prompt is re-encoded text, not the first
    call's tokens (its end token is gone): the episode trains as two rows, both with the
    episode's advantage (docs/agents.md, the merge rule).
    """
    first = await client.completions.create(model="policy", prompt=row.prompt, max_tokens=8)
    answer = first.choices[0].text.strip()
    check = await client.completions.create(model="policy", prompt=f"{row.prompt}{answer}=",
                                            max_tokens=8)
    return check.choices[0].text.strip() or answer
