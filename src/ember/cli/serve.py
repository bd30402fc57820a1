"""`ember serve`: an OpenAI-compatible HTTP server (chat, completions, models, health, Prometheus metrics).

    ember serve smollm2-135m-instruct --port 8000 --api-key sk-local
    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer sk-local' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

SIGTERM (or Ctrl-C) stops intake at once (new requests get 503), lets running requests finish for up to
--drain-timeout seconds, then cancels the rest and exits.
"""

from __future__ import annotations

import argparse
import logging
import os

from ember.cli.common import add_model_options, integer, load_llm, model_name, number

log = logging.getLogger(__name__)

API_KEY_ENV = "EMBER_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p, positional=True)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)"
    )
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    e = p.add_argument_group("engine")
    e.add_argument(
        "--max-num-seqs", type=integer(1), default=64, help="most requests in the running batch (default: 64)"
    )
    e.add_argument(
        "--max-batched-tokens",
        type=integer(1),
        default=512,
        help="most tokens computed in one step (default: 512)",
    )
    e.add_argument(
        "--kv-cache-gib",
        type=number(0, inclusive=False),
        default=None,
        help="KV-cache memory (default: 1 on CPU, 80%% of free GPU memory)",
    )
    e.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks between prompts")
    lim = p.add_argument_group("limits")
    lim.add_argument(
        "--max-waiting", type=integer(0), default=256, help="queued requests before 429 (default: 256)"
    )
    lim.add_argument("--max-n", type=integer(1), default=16, help="most choices per request (default: 16)")
    lim.add_argument(
        "--max-body-mib",
        type=number(0, inclusive=False),
        default=4.0,
        help="largest request body (default: 4 MiB)",
    )
    lim.add_argument(
        "--drain-timeout",
        type=number(0, inclusive=True),
        default=30.0,
        help="seconds running requests get at shutdown (default: 30)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ember.engine.async_engine import ModelThread
    from ember.engine.core import EngineConfig
    from ember.serve import ServerLimits, create_app
    from ember.serve.app import begin_drain

    name = model_name(args)
    # Loaded on the thread that will run the engine's steps (on a CPU, a step on another thread runs much slower:
    # ember.engine.async_engine.ModelThread); every model option, as the other subcommands read them.
    thread = ModelThread()
    llm = thread.call(load_llm, args)
    # The batching engine is created on first use (by create_app), so its settings can still be set here.
    llm.engine_config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
        prefix_caching=not args.no_prefix_caching,
    )
    limits = ServerLimits(
        max_body_bytes=int(args.max_body_mib * 2**20),
        max_n=args.max_n,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
    )
    app = create_app(
        llm, model_name=args.served_model_name or name, api_key=args.api_key, limits=limits, thread=thread
    )
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if not app.state.serving.draining:
                log.warning("shutting down: finishing running requests (at most %.0f s)", args.drain_timeout)
                begin_drain(app)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="debug" if args.verbose else "info",
        # A backstop only: begin_drain ends the running requests (cleanly) after --drain-timeout.
        timeout_graceful_shutdown=int(args.drain_timeout) + 5,
    )
    Server(config).run()
    return 0
