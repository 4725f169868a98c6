"""What every sampling engine shares: :class:`SamplingConfig`, :class:`Completion`, seeds, how
a response ends, and the engine interface (:class:`Engine`) the ``Generator`` actor serves.

An engine takes requests one at a time (:meth:`Engine.sample`: one prompt, ``n`` samples, a
seed); each joins what the engine is already running (vLLM: its continuous batch; transformers:
the next batch of what arrived together), so a caller never waits for other callers' longest
response. :meth:`Engine.generate` (a batch of prompts) is written once here on top of it.

Every engine returns, for each sampled token, its log-probability under the *policy*, i.e.
``log_softmax`` of the model's raw logits, before temperature and top-p. That is the
``pi_old`` of GRPO's importance ratio ``pi_theta / pi_old`` (the trainer computes
``pi_theta`` from raw logits too), so with ``temperature=1, top_p=1`` sampling and scoring use
one distribution and the ratio starts at exactly 1 up to numerics. With another temperature
or top-p the samples come from a sharpened distribution while the ratio still compares
policies; keep ``temperature: 1.0`` for on-policy GRPO. Each token also carries the policy
version that sampled it (:attr:`Completion.versions`): with in-flight weight updates one
response can span versions.

A response ends at the first of the checkpoint's *stop ids*: every id its
``generation_config.json`` lists as ``eos_token_id`` (Qwen3 declares two) plus the
tokenizer's ``eos_token`` (see :func:`forge_ext.tasks.tokenizer.stop_token_ids`).
"""

from __future__ import annotations

import asyncio
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from forge_ext.runtime.clock import BusyClock
from forge_ext.tasks.tokenizer import as_stop_ids


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingConfig:
    """How completions are sampled (YAML ``generator.sampling``). Frozen: a request's config
    is part of what groups it into a batch (hashable)."""

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
    """The oldest version of the weights that sampled any of its tokens (the served version
    for an empty response): what ``loop.max_policy_age`` bounds."""
    versions: list[int] = field(default_factory=list)
    """``[len(response_ids)]``: the policy version that sampled each token (an in-flight
    weight update between two tokens starts the next version there)."""
    resubmitted: int = 0
    """How many times an update (``generator.weight_update: abort``) cut it and it was sent
    again from its tokens so far."""
    replica: int = 0
    """The generator replica that sampled it (set by
    :meth:`forge_ext.rollout.replicas.GeneratorReplicas.sample`; its train-inference mismatch
    is logged per replica)."""


@dataclass(kw_only=True, slots=True)
class Scores:
    """What :meth:`Engine.score` returns: the policy's log-probs of given tokens."""

    logprobs: list[list[float] | None]
    """One entry per scored sequence: ``[len(response_ids)]`` log-probs (nats) of its response
    tokens, each given every token before it (teacher-forced), under the raw logits as in
    :attr:`Completion.logprobs`; None for a sequence the engine cannot take (longer than its
    context)."""
    policy_version: int | None
    """The version of the weights that scored every sequence; None when the engine's weights
    changed while it scored (then no entry can be trusted to one version)."""


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


def make_completion(
    prompt: Sequence[int], ids: Sequence[int], logprobs: Sequence[float],
    stop_ids: tuple[int, ...], policy_version: int, versions: Sequence[int] | None = None,
    resubmitted: int = 0,
) -> Completion:
    """A :class:`Completion` of ``ids`` cut after the first stop id (padding a backend
    sampled after it is dropped); ``finished`` when there is one. ``versions``: each token's
    policy version (default: ``policy_version`` for all); the completion's
    ``policy_version`` is the oldest of its tokens'."""
    ids, logprobs = list(ids), list(logprobs)
    versions = [policy_version] * len(ids) if versions is None else list(versions)
    if not len(ids) == len(logprobs) == len(versions):
        raise ValueError(f"{len(ids)} tokens, {len(logprobs)} log-probs and {len(versions)} "
                         "versions: one of each per token")
    end = next((i for i, token in enumerate(ids) if token in stop_ids), None)
    finished = end is not None
    length = end + 1 if finished else len(ids)
    return Completion(
        prompt_ids=list(prompt), response_ids=ids[:length], logprobs=logprobs[:length],
        finished=finished, versions=versions[:length], resubmitted=resubmitted,
        policy_version=min(versions[:length], default=policy_version),
    )


WeightUpdateMode = Literal["between_requests", "keep", "abort"]
"""How an engine takes a new policy version while requests are in flight
(``generator.weight_update``):

- ``between_requests``: requests in flight finish on the old weights; new ones wait; then the
  new weights load (no response spans two versions);
- ``keep``: requests in flight are paused, the weights load, the KV cache is dropped, and
  they continue under the new version (their earlier tokens are recomputed, not resampled:
  their tokens keep the version that sampled them);
- ``abort``: requests in flight are ended, the weights load, and each unfinished sample is
  sent again from its tokens so far (counted in :attr:`Completion.resubmitted`)."""

WEIGHT_UPDATE_MODES = ("between_requests", "keep", "abort")


