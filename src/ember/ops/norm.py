"""RMSNorm, as Hugging Face's models compute and round it: the decoder's module, and the function that the
fused GEMV's plain-torch twin shares with it."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """`weight * round(x / rms(x))` in float32 math, or with an offset (Gemma: the stored weight w scales by
    offset + w) `round(x / rms(x) * (offset + w))`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma: the stored weight w scales by (1 + w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)
