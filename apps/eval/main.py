"""Evaluate a checkpoint without training it: ``python -m apps.eval --config <run or eval config> checkpoint=<path> [k=v ...]``.

``checkpoint`` is an HF checkpoint folder (``config.json`` + safetensors: a run's
``<output_dir>/hf/step-N``, a warm-start, a downloaded model), a DCP checkpoint step folder
(``<output_dir>/checkpoints/step-N``: converted to an HF folder first,
:func:`forge_ext.engine.export.dcp_to_hf`, the run's model read from its ``run_config.yaml``
or ``base``), a LoRA adapter folder (PEFT's ``adapter_config.json``: served on its base,
``base`` or the adapter's ``base_model_name_or_path``), a folder of ``step-N`` folders of
those (each step in order), or a list of any of them.

``--config`` is a GRPO run's config (``configs/grpo_cpu_demo.yaml``; the sections this app
reads are taken from it: ``output_dir``, ``seed``, ``task``, ``reward``, ``prompt``,
``generator``, ``eval``, ``procs.env``) or an evaluation config (:class:`EvalAppConfig`,
``configs/eval_cpu_demo.yaml``). The sets are ``eval.sets`` (:mod:`forge_ext.evaluation`),
or without any the held-out split of ``task:``. Each checkpoint is served by the run's
generator (``generator.backend``: transformers or vLLM, ``generator.replicas``), started on
it and stopped after; its samples go through the episode runner the GRPO app samples with.

Everything is checked before anything is spawned (the checkpoint's kind, every set, the
lengths); a bad input is one line. Results go to ``output_dir``: ``eval_results.json``,
``eval_results.md`` and, for several steps, ``eval_results.png``
(:mod:`forge_ext.evaluation.report`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import forge_ext  # noqa: F401  (selects the CPU device before torchtitan is imported)
from apps.eval.config import EvalAppConfig, eval_help, load_eval_config

@dataclass
class Checkpoint:
    """One checkpoint to evaluate."""

    path: str
    kind: Literal["hf", "dcp", "lora"]
    model: str
    """The HF folder the generator starts on (hf: ``path``; lora: the base; dcp: the folder
    it is converted into)."""
    step: int | None
    """N of a ``step-N`` folder."""
    run_model: dict[str, Any] | None = None
    """dcp: the run's ``trainer.model``."""


STEP = re.compile(r"step-(\d+)")


def kind_of(path: Path) -> str | None:
    """``hf``, ``dcp``, ``lora`` or None (module docstring)."""
    from forge_ext.engine.checkpoint_files import (
        ADAPTER_CONFIG_NAME, is_complete_checkpoint, is_hf_checkpoint,
    )

    if is_hf_checkpoint(path):
        return "hf"
    if (path / ADAPTER_CONFIG_NAME).is_file():
        return "lora"
    if path.is_dir() and is_complete_checkpoint(path):
        return "dcp"
    return None


def resolve_checkpoints(config: EvalAppConfig) -> list[Checkpoint]:
    """``config.checkpoint`` as checkpoints in order, each with the model its generator
    starts on, checked (nothing converted or spawned yet).

    Raises:
        ValueError / FileNotFoundError: a path that does not exist or is none of the kinds,
            a LoRA adapter or DCP step whose base model is unknown, naming ``checkpoint``.
    """
    from forge_ext.engine.checkpoint_files import (
        ADAPTER_CONFIG_NAME, is_hf_checkpoint, run_model_of,
    )

    paths = [config.checkpoint] if isinstance(config.checkpoint, str) else list(config.checkpoint)
    if not paths:
        raise ValueError("checkpoint=[] names nothing to evaluate")
    found: list[Checkpoint] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint={given} does not exist")
        kind = kind_of(path)
        targets = [(path, kind)]
        if kind is None and path.is_dir():  # a folder of step-N checkpoints
            steps = sorted((int(m.group(1)), p) for p in path.iterdir()
                           if (m := STEP.fullmatch(p.name)) and kind_of(p) is not None)
            targets = [(p, kind_of(p)) for _, p in steps]
        if not targets or targets[0][1] is None:
            raise ValueError(
                f"checkpoint={given} is none of: an HF checkpoint folder (config.json + "
                "*.safetensors), a DCP checkpoint step folder (with .metadata), a LoRA "
                f"adapter folder ({ADAPTER_CONFIG_NAME}), or a folder of step-N folders of "
                "these")
        for p, k in targets:
            match = STEP.fullmatch(p.name)
            step = int(match.group(1)) if match else None
            if k == "hf":
                found.append(Checkpoint(str(p), "hf", str(p), step))
            elif k == "lora":
                adapter = json.loads((p / ADAPTER_CONFIG_NAME).read_text())
                base = config.base or adapter.get("base_model_name_or_path")
                if not base or not is_hf_checkpoint(base):
                    raise ValueError(
                        f"checkpoint={p} is a LoRA adapter whose base ({base!r}) is not an HF "
                        "checkpoint folder here; set base=<the folder it was trained on>")
                found.append(Checkpoint(str(p), "lora", str(base), step))
            else:
                model = {"hf_path": config.base} if config.base else run_model_of(p)
                found.append(Checkpoint(str(p), "dcp", "", step, run_model=model))
    return found


