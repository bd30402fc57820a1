"""Triton GEMV kernels for decode (few activation rows) over bf16/fp16, int8 and int4 weights.

Decoding one stream reads every weight once per token, so these kernels are judged by one number: bytes of
weights per second against the memory's limit. Each program owns BLOCK_N output features of one activation
row and walks K in BLOCK_K steps, keeping a (BLOCK_N, BLOCK_K) float32 accumulator in registers that is
reduced once at the end. What keeps them near the limit on an H100/H200-class GPU:

- Weight rows are read with full-width vector loads and no per-element masks: rows past N are clamped to
  row 0 (their results are never stored) and K is masked only when BLOCK_K does not divide it.
- Integer codes become floats without the int-to-float conversion instruction, which runs at a quarter of
  the FMA rate and would cap an int8 GEMV below the bandwidth limit. The code is written into the mantissa
  of a float with a fixed exponent instead: for int8, bits(2^23) + 128 + q is the float 2^23 + 128 + q, so
  one byte permute (`prmt`, on a GPU) and one float subtract give q exactly. For int4 in the tiled layout
  (`ember.quant.kernels.int4_tile`, the CUDA path) the masked nibble, left where it lies in its word, is
  read as the subnormal float q * 2^(P - 149); with x scaled by a power of two, a thread sums q * x over its
  8 weights of a group with FMAs and applies the group's scale and min once (`_int4_tiled_gemv_kernel`):
  one AND and one FMA per weight. In the canonical layout the nibble placed in the top mantissa bits of 1.0
  gives 1 + q/16, with scales folded by `ember.quant.kernels.int4_fold_scales`.
- Activations are loaded in the weight tile's shape, every row the same x (served from L1), so each thread
  gets the x values of the weights it holds; a vector of x broadcast over the rows cost a trip through
  shared memory and two barriers per loop step (seen in the SASS; int8 gate/up 33.4 -> 30.3 us).
- With several rows of activations (batched decoding), the programs that read one block of weights for
  different rows are consecutive in the grid (`_row_and_features`), so rows after the first mostly find
  those weights in L2 instead of reading them from memory again.
- Launched with programmatic dependent launch on Hopper (`ember.ops.launch`): a program loads its first
  weight tile before waiting for the kernel before it to finish.

The tiles are picked per shape on a device's first call (`ember.quant.tuning`: timed in a CUDA graph over
weights streamed from memory, as decoding reads them), which the compiled step's warm-up makes before any
CUDA graph is captured. `benchmarks/gpu_gemv.py` sweeps them on a device and compares with cuBLAS.
Tested against `ember.quant.kernels.*_reference`, also on CPU through Triton's interpreter.

Shape legend: M rows of activations, K input features, N output features, g group size.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ember.ops.launch import launch_options
from ember.quant import cuda_gemv, tuning
from ember.quant.kernels import TILED_X_EXP

X_EXP = tl.constexpr(TILED_X_EXP)


def int8_magic() -> int:
    """How the int8 GEMV turns codes into floats (`_int8_to_float`): byte permutes on a GPU, arithmetic in
    Triton's interpreter (which runs no PTX)."""
    return 1 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 2


def _blocks(entries: list[tuple[int, int, int]], **flags) -> list[dict]:
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 1, **flags} for bn, bk, w in entries]


# The GEMV's candidate tiles, (BLOCK_N, BLOCK_K, warps) (BLOCK_K counts weights), timed on a device's first
# call of each shape (`ember.quant.tuning`): those within a few percent of the best for some Llama-3-8B shape
# in `benchmarks/gpu_gemv.py` on an H200, each with one float accumulator per weight and with one per 8
# weights (ACC8, fewer registers: more programs in flight). The first is what a call that cannot time
# (during a CUDA graph capture) takes. Small BLOCK_N keeps enough programs in flight to fill 132
# multiprocessors when N = 4096.
FLOAT_BLOCKS = _blocks([(1, 2048, 8), (2, 2048, 8), (1, 2048, 4), (2, 1024, 4), (4, 512, 4)]) + _blocks(
    [(1, 2048, 8), (2, 2048, 8), (4, 1024, 4)], ACC8=True
)
INT8_BLOCKS = _blocks(
    [(4, 2048, 4), (4, 1024, 4), (8, 1024, 8), (8, 512, 8), (4, 512, 4), (16, 512, 8)]
) + _blocks([(4, 2048, 4), (4, 1024, 4), (8, 1024, 8), (4, 512, 4), (8, 512, 8), (16, 512, 8)], ACC8=True)
INT4_BLOCKS = _blocks(
    [(2, 1024, 4), (4, 512, 4), (8, 256, 4), (16, 256, 4), (16, 512, 4)]
)  # canonical layout


