"""Train-step benchmark: our path versus a bare torchtitan loop, side by side, as ratios.

Run from the repository root (so that the Monarch proc can import this module)::

    .venv/bin/python -m bench.train_step                  # qwen3 small, 8 x 128 tokens
    .venv/bin/python -m bench.train_step --flavor tiny --steps 10 --no-actor --ga 1,4
    .venv/bin/python -m bench.train_step --no-actor --no-memory   # hf vs titan engine only

Three sections, each printed as a table:

1. **In-process throughput.** One :class:`TitanEngine`; on its model object
   (``engine.model_parts[0]``, ``engine.optimizers``, ``engine.lr_schedulers``) steps of
   ``engine.train_batch`` alternate with steps of :func:`bare_train_step`, a bare torchtitan
   loop (``torchtitan/trainer.py`` ``Trainer.train_step`` without logging or checkpointing:
   zero_grad, per microbatch forward + ``F.cross_entropy(reduction="sum") / global valid
   tokens`` + backward, ``clip_grad_norm_``, optimizer step, LR step). Order alternates each
   pair (AB, BA, ...) after a warmup. Tokens/s = ``input_ids.numel()`` / step seconds
   (padding included), median over steps; "vs bare" is the median of the per-round ratios
   (path tokens/s / bare tokens/s of the neighbouring step) with a distribution-free 95%
   confidence interval.
2. **RLTrainer actor.** One Monarch proc running :class:`BenchTrainer`, an ``RLTrainer`` with
   one extra endpoint that runs the same bare loop on the actor's engine. Alternating calls of
   ``RLTrainer.train_step`` (through the ``TrainerHandle``, as a controller uses it) and of
   that bare endpoint, with the same batch payload. Times are taken in the controller (round
   trip: request pickling, RPC, the endpoint, reply) and inside the actor (``train_batch``'s
   own ``tokens_per_second``, and the bare loop's own timer). The headline ratio compares the
   controller's view of ``train_step`` with the bare loop in the same process as the model.
3. **Peak memory versus gradient accumulation** on the same batch (GA = 1, 2, 4, 8 by default),
   engine and bare loop on models with the same weights, after one warmup step (so the
   optimizer state, created on the first step, is not counted):
   - *saved activations*: ``torch.autograd.graph.saved_tensors_hooks`` count the bytes of every
     tensor autograd saves for backward (unique storages, parameters excluded) while they are
     alive; the peak over one step is exactly the activation memory, and deterministic.
   - *peak tensor memory*: a ``TorchDispatchMode`` counts every storage allocated during the
     step while it is alive (activations, gradients, logits, temporaries; exact sizes, no
     allocator caching): the CPU analogue of ``torch.cuda.max_memory_allocated`` minus the
     memory allocated before the step. FSDP2's unsharded-parameter buffers, which torchtitan
     keeps even on one rank and grows/frees by resizing storage in place, are not seen.
   - with ``--rss``: a fresh process per row builds the engine, resets the kernel's
     high-water mark (``/proc/self/clear_refs`` 5), runs one step and reports ``VmHWM`` minus
     the RSS before the step (on CUDA: peak allocated growth). This includes the optimizer
     state created on that first step and allocator slack; slow (a process per row) and noisy.

4. **Engine backends, hf versus titan**, on the same model: the flavor's weights written once
   as an HF checkpoint (``transformers``' own init, seeded), then a :class:`TitanEngine`
   (``model.flavor: hf``, torchtitan's decoder) and an ``HFEngine`` (``trainer.engine: hf``,
   transformers' ``AutoModelForCausalLM``) built from it with the same ``trainer:`` section
   (SDPA attention both), steps of ``train_batch`` alternating as in section 1. The first
   step's losses are printed (equal weights, equal batch: they agree to ~1e-6). "vs titan" is
   the median per-round ratio hf tokens/s / titan tokens/s. Needs a forge_ext small flavor
   (``tiny``, ``small``: flavors with HF config fields).

Absolute timings on a shared 2-core machine are noisy; ratios measured side by side much less.
Every process runs one torch thread by default (``--threads``): with two OpenMP threads on two
cores shared with other jobs (load average ~7), the per-round ratios spread from 0.56 to 1.08
(p25-p75) in one run here, against 0.94 to 1.01 with one thread.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # ``python bench/train_step.py``: make ``bench`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import forge_ext  # noqa: F401, E402  (must precede any torchtitan import: CPU device fix)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from monarch.actor import endpoint, this_host  # noqa: E402
from monarch.spmd import setup_torch_elastic_env_async  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from forge_ext.actors.trainer import RLTrainer, TrainerHandle  # noqa: E402
from forge_ext.engine import (  # noqa: E402
    IGNORE_INDEX,
    TitanEngine,
    cross_entropy_loss,
    engine_config_from_mapping,
    valid_tokens,
)
from bench.common import SavedActivations, make_batch  # noqa: E402
from forge_ext.engine.distributed import free_port, init_single_process_env  # noqa: E402
from forge_ext.engine.models import build_model_spec  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


# ---- workload ---------------------------------------------------------------------------
def trainer_mapping(args: argparse.Namespace, ga: int) -> dict[str, Any]:
    """The YAML ``trainer:`` section benchmarked (same schema as apps and tests)."""
    return {
        "model": {"name": args.model, "flavor": args.flavor},
        "training": {
            "local_batch_size": args.batch,
            "seq_len": args.seq,
            "gradient_accumulation_steps": ga,
        },
        "optimizer": {"lr": 1e-4},
        "seed": args.seed,
    }


def vocab_size(engine: TitanEngine) -> int:
    return engine.model_spec.model.vocab_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the baseline -----------------------------------------------------------------------
def bare_train_step(engine: TitanEngine, batch: dict[str, torch.Tensor], num_microbatches: int):
    """One optimizer step the way ``torchtitan/trainer.py`` ``Trainer.train_step`` takes it,
    on the engine's model, optimizers and LR schedulers, without any forge_ext code:
    zero_grad, per microbatch forward + summed cross entropy / global valid tokens + backward,
    ``clip_grad_norm_``, optimizer step, LR step. No validation, no host syncs, no metrics.
    Like torchtitan's trainer (and unlike the engine) it lets FSDP reduce gradients after
    every microbatch; on one rank that reduction is a local copy.
    """
    model = engine.model_parts[0]
    device = engine.device
    engine.optimizers.zero_grad()
    microbatches = [
        dict(zip(batch, parts))
        for parts in zip(*(v.chunk(num_microbatches) for v in batch.values()))
    ]
    global_valid = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches).to(device)
    with engine.train_context():
        for mb in microbatches:
            labels = mb["labels"].to(device)
            logits = model(mb["input_ids"].to(device))
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(0, 1),
                ignore_index=IGNORE_INDEX, reduction="sum",
            ) / global_valid
            del logits  # as torchtitan's ``del pred``: not kept alive during backward
            loss.backward()
    dist_utils.clip_grad_norm_(
        [p for m in engine.model_parts for p in m.parameters()],
        engine.config.training.max_norm,
        foreach=True,
        pp_mesh=engine.parallel_dims.get_optional_mesh("pp"),
        ep_enabled=engine.parallel_dims.ep_enabled,
    )
    engine.optimizers.step()
    engine.lr_schedulers.step()


def engine_train_step(engine: TitanEngine, batch: dict[str, torch.Tensor]) -> dict:
    return engine.train_batch(batch, cross_entropy_loss, valid_tokens)


# ---- timing helpers ---------------------------------------------------------------------
def interleaved(
    paths: dict[str, Callable[[], float]], steps: int, warmup: int
) -> dict[str, list[float]]:
    """Call each path ``warmup`` times, then ``steps`` times each, in pairs/rounds whose order
    rotates every round (AB, BA, ...), so drift and noise fall on every path alike.
    Each callable returns its own step seconds (so it may time itself remotely)."""
    names = list(paths)
    for _ in range(warmup):
        for name in names:
            paths[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            seconds[name].append(paths[name]())
    return seconds


def timed(fn: Callable[[], Any], device: torch.device) -> Callable[[], float]:
    def run() -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    return run


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95% confidence interval (order statistics at ranks
    ``n/2 -+ 1.96 sqrt(n)/2``; no normality assumed)."""
    v = sorted(values)
    n = len(v)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(int(math.floor(n / 2 - half)), 0), min(int(math.ceil(n / 2 + half)), n - 1)
    return statistics.median(v), v[lo], v[hi]


