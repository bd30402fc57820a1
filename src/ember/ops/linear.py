"""`Linear`, an nn.Linear with Ember's one-row GEMV on CUDA, and `project`: a layer's norm, projection,
SwiGLU activation and residual add as one kernel when decoding.

Decoding one stream multiplies each weight matrix by a single activation row, which is bound by reading the
weights. On an H200 the Triton kernel (`ember.quant.triton_kernels`) reads Llama-3-8B's projections 5-40%
faster than cuBLAS's bf16 GEMV (`benchmarks/gpu_gemv.py`, BENCHMARKS.md). Everything else (several rows,
CPU, float32) is plain `F.linear`. Parameters and state dict are nn.Linear's.

Between its GEMVs a decode step also ran an add + RMSNorm kernel before the qkv and gate/up projections and
silu(gate) * up before the down projection: three small kernels per layer, each a launch and a few
microseconds. `project` folds them into the GEMVs: the norm's sum of squares is taken in the weight loop and
its scale applied at the end (W (g x) / rms(x) is linear in 1 / rms(x)), the gate/up GEMV reads each gate
row with its up row and stores silu(gate) * up, and the output/down GEMVs add the residual as they store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.ops.norm import RMSNorm
from ember.quant import kernels

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in _GEMV_DTYPES and x.numel() == x.shape[-1] and kernels.HAS_TRITON:
            y = kernels.float_linear(x.reshape(1, -1), self.weight).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, per-row scales or None) for `ember::fused_linear`, or None when it cannot run this module."""
        return (self.weight, None) if self.bias is None else None


def project(
    module: nn.Module,
    x: torch.Tensor,
    *,
    norm: RMSNorm | None = None,
    glu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] [silu(gate) * up of] module([norm](x)); x (..., K) -> (..., N), or (..., N/2) with glu
    (the module is a fused gate/up projection, gate rows over up rows).

    One row on CUDA through a module with float or int8 weights and no bias (`gemv_operands`) is one
    fused GEMV; anything else runs the same ops one by one.
    """
    fusable = x.is_cuda and x.dtype in _GEMV_DTYPES and x.numel() == x.shape[-1] and kernels.HAS_TRITON
    operands = module.gemv_operands() if fusable and hasattr(module, "gemv_operands") else None
    if operands is None:
        y = module(x if norm is None else norm(x))
        if glu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y if residual is None else residual + y
    y = kernels.fused_linear(
        x.reshape(1, -1),
        *operands,
        None if norm is None else norm.weight,
        None if residual is None else residual.reshape(1, -1),
        0.0 if norm is None else norm.eps,
        0.0 if norm is None else float(norm.offset),
        glu,
    )
    return y.reshape(*x.shape[:-1], -1)
