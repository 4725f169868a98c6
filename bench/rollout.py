"""Rollout service benchmark (issue 33): independent episodes vs lock-step turns, in-flight
weight updates (``keep`` vs ``between_requests``), and one vs two engine replicas, each pair
side by side in one run on vLLM's async engine (``VLLMEngine``, in this process).

Run from the repository root::

    .venv/bin/python -m bench.rollout                        # the three tables, ~10 min
    .venv/bin/python -m bench.rollout --sections episodes    # one table
    .venv/bin/python -m bench.rollout --rows 8 --reps 1      # smaller

The model is a random Qwen3 written by the bench (2 layers, hidden 128, 4/2 heads of 32, the
demo's 16-id character tokenizer, fp32) whose end token's LM-head row is scaled so that its
probability, averaged over positions, is ``1 / --typical-tokens``: each position has its own,
so lengths have a long tail (at the defaults: median ~28, mean ~50, p90 ~130 of at most 256;
the tables print the lengths drawn); ``max_new_tokens`` is ``--max-tokens``. Every timed run
starts with an empty prefix cache. Each table runs its paths ``--reps`` rounds, their order
reversed each round; a ratio is the median of the rounds' ratios (each listed): the load of a
shared machine moves between rounds.

Table 1, episodes (``--rows`` x ``--group`` multi-turn episodes, up to ``--turns`` turns, one
engine on every core): the environment (:class:`SlowEnv`) sleeps a lognormal time in each
``step`` (median ``--env-median`` s, sigma ``--env-sigma``) and replies 1-16 digits; its draws
depend only on the episode's prompt, turn and completion, and every turn's seed only on the
episode and turn, so both drivers sample the same tokens and wait the same times:

- ``independent``: :meth:`forge_ext.rollout.runner.EpisodeRunner.run` (each episode sends its next
  turn when its own environment has answered);
- ``lock-step``: :func:`lockstep_run`, the driver before issue 33 (every running episode's
  turn sent together and awaited together, then every environment step awaited together).

Table 2, weight updates: ``--requests`` GRPO-like requests (``--group`` samples each, at
most ``--inflight`` in flight, a new one sent as one finishes) while a trainer publishes a
version every ``--update-every`` s; whenever no update runs, the engine loads the newest as
``Generator.update_weights`` does (``engine.pause(mode)``, ``load_hf_state_dict``,
``engine.resume()``; :func:`follow_versions`), per ``--modes`` (``none``: no update). Shown:
versions served of those published and their lag (publication to served), the time to
finish every request, tokens/s, the seconds inside ``pause`` (``between_requests``: the
requests in flight finishing on the old weights while new ones wait), the engine's paused
seconds (``EngineStats.paused_seconds``: load and resume), the policy versions per response
and the samples an ``abort`` update cut and sent again. (``Engine.busy`` counts held
requests as busy: with requests always in flight it shows no idle time, so it is left out.)

Table 3, replicas: ``--requests`` requests (at most ``--inflight`` in flight) on one engine
on both cores vs two engines of one core each (``VLLMEngine(cores=[0])`` and ``[1]``),
routed round-robin or by :class:`forge_ext.rollout.router.Router` (least loaded); tokens/s.
Each vLLM engine is three processes (this one, its engine core, its worker): the worker's
threads are bound to its cores, the engine core and this process are not.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import forge_ext  # noqa: F401  (CPU device for torchtitan, before anything imports it)
from forge_ext.rollout.runner import EpisodeRunner, Trajectory
from forge_ext.rollout.engines.base import SamplingConfig, derive_seed
from forge_ext.rollout.router import Router
from forge_ext.tasks import (EpisodeConfig, PromptConfig, PromptRenderer, RewardConfig,
                             RewardFunctionConfig, Row, Rubric, Task)
from forge_ext.tasks.tokenizer import CheckpointTokenizer

ARCHITECTURE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
)
MAX_MODEL_LEN = 2048
DIGITS = "0123456789"


def load() -> str:
    """The 1-minute load average, for the tables (2 shared cores: figures are noisy)."""
    return f"{os.getloadavg()[0]:.1f}"


# ---- the model ---------------------------------------------------------------------------
def write_checkpoint(root: Path, typical_tokens: float, seed: int = 0) -> tuple[str, dict]:
    """A random Qwen3 (:data:`ARCHITECTURE`, the character tokenizer) whose responses end
    after about ``typical_tokens`` tokens, with a long tail; returns its path and state dict.

    The end token's LM-head row is set along the mean final hidden state (as
    ``tests/conftest.py``'s ``chat_checkpoint`` does), scaled by bisection so that its softmax
    probability averaged over the positions of random sequences is ``1 / typical_tokens``. A
    position's probability depends on its hidden state, so lengths are a mixture of
    geometric laws: a longer tail than one geometric law of that mean."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from forge_ext.engine.hf_checkpoint import hf_config_dict, save_hf_checkpoint
    from forge_ext.tasks.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer

    fields = {**ARCHITECTURE, "vocab_size": VOCAB_SIZE, "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID}
    save_tokenizer(root / "tok")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2)
            if "norm" in name:  # around 1, not 0: attention that is not uniform
                p.add_(1.0)
        ids = torch.randint(4, VOCAB_SIZE, (16, 64), generator=torch.Generator().manual_seed(1))
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, fields["hidden_size"])
        head = model.lm_head.weight
        direction = hidden.mean(0) / hidden.mean(0).norm() * head.norm(dim=1).mean()

        def end_probability(scale: float) -> float:
            head[EOS_ID] = scale * direction
            return torch.softmax(hidden @ head.T, -1)[:, EOS_ID].mean().item()

        low, high = -20.0, 20.0
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if end_probability(middle) < 1 / typical_tokens else (
                low, middle)
        end_probability((low + high) / 2)
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = save_hf_checkpoint(root / "ckpt", state_dict, hf_config_dict("qwen3", fields),
                              tokenizer_from=root / "tok")
    return str(path), state_dict


