"""Perplexity of SmolLM2-135M-Instruct on a fixed text, float32 vs each quantization scheme (same tokens).

python benchmarks/quality_smollm2.py
"""

from __future__ import annotations

import torch

from ember.loading.checkpoint import load
from ember.quant import perplexity, quantize_model

TEXT = (
    "The French Revolution was a period of political and societal change in France that began with the Estates "
    "General of 1789 and ended with the coup of 18 Brumaire in November 1799 and the formation of the French "
    "Consulate. Many of its ideas are considered fundamental principles of liberal democracy, while its values "
    "and institutions remain central to modern French political discourse. Its causes are generally agreed to be "
    "a combination of social, political, and economic factors which the existing regime proved unable to manage. "
    "Financial crisis and widespread social distress led to the convocation of the Estates General in May 1789, "
    "its first meeting since 1614. The Representatives of the Third Estate broke away and re-constituted "
    "themselves as a National Assembly in June. The Storming of the Bastille in Paris on 14 July led to a series "
    "of radical measures by the Assembly, including the abolition of feudalism, state control over the Catholic "
    "Church in France, and a declaration of rights."
)


def main() -> None:
    torch.set_num_threads(2)
    base = load("smollm2-135m-instruct", device="cpu", progress=False)
    tokens = torch.tensor([base.tokenizer.encode(TEXT, add_special_tokens=False)])
    ref = perplexity(base.model, tokens)
    print(f"{'scheme':<10}{'perplexity':>12}{'vs float32':>12}   ({tokens.shape[1]} tokens)")
    print(f"{'float32':<10}{ref:>12.4f}{'':>12}")
    for scheme in ("int8", "int8-dyn", "int4-g32", "int4-g64"):
        model = quantize_model(load("smollm2-135m-instruct", device="cpu", progress=False).model, scheme)
        ppl = perplexity(model, tokens)
        print(f"{scheme:<10}{ppl:>12.4f}{100 * (ppl - ref) / ref:>+11.2f}%")


if __name__ == "__main__":
    main()
