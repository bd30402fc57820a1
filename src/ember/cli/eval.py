"""`ember eval [MODEL]`: the perplexity of a model on a text, to see what a quantization (or a file) costs.

    ember eval                                   # the default model on a built-in English passage
    ember eval --text article.txt --quantize int4-g32
    ember eval gemma3-270m --text - --json < article.txt

The text is tokenized as a prompt is (with the tokenizer's BOS, where it adds one) and scored in windows of
--window tokens (default: the model's context, at most 2048), each --stride tokens after the one before
(default: half a window), so every token but the first is scored once, with at least window - stride tokens
before it. Lower is better; compare runs on the same text and tokenizer only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ember.cli.common import add_model_options, integer, load_model, scheme
from ember.errors import ContextLengthError, EmberError

# The default window where the model's context is longer: a forward of 2048 tokens keeps a CPU's evaluation
# to seconds a window for small models, and scores each token with at least 1024 before it.
DEFAULT_WINDOW = 2048


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure a model's perplexity on a text", description=__doc__)
    add_model_options(p, positional=True, compiles=False)
    p.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="UTF-8 text to score ('-' reads standard input; default: a built-in English passage of ~200 "
        "tokens)",
    )
    p.add_argument(
        "--window",
        type=integer(2),
        default=None,
        help=f"most tokens a forward sees (default: the model's context, at most {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--stride",
        type=integer(1),
        default=None,
        help="tokens from one window's start to the next's (default: half the window)",
    )
    p.add_argument(
        "--versus",
        type=scheme,
        default=None,
        metavar="SCHEME",
        help="also load the model with this --quantize scheme ('none': every weight in --dtype) and report its "
        "perplexity on the same windows, and how far this run's next-token distributions are from its (mean "
        "and 99th-percentile KL divergence, the share of positions whose most likely token agrees)",
    )
    p.add_argument("--threads", type=integer(1), default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def read_text(source: str | None) -> tuple[str, str]:
    """(the text, what to call it) from --text; an EmberError names a file that is missing or not UTF-8."""
    if source is None:
        from ember.quant import QUALITY_TEXT

        return QUALITY_TEXT, "the built-in passage"
    if source == "-":
        data, name = sys.stdin.buffer.read(), "standard input"
    else:
        path = Path(source)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise EmberError(f"--text {source}: no such file") from None
        except IsADirectoryError:
            raise EmberError(f"--text {source}: is a directory; expected a UTF-8 text file") from None
        except OSError as e:
            raise EmberError(f"--text {source}: cannot be read ({e.strerror})") from None
        name = source
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EmberError(
            f"--text {source}: byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8; expected UTF-8 text"
        ) from None
    return text.removeprefix("\ufeff"), name


def check_windows(args: argparse.Namespace, context: int) -> tuple[int, int]:
    """(window, stride) from the options and the model's context; errors name the values and the limit."""
    source = "set by --max-seq-len" if context == args.max_seq_len else "the model's maximum"
    if args.window is not None and args.window > context:
        raise ContextLengthError(
            f"--window {args.window} is longer than the context of {context} tokens ({source})"
        )
    window = args.window or min(context, DEFAULT_WINDOW)
    if window < 2:
        raise ContextLengthError(f"a context of {context} token ({source}) cannot score a token; need 2")
    if args.stride is not None and args.stride >= window:
        raise EmberError(
            f"--stride {args.stride} is not shorter than the window of {window} tokens: a window's first token "
            f"would be scored without the one before it; expected 1 to {window - 1}"
        )
    return window, args.stride or window // 2


def run(args: argparse.Namespace) -> int:
    from ember.eval import compare, perplexity

    if args.threads:
        torch.set_num_threads(args.threads)
    text, text_name = read_text(args.text)  # before a model loads: a wrong path costs no seconds
    loaded = load_model(args)
    context = loaded.config.max_position_embeddings
    if args.max_seq_len is not None:
        context = min(context, args.max_seq_len)
    window, stride = check_windows(args, context)
    ids = loaded.tokenizer.encode(text)
    if len(ids) < 2:
        raise EmberError(f"{text_name} is {len(ids)} token(s) long; perplexity needs at least 2")
    progress = sys.stderr.isatty()
    versus = divergence = None
    if args.versus is not None:
        reference = load_model(args, quantize=args.versus)
        result, versus, divergence = compare(
            loaded.model, reference.model, ids, window=window, stride=stride, progress=progress
        )
        versus_scheme = scheme_of(args.versus, reference)
    else:
        result = perplexity(loaded.model, ids, window=window, stride=stride, progress=progress)
    scheme = scheme_of(args.quantize, loaded)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if args.json:
        out = {
            "model": loaded.name,
            "text": text_name,
            "quantize": scheme,
            "device": str(loaded.device),
            "dtype": dtype,
            **result.to_dict(),
            "load_s": round(loaded.load_s, 3),
        }
        if versus is not None:
            out["versus"] = {
                "quantize": versus_scheme,
                "perplexity": versus.perplexity,
                "nll": versus.nll,
                "seconds": versus.seconds,
                **divergence.to_dict(),
            }
        print(json.dumps(out))
        return 0
    r = result
    print(f"{loaded.name} ({loaded.device}, {dtype}, quantization: {scheme}) on {text_name}")
    if r.windows == 1:
        print(f"  tokens      {r.tokens} ({r.scored} scored in one forward)")
    else:
        print(
            f"  tokens      {r.tokens} ({r.scored} scored in {r.windows} windows of <= {r.window}, {r.stride} apart)"
        )
    print(f"  perplexity  {r.perplexity:.4f} (nll {r.nll:.4f} nats a token)")
    if versus is not None:
        d, ratio = divergence, r.perplexity / versus.perplexity - 1
        print(f"  versus      {versus_scheme}: perplexity {versus.perplexity:.4f} ({ratio:+.2%} here)")
        print(
            f"  divergence  KL from {versus_scheme} {d.kl_divergence:.5f} nats a token (99th percentile "
            f"{d.kl_divergence_p99:.5f}); the same most likely token at {d.top_agreement:.2%} of positions"
        )
    print(f"  time        {r.seconds:.2f} s (load {loaded.load_s:.2f} s)")
    return 0


def scheme_of(quantize: str | None, loaded) -> str:
    """What a run's weights are, for its report: the scheme asked for, else the file's kept codes or none."""
    return quantize or ("the file's codes" if loaded.kept_codes else "none")
