"""Programmatic dependent launch (PDL) for the Triton kernels of a CUDA decode step.

A decode step is some 250 kernels of 2 to 60 microseconds. Launched plainly, each starts only once the one
before it has finished and flushed its writes, and then spends its first microsecond ramping up its loads: a
gap of ~1-2 us per kernel boundary, several percent of a step. On Hopper and later, a kernel launched with
PDL may start as soon as every program of the kernel before it has started and said so
(`griddepcontrol.launch_dependents`). Its programs then do what needs nothing from that kernel (a GEMV
loads its first weight tile: weights never change during decoding) and wait (`griddepcontrol.wait`) until
that kernel has completed and its writes are visible, before reading anything it wrote.

Rules every kernel here follows when its `PDL` flag is set:
- it calls `gdc_wait()` before its first read of an activation, a cache or a position, and before its first
  store (the memory it writes may have been read by the kernel before it, until that one completes). The
  one exception is reasoned out where it is made (`ember.ops.triton_attention`): memory that only kernels
  before the step's last non-PDL kernel can have written is complete by then, since a PDL launch after a
  kernel that does not signal waits for it to exit;
- it calls `gdc_wait()` on every path, so that a kernel waiting on it waits, through it, on everything
  before it;
- it calls `gdc_launch_dependents()` first thing: the next kernel's programs fill multiprocessors as this
  kernel's last programs drain.

A kernel that is not launched with PDL treats both instructions as no-ops, and a PDL launch after a kernel
that does not signal (inductor's, cuBLAS's) waits for that kernel's last program to exit, as a plain launch
would. `EMBER_PDL=0` turns it off (to measure what it is worth: `benchmarks/gpu_decode_step.py`).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _hopper(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":  # the interpreter runs no PTX
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _supported(index: int) -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:  # a Triton without grid dependency control
        return False
    return _hopper(index)


def hopper(device: torch.device) -> bool:
    """Whether Triton kernels on `device` run compiled on compute capability 9.0 or later (sm_90 PTX)."""
    if device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if device.type != "cuda" or os.environ.get("EMBER_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch whose kernel takes a `PDL` flag and follows the rules above."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
