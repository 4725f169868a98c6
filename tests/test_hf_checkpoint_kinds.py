"""Checkpoint kinds the ``hf`` engine backend must train as RL needs them (issue 49, items 4
and 5), each on a tiny random checkpoint written by transformers' ``save_pretrained``, one
process, no spawn:

- **dropout** (GPT-2's ``resid_pdrop`` / ``embd_pdrop`` / ``attn_pdrop``; OPT's ``dropout``,
  ``attention_dropout``, ``activation_dropout``, ``layerdrop``): RL trains with it off, so the
  train step's log-probs equal the forward-only ones (the reference's, the generator's) and
  transformers' in eval mode: an on-policy ratio of exactly 1 (TRL PR #3234);
- **sliding-window attention** (Mistral: every layer; Qwen2 with ``max_window_layers``
  and Gemma-2: some layers): a packed microbatch's log-probs equal each row's alone, rows
  longer than the window.
"""

import logging

import pytest
import torch
from conftest import make_lm_batch, random_state_dict

from forge_ext.engine import build_engine, cross_entropy_loss, valid_tokens
from forge_ext.engine.distributed import init_single_process_env

VOCAB = 96
DROPOUT = {
    # GPT-2: every dropout an nn.Dropout module (attention's read as its p by SDPA).
    "gpt2": dict(n_embd=64, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.3,
                 embd_pdrop=0.3, attn_pdrop=0.3),
    # OPT: functional dropouts read from float attributes, and LayerDrop (whole layers
    # skipped at random in training).
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.3,
                attention_dropout=0.3, activation_dropout=0.3, layerdrop=0.3),
}


def save_random(root, model_type: str, fields: dict, seed: int = 0) -> str:
    """A random ``model_type`` checkpoint (weights far from init, so attention and logits
    are far from uniform) saved by transformers in ``root / model_type``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = random_state_dict(model.state_dict(), seed=seed + 1, std=0.3)
    weights = {k: v + 1.0 if "norm" in k and k.endswith("weight") else v
               for k, v in weights.items()}
    model.load_state_dict(weights)
    path = root / model_type
    model.save_pretrained(path)
    return str(path)


def token_logprobs(logits: torch.Tensor, mb) -> torch.Tensor:
    """``[b, S]`` log-prob of each label (0 where it is ignored)."""
    labels = mb["labels"]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])
    return lp[..., 0] * (labels != -100)


def transformers_logprobs(path: str, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return token_logprobs(model(input_ids=batch["input_ids"]).logits, batch)


@pytest.mark.parametrize("model_type", sorted(DROPOUT))
def test_train_steps_run_with_the_checkpoints_dropout_off(model_type, tmp_path, caplog):
    """The log-probs a train step computes (the loss's input, in train mode) equal the
    engine's forward-only ones and transformers' in eval mode: the on-policy ratio
    ``exp(new - old)`` is 1 at every token (with the dropout on, GPT-2 at p 0.3 is off by
    several nats). The log says once which dropout was turned off."""
    init_single_process_env()
    path = save_random(tmp_path, model_type, DROPOUT[model_type])
    batch = make_lm_batch(4, 32, VOCAB, seed=0, ignore_prefix=[0, 5, 9, 2])
    with caplog.at_level(logging.INFO, logger="forge_ext.engine.hf"):
        engine = build_engine({"engine": "hf", "model": {"hf_path": path},
                               "training": {"local_batch_size": 4, "seq_len": 64},
                               "optimizer": {"lr": 0.0}})
    seen = []

    def loss(logits, mb):
        seen.append(token_logprobs(logits, mb).detach())
        return cross_entropy_loss(logits, mb)

    for _ in range(2):  # two train steps (lr 0): two draws of any dropout left on
        engine.train_batch(batch, loss, valid_tokens)
    old = engine.forward_batch(batch, post_hook=token_logprobs)
    want = transformers_logprobs(path, batch)
    torch.testing.assert_close(old, want, rtol=1e-5, atol=1e-5)
    for new in seen:
        ratio = torch.exp(new - old)
        assert (ratio - 1).abs().max().item() <= 1e-5, (ratio - 1).abs().max().item()
    said = [r.getMessage() for r in caplog.records if "dropout" in r.getMessage()]
    assert len(said) == 1, said
    for key in DROPOUT[model_type]:
        if key.endswith(("pdrop", "dropout", "layerdrop")):
            assert key in said[0], (key, said[0])


WINDOW = 6
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=64)
SLIDING = {
    # Every layer slides (no layer_types: config.sliding_window alone).
    "mistral": dict(sliding_window=WINDOW),
    # Layers from max_window_layers on slide: layer 0 full, layer 1 sliding.
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # layer_types alternate: sliding, full.
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=32),
}


@pytest.mark.parametrize("model_type", sorted(SLIDING))
def test_packed_rows_keep_each_layers_sliding_window(model_type, tmp_path):
    """Packed microbatches (``training.packing``, several rows per packed row) give each row's
    log-probs as transformers gives them for the row alone, with rows four to five times the
    window: every sliding layer keeps its window inside each packed document, every full
    layer attends to the whole document."""
    init_single_process_env()
    path = save_random(tmp_path, model_type, {**COMMON, **SLIDING[model_type]})
    batch = make_lm_batch(6, 32, VOCAB, seed=0, ignore_prefix=[0, 5, 9, 2, 14, 3])
    batch["labels"][1, 24:] = -100  # rows of unequal length: 24 to 32 tokens
    batch["labels"][4, 27:] = -100
    engine = build_engine({"engine": "hf", "model": {"hf_path": path},
                           "training": {"local_batch_size": 6, "seq_len": 64, "packing": True,
                                        "max_tokens_per_microbatch": 96}})
    got = engine.forward_batch(batch, post_hook=token_logprobs)
    assert engine.microbatches(batch)[0]["input_ids"].shape[0] == 1  # packed
    assert len(engine.microbatches(batch)[0].rows) >= 3
    want = transformers_logprobs(path, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_refuses_a_layer_type_a_mask_cannot_express(tmp_path):
    """A checkpoint with a layer type other than full or sliding-window attention (here
    chunked attention) cannot be packed: refused when the config is read, naming the field
    and the fix; unpacked it is accepted."""
    from transformers import AutoConfig

    from forge_ext.engine import engine_config_from_mapping

    AutoConfig.for_model("qwen2", vocab_size=VOCAB, **COMMON,
                         layer_types=["full_attention", "chunked_attention"]
                         ).save_pretrained(tmp_path)
    section = {"engine": "hf", "model": {"hf_path": str(tmp_path)},
               "training": {"local_batch_size": 2, "seq_len": 64}}
    engine_config_from_mapping(section)
    section["training"].update(packing=True, max_tokens_per_microbatch=64)
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\].*"
                                         r"training.packing=false"):
        engine_config_from_mapping(section)
