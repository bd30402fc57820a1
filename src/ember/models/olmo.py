"""OLMo 2 (AllenAI): Llama with post-norms and q/k norms over all heads.

OLMo 2 normalises the output of attention and of the MLP before adding it to the residual ("post" placement:
there is no input norm), and applies RMSNorm to the whole q and k projections (over all heads at once, not
per head) before they are split into heads.
"""

from __future__ import annotations

from ember.config import ModelConfig, common_fields
from ember.models.registry import Family, register


def olmo2_config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=bias,
        o_bias=bias,
        norm_placement="post",  # OLMo 2: x + norm(f(x))
        qk_norm="full",  # OLMo 2: RMSNorm over all of q and all of k
    )


OLMO2 = register(Family("olmo2", ("Olmo2ForCausalLM",), olmo2_config, defaults={"rms_norm_eps": 1e-5}))
