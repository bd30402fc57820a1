"""Loads a resolved model: config, weights, tokenizer and generation defaults, from GGUF or a HF directory."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember import huge_pages
from ember.config import ModelConfig, token_ids
from ember.errors import CheckpointError, EmberError
from ember.loading.hub import ResolvedModel, resolve
from ember.loading.safetensors import (
    PICKLE_SUFFIXES,
    DictSource,
    SafetensorsSource,
    read_hf_config,
    read_json,
)
from ember.loading.weights import WeightSource, build_model
from ember.models.decoder import Decoder
from ember.models.registry import config_from_hf, get_family
from ember.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    format: str
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    # Sampling defaults from generation_config.json (temperature, top_p, top_k, repetition_penalty).
    generation_defaults: dict = field(default_factory=dict)
    load_s: float = 0.0
    # "hit" or "miss" when the quantized weights went through the quantized-weights cache; None otherwise.
    quant_cache: str | None = None
    # Projections kept as the GGUF file's own codes, computed with float activations (`keeps_codes`).
    kept_codes: int = 0


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    expected = "expected cpu, cuda, cuda:N or mps"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise EmberError(f"device {device!r} is not a torch device; {expected}") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise EmberError(f"device {device!r} is not supported; {expected}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EmberError(f"device {device!r} asked for, but this torch build sees no CUDA device")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise EmberError(
                f"device {device!r} asked for, but this machine has {count} CUDA device(s): cuda:0..{count - 1}"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise EmberError(f"device {device!r} asked for, but this torch build sees no MPS device")
    return dev


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        # float32 on CPU: exact, and faster than bf16 for small models in eager mode on most CPUs.
        return torch.bfloat16 if device.type in ("cuda", "mps") else torch.float32
    if dtype not in DTYPES:
        raise EmberError(f"dtype {dtype!r} is not supported; expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _generation_config(directory: Path) -> dict:
    path = directory / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def _ids(value: object, where: str) -> tuple[int, ...]:
    try:
        return token_ids(value)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def source_files(resolved: ResolvedModel) -> list[Path]:
    """The files whose bytes decide the weights: the GGUF file, or a directory's config.json and weight files."""
    if resolved.format == "gguf":
        return [resolved.path]
    suffixes = (".safetensors", *PICKLE_SUFFIXES)
    return sorted(p for p in resolved.path.iterdir() if p.name == "config.json" or p.suffix in suffixes)