@triton.jit
def _row_and_features(M, BLOCK_N: tl.constexpr):
    # Program p of a GEMV grid serves activation row p % M and output features (p // M) * BLOCK_N onwards: the
    # M programs that read one block of weights run one after another, so rows after the first find those
    # weights in L2 (batched decoding reads them from memory about once, not M times).
    pid = tl.program_id(0)
    return pid % M, (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _gemv_weights(
    w_ptrs,
    k0,
    rk,
    K: tl.constexpr,
    UP: tl.constexpr,
    EVEN_K: tl.constexpr,
    GLU: tl.constexpr,
    EVICT: tl.constexpr,
):
    # One step's weight tile, and with GLU the up rows' tile UP elements further (else w again, unused).
    # EVICT: the loads' L2 eviction policy (see _gemv_kernel).
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy=EVICT)
        wu = tl.load(w_ptrs + UP, eviction_policy=EVICT) if GLU else w
    else:
        k_ok = (k0 + rk < K)[None, :]
        w = tl.load(w_ptrs, mask=k_ok, other=0, eviction_policy=EVICT)
        wu = tl.load(w_ptrs + UP, mask=k_ok, other=0, eviction_policy=EVICT) if GLU else w
    return w, wu


@triton.jit
def _gemv_step(
    acc,
    acc_up,
    w,
    wu,
    x_ptrs,
    k0,
    rk,
    K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INT8: tl.constexpr,
    MAGIC: tl.constexpr,
    GLU: tl.constexpr,
    ACC8: tl.constexpr,
):
    # acc (+)= w * x over one step (and acc_up with the up rows' tile). x_ptrs has the tile's shape (every row
    # the same activations): loaded so, x lands in the registers of the weights it multiplies; a vector of x
    # broadcast over rows took a trip through shared memory and two barriers per step.
    # ACC8: acc holds one sum per 8 consecutive weights of a row (a thread's own: 8 FMAs in a chain, see
    # _dot_last8), an eighth of the registers of one float per weight.
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=(k0 + rk < K)[None, :], other=0.0)
    xf = x.to(tl.float32)
    shape: tl.constexpr = [w.shape[0], w.shape[1] // 8, 8]  # ACC8's view of a tile
    if INT8:
        wf = _int8_to_float(w, MAGIC)
    else:
        wf = w.to(tl.float32)
    if ACC8:
        x8 = tl.reshape(xf, shape)
        acc = _dot_last8(tl.reshape(wf, shape), x8, acc)
    else:
        acc += wf * xf
    if GLU:
        if INT8:
            wuf = _int8_to_float(wu, MAGIC)
        else:
            wuf = wu.to(tl.float32)
        if ACC8:
            acc_up = _dot_last8(tl.reshape(wuf, shape), x8, acc_up)
        else:
            acc_up += wuf * xf
    return acc, acc_up


@triton.jit
def _int8_to_float(w, MAGIC: tl.constexpr):
    # int8 codes -> exact float32 values, without the int-to-float conversion instruction.
    if MAGIC == 2:
        # Four codes per 32-bit register: flip each sign bit (q + 128 as an unsigned byte), then one byte
        # permute per code builds the float 2^23 + 128 + q (exponent bytes from 0x4B000000), and one subtract
        # gives q.
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7650;
            prmt.b32 $1, t, 0x4B000000, 0x7651;
            prmt.b32 $2, t, 0x4B000000, 0x7652;
            prmt.b32 $3, t, 0x4B000000, 0x7653;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }""",
            "=r,=r,=r,=r,r",
            [w],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    elif MAGIC == 1:
        # bits(2^23) + 128 + q read as a float is 2^23 + 128 + q, exactly (q in [-128, 127]).
        return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    M,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INT8: tl.constexpr,
    MAGIC: tl.constexpr,
    GLU: tl.constexpr = False,
    PDL: tl.constexpr = False,
    ACC8: tl.constexpr = False,
    EVICT: tl.constexpr = "",
):
    # Float weights (INT8=False, s_ptr unused), or int8 codes with one scale per row (INT8=True; MAGIC picks
    # how codes become floats, see _int8_to_float).
    # GLU: the weight is gate rows [0, N) over up rows [N, 2N) (a fused gate/up projection); each program
    # also reads the up rows of its gate rows and stores silu(gate) * up, so y has N columns.
    # PDL (`ember.ops.launch`): the first weight tile is loaded before waiting for the kernel before.
    # EVICT="evict_first" (one activation row): each weight is read once a step, so its lines are the first to
    # leave L2, which keeps the step's KV cache there (see `ember.ops.triton_attention`'s prefetch).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m, rn = _row_and_features(M, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # rows past N read row 0 and are not stored
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + m * K + (rows * 0)[:, None] + rk[None, :]  # (BLOCK_N, BLOCK_K): see _gemv_step
    # The first step is peeled: its weights need nothing from the kernel before, its activations do.
    w, wu = _gemv_weights(w_ptrs, 0, rk, K, N * K, EVEN_K, GLU, EVICT)
    if ACC8:
        # Zeros in the layout the weights' load gave (tl.zeros picks one of its own, and the FMAs converted
        # between the two through shared memory).
        acc = tl.sum(tl.reshape(w, (BLOCK_N, BLOCK_K // 8, 8)).to(tl.float32), axis=2) * 0.0
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = acc
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc, acc_up = _gemv_step(acc, acc_up, w, wu, x_ptrs, 0, rk, K, EVEN_K, INT8, MAGIC, GLU, ACC8)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w, wu = _gemv_weights(w_ptrs, k0, rk, K, N * K, EVEN_K, GLU, EVICT)
        acc, acc_up = _gemv_step(acc, acc_up, w, wu, x_ptrs, k0, rk, K, EVEN_K, INT8, MAGIC, GLU, ACC8)
    out = tl.sum(acc, axis=1)
    if INT8:
        out = out * tl.load(s_ptr + rows).to(tl.float32)
    if GLU:
        up = tl.sum(acc_up, axis=1)
        if INT8:
            up = up * tl.load(s_ptr + N + rows).to(tl.float32)
        # Rounded where the unfused ops round: the projection's output, silu's, and the product.
        dt = y_ptr.dtype.element_ty
        gate = out.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        out = act * up.to(dt).to(tl.float32)
    tl.store(y_ptr + m * N + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    M,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # w: uint8 (N, K/2), low nibble = even k; s, z: (N, K/g) folded as 16 * scale and min - 16 * scale.
    m, rn = _row_and_features(M, BLOCK_N)
    BB: tl.constexpr = BLOCK_K // 2  # bytes per row per step
    NG: tl.constexpr = BLOCK_K // GROUP  # groups per row per step
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # rows past N read row 0 and are not stored
    rb = tl.arange(0, BB)
    rg = tl.arange(0, NG)
    rk = tl.arange(0, BLOCK_K)
    KB = K // 2
    G = K // GROUP
    w_ptrs = w_ptr + rows[:, None] * KB + rb[None, :]
    s_ptrs = s_ptr + rows[:, None] * G + rg[None, :]
    z_ptrs = z_ptr + rows[:, None] * G + rg[None, :]
    x_ptrs = x_ptr + m * K + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            b = tl.load(w_ptrs)
            s = tl.load(s_ptrs)
            z = tl.load(z_ptrs)
            x = tl.load(x_ptrs)
        else:
            b_ok = k0 // 2 + rb < KB
            g_ok = k0 // GROUP + rg < G
            b = tl.load(w_ptrs, mask=b_ok[None, :], other=0)
            s = tl.load(s_ptrs, mask=g_ok[None, :], other=0.0)
            z = tl.load(z_ptrs, mask=g_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k0 + rk < K, other=0.0)
        b = b.to(tl.int32)
        # Each nibble into mantissa bits 19-22 of 1.0: the float 1 + q/16.
        lo = ((b << 19) & 0x780000) | 0x3F800000
        hi = ((b << 15) & 0x780000) | 0x3F800000
        f = tl.join(lo, hi).reshape(BLOCK_N, NG, GROUP).to(tl.float32, bitcast=True)
        w = f * s.to(tl.float32)[:, :, None] + z.to(tl.float32)[:, :, None]
        acc += w.reshape(BLOCK_N, BLOCK_K) * x.to(tl.float32)[None, :]
        w_ptrs += BB
        s_ptrs += NG
        z_ptrs += NG
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * N + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _tiled_nibble(words, j: tl.constexpr):
    # Nibble j of each word read as the float q * 2^(P - 149), P its bit (`kernels.TILED_NIBBLE_BITS`), and
    # 2^(X_EXP - P), the factor for the activations it multiplies. Masked where it lies, a nibble at bits
    # P..P+3 with P + 3 <= 23 reads as that number: bits below 2^23 are the subnormal floats, and from 2^23
    # the first binade of normal floats continues the same step (2^-149). The top two nibbles are shifted
    # right by 8 first (one shift per word) to bits 16 and 20.
    if j <= 5:
        bits = words & (0xF << (4 * j))
        xs = 2.0 ** (X_EXP - 4 * j)
    elif j == 6:
        bits = (words >> 8) & 0xF0000
        xs = 2.0 ** (X_EXP - 16)
    else:
        bits = (words >> 8) & 0xF00000
        xs = 2.0 ** (X_EXP - 20)
    return bits.to(tl.float32, bitcast=True), xs


@triton.jit
def _factors(sz):
    # Words of two bf16 (`kernels.bf16_pair`) -> (high, low) as float32 (bf16 -> float32 is a move to the high
    # half): a group's packed factors, s * 2^(149 - X_EXP) and min * 2^(P - X_EXP) for the tiled layout
    # (`kernels.int4_subnormal_scales`), s and min for the mma layout (`kernels.int4_mma_scales`).
    return (sz & -65536).to(tl.float32, bitcast=True), (sz << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dot_last8(a, b, acc=None):
    # sum(a * b) over the last axis, of size 8 and held by one thread (the words' layout), plus acc if given:
    # one multiply and seven FMAs (eight FMAs onto acc); tl.sum would multiply and add separately.
    shape: tl.constexpr = a.shape[:-1]
    a0, a1 = tl.split(tl.reshape(a, shape + [4, 2]))
    b0, b1 = tl.split(tl.reshape(b, shape + [4, 2]))
    a00, a01 = tl.split(tl.reshape(a0, shape + [2, 2]))
    a10, a11 = tl.split(tl.reshape(a1, shape + [2, 2]))
    b00, b01 = tl.split(tl.reshape(b0, shape + [2, 2]))
    b10, b11 = tl.split(tl.reshape(b1, shape + [2, 2]))
    u, v = tl.split(a00)
    x, y = tl.split(b00)
    if acc is None:
        acc = tl.fma(v, y, u * x)
    else:
        acc = tl.fma(v, y, tl.fma(u, x, acc))
    u, v = tl.split(a01)
    x, y = tl.split(b01)
    acc = tl.fma(v, y, tl.fma(u, x, acc))
    u, v = tl.split(a10)
    x, y = tl.split(b10)
    acc = tl.fma(v, y, tl.fma(u, x, acc))
    u, v = tl.split(a11)
    x, y = tl.split(b11)
    return tl.fma(v, y, tl.fma(u, x, acc))


@triton.jit
def _int4_tiled_gemv_kernel(
    x_ptr,
    w_ptr,
    sz_ptr,
    y_ptr,
    N,
    M,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    # Grid (row blocks * M, 1, SPLIT) (`_row_and_features`). SPLIT > 1: program (p, 0, s) reads the s-th of
    # SPLIT equal runs of tiles and stores float32 partial sums in y (SPLIT, M, N) for `_sum_splits_kernel`.
    # w: int32 (N, K/8) in the tiled layout of `kernels.int4_tile` (nibble j of word i of tile t: weight
    # k = 8g*t + g*j + i, so nibble j of a tile's g words is group 8t + j). sz: int32 (N, K/g) from
    # `kernels.int4_subnormal_scales`: s * 2^(149 - X_EXP) and min * 2^(P_j - X_EXP) as two bf16 (one load).
    # A code is never moved into a mantissa: masked where it lies, its bits read as a float are
    # q * 2^(P_j - 149) (`_tiled_nibble`). With x scaled by 2^(X_EXP - P_j) (once per element, shared by the
    # thread's rows), a thread's 8 consecutive words of a row give, per nibble, 2^(X_EXP - 149) sum(q x) over
    # 8 weights of one group in 1 multiply + 7 FMAs; then acc += that * s + min * sum(x): per weight one AND
    # and one FMA (an eighth of a shift; the factors, the x scaling and sum(x) are per 8 weights or fewer).
    # Exact up to float32 rounding of the sums; needs FMAs that keep subnormal inputs (Triton emits
    # fma.rn.f32, not .ftz; `benchmarks/gpu_gemv.py --check` runs it on the GPU), |x| < 2^48, and loses
    # precision only where |q x| < 2^-56. The previous form (two FMAs per weight: the weight, then w * x)
    # counted 5.3 instructions per weight in the sm90 SASS (Triton 3.6), this one 4.7 at 4 rows per thread
    # and 4.0 at 8.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m, rn = _row_and_features(M, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # rows past N read row 0 and are not stored
    C: tl.constexpr = 8  # consecutive words per thread and row (32 bytes: the layout Triton gives the load)
    ri = tl.arange(0, GROUP)
    KW: tl.constexpr = K // 8
    G: tl.constexpr = K // GROUP
    w_ptrs = w_ptr + rows[:, None] * KW + ri[None, :]
    # x in the tile's shape (every row the same activations): loaded so, x lands in the registers of the
    # words it multiplies, and the compiler loads and scales it once per thread for all of its rows.
    x_ptrs = x_ptr + m * K + (rows * 0)[:, None] + ri[None, :]
    sz_ptrs = sz_ptr + rows * G
    acc = tl.zeros((BLOCK_N, GROUP // C), dtype=tl.float32)
    T: tl.constexpr = K // (8 * GROUP) // SPLIT  # tiles per program (SPLIT divides the row's tiles)
    t0 = tl.program_id(2) * T
    w_ptrs += t0 * GROUP
    x_ptrs += t0 * 8 * GROUP
    sz_ptrs += t0 * 8
    words = tl.load(w_ptrs)  # (BLOCK_N, g) int32, the first tile
    if PDL:
        tl.extra.cuda.gdc_wait()
    for t in range(0, T):
        # The next tile's words are in flight while this one is unpacked (none after the last).
        nxt = tl.load(w_ptrs + GROUP, mask=(ri[None, :] * 0 + t + 1) < T, other=0)
        for j in tl.static_range(8):
            bits, xs = _tiled_nibble(words, j)
            xj = tl.load(x_ptrs + j * GROUP).to(tl.float32) * xs
            xj = tl.reshape(xj, (BLOCK_N, GROUP // C, C))
            part = _dot_last8(tl.reshape(bits, (BLOCK_N, GROUP // C, C)), xj)
            s, z = _factors(tl.load(sz_ptrs + j))
            acc += part * s[:, None] + z[:, None] * tl.sum(xj, axis=2)
        words = nxt
        w_ptrs += GROUP
        x_ptrs += 8 * GROUP
        sz_ptrs += 8
    out = tl.sum(acc, axis=1)
    y_ptr += tl.program_id(2) * M * N
    tl.store(y_ptr + m * N + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _sum_splits_kernel(
    part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    # y (M, N) = the sum over s of part (SPLIT, M, N), float32, in y's dtype.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    acc = tl.load(part_ptr + r, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + r, mask=ok, other=0.0)
    tl.store(y_ptr + r, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_partials_kernel(
    part_ptr,
    y_ptr,
    MI,
    INTER,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # y (M, INTER) = silu(gate) * up, gate and up the halves of the rows of the sum over s of part
    # (SPLIT, M, 2 INTER), each sum rounded to y's dtype first, silu rounded before the product (as the plain
    # ops round).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MI
    g_ptrs = part_ptr + (r // INTER) * (2 * INTER) + r % INTER
    gate = tl.load(g_ptrs, mask=ok, other=0.0)
    up = tl.load(g_ptrs + INTER, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        gate += tl.load(g_ptrs + s * 2 * MI, mask=ok, other=0.0)
        up += tl.load(g_ptrs + s * 2 * MI + INTER, mask=ok, other=0.0)
    dt = y_ptr.dtype.element_ty
    g = gate.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + r, (act * up.to(dt).to(tl.float32)).to(dt), mask=ok)


def silu_mul_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts (S, M, 2I) float32, contiguous -> silu(gate) * up (M, I) in `dtype` (`kernels.silu_mul_partials`)."""
    S, M, N = parts.shape
    y = torch.empty(M, N // 2, device=parts.device, dtype=dtype)
    BLOCK = 1024
    _silu_mul_partials_kernel[(triton.cdiv(y.numel(), BLOCK),)](
        parts, y, y.numel(), N // 2, SPLIT=S, BLOCK=BLOCK, **launch_options(parts.device)
    )
    return y


TILED_PROGRAMS = 2048  # a split stops where it would launch more programs than this (`tiled_split`)
# The split launches' tile: the best for Llama-3-8B's o and down on an H200, 9.1 vs 8.3 us for its qkv.
TILED_SPLIT_BLOCKS = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@functools.cache
def tiled_split(N: int, K: int, group_size: int, block_n: int, rows: int = 1) -> int:
    """How many runs of tiles the tiled int4 GEMV cuts each row's K into: the largest divisor of the row's
    tiles that keeps the programs at most TILED_PROGRAMS. A program walks its tiles one after another, and
    where N is small (4096 outputs: 256 programs of 16 rows for 132 multiprocessors) too few warps are in
    flight to hide the latency of each tile; a split adds a pass that sums float32 partials."""
    tiles, blocks = K // (8 * group_size), triton.cdiv(N, block_n) * rows
    return max(d for d in range(1, tiles + 1) if tiles % d == 0 and (d == 1 or blocks * d <= TILED_PROGRAMS))


TILED_BLOCKS = [  # (BLOCK_N, warps): the best few per Llama-3-8B shape in benchmarks/gpu_gemv.py on an H200
    {"BLOCK_N": bn, "num_warps": w, "num_stages": 1} for bn, w in [(16, 4), (16, 2), (32, 4), (64, 8)]
]


def float_gemv(x: torch.Tensor, weight: torch.Tensor, blocks: dict | None = None) -> torch.Tensor:
    """x (M, K) contiguous, weight (N, K) -> (M, N) in x's dtype."""
    return fused_gemv(x, weight, blocks=blocks)


def int8_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, blocks: dict | None = None
) -> torch.Tensor:
    """x (M, K) contiguous, qweight int8 (N, K), scales (N,) -> (M, N) in x's dtype."""
    return fused_gemv(x, qweight, scales, blocks=blocks)


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    glu: bool = False,
    blocks: dict | None = None,
    resid: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """x (M, K) contiguous @ weight (N, K).T: float weights, or int8 codes with per-row `scales` (N,).

    glu: the weight is a fused gate/up projection (gate rows over up rows) and the result is
    silu(gate) * up, (M, N/2). In x's dtype. resid, norm: the CUDA C++ kernel's folds (`cuda_gemv.gemv`;
    int8 codes only, on operands `cuda_gemv.fits` takes).
    """
    (M, K), N = x.shape, weight.shape[0] // (2 if glu else 1)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    int8 = scales is not None
    # One row reads each weight once; more rows read a block one program after another (_row_and_features).
    consts = {"INT8": int8, "GLU": glu, "EVICT": "evict_first" if M == 1 else "", **launch_options(x.device)}
    if blocks is None or "MAGIC" not in blocks:
        consts["MAGIC"] = int8_magic() if int8 else 0
    grid = lambda b: (triton.cdiv(N, b["BLOCK_N"]) * M,)  # noqa: E731

    cuda = int8 and cuda_gemv.fits(x, weight, scales)
    fold = "resid" if resid is not None else "norm" if norm is not None else ""
    if fold and not cuda:
        raise ValueError("the residual and norm folds run on the CUDA C++ int8 GEMV only")

    def run(b: dict, w: tuple[torch.Tensor, ...]) -> None:
        if "CUDA" in b:
            if cuda:
                cuda_gemv.gemv(x, w[0], w[-1], y, b["CUDA"], glu, consts["PDL"], resid, norm)
                return
            b = INT8_BLOCKS[0]
        if fold:
            raise ValueError(f"the {fold} fold runs on the CUDA C++ int8 GEMV's block shapes, not {b}")
        _gemv_kernel[grid(b)](x, w[0], w[-1], y, N, M, K, **{"EVEN_K": K % b["BLOCK_K"] == 0, **consts, **b})

    if blocks is None:
        configs = [] if fold else INT8_BLOCKS if int8 else FLOAT_BLOCKS
        if cuda:
            configs = configs + [{"CUDA": c} for c in (cuda_gemv.GLU_CONFIGS if glu else cuda_gemv.CONFIGS)]
        key = ("gemv", int8, glu, M, N, K, weight.dtype, x.dtype, fold)
        blocks = tuning.pick(key, configs, run, (weight, scales) if int8 else (weight,))
    run(blocks, (weight, scales) if int8 else (weight,))
    return y


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    s16: torch.Tensor,
    z16: torch.Tensor,
    group_size: int,
    blocks: dict | None = None,
) -> torch.Tensor:
    """x (M, K) contiguous, qweight uint8 (N, K/2), folded scales (N, K/g) (`kernels.int4_fold_scales`) -> (M, N)."""
    (M, K), N = x.shape, qweight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)

    def run(b: dict, w: tuple[torch.Tensor, ...]) -> None:
        grid = (triton.cdiv(N, b["BLOCK_N"]) * M,)
        _int4_gemv_kernel[grid](x, *w, y, N, M, K, GROUP=group_size, **{"EVEN_K": K % b["BLOCK_K"] == 0, **b})

    if blocks is None:  # a tile holds whole groups
        fits = [b for b in INT4_BLOCKS if b["BLOCK_K"] % group_size == 0]
        fits = fits or _blocks([(4, group_size, 4)])
        blocks = tuning.pick(("int4", M, N, K, group_size, x.dtype), fits, run, (qweight, s16, z16))
    run(blocks, (qweight, s16, z16))
    return y


