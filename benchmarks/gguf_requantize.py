"""Writes the default model's GGUF file again in other llama.cpp quantization mixes (Q5_K_M, Q3_K_M, Q5_1, ...),
by llama.cpp's own quantizer (llama-cpp-python, built as BENCHMARKS.md says), for benchmarks on more types.

    python benchmarks/gguf_requantize.py --out /tmp/gguf Q5_K_M Q3_K_M
    taskset -c 0,1 python benchmarks/cpu_smollm2.py --gguf /tmp/gguf/smollm2-Q5_K_M.gguf --ember default none

The source holds Q4_1 and Q8_0 weights, so the new files requantize those (llama.cpp's allow_requantize): their
values are not the original model's at that precision, but their types and layouts are the real ones.
SmolLM2's width (576) is no multiple of 256, so a K type falls back to Q5_1 / Q4_0 / ... for most tensors, as
llama.cpp prints; the 1536-wide down projections take it.

`--shape llama-3.2-1b` starts instead from a float16 file of random weights in Llama 3.2 1B's layer shapes (width
2048, 16 layers, 32 query and 8 kv heads, MLP 8192, tied embeddings; SmolLM2's tokenizer and vocabulary), so
the K mixes come out as they do for real Llama files (Q4_K_M: Q4_K with Q6_K attn_v and half the ffn_down):

    python benchmarks/gguf_requantize.py --shape llama-3.2-1b --out /tmp/gguf Q4_K_M
    taskset -c 0,1 python benchmarks/cpu_smollm2.py --gguf /tmp/gguf/llama-3.2-1b-Q4_K_M.gguf --ember default
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import gguf
import numpy as np
from cpu_smollm2 import gguf_path

# (width, layers, query heads, kv heads, MLP width): real models' layer shapes, for random-weight sources
SHAPES = {"llama-3.2-1b": (2048, 16, 32, 8, 8192), "llama-3.2-3b": (3072, 28, 24, 8, 8192)}


def write_random(shape: str, out: Path) -> Path:
    """A float16 GGUF of random weights in `shape`'s layers, with the packaged model's tokenizer."""
    width, layers, heads, kv_heads, mlp = SHAPES[shape]
    path = out / f"{shape}-F16.gguf"
    if path.exists():
        return path
    src = gguf.GGUFReader(gguf_path())
    w = gguf.GGUFWriter(str(path), "llama")
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    for key, field in src.fields.items():
        if key.startswith("tokenizer.") or key == "general.quantization_version":
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    head_dim = width // heads
    w.add_name(shape)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(width)
    w.add_feed_forward_length(mlp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * cols**-0.5).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(vocab, width))
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    for i in range(layers):
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", np.ones(width, np.float32))
        w.add_tensor(blk + "ffn_norm.weight", np.ones(width, np.float32))
        w.add_tensor(blk + "attn_q.weight", matrix(width, width))
        w.add_tensor(blk + "attn_k.weight", matrix(kv_heads * head_dim, width))
        w.add_tensor(blk + "attn_v.weight", matrix(kv_heads * head_dim, width))
        w.add_tensor(blk + "attn_output.weight", matrix(width, width))
        w.add_tensor(blk + "ffn_gate.weight", matrix(mlp, width))
        w.add_tensor(blk + "ffn_up.weight", matrix(mlp, width))
        w.add_tensor(blk + "ffn_down.weight", matrix(width, mlp))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="+", help="llama.cpp file types: Q5_K_M, Q5_K_S, Q3_K_M, Q2_K, Q5_1, ...")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), help="start from random weights of this shape (float16)"
    )
    args = ap.parse_args()
    import llama_cpp

    args.out.mkdir(parents=True, exist_ok=True)
    source = str(write_random(args.shape, args.out)) if args.shape else gguf_path()
    stem = args.shape or "smollm2"
    for name in args.types:
        ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
        if ftype is None:
            raise SystemExit(f"unknown llama.cpp file type {name!r}")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, args.threads
        out = args.out / f"{stem}-{name.upper()}.gguf"
        if llama_cpp.llama_model_quantize(source.encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not write {out}")
        print(out)


if __name__ == "__main__":
    main()
