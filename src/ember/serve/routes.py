"""The routes: parse a body, turn it into token ids and SamplingParams, run it on the engine, answer.

Everything that can be refused is refused before the first byte of a response (bad parameters, a prompt that
does not fit, a full queue), so a streamed response never starts with a 200 and then fails for a reason that
was known up front. Each of the n choices (and each prompt of a batched completion) is its own engine
request; `_run_jobs` merges their updates. Closing a stream early — a client that disconnects — cancels the
tasks feeding it, and leaving `AsyncEngine.generate` early aborts the request and frees its KV blocks.

Both endpoints share one whole-answer assembler (`_respond`) and one streaming driver (`_stream`); a route
parses, builds SamplingParams, starts a `Run`, and supplies only how its choices and deltas look.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import sys
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
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
    ChatMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    StreamOptions,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ember.tokenizer.tokenizer import Tokenizer

FINGERPRINT = f"ember-{__version__}"
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", ChatCompletionRequest, CompletionRequest)
B = TypeVar("B", ChatCompletion, ChatCompletionChunk, Completion)


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
    # Admitted runs whose jobs may not be in the engine's queue yet (a run that is dropped leaves by itself).
    admitted: weakref.WeakSet[Run] = field(default_factory=weakref.WeakSet)

    @property
    def vocab_size(self) -> int:
        return self.engine.core.loaded.config.vocab_size

    def token_piece(self, token_id: int) -> TokenPiece:
        return _token_piece(self.tokenizer, token_id)


@dataclass(frozen=True)
class TokenPiece:
    """One token as logprobs report it."""

    # Its text; for part of a UTF-8 character, its bytes escaped as OpenAI writes them
    # ("bytes:\\xf0\\x9f"), so that no two such tokens look alike (they all decode to U+FFFD).
    token: str
    raw: bytes  # its bytes, those of its vocabulary entry
    text: bytes  # what it adds to the generated text: nothing for a special token


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in bs]
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _raw_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary entry stands for: a byte-fallback token's byte, or a byte-level BPE token's
    bytes; None for any other vocabulary."""
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m[1], 16)])
    if piece and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return None


@lru_cache(maxsize=64)
def _anchor(tokenizer: Tokenizer) -> list[int]:
    """A token to decode ahead of another: a decoder that strips the start of what it decodes (SentencePiece's
    leading "▁") then keeps that token's own leading space, as the generated text does."""
    candidates = [tokenizer.encode("a", add_special_tokens=False)[-1:], *([i] for i in range(256))]
    for ids in candidates:
        if ids and ids[0] < tokenizer.vocab_size and (text := tokenizer.decode(ids)) and "\ufffd" not in text:
            return ids
    return []


def _decode_one(tokenizer: Tokenizer, token_id: int, skip_special_tokens: bool) -> str:
    """The text `token_id` adds after the anchor, as the generated text has it (the stream decoder's context)."""
    decoder = tokenizer.stream_decoder(skip_special_tokens, prompt_ids=_anchor(tokenizer))
    return decoder.push(token_id) + decoder.flush()


@lru_cache(maxsize=1 << 16)
def _token_piece(tokenizer: Tokenizer, token_id: int) -> TokenPiece:
    shown = _decode_one(tokenizer, token_id, skip_special_tokens=False)
    text = _decode_one(tokenizer, token_id, True).encode()  # b"" for a special token: the text leaves it out
    # A token holding part of a character decodes to U+FFFD; its vocabulary entry still has its bytes.
    raw = _raw_bytes(tokenizer.backend.id_to_token(token_id) or "") if "\ufffd" in shown else None
    if raw is None:
        return TokenPiece(shown, shown.encode(), text)
    try:
        raw.decode()
    except UnicodeDecodeError:
        escaped = "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)
        return TokenPiece(f"bytes:{escaped}", raw, raw if text else b"")
    return TokenPiece(shown, raw, text)


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


