"""Where a compiled decode step's time goes, kernel by kernel, on one GPU (a diagnostic, not a race).

Builds a random-weight model of a real shape, decodes with Ember's compiled step (CUDA graph) as `ember bench`
does, then decodes once more under the CUDA profiler and charges every microsecond of the decode steps to one
kernel: its *marginal* time, how far its end lies past the end of every kernel before it. Kernel durations
alone mislead here: with programmatic dependent launch a kernel starts while the one before it still runs and
waits inside (`ember.ops.launch`), so durations overlap and add up to more than the step. Marginal times add
up to the step exactly; an idle gap is charged to the kernel after it.

    python benchmarks/gpu_step_profile.py --configs int4 int8 bf16
    python benchmarks/gpu_step_profile.py --configs int4 --sequence 24   # also one stretch of a step in order
    python benchmarks/gpu_step_profile.py --configs int4 --set ember.quant.cuda_int4.FOLD_NORMS=True

The table gives, per kernel (template arguments kept, call arguments dropped): launches a step, marginal us a
step, its share of the step, and its mean span (start to end, waiting included). Above it: the step time
without the profiler, the profiled one (tracing costs a few percent), and the floor of reading the step's
weights once at the copy bandwidth measured in the same process; and the host's time a step (one more decode,
untraced): enqueuing the step, and waiting for its token. A host that seldom waits bounds the step itself.
"""

from __future__ import annotations

import argparse
import ast
import collections
import gc
import importlib
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def short_name(name: str) -> str:
    """A kernel's name without `void ` and its call arguments (templates kept)."""
    name = re.sub(r"^void ", "", name)
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i].rstrip()
    return name


def decode_window(events: list) -> tuple[list, int]:
    """The kernels (and copies) of the decode steps, in start order, and how many steps they hold.

    The token of each step is copied to pinned host memory once (`ember.engine.generate._TokenReader`), so the
    GPU runs prefill, copy of token 0, step 1, copy of token 1, ..., copy of token N - 1: between the first and
    the last such copy lie exactly N - 1 whole steps (the one other read, of the prefill's finite check, goes
    to pageable memory).
    """
    copies = [i for i, e in enumerate(events) if "Memcpy DtoH" in e.name and "Pinned" in e.name]
    if len(copies) < 2:
        raise SystemExit("the profile holds fewer than two token copies: no whole decode step to report")
    return events[copies[0] : copies[-1] + 1], len(copies) - 1


def marginal_times(events: list) -> list[float]:
    """Each event's end past the latest end before it (0 if it ends inside an earlier one); the first is 0."""
    out, far = [0.0], events[0].time_range.end
    for e in events[1:]:
        out.append(max(0.0, e.time_range.end - far))
        far = max(far, e.time_range.end)
    return out


