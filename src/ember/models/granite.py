"""IBM Granite 3.x: Llama with four scalar multipliers (muP-style training).

Embeddings are multiplied by `embedding_multiplier`, each residual branch by `residual_multiplier`, attention
scores use `attention_multiplier` as the scale (not head_dim ** -0.5), and logits are divided by
`logits_scaling`.
"""

from __future__ import annotations

from ember.config import ModelConfig, common_fields
from ember.models.registry import Family, register


def granite_config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_scale=float(hf.get("attention_multiplier", 1.0)),
        logit_multiplier=1.0 / float(hf.get("logits_scaling", 1.0)),  # Granite divides logits by this
    )


GRANITE = register(Family("granite", ("GraniteForCausalLM",), granite_config))