@dataclass(eq=False)  # hashed by identity: ServingState.admitted holds it
class Run:
    """One response's engine requests, with what its body repeats: id, creation time, prompts (for usage)."""

    state: ServingState
    request_id: str
    prompts: list[list[int]]
    n: int
    jobs: list[Job]
    arrival: float  # time.monotonic() when the request came in, for the latency metrics
    created: int = field(default_factory=lambda: int(time.time()))
    unqueued: int = 0  # admitted jobs not yet handed to the engine: the admission check counts them

    def body(self, cls: type[B], choices: list[Any], usage: Usage | None) -> B:
        """A response body, or one chunk of a stream, of this run."""
        return cls(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            system_fingerprint=FINGERPRINT,
            choices=choices,
            usage=usage,
        )


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
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:
        # Valid JSON, but int() refuses a literal of more than sys.get_int_max_str_digits() digits (the only
        # plain ValueError json.loads raises): answered as invalid JSON is, not as a server error.
        raise APIError(
            400,
            f"request body holds an integer of more than {sys.get_int_max_str_digits()} digits",
            code="invalid_json",
        ) from None
    # UTF-8 cannot hold a surrogate: only a "\\udXXX" escape can, so most bodies need no look.
    if _SURROGATE_ESCAPE.search(body) and (param := _surrogate_path(data)) is not None:
        raise APIError(
            400,
            f"{param or 'request body'}: a lone UTF-16 surrogate is not valid Unicode text",
            param=param or None,
            code="invalid_value",
        )
    return data


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _surrogate_path(data: Any) -> str | None:
    """Where the first lone UTF-16 surrogate in `data` is ("messages.0.content"): JSON can write one
    ("\\ud800"), but it is not Unicode text, and the tokenizer cannot take it."""
    todo: list[tuple[list[str], Any]] = [([], data)]  # a loop, not recursion: the nesting can be deep
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            return ".".join(path)
        if isinstance(value, dict):
            for k, v in reversed(value.items()):
                # A key holding one is the culprit itself, named escaped ("\\ud800") for the error body.
                name = k.encode("utf-8", "backslashreplace").decode()
                todo.append(([*path, name], k if _SURROGATE.search(k) else v))
        elif isinstance(value, list):
            items = reversed(list(enumerate(value)))
            todo.extend(([*path, str(i)], v) for i, v in items if isinstance(v, str | list | dict))
    return None


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


