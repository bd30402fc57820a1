"""Triton kernels of `ember.ops.argmax` on CUDA: each program finds the winner of one block of a row, then one
program per row picks among the block winners (in index order, so the first of equal maxima wins).
Tested against torch.argmax in Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.ops.launch import launch_options

BLOCK_V = 4096  # logits per program (the fastest of 1024-8192 on an H200, `benchmarks/gpu_decode_step.py`)


@triton.jit
def _first_max(x, idx, BIG: tl.constexpr):
    # (value, index) of the first NaN in x if there is one, else of the first largest value.
    first_nan = tl.min(tl.where(x != x, idx, BIG), axis=0)
    best = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    at = tl.min(tl.where(x == best, idx, BIG), axis=0)  # the first of several equal maxima
    nan = first_nan < BIG
    return tl.where(nan, float("nan"), best), tl.where(nan, first_nan, at)


@triton.jit
def _argmax_blocks_kernel(x_ptr, val_ptr, idx_ptr, V, stride, P, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # `ember.ops.launch`
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    p = tl.program_id(1)
    idx = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + b.to(tl.int64) * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    best, at = _first_max(x, tl.where(idx < V, idx, 2**31 - 1), 2**31 - 1)
    tl.store(val_ptr + b * P + p, best)
    tl.store(idx_ptr + b * P + p, at)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    rp = tl.arange(0, BLOCK_P)
    val = tl.load(val_ptr + b * P + rp, mask=rp < P, other=float("-inf"))
    at = tl.load(idx_ptr + b * P + rp, mask=rp < P, other=2**31 - 1)
    # Block winners come in index order: the first NaN block or the first of equal maxima is the answer.
    _, block = _first_max(val, tl.where(rp < P, rp, 2**31 - 1), 2**31 - 1)
    tl.store(out_ptr + b, tl.sum(tl.where(rp == block, at, 0), axis=0).to(tl.int64))


def split_argmax(logits: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    """The two-kernel argmax (Triton; also in its interpreter, which tests use)."""
    B, V = logits.shape
    P = triton.cdiv(V, block)
    val = torch.empty(B, P, device=logits.device, dtype=torch.float32)
    idx = torch.empty(B, P, device=logits.device, dtype=torch.int32)
    out = torch.empty(B, device=logits.device, dtype=torch.int64)
    pdl = launch_options(logits.device)
    _argmax_blocks_kernel[(B, P)](logits, val, idx, V, logits.stride(0), P, BLOCK=block, num_warps=8, **pdl)
    BLOCK_P = max(16, triton.next_power_of_2(P))
    _argmax_merge_kernel[(B,)](val, idx, out, P, BLOCK_P=BLOCK_P, num_warps=4, **pdl)
    return out
