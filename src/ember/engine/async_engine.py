"""AsyncEngine: the asyncio face of the engine, used by the server (and by anything else that is async).

The model runs in one background thread (`EngineCore.step()` in a loop); each request gets an asyncio queue
that the thread feeds through `loop.call_soon_threadsafe`. Leaving the `generate()` iterator early — a client
that disconnects, a cancelled task — aborts the request at once, which frees its KV blocks.

Threading rule: only the engine thread touches the model, the cache and the scheduler; other threads talk to
it through `EngineCore.add_request` / `abort`, which only enqueue. That thread is a `ModelThread`, which can
also load the model first (`ember serve` does): on a CPU, a model loaded in one thread and stepped in another
runs its steps much slower (see `ModelThread`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from ember.engine.core import EngineCore, EngineStats, RequestUpdate
from ember.engine.sampler import SamplingParams
from ember.errors import EmberError

log = logging.getLogger(__name__)


class QueueFullError(EmberError):
    """Too many requests are waiting; the client should retry later."""


class EngineStoppedError(EmberError):
    """The engine is shutting down and takes no new requests."""


class ModelThread:
    """One thread for a model's torch work, jobs run in order: loading it (`call`), then the engine's loop.

    OpenMP runtimes (libgomp, PyTorch's CPU builds) keep a team of worker threads for every thread that opens a
    parallel region, and once a process holds more of those threads than it has CPUs, waiting workers stop
    spinning and sleep in the kernel at every barrier (libgomp's throttled spin). A CPU decode step runs a few
    hundred parallel regions, so loading a model in the main thread and stepping it in another made each step
    ~2.5x slower on 2 cores (SmolLM2: ~5.3 against 12.6-15.6 ms; BENCHMARKS.md, forty-second session). A
    daemon thread, not a one-worker ThreadPoolExecutor: that worker is joined at interpreter exit, which the
    engine's loop (its last job, run until `AsyncEngine.shutdown`) would hang where a server never started."""

    def __init__(self, name: str = "ember-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # handed to the caller, whatever it is (KeyboardInterrupt included)
                future.set_exception(e)
            else:
                future.set_result(result)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queues fn(*args, **kwargs) to run on the thread after the jobs before it; its result's Future."""
        future: Future = Future()
        self._jobs.put((lambda: fn(*args, **kwargs), future))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) run on the thread, waited for: its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    """`core` stepped in a loop on `thread` (a new ModelThread unless given: pass the one that loaded the model)."""

    def __init__(
        self, core: EngineCore, *, max_waiting: int = 256, thread: ModelThread | None = None
    ) -> None:
        self.core = core
        self.max_waiting = max_waiting
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._running = (thread or ModelThread()).submit(self._run)

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
        await asyncio.to_thread(wait_futures, [self._running], 5.0)
