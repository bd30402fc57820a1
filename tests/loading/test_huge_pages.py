"""Weights moved into transparent huge pages (`ember.loading.weights.into_huge_pages`): the same values, ties
kept, small and strided tensors left where they are."""

import pytest
import torch
from torch import nn

from ember.loading import weights
from ember.loading.weights import HUGE_PAGE, into_huge_pages


def test_a_huge_copy_is_the_tensor_on_huge_page_boundaries():
    t = torch.randn(HUGE_PAGE // 4 * 3 + 17)
    c = weights._huge_copy(t)
    assert torch.equal(c, t) and c.dtype == t.dtype and c.shape == t.shape
    assert c.data_ptr() % HUGE_PAGE == 0 and c.data_ptr() != t.data_ptr()
    c[0] = 1e9  # its own memory, writable
    assert t[0] != 1e9
    codes = torch.randint(0, 255, (1024, 4096), dtype=torch.uint8)
    assert torch.equal(weights._huge_copy(codes), codes)


class _Tied(nn.Module):
    """An embedding tied to the output projection, a buffer two modules hold, and tensors too small or strided
    to move."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 1024)
        self.head = nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.embed.weight
        shared = torch.randn(600, 1024)  # 2.4 MB
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("codes", shared)
        self.b.register_buffer("codes", shared)
        self.register_buffer("small", torch.randn(16))
        self.register_buffer("strided", torch.randn(1024, 1024).t())


@pytest.mark.parametrize("on", [True, False])
def test_into_huge_pages_moves_large_tensors_once_and_keeps_ties(monkeypatch, on):
    monkeypatch.setattr(weights, "_huge_pages_on", lambda: on)
    m = _Tied()
    before = {n: t.clone() for n, t in m.state_dict().items()}
    ptrs = {n: t.data_ptr() for n, t in m.state_dict().items()}
    moved = into_huge_pages(m)
    after = m.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert m.head.weight is m.embed.weight and m.a.codes is m.b.codes
    assert after["small"].data_ptr() == ptrs["small"] and after["strided"].data_ptr() == ptrs["strided"]
    if on:
        assert moved == m.embed.weight.nbytes + m.a.codes.nbytes
        assert m.embed.weight.data_ptr() % HUGE_PAGE == 0 and m.a.codes.data_ptr() % HUGE_PAGE == 0
        assert isinstance(m.embed.weight, nn.Parameter)
    else:
        assert moved == 0 and m.embed.weight.data_ptr() == ptrs["embed.weight"]


def test_huge_pages_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EMBER_HUGE_PAGES", "0")
    assert not weights._huge_pages_on()
