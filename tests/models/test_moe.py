"""The routed-experts layer: grouped matmul, its per-expert fallback, and a per-token reference agree.

The family tests cover MoE against transformers end to end; this pins down the three compute paths (torch's
grouped GEMM when rows are 16-byte aligned, a loop over experts otherwise, and under torch.compile without
the grouped GEMM each row against its expert's weight), experts that receive no tokens, and the
single-token decode case.
"""

from __future__ import annotations

import pytest
import torch

from ember.config import ModelConfig
from ember.models.decoder import MoE, expert_matmul, grouped_mm_supported
from ember.ops.rope import RopeConfig


def _moe(hidden: int, inter: int, experts: int, top_k: int, norm: bool) -> MoE:
    cfg = ModelConfig(
        architecture="t",
        vocab_size=8,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=hidden,
        max_position_embeddings=16,
        norm_eps=1e-6,
        rope=RopeConfig(theta=1e4, rotary_dim=hidden, max_position_embeddings=16),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=norm,
    )
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return moe


def _per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The obvious definition: for each token, the router-weighted sum of its top-k experts' MLPs."""
    out = torch.zeros_like(x)
    for n, row in enumerate(x):
        probs = torch.softmax(moe.gate(row).float(), dim=-1)
        w, idx = probs.topk(moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for weight, e in zip(w, idx.tolist(), strict=True):
            gate, up = (moe.experts.gate_up_proj[e] @ row).chunk(2)
            out[n] += weight * (moe.experts.down_proj[e] @ (moe.act(gate) * up))
    return out


@pytest.mark.parametrize("hidden,inter", [(64, 32), (18, 10)])  # aligned rows: grouped GEMM; not: loop
@pytest.mark.parametrize("tokens", [1, 3, 37])  # decode, a few, a prefill where most experts get rows
@pytest.mark.parametrize("norm", [True, False])
@torch.no_grad()
def test_moe_matches_per_token_reference(hidden, inter, tokens, norm):
    moe = _moe(hidden, inter, experts=8, top_k=2, norm=norm)
    x = torch.randn(1, tokens, hidden)
    grouped = grouped_mm_supported(x, moe.experts.gate_up_proj, moe.experts.down_proj)
    assert grouped == (hidden == 64 and hasattr(torch.nn.functional, "grouped_mm"))
    torch.testing.assert_close(moe(x)[0], _per_token(moe, x[0]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_grouped_loop_and_traced_paths_agree_with_empty_groups():
    w = torch.randn(4, 16, 32)  # (X, out, in)
    x = torch.randn(10, 32)  # rows sorted by expert: 3 for expert 0, none for 1 and 3, 7 for expert 2
    offsets = torch.tensor([3, 3, 10, 10], dtype=torch.int32)
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(expert_matmul(x, w, offsets, grouped=False), expected)
    experts = torch.tensor([0] * 3 + [2] * 7)  # the traced path's operand: each row's expert
    torch.testing.assert_close(expert_matmul(x, w, offsets, grouped=False, experts=experts), expected)
    if hasattr(torch.nn.functional, "grouped_mm"):
        torch.testing.assert_close(expert_matmul(x, w, offsets, grouped=True), expected)


@pytest.mark.parametrize("hidden,inter", [(64, 32), (18, 10)])
@pytest.mark.parametrize("tokens", [1, 37])
@torch.no_grad()
def test_moe_compiled_fullgraph_matches_per_token_reference(hidden, inter, tokens):
    # A compiled step may not sync with the host (fullgraph), and torch's grouped GEMM traces in bf16 only:
    # float32 traced takes each row against its expert's weight instead of the eager per-expert loop.
    moe = _moe(hidden, inter, experts=8, top_k=2, norm=False)
    x = torch.randn(1, tokens, hidden)
    torch._dynamo.reset()
    traced = torch.compile(moe, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(traced(x)[0], _per_token(moe, x[0]), atol=1e-5, rtol=1e-5)
