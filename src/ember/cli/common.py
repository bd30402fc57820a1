"""Options shared by the subcommands that load a model, and their one source of defaults."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from ember.engine.sampler import SamplingParams
from ember.loading.hub import DEFAULT_MODEL


def integer(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum], else a usage error naming the value and the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            want = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"{value} is out of range; expected an integer {want}")
        return value

    return parse


def scheme(text: str) -> str:
    """An argparse type: a quantization scheme, or "none" (an empty one is a usage error, not "none")."""
    from ember.quant import SCHEMES

    if text not in (*SCHEMES, "none"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a scheme; expected one of {', '.join(SCHEMES)} or none"
        )
    return text


def number(minimum: float, *, inclusive: bool):
    """An argparse type: a finite float above `minimum` (or equal to it, if inclusive), else a usage error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            want = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range; expected a number {want}")
        return value

    return parse


def stdin_keeps_bad_bytes() -> None:
    """Standard input read as argv is: in the locale's encoding, each byte it cannot decode kept as a lone
    surrogate (U+DC80 + the byte) rather than a UnicodeDecodeError ending the command, so that `check_text` can
    name it."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


def add_model_options(
    parser: argparse.ArgumentParser, *, positional: bool = False, compiles: bool = True
) -> None:
    """The options that pick and load a model; `compiles`: with --compile and --compile-prefill."""
    if positional:
        parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help="same as --model")
    parser.add_argument(
        "-m",
        "--model",
        dest="model_option",
        default=None,
        help=f"alias, HF directory, .gguf file or cached repo id (default: {DEFAULT_MODEL}; see `ember list`)",
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)",
    )
    parser.add_argument(
        "--max-seq-len", type=integer(1), default=None, help="cap the context (and the KV cache) length"
    )
    if compiles:
        parser.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="compile the decode step (CPU: an AOTInductor package, built once per model shape in minutes and "
            "kept in $EMBER_CACHE_DIR/aoti; CUDA: torch.compile and a CUDA graph). Default: on CPU, decode with "
            "such a package where an earlier --compile run built one, else eagerly; --no-compile: eagerly",
        )
        parser.add_argument(
            "--compile-prefill",
            action="store_true",
            help="also compile the prefill (dynamic shapes; on CUDA a CUDA graph per padded prompt length)",
        )
    parser.add_argument(
        "--quantize",
        type=scheme,
        default=None,
        metavar="SCHEME",
        help="quantize weights after loading: int8, int4 (group 128), int4-g32/g64/g256, int8-dyn (CPU), "
        "gguf (a GGUF file's own: its 4-bit tensors as int4, the rest int8), none (every weight dequantized "
        "to --dtype). Default: none, but on a CPU a GGUF file's projections in block types (Q4_0 .. Q8_0, the K "
        "types) stay as they are, computed in float32 (the dequantized model's values, from a fraction of the bytes; "
        "a prefill's activations as int16 codes of each block of 32 where AVX512-VNNI runs)",
    )
    parser.add_argument(
        "--quant-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --quantize, load the quantized weights that an earlier run saved for the same checkpoint, "
        "scheme and dtype, or save them for the next run (default: on); they lie in "
        "$EMBER_CACHE_DIR/quantized, else ~/.cache/ember/quantized",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow *.bin/*.pt checkpoints (loaded with torch.load(weights_only=True))",
    )


def model_name(args: argparse.Namespace) -> str:
    """--model, else the positional MODEL, else the default; an empty one given is kept (the loader refuses
    it by name), not read as "not given"."""
    for given in (args.model_option, getattr(args, "model", None)):
        if given is not None:
            return given
    return DEFAULT_MODEL


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (unset values come from the model's generation_config)")
    g.add_argument(
        "--max-new-tokens", type=integer(1), default=256, help="most tokens to generate (default: 256)"
    )
    g.add_argument("--temperature", type=float, default=None, help="0 means greedy (default: 0.7)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1.0: off)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=None, help="1.0: off")
    g.add_argument("--seed", type=int, default=None, help="same seed, same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


# Used when neither the command line nor the model's generation_config sets a value.
CLI_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}


def sampling_params(args: argparse.Namespace, model_defaults: dict) -> SamplingParams:
    values = {**CLI_DEFAULTS, **model_defaults}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(
        max_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        **{k: v for k, v in values.items() if k in known},
    )


def load_model(args: argparse.Namespace, quantize: str | None = None):
    """The LoadedModel the loading options name, or with another `quantize` scheme than theirs (no progress
    bar: for commands that measure it)."""
    from ember.loading.checkpoint import load

    return load(
        model_name(args),
        device=args.device,
        dtype=args.dtype,
        allow_pickle=args.allow_pickle,
        progress=False,
        quantize=quantize or args.quantize,
        quant_cache=args.quant_cache,
    )


def load_llm(args: argparse.Namespace):
    from ember.llm import LLM

    return LLM(
        model_name(args),
        device=args.device,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        compile=args.compile,
        compile_prefill=args.compile_prefill,
        quantize=args.quantize,
        quant_cache=args.quant_cache,
        allow_pickle=args.allow_pickle,
        progress=sys.stderr.isatty(),
    )
