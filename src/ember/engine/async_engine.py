"""AsyncEngine: the asyncio face of the engine, used by the server (and by anything else that is async).

The model runs in one background thread (`EngineCore.step()` in a loop); each request gets an asyncio queue
that the thread feeds through `loop.call_soon_threadsafe`. Leaving the `generate()` iterator early — a client
that disconnects, a cancelled task — aborts the request at once, which frees its KV blocks.

Threading rule: only the engine thread touches the model, the cache and the scheduler; other threads talk to
it through `EngineCore.add_request` / `abort`, which only enqueue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ember.engine.core import EngineCore, EngineStats, RequestUpdate
from ember.engine.sampler import SamplingParams
from ember.errors import EmberError

log = logging.getLogger(__name__)


class QueueFullError(EmberError):
    """Too many requests are waiting; the client should retry later."""


class EngineStoppedError(EmberError):
    """The engine is shutting down and takes no new requests."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, core: EngineCore, *, max_waiting: int = 256) -> None:
        self.core = core
        self.max_waiting = max_waiting
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.core.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                updates = self.core.step()
            except Exception:  # a bug in a step must not kill the engine silently: fail its requests
                log.exception("engine step failed; aborting the running requests")
                updates = self.core.fail_all("internal error in the engine step")
            for update in updates:
                self._deliver(update)

    def _deliver(self, update: RequestUpdate) -> None:
        with self._lock:
            stream = self._streams.get(update.request_id)
            if stream is not None and update.finish_reason is not None:
                del self._streams[update.request_id]
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)

    # -- any thread ----------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        admitted: bool = False,
    ) -> AsyncIterator[RequestUpdate]:
        """Yields one RequestUpdate per engine step until the update with a finish_reason.

        Raises QueueFullError when `max_waiting` requests wait, unless `admitted`: the caller has already
        counted this request against the limit (the server does, before its response starts) and it is queued
        even if the queue has filled since, as it does when preempted requests go back to it."""
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down and accepts no new requests")
        if not admitted and self.core.num_waiting() >= self.max_waiting:
            raise QueueFullError(f"{self.core.num_waiting()} requests are already waiting; retry later")
        self.core.validate(prompt_token_ids, params)  # raises ContextLengthError before anything is queued
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise EmberError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self.core.add_request(request_id, prompt_token_ids, params)
        self._wake.set()
        finished = False
        try:
            while True:
                update: RequestUpdate = await stream.queue.get()
                finished = update.finish_reason is not None
                yield update
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.core.abort(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def shutdown(self, *, drain_timeout: float = 30.0) -> None:
        """Stops intake, lets running requests finish for up to `drain_timeout` seconds, then aborts the rest."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while self.core.has_work() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for update in self.core.fail_all("the server is shutting down", finish_reason="abort"):
            self._deliver(update)
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 5.0)