def keeps_codes(fmt: str, quantize: str | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether loading a checkpoint of format `fmt` without a scheme keeps the projections (and the output
    projection) it holds in Q4_0/Q4_1/Q4_K or Q8_0/Q5_0/Q6_K blocks as they are (`ember.loading.weights.build_model(
    keep_codes=True)`): a GGUF file, float32 on a CPU where Ember's CPU kernels run. Those projections then
    compute the float model's values (float activations, float32 sums; a prefill's rows, on AVX512-VNNI, as
    int16 codes of each block of 32 activations, to 2^-16 of its largest |x|) from the file's 4.5-9 bits a weight
    instead of dequantized float32: SmolLM2-135M Q4_1 decodes ~3x faster on 2 cores, Gemma 3 270M Q4_K_M ~2x
    (BENCHMARKS.md). quantize="none" dequantizes everything, as elsewhere."""
    if fmt != "gguf" or quantize is not None or device.type != "cpu" or dtype != torch.float32:
        return False
    from ember.ops import cpu_ext

    return cpu_ext.available()


def _config(hf: dict, source: Path) -> ModelConfig:
    """`config_from_hf`, its errors naming the file the config came from."""
    try:
        return config_from_hf(hf)
    except EmberError as e:
        raise type(e)(f"{source}: {e}") from None


def load(
    name: str | Path,
    *,
    device: str | None = None,
    dtype: str | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    quantize: str | None = None,
    quant_cache: bool = True,
) -> LoadedModel:
    """`quantize` names an `ember.quant` scheme (int8, int4, int4-g32, int8-dyn ...) applied after loading.
    Without one, a GGUF file's projections held in blocks Ember's CPU kernels take stay as they are on a CPU
    (`keeps_codes`); "none": every weight dequantized to `dtype`.

    With `quant_cache` (the default) a quantized model comes from, or is saved to, the quantized-weights
    cache (`ember.quant.cache`), so the float weights are read and quantized once per checkpoint and scheme.
    """
    start = time.perf_counter()
    if quantize is not None and quantize != "none":
        from ember.quant import QuantSpec

        QuantSpec.parse(quantize)  # an unknown scheme (or "") is refused before anything is read
    resolved: ResolvedModel = resolve(name)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    dequantize = quantize == "none"
    quantize = None if dequantize else quantize
    keep_codes = not dequantize and keeps_codes(resolved.format, quantize, dev, dt)
    gen_defaults: dict = {}
    if quantize == "gguf" and resolved.format != "gguf":
        from ember.quant import not_gguf

        raise not_gguf(f"{resolved.path} is not a GGUF file")
    if resolved.format == "gguf":
        from ember.loading import gguf

        reader = gguf.read_gguf(resolved.path)
        hf = gguf.gguf_to_hf_config(reader)
        cfg = _config(hf, resolved.path)
        family = get_family(cfg.architecture)
        tokenizer = Tokenizer.from_gguf(reader)
        extra_eos = _ids(hf.get("eos_token_id"), str(resolved.path)) + tokenizer.end_ids

        def weights() -> WeightSource:
            # Quantizing: one GGUF tensor dequantized at a time. Float: all at once, on several threads.
            if quantize or keep_codes:
                return gguf.GGUFSource(reader, dtype=dt)
            return DictSource(gguf.load_gguf_state_dict(reader, dtype=dt))

    else:
        hf = read_hf_config(resolved.path)
        cfg = _config(hf, resolved.path / "config.json")
        family = get_family(cfg.architecture)
        tokenizer = Tokenizer.from_dir(resolved.path)
        gen = _generation_config(resolved.path)
        extra_eos = _ids(gen.get("eos_token_id"), str(resolved.path / "generation_config.json"))
        gen_defaults = {
            k: gen[k]
            for k in ("temperature", "top_p", "top_k", "repetition_penalty")
            if gen.get(k) is not None
        }
        if gen.get("do_sample") is False:
            gen_defaults["temperature"] = 0.0

        def weights() -> WeightSource:
            return SafetensorsSource(resolved.path, allow_pickle=allow_pickle)

    def read_model() -> Decoder:
        # Reading (for GGUF, dequantizing) every weight: the slow part that a quant-cache hit skips. With a
        # scheme, each projection is quantized as it is read, so the float model never exists whole.
        origin = str(resolved.path)
        return build_model(
            cfg,
            family,
            weights(),
            device=dev,
            dtype=dt,
            origin=origin,
            progress=progress,
            quantize=quantize,
            keep_codes=keep_codes,
        )

    cache_state = None
    if quantize and quant_cache:
        from ember.quant import cache

        path = cache.cache_file(resolved.name, source_files(resolved), quantize, dt)
        model, cache_state = cache.load_or_quantize(
            path, read_model, config=cfg, scheme=quantize, dtype=dt, device=dev
        )
    elif quantize:
        from ember.quant import quantize_model

        model = quantize_model(read_model(), quantize)
    else:
        model = read_model()
    if dev.type == "cpu":  # every step streams the weights: in huge pages, far fewer TLB misses
        huge_pages.into(model)
    eos = tuple(dict.fromkeys(extra_eos + tuple(tokenizer.eos_token_ids) + cfg.eos_token_ids))
    if not eos:
        raise CheckpointError(f"{resolved.path}: no end-of-sequence token id in the config or tokenizer")
    from ember.quant.linear import outer_quantized

    loaded = LoadedModel(
        name=resolved.name,
        path=resolved.path,
        format=resolved.format,
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dt,
        eos_token_ids=eos,
        generation_defaults=gen_defaults,
        load_s=time.perf_counter() - start,
        quant_cache=cache_state,
        kept_codes=sum(getattr(m, "float_activations", False) for m in outer_quantized(model)),
    )
    log.info("loaded %s (%s, %s) on %s in %.1f s", resolved.name, cfg.architecture, dt, dev, loaded.load_s)
    return loaded
