"""The eager decode step on a CPU as a flat run of kernel calls: the module path's ops, without its Python.

An eager step (`ember generate`, `chat` and `bench` on a CPU without an AOTInductor package, and every step of
`ember serve` there) runs each layer through nn.Module calls, keyword plumbing for the CUDA-only layer forms,
and a projection's `forward` choosing its kernel on every call: SmolLM2-135M's 30 layers spent ~4 ms of an
~9 ms step in Python, beside ~4.5 ms of kernels. `EagerCpuStep` is built once per cache. Each projection
becomes its kernel calls with their operands (`QuantLinear.row_kernel`; a float `Linear` is `F.linear`), and
the layers one C++ call (`DecodeLayers`, `ops/csrc/cpu_step.cpp`) that runs them through the dispatcher in the
module path's order: the same ops on the same operands, so the same values bit for bit
(tests/engine/test_cpu_step.py).

It runs decode rows, one token each: one row of a `StaticKVCache` (the Generator's `_forward`), or a
`PagedKVCache`'s batch of them (`ModelRunner.execute`, batches without a prefill, up to `core.FLAT_ROWS`
rows), where attention is Ember's C++ kernel, for decoders whose layers are all a gated MLP and attention
without a logit softcap and whose projections all have a row kernel (not int8 weight-only, nor int4 in
bf16); `build` answers None for anything else, and the module path runs. `EMBER_CPU_STEP=0` keeps the module
path always.

Shape legend: N rows, E hidden size, H query heads, K kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.kv_cache import StaticKVCache
from ember.engine.paged_cache import PagedBatch, PagedKVCache
from ember.models.decoder import ACTIVATIONS, MLP, Decoder
from ember.ops import cpu_ext
from ember.ops.linear import Linear
from ember.ops.norm import RMSNorm
from ember.quant.linear import QuantLinear, RowKernel

ENV = "EMBER_CPU_STEP"  # "0": the module path (for A/B runs)
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
    """module's forward of one row as kernel calls, or None where it has none."""
    if isinstance(module, QuantLinear):
        return module.row_kernel()
    if type(module) in (nn.Linear, Linear):  # Linear's CUDA GEMV aside, F.linear
        return RowKernel((("linear", (module.weight, module.bias)),))
    return None


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


class EagerCpuStep:
    """The eager step's layers and what surrounds them: `__call__` is `Generator._forward` for one decode row of a
    static cache; `paged` the model runner's forward for a paged cache's batch of decode rows."""

    def __init__(self, model: Decoder, program: _Program) -> None:
        self.model = model
        classes = getattr(torch.classes, cpu_ext.NAMESPACE)
        self.layers = classes.DecodeLayers(program.tensors, program.ints, program.reals)

    @classmethod
    def build(cls, model: Decoder, cache: StaticKVCache | PagedKVCache) -> EagerCpuStep | None:
        """The step for this model and cache (a static one of one row, or a paged one), or None where some part
        of it is not one this step runs (the module path runs it)."""
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
        program = _Program.of(model, cache) if fits else None
        return None if program is None else cls(model, program)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens, positions (1, 1) -> float32 logits (1, V)."""
        x, tables = self._inputs(tokens, positions, None)
        h = self.layers.run(x, *tables, positions[:, 0])  # (1, E)
        return self.model.compute_logits(h)  # (1, V)

    def paged(self, tokens: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """A paged batch of decode rows only (one token each; `batch.prefills` empty): tokens (1, N) -> the final
        norm's rows (N, E), as the model's forward gives them (`Decoder.forward`; `ModelRunner.execute`)."""
        x, tables = self._inputs(tokens, batch.positions, batch.lengths)
        slots = cache._slots(batch.decode_tables)  # (N, S): what `PagedKVCache.begin` gives its attention
        return self.layers.run_paged(x, *tables, batch.slot_mapping, slots, batch.decode_lens - 1)

    def _inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The rows' embeddings (N, E) and rope tables (cos, sin, local cos, local sin: (N, D/2) each), as
        `Decoder.forward` makes them."""
        model, cfg = self.model, self.model.config
        x = model.model.embed_tokens(tokens)[0]  # (N, E)
        if cfg.embedding_multiplier != 1.0:
            # Gemma rounds sqrt(E) to the activation dtype before scaling (as `Decoder.forward`)
            x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
        cos, sin = model.rope(positions, lengths)
        local_cos, local_sin = (
            model.local_rope(positions, lengths) if model.local_rope is not None else (cos, sin)
        )
        return x, (cos[0], sin[0], local_cos[0], local_sin[0])
