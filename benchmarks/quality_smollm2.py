"""Perplexity on a fixed text, float32 vs each quantization scheme (same tokens); SmolLM2-135M-Instruct by
default, any model with `--model`.

python benchmarks/quality_smollm2.py
python benchmarks/quality_smollm2.py --model gemma3-270m --schemes int8 int4-g32

The last column runs the prompt through the compiled forward (`--compile-prefill`'s path): on CPU, int8
weight-only projections there are dequantized for a GEMM in `ember.quant.linear.CPU_GEMM_DTYPE` (bf16 on CPUs
with bf16 dot products) instead of torch's weight-only kernel, and so are int4 ones where Ember's CPU kernel
(`ember.ops.cpu_ext`, int8 activation codes) is not built; where it is, int4 runs it eager and compiled.

`--carried-norms` adds the model quantized int4-g64 in bf16, every token through a decode step, with each
projection computed as the CUDA int4 GEMV computes it (its ops' twins: float32 sums of the dequantized weights,
rounded to bf16), without and with each layer's RMSNorms carried across the GEMVs either side of them (what a
GPU runs with `ember.quant.cuda_int4.FOLD_NORMS`): the carrying's cost in perplexity, apart from the weights'.

`--rounded-rows` adds the float model with each layer's qkv and gate/up input rows rounded to bf16 and then
to int8 as `ember.quant.cuda_int4.round_row` rounds them (what those GEMVs read on a GPU with
`cuda_int4.ROUNDED_ROWS`), so the rounding's cost in perplexity is measured apart from the weights'.
"""

from __future__ import annotations

import argparse

import torch

from ember.loading.checkpoint import load
from ember.quant import QUALITY_TEXT, linear, perplexity, quantize_model
from ember.quant.cuda_int4 import round_row, unround_row


def round_rows(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each layer's qkv and gate/up inputs rounded as `round_row` rounds a bf16 row (in place)."""

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        K = x.shape[-1]
        rows = [unround_row(round_row(row.to(torch.bfloat16)), K) for row in x.reshape(-1, K)]
        return (torch.cat(rows).to(x.dtype).reshape(x.shape), *args[1:])

    for layer in model.model.layers:
        layer.self_attn.qkv_proj.register_forward_pre_hook(hook)
        layer.mlp.gate_up_proj.register_forward_pre_hook(hook)
    return model


def as_cuda_gemvs(model: torch.nn.Module, carried: bool) -> torch.nn.Module:
    """`model` (int4, groups of 64 or more) with its int4 projections run as on a GPU's decode rows: the CUDA
    int4 GEMV's layout and ops (their twins off CUDA), and with `carried`, the norms carried across them (in
    place)."""
    from ember.models import decoder
    from ember.quant import kernels
    from ember.quant.linear import Int4WeightOnlyLinear

    decoder.on_gpu = lambda x: True  # the layers ask whether they carry, as for a GPU's rows
    for module in model.modules():
        if isinstance(module, Int4WeightOnlyLinear):
            module._kernel, module._whole_rows = "mma", True
            module.register_buffer("_words", kernels.int4_mma_tile(module.qweight), persistent=False)
            module.register_buffer(
                "_msz", kernels.int4_mma_scales(module.scales, module.mins), persistent=False
            )
            # `carries_norm` asks for a row on CUDA; here any one row
            module.carries_norm = lambda x, on=carried: on and x.numel() == x.shape[-1]
    return model


def decode_perplexity(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """exp(mean next-token negative log-likelihood) of tokens (1, T), each token through a decode step (one
    row), as a GPU decodes them (`perplexity` runs one forward of all the rows)."""
    from ember.engine.kv_cache import StaticKVCache

    T = tokens.shape[1]
    cache = StaticKVCache(model.config, batch_size=1, max_seq_len=T, device="cpu", dtype=torch.bfloat16)
    nll = []
    with torch.inference_mode():
        for t in range(T - 1):
            hidden = model(tokens[:, t : t + 1], torch.tensor([[t]]), cache)
            logits = model.compute_logits(hidden)[0, -1].float()
            nll.append(torch.logsumexp(logits, 0) - logits[tokens[0, t + 1]])
    return float(torch.exp(torch.stack(nll).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a name or path (GGUF files: their float weights are the file's dequantized ones)",
    )
    ap.add_argument("--schemes", nargs="*", default=["int8", "int8-dyn", "int4-g32", "int4-g64", "gguf"])
    ap.add_argument("--rounded-rows", action="store_true", help="also the float model with rounded rows")
    ap.add_argument(
        "--carried-norms", action="store_true", help="also int4-g64 bf16 decode steps with norms carried"
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    base = load(args.model, device="cpu", progress=False, quantize="none")
    tokens = torch.tensor([base.tokenizer.encode(QUALITY_TEXT, add_special_tokens=False)])
    ref = perplexity(base.model, tokens)
    print(
        f"{'scheme':<10}{'loaded with it':>16}{'vs float32':>12}"
        f"{'float, then quantized':>24}{'vs float32':>12}{'compiled':>12}{'vs float32':>12}"
        f"   ({args.model}, {tokens.shape[1]} tokens, CPU GEMMs in {linear.CPU_GEMM_DTYPE})"
    )
    print(f"{'float32':<10}{ref:>16.4f}")
    if args.rounded_rows:
        r = perplexity(
            round_rows(load(args.model, device="cpu", progress=False, quantize="none").model), tokens
        )
        print(
            f"{'rounded':<10}{r:>16.4f}{100 * (r - ref) / ref:>+11.2f}%   (float32, qkv and gate/up rows in int8)"
        )
    if args.carried_norms:
        ppl = {}
        for carried in (False, True):
            model = load(args.model, device="cpu", dtype="bfloat16", progress=False, quantize="none").model
            ppl[carried] = decode_perplexity(
                as_cuda_gemvs(quantize_model(model, "int4-g64"), carried), tokens
            )
        off, on = ppl[False], ppl[True]
        print(
            f"{'int4-g64':<10}{off:>16.4f}{100 * (off - ref) / ref:>+11.2f}%   (bf16 decode steps, as the CUDA GEMV)"
        )
        print(
            f"{'carried':<10}{on:>16.4f}{100 * (on - ref) / ref:>+11.2f}%   "
            f"(the same, norms carried: {100 * (on - off) / off:+.2f}% against it)"
        )
    for scheme in args.schemes:
        # As `--quantize` loads (GGUF 4-bit tensors taken as they are under int4-g32), and quantizing the
        # float model after loading it.
        loaded = load(args.model, device="cpu", progress=False, quantize=scheme, quant_cache=False).model
        a = perplexity(loaded, tokens)
        line = f"{scheme:<10}{a:>16.4f}{100 * (a - ref) / ref:>+11.2f}%"
        if scheme != "gguf":  # chosen while loading a GGUF file only
            b = perplexity(
                quantize_model(load(args.model, device="cpu", progress=False, quantize="none").model, scheme),
                tokens,
            )
            line += f"{b:>24.4f}{100 * (b - ref) / ref:>+11.2f}%"
        else:
            line += " " * 36
        c = perplexity(torch.compile(loaded, dynamic=True), tokens)
        line += f"{c:>12.4f}{100 * (c - ref) / ref:>+11.2f}%"
        print(line, flush=True)


if __name__ == "__main__":
    main()
