"""PPO on real Monarch actors: ``python -m apps.ppo.main --config configs/<name>.yaml [k=v ...]``.

PPO is the RL app of :mod:`apps.grpo.main` (:class:`apps.grpo.main.RLApp`) with
``algorithm.advantage: gae`` and a ``critic:`` role (docs/ppo.md; e.g.
``configs/ppo_cpu_demo.yaml``): the same command line, config reference and outputs, the
critic's value loss and explained variance in each step line. ``python -m apps.grpo.main``
runs the same configs.
"""

from __future__ import annotations

if __name__ == "__main__":  # --help and config errors before the imports below (seconds)
    from apps.fast_help import check_command_line

    # The config, the data, the rewards and every prompt, checked before torchtitan and
    # Monarch are imported; the app takes them as they are (main's inputs).
    _checked_inputs = check_command_line("ppo", "apps.grpo.prepare:check_run")

from apps.grpo import main as rl_app
from apps.grpo.prepare import FinishedRun, RunInputs
from forge_ext.runtime.supervision import shutdown_monarch


def main(argv: list[str] | None = None,
         inputs: RunInputs | FinishedRun | None = None) -> None:
    """The command line: ``--config PATH [key=value ...]``, as :func:`apps.grpo.main.main`'s,
    under this module's name (``--help``, the resume command after a failure)."""
    rl_app.main(argv, inputs, module="apps.ppo.main", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    try:
        main(inputs=_checked_inputs)
    finally:  # the program's end: not in Monarch's 1-second atexit hook (see shutdown_monarch)
        shutdown_monarch()
