"""Quantized linears against the float linear, the custom ops against their plain-torch twins, save/load."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ember.bench import random_model
from ember.errors import EmberError
from ember.quant import QuantSpec, load_quantized, perplexity, quantize_model, save_quantized
from ember.quant.kernels import int4_linear_reference, int8_linear_reference
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


def test_int4_grid_and_packing_round_trip():
    w = torch.randn(8, 64)
    codes, scales, mins = quantize_int4_grouped(w, 32)
    assert codes.max() <= 15 and torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    deq = codes.float().reshape(8, 2, 32) * scales[..., None] + mins[..., None]
    # Every weight lies within half a grid step of its code's value.
    assert ((deq.reshape(8, 64) - w).abs() <= scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def test_ops_match_their_twins_on_cpu():
    x, w = torch.randn(3, 128), torch.randn(40, 128)
    q, s = quantize_int8_per_channel(w)
    y = torch.ops.ember.int8_linear(x, q, s)
    assert rel_err(y, int8_linear_reference(x, q, s)) < 5e-3  # the CPU kernel runs in bf16
    codes, sc, mn = quantize_int4_grouped(w, 32)
    y4 = torch.ops.ember.int4_linear(x, pack_nibbles(codes), sc, mn, 32)
    assert rel_err(y4, int4_linear_reference(x, pack_nibbles(codes), sc, mn, 32)) < 1e-5


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
def test_triton_gemv_kernels_match_twins_in_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from ember.quant import triton_kernels as tk

    x, w = torch.randn(2, 256), torch.randn(40, 256)
    q, s = quantize_int8_per_channel(w)
    y = tk.int8_gemv(x, q, s, blocks=dict(BLOCK_N=16, BLOCK_K=128))
    assert rel_err(y, int8_linear_reference(x, q, s)) < 1e-5
    codes, sc, mn = quantize_int4_grouped(w, 32)
    p = pack_nibbles(codes)
    y4 = tk.int4_gemv(x, p, sc, mn, 32, blocks=dict(BLOCK_N=16, BLOCK_K=64))
    assert rel_err(y4, int4_linear_reference(x, p, sc, mn, 32)) < 1e-5


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


def test_unknown_scheme_and_double_quantization_are_errors():
    with pytest.raises(EmberError, match="int3"):
        QuantSpec.parse("int3")
    model = quantize_model(random_model("tiny", device="cpu", dtype=torch.float32), "int8")
    with pytest.raises(EmberError, match="already quantized"):
        quantize_model(model, "int8")
