"""The quantized-weights cache: `--quantize` pays for reading float weights and quantizing once per checkpoint.

`ember.loading.checkpoint.load(..., quantize=SCHEME)` goes through `load_or_quantize`. A hit rebuilds the
model with `load_quantized` and never reads the float weights; a miss reads and quantizes them as before,
then saves the result (a temporary file in the same folder, then `os.replace`, so a reader never sees half a
file). Files lie in `$EMBER_CACHE_DIR/quantized/` (default `~/.cache/ember/quantized/`, following
`$XDG_CACHE_HOME`), named `<model>-<scheme>-<hash>.safetensors`.

The hash covers what decides the saved tensors: each source file's resolved path, size and mtime_ns, the
scheme (and the output projection's scheme), the dtype, `FORMAT_VERSION` and Ember's version. The device is
not part of it: the saved form is canonical, and `prepare()` builds each device's layout after loading.
Nothing is ever evicted; a changed checkpoint leaves its old file behind (delete the folder to reclaim it).

The cache never stops a model from loading: a corrupt, foreign or stale file is a warning and a fresh
quantization that overwrites it; a cache folder that cannot be written is one warning and no caching.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError

from ember.config import ModelConfig
from ember.models.decoder import Decoder
from ember.paths import cache_root, write_atomically
from ember.quant import (
    FORMAT_VERSION,
    QuantSpec,
    load_quantized,
    output_scheme_for,
    quantize_model,
    save_quantized,
)

log = logging.getLogger(__name__)

# How a checkpoint's weights become the saved tensors: bump when a loader or quantizer gives other tensors for
# the same checkpoint and scheme, so older entries are not served. 2: GGUF 4-bit tensors taken as they are
# under int4-g32 (`ember.loading.gguf.int4_blocks`).
RECIPE = 2

_unwritable_warned: set[Path] = set()  # folders already warned about, so a process warns once per folder


def cache_dir() -> Path:
    """Where quantized weights are cached: `quantized/` under Ember's cache root (`ember.paths.cache_root`)."""
    return cache_root() / "quantized"


def cache_file(name: str, sources: Sequence[Path], scheme: str, dtype: torch.dtype) -> Path:
    """The cache file for `sources` (the files whose bytes decide the weights) quantized to `scheme` in `dtype`."""
    from ember import __version__

    spec = QuantSpec.parse(scheme)
    key = {
        "sources": [[str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns] for p in sources],
        "scheme": spec.name,
        "output_scheme": output_scheme_for(scheme),
        "dtype": str(dtype).removeprefix("torch."),
        "format": FORMAT_VERSION,
        "recipe": RECIPE,
        "ember": __version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name.removesuffix(".gguf")) or "model"
    return cache_dir() / f"{readable}-{spec.name}-{digest}.safetensors"


def _read(
    path: Path, *, config: ModelConfig, scheme: str, dtype: torch.dtype, device: torch.device
) -> Decoder | None:
    """The cached model, or None (with a warning when a file was there but cannot be used)."""
    if not path.is_file():
        return None
    try:
        model = load_quantized(path, device=device)
    # load_quantized raises CheckpointError for every missing, damaged or foreign file it knows of; a cache is
    # only a cache, so anything else it meets is a fresh quantization too.
    except Exception as e:
        log.warning("quant cache: %s cannot be read (%s); quantizing again and overwriting it", path, e)
        return None
    found = (model.quantization["scheme"], model.model.norm.weight.dtype, model.config)
    if found != (QuantSpec.parse(scheme).name, dtype, config):
        log.warning(
            "quant cache: %s holds weights of another scheme, dtype or config than asked for; "
            "quantizing again and overwriting it",
            path,
        )
        return None
    return model


def save(model: Decoder, path: Path) -> bool:
    """Saves `model` to `path` atomically; False (after one warning per folder) when the folder is unwritable."""
    try:  # a temporary unique per writer: two processes filling the same entry never write into one file
        write_atomically(path, lambda tmp: save_quantized(model, tmp))
        return True
    except (OSError, SafetensorError) as e:  # read-only, missing or full: safetensors reports I/O its own way
        if path.parent not in _unwritable_warned:
            _unwritable_warned.add(path.parent)
            log.warning(
                "quant cache: cannot write to %s (%s); quantized weights will not be cached", path.parent, e
            )
        return False


def load_or_quantize(
    path: Path,
    build: Callable[[], Decoder],
    *,
    config: ModelConfig,
    scheme: str,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Decoder, str]:
    """The quantized model from `path` ("hit"), or `build()` quantized to `scheme` and saved there ("miss")."""
    model = _read(path, config=config, scheme=scheme, dtype=dtype, device=device)
    if model is not None:
        log.info("quant cache hit: %s", path)
        return model, "hit"
    model = quantize_model(build(), scheme)
    saved = save(model, path)
    log.info("quant cache miss: quantized to %s; %s %s", scheme, "saved" if saved else "could not save", path)
    return model, "miss"
