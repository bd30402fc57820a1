"""Mixtral: Mistral with top-2 routed experts in every layer.

Mixtral's checkpoints name the MoE block `block_sparse_moe` and the expert projections w1 (gate), w3 (up),
w2 (down); they are renamed to the Hugging Face MoE names the generic decoder uses, then stacked per expert.
The router always renormalises the top-k weights.
"""

from __future__ import annotations

import re

from ember.config import ModelConfig, common_fields, layer_windows
from ember.models.registry import Family, register

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_RE = re.compile(r"(\.experts\.\d+\.)(w[123])\.")


def mixtral_config(hf: dict) -> ModelConfig:
    fields = common_fields(hf)
    return ModelConfig(
        **fields,
        layer_windows=layer_windows(hf, fields["num_layers"]),
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        norm_topk_prob=True,  # Mixtral: the top-k router weights always sum to one
    )


def mixtral_rename(name: str) -> str:
    """'model.layers.0.block_sparse_moe.experts.3.w1.weight' -> 'model.layers.0.mlp.experts.3.gate_proj.weight'."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _EXPERT_RE.sub(lambda m: f"{m[1]}{_EXPERT_PROJ[m[2]]}.", name)


MIXTRAL = register(
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        mixtral_config,
        rename=mixtral_rename,
        defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072},
    )
)
