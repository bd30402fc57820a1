"""Triton kernel of `ember::add_rms_norm`: h = x + delta, then RMSNorm(h), one program per row; delta may come
as S float32 partial sums (a split GEMV's, `ember.quant.kernels.SplitSum`), added here in order.

Rounded where the plain ops round (`ember.ops.norm.add_rms_norm_reference`): h in the activation dtype, the
statistics in float32, and the normalised row rounded before the weight scales it (with an offset, after).
With ROUND it also stores the normalised row rounded to int8 for the int4 GEMVs that read it so
(`ember.quant.cuda_int4.round_row`, bit for bit). Tested against the reference in Triton's interpreter on CPU.
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
    q_ptr,
    s_ptr,
    u_ptr,
    eps,
    offset,
    part_stride,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    OFFSET: tl.constexpr,
    SPLITS: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    # SPLITS = 0: d_ptr holds delta in x's dtype; else SPLITS float32 partial sums, part_stride elements apart.
    # ROUND (one row, E a multiple of 64): q_ptr, s_ptr, u_ptr take the row's int8 codes, block scales and sums.
    if PDL:  # `ember.ops.launch`: the weight needs nothing from the kernel before, the rows do
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64) * E
    # ROUND: the row as (lane t, block, 8), block 2 s + i holding k 64 s + 16 t + 8 i + 0..7 (step s). Laid out
    # so, a block's reductions stay in a warp and a thread divides for 4 blocks at 8 warps and E 4096 (a 1-D row
    # reshaped into blocks compiled to 13 barriers and 32 divisions a thread for sm_90; this, 5 and 8).
    if ROUND:
        t3, j3 = tl.arange(0, 4)[:, None, None], tl.arange(0, 8)[None, None, :]
        b3 = tl.arange(0, BLOCK_E // 32)[None, :, None]
        re = 16 * t3 + 64 * (b3 // 2) + 8 * (b3 % 2) + j3
    else:
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
    squares = hf * hf
    if ROUND:
        squares = tl.sum(tl.sum(squares, axis=2), axis=0)
    r = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / E + eps)
    if OFFSET:
        out = hf * r * (offset + w.to(tl.float32))
    else:
        out = w.to(tl.float32) * (hf * r).to(dt).to(tl.float32)
    tl.store(o_ptr + row + re, out.to(dt), mask=ok)
    if ROUND:  # each block's scale amax / 127 and codes round(v * 127 / amax); padding: blocks of 0s
        v = out.to(dt).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(v), axis=2), axis=0)
        # Divisions rounded to nearest (IEEE), as torch's of two tensors: a GPU's `/` may be an ulp off.
        inv = tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(amax > 0.0, amax, 1.0))
        inv = tl.where(amax > 0.0, inv, 0.0)[None, :, None]
        # To nearest even as the sum's float rounds it (launched without FMA contraction, so v * inv rounds
        # first, as in torch); |v * inv| <= 127.
        codes = (v * inv + 12582912.0) - 12582912.0
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        sums = tl.sum(tl.sum(codes, axis=2), axis=0) * scale
        # lane t's 16 codes in k order but the middle two of each 4 swapped (bits 0 and 1 of k)
        to = (re & ~3) | ((re & 1) << 1) | ((re >> 1) & 1)
        tl.store(q_ptr + to, codes.to(tl.int8), mask=ok)
        # a block's scale and sum stored by its first element (in the reductions' layout: no exchange)
        first = (t3 == 0) & (j3 == 0) & (b3 < E // 32)
        blocks = tl.broadcast_to(b3, re.shape)
        tl.store(s_ptr + blocks, tl.broadcast_to(scale[None, :, None], re.shape), mask=first)
        tl.store(u_ptr + blocks, tl.broadcast_to(sums[None, :, None], re.shape), mask=first)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    rounded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta (..., E) contiguous, weight (E,) -> (h, norm(h)) with h = x + delta, in x's dtype. delta may be
    (S, ..., E) float32 partial sums instead, added in order and rounded to x's dtype. rounded: for one row (E
    a multiple of 64), a uint8 buffer that takes norm(h) as `ember.quant.cuda_int4.round_row` rounds it."""
    E = x.shape[-1]
    splits = delta.shape[0] if delta.dim() == x.dim() + 1 else 0
    h, out = torch.empty_like(x), torch.empty_like(x)
    BLOCK_E = triton.next_power_of_2(E)
    # One program reads a row's S partials: with more warps, more of those loads are in flight at once.
    warps = min(32, max(1, BLOCK_E // 128)) if splits > 4 else min(16, max(1, BLOCK_E // 512))
    if rounded is not None:
        from ember.quant.cuda_int4 import rounded_bytes

        if x.numel() != E or E % 64 or rounded.numel() != rounded_bytes(E):
            raise ValueError(f"a rounded norm takes one row of a multiple of 64, not {tuple(x.shape)}")
        codes, scales, sums = rounded[:E].view(torch.int8), *rounded[E:].view(torch.float32).chunk(2)
    else:
        codes = scales = sums = out  # not written
    options = launch_options(x.device)
    if rounded is not None and x.is_cuda:
        options["enable_fp_fusion"] = False  # the codes' v * inv rounded before the add that rounds it
    _add_rms_norm_kernel[(x.numel() // E,)](
        x, delta, weight, h, out, codes, scales, sums, eps, offset, x.numel(), E=E, BLOCK_E=BLOCK_E,
        OFFSET=offset != 0.0, SPLITS=splits, ROUND=rounded is not None, num_warps=warps, **options,
    )  # fmt: skip
    return h, out
