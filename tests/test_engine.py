"""Engine behaviour in one process (world of one, gloo): gradient accumulation is exact,
eval never depends on the split, checkpoints round-trip, bad input is rejected clearly.

The equivalence tests take ``backend`` and run on both engine backends (``titan``,
torchtitan's model; ``hf``, transformers' module) loading the same HF checkpoint (the tiny
flavor with the reference weights, written by ``export_hf``); ``test_dp2_...`` runs both on
two gloo processes (FSDP2) against one process."""

import copy
import re

import pytest
import torch
from conftest import full, make_lm_batch, random_state_dict

from forge_ext.engine import TitanEngine, cross_entropy_loss, engine_config_from_mapping
from forge_ext.engine import valid_tokens
from forge_ext.engine.distributed import init_single_process_env

BASE = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": 8, "seq_len": 64, "max_norm": 1.0e6},
    # A large Adam eps keeps the first update proportional to the gradient: with eps=1e-8 it
    # is lr * sign(g), and fp32 noise flips the sign of near-zero gradients.
    "optimizer": {"lr": 1e-2, "eps": 1e-3},
}
# Rows carry very different valid-token counts, so microbatch means are unequal.
PREFIX = [0, 25, 3, 30, 10, 0, 31, 16]


def config(**training):
    c = copy.deepcopy(BASE)
    c["training"].update(training)
    return c


@pytest.fixture(scope="module")
def reference_weights():
    init_single_process_env()
    engine = TitanEngine(config())
    return random_state_dict(engine.model_state_dict(), seed=1)


def build(reference_weights, **training) -> TitanEngine:
    engine = TitanEngine(config(**training))
    engine.load_model_state_dict(reference_weights)
    return engine


@pytest.fixture(scope="module")
def hf_path(reference_weights, tmp_path_factory):
    """The tiny flavor with the reference weights as an HF checkpoint folder (the titan
    engine's ``export_hf``): what both backends load in the parametrised tests."""
    folder = tmp_path_factory.mktemp("tiny_hf") / "ckpt"
    return build(reference_weights).export_hf(folder)["folder"]


@pytest.fixture(scope="module", params=["titan", "hf"])
def backend(request):
    """The engine backend (``trainer.engine``) a parametrised test runs on."""
    return request.param


def backend_config(backend, hf_path, **training):
    """:func:`config` for ``backend``, the model read from the HF checkpoint ``hf_path``."""
    c = config(**training)
    c.update(engine=backend, model={"flavor": "hf", "hf_path": str(hf_path)})
    return c


@pytest.fixture
def make(backend, hf_path):
    """``make(training=None, **sections)``: an engine of the test's backend on ``hf_path``,
    with ``training`` fields and whole config sections (``checkpoint=...``) set."""
    from forge_ext.engine import build_engine

    def make_engine(training=None, **sections):
        c = backend_config(backend, hf_path, **(training or {}))
        c.update(sections)
        return build_engine(c)

    return make_engine


def grads(engine):
    return {n: full(p.grad).clone() for n, p in engine.model_parts[0].named_parameters()
            if p.grad is not None}


def weights(engine):
    return {k: full(v).clone() for k, v in engine.model_state_dict().items()}


def test_gradient_accumulation_equals_full_batch(make):
    batch = make_lm_batch(8, 32, 256, seed=0, ignore_prefix=PREFIX)
    ga1 = make()
    ga4 = make({"gradient_accumulation_steps": 4})
    results = {}
    for name, engine in (("ga1", ga1), ("ga4", ga4)):
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(
            engine.microbatches(batch), cross_entropy_loss, valid_tokens
        )
        results[name] = (out, grads(engine))
        engine.optimizer_step()

    # Reference: plain autograd of one cross entropy over all valid tokens of the batch,
    # through the model alone (no microbatches, no loss weights, no engine loop).
    reference = make()
    logits = reference._model_forward(reference.model_parts[0], batch)
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    ).backward()
    g_ref = grads(reference)

    out1, g1 = results["ga1"]
    out4, g4 = results["ga4"]
    for name in g_ref:
        torch.testing.assert_close(g1[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(out4.losses) == 4
    assert out1.global_weight == out4.global_weight == float(valid_tokens(batch))
    # The bug this guards against: averaging microbatch means gives a different loss.
    naive = torch.stack(out4.losses).mean()
    assert abs(float(naive) - out4.loss) > 1e-2
    assert out4.loss == pytest.approx(out1.loss, rel=1e-5)
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-5, atol=1e-6, msg=name)
    w1, w4 = weights(ga1), weights(ga4)
    for name in w1:
        torch.testing.assert_close(w4[name], w1[name], rtol=1e-5, atol=1e-6, msg=name)


def test_step_loss_is_the_full_batch_token_mean(reference_weights):
    batch = make_lm_batch(8, 32, 256, seed=3, ignore_prefix=PREFIX)
    engine = build(reference_weights, microbatch_size=2)
    logits = engine.forward_batch(batch)
    reference = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )
    metrics = engine.train_batch(batch, cross_entropy_loss, valid_tokens)
    assert metrics["loss"] == pytest.approx(float(reference), rel=1e-5)
    assert metrics["num_tokens"] == float(valid_tokens(batch))
    assert set(metrics) == {"loss", "grad_norm", "lr", "num_tokens", "tokens_per_second",
                            "num_microbatches", "computed_tokens"}
    assert metrics["num_microbatches"] == 4 and metrics["computed_tokens"] == 8 * 32


