"""Tasks, rewards and prompts (forge_ext.tasks) without actors: the sources' rows and splits,
the rubric's accounting of reward functions that fail, the built-in rewards against the
libraries they wrap, prompt ids against ``apply_chat_template``, and every pre-spawn error."""

import asyncio
import gc
import json
import math
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import save_chat_tokenizer

import reward_fns as fns

from forge_ext.tasks import (
    PromptConfig, PromptRenderer, PromptStream, RewardConfig, RewardFunctionConfig, Row, Rubric,
    Sample, build_task, task_config,
)
from forge_ext.tasks.rubric import RewardFailure
from forge_ext.tasks.tokenizer import CheckpointTokenizer, save_tokenizer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def records(n):
    return [{"question": f"What is {i} plus {i}?", "solution": f"#### {2 * i}", "level": i % 3}
            for i in range(n)]


# ------------------------------------------------------------------------ dataset source
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "disk"])
def test_dataset_rows_from_every_format_hold_out_a_fixed_disjoint_split(tmp_path, fmt):
    import datasets

    data = records(30)
    path = tmp_path / f"data.{fmt}"
    table = datasets.Dataset.from_list(data)
    if fmt == "jsonl":
        write_jsonl(path, data)
    elif fmt == "parquet":
        table.to_parquet(str(path))
    elif fmt == "csv":
        table.to_csv(str(path), index=False)
    else:
        table.save_to_disk(str(path))
    spec = {"source": "dataset", "train_path": str(path), "num_eval": 5,
            "prompt_field": "question", "answer_field": "solution", "seed": 3}
    task = build_task(spec)
    train, held_out = task.train_rows(), task.eval_rows()
    assert len(train) == 25 and len(held_out) == 5
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held_out})
    assert {r.prompt for r in train} | {r.prompt for r in held_out} == {d["question"] for d in data}
    by_prompt = {d["question"]: d for d in data}
    for row in train + held_out:
        assert row.answer == by_prompt[row.prompt]["solution"]
        # Every column kept; a CSV file's are its text (it has no types).
        level = by_prompt[row.prompt]["level"]
        assert row.metadata["level"] == (str(level) if fmt == "csv" else level)
    # Fixed by the seed; another seed holds out other rows.
    assert build_task(spec).eval_rows() == held_out
    assert build_task({**spec, "seed": 4}).eval_rows() != held_out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "jsonl null", "csv", "parquet", "disk"])
def test_a_row_without_the_answer_column_is_named_with_the_columns_it_has(tmp_path, fmt):
    """Issue 50: row 418 of a valid .jsonl had ``ans`` for ``answer`` and the run said
    ``task.train_path='x.jsonl' does not read as json: 'answer'``. In every format the
    message names the row, the column it lacks and the columns it has (a CSV field left
    empty, a parquet or ``save_to_disk`` null, a JSON null are the same to a row)."""
    import datasets

    data = records(30)
    if fmt in ("jsonl", "json"):
        data[23] = {"question": data[23]["question"], "sol": "#### 46", "level": 2}
    else:
        data[23] = {**data[23], "solution": None}
    path = tmp_path / f"data.{fmt.split()[0]}"
    if fmt.startswith("jsonl"):
        write_jsonl(path, data)
    elif fmt == "json":
        path.write_text(json.dumps(data))
    elif fmt == "csv":
        datasets.Dataset.from_list(data).to_csv(str(path), index=False)
    elif fmt == "parquet":
        datasets.Dataset.from_list(data).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(data).save_to_disk(str(path))
    spec = {"source": "dataset", "train_path": str(path), "num_eval": 5,
            "prompt_field": "question", "answer_field": "solution"}
    with pytest.raises(ValueError) as error:
        build_task(spec)
    row = {"jsonl": "row 23 (line 24)", "json": "row 23"}.get(fmt, "row 23")
    have = (["question", "sol", "level"] if fmt in ("jsonl", "json") else
            ["question", "level"])
    assert str(error.value) == (
        f"{row} of task.train_path={str(path)!r} has no 'solution' (task.answer_field); the "
        f"columns it has: {have}"), str(error.value)


def test_dataset_eval_path_messages_system_prompt_and_numeric_answers(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": 4},
        {"messages": [{"role": "user", "content": "3+3?"}], "answer": 6.5},
    ])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [
        {"messages": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)}
        for i in range(4)
    ])
    task = build_task({"source": "dataset", "train_path": train, "eval_path": held_out,
                       "num_eval": 3, "prompt_field": "messages", "system_prompt": "Be brief."})
    assert [r.answer for r in task.train_rows()] == ["4", "6.5"]
    assert [r.answer for r in task.eval_rows()] == ["1", "2", "3"]  # the first num_eval
    assert task.train_rows()[0].prompt == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}
    ]


def test_a_csv_files_answers_are_its_text_and_score_their_own_exact_match(tmp_path):
    """pandas' type inference would read ``0021`` as 21, ``0.50`` as 0.5, ``3.10`` as 3.1 and
    round a 21-digit id through float64: each row's own answer would then miss its text."""
    answers = ["0021", "0.50", "3.10", "123456789012345678901", "NA"]
    path = tmp_path / "d.csv"
    # Quoted and bare fields alike: quoting does not stop the inference.
    path.write_text("question,answer\n" + "".join(
        f'q{i},"{a}"\n' if i % 2 else f"q{i},{a}\n" for i, a in enumerate(answers)))
    task = build_task({"source": "dataset", "train_path": str(path), "num_eval": 1,
                       "prompt_field": "question"})
    rows = sorted([*task.train_rows(), *task.eval_rows()], key=lambda r: r.prompt)
    lines = path.read_text().splitlines()[1:]  # the file's own text, field by field
    assert [r.answer for r in rows] == [line.split(",", 1)[1].strip('"') for line in lines]
    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")]), task)
    scores = rubric.score_sync([Sample(row=r, completion=a) for r, a in zip(rows, answers)])
    assert scores.rewards == [1.0] * len(answers)


