"""Character-level tokenizer for the addition task, built with HuggingFace ``tokenizers``.

Vocabulary (16 ids, fixed): ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, the digits
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
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = "0123456789+="
VOCAB: dict[str, int] = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)
VOCAB_SIZE = len(VOCAB)


def build_tokenizer() -> Tokenizer:
    """The task's character-level ``tokenizers.Tokenizer`` (vocabulary in the module doc)."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(directory: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created).

    Returns:
        The path of ``tokenizer.json``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    ).save_pretrained(directory)
    return directory / "tokenizer.json"
