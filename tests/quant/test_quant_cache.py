"""The quantized-weights cache. On the real SmolLM2 GGUF: a later start loads what the first one saved (the
same tensors and greedy answers as quantizing afresh), and a touched checkpoint or a truncated file is
quantized again. On a tiny checkpoint directory: its key, `quant_cache=False`, and `ember generate` twice. On
a tiny random model: unusable files (a tensor of the wrong shape included) and unwritable folders are warnings,
never failures, and `load_quantized` refuses every such file with one CheckpointError naming it."""

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
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.bench import random_model
from ember.errors import CheckpointError
from ember.quant import FORMAT_VERSION, load_quantized, quantize_model, read_metadata, save_quantized
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
    # The CPU kernels come from the session's cache (linked), as a user's second run finds them: each fresh
    # cache would build them again, ~50 s a process on CI's 2 cores.
    kernels = Path(os.environ["EMBER_CACHE_DIR"]) / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)

    def generate(cache: Path, *extra: str) -> subprocess.CompletedProcess:
        cache.mkdir(exist_ok=True)
        if not (cache / "kernels").exists():
            (cache / "kernels").symlink_to(kernels, target_is_directory=True)
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
    assert "quant cache" not in off.stderr and not (tmp_path / "off" / "quantized").exists()
    assert json.loads(off.stdout)["token_ids"] == first_ids


# -- the cache alone, on a tiny random model -------------------------------------------------------------------


def tiny_float() -> torch.nn.Module:
    return random_model("tiny", device="cpu", dtype=torch.float32)


def through_cache(path: Path) -> tuple[torch.nn.Module, str]:
    config = tiny_float().config
    return quant_cache.load_or_quantize(
        path, tiny_float, config=config, scheme="int8", dtype=torch.float32, device=torch.device("cpu")
    )


DOWN = "model.layers.0.mlp.down_proj.qweight"  # int8 (128, 256) in the tiny model


def rewrite(src: Path, dst: Path, *, tensors=None, meta=None) -> Path:
    """`src`'s tensors and metadata, changed in place by `tensors(dict)` and `meta(dict)`, saved as `dst`."""
    state, metadata = load_file(src), read_metadata(src)
    for change, value in ((tensors, state), (meta, metadata)):
        if change is not None:
            change(value)
    save_file(state, str(dst), metadata=metadata)
    return dst


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a safetensors file" * 100)


def _other_format(path: Path) -> None:
    save_file({"x": torch.zeros(4)}, str(path), metadata={"ember.format": "0"})


def _other_scheme(path: Path) -> None:
    save_quantized(quantize_model(tiny_float(), "int4-g32"), path)


def _wrong_shape(path: Path) -> None:
    # The right metadata, and one tensor cut short: it loaded, then failed every forward in the int8 kernel.
    save_quantized(quantize_model(tiny_float(), "int8"), path)
    rewrite(path, path, tensors=lambda st: st.update(**{DOWN: st[DOWN][:, :-16].contiguous()}))


@pytest.mark.parametrize(
    "damage",
    [_garbage, _other_format, _other_scheme, _wrong_shape],
    ids=["garbage", "format", "scheme", "shape"],
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


# A writer that makes its temporary, writes into it, then sleeps (alive) or exits before its rename (killed).
_WRITER = """
import os, sys, time
from pathlib import Path
from ember.paths import temporary
tmp = temporary(Path(sys.argv[1]))
tmp.write_bytes(b"half a file")
print(tmp, flush=True)
time.sleep(60) if sys.argv[2] == "alive" else os._exit(9)
"""


def test_a_killed_writers_temporary_is_removed_by_the_next_save(tmp_path):
    """A process killed mid-save (the OOM killer, say) leaves its temporary, a model's worth of weights; the next
    save in the folder removes it, and leaves a live writer's alone."""
    path = tmp_path / "tiny.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(quant_cache.__file__).parents[2])}
    dead = subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), "dead"], capture_output=True, text=True, env=env
    )
    assert dead.returncode == 9, dead.stderr
    live = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), "alive"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        dead_tmp, live_tmp = Path(dead.stdout.strip()), Path(live.stdout.readline().strip())
        assert dead_tmp.exists() and live_tmp.exists() and dead_tmp.parent == tmp_path
        model, state = through_cache(path)
        assert state == "miss"
        assert sorted(tmp_path.iterdir()) == sorted([path, live_tmp])
    finally:
        live.kill()
        live.wait()


