"""The CUDA C++ int4 tensor-core GEMV (`ember.quant.cuda_int4`, built by NVRTC).

Its layout and fragment arithmetic are the Triton tensor-core GEMV's, checked on CPU in test_quant_mma.py.
On a GPU with NVRTC: every block shape (LEAN ones included) against float math on the dequantized weights,
whole rows and split into runs of K (float32 partials), 1 to 8 activation rows, groups of 64 to 256, widths
that leave tiles over by every block; gate/up with SwiGLU against the unfused ops; in a CUDA graph with
programmatic dependent launch; through the tensor-core ops with the kernel offered to their tuner, and
through an int4 module's fused gate/up. One row runs the A8 kernels (activations rounded to int8 in blocks of
32), checked against `cuda_int4.a8_reference` as well; the FOLD kernels that carry a norm across two GEMVs
against their ops' twins, and in a decode step. On CPU: the shapes offered, the gate/up op's plain-torch path,
and the A8 reference's blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.quant import cuda_int4
from ember.quant.kernels import int4_mma_scales, int4_mma_tile, split_k_partials
from ember.quant.linear import pack_nibbles, quantize_int4_grouped


def test_no_block_shape_gives_a_tiles_warp_no_group_and_lean_ones_stop_where_they_spill():
    for group in (64, 128, 256):
        for groups, split in ((32, 16), (32, 1), (112, 16), (8, 4), (4, 1), (1, 1)):
            for glu in (False, True):
                shapes = cuda_int4.configs(group, groups, split, glu, lean=True, asynchronous=True)
                assert shapes and all(kw <= groups // split for _, kw, *_ in shapes)
                assert any(c[3] for c in shapes) == (group // 64 <= cuda_int4.LEAN_MAX_STEPS)
                assert not any(c[3] and c[4] for c in shapes)  # LEAN's registers or ASYNC's shared memory
                for c in shapes:  # an ASYNC ring within the shared memory a block may declare
                    assert cuda_int4._shared_bytes(group // 64, c, glu) <= cuda_int4.ASYNC_SHARED
                if cuda_int4.rounds(1, split, groups * group):  # room for the rounded row as well
                    a8 = cuda_int4.configs(group, groups, split, glu, lean=True, asynchronous=True, a8=True)
                    room = cuda_int4.ASYNC_SHARED - cuda_int4.rounded_bytes(groups * group)
                    assert a8 and all(cuda_int4._shared_bytes(group // 64, c, glu) <= room for c in a8)
                offered = cuda_int4.configs(group, groups, split, glu)
                built = group // 64 <= cuda_int4.LEAN_MAX_STEPS
                assert offered and any(c[3] for c in offered) == (cuda_int4.LEAN_OFFERED and built)
                assert cuda_int4.ASYNC_OFFERED or not any(c[4] for c in offered)


def test_the_a8_reference_rounds_each_block_of_32_on_its_own_scale():
    # Each block's activations are multiples of its own power of 2, up to 127 of them: exact in int8 on the
    # block's scale, and on no other grouping's (a block's scale is then that of a block with larger ones).
    N, K, group = 32, 512, 128
    words, sz, w = quantized(N, K, group, torch.device("cpu"))
    codes = torch.randint(-127, 128, (1, K // 64, 4, 2, 8))  # (row, step, lane t, block i, 8): k 16 t + 8 i
    codes[..., 0, :, 0] = 127
    unit = 2.0 ** -torch.arange(K // 32).reshape(1, K // 64, 1, 2, 1)  # a power of 2 a block
    x = (codes * unit).reshape(1, K).to(torch.bfloat16)
    assert torch.equal(x.float(), (codes * unit).reshape(1, K))
    exact = x.float() @ w.T
    assert rel_err(cuda_int4.a8_reference(x, words, sz, group), exact) < 1e-6
    contiguous = x.float().reshape(1, K // 32, 32)  # blocks of 32 consecutive k: not the kernel's
    scale = contiguous.abs().amax(-1, keepdim=True) / 127.0
    rounded = (torch.round(contiguous / scale) * scale).reshape(1, K)
    assert rel_err(rounded @ w.T, exact) > 1e-4
    # Random activations: the rounding's error is under a percent of the product.
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    err = rel_err(cuda_int4.a8_reference(x, words, sz, group), x.float() @ w.T)
    assert 1e-4 < err < 1e-2


def test_round_row_divides_once_as_the_norm_kernel_does():
    # 127 / amax and amax / 127 each rounded once (IEEE division: the float64 quotient rounded to float32 is
    # the same), on every device. Here 127 * (1 / amax), torch's `127.0 / t`, rounds v * inv up to 1.5 -> 2.
    a, v = 0.8078194856643677, 0.00954117439687252
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = a, v
    r = cuda_int4.round_row(x)
    scale = r[64:68].view(torch.float32)
    assert scale.item() == torch.tensor(a, dtype=torch.float64).div(127).float().item()
    inv = torch.tensor(127, dtype=torch.float64).div(torch.tensor(a).double()).float()
    assert torch.round(x[0, 1] * inv).item() == 1 != torch.round(x[0, 1] * (127.0 / x[0, :1])).item()
    assert cuda_int4.unround_row(r, 64)[0, 1] == scale


def test_the_rounded_row_op_off_cuda_is_the_float_math_of_the_rounded_row():
    from ember.quant import kernels

    N, K, group = 32, 256, 64
    words, sz, w = quantized(2 * N, K, group, torch.device("cpu"))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    r = cuda_int4.round_row(x)
    xr = cuda_int4.unround_row(r, K)
    assert 0 < rel_err(xr, x) < 1e-2
    y = kernels.int4_mma_rounded_linear(r, words, sz, group, False)
    assert y.shape == (1, 2 * N) and y.dtype == torch.bfloat16
    assert rel_err(y, xr @ w.T) < 5e-3
    gate, up = (xr @ w.T).chunk(2, dim=-1)
    assert rel_err(kernels.int4_mma_rounded_linear(r, words, sz, group, True), F.silu(gate) * up) < 2e-2
    for glu in (False, True):
        checks = torch.library.opcheck(kernels.int4_mma_rounded_linear, (r, words, sz, group, glu))
        assert all(v == "SUCCESS" for v in checks.values())


def test_the_gate_up_op_off_cuda_is_swiglu_of_the_dequantized_weights():
    from ember.quant import kernels

    N, K, group = 32, 256, 64
    words, sz, w = quantized(2 * N, K, group, torch.device("cpu"))
    x = torch.randn(3, K, dtype=torch.bfloat16)
    gate, up = (x.float() @ w.T).chunk(2, dim=-1)
    got = kernels.int4_mma_silu_gate_up(x, words, sz, group)
    assert got.shape == (3, N) and got.dtype == torch.bfloat16
    assert rel_err(got, torch.nn.functional.silu(gate) * up) < 2e-2
    fake = torch.library.opcheck(kernels.int4_mma_silu_gate_up, (x, words, sz, group))
    assert all(v == "SUCCESS" for v in fake.values())


def _cuda_ready() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return False
    from ember.ops import cuda_rtc

    return cuda_rtc.available()


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs an sm80+ CUDA GPU and NVRTC")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def quantized(N: int, K: int, group: int, dev: torch.device):
    """The layout's words and factors of random weights, and those weights as the kernel reads them (float32)."""
    codes, sc, mn = quantize_int4_grouped(torch.randn(N, K, device=dev) * 0.05, group)
    sz = int4_mma_scales(sc, mn)
    s = (sz & -65536).view(torch.float32)  # the bf16 factors as rounded (high half: scale, low: min)
    z = (sz << 16).view(torch.float32)
    w = (codes.float().reshape(N, -1, group) * s[..., None] + z[..., None]).reshape(N, K)
    return int4_mma_tile(pack_nibbles(codes)), sz, w


