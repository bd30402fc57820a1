"""Writes the default model's GGUF file again in other llama.cpp quantization mixes (Q5_K_M, Q3_K_M, Q5_1, ...),
by llama.cpp's own quantizer (llama-cpp-python, built as BENCHMARKS.md says), for benchmarks on more types.

    python benchmarks/gguf_requantize.py --out /tmp/gguf Q5_K_M Q3_K_M
    taskset -c 0,1 python benchmarks/cpu_smollm2.py --gguf /tmp/gguf/smollm2-Q5_K_M.gguf --ember default none

The source holds Q4_1 and Q8_0 weights, so the new files requantize those (llama.cpp's allow_requantize): their
values are not the original model's at that precision, but their types and layouts are the real ones.
SmolLM2's width (576) is no multiple of 256, so a K type falls back to Q5_1 / Q4_0 / ... for most tensors, as
llama.cpp prints; the 1536-wide down projections take it.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from cpu_smollm2 import gguf_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="+", help="llama.cpp file types: Q5_K_M, Q5_K_S, Q3_K_M, Q2_K, Q5_1, ...")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gguf"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import llama_cpp

    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.types:
        ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
        if ftype is None:
            raise SystemExit(f"unknown llama.cpp file type {name!r}")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, args.threads
        out = args.out / f"smollm2-{name.upper()}.gguf"
        if llama_cpp.llama_model_quantize(gguf_path().encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not write {out}")
        print(out)


if __name__ == "__main__":
    main()