@pytest.mark.parametrize("correction", ["none", "token_tis"])
def test_loss_metrics_are_full_batch_token_means_at_any_split(reference_weights, correction):
    from forge_ext.rl.losses.grpo import GRPOLoss, grpo_metrics, token_logprobs, valid_token_count

    batch = make_lm_batch(8, 32, 256, seed=5, ignore_prefix=PREFIX)
    reference = build(reference_weights)
    logits = reference.forward_batch(batch)
    g = torch.Generator().manual_seed(5)
    logprobs = token_logprobs(logits, batch["labels"])
    batch["generator_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    batch["ref_logprobs"] = logprobs + 0.2 * torch.randn(logprobs.shape, generator=g)
    batch["advantages"] = torch.randn(8, generator=g)
    coefs = {"clip_eps_high": 0.28, "kl_coef": 0.1, "off_policy_correction": correction,
             "tis_imp_ratio_cap": 1.2}
    expected = grpo_metrics(logits, batch, **coefs)
    loss_fn = GRPOLoss(GRPOLoss.Config(**coefs))
    for k in (1, 4):
        engine = build(reference_weights, gradient_accumulation_steps=k)
        out = engine.forward_backward_batch(engine.microbatches(batch), loss_fn, valid_token_count)
        assert set(out.metrics) == {"kl", "ratio_mean", "clip_fraction"} | (
            {"tis_weight_mean", "tis_capped_fraction"} if correction == "token_tis" else set()
        )
        for name, value in out.metrics.items():
            assert value == pytest.approx(expected[name], rel=1e-5), (k, name)
        assert out.loss == pytest.approx(expected["loss"], rel=1e-5)
        if k == 4:  # a mean of the microbatch means is a different number
            means = [loss_fn(logits[i : i + 2], {n: t[i : i + 2] for n, t in batch.items()})[1]
                     for i in range(0, 8, 2)]
            for name in ("kl", "tis_weight_mean") if correction == "token_tis" else ("kl",):
                naive = sum(float(m[name]) for m in means) / 4
                assert abs(naive - out.metrics[name]) > 1e-3 * abs(out.metrics[name]), name
    metrics = build(reference_weights).train_batch(batch, loss_fn, valid_token_count)
    assert metrics["loss/kl"] == pytest.approx(expected["kl"], rel=1e-5)


def test_every_grpo_variant_is_exact_under_gradient_accumulation(reference_weights):
    """GA=1 and GA=4 give the same gradient and the float64 reference's loss
    (tests/grpo_reference.py; its gradient w.r.t. the logits is checked in
    test_grpo_variants.py) for each aggregation and GSPO, on rows of very unequal length (one
    without a valid token), where the variants give different losses."""
    from grpo_reference import ENGINE_VARIANTS, grpo_targets, reference_kwargs, reference_loss

    from forge_ext.engine.core import split_batch
    from forge_ext.rl.losses.grpo import GRPOLoss

    batch = make_lm_batch(8, 32, 256, seed=7, ignore_prefix=PREFIX)
    # One engine: gradient accumulation is forward_backward_batch over the microbatches
    # (what engine.microbatches gives under gradient_accumulation_steps=k).
    engine = build(reference_weights)
    logits = engine.forward_batch(batch)
    batch.update(grpo_targets(logits, batch["labels"], seed=7))
    losses = []
    for variant in ENGINE_VARIANTS:
        expected = float(reference_loss(logits, batch, **reference_kwargs(variant, 0.1)))
        loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.1, **variant))
        results = {}
        for k in (1, 4):
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(split_batch(batch, k), loss_fn, loss_fn.weight)
            assert len(out.losses) == k
            assert out.loss == pytest.approx(expected, rel=1e-5), (variant, k)
            results[k] = grads(engine)
        for name, g in results[4].items():
            atol = 1e-5 * float(results[1][name].abs().max())
            torch.testing.assert_close(g, results[1][name], rtol=1e-4, atol=atol,
                                       msg=f"{variant} {name}")
        losses.append(expected)
    values = sorted(losses)
    assert all(b - a > 1e-3 * abs(b) for a, b in zip(values, values[1:])), losses


def test_eval_batch_is_the_token_mean_cross_entropy_at_any_split(reference_weights):
    batch = make_lm_batch(8, 32, 256, seed=4, ignore_prefix=PREFIX)
    # Reference: one cross entropy over every valid token of the batch, from the logits.
    logits = build(reference_weights).forward_batch(batch)
    reference = float(torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    ))
    for k in (1, 2, 4, 8):
        engine = build(reference_weights, gradient_accumulation_steps=k)
        loss = engine.eval_batch(batch, cross_entropy_loss, valid_tokens)
        assert loss == pytest.approx(reference, rel=1e-5), k


def test_forward_batch_does_not_depend_on_microbatches(reference_weights):
    batch = make_lm_batch(8, 32, 256, seed=5)
    a = build(reference_weights).forward_batch(batch)
    engine = build(reference_weights, microbatch_size=2)
    b = engine.forward_batch(batch)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert engine.forward is not None and engine.forward_batch(batch).shape == a.shape
    tails = engine.forward(batch, output_seqlens=[3] * 8)
    assert len(tails) == 8 and tails[0].shape == (3, 256)
    torch.testing.assert_close(tails[2], b[2, -3:], rtol=1e-5, atol=1e-5)


def test_infer_batch_gives_eval_batchs_loss_and_forward_batchs_outputs(reference_weights):
    """verl's ``infer_batch``: forward only, with an optional loss; ``eval_batch`` and
    ``forward_batch`` are its two halves, at any split."""
    batch = make_lm_batch(8, 32, 256, seed=4, ignore_prefix=PREFIX)
    logits = build(reference_weights).forward_batch(batch)
    reference = float(torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    ))
    engine = build(reference_weights, microbatch_size=2)
    out = engine.infer_batch(batch, cross_entropy_loss, valid_tokens)
    assert out.loss == pytest.approx(reference, rel=1e-5)
    assert out.global_weight == float(valid_tokens(batch))
    torch.testing.assert_close(out.outputs, logits, rtol=1e-5, atol=1e-5)
    assert engine.infer_batch(batch).loss is None
    assert engine.infer_batch(batch, cross_entropy_loss, valid_tokens,
                              return_outputs=False).outputs is None
    assert all(p.grad is None for p in engine.parameters())


