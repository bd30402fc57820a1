"""Quantized GEMMs for prefill on one GPU: Ember's decode-in-registers kernels against dequantize + matmul.

For each Llama-3-8B projection shape and number of activation rows M it times, in one process:
- bf16: cuBLAS on bf16 weights (the float model's prefill, the bar);
- int8 / int4 "dequant": the weights dequantized to bf16 in memory, then cuBLAS (Ember's path before
  `ember.quant.triton_gemm`, and gpt-fast's int8 `F.linear(x, w.to(x.dtype)) * scales`);
- tinygemm: torch's `_weight_int4pack_mm` (gpt-fast's and torchao's int4), same codes;
- Ember: `triton_gemm.int8_gemm` / `int4_mma_gemm` at the tiles `blocks` / `int4_tiles` pick, and with `--sweep` over a grid.
Every Ember result is first checked against float math on the dequantized weights. Calls are timed inside a
CUDA graph cycling through weight copies that spill L2 (`ember.quant.tuning.graph_seconds`), median of
replays. Prints microseconds per call and the weights' GB/s, and per (shape, M) the ratios.

    python benchmarks/gpu_gemm.py                          # Llama-3-8B shapes, M = 16 .. 2048
    python benchmarks/gpu_gemm.py --sweep --rows 128 --shapes qkv gate_up
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
POOL_BYTES = 512 << 20


def weights(kind: str, N: int, K: int) -> tuple[torch.Tensor, ...]:
    from ember.quant.kernels import int4_mma_scales, int4_mma_tile
    from ember.quant.linear import (
        pack_nibbles,
        quantize_int4_grouped,
        quantize_int8_per_channel,
        tinygemm_layout,
    )

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    if kind == "bf16":
        return (w,)
    if kind == "int8":
        q, s = quantize_int8_per_channel(w)
        return q, s.to(torch.bfloat16)
    codes, sc, mn = quantize_int4_grouped(w, GROUP)
    if kind == "int4":
        return int4_mma_tile(pack_nibbles(codes)), int4_mma_scales(sc, mn)
    return tinygemm_layout(pack_nibbles(codes), sc, mn)


def dense(kind: str, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The float32 weights the quantized ones stand for."""
    from ember.quant.kernels import int4_mma_dequantize

    if kind == "int8":
        return w[0].float() * w[1].float()[:, None]
    return int4_mma_dequantize(w[0], w[1], GROUP).to(torch.bfloat16).float()


def call(kind: str, how: str, x: torch.Tensor, w: tuple[torch.Tensor, ...], config: dict | None):
    from ember.quant import triton_gemm, triton_mma

    if kind == "bf16" or kind == "tinygemm":
        if kind == "bf16":
            return F.linear(x, w[0])
        return torch.ops.aten._weight_int4pack_mm(x, w[0], GROUP, w[1])
    if how == "dequant":
        if kind == "int8":
            return F.linear(x, w[0].to(x.dtype)) * w[1]
        return F.linear(x, triton_mma.int4_mma_dequantize(w[0], w[1], GROUP, x.dtype))
    if kind == "int8":
        return triton_gemm.int8_gemm(x, w[0], w[1], config)
    return triton_gemm.int4_mma_gemm(x, w[0], w[1], GROUP, config)


def sweep(kind: str, M: int) -> list[dict]:
    top = min(128, max(16, 1 << (M - 1).bit_length()))
    out = []
    for bm, bn, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)):
        if bm > top or (bm * bn > 128 * 128 and warps == 4) or (kind == "int4" and stages == 5):
            continue
        for bk in (64, 128) if kind == "int8" else (None,):
            c = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            out.append({**c, "BLOCK_K": bk} if bk else c)
    return out


def seconds(fn, ws: list, launches: int) -> float:
    from ember.quant.tuning import graph_seconds

    return graph_seconds(lambda i: fn(ws[i % len(ws)]), launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=[16, 64, 128, 512, 2048])
    ap.add_argument("--kinds", nargs="*", default=["int8", "int4"])
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles; print the best")
    ap.add_argument("--deadline", type=float, default=480, help="seconds; later measurements are skipped")
    args = ap.parse_args()
    from ember.quant import triton_gemm

    t0 = time.perf_counter()
    print(f"{'shape':<8}{'M':>5} {'kind':<9}{'how':<34}{'us':>9}{'GB/s':>7}", flush=True)
    summary = []
    for shape, M in itertools.product(args.shapes, args.rows):
        N, K = SHAPES[shape]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        row = {"shape": shape, "M": M}
        for kind in ["bf16", *args.kinds] + (["tinygemm"] if "int4" in args.kinds else []):
            if time.perf_counter() - t0 > args.deadline:
                print(f"deadline: skipping {shape} {M} {kind}", flush=True)
                continue
            one = weights(kind, N, K)
            nbytes = sum(t.numel() * t.element_size() for t in one)
            ws = [one] + [tuple(t.clone() for t in one) for _ in range(max(1, POOL_BYTES // nbytes) - 1)]
            launches = max(len(ws), 8)
            hows = {"cuBLAS" if kind == "bf16" else "torch": None}
            if kind in ("int8", "int4"):
                want = x.float() @ dense(kind, one).T
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                auto = triton_gemm.blocks(M, N, sms) if kind == "int8" else triton_gemm.int4_tiles(M, N, sms)
                hows = {"dequant": None, "ember": auto}
                if args.sweep:
                    hows |= {json.dumps(c): c for c in sweep(kind, M)}
            for how, config in hows.items():
                try:
                    if config is not None:
                        got = call(kind, how, x, one, config).float()
                        err = float((got - want).norm() / want.norm())
                        if err > 1e-2:
                            print(f"WRONG {shape} {M} {kind} {how}: {err:.2e}", flush=True)
                            continue
                    s = seconds(lambda w, k=kind, h=how, c=config: call(k, h, x, w, c), ws, launches)  # noqa: B023
                except Exception as e:  # e.g. a tile that needs more shared memory than the GPU has
                    print(f"FAIL {shape} {M} {kind} {how}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                print(f"{shape:<8}{M:>5} {kind:<9}{how:<34}{s * 1e6:9.1f}{nbytes / s / 1e9:7.0f}", flush=True)
                key = kind if how in ("cuBLAS", "torch", "ember") else f"{kind} {how}"
                if how.startswith("{"):
                    best = row.get(f"{kind} best", (float("inf"), ""))
                    row[f"{kind} best"] = min(best, (s, how))
                else:
                    row[key] = s
        summary.append(row)
    print("\nSUMMARY: us per call; ratios against Ember")
    for row in summary:
        parts = [f"{row['shape']:<8}{row['M']:>5}"]
        for kind in ("bf16", "int8", "int4", "tinygemm"):
            if kind in row:
                parts.append(f"{kind} {row[kind] * 1e6:.1f}")
        for kind in ("int8", "int4"):
            if kind in row and f"{kind} dequant" in row:
                parts.append(f"{kind} dequant/ember {row[f'{kind} dequant'] / row[kind]:.2f}x")
            if f"{kind} best" in row:
                s, how = row[f"{kind} best"]
                parts.append(f"{kind} best {s * 1e6:.1f} {how}")
        print("  ".join(parts), flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
