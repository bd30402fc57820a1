"""The eager CPU decode step as a flat run of kernel calls (`ember.engine.cpu_step`) against the module path: the
same logits bit for bit at every decode step, the layers one C++ call (`DecodeLayers`), for every family's
layer form (pre-, sandwich and post-norm, q/k norms, biases, multipliers, local rope) and
every kernel a projection runs (float, int4 groups with float or int8 activations, 5/6/8-bit blocks, joined
parts, int8-dyn); the Generator decodes with it where it runs, and keeps the module path where it does not."""

from __future__ import annotations

import pytest
import torch

from ember.engine.cpu_step import EagerCpuStep
from ember.engine.generate import Generator
from ember.ops import cpu_ext
from ember.quant import quantize_model
from tests.conftest import load_hf_dir
from tests.loading.test_gguf import QT, _kept, _write_wide_llama
from tests.models.test_families import CASES, case_reference

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="Ember's CPU kernels are not built here")

# softcap, MoE
UNSUPPORTED = {"gemma2-bias", "mixtral-window", "qwen3-moe", "qwen3-moe-normalized-sparse-step-window"}


@torch.inference_mode()
def assert_same_steps(model, *, steps: int = 6) -> Generator:
    """Prefill a prompt, then decode greedily: each step's logits from the flat step equal the module path's."""
    gen = Generator(model, device=torch.device("cpu"), context=64)
    prompt = torch.randint(3, model.config.vocab_size, (7,)).tolist()
    cache = gen._cache_for(len(prompt) + steps)
    flat = gen._decode
    assert isinstance(flat, EagerCpuStep)  # what the generator decodes with
    token = gen._run_prefill(prompt, cache).argmax(-1)
    for i in range(steps):
        tokens, pos = token.view(1, 1), torch.tensor([[len(prompt) + i]])
        want = gen._forward(tokens, pos, cache)  # (1, V)
        got = flat(tokens, pos, cache)
        assert got.shape == want.shape and torch.equal(got, want), i
        token = want.argmax(-1)
    return gen


def assert_module_path(model) -> None:
    gen = Generator(model, device=torch.device("cpu"), context=64)
    gen._cache_for(16)
    assert gen._decode == gen._forward


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    case_reference(request.param).save_pretrained(path)
    return request.param, load_hf_dir(path)


def test_every_family_decodes_the_module_paths_logits(family):
    case, model = family
    if case in UNSUPPORTED:
        assert_module_path(model)  # which runs them
        return
    assert_same_steps(model)


@pytest.mark.parametrize("scheme", ["int4-g32", "int8-dyn", "int8"])
@pytest.mark.parametrize("case", ["qwen2-bias-tied-window", "granite", "gemma3-linear-rope-bias"])
def test_quantized_projections_decode_the_module_paths_logits(tmp_path, case, scheme):
    # int4 groups (int8 activations: `int4_gemv`), int8-dyn (`int8_gemv`) and int8 weight-only (float
    # activations: `int8_gemv_f32`) have row kernels
    torch.manual_seed(0)
    case_reference(case).save_pretrained(tmp_path)
    assert_same_steps(quantize_model(load_hf_dir(tmp_path), scheme))


def test_a_bfloat16_model_decodes_the_module_paths_logits(tmp_path):
    torch.manual_seed(0)
    case_reference("qwen3-head_dim-yarn").save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path).to(torch.bfloat16)
    assert_same_steps(model)


