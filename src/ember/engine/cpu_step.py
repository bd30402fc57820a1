"""The eager decode step on a CPU as a flat run of kernel calls: the module path's ops, without its Python.

An eager step (`ember generate`, `chat` and `bench` on a CPU without an AOTInductor package, and every step of
`ember serve` there) runs each layer through nn.Module calls, keyword plumbing for the CUDA-only layer forms,
and a projection's `forward` choosing its kernel on every call: SmolLM2-135M's 30 layers spent ~4 ms of an
~9 ms step in Python, beside ~4.5 ms of kernels. `EagerCpuStep` is built once per cache. Each projection
becomes its kernel calls with their operands (`QuantLinear.row_kernel`; a float `Linear` is `F.linear`), and
the layers one C++ call (`DecodeLayers`, `ops/csrc/cpu_step.cpp`) that runs them through the dispatcher in the
module path's order: the same ops on the same operands, so the same values bit for bit
(tests/engine/test_cpu_step.py). Where some projection has no row kernel (int8 weight-only, a bf16 int4) the
same calls run from Python, that module called as it is. `EMBER_CPU_STEP=0` keeps the module path.

It runs decode rows, one token each: one row of a `StaticKVCache` (the Generator's `_forward`), or a
`PagedKVCache`'s batch of them (`ModelRunner.execute`, batches without a prefill, up to `core.FLAT_ROWS`
rows), where attention is Ember's C++ kernel, for decoders whose layers are all a gated MLP and attention
without a logit softcap; `build` answers None for anything else, and the module path runs.

Shape legend: N rows, E hidden size, H query heads, K kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.kv_cache import StaticKVCache
from ember.engine.paged_cache import PagedBatch, PagedKVCache
from ember.models.decoder import ACTIVATIONS, MLP, Decoder, DecoderLayer
from ember.ops import cpu_ext
from ember.ops.linear import Linear
from ember.ops.norm import RMSNorm
from ember.quant.linear import QuantLinear, RowKernel

ENV = "EMBER_CPU_STEP"  # "0": the module path (for A/B runs)
RowFn = Callable[[torch.Tensor], torch.Tensor]
# The program's kernel names, in the order of `cpu_step.cpp`'s `Kernel`.
KERNELS = (
    "linear",
    "int4_gemv_f32",
    "int4_gemv",
    "int8_gemv_f32",
    "int5_gemv_f32",
    "int6_gemv_f32",
    "int8_gemv",
)
ACTS = {id(F.silu): 0, id(ACTIVATIONS["gelu_pytorch_tanh"]): 1, id(ACTIVATIONS["gelu_new"]): 1, id(F.gelu): 2}
PLACEMENTS = ("pre", "sandwich", "post")
QK_NORMS = (None, "head", "full")


def row_kernel(module: nn.Module) -> RowKernel | None:
    """module's forward of one row as kernel calls, or None (the module is called as it is)."""
    if isinstance(module, QuantLinear):
        return module.row_kernel()
    if type(module) in (nn.Linear, Linear):  # Linear's CUDA GEMV aside, F.linear
        return RowKernel((("linear", (module.weight, module.bias)),))
    return None


def bind(kernel: RowKernel) -> RowFn:
    """The kernel calls as one function of the row."""

    def one(op: str, operands: tuple) -> RowFn:
        if op == "linear":
            return lambda x: F.linear(x, *operands)
        fn = getattr(torch.ops.ember_cpu, op).default
        return lambda x: fn(x, *operands)

    calls = [one(op, operands) for op, operands in kernel.calls]
    joined = calls[0] if len(calls) == 1 else lambda x: torch.cat([c(x) for c in calls], dim=-1)
    bias = kernel.bias
    return joined if bias is None else lambda x: joined(x) + bias


def row_call(module: nn.Module) -> RowFn:
    """module's forward of one row (1, K) -> (1, N) as the leanest call that gives its values."""
    kernel = row_kernel(module)
    return module if kernel is None else bind(kernel)


def norm_call(norm: RMSNorm) -> RowFn:
    op, weight, eps, offset = torch.ops.ember_cpu.rms_norm.default, norm.weight, norm.eps, norm.offset
    return lambda x: op(x, weight, eps, offset)


