"""Pipeline-parallel benchmark: step time and peak memory per stage for PP=1 versus PP=2 (same
model, batch and number of microbatches), and the measured pipeline bubble against the
schedule's theoretical ``(p - 1) / (m + p - 1)``.

Run from the repository root::

    .venv/bin/python -m bench.pipeline                       # 1.5-4 min on 2 CPU cores
    .venv/bin/python -m bench.pipeline --microbatches 4 --schedules 1F1B --steps 4

Setup. A qwen3 decoder (default 8 layers, dim 256, FFN 768, vocab 512; a ``config.json`` plus
random ``model.safetensors`` written to a temp dir, loaded through ``model.flavor: hf`` so
every config starts from the same weights), batch ``B`` x ``S`` tokens, cross entropy. For each
``m`` in ``--microbatches``:

- **PP=1**: one process, ``training.gradient_accumulation_steps = m`` (m microbatches of
  ``B/m`` sequences, forward + backward each, one optimizer step).
- **PP=2** per schedule in ``--schedules``: two processes (one stage each, gloo), one
  ``schedule.step`` over ``m`` PP microbatches of ``B/m`` sequences
  (``parallelism.pipeline_parallel_microbatch_size = B/m``), one optimizer step.

Every process runs with ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1``: PP=2 uses two
processes on two cores where PP=1 uses one, so each stage computes with one core in both cases
(PP=2 therefore has twice the cores of PP=1, as it would have twice the devices).

The PP=1 group (``torchrun --nproc-per-node 1``) and the PP=2 group (``--nproc-per-node 2``)
are launched once, build an engine per config, warm up, and then wait on this driver's
``TCPStore``; the driver runs one step of one config at a time, every config once per round,
in an order reversed every round, so load from other jobs falls on every config alike.
See ``bench/_pipeline_worker.py`` for what is timed.

Columns:

- *step ms*: median over rounds of the step's wall time (``engine.train_batch``: zero_grad,
  forward/backward of all microbatches, clipping, optimizer step, LR step); under PP the
  slowest stage's time of each step.
- *vs PP=1*: median over rounds of (PP=2 step / PP=1 step of the same ``m`` in that round);
  *min vs min*: fastest PP=2 step / fastest PP=1 step (other jobs only ever add time, so the
  minima are the least disturbed steps).
  *ideal*: the ratio a balanced pipeline with free communication would reach:
  ``(1 - o) (m + p - 1) / (p m) + o / p``, with ``o`` PP=1's measured share of the step in
  ``optimizer_step`` (clipping + AdamW), which each PP rank runs on its own stage only.
- *busy ms*: per rank, median seconds inside the stage's ``forward_one_chunk``,
  ``backward_one_chunk`` and the loss (rank = stage for GPipe and 1F1B; an interleaved
  schedule's rank holds ``v`` stages).
- *bubble*: per rank, median over rounds of ``1 - busy / wall(schedule.step)``: the fraction
  of the pipeline's step a rank spends waiting (send/recv, idle in fill/drain) or in schedule
  bookkeeping. *theory*: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B (the same bubble; Huang
  et al. 2019, Narayanan et al. 2021), ``(p - 1) / (v m + p - 1)`` for Interleaved1F1B;
  it assumes equal stages and free communication. On a loaded machine, preemption inside
  a computation counts as busy, so the measured bubble reads low.
- *activations peak MiB*: per stage, the peak bytes of tensors autograd saved for backward
  during one step (``saved_tensors_hooks``; weights, and FSDP's unsharded copies of them,
  excluded); deterministic. GPipe keeps all ``m`` microbatches' activations alive, 1F1B at
  most ``p - stage`` of them. Not counted: the stage's boundary buffers (``B/m`` x ``S`` x
  dim floats per microbatch in flight), temporaries, allocator slack, and the unsharded
  parameter and gradient buffers of the FSDP wrapper the engine applies even on a one-rank
  mesh (under PP, torchtitan keeps the unsharded parameters from forward to backward and
  the stage defers gradient reduction to the last microbatch, so they stay allocated for the
  whole step).
  *model state MiB*: parameters + gradients + AdamW's two moments of the stage.
  On CUDA (one GPU per PP rank, so 2 GPUs) both are replaced by
  ``torch.cuda.max_memory_allocated`` over the step.

Absolute times on a shared 2-core machine are noisy (the load average is printed); ratios of
steps taken in the same rounds are less so, but PP=2 needs both cores and suffers more from
other jobs than PP=1 does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

# The driver waits on its store in 1 s slices; each timeout would log a c10d warning.
_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402
from tabulate import tabulate  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
PP = 2


# Schedules whose bubble the formulas below describe: GPipe and 1F1B (one stage per rank,
# v = 1) and interleaved 1F1B (v stages per rank). Zero-bubble schedules (ZBV, DualPipeV,
# InterleavedZeroBubble) split backward and have other bubbles: no theory column for them.
BUBBLE_FORMULA_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def theoretical_bubble(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a GPipe/1F1B step with ``p`` equal stages and ``m`` microbatches,
    ``(p - 1) / (m + p - 1)``; with ``v`` interleaved stages per rank the fill/drain shrinks
    ``v``-fold: ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, Megatron-LM, sec. 2.2)."""
    return (p - 1) / (v * m + p - 1)


