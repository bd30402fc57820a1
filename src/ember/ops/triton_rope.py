"""Triton kernel of `ember::rope_tables`: a decode step's rope tables, cos and sin of position x frequency, one
program a token. Computed as the plain ops compute them (`ember.ops.rope.rope_tables_reference`: the angle a
float32 product, the factor applied after cos and sin); tested against them in Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_tables_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, factor, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + i, mask=ok, other=0.0)
    c = tl.cos(angle) * factor
    s = tl.sin(angle) * factor
    row = t.to(tl.int64) * (2 * HALF)
    for half in tl.static_range(2):  # the table repeats its frequencies: [f, f]
        tl.store(cos_ptr + row + half * HALF + i, c, mask=ok)
        tl.store(sin_ptr + row + half * HALF + i, s, mask=ok)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) contiguous, inv_freq (Dr/2,) float32 contiguous -> (cos, sin), each (B, T, Dr) float32."""
    half = inv_freq.shape[0]
    shape = (*positions.shape, 2 * half)
    cos = torch.empty(shape, device=positions.device, dtype=torch.float32)
    sin = torch.empty(shape, device=positions.device, dtype=torch.float32)
    _rope_tables_kernel[(positions.numel(),)](
        positions,
        inv_freq,
        cos,
        sin,
        float(factor),
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1,
    )
    return cos, sin