def add_norm_call(norm: RMSNorm) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(x, delta) -> (x + delta, norm(x + delta)): one kernel."""
    op, weight, eps, offset = torch.ops.ember_cpu.add_rms_norm.default, norm.weight, norm.eps, norm.offset
    return lambda x, delta: op(x, delta, weight, eps, offset)


class _Program:
    """A model's layers as `cpu_step.cpp`'s `DecodeLayers` reads them: ints (kernels, counts, flags and indices
    into `tensors`, -1 for None) and floats, in the order its constructors read them."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.ints: list[int] = []
        self.reals: list[float] = []
        self._index: dict[int, int] = {}

    def tensor(self, t: torch.Tensor | None) -> None:
        if t is None:
            self.ints.append(-1)
            return
        if id(t) not in self._index:
            self._index[id(t)] = len(self.tensors)
            self.tensors.append(t)
        self.ints.append(self._index[id(t)])

    def norm(self, norm: RMSNorm) -> None:
        self.tensor(norm.weight)
        self.reals += [float(norm.eps), float(norm.offset)]

    def projection(self, kernel: RowKernel) -> None:
        self.ints.append(len(kernel.calls))
        for op, operands in kernel.calls:
            self.ints += [KERNELS.index(op), len(operands)]
            for a in operands:
                if isinstance(a, int):
                    self.ints += [1, a]
                else:
                    self.ints.append(0)
                    self.tensor(a)
        self.tensor(kernel.bias)

    @classmethod
    def of(cls, model: Decoder, cache: StaticKVCache | PagedKVCache) -> _Program | None:
        """The program, or None where a projection has no row kernel or an activation is not one it names."""
        p = cls()
        placement = model.config.norm_placement
        layers = model.model.layers
        p.ints += [PLACEMENTS.index(placement), len(layers)]
        p.norm(model.model.norm)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            kernels = [row_kernel(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(k is None for k in kernels) or id(mlp.act) not in ACTS:
                return None
            p.ints += [
                attn.H,
                attn.K,
                attn.D,
                QK_NORMS.index(attn.qk_norm),
                attn.window or 0,
                ACTS[id(mlp.act)],
            ]
            p.ints.append(int(layer.uses_local_rope))
            p.reals += [float(attn.scale), float(layer.residual_multiplier)]
            if attn.qk_norm is not None:
                p.norm(attn.q_norm)
                p.norm(attn.k_norm)
            if placement != "post":
                p.norm(layer.input_layernorm)
            p.norm(layer.post_attention_layernorm)
            if placement == "sandwich":
                p.norm(layer.pre_feedforward_layernorm)
            if placement != "pre":
                p.norm(layer.post_feedforward_layernorm)
            p.tensor(cache.k[i])
            p.tensor(cache.v[i])
            for k in kernels:
                p.projection(k)
        return p


@dataclass
class _Step:
    """What a step's layers share (`cpu_step.cpp`'s `Step`): the rows' rope tables (local ones for sliding-window
    layers) and where keys and values go: a static cache's positions, or a paged cache's slots."""

    tables: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # uses local rope -> (cos, sin), (N, D/2) each
    positions: torch.Tensor  # (N,)
    slot_mapping: torch.Tensor | None = None  # paged: (N,) slots this step writes
    decode_slots: torch.Tensor | None = None  # paged: (N, S) the slots each row reads


class _Layer:
    """One layer's calls, bound: the Python twin of `DecodeLayers`, for models with a projection that has no
    row kernel."""

    def __init__(self, layer: DecoderLayer, index: int, cache: StaticKVCache | PagedKVCache) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.H, self.K, self.D = attn.H, attn.K, attn.D
        self.qkv, self.o = row_call(attn.qkv_proj), row_call(attn.o_proj)
        self.gate_up, self.down, self.act = row_call(mlp.gate_up_proj), row_call(mlp.down_proj), mlp.act
        self.qk_norm = attn.qk_norm
        if attn.qk_norm is not None:
            self.q_norm, self.k_norm = norm_call(attn.q_norm), norm_call(attn.k_norm)
        self.k_cache, self.v_cache = cache.k[index], cache.v[index]
        self.scale, self.window = attn.scale, attn.window or 0
        self.local = layer.uses_local_rope
        self.m = layer.residual_multiplier
        if layer.placement == "pre":
            self.add_input_norm = add_norm_call(layer.input_layernorm)
            self.add_post_norm = add_norm_call(layer.post_attention_layernorm)
        if layer.placement in ("pre", "sandwich"):
            self.input_norm = norm_call(layer.input_layernorm)
        self.post_norm = norm_call(layer.post_attention_layernorm)
        if layer.placement == "sandwich":
            self.pre_ff_norm = norm_call(layer.pre_feedforward_layernorm)
        if layer.placement in ("sandwich", "post"):
            self.post_ff_norm = norm_call(layer.post_feedforward_layernorm)

    def attend(self, n: torch.Tensor, step: _Step) -> torch.Tensor:
        """Attention of the normed rows n (N, E), this step's k, v cached, through the output projection."""
        N, H, K, D = n.shape[0], self.H, self.K, self.D
        cos, sin = step.tables[self.local]
        q, k, v = self.qkv(n).split_with_sizes([H * D, K * D, K * D], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(N, H, D), k.view(N, K, D), v.view(N, K, D)  # (N, H, D), (N, K, D), (N, K, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        ops = torch.ops.ember_cpu
        if step.slot_mapping is not None:
            q = ops.rope_write.default(q, k, v, cos, sin, self.k_cache, self.v_cache, step.slot_mapping)
            out = ops.paged_decode_attention.default(
                q, self.k_cache, self.v_cache, step.decode_slots, step.positions, self.scale, self.window
            )  # (N, H, D)
        else:
            out = ops.rope_decode_attention.default(
                q, k, v, cos, sin, self.k_cache, self.v_cache, step.positions, self.scale, self.window
            )  # (N, H, D)
        return self.o(out.view(N, H * D))

    def mlp(self, n: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(n).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class EagerCpuStep:
    """The eager step's layers and what surrounds them: `__call__` is `Generator._forward` for one decode row of a
    static cache; `paged` the model runner's forward for a paged cache's batch of decode rows."""

    def __init__(self, model: Decoder, cache: StaticKVCache | PagedKVCache, native: bool = True) -> None:
        """native: the layers as one C++ call (`DecodeLayers`) where every projection has a row kernel; else (or
        False) as Python calls of the same ops."""
        self.model = model
        self.placement = model.config.norm_placement
        program = _Program.of(model, cache) if native else None
        self.native = None
        if program is not None:
            classes = getattr(torch.classes, cpu_ext.NAMESPACE)
            self.native = classes.DecodeLayers(program.tensors, program.ints, program.reals)
            return
        self.layers = [_Layer(layer, i, cache) for i, layer in enumerate(model.model.layers)]
        self.final_norm = norm_call(model.model.norm)
        self.add_final_norm = add_norm_call(model.model.norm)

    @classmethod
    def build(
        cls, model: Decoder, cache: StaticKVCache | PagedKVCache, native: bool = True
    ) -> EagerCpuStep | None:
        """The step for this model and cache (a static one of one row, or a paged one), or None where some part
        of it is not one this step runs."""
        if os.environ.get(ENV) == "0":
            return None
        cfg = model.config
        activations = model.model.norm.weight.dtype
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        fits = (
            (isinstance(cache, PagedKVCache) or cache.batch_size == 1)
            and cache._cpu_attention
            and cfg.norm_placement in PLACEMENTS
            and activations in (torch.float32, torch.bfloat16)
            and cache.k[0].dtype == activations
            and all(n.weight.dtype == activations for n in norms)
            and all(
                type(layer.mlp) is MLP and layer.self_attn.softcap is None for layer in model.model.layers
            )
            and cpu_ext.available()
        )
        return cls(model, cache, native) if fits else None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens, positions (1, 1) -> float32 logits (1, V)."""
        h = self._forward(tokens, positions, None, positions[:, 0], None, None)
        return self.model.compute_logits(h)  # (1, V)

    def paged(self, tokens: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """A paged batch of decode rows only (one token each; `batch.prefills` empty): tokens (1, N) -> the final
        norm's rows (N, E), as the model's forward gives them (`Decoder.forward`; `ModelRunner.execute`)."""
        cache.begin(
            batch.positions
        )  # each row's slots (`_decode_slots`), as the module path's attention reads
        positions = batch.decode_lens - 1  # (N,)
        return self._forward(tokens, batch.positions, batch.lengths, positions, batch.slot_mapping, cache)

    def _forward(self, tokens, positions, lengths, rows_positions, slot_mapping, paged) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        x = model.model.embed_tokens(tokens)[0]  # (N, E)
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds sqrt(E) to the activation dtype before scaling (as `Decoder.forward`)
            x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
        cos, sin = model.rope(positions, lengths)
        tables = {False: (cos[0], sin[0])}  # (N, D/2) each
        if model.local_rope is not None:
            local_cos, local_sin = model.local_rope(positions, lengths)
            tables[True] = (local_cos[0], local_sin[0])
        else:
            tables[True] = tables[False]
        decode_slots = None if paged is None else paged._decode_slots
        if self.native is not None:
            if paged is None:
                return self.native.run(x, *tables[False], *tables[True], rows_positions)
            return self.native.run_paged(
                x, *tables[False], *tables[True], slot_mapping, decode_slots, rows_positions
            )
        step = _Step(tables, rows_positions, slot_mapping, decode_slots)
        if self.placement == "pre":
            return self._pre(x, step)
        h = x
        for layer in self.layers:
            if self.placement == "sandwich":
                h = h + layer.post_norm(layer.attend(layer.input_norm(h), step))
                h = h + layer.post_ff_norm(layer.mlp(layer.pre_ff_norm(h)))
            else:  # post
                h = h + layer.post_norm(layer.attend(h, step))
                h = h + layer.post_ff_norm(layer.mlp(h))
        return self.final_norm(h)

    def _pre(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """Pre-norm layers, each add done by the norm after it (as `DecoderLayer.forward_pre`) -> the final norm's
        rows."""
        h, delta = x, None
        for layer in self.layers:
            if delta is None:
                n = layer.input_norm(h)
            else:
                h, n = layer.add_input_norm(h, delta)
            a = layer.attend(n, step)
            m = layer.m
            h, n = layer.add_post_norm(h, a * m if m != 1.0 else a)
            f = layer.mlp(n)
            delta = f * m if m != 1.0 else f
        return self.add_final_norm(h, delta)[1]