def test_mode_contexts_switch_every_model_part_and_restore_on_exit(make):
    """verl's ``train_mode`` / ``eval_mode``: every model part switches, the innermost
    context wins, and leaving one restores what was there (also after an error)."""
    engine = make()
    training = lambda: [m.training for m in engine.model_modules()]  # noqa: E731
    assert training() == [True] and engine.mode is None
    with engine.eval_mode():
        assert training() == [False] and engine.mode == "eval"
        with engine.train_mode():
            assert training() == [True] and engine.mode == "train"
        assert training() == [False] and engine.mode == "eval"
    assert training() == [True] and engine.mode is None
    with pytest.raises(ValueError), engine.eval_mode():
        engine.infer_batch(make_lm_batch(3, 32, 256, seed=0))  # bad batch size
    assert training() == [True] and engine.mode is None
    # The verbs run in their mode: a post hook sees the model as the forward did.
    seen = []
    engine.forward_batch(make_lm_batch(8, 32, 256, seed=0),
                         post_hook=lambda logits, mb: seen.append(training()) or logits)
    assert seen == [[False]] and training() == [True]


def test_get_per_tensor_param_yields_hf_state_dict_one_gathered_tensor_at_a_time(
    make, monkeypatch
):
    """verl's ``get_per_tensor_param``: exactly ``hf_state_dict()``'s names, order and
    values, each gathered only when reached. Under FSDP over several ranks every gather
    allocates a full tensor; here (one rank, where most gathers are views) every gather
    is made to allocate, and the bytes of gathered tensors alive at once are measured from
    their storages' lifetimes while a consumer copies each tensor out and drops it."""
    import weakref

    from forge_ext.engine import model_weights

    engine = make()
    expected = {k: full(v).clone() for k, v in engine.hf_state_dict().items()}
    live, peak = [0], [0]

    def gather_allocating(t):
        copy = full(t).clone()
        nbytes = copy.untyped_storage().nbytes()
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(copy.untyped_storage(), lambda: live.__setitem__(0, live[0] - nbytes))
        return copy

    monkeypatch.setattr(model_weights, "_full", gather_allocating)
    tensors, adapter_config = engine.get_per_tensor_param()
    assert adapter_config is None
    names = []
    for name, tensor in tensors:
        names.append(name)
        assert torch.equal(tensor.clone(), expected[name]), name  # the consumer's copy
        del tensor
    assert names == list(expected)
    full_copy = sum(t.numel() * t.element_size() for t in expected.values())
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert 0 < peak[0] <= largest < full_copy / 4, (peak[0], largest, full_copy)
    # sharded=True: the tensors as held (what the weight publisher writes), no gather.
    monkeypatch.setattr(model_weights, "_full", lambda t: pytest.fail("gathered"))
    held = dict(engine.get_per_tensor_param(sharded=True)[0])
    assert list(held) == names and all(torch.equal(full(held[k]), expected[k]) for k in held)


