"""``Generator``: a Monarch actor that samples completions and serves a policy version.

Backends (:mod:`forge_ext.generation`): ``hf`` (``transformers``, any device, the CPU
default) and ``vllm`` (GPU, when ``vllm`` imports). After the trainer's ``push_weights(N)``,
``update_weights(N)`` fetches version ``N`` through :func:`forge_ext.weights.fetch.fetch_weights`
(HF layout) and loads it; the vLLM backend converts it to vLLM's layout on its workers.

Controller usage::

    generator = await spawn_generator(GeneratorConfig(hf_path=...), eos_token_id=2, pad_token_id=0)
    await generator.update_weights(3)
    completions = await generator.generate([[1, 5, 14, 6, 15]], n=8, seed=0)
    await generator.stop()
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from monarch.actor import Actor, ProcMesh, endpoint, this_host

from forge_ext.generation import Completion, HFSampler, SamplingConfig, VLLMSampler
from forge_ext.weights.fetch import DEFAULT_KEY_PREFIX


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """YAML ``generator:`` section."""

    hf_path: str
    """HF checkpoint directory the generator starts from (usually ``${model.hf_path}``)."""
    backend: Literal["hf", "vllm"] = "hf"
    """``hf``: transformers sampling; ``vllm``: vLLM (needs vllm installed and a GPU)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dtype: str = "float32"
    """Model dtype of the ``hf`` backend (float32 on CPU: bf16 matmuls are slow there)."""
    device: str = "cpu"
    """Device of the ``hf`` backend."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.LLM`` arguments (``tensor_parallel_size``, ``gpu_memory_utilization``,
    ``dtype``, ...)."""

    def check_backend(self) -> None:
        """Raise ValueError if ``backend: vllm`` but vllm is not importable."""
        if self.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "generator.backend=vllm but vllm is not installed in this environment "
                "(a GPU-only extra); install it or set generator.backend=hf"
            )


class Generator(Actor):
    """Samples completions with the current weights; one process (vLLM spawns its own
    tensor-parallel workers)."""

    def __init__(
        self, config: dict[str, Any], eos_token_id: int, pad_token_id: int, key_prefix: str
    ) -> None:
        self.config = GeneratorConfig(**{**config, "sampling": SamplingConfig(**config["sampling"])})
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.key_prefix = key_prefix
        self.policy_version = 0
        self.sampler: HFSampler | VLLMSampler | None = None

    @endpoint
    async def setup(self) -> int:
        """Load the model from ``hf_path``; returns the policy version served (0)."""
        c = self.config
        if c.backend == "vllm":
            self.sampler = VLLMSampler(c.hf_path, eos_token_id=self.eos_token_id, engine_args=c.vllm)
        else:
            self.sampler = HFSampler(
                c.hf_path, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                dtype=c.dtype, device=c.device,
            )
        return self.policy_version

    @endpoint
    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False, seed: int | None = None
    ) -> list[Completion]:
        """``n`` completions per prompt, prompt-major, stamped with the served policy version
        (see :meth:`forge_ext.generation.HFSampler.generate`)."""
        return self.sampler.generate(
            prompts, n, self.config.sampling, greedy=greedy, seed=seed,
            policy_version=self.policy_version,
        )

    @endpoint
    async def update_weights(self, policy_version: int) -> dict[str, float]:
        """Fetch ``policy_version`` from torchstore and serve it.

        Returns:
            ``{"policy_version", "fetch_seconds", "load_seconds"}``.

        Raises:
            forge_ext.weights.fetch.WeightsVersionNotFoundError: the version is not committed.
        """
        from forge_ext.weights.fetch import fetch_weights

        start = time.perf_counter()
        state_dict = await fetch_weights(policy_version, key_prefix=self.key_prefix)
        fetched = time.perf_counter()
        self.sampler.load_hf_state_dict(state_dict)
        self.policy_version = policy_version
        return {
            "policy_version": policy_version,
            "fetch_seconds": fetched - start,
            "load_seconds": time.perf_counter() - fetched,
        }

    @endpoint
    async def get_policy_version(self) -> int:
        return self.policy_version


@dataclass
class GeneratorHandle:
    """The controller's handle on a spawned generator."""

    actor: Generator
    procs: ProcMesh
    config: GeneratorConfig

    async def generate(
        self, prompts: list[list[int]], n: int = 1, greedy: bool = False, seed: int | None = None
    ) -> list[Completion]:
        return await self.actor.generate.call_one(prompts, n, greedy, seed)

    async def update_weights(self, policy_version: int) -> dict[str, float]:
        return await self.actor.update_weights.call_one(policy_version)

    async def get_policy_version(self) -> int:
        return await self.actor.get_policy_version.call_one()

    async def stop(self) -> None:
        await self.procs.stop()


async def spawn_generator(
    config: GeneratorConfig, *, eos_token_id: int, pad_token_id: int,
    key_prefix: str = DEFAULT_KEY_PREFIX, name: str = "generator",
) -> GeneratorHandle:
    """Check the backend, spawn one proc, load the model there.

    Args:
        key_prefix: torchstore prefix the trainer publishes under (``weights.key_prefix``).

    Raises:
        ValueError: ``backend: vllm`` without vllm installed (before anything is spawned).
    """
    config.check_backend()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        actor = procs.spawn(name, Generator, asdict(config), eos_token_id, pad_token_id, key_prefix)
        await actor.setup.call_one()
    except BaseException:
        await procs.stop()
        raise
    return GeneratorHandle(actor=actor, procs=procs, config=config)
