"""The ``transformers`` sampling backend of the ``Generator`` actor, and what every backend
shares: :class:`SamplingConfig`, :class:`Completion` and how a response ends.

Every backend returns, for each sampled token, its log-probability under the *policy*, i.e.
``log_softmax`` of the model's raw logits, before temperature and top-p. That is the
``pi_old`` of GRPO's importance ratio ``pi_theta / pi_old`` (the trainer computes
``pi_theta`` from raw logits too), so with ``temperature=1, top_p=1`` sampling and scoring use
one distribution and the ratio starts at exactly 1 up to numerics. With another temperature
or top-p the samples come from a sharpened distribution while the ratio still compares
policies; keep ``temperature: 1.0`` for on-policy GRPO.

A batch of prompts of different lengths is left-padded with an attention mask;
``transformers`` derives position ids from the mask (``GenerationMixin
._prepare_position_ids_for_generation``), so each row is computed as if unpadded.

A response ends at the first of the checkpoint's *stop ids*: every id its
``generation_config.json`` lists as ``eos_token_id`` (Qwen3 declares two) plus the
tokenizer's ``eos_token`` (see :func:`stop_token_ids`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """How completions are sampled (YAML ``generator.sampling``)."""

    temperature: float = 1.0
    """Softmax temperature of sampling; 1.0 keeps GRPO on-policy (module docstring)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 disables it."""
    max_new_tokens: int = 16
    """Longest response in tokens; a response that hits it unfinished ends with no stop id."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"generator.sampling.temperature={self.temperature} must be > 0 "
                "(greedy decoding is a separate flag of generate())"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generator.sampling.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"generator.sampling.max_new_tokens={self.max_new_tokens} must be >= 1"
            )


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sampled response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Sampled ids up to and including the first stop id (none after it)."""
    logprobs: list[float]
    """``[len(response_ids)]`` log-probs (nats) under the policy's raw logits."""
    finished: bool
    """True if the response ends with a stop id (False: cut at ``max_new_tokens``)."""
    policy_version: int
    """Version of the weights that sampled it."""


