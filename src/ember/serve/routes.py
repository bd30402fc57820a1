"""The routes: parse a body, turn it into token ids and SamplingParams, run it on the engine, answer.

Everything that can be refused is refused before the first byte of a response (bad parameters, a prompt that
does not fit, a full queue), so a streamed response never starts with a 200 and then fails for a reason that
was known up front. Each of the n choices (and each prompt of a batched completion) is its own engine
request; `_run_jobs` merges their updates. Closing a stream early — a client that disconnects — cancels the
tasks feeding it, and leaving `AsyncEngine.generate` early aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ember import __version__
from ember.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from ember.engine.core import RequestUpdate
from ember.engine.sampler import SamplingParams
from ember.errors import ContextLengthError, EmberError, TokenizerError
from ember.serve import sse
from ember.serve.errors import APIError, from_validation_error
from ember.serve.metrics import CONTENT_TYPE, ServerMetrics
from ember.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ember.tokenizer.tokenizer import Tokenizer

FINGERPRINT = f"ember-{__version__}"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; beyond these it gets a 4xx naming the limit."""

    max_body_bytes: int = 4 << 20  # 413 above this
    max_n: int = 16  # choices per request
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_prompts: int = 64  # prompts in one batched /v1/completions request
    max_tokens: int | None = None  # cap on max_tokens; None: the context length
    max_waiting: int = 256  # queued engine requests before 429
    drain_timeout: float = 30.0  # seconds running requests get to finish at shutdown


@dataclass
class ServingState:
    """What the routes share: the engine, the tokenizer, the limits, the metrics."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    limits: ServerLimits
    metrics: ServerMetrics
    generation_defaults: dict
    eos_token_ids: frozenset[int]
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: no new requests, running ones finish

    @property
    def vocab_size(self) -> int:
        return self.engine.core.loaded.config.vocab_size

    def token_text(self, token_id: int) -> str:
        return _token_text(self.tokenizer, token_id)


@lru_cache(maxsize=1 << 16)
def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class Job:
    """One engine request: choice `index` of the response."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


router = APIRouter()

