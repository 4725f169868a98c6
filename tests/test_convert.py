"""Specification of forge_ext.weights.convert: HF <-> vLLM layout, whole and per TP rank.

The reference for "correct" is transformers' own model on the original HF weights; the
vLLM side is emulated from vLLM's layer semantics (column-parallel layers give local heads,
row-parallel layers give partial sums added across ranks with the bias added once, the
vocab-parallel embedding masks out-of-shard tokens and sums, the LM head's shards are
concatenated and the padding dropped). vLLM itself is not imported.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from forge_ext.weights.convert import (
    hf_to_vllm,
    iter_hf_to_vllm,
    iter_vllm_to_hf,
    merge_vllm_shards,
    vllm_to_hf,
)
from forge_ext.weights.model_config import ModelConfig, padded_vocab_size

VOCAB = 100  # not a multiple of 64: vLLM pads it to 128
HEADS = 8


def _qwen3(kv, tied, **kw):
    # head_dim 16 != hidden_size // heads, so a converter that derives head_dim is caught.
    return Qwen3Config(head_dim=16, tie_word_embeddings=tied, num_key_value_heads=kv, **kw)


def _qwen2(kv, tied, **kw):
    return Qwen2Config(tie_word_embeddings=tied, num_key_value_heads=kv, **kw)


def _llama(kv, tied, **kw):
    return LlamaConfig(tie_word_embeddings=tied, num_key_value_heads=kv, **kw)


# name -> (config factory, tied, extra config); together: q/k norms, q/k/v biases, o_proj and
# MLP biases (row-parallel biases are added once in vLLM), tied and untied embeddings.
FAMILIES = {
    "qwen3-tied": (_qwen3, True, {}),
    "qwen3-attention_bias": (_qwen3, False, {"attention_bias": True}),
    "qwen2-untied": (_qwen2, False, {}),
    "qwen2-tied": (_qwen2, True, {}),
    "llama3-untied": (_llama, False, {}),
    "llama-tied-biases": (_llama, True, {"attention_bias": True, "mlp_bias": True}),
}


def hf_config(family: str, kv_heads: int = 2):
    factory, tied, extra = FAMILIES[family]
    return factory(
        kv_heads,
        tied,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        **extra,
    )


@functools.cache
def hf_model(family: str, kv_heads: int = 2):
    """A tiny fp32 model with every parameter random (HF init leaves biases 0 and norms 1)."""
    torch.manual_seed(1000 * kv_heads + list(FAMILIES).index(family))
    model = AutoModelForCausalLM.from_config(hf_config(family, kv_heads), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def hf_state_dict(family: str, kv_heads: int = 2) -> dict[str, torch.Tensor]:
    """The HF checkpoint layout: a tied model has no ``lm_head.weight`` (as in safetensors)."""
    model = hf_model(family, kv_heads)
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del sd["lm_head.weight"]
    return sd


# --------------------------------------------------------------------------------------------
# vLLM's forward pass, emulated rank by rank


def vllm_forward(shards: list[dict[str, torch.Tensor]], reference, input_ids: torch.Tensor):
    """Logits ``[batch, seq, vocab_size]`` of a model held as per-rank vLLM state dicts.

    ``shards[r]`` is rank r's parameters (``len(shards)`` ranks); a single full, unpadded
    state dict is the ``tp_size=1`` case. ``reference`` (the HF model) provides the config and
    the rotary embedding's cos/sin, which hold no weights.
    """
    config = reference.config
    tp = len(shards)
    eps, d = config.rms_norm_eps, getattr(config, "head_dim", None)
    d = d or config.hidden_size // config.num_attention_heads
    q_local = config.num_attention_heads // tp * d
    kv_local = max(config.num_key_value_heads // tp, 1) * d
    batch, seq = input_ids.shape

    # VocabParallelEmbedding: each rank looks up the tokens in its row range, zeros the rest.
    x = 0
    for rank, shard in enumerate(shards):
        table = shard["model.embed_tokens.weight"]
        local = input_ids - rank * table.shape[0]
        inside = (local >= 0) & (local < table.shape[0])
        x = x + F.embedding(local * inside, table) * inside[..., None]

    positions = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = reference.model.rotary_emb(x, positions)

    def norm(h, weight):
        return F.rms_norm(h, (h.shape[-1],), weight, eps)

    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        partial = []
        for rank, s in enumerate(shards):
            h = norm(x, s[p + "input_layernorm.weight"])
            qkv = F.linear(
                h, s[p + "self_attn.qkv_proj.weight"], s.get(p + "self_attn.qkv_proj.bias")
            )
            q, k, v = (
                t.view(batch, seq, -1, d) for t in qkv.split([q_local, kv_local, kv_local], -1)
            )
            if p + "self_attn.q_norm.weight" in s:
                q, k = (
                    norm(q, s[p + "self_attn.q_norm.weight"]),
                    norm(k, s[p + "self_attn.k_norm.weight"]),
                )
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o = o.transpose(1, 2).reshape(batch, seq, -1)
            bias = s.get(p + "self_attn.o_proj.bias") if rank == 0 else None  # RowParallelLinear
            partial.append(F.linear(o, s[p + "self_attn.o_proj.weight"], bias))
        x = x + sum(partial)  # all-reduce
        partial = []
        for rank, s in enumerate(shards):
            h = norm(x, s[p + "post_attention_layernorm.weight"])
            gate, up = F.linear(
                h, s[p + "mlp.gate_up_proj.weight"], s.get(p + "mlp.gate_up_proj.bias")
            ).chunk(2, -1)
            bias = s.get(p + "mlp.down_proj.bias") if rank == 0 else None
            partial.append(F.linear(F.silu(gate) * up, s[p + "mlp.down_proj.weight"], bias))
        x = x + sum(partial)
    x = norm(x, shards[0]["model.norm.weight"])
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    logits = torch.cat([F.linear(x, s[head]) for s in shards], dim=-1)  # all-gather
    return logits[..., : config.vocab_size]  # LogitsProcessor drops the vocab padding


def reference_logits(family: str, kv_heads: int, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(family, kv_heads)(input_ids).logits


def input_ids() -> torch.Tensor:
    # Every vocab shard gets tokens, including the last rank's few real rows (96..99).
    return torch.tensor([[0, 5, 31, 32, 63, 64, 97, 99], [99, 96, 70, 40, 1, 33, 65, 2]])


# --------------------------------------------------------------------------------------------
# 1. Round trips


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_full_layout_is_exact(family):
    sd = hf_state_dict(family)
    back = vllm_to_hf(hf_to_vllm(sd, hf_config(family)), hf_config(family))
    assert set(back) == set(sd)
    for key, tensor in sd.items():
        assert back[key].dtype == tensor.dtype
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("family", ["qwen3-tied", "qwen2-untied"])
def test_round_trip_is_exact_in_bfloat16(family):
    sd = {k: v.to(torch.bfloat16) for k, v in hf_state_dict(family).items()}
    back = vllm_to_hf(hf_to_vllm(sd, hf_config(family)), hf_config(family))
    assert set(back) == set(sd)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("family", ["qwen3-tied", "llama-tied-biases", "qwen2-untied"])
@pytest.mark.parametrize("tp_size, kv_heads", [(2, 2), (4, 1), (4, 2), (4, 8)])
def test_merging_all_rank_shards_gives_back_the_full_layout(family, tp_size, kv_heads):
    sd = hf_state_dict(family, kv_heads)
    config = hf_config(family, kv_heads)
    shards = [hf_to_vllm(sd, config, tp_size, rank) for rank in range(tp_size)]
    merged = merge_vllm_shards(shards, config)
    full = hf_to_vllm(sd, config)
    assert set(merged) == set(full)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    back = vllm_to_hf(merged, config)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_vllm_to_hf_accepts_the_padded_vocabulary_of_a_vllm_model():
    family = "qwen2-untied"
    sd, config = hf_state_dict(family), hf_config(family)
    as_vllm_holds_it = hf_to_vllm(sd, config, tp_size=1, tp_rank=0)  # embed [128, h]
    assert as_vllm_holds_it["model.embed_tokens.weight"].shape[0] == padded_vocab_size(VOCAB) == 128
    back = vllm_to_hf(as_vllm_holds_it, config)
    assert back["model.embed_tokens.weight"].shape[0] == VOCAB
    assert all(torch.equal(back[k], sd[k]) for k in sd)


# --------------------------------------------------------------------------------------------
# 2. Functional equivalence with transformers (fused tensors, no TP)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_full_tensors_compute_what_transformers_computes(family):
    config = hf_config(family)
    fused = hf_to_vllm(hf_state_dict(family), config)
    assert "model.layers.0.self_attn.q_proj.weight" not in fused
    assert "model.layers.0.mlp.gate_up_proj.weight" in fused
    ids = input_ids()
    torch.testing.assert_close(
        vllm_forward([fused], hf_model(family), ids),
        reference_logits(family, 2, ids),
        rtol=1e-5,
        atol=1e-5,
    )


# --------------------------------------------------------------------------------------------
# 3. Tensor parallelism, including replicated KV heads (tp_size >= num_key_value_heads)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_rank_shards_combined_as_vllm_does_reproduce_transformers(family, tp_size, kv_heads):
    config = hf_config(family, kv_heads)
    sd = hf_state_dict(family, kv_heads)
    shards = [hf_to_vllm(sd, config, tp_size, rank) for rank in range(tp_size)]
    ids = input_ids()
    torch.testing.assert_close(
        vllm_forward(shards, hf_model(family, kv_heads), ids),
        reference_logits(family, kv_heads, ids),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("tp_size, kv_heads", [(1, 2), (2, 2), (4, 2), (4, 1), (2, 8), (4, 8)])
def test_shard_shapes_are_those_vllm_allocates(tp_size, kv_heads):
    # Per-rank sizes from QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear /
    # VocabParallelEmbedding.__init__ (head_dim 16, hidden 64, intermediate 96, vocab 100 -> 128).
    config = hf_config("qwen3-tied", kv_heads)
    local_kv = 1 if tp_size >= kv_heads else kv_heads // tp_size
    shard = hf_to_vllm(hf_state_dict("qwen3-tied", kv_heads), config, tp_size, tp_size - 1)
    p = "model.layers.1."
    assert shard[p + "self_attn.qkv_proj.weight"].shape == (
        (HEADS // tp_size + 2 * local_kv) * 16,
        64,
    )
    assert shard[p + "self_attn.o_proj.weight"].shape == (64, HEADS * 16 // tp_size)
    assert shard[p + "mlp.gate_up_proj.weight"].shape == (2 * 96 // tp_size, 64)
    assert shard[p + "mlp.down_proj.weight"].shape == (64, 96 // tp_size)
    assert shard[p + "self_attn.q_norm.weight"].shape == (16,)
    assert shard["model.embed_tokens.weight"].shape == (128 // tp_size, 64)
    assert "lm_head.weight" not in shard


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_shards_are_rows_of_the_padded_vocab_with_zero_padding(tp_size):
    family = "qwen2-untied"
    sd, config = hf_state_dict(family), hf_config(family)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        shards = [hf_to_vllm(sd, config, tp_size, r)[key] for r in range(tp_size)]
        stacked = torch.cat(shards)
        assert stacked.shape == (128, 64)
        assert torch.equal(stacked[:VOCAB], sd[key])
        assert torch.count_nonzero(stacked[VOCAB:]) == 0


def test_replicated_kv_ranks_hold_the_kv_head_of_their_group():
    # 8 query heads, 2 KV heads, tp 4: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1
    # (QKVParallelLinear: shard_rank = tp_rank // num_kv_head_replicas), not head rank % 2.
    family, d = "qwen3-tied", 16
    sd, config = hf_state_dict(family, 2), hf_config(family, 2)
    k_full = sd["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(4):
        qkv = hf_to_vllm(sd, config, 4, rank)["model.layers.0.self_attn.qkv_proj.weight"]
        k_local = qkv[2 * d : 3 * d]
        assert torch.equal(k_local, k_full[(rank // 2) * d : (rank // 2 + 1) * d]), rank


# --------------------------------------------------------------------------------------------
# 4. Inputs stay as they were; outputs own their storage and keep the device


def test_conversion_leaves_the_input_dict_and_tensors_unchanged():
    family = "llama-tied-biases"
    config = hf_config(family, 1)
    model = hf_model(family, 1)
    sd = dict(model.state_dict())  # tied: lm_head.weight is the embedding itself
    keys, objects = list(sd), dict(sd)
    values = {k: v.clone() for k, v in sd.items()}
    versions = {k: v._version for k, v in sd.items()}

    full = hf_to_vllm(sd, config)
    shards = [hf_to_vllm(sd, config, 4, r) for r in range(4)]
    for _ in iter_hf_to_vllm(sd, config, 2, 1):
        pass
    vllm_to_hf(full, config)
    merge_vllm_shards(shards, config)

    assert list(sd) == keys
    for k in keys:
        assert sd[k] is objects[k]
        assert sd[k]._version == versions[k], f"{k} was modified in place"
        assert torch.equal(sd[k], values[k]), k


def _assert_passed_through_or_own_storage(inputs: dict, outputs: dict) -> None:
    """Each output is an input tensor itself, or a contiguous tensor owning all its storage
    (torchstore serialises a view's whole base storage)."""
    input_storages = {t.untyped_storage().data_ptr() for t in inputs.values()}
    input_objects = {id(t) for t in inputs.values()}
    for key, t in outputs.items():
        if id(t) in input_objects:
            continue
        assert t.is_contiguous(), key
        assert t.untyped_storage().data_ptr() not in input_storages, key
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key


def test_outputs_are_inputs_unchanged_or_own_their_storage():
    family = "qwen2-untied"
    sd, config = hf_state_dict(family), hf_config(family)
    norm = "model.layers.0.input_layernorm.weight"
    for tp_size, tp_rank in [(1, None), (2, 1), (1, 0)]:
        out = hf_to_vllm(sd, config, tp_size, tp_rank)
        assert out[norm] is sd[norm]  # unchanged tensors are passed through without a copy
        _assert_passed_through_or_own_storage(sd, out)
    full = hf_to_vllm(sd, config)
    _assert_passed_through_or_own_storage(full, vllm_to_hf(full, config))
    padded = hf_to_vllm(sd, config, 1, 0)
    _assert_passed_through_or_own_storage(padded, vllm_to_hf(padded, config))
    shards = [hf_to_vllm(sd, config, 2, r) for r in range(2)]
    _assert_passed_through_or_own_storage(shards[0], merge_vllm_shards(shards, config))


def test_outputs_stay_on_the_inputs_device():
    family = "qwen3-attention_bias"
    config = hf_config(family)
    meta = {k: torch.empty_like(v, device="meta") for k, v in hf_state_dict(family).items()}
    for out in (hf_to_vllm(meta, config), hf_to_vllm(meta, config, 2, 1)):
        assert {t.device.type for t in out.values()} == {"meta"}
    back = vllm_to_hf(hf_to_vllm(meta, config), config)
    assert {t.device.type for t in back.values()} == {"meta"}


# --------------------------------------------------------------------------------------------
# 5. Unknown, missing and inconsistent inputs raise, naming what is wrong


def test_unknown_key_raises_and_names_it():
    family = "qwen3-tied"
    sd = hf_state_dict(family)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    with pytest.raises(
        ValueError, match=r"unexpected keys \['model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'\]"
    ):
        hf_to_vllm(sd, hf_config(family))


@pytest.mark.parametrize(
    "family, key",
    [
        ("qwen3-tied", "model.layers.1.self_attn.v_proj.weight"),
        ("qwen2-untied", "model.layers.0.self_attn.v_proj.bias"),  # one bias of three
        ("llama3-untied", "lm_head.weight"),  # required when the embeddings are not tied
    ],
)
def test_missing_key_raises_and_names_it(family, key):
    sd = hf_state_dict(family)
    del sd[key]
    with pytest.raises(ValueError, match=re.escape(f"missing keys ['{key}']")):
        hf_to_vllm(sd, hf_config(family))


def test_unknown_key_in_vllm_layout_raises_and_names_it():
    family = "qwen2-tied"
    full = hf_to_vllm(hf_state_dict(family), hf_config(family))
    full["model.layers.0.self_attn.q_proj.weight"] = torch.ones(1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        vllm_to_hf(full, hf_config(family))


def test_wrong_kv_head_count_in_config_raises_with_the_shape():
    sd = hf_state_dict("qwen3-tied", 2)
    with pytest.raises(ValueError, match=r"k_proj\.weight: \(32, 64\), expected \(64, 64\)"):
        hf_to_vllm(sd, hf_config("qwen3-tied", 4))


@pytest.mark.parametrize(
    "heads, kv_heads, intermediate, tp_size, message",
    [
        (8, 2, 96, 3, r"num_attention_heads=8 is not divisible by tp_size=3"),
        (8, 8, 96, 16, r"num_attention_heads=8 is not divisible by tp_size=16"),
        (12, 4, 96, 6, r"tp_size=6 >= num_key_value_heads=4 but is not a multiple of it"),
        (24, 12, 96, 8, r"num_key_value_heads=12 is not divisible by tp_size=8"),
        # every problem at once: the intermediate size and the padded vocab (128), not the heads
        (6, 6, 100, 3, r"^[^:]*: intermediate_size=100 [^;]*; vocab_size=100 padded to 128 "),
    ],
)
def test_sizes_that_tp_size_does_not_divide_raise(heads, kv_heads, intermediate, tp_size, message):
    config = ModelConfig(
        num_hidden_layers=1,
        hidden_size=heads * 8,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    with pytest.raises(ValueError, match=message):
        hf_to_vllm({}, config, tp_size=tp_size, tp_rank=0)


def test_tied_lm_head_equal_to_the_embedding_is_dropped_and_a_different_one_raises():
    family = "qwen3-tied"
    config = hf_config(family)
    sd = dict(hf_model(family).state_dict())  # nn.Module.state_dict lists the tied weight twice
    assert sd["lm_head.weight"] is not None and "lm_head.weight" not in hf_to_vllm(sd, config)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_vllm(sd, config)


def test_tp_rank_out_of_range_raises():
    with pytest.raises(ValueError, match=r"tp_rank=2"):
        hf_to_vllm(hf_state_dict("qwen3-tied"), hf_config("qwen3-tied"), tp_size=2, tp_rank=2)


# --------------------------------------------------------------------------------------------
# Iterator form, DTensors, configs


class _RecordingDict(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.read: list[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)


def test_iterator_checks_everything_up_front_and_converts_lazily():
    family = "qwen2-untied"
    config = hf_config(family)
    bad = hf_state_dict(family)
    del bad["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        iter_hf_to_vllm(bad, config)  # raised by the call, before iterating
    with pytest.raises(ValueError, match="model.norm.weight"):
        iter_vllm_to_hf({}, config)

    sd = _RecordingDict(hf_state_dict(family))
    stream = iter_hf_to_vllm(sd, config, 2, 0)
    sd.read.clear()  # the up-front checks read shapes
    key, _ = next(stream)
    assert key == "model.embed_tokens.weight" and sd.read == ["model.embed_tokens.weight"]
    key, _ = next(stream)
    key, qkv = next(stream)
    assert key == "model.layers.0.self_attn.qkv_proj.weight"
    assert sd.read[-3:] == [f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"]
    assert dict(iter_hf_to_vllm(sd, config, 2, 0)).keys() == hf_to_vllm(sd, config, 2, 0).keys()


@pytest.fixture(scope="module")
def cpu_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (dist.get_world_size(),))
    if started:
        dist.destroy_process_group()


def test_dtensor_inputs_give_the_same_plain_tensors(cpu_mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    family = "qwen3-attention_bias"
    sd, config = hf_state_dict(family), hf_config(family)
    placements = [[Shard(0)], [Replicate()]]
    dsd = {
        k: distribute_tensor(v, cpu_mesh, placements[i % 2]) for i, (k, v) in enumerate(sd.items())
    }
    for tp_size, tp_rank in [(1, None), (2, 1)]:
        expected = hf_to_vllm(sd, config, tp_size, tp_rank)
        got = hf_to_vllm(dsd, config, tp_size, tp_rank)
        assert set(got) == set(expected)
        for k in expected:
            assert not isinstance(got[k], DTensor) and torch.equal(got[k], expected[k]), k
    back = vllm_to_hf(
        {k: distribute_tensor(v, cpu_mesh, [Shard(0)]) for k, v in hf_to_vllm(sd, config).items()},
        config,
    )
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_config_reads_hf_config_objects_dicts_and_config_json(family, tmp_path):
    config = hf_config(family)
    from_object = ModelConfig.from_hf(config)
    config.save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == from_object
    assert ModelConfig.from_hf(tmp_path / "config.json") == from_object
    assert ModelConfig.from_hf(config.to_dict()) == from_object
    expected_head_dim = 16 if family.startswith("qwen3") else 64 // HEADS
    assert (from_object.head_dim, from_object.num_key_value_heads, from_object.vocab_size) == (
        expected_head_dim,
        2,
        VOCAB,
    )
    assert from_object.tie_word_embeddings == FAMILIES[family][1]
    assert from_object.qkv_bias == (family.startswith("qwen2") or "bias" in family)
    assert from_object.qk_norm == family.startswith("qwen3")


def test_model_config_rejects_unsupported_model_types():
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_rank_holding_only_vocab_padding_gets_zero_rows():
    """Vocab 16 padded to 64 over TP=2: rank 1's 32 embedding rows are all padding."""
    from transformers import Qwen3Config

    from forge_ext.weights.convert import hf_to_vllm
    from forge_ext.weights.model_config import ModelConfig

    hf = Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                     tie_word_embeddings=False)
    from transformers import Qwen3ForCausalLM

    sd = Qwen3ForCausalLM(hf).state_dict()
    config = ModelConfig.from_hf(hf)
    rank0 = hf_to_vllm(sd, config, tp_size=2, tp_rank=0)
    rank1 = hf_to_vllm(sd, config, tp_size=2, tp_rank=1)
    emb = "model.embed_tokens.weight"
    assert rank0[emb].shape == rank1[emb].shape == (32, 32)
    assert torch.equal(rank0[emb][:16], sd[emb]) and not rank0[emb][16:].any()
    assert not rank1[emb].any() and not rank1["lm_head.weight"].any()