def test_typed_numbers_of_jsonl_and_parquet_answers_become_their_text(tmp_path):
    """A file with typed numbers: an int or float answer becomes its text (an integral float
    without ``.0``: Arrow reads a column of mixed ints and floats as floats)."""
    import datasets

    records = [{"question": "a", "answer": 21}, {"question": "b", "answer": 0.5},
               {"question": "c", "answer": 3.1}, {"question": "d", "answer": 7.0}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    parquet = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(records).to_parquet(parquet)
    for path in (jsonl, parquet):
        task = build_task({"source": "dataset", "train_path": path, "eval_path": path,
                           "prompt_field": "question"})
        assert [r.answer for r in task.train_rows()] == ["21", "0.5", "3.1", "7"], path


def test_the_task_rows_are_the_same_in_a_fresh_process(tmp_path):
    """What a resumed run relies on: every source builds the same rows in the same order in
    another process (no dependence on hash seeds, set order or the clock)."""
    data = write_jsonl(tmp_path / "d.jsonl", records(40))
    specs = [
        {"source": "addition", "max_digits": 2, "num_train": 50, "num_eval": 10},
        {"source": "dataset", "train_path": data, "num_eval": 7, "prompt_field": "question",
         "answer_field": "solution"},
        {"source": "reasoning_gym", "name": "chain_sum", "num_train": 30, "num_eval": 10,
         "config": {"max_terms": 3, "max_digits": 1}},
    ]
    script = textwrap.dedent(f"""
        import json, sys
        from forge_ext.tasks import build_task, PromptStream
        out = []
        for spec in {specs!r}:
            task = build_task(spec)
            stream = PromptStream(task.train_rows(), seed=5).slice(0, 70)
            out.append([[r.text, r.answer] for r in list(task.eval_rows()) + stream])
        json.dump(out, sys.stdout)
    """)
    runs = [json.loads(subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": str(seed)},
    ).stdout) for seed in (1, 2)]
    assert runs[0] == runs[1]
    here = []
    for spec in specs:
        task = build_task(spec)
        stream = PromptStream(task.train_rows(), seed=5).slice(0, 70)
        here.append([[r.text, r.answer] for r in list(task.eval_rows()) + stream])
    assert here == runs[0]


def test_prompt_stream_covers_each_row_once_per_epoch():
    rows = [Row(prompt=str(i), answer="") for i in range(7)]
    stream = PromptStream(rows, seed=1)
    first, second = stream.slice(0, 7), stream.slice(7, 7)
    assert sorted(r.prompt for r in first) == sorted(r.prompt for r in second) == [
        str(i) for i in range(7)
    ]
    assert first != second  # reshuffled per epoch
    assert stream.slice(3, 6) == first[3:] + second[:2]  # addressed by position


# ------------------------------------------------------------------- reasoning-gym source
def test_reasoning_gym_rows_are_disjoint_and_scored_by_its_own_score_answer():
    import reasoning_gym

    task = build_task({"source": "reasoning_gym", "name": "chain_sum", "num_train": 60,
                       "num_eval": 20, "seed": 7, "config": {"max_terms": 2, "max_digits": 1}})
    train, held_out = task.train_rows(), task.eval_rows()
    assert len(train) == 60 and len(held_out) == 20
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held_out})
    rubric = Rubric(RewardConfig(), task)  # the task's default: its own scorer
    assert rubric.names == ["reasoning_gym"]
    dataset = reasoning_gym.create_dataset("chain_sum", seed=7, size=10, max_terms=2,
                                           max_digits=1)
    samples = [
        Sample(row=r, completion=c) for r in held_out[:5]
        for c in ["", "0", "-3", r.answer, f" {r.answer} ", f"<answer>{r.answer}</answer>", "x"]
    ]
    scores = rubric.score_sync(samples)
    for sample, value in zip(samples, scores.rewards):
        entry = sample.row.metadata
        answer = sample.completion
        if "<answer>" in answer:
            answer = answer.split("<answer>")[1].split("</answer>")[0]
        expected = dataset.score_answer(answer.strip(), entry)
        assert value == expected, (sample.completion, entry["answer"])
    assert any(scores.rewards) and not all(scores.rewards)


def _off_in_the_4th_decimal(entry):
    from decimal import Decimal

    return str(Decimal(entry["answer"]) + Decimal("0.0003"))


def _fifty_days_off(entry):
    return f"{int(entry['answer'].split()[0]) + 50} days"


