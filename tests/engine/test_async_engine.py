"""The engine's thread: `ModelThread` runs jobs in order on one thread, and the server's engine steps the model on
the thread that loaded it (on a CPU, OpenMP's worker teams make steps on another thread much slower)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import ember
from ember.engine.async_engine import AsyncEngine, ModelThread
from ember.errors import EmberError
from ember.serve import create_app


def test_model_thread_runs_jobs_in_order_on_one_thread_and_hands_back_their_errors():
    thread = ModelThread(name="test-model-thread")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    futures = [thread.submit(job, i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == [0, 1, 4, 9, 16]
    assert seen == [(i, "test-model-thread") for i in range(5)]
    assert thread.call(job, i=7) == 49

    def fail() -> None:
        raise EmberError("model.safetensors is truncated")

    with pytest.raises(EmberError, match="truncated"):
        thread.call(fail)
    assert thread.call(job, 2) == 4  # an error does not end the thread


def test_the_server_steps_the_model_on_the_thread_that_loaded_it(tiny_llama_dir):
    thread = ModelThread()
    llm = thread.call(ember.LLM, str(tiny_llama_dir))
    loaded_on = thread.call(threading.get_ident)
    app = create_app(llm, thread=thread)
    engine: AsyncEngine = app.state.serving.engine
    stepped_on: set[int] = set()
    step = engine.core.step

    def recorded_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.core.step = recorded_step
    params = ember.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main() -> list[int]:
        try:
            return [t async for u in engine.generate("r", [5, 6, 7], params) for t in u.token_ids]
        finally:
            await engine.shutdown(drain_timeout=0)

    assert len(asyncio.run(main())) == 4
    assert stepped_on == {loaded_on} != {threading.get_ident()}
