"""The paged cache and the batching engine, proven against the static-cache path on the same model."""

from __future__ import annotations

import pytest
import torch

import ember
from ember.engine.block_manager import BlockManager, block_hashes
from ember.engine.core import EngineConfig, EngineCore
from ember.engine.generate import Generator
from ember.errors import ContextLengthError
from tests.conftest import make_tiny_llama_dir

GREEDY = ember.SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def windowed_llm(tmp_path_factory, smollm2_tokenizer_dir):
    """Tiny Mistral-style model: a sliding window shorter than the prompts, larger init for varied tokens."""
    path = make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-window"),
        smollm2_tokenizer_dir,
        initializer_range=0.3,
        architectures=["MistralForCausalLM"],
    )
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=6)
    (path / "config.json").write_text(json.dumps(cfg))
    return ember.LLM(path)


def static_greedy(llm: ember.LLM, ids: list[int], max_tokens: int) -> list[int]:
    gen = Generator(llm.loaded.model, device=llm.loaded.device, context=llm.context)
    params = ember.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [s.token_id for s in gen.generate(ids, params, (), None)]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 49152, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@torch.no_grad()
def test_paged_prefill_and_decode_logits_match_static_cache(windowed_llm):
    """Mixed batch: prefill chunks and decodes in one packed step give the static cache's logits."""
    from ember.engine.kv_cache import StaticKVCache
    from ember.engine.paged_cache import PagedKVCache
    from ember.engine.request import Request
    from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

    llm = windowed_llm
    model, cfg = llm.loaded.model, llm.loaded.config
    core = EngineCore(llm.loaded, EngineConfig(kv_cache_memory=8 << 20, block_size=4))
    runner, cache = core.runner, core.cache
    assert isinstance(cache, PagedKVCache)
    seqs = prompts(3, seed=1)
    reqs = []
    for i, ids in enumerate(seqs):
        r = Request(str(i), ids, GREEDY, 12, None, torch.Generator())  # type: ignore[arg-type]
        r.blocks = core.blocks.allocate(-(-len(ids) // 4) + 1)
        reqs.append(r)
    # Step 1: request 0 prefills whole, request 1 prefills a chunk, request 2 waits.
    # Step 2: request 0 decodes one token, request 1 finishes its prefill, request 2 prefills.
    steps = [[(0, len(seqs[0])), (1, 5)], [(0, 1), (1, len(seqs[1]) - 5), (2, len(seqs[2]))]]
    reqs[0].output_ids = [7]  # the token request 0 "sampled" after step 1
    reqs[0].prompt_ids = seqs[0]
    for step in steps:
        sched = SchedulerOutput([ScheduledRequest(reqs[i], n) for i, n in step])
        tokens, batch, _ = runner._batch(sched)
        cache.set_batch(batch)
        hidden = model(tokens, batch.positions, cache)
        logits = model.compute_logits(hidden)[0]
        offset = 0
        for i, n in step:
            r = reqs[i]
            all_ids = r.all_ids[: r.num_computed + n]
            static = StaticKVCache(cfg, batch_size=1, max_seq_len=64, device="cpu", dtype=torch.float32)
            ref = model.compute_logits(
                model(torch.tensor([all_ids]), torch.arange(len(all_ids))[None], static)
            )[0]
            assert (logits[offset : offset + n] - ref[r.num_computed :]).abs().max() < 1e-4
            offset += n
        for i, n in step:
            reqs[i].num_computed += n


def test_engine_greedy_equals_static_generator(windowed_llm):
    llm = windowed_llm
    ps = prompts(10)
    params = ember.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(ps, params)
    for ids, out in zip(ps, outs, strict=True):
        assert out.token_ids == static_greedy(llm, ids, 10)
        assert out.finish_reason == "length"
    assert llm.engine().stats().kv_blocks_used == 0


def test_preemption_under_memory_pressure_keeps_outputs(windowed_llm):
    """A cache too small for all requests at once: requests are preempted and recomputed, outputs unchanged."""
    llm = windowed_llm
    ps = prompts(8, seed=3)
    params = ember.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [static_greedy(llm, ids, 20) for ids in ps]
    per_block = core_block_bytes(llm, 4)
    core = EngineCore(
        llm.loaded, EngineConfig(kv_cache_memory=per_block * 26, block_size=4, max_batched_tokens=32)
    )
    for i, ids in enumerate(ps):
        core.add_request(str(i), ids, params)
    results = core.run_to_completion()
    assert core.scheduler.num_preemptions > 0
    for i in range(len(ps)):
        assert [t for u in results[str(i)] for t in u.token_ids] == expected[i]
    assert core.stats().kv_blocks_used == 0


def test_admitted_requests_stream_to_the_end_while_preemption_fills_the_queue(windowed_llm):
    """The server admits a request against the queue limit before its response starts; a queue that preempted
    requests refill meanwhile must not refuse it after that (AsyncEngine.generate(admitted=True))."""
    import asyncio

    from ember.engine.async_engine import AsyncEngine, QueueFullError

    llm = windowed_llm
    ps = prompts(8, seed=3)
    params = ember.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [static_greedy(llm, ids, 20) for ids in ps]
    config = EngineConfig(kv_cache_memory=core_block_bytes(llm, 4) * 26, block_size=4, max_batched_tokens=32)
    engine = AsyncEngine(EngineCore(llm.loaded, config), max_waiting=2)

    async def run(i: int, admitted: bool) -> list[int]:
        gen = engine.generate(f"{admitted}-{i}", ps[i], params, admitted=admitted)
        return [t async for u in gen for t in u.token_ids]

    async def main():
        try:
            got = await asyncio.gather(*(run(i, True) for i in range(len(ps))))
            assert engine.core.scheduler.num_preemptions > 0
            assert got == expected
            with pytest.raises(QueueFullError):  # unadmitted: refused while more than the limit wait
                await asyncio.gather(*(run(i, False) for i in range(len(ps))))
        finally:
            await engine.shutdown(drain_timeout=0)

    asyncio.run(main())


def core_block_bytes(llm, block_size):
    from ember.engine.paged_cache import PagedKVCache

    return PagedKVCache.bytes_per_block(llm.loaded.config, block_size, llm.loaded.dtype)


def test_request_that_can_never_fit_is_refused(windowed_llm):
    llm = windowed_llm
    core = EngineCore(llm.loaded, EngineConfig(kv_cache_memory=core_block_bytes(llm, 4) * 5, block_size=4))
    with pytest.raises(ContextLengthError, match="KV cache, which holds 16"):
        core.add_request("big", list(range(3, 20)), ember.SamplingParams(max_tokens=4))
    with pytest.raises(ContextLengthError, match="prompt has 600 tokens but the context holds 512"):
        core.add_request("long", [5] * 600, ember.SamplingParams(max_tokens=4))
    with pytest.raises(ContextLengthError, match="max_tokens=100"):
        core.add_request("long", [5] * 500, ember.SamplingParams(max_tokens=100))
    with pytest.raises(ContextLengthError, match="needs 17 tokens of KV cache, which holds 16"):
        core.add_request("full", list(range(3, 19)), ember.SamplingParams(max_tokens=None))


def test_max_tokens_none_runs_up_to_what_the_kv_cache_holds(windowed_llm):
    """A context (512) larger than the KV cache (16 tokens): max_tokens=None generates until the cache is full,
    not a ContextLengthError for the whole context."""
    llm = windowed_llm
    core = EngineCore(llm.loaded, EngineConfig(kv_cache_memory=core_block_bytes(llm, 4) * 5, block_size=4))
    params = ember.SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    core.add_request("open", list(range(3, 10)), params)
    updates = core.run_to_completion()["open"]
    assert sum(len(u.token_ids) for u in updates) == 16 - 7
    assert updates[-1].finish_reason == "length"


def test_prefix_cache_shares_blocks_and_abort_frees_them(windowed_llm):
    llm = windowed_llm
    core = EngineCore(llm.loaded, EngineConfig(kv_cache_memory=core_block_bytes(llm, 4) * 64, block_size=4))
    shared = list(range(100, 128))
    params = ember.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    core.add_request("a", shared + [21, 22], params)
    first = core.run_to_completion()["a"]
    core.add_request("b", shared + [31, 32, 33], params)
    second = core.run_to_completion()["b"]
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == len(shared)  # 28 tokens = 7 full blocks reused
    # Abort mid-generation: every block is released.
    core.add_request("c", shared, ember.SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    core.step()
    assert core.stats().kv_blocks_used > 0
    core.abort("c")
    updates = core.step()
    assert [u.finish_reason for u in updates] == ["abort"]
    assert core.stats().kv_blocks_used == 0 and core.stats().running == 0


def test_block_manager_refcounts_and_lru_eviction():
    bm = BlockManager(5, 2)
    assert bm.capacity == 4
    a = bm.allocate(2)
    assert 0 not in a  # block 0 is the padding sink
    h = block_hashes([1, 2, 3, 4], 2)
    bm.register(a[0], h[0])
    bm.register(a[1], h[1])
    assert bm.match_prefix(h) == a
    bm.acquire(a)  # a second owner
    bm.free(a)
    assert bm.stats().used == 2
    bm.free(a)
    assert bm.stats().cached == 2 and bm.stats().used == 0
    assert bm.allocate(3) is not None  # 2 free + 1 evicted (the tail block first)
    assert bm.match_prefix(h) == [a[0]]
    assert bm.allocate(2) is None  # only 1 left: nothing taken
    assert bm.num_available() == 1


def test_bad_token_ids_are_refused_before_queuing(windowed_llm):
    from ember.errors import InvalidParameterError

    core = windowed_llm.engine()
    with pytest.raises(InvalidParameterError, match="logit_bias token id 999999"):
        core.add_request("x", [5, 6], ember.SamplingParams(logit_bias={999999: 1.0}))
    with pytest.raises(InvalidParameterError, match="prompt token id -1"):
        core.add_request("y", [5, -1], ember.SamplingParams())
    assert not core.has_work()


def test_a_request_whose_logits_are_not_finite_ends_with_an_error_not_token_zero(tiny_llama_dir):
    """float16 overflow gave NaN logits, sampled as token 0 for the whole answer; now the request ends with
    finish_reason "error" and the cause (the server answers 500 with it), and LLM.generate raises it."""
    from ember.errors import EmberError

    llm = ember.LLM(tiny_llama_dir, dtype="float16")
    with torch.no_grad():  # silu(gate) * up ~1e6: float16 tops out at 65504
        llm.loaded.model.model.layers[0].mlp.gate_up_proj.weight.mul_(1e4)
    core = EngineCore(llm.loaded, EngineConfig(kv_cache_memory=8 << 20, block_size=4))
    for i, ids in enumerate(prompts(2)):
        core.add_request(str(i), ids, GREEDY)
    updates = core.run_to_completion()
    for steps in updates.values():
        assert [u.finish_reason for u in steps] == ["error"] and steps[0].token_ids == []
        assert "overflow float16" in steps[0].error
    assert not core.has_work()
    with pytest.raises(EmberError, match="overflow float16"):
        llm.generate("Hello", GREEDY)


@torch.no_grad()
def test_longrope_factors_follow_each_sequence_not_the_batch_or_a_chunk(tmp_path, smollm2_tokenizer_dir):
    """Phi-3 LongRoPE takes its long factors once a sequence is longer than the original length. They were
    picked from the largest position in the packed step: a prompt's early chunks took the short ones, and a
    short request batched with a long one took the long ones. Against transformers' single-pass logprobs."""
    from transformers import Phi3ForCausalLM

    half = 8  # rotary_dim 16 (head_dim 16)
    rope = dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[2.0 + 1.5 * i for i in range(half)],
    )
    path = make_tiny_llama_dir(
        tmp_path,
        smollm2_tokenizer_dir,
        arch="Phi3",
        original_max_position_embeddings=16,
        rope_parameters=dict(rope_theta=10000.0, **rope),
        pad_token_id=0,
    )
    ref = Phi3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    llm = ember.LLM(path)
    short, long = prompts(1, seed=3)[0][:10], prompts(1, seed=4)[0] * 3
    assert len(short) + 4 <= 16 < len(long)
    params = ember.SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)

    def run(requests: dict[str, list[int]], chunk: int) -> dict[str, list[float]]:
        core = EngineCore(
            llm.loaded, EngineConfig(kv_cache_memory=8 << 20, block_size=4, max_batched_tokens=chunk)
        )
        for rid, ids in requests.items():
            core.add_request(rid, ids, params)
        out = core.run_to_completion()
        return {
            rid: [lp for u in steps for e in u.logprobs for lp in e.values()] for rid, steps in out.items()
        }

    def expected(ids: list[int], tokens: list[int]) -> list[float]:
        # transformers: one forward over the sequence, long factors for all of it when it is long
        logp = torch.log_softmax(ref(torch.tensor([ids + tokens])).logits[0].float(), dim=-1)
        return [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]

    alone = run({"long": long}, chunk=8)  # the long prompt prefilled in chunks of 8
    core_tokens = llm.generate([long], params)[0].outputs[0].token_ids
    assert alone["long"] == pytest.approx(expected(long, core_tokens), abs=1e-4)
    together = run({"short": short, "long": long}, chunk=512)
    short_tokens = llm.generate([short], params)[0].outputs[0].token_ids
    assert together["short"] == pytest.approx(run({"short": short}, chunk=512)["short"], abs=1e-6)
    assert together["short"] == pytest.approx(expected(short, short_tokens), abs=1e-4)


def test_penalties_count_the_prompt_from_the_first_token_as_the_single_stream_does(windowed_llm):
    """The engine made a request's penalty state at its first sampled token, so that token's logits were not
    penalised for the prompt's tokens (LLM.generate and LLM.stream differed). The sliding window (6) makes
    a prompt's first token invisible to its last position: prepending the unpenalised answer puts it in the
    prompt without changing the logits, and a repetition penalty must then avoid it."""
    llm = windowed_llm
    ids = prompts(1, seed=5)[0][:12]
    answer = static_greedy(llm, ids, 1)[0]
    ids = [answer] + ids
    assert static_greedy(llm, ids, 1) == [answer]
    params = ember.SamplingParams(max_tokens=4, temperature=0, repetition_penalty=10.0, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    stream = [t for c in llm.stream(ids, params) for t in c.token_ids]
    assert out.token_ids == stream and out.token_ids[0] != answer
