"""StreamDecoder: pieces never split a character, and together they equal the full decode."""

from __future__ import annotations

import random

import pytest


def _stream(tok, ids, skip_special_tokens=True):
    decoder = tok.stream_decoder(skip_special_tokens=skip_special_tokens)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_decode(model, texts, skip_special_tokens):
    for text in texts:
        ids = model.ours.encode(text)
        expected = model.ref.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, tail = _stream(model.ours, ids, skip_special_tokens)
        assert "".join(pieces) + tail == expected, repr(text)
        if "\ufffd" not in expected:
            assert not any("\ufffd" in p for p in [*pieces, tail]), (repr(text), pieces)


def test_stream_holds_back_split_characters(model):
    # "𓀀" (4 UTF-8 bytes) is spelled with byte tokens in both vocabularies: nothing may come out half-made.
    tok = model.ours
    ids = tok.encode("a 𓀀 b", add_special_tokens=False)
    assert sum(tok.decode([i]) == "\ufffd" for i in ids) >= 2, "test needs a character split over tokens"
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == "a 𓀀 b" and tail == ""
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


@pytest.mark.slow
def test_stream_holds_byte_run_until_it_ends(gemma3):
    # A stray byte after a byte-fallback character makes the whole run invalid: Gemma's decoder then gives one
    # U+FFFD per byte, so "𓀀" must not have been streamed before the run ended.
    tok = gemma3.ours
    ids = tok.encode("a 𓀀", add_special_tokens=False) + [tok.backend.token_to_id("<0x80>")]
    ids += tok.encode(" ok", add_special_tokens=False)
    assert tok.decode(ids) == "a " + "\ufffd" * 5 + " ok" == gemma3.ref.decode(ids, skip_special_tokens=True)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) and "𓀀" not in pieces


def test_stream_random_ids(model):
    # Random ids: broken byte sequences, special tokens mid-stream, and long enough to trim the window.
    rng = random.Random(0)
    tok = model.ours
    special = [tok.bos_token_id, *tok.eos_token_ids]
    for _ in range(3):
        ids = [
            rng.randrange(tok.vocab_size) if rng.random() > 0.05 else rng.choice(special) for _ in range(700)
        ]
        for skip in (True, False):
            pieces, tail = _stream(tok, ids, skip)
            assert "".join(pieces) + tail == model.ref.decode(ids, skip_special_tokens=skip)


def test_stream_is_windowed(smollm2):
    # O(1) per token: the decoder re-decodes a short window, not the whole sequence.
    tok = smollm2.ours
    ids = tok.encode("word " * 2000, add_special_tokens=False)
    seen: list[int] = []
    backend_decode = tok.backend.decode

    class Counting:
        def decode(self, window, skip_special_tokens=True):
            seen.append(len(window))
            return backend_decode(window, skip_special_tokens=skip_special_tokens)

    from ember.tokenizer import StreamDecoder

    counting = Counting()
    decoder = StreamDecoder(counting.decode)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == tok.decode(ids)
    assert max(seen) <= 4


def test_stream_keeps_space_after_skipped_special_token():
    # Llama-2-style SentencePiece decoders strip the first leading space of whatever they decode, so every
    # window must decode consistently with the full text, also around skipped special tokens.
    from tokenizers import AddedToken, decoders
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    from ember.tokenizer import Tokenizer

    backend = FastTokenizer(BPE(vocab={"▁a": 0, "▁b": 1, "▁c": 2, "<s>": 3}, merges=[]))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    tok = Tokenizer(backend, bos_token_id=3, eos_token_ids=(), chat_template=None)
    for ids in ([3, 0, 3, 1, 3, 3, 2], [0, 3, 1], [3, 3, 0, 1, 3]):
        pieces, tail = _stream(tok, ids)
        assert "".join(pieces) + tail == tok.decode(ids), ids


@pytest.mark.parametrize("ids", [[0, 1, 3], [0, 4, 1, 3], [4, 0, 3, 1], [3, 0, 1], [0, 4, 4, 3, 1, 0]])
def test_stream_byte_fallback_runs(ids):
    # ByteFallback decodes a run of <0x..> pieces at once: "{" alone, but "{" + a stray continuation byte is
    # two U+FFFD, also across a skipped special token (which does not end the run).
    from tokenizers import AddedToken, decoders
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    from ember.tokenizer import Tokenizer

    vocab = {"<0x7B>": 0, "<0x94>": 1, "<0xC3>": 2, "▁a": 3, "<eos>": 4}
    backend = FastTokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(4,), chat_template=None)
    for skip in (True, False):
        pieces, tail = _stream(tok, ids, skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip), (ids, skip, pieces)


def _sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: "▁" pieces, a decoder that strips the first space of what it decodes."""
    from tokenizers import AddedToken, decoders
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    from ember.tokenizer import Tokenizer

    vocab = {"▁a": 0, "▁b": 1, "c": 2, "<s>": 3, "<0xE4>": 4, "<0xB8>": 5, "<0xAD>": 6}
    backend = FastTokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    return Tokenizer(backend, bos_token_id=3, eos_token_ids=(), chat_template=None)


@pytest.mark.parametrize(
    ("prompt", "ids", "text"),
    [
        ([3, 0], [1, 2, 0], " bc a"),  # "a" + "▁b": the answer starts with the space the prompt's text lacks
        ([0, 4], [5, 6, 1], "\ufffd\ufffd b"),  # a prompt ending inside a character: decoded without it
        ([3], [1, 0], "b a"),  # a context that decodes to nothing anchors nothing
        ([], [1, 0], "b a"),
    ],
)
def test_stream_is_the_text_the_ids_add_to_the_prompts(prompt, ids, text):
    tok = _sentencepiece_tokenizer()
    decoder = tok.stream_decoder(prompt_ids=prompt)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == text
    if prompt and prompt[-1] != 4:
        assert tok.decode(prompt + ids) == tok.decode(prompt) + text