def test_to_round_trips_parameters_gradients_and_optimizer_state_exactly(make, monkeypatch):
    """verl's ``to``: on this CPU-only machine the engine's device is the CPU, so ``to`` is
    the identity (nothing copied) even with both offloads on; then the offload path itself
    (every tensor copied to host memory and back, FSDP re-binding its shards) is forced and
    leaves parameters, gradients and Adam's state bit for bit, and the next step equal to
    that of an engine that never moved."""
    from forge_ext.engine import offload

    engine, twin = make(offload={"params": True, "optimizer": True}), make()
    assert engine.is_param_offload_enabled and engine.is_optimizer_offload_enabled
    assert not twin.is_param_offload_enabled and not twin.is_optimizer_offload_enabled
    batch = make_lm_batch(8, 32, 256, seed=2, ignore_prefix=PREFIX)
    for e in (engine, twin):
        e.train_batch(batch, cross_entropy_loss, valid_tokens)  # Adam state exists
        e.forward_backward_batch(e.microbatches(batch), cross_entropy_loss, valid_tokens)

    def snapshot():
        params = {n: (p, p.grad) for n, p in engine.model_parts[0].named_parameters()}
        state = {(n, k): v for n, p in engine.model_parts[0].named_parameters()
                 for k, v in engine.optimizers.optimizers[0].state[p].items()}
        return params, state

    def storage(t):
        return (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage().data_ptr()

    params, state = snapshot()
    values = {n: (full(p).clone(), full(g).clone()) for n, (p, g) in params.items()}
    state_values = {k: full(v).clone() for k, v in state.items()}
    storages = {n: storage(p) for n, (p, _) in params.items()}
    state_storages = {k: storage(v) for k, v in state.items()}
    assert len(state) == 3 * len(params)  # step, exp_avg, exp_avg_sq

    engine.to("cpu")
    engine.to(engine.device)
    assert {n: storage(p) for n, (p, _) in snapshot()[0].items()} == storages  # identity
    with pytest.raises(ValueError, match=r"to\(model=False, grad=True\)"):
        engine.to("cpu", model=False)
    engine.to("cpu", model=False, grad=False)  # the optimizer state alone (optimizer offload)
    engine.to(engine.device, model=False, grad=False)
    with pytest.raises(ValueError, match="device='meta'"):
        engine.to("meta")

    monkeypatch.setattr(offload, "same_place", lambda tensor, device: False)
    engine.to("cpu")
    engine.to(engine.device)
    monkeypatch.undo()
    params, state = snapshot()
    assert all(storage(p) != storages[n] for n, (p, _) in params.items())  # all copied
    assert all(storage(v) != state_storages[k] for k, v in state.items())
    for n, (p, g) in params.items():
        assert torch.equal(full(p), values[n][0]) and torch.equal(full(g), values[n][1]), n
    for k, v in state.items():
        assert v is not None and torch.equal(full(v), state_values[k]), k
    # The optimizer still holds these parameters and their moments: the next step is the
    # step of an engine that never moved.
    for e in (engine, twin):
        e.optimizer_step()
    w, w_twin = weights(engine), weights(twin)
    for k in w:
        assert torch.equal(w[k], w_twin[k]), k


def test_engine_registry_builds_the_configured_backend(reference_weights, monkeypatch):
    """``trainer.engine`` picks a class registered with ``EngineRegistry`` (verl's registry):
    ``titan`` by default, a second backend once registered; an unknown name is refused by
    the config check (before any spawn), naming the field."""
    from forge_ext.engine import MODEL_TYPE, EngineRegistry, build_engine

    assert EngineRegistry.backends() == ["hf", "titan"]
    assert type(build_engine(config())) is TitanEngine
    assert type(EngineRegistry.new(MODEL_TYPE, "titan", config())) is TitanEngine
    with pytest.raises(ValueError, match="trainer: engine='other' is not an engine backend "
                                         "for language_model \\(registered: hf, titan\\)"):
        build_engine({**config(), "engine": "other"})

    monkeypatch.setattr(EngineRegistry, "_engines",
                        {k: dict(v) for k, v in EngineRegistry._engines.items()})

    @EngineRegistry.register(MODEL_TYPE, ["other", "another"])
    class OtherEngine(TitanEngine):
        pass

    assert EngineRegistry.backends() == ["another", "hf", "other", "titan"]
    engine = build_engine({**config(), "engine": "other"})
    assert type(engine) is OtherEngine and engine.config.engine == "other"
    with pytest.raises(TypeError, match="not a BaseEngine"):
        EngineRegistry.register(MODEL_TYPE, "x")(object)


def test_checkpoint_round_trip(make, tmp_path):
    """A fresh engine loaded from step 2 takes step 3 exactly as the uninterrupted run did:
    same loss and grad norm (weights), same LR (scheduler state) and the same updated weights
    (Adam's moments, which only show in the update)."""
    ckpt = {"enable": True, "folder": "ckpt"}
    batches = [make_lm_batch(8, 32, 256, seed=s, ignore_prefix=PREFIX) for s in range(4)]
    # Few training steps: the linear LR decay moves the LR by 1/6 per step.
    training = {"microbatch_size": 4, "steps": 6}
    first = make(training, checkpoint=ckpt, dump_folder=str(tmp_path))
    for b in batches[:2]:
        first.train_batch(b, cross_entropy_loss, valid_tokens)
    first.save_checkpoint(first.step)
    expected = [first.train_batch(b, cross_entropy_loss, valid_tokens) for b in batches[2:]]
    expected_weights = weights(first)

    fresh = make(training, checkpoint=ckpt, dump_folder=str(tmp_path))
    assert fresh.load_checkpoint() == 2
    got = [fresh.train_batch(b, cross_entropy_loss, valid_tokens) for b in batches[2:]]
    for g, e in zip(got, expected):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == e[key], key
    assert len({BASE["optimizer"]["lr"], expected[0]["lr"], expected[1]["lr"]}) == 3  # LR moves
    got_weights = weights(fresh)
    for k in expected_weights:
        assert torch.equal(got_weights[k], expected_weights[k]), k


DP_BATCHES = [make_lm_batch(8, 32, 256, seed=s, ignore_prefix=PREFIX) for s in (10, 11, 12)]


@pytest.fixture(scope="module")
def dp2_results(hf_path, tmp_path_factory):
    """Both backends on two gloo processes (FSDP2 over both, GA 2, 4 rows a rank), one
    process pair for both (:mod:`engine_dp_worker`); the folder of their results."""
    import torch.multiprocessing as mp

    import engine_dp_worker
    from forge_ext.engine.distributed import free_port

    out = tmp_path_factory.mktemp("dp2")
    configs = {}
    for name in ("titan", "hf"):
        for lora in (False, True):
            c = backend_config(name, hf_path, local_batch_size=4,
                               gradient_accumulation_steps=2, steps=6)
            key = f"{name}-lora" if lora else name
            c.update(checkpoint={"enable": True, "folder": "ckpt"}, dump_folder=str(out / key))
            if lora:
                c["lora"] = {"rank": LORA_RANK}
            configs[key] = c
    mp.start_processes(engine_dp_worker.run, args=(2, free_port(), configs, DP_BATCHES,
                                                    str(out), dp_adapters(hf_path)),
                       nprocs=2, join=True, start_method="spawn")
    return out


LORA_RANK = 4


def dp_adapters(hf_path):
    """Random rank-4 adapters (B non-zero) in PEFT names on all seven projections of the
    checkpoint at ``hf_path``: the same on one process and on two."""
    from safetensors.torch import load_file

    from conftest import random_adapter
    from forge_ext.engine.schema import HF_TARGETS

    return random_adapter(load_file(f"{hf_path}/model.safetensors"), LORA_RANK,
                          targets=HF_TARGETS, seed=4)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])


