"""One sampled completion (an episode) as tensors, and packing episodes into the engine's batch.

The rollout side's output becomes tensors once, where the trajectories of a step become
episodes (:func:`forge_ext.rl.rollouts.episodes_from_trajectories`); the reference's
log-probs of the packed batch go back onto the episodes as tensor slices
(:func:`set_ref_logprobs`); the trainer's batch is :func:`pack_episodes` of the replay
buffer's sample. No per-token data passes through Python lists on the way.

Alignment used by :func:`pack_episodes` (next-token labels, already shifted): for an episode
with prompt ``p_0..p_{P-1}`` and response ``o_0..o_{R-1}``, the row's tokens are
``x = p_0..p_{P-1} o_0..o_{R-1}`` (length ``L = P + R``) and

- ``input_ids[b, t] = x_t`` for ``t < L``, ``pad_id`` for ``t >= L`` (right padding);
- ``labels[b, t] = x_{t+1}`` where ``x_{t+1}`` is a response token, i.e. for
  ``P - 1 <= t <= L - 2``, so ``labels[b, P - 1 + i] = o_i``; ``-100`` elsewhere (prompt,
  the last token, which has no successor, and padding);
- ``generator_logprobs[b, P - 1 + i]`` (and ``ref_logprobs``) ``= log pi(o_i | x_{<P+i})``,
  the log-prob of the label at the same position; ``0.0`` where the label is ``-100``.

Example: prompt ``[1, 5, 15]``, response ``[6, 2]`` ->
``input_ids [1, 5, 15, 6, 2]``, ``labels [-100, -100, 6, 2, -100]``.

A multi-turn episode is one token sequence too: its response holds every token after the
first prompt, the model's turns and the environment's replies between them, and
``response_mask`` marks the model's (1) apart from the environment's (0). A masked token is
input to the model but never a label: ``labels`` is ``-100`` there, so the loss, reference
log-probs, importance ratios and every token metric skip it. Example: prompt ``[1, 5]``, model
``[6, 2]``, environment ``[9]``, model ``[7, 2]``: response ``[6, 2, 9, 7, 2]``, mask
``[1, 1, 0, 1, 1]`` -> ``labels [-100, 6, 2, -100, 7, 2, -100]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forge_ext.engine.losses import IGNORE_INDEX

_TOKEN_FIELDS = {
    "prompt_ids": torch.int64, "response_ids": torch.int64,
    "generator_logprobs": torch.float32, "ref_logprobs": torch.float32,
    "response_mask": torch.bool,
}
"""Each per-token field of :class:`Episode` and the dtype it is stored in."""


@dataclass(kw_only=True, slots=True, eq=False)
class Episode:
    """A prompt, one sampled response, and what GRPO needs to train on it.

    The per-token fields are 1-D tensors; a sequence (a list of ints or floats) given for one
    is converted on construction to the field's dtype (a tensor of that dtype is kept as is).
    Episodes compare by identity (``==`` of their tensors would be elementwise).

    Raises ``ValueError`` on construction if a per-token field is not 1-D, the prompt or
    response is empty, or a per-token field's length differs from ``len(response_ids)``.
    """

    prompt_ids: torch.Tensor
    """``[P]`` int64 prompt token ids, ``<bos>`` included."""

    response_ids: torch.Tensor
    """``[R]`` int64 sampled token ids, ``<eos>`` included if the generator emitted it."""

    generator_logprobs: torch.Tensor
    """``[R]`` fp32 log-probs (nats) of each response token under the generator."""

    advantage: float
    """Group-normalised advantage (``compute_group_advantages``)."""

    policy_version: int
    """Version of the weights that generated the response (for replay-buffer eviction)."""

    reward: float = 0.0
    """Reward of the response (kept for logging)."""

    replica: int = 0
    """The generator replica that sampled it (the mismatch is logged per replica)."""

    ref_logprobs: torch.Tensor | None = None
    """Optional ``[R]`` fp32 log-probs under the reference model."""

    response_mask: torch.Tensor | None = None
    """``[R]`` bool: True on the model's tokens, False on an environment's (multi-turn);
    None: every response token is the model's."""

    truncated: bool = False
    """The response was cut at the length limit (no end token, or the episode's token or
    turn budget ran out); ``loss.mask_truncated`` drops such responses from the loss."""

    def __post_init__(self) -> None:
        for name, dtype in _TOKEN_FIELDS.items():
            values = getattr(self, name)
            if values is not None:
                values = torch.as_tensor(values, dtype=dtype)
                if values.dim() != 1:
                    raise ValueError(f"Episode.{name} must be 1-D, got shape "
                                     f"{tuple(values.shape)}")
                setattr(self, name, values)
        if not len(self.prompt_ids) or not len(self.response_ids):
            raise ValueError(
                f"Episode needs a non-empty prompt and response; got {len(self.prompt_ids)} "
                f"prompt and {len(self.response_ids)} response tokens"
            )
        for name in ("generator_logprobs", "ref_logprobs", "response_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(
                    f"Episode.{name} has {len(values)} entries, expected one per response "
                    f"token ({len(self.response_ids)})"
                )


