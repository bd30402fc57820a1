"""Matmul kernels for quantized weights, as torch.library custom ops with a plain-torch twin.

`ember::int8_linear(x, qweight, scales)`, `ember::int4_linear(x, qweight, s16, z16, group_size)` and
`ember::int4_tiled_linear(x, words, sz, group_size)` take activations x (M, K) and the weights of
`ember.quant.linear` (int4 scales folded by `int4_fold_scales`, or codes in the tiled layout of `int4_tile`
with factors from `int4_subnormal_scales`), and return y (M, N) in x's dtype.

- `ember::float_linear(x, weight)`: bf16/fp16 weights, one row on CUDA (used by `ember.ops.linear.Linear`).
- `ember::int4_tiled_partials(x, words, sz, group_size, splits)`: the tiled int4 GEMV's float32 partial sums
  over `splits` runs of K, left for the consumer to add (`SplitSum`).
- `ember::silu_gate_up(x, weight, scales)`: a fused gate/up projection and SwiGLU's silu(gate) * up in one
  GEMV (float or int8 weights; decode on CUDA, chosen by `ember.ops.linear.silu_gate_up`).
- `ember::silu_mul_partials(parts, dtype)`: silu(gate) * up of a split gate/up GEMV's float32 partials
  (int4), summing them as it loads them.
- CUDA, M <= 8 (decode): Triton GEMV kernels that read each weight byte once and dequantize in registers.
  Decoding one stream is bound by reading weights, so int8 reads half the bytes of bf16 and int4 a quarter;
  torch's bf16 matmul with a separate dequantize would read the weights twice and write them once.
- CUDA, int8, 8 < M <= `GEMM_MAX_ROWS` (prefill, batches): a Triton GEMM that decodes weight tiles in
  registers for tensor-core dots (`ember.quant.triton_gemm`); int4 prefill dequantizes in one Triton pass for
  torch's matmul.
- CPU: `_weight_int8pack_mm` for int8 (bf16 activations: its float32 path is not vectorised).
- Anywhere else, and as the reference in tests: dequantize, then F.linear (`*_reference`).

The ops are opaque to torch.compile (fake impls give the shapes), so a compiled decode step, CUDA graph
included, calls the same kernels.

Shape legend: M rows of activations, K input features, N output features, g group size.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HAS_TRITON = importlib.util.find_spec("triton") is not None
GEMV_MAX_ROWS = 8  # above this many rows (prefill), a GEMM (or dequantize + matmul) wins over a GEMV kernel
# Up to this many rows the int8 GEMM that decodes weight tiles in registers (`triton_gemm`) beats decoding the
# whole projection to bf16 and calling torch's matmul (H200, Llama-3-8B shapes: 3.8-11x at 16 rows, 2-5x at
# 128, about even at 2048: 0.91-1.09x; `benchmarks/gpu_gemm.py`); past it cuBLAS's speed outweighs the pass.
GEMM_MAX_ROWS = 2048
# The tiled int4 GEMV is bound by its instructions, not by memory, so each row costs about one row's time
# (Llama-3-8B gate/up on an H200: 26 us a row against ~135 us to dequantize and multiply any number of rows).
TILED_GEMV_MAX_ROWS = 4
# The bit at which the tiled int4 GEMV reads nibble j of a word (`triton_kernels._tiled_nibble`), and the
# power of two by which it scales activations read at bit 0: 2^(TILED_X_EXP - P) at bit P.
TILED_NIBBLE_BITS = (0, 4, 8, 12, 16, 20, 16, 20)
TILED_X_EXP = 79


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K), qweight int8 (N, K), scales (N,) -> (M, N): x @ (q * scale).T."""
    return (F.linear(x, qweight.to(x.dtype)) * scales.to(x.dtype)).to(x.dtype)


def int4_fold_scales(
    scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, mins) of w = q*s + min -> (16s, min - 16s) in `dtype`, the factors `int4_linear` takes.

    With them w = (1 + q/16) * 16s + (min - 16s): the GEMV kernel builds the float 1 + q/16 by writing q into
    the mantissa of 1.0 (no int-to-float conversion) and needs one FMA per weight.
    """
    s16 = scales.float() * 16
    return s16.to(dtype), (mins.float() - s16).to(dtype)


def _tiled_bits(per_group: torch.Tensor) -> torch.Tensor:
    """(K/g,) the bit at which the tiled GEMV reads each group's codes: group 8t + j is nibble j of tile t."""
    j = torch.arange(per_group.shape[-1], device=per_group.device) % 8
    return torch.tensor(TILED_NIBBLE_BITS, device=per_group.device)[j]


