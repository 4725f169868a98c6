"""One sampled completion (an episode) and packing episodes into the engine's batch dict.

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


@dataclass(kw_only=True, slots=True)
class Episode:
    """A prompt, one sampled response, and what GRPO needs to train on it.

    Raises ``ValueError`` on construction if the prompt or response is empty or a per-token
    list's length differs from ``len(response_ids)``.
    """

    prompt_ids: list[int]
    """Prompt token ids, ``<bos>`` included."""

    response_ids: list[int]
    """Sampled token ids, ``<eos>`` included if the generator emitted it."""

    generator_logprobs: list[float]
    """``[len(response_ids)]`` log-probs (nats) of each response token under the generator."""

    advantage: float
    """Group-normalised advantage (``compute_group_advantages``)."""

    policy_version: int
    """Version of the weights that generated the response (for replay-buffer eviction)."""

    reward: float = 0.0
    """Reward of the response (kept for logging)."""

    ref_logprobs: list[float] | None = None
    """Optional ``[len(response_ids)]`` log-probs under the reference model."""

    response_mask: list[int] | None = None
    """``[len(response_ids)]``: 1 on the model's tokens, 0 on an environment's (multi-turn);
    None: every response token is the model's."""

    truncated: bool = False
    """The response was cut at the length limit (no end token, or the episode's token or
    turn budget ran out); ``loss.mask_truncated`` drops such responses from the loss."""

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
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
        input_ids[row, : prompt_len + response_len] = torch.tensor(
            ep.prompt_ids + ep.response_ids, dtype=torch.int64
        )
        # Position t predicts token t + 1: response token i sits at input position
        # prompt_len + i and is the label of position prompt_len - 1 + i.
        targets = slice(prompt_len - 1, prompt_len - 1 + response_len)
        response = torch.tensor(ep.response_ids, dtype=torch.int64)
        if ep.response_mask is not None:  # environment tokens are inputs, never labels
            response[torch.tensor(ep.response_mask) == 0] = IGNORE_INDEX
        labels[row, targets] = response
        generator_logprobs[row, targets] = torch.tensor(ep.generator_logprobs)
        if ref_logprobs is not None:
            ref_logprobs[row, targets] = torch.tensor(ep.ref_logprobs)

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
