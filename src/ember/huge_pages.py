"""Memory that Linux backs with transparent huge pages (2 MB), for what a CPU decode step streams.

A decode step reads every weight once (and each layer's KV cache up to the position): in 4 KB pages that is a
TLB miss, a page walk, every 4 KB, ~170k a step of a 1B model's 680 MB; in 2 MB pages 512 times fewer. Linux
gives huge pages to anonymous memory advised MADV_HUGEPAGE where THP is "madvise" (a common default) or
"always". Ember's tensors of 2 MB or more on a CPU live in such mappings: each in its own, its whole 2 MB pages
advised (the rest ordinary pages, so nothing past the tensor is ever touched), unmapped when its last view goes.
`EMBER_HUGE_PAGES=0` keeps ordinary allocations.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB granule) transparent huge page


def enabled() -> bool:
    """Whether Linux backs memory advised MADV_HUGEPAGE by huge pages (THP not "never") and Ember may ask
    (EMBER_HUGE_PAGES not 0)."""
    if (
        os.environ.get("EMBER_HUGE_PAGES") == "0"
        or sys.platform != "linux"
        or not hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _mapped(n: int) -> torch.Tensor:
    """n bytes (uint8, zeros) starting on a huge page boundary of a fresh anonymous mapping, whose whole huge
    pages are advised MADV_HUGEPAGE; the tensor holds the mapping."""
    region = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages, the memory as good
        region.madvise(mmap.MADV_HUGEPAGE, start, n // HUGE_PAGE * HUGE_PAGE)
    return raw[start : start + n]


def copy(t: torch.Tensor) -> torch.Tensor:
    """Contiguous CPU tensor `t`'s values in huge-page memory (`_mapped`)."""
    out = _mapped(t.nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape), in huge-page memory where it is a CPU tensor of a huge page or more and `enabled()`."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    if torch.device(device).type != "cpu" or n < HUGE_PAGE or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapped(n).view(dtype).view(shape)  # an anonymous mapping reads as zeros


def into(model: nn.Module) -> int:
    """Moves `model`'s contiguous CPU parameters and buffers of a huge page or more into huge-page memory
    (`copy`) where `enabled()`; returns the bytes moved. A tensor held by several modules stays one tensor."""
    if not enabled():
        return 0
    moved: dict[int, torch.Tensor] = {}
    params: set[int] = set()
    total = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.device.type != "cpu" or t.nbytes < HUGE_PAGE or not t.is_contiguous():
            return t
        if t.data_ptr() not in moved:
            moved[t.data_ptr()] = copy(t)
            total += t.nbytes
        return moved[t.data_ptr()]

    with torch.no_grad():
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = place(b)
            for p in module._parameters.values():
                if p is not None and id(p) not in params:  # a tied parameter: once
                    params.add(id(p))
                    p.data = place(p.data)
    return total
