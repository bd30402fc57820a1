"""Turn the vocabulary embedded in a GGUF file into a `tokenizers.Tokenizer`.

A GGUF carries no `tokenizer.json`: it stores the token strings, their types, merges (byte-level BPE) or
scores (SentencePiece) and a few flags under `tokenizer.ggml.*`. We rebuild the equivalent fast tokenizer:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE. Tokens are already spelled in the GPT-2 byte alphabet;
  the text is split with the regex llama.cpp picks for `tokenizer.ggml.pre`, then mapped to bytes. For the
  Llama 3 family llama.cpp also takes a word that is a whole token as is, without merging (tiktoken's rule,
  `ignore_merges` in Llama 3's tokenizer.json), and adds BOS unless the file says not to; so do we.
* `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback (`<0x0A>` tokens). The file has
  no merges, so they are derived from the vocabulary: every way of cutting a token into two tokens is a
  merge, ranked by the score of the merged token. Gemma files rank by position instead.

Token types follow llama.cpp: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control and
unknown tokens become special added tokens (matched whole, dropped by `skip_special_tokens`); user-defined ones
become plain added tokens (matched whole, always decoded), as llama.cpp does. The result agrees with
`transformers`' own GGUF conversion, which the tests use as the oracle, except where that conversion departs
from llama.cpp: it splits no digits for StarCoder-family vocabularies, merges whole Llama 3 words, builds
Gemma's runs of spaces from BPE pieces where llama.cpp matches its user-defined space-run tokens whole, and
(but for Phi-3) puts SentencePiece's "▁" only at the start of the whole text, where llama.cpp puts one before
every stretch of text between added tokens, whether or not it starts with a space.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import BPE

from ember.errors import TokenizerError
from ember.paths import cache_root, write_atomically

if TYPE_CHECKING:
    import gguf

__all__ = ["GGUFVocab", "bos_eos_processor", "gguf_source", "vocab_from_gguf"]

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4

# Where generation ends besides `tokenizer.ggml.eos_token_id`, as llama.cpp has it: the file's end-of-turn,
# end-of-message and fill-in-the-middle padding / repository / file-separator ids, and the control or
# user-defined tokens spelled as one of these end markers (a GGUF has no generation_config.json; a Gemma 3
# instruct file's eos is <eos>, while its turns end with <end_of_turn>).
_END_ID_KEYS = (
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)
_END_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>", "</s>",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|repo_name|>", "<reponame>", "<fim-repo>", "<|file_sep|>",
    }
)  # fmt: skip

# The split regexes llama.cpp uses for each `tokenizer.ggml.pre` of a byte-level vocabulary. Each entry is a
# list of regexes applied one after the other (llama.cpp's `regex_exprs`); `None` means the GPT-2 regex, which
# the ByteLevel pre-tokenizer applies itself.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS: dict[str, list[str] | None] = {
    # "default" is what convert_hf_to_gguf writes when it does not recognise the pre-tokenizer; for a
    # byte-level vocabulary that is GPT-2's split.
    **dict.fromkeys(["gpt-2", "gpt2", "default", "mpt", "olmo", "jais"], None),
    # StarCoder family (SmolLM included): every digit on its own, then the GPT-2 split.
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        [r"\p{N}", _GPT2_SPLIT],
    ),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "smaug-bpe", "dbrx", "lfm2"],
        [_LLAMA3_SPLIT],
    ),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"], [_QWEN2_SPLIT]),
    **dict.fromkeys(["gpt-4o", "llama4"], [_GPT4O_SPLIT]),
}
# The pre-tokenizers llama.cpp reads as LLAMA3: `ignore_merges`, and BOS by default (dbrx and smaug-bpe share
# the split only).
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2"})

# Gemma: the scores in the file do not follow the merge order, the position of a token does (ranking by score
# gives ids that differ from the original tokenizer.json; transformers' GGUF loader found the same).
_POSITION_RANKED_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF's tokenizer: the fast tokenizer plus the settings `tokenizer.json` would not carry."""

    tokenizer: FastTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None
    end_ids: tuple[int, ...] = ()  # other ids where generation ends (`_END_ID_KEYS`, `_END_TEXTS`)


