"""The real default model through the server: greedy answers equal `ember generate`'s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from ember.engine.core import EngineConfig
from ember.llm import LLM
from ember.serve import create_app

from .conftest import LiveServer

SRC = Path(__file__).parents[2] / "src"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    llm = LLM(smollm2_gguf, device="cpu", engine_config=EngineConfig(kv_cache_memory=64 << 20))
    server = LiveServer(create_app(llm, model_name="smollm2"))
    yield server
    server.stop()


def test_greedy_chat_equals_ember_generate(smollm2_server, smollm2_gguf):
    cmd = [sys.executable, "-m", "ember.cli.main", "generate", PROMPT, "--model", str(smollm2_gguf), "--json"]
    cmd += ["--temperature", "0", "--max-new-tokens", str(MAX_TOKENS), "--device", "cpu"]
    out = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, check=True
    )
    expected = json.loads(out.stdout)
    with OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in expected["text"]
    assert r.choices[0].message.content == expected["text"] == streamed
    assert r.choices[0].finish_reason == expected["finish_reason"]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    assert r.usage.completion_tokens == expected["completion_tokens"]
