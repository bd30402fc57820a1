"""Graceful shutdown: SIGTERM stops intake, lets running streams finish, and past the drain timeout ends them
with an error event and `data: [DONE]` (never a cut connection); no KV block stays allocated."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from ember.llm import LLM
from ember.serve import create_app
from ember.serve.app import begin_drain

from .conftest import ENGINE, MODEL, LiveServer

SRC = Path(__file__).parents[2] / "src"


def read_events(response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_drain_timeout_ends_running_streams_cleanly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", engine_config=ENGINE)
    server = LiveServer(create_app(llm, model_name=MODEL))
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 500, "stream": True}
    try:
        with httpx2.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: {")
                begin_drain(server.app, drain_timeout=0)
                events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert "shutting down" in error["message"] and error["type"] == "server_error"
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503 and "Retry-After" in r.headers
            stats = server.state.engine.stats()
            assert stats.kv_blocks_used == 0 and stats.running == 0
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_lets_running_streams_finish(tiny_llama_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "EMBER_API_KEY": "k"}
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", str(tiny_llama_dir), "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--device", "cpu", "--kv-cache-gib", "0.02"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx2.Client(base_url=url, timeout=30) as http:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx2.TransportError:
                    time.sleep(0.1)
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 60, "temperature": 0, "stream": True}
            headers = {"Authorization": "Bearer k"}
            events: list[str] = []
            started = threading.Event()

            def consume() -> None:
                with (
                    httpx2.Client(base_url=url, timeout=60) as c,
                    c.stream("POST", "/v1/completions", json=body, headers=headers) as r,
                ):
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: ") :])
                            started.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert started.wait(30)
            proc.send_signal(signal.SIGTERM)
            reader.join(60)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(1 for c in chunks if c["choices"][0]["text"] or c["choices"][0]["finish_reason"]) >= 1
            # Intake is closed: the listening socket is gone (or, in the instant before, the answer is 503).
            with contextlib.suppress(httpx2.TransportError):
                r = http.post("/v1/completions", json={**body, "stream": False}, headers=headers)
                assert r.status_code == 503
        # uvicorn re-raises the signal once it has shut down, so the exit is "killed by SIGTERM", after a
        # complete shutdown (the lifespan's, which stops the engine).
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
