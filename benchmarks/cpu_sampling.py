"""What sampling costs a decode step, Ember against llama.cpp, in turn in one process (this CPU).

`ember generate` samples by default (temperature 0.7, top-p 0.9); on a vocabulary of 262k tokens (Gemma 3) a
sampler that sorts the whole vocabulary for top-p costs more than the step itself. Each engine generates the
same number of tokens from the same prompt (128 random tokens) greedily and with the sampling settings, EOS
ignored; rounds alternate the engines and the modes, and the table gives the median decode step (prefill
excluded) of each, and what sampling adds to it. Both engines filter with the same settings: temperature,
top-p, no top-k, no min-p (llama.cpp's own sampler chain, `llama_sampler`, through llama-cpp-python).

    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_sampling.py
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_sampling.py --gguf FILE --rounds 7

Needs llama-cpp-python (built as BENCHMARKS.md says).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.engine.generate import Generator
from ember.engine.sampler import SamplingParams, make_generator
from ember.loading.checkpoint import load
from ember.loading.hub import DEFAULT_MODEL, resolve


def ember_steps(generator: Generator, prompt: list[int], params: SamplingParams) -> list[float]:
    """Seconds of each decode step after the first token (the prefill's)."""
    times = []
    stream = generator.generate(prompt, params, (), make_generator(0, "cpu"))
    next(stream)
    t = time.perf_counter()
    for _ in stream:
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def llama_cpp_steps(llm, prompt: list[int], params: SamplingParams) -> list[float]:
    llm.reset()
    if params.temperature > 0:
        llm._sampler = llm._init_sampler(
            top_k=0, top_p=params.top_p, min_p=0.0, temp=params.temperature, repeat_penalty=1.0
        )
    llm.eval(prompt)
    times = []
    token = llm.sample(temp=0.0) if params.temperature == 0 else llm.sample()
    t = time.perf_counter()
    for _ in range(params.max_tokens - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0) if params.temperature == 0 else llm.sample()
        now = time.perf_counter()
        times.append(now - t)
        t = now
    llm._sampler = None
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gguf", default=None, help="a GGUF file for both engines (default: the default model's)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from llama_cpp import Llama

    path = args.gguf or str(resolve(DEFAULT_MODEL).path)
    loaded = load(path, device="cpu", progress=False)
    vocab = loaded.config.vocab_size
    prompt = torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    context = 512
    generator = Generator(loaded.model, device=torch.device("cpu"), context=context, compile=False)
    llm = Llama(
        model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=context, verbose=False
    )
    modes = {
        "greedy": SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
        "sampled": SamplingParams(
            max_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p, ignore_eos=True
        ),
    }
    runs = {
        "Ember (eager step)": lambda p: ember_steps(generator, prompt, p),
        "llama.cpp": lambda p: llama_cpp_steps(llm, prompt, p),
    }
    for run in runs.values():  # warm-up
        for params in modes.values():
            run(params)
    steps = {(e, m): [] for e in runs for m in modes}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for engine in order:
            for mode, params in modes.items():
                steps[engine, mode].extend(runs[engine](params))
    print(
        f"\n{path}: vocabulary {vocab}, {args.threads} threads, {args.rounds} rounds of {args.new_tokens} tokens"
    )
    print(f"sampled: temperature {args.temperature}, top-p {args.top_p}\n")
    print("| engine | greedy step (ms) | sampled step (ms) | sampling adds (ms) | sampled tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for engine in runs:
        g = statistics.median(steps[engine, "greedy"]) * 1e3
        s = statistics.median(steps[engine, "sampled"]) * 1e3
        print(f"| {engine} | {g:.2f} | {s:.2f} | {s - g:+.2f} | {1e3 / s:.1f} |")


if __name__ == "__main__":
    main()
