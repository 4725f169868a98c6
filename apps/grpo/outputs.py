"""What the RL app (:class:`apps.grpo.main.RLApp`) writes and reads back: checkpoints of the
policy and the critic (and, with dynamic sampling, the prompt stream's position), the policy
as an HF checkpoint folder or a LoRA adapter, and the samples of each step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from apps.grpo.prepare import resume_step_of


class RunOutputs:
    """The checkpoint and export hooks of :class:`forge_ext.rl.loop.RLLoop`
    (``load_checkpoint``, ``save_checkpoint``, ``export_model``) for the RL app, which holds
    what they use: ``config``, ``loop``, ``metrics``, ``tok``, ``trainer``, ``critic``,
    ``stream`` (:class:`forge_ext.rl.sampling.DynamicSampling`), ``write`` and
    ``checkpoint_folder`` (:class:`apps.grpo.console.RunConsole`)."""

    async def load_checkpoint(self) -> int:
        if not self.config.trainer.get("checkpoint", {}).get("enable"):
            return 0
        # The step both the policy and the critic have (a crash between their saves leaves
        # the policy one ahead); the folder's step is the loop's, whatever the policy's own
        # count of updates (it does not move during critic.warmup_steps).
        step = resume_step_of(self.config)
        if step == 0:
            return 0
        await self.trainer.load_checkpoint(step)
        if self.critic is not None:
            await self.critic.load_checkpoint(step)
        return step

    async def save_checkpoint(self, step: int) -> None:
        if step == self.loop.steps and self.config.trainer.get("lora"):
            await self.export_lora()
        if not self.config.trainer.get("checkpoint", {}).get("enable"):
            return  # checkpoints off (loop.save_every must then be 0): nothing to keep
        if self.config.grpo.dynamic_sampling:
            self.stream.save_position(step)
        start = time.perf_counter()
        await self.trainer.save_checkpoint(step)
        if self.critic is not None:  # after the policy's: a resume takes the step both have
            await self.critic.save_checkpoint(step)
        self.write(f"checkpoint of step {step} saved in {time.perf_counter() - start:.1f}s: "
                   f"{self.checkpoint_folder() / f'step-{step}'}")

    async def export_model(self, step: int) -> None:
        """The policy of ``step`` as an HF checkpoint folder ``<output_dir>/hf/step-N``
        (``RLTrainer.export_hf``: gathered a tensor at a time, written atomically); not for
        LoRA runs, whose adapter :meth:`export_lora` writes at the last step."""
        c = self.config
        if self.config.trainer.get("lora") or not c.export.enable:
            return
        folder = Path(c.output_dir) / "hf" / f"step-{step}"
        info = await self.trainer.export_hf(folder, c.export.dtype,
                                            int(c.export.max_shard_mb * 10**6))
        self.write(f"HF checkpoint of step {step} written in {info['seconds']:.1f}s: {folder}")

    async def export_lora(self) -> None:
        """The final policy of a LoRA run: a PEFT adapter folder ``<output_dir>/adapter``
        (``peft.PeftModel.from_pretrained(base, folder)``, vLLM ``LoRARequest``) and, with
        ``trainer.lora.export_merged``, a merged HF checkpoint ``<output_dir>/merged``."""
        out = Path(self.config.output_dir)
        merged = out / "merged" if self.config.trainer["lora"].get("export_merged") else None
        start = time.perf_counter()
        await self.trainer.export_lora(out / "adapter", merged)
        self.write(f"LoRA adapter of step {self.loop.steps} written in "
                   f"{time.perf_counter() - start:.1f}s: {out / 'adapter'}"
                   + (f", merged HF checkpoint {merged}" if merged else ""))

    def _write_samples(self, step: int, rollouts: Any) -> None:
        """``metrics.samples_per_step`` of the step's episodes (the first of each group), as
        the rubric scored them, to ``samples.jsonl`` and TensorBoard's text
        (:meth:`forge_ext.runtime.metrics.MetricLogger.log_samples`)."""
        count = self.metrics.config.samples_per_step
        if not count:
            return
        group = self.config.grpo.group_size
        batch = rollouts.batch
        indices = list(range(0, len(batch.trajectories), group))[:count]
        self.metrics.log_samples(step, batch.samples(self.tok, indices))