def generator_config(config: EvalAppConfig, checkpoint: Checkpoint) -> Any:
    """The ``generator:`` section on ``checkpoint``'s model (vLLM with LoRA for an adapter).

    Raises:
        ValueError: a bad field (:meth:`GeneratorConfig.check_backend`), naming it.
    """
    from forge_ext.config import from_mapping
    from forge_ext.rollout.config import GeneratorConfig, lora_engine_args

    section = {k: v for k, v in config.generator.items() if k != "hf_path"}
    generator = from_mapping(GeneratorConfig, {**section, "hf_path": checkpoint.model or "."},
                             path="generator")
    if checkpoint.kind == "lora" and generator.backend == "vllm":
        from forge_ext.engine.lora import read_peft_folder

        rank = int(read_peft_folder(checkpoint.path)[1]["r"])
        generator.vllm = lora_engine_args(generator.vllm, rank)
    return generator


class EvalApp:
    """The evaluation of one config (module docstring): everything checked in the
    constructor, nothing spawned before :meth:`run`."""

    def __init__(self, config: EvalAppConfig) -> None:
        from forge_ext.evaluation import build_sets, default_set
        from forge_ext.evaluation.sets import check_context, check_reward_models
        from forge_ext.tasks.tokenizer import CheckpointTokenizer

        self.config = config
        self.checkpoints = resolve_checkpoints(config)
        first = self.checkpoints[0]
        generator = generator_config(config, first)
        generator.check_backend()
        # The tokenizer of the model the generator starts on (a DCP step's: its run's).
        tok_path = first.model or first.run_model.get("hf_path")
        if not tok_path:
            raise ValueError(f"checkpoint={first.path}: its run has no model.hf_path to read "
                             "a tokenizer from; set base=<HF folder>")
        configs = config.eval.sets or [default_set(config.task, config.eval.greedy)]

        def load_tokenizer() -> CheckpointTokenizer:  # after the sets' data are checked
            self.tok = CheckpointTokenizer(tok_path)
            return self.tok

        self.sets = build_sets(configs, load_tokenizer, prompt=config.prompt,
                               reward=config.reward,
                               max_new_tokens=generator.sampling.max_new_tokens,
                               run_task=config.task)
        try:
            check_context(self.sets, generator)
            check_reward_models(self.sets, {})  # this app spawns no reward model
        except ValueError:
            self.close()
            raise
        self.generator = generator

    def close(self) -> None:
        from forge_ext.evaluation import close_sets

        close_sets(self.sets)

    def plan(self) -> list[str]:
        c = self.config
        checkpoints = "; ".join(f"{x.kind} {x.path}" for x in self.checkpoints)
        sets = "; ".join(
            f"{s.name} ({len(s.rows)} prompts, n={s.config.n}, temperature "
            f"{s.sampling.temperature}, max_new_tokens {s.sampling.max_new_tokens}: "
            f"{', '.join(s.metrics)})" for s in self.sets)
        return [f"eval: {len(self.checkpoints)} checkpoint(s): {checkpoints}",
                f"sets: {sets}",
                f"generator {self.generator.backend} ({self.generator.replicas} replica(s)), "
                f"seed {c.seed}; output_dir {c.output_dir}"]

    async def run(self) -> dict[str, Any]:
        """Evaluate every checkpoint; write and return the results."""
        from forge_ext.evaluation import overall
        from forge_ext.evaluation.report import write_results

        c = self.config
        entries, samples = [], []
        try:
            for checkpoint in self.checkpoints:
                start = time.perf_counter()
                results = await self._evaluate(checkpoint)
                entry = {
                    "label": checkpoint.path, "checkpoint": os.path.abspath(checkpoint.path),
                    "kind": checkpoint.kind, "model": checkpoint.model, "step": checkpoint.step,
                    "sets": {r.name: {"metrics": r.metrics, "settings": r.settings,
                                      "seconds": r.seconds} for r in results},
                    "overall": overall(results),
                }
                entries.append(entry)
                samples += [{"checkpoint": checkpoint.path, "set": r.name, **s}
                            for r in results for s in r.samples]
                print(f"{checkpoint.path} ({time.perf_counter() - start:.0f}s): " + " | ".join(
                    f"{r.name}: " + " ".join(f"{m} {r.metrics[m]:.1%}" for m in s.metrics)
                    for r, s in zip(results, self.sets)), flush=True)
        finally:
            self.close()
        results = {
            "seed": c.seed, "generator": {k: v for k, v in asdict(self.generator).items()
                                          if k != "hf_path"},
            "checkpoints": entries,
        }
        self.paths = write_results(c.output_dir, results, samples if c.save_samples else ())
        return results

    async def _evaluate(self, checkpoint: Checkpoint) -> list:
        """Serve ``checkpoint`` (a DCP step converted first, into a hidden folder of
        ``output_dir`` removed after) on fresh replicas and evaluate every set there."""
        from forge_ext.evaluation import evaluate_sets
        from forge_ext.rollout.replicas import spawn_replicas

        c = self.config
        converted = None
        if checkpoint.kind == "dcp":
            from forge_ext.engine.export import dcp_to_hf

            converted = Path(c.output_dir) / f".converted-{Path(checkpoint.path).name}"
            checkpoint.model = str(dcp_to_hf(checkpoint.path, converted,
                                             model=checkpoint.run_model))
        try:
            generator = generator_config(c, checkpoint)
            replicas = await spawn_replicas(generator, stop_token_ids=self.tok.stop_ids,
                                            pad_token_id=self.tok.pad_id, key_prefix="eval")
            try:
                if checkpoint.kind == "lora":
                    await replicas.load_adapter_folder(checkpoint.path, 1)
                return await evaluate_sets(self.sets, replicas.sample, seed=c.seed,
                                           batch_size=c.eval.batch_size,
                                           keep_samples=c.save_samples)
            finally:
                await replicas.stop()
        finally:
            if converted is not None:
                shutil.rmtree(converted, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    from forge_ext.config import apply_env, parse_cli
    from forge_ext.runtime import run_logs
    from forge_ext.runtime.disk import find_output_write_error
    from forge_ext.runtime.interrupts import exit_status, run_until_stopped

    path, overrides = parse_cli(argv, __doc__.splitlines()[0], reference=eval_help,
                                prog="python -m apps.eval")
    try:
        config = load_eval_config(path, overrides)
        app = EvalApp(config)
    except (ValueError, FileNotFoundError) as e:  # bad input: the message says the fix
        sys.exit(f"config error: {e}")
    apply_env(config.env)
    with run_logs.keep_console(config.output_dir):  # the screen, in <output_dir>/logs
        for line in app.plan():
            print(line, flush=True)
        try:
            results = asyncio.run(run_until_stopped(app.run()))
        except (KeyboardInterrupt, asyncio.CancelledError) as stop:  # Ctrl-C, SIGTERM
            print("interrupted: the generator was stopped", file=sys.stderr)
            sys.exit(exit_status(stop))  # 130 after Ctrl-C, 143 after SIGTERM
        except Exception as error:  # noqa: BLE001 - re-raised unless an output failed
            write_error = find_output_write_error(error)
            if write_error is None:
                raise
            sys.exit(f"error: {write_error}")
        from forge_ext.evaluation.report import markdown_table

        print(markdown_table(results), end="")
        print(f"written to {config.output_dir}: " + ", ".join(p.name for p in app.paths))
    return results


if __name__ == "__main__":
    from forge_ext.runtime.supervision import shutdown_monarch

    try:
        main()
    finally:
        shutdown_monarch()
