"""Weights and KV caches in transparent huge pages (`ember.huge_pages`): the same values, ties kept, small and
strided tensors left where they are."""

import pytest
import torch
from torch import nn

from ember import huge_pages
from ember.huge_pages import HUGE_PAGE


def test_a_huge_copy_is_the_tensor_on_huge_page_boundaries():
    t = torch.randn(HUGE_PAGE // 4 * 3 + 17)
    c = huge_pages.copy(t)
    assert torch.equal(c, t) and c.dtype == t.dtype and c.shape == t.shape
    assert c.data_ptr() % HUGE_PAGE == 0 and c.data_ptr() != t.data_ptr()
    c[0] = 1e9  # its own memory, writable
    assert t[0] != 1e9
    codes = torch.randint(0, 255, (1024, 4096), dtype=torch.uint8)
    assert torch.equal(huge_pages.copy(codes), codes)


@pytest.mark.parametrize("on", [True, False])
def test_huge_zeros_are_zeros(monkeypatch, on):
    monkeypatch.setattr(huge_pages, "enabled", lambda: on)
    z = huge_pages.zeros((3, 1024, 1000), torch.float32, "cpu")
    assert z.shape == (3, 1024, 1000) and z.dtype == torch.float32 and not z.any()
    assert (z.data_ptr() % HUGE_PAGE == 0) == on
    z[1, 2, 3] = 5.0
    assert z.sum() == 5.0
    small = huge_pages.zeros((4, 4), torch.bfloat16, "cpu")
    assert small.dtype == torch.bfloat16 and not small.any()


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
def test_a_model_moves_its_large_tensors_once_and_keeps_ties(monkeypatch, on):
    monkeypatch.setattr(huge_pages, "enabled", lambda: on)
    m = _Tied()
    before = {n: t.clone() for n, t in m.state_dict().items()}
    ptrs = {n: t.data_ptr() for n, t in m.state_dict().items()}
    moved = huge_pages.into(m)
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
    assert not huge_pages.enabled()
