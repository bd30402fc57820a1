"""Rotary position embeddings and the scaling variants that Hugging Face configs use.

`RopeConfig` is the truthful description read from a config (`rope_type` plus its parameters); `Rope` turns
positions into (cos, sin) tables. Two variants depend on the sequence length seen so far: dynamic NTK (the
base grows past the trained length) and longrope (long factors once past the original length). Both choose
from the sequence's length (`max(positions) + 1` of a row, or the lengths a packed batch gives per token)
with tensor ops only, so the decode step stays free of host syncs and compiles. As in vLLM, a sequence that
grows past the original length while decoding keeps the keys it cached with the short factors (transformers
recomputes its whole cache then).

A CUDA decode step may take its tables from `ember::rope_tables` (`DECODE_TABLES_OP`): as plain pointwise ops,
inductor recomputes them inside a kernel before each layer's attention custom op (it copies an unrealized
pointwise producer for every consumer that requires exact strides: 8 launches a Llama-3-8B step, ~14 us on an
H200, BENCHMARKS.md); a custom op's outputs are computed once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Whether CUDA decode rows take their tables from `rope_tables` (one Triton kernel a step; its GPU test passed
# on an H100, BENCHMARKS.md, thirty-first session). False for A/B runs.
DECODE_TABLES_OP = True


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: base `theta`, how many of the head's dims rotate, and the scaling variant."""

    theta: float
    rotary_dim: int
    max_position_embeddings: int
    rope_type: str = "default"
    params: dict = field(default_factory=dict)  # the variant's own keys, as the config spells them

    @property
    def original_length(self) -> int:
        """yarn, longrope: the length the model was trained at (longrope switches factors past it)."""
        return self.params.get("original_max_position_embeddings") or self.max_position_embeddings

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; expected one of {ROPE_TYPES}")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp in between.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    p, dim, base = cfg.params, cfg.rotary_dim, cfg.theta
    old_ctx = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 keeps the original frequency, 0 interpolates fully
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rope(nn.Module):
    """Maps positions (B, T) to (cos, sin), each (B, T, rotary_dim), in float32."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention_factor = 1.0
        self.register_buffer("inv_freq", torch.empty(cfg.rotary_dim // 2), persistent=False)
        self.register_buffer("long_inv_freq", torch.empty(cfg.rotary_dim // 2), persistent=False)

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str) -> None:
        """Computes the frequency tables; called after the weights are materialised (they are built on meta)."""
        cfg, p = self.cfg, self.cfg.params
        inv_freq = _base_inv_freq(cfg.theta, cfg.rotary_dim)
        long_inv_freq = inv_freq
        if cfg.rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
        elif cfg.rope_type == "llama3":
            inv_freq = _llama3(inv_freq, p)
        elif cfg.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn(cfg)
        elif cfg.rope_type == "longrope":
            old_ctx = cfg.original_length
            factor = p.get("factor") or cfg.max_position_embeddings / old_ctx
            self.attention_factor = p.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
            )
            inv_freq = inv_freq / torch.tensor(p["short_factor"], dtype=torch.float32)
            long_inv_freq = long_inv_freq / torch.tensor(p["long_factor"], dtype=torch.float32)
        self.inv_freq = inv_freq.to(device)
        self.long_inv_freq = long_inv_freq.to(device)

    def _frequencies(self, positions: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        if cfg.rope_type == "longrope":
            # Each sequence picks its own factors from its length (a row's, or per token where a forward packs
            # several sequences): never from another sequence of the batch, nor from a chunk of its prompt.
            if lengths is None:
                lengths = positions.amax(dim=-1, keepdim=True) + 1  # (B, 1)
            use_long = (lengths > cfg.original_length)[..., None]
            return torch.where(use_long, self.long_inv_freq, self.inv_freq)
        if cfg.rope_type == "dynamic":
            # NTK-aware: past the trained length L0 the base grows to theta * (f * L / L0 - (f - 1))^(d / (d - 2)).
            dim, factor, ctx = cfg.rotary_dim, cfg.params["factor"], cfg.max_position_embeddings
            seq_len = torch.clamp(positions.max() + 1, min=ctx).float()
            base = cfg.theta * ((factor * seq_len / ctx) - (factor - 1)) ** (dim / (dim - 2))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
            return 1.0 / (base**exponents)
        return self.inv_freq

    def forward(
        self, positions: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`lengths` (B, T): each token's sequence length, where a forward packs several sequences (longrope)."""
        inv_freq = self._frequencies(positions, lengths)
        if DECODE_TABLES_OP and positions.is_cuda and positions.shape[-1] == 1 and inv_freq.dim() == 1:
            return rope_tables(positions, inv_freq, self.attention_factor)
        return rope_tables_reference(positions, inv_freq, self.attention_factor)


def rope_tables_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T), inv_freq (Dr/2,) or broadcasting to (B, T, Dr/2) -> (cos, sin), each (B, T, Dr) float32,
    times `factor` (the variant's attention factor)."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, Dr/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, Dr)
    return emb.cos() * factor, emb.sin() * factor


@torch.library.custom_op("ember::rope_tables", mutates_args=())
def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables_reference` for inv_freq (Dr/2,); one Triton kernel on CUDA."""
    return rope_tables_reference(positions, inv_freq, factor)


@rope_tables.register_fake
def _(positions, inv_freq, factor):
    shape = (*positions.shape, 2 * inv_freq.shape[-1])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


@rope_tables.register_kernel("cuda")
def _(positions, inv_freq, factor):
    from ember.quant.kernels import HAS_TRITON

    if HAS_TRITON and inv_freq.dim() == 1 and inv_freq.dtype == torch.float32:
        from ember.ops.triton_rope import rope_tables as triton_rope_tables

        return triton_rope_tables(positions.contiguous(), inv_freq.contiguous(), factor)
    return rope_tables_reference(positions, inv_freq, factor)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of q (B, T, H, D) and k (B, T, K, D) as one tensor: the same values, with half the ops (an
    eager CPU decode step pays ~1 us an op, 30 layers a step)."""
    qk = apply_rope(torch.cat((q, k), dim=2), cos, sin)
    return qk[:, :, : q.shape[2]], qk[:, :, q.shape[2] :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x (B, T, H, D) with the half-split convention of Hugging Face checkpoints.

    Only the first `cos.shape[-1]` dims rotate (partial rotary); the math runs in x's dtype, as in the reference.
    """
    rd = cos.shape[-1]
    cos = cos[:, :, None, :].to(x.dtype)  # (B, T, 1, Dr)
    sin = sin[:, :, None, :].to(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