def test_dp2_fsdp_equals_one_process_and_resumes_splits_and_exports_exactly(
    backend, make, dp2_results, hf_path, lora
):
    """Two ranks (FSDP2, gloo), GA 2 over 4 rows each, against one process over all 8 rows:
    the same loss, global weight, gradients, grad norm and updated weights, and the next step
    too. On the two ranks: a resume from the step-1 checkpoint takes step 2 bit for bit as
    the uninterrupted run; a token budget gives the fixed rows' loss and gradients; every
    rank's modules switch with the mode contexts; ``get_per_tensor_param`` yields exactly
    ``hf_state_dict``'s gathered tensors (DTensor shards with ``sharded=True``); full
    tensors load into the shards. With LoRA (the same adapters set on both) the same
    for the adapters, which are what ``get_per_tensor_param`` yields, gathered."""
    from conftest import assert_grad_close

    key = f"{backend}-lora" if lora else backend
    got = torch.load(dp2_results / f"{key}.pt")
    for rank in (0, 1):
        modes = torch.load(dp2_results / f"{key}-modes-{rank}.pt")
        assert modes == {"outside": [True], "train": [True], "eval": [False],
                         "after": [True]}, rank
    assert got["dp_size"] == 2

    # The linear decay over 6 steps: the LR moves per step.
    one = make({"steps": 6}, **({"lora": {"rank": LORA_RANK}} if lora else {}))
    if lora:
        one.load_adapter_state_dict(dp_adapters(hf_path))
    one.optimizer_zero_grad()
    fb = one.forward_backward_batch(one.microbatches(DP_BATCHES[0]), cross_entropy_loss,
                                    valid_tokens)
    want_grads = grads(one)
    want_norm = one.optimizer_step()
    one.lr_scheduler_step()
    step1 = got["step1"]
    assert step1["global_weight"] == fb.global_weight == float(valid_tokens(DP_BATCHES[0]))
    assert step1["loss"] == pytest.approx(fb.loss, rel=1e-5)
    assert step1["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
    assert set(step1["grads"]) == set(want_grads)
    for name, g in want_grads.items():
        assert_grad_close(step1["grads"][name], g, name)
    want_weights = {k: full(v) for k, v in one.hf_state_dict().items()}
    for name, w in want_weights.items():
        assert_grad_close(step1["weights"][name], w, name)
    want2 = one.train_batch(DP_BATCHES[1], cross_entropy_loss, valid_tokens)
    for key in ("loss", "grad_norm", "lr"):
        assert got["step2"][key] == pytest.approx(want2[key], rel=1e-5), key

    assert got["resumed_step"] == 1
    for key in ("loss", "grad_norm", "lr"):
        assert got["resumed"][key] == got["step2"][key], key
    for name, w in got["step2_weights"].items():
        assert torch.equal(got["resumed_weights"][name], w), name

    rows, budget = got["splits"]["rows"], got["splits"]["budget"]
    assert (rows["count"], budget["count"]) == (2, 4)
    assert budget["loss"] == pytest.approx(rows["loss"], rel=1e-5)
    for name, g in rows["grads"].items():
        assert_grad_close(budget["grads"][name], g, name)

    assert got["per_tensor"] == {
        # Under LoRA the adapters travel whole (small), sharded=True or not.
        "names": True, "equal": True, "sharded_types": ["Tensor" if lora else "DTensor"],
        "adapter_config": one.adapter_config() if lora else None}
    assert got["load_full"]


def keep_two_config(tmp_path):
    """The test config saving checkpoints under ``<tmp_path>/ckpt``, keeping the newest 2."""
    cfg = config()
    cfg.update(checkpoint={"enable": True, "folder": "ckpt", "keep_latest_k": 2},
               dump_folder=str(tmp_path))
    return cfg


def train_and_save(engine, steps):
    """``steps`` training steps, each saved as the checkpoint of its step."""
    batch = make_lm_batch(8, 32, 256, seed=0, ignore_prefix=PREFIX)
    for _ in range(steps):
        engine.train_batch(batch, cross_entropy_loss, valid_tokens)
        engine.save_checkpoint(engine.step)


def test_only_the_newest_keep_latest_k_checkpoints_remain(reference_weights, tmp_path):
    import os

    cfg = keep_two_config(tmp_path)
    engine = TitanEngine(cfg)
    train_and_save(engine, 4)
    engine.close()  # waits for torchtitan's background purge
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-3", "step-4"]
    assert TitanEngine(cfg).load_checkpoint() == 4


def test_a_crashed_save_never_counts_toward_keep_latest_k_and_is_never_loaded(
    reference_weights, tmp_path
):
    """A ``step-9`` left by a save that crashed (shard files, no ``.metadata``), newer than
    anything the run saves: torchtitan 0.3.0 kept it as one of the newest ``keep_latest_k: 2``
    and deleted ``step-2`` for it (issue 26). It is set aside under a name that says so, both
    complete checkpoints stay, and neither the latest-step load nor a load of step 9 reads it."""
    import os

    cfg = keep_two_config(tmp_path)
    crashed = tmp_path / "ckpt" / "step-9"
    crashed.mkdir(parents=True)
    (crashed / "__0_0.distcp").write_bytes(b"half a shard")
    engine = TitanEngine(cfg)
    assert engine.load_checkpoint() == 0  # nothing complete to resume from: a fresh start
    with pytest.raises(FileNotFoundError, match="step-9 is incomplete"):
        engine.load_checkpoint(9)
    train_and_save(engine, 3)
    engine.close()  # waits for torchtitan's background purge
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-2", "step-3", "step-9.incomplete"]
    assert os.listdir(tmp_path / "ckpt" / "step-9.incomplete") == ["__0_0.distcp"]
    resumed = TitanEngine(cfg)
    assert resumed.load_checkpoint() == 3
    assert resumed.load_checkpoint(2) == 2


def test_the_purge_counts_only_complete_checkpoints_by_itself(reference_weights, tmp_path):
    """The purge's own defence, without the set-aside before each save: torchtitan calls
    ``_purge_stale_checkpoints`` right after dispatching a save, and an async save still in
    flight (here ``step-3``: shard files, no ``.metadata`` yet) is an incomplete folder the
    set-aside leaves alone. With ``keep_latest_k: 2`` the two complete ones stay besides it
    (torchtitan 0.3.0 counted every ``step-N`` folder and deleted ``step-1``), and the
    in-flight folder is not touched."""
    import os

    engine = TitanEngine(keep_two_config(tmp_path))
    train_and_save(engine, 2)
    in_flight = tmp_path / "ckpt" / "step-3"
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"half a shard")
    engine.checkpointer._purge_stale_checkpoints()
    engine.close()  # waits for torchtitan's background purge
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-1", "step-2", "step-3"]
    assert os.listdir(in_flight) == ["__0_0.distcp"]


