"""Weight quantization as a module swap, with the format recorded in the model and in saved files.

    model = quantize_model(model, "int4-g32")        # every projection becomes an Int4WeightOnlyLinear
    save_quantized(model, "smollm2-int4.safetensors") # canonical codes + scales, metadata says the scheme
    model = load_quantized("smollm2-int4.safetensors", device="cpu")

Schemes (`SCHEMES`): "int8" (weight-only, per channel), "int4" (weight-only, groups of 128 along K; "int4-gN"
picks N in 32/64/128/256), "int8-dyn" (int8 weights and dynamically quantized int8 activations, for CPUs
with VNNI), "gguf" (a GGUF file's own quantization, chosen while loading one: its 4-bit projections as int4
groups of 32, the rest int8; the model records each projection's scheme). The attention and MLP projections
and the output projection are swapped (the output projection to int8-dyn under int4 schemes and gguf, see
`output_scheme_for`); embeddings and norms stay in float. The scheme is read from `model.quantization` or
the file's metadata, never guessed.

The output projection is the Decoder's `lm_head` module (for tied models it shares the embedding's
tensor until it is swapped), so it is quantized like any other projection.

Loading a checkpoint with a scheme (`ember.LLM(..., quantize=...)`, `--quantize` of every command) goes
through the quantized-weights cache (`ember.quant.cache`): the first start saves the quantized model with
`save_quantized` to `$EMBER_CACHE_DIR/quantized/` (default `~/.cache/ember/quantized/`), later starts load
it with `load_quantized` and skip reading and quantizing the float weights. `quant_cache=False` /
`--no-quant-cache` turns it off. Bump `FORMAT_VERSION` whenever the saved form changes, and the cache's
`RECIPE` whenever the quantized tensors for a checkpoint do: both are part of every cache key.

Loading a GGUF file with an int4 scheme of groups of 32, or with "gguf", takes its Q4_0, Q4_1 and Q4_K
tensors as they are (their blocks are int4 groups of 32, `ember.loading.gguf.int4_blocks`): nothing is
dequantized and quantized again, and the model computes with the file's own weights. Other tensor types are
dequantized and quantized: to the scheme's int4, or under "gguf" to int8, which keeps what 5-, 6- and 8-bit
blocks hold (Gemma 3 270M Q4_K_M: +0.4-1.1% perplexity against the file's float weights where int4-g32 gives
+30%; BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ember.config import ModelConfig
from ember.errors import CheckpointError, EmberError
from ember.ops.rope import RopeConfig
from ember.quant.linear import (
    CodesEmbedding,
    Int4WeightOnlyLinear,
    Int8DynActLinear,
    Int8WeightOnlyLinear,
    QuantLinear,
)

FORMAT_VERSION = 1
MODULES: dict[str, type[QuantLinear]] = {
    "int8": Int8WeightOnlyLinear,
    "int4": Int4WeightOnlyLinear,
    "int8-dyn": Int8DynActLinear,
}
SCHEMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256", "int8-dyn", "gguf")
GGUF_GROUP = 32  # the "gguf" scheme's int4 groups: the blocks of GGUF's 4-bit types
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class QuantSpec:
    scheme: str  # a key of MODULES, or "gguf"
    group_size: int | None = None  # int4 (and gguf's int4 projections) only

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """'int8' | 'int4' | 'int4-g32' ... | 'int8-dyn' -> QuantSpec; raises EmberError naming the choices."""
        if text not in SCHEMES:
            raise EmberError(f"quantization {text!r} is not supported; expected one of {', '.join(SCHEMES)}")
        if text.startswith("int4"):
            return cls("int4", int(text.partition("-g")[2] or 128))
        if text == "gguf":
            return cls("gguf", GGUF_GROUP)
        return cls(text)

    @property
    def name(self) -> str:
        return f"int4-g{self.group_size}" if self.scheme == "int4" else self.scheme

    def make(self, linear: nn.Linear) -> QuantLinear:
        """`linear` quantized to this scheme (under "gguf": a projection that was not 4-bit, to int8)."""
        if self.scheme == "int4":
            return Int4WeightOnlyLinear.from_float(linear, self.group_size or 128)
        if self.scheme == "gguf":
            return Int8WeightOnlyLinear.from_float(linear)
        return MODULES[self.scheme].from_float(linear)

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        """A projection of `weight` (N, K) and `bias` quantized to this scheme and prepared for its device (the
        float tensors are not kept)."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        module = self.make(linear)
        module.prepare()
        return module

    def takes(self, module: QuantLinear) -> bool:
        """Whether `module`, swapped in by a loader, is of this scheme."""
        if self.scheme == "gguf":
            return module.scheme == "int8" or (module.scheme == "int4" and module.group_size == GGUF_GROUP)
        return module.scheme == self.scheme and getattr(module, "group_size", None) == self.group_size


