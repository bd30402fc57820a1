"""The CUDA C++ int8 GEMV (`ember.quant.cuda_gemv`, built by NVRTC).

On CPU: the byte permutes the source uses to turn codes into floats, read out of the source and emulated
(`prmt`'s byte selection), give every code exactly; the float32 sums (32768 + u, the offset taken off once
at the end) stay at the bf16 output's rounding level in the kernel's order of additions. On a GPU with
NVRTC: every configuration against float math on the dequantized weights (bf16 and fp16, plain and gate/up,
several rows, widths that leave chunks and rows over), in a CUDA graph with programmatic dependent launch,
and through the int8 module's op; the folds of a pre-norm layer's residual add (bit-equal to the plain kernel's
product added as torch adds) and RMSNorm (against the unfused float ops), through their ops too.
"""

from __future__ import annotations

import re

import pytest
import torch

from ember.quant import cuda_gemv
from ember.quant.kernels import int8_linear_reference, silu_gate_up_reference
from ember.quant.linear import quantize_int8_per_channel

SOURCE = cuda_gemv.SOURCE.read_text()


def byte_perm(a: torch.Tensor, b: int, selector: int) -> torch.Tensor:
    """PTX prmt (default mode) on int64-held 32-bit words: result byte i is byte (selector >> 4i) & 7 of b:a."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [
        torch.full_like(a, (b >> (8 * i)) & 0xFF) for i in range(4)
    ]
    out = torch.zeros_like(a)
    for i in range(4):
        out |= pool[(selector >> (4 * i)) & 7] << (8 * i)
    return out


def as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def words_of(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (4n,) -> their little-endian 32-bit words, int64-held."""
    b = codes.view(torch.uint8).to(torch.int64).reshape(-1, 4)
    return b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24


def test_the_sources_byte_permutes_give_every_code():
    body = SOURCE[SOURCE.index("float dot4") :]
    calls = re.findall(r"__byte_perm\(t, (0x[0-9A-F]+)u, (0x[0-9A-F]+)\)\)", body[: body.index("return acc")])
    assert len(calls) == 4
    codes = torch.arange(-128, 128, dtype=torch.int8)
    t = words_of(codes) ^ 0x80808080  # as the kernel flips each sign bit
    values = torch.stack([as_float(byte_perm(t, int(b, 16), int(s, 16))) for b, s in calls], 1).reshape(-1)
    assert torch.equal(values.double() - 32896.0, codes.double())  # 2^15 + 128, taken off at the end