@needs_cuda
@pytest.mark.parametrize("a8", [False, True], ids=["bf16", "a8"])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_every_block_shape_and_split_against_float_math(group, a8, monkeypatch):
    monkeypatch.setattr(cuda_int4, "A8", a8)  # A8: one row's activations rounded to int8
    dev = torch.device("cuda")
    N, K = 16 * 13, group * 24  # 13 tiles: left over by every block of 2, 4 and 8 tiles
    words, sz, w = quantized(N, K, group, dev)
    for M in (1, 3, 8):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        x[:, 5] = 30.0
        ref = x.float() @ w.T
        for split in (1, 2, 3, 8):
            rounds = cuda_int4.rounds(M, split, K)
            assert rounds == (a8 and M == 1 and split == 1)
            shapes = cuda_int4.configs(group, K // group, split, lean=True, asynchronous=True, a8=rounds)
            for config in shapes:
                if split == 1:
                    y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                    cuda_int4.gemv(x, words, sz, y, group, config, split, pdl=False)
                    if rounds:  # the activations rounded to int8: the outlier's block loses the most
                        assert rel_err(y, cuda_int4.a8_reference(x, words, sz, group)) < 3e-3, config
                    assert rel_err(y, ref) < (2e-2 if rounds else 1e-2), (config, M)
                else:
                    y = torch.full((split, M, N), float("nan"), device=dev)
                    cuda_int4.gemv(x, words, sz, y, group, config, split, pdl=False)
                    assert rel_err(y, split_k_partials(x, w, split)) < 1e-3, (config, M, split)


@needs_cuda
def test_in_a_cuda_graph_with_pdl_and_through_the_op(monkeypatch):
    from ember.ops.launch import pdl
    from ember.quant import kernels, tuning

    dev = torch.device("cuda")
    N, K, group = 512, 2048, 128
    words, sz, w = quantized(N, K, group, dev)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_int4.gemv(x, words, sz, y, group, cuda_int4.CONFIGS[0], 1, pdl(dev))
        with torch.cuda.graph(graph, stream=stream):
            z = torch.add(x, 0.0)  # a kernel before, which the GEMV waits on
            cuda_int4.gemv(z, words, sz, y, group, cuda_int4.CONFIGS[-1], 1, pdl(dev))
    for _ in range(3):
        x.normal_()
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, x.float() @ w.T) < 1e-2
    monkeypatch.setattr(cuda_int4, "OFFERED", True)
    tuning._picked.clear()
    # The ops time Triton's launches and these block shapes, and run the fastest.
    assert rel_err(kernels.int4_mma_linear(x, words, sz, group), x.float() @ w.T) < 1e-2
    parts = kernels.int4_mma_partials(x, words, sz, group, 4)
    assert rel_err(parts, split_k_partials(x, w, 4)) < 1e-3
    tuning._picked.clear()


