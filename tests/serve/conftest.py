"""Live servers for the server tests: a real uvicorn on a free loopback port, in a background thread.

Nothing is mocked: the app runs the tiny random Llama (real SmolLM2 tokenizer and chat template) on the real
engine. `tiny_server` is shared by the whole session; tests that need other limits start their own.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from ember.engine.core import EngineConfig
from ember.llm import LLM
from ember.serve import ServerLimits, create_app

API_KEY = "test-key"
MODEL = "tiny"
# A small KV cache (a few thousand tokens) keeps allocation instant and makes leaked blocks visible.
ENGINE = EngineConfig(kv_cache_memory=16 << 20, max_num_seqs=64)


class LiveServer:
    def __init__(self, app, *, drain_timeout: int = 5) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    @property
    def state(self):
        return self.app.state.serving

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, device="cpu", dtype="float32", engine_config=ENGINE)


@pytest.fixture(scope="session")
def tiny_server(tiny_llm):
    server = LiveServer(
        create_app(tiny_llm, model_name=MODEL, api_key=API_KEY, limits=ServerLimits(max_body_bytes=1 << 20))
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference_llm(tiny_llama_dir: Path) -> LLM:
    """A second copy of the tiny model, outside the server, to compute expected outputs."""
    return LLM(tiny_llama_dir, device="cpu", dtype="float32", engine_config=ENGINE)


@pytest.fixture
def client(tiny_server):
    from openai import OpenAI

    with OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c
