"""`create_app(...)`: the FastAPI app of one served model, with auth, error bodies, metrics and the web UI.

    app = create_app(ember.LLM("smollm2-135m-instruct"), api_key="sk-local")
    uvicorn.run(app, host="127.0.0.1", port=8000)

The app owns an `AsyncEngine` (the model runs in its thread) and stops it in the lifespan's shutdown after
the running requests finish (`ServerLimits.drain_timeout`). Every route but /health, / and /static needs
`Authorization: Bearer <api_key>` when a key is set. Every error, FastAPI's own included, is answered in
OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.engine.async_engine import AsyncEngine, ModelThread
from ember.engine.core import EngineCore
from ember.llm import LLM
from ember.serve.errors import APIError
from ember.serve.metrics import ServerMetrics
from ember.serve.routes import ServerLimits, ServingState, health_router, router

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


class _CountResponses:
    """Counts every response by route and status code (a pure ASGI wrapper, so streams are not buffered)."""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")
    PREFIXES = ("/v1/models/", "/static/")  # labelled by the prefix: one label per route, not per path

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = (
            path if path in self.ROUTES else next((p for p in self.PREFIXES if path.startswith(p)), "other")
        )

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _InternalErrors:
    """Answers an unexpected exception with OpenAI's 500 body (pure ASGI, so streams are not buffered).

    Starlette's handler for `Exception` re-raises after answering, so uvicorn logs the error a second time and
    closes the keep-alive connection; here the exception ends with the answer. One raised after the response
    has started can only end the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            return  # nobody is left to answer
        except Exception as e:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            error = APIError(500, f"internal server error ({type(e).__name__})", code="internal_error")
            await error.response()(scope, receive, send)


def create_app(
    llm: LLM | EngineCore | AsyncEngine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    static_dir: Path | None = STATIC_DIR,
    thread: ModelThread | None = None,
) -> FastAPI:
    """The app serving `llm` under `model_name` (default: the loaded model's name). `thread`: the ModelThread
    that loaded the model, to run the engine on (on a CPU, steps run much slower on another thread)."""
    limits = limits or ServerLimits()
    if isinstance(llm, AsyncEngine):
        engine = llm
    else:
        thread = thread or ModelThread()
        core = thread.call(llm.engine) if isinstance(llm, LLM) else llm
        engine = AsyncEngine(core, max_waiting=limits.max_waiting, thread=thread)
    loaded = engine.core.loaded
    metrics = ServerMetrics(engine.stats)
    state = ServingState(
        engine=engine,
        tokenizer=loaded.tokenizer,
        model_name=model_name or loaded.name,
        limits=limits,
        metrics=metrics,
        generation_defaults=dict(loaded.generation_defaults),
        eos_token_ids=frozenset(loaded.eos_token_ids),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        yield
        state.draining = True
        await engine.shutdown(drain_timeout=limits.drain_timeout)

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    app = FastAPI(title="Ember", version=loaded.name, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = state
    app.include_router(health_router)
    app.include_router(router, dependencies=[Depends(require_api_key)])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = f"{request.method} {request.url.path}: {e.detail}"
        return APIError(e.status_code, message, headers=e.headers).response()

    if static_dir is not None and (static_dir / "index.html").is_file():
        index = static_dir / "index.html"

        @app.get("/", include_in_schema=False)
        async def _index() -> FileResponse:
            return FileResponse(index)

        app.mount("/static", StaticFiles(directory=static_dir), name="static")

    app.add_middleware(_InternalErrors)
    app.add_middleware(_CountResponses, metrics=metrics)  # outermost: counts the 500s too
    return app


def begin_drain(app: FastAPI, *, drain_timeout: float | None = None) -> None:
    """Starts a graceful shutdown (call it from a signal handler, or any thread): new requests get 503 at once,
    running ones get `drain_timeout` seconds (default: the limits') to finish, then end with an error event.

    uvicorn, told to exit at the same time, stops accepting connections and waits for the open ones, which
    therefore close cleanly (`data: [DONE]`) rather than being cut when its own timeout passes.
    """
    state: ServingState = app.state.serving
    state.draining = True
    timeout = state.limits.drain_timeout if drain_timeout is None else drain_timeout
    loop: asyncio.AbstractEventLoop = app.state.loop
    loop.call_soon_threadsafe(lambda: loop.create_task(state.engine.shutdown(drain_timeout=timeout)))
