"""Decode GEMV kernels on one GPU, one row of activations: bytes of weights per second per kernel and tile.

For each Llama-3-8B projection shape it times cuBLAS (bf16 `F.linear`), torch's int4 tinygemm
(`_weight_int4pack_mm`, what gpt-fast and torchao's int4 use) and Ember's Triton kernels over a grid of tile
sizes (int4: the canonical layout and the tiled one, `int4t`), and prints a table: microseconds per call and GB/s of weight bytes, against a read-only and a copy
bandwidth measured in the same run. Calls are timed inside a CUDA graph (as the compiled decode step runs
them), cycling through enough weight copies to defeat the 50 MB L2, median of several replays.

    python benchmarks/gpu_gemv.py                   # all kernels, all shapes
    python benchmarks/gpu_gemv.py --kinds int4 --top 5
    python benchmarks/gpu_gemv.py --kinds int8 int4t tinygemm --rows 4   # batched decoding
    python benchmarks/gpu_gemv.py --kinds int8glu bf16glu --shapes gate_up   # the fused SwiGLU GEMV
    python benchmarks/gpu_gemv.py --kinds int4mma int4t --shapes qkv o gate_up down   # int4 on tensor cores
    python benchmarks/gpu_gemv.py --kinds int8 int8cu --shapes qkv o down lm_head   # int8: Triton vs CUDA C++
    python benchmarks/gpu_gemv.py --kinds int8glu int8cuglu --shapes gate_up
    python benchmarks/gpu_gemv.py --kinds int4mma int4cu --shapes qkv o gate_up down   # int4: Triton vs CUDA C++
    python benchmarks/gpu_gemv.py --kinds int4cuglu --shapes gate_up   # int4 gate/up + SwiGLU, ASYNC shapes too
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K), Llama-3-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
TILES = [(1, 2048), (1, 4096), (2, 1024), (2, 2048), (2, 4096), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256)]  # fmt: skip
WARPS, STAGES = (4, 8), (1, 3)
POOL_BYTES = 768 << 20  # weight copies per shape: several times the L2
GROUP = 128


def timed_graph(fn, calls: int, replays: int = 7) -> float:
    """Seconds per call of fn(i) for i in range(calls), captured once in a CUDA graph; median of replays."""
    from ember.quant.tuning import graph_seconds

    return graph_seconds(fn, calls, replays)


def read_bandwidth() -> tuple[float, float]:
    """(read-only, copy) bytes/s on 2 GiB of random data."""
    x = torch.randn(1 << 29, device="cuda")
    y = torch.empty_like(x)
    read = x.numel() * 4 / timed_graph(lambda i: x.sum(), 4)
    copy = 2 * x.numel() * 4 / timed_graph(lambda i: y.copy_(x), 4)
    return read, copy


def weights_for(kind: str, N: int, K: int, copies: int):
    """A list of `copies` weight tuples for kernel kind, and the bytes one call reads."""

    from ember.quant.kernels import (
        int4_fold_scales,
        int4_mma_scales,
        int4_mma_tile,
        int4_subnormal_scales,
        int4_tile,
    )
    from ember.quant.linear import (
        pack_nibbles,
        quantize_int4_grouped,
        quantize_int8_per_channel,
        tinygemm_layout,
    )

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    # fused gate/up and the CUDA C++ kernels: the weights of the Triton kernel they stand beside
    kind = (
        {"int4cu": "int4mma", "int4cuglu": "int4mma"}.get(kind, kind).removesuffix("glu").removesuffix("cu")
    )
    if kind == "bf16":
        one = (w,)
    elif kind == "int8":
        q, s = quantize_int8_per_channel(w)
        one = (q, s.to(torch.bfloat16))
    elif kind == "int4t":
        codes, sc, mn = quantize_int4_grouped(w, GROUP)
        one = (int4_tile(pack_nibbles(codes), GROUP), int4_subnormal_scales(sc, mn))
    elif kind == "int4":
        codes, sc, mn = quantize_int4_grouped(w, GROUP)
        one = (pack_nibbles(codes), *int4_fold_scales(sc, mn, torch.bfloat16))
    elif kind == "int4mma":
        codes, sc, mn = quantize_int4_grouped(w, GROUP)
        one = (int4_mma_tile(pack_nibbles(codes)), int4_mma_scales(sc, mn))
    elif kind == "tinygemm":  # torch's layout, as Ember's int4 module builds it where it picks tinygemm
        codes, sc, mn = quantize_int4_grouped(w, GROUP)
        one = tinygemm_layout(pack_nibbles(codes), sc, mn)
    nbytes = sum(t.numel() * t.element_size() for t in one)
    return [one] + [tuple(t.clone() for t in one) for _ in range(copies - 1)], nbytes


def kernel_calls(kind: str, x: torch.Tensor, ws, config: dict | None):
    from ember.ops.launch import pdl
    from ember.quant import triton_kernels as tk

    if kind == "bf16":
        if config is None:
            return lambda i: F.linear(x, ws[i % len(ws)][0])
        return lambda i: tk.float_gemv(x, ws[i % len(ws)][0], blocks=config)
    if kind == "int8":
        return lambda i: tk.int8_gemv(x, *ws[i % len(ws)], blocks=config)
    if kind in (
        "int8cu",
        "int8cuglu",
    ):  # Ember's CUDA C++ int8 GEMV (`ember.quant.cuda_gemv`), one block shape
        from ember.quant import cuda_gemv

        glu = kind == "int8cuglu"
        N = ws[0][0].shape[0] // (2 if glu else 1)
        y = torch.empty(x.shape[0], N, device=x.device, dtype=x.dtype)
        shape = tuple(config["CUDA"])
        on = pdl(x.device)  # as the Triton kernels launch (`ember.ops.launch`)
        return lambda i: cuda_gemv.gemv(x, *ws[i % len(ws)], y, shape, glu, pdl=on)
    if kind in ("bf16glu", "int8glu"):  # gate rows over up rows -> silu(gate) * up, as the MLP runs it
        return lambda i: tk.fused_gemv(x, *ws[i % len(ws)], glu=True, blocks=config)
    if kind == "int4":
        return lambda i: tk.int4_gemv(x, *ws[i % len(ws)], GROUP, blocks=config)
    if kind == "int4t":  # {"auto": True}: what the op picks (`ember.quant.tuning`, or a split)
        blocks = None if config and config.get("auto") else config
        return lambda i: tk.int4_tiled_gemv(x, *ws[i % len(ws)], GROUP, blocks=blocks)
    if kind == "int4mma":  # {"auto": True}: as the module runs it (its split's partials, unsummed)
        from ember.quant import triton_mma

        N, K = ws[0][0].shape[0], x.shape[1]
        if config and config.get("auto"):
            split = triton_mma.splits(N, K, GROUP, triton_mma.multiprocessors(x.device))
            return lambda i: triton_mma.int4_mma_gemv(
                x, *ws[i % len(ws)], GROUP, split if split > 1 else None
            )
        blocks = {k: v for k, v in config.items() if k != "SPLIT"}
        split = config.get("SPLIT")
        return lambda i: triton_mma.int4_mma_gemv(x, *ws[i % len(ws)], GROUP, split, blocks=blocks)
    if kind == "int4cuglu":  # the same kernel's gate/up + SwiGLU (gate rows over up rows), a block shape
        from ember.quant import cuda_int4

        y = torch.empty(x.shape[0], ws[0][0].shape[0] // 2, device=x.device, dtype=x.dtype)
        block, on = tuple(config["CUDA"]), pdl(x.device)
        return lambda i: cuda_int4.gemv(x, *ws[i % len(ws)], y, GROUP, block, 1, pdl=on, glu=True)
    if kind == "int4cu":  # Ember's CUDA C++ int4 GEMV (`ember.quant.cuda_int4`): a block shape and a split
        from ember.quant import cuda_int4

        N, split = ws[0][0].shape[0], config["SPLIT"]
        shape = (split, x.shape[0], N) if split > 1 else (x.shape[0], N)
        y = torch.empty(shape, device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
        block = tuple(config["CUDA"])
        on = pdl(x.device)  # as the Triton kernels launch (`ember.ops.launch`)
        return lambda i: cuda_int4.gemv(x, *ws[i % len(ws)], y, GROUP, block, split, pdl=on)
    if kind == "tinygemm":
        return lambda i: torch.ops.aten._weight_int4pack_mm(x, ws[i % len(ws)][0], GROUP, ws[i % len(ws)][1])
    raise ValueError(kind)


def configs_for(kind: str, N: int, K: int) -> list[dict]:
    if kind in ("int8cu", "int8cuglu"):
        from ember.quant import cuda_gemv

        return [
            {"CUDA": list(c)} for c in (cuda_gemv.GLU_CONFIGS if kind == "int8cuglu" else cuda_gemv.CONFIGS)
        ]
    if kind == "int4cuglu":  # gate/up + SwiGLU: whole rows (ASYNC shapes included)
        from ember.quant import cuda_int4

        return [{"CUDA": list(c)} for c in cuda_int4.configs(GROUP, K // GROUP, 1, True, True, True)]
    if kind == "int4cu":  # block shapes x runs of K's groups: the whole row and the Triton kernel's split
        from ember.quant import cuda_int4, triton_mma

        groups = K // GROUP
        auto = triton_mma.splits(N, K, GROUP, triton_mma.multiprocessors(torch.device("cuda")))
        return [
            {"CUDA": list(c), "SPLIT": d}
            for d in sorted({1, 2, 4, auto})
            if groups % d == 0
            for c in cuda_int4.configs(GROUP, groups, d, lean=True, asynchronous=True)
        ]
    if kind == "int4mma":  # warps per program x runs of K's groups (float32 partials, unsummed)
        groups = K // GROUP
        return [
            {"WARPS": w, "num_warps": w, "num_stages": 1, **({"SPLIT": d} if d > 1 else {})}
            for w in (4, 8)
            for d in (1, 2, 4, 7, 8, 14, 16, 28, 32)
            if groups % d == 0
        ] + [{"auto": True}]
    if kind == "int4t":  # one group per nibble position: the tile is (BLOCK_N, GROUP) words
        return (
            [
                {"BLOCK_N": bn, "num_warps": w, "num_stages": 1}
                for bn, w in [(16, 2), (32, 2), (16, 4), (32, 4), (64, 4), (64, 8), (128, 8)]
            ]
            + [  # K split into runs of tiles (a split must divide the row's tiles)
                {"BLOCK_N": bn, "num_warps": w, "num_stages": 1, "SPLIT": split}
                for bn, w in [(16, 4), (16, 2), (32, 4), (64, 8)]
                for split in (2, 4, 7)
                if (K // (8 * GROUP)) % split == 0
            ]
            + [{"auto": True}]
        )
    out = []
    for (bn, bk), w, s in itertools.product(TILES, WARPS, STAGES):
        if kind == "int4" and bk < GROUP:
            continue
        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s})
    if kind in ("bf16", "int8", "bf16glu", "int8glu"):  # also one accumulator per 8 weights (as tuned)
        out += [{**c, "ACC8": True} for c in out if c["num_stages"] == 1 and c["BLOCK_K"] <= K]
    if kind == "int8":  # the other conversions (`_int8_to_float`), for comparison, on a few tiles
        few = [c for c in out if c["num_stages"] == 1 and c["num_warps"] == 4]
        out += [{**c, "MAGIC": magic} for c in few for magic in (0, 1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="*", default=["bf16", "int8", "int4", "int4t", "int4mma", "tinygemm"])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--top", type=int, default=4, help="rows per (kind, shape) in the table")
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (batched decoding)")
    ap.add_argument("--deadline", type=float, default=420, help="seconds; later measurements are skipped")
    ap.add_argument("--check", action="store_true", help="first check Ember's modules against float math")
    ap.add_argument(
        "--x-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="activations' storage (Triton kinds)",
    )
    args = ap.parse_args()
    if args.check:
        check_modules()
        check_int4_mma()
        check_int4_tiled()
    t_start = time.perf_counter()
    read, copy = read_bandwidth()
    print(f"read-only {read / 1e9:.0f} GB/s, copy {copy / 1e9:.0f} GB/s (read + write)", flush=True)
    x = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16)
    results = []
    for kind in args.kinds:
        for shape in args.shapes:
            if time.perf_counter() - t_start > args.deadline:
                print(f"deadline reached; skipping {kind} {shape}", flush=True)
                continue
            N, K = SHAPES[shape]
            configs = [None] if kind in ("tinygemm",) else configs_for(kind, N, K)
            if kind in ("bf16", "bf16glu", "int8glu"):
                configs = [None] + configs  # None = cuBLAS (bf16), or the tiles the GLU op tunes itself
            try:
                probe, nbytes = weights_for(kind, N, K, 1)
            except Exception as e:  # e.g. tinygemm missing on this build
                print(f"{kind} {shape}: unavailable ({type(e).__name__}: {e})", flush=True)
                continue
            copies = max(2, math.ceil(POOL_BYTES / nbytes))
            ws, nbytes = weights_for(kind, N, K, copies)
            # bf16 values either way; float32 storage shows what converting x in the kernel costs.
            x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16).to(
                getattr(torch, args.x_dtype)
            )
            compile_in_parallel(kind, x, ws, [c for c in configs if c is not None])
            for config in configs:
                try:
                    sec = timed_graph(kernel_calls(kind, x, ws, config), calls=copies)
                except Exception as e:
                    print(f"{kind} {shape} {config}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                    continue
                results.append(
                    dict(kind=kind, shape=shape, config=config, us=sec * 1e6, gb_s=nbytes / sec / 1e9)
                )
            del ws
            torch.cuda.empty_cache()
            best = sorted(
                (r for r in results if r["kind"] == kind and r["shape"] == shape), key=lambda r: r["us"]
            )
            for r in best[: args.top]:
                label = json.dumps(r["config"])
                if r["config"] is None:
                    label = "cuBLAS" if kind == "bf16" else "picked (ember.quant.tuning)"
                print(
                    f"{kind:<9}{shape:<9}{r['us']:9.1f} us {r['gb_s']:7.0f} GB/s {100 * r['gb_s'] * 1e9 / read:5.1f}% "
                    f"of read  {label}",
                    flush=True,
                )
            cublas = [r for r in results if r["kind"] == kind and r["shape"] == shape and r["config"] is None]
            if kind == "bf16" and cublas and cublas[0] not in best[: args.top]:
                r = cublas[0]
                print(f"{kind:<9}{shape:<9}{r['us']:9.1f} us {r['gb_s']:7.0f} GB/s  cuBLAS", flush=True)
    print("RESULTS " + json.dumps(results), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


def check_modules() -> None:
    """Ember's modules on this GPU against float math on their dequantized weights: relative error per
    (scheme, shape, rows). One row takes the decode kernels; 17 rows the prefill path."""
    from torch import nn

    from ember.ops.linear import Linear
    from ember.quant import QuantSpec

    for (N, K), scheme, rows in itertools.product(
        [(4096, 4096), (6144, 14336), (28672, 4096)], ["bf16", "int8", "int4-g32", "int4-g128"], [1, 4, 17]
    ):
        linear = Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        nn.init.normal_(linear.weight, std=0.02)
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        if scheme == "bf16":
            module, w = linear, linear.weight.detach().float()
        else:
            module = QuantSpec.parse(scheme).make(linear)
            module.prepare()
            w = module.dequantize()
        with torch.no_grad():
            y = module(x).float()
        ref = x.float() @ w.T
        err = float((y - ref).norm() / ref.norm())
        kernel = getattr(module, "_kernel", "")
        print(f"check {scheme:<10}{kernel:<9} N={N:<6} K={K:<6} rows={rows:<3} rel err {err:.2e}", flush=True)
        assert err < 2e-2, (scheme, N, K, rows, err)


def check_int4_tiled() -> None:
    """The tiled int4 GEMV against float math on its dequantized weights (s and min rounded to bf16), at one
    row, for activations of ordinary, large, tiny and zero size: the kernel scales weights and x by powers of
    two up to 2^79 and reads codes as subnormal floats, which a flush-to-zero build would lose."""
    from ember.quant import triton_kernels as tk
    from ember.quant.kernels import int4_subnormal_scales, int4_tile
    from ember.quant.linear import pack_nibbles, quantize_int4_grouped

    worst = 0.0
    for (N, K), g in itertools.product([(4096, 4096), (6144, 14336), (1000, 2048)], [32, 64, 128, 256]):
        codes, sc, mn = quantize_int4_grouped(torch.randn(N, K, device="cuda") * 0.02, g)
        sz = int4_subnormal_scales(sc, mn)
        words = int4_tile(pack_nibbles(codes), g)
        s, m = sc.to(torch.bfloat16).float(), mn.to(torch.bfloat16).float()
        w = (codes.reshape(N, -1, g).float() * s[..., None] + m[..., None]).reshape(N, K)
        for amp in (1.0, 3e4, 1e-6, 0.0):
            x = (torch.randn(1, K, device="cuda") * amp).to(torch.bfloat16)
            want = x.float() @ w.T
            tiles = K // (8 * g)
            variants = [{"BLOCK_N": bn, "num_warps": nw} for bn, nw in [(16, 4), (64, 8)]]
            variants += [{"BLOCK_N": 16, "num_warps": 4, "SPLIT": d} for d in (2, 7) if tiles % d == 0]
            variants += [None] if g == 128 else []  # None: what the op picks (ember.quant.tuning, or split)
            for blocks in variants:
                got = tk.int4_tiled_gemv(x, words, sz, g, blocks=blocks).float()
                if amp == 0.0:
                    assert bool((got == 0).all()), (N, K, g, blocks)
                    continue
                err = float((got - want).norm() / want.norm())
                worst = max(worst, err)
                assert err < 1e-2, (N, K, g, amp, blocks, err)
    print(
        f"check int4 tiled GEMV: worst relative error {worst:.2e} (x of size 1, 3e4, 1e-6; 0 exact)",
        flush=True,
    )


def check_int4_mma() -> None:
    """The tensor-core int4 GEMV against float math on its dequantized weights (s and min rounded to bf16), at
    1, 3 and 8 rows (one per mma column), each group size it takes, with and without K split, for activations
    of ordinary, large and tiny size and zero."""
    from ember.quant import triton_mma
    from ember.quant.kernels import int4_mma_scales, int4_mma_tile
    from ember.quant.linear import pack_nibbles, quantize_int4_grouped

    worst = 0.0
    for (N, K), g in itertools.product([(4096, 4096), (6144, 14336), (1040, 1024)], [64, 128, 256]):
        codes, sc, mn = quantize_int4_grouped(torch.randn(N, K, device="cuda") * 0.02, g)
        words, sz = int4_mma_tile(pack_nibbles(codes)), int4_mma_scales(sc, mn)
        s, m = sc.to(torch.bfloat16).float(), mn.to(torch.bfloat16).float()
        w = (codes.reshape(N, -1, g).float() * s[..., None] + m[..., None]).reshape(N, K)
        for rows, amp in itertools.product((1, 3, 8), (1.0, 3e4, 1e-6, 0.0)):
            x = (torch.randn(rows, K, device="cuda") * amp).to(torch.bfloat16)
            want = x.float() @ w.T
            for warps, split in [(4, None), (8, 2), (4, 4)]:
                if split and (K // g) % split:
                    continue
                blocks = {"WARPS": warps, "num_warps": warps, "num_stages": 1}
                got = triton_mma.int4_mma_gemv(x, words, sz, g, split, blocks=blocks).float()
                got = got.sum(0) if split else got
                if amp == 0.0:
                    assert bool((got == 0).all()), (N, K, g, rows, split)
                    continue
                err = float((got - want).norm() / want.norm())
                worst = max(worst, err)
                assert err < 1e-2, (N, K, g, rows, amp, split, err)
    print(
        f"check int4 mma GEMV: worst relative error {worst:.2e} (1/3/8 rows; x of size 1, 3e4, 1e-6; 0 exact)"
    )


def compile_in_parallel(kind: str, x: torch.Tensor, ws, configs: list[dict]) -> None:
    """Compiles every config once (Triton's compiler and ptxas run outside the GIL for much of the time)."""

    def one(config):
        with contextlib.suppress(Exception):  # a failing config is reported when it is timed
            kernel_calls(kind, x, ws, config)(0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, configs))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
