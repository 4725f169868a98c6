"""The GRPO app's typed config, validated in the controller before any process is spawned.

YAML top level (see ``configs/grpo_cpu_demo.yaml`` for a complete, commented example)::

    output_dir, seed
    model:     {hf_path}                      one checkpoint for trainer, reference, generator
    task:      {source, ...}                  forge_ext.tasks: addition (default), dataset,
                                              reasoning_gym, or "package.module:factory"
    reward:    forge_ext.tasks.RewardConfig   reward functions and reward models, weights,
                                              timeout, on_error
    grpo:      {prompts_per_step, group_size, advantage_scaling, dynamic_sampling,
                max_rollout_batches}
    algorithm: forge_ext.rl.algorithm.AlgorithmConfig  advantage: grpo | rloo | gae, gamma, lam, ...
    critic:    engine mapping or null         PPO's value model (forge_ext.actors.critic); with
                                              algorithm.advantage: gae
    prompt:    forge_ext.tasks.PromptConfig   template, chat_template: how a row becomes ids
    loss:      GRPOLoss.Config                preset, aggregation, ratio_level, clip_eps_low/high,
                                              kl_coef, mask_truncated, off_policy_correction
    loop:      forge_ext.rl.loop.LoopConfig      steps, mode, eval_every, save_every, max_policy_age
    trainer:   engine mapping                 (forge_ext.engine.config)
    reference: engine mapping or null         (null: none, loss.kl_coef: 0; with trainer.lora
                                              the trainer's base with its adapters disabled)
    generator: GeneratorConfig
    weights:   WeightsConfig                  transport of push_weights / fetch
    procs:     {env, trainer, reference, critic, generator}  processes and environment per role
    hosts:     forge_ext.runtime.hosts.HostsConfig      where roles run: launcher, hosts per role
    metrics:   MetricsConfig
    eval:      forge_ext.evaluation.EvalConfig  held-out accuracy, evaluation sets (pass@k ...)
    export:    {enable, dtype, max_shard_mb}  HF checkpoint folders <output_dir>/hf/step-N
    debug:     {fail_at_step}
"""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass, field
from typing import Any

# Light modules only (standard library, OmegaConf, dacite): a config error shows in well
# under 2 s, before torch, torchtitan, transformers and Monarch are imported (issue 38); the
# checks that need the model's code (torchtitan) import it in validate_engines.
from forge_ext.actors.critic_config import CriticConfig, critic_key_problems, critic_sections
from forge_ext.rl.algorithm import AlgorithmConfig
from forge_ext.config import from_mapping, load_yaml
from forge_ext.config_doc import SectionDoc, help_text, sections
from forge_ext.engine.checkpoint_files import not_hf_folder_message
from forge_ext.engine.schema import (
    check_engine_view, check_weights_transport, data_parallel_size, engine_key_problems,
    engine_view, fixed_rows_token_budget, world_size_of,
)
from forge_ext.evaluation import EvalConfig, check_sets
from forge_ext.rl.losses.config import GRPOLossConfig
from forge_ext.rl.losses.presets import PRESETS, apply_preset, preset_fields
from forge_ext.rl.loop import LoopConfig
from forge_ext.runtime.metrics import MetricsConfig
from forge_ext.runtime.hosts import HostsConfig
from forge_ext.rollout.config import GeneratorConfig, lora_engine_args
from forge_ext.tasks import (
    PromptConfig, RewardConfig, episode_config, task_config, task_key_problems,
    task_section_variants,
)
from forge_ext.weights.config import WeightsConfig

from apps.grpo.sections import (
    DebugSection, ExportSection, GRPOSection, ModelSection, ProcsSection,
)

