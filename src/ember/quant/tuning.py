"""Tile choice for the decode GEMVs, timed the way a decode step runs them.

A decode GEMV reads weights that were last touched a whole step earlier, so they come from memory, not from
L2, and the compiled step launches its kernels back to back in a CUDA graph. Triton's autotuner times one
launch at a time with the same weights every time (clearing L2 with a memset in between): at the few
microseconds an attention projection takes, its timings are noisy and its pick moved between processes
(H200, Llama-3-8B int8, the same code: 348 and 380 tok/s, BENCHMARKS.md). `pick` times each candidate inside
a CUDA graph of back-to-back launches over enough copies of the weights to spill L2, median of a few
replays, once per key and process, and remembers the winner. With `PRECEDED_NS`, each timed launch follows
a kernel that holds the GPU that long without memory traffic (`ember/ops/csrc/hold.cu`), as attention and the
norms precede the step's GEMVs: there a block shape that loads more weights before its wait (programmatic
dependent launch) hides them under the kernel before, which back-to-back launches of one GEMV never show.
Timing the candidates in turn, round after round, or queued behind a GPU sleep so that no replay counts the
host's time to queue it, picked the same block shapes and made the same step in fresh processes (H100,
BENCHMARKS.md, thirty-fifth session): the tuner times each candidate's replays together, each waited for.

    config = pick(key, candidates, run, weights)   # run(config, weights) launches one call
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

L2_SPILL = 4  # copies of the weights add up to this many times the L2 (or the weights alone already do)
MIN_LAUNCHES = 16  # per graph: amortizes the graph launch and the first kernel's ramp
REPLAYS = 5
# Nanoseconds of the kernel before each timed launch (0: none, the GEMV's launches back to back). Its GPU test
# passed on an H100; at 3000 the int4-g128 step moved +0.05% (FOLD_NORMS off), and 0.3-0.5% against an arm
# tuned again without it (BENCHMARKS.md, thirty-fourth session): within the tuner's own spread, so 0.
PRECEDED_NS = 0
HOLD_SOURCE = Path(__file__).resolve().parents[1] / "ops" / "csrc" / "hold.cu"
# Picks fixed by hand, key (as `pick` is given it) -> candidate, for timing block shapes in whole steps
# (`benchmarks/gpu_step_ab.py --set "ember.quant.tuning.PINNED={...}"`; the keys are in the debug log). A pin
# that is not among the candidates is ignored.
PINNED: dict[tuple, object] = {}

_picked: dict[tuple, object] = {}


def pick(key: tuple, candidates: Sequence, run: Callable, weights: tuple[torch.Tensor, ...]):
    """The fastest of `candidates` for `key` (the first call times them; later calls return the winner).

    run(candidate, weights) launches one call with a tuple like `weights` (the caller owns the output
    buffers). Outside CUDA, with one candidate, or while a CUDA graph is being captured (no timing possible;
    nothing is remembered) it returns the first candidate. A candidate that fails to compile or launch is
    skipped (and logged); if all fail, the last error is raised. A candidate pinned for the key (`PINNED`)
    is returned untimed, anywhere.
    """
    pinned = PINNED.get(key)
    if pinned is not None and pinned in candidates:
        return pinned
    device = weights[0].device
    key = (*key, device)
    if key in _picked:
        return _picked[key]
    if len(candidates) == 1 or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    copies = _weight_copies(weights)
    calls = [lambda i, c=candidate: run(c, copies[i % len(copies)]) for candidate in candidates]
    timed = _one_by_one(calls, max(len(copies), MIN_LAUNCHES), before=_hold(device, PRECEDED_NS))
    best, best_s, error = None, math.inf, None
    for candidate, s in zip(candidates, timed, strict=True):
        if isinstance(s, Exception):  # e.g. a tile that needs more shared memory than this GPU has
            log.debug("GEMV candidate %s for %s failed: %s", candidate, key, s)
            error = s
        elif s < best_s:
            best, best_s = candidate, s
    if best is None:
        raise error
    log.debug("GEMV %s: %s (%.1f us; all: %s)", key, best, best_s * 1e6, _us(timed))
    _picked[key] = best
    return best


def _us(timed: list) -> str:
    return ", ".join("failed" if isinstance(s, Exception) else f"{s * 1e6:.2f}" for s in timed)


def _one_by_one(
    calls: list[Callable[[int], None]], launches: int, before: Callable[[], None] | None = None
) -> list[float | Exception]:
    """`graph_seconds` of each call in turn (an exception in its place where one fails)."""
    out: list[float | Exception] = []
    for call in calls:
        try:
            out.append(graph_seconds(call, launches, before=before))
        except Exception as e:
            out.append(e)
    return out


def _weight_copies(weights: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """The weights, and as many clones as make L2_SPILL times the L2 (as many as free memory allows)."""
    device = weights[0].device
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    want = math.ceil(L2_SPILL * l2 / max(nbytes, 1)) - 1
    free, _ = torch.cuda.mem_get_info(device)
    extra = max(0, min(want, (free // 2) // max(nbytes, 1), 64))
    return [weights] + [tuple(t.clone() for t in weights) for _ in range(extra)]


def _hold(device: torch.device, ns: int) -> Callable[[], None] | None:
    """A launch of the `hold` kernel for ns nanoseconds on `device` (None for 0, or where it cannot be built)."""
    if ns <= 0:
        return None
    from ember.ops import cuda_rtc, launch

    fns = cuda_rtc.load_or_none(HOLD_SOURCE, ["hold"], device, "the tuner's hold kernel")
    if fns is None:
        return None
    return lambda: cuda_rtc.launch(fns["hold"], 1, 32, (int(ns),), device, pdl=launch.pdl(device))


def graph_seconds(
    call: Callable[[int], None],
    launches: int,
    replays: int = REPLAYS,
    before: Callable[[], None] | None = None,
) -> float:
    """Seconds per call of call(i), i < launches, captured in one CUDA graph; median of `replays` replays.
    before: launched ahead of each call (its time is counted: the same for every candidate).
    (`benchmarks/gpu_gemv.py` times its sweeps with it too.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if before is not None:
            before()  # builds
        call(0)  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            if before is not None:
                before()
            call(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    return sorted(times)[len(times) // 2]
