"""Token-budget microbatches and packing (``training.max_tokens_per_microbatch``,
``training.packing``): the same loss, metrics and gradients as fixed-row microbatches of the
same batch, packed sequences computed as if alone, bad budgets refused naming the field.
DP=2 on real procs is in test_trainer_actor.py."""

import copy

import pytest
import torch
from conftest import assert_grad_close, full, random_state_dict

from forge_ext.engine import TitanEngine, build_engine, cross_entropy_loss
from forge_ext.engine import engine_config_from_mapping
from forge_ext.engine import microbatch as tb
from forge_ext.engine import valid_tokens
from forge_ext.engine.distributed import init_single_process_env
from forge_ext.rl.losses.grpo import GRPOLoss, token_logprobs, valid_token_count

BASE = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": 8, "seq_len": 96, "max_norm": 1.0e6},
}
BUDGET = 40
# (prompt, response) lengths: one row longer than the budget (64 tokens), one whose response
# is all masked (no valid token), the rest very unequal.
SHAPES = [(6, 58), (3, 2), (10, 20), (4, 1), (5, 0), (2, 9), (8, 30), (3, 5)]


def lm_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded GRPO-shaped rows: labels only on the response (the episode layout)."""
    g = torch.Generator().manual_seed(seed)
    seq = max(p + r for p, r in SHAPES) + 3  # trailing padding on every row
    ids = torch.randint(1, 256, (len(SHAPES), seq), generator=g)
    labels = torch.full_like(ids, -100)
    for row, (p, r) in enumerate(SHAPES):
        ids[row, p + r :] = 0
        labels[row, p - 1 : p + r - 1] = ids[row, p : p + r]
    return {"input_ids": ids, "labels": labels}


@pytest.fixture(scope="module", params=["titan", "hf"])
def engine(request, tmp_path_factory):
    """The tiny flavor with random weights on each engine backend: ``titan``, and ``hf``
    (transformers' module) loading the same weights from the titan engine's export."""
    init_single_process_env()
    e = TitanEngine(copy.deepcopy(BASE))
    e.load_model_state_dict(random_state_dict(e.model_state_dict(), seed=3))
    if request.param == "titan":
        return e
    folder = e.export_hf(tmp_path_factory.mktemp("budget_hf") / "ckpt")["folder"]
    return build_engine({**copy.deepcopy(BASE), "engine": "hf",
                         "model": {"flavor": "hf", "hf_path": folder}})


@pytest.fixture
def split(engine):
    """``split(mode)`` sets the engine's microbatching: ``rows`` (one fixed-row microbatch),
    ``budget`` or ``packing``; restored after the test."""
    t = engine.config.training

    def set_mode(mode: str, multiple: int = 1) -> None:
        t.max_tokens_per_microbatch = None if mode == "rows" else BUDGET
        t.packing = mode == "packing"
        t.pad_to_multiple_of = multiple

    yield set_mode
    set_mode("rows")


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: full(p.grad).clone() for n, p in engine.model_parts[0].named_parameters()}


def label_logprobs(logits, mb):
    return token_logprobs(logits, mb["labels"])


def step(engine, batch, loss_fn, weight_fn, extra=()):
    engine.optimizer_zero_grad()
    microbatches = engine.microbatches(batch) + list(extra)
    out = engine.forward_backward_batch(microbatches, loss_fn, weight_fn)
    return out, grads(engine), microbatches


def grpo_batch(engine, split) -> dict[str, torch.Tensor]:
    batch = lm_batch(seed=1)
    split("rows")
    logprobs = engine.forward_batch(batch, post_hook=label_logprobs)
    g = torch.Generator().manual_seed(2)
    batch["generator_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    batch["ref_logprobs"] = logprobs + 0.2 * torch.randn(logprobs.shape, generator=g)
    batch["advantages"] = torch.randn(len(SHAPES), generator=g)
    return batch


# ---- the plans ------------------------------------------------------------------------------
def test_a_token_budget_plan_keeps_every_row_once_and_the_padded_size_within_the_budget():
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 90, (200,), generator=g)]
    lengths[7] = 0
    for multiple in (1, 8):
        groups = tb.plan_token_budget(lengths, BUDGET, multiple)
        rows = sorted(i for g in groups for i in g)
        assert rows == [i for i, n in enumerate(lengths) if n > 0]
        for g in groups:
            width = tb.round_up(max(lengths[i] for i in g), multiple)
            assert len(g) == 1 or len(g) * width <= BUDGET, (g, [lengths[i] for i in g])
        bins = tb.plan_packing(lengths, BUDGET, multiple)
        assert sorted(i for b in bins for i in b) == rows
        for b in bins:
            total = sum(lengths[i] for i in b)
            assert len(b) == 1 or tb.round_up(total, multiple) <= BUDGET
    # Splitting toward another rank's count keeps every row; an unsplittable plan gets empty
    # (padding) microbatches.
    groups = tb.plan_token_budget(lengths, BUDGET)
    more = tb.equalize(groups, len(groups) + 5, lengths)
    assert len(more) == len(groups) + 5 and sorted(sum(more, [])) == sorted(sum(groups, []))
    assert tb.equalize([[3]], 3, lengths) == [[3], [], []]


def test_rows_are_balanced_across_ranks_by_tokens_not_by_count():
    lengths = [400] * 4 + [20] * 4  # the first half 20x longer, as a count split would send
    ranks = tb.balance_rows(lengths, 2)
    sums = [sum(lengths[i] for i in r) for r in ranks]
    assert sorted(sum(ranks, [])) == list(range(8))
    assert sums == [840, 840]
    assert sum(lengths[:4]) / sum(lengths[4:]) == 20  # what a count split gives


# ---- exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["budget", "packing"])
def test_token_budget_and_packing_give_the_fixed_row_loss_metrics_and_gradients(
    engine, split, mode
):
    batch = grpo_batch(engine, split)
    loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.1, clip_eps_high=0.28))
    split("rows")
    ref, g_ref, _ = step(engine, batch, loss_fn, valid_token_count)
    split(mode, multiple=8)
    lengths = tb.row_lengths(batch).tolist()
    # A padding microbatch (no valid token), as a rank with fewer microbatches runs.
    empty = tb.packed_microbatch if mode == "packing" else tb.padded_microbatch
    out, g, mbs = step(engine, batch, loss_fn, valid_token_count,
                       extra=[empty(batch, [], lengths, 8)])
    assert len(mbs) > 3 and any(len(mb.rows) > 1 for mb in mbs[:-1])
    assert max(mb["input_ids"].numel() for mb in mbs if len(mb.rows) > 1) <= BUDGET
    assert any(mb["input_ids"].shape[1] > BUDGET for mb in mbs)  # the 64-token row, alone
    assert tb.count_tokens(mbs) < batch["input_ids"].numel()
    assert out.global_weight == ref.global_weight == float(valid_tokens(batch))
    assert out.loss == pytest.approx(ref.loss, rel=1e-5)
    for name in ref.metrics:
        assert out.metrics[name] == pytest.approx(ref.metrics[name], rel=1e-5), name
    for name in g_ref:
        assert_grad_close(g[name], g_ref[name], name)


def test_every_grpo_variant_under_packing_gives_the_fixed_row_loss_and_gradients(
    engine, split
):
    """The sequence-level aggregations and GSPO on packed rows (several sequences per row,
    grouped by ``sequence_ids``; one row without a valid token; truncated rows masked) give
    the fixed-row loss, sequence count and gradients."""
    from grpo_reference import ENGINE_VARIANTS

    batch = grpo_batch(engine, split)
    batch["truncated"] = torch.tensor([False, False, True, False, False, False, False, True])
    for variant in ENGINE_VARIANTS[1:]:  # token_mean is the test above
        loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.1, mask_truncated=True, **variant))
        split("rows")
        ref, g_ref, _ = step(engine, batch, loss_fn, loss_fn.weight)
        split("packing", multiple=8)
        out, g, mbs = step(engine, batch, loss_fn, loss_fn.weight)
        assert any(len(mb.rows) > 1 for mb in mbs)  # rows holding several sequences
        assert out.global_weight == ref.global_weight == 5.0, variant  # 8 - empty - 2 cut
        assert out.loss == pytest.approx(ref.loss, rel=1e-5), variant
        for name in g_ref:
            assert_grad_close(g[name], g_ref[name], name)


def test_cross_entropy_train_and_eval_are_split_independent(engine, split):
    batch = lm_batch(seed=4)
    split("rows")
    ref = engine.eval_batch(batch, cross_entropy_loss, valid_tokens)
    _, g_ref, _ = step(engine, batch, cross_entropy_loss, valid_tokens)
    for mode in ("budget", "packing"):
        split(mode)
        assert engine.eval_batch(batch, cross_entropy_loss, valid_tokens) == pytest.approx(
            ref, rel=1e-5
        )
        _, g, _ = step(engine, batch, cross_entropy_loss, valid_tokens)
        for name in g_ref:
            assert_grad_close(g[name], g_ref[name], name)


def test_packed_sequences_have_the_logits_of_each_sequence_run_alone(engine, split):
    batch = lm_batch(seed=5)
    split("packing", multiple=8)
    mbs = engine.microbatches(batch)
    packed = next(mb for mb in mbs if len(mb.rows) >= 3)
    positions = packed["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist()
    assert starts[: len(packed.rows)] == [0, *torch.tensor(packed.lengths).cumsum(0)[:-1].tolist()]
    with torch.no_grad():
        logits = engine._model_forward(engine.model_parts[0], packed)
        offset = 0
        for row, n in zip(packed.rows, packed.lengths):
            alone = engine._model_forward(engine.model_parts[0],
                                          {"input_ids": batch["input_ids"][row : row + 1, :n]})
            torch.testing.assert_close(logits[0, offset : offset + n], alone[0], rtol=1e-5,
                                       atol=1e-5)
            offset += n


@pytest.mark.parametrize("mode", ["budget", "packing"])
def test_forward_batch_puts_every_row_back_in_place(engine, split, mode):
    """The fixed-row log-probs exactly where a label is valid, zero elsewhere (an ignored
    label's log-prob), rows in the batch's order although microbatches regroup them."""
    batch = lm_batch(seed=6)
    split(mode)
    got = engine.forward_batch(batch, post_hook=label_logprobs)
    split("rows")
    want = engine.forward_batch(batch, post_hook=label_logprobs)
    assert got.shape == want.shape == batch["input_ids"].shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- bad budgets ----------------------------------------------------------------------------
@pytest.mark.parametrize("training, message", [
    ({"max_tokens_per_microbatch": 0}, "training.max_tokens_per_microbatch=0"),
    ({"max_tokens_per_microbatch": 4, "pad_to_multiple_of": 8},
     "training.max_tokens_per_microbatch=4 must be >= training.pad_to_multiple_of=8"),
    ({"packing": True}, "training.packing=true needs training.max_tokens_per_microbatch"),
    ({"pad_to_multiple_of": 0}, "training.pad_to_multiple_of=0"),
    ({"max_tokens_per_microbatch": 64, "microbatch_size": 2},
     "set only one of training.microbatch_size=2 and training.max_tokens_per_microbatch=64"),
])
def test_bad_token_budgets_are_refused_naming_the_field(training, message):
    mapping = copy.deepcopy(BASE)
    mapping["training"].update(training)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        engine_config_from_mapping(mapping)


def test_a_token_budget_under_pipeline_parallelism_is_refused():
    mapping = copy.deepcopy(BASE)
    mapping["training"].update(max_tokens_per_microbatch=64, packing=True)
    mapping["parallelism"] = {"pipeline_parallel_degree": 2}
    with pytest.raises(ValueError, match="pipeline parallelism"):
        engine_config_from_mapping(mapping)
