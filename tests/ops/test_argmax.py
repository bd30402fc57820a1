"""The split argmax (two Triton kernels) against torch.argmax: ties, NaN, -inf rows. In Triton's interpreter on
a CPU; compiled, on the GPU, where a run sets TRITON_INTERPRET=0."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (runs in its interpreter)"
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_argmax_matches_torch(dtype):
    from ember.ops.triton_argmax import split_argmax

    g = torch.Generator().manual_seed(0)
    V = 1000  # blocks of 128: the last one is partial
    x = torch.randn(6, V, generator=g).to(dtype)
    x[1, 517] = x[1, 905] = 50.0  # a tie across blocks: the first index wins
    x[2, 130] = x[2, 131] = 50.0  # a tie inside a block
    x[3, 700] = float("nan")  # a NaN counts as the largest value
    x[3, 300] = float("inf")
    x[4] = float("-inf")  # nothing allowed: index 0, as torch.argmax
    x[5, 999] = 60.0  # the last element
    want = x.argmax(dim=-1)
    assert want.tolist()[1:] == [517, 130, 700, 0, 999]
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton needs a CUDA GPU (TRITON_INTERPRET=0)")
    x = x.to(DEVICE)
    assert split_argmax(x, block=128).tolist() == want.tolist()
    assert split_argmax(x[:, :640], block=128).tolist() == x[:, :640].argmax(dim=-1).tolist()  # strided rows
