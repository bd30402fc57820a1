"""Quantized replacements for nn.Linear: int8 and int4 weight-only, and int8 dynamic activations (CPU).

Each module keeps a device-neutral canonical form in its state dict, which is what `ember.quant.save` writes:

- `Int8WeightOnlyLinear`: `qweight` int8 (N, K), `scales` (N,) float32; w = q * scale (symmetric, per channel).
- `Int4WeightOnlyLinear`: `qweight` uint8 (N, K/2), two 4-bit codes per byte (low nibble = even k),
  `scales` and `mins` (N, K/g); w = q * scale + min with q in [0, 15] (asymmetric, groups of g along K; the
  same grid as GGUF's Q4_1, so Q4_1 blocks convert without loss when g = 32).
- `Int8DynActLinear`: int8 weights as above, and each activation row quantized to int8 on the fly, so the
  matmul is int8 x int8 -> int32 (`torch._int_mm`, VNNI on x86 CPUs).

`prepare()` builds what a device's kernel wants from the canonical form (the packed int4 layout of
`_weight_int4pack_mm_for_cpu`, say) as non-persistent buffers; call it after moving the module. Matmuls go
through `ember.quant.kernels`, whose ops run Triton on CUDA and a plain-torch twin elsewhere.

Shape legend: N output features, K input features, g group size, M rows of activations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.compiler import is_compiling

from ember.ops import cpu_ext, cuda_rtc
from ember.quant import cuda_int4, kernels


def _cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), from /proc/cpuinfo (other
    systems answer False); EMBER_CPU_BF16=0 or 1 decides instead."""
    forced = os.environ.get("EMBER_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(cpu_ext.cpu_flags() & {"avx512_bf16", "amx_bf16"})


# The dtype of the GEMMs below, decided at import (a compiled forward reads it as a constant): bf16 where the
# CPU multiplies it natively, else float32. A 2-core Zen 4 (AVX512-BF16) runs oneDNN's bf16 GEMM at 2.2-2.6x
# MKL's float32 rate at SmolLM2's shapes and 128 rows, and SmolLM2's int4-g32 compiled prefill at 1.7x
# (BENCHMARKS.md); without the instructions bf16 is emulated, slower than float32.
CPU_GEMM_DTYPE: torch.dtype = torch.bfloat16 if _cpu_has_bf16() else torch.float32
# From this many rows a compiled CPU forward of an int4 (where Ember's CPU kernel is not built) or int8
# weight-only projection dequantizes its weights (one fused inductor pass) and runs a GEMM in CPU_GEMM_DTYPE
# instead of torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`, whose time grows about linearly
# with the rows. float32 GEMMs (2-core Xeon, SmolLM2's projections, 2 threads) win from 96 rows (int4:
# 1.1-1.3x faster at 96, 1.3-1.5x at 128, 2.0-2.2x at 512, even to slower at 64; int8: 1.5-1.9x at 128,
# 2.1-2.4x at 512); bf16 GEMMs (2-core Zen 4) from 64 (int4: 1.15-1.5x at 64, 1.4-1.7x at 96; even at 48,
# slower at 32). Eager, the unfused dequantize costs more than it saves.
CPU_DEQUANT_ROWS = 64 if CPU_GEMM_DTYPE is torch.bfloat16 else 96
# Below this many rows that path multiplies int4 weights as two halves of K (even and odd k: the nibbles as they
# lie, dequantized in one fused pass) instead of interleaving them back, which inductor does in a separate
# copy (SmolLM2 int4-g32 compiled prefill, same machine: 691-720 -> 791-847 tok/s at 128 tokens, even at 512,
# 3-7% slower at 1024 where two half-K GEMMs lose more than the copy costs).
HALVES_ROWS = 512


def round_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 t rounded to bf16 (to nearest, ties to even; finite values), kept in float32. In integer ops:
    inductor drops a .to(bfloat16).float() round trip as a no-op."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)


def float32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the contiguous float32 rows Ember's CPU kernels take (x itself where it is: a no-op call costs ~1 us
    in an eager step)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def cpu_float_gemm(x: torch.Tensor) -> bool:
    """Whether a forward on rows x (M, K) takes `float_gemm_as_kernel` (see CPU_DEQUANT_ROWS)."""
    return x.is_cpu and x.shape[0] >= CPU_DEQUANT_ROWS and is_compiling()


def float_gemm_as_kernel(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    scales: torch.Tensor | None = None,
):
    """x (M, K) @ weight (N, K) float32 .T (times per-row `scales` after the sum) with torch's CPU weight-only
    kernels' rounding of the activations and the result (bf16), in float32. Compiled, inductor fuses the
    weight's dequantize into one vectorized pass and the rest is one GEMM, in `CPU_GEMM_DTYPE` (bf16: the
    weights rounded to bf16 as well, float32 sums). `weight` may also be the pair (N, K/2) of its columns at
    even and at odd k, multiplied by x's even and odd columns: int4 nibbles dequantize into those contiguous
    halves, where interleaving them back costs inductor an unfused copy."""
    dtype = CPU_GEMM_DTYPE
    xb = round_bf16(x.float()).to(dtype)
    if isinstance(weight, tuple):
        y = (
            F.linear(xb[:, 0::2], weight[0].to(dtype)).float()
            + F.linear(xb[:, 1::2], weight[1].to(dtype)).float()
        )
    else:
        y = F.linear(xb, weight.to(dtype)).float()
    return round_bf16(y if scales is None else y * scales)


@dataclass(frozen=True)
class RowKernel:
    """One activation row's forward as kernel calls (`QuantLinear.row_kernel`): each of `calls` is (op, operands),
    op(x, *operands) with op the name of an `ember_cpu` kernel or "linear" (F.linear); their outputs side by
    side (a joined projection's parts), then `bias` added."""

    calls: tuple[tuple[str, tuple], ...]
    bias: torch.Tensor | None = None