def test_an_unwritable_cache_dir_warns_once_and_still_quantizes(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache folder would lie inside a file: mkdir fails, as on a read-only disk
    with caplog.at_level(logging.WARNING, logger="ember.quant.cache"):
        model, state = through_cache(blocker / "quantized" / "tiny.safetensors")
        assert not quant_cache.save(model, blocker / "quantized" / "again.safetensors")
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.quant.cache"]
    assert state == "miss" and model.quantization["scheme"] == "int8"
    assert len(warnings) == 1 and "cannot write" in warnings[0], warnings


# -- load_quantized alone: every unusable file is one CheckpointError naming it -------------------------------


def _config(change):
    def edit(meta: dict) -> None:
        config = json.loads(meta["ember.config"])
        change(config)
        meta["ember.config"] = json.dumps(config)

    return edit


DAMAGED = {
    # name: (how the good file becomes a bad one, what the error must say after the path)
    "missing file": (lambda good, bad: None, "no such file"),
    "directory": (lambda good, bad: bad.mkdir(), "is a directory"),
    "truncated header": (lambda good, bad: bad.write_bytes(good.read_bytes()[:100]), "truncated or corrupt"),
    "truncated data": (
        lambda good, bad: bad.write_bytes(good.read_bytes()[:-1]),
        "truncated or corrupt",
    ),
    "gguf file": (
        lambda good, bad: bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64)),
        "not a readable safetensors file",
    ),
    "missing qweight": (
        lambda good, bad: rewrite(good, bad, tensors=lambda st: st.pop(DOWN)),
        f"missing weights \\['{DOWN}'\\]",
    ),
    "missing scales": (
        lambda good, bad: rewrite(good, bad, tensors=lambda st: st.pop(DOWN.replace("qweight", "scales"))),
        "missing weights",
    ),
    "unexpected tensor": (
        lambda good, bad: rewrite(good, bad, tensors=lambda st: st.update(extra=torch.zeros(2))),
        "unexpected weights \\['extra'\\]",
    ),
    "qweight cut short": (
        lambda good, bad: rewrite(
            good, bad, tensors=lambda st: st.update(**{DOWN: st[DOWN][:, :-16].contiguous()})
        ),
        f"weight {DOWN} is int8 \\(128, 240\\), expected int8 \\(128, 256\\)",
    ),
    "scales of another dtype": (
        lambda good, bad: rewrite(
            good, bad, tensors=lambda st: st.update(**{"lm_head.scales": st["lm_head.scales"].half()})
        ),
        "weight lm_head.scales is float16 \\(512,\\), expected float32 \\(512,\\)",
    ),
    "config of another width": (
        lambda good, bad: rewrite(good, bad, meta=_config(lambda c: c.update(hidden_size=64))),
        "expected float32 \\(512, 64\\)",
    ),
    "empty config": (
        lambda good, bad: rewrite(good, bad, meta=lambda m: m.update({"ember.config": "{}"})),
        "metadata does not describe a quantized model",
    ),
    "unknown scheme": (
        lambda good, bad: rewrite(
            good,
            bad,
            meta=lambda m: m.update({"ember.quantization": m["ember.quantization"].replace("int8", "int3")}),
        ),
        "metadata does not describe a quantized model .*'int3'",
    ),
    "unknown dtype": (
        lambda good, bad: rewrite(good, bad, meta=lambda m: m.update({"ember.dtype": "nn"})),
        "metadata does not describe a quantized model",
    ),
}


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    return save_quantized(
        quantize_model(tiny_float(), "int8"), tmp_path_factory.mktemp("good") / "q.safetensors"
    )


@pytest.mark.parametrize("case", list(DAMAGED))
def test_an_unusable_file_is_one_checkpoint_error_naming_it(good_file, tmp_path, case):
    damage, says = DAMAGED[case]
    bad = tmp_path / "bad.safetensors"
    damage(good_file, bad)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(bad))}: .*{says}") as e:
        load_quantized(bad)
    assert "\n" not in str(e.value)
