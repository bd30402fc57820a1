"""Quantized GEMMs for many activation rows (prefill, batches above a GEMV's 8): weights decoded tile by tile.

Above 8 rows a GEMV no longer pays (each row re-reads its weights' registers), and the old path decoded the
whole projection to bf16 in memory before torch's matmul: it wrote the bf16 weights and read them again,
three bf16 passes for one int8 one (Llama-3-8B int8 on an H200: a 128-token prefill took 27.7 ms, bf16's 8.0).
Here each program decodes a (BLOCK_N, BLOCK_K) tile of codes in registers and hands it to `tl.dot`, so the
weights are read once, as codes, and the decoding is paid once per BLOCK_M rows:

- int8 (per-channel scales): the codes become the activation dtype exactly (|q| <= 127), and the scale,
  constant along K, multiplies the float32 sum once.
- int4 in the tensor-core GEMV's fragment layout (`kernels.int4_mma_tile`): a tile is one K step of 64 and
  BLOCK_N / 16 row tiles. Lane (g, q)'s 4 words of a tile hold rows g and g + 8 at k = 16q + 4m + 2h + e
  (word m, bits 16e + 8h + 4r for row g + 8r), so reading the 16 words of (tile, g) in order and taking bits
  16e + 8h (+ 4 for row g + 8) gives rows g and g + 8 with their 64 k in order: the tile is decoded as two
  (BLOCK_N / 2, 64) operands, one per r, with their own accumulators. Each weight is q * s + min in float32
  rounded to the activation dtype, exactly the weights `int4_mma_dequantize` writes.

Results differ from dequantize + matmul only in the float32 summation order (and, for int8, in applying the
scale to the float32 sum rather than to a rounded product). Checked in Triton's interpreter on CPU
(tests/quant/test_quant_gemm.py) and on the GPU against float math (`benchmarks/gpu_gemm.py`).

Measured (H200, Llama-3-8B projections, against dequantize + cuBLAS; BENCHMARKS.md): int8 is 3.8-10.7x faster
at 16 rows, 2.0-5.2x at 128, 1.06-1.09x at 2048 (down: 0.91x), and `kernels.int8_linear` runs it from 9 to
`GEMM_MAX_ROWS` rows. The int4 kernel wins only where N gives enough programs (gate/up: 2.3x at 16 rows,
1.2x at 128) and loses elsewhere (qkv, o, down: 0.3-0.9x; 32-48 programs of 128 rows for 132
multiprocessors): it is not dispatched yet, int4 prefill still dequantizes (`kernels._mma_linear_launch`).

Shape legend: M rows of activations, K input features, N output features.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.quant.triton_kernels import _factors
from ember.quant.triton_mma import _interpreted, multiprocessors

DTYPES = (torch.bfloat16, torch.float16)  # tl.dot's operands: float32 would round through tf32


def blocks(M: int, N: int, multiprocessors: int) -> dict:
    """The int8 tile for M rows and N columns (H200, Llama-3-8B's qkv and gate/up, `benchmarks/gpu_gemm.py
    --sweep`: the best or within 5% of it at M = 16, 128 and 2048; o and down were not swept). BLOCK_M is the
    next power of two up to 128 (16 at least: the dot's); columns in tiles of 128 unless that leaves
    multiprocessors idle, then 64 with longer K steps."""
    block_m = min(128, max(16, triton.next_power_of_2(M)))
    block_n = 128 if triton.cdiv(M, block_m) * triton.cdiv(N, 128) >= multiprocessors else 64
    block_k = 128 if block_n == 64 or block_m <= 32 else 64
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": 4,
        "num_stages": 4 if M <= 128 else 3,
    }


@triton.jit
def _tile(M, BLOCK_M: tl.constexpr):
    # Programs sharing a weight tile run together (row blocks fastest): the tile is read from memory once and
    # then from L2, while the activations, far smaller than the weights, stay in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    return pid % grid_m, pid // grid_m


@triton.jit
def _round_bf16(x):
    # float32 -> float32 holding x rounded to bf16 (to nearest, ties to even; finite x): the interpreter's
    # stand-in for .to(tl.bfloat16).
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile(M, BLOCK_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    # Rows and columns past the ends read row M - 1 and N - 1's (in bounds, discarded at the store).
    x_ptrs = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * K + k[None, :]
    w_ptrs = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K + k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=k[None, :] < K - k0, other=0.0)
            w = tl.load(w_ptrs, mask=k[None, :] < K - k0, other=0)
        if EMULATE:  # the interpreter's bf16 dot and conversions are wrong; codes are exact in float32
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + tl.minimum(cols, N - 1)).to(tl.float32)
    y = acc * scale[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, config: dict | None = None):
    """x (M, K) bf16/fp16 contiguous, qweight int8 (N, K), scales (N,) -> (M, N) in x's dtype."""
    M, K = x.shape
    N = qweight.shape[0]
    if config is None:
        grid, kwargs = _int8_launch(M, N, K, multiprocessors(x.device))
    else:
        grid, kwargs = _int8_launch_of(M, N, K, config)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _int8_gemm_kernel[grid](x, qweight, scales, y, M, N, K, **kwargs)
    return y


def _int8_launch_of(M: int, N: int, K: int, b: dict) -> tuple[tuple[int], dict]:
    grid = (triton.cdiv(M, b["BLOCK_M"]) * triton.cdiv(N, b["BLOCK_N"]),)
    return grid, {**b, "EVEN_K": K % b["BLOCK_K"] == 0, "EMULATE": _interpreted()}


@functools.cache  # a prefill launches hundreds: its Python is most of a small GEMM's time
def _int8_launch(M: int, N: int, K: int, multiprocessors: int) -> tuple[tuple[int], dict]:
    return _int8_launch_of(M, N, K, blocks(M, N, multiprocessors))


@triton.jit
def _int4_mma_gemm_kernel(
    x_ptr, w_ptr, sz_ptr, y_ptr, M, N,
    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    # Computes y^T: the decoded weights are the dot's first operand, which Hopper's wgmma takes from
    # registers (the second comes from shared memory), so they are never stored to shared memory.
    pid_m, pid_n = _tile(M, BLOCK_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    R: tl.constexpr = BLOCK_N // 2
    # Operand row i is (tile, g) = (i // 8, i % 8): weight rows 16 tile + g (r = 0) and 16 tile + g + 8 (r = 1).
    i = tl.arange(0, R)
    tiles = pid_n * (BLOCK_N // 16) + i // 8
    tile = tl.minimum(tiles, N // 16 - 1)  # past the end: the last tile's rows, discarded at the store
    out0 = tile * 16 + i % 8
    u = tl.arange(0, 16)  # lane (g, q)'s words 4q + m, in order
    w_ptrs = w_ptr + tile.to(tl.int64)[:, None] * (K // 64) * 128 + (i % 8)[:, None] * 16 + u[None, :]
    c = tl.arange(0, 4)  # 2h + e of k = 16q + 4m + 2h + e: bits 16e + 8h of word 4q + m
    shift = 16 * (c % 2) + 8 * (c // 2)
    sz_ptrs = sz_ptr + out0.to(tl.int64) * (K // GROUP)
    k = tl.arange(0, 64)
    xt_ptrs = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[None, :] * K + k[:, None]  # x^T (64, BLOCK_M)
    acc0 = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    acc1 = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    for step in range(K // 64):
        xt = tl.load(xt_ptrs + step * 64)
        words = tl.load(w_ptrs + step * 128)  # (R, 16)
        bits = tl.reshape(words[:, :, None] >> shift[None, None, :], (R, 64))  # row g's k in order at bit 0
        group = step * 64 // GROUP
        s0, min0 = _factors(tl.load(sz_ptrs + group))
        s1, min1 = _factors(tl.load(sz_ptrs + 8 * (K // GROUP) + group))
        w0 = (bits & 0xF).to(tl.float32) * s0[:, None] + min0[:, None]
        w1 = ((bits >> 4) & 0xF).to(tl.float32) * s1[:, None] + min1[:, None]
        if EMULATE:
            acc0 = tl.dot(_round_bf16(w0), xt.to(tl.float32), acc0)
            acc1 = tl.dot(_round_bf16(w1), xt.to(tl.float32), acc1)
        else:
            acc0 = tl.dot(w0.to(xt.dtype), xt, acc0)
            acc1 = tl.dot(w1.to(xt.dtype), xt, acc1)
    ptrs = y_ptr + rows.to(tl.int64)[None, :] * N + out0[:, None]
    mask = (tiles < N // 16)[:, None] & (rows[None, :] < M)
    tl.store(ptrs, acc0.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + 8, acc1.to(y_ptr.dtype.element_ty), mask=mask)


def int4_tiles(M: int, N: int, multiprocessors: int) -> dict:
    """The int4 tile for M rows and N columns, as `blocks` picks int8's; 8 warps for 128 x 128 (with 4, sm90
    ptxas spills: 255 registers and 476 bytes of stack). Not yet tuned on a GPU (the kernel is not dispatched)."""
    b = blocks(M, N, multiprocessors)
    warps = 8 if b["BLOCK_M"] * b["BLOCK_N"] >= 128 * 128 else 4
    return {"BLOCK_M": b["BLOCK_M"], "BLOCK_N": b["BLOCK_N"], "num_warps": warps, "num_stages": 3}


def int4_mma_gemm(
    x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, config: dict | None = None
) -> torch.Tensor:
    """x (M, K) bf16/fp16 contiguous, `int4_mma_tile` words (N, K/8) and `int4_mma_scales` factors (N, K/g)
    -> (M, N) in x's dtype."""
    M, K = x.shape
    N = words.shape[0]
    b = config or int4_tiles(M, N, multiprocessors(x.device))
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, b["BLOCK_M"]) * triton.cdiv(N, b["BLOCK_N"]),)
    _int4_mma_gemm_kernel[grid](x, words, sz, y, M, N, K, GROUP=group_size, EMULATE=_interpreted(), **b)
    return y
