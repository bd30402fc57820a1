"""Hugging Face checkpoint directories: config.json, safetensors (single or sharded), and pickle refusal.

Tensors are opened with safetensors' mmap (`safe_open`) and read one at a time when the model is assembled,
so peak memory is the model plus one tensor. Pickle checkpoints (`*.bin`, `*.pt`) can run code when loaded:
they are refused unless the user passes `allow_pickle`, and then loaded with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ember.errors import CheckpointError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def read_json(path: Path) -> dict:
    try:
        with path.open() as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json; expected a Hugging Face model directory")
    return read_json(path)


class SafetensorsSource:
    """All tensors of a checkpoint directory by name, read lazily from mmap'd files."""

    def __init__(self, directory: Path, *, allow_pickle: bool = False) -> None:
        self.directory = directory
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        files = self._safetensors_files(directory)
        if files:
            for file in files:
                for name in self._open(file).keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._file_of[name] = file
        else:
            self._load_pickle(directory, allow_pickle)

    def _safetensors_files(self, directory: Path) -> list[Path]:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            for name, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise CheckpointError(
                        f"{index}: weight_map[{name!r}] is {shard!r}; expected the name of a shard file"
                    )
            files = sorted({directory / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
            return files
        return sorted(directory.glob("*.safetensors"))

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{file}: not a readable safetensors file ({e}); it may be truncated or corrupt"
                ) from None
        return self._handles[file]

    def _load_pickle(self, directory: Path, allow_pickle: bool) -> None:
        pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if not pickles:
            raise CheckpointError(f"{directory}: no *.safetensors weights found")
        if not allow_pickle:
            raise CheckpointError(
                f"{directory} has only pickle weights ({pickles[0].name}); pickle files can run code when loaded. "
                "Convert them to safetensors, or pass --allow-pickle to load them with torch.load(weights_only=True)"
            )
        for file in pickles:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types for a bad or unsafe pickle
                raise CheckpointError(f"{file}: cannot load with weights_only=True ({e})") from None
            if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
            ):
                raise CheckpointError(
                    f"{file} holds a {type(state).__name__}, not a state dict (tensor names -> tensors)"
                )
            self._pickled.update(state)

    def names(self) -> set[str]:
        return set(self._file_of) | set(self._pickled)

    def get(self, name: str) -> torch.Tensor:
        if name in self._pickled:
            return self._pickled[name]
        try:
            return self._open(self._file_of[name]).get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(
                f"{self._file_of[name]}: cannot read tensor {name!r} ({e}); truncated?"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


class DictSource:
    """Tensors already in memory (e.g. dequantized from GGUF)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]
