"""Asynchronous vs synchronous RL loop benchmark: the GRPO app, same config and model, in
``loop.mode: sync`` and ``async``, side by side in one run.

Run from the repository root::

    .venv/bin/python -m bench.async_loop                 # 20 steps per configuration
    .venv/bin/python -m bench.async_loop --steps 30 --reps 2

Every configuration is ``configs/grpo_cpu_demo.yaml`` (64 prompts x 8 samples per step, the
demo's 2-layer Qwen3; trainer, reference and generator each in a proc of its own, one torch
thread each, ``procs.env.OMP_NUM_THREADS: 1``) with checkpoints off and a 50-prompt held-out
set, changing only the loop:

- ``sync`` ``max_policy_age 0``: the demo (rollouts, then training, then the weight sync);
- ``sync`` ``max_policy_age 1``: the weight sync overlaps the next rollouts;
- ``async`` ``max_policy_age 1`` (``configs/grpo_cpu_async.yaml``) and ``2``: a rollout task
  generates the next steps while the trainer trains.

The model is the demo's warm-start (``outputs/demo/warmstart``, written by
``python -m apps.sft.main --config configs/sft_cpu_demo.yaml``) when it exists, else a random
checkpoint of the same architecture (``--hf-path`` picks another). Figures are from the
app's own per-step metrics (``time/step``, the policy ages, ``time/*_idle``) over the steady
steps: the first two (warm-up, and the first weight sync) and the last (the final held-out
evaluation) are left out. Configurations run one after another, ``--reps`` rounds
interleaved; the table shows each configuration's mean, its ratio to ``sync`` age 0, and the
load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import forge_ext  # noqa: F401  (CPU device for torchtitan, before anything imports it)
from apps.grpo.config import load_config
from apps.grpo.main import RLApp

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "configs" / "grpo_cpu_demo.yaml"
ASYNC_CONFIG = ROOT / "configs" / "grpo_cpu_async.yaml"
WARM_START = Path("outputs/demo/warmstart")

CONFIGURATIONS = [  # (label, config file, max_policy_age)
    ("sync", DEMO_CONFIG, 0),
    ("sync", DEMO_CONFIG, 1),
    ("async", ASYNC_CONFIG, 1),
    ("async", ASYNC_CONFIG, 2),
]


class QuietApp(RLApp):
    """The app without its progress bar and console lines (the table is the output)."""

    def fast_forward(self, step: int) -> None:
        pass

    def write(self, line: str) -> None:
        pass

    def on_finish(self, completed: bool) -> None:
        pass


def random_checkpoint(folder: Path) -> str:
    """A random HF checkpoint with the warm-start's architecture and tokenizer."""
    from forge_ext.tasks.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer
    from forge_ext.config import load_yaml
    from forge_ext.engine.hf_checkpoint import init_hf_checkpoint

    architecture = load_yaml(ROOT / "configs" / "sft_cpu_demo.yaml")["init"]["architecture"]
    fields = {"vocab_size": VOCAB_SIZE, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
              **architecture}
    save_tokenizer(folder / "tok")
    return str(init_hf_checkpoint(folder / "ckpt", "qwen3", fields, seed=0,
                                  tokenizer_from=folder / "tok"))


async def run_one(config_file: Path, max_policy_age: int, hf_path: str, steps: int,
                  output_dir: str) -> dict[str, float]:
    """One app run; means over its steady steps."""
    config = load_config(str(config_file), [
        f"model.hf_path={hf_path}", f"output_dir={output_dir}", f"loop.steps={steps}",
        f"loop.max_policy_age={max_policy_age}", "loop.eval_every=0", "loop.save_every=0",
        "trainer.checkpoint.enable=false", "task.num_eval=50", "metrics.tensorboard=false",
        "metrics.plot=null",
    ])
    app = QuietApp(config)
    await app.run()
    rows = [r for r in app.metrics.history if "loss" in r][2:-1]  # steady steps
    seconds = sum(r["time/step"] for r in rows)
    samples = sum(r["throughput/samples_per_s"] * r["time/step"] for r in rows)
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    return {
        "step_s": seconds / len(rows), "samples_per_s": samples / seconds,
        "age_mean": mean("rollout/policy_age_mean"),
        "age_max": max(r["rollout/policy_age_max"] for r in rows),
        "dropped": sum(r["rollout/dropped_samples"] for r in rows),
        "trainer_idle": mean("time/trainer_idle"), "generator_idle": mean("time/generator_idle"),
        "generate": mean("time/generate"), "train": mean("time/train"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per run (>= 6)")
    p.add_argument("--reps", type=int, default=1, help="interleaved rounds of all runs")
    p.add_argument("--hf-path", default=None, help="checkpoint (default: the warm-start)")
    args = p.parse_args(argv)
    if args.steps < 6:
        p.error(f"--steps={args.steps} must be >= 6 (three steps are not measured)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_async_loop_") as tmp:
        hf_path = args.hf_path
        if hf_path is None:
            hf_path = str(WARM_START) if (WARM_START / "config.json").is_file() else (
                random_checkpoint(Path(tmp) / "model")
            )
        loads = [os.getloadavg()[0]]
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for rep in range(args.reps):
            for i, (mode, config_file, age) in enumerate(CONFIGURATIONS):
                out = str(Path(tmp) / f"run_{rep}_{i}")
                print(f"round {rep + 1}/{args.reps}: {mode} max_policy_age {age} ...",
                      file=sys.stderr, flush=True)
                result = asyncio.run(run_one(config_file, age, hf_path, args.steps, out))
                results.setdefault((mode, age), []).append(result)
                loads.append(os.getloadavg()[0])
    print(f"\nmodel {hf_path}; {args.steps} steps per run, steps 3..{args.steps - 1} measured, "
          f"{args.reps} round(s); load average {min(loads):.1f}-{max(loads):.1f}\n")
    base = statistics.fmean(r["step_s"] for r in results["sync", 0])
    print("| mode | max_policy_age | s/step | samples/s | speed-up vs sync age 0 | mean (max) "
          "sample age | dropped | trainer idle s/step | generator idle s/step | generate s "
          "| train s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (mode, age), runs in results.items():
        m = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
        print(f"| {mode} | {age} | {m['step_s']:.3f} | {m['samples_per_s']:.0f} | "
              f"{base / m['step_s']:.2f}x | {m['age_mean']:.2f} ({int(m['age_max'])}) | "
              f"{int(m['dropped'])} | {m['trainer_idle']:.3f} | {m['generator_idle']:.3f} | "
              f"{m['generate']:.3f} | {m['train']:.3f} |")


if __name__ == "__main__":
    main()
