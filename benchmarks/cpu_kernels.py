"""Ember's CPU kernels (`ember.ops.cpu_ext`) against torch's, call by call, at a model's decode shapes; SmolLM2-135M's
by default. Medians of alternated runs, microseconds a call, 2 threads unless --threads.

    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_kernels.py
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_kernels.py --rows 1 4 16 --slots 256 1024

- int4 (groups of 32): `ember_cpu::int4_gemv` vs torch's `_weight_int4pack_mm_for_cpu` (bf16 activations);
  "step" adds up one decode step's projections (each layer's qkv, o, gate/up, down) over distinct copies of the
  weights, so that they stream from memory as in a real step.
- int4 prefill (`--prefill-rows`): `int4_gemv` (int8 activation codes) and, on CPUs with AMX-BF16,
  `int4_gemm_bf16` (dequantized a tile at a time), against torch's int4 kernel and against torch's bf16 GEMM
  over weights dequantized beforehand (oneDNN: what the same projection costs a bf16 model).
- int8-dyn: `ember_cpu::int8_gemv` vs `torch._int_mm`, both with the activation's per-row int8 quantization.
- attention: `ember_cpu::decode_attention` vs `grouped_decode_attention` (masked matmuls over every slot), one
  query token at the last slot; and `paged_decode_attention` vs the paged cache's gather + SDPA, rows whose
  tokens are scattered over the pool.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.ops import cpu_ext
from ember.ops.attention import causal_mask, grouped_decode_attention, sdpa_attention
from ember.quant.linear import pack_nibbles, quantize_int4_grouped, quantize_int8_per_channel, tinygemm_layout

SMOLLM2 = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, layers=30)


def median_us(fns: dict, repeats: int) -> dict[str, float]:
    """Median time of each callable, the arms alternated `repeats` times after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def int4_operands(N: int, K: int, copies: int = 1) -> list[tuple]:
    out = []
    for _ in range(copies):
        codes, scales, mins = quantize_int4_grouped(torch.randn(N, K) * 0.05, 32)
        qweight = pack_nibbles(codes)
        out.append((*cpu_ext.int4_tiles(qweight, scales, mins), *tinygemm_layout(qweight, scales, mins)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16], help="activation rows a call")
    ap.add_argument("--slots", type=int, nargs="*", default=[256, 1024], help="attention: positions + 1")
    ap.add_argument(
        "--prefill-rows", type=int, nargs="*", default=[64, 128, 512], help="int4 prefill: rows a call"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ext.available():
        raise SystemExit("Ember's CPU kernels are not available here (see the log line above)")
    m = SMOLLM2
    h, i = m["hidden"], m["intermediate"]
    qkv = (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
    shapes = {"qkv": (qkv, h), "o": (h, h), "gate/up": (2 * i, h), "down": (h, i)}
    print(
        f"SmolLM2-135M shapes, {args.threads} threads, {torch.ops.ember_cpu.simd()}; us a call, median of {args.repeats}"
    )
    print(f"\n{'int4-g32':10} {'rows':>4} {'Ember':>9} {'torch':>9} {'speed-up':>9}")
    for name, (N, K) in shapes.items():
        tiles, scale_min, packed, sz = int4_operands(N, K)[0]
        for rows in args.rows:
            x = torch.randn(rows, K)
            xb = x.bfloat16()
            t = median_us(
                {
                    "ember": lambda: torch.ops.ember_cpu.int4_gemv(x, tiles, scale_min, 32),  # noqa: B023
                    "torch": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz),  # noqa: B023
                },
                args.repeats,
            )
            print(f"{name:10} {rows:4d} {t['ember']:9.1f} {t['torch']:9.1f} {t['torch'] / t['ember']:8.2f}x")
    layers = [{n: int4_operands(N, K)[0] for n, (N, K) in shapes.items()} for _ in range(m["layers"])]
    xs = {K: torch.randn(1, K) for K in (h, i)}

    def step(ember: bool) -> None:
        for layer in layers:
            for n, (tiles, scale_min, packed, sz) in layer.items():
                x = xs[shapes[n][1]]
                if ember:
                    torch.ops.ember_cpu.int4_gemv(x, tiles, scale_min, 32)
                else:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz)

    t = median_us({"ember": lambda: step(True), "torch": lambda: step(False)}, max(5, args.repeats // 20))
    print(f"{'step':10} {1:4d} {t['ember']:9.1f} {t['torch']:9.1f} {t['torch'] / t['ember']:8.2f}x")

    amx = cpu_ext.amx_bf16()
    print(
        f"\n{'int4 prefill':12} {'rows':>4} {'codes':>8} {'bf16 AMX':>9} {'torch int4':>11} {'torch bf16':>11}"
        f" {'vs torch int4':>14}"
    )
    for name, (N, K) in shapes.items():
        tiles, scale_min, packed, sz = int4_operands(N, K)[0]
        w = torch.randn(N, K).bfloat16()  # a bf16 model's weight of the same shape
        for rows in args.prefill_rows:
            x = torch.randn(rows, K)
            xb = x.bfloat16()
            fns = {
                "codes": lambda: torch.ops.ember_cpu.int4_gemv(x, tiles, scale_min, 32),  # noqa: B023
                "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz),  # noqa: B023
                "bf16": lambda: torch.nn.functional.linear(xb, w),  # noqa: B023
            }
            if amx:
                fns["amx"] = lambda: torch.ops.ember_cpu.int4_gemm_bf16(x, tiles, scale_min, 32)  # noqa: B023
            t = median_us(fns, max(5, args.repeats // 10))
            best = min(t["codes"], t.get("amx", t["codes"]))
            amx_col = f"{t['amx']:9.1f}" if amx else f"{'-':>9}"
            print(
                f"{name:12} {rows:4d} {t['codes']:8.1f} {amx_col} {t['int4']:11.1f} {t['bf16']:11.1f}"
                f" {t['int4'] / best:13.2f}x"
            )

    print(f"\n{'int8-dyn':10} {'rows':>4} {'Ember':>9} {'_int_mm':>9} {'speed-up':>9}")
    for name, (N, K) in {**shapes, "lm_head": (m["vocab"], h)}.items():
        qweight, scales = quantize_int8_per_channel(torch.randn(N, K))
        tiles, wt = cpu_ext.int8_tiles(qweight), qweight.t()
        for rows in args.rows:
            x = torch.randn(rows, K)

            def int_mm(x=x, wt=wt, scales=scales):
                x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
                xq = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
                return torch._int_mm(xq, wt).float() * x_scale * scales

            t = median_us(
                {
                    "ember": lambda: torch.ops.ember_cpu.int8_gemv(x, tiles, scales),  # noqa: B023
                    "torch": int_mm,
                },
                args.repeats,
            )
            print(f"{name:10} {rows:4d} {t['ember']:9.1f} {t['torch']:9.1f} {t['torch'] / t['ember']:8.2f}x")

    print(f"\n{'attention':10} {'slots':>5} {'Ember':>8} {'matmuls':>9} {'speed-up':>9}")
    H, K, D = m["heads"], m["kv_heads"], m["head_dim"]
    for S in args.slots:
        q = torch.randn(1, H, D)
        k_cache, v_cache = torch.randn(1, K, S, D), torch.randn(1, K, S, D)
        pos = torch.tensor([S - 1])
        mask = causal_mask(pos[:, None], torch.arange(S)[None], None)
        t = median_us(
            {
                "ember": lambda: torch.ops.ember_cpu.decode_attention(q, k_cache, v_cache, pos, D**-0.5, 0),  # noqa: B023
                "torch": lambda: grouped_decode_attention(q[:, None], k_cache, v_cache, mask, D**-0.5),  # noqa: B023
            },
            args.repeats,
        )
        print(f"{'':10} {S:5d} {t['ember']:8.1f} {t['torch']:9.1f} {t['torch'] / t['ember']:8.2f}x")

    print(f"\n{'paged':10} {'rows':>4} {'slots':>5} {'Ember':>8} {'gather+SDPA':>12} {'speed-up':>9}")
    for B in (1, 4):
        for S in args.slots:
            pool = B * S + 64  # each row's tokens scattered over the pool, as block tables leave them
            k_pool, v_pool = torch.randn(pool, K, D), torch.randn(pool, K, D)
            slots = torch.stack([torch.randperm(pool)[:S] for _ in range(B)])  # (B, S)
            pos = torch.full((B,), S - 1)
            q = torch.randn(B, H, D)
            mask = causal_mask(pos[:, None], torch.arange(S)[None], None)

            def paged(q=q, k_pool=k_pool, v_pool=v_pool, slots=slots, pos=pos):
                return torch.ops.ember_cpu.paged_decode_attention(q, k_pool, v_pool, slots, pos, D**-0.5, 0)

            def gather_sdpa(q=q, k_pool=k_pool, v_pool=v_pool, slots=slots, mask=mask):
                kd, vd = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)  # (B, K, S, D)
                return sdpa_attention(q[:, :, None], kd, vd, mask, scale=D**-0.5, softcap=None)

            t = median_us({"ember": paged, "torch": gather_sdpa}, args.repeats)
            speedup = t["torch"] / t["ember"]
            print(f"{'':10} {B:4d} {S:5d} {t['ember']:8.1f} {t['torch']:12.1f} {speedup:8.2f}x")


if __name__ == "__main__":
    main()
