"""Multi-digit addition as a verifiable RL task, generated in-process (no dataset download):
the ``addition`` source of :mod:`forge_ext.tasks` (the default, and the CPU demo's task).

A problem is two operands drawn uniformly from ``[0, 10**max_digits)``. Prompt text is
``"{a}+{b}="`` (e.g. ``"12+345="``), which the tokenizer encodes as ``<bos>`` followed by one
token per character; the expected response is the decimal sum without leading zeros followed
by ``<eos>`` (e.g. ``"357"`` then ``<eos>``). See :mod:`forge_ext.tasks.tokenizer` for the ids.

Reward (:meth:`AdditionTask.reward`): ``1.0`` if the response up to its first ``<eos>`` is
exactly the sum; ``partial_credit`` (default ``0.0``, off) if it is a wrong but well-formed
number (one or more digits) followed by ``<eos>``; otherwise ``0.0`` (no ``<eos>``, empty
answer, any non-digit token). Tokens after the first ``<eos>`` are ignored (the generator
stops there).

As a :class:`~forge_ext.tasks.base.Task`: rows have the prompt text, the expected answer
(reversed with ``reverse_answer``) and ``metadata = {"a": a, "b": b}``; the task's reward
function ``addition`` is :meth:`AdditionTask.score_text` of the completion (``None`` when
the response has no end token), after stripping surrounding white space.

Splits: the held-out set and the training set are disjoint even up to commutativity (no
``a+b`` in one split when ``a+b`` or ``b+a`` is in the other), and each unordered pair occurs
at most once overall. Both are a pure function of ``(seed, max_digits, num_eval,
num_train)``; the held-out set does not depend on ``num_train``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from forge_ext.tasks.base import Row, Task

# The tokenizer module (transformers: ~1 s) is imported where it is used: a reward worker
# process that runs AdditionReward imports this module and needs none of it.


@dataclass(frozen=True, slots=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        """Prompt text, e.g. ``"12+345="``."""
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """Expected response text without ``<eos>``, e.g. ``"357"``."""
        return str(self.a + self.b)


class AdditionTask(Task):
    """Train/held-out addition problems plus their reward and accuracy."""

    name = "addition"

    @dataclass(kw_only=True, slots=True)
    class Config:
        seed: int = 0
        """Seed of the problem generator."""

        max_digits: int = 3
        """Operands are drawn uniformly from ``[0, 10**max_digits)``."""

        num_train: int = 2000
        """Number of training problems."""

        num_eval: int = 200
        """Number of held-out problems."""

        partial_credit: float = 0.0
        """Reward for a wrong but well-formed answer (digits then ``<eos>``); 0 disables."""

        reverse_answer: bool = False
        """The expected answer lists the sum's digits least significant first (``12+345=`` ->
        ``753``). Each digit then depends only on the operands' digits at that position and the
        carry out of the digit just written, which small transformers learn far more easily
        and more gradually than the usual order (Lee et al. 2023, "Teaching Arithmetic to Small
        Transformers", section 4)."""

        def build(self) -> AdditionTask:
            return AdditionTask(self)

        def __post_init__(self) -> None:
            if self.max_digits < 1:
                raise ValueError(f"AdditionTask.Config.max_digits={self.max_digits} must be >= 1")
            if self.num_train < 0 or self.num_eval < 0:
                raise ValueError(
                    f"AdditionTask.Config.num_train={self.num_train} and "
                    f"num_eval={self.num_eval} must be >= 0"
                )
            n = 10**self.max_digits
            capacity = n * (n + 1) // 2  # unordered operand pairs
            # Rejection sampling of distinct pairs stays cheap while at most half are taken.
            if self.num_train + self.num_eval > capacity // 2:
                raise ValueError(
                    f"AdditionTask.Config.num_train + num_eval = "
                    f"{self.num_train + self.num_eval} exceeds {capacity // 2}, half of the "
                    f"{capacity} distinct problems with max_digits={self.max_digits}; "
                    "raise max_digits or ask for fewer problems"
                )
            if not 0.0 <= self.partial_credit < 1.0:
                raise ValueError(
                    f"AdditionTask.Config.partial_credit={self.partial_credit} must be in [0, 1)"
                )

    def __init__(self, config: Config) -> None:
        from forge_ext.tasks.tokenizer import build_tokenizer

        self.config = config
        self._tokenizer = build_tokenizer()
        problems = _distinct_problems(
            random.Random(config.seed), config.max_digits, config.num_eval + config.num_train
        )
        self.eval_problems: list[AdditionProblem] = problems[: config.num_eval]
        self.train_problems: list[AdditionProblem] = problems[config.num_eval :]

    # ---- the Task interface ---------------------------------------------------------------
    def _row(self, problem: AdditionProblem) -> Row:
        return Row(prompt=problem.prompt, answer=self.expected(problem),
                   metadata={"a": problem.a, "b": problem.b})

    def train_rows(self) -> list[Row]:
        return [self._row(p) for p in self.train_problems]

    def eval_rows(self) -> list[Row]:
        return [self._row(p) for p in self.eval_problems]

    def rewards(self) -> dict:
        return {"addition": AdditionReward(self.config)}

    def default_rewards(self) -> list[str]:
        return ["addition"]

    def characters(self) -> str:
        """The character tokenizer's fixed alphabet (:mod:`forge_ext.tasks.tokenizer`)."""
        from forge_ext.tasks.tokenizer import CHARACTERS

        return CHARACTERS

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in tokens: ``<bos>``, two operands, ``'+'`` and ``'='``."""
        return 1 + 2 * self.config.max_digits + 2

    @property
    def max_response_tokens(self) -> int:
        """Longest correct response in tokens: ``max_digits + 1`` digits and ``<eos>``."""
        return self.config.max_digits + 2

    def expected(self, problem: AdditionProblem) -> str:
        """The correct response text (without ``<eos>``): ``problem.answer``, reversed when
        ``config.reverse_answer``."""
        return _expected(problem, self.config)

    def reward(self, problem: AdditionProblem, response_ids: Sequence[int]) -> float:
        """Reward of one sampled response in the task's own tokenizer (rules in the module
        docstring).

        Args:
            problem: the prompt's problem.
            response_ids: generated token ids after the prompt, ``<eos>`` included if emitted.

        Returns:
            ``1.0``, ``config.partial_credit`` or ``0.0``.
        """
        return self.score_text(problem, self._answer_text(response_ids))

    def score_text(self, problem: AdditionProblem, answer: str | None) -> float:
        """Reward of a decoded answer: the text before ``<eos>``, or None if the response
        never emitted ``<eos>``. Lets an app score responses of any tokenizer."""
        return _score_text(problem, answer, self.config)

    def accuracy(
        self, problems: Sequence[AdditionProblem], responses: Sequence[Sequence[int]]
    ) -> float:
        """Fraction of responses that are exactly the sum followed by ``<eos>``, in [0, 1].

        Raises:
            ValueError: if the two sequences differ in length or are empty.
        """
        return self.accuracy_text(problems, [self._answer_text(ids) for ids in responses])

    def accuracy_text(
        self, problems: Sequence[AdditionProblem], answers: Sequence[str | None]
    ) -> float:
        """:meth:`accuracy` of decoded answers (see :meth:`score_text`).

        Raises:
            ValueError: if the two sequences differ in length or are empty.
        """
        if len(problems) != len(answers) or not problems:
            raise ValueError(
                f"accuracy needs as many responses as problems, and at least one; got "
                f"{len(answers)} responses for {len(problems)} problems"
            )
        correct = sum(
            answer == self.expected(problem)
            for problem, answer in zip(problems, answers, strict=True)
        )
        return correct / len(problems)

    def _answer_text(self, response_ids: Sequence[int]) -> str | None:
        """Decoded text before the first ``<eos>``; ``None`` if there is no ``<eos>``."""
        from forge_ext.tasks.tokenizer import EOS_ID

        ids = list(response_ids)
        if EOS_ID not in ids:
            return None
        # skip_special_tokens=False: a stray <bos>/<pad> inside the answer must make it wrong.
        return self._tokenizer.decode(ids[: ids.index(EOS_ID)], skip_special_tokens=False)


@dataclass(frozen=True, slots=True)
class AdditionReward:
    """The task's reward function ``addition``: :meth:`AdditionTask.score_text` of the
    completion, stripped (None when the response has no end token). An object of the task's
    config rather than a closure over the task, so that a reward worker process receives it
    by reference (:mod:`forge_ext.tasks.workers`)."""

    config: AdditionTask.Config

    def __call__(self, completion: str, finished: bool, row: Row) -> float:
        problem = AdditionProblem(row.metadata["a"], row.metadata["b"])
        return _score_text(problem, completion.strip() if finished else None, self.config)


def _expected(problem: AdditionProblem, config: AdditionTask.Config) -> str:
    return problem.answer[::-1] if config.reverse_answer else problem.answer


def _score_text(problem: AdditionProblem, answer: str | None,
                config: AdditionTask.Config) -> float:
    """Reward rules of the module docstring (see :meth:`AdditionTask.score_text`)."""
    if answer is None:
        return 0.0
    if answer == _expected(problem, config):
        return 1.0
    if answer and all(char.isdigit() for char in answer):
        return config.partial_credit
    return 0.0


def _distinct_problems(rng: random.Random, max_digits: int, count: int) -> list[AdditionProblem]:
    """``count`` problems, no two sharing the same unordered operand pair."""
    n = 10**max_digits
    seen: set[tuple[int, int]] = set()
    problems: list[AdditionProblem] = []
    while len(problems) < count:
        a, b = rng.randrange(n), rng.randrange(n)
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            problems.append(AdditionProblem(a, b))
    return problems