def profile_config(config: str, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ember.bench import copy_bandwidth, random_model, weight_bytes_per_step
    from ember.engine.generate import Generator, _TokenReader
    from ember.engine.sampler import SamplingParams

    device = torch.device("cuda")
    quantize = None if config == "bf16" else config
    model = random_model(args.shape, device=device, dtype=torch.bfloat16, quantize=quantize)
    gen = Generator(model, device=device, context=args.prompt + args.new, compile=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)

    def decode() -> float:
        for _ in gen.generate(prompt, params, (), None):
            pass
        torch.cuda.synchronize()
        return 1e6 / gen.timings.decode_tokens_per_s

    def host_times() -> tuple[list[float], list[float]]:
        """One decode's host time a step in `Generator._step` (the decode graph's replay) and in
        waiting for each token: a host that rarely waits is what bounds the step."""
        enqueue, wait = [], []
        step, read = gen._step, _TokenReader.read

        def timed_step(*a, **k):
            t = time.perf_counter()
            out = step(*a, **k)
            enqueue.append(1e6 * (time.perf_counter() - t))
            return out

        def timed_read(reader):
            t = time.perf_counter()
            out = read(reader)
            wait.append(1e6 * (time.perf_counter() - t))
            return out

        gen._step, _TokenReader.read = timed_step, timed_read
        try:
            decode()
        finally:
            del gen._step
            _TokenReader.read = read
        return enqueue, wait

    start = time.perf_counter()
    plain = min(decode() for _ in range(args.warmup + 1))
    enqueue, wait = host_times()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    window, steps = decode_window(events)
    marg = marginal_times(window)
    total = sum(marg)
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e, m in zip(window[1:], marg[1:], strict=True):  # the first copy ends the prefill's work
        r = rows[short_name(e.name)]
        r[0] += 1
        r[1] += m
        r[2] += e.time_range.elapsed_us()
    wbytes = weight_bytes_per_step(model)
    copy = copy_bandwidth(device) / 1e9
    floor = wbytes / copy / 1e3  # us
    print(
        f"\n## {args.shape}, {config}, {torch.cuda.get_device_name(device)} ({time.perf_counter() - start:.0f} s)"
    )
    print(
        f"step {plain:.1f} us unprofiled, {total / steps:.1f} us profiled ({steps} steps); weights "
        f"{wbytes / 1e9:.2f} GB a step, at the copy bandwidth ({copy:.0f} GB/s) {floor:.1f} us = "
        f"{100 * floor / plain:.1f}% of the step\n"
    )
    q = statistics.quantiles
    print(
        f"host a step: {statistics.median(enqueue):.0f} us enqueuing it (p90 {q(enqueue, n=10)[-1]:.0f}), "
        f"{statistics.median(wait):.0f} us waiting for a token (p10 {q(wait, n=10)[0]:.0f}); "
        f"{sum(w < 50 for w in wait[1:])} of {len(wait) - 1} waits under 50 us (a host that does not wait is the bound)\n"
    )
    print("| kernel | a step | marginal us a step | share | mean span us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    for name, (n, m, span) in ranked[: args.top]:
        print(
            f"| `{name[:90]}` | {n / steps:.2f} | {m / steps:.1f} | {100 * m / total:.1f}% | {span / n:.2f} |"
        )
    rest = ranked[args.top :]
    if rest:
        m = sum(r[1] for _, r in rest)
        print(f"| {len(rest)} others | | {m / steps:.1f} | {100 * m / total:.1f}% | |")
    if args.sequence:
        mid = len(window) // 2
        print(f"\nkernels {mid}-{mid + args.sequence} of the decode window, in order (marginal / span us):")
        for e, m in zip(window[mid : mid + args.sequence], marg[mid : mid + args.sequence], strict=True):
            print(f"  {m:7.2f} {e.time_range.elapsed_us():7.2f}  {short_name(e.name)[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", nargs="+", default=["int4"], help="bf16 or a --quantize scheme (int8, int4, ...)"
    )
    ap.add_argument("--shape", default="llama-3-8b", help="a --random-weights shape of `ember bench`")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="new tokens (decode steps + 1)")
    ap.add_argument("--warmup", type=int, default=2, help="decodes before the timed ones (compilation)")
    ap.add_argument("--top", type=int, default=20, help="kernels in the table")
    ap.add_argument("--sequence", type=int, default=0, help="also print this many kernels of a step in order")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="MODULE.NAME=VALUE: a module constant, set before the build",
    )
    args = ap.parse_args()
    if args.new < 3 or args.prompt < 1:
        raise SystemExit(
            f"--prompt {args.prompt} --new {args.new}: expected a prompt and at least 3 new tokens"
        )
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_profile.py needs a CUDA GPU")
    for pair in args.set:  # say, a switch that is off: ember.quant.cuda_int4.FOLD_NORMS=True
        name, eq, value = pair.partition("=")
        module, _, attr = name.rpartition(".")
        if not eq or not module:
            raise SystemExit(f"--set {pair!r}: expected MODULE.NAME=VALUE")
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    for config in args.configs:
        profile_config(config, args)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
