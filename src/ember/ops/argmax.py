"""`argmax` over the vocabulary: the greedy token of each row of logits, as torch.argmax picks it.

torch.argmax reduces one row of 128256 logits in one thread block on CUDA (27 us on an H200, 0.6% of a
Llama-3-8B bf16 decode step and more of a quantized one). On CUDA, for long rows, two Triton kernels split
the row over many programs and then reduce their winners (`benchmarks/gpu_decode_step.py` times both).
On a CPU, in an eager step, Ember's C++ kernel (`ember_cpu::argmax_rows`: two vector passes, ~5x aten's
reduction). Elsewhere, and for short rows, it is torch.argmax. Same answer every way: the first index of the
largest value, a NaN counting as larger than everything (so the first NaN, if any).

Shape legend: B rows, V vocabulary.
"""

from __future__ import annotations

import torch

from ember.ops import cpu_ext
from ember.quant.kernels import HAS_TRITON

MIN_SPLIT = 8192  # shorter rows: torch.argmax's one block is as fast as two launches


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) int64, the first index of each row's largest value (a NaN counts as largest)."""
    rows = logits.dim() == 2 and logits.shape[-1] > 0 and logits.stride(-1) == 1
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ext.eager_inference()
    if rows and cpu and cpu_ext.available():
        return torch.ops.ember_cpu.argmax_rows(logits)
    if not (HAS_TRITON and logits.is_cuda and logits.shape[-1] >= MIN_SPLIT and logits.stride(-1) == 1):
        return argmax_reference(logits)
    from ember.ops.triton_argmax import split_argmax

    return split_argmax(logits)
