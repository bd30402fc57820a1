"""One decode GEMV kernel, rows swept: where its bandwidth goes with the size of its grid.

Each row count is timed alone, one activation row, in a CUDA graph over weight copies that spill L2 (as
`gpu_gemv.py` times), at fixed block shapes of Ember's CUDA int4 GEMV (`ember.quant.cuda_int4`), and beside it
cuBLAS's bf16 GEMV (`F.linear`) over as many bytes of weights: GB/s of weights, and blocks in the grid (a grid
past what the multiprocessors hold at once runs a second wave).

    python benchmarks/gpu_gemv_rows.py --glu --k 4096 --rows 6144 10240 14336 16384 --shape 2 2 2 1 0
    python benchmarks/gpu_gemv_rows.py --k 14336 --rows 2048 4096 6144 --shape 1 16 2 1 0 --shape 1 8 2 0 0
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gpu_gemv import GROUP, read_bandwidth, timed_graph, weights_for  # noqa: E402

SPILL_BYTES = 200e6  # weight copies per timed graph add up to at least this (4x an H100's L2)


def seconds(kind: str, rows: int, K: int, call) -> tuple[float, int]:
    """(seconds per call, bytes of weights per call) of call(weights) over rows x K weights of kind."""
    one, nbytes = weights_for(kind, rows, K, 1)
    copies = max(2, math.ceil(SPILL_BYTES / nbytes))
    ws = one + [tuple(t.clone() for t in one[0]) for _ in range(copies - 1)]
    return timed_graph(lambda i: call(ws[i % copies]), max(copies, 16)), nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4096, help="the row's length")
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 4096, 6144, 8192, 12288, 14336])
    ap.add_argument("--glu", action="store_true", help="gate/up + SwiGLU: 2 x rows weights, rows outputs")
    ap.add_argument(
        "--shape",
        type=int,
        nargs=5,
        action="append",
        metavar=("TW", "KW", "DEPTH", "LEAN", "ASYNC"),
        default=None,
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gemv_rows.py needs a CUDA GPU")
    from ember.ops.launch import pdl
    from ember.quant import cuda_int4

    dev = torch.device("cuda")
    shapes = [(tw, kw, d, bool(lean), bool(a)) for tw, kw, d, lean, a in args.shape or [(1, 8, 2, 0, 0)]]
    read, _ = read_bandwidth()
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {props.multi_processor_count} multiprocessors, read {read / 1e9:.0f} GB/s")
    x = torch.randn(1, args.k, device=dev, dtype=torch.bfloat16)
    on = pdl(dev)
    print("\n| kernel | rows | blocks | us | GB/s | % of read |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        y = torch.empty(1, rows, device=dev, dtype=torch.bfloat16)
        nbytes = 0
        for shape in shapes:

            def call(w, shape=shape, y=y):
                cuda_int4.gemv(x, *w, y, GROUP, shape, 1, on, glu=args.glu)

            s, nbytes = seconds("int4cu", (2 if args.glu else 1) * rows, args.k, call)
            blocks = -(-(rows // 16) // shape[0])
            name = f"int4{' glu' if args.glu else ''} {shape}"
            print(f"| {name} | {rows} | {blocks} | {s * 1e6:.1f} | {nbytes / s / 1e9:.0f} | {100 * nbytes / s / read:.0f}% |")  # fmt: skip
        bf16_rows = max(16, round(nbytes / (2 * args.k) / 16) * 16)  # as many bytes of bf16 weights
        s, b = seconds("bf16", bf16_rows, args.k, lambda w: F.linear(x, w[0]))
        print(
            f"| cuBLAS bf16 | {bf16_rows} | - | {s * 1e6:.1f} | {b / s / 1e9:.0f} | {100 * b / s / read:.0f}% |"
        )


if __name__ == "__main__":
    main()
