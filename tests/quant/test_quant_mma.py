"""The tensor-core int4 GEMV's layout and arithmetic, on CPU.

The kernel (`ember.quant.triton_mma`) runs PTX that Triton's interpreter cannot, so its arithmetic is checked
here by emulating what each mma.m16n8k16 computes from the registers the kernel gives it, with the operand
fragments as the PTX ISA lays them out ("Matrix fragments for mma.m16n8k16 with floating point type"), and
comparing with float math on the dequantized weights. The GPU runs the kernel itself against the same float
math (`benchmarks/gpu_gemv.py --check`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ember.quant.kernels import (
    int4_mma_dequantize,
    int4_mma_fits,
    int4_mma_partials_reference,
    int4_mma_scales,
    int4_mma_tile,
    int4_mma_untile,
)
from ember.quant.linear import pack_nibbles, quantize_int4_grouped
from tests.conftest import compile_for_sm90, needs_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def quantized(N: int, K: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    codes, sc, mn = quantize_int4_grouped(w, group)
    words, sz = int4_mma_tile(pack_nibbles(codes)), int4_mma_scales(sc, mn)
    bf = sc.to(torch.bfloat16).double(), mn.to(torch.bfloat16).double()  # the factors are bf16
    dense = (codes.double().reshape(N, -1, group) * bf[0][..., None] + bf[1][..., None]).reshape(N, K)
    return codes, words, sz, dense


# Where element j of a lane's fragment sits (PTX ISA): A (16 x 16, a0..a7), B (16 x 8, b0..b3), by lane (g, q).
def a_position(g: int, q: int, j: int) -> tuple[int, int]:
    return g + 8 * ((j >> 1) & 1), 2 * q + (j & 1) + 8 * (j >> 2)


def b_position(g: int, q: int, j: int) -> tuple[int, int]:
    return 2 * q + (j & 1) + 8 * (j >> 1), g


def emulate(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """y (M, N) as `_int4_mma_kernel` computes it: its loads (addresses as in the kernel), its LOP3s, its mmas
    (exact products, float64 sums) and its per-group combination."""
    M, K = x.shape
    N = words.shape[0]
    T, S = N // 16, K // 64
    w = words.reshape(T, S, 32, 4).to(torch.int64) & 0xFFFFFFFF  # (tile, step, lane, m)
    regs = torch.stack([((w >> (4 * i)) & 0x000F000F) | 0x43004300 for i in range(4)], -1)  # A registers
    a_vals = bf16_bits_to_float(torch.stack((regs & 0xFFFF, regs >> 16), -1).reshape(T, S, 32, 4, 8))
    a_index = torch.tensor([[a_position(lane // 4, lane % 4, j) for j in range(8)] for lane in range(32)])
    A = torch.zeros(T, S, 4, 16, 16, dtype=torch.float64)
    A[:, :, :, a_index[..., 0], a_index[..., 1]] = a_vals.permute(0, 1, 3, 2, 4)  # (T, S, m, lane, j)
    # Lane (g, q) loads bf16 pairs q*8 .. q*8+7 of its step from activation row min(g, M - 1); mma m takes
    # pairs 2m and 2m + 1 as its B registers (b0 b1, b2 b3).
    xbits = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    lanes = torch.arange(32)
    rows = torch.clamp(lanes // 4, max=M - 1)
    pair = (lanes % 4)[:, None] * 8 + torch.arange(8)[None, :]  # (lane, 8) pair index within the step
    B = torch.zeros(S, 4, 16, 8, dtype=torch.float64)
    b_index = torch.tensor([[b_position(lane // 4, lane % 4, j) for j in range(4)] for lane in range(32)])
    for s in range(S):
        halves = xbits[rows[:, None], (s * 32 + pair) * 2 + 0], xbits[rows[:, None], (s * 32 + pair) * 2 + 1]
        bvals = bf16_bits_to_float(torch.stack(halves, -1).reshape(32, 4, 4))  # (lane, m, b0..b3)
        B[s][:, b_index[..., 0], b_index[..., 1]] = bvals.permute(1, 0, 2)
    C = (A @ B).sum(2)  # (T, S, 16, 8): the 4 chained mmas of each step
    X = (torch.ones(16, 16, dtype=torch.float64) @ B).sum(1)  # (S, 16, 8)
    s_fac = bf16_bits_to_float((sz.to(torch.int64) >> 16) & 0xFFFF).reshape(T, 16, -1)
    m_fac = bf16_bits_to_float(sz.to(torch.int64) & 0xFFFF).reshape(T, 16, -1)
    grp = torch.arange(S) * 64 // group
    s_st, m_st = s_fac[:, :, grp].permute(0, 2, 1), m_fac[:, :, grp].permute(0, 2, 1)  # (T, S, 16)
    acc = (s_st[..., None] * C + (m_st - 128 * s_st)[..., None] * X).sum(1)  # (T, 16 rows, 8 columns)
    return acc.permute(2, 0, 1).reshape(8, N)[:M]


@pytest.mark.parametrize(
    "N,K,group,M", [(32, 128, 64, 1), (16, 256, 128, 3), (48, 512, 256, 8), (32, 256, 64, 5)]
)
def test_the_mma_fragments_give_float_math(N, K, group, M):
    codes, words, sz, dense = quantized(N, K, group)
    x = torch.randn(M, K).to(torch.bfloat16)
    x[:, :5] *= 3e4  # large activations: the 128 + q operands' bias cancels in float32 without loss
    want = x.double() @ dense.T
    assert rel_err(emulate(x, words, sz, group), want) < 1e-9


def test_the_mma_layout_round_trips_and_its_ops_match_float_math():
    codes, words, sz, dense = quantized(64, 512, 128, seed=1)
    assert words.shape == (64, 512 // 8) and words.dtype == torch.int32
    assert torch.equal(int4_mma_untile(words), codes)
    assert torch.equal(int4_mma_dequantize(words, sz, 128).double(), dense)
    x = torch.randn(3, 512)
    assert rel_err(torch.ops.ember.int4_mma_linear(x, words, sz, 128), x.double() @ dense.T) < 1e-5
    parts = torch.ops.ember.int4_mma_partials(x, words, sz, 128, 2)
    assert parts.shape == (2, 3, 64) and parts.dtype == torch.float32
    assert rel_err(parts[0], x[:, :256].double() @ dense[:, :256].T) < 1e-5
    assert rel_err(parts.sum(0), x.double() @ dense.T) < 1e-5
    assert torch.equal(parts, int4_mma_partials_reference(x, words, sz, 128, 2))


def test_the_mma_layout_needs_tiles_steps_and_whole_step_groups():
    assert int4_mma_fits(4096, 4096, 128) and int4_mma_fits(16, 64, 64)
    assert not int4_mma_fits(4104, 4096, 128)  # rows not in tiles of 16
    assert not int4_mma_fits(4096, 4096 + 32, 32)  # K not in steps of 64
    assert not int4_mma_fits(4096, 4096, 32)  # a group of 32 is half a step


@needs_interpreter
@needs_triton
@pytest.mark.parametrize("group,M", [(64, 1), (128, 3), (256, 8)])
def test_the_mma_kernel_matches_float_math_in_the_interpreter(group, M):
    """The kernel itself (its loads, masks, K runs, rows and stores), with its mma step emulated in tensor ops
    (`triton_mma._mma_step_emulated`; Triton's interpreter runs no PTX): 3 tiles for programs of 4 and 2
    warps (warps past the last tile store nothing), K whole or split."""
    from ember.quant import triton_mma

    N, K = 48, 512
    _, words, sz, dense = quantized(N, K, group, seed=3)
    x = torch.randn(M, K).to(torch.bfloat16)
    want = x.double() @ dense.T
    for warps in (4, 2):
        blocks = {"WARPS": warps, "num_warps": warps}
        got = triton_mma.int4_mma_gemv(x, words, sz, group, blocks=blocks)
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2  # bf16 output (the interpreter truncates to bf16)
        parts = triton_mma.int4_mma_gemv(x, words, sz, group, split=2, blocks=blocks)
        assert parts.shape == (2, M, N) and parts.dtype == torch.float32
        # float32 sums of (128 + q) x, less 128 sum(x): the cancellation costs a few bits of float32
        assert rel_err(parts[0], x[:, : K // 2].double() @ dense[:, : K // 2].T) < 2e-5
        assert rel_err(parts.sum(0), want) < 2e-5
    # split into runs (the interpreter counts one multiprocessor), partials added by the sum kernel
    assert triton_mma.splits(N, K, group, triton_mma.multiprocessors(x.device)) > 1
    assert rel_err(triton_mma.int4_mma_linear(x, words, sz, group), want) < 1e-2
    assert torch.equal(triton_mma.int4_mma_gemv(x * 0, words, sz, group), x.new_zeros(M, N))


@needs_interpreter
@needs_triton
def test_the_prefill_dequantize_kernel_writes_the_layouts_weights_in_the_interpreter():
    from ember.quant import triton_mma

    # K of 4 steps of 64 (one program for all), 2 and 3 (programs of fewer steps), groups of 64 and 128
    for n, k, group in ((32, 256, 64), (16, 128, 128), (48, 192, 64)):
        _, words, sz, dense = quantized(n, k, group, seed=2)
        got = triton_mma.int4_mma_dequantize(words, sz, group, torch.float32)
        assert torch.equal(got.double(), dense), (n, k, group)


@needs_triton
def test_splits_give_each_multiprocessor_enough_warps():
    from ember.quant.triton_mma import splits

    # Llama-3-8B on an H200 (132 multiprocessors): the splits measured best or within 2% (BENCHMARKS.md).
    assert [splits(n, k, 128, 132) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]] == [
        16, 16, 4, 16,
    ]  # fmt: skip
    assert splits(128256, 4096, 128, 132) == 1  # plenty of rows
    assert splits(64, 128, 64, 132) == 2  # never more runs than groups


_COMPILE_FOR_SM90 = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.quant import triton_mma

sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "y_ptr": "*bf16", "N": "i32", "M": "i32"}
sig |= {k: "constexpr" for k in ("K", "GROUP", "WARPS", "SPLIT", "PDL", "EMULATE")}
consts = {"K": 4096, "GROUP": 128, "WARPS": 4, "SPLIT": 1, "PDL": True, "EMULATE": False}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
src = ASTSource(triton_mma._int4_mma_kernel, sig, consts, attrs=attrs)
try:
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
except RuntimeError as e:  # a Triton build without its CUDA toolchain
    print(json.dumps({"skip": str(e)}))
else:
    print(json.dumps({"ptx": kernel.asm["ptx"], "cubin": len(kernel.asm["cubin"])}))
"""


@needs_triton
def test_the_mma_kernel_compiles_for_hopper_with_no_shared_memory_in_its_loop():
    """ptxas (shipped with Triton) assembles the inline PTX for sm90, and the loop holds the mmas and no
    shared-memory shuffle (a tl.load of the factors, in a layout of its own, would put one there)."""
    import re

    result = compile_for_sm90(_COMPILE_FOR_SM90)
    ptx = result["ptx"]
    assert result["cubin"] > 0
    assert (
        ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 16
    )  # 2 steps x 4 x (codes, ones)
    first = ptx.index("mma.sync")
    label = re.findall(r"^(\$L__BB\w+):", ptx[:first], re.M)[-1]  # the loop's head
    back = [m.start() for m in re.finditer(rf"bra(\.uni)?\s+{re.escape(label)};", ptx)][-1]
    loop = ptx[ptx.rindex(label + ":", 0, first) : back]
    assert "mma.sync" in loop
    assert "st.shared" not in loop and "bar.sync" not in loop