def gguf_source(reader: gguf.GGUFReader) -> str:
    """The file a reader has open, for error messages (GGUFReader keeps it only on its memmap)."""
    return str(getattr(reader.data, "filename", None) or "<gguf>")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def vocab_from_gguf(reader: gguf.GGUFReader) -> GGUFVocab:
    """Build the tokenizer described by the `tokenizer.*` keys of an opened GGUF file."""
    path = gguf_source(reader)
    model = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] | None = _field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerError(
            f"{path} has no embedded tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)"
        )
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise TokenizerError(
            f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    arch = _field(reader, "general.architecture", "")
    pre = _field(reader, "tokenizer.ggml.pre", "default")

    if model not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported (expected 'gpt2' or 'llama')"
        )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp's defaults when the flag is absent: SentencePiece and Llama 3 vocabularies add BOS, other
    # byte-level ones do not.
    add_bos_default = model == "llama" or pre in _LLAMA3_PRES
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None

    def build() -> FastTokenizer:
        if model == "gpt2":
            fast, added = _byte_level_bpe(reader, tokens, token_types, pre, path)
        else:
            fast, added = _sentencepiece_bpe(reader, tokens, token_types, arch, path)
        fast.add_special_tokens([t for t in added if t.special])
        fast.add_tokens([t for t in added if not t.special])
        fast.post_processor = bos_eos_processor(fast, bos if add_bos else None, eos if add_eos else None)
        return fast

    return GGUFVocab(
        tokenizer=_cached(reader, build) if model == "llama" else build(),  # byte-level: as fast as loading
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos=add_bos,
        chat_template=_field(reader, "tokenizer.chat_template"),
        end_ids=_end_ids(reader, tokens, token_types, eos),
    )


def _cached(reader: gguf.GGUFReader, build: Callable[[], FastTokenizer]) -> FastTokenizer:
    """`build()`, kept as tokenizer.json under the cache's `tokenizers/`, keyed by the file's tokenizer fields and
    this module: a SentencePiece vocabulary's merges are derived in Python (Gemma 3's 262k tokens: 3.0 s to
    build, 1.2 s to load the cached one). A cache that cannot be read or written is built around, silently."""
    digest = hashlib.sha256("\0".join([Path(__file__).read_text(), tokenizers.__version__]).encode())
    # A field's bytes run up to the next field's (or the first tensor's entry, or the file's end).
    starts = [f.offset for f in reader.fields.values()] + [t.field.offset for t in reader.tensors[:1]]
    starts = sorted({*starts, len(reader.data)})
    end_of = dict(zip(starts, starts[1:], strict=False))
    for name, f in sorted(reader.fields.items()):
        if name.startswith("tokenizer.ggml.") or name == "general.architecture":
            digest.update(memoryview(reader.data[f.offset : end_of[f.offset]]))
    path = cache_root() / "tokenizers" / f"{digest.hexdigest()[:32]}.json"
    if path.is_file():
        try:
            return FastTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exceptions): build it again
            log.debug("tokenizer cache: %s unreadable (%s); building the tokenizer again", path, e)
    fast = build()
    try:
        write_atomically(path, lambda tmp: fast.save(str(tmp), pretty=False))
    except Exception as e:  # noqa: BLE001  (an unwritable or full disk; tokenizers' own errors are plain)
        log.debug("tokenizer cache: cannot write %s (%s)", path, e)
    return fast


