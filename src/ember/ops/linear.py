"""`Linear`, an nn.Linear with Ember's one-row GEMV on CUDA, and `silu_gate_up`, SwiGLU's gate/up projection
and activation as one kernel when decoding.

Decoding one stream multiplies each weight matrix by a single activation row, which is bound by reading the
weights. On an H200 the Triton kernel (`ember.quant.triton_kernels`) reads Llama-3-8B's projections 5-40%
faster than cuBLAS's bf16 GEMV (`benchmarks/gpu_gemv.py`, BENCHMARKS.md). Everything else (several rows,
CPU, float32) is plain `F.linear`. Parameters and state dict are nn.Linear's.

A decode step also ran silu(gate) * up as its own kernel between the gate/up and down GEMVs (~1.5 us and a
launch per layer); `silu_gate_up` has the GEMV read each gate row with its up row and store the product, in
the same time as the plain GEMV (`benchmarks/gpu_decode_step.py`). The layer's RMSNorm and residual add were
folded into the Triton GEMVs too, and measured slower (BENCHMARKS.md): they are one kernel of their own between
the GEMVs (`ember.ops.norm.add_rms_norm`), except where an int8 layer folds them into the CUDA C++ GEMV's
variants (`ember.models.decoder.DecoderLayer.folds`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.quant import kernels

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def one_row_on_cuda(x: torch.Tensor) -> bool:
    """Whether x is one bf16/fp16 activation row on CUDA with Triton present: what Ember's decode kernels serve."""
    return x.is_cuda and x.dtype in _GEMV_DTYPES and x.numel() == x.shape[-1] and kernels.HAS_TRITON


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row_on_cuda(x):
            y = kernels.float_linear(x.reshape(1, -1), self.weight).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, per-row scales or None) for `ember::silu_gate_up`, or None when it cannot run this module."""
        return (self.weight, None) if self.bias is None else None


def project(module: nn.Module, x: torch.Tensor, split: bool = False) -> torch.Tensor | kernels.SplitSum:
    """module(x); with `split`, the module's `split_forward` where it has one, which may leave a GEMV's partial
    sums for the caller's consumer to add (`kernels.SplitSum`, `ember.ops.norm.RMSNorm.add_forward`)."""
    if split and hasattr(module, "split_forward"):
        return module.split_forward(x)
    return module(x)


def silu_gate_up(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection `module` (gate rows over up rows); x (..., K) -> (..., I).

    One row on CUDA through a module with float or int8 weights and no bias (`gemv_operands`), or int4 weights
    on the CUDA C++ GEMV, runs as one GEMV that applies the activation as it stores, as does a prefill's
    int4 projection on a CPU's tile unit (both `fused_silu_gate_up`); where the module's GEMV splits K (int4,
    `split_forward`), one kernel adds its partial sums and applies the activation; anything else runs the
    projection, then the activation.
    """
    one_row = one_row_on_cuda(x)
    operands = module.gemv_operands() if one_row and hasattr(module, "gemv_operands") else None
    if operands is not None:
        return kernels.silu_gate_up(x.reshape(1, -1), *operands).reshape(*x.shape[:-1], -1)
    fused = module.fused_silu_gate_up(x) if hasattr(module, "fused_silu_gate_up") else None
    if fused is not None:
        return fused
    y = project(module, x, split=one_row)
    if isinstance(y, kernels.SplitSum):  # a split GEMV's partials: summed by the activation's kernel
        parts = y.parts.reshape(y.parts.shape[0], 1, -1)
        return kernels.silu_mul_partials(parts, x.dtype).reshape(*x.shape[:-1], -1)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
