"""Llama-family parity with transformers: logits for the prompt and every cached decode step, greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tests.conftest import load_hf_dir, run_cached

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)

CASES = {
    "llama-gqa-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama-tied-head_dim": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, head_dim=24)),
    "llama3-rope-bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-linear-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_scaling=dict(rope_type="linear", factor=2.0), num_key_value_heads=4),
    ),
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=7)),
}


def load_pair(case: str, tmp_path):
    config_cls, model_cls, extra = CASES[case]
    ref = model_cls(config_cls(**{**BASE, **extra}, attn_implementation="eager")).eval()
    ref.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    return ref, model


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_match_transformers(case, tmp_path):
    ref, model = load_pair(case, tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (2, 20))
    expected = ref(ids).logits
    full = run_cached(model, ids, split=20)
    assert (full - expected).abs().max() <= 1e-4
    # Prompt shorter than the sliding window, then decode steps past it: every cached step matches.
    cached = run_cached(model, ids, split=5)
    assert (cached - expected).abs().max() <= 1e-4


@torch.no_grad()
def test_greedy_continuation_matches_transformers(tmp_path):
    from ember.engine.generate import Generator
    from ember.engine.sampler import SamplingParams

    ref, model = load_pair("llama3-rope-bias", tmp_path)
    prompt = torch.randint(0, BASE["vocab_size"], (1, 9))
    expected = ref.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    gen = Generator(model, device=torch.device("cpu"), context=256)
    steps = list(gen.generate(prompt[0].tolist(), SamplingParams(max_tokens=24, temperature=0), (), None))
    assert [s.token_id for s in steps] == expected[0, 9:].tolist()
    assert steps[-1].finish_reason == "length"