def make_engine(path: str, tok: CheckpointTokenizer, max_tokens: int, cores=None):
    from forge_ext.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(path, sampling=SamplingConfig(max_new_tokens=max_tokens),
                      stop_token_ids=tok.stop_ids, engine_args={"max_model_len": MAX_MODEL_LEN},
                      cores=cores)


async def started(engine) -> float:
    """Seconds of ``engine.start()`` (its first log-prob request compiles a kernel)."""
    start = time.perf_counter()
    await engine.start()
    return time.perf_counter() - start


def worker_cores(engine) -> str:
    """The cores the threads of the engine's worker process(es) may run on, e.g. ``"0 (46
    threads), 1 (1)"``: vLLM binds each OpenMP thread to one core of its group."""
    import collections

    import psutil

    found = []
    for pid in engine.children:
        try:
            for p in psutil.Process(pid).children(recursive=True):
                if "VLLM::Worker" in " ".join(p.cmdline()):
                    cores = collections.Counter(
                        ",".join(map(str, sorted(os.sched_getaffinity(t.id))))
                        for t in p.threads())
                    found.append(", ".join(f"{c} ({n})" for c, n in sorted(cores.items())))
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return " / ".join(found) or "?"


def prompts_for(count: int, seed: int) -> list[str]:
    """``count`` distinct digit strings of 6-12 characters."""
    rng = random.Random(seed)
    return [f"{i}+" + "".join(rng.choice(DIGITS) for _ in range(rng.randint(4, 10))) + "="
            for i in range(count)]


def per_rep(seconds: list[float]) -> str:
    return " + ".join(f"{s:.1f}" for s in seconds)


def ratios(numerators: list[float], denominators: list[float]) -> str:
    """The median of the per-rep ratios, then each: runs of one rep ran back to back, under
    about the same load, so their ratio is steadier than one of totals."""
    each = [a / b for a, b in zip(numerators, denominators)]
    return f"{statistics.median(each):.2f}x ({', '.join(f'{r:.2f}' for r in each)})"


def lengths(values: list[int]) -> str:
    """``mean / p90 / max`` of response lengths."""
    ordered = sorted(values)
    return (f"{statistics.mean(ordered):.0f} / {ordered[int(0.9 * (len(ordered) - 1))]} / "
            f"{ordered[-1]}")


