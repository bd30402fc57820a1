"""Chat rendering parity with transformers' apply_chat_template(tokenize=False), and its error paths."""

from __future__ import annotations

import pytest

from ember.errors import TokenizerError
from ember.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 中文 😀 <b>&</b>?"},
]

# Exercises the environment transformers defines: tojson without HTML escaping, namespace, loop controls,
# the {% generation %} block, raise_exception, bos/eos variables, extra kwargs and `tools` being defined.
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools is not none %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "  {% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "  {% set ns.n = ns.n + 1 %}"
    "  {% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "  {% else %}{{ m['role'] }}: {{ m | tojson }}\n{% endif %}"
    "{% endfor %}"
    "turns={{ ns.n }} extra={{ flavour }}"
    "{% if add_generation_prompt %}\nA:{% endif %}"
)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(smollm2, add_generation_prompt):
    for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[:3]):  # [1:]: the template's default system
        expected = smollm2.ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        for tok in (smollm2.ours, smollm2.from_dir):
            assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_encode_chat_matches_transformers(smollm2):
    rendered = smollm2.ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    expected = smollm2.ref.encode(rendered, add_special_tokens=False)
    assert smollm2.ours.encode_chat(CONVERSATION) == expected
    assert expected[0] == 1  # <|im_start|> comes from the template, not from add_special_tokens


@pytest.mark.parametrize(
    "tools", [None, [{"type": "function", "function": {"name": "f<x>", "parameters": {}}}]]
)
def test_custom_template_matches_transformers(smollm2, tmp_path, tools):
    (tmp_path / "tokenizer.json").write_bytes((smollm2.saved_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes(
        (smollm2.saved_dir / "tokenizer_config.json").read_bytes()
    )
    (tmp_path / "chat_template.jinja").write_text(CUSTOM_TEMPLATE)
    tok = Tokenizer.from_dir(tmp_path)
    expected = smollm2.ref.apply_chat_template(
        CONVERSATION, chat_template=CUSTOM_TEMPLATE, tools=tools, tokenize=False, flavour="x<y>"
    )
    kwargs = {"tools": tools} if tools is not None else {}
    assert tok.render_chat(CONVERSATION, add_generation_prompt=False, flavour="x<y>", **kwargs) == expected


def test_template_exception_becomes_tokenizer_error(smollm2, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((smollm2.saved_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(TokenizerError, match="Conversation must start with user"):
        tok.render_chat(CONVERSATION)


def _with_template(smollm2, tmp_path, template: str) -> Tokenizer:
    (tmp_path / "tokenizer.json").write_bytes((smollm2.saved_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(tmp_path)


def test_none_valued_keys_are_left_out(smollm2, tmp_path):
    # OpenAI clients send `"content": null` beside tool_calls; transformers drops such keys before rendering,
    # so a template that tests `is defined` takes the same branch as for a message without the key.
    template = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is defined %}{{ m['content'] }}"
        "{% else %}{{ m['tool_calls'] | tojson }}{% endif %}|{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    expected = smollm2.ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert expected == 'user: weather?|assistant: [{"function": {"name": "f", "arguments": {}}}]|'
    assert (
        _with_template(smollm2, tmp_path, template).render_chat(messages, add_generation_prompt=False)
        == expected
    )
    assert messages[1]["content"] is None  # the caller's messages are not changed


def test_empty_conversation_is_tokenizer_error(smollm2):
    with pytest.raises(TokenizerError, match="no messages"):
        smollm2.ours.render_chat([])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages | length / 0 }}",
        "{% for i in range(10**6) %}{% endfor %}",  # the sandbox's range limit raises OverflowError
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    ],
)
def test_template_python_errors_become_tokenizer_error(smollm2, tmp_path, template):
    with pytest.raises(TokenizerError, match="chat template failed: [A-Za-z]+Error"):
        _with_template(smollm2, tmp_path, template).render_chat(CONVERSATION)


def test_sandbox_blocks_attribute_escape(smollm2, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((smollm2.saved_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="chat template failed"):
        Tokenizer.from_dir(tmp_path).render_chat(CONVERSATION)


@pytest.mark.slow
def test_gemma3_gguf_has_no_chat_template(gemma3):
    assert gemma3.ours.chat_template is None and gemma3.ref.chat_template is None
    with pytest.raises(TokenizerError, match=r"no chat template.*--no-chat"):
        gemma3.ours.render_chat(CONVERSATION)
