"""ember.quant.tuning off CUDA: the first candidate, without timing anything (its timing needs a GPU; the
H200 runs are in BENCHMARKS.md); on a GPU the kernel the tuner may time candidates behind, and its pick."""

import pytest
import torch

from ember.quant import tuning


def test_off_cuda_the_first_candidate_is_taken_untimed_and_not_remembered():
    calls = []
    w = torch.zeros(4, 8)
    got = tuning.pick(("test", 4, 8), [{"BLOCK_N": 2}, {"BLOCK_N": 4}], lambda c, ws: calls.append(c), (w,))
    assert got == {"BLOCK_N": 2}
    assert calls == []
    assert not any(k[0] == "test" for k in tuning._picked)


def _cuda_kernels() -> bool:
    from ember.ops import cuda_rtc

    return torch.cuda.is_available() and cuda_rtc.available()


@pytest.mark.skipif(not _cuda_kernels(), reason="needs a CUDA GPU and NVRTC")
def test_the_hold_kernel_holds_the_gpu_before_each_timed_call():
    # `PRECEDED_NS`: each timed launch behind a kernel of that many nanoseconds (none for 0).
    dev = torch.device("cuda")
    assert tuning._hold(dev, 0) is None
    x = torch.zeros(1024, device=dev)
    plain = tuning.graph_seconds(lambda i: x.add_(1), 8)
    held = tuning.graph_seconds(lambda i: x.add_(1), 8, before=tuning._hold(dev, 20_000))
    assert 15e-6 < held - plain < 60e-6, (plain, held)


def test_a_pinned_candidate_is_taken_untimed(monkeypatch):
    calls = []
    w = torch.zeros(4, 8)
    candidates = [{"CUDA": (1, 8, 2, False, False)}, {"CUDA": (1, 8, 4, False, False)}]
    key = ("int4_mma", 1, 4, 8, 128, None, False)
    monkeypatch.setattr(tuning, "PINNED", {key: {"CUDA": (1, 8, 4, False, False)}})
    assert tuning.pick(key, candidates, lambda c, ws: calls.append(c), (w,)) == candidates[1]
    monkeypatch.setattr(tuning, "PINNED", {key: {"CUDA": (9, 9, 9, False, False)}})  # not a candidate
    assert tuning.pick(key, candidates, lambda c, ws: calls.append(c), (w,)) == candidates[0]
    assert calls == []


@pytest.mark.skipif(not _cuda_kernels(), reason="needs a CUDA GPU and NVRTC")
def test_the_tuner_picks_the_fastest_candidate_past_a_failing_one(monkeypatch):
    dev = torch.device("cuda")
    holds = {30: tuning._hold(dev, 30_000), 10: tuning._hold(dev, 10_000)}
    monkeypatch.setattr(tuning, "_picked", {})
    w = torch.zeros(4, device=dev)
    assert tuning.pick(("test", 1), [30, "no such", 10], lambda c, ws: holds[c](), (w,)) == 10
    assert tuning.pick(("test", 1), [30, 10], lambda c, ws: 1 / 0, (w,)) == 10  # remembered, not timed again
