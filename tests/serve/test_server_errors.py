"""Malformed requests get the right 4xx in OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time

import httpx2
import pytest

from ember.serve import ServerLimits, create_app
from tests.conftest import make_tiny_llama_dir

from .conftest import API_KEY, MODEL, LiveServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def chat(**overrides) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **overrides}


def completion(**overrides) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **overrides}


def huge(body: dict) -> str:
    """`body` as JSON text with each "HUGE" written as an integer of 4301 digits: valid JSON, but past the
    4300 digits Python's int() converts."""
    return json.dumps(body).replace('"HUGE"', "9" * 4301)


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
    (
        "huge max_completion_tokens",
        CHAT,
        chat(max_tokens=None, max_completion_tokens=10**12),
        AUTH,
        400,
        "max_completion_tokens",
    ),
    ("4301-digit max_tokens", CHAT, huge(chat(max_tokens="HUGE")), AUTH, 400, None),
    ("4301-digit seed", CHAT, huge(chat(seed="HUGE")), AUTH, 400, None),
    ("4301-digit logit_bias", CHAT, huge(chat(logit_bias={"5": "HUGE"})), AUTH, 400, None),
    ("4301-digit prompt token", COMPLETIONS, huge(completion(prompt=[1, "HUGE"])), AUTH, 400, None),
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
    # str.isdigit() takes these, int() refuses the first two and reads the third as 1.
    ("logit_bias superscript key", CHAT, chat(logit_bias={"\u00b2": 1}), AUTH, 400, "logit_bias"),
    ("logit_bias 5000-digit key", CHAT, chat(logit_bias={"1" * 5000: 1}), AUTH, 400, "logit_bias"),
    ("logit_bias Arabic-Indic key", CHAT, chat(logit_bias={"\u0661": 1}), AUTH, 400, "logit_bias"),
    ("logit_bias spaced key", COMPLETIONS, completion(logit_bias={" 1": 1}), AUTH, 400, "logit_bias"),
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
    # A lone UTF-16 surrogate is valid JSON ("\ud800") but not Unicode text.
    ("lone surrogate prompt", COMPLETIONS, completion(prompt="\ud800 hi"), AUTH, 400, "prompt"),
    ("lone surrogate in prompts", COMPLETIONS, completion(prompt=["a", "\udfff"]), AUTH, 400, "prompt.1"),
    (
        "lone surrogate content",
        CHAT,
        chat(messages=[{"role": "user", "content": "\udfff"}]),
        AUTH,
        400,
        "messages.0.content",
    ),
    (
        "lone surrogate content part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]),
        AUTH,
        400,
        "messages.0.content.0.text",
    ),
    ("lone surrogate model", CHAT, chat(model="\ud800"), AUTH, 400, "model"),
    ("deeply nested json", CHAT, "[" * 100_000 + "]" * 100_000, AUTH, 400, None),
    (
        "assistant tool_calls",
        CHAT,
        chat(messages=[*MSG, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, *MSG]),
        AUTH,
        400,
        "messages.1.tool_calls",
    ),
    (
        "assistant refusal",
        CHAT,
        chat(messages=[*MSG, {"role": "assistant", "content": "x", "refusal": "no"}, *MSG]),
        AUTH,
        400,
        "messages.1.refusal",
    ),
    (
        "user content null",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        AUTH,
        400,
        "messages.0.content",
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


def test_integer_past_the_digit_limit_is_answered_as_invalid_json(http):
    headers = {"Content-Type": "application/json", **AUTH}
    invalid = http.post(CHAT, content="{not json", headers=headers).json()["error"]
    r = http.post(COMPLETIONS, content=huge(completion(max_tokens="HUGE")), headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error == {**invalid, "message": "request body holds an integer of more than 4300 digits"}
    assert error["code"] == "invalid_json"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limit_errors_name_the_field_sent(http, field):
    """max_completion_tokens is OpenAI's newer name of max_tokens: errors name the one the request used."""
    r = http.post(CHAT, json={"model": MODEL, "messages": MSG, field: 10**12}, headers=AUTH)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field, error
    assert error["message"] == f"{field}=1000000000000 exceeds the limit of 512"

    messages = [{"role": "user", "content": "hello " * 300}]
    r = http.post(CHAT, json={"model": MODEL, "messages": messages, field: 400}, headers=AUTH)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == "messages" and f" {field}=400," in error["message"], error


def test_empty_prompt_is_an_invalid_value_not_a_context_error(http):
    r = http.post(COMPLETIONS, json=completion(prompt=[]), headers=AUTH)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "invalid_value" and "empty" in error["message"], error


def test_wrong_method_and_auth_free_health(http):
    assert http.get(CHAT, headers=AUTH).status_code == 405
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/metrics").status_code == 401
    assert http.get("/v1/models").status_code == 401


def test_explicit_null_is_the_default(http):
    """OpenAI's API takes null for every optional parameter, also where the default is not null."""
    nulls = dict.fromkeys(
        [
            "frequency_penalty",
            "logit_bias",
            "n",
            "presence_penalty",
            "seed",
            "stop",
            "stream",
            "stream_options",
        ]
        + ["temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos"]
    )
    r = http.post(
        CHAT, json=chat(**nulls, logprobs=None, top_logprobs=None, max_completion_tokens=None), headers=AUTH
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None and choice["finish_reason"] == "length"
    r = http.post(COMPLETIONS, json=completion(**nulls, logprobs=None), headers=AUTH)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = http.post(CHAT, json=chat(stream=True, stream_options={"include_usage": None}), headers=AUTH)
    assert r.status_code == 200 and '"usage"' not in r.text and r.text.endswith("data: [DONE]\n\n")


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


def test_chat_template_refusing_the_messages_is_400(tmp_path, tiny_llama_dir):
    """Llama 2, Mistral and Gemma templates refuse roles that do not alternate (`raise_exception`): the
    request's fault, answered 400 as OpenAI does, before a stream starts as well."""
    from openai import BadRequestError, OpenAI

    from ember.llm import LLM

    from .conftest import ENGINE

    strict = tmp_path / "strict"
    shutil.copytree(tiny_llama_dir, strict)
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    server = LiveServer(create_app(LLM(strict, device="cpu", engine_config=ENGINE), model_name=MODEL))
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            kw = {"model": MODEL, "max_tokens": 2}
            assert client.chat.completions.create(messages=MSG, **kw).choices[0].finish_reason
            for stream in (False, True):
                with pytest.raises(BadRequestError) as e:
                    client.chat.completions.create(messages=MSG * 2, stream=stream, **kw)
                assert e.value.status_code == 400
                assert e.value.body["type"] == "invalid_request_error"
                assert e.value.body["param"] == "messages" and e.value.body["code"] == "invalid_value"
                assert "Conversation roles must alternate" in e.value.body["message"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory, smollm2_tokenizer_dir):
    """The tiny Llama with room for 8192 positions: a request that cannot finish while a test looks at it."""
    return make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-long"), smollm2_tokenizer_dir, max_position_embeddings=8192
    )


@pytest.fixture
def queue_server(long_context_dir):
    """A server running one sequence at a time with room for 4 waiting: its queue is easy to fill."""
    from ember.engine.core import EngineConfig
    from ember.llm import LLM

    # Its own engine (one engine thread per core).
    llm = LLM(
        long_context_dir, device="cpu", engine_config=EngineConfig(kv_cache_memory=16 << 20, max_num_seqs=1)
    )
    server = LiveServer(create_app(llm, model_name=MODEL, limits=ServerLimits(max_waiting=4)))
    yield server
    server.stop()


def wait_until_idle(server: LiveServer, timeout: float = 30) -> None:
    """Until the engine holds no sequence and no admitted job waits to be queued (closed streams cancel theirs)."""
    deadline = time.monotonic() + timeout
    state = server.state
    while (stats := state.engine.stats()).running or stats.waiting or any(r.unqueued for r in state.admitted):
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {stats}"
        time.sleep(0.01)


def test_queue_full_is_429_and_too_many_jobs_is_400(queue_server):
    # 8000 tokens take seconds even for the tiny model: the one running sequence is still running, and its
    # 4 waiting jobs still waiting, when the third request arrives (400 tokens could finish before it did).
    long = completion(max_tokens=8000, ignore_eos=True, stream=True)
    with httpx2.Client(base_url=queue_server.url, timeout=30) as c:
        with c.stream("POST", COMPLETIONS, json=long) as running:
            # Held: an iterator dropped after its first line is closed at once, and closing it closes the
            # connection, which cancels the request (the queue then had room for the third request).
            lines = running.iter_lines()
            assert next(lines).startswith("data: {")  # it runs: the one sequence is taken
            with c.stream("POST", COMPLETIONS, json={**long, "n": 4}) as waiting:
                assert waiting.status_code == 200  # its 4 jobs fill the queue
                r = c.post(CHAT, json=chat())
                assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
                assert r.json()["error"]["code"] == "queue_full"
        # More jobs than the queue ever holds: retrying cannot help, so it is no 429.
        for body, param in [(chat(n=5), "n"), (completion(prompt=["a", "b", "c"], n=2), "prompt")]:
            r = c.post(CHAT if "messages" in body else COMPLETIONS, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "at most 4" in r.json()["error"]["message"]
        wait_until_idle(queue_server)
        assert c.post(CHAT, json=chat(n=4)).status_code == 200


def test_requests_arriving_together_are_refused_before_their_200(queue_server):
    """Jobs are queued some event-loop turns after admission: requests arriving in between must count them,
    or each passes the check and the late ones fail inside a stream that has already answered 200."""

    async def one(c: httpx2.AsyncClient, i: int) -> tuple[int, str]:
        body = completion(prompt=f"Number {i}", n=4, max_tokens=2, stream=True)
        async with c.stream("POST", COMPLETIONS, json=body) as r:
            return r.status_code, (await r.aread()).decode()

    async def main() -> list[tuple[int, str]]:
        limits = httpx2.Limits(max_connections=32)
        async with httpx2.AsyncClient(base_url=queue_server.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(24)))

    results = asyncio.run(main())
    statuses = sorted(status for status, _ in results)
    assert 200 in statuses and 429 in statuses and set(statuses) == {200, 429}, statuses
    for status, text in results:
        if status == 200:
            assert '"error"' not in text and text.endswith("data: [DONE]\n\n"), text
    stats = queue_server.state.engine.stats()
    assert stats.waiting == 0 and not queue_server.state.admitted  # nothing left counted as admitted


def test_internal_error_is_openai_500_and_keeps_the_connection(tiny_llama_dir):
    """An unexpected exception is answered in OpenAI's error body, counted, and the keep-alive connection
    serves the next request (Starlette's own handler re-raises, which makes uvicorn close it)."""
    from ember.llm import LLM

    from .conftest import ENGINE

    app = create_app(LLM(tiny_llama_dir, device="cpu", engine_config=ENGINE), model_name=MODEL)

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.router.add_api_route("/broken", broken)  # a route with a bug: the app must contain it
    server = LiveServer(app)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            reader = sock.makefile("rb")
            for path, status in [("/broken", 500), ("/health", 200), ("/broken", 500)]:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
                assert reader.readline().split()[1] == str(status).encode(), path
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.lower()] = value.strip()
                assert headers.get("connection") != "close"
                body = json.loads(reader.read(int(headers["content-length"])))
                if status == 500:
                    assert body["error"] == {
                        "message": "internal server error (RuntimeError)",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
        assert server.state.metrics.http_requests.labels("other", "500")._value.get() == 2
    finally:
        server.stop()
