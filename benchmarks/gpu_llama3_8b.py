"""Llama-3-8B shape, random bf16 weights, batch 1 on one GPU: Ember vs gpt-fast vs transformers (static cache).

Each engine runs in its own process (gpt-fast sets global inductor options on import); every process prints
one JSON line per configuration, and `--all` runs them one after the other and prints a table. Measured the way
the peers report it: a 128-token prompt, 256 new tokens, tokens/s over the whole generate call, median of 3
timed calls after 2 warm-up calls (compilation happens in the warm-up). Ember also reports its decode-only rate.

    python benchmarks/gpu_llama3_8b.py --all --gpt-fast .peers/gpt-fast
    python benchmarks/gpu_llama3_8b.py --engine ember --configs bf16 int8 int4

gpt-fast is not part of this repository: fetch github:meta-pytorch/gpt-fast and pass its directory.

`--engine torchao` is Ember with its projections (output projection included) quantized by torchao instead:
the same model, attention and compiled step, each projection a plain nn.Linear over a torchao weight
(`Int8WeightOnlyConfig`; `Int4WeightOnlyConfig` with torch's tinygemm packing, group 128). It answers whether
Ember's own GEMV kernels earn their place on the GPU. torchao is not an Ember dependency: install it with
`pip install --no-deps torchao==0.18.0`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT, NEW, REPEATS, WARMUP = 128, 256, 3, 2


def median(xs):
    return sorted(xs)[len(xs) // 2]


def emit(**record):
    print("RESULT " + json.dumps(record), flush=True)


def copy_bandwidth() -> float:
    from ember.bench import copy_bandwidth as cb

    return cb(torch.device("cuda"), nbytes=2 << 30, repeats=20) / 1e9


def torchao_quantize(model: torch.nn.Module, config: str) -> None:
    """Every projection of `model` becomes a plain nn.Linear (F.linear, no Ember kernel) over a torchao weight."""
    import torchao.quantization as tq

    from ember.ops.linear import Linear

    for m in model.modules():
        if type(m) is Linear:
            m.__class__ = torch.nn.Linear
    if config == "bf16":
        return
    if config == "int8":
        cfg = tq.Int8WeightOnlyConfig()
    elif config.startswith("int4"):
        group = int(config.partition("-g")[2] or 128)
        cfg = tq.Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d")
    else:
        raise ValueError(f"torchao: no config for {config!r}")
    tq.quantize_(model, cfg, filter_fn=lambda m, fqn: type(m) is torch.nn.Linear)


def run_ember(configs: list[str], compile_prefill: bool = False, torchao: bool = False) -> None:
    from ember.bench import random_model, run_bench

    dev = torch.device("cuda")
    emit(engine="copy", config="d2d", bandwidth_gb_s=round(copy_bandwidth(), 1))
    for config in configs:
        ours = None if torchao or config == "bf16" else config  # Ember's projections quantized as drawn
        model = random_model("llama-3-8b", device=dev, dtype=torch.bfloat16, quantize=ours)
        if torchao:
            torchao_quantize(model, config)
        t0 = time.perf_counter()
        r = run_bench(
            model,
            name="llama-3-8b",
            device=dev,
            prompt_tokens=PROMPT,
            new_tokens=NEW,
            repeats=REPEATS,
            warmup=WARMUP,
            compile=True,
            compile_prefill=compile_prefill,
            quantize=None if config == "bf16" or torchao else config,
            measure_device=False,
        )
        emit(
            engine="ember + torchao" if torchao else "ember",
            config=config,
            compile_prefill=compile_prefill,
            total_tok_s=r.total_tokens_per_s,
            decode_tok_s=r.decode_tokens_per_s,
            prefill_tok_s=r.prefill_tokens_per_s,
            ttft_s=r.time_to_first_token_s,
            weight_gb=round(r.weight_bytes_per_step / 1e9, 3),
            decode_gb_s=r.decode_bandwidth_gb_s,
            peak_mb=r.peak_memory_mb,
            wall_s=round(time.perf_counter() - t0, 1),
        )
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def profile_ember(config: str, steps: int = 32) -> None:
    """Prints where a compiled decode step's GPU time goes: kernels by total time over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    from ember.bench import random_model
    from ember.engine.generate import Generator
    from ember.engine.sampler import SamplingParams

    dev = torch.device("cuda")
    quantize = None if config == "bf16" else config
    model = random_model("llama-3-8b", device=dev, dtype=torch.bfloat16, quantize=quantize)
    gen = Generator(model, device=dev, context=PROMPT + NEW, compile=True)
    prompt = list(range(1, PROMPT + 1))
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        for _ in gen.generate(prompt, params, (), None):
            pass
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in gen.generate(prompt, params, (), None):
            pass
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"{config}: GPU time per decode step ~{total / steps / 1e3:.3f} ms (prefill included once)")
    for e in rows[:30]:
        print(f"{e.device_time_total / steps:9.1f} us/step {e.count / steps:7.1f} calls/step  {e.key[:110]}")
    del gen, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def run_gpt_fast(configs: list[str], root: Path) -> None:
    sys.path.insert(0, str(root))
    import generate as gf  # noqa: E402  (sets gpt-fast's inductor options, as its own main does)
    import quantize as gq  # noqa: E402
    from model import Transformer  # noqa: E402

    gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    gf.prefill = torch.compile(gf.prefill, fullgraph=True, dynamic=True)
    for config in configs:
        with torch.device("cuda"):
            model = Transformer.from_name("llama-3-8b")
        model = model.to(torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
        if config == "int8":
            handler = gq.WeightOnlyInt8QuantHandler(model)
            sd = handler.create_quantized_state_dict()
            model = handler.convert_for_runtime()
            model.load_state_dict(sd, assign=True)
        elif config.startswith("int4"):
            group = int(config.partition("-g")[2] or 128)
            handler = gq.WeightOnlyInt4QuantHandler(model, group)
            sd = handler.create_quantized_state_dict()
            model = handler.convert_for_runtime()
            model.load_state_dict(sd, assign=True)
        model = model.cuda().eval()
        prompt = torch.randint(0, 128256, (PROMPT,), device="cuda", dtype=torch.int)
        times = []
        for i in range(WARMUP + REPEATS):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gf.generate(
                model,
                prompt,
                NEW,
                batch_size=1,
                interactive=False,
                draft_model=None,
                temperature=0.8,
                top_k=200,
            )
            torch.cuda.synchronize()
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
        emit(
            engine="gpt-fast",
            config=config,
            total_tok_s=round(NEW / median(times), 2),
            peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
        )
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def run_transformers() -> None:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.bench import RANDOM_SHAPES

    hf = {k: v for k, v in RANDOM_SHAPES["llama-3-8b"].items() if k != "architectures"}
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**hf, dtype="bfloat16")).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128256, (1, PROMPT), device="cuda")
    times = []
    for i in range(WARMUP + REPEATS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(
            ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache_implementation="static"
        )
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    emit(
        engine=f"transformers {transformers.__version__}",
        config="bf16 static cache",
        total_tok_s=round(NEW / median(times), 2),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ember", "torchao", "gpt-fast", "transformers"])
    ap.add_argument("--configs", nargs="*", default=["bf16", "int8", "int4"])
    ap.add_argument("--gpt-fast", type=Path, default=Path(".peers/gpt-fast"))
    ap.add_argument("--all", action="store_true", help="ember, gpt-fast and transformers, one process each")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per engine process")
    ap.add_argument("--profile", action="store_true", help="Ember: GPU time of a decode step by kernel")
    ap.add_argument(
        "--compile-prefill",
        action="store_true",
        help="Ember: also compile the prefill (dynamic shapes), as gpt-fast does",
    )
    args = ap.parse_args()
    if args.profile:
        for config in args.configs:
            profile_ember(config)
        return
    if args.engine in ("ember", "torchao"):
        return run_ember(args.configs, args.compile_prefill, torchao=args.engine == "torchao")
    if args.engine == "gpt-fast":
        return run_gpt_fast(args.configs, args.gpt_fast)
    if args.engine == "transformers":
        return run_transformers()
    rows = []
    engines = ["ember", "gpt-fast", "transformers"] if args.all else []
    for engine in engines:
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--gpt-fast",
            str(args.gpt_fast),
            "--configs",
            *args.configs,
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            text = out.stdout
            if out.returncode:
                print(f"{engine} failed ({out.returncode}):\n{out.stderr[-3000:]}", flush=True)
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            print(f"{engine} timed out after {args.timeout} s", flush=True)
        for line in text.splitlines():
            if line.startswith("RESULT "):
                print(line, flush=True)
                rows.append(json.loads(line[7:]))
    print(f"\n{'engine':<24}{'config':<20}{'tok/s (call)':>14}{'decode tok/s':>14}{'GB/s':>8}")
    for r in rows:
        print(
            f"{r['engine']:<24}{r['config']:<20}{r.get('total_tok_s', ''):>14}{r.get('decode_tok_s', ''):>14}"
            f"{r.get('decode_gb_s', r.get('bandwidth_gb_s', '')):>8}"
        )


if __name__ == "__main__":
    main()
