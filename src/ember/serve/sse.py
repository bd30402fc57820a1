"""Server-sent events in OpenAI's framing: `data: <json>\n\n` per chunk, then `data: [DONE]\n\n`."""

from __future__ import annotations

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"

# What a streamed response is sent as; no-cache and no proxy buffering, or tokens arrive in bursts.
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(chunk: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """One `data:` event holding `chunk` as JSON (nulls included, as OpenAI sends them)."""
    return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"