def test_checkpoint_steps_are_in_the_order_of_their_numbers_not_their_names(tmp_path):
    """``step-10`` is newer than ``step-9`` (by name it sorts first): the newest complete
    checkpoint (the one a run resumes from, the last one a full disk's message names) is the
    highest N, and the oldest ones (which ``keep_latest_k`` removes,
    forge_ext.engine.checkpoint) come first."""
    from forge_ext.engine.checkpoint import last_complete_checkpoint
    from forge_ext.engine.checkpoint_files import complete_checkpoint_steps

    for step in (9, 10, 2, 100, 11):
        (tmp_path / f"step-{step}").mkdir()
        if step != 100:  # step-100's save has not finished
            (tmp_path / f"step-{step}" / ".metadata").write_text("")
    (tmp_path / "step-12.incomplete").mkdir()
    (tmp_path / "step-12.incomplete" / ".metadata").write_text("")
    assert complete_checkpoint_steps(tmp_path) == [2, 9, 10, 11]
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "step-11")


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"training": {"local_batch_size": 6, "microbatch_size": 4}},
         "training.local_batch_size=6 is not a multiple of training.microbatch_size=4"),
        ({"training": {"local_batch_size": 6, "gradient_accumulation_steps": 4}},
         "training.gradient_accumulation_steps=4"),
        ({"model": {"flavor": "huge-typo"}}, "model.flavor='huge-typo'"),
        ({"model": {"name": "gpt9"}}, "model.name='gpt9'"),
        ({"training": {"microbatch": 2}}, "trainer.training.microbatch"),
        ({"training": {"seq_len": 100000}}, "training.seq_len=100000"),
        ({"optimizer": {"lr": "fast"}}, "trainer.optimizer.lr"),
    ],
)
def test_bad_config_names_the_field(mapping, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        engine_config_from_mapping(mapping)


def test_bad_batch_is_rejected_and_engine_stays_usable(reference_weights):
    engine = build(reference_weights, microbatch_size=2)
    good = make_lm_batch(8, 32, 256, seed=6)
    before = weights(engine)
    bad_batches = {
        "local_batch_size=8": make_lm_batch(6, 32, 256, seed=6),
        "dim 1 must equal the sequence length": {**good, "labels": good["labels"][:, :16]},
        r"batch\['input_ids'\] must be \[batch, seq\] int64": {
            **good, "input_ids": good["input_ids"].float()
        },
        r"batch\['advantages'\] must be a tensor with leading dim 8": {
            **good, "advantages": torch.ones(5)
        },
        "training.seq_len=64": make_lm_batch(8, 80, 256, seed=6),
    }
    for message, batch in bad_batches.items():
        with pytest.raises(ValueError, match=message):
            engine.train_batch(batch, cross_entropy_loss, valid_tokens)
    after = weights(engine)
    for k in before:
        assert torch.equal(before[k], after[k])
    metrics = engine.train_batch(good, cross_entropy_loss, valid_tokens)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and engine.step == 1


# Every config.json field the loader reads, none at the value a default would give: the
# tiny flavor's defaults (rope_theta 10000, rms_norm_eps 1e-6, head_dim = hidden / heads,
# 2 KV heads) would otherwise hide a field that is read wrong or not at all.
HF_ARCH = dict(
    vocab_size=192, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=1, head_dim=20, max_position_embeddings=128,
    rms_norm_eps=0.3, tie_word_embeddings=False,
)


@pytest.mark.parametrize("rope_theta_at", ["rope_parameters", "top_level"])
def test_hf_checkpoint_saved_by_transformers_loads_with_equal_logits(tmp_path, rope_theta_at):
    """A directory written by ``save_pretrained`` loads through ``model.flavor: hf`` and
    reproduces transformers' logits. transformers 5 writes ``rope_theta`` under
    ``rope_parameters``; older checkpoints have it at the top level of config.json."""
    import json

    from transformers import Qwen3Config, Qwen3ForCausalLM

    init_single_process_env()
    torch.manual_seed(0)
    hf_model = Qwen3ForCausalLM(Qwen3Config(
        **HF_ARCH, rope_parameters={"rope_type": "default", "rope_theta": 50.0},
        attn_implementation="sdpa",
    )).float().eval()
    with torch.no_grad():  # norm weights near 1: attention far from uniform, RoPE matters
        for name, p in hf_model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    hf_model.save_pretrained(tmp_path)
    if rope_theta_at == "top_level":
        path = tmp_path / "config.json"
        hf_config = json.loads(path.read_text())
        hf_config["rope_theta"] = hf_config.pop("rope_parameters")["rope_theta"]
        path.write_text(json.dumps(hf_config))
    engine = TitanEngine({"model": {"flavor": "hf", "hf_path": str(tmp_path)},
                          "training": {"local_batch_size": 2, "seq_len": 64}})
    batch = make_lm_batch(2, 48, HF_ARCH["vocab_size"], seed=9)
    with torch.no_grad():
        expected = hf_model(batch["input_ids"]).logits
    torch.testing.assert_close(engine.forward_batch(batch), expected, rtol=1e-4, atol=1e-4)


def _disk_engine(reference_weights, tmp_path):
    cfg = config()
    cfg.update(checkpoint={"enable": True, "folder": "ckpt"}, dump_folder=str(tmp_path))
    engine = TitanEngine(cfg)
    engine.load_model_state_dict(reference_weights)
    engine.train_batch(make_lm_batch(8, 32, 256, seed=0), cross_entropy_loss, valid_tokens)
    engine.save_checkpoint(engine.step)  # step-1
    return engine, cfg


def test_a_checkpoint_save_that_runs_out_of_space_is_one_line_naming_what_where_and_space(
    reference_weights, tmp_path, monkeypatch
):
    """Issue 26 (3): ENOSPC part-way through a save ends in one CheckpointWriteError line
    naming the step, the folder, the free and needed space and the last complete checkpoint;
    the half-written folder is gone and the last checkpoint still loads."""
    import errno
    import os

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from forge_ext.runtime.disk import CheckpointWriteError

    engine, cfg = _disk_engine(reference_weights, tmp_path)
    real_write_item, calls = dcp_fs._write_item, []

    def write_item(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # part-way: some items are on disk already
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    with pytest.raises(CheckpointWriteError) as raised:
        engine.save_checkpoint(2)
    monkeypatch.undo()
    message = str(raised.value)
    step1, step2 = str(tmp_path / "ckpt" / "step-1"), str(tmp_path / "ckpt" / "step-2")
    assert "\n" not in message and raised.value.__cause__ is None
    assert f"writing checkpoint step 2 to {step2} failed: ENOSPC" in message
    assert " MiB free, " in message and "MiB needed (the last checkpoint's size)" in message
    assert message.endswith(f"last complete checkpoint: {step1}")
    assert raised.value.errno == errno.ENOSPC and raised.value.needed_bytes > 0
    assert not os.path.exists(step2)
    assert TitanEngine(cfg).load_checkpoint() == 1


def test_a_save_with_measurably_too_little_free_space_is_refused_before_writing(
    reference_weights, tmp_path, monkeypatch
):
    import os
    import shutil

    from forge_ext.runtime import disk

    engine, _ = _disk_engine(reference_weights, tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    with pytest.raises(disk.CheckpointWriteError, match=(
        r"not writing checkpoint step 2 to .*step-2: 1.0 MiB free on its filesystem, "
        r"[0-9.]+ MiB needed \(the last checkpoint's size\).*last complete checkpoint: .*step-1$"
    )):
        engine.save_checkpoint(2)
    assert not os.path.exists(tmp_path / "ckpt" / "step-2")


def value_head_engine(**training) -> TitanEngine:
    c = config(**training)
    c["model"]["value_head"] = True
    return TitanEngine(c)


def test_value_head_is_exact_under_gradient_accumulation():
    """A critic (``model.value_head``) trains on the clipped value loss through the same
    microbatch core: GA=4 gives GA=1's loss and gradient, and both equal plain autograd of
    the value loss written out over the whole batch (no microbatches, no loss weights)."""
    from forge_ext.engine.core import split_batch
    from forge_ext.rl.losses.value import ValueLoss

    init_single_process_env()
    engine = value_head_engine()
    weights_ = random_state_dict(engine.model_state_dict(), seed=11, std=0.1)
    engine.load_model_state_dict(weights_)
    batch = make_lm_batch(8, 32, 256, seed=11, ignore_prefix=PREFIX)
    values = engine.forward_batch(batch)
    assert values.shape == (8, 32, 1)
    g = torch.Generator().manual_seed(11)
    batch["old_values"] = values[..., 0] + 0.5 * torch.randn(8, 32, generator=g)
    batch["returns"] = torch.randn(8, 32, generator=g)
    loss_fn = ValueLoss(ValueLoss.Config(clip_value=0.2))
    results = {}
    for k in (1, 4):
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(split_batch(batch, k), loss_fn, loss_fn.weight)
        results[k] = (out, grads(engine))
    engine.optimizer_zero_grad()
    v = engine.model_parts[0](batch["input_ids"])[..., 0]
    valid = batch["labels"] != -100
    old, ret = batch["old_values"], batch["returns"]
    clipped = old + (v - old).clamp(-0.2, 0.2)
    token = 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    reference = token[valid].mean()
    reference.backward()
    want = grads(engine)
    assert 0 < results[4][0].metrics["clip_fraction"] < 1
    for k, (out, got) in results.items():
        assert out.loss == pytest.approx(float(reference), rel=1e-5), k
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4,
                                       atol=1e-5 * float(want[name].abs().max()), msg=name)


def test_value_head_reads_a_classifier_score_and_starts_at_zero_on_a_causal_lm(tmp_path):
    """``model.value_head`` on transformers' ``Qwen3ForSequenceClassification`` (num_labels
    1) reproduces its per-position scores (``score.weight`` read, exported under that name);
    on a causal LM checkpoint it reads the trunk only and its head starts at zero."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    init_single_process_env()
    torch.manual_seed(0)
    arch = Qwen3Config(**HF_ARCH, num_labels=1, pad_token_id=0, attn_implementation="sdpa")
    classifier = Qwen3ForSequenceClassification(arch).float().eval()
    with torch.no_grad():
        for name, p in classifier.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    classifier.save_pretrained(tmp_path / "rm")
    engine = TitanEngine({"model": {"flavor": "hf", "hf_path": str(tmp_path / "rm"),
                                    "value_head": True},
                          "training": {"local_batch_size": 2, "seq_len": 64}})
    batch = make_lm_batch(2, 48, HF_ARCH["vocab_size"], seed=9)
    batch["input_ids"].clamp_(min=1)  # no pad id inside: HF scores the last token
    with torch.no_grad():
        hidden = classifier.model(batch["input_ids"]).last_hidden_state
        expected = classifier.score(hidden)
        last = classifier(batch["input_ids"]).logits
    got = engine.forward_batch(batch)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:, -1], last, rtol=1e-4, atol=1e-4)
    exported = engine.hf_state_dict()
    assert "score.weight" in exported and "lm_head.weight" not in exported
    torch.testing.assert_close(full(exported["score.weight"]), classifier.score.weight)

    causal = Qwen3ForCausalLM(Qwen3Config(**HF_ARCH)).float()
    causal.model.load_state_dict(classifier.model.state_dict())
    causal.save_pretrained(tmp_path / "lm")
    critic = TitanEngine({"model": {"flavor": "hf", "hf_path": str(tmp_path / "lm"),
                                    "value_head": True},
                          "training": {"local_batch_size": 2, "seq_len": 64}})
    assert (critic.forward_batch(batch) == 0).all()
    trunk = {k: full(v) for k, v in critic.hf_state_dict().items() if k != "score.weight"}
    for k, v in trunk.items():
        torch.testing.assert_close(v, classifier.state_dict()[k], msg=k)


def _tiny_hf_checkpoint(path, model_type="qwen3"):
    """A small transformers checkpoint with random weights (norms near 1, so attention is far
    from uniform) written by ``save_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(HF_ARCH, rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    if model_type == "qwen2":
        fields.pop("head_dim")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


def test_hf_engine_trains_like_the_titan_engine_at_any_gradient_accumulation(tmp_path):
    """``trainer.engine: hf`` (transformers' own module) on a Qwen3 checkpoint that the titan
    engine also reads: the same microbatch core gives the same loss, grad norm and updated
    weights, whatever the split (rows of very unequal valid-token counts)."""
    from forge_ext.engine import build_engine
    from forge_ext.engine.hf import HFEngine

    init_single_process_env()
    path = _tiny_hf_checkpoint(tmp_path / "qwen3")
    common = {"model": {"hf_path": path},
              "training": {"local_batch_size": 8, "seq_len": 64, "max_norm": 1.0},
              "optimizer": {"lr": 1e-2, "eps": 1e-3}}
    titan = TitanEngine({**common, "model": {"flavor": "hf", "hf_path": path}})
    engines = {k: build_engine({**common, "engine": "hf", "training": {
        **common["training"], "gradient_accumulation_steps": k}}) for k in (1, 4)}
    assert all(type(e) is HFEngine for e in engines.values())
    batches = [make_lm_batch(8, 32, HF_ARCH["vocab_size"], seed=s, ignore_prefix=PREFIX)
               for s in (0, 1)]
    torch.testing.assert_close(engines[4].forward_batch(batches[0]),
                               titan.forward_batch(batches[0]), rtol=1e-4, atol=1e-4)
    for batch in batches:
        want = titan.train_batch(batch, cross_entropy_loss, valid_tokens)
        for k, engine in engines.items():
            got = engine.train_batch(batch, cross_entropy_loss, valid_tokens)
            assert got["num_microbatches"] == k
            for key in ("loss", "grad_norm", "lr", "num_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-4), (k, key)
    want = {k: full(v) for k, v in titan.hf_state_dict().items()}
    for k, engine in engines.items():
        got = dict(engine.get_per_tensor_param()[0])
        assert set(got) >= set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5,
                                       msg=f"{k} {name}")


def test_hf_engine_exports_a_folder_transformers_loads_with_its_logits(tmp_path):
    """The hf backend (no device mesh) writes its trained weights as an HF folder, as a GRPO
    run's last step does: transformers loads it with the engine's own logits (fp32)."""
    from transformers import AutoModelForCausalLM

    from forge_ext.engine import build_engine

    init_single_process_env()
    path = _tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    engine = build_engine({"engine": "hf", "model": {"hf_path": path},
                           "training": {"local_batch_size": 8, "seq_len": 64},
                           "optimizer": {"lr": 1e-2}})
    batch = make_lm_batch(8, 32, HF_ARCH["vocab_size"], seed=0, ignore_prefix=PREFIX)
    engine.train_batch(batch, cross_entropy_loss, valid_tokens)  # weights moved from the start
    info = engine.export_hf(tmp_path / "out")
    assert info["files"] == 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    torch.testing.assert_close(logits, engine.forward_batch(batch), rtol=1e-5, atol=1e-5)


def test_hf_engine_trains_a_family_torchtitan_lacks_and_refuses_what_it_cannot_do(tmp_path):
    """A Qwen2 checkpoint (q/k/v biases: the titan engine refuses it) trains with the hf
    engine: the loss falls. Tensor, pipeline and context parallelism, replication, a value
    head and a data-parallel degree other than the world size are refused, naming the
    field: the config ones when it is read, before anything is spawned."""
    from forge_ext.engine import build_engine

    init_single_process_env()
    path = _tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    cfg = {"engine": "hf", "model": {"hf_path": path},
           "training": {"local_batch_size": 8, "seq_len": 64, "microbatch_size": 4},
           "optimizer": {"lr": 1e-2}}
    with pytest.raises(ValueError, match="model_type='qwen2'"):
        engine_config_from_mapping({**cfg, "engine": "titan"})
    engine = build_engine(cfg)
    batch = make_lm_batch(8, 32, HF_ARCH["vocab_size"], seed=0, ignore_prefix=PREFIX)
    losses = [engine.train_batch(batch, cross_entropy_loss, valid_tokens)["loss"]
              for _ in range(4)]
    assert losses[-1] < 0.9 * losses[0], losses
    for change, message in (
        ({"parallelism": {"pipeline_parallel_degree": 2}},
         "engine=hf does not support parallelism.pipeline_parallel_degree=2"),
        ({"parallelism": {"tensor_parallel_degree": 2}},
         "engine=hf does not support parallelism.tensor_parallel_degree=2"),
        ({"parallelism": {"context_parallel_degree": 2}},
         "engine=hf does not support parallelism.context_parallel_degree=2"),
        ({"parallelism": {"data_parallel_replicate_degree": 2}},
         "engine=hf does not support parallelism.data_parallel_replicate_degree=2"),
        ({"model": {"hf_path": path, "value_head": True}},
         "engine=hf does not support model.value_head"),
        ({"lora": {"rank": 0}}, "lora.rank=0 must be an integer >= 1"),
        ({"training": {"local_batch_size": 8, "packing": True}},
         "training.packing=true needs training.max_tokens_per_microbatch"),
        ({"model": {}}, "engine=hf needs model.hf_path"),
    ):
        with pytest.raises(ValueError, match=f"trainer: {re.escape(message)}"):
            engine_config_from_mapping({**cfg, **change})
    # Data parallelism is FSDP over every process: num_procs sets the degree.
    from forge_ext.engine.schema import world_size_of

    assert world_size_of(engine_config_from_mapping(cfg), None) == 1
    assert world_size_of(engine_config_from_mapping(cfg), 2) == 2
    with pytest.raises(ValueError, match="data_parallel_shard_degree=2 does not fit world "
                                         "size 1: engine=hf shards over all ranks"):
        build_engine({**cfg, "parallelism": {"data_parallel_shard_degree": 2}})
