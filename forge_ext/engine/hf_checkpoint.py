"""Write Hugging Face checkpoint directories (``config.json`` + safetensors + tokenizer files)
that ``transformers``, vLLM and the engine's ``flavor: hf`` path load.

A directory is written under a temporary name and renamed into place when complete, so a
reader (or a "skip if the checkpoint exists" check) never sees half a checkpoint.

Weights are written as ``save_pretrained`` writes them (``transformers/modeling_utils.py``):
one ``model.safetensors`` when they fit in ``max_shard_bytes``, else
``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``weight_map``:
tensor name -> file; ``metadata.total_size``: bytes). :class:`ShardWriter` takes tensors one
at a time and writes each shard as soon as it is full, so a writer holds at most one shard
(the distributed export, :mod:`forge_ext.engine.export`, gathers one tensor at a time into it).
A write that hits an ``OSError`` (a full disk) is the one-line
:class:`forge_ext.runtime.disk.OutputWriteError` and leaves no folder behind.

``config.json`` carries ``rope_theta`` at the top level as well as transformers 5's
``rope_parameters``: torchtitan-era readers (:func:`forge_ext.engine.models.decoder_config_from_hf`)
and hub checkpoints such as ``Qwen/Qwen3-0.6B`` use the former.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from forge_ext.runtime import disk

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""``save_pretrained``'s historical default shard size (5 GB)."""
TOKENIZER_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates",
)
"""What a tokenizer folder holds besides its vocabulary files, in transformers' names
(``transformers/tokenization_utils_base.py``: ``TOKENIZER_CONFIG_FILE``,
``SPECIAL_TOKENS_MAP_FILE``, ``ADDED_TOKENS_FILE``, ``FULL_TOKENIZER_FILE``,
``CHAT_TEMPLATE_FILE``, ``CHAT_TEMPLATE_DIR``; ``chat_template.json``, the older template
file). The vocabulary files are the tokenizer class's own ``vocab_files_names``
(:func:`copy_tokenizer`)."""
TOKENIZER_SAMPLE = (
    "Hello world! What is 12 plus 30? The answer is 42.\n\tTabs,  two spaces, naïve café, "
    "déjà vu, 日本語, 🙂, <tag> x=1; y = [2, 3]"
)
"""The text an exported tokenizer must encode as the source's (:func:`copy_tokenizer`):
ASCII, digits, whitespace runs, accents, CJK, an emoji (byte fallback), markup."""
# Copied with the tokenizer: the end ids a checkpoint declares there (Qwen3 and Llama-3
# instruct models list two; config.json names one) and its sampling defaults.
GENERATION_CONFIG = "generation_config.json"