@needs_cuda
@pytest.mark.parametrize("a8", [False, True], ids=["bf16", "a8"])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_gate_up_with_swiglu_against_the_unfused_ops(group, a8, monkeypatch):
    monkeypatch.setattr(cuda_int4, "A8", a8)
    from ember.quant import kernels

    dev = torch.device("cuda")
    N, K = 16 * 5, group * 16  # 5 tiles of outputs: left over by blocks of 2
    words, sz, w = quantized(2 * N, K, group, dev)
    for M in (1, 3, 8):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        gate, up = (x @ w.T.to(torch.bfloat16)).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        rounds = cuda_int4.rounds(M, 1, K)
        if rounds:  # SwiGLU of the A8 sums, each rounded as the unfused ops round
            gate, up = cuda_int4.a8_reference(x, words, sz, group).to(torch.bfloat16).chunk(2, dim=-1)
            rounded = torch.nn.functional.silu(gate) * up
        shapes = cuda_int4.configs(group, K // group, 1, glu=True, lean=True, asynchronous=True, a8=rounds)
        for config in shapes:
            y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            cuda_int4.gemv(x, words, sz, y, group, config, 1, pdl=False, glu=True)
            assert rel_err(y, ref) < 2e-2, (config, M)
            if rounds:
                assert rel_err(y, rounded) < 6e-3, config
        got = kernels.int4_mma_silu_gate_up(x, words, sz, group)  # the op: tuned, then one launch
        assert rel_err(got, kernels.int4_mma_silu_gate_up_reference(x, words, sz, group)) < 2e-2


@needs_cuda
def test_an_int4_mlp_decodes_as_its_float_math(monkeypatch):
    # A gate/up projection of the int4 module with the kernel over whole rows: SwiGLU in the GEMV's store.
    from ember.ops.linear import silu_gate_up
    from ember.quant.linear import Int4WeightOnlyLinear

    monkeypatch.setattr(cuda_int4, "OFFERED", True)
    monkeypatch.setattr(cuda_int4, "WHOLE_ROWS", True)
    dev = torch.device("cuda")
    lin = torch.nn.Linear(1024, 2 * 256, bias=False, device=dev, dtype=torch.bfloat16)
    module = Int4WeightOnlyLinear.from_float(lin, group_size=128).to(dev)
    module.prepare()
    x = torch.randn(1, 1, 1024, device=dev, dtype=torch.bfloat16)
    fused = module.fused_silu_gate_up(x)
    assert fused is not None and fused.shape == (1, 1, 256)
    gate, up = module(x).chunk(2, dim=-1)
    assert rel_err(silu_gate_up(module, x), torch.nn.functional.silu(gate) * up) < 2e-2


@needs_cuda
@pytest.mark.parametrize("group", [64, 128, 256])
def test_rows_rounded_before_against_the_reference(group, monkeypatch):
    # The A8 kernels that read a row rounded by the kernel before them (`round_row`'s layout), plain and gate/up
    # + SwiGLU, every block shape and through the op; the row here rounded by torch.
    from ember.quant import kernels

    monkeypatch.setattr(cuda_int4, "ROUNDED_ROWS", True)
    dev = torch.device("cuda")
    N, K = 16 * 13, group * 24
    words, sz, w = quantized(N, K, group, dev)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    x[:, 5] = 30.0
    r = cuda_int4.round_row(x)
    assert cuda_int4.rounded_fits(r, words, sz, group)
    assert rel_err(cuda_int4.a8_reference(x, words, sz, group), x.float() @ w.T) < 2e-2
    for glu in (False, True):  # gate/up: 2N rows of their own
        rows = 2 * N if glu else N
        wg, szg, _ = quantized(rows, K, group, dev) if glu else (words, sz, w)
        ref = kernels.int4_mma_rounded_linear_reference(r, wg, szg, group, glu)
        for config in cuda_int4.configs(group, K // group, 1, glu=glu, lean=True, asynchronous=True):
            y = torch.full((1, N), float("nan"), device=dev, dtype=torch.bfloat16)
            cuda_int4.gemv(r, wg, szg, y, group, config, 1, pdl=False, glu=glu, rounded=True)
            assert rel_err(y, ref) < (6e-3 if glu else 3e-3), (config, glu)
        got = kernels.int4_mma_rounded_linear(r, wg, szg, group, glu)  # the op: tuned, then one launch
        assert got.shape == (1, N) and rel_err(got, ref) < (6e-3 if glu else 3e-3)


@needs_cuda
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_norm_rounds_its_row_on_the_gpu_as_torch_does(offset):
    # `ember::add_rms_norm_rounded`'s Triton kernel compiled (without FMA contraction): the same codes, scales
    # and sums as `round_row` of its own normalised row.
    from ember.ops.norm import add_rms_norm_rounded

    dev = torch.device("cuda")
    for E in (576, 4096):
        x = torch.randn(1, 1, E, device=dev, dtype=torch.bfloat16) * 3
        d = torch.randn(1, 1, E, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, device=dev) * 0.3 + 1).to(torch.bfloat16)
        x[..., 100] = 80.0
        h, out, r = add_rms_norm_rounded(x, d, w, 1e-5, offset)
        assert torch.equal(r, cuda_int4.round_row(out.reshape(1, E))), E


def decode_steps_with_and_without(flag: str, method: str, monkeypatch):
    """The tiny int4-g64 model's logits of one CUDA decode step with `cuda_int4.<flag>` off and on, and how
    many times the step called `Int4WeightOnlyLinear.<method>`, and the model's layers."""
    from ember.bench import random_model
    from ember.engine.kv_cache import StaticKVCache
    from ember.quant.linear import Int4WeightOnlyLinear

    monkeypatch.setattr(cuda_int4, "OFFERED", True)
    monkeypatch.setattr(cuda_int4, "WHOLE_ROWS", True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model("tiny", device=dev, dtype=torch.bfloat16, quantize="int4-g64")
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (1, 6), device=dev)
    calls = []
    wrapped = getattr(Int4WeightOnlyLinear, method)
    monkeypatch.setattr(
        Int4WeightOnlyLinear, method, lambda self, *a, **k: calls.append(1) or wrapped(self, *a, **k)
    )
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(cuda_int4, flag, on)
        cache = StaticKVCache(cfg, batch_size=1, max_seq_len=16, device=dev, dtype=torch.bfloat16)
        model(tokens[:, :5], torch.arange(5, device=dev)[None], cache)
        outs[on] = model(tokens[:, 5:], torch.tensor([[5]], device=dev), cache).float()
    return outs[False], outs[True], len(calls), cfg.num_layers


@needs_cuda
def test_an_int4_decode_step_with_rows_rounded_by_the_norms(monkeypatch):
    # ROUNDED_ROWS on a CUDA decode step: every layer's qkv and gate/up read their norm's rounded row, and the
    # step's logits stay within the activations' rounding of the step without it. Norms carried across the
    # GEMVs (FOLD_NORMS) leave no norm kernel to round a row: off here.
    monkeypatch.setattr(cuda_int4, "FOLD_NORMS", False)
    off, on, calls, layers = decode_steps_with_and_without("ROUNDED_ROWS", "rounded_forward", monkeypatch)
    assert calls == 2 * layers
    assert 0 < rel_err(on, off) < 3e-2


@needs_cuda
@pytest.mark.parametrize("group", [64, 128, 256])
def test_the_carried_norm_kernels_against_their_twins(group, monkeypatch):
    # FOLD 1 (a projection into the residual stream handing on the next norm's row) and FOLD 2 (the projection
    # after that norm, plain and gate/up + SwiGLU), every block shape, against the ops' twins.
    from ember.quant import kernels, tuning

    monkeypatch.setattr(cuda_int4, "FOLD_NORMS", True)
    dev = torch.device("cuda")
    torch.manual_seed(group)
    E, inner = 1024, 1536
    o_words, o_sz, _ = quantized(E, E, group, dev)
    gu_words, gu_sz, _ = quantized(2 * inner, E, group, dev)
    x = torch.randn(1, E, device=dev).bfloat16()
    resid = (torch.randn(1, E, device=dev) * 4).bfloat16()
    weight = (torch.rand(E, device=dev) + 0.5).bfloat16()
    for offset in (0.0, 1.0):
        want_h, want_hw, want_sq = kernels.int4_mma_linear_add_norm_reference(
            x, o_words, o_sz, group, resid, weight, offset
        )
        for config in cuda_int4.configs(group, E // group, 1):
            monkeypatch.setattr(tuning, "PINNED", {("int4_fold_before", E, E, group): config})
            h, hw, sq = cuda_int4.linear_add_norm(x, o_words, o_sz, group, resid, weight, offset)
            assert rel_err(h, want_h) < 4e-3 and rel_err(hw, want_hw) < 8e-3, config  # a bf16 step at most
            assert sq.shape == want_sq.shape and rel_err(sq, want_sq) < 1e-2, config
        for glu in (False, True):
            want = kernels.int4_mma_normed_linear_reference(
                want_hw, want_sq, 1e-5, gu_words, gu_sz, group, glu
            )
            key = ("int4_fold_after", 2 * inner, E, group, glu)
            for config in cuda_int4.configs(group, E // group, 1, glu=glu):
                monkeypatch.setattr(tuning, "PINNED", {key: config})
                y = cuda_int4.normed_linear(want_hw, want_sq, 1e-5, gu_words, gu_sz, group, glu)
                assert y.shape == want.shape and rel_err(y, want) < 1e-2, (glu, config)


@needs_cuda
def test_an_int4_decode_step_with_norms_carried_across_the_gemvs(monkeypatch):
    # FOLD_NORMS on a CUDA decode step: no norm kernel but the first layer's input norm and the final one, and
    # the step's logits within the activations' rounding of the step without it.
    off, on, calls, layers = decode_steps_with_and_without("FOLD_NORMS", "linear_add_norm", monkeypatch)
    assert calls == 2 * layers - 1  # o in every layer, down into the next one
    assert 0 < rel_err(on, off) < 3e-2


@needs_cuda
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_compiled_decoding_gives_the_same_greedy_tokens_run_after_run(scheme):
    """Greedy decoding through the CUDA graph, four runs of one generator: the same tokens. The GEMVs start
    before the kernel that writes their rows ends (programmatic dependent launch), so a row read through the
    read-only cache (__ldg) could be stale: with it, runs of this test differed from the second token on (H100,
    the norms carried across the int4 GEMVs); they read by ld.global.ca now."""
    from ember.bench import random_model
    from ember.engine.generate import Generator
    from ember.engine.sampler import SamplingParams

    cuda = torch.device("cuda")
    model = random_model("llama-3.2-1b", device=cuda, dtype=torch.bfloat16, quantize=scheme)
    prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    generator = Generator(model, device=cuda, context=192, compile=True)
    runs = [[s.token_id for s in generator.generate(prompt.tolist(), params, (), None)] for _ in range(4)]
    assert all(run == runs[0] for run in runs[1:])
