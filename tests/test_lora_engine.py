"""LoRA training in the engine (one process, gloo world of one), against independent
references: ``transformers`` with the merged weights and ``peft`` loading the exported
adapter folder (fp32, 1e-5); only the adapters train and are checkpointed; the base stays
bitwise as loaded; gradient accumulation and a resume from a checkpoint are exact. Each test
runs on both engine backends (``backend``: ``titan``, torchtitan's ``LoRALinear``; ``hf``,
forge_ext's adapters on transformers' module), which publish the same PEFT tensors."""

import copy

import pytest
import torch
from conftest import assert_grad_close, full, make_lm_batch, random_state_dict

from forge_ext.engine import build_engine, cross_entropy_loss, valid_tokens
from forge_ext.engine.distributed import init_single_process_env
from forge_ext.engine.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint
from forge_ext.engine.lora import merge_into, read_peft_folder
from forge_ext.engine.schema import HF_TARGETS

# The tiny qwen3 flavor's shapes as an HF checkpoint (forge_ext.engine.models.SMALL_FLAVORS).
ARCH = dict(
    vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
LORA = {"rank": 4}  # alpha defaults to 2 * rank: a scale of 2, so a lost scale shows
PREFIX = [0, 25, 3, 30, 10, 0, 31, 16]  # unequal valid-token counts per row


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An HF checkpoint with large random weights (the default init leaves logits near 0)."""
    from safetensors.torch import load_file

    init_single_process_env()  # every test's engines: a world of one
    root = tmp_path_factory.mktemp("lora_base")
    init = init_hf_checkpoint(root / "init", "qwen3", ARCH, seed=0)
    weights = random_state_dict(load_file(str(init / "model.safetensors")), seed=3, std=0.2)
    return str(save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", ARCH)))


@pytest.fixture(scope="module", params=["titan", "hf"])
def backend(request):
    """The engine backend (``trainer.engine``) a test runs on."""
    return request.param


def config(base, backend, **extra):
    c = {
        "engine": backend,
        "model": {"flavor": "hf", "hf_path": base},
        "training": {"local_batch_size": 8, "seq_len": 64, "max_norm": 1.0e6, "steps": 6},
        "optimizer": {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1},
        "lora": dict(LORA),
    }
    for key, value in extra.items():
        c[key] = {**c.get(key, {}), **value} if isinstance(value, dict) else value
    return c


@pytest.fixture(scope="module")
def engine(base, backend):
    return build_engine(config(base, backend))


def adapter_params(engine):
    return {n: p for n, p in engine.model_parts[0].named_parameters()
            if n.endswith(("lora_a.weight", "lora_b.weight"))}


def set_adapters(engine, values):
    """Replace the adapters' values (torchtitan names), the base kept."""
    state = {k: full(v) for k, v in engine.model_state_dict().items()}
    engine.load_model_state_dict({**state, **values})


def randomize_adapters(engine, seed):
    g = torch.Generator().manual_seed(seed)
    set_adapters(engine, {n: torch.randn(p.shape, generator=g) * 0.1
                          for n, p in adapter_params(engine).items()})


def close(got, want, what):
    """Equal in fp32 to 1e-5, relative and of the largest logit (|logits| reach ~8 here:
    merged and unmerged products round differently by ~1e-6 of that)."""
    assert_grad_close(got, want, what, rel=1e-5)


def transformers_logits(state_dict, ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **ARCH),
                                             dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return model(ids).logits


def test_adapters_start_as_torchtitan_initialises_them_and_the_model_is_its_base(engine, base):
    from safetensors.torch import load_file

    params = adapter_params(engine)
    assert len(params) == 2 * len(HF_TARGETS) * ARCH["num_hidden_layers"]
    for name, p in params.items():
        if name.endswith("lora_b.weight"):
            assert not p.any(), name  # B = 0: training starts at the base model
        else:
            bound = 1 / p.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
            assert 0 < p.abs().max() <= bound and p.std() > bound / 4, name
    base_sd = load_file(f"{base}/model.safetensors")
    for k, v in engine.hf_state_dict().items():  # loaded from model.hf_path, lora keys aside
        assert torch.equal(full(v), base_sd[k]), k
    ids = make_lm_batch(8, 32, 256, seed=0)["input_ids"]
    close(engine.forward_batch({"input_ids": ids}), transformers_logits(base_sd, ids), "base")


def test_only_the_adapters_require_grad_and_sit_in_the_optimizer(engine):
    params = adapter_params(engine)
    trainable = {n for n, p in engine.model_parts[0].named_parameters() if p.requires_grad}
    assert trainable == set(params)
    in_optimizer = {id(p) for opt in engine.optimizers.optimizers
                    for group in opt.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in params.values()}


def test_logits_equal_transformers_with_merged_weights_and_peft_with_the_export(
        engine, base, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    randomize_adapters(engine, seed=5)
    ids = make_lm_batch(8, 32, 256, seed=1)["input_ids"]
    logits = engine.forward_batch({"input_ids": ids})
    exported = engine.export_lora(tmp_path / "adapter", merged_folder=tmp_path / "merged")
    tensors, adapter_config = read_peft_folder(exported["adapter"])
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
    assert adapter_config["base_model_name_or_path"] == base
    for k, v in engine.adapter_state_dict().items():
        assert torch.equal(tensors[k], v), k
    # What push_weights publishes under LoRA: the adapters and their config, not the base.
    per_tensor, per_tensor_config = engine.get_per_tensor_param()
    per_tensor = dict(per_tensor)
    assert per_tensor_config == adapter_config and set(per_tensor) == set(tensors)
    for k, v in per_tensor.items():
        assert torch.equal(v, tensors[k]), k

    base_sd = load_file(f"{base}/model.safetensors")
    merged = merge_into(base_sd, tensors, adapter_config)
    want = transformers_logits(merged, ids)
    assert (want - transformers_logits(base_sd, ids)).abs().max() > 1e-2  # the adapter matters
    close(logits, want, "merged")
    merged_file = load_file(f"{tmp_path}/merged/model.safetensors")
    assert set(merged_file) == set(merged)
    for k in merged:
        torch.testing.assert_close(merged_file[k], merged[k], rtol=0, atol=1e-6)

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **ARCH),
                                             dtype=torch.float32)
    model.load_state_dict(base_sd, strict=True)
    peft_model = PeftModel.from_pretrained(model, exported["adapter"])
    with torch.no_grad():
        close(logits, peft_model(ids).logits, "peft")

    base_logits = transformers_logits(base_sd, ids)
    with engine.disable_adapter():  # the KL reference: the base, from the same weights
        close(engine.forward_batch({"input_ids": ids}), base_logits, "adapters disabled")
    with engine.adapters_disabled():  # the earlier name, an alias
        close(engine.forward_batch({"input_ids": ids}), base_logits, "adapters disabled")
    torch.testing.assert_close(engine.forward_batch({"input_ids": ids}), logits, rtol=0, atol=0)


