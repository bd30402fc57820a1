"""RMSNorm, as Hugging Face's models compute and round it, and `ember::add_rms_norm`: the residual add and
the next RMSNorm of a decode step as one kernel.

A pre-norm layer's residual stream is h = x + branch(norm(x)); a CUDA decode step computes the add and the
next norm between two GEMVs. torch.compile fuses them into one kernel of its own, which the GEMV after it
cannot start early behind (`ember.ops.launch`); on CUDA, for one row, `add_rms_norm` is a Triton kernel that
loads the norm weight before waiting on the kernel before and lets the GEMV after it start while it drains.
Elsewhere it is the plain ops, `add_rms_norm_reference`, which the kernel is tested against; in an eager CPU
step, Ember's C++ kernel of the same values (`cpu_kernel`).

A split GEMV's float32 partial sums (`ember.quant.kernels.SplitSum`) can stand for delta: the kernel adds them
as it loads them, in place of the pass that would (int4 o and down projections; one kernel and its
boundary fewer per projection). `add_rms_norm_rounded` also returns the normalised row rounded to int8 for the
int4 GEMVs after it (`ember.quant.cuda_int4.round_row`), which only this kernel holds whole.

Shape legend: E features; x, delta (..., E); S runs of a split GEMV.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.ops import cpu_ext
from ember.ops.linear import one_row_on_cuda
from ember.quant.kernels import HAS_TRITON, SplitSum


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: float32 statistics; the weight scales the result rounded to x's dtype, or with
    an offset (Gemma: 1 + w) the float32 result before rounding."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = x + delta in x's dtype; delta (..., E) in x's dtype, or (S, ..., E) float32
    partial sums of it (`SplitSum`), added in order and rounded to x's dtype first."""
    if delta.dim() == x.dim() + 1:
        delta = SplitSum(delta).total(x.dtype)
    h = x + delta
    return h, rms_norm_reference(h, weight, eps, offset)


@torch.library.custom_op("ember::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference`; one Triton kernel on CUDA."""
    return add_rms_norm_reference(x, delta, weight, eps, offset)


@add_rms_norm.register_fake
def _(x, delta, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(x)


@add_rms_norm.register_kernel("cuda")
def _(x, delta, weight, eps, offset):
    if HAS_TRITON and x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous():
        from ember.ops import triton_norm

        return triton_norm.add_rms_norm(x, delta, weight, eps, offset)
    return add_rms_norm_reference(x, delta, weight, eps, offset)


def add_rms_norm_rounded_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` of one row, and its norm rounded as `ember.quant.cuda_int4.round_row` rounds."""
    from ember.quant.cuda_int4 import round_row

    h, out = add_rms_norm_reference(x, delta, weight, eps, offset)
    return h, out, round_row(out)


@torch.library.custom_op("ember::add_rms_norm_rounded", mutates_args=())
def add_rms_norm_rounded(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_rounded_reference`; one Triton kernel on CUDA."""
    return add_rms_norm_rounded_reference(x, delta, weight, eps, offset)


@add_rms_norm_rounded.register_fake
def _(x, delta, weight, eps, offset):
    from ember.quant.cuda_int4 import rounded_bytes

    return (
        torch.empty_like(x),
        torch.empty_like(x),
        x.new_empty(rounded_bytes(x.shape[-1]), dtype=torch.uint8),
    )


@add_rms_norm_rounded.register_kernel("cuda")
def _(x, delta, weight, eps, offset):
    if HAS_TRITON and x.is_contiguous() and delta.is_contiguous() and weight.is_contiguous():
        from ember.ops import triton_norm
        from ember.quant.cuda_int4 import rounded_bytes

        rounded = x.new_empty(rounded_bytes(x.shape[-1]), dtype=torch.uint8)
        return *triton_norm.add_rms_norm(x, delta, weight, eps, offset, rounded), rounded
    return add_rms_norm_rounded_reference(x, delta, weight, eps, offset)


def cpu_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a norm of x runs Ember's C++ CPU kernel (`ember.ops.cpu_ext`): eager inference on a CPU, x and the
    weight float32 or bfloat16 alike."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and cpu_ext.eager_inference()
        and cpu_ext.available()
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma: the stored weight w scales by (1 + w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernel(x, self.weight):
            return torch.ops.ember_cpu.rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm_reference(x, self.weight, self.eps, self.offset)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor | SplitSum, rounded: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """(h, self(h)) for h = x + delta: one kernel for a decode row on CUDA (`add_rms_norm`), which also adds
        a split GEMV's partial sums where delta is a `SplitSum`. rounded (one row of a multiple of 64): (h,
        self(h), self(h) rounded to int8 as `ember.quant.cuda_int4.round_row` rounds it)."""
        split = isinstance(delta, SplitSum)
        d = delta.parts if split else delta  # both forms of the op's delta
        args = (x, d, self.weight, self.eps, self.offset)
        if one_row_on_cuda(x) and x.dtype == self.weight.dtype and (split or d.dtype == x.dtype):
            return add_rms_norm_rounded(*args) if rounded else add_rms_norm(*args)
        if (
            not rounded
            and not split
            and d.shape == x.shape
            and d.dtype == x.dtype
            and cpu_kernel(x, self.weight)
        ):
            return torch.ops.ember_cpu.add_rms_norm(*args)
        return add_rms_norm_rounded_reference(*args) if rounded else add_rms_norm_reference(*args)
