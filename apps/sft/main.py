"""Supervised warm-start: ``python -m apps.sft.main --config configs/sft_cpu_demo.yaml [k=v ...]``.

Trains a causal LM on ``prompt -> answer <eos>`` of the embedded addition task (loss on the
answer tokens only) with the engine in this process, then writes an HF checkpoint directory
(``config.json`` + ``model.safetensors`` + tokenizer) to ``output_dir``, evaluates it on the
held-out prompts with greedy decoding, and exits, recording its config in
``<output_dir>/run_config.yaml``. With ``skip_if_exists: true`` (default) an existing
checkpoint in ``output_dir`` is kept and nothing runs, if it was written with the same config
(except :data:`MAY_CHANGE_ON_SKIP`); otherwise the run is refused, naming what differs.

Starting point: ``init.hf_path``. If that directory holds no checkpoint, a randomly
initialised ``transformers`` model with ``init.architecture`` (HF ``config.json`` fields) and
the task's tokenizer is written there first, so the engine loads it through the same
``flavor: hf`` path as a downloaded checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forge_ext  # noqa: F401  (selects the CPU device before torchtitan is imported)
from apps.grpo.episode import Episode, pack_episodes
from apps.grpo.task import AdditionProblem, AdditionTask
from apps.grpo.tokenizer import VOCAB_SIZE, CheckpointTokenizer, save_tokenizer
from forge_ext.config import (
    RUN_CONFIG_FILE, apply_env, from_mapping, load_yaml, parse_cli, record_run_config,
)
from forge_ext.generation import HFSampler, SamplingConfig
from forge_ext.hf_checkpoint import init_hf_checkpoint, is_hf_checkpoint, save_hf_checkpoint
from forge_ext.metrics import MetricLogger, MetricsConfig


@dataclass(kw_only=True, slots=True)
class InitConfig:
    """Where training starts (YAML ``init:``)."""

    hf_path: str
    """HF checkpoint directory to start from; if it holds none, a random model is written."""
    model_type: str = "qwen3"
    """``transformers`` model type of the random model."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """HF ``config.json`` fields of the random model; ``vocab_size`` defaults to the task
    tokenizer's, special token ids to its ``<bos>``/``<eos>``/``<pad>``."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Steps between validation evaluations during training (0: only the final held-out one)."""
    num_validation: int = 200
    """Training problems whose greedy accuracy is the validation metric (the held-out set is
    never used to decide anything)."""
    stop_at_accuracy: float | None = None
    """Stop once the validation accuracy reaches this (needs ``every``): a warm-start that is
    partly right whatever the seed or the machine's numerics, rather than after a fixed number
    of steps (addition is learnt abruptly, at a step that varies with the seed)."""
    max_new_tokens: int | None = None
    """Longest greedy answer; default: the task's longest correct answer."""

    def __post_init__(self) -> None:
        if self.stop_at_accuracy is not None and not self.every:
            raise ValueError("eval.stop_at_accuracy needs eval.every > 0")


