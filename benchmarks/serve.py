"""Serving benchmark: TTFT, TPOT, inter-token latency and throughput of `ember serve` at several concurrency
levels, on a ShareGPT-like mix of prompt and answer lengths generated locally (no dataset download).

    python benchmarks/serve.py --model smollm2-135m-instruct --concurrency 1 4 16
    python benchmarks/serve.py --random llama-3-8b --device cuda --hf-baseline   # on a GPU

The server runs as a subprocess (`python -m ember.cli.main serve`), so the client's timing loop does not share
a GIL with it; the client streams /v1/completions with token-id prompts, `ignore_eos` and greedy decoding, so
every request does exactly the work the mix asks for. Lengths are drawn from log-normal distributions shaped
like ShareGPT's (long-tailed, prompts longer than answers), scaled by --input-mean / --output-mean.

With --hf-baseline the same requests also run through `transformers`' own batched `generate` (static batches of
`concurrency` left-padded prompts, each batch running until its longest answer is done); only the tokens each
request asked for count towards its throughput. --random llama-3-8b builds a random model of Llama-3-8B's
shapes (bf16 on the GPU, a synthetic word-level tokenizer of its vocabulary size) in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx2 as httpx  # the client of this repository's environment
except ImportError:
    import httpx

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))  # run from a checkout without installing
from ember.bench import RANDOM_SHAPES as SHAPES  # noqa: E402  (one table of real shapes, shared with `ember bench`)

# ---------------------------------------------------------------------------------------------- workload


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def sharegpt_like(
    n: int, *, input_mean: int, output_mean: int, max_len: int, vocab: int, seed: int
) -> list[Req]:
    """Log-normal lengths (sigma 1.0 for prompts, 0.8 for answers: ShareGPT's long tails), random token ids."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        # mean of a log-normal is exp(mu + sigma^2 / 2): pick mu so the mean is the one asked for.
        p = int(rng.lognormvariate(math.log(input_mean) - 0.5, 1.0))
        o = int(rng.lognormvariate(math.log(output_mean) - 0.32, 0.8))
        p = max(4, min(p, max_len // 2))
        o = max(2, min(o, max_len - p - 1, 4 * output_mean))
        reqs.append(Req([rng.randrange(100, vocab) for _ in range(p)], o))
    return reqs


# ------------------------------------------------------------------------------------------------ client


@dataclass
class Trace:
    start: float
    first: float | None = None
    times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    tokens: int = 0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, model: str, req: Req) -> Trace:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = Trace(time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            t.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
            return t
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                t.error = chunk["error"]["message"]
            elif chunk.get("usage"):
                t.tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                t.first = t.first or now
                t.times.append(now)
    return t


async def run_level(url: str, model: str, reqs: list[Req], concurrency: int) -> tuple[list[Trace], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def bounded(r: Req) -> Trace:
            async with sem:
                return await one_request(client, model, r)

        start = time.perf_counter()
        traces = await asyncio.gather(*(bounded(r) for r in reqs))
        return traces, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(traces: list[Trace], wall: float) -> dict:
    ok = [t for t in traces if t.error is None and t.first is not None]
    ttft = [t.first - t.start for t in ok]
    tpot = [(t.times[-1] - t.first) / (t.tokens - 1) for t in ok if t.tokens > 1]
    itl = [b - a for t in ok for a, b in zip(t.times, t.times[1:], strict=False)]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(traces),
        "errors": len(traces) - len(ok),
        "ttft_median_ms": 1e3 * statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
        "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
        "itl_median_ms": 1e3 * statistics.median(itl) if itl else float("nan"),
        "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "output_tok_s": tokens / wall,
        "req_s": len(ok) / wall,
        "wall_s": wall,
    }


# ------------------------------------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ember.cli.main", "serve", model, "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--max-num-seqs", str(max(args.concurrency))]
    cmd += ["--max-batched-tokens", str(args.max_batched_tokens), "--max-waiting", "100000"]
    if args.device:
        cmd += ["--device", args.device]
    if args.kv_cache_gib:
        cmd += ["--kv-cache-gib", str(args.kv_cache_gib)]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    with httpx.Client(base_url=url) as c:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"ember serve exited with {proc.returncode}")
            try:
                if c.get("/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("ember serve did not start")
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------- random models


def make_random_model(shape: str, out: Path, device: str) -> Path:
    """A random Llama of `shape` saved as an HF directory, with a word-level tokenizer of its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def hf_baseline(model_dir: Path, reqs: list[Req], concurrency: int, device: str) -> dict:
    """transformers' batched generate: static batches of `concurrency` left-padded prompts, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as the server run does
    useful, wall = 0, 0.0
    warm = torch.tensor([reqs[0].prompt[:8]], device=device)
    model.generate(
        warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    for i in range(0, len(reqs), concurrency):
        batch = reqs[i : i + concurrency]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device
        )
        new = max(r.max_tokens for r in batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall += time.perf_counter() - start
        useful += sum(r.max_tokens for r in batch)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"output_tok_s": useful / wall, "req_s": len(reqs) / wall, "wall_s": wall}


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m-instruct", help="model to serve (alias, dir or .gguf)")
    src.add_argument("--random", choices=sorted(SHAPES), help="serve a random model of these shapes")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-level", type=int, default=None, help="default: max(8, 4 x concurrency)")
    p.add_argument("--input-mean", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-mean", type=int, default=64, help="mean answer length in tokens")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + answer never exceed this")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--quantize", default=None, help="the server's --quantize (int8, int4, ...)")
    p.add_argument("--hf-baseline", action="store_true", help="also time transformers' batched generate")
    p.add_argument("--json", type=Path, default=None, help="write all numbers here (after each step)")
    p.add_argument("--time-budget", type=float, default=math.inf, help="skip baseline runs after this many s")
    args = p.parse_args()
    started = time.perf_counter()

    device = args.device or ("cuda" if _cuda() else "cpu")
    tmp = tempfile.TemporaryDirectory(prefix="ember-bench-")
    if args.random:
        t0 = time.perf_counter()
        model = str(make_random_model(args.random, Path(tmp.name), device))
        print(f"random {args.random} model written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        vocab = SHAPES[args.random]["vocab_size"]
    else:
        model, vocab = args.model, 49152
    workloads = {
        c: sharegpt_like(
            args.requests_per_level or max(8, 4 * c),
            input_mean=args.input_mean,
            output_mean=args.output_mean,
            max_len=args.max_len,
            vocab=min(vocab, 32000),
            seed=c,
        )
        for c in args.concurrency
    }
    results: dict = {
        "model": args.random or args.model,
        "quantize": args.quantize,
        "device": device,
        "levels": {},
    }
    proc, url = start_server(model, args)
    try:
        for c, reqs in workloads.items():
            warm = [Req(r.prompt, min(r.max_tokens, 8)) for r in reqs[: min(c, 4)]]
            asyncio.run(run_level(url, "bench", warm, c))
            traces, wall = asyncio.run(run_level(url, "bench", reqs, c))
            results["levels"][c] = {"ember": summarize(traces, wall)}
            print(f"concurrency {c}: {results['levels'][c]['ember']}", file=sys.stderr, flush=True)
            save(results, args.json)
    finally:
        proc.terminate()
        proc.wait(60)
    if args.hf_baseline:
        model_dir = Path(model)
        # Highest concurrency first: the throughput comparison that matters most survives a short budget.
        for c, reqs in sorted(workloads.items(), reverse=True):
            if time.perf_counter() - started > args.time_budget:
                print(f"time budget spent: no transformers run at concurrency {c}", file=sys.stderr)
                continue
            results["levels"][c]["transformers"] = hf_baseline(model_dir, reqs, c, device)
            print(
                f"concurrency {c} transformers: {results['levels'][c]['transformers']}",
                file=sys.stderr,
                flush=True,
            )
            save(results, args.json)
    print_table(results)


def save(results: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=2))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def print_table(results: dict) -> None:
    scheme = f", --quantize {results['quantize']}" if results.get("quantize") else ""
    print(f"\nmodel {results['model']}{scheme} on {results['device']}")
    head = "| concurrency | requests | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | output tok/s | req/s |"
    if any("transformers" in v for v in results["levels"].values()):
        head += " HF generate tok/s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for c, v in results["levels"].items():
        e = v["ember"]
        row = (
            f"| {c} | {e['requests']} | {e['ttft_median_ms']:.1f} | {e['ttft_p99_ms']:.1f} | {e['tpot_median_ms']:.1f} "
            f"| {e['itl_median_ms']:.1f} | {e['itl_p99_ms']:.1f} | {e['output_tok_s']:.1f} | {e['req_s']:.2f} |"
        )
        if "transformers" in v:
            row += f" {v['transformers']['output_tok_s']:.1f} |"
        if e["errors"]:
            row += f" ({e['errors']} errors)"
        print(row)


if __name__ == "__main__":
    main()
