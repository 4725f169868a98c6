"""The ``transformers`` engine: :class:`HFSampler` samples a batch of prompts with
``model.generate``, and :class:`HFEngine` serves it one request at a time, batching the
requests that arrive together.

A batch of prompts of different lengths is left-padded with an attention mask;
``transformers`` derives position ids from the mask (``GenerationMixin
._prepare_position_ids_for_generation``), so each row is computed as if unpadded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.rollout.engines.base import (
    Completion,
    Engine,
    SamplingConfig,
    Scores,
    WeightUpdateMode,
    derive_seed,
    make_completion,
    request_seeds,
)
from forge_ext.tasks.tokenizer import as_stop_ids


#: ``transformers.GenerationConfig`` options that shape the sampled distribution, at the
#: value that turns each off. transformers 5 reads an option passed as None as *unset* and
#: fills it from the model's ``generation_config`` and then from its own defaults
#: (``GenerationMixin._prepare_generation_config``, ``GenerationConfig
#: ._get_default_generation_params``): ``top_k=None`` became ``top_k=50`` (issue 26). Those
#: that are off only as None (``top_h``, ``bad_words_ids``, ``sequence_bias``,
#: ``suppress_tokens``, ``begin_suppress_tokens``, ``forced_bos_token_id``,
#: ``forced_eos_token_id``, ``exponential_decay_length_penalty``, ``watermarking_config``)
#: have no default there and :class:`HFSampler` gives the model a ``generation_config``
#: without them. The list follows ``GenerationMixin._get_logits_processor`` (5.19).
HF_NEUTRAL_LOGITS_PROCESSING = {
    "num_beams": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    # min_new_tokens=0 alone: it takes precedence over min_length (which it then sets to
    # the prompt's length, no minimum), and both set logged a warning at every generate.
    "min_new_tokens": 0,
    "guidance_scale": 1.0,
    "remove_invalid_values": False,
    "renormalize_logits": False,
}
def hf_generation_config(
    sampling: SamplingConfig, *, stop_token_ids: Sequence[int], pad_token_id: int
):
    """The ``transformers.GenerationConfig`` of one :meth:`HFSampler.generate` call: the argmax
    of what the logits processors give (:class:`SeededSampling` when sampling), with every
    other option that could change a token set to off (:data:`HF_NEUTRAL_LOGITS_PROCESSING`)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        **HF_NEUTRAL_LOGITS_PROCESSING,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=list(stop_token_ids),
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )


