"""`Tokenizer`: text <-> ids, chat templates and streaming decode for one model.

Two sources, one object:

* `Tokenizer.from_dir(path)` reads a Hugging Face tokenizer directory: `tokenizer.json` (the fast tokenizer
  itself), `tokenizer_config.json` (special tokens, add_bos/eos flags, chat template), `special_tokens_map.json`
  and `chat_template.jinja` / `chat_template.json` when present. Nothing in the directory is executed
  (`auto_map` and custom tokenizer classes are ignored); `generation_config.json` belongs to the engine.
* `Tokenizer.from_gguf(reader)` converts the vocabulary embedded in a GGUF file (see `gguf_vocab`).

Encoding, decoding and chat rendering follow `transformers` exactly (`encode`, `decode`,
`apply_chat_template(tokenize=False)`), which is what the tests check against.
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as FastTokenizer

from ember.errors import InvalidParameterError, TokenizerError
from ember.tokenizer.chat_template import render_chat_template
from ember.tokenizer.gguf_vocab import bos_eos_processor, gguf_source, vocab_from_gguf
from ember.tokenizer.stream import StreamDecoder

if TYPE_CHECKING:
    import gguf

__all__ = ["Tokenizer"]

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# How many of a prompt's last ids a stream decoder decodes ahead of the generated ones (`StreamDecoder` context).
_STREAM_CONTEXT = 4


class Tokenizer:
    """A model's tokenizer: a `tokenizers.Tokenizer` plus BOS/EOS settings and the chat template."""

    def __init__(
        self,
        backend: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
        source: str = "<tokenizer>",
        end_ids: tuple[int, ...] = (),
    ) -> None:
        """Prefer `from_dir` / `from_gguf`. `special_tokens` maps bos_token/eos_token/... to their text for
        chat templates; `source` names the origin in error messages; `end_ids` are ids other than eos where
        generation ends (a GGUF's end-of-turn tokens: it has no generation_config.json to list them)."""
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.end_ids = end_ids
        self.chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        self._source = source
        # What the post-processor does, not what a config claims: that is what `encode` will produce.
        self.add_bos: bool = bos_token_id is not None and backend.encode("a").ids[:1] == [bos_token_id]
        # For streaming: byte-fallback pieces, and the ids that skip_special_tokens drops.
        self._byte_ids = frozenset(
            i for b in range(256) if (i := backend.token_to_id(f"<0x{b:02X}>")) is not None
        )
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    @property
    def backend(self) -> FastTokenizer:
        """The underlying `tokenizers.Tokenizer` (for token<->string lookups)."""
        return self._backend

    # ----------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (see the module docstring for the files read)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{path} has no tokenizer.json (expected tokenizer.json, with optional tokenizer_config.json, "
                "special_tokens_map.json and chat_template.jinja)"
            )
        try:
            backend = FastTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a plain Exception for a malformed file
            raise TokenizerError(f"{tokenizer_file} could not be parsed as a tokenizers file: {e}") from e

        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        special_tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text is not None:
                special_tokens[name] = text
        bos_id = _token_id(backend, special_tokens.get("bos_token"))
        eos_id = _token_id(backend, special_tokens.get("eos_token"))

        # transformers rebuilds the post-processor when the config states add_bos/add_eos explicitly (or
        # tokenizer.json has none); otherwise tokenizer.json's own post-processor decides.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = bos_eos_processor(
                backend,
                bos_id if config.get("add_bos_token", False) else None,
                eos_id if config.get("add_eos_token", False) else None,
            )

        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=(eos_id,) if eos_id is not None else (),
            chat_template=_chat_template_from_dir(path, config),
            special_tokens=special_tokens,
            source=str(path),
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer embedded in an opened GGUF file (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        vocab = vocab_from_gguf(reader)
        backend = vocab.tokenizer
        ids = {"bos_token": vocab.bos_token_id, "eos_token": vocab.eos_token_id}
        ids |= {"unk_token": vocab.unk_token_id, "pad_token": vocab.pad_token_id}
        special_tokens = {name: backend.id_to_token(i) for name, i in ids.items() if i is not None}
        return cls(
            backend,
            bos_token_id=vocab.bos_token_id,
            eos_token_ids=(vocab.eos_token_id,) if vocab.eos_token_id is not None else (),
            chat_template=vocab.chat_template,
            special_tokens=special_tokens,
            source=gguf_source(reader),
            end_ids=vocab.end_ids,
        )

    # ------------------------------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as the tokenizer is configured to.

        Special-token strings inside `text` (e.g. "<|im_start|>") become their single ids, as in transformers.
        Text that is not Unicode (a lone surrogate, as Python decodes bytes that are not UTF-8 from the command
        line or a pipe) raises InvalidParameterError.
        """
        check_text(text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special (control) tokens are dropped unless `skip_special_tokens=False`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(
        self, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence, the text it adds to `prompt_ids`'."""
        backend = self._backend
        try:
            context = [operator.index(i) for i in prompt_ids[-_STREAM_CONTEXT:]]
        except TypeError:
            context = []
        if not all(0 <= i < self.vocab_size for i in context):
            context = []  # a prompt the generation refuses, naming the id: nothing to decode here
        return StreamDecoder(
            lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens),
            byte_ids=self._byte_ids,
            skipped_ids=self._special_ids if skip_special_tokens else frozenset(),
            context=context,
        )

    # -------------------------------------------------------------------------------------------------- chat

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The prompt text for `messages`, as `apply_chat_template(..., tokenize=False)` renders it.

        `template_kwargs` become template variables (e.g. `tools=[...]`, `enable_thinking=False`).
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"model {self._source} has no chat template; use raw completion (--no-chat) instead"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_tokens,
            **template_kwargs,
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Ids of the rendered chat; the template writes BOS itself, so no special tokens are added."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------------------- helpers


def check_text(text: object, what: str = "the prompt") -> None:
    """Raises InvalidParameterError unless `text` is a str that UTF-8 can hold: Python reads bytes that are not
    UTF-8 (from argv, or a pipe under the C locale) as lone surrogates, U+DC80 + the byte, which no tokenizer
    takes."""
    if not isinstance(text, str):
        raise InvalidParameterError(f"{what} is a {type(text).__name__}; expected a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        found = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise InvalidParameterError(
            f"{what} is not valid UTF-8 text ({found} at character {e.start}); expected UTF-8"
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a {type(data).__name__}, expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as configs spell it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_id(backend: FastTokenizer, text: str | None) -> int | None:
    return None if text is None else backend.token_to_id(text)


def _chat_template_from_dir(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's chat_template.

    A config may hold a list of named templates; the one named "default" is the chat template.
    """
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            logger.warning("%s: chat templates %s include no 'default'; using none", path, sorted(named))
        template = named.get("default")
    return template if isinstance(template, str) else None
