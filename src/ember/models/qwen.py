"""Qwen 2 / 2.5, Qwen 3 and Qwen 3 MoE: Llama plus a few named deltas.

- Qwen2: bias on q/k/v (not on o); optional sliding window on the layers from `max_window_layers` on.
- Qwen3: no q/k/v bias by default, RMSNorm on each head of q and k before rope, and an explicit head_dim.
- Qwen3-MoE: Qwen3 with routed experts on every `decoder_sparse_step`-th layer except `mlp_only_layers`; its
  optional sliding window applies to every layer (transformers' Qwen3-MoE reads no `max_window_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ember.config import ModelConfig, common_fields, layer_windows
from ember.models.registry import Family, register


def _qwen_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    # Qwen: the window is off unless `use_sliding_window`; hub configs carry a window value regardless.
    if not hf.get("use_sliding_window", False):
        return ()
    if hf.get("layer_types") is None:
        first = hf["max_window_layers"]
        if not isinstance(first, int):
            raise ValueError(f"max_window_layers={first!r} is not an integer")
        hf = {
            **hf,
            "layer_types": [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ],
        }
    return layer_windows(hf, num_layers)


def _every_layer_window(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    # Qwen3-MoE: `use_sliding_window` windows every layer; `max_window_layers` and `layer_types` are not read.
    if not hf.get("use_sliding_window", False):
        return ()
    return layer_windows({**hf, "layer_types": None}, num_layers)


def qwen2_config(hf: dict) -> ModelConfig:
    fields = common_fields(hf)
    # Qwen2: bias on the q/k/v projections only.
    return ModelConfig(**fields, qkv_bias=True, layer_windows=_qwen_windows(hf, fields["num_layers"]))


def _qwen3_config(hf: dict, windows: Callable[[dict, int], tuple[int | None, ...]]) -> ModelConfig:
    fields = common_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",  # Qwen3: RMSNorm on each head of q and k before rope
        layer_windows=windows(hf, fields["num_layers"]),
    )


def qwen3_config(hf: dict) -> ModelConfig:
    return _qwen3_config(hf, _qwen_windows)


def qwen3_moe_config(hf: dict) -> ModelConfig:
    dense = _qwen3_config(hf, _every_layer_window)
    n = dense.num_layers
    # Qwen3-MoE: experts on every `decoder_sparse_step`-th layer, except those listed as dense.
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_layers = set(hf.get("mlp_only_layers") or ())
    moe = tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(n))
    return replace(
        dense,
        # transformers 5 writes `num_local_experts`; hub configs say `num_experts`.
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=moe,
    )


# transformers' Qwen config defaults: a window of 4096 once `use_sliding_window` is on, from layer 28 on (Qwen3-MoE
# has no `max_window_layers`).
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "sliding_window": 4096}
_QWEN_DENSE_DEFAULTS = {**_QWEN_DEFAULTS, "max_window_layers": 28}
QWEN2 = register(Family("qwen2", ("Qwen2ForCausalLM",), qwen2_config, defaults=_QWEN_DENSE_DEFAULTS))
QWEN3 = register(Family("qwen3", ("Qwen3ForCausalLM",), qwen3_config, defaults=_QWEN_DENSE_DEFAULTS))
QWEN3_MOE = register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3_moe_config, defaults=_QWEN_DEFAULTS))
