"""Ember's two int8 decode GEMVs on one GPU: the Triton kernel's tiles against the CUDA C++ kernel's block shapes.

For each Llama-3-8B projection (gate/up as the fused SwiGLU GEMV), one activation row: first every kernel and
shape against float math on the dequantized weights (1 and 3 rows, an outlier activation), then each timed
in a CUDA graph over weight copies that spill L2 (`ember.quant.tuning.graph_seconds`, as the tuner times
them); the table gives the best of each kernel and their ratio.

    PYTHONPATH=src python3 benchmarks/gpu_int8_gemv.py [--shapes qkv o gate_up down lm_head]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from ember.ops import cuda_rtc
from ember.quant import cuda_gemv, tuning
from ember.quant import triton_kernels as tk
from ember.quant.kernels import int8_linear_reference, silu_gate_up_reference
from ember.quant.linear import quantize_int8_per_channel

SHAPES = {  # name: (weight rows, K, fused gate/up)
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, True),
    "down": (4096, 14336, False),
    "lm_head": (128256, 4096, False),
}
SPILL = 4 * (60 << 20)  # bytes of weight copies per shape: several times an H200's L2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(name: str, dev: torch.device) -> tuple:
    """(name, bytes, CUDA kernel's worst relative error, best Triton (kind, label, s), best CUDA)."""
    wrows, K, glu = SHAPES[name]
    N = wrows // 2 if glu else wrows
    q, s = quantize_int8_per_channel(torch.randn(wrows, K, device=dev) * 0.02)
    s = s.to(torch.bfloat16)
    nbytes = q.numel() + s.numel() * 2
    copies = [(q, s)] + [(q.clone(), s.clone()) for _ in range(max(1, SPILL // nbytes))]
    shapes = cuda_gemv.GLU_CONFIGS if glu else cuda_gemv.CONFIGS
    worst = 0.0
    for M in (1, 3):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        x[:, 7] = 40.0
        ref = (silu_gate_up_reference if glu else int8_linear_reference)(x.float(), q, s.float())
        for shape in shapes:
            y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            cuda_gemv.gemv(x, q, s, y, shape, glu, pdl=False)
            worst = max(worst, rel_err(y, ref))
    assert worst < 1e-2, (name, worst)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
    launches = max(len(copies), 16)
    timed = []
    for b in tk.INT8_BLOCKS:
        consts = dict(
            INT8=True, GLU=glu, EVICT="evict_first", MAGIC=2, PDL=False, EVEN_K=K % b["BLOCK_K"] == 0
        )
        grid = (triton.cdiv(N, b["BLOCK_N"]),)

        def call(i, b=b, consts=consts, grid=grid):
            w, sc = copies[i % len(copies)]
            tk._gemv_kernel[grid](x, w, sc, y, N, 1, K, **consts, **b)

        label = f"{b['BLOCK_N']}x{b['BLOCK_K']}, {b['num_warps']} warps{', ACC8' if b.get('ACC8') else ''}"
        timed.append(("triton", label, tuning.graph_seconds(call, launches, 7)))
    for shape in shapes:

        def call(i, shape=shape):
            cuda_gemv.gemv(x, *copies[i % len(copies)], y, shape, glu, pdl=False)

        timed.append(
            ("cuda", f"R={shape[0]} U={shape[1]} {shape[2]} warps", tuning.graph_seconds(call, launches, 7))
        )
    best = {kind: min((r for r in timed if r[0] == kind), key=lambda r: r[2]) for kind in ("triton", "cuda")}
    return name, nbytes, worst, best["triton"], best["cuda"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    t = time.perf_counter()
    assert cuda_gemv.kernels(dev) is not None, "the CUDA kernel could not be built"
    print(
        f"torch {torch.__version__}, NVRTC {cuda_rtc._nvrtc_version()}, build {time.perf_counter() - t:.1f} s"
    )
    rows = []
    for name in args.shapes:
        rows.append(measure(name, dev))
        torch.cuda.empty_cache()  # the weight copies of the last shape
    print(
        "| projection | Triton us (GB/s) | its tile | CUDA C++ us (GB/s) | its block | Triton / CUDA | CUDA rel err |"
    )
    print("| --- | ---: | --- | ---: | --- | ---: | ---: |")
    for name, nbytes, worst, tr, cu in rows:
        print(
            f"| {name} | {tr[2] * 1e6:.2f} ({nbytes / tr[2] / 1e9:.0f}) | {tr[1]} | {cu[2] * 1e6:.2f} "
            f"({nbytes / cu[2] / 1e9:.0f}) | {cu[1]} | {tr[2] / cu[2]:.3f} | {worst:.1e} |"
        )


if __name__ == "__main__":
    main()
