"""Where Ember's CUDA decode attention spends its time, stamp by stamp, on one GPU.

The kernel (`src/ember/ops/csrc/decode_attention.cu`) marks eight points of a block's path with `STAMP(i)`,
empty there. This script builds a copy in which thread 0 of each block writes `clock64` and `%globaltimer` at
each point into the `k_next` argument (a buffer here; the L2 prefetch it would feed is off), and runs it
as the int4 step does: a CUDA graph of 32 Llama-3-8B layers, each the int4 qkv GEMV (CUDA, whole rows) and
then attention at S cache slots, the row at position P.

    python benchmarks/gpu_attention_stamps.py                    # S 384, position 300, the default tiles
    python benchmarks/gpu_attention_stamps.py --slots 1024 --position 1000 --config 4 8 8

It prints each layer's time with and without attention (the stamped and the plain kernel), each point's time
past the layer's first return from `griddepcontrol.wait` (median, min, max over blocks, from the global timer)
and each stretch between points in cycles (median over blocks), which is how the twenty-sixth session found
the path after the wait (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_gemv import timed_graph, weights_for  # noqa: E402

POINTS = ["entry", "waited", "q, k roped", "slots done", "own slot", "block merged", "shares in", "end"]

STAMP = r"""
#define STAMP(point) do { if (threadIdx.x == 0) { long long* s_ = (long long*)k_next + blockIdx.x * 16; \
  unsigned lo_, hi_; asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(lo_)); \
  asm volatile("mov.u32 %0, %%globaltimer_hi;" : "=r"(hi_)); \
  s_[point] = clock64(); s_[8 + (point)] = ((long long)hi_ << 32) | lo_; } } while (0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=384, help="cache slots S")
    ap.add_argument("--position", type=int, default=300, help="the row's position (< S)")
    ap.add_argument(
        "--config", type=int, nargs=3, default=None, help="warps, steps, cluster (default: the op's)"
    )
    ap.add_argument("--qkv", type=int, nargs=3, default=(1, 8, 2), help="the qkv GEMV's TW KW DEPTH")
    args = ap.parse_args()

    from ember.ops import cuda_attention, launch
    from ember.quant import cuda_int4

    L, H, K, D, S = 32, 32, 8, 128, args.slots
    dev, bf = torch.device("cuda"), torch.bfloat16
    config = tuple(args.config) if args.config else cuda_attention.default_config(S, D, H // K)
    qkv_config = (*args.qkv, False)
    ws, _ = weights_for("int4cu", (H + 2 * K) * D, 4096, L)
    x = torch.randn(1, 4096, device=dev, dtype=bf)
    ys = [torch.empty(1, (H + 2 * K) * D, device=dev, dtype=bf) for _ in range(L)]
    caches = [(torch.randn(1, K, S, D, device=dev, dtype=bf), torch.randn(1, K, S, D, device=dev, dtype=bf))
              for _ in range(L)]  # fmt: skip
    cos, sin = torch.rand(1, D, device=dev), torch.rand(1, D, device=dev)
    pos = torch.tensor([args.position], device=dev)
    blocks = K * config[2]
    stamps = torch.zeros(L, blocks * 16, device=dev, dtype=torch.int64)
    pdl = launch.pdl(dev)
    plain = cuda_attention.SOURCE
    stamped = Path(tempfile.mkdtemp()) / "decode_attention_stamped.cu"
    stamped.write_text(STAMP + plain.read_text())

    def gemv(i: int) -> None:
        cuda_int4.gemv(x, *ws[i % L], ys[i % L], 128, qkv_config, 1, pdl)

    def layer(stamp: bool):
        def call(i: int) -> None:
            gemv(i)
            q, k, v = (t.view(1, -1, D) for t in ys[i % L].split([H * D, K * D, K * D], dim=-1))
            # stamped: the stamps go where the next layer's caches would (the prefetch they feed is off)
            nxt = (stamps[i % L], stamps[i % L]) if stamp else caches[(i + 1) % L]
            out = cuda_attention.decode_attention(
                q, k, v, cos, sin, *caches[i % L], pos, D**-0.5, 0, *nxt, config=config,
                prefetch=False if stamp else None,
            )  # fmt: skip
            if out is None:
                raise SystemExit("the CUDA decode attention could not be built on this GPU")

        return call

    alone = timed_graph(gemv, L)
    for label, stamp in (("plain", False), ("stamped", True)):
        # read at each launch: each graph keeps the kernel it was captured with
        cuda_attention.SOURCE = stamped if stamp else plain
        t = timed_graph(layer(stamp), L)
        print(f"{label}: S {S}, position {args.position}, attention {config}, qkv {qkv_config}: layer "
              f"{t * 1e6:.2f} us, qkv alone {alone * 1e6:.2f}, attention {(t - alone) * 1e6:.2f}")  # fmt: skip
    cuda_attention.SOURCE = plain

    s = stamps.view(L, blocks, 16)[1:].cpu().double()  # layer 0 follows the graph's start
    clock, timer = s[..., :8], s[..., 8:]
    waited = timer[..., 1].min(dim=1, keepdim=True).values  # each layer's first return from the wait
    us = (timer - waited[..., None]) / 1e3
    print("\npoint: us past the layer's first wait return (median / min / max over blocks)")
    for i, point in enumerate(POINTS):
        v = us[..., i].flatten().tolist()
        print(f"  {point:14s} {statistics.median(v):7.2f} {min(v):7.2f} {max(v):7.2f}")
    print("\nstretch: cycles (median over blocks)")
    for i in range(len(POINTS) - 1):
        v = (clock[..., i + 1] - clock[..., i]).flatten().tolist()
        print(f"  {POINTS[i]} -> {POINTS[i + 1]}: {statistics.median(v):.0f}")


if __name__ == "__main__":
    main()