def not_gguf(weights: str) -> EmberError:
    """The error for the "gguf" scheme asked of weights that are not a GGUF file's (`weights` says whose)."""
    return EmberError(
        f"quantization 'gguf' keeps a GGUF file's own quantization; {weights} (use int8, int4-gN or int8-dyn)"
    )


def quantized_projections(model: nn.Module) -> list[str]:
    """The names of the projections a scheme swaps (attention and dense MLP; MoE experts stay float), also
    those a loader already swapped while reading the weights (`ember.loading.weights.build_model`)."""
    names = []
    for i, layer in enumerate(model.model.layers):
        for proj in _PROJECTIONS:
            parent, _, leaf = proj.partition(".")
            if isinstance(getattr(getattr(layer, parent), leaf, None), (nn.Linear, QuantLinear)):
                names.append(f"model.layers.{i}.{proj}")
    return names


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def output_scheme_for(scheme: str) -> str:
    """The output projection's scheme: int8 weights with dynamic int8 activations under int4 schemes.

    Not int4: int4 logits cost SmolLM2-135M 9.6% perplexity where int4 layers cost 0.04%. int8 weights, as
    GGUF files keep the output at Q8_0; int8 activations too (as llama.cpp's Q8 activations), because on a
    CPU that halves the time of the largest matmul of a small model's step for +0.7% perplexity (int4-g32
    in all: +1.2%, inside the 3% kept for int4; BENCHMARKS.md). On CUDA that module runs weight-only.
    """
    return "int8-dyn" if QuantSpec.parse(scheme).scheme in ("int4", "gguf") else scheme


def _module_scheme(module: QuantLinear) -> str:
    return f"int4-g{module.group_size}" if module.scheme == "int4" else module.scheme


