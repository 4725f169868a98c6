"""Token-budget microbatches and sequence packing: compute on tokens, not on padding.

Fixed-row microbatches (``training.microbatch_size`` / ``gradient_accumulation_steps``) pad
every row to the batch's longest; RL responses are long-tailed, so most of that compute is
padding. With ``training.max_tokens_per_microbatch`` the engine instead groups a rank's rows
by length (:func:`plan_token_budget`): each microbatch's padded size (rows x its longest row,
rounded up to ``training.pad_to_multiple_of``) stays within the budget, a row longer than the
budget is a microbatch of its own, and each microbatch is padded only to its own longest row.
With ``training.packing: true`` several sequences share one row (:func:`plan_packing`,
first-fit decreasing into bins of the budget), positions restart at 0 per sequence and
attention is confined to each sequence (document masking, :func:`block_causal_mask`). The
same designs: verl ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``
(``verl/utils/seqlen_balancing.py``), NeMo-RL ``train_mb_tokens``, torchtitan's RL batcher.

Any split is exact because the engine normalises the loss by the step's global weight
(:meth:`forge_ext.engine.base.BaseEngine.forward_backward_batch`); what this module decides
is only which tokens go together. Data-parallel ranks must run the same number of
microbatches (FSDP's collectives), so :func:`equalize` splits the largest microbatches, or
adds empty ones (one padding row, no valid token, weight 0), up to the largest rank's count.

A row's length (:func:`row_lengths`) is the tokens the loss needs: up to and including the
position of its last valid label (``labels != -100``); later positions cannot change any
valid token's logits under causal attention, so they are not computed. Rows without a valid
label need no compute at all. Batches without ``labels`` keep every position.

Layouts produced, for a step batch of ``B`` rows and sequence length ``S``:

- token budget: a :class:`Microbatch` of rows ``rows`` cut to ``[len(rows), L]`` with ``L``
  the longest of them rounded up to ``pad_to_multiple_of`` (at most ``S``); per-row tensors
  ``[B, ...]`` keep their shape.
- packing: a :class:`Microbatch` of one row ``[1, T]`` holding the sequences ``rows`` one
  after another (each cut to its length), then padding up to a multiple of
  ``pad_to_multiple_of``; ``position_ids [1, T]`` restart at 0 per sequence (and at the
  padding), ``sequence_ids [1, T]`` give each token's sequence (its index in ``rows``, ``-1``
  on padding), every per-token tensor ``[B, S, ...]`` becomes ``[1, T, ...]`` (``labels``
  padded with ``-100``, the rest with 0) and every per-row tensor ``[B]`` is broadcast over
  its sequence's tokens (``advantages [B]`` -> ``[1, T]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from forge_ext.engine.losses import IGNORE_INDEX

RESERVED_KEYS = ("position_ids", "sequence_ids")
"""Keys packing adds to a microbatch; a caller's batch may not carry them."""


class Microbatch(dict):
    """A microbatch (``dict[str, Tensor]``) that remembers where its rows came from.

    Attributes:
        rows: indices into the step batch of the rows (or packed sequences) it holds, in
            order; empty for a padding microbatch.
        lengths: per entry of ``rows``, the tokens kept (its :func:`row_lengths` value).
        packed: the rows are packed one after another into a single row.
    """

    rows: list[int]
    lengths: list[int]
    packed: bool

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "Microbatch":
        """The same microbatch over other tensors (e.g. moved to a device)."""
        out = Microbatch(tensors)
        out.rows, out.lengths, out.packed = self.rows, self.lengths, self.packed
        return out


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (>= 1) that is >= ``n`` (token counts)."""
    return -(-n // multiple) * multiple


def row_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B]`` int64: positions each row needs, ``1 + `` the index of its last valid label
    (0 for a row without one); ``S`` for every row of a batch without ``labels``."""
    ids = batch["input_ids"]
    if "labels" not in batch:
        return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)
    if ids.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64)
    valid = batch["labels"] != IGNORE_INDEX
    positions = torch.arange(1, ids.shape[1] + 1, device=valid.device)
    return (valid * positions).amax(dim=1).cpu()


