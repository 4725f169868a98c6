"""Supervised warm-start: ``python -m apps.sft.main --config configs/sft_cpu_demo.yaml [k=v ...]``.

Trains a causal LM on ``prompt -> answer <eos>`` of the ``task:`` section's rows (any source of
:mod:`forge_ext.tasks`, the same section the GRPO app reads; loss on the answer tokens only) with the engine in this process, then writes an HF checkpoint directory
(``config.json`` + ``model.safetensors`` + tokenizer) to ``output_dir``, evaluates it on the
held-out prompts with greedy decoding, and exits, recording its config in
``<output_dir>/run_config.yaml``. With ``skip_if_exists: true`` (default) an existing
checkpoint in ``output_dir`` is kept and nothing runs, if it was written with the same config
(except :data:`MAY_CHANGE_ON_SKIP`); otherwise the run is refused, naming what differs.

Starting point: ``init.hf_path``. If that directory holds no checkpoint, a randomly
initialised ``transformers`` model with ``init.architecture`` (HF ``config.json`` fields) and
a character tokenizer over the task's alphabet (:meth:`forge_ext.tasks.Task.characters`) is
written there first, so the engine loads it through the same ``flavor: hf`` path as a
downloaded checkpoint.

Accuracy (validation and held-out) is the rubric's (``reward:``): the rate at which its
accuracy function scores 1 on greedy completions.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # --help and config errors before the imports below (seconds)
    from apps.fast_help import exit_on_config_error, print_saved_help

    print_saved_help("sft")
    # The config, the task's rows and the reward functions, before torch is imported.
    _checked = exit_on_config_error("apps.sft.config:check_run", prog="python -m apps.sft.main")

import forge_ext  # noqa: F401  (selects the CPU device before torchtitan is imported)
from apps.sft.config import (
    MAY_CHANGE_ON_SKIP, SFTConfig, check_config, check_data, functions_only, sft_help,
)
from forge_ext.config import RUN_CONFIG_FILE, apply_env, parse_cli, record_run_config
from forge_ext.engine.checkpoint_files import ADAPTER_CONFIG_NAME, is_hf_checkpoint
from forge_ext.engine.hf_checkpoint import init_hf_checkpoint, save_hf_checkpoint
from forge_ext.rl.episode import Episode, pack_episodes
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.hf import HFSampler
from forge_ext.runtime.interrupts import exit_status, stop_signals_raise
from forge_ext.runtime.metrics import MetricLogger
from forge_ext.tasks import PromptRenderer, Row, Rubric, Sample, Task, build_task, resolved_task
from forge_ext.tasks.base import prompt_characters
from forge_ext.tasks.prompts import render_splits
from forge_ext.tasks.rubric import RewardFailure, failures_of
from forge_ext.tasks.tokenizer import CheckpointTokenizer, save_tokenizer

def kept_checkpoint(config: SFTConfig) -> bool:
    """True if ``skip_if_exists`` keeps a checkpoint already in ``output_dir``.

    Raises:
        ValueError: that checkpoint was written with another config (names what differs).
    """
    out = Path(config.output_dir)
    written = is_hf_checkpoint(out) or (out / "adapter" / ADAPTER_CONFIG_NAME).is_file()
    if not (config.skip_if_exists and written):
        return False
    if (out / RUN_CONFIG_FILE).exists():  # a checkpoint without one predates the records
        record_run_config(
            out, run_record(config), may_change=MAY_CHANGE_ON_SKIP,
            rerun="keeps the checkpoint there",
        )
    return True


def run_record(config: SFTConfig) -> dict[str, Any]:
    """What ``run_config.yaml`` records: the config, its task with every default filled."""
    return {**asdict(config), "task": resolved_task(config.task)}


def ensure_init_checkpoint(config: SFTConfig, task: Task) -> bool:
    """Write a random model (and a character tokenizer over the task's alphabet and the
    characters its prompt template adds) to ``init.hf_path`` unless a checkpoint is there
    already; returns whether it wrote one."""
    path = Path(config.init.hf_path)
    if is_hf_checkpoint(path):
        return False
    # The task's alphabet, then what the prompt template adds to it, in a fixed order.
    characters = task.characters()
    extra = prompt_characters([*task.train_rows(), *task.eval_rows()], config.prompt.template)
    characters += "".join(sorted(extra - set(characters)))
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        save_tokenizer(tokenizer_dir, characters)
        tok = CheckpointTokenizer(tokenizer_dir)
        fields = {
            "vocab_size": len(tok.tokenizer),
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
    rows: list[Row], render: PromptRenderer, tok: CheckpointTokenizer
) -> dict[str, Any]:
    """``input_ids``/``labels`` ``[B, S]`` for ``prompt answer <eos>`` rows, labels only on the
    answer and ``<eos>`` (the same alignment GRPO trains on, see :mod:`forge_ext.rl.episode`)."""
    episodes = []
    for row in rows:
        answer = tok.encode_answer(row.answer)
        episodes.append(Episode(
            prompt_ids=render(row), response_ids=answer,
            generator_logprobs=[0.0] * len(answer), advantage=0.0, policy_version=0,
        ))
    packed = pack_episodes(episodes, pad_id=tok.pad_id)
    return {"input_ids": packed["input_ids"], "labels": packed["labels"]}


def greedy_accuracy(
    sampler: HFSampler, rubric: Rubric, rows: list[Row], render: PromptRenderer,
    tok: CheckpointTokenizer, max_new_tokens: int,
) -> float:
    """Greedy accuracy on ``rows`` (the rubric's, module docstring), in [0, 1].

    Raises:
        RewardFailure: a reward function failed on ``reward.max_error_rate`` of the rows.
    """
    completions = sampler.generate(
        [render(row) for row in rows], 1, SamplingConfig(max_new_tokens=max_new_tokens),
        greedy=True,
    )
    samples = []
    for row, c in zip(rows, completions, strict=True):
        text, finished = tok.completion_text(c.response_ids)
        samples.append(Sample(row=row, completion=text, finished=finished,
                              completion_ids=c.response_ids))
    scores = rubric.score_sync(samples)
    with failures_of(f"the accuracy on {len(rows)} rows"):
        rubric.check(scores)  # a function failing on every call: not an accuracy of 0
    return sum(scores.correct) / len(scores.correct)


@dataclass
class SFTRun:
    """What a warm-start holds while it trains, saves and evaluates (:func:`run`)."""

    config: SFTConfig
    engine: Any
    """The engine (:func:`forge_ext.engine.build_engine`) in this process."""
    rubric: Rubric
    train_rows: list[Row]
    eval_rows: list[Row]
    tok: CheckpointTokenizer
    render: PromptRenderer
    sampler: HFSampler
    """Greedy decoding of the weights under training (validation) or of the saved ones."""
    max_new_tokens: int
    logger: MetricLogger | None


def start(config: SFTConfig, task: Task) -> SFTRun:
    """Read the task's rows, write the random init if needed, say what the run will do and
    build the engine, the sampler and the metric logger.

    Raises:
        ValueError: the task has no held-out rows, or a config the engine refuses.
    """
    from forge_ext.engine import build_engine, engine_config_from_mapping
    from forge_ext.engine.distributed import init_single_process_env

    rubric = functions_only(Rubric(config.reward, task))
    train_rows, eval_rows = list(task.train_rows()), list(task.eval_rows())
    if not eval_rows:
        raise ValueError(f"the task ({task.name}) has no held-out rows; set task.num_eval")
    ensure_init_checkpoint(config, task)
    engine_config = engine_config_from_mapping(config.trainer)
    # What the run will do, before it starts; its last line says where it wrote.
    model = engine_config.model
    print(
        f"SFT warm-start: {engine_config.training.steps} steps of "
        f"{engine_config.training.local_batch_size} rows from {config.init.hf_path} "
        f"({model.name}); task "
        f"{task.name}: {len(train_rows)} training rows, {len(eval_rows)} held-out; "
        f"output_dir {config.output_dir}", flush=True,
    )
    tok = CheckpointTokenizer(config.init.hf_path)
    render = PromptRenderer(tok, config.prompt)
    max_new_tokens = config.eval.max_new_tokens or max(
        len(tok.encode_answer(row.answer)) for row in train_rows + eval_rows
    )
    init_single_process_env()
    engine = build_engine(engine_config)
    sampler = HFSampler(
        config.init.hf_path, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id
    )
    logger = MetricLogger(config.metrics) if config.metrics else None
    if logger:
        logger.open()
    return SFTRun(config=config, engine=engine, rubric=rubric,
                  train_rows=train_rows, eval_rows=eval_rows, tok=tok, render=render,
                  sampler=sampler, max_new_tokens=max_new_tokens, logger=logger)


def validate(sft: SFTRun, step: int) -> float:
    """Greedy accuracy of the weights under training on the validation rows (the first
    ``eval.num_validation`` training rows), logged as ``validation/accuracy``."""
    sft.sampler.load_hf_state_dict(_full(sft.engine.merged_hf_state_dict()))
    validation = sft.train_rows[: sft.config.eval.num_validation]
    accuracy = greedy_accuracy(sft.sampler, sft.rubric, validation, sft.render, sft.tok,
                               sft.max_new_tokens)
    if sft.logger:
        sft.logger.log(step, {"validation/accuracy": accuracy})
    return accuracy


def train(sft: SFTRun) -> int:
    """Train until ``trainer.training.steps`` or ``eval.stop_at_accuracy``; returns the last
    step."""
    from tqdm import tqdm

    from forge_ext.engine import cross_entropy_loss, valid_tokens

    config, engine_config = sft.config, sft.engine.config
    rng = random.Random(config.seed)
    steps, batch_size = engine_config.training.steps, engine_config.training.local_batch_size
    step = 0
    # No bar when stdout is not a terminal (disable=None): a redirected log would hold its
    # every carriage-return update.
    bar = tqdm(range(1, steps + 1), desc="warm-start (SFT)", unit="step", file=sys.stdout,
               disable=None)
    for step in bar:
        batch = sft_batch([rng.choice(sft.train_rows) for _ in range(batch_size)],
                          sft.render, sft.tok)
        metrics = sft.engine.train_batch(batch, cross_entropy_loss, valid_tokens)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        if sft.logger:
            sft.logger.log(step, {"sft/loss": metrics["loss"], "sft/lr": metrics["lr"]})
        if config.eval.every and step % config.eval.every == 0 and step < steps:
            accuracy = validate(sft, step)
            bar.write(f"step {step}: validation accuracy {accuracy:.1%}")
            target = config.eval.stop_at_accuracy
            if target is not None and accuracy >= target:
                bar.write(f"step {step}: reached eval.stop_at_accuracy={target}, stopping")
                break
    bar.close()
    return step


def save(sft: SFTRun) -> HFSampler:
    """Write the checkpoint (and with ``trainer.lora`` the PEFT adapter) and the run record
    to ``output_dir``; returns a sampler of the checkpoint as written, loaded through the
    path the GRPO app loads it by (a LoRA adapter alone: the base with the exported adapter
    merged)."""
    config, engine, tok = sft.config, sft.engine, sft.tok
    out = Path(config.output_dir)
    hf_config = json.loads((Path(config.init.hf_path) / "config.json").read_text())
    lora = sft.engine.config.lora
    if lora is None:
        save_hf_checkpoint(out, engine.hf_state_dict(), hf_config,
                           tokenizer_from=config.init.hf_path)
    elif lora.export_merged:  # first: the checkpoint folder replaces output_dir whole
        save_hf_checkpoint(out, engine.merged_hf_state_dict(), hf_config,
                           tokenizer_from=config.init.hf_path)
    if lora is not None:  # the adapter in PEFT's format, base: init.hf_path
        engine.export_lora(out / "adapter")
    record_run_config(out, run_record(config), check=False)  # what wrote this checkpoint
    if lora is None or lora.export_merged:
        return HFSampler(str(out), stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    from forge_ext.engine.lora import merge_into, read_peft_folder

    tensors, adapter_config = read_peft_folder(out / "adapter")
    sft.sampler.load_hf_state_dict(merge_into(_full(engine.hf_state_dict()), tensors,
                                              adapter_config))
    return sft.sampler


def run(config: SFTConfig, task: Task | None = None) -> float | None:
    """Train (until ``trainer.training.steps`` or ``eval.stop_at_accuracy``), save and
    evaluate on the held-out problems (see the module docstring).

    Returns:
        The saved checkpoint's held-out accuracy, or None when skipped.
    """
    out = Path(config.output_dir)
    if kept_checkpoint(config):
        print(f"warm-start: checkpoint {out} exists, skipping (skip_if_exists=false retrains)")
        return None
    apply_env(config.env)
    sft = start(config, task or build_task(config.task))
    began = time.perf_counter()
    step = train(sft)
    saved = save(sft)
    accuracy = greedy_accuracy(saved, sft.rubric, sft.eval_rows, sft.render, sft.tok,
                               sft.max_new_tokens)
    if sft.logger:
        sft.logger.log(step, {"eval/accuracy": accuracy})
        sft.logger.close(plot_keys=["validation/accuracy", "eval/accuracy"], title="warm-start")
    sft.engine.close()
    sft.rubric.close()  # its reward worker processes
    print(
        f"warm-start: {step} steps in {time.perf_counter() - began:.0f}s; held-out accuracy "
        f"{accuracy:.1%} on {len(sft.eval_rows)} prompts (greedy); written to {out}: "
        f"checkpoint, run config {out / RUN_CONFIG_FILE}"
        + (f", metrics {sft.logger.jsonl_path}" if sft.logger else "")
    )
    return accuracy


def _full(state_dict: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}


def main(argv: list[str] | None = None, task: Task | None = None) -> None:
    """The command line: ``--config PATH [key=value ...]`` (``argv``, default ``sys.argv``);
    ``task``: the task :func:`apps.sft.config.check_run` built from it, if already done."""
    path, overrides = parse_cli(argv, __doc__.splitlines()[0], reference=sft_help,
                                prog="python -m apps.sft.main")
    try:
        config = check_config(path, overrides)  # without torch (also before the imports)
        kept = kept_checkpoint(config)  # a kept checkpoint must come from the same config
    except (ValueError, FileNotFoundError) as e:  # bad config: the message says the fix
        sys.exit(f"config error: {e}")
    if kept:
        task = None
    else:
        from forge_ext.engine.schema import world_size_of
        from forge_ext.engine import engine_config_from_mapping

        apply_env(config.env)
        try:
            task = check_data(config) if task is None else task
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"config error: {e}")
        wrote = False
        try:
            wrote = ensure_init_checkpoint(config, task)  # the trainer: reads its config.json
            engine = engine_config_from_mapping(config.trainer)
            processes = world_size_of(engine, None)
            if processes != 1:
                raise ValueError(
                    f"trainer.parallelism degrees multiply to {processes} processes, but the "
                    "SFT app trains in this one process; set them to 1 (or leave them out)"
                )
            # Every prompt must render and every training row fit, as the GRPO app checks
            # before spawning (a held-out row that did not render was a traceback after
            # training; a row too long, the engine's 20-line traceback mid-run).
            tok = CheckpointTokenizer(config.init.hf_path)
            render = PromptRenderer(tok, config.prompt)
            train_rows = list(task.train_rows())
            prompts, warning = render_splits(
                render, {"training": train_rows, "held-out": list(task.eval_rows())},
                tokenizer_field="init.hf_path")
            if warning:
                print(warning, file=sys.stderr)
            longest = max(len(ids) + len(tok.encode_answer(row.answer))
                          for ids, row in zip(prompts["training"], train_rows))
            if longest > engine.training.seq_len:
                raise ValueError(
                    f"trainer.training.seq_len={engine.training.seq_len} < {longest} tokens "
                    "(longest training prompt + answer + end token); raise "
                    "trainer.training.seq_len"
                )
        except (ValueError, FileNotFoundError) as e:
            if wrote:  # a random model the engine refuses: not left for the next run to reuse
                shutil.rmtree(config.init.hf_path, ignore_errors=True)
            sys.exit(f"config error: {e}")
    try:
        with stop_signals_raise():
            run(config, task)
    except RewardFailure as failure:  # every call of a batch failed: count and traceback
        sys.exit(f"error: {failure}")
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM
        print("interrupted: the run was stopped", file=sys.stderr)
        sys.exit(exit_status(stop))  # 130 after Ctrl-C, 143 after SIGTERM


if __name__ == "__main__":
    main(task=_checked[1] if _checked else None)
