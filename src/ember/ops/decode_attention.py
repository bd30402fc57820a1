"""`ember::decode_attention`: one query token per row over a static KV cache, rope and cache write included.

A CUDA decode step used to run rope on q, rope on k with the key's cache write, the value's cache write, and
then attention: four kernels per layer. On CUDA this op is one Triton flash-decoding kernel
(`ember.ops.triton_attention`) that does all of it and reads only the slots up to each row's position;
elsewhere, and as the reference it is tested against, it is apply_rope, an index write and plain matmuls
over a causal (and sliding-window) mask. `StaticKVCache.attend` picks it for CUDA decode steps without
attention soft-capping.

Shape legend: B rows, H query heads, K kv heads, S cache slots, D head dim, R rotary dims.
"""

from __future__ import annotations

import torch

from ember.ops.attention import causal_mask, grouped_decode_attention
from ember.ops.rope import apply_rope
from ember.quant.kernels import HAS_TRITON


def attend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """q (B, H, D) after rope, caches (B, K, S, D) holding this step's keys, positions (B,) -> (B, H, D).

    The query at position p sees slots 0..p (and, with window > 0, only those less than `window` behind it).
    """
    B, H, D = q.shape
    slots = torch.arange(k_cache.shape[2], device=q.device)[None]  # (1, S)
    mask = causal_mask(positions[:, None], slots, window if window > 0 else None)  # (B, 1, 1, S)
    out = grouped_decode_attention(q.float()[:, None], k_cache.float(), v_cache.float(), mask, scale)
    return out.reshape(B, H, D).to(q.dtype)


def decode_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """q (B, H, D), k and v (B, K, D) before rope, cos and sin (B, R), caches (B, K, S, D), positions (B,):
    rotates q and k, writes k and v at each row's position, attends -> (B, H, D)."""
    q = apply_rope(q[:, None], cos[:, None], sin[:, None])[:, 0]  # (B, H, D)
    k = apply_rope(k[:, None], cos[:, None], sin[:, None])[:, 0]  # (B, K, D)
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v
    return attend_reference(q, k_cache, v_cache, positions, scale, window)


@torch.library.custom_op("ember::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
    k_next: torch.Tensor | None = None,
    v_next: torch.Tensor | None = None,
    ahead: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention_reference`; the Triton kernel on CUDA. k_next, v_next (optional): the next layer's
    caches, which the kernel may pull into L2 for that layer; ahead (optional): weights a later kernel reads
    (the output projection's), which the CUDA kernel may pull into L2 (hints: nothing reads or writes them
    here)."""
    return decode_attention_reference(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window)


@decode_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window, k_next=None, v_next=None, ahead=None):
    return torch.empty_like(q)


@decode_attention.register_kernel("cuda")
def _(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window, k_next=None, v_next=None, ahead=None):
    # The kernel takes one row stride per tensor (cos and sin share one) and unit strides within a row.
    rows_ok = (
        all(t.stride(-1) == 1 for t in (q, k, v, cos, sin))
        and q.stride(1) == k.stride(1) == v.stride(1) == q.shape[-1]
        and cos.stride(0) == sin.stride(0)
    )
    from ember.ops import cuda_attention

    if k_cache.shape[2] <= cuda_attention.MAX_SLOTS and cuda_attention.fits(
        q, k, v, cos, sin, k_cache, v_cache, positions
    ):
        out = cuda_attention.decode_attention(
            q, k, v, cos, sin, k_cache, v_cache, positions, scale, window, k_next, v_next, ahead
        )
        if out is not None:
            return out
    if HAS_TRITON and rows_ok and k_cache.is_contiguous() and v_cache.is_contiguous():
        from ember.ops import triton_attention

        return triton_attention.decode_attention(
            q, k, v, cos, sin, k_cache, v_cache, positions.contiguous(), scale, window, k_next, v_next
        )
    return decode_attention_reference(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window)
