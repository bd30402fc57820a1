"""Triton kernel of `ember::add_rms_norm`: h = x + delta, then RMSNorm(h), one program per row; delta may come
as S float32 partial sums (a split GEMV's, `ember.quant.kernels.SplitSum`), added here in order.

Rounded where the plain ops round (`ember.ops.norm.add_rms_norm_reference`): h in the activation dtype, the
statistics in float32, and the normalised row rounded before the weight scales it (with an offset, after).
Tested against the reference in Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.ops.launch import launch_options


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    h_ptr,
    o_ptr,
    eps,
    offset,
    part_stride,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    OFFSET: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # SPLITS = 0: d_ptr holds delta in x's dtype; else SPLITS float32 partial sums, part_stride elements apart.
    if PDL:  # `ember.ops.launch`: the weight needs nothing from the kernel before, the rows do
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64) * E
    re = tl.arange(0, BLOCK_E)
    ok = re < E
    w = tl.load(w_ptr + re, mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row + re, mask=ok, other=0.0)
    dt = x.dtype
    if SPLITS == 0:
        d = tl.load(d_ptr + row + re, mask=ok, other=0.0).to(tl.float32)
    else:  # the projection's output as the pass that adds the partials would store it
        d = tl.load(d_ptr + row + re, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            d += tl.load(d_ptr + s * part_stride + row + re, mask=ok, other=0.0)
        d = d.to(dt).to(tl.float32)
    h = (x.to(tl.float32) + d).to(dt)
    tl.store(h_ptr + row + re, h, mask=ok)
    hf = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / E + eps)
    if OFFSET:
        out = hf * r * (offset + w.to(tl.float32))
    else:
        out = w.to(tl.float32) * (hf * r).to(dt).to(tl.float32)
    tl.store(o_ptr + row + re, out.to(dt), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta (..., E) contiguous, weight (E,) -> (h, norm(h)) with h = x + delta, in x's dtype. delta may be
    (S, ..., E) float32 partial sums instead, added in order and rounded to x's dtype."""
    E = x.shape[-1]
    splits = delta.shape[0] if delta.dim() == x.dim() + 1 else 0
    h, out = torch.empty_like(x), torch.empty_like(x)
    BLOCK_E = triton.next_power_of_2(E)
    # One program reads a row's S partials: with more warps, more of those loads are in flight at once.
    warps = min(32, max(1, BLOCK_E // 128)) if splits > 4 else min(16, max(1, BLOCK_E // 512))
    _add_rms_norm_kernel[(x.numel() // E,)](
        x, delta, weight, h, out, eps, offset, x.numel(), E=E, BLOCK_E=BLOCK_E, OFFSET=offset != 0.0, SPLITS=splits,
        num_warps=warps, **launch_options(x.device),
    )  # fmt: skip
    return h, out