@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    output_dir: str
    """Run folder: checkpoints (``trainer.dump_folder``), metrics, TensorBoard, plot."""
    model: ModelSection
    """The checkpoint the run starts from (its trainer, reference and generator)."""
    loop: LoopConfig
    trainer: dict[str, Any]
    """The policy's engine (:class:`forge_ext.engine.config.EngineConfig`): model, training,
    parallelism, optimizer, LR schedule, checkpoints."""
    generator: GeneratorConfig
    seed: int = 0
    """Seeds prompt order and sampling (per step, so a resumed run samples the same way)."""
    task: dict[str, Any] = field(default_factory=lambda: {"source": "addition"})
    """``task.source`` and that source's fields (:mod:`forge_ext.tasks`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """Prompts per step, samples per prompt, advantage scaling and dynamic sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The advantage estimator: ``grpo`` (default), ``rloo``, or ``gae`` (PPO, with the
    ``critic:`` role)."""
    critic: dict[str, Any] | None = None
    """PPO's value model (:class:`forge_ext.actors.critic_config.CriticConfig`: an engine
    section like ``trainer:`` plus ``hf_path``, ``clip_value``, ``warmup_steps``), on its own
    procs; needed by, and only by, ``algorithm.advantage: gae``. ``{}`` takes every default: the
    policy's checkpoint with a value head, the trainer's batch settings are not copied (give
    ``training``)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """The GRPO loss: its variant (``preset``, aggregation, ratio level), clipping, KL
    coefficient, truncation masking, off-policy correction."""
    reference: dict[str, Any] | None = None
    """The frozen reference model's engine (an engine section like ``trainer:``, usually
    ``model: ${trainer.model}``) for the KL term, on its own procs; null needs
    ``loss.kl_coef: 0``, or ``trainer.lora``: then the reference is the trainer's own frozen
    base, its adapters disabled (no second copy of the weights, ``docs/lora.md``). Unused,
    and not spawned, when ``loss.kl_coef`` is 0 (the DAPO, Dr. GRPO and GSPO presets) and
    ``algorithm.kl_in_reward`` is false."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    procs: ProcsSection = field(default_factory=ProcsSection)
    """Processes per role and their environment variables."""
    hosts: HostsConfig = field(default_factory=HostsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """How held-out accuracy is measured, and the evaluation sets evaluated with it."""
    export: ExportSection = field(default_factory=ExportSection)
    """The HF checkpoint folders the run writes (``<output_dir>/hf/step-N``)."""
    metrics: MetricsConfig | None = None
    """Where metrics go (default: ``metrics.jsonl``, TensorBoard and a plot in
    ``output_dir``)."""
    debug: DebugSection = field(default_factory=DebugSection)
    """Fault injection for tests."""

    def __post_init__(self) -> None:
        if (self.loss.kl_coef == 0 and not self.algorithm.kl_in_reward
                and self.reference is not None):
            # No KL term (in the loss or in PPO's reward): a reference would be a role spawned
            # (a model loaded, a forward per step) for nothing but the logged kl; none is
            # spawned (the run record says null).
            self.reference = None
        self._lora_generator()
        # Lengths that default to the response limit, filled here so that the run record
        # holds the values the run used.
        limit, what = self.response_limit()
        overlong = self.reward.overlong
        if overlong.max_tokens is None:
            overlong.max_tokens = limit
        if overlong.cache_tokens is None:
            overlong.cache_tokens = max(1, overlong.max_tokens // 5)
        if overlong.max_tokens > limit:
            raise ValueError(
                f"reward.overlong.max_tokens={overlong.max_tokens} > {what}={limit}: no "
                f"response gets that long; set it to at most {limit} (or leave it unset)"
            )
        if overlong.cache_tokens > overlong.max_tokens:
            raise ValueError(
                f"reward.overlong.cache_tokens={overlong.cache_tokens} is longer than "
                f"reward.overlong.max_tokens={overlong.max_tokens} ({what}={limit}); the "
                f"penalty interval must fit below the limit: set it to at most "
                f"{overlong.max_tokens}"
            )
        if self.loss.max_response_tokens is None:
            self.loss.max_response_tokens = limit

    def _lora_generator(self) -> None:
        """With ``trainer.lora`` and ``generator.backend: vllm``: start vLLM with LoRA, its
        ``max_lora_rank`` following ``trainer.lora.rank`` (set here, so that users do not
        state the rank twice and the run record holds what vLLM got).

        Raises:
            ValueError: ``generator.vllm.enable_lora`` false, or ``generator.vllm
                .max_lora_rank`` below ``trainer.lora.rank`` (or not a rank vLLM takes),
                naming the field (:func:`forge_ext.rollout.engines.vllm.lora_engine_args`).
        """
        section = (self.trainer or {}).get("lora")
        rank = section.get("rank") if isinstance(section, dict) else None
        if self.generator.backend != "vllm" or isinstance(rank, bool) or not isinstance(
                rank, int) or rank < 1:
            return  # no LoRA, or a bad rank that the trainer's own check names
        self.generator.vllm = lora_engine_args(self.generator.vllm, rank)

    def response_limit(self) -> tuple[int, str]:
        """``(tokens, field)``: the longest response an episode can have after its first
        prompt: ``generator.sampling.max_new_tokens``, or ``task.max_episode_tokens`` for a
        multi-turn task (``task.environment``)."""
        episodes = episode_config(self.task)
        if episodes.environment is not None:
            return episodes.max_episode_tokens, "task.max_episode_tokens"
        return self.generator.sampling.max_new_tokens, "generator.sampling.max_new_tokens"

    def variant_summary(self) -> str:
        """One line: the preset and the resolved value of every field a preset sets, each
        field the config overrode marked with the preset's value, e.g. ``GRPO variant: dapo
        | loss.aggregation=token_mean ... loss.kl_coef=0.01 (preset 0.0) ...``."""
        preset = self.loss.preset
        table = PRESETS.get(preset or "", {})
        parts = []
        for name in preset_fields(preset or "grpo"):
            section, *rest = name.split(".")
            value: Any = getattr(self, section)
            expected: Any = table.get(section, {})
            for key in rest:
                value = getattr(value, key)
                expected = expected.get(key) if isinstance(expected, dict) else None
            note = f" (preset {expected})" if preset and expected != value else ""
            parts.append(f"{name}={value}{note}")
        if self.loss.aggregation == "seq_mean_token_sum_norm":
            parts.append(f"loss.max_response_tokens={self.loss.max_response_tokens}")
        if self.grpo.dynamic_sampling:
            parts.append(f"grpo.max_rollout_batches={self.grpo.max_rollout_batches}")
        if self.reward.overlong.enable:
            o = self.reward.overlong
            parts.append(f"reward.overlong: max_tokens={o.max_tokens} "
                         f"cache_tokens={o.cache_tokens} penalty_factor={o.penalty_factor}")
        if self.loss.mask_truncated:
            parts.append("loss.mask_truncated=True")
        return f"GRPO variant: {preset or 'none (field defaults)'} | " + ", ".join(parts)

    @property
    def reference_is_trainer_base(self) -> bool:
        """Whether the KL reference is the LoRA trainer's own base (``reference: null`` with
        ``trainer.lora`` and ``loss.kl_coef != 0``)."""
        return (self.reference is None and bool(self.trainer.get("lora"))
                and self.loss.kl_coef != 0)

    def loss_spec(self) -> dict[str, Any]:
        """The trainer's ``loss`` argument (:func:`forge_ext.engine.losses.build_loss`)."""
        return {"name": "grpo", **asdict(self.loss)}

    def validate(self, *, check_model: bool = True, check_engines: bool = True) -> None:
        """Cross-section checks; with ``check_model`` also the sizes derived from the engine
        sections and, with ``check_engines``, the engine sections themselves
        (:meth:`validate_engines`: torchtitan's config and model checks, which read
        ``model.hf_path``'s config.json, so the checkpoint must exist). Everything before
        :meth:`validate_engines` runs without torch (``forge_ext.engine.schema``).

        Raises:
            ValueError: naming the fields that disagree and the fix.
        """
        task_config(self.task)  # source, fields, files, import paths; the rows load later
        check_sets(self.eval.sets)
        if self.loss.kl_coef != 0 and self.reference is None and not self.trainer.get("lora"):
            raise ValueError(
                f"loss.kl_coef={self.loss.kl_coef} needs a reference model; set the "
                "reference: section, trainer.lora (the reference is then the trainer's base) "
                "or loss.kl_coef=0"
            )
        self._validate_algorithm()
        self._validate_delta()
        if self.loop.save_every and not self.trainer.get("checkpoint", {}).get("enable"):
            raise ValueError(
                f"loop.save_every={self.loop.save_every} needs trainer.checkpoint.enable=true"
            )
        if self.debug.fail_at_step is not None and self.debug.fail_at_step < 1:
            raise ValueError(f"debug.fail_at_step={self.debug.fail_at_step} must be >= 1")
        self._validate_reward_models(check_model=False)
        if not check_model:
            return
        hf_path = self.model.hf_path
        if hf_path and not os.path.isfile(os.path.join(hf_path, "config.json")):
            raise FileNotFoundError(not_hf_folder_message(
                "model.hf_path", hf_path,
                "for the demo, write the warm-start first: python -m apps.sft.main --config "
                "configs/sft_cpu_demo.yaml (make demo does both); otherwise point "
                "model.hf_path at an HF checkpoint directory"))
        self._derive_sizes()
        self._derive_token_budgets()
        views = self._engine_views()
        for role, view in views.items():
            check_engine_view(view, role)
        check_weights_transport(views["trainer"], self.weights)
        layout = self.hosts.layout(self.processes(views))
        if check_engines:
            self.validate_engines(layout)

    def _validate_delta(self) -> None:
        """``weights.delta`` needs full versions to publish (every generator backend keeps
        the last one whole to apply a delta onto, ``Generator(keep_base=True)``)."""
        if self.weights.delta and self.trainer.get("lora"):
            raise ValueError(
                "weights.delta=true with trainer.lora: a LoRA version is the adapter alone, "
                "already small; set weights.delta=false"
            )

    def validate_engines(self, layout: dict[str, Any] | None = None) -> None:
        """The checks that need torch and the model's code (seconds to import): every engine
        section built as :func:`forge_ext.engine.engine_config_from_mapping` builds it (the
        model's RoPE length, heads, LoRA targets, pipeline stages), the reward models'
        checkpoints, and the generator replicas against this machine's devices.

        Raises:
            ValueError: naming the fields and the fix.
        """
        engines = self._engines()
        self._validate_reward_models(check_model=True)
        check_weights_transport(engines["trainer"], self.weights)
        layout = layout or self.hosts.layout(self.processes(engines))
        self._check_replica_devices(layout["generator"][1])

    def _derive_sizes(self) -> None:
        """Fill the sizes that follow from the rest of the config where they are unset (so a
        run is resized by ``grpo.prompts_per_step`` or ``grpo.group_size`` alone, as verl and
        TRL derive theirs from the rollout batch): ``training.local_batch_size`` of the trainer
        and the reference = ``grpo.batch_size`` / their data-parallel ranks, and the
        reference's ``training.seq_len`` = the trainer's (it scores the same sequences).

        Raises:
            ValueError: every hand-set value that disagrees (and a batch the data-parallel
                ranks cannot split), all in one message.
        """
        batch = self.grpo.batch_size
        sections = {"trainer": self.trainer}
        if self.reference is not None:
            sections["reference"] = self.reference
        given = {role: dict(section.get("training") or {}) for role, section in sections.items()}
        # Parsed once with the whole batch in place of an unset local_batch_size (any split
        # that divides batch / dp divides batch too, so this refuses nothing the real one
        # takes), and the reference with the trainer's seq_len unless it has its own.
        unset = {"local_batch_size": batch, **({"seq_len": given["trainer"]["seq_len"]}
                                                if "seq_len" in given["trainer"] else {})}
        engines = {role: engine_view({**section, "training": {**unset, **given[role]}}, role)
                   for role, section in sections.items()}
        processes = self.processes(engines)
        problems = []
        for role, section in sections.items():
            dp = data_parallel_size(engines[role], processes[role])
            local = given[role].get("local_batch_size")
            if local is not None and local * dp != batch:
                problems.append(
                    f"{role}.training.local_batch_size={local} x {dp} data-parallel ranks = "
                    f"{local * dp} sequences, but grpo.prompts_per_step x grpo.group_size = "
                    f"{batch} (unset it: it follows, {batch} / {dp})")
            elif local is None and batch % dp:
                problems.append(
                    f"grpo.prompts_per_step x grpo.group_size = {batch} sequences do not split "
                    f"over {role}'s {dp} data-parallel ranks; make it a multiple of {dp}")
            elif local is None:
                section.setdefault("training", {})["local_batch_size"] = batch // dp
        if "reference" in sections:
            trainer_len = engines["trainer"].training.seq_len
            reference_len = given["reference"].get("seq_len")
            if reference_len is not None and reference_len != trainer_len:
                problems.append(
                    f"reference.training.seq_len={reference_len} but trainer.training.seq_len="
                    f"{trainer_len}: the reference scores the trainer's sequences (unset it: "
                    "it follows the trainer's)")
            elif reference_len is None:
                self.reference.setdefault("training", {})["seq_len"] = trainer_len
        if problems:
            raise ValueError("sizes that disagree: " + "; ".join(problems))

    def row_sections(self) -> dict[str, dict[str, Any]]:
        """``{role: its engine section}`` of the roles that train or score a step's rows
        (trainer, reference, critic; a reward model always has a token budget). The
        critic's is its YAML section, whose ``training`` its engine takes as it is."""
        sections = {"trainer": self.trainer, "reference": self.reference,
                    "critic": self.critic}
        return {role: section for role, section in sections.items() if section is not None}

    def _derive_token_budgets(self) -> None:
        """Where a step's rows vary (an agent's episodes, ``task.agent``:
        :attr:`forge_ext.tasks.environments.EpisodeConfig.rows_vary`), give every role that
        trains or scores them a token budget in place of fixed-row microbatches (which
        need exactly ``grpo.batch_size`` rows): ``training.max_tokens_per_microbatch`` =
        ``training.seq_len`` x the rows a fixed microbatch holds
        (:func:`forge_ext.engine.schema.fixed_rows_token_budget`: no microbatch grows).

        Raises:
            ValueError: one message naming every role where no budget can be derived.
        """
        episodes = episode_config(self.task)
        if not episodes.rows_vary:
            return
        problems = []
        for role, section in self.row_sections().items():
            training = section.setdefault("training", {})
            if training.get("max_tokens_per_microbatch"):
                continue
            mapping = (section if role != "critic" else critic_sections(
                section, policy_hf_path=self.model.hf_path, trainer=self.trainer)[0])
            try:
                budget = fixed_rows_token_budget(engine_view(mapping, role))
            except ValueError as e:
                problems.append(f"{role}.{e}")
                continue
            for name in ("microbatch_size", "gradient_accumulation_steps"):
                training.pop(name, None)
            training["max_tokens_per_microbatch"] = budget
        if problems:
            raise ValueError(
                f"task.agent={episodes.agent!r} makes a training row of each model call that "
                "does not extend an earlier one (docs/agents.md), so a step's rows vary: "
                "fixed-row microbatches take exactly grpo.batch_size rows, a token budget "
                "(training.max_tokens_per_microbatch) any number, and none can be derived "
                "for " + "; ".join(problems))

    def _validate_reward_models(self, *, check_model: bool) -> None:
        """Each reward model of ``reward.functions`` (:mod:`forge_ext.actors.reward_model`):
        where it can run, and with ``check_model`` its checkpoint and engine.

        Raises:
            ValueError: naming ``reward.functions[i]`` and the fix.
        """
        for i, entry in enumerate(self.reward.functions):
            if entry.model is None:
                continue
            field = f"reward.functions[{i}]"
            if self.hosts.launcher not in ("local", "processes"):
                raise ValueError(
                    f"{field}.model: a reward model runs on this machine's procs only, and "
                    f"hosts.launcher={self.hosts.launcher!r} runs the roles on other hosts; "
                    "use hosts.launcher=local or processes, or a reward function")
            if check_model:
                from forge_ext.actors.reward_model import validate_reward_model

                validate_reward_model(entry, field)

    def _validate_algorithm(self) -> None:
        """The estimator against the sections it needs (before the engines are read).

        Raises:
            ValueError: naming the fields that disagree and the fix.
        """
        a = self.algorithm
        a.check_group_size(self.grpo.group_size)
        if a.needs_critic and self.critic is None:
            raise ValueError(
                "algorithm.advantage=gae needs the critic: section (the value model; "
                "critic: {} takes the policy's checkpoint and defaults, plus critic.training)")
        if self.critic is not None and not a.needs_critic:
            raise ValueError(
                f"critic: is set but algorithm.advantage={a.advantage} uses no critic; set "
                "algorithm.advantage=gae, or critic=null")
        if a.needs_critic and self.grpo.dynamic_sampling:
            raise ValueError(
                "grpo.dynamic_sampling drops groups whose rewards are all equal, which means "
                "nothing to algorithm.advantage=gae (its baseline is the critic's); set "
                "grpo.dynamic_sampling=false")
        if a.kl_in_reward and self.reference is None and not self.trainer.get("lora"):
            raise ValueError(
                "algorithm.kl_in_reward needs a reference model's log-probs; set the "
                "reference: section (or trainer.lora), or algorithm.kl_in_reward=false")
        if self.critic is not None:
            engine, options = critic_sections(self.critic, policy_hf_path=self.model.hf_path,
                                              trainer=self.trainer)
            if (self.loop.save_every or self.trainer.get("checkpoint", {}).get("enable")) \
                    and not engine["checkpoint"]["enable"]:
                raise ValueError(
                    "critic.checkpoint.enable=false while the trainer checkpoints: a resumed "
                    "run would restart the critic from scratch; set "
                    "critic.checkpoint.enable=true (the default)")
            if options.warmup_steps >= self.loop.steps > 0:
                raise ValueError(
                    f"critic.warmup_steps={options.warmup_steps} >= loop.steps="
                    f"{self.loop.steps}: the policy would never train")

    def _check_replica_devices(self, per_host: int) -> None:
        """Each host's generator replicas x ``tensor_parallel_size`` against what that host
        has: GPUs (``hosts.slurm.gpus_per_host``, or this machine's when it runs them), or,
        without CUDA, this machine's cores (vLLM's CPU build binds a core per rank).

        Raises:
            ValueError: more devices asked for than there are, naming the fields.
        """
        import torch

        tp = int(self.generator.vllm.get("tensor_parallel_size", 1))
        wanted = per_host * (tp if self.generator.backend == "vllm" else 1)
        where = (f"generator.replicas={self.generator.replicas} over hosts.generator.hosts="
                 f"{self.hosts.generator.hosts} ({per_host} per host)"
                 + (f" x generator.vllm.tensor_parallel_size={tp}"
                    if self.generator.backend == "vllm" else ""))
        if self.hosts.launcher == "slurm" and self.hosts.slurm.gpus_per_host:
            have, what = self.hosts.slurm.gpus_per_host, "hosts.slurm.gpus_per_host"
        elif self.hosts.launcher in ("local", "processes") and torch.cuda.is_available():
            have, what = torch.cuda.device_count(), "this machine's GPUs"
            if not have:  # CUDA without a device to count (a stub): nothing to check against
                return
        elif self.hosts.launcher in ("local", "processes") and self.generator.backend == "vllm":
            have, what = len(os.sched_getaffinity(0)), "this machine's CPU cores"
        else:
            return
        if wanted > have:
            raise ValueError(f"{where} needs {wanted} devices per host but {what} = {have}; "
                             "lower generator.replicas or the tensor parallelism")

    def _engine_views(self) -> dict[str, Any]:
        """``{role: engine_view}`` (:func:`forge_ext.engine.schema.engine_view`: keys, plain
        types and sizes, without torch) of the trainer, the reference and the critic."""
        views = {"trainer": engine_view(self.trainer, "trainer")}
        if self.reference is not None:
            views["reference"] = engine_view(self.reference, "reference")
        if self.critic is not None:
            engine, _ = critic_sections(self.critic, policy_hf_path=self.model.hf_path,
                                        trainer=self.trainer)
            views["critic"] = engine_view(engine, "critic")
        return views

    def _engines(self) -> dict[str, Any]:
        """``{role: EngineConfig}`` of the trainer, the reference and the critic (those not
        null). Imports torchtitan."""
        from forge_ext.actors.critic import critic_engine_config
        from forge_ext.engine import engine_config_from_mapping

        sections = {"trainer": self.trainer}
        if self.reference is not None:
            sections["reference"] = self.reference
        engines = {role: engine_config_from_mapping(mapping, section=role)
                   for role, mapping in sections.items()}
        if self.critic is not None:
            engines["critic"] = critic_engine_config(
                self.critic, policy_hf_path=self.model.hf_path, trainer=self.trainer)
        return engines

    def processes(self, engines: dict[str, Any] | None = None) -> dict[str, int]:
        """``{role: process count}`` of the roles this run spawns: the trainer's and
        reference's from their parallelism degrees and ``procs.<role>.num_procs`` or
        ``hosts.<role>`` (hosts x procs_per_host), the generator's ``generator.replicas``. Reads
        the engine sections lightly (:meth:`_engine_views`) unless ``engines`` gives them.

        Raises:
            ValueError: ``procs.<role>.num_procs`` and ``hosts.<role>`` disagree, or either
                disagrees with the parallelism degrees (naming the fields).
        """
        processes = {}
        for role, engine in (engines or self._engine_views()).items():
            num_procs = getattr(self.procs, role).num_procs
            spec = self.hosts.role(role)
            from_hosts = spec.hosts * spec.procs_per_host if spec.procs_per_host else None
            if num_procs is not None and from_hosts is not None and num_procs != from_hosts:
                raise ValueError(
                    f"procs.{role}.num_procs={num_procs} but hosts.{role}.hosts={spec.hosts} x "
                    f"hosts.{role}.procs_per_host={spec.procs_per_host} = {from_hosts}; set "
                    "one of them, or make them equal"
                )
            wanted = num_procs if num_procs is not None else from_hosts
            try:
                processes[role] = world_size_of(engine, wanted)
            except ValueError:
                source = (f"procs.{role}.num_procs={num_procs}" if num_procs is not None else
                          f"hosts.{role}.hosts={spec.hosts} x hosts.{role}.procs_per_host="
                          f"{spec.procs_per_host} = {from_hosts} processes")
                raise ValueError(
                    f"{source}, but {role}.parallelism needs {world_size_of(engine, None)} "
                    "(the product of its degrees: DP replicate x DP shard x CP x TP x PP); "
                    "make them equal"
                ) from None
        processes["generator"] = self.generator.replicas  # one process per replica
        return processes