# ---- table 1: episodes -------------------------------------------------------------------
class SlowEnv:
    """An environment whose every ``step`` sleeps a lognormal time (median ``median_s``,
    log-scale ``sigma``) and replies 1-16 digits; done after ``turns`` steps. Its draws depend
    only on the episode's prompt, the turn and the completion (not on timing), so two drivers
    that sample the same tokens see the same latencies and replies."""

    def __init__(self, median_s: float = 0.2, sigma: float = 1.0, turns: int = 4) -> None:
        self.median_s, self.sigma, self.turns = median_s, sigma, turns
        self.key, self.turn = "", 0
        self.slept: list[float] = []
        """Seconds of each step."""

    async def reset(self, row: Row) -> str:
        self.key = row.prompt
        return row.prompt

    async def step(self, completion: str) -> tuple[str, float, bool]:
        self.turn += 1
        rng = random.Random(f"{self.key}|{self.turn}|{completion}")
        self.slept.append(rng.lognormvariate(math.log(self.median_s), self.sigma))
        await asyncio.sleep(self.slept[-1])
        reply = "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 16)))
        return reply, 0.0, self.turn >= self.turns


async def lockstep_run(runner: EpisodeRunner, rows: list[Row], group: int, sample, *,
                       seed: int) -> list[Trajectory]:
    """The multi-turn driver before issue 33 (``forge_ext/rollout.py`` at d00e003^), over the
    same runner's environment, renderer and limits: each turn, every running episode's
    request is sent together and all are awaited, then every environment step together.
    Seeds as :meth:`EpisodeRunner.run`'s (episode ``e``'s turn ``k``: ``derive_seed(seed, e,
    k)``). The environment here never fails, so failures are not handled; the episodes are
    not scored (``EpisodeRunner.run`` scores its own: an ``exact_match`` rubric, milliseconds
    here)."""
    c, render = runner.config, runner.render
    trajectories = [Trajectory(row=row, prompt_ids=[], env=c.make())
                    for row in rows for _ in range(group)]
    firsts = await asyncio.gather(*(t.env.reset(t.row) for t in trajectories))
    for t, first in zip(trajectories, firsts):
        t.prompt_ids = render(Row(prompt=first, answer=t.row.answer))
    for turn in range(c.max_turns):
        running = [(e, t) for e, t in enumerate(trajectories) if not t.done]
        if not running:
            break
        completions = await asyncio.gather(*(
            sample(t.prompt_ids + t.response_ids, 1, seed=derive_seed(seed, e, turn))
            for e, t in running))
        stepping = []
        for (_, t), (x,) in zip(running, completions):
            room = c.max_episode_tokens - len(t.response_ids)
            ids = x.response_ids[:room]
            t.add(ids, True, x.logprobs[:room])
            t.turns += 1
            t.versions += x.versions[:room] or [x.policy_version]
            t.last_turn = ids
            if len(ids) < len(x.response_ids) or not x.finished:
                t.truncated = t.done = True
            else:
                stepping.append(t)
        results = await asyncio.gather(*(
            t.env.step(runner.tok.completion_text(t.last_turn)[0]) for t in stepping))
        for t, (reply, reward, done) in zip(stepping, results):
            t.env_reward += reward
            if done or reply is None:
                t.done = True
                continue
            ids = render.continuation(reply)
            if t.turns == c.max_turns or len(t.response_ids) + len(ids) >= c.max_episode_tokens:
                t.truncated = t.done = True
                continue
            t.add(ids, False)
    for t in trajectories:
        t.truncated |= not t.done
        t.done = True
    return trajectories


