"""The static KV cache: one preallocated (B, K, S, D) buffer per layer, written at the tokens' positions.

Static shapes make the decode step compile to one graph (and one CUDA graph): every step attends over all S
slots, and a mask hides the slots after the query's position (and, for sliding-window layers, those
`window` or more positions behind it). Rows of a batch may sit at different positions. Decode steps (one token
per row) read only the slots up to each row's position: on CUDA with `ember::decode_attention`, a Triton
kernel; on CPUs with `ember_cpu::decode_attention`, Ember's C++ kernel (`ember.ops.cpu_ext`; SmolLM2's 2-core
step spent ~1.3 ms of ~4.5 in the masked matmuls over every slot, ~0.5 ms in it), or where that is not built
`grouped_decode_attention`, plain matmuls over every slot that beat SDPA's kernel there.

A cache made with `prompts_from_start` (the Generator's, perplexity's) is promised that every forward of more
than one token a row is a whole prompt at positions 0..T-1: that forward attends over its own T slots only,
causally (masked only where a sliding window hides part of the prompt), not over all S behind a mask. A
128-token prompt in a 2048-slot cache then reads a sixteenth of the keys, and SDPA skips the blocks above the
diagonal: SmolLM2's compiled CPU prefill, 2 threads, 361 -> 605 tok/s (BENCHMARKS.md).
"""

from __future__ import annotations

import copy

import torch

from ember import huge_pages
from ember.config import ModelConfig
from ember.ops import cpu_ext
from ember.ops.attention import causal_mask, grouped_decode_attention, prompt_attention, sdpa_attention
from ember.ops.decode_attention import decode_attention as cuda_decode_attention
from ember.ops.rope import apply_rope_qk

# Whether an eager CPU prompt's rope and cache writes are one call (`ember_cpu::rope_prompt_write`; False: the
# torch ops, to compare).
PROMPT_ROPE_KERNEL = True


class StaticKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        batch_size: int,
        max_seq_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        prompts_from_start: bool = False,
    ) -> None:
        shape = (batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim)  # (B, K, S, D)
        self.k = [huge_pages.zeros(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.v = [huge_pages.zeros(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.prompts_from_start = prompts_from_start
        self.windows = sorted(
            {cfg.window(i) for i in range(cfg.num_layers)}, key=lambda w: (w is None, w or 0)
        )
        self._slots = torch.arange(max_seq_len, device=device)[None]  # (1, S)
        self._positions: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # (B, 1) row indices of the positions given to `begin`
        self._masks: dict[int | None, torch.Tensor] = {}
        self._cpu_attention = torch.device(device).type == "cpu" and cpu_ext.available()

    def with_tensors(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> StaticKVCache:
        """This cache's layout over other (B, K, S, D) tensors, of any S: an exported step takes them as inputs."""
        view = copy.copy(self)
        view.k, view.v = k, v
        view.max_seq_len = k[0].shape[2]
        view._slots = torch.arange(view.max_seq_len, device=k[0].device)[None]  # (1, S)
        return view

    def sequence_lengths(self) -> None:
        return None  # one sequence a row

    def begin(self, positions: torch.Tensor) -> None:
        """Called once per forward with positions (B, T): builds each window's mask once for all layers (a
        prompt from slot 0 needs one only where a window hides part of it; see `prompts_from_start`)."""
        self._positions = positions
        self._rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        T = positions.shape[1]
        if self._whole_prompt(T):
            self._masks = {}  # `prompt_attention` makes what it needs
        else:
            self._masks = {w: causal_mask(positions, self._slots, w) for w in self.windows}

    def _whole_prompt(self, T: int) -> bool:
        return self.prompts_from_start and T > 1

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor],
        window: int | None,
        scale: float,
        softcap: float | None,
        ahead: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over this layer's cache after storing k, v at the positions given to `begin`. ahead:
        weights read after attention (a hint for the one-row CUDA kernel: `cuda_attention.AHEAD_BYTES`)."""
        pos = self._positions
        assert pos is not None, "StaticKVCache.begin(positions) must run before the forward"
        B, T, H, D = q.shape
        if T == 1 and softcap is None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            # One kernel: rope, this step's cache write, attention over the slots up to each position; it also
            # hints the next layer's cache into L2.
            cos, sin = rope
            nxt = layer + 1 if layer + 1 < len(self.k) else None
            out = cuda_decode_attention(
                q.view(B, H, D),
                k.view(B, -1, D),
                v.view(B, -1, D),
                cos[:, 0],
                sin[:, 0],
                self.k[layer][:B],
                self.v[layer][:B],
                pos[:, 0],
                scale,
                window or 0,
                None if nxt is None else self.k[nxt][:B],
                None if nxt is None else self.v[nxt][:B],
                ahead,
            )  # (B, H, D)
            return out.unsqueeze(1)
        if T == 1 and softcap is None and self._cpu_attention and cpu_ext.eager_inference():
            # rope, this step's cache writes and attention in one call
            cos, sin = rope
            out = torch.ops.ember_cpu.rope_decode_attention(
                q.reshape(B, H, D), k.reshape(B, -1, D), v.reshape(B, -1, D), cos[:, 0], sin[:, 0],
                self.k[layer], self.v[layer], pos[:, 0], scale, window or 0,
            )  # fmt: skip
            return out.unsqueeze(1)
        if T > 1 and PROMPT_ROPE_KERNEL and self._cpu_attention and cpu_ext.eager_inference():  # one call
            q, k = torch.ops.ember_cpu.rope_prompt_write(q, k, v, *rope, self.k[layer], self.v[layer], pos)
        else:
            q, k = apply_rope_qk(q, k, *rope)
            rows = self._rows
            self.k[layer][rows, :, pos] = k  # k (B, T, K, D) lands at cache[b, :, pos[b, t]]
            self.v[layer][rows, :, pos] = v
        if T == 1 and softcap is None and self._cpu_attention:
            out = torch.ops.ember_cpu.decode_attention(
                q.reshape(B, H, D), self.k[layer][:B], self.v[layer][:B], pos[:, 0], scale, window or 0
            )  # (B, H, D)
            return out.unsqueeze(1)
        if T == 1 and softcap is None and q.device.type == "cpu":  # CPU decode (measured there only)
            k_all, v_all, mask = self.k[layer][:B], self.v[layer][:B], self._masks[window][:B]
            return grouped_decode_attention(q, k_all, v_all, mask, scale)
        if self._whole_prompt(T):  # its own T slots; causal unless a window hides part of them
            out = prompt_attention(
                q.transpose(1, 2),  # (B, H, T, D)
                k.transpose(1, 2),  # (B, K, T, D), what was just written to slots 0..T-1
                v.transpose(1, 2),
                window=window,
                scale=scale,
                softcap=softcap,
            )
            return out.transpose(1, 2)  # (B, T, H, D)
        out = sdpa_attention(
            q.transpose(1, 2),  # (B, H, T, D)
            self.k[layer][:B],
            self.v[layer][:B],
            self._masks[window][:B],
            scale=scale,
            softcap=softcap,
        )
        return out.transpose(1, 2)  # (B, T, H, D)