def test_offset_codes_sum_at_the_outputs_rounding():
    # The kernels' order: each thread sums (32768 + u) * x over its chunks, 16 at a time, and its
    # x; lanes and warps add their sums; 32896 * sum(x) is taken off once. Against float64, with an outlier
    # activation as real hidden states have: under half the bf16 output's rounding (2^-9 relative).
    g = torch.Generator().manual_seed(0)
    N, K, threads = 64, 14336, 128
    w = torch.randn(N, K, generator=g) * 0.02
    x = torch.randn(K, generator=g)
    x[5] = 60.0
    q, s = quantize_int8_per_channel(w)
    u = (q.to(torch.int32) + 128).float()
    chunks = (32768.0 + u).reshape(N, K // 16, 16)
    xc = x.reshape(K // 16, 16)
    acc = torch.zeros(N, threads)
    sx = torch.zeros(threads)
    for c in range(K // 16):
        t = c % threads
        for i in range(16):
            acc[:, t] = torch.addcmul(acc[:, t], chunks[:, c, i], xc[c, i].expand(N))
            sx[t] = sx[t] + xc[c, i]
    total = acc.sum(1) - 32896.0 * sx.sum()
    exact = q.double() @ x.double()
    assert float((total.double() - exact).norm() / exact.norm()) < 1e-3


def test_kernel_arguments_are_packed_as_the_driver_reads_them():
    # cuLaunchKernelEx reads argument i at params[i]: a device pointer (8 bytes) for a tensor, a C int for an
    # int, a C float for a float.
    import ctypes

    from ember.ops import cuda_rtc

    t, u = torch.zeros(3), torch.zeros(5, dtype=torch.int8)
    args = (t, 4096, u, -7, 0.08838834764831845, 2**31 - 1)
    values, params = cuda_rtc.pack(args)
    kinds = {torch.Tensor: ctypes.c_void_p, int: ctypes.c_int, float: ctypes.c_float}
    read = [
        kinds[next(k for k in kinds if isinstance(a, k))].from_address(params[i]).value
        for i, a in enumerate(args)
    ]
    assert read[:4] == [t.data_ptr(), 4096, u.data_ptr(), -7]
    assert read[4] == pytest.approx(0.08838834764831845, rel=1e-7) and read[5] == 2**31 - 1
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match="expected a tensor, an int or a float"):
            cuda_rtc.pack((t, bad))


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from ember.ops import cuda_rtc

    return cuda_rtc.available()


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU and NVRTC")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("glu", [False, True])
def test_every_config_against_float_math(dtype, glu):
    dev = torch.device("cuda")
    N, K = 100, 16 * 37  # rows and chunks left over by every block
    q, s = quantize_int8_per_channel(torch.randn(2 * N if glu else N, K, device=dev) * 0.05)
    s = s.to(dtype)
    for M in (1, 3):
        x = torch.randn(M, K, device=dev, dtype=dtype)
        x[:, 3] = 30.0
        ref = (silu_gate_up_reference if glu else int8_linear_reference)(x.float(), q, s.float())
        for config in cuda_gemv.GLU_CONFIGS if glu else cuda_gemv.CONFIGS:
            y = torch.full((M, N), float("nan"), device=dev, dtype=dtype)
            cuda_gemv.gemv(x, q, s, y, config, glu, pdl=False)
            assert rel_err(y, ref) < 1e-2, (config, M)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fold", ["resid", "norm", "norm-glu", "norm-offset"])
def test_the_folds_of_norm_and_residual_add_against_the_unfused_ops(dtype, fold):
    from ember.quant.kernels import int8_linear_add_reference, int8_norm_linear_reference

    dev = torch.device("cuda")
    glu = fold == "norm-glu"
    N, K = 100, 16 * 37
    q, s = quantize_int8_per_channel(torch.randn(2 * N if glu else N, K, device=dev) * 0.05)
    s = s.to(dtype)
    x = torch.randn(1, K, device=dev, dtype=dtype) * 3
    x[:, 3] = 60.0  # an outlier, as residual streams have
    resid = torch.randn(1, N, device=dev, dtype=dtype) * 4
    offset = 1.0 if fold == "norm-offset" else 0.0
    nw = (torch.rand(K, device=dev) + 0.5 - offset).to(dtype)
    for config in cuda_gemv.GLU_CONFIGS if glu else cuda_gemv.CONFIGS:
        y = torch.full((1, N), float("nan"), device=dev, dtype=dtype)
        if fold == "resid":
            cuda_gemv.gemv(x, q, s, y, config, False, pdl=False, resid=resid)
            product = torch.empty_like(y)
            cuda_gemv.gemv(x, q, s, product, config, False, pdl=False)
            # the product as the plain kernel rounds it, then added as torch adds
            assert torch.equal(y, resid + product), config
            assert rel_err(y, int8_linear_add_reference(x, q, s, resid)) < 5e-3, config
        else:
            cuda_gemv.gemv(x, q, s, y, config, glu, pdl=False, norm=(nw, 1e-5, offset))
            want = int8_norm_linear_reference(x.float(), q, s.float(), nw.float(), 1e-5, offset, glu)
            assert rel_err(y, want) < 1e-2, config


@needs_cuda
def test_the_folds_through_the_ops_and_their_tuner():
    from ember.quant import kernels, tuning

    dev = torch.device("cuda")
    N, K = 512, 1024
    q, s = quantize_int8_per_channel(torch.randn(2 * N, K, device=dev) * 0.05)
    s = s.to(torch.bfloat16)
    h = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(K, device=dev, dtype=torch.bfloat16) + 0.5
    tuning._picked.clear()
    y = kernels.int8_norm_linear(h, q, s, nw, 1e-6, 0.0, True)
    want = kernels.int8_norm_linear_reference(h.float(), q, s.float(), nw.float(), 1e-6, 0.0, True)
    assert y.shape == (1, N) and rel_err(y, want) < 1e-2
    resid = torch.randn(1, 2 * N, device=dev, dtype=torch.bfloat16)
    z = kernels.int8_linear_add(h, q, s, resid)
    assert rel_err(z, kernels.int8_linear_add_reference(h, q, s, resid)) < 5e-3
    assert {k[-2] for k in tuning._picked if k[0] == "gemv"} == {"norm", "resid"}  # the folded kernels ran


@needs_cuda
def test_in_a_cuda_graph_with_pdl_and_through_the_op():
    from ember.ops.launch import pdl
    from ember.quant import kernels, tuning

    dev = torch.device("cuda")
    N, K = 512, 1024
    q, s = quantize_int8_per_channel(torch.randn(N, K, device=dev) * 0.05)
    s = s.to(torch.bfloat16)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
    ref = int8_linear_reference(x.float(), q, s.float())
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_gemv.gemv(x, q, s, y, cuda_gemv.CONFIGS[0], False, pdl(dev))
        with torch.cuda.graph(graph, stream=stream):
            z = torch.add(x, 0.0)  # a kernel before, which the GEMV waits on
            cuda_gemv.gemv(z, q, s, y, cuda_gemv.CONFIGS[-1], False, pdl(dev))
    for _ in range(3):
        x.normal_()
        ref = int8_linear_reference(x.float(), q, s.float())
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, ref) < 1e-2
    tuning._picked.clear()
    out = kernels.int8_linear(x, q, s)  # the op times Triton's tiles and these configs, and runs the fastest
    assert rel_err(out, int8_linear_reference(x.float(), q, s.float())) < 1e-2


@needs_cuda
def test_built_and_launched_from_a_thread_that_made_no_cuda_call():
    # A tuner's worker or a server's engine thread has no current CUDA context until a runtime call makes
    # one; the driver calls (module load, launch) must not depend on it (seen failing on an H200 before).
    import threading

    from ember.ops import cuda_rtc

    dev = torch.device("cuda")
    q, s = quantize_int8_per_channel(torch.randn(256, 512, device=dev) * 0.05)
    s = s.to(torch.bfloat16)
    x = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)
    y = torch.full((1, 256), float("nan"), device=dev, dtype=torch.bfloat16)
    cuda_rtc._MODULES.clear()
    errors = []

    def work():
        try:
            cuda_gemv.gemv(x, q, s, y, cuda_gemv.CONFIGS[0], False, pdl=False)
        except Exception as e:  # reported in the main thread
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert rel_err(y, int8_linear_reference(x.float(), q, s.float())) < 1e-2
