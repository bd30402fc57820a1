"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

import ember
from ember.engine.kv_cache import StaticKVCache

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish and German.",
]
NEAR_TIE = 1e-3  # reference top-2 logit gap under which either token is a correct greedy choice


@pytest.fixture(scope="module")
def llm() -> ember.LLM:
    return ember.LLM("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("wide", ["0", "1"], ids=["float-prefill", "int16-prefill"])
@torch.no_grad()
def test_prompt_and_decode_logits_match_transformers(llm, reference, monkeypatch, wide):
    """The prompt's logits and six cached decode steps' against transformers: to 1e-3 with the prompt's rows in
    float FMAs; with them as int16 codes of each block of 32 (AVX512-VNNI's default, 2^-16 of a block's
    largest |x| a projection) to 2e-3 of the logits' largest (measured 3-8e-4 on real text)."""
    monkeypatch.setenv("EMBER_CPU_WIDE", wide)
    ids = llm.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    full = torch.tensor([ids])
    expected = reference(full).logits[0]
    model = llm.loaded.model
    cache = StaticKVCache(llm.loaded.config, batch_size=1, max_seq_len=128, device="cpu", dtype=torch.float32)
    split = len(ids) - 6
    got = [model.compute_logits(model(full[:, :split], torch.arange(split)[None], cache))[0]]
    for t in range(split, len(ids)):  # the last six positions as cached decode steps
        got.append(model.compute_logits(model(full[:, t : t + 1], torch.tensor([[t]]), cache))[0])
    diff = (torch.cat(got) - expected).abs().max().item()
    bound = 1e-3 if wide == "0" else 2e-3 * expected.abs().max().item()
    assert diff < bound, f"max abs logit diff {diff}"


@pytest.mark.parametrize("prompt", PROMPTS)
@torch.no_grad()
def test_greedy_chat_answers_match_transformers(llm, reference, prompt):
    params = ember.SamplingParams(max_tokens=40, temperature=0)
    chunks = list(llm.stream_chat([{"role": "user", "content": prompt}], params))
    answer = [t for c in chunks for t in c.token_ids]
    prompt_ids = llm.encode_chat([{"role": "user", "content": prompt}])
    # Teacher-force Ember's answer through the reference: every chosen token must be the reference's argmax,
    # unless the reference's top two logits are a near-tie there.
    logits = reference(torch.tensor([prompt_ids + answer])).logits[0, len(prompt_ids) - 1 : -1]
    top2 = logits.topk(2, dim=-1)
    for i, token in enumerate(answer):
        if token != top2.indices[i, 0]:
            gap = (top2.values[i, 0] - logits[i, token]).item()
            assert gap < NEAR_TIE, (
                f"step {i}: ember chose {token}, reference {top2.indices[i, 0]} (gap {gap})"
            )
    text = "".join(c.text for c in chunks)
    assert text == llm.tokenizer.decode(answer)
    if prompt == PROMPTS[0]:
        assert "Paris" in text


def test_batched_engine_matches_single_stream(llm):
    """LLM.chat (batching engine, paged cache) gives the streamed (static cache) greedy answers."""
    params = ember.SamplingParams(max_tokens=24, temperature=0)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    batched = llm.chat(conversations, params)
    for conv, out in zip(conversations, batched, strict=True):
        single = [t for c in llm.stream_chat(conv, params) for t in c.token_ids]
        assert out.token_ids == single


def test_logprobs_and_seeded_sampling(llm):
    params = ember.SamplingParams(max_tokens=8, temperature=0.8, seed=42, logprobs=3)
    a = llm.chat([{"role": "user", "content": "Say something."}], params)[0]
    b = llm.chat([{"role": "user", "content": "Say something."}], params)[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(a.token_ids)
    for token, entry in zip(a.token_ids, a.logprobs, strict=True):
        assert token in entry and len(entry) >= 3
        assert all(v <= 0 for v in entry.values())


@pytest.mark.parametrize("end", [0, 2, 4])
def test_generation_ends_where_llama_cpp_ends_it(llm, end):
    # llama.cpp's end-of-generation ids for this file (llama_vocab_is_eog, llama-cpp-python 0.3.36): <|im_end|>
    # (the eos), <|endoftext|> (its end-of-turn) and <reponame> (fill-in-the-middle); a token forced by a bias
    # ends the answer there, with no text.
    assert set(llm.loaded.eos_token_ids) == {0, 2, 4}
    params = ember.SamplingParams(max_tokens=5, temperature=0, logit_bias={end: 100.0})
    (out,) = llm.generate(["Hello"], params)
    assert (out.token_ids, out.text, out.finish_reason) == ([end], "", "stop")
