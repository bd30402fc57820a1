"""Ember's OpenAI-compatible HTTP server: `create_app(llm, model_name=...)` returns a FastAPI app.

`protocol` holds OpenAI's bodies as pydantic models, `routes` the thin handlers that turn them into engine
requests, `sse` the server-sent-event framing, `metrics` the Prometheus registry, `app` the factory with auth,
limits, error bodies and graceful shutdown. Run it with `ember serve`.
"""

from ember.serve.app import ServerLimits, create_app

__all__ = ["ServerLimits", "create_app"]
