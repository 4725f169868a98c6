"""The train-inference mismatch figures (forge_ext.rl.mismatch) against an independent float64
computation written from verl's ``compute_offpolicy_metrics`` one token at a time, the
step's split by policy age and replica, the gate (loop.max_mismatch_kl) and the step line.
The runs that measure it end to end (fp32 both sides: every figure below 1e-5; a weight left
out of the push: the gate stops the run) are in tests/test_grpo_app.py and tests/test_vllm.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from forge_ext.rl.loop import LoopConfig, MismatchError, RLLoop
from forge_ext.rl.episode import Episode, pack_episodes
from forge_ext.rl.mismatch import NAMES, Probe, mismatch_figures, probe_rows, step_mismatch
from forge_ext.rl.report import _mismatch_parts


def reference_figures(trainer, generator, labels, band=2.0):
    """Plain loops over the valid tokens, float64 from Python floats."""
    diffs, per_sequence = [], []
    for b in range(labels.shape[0]):
        row = [(float(trainer[b, t]), float(generator[b, t]))
               for t in range(labels.shape[1]) if int(labels[b, t]) != -100]
        if not row:
            continue
        diffs += [tr - ge for tr, ge in row]
        per_sequence.append(sum(ge for _, ge in row) / len(row)
                            - sum(tr for tr, _ in row) / len(row))
    n = len(diffs)
    return {
        "k3_kl": sum(math.exp(d) - d - 1 for d in diffs) / n,
        "abs_diff_mean": sum(abs(d) for d in diffs) / n,
        "abs_diff_max": max(abs(d) for d in diffs),
        "log_ppl_diff": sum(per_sequence) / len(per_sequence),
        "ratio_outside_band": sum(abs(d) > math.log(band) for d in diffs) / n,
        "tokens": float(n),
    }


def batch(seed=0, rows=4, seq=9, noise=0.5):
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((rows, seq), -100)
    for b, n in enumerate((3, 0, 6, 2)[:rows]):
        labels[b, seq - 1 - n: seq - 1] = 1
    valid = labels != -100
    trainer = torch.where(valid, -torch.rand(rows, seq, generator=g) * 3, 0.0)
    generator = trainer + noise * torch.randn(rows, seq, generator=g)
    # What is not a sampled token is never read (padding may hold anything).
    return trainer, {"labels": labels, "generator_logprobs": torch.where(valid, generator, math.nan)}


def test_figures_match_an_independent_per_token_computation():
    trainer, packed = batch()
    ours = mismatch_figures(trainer, packed["generator_logprobs"], packed["labels"] != -100)
    expected = reference_figures(trainer, packed["generator_logprobs"], packed["labels"])
    assert set(ours) == set(NAMES)
    for name in NAMES:
        assert ours[name] == pytest.approx(expected[name], rel=1e-12), name
    assert 0 < ours["ratio_outside_band"] < 1  # not vacuous
    # No gap: every figure is exactly 0.
    same = mismatch_figures(trainer, trainer, packed["labels"] != -100)
    assert all(same[name] == 0.0 for name in NAMES if name != "tokens")


def test_the_step_measures_mismatch_on_the_trainers_own_version_and_per_replica():
    trainer, packed = batch(seed=1)
    labels = packed["labels"]
    # Rows 0 and 2 were sampled by the trainer's version 5 (on replicas 0 and 1), row 3 by
    # version 4 (age 1: its gap mixes one update with the mismatch), row 1 has no token.
    out = step_mismatch(trainer, packed, versions=[5, 5, 5, 4], replicas=[0, 1, 1, 0],
                        trainer_version=5, num_replicas=2)

    def only(rows):
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[rows] = True
        return reference_figures(trainer, packed["generator_logprobs"],
                                 torch.where(keep, labels, -100))

    for name, expected in (("mismatch", only([0, 1, 2])), ("offpolicy", only([0, 1, 2, 3])),
                           ("mismatch/replica0", only([0])), ("mismatch/replica1", only([2]))):
        for figure in NAMES:
            assert out[f"{name}/{figure}"] == pytest.approx(expected[figure], rel=1e-12)
    # A step without a sample of the trainer's version: no figure, and tokens 0.
    stale = step_mismatch(trainer, packed, versions=[4] * 4, replicas=[0] * 4, trainer_version=5)
    assert stale["mismatch/tokens"] == 0 and math.isnan(stale["mismatch/k3_kl"])
    assert "mismatch/replica0/k3_kl" not in stale and stale["offpolicy/tokens"] == 11


def test_the_probe_picks_stale_rows_only_to_make_up_the_sequences_measured_per_step():
    stale = dict(trainer_version=5)
    assert probe_rows([4, 4, 4, 4], sequences=2, **stale) == [0, 2]  # spread over them
    assert probe_rows([4, 5, 4, 4], sequences=3, **stale) == [0, 2]  # the age-0 row counts
    assert probe_rows([5, 5, 4, 4], sequences=2, **stale) == []  # enough measured for free
    assert probe_rows([4, 3], sequences=8, **stale) == [0, 1]  # all there are
    assert probe_rows([4, 4, 4], sequences=0, **stale) == []  # 0: no probe
    with pytest.raises(ValueError, match="loop.mismatch_probe_sequences=-1"):
        LoopConfig(steps=1, mismatch_probe_sequences=-1)


def test_a_stale_step_is_measured_on_the_rows_the_generator_scored_at_the_trainers_version():
    g = torch.Generator().manual_seed(3)
    # (prompt tokens, response tokens, version, replica): the trainer is at version 5.
    shapes = ((2, 3, 4, 0), (4, 2, 4, 1), (1, 5, 4, 1), (3, 1, 5, 0))
    episodes = [Episode(prompt_ids=[1] * p, response_ids=list(range(6, 6 + r)),
                        generator_logprobs=-torch.rand(r, generator=g), advantage=0.0,
                        policy_version=v, replica=rep) for p, r, v, rep in shapes]
    packed = pack_episodes(episodes, pad_id=0)
    labels = packed["labels"]
    valid = labels != -100
    trainer = torch.where(valid, packed["generator_logprobs"] + 0.3 * torch.randn(
        labels.shape, generator=g), 0.0)
    # Rows 0 and 2 scored at version 5 (row 1 was asked for too, its replica was elsewhere).
    scores = {r: (-torch.rand(shapes[r][1], generator=g)).tolist() for r in (0, 2)}
    out = step_mismatch(trainer, packed, versions=[4, 4, 4, 5], replicas=[0, 1, 1, 0],
                        trainer_version=5, num_replicas=2,
                        probe=Probe.of(episodes, scores, labels.shape[1], skipped=1))
    # The generator's side, placed by the labels' own order (not by prompt lengths).
    same = packed["generator_logprobs"].clone()
    for row, values in scores.items():
        same[row, valid[row]] = torch.tensor(values)

    def only(rows, generator=same):
        keep = torch.zeros_like(valid)
        keep[rows] = True
        return reference_figures(trainer, generator, torch.where(keep, labels, -100))

    for name, expected in (("mismatch", only([0, 2, 3])), ("mismatch/replica0", only([0, 3])),
                           ("mismatch/replica1", only([2])),
                           ("offpolicy", only([0, 1, 2, 3], packed["generator_logprobs"]))):
        for figure in NAMES:
            assert out[f"{name}/{figure}"] == pytest.approx(expected[figure], rel=1e-12), (
                name, figure)
    assert out["mismatch/probed_sequences"] == 2 and out["mismatch/probe_skipped"] == 1
    with pytest.raises(ValueError, match="row 0: 2 scores for 3 response tokens"):
        Probe.of(episodes, {0: [0.0, 0.0]}, labels.shape[1])


def gate(max_kl):
    return SimpleNamespace(loop=LoopConfig(steps=3, max_mismatch_kl=max_kl))


def test_the_gate_stops_above_max_mismatch_kl_naming_the_figure_step_and_causes():
    metrics = {"mismatch/k3_kl": 0.02, "mismatch/abs_diff_max": 1.5, "mismatch/tokens": 40,
               "mismatch/replica0/k3_kl": 1e-7, "mismatch/replica1/k3_kl": 0.04}
    with pytest.raises(MismatchError) as error:
        RLLoop.check_mismatch(gate(1e-3), metrics, 7)
    message = str(error.value)
    assert "\n" not in message
    for part in ("step 7", "mismatch/k3_kl=0.02", "loop.max_mismatch_kl=0.001", "replica1",
                 "dtype", "did not load", "tokenizer"):
        assert part in message
    assert "replica0" not in message and "scored by the generator" not in message
    with pytest.raises(MismatchError, match=r"over 40 tokens, 3 stale samples scored by the "
                       r"generator at the trainer's version; replica1\)"):
        RLLoop.check_mismatch(gate(1e-3), {**metrics, "mismatch/probed_sequences": 3.0}, 7)
    RLLoop.check_mismatch(gate(None), metrics, 7)  # unset: never
    RLLoop.check_mismatch(gate(0.05), metrics, 7)  # below
    RLLoop.check_mismatch(gate(1e-3), {"mismatch/k3_kl": math.nan}, 7)  # no own-version sample
    with pytest.raises(ValueError, match="loop.max_mismatch_kl=0"):
        LoopConfig(steps=1, max_mismatch_kl=0)


def test_the_step_line_shows_the_mismatch_only_above_its_threshold():
    trainer, packed = batch(seed=2)
    big = step_mismatch(trainer, packed, versions=[0, 0, 0, 0], replicas=[0, 1, 0, 1],
                        trainer_version=0, num_replicas=2)
    (part,) = _mismatch_parts(big, replicas=2)
    assert part.startswith("mismatch kl ") and "outside [1/2, 2]" in part and "worst generator" in part
    small = step_mismatch(trainer, {**packed, "generator_logprobs": trainer + 1e-6},
                          versions=[0] * 4, replicas=[0] * 4, trainer_version=0)
    assert _mismatch_parts(small, replicas=1) == []


def test_the_apps_probe_keeps_only_scores_at_the_trainers_version_and_says_a_failure_once():
    """apps.grpo's probe: replica 0 scores at the trainer's version 5 (kept), replica 1's
    scoring raises (skipped, one warning however often), replica 2 serves version 4 (its
    delta refused: skipped); a generator that never serves version 5 skips every row."""
    import asyncio

    from apps.grpo.main import RLApp
    from forge_ext.rollout.engines.base import Scores

    episodes = [Episode(prompt_ids=[1, 2], response_ids=[6, 7], generator_logprobs=[-1.0, -2.0],
                        advantage=0.0, policy_version=4, replica=r) for r in range(3)]
    packed = pack_episodes(episodes, pad_id=0)

    async def score(sequences, replica):
        assert sequences == [([1, 2], [6, 7])]
        if replica == 1:
            raise RuntimeError("boom")
        return Scores(logprobs=[[-1.5, -2.5]], policy_version={0: 5, 2: 4}[replica])

    async def serving(version, served=True):
        return served

    written = []
    app = SimpleNamespace(trainer_version=5, probe_failed=False, write=written.append,
                          generator=SimpleNamespace(score=score), generator_serving=serving)
    for _ in range(2):
        probe = asyncio.run(RLApp.probe(app, episodes, packed, [0, 1, 2]))
        assert probe.rows.tolist() == [True, False, False] and probe.skipped == 2
        assert probe.logprobs[0, 1:3].tolist() == [-1.5, -2.5]
    assert len(written) == 1 and written[0].startswith("warning: the mismatch probe could not")
    assert "RuntimeError: boom" in written[0]
    app.generator_serving = lambda version: serving(version, served=False)
    probe = asyncio.run(RLApp.probe(app, episodes, packed, [0, 2]))
    assert probe.rows.tolist() == [False] * 3 and probe.skipped == 2
    assert asyncio.run(RLApp.probe(app, episodes, packed, [])) is None
