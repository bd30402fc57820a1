"""Rope variants against transformers' rotary embedding: (cos, sin) for the same config and positions.

Covers every rope_type Ember reads (default, linear, dynamic NTK, llama3, yarn, longrope), partial rotary
dims, and the two length-dependent variants on both sides of their threshold (dynamic grows the base past
the trained length; longrope switches to its long factors past the original length).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ember.config import rope_from_hf
from ember.ops.rope import Rope, RopeConfig, apply_rope

HEAD_DIM, MAX_POS = 32, 64

CASES = {
    "default": {},
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn-beta-mscale": dict(
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=8,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=1.0,
        mscale_all_dim=0.5,
    ),
    "longrope": dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.05 * i for i in range(HEAD_DIM // 4)],
        long_factor=[2.0 + 0.25 * i for i in range(HEAD_DIM // 4)],
        original_max_position_embeddings=16,
    ),
}
PARTIAL = {"longrope"}  # Phi-4-mini: longrope on half of each head


def _pair(case: str) -> tuple[Rope, LlamaRotaryEmbedding]:
    params = {"rope_theta": 10000.0, "rope_type": "default", **CASES[case]}
    partial = 0.5 if case in PARTIAL else 1.0
    hf = dict(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={**params, "partial_rotary_factor": partial},
    )
    ours = Rope(rope_from_hf(hf, head_dim=HEAD_DIM, partial_rotary=case in PARTIAL))  # as Phi-3 reads it
    ours.init_buffers("cpu")
    theirs = LlamaRotaryEmbedding(LlamaConfig(**hf))
    return ours, theirs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("length", [12, 40, 100])  # below / across the original lengths, past MAX_POS
def test_cos_sin_match_transformers(case, length):
    ours, theirs = _pair(case)
    positions = torch.arange(length)[None]  # (1, T)
    x = torch.zeros(1, length, HEAD_DIM)
    cos, sin = ours(positions)
    ref_cos, ref_sin = theirs(x, positions)
    rd = cos.shape[-1]
    assert rd == (HEAD_DIM // 2 if case in PARTIAL else HEAD_DIM)
    torch.testing.assert_close(cos, ref_cos[..., :rd], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin[..., :rd], atol=1e-5, rtol=1e-5)


def test_rope_from_hub_spellings():
    """Hub configs spell scaling as rope_scaling + rope_theta, the type as "type" (Phi-3's "su" is its family's)."""
    hf = dict(
        rope_theta=500000.0,
        max_position_embeddings=4096,
        original_max_position_embeddings=1024,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4),
    )
    cfg = rope_from_hf(hf, head_dim=8)
    assert (cfg.rope_type, cfg.theta, cfg.rotary_dim) == ("longrope", 500000.0, 8)
    assert cfg.params["original_max_position_embeddings"] == 1024
    # transformers 5 keys rope parameters by layer type for Gemma 3; the full-attention entry is the default.
    nested = dict(rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6)))
    cfg = rope_from_hf(nested, head_dim=8)
    assert (cfg.rope_type, cfg.theta, cfg.params) == ("linear", 1e6, {"factor": 8.0})


def test_unknown_rope_type_is_an_error():
    with pytest.raises(ValueError, match="'ntk-by-parts' is not supported"):
        RopeConfig(theta=1e4, rotary_dim=8, max_position_embeddings=16, rope_type="ntk-by-parts")


def test_apply_rope_partial_leaves_the_rest():
    x = torch.randn(1, 3, 2, 8)
    cos, sin = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)
    cos, sin = torch.zeros(1, 3, 4), torch.ones(1, 3, 4)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], torch.cat((-x[..., 2:4], x[..., :2]), dim=-1))


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
@pytest.mark.parametrize("rotary,factor", [(128, 1.0), (64, 1.2), (24, 0.9)])
def test_the_decode_tables_kernel_matches_the_plain_ops(rotary, factor):
    # `ember::rope_tables` on CUDA (`DECODE_TABLES_OP`): in Triton's interpreter on a CPU, on the GPU where a run
    # sets TRITON_INTERPRET=0. Rows at positions up to a long context, Dr / 2 not a power of two in one case.
    import os

    from ember.ops.rope import rope_tables_reference
    from ember.ops.triton_rope import rope_tables

    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton needs a CUDA GPU (TRITON_INTERPRET=0)")
    rope = Rope(RopeConfig(theta=500000.0, rotary_dim=rotary, max_position_embeddings=131072))
    rope.init_buffers(device)
    positions = torch.tensor([[0], [1], [517], [131071]], device=device)
    got = rope_tables(positions, rope.inv_freq, factor)
    want = rope_tables_reference(positions, rope.inv_freq, factor)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (4, 1, rotary)
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)