@pytest.mark.parametrize(("name", "config", "wrong"), [
    # Tolerance is one unit of the last of max_num_decimal_places (default 3): at 6 places an
    # answer off in the 4th decimal is wrong, at the default it would score 1.0.
    ("decimal_arithmetic", {"min_num_decimal_places": 6, "max_num_decimal_places": 6},
     _off_in_the_4th_decimal),
    # Partial credit 1 - miss / max_date_difference_days: 0.95 at 1000 days, 0.5 at 100.
    ("time_intervals", {"task_types": ["date"], "max_date_difference_days": 1000},
     _fifty_days_off),
])
@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_reasoning_gym_rows_are_scored_by_the_dataset_that_made_them(name, config, wrong,
                                                                     isolation):
    import reasoning_gym

    task = build_task({"source": "reasoning_gym", "name": name, "config": config,
                       "num_train": 8, "num_eval": 4, "seed": 3})
    rubric = Rubric(RewardConfig(isolation=isolation, num_workers=1), task)
    rows = task.eval_rows()
    samples = [Sample(row=r, completion=f"<answer>{c}</answer>") for r in rows
               for c in (r.answer, wrong(r.metadata))]
    scores = rubric.score_sync(samples)
    # The reference: reasoning-gym's dataset built with the task's config.
    dataset = reasoning_gym.create_dataset(name, seed=3, size=48, **config)
    expected = [dataset.score_answer(s.completion[8:-9], s.row.metadata) for s in samples]
    assert scores.rewards == expected
    default = reasoning_gym.get_score_answer_fn(name)
    assert expected != [default(s.completion[8:-9], s.row.metadata) for s in samples]
    assert scores.errors == {"reasoning_gym": 0} and expected[::2] == [1.0] * len(rows)
    assert scores.correct == [v >= 1.0 for v in expected]  # what counts as accurate
    rubric.close()


def test_the_reasoning_gym_reward_needs_the_reasoning_gym_source():
    """It scores with the dataset that made the rows: another source has none to give."""
    with pytest.raises(ValueError, match=r"reward.functions\[0\].fn='reasoning_gym' is not a "
                                         r"reward function \(reasoning_gym is the reward of "
                                         r"task.source=reasoning_gym"):
        Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="reasoning_gym")]),
               fns.NoTask())


# ------------------------------------------------------------------------------- rubric
def rubric_of(*fns, **config):
    """A rubric of ``fns`` (functions of :mod:`reward_fns`, by reference) with ``config``."""
    class _Task:
        name = "t"

        def rewards(self):
            return {f.__name__: f for f in fns}

        def default_rewards(self):
            return []

    entries = [RewardFunctionConfig(fn=f.__name__) for f in fns]
    return Rubric(RewardConfig(functions=entries, **config), _Task())


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_failing_reward_functions_cost_their_samples_and_are_counted(capsys, isolation):
    rubric = rubric_of(fns.sync_reward, fns.async_reward, fns.raises, fns.hangs,
                       fns.hangs_async, fns.nan, fns.string, fns.array, timeout_s=0.5,
                       on_error=-1.0, isolation=isolation, num_workers=4,
                       max_error_rate=None)  # never stop: each failure is printed once
    rows = [Row(prompt="p", answer="42"), Row(prompt="q", answer="7")]
    samples = [Sample(row=rows[0], completion="42"), Sample(row=rows[1], completion="no")]
    start = time.perf_counter()
    scores = rubric.score_sync(samples)
    assert time.perf_counter() - start < 5  # the hung calls cost their timeout, once, at once
    assert scores.by_function["sync_reward"] == [1.0, 0.0]
    assert scores.by_function["async_reward"] == [0.5, 0.0]
    assert scores.by_function["array"] == [0.25, 0.25]
    for name in ("raises", "hangs", "hangs_async", "nan", "string"):
        assert scores.by_function[name] == [-1.0, -1.0], name
    assert scores.errors == {"sync_reward": 0, "async_reward": 0, "raises": 2, "hangs": 2,
                             "hangs_async": 2, "nan": 2, "string": 2, "array": 0}
    # The weighted total: weight 1 each.
    assert scores.rewards == [1.0 + 0.5 - 5 + 0.25, 0.0 - 5 + 0.25]
    metrics = scores.metrics()
    assert metrics["reward/errors/raises"] == 2 and metrics["reward/sync_reward"] == 0.5
    assert scores.correct == [True, False]  # the first function's 1.0 rate
    err = capsys.readouterr().err
    # One traceback per failing function, however many samples it failed.
    assert err.count("failed; its sample scores") == 5
    assert "RuntimeError: boom" in err and "reward.timeout_s=0.5" in err
    assert "must be finite" in err and "must be a number, got str" in err
    rubric.score_sync(samples)
    assert "failed; its sample" not in capsys.readouterr().err
    assert rubric.error_counts["raises"] == 4


def test_a_function_failing_on_every_call_has_its_traceback_once_in_the_stop(capsys):
    """Issue 38: a batch that stops the run printed the function's first traceback as it
    failed, then again in the run's last line (the stop's error): now only in the error; a
    function below the rate still has it printed after its batch."""
    rubric = rubric_of(fns.sync_reward, fns.raises, max_error_rate=0.5)
    row = Row(prompt="p", answer="42")
    scores = rubric.score_sync([Sample(row=row, completion="42")] * 2)
    assert capsys.readouterr().err == ""
    with pytest.raises(RewardFailure) as failure:
        rubric.check(scores)
    assert str(failure.value).count("RuntimeError: boom") == 1
    assert "Its first failure:\nTraceback" in str(failure.value)
    lenient = rubric_of(fns.sync_reward, fns.raises, max_error_rate=None)
    lenient.check(lenient.score_sync([Sample(row=row, completion="42")]))
    assert capsys.readouterr().err.count("RuntimeError: boom") == 1


