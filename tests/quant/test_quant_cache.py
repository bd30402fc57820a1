"""The quantized-weights cache. On the real SmolLM2 GGUF: a later start loads what the first one saved (the
same tensors and greedy answers as quantizing afresh), and a touched checkpoint or a truncated file is
quantized again. On a tiny checkpoint directory: its key, `quant_cache=False`, and `ember generate` twice. On
a tiny random model: unusable files and unwritable folders are warnings, never failures."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ember import LLM, SamplingParams
from ember.bench import random_model
from ember.quant import FORMAT_VERSION, quantize_model, read_metadata, save_quantized
from ember.quant import cache as quant_cache

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def answers(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def cache_entries(cache: Path) -> list[Path]:
    """Everything in the cache folder, temporary files included (none may be left behind)."""
    folder = cache / "quantized"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def load(gguf: Path, **kwargs) -> LLM:
    return LLM(gguf, device="cpu", quantize="int4-g32", **kwargs)


@dataclass
class FirstStart:
    gguf: Path  # a private copy of the SmolLM2 GGUF, so that its mtime can be changed
    cache: Path  # EMBER_CACHE_DIR
    llm: LLM
    answers: list[list[int]]
    entries: list[Path]  # the cache folder right after the first start


# -- the real model, end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first(tmp_path_factory, smollm2_gguf) -> FirstStart:
    root = tmp_path_factory.mktemp("quant-cache")
    gguf = root / "smollm2.gguf"
    shutil.copy2(smollm2_gguf, gguf)
    cache = root / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE_DIR", str(cache))
        llm = load(gguf)
    return FirstStart(gguf, cache, llm, answers(llm), cache_entries(cache))


@pytest.mark.slow
def test_first_start_quantizes_and_saves_one_file(first):
    assert first.llm.loaded.quant_cache == "miss"
    assert len(first.entries) == 1
    assert re.fullmatch(r"smollm2-int4-g32-[0-9a-f]{12}\.safetensors", first.entries[0].name)
    assert read_metadata(first.entries[0])["ember.format"] == str(FORMAT_VERSION)
    assert all(len(ids) > 0 for ids in first.answers)


@pytest.mark.slow
def test_second_start_loads_the_same_weights_and_answers_the_same(first, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(first.cache))
    before = cache_entries(first.cache)
    llm = load(first.gguf)
    assert llm.loaded.quant_cache == "hit"
    assert llm.loaded.model.quantization == first.llm.loaded.model.quantization
    fresh, cached = first.llm.loaded.model.state_dict(), llm.loaded.model.state_dict()
    assert fresh.keys() == cached.keys()
    for name, tensor in fresh.items():
        assert tensor.dtype == cached[name].dtype and torch.equal(tensor, cached[name]), name
    assert answers(llm) == first.answers
    assert cache_entries(first.cache) == before  # a hit writes nothing


@pytest.mark.slow
def test_a_touched_checkpoint_is_quantized_again(first, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(first.cache))
    st = first.gguf.stat()
    before = cache_entries(first.cache)
    os.utime(first.gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        llm = load(first.gguf)
    finally:
        os.utime(first.gguf, ns=(st.st_atime_ns, st.st_mtime_ns))  # the other tests' entry stays valid
    assert llm.loaded.quant_cache == "miss"
    added = sorted(set(cache_entries(first.cache)) - set(before))
    assert len(added) == 1 and added[0].name.startswith("smollm2-int4-g32-")


@pytest.mark.slow
def test_a_truncated_cache_file_is_a_warning_and_is_rewritten(first, monkeypatch, caplog):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(first.cache))
    entry = first.entries[0]
    size = entry.stat().st_size
    entry.write_bytes(entry.read_bytes()[: size // 2])
    with caplog.at_level(logging.WARNING, logger="ember.quant.cache"):
        llm = load(first.gguf)
    assert llm.loaded.quant_cache == "miss"
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.quant.cache"]
    assert len(warnings) == 1 and str(entry) in warnings[0], warnings
    assert answers(llm) == first.answers
    assert entry.stat().st_size == size and read_metadata(entry)["ember.format"] == str(FORMAT_VERSION)


# -- a tiny checkpoint directory: the HF layout's key, the switch, the command line ----------------------------


def test_a_directory_is_cached_and_no_quant_cache_writes_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    plain = LLM(tiny_llama_dir, device="cpu", quantize="int8", quant_cache=False)
    assert plain.loaded.quant_cache is None and not (tmp_path / "quantized").exists()
    starts = [LLM(tiny_llama_dir, device="cpu", quantize="int8") for _ in range(2)]
    assert [llm.loaded.quant_cache for llm in starts] == ["miss", "hit"]
    assert len(cache_entries(tmp_path)) == 1
    assert answers(starts[1]) == answers(plain)


@pytest.mark.slow
def test_ember_generate_twice_uses_the_cache(tiny_llama_dir, tmp_path):
    # Real subprocesses through the entry point, as a user runs them; -v shows the cache's INFO lines.
    def generate(cache: Path, *extra: str) -> subprocess.CompletedProcess:
        args = ["-v", "generate", "Name a colour.", "-m", str(tiny_llama_dir), "--quantize", "int8"]
        args += ["--temperature", "0", "--max-new-tokens", "8", "--device", "cpu", "--json", *extra]
        env = dict(os.environ, EMBER_CACHE_DIR=str(cache))
        run = subprocess.run(
            [sys.executable, "-m", "ember.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert run.returncode == 0, run.stderr
        return run

    runs = [generate(tmp_path / "cache") for _ in range(2)]
    assert "quant cache miss" in runs[0].stderr and "quant cache hit" in runs[1].stderr
    first_ids, second_ids = (json.loads(run.stdout)["token_ids"] for run in runs)
    assert first_ids == second_ids and len(first_ids) > 0
    assert [f.name.split("-int8-")[0] for f in cache_entries(tmp_path / "cache")] == [tiny_llama_dir.name]
    off = generate(tmp_path / "off", "--no-quant-cache")
    assert "quant cache" not in off.stderr and not (tmp_path / "off").exists()
    assert json.loads(off.stdout)["token_ids"] == first_ids


# -- the cache alone, on a tiny random model -------------------------------------------------------------------


def tiny_float() -> torch.nn.Module:
    return random_model("tiny", device="cpu", dtype=torch.float32)


def through_cache(path: Path) -> tuple[torch.nn.Module, str]:
    config = tiny_float().config
    return quant_cache.load_or_quantize(
        path, tiny_float, config=config, scheme="int8", dtype=torch.float32, device=torch.device("cpu")
    )


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a safetensors file" * 100)


def _other_format(path: Path) -> None:
    save_file({"x": torch.zeros(4)}, str(path), metadata={"ember.format": "0"})


def _other_scheme(path: Path) -> None:
    save_quantized(quantize_model(tiny_float(), "int4-g32"), path)


@pytest.mark.parametrize(
    "damage", [_garbage, _other_format, _other_scheme], ids=["garbage", "format", "scheme"]
)
def test_an_unusable_cache_file_is_a_warning_and_is_replaced(tmp_path, caplog, damage):
    path = tmp_path / "tiny.safetensors"
    damage(path)
    with caplog.at_level(logging.WARNING, logger="ember.quant.cache"):
        model, state = through_cache(path)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.quant.cache"]
    assert state == "miss" and len(warnings) == 1 and str(path) in warnings[0], warnings
    again, state = through_cache(path)
    assert state == "hit" and again.quantization["scheme"] == "int8"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_an_unwritable_cache_dir_warns_once_and_still_quantizes(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache folder would lie inside a file: mkdir fails, as on a read-only disk
    with caplog.at_level(logging.WARNING, logger="ember.quant.cache"):
        model, state = through_cache(blocker / "quantized" / "tiny.safetensors")
        assert not quant_cache.save(model, blocker / "quantized" / "again.safetensors")
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.quant.cache"]
    assert state == "miss" and model.quantization["scheme"] == "int8"
    assert len(warnings) == 1 and "cannot write" in warnings[0], warnings