def pack_episodes(
    episodes: Sequence[Episode], *, pad_id: int, seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Pack episodes into the engine's batch dict (alignment in the module docstring).

    Args:
        episodes: ``B >= 1`` episodes.
        pad_id: token id used to right-pad ``input_ids``.
        seq_len: pad every row to this length; default: the longest ``P + R``.

    Returns:
        ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` int64, ``generator_logprobs``
        ``[B, S]`` fp32, ``advantages`` ``[B]`` fp32, ``truncated`` ``[B]`` bool, and
        ``ref_logprobs`` ``[B, S]`` fp32 if every episode has them.

    Raises:
        ValueError: if ``episodes`` is empty, an episode is longer than ``seq_len``, or only
            some episodes carry ``ref_logprobs``.
    """
    if not episodes:
        raise ValueError("pack_episodes needs at least one episode")
    lengths = [len(ep.prompt_ids) + len(ep.response_ids) for ep in episodes]
    if seq_len is None:
        seq_len = max(lengths)
    elif max(lengths) > seq_len:
        raise ValueError(
            f"an episode has {max(lengths)} tokens, more than seq_len={seq_len}; raise "
            "seq_len or cap the prompt and response lengths"
        )
    with_ref = [ep.ref_logprobs is not None for ep in episodes]
    if any(with_ref) and not all(with_ref):
        raise ValueError(
            f"ref_logprobs are set on {sum(with_ref)} of {len(episodes)} episodes; "
            "set them on all or none"
        )

    batch = len(episodes)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.int64)
    generator_logprobs = torch.zeros(batch, seq_len, dtype=torch.float32)
    ref_logprobs = torch.zeros(batch, seq_len, dtype=torch.float32) if all(with_ref) else None
    for row, ep in enumerate(episodes):
        prompt_len, response_len = len(ep.prompt_ids), len(ep.response_ids)
        input_ids[row, :prompt_len] = ep.prompt_ids
        input_ids[row, prompt_len : prompt_len + response_len] = ep.response_ids
        # Position t predicts token t + 1: response token i sits at input position
        # prompt_len + i and is the label of position prompt_len - 1 + i.
        targets = _targets(ep)
        response = ep.response_ids
        if ep.response_mask is not None:  # environment tokens are inputs, never labels
            response = response.masked_fill(~ep.response_mask, IGNORE_INDEX)
        labels[row, targets] = response
        generator_logprobs[row, targets] = ep.generator_logprobs
        if ref_logprobs is not None:
            ref_logprobs[row, targets] = ep.ref_logprobs

    packed = {
        "input_ids": input_ids,
        "labels": labels,
        "generator_logprobs": generator_logprobs,
        "advantages": torch.tensor([ep.advantage for ep in episodes], dtype=torch.float32),
        "truncated": torch.tensor([ep.truncated for ep in episodes], dtype=torch.bool),
    }
    if ref_logprobs is not None:
        packed["ref_logprobs"] = ref_logprobs
    return packed


def set_ref_logprobs(episodes: Sequence[Episode], ref_logprobs: torch.Tensor) -> None:
    """Give each episode its reference log-probs, read from the reference's output on
    :func:`pack_episodes` of ``episodes`` (the label positions of its response).

    Args:
        episodes: ``B`` episodes, in the packed batch's row order.
        ref_logprobs: ``[B, S]`` log-probs of each label; each episode keeps a copy of its
            ``[R]`` slice, as fp32 (not a view that would hold the whole batch).

    Raises:
        ValueError: ``ref_logprobs`` has not ``B`` rows.
    """
    if ref_logprobs.shape[0] != len(episodes):
        raise ValueError(f"ref_logprobs has {ref_logprobs.shape[0]} rows for "
                         f"{len(episodes)} episodes")
    for row, ep in enumerate(episodes):
        ep.ref_logprobs = ref_logprobs[row, _targets(ep)].to(torch.float32, copy=True)


def _targets(ep: Episode) -> slice:
    """The positions of ``ep``'s packed row whose labels are its response tokens."""
    return slice(len(ep.prompt_ids) - 1, len(ep.prompt_ids) - 1 + len(ep.response_ids))