async def parse_request(request: Request, model: type[R]) -> tuple[ServingState, R]:
    """The body parsed as `model`, checked for what both generation endpoints refuse alike."""
    state = _serving(request)
    req = parse(model, await read_json(request, state.limits.max_body_bytes))
    _check_model(state, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return state, req


def _check_model(state: ServingState, model: str) -> None:
    if model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _admit(state: ServingState, run: Run, *, param: str) -> None:
    """Admits `run` or refuses it before anything runs: 503 while draining, 400 for more jobs than the queue
    can ever hold, 429 while the queue is full.

    Jobs are handed to the engine a few event-loop turns later (by `_run_jobs`), so the check counts, besides
    the engine's queue, the jobs of runs admitted but not handed over yet; otherwise requests arriving
    together would all pass and the late ones fail after their 200 has gone out.
    """
    if state.draining:
        raise APIError(
            503, "the server is shutting down", code="server_shutting_down", headers={"Retry-After": "5"}
        )
    limit, num_jobs = state.engine.max_waiting, len(run.jobs)
    if num_jobs > limit:
        raise APIError(
            400,
            f"this request needs {num_jobs} engine requests ({len(run.prompts)} prompts x n={run.n}) but at "
            f"most {limit} can be queued",
            param=param,
            code="invalid_value",
        )
    waiting = state.engine.core.num_waiting() + sum(r.unqueued for r in state.admitted)
    if waiting + num_jobs > limit:
        raise APIError(
            429,
            f"{waiting} requests are already queued (limit {limit}); retry later",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    run.unqueued = num_jobs
    state.admitted.add(run)


_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")


def sampling_params(
    state: ServingState,
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
) -> SamplingParams:
    """The engine's SamplingParams for one choice; unset sampling knobs take the model's generation_config.

    `max_tokens` came from the request's field `max_tokens_param`, which errors about it name.
    """
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
            f"{max_tokens_param}={max_tokens} exceeds the limit of {cap}",
            param=max_tokens_param,
            code="invalid_value",
        )
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        # ASCII digits only: int() takes "١" (Arabic-Indic one) and " 1", and refuses "²" and 5000 digits.
        if not _TOKEN_ID.fullmatch(key) or not 0 <= int(key) < state.vocab_size:
            shown = repr(key) if len(key) <= 40 else repr(key[:37]) + "..."
            raise APIError(
                400,
                f"logit_bias key {shown} is not a token id in [0, {state.vocab_size})",
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


def make_run(
    state: ServingState,
    id_prefix: str,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    *,
    param: str,
    max_tokens_param: str,
    arrival: float,
) -> Run:
    """n jobs per prompt (choice index = prompt * n + j), each checked against the context before any runs.

    `param` names the request's prompt field, `max_tokens_param` the field that set `params.max_tokens`.
    """
    for ids in prompts:
        try:
            state.engine.core.validate(ids, params)
        except ContextLengthError as e:
            # The engine names its own field, SamplingParams.max_tokens: name the one the request set.
            message = re.sub(r"\bmax_tokens\b", max_tokens_param, str(e))
            raise APIError(400, message, param=param, code="context_length_exceeded") from None
        except EmberError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    jobs = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            # With a seed, choice j uses seed + j: n different samples, each reproducible (as LLM.generate).
            sub = params if params.seed is None else replace(params, seed=params.seed + j)
            index = p * n + j
            jobs.append(Job(index, f"{request_id}-{index}", ids, sub))
    run = Run(state, request_id, prompts, n, jobs, arrival)
    _admit(state, run, param="n" if len(prompts) == 1 else "prompt")
    return run


# --------------------------------------------------------------------------------------------- running


async def _run_jobs(run: Run) -> AsyncIterator[tuple[Job, RequestUpdate]]:
    """Merges the updates of every job as they come; records latency and token metrics."""
    state, jobs, arrival = run.state, run.jobs, run.arrival
    queue: asyncio.Queue[tuple[Job, RequestUpdate | BaseException]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        # generate() queues the job before its first await, so from here on the engine's queue counts it. It
        # was admitted (`_admit`), so a queue filled since (preempted requests go back to it) does not refuse it.
        run.unqueued -= 1
        try:
            gen = state.engine.generate(job.request_id, job.prompt_ids, job.params, admitted=True)
            async for update in gen:
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
        run.unqueued = 0  # a task cancelled before it started never queues its job
        if remaining:  # the client left (or an error ended the response) before these jobs finished
            m.finished.labels("abort").inc(remaining)


def _raise_for_unfinished(update: RequestUpdate) -> None:
    if update.finish_reason == "abort":
        raise APIError(503, update.error or "the request was aborted", code="aborted")
    if update.finish_reason == "error":
        raise APIError(500, update.error or "internal error in the engine", code="engine_error")


async def _collect(request: Request, run: Run) -> list[ChoiceResult]:
    """Runs the jobs to the end (non-streaming); a client that leaves meanwhile cancels them."""
    results = [ChoiceResult() for _ in run.jobs]

    async def consume() -> None:
        async for job, u in _run_jobs(run):
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


def _visible(state: ServingState, out: ChoiceResult | RequestUpdate) -> list[tuple[int, dict[int, float]]]:
    """(token, logprobs) pairs to report: the EOS that ended a completion has no text and is not shown."""
    pairs = list(zip(out.token_ids, out.logprobs or [], strict=False))
    if out.finish_reason == "stop" and pairs and pairs[-1][0] in state.eos_token_ids:
        pairs.pop()
    return pairs


class LogprobCursor:
    """Which generated tokens one choice's text holds so far, and where in that text each starts.

    The text lags the tokens (an incomplete character, a possible stop string is held back) and ends before
    them when a stop string matched: a token is reported once the text sent reaches it, and those past the end
    of the final text (the stop string's) never are. Offsets count the tokens' bytes through a UTF-8 decoder,
    so the tokens holding parts of one character all start where that character does.
    """

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # length of the text the tokens seen so far make
        self._sent = 0  # length of the text sent so far
        self._pending: deque[tuple[int, dict[int, float], int]] = deque()

    def advance(self, out: ChoiceResult | RequestUpdate) -> list[tuple[int, dict[int, float], int]]:
        """(token, logprobs, text offset) of each token that the text of `out` (the next piece) reaches."""
        for token, entry in _visible(self.state, out):
            self._pending.append((token, entry, self._chars))
            self._chars += len(self._utf8.decode(self.state.token_piece(token).text))
        self._sent += len(out.text)
        ready = []
        while self._pending and self._pending[0][2] < self._sent:
            ready.append(self._pending.popleft())
        return ready


def _chat_logprobs(cursor: LogprobCursor, out: ChoiceResult | RequestUpdate, k: int) -> ChoiceLogprobs:
    content = []
    for token, entry, _ in cursor.advance(out):
        piece = cursor.state.token_piece(token)
        top = [
            (cursor.state.token_piece(i), lp) for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        ]
        content.append(
            TokenLogprob(
                token=piece.token,
                logprob=entry[token],
                bytes=list(piece.raw),
                top_logprobs=[TopLogprob(token=p.token, logprob=lp, bytes=list(p.raw)) for p, lp in top],
            )
        )
    return ChoiceLogprobs(content=content)


def _completion_logprobs(
    cursor: LogprobCursor, out: ChoiceResult | RequestUpdate, k: int
) -> CompletionLogprobs:
    lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token, entry, offset in cursor.advance(out):
        lp.tokens.append(cursor.state.token_piece(token).token)
        lp.token_logprobs.append(entry[token])
        lp.top_logprobs.append(
            {
                cursor.state.token_piece(i).token: v
                for i, v in sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            }
        )
        lp.text_offset.append(offset)
    return lp


# ---------------------------------------------------------------------------------------------- answering


async def _respond(
    request: Request,
    run: Run,
    body: type[ChatCompletion | Completion],
    choice: Callable[[int, ChoiceResult], Any],
) -> JSONResponse:
    """The whole answer at once: `choice(index, result)` formats each choice of `body`."""
    results = await _collect(request, run)
    completion_tokens = sum(len(r.token_ids) for r in results)
    choices = [choice(i, r) for i, r in enumerate(results)]
    usage = _usage(run.prompts, dict(enumerate(results)), run.n, completion_tokens)
    return JSONResponse(run.body(body, choices, usage).model_dump())


def _stream(
    run: Run,
    body: type[ChatCompletionChunk | Completion],
    stream_options: StreamOptions | None,
    deltas: Callable[[Job, RequestUpdate], list[Any]],
    opening: Callable[[Job], Any] | None = None,
) -> StreamingResponse:
    """The answer as server-sent events: one `body` chunk per choice that `deltas(job, update)` returns.

    `opening(job)`, when given, is sent for every job before the first token. An error after the 200 has gone
    out ends the stream with an error event; `[DONE]` always comes last.
    """
    include_usage = bool(stream_options and stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[Any], usage: Usage | None = None) -> bytes:
        return sse.event(run.body(body, choices, usage), exclude=exclude)

    async def events() -> AsyncIterator[bytes]:
        if opening is not None:
            for job in run.jobs:
                yield chunk([opening(job)])
        completion_tokens, results = 0, {}
        try:
            async for job, u in _run_jobs(run):
                completion_tokens += len(u.token_ids)
                results[job.index] = ChoiceResult(
                    prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens
                )
                # Aborted and failed updates carry no text (EngineCore._final), so raising first drops nothing.
                if u.finish_reason is not None:
                    _raise_for_unfinished(u)
                for c in deltas(job, u):
                    yield chunk([c])
        except APIError as e:
            yield sse.event(e.body())
        except EmberError as e:
            yield sse.event(APIError(503, str(e)).body())
        else:
            if include_usage:
                yield chunk([], _usage(run.prompts, results, run.n, completion_tokens))
        yield sse.DONE

    return StreamingResponse(events(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


# ------------------------------------------------------------------------------------------------ routes


def _encode_chat(state: ServingState, messages: list[ChatMessage]) -> list[int]:
    """The conversation rendered by the model's chat template, ready for the assistant's turn."""
    # OpenAI's "developer" role is the newer name of "system", which is what chat templates know.
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return state.tokenizer.encode_chat(turns, add_generation_prompt=True)
    except TokenizerError as e:
        # The request's fault: a template refuses what it cannot take ("Conversation roles must alternate").
        raise APIError(
            400,
            f"the chat template cannot render these messages: {e}",
            param="messages",
            code="invalid_value",
        ) from None


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival = time.monotonic()
    state, req = await parse_request(request, ChatCompletionRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if state.tokenizer.chat_template is None:
        raise APIError(
            400,
            f"model {state.model_name!r} has no chat template (a base model?); use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    top = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens is OpenAI's newer name of max_tokens and wins over it; errors name the one sent.
    max_tokens_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    params = sampling_params(
        state,
        req,
        max_tokens=getattr(req, max_tokens_param),
        max_tokens_param=max_tokens_param,
        logprobs=top,
    )
    prompt_ids = _encode_chat(state, req.messages)
    run = make_run(
        state,
        "chatcmpl",
        [prompt_ids],
        params,
        req.n,
        param="messages",
        max_tokens_param=max_tokens_param,
        arrival=arrival,
    )

    def choice(i: int, r: ChoiceResult) -> ChatChoice:
        lp = None if top is None else _chat_logprobs(LogprobCursor(state), r, top)
        return ChatChoice(
            index=i, message=AssistantMessage(content=r.text), logprobs=lp, finish_reason=r.finish_reason
        )

    def opening(job: Job) -> ChatChunkChoice:
        return ChatChunkChoice(index=job.index, delta=Delta(role="assistant", content=""))

    cursors = [LogprobCursor(state) for _ in run.jobs]

    def deltas(job: Job, u: RequestUpdate) -> list[ChatChunkChoice]:
        # Chat sends the finish_reason in a chunk of its own, after the last content.
        out = []
        lp = None if top is None else _chat_logprobs(cursors[job.index], u, top)
        if u.text or (lp is not None and lp.content):
            out.append(ChatChunkChoice(index=job.index, delta=Delta(content=u.text), logprobs=lp))
        if u.finish_reason is not None:
            out.append(ChatChunkChoice(index=job.index, delta=Delta(), finish_reason=u.finish_reason))
        return out

    if not req.stream:
        return await _respond(request, run, ChatCompletion, choice)
    return _stream(run, ChatCompletionChunk, req.stream_options, deltas, opening)


def _encode_prompts(
    state: ServingState, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """/v1/completions' `prompt` (a string, strings, token ids, or lists of them) as a list of token-id lists."""
    if isinstance(prompt, str):
        prompts = [state.tokenizer.encode(prompt, add_special_tokens=True)]
    elif prompt and isinstance(prompt[0], str):
        prompts = [state.tokenizer.encode(s, add_special_tokens=True) for s in prompt]  # type: ignore[arg-type]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(ids) for ids in prompt]  # type: ignore[union-attr]
    else:
        prompts = [list(prompt)]  # type: ignore[arg-type]
    if len(prompts) > state.limits.max_prompts:
        raise APIError(
            400,
            f"prompt holds {len(prompts)} prompts; at most {state.limits.max_prompts} are allowed",
            param="prompt",
        )
    return prompts


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrival = time.monotonic()
    state, req = await parse_request(request, CompletionRequest)
    prompts = _encode_prompts(state, req.prompt)
    params = sampling_params(
        state, req, max_tokens=req.max_tokens, max_tokens_param="max_tokens", logprobs=req.logprobs
    )
    run = make_run(
        state, "cmpl", prompts, params, req.n, param="prompt", max_tokens_param="max_tokens", arrival=arrival
    )
    k = req.logprobs

    def choice(i: int, r: ChoiceResult) -> CompletionChoice:
        lp = None if k is None else _completion_logprobs(LogprobCursor(state), r, k)
        return CompletionChoice(index=i, text=r.text, logprobs=lp, finish_reason=r.finish_reason)

    cursors = [LogprobCursor(state) for _ in run.jobs]  # text_offset continues across a choice's chunks

    def deltas(job: Job, u: RequestUpdate) -> list[CompletionChoice]:
        lp = None if k is None else _completion_logprobs(cursors[job.index], u, k)
        if not (u.text or (lp is not None and lp.tokens) or u.finish_reason is not None):
            return []
        return [CompletionChoice(index=job.index, text=u.text, logprobs=lp, finish_reason=u.finish_reason)]

    if not req.stream:
        return await _respond(request, run, Completion, choice)
    return _stream(run, Completion, req.stream_options, deltas)


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
