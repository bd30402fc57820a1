"""StaticKVCache's CPU decode attention against the SDPA reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from ember.ops.attention import causal_mask, grouped_decode_attention, sdpa_attention


@pytest.mark.parametrize(("H", "K", "window"), [(9, 3, None), (4, 4, None), (8, 2, 5)])
def test_decode_attention_matches_sdpa(H, K, window):
    torch.manual_seed(0)
    B, S, D = 2, 16, 32
    q = torch.randn(B, 1, H, D)  # (B, 1, H, D)
    k = torch.randn(B, K, S, D)  # (B, K, S, D)
    v = torch.randn(B, K, S, D)
    positions = torch.tensor([[3], [11]])  # rows at different positions
    mask = causal_mask(positions, torch.arange(S)[None], window)  # (B, 1, 1, S)
    ref = sdpa_attention(q.transpose(1, 2), k, v, mask, scale=D**-0.5).transpose(1, 2)
    out = grouped_decode_attention(q, k, v, mask, D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
