"""Architecture name -> Family: how a checkpoint of that family becomes a ModelConfig and Ember weights.

A Family is data, not a subclass: a config function (common fields plus the family's named deltas), the
table of fused parameters, e.g. `{"qkv_proj": ("q_proj", "k_proj", "v_proj")}` as in vLLM's
packed_modules_mapping, and the table of stacked MoE expert parameters (hub checkpoints store one tensor per
expert; Ember holds one (X, out, in) tensor per projection). The generic decoder never asks which family it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ember.config import ModelConfig
from ember.errors import CheckpointError, UnsupportedArchitectureError

# Ember parameter -> the checkpoint parameters concatenated (dim 0) to make it.
DEFAULT_PACKED: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Ember expert parameter (suffix) -> the per-expert checkpoint parameters, `{e}` the expert index: each
# expert's parts are concatenated on dim 0, then the experts stacked on a new dim 0. A checkpoint that already
# holds the stacked tensor under the Ember name (transformers' in-memory layout) loads as is.
DEFAULT_STACKED: Mapping[str, tuple[str, ...]] = {
    "experts.gate_up_proj": ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight"),
    "experts.down_proj": ("experts.{e}.down_proj.weight",),
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    config: Callable[[dict], ModelConfig]
    packed: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_PACKED))
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_STACKED))
    # Checkpoint name -> Hugging Face name for checkpoints that spell weights differently (applied first).
    rename: Callable[[str], str] | None = None
    # Values for keys a config.json leaves out: the transformers config class's defaults, where they differ from
    # `common_fields`' (saves drop keys equal to the base class's defaults, e.g. tie_word_embeddings=True).
    defaults: Mapping[str, object] = field(default_factory=dict)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        _FAMILIES[arch] = family
    return family


def supported_architectures() -> list[str]:
    _load_all()
    return sorted(_FAMILIES)


def get_family(architecture: str) -> Family:
    _load_all()
    if architecture not in _FAMILIES:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[architecture]


def config_from_hf(hf: dict) -> ModelConfig:
    """A Hugging Face config.json dict -> ModelConfig, through the family named by `architectures[0]`."""
    archs = hf.get("architectures") or []
    if not archs:
        raise UnsupportedArchitectureError(
            f"config has no 'architectures' entry (model_type={hf.get('model_type')!r}); "
            f"supported: {', '.join(supported_architectures())}"
        )
    family = get_family(archs[0])
    try:
        return family.config({**family.defaults, **hf})
    except KeyError as e:
        raise CheckpointError(f"{archs[0]} config lacks {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise UnsupportedArchitectureError(f"{archs[0]} config: {e}") from None


def _load_all() -> None:
    # Family modules register themselves on import.
    from ember.models import families  # noqa: F401
