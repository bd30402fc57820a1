"""The int8 decode GEMV in CUDA C++ (`csrc/int8_gemv.cu`, built by NVRTC: `ember.ops.cuda_rtc`).

Same function as the Triton int8 GEMV (`triton_kernels.fused_gemv` with int8 codes, plain or gate/up with
SwiGLU): its configurations join that op's tuner candidates, so each shape runs whichever kernel is faster
on the device in hand. A configuration is a block shape (`CONFIGS`). Two variants only this kernel has fold
a pre-norm layer's residual add (`resid`) and RMSNorm (`norm`) into the projections either side of them
(`ember.quant.kernels.int8_linear_add`, `int8_norm_linear`).

Shape legend: M rows of activations, K input features, N output features.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ember.ops import cuda_rtc

SOURCE = Path(__file__).with_name("csrc") / "int8_gemv.cu"
CHUNK = 16  # bytes of codes a thread loads at a time: K must be a multiple
# (R, U, WARPS) the tuner times: R output rows a block (2R with GLU), U chunks of each row a thread keeps in
# flight (and U more loading while it multiplies those), WARPS warps a block. Each is within 1-2% of the
# best for some Llama-3-8B projection on an H200 (BENCHMARKS.md, twenty-first session).
CONFIGS = [(4, 1, 2), (4, 1, 4), (8, 1, 4), (4, 2, 2), (2, 1, 4)]
GLU_CONFIGS = [(2, 1, 2), (4, 1, 4), (2, 1, 4), (2, 2, 2)]
_DTYPES = {torch.bfloat16: "true", torch.float16: "false"}


def _name(dtype: torch.dtype, config: tuple[int, int, int], glu: bool, fold: str = "") -> str:
    r, u, w = config
    flags = ", ".join("true" if f else "false" for f in (glu, fold == "resid", fold == "norm"))
    return f"int8_gemv<{_DTYPES[dtype]}, {r}, {u}, {w}, {flags}>"


@functools.cache
def _all_names(fold: str, plain: tuple, gated: tuple) -> tuple[str, ...]:
    """Every instance of one variant ("", "resid" or "norm") for the block shapes offered, built together on
    its first use (named once: `kernels` runs on every launch)."""
    return tuple(
        _name(dtype, c, glu, fold)
        for dtype in _DTYPES
        for glu, configs in ((False, plain), (True, gated))
        if not (glu and fold == "resid")
        for c in configs
    )


def fits(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes these operands (else the Triton kernel runs)."""
    K = x.shape[1]
    return (
        x.is_cuda
        and x.dtype in _DTYPES
        and scales.dtype == x.dtype
        and weight.dtype == torch.int8
        and K % CHUNK == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and scales.is_contiguous()
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and cuda_rtc.available()
    )


def kernels(device: torch.device, fold: str = "") -> dict | None:
    """The built kernels of a variant for `device`, or None where they cannot be built (logged once)."""
    # The block shapes as they are now: a benchmark may offer others (`gpu_step_ab.py --set`).
    names = _all_names(fold, tuple(CONFIGS), tuple(GLU_CONFIGS))
    return cuda_rtc.load_or_none(SOURCE, list(names), device, "CUDA int8 GEMV")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    y: torch.Tensor,
    config: tuple[int, int, int],
    glu: bool,
    pdl: bool,
    resid: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, float] | None = None,
) -> None:
    """y (M, N) = x (M, K) @ (weight * scales).T, or silu(gate) * up with glu (N = weight rows / 2). resid
    (M, N), contiguous in x's dtype: y = resid + that (not with glu). norm = (weight (K,) in x's dtype, eps,
    offset): x is taken as h and the product is of RMSNorm(h) (`kernels.int8_norm_linear_reference`)."""
    fold = "resid" if resid is not None else "norm" if norm is not None else ""
    fns = kernels(x.device, fold)
    if fns is None:
        raise cuda_rtc.CudaError("the CUDA int8 GEMV is not built")
    M, K = x.shape
    N = y.shape[1]
    r, _, warps = config
    norm_weight, eps, offset = norm if norm is not None else (x, 0.0, 0.0)
    args = (
        x,
        weight,
        scales,
        y,
        N,
        K,
        M,
        x if resid is None else resid,
        norm_weight,
        float(eps),
        float(offset),
    )
    cuda_rtc.launch(fns[_name(x.dtype, config, glu, fold)], -(-N // r) * M, warps * 32, args, x.device, pdl)
