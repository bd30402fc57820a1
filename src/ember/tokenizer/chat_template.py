"""Render Hugging Face chat templates the way `transformers.apply_chat_template(tokenize=False)` does.

Chat templates come from model repos and GGUF files, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, and every value they see is rebuilt from plain JSON types first. The
environment matches transformers': `trim_blocks`, `lstrip_blocks`, loop controls, a `{% generation %}` block
(rendered as its body; we never need the assistant mask), `raise_exception()`, `strftime_now()`, a `tojson`
that does not HTML-escape, and a `namespace` that refuses underscore attributes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import TokenizerError

__all__ = ["render_chat_template"]


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` without underscore attributes, so templates cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja2's signature trick, `self` in args
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes `<`, `>`, `&` and `'`, which would change what the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy made of JSON types only: rich objects carry methods the sandbox does not know are unsafe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):  # pydantic models from the server's protocol layer
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    **template_kwargs: Any,
) -> str:
    """Render `source` over `messages`; `special_tokens` (bos_token, eos_token, ...) become variables.

    Raises TokenizerError for an empty conversation, and when the template does not compile or raises while
    rendering (for example through `raise_exception("Conversation roles must alternate ...")`), carrying the
    template's own message.
    """
    if not messages:
        raise TokenizerError("cannot render a chat of no messages: give at least one")
    plain_messages = _plain(messages)
    if not all(isinstance(m, dict) for m in plain_messages):
        kinds = sorted({type(m).__name__ for m in plain_messages if not isinstance(m, dict)})
        raise TokenizerError(f"chat messages must be dicts with 'role' and 'content', got {', '.join(kinds)}")
    # As transformers does: a key set to None is a key left out (OpenAI's `"content": null` beside
    # `tool_calls`), so that templates testing `message.content is defined` see what they expect.
    plain_messages = [{k: v for k, v in m.items() if v is not None} for m in plain_messages]
    try:
        template = _compile(source)
        variables = _plain({**special_tokens, **template_kwargs})
        # transformers always defines `tools` and `documents` (None when not given); templates test for them.
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return template.render(
            messages=plain_messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed: {e}") from e
    except (
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
        IndexError,
        ArithmeticError,
        RecursionError,
    ) as e:
        # Python errors from template expressions, e.g. `'a' + None` for a message without content, or the
        # sandbox refusing `range(10**6)` (OverflowError), or a macro that calls itself forever.
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e
