"""``python -m apps.eval``: evaluate checkpoints without training (:mod:`apps.eval.main`)."""