def plan_token_budget(lengths: Sequence[int], budget: int, multiple: int = 1) -> list[list[int]]:
    """Group rows so that ``len(group) * round_up(longest, multiple) <= budget``.

    Rows are taken longest first and each group is filled while the next row fits (rows are
    sorted, so a group's first row is its longest). A row longer than the budget is a group
    of its own. Rows of length 0 are left out (they hold no valid token).

    Returns:
        Lists of row indices; every row of positive length is in exactly one.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = round_up(lengths[i], multiple)
    return groups


def plan_packing(lengths: Sequence[int], budget: int, multiple: int = 1) -> list[list[int]]:
    """Pack rows into bins of at most ``budget`` tokens (after rounding the bin's total up to
    ``multiple``), first-fit decreasing (Johnson 1973; NeMo-RL's sequence packer). A row longer
    than the budget is a bin of its own; rows of length 0 are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        for b, total in enumerate(totals):
            if round_up(total + lengths[i], multiple) <= budget:
                bins[b].append(i)
                totals[b] += lengths[i]
                break
        else:
            bins.append([i])
            totals.append(lengths[i])
    return bins


def equalize(groups: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """``groups`` made ``count`` long (``count >= len(groups)``): the group with the most
    tokens among those of two or more rows is halved, then empty groups (padding
    microbatches) fill what splitting cannot."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.extend([] for _ in range(count - len(groups)))
            break
        largest = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        half = len(largest) // 2
        groups.remove(largest)
        groups.extend([largest[:half], largest[half:]])
    return groups


def balance_rows(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Assign rows to ``num_ranks`` data-parallel ranks with near-equal token sums: longest
    first, each to the rank with the fewest tokens so far (LPT, Graham 1969; verl balances
    with Karmarkar-Karp in ``seqlen_balancing.py``). Each rank's rows keep batch order."""
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(num_ranks), key=lambda r: (tokens[r], len(ranks[r])))
        ranks[r].append(i)
        tokens[r] += lengths[i]
    return [sorted(rows) for rows in ranks]


def padded_microbatch(
    batch: dict[str, torch.Tensor], rows: list[int], lengths: Sequence[int], multiple: int
) -> Microbatch:
    """Rows ``rows`` of ``batch`` cut to their longest length rounded up to ``multiple``
    (at most the batch's ``S``); with no rows, one padding row of ``multiple`` positions."""
    seq = batch["input_ids"].shape[1]
    width = min(round_up(max((lengths[i] for i in rows), default=0) or multiple, multiple), seq)
    consecutive = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
    if consecutive:  # equal lengths keep their order: views, as fixed rows take, no copy
        lo, hi = rows[0], rows[0] + len(rows)
        tensors = {k: v[lo:hi, :width] if v.dim() >= 2 else v[lo:hi] for k, v in batch.items()}
    elif rows:
        index = torch.tensor(rows, dtype=torch.int64, device=batch["input_ids"].device)
        tensors = {
            k: (v.index_select(0, index)[:, :width] if v.dim() >= 2 else v.index_select(0, index))
            for k, v in batch.items()
        }
    else:
        tensors = _padding_row(batch, max(width, 1))
    mb = Microbatch(tensors)
    mb.rows, mb.lengths, mb.packed = list(rows), [int(lengths[i]) for i in rows], False
    return mb


def packed_microbatch(
    batch: dict[str, torch.Tensor], rows: list[int], lengths: Sequence[int], multiple: int
) -> Microbatch:
    """The sequences ``rows`` of ``batch`` packed into one row (layout in the module
    docstring); with no rows, one padding row of ``multiple`` positions."""
    seq = batch["input_ids"].shape[1]
    keep = [int(lengths[i]) for i in rows]
    total = sum(keep)
    width = max(round_up(total, multiple), 1) if rows else multiple
    pad = width - total
    device = batch["input_ids"].device
    tensors: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if value.dim() >= 2 and value.shape[1] == seq:
            parts = [value[i, :n] for i, n in zip(rows, keep)]
        else:  # one value per row: broadcast over the row's tokens
            parts = [value[i].expand(n, *value.shape[1:]) for i, n in zip(rows, keep)]
        fill = IGNORE_INDEX if key == "labels" else 0
        shape = value.shape[2:] if value.dim() >= 2 else value.shape[1:]
        parts.append(value.new_full((pad, *shape), fill))
        tensors[key] = torch.cat(parts).unsqueeze(0)
    # Positions restart per sequence; the padding is a document of its own (it starts at 0),
    # so no real token attends to it and its own queries are never fully masked.
    tensors["position_ids"] = torch.cat(
        [torch.arange(n, device=device) for n in keep] + [torch.arange(pad, device=device)]
    ).unsqueeze(0)
    tensors["sequence_ids"] = torch.cat(
        [torch.full((n,), s, dtype=torch.int64, device=device) for s, n in enumerate(keep)]
        + [torch.full((pad,), -1, dtype=torch.int64, device=device)]
    ).unsqueeze(0)
    mb = Microbatch(tensors)
    mb.rows, mb.lengths, mb.packed = list(rows), keep, True
    return mb


def _padding_row(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """One row that holds no valid token, shaped like ``batch``'s rows cut to ``width``."""
    out = {}
    for key, value in batch.items():
        if value.dim() >= 2:
            fill = IGNORE_INDEX if key == "labels" else 0
            out[key] = value.new_full((1, width, *value.shape[2:]), fill)
        else:
            out[key] = value.new_zeros((1, *value.shape[1:]))
    return out


def block_causal_mask(position_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[b, 1, T, T]`` bool, True where query ``q`` may attend to key ``k``: ``k <= q`` and
    both in the same document, a document starting wherever ``position_ids`` is 0 (the
    convention of torchtitan's ``get_document_mask_mod``); with ``window`` (tokens), also
    ``q - k < window``, the sliding window of transformers' ``sliding_window_overlay``
    (``transformers/masking_utils.py``; Mistral, Gemma-2, Qwen2 sliding layers). For
    ``F.scaled_dot_product_attention``'s ``attn_mask``, the backend with a CPU backward."""
    doc = torch.cumsum(position_ids == 0, dim=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)  # k > q - window
    return (same_doc & causal)[:, None]


def restore_rows(
    outputs: list[object], microbatches: Sequence[object], batch_size: int, seq_len: int
) -> list[object]:
    """Outputs of :class:`Microbatch` es put back in the step batch's row order.

    Args:
        outputs: per microbatch, a tensor ``[b, L, ...]`` (``[1, T, ...]`` when packed), as
            the forward's post-hook returned it.
        microbatches: the microbatches that produced them; plain dicts (fixed-row splits,
            already in row order) leave ``outputs`` unchanged.

    Returns:
        ``[batch]`` of one ``[B, S, ...]`` tensor, zero past each row's length and on rows
        without a valid label (where a label's log-prob is 0 anyway).

    Raises:
        ValueError: an output that is not a per-position tensor.
    """
    if not microbatches or not isinstance(microbatches[0], Microbatch):
        return outputs
    result = None
    for out, mb in zip(outputs, microbatches):
        if not torch.is_tensor(out) or out.dim() < 2:
            raise ValueError(
                "with training.max_tokens_per_microbatch the forward's post-hook must return "
                f"a per-position tensor [b, L, ...], got {type(out).__name__}"
            )
        if result is None:
            result = out.new_zeros((batch_size, seq_len, *out.shape[2:]))
        offset = 0
        for j, (row, n) in enumerate(zip(mb.rows, mb.lengths)):
            if mb.packed:
                result[row, :n] = out[0, offset : offset + n]
                offset += n
            else:
                result[row, :n] = out[j, :n]
    return outputs if result is None else [result]


def count_tokens(microbatches: Sequence[dict[str, torch.Tensor]]) -> int:
    """Positions computed over ``microbatches`` (padding included)."""
    return sum(math.prod(mb["input_ids"].shape) for mb in microbatches)
