"""ember.LLM as a user calls it: bad prompts, messages and params are named in one line, and a call that
fails leaves nothing behind for the next one. A tiny random Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

import ember
from ember.errors import ContextLengthError, InvalidParameterError

GREEDY = ember.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> ember.LLM:
    return ember.LLM(tiny_llama_dir, device="cpu", dtype="float32")


def test_a_bad_prompt_in_a_batch_is_named_and_runs_nothing(llm):
    """Prompts were queued one by one: the good ones before a bad one stayed in the engine, and the next call
    ran them again under the same request ids, its outputs doubled."""
    expected = llm.generate(["Hello", "World"], GREEDY)
    with pytest.raises(InvalidParameterError, match="^prompt 1: the prompt is empty"):
        llm.generate(["Hello", "", "World"], GREEDY)
    with pytest.raises(ContextLengthError, match="^prompt 2: prompt has 600 tokens"):
        llm.generate(["Hello", "World", [5] * 600], GREEDY)
    with pytest.raises(InvalidParameterError, match=r"^prompt 1: prompt=\[1\.0\] is invalid"):
        llm.generate(["Hello", [1.0]], GREEDY)
    got = llm.generate(["Hello", "World"], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert not llm.engine().has_work()


def test_an_error_inside_a_run_leaves_no_request_behind(llm, monkeypatch):
    """A step that raised (it did for logprobs=1.5, in torch's topk) left its requests in the engine: every
    later call ran them again and raised the same error, until the LLM was rebuilt."""
    expected = llm.generate("Hello", GREEDY)[0].token_ids
    core = llm.engine()
    execute = core.runner.execute

    def fail_once(sched):
        monkeypatch.setattr(core.runner, "execute", execute)
        raise RuntimeError("boom")

    monkeypatch.setattr(core.runner, "execute", fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate("Hello", GREEDY)
    assert not core.has_work() and core.stats().kv_blocks_used == 0
    assert llm.generate("Hello", GREEDY)[0].token_ids == expected


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hi", r"^messages='hi' is invalid; expected a list"),
        ({"role": "user", "content": "hi"}, "^messages=.* is invalid; expected a list"),
        (["hi"], r"^messages\[0\]='hi' is invalid; expected a \{'role', 'content'\} dict"),
        ([{"content": "hi"}], r"^messages\[0\]\['role'\]=None is invalid; expected a role such as system"),
        ([{"role": 5, "content": "hi"}], r"^messages\[0\]\['role'\]=5 is invalid"),
        ([{"role": "user"}], r"^messages\[0\]\['content'\]=None is invalid; expected a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
            r"^messages\[1\]\['content'\]=5",
        ),
        ([[{"role": "user", "content": "a"}], [{"role": "user"}]], r"^conversation 1: messages\[0\]"),
    ],
)
def test_bad_chat_messages_are_named(llm, messages, match):
    with pytest.raises(InvalidParameterError, match=match):
        llm.chat(messages, GREEDY)


def test_chat_takes_the_servers_message_forms(llm):
    """Text parts, an assistant's None content and the "developer" role render as the server renders them."""
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "c"},
    ]
    forms = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]
    assert llm.encode_chat(forms) == llm.encode_chat(plain)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.generate(None, GREEDY), "^prompts=None is invalid"),
        (lambda llm: llm.generate([None], GREEDY), "^prompt=None is invalid"),
        (lambda llm: llm.generate([["a"]], GREEDY), r"^prompt=\['a'\] is invalid"),
        (
            lambda llm: llm.generate("Hi", [GREEDY]),
            r"^params=\[.* is invalid; expected an ember.SamplingParams",
        ),
        (lambda llm: list(llm.stream("Hi", ember.SamplingParams(n=2))), "^n=2 is invalid for a stream"),
        # the stream path checked no ids: torch's IndexError from the embedding
        (lambda llm: list(llm.stream([5, 10**9])), r"^prompt token id 1000000000 is outside the vocabulary"),
        (
            lambda llm: list(llm.stream_ids([-1])),
            r"^prompt token id -1 is outside the vocabulary \[0, 49152\)",
        ),
        (lambda llm: llm.encode_prompt("\udcc3("), r"^the prompt is not valid UTF-8 text \(byte 0xc3"),
    ],
)
def test_bad_prompts_and_params_are_named(llm, call, match):
    with pytest.raises(InvalidParameterError, match=match):
        call(llm)


def test_chat_passes_other_roles_and_keys_to_the_template(llm):
    """Roles beyond the usual four and keys beyond role/content reach the template as they are."""
    ids = llm.encode_chat(
        [{"role": "user", "content": "a"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    )
    assert "<|im_start|>tool\n42<|im_end|>" in llm.tokenizer.decode(ids, skip_special_tokens=False)


def test_generate_from_several_threads_gives_each_its_own_outputs(llm):
    """Threads share the LLM's batching engine: each call's requests and outputs stay its own."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["Hello", "The sky is", "def fib(n):", "Once upon a time"]
    want = {p: llm.generate(p, GREEDY)[0].token_ids for p in prompts}
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: llm.generate(p, GREEDY)[0].token_ids, prompts * 2))
    assert got == [want[p] for p in prompts * 2]


def test_the_text_is_what_the_tokens_add_to_the_prompts(tmp_path):
    """With a decoder that strips the start of what it decodes (Llama-2-style SentencePiece), "a" + "▁b" is
    "a b": the answer's text starts with its space, streamed or not, and so does its logprobs' token."""
    import json

    from tokenizers import AddedToken, decoders
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    from ember.serve.routes import _token_piece
    from tests.conftest import make_tiny_llama_dir

    backend = FastTokenizer(BPE(vocab={"▁a": 0, "▁b": 1, "c": 2, "<s>": 3, "</s>": 4}, merges=[]))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    backend.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    model = make_tiny_llama_dir(tmp_path / "model", tokenizer, vocab_size=5, bos_token_id=3, eos_token_id=4)
    llm = ember.LLM(model, device="cpu", dtype="float32")
    params = ember.SamplingParams(max_tokens=3, temperature=0, logit_bias={1: 100.0}, ignore_eos=True)
    (out,) = llm.generate([[3, 0]], params)
    assert (out.token_ids, out.text) == ([1, 1, 1], " b b b")
    assert "".join(c.text for c in llm.stream([3, 0], params)) == " b b b"
    assert _token_piece(llm.tokenizer, 1).text == b" b"