def derive_seed(*parts: int) -> int:
    """A seed in ``[0, 2**62)`` that depends on every part (a step's seed, an episode's
    index, a turn), the same in every process and run (BLAKE2b of the parts, not Python's
    salted ``hash``). Distinct parts give unrelated seeds, so separate requests never share a
    random stream (vLLM seeds each request's generator with its own ``seed``: equal seeds on
    equal prompts draw equal tokens, issue 32). Below ``2**62`` so that vLLM's ``seed + j``
    for the ``j``-th sample of an ``n > 1`` request stays an int64."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 2


def request_seeds(seed: int | Sequence[int] | None, count: int) -> list[int | None]:
    """One seed per prompt of a ``generate`` call, from its ``seed`` argument: None
    (unseeded), one int (the call's seed: prompt ``i`` gets ``derive_seed(seed, i)``, so two
    equal prompts in one call still draw apart), or a list of one seed per prompt (the
    episode runner's: an episode's seed must not depend on which others share its call).

    Raises:
        ValueError: a list of seeds whose length is not ``count``.
    """
    if seed is None:
        return [None] * count
    if isinstance(seed, int):
        return [derive_seed(seed, i) for i in range(count)]
    seeds = [int(s) for s in seed]
    if len(seeds) != count:
        raise ValueError(f"{len(seeds)} seeds for {count} prompts: give one seed per prompt")
    return seeds


def _fork_rng(seed: int | None):
    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


def as_stop_ids(stop_token_ids: int | Sequence[int]) -> tuple[int, ...]:
    """``stop_token_ids`` as a non-empty tuple of distinct ints, in order.

    Raises:
        ValueError: when empty or not ints.
    """
    ids = (stop_token_ids,) if isinstance(stop_token_ids, int) else tuple(stop_token_ids)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be one or more token ids")
    return tuple(dict.fromkeys(ids))


def stop_token_ids(hf_path: str | os.PathLike, tokenizer_eos_id: int | None) -> tuple[int, ...]:
    """Every id that ends a response of the checkpoint in ``hf_path``: the
    ``eos_token_id`` of its ``generation_config.json`` (an int or a list; Qwen3 lists
    ``<|im_end|>`` and ``<|endoftext|>``), else of its ``config.json``, then the tokenizer's
    ``eos_token_id``.

    Raises:
        ValueError: the checkpoint declares no end id and the tokenizer has none.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(hf_path, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            declared = json.load(f).get("eos_token_id")
        if declared is not None:
            ids.extend([declared] if isinstance(declared, int) else declared)
            break
    if tokenizer_eos_id is not None:
        ids.append(tokenizer_eos_id)
    if not ids:
        raise ValueError(
            f"{os.fspath(hf_path)!r} declares no eos_token_id (generation_config.json, "
            "config.json) and its tokenizer has no eos_token: a response could never end"
        )
    return as_stop_ids(ids)


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
#: The same for the warpers transformers applies only when sampling (``do_sample=True``).
HF_NEUTRAL_SAMPLING_WARPERS = {
    "top_k": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


def hf_generation_config(
    sampling: SamplingConfig, *, greedy: bool, stop_token_ids: Sequence[int], pad_token_id: int
):
    """The ``transformers.GenerationConfig`` of one :meth:`HFSampler.generate` call: softmax
    of the logits at ``sampling.temperature``, then nucleus ``sampling.top_p``, and nothing
    else (every other option that could change a draw set to off, see
    :data:`HF_NEUTRAL_LOGITS_PROCESSING`); ``greedy``: the argmax of the raw logits."""
    from transformers import GenerationConfig

    warpers = {} if greedy else {
        **HF_NEUTRAL_SAMPLING_WARPERS,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    return GenerationConfig(
        do_sample=not greedy,
        **HF_NEUTRAL_LOGITS_PROCESSING,
        **warpers,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=list(stop_token_ids),
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )


class HFSampler:
    """``transformers`` ``AutoModelForCausalLM`` sampling with KV cache (``generate``).

    Args:
        hf_path: an HF checkpoint directory (``config.json`` + safetensors).
        stop_token_ids: every id that ends a response (:func:`stop_token_ids`); an int is
            one id. pad_token_id: the id used to pad.
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
            seed: seeds sampling (:func:`request_seeds`; the process RNG is restored afterwards);
                None: unseeded. The batch is sampled from one generator seeded by all the
                prompts' seeds together, so every row draws its own tokens, and the same call
                (same prompts, same seeds) draws the same tokens again; unlike vLLM, a
                prompt's draws depend on the rest of the batch.
            policy_version: stamped on every completion.

        Returns:
            ``len(prompts) * n`` completions, prompt-major (``n`` consecutive per prompt).
        """
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        config = hf_generation_config(
            sampling, greedy=greedy, stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
        )
        seeds = request_seeds(seed, len(prompts))
        with _fork_rng(None if seed is None else derive_seed(*seeds)):
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
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

    def load_hf_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], shared_handle: Mapping | None = None
    ) -> None:
        """Copy HF-layout weights into the model (strict: every parameter, no extras;
        a tied model may omit ``lm_head.weight``). ``shared_handle`` (where the tensors live
        in shared memory, see ``forge_ext.weights.fetch.OpenedWeights``) is not needed: the
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
        weight becomes ``W + (alpha / r) B @ A`` (:func:`forge_ext.lora.merge_into`, fp32),
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
        from forge_ext import lora

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


def make_completion(
    prompt: Sequence[int], ids: Sequence[int], logprobs: Sequence[float],
    stop_ids: tuple[int, ...], policy_version: int,
) -> Completion:
    """A :class:`Completion` of ``ids`` cut after the first stop id (padding a backend
    sampled after it is dropped); ``finished`` when there is one."""
    ids, logprobs = list(ids), list(logprobs)
    end = next((i for i, token in enumerate(ids) if token in stop_ids), None)
    finished = end is not None
    length = end + 1 if finished else len(ids)
    prompt = list(prompt)
    return Completion(
        prompt_ids=prompt, response_ids=ids[:length], logprobs=logprobs[:length],
        finished=finished, policy_version=policy_version,
    )
