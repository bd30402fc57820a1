"""The pure sampler: exact tokens under fixed generators, filters that keep only what they should."""

from __future__ import annotations

import pytest
import torch

from ember.engine.sampler import SamplingParams, SamplingTensors, apply_penalties, make_generator, sample
from ember.errors import InvalidParameterError

V = 50


def draw(logits: torch.Tensor, n: int, seed: int = 0, **kw) -> torch.Tensor:
    """n samples from one row of logits (V,) with the given params, through a batch of n identical rows."""
    params = [SamplingParams(**kw)] * n
    st = SamplingTensors.build(params, logits.shape[-1], "cpu")
    gen = make_generator(seed, "cpu")
    return sample(logits.expand(n, -1).clone(), st, [gen] * n)


def test_greedy_is_argmax_and_mixed_batches_keep_row_settings():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)] * 2
    st = SamplingTensors.build(params, V, "cpu")
    out = sample(logits, st, [make_generator(i, "cpu") for i in range(4)])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert SamplingTensors.build([SamplingParams(temperature=0)], V, "cpu").all_greedy


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = torch.zeros(V)
    a, b, c = draw(logits, 64, seed=7), draw(logits, 64, seed=7), draw(logits, 64, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_samples_follow_the_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(draw(logits, n, seed=3), minlength=4).float() / n
    assert (counts - logits.softmax(-1)).abs().max() < 0.015
    # temperature 0.5 sharpens to softmax(2 * logits)
    counts = torch.bincount(draw(logits, n, seed=4, temperature=0.5), minlength=4).float() / n
    assert (counts - (logits * 2).softmax(-1)).abs().max() < 0.015


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([3.0, 2.9, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    assert set(draw(logits, 2000, top_k=2).tolist()) == {0, 1}
    probs = logits.softmax(-1)  # p = [.40, .36, .15, .05, ...]; mass before token 2 is .77
    assert set(draw(logits, 4000, top_p=0.7).tolist()) == {0, 1}
    assert set(draw(logits, 4000, top_p=0.8).tolist()) == {0, 1, 2}
    keep = {i for i, p in enumerate(probs.tolist()) if p >= 0.3 * probs.max()}
    assert set(draw(logits, 4000, min_p=0.3).tolist()) == keep
    assert set(draw(logits, 100, top_k=1, temperature=5.0).tolist()) == {0}


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    st = SamplingTensors.build(params, 4, "cpu")
    seen = torch.tensor([[True, True, False, True]])
    counts = torch.tensor([[0, 2, 0, 1]], dtype=torch.int32)
    out = apply_penalties(logits, st, seen, counts)
    # token 0: seen, positive -> 2/2 = 1; token 1: seen, negative -> -4, minus 0.5 + 2 * 0.25
    # token 2: untouched; token 3: 0.5 / 2 - 0.5 - 0.25
    assert torch.allclose(out, torch.tensor([[1.0, -5.0, 1.0, -0.5]]))
    st_bias = SamplingTensors.build([SamplingParams(logit_bias={3: 10.0})], 4, "cpu")
    assert sample(apply_penalties(logits, st_bias, seen & False, counts * 0), st_bias).item() == 3


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(temperature=-1), "temperature=-1"),
        (dict(top_p=0), "top_p=0"),
        (dict(top_k=-5), "top_k=-5"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(min_p=2), "min_p=2"),
        (dict(presence_penalty=3), "presence_penalty=3"),
        (dict(n=0), "n=0"),
        (dict(stop=("",)), "stop="),
        (dict(logprobs=50), "logprobs=50"),
        # Wrong kinds were accepted, or failed deep inside (TypeError, torch's topk or manual_seed).
        (dict(temperature="0.5"), "temperature='0.5'"),
        (dict(temperature=None), "temperature=None"),
        (dict(temperature=True), "temperature=True"),
        (dict(top_p="1"), "top_p='1'"),
        (dict(min_p=None), "min_p=None"),
        (dict(frequency_penalty="1"), "frequency_penalty='1'"),
        (dict(top_k=True), "top_k=True"),
        (dict(max_tokens=True), "max_tokens=True"),
        (dict(n=True), "n=True"),
        (dict(logprobs=1.5), "logprobs=1.5"),
        (dict(logprobs=True), "logprobs=True"),
        (dict(logprobs="2"), "logprobs='2'"),
        (dict(seed="1"), "seed='1'"),
        (dict(seed=1.5), "seed=1.5"),
        (dict(stop=5), "stop=5"),
        (dict(stop_token_ids=["a"]), "stop_token_ids="),
        (dict(stop_token_ids=[-1]), "stop_token_ids="),
        (dict(logit_bias={1: float("nan")}), r"logit_bias\[1\]=nan"),
        (dict(logit_bias={1: 500}), r"logit_bias\[1\]=500"),
        (dict(logit_bias={"a": 1.0}), "logit_bias="),
        (dict(logit_bias=[1, 2]), "logit_bias="),
        (dict(ignore_eos="no"), "ignore_eos='no'"),
    ],
)
def test_invalid_params_name_the_value(kw, match):
    with pytest.raises(InvalidParameterError, match=match):
        SamplingParams(**kw)
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        SamplingTensors.build([SamplingParams(logit_bias={99: 1.0})], 4, "cpu")