def test_a_rubric_scores_alike_in_every_event_loop():
    """score_sync opens a new event loop per call (the SFT app validates many times): the
    second call's samples, more than the rubric runs at once, must score as the first's."""
    rubric = rubric_of(fns.sync_reward, fns.async_reward)
    samples = [Sample(row=Row(prompt="p", answer=str(i)), completion=str(i % 2)) for i in range(40)]
    first = rubric.score_sync(samples)
    assert rubric.score_sync(samples) == first
    assert first.errors == {"sync_reward": 0, "async_reward": 0} and sum(first.correct) == 2


def test_weights_and_the_accuracy_function():
    rubric = rubric_of(fns.sync_reward, fns.async_reward, accuracy="async_reward")
    rubric.functions["sync_reward"] = (*rubric.functions["sync_reward"][:1], 2.0,
                                       rubric.functions["sync_reward"][2])
    scores = rubric.score_sync([Sample(row=Row(prompt="p", answer="4"), completion="4")])
    assert scores.rewards == [2.0 * 1.0 + 0.5]
    assert scores.correct == [False]  # async_reward gave 0.5, not 1


def test_reward_calls_run_in_worker_processes_spread_over_them():
    """reward.isolation=process (the default): sync and async functions run in the rubric's
    worker processes, the calls of a batch on all of them; thread: in this process."""
    import psutil

    rows = [Row(prompt="p", answer=str(i)) for i in range(6)]
    samples = [Sample(row=r, completion="c") for r in rows]
    rubric = rubric_of(fns.pid, fns.pid_async, num_workers=2)
    scores = rubric.score_sync(samples)
    workers = set(rubric.worker_pids)
    assert len(workers) == 2 and workers <= {p.pid for p in psutil.Process().children()}
    ran_in = {name: {int(v) for v in values} for name, values in scores.by_function.items()}
    assert ran_in["pid"] | ran_in["pid_async"] == workers  # both workers took calls
    rubric.close()
    threaded = rubric_of(fns.pid, fns.pid_async, isolation="thread")
    assert set(threaded.score_sync(samples[:2]).by_function["pid"]) == {float(os.getpid())}


def test_a_stop_sent_to_the_process_group_leaves_the_reward_workers_scoring():
    """A Ctrl-C (SIGINT) or a ``kill``/``timeout``/scheduler stop (SIGTERM) sent to the whole
    process group reaches the reward workers too: they ignore it (the controller's loop
    finishes the step, then closes the pool), so the step's samples are scored, not given
    ``reward.on_error`` (a newcomer's ``timeout 40`` run: 'the reward worker process died
    during the call (exit code -15)')."""
    import signal

    rubric = rubric_of(fns.pid, num_workers=2)
    samples = [Sample(row=Row(prompt="p", answer=str(i)), completion="c") for i in range(4)]
    assert rubric.score_sync(samples).errors == {"pid": 0}
    for pid in rubric.worker_pids:
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.2)
    scores = rubric.score_sync(samples)
    assert scores.errors == {"pid": 0}, scores
    assert {int(v) for v in scores.by_function["pid"]} <= set(rubric.worker_pids)
    rubric.close()


def test_the_addition_tasks_own_reward_runs_in_a_worker():
    from forge_ext.tasks import AdditionTask

    task = AdditionTask(AdditionTask.Config(num_train=4, num_eval=2, reverse_answer=True,
                                            partial_credit=0.25))
    rubric = Rubric(RewardConfig(num_workers=1), task)
    row = task.eval_rows()[0]  # its answer is the sum's digits reversed
    total = str(row.metadata["a"] + row.metadata["b"])
    samples = [Sample(row=row, completion=c) for c in (total[::-1], "1" + total, "x")]
    samples.append(Sample(row=row, completion=total[::-1], finished=False))
    assert rubric.score_sync(samples).rewards == [1.0, 0.25, 0.0, 0.0]
    rubric.close()


def test_a_reward_function_a_worker_process_cannot_receive_is_refused_naming_its_field():
    """A lambda or closure cannot be sent to a worker process by reference: refused when the
    rubric is built, naming the field and both fixes; reward.isolation=thread runs it."""
    offset = 1.0

    class _Task:
        name = "t"

        def rewards(self):
            return {"closure": lambda completion: offset, "ok": fns.sync_reward}

        def default_rewards(self):
            return []

    entries = [RewardFunctionConfig(fn="ok"), RewardFunctionConfig(fn="closure")]
    with pytest.raises(ValueError, match=r"reward.functions\[1\].fn='closure' .* cannot be sent "
                                         r"to a reward worker process.*module level.*"
                                         r"reward.isolation=thread"):
        Rubric(RewardConfig(functions=entries), _Task())
    rubric = Rubric(RewardConfig(functions=entries, isolation="thread"), _Task())
    assert rubric.score_sync([Sample(row=Row(prompt="p", answer="a"), completion="a")]
                             ).rewards == [2.0]