def test_base_weights_are_bitwise_unchanged_after_training(base, backend):
    engine = build_engine(config(base, backend))
    before = {k: full(v).clone() for k, v in engine.hf_state_dict().items()}
    adapters = {n: full(p).clone() for n, p in adapter_params(engine).items()}
    batch = make_lm_batch(8, 32, 256, seed=2, ignore_prefix=PREFIX)
    losses = [engine.train_batch(batch, cross_entropy_loss, valid_tokens)["loss"]
              for _ in range(4)]
    assert losses[-1] < losses[0]
    for k, v in engine.hf_state_dict().items():
        assert torch.equal(full(v), before[k]), k
    for n, p in adapter_params(engine).items():
        assert not torch.equal(full(p), adapters[n]), n


def test_adapter_gradients_under_gradient_accumulation_equal_the_full_batch(
        engine, base, backend):
    randomize_adapters(engine, seed=6)
    state = {n: full(p).detach().clone() for n, p in adapter_params(engine).items()}
    ga4 = build_engine(config(base, backend, training={"gradient_accumulation_steps": 4}))
    set_adapters(ga4, state)
    batch = make_lm_batch(8, 32, 256, seed=3, ignore_prefix=PREFIX)
    grads = []
    for e in (engine, ga4):
        e.optimizer_zero_grad()
        e.forward_backward_batch(e.microbatches(batch), cross_entropy_loss, valid_tokens)
        grads.append({n: full(p.grad).clone() for n, p in adapter_params(e).items()})
        assert all(p.grad is None for n, p in e.model_parts[0].named_parameters()
                   if n not in state)  # the frozen base gets no gradient
        e.optimizer_zero_grad()
    for n in state:
        assert grads[0][n].abs().max() > 0, n
        assert_grad_close(grads[1][n], grads[0][n], n)


def test_checkpoints_hold_only_adapters_and_their_optimizer_state_and_resume_exactly(
        base, backend, tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = config(base, backend, checkpoint={"enable": True, "folder": "ckpt"},
                 dump_folder=str(tmp_path))
    batches = [make_lm_batch(8, 32, 256, seed=s, ignore_prefix=PREFIX) for s in range(4)]
    run = build_engine(cfg)
    for b in batches[:2]:
        run.train_batch(b, cross_entropy_loss, valid_tokens)
    run.save_checkpoint(run.step)
    unstopped = [run.train_batch(b, cross_entropy_loss, valid_tokens) for b in batches[2:]]

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step-2")).read_metadata()
    keys = set(keys.state_dict_metadata)
    model_keys = {k for k in keys
                  if not k.startswith(("optimizer.", "lr_scheduler", "train_state"))}
    assert model_keys == set(adapter_params(run)), sorted(model_keys - set(adapter_params(run)))
    moments = {k for k in keys if k.startswith("optimizer.state.")}
    assert moments and all(".lora_" in k for k in moments), sorted(moments)[:3]

    # A fresh engine (a restarted process: base from model.hf_path) resumes at step 2.
    resumed = build_engine(copy.deepcopy(cfg))
    assert resumed.load_checkpoint() == 2
    got = [resumed.train_batch(b, cross_entropy_loss, valid_tokens) for b in batches[2:]]
    for g, e in zip(got, unstopped):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == e[key], key
    want = run.adapter_state_dict()
    for k, v in resumed.adapter_state_dict().items():
        assert torch.equal(v, want[k]), k
