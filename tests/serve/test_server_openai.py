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


@pytest.mark.parametrize("byte", ["Ģ", "ð"], ids=["continuation byte", "lead byte"])
def test_stop_string_completed_when_the_text_ends(client, reference_llm, byte):
    """Bytes that are no character yet are held back and become U+FFFD only when the text ends (here at
    max_tokens): a stop string they complete still ends the choice with "stop", as one found earlier does."""
    # GPT-2's byte-level "Ģ" is 0x80, a continuation byte with no lead; "ð" is 0xF0, a lead byte never continued.
    token = reference_llm.tokenizer.backend.token_to_id(byte)
    kw = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}
    r = client.completions.create(**kw).choices[0]
    assert r.text == "\ufffd" * 4 and r.finish_reason == "length"

    stop = "\ufffd" * 2
    r = client.completions.create(**kw, stop=stop).choices[0]
    assert r.text == "" and r.finish_reason == "stop"
    chunks = [c.choices[0] for c in client.completions.create(**kw, stop=stop, stream=True)]
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "stop"

    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={token: 100}, stop=(stop,))
    (out,) = reference_llm.generate("x", params)
    assert out.text == "" and out.finish_reason == "stop"
    chunks = list(reference_llm.stream("x", params))
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "stop"


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


def test_multi_turn_sends_the_assistant_message_back(client):
    """The SDK's own assistant message carries refusal/annotations/audio/tool_calls as nulls; OpenAI takes
    them back as they are, and an assistant turn with content null is an empty turn."""
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    message = first.choices[0].message
    assert "refusal" in message.model_dump()
    for previous in (message, message.model_dump(), {"role": "assistant", "content": None}):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[*MESSAGES, previous, {"role": "user", "content": "And two more?"}],
            max_tokens=4,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "length"


def test_logprobs_of_tokens_holding_part_of_a_character(client, reference_llm, tiny_server):
    # 0xF0 (GPT-2's byte-level "ð") starts a 4-byte character (an emoji): alone it decodes to U+FFFD.
    token = reference_llm.tokenizer.backend.token_to_id("ð")
    bias = {str(token): 100}
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, logit_bias=bias
    )
    content = r.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in content] == [("bytes:\\xf0", [0xF0])] * 3
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content

    c = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=1, logit_bias=bias
    )
    lp = c.choices[0].logprobs
    assert lp.tokens == ["bytes:\\xf0"] * 3
    # Three 0xF0 bytes make three broken characters; the second byte is where the first one is seen to break.
    assert c.choices[0].text == "\ufffd" * 3 and lp.text_offset == [0, 0, 1]

    # No two such tokens share a name in top_logprobs (which is keyed by it in /v1/completions), and each has
    # its own bytes: those its vocabulary entry stands for.
    vocab = reference_llm.tokenizer.backend.get_vocab()
    partial = {i for i in vocab.values() if "\ufffd" in reference_llm.tokenizer.decode([i])}
    pieces = [tiny_server.state.token_piece(i) for i in partial]
    assert len(partial) > 200
    assert len({p.token for p in pieces}) == len({p.raw for p in pieces}) == len(partial)
    assert tiny_server.state.token_piece(vocab["ðŁ"]).raw == "😀".encode()[:2]


def _tokens(reference_llm, prompt: str) -> list[str]:
    out = reference_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    return [reference_llm.tokenizer.decode([i]) for i in out.token_ids]


@pytest.mark.parametrize("inside", [False, True], ids=["at a token", "inside a token"])
def test_completion_logprobs_end_with_the_text_at_a_stop_string(client, reference_llm, inside):
    prompt = "The capital of France is"
    tokens = _tokens(reference_llm, prompt)
    # The tiny model repeats a token, then turns to another: stop at the turn, or a character before it.
    j = next(j for j, t in enumerate(tokens) if t != tokens[0])
    stop = tokens[j - 1][-1:] + tokens[j] if inside else tokens[0] + tokens[j]
    text = "".join(tokens)[: "".join(tokens).find(stop)]
    kept = tokens[: j if inside else j - 1]  # the tokens that make up the text: the stop's first one at most
    assert len(text) == len("".join(kept)) - inside  # inside: the last kept token ends in the stop string
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": stop, "logprobs": 1}
    r = client.completions.create(**kw)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert lp.tokens == kept and len(lp.token_logprobs) == len(lp.top_logprobs) == len(kept)
    assert lp.text_offset == [len("".join(kept[:i])) for i in range(len(kept))]
    assert all(o < len(text) for o in lp.text_offset)

    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert "".join(c.text for c in chunks) == text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == kept
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    # A chunk carries the tokens its text holds (text held back as a possible stop brings its own later).
    assert all(c.text for c in chunks if c.logprobs and c.logprobs.tokens)


def test_chat_logprobs_end_with_the_text_at_a_stop_string(client, reference_llm):
    token = reference_llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    word = reference_llm.tokenizer.decode([token])
    stop = word[-1] + word[0]  # spans the first two tokens: "a " of " banana banana"
    assert len(word) >= 3 and (word * 2).find(stop) == len(word) - 1
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True}
    kw |= {"logit_bias": {str(token): 100}, "stop": stop}
    r = client.chat.completions.create(**kw).choices[0]
    assert r.message.content == word[:-1] and r.finish_reason == "stop"
    # The second token completed the stop string but holds none of the text: it is not reported.
    assert [e.token for e in r.logprobs.content] == [word]
    stream = client.chat.completions.create(**kw, stream=True)
    streamed = [
        e.token for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed == [word]
