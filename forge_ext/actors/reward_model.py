"""The reward-model role: a frozen sequence classifier that scores completions.

A ``reward.functions`` entry with ``model: <HF checkpoint dir>`` (a
``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification`` with ``num_labels: 1``,
:func:`forge_ext.tasks.rewards.check_reward_model`) runs as the engine of
:class:`forge_ext.actors.trainer.RLTrainer` on its own proc mesh, built with
``model.value_head: true`` (the classifier's ``score`` head read as a one-column value head,
:func:`forge_ext.engine.models.apply_value_head`) and used forward-only, like the KL
reference (:mod:`forge_ext.actors.reference`): ``forward(output="values")`` over its
data-parallel ranks, balanced by tokens under its token budget
(:func:`forge_ext.actors.reference.forward_rows`). No optimizer step is ever taken, so it
keeps the weights it loaded.

A completion's score is the value at the position transformers'
``*ForSequenceClassification`` pools (:func:`score_position`): the last token that is not the
checkpoint's ``pad_token_id``, so with pad == eos (the Llama recipe) a conversation that ends
in its end token scores at the token before it; ``pooling: last_token`` on the entry scores at
the conversation's last token instead (OpenRLHF's reward models). The text scored is the conversation the checkpoint expects: its tokenizer's chat template over
``[user: prompt, assistant: completion]`` (a prompt given as chat messages: those messages,
then the assistant's), or, for a tokenizer without a chat template, ``prompt + completion``
encoded with the tokenizer's own special tokens; tokenized with the reward model's tokenizer,
not the policy's. A step's completions are scored in one call (:meth:`RewardModel.score`).

The rubric (:class:`forge_ext.tasks.rubric.Rubric`) weighs, logs and counts its scores like
any reward function's; a completion longer than the reward model's ``seq_len`` gets no score
(``None``: the rubric gives it ``reward.on_error`` and counts it), and a call that fails costs
the step's scores of this model, never the run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from forge_ext.actors.reference import forward_rows
from forge_ext.actors.trainer import TrainerHandle, spawn_trainer
from forge_ext.engine import engine_config_from_mapping
from forge_ext.engine.losses import IGNORE_INDEX
from forge_ext.tasks.rewards import REWARD_MODEL_ARCHITECTURES, check_reward_model

if TYPE_CHECKING:
    from forge_ext.tasks.rubric import RewardFunctionConfig

POOLINGS = ("last_non_pad", "last_token")
"""What ``reward.functions[i].pooling`` takes (:func:`score_position`)."""
DEFAULT_TOKEN_BUDGET = 4096
"""``max_tokens_per_microbatch`` of a reward model whose entry does not set it."""


def reward_model_engine(entry: RewardFunctionConfig, field: str) -> dict[str, Any]:
    """The engine section (the schema of ``trainer:``) of a ``reward.functions`` entry with
    ``model`` (:class:`forge_ext.tasks.rubric.RewardFunctionConfig`): the checkpoint with a
    value head, ``entry.procs`` data-parallel replicas (each holds the whole frozen model: a
    forward needs no collective of the weights), a token budget of
    ``entry.max_tokens_per_microbatch`` (any number of rows per call), ``training.seq_len``
    ``entry.seq_len`` or the checkpoint's ``max_position_embeddings``.

    Raises:
        ValueError: the checkpoint's refusals (:func:`check_reward_model`), naming ``field``.
    """
    hf = check_reward_model(entry.model, f"{field}.model")
    name = next(REWARD_MODEL_ARCHITECTURES[a] for a in hf["architectures"]
                if a in REWARD_MODEL_ARCHITECTURES)
    seq_len = entry.seq_len or hf.get("max_position_embeddings") or 2048
    return {
        "model": {"name": name, "flavor": "hf", "hf_path": entry.model, "value_head": True},
        "training": {"local_batch_size": 1, "seq_len": seq_len,
                     "max_tokens_per_microbatch":
                         entry.max_tokens_per_microbatch or DEFAULT_TOKEN_BUDGET},
        "parallelism": {"data_parallel_replicate_degree": entry.procs or 1,
                        "data_parallel_shard_degree": 1},
    }


def validate_reward_model(entry: RewardFunctionConfig, field: str) -> None:
    """Everything :func:`spawn_reward_model` checks before spawning (the engine's own
    validation of the checkpoint included), errors naming ``field``."""
    engine_config_from_mapping(reward_model_engine(entry, field), section=field)


def score_position(ids: Sequence[int], pad_token_id: int | None,
                   pooling: str = "last_non_pad") -> int:
    """The index in ``ids`` (one conversation's tokens, padded or not) of the value that is
    its score.

    Args:
        pad_token_id: the checkpoint's ``config.json`` ``pad_token_id`` (what transformers'
            classifier compares with), None when it has none.
        pooling: ``last_non_pad``: as transformers' ``*ForSequenceClassification``
            (``GenericForSequenceClassification``, ``transformers/modeling_layers.py``): the
            rightmost token other than ``pad_token_id`` (left and right padding alike; with
            pad == eos, the token before a trailing end token), 0 when every token is the
            pad, the last token when there is no pad token. ``last_token``: the last token
            whatever it is (OpenRLHF's convention: the reward at the end token).

    Raises:
        ValueError: another ``pooling``, or empty ``ids``.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not one of {list(POOLINGS)}")
    if not ids:
        raise ValueError("an empty conversation has no score position")
    if pooling == "last_token" or pad_token_id is None:
        return len(ids) - 1
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_token_id), 0)