# A controller with a rubric that scores a batch holding one runaway call while an asyncio
# task ticks every 50 ms, then a second batch; it prints what happened and exits (no close).
RUNAWAY = """
import asyncio, json, sys, time
import psutil
from forge_ext.tasks import RewardConfig, RewardFunctionConfig, Row, Rubric, Sample
from reward_fns import NoTask

fn, answer, completions, timeout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), 2.0

rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn=fn, name="f"),
                                        RewardFunctionConfig(fn="exact_match")],
                             timeout_s=timeout, on_error=-1.0, num_workers=2), NoTask())

async def main():
    ticks = []
    async def tick():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)
    ticker = asyncio.create_task(tick())
    batch = lambda cs: [Sample(row=Row(prompt="p", answer=answer), completion=c) for c in cs]
    await rubric.score(batch(completions[1:] * 2))  # the workers have started
    start = time.monotonic()
    first = await rubric.score(batch(completions))
    middle = time.monotonic()
    second = await rubric.score(batch(completions[1:]))
    end = time.monotonic()
    ticker.cancel()
    during = [t for t in ticks if start <= t <= end]
    gaps = [b - a for a, b in zip([start, *during], [*during, end])]
    workers = [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"first": first.by_function, "first_errors": first.errors,
                      "second": second.by_function, "second_errors": second.errors,
                      "first_s": middle - start, "max_gap_s": max(gaps), "ticks": len(during),
                      "timeout": timeout, "workers": workers}))

asyncio.run(main())
"""


def _python_env():
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize(("fn", "answer", "runaway", "right", "wrong"), [
    # sympy's big-int power under math-verify: minutes in one C call.
    ("math_verify", "3", r"\boxed{9^{9^{9}}}", r"\boxed{3}", r"\boxed{4}"),
    # A user's function in one C call (10 ** 10**9), sync and async.
    ("reward_fns:power", "3", fns.HUGE, "3", "4"),
    ("reward_fns:power_async", "3", fns.HUGE, "3", "5"),
], ids=["math_verify", "user_sync", "user_async"])
def test_a_reward_call_holding_the_gil_is_ended_at_its_timeout_and_the_loop_keeps_running(
    fn, answer, runaway, right, wrong
):
    """On threads such a call freezes the whole controller (event loop, timeouts, every
    thread) until it returns: the child process would not finish in 150 s."""
    import psutil

    completions = [runaway, right, wrong]
    out = subprocess.run([sys.executable, "-c", RUNAWAY, fn, answer, json.dumps(completions)],
                         capture_output=True, text=True, timeout=150, env=_python_env())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = fns.power if fn.startswith("reward_fns") else None
    values = [1.0 if c == right else 0.0 for c in completions[1:]] if expected is None else [
        expected(c) for c in completions[1:]]
    assert result["first"]["f"] == [-1.0, *values]  # the runaway call scored on_error ...
    assert result["first_errors"] == {"f": 1, "exact_match": 0}  # ... and was counted
    assert result["first"]["exact_match"] == [float(c == answer) for c in completions]
    assert result["first_s"] < result["timeout"] + 2.5  # ended at its timeout
    assert result["max_gap_s"] < 1.0 and result["ticks"] > 10  # the loop kept running
    assert result["second"]["f"] == values and result["second_errors"]["f"] == 0
    assert "took longer than reward.timeout_s=2.0" in out.stderr
    workers = []
    for pid in result["workers"]:
        try:
            workers.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # gone already
            pass
    assert not psutil.wait_procs(workers, timeout=10)[1]  # none outlived the controller


def test_no_reward_worker_outlives_its_rubric_or_a_killed_controller():
    import psutil

    def started(rubric):
        rubric.score_sync([Sample(row=Row(prompt="p", answer="1"), completion="1")] * 4)
        workers = [psutil.Process(pid) for pid in rubric.worker_pids]
        assert len(workers) == 2 and all(w.ppid() == os.getpid() for w in workers)
        return workers

    rubric = rubric_of(fns.sync_reward, fns.raises, num_workers=2)
    workers = started(rubric)
    rubric.close()
    assert not psutil.wait_procs(workers, timeout=10)[1]
    # Dropped without close (after errors, whose tracebacks hold the rubric's frames): its
    # finalizer ends them at once, no gc pass needed (no reference cycle keeps it).
    rubric = rubric_of(fns.sync_reward, fns.raises, num_workers=2)
    workers = started(rubric)
    gc.disable()
    try:
        del rubric
        assert not psutil.wait_procs(workers, timeout=10)[1]
    finally:
        gc.enable()
    # A controller SIGKILLed while its worker holds the GIL in a C call: the kernel ends it.
    child = subprocess.Popen([sys.executable, "-c", SPINNING, fns.HUGE], stdout=subprocess.PIPE,
                             text=True, env=_python_env())
    try:
        spinning = [psutil.Process(p) for p in json.loads(child.stdout.readline())]
        assert len(spinning) == 2
        before = [p.cpu_times().user for p in spinning]
        time.sleep(1.0)
        # The runaway call runs: one worker computes (on a busy machine, part of the second).
        assert max(p.cpu_times().user - b for p, b in zip(spinning, before)) > 0.05
        child.kill()
        child.wait()
        assert not psutil.wait_procs(spinning, timeout=10)[1]
    finally:
        child.kill()


# A controller whose one reward call runs for minutes; it prints its worker pids once that
# call has run a while.
SPINNING = """
import asyncio, json, sys
import psutil
from forge_ext.tasks import RewardConfig, RewardFunctionConfig, Row, Rubric, Sample
from reward_fns import NoTask

rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="reward_fns:power")],
                             timeout_s=600, num_workers=2), NoTask())

async def main():
    call = asyncio.ensure_future(rubric.score([Sample(row=Row(prompt="p", answer=""),
                                                      completion=sys.argv[1])]))
    while len(psutil.Process().children()) < 2:
        await asyncio.sleep(0.1)
    await asyncio.sleep(3)
    print(json.dumps([p.pid for p in psutil.Process().children()]), flush=True)
    await call

asyncio.run(main())
"""


