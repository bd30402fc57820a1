"""Many streams at once give the answers they give alone; clients that leave free their KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx2
from openai import AsyncOpenAI

from .conftest import API_KEY, MODEL, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "pack",
    "boxes",
    "of",
    "jugs",
]


def prompts(k: int) -> list[str]:
    # Different lengths and contents, so the batch mixes prefill chunks and decodes of different lengths.
    return [" ".join(WORDS[i % len(WORDS) :] + WORDS[: i % 5]) + f" {i}" for i in range(k)]


async def _stream_text(client: AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_32_concurrent_streams_equal_one_at_a_time(tiny_server):
    async def main():
        async with AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            ps = prompts(32)
            alone = [await _stream_text(client, p, 16) for p in ps]
            together = await asyncio.gather(*(_stream_text(client, p, 16) for p in ps))
            return alone, together

    alone, together = asyncio.run(main())
    assert together == alone
    assert all(finish == "length" for _, finish in alone)


def _wait_idle(http: httpx2.Client, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics", headers=AUTH).text
        idle = (
            metric(text, "ember_num_requests_running") == 0
            and metric(text, "ember_num_requests_waiting") == 0
            and metric(text, "ember_kv_cache_blocks_used") == 0
        )
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_disconnected_streams_free_their_blocks(tiny_server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx2.Client(base_url=tiny_server.url, timeout=30) as http:
        _wait_idle(http)
        aborted_before = tiny_server.state.metrics.finished.labels("abort")._value.get()
        streams = [http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) for _ in range(4)]
        for s in streams:
            response = s.__enter__()
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few events in: the request holds KV blocks now
            assert any(line.startswith("data: {") for line in got)
        stats = tiny_server.state.engine.stats()
        assert stats.running + stats.waiting > 0 and stats.kv_blocks_used > 0
        for s in streams:
            s.__exit__(None, None, None)  # the client hangs up mid-stream
        text = _wait_idle(http)
        assert metric(text, "ember_kv_cache_blocks_used") == 0, text
        assert metric(text, "ember_num_requests_running") == 0
        assert tiny_server.state.metrics.finished.labels("abort")._value.get() - aborted_before == 4
        # The server still serves.
        r = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, headers=AUTH)
        assert r.status_code == 200


def test_client_timeout_on_non_streaming_request_frees_blocks(tiny_server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 500, "temperature": 0}
    with httpx2.Client(base_url=tiny_server.url, timeout=30) as http:
        _wait_idle(http)
        with contextlib.suppress(httpx2.TimeoutException):
            http.post("/v1/completions", json=body, headers=AUTH, timeout=0.3)
        text = _wait_idle(http)
        assert metric(text, "ember_kv_cache_blocks_used") == 0, text
        assert metric(text, "ember_num_requests_running") == 0
