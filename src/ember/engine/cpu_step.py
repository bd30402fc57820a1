"""The eager decode step on a CPU as a flat run of kernel calls: the module path's ops, without its Python.

An eager step (`ember generate`, `chat` and `bench` on a CPU without an AOTInductor package) runs each layer
through nn.Module calls, keyword plumbing for the CUDA-only layer forms, and a projection's `forward` choosing
its kernel on every call: SmolLM2-135M's 30 layers spent ~4 ms of an ~9 ms step in Python, around ~4.5 ms of
kernels. `EagerCpuStep` is built once per cache: each projection becomes one bound kernel call
(`QuantLinear.row_kernel`; a float `Linear` is `F.linear`; any other module is called as it is), each norm
Ember's C++ norm kernel with its operands bound, and a layer a short run of those calls over one row. The
ops, their order and their operands are the module path's, so the logits are the same bit for bit
(tests/engine/test_cpu_step.py).

It runs one row at a position (B = T = 1) of a `StaticKVCache` whose attention is Ember's C++ kernel, for
decoders whose layers are all a gated MLP and attention without a logit softcap; `build` answers None for
anything else, and the Generator keeps the module path.

Shape legend: E hidden size, H query heads, K kv heads, D head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.kv_cache import StaticKVCache
from ember.models.decoder import ACTIVATIONS, MLP, Decoder, DecoderLayer
from ember.ops import cpu_ext
from ember.ops.linear import Linear
from ember.ops.norm import RMSNorm
from ember.quant.linear import QuantLinear, RowKernel

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
    def of(cls, model: Decoder, cache: StaticKVCache) -> _Program | None:
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


class _Layer:
    """One layer's calls, bound."""

    def __init__(self, layer: DecoderLayer, index: int, cache: StaticKVCache) -> None:
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
        self.placement = layer.placement
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

    def attend(
        self, n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """Attention's output projection of the normed row n (1, E) -> (1, E), this step's k, v cached."""
        H, K, D = self.H, self.K, self.D
        q, k, v = self.qkv(n).split([H * D, K * D, K * D], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(1, H, D), k.view(1, K, D), v.view(1, K, D)  # (1, H, D), (1, K, D), (1, K, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        out = torch.ops.ember_cpu.rope_decode_attention.default(
            q, k, v, cos, sin, self.k_cache, self.v_cache, pos, self.scale, self.window
        )  # (1, H, D)
        return self.o(out.view(1, H * D))

    def mlp(self, n: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(n).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class EagerCpuStep:
    """`Generator._forward` for one decode row on a CPU: tokens, positions (1, 1) -> float32 logits (1, V)."""

    def __init__(self, model: Decoder, cache: StaticKVCache, native: bool = True) -> None:
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
    def build(cls, model: Decoder, cache: StaticKVCache, native: bool = True) -> EagerCpuStep | None:
        """The step for this model and cache, or None where some part of it is not one this step runs."""
        cfg = model.config
        activations = model.model.norm.weight.dtype
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        fits = (
            cache.batch_size == 1
            and cache._cpu_attention
            and cfg.norm_placement in ("pre", "sandwich", "post")
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
        model, cfg = self.model, self.model.config
        x = model.model.embed_tokens(tokens).view(1, -1)  # (1, E)
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds sqrt(E) to the activation dtype before scaling (as `Decoder.forward`)
            x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
        cos, sin = model.rope(positions, None)
        tables = {False: (cos[:, 0], sin[:, 0])}
        if model.local_rope is not None:
            local = model.local_rope(positions, None)
            tables[True] = (local[0][:, 0], local[1][:, 0])
        else:
            tables[True] = tables[False]
        pos = positions[:, 0]
        if self.native is not None:
            h = self.native.run(x, *tables[False], *tables[True], pos)
        elif self.placement == "pre":
            h = self._pre(x, tables, pos)
        else:
            h = x
            for layer in self.layers:
                cs = tables[layer.local]
                if self.placement == "sandwich":
                    h = h + layer.post_norm(layer.attend(layer.input_norm(h), *cs, pos))
                    h = h + layer.post_ff_norm(layer.mlp(layer.pre_ff_norm(h)))
                else:  # post
                    h = h + layer.post_norm(layer.attend(h, *cs, pos))
                    h = h + layer.post_ff_norm(layer.mlp(h))
            h = self.final_norm(h)
        return model.compute_logits(h)  # (1, V)

    def _pre(self, x: torch.Tensor, tables: dict, pos: torch.Tensor) -> torch.Tensor:
        """Pre-norm layers, each add done by the norm after it (as `DecoderLayer.forward_pre`) -> the final norm's row."""
        h, delta = x, None
        for layer in self.layers:
            if delta is None:
                n = layer.input_norm(h)
            else:
                h, n = layer.add_input_norm(h, delta)
            a = layer.attend(n, *tables[layer.local], pos)
            m = layer.m
            h, n = layer.add_post_norm(h, a * m if m != 1.0 else a)
            f = layer.mlp(n)
            delta = f * m if m != 1.0 else f
        return self.add_final_norm(h, delta)[1]
