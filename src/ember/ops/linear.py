"""`Linear`: nn.Linear whose one-row forward on a CUDA GPU runs Ember's Triton GEMV instead of cuBLAS.

Decoding one stream multiplies each weight matrix by a single activation row, which is bound by reading the
weights. On an H200 the Triton kernel (`ember.quant.triton_kernels.float_gemv`) reads Llama-3-8B's
projections 5-40% faster than cuBLAS's bf16 GEMV (`benchmarks/gpu_gemv.py`, BENCHMARKS.md). Everything else
(several rows, CPU, float32) is plain `F.linear`. Parameters and state dict are nn.Linear's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.quant import kernels

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in _GEMV_DTYPES and x.numel() == x.shape[-1] and kernels.HAS_TRITON:
            y = kernels.float_linear(x.reshape(1, -1), self.weight).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
