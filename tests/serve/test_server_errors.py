"""Malformed requests get the right 4xx in OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import json

import httpx2
import pytest

from ember.serve import ServerLimits, create_app

from .conftest import API_KEY, MODEL, LiveServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def chat(**overrides) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **overrides}


def completion(**overrides) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **overrides}


# (name, path, body (dict -> JSON, str/bytes -> raw), headers, status, param)
CASES = [
    ("bad json", CHAT, "{not json", AUTH, 400, None),
    ("json array", CHAT, "[1, 2]", AUTH, 400, None),
    ("empty body", CHAT, "", AUTH, 400, None),
    ("not utf-8", CHAT, b"\xff\xfe{", AUTH, 400, None),
    ("missing model", CHAT, {"messages": MSG}, AUTH, 400, "model"),
    ("missing messages", CHAT, {"model": MODEL}, AUTH, 400, "messages"),
    ("empty messages", CHAT, chat(messages=[]), AUTH, 400, "messages"),
    ("bad role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400, "messages.0.role"),
    (
        "image part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        AUTH,
        400,
        "messages.0.content.0.type",
    ),
    (
        "content as number",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        AUTH,
        400,
        "messages.0.content",
    ),
    ("unknown param", CHAT, chat(frobnicate=True), AUTH, 400, "frobnicate"),
    (
        "unknown message field",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
        AUTH,
        400,
        "messages.0.mood",
    ),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), AUTH, 400, "tools"),
    ("response_format", CHAT, chat(response_format={"type": "json_object"}), AUTH, 400, "response_format"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), AUTH, 400, "functions"),
    ("echo", COMPLETIONS, completion(echo=True), AUTH, 400, "echo"),
    ("best_of", COMPLETIONS, completion(best_of=3), AUTH, 400, "best_of"),
    ("suffix", COMPLETIONS, completion(suffix="end"), AUTH, 400, "suffix"),
    ("max_tokens as string", CHAT, chat(max_tokens="4"), AUTH, 400, "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=4.5), AUTH, 400, "max_tokens"),
    ("stream as int", CHAT, chat(stream=1), AUTH, 400, "stream"),
    ("negative max_tokens", CHAT, chat(max_tokens=-1), AUTH, 400, "max_tokens"),
    ("zero max_tokens", COMPLETIONS, completion(max_tokens=0), AUTH, 400, "max_tokens"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**12), AUTH, 400, "max_tokens"),
    ("negative temperature", CHAT, chat(temperature=-0.5), AUTH, 400, "temperature"),
    ("temperature above 2", CHAT, chat(temperature=3), AUTH, 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), AUTH, 400, "top_p"),
    ("penalty out of range", CHAT, chat(presence_penalty=5), AUTH, 400, "presence_penalty"),
    ("n zero", CHAT, chat(n=0), AUTH, 400, "n"),
    ("n above limit", CHAT, chat(n=1000), AUTH, 400, "n"),
    ("too many stops", CHAT, chat(stop=["a", "b", "c", "d", "e"]), AUTH, 400, "stop"),
    ("empty stop", CHAT, chat(stop=[""]), AUTH, 400, "stop"),
    ("top_logprobs too big", CHAT, chat(logprobs=True, top_logprobs=50), AUTH, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), AUTH, 400, "top_logprobs"),
    ("completion logprobs too big", COMPLETIONS, completion(logprobs=6), AUTH, 400, "logprobs"),
    ("logit_bias bad key", CHAT, chat(logit_bias={"abc": 1}), AUTH, 400, "logit_bias"),
    ("logit_bias out of vocab", CHAT, chat(logit_bias={"99999999": 1}), AUTH, 400, "logit_bias"),
    ("logit_bias value", CHAT, chat(logit_bias={"5": 500}), AUTH, 400, "logit_bias.5"),
    (
        "stream_options without stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        AUTH,
        400,
        "stream_options",
    ),
    ("seed too big", CHAT, chat(seed=2**70), AUTH, 400, "seed"),
    ("prompt token out of vocab", COMPLETIONS, completion(prompt=[1, 10**9]), AUTH, 400, "prompt"),
    ("empty token prompt", COMPLETIONS, completion(prompt=[]), AUTH, 400, "prompt"),
    ("prompt too long", COMPLETIONS, completion(prompt="hello " * 2000), AUTH, 400, "prompt"),
    (
        "prompt + max_tokens beyond context",
        COMPLETIONS,
        completion(prompt="hello " * 300, max_tokens=400),
        AUTH,
        400,
        "prompt",
    ),
    ("wrong model", CHAT, chat(model="gpt-4o"), AUTH, 404, "model"),
    ("no api key", CHAT, chat(), {}, 401, None),
    ("wrong api key", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None),
    ("wrong scheme", CHAT, chat(), {"Authorization": f"Basic {API_KEY}"}, 401, None),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, AUTH, 404, None),
    ("body too large", CHAT, chat(messages=[{"role": "user", "content": "x" * (2 << 20)}]), AUTH, 413, None),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx2.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request(http, path, body, headers, status, param):
    content = json.dumps(body) if isinstance(body, dict) else body
    r = http.post(path, content=content, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    if status == 400 and param and "." not in param:
        assert param in error["message"], error


def test_context_error_names_the_token_counts(http):
    r = http.post(COMPLETIONS, json=completion(prompt="hello " * 300, max_tokens=400), headers=AUTH)
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "301 tokens" in error["message"] and "512" in error["message"], error


def test_empty_prompt_is_an_invalid_value_not_a_context_error(http):
    r = http.post(COMPLETIONS, json=completion(prompt=[]), headers=AUTH)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "invalid_value" and "empty" in error["message"], error


def test_wrong_method_and_auth_free_health(http):
    assert http.get(CHAT, headers=AUTH).status_code == 405
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/metrics").status_code == 401
    assert http.get("/v1/models").status_code == 401


def test_no_op_values_of_unsupported_params_pass(http):
    r = http.post(
        CHAT,
        json=chat(tools=[], tool_choice="none", response_format={"type": "text"}, store=False),
        headers=AUTH,
    )
    assert r.status_code == 200, r.text


def test_server_keeps_serving_after_errors(http):
    for case in CASES:
        content = json.dumps(case[2]) if isinstance(case[2], dict) else case[2]
        http.post(case[1], content=content, headers=case[3])
    r = http.post(CHAT, json=chat(temperature=0), headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    metrics = http.get("/metrics", headers=AUTH).text
    assert 'ember_http_requests_total{code="400",route="/v1/chat/completions"}' in metrics


def test_no_chat_template_is_400(tmp_path, tiny_llama_dir):
    from ember.llm import LLM

    from .conftest import ENGINE

    base = tmp_path / "base"
    base.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name == "chat_template.jinja":
            continue
        data = f.read_bytes()
        if f.name == "tokenizer_config.json":
            cfg = json.loads(data)
            cfg.pop("chat_template", None)
            data = json.dumps(cfg).encode()
        (base / f.name).write_bytes(data)
    llm = LLM(base, device="cpu", engine_config=ENGINE)
    assert llm.tokenizer.chat_template is None
    server = LiveServer(create_app(llm, model_name=MODEL))
    try:
        with httpx2.Client(base_url=server.url) as c:
            r = c.post(CHAT, json=chat())
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
            assert "no chat template" in r.json()["error"]["message"]
            assert c.post(COMPLETIONS, json=completion()).status_code == 200
    finally:
        server.stop()


def test_queue_full_is_429_with_retry_after(tiny_llama_dir):
    from ember.llm import LLM

    from .conftest import ENGINE

    llm = LLM(
        tiny_llama_dir, device="cpu", engine_config=ENGINE
    )  # its own engine: one engine thread per core
    server = LiveServer(create_app(llm, model_name=MODEL, limits=ServerLimits(max_waiting=2)))
    try:
        with httpx2.Client(base_url=server.url) as c:
            r = c.post(CHAT, json=chat(n=3))
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert c.post(CHAT, json=chat(n=2)).status_code == 200
    finally:
        server.stop()
