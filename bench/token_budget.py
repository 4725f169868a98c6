"""Token-budget microbatches and packing versus fixed-row microbatches, side by side.

Run from the repository root::

    .venv/bin/python -m bench.token_budget                  # qwen3 small, 32 rows, 5 steps
    .venv/bin/python -m bench.token_budget --rows 16 --steps 3 --flavor tiny

One :class:`TitanEngine` (random weights, GRPO loss) trains on two GRPO-shaped batches:

- **long-tailed**: a 32-token prompt and a response whose length is log-normal (median 40
  tokens, sigma 1.1: most under 64), the longest at the cap (a row of ``--max-len`` tokens,
  1024 by default: a truncated response), labels on the response only;
- **equal short**: every row the demo's shape (a 16-token prompt, an 8-token response).

Paths, on the same engine and batch, timed in rotating order (ABC, CBA, ...) after a warmup:

- *fixed rows*: ``training.microbatch_size = --rows-per-microbatch`` (4), every microbatch
  padded to the batch's longest row;
- *token budget*: ``training.max_tokens_per_microbatch`` = rows-per-microbatch x the batch's
  padded length (the fixed-row microbatch's size, so no microbatch is larger than the
  baseline's), ``training.pad_to_multiple_of = --multiple``;
- *packing*: the same budget with ``training.packing: true`` (block-causal masked SDPA).

Reported per path: microbatches per step, positions computed (padding included), train
tokens/s (the batch's real tokens, prompt + response, per step second: the same numerator
for every path), the median per-round speedup over fixed rows with its 95% confidence
interval, and the peak bytes of saved activations over one step (``saved_tensors_hooks``,
:class:`bench.common.SavedActivations`; exact and deterministic). One torch thread by
default (``--threads``), as in ``bench/train_step.py``: ratios of neighbouring steps are
stable on a shared 2-core machine, absolute times are not.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import forge_ext  # noqa: F401, E402  (must precede any torchtitan import: CPU device fix)

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from bench.train_step import interleaved, median_ci, saved_activation_peak, timed  # noqa: E402
from forge_ext.engine import TitanEngine  # noqa: E402
from forge_ext.engine import microbatch as tb  # noqa: E402
from forge_ext.engine.distributed import init_single_process_env  # noqa: E402
from forge_ext.rl.losses.grpo import GRPOLoss, valid_token_count  # noqa: E402


def grpo_batch(lengths: list[tuple[int, int]], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of ``(prompt, response)`` lengths in the episode layout
    (:mod:`forge_ext.rl.episode`), with generator log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    seq = max(p + r for p, r in lengths)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g)
    labels = torch.full_like(ids, -100)
    for row, (p, r) in enumerate(lengths):
        ids[row, p + r :] = 0
        labels[row, p - 1 : p + r - 1] = ids[row, p : p + r]
    valid = labels != -100
    return {
        "input_ids": ids, "labels": labels,
        "generator_logprobs": torch.where(valid, -torch.rand(ids.shape, generator=g) * 5, 0.0),
        "advantages": torch.randn(len(lengths), generator=g),
    }


def long_tailed(rows: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """Log-normal response lengths, the longest set to the cap (a response truncated at
    ``max_new_tokens``, which RL batches nearly always hold)."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(rows, generator=g) * 1.1 + torch.log(torch.tensor(40.0)))
    draws[draws.argmax()] = max_len
    return [(32, int(min(max(d, 1), max_len - 32))) for d in draws]


def set_mode(engine: TitanEngine, mode: str, rows: int, per_mb: int, budget: int,
             multiple: int) -> None:
    t = engine.config.training
    t.local_batch_size = rows
    t.microbatch_size = per_mb if mode == "fixed rows" else None
    t.max_tokens_per_microbatch = None if mode == "fixed rows" else budget
    t.packing = mode == "packing"
    t.pad_to_multiple_of = 1 if mode == "fixed rows" else multiple
    engine.num_microbatches = engine.config.num_microbatches()


MODES = ("fixed rows", "token budget", "packing")


def bench_batch(engine, batch, args, loss_fn) -> list[list[str]]:
    rows, seq = batch["input_ids"].shape
    budget = args.rows_per_microbatch * seq
    real = int((batch["input_ids"] != 0).sum())  # prompt + response tokens (0 is padding)

    def path(mode):
        def step():
            set_mode(engine, mode, rows, args.rows_per_microbatch, budget, args.multiple)
            return engine.train_batch(batch, loss_fn, valid_token_count)
        return step

    shape = {}
    for mode in MODES:
        m = path(mode)()
        shape[mode] = (m["num_microbatches"], m["computed_tokens"])
    peak = {mode: saved_activation_peak(path(mode)) for mode in MODES}
    secs = interleaved({mode: timed(path(mode), engine.device) for mode in MODES},
                       args.steps, args.warmup)
    out = []
    for mode in MODES:
        med = statistics.median(secs[mode])
        cells = [mode, str(shape[mode][0]), f"{shape[mode][1]:,}", f"{real / med:,.0f}"]
        if mode == "fixed rows":
            cells += ["1.000 (ref)", ""]
        else:
            ratio, lo, hi = median_ci([f / s for s, f in zip(secs[mode], secs["fixed rows"])])
            cells += [f"{ratio:.2f}", f"{lo:.2f}-{hi:.2f}"]
        base = peak["fixed rows"]
        cells += [f"{peak[mode] / 2**20:.1f}", f"{peak[mode] / base:.2f}"]
        out.append(cells)
    return out


HEADERS = ["path", "microbatches", "positions computed", "train tokens/s",
           "vs fixed rows (median)", "95% CI", "peak saved activations MiB", "vs fixed rows"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="small")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--rows-per-microbatch", type=int, default=4)
    p.add_argument("--multiple", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.rows % args.rows_per_microbatch:
        p.error(f"--rows={args.rows} is not a multiple of --rows-per-microbatch")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    init_single_process_env()
    engine = TitanEngine({
        "model": {"name": "qwen3", "flavor": args.flavor},
        "training": {"local_batch_size": args.rows, "seq_len": args.max_len, "max_norm": 1e6},
        "optimizer": {"lr": 1e-5},
    })
    logging.getLogger().setLevel(logging.ERROR)
    vocab = engine.model_spec.model.vocab_size
    loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.0))
    batches = {
        "long-tailed": grpo_batch(long_tailed(args.rows, args.max_len, args.seed), vocab,
                                  args.seed),
        "equal short (the demo's 16 + 8)": grpo_batch([(16, 8)] * args.rows, vocab, args.seed),
    }
    print(f"# bench/token_budget.py: qwen3 {args.flavor}, {args.rows} rows, "
          f"{args.rows_per_microbatch} rows per fixed microbatch, pad_to_multiple_of "
          f"{args.multiple}, {args.steps} timed steps per path (+{args.warmup} warmup), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, device {engine.device.type}")
    print(" ".join(["# command: python -m bench.token_budget",
                    *(argv if argv is not None else sys.argv[1:])]))
    for name, batch in batches.items():
        t0 = time.perf_counter()
        lengths = tb.row_lengths(batch)
        responses = (batch["labels"] != -100).sum(1)
        print(f"\n## {name}: {tuple(batch['input_ids'].shape)} padded; response tokens "
              f"median {int(responses.median())}, max {int(responses.max())}; real tokens "
              f"{int((batch['input_ids'] != 0).sum()):,} of {batch['input_ids'].numel():,} "
              f"positions (rows need {int(lengths.sum()):,})")
        print(tabulate(bench_batch(engine, batch, args, loss_fn), headers=HEADERS,
                       disable_numparse=True))
        print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"\n# total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