class QuantLinear(nn.Module):
    """Base: y = x @ dequantize().T + bias. Subclasses store weights their way and choose the kernel."""

    scheme: str = ""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype  # the activation dtype the float linear had
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def dequantize(self) -> torch.Tensor:
        """The float weight (N, K) these codes stand for, in float32."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Builds device-specific buffers from the canonical ones; a no-op unless a kernel needs a layout."""

    def bytes_read(self) -> int:
        """Bytes one forward reads from this module's weights with the kernel `prepare()` chose."""
        names = self._runtime_buffers()
        tensors = [getattr(self, n) for n in names] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def streamed_weight(self) -> torch.Tensor:
        """The largest tensor one forward reads (the codes, in the layout of the kernel `prepare()` chose)."""
        largest = None  # a loop, not max(key=): torch.compile traces this
        for name in self._runtime_buffers():
            t = getattr(self, name)
            if largest is None or t.numel() * t.element_size() > largest.numel() * largest.element_size():
                largest = t
        return largest

    def _runtime_buffers(self) -> tuple[str, ...]:
        return ("qweight", "scales")

    def options(self) -> dict:
        """What, beside the scheme, is needed to rebuild this module from its state dict (saved as metadata)."""
        return {}

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(codes, per-row scales) for `ember::silu_gate_up`, or None when its kernel cannot run this module."""
        return None

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def row_kernel(self) -> RowKernel | None:
        """This module's forward of one float32 activation row (1, K) -> (1, N) as kernel calls (`RowKernel`), where
        the kernel `prepare()` chose takes the row as it is: what an eager CPU decode step runs in place of the
        module (`ember.engine.cpu_step`). The same ops as `forward`, so the same values; None: call the module."""
        return None

    def _row(self, op: str, *operands) -> RowKernel:
        return RowKernel(((op, operands),), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


QUANTIZE_CHUNK = (
    1 << 24
)  # weights quantized at a time: the float32 temporaries of an output projection (Llama-3
# -8B's 525 M weights) would otherwise be a few GB on top of the model


def _by_rows(quantize, w: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """quantize(rows, *args) over chunks of w's rows, concatenated: the same values (every scheme here is
    row-wise), with temporaries of at most QUANTIZE_CHUNK weights."""
    rows = max(1, QUANTIZE_CHUNK // max(1, w.shape[1]))
    if w.shape[0] <= rows:
        return quantize(w, *args)
    parts = [quantize(w[i : i + rows], *args) for i in range(0, w.shape[0], rows)]
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q int8 (N, K), scales float32 (N,)), symmetric: w ~ q * scale."""
    return _by_rows(_int8_per_channel, w)


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4_grouped(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (codes uint8 (N, K) in [0, 15], scales (N, K/g), mins (N, K/g)): w ~ q * scale + min."""
    if w.shape[1] % group_size:
        raise ValueError(f"in_features={w.shape[1]} is not a multiple of the int4 group size {group_size}")
    return _by_rows(_int4_grouped, w, group_size)


def _int4_grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K = w.shape
    wg = w.float().reshape(N, K // group_size, group_size)  # (N, K/g, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    codes = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(N, K), scales, lo


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 (N, K) in [0, 15] -> (N, K/2): low nibble = even k, high nibble = odd k."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> codes (N, K)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


class Int8WeightOnlyLinear(QuantLinear):
    scheme = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self._cuda_gemv = False  # the CUDA C++ GEMV takes these weights (set by `prepare`)
        self._f32 = False  # Ember's CPU kernel for float activations takes them (set by `prepare`)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        w = linear.weight.detach()
        m = cls(w.shape[1], w.shape[0], linear.bias is not None, w.dtype).to(w.device)
        m.qweight, m.scales = quantize_int8_per_channel(w)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    def dequantize(self) -> torch.Tensor:
        return self._codes().float() * self.scales[:, None]

    def _codes(self) -> torch.Tensor:
        """The canonical int8 codes (N, K), from the CPU kernel's tiles where `prepare` released them."""
        return cpu_ext.untile_int8(self._tiles) if self.qweight is None else self.qweight

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.qweight is None:  # the codes live in the CPU kernel's tiles: saved in the canonical layout
            destination[prefix + "qweight"] = self._codes()

    def prepare(self) -> None:
        """On CPUs where Ember's kernels run, in float32, `cpu_ext.int8_gemv_f32` (float activations against the
        codes, float32 products and sums: the dequantized weights' float linear, where torch's kernel rounds the
        activations to bf16; a prefill's rows on AVX512-VNNI as int16 codes, to 2^-16 of each block of 32's
        largest |x|). Its tiles replace the canonical codes in memory (the state dict gives them back). SmolLM2
        int8 on 2 Zen 4 cores, eager: 40-57 -> 100-119 decode tok/s, 446-552 -> 982-1249 prefill (BENCHMARKS.md,
        fifty-first session). On CUDA the
        CUDA C++ GEMV where it builds, else the Triton kernels; elsewhere torch's weight-only kernel."""
        if self.qweight is None:  # prepared already: the kernel's tiles hold the codes
            return
        N, K = self.qweight.shape
        self._f32 = (
            self.qweight.is_cpu and self.dtype == torch.float32 and cpu_ext.fits(N, K) and cpu_ext.available()
        )
        if self._f32:
            self.register_buffer("_tiles", cpu_ext.int8_tiles(self.qweight), persistent=False)
            blocks = cpu_ext.int8_block_scales(self.scales[:, None].expand(N, K // cpu_ext.BLOCK))
            ((factors, units),) = cpu_ext.compact_factors([blocks], K)
            self.register_buffer("_tile_scales", factors, persistent=False)
            self.register_buffer("_scale_units", units, persistent=False)
            self.qweight = None
            return
        # A fresh copy from torch's allocator: tensors read by safetensors need not be 64-byte aligned, and
        # the CPU int8 kernel crashed (SIGSEGV) on one such weight in tests.
        self.qweight = self.qweight.clone()
        self.register_buffer("_scales_act", self.scales.to(self.dtype), persistent=False)
        # Asked here, not in forward: a traced forward may not call into the kernels' loader.
        self._cuda_gemv = self.qweight.is_cuda and self.in_features % 16 == 0 and cuda_rtc.available()

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return (self.qweight, self._scales_act) if self.bias is None else None

    def folds(self, x: torch.Tensor) -> bool:
        """Whether a decode row like x (one bf16/fp16 row on CUDA) runs this projection with a pre-norm layer's
        RMSNorm before it or residual add after it folded into its GEMV (`norm_linear`, `linear_add`: the CUDA
        C++ int8 GEMV's variants; no bias)."""
        return (
            self._cuda_gemv
            and self.bias is None
            and x.is_cuda
            and x.numel() == x.shape[-1]
            and x.dtype == self._scales_act.dtype
        )

    def norm_linear(self, h: torch.Tensor, norm: nn.Module, glu: bool = False) -> torch.Tensor:
        """self(norm(h)), or silu(gate) * up of it with glu (a gate/up projection), for one row h: one GEMV
        (`kernels.int8_norm_linear`; `folds`). norm: an `ember.ops.norm.RMSNorm`."""
        y = kernels.int8_norm_linear(
            h.reshape(1, -1), self.qweight, self._scales_act, norm.weight, norm.eps, norm.offset, glu
        )
        return y.reshape(*h.shape[:-1], -1)

    def linear_add(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """resid + self(x) for one row: one GEMV (`kernels.int8_linear_add`; `folds`)."""
        y = kernels.int8_linear_add(x.reshape(1, -1), self.qweight, self._scales_act, resid.reshape(1, -1))
        return y.reshape(resid.shape)

    def _runtime_buffers(self) -> tuple[str, ...]:
        return ("_tiles", "_tile_scales") if self._f32 else ("qweight", "scales")

    def _cpu_call(self) -> tuple[str, tuple]:
        units = self._scale_units
        return "int8_gemv_f32", (self._tiles, self._tile_scales, cpu_ext.BLOCK, None, units, None)

    def row_kernel(self) -> RowKernel | None:
        return RowKernel((self._cpu_call(),), self.bias) if self._f32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._f32:
            op, operands = self._cpu_call()
            y = getattr(torch.ops.ember_cpu, op)(float32_rows(x2), *operands)
            return self._add_bias(y.reshape(*shape[:-1], self.out_features))
        if cpu_float_gemm(x2):  # the CPU kernel's operands: bf16 scales after the sum
            scales = round_bf16(self._scales_act.float())
            y = float_gemm_as_kernel(x2, self.qweight.float(), scales).to(x.dtype)
        elif x2.is_cpu and not is_compiling():  # inductor's own lowering of torch's kernel fails (torch 2.13)
            y = kernels.int8_linear_cpu(x2, self.qweight, self._scales_act)
        else:
            y = kernels.int8_linear(x2, self.qweight, self._scales_act)
        return self._add_bias(y.reshape(*shape[:-1], self.out_features))


def tinygemm_layout(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, inner_tiles: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 codes (N, K/2) and their (N, K/g) scales and mins -> the packed codes and bf16 (K/g, N, 2)
    scale/zero pairs of torch's int4 kernels (`_weight_int4pack_mm` on CUDA, `..._for_cpu` on a CPU), on the
    codes' device. `inner_tiles`: CUDA's packing parameter (K a multiple of 16 * inner_tiles)."""
    codes = unpack_nibbles(qweight)
    if qweight.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    else:  # CUDA packs (N, K/2) bytes with the even k in the high nibble
        hi_even = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(hi_even, inner_tiles)
    # tinygemm's grid is w = (q - 8) * scale + zero, so zero = min + 8 * scale; layout (K/g, N, 2).
    sz = torch.stack((scales, mins + 8 * scales), dim=-1).transpose(0, 1)
    return packed, sz.contiguous().to(torch.bfloat16)


class Int4WeightOnlyLinear(QuantLinear):
    scheme = "int4"

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int = 128
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size {group_size} is not supported; expected 32, 64, 128 or 256")
        if in_features % group_size:
            raise ValueError(
                f"in_features={in_features} is not a multiple of the int4 group size {group_size}"
            )
        self.group_size = group_size
        G = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, G, dtype=torch.float32))
        self.register_buffer("mins", torch.zeros(out_features, G, dtype=torch.float32))
        self._splits = 1  # runs of K the tiled one-row GEMV adds up, set by `prepare` (`split_forward`)
        self._whole_rows = False  # set by `prepare` (`fused_silu_gate_up`)
        # The float linear's values on the dequantized weights (a checkpoint's own 4-bit weights kept as they
        # are, `ember.loading.weights.build_model(keep_codes=True)`): on a CPU, `cpu_ext.int4_gemv_f32`, never
        # the kernels that round the activations (to one int8 code or bf16: the float kernel's few rows take x
        # as three int8 parts, its many as three bf16 parts on AMX, to float32's precision, or elsewhere on
        # AVX512-VNNI as one int16 code, to 2^-16 of each block of 32's largest |x|). Set before `prepare`.
        self.float_activations = False

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 128) -> Int4WeightOnlyLinear:
        w = linear.weight.detach()
        m = cls(w.shape[1], w.shape[0], linear.bias is not None, w.dtype, group_size).to(w.device)
        codes, m.scales, m.mins = quantize_int4_grouped(w, group_size)
        m.qweight = pack_nibbles(codes)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Int4WeightOnlyLinear:
        """Codes uint8 (N, K) in [0, 15] with their (N, K/g) scales and mins, w = code * scale + min, taken
        as they are (a checkpoint's own 4-bit weights: `ember.loading.gguf.int4_blocks`); on codes' device."""
        (N, K), G = codes.shape, scales.shape[-1]
        if scales.shape != (N, G) or mins.shape != (N, G) or G == 0 or K % G:
            raise ValueError(
                f"int4 codes {tuple(codes.shape)} with scales {tuple(scales.shape)} and mins "
                f"{tuple(mins.shape)}: expected (N, K) codes and (N, K/g) scales and mins"
            )
        m = cls(K, N, bias is not None, dtype, K // G).to(codes.device)
        m.qweight = pack_nibbles(codes.to(torch.uint8))
        m.scales, m.mins = scales.float(), mins.float()
        if bias is not None:
            m.bias.copy_(bias)
        return m

    def options(self) -> dict:
        return {"group_size": self.group_size}

    def dequantize(self) -> torch.Tensor:
        return self.weight_rows(None)

    def weight_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Rows `ids` (1-D; None: all) of the float weight these codes stand for, in float32; from the kernel's
        tiles where a "cpu_f32" prepare() released the canonical codes (rows asked for in C++, the same values)."""
        if self.qweight is None and ids is not None:
            return torch.ops.ember_cpu.tile_rows(
                self._tiles, None, ids, 4, self.group_size, self._tile_scale_min, None, self._scale_min_units
            )
        if self.qweight is None:
            codes = cpu_ext.untile_nibbles(self._tiles)
            scales, mins = cpu_ext.untile_scale_min(
                cpu_ext.uncoded(self._tile_scale_min, self._scale_min_units)
            )
        else:
            qweight, scales, mins = (
                (self.qweight, self.scales, self.mins)
                if ids is None
                else (self.qweight[ids], self.scales[ids], self.mins[ids])
            )
            codes = unpack_nibbles(qweight)
        rows, K, g = codes.shape[0], self.in_features, self.group_size
        return (codes.float().reshape(rows, K // g, g) * scales[..., None] + mins[..., None]).reshape(rows, K)

    def _restore(self) -> None:
        """The canonical codes and factors back from a "cpu_f32" kernel's tiles (`prepare` released them), for
        another kernel's layout."""
        self.qweight = pack_nibbles(cpu_ext.untile_nibbles(self._tiles))
        self.scales, self.mins = cpu_ext.untile_scale_min(
            cpu_ext.uncoded(self._tile_scale_min, self._scale_min_units)
        )
        del self._tiles, self._tile_scale_min, self._scale_min_units

    def prepare(self) -> None:
        """Picks the kernel for this device, dtype and shape and builds its layout (a second copy of the codes;
        the canonical one stays the state dict):

        - "mma": on CUDA from sm80 on, bf16, where the tensor-core layout holds the weights
          (`kernels.int4_mma_fits`: groups of 64 or more), Ember's tensor-core GEMV up to 8 rows
          (`ember.quant.triton_mma`; K split into `triton_mma.row_splits` runs where N is small; or, where it
          builds, its CUDA C++ twin over whole rows, `ember.quant.cuda_int4`, which also fuses a gate/up
          projection's SwiGLU: `fused_silu_gate_up`), a Triton dequantize and torch's matmul for more. On an
          H200 it reads Llama-3-8B's projections in 57-77% of the tiled kernel's time, and the compiled
          int4-g128 step decodes 443 tok/s against 405 (BENCHMARKS.md).
        - "tiled": on CUDA for the rest (groups of 32; other GPUs) where K splits into tiles of 8 groups
          (`kernels.int4_tiles`), Ember's tiled GEMV
          (`ember.quant.kernels.int4_tiled_linear`; codes read as subnormal floats, K split where N is small);
          more than a few rows (prefill) dequantize in one Triton pass for torch's matmul. On an H200 it reads
          every Llama-3-8B projection at one row as fast as torch's tinygemm or faster (gate/up 26.2 vs 33.8
          us, down 16.1 vs 19.0) and the compiled int4 step decodes 401 tok/s against 362 with tinygemm for
          the narrow projections, at the same time to first token (BENCHMARKS.md).
        - "cpu_dot": on CPUs with AVX2 or VNNI, Ember's C++ kernel (`ember.ops.cpu_ext`): activations
          quantized to int8 per block of 32 and integer dot products with the codes, at any number of rows
          (from `cpu_ext.AMX_BF16_ROWS` rows on CPUs with AMX-BF16, bf16 activations and weights on the tile
          unit instead: `cpu_ext.int4_gemm_bf16`, and for a gate/up projection with SwiGLU's activation
          applied as the sums are stored, `fused_silu_gate_up`).
          On a 2-core Zen 4 it runs SmolLM2's projections at one row in 0.26-0.43x the time of torch's kernel
          and at 16 in 0.29-0.41x; a compiled prefill with it takes 0.56x (128 tokens) to 0.69x (500) the
          time of the dequantize + bf16 GEMM path below (BENCHMARKS.md).
        - "cpu_f32": with `float_activations`, on CPUs where "cpu_dot" runs and in float32, Ember's C++ kernel
          for float activations (`cpu_ext.int4_gemv_f32`): the float linear's values on the dequantized weights
          to float32's precision (x as three int8 or bf16 parts, or as it is; a prefill's rows on AVX512-VNNI as
          int16 codes, to 2^-16 of each block's largest |x|), from 4.5-6 bits a weight, not 32.
        - "tinygemm": torch's int4 kernels (`_weight_int4pack_mm*`, `tinygemm_layout`), on other CPUs where N is
          a multiple of 16 (the CPU packing's rows), and on CUDA for bf16 projections that do not tile.
        - "triton": Ember's canonical-layout GEMV for the rest (on CPU: dequantize and matmul).
        """
        if self.qweight is None:
            self._restore()
        dev = self.qweight.device
        self._splits = 1
        self._whole_rows = False  # decode GEMVs by the CUDA C++ int4 kernel over whole rows of K
        inner = next((t for t in (8, 4, 2) if self.in_features % (16 * t) == 0), None)
        cuda_ok = self.dtype == torch.bfloat16 and self.out_features % 8 == 0 and inner is not None
        cpu_kernels = (
            dev.type == "cpu" and cpu_ext.fits(self.out_features, self.in_features) and cpu_ext.available()
        )
        if dev.type == "cpu" and self.float_activations:  # (on CPU "triton" dequantizes for a float matmul)
            self._kernel = "cpu_f32" if cpu_kernels and self.dtype == torch.float32 else "triton"
        elif cpu_kernels:
            self._kernel = "cpu_dot"
        elif dev.type == "cpu":
            self._kernel = "tinygemm" if self.out_features % 16 == 0 else "triton"
        elif (
            dev.type == "cuda"
            and self.dtype == torch.bfloat16
            and kernels.int4_mma_fits(self.out_features, self.in_features, self.group_size)
            and torch.cuda.get_device_capability(dev) >= (8, 0)
        ):
            self._kernel = "mma"
        elif kernels.int4_tiles(self.in_features, self.group_size):
            self._kernel = "tiled"
        else:
            self._kernel = "tinygemm" if cuda_ok else "triton"
        # Asked here, not in forward: a traced forward may not call into the kernels' loader.
        self._amx_bf16 = self._kernel == "cpu_dot" and cpu_ext.amx_bf16()
        if self._kernel == "cpu_dot":
            tiles, scale_min = cpu_ext.int4_tiles(self.qweight, self.scales, self.mins)
            self.register_buffer("_tiles", tiles, persistent=False)
            self.register_buffer("_scale_min", scale_min, persistent=False)
        elif self._kernel == "cpu_f32":
            tiles, scale_min = cpu_ext.int4_tiles(self.qweight, self.scales, self.mins, torch.float32)
            # in the fewest bytes that hold them exactly: a K type's as int8 codes of units a run of 256 k, f16s
            # as float16 (`cpu_ext.compact_factors`)
            ((scale_min, units),) = cpu_ext.compact_factors([scale_min], self.in_features)
            self.register_buffer("_tiles", tiles, persistent=False)
            self.register_buffer("_tile_scale_min", scale_min, persistent=False)
            self.register_buffer("_scale_min_units", units, persistent=False)
            # A checkpoint's own codes, kept for float activations: the tiles are the codes now, one copy in
            # memory, not two (`dequantize` reads them back; another scheme's prepare restores them).
            self.qweight = self.scales = self.mins = None
        elif self._kernel == "tinygemm":
            packed, sz = tinygemm_layout(self.qweight, self.scales, self.mins, inner or 8)
            self.register_buffer("_packed", packed, persistent=False)
            self.register_buffer("_sz", sz, persistent=False)
        elif self._kernel == "mma":
            self.register_buffer("_words", kernels.int4_mma_tile(self.qweight), persistent=False)
            self.register_buffer("_msz", kernels.int4_mma_scales(self.scales, self.mins), persistent=False)
            if kernels.HAS_TRITON:
                from ember.quant import triton_mma

                N, K, g = self.out_features, self.in_features, self.group_size
                self._splits = triton_mma.row_splits(N, K, g, dev)
                self._whole_rows = cuda_int4.whole_rows(dev, g)
        elif self._kernel == "tiled":
            self.register_buffer("_words", kernels.int4_tile(self.qweight, self.group_size), persistent=False)
            self.register_buffer(
                "_tsz", kernels.int4_subnormal_scales(self.scales, self.mins), persistent=False
            )
            if kernels.HAS_TRITON:
                from ember.quant import triton_kernels as tk

                N, K, g = self.out_features, self.in_features, self.group_size
                self._splits = tk.tiled_split(N, K, g, tk.TILED_SPLIT_BLOCKS["BLOCK_N"])
        else:
            s16, z16 = kernels.int4_fold_scales(self.scales, self.mins, self.dtype)
            self.register_buffer("_s16", s16, persistent=False)
            self.register_buffer("_z16", z16, persistent=False)

    def _runtime_buffers(self) -> tuple[str, ...]:
        """What one row reads (a decode step's bytes)."""
        kinds = {
            "cpu_dot": ("_tiles", "_scale_min"),
            "cpu_f32": ("_tiles", "_tile_scale_min", "_scale_min_units"),
            "tinygemm": ("_packed", "_sz"),
            "mma": ("_words", "_msz"),
            "tiled": ("_words", "_tsz"),
            "triton": ("qweight", "_s16", "_z16"),
        }
        return tuple(n for n in kinds[self._kernel] if getattr(self, n) is not None)

    def _float_weights(self, rows: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The float32 weights, q * scale + min from the canonical codes, scales and mins: (N, K), or below
        HALVES_ROWS rows the pair (N, K/2) at even and at odd k (low and high nibbles, see
        `float_gemm_as_kernel`). Written for inductor's vectorizer: the nibbles come out of a byte's float
        value by floor and subtract (shifts of uint8 and the kernel layout's (K/g, N) scales each made it loop
        one weight at a time, 7x slower: 1.3 ms a call for SmolLM2's gate/up on 2 Zen 4 threads, now 0.19)."""
        N, K, g = self.out_features, self.in_features, self.group_size
        byte = self.qweight.reshape(N, K // g, g // 2).float()  # a byte's two k are in one group
        high = torch.floor(byte * 0.0625)
        low = byte - 16.0 * high
        scale, low_min = self.scales[..., None], self.mins[..., None]  # (N, K/g, 1)
        if rows >= HALVES_ROWS:
            return torch.stack((low * scale + low_min, high * scale + low_min), dim=-1).reshape(N, K)
        return tuple((codes * scale + low_min).reshape(N, K // 2) for codes in (low, high))

    def _on_tile_unit(self, rows: int) -> bool:
        """Whether `rows` activation rows run on the CPU's tile unit in bf16 (`cpu_ext.int4_gemm_bf16`)."""
        return self._amx_bf16 and rows >= cpu_ext.AMX_BF16_ROWS

    def fused_silu_gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up as one kernel that applies the activation to the sums as it stores them, where this
        module is a gate/up projection (gate rows over up rows, no bias) and one runs: one decode row on CUDA
        through the CUDA C++ int4 GEMV over whole rows (`ember.quant.cuda_int4`), or a prefill's rows on the
        CPU's tile unit (`cpu_ext.int4_silu_gate_up_bf16`, from `cpu_ext.AMX_BF16_ROWS` rows as `forward`);
        else None."""
        if self.bias is not None or (self.out_features // 2) % 16:
            return None
        x2 = x.reshape(-1, self.in_features)
        if self._whole_rows and x2.shape[0] == 1:
            y = kernels.int4_mma_silu_gate_up(x2, self._words, self._msz, self.group_size)
        elif self._on_tile_unit(x2.shape[0]):
            y = torch.ops.ember_cpu.int4_silu_gate_up_bf16(
                float32_rows(x2), self._tiles, self._scale_min, self.group_size
            ).to(x.dtype)
        else:
            return None
        return y.reshape(*x.shape[:-1], -1)

    def takes_rounded(self, x: torch.Tensor) -> bool:
        """Whether a decode row like x (one bf16 row on CUDA) runs this projection from the row rounded to int8
        by the norm before it (`rounded_forward`; `ember.quant.cuda_int4.ROUNDED_ROWS`): the CUDA C++ int4 GEMV
        over whole rows, no bias."""
        return cuda_int4.ROUNDED_ROWS and self._whole_row_gemv(x)

    def rounded_forward(self, r: torch.Tensor, shape: torch.Size, glu: bool = False) -> torch.Tensor:
        """self(x) for the row x of `shape` given as r, the row rounded to int8 (`cuda_int4.round_row`'s buffer),
        or silu(gate) * up of it with glu (a gate/up projection): one GEMV on the integer tensor cores
        (`kernels.int4_mma_rounded_linear`; `takes_rounded`)."""
        y = kernels.int4_mma_rounded_linear(r, self._words, self._msz, self.group_size, glu)
        return y.reshape(*shape[:-1], -1)

    def carries_norm(self, x: torch.Tensor) -> bool:
        """Whether a decode row like x (one bf16 row on CUDA) runs this projection with the RMSNorm between it and
        the next carried across their GEMVs (`linear_add_norm`, `normed_forward`; `ember.quant.cuda_int4.
        FOLD_NORMS`): the CUDA C++ int4 GEMV over whole rows, no bias."""
        return cuda_int4.FOLD_NORMS and self._whole_row_gemv(x)

    def _whole_row_gemv(self, x: torch.Tensor) -> bool:
        """Whether x is one bf16 row on CUDA that this projection (no bias) runs on the CUDA C++ int4 GEMV over
        whole rows: what its variants beside `forward` need."""
        return (
            self._whole_rows
            and self.bias is None
            and x.is_cuda
            and x.numel() == x.shape[-1]
            and x.dtype == torch.bfloat16
        )

    def linear_add_norm(
        self, x: torch.Tensor, resid: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, kernels.NormedRow]:
        """(h, norm(h) as a `kernels.NormedRow`) with h = resid + self(x), for one row: one GEMV
        (`kernels.int4_mma_linear_add_norm`; `carries_norm`). norm: an `ember.ops.norm.RMSNorm`."""
        h, hw, sq = kernels.int4_mma_linear_add_norm(
            x.reshape(1, -1),
            self._words,
            self._msz,
            self.group_size,
            resid.reshape(1, -1),
            norm.weight,
            norm.offset,
        )
        return h.reshape(resid.shape), kernels.NormedRow(hw, sq, norm.eps)

    def normed_forward(self, row: kernels.NormedRow, shape: torch.Size, glu: bool = False) -> torch.Tensor:
        """self(norm(h)) for the row h of `shape` carried as `linear_add_norm` leaves it, or silu(gate) * up of it
        with glu (a gate/up projection): one GEMV (`kernels.int4_mma_normed_linear`; `carries_norm`)."""
        y = kernels.int4_mma_normed_linear(
            row.hw, row.sq, row.eps, self._words, self._msz, self.group_size, glu
        )
        return y.reshape(*shape[:-1], -1)

    def split_forward(self, x: torch.Tensor) -> torch.Tensor | kernels.SplitSum:
        """forward(x); or, for one decode row on CUDA where the tiled GEMV splits K, its float32 partial sums
        (`kernels.SplitSum`) for a consumer that adds them as it reads them, in place of the pass that would."""
        splits = self._splits
        if splits > 1 and self.bias is None and x.is_cuda and x.numel() == x.shape[-1]:
            x2 = x.reshape(1, self.in_features)
            if self._kernel == "mma":
                parts = kernels.int4_mma_partials(x2, self._words, self._msz, self.group_size, splits)
            else:
                parts = kernels.int4_tiled_partials(x2, self._words, self._tsz, self.group_size, splits)
            return kernels.SplitSum(parts.reshape(splits, *x.shape[:-1], self.out_features))
        return self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if self._kernel == "mma":
            y = kernels.int4_mma_linear(x2, self._words, self._msz, self.group_size)
        elif self._kernel == "tiled":
            y = kernels.int4_tiled_linear(x2, self._words, self._tsz, self.group_size)
        elif self._kernel == "tinygemm" and cpu_float_gemm(x2):
            # The canonical weights (the kernel's are their bf16-rounded scale and zero): compiled and eager
            # agree to a bf16 rounding.
            y = float_gemm_as_kernel(x2, self._float_weights(x2.shape[0])).to(x.dtype)
        elif self._kernel == "cpu_dot":
            # A prefill's rows on the tile unit in bf16 where the CPU has one (`cpu_ext.int4_gemm_bf16`), else
            # (and for a decode step's few rows) the activations' int8 codes.
            many = self._on_tile_unit(x2.shape[0])
            gemm = torch.ops.ember_cpu.int4_gemm_bf16 if many else torch.ops.ember_cpu.int4_gemv
            y = gemm(float32_rows(x2), self._tiles, self._scale_min, self.group_size)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        elif self._kernel == "cpu_f32":
            y = torch.ops.ember_cpu.int4_gemv_f32(
                float32_rows(x2), self._tiles, self._tile_scale_min, self.group_size, self._scale_min_units
            )
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        elif self._kernel == "tinygemm":
            # bf16 activations: the only dtype of the CUDA kernel, and the CPU kernel's float32 path is not
            # vectorised (measured ~60x slower on AVX-512).
            mm = (
                torch.ops.aten._weight_int4pack_mm_for_cpu if x.is_cpu else torch.ops.aten._weight_int4pack_mm
            )
            y = mm(x2.to(torch.bfloat16), self._packed, self.group_size, self._sz).to(x.dtype)
        else:
            y = kernels.int4_linear(x2, self.qweight, self._s16, self._z16, self.group_size)
        return self._add_bias(y.reshape(*shape[:-1], self.out_features))

    def row_kernel(self) -> RowKernel | None:
        if self.dtype != torch.float32:
            return None
        if self._kernel == "cpu_f32":
            units = self._scale_min_units
            return self._row("int4_gemv_f32", self._tiles, self._tile_scale_min, self.group_size, units)
        if self._kernel == "cpu_dot" and not self._on_tile_unit(1):
            return self._row("int4_gemv", self._tiles, self._scale_min, self.group_size)
        return None


class Int8BlockLinear(QuantLinear):
    """int8 codes with a float32 scale a block of 16 or 32 along K, and for some a float32 min, w = code * scale
    (+ min): a GGUF file's block types (Q8_0, Q6_K, Q5_K, Q3_K, ...: `ember.loading.gguf.int8_blocks`) as they
    are, kept by a float load (`ember.loading.weights.build_model(keep_codes=True)`) and computed with float
    activations, so the module gives the dequantized weights' float linear. Not a `--quantize` scheme (nothing
    saves it); a scheme asked of a model that holds one quantizes the weights it stands for (`dequantize`).

    Kernels: "cpu_f32", float32 on CPUs where Ember's CPU kernels run: codes that fit 5 bits (`narrow_codes`:
    Q5_0/1, Q5_K, Q3_K, Q2_K, 4-bit) in 5 bits a weight (`cpu_ext.int5_gemv_f32`), 6 bits (Q6_K, and parts
    beside it) in 6 (`cpu_ext.int6_gemv_f32`), others in 8 (`cpu_ext.int8_gemv_f32`); "float" elsewhere (the
    weights dequantized for each call)."""

    scheme = "int8-blocks"
    BLOCKS = (16, 32)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        block: int = 32,
        mins: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if block not in self.BLOCKS or in_features % 32:
            raise ValueError(
                f"int8 blocks of {block} over in_features={in_features}: expected blocks of 16 or 32 and "
                "in_features a multiple of 32"
            )
        self.block = block
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, in_features // block))
        self.register_buffer("mins", torch.zeros(out_features, in_features // block) if mins else None)
        self.float_activations = True

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Int8BlockLinear:
        """Codes int8 (N, K) with their (N, K/b) scales and mins (or None) (blocks b of 16 or 32), taken as
        they are; on codes' device."""
        (N, K), B = codes.shape, scales.shape[-1]
        block = K // B if B and K % B == 0 else 0
        if (
            codes.dtype != torch.int8
            or scales.shape != (N, B)
            or block not in cls.BLOCKS
            or (mins is not None and mins.shape != scales.shape)
        ):
            raise ValueError(
                f"int8 blocks: codes {tuple(codes.shape)} {codes.dtype} with scales {tuple(scales.shape)} and "
                f"mins {None if mins is None else tuple(mins.shape)}; expected int8 (N, K) codes and (N, K/16) "
                "or (N, K/32) scales (and mins)"
            )
        m = cls(K, N, bias is not None, dtype, block, mins is not None).to(codes.device)
        m.qweight, m.scales = codes, scales.float()
        if mins is not None:
            m.mins = mins.float()
        if bias is not None:
            m.bias.copy_(bias)
        return m

    @classmethod
    def joined(
        cls,
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Int8BlockLinear:
        """A fused projection (q/k/v, gate/up) from its parts' (codes, scales, mins) (`from_codes`' operands),
        rows one after another. Parts of blocks of 32 join ones of 16 as blocks of 16 (each factor twice), and
        parts without mins take mins of zero beside ones with them: the same weights."""
        block = min(p[0].shape[1] // p[1].shape[1] for p in parts)
        with_mins = any(p[2] is not None for p in parts)
        codes, scales, mins = [], [], []
        for c, s, m in parts:
            repeat = c.shape[1] // s.shape[1] // block
            codes.append(c)
            scales.append(s.repeat_interleave(repeat, dim=1))
            if with_mins:
                mins.append(torch.zeros_like(scales[-1]) if m is None else m.repeat_interleave(repeat, dim=1))
        return cls.from_codes(
            torch.cat(codes), torch.cat(scales), torch.cat(mins) if with_mins else None, bias, dtype
        )

    def dequantize(self) -> torch.Tensor:
        return self.weight_rows(None)

    def weight_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Rows `ids` (1-D; None: all) of the float weight these codes stand for, in float32; from the kernel's
        tiles where prepare() released the canonical codes (rows asked for in C++, the same values)."""
        if self.qweight is None and ids is not None:
            factors = (self._tile_scales, self._tile_mins, self._scale_units, self._min_units)
            return torch.ops.ember_cpu.tile_rows(
                self._tiles, self._high, ids, self._bits, self.block, *factors
            )
        if self.qweight is None:
            tiles, high, mins = self._tiles, self._high, self._tile_mins
            codes = (
                cpu_ext.untile_int8(tiles)
                if high is None
                else (cpu_ext.untile_int5 if self._bits == 5 else cpu_ext.untile_int6)(tiles, high)
            )
            scales, mins = (
                cpu_ext.untile_factors(cpu_ext.uncoded(self._tile_scales, self._scale_units)),
                None if mins is None else cpu_ext.untile_factors(cpu_ext.uncoded(mins, self._min_units)),
            )
        else:
            codes, scales, mins = self.qweight, self.scales, self.mins
            if ids is not None:
                codes, scales, mins = codes[ids], scales[ids], None if mins is None else mins[ids]
        rows = codes.shape[0]
        w = codes.float().reshape(rows, -1, self.block) * scales[..., None]
        return (w if mins is None else w + mins[..., None]).reshape(rows, self.in_features)

    @staticmethod
    def code_bits(codes: torch.Tensor) -> int:
        """The fewest bits a weight the CPU kernels hold int8 codes (N, K) in: 5 where each row's codes are
        within 0..31, or -16..15 (taken up by 16: `narrow_codes`); 6 where all are within -32..31; else 8."""
        low, high = codes.amin(dim=1).to(torch.int16), codes.amax(dim=1).to(torch.int16)
        up = torch.where(low < 0, 16, 0).to(torch.int16)
        if bool((low + up >= 0).all()) and bool((high + up <= 31).all()):
            return 5
        return 6 if bool(low.min() >= -32) and bool(high.max() <= 31) else 8

    def narrow_codes(self, bits: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The codes as `bits`-bit ones and the mins that keep the weights, or None where some row's codes do not
        fit (`code_bits`). 5 bits: unsigned (0..31; not Q8_0, Q6_K), a row with codes below 0 (Q5_0, Q3_K:
        within -16..15) taken up by 16 and its min down by 16 of its scales (exact for those types, which have no
        min). 6 bits: signed, -32..31 as they are (every type but Q8_0)."""
        if self.code_bits(self.qweight) > bits:
            return None
        if bits == 6:
            return self.qweight, self.mins
        up = torch.where(self.qweight.amin(dim=1) < 0, 16, 0).to(torch.int16)
        codes = (self.qweight.to(torch.int16) + up[:, None]).to(torch.uint8)
        if not bool(up.any()):
            return codes, self.mins
        mins = torch.zeros_like(self.scales) if self.mins is None else self.mins
        return codes, mins - up[:, None].float() * self.scales

    def prepare(self) -> None:
        if self.qweight is None:  # prepared already: the kernel's tiles hold the codes
            return
        cpu = self.qweight.device.type == "cpu" and self.dtype == torch.float32
        if cpu and cpu_ext.fits(self.out_features, self.in_features) and cpu_ext.available():
            self._kernel = "cpu_f32"
            self._bits = self.code_bits(self.qweight)
            if self._bits == 8:
                mins, (tiles, high) = self.mins, (cpu_ext.int8_tiles(self.qweight), None)
            else:
                codes, mins = self.narrow_codes(self._bits)
                tiles, high = (cpu_ext.int5_tiles if self._bits == 5 else cpu_ext.int6_tiles)(codes)
            self.register_buffer("_tiles", tiles, persistent=False)
            self.register_buffer("_high", high, persistent=False)
            # in the fewest bytes that hold them exactly (a K type's as int8 codes of units a run of 256 k, f16s
            # as float16: `cpu_ext.compact_factors`), one form for both
            tiled = [None if f is None else cpu_ext.int8_block_scales(f) for f in (self.scales, mins)]
            compact = cpu_ext.compact_factors(tiled, self.in_features)
            for name, pair in zip(("scale", "min"), compact, strict=True):
                self.register_buffer(f"_tile_{name}s", None if pair is None else pair[0], persistent=False)
                self.register_buffer(f"_{name}_units", None if pair is None else pair[1], persistent=False)
            # The tiles are the codes now: one copy in memory, not two (`dequantize` reads them back; 5-bit codes
            # of a row taken up by 16 give its weights exactly, as its min is 16 of its scales down).
            self.qweight = self.scales = self.mins = None
        else:
            self._kernel = "float"

    def _runtime_buffers(self) -> tuple[str, ...]:
        names = (
            ("_tiles", "_high", "_tile_scales", "_tile_mins", "_scale_units", "_min_units")
            if self._kernel == "cpu_f32"
            else ("qweight", "scales", "mins")
        )
        return tuple(n for n in names if getattr(self, n) is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._kernel == "cpu_f32":
            op, operands = self._cpu_call()
            y = getattr(torch.ops.ember_cpu, op)(float32_rows(x2), *operands)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize().to(x.dtype))
        return self._add_bias(y.reshape(*shape[:-1], self.out_features))

    def _cpu_call(self) -> tuple[str, tuple]:
        """The "cpu_f32" kernel (5, 6 or 8 bits a weight) and its operands after the rows."""
        factors = (self._tile_scales, self.block, self._tile_mins, self._scale_units, self._min_units)
        if self._high is None:
            return "int8_gemv_f32", (self._tiles, *factors)
        return f"int{self._bits}_gemv_f32", (self._tiles, self._high, *factors)

    def row_kernel(self) -> RowKernel | None:
        if self._kernel != "cpu_f32" or self.dtype != torch.float32:
            return None
        return RowKernel((self._cpu_call(),), self.bias)


class JoinedLinear(QuantLinear):
    """A fused projection (q/k/v, gate/up) whose parts a file holds in different kinds of codes, kept as a run of
    modules, one a kind, their outputs side by side (`build_model` in `ember.loading.weights`): a Q4_K_M file's
    q and k in Q4_K beside a v in Q6_K run as int4 groups and 6-bit blocks, not all of it as 6-bit blocks with
    mins (7.25 bits a weight). Each part keeps its own kernel; the same weights, the same values (each output
    the same sums). Not a scheme: a scheme asked of it quantizes the weights it stands for (`dequantize`)."""

    scheme = "joined"

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        first = parts[0]
        if len(parts) < 2 or any(p.in_features != first.in_features or p.bias is not None for p in parts):
            raise ValueError(
                "a joined projection takes two or more parts without biases of one input width, got "
                f"{[(p.in_features, p.bias is not None) for p in parts]}"
            )
        super().__init__(first.in_features, sum(p.out_features for p in parts), bias is not None, first.dtype)
        self.parts = nn.ModuleList(parts)
        self.float_activations = True
        self._kernel = "cpu_f32" if all(getattr(p, "_kernel", None) == "cpu_f32" for p in parts) else "float"
        if bias is not None:
            self.bias.copy_(bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def bytes_read(self) -> int:
        return sum(p.bytes_read() for p in self.parts) + (0 if self.bias is None else self.bias.nbytes)

    def streamed_weight(self) -> torch.Tensor:
        largest = None
        for p in self.parts:
            t = p.streamed_weight()
            if largest is None or t.numel() * t.element_size() > largest.numel() * largest.element_size():
                largest = t
        return largest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.cat([p(x) for p in self.parts], dim=-1))

    def row_kernel(self) -> RowKernel | None:
        rows = [p.row_kernel() for p in self.parts]  # parts have no biases
        if any(r is None for r in rows):
            return None
        return RowKernel(tuple(call for r in rows for call in r.calls), self.bias)


def outer_quantized(model: nn.Module):
    """The model's quantized modules, each once: a `JoinedLinear`, not also its parts."""
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in inner:
            inner.update(id(m) for m in module.modules() if m is not module)
            yield module


class CodesEmbedding(nn.Module):
    """A tied embedding looked up in its output projection's kept codes (`Int4WeightOnlyLinear` with
    `float_activations`, or `Int8BlockLinear`): each token's row dequantized as it is looked up, to the float
    load's values exactly, so that the float table (a GGUF file's largest tensor, 4 bytes a weight) is never
    made. The projection is held outside the module tree: it is the model's `lm_head`, moved and counted there.
    """

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]
        self.num_embeddings, self.embedding_dim, self.dtype = head.out_features, head.in_features, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._head[0].weight_rows(ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def as_table(self) -> nn.Embedding:
        """The same lookups from a float table (the model's embedding as a float load makes it)."""
        table = nn.Embedding(
            self.num_embeddings, self.embedding_dim, _weight=self._head[0].dequantize().to(self.dtype)
        )
        return table.requires_grad_(False)


# Up to this many rows an int8-dyn projection runs Ember's int8 kernel (`cpu_ext`) rather than `torch._int_mm`
# (2-core Zen 4, SmolLM2's projections and output projection: 1.6-2.9x faster at one row, 1.1-1.4x at 16,
# even to 0.85x at 32, 0.7-0.8x at 64).
INT8_GEMV_ROWS = 16


class Int8DynActLinear(Int8WeightOnlyLinear):
    """int8 weights (per channel) x int8 activations (per row, quantized on the fly): an int32 matmul.

    The weights, their format and quantization are Int8WeightOnlyLinear's; only the kernel differs. On CPUs
    with VNNI `torch._int_mm` reads the weights about twice as fast as the weight-only kernel, and Ember's own
    kernel (`ember.ops.cpu_ext`, the same integer sums) faster again for a few rows. On CUDA the
    activations stay in floating point and the weight-only kernels run: `_int_mm` needs more than 16 rows
    there, and at one row the weight-only GEMV is bound by reading the same bytes.
    """

    scheme = "int8-dyn"
    _gemv = False  # whether prepare() chose Ember's CPU kernel

    def prepare(self) -> None:
        if self.qweight.device.type == "cuda":
            return super().prepare()
        # _int_mm takes the weight as (K, N); a transposed view of the (N, K) codes keeps one copy in memory.
        self.register_buffer("_wt", self.qweight.t(), persistent=False)
        self._gemv = (
            cpu_ext.fits(self.out_features, self.in_features)
            and self.in_features <= cpu_ext.INT8_MAX_K
            and cpu_ext.available()
        )
        if self._gemv:  # a second copy of the codes, tiled for Ember's kernel
            self.register_buffer("_tiles", cpu_ext.int8_tiles(self.qweight), persistent=False)

    def _runtime_buffers(self) -> tuple[str, ...]:
        return ("_tiles", "scales") if self._gemv else ("qweight", "scales")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return super().forward(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # (M, K)
        if self._gemv and x2.shape[0] <= INT8_GEMV_ROWS:  # the same sums as _int_mm's, from Ember's kernel
            y = torch.ops.ember_cpu.int8_gemv(x2.contiguous(), self._tiles, self.scales).to(x.dtype)
            return self._add_bias(y.reshape(*shape[:-1], self.out_features))
        x_scale = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # (M, 1)
        xq = torch.round(x2 / x_scale).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self._wt)  # (M, N) int32
        y = (acc.float() * x_scale * self.scales).to(x.dtype)
        return self._add_bias(y.reshape(*shape[:-1], self.out_features))

    def row_kernel(self) -> RowKernel | None:
        if not self._gemv or self.dtype != torch.float32:
            return None
        return self._row("int8_gemv", self._tiles, self.scales)


def float_linear(x: torch.Tensor, module: QuantLinear) -> torch.Tensor:
    """The reference: the same matmul with the dequantized weight, in float32."""
    b = None if module.bias is None else module.bias.float()
    return F.linear(x.float(), module.dequantize(), b)
