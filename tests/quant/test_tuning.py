"""ember.quant.tuning off CUDA: the first candidate, without timing anything (its timing needs a GPU; the
H200 runs are in BENCHMARKS.md); on a GPU the kernel the tuner may time candidates behind, and its ways of
timing them (interleaved, queued)."""

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


@pytest.mark.skipif(not _cuda_kernels(), reason="needs a CUDA GPU and NVRTC")
def test_queued_replays_leave_out_the_hosts_time_to_queue_them(monkeypatch):
    # A graph of 64 tiny launches: waited for one by one, each replay's time holds the host's queueing of the
    # graph after its start event; queued behind a sleep, only the GPU's (the launches back to back).
    dev = torch.device("cuda")
    x = torch.zeros(16, device=dev)
    times = {}
    for queued in (False, True):
        monkeypatch.setattr(tuning, "QUEUED", queued)
        times[queued] = tuning.graph_seconds(lambda i: x.add_(1), 64, replays=9)
    assert times[True] < times[False], times


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
@pytest.mark.parametrize("queued", [False, True])
def test_interleaved_timing_times_each_call_and_keeps_a_failure_in_its_place(queued, monkeypatch):
    # QUEUED: the replays queued behind a GPU sleep and waited for once; the same times, without the host's
    monkeypatch.setattr(tuning, "QUEUED", queued)
    dev = torch.device("cuda")
    short, long = tuning._hold(dev, 10_000), tuning._hold(dev, 30_000)

    def fails(i: int) -> None:
        raise RuntimeError("a tile that does not fit")

    got = tuning.interleaved_seconds([lambda i: long(), fails, lambda i: short()], 8)
    assert isinstance(got[1], RuntimeError)
    assert 8e-6 < got[2] < 16e-6 and 26e-6 < got[0] < 40e-6, got


@pytest.mark.skipif(not _cuda_kernels(), reason="needs a CUDA GPU and NVRTC")
@pytest.mark.parametrize("interleaved, queued", [(True, False), (False, True), (True, True)])
def test_the_tuner_picks_the_fastest_candidate_past_a_failing_one(interleaved, queued, monkeypatch):
    dev = torch.device("cuda")
    holds = {30: tuning._hold(dev, 30_000), 10: tuning._hold(dev, 10_000)}
    monkeypatch.setattr(tuning, "INTERLEAVED", interleaved)
    monkeypatch.setattr(tuning, "QUEUED", queued)
    monkeypatch.setattr(tuning, "_picked", {})
    w = torch.zeros(4, device=dev)
    assert tuning.pick(("test", 1), [30, "no such", 10], lambda c, ws: holds[c](), (w,)) == 10


def test_interleaved_timing_maps_each_rounds_times_back_to_its_call(monkeypatch):
    # The bookkeeping of `interleaved_seconds` off a GPU: graphs stand in as numbers (in the order built), every round
    # replays the live ones starting one further on, and each call gets the median of its own replays.
    captured, order = [], []

    def capture(call, launches, before):
        call(0)  # a failing call raises here, as a candidate that cannot build does
        captured.append(call)
        return len(captured) - 1

    def replays(graphs, launches):
        order.append(list(graphs))
        return [1e-6 * (10 * g + r % 3) for r, g in enumerate(graphs)]

    monkeypatch.setattr(tuning, "_captured", capture)
    monkeypatch.setattr(tuning, "_timed_replays", replays)

    def fails(i):
        raise RuntimeError("a tile that does not fit")

    got = tuning.interleaved_seconds([lambda i: None, fails, lambda i: None, lambda i: None], 4, replays=3)
    # calls 0, 2, 3 built graphs 0, 1, 2; three rounds of them, each starting one further on, queued at once
    assert order == [[0, 1, 2, 1, 2, 0, 2, 0, 1]]
    assert isinstance(got[1], RuntimeError)
    # graph g's replays at places p of the queue took 10 g + p % 3 us: medians 1, 11, 21
    assert [round(got[i] * 1e6, 6) for i in (0, 2, 3)] == [1.0, 11.0, 21.0]
