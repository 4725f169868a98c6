"""Checkpoints written by ``transformers`` ``save_pretrained`` with real config fields (issue 11,
items 1-2): the engine's logits equal transformers' in fp32 for every RoPE the supported
families use, Llama-3 loads and exports exactly, pushed weights reproduce transformers'
logits on the generator side, and what the engine cannot reproduce is refused before anything
is spawned, naming the config.json field.

The checkpoints keep the real vocabulary sizes, head dims, head counts, tying and RoPE fields
of Qwen3-0.6B, Qwen2.5-0.5B and Llama-3.2-1B (their hub ``config.json``), with 2 layers and a
small hidden size so they run in seconds on CPU, and are written sharded
(``model.safetensors.index.json``) like hub checkpoints. Weights are random (the default init
can leave the logits near zero, which would make parity vacuous).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import (
    generator_logprob_gap,
    make_lm_batch,
    random_state_dict,
    spawn_all,
)

from forge_ext.engine import TitanEngine, engine_config_from_mapping
from forge_ext.engine.distributed import init_single_process_env
from forge_ext.engine.models import SMALL_FLAVORS, HFRoPE

# Hub config.json fields (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B) with
# num_hidden_layers, hidden_size and intermediate_size made small.
REAL = {
    "qwen3_0.6b": ("qwen3", "qwen3", dict(
        vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
    )),
    "llama3.2_1b": ("llama3", "llama", dict(
        vocab_size=128256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rope_theta=500000.0,
    )),
}
QWEN25_05B = dict(
    vocab_size=151936, hidden_size=56, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
)
SEQ = 32


def hf_model(model_type: str, fields: dict, seed: int):
    """A transformers causal LM from config fields, fp32, SDPA, with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **fields, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(random_state_dict(model.state_dict(), seed=seed, std=0.1))
    return model


def save_sharded(model, directory) -> str:
    """``save_pretrained`` in shards small enough that the index file is used."""
    model.save_pretrained(directory, max_shard_size="200KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return str(directory)


def engine_for(name: str, hf_path: str, flavor: str = "hf") -> TitanEngine:
    init_single_process_env()
    return TitanEngine({
        "model": {"name": name, "flavor": flavor, "hf_path": hf_path},
        "training": {"local_batch_size": 2, "seq_len": SEQ},
    })


def plain(state_dict: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def load_exported(model_type: str, fields: dict, state_dict: dict):
    """A transformers model holding an HF-layout state dict; tied checkpoints carry no
    ``lm_head.weight`` (it is the embedding)."""
    model = hf_model(model_type, fields, seed=999)  # different weights, all replaced
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"} and (
        not missing or fields.get("tie_word_embeddings")
    ), missing
    return model


@pytest.fixture(scope="module")
def real_checkpoints(tmp_path_factory):
    out = {}
    for key, (name, model_type, fields) in REAL.items():
        model = hf_model(model_type, fields, seed=1)
        out[key] = (name, model_type, fields, model,
                    save_sharded(model, tmp_path_factory.mktemp(key)))
    return out


@pytest.mark.parametrize("key", list(REAL))
def test_real_config_checkpoint_gives_transformers_logits_and_exports_exactly(
    real_checkpoints, key
):
    name, model_type, fields, model, path = real_checkpoints[key]
    engine = engine_for(name, path)
    ids = make_lm_batch(2, SEQ, fields["vocab_size"], seed=3)["input_ids"]
    expected = logits_of(model, ids)
    assert expected.abs().max() > 1.0  # random weights: parity is not vacuous
    got = engine.forward_batch({"input_ids": ids})
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The RoPE table is transformers' (Llama-3.2: llama3 scaling, factor 32).
    rope = engine.model_spec.model.layers[0].attention.rope
    hf_inv_freq = model.model.rotary_emb.inv_freq
    if "rope_scaling" in fields:
        assert isinstance(rope, HFRoPE.Config) and rope.rope_type == "llama3"
        assert torch.equal(torch.tensor(rope.inv_freq, dtype=torch.float32), hf_inv_freq)
    # Export: hf_state_dict() in a fresh transformers model gives the same logits.
    exported = load_exported(model_type, fields, plain(engine.hf_state_dict()))
    torch.testing.assert_close(logits_of(exported, ids), expected, rtol=1e-5, atol=1e-5)
    engine.close()


def test_qwen2_checkpoint_is_refused_before_spawning(tmp_path):
    """torchtitan 0.3.0 has no Qwen2 model (q/k/v biases, no q/k norm)."""
    model = hf_model("qwen2", QWEN25_05B, seed=1)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # real Qwen2.5 layout
    path = save_sharded(model, tmp_path)
    for name in ("qwen3", "llama3"):
        for flavor in ("hf", "tiny"):
            with pytest.raises(ValueError, match="config.json model_type='qwen2' cannot be"):
                engine_config_from_mapping(
                    {"model": {"name": name, "flavor": flavor, "hf_path": path}}
                )


# ---- every RoPE variant of config.json ------------------------------------------------------
TINY_QWEN3 = dict(SMALL_FLAVORS["qwen3"]["tiny"], max_position_embeddings=SEQ)
TINY_LLAMA = dict(SMALL_FLAVORS["llama3"]["tiny"], max_position_embeddings=SEQ)
for _fields in (TINY_QWEN3, TINY_LLAMA):
    _fields.pop("rope_theta")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 10000.0}