def row(label: str, what: str, secs: list[float], ref: list[float] | None, tokens: int):
    """A table row: median step ms and tokens/s; against ``ref`` (timed in the same rounds,
    neighbours in time): the median of the per-round tokens/s ratios with its 95% confidence
    interval, and the step-time overhead that ratio implies."""
    med = statistics.median(secs)
    cells = [label, what, f"{med * 1e3:.1f}", f"{tokens / med:,.0f}"]
    if ref is None:
        return cells + ["1.000 (ref)", "", ""]
    ratio, lo, hi = median_ci([r / s for s, r in zip(secs, ref)])
    return cells + [f"{ratio:.3f}", f"{lo:.3f}-{hi:.3f}", f"{(1 / ratio - 1) * 100:+.1f}%"]


HEADERS = ["path", "what is timed", "step ms (median)", "tokens/s (median)",
           "vs bare (median per-round ratio)", "95% CI", "step-time overhead"]


# ---- section 1: in-process --------------------------------------------------------------
def bench_in_process(args, batch) -> list[list[str]]:
    engine = TitanEngine(trainer_mapping(args, args.timing_ga))
    dev = engine.device
    secs = interleaved(
        {
            "bare": timed(lambda: bare_train_step(engine, batch, args.timing_ga), dev),
            "engine": timed(lambda: engine_train_step(engine, batch), dev),
        },
        args.steps, args.warmup,
    )
    tokens = batch["input_ids"].numel()
    ga = f"GA={args.timing_ga}"
    rows = [
        row(f"bare torchtitan loop ({ga})", "in-process, same model object", secs["bare"],
            None, tokens),
        row(f"TitanEngine.train_batch ({ga})", "in-process, same model object",
            secs["engine"], secs["bare"], tokens),
    ]
    engine.close()
    return rows


