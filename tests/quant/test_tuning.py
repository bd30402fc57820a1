"""ember.quant.tuning off CUDA: the first candidate, without timing anything (its timing needs a GPU; the
H200 runs are in BENCHMARKS.md)."""

import torch

from ember.quant import tuning


def test_off_cuda_the_first_candidate_is_taken_untimed_and_not_remembered():
    calls = []
    w = torch.zeros(4, 8)
    got = tuning.pick(("test", 4, 8), [{"BLOCK_N": 2}, {"BLOCK_N": 4}], lambda c, ws: calls.append(c), (w,))
    assert got == {"BLOCK_N": 2}
    assert calls == []
    assert not any(k[0] == "test" for k in tuning._picked)
