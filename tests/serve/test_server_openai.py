"""The official `openai` client against a live server: chat and completions, streamed and not, n > 1, stop
strings, usage, logprobs, seeds; greedy answers equal the engine's own outside the server."""

from __future__ import annotations

import pytest

from ember.engine.sampler import SamplingParams

from .conftest import MODEL

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def greedy_chat(reference_llm):
    return reference_llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0))[0]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_greedy_equals_engine(client, reference_llm, greedy_chat):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy_chat.text
    assert choice.finish_reason == greedy_chat.finish_reason == "length"
    prompt_tokens = len(reference_llm.encode_chat(MESSAGES))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == prompt_tokens + 12


def test_chat_stream_matches_and_reports_usage(client, greedy_chat):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_chat.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_batch_equals_engine(client, reference_llm):
    prompts = ["The capital of France is", "Once upon a time"]
    expected = reference_llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == 20


def test_completion_stream_and_token_prompt(client, reference_llm):
    ids = reference_llm.encode_prompt("Hello there")
    expected = reference_llm.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_spanning_tokens(client, reference_llm):
    prompt = "Once upon a time"
    full = reference_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00"]
    )
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_with_seed_are_distinct_and_reproducible(client):
    def ask():
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=7
        )
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.completion_tokens == 24
        return [c.message.content for c in r.choices]

    first = ask()
    assert len(set(first)) == 3, first
    assert ask() == first
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=7, stream=True
    )
    texts = ["", "", ""]
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == first


def test_chat_logprobs(client, reference_llm):
    expected = reference_llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry, token, ref in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one, and its logprob is the engine's.
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob == pytest.approx(ref[token], abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            sorted(ref.values(), reverse=True), abs=1e-4
        )
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_sampling_knobs_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "Be brief."}, *MESSAGES],
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={"100": 5},
        seed=1,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 4


def test_logit_bias_forces_a_token(client, reference_llm):
    token = reference_llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == reference_llm.tokenizer.decode([token] * 3)