# ---- section 4: engine backends, hf versus titan ------------------------------------------
ENGINE_HEADERS = ["engine", "model", "step ms (median)", "tokens/s (median)",
                  "vs titan (median per-round ratio)", "95% CI", "step-time overhead"]


def bench_engines(args, batch) -> tuple[list[list[str]], float, float]:
    """hf and titan engines on one HF checkpoint of the flavor; rows and first-step losses."""
    import tempfile

    from forge_ext.engine import build_engine
    from forge_ext.engine.models import HF_MODEL_TYPES, SMALL_FLAVORS
    from forge_ext.engine.hf_checkpoint import init_hf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars

    fields = SMALL_FLAVORS.get(args.model, {}).get(args.flavor)
    if fields is None:
        raise ValueError(f"--flavor={args.flavor}: the engine section needs a forge_ext small "
                         f"flavor of {args.model} ({sorted(SMALL_FLAVORS.get(args.model, {}))}) "
                         "or --no-engines")
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
        path = str(init_hf_checkpoint(tmp, HF_MODEL_TYPES[args.model], fields, seed=args.seed))
        mapping = trainer_mapping(args, args.timing_ga)
        model = {"hf_path": path, "attn_backend": "sdpa"}
        engines = {
            "titan": TitanEngine({**mapping, "model": {**model, "name": args.model,
                                                       "flavor": "hf"}}),
            "hf": build_engine({**mapping, "engine": "hf", "model": model}),
        }
    first = {name: engine_train_step(e, batch)["loss"] for name, e in engines.items()}
    secs = interleaved(
        {name: timed(lambda e=e: engine_train_step(e, batch), e.device)
         for name, e in engines.items()},
        args.steps, args.warmup,
    )
    tokens = batch["input_ids"].numel()
    what = f"{args.model} {args.flavor} (HF checkpoint), GA={args.timing_ga}"
    rows = [row("titan: TitanEngine.train_batch", what, secs["titan"], None, tokens),
            row("hf: HFEngine.train_batch", what, secs["hf"], secs["titan"], tokens)]
    for engine in engines.values():
        engine.close()
    return rows, first["titan"], first["hf"]