def check_fits(model: nn.Module, spec: QuantSpec) -> list[str]:
    """The projections `spec` will swap; an EmberError naming the groups that fit when an int4 group size does
    not divide some projection's input width (checked before anything is swapped or loaded)."""
    names = quantized_projections(model)
    if spec.scheme == "int4":
        widths = sorted({model.get_submodule(n).in_features for n in names})
        if any(k % spec.group_size for k in widths):
            fits = [f"int4-g{g}" for g in (32, 64, 128, 256) if all(k % g == 0 for k in widths)]
            raise EmberError(
                f"{spec.name}: groups of {spec.group_size} do not divide this model's input widths "
                f"{widths}; use {' or '.join(fits) if fits else 'int8'}"
            )
    return names


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, *, output: bool = True) -> nn.Module:
    """Swaps the projections of a Decoder (and, with `output`, the output projection) in place; returns it.

    Projections that are already modules of this scheme (a loader that quantizes as it reads, so the float
    model never exists whole) are kept; the rest are quantized here. "gguf" is chosen while loading a GGUF
    file (`ember.loading.checkpoint.load(..., quantize="gguf")`), which swaps every projection."""
    spec = QuantSpec.parse(scheme)
    if getattr(model, "quantization", None):
        raise EmberError(f"the model is already quantized ({model.quantization['scheme']})")
    names = check_fits(model, spec)
    if spec.scheme == "gguf" and not all(isinstance(model.get_submodule(n), QuantLinear) for n in names):
        raise not_gguf("it is chosen when loading one, and this model's projections are float")
    body = model.model
    if isinstance(body.embed_tokens, CodesEmbedding):  # looked up in kept codes: the float table back, as a
        body.embed_tokens = body.embed_tokens.as_table()  # quantized model holds (and saves) it
    schemes: dict[str, str] = {}
    for name in names:
        module = model.get_submodule(name)
        if getattr(module, "float_activations", False):  # a checkpoint's own codes kept by a float load
            if spec.takes(module):  # those codes are this scheme's: kept, for the scheme's kernels
                module.float_activations = False
                module.prepare()
            else:  # quantized as the float weights they stand for
                module = spec.quantize(module.dequantize().to(module.dtype), module.bias)
                _set(model, name, module)
            schemes[name] = _module_scheme(module)
            continue
        if isinstance(module, QuantLinear):  # quantized as it was loaded
            if not spec.takes(module):
                raise EmberError(f"{name} was loaded as {_module_scheme(module)}, not {spec.name}")
            schemes[name] = _module_scheme(module)
            continue
        module = spec.make(module)
        module.prepare()
        _set(model, name, module)
    if output:
        head = model.lm_head  # a checkpoint's own codes kept by a float load: the weights they stand for
        kept = getattr(head, "float_activations", False)
        weight = head.dequantize().to(head.dtype) if kept else model.output_weight()
        model.lm_head = QuantSpec.parse(output_scheme_for(scheme)).quantize(weight)
        names.append("lm_head")
    model.quantization = {"scheme": spec.name, "modules": names}
    if spec.scheme == "gguf":  # mixed: each projection's own
        model.quantization["module_schemes"] = schemes
    if output:
        model.quantization["output_scheme"] = output_scheme_for(scheme)
    return model


def _config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def _config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    d["rope"] = RopeConfig(**d["rope"])
    d["local_rope"] = RopeConfig(**d["local_rope"]) if d["local_rope"] else None
    for key in ("layer_windows", "moe_layers", "eos_token_ids"):
        d[key] = tuple(d[key])
    return ModelConfig(**d)


