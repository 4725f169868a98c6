"""Evaluation metrics against independent computations on hand-made counts and answers; the
HF checkpoint writer's shards, index and full-disk error; the results' JSON, table and plot;
bad evaluation input refused in one line before anything is spawned (``apps.eval``, the GRPO
config)."""

import errno
import itertools
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_ext.evaluation import maj_at_k, mean_at_k, pass_at_k
from forge_ext.evaluation.metrics import final_answer


def pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n samples (the first c correct) holding a correct
    one: the definition the estimator estimates, counted."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def pass_at_k_codex(n: int, c: int, k: int) -> float:
    """The numerically stable product form of Chen et al. 2021 (arXiv:2107.03374, Figure 3)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@pytest.mark.parametrize("n, c, k", [
    (1, 0, 1), (1, 1, 1), (8, 0, 1), (8, 0, 8), (8, 1, 1), (8, 1, 8), (8, 3, 2), (8, 5, 4),
    (10, 2, 5), (10, 9, 3), (16, 4, 8), (12, 11, 12), (7, 3, 7),
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    got = pass_at_k(n, c, k)
    assert got == pytest.approx(float(pass_at_k_by_enumeration(n, c, k)), abs=1e-12)
    assert got == pytest.approx(pass_at_k_codex(n, c, k), abs=1e-12)


def test_pass_at_k_of_a_large_n_stays_exact():
    # C(200, 100) overflows a float; the estimator is computed in integers.
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(200, 0, 100) == 0.0
    assert pass_at_k(200, 150, 51) == 1.0


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_mean_at_k_is_the_fraction_correct_of_hand_made_samples():
    # Prompt A: 3 of 8 right; prompt B: 0 of 8; prompt C: 8 of 8.
    samples = {"A": [1, 0, 0, 1, 0, 1, 0, 0], "B": [0] * 8, "C": [1] * 8}
    for k in (1, 4, 8):
        means = [mean_at_k(8, sum(s), k) for s in samples.values()]
        assert means == [3 / 8, 0.0, 1.0]
        # Independent: the mean accuracy over every k-subset of the samples.
        for value, s in zip(means, samples.values()):
            subsets = list(itertools.combinations(s, k))
            assert value == pytest.approx(sum(sum(x) / k for x in subsets) / len(subsets))


def maj_by_hand(answers, correct):
    """Majority vote written out: count, take the most frequent, share ties."""
    counts = {}
    for a, ok in zip(answers, correct):
        if a is not None:
            counts.setdefault(a, []).append(ok)
    if not counts:
        return 0.0
    top = max(len(v) for v in counts.values())
    winners = [v for v in counts.values() if len(v) == top]
    return sum(sum(v) / len(v) for v in winners) / len(winners)


def test_maj_at_k_on_hand_made_answers():
    # The right answer is "42"; samples vote "41" three times, "42" twice, one unfinished.
    answers = ["41", "42", "41", None, "42", "41"]
    correct = [False, True, False, False, True, False]
    assert maj_at_k(answers, correct, 6) == 0.0  # "41" wins 3-2
    # Drop one "41": a 2-2 tie shares the vote.
    assert maj_at_k(["41", "42", "41", "42"], [False, True, False, True], 4) == 0.5
    assert maj_at_k(["42", "42", "7"], [True, True, False], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    # k < n: the mean over every k-subset, checked against the subsets counted by hand.
    for k in (1, 2, 3, 5):
        subsets = list(itertools.combinations(range(6), k))
        want = sum(maj_by_hand([answers[i] for i in s], [correct[i] for i in s])
                   for s in subsets) / len(subsets)
        assert maj_at_k(answers, correct, k) == pytest.approx(want), k
    # maj@1: each sample alone, a sample without an answer scoring 0: the accuracy.
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 6)


def test_final_answers_maj_at_k_votes_on():
    assert final_answer(" 753 ", True) == "753"
    assert final_answer("so 6*7 is #### 42", True) == "42"
    assert final_answer("think <answer>12</answer> more <answer>13</answer>", True) == "13"
    assert final_answer("753", False) is None  # cut at the length limit: no vote
    assert final_answer(r"x \boxed{7} y \boxed{8}", True, r"\\boxed\{(.*?)\}") == "8"
    assert final_answer("nothing", True, r"\\boxed\{(.*?)\}") is None


# ---- the HF checkpoint writer -----------------------------------------------------------------

def test_shards_and_index_are_what_transformers_reads(tmp_path):
    from safetensors.torch import load_file

    from forge_ext.engine.hf_checkpoint import save_hf_checkpoint

    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=g)
               for i in range(5)}  # 4 KB each in bf16: two per shard
    folder = save_hf_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "qwen3"},
                                max_shard_bytes=10_000, dtype=torch.bfloat16)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 5 * 64 * 32 * 2
    for name, value in tensors.items():
        stored = load_file(str(folder / index["weight_map"][name]))[name]
        assert stored.dtype == torch.bfloat16 and torch.equal(stored, value.to(torch.bfloat16))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    # One shard: model.safetensors alone, no index (what save_pretrained writes).
    single = save_hf_checkpoint(tmp_path / "one", tensors, {"model_type": "qwen3"})
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_full_disk_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    from forge_ext.engine import hf_checkpoint
    from forge_ext.runtime.disk import OutputWriteError

    tensors = {f"w{i}": torch.ones(1000) for i in range(4)}
    old = hf_checkpoint.save_hf_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "qwen3"})
    written = []

    def full_disk(tensors, path, metadata=None):
        if written:  # the second shard finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        Path(path).write_bytes(b"")  # a file, as save_file leaves (its mode is then set)

    monkeypatch.setattr(hf_checkpoint, "save_file", full_disk)
    with pytest.raises(OutputWriteError) as error:
        hf_checkpoint.save_hf_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "qwen3"},
                                         max_shard_bytes=8000)
    message = str(error.value)
    assert "\n" not in message and "ENOSPC" in message and str(tmp_path / "ckpt") in message
    # The previous checkpoint is untouched and no staging folder is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]
    assert (old / "model.safetensors").is_file()

    monkeypatch.setattr(hf_checkpoint.disk, "free_bytes", lambda path: 100)
    with pytest.raises(OutputWriteError, match=r"not writing the HF checkpoint to .*other: "
                       r".* free on its filesystem, .* needed"):
        hf_checkpoint.save_hf_checkpoint(tmp_path / "other", tensors, {"model_type": "qwen3"})


# ---- the results a person reads ---------------------------------------------------------------

def test_results_are_a_json_a_table_and_a_plot_per_step(tmp_path):
    """Two step-N checkpoints of two sets: every number in eval_results.json, a table row per
    checkpoint and set plus their overall mean, and a plot over the steps."""
    from forge_ext.evaluation.report import write_results

    def entry(step, a, b):
        sets = {"sums": {"metrics": {"pass@1": a, "pass@4": 2 * a, "reward": a, "prompts": 6.0},
                         "settings": {"rows": 6, "n": 4, "temperature": 0.7, "top_p": 1.0,
                                      "max_new_tokens": 5, "seed": 123}},
                "long": {"metrics": {"greedy": b, "pass@1": b, "prompts": 3.0},
                         "settings": {"rows": 3, "n": 1, "temperature": 1.0, "top_p": 1.0,
                                      "max_new_tokens": 5, "seed": 456}}}
        return {"label": f"hf/step-{step}", "step": step, "kind": "hf", "sets": sets,
                "overall": {"pass@1": (a + b) / 2, "pass@4": 2 * a, "greedy": b, "reward": a}}

    results = {"seed": 0, "generator": {}, "checkpoints": [entry(2, 0.25, 0.5),
                                                            entry(4, 0.375, 0.0)]}
    paths = write_results(tmp_path, results)
    assert [p.name for p in paths] == ["eval_results.json", "eval_results.md",
                                       "eval_results.png"]
    assert json.loads((tmp_path / "eval_results.json").read_text()) == results
    table = (tmp_path / "eval_results.md").read_text().splitlines()
    assert table[0] == ("| checkpoint | set | greedy | pass@1 | pass@4 | reward | prompts |")
    assert table[2:5] == ["| hf/step-2 | sums |  | 25.0% | 50.0% | 0.250 | 6 |",
                          "| hf/step-2 | long | 50.0% | 50.0% |  |  | 3 |",
                          "| hf/step-2 | overall | 50.0% | 37.5% | 50.0% | 0.250 |  |"]
    assert "- sums: 6 prompts, n=4, temperature 0.7, top_p 1.0, max_new_tokens 5, seed 123" in (
        table)
    assert (tmp_path / "eval_results.png").stat().st_size > 1000
    # One checkpoint (or none with a step): no plot.
    assert [p.name for p in write_results(tmp_path / "one", {**results, "checkpoints": [
        entry(2, 0.25, 0.5)]})] == ["eval_results.json", "eval_results.md"]


def test_the_plot_draws_each_metric_over_the_steps_in_step_order(tmp_path, monkeypatch):
    """Checkpoints of steps 10, 2 and 100 (in that order, labels ``hf/step-N`` that sort by
    name as 10, 100, 2): each set's line goes through the steps in the order of N. What is
    drawn is read where the plot is drawn (``plot_panels``, which then runs as shipped)."""
    from forge_ext.evaluation.report import plot_steps
    from forge_ext.runtime import metrics

    drawn = []

    def recording(panels, path, title=""):
        drawn.extend(panels)
        return real(panels, path, title)

    real = metrics.plot_panels
    monkeypatch.setattr(metrics, "plot_panels", recording)
    settings = {"rows": 6, "n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 5,
                "seed": 0}
    checkpoints = [{"label": f"hf/step-{step}", "step": step, "kind": "hf",
                    "sets": {"sums": {"metrics": {"pass@1": step / 100, "prompts": 6.0},
                                      "settings": settings}},
                    "overall": {"pass@1": step / 100}} for step in (10, 2, 100)]
    assert plot_steps({"seed": 0, "checkpoints": checkpoints}, tmp_path / "plot.png")
    ((panel, series),) = drawn
    assert panel.ylabel == "pass@1"
    assert series == {"sums": [(2, 0.02), (10, 0.1), (100, 1.0)]}


def test_a_set_whose_environment_gives_the_rewards_needs_no_reward_function(tmp_path):
    """As in training, a multi-turn set's environment rewards may stand alone: no
    ``reward.functions`` and a task without default rewards (a dataset file) is a set."""
    from forge_ext.evaluation import EvalSetConfig, build_sets, close_sets
    from forge_ext.tasks import PromptConfig, RewardConfig
    from forge_ext.tasks.tokenizer import CheckpointTokenizer, save_tokenizer

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2)}) + "\n"
                            for i in range(6)))
    save_tokenizer(tmp_path / "tok")
    task = {"source": "dataset", "train_path": str(data), "num_eval": 2,
            "environment": "feedback"}
    (built,) = build_sets([EvalSetConfig(name="feedback", task=task)],
                          CheckpointTokenizer(str(tmp_path / "tok")), prompt=PromptConfig(),
                          reward=RewardConfig(), max_new_tokens=4)
    try:
        assert built.runner.rubric.names == [] and len(built.rows) == 2
    finally:
        close_sets([built])


def test_a_sets_metrics_group_the_samples_of_each_prompt(tmp_path):
    """3 prompts x 4 samples, the first prompt's four right and the others' wrong, in two
    batches of rows: every metric is 1/3 and each saved sample names its own prompt's row.
    The fault: samples grouped with the wrong stride (``records[i::rows]``), which gives
    each prompt one right sample: pass@4 1.0 (pass@1 and mean@4 do not depend on grouping)."""
    import asyncio

    from forge_ext.evaluation import EvalSetConfig, build_sets, close_sets
    from forge_ext.rollout.engines.base import Completion
    from forge_ext.tasks import PromptConfig, RewardConfig, RewardFunctionConfig
    from forge_ext.tasks.tokenizer import CheckpointTokenizer, save_tokenizer

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2)}) + "\n"
                            for i in range(9)))
    save_tokenizer(tmp_path / "tok")
    tok = CheckpointTokenizer(str(tmp_path / "tok"))
    metrics = ["greedy", "pass@1", "pass@2", "pass@4", "mean@4", "maj@2", "maj@4"]
    (built,) = build_sets(
        [EvalSetConfig(name="sums", n=4, metrics=metrics,
                       task={"source": "dataset", "train_path": str(data), "num_eval": 3})],
        tok, prompt=PromptConfig(), max_new_tokens=4,
        reward=RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")],
                            isolation="thread"))
    prompts = [built.runner.render(row) for row in built.rows]
    assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3

    async def sample(prompt_ids, n, *, greedy=False, seed=None, session=None, sampling=None):
        row = built.rows[prompts.index(list(prompt_ids))]
        right = prompts.index(list(prompt_ids)) == 0
        text = row.answer if right else str(int(row.answer) + 1)
        ids = tok.encode_answer(text) + [tok.eos_id]
        return [Completion(prompt_ids=list(prompt_ids), response_ids=ids,
                           logprobs=[-0.5] * len(ids), finished=True, policy_version=0)
                for _ in range(n)]

    try:
        result = asyncio.run(built.evaluate(sample, seed=0, batch_size=2, keep_samples=True))
    finally:
        close_sets([built])
    assert result.metrics["reward"] == pytest.approx(1 / 3)  # the samples are as scripted
    assert result.metrics["pass@4"] == pytest.approx(1 / 3)  # 1.0 under the wrong stride
    for name in metrics:
        assert result.metrics[name] == pytest.approx(1 / 3), name
    assert len(result.samples) == 3 + 12
    for record in result.samples:
        assert prompts[record["row"]] == record["prompt_ids"], record["row"]
    assert [r["row"] for r in result.samples if not r["greedy"]] == [0] * 4 + [1] * 4 + [2] * 4


# ---- bad input, before anything is spawned -----------------------------------------------------

@pytest.fixture
def no_spawn(monkeypatch):
    """Fails a test that spawns a generator."""
    import forge_ext.rollout.replicas as replicas

    def refuse(*args, **kwargs):
        raise AssertionError("a generator was spawned")

    monkeypatch.setattr(replicas, "spawn_replicas", refuse)


def run_eval(argv, capsys):
    from apps.eval.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    message = str(exit_.value.code)
    assert "\n" not in message, message  # one line
    assert capsys.readouterr().out == ""  # nothing printed before: no plan, no spawn
    return message


EVAL = str(Path(__file__).resolve().parent.parent / "configs" / "eval_cpu_demo.yaml")


def test_a_checkpoint_of_no_known_kind_is_one_line(tmp_path, capsys, no_spawn):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    message = run_eval(["--config", EVAL, f"checkpoint={tmp_path}"], capsys)
    assert message.startswith(f"config error: checkpoint={tmp_path} is none of: an HF "
                              "checkpoint folder"), message
    message = run_eval(["--config", EVAL, f"checkpoint={tmp_path}/nothing"], capsys)
    assert message == f"config error: checkpoint={tmp_path}/nothing does not exist"


def test_a_set_without_a_task_is_one_line(capsys, no_spawn, demo_checkpoint):
    message = run_eval(["--config", EVAL, f"checkpoint={demo_checkpoint}",
                        "eval.sets=[{name: gsm8k, n: 4}]"], capsys)
    assert message.startswith("config error: eval.sets[0] (gsm8k) has no task"), message


def test_k_above_n_is_one_line(capsys, no_spawn, demo_checkpoint):
    message = run_eval(["--config", EVAL, f"checkpoint={demo_checkpoint}",
                        "eval.sets=[{name: sums, task: {source: addition}, n: 4, "
                        "metrics: [pass@1, maj@8]}]"], capsys)
    assert message == ("config error: eval.sets[0] (sums).metrics: maj@8 needs at least 8 "
                       "samples per prompt but n=4; raise n to 8 or lower k"), message


def test_a_folder_of_step_folders_is_evaluated_in_step_order(tmp_path, no_spawn,
                                                              demo_checkpoint):
    """``checkpoint=<folder>`` of ``step-N`` folders: every step, in the order of N (step-10
    after step-2, not before it as names sort), which is the order of the results' JSON,
    table and plot; folders of no checkpoint kind, and names other than ``step-N``, are not
    steps."""
    from apps.eval.config import load_eval_config
    from apps.eval.main import EvalApp

    folder = tmp_path / "hf"
    folder.mkdir()
    for step in (10, 2, 1, 100):
        (folder / f"step-{step}").symlink_to(demo_checkpoint, target_is_directory=True)
    (folder / "step-3").mkdir()  # a step still being written: no config.json yet
    (folder / "step-4.incomplete").symlink_to(demo_checkpoint, target_is_directory=True)
    (folder / "latest").symlink_to(demo_checkpoint, target_is_directory=True)
    app = EvalApp(load_eval_config(EVAL, [f"checkpoint={folder}",
                                          f"output_dir={tmp_path / 'out'}"]))
    try:
        steps = [1, 2, 10, 100]
        assert [c.step for c in app.checkpoints] == steps
        assert [c.path for c in app.checkpoints] == [str(folder / f"step-{s}") for s in steps]
        assert {c.kind for c in app.checkpoints} == {"hf"}
        assert app.plan()[0] == "eval: 4 checkpoint(s): " + "; ".join(
            f"hf {folder}/step-{s}" for s in steps)
    finally:
        app.close()


@pytest.mark.parametrize("sets, match", [
    ("[{name: a, n: 2}]", r"eval.sets\[0\] \(a\) has no task"),
    ("[{name: a, task: {source: addition}, n: 2, metrics: [pass@4]}]", r"pass@4 needs at least 4"),
    ("[{name: a, task: {source: addition}, metrics: [best@1]}]", r"'best@1' is not one of"),
    ("[{name: a, task: {source: addition}}, {name: a, task: {source: addition}}]",
     r"two sets are named 'a'"),
    ("[{name: reward, task: {source: addition}}]", r"taken by the held-out metrics"),
])
def test_the_grpo_config_refuses_bad_sets_before_spawning(sets, match):
    from apps.grpo.config import load_config

    with pytest.raises(ValueError, match=match):
        load_config(EVAL.replace("eval_cpu_demo", "grpo_cpu_demo"), [f"eval.sets={sets}"],
                    check_model=False)


def test_the_eval_apps_console_is_kept_in_its_output_dir(monkeypatch, tmp_path, capsys):
    """Issue 50: what ``apps.eval`` prints (its plan, the results table, where it wrote) is
    kept in ``<output_dir>/logs/console.log`` as well as shown (the app's run replaced by one
    that returns a result at once: the console is what is checked)."""
    from types import SimpleNamespace

    import apps.eval.main as eval_main

    settings = {"rows": 2, "n": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 4,
                "seed": 0}
    results = {"seed": 0, "checkpoints": [{"label": "step-2", "sets": {"sums": {
        "metrics": {"greedy": 0.5}, "settings": settings}}}]}

    class App:
        paths = [tmp_path / "results.json"]

        def __init__(self, config):
            pass

        def plan(self):
            return ["evaluating 1 checkpoint on 1 set"]

        async def run(self):
            print("checkpoint step-2 done")
            return results

    config = SimpleNamespace(output_dir=str(tmp_path), env={})
    monkeypatch.setattr(eval_main, "load_eval_config", lambda path, overrides: config)
    monkeypatch.setattr(eval_main, "EvalApp", App)
    assert eval_main.main(["--config", str(tmp_path / "c.yaml")]) == results
    shown = capsys.readouterr().out
    assert shown.startswith("evaluating 1 checkpoint") and "| step-2 | sums | 50.0% |" in shown
    assert (tmp_path / "logs" / "console.log").read_text() == shown