def test_none_means_empty_and_containers_are_copied():
    bias, stop = {3: 1.0}, ["x"]
    p = SamplingParams(stop=stop, logit_bias=bias)
    bias[4], stop[0] = 2.0, "y"  # the caller's objects change later; the params do not
    assert p.logit_bias == {3: 1.0} and p.stop == ("x",)
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ((), (), {})


def test_seeds_that_differ_past_32_bits_draw_different_numbers():
    from ember.engine.sampler import make_generator

    def draws(seed: int) -> list[float]:
        return torch.rand(4, generator=make_generator(seed, "cpu")).tolist()

    # torch's CPU generator keeps the low 32 bits: these pairs drew the same numbers
    for a, b in ((-1, 2**63 - 1), (0, -(2**63)), (0, 2**32), (7, 2**32 + 7)):
        assert draws(a) != draws(b)
    assert draws(12345) == draws(12345) and draws(-5) == draws(-5)


def test_a_cpu_rows_candidates_keep_exactly_what_the_whole_vocabulary_keeps():
    """`_filter_candidates` (each row's most likely K tokens, where the filters provably drop the rest) keeps the
    same tokens with the same logits as `_filter` over the whole vocabulary, ties at the candidates' edge
    included, and gives up where a row could keep a token past the candidates."""
    from ember.engine.sampler import CANDIDATES, _filter, _filter_candidates

    torch.manual_seed(0)
    vocab = 4 * CANDIDATES[-1]
    grid = [
        dict(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.7, 1.3)
        for k in (0, 1, 40, CANDIDATES[0])
        for p in (1.0, 0.5, 0.9)
        for m in (0.0, 0.05)
        if k or p < 1 or m
    ]
    found = 0
    for scale in (1.0, 4.0, 8.0):
        for start in range(0, len(grid), 6):
            params = grid[start : start + 6] + [SamplingParams(temperature=0)]
            params = [p if isinstance(p, SamplingParams) else SamplingParams(**p) for p in params]
            logits = torch.randn(len(params), vocab) * scale
            # Ties across the first candidate count's edge (ties inside top-p's nucleus are cut in sort order,
            # an arbitrary one, in either path).
            edge = logits.argsort(dim=-1, descending=True)[:, CANDIDATES[0] - 6 : CANDIDATES[0] + 6]
            logits.scatter_(-1, edge, logits.gather(-1, edge[:, :1]).expand_as(edge).clone())
            st = SamplingTensors.build(params, vocab, "cpu")
            got = _filter_candidates(logits, st)
            if got is None:
                continue
            found += 1
            filtered, ids = got
            want = _filter(logits, st)[:-1]  # the greedy row's filters are not applied to it
            full = torch.full_like(want, float("-inf")).scatter(-1, ids[:-1], filtered[:-1])
            assert torch.equal(full.isfinite(), want.isfinite())
            assert torch.allclose(full[want.isfinite()], want[want.isfinite()])
    assert found >= 6
    # Nearly flat logits: top-p 0.999 keeps more tokens than any candidate count, so the whole vocabulary is used.
    st = SamplingTensors.build([SamplingParams(top_p=0.999)], vocab, "cpu")
    assert _filter_candidates(torch.randn(1, vocab) * 0.01, st) is None


def test_sampling_from_the_candidates_follows_the_filtered_distribution():
    from ember.engine.sampler import CANDIDATES

    logits = torch.full((2 * CANDIDATES[-1],), -30.0)
    logits[:4] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(draw(logits, n, seed=5, top_p=0.99), minlength=4)[:4].float() / n
    assert (counts - logits[:4].softmax(-1)).abs().max() < 0.015
