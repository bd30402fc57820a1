"""Quantized linears against the float linear, the custom ops against their plain-torch twins, save/load."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ember.bench import random_model
from ember.errors import EmberError
from ember.quant import QuantSpec, load_quantized, perplexity, quantize_model, save_quantized
from ember.quant.kernels import (
    int4_fold_scales,
    int4_subnormal_scales,
    int4_tile,
    int4_tiled_dequantize,
    int4_tiled_partials_reference,
    int4_tiles,
    int4_untile,
    int8_linear_reference,
)
from ember.quant.linear import pack_nibbles, quantize_int4_grouped, quantize_int8_per_channel, unpack_nibbles

# Relative error ||y - y_float|| / ||y_float|| of each scheme on N(0, 1) weights and activations: the bound
# follows from the grid step (int8: max|w| / 127 per row; int4: range / 15 per group) with margin.
BOUNDS = {"int8": 0.01, "int4-g32": 0.08, "int4-g128": 0.12, "int8-dyn": 0.02}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_error_is_bounded(scheme, bias):
    linear = nn.Linear(256, 96, bias=bias)
    q = QuantSpec.parse(scheme).make(linear)
    q.prepare()
    x = torch.randn(5, 256)
    with torch.no_grad():
        err = rel_err(q(x), linear(x))
    assert err < BOUNDS[scheme], f"{scheme}: relative error {err:.4f}"
    assert err > 0  # really quantized


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
@pytest.mark.parametrize("in_features,out_features", [(200, 96), (256, 120), (40, 7)])
@pytest.mark.parametrize("rows", [1, 5])
def test_projections_of_any_width_quantize_on_cpu(scheme, in_features, out_features, rows):
    """Widths torch's CPU kernels do not take (int8: K not a multiple of 16 crashed or gave NaN; int4: N not a
    multiple of 16 was refused) run another path with the same bound."""
    group = QuantSpec.parse(scheme).group_size
    if group and in_features % group:
        pytest.skip("the group size does not divide K (refused by check_fits)")
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features)
    q = QuantSpec.parse(scheme).make(linear)
    q.prepare()
    x = torch.randn(rows, in_features)
    with torch.no_grad():
        err = rel_err(q(x), linear(x))
    assert err < BOUNDS[scheme], f"{scheme}: relative error {err:.4f}"


@pytest.mark.parametrize("scheme", ["int4-g32", "int8"])
@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_cpu_prefill_runs_a_gemm_on_the_dequantized_weights(scheme, gemm_dtype, monkeypatch):
    """From CPU_DEQUANT_ROWS rows a compiled forward dequantizes the weights and runs a float32 or bf16 GEMM
    (`linear.CPU_GEMM_DTYPE`) in place of torch's weight-only kernel (absent from inductor's code), on the
    kernel's bf16 activations: it gives the float math of the canonical weights to bf16 roundings, and so the
    eager forward. Fewer rows keep the kernel. (int4 as on CPUs where Ember's own kernel is not built.)"""
    from torch._inductor.utils import run_and_get_code

    from ember.ops import cpu_ext
    from ember.quant import linear
    from ember.quant.linear import CPU_DEQUANT_ROWS, HALVES_ROWS, round_bf16

    monkeypatch.setattr(linear, "CPU_GEMM_DTYPE", gemm_dtype)
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    torch._dynamo.reset()
    q = QuantSpec.parse(scheme).make(nn.Linear(256, 96))
    q.prepare()
    kernel = "_weight_int4pack_mm_for_cpu" if scheme.startswith("int4") else "int8_linear"
    compiled = torch.compile(q, dynamic=True)
    with torch.no_grad():  # int4: K in halves, then whole (HALVES_ROWS)
        for rows, gemm in (
            (CPU_DEQUANT_ROWS + 7, True),
            (HALVES_ROWS + 3, True),
            (CPU_DEQUANT_ROWS - 1, False),
        ):
            x = torch.randn(rows, 256)
            y, code = run_and_get_code(compiled, x)
            assert (kernel not in "".join(code)) is gemm
            # one bf16 rounding of the result (and of the weights, in bf16) away from float math on bf16 inputs
            assert rel_err(y, round_bf16(x) @ q.dequantize().T + q.bias) < 3e-3
            assert rel_err(y, q(x)) < 5e-3
            assert rel_err(y, x @ q.dequantize().T + q.bias) < BOUNDS[scheme]


def test_int4_grid_and_packing_round_trip():
    w = torch.randn(8, 64)
    codes, scales, mins = quantize_int4_grouped(w, 32)
    assert codes.max() <= 15 and torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    deq = codes.float().reshape(8, 2, 32) * scales[..., None] + mins[..., None]
    # Every weight lies within half a grid step of its code's value.
    assert ((deq.reshape(8, 64) - w).abs() <= scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def dequantized_int4(codes, scales, mins, group_size):
    N, K = codes.shape
    return (codes.float().reshape(N, -1, group_size) * scales[..., None] + mins[..., None]).reshape(N, K)


def test_ops_match_their_twins_on_cpu():
    x, w = torch.randn(3, 128), torch.randn(40, 128)
    q, s = quantize_int8_per_channel(w)
    y = torch.ops.ember.int8_linear(x, q, s)
    assert rel_err(y, int8_linear_reference(x, q, s)) < 5e-3  # the CPU kernel runs in bf16
    # The folded int4 factors, (1 + q/16) * 16s + (min - 16s), are the same grid as q * s + min.
    codes, sc, mn = quantize_int4_grouped(w, 32)
    y4 = torch.ops.ember.int4_linear(x, pack_nibbles(codes), *int4_fold_scales(sc, mn, torch.float32), 32)
    assert rel_err(y4, x @ dequantized_int4(codes, sc, mn, 32).T) < 1e-5


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
@pytest.mark.parametrize("K,block_k", [(512, 256), (576, 256)])  # 576: the last K step is partial
@pytest.mark.parametrize("acc8", [False, True])  # one float accumulator per weight, or per 8 weights
def test_triton_gemv_kernels_match_float_math_in_interpreter(K, block_k, acc8):
    from ember.quant import triton_kernels as tk

    x, w = torch.randn(2, K), torch.randn(40, K)  # N=40: the last row block is partial
    blocks = dict(BLOCK_N=16, BLOCK_K=block_k, ACC8=acc8)
    assert rel_err(tk.float_gemv(x, w, blocks=blocks), x @ w.T) < 1e-5
    q, s = quantize_int8_per_channel(w)
    for magic in (0, 1):  # the plain conversion, the float-exponent arithmetic (2, byte permutes: PTX only)
        y = tk.int8_gemv(x, q, s, blocks={**blocks, "MAGIC": magic})
        assert rel_err(y, x @ (q.float() * s[:, None]).T) < 1e-5
    for group in (32, 64):
        codes, sc, mn = quantize_int4_grouped(w, group)
        s16, z16 = int4_fold_scales(sc, mn, torch.float32)
        y4 = tk.int4_gemv(x, pack_nibbles(codes), s16, z16, group, blocks=dict(BLOCK_N=16, BLOCK_K=block_k))
        want = x @ dequantized_int4(codes, sc, mn, group).T
        assert rel_err(y4, want) < 1e-5
        if int4_tiles(K, group):
            words, sz = int4_tile(pack_nibbles(codes), group), int4_subnormal_scales(sc, mn)
            bf = sc.to(torch.bfloat16).float(), mn.to(torch.bfloat16).float()  # the factors are bf16
            want = x @ dequantized_int4(codes, *bf, group).T
            for xs in (1.0, 3e4, 1e-6):  # codes read as subnormals, x scaled by up to 2^79
                y4 = tk.int4_tiled_gemv(x * xs, words, sz, group, blocks=dict(BLOCK_N=16))
                assert rel_err(y4, want * xs) < 1e-5
            if (
                K // (8 * group)
            ) % 2 == 0:  # K cut into two runs of tiles, float32 partials added by a second kernel
                y4 = tk.int4_tiled_gemv(x, words, sz, group, blocks=dict(BLOCK_N=16, SPLIT=2))
                assert rel_err(y4, want) < 1e-5
                # The same launch's partials, left for the consumer (`kernels.SplitSum`), and their reference.
                parts = tk.int4_tiled_partials(x, words, sz, group, 2, dict(BLOCK_N=16))
                assert parts.shape == (2, 2, 40) and parts.dtype == torch.float32
                assert rel_err(parts.sum(0), want) < 1e-5
                ref = int4_tiled_partials_reference(x, words, sz, group, 2)
                w_bf = dequantized_int4(codes, *bf, group)
                assert rel_err(parts, ref) < 1e-5
                assert rel_err(ref[0], x[:, : K // 2] @ w_bf[:, : K // 2].T) < 1e-5
            if tk.tiled_split(40, K, group, 16, rows=2) > 1:  # picked by the op itself (fixed tiles)
                assert rel_err(tk.int4_tiled_gemv(x, words, sz, group), want) < 1e-5
            assert torch.equal(
                tk.int4_tiled_gemv(x * 0, words, sz, group, blocks=dict(BLOCK_N=16)), x.new_zeros(2, 40)
            )
            w_tk = tk.int4_tiled_dequantize(words, sz, group, torch.float32)  # the prefill path's weights
            assert torch.equal(w_tk, dequantized_int4(codes, *bf, group))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_tiled_int4_gemv_splits_k_only_where_programs_are_few():
    from ember.quant.triton_kernels import tiled_split

    # Llama-3-8B's projections at 16 rows per program, group 128: (N, K) -> runs of tiles per row
    shapes = {(6144, 4096): 4, (4096, 4096): 4, (28672, 4096): 1, (4096, 14336): 7, (128256, 4096): 1}
    for (N, K), want in shapes.items():
        assert tiled_split(N, K, 128, 16) == want, (N, K)
    assert tiled_split(4096, 4096, 128, 16, rows=8) == 1  # eight rows: programs enough


def test_int4_tiled_layout_round_trips_and_feeds_the_op():
    x, w = torch.randn(3, 512), torch.randn(24, 512)
    codes, sc, mn = quantize_int4_grouped(w, 32)
    words = int4_tile(pack_nibbles(codes), 32)
    assert words.dtype == torch.int32 and words.shape == (24, 64)
    assert torch.equal(int4_untile(words, 32), codes)
    # Nibble j of word i in tile t is weight 256t + 32j + i.
    assert int((words[5, 33] >> 8) & 0xF) == int(codes[5, 256 + 64 + 1])
    sz = int4_subnormal_scales(sc, mn)
    bf = sc.to(torch.bfloat16).float(), mn.to(torch.bfloat16).float()
    assert torch.equal(int4_tiled_dequantize(words, sz, 32), dequantized_int4(codes, *bf, 32))
    y = torch.ops.ember.int4_tiled_linear(x, words, sz, 32)
    assert rel_err(y, x @ dequantized_int4(codes, *bf, 32).T) < 1e-5


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int8-dyn"])
def test_quantize_save_load_round_trip(scheme, tmp_path):
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (1, 48))
    before = perplexity(model, tokens)
    quantize_model(model, scheme)
    after = perplexity(model, tokens)
    assert abs(after - before) / before < 0.03  # the bar for int4; int8 lands far inside it
    path = save_quantized(model, tmp_path / "q.safetensors")
    loaded = load_quantized(path)
    assert loaded.quantization == model.quantization
    assert perplexity(loaded, tokens) == pytest.approx(after, rel=1e-6)


def test_int8_weights_on_a_cpu_run_the_float_activation_kernel_from_one_copy_of_the_codes():
    """int8 weight-only in float32 on a CPU where Ember's kernels run: `int8_gemv_f32`, the dequantized weights'
    float linear (one or two rows to float32's precision, more as int16 activation codes to 2^-16 of a block's
    largest |x|; torch's kernel rounds the activations to bf16, ~3e-3), its tiles in place of the codes, which
    the state dict and `dequantize` still give exactly."""
    from ember.ops import cpu_ext
    from ember.quant.linear import float_linear

    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built here")
    q = QuantSpec.parse("int8").make(nn.Linear(256, 96))
    codes, weights = q.qweight.clone(), q.dequantize()
    q.prepare()
    assert q.qweight is None and q.streamed_weight() is q._tiles
    assert torch.equal(q.state_dict()["qweight"], codes) and torch.equal(q.dequantize(), weights)
    for rows, bound in ((1, 1e-6), (2, 1e-6), (17, 1e-4)):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            y = q(x)
        assert rel_err(y, float_linear(x, q)) < bound, rows
    ((op, operands),) = q.row_kernel().calls  # the eager CPU step's call is the forward's
    x = torch.randn(1, 256)
    assert torch.equal(getattr(torch.ops.ember_cpu, op)(x, *operands) + q.bias, q(x))


def test_int4_groups_that_do_not_divide_a_width_are_refused_naming_the_fits():
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    widths = sorted({m.in_features for m in model.modules() if isinstance(m, nn.Linear)})
    bad = next(g for g in (256, 128, 64) if any(k % g for k in widths))
    with pytest.raises(EmberError, match=f"int4-g{bad}: groups of {bad} do not divide") as e:
        quantize_model(model, f"int4-g{bad}")
    assert "int4-g32" in str(e.value)
    assert not getattr(model, "quantization", None)  # nothing was swapped


def test_unknown_scheme_and_double_quantization_are_errors():
    with pytest.raises(EmberError, match="int3"):
        QuantSpec.parse("int3")
    model = quantize_model(random_model("tiny", device="cpu", dtype=torch.float32), "int8")
    with pytest.raises(EmberError, match="already quantized"):
        quantize_model(model, "int8")


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("acc8", [False, True])
def test_silu_gate_up_gemv_matches_the_unfused_ops_in_interpreter(int8, acc8):
    from ember.quant import triton_kernels as tk
    from ember.quant.kernels import silu_gate_up_reference

    K, I = 576, 40  # noqa: E741  (the last K step and the last row block are partial)
    x, w = torch.randn(1, K), torch.randn(2 * I, K) * 0.1
    weight, scales = quantize_int8_per_channel(w) if int8 else (w, None)
    got = tk.fused_gemv(x, weight, scales, glu=True, blocks=dict(BLOCK_N=16, BLOCK_K=256, ACC8=acc8))
    want = silu_gate_up_reference(x, weight, scales)
    assert got.shape == (1, I)
    assert rel_err(got, want) < 1e-5


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_of_split_partials_matches_summing_then_the_activation_in_interpreter(dtype):
    from ember.quant import triton_kernels as tk
    from ember.quant.kernels import silu_mul_partials_reference

    parts = torch.randn(4, 3, 2 * 1500) * 3  # 4 runs of K, 3 rows, I = 1500 (the last block is partial)
    got = tk.silu_mul_partials(parts, dtype)
    want = silu_mul_partials_reference(parts, dtype)
    assert got.shape == (3, 1500) and got.dtype == dtype
    # float32: the same arithmetic. bf16: Triton's interpreter rounds to bf16 by truncation (a GPU rounds to
    # nearest), up to a step at each of the kernel's three roundings.
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 3e-2)
    assert rel_err(want, torch.ops.ember.silu_mul_partials(parts, dtype)) == 0
    gate, up = parts.sum(0).chunk(2, dim=-1)
    assert rel_err(want.float(), torch.nn.functional.silu(gate) * up) < 1e-2


def test_quantizing_in_row_chunks_gives_the_same_values(monkeypatch):
    from ember.quant import linear

    w = torch.randn(37, 64)
    whole8, whole4 = linear.quantize_int8_per_channel(w), linear.quantize_int4_grouped(w, 32)
    monkeypatch.setattr(linear, "QUANTIZE_CHUNK", 5 * 64)  # 5 rows at a time, the last chunk 2
    for got, want in (
        (linear.quantize_int8_per_channel(w), whole8),
        (linear.quantize_int4_grouped(w, 32), whole4),
    ):
        assert all(torch.equal(g, x) for g, x in zip(got, want, strict=True))


def test_a_decode_step_with_norms_and_adds_folded_into_int8_projections_is_the_same_step(monkeypatch):
    # `DecoderLayer.folds`: on a CUDA decode row each pre-norm layer hands its norms and residual adds to the
    # int8 GEMVs either side of them. Here the ops' twins stand in for those GEMVs (CPU), and every projection
    # runs the same twin unfolded, so the plumbing is what is checked: which stream each norm reads, which
    # stream each add lands on, and the last norm.
    from ember.engine.kv_cache import StaticKVCache
    from ember.models import decoder
    from ember.ops import cpu_ext
    from ember.quant.linear import Int8WeightOnlyLinear

    monkeypatch.setattr(decoder, "on_gpu", lambda x: True)  # the CPU rows asked as a GPU's are
    monkeypatch.setattr(cpu_ext, "available", lambda: False)  # int8 modules keep their codes, as on a GPU
    torch.manual_seed(0)
    model = random_model("tiny", device="cpu", dtype=torch.float32, quantize="int8")
    for layer in model.model.layers:  # norms that do more than pass their input through
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = torch.rand_like(norm.weight) + 0.5
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    folded = []
    norm_linear = Int8WeightOnlyLinear.norm_linear
    monkeypatch.setattr(Int8WeightOnlyLinear, "folds", lambda self, x: x.numel() == x.shape[-1])
    monkeypatch.setattr(
        Int8WeightOnlyLinear,
        "forward",
        lambda self, x: int8_linear_reference(x, self.qweight, self._scales_act),
    )
    monkeypatch.setattr(
        Int8WeightOnlyLinear,
        "norm_linear",
        lambda self, *a, **k: folded.append(1) or norm_linear(self, *a, **k),
    )
    outs = {}
    for fold in (False, True):
        monkeypatch.setattr(decoder, "FOLD_NORMS", fold)
        cache = StaticKVCache(cfg, batch_size=1, max_seq_len=16, device="cpu", dtype=torch.float32)
        model(tokens[:, :5], torch.arange(5)[None], cache)  # the prompt: several rows, never folded
        assert not folded
        outs[fold] = model(tokens[:, 5:], torch.tensor([[5]]), cache)
    assert len(folded) == 2 * cfg.num_layers  # qkv and gate/up of every layer took their norm
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-6)


def int4_model_in_cuda_layout(dtype: torch.dtype):
    """The tiny model quantized int4-g64 on CPU, with norms that do more than pass their input through and the
    CUDA kernels' layout of each projection built (for their ops' twins)."""
    from ember.quant import kernels
    from ember.quant.linear import Int4WeightOnlyLinear

    torch.manual_seed(0)
    model = random_model("tiny", device="cpu", dtype=dtype, quantize="int4-g64")
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = (torch.rand_like(norm.weight.float()) + 0.5).to(norm.weight.dtype)
        for module in layer.modules():
            if isinstance(module, Int4WeightOnlyLinear):
                module._words = kernels.int4_mma_tile(module.qweight)
                module._msz = kernels.int4_mma_scales(module.scales, module.mins)
    return model


def test_a_decode_step_with_int4_rows_rounded_by_the_norms_is_the_same_step(monkeypatch):
    # `DecoderLayer.rounds`: on a CUDA decode row each pre-norm int4 layer's norms hand qkv and gate/up the row
    # rounded to int8 (`cuda_int4.round_row`), which their GEMVs read as it is. Here the ops' twins stand in
    # (CPU), and the other arm rounds qkv's and gate/up's own input the same way in the plain path, so what is
    # checked is the plumbing: which norm's row each projection gets, the first layer's, SwiGLU, and that a
    # prompt's rows are never rounded.
    from ember.engine.kv_cache import StaticKVCache
    from ember.models import decoder
    from ember.quant import cuda_int4, kernels
    from ember.quant.linear import Int4WeightOnlyLinear

    monkeypatch.setattr(decoder, "on_gpu", lambda x: True)  # the CPU rows asked as a GPU's are
    model = int4_model_in_cuda_layout(torch.bfloat16)
    takers = {id(layer.self_attn.qkv_proj) for layer in model.model.layers}
    takers |= {id(layer.mlp.gate_up_proj) for layer in model.model.layers}
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    calls = []

    def forward(self, x):  # the float product of the weights; of the rounded row for qkv and gate/up
        if round_inputs and id(self) in takers and x.numel() == x.shape[-1]:
            x = cuda_int4.unround_row(cuda_int4.round_row(x), x.shape[-1]).reshape(x.shape)
        y = x.float() @ kernels.int4_mma_dequantize(self._words, self._msz, self.group_size).T
        return y.to(torch.bfloat16)

    rounded_forward = Int4WeightOnlyLinear.rounded_forward
    monkeypatch.setattr(Int4WeightOnlyLinear, "forward", forward)
    monkeypatch.setattr(Int4WeightOnlyLinear, "split_forward", forward)
    monkeypatch.setattr(
        Int4WeightOnlyLinear,
        "rounded_forward",
        lambda self, *a, **k: calls.append(id(self)) or rounded_forward(self, *a, **k),
    )
    outs = {}
    for rounds in (False, True):
        round_inputs = not rounds
        monkeypatch.setattr(
            Int4WeightOnlyLinear, "takes_rounded", lambda self, x, on=rounds: on and x.numel() == x.shape[-1]
        )
        cache = StaticKVCache(cfg, batch_size=1, max_seq_len=16, device="cpu", dtype=torch.bfloat16)
        model(tokens[:, :5], torch.arange(5)[None], cache)  # the prompt: several rows, never rounded
        assert not calls
        outs[rounds] = model(tokens[:, 5:], torch.tensor([[5]]), cache)
    assert sorted(calls) == sorted(takers)  # qkv and gate/up of every layer, once each
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4-g64", "int8-dyn"])
def test_the_streamed_weight_is_the_largest_tensor_a_row_reads_and_compiles(scheme):
    # What decode attention hints into a GPU's L2 for the output projection (`KVCache.attend(ahead=)`).
    from ember.models.decoder import streamed_weight

    linear = nn.Linear(256, 96, bias=False)
    q = QuantSpec.parse(scheme).make(linear)
    q.prepare()
    read = [getattr(q, n) for n in q._runtime_buffers()]
    assert len(read) > 1 and streamed_weight(q) is max(read, key=lambda t: t.numel() * t.element_size())
    assert streamed_weight(linear) is linear.weight
    compiled = torch.compile(lambda: streamed_weight(q) + 0, backend="eager", fullgraph=True)
    assert torch.equal(compiled(), streamed_weight(q))


def test_a_decode_step_with_norms_carried_across_int4_projections_is_the_same_step(monkeypatch):
    # `DecoderLayer.carries_norm`: on a CUDA decode row the GEMV before each norm (o; down, into the next
    # layer) adds the residual and hands on the row times the norm's weight with its sums of squares; the GEMV
    # after it (gate/up; the next layer's qkv) applies the norm's factor. Here the ops' twins stand in (CPU,
    # float32: no rounding between the two forms), so what is checked is the plumbing: which residual, which
    # norm, across layers, the first layer's and the final norm, and that a prompt's rows are never carried.
    from ember.engine.kv_cache import StaticKVCache
    from ember.models import decoder
    from ember.quant import cuda_int4, kernels
    from ember.quant.linear import Int4WeightOnlyLinear

    monkeypatch.setattr(decoder, "on_gpu", lambda x: True)  # the CPU rows asked as a GPU's are
    model = int4_model_in_cuda_layout(torch.float32)
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    calls = []

    def forward(self, x):  # the float product of the weights, as the twins compute it
        return (x.float() @ kernels.int4_mma_dequantize(self._words, self._msz, self.group_size).T).to(
            x.dtype
        )

    for name in ("linear_add_norm", "normed_forward"):
        method = getattr(Int4WeightOnlyLinear, name)
        monkeypatch.setattr(
            Int4WeightOnlyLinear,
            name,
            lambda self, *a, m=method, n=name, **k: calls.append(n) or m(self, *a, **k),
        )
    monkeypatch.setattr(Int4WeightOnlyLinear, "forward", forward)
    monkeypatch.setattr(Int4WeightOnlyLinear, "split_forward", forward)
    outs = {}
    for carries in (False, True):
        monkeypatch.setattr(cuda_int4, "FOLD_NORMS", carries)
        monkeypatch.setattr(
            Int4WeightOnlyLinear, "carries_norm", lambda self, x, on=carries: on and x.numel() == x.shape[-1]
        )
        cache = StaticKVCache(cfg, batch_size=1, max_seq_len=16, device="cpu", dtype=torch.float32)
        model(tokens[:, :5], torch.arange(5)[None], cache)  # the prompt: several rows, never carried
        assert not calls
        outs[carries] = model(tokens[:, 5:], torch.tensor([[5]]), cache)
    # o and gate/up in every layer, down into the next layer and qkv from the one before
    assert sorted(calls) == sorted(["linear_add_norm", "normed_forward"] * (2 * cfg.num_layers - 1))
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)