# ---------------------------------------------------------------------------------------------- parsing


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 past `limit` bytes (checked while reading, not after)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="body_too_large"
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(
            400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json"
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _serving(request: Request) -> ServingState:
    return request.app.state.serving


def _check_model(state: ServingState, model: str) -> None:
    if model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _check_intake(state: ServingState, num_jobs: int) -> None:
    if state.draining:
        raise APIError(
            503, "the server is shutting down", code="server_shutting_down", headers={"Retry-After": "5"}
        )
    waiting = state.engine.core.num_waiting()
    if waiting + num_jobs > state.engine.max_waiting:
        raise APIError(
            429,
            f"{waiting} requests are already queued (limit {state.engine.max_waiting}); retry later",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


def sampling_params(
    state: ServingState,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """The engine's SamplingParams for one choice; unset sampling knobs take the model's generation_config."""
    limits = state.limits
    if req.n > limits.max_n:
        raise APIError(400, f"n={req.n} exceeds the limit of {limits.max_n}", param="n", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise APIError(
            400,
            f"stop has {len(stop)} strings; at most {limits.max_stop} are allowed",
            param="stop",
            code="invalid_value",
        )
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    cap = limits.max_tokens or state.engine.core.context
    if max_tokens is not None and max_tokens > cap:
        raise APIError(
            400,
            f"max_tokens={max_tokens} exceeds the limit of {cap}",
            param="max_tokens",
            code="invalid_value",
        )
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < state.vocab_size:
            raise APIError(
                400,
                f"logit_bias key {key!r} is not a token id in [0, {state.vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        bias[int(key)] = value
    knobs = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = state.generation_defaults.get(name)
        if value is not None:
            knobs[name] = value
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            seed=req.seed,
            stop=tuple(stop),
            logprobs=logprobs,
            logit_bias=bias,
            ignore_eos=req.ignore_eos,
            **knobs,
        )
    except EmberError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def make_jobs(
    state: ServingState, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int, param: str
) -> list[Job]:
    """n jobs per prompt (choice index = prompt * n + j), each checked against the context before any runs."""
    for ids in prompts:
        try:
            state.engine.core.validate(ids, params)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except EmberError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
    jobs = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            # With a seed, choice j uses seed + j: n different samples, each reproducible (as LLM.generate).
            sub = params if params.seed is None else replace(params, seed=params.seed + j)
            index = p * n + j
            jobs.append(Job(index, f"{request_id}-{index}", ids, sub))
    _check_intake(state, len(jobs))
    return jobs


# --------------------------------------------------------------------------------------------- running


async def _run_jobs(
    state: ServingState, jobs: list[Job], arrival: float
) -> AsyncIterator[tuple[Job, RequestUpdate]]:
    """Merges the updates of every job as they come; records latency and token metrics."""
    queue: asyncio.Queue[tuple[Job, RequestUpdate | BaseException]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for update in state.engine.generate(job.request_id, job.prompt_ids, job.params):
                queue.put_nowait((job, update))
        except (QueueFullError, EngineStoppedError, EmberError) as e:
            queue.put_nowait((job, e))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    m = state.metrics
    first: dict[int, float] = {}
    remaining = len(jobs)
    try:
        while remaining:
            job, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            now = time.monotonic()
            if item.token_ids and job.index not in first:
                first[job.index] = now
                m.ttft.observe(now - arrival)
            m.generation_tokens.inc(len(item.token_ids))
            if item.finish_reason is not None:
                remaining -= 1
                m.finished.labels(item.finish_reason).inc()
                m.prompt_tokens.inc(item.prompt_tokens)
                m.e2e.observe(now - arrival)
                if item.completion_tokens > 1 and job.index in first:
                    m.tpot.observe((now - first[job.index]) / (item.completion_tokens - 1))
            yield job, item
    finally:
        # Cancelling a task makes its engine.generate() exit early, which aborts the engine request.
        for task in tasks:
            task.cancel()
        if remaining:  # the client left (or an error ended the response) before these jobs finished
            m.finished.labels("abort").inc(remaining)


def _raise_for_unfinished(update: RequestUpdate) -> None:
    if update.finish_reason == "abort":
        raise APIError(503, update.error or "the request was aborted", code="aborted")
    if update.finish_reason == "error":
        raise APIError(500, update.error or "internal error in the engine", code="engine_error")


def _error_event(e: APIError) -> bytes:
    return sse.event(e.body())


async def _collect(
    request: Request, state: ServingState, jobs: list[Job], arrival: float
) -> list[ChoiceResult]:
    """Runs the jobs to the end (non-streaming); a client that leaves meanwhile cancels them."""
    results = [ChoiceResult() for _ in jobs]

    async def consume() -> None:
        async for job, u in _run_jobs(state, jobs, arrival):
            r = results[job.index]
            r.text += u.text
            r.token_ids += u.token_ids
            r.logprobs += u.logprobs or []
            r.prompt_tokens, r.cached_tokens = u.prompt_tokens, u.cached_tokens
            if u.finish_reason is not None:
                _raise_for_unfinished(u)
                r.finish_reason = u.finish_reason

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
    except QueueFullError as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="server_shutting_down", headers={"Retry-After": "5"}) from None
    except EmberError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    finally:
        task.cancel()
    return results


def _usage(
    prompts: list[list[int]], results: dict[int, ChoiceResult], n: int, completion_tokens: int
) -> Usage:
    """Usage of a whole response: each prompt counts once, however many choices it has."""
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(r.cached_tokens for p in range(len(prompts)) if (r := results.get(p * n)) is not None)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _visible(state: ServingState, token_ids: list[int], logprobs: list[dict[int, float]], finish: str | None):
    """(token, entry) pairs to report: the EOS that ended a completion has no text and is not shown."""
    pairs = list(zip(token_ids, logprobs, strict=False))
    if finish == "stop" and pairs and pairs[-1][0] in state.eos_token_ids:
        pairs.pop()
    return pairs


def _chat_logprobs(state: ServingState, pairs: list[tuple[int, dict[int, float]]], k: int) -> ChoiceLogprobs:
    content = []
    for token, entry in pairs:
        text = state.token_text(token)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append(
            TokenLogprob(
                token=text,
                logprob=entry[token],
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(t := state.token_text(i)), logprob=lp, bytes=list(t.encode()))
                    for i, lp in top
                ],
            )
        )
    return ChoiceLogprobs(content=content)


def _completion_logprobs(
    state: ServingState, pairs: list[tuple[int, dict[int, float]]], k: int, offset: int
) -> CompletionLogprobs:
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, entry in pairs:
        text = state.token_text(token)
        out.tokens.append(text)
        out.token_logprobs.append(entry[token])
        out.top_logprobs.append(
            {state.token_text(i): lp for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:k]}
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


# ------------------------------------------------------------------------------------------------ routes


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival = time.monotonic()
    state = _serving(request)
    req = parse(ChatCompletionRequest, await read_json(request, state.limits.max_body_bytes))
    _check_model(state, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if state.tokenizer.chat_template is None:
        raise APIError(
            400,
            f"model {state.model_name!r} has no chat template (a base model?); use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    top = req.top_logprobs or 0
    params = sampling_params(
        state,
        req,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        logprobs=top if req.logprobs else None,
    )
    # OpenAI's "developer" role is the newer name of "system", which is what chat templates know.
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages
    ]
    try:
        prompt_ids = state.tokenizer.encode_chat(messages, add_generation_prompt=True)
    except TokenizerError as e:
        raise APIError(
            422, f"the chat template cannot render these messages: {e}", param="messages"
        ) from None
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = make_jobs(state, request_id, [prompt_ids], params, req.n, "messages")
    created = int(time.time())

    if not req.stream:
        results = await _collect(request, state, jobs, arrival)
        choices = []
        for i, r in enumerate(results):
            lp = None
            if req.logprobs:
                lp = _chat_logprobs(state, _visible(state, r.token_ids, r.logprobs, r.finish_reason), top)
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=r.text),
                    logprobs=lp,
                    finish_reason=r.finish_reason,
                )
            )
        usage = _usage([prompt_ids], dict(enumerate(results)), req.n, sum(len(r.token_ids) for r in results))
        body = ChatCompletion(
            id=request_id,
            created=created,
            model=state.model_name,
            choices=choices,
            usage=usage,
            system_fingerprint=FINGERPRINT,
        )
        return JSONResponse(body.model_dump())

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        c = ChatCompletionChunk(
            id=request_id,
            created=created,
            model=state.model_name,
            system_fingerprint=FINGERPRINT,
            choices=choices,
            usage=usage,
        )
        return sse.event(c, exclude=exclude)

    async def stream() -> AsyncIterator[bytes]:
        for job in jobs:
            yield chunk([ChatChunkChoice(index=job.index, delta=Delta(role="assistant", content=""))])
        completion_tokens, results = 0, {}
        try:
            async for job, u in _run_jobs(state, jobs, arrival):
                completion_tokens += len(u.token_ids)
                results[job.index] = ChoiceResult(
                    prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens
                )
                pairs = (
                    _visible(state, u.token_ids, u.logprobs or [], u.finish_reason) if req.logprobs else []
                )
                if u.text or pairs:
                    lp = _chat_logprobs(state, pairs, top) if req.logprobs else None
                    yield chunk([ChatChunkChoice(index=job.index, delta=Delta(content=u.text), logprobs=lp)])
                if u.finish_reason is not None:
                    _raise_for_unfinished(u)
                    yield chunk(
                        [ChatChunkChoice(index=job.index, delta=Delta(), finish_reason=u.finish_reason)]
                    )
        except APIError as e:
            yield _error_event(e)
        except EmberError as e:
            yield _error_event(APIError(503, str(e)))
        else:
            if include_usage:
                yield chunk([], _usage([prompt_ids], results, req.n, completion_tokens))
        yield sse.DONE

    return StreamingResponse(stream(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrival = time.monotonic()
    state = _serving(request)
    req = parse(CompletionRequest, await read_json(request, state.limits.max_body_bytes))
    _check_model(state, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    p = req.prompt
    if isinstance(p, str):
        prompts = [state.tokenizer.encode(p, add_special_tokens=True)]
    elif p and isinstance(p[0], str):
        prompts = [state.tokenizer.encode(s, add_special_tokens=True) for s in p]  # type: ignore[arg-type]
    elif p and isinstance(p[0], list):
        prompts = [list(ids) for ids in p]  # type: ignore[union-attr]
    else:
        prompts = [list(p)]  # type: ignore[arg-type]
    if len(prompts) > state.limits.max_prompts:
        raise APIError(
            400,
            f"prompt holds {len(prompts)} prompts; at most {state.limits.max_prompts} are allowed",
            param="prompt",
        )
    params = sampling_params(state, req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs = make_jobs(state, request_id, prompts, params, req.n, "prompt")
    created = int(time.time())
    k = req.logprobs or 0

    if not req.stream:
        results = await _collect(request, state, jobs, arrival)
        choices = []
        for i, r in enumerate(results):
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(
                    state, _visible(state, r.token_ids, r.logprobs, r.finish_reason), k, 0
                )
            choices.append(CompletionChoice(index=i, text=r.text, logprobs=lp, finish_reason=r.finish_reason))
        usage = _usage(prompts, dict(enumerate(results)), req.n, sum(len(r.token_ids) for r in results))
        body = Completion(
            id=request_id,
            created=created,
            model=state.model_name,
            system_fingerprint=FINGERPRINT,
            choices=choices,
            usage=usage,
        )
        return JSONResponse(body.model_dump())

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        c = Completion(
            id=request_id,
            created=created,
            model=state.model_name,
            system_fingerprint=FINGERPRINT,
            choices=choices,
            usage=usage,
        )
        return sse.event(c, exclude=exclude)

    async def stream() -> AsyncIterator[bytes]:
        completion_tokens, results = 0, {}
        offsets = [0] * len(jobs)
        try:
            async for job, u in _run_jobs(state, jobs, arrival):
                completion_tokens += len(u.token_ids)
                results[job.index] = ChoiceResult(
                    prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens
                )
                pairs = _visible(state, u.token_ids, u.logprobs or [], u.finish_reason)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(state, pairs, k, offsets[job.index])
                    offsets[job.index] += sum(len(t) for t in lp.tokens)
                if u.finish_reason is not None:
                    _raise_for_unfinished(u)
                if u.text or (lp is not None and lp.tokens) or u.finish_reason is not None:
                    yield chunk(
                        [
                            CompletionChoice(
                                index=job.index, text=u.text, logprobs=lp, finish_reason=u.finish_reason
                            )
                        ]
                    )
        except APIError as e:
            yield _error_event(e)
        except EmberError as e:
            yield _error_event(APIError(503, str(e)))
        else:
            if include_usage:
                yield chunk([], _usage(prompts, results, req.n, completion_tokens))
        yield sse.DONE

    return StreamingResponse(stream(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = _serving(request)
    return JSONResponse(ModelList(data=[ModelCard(id=state.model_name, created=state.created)]).model_dump())


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> JSONResponse:
    state = _serving(request)
    _check_model(state, model)
    return JSONResponse(ModelCard(id=state.model_name, created=state.created).model_dump())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_serving(request).metrics.render(), media_type=CONTENT_TYPE)


# /health is registered without the API-key check (see app.py): load balancers probe it anonymously.
health_router = APIRouter()


@health_router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _serving(request)
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})
