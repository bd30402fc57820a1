"""The AOTInductor CPU decode step: the eager step's greedy tokens, one package for every cache length that
later Generators load instead of compiling, and torch.compile's step when the package cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from ember.bench import random_model
from ember.engine.aoti import AOTIDecodeStep, package_path
from ember.engine.generate import Generator
from ember.engine.sampler import SamplingParams
from ember.quant import quantize_model
from tests.conftest import assert_greedy, tiny_random_model

CPU = torch.device("cpu")


def greedy(gen: Generator, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [s.token_id for s in gen.generate(prompt, params, (), None)]


def tiny(quantize: str | None):
    model = random_model("tiny", device="cpu", dtype=torch.float32)
    return quantize_model(model, quantize) if quantize else model


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int4-g32"])  # int4-g32: Ember's CPU int4 and int8 kernels
def test_aoti_decode_matches_eager_and_is_reused(quantize, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = tiny(quantize)
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    eager = Generator(model, device=CPU, context=600)
    compiled = Generator(model, device=CPU, context=600, compile=True)
    expected = greedy(eager, prompt, 12)
    assert greedy(compiled, prompt, 12) == expected
    assert isinstance(compiled._decode, AOTIDecodeStep)
    # A longer request grows the cache from 256 to 512 slots; the cache length is dynamic in the package. Over
    # 300 tokens the random model meets near-ties, which int8 activation codes (int4's CPU kernel) may break
    # either way: each token is eager's argmax or a near-tie of it.
    assert_greedy(model, prompt[:5], greedy(compiled, prompt[:5], 300))
    assert compiled.cache.max_seq_len == 512
    assert len(list((tmp_path / "aoti").glob("*.pt2"))) == 1
    # A new Generator (or process) for a model of this shape loads the package instead of compiling it.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember.engine.aoti"):
        again = Generator(model, device=CPU, context=600, compile=True)
        assert greedy(again, prompt, 12) == expected
    assert "loaded" in caplog.text and "compiling" not in caplog.text
    # Not asked either way (the CLI's default), a Generator decodes with the package an earlier run built;
    # asked not to compile, eagerly.
    unasked = Generator(model, device=CPU, context=600, compile=None)
    assert greedy(unasked, prompt, 12) == expected and unasked.decode_step == "aoti"
    eager_again = Generator(model, device=CPU, context=600, compile=False)
    assert greedy(eager_again, prompt, 12) == expected and eager_again.decode_step == "eager"


def test_unasked_without_a_package_decodes_eagerly_and_builds_none(tmp_path, monkeypatch):
    # compile=None never starts the minutes of compiling: with no package on disk it is the eager step.
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = tiny(None)
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    unasked = Generator(model, device=CPU, context=64, compile=None)
    assert greedy(unasked, prompt, 6) == greedy(Generator(model, device=CPU, context=64), prompt, 6)
    assert unasked.decode_step == "eager" and not unasked.compiled
    assert not (tmp_path / "aoti").exists() or not list((tmp_path / "aoti").iterdir())


def test_a_package_that_does_not_load_is_removed_not_tried_every_run(tmp_path, monkeypatch, caplog):
    # A truncated or foreign file where the package lies used to be warned about on every run and never
    # replaced (compile=True only builds where nothing lies), so --compile stayed broken until it was deleted.
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = tiny(None)
    path = package_path(model, torch.float32)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a zip archive")
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    with caplog.at_level(logging.WARNING, logger="ember.engine"):
        unasked = Generator(model, device=CPU, context=64, compile=None)  # tries what lies there
        tokens = greedy(unasked, prompt, 6)
    assert tokens == greedy(Generator(model, device=CPU, context=64), prompt, 6)
    assert unasked.decode_step == "eager"
    assert f"the compiled decode step {path} does not load" in caplog.text and "removed" in caplog.text
    assert not path.exists()  # the next --compile run builds it again


@pytest.mark.slow
def test_aoti_decode_of_a_mixture_of_experts_matches_eager(tmp_path, monkeypatch):
    # The routed experts in the exported step: no host sync, and float32 (torch's grouped GEMM traces bf16 only).
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = tiny_random_model(monkeypatch, experts=4)
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    compiled = Generator(model, device=CPU, context=64, compile=True)
    assert greedy(compiled, prompt, 12) == greedy(Generator(model, device=CPU, context=64), prompt, 12)
    assert isinstance(compiled._decode, AOTIDecodeStep)


@pytest.mark.slow
def test_unbuildable_aoti_step_falls_back_to_torch_compile(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(blocker))  # the package folder cannot be created under a file
    model = tiny("int4-g32")
    prompt = torch.randint(0, model.config.vocab_size, (7,)).tolist()
    compiled = Generator(model, device=CPU, context=64, compile=True)
    with caplog.at_level(logging.WARNING, logger="ember.engine.generate"):
        tokens = greedy(compiled, prompt, 12)
    assert "AOTInductor decode step unavailable" in caplog.text
    assert not isinstance(compiled._decode, AOTIDecodeStep)
    assert tokens == greedy(Generator(model, device=CPU, context=64), prompt, 12)


class _Tagged(torch.Tensor):
    """A wrapper tensor subclass holding another tensor, as torchao's quantized weights do: the outer
    shape and dtype can be a plain weight's while the data compiled code reads differs."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=torch.float32)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter(t) detaches
            return cls(args[0].inner)
        raise NotImplementedError(func)  # only its layout is looked at here


def test_package_key_tells_a_tensor_subclass_weight_from_a_plain_one():
    """A model whose weight became a subclass of the same outer shape (torchao's quantize_) must not load
    the plain model's package (it did: the package then read weights whose data it cannot see)."""
    from ember.engine.aoti import package_key

    model = tiny(None)
    plain = package_key(model, torch.float32)
    proj = model.model.layers[0].mlp.down_proj
    w = proj.weight
    assert package_key(model, torch.float32) == plain
    proj.weight = torch.nn.Parameter(_Tagged(w.detach().to(torch.int8)), requires_grad=False)
    tagged_int8 = package_key(model, torch.float32)
    proj.weight = torch.nn.Parameter(_Tagged(w.detach().to(torch.int16)), requires_grad=False)
    assert len({plain, tagged_int8, package_key(model, torch.float32)}) == 3  # inner dtypes differ too
