"""Matmul kernels for quantized weights, as torch.library custom ops with a plain-torch twin.

`ember::int8_linear(x, qweight, scales)` and `ember::int4_linear(x, qweight, scales, mins, group_size)` take
activations x (M, K) and the canonical weights of `ember.quant.linear`, and return y (M, N) in x's dtype.

- CUDA, M <= 8 (decode): Triton GEMV kernels that read each weight byte once and dequantize in registers.
  Decoding one stream is bound by reading weights, so int8 reads half the bytes of bf16 and int4 a quarter;
  torch's bf16 matmul with a separate dequantize would read the weights twice and write them once.
- CPU: `_weight_int8pack_mm` for int8 (bf16 activations: its float32 path is not vectorised).
- Anywhere else, and as the reference in tests: dequantize, then F.linear (`*_reference`).

The ops are opaque to torch.compile (fake impls give the shapes), so a compiled decode step, CUDA graph
included, calls the same kernels.

Shape legend: M rows of activations, K input features, N output features, g group size.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HAS_TRITON = importlib.util.find_spec("triton") is not None
GEMV_MAX_ROWS = 8  # above this many rows (prefill), dequantize + matmul wins over a GEMV kernel


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K), qweight int8 (N, K), scales (N,) -> (M, N): x @ (q * scale).T."""
    return (F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)).to(x.dtype)


def int4_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K), qweight uint8 (N, K/2) nibbles, scales and mins (N, K/g) -> (M, N): x @ (q * s + min).T."""
    N = qweight.shape[0]
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, -1, group_size)  # (N, K/g, g)
    w = codes.to(x.dtype) * scales[..., None].to(x.dtype) + mins[..., None].to(x.dtype)
    return F.linear(x, w.reshape(N, -1))


@torch.library.custom_op("ember::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return int8_linear_reference(x, qweight, scales)


@int8_linear.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@int8_linear.register_kernel("cpu")
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales.to(torch.bfloat16))
    return y.to(x.dtype)


@int8_linear.register_kernel("cuda")
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and x.shape[0] <= GEMV_MAX_ROWS:
        from ember.quant import triton_kernels

        return triton_kernels.int8_gemv(x.contiguous(), qweight, scales)
    return int8_linear_reference(x, qweight, scales)


@torch.library.custom_op("ember::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    return int4_linear_reference(x, qweight, scales, mins, group_size)


@int4_linear.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int):
    return x.new_empty(x.shape[0], qweight.shape[0])


@int4_linear.register_kernel("cuda")
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int):
    if HAS_TRITON and x.shape[0] <= GEMV_MAX_ROWS:
        from ember.quant import triton_kernels

        return triton_kernels.int4_gemv(x.contiguous(), qweight, scales, mins, group_size)
    return int4_linear_reference(x, qweight, scales, mins, group_size)