# --------------------------------------------------------------------- built-in rewards
@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("Half of 84 is 42.\n#### 42", "Natalia sold 48/2 = 24 clips.\n#### 42", 1.0),
    ("The answer is \\boxed{42}", "#### 42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("#### 41", "#### 42", 0.0),
    ("no number here", "#### 42", 0.0),
])
def test_math_verify_reads_gsm8k_and_latex_answers(completion, answer, expected):
    from forge_ext.tasks.rewards import math_verify

    assert math_verify(completion=completion, answer=answer) == expected


# A gold as MATH and MATH-500 store it (bare LaTeX), in $...$, boxed, or GSM8K's solution
# text; a right and a wrong completion of it.
GOLDS = [
    (r"\sqrt{2}", r"so \boxed{\sqrt{2}}", r"\boxed{2}"),
    (r"\dfrac{14}{3}", r"The answer is $\frac{14}{3}$.", r"\boxed{4.6667}"),
    ("p - q", r"\boxed{p - q}", r"\boxed{q - p}"),
    (r"10\sqrt{2}", r"\boxed{10\sqrt{2}}", r"\boxed{10}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}", r"\boxed{3}"),
    (r"$\frac{1}{2}$", r"\boxed{0.5}", r"\boxed{2}"),
    (r"The answer is $\frac{1}{2}$.", r"\boxed{\frac{2}{4}}", r"\boxed{1}"),
    (r"\boxed{42}", r"Thus \boxed{42}.", r"\boxed{24}"),
    ("She has 1,000 + 234 = 1,234 apples.\n#### 1,234", r"\boxed{1234}", r"\boxed{234}"),
    ("#### 72", "... so 72 in all.\n#### 72", "#### 27"),
    ("0.5", r"\boxed{\frac{1}{2}}", r"\boxed{5}"),
    ("-3", r"\boxed{-3}", r"\boxed{3}"),
    (r"\$5", r"\boxed{5}", r"\boxed{6}"),
]


@pytest.mark.parametrize(("gold", "right", "wrong"), GOLDS)
def test_math_verify_reads_the_gold_as_written(gold, right, wrong):
    from forge_ext.tasks.rewards import math_verify

    assert math_verify(completion=right, answer=gold) == 1.0
    assert math_verify(completion=wrong, answer=gold) == 0.0


@pytest.mark.parametrize("gold", ["", "#### ", r"\frac{1}{", r"\boxed{}"])
def test_a_gold_math_verify_cannot_read_is_an_error_naming_it_and_counted(gold):
    from forge_ext.tasks.rewards import math_verify

    with pytest.raises(ValueError, match="the reference answer .* does not parse as math"):
        math_verify(completion=r"\boxed{1}", answer=gold)
    rubric = rubric_of(math_verify, on_error=-1.0, num_workers=1)
    scores = rubric.score_sync([Sample(row=Row(prompt="p", answer=gold), completion="1")])
    assert scores.rewards == [-1.0] and scores.errors == {"math_verify": 1}
    with pytest.raises(RewardFailure) as failure:  # its only call failed: the stop says why
        rubric.check(scores)
    assert f"the reference answer {gold!r}" in str(failure.value)
    rubric.close()


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_math_verify_runs_off_the_main_thread(isolation):
    """math-verify's own timeouts use SIGALRM (main thread only): through the rubric, its
    calls run in worker threads and must still score."""
    from forge_ext.tasks import AdditionTask

    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="math_verify")],
                                 isolation=isolation),
                    AdditionTask(AdditionTask.Config(num_train=1, num_eval=1)))
    scores = rubric.score_sync([Sample(row=Row(prompt="p", answer="#### 12"), completion="12")])
    assert scores.rewards == [1.0] and scores.errors == {"math_verify": 0}


# ---------------------------------------------------------------------------- prompts
def test_chat_prompt_ids_are_apply_chat_template_of_the_messages(tmp_path):
    hf = save_chat_tokenizer(tmp_path)
    tok = CheckpointTokenizer(tmp_path)
    assert tok.has_chat_template and tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    render = PromptRenderer(tok, PromptConfig())
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 12 plus 30?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert render(Row(prompt=messages, answer="42")) == expected
    # A text prompt is one user turn; the template sees the formatted text.
    text = PromptRenderer(tok, PromptConfig(template="Compute: {prompt}"))
    one = hf.apply_chat_template([{"role": "user", "content": "Compute: 7 times 6"}],
                                 add_generation_prompt=True, tokenize=True)
    one = list(one["input_ids"] if hasattr(one, "keys") else one)
    assert text(Row(prompt="7 times 6", answer="42")) == one
    assert hf.decode(one).endswith("<|im_start|>assistant\n")


