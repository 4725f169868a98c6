"""Character-level tokenizers (for tasks trained from a random init) and the checkpoint
tokenizer the apps encode prompts with.

A character tokenizer over an alphabet (:func:`build_tokenizer`, ``characters``) has the four
special tokens, then one id per character, in the alphabet's order. The addition task's
(the default alphabet, :data:`CHARACTERS`), 16 ids, fixed: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, the digits
``'0'..'9'`` = 4..13, ``'+'``=14, ``'='``=15. Every character is one token
(``FixedLength(length=1)`` pre-tokenizer, ``WordLevel`` model; any other character, spaces
included, becomes ``<unk>``). Encoding adds ``<bos>`` in front (a ``TemplateProcessing``
post-processor), decoding concatenates characters (``Fuse`` decoder)::

    encode("12+345=") -> [1, 5, 6, 14, 7, 8, 9, 15]

:func:`save_tokenizer` writes ``tokenizer.json`` (loadable with
``tokenizers.Tokenizer.from_file`` and ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``)
and ``tokenizer_config.json`` naming the special tokens, so
``transformers.AutoTokenizer.from_pretrained(directory)`` also knows ``eos_token_id`` and
``pad_token_id``.

A response ends at the first of the checkpoint's *stop ids* (:func:`stop_token_ids`: every id
its ``generation_config.json`` lists as ``eos_token_id``, plus the tokenizer's ``eos_token``);
the sampling engines take them as :func:`as_stop_ids` normalises them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = "0123456789+="
VOCAB: dict[str, int] = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)
VOCAB_SIZE = len(VOCAB)


def character_vocab(characters: str = CHARACTERS) -> dict[str, int]:
    """``{token: id}``: the special tokens, then each character of ``characters`` in order.

    Raises:
        ValueError: ``characters`` is empty or repeats a character.
    """
    if not characters or len(set(characters)) != len(characters):
        raise ValueError(
            f"a character tokenizer needs distinct characters, got {characters!r:.80}"
        )
    return {token: i for i, token in enumerate((*SPECIAL_TOKENS, *characters))}


def build_tokenizer(characters: str = CHARACTERS) -> Tokenizer:
    """A character-level ``tokenizers.Tokenizer`` over ``characters`` (the addition task's by
    default; vocabulary in the module doc)."""
    tokenizer = Tokenizer(models.WordLevel(character_vocab(characters), unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(directory: str | Path, characters: str = CHARACTERS) -> Path:
    """Write the character tokenizer over ``characters`` as ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``directory`` (created).

    Returns:
        The path of ``tokenizer.json``.
    """
    from transformers import PreTrainedTokenizerFast  # seconds: only when one is written

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(characters),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    ).save_pretrained(directory)
    return directory / "tokenizer.json"


def as_stop_ids(stop_token_ids: int | Sequence[int]) -> tuple[int, ...]:
    """``stop_token_ids`` as a non-empty tuple of distinct ints, in order.

    Raises:
        ValueError: when empty or not ints.
    """
    ids = (stop_token_ids,) if isinstance(stop_token_ids, int) else tuple(stop_token_ids)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be one or more token ids")
    return tuple(dict.fromkeys(ids))


def stop_token_ids(hf_path: str | os.PathLike, tokenizer_eos_id: int | None) -> tuple[int, ...]:
    """Every id that ends a response of the checkpoint in ``hf_path``: the
    ``eos_token_id`` of its ``generation_config.json`` (an int or a list; Qwen3 lists
    ``<|im_end|>`` and ``<|endoftext|>``), else of its ``config.json``, then the tokenizer's
    ``eos_token_id``.

    Raises:
        ValueError: the checkpoint declares no end id and the tokenizer has none.
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(hf_path, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            declared = json.load(f).get("eos_token_id")
        if declared is not None:
            ids.extend([declared] if isinstance(declared, int) else declared)
            break
    if tokenizer_eos_id is not None:
        ids.append(tokenizer_eos_id)
    if not ids:
        raise ValueError(
            f"{os.fspath(hf_path)!r} declares no eos_token_id (generation_config.json, "
            "config.json) and its tokenizer has no eos_token: a response could never end"
        )
    return as_stop_ids(ids)


# Files one of which AutoTokenizer needs (fast tokenizer, or the slow ones' vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class CheckpointTokenizer:
    """The tokenizer stored with an HF checkpoint, as the apps use it.

    Loads ``transformers.AutoTokenizer`` from the checkpoint directory, so the character
    tokenizer of the embedded demo and a real model's tokenizer (e.g. ``Qwen/Qwen3-0.6B``'s)
    take the same path.

    Raises:
        FileNotFoundError: ``path`` holds no tokenizer file (``save_pretrained`` of a model
            writes none), naming ``model.hf_path`` and how to add one.
        ValueError: the tokenizer defines no ``eos_token_id`` (a response could never end).
    """

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"model.hf_path={str(path)!r} has no tokenizer (none of {list(TOKENIZER_FILES)}):"
                " the apps read it from the checkpoint. Save the model's tokenizer there "
                "(tokenizer.save_pretrained(path)), or for the demo's addition task: python -c "
                f"\"from forge_ext.tasks.tokenizer import save_tokenizer; save_tokenizer({str(path)!r})\""
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {str(path)!r} has no eos_token; set one")
        self.eos_id: int = self.tokenizer.eos_token_id
        # Every id that ends a response: the checkpoint may declare more than the tokenizer's
        # eos_token (Qwen3's generation_config.json lists <|im_end|> and <|endoftext|>).
        self.stop_ids: tuple[int, ...] = stop_token_ids(path, self.eos_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = self.eos_id if pad is None else pad

    def unknown_count(self, ids: list[int]) -> int:
        """How many of ``ids`` are the tokenizer's unknown token (``<unk>``: text outside its
        vocabulary); 0 for a tokenizer without one (byte-level BPE encodes any text)."""
        unk = self.tokenizer.unk_token_id
        return 0 if unk is None else sum(i == unk for i in ids)

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint's tokenizer defines a chat template (``chat_template`` in
        ``tokenizer_config.json`` or ``chat_template.jinja``)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, text: str, chat_template: bool = False) -> list[int]:
        """Prompt ids with the tokenizer's special tokens (``<bos>`` for the demo's).

        With ``chat_template``, ``text`` becomes a user turn of the tokenizer's chat template
        followed by the assistant prompt (thinking disabled where the template supports it,
        e.g. Qwen3's), for instruction-tuned checkpoints.
        """
        if not chat_template:
            return self.tokenizer(text)["input_ids"]
        return self.encode_messages([{"role": "user", "content": text}],
                                    {"enable_thinking": False})

    def encode_messages(self, messages: list[dict[str, str]],
                        template_kwargs: dict | None = None) -> list[int]:
        """``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` ids:
        the conversation, then the assistant turn's opening, exactly as the template renders
        it (``template_kwargs`` are passed to the template, e.g. ``enable_thinking``; they may
        set ``add_generation_prompt`` and ``continue_final_message``, as vLLM passes them).

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError("the tokenizer has no chat_template to render chat messages with")
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode_messages_plain(self, messages: list[dict[str, str]],
                              template_kwargs: dict | None = None) -> list[int]:
        """:meth:`encode_messages` without the assistant turn's opening at the end
        (``add_generation_prompt=False``)."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True, **(template_kwargs or {})
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode_answer(self, text: str) -> list[int]:
        """Response ids of ``text`` followed by ``<eos>`` (what a correct sample looks like)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id]

    def answer_text(self, response_ids: list[int]) -> str | None:
        """Decoded text before the first stop id (:attr:`stop_ids`); None if the response has
        none (it was cut at the length limit, unfinished).

        Special tokens are kept, so a stray one inside the answer makes it wrong.
        """
        end = next((i for i, t in enumerate(response_ids) if t in self.stop_ids), None)
        if end is None:
            return None
        cut = response_ids[:end]
        return self.tokenizer.decode(cut, skip_special_tokens=False)

    def completion_text(self, response_ids: list[int]) -> tuple[str, bool]:
        """``(text, finished)``: the decoded text before the first stop id and True, or the
        whole response decoded and False when it has no stop id (cut at the length limit).
        Special tokens are kept (see :meth:`answer_text`)."""
        text = self.answer_text(response_ids)
        if text is not None:
            return text, True
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=False), False