async def episodes_table(engine, tok: CheckpointTokenizer, args) -> list[str]:
    config = EpisodeConfig(
        environment=f"{__name__}:SlowEnv", max_turns=args.turns, max_episode_tokens=768,
        env_timeout_s=120.0, environment_options={
            "median_s": args.env_median, "sigma": args.env_sigma, "turns": args.turns})
    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")]), Task())
    runner = EpisodeRunner(tok, PromptRenderer(tok, PromptConfig()), rubric, config)

    async def sample(prompt_ids, n, *, greedy=False, seed=None, session=None):
        return await engine.sample(prompt_ids, n, greedy=greedy, seed=seed)

    async def independent(rows, seed):
        return (await runner.run(rows, args.group, sample, seed=seed)).trajectories

    async def lockstep(rows, seed):
        return await lockstep_run(runner, rows, args.group, sample, seed=seed)

    drivers = {"independent": independent, "lock-step": lockstep}
    rows = [Row(prompt=p, answer="0") for p in prompts_for(2, seed=99)]
    for driver in drivers.values():  # warm-up, not timed
        await driver(rows, seed=99)
    results = {name: [] for name in drivers}
    for rep in range(args.reps):
        rows = [Row(prompt=p, answer="0") for p in prompts_for(args.rows, seed=rep)]
        order = list(drivers) if rep % 2 == 0 else list(drivers)[::-1]
        for name in order:
            await engine.engine.reset_prefix_cache()
            busy = engine.busy.total()
            start = time.perf_counter()
            trajectories = await drivers[name](rows, seed=rep)
            seconds = time.perf_counter() - start
            idle = seconds - (engine.busy.total() - busy)
            results[name].append((seconds, idle, trajectories, load()))
    rows_out = [
        "| driver | episodes | turns | model tokens | turn length mean / p90 / max | "
        "critical path: env s / tokens | wall s (per rep) | episodes/s | engine idle | "
        "load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rate = {}
    for name, runs in results.items():
        episodes = [t for r in runs for t in r[2]]
        turn_lengths = [n for t in episodes for n in _turn_lengths(t)]
        paths = [critical_path(r[2], lockstep=name == "lock-step") for r in runs]
        wall = sum(r[0] for r in runs)
        rate[name] = len(episodes) / wall
        rows_out.append(
            f"| {name} | {len(episodes)} | {sum(t.turns for t in episodes)} | "
            f"{sum(turn_lengths):,} | {lengths(turn_lengths)} | "
            f"{statistics.mean(p[0] for p in paths):.1f} / "
            f"{statistics.mean(p[1] for p in paths):.0f} | "
            f"{per_rep([r[0] for r in runs])} | {rate[name]:.2f} | "
            f"{sum(r[1] for r in runs) / wall:.0%} | {', '.join(r[3] for r in runs)} |")
    ratio = ratios([r[0] for r in results["lock-step"]], [r[0] for r in results["independent"]])
    rows_out.append(f"| independent / lock-step (per rep) | | | | | | | **{ratio}** | | |")
    return rows_out


def _turn_lengths(t: Trajectory) -> list[int]:
    """The lengths of an episode's model turns (its runs of mask 1)."""
    out, run = [], 0
    for m in t.response_mask + [0]:
        if m:
            run += 1
        elif run:
            out.append(run)
            run = 0
    return out


def critical_path(trajectories: list[Trajectory], *, lockstep: bool) -> tuple[float, int]:
    """The environment seconds and model tokens one batch cannot overlap: with independent
    episodes, the largest of an episode's own (a lower bound of the batch's wall time with
    infinitely fast sampling, and in tokens with an instant environment); lock-step, the
    sum over turns of that turn's largest (every turn waits for its slowest episode)."""
    sleeps = [t.env.slept for t in trajectories]
    tokens = [_turn_lengths(t) for t in trajectories]
    if not lockstep:
        return max(map(sum, sleeps)), max(map(sum, tokens))
    turns = max(map(len, tokens))
    return (sum(max((s[k] for s in sleeps if k < len(s)), default=0.0) for k in range(turns)),
            sum(max(n[k] for n in tokens if k < len(n)) for k in range(turns)))


# ---- table 2: weight updates -------------------------------------------------------------
async def requests_run(engines, prompts: list[list[int]], args, *, seed: int,
                       route=None) -> tuple[float, list]:
    """Every prompt as one request of ``args.group`` samples, at most ``args.inflight`` in
    flight (a new one sent as one finishes); ``route(i, prompt)`` picks the engine (index)
    and returns a callback to call when the request is answered. Returns the seconds and the
    completions."""
    gate = asyncio.Semaphore(args.inflight)

    async def one(i: int, prompt: list[int]):
        async with gate:
            replica, done = route(i, prompt) if route else (0, None)
            try:
                return await engines[replica].sample(prompt, args.group,
                                                     seed=derive_seed(seed, i))
            finally:
                if done:
                    done()

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, [c for r in results for c in r]


async def update_weights(engine, mode: str, state_dict: dict, version: int) -> dict[str, float]:
    """What ``Generator.update_weights`` does once the version is fetched (here it is in this
    process already): pause as ``mode`` says, load, resume. Returns the seconds inside
    ``pause`` and of the whole update."""
    start = time.perf_counter()
    await engine.pause(mode)
    paused = time.perf_counter()
    try:
        await engine.load_hf_state_dict(state_dict, version)
    finally:
        await engine.resume()
    return {"pause": paused - start, "update": time.perf_counter() - start}


async def follow_versions(engine, mode: str, run: asyncio.Future, weights: list[dict],
                          every: float) -> tuple[list[dict[str, float]], int]:
    """Until ``run`` is done: a trainer publishes a new version every ``every`` s; whenever
    the engine is free of updates it loads the newest one published (a generator that fell
    behind skips to it), alternating the ``weights`` state dicts. Returns, per update, the
    seconds inside ``pause``, of the update, and its lag (from the version's publication
    until it is served); and how many versions were published."""
    start, base, done = time.perf_counter(), engine.policy_version, []
    while not run.done():
        published = int((time.perf_counter() - start) // every)
        if base + published <= engine.policy_version:  # the newest is served: wait for more
            wait = start + (published + 1) * every - time.perf_counter()
            await asyncio.wait({run}, timeout=max(wait, 0.0))
            continue
        version = base + published
        update = await update_weights(engine, mode, weights[version % len(weights)], version)
        update["lag"] = time.perf_counter() - (start + published * every)
        done.append(update)
    return done, int((time.perf_counter() - start) // every)


async def updates_table(engine, tok: CheckpointTokenizer, state_dict: dict, args) -> list[str]:
    new_version = {  # every tensor moved a little: the response lengths stay
        k: v + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in state_dict.items()}
    prompts = [tok.encode_prompt(p) for p in prompts_for(args.requests, seed=1000)]
    results = {mode: [] for mode in args.modes}
    for rep in range(args.reps):
        for mode in args.modes if rep % 2 == 0 else args.modes[::-1]:
            await engine.engine.reset_prefix_cache()
            before = (engine.stats.paused_seconds, engine.stats.resubmitted)
            run = asyncio.ensure_future(requests_run([engine], prompts, args, seed=7 + rep))
            if mode == "none":
                updates, published = [], 0
                await run
            else:
                updates, published = await follow_versions(
                    engine, mode, run, [state_dict, new_version], args.update_every)
            seconds, completions = run.result()
            results[mode].append({
                "seconds": seconds, "completions": completions, "updates": updates,
                "published": published, "paused": engine.stats.paused_seconds - before[0],
                "resubmitted": engine.stats.resubmitted - before[1], "load": load()})
    rows = [
        "| weight_update | versions served / published | lag s mean / max | wall s (per rep) | "
        "vs no updates | tokens/s | inside pause s | paused s | versions per response "
        "mean / max | resubmitted | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    wall = {mode: sum(r["seconds"] for r in runs) for mode, runs in results.items()}
    for mode, runs in results.items():
        spans = [len(set(c.versions)) for r in runs for c in r["completions"] if c.versions]
        tokens = sum(len(c.response_ids) for r in runs for c in r["completions"])
        updates = [u for r in runs for u in r["updates"]]
        lag = (f"{statistics.mean(u['lag'] for u in updates):.2f} / "
               f"{max(u['lag'] for u in updates):.2f}" if updates else "")
        versus = ratios([r["seconds"] for r in runs], [r["seconds"] for r in results["none"]]
                        ) if "none" in results else ""
        rows.append(
            f"| {'none (no update)' if mode == 'none' else mode} | "
            f"{len(updates)} / {sum(r['published'] for r in runs)} | {lag} | "
            f"{per_rep([r['seconds'] for r in runs])} | {versus} | "
            f"{tokens / wall[mode]:,.0f} | "
            f"{sum(u['pause'] for u in updates):.2f} | {sum(r['paused'] for r in runs):.2f} | "
            f"{statistics.mean(spans):.2f} / {max(spans)} | "
            f"{sum(r['resubmitted'] for r in runs)} | {', '.join(r['load'] for r in runs)} |")
    if "keep" in wall and "between_requests" in wall:
        ratio = ratios([r["seconds"] for r in results["between_requests"]],
                       [r["seconds"] for r in results["keep"]])
        rows.append(f"| between_requests / keep (per rep) | | | | **{ratio}** | | | | | | |")
    return rows


# ---- table 3: replicas -------------------------------------------------------------------
def round_robin(replicas: int):
    def route(i: int, prompt: list[int]):
        return i % replicas, None
    return route


def least_loaded(router: Router, max_tokens: int, group: int):
    """Routing by the rollout service's router (no sessions: single-turn requests)."""
    def route(i: int, prompt: list[int]):
        cost = len(prompt) + group * max_tokens
        replica = router.route(None, cost)
        return replica, lambda: router.done(replica, cost)
    return route


async def replicas_table(both, tok: CheckpointTokenizer, path: str, args) -> list[str]:
    singles = []
    try:
        for core in (0, 1):
            singles.append(make_engine(path, tok, args.max_tokens, cores=[core]))
            seconds = await started(singles[-1])
            print(f"engine on core {core} started in {seconds:.0f} s (+ construction)",
                  flush=True)
        prompts = [tok.encode_prompt(p) for p in prompts_for(args.requests, seed=2000)]
        ways = {
            "1 engine, cores 0,1": ([both], None),
            "2 engines (cores 0 / 1), round-robin": (singles, round_robin(2)),
            "2 engines (cores 0 / 1), least-loaded": (
                singles, least_loaded(Router(2), args.max_tokens, args.group)),
        }
        cores = {way: " / ".join(worker_cores(e) for e in engines)
                 for way, (engines, _) in ways.items()}
        results = {way: [] for way in ways}
        for rep in range(args.reps):
            order = list(ways) if rep % 2 == 0 else list(ways)[::-1]
            for way in order:
                engines, route = ways[way]
                for engine in engines:
                    await engine.engine.reset_prefix_cache()
                seconds, completions = await requests_run(engines, prompts, args, seed=rep,
                                                          route=route)
                tokens = sum(len(c.response_ids) for c in completions)
                results[way].append((tokens / seconds, seconds, load()))
        rows = [
            "| replicas (tp=1) | worker threads' cores (threads) | requests x samples | "
            "tokens/s (per rep) | vs 1 engine | load avg |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        base = [r[0] for r in results["1 engine, cores 0,1"]]
        for way, runs in results.items():
            rows.append(
                f"| {way} | {cores[way]} | {len(prompts)} x {args.group} | "
                f"{', '.join(f'{r[0]:,.0f}' for r in runs)} | "
                f"{ratios([r[0] for r in runs], base)} | "
                f"{', '.join(r[2] for r in runs)} |")
        return rows
    finally:
        for engine in singles:
            await engine.close()


# ---- main --------------------------------------------------------------------------------
async def run(args) -> None:
    with tempfile.TemporaryDirectory() as root:
        path, state_dict = write_checkpoint(Path(root), args.typical_tokens)
        tok = CheckpointTokenizer(path)
        start = time.perf_counter()
        engine = make_engine(path, tok, args.max_tokens)
        built = time.perf_counter() - start
        try:
            seconds = await started(engine)
            print(f"engine on cores {worker_cores(engine)}: constructed in {built:.0f} s, "
                  f"start() (first log-prob request) {seconds:.1f} s; load {load()}", flush=True)
            if "episodes" in args.sections:
                print("\n" + "\n".join(await episodes_table(engine, tok, args)), flush=True)
            if "updates" in args.sections:
                print("\n" + "\n".join(await updates_table(engine, tok, state_dict, args)),
                      flush=True)
            if "replicas" in args.sections:
                print("\n" + "\n".join(await replicas_table(engine, tok, path, args)),
                      flush=True)
        finally:
            await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="*", default=["episodes", "updates", "replicas"],
                        choices=["episodes", "updates", "replicas"])
    parser.add_argument("--typical-tokens", type=float, default=24.0,
                        help="1 / the end token's mean probability per position")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_new_tokens")
    parser.add_argument("--rows", type=int, default=16, help="episodes table: rows")
    parser.add_argument("--group", type=int, default=4, help="episodes per row; samples per "
                        "request in the other tables")
    parser.add_argument("--turns", type=int, default=4, help="environment steps per episode")
    parser.add_argument("--env-median", type=float, default=0.2, help="seconds")
    parser.add_argument("--env-sigma", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3,
                        help="rounds of each table, the order of its paths reversed each round")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--update-every", type=float, default=2.0, help="seconds")
    parser.add_argument("--modes", nargs="*", choices=["none", "between_requests", "keep", "abort"],
                        default=["none", "between_requests", "keep", "abort"],
                        help="updates table: generator.weight_update modes (none: no update)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"load average {load()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    asyncio.run(run(args))
    print(f"load average {load()} at the end", flush=True)


if __name__ == "__main__":
    main()
