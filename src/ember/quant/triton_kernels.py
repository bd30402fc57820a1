"""Triton GEMV kernels for decode (few activation rows) over int8 and int4 weights; imported only with Triton.

Each program owns BLOCK_N output features of one activation row and walks K, loading a (BLOCK_N, BLOCK_K)
tile of weight bytes per iteration, dequantizing in registers and accumulating in float32. Small BLOCK_N
keeps enough programs in flight to fill the GPU for N = 4096 (a 128-wide block would give 32 programs for
132 multiprocessors). The tile sizes are autotuned per (N, K) on the first call, which the compiled step's
warm-up makes before any CUDA graph is captured. Tested against `ember.quant.kernels.*_reference`, also on
CPU through Triton's interpreter (TRITON_INTERPRET=1).

Shape legend: M rows of activations, K input features, N output features, g group size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (8, 512, 4, 3),
        (16, 256, 4, 3),
        (16, 512, 4, 3),
        (32, 256, 4, 3),
        (32, 256, 8, 3),
        (64, 128, 4, 4),
    ]
]


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_n, m = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + m * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += w.to(tl.float32) * x[None, :]
    scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = tl.sum(acc, axis=1) * scale
    tl.store(y_ptr + m * N + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # BLOCK_K counts bytes of packed weights (2 weights each); a byte's two nibbles share one group.
    pid_n, m = tl.program_id(0), tl.program_id(1)
    KB: tl.constexpr = K // 2
    G: tl.constexpr = K // GROUP
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for b0 in range(0, KB, BLOCK_K):
        bb = b0 + rb
        b_ok = bb < KB
        tile_ok = n_ok[:, None] & b_ok[None, :]
        packed = tl.load(w_ptr + rn[:, None] * KB + bb[None, :], mask=tile_ok, other=0)
        lo = (packed & 0xF).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
        g = (2 * bb) // GROUP
        s = tl.load(s_ptr + rn[:, None] * G + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[:, None] * G + g[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        xe = tl.load(x_ptr + m * K + 2 * bb, mask=b_ok, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * K + 2 * bb + 1, mask=b_ok, other=0.0).to(tl.float32)
        acc += (lo * s + z) * xe[None, :] + (hi * s + z) * xo[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * N + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def _launch(kernel, blocks: dict | None, N: int, M: int, *args, **kwargs) -> None:
    """Runs the autotuned kernel, or with fixed `blocks` the plain one (Triton's interpreter cannot autotune)."""
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), M)  # noqa: E731
    if blocks is None:
        kernel[grid](*args, **kwargs)
    else:
        kernel.fn[grid](*args, **kwargs, **blocks)


def int8_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, blocks: dict | None = None
) -> torch.Tensor:
    """x (M, K) contiguous, qweight int8 (N, K), scales (N,) -> (M, N) in x's dtype."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _launch(_int8_gemv_kernel, blocks, N, M, x, qweight, scales, y, N, K)
    return y


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    blocks: dict | None = None,
) -> torch.Tensor:
    """x (M, K) contiguous, qweight uint8 (N, K/2), scales and mins (N, K/g) -> (M, N) in x's dtype."""
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _launch(_int4_gemv_kernel, blocks, N, M, x, qweight, scales, mins, y, N, K, GROUP=group_size)
    return y
