"""`ember bench [MODEL]`: prefill and decode speed of one stream, and how close decode gets to memory bandwidth.

Prints, for prefill and decode: tokens/s, time to first token, achieved weight bandwidth (weight bytes read
per step x steps / time) and its share of the device's measured copy bandwidth, and peak memory. `--json`
prints one object for scripts. `--random-weights llama-3-8b` benchmarks a real shape with random weights.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

from ember.cli.common import add_model_options, integer, load_model
from ember.errors import ContextLengthError, EmberError

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ember.bench import RANDOM_SHAPES

    p = sub.add_parser("bench", help="measure prefill and decode speed of one stream", description=__doc__)
    add_model_options(p, positional=True)
    p.add_argument(
        "--random-weights",
        default=None,
        metavar="SHAPE",
        choices=sorted(RANDOM_SHAPES),
        help=f"random weights of a real model's shape instead of a checkpoint (no MODEL): "
        f"{', '.join(RANDOM_SHAPES)}",
    )
    p.add_argument("--prompt-tokens", type=integer(1), default=128, help="prompt length (default: 128)")
    p.add_argument(
        "--new-tokens", type=integer(1), default=256, help="tokens to generate per run (default: 256)"
    )
    p.add_argument(
        "--repeats",
        type=integer(1),
        default=3,
        help="timed runs; of each phase, the median run is reported (default: 3)",
    )
    p.add_argument(
        "--warmup", type=integer(0), default=1, help="untimed runs first (compilation happens here)"
    )
    p.add_argument("--threads", type=integer(1), default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def check_context(args: argparse.Namespace, limit: int) -> None:
    """A ContextLengthError naming the counts when the prompt and the new tokens do not fit in `limit`."""
    if args.prompt_tokens + args.new_tokens > limit:
        source = "set by --max-seq-len" if limit == args.max_seq_len else "the model's maximum"
        raise ContextLengthError(
            f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} = "
            f"{args.prompt_tokens + args.new_tokens} tokens do not fit the context of {limit} ({source})"
        )


def run(args: argparse.Namespace) -> int:
    from ember.bench import bench_context, random_config, random_model, run_bench
    from ember.loading.checkpoint import pick_device, pick_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    scheme = None if args.quantize == "none" else args.quantize
    kept = 0
    # Refused before a model is built (one of real size can take minutes); argparse checked the scheme.
    if args.random_weights:
        given = args.model_option if args.model_option is not None else args.model
        if given is not None:
            raise EmberError(
                f"--random-weights {args.random_weights} benchmarks random weights, not a checkpoint; "
                f"drop the model {given!r} or --random-weights"
            )
        if args.quantize == "gguf":
            from ember.quant import not_gguf

            raise not_gguf("random weights have none")
        check_context(args, bench_context(random_config(args.random_weights), args.max_seq_len))
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
        model = random_model(args.random_weights, device=device, dtype=dtype, quantize=scheme)
        name = f"random:{args.random_weights}"
    else:
        loaded = load_model(args)
        model, device, name, kept = loaded.model, loaded.device, loaded.name, loaded.kept_codes
        check_context(args, bench_context(model.config, args.max_seq_len))
    result = run_bench(
        model,
        name=name,
        device=device,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        compile=args.compile,
        compile_prefill=args.compile_prefill,
        quantize=scheme,
        max_seq_len=args.max_seq_len,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    r = result

    def share(pct: float | None) -> str:
        return f" ({pct:.0f}% of {r.device_bandwidth_gb_s:.0f} GB/s copy)" if pct is not None else ""

    if r.decode_tokens_per_s is None:  # --new-tokens 1: the one token comes from the prefill
        decode = f"{'n/a':>9}          (no decode step: --new-tokens 1)"
    else:
        decode = f"{r.decode_tokens_per_s:9.1f} tok/s   {r.decode_bandwidth_gb_s:.1f} GB/s{share(r.decode_bandwidth_pct)}"
    lines = [
        f"model     {r.model} ({r.dtype}, quantize={r.quantize or 'none'}, decode step {r.decode_step}, "
        f"compile_prefill={r.compile_prefill}) on {r.device}, {r.threads} threads",
        f"weights   {r.weight_bytes_per_step / 1e6:.1f} MB read per decode step"
        + (f" ({kept} projections as the GGUF file's own codes)" if kept else ""),
        f"prefill   {r.prefill_tokens_per_s:9.1f} tok/s   {r.prefill_bandwidth_gb_s:.1f} GB/s"
        f"{share(r.prefill_bandwidth_pct)}, time to first token {r.time_to_first_token_s * 1e3:.1f} ms "
        f"({r.prompt_tokens} prompt tokens)",
        f"decode    {decode}",
        f"overall   {r.total_tokens_per_s:9.1f} tok/s   ({r.new_tokens} new tokens, prefill included)",
        f"memory    {r.peak_memory_mb:9.1f} MB peak",
    ]
    if r.decode_step == "eager" and r.device == "cpu" and args.compile is None:
        lines.append(
            "hint      --compile builds a compiled decode step once (minutes); later runs use it unasked"
        )
    print("\n".join(lines))
    return 0
