"""Sampling backends for the ``Generator`` actor: ``transformers`` on any device (default),
vLLM on GPUs when it imports.

Both return, for each sampled token, its log-probability under the *policy*, i.e.
``log_softmax`` of the model's raw logits, before temperature and top-p. That is the
``pi_old`` of GRPO's importance ratio ``pi_theta / pi_old`` (the trainer computes
``pi_theta`` from raw logits too), so with ``temperature=1, top_p=1`` sampling and scoring use
one distribution and the ratio starts at exactly 1 up to numerics. With another temperature
or top-p the samples come from a sharpened distribution while the ratio still compares
policies; keep ``temperature: 1.0`` for on-policy GRPO.

A batch of prompts of different lengths is left-padded with an attention mask;
``transformers`` derives position ids from the mask (``GenerationMixin
._prepare_position_ids_for_generation``), so each row is computed as if unpadded.
"""

from __future__ import annotations

import contextlib
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
    """Longest response in tokens; a response that hits it unfinished gets no ``<eos>``."""

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
    """Sampled ids up to and including the first ``<eos>`` (none after it)."""
    logprobs: list[float]
    """``[len(response_ids)]`` log-probs (nats) under the policy's raw logits."""
    finished: bool
    """True if the response ends with ``<eos>`` (False: cut at ``max_new_tokens``)."""
    policy_version: int
    """Version of the weights that sampled it."""


def _fork_rng(seed: int | None):
    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


class HFSampler:
    """``transformers`` ``AutoModelForCausalLM`` sampling with KV cache (``generate``).

    Args:
        hf_path: an HF checkpoint directory (``config.json`` + safetensors).
        eos_token_id: the id that ends a response; pad_token_id: the id used to pad.
        dtype: torch dtype name of the model (``float32`` on CPU).
        device: ``cpu`` or e.g. ``cuda``.
    """

    def __init__(
        self, hf_path: str, *, eos_token_id: int, pad_token_id: int, dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            hf_path, dtype=getattr(torch, dtype)
        ).to(device)
        self.model.eval()
        # Forget the checkpoint's sampling defaults (generation_config.json, e.g. Qwen3's
        # top_k=20, temperature=0.6): transformers fills unset generate() options from them.
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(
            eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        greedy: bool = False,
        seed: int | None = None,
        policy_version: int = 0,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt.

        Args:
            prompts: token ids per prompt (special tokens already added).
            n: completions per prompt (GRPO's group size).
            sampling: temperature, top-p, max_new_tokens.
            greedy: argmax decoding instead of sampling (evaluation).
            seed: seeds sampling (the process RNG is restored afterwards); None: unseeded.
            policy_version: stamped on every completion.

        Returns:
            ``len(prompts) * n`` completions, prompt-major (``n`` consecutive per prompt).
        """
        from transformers import GenerationConfig

        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with _fork_rng(seed):
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
            _completion(rows[i], sampled[i].tolist(), logprobs[i].tolist(), self.eos_token_id,
                        policy_version)
            for i in range(len(rows))
        ]

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-layout weights into the model (strict: every parameter, no extras;
        a tied model may omit ``lm_head.weight``)."""
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


def _completion(prompt, ids, logprobs, eos_token_id, policy_version) -> Completion:
    finished = eos_token_id in ids
    length = ids.index(eos_token_id) + 1 if finished else len(ids)
    return Completion(
        prompt_ids=prompt, response_ids=ids[:length], logprobs=logprobs[:length],
        finished=finished, policy_version=policy_version,
    )


class VLLMSampler:
    """vLLM sampling (GPU). Weights arrive in HF layout and are converted on each vLLM worker
    with :func:`forge_ext.weights.convert.hf_to_vllm` for that worker's tensor-parallel rank,
    then copied into vLLM's fused parameters.

    Args:
        hf_path: HF checkpoint directory vLLM starts from.
        eos_token_id: the id that ends a response.
        engine_args: extra ``vllm.LLM`` arguments (``tensor_parallel_size``,
            ``gpu_memory_utilization``, ``dtype``, ...).

    Raises:
        ImportError: vllm is not installed (install the GPU extra; see README).
    """

    def __init__(self, hf_path: str, *, eos_token_id: int, engine_args: Mapping[str, Any]) -> None:
        import vllm  # noqa: F401  (GPU-only optional dependency)

        self.hf_path = hf_path
        self.eos_token_id = eos_token_id
        # logprobs_mode="raw_logprobs": log-probs of the raw logits (see module docstring).
        self.llm = vllm.LLM(
            model=hf_path, logprobs_mode="raw_logprobs", **{"enforce_eager": True, **engine_args}
        )

    def generate(
        self, prompts, n, sampling: SamplingConfig, *, greedy=False, seed=None, policy_version=0
    ) -> list[Completion]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
            stop_token_ids=[self.eos_token_id],
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params)
        completions = []
        for prompt, output in zip(prompts, outputs):
            for sample in output.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(sample.logprobs, ids)]
                completions.append(
                    _completion(list(prompt), ids, logprobs, self.eos_token_id, policy_version)
                )
        return completions

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Convert and load on every vLLM worker (``LLM.collective_rpc``)."""
        config_path = self.hf_path
        self.llm.collective_rpc(_load_vllm_worker_weights, args=(dict(state_dict), config_path))
        self.llm.reset_prefix_cache()


def _load_vllm_worker_weights(worker: Any, state_dict: dict, config_path: str) -> None:
    """Runs inside each vLLM worker: convert for this worker's TP rank and copy in."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    model = worker.model_runner.model
    copy_vllm_weights(
        model, state_dict, config_path,
        tp_size=get_tensor_model_parallel_world_size(),
        tp_rank=get_tensor_model_parallel_rank(),
    )


@torch.no_grad()
def copy_vllm_weights(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], model_config: Any, *,
    tp_size: int, tp_rank: int,
) -> None:
    """Convert HF-layout weights to the vLLM layout of ``tp_rank`` and copy them into
    ``model``'s parameters of the same names.

    Args:
        model: a module whose ``named_parameters()`` use vLLM names and per-rank shapes.
        state_dict: HF-layout tensors (full, unsharded).
        model_config: anything :func:`forge_ext.weights.convert.hf_to_vllm` accepts.

    Raises:
        KeyError: a converted tensor has no parameter of that name; ValueError: shapes differ.
    """
    from forge_ext.weights.convert import iter_hf_to_vllm

    params = dict(model.named_parameters())
    for name, tensor in iter_hf_to_vllm(state_dict, model_config, tp_size=tp_size, tp_rank=tp_rank):
        if name not in params:
            raise KeyError(f"vLLM model has no parameter {name!r}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{name}: converted shape {tuple(tensor.shape)} != vLLM parameter shape "
                f"{tuple(params[name].shape)}"
            )
        params[name].copy_(tensor.to(params[name].device, params[name].dtype))