# ---- section 2: the RLTrainer actor -----------------------------------------------------
class BenchTrainer(RLTrainer):
    """``RLTrainer`` plus an endpoint running the bare loop on the actor's own engine, so the
    baseline runs in the same process, on the same model, as ``train_step``."""

    @endpoint
    async def bare_step(
        self, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]
    ) -> float:
        """The bare loop on this rank's batch; returns its seconds, timed in the actor."""
        rank = self.engine.dp_rank
        batch = {**inputs[rank], **targets[rank]}
        sync(self.engine.device)
        start = time.perf_counter()
        bare_train_step(self.engine, batch, self.engine.num_microbatches)
        sync(self.engine.device)
        return time.perf_counter() - start

    @endpoint
    async def num_threads(self) -> int:
        return torch.get_num_threads()


async def bench_actor(args, batch) -> tuple[list[list[str]], int]:
    mapping = trainer_mapping(args, args.timing_ga)
    config = engine_config_from_mapping(mapping)
    # The proc unpickles BenchTrainer by reference: it must find ``bench.train_step``.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p
    )
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        await setup_torch_elastic_env_async(procs)
        actor = procs.spawn("bench_trainer", BenchTrainer, mapping, None)
        await actor.setup.call()
        trainer = TrainerHandle(actor=actor, procs=procs, config=config, num_procs=1)
        actor_threads = await actor.num_threads.call_one()
        inputs, targets = [{"input_ids": batch["input_ids"]}], [{"labels": batch["labels"]}]
        tokens = batch["input_ids"].numel()
        in_actor: dict[str, list[float]] = {"engine": [], "bare": []}

        async def run_pairs(n: int, record: bool) -> dict[str, list[float]]:
            rtt: dict[str, list[float]] = {"train_step": [], "bare_endpoint": []}
            for i in range(n):
                order = ("train_step", "bare_endpoint") if i % 2 == 0 else (
                    "bare_endpoint", "train_step")
                for name in order:
                    start = time.perf_counter()
                    if name == "train_step":
                        metrics = await trainer.train_step(inputs, targets, return_metrics=True)
                        inner = tokens / metrics["tokens_per_second"]
                        key = "engine"
                    else:
                        values = await actor.bare_step.call(inputs, targets)
                        inner = list(values.values())[-1]
                        key = "bare"
                    elapsed = time.perf_counter() - start
                    if record:
                        rtt[name].append(elapsed)
                        in_actor[key].append(inner)
            return rtt

        await run_pairs(args.warmup, record=False)
        rtt = await run_pairs(args.steps, record=True)
        ga = f"GA={args.timing_ga}"
        ref = in_actor["bare"]
        rows = [
            row(f"bare torchtitan loop ({ga})", "in the actor proc, timed there", ref, None,
                tokens),
            row(f"TitanEngine.train_batch ({ga})", "in the actor proc, timed there",
                in_actor["engine"], ref, tokens),
            row(f"RLTrainer.train_step ({ga})", "controller round trip (RPC + endpoint)",
                rtt["train_step"], ref, tokens),
            row("bare-loop endpoint", "controller round trip (RPC + endpoint)",
                rtt["bare_endpoint"], ref, tokens),
        ]
        for name, inner in (("train_step", "engine"), ("bare_endpoint", "bare")):
            rpc_ms, lo, hi = median_ci(
                [(a - b) * 1e3 for a, b in zip(rtt[name], in_actor[inner])])
            rows.append([
                f"RPC cost of {name}", "round trip - time inside the actor, per call (ms)",
                f"{rpc_ms:.1f}", "", "", f"{lo:.1f}-{hi:.1f} ms", "",
            ])
        await actor.cleanup.call()
    finally:
        await procs.stop()
    return rows, actor_threads


