"""Worker of ``bench/pipeline.py``: one torchrun process (one pipeline stage, or the whole model
for PP=1) that builds a :class:`TitanEngine` per benchmarked config, then measures whichever
config the driver names, one command at a time.

Launched by the driver, one torchrun per group (``pp1``: 1 process, ``pp2``: 2 processes)::

    python -m torch.distributed.run --standalone --nproc-per-node P -m bench._pipeline_worker \
        --plan plan.json --group pp2 --store 127.0.0.1:PORT

Both groups stay alive side by side and block on the driver's ``TCPStore`` between commands,
so steps of PP=1 and PP=2 configs alternate in time (the driver rotates the order each
round) and load from other jobs on the machine falls on every config alike.

Protocol (keys of the driver's store): rank 0 of the group writing the weights sets
``weights_ready``; each group sets ``<group>/ready`` after building and warming up its engines;
the driver sets ``<group>/cmd/<i>`` = ``{"op": "step"|"memory"|"stop", "run": k}``; rank 0
answers ``<group>/res/<i>`` with the per-rank results; any failure sets ``<group>/error``.

Measured per command and rank:

- ``step`` -- **seconds** of ``engine.train_batch`` (zero_grad, forward/backward over all
  microbatches, grad clipping, optimizer step, LR step), after a ``dist.barrier``; under PP
  also **busy** and **wall**: seconds inside the stage's ``forward_one_chunk``,
  ``backward_one_chunk`` and the schedule's ``_compute_loss`` (the loss, last stage), and the
  wall seconds of ``schedule.step``. Everything else inside ``step`` (send/recv waits,
  schedule bookkeeping) is idle: bubble = 1 - busy / wall.
- ``memory`` -- one more step. On CPU under a ``saved_tensors_hooks`` counter: the peak bytes
  of tensors autograd saves for backward (activations; parameters excluded), plus the bytes
  of the rank's parameters, gradients and optimizer state. On CUDA:
  ``torch.cuda.max_memory_allocated`` over the step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import forge_ext  # noqa: F401, E402  (must precede any torchtitan import: CPU device fix)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from forge_ext.engine import (  # noqa: E402
    TitanEngine,
    cross_entropy_loss,
    valid_tokens,
)
from bench.common import SavedActivations, make_batch  # noqa: E402
from forge_ext.engine.distributed import init_single_process_env  # noqa: E402
from forge_ext.engine.models import build_model_spec  # noqa: E402


# ---- workload ---------------------------------------------------------------------------
def run_mapping(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The engine config of one run: PP=1 splits the batch into ``microbatches`` gradient-
    accumulation microbatches; PP=p runs one ``schedule.step`` over ``microbatches`` PP
    microbatches of the same size. Same model, batch and microbatch size either way."""
    mapping = json.loads(json.dumps(base))
    batch = mapping["training"]["local_batch_size"]
    m = run["microbatches"]
    if run["pp"] == 1:
        mapping["training"]["gradient_accumulation_steps"] = m
    else:
        mapping["parallelism"] = {
            "pipeline_parallel_degree": run["pp"],
            "pipeline_parallel_microbatch_size": batch // m,
            "pipeline_parallel_schedule": run["schedule"],
        }
    return mapping


def write_random_weights(mapping: dict[str, Any], seed: int) -> None:
    """Write ``model.safetensors`` with random weights (std 0.02, norms 1) into
    ``model.hf_path``, in HF layout (names and shapes from torchtitan's state-dict adapter), so
    every run loads the same weights."""
    from safetensors.torch import save_file

    model = mapping["model"]
    spec = build_model_spec(model["name"], model["flavor"], hf_path=model["hf_path"])
    with torch.device("meta"):
        meta_model = spec.model.build()
    adapter = spec.state_dict_adapter(spec.model, model["hf_path"])
    shapes = {k: v.shape for k, v in adapter.to_hf(meta_model.state_dict()).items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02
        for k, s in shapes.items()
    }
    save_file(tensors, os.path.join(model["hf_path"], "model.safetensors"),
              metadata={"format": "pt"})


# ---- measurement ------------------------------------------------------------------------
class BusyTimer:
    """Wraps the compute calls of a pipeline schedule's local stages (instance attributes, so
    only this engine's schedule is affected) and the schedule's ``step``.

    ``busy`` accumulates seconds inside ``forward_one_chunk`` / ``backward_one_chunk`` of every
    local stage and inside ``_compute_loss`` (last stage); ``wall`` accumulates the seconds of
    ``step``. Send/recv waits and schedule bookkeeping fall outside ``busy``.
    """

    def __init__(self, schedule):
        self.forward = self.backward = self.loss = self.wall = 0.0
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.local_stages = len(stages)
        for stage in stages:
            stage.forward_one_chunk = self._wrap(stage.forward_one_chunk, "forward")
            stage.backward_one_chunk = self._wrap(stage.backward_one_chunk, "backward")
        schedule._compute_loss = self._wrap(schedule._compute_loss, "loss")
        schedule.step = self._wrap(schedule.step, "wall")

    def _wrap(self, fn, field: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)

        return timed

    def reset(self) -> None:
        self.forward = self.backward = self.loss = self.wall = 0.0

    @property
    def busy(self) -> float:
        return self.forward + self.backward + self.loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _local_bytes(t: torch.Tensor) -> int:
    return _local(t).numel() * _local(t).element_size()


