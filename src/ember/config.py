"""ModelConfig: one truthful description of a decoder, built from a Hugging Face config.json or GGUF metadata.

Every field is what the checkpoint says; derived values (head_dim, kv heads) only fill what is absent. The
family modules in `ember.models` turn a config dict into a ModelConfig: `common_fields` reads the keys all
families share, and each family adds its own named deltas (see `ember.models.families`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.errors import CheckpointError
from ember.ops.rope import RopeConfig


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    rope: RopeConfig
    # Gemma 3: sliding-window layers use their own rope base; None means every layer uses `rope`.
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # "pre": x + f(norm(x)) (Llama); "sandwich": x + norm(f(norm(x))) (Gemma 2/3);
    # "post": x + norm(f(x)) (OLMo 2).
    norm_placement: str = "pre"
    norm_offset: float = 0.0  # Gemma stores w and scales by (1 + w)
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3, Gemma 3); "full": over all heads (OLMo 2)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None means head_dim ** -0.5
    logit_multiplier: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Per layer: the sliding window (keys with q_pos - k_pos < window are visible) or None for global layers.
    layer_windows: tuple[int | None, ...] = ()
    # Mixture of experts; num_experts == 0 means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict)  # unused keys kept for diagnostics only

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[layer])


def token_ids(value: object) -> tuple[int, ...]:
    """An `eos_token_id` as configs write it (a token id, a list of them, or null); ValueError otherwise."""
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids
    ):
        raise ValueError(f"eos_token_id is {value!r}; expected a token id or a list of token ids")
    return tuple(ids)


# Rope variant -> the keys its frequencies are computed from (transformers refuses a config without them).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# Variants scaled against the length the model was trained at, `original_max_position_embeddings`.
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def rope_from_hf(
    hf: dict,
    *,
    head_dim: int,
    params: dict | None = None,
    source: str = "rope_parameters",
    partial_rotary: bool = False,
) -> RopeConfig:
    """Reads rope settings in either spelling: transformers 5's `rope_parameters` or `rope_theta` + `rope_scaling`.

    A config that carries both takes `rope_scaling`, as transformers does (it replaces `rope_parameters`).
    `params` picks one entry explicitly (`source` names it in errors); otherwise a `rope_parameters` keyed by
    layer type (Gemma 3 in transformers 5: {"full_attention": ..., "sliding_attention": ...}) yields its
    full-attention entry. llama3, yarn and longrope scale against the trained length: a top-level
    `original_max_position_embeddings` (Phi-3 saves it there) wins over the flat settings' own, as
    transformers' `standardize_rope_params` has it; an entry keyed by layer type keeps its own; either falls
    back to `max_position_embeddings`.
    `partial_rotary`: the family rotates `partial_rotary_factor` of each head (Phi-3); the others rotate all of
    it whatever the config says, as transformers does.
    """
    flat = params is None
    if params is None:
        source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        params = hf.get(source) or {}
        if "full_attention" in params:
            params, source, flat = params["full_attention"] or {}, f"{source}['full_attention']", False
    p = dict(params)
    theta = p.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = p.pop("rope_type", None) or p.pop("type", None) or "default"
    partial = p.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if not partial_rotary:
        partial = 1.0
    max_pos = int(hf.get("max_position_embeddings") or 2048)
    missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if p.get(k) is None]
    if missing:
        raise CheckpointError(f"{source} of rope type {rope_type!r} lacks {', '.join(map(repr, missing))}")
    if rope_type in _ORIGINAL_LENGTH_TYPES:
        top = hf.get("original_max_position_embeddings") if flat else None
        if top or not p.get("original_max_position_embeddings"):
            p["original_max_position_embeddings"] = int(top or max_pos)
    return RopeConfig(
        theta=float(theta),
        rotary_dim=int(head_dim * partial),
        max_position_embeddings=max_pos,
        rope_type=rope_type,
        params=p,
    )


def layer_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `sliding_window` and, when present, `layer_types` (transformers 5).

    Without `layer_types` a window applies to every layer; no window (None or 0) means all layers are global.
    """
    window = hf.get("sliding_window")
    if not window:
        return ()
    types = hf.get("layer_types")
    if types is None:
        return (int(window),) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers but num_hidden_layers is {num_layers}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def common_fields(hf: dict, *, partial_rotary: bool = False) -> dict:
    """The fields every decoder family reads the same way, as keyword arguments for ModelConfig (keys a
    checkpoint leaves out take the family's defaults first, `Family.defaults`)."""
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
    num_layers = int(hf["num_hidden_layers"])
    return dict(
        architecture=hf["architectures"][0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        norm_eps=float(hf.get("rms_norm_eps") or hf.get("layer_norm_eps") or 1e-6),
        rope=rope_from_hf(hf, head_dim=int(head_dim), partial_rotary=partial_rotary),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_act=hf.get("hidden_act") or hf.get("hidden_activation") or "silu",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
    )