def test_a_gguf_files_kept_codes_decode_the_module_paths_logits(tmp_path):
    # int4 groups with float activations (Q4_0/Q4_1/Q4_K), 5-bit (Q5_K, Q3_K, Q2_K, Q5_1), 6-bit (Q6_K) and
    # 8-bit (Q8_0) blocks, and projections joined from parts of different kinds
    path = tmp_path / "k.gguf"
    types = [
        dict(q=QT.Q4_K, k=QT.Q4_K, v=QT.Q6_K, output=QT.Q4_0, gate=QT.Q2_K, up=QT.Q5_1, down=QT.Q8_0),
        dict(q=QT.Q3_K, k=QT.Q6_K, v=QT.Q2_K, output=QT.Q4_1, gate=QT.Q5_K, up=QT.Q6_K, down=QT.Q5_1),
    ]
    _write_wide_llama(path, QT.Q6_K, lambda i: types[i], seed=5)
    model = _kept(path)
    kernels = {
        op
        for layer in model.model.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        for op, _ in m.row_kernel().calls
    }
    assert kernels == {"int4_gemv_f32", "int5_gemv_f32", "int6_gemv_f32", "int8_gemv_f32"}
    assert any(len(layer.self_attn.qkv_proj.row_kernel().calls) > 1 for layer in model.model.layers)  # joined
    assert_same_steps(model)


def test_the_default_model_decodes_the_module_paths_tokens(smollm2_gguf):
    from ember.loading.checkpoint import load

    model = load(smollm2_gguf, device="cpu", progress=False).model
    gen = assert_same_steps(model, steps=3)
    # and greedy generation through the Generator (the flat step) gives the module path's tokens
    from ember.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
    flat = [s.token_id for s in gen.generate(prompt, params, (), None)]
    gen._decode = gen._forward
    assert [s.token_id for s in gen.generate(prompt, params, (), None)] == flat


def test_a_compiled_generator_keeps_its_own_step(monkeypatch):
    from tests.conftest import tiny_random_model

    monkeypatch.setenv("EMBER_AOTI", "0")
    model = tiny_random_model(monkeypatch)
    gen = Generator(model, device=torch.device("cpu"), context=64, compile=True)
    gen._cache_for(16)
    assert not isinstance(gen._decode, EagerCpuStep)


@pytest.mark.parametrize(
    "case", ["qwen2-bias-tied-window", "gemma3-linear-rope-bias", "olmo2", "granite", "phi3-longrope-partial"]
)
@torch.inference_mode()
def test_a_paged_batch_of_decode_rows_gives_the_module_paths_rows(tmp_path, case):
    """The server's steps (`ModelRunner`): rows of several requests at different positions, each one token, in a
    paged cache; the flat step's final rows (C++ and Python) equal the model forward's bit for bit."""
    from types import SimpleNamespace

    from ember.engine.core import ModelRunner
    from ember.engine.paged_cache import PagedKVCache
    from ember.engine.request import Request
    from ember.engine.sampler import SamplingParams
    from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

    torch.manual_seed(0)
    case_reference(case).save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    cfg, block = model.config, 4
    cache = PagedKVCache(cfg, num_blocks=48, block_size=block, device="cpu", dtype=torch.float32)
    loaded = SimpleNamespace(model=model, dtype=torch.float32, device=torch.device("cpu"), config=cfg)
    runner = ModelRunner(loaded, cache)
    assert runner.flat is not None
    params = SamplingParams(max_tokens=8, temperature=0)
    reqs = []
    for i, n in enumerate((11, 3, 17)):  # past the sliding windows and Phi-3's original context
        r = Request(
            str(i), torch.randint(3, cfg.vocab_size, (n,)).tolist(), params, 8, None, torch.Generator()
        )
        r.blocks = list(range(16 * i, 16 * i + 16))
        runner.execute(SchedulerOutput([ScheduledRequest(r, n)]))  # the prefill: the module path
        r.num_computed, r.output_ids = n, [5]
        reqs.append(r)
    for _ in range(5):
        tokens, batch, _ = runner._batch(SchedulerOutput([ScheduledRequest(r, 1) for r in reqs]))
        cache.set_batch(batch)
        want = model(tokens, batch.positions, cache)[0]  # (N, E)
        assert torch.equal(runner.flat.paged(tokens, batch, cache), want)
        for r, t in zip(reqs, model.compute_logits(want).argmax(-1).tolist(), strict=True):
            r.num_computed += 1
            r.output_ids.append(t)
