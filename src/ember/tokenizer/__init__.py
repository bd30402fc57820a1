"""Tokenization: HF tokenizer directories and GGUF vocabularies, chat templates, streaming decode.

Public API: `Tokenizer` (from_dir / from_gguf, encode, decode, render_chat, encode_chat, stream_decoder) and
`StreamDecoder`. Everything is built on the `tokenizers` library and sandboxed jinja2; no repo code is run.
"""

from ember.tokenizer.stream import StreamDecoder
from ember.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer"]
