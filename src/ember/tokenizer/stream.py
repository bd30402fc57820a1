"""Incremental detokenization: turn generated token ids into text pieces as they arrive.

One token is not one piece of text. A byte-level BPE token can hold half of a UTF-8 character (emoji, CJK),
and SentencePiece decoders treat the first token of a string specially (a leading "▁" may be stripped).
`StreamDecoder` therefore decodes a short window of recent ids, `ids[prefix_offset:]`, and compares it with
the text the already-emitted part of that window decodes to, `ids[prefix_offset:read_offset]`; the
difference is the new text. Text that ends in U+FFFD is an incomplete character and is held back until a
later token completes it (or `flush()` gives up). Each step decodes a window of a few tokens, so streaming
is O(1) per token rather than a re-decode of the whole output.

Byte-fallback pieces (SentencePiece's `<0xE4>`) need more: the decoder turns a whole run of them into text at
once, and a run that is not valid UTF-8 becomes one U+FFFD per byte, including bytes that were a complete
character before the run went on (`<0x7B>` is "{", `<0x7B><0x94>` is "\ufffd\ufffd"). Text is therefore held
while the latest id that the decode keeps is a byte piece, and released when the run ends.

Invariant, tested against the full decode: `"".join(push(i) for i in ids) + flush() == decode(ids)`; with a
`context`, `decode(context + ids)` less `decode(context)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StreamDecoder"]

# Ids already emitted and outside the window are dropped once this many pile up (amortised O(1) trimming).
_TRIM_AT = 256


class StreamDecoder:
    """Feeds token ids one at a time and returns only text that no later token can change."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        byte_ids: frozenset[int] = frozenset(),
        skipped_ids: frozenset[int] = frozenset(),
        context: Sequence[int] = (),
    ) -> None:
        """`decode(ids) -> str` must be the tokenizer's decode with the caller's skip_special_tokens choice.

        `byte_ids` are the byte-fallback pieces; `skipped_ids` the ids that `decode` drops (special tokens
        under skip_special_tokens), which leave a run of byte pieces open rather than ending it. `context`: the
        ids before the first pushed one (a prompt's last few), decoded with it but never returned, so that the
        text is what the ids add to the prompt's: a decoder that strips the start of a decode (SentencePiece's
        leading "▁") would otherwise drop the space the first generated token begins with ("is" + "▁Paris"
        must give " Paris", as llama.cpp, vLLM and TGI give it). A context that ends inside a character is not
        used (the character's completion would change text already counted as the prompt's).
        """
        self._decode = decode
        self._byte_ids = byte_ids
        self._skipped_ids = skipped_ids
        self._in_byte_run = False  # the latest id the decode keeps is a byte piece
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: decoding from here gives the same text as the full decode
        self._read_offset = 0  # end of what has been emitted
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), cached between steps
        if context and context[-1] not in byte_ids:
            text = decode(list(context))
            if not text.endswith("\ufffd"):
                self._ids, self._read_offset, self._prefix_text = list(context), len(context), text

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        if token_id in self._byte_ids:
            self._in_byte_run = True
        elif token_id not in self._skipped_ids:
            self._in_byte_run = False
        if self._in_byte_run:  # a later byte piece could still turn this run into U+FFFDs
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        new = text[len(self._prefix_text) :]
        self._advance(text)
        return new

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes to U+FFFD, as decode() does)."""
        if self._read_offset == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        new = text[len(self._prefix_text) :]
        self._advance(text)
        return new

    def _advance(self, text: str) -> None:
        # The emitted tokens become the new window prefix, unless they decode to nothing: such a prefix is no
        # anchor for decoders that strip the start of a decode (SentencePiece's leading "▁"), so keep the old one.
        emitted_text = self._decode(self._ids[self._read_offset :])
        if emitted_text:
            self._prefix_offset, self._prefix_text = self._read_offset, emitted_text
        else:
            self._prefix_text = text
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
