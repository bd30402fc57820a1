"""Ember's compiled decode step vs llama.cpp's, one step each in turn, in one process (SmolLM2, this CPU); and
their prefills, with transformers', in turn as well.

On a shared VM the speed of a process drifts by 10-20% from minute to minute (and for minutes at a time by
1.5x), so two engines measured one after the other can swap places. Here both generate from the same prompt
(128 random tokens; `--prompt-tokens`) and take their decode steps alternately (Ember's step, llama.cpp's step,
...), so any drift hits both alike; the table gives the median step of each over all rounds, and the median of
the per-round medians. Each round starts with the engines' prefills of the prompt, one after the other (Ember's
compiled prefill, to the first token; llama.cpp's; with `--transformers`, transformers' float32 forward as its
`generate` runs it, logits of the last position only).

    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_interleaved.py --scheme int4-g32 --rounds 5
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_interleaved.py --turns round --rounds 9
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_interleaved.py --gguf FILE --scheme default --eager
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_interleaved.py --scheme default --eager --prompt-tokens 1800

`--eager` adds Ember's eager step (`ember.engine.cpu_step`: what `generate` and `chat` run without a compiled
package) as a third engine in the same turns. `--gguf FILE` runs another GGUF file (both engines; say `gguf_requantize.py --shape llama-3.2-1b`'s) in place of
the default model's.

Step by step, each engine's step starts with the other's weights in the caches; `--turns round` runs one
engine's steps of a round together, then the other's (drift then cancels only over rounds, so take more).

Needs llama-cpp-python (built as BENCHMARKS.md says), and transformers for `--transformers`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ember.engine.generate import Generator
from ember.engine.sampler import SamplingParams
from ember.loading.checkpoint import load
from ember.loading.hub import DEFAULT_MODEL, resolve


class LlamaCppSteps:
    """llama.cpp behind Generator.generate's shape: the first item is the prefill, each later one a step."""

    def __init__(self, path: str, threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False
        )

    def generate(self, prompt: list[int], params: SamplingParams, *_):
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        for _ in range(params.max_tokens):
            # The last token's logits, as llama.cpp keeps them (Llama.scores holds them only with logits_all).
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
            yield token
            llm.eval([token])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scheme",
        default="int4-g32",
        help="Ember's --quantize scheme ('none': float32; 'default': no scheme, the file's 4-bit projections kept)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=128,
        help="the prompt's length: decode steps then attend to this many slots and more",
    )
    ap.add_argument("--transformers", action="store_true", help="also time transformers' prefill in turn")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="also Ember's eager step (no compiled step: `generate`'s and `chat`'s default without a package)",
    )
    ap.add_argument(
        "--gguf", default=None, help="a GGUF file for both engines (default: the default model's)"
    )
    ap.add_argument(
        "--turns",
        choices=["step", "round"],
        default="step",
        help="decode steps alternate each step (drift cancels finely, but each engine's step follows the other's "
        "and finds its own weights evicted from the caches) or each round (all of one engine's steps, then the "
        "other's)",
    )
    args = ap.parse_args()
    if args.gguf and args.transformers:
        ap.error("--transformers times the default model's prefill: not with --gguf")
    torch.set_num_threads(args.threads)
    scheme = None if args.scheme == "default" else args.scheme
    path = args.gguf or str(resolve(DEFAULT_MODEL).path)
    loaded = load(path, device="cpu", progress=False, quantize=scheme)
    prompt = torch.randint(
        3, loaded.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    context = max(512, -(-(args.prompt_tokens + args.new_tokens + 2) // 256) * 256)
    params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
    engines = {
        f"Ember {args.scheme} (compiled)": Generator(
            loaded.model, device=torch.device("cpu"), context=context, compile=True, compile_prefill=True
        ),
        "llama.cpp (GGUF weights)": LlamaCppSteps(path, args.threads, context),
    }
    if args.eager:
        engines[f"Ember {args.scheme} (eager)"] = Generator(
            loaded.model, device=torch.device("cpu"), context=context, compile=False
        )
    for name, engine in engines.items():  # warm-up: compiles (or loads the compiled step)
        t = time.perf_counter()
        for _ in engine.generate(prompt, params, (), None):
            pass
        print(f"{name}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
    prefill_fns = {}
    if args.transformers:
        prefill_fns["transformers fp32 (eager)"] = transformers_prefill(prompt)
        prefill_fns["transformers fp32 (eager)"]()  # warm-up
    steps: dict[str, list[float]] = {n: [] for n in engines}
    round_medians: dict[str, list[float]] = {n: [] for n in engines}
    prefills: dict[str, list[float]] = {n: [] for n in [*engines, *prefill_fns]}
    for r in range(args.rounds):
        streams = {n: e.generate(prompt, params, (), None) for n, e in engines.items()}
        for name, stream in streams.items():
            t = time.perf_counter()
            next(stream)  # the prefill and the first token
            prefills[name].append(time.perf_counter() - t)
        for name, fn in prefill_fns.items():
            t = time.perf_counter()
            fn()
            prefills[name].append(time.perf_counter() - t)
        this_round: dict[str, list[float]] = {n: [] for n in engines}
        n = args.new_tokens
        if args.turns == "step":
            order = [name for _ in range(n) for name in streams]
        else:  # each engine's steps of the round together: no other engine's weights between two of its steps
            order = [name for name in streams for _ in range(n)]
        for name in order:
            t = time.perf_counter()
            next(streams[name])
            this_round[name].append(time.perf_counter() - t)
        for name, times in this_round.items():
            steps[name] += times
            round_medians[name].append(statistics.median(times) * 1e3)
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in round_medians.items()), flush=True)
    print(
        f"\n{'engine':<34}{'median step (ms)':>18}{'tok/s':>8}{'median of rounds (ms)':>23}{'vs llama.cpp':>14}"
    )
    ref = statistics.median(steps["llama.cpp (GGUF weights)"])
    for name, times in steps.items():
        m = statistics.median(times)
        print(
            f"{name:<34}{m * 1e3:>18.2f}{1 / m:>8.1f}{statistics.median(round_medians[name]):>23.2f}"
            f"{ref / m:>13.2f}x"
        )
    print(
        f"\n{f'prefill ({len(prompt)} tokens)':<34}{'median (ms)':>18}{'tok/s':>8}{'vs llama.cpp':>14}{'vs transformers':>17}"
    )
    ref = statistics.median(prefills["llama.cpp (GGUF weights)"])
    tf = statistics.median(prefills[next(iter(prefill_fns))]) if prefill_fns else None
    for name, times in prefills.items():
        m = statistics.median(times)
        vs_tf = f"{tf / m:>16.2f}x" if tf else ""
        print(f"{name:<34}{m * 1e3:>18.2f}{len(prompt) / m:>8.1f}{ref / m:>13.2f}x{vs_tf}")


def transformers_prefill(prompt: list[int]):
    """transformers' float32 model of the same GGUF; a call runs the prompt as its `generate` prefills it."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(resolve(DEFAULT_MODEL).path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def run():
        return model(ids, logits_to_keep=1).logits

    return run


if __name__ == "__main__":
    main()
