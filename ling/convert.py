"""Convert a hub checkpoint (config.json + safetensors) into the project's orbax format.

    python -m ling.convert --hf /path/to/Ling-3.0-flash --out /path/to/ling-3-flash-orbax [--dtype bfloat16]

The output directory holds `ling_config.json` and `params/`; `ling.load(out)` reads it back.
"""

from __future__ import annotations

import argparse
import sys
import time

from ling import checkpoint, load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="hub checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--out", required=True, help="output directory for the converted checkpoint")
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16; router, gate "
                    "and KDA decay parameters stay float32)")
    ap.add_argument("--quantize", choices=["int8", "int4", "int2"], default=None,
                    help="store the projections, dense MLPs and shared experts grouped low-bit (the router "
                         "gate, embeddings and, unless --quantize-experts, routed experts stay as they are)")
    ap.add_argument("--group-size", type=int, default=128, help="input columns per scale (default 128)")
    ap.add_argument("--quantize-lm-head", action="store_true", help="quantise the lm_head too")
    ap.add_argument("--quantize-experts", action="store_true", help="quantise the routed experts too "
                    "(int4 / int8, in the fused MoE kernel's format)")
    ap.add_argument("--quantize-layout", choices=["tiles", "rows"], default="tiles",
                    help="int4 or int8 in groups of 128: store in the row layout that the tensor-core kernels read "
                         "(rows) or the tile layout (default); `ling.load` re-lays out either way when asked")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model = load(args.hf, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size,
                     quantize_lm_head=args.quantize_lm_head, quantize_experts=args.quantize_experts,
                     quantize_layout=args.quantize_layout)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    checkpoint.save_converted(model, args.out)
    print(f"wrote {args.out} ({model.cfg.model_type}, {model.cfg.num_hidden_layers} layers"
          f"{', NEXTN' if model.nextn is not None else ''}"
          f"{f', {args.quantize} g{args.group_size}' if args.quantize else ''}"
          f"{', routed experts too' if args.quantize_experts else ''}"
          f"{', row layout' if args.quantize and args.quantize_layout == 'rows' else ''}) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