def test_plain_prompts_and_templates_over_metadata(tmp_path):
    save_tokenizer(tmp_path)
    tok = CheckpointTokenizer(tmp_path)
    assert not tok.has_chat_template
    render = PromptRenderer(tok, PromptConfig(template="{a}+{b}="))
    assert render(Row(prompt="ignored", answer="3", metadata={"a": 1, "b": 2})) == \
        tok.encode_prompt("1+2=")
    with pytest.raises(ValueError, match=r"prompt.template='\{a\}\+\{b\}=' does not format"):
        render(Row(prompt="x", answer="3", metadata={"a": 1}))
    with pytest.raises(ValueError, match="rows are chat messages .* no chat_template"):
        PromptRenderer(tok, PromptConfig())(
            Row(prompt=[{"role": "user", "content": "1+2="}], answer="3"))
    with pytest.raises(ValueError, match="prompt.chat_template=true but .* no chat_template"):
        PromptRenderer(tok, PromptConfig(chat_template=True))


# ------------------------------------------------------------------ errors before spawn
def _module(tmp_path, body):
    name = f"user_mod_{random.randrange(10**9)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    return name


def test_every_bad_task_or_reward_is_one_line_naming_the_field_before_any_spawn(
    tmp_path, demo_checkpoint
):
    """Each refused by the app's constructor (nothing spawned, nothing written), in one line
    that names the field; all of them within 20 s."""
    from apps.grpo.config import load_config
    from apps.grpo.main import RLApp

    data = write_jsonl(tmp_path / "d.jsonl", records(20))
    holes = write_jsonl(tmp_path / "holes.jsonl", [
        {"question": "q0", "solution": "1"}, {"question": "q1", "solution": None},
    ])
    mod = _module(tmp_path, """
        VALUE = 3
        def reward(completion, answer):
            return 1.0
        def needs(completion, extra):
            return 1.0
    """)
    base = [f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / 'run'}"]
    def task(**fields):  # dotted overrides; a new task.source replaces the demo's section
        return [f"task.{k}={v}" for k, v in fields.items()]

    ds = dict(source="dataset", train_path=data, prompt_field="question",
              answer_field="solution", num_eval=5)
    cases = [
        (["task.source=nope"], r"task.source='nope' is not a task source"),
        (task(source="dataset", train_path="/no/such.jsonl"),
         r"task.train_path='/no/such.jsonl': no such file"),
        (task(**{**ds, "prompt_field": "prompt"}),
         r"task.prompt_field='prompt' is not a column of task.train_path=.*\['question', "),
        (task(**{**ds, "train_path": holes, "num_eval": 1}),
         r"row 1 of task.train_path=.*holes.jsonl.* has no 'solution' \(task.answer_field\); "
         r"the columns it has: \['question'\]"),
        (task(**ds, max_digits=3), r"unknown key 'task.max_digits'"),
        (task(source="reasoning_gym", name="chain_summ"),
         r"task.name='chain_summ' is not a reasoning-gym task"),
        (task(source="reasoning_gym", name="chain_sum", config="{max_termz: 3}"),
         r"task.config.max_termz is not a field of reasoning-gym's ChainSumConfig"),
        (task(source="reasoning_gym", name="chain_sum", config="{min_terms: 0}"),
         r"task.config=.* is refused by reasoning-gym's ChainSumConfig: min_terms must be positive"),
        (["reward.functions=[{fn: nope}]"], r"reward.functions\[0\].fn='nope' is not a reward"),
        (["reward.functions=[{fn: 'no_such_module_x:f'}]"],
         r"reward.functions\[0\].fn='no_such_module_x:f': module 'no_such_module_x' does not "
         r"import"),
        ([f"reward.functions=[{{fn: '{mod}:missing'}}]"], rf"'{mod}' has no attribute 'missing'"),
        ([f"reward.functions=[{{fn: '{mod}:VALUE'}}]"], r"names a int, not a callable"),
        ([f"reward.functions=[{{fn: '{mod}:needs'}}]"], r"requires \['extra'\]"),
        ([f"reward.functions=[{{fn: '{mod}:reward', weight: 1}}, {{fn: addition, weight: -1}}]"],
         r"reward.functions weights sum to 0"),
        (task(**ds), r"reward.functions is empty and the task \(dataset\) has no default reward"),
        (task(source="'no_such_pkg_y:make'"), r"task.source='no_such_pkg_y:make': module"),
        (["prompt.template='{x}+{b}='"], r"training row 0: prompt.template='\{x\}\+\{b\}=' does not"),
        (["reward.timeout_s=0"], r"reward.timeout_s=0 must be > 0"),
        (["task.environment=feedback", "task.max_episode_tokens=100"],
         r"trainer.training.seq_len=32 < 107 tokens \(longest prompt \+ task.max_episode_tokens\)"),
        # A typo inside a list entry, and a string where the list goes (a newcomer's tries).
        (["reward.functions=[{fn: exact_match, wieght: 2}]"],
         r"unknown key 'reward.functions\[0\].wieght' \(did you mean "
         r"'reward.functions\[0\].weight'\?\); accepted keys of reward.functions\[0\]"),
        (["reward.functions=[{fn:exact_match}]"], r"unknown key 'reward.functions\[0\].fn:exact_match'"),
        (["reward.functions=my_rewards:exact"],
         r"reward.functions: 'my_rewards:exact' is not a list; write a YAML list"),
    ]
    start = time.perf_counter()
    for extra, pattern in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as error:
            RLApp(load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [*base, *extra]))
        message = str(error.value)
        assert "\n" not in message, (extra, message)
        import re

        assert re.search(pattern, message), (extra, message)
    assert time.perf_counter() - start < 20
    assert not (tmp_path / "run").exists()  # nothing written for a refused config


