"""Gemma 2 and Gemma 3 (text): the family with the most deltas from Llama, each a config field.

Both: RMSNorm weight stored as w and applied as (1 + w); a norm before and after attention and MLP
("sandwich"); GeGLU (tanh-approximated GELU gate); embeddings scaled by sqrt(hidden); queries scaled by
`query_pre_attn_scalar` ** -0.5 rather than head_dim ** -0.5; local sliding-window layers between global ones;
biases on q/k/v/o where `attention_bias` says so (as Llama).
Gemma 2: tanh soft-capping of attention and final logits; local and global layers alternate.
Gemma 3: RMSNorm on q and k per head (no soft-capping); five local layers per global one, and local layers use
their own rope base (10k) while global ones use 1M, possibly with scaling (`rope_scaling` updates the global
settings in place, as in transformers).
"""

from __future__ import annotations

from ember.config import ModelConfig, common_fields, layer_windows, rope_from_hf
from ember.models.registry import Family, register
from ember.ops.rope import RopeConfig


def _gemma_fields(hf: dict, default_period: int) -> dict:
    fields = common_fields(hf)
    n = fields["num_layers"]
    bias = bool(hf.get("attention_bias", False))
    if hf.get("layer_types") is None and hf.get("sliding_window"):
        # Hub configs predating `layer_types`: every `period`-th layer is global, the others local.
        period = int(hf.get("sliding_window_pattern") or default_period)
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
        hf = {**hf, "layer_types": types}
    return dict(
        fields,
        qkv_bias=bias,
        o_bias=bias,
        # Gemma calls it hidden_activation; older configs also carry a stale hidden_act.
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        norm_placement="sandwich",  # Gemma: norms around both attention and MLP
        norm_offset=1.0,  # Gemma: norm weight is (1 + w)
        embedding_multiplier=fields["hidden_size"] ** 0.5,  # Gemma: embeddings scaled by sqrt(hidden)
        attention_scale=float(hf.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        layer_windows=layer_windows(hf, n),
    )


def gemma2_config(hf: dict) -> ModelConfig:
    # Gemma 2 soft-caps attention scores (Gemma 3's modelling ignores the key; so does Ember).
    return ModelConfig(
        **_gemma_fields(hf, default_period=2), attn_logit_softcap=hf.get("attn_logit_softcapping")
    )


def _gemma3_rope_parameters(hf: dict) -> dict:
    # Gemma 3 (as transformers reads it): rope parameters keyed by layer type, with `rope_scaling` updating the
    # full-attention entry rather than replacing it.
    params = hf.get("rope_parameters") or {}
    full = (params["full_attention"] or {}) if "full_attention" in params else params
    full = {**full, **(hf.get("rope_scaling") or {})}
    return {"full_attention": full, "sliding_attention": params.get("sliding_attention")}


def _local_rope(hf: dict, head_dim: int) -> RopeConfig:
    params = hf.get("rope_parameters") or {}
    if params.get("sliding_attention"):  # transformers 5: rope parameters keyed by layer type
        source = "rope_parameters['sliding_attention']"
        return rope_from_hf(hf, head_dim=head_dim, params=params["sliding_attention"], source=source)
    theta = hf.get("rope_local_base_freq") or 10000.0
    return rope_from_hf(hf, head_dim=head_dim, params={"rope_theta": theta, "rope_type": "default"})


def gemma3_config(hf: dict) -> ModelConfig:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention (an embedding model) is not supported: Ember decodes causally"
        )
    hf = {**hf, "rope_parameters": _gemma3_rope_parameters(hf), "rope_scaling": None}
    fields = _gemma_fields(hf, default_period=6)
    return ModelConfig(
        **fields,
        qk_norm="head",  # Gemma 3: RMSNorm (1 + w) on each head of q and k before rope
        local_rope=_local_rope(hf, fields["head_dim"]),  # Gemma 3: sliding layers use their own rope base
    )


# transformers' Gemma config defaults (checkpoints saved by older versions leave tie_word_embeddings=True out).
_GEMMA_DEFAULTS = {"tie_word_embeddings": True, "sliding_window": 4096, "query_pre_attn_scalar": 256}
GEMMA2 = register(
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        gemma2_config,
        defaults={
            **_GEMMA_DEFAULTS,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "max_position_embeddings": 8192,
        },
    )
)
GEMMA3 = register(
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        gemma3_config,
        defaults={**_GEMMA_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 131072},
    )
)
