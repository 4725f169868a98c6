"""Evaluation: sets of prompts sampled ``n`` times each and summarised as pass@k, mean@k,
maj@k and greedy accuracy, for the GRPO app's periodic evaluation and for ``apps.eval``.

- :mod:`~forge_ext.evaluation.metrics`: the estimators (pass@k of Chen et al. 2021, mean@k,
  maj@k) and the final answer maj@k votes on;
- :mod:`~forge_ext.evaluation.sets`: ``eval:`` and ``eval.sets`` configs, their checks before
  anything is spawned, and running a set through the generator replicas;
- :mod:`~forge_ext.evaluation.report`: ``eval_results.json``, the markdown table, the plot
  across a run's checkpoints.
"""

from forge_ext.evaluation.metrics import maj_at_k, mean_at_k, parse_metric, pass_at_k
from forge_ext.evaluation.sets import (
    EvalConfig, EvalSet, EvalSetConfig, SetResult, as_logged, build_sets, check_sets,
    close_sets, default_set, evaluate_held_out, evaluate_sets, overall,
)

__all__ = [
    "EvalConfig", "EvalSet", "EvalSetConfig", "SetResult", "as_logged", "build_sets",
    "check_sets", "close_sets", "default_set", "evaluate_held_out", "evaluate_sets",
    "maj_at_k", "mean_at_k", "overall", "parse_metric", "pass_at_k",
]
