"""Generator: the compiled decode step gives the eager step's greedy tokens; penalties and logprobs still run."""

from __future__ import annotations

import pytest
import torch

from ember.bench import random_model
from ember.engine.generate import Generator
from ember.engine.sampler import SamplingParams
from ember.quant import quantize_model


def greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [s.token_id for s in gen.generate(prompt, params, (), None)]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int4-g32"])
def test_compiled_decode_matches_eager(quantize, monkeypatch):
    # torch.compile's decode step (CUDA's, and CPU's fallback); tests/engine/test_aoti.py covers CPU's default.
    monkeypatch.setenv("EMBER_AOTI", "0")
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    if quantize:
        quantize_model(model, quantize)
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    eager = Generator(model, device=torch.device("cpu"), context=64)
    compiled = Generator(model, device=torch.device("cpu"), context=64, compile=True, compile_prefill=True)
    expected = greedy(eager, prompt, 12)
    assert greedy(compiled, prompt, 12) == expected
    assert greedy(compiled, prompt[:5], 12) == greedy(eager, prompt[:5], 12)  # a new prompt length


def test_penalties_and_logprobs_path():
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    gen = Generator(model, device=torch.device("cpu"), context=64)
    prompt = [1, 2, 3, 4]
    params = SamplingParams(
        max_tokens=10, temperature=0, repetition_penalty=10.0, logprobs=2, ignore_eos=True
    )
    steps = list(gen.generate(prompt, params, (), None))
    ids = [s.token_id for s in steps]
    # A huge repetition penalty on a greedy run: no token of the prompt or the output repeats.
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)
    assert all(s.logprob is not None and len(s.top_logprobs) == 2 for s in steps)
    assert steps[-1].finish_reason == "length" and gen.timings.decode_steps == 9


def test_stop_token_ends_generation():
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    gen = Generator(model, device=torch.device("cpu"), context=64)
    first = greedy(gen, [5, 6, 7], 3)
    params = SamplingParams(max_tokens=10, temperature=0)
    steps = list(gen.generate([5, 6, 7], params, (first[1],), None))
    assert [s.token_id for s in steps] == first[:2] and steps[-1].finish_reason == "stop"
