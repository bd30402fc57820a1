"""Ember's C++ CPU kernels (`csrc/`), built for this machine on first use and loaded as torch ops `ember_cpu::*`:

- `int4_gemv` and `int8_gemv` (`csrc/cpu_gemv.cpp`): a few rows of activations (decode steps) against int4
  and int8 weights, with the activations' int8 codes multiplied by the weights' codes in integer dot products
  (AVX512-VNNI, AVX-VNNI or AVX2);
- `int4_gemv_f32`, `int8_gemv_f32`, `int5_gemv_f32` and `int6_gemv_f32` (`csrc/cpu_gemv.cpp`): float activations
  against a GGUF file's own codes in 4, 8, 5 or 6 bits a weight, float32 products and sums (the dequantized
  weights' float linear to float32's precision); their factors float32, float16 or int8 codes
  of a unit a run of 256 k, whichever holds them exactly in the fewest bytes (`compact_factors`). One or two
  rows (a decode step's) on AVX512-VNNI, AVX-VNNI or AVX2 take x as three int8 parts of each block of 32's scale
  (held to 2^-24 of the block's largest |x|) in integer dot products (EMBER_CPU_SPLIT=0: float FMAs); from 16
  rows on AMX-BF16, as three bf16 parts on the tile unit (exact products, float32 sums; EMBER_CPU_AMX_F32=0:
  the vector path); the rows the tile unit leaves, from 4 (a prefill's) on AVX512-VNNI, as one int16 code of
  each block of 32's scale (held to 2^-16 of the block's largest |x|: 1.4-1.8x the FMAs' rate on Zen 4) against
  the codes made int16 once a tile, in integer dot products (`quantize_blocks(x, 32767)`; EMBER_CPU_WIDE=0: float
  FMAs);
- `int4_gemm_bf16` (`csrc/cpu_gemv.cpp`, on CPUs with AMX-BF16: Sapphire Rapids and later): a prefill's
  rows against int4 weights on the tile unit, the weights dequantized to bf16 a tile at a time and x rounded
  to bf16, float32 sums; from `AMX_BF16_ROWS` rows it takes 0.47-0.98x the time of `int4_gemv` (which itself
  runs its many-row sums on the tile unit there, bit for bit as its vector path: BENCHMARKS.md);
  `int4_silu_gate_up_bf16` is the same for a gate/up projection, with SwiGLU's activation applied to the
  sums as they leave the tile unit (its output half the width, and no pass of its own);
- `decode_attention` and `paged_decode_attention` (`csrc/cpu_attention.cpp`): one query token a row over a
  static or a paged KV cache, reading only the slots the row sees; `rope_decode_attention`, for eager steps,
  also ropes q and k and writes this step's k and v to the static cache first, `rope_prompt_write` does those
  for a prompt's rows on a static cache, and `rope_write` for a paged cache's tokens;
- `prompt_attention` (`csrc/cpu_prompt_attention.cpp`, AVX-512 builds): a prompt's queries over the keys each
  sees, causal and within a sliding window, float32, flash-attention style (`ember.ops.attention.prompt_attention`);
- `rms_norm` and `add_rms_norm` (`csrc/cpu_norm.cpp`): `ember.ops.norm`'s RMSNorm (and the residual add before
  it) in one call, for eager steps, where its ~10 aten ops a norm were a tenth of a small model's step.
- `tile_rows` (`csrc/cpu_rows.cpp`): rows of 4-, 5-, 6- or 8-bit tiles dequantized (`untile_int8`,
  `untile_int6` ... and the factors for just those rows, the same values): a tied embedding looked up in its
  output projection's kept codes (a GGUF file's Q8_0, Q6_K, Q4_K ... token table);
  `argmax_rows`, torch.argmax over each row of float32 logits (`ember.ops.argmax` in eager steps).

The sources are compiled with the host's compiler (`$CXX`, else g++) for the host's instruction set
(-march=native), against the installed torch; registered in C++, an op costs what an aten op does, inside a
compiled step too. The library is kept in `$EMBER_CACHE_DIR/kernels/` under a key of the sources, torch's
version, the compiler, the flags and the CPU, and is reused by every later process; a build takes about a
minute on 2 cores (58 s on the 2-core Zen 4 VM: one compiler per source, `cpu_gemv.cpp` alone ~35 s; a
precompiled ATen header saved only 14% and weighed 406 MiB). `available()` is False off x86, on CPUs with
neither AVX2 nor VNNI, when no compiler or headers are found (one log line says why) and with
EMBER_CPU_KERNELS=0: callers then keep torch's kernels.

Layouts (tiles of 16 output rows; see the C++ source): `int4_tiles` and `int8_tiles` build them from the
canonical codes; `int4_reference`, `int4_bf16_reference` (and `int4_silu_gate_up_bf16_reference`) and
`int8_reference` are the plain-torch twins the tests hold them to (decode attention's is
`ember.ops.decode_attention.attend_reference`). EMBER_CPU_AMX=0 keeps the tile unit out of it (to compare).

Shape legend: M rows of activations, K input features, N output features, g group size.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.paths import cache_root, remove_stale, temporary

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / f"cpu_{name}.cpp" for name in ("gemv", "attention", "prompt_attention", "norm", "step", "rows")
)
NAMESPACE = "ember_cpu"
TILE = 16  # output rows of a tile: N must be a multiple
BLOCK = 32  # k of an activation block (int4) and of a tile's run of bytes: K must be a multiple
INT8_MAX_K = 1 << 16  # int8 sums stay inside int32 up to this K
# From this many rows an int4 projection runs `int4_gemm_bf16` where it can (`amx_bf16`): below, dequantizing
# the weights costs more than the tile unit saves (SmolLM2's projections against `int4_gemv`, 2 threads of a
# Xeon with AMX: gate/up even at 48 rows; at 64, 0.68-0.72x the time for gate/up and down, qkv and o even; at
# 128, 0.47-0.98x; BENCHMARKS.md).
AMX_BF16_ROWS = 64
ENV = "EMBER_CPU_KERNELS"
# Ops only some instruction sets' builds have (`has_op`).
OPTIONAL_OPS = ("prompt_attention",)


def eager_inference() -> bool:
    """Whether ops run now as an eager inference step (no autograd, nothing traced): where the kernels that
    stand for several aten ops of an eager step (the norms, rope with the cache writes) run. A compiled step
    keeps the plain ops, which inductor fuses with their neighbours."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def fits(out_features: int, in_features: int) -> bool:
    """Whether a projection (N, K) tiles for these kernels."""
    return out_features % TILE == 0 and in_features % BLOCK == 0


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def _cpu_ident() -> str:
    """The CPU's model and flags: a library built with -march=native runs only where its instructions do."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_ident(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def _process_libstdcxx() -> str:
    """The libstdc++ shared library this process has loaded (torch's), as a link argument; else "-lstdc++"."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and Path(fields[5].strip()).name.startswith("libstdc++.so"):
                    return fields[5].strip()
    except OSError:
        pass
    return "-lstdc++"


def build(namespace: str = NAMESPACE, flags: tuple[str, ...] = ()) -> Path:
    """Compiles the kernels (ops `namespace::*`, extra compiler `flags`) into the kernels cache, once per key;
    returns the library's path. Raises OSError or subprocess.CalledProcessError when the build fails."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise OSError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP (torch's own libgomp at run time); without it, one thread.
    cmd = [
        cxx, "-O3", "-march=native", "-std=c++20", "-fPIC", "-fopenmp", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DEMBER_CPU_NAMESPACE={namespace}", *flags,
        *[f"-I{p}" for p in cpp_extension.include_paths()],
    ]  # fmt: skip
    # The process's libstdc++, named by its path ahead of what the compiler's driver adds: torch's libraries use
    # it. A driver whose own library folders come first and hold only libstdc++.a (one GPU host's g++ wrapper,
    # gcc 13 with -B/opt/gcc/...: even "-lstdc++" took the archive) gave the kernels a second copy whose locale
    # facets c10's streams do not know, so that formatting the first error message crashed the process.
    libs = [*[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu", _process_libstdcxx()]
    texts = [f.read_text() for f in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])]
    ident = [*texts, torch.__version__, _compiler_ident(cxx), " ".join(cmd), " ".join(libs), _cpu_ident()]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:20]
    folder = cache_root() / "kernels"
    path = folder / f"{namespace}-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(folder)
    stem = temporary(folder / path.stem)
    objects = [stem.with_name(f"{stem.name}.{src.stem}.o") for src in SOURCES]
    # Seconds of silence inside a model's load otherwise: say so once, at the level the CLI shows by default.
    log.warning(
        "building Ember's CPU kernels for this machine (once; about a minute on 2 cores) into %s", path
    )
    start = time.perf_counter()
    try:  # one compiler per source at once, then the link
        jobs = [
            subprocess.Popen([*cmd, "-c", str(src), "-o", str(obj)], stderr=subprocess.PIPE, text=True)
            for src, obj in zip(SOURCES, objects, strict=True)
        ]
        for job in jobs:
            _, err = job.communicate()
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=err)
        link = [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", f"{stem}.so", *libs]
        subprocess.run(link, check=True, capture_output=True, text=True)
        Path(f"{stem}.so").replace(path)  # atomic: a concurrent process never loads half a library
    finally:
        for leftover in [*objects, Path(f"{stem}.so")]:
            leftover.unlink(missing_ok=True)
    log.info("CPU kernels built in %.1f s", time.perf_counter() - start)
    return path


_LOCK = threading.Lock()
_LOADED: dict[str, str] = {}  # namespace -> instruction set


def load(namespace: str = NAMESPACE, flags: tuple[str, ...] = ()) -> str:
    """Builds (or finds) and loads the kernels as ops `namespace::*`, once a process; returns the instruction
    set they use ("avx512-vnni", "avx-vnni", "avx2" or "scalar")."""
    with _LOCK:  # two threads' first calls must not both register the ops
        if namespace not in _LOADED:
            torch.ops.load_library(str(build(namespace, flags)))
            fakes = (
                ("int4_gemv", _int4_fake),
                ("int4_gemv_f32", _int4_f32_fake),
                ("int4_gemm_bf16", _int4_fake),
                ("int4_silu_gate_up_bf16", _int4_glu_fake),
                ("int8_gemv", _int8_fake),
                ("int8_gemv_f32", _int8_blocks_fake),
                ("int5_gemv_f32", _int5_fake),
                ("int6_gemv_f32", _int6_fake),
                ("decode_attention", _attention_fake),
                ("paged_decode_attention", _attention_fake),
                ("rope_decode_attention", _rope_attention_fake),
                ("rope_write", _rope_write_fake),
                ("rope_prompt_write", _rope_prompt_write_fake),
                ("rms_norm", _norm_fake),
                ("add_rms_norm", _add_norm_fake),
                ("tile_rows", _tile_rows_fake),
                ("argmax_rows", _argmax_fake),
                ("prompt_attention", _prompt_attention_fake),
            )
            ops = getattr(torch.ops, namespace)
            for name, fake in fakes:
                if name in OPTIONAL_OPS and not hasattr(ops, name):
                    continue
                torch.library.register_fake(f"{namespace}::{name}")(fake)
            _LOADED[namespace] = getattr(torch.ops, namespace).simd()
        return _LOADED[namespace]


@functools.cache
def available() -> bool:
    """Whether the `ember_cpu::*` ops run here, the GEMVs with integer dot-product instructions; builds and
    loads them on the first call."""
    if os.environ.get(ENV) == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        simd = load()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("Ember's CPU kernels could not be built (%s%s); using torch's", e, detail[-2000:])
        return False
    if simd == "scalar":
        log.info("no AVX2 or VNNI on this CPU: using torch's kernels")
        return False
    log.info("Ember's CPU kernels: %s", simd)
    return True


@functools.cache
def has_op(name: str) -> bool:
    """Whether the loaded build has `ember_cpu::name` (one of `OPTIONAL_OPS`, which need AVX-512)."""
    return available() and hasattr(torch.ops.ember_cpu, name)


@functools.cache
def amx_bf16() -> bool:
    """Whether `int4_gemm_bf16` runs here: the kernels built for AMX-BF16 and Linux granting this process the
    tile state (not with EMBER_CPU_AMX=0)."""
    return available() and bool(torch.ops.ember_cpu.amx_bf16())


def _rope_attention_fake(q, k, v, cos, sin, k_cache, v_cache, positions, scale, window):
    return torch.empty_like(q)


def _rope_write_fake(q, k, v, cos, sin, k_pool, v_pool, slot_mapping):
    return torch.empty_like(q)


def _prompt_attention_fake(q, k, v, scale, window):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2)


def _rope_prompt_write_fake(q, k, v, cos, sin, k_cache, v_cache, positions):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )


def _norm_fake(x, weight, eps, offset):
    return torch.empty_like(x)


def _add_norm_fake(x, delta, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(x)


def _int4_fake(x, packed, scale_min, group_size):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


def _int4_glu_fake(x, packed, scale_min, group_size):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE // 2)


def _int8_fake(x, packed, scales):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


def _int4_f32_fake(x, packed, scale_min, group_size, units=None):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


def _int8_blocks_fake(x, packed, scales, block, mins=None, scale_units=None, min_units=None):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


def _int5_fake(x, packed, high, scales, block, mins=None, scale_units=None, min_units=None):
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


_int6_fake = _int5_fake


def _argmax_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _tile_rows_fake(packed, high, ids, bits, block, scales, mins=None, scale_units=None, min_units=None):
    return packed.new_empty(
        ids.numel(), packed.shape[1] // (512 if bits == 8 else 256) * BLOCK, dtype=torch.float32
    )


def _attention_fake(q, *args):
    return torch.empty_like(q)


def int4_tiles(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, factors: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 nibbles (N, K/2) (low = even k) and their (N, K/g) scales and mins -> `int4_gemv`'s
    packed codes (N/16, K/32 * 256) uint8 and scale_min (N/16, K/g, 2, 16) in `factors` (float16; float32
    for `int4_gemv_f32`)."""
    N, G = scales.shape
    K = qweight.shape[1] * 2
    packed = nibble_tiles(torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, K))
    sm = torch.stack([t.reshape(N // TILE, TILE, G).transpose(1, 2) for t in (scales, mins)], dim=2)
    return packed, sm.to(factors).contiguous()


def nibble_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..15 (their low nibbles taken) -> the int4 kernels' packed nibbles (N/16, K/32 * 256)
    uint8."""
    N, K = codes.shape
    # (tile, row, block, half, run, byte) -> (tile, block, run, row, byte, half): a run's 64 bytes are 16 rows
    # of 4 k, the first half of the block in the low nibbles and the second in the high ones.
    c = (codes & 0xF).to(torch.uint8).reshape(N // TILE, TILE, K // BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    return (c[..., 0] | (c[..., 1] << 4)).reshape(N // TILE, K // BLOCK * 256).contiguous()


def _plane_shifts() -> torch.Tensor:
    """(half, i, 1) uint8: where k = 16 half + 4 i + j's bit sits in byte j of a row's plane word."""
    return (4 * torch.arange(2).reshape(2, 1, 1) + torch.arange(4).reshape(1, 4, 1)).to(torch.uint8)


def _bit_plane(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit `bit` of codes (N, K) as `int5_tiles`' plane (N/16, K/32, 64) uint8: a block's 16 rows' 32 bits each as
    a little-endian int32, bit 8 j + i for k = 4 i + j and 8 j + 4 + i for k = 16 + 4 i + j (i, j < 4): byte j
    of a row holds bit 4 half + i for k = 16 half + 4 i + j. In bytes throughout (an output projection's plane is
    built from its N K codes, so no wider temporaries)."""
    N, K = codes.shape
    bits = (
        ((codes >> bit) & 1).to(torch.uint8).reshape(N // TILE, TILE, K // BLOCK, 2, 4, 4)
    )  # (.., half, i, j)
    planes = (bits << _plane_shifts()).sum(
        dim=(3, 4), dtype=torch.uint8
    )  # (tile, row, block, j): distinct bits
    return planes.transpose(1, 2).reshape(N // TILE, K // BLOCK, 64)


def _untile_plane(plane: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """`_bit_plane`'s inverse: the bits (N, K) as uint8."""
    planes = plane.reshape(N // TILE, K // BLOCK, TILE, 1, 1, 4)  # (tile, block, row, ., ., j)
    bits = (planes >> _plane_shifts()) & 1  # (tile, block, row, half, i, j)
    return bits.transpose(1, 2).reshape(N, K)


def int5_tiles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit codes (N, K) in 0..31 -> `int5_gemv_f32`'s low nibbles (`nibble_tiles`) and fifth bits (N/16,
    K/32 * 64) uint8 (`_bit_plane`: a block's 16 rows' 32 bits each as a little-endian int32, bit 8 j + i for
    k = 4 i + j and 8 j + 4 + i for k = 16 + 4 i + j)."""
    N, K = codes.shape
    return nibble_tiles(codes), _bit_plane(codes, 4).reshape(N // TILE, K // BLOCK * 64).contiguous()


def int6_tiles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed 6-bit codes (N, K) in -32..31 -> `int6_gemv_f32`'s low nibbles (`nibble_tiles`) and high bits
    (N/16, K/32 * 128) uint8 of their two's complements in 6 bits: a block's fifth bits then its sixth, each as
    `int5_tiles` lays out the fifth."""
    N, K = codes.shape
    codes = codes.to(torch.int16) & 63
    planes = torch.cat([_bit_plane(codes, 4), _bit_plane(codes, 5)], dim=-1)
    return nibble_tiles(codes), planes.reshape(N // TILE, K // BLOCK * 128).contiguous()


def int8_tiles(qweight: torch.Tensor) -> torch.Tensor:
    """int8 codes (N, K) -> `int8_gemv`'s packed codes (N/16, K/32 * 512) uint8: tiles of 16 rows, runs of 4 k,
    each code plus 128."""
    N, K = qweight.shape
    offset = (qweight.to(torch.int16) + 128).to(torch.uint8)
    # (tile, row, block, run, k) -> (tile, block, run, row, k)
    runs = offset.reshape(N // TILE, TILE, K // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    return runs.reshape(N // TILE, K // BLOCK * 512).contiguous()


def untile_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`nibble_tiles`' inverse: packed nibbles (N/16, K/32 * 256) -> codes (N, K) uint8 in 0..15."""
    T, K = packed.shape[0], packed.shape[1] // 256 * BLOCK
    c = packed.reshape(T, K // BLOCK, 4, TILE, 4)  # (tile, block, run, row, byte)
    c = torch.stack((c & 0xF, c >> 4), dim=-1)  # (.., byte, half) -> (tile, row, block, half, run, byte)
    return c.permute(0, 3, 1, 5, 2, 4).reshape(T * TILE, K).contiguous()


def untile_scale_min(scale_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_tiles`' scale_min (N/16, K/g, 2, 16) -> scales and mins (N, K/g), in its dtype."""
    T, G = scale_min.shape[:2]
    return tuple(scale_min[:, :, i].transpose(1, 2).reshape(T * TILE, G).contiguous() for i in (0, 1))


def untile_int5(packed: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """`int5_tiles`' inverse: codes (N, K) uint8 in 0..31."""
    codes = untile_nibbles(packed)
    N, K = codes.shape
    return codes | (_untile_plane(high, N, K) << 4).to(torch.uint8)


def untile_int6(packed: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """`int6_tiles`' inverse: codes (N, K) int8 in -32..31."""
    codes = untile_nibbles(packed).to(torch.int16)
    N, K = codes.shape
    planes = high.reshape(N // TILE, K // BLOCK, 2, 64)
    for p in range(2):
        codes = codes | (_untile_plane(planes[:, :, p], N, K) << (4 + p)).to(torch.int16)
    return ((codes ^ 32) - 32).to(torch.int8)


def untile_int8(packed: torch.Tensor) -> torch.Tensor:
    """`int8_tiles`' inverse: codes (N, K) int8."""
    T, K = packed.shape[0], packed.shape[1] // 512 * BLOCK
    runs = packed.reshape(T, K // BLOCK, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(T * TILE, K)
    return (runs.to(torch.int16) - 128).to(torch.int8)


def untile_factors(tiled: torch.Tensor) -> torch.Tensor:
    """`int8_block_scales`' inverse: (N/16, K/b, 16) -> (N, K/b)."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1]).contiguous()


# The float kernels' factors coded in runs of UNIT_K k: an int8 a block times a float16 unit a run (`Coded` in
# the C++ source), where that is exact: a GGUF K type's factors are an f16 (d, dmin) of 256 weights times small
# integers, 0.625 bits a weight (Q4_K's scale and min), not 2 as float32s.
UNIT_K = 256


def coded_factors(tiled: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A float kernel's float32 factors (N/16, K/b, *lanes) (`int8_block_scales`' (.., 16), `int4_tiles`' pairs
    (.., 2, 16)) -> int8 codes of the same shape and float16 units (N/16, K/256, *lanes), codes times units
    equal to the factors bit for bit; None where some run of 256 k has no such unit (factors that are not one
    float16 times small integers: Q8_0's, Q4_1's) or K is no multiple of 256.

    A run's unit is the greatest common divisor of its factors as binary fractions: the gcd of their odd
    significands times two to the least exponent. Every factor is an integer times it, and no integer is
    larger than over any other common unit (a K type's f16 d: the codes are at most its own). Where float16
    does not hold that unit, a smaller one it holds (the gcd over a small odd factor: a K type's d itself)."""
    T, B, lanes = tiled.shape[0], tiled.shape[1], tiled.shape[2:]
    if K % UNIT_K or B % (K // UNIT_K):
        return None
    S = K // UNIT_K
    per = B // S
    # runs (T, S, per, *lanes) -> one row a run and lane: (T * S * lanes, per)
    v = tiled.float().reshape(T, S, per, -1).transpose(2, 3).reshape(-1, per)
    fraction, exponent = torch.frexp(v.abs())
    significand = (fraction * 2**24).int()  # exact: 24 bits; 0 for a zero
    shift = torch.frexp((significand & -significand).float())[1] - 1  # its lowest set bit's (-1 for a zero)
    odd = significand >> shift.clamp(min=0)
    power = torch.where(significand == 0, 1 << 20, exponent - 24 + shift)  # v = odd * 2^power
    g = odd[:, 0]
    for i in range(1, per):
        g = torch.gcd(g, odd[:, i])
    power = power.amin(dim=1).clamp(max=1 << 10)
    units = torch.where(
        g == 0, 0.0, torch.ldexp(g.float(), power.float())
    )  # exact: g < 2^24; zeros: a unit 0
    q = torch.round(v / torch.where(units == 0, 1.0, units)[:, None])
    # A unit float16 does not hold (an f16 d times a common odd factor of its integers: 3 d) gives way to one
    # an odd factor f smaller that it holds, its codes f times larger (while they fit).
    wide = units.half().float() != units
    for f in range(3, 128, 2):
        if not bool(wide.any()):
            break
        smaller = torch.ldexp(torch.div(g, f, rounding_mode="floor").float(), power.float())
        fits = wide & (g % f == 0) & (smaller.half().float() == smaller) & (q.abs().amax(dim=1) * f <= 127)
        units, q = torch.where(fits, smaller, units), torch.where(fits[:, None], q * f, q)
        wide &= ~fits
    # int8 reaches -128, not 128: such a run takes the unit's other sign
    flip = (q == 128).any(dim=1)
    units, q = torch.where(flip, -units, units), torch.where(flip[:, None], -q, q)
    exact = bool(((q >= -128) & (q <= 127)).all()) and torch.equal(q * units[:, None], v)
    if not exact or bool(wide.any()):
        return None
    L = v.shape[0] // (T * S)
    codes = q.to(torch.int8).reshape(T, S, L, per).transpose(2, 3).reshape(tiled.shape).contiguous()
    return codes, units.half().reshape(T, S, *lanes).contiguous()


def compact_factors(
    factors: list[torch.Tensor | None], K: int
) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
    """A float kernel's float32 factors (scales, and mins or None: one form for both) in the fewest bytes that
    hold them exactly, each as (factors, units or None): int8 codes of units (`coded_factors`; a K type's), else
    float16 (a Q8_0's or Q4_1's f16 d and m), else float32 as they are."""
    given = [f for f in factors if f is not None]
    coded = []
    for f in given:  # until one does not code (a Q8_0's scales: their mins need no search)
        if (c := coded_factors(f, K)) is None:
            break
        coded.append(c)
    if len(coded) == len(given):
        compact = iter(coded)
    elif all(torch.equal(f.half().float(), f) for f in given):
        compact = iter((f.half(), None) for f in given)
    else:
        compact = iter((f, None) for f in given)
    return [None if f is None else next(compact) for f in factors]


def uncoded(factors: torch.Tensor, units: torch.Tensor | None) -> torch.Tensor:
    """`compact_factors`' inverse: float32 factors (N/16, K/b, *lanes)."""
    if units is None:
        return factors.float()
    per = factors.shape[1] // units.shape[1]
    return factors.float() * units.float().repeat_interleave(per, dim=1)


def int8_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """(N, K/b) scales (or mins) of int8 blocks of b k -> `int8_gemv_f32`'s (N/16, K/b, 16) float32: a tile's 16
    rows' factors of each block together."""
    N, B = scales.shape
    return scales.float().reshape(N // TILE, TILE, B).transpose(1, 2).contiguous()


def int8_f32_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """`int8_gemv_f32` in plain torch: the float linear on the weights q * scale (+ min) (a factor a block of K /
    (N, K/b) factors' b k), summed in float64 (the kernel's float32 sums differ from it by their rounding
    alone)."""
    N, K = qweight.shape
    b = K // scales.shape[1]
    w = qweight.double().reshape(N, K // b, b) * scales.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    return F.linear(x.double(), w.reshape(N, K)).float()


def quantize_blocks(x: torch.Tensor, top: int = 127) -> torch.Tensor:
    """x (M, K) float32 -> the values the kernels multiply where they round activations per block of 32: codes
    up to `top` times max|x| / top, the products in float64 (exact). 127: int8 codes (int4_gemv); 32767: int16
    codes (the float kernels' rows from 4, on AVX512-VNNI: csrc's `wide_tile`)."""
    M, K = x.shape
    xb = x.float().reshape(M, K // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # The kernel's arithmetic: x * (top / amax) rounded half to even (a tensor divided, where `top / amax`
    # would multiply by amax's reciprocal and round differently), d = amax / top in float32.
    inv = torch.where(amax > 0, torch.full_like(amax, float(top)) / amax, 0.0)
    codes = torch.round(xb * inv)
    return (codes.double() * (amax / top).double()).reshape(M, K)


def _int4_weights(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The (N, K) float32 weights the int4 kernels multiply: q * scale + min, scale and min rounded to float16."""
    N, G = scales.shape
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, G, group_size).float()
    s, m = (t.to(torch.float16).float()[..., None] for t in (scales, mins))
    return (codes * s + m).reshape(N, -1)


def int4_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_gemv` in plain torch, from the canonical operands: the activations quantized per block of 32,
    times the weights q * scale + min with scale and min rounded to float16 (the kernel's)."""
    return F.linear(quantize_blocks(x).float(), _int4_weights(qweight, scales, mins, group_size))


def int4_f32_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_gemv_f32` in plain torch: the float linear on the weights q * scale + min (float32 factors), summed
    in float64 (the kernel's float32 sums differ from it by their rounding alone)."""
    N, G = scales.shape
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(N, G, group_size).double()
    w = (codes * scales.double()[..., None] + mins.double()[..., None]).reshape(N, -1)
    return F.linear(x.double(), w).float()


def int4_bf16_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_gemm_bf16` in plain torch: x rounded to bf16, the weights q * scale + min (float16 scale and min)
    rounded to bf16, float32 sums."""
    w = _int4_weights(qweight, scales, mins, group_size).to(torch.bfloat16).float()
    return F.linear(x.to(torch.bfloat16).float(), w)


def int4_silu_gate_up_bf16_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`int4_silu_gate_up_bf16` in plain torch: silu(gate) * up of `int4_bf16_reference`'s sums (gate rows over
    up rows)."""
    gate, up = int4_bf16_reference(x, qweight, scales, mins, group_size).chunk(2, dim=-1)
    return F.silu(gate) * up


def int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_gemv` in plain torch: each activation row quantized to int8 with one scale (the int8-dyn
    scheme's), the int32 products summed exactly, then both scales."""
    x = x.float()
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    xq = torch.round(x / x_scale).clamp(-127, 127)
    acc = (xq.double() @ qweight.double().T).float()  # exact: products and sums of small integers
    return acc * x_scale * scales
