"""DCP checkpoint -> HF checkpoint: ``python -m apps.export <checkpoint step folder> <out>``.

Converts any step a full fine-tuning run saved (``<output_dir>/checkpoints/step-N``) into a
Hugging Face folder that transformers loads, vLLM serves and a next run takes as
``model.hf_path``: safetensors shards, ``config.json``, the tokenizer files and
``generation_config.json`` of the run's ``model.hf_path`` (read from the run's
``run_config.yaml``, or ``--model``). One process, a shard of tensors in memory at a time
(:func:`forge_ext.engine.export.dcp_to_hf`). A run's final step is also exported by the run
itself (``<output_dir>/hf/step-N``, the GRPO app's ``export:`` section).
"""

from __future__ import annotations

import argparse
import sys
import time

import forge_ext  # noqa: F401  (selects the CPU device before torchtitan is imported)


def main(argv: list[str] | None = None) -> None:
    from forge_ext.runtime.disk import OutputWriteError
    from forge_ext.engine.export import DTYPES, dcp_to_hf, export_dtype

    parser = argparse.ArgumentParser(
        prog="python -m apps.export", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("step_folder", help="a DCP checkpoint step folder (<output_dir>/"
                        "checkpoints/step-N)")
    parser.add_argument("out", help="the HF checkpoint folder to write (replaced atomically)")
    parser.add_argument("--model", help="the run's model.hf_path (default: from the run's "
                        "run_config.yaml)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: "
                        "as stored)")
    parser.add_argument("--max-shard-mb", type=int, default=5000,
                        help="largest safetensors file in MB (default 5000)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = dcp_to_hf(args.step_folder, args.out,
                        model={"hf_path": args.model} if args.model else None,
                        dtype=export_dtype(args.dtype, "--dtype"),
                        max_shard_bytes=args.max_shard_mb * 10**6)
    except (ValueError, FileNotFoundError, OutputWriteError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s (from {args.step_folder})")


if __name__ == "__main__":
    main()
