"""Llama 2/3/3.1/3.2, SmolLM and Mistral: the base every other family is a delta from.

Llama's own quirks are all config: GQA through num_key_value_heads, llama3/linear/dynamic/yarn rope scaling
through rope_parameters, optional attention and MLP biases. Mistral differs only by a sliding window.
"""

from __future__ import annotations

from ember.config import ModelConfig, common_fields
from ember.models.registry import Family, register


def llama_config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def mistral_config(hf: dict) -> ModelConfig:
    # Mistral: every layer attends to the last `sliding_window` positions only (None disables it).
    window = hf.get("sliding_window")
    fields = common_fields(hf)
    return ModelConfig(**fields, layer_windows=(window,) * fields["num_layers"] if window else ())


LLAMA = register(Family("llama", ("LlamaForCausalLM",), llama_config))
MISTRAL = register(
    Family(
        "mistral",
        ("MistralForCausalLM",),
        mistral_config,
        defaults={"sliding_window": 4096, "max_position_embeddings": 131072},
    )
)