# Keys that may differ from the run that wrote an existing warm-start, which is then kept.
MAY_CHANGE_ON_SKIP = ("skip_if_exists", "metrics", "env")


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """The SFT app's config (YAML top level)."""

    output_dir: str
    """The warm-start HF checkpoint directory written at the end."""
    init: InitConfig
    trainer: dict[str, Any]
    """Engine config (:func:`forge_ext.engine.engine_config_from_mapping`);
    ``trainer.model`` should be ``{name: qwen3, flavor: hf, hf_path: ${init.hf_path}}``."""
    skip_if_exists: bool = True
    """Keep an existing checkpoint in ``output_dir`` and do nothing."""
    seed: int = 0
    """Seeds the random init and the order of training problems."""
    task: AdditionTask.Config = field(default_factory=AdditionTask.Config)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Environment set before training, e.g. ``OMP_NUM_THREADS: "1"`` (see
    :func:`forge_ext.config.apply_env`)."""


def kept_checkpoint(config: SFTConfig) -> bool:
    """True if ``skip_if_exists`` keeps a checkpoint already in ``output_dir``.

    Raises:
        ValueError: that checkpoint was written with another config (names what differs).
    """
    out = Path(config.output_dir)
    if not (config.skip_if_exists and is_hf_checkpoint(out)):
        return False
    if (out / RUN_CONFIG_FILE).exists():  # a checkpoint without one predates the records
        record_run_config(
            out, config, may_change=MAY_CHANGE_ON_SKIP, rerun="keeps the checkpoint there"
        )
    return True


def ensure_init_checkpoint(config: SFTConfig) -> bool:
    """Write a random model (and the task tokenizer) to ``init.hf_path`` unless a checkpoint
    is there already; returns whether it wrote one."""
    path = Path(config.init.hf_path)
    if is_hf_checkpoint(path):
        return False
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        save_tokenizer(tokenizer_dir)
        tok = CheckpointTokenizer(tokenizer_dir)
        fields = {
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": tok.tokenizer.bos_token_id,
            "eos_token_id": tok.eos_id,
            "pad_token_id": tok.pad_id,
            **config.init.architecture,
        }
        init_hf_checkpoint(
            path, config.init.model_type, fields, seed=config.seed, tokenizer_from=tokenizer_dir
        )
    return True


def sft_batch(
    problems: list[AdditionProblem], task: AdditionTask, tok: CheckpointTokenizer
) -> dict[str, Any]:
    """``input_ids``/``labels`` ``[B, S]`` for ``prompt answer <eos>`` rows, labels only on the
    answer and ``<eos>`` (the same alignment GRPO trains on, see :mod:`apps.grpo.episode`)."""
    rows = []
    for problem in problems:
        answer = tok.encode_answer(task.expected(problem))
        rows.append(Episode(
            prompt_ids=tok.encode_prompt(problem.prompt), response_ids=answer,
            generator_logprobs=[0.0] * len(answer), advantage=0.0, policy_version=0,
        ))
    packed = pack_episodes(rows, pad_id=tok.pad_id)
    return {"input_ids": packed["input_ids"], "labels": packed["labels"]}


def greedy_accuracy(
    sampler: HFSampler, task: AdditionTask, problems: list[AdditionProblem],
    tok: CheckpointTokenizer, max_new_tokens: int,
) -> float:
    """Greedy accuracy on ``problems``, in [0, 1]."""
    completions = sampler.generate(
        [tok.encode_prompt(p.prompt) for p in problems], 1,
        SamplingConfig(max_new_tokens=max_new_tokens), greedy=True,
    )
    return task.accuracy_text(problems, [tok.answer_text(c.response_ids) for c in completions])


def run(config: SFTConfig) -> float | None:
    """Train (until ``trainer.training.steps`` or ``eval.stop_at_accuracy``), save and
    evaluate on the held-out problems (see the module docstring).

    Returns:
        The saved checkpoint's held-out accuracy, or None when skipped.
    """
    from tqdm import tqdm

    from forge_ext.engine import TitanEngine, cross_entropy_loss, engine_config_from_mapping, valid_tokens
    from forge_ext.engine.distributed import init_single_process_env

    out = Path(config.output_dir)
    if kept_checkpoint(config):
        print(f"warm-start: checkpoint {out} exists, skipping (skip_if_exists=false retrains)")
        return None
    apply_env(config.env)
    task = AdditionTask(config.task)
    ensure_init_checkpoint(config)
    engine_config = engine_config_from_mapping(config.trainer)
    tok = CheckpointTokenizer(config.init.hf_path)
    max_new_tokens = config.eval.max_new_tokens or task.max_response_tokens
    init_single_process_env()
    engine = TitanEngine(engine_config)
    sampler = HFSampler(
        config.init.hf_path, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id
    )
    logger = MetricLogger(config.metrics) if config.metrics else None
    if logger:
        logger.open()

    validation = task.train_problems[: config.eval.num_validation]

    def validate(step: int) -> float:
        sampler.load_hf_state_dict(_full(engine.hf_state_dict()))
        accuracy = greedy_accuracy(sampler, task, validation, tok, max_new_tokens)
        if logger:
            logger.log(step, {"validation/accuracy": accuracy})
        return accuracy

    rng = random.Random(config.seed)
    steps, batch_size = engine_config.training.steps, engine_config.training.local_batch_size
    start = time.perf_counter()
    step = 0
    bar = tqdm(range(1, steps + 1), desc="warm-start (SFT)", unit="step", file=sys.stdout)
    for step in bar:
        batch = sft_batch([rng.choice(task.train_problems) for _ in range(batch_size)], task, tok)
        metrics = engine.train_batch(batch, cross_entropy_loss, valid_tokens)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        if logger:
            logger.log(step, {"sft/loss": metrics["loss"], "sft/lr": metrics["lr"]})
        if config.eval.every and step % config.eval.every == 0 and step < steps:
            accuracy = validate(step)
            bar.write(f"step {step}: validation accuracy {accuracy:.1%}")
            target = config.eval.stop_at_accuracy
            if target is not None and accuracy >= target:
                bar.write(f"step {step}: reached eval.stop_at_accuracy={target}, stopping")
                break
    bar.close()

    hf_config = json.loads((Path(config.init.hf_path) / "config.json").read_text())
    save_hf_checkpoint(out, engine.hf_state_dict(), hf_config, tokenizer_from=config.init.hf_path)
    record_run_config(out, config, check=False)  # what wrote this checkpoint
    # Evaluate the checkpoint as written, through the path the GRPO app loads it by.
    saved = HFSampler(str(out), stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    accuracy = greedy_accuracy(saved, task, task.eval_problems, tok, max_new_tokens)
    if logger:
        logger.log(step, {"eval/accuracy": accuracy})
        logger.close(plot_keys=["validation/accuracy", "eval/accuracy"], title="warm-start")
    engine.close()
    print(
        f"warm-start: {step} steps in {time.perf_counter() - start:.0f}s; held-out accuracy "
        f"{accuracy:.1%} on {len(task.eval_problems)} prompts (greedy); checkpoint {out}"
    )
    return accuracy


def _full(state_dict: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}


def main(argv: list[str] | None = None) -> None:
    path, overrides = parse_cli(argv, __doc__.splitlines()[0])
    try:
        config = from_mapping(SFTConfig, load_yaml(path, overrides))
        kept = kept_checkpoint(config)  # a kept checkpoint must come from the same config
    except (ValueError, FileNotFoundError) as e:  # bad config: the message says the fix
        sys.exit(f"config error: {e}")
    if not kept:
        from forge_ext.actors.trainer import world_size_of
        from forge_ext.engine import engine_config_from_mapping

        apply_env(config.env)
        wrote = ensure_init_checkpoint(config)  # the trainer: section reads its config.json
        try:
            engine = engine_config_from_mapping(config.trainer)
            processes = world_size_of(engine, None)
            if processes != 1:
                raise ValueError(
                    f"trainer.parallelism degrees multiply to {processes} processes, but the "
                    "SFT app trains in this one process; set them to 1 (or leave them out)"
                )
        except (ValueError, FileNotFoundError) as e:
            if wrote:  # a random model the engine refuses: not left for the next run to reuse
                shutil.rmtree(config.init.hf_path, ignore_errors=True)
            sys.exit(f"config error: {e}")
    run(config)


if __name__ == "__main__":
    main()