VARIANTS = {
    # (model.name, model_type, extra config.json fields)
    "qwen3-default": ("qwen3", "qwen3", {"rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 10000.0}}),
    "qwen3-yarn": ("qwen3", "qwen3", {"rope_parameters": YARN}),
    "qwen3-yarn-rope_scaling": ("qwen3", "qwen3", {
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    }),
    "qwen3-yarn-attention_factor": ("qwen3", "qwen3", {
        "rope_parameters": {**YARN, "attention_factor": 1.3, "beta_fast": 16.0}}),
    "qwen3-linear": ("qwen3", "qwen3", {"rope_parameters": {"rope_type": "linear",
                                                            "factor": 4.0, "rope_theta": 1e4}}),
    "llama-llama3": ("llama3", "llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8, "rope_theta": 500000.0}}),
    "llama-linear": ("llama3", "llama", {"rope_theta": 500000.0,
                                         "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama-default": ("llama3", "llama", {"rope_theta": 500000.0}),
}


def without_scaling(extra: dict) -> dict:
    theta = extra.get("rope_theta") or extra["rope_parameters"]["rope_theta"]
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rope_variant_gives_transformers_logits(tmp_path, variant):
    name, model_type, extra = VARIANTS[variant]
    fields = {**(TINY_QWEN3 if name == "qwen3" else TINY_LLAMA), **extra}
    model = hf_model(model_type, fields, seed=2)
    path = save_sharded(model, tmp_path) if variant == "llama-llama3" else (
        model.save_pretrained(tmp_path) or str(tmp_path)
    )
    ids = make_lm_batch(2, SEQ, fields["vocab_size"], seed=4)["input_ids"]
    expected = logits_of(model, ids)
    if "default" not in variant:  # the scaling changes transformers' logits: not vacuous
        plain_fields = {k: v for k, v in fields.items() if k not in ("rope_scaling", "rope_theta")}
        unscaled = hf_model(model_type, {**plain_fields, **without_scaling(extra)}, seed=2)
        unscaled.load_state_dict(model.state_dict())
        assert (logits_of(unscaled, ids) - expected).abs().max() > 1e-3
    engine = engine_for(name, path)
    torch.testing.assert_close(
        engine.forward_batch({"input_ids": ids}), expected, rtol=1e-5, atol=1e-5
    )
    exported = load_exported(model_type, fields, plain(engine.hf_state_dict()))
    torch.testing.assert_close(logits_of(exported, ids), expected, rtol=1e-5, atol=1e-5)
    engine.close()


def test_llama3_tiny_flavor_loads_an_hf_checkpoint(tmp_path):
    """``model.flavor: tiny`` with ``model.hf_path``: the tiny architecture, the
    checkpoint's weights (HF q/k rows, no permutation for the rotate-half RoPE)."""
    fields = SMALL_FLAVORS["llama3"]["tiny"]
    model = hf_model("llama", fields, seed=5)
    model.save_pretrained(tmp_path)
    ids = make_lm_batch(2, SEQ, fields["vocab_size"], seed=6)["input_ids"]
    engine = engine_for("llama3", str(tmp_path), flavor="tiny")
    torch.testing.assert_close(
        engine.forward_batch({"input_ids": ids}), logits_of(model, ids), rtol=1e-5, atol=1e-5
    )
    engine.close()


LLAMA32_1B = dict(
    REAL["llama3.2_1b"][2], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16
)  # the hub config.json (only written, never built)


@pytest.mark.parametrize(
    ("name", "flavor", "fields", "message"),
    [
        ("qwen3", "tiny", dict(SMALL_FLAVORS["qwen3"]["tiny"], rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
         r"RoPE frequencies differ \(config.json rope_type='yarn'\)"),
        ("qwen3", "tiny", dict(SMALL_FLAVORS["qwen3"]["tiny"], rms_norm_eps=1e-5),
         "rms_norm_eps 1e-06 != 1e-05"),
        ("llama3", "tiny", dict(SMALL_FLAVORS["llama3"]["tiny"], intermediate_size=128),
         "parameter shapes differ"),
        # torchtitan's Llama-3 "1B" flavor has llama3 RoPE factor 8; Llama-3.2-1B's is 32.
        ("llama3", "1B", LLAMA32_1B, r"RoPE frequencies differ \(config.json rope_type='llama3'\)"),
    ],
)
def test_a_flavor_that_does_not_match_the_checkpoint_is_refused(
    tmp_path, name, flavor, fields, message
):
    from forge_ext.engine.hf_checkpoint import hf_config_dict

    model_type = {"qwen3": "qwen3", "llama3": "llama"}[name]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model_type, fields)))
    with pytest.raises(
        ValueError, match=rf"^trainer: model.flavor='{flavor}' does not match model.hf_path "
        rf"config.json: {message}.* Use model.flavor=hf"
    ):
        engine_config_from_mapping({"model": {"name": name, "flavor": flavor,
                                              "hf_path": str(tmp_path)}})
    engine_config_from_mapping({"model": {"name": name, "flavor": "hf", "hf_path": str(tmp_path)}})


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         r"config.json rope_parameters.rope_type='dynamic' is not supported \(transformers "
         r"recomputes"),
        ({"rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         r"config.json rope_scaling.rope_type='dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [1.0] * 8, "original_max_position_embeddings": 16}},
         r"config.json rope_parameters.rope_type='longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}},
         r"config.json rope_parameters.partial_rotary_factor=0.5 is not supported"),
    ],
)
def test_rope_the_engine_cannot_reproduce_is_refused_before_spawning(tmp_path, rope, message):
    config = {**SMALL_FLAVORS["qwen3"]["tiny"], "model_type": "qwen3", **rope}
    if "rope_parameters" in rope:
        del config["rope_theta"]  # transformers 5 keeps it inside rope_parameters
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^trainer: model.hf_path " + message):
        engine_config_from_mapping({"model": {"flavor": "hf", "hf_path": str(tmp_path)}})


# ---- layers the engine's decoders lack ------------------------------------------------------
def test_llama_with_attention_biases_is_refused_before_spawning(tmp_path):
    """A Llama saved by transformers with ``attention_bias=True`` has q/k/v/o biases the
    torchtitan decoder lacks: refused, naming the field (it used to train without them and
    fail at the first weight sync)."""
    model = hf_model("llama", dict(TINY_LLAMA, attention_bias=True), seed=1)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    path = save_sharded(model, tmp_path)
    with pytest.raises(ValueError, match=r"^trainer: model.hf_path config.json "
                                         r"attention_bias=True is not supported"):
        engine_config_from_mapping({"model": {"name": "llama3", "flavor": "hf", "hf_path": path}})


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("llama3", {"mlp_bias": True}, r"config.json mlp_bias=True is not supported"),
        ("llama3", {"hidden_act": "gelu"}, r"config.json hidden_act='gelu' is not supported"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16},
         r"config.json use_sliding_window=True is not supported"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
         r"config.json layer_types has \['sliding_attention'\]"),
    ],
)
def test_config_fields_of_layers_the_engine_lacks_are_refused(tmp_path, name, fields, message):
    model_type = {"llama3": "llama", "qwen3": "qwen3"}[name]
    config = {**SMALL_FLAVORS[name]["tiny"], "model_type": model_type, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^trainer: model.hf_path " + message):
        engine_config_from_mapping({"model": {"name": name, "flavor": "hf",
                                              "hf_path": str(tmp_path)}})


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_checkpoint_tensors_other_than_the_models_are_refused(tmp_path, change):
    """Whatever config.json says, a tensor the model would not load (or one it needs and the
    checkpoint lacks) is refused before any spawn, naming it."""
    from safetensors.torch import load_file, save_file

    model = hf_model("qwen3", dict(TINY_QWEN3), seed=1)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = {"model": {"flavor": "hf", "hf_path": str(tmp_path)}, "training": {"seq_len": SEQ}}
    engine_config_from_mapping(config)  # as saved: accepted
    if change == "extra":
        tensors["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(64)
        message = r"tensors the engine's model has no place for: \['model.layers.1.self_attn"
    else:
        del tensors["model.layers.0.mlp.up_proj.weight"]
        message = r"no \['model.layers.0.mlp.up_proj.weight'\] \(1 missing in all\)"
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        engine_config_from_mapping(config)


# ---- the apps: SFT and GRPO one step from each checkpoint (model.hf_path) -------------------
# Before the tests that use the ``store`` fixture: the GRPO app starts and shuts down its own
# torchstore, and a second one in this process is refused ("already initialized").
@pytest.fixture(scope="module")
def app_checkpoints(real_checkpoints, tmp_path_factory):
    """Each real-config checkpoint with the addition task's tokenizer beside it (the apps
    read ``tokenizer.json`` from ``model.hf_path``); its ``generation_config.json`` still
    declares the model's own end id besides the tokenizer's ``<eos>``."""
    import shutil

    from forge_ext.tasks.tokenizer import save_tokenizer

    out = {}
    for key, (name, model_type, fields, model, path) in real_checkpoints.items():
        directory = tmp_path_factory.mktemp(f"{key}_app")
        shutil.copytree(path, directory, dirs_exist_ok=True)
        save_tokenizer(directory)
        out[key] = (name, model_type, fields, str(directory))
    return out


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("key", list(REAL))
def test_sft_runs_a_step_and_writes_the_checkpoints_config(app_checkpoints, key, tmp_path):
    """The warm-start app from the checkpoint: one step, then the written checkpoint keeps
    config.json's fields (RoPE scaling, tying, head_dim) and transformers reads it as the
    engine does."""
    from apps.sft.config import SFTConfig
    from apps.sft.main import run
    from forge_ext.config import from_mapping, load_yaml

    name, model_type, fields, path = app_checkpoints[key]
    config = from_mapping(SFTConfig, load_yaml(CONFIGS / "sft_cpu_demo.yaml", [
        # No trainer.model.name: it follows config.json's model_type (llama -> llama3).
        f"output_dir={tmp_path / 'out'}", f"init.hf_path={path}",
        "metrics=null", "env={}", "trainer.training.steps=1", "trainer.training.seq_len=16",
        "trainer.training.local_batch_size=4", "task.num_eval=4", "eval.every=0",
        "eval.stop_at_accuracy=null",
    ]))
    assert run(config) is not None
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((Path(path) / "config.json").read_text())
    for field in ("vocab_size", "head_dim", "tie_word_embeddings", "rope_theta", "rope_scaling",
                  "rope_parameters", "num_key_value_heads"):
        assert written.get(field) == source.get(field), field
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = make_lm_batch(2, SEQ, fields["vocab_size"], seed=5)["input_ids"]
    engine = engine_for(name, str(tmp_path / "out"))
    torch.testing.assert_close(
        engine.forward_batch({"input_ids": ids}), logits_of(trained, ids), rtol=1e-5, atol=1e-5
    )
    engine.close()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("key", list(REAL))
async def test_grpo_runs_a_step_with_trainer_reference_and_generator_agreeing(
    app_checkpoints, key, tmp_path
):
    """The GRPO app from the checkpoint for one step: the generator's log-probs of what it
    sampled are the trainer's, and the reference (same starting weights) gives KL 0."""
    from apps.grpo.config import load_config
    from apps.grpo.main import RLApp

    gaps = []

    class App(RLApp):
        async def build_rollouts(self, step):
            rollouts = await super().build_rollouts(step)
            gaps.append(await generator_logprob_gap(
                self.trainer, rollouts.episodes, self.tok.pad_id
            ))
            return rollouts

    name, _, _, path = app_checkpoints[key]
    app = App(load_config(CONFIGS / "grpo_cpu_demo.yaml", [
        # No trainer.model.name: it follows config.json's model_type (llama -> llama3).
        f"model.hf_path={path}", f"output_dir={tmp_path}",
        "task.num_train=8", "task.num_eval=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "trainer.training.local_batch_size=4", "reference.training.local_batch_size=4",
        "trainer.training.seq_len=16", "reference.training.seq_len=16",
        "loop.steps=1", "loop.save_every=0", "trainer.checkpoint.enable=false", "metrics.tensorboard=false",
        "metrics.plot=null", "procs.env={}",
    ]))
    await app.run()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    step = next(r for r in rows if "loss" in r)
    # Random weights score 0 everywhere, so the advantages (and the gradient) are 0: the step
    # checks that every role loads the checkpoint alike, not that the policy improves.
    assert step["policy_version"] == 1 and math.isfinite(step["loss"])
    assert abs(step["loss/kl"]) <= 1e-6, step["loss/kl"]
    assert gaps and max(gaps) <= 1e-4, gaps


# ---- the generator side: push_weights -> fetch -> transformers ------------------------------
@pytest.mark.asyncio(loop_scope="module")
async def test_pushed_weights_reproduce_transformers_logits(store, real_checkpoints):
    from forge_ext.actors import spawn_trainer
    from forge_ext.weights.fetch import fetch_weights

    def prefix(key):
        return f"real_{key.replace('.', '_')}"

    trainers = await spawn_all(*(
        spawn_trainer(
            {"model": {"name": name, "flavor": "hf", "hf_path": path},
             "training": {"local_batch_size": 2, "seq_len": SEQ}},
            weights={"transport": "direct", "key_prefix": prefix(key)},
        )
        for key, (name, _, _, _, path) in real_checkpoints.items()
    ))
    try:
        for trainer, (key, (_, model_type, fields, model, _)) in zip(
            trainers, real_checkpoints.items(), strict=True
        ):
            batch = make_lm_batch(2, SEQ, fields["vocab_size"], seed=7)
            await trainer.push_weights(0)
            fetched = await fetch_weights(0, key_prefix=prefix(key))
            generator = load_exported(model_type, fields, fetched)
            expected = logits_of(model, batch["input_ids"])
            torch.testing.assert_close(
                logits_of(generator, batch["input_ids"]), expected, rtol=1e-5, atol=1e-5
            )
            trainer_logits = await trainer.forward([{"input_ids": batch["input_ids"]}])
            torch.testing.assert_close(trainer_logits, expected, rtol=1e-5, atol=1e-5)
    finally:
        await asyncio.gather(*(trainer.stop() for trainer in trainers))
