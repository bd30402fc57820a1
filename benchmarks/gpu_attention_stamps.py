"""Where Ember's CUDA decode attention spends its time, stamp by stamp, on one GPU.

The kernel (`src/ember/ops/csrc/decode_attention.cu`) marks eight points of a block's path with `STAMP(i)`,
empty there. This script builds a copy in which thread 0 of each block writes `clock64` and `%globaltimer` at
each point into the `k_next` argument (a buffer here; the L2 prefetch it would feed is off), and runs it
as the int4 step does: a CUDA graph of 32 Llama-3-8B layers, each the int4 qkv GEMV (CUDA, whole rows) and
then attention at S cache slots, the row at position P.

    python benchmarks/gpu_attention_stamps.py                    # S 384, position 300, the default tiles
    python benchmarks/gpu_attention_stamps.py --slots 1024 --position 1000 --config 4 8 8
    python benchmarks/gpu_attention_stamps.py --o-proj 2 8 2    # and the o projection after it

With `--o-proj TW KW DEPTH` each layer goes on into the int4 o projection that carries the MLP's norm (FOLD 1
of `src/ember/quant/csrc/int4_gemv.cu`, as a step with `cuda_int4.FOLD_NORMS` runs it), whose blocks stamp six
points of their own (in a buffer past the tiles' sums of squares); they are printed past the end of the
layer's last attention block, the moment the projection's wait can return at the earliest.

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
O_POINTS = ["entry", "waited", "first group", "groups done", "warps' sums met", "end"]

STAMP = r"""
#define STAMP(point) do { if (threadIdx.x == 0) { long long* s_ = (long long*)k_next + blockIdx.x * 16; \
  unsigned lo_, hi_; asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(lo_)); \
  asm volatile("mov.u32 %0, %%globaltimer_hi;" : "=r"(hi_)); \
  s_[point] = clock64(); s_[8 + (point)] = ((long long)hi_ << 32) | lo_; } } while (0)
"""

# the int4 GEMV's: FOLD 1 instances only, into their sq buffer past its N / 16 sums
O_STAMP = r"""
#define STAMP(point) do { if (FOLD == 1 && threadIdx.x == 0) { \
  long long* s_ = (long long*)(sq + (N >> 4)) + (blockIdx.y * gridDim.x + blockIdx.x) * 16; \
  unsigned lo_, hi_; asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(lo_)); \
  asm volatile("mov.u32 %0, %%globaltimer_hi;" : "=r"(hi_)); \
  s_[point] = clock64(); s_[8 + (point)] = ((long long)hi_ << 32) | lo_; } } while (0)
"""


def points_table(us: torch.Tensor, clock: torch.Tensor, points: list[str], past: str) -> None:
    """Each point's us past a layer's reference moment (median / min / max over blocks and layers), and the
    cycles of each stretch between points (median)."""
    print(f"\npoint: us past {past} (median / min / max over blocks)")
    for i, point in enumerate(points):
        v = us[..., i].flatten().tolist()
        print(f"  {point:16s} {statistics.median(v):7.2f} {min(v):7.2f} {max(v):7.2f}")
    print("\nstretch: cycles (median over blocks)")
    for i in range(len(points) - 1):
        v = (clock[..., i + 1] - clock[..., i]).flatten().tolist()
        print(f"  {points[i]} -> {points[i + 1]}: {statistics.median(v):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=384, help="cache slots S")
    ap.add_argument("--position", type=int, default=300, help="the row's position (< S)")
    ap.add_argument(
        "--config", type=int, nargs=3, default=None, help="warps, steps, cluster (default: the op's)"
    )
    ap.add_argument("--qkv", type=int, nargs=3, default=(1, 8, 2), help="the qkv GEMV's TW KW DEPTH")
    ap.add_argument(
        "--o-proj", type=int, nargs=3, default=None, help="also the carried o GEMV after it: TW KW DEPTH"
    )
    args = ap.parse_args()

    from ember.ops import cuda_attention, launch
    from ember.quant import cuda_int4

    L, H, K, D, S = 32, 32, 8, 128, args.slots
    dev, bf = torch.device("cuda"), torch.bfloat16
    config = tuple(args.config) if args.config else cuda_attention.default_config(S, D, H // K)
    qkv_config = (*args.qkv, False, False)  # TW KW DEPTH LEAN ASYNC
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

    int4_plain = cuda_int4.SOURCE
    int4_stamped = stamped.with_name("int4_gemv_stamped.cu")
    int4_stamped.write_text(O_STAMP + int4_plain.read_text())
    E = 4096
    if args.o_proj:
        o_config = (*args.o_proj, False, False)
        o_ws, _ = weights_for("int4cu", E, H * D, L)
        o_blocks = -(-(E // 16) // o_config[0])
        resid = torch.randn(1, E, device=dev, dtype=bf)
        h, hw = torch.empty(1, E, device=dev, dtype=bf), torch.empty(1, E, device=dev, dtype=bf)
        wn = (torch.rand(E, device=dev) + 0.5).to(bf)
        o_sq = torch.zeros(L, E // 16 + 32 * o_blocks, device=dev)

    def gemv(i: int) -> None:
        cuda_int4.gemv(x, *ws[i % L], ys[i % L], 128, qkv_config, 1, pdl)

    def o_proj(i: int, out: torch.Tensor, stamp: bool) -> None:
        cuda_int4.SOURCE = int4_stamped if stamp else int4_plain
        fold = (1, resid, hw, o_sq[i % L], wn, 0.0)
        cuda_int4.gemv(out.reshape(1, -1), *o_ws[i % L], h, 128, o_config, 1, pdl, fold=fold)
        cuda_int4.SOURCE = int4_plain

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
            if args.o_proj and with_o:
                o_proj(i, out, stamp)

        return call

    alone = timed_graph(gemv, L)
    for label, stamp in (("plain", False), ("stamped", True)):
        # read at each launch: each graph keeps the kernel it was captured with
        cuda_attention.SOURCE = stamped if stamp else plain
        with_o = False
        t = timed_graph(layer(stamp), L)
        print(f"{label}: S {S}, position {args.position}, attention {config}, qkv {qkv_config}: layer "
              f"{t * 1e6:.2f} us, qkv alone {alone * 1e6:.2f}, attention {(t - alone) * 1e6:.2f}")  # fmt: skip
        if args.o_proj:
            with_o = True
            t_o = timed_graph(layer(stamp), L)
            print(f"  and the carried o GEMV {o_config}: layer {t_o * 1e6:.2f} us, o {(t_o - t) * 1e6:.2f}")
    cuda_attention.SOURCE = plain

    s = stamps.view(L, blocks, 16)[1:].cpu().double()  # layer 0 follows the graph's start
    clock, timer = s[..., :8], s[..., 8:]
    waited = timer[..., 1].min(dim=1, keepdim=True).values  # each layer's first return from the wait
    points_table((timer - waited[..., None]) / 1e3, clock, POINTS, "the layer's first wait return")
    if args.o_proj:
        ended = timer[..., 7].max(dim=1).values  # each layer's last attention block's end
        o = o_sq[1:, E // 16 :].contiguous().view(torch.int64).view(L - 1, o_blocks, 16).cpu().double()
        o_us = (o[..., 8 : 8 + len(O_POINTS)] - ended[:, None, None]) / 1e3
        points_table(
            o_us, o[..., : len(O_POINTS)], O_POINTS, "the layer's last attention block's end (o GEMV)"
        )


if __name__ == "__main__":
    main()
