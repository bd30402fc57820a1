"""The CPU decode step compiled ahead of time with AOTInductor: one C++ call per token, no Python inside.

A torch.compile'd step spends a large share of a small model's CPU step in Python: dynamo's guards over
every weight and cache tensor, and inductor's Python wrapper that calls each kernel. AOTInductor compiles the
same graph into a shared library whose C++ wrapper calls the kernels and checks no guards (SmolLM2-135M
int4-g32 on 2 cores: ~1.25x the torch.compile step's tokens/s).

What is notable:
- The step takes the weights as inputs, not as constants, so a package holds code only. It is keyed by
  what the code depends on (config, weight names/shapes/dtypes, torch, CPU model, the traced Ember sources),
  never by weight values, and is compiled once per model shape (minutes) and loaded in milliseconds.
- The KV cache tensors are inputs as well, written in place by the step, so the prefill (eager or
  torch.compile) and the compiled decode share one cache. Their length S is a dynamic dimension: one
  package serves every cache size.
- Packages live in `$EMBER_CACHE_DIR/aoti/` (else `~/.cache/ember/aoti/`), written atomically.

Shape legend: B batch (1), T tokens (1), K kv heads, S cache slots, D head dim, V vocab.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

import ember
from ember.engine.kv_cache import StaticKVCache
from ember.models.decoder import Decoder
from ember.paths import cache_root, write_atomically

log = logging.getLogger(__name__)

# The sources a decode step's trace runs through: a package traced from other code must not be reused.
_TRACED_SOURCES = ("config.py", "models", "ops", "quant", "engine/kv_cache.py", "engine/aoti.py")


def cache_dir() -> Path:
    """`aoti/` under Ember's cache root (`ember.paths.cache_root`), beside the quantized-weights cache."""
    return cache_root() / "aoti"


def _cpu_name() -> str:
    """The CPU model: the library is built for the host's instruction set, so it runs only where it was built."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _source_hash() -> str:
    h = hashlib.sha256()
    root = Path(ember.__file__).parent
    for entry in _TRACED_SOURCES:
        # Folders: their Python and the C++ of the ops a step calls by name (ops/csrc: schemas, behaviour).
        paths = (
            [root / entry]
            if entry.endswith(".py")
            else sorted(p for p in (root / entry).rglob("*") if p.suffix in (".py", ".cpp", ".h"))
        )
        for path in paths:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class _LastLogits(nn.Module):
    """tokens and positions (B, T) -> float32 logits of the last position (B, V): the Generator's step."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        hidden = self.model(tokens, positions, cache)
        return self.model.compute_logits(hidden[:, -1])  # (B, V)


def _weights(step: _LastLogits) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the step reads, by name; a tied tensor once, under its first name."""
    return {**dict(step.named_parameters()), **dict(step.named_buffers())}


def _layout(t: torch.Tensor) -> list:
    """What compiled code sees of a weight: shape, strides, dtype and class, and for a tensor subclass
    (torchao's quantized weights) its inner tensors and metadata, which the outer shape does not show."""
    layout = [tuple(t.shape), tuple(t.stride()), str(t.dtype), f"{type(t).__module__}.{type(t).__qualname__}"]
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, ctx = t.__tensor_flatten__()
        layout += [[(name, _layout(getattr(t, name))) for name in names], repr(ctx)]
    return layout


def package_key(model: Decoder, dtype: torch.dtype) -> str:
    """What the compiled code depends on; the weights' values are inputs and so not part of it."""
    weights = _weights(_LastLogits(model))
    layout = [(n, _layout(t)) for n, t in weights.items()]
    ident = dict(
        config=asdict(model.config),
        quantization=getattr(model, "quantization", None),
        weights=layout,
        cache_dtype=str(dtype),
        torch=torch.__version__,
        cpu=_cpu_name(),
        source=_source_hash(),
    )
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]