def model_state_bytes(engine: TitanEngine) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state tensors."""
    params = engine.parameters()
    total = sum(_local_bytes(p) for p in params)
    total += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    for opt in engine.optimizers.optimizers:
        for state in opt.state.values():
            total += sum(_local_bytes(v) for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0)
    return total


class RunBench:
    """One config's engine, batch and timers on this rank."""

    def __init__(self, mapping: dict[str, Any], seed: int):
        self.engine = TitanEngine(mapping)
        cfg = self.engine.config.training
        self.batch = make_batch(
            cfg.local_batch_size, cfg.seq_len, self.engine.model_spec.model.vocab_size, seed
        )
        schedule = self.engine.pp_schedule
        self.timer = BusyTimer(schedule) if schedule is not None else None
        self.cuda = self.engine.device.type == "cuda"
        self.optimizer_seconds = 0.0
        optimizer_step = self.engine.optimizer_step

        def timed_optimizer_step():  # clip + optimizer step, called by train_batch
            start = time.perf_counter()
            try:
                return optimizer_step()
            finally:
                self.optimizer_seconds += time.perf_counter() - start

        self.engine.optimizer_step = timed_optimizer_step

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)

    def _train_step(self) -> None:
        self.engine.train_batch(self.batch, cross_entropy_loss, valid_tokens)

    def step(self) -> dict[str, float]:
        dist.barrier()
        if self.timer:
            self.timer.reset()
        self.optimizer_seconds = 0.0
        self._sync()
        start = time.perf_counter()
        self._train_step()
        self._sync()
        out = {"seconds": time.perf_counter() - start, "optimizer": self.optimizer_seconds}
        if self.timer:
            t = self.timer
            out.update(busy=t.busy, wall=t.wall, forward=t.forward, loss=t.loss,
                       backward=t.backward, local_stages=t.local_stages)
        return out

    def memory(self) -> dict[str, Any]:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._train_step()
            torch.cuda.synchronize()
            return {"kind": "cuda", "peak_allocated": torch.cuda.max_memory_allocated()}
        with SavedActivations() as tracker:
            self._train_step()
        return {"kind": "cpu", "saved_activations": tracker.peak,
                "model_state": model_state_bytes(self.engine),
                "num_params": sum(_local(p).numel() for p in self.engine.parameters())}


def serve(store, group: str, benches: list[RunBench]) -> None:
    """Answer the driver's commands until ``stop``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    i = 0
    while True:
        cmd = json.loads(store.get(f"{group}/cmd/{i}"))
        if cmd["op"] == "stop":
            return
        bench = benches[cmd["run"]]
        mine = bench.step() if cmd["op"] == "step" else bench.memory()
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            store.set(f"{group}/res/{i}", json.dumps(per_rank))
        i += 1


# ---- main -------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="bench/pipeline.py worker (run under torchrun)")
    p.add_argument("--plan", required=True, help="JSON plan written by bench/pipeline.py")
    p.add_argument("--group", required=True, help="the plan's group this launch runs")
    p.add_argument("--store", required=True, help="host:port of the driver's TCPStore")
    args = p.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=timedelta(seconds=plan["store_timeout_s"]))
    try:
        # One intra-op thread per process: PP=2 runs two processes on two cores and PP=1
        # one, so each stage computes with one core in both cases.
        torch.set_num_threads(1)
        init_single_process_env()  # no-op under torchrun
        if plan["weights_writer"] == args.group and int(os.environ["RANK"]) == 0:
            write_random_weights(plan["mapping"], plan["seed"])
            store.set("weights_ready", "1")
        store.wait(["weights_ready"])
        benches = [RunBench(run_mapping(plan["mapping"], run), plan["seed"])
                   for run in plan["groups"][args.group]["runs"]]
        for bench in benches:  # warm up (allocator, schedule shape inference, Adam state)
            for _ in range(plan["warmup"]):
                bench.step()
        dist.barrier()
        if dist.get_rank() == 0:
            store.set(f"{args.group}/ready", str(torch.get_num_threads()))
        serve(store, args.group, benches)
        for bench in benches:
            bench.engine.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        store.set(f"{args.group}/error", f"rank {os.environ.get('RANK')}: "
                  + traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
