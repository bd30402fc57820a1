"""Attention math shared by every KV-cache backend.

`sdpa_attention` is the reference every faster backend is tested against: PyTorch's scaled_dot_product_attention
with a boolean mask, or an explicit softmax when the family soft-caps attention logits (Gemma 2), which SDPA
cannot express. `prompt_attention` runs a prompt's queries through it over only the keys they can see.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ember.ops import cpu_ext


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, H, T, D), k and v (B, K, S, D), mask (B or 1, 1, T, S) bool with True = visible -> (B, H, T, D).

    mask None: causal over a prompt's own keys (S == T, query t sees keys 0..t), which lets SDPA's kernels skip
    the blocks above the diagonal instead of reading a mask."""
    H, K = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=H != K
        )
    if mask is None:
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if H != K:
        k = k.repeat_interleave(H // K, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(H // K, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


# A prompt's query rows a call where a sliding window shorter than the prompt gives each chunk a band of keys.
PROMPT_CHUNK = 256

# Whether a CPU prompt's attention runs Ember's kernel where it can (`cpu_kernel_runs`; EMBER_CPU_PROMPT_ATTENTION=0:
# torch's SDPA, to compare).
CPU_KERNEL = os.environ.get("EMBER_CPU_PROMPT_ATTENTION", "1") != "0"


def cpu_kernel_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `ember_cpu::prompt_attention` (csrc/cpu_prompt_attention.cpp: AVX-512 builds) runs q, k, v:
    float32 on a CPU, a head dim of a multiple of 16, each head's dims contiguous, nothing to differentiate.
    Against SDPA on 2 Zen 4 cores, SmolLM2's 9 heads over 3 kv heads: 1.6x as fast at 128 tokens, 1.8x at 512,
    1.2x at 1800."""
    return (
        CPU_KERNEL
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.shape[-1] % 16 == 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and _kernel_built()
    )


def _kernel_built() -> bool:
    return cpu_ext.has_op("prompt_attention")


# A compiled graph asks once, as it is traced: the mark torch.compiler.assume_constant_result sets, set here
# without the decorator, which imports all of dynamo (~1 s of every command's start, eager runs included).
_kernel_built._dynamo_marked_constant = True  # type: ignore[attr-defined]


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """A prompt's (or a prompt chunk's) queries over its sequence: q (B, H, T, D) at positions S - T .. S - 1,
    k and v (B, K, S, D) at positions 0 .. S - 1 -> (B, H, T, D), causal and, for a sliding-window layer,
    within `window`.

    A prompt from position 0 that no window cuts is one causal call (SDPA skips the blocks above the
    diagonal). Otherwise SDPA reads a mask and computes every query against every key it is given, seen or
    not: so a call gets only the keys from the first one its queries can see, and where a sliding window is
    shorter than the prompt, the queries go PROMPT_CHUNK rows at a time, each chunk over its own band of keys
    (in a compiled graph, as one op: `windowed_prompt_attention`). On 2 CPU cores, a Gemma 3 270M local layer
    (window 512) over 1800 prompt tokens: 77-82 ms with the whole mask, 32-38 ms in chunks. (Chunks of a causal
    prompt after a prefix ran slower than one call with its mask there, 18.3 against 13.0 ms for SmolLM2's 512
    rows after 1024: no chunks without a window.)

    On a CPU with AVX-512, float32 and no soft-cap, all of it is one call of Ember's kernel instead
    (`cpu_kernel_runs`), which reads no mask and never the keys a query cannot see, window or not."""
    T, S = q.shape[2], k.shape[2]
    start = S - T
    if softcap is None and cpu_kernel_runs(q, k, v):
        return torch.ops.ember_cpu.prompt_attention(q, k, v, scale, window or 0)
    if start == 0 and (window is None or window >= S):
        return sdpa_attention(q, k, v, None, scale=scale, softcap=softcap)
    if window is not None and window < T and T > PROMPT_CHUNK:
        if torch.compiler.is_compiling():
            return windowed_prompt_attention(q, k, v, window, scale, softcap)
        return _in_chunks(q, k, v, window, scale, softcap)
    if torch.compiler.is_compiling():  # one graph for any length: the whole mask
        return _band_attention(q, k, v, start, 0, window, scale, softcap)
    lo = _first_seen(start, window)
    return _band_attention(q, k[:, :, lo:], v[:, :, lo:], start, lo, window, scale, softcap)


@torch.library.custom_op("ember::windowed_prompt_attention", mutates_args=())
def windowed_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, softcap: float | None
) -> torch.Tensor:
    """`prompt_attention` in chunks, as one op of a compiled graph (whose shapes, dynamic, it cannot loop over)."""
    return _in_chunks(q, k, v, window, scale, softcap)


@windowed_prompt_attention.register_fake
def _(q, k, v, window, scale, softcap):
    return q.new_empty(q.shape)


def _in_chunks(q, k, v, window: int, scale: float, softcap: float | None) -> torch.Tensor:
    """PROMPT_CHUNK query rows a call, each over its band of keys -> (B, H, T, D), contiguous."""
    T, S = q.shape[2], k.shape[2]
    start = S - T
    out = q.new_empty(q.shape)
    for a in range(0, T, PROMPT_CHUNK):
        b = min(T, a + PROMPT_CHUNK)
        lo, hi = _first_seen(start + a, window), start + b
        out[:, :, a:b] = _band_attention(
            q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], start + a, lo, window, scale, softcap
        )
    return out


def _first_seen(position: int, window: int | None) -> int:
    """The first key a query at `position` sees."""
    return 0 if window is None else max(0, position - window + 1)


def _band_attention(q, k, v, q_first, k_first, window, scale, softcap) -> torch.Tensor:
    """q's rows at positions q_first.., k and v's at k_first..; the mask made for what they are."""
    T, S = q.shape[2], k.shape[2]
    if torch.compiler.is_compiling():  # positions as tensors: no guard on the lengths
        q_pos = torch.arange(q_first, q_first + T, device=q.device)[None]
        k_pos = torch.arange(k_first, k_first + S, device=q.device)[None]
        mask = causal_mask(q_pos, k_pos, window)
    else:  # row i sees key j where j <= i + offset (and j > i + offset - window): ~20x faster to make
        offset = q_first - k_first
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(offset)
        if window is not None:
            mask.triu_(offset - window + 1)
    return sdpa_attention(q, k, v, mask, scale=scale, softcap=softcap)


def causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, k_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """q_pos (B, T) and k_pos (B or 1, S) positions -> (B, 1, T, S) bool: key visible to query.

    A key is visible when it is not in the future and, for sliding-window layers, q_pos - k_pos < window.
    """
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # (B, T, S)
    visible = diff >= 0
    if window is not None:
        visible = visible & (diff < window)
    if k_valid is not None:
        visible = visible & k_valid[:, None, :]
    return visible[:, None]  # (B, 1, T, S)


def grouped_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row: q (B, 1, H, D), k and v (B, K, S, D), mask (B, 1, 1, S) -> (B, 1, H, D).

    Plain matmuls and a softmax, with the G = H/K query heads of a kv head as the rows of one matmul (no
    repeated k/v). On CPU this beats SDPA's flash kernel for T=1: ~35 us instead of ~50 us per layer
    (SmolLM2-135M int4, S=256: ~0.5 ms of an ~8.5 ms step), with the scale, mask and softmax fused by inductor.
    """
    B, _, H, D = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, H // K, D)  # (B, K, G, D)
    scores = (qg @ k.transpose(-1, -2)) * scale  # (B, K, G, S)
    scores = scores.masked_fill(~mask, float("-inf"))  # mask (B, 1, 1, S)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ v).view(B, 1, H, D)