class _Exported(nn.Module):
    """The exported function: (weights..., tokens, positions, k..., v...) -> logits (B, V).

    The step is held outside the module tree, so export lifts none of the model's tensors as constants;
    `functional_call` runs it on the weights passed in.
    """

    def __init__(self, step: _LastLogits, names: list[str], cache: StaticKVCache) -> None:
        super().__init__()
        self._step = [step]  # a list, so nn.Module does not register it
        self._names = names
        self._cache = cache

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        n, L = len(self._names), len(self._cache.k)
        weights = dict(zip(self._names, args[:n], strict=True))
        tokens, positions = args[n], args[n + 1]
        cache = self._cache.with_tensors(list(args[n + 2 : n + 2 + L]), list(args[n + 2 + L :]))
        return torch.func.functional_call(self._step[0], weights, (tokens, positions, cache))


def compile_decode_step(model: Decoder, cache: StaticKVCache, path: Path) -> None:
    """Exports the B=1, T=1 decode step (any cache length) and compiles it into the package at `path`."""
    step = _LastLogits(model)
    weights = _weights(step)
    L = len(cache.k)
    token = torch.zeros(1, 1, dtype=torch.long, device=cache.k[0].device)  # (B, T)
    example = (*weights.values(), token, token.clone(), *cache.k, *cache.v)
    S = torch.export.Dim("S", min=2, max=1 << 20)
    shapes = (tuple([None] * (len(weights) + 2) + [{2: S}] * (2 * L)),)  # k, v (B, K, S, D)
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own pytree code trips its own deprecation here (torch 2.13); nothing a user can act on.
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning
        )
        exported = torch.export.export(
            _Exported(step, list(weights), cache), example, dynamic_shapes=shapes, strict=False
        )
        # atomic: a concurrent reader never sees half a package
        write_atomically(
            path,
            lambda tmp: torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp)),
            ".pt2",
        )


class AOTIDecodeStep:
    """A loaded package as `step(tokens, positions, cache) -> logits (B, V)`, like the eager step.

    Calls the runner's boxed entry point with a prebuilt weight list: the package's generic __call__ would
    parse its input spec and flatten a pytree of hundreds of tensors on every token.
    """

    def __init__(self, model: Decoder, path: Path) -> None:
        self.path = path
        self._run = torch._inductor.aoti_load_package(str(path)).loader.boxed_run
        self._weights = list(_weights(_LastLogits(model)).values())

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        return self._run([*self._weights, tokens, positions, *cache.k, *cache.v])[0]


def package_path(model: Decoder, dtype: torch.dtype) -> Path:
    """Where the decode step's package for `model`'s shape over caches of `dtype` lies (once built)."""
    return cache_dir() / f"decode-{package_key(model, dtype)}.pt2"


def load_decode_step(model: Decoder, cache: StaticKVCache, *, build: bool = True) -> AOTIDecodeStep:
    """The AOTInductor decode step for `model`'s shape over caches like `cache`; with `build`, compiled on first
    use. A package on disk that does not load (truncated, or not a package) is removed, so that it is built
    again (now, with `build`; else by the next run that asks to compile) instead of failing every run."""
    path = package_path(model, cache.k[0].dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        start = time.perf_counter()
        try:
            step = AOTIDecodeStep(model, path)
        except Exception as e:  # the loader raises RuntimeError and others for a bad archive
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            path.unlink(missing_ok=True)
            message = f"the compiled decode step {path} does not load ({type(e).__name__}: {first}); removed"
            if not build:  # the caller says it, once, with what it decodes with instead
                raise RuntimeError(message) from e
            log.warning("%s, compiling it again", message)
        else:
            log.info("AOTInductor decode step loaded from %s in %.3f s", path, time.perf_counter() - start)
            return step
    if not build:
        raise FileNotFoundError(f"no compiled decode step at {path}")
    start = time.perf_counter()
    # Minutes of silence otherwise: say so once, at the level the CLI shows by default.
    log.warning("compiling the decode step ahead of time (once per model shape; a few minutes) into %s", path)
    compile_decode_step(model, cache, path)
    log.info("AOTInductor decode step compiled in %.1f s", time.perf_counter() - start)
    return AOTIDecodeStep(model, path)