# ---- section 3: memory ------------------------------------------------------------------
class LiveTensorMemory(TorchDispatchMode):
    """Tracks the bytes of tensor storages allocated while active and still alive.

    Every op output whose storage is not one of the op's inputs' storages (so not a view, not
    an in-place or ``out=`` result) is a new allocation; a weak reference on its storage
    subtracts it when freed. ``peak`` is the CPU analogue of ``torch.cuda.max_memory_allocated``
    minus the memory allocated before: activations, gradients, temporaries (exact sizes, no
    allocator rounding or caching). Tensors that existed before (weights, optimizer state,
    the batch) are not counted.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> local
        return local.untyped_storage()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            self._storage(t).data_ptr()
            for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = self._storage(t)
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in inputs or ptr in self.live or nbytes == 0:
                continue
            self.live[ptr] = (weakref.ref(storage, lambda _, p=ptr: self._free(p)), nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out

    def _free(self, ptr: int) -> None:
        _, nbytes = self.live.pop(ptr)
        self.current -= nbytes


def peak_tensor_memory(step: Callable[[], Any]) -> int:
    with LiveTensorMemory() as tracker:
        step()
    return tracker.peak


def saved_activation_peak(step: Callable[[], Any]) -> int:
    with SavedActivations() as tracker:
        step()
    assert tracker.live == 0, f"{tracker.live} bytes of saved activations outlived the step"
    return tracker.peak


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _peak_step_memory_worker(mapping: dict, ga: int, path: str, seed: int, queue) -> None:
    """In a fresh process: build the engine, then measure the high-water mark of one step."""
    try:
        os.environ["MASTER_PORT"] = str(free_port())  # the parent's store holds its port
        init_single_process_env()
        engine = TitanEngine(mapping)
        cfg = engine.config.training
        batch = make_batch(cfg.local_batch_size, cfg.seq_len, vocab_size(engine), seed)
        step = (
            (lambda: engine_train_step(engine, batch)) if path == "engine"
            else (lambda: bare_train_step(engine, batch, ga))
        )
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            queue.put(torch.cuda.max_memory_allocated() - before)
        else:
            before = _vm_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
                f.write("5")
            step()
            queue.put((_vm_kib("VmHWM") - before) * 1024)
    except BaseException as e:  # report, don't hang the parent
        queue.put(repr(e))


def peak_step_memory(mapping: dict, ga: int, path: str, seed: int) -> int | None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_step_memory_worker, args=(mapping, ga, path, seed, queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join()
    if isinstance(result, str):
        print(f"peak-memory worker (GA={ga}, {path}) failed: {result}", file=sys.stderr)
        return None
    return result


def bench_memory(args, batch) -> list[list[str]]:
    reference = TitanEngine(trainer_mapping(args, 1))  # the bare loop runs on this model
    engines = {ga: TitanEngine(trainer_mapping(args, ga)) for ga in args.ga}
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in reference.model_state_dict().items()}
    # Warm up once: the optimizer state (created on the first step) is then not counted.
    bare_train_step(reference, batch, 1)
    for engine in engines.values():
        engine.load_model_state_dict(state)  # the seed makes them equal; be explicit
        engine_train_step(engine, batch)
    rss_kind = "peak allocated growth" if torch.cuda.is_available() else "peak RSS growth"
    mib = lambda b: "n/a" if b is None else f"{b / MiB:.1f}"  # noqa: E731
    rows, first = [], None
    for ga, engine in engines.items():
        saved_engine = saved_activation_peak(lambda: engine_train_step(engine, batch))
        saved_bare = saved_activation_peak(lambda: bare_train_step(reference, batch, ga))
        peak_engine = peak_tensor_memory(lambda: engine_train_step(engine, batch))
        peak_bare = peak_tensor_memory(lambda: bare_train_step(reference, batch, ga))
        first = first or (saved_engine, peak_engine)
        cells = [
            ga, args.batch // ga, mib(saved_engine), mib(saved_bare),
            f"{saved_engine / first[0]:.3f}", mib(peak_engine), mib(peak_bare),
            f"{(peak_engine - peak_bare) / MiB:+.1f}", f"{peak_engine / first[1]:.3f}",
        ]
        if args.rss:
            cells += [mib(peak_step_memory(trainer_mapping(args, ga), ga, path, args.seed))
                      for path in ("engine", "bare")]
        rows.append(cells)
        engine.close()
    reference.close()
    headers = ["GA", "microbatch", "saved act. MiB (engine)", "saved act. MiB (bare)",
               "saved act. vs GA=1", "peak tensor MiB (engine)", "peak tensor MiB (bare)",
               "engine - bare", "peak vs GA=1"]
    if args.rss:
        headers += [f"{rss_kind} MiB (engine, fresh proc)", f"{rss_kind} MiB (bare)"]
    return [headers, *rows]


# ---- main -------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3", help="model.name (qwen3 or llama3)")
    p.add_argument("--flavor", default="small", help="model.flavor (tiny, small, debugmodel...)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (local batch)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=100, help="timed steps per path and section")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per path first")
    p.add_argument("--timing-ga", type=int, default=1,
                   help="gradient accumulation steps of the throughput sections")
    p.add_argument("--ga", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8],
                   help="comma-separated GA factors of the memory section")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-actor", dest="actor", action="store_false",
                   help="skip the RLTrainer actor section")
    p.add_argument("--rss", action="store_true",
                   help="add peak RSS growth of one step in a fresh process per row (slow)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in every process; 0: torch's default. One by default: "
                        "on a shared 2-core machine, OpenMP threads that spin while other "
                        "jobs hold the cores make per-step times erratic")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the memory section")
    p.add_argument("--no-engines", dest="engines", action="store_false",
                   help="skip the hf-versus-titan engine section")
    p.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="skip the in-process engine-versus-bare-loop section")
    args = p.parse_args(argv)
    for ga in [args.timing_ga, *args.ga]:
        if ga <= 0 or args.batch % ga:
            p.error(f"--batch={args.batch} is not divisible by gradient accumulation {ga}")
    return args


def quiet_logs() -> None:
    """Keep the tables readable: torchtitan logs on the root logger (INFO once Monarch has set
    it up, and a warning per engine build that applies to neither path)."""
    logging.getLogger().setLevel(logging.ERROR)


def main(argv=None) -> None:
    args = parse_args(argv)
    quiet_logs()
    start = time.perf_counter()
    if args.threads:
        # OMP_NUM_THREADS reaches the Monarch proc and the --rss worker processes.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    init_single_process_env()
    engine_config_from_mapping(trainer_mapping(args, 1))  # validate before any work
    vocab = build_model_spec(args.model, args.flavor).model.vocab_size
    batch = make_batch(args.batch, args.seq, vocab, args.seed)
    print(f"# bench/train_step.py: {args.model} {args.flavor}, batch {args.batch} x {args.seq} "
          f"tokens, {args.steps} timed steps per path (+{args.warmup} warmup), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(" ".join(["# command: python -m bench.train_step",
                    *(argv if argv is not None else sys.argv[1:])]))

    if args.in_process:
        t0 = time.perf_counter()
        in_proc = bench_in_process(args, batch)
        print(f"\n## Throughput, one process (bare loop and engine alternate on the same "
              f"model; {time.perf_counter() - t0:.0f} s)")
        print(tabulate(in_proc, headers=HEADERS, disable_numparse=True))

    if args.actor:
        t0 = time.perf_counter()
        actor_rows, threads = asyncio.run(bench_actor(args, batch))
        quiet_logs()
        print(f"\n## Throughput, RLTrainer actor (one Monarch proc, {threads} torch threads; "
              f"'vs bare' against the bare loop timed inside that proc; "
              f"{time.perf_counter() - t0:.0f} s)")
        print(tabulate(actor_rows, headers=HEADERS, disable_numparse=True))

    if args.memory:
        t0 = time.perf_counter()
        headers, *mem_rows = bench_memory(args, batch)
        print(f"\n## Peak memory versus gradient accumulation (same {args.batch} x {args.seq} "
              f"batch, one train step; {time.perf_counter() - t0:.0f} s)")
        print(tabulate(mem_rows, headers=headers, disable_numparse=True))
    if args.engines:
        t0 = time.perf_counter()
        engine_rows, titan_loss, hf_loss = bench_engines(args, batch)
        quiet_logs()
        print(f"\n## Engine backends, hf vs titan (same HF checkpoint and batch, steps "
              f"alternating in one process; first-step loss titan {titan_loss:.6f}, hf "
              f"{hf_loss:.6f}; {time.perf_counter() - t0:.0f} s)")
        print(tabulate(engine_rows, headers=ENGINE_HEADERS, disable_numparse=True))
    print(f"\n# total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    # Run the importable module, not ``__main__``: Monarch pickles BenchTrainer by reference
    # and multiprocessing's spawn re-imports the worker's module by name.
    from bench import train_step

    train_step.main()
