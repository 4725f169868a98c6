"""Every HF folder forge_ext writes carries the whole tokenizer of the checkpoint it started
from (issue 49, item 6): a Llama-2 / Mistral-style SentencePiece tokenizer
(``tokenizer.model``, ``added_tokens.json``, no ``tokenizer.json``) built here with
``sentencepiece``. Without ``tokenizer.model`` such a folder loads silently as a 3-token
tokenizer that encodes every text as ``[1]``. Each export path (``save_hf_checkpoint``, which
``apps.export`` and the SFT app's write through ``write_hf_folder``; the engine's
``export_hf`` at a run's end; the merged LoRA export) goes through
``forge_ext.engine.hf_checkpoint.copy_tokenizer``, whose check refuses a copy that loads as
another tokenizer."""

import io
import json
from pathlib import Path

import pytest
import torch

from forge_ext.engine import hf_checkpoint
from forge_ext.engine.distributed import init_single_process_env
from forge_ext.engine.hf_checkpoint import save_hf_checkpoint

ADDED = "<tool_call>"
SAMPLE = "Hello! What is 12 plus 30?\n\tnaïve café, 日本語 🙂 x=[2, 3]"


def save_sentencepiece_tokenizer(directory: Path) -> None:
    """A byte-fallback BPE SentencePiece model trained here, saved as Llama-2's hub folders
    hold it: ``tokenizer.model``, ``tokenizer_config.json`` (``LlamaTokenizer``),
    ``special_tokens_map.json`` and an added token in ``added_tokens.json``."""
    import sentencepiece as spm

    corpus = ["What is 12 plus 30? The answer is 42.", "You are a helpful assistant.",
              "Compute 7 times 6 and reply with the number only.", "naïve café déjà vu"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=340, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=1.0,
        minloglevel=2)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "legacy": False, **specials}))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials))
    (directory / "added_tokens.json").write_text(json.dumps({ADDED: 340}))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint with the SentencePiece tokenizer beside it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("sp") / "llama"
    save_sentencepiece_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)).save_pretrained(path)
    return str(path)


def assert_same_tokenizer(folder, source):
    from transformers import AutoTokenizer

    want, got = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(folder)
    assert (Path(folder) / "tokenizer.model").read_bytes() == (
        Path(source) / "tokenizer.model").read_bytes()
    assert (Path(folder) / "added_tokens.json").is_file()
    assert len(got) == len(want) == 341
    for text in (SAMPLE, f"Call {ADDED} now", "The answer is 42."):
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    assert len(want("The answer is 42.")["input_ids"]) > 3


def test_every_export_carries_a_sentencepiece_tokenizer(source, tmp_path):
    """``save_hf_checkpoint`` (the path of ``apps.export`` and the SFT app), the engine's
    ``export_hf`` (a run's end) and ``export_lora``'s merged folder each write a folder whose
    tokenizer is the source's: its ``tokenizer.model`` and added token, the same ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from forge_ext.engine import build_engine

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source).to_dict()
    folder = save_hf_checkpoint(tmp_path / "saved", model.state_dict(), config,
                                tokenizer_from=source)
    assert_same_tokenizer(folder, source)
    init_single_process_env()
    section = {"engine": "hf", "model": {"hf_path": source},
               "training": {"local_batch_size": 2, "seq_len": 64}}
    engine = build_engine(section)
    assert_same_tokenizer(engine.export_hf(tmp_path / "run_end")["folder"], source)
    engine = build_engine({**section, "lora": {"rank": 4}})
    merged = engine.export_lora(tmp_path / "adapter", merged_folder=tmp_path / "merged")
    assert_same_tokenizer(merged["merged"], source)


def test_an_export_whose_tokenizer_loads_differently_is_refused(source, tmp_path, monkeypatch):
    """The check after writing: a copy that leaves ``tokenizer.model`` behind (the fault of
    a fixed list of file names) loads as another tokenizer, and the export fails, naming
    what differs, with no folder left behind."""
    from transformers import AutoModelForCausalLM

    copy = hf_checkpoint.shutil.copyfile

    def copy_but_the_vocabulary(src, dst, *args, **kwargs):
        if Path(src).name != "tokenizer.model":
            return copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(hf_checkpoint.shutil, "copyfile", copy_but_the_vocabulary)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"does not load as .*size: 4 where the source has 341"):
        save_hf_checkpoint(tmp_path / "out", model.state_dict(), {"model_type": "llama"},
                           tokenizer_from=source)
    assert not (tmp_path / "out").exists()
