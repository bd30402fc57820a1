"""Stop strings over a real streaming detokenizer: split across tokens, held back, never shown."""

from __future__ import annotations

import pytest

from ember.engine.output import TextAssembler
from ember.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_tokenizer_dir)


def run(tokenizer: Tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    assembler = TextAssembler(tokenizer.stream_decoder(), stop)
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        pieces.append(assembler.push(token))
        if assembler.stopped:
            break
    pieces.append(assembler.finish())
    return pieces, assembler.text, assembler.stopped


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42. END of story", ("END",), "The answer is 42. "),
        ("alpha beta\n\ngamma", ("\n\n",), "alpha beta"),
        ("count: 1, 2, 3, 4", ("3, 4", "never"), "count: 1, 2, "),
        ("emoji 🎉🎉 then stop🎉", ("stop🎉",), "emoji 🎉🎉 then "),
        ("no stop here at all", ("zzz",), "no stop here at all"),
        ("ends with a partial sto", ("stop",), "ends with a partial sto"),
        # One token (" the") holds both: the earliest in the text wins, not the first in the list.
        ("on the hill", ("e", "t"), "on "),
    ],
)
def test_stop_strings(tokenizer, text, stop, expected):
    pieces, full, stopped = run(tokenizer, text, stop)
    assert full == "".join(pieces) == expected
    assert stopped == (expected != text)
    for piece in pieces:  # nothing released ever contains (the start of) a stop string that then completed
        assert not any(s in piece for s in stop)


def test_without_stop_strings_text_streams_as_decoded(tokenizer):
    text = "Streaming 日本語 and emoji 👩‍👩‍👧 keep every character whole."
    pieces, full, stopped = run(tokenizer, text, ())
    assert full == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    assert not stopped and all("\ufffd" not in p for p in pieces)


def test_stop_string_completed_by_the_final_flush(tokenizer):
    """Bytes that are no character yet are held back and become U+FFFD only when the text ends: a stop string
    they complete is found then, and the caller learns it from `stopped` after finish()."""
    token = tokenizer.backend.token_to_id("Ģ")  # GPT-2's byte-level 0x80: a continuation byte with no lead
    assembler = TextAssembler(tokenizer.stream_decoder(), ("a\ufffd",))
    pieces = [assembler.push(t) for t in tokenizer.encode("data", add_special_tokens=False) + [token] * 2]
    assert "".join(pieces) == "dat" and not assembler.stopped
    assert assembler.finish() == "" and assembler.text == "dat" and assembler.stopped
