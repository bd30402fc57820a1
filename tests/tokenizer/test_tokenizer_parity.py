"""Encode/decode parity with transformers for GGUF vocabularies and the HF directories saved from them."""

from __future__ import annotations

import json

import pytest

from ember.errors import TokenizerError
from ember.tokenizer import Tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(model, texts, add_special_tokens):
    for text in texts:
        expected = model.ref.encode(text, add_special_tokens=add_special_tokens)
        assert model.ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(model, texts, skip_special_tokens):
    for text in texts:
        ids = model.ref.encode(text)
        expected = model.ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert model.ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(text)


def test_from_dir_matches_gguf(model, texts):
    ours, from_dir = model.ours, model.from_dir
    assert from_dir.vocab_size == ours.vocab_size == len(model.ref)
    assert (from_dir.bos_token_id, from_dir.eos_token_ids) == (ours.bos_token_id, ours.eos_token_ids)
    assert from_dir.add_bos == ours.add_bos
    assert from_dir.chat_template == ours.chat_template
    for text in texts:
        for add in (True, False):
            assert from_dir.encode(text, add) == model.ref.encode(text, add_special_tokens=add), repr(text)
        ids = from_dir.encode(text)
        assert from_dir.decode(ids) == model.ref.decode(ids, skip_special_tokens=True), repr(text)


def test_smollm2_special_tokens(smollm2):
    # bos <|im_start|>, eos <|im_end|>, no BOS added; special strings in text become single ids.
    s = smollm2.ours
    assert (s.bos_token_id, s.eos_token_ids, s.add_bos) == (1, (2,), False)
    assert s.encode("<|im_start|>") == [1]


@pytest.mark.slow
def test_gemma3_special_tokens(gemma3):
    # Gemma 3: bos <bos>=2 added, eos <eos>=1; control tokens dropped on decode unless asked for.
    g = gemma3.ours
    assert (g.bos_token_id, g.eos_token_ids, g.add_bos) == (2, (1,), True)
    ids = g.encode("hi")
    assert ids[0] == 2 and g.decode(ids) == "hi" and g.decode(ids, skip_special_tokens=False) == "<bos>hi"


@pytest.mark.slow
def test_gemma_byte_fallback_roundtrip(gemma3):
    # A character Gemma has no piece for is spelled with <0x..> byte tokens and decodes back whole.
    text = "𓀀"
    ids = gemma3.ours.encode(text, add_special_tokens=False)
    assert all(gemma3.ours.backend.id_to_token(i).startswith("<0x") for i in ids) and len(ids) == 4
    assert gemma3.ours.decode(ids) == text


def test_from_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json.*tokenizer_config\.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_from_dir_respects_add_bos_flag(smollm2, tmp_path):
    # An explicit add_bos_token in tokenizer_config.json rebuilds the post-processor, as transformers does.
    (tmp_path / "tokenizer.json").write_bytes((smollm2.saved_dir / "tokenizer.json").read_bytes())
    config = json.loads((smollm2.saved_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.add_bos and tok.encode("hi") == [tok.bos_token_id, *tok.encode("hi", add_special_tokens=False)]
    assert tok.chat_template is None  # chat_template.jinja was not copied and the config has none