def test_the_carried_norm_ops_are_rmsnorm_between_two_projections():
    # `ember::int4_mma_linear_add_norm` then `ember::int4_mma_normed_linear` (their twins, off CUDA): the MLP's
    # input RMSNorm(resid + o(x)) times gate/up, with Gemma's weight offset too; fake kernels by opcheck.
    from ember.ops.norm import rms_norm_reference
    from ember.quant import kernels

    g = torch.Generator().manual_seed(0)
    E, inner, group = 128, 96, 64
    o = torch.randn(E, E, generator=g) / 8
    gate_up = torch.randn(2 * inner, E, generator=g) / 8
    (o_words, o_sz), (gu_words, gu_sz) = (
        (kernels.int4_mma_tile(pack_nibbles(q)), kernels.int4_mma_scales(s, m))
        for q, s, m in (quantize_int4_grouped(w, group) for w in (o, gate_up))
    )
    x, resid = torch.randn(1, E, generator=g), torch.randn(1, E, generator=g) * 4
    weight = torch.rand(E, generator=g) + 0.5
    for offset in (0.0, 1.0):
        h, hw, sq = kernels.int4_mma_linear_add_norm(x, o_words, o_sz, group, resid, weight, offset)
        assert torch.equal(h, resid + x @ kernels.int4_mma_dequantize(o_words, o_sz, group).T)
        assert sq.shape == (E // 16,) and torch.allclose(sq.sum(), h.square().sum())
        y = kernels.int4_mma_normed_linear(hw, sq, 1e-6, gu_words, gu_sz, group, True)
        gate, up = (
            rms_norm_reference(h, weight, 1e-6, offset)
            @ kernels.int4_mma_dequantize(gu_words, gu_sz, group).T
        ).chunk(2, -1)
        torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    checks = torch.library.opcheck(
        kernels.int4_mma_linear_add_norm, (x, o_words, o_sz, group, resid, weight, 0.0)
    )
    assert all(v == "SUCCESS" for v in checks.values())
    checks = torch.library.opcheck(
        kernels.int4_mma_normed_linear, (hw, sq, 1e-6, gu_words, gu_sz, group, False)
    )
    assert all(v == "SUCCESS" for v in checks.values())