#: The sections of a GRPO config that a component checks (engines, the task), for
#: :func:`forge_ext.config.from_mapping`: every unknown key of a config in one error.
SECTION_CHECKS = {"trainer": engine_key_problems, "reference": engine_key_problems,
                  "critic": critic_key_problems, "task": task_key_problems}


def load_config(path: str, overrides: list[str] = (), *, check_model: bool = True,
                check_engines: bool = True) -> GRPOConfig:
    """Read, override, resolve and validate a GRPO YAML config (see the module docstring);
    ``check_engines=False`` leaves out :meth:`GRPOConfig.validate_engines` (torchtitan), so
    that it runs without torch.

    Raises:
        ValueError: unknown keys (named), wrong types, or a failed :meth:`GRPOConfig.validate`.
    """
    mapping, _ = apply_preset(load_yaml(path, overrides))  # loss.preset: fills unset fields
    config = from_mapping(GRPOConfig, mapping, sections=SECTION_CHECKS)
    config.validate(check_model=check_model, check_engines=check_engines)
    return config



def check_config(path: str, overrides: list[str] = ()) -> GRPOConfig:
    """The checks that need no torch (:func:`load_config` without ``check_engines``):
    ``python -m apps.grpo.main`` runs them before its imports (:mod:`apps.fast_help`).

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    return load_config(path, overrides, check_engines=False)


def grpo_sections() -> list[SectionDoc]:
    """The GRPO app's config reference (``--help``, docs/config.md): :class:`GRPOConfig`'s
    sections, ``trainer:`` as the engine's fields, ``critic:`` as :class:`CriticConfig`'s
    and ``task:`` as each source's."""
    # torchtitan's config dataclasses (torch, seconds): only when the reference is rendered.
    from forge_ext.engine.config import EngineConfig

    # reference: takes the trainer's fields (its field docstring says so), not listed twice;
    # critic: lists its own fields (CriticConfig's), the engine's being the trainer's.
    return sections(GRPOConfig, {"trainer": EngineConfig, "critic": CriticConfig,
                                 "task": task_section_variants()})


def grpo_help() -> str:
    """What ``python -m apps.grpo.main --help`` prints after the usage."""
    return help_text(grpo_sections())
