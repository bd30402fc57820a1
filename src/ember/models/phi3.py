"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with projections already fused in the checkpoint, and LongRoPE.

The checkpoint stores `qkv_proj` and `gate_up_proj` exactly as Ember does, so nothing is packed at load time.
LongRoPE ("su" in early configs) rescales each rotary frequency by a short or long factor list, switching to
the long one once the sequence passes `original_max_position_embeddings`; Phi-4-mini rotates only part of each
head (`partial_rotary_factor`). Both are read by the generic rope config.
"""

from __future__ import annotations

from ember.config import ModelConfig, common_fields, layer_windows
from ember.errors import CheckpointError
from ember.models.registry import Family, register


def _rope_as_longrope(hf: dict) -> dict:
    # transformers' Phi-3 reads early configs' "su" and "yarn" as LongRoPE and refuses any other scaling (only
    # Phi-3 renames them: for another family "su" is an unknown rope type, "yarn" YaRN).
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(source)
    if not isinstance(rope, dict):
        return hf
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind in ("su", "yarn"):
        return {**hf, source: {**rope, "rope_type": "longrope"}}
    if kind not in ("default", "longrope"):
        raise CheckpointError(f"Phi-3's {source} has rope type {kind!r}; expected 'longrope' (or none)")
    return hf


def phi3_config(hf: dict) -> ModelConfig:
    hf = _rope_as_longrope(hf)
    # Phi-3: the top-level `original_max_position_embeddings` (4096 when absent) is the LongRoPE threshold; the
    # generic rope config lets it win over one inside the rope settings, as transformers does.
    fields = common_fields(hf, partial_rotary=True)
    # Phi-3: the sliding window (when the config sets one) applies to every layer.
    return ModelConfig(**fields, layer_windows=layer_windows(hf, fields["num_layers"]))


# Phi-3: q/k/v and gate/up are fused in the checkpoint already.
PHI3 = register(
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        phi3_config,
        packed={},
        defaults={
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
        },
    )
)
