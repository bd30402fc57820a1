"""The quantized GEMMs for many rows (`ember.quant.triton_gemm`), on CPU: the kernels themselves in Triton's
interpreter against float math on the dequantized weights, and their sm90 compilation. The GPU runs them
against the same float math in `benchmarks/gpu_gemm.py`."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ember.quant.kernels import int4_mma_dequantize, int4_mma_scales, int4_mma_tile
from ember.quant.linear import pack_nibbles, quantize_int4_grouped, quantize_int8_per_channel
from tests.conftest import compile_for_sm90, needs_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_interpreter
@needs_triton
@pytest.mark.parametrize("M,N,K", [(9, 48, 256), (33, 160, 320), (130, 96, 192)])
def test_the_int8_gemm_matches_float_math_in_the_interpreter(M, N, K):
    """Rows and columns past a tile's end (M, N not multiples of the blocks), K not a multiple of BLOCK_K
    (its masked last step), and the per-channel scale applied to the float32 sum."""
    from ember.quant import triton_gemm

    g = torch.Generator().manual_seed(M)
    q, s = quantize_int8_per_channel(torch.randn(N, K, generator=g))
    s = s.to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    want = x.double() @ (q.double() * s.double()[:, None]).T
    for config in (
        None,  # `blocks`: the interpreter counts one multiprocessor
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1},
    ):
        got = triton_gemm.int8_gemm(x, q, s, config)
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2  # bf16 output (the interpreter truncates to bf16)
    assert torch.equal(triton_gemm.int8_gemm(x * 0, q, s), x.new_zeros(M, N))


@needs_interpreter
@needs_triton
@pytest.mark.parametrize("M,group", [(9, 64), (130, 128)])
def test_the_int4_gemm_decodes_the_mma_layout_in_the_interpreter(M, group):
    """The tensor-core GEMV's fragment-ordered words read as two row halves per 16-row tile: 3 tiles in
    blocks of 2 (the last block half past the end), groups of one and two K steps."""
    from ember.quant import triton_gemm

    g = torch.Generator().manual_seed(M)
    N, K = 48, 512
    codes, scales, mins = quantize_int4_grouped(torch.randn(N, K, generator=g), group)
    words, sz = int4_mma_tile(pack_nibbles(codes)), int4_mma_scales(scales, mins)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    dense = int4_mma_dequantize(words, sz, group).to(torch.bfloat16)  # the weights dequantize + matmul uses
    want = x.double() @ dense.double().T
    for config in (None, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}):
        got = triton_gemm.int4_mma_gemm(x, words, sz, group, config)
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2
    # a weight decoded in the wrong place shows: row tile 1 alone changed changes only its 16 columns
    words2 = words.clone()
    words2[16:32] = int4_mma_tile(pack_nibbles(15 - codes[16:32]))
    got2 = triton_gemm.int4_mma_gemm(x, words2, sz, group)
    changed = (got2 != triton_gemm.int4_mma_gemm(x, words, sz, group)).any(0)
    assert changed[16:32].all() and not changed[:16].any() and not changed[32:].any()


def test_the_int8_tiles_keep_multiprocessors_busy():
    from ember.quant.triton_gemm import blocks

    # H200 (132 multiprocessors), Llama-3-8B: the best or within 5% in `benchmarks/gpu_gemm.py --sweep`
    assert blocks(16, 6144, 132)["BLOCK_N"] == 64  # 48 tiles of 128 columns: too few
    assert blocks(16, 28672, 132) == {
        "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4,
    }  # fmt: skip
    assert blocks(2048, 6144, 132) == {
        "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3,
    }  # fmt: skip
    assert blocks(9, 64, 132)["BLOCK_M"] == 16 and blocks(5000, 64, 132)["BLOCK_M"] == 128


_COMPILE_FOR_SM90 = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.quant import triton_gemm

attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
target = GPUTarget("cuda", 90, 32)
sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
consts = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "EVEN_K": True, "EMULATE": False}
src = ASTSource(triton_gemm._int8_gemm_kernel, sig | {k: "constexpr" for k in consts}, consts, attrs=attrs)
try:
    int8 = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
except RuntimeError as e:  # a Triton build without its CUDA toolchain
    print(json.dumps({"skip": str(e)}))
    raise SystemExit
sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "y_ptr": "*bf16", "M": "i32", "N": "i32"}
consts = {"K": 4096, "GROUP": 128, "BLOCK_M": 128, "BLOCK_N": 128, "EMULATE": False}
src = ASTSource(triton_gemm._int4_mma_gemm_kernel, sig | {k: "constexpr" for k in consts}, consts, attrs=attrs)
int4 = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
print(json.dumps({"int8": int8.asm["ptx"], "int4": int4.asm["ptx"]}))
"""


@needs_triton
def test_the_gemms_compile_for_hopper_onto_wgmma():
    """sm90: both multiply with wgmma, and the int4 kernel hands its decoded weights to it from registers
    (its first operand; the second comes from shared memory), so they never go through shared memory."""
    import re

    result = compile_for_sm90(_COMPILE_FOR_SM90)
    assert "wgmma.mma_async" in result["int8"]
    # wgmma.mma_async...bf16.bf16 {accumulators}, {A registers}, B descriptor, ...
    with_registers = re.findall(r"wgmma\.mma_async\.\S+\s+\{[^}]*\},\s*\{", result["int4"])
    assert with_registers and len(with_registers) == result["int4"].count("wgmma.mma_async")
