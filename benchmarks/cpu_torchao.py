"""Ember's quantized projections against torchao's, on SmolLM2-135M-Instruct on this CPU, one process.

torchao is the field's quantization library; this is the check that Ember's own CPU kernels earn their place.
Both quantize the same bf16 model's attention and MLP projections (the output projection stays bf16 in both,
so only the projections differ) and run in Ember's generation loop: eager, or with `--compile` Ember's
compiled CPU step (AOTInductor) over either model. Pairs, per scheme:

- int8: Ember's `Int8WeightOnlyLinear` / torchao `Int8WeightOnlyConfig()` (per-channel int8 weights);
- int4-g32: Ember's `Int4WeightOnlyLinear` / torchao `PrototypeInt4WeightOnlyConfig(group_size=32)` (its
  CPU int4 config; `Int4WeightOnlyConfig` has no CPU packing in torchao 0.18);
- int8-dyn: Ember's `Int8DynActLinear` / torchao `Int8DynamicActivationInt8WeightConfig()`.

Reports perplexity on the quality benchmark's fixed text (vs the bf16 model) and prefill / decode tokens/s
(64-token prompt, 32 new tokens, median of 3 after a warm-up), and Ember's decode rate over torchao's.
torchao is not an Ember dependency: `pip install --no-deps torchao==0.18.0` (it needs nothing else beside
torch 2.13).

    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_torchao.py --threads 2
    PYTHONPATH=src taskset -c 0,1 python benchmarks/cpu_torchao.py --threads 2 --compile
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from torch import nn

from ember.bench import run_bench
from ember.loading.checkpoint import load
from ember.quant import perplexity, quantize_model

MODEL = "smollm2-135m-instruct"


def torchao_config(scheme: str):
    import torchao.quantization as tq
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return {
        "int8": tq.Int8WeightOnlyConfig,
        "int4-g32": lambda: PrototypeInt4WeightOnlyConfig(group_size=32),
        "int8-dyn": tq.Int8DynamicActivationInt8WeightConfig,
    }[scheme]()


def quantized(lib: str, scheme: str) -> nn.Module:
    """The bf16 model with its projections quantized by `lib` ("ember" or "torchao"); the output projection
    left bf16."""
    model = load(MODEL, device="cpu", dtype="bfloat16", progress=False).model
    if lib == "ember":
        return quantize_model(model, scheme, output=False)
    if lib == "torchao":
        import torchao.quantization as tq

        projection = lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head"  # noqa: E731
        tq.quantize_(model, torchao_config(scheme), filter_fn=projection)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", nargs="*", default=["int8", "int4-g32", "int8-dyn"])
    ap.add_argument("--compile", action="store_true", help="Ember's compiled CPU step (AOTInductor) for all")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)

    from quality_smollm2 import TEXT

    tokenizer = load(MODEL, device="cpu", progress=False).tokenizer
    tokens = torch.tensor([tokenizer.encode(TEXT, add_special_tokens=False)])

    def measure(model: nn.Module) -> tuple[float, float, float]:
        ppl = perplexity(model, tokens)
        r = run_bench(
            model, name=MODEL, device=torch.device("cpu"), prompt_tokens=64, new_tokens=32, repeats=3,
            warmup=1, compile=args.compile, quantize=None,
        )  # fmt: skip
        return ppl, r.prefill_tokens_per_s, r.decode_tokens_per_s

    mode = "compiled step (AOTInductor)" if args.compile else "eager"
    print(f"{MODEL}, {args.threads} threads, {mode}; projections quantized, output projection bf16")
    print(
        f"{'scheme':<10}{'library':<9}{'perplexity':>11}{'vs bf16':>9}{'prefill':>9}{'decode':>8}{'Ember/torchao':>15}"
    )
    ref, prefill, decode = measure(quantized("none", "bf16"))
    print(f"{'bf16':<10}{'':<9}{ref:>11.4f}{'':>9}{prefill:>9.1f}{decode:>8.1f}")
    for scheme in args.schemes:
        rates = {}
        for lib in ("ember", "torchao"):
            ppl, prefill, rates[lib] = measure(quantized(lib, scheme))
            ratio = f"{rates['ember'] / rates['torchao']:.2f}x" if lib == "torchao" else ""
            print(
                f"{scheme:<10}{lib:<9}{ppl:>11.4f}{100 * (ppl - ref) / ref:>+8.2f}%{prefill:>9.1f}"
                f"{rates[lib]:>8.1f}{ratio:>15}",
                flush=True,
            )


if __name__ == "__main__":
    main()