def test_a_user_task_factory_by_import_path(tmp_path):
    mod = _module(tmp_path, """
        class MyTask:
            def __init__(self, n):
                self.n = n
            def train_rows(self):
                return [{"prompt": f"{i}?", "answer": str(i), "tag": i} for i in range(self.n)]
            def eval_rows(self):
                return [{"prompt": "held?", "answer": "h"}]
            def default_rewards(self):
                return ["exact_match"]
        def make(n=3):
            return MyTask(n)
        def broken():
            return [1, 2]
        class DictDefaults(MyTask):
            def default_rewards(self):
                return [{"fn": "exact_match"}]
        def dict_defaults():
            return DictDefaults(2)
    """)
    task = build_task({"source": f"{mod}:make", "n": 4})
    assert [r.answer for r in task.train_rows()] == ["0", "1", "2", "3"]
    assert task.train_rows()[2].metadata["tag"] == 2
    assert Rubric(RewardConfig(), task).names == ["exact_match"]
    with pytest.raises(ValueError, match=r"refused the task fields \['m'\]"):
        build_task({"source": f"{mod}:make", "m": 4})
    with pytest.raises(ValueError, match=r"returned a list, not a task"):
        build_task({"source": f"{mod}:broken"})
    assert task_config({"source": f"{mod}:make"}).fields == {}
    with pytest.raises(ValueError, match=r"default_rewards\(\) must return reward function "
                                         r"names \(a list of str\)"):
        Rubric(RewardConfig(), build_task({"source": f"{mod}:dict_defaults"}))


def test_an_episode_longer_than_vllms_context_is_refused_before_any_spawn(tmp_path,
                                                                         demo_checkpoint):
    from apps.grpo.config import load_config
    from apps.grpo.main import RLApp

    config = load_config(str(CONFIGS / "grpo_cpu_vllm.yaml"), [
        f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / 'run'}",
        "task.environment=feedback", "task.max_episode_tokens=50",
        "trainer.training.seq_len=64", "reference.training.seq_len=64",
        "generator.vllm.max_model_len=48",
    ])
    with pytest.raises(ValueError, match=r"generator.vllm.max_model_len=48 < 57 tokens "
                                         r"\(longest prompt \+ task.max_episode_tokens\)"):
        RLApp(config)


# ------------------------------------------------------------- the row's columns (issue 38)
def test_a_reward_function_gets_the_rows_columns_by_key_and_as_keywords():
    """A user writes ``row["gold"]`` or ``def f(completion, gold)`` (TRL's style): both get
    the row's column, in a reward worker process; ``**kwargs`` gets every column and the
    rubric's arguments."""
    entries = [RewardFunctionConfig(fn=f"reward_fns:{name}")
               for name in ("gold_by_key", "gold_by_keyword", "gold_by_kwargs")]
    rubric = Rubric(RewardConfig(functions=entries, num_workers=1), fns.GoldTask())
    rows = fns.GoldTask().train_rows()
    scores = rubric.score_sync([Sample(row=rows[1], completion="1"),
                                Sample(row=rows[2], completion="1")])
    rubric.close()
    assert scores.errors == {"gold_by_key": 0, "gold_by_keyword": 0, "gold_by_kwargs": 0}
    assert scores.by_function == {"gold_by_key": [1.0, 0.0], "gold_by_keyword": [11.0, 20.0],
                                  "gold_by_kwargs": [101.0, 100.0]}
    row = rows[2]
    assert (row["gold"], row["level"], row["prompt"], row["answer"]) == ("2", 2, "q2", "unused")
    assert dict(row) == {"gold": "2", "level": 2, "prompt": "q2", "answer": "unused"}
    with pytest.raises(KeyError, match=r"'silver': the row's columns are \['gold', 'level'"):
        row["silver"]


def test_a_reward_function_requiring_a_column_the_rows_lack_is_refused_naming_them():
    class _Task(fns.GoldTask):
        def train_rows(self):
            return [Row(prompt="q", answer="a", metadata={"silver": "1"})]

    with pytest.raises(ValueError, match=r"reward.functions\[0\].fn: the reward function "
                                         r"requires \['gold'\].*columns \['answer', 'prompt', "
                                         r"'silver'\]"):
        Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="reward_fns:gold_by_keyword")]),
               _Task())


def test_an_evaluation_sets_task_errors_name_its_fields_and_keep_the_users_paths(tmp_path):
    """``build_task(..., "eval.sets[0].task")`` names the set's fields, not the top-level
    task's; a path holding ``task.`` (``my.task.data/task.jsonl``) is quoted as written (it
    was rewritten to ``my.task.data/eval.sets[0].task.jsonl``)."""
    folder = tmp_path / "my.task.data"
    folder.mkdir()
    path = folder / "task.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    section = "eval.sets[0].task"
    with pytest.raises(ValueError) as error:
        build_task({"source": "dataset", "train_path": str(path), "prompt_field": "q",
                    "num_eval": 1}, section)
    assert str(error.value).startswith(
        f"eval.sets[0].task.prompt_field='q' is not a column of "
        f"eval.sets[0].task.train_path={str(path)!r} (its columns: ['prompt', 'answer']); "
        "set eval.sets[0].task.prompt_field=<one of them>"), str(error.value)
    missing = str(folder / "task.missing")
    with pytest.raises(FileNotFoundError) as error:
        build_task({"source": "dataset", "train_path": missing, "num_eval": 1}, section)
    assert str(error.value) == (f"eval.sets[0].task.train_path={missing!r}: no such file or "
                                "folder")
