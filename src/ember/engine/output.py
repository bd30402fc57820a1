"""From generated token ids to text: streaming detokenization plus stop strings.

A stop string may arrive split across tokens, so text that could still become the start of a stop string is
held back until it cannot; when a stop string completes, the text before it is the final output and the
stop string itself is never shown (as in OpenAI's API).
"""

from __future__ import annotations

from typing import Protocol


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextAssembler:
    def __init__(self, decoder: StreamDecoder, stop: tuple[str, ...] = ()) -> None:
        self.decoder = decoder
        self.stop = stop
        self.text = ""  # everything released so far
        self._pending = ""  # decoded but held back: it may be the beginning of a stop string
        self.stopped = False

    def _release(self, final: bool) -> str:
        pending = self._pending
        # The earliest stop string in the text wins, not the first in the list: one token can hold several.
        found = [idx for s in self.stop if (idx := pending.find(s)) != -1]
        if found:
            self.stopped = True
            self._pending = ""
            return pending[: min(found)]
        if final or not self.stop:
            self._pending = ""
            return pending
        # Keep the longest suffix that is a prefix of some stop string.
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(pending)), 0, -1):
                if pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        return out

    def push(self, token_id: int) -> str:
        """Feeds one token; returns the text it makes final (possibly ""). Check `stopped` afterwards."""
        if self.stopped:
            return ""
        self._pending += self.decoder.push(token_id)
        out = self._release(final=False)
        self.text += out
        return out

    def finish(self) -> str:
        """Ends the stream: releases what was held back (unless a stop string already ended it). Check
        `stopped` afterwards too: the decoder's flush (an incomplete character, as U+FFFD) can complete a stop
        string, which then ends the text as one found by `push` does."""
        if self.stopped:
            return ""
        self._pending += self.decoder.flush()
        out = self._release(final=True)
        self.text += out
        return out