def _end_ids(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int], eos: int | None
) -> tuple[int, ...]:
    named = [_field(reader, key) for key in _END_ID_KEYS]
    spelled = [
        i
        for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True))
        if token in _END_TEXTS and kind in (_CONTROL, _USER_DEFINED)
    ]
    ids = [i for i in (*named, *spelled) if isinstance(i, int) and 0 <= i < len(tokens) and i != eos]
    return tuple(sorted(set(ids)))


def _added_tokens(tokens: list[str], token_types: list[int], vocab: dict[str, int]) -> list[AddedToken]:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens, in id order
    (llama.cpp matches all three whole in the text, and drops the first two from text it decodes)."""
    return [
        AddedToken(token, normalized=False, special=kind in (_CONTROL, _UNKNOWN))
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED) and token in vocab
    ]


def _byte_level_bpe(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int], pre: str, path: str
) -> tuple[FastTokenizer, list[AddedToken]]:
    if pre not in _BYTE_LEVEL_SPLITS:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not a known byte-level pre-tokenizer "
            f"(expected one of {sorted(_BYTE_LEVEL_SPLITS)})"
        )
    merges_field: list[str] | None = _field(reader, "tokenizer.ggml.merges")
    if merges_field is None:
        raise TokenizerError(f"{path}: byte-level vocabulary without tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_field]
    fast = FastTokenizer(
        BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _LLAMA3_PRES
        )
    )

    splits = _BYTE_LEVEL_SPLITS[pre]
    if splits is None:
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    fast.decoder = decoders.ByteLevel()
    return fast, _added_tokens(tokens, token_types, vocab)


def _sentencepiece_bpe(
    reader: gguf.GGUFReader, tokens: list[str], token_types: list[int], arch: str, path: str
) -> tuple[FastTokenizer, list[AddedToken]]:
    scores: list[float] | None = _field(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise TokenizerError(f"{path}: SentencePiece vocabulary without tokenizer.ggml.scores")
    # Gemma's runs of 2-31 spaces are user-defined tokens spelled with real spaces: added tokens, matched whole on
    # the text before its spaces become "▁", longest first, as llama.cpp matches them (respelled with "▁" they
    # were BPE pieces instead: 32 spaces became 16 + 16, and a literal "▁▁" the two-space token).
    vocab = {token: i for i, token in enumerate(tokens)}
    rank = [-i for i in range(len(tokens))] if arch in _POSITION_RANKED_ARCHS else scores
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    fast = FastTokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_from_vocab(tokens, vocab, rank),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp puts a space before every stretch of text, also one that starts with a space or follows a special
    # or user-defined token (`<s>[INST]`, `<|user|>\n`), unless the file says not to (Gemma does). Added tokens
    # are cut out before normalizing, so each stretch between them gets its own "▁". (transformers' GGUF loader
    # does so for Phi-3 only; for the others its Metaspace adds one at the start of the whole text, and none
    # where the text starts with a space.)
    add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    fast.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    fast.decoder = decoders.Sequence(steps)
    return fast, _added_tokens(tokens, token_types, vocab)


def _merges_from_vocab(pieces: list[str], vocab: dict[str, int], rank: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best merge first.

    SentencePiece BPE merges, at each step, the adjacent pair whose concatenation scores highest; sorting the
    pairs by the score of what they produce gives the equivalent ranked merge list. Ties break on the longer
    left piece, then vocabulary order (the order transformers uses, so both agree exactly).
    """
    found: list[tuple[float, int, int, int, str, str]] = []
    for index, piece in enumerate(pieces):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-rank[index], -len(left), -len(right), index, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def bos_eos_processor(
    backend: FastTokenizer, bos: int | None, eos: int | None
) -> processors.TemplateProcessing:
    """A post-processor that puts BOS before / EOS after each sequence (either may be None)."""
    head = [backend.id_to_token(bos)] if bos is not None else []
    tail = [backend.id_to_token(eos)] if eos is not None else []
    special = [(backend.id_to_token(i), i) for i in (bos, eos) if i is not None]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B:1", *tail], special_tokens=special
    )
