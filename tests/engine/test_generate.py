"""Generator: the compiled decode step gives the eager step's greedy tokens; penalties and logprobs still run."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from ember.bench import random_model
from ember.engine import generate
from ember.engine.generate import Generator, prefill_length
from ember.engine.sampler import SamplingParams
from ember.quant import quantize_model
from tests.conftest import tiny_random_model


def greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [s.token_id for s in gen.generate(prompt, params, (), None)]


@pytest.mark.slow
@pytest.mark.parametrize("quantize,experts", [(None, 0), ("int4-g32", 0), (None, 4)])
def test_compiled_decode_matches_eager(quantize, experts, monkeypatch):
    # torch.compile's decode step (CUDA's, and CPU's fallback); tests/engine/test_aoti.py covers CPU's default.
    # experts: a Mixtral, whose routed experts must compile without a host sync in float32 too.
    monkeypatch.setenv("EMBER_AOTI", "0")
    model = tiny_random_model(monkeypatch, experts=experts)
    if quantize:
        quantize_model(model, quantize)
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    eager = Generator(model, device=torch.device("cpu"), context=64)
    compiled = Generator(model, device=torch.device("cpu"), context=64, compile=True, compile_prefill=True)
    expected = greedy(eager, prompt, 12)
    assert greedy(compiled, prompt, 12) == expected
    assert greedy(compiled, prompt[:5], 12) == greedy(eager, prompt[:5], 12)  # a new prompt length


@pytest.mark.slow
def test_a_compiled_generator_outlives_torch_compiles_recompile_limit(monkeypatch):
    # Each cache length is a graph of its own (static shapes). torch.compile counts recompiles per code object
    # and, with fullgraph, fails past its limit (8): a chat whose cache grew past 8 lengths (2048 tokens) did.
    monkeypatch.setenv("EMBER_AOTI", "0")
    model = tiny_random_model(monkeypatch)
    compiled = Generator(model, device=torch.device("cpu"), context=1024, compile=True, compile_prefill=True)
    eager = Generator(model, device=torch.device("cpu"), context=1024)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (40, 300, 560):  # caches of 256, 512 and 768 slots: past a limit of 1
            prompt = torch.randint(0, model.config.vocab_size, (n,)).tolist()
            assert greedy(compiled, prompt, 3) == greedy(eager, prompt, 3)
            assert compiled.cache.max_seq_len == -(-(n + 3) // 256) * 256


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU, with TRITON_INTERPRET=0",
)
@pytest.mark.parametrize("own_graph,compile_prefill", [(True, False), (False, False), (True, True)])
def test_cuda_graph_decode_matches_eager_across_cache_lengths(own_graph, compile_prefill, monkeypatch):
    # The CUDA path of the test above: the step captured in Ember's DecodeGraph (or torch.compile's
    # "reduce-overhead" graph), a step per cache length, beside the prefill's CUDA graphs or the eager prefill;
    # greedy tokens picked inside the graph, and tokens picked outside it (a penalty, log-probabilities), each
    # as the eager step picks them.
    monkeypatch.setattr(generate, "OWN_GRAPH", own_graph)
    cuda = torch.device("cuda")
    model = random_model("tiny", device=cuda, dtype=torch.float32)
    compiled = Generator(model, device=cuda, context=1024, compile=True, compile_prefill=compile_prefill)
    eager = Generator(model, device=cuda, context=1024)
    outside = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, logprobs=2, ignore_eos=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n, slots in ((40, 256), (300, 512), (560, 768), (41, 768)):  # a cache only grows
            prompt = torch.randint(0, model.config.vocab_size, (n,)).tolist()
            assert greedy(compiled, prompt, 6) == greedy(eager, prompt, 6)
            assert compiled.cache.max_seq_len == slots
            ours = list(compiled.generate(prompt, outside, (), None))
            theirs = list(eager.generate(prompt, outside, (), None))
            assert [s.token_id for s in ours] == [s.token_id for s in theirs]
            for a, b in zip(ours, theirs, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert greedy(compiled, prompt[:-1], 3) == greedy(eager, prompt[:-1], 3)  # back in the graph
    assert (compiled._graph is not None) == own_graph


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU, with TRITON_INTERPRET=0",
)
def test_a_step_no_cuda_graph_can_hold_decodes_with_torch_compiles_graphs(monkeypatch, caplog):
    # A step that syncs with the host cannot be captured: the generation goes on (torch.compile's
    # "reduce-overhead" runs what it can), gives the eager step's tokens, and says why in one log line.
    real = generate.DecodeGraph._logits

    def syncing(self):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # no graph can hold a host sync
        return real(self)

    monkeypatch.setattr(generate.DecodeGraph, "_logits", syncing)
    cuda = torch.device("cuda")
    model = random_model("tiny", device=cuda, dtype=torch.float32)
    compiled = Generator(model, device=cuda, context=256, compile=True)
    eager = Generator(model, device=cuda, context=256)
    prompt = torch.randint(0, model.config.vocab_size, (20,)).tolist()
    with caplog.at_level(logging.WARNING, logger="ember.engine.generate"):
        assert greedy(compiled, prompt, 6) == greedy(eager, prompt, 6)
    assert "not captured in a CUDA graph" in caplog.text and compiled._graph is None
    assert greedy(compiled, prompt[:-3], 6) == greedy(eager, prompt[:-3], 6)


@pytest.mark.parametrize("window", [None, 6])
def test_a_padded_prefill_changes_no_token_or_logprob(window, monkeypatch):
    """CUDA-graph prefills run at `prefill_length`s with the prompt padded at its end: nothing the prompt's
    positions attend to changes (a sliding window too), and the cache slots the padding writes are each
    written again by a decode step before any query reads them."""
    model = tiny_random_model(monkeypatch, window)
    prompt = torch.randint(0, model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    plain = Generator(model, device=torch.device("cpu"), context=64)
    padded = Generator(model, device=torch.device("cpu"), context=64)
    padded.pad_prefill = True  # on CUDA, compile_prefill's default
    want = list(plain.generate(prompt.tolist(), params, (), None))
    got = list(padded.generate(prompt.tolist(), params, (), None))
    assert [s.token_id for s in got] == [s.token_id for s in want]
    for a, b in zip(got, want, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    # The prefill ran at 32 tokens: slots 26-31 (past the last decode step's) still hold the padding's keys.
    assert padded.cache.k[0][:, :, 26:32].abs().sum() > 0 and plain.cache.k[0][:, :, 26:].abs().sum() == 0


def test_prefill_lengths():
    assert [prefill_length(t, 8192) for t in (1, 16, 17, 100, 128, 129, 200, 1000, 1025, 5000)] == [
        16, 16, 32, 112, 128, 160, 224, 1024, 1280, 5120,
    ]  # fmt: skip
    assert prefill_length(100, 104) == 104 and prefill_length(100, 100) == 100  # never past the cache


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_logits_that_are_not_finite_are_an_error_not_a_run_of_token_zero(dtype):
    """Activations that overflow float16 (Gemma 3 does) made NaN logits, whose argmax is token 0: the run
    answered "" and exited 0. Now the first token's read names the cause."""
    from ember.errors import NonFiniteLogitsError

    model = random_model("tiny", device="cpu", dtype=dtype)
    with torch.no_grad():  # silu(gate) * up ~1e6: float16 tops out at 65504
        model.model.layers[0].mlp.gate_up_proj.weight.mul_(1e4)
    gen = Generator(model, device=torch.device("cpu"), context=64)
    if dtype == torch.float32:
        assert len(greedy(gen, [1, 2, 3], 2)) == 2
        return
    with pytest.raises(NonFiniteLogitsError, match="overflow float16.*bfloat16 or float32"):
        greedy(gen, [1, 2, 3], 2)


def test_a_generation_started_while_another_is_suspended_stops_the_first_not_its_tokens():
    """Two LLM.stream iterators advanced in turn share the one static cache: the second's prefill overwrote
    the first's keys, which went on silently with wrong tokens. Now the first stops with an error; the second
    is unharmed."""
    from ember.errors import EmberError

    model = random_model("tiny", device="cpu", dtype=torch.float32)
    gen = Generator(model, device=torch.device("cpu"), context=64)
    expected = greedy(gen, [9, 8, 7, 6, 5], 6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = gen.generate([1, 2, 3], params, (), None)
    second = gen.generate([9, 8, 7, 6, 5], params, (), None)
    next(first)
    got = [next(second).token_id]
    with pytest.raises(EmberError, match="another generation started"):
        next(first)
    assert got + [s.token_id for s in second] == expected