@triton.jit
def _int4_tiled_dequant_kernel(
    w_ptr, sz_ptr, out_ptr, N, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr
):
    # The weights of `_int4_tiled_gemv_kernel` in out's dtype (N, K): program (row block, tile).
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    ri = tl.arange(0, GROUP)
    G: tl.constexpr = K // GROUP
    words = tl.load(w_ptr + rows[:, None] * (K // 8) + t * GROUP + ri[None, :])
    out_ptrs = out_ptr + rows[:, None] * K + t * 8 * GROUP + ri[None, :]
    ok = (rn < N)[:, None]
    for j in tl.static_range(8):
        bits, xs = _tiled_nibble(words, j)
        s, z = _factors(tl.load(sz_ptr + rows * G + t * 8 + j))
        w = bits * s[:, None] + z[:, None]  # w * 2^(P - X_EXP), exactly: one rounding, after an exact product
        tl.store(out_ptrs + j * GROUP, (w * xs).to(out_ptr.dtype.element_ty), mask=ok)


def int4_tiled_dequantize(
    words: torch.Tensor, sz: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weights (N, K) in `dtype` of the tiled codes and factors that `int4_tiled_gemv` takes (prefill: one
    pass over the codes, then torch's matmul)."""
    N, K = words.shape[0], words.shape[1] * 8
    out = torch.empty(N, K, device=words.device, dtype=dtype)
    BLOCK_N = 16
    _int4_tiled_dequant_kernel[(triton.cdiv(N, BLOCK_N), K // (8 * group_size))](
        words, sz, out, N, K, GROUP=group_size, BLOCK_N=BLOCK_N, num_warps=4
    )
    return out


def int4_tiled_gemv(
    x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, blocks: dict | None = None
) -> torch.Tensor:
    """x (M, K) contiguous, words int32 (N, K/8) from `kernels.int4_tile`, sz int32 (N, K/g) from
    `kernels.int4_subnormal_scales` -> (M, N).

    Where N gives few programs, K is split (`tiled_split`) and a second kernel adds the partial sums; those
    launches take fixed tiles (TILED_SPLIT_BLOCKS) instead of picked ones (`ember.quant.tuning`). `blocks`
    (tile, warps and SPLIT, for benchmarks) fixes them all."""
    M, K = x.shape
    N = words.shape[0]
    if blocks is None:
        split = tiled_split(N, K, group_size, TILED_SPLIT_BLOCKS["BLOCK_N"], M)
        blocks = {**TILED_SPLIT_BLOCKS, "SPLIT": split} if split > 1 else None
    if blocks is None or blocks.get("SPLIT", 1) == 1:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
        opts = launch_options(x.device)

        def run(b: dict, w: tuple[torch.Tensor, ...]) -> None:
            grid = (triton.cdiv(N, b["BLOCK_N"]) * M, 1, 1)
            _int4_tiled_gemv_kernel[grid](x, w[0], w[1], y, N, M, K, GROUP=group_size, **{**opts, **b})

        if blocks is None:
            key = ("int4_tiled", M, N, K, group_size, x.dtype)
            blocks = tuning.pick(key, TILED_BLOCKS, run, (words, sz))
        run(blocks, (words, sz))
        return y
    return sum_splits(int4_tiled_partials(x, words, sz, group_size, blocks["SPLIT"], blocks), x.dtype)


def sum_splits(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 partial sums (S, M, N) of a split GEMV -> their sum (M, N) in `dtype`, added in order
    (`_sum_splits_kernel`, launched with PDL where the GEMVs are)."""
    S, M, N = part.shape
    y = torch.empty(M, N, device=part.device, dtype=dtype)
    BLOCK = 1024
    _sum_splits_kernel[(triton.cdiv(M * N, BLOCK),)](
        part, y, M * N, SPLIT=S, BLOCK=BLOCK, **launch_options(part.device)
    )
    return y


def int4_tiled_partials(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    split: int,
    blocks: dict | None = None,
) -> torch.Tensor:
    """The tiled GEMV over `split` equal runs of each row's tiles, without adding them: float32 (split, M, N),
    summed over the first axis by `_sum_splits_kernel` or by the consumer (`kernels.SplitSum`)."""
    M, K = x.shape
    N = words.shape[0]
    if (K // (8 * group_size)) % split:
        raise ValueError(f"SPLIT={split} does not divide the {K // (8 * group_size)} tiles of a row")
    blocks = {**TILED_SPLIT_BLOCKS, **(blocks or {}), "SPLIT": split}
    part = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, blocks["BLOCK_N"]) * M, 1, split)
    _int4_tiled_gemv_kernel[grid](
        x, words, sz, part, N, M, K, GROUP=group_size, **launch_options(x.device), **blocks
    )
    return part