def bf16_pair(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Two tensors rounded to bf16 -> int32 words holding `hi` in the high half and `lo` in the low."""
    return hi.to(torch.bfloat16).view(torch.int16).to(torch.int32) << 16 | (
        lo.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    )


def bf16_unpair(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `bf16_pair`, as float32: (high half, low half)."""
    return (words & -65536).view(torch.float32), (words << 16).view(torch.float32)


def int4_subnormal_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """(scales, mins) (N, K/g) of w = q*s + min -> int32 (N, K/g), the factors of the subnormal int4 GEMV
    (`triton_kernels.int4_tiled_gemv`) as two bf16 in one word (bf16's exponent range holds them): s * 2^70 in
    the high half, min * 2^(P - 79) in the low, P the bit position at which the kernel reads the group's codes
    (`TILED_NIBBLE_BITS`; 70 = 149 - `TILED_X_EXP`). Scaled by powers of two, the two are exactly s and min
    rounded to bf16."""
    p = _tiled_bits(scales)
    s = scales.to(torch.bfloat16).float() * 2.0 ** (149 - TILED_X_EXP)
    z = mins.to(torch.bfloat16).float() * torch.exp2((p - TILED_X_EXP).float())
    return bf16_pair(s, z)


def int4_tiles(in_features: int, group_size: int) -> bool:
    """Whether K splits into tiles of 8 groups, which the tiled int4 layout (`int4_tile`) needs."""
    return in_features % (8 * group_size) == 0


def int4_tile(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Canonical packed codes uint8 (N, K/2) -> int32 words (N, K/8) in the tiled layout of the CUDA kernel.

    K is cut into tiles of 8 groups; word i of tile t holds in its nibble j (bits 4j..4j+3) the code of weight
    k = 8g*t + g*j + i, so a kernel unpacks one whole group per nibble position with a shift and a mask.
    """
    N, g = qweight.shape[0], group_size
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, -1, 8, g)  # (N, T, j, i)
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int64)
    words = (codes.transpose(2, 3).to(torch.int64) << shifts).sum(-1)  # (N, T, i): disjoint bits, sum = or
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement for int32
    return words.to(torch.int32).reshape(N, -1)


def int4_untile(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of `int4_tile`: int32 words (N, K/8) -> codes uint8 (N, K)."""
    N, g = words.shape[0], group_size
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    codes = (words.reshape(N, -1, g, 1) >> shifts) & 0xF  # (N, T, i, j)
    return codes.transpose(2, 3).reshape(N, -1).to(torch.uint8)


def int4_mma_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the tensor-core int4 layout (`int4_mma_tile`) holds these weights: rows in tiles of 16, K in
    steps of 64, and groups of whole steps (a step's 64 weights of a row are summed by 4 mma together)."""
    return out_features % 16 == 0 and in_features % 64 == 0 and group_size % 64 == 0


def int4_mma_tile(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical packed codes uint8 (N, K/2) -> int32 words (N, K/8) in the fragment layout of the tensor-core
    GEMV (`ember.quant.triton_mma`).

    Rows go in tiles of 16 and K in steps of 64; a (tile, step) block is 128 words, 4 per lane of a warp, in
    lane order, so a warp reads it with one 16-byte load per lane. Word m of lane (g, q) (g = lane // 4,
    q = lane % 4) holds the A operand of the step's m-th mma.m16n8k16: weights of rows g and g + 8 at
    k = 64s + 16q + 4m + {0, 1, 2, 3}, nibble (4e + r + 2h) (bits 16e + 4r + 8h) being row g + 8r at
    k = 64s + 16q + 4m + 2h + e. Lane (g, q) takes activations 16q..16q+15 of the step, contiguous, and a mask
    of 0x000F000F after a shift by 0, 4, 8 or 12 leaves the two nibbles of one A register in place.
    """
    N, K = qweight.shape[0], qweight.shape[1] * 2
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).to(torch.int64)
    codes = codes.reshape(N // 16, 2, 8, K // 64, 4, 4, 2, 2)  # (tile, r, g, step, q, m, h, e)
    codes = codes.permute(0, 3, 2, 4, 5, 1, 6, 7)  # (tile, step, g, q, m, r, h, e)
    i = torch.arange(2, device=qweight.device)
    shifts = 4 * i.view(2, 1, 1) + 8 * i.view(1, 2, 1) + 16 * i.view(1, 1, 2)
    words = (codes << shifts).sum((-3, -2, -1))  # disjoint bits: the sum is an or
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement for int32
    return words.to(torch.int32).reshape(N, K // 8)


def int4_mma_untile(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `int4_mma_tile`, unpacked: int32 words (N, K/8) -> codes uint8 (N, K)."""
    N, K = words.shape[0], words.shape[1] * 8
    i = torch.arange(2, device=words.device)
    shifts = 4 * i.view(2, 1, 1) + 8 * i.view(1, 2, 1) + 16 * i.view(1, 1, 2)  # (r, h, e)
    w = words.reshape(N // 16, K // 64, 8, 4, 4, 1, 1, 1)  # (tile, step, g, q, m, r, h, e)
    codes = (w >> shifts) & 0xF
    return codes.permute(0, 5, 2, 1, 3, 4, 6, 7).reshape(N, K).to(torch.uint8)


def int4_mma_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """(scales, mins) (N, K/g) of w = q*s + min -> int32 (N, K/g): s as bf16 in the high half, min in the low."""
    return bf16_pair(scales, mins)


def int4_mma_dequantize(words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """`int4_mma_tile` words and `int4_mma_scales` factors -> the float32 weights (N, K): q * s + min, with s
    and min as rounded to bf16."""
    N = words.shape[0]
    codes = int4_mma_untile(words).reshape(N, -1, group_size).float()  # (N, K/g, g)
    s, z = bf16_unpair(sz)
    return (codes * s[..., None] + z[..., None]).reshape(N, -1)


def int4_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, s16: torch.Tensor, z16: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K), qweight uint8 (N, K/2) nibbles, folded scales (N, K/g) -> (M, N): x @ ((1 + q/16) * s16 + z16).T."""
    N = qweight.shape[0]
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, -1, group_size)  # (N, K/g, g)
    f = codes.float() / 16 + 1
    w = f * s16[..., None].float() + z16[..., None].float()
    return F.linear(x, w.reshape(N, -1).to(x.dtype))


@torch.library.custom_op("ember::float_linear", mutates_args=())
def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T for float weights: the Triton GEMV on CUDA for one row, else F.linear."""
    return F.linear(x, weight)


@float_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@float_linear.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and x.shape[0] == 1 and weight.stride(-1) == 1 and weight.stride(0) == weight.shape[1]:
        from ember.quant import triton_kernels

        return triton_kernels.float_gemv(x.contiguous(), weight)
    return F.linear(x, weight)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output y (..., 2I): gate columns, then up."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_gate_up_reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K), a fused gate/up weight (2I, K) (float, or int8 codes with scales (2I,)) -> silu(gate) * up (M, I)."""
    return swiglu(F.linear(x, weight) if scales is None else int8_linear_reference(x, weight, scales))


@torch.library.custom_op("ember::silu_gate_up", mutates_args=())
def silu_gate_up(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """`silu_gate_up_reference`; on CUDA, for one row, one Triton GEMV that reads each gate row with its up
    row and stores silu(gate) * up (no (M, 2I) intermediate, no separate activation kernel)."""
    return silu_gate_up_reference(x, weight, scales)


@silu_gate_up.register_fake
def _(x, weight, scales):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@silu_gate_up.register_kernel("cuda")
def _(x, weight, scales):
    if HAS_TRITON and x.shape[0] == 1 and weight.is_contiguous():
        from ember.quant import triton_kernels

        return triton_kernels.fused_gemv(x.contiguous(), weight, scales, glu=True)
    return silu_gate_up_reference(x, weight, scales)


def int8_linear_add_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, resid: torch.Tensor
) -> torch.Tensor:
    """resid (M, N) + x (M, K) @ (qweight * scales).T, the product rounded to x's dtype before the add (as the
    unfused projection and residual add round)."""
    return resid + int8_linear_reference(x, qweight, scales)


@torch.library.custom_op("ember::int8_linear_add", mutates_args=())
def int8_linear_add(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, resid: torch.Tensor
) -> torch.Tensor:
    """`int8_linear_add_reference`: a pre-norm layer's output projection and the residual add after it; on
    CUDA, for one row, one GEMV that adds the residual as it stores (`ember.quant.cuda_gemv`)."""
    return int8_linear_add_reference(x, qweight, scales, resid)


@int8_linear_add.register_fake
def _(x, qweight, scales, resid):
    return torch.empty_like(resid)


@int8_linear_add.register_kernel("cuda")
def _(x, qweight, scales, resid):
    if HAS_TRITON and _folds(x, qweight, scales, resid.dtype) and resid.is_contiguous():
        from ember.quant import triton_kernels

        return triton_kernels.fused_gemv(x.contiguous(), qweight, scales, resid=resid)
    return int8_linear_add_reference(x, qweight, scales, resid)


def _folds(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the CUDA C++ int8 GEMV's folds take one row x with these operands (the other's dtype `dtype`)."""
    from ember.quant import cuda_gemv

    return x.shape[0] == 1 and dtype == x.dtype and cuda_gemv.fits(x.contiguous(), qweight, scales)


def int8_norm_linear_reference(
    h: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    offset: float,
    glu: bool,
) -> torch.Tensor:
    """RMSNorm(h) (`ember.ops.norm.rms_norm_reference`) @ (qweight * scales).T, or silu(gate) * up of it with
    glu: a pre-norm layer's norm and the projection after it."""
    from ember.ops.norm import rms_norm_reference

    n = rms_norm_reference(h, norm_weight, eps, offset)
    return silu_gate_up_reference(n, qweight, scales) if glu else int8_linear_reference(n, qweight, scales)


@torch.library.custom_op("ember::int8_norm_linear", mutates_args=())
def int8_norm_linear(
    h: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    offset: float,
    glu: bool,
) -> torch.Tensor:
    """`int8_norm_linear_reference`; on CUDA, for one row, one GEMV that scales each activation by the norm's
    weight as it loads it and the row's sums by the norm's factor as it stores them (`ember.quant.cuda_gemv`;
    the normalised activations are not rounded on the way, so it differs from the reference by that rounding)."""
    return int8_norm_linear_reference(h, qweight, scales, norm_weight, eps, offset, glu)


@int8_norm_linear.register_fake
def _(h, qweight, scales, norm_weight, eps, offset, glu):
    return h.new_empty(h.shape[0], qweight.shape[0] // (2 if glu else 1))


@int8_norm_linear.register_kernel("cuda")
def _(h, qweight, scales, norm_weight, eps, offset, glu):
    if HAS_TRITON and _folds(h, qweight, scales, norm_weight.dtype) and norm_weight.is_contiguous():
        from ember.quant import triton_kernels

        norm = (norm_weight, eps, offset)
        return triton_kernels.fused_gemv(h.contiguous(), qweight, scales, glu=glu, norm=norm)
    return int8_norm_linear_reference(h, qweight, scales, norm_weight, eps, offset, glu)


@torch.library.custom_op("ember::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return int8_linear_reference(x, qweight, scales)


@int8_linear.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


# `_weight_int8pack_mm` on CPU reads K in blocks of 16: other widths crashed (SIGSEGV, several rows) or gave
# NaN/inf (one row) with torch 2.13 on AVX-512. Such projections (tiny models) take the reference.
INT8PACK_K = 16


def int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_linear` on CPU: torch's kernel with bf16 activations, or the reference for widths it does not take.
    The int8 module calls it directly: through the custom op a call cost ~12 us more (SmolLM2's decode makes
    120 a step), and the op's first call imported torch._dynamo (~1 s inside the first token's time)."""
    if qweight.shape[1] % INT8PACK_K:
        return int8_linear_reference(x, qweight, scales)
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales.to(torch.bfloat16))
    return y.to(x.dtype)


int8_linear.register_kernel("cpu")(int8_linear_cpu)


@int8_linear.register_kernel("cuda")
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and x.shape[0] <= GEMV_MAX_ROWS:
        from ember.quant import triton_kernels

        return triton_kernels.int8_gemv(x.contiguous(), qweight, scales)
    if HAS_TRITON and x.shape[0] <= GEMM_MAX_ROWS:
        from ember.quant import triton_gemm

        if x.dtype in triton_gemm.DTYPES:
            return triton_gemm.int8_gemm(x.contiguous(), qweight, scales)
    return int8_linear_reference(x, qweight, scales)


@torch.library.custom_op("ember::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, s16: torch.Tensor, z16: torch.Tensor, group_size: int
) -> torch.Tensor:
    return int4_linear_reference(x, qweight, s16, z16, group_size)


@int4_linear.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, s16: torch.Tensor, z16: torch.Tensor, group_size: int):
    return x.new_empty(x.shape[0], qweight.shape[0])


@int4_linear.register_kernel("cuda")
def _(x: torch.Tensor, qweight: torch.Tensor, s16: torch.Tensor, z16: torch.Tensor, group_size: int):
    if HAS_TRITON and x.shape[0] <= GEMV_MAX_ROWS:
        from ember.quant import triton_kernels

        return triton_kernels.int4_gemv(x.contiguous(), qweight, s16, z16, group_size)
    return int4_linear_reference(x, qweight, s16, z16, group_size)


def int4_tiled_dequantize(words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """Tiled words int32 (N, K/8) (`int4_tile`) and their factors sz (`int4_subnormal_scales`) -> the float32
    weights (N, K): q * s + min, with s and min as rounded to bf16."""
    N = words.shape[0]
    codes = int4_untile(words, group_size).reshape(N, -1, group_size).float()  # (N, K/g, g)
    p = _tiled_bits(sz)
    s, z = bf16_unpair(sz)
    s, z = s * 2.0 ** (TILED_X_EXP - 149), z * torch.exp2((TILED_X_EXP - p).float())
    return (codes * s[..., None] + z[..., None]).reshape(N, -1)


class SplitSum(NamedTuple):
    """A projection's output y (..., N) left as float32 partial sums over runs of K, `parts` (S, ..., N).

    A GEMV that splits K where N is small needs a pass that adds its partials; when the projection's consumer
    reads its output once anyway (the residual add before the next RMSNorm, `ember.ops.norm.RMSNorm.add_forward`),
    that pass can be the consumer's load. `total` is y as the pass would store it: the parts added in order in
    float32, rounded once."""

    parts: torch.Tensor

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        acc = self.parts[0].clone()
        for part in self.parts[1:]:
            acc += part
        return acc.to(dtype)


class NormedRow(NamedTuple):
    """One row's RMSNorm(h) as the projection before the norm hands it on (`int4_mma_linear_add_norm`): hw, h
    times the norm's (offset + weight) in h's dtype, and sq, the sums of h^2 of each 16 of its values; the
    norm's factor rsqrt(sum(sq) / E + eps) is applied by the projection after it (`int4_mma_normed_linear`)."""

    hw: torch.Tensor
    sq: torch.Tensor
    eps: float


def silu_mul_partials_reference(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts (S, M, 2I) float32 partial sums of a fused gate/up projection -> silu(gate) * up (M, I) in `dtype`:
    the sums added and rounded as `SplitSum.total` does, then the activation as `silu_gate_up_reference`."""
    return swiglu(SplitSum(parts).total(dtype))


@torch.library.custom_op("ember::silu_mul_partials", mutates_args=())
def silu_mul_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`silu_mul_partials_reference`; on CUDA one Triton kernel (launched with PDL) in place of a sum pass and
    an activation kernel."""
    return silu_mul_partials_reference(parts, dtype)


@silu_mul_partials.register_fake
def _(parts: torch.Tensor, dtype: torch.dtype):
    return parts.new_empty(parts.shape[1], parts.shape[2] // 2, dtype=dtype)


@silu_mul_partials.register_kernel("cuda")
def _(parts: torch.Tensor, dtype: torch.dtype):
    if not HAS_TRITON or not parts.is_contiguous():
        return silu_mul_partials_reference(parts, dtype)
    from ember.quant import triton_kernels

    return triton_kernels.silu_mul_partials(parts, dtype)


def split_k_partials(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """x (M, K), float32 weights (N, K) -> (splits, M, N) float32: x @ w.T over each of `splits` equal runs of K."""
    run = x.shape[1] // splits
    xf = x.float()
    return torch.stack(
        [xf[:, i * run : (i + 1) * run] @ w[:, i * run : (i + 1) * run].T for i in range(splits)]
    )


def _linear_op(name: str, dequantize, launch):
    """The custom op `ember::<name>` (x (M, K), int4 words and factors of one layout, group size) -> (M, N)
    in x's dtype, and its reference (torch's linear over `dequantize(words, sz, group_size)`), which runs off
    CUDA and wherever `launch(x, words, sz, group_size)`, the CUDA path, returns None."""

    def reference(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return F.linear(x, dequantize(words, sz, group_size).to(x.dtype))

    @torch.library.custom_op(f"ember::{name}", mutates_args=())
    def op(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
        return reference(x, words, sz, group_size)

    @op.register_fake
    def _(x, words, sz, group_size):
        return x.new_empty(x.shape[0], words.shape[0])

    @op.register_kernel("cuda")
    def _(x, words, sz, group_size):
        out = launch(x, words, sz, group_size) if HAS_TRITON else None
        return reference(x, words, sz, group_size) if out is None else out

    return op, reference


def _partials_op(name: str, dequantize, launch):
    """The custom op `ember::<name>` (x (M, K), int4 words and factors of one layout, group size, splits) ->
    (splits, M, N) float32 partial sums of x @ w.T over `splits` equal runs of K, and its reference (float math
    on `dequantize(words, sz, group_size)`), which runs off CUDA and wherever `launch(x, words, sz,
    group_size, splits)`, the CUDA kernel, returns None."""

    def reference(
        x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, splits: int
    ) -> torch.Tensor:
        return split_k_partials(x, dequantize(words, sz, group_size), splits)

    @torch.library.custom_op(f"ember::{name}", mutates_args=())
    def op(
        x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, splits: int
    ) -> torch.Tensor:
        return reference(x, words, sz, group_size, splits)

    @op.register_fake
    def _(x, words, sz, group_size, splits):
        return x.new_empty(splits, x.shape[0], words.shape[0], dtype=torch.float32)

    @op.register_kernel("cuda")
    def _(x, words, sz, group_size, splits):
        out = launch(x, words, sz, group_size, splits) if HAS_TRITON else None
        return reference(x, words, sz, group_size, splits) if out is None else out

    return op, reference


def _tiled_partials_launch(x, words, sz, group_size, splits):
    from ember.quant import triton_kernels

    return triton_kernels.int4_tiled_partials(x.contiguous(), words, sz, group_size, splits)


# The tiled GEMV's split-K launch without its sum pass.
int4_tiled_partials, int4_tiled_partials_reference = _partials_op(
    "int4_tiled_partials", int4_tiled_dequantize, _tiled_partials_launch
)


def _tiled_linear_launch(x, words, sz, group_size):
    from ember.quant import triton_kernels

    if x.shape[0] <= TILED_GEMV_MAX_ROWS:
        return triton_kernels.int4_tiled_gemv(x.contiguous(), words, sz, group_size)
    return F.linear(x, triton_kernels.int4_tiled_dequantize(words, sz, group_size, x.dtype))


# On CUDA the subnormal-code GEMV for few rows (`triton_kernels.int4_tiled_gemv`) and, for more, a Triton
# dequantize to the activation dtype and torch's matmul.
int4_tiled_linear, int4_tiled_linear_reference = _linear_op(
    "int4_tiled_linear", int4_tiled_dequantize, _tiled_linear_launch
)


def _mma_linear_launch(x, words, sz, group_size):
    from ember.quant import triton_mma

    if x.dtype != torch.bfloat16:  # the mma multiplies bf16
        return None
    if x.shape[0] <= triton_mma.MAX_ROWS:
        return triton_mma.int4_mma_linear(x.contiguous(), words, sz, group_size)
    return F.linear(x, triton_mma.int4_mma_dequantize(words, sz, group_size, x.dtype))


# On CUDA the tensor-core GEMV up to 8 rows (`triton_mma.int4_mma_gemv`) and, for more, a Triton dequantize
# to the activation dtype and torch's matmul.
int4_mma_linear, int4_mma_linear_reference = _linear_op(
    "int4_mma_linear", int4_mma_dequantize, _mma_linear_launch
)


def _mma_partials_launch(x, words, sz, group_size, splits):
    from ember.quant import triton_mma

    if x.dtype != torch.bfloat16 or x.shape[0] > triton_mma.MAX_ROWS:
        return None
    return triton_mma.int4_mma_gemv(x.contiguous(), words, sz, group_size, splits)


# The tensor-core GEMV over `splits` runs of K, unsummed.
int4_mma_partials, int4_mma_partials_reference = _partials_op(
    "int4_mma_partials", int4_mma_dequantize, _mma_partials_launch
)


def int4_mma_silu_gate_up_reference(
    x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int
) -> torch.Tensor:
    """silu(gate) * up (M, N) of x (M, K) and a gate/up weight (gate rows over up rows, 2N of them) in the
    tensor-core layout: the projection in x's dtype, then the activation as `silu_gate_up_reference` rounds."""
    return swiglu(int4_mma_linear(x, words, sz, group_size))


@torch.library.custom_op("ember::int4_mma_silu_gate_up", mutates_args=())
def int4_mma_silu_gate_up(
    x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_mma_silu_gate_up_reference`; on CUDA one kernel where the CUDA C++ int4 GEMV takes the operands
    (`ember.quant.cuda_int4.silu_gate_up`)."""
    return int4_mma_silu_gate_up_reference(x, words, sz, group_size)


@int4_mma_silu_gate_up.register_fake
def _(x, words, sz, group_size):
    return x.new_empty(x.shape[0], words.shape[0] // 2)


@int4_mma_silu_gate_up.register_kernel("cuda")
def _(x, words, sz, group_size):
    from ember.quant import cuda_int4

    if cuda_int4.fits(x, words, sz, group_size) and (words.shape[0] // 2) % 16 == 0:
        return cuda_int4.silu_gate_up(x, words, sz, group_size)
    return int4_mma_silu_gate_up_reference(x, words, sz, group_size)


def int4_mma_linear_add_norm_reference(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    resid: torch.Tensor,
    weight: torch.Tensor,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one row x (1, K) and a weight (N rows) in the tensor-core layout, a projection into the residual
    stream before a pre-norm layer's RMSNorm: h = resid + x @ w.T (the product rounded to x's dtype, then the
    add, as torch rounds them), hw = h (offset + weight) in x's dtype (the norm's weight applied, its factor
    not), and sq (N / 16,) float32, the sums of h^2 of each 16 rows. `int4_mma_normed_linear` takes hw and sq."""
    y = (x.reshape(1, -1).float() @ int4_mma_dequantize(words, sz, group_size).T).to(x.dtype)
    h = resid.reshape(y.shape) + y
    hw = (h.float() * (offset + weight.float())).to(x.dtype)
    return h, hw, h.float().square().reshape(-1, 16).sum(-1)


@torch.library.custom_op("ember::int4_mma_linear_add_norm", mutates_args=())
def int4_mma_linear_add_norm(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    resid: torch.Tensor,
    weight: torch.Tensor,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`int4_mma_linear_add_norm_reference`; on CUDA one kernel of the CUDA C++ int4 GEMV
    (`ember.quant.cuda_int4.linear_add_norm`)."""
    return int4_mma_linear_add_norm_reference(x, words, sz, group_size, resid, weight, offset)


@int4_mma_linear_add_norm.register_fake
def _(x, words, sz, group_size, resid, weight, offset):
    N = words.shape[0]
    return x.new_empty(1, N), x.new_empty(1, N), x.new_empty(N // 16, dtype=torch.float32)


@int4_mma_linear_add_norm.register_kernel("cuda")
def _(x, words, sz, group_size, resid, weight, offset):
    from ember.quant import cuda_int4

    ok = (
        resid.is_contiguous()
        and resid.dtype == x.dtype
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    )
    if ok and cuda_int4.fold_fits(x, words, sz, group_size):
        return cuda_int4.linear_add_norm(x.reshape(1, -1), words, sz, group_size, resid, weight, offset)
    return int4_mma_linear_add_norm_reference(x, words, sz, group_size, resid, weight, offset)


def int4_mma_normed_linear_reference(
    hw: torch.Tensor,
    sq: torch.Tensor,
    eps: float,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    glu: bool,
) -> torch.Tensor:
    """RMSNorm(h) @ w.T (1, N) in hw's dtype for a row h carried as `int4_mma_linear_add_norm_reference` leaves
    it: (hw @ w.T) * rsqrt(sum(sq) / K + eps) in float32, rounded once; with glu (a gate/up weight of 2N rows),
    silu(gate) * up of those, as `int4_mma_silu_gate_up_reference` rounds."""
    r = torch.rsqrt(sq.sum() / hw.shape[-1] + eps)
    y = ((hw.reshape(1, -1).float() @ int4_mma_dequantize(words, sz, group_size).T) * r).to(hw.dtype)
    return swiglu(y) if glu else y


@torch.library.custom_op("ember::int4_mma_normed_linear", mutates_args=())
def int4_mma_normed_linear(
    hw: torch.Tensor,
    sq: torch.Tensor,
    eps: float,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    glu: bool,
) -> torch.Tensor:
    """`int4_mma_normed_linear_reference`; on CUDA one kernel of the CUDA C++ int4 GEMV
    (`ember.quant.cuda_int4.normed_linear`)."""
    return int4_mma_normed_linear_reference(hw, sq, eps, words, sz, group_size, glu)


@int4_mma_normed_linear.register_fake
def _(hw, sq, eps, words, sz, group_size, glu):
    return hw.new_empty(1, words.shape[0] // (2 if glu else 1))


@int4_mma_normed_linear.register_kernel("cuda")
def _(hw, sq, eps, words, sz, group_size, glu):
    from ember.quant import cuda_int4

    x = hw.reshape(1, -1)
    fits = x.shape[1] <= cuda_int4.FOLD_MAX_K and cuda_int4.fold_fits(x, words, sz, group_size)
    if fits and sq.is_contiguous() and (not glu or (words.shape[0] // 2) % 16 == 0):
        return cuda_int4.normed_linear(x, sq, eps, words, sz, group_size, glu)
    return int4_mma_normed_linear_reference(hw, sq, eps, words, sz, group_size, glu)


def int4_mma_rounded_linear_reference(
    r: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, glu: bool
) -> torch.Tensor:
    """y (1, N) bf16 of a row rounded to int8 (`ember.quant.cuda_int4.round_row`'s buffer r) and a weight in the
    tensor-core layout: the rounded row's values x' @ w.T; with glu (a gate/up weight of 2N rows), silu(gate) *
    up of those, as `int4_mma_silu_gate_up_reference` rounds."""
    from ember.quant.cuda_int4 import unround_row

    x = unround_row(r, words.shape[1] * 8)
    y = (x @ int4_mma_dequantize(words, sz, group_size).T).to(torch.bfloat16)
    return swiglu(y) if glu else y


@torch.library.custom_op("ember::int4_mma_rounded_linear", mutates_args=())
def int4_mma_rounded_linear(
    r: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, glu: bool
) -> torch.Tensor:
    """`int4_mma_rounded_linear_reference`; on CUDA the CUDA C++ int4 GEMV that reads the rounded row as it is
    (`ember.quant.cuda_int4.linear_rounded`)."""
    return int4_mma_rounded_linear_reference(r, words, sz, group_size, glu)


@int4_mma_rounded_linear.register_fake
def _(r, words, sz, group_size, glu):
    return r.new_empty(1, words.shape[0] // (2 if glu else 1), dtype=torch.bfloat16)


@int4_mma_rounded_linear.register_kernel("cuda")
def _(r, words, sz, group_size, glu):
    from ember.quant import cuda_int4

    if cuda_int4.rounded_fits(r, words, sz, group_size) and (not glu or (words.shape[0] // 2) % 16 == 0):
        return cuda_int4.linear_rounded(r, words, sz, group_size, glu)
    return int4_mma_rounded_linear_reference(r, words, sz, group_size, glu)