def conversation_text(tokenizer: Any, prompt: str | list[dict[str, str]],
                      completion: str) -> tuple[str, bool]:
    """``(text, add_special_tokens)`` of one completion as the reward model reads it (module
    docstring): the chat template's rendering (its special tokens already in the text), or
    ``prompt + completion`` (the tokenizer adds its own, e.g. a BOS)."""
    messages = (list(prompt) if isinstance(prompt, list)
                else [{"role": "user", "content": prompt}])
    if getattr(tokenizer, "chat_template", None):
        messages = [*messages, {"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(messages, tokenize=False), False
    text = "\n".join(m["content"] for m in messages) if isinstance(prompt, list) else prompt
    return text + completion, True


@dataclass
class RewardModel:
    """Controller handle of one reward model (module docstring)."""

    trainer: TrainerHandle
    tokenizer: Any
    """The checkpoint's own tokenizer (``transformers.AutoTokenizer``)."""
    name: str = "reward_model"
    pad_token_id: int | None = None
    """The checkpoint's ``pad_token_id`` (:func:`score_position`)."""
    pooling: str = "last_non_pad"
    """The entry's ``pooling`` (:func:`score_position`)."""

    @property
    def seq_len(self) -> int:
        return self.trainer.config.training.seq_len

    def encode(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[list[int]]:
        """Token ids of each (prompt, completion) as the reward model reads it."""
        ids = []
        for prompt, completion in zip(prompts, completions, strict=True):
            text, special = conversation_text(self.tokenizer, prompt, completion)
            ids.append(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        return ids

    async def score(self, prompts: Sequence[Any], completions: Sequence[str]
                    ) -> list[float | None]:
        """Scores of a batch of completions in one forward call over the role's ranks:
        the value at each conversation's :func:`score_position`; None for one longer than ``seq_len``
        (or empty)."""
        ids = self.encode(prompts, completions)
        return await self.score_ids(ids)

    async def score_ids(self, ids: Sequence[Sequence[int]]) -> list[float | None]:
        """:meth:`score` of already tokenized conversations."""
        kept = [i for i, row in enumerate(ids) if 0 < len(row) <= self.seq_len]
        scores: list[float | None] = [None] * len(ids)
        if not kept:
            return scores
        lengths = [len(ids[i]) for i in kept]
        width = max(lengths)
        input_ids = torch.zeros(len(kept), width, dtype=torch.int64)
        # Labels only mark how far each row goes (the token budget cuts rows there); a value
        # head's output does not read them.
        labels = torch.full((len(kept), width), IGNORE_INDEX, dtype=torch.int64)
        for row, (i, n) in enumerate(zip(kept, lengths)):
            input_ids[row, :n] = torch.tensor(ids[i], dtype=torch.int64)
            labels[row, :n] = input_ids[row, :n]
        values = await forward_rows(self.trainer, {"input_ids": input_ids, "labels": labels},
                                    "values")
        at = [score_position(ids[i], self.pad_token_id, self.pooling) for i in kept]
        last = values[torch.arange(len(kept)), torch.tensor(at)]
        for i, value in zip(kept, last.tolist()):
            scores[i] = value
        return scores

    async def stop(self) -> None:
        await self.trainer.stop()


def reward_model_role(name: str) -> str:
    """The proc mesh and actor name of reward model ``name`` (Monarch's failure reports
    name it): ``reward_model.<name>``, each character other than a word character, ``.``
    and ``-`` replaced by ``_``."""
    return "reward_model." + re.sub(r"[^\w.-]", "_", name)


async def spawn_reward_model(
    entry: RewardFunctionConfig, field: str, *, name: str = "reward_model",
    spawn_procs: Callable[[], Any] | None = None, master_addr: str | None = None,
) -> RewardModel:
    """Spawn the reward model of a ``reward.functions`` entry with ``model``
    (:func:`reward_model_engine`; ``spawn_procs`` and ``master_addr`` as in
    :func:`spawn_trainer`). Raises ValueError on a config error, before spawning."""
    from transformers import AutoTokenizer

    engine = reward_model_engine(entry, field)
    engine_config_from_mapping(engine, section=field)  # errors name the entry
    tokenizer = AutoTokenizer.from_pretrained(entry.model)
    pad = check_reward_model(entry.model, f"{field}.model").get("pad_token_id")
    trainer = await spawn_trainer(engine, num_procs=entry.procs or 1, name=name,
                                  spawn_procs=spawn_procs, master_addr=master_addr)
    return RewardModel(trainer, tokenizer, name, pad_token_id=pad,
                       pooling=entry.pooling or "last_non_pad")
