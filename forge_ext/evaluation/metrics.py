"""Metrics of ``n`` samples per prompt: pass@k, mean@k, maj@k, greedy accuracy.

Per prompt, ``n`` samples, ``c`` of them correct (the rubric's accuracy function scored them
1.0, :mod:`forge_ext.tasks.rubric`); a metric of a set is its mean over the set's prompts.

- ``pass@k``: the probability that at least one of ``k`` samples drawn without replacement
  from the ``n`` is correct, ``1 - C(n - c, k) / C(n, k)``: the unbiased estimator of Chen et
  al. 2021 ("Evaluating Large Language Models Trained on Code", arXiv:2107.03374, eq. 1;
  ``n >= k``), computed in exact integers.
- ``mean@k``: the expected fraction of correct samples among ``k``; for any ``k <= n`` its
  unbiased estimate from the ``n`` is ``c / n`` (verl's ``mean@N``).
- ``maj@k``: majority voting (self-consistency, Wang et al. 2022, arXiv:2203.11171): of ``k``
  samples the most frequent final answer wins and scores its correctness. Answers are the
  samples' final answers as text (:func:`final_answer`); a sample with no answer (cut at the
  length limit) does not vote; ties are shared (a tie of ``t`` answers scores the mean of
  their correctness, the expectation of a random tie-break). With ``k < n`` the value is the
  mean over every ``k``-subset of the ``n`` samples when there are at most
  :data:`MAJ_SUBSETS` of them, else over that many random subsets (seeded).
- ``greedy``: accuracy of one greedy (argmax) completion per prompt.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Sequence

KINDS = ("pass", "mean", "maj")
"""Metrics with ``@k``; ``greedy`` has none."""
MAJ_SUBSETS = 2000
"""Most ``k``-subsets maj@k averages over (module docstring)."""


def parse_metric(name: str) -> tuple[str, int | None]:
    """``"pass@8"`` -> ``("pass", 8)``, ``"greedy"`` -> ``("greedy", None)``.

    Raises:
        ValueError: anything else, listing the accepted forms.
    """
    if name == "greedy":
        return "greedy", None
    match = re.fullmatch(r"(pass|mean|maj)@(\d+)", str(name))
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"metric {name!r} is not one of greedy, pass@k, mean@k, maj@k "
                         "(k >= 1)")
    return match.group(1), int(match.group(2))


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)`` (module docstring), exact.

    Raises:
        ValueError: ``k > n``, or ``c`` outside ``[0, n]``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(n: int, c: int, k: int) -> float:
    """``c / n``: the unbiased estimate of the expected accuracy of ``k`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"mean@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return c / n


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """The correctness of the majority answer of these samples (module docstring): 0 when
    none has an answer; a tie scores the mean correctness of the tied answers."""
    votes: dict[str, list[bool]] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            votes.setdefault(answer, []).append(bool(ok))
    if not votes:
        return 0.0
    most = max(len(v) for v in votes.values())
    tied = [v for v in votes.values() if len(v) == most]
    # Samples of one answer normally agree; if a reward also reads other text, the answer's
    # correctness is the share of its samples scored correct.
    return sum(sum(v) / len(v) for v in tied) / len(tied)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int,
             seed: int = 0) -> float:
    """maj@k of one prompt's ``n`` samples (module docstring).

    Raises:
        ValueError: ``k > n``.
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n; got n={n}, k={k}")
    if k == n:
        return majority_correct(answers, correct)
    if math.comb(n, k) <= MAJ_SUBSETS:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(MAJ_SUBSETS))
    values = [majority_correct([answers[i] for i in s], [correct[i] for i in s])
              for s in subsets]
    return sum(values) / len(values)


def final_answer(completion: str, finished: bool, pattern: str | None = None) -> str | None:
    """The final answer maj@k votes on: None for a completion cut at the length limit;
    with ``pattern`` (a regex with one group) its last match's group, None without a match;
    otherwise the text after the last ``####`` (GSM8K), else the last
    ``<answer>...</answer>`` (reasoning-gym), else the whole completion; stripped
    (:func:`forge_ext.tasks.rewards.gsm8k_final`, :func:`~forge_ext.tasks.rewards.extract_answer`)."""
    from forge_ext.tasks.rewards import extract_answer, gsm8k_final

    if not finished:
        return None
    if pattern is not None:
        matches = re.findall(pattern, completion, re.DOTALL)
        return matches[-1].strip() if matches else None
    return extract_answer(gsm8k_final(completion))