class SeededSampling:
    """A logits processor that turns ``model.generate``'s argmax into a draw from the softmax
    at ``temperature`` within nucleus ``top_p`` (transformers' own
    ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``), each row with its own
    ``torch.Generator``: the Gumbel-max trick (argmax of ``log p + G``, ``G = -log(-log U)``,
    ``U`` uniform, is a draw from ``p``; Gumbel 1954, as used by e.g. vLLM's sampler). A row's
    draws then depend on its own seed alone, not on which rows share the batch: a request
    sampled in any batch draws what it draws alone (up to float differences in the logits).

    Args:
        seeds: one per row of the batch.
    """

    def __init__(self, sampling: SamplingConfig, seeds: Sequence[int], device: torch.device):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generators = [torch.Generator(device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        logp = torch.log_softmax(scores.float(), dim=-1)
        uniform = torch.stack([
            torch.rand(scores.shape[-1], generator=g, device=scores.device)
            for g in self.generators
        ]).clamp_(min=torch.finfo(torch.float32).tiny)
        return logp - torch.log(-torch.log(uniform))


class HFSampler:
    """``transformers`` ``AutoModelForCausalLM`` sampling with KV cache (``generate``).

    Args:
        hf_path: an HF checkpoint directory (``config.json`` + safetensors).
        stop_token_ids: every id that ends a response
            (:func:`forge_ext.tasks.tokenizer.stop_token_ids`); an int is one id.
            pad_token_id: the id used to pad.
        dtype: torch dtype name of the model (``float32`` on CPU).
        device: ``cpu`` or e.g. ``cuda``.
    """

    def __init__(
        self, hf_path: str, *, stop_token_ids: int | Sequence[int], pad_token_id: int,
        dtype: str = "float32", device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # No "Loading weights" bar in the middle of a run's console (restored after).
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                hf_path, dtype=getattr(torch, dtype)
            ).to(device)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.model.eval()
        # Forget the checkpoint's sampling defaults (generation_config.json, e.g. Qwen3's
        # top_k=20, temperature=0.6): transformers fills every generate() option left None
        # from them. The options that are off only as None stay off because this config
        # leaves them None too (see HF_NEUTRAL_LOGITS_PROCESSING).
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(
            eos_token_id=list(as_stop_ids(stop_token_ids)), pad_token_id=pad_token_id
        )
        self.device = torch.device(device)
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.pad_token_id = pad_token_id
        # Base weights of the layers a LoRA adapter changed (see load_adapter).
        self._lora_base: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int | Sequence[int] | None = None,
        policy_version: int = 0,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt.

        Args:
            prompts: token ids per prompt (special tokens already added).
            n: completions per prompt (GRPO's group size).
            sampling: temperature, top-p, max_new_tokens.
            greedy: argmax decoding instead of sampling (evaluation).
            seed: seeds sampling (:func:`request_seeds`); None: unseeded. Sample ``j`` of
                prompt ``i`` draws from its own generator seeded ``derive_seed(seed_i, j)``
                (:class:`SeededSampling`): the same prompt and seed draw the same tokens in
                any batch, and the process RNG is untouched.
            policy_version: stamped on every completion.

        Returns:
            ``len(prompts) * n`` completions, prompt-major (``n`` consecutive per prompt).
        """
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        seeds = request_seeds(seed, len(prompts))
        return self.sample_rows(
            [list(p) for p in prompts for _ in range(n)], sampling, greedy=greedy,
            seeds=[None if s is None else derive_seed(s, j) for s in seeds for j in range(n)],
            policy_version=policy_version,
        )

    @torch.no_grad()
    def sample_rows(self, rows: Sequence[list[int]], sampling: SamplingConfig, *,
                    greedy: bool, seeds: Sequence[int | None], policy_version: int
                    ) -> list[Completion]:
        """One completion per row, row ``r`` drawn with its own generator seeded ``seeds[r]``
        (None: a seed from the process RNG); see :meth:`generate`."""
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        config = hf_generation_config(
            sampling, stop_token_ids=self.stop_token_ids, pad_token_id=self.pad_token_id,
        )
        processors = []
        if not greedy:
            from transformers import LogitsProcessorList

            seeds = [int(torch.randint(2**62, ())) if s is None else s for s in seeds]
            processors = LogitsProcessorList([SeededSampling(sampling, seeds, self.device)])
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=config, logits_processor=processors or None,
        )
        sampled = out.sequences[:, width:]
        # out.logits are the raw (unprocessed) logits of each generated position.
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, sampled[..., None])[..., 0]
        return [
            make_completion(rows[i], sampled[i].tolist(), logprobs[i].tolist(),
                            self.stop_token_ids, policy_version)
            for i in range(len(rows))
        ]

    @torch.no_grad()
    def score_rows(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
                   ) -> list[list[float]]:
        """The model's log-probs of each ``(prompt_ids, response_ids)``'s response tokens,
        teacher-forced: one forward of ``prompt + response`` per sequence (unpadded), the
        raw logits' ``log_softmax`` in fp32 at the positions before each response token, as
        :meth:`sample_rows` computes a sample's (``[len(response_ids)]`` each)."""
        out = []
        for prompt, response in sequences:
            ids = torch.tensor([*prompt, *response], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[len(prompt):, None])
            out.append(picked[:, 0].tolist())
        return out

    def load_hf_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], shared_handle: Mapping | None = None
    ) -> None:
        """Copy HF-layout weights into the model (strict: every parameter, no extras;
        a tied model may omit ``lm_head.weight``). ``shared_handle`` (where the tensors live
        in shared memory, see ``forge_ext.weights.transports.base.OpenedWeights``) is not needed: the
        model is in this process and copies from the tensors themselves."""
        params = dict(self.model.state_dict())
        missing = sorted(set(params) - set(state_dict))
        if self.model.config.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        unexpected = sorted(set(state_dict) - set(params))
        if missing or unexpected:
            raise KeyError(
                f"weights do not match the generator's model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for name, value in state_dict.items():
                params[name].copy_(value)
        self._lora_base = None  # new base weights: an adapter merges into these from now on

    def load_adapter(self, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping[str, Any],
                     policy_version: int = 0) -> None:
        """Serve a LoRA adapter (a LoRA policy version) on the base weights: each adapted
        weight becomes ``W + (alpha / r) B @ A`` (:func:`forge_ext.engine.lora.merge_into`, fp32),
        with ``W`` from a copy of the base weights kept at the first adapter (only the adapted
        layers'), so versions never stack; layers an earlier adapter changed but this one
        does not get their base weights back. Merging (rather than wrapping the model with
        PEFT) keeps generation at the base model's speed and kernels.

        Args:
            tensors: PEFT-named ``lora_A [r, in]`` / ``lora_B [out, r]`` tensors.
            adapter_config: its ``adapter_config.json`` mapping (``r``, ``lora_alpha``).

        Raises:
            KeyError: an adapted module the model does not have.
        """
        from forge_ext.engine import lora

        params = dict(self.model.state_dict())
        names = [f"{module}.weight" for module in lora.adapter_modules(tensors)]
        unknown = sorted(n for n in names if n not in params)
        if unknown:
            raise KeyError(f"policy_version={policy_version}: the adapter's modules "
                           f"{unknown[:4]} are not layers of the generator's model")
        if self._lora_base is None:
            self._lora_base = {}
        with torch.no_grad():
            for name in names:  # still the base weights: no adapter touched them yet
                self._lora_base.setdefault(name, params[name].detach().clone())
            merged = lora.merge_into(self._lora_base, tensors, adapter_config)
            for name, value in merged.items():
                params[name].copy_(value)




@dataclass(slots=True)
class _Request:
    prompt_ids: list[int]
    n: int
    greedy: bool
    seed: int | None
    sampling: SamplingConfig
    done: asyncio.Future


class HFEngine(Engine):
    """:class:`HFSampler` behind the :class:`~forge_ext.rollout.engines.base.Engine`
    interface: requests that arrive while a batch runs wait for the next batch, which takes
    every one of them (grouped by greedy flag and sampling config); a batch runs on a worker
    thread, so the actor keeps taking requests meanwhile. A weight update waits for the running
    batch: every mode of :data:`~forge_ext.rollout.engines.base.WeightUpdateMode` is
    ``between_requests`` here (``model.generate`` cannot change weights mid-batch).

    Every sample draws from its own generator (:class:`SeededSampling`): a request draws
    the same tokens whichever requests share its batch.

    Args: as :class:`HFSampler`, and ``sampling``, the requests' default sampling config;
        ``sampler``: an :class:`HFSampler` already loaded (then ``hf_path`` and the model
        arguments are not used).
    """

    def __init__(self, hf_path: str, *, sampling: SamplingConfig,
                 stop_token_ids: int | Sequence[int], pad_token_id: int,
                 dtype: str = "float32", device: str = "cpu",
                 sampler: HFSampler | None = None) -> None:
        super().__init__(sampling, stop_token_ids)
        self.sampler = sampler or HFSampler(hf_path, stop_token_ids=stop_token_ids,
                                            pad_token_id=pad_token_id, dtype=dtype, device=device)
        self._waiting: list[_Request] = []
        self._batcher: asyncio.Task | None = None
        self._gate: asyncio.Lock | None = None  # held by a running batch and by a pause
        self._gate_loop: asyncio.AbstractEventLoop | None = None
        self._paused_at = 0.0
        self._buffer: dict[str, torch.Tensor] = {}  # allocate's, made at its first call

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate_loop is not loop:  # one per serving loop
            self._gate, self._gate_loop = asyncio.Lock(), loop
        return self._gate

    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, greedy: bool = False,
                     seed: int | None = None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        done = asyncio.get_running_loop().create_future()
        self._waiting.append(_Request(list(prompt_ids), n, greedy, seed,
                                      sampling or self.sampling, done))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        with self.busy:
            completions = await done
        self.stats.requests += 1
        self.stats.samples += n
        self.stats.tokens += sum(len(c.response_ids) for c in completions)
        return completions

    async def _run_batches(self) -> None:
        while self._waiting:
            async with self._lock():
                taken, self._waiting = self._waiting, []
                groups: dict[tuple, list[_Request]] = {}
                for request in taken:
                    groups.setdefault((request.greedy, request.sampling), []).append(request)
                for (greedy, sampling), requests in groups.items():
                    try:
                        await self._run_batch(requests, greedy, sampling)
                    except BaseException as error:  # each request's caller gets it
                        for r in requests:
                            if not r.done.done():
                                r.done.set_exception(error)
                        if not isinstance(error, Exception):
                            raise

    async def _run_batch(self, requests: list[_Request], greedy: bool,
                         sampling: SamplingConfig) -> None:
        rows = [r.prompt_ids for r in requests for _ in range(r.n)]
        seeds = [None if r.seed is None else derive_seed(r.seed, j)
                 for r in requests for j in range(r.n)]
        completions = await asyncio.to_thread(
            self.sampler.sample_rows, rows, sampling, greedy=greedy, seeds=seeds,
            policy_version=self.policy_version,
        )
        start = 0
        for r in requests:
            if not r.done.done():
                r.done.set_result(completions[start : start + r.n])
            start += r.n

    async def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Scores:
        """:meth:`HFSampler.score_rows`, between batches and never during a weight update
        (it holds their lock): every sequence is scored by the version served."""
        with self.busy:
            async with self._lock():
                version = self.policy_version
                logprobs = await asyncio.to_thread(self.sampler.score_rows, sequences)
        return Scores(logprobs=list(logprobs), policy_version=version)

    async def pause(self, mode: WeightUpdateMode) -> None:
        await self._lock().acquire()  # after the running batch
        self._paused_at = time.perf_counter()

    async def resume(self) -> None:
        self.stats.paused_seconds += time.perf_counter() - self._paused_at
        self._lock().release()

    def allocate(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                 ) -> dict[str, torch.Tensor]:
        """CPU tensors in the published dtype, kept between versions (made again when the
        names, shapes or dtypes change), for a generator that keeps a delta's base
        (``weights.delta``): a version is fetched (a delta applied and its checksums checked)
        into them while the model serves the version before, then copied (cast where the
        model's dtype differs) into the model by :meth:`load_hf_state_dict`. Why a buffer of
        its own and not the model's parameters, even where the dtypes match: a delta whose
        checksum fails would leave the served model on wrong weights, and a fetch into the
        parameters would change them under a running batch. Memory: one copy of the model
        in the published dtype."""
        wanted = {name: (tuple(shape), dtype) for name, (shape, dtype) in specs.items()}
        held = {name: (tuple(t.shape), t.dtype) for name, t in self._buffer.items()}
        if held != wanted:
            self._buffer = {name: torch.empty(shape, dtype=dtype)
                            for name, (shape, dtype) in wanted.items()}
        return self._buffer

    async def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor],
                                 policy_version: int, shared_handle: Any = None,
                                 changed: Any = None) -> None:
        # ``changed`` is not used: copying every tensor into the module costs one pass.
        self.sampler.load_hf_state_dict(state_dict)
        self.policy_version = policy_version

    async def load_adapter(self, tensors: Mapping[str, torch.Tensor],
                           adapter_config: Mapping[str, Any], policy_version: int) -> None:
        self.sampler.load_adapter(tensors, adapter_config, policy_version)
        self.policy_version = policy_version