def save_quantized(model: nn.Module, path: str | os.PathLike) -> Path:
    """Writes the quantized model's weights to one safetensors file; its metadata records scheme and config."""
    q = getattr(model, "quantization", None)
    if not q:
        raise EmberError("save_quantized needs a model quantized with ember.quant.quantize_model")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A tied, unquantized output projection is the embedding itself: saved once, re-tied on load.
    shared = (
        {"lm_head.weight"}
        if isinstance(model.lm_head, nn.Linear) and model.config.tie_word_embeddings
        else set()
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in shared}
    meta = {
        "ember.format": str(FORMAT_VERSION),
        "ember.quantization": json.dumps(q),
        "ember.config": _config_to_json(model.config),
        "ember.dtype": str(model.model.norm.weight.dtype).removeprefix("torch."),
    }
    save_file(state, str(path), metadata=meta)
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def _unreadable(path: str | os.PathLike, e: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be truncated or corrupt")


def _expected_model(path: str | os.PathLike, meta: dict[str, str]) -> nn.Module:
    """The Decoder the metadata describes, on the meta device with its quantized modules swapped in: the names,
    shapes and dtypes the file's tensors must have."""
    from ember.models.decoder import Decoder

    try:
        q = json.loads(meta["ember.quantization"])
        cfg = _config_from_json(meta["ember.config"])
        dtype = getattr(torch, meta["ember.dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"ember.dtype {meta['ember.dtype']!r} is not a torch dtype")
        per_module = q.get("module_schemes", {})
        specs = {
            name: QuantSpec.parse(
                q["output_scheme"] if name == "lm_head" else per_module.get(name, q["scheme"])
            )
            for name in q["modules"]
        }
        with torch.device("meta"):
            model = Decoder(cfg).to(dtype)
            for name, s in specs.items():
                linear = model.get_submodule(name)
                if not isinstance(linear, nn.Linear):
                    raise ValueError(f"{name} is not a projection of this config")
                extra = {"group_size": s.group_size} if s.scheme == "int4" else {}
                module = MODULES[s.scheme](
                    linear.in_features, linear.out_features, linear.bias is not None, dtype, **extra
                )
                _set(model, name, module)
    # Metadata that save_quantized did not write fails in json, ModelConfig, QuantSpec or a module's
    # constructor, with many types (a KeyError for a missing field, a TypeError for a wrong one, ...).
    except Exception as e:
        raise CheckpointError(
            f"{path}: Ember metadata does not describe a quantized model ({type(e).__name__}: {e})"
        ) from None
    model.quantization = q
    return model


@torch.no_grad()
def load_quantized(path: str | os.PathLike, *, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuilds a model saved by `save_quantized` without redoing the quantization.

    Every tensor is checked against the model its metadata describes (names, shapes and dtypes), so a missing,
    foreign, truncated or inconsistent file is one CheckpointError naming it, never a model that fails later."""
    if not Path(path).is_file():
        found = "is a directory" if Path(path).is_dir() else "no such file"
        raise CheckpointError(f"{path}: {found}, expected an Ember quantized checkpoint")
    try:
        meta = read_metadata(path)
    except (SafetensorError, OSError) as e:  # a GGUF file reads as a header far too large, say
        raise _unreadable(path, e) from None
    if meta.get("ember.format") != str(FORMAT_VERSION) or "ember.quantization" not in meta:
        raise CheckpointError(
            f"{path}: not an Ember quantized checkpoint (format {meta.get('ember.format')!r}, "
            f"expected {FORMAT_VERSION})"
        )
    model = _expected_model(path, meta)
    try:
        state = load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None
    q, cfg = model.quantization, model.config
    expected = model.state_dict()
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings and "lm_head" not in q["modules"] else set()
    missing = set(expected) - set(state) - tied
    if missing:
        raise CheckpointError(f"{path}: missing weights {sorted(missing)[:5]}")
    unexpected = set(state) - set(expected)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weights {sorted(unexpected)[:5]}")
    for name, want in expected.items():
        tensor = state.get(name, want)  # a tied output projection's weight is not saved
        if tensor.shape != want.shape or tensor.dtype != want.dtype:
            raise CheckpointError(
                f"{path}: weight {name} is {str(tensor.dtype).removeprefix('torch.')} "
                f"{tuple(tensor.shape)}, expected {str(want.dtype).removeprefix('torch.')} "
                f"{tuple(want.shape)} from its metadata"
            )
    model.load_state_dict(state, strict=not tied, assign=True)
    model.tie_weights()
    model.init_buffers(device)
    for name in q["modules"]:
        model.get_submodule(name).prepare()
    return model.eval().requires_grad_(False)


# A fixed English passage (~207 SmolLM2 tokens) for `perplexity`: the quality benchmark's and the tests'. On a
# text of ~45 tokens, a 1-ulp change of the norms' outputs moved SmolLM2 int4-g32's perplexity by -5% to +1.5%
# (its activations rounded to int8 codes); on this one by +0.1% to +0.8%.
QUALITY_TEXT = (
    "The French Revolution was a period of political and societal change in France that began with the Estates "
    "General of 1789 and ended with the coup of 18 Brumaire in November 1799 and the formation of the French "
    "Consulate. Many of its ideas are considered fundamental principles of liberal democracy, while its values "
    "and institutions remain central to modern French political discourse. Its causes are generally agreed to be "
    "a combination of social, political, and economic factors which the existing regime proved unable to manage. "
    "Financial crisis and widespread social distress led to the convocation of the Estates General in May 1789, "
    "its first meeting since 1614. The Representatives of the Third Estate broke away and re-constituted "
    "themselves as a National Assembly in June. The Storming of the Bastille in Paris on 14 July led to a series "
    "of radical measures by the Assembly, including the abolition of feudalism, state control over the Catholic "
    "Church in France, and a declaration of rights."
)


def perplexity(model: nn.Module, tokens: torch.Tensor) -> float:
    """exp(mean next-token negative log-likelihood) of tokens (1, T) in one forward pass (`ember.eval`)."""
    from ember.eval import perplexity as windowed

    return windowed(model, tokens[0]).perplexity