def ideal_ratio(p: int, m: int, v: int = 1, optimizer_share: float = 0.0) -> float:
    """PP=p step time / PP=1 step time of a balanced pipeline with free communication.

    Forward/backward: ``(v m + p - 1)`` slots of ``1/(p v)`` of the work against ``m`` full
    slots; the optimizer part (``optimizer_share`` of PP=1's step: clipping + optimizer step)
    shrinks to ``1/p`` since each rank updates its own stage."""
    pipeline = (v * m + p - 1) / (p * v * m)
    return (1 - optimizer_share) * pipeline + optimizer_share / p


# ---- plan -------------------------------------------------------------------------------
def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model, as HF ``config.json`` fields (``Qwen3Config`` names); untied embeddings
    (pipeline parallelism cannot split tied weights)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": args.vocab, "hidden_size": args.dim,
        "intermediate_size": args.ffn, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.dim // args.heads, "max_position_embeddings": max(args.seq, 128),
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def make_plan(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    hf_dir = os.path.join(workdir, "hf")
    os.makedirs(hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_config(args), f, indent=1)
    mapping = {  # the YAML ``trainer:`` section, without the microbatch fields
        "model": {"name": "qwen3", "flavor": "hf", "hf_path": hf_dir},
        "training": {"local_batch_size": args.batch, "seq_len": args.seq, "max_norm": 1.0},
        "optimizer": {"lr": 1e-4},
        "dump_folder": os.path.join(workdir, "outputs"),
        "seed": args.seed,
    }
    pp1 = [{"name": f"PP=1 GA={m}", "pp": 1, "schedule": None, "microbatches": m}
           for m in args.microbatches]
    pp2 = [{"name": f"PP={PP} {s} m={m}", "pp": PP, "schedule": s, "microbatches": m}
           for m in args.microbatches for s in args.schedules]
    return {
        "mapping": mapping, "seed": args.seed, "warmup": args.warmup,
        "store_timeout_s": args.timeout, "weights_writer": "pp1",
        "groups": {"pp1": {"nproc": 1, "runs": pp1}, f"pp{PP}": {"nproc": PP, "runs": pp2}},
    }


# ---- driving the worker groups ----------------------------------------------------------
class Groups:
    """The torchrun launches of the plan's groups and the store that drives them."""

    def __init__(self, plan: dict[str, Any], workdir: str):
        self.plan, self.workdir = plan, workdir
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=plan["store_timeout_s"]))
        self.next_cmd = {g: 0 for g in plan["groups"]}
        plan_path = os.path.join(workdir, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f, indent=1)
        env = dict(os.environ)
        env.pop("TORCH_CPP_LOG_LEVEL", None)
        if _CPP_LOG_LEVEL is not None:
            env["TORCH_CPP_LOG_LEVEL"] = _CPP_LOG_LEVEL
        env.update(OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(
                       p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
        self.procs, self.logs = {}, {}
        for group, spec in plan["groups"].items():
            self.logs[group] = os.path.join(workdir, f"{group}.log")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(spec["nproc"]), "-m", "bench._pipeline_worker",
                   "--plan", plan_path, "--group", group,
                   "--store", f"127.0.0.1:{self.store.port}"]
            with open(self.logs[group], "w") as log:
                self.procs[group] = subprocess.Popen(
                    cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _wait(self, group: str, key: str) -> bytes:
        """Block until ``key`` is set; raise with the group's log tail if it fails first."""
        deadline = time.monotonic() + self.plan["store_timeout_s"]
        while True:
            try:  # blocks in the store (no polling) for up to a second at a time
                self.store.wait([key], timedelta(seconds=1))
                break
            except dist.DistStoreError:
                pass
            failed = [g for g in self.procs if self.store.check([f"{g}/error"])]
            dead = [g for g, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed or dead or time.monotonic() > deadline:
                g = (failed or dead or [group])[0]
                detail = (self.store.get(f"{g}/error").decode() if failed
                          else open(self.logs[g]).read()[-4000:])
                self.close()
                raise RuntimeError(f"worker group {g} failed while waiting for {key}:\n"
                                   f"{detail}")
        return self.store.get(key)

    def ready(self) -> dict[str, int]:
        """Wait until every group has built and warmed up its engines; torch threads per
        process, by group."""
        return {g: int(self._wait(g, f"{g}/ready")) for g in self.procs}

    def command(self, group: str, op: str, run: int = 0) -> list[dict[str, Any]]:
        """Run ``op`` (``step``, ``memory``) of the group's ``run``-th config; per-rank results."""
        i = self.next_cmd[group]
        self.next_cmd[group] += 1
        self.store.set(f"{group}/cmd/{i}", json.dumps({"op": op, "run": run}))
        if op == "stop":
            return []
        return json.loads(self._wait(group, f"{group}/res/{i}"))

    def close(self) -> None:
        for group, proc in self.procs.items():
            if proc.poll() is None:
                self.command(group, "stop")
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun forwards SIGTERM to its workers
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


# ---- measurement ------------------------------------------------------------------------
def measure(args: argparse.Namespace, plan: dict[str, Any], groups: Groups):
    """Rounds of one step per config (order reversed each round), then one memory step per
    config. Returns ``{name: {"steps": [per-rank results per round], "memory": per-rank}}``."""
    runs = [(g, k, run) for g, spec in plan["groups"].items() for k, run in enumerate(spec["runs"])]
    results: dict[str, dict[str, Any]] = {run["name"]: {"run": run, "steps": []}
                                          for _, _, run in runs}
    for r in range(args.steps):
        for group, k, run in (runs if r % 2 == 0 else runs[::-1]):
            results[run["name"]]["steps"].append(groups.command(group, "step", k))
        print(f"# round {r + 1}/{args.steps} done", flush=True)
    for group, k, run in runs:
        results[run["name"]]["memory"] = groups.command(group, "memory", k)
    return results


def _per_stage(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in values)


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace):
    step_time = {  # per round, the slowest rank's step
        name: [max(rank["seconds"] for rank in ranks) for ranks in res["steps"]]
        for name, res in results.items()
    }
    rows = []
    for name, res in results.items():
        run, steps, memory = res["run"], res["steps"], res["memory"]
        p, m = run["pp"], run["microbatches"]
        secs = step_time[name]
        if p == 1:
            ratio, best, ideal, busy, bubble, theory = "1.000 (ref)", "", "", "", "", ""
        else:
            ref = step_time[f"PP=1 GA={m}"]
            ratio = f"{statistics.median(s / b for s, b in zip(secs, ref)):.3f}"
            best = f"{min(secs) / min(ref):.3f}"
            v = steps[0][0]["local_stages"]
            known = run["schedule"] in BUBBLE_FORMULA_SCHEDULES
            opt_share = statistics.median(
                st[0]["optimizer"] / st[0]["seconds"] for st in results[f"PP=1 GA={m}"]["steps"])
            ideal = f"{ideal_ratio(p, m, v, opt_share):.3f}" if known else "n/a"
            n_ranks = len(steps[0])
            busy = _per_stage([statistics.median(st[i]["busy"] for st in steps) * 1e3
                               for i in range(n_ranks)], "{:.0f}")
            bubble = _per_stage([statistics.median(1 - st[i]["busy"] / st[i]["wall"]
                                                   for st in steps)
                                 for i in range(n_ranks)], "{:.3f}")
            theory = f"{theoretical_bubble(p, m, v):.3f}" if known else "n/a"
        if memory[0]["kind"] == "cuda":
            mem = [_per_stage([r["peak_allocated"] / MiB for r in memory], "{:.1f}"), ""]
        else:
            mem = [_per_stage([r["saved_activations"] / MiB for r in memory], "{:.1f}"),
                   _per_stage([r["model_state"] / MiB for r in memory], "{:.1f}")]
        rows.append([
            name, m, args.batch // m, f"{statistics.median(secs) * 1e3:.0f}", ratio, best, ideal,
            busy, bubble, theory, *mem,
        ])
    cuda = results[next(iter(results))]["memory"][0]["kind"] == "cuda"
    headers = ["config", "m", "mb size", "step ms", "vs PP=1", "min vs min", "ideal", "busy ms",
               "bubble", "theory",
               "peak allocated MiB" if cuda else "activations peak MiB",
               "" if cuda else "model state MiB"]
    return headers, rows


# ---- main -------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--dim", type=int, default=256, help="hidden size")
    p.add_argument("--ffn", type=int, default=768, help="FFN (intermediate) size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--microbatches", type=_ints, default=[2, 4, 8],
                   help="comma-separated microbatch counts m per step")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=["1F1B", "GPipe"],
                   help="comma-separated PP schedules (torch.distributed.pipelining names)")
    p.add_argument("--steps", type=int, default=8, help="timed rounds (one step per config)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=900, help="seconds to wait on a worker")
    p.add_argument("--json", help="also write the raw per-rank results to this file")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, weights)")
    args = p.parse_args(argv)
    for m in args.microbatches:
        if m < PP or args.batch % m:
            p.error(f"--microbatches {m}: needs m >= {PP} (stages) and --batch={args.batch} "
                    "divisible by m")
    for name in args.schedules:  # fail here, not in the workers after their 15 s imports
        try:
            get_schedule_class(name)
        except ValueError:
            p.error(f"--schedules: {name!r} is not a torch.distributed.pipelining schedule "
                    "(e.g. 1F1B, GPipe, Interleaved1F1B)")
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error("--dim must be divisible by --heads, and --heads by --kv-heads")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="bench_pipeline_")
    plan = make_plan(args, workdir)
    load_before = os.getloadavg()[0]
    cfg = hf_config(args)
    print(f"# bench/pipeline.py: qwen3 {cfg['num_hidden_layers']} layers, dim {cfg['hidden_size']}"
          f", FFN {cfg['intermediate_size']}, vocab {cfg['vocab_size']}; batch {args.batch} x "
          f"{args.seq} tokens; {args.steps} timed rounds (+{args.warmup} warmup steps); "
          f"{os.cpu_count()} CPUs")
    print("# command: python -m bench.pipeline " + " ".join(
        argv if argv is not None else sys.argv[1:]), flush=True)
    groups = Groups(plan, workdir)
    try:
        threads = groups.ready()
        print(f"# engines built and warmed up ({time.perf_counter() - start:.0f} s); torch "
              f"threads per process: {threads} (OMP_NUM_THREADS=1): each stage computes on "
              "one core", flush=True)
        results = measure(args, plan, groups)
    finally:
        groups.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"# kept {workdir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    headers, rows = table(results, args)
    print(f"\n## PP=1 vs PP={PP}: step time, bubble and memory per rank (rank 0 / rank 1)")
    print(tabulate(rows, headers=headers, disable_numparse=True))
    n_params = [r["num_params"] for r in next(iter(results.values()))["memory"]]
    print(f"\n# parameters: {n_params[0]:,} (PP=1); load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
