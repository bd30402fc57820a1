"""The int4 decode GEMV on tensor cores: mma.sync in inline PTX, inside a Triton kernel.

Decoding reads every weight once per token, so an int4 GEMV should take a quarter of bf16's time. With CUDA
cores it cannot: turning a nibble into a float and multiplying it costs at least an AND and an FMA per weight,
and the subnormal-float GEMV (`triton_kernels._int4_tiled_gemv_kernel`, 4.7 instructions per weight in its
sm90 SASS) issued instructions, not bytes, at its limit: 1.6-2.4 TB/s of codes on an H200. Here the tensor
cores multiply, and a weight costs under one instruction:

- One LOP3 makes two bf16 of two nibbles: (word >> 4i) & 0x000F000F | 0x43004300 is the pair 128 + q, exactly
  (bf16 holds 7 mantissa bits above 128's exponent). Four such registers are the A operand of one
  mma.m16n8k16 (16 rows x 16 k); the codes are stored in exactly that fragment order (`kernels.int4_mma_tile`),
  so a lane's 16-byte load holds the operands of 4 mmas, and its two 16-byte loads of activations hold
  their B operands (the same x in all 8 columns, or up to 8 activation rows, one per column).
- A second mma per step multiplies the same B by ones, giving each group's sum of x. A group's result is
  then s * sum((128 + q) x) + (min - 128 s) * sum(x), two FMAs per group and row in float32 (s, min: the
  group's factors, bf16, `kernels.int4_mma_scales`), the products being exact and the sums float32.
- Where N gives few warps (one per 16 rows), K is split into runs of groups and the float32 partial sums are
  left for the consumer (the next add + RMSNorm, or SwiGLU's activation: `kernels.SplitSum`) or added by a
  second kernel.

Triton runs the PTX as an elementwise op over tensors whose every lane holds 4 consecutive elements (4
registers): the kernel's tensors are laid out so that those are the fragments, and the scale factors are
loaded by inline PTX too (a tl.load would take a layout of its own and cost a shared-memory shuffle).
Checked on CPU twice over (tests/quant/test_quant_mma.py): the fragment arithmetic by emulating each mma from
the operand layouts of the PTX ISA ("Matrix fragments for mma.m16n8k16"), and the kernel itself in Triton's
interpreter, which runs no PTX, with its mma step written in tensor ops (`_mma_step_emulated`; the compiled
kernel is the same, that branch being pruned); on the GPU against float math (`benchmarks/gpu_gemv.py
--check`). Needs sm80 or later (bf16 mma), bf16 activations.

Shape legend: M rows of activations (<= 8), K input features, N output features, g group size, S splits.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ember.ops.launch import launch_options
from ember.quant import cuda_int4, tuning
from ember.quant.triton_kernels import _factors, sum_splits

MAX_ROWS = 8  # activation rows one launch serves: the mma's 8 columns
WARPS_PER_SM = 30  # `splits`: enough warps that every multiprocessor has about this many in flight
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _step_asm() -> str:
    # Operands: out C $0-$3, out X $4-$7, words $8-$11 (one per mma), x $12-$19 (mma m: $12+2m, $13+2m),
    # C in $20-$23, X in $24-$27. C += A(words) @ B(x) and X += ones @ B(x) over the step's 4 mmas.
    lines = ["{", ".reg .b32 a0, a1, a2, a3, t, one;", "mov.b32 one, 0x3F803F80;"]  # bf16 (1, 1)
    for m in range(4):
        w = f"${8 + m}"
        for i in range(4):
            src = w if i == 0 else "t"
            if i:
                lines.append(f"shr.u32 t, {w}, {4 * i};")
            lines.append(f"lop3.b32 a{i}, {src}, 0x000F000F, 0x43004300, 0xEA;")  # (src & b) | c
        b = f"{{${12 + 2 * m}, ${13 + 2 * m}}}"
        c_in = "{$20, $21, $22, $23}" if m == 0 else "{$0, $1, $2, $3}"
        x_in = "{$24, $25, $26, $27}" if m == 0 else "{$4, $5, $6, $7}"
        lines.append(f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {b}, {c_in};")
        lines.append(f"{_MMA} {{$4, $5, $6, $7}}, {{one, one, one, one}}, {b}, {x_in};")
    lines.append("}")
    return "\n".join(lines)


STEP_ASM = tl.constexpr(_step_asm())
STEP_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 12 + ["f"] * 8))


@triton.jit
def _mma_step(words, xa, xb, c, xs):
    # words, xa, xb, c, xs: (U, L) with 4 consecutive elements per lane (one pack): -> (C, X) as c and xs.
    return tl.inline_asm_elementwise(
        STEP_ASM,
        STEP_CONSTRAINTS,
        [words, xa, xb, c, xs],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _mma_step_emulated(words, xa, xb, c, xs, U: tl.constexpr, WARPS: tl.constexpr):
    # What `_mma_step` computes, in tensor ops, for Triton's interpreter (which runs no PTX): the registers of
    # lane (g, q) of warp w are elements (w, g, q, 0..3) of the (U, L) tensors; each mma multiplies the A and B
    # fragments as the PTX ISA lays them out (a_j: row g + 8 ((j >> 1) & 1), k 2q + (j & 1) + 8 (j >> 2); b_j:
    # k 2q + (j & 1) + 8 (j >> 1), column g) and adds the products in float32.
    i4 = tl.arange(0, 4)
    i2 = tl.arange(0, 2)
    # A register i = 2r + ro of word m holds the nibbles at bits 4i (half 0) and 4i + 16 (half 1): 128 + q.
    shifts = tl.reshape(i4[:, None] * 4 + i2[None, :] * 16, (1, 1, 1, 1, 1, 4, 2))
    w7 = tl.reshape(words, (U, WARPS, 8, 4, 4, 1, 1))  # (u, w, g, q, m, i, h)
    a = ((w7 >> shifts) & 0xF).to(tl.float32) + 128.0
    a = tl.reshape(a, (U, WARPS, 8, 1, 4, 4, 2, 2, 2))  # (u, w, g, n, q, m, r, ro, h)
    # B registers: x pair p = 4t + c of the lane (t: xa or xb) is register r = p % 2 of mma m = p // 2.
    regs = tl.permute(
        tl.join(tl.reshape(xa, (U, WARPS, 8, 4, 4)), tl.reshape(xb, (U, WARPS, 8, 4, 4))), (0, 1, 2, 3, 5, 4)
    )
    hi, lo = _factors(regs)  # a register's two bf16: h = 0 the low half
    b = tl.reshape(tl.join(lo, hi), (U, WARPS, 8, 4, 4, 2, 2))  # (u, w, n, q, m, r, h): column n = lane's g
    prod = a * tl.reshape(b, (U, WARPS, 1, 8, 4, 4, 2, 1, 2))
    acc = tl.sum(tl.sum(tl.sum(tl.sum(prod, 8), 6), 5), 4)  # (u, w, g, n, ro): row g + 8 ro, column n
    # Lane (g, q) holds accumulator cc = 2 ro + c2: row g + 8 ro, column n = 2q + c2.
    acc = tl.permute(tl.reshape(acc, (U, WARPS, 8, 4, 2, 2)), (0, 1, 2, 3, 5, 4))
    ones = tl.sum(tl.sum(tl.sum(tl.sum(b, 6), 5), 4), 3)  # (u, w, n): a column's sum of x over the step
    ones = tl.broadcast_to(tl.reshape(ones, (U, WARPS, 1, 4, 1, 2)), (U, WARPS, 8, 4, 2, 2))
    return c + tl.reshape(acc, (U, WARPS * 128)), xs + tl.reshape(ones, (U, WARPS * 128))


@triton.jit
def _load_b32(ptrs, EMULATE: tl.constexpr):
    # A 32-bit load that keeps the layout of ptrs (tl.load would take one from its addresses' contiguity).
    if EMULATE:
        return tl.load(ptrs)
    return tl.inline_asm_elementwise(
        "ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _int4_mma_kernel(
    x_ptr,
    w_ptr,
    sz_ptr,
    y_ptr,
    N,
    M,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    WARPS: tl.constexpr,
    SPLIT: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    EMULATE: tl.constexpr = False,
):
    # Grid (cdiv(N / 16, WARPS), SPLIT): warp w of program p owns rows 16 (p * WARPS + w) onwards and the
    # program_id(1)-th of SPLIT runs of groups. Elements e of a step's tensors (L = WARPS * 128 of them):
    # warp e // 128, lane (e // 4) % 32 = 4g + q, fragment register c = e % 4 (A word / B pair of mma c;
    # accumulator c: row g + 8 (c // 2), activation row 2q + c % 2). Tensors (U, L) hold a group's U steps.
    # SPLIT > 1: float32 partials in y (SPLIT, M, N); else y (M, N) in y's dtype.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    U: tl.constexpr = GROUP // 64
    L: tl.constexpr = WARPS * 128
    G: tl.constexpr = K // GROUP
    RUN: tl.constexpr = G // SPLIT  # groups per program
    T = N // 16
    e = tl.arange(0, L)
    lane = (e // 4) % 32
    own = tl.program_id(0) * WARPS + e // 128
    tile = tl.where(own < T, own, T - 1)  # warps past the last tile redo it and store nothing
    g, q, c = lane // 4, lane % 4, e % 4
    u = tl.arange(0, U)[:, None]
    step0 = tl.program_id(1) * RUN * U
    w_ptrs = w_ptr + (tile.to(tl.int64) * (K // 64) * 128 + lane * 4 + c)[None, :] + (step0 + u) * 128
    x_rows = tl.where(g < M, g, M - 1)  # B column g: activation row g (columns past M repeat the last)
    x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # bf16 pairs
    x_ptrs = x32 + (x_rows * (K // 2) + q * 8 + c)[None, :] + (step0 + u) * 32
    rows = tile * 16 + g + 8 * (c // 2)
    sz_ptrs = sz_ptr + rows * G + tl.program_id(1) * RUN
    # Weights first: nothing in this step writes them. Each is read once a step (all M rows ride in one program),
    # so its lines are the first to leave L2, which keeps the step's KV cache there (`ember.ops.triton_attention`).
    words = tl.load(w_ptrs, eviction_policy="evict_first")
    sz = _load_b32(sz_ptrs, EMULATE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    zero = tl.zeros((U, L), dtype=tl.float32)
    acc = tl.zeros((L,), dtype=tl.float32)
    for i in range(RUN):
        # The next group's words and factors are in flight while this one is multiplied.
        nxt = tl.load(w_ptrs + U * 128, mask=(u * 0 + i + 1) < RUN, other=0, eviction_policy="evict_first")
        nsz = _load_b32(sz_ptrs + tl.where(i + 1 < RUN, 1, 0), EMULATE)  # the last group: itself
        xa = tl.load(x_ptrs)
        xb = tl.load(x_ptrs + 4)
        if EMULATE:
            C, X = _mma_step_emulated(words, xa, xb, zero, zero, U, WARPS)
        else:
            C, X = _mma_step(words, xa, xb, zero, zero)
        C = tl.sum(C, axis=0)  # sum((128 + q) x) over the group, per row and activation row
        X = tl.sum(X, axis=0)  # sum(x) over the group
        s, mn = _factors(sz)
        acc += s * C + (mn - 128.0 * s) * X
        words, sz = nxt, nsz
        w_ptrs += U * 128
        x_ptrs += U * 32
        sz_ptrs += 1
    m = 2 * q + c % 2
    ok = (m < M) & (own < T)  # one lane in 4 and one register in 2 store a row's value when M = 1
    if SPLIT > 1:
        tl.store(y_ptr + tl.program_id(1) * M * N + m * N + rows, acc, mask=ok)
    else:
        tl.store(y_ptr + m * N + rows, acc.to(y_ptr.dtype.element_ty), mask=ok)


WARPS = ({"WARPS": 4, "num_warps": 4, "num_stages": 1}, {"WARPS": 8, "num_warps": 8, "num_stages": 1})


def _interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (no PTX: the mma step is emulated in tensor ops)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (1 off CUDA: Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def splits(N: int, K: int, group_size: int, multiprocessors: int) -> int:
    """Runs of groups each row's K is cut into: the fewest that give every multiprocessor WARPS_PER_SM
    warps (one warp per 16 rows and run). On an H200 (132 multiprocessors), Llama-3-8B: qkv and o 16, gate/up
    4, down 16, the best or within 2% of it in `benchmarks/gpu_gemv.py`."""
    G, tiles = K // group_size, N // 16
    fits = [d for d in range(1, G + 1) if G % d == 0]
    return next((d for d in fits if tiles * d >= WARPS_PER_SM * multiprocessors), fits[-1])


def row_splits(N: int, K: int, group_size: int, device: torch.device) -> int:
    """Runs of K a decode GEMV of this shape leaves as float32 partials: `splits`, or 1 where the CUDA C++
    kernel splits K among the warps of a block instead (`cuda_int4.whole_rows`)."""
    if cuda_int4.whole_rows(device, group_size):
        return 1
    return splits(N, K, group_size, multiprocessors(device))


def int4_mma_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    split: int | None = None,
    blocks: dict | None = None,
) -> torch.Tensor:
    """x (M, K) bf16 contiguous, M <= MAX_ROWS; words int32 (N, K/8) (`kernels.int4_mma_tile`), sz int32
    (N, K/g) (`kernels.int4_mma_scales`) -> y (M, N) in x's dtype; or, with `split`, float32 partial sums
    (split, M, N) over equal runs of K's groups. `blocks` fixes the warps per program, or {"CUDA": config}
    the CUDA C++ kernel's block shape (else timed, `ember.quant.tuning`)."""
    (M, K), N = x.shape, words.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"the int4 mma GEMV serves up to {MAX_ROWS} rows, not {M}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the int4 mma GEMV multiplies bf16 activations, not {x.dtype}")
    if x.data_ptr() % 16:  # a view that starts mid-vector: the kernel reads x in 16-byte pieces
        x = x.clone()
    if split is not None and (K // group_size) % split:
        raise ValueError(f"split={split} does not divide the {K // group_size} groups of a row")
    out = (
        torch.empty(M, N, device=x.device, dtype=x.dtype)
        if split is None
        else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    )
    opts = launch_options(x.device)
    cuda = cuda_int4.OFFERED and cuda_int4.fits(x, words, sz, group_size)

    def run(b: dict, w: tuple[torch.Tensor, ...]) -> None:
        if "CUDA" in b:
            if cuda:
                cuda_int4.gemv(x, w[0], w[1], out, group_size, b["CUDA"], split or 1, opts["PDL"])
                return
            b = WARPS[0]
        grid = (triton.cdiv(N // 16, b["WARPS"]), split or 1)
        _int4_mma_kernel[grid](
            x,
            w[0],
            w[1],
            out,
            N,
            M,
            K,
            GROUP=group_size,
            SPLIT=split or 1,
            EMULATE=_interpreted(),
            **opts,
            **b,
        )

    if blocks is None:
        # Ember's CUDA C++ kernel of the same layout and outputs (`ember.quant.cuda_int4`); for a row it rounds
        # to int8, only its block shapes, so that every pick computes the same sums.
        a8 = cuda and cuda_int4.rounds(M, split or 1, K)
        candidates = [] if a8 else list(WARPS)
        if cuda:
            shapes = cuda_int4.configs(group_size, K // group_size, split or 1, a8=a8)
            candidates += [{"CUDA": c} for c in shapes]
        blocks = tuning.pick(("int4_mma", M, N, K, group_size, split, a8), candidates, run, (words, sz))
    run(blocks, (words, sz))
    return out


def int4_mma_linear(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """y (M, N) in x's dtype: `int4_mma_gemv` over `row_splits` runs of K where N is small, the partial sums
    added by a second kernel (launched with PDL, like the GEMV)."""
    K, N = x.shape[1], words.shape[0]
    split = row_splits(N, K, group_size, x.device)
    if split == 1:
        return int4_mma_gemv(x, words, sz, group_size)
    return sum_splits(int4_mma_gemv(x, words, sz, group_size, split), x.dtype)


@triton.jit
def _int4_mma_dequant_kernel(
    w_ptr, sz_ptr, out_ptr, K: tl.constexpr, GROUP: tl.constexpr, STEPS: tl.constexpr
):
    # The weights of `_int4_mma_kernel` in out's dtype (N, K): program (tile, block) decodes STEPS consecutive
    # (tile, step) blocks of 128 words (STEPS x 512 contiguous bytes) into 16 rows of STEPS x 64 contiguous k.
    # Word 4 lane + m, nibble j = 4e + r + 2h is row 16 tile + lane // 4 + 8r at k = 64 step + 16 (lane % 4) +
    # 4m + 2h + e (`kernels.int4_mma_tile`); with lane = 4g + u // 4 and m = u % 4 that is k = 64 step + 4u + c
    # for c = 2h + e, so each row's 64 k of a step are the 16 words u of its g, 4 nibbles each, in order.
    tile, block = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, 8)[:, None, None]
    step = block * STEPS + tl.arange(0, STEPS)[None, :, None]
    u = tl.arange(0, 16)[None, None, :]
    words = tl.load(w_ptr + (tile.to(tl.int64) * (K // 64) + step) * 128 + 16 * g + u)  # (8, STEPS, 16)
    c = tl.arange(0, 4)
    shift = 16 * (c % 2) + 8 * (c // 2)  # nibble 4e + 2h at bit 16e + 8h; row half r adds 4r
    bits = tl.reshape(words[:, :, :, None] >> shift[None, None, None, :], (8, STEPS, 64))
    k = step * 64 + tl.arange(0, 64)[None, None, :]
    for r in tl.static_range(2):
        rows = tile * 16 + g + 8 * r  # (8, 1, 1)
        # one group a step: groups are whole steps (`kernels.int4_mma_fits`)
        s, mn = _factors(tl.load(sz_ptr + rows.to(tl.int64) * (K // GROUP) + step * 64 // GROUP))
        w = ((bits >> (4 * r)) & 0xF).to(tl.float32) * s + mn
        tl.store(out_ptr + rows.to(tl.int64) * K + k, w.to(out_ptr.dtype.element_ty))


# Steps of 64 k a dequantize program decodes: H200, Llama-3-8B's projections, 3.3-3.4 TB/s at 2-8 steps against
# 1.2-1.6 TB/s for one (its stores were 128-byte row pieces scattered per element); 4 the best or within 6%.
DEQUANT_STEPS = 4


def int4_mma_dequantize(
    words: torch.Tensor, sz: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weights (N, K) in `dtype` of `int4_mma_gemv`'s words and factors (prefill: one pass, then a matmul)."""
    N, K = words.shape[0], words.shape[1] * 8
    steps = math.gcd(DEQUANT_STEPS, K // 64)
    out = torch.empty(N, K, device=words.device, dtype=dtype)
    _int4_mma_dequant_kernel[(N // 16, K // 64 // steps)](
        words, sz, out, K, GROUP=group_size, STEPS=steps, num_warps=4
    )
    return out
