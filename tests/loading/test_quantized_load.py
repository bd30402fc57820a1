"""Quantizing while loading (each projection as soon as it is read, so the float model never exists whole)
gives, tensor for tensor, the model that quantizing after a float load gives: safetensors with biases, GGUF."""

from __future__ import annotations

import pytest
import torch

from ember.errors import EmberError
from ember.loading.checkpoint import load
from ember.quant import quantize_model
from tests.conftest import make_tiny_llama_dir


def assert_same_model(a, b, vocab_size: int) -> None:
    assert a.quantization == b.quantization
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    from ember.quant import perplexity

    tokens = torch.randint(0, vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert perplexity(a, tokens) == perplexity(b, tokens)  # the prepared kernels' layouts agree too


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int8-dyn"])
def test_quantizing_while_loading_safetensors_equals_quantizing_after(
    scheme, tmp_path, smollm2_tokenizer_dir
):
    path = make_tiny_llama_dir(tmp_path, smollm2_tokenizer_dir, attention_bias=True, mlp_bias=True)
    streamed = load(str(path), device="cpu", quantize=scheme, quant_cache=False, progress=False)
    after = quantize_model(load(str(path), device="cpu", progress=False).model, scheme)
    assert streamed.model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_same_model(streamed.model, after, streamed.config.vocab_size)


def test_quantizing_while_loading_gguf_equals_quantizing_after(smollm2_gguf):
    streamed = load(str(smollm2_gguf), device="cpu", quantize="int4-g32", quant_cache=False, progress=False)
    after = quantize_model(load(str(smollm2_gguf), device="cpu", progress=False).model, "int4-g32")
    assert_same_model(streamed.model, after, streamed.config.vocab_size)


def test_a_scheme_that_does_not_fit_is_refused_before_reading(smollm2_gguf):
    with pytest.raises(EmberError, match="groups of 128 do not divide this model's input widths"):
        load(str(smollm2_gguf), device="cpu", quantize="int4", quant_cache=False, progress=False)