def hf_config_dict(model_type: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The full ``config.json`` mapping of a ``transformers`` config built from ``fields``,
    with ``architectures`` (the causal-LM class of ``model_type``) as ``save_pretrained``
    writes it.

    Args:
        model_type: e.g. ``"qwen3"``.
        fields: ``config.json`` fields (``hidden_size``, ``vocab_size``, ...); the rest take
            the transformers defaults of ``model_type``.

    Raises:
        ValueError: an unknown ``model_type``.
    """
    from transformers import AutoConfig

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type, **fields).to_dict()
    # Readers that pick a model class by name (vLLM) need it; save_pretrained writes it too.
    if not config.get("architectures") and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    return config


def save_hf_checkpoint(
    directory: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write an HF checkpoint directory, replacing any previous one atomically.

    Args:
        directory: target folder (its parent is created).
        state_dict: HF-layout tensors (``model.embed_tokens.weight``, ...); DTensors are
            gathered with ``full_tensor()`` (a collective under data/tensor parallelism).
        config: ``config.json`` contents (see :func:`hf_config_dict`).
        tokenizer_from: a folder whose tokenizer (:func:`copy_tokenizer`: every file it
            needs, checked by loading the copy) and ``generation_config.json`` are copied
            (the checkpoint training started from).
        dtype: cast floating-point tensors to it (None: as they are); ``config.json``'s
            ``dtype`` says what was written.
        max_shard_bytes: largest safetensors file (module docstring).

    Returns:
        ``directory`` as a Path.

    Raises:
        forge_ext.runtime.disk.OutputWriteError: not enough free space, or a write failed.
        ValueError: the tokenizer copied does not load as ``tokenizer_from``'s; no folder
            is left behind.
    """
    tensors = {name: (v.full_tensor() if hasattr(v, "full_tensor") else v)
               for name, v in state_dict.items()}
    return write_hf_folder(directory, tensors.items(), config,
                           needed_bytes=sum(tensor_bytes(v, dtype) for v in tensors.values()),
                           tokenizer_from=tokenizer_from, dtype=dtype,
                           max_shard_bytes=max_shard_bytes)


def write_hf_folder(
    directory: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
    config: Mapping[str, Any], *, needed_bytes: int, tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write an HF checkpoint folder from ``(name, full tensor)`` pairs, one writer in this
    process, each shard as soon as it is full: ``tensors`` may be a generator that loads
    them as it goes (a DCP checkpoint's, :func:`forge_ext.engine.export.dcp_to_hf`).
    ``needed_bytes``: the folder's size, compared with the free space first;
    ``config.json``'s ``dtype`` is what the files hold. Other arguments and errors as for
    :func:`save_hf_checkpoint`."""
    directory = Path(directory)
    disk.refuse_if_short("the HF checkpoint", str(directory), needed_bytes)
    staging = staging_folder(directory, str(os.getpid()))
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        writer = ShardWriter(staging, max_shard_bytes=max_shard_bytes, dtype=dtype)
        for name, value in tensors:
            writer.add(name, value)
        return finish_hf_folder(staging, [writer.close()], directory, config,
                                tokenizer_from=tokenizer_from, dtype=writer.float_dtype)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise disk.write_failed("the HF checkpoint", str(directory), e) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_folder(directory: str | Path, tag: str) -> Path:
    """The sibling folder a checkpoint is written into before it is renamed to
    ``directory``: hidden, ``.<name>.staging-<tag>`` (``tag`` tells writers apart)."""
    directory = Path(directory)
    return directory.with_name(f".{directory.name}.staging-{tag}")


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes ``tensor`` takes in a safetensors file after :func:`cast`."""
    itemsize = cast(torch.empty((), dtype=tensor.dtype), dtype).element_size()
    return tensor.numel() * itemsize


def cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating point and ``dtype`` is set."""
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


class ShardWriter:
    """Tensors written into safetensors files of at most ``max_shard_bytes`` each (a tensor
    larger than that gets a file of its own), a file as soon as it is full: the writer holds
    at most one shard's tensors.

    Args:
        folder: where the files go (``<prefix>-<k>.safetensors``; :func:`finish_hf_folder`
            renames them to HF's names).
        prefix: tells several writers' files apart in one folder (one per pipeline stage).
        dtype: cast floating-point tensors to it (None: keep theirs).
    """

    def __init__(self, folder: str | Path, *, prefix: str = "part",
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
        self.folder, self.prefix = Path(folder), prefix
        self.max_shard_bytes, self.dtype = max_shard_bytes, dtype
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self.float_dtype: torch.dtype | None = None
        """The dtype of the floating-point tensors written (the first one's)."""
        self.shards: list[tuple[str, list[str], int]] = []
        """``(file name, tensor names, bytes)`` of each file written, in order."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (a plain, full tensor; copied to CPU), writing the current shard
        first if ``tensor`` would overflow it."""
        value = cast(tensor.detach(), self.dtype).to("cpu").contiguous().clone()
        if self.float_dtype is None and value.is_floating_point():
            self.float_dtype = value.dtype
        size = value.numel() * value.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = value
        self._pending_bytes += size

    def _flush(self) -> None:
        name = f"{self.prefix}-{len(self.shards):05d}.safetensors"
        save_file(self._pending, str(self.folder / name), metadata={"format": "pt"})
        disk.follow_umask(self.folder / name)  # safetensors writes 0600
        self.shards.append((name, list(self._pending), self._pending_bytes))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str], int]]:
        """Write what is queued; returns :attr:`shards`."""
        if self._pending:
            self._flush()
        return self.shards


def finish_hf_folder(
    staging: str | Path, shards: list[list[tuple[str, list[str], int]]], directory: str | Path,
    config: Mapping[str, Any], *, tokenizer_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Complete the checkpoint in ``staging`` and rename it to ``directory`` (replacing a
    previous one only once this one is complete).

    Args:
        shards: each writer's :meth:`ShardWriter.close`, in order: their files are renamed to
            ``model.safetensors`` (one file) or ``model-0000i-of-0000N.safetensors`` with
            ``model.safetensors.index.json``.
        config, tokenizer_from, dtype: as for :func:`save_hf_checkpoint`.

    Raises:
        OSError: a write failed (the caller removes ``staging``).
    """
    staging, directory = Path(staging), Path(directory)
    files = [shard for writer in shards for shard in writer]
    weight_map, total = {}, 0
    for i, (name, tensors, size) in enumerate(files):
        final = WEIGHTS_NAME if len(files) == 1 else (
            f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
        os.replace(staging / name, staging / final)
        weight_map.update({t: final for t in tensors})
        total += size
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = dict(config)
    if dtype is not None:  # what the files hold (transformers 5 reads dtype, 4 torch_dtype)
        config["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
    with open(staging / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, staging)
        if (Path(tokenizer_from) / GENERATION_CONFIG).is_file():
            shutil.copyfile(Path(tokenizer_from) / GENERATION_CONFIG,  # the umask's mode
                            staging / GENERATION_CONFIG)
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def copy_tokenizer(source: str | Path, target: str | Path) -> list[str]:
    """Copy the tokenizer of folder ``source`` into ``target`` and check that it loads there
    as it loads in ``source``.

    Copied as they are: the files of :data:`TOKENIZER_FILES` that ``source`` has, and every
    vocabulary file its tokenizer class names (``vocab_files_names``: ``tokenizer.model`` of a
    SentencePiece tokenizer, ``vocab.json`` and ``merges.txt`` of a byte-level BPE, ...), so
    nothing the tokenizer reads is left behind (a SentencePiece folder without
    ``tokenizer.model`` loads silently as a 3-token tokenizer). Then both are loaded with
    ``transformers.AutoTokenizer`` and compared: size, special tokens, chat template, and
    the encoding of :data:`TOKENIZER_SAMPLE` and of every special and added token.

    Returns:
        The names copied; none when ``source`` holds no tokenizer (no
        ``tokenizer_config.json``, ``tokenizer.json`` or ``tokenizer.model``).

    Raises:
        ValueError: the source's tokenizer does not load, or the copy loads as another
            tokenizer (naming what differs).
        OSError: a copy failed.
    """
    source, target = Path(source), Path(target)
    if not any((source / f).is_file() for f in
               ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")):
        return []
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers raises many kinds; the export names its source
        raise ValueError(f"the tokenizer of {str(source)!r} does not load, so the export "
                         f"cannot carry it: {type(e).__name__}: {e}") from e
    names = dict.fromkeys([*TOKENIZER_FILES, *tokenizer.vocab_files_names.values()])
    copied = []
    for name in names:
        path = source / name
        # Contents only: the copies get the umask's mode, not the source's (a 0600 source
        # would leave the export unreadable to others, issue 50).
        if path.is_dir():
            shutil.copytree(path, target / name, dirs_exist_ok=True,
                            copy_function=shutil.copyfile)
        elif path.is_file():
            shutil.copyfile(path, target / name)
        else:
            continue
        copied.append(name)
    copy = AutoTokenizer.from_pretrained(target)
    if not (source / "config.json").is_file() and (target / "config.json").is_file():
        # A tokenizer-only source (a from-scratch init's): transformers picks some classes by
        # config.json's model_type (qwen2: Qwen2Tokenizer, whatever tokenizer_class says), so
        # the source is compared as the checkpoint's model type reads it.
        from transformers import AutoConfig

        tokenizer = AutoTokenizer.from_pretrained(source,
                                                  config=AutoConfig.from_pretrained(target))
    problem = _tokenizer_difference(tokenizer, copy)
    if problem:
        raise ValueError(
            f"the tokenizer copied from {str(source)!r} into the export does not load as "
            f"the source's ({problem}; files copied: {copied}): the export is refused "
            "rather than written with a different tokenizer; save the source's tokenizer "
            "with tokenizer.save_pretrained(...) and export again")
    return copied


def _tokenizer_difference(want: Any, got: Any) -> str | None:
    """What differs between two loaded tokenizers (:func:`copy_tokenizer`), or None."""
    added = list(want.get_added_vocab())
    texts = [TOKENIZER_SAMPLE, " ".join(added), "".join(added)]
    checks = [("size", len(want), len(got)),
              ("special tokens", want.special_tokens_map, got.special_tokens_map),
              ("chat template", want.chat_template, got.chat_template)]
    checks += [(f"the encoding of {text[:40]!r}", want(text)["input_ids"], got(text)["input_ids"])
               for text in texts]
    for what, a, b in checks:
        if a != b:
            return f"{what}: {str(b)[:80]} where the source has {str(a)[:80]}"
    return None


def init_hf_checkpoint(
    directory: str | Path,
    model_type: str,
    fields: Mapping[str, Any],
    *,
    seed: int,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """A randomly initialised ``transformers`` model (its own init, seeded) saved as an HF
    checkpoint: the starting point of a from-scratch run that then loads like any user
    checkpoint.

    Args:
        directory, tokenizer_from: as for :func:`save_hf_checkpoint`.
        model_type, fields: as for :func:`hf_config_dict`.
        seed: ``torch.manual_seed`` before building the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf_config_dict(model_type, fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **fields), dtype=torch.float32
    )
    state_dict = model.state_dict()
    if config.get("tie_word_embeddings"):
        state_dict.pop("lm_head.weight", None)  # tied: stored once, as in hub checkpoints
    return save_hf_checkpoint(directory, state_dict, config, tokenizer_from=tokenizer_from)