@dataclass(slots=True)
class EngineStats:
    """What an engine counts over its life (``Generator.stats``)."""

    requests: int = 0
    """Requests finished (a request of ``n`` samples counts once)."""
    samples: int = 0
    tokens: int = 0
    """Response tokens sampled."""
    resubmitted: int = 0
    """Samples an ``abort`` update cut and sent again."""
    updates: int = 0
    update_seconds: float = 0.0
    """Seconds from an update's start to serving the new version (fetch, pause, load)."""
    paused_seconds: float = 0.0
    """Seconds the engine held requests without running them (``keep``/``abort`` pauses and
    ``between_requests``' wait for new ones)."""


class Engine(ABC):
    """A sampling engine of one model replica (module docstring): requests one at a time,
    weights by policy version.

    Args (of every backend):
        sampling: the default :class:`SamplingConfig` of its requests.
        stop_token_ids: every id that ends a response.
    """

    #: A version fetched over torchstore goes into the engine's own buffer (:meth:`allocate`)
    #: because the engine loads from there (vLLM's workers map it).
    loads_from_buffer: ClassVar[bool] = False

    def __init__(self, sampling: SamplingConfig, stop_token_ids: int | Sequence[int]) -> None:
        self.sampling = sampling
        self.stop_token_ids = as_stop_ids(stop_token_ids)
        self.policy_version = 0
        self.stats = EngineStats()
        self.busy = BusyClock()

    def allocate(self, specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, Any]:
        """Contiguous CPU tensors of the engine's own buffer for ``specs`` (``{name: (shape,
        dtype)}``, the published ones), kept from version to version: a version is fetched
        into them (``fetch_weights(..., allocate=engine.allocate)``) and a delta version
        (``weights.delta``) applied onto the one they hold, then loaded from them."""
        raise NotImplementedError(f"{type(self).__name__} keeps no weight buffer")

    @classmethod
    def validate_config(cls, config: Any) -> None:
        """Check a ``generator:`` section (:class:`~forge_ext.rollout.config.GeneratorConfig`)
        for this backend, before anything is spawned (what every backend shares is checked
        already); nothing by default.

        Raises:
            ValueError: naming the field and the fix.
        """

    @abstractmethod
    async def sample(self, prompt_ids: Sequence[int], n: int = 1, *, greedy: bool = False,
                     seed: int | None = None, sampling: SamplingConfig | None = None
                     ) -> list[Completion]:
        """``n`` completions of one prompt.

        Args:
            prompt_ids: token ids (special tokens already added).
            n: samples (GRPO's group size for a single-turn row).
            greedy: argmax decoding instead of sampling (evaluation).
            seed: seeds this request's draws (None: unseeded); its samples draw apart.
            sampling: overrides :attr:`sampling` for this request.

        Returns:
            ``n`` completions, each token stamped with the version that sampled it.
        """

    async def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, *,
                       greedy: bool = False, seed: int | Sequence[int] | None = None,
                       sampling: SamplingConfig | None = None) -> list[Completion]:
        """``n`` completions per prompt, prompt-major: one :meth:`sample` request per prompt,
        all at once, seeded by :func:`request_seeds`.

        Raises:
            ValueError: no prompts, ``n < 1``, or a list of seeds of the wrong length.
        """
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)}, n={n}")
        seeds = request_seeds(seed, len(prompts))
        results = await asyncio.gather(*(
            self.sample(p, n, greedy=greedy, seed=s, sampling=sampling)
            for p, s in zip(prompts, seeds)
        ))
        return [c for completions in results for c in completions]

    @abstractmethod
    async def pause(self, mode: WeightUpdateMode) -> None:
        """Hold requests for a weight update (:data:`WeightUpdateMode`); returns once none
        runs. New requests wait until :meth:`resume`."""

    @abstractmethod
    async def resume(self) -> None:
        """Run held and new requests again, under what was loaded meanwhile."""

    @abstractmethod
    async def load_hf_state_dict(self, state_dict: Any, policy_version: int,
                                 shared_handle: Any = None, changed: Any = None) -> None:
        """Load full HF-layout weights as ``policy_version`` (between :meth:`pause` and
        :meth:`resume`). ``changed``: the names of the tensors that differ from the version
        the engine serves (a delta version's ``OpenedWeights.changed``), which an engine may
        load alone; None: all of them."""

    @abstractmethod
    async def load_adapter(self, tensors: Any, adapter_config: Any,
                           policy_version: int) -> None:
        """Serve a LoRA adapter on the base weights as ``policy_version`` (between
        :meth:`pause` and :meth:`resume`)."""

    async def score(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Scores:
        """The policy's log-probs of given responses, teacher-forced: for each ``(prompt_ids,
        response_ids)``, ``log pi(o_i | prompt, o_<i)`` for every response token ``o_i``,
        from the raw logits (as a sample's :attr:`Completion.logprobs`, so the two measure
        one distribution), with the weights the engine serves now, and that version. What
        the train-inference mismatch probe of a run whose samples are stale asks
        (:mod:`forge_ext.rl.mismatch`): the generator's side of the gap at the trainer's
        version.

        Raises:
            NotImplementedError: the engine does not score (none of this package's).
        """
        raise NotImplementedError(f"{type(self).__name__} does not score sequences")

    async def close(self) -> None:
        """Stop whatever the engine started (processes, buffers)."""

    def metrics(self) -> dict[str, float]:
        """:attr:`stats` and the busy seconds, as plain numbers."""
        from dataclasses import asdict

        return {**asdict(self.stats), "busy_seconds": self.busy.total(),
                "policy_version": float(self.policy_version)}
