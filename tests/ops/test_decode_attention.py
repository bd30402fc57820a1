"""`ember::decode_attention` (rope, cache write and attention for one query token per row): the Triton kernel
in Triton's interpreter against the plain-torch twin, and the twin against SDPA with the cache's mask."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ember.ops.attention import causal_mask, sdpa_attention
from ember.ops.decode_attention import attend_reference, decode_attention_reference
from ember.ops.rope import Rope, RopeConfig

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)


def rope_for(rotary: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rope = Rope(RopeConfig(theta=10000.0, rotary_dim=rotary, max_position_embeddings=4096))
    rope.init_buffers("cpu")
    return rope(pos[:, None])  # (B, 1, R) each


def randn(*shape, g):
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("window", [0, 24])
def test_reference_matches_sdpa_with_the_cache_mask(window):
    B, H, K, S, D = 2, 6, 2, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = randn(B, H, D, g=g), randn(B, K, S, D, g=g), randn(B, K, S, D, g=g)
    pos = torch.tensor([3, 37])
    mask = causal_mask(pos[:, None], torch.arange(S)[None], window or None)
    want = sdpa_attention(q[:, :, None], k, v, mask, scale=0.3)  # (B, H, 1, D)
    torch.testing.assert_close(
        attend_reference(q, k, v, pos, 0.3, window), want[:, :, 0], atol=1e-5, rtol=1e-5
    )


@needs_triton
@pytest.mark.parametrize(
    "H,K,D,rotary,splits,block_s,window,S",
    [
        (8, 2, 32, 32, 1, 32, 0, 200),  # G = 4 query heads per kv head, the whole cache in one program
        (6, 2, 24, 24, 4, 32, 0, 200),  # G = 3 and D = 24 (both padded), four chunks merged
        (4, 4, 16, 8, 2, 32, 0, 200),  # no grouping (G = 1); partial rotary: dims 8..15 pass through
        (8, 2, 32, 32, 4, 32, 50, 200),  # sliding window: chunks wholly out of view stay empty
        (
            8,
            2,
            32,
            32,
            None,
            None,
            0,
            200,
        ),  # the default tiles for a short cache (two chunks, 128-slot steps)
        (8, 2, 32, 32, None, None, 0, 400),  # ... and past 256 slots (two chunks of one 256-slot step each)
        (8, 2, 32, 32, 8, 64, 0, 400),  # eight chunks of one 64-slot step (the tiles with the L2 prefetch)
    ],
)
def test_triton_kernel_matches_reference_in_interpreter(H, K, D, rotary, splits, block_s, window, S):
    from ember.ops.triton_attention import decode_attention

    B = 3
    g = torch.Generator().manual_seed(0)
    qkv = randn(
        B, (H + 2 * K) * D, g=g
    )  # this step's projections; q, k, v are strided views, as in the model
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, K * D, K * D], dim=-1))
    pos = torch.tensor([0, 77, S - 1])  # first slot, inside a chunk, last slot
    cos, sin = rope_for(rotary, pos)  # (B, 1, R)
    k_cache, v_cache = randn(B, K, S, D, g=g), randn(B, K, S, D, g=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention_reference(q, k, v, cos[:, 0], sin[:, 0], want_k, want_v, pos, 0.25, window)
    for b, p in enumerate(pos.tolist()):  # slots from a row's position on are never read: poison them
        k_cache[b, :, p:] = float("nan")
        v_cache[b, :, p:] = float("nan")
    # The next layer's caches ride along as the model passes them (an L2 hint that the interpreter skips).
    k_next, v_next = randn(B, K, S, D, g=g), randn(B, K, S, D, g=g)
    got = decode_attention(
        q, k, v, cos[:, 0], sin[:, 0], k_cache, v_cache, pos, 0.25, window, k_next, v_next,
        splits=splits, block_s=block_s,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    rows = torch.arange(B)
    # The rotated key and the value were stored at each row's position.
    torch.testing.assert_close(k_cache[rows, :, pos], want_k[rows, :, pos], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache[rows, :, pos], want_v[rows, :, pos])
