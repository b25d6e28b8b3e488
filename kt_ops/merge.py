"""``python -m kt_ops.merge``: merge a trained adapter into its base checkpoint, in the base's own
format (see :func:`kt_ops.hf.merge.merge_adapter`).

    python -m kt_ops.merge --base DIR --adapter DIR --out DIR [--format same|bf16] [--overwrite]

The output loads with stock transformers (``AutoModelForCausalLM.from_pretrained(out)``) and
any engine that loads the base architecture.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    from kt_ops.hf.merge import OUTPUT_FORMATS, merge_adapter

    parser = argparse.ArgumentParser(prog="python -m kt_ops.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base checkpoint directory (safetensors shards)")
    parser.add_argument("--adapter", required=True, help="the adapter directory (kt_ops.hf.save_adapter's)")
    parser.add_argument("--out", required=True, help="the new checkpoint directory")
    parser.add_argument("--format", default="same", choices=OUTPUT_FORMATS,
                        help="'same': the base's format (FP8, INT4 ... requantized where the adapter changes a "
                             "weight); 'bf16': quantized weights written as bf16; 'fp8' (DeepSeek-V3's blocks), "
                             "'int8', 'int4' (compressed-tensors): every linear and expert weight quantized")
    parser.add_argument("--group-size", type=int, default=32, help="int4's input columns per scale (--format int4)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        summary = merge_adapter(args.base, args.adapter, args.out, output_format=args.format,
                                group_size=args.group_size, progress=not args.no_progress, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"{summary.out_dir}: {len(summary.merged)} tensors merged, {summary.copied} copied byte for byte, "
          f"{len(summary.converted)} converted to {args.format}; {summary.bytes_written / 1e9:.3f} GB in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
