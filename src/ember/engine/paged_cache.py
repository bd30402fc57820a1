"""The paged KV cache: a pool of fixed-size blocks per layer, read through per-request block tables.

A batch is packed: the tokens of all scheduled requests form one (1, N) row — a prefill chunk of many tokens
for some requests, one token for each decoding request. `PagedBatch` says where each request's tokens sit,
its block table and how many tokens its context holds after this step.

Attention runs in two groups: all single-token (decode) requests together — their k/v gathered through
their block tables into (B, K, S, D) and one SDPA call, or on CPUs Ember's C++ kernel, which reads each row's
visible slots where its table puts them (`ember_cpu::paged_decode_attention`, tested against the static
cache's) — and each multi-token (prefill) segment on its own.
Both go through `ops.attention.sdpa_attention`, the same reference the static cache uses, and the tests
compare this cache with the static one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember import huge_pages
from ember.config import ModelConfig
from ember.ops import cpu_ext
from ember.ops.attention import causal_mask, prompt_attention, sdpa_attention
from ember.ops.rope import apply_rope_qk


@dataclass
class PagedBatch:
    """Where each request's tokens lie in the packed step, built by the model runner."""

    slot_mapping: torch.Tensor  # (N,) int64: cache slot (block * block_size + offset) for each token
    positions: torch.Tensor  # (1, N) int64
    lengths: torch.Tensor  # (1, N) int64: each token's sequence length (prompt and tokens so far)
    # Decode group: packed indices of the single-token requests, their block tables and context lengths.
    decode_index: torch.Tensor  # (Bd,) int64
    decode_tables: torch.Tensor  # (Bd, max_blocks) int64, padded with 0 (the padding sink)
    decode_lens: torch.Tensor  # (Bd,) int64: tokens in context including this step's
    # Prefill segments: (start in the packed row, number of tokens, block table (nb,), context length).
    prefills: list[tuple[int, int, torch.Tensor, int]]


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)  # (slots, K, D)
        self.k = [huge_pages.zeros(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.v = [huge_pages.zeros(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.batch: PagedBatch | None = None
        self._masks: dict = {}
        self._decode_slots: torch.Tensor | None = None
        self._prefill_slots: list[torch.Tensor] = []
        self.windows = {cfg.window(i) for i in range(cfg.num_layers)}
        self._cpu_attention = (
            self.device.type == "cpu" and cpu_ext.available()
        )  # Ember's C++ decode attention

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def set_batch(self, batch: PagedBatch) -> None:
        self.batch = batch

    def sequence_lengths(self) -> torch.Tensor:
        assert self.batch is not None, "PagedKVCache.set_batch() must run before the forward"
        return self.batch.lengths

    def _slots(self, tables: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """Block tables (B, nb) -> the cache slots of their tokens (B, S), S = nb * block_size (or `length`)."""
        offsets = torch.arange(self.block_size, device=self.device)
        slots = (tables[:, :, None] * self.block_size + offsets).flatten(1)  # (B, S)
        return slots if length is None else slots[:, :length]

    def begin(self, positions: torch.Tensor) -> None:
        """Per step, not per layer: the slots each group reads and the masks for each window."""
        b = self.batch
        assert b is not None, "PagedKVCache.set_batch() must run before the forward"
        self._masks = {}
        self._decode_slots = None
        if len(b.decode_index):
            self._decode_slots = self._slots(b.decode_tables)  # (Bd, S)
            k_pos = torch.arange(self._decode_slots.shape[1], device=self.device)[None]  # (1, S)
            q_pos = (b.decode_lens - 1)[:, None]  # (Bd, 1)
            for w in self.windows:
                self._masks[("decode", w)] = causal_mask(q_pos, k_pos, w)  # (Bd, 1, 1, S)
        # A prefill's n tokens are the last of its sequence's ctx (positions ctx - n .. ctx - 1), as
        # `prompt_attention` takes them; these are the slots of all ctx, (1, ctx) each.
        self._prefill_slots = [self._slots(table[None], ctx) for *_, table, ctx in b.prefills]

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
        """q (1, N, H, D), k and v (1, N, K, D) packed, q and k before rope (cos, sin) -> (1, N, H, D). ahead:
        `StaticKVCache.attend`'s L2 hint, which these kernels do not take."""
        b = self.batch
        assert b is not None
        k_pool, v_pool = self.k[layer], self.v[layer]
        if self._cpu_attention and cpu_ext.eager_inference():
            cos, sin = rope  # eager: the rope and the writes in one call
            q = torch.ops.ember_cpu.rope_write(
                q[0], k[0], v[0], cos[0], sin[0], k_pool, v_pool, b.slot_mapping
            )[None]
        else:
            q, k = apply_rope_qk(q, k, *rope)
            k_pool[b.slot_mapping] = k[0]
            v_pool[b.slot_mapping] = v[0]
        out = torch.empty_like(q[0])  # (N, H, D)
        if self._decode_slots is not None and softcap is None and self._cpu_attention:
            out[b.decode_index] = torch.ops.ember_cpu.paged_decode_attention(
                q[0, b.decode_index],
                k_pool,
                v_pool,
                self._decode_slots,
                b.decode_lens - 1,
                scale,
                window or 0,
            )  # (Bd, H, D): only each row's visible slots, where its block table puts them
        elif self._decode_slots is not None:
            qd = q[0, b.decode_index][:, :, None]  # (Bd, H, 1, D)
            kd = k_pool[self._decode_slots].transpose(1, 2)  # (Bd, K, S, D)
            vd = v_pool[self._decode_slots].transpose(1, 2)
            od = sdpa_attention(qd, kd, vd, self._masks[("decode", window)], scale=scale, softcap=softcap)
            out[b.decode_index] = od[:, :, 0]
        for i, (start, n, _, _) in enumerate(b.prefills):
            qp = q[:, start : start + n].transpose(1, 2)  # (1, H, n, D)
            kp = k_pool[self._prefill_slots[i]].transpose(1, 2)  # (1, K, ctx, D)
            vp = v_pool[self._prefill_slots[i]].transpose(1, 2)
            op = prompt_attention(qp, kp, vp, window=window, scale=scale, softcap=softcap)
            out[start : start + n] = op[0].transpose(0, 1)
        return out[None]
