"""RMSNorm and `ember::add_rms_norm`: the Triton kernel in Triton's interpreter against the plain ops, and the
pre-norm decoder's fused residual adds against the layer-by-layer form."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ember.ops import cpu_ext
from ember.ops.norm import RMSNorm, add_rms_norm_reference, cpu_kernel, rms_norm_reference

# The Triton kernel on CPU tensors in Triton's interpreter (a GPU run of the suite sets TRITON_INTERPRET=0; the
# compiled kernel's tests are the CUDA ones of tests/quant/test_cuda_int4.py).
in_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in Triton's interpreter (TRITON_INTERPRET=1)",
)


def test_rms_norm_reference_is_hugging_faces_formula():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    xf = x.float()
    normed = (xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).bfloat16()
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6, 0.0), w * normed, atol=0, rtol=1e-2)
    gemma = (xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w.float())).bfloat16()
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6, 1.0), gemma, atol=0, rtol=1e-2)


def test_add_forward_returns_the_sum_and_its_norm():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g))
    x, d = torch.randn(2, 1, 32, generator=g), torch.randn(2, 1, 32, generator=g)
    h, out = norm.add_forward(x, d)
    torch.testing.assert_close(h, x + d, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(x + d), atol=0, rtol=0)


@pytest.mark.skipif(not cpu_ext.available(), reason="needs Ember's C++ CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, offset", [((1, 1, 576), 0.0), ((3, 5, 96), 1.0), ((2, 37), 0.0)])
def test_the_cpu_kernels_of_an_eager_norm_match_the_plain_ops(dtype, shape, offset):
    # Eager inference on a CPU runs `ember_cpu::rms_norm` / `add_rms_norm`: the plain ops' values, but for the
    # sum of squares added in another order (the factor may differ in its last float32 bit).
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    d = torch.randn(shape, generator=g).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g) * 0.5 + 1)
    with torch.inference_mode():
        assert cpu_kernel(x, norm.weight)
        h, out = norm.add_forward(x, d)
        alone = norm(x)
        assert torch.equal(alone, torch.ops.ember_cpu.rms_norm(x, norm.weight, 1e-6, offset))
    want_h, want = add_rms_norm_reference(x, d, norm.weight.detach(), 1e-6, offset)
    assert h.dtype == out.dtype == alone.dtype == dtype and torch.equal(h, want_h)
    step = {torch.float32: 4e-7, torch.bfloat16: 2.0**-7}[dtype]  # one rounding step of the result at most
    torch.testing.assert_close(out, want, atol=0, rtol=step)
    torch.testing.assert_close(
        alone, rms_norm_reference(x, norm.weight.detach(), 1e-6, offset), atol=0, rtol=step
    )


def test_a_norm_outside_eager_cpu_inference_keeps_the_plain_ops():
    x, w = torch.randn(1, 8), torch.ones(8)
    assert not cpu_kernel(x, w)  # autograd on: no kernel of its own
    with torch.inference_mode():
        assert not cpu_kernel(x.half(), w.half())  # float16: not a dtype of the kernel
        assert not cpu_kernel(x, w.bfloat16())  # mixed dtypes


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,offset", [(96, 0.0), (128, 1.0)])  # 96: the row is padded to 128 lanes
def test_triton_add_rms_norm_matches_the_plain_ops_in_interpreter(dtype, E, offset):
    from ember.ops import triton_norm

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, E, generator=g) * 4).to(dtype)
    d = torch.randn(3, E, generator=g).to(dtype)
    w = (torch.randn(E, generator=g) * 0.5 + 1).to(dtype)
    h, out = triton_norm.add_rms_norm(x, d, w, 1e-6, offset)
    want_h, _ = add_rms_norm_reference(x, d, w, 1e-6, offset)
    assert h.dtype == out.dtype == dtype
    # fp16: h is the float32 sum rounded once, as torch rounds it. The interpreter truncates float32 to
    # bfloat16 (a GPU rounds to nearest), so there bf16 may be one step off.
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(h.float(), want_h.float(), atol=0, rtol=step if dtype == torch.bfloat16 else 0)
    # The norm of the kernel's own h: the statistics may differ in the last float32 bits (summation order),
    # so a value near a rounding boundary may round the other way; bf16 rounds twice (the normalised row,
    # then its product with the weight), each time truncated by the interpreter.
    want = rms_norm_reference(h, w, 1e-6, offset)
    torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=2 * step)


def test_add_forward_adds_split_partial_sums_as_the_sum_pass_would():
    from ember.quant.kernels import SplitSum

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(32, 1e-5).bfloat16()
    x = torch.randn(1, 1, 32, generator=g).bfloat16()
    parts = torch.randn(3, 1, 1, 32, generator=g)  # float32 partials of a projection split in 3 runs of K
    delta = ((parts[0] + parts[1]) + parts[2]).bfloat16()  # the sum pass: in order, in float32, rounded once
    h, out = norm.add_forward(x, SplitSum(parts))
    want_h, want = norm.add_forward(x, delta)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@in_interpreter
def test_triton_add_rms_norm_adds_split_partial_sums_in_interpreter():
    from ember.ops import triton_norm

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 96, generator=g) * 4).to(torch.float16)
    parts = torch.randn(4, 2, 96, generator=g)
    w = (torch.randn(96, generator=g) * 0.5 + 1).to(torch.float16)
    h, out = triton_norm.add_rms_norm(x, parts, w, 1e-6, 0.0)
    delta = (((parts[0] + parts[1]) + parts[2]) + parts[3]).to(torch.float16)
    want_h, _ = add_rms_norm_reference(x, delta, w, 1e-6, 0.0)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)  # fp16: rounded once, as torch rounds it
    torch.testing.assert_close(out.float(), rms_norm_reference(h, w, 1e-6, 0.0).float(), atol=0, rtol=2**-9)


@in_interpreter
@pytest.mark.parametrize("E", [128, 192])  # 192: padded to 256 lanes, whose blocks round to nothing
def test_triton_add_rms_norm_rounds_its_row_as_the_int4_gemvs_read_it_in_interpreter(E):
    from ember.ops import triton_norm
    from ember.quant.cuda_int4 import round_row, rounded_bytes

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, E, generator=g).bfloat16()
    d = torch.randn(1, E, generator=g).bfloat16()
    w = (torch.randn(E, generator=g) * 0.5 + 1).bfloat16()
    x[0, 64:128] = d[0, 64:128] = 0.0  # a step of zeros: its blocks' scales 0, codes 0
    x[0, 40] = 50.0  # an outlier in its block (k 8..15, 24..31, 40..47, 56..63)
    rounded = torch.full((rounded_bytes(E),), 255, dtype=torch.uint8)
    h, out = triton_norm.add_rms_norm(x, d, w, 1e-6, 0.0, rounded=rounded)
    plain_h, plain_out = triton_norm.add_rms_norm(x, d, w, 1e-6, 0.0)
    assert torch.equal(h, plain_h) and torch.equal(out, plain_out)
    assert torch.equal(rounded, round_row(out)), (rounded[:E] != round_row(out)[:E]).nonzero()


def test_the_rounded_norm_op_is_the_norm_and_its_row_rounded():
    from ember.ops.norm import add_rms_norm_rounded
    from ember.quant.cuda_int4 import round_row

    g = torch.Generator().manual_seed(5)
    x, d = torch.randn(1, 1, 128, generator=g).bfloat16(), torch.randn(1, 1, 128, generator=g).bfloat16()
    w = torch.rand(128, generator=g).bfloat16() + 0.5
    h, out, r = add_rms_norm_rounded(x, d, w, 1e-6, 0.0)
    want_h, want = add_rms_norm_reference(x, d, w, 1e-6, 0.0)
    assert torch.equal(h, want_h) and torch.equal(out, want) and torch.equal(r, round_row(want))
    checks = torch.library.opcheck(add_rms_norm_rounded, (x, d, w, 1e-6, 0.0))
    assert all(v == "SUCCESS" for v in checks.values())
