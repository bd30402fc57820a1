"""Ember's CPU kernels (ember.ops.cpu_ext): every instruction-set path this CPU can run against the plain-torch
twins, the modules that use them against torch's kernels, and the fallback when they cannot be built."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch
from torch import nn

from ember.ops import cpu_ext
from ember.quant import QuantSpec
from ember.quant.linear import INT8_GEMV_ROWS, pack_nibbles, quantize_int4_grouped, quantize_int8_per_channel

# Each build compiles the same source for one path (its own op namespace, so all load into one process).
BUILDS = {
    "native": ("ember_cpu", ()),
    "avx2": ("ember_cpu_avx2", ("-mno-avx512f", "-mno-avxvnni")),
    "scalar": ("ember_cpu_scalar", ("-mno-avx512f", "-mno-avx2", "-mno-fma")),
}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def ops(request):
    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    namespace, flags = BUILDS[request.param]
    if request.param == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_ext.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    simd = cpu_ext.load(namespace, flags)
    assert simd == {"native": simd, "avx2": "avx2", "scalar": "scalar"}[request.param]
    return getattr(torch.ops, namespace)


def activations(rows: int, K: int) -> torch.Tensor:
    """Rows with an outlier column, a block of zeros and values on exact rounding ties of their block's grid."""
    x = torch.randn(rows, K)
    x[:, 3] *= 40
    x[0, 32:64] = 0
    if K >= 128:  # a block whose codes all land on .5 before rounding: x * 127 / max = k + 0.5
        x[-1, 96:128] = torch.arange(32) - 15.5
        x[-1, 96] = -127.0
    return x


def int4_weights(N: int, K: int, group_size: int):
    """Random int4 weights: (codes, scales, mins) as quantized, the packed canonical `qweight`, and the
    kernels' layout (`tiles`, `scale_min`)."""
    codes, scales, mins = quantize_int4_grouped(torch.randn(N, K) * 0.05, group_size)
    qweight = pack_nibbles(codes)
    return (codes, scales, mins), qweight, cpu_ext.int4_tiles(qweight, scales, mins)


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_int4_gemv_is_its_twin(ops, group_size, rows):
    """Per block of 32 activations: int8 codes (half to even), their integer dot products with the codes, then
    scale and min (float16). Several tiles and groups; rows in runs of 4 and a remainder."""
    torch.manual_seed(group_size + rows)
    N, K = 48, 512
    (codes, scales, mins), qweight, (tiles, scale_min) = int4_weights(N, K, group_size)
    x = activations(rows, K)
    want = cpu_ext.int4_reference(x, qweight, scales, mins, group_size)
    got = ops.int4_gemv(x, tiles, scale_min, group_size)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 37])
def test_int4_gemv_f32_is_the_float_linear_on_the_dequantized_weights(ops, float_fmas, group_size, rows):
    """Float activations as they are, float32 scales and mins (not rounded to float16: a GGUF Q4_K's factors
    need more bits): the float64 linear on q * scale + min but for float32 sums. Every row count a tile meets
    (1-8 at once; the per-row chains of 1-3 rows), a remainder, and a prefill's many."""
    torch.manual_seed(group_size + rows)
    N, K = 48, 512
    (codes, scales, mins), qweight, _ = int4_weights(N, K, group_size)
    scales = scales * (1 + torch.rand_like(scales) * 1e-3)  # factors no float16 holds
    tiles, scale_min = cpu_ext.int4_tiles(qweight, scales, mins, torch.float32)
    x = activations(rows, K)
    want = cpu_ext.int4_f32_reference(x, qweight, scales, mins, group_size)
    got = ops.int4_gemv_f32(x, tiles, scale_min, group_size)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    # float16 factors would be further off than that: the test can tell them apart
    rounded = cpu_ext.int4_f32_reference(x, qweight, scales.half().float(), mins.half().float(), group_size)
    assert (rounded - want).abs().max() > 2e-5 * want.abs().max()


@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 37])
def test_int8_gemv_f32_is_the_float_linear_on_the_blocks_weights(ops, float_fmas, rows, block, with_mins):
    """int8 codes (-128..127: the layout's +128 taken off) times a float32 scale a block of 16 or 32 k, plus
    with mins a float32 min, float activations as they are: the float64 linear on q * scale (+ min) but for
    float32 sums."""
    torch.manual_seed(rows)
    N, K = 48, 512
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    scales = torch.rand(N, K // block) * 0.01
    mins = -torch.rand(N, K // block) if with_mins else None
    x = activations(rows, K)
    want = cpu_ext.int8_f32_reference(x, codes, scales, mins)
    tiles, tiled = cpu_ext.int8_tiles(codes), cpu_ext.int8_block_scales(scales)
    tiled_mins = None if mins is None else cpu_ext.int8_block_scales(mins)
    got = ops.int8_gemv_f32(x, tiles, tiled, block, tiled_mins)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    if with_mins:  # the mins are not nothing: the same codes and scales without them are far off
        without = cpu_ext.int8_f32_reference(x, codes, scales)
        assert (without - want).abs().max() > 1e-2 * want.abs().max()
    # the other block size's reading of the same scales would be far off: the test tells them apart
    with pytest.raises(RuntimeError, match=r"scales .* \(float32 or float16\)"):
        ops.int8_gemv_f32(x, tiles, cpu_ext.int8_block_scales(scales), 48 - block)
    with pytest.raises(RuntimeError, match=r"scales .* \(float32 or float16\)"):
        ops.int8_gemv_f32(x, tiles, scales.double(), block)
    with pytest.raises(RuntimeError, match=r"mins .* \(float32 or float16\)"):
        ops.int8_gemv_f32(x, tiles, tiled, block, tiled[:, :-1].contiguous())


@pytest.mark.parametrize("V", [1, 15, 16, 17, 1000, 49152])
def test_argmax_rows_is_torch_argmax(ops, V):
    """The first index of each row's largest value, a NaN counting as the largest (the first NaN): ties within and
    across the 16-wide vectors and in the scalar tail, a NaN after a larger finite value, +inf, a row of -inf
    (index 0), -0.0 beside 0.0, and rows of a wider tensor (a row stride past V)."""
    torch.manual_seed(V)
    x = torch.randn(9, V + 3)
    x[1, [V // 2, V - 1]] = 50.0
    x[2, [V - 1, V // 3]] = 50.0
    x[3, V // 2] = 1e30
    x[3, [V - 1, V // 3]] = float("nan")
    x[4, V // 2] = float("inf")
    x[5] = float("-inf")
    x[6] = 0.0
    x[6, [V - 1, V // 2]] = -0.0
    x[7, V - 1] = 60.0
    x[8] = -1.0
    x[8, [V // 4, V - 1]] = float("-inf")
    rows = x[:, :V]
    want = rows.argmax(dim=-1)
    assert torch.equal(ops.argmax_rows(rows), want)
    assert torch.equal(ops.argmax_rows(rows.contiguous()), want)
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(rows.double())


# bits -> (the codes' range, their tiles and high planes)
_TILED = {
    4: ((0, 16), lambda c: (cpu_ext.nibble_tiles(c), None)),
    5: ((0, 32), cpu_ext.int5_tiles),
    6: ((-32, 32), cpu_ext.int6_tiles),
    8: ((-128, 128), lambda c: (cpu_ext.int8_tiles(c), None)),
}


@pytest.mark.parametrize("form", ["float32", "float16", "coded"])
@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("bits", sorted(_TILED))
def test_tile_rows_are_the_rows_of_the_dequantized_weight(ops, bits, block, with_mins, form):
    """A tied embedding's lookup in a GGUF table's kept codes (`Int8BlockLinear.weight_rows`): rows of 4-, 5-, 6-
    or 8-bit tiles dequantized, float32(q) * scale then + min, each rounded in float32, bit for bit, with
    float32, float16 or coded factors (int8 codes of a float16 unit a run of 256 k); every code of each range
    (the 6-bit sign bit); any shape of ids, repeats, the first and last rows."""
    torch.manual_seed(bits + block + with_mins)
    N, K = 48, 512
    (low, high), tiled_codes = _TILED[bits]
    codes = torch.randint(low, high, (N, K), dtype=torch.int16)
    codes[0, :64] = torch.arange(64) % (high - low) + low  # every code
    codes = codes.to(torch.int8 if low < 0 else torch.uint8)

    def factors(sign: float) -> torch.Tensor:
        if form == "coded":  # a K type's: a float16 unit a run of 256 k times small integers
            unit = (torch.rand(N, K // 256) * 1e-3).half().float()
            return sign * unit.repeat_interleave(256 // block, dim=1) * torch.randint(1, 64, (N, K // block))
        f = torch.rand(N, K // block) * 0.01 * sign
        return f.half().float() if form == "float16" else f * (1 + torch.rand_like(f) * 1e-3)

    scales, mins = factors(1.0), factors(-1.0) if with_mins else None
    want = codes.float().reshape(N, -1, block) * scales[..., None]
    want = (want if mins is None else want + mins[..., None]).reshape(N, K)
    tiles, planes = tiled_codes(codes)
    compact = cpu_ext.compact_factors(
        [cpu_ext.int8_block_scales(scales), None if mins is None else cpu_ext.int8_block_scales(mins)], K
    )
    (tiled, units), (tiled_mins, min_units) = compact[0], compact[1] or (None, None)
    assert (units is not None) == (form == "coded") and tiled.dtype == {
        "float32": torch.float32, "float16": torch.float16, "coded": torch.int8
    }[form]  # fmt: skip

    def rows(ids, b=block, p=planes):
        return ops.tile_rows(tiles, p, ids, bits, b, tiled, tiled_mins, units, min_units)

    ids = torch.tensor([[0, 47, 16], [15, 16, 0]])
    assert torch.equal(rows(ids), want[ids.reshape(-1)])
    assert torch.equal(rows(torch.arange(N)), want)
    with pytest.raises(RuntimeError, match=r"row 48 is outside \[0, 48\)"):
        rows(torch.tensor([3, 48]))
    with pytest.raises(RuntimeError, match=r"scales .* do not match"):  # the other block size's factors
        rows(ids, b=48 - block)
    if bits in (5, 6):
        with pytest.raises(RuntimeError, match="high bits missing"):
            rows(ids, p=None)


@pytest.mark.parametrize("form", ["float32", "coded"])
@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_tile_rows_of_int4_groups_are_the_rows_of_the_dequantized_weight(ops, group_size, form):
    """A tied embedding's lookup in a 4-bit table's kept codes (`Int4WeightOnlyLinear.weight_rows`, a Q4_K or
    Q4_1 table): int4 tiles with (scale, min) pairs a group, float32 or coded as a K type's."""
    torch.manual_seed(group_size)
    N, K = 48, 512
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    if form == "coded":
        unit = (torch.rand(N, K // 256, 2) * 1e-3).half().float()
        pair = unit.repeat_interleave(256 // group_size, dim=1) * torch.randint(
            1, 64, (N, K // group_size, 2)
        )
        scales, mins = pair[..., 0], -pair[..., 1]
    else:
        scales, mins = torch.rand(N, K // group_size) * 0.01, -torch.rand(N, K // group_size) * 0.05
    want = (codes.float().reshape(N, -1, group_size) * scales[..., None] + mins[..., None]).reshape(N, K)
    tiles, scale_min = cpu_ext.int4_tiles(pack_nibbles(codes), scales, mins, torch.float32)
    ((scale_min, units),) = cpu_ext.compact_factors([scale_min], K)
    assert (units is not None) == (form == "coded")
    ids = torch.tensor([47, 0, 16, 16, 31])
    got = ops.tile_rows(tiles, None, ids, 4, group_size, scale_min, None, units)
    assert torch.equal(got, want[ids])
    assert torch.equal(
        ops.tile_rows(tiles, None, torch.arange(N), 4, group_size, scale_min, None, units), want
    )


@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_int6_gemv_f32_is_the_float_linear_on_the_6bit_weights(ops, float_fmas, rows, block, with_mins):
    """Signed 6-bit codes (-32..31: Q6_K's) as low nibbles and two planes of high bits, a float32 scale (and min)
    a block of 16 or 32 k: the float64 linear on q * scale (+ min) but for float32 sums; the tiles give the codes
    back, and each code's fifth and sixth (sign) bits count."""
    torch.manual_seed(rows + block + 1)
    N, K = 48, 512
    codes = torch.randint(-32, 32, (N, K), dtype=torch.int8)
    scales = torch.rand(N, K // block) * 0.01
    mins = -torch.rand(N, K // block) if with_mins else None
    x = activations(rows, K)
    want = cpu_ext.int8_f32_reference(x, codes, scales, mins)
    packed, high = cpu_ext.int6_tiles(codes)
    assert high.shape == (N // 16, K // 32 * 128) and torch.equal(cpu_ext.untile_int6(packed, high), codes)
    tiled, tiled_mins = (
        cpu_ext.int8_block_scales(scales),
        None if mins is None else cpu_ext.int8_block_scales(mins),
    )
    got = ops.int6_gemv_f32(x, packed, high, tiled, block, tiled_mins)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    for wrong in (
        codes & 15,
        codes & 31,
        (codes.to(torch.int16) & 63).to(torch.int8),
    ):  # a bit dropped or unsigned
        assert (
            cpu_ext.int8_f32_reference(x, wrong, scales, mins) - want
        ).abs().max() > 1e-2 * want.abs().max()
    with pytest.raises(RuntimeError, match=r"high bits .* do not match .* \(6-bit codes\)"):
        ops.int6_gemv_f32(x, packed, high[:, :-128].contiguous(), tiled, block, tiled_mins)


# Integer ranges of GGUF K types' factors of a run of 256 k (the unit an f16 d or -dmin): Q4_K / Q5_K scales and
# mins, Q6_K scales, Q3_K scales, Q2_K scales and mins
K_CODES = {"6bit": (0, 63), "int8": (-128, 127), "q3k": (-32, 31), "4bit": (0, 15)}


def k_factors(N: int, blocks: int, codes: tuple[int, int], per: int, seed: int) -> torch.Tensor:
    """(N, blocks) factors like a K type's: each run of `per` blocks an f16 unit (either sign, some runs all
    zero, units from 1e-6 to 10) times random integers in `codes`."""
    g = torch.Generator().manual_seed(seed)
    units = torch.randn(N, blocks // per, generator=g) * 10 ** torch.randint(
        -6, 2, (N, blocks // per), generator=g
    )
    units = units.half().float()
    units[0, 0] = 0.0
    ints = torch.randint(codes[0], codes[1] + 1, (N, blocks), generator=g).float()
    return ints * units.repeat_interleave(per, dim=1)


@pytest.mark.parametrize("kind", sorted(K_CODES))
@pytest.mark.parametrize("block", [16, 32])
def test_coded_factors_are_the_float_factors_bit_for_bit(kind, block):
    """K-type factors coded as int8 codes times a float16 unit a run of 256 k give back every float32 factor
    exactly; factors that are no one float16 times small integers (Q8_0's f16 a block) and widths that are no
    multiple of 256 are not coded."""
    N, K = 48, 1024
    scales = k_factors(N, K // block, K_CODES[kind], 256 // block, seed=block)
    tiled = cpu_ext.int8_block_scales(scales)
    codes, units = cpu_ext.coded_factors(tiled, K)
    assert codes.dtype == torch.int8 and codes.shape == tiled.shape and units.shape == (N // 16, K // 256, 16)
    assert units.dtype == torch.float16
    assert torch.equal(cpu_ext.uncoded(codes, units), tiled)
    # a run whose integers share an odd factor (3 d, 9 d, ...): its gcd past float16, the unit d (or 2^i d) instead
    lo, hi = K_CODES[kind]
    thirds = k_factors(
        N, K // block, (-(-lo // 3), hi // 3), 256 // block, seed=block + 1
    )  # codes 3 i: a K type's
    shared = cpu_ext.int8_block_scales(thirds * 3)
    codes, units = cpu_ext.coded_factors(shared, K)
    assert torch.equal(cpu_ext.uncoded(codes, units), shared)
    assert cpu_ext.coded_factors(tiled * 1e-6, K) is None  # units below float16's range
    pairs = cpu_ext.int4_tiles(torch.zeros(N, K // 2, dtype=torch.uint8), scales, -scales, torch.float32)[1]
    codes, units = cpu_ext.coded_factors(pairs, K)
    assert torch.equal(cpu_ext.uncoded(codes, units), pairs) and units.shape == (N // 16, K // 256, 2, 16)
    per_block = cpu_ext.int8_block_scales(torch.randn(N, K // block).half().float())  # Q8_0: an f16 a block
    assert cpu_ext.coded_factors(per_block, K) is None
    assert cpu_ext.coded_factors(cpu_ext.int8_block_scales(scales[:, : 640 // block]), 640) is None
    # compact_factors: coded where all code, else float16 where that holds them all, else float32 as they are
    ((codes, units), none) = cpu_ext.compact_factors([tiled, None], K)
    assert codes.dtype == torch.int8 and units is not None and none is None
    (half, units), (half_mins, _) = cpu_ext.compact_factors([per_block, -per_block], K)
    assert half.dtype == half_mins.dtype == torch.float16 and units is None
    assert torch.equal(cpu_ext.uncoded(half, None), per_block)
    finer = per_block * (1 + 1e-4)  # past float16's precision
    assert all(f.dtype == torch.float32 for f, _ in cpu_ext.compact_factors([per_block, finer], K))
    (a, _), (b, _) = cpu_ext.compact_factors([tiled, per_block], K)  # one form for both: not coded
    assert a.dtype == b.dtype != torch.int8


@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_coded_factors_compute_what_float_factors_do(ops, rows, block, with_mins):
    """int8, 6-bit, 5-bit and int4 codes with coded factors (`cpu_ext.coded_factors`) give the float32 factors' outputs
    bit for bit (each factor is the same float32 product), and so do float16 factors where they hold them."""
    N, K = 48, 1024
    codes = torch.randint(0, 16, (N, K), dtype=torch.int8, generator=torch.Generator().manual_seed(rows))
    scales = k_factors(N, K // block, K_CODES["6bit"], 256 // block, seed=rows)
    mins = -k_factors(N, K // block, K_CODES["6bit"], 256 // block, seed=rows + 1) if with_mins else None
    x = activations(rows, K)
    tiled = [None if f is None else cpu_ext.int8_block_scales(f) for f in (scales, mins)]
    coded = [None if f is None else cpu_ext.coded_factors(f, K) for f in tiled]
    units = [None if c is None else c[1] for c in coded]
    factors = [None if c is None else c[0] for c in coded]
    packed, high = cpu_ext.int5_tiles(codes)
    for op, operands in (
        (ops.int8_gemv_f32, (cpu_ext.int8_tiles(codes),)),
        (ops.int5_gemv_f32, (packed, high)),
        (ops.int6_gemv_f32, cpu_ext.int6_tiles(codes)),
    ):
        want = op(x, *operands, tiled[0], block, tiled[1])
        got = op(x, *operands, factors[0], block, factors[1], units[0], units[1])
        assert torch.equal(got, want)
        # float16 factors (a Q8_0's f16 d a block) against the same as float32
        halves = [None if f is None else (f / 64).half() for f in tiled]
        floats = [None if f is None else f.float() for f in halves]
        assert torch.equal(
            op(x, *operands, halves[0], block, halves[1]), op(x, *operands, floats[0], block, floats[1])
        )
    if block == 32 and with_mins:
        qweight = pack_nibbles(codes.to(torch.uint8))
        tiles, pairs = cpu_ext.int4_tiles(qweight, scales, mins, torch.float32)
        pair_codes, pair_units = cpu_ext.coded_factors(pairs, K)
        want = ops.int4_gemv_f32(x, tiles, pairs, 32)
        assert torch.equal(ops.int4_gemv_f32(x, tiles, pair_codes, 32, pair_units), want)
        with pytest.raises(RuntimeError, match=r"units .* do not match"):
            ops.int4_gemv_f32(x, tiles, pair_codes, 32, pair_units[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match=r"scales .* \(int8 codes beside units\)"):
        ops.int8_gemv_f32(x, cpu_ext.int8_tiles(codes), tiled[0], block, None, units[0])


@pytest.mark.parametrize("with_mins", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_int5_gemv_f32_is_the_float_linear_on_the_5bit_weights(ops, float_fmas, rows, block, with_mins):
    """5-bit codes (0..31) as low nibbles and a plane of fifth bits, a float32 scale (and min) a block of 16 or
    32 k: the float64 linear on q * scale (+ min) but for float32 sums; each code's fifth bit counts (the same
    codes with it cleared are far off)."""
    torch.manual_seed(rows + block)
    N, K = 48, 512
    codes = torch.randint(0, 32, (N, K), dtype=torch.int8)
    scales = torch.rand(N, K // block) * 0.01
    mins = -torch.rand(N, K // block) if with_mins else None
    x = activations(rows, K)
    want = cpu_ext.int8_f32_reference(x, codes, scales, mins)
    packed, high = cpu_ext.int5_tiles(codes)
    assert packed.shape == (N // 16, K // 32 * 256) and high.shape == (N // 16, K // 32 * 64)
    tiled, tiled_mins = (
        cpu_ext.int8_block_scales(scales),
        None if mins is None else cpu_ext.int8_block_scales(mins),
    )
    got = ops.int5_gemv_f32(x, packed, high, tiled, block, tiled_mins)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    nibbles = cpu_ext.int8_f32_reference(x, codes & 15, scales, mins)
    assert (nibbles - want).abs().max() > 1e-2 * want.abs().max()
    with pytest.raises(RuntimeError, match=r"high bits .* do not match"):
        ops.int5_gemv_f32(x, packed, high[:, :-64].contiguous(), tiled, block, tiled_mins)


def float_kernel_operands(
    kind: str, block: int, with_mins: bool, N: int, K: int, g: torch.Generator
) -> tuple:
    """Random codes of a float kernel's kind ("int4", "int8", "int6", "int5"), float32 scales (and mins) a block
    (int4: a group) of `block` k: (codes, scales, mins, the kernel's code operands, its factor operands)."""
    scales = torch.rand(N, K // block, generator=g) * 0.01
    mins = -torch.rand(N, K // block, generator=g) if with_mins else None
    if kind == "int4":
        codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
        tiles, pairs = cpu_ext.int4_tiles(pack_nibbles(codes), scales, mins, torch.float32)
        return codes, scales, mins, (tiles,), (pairs, block)
    low, high = {"int8": (-128, 128), "int6": (-32, 32), "int5": (0, 32)}[kind]
    codes = torch.randint(low, high, (N, K), dtype=torch.int8, generator=g)
    tiled_mins = None if mins is None else cpu_ext.int8_block_scales(mins)
    operands = {"int8": lambda: (cpu_ext.int8_tiles(codes),), "int6": lambda: cpu_ext.int6_tiles(codes),
                "int5": lambda: cpu_ext.int5_tiles(codes)}[kind]()  # fmt: skip
    return codes, scales, mins, operands, (cpu_ext.int8_block_scales(scales), block, tiled_mins)


class OutlierCase:
    """A float kernel of `kind` against rows of activations with a block whose other 31 values are 10^4 times
    smaller than its outlier: the linear on the weights (float64, `linear`), the bound 2^-bits of each block's
    largest |x| leaves, and x's rounding to one int8 code a block (the activations of int4_gemv and `gguf`)."""

    def __init__(self, ops, kind: str, block: int, with_mins: bool, rows: int) -> None:
        g = torch.Generator().manual_seed(rows + block)
        self.N, self.K = 48, 512
        self.x = activations(rows, self.K)
        self.x[:, 64] = 1e4
        self.codes, self.scales, self.mins, operands, factors = float_kernel_operands(
            kind, block, with_mins, self.N, self.K, g
        )
        op = getattr(ops, f"{kind}_gemv_f32")
        self.run = lambda: op(self.x, *operands, *factors)

    def linear(self, x: torch.Tensor, mins: bool = True) -> torch.Tensor:
        m = self.mins.double() if mins and self.mins is not None else None
        return cpu_ext.int8_f32_reference(x.double(), self.codes.to(torch.int8), self.scales.double(), m)

    def bound(self, bits: int) -> torch.Tensor:
        """Each weight times 2^-bits of its block's largest |x|."""
        rows, K = self.x.shape
        block_max = self.x.abs().reshape(rows, -1, 32).amax(-1, keepdim=True).expand(rows, K // 32, 32)
        weights = self.linear(torch.eye(K, dtype=torch.double))  # (K, N): the weights' transpose
        return 2.0**-bits * (block_max.reshape(rows, K).double() @ weights.double().abs())

    def int8_rounded(self) -> torch.Tensor:
        rows, K = self.x.shape
        d = self.x.reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
        return (
            (self.x.reshape(rows, -1, 32) / d).nan_to_num().round().mul(d).reshape(rows, K)
        )  # (a block of 0s)


@pytest.mark.parametrize(
    "kind,block,with_mins", [("int4", 32, True), ("int8", 32, False), ("int6", 16, True), ("int5", 32, True)]
)
@pytest.mark.parametrize("rows", [1, 2])
def test_float_kernels_take_x_as_three_int8_parts(ops, monkeypatch, kind, block, with_mins, rows):
    """One or two rows (a decode step's; AVX512-VNNI, AVX-VNNI or AVX2), meeting a tile at once:
    each block of 32 activations as three int8 parts of one scale, multiplied by the codes in integer dot
    products, so x is held to 2^-24 of its block's largest |x|: the float64 linear within float32's error even
    beside an outlier 10^4 times its block, though not the FMA path's bits."""
    if ops.simd() == "scalar":
        pytest.skip("the portable build keeps float FMAs")
    case = OutlierCase(ops, kind, block, with_mins, rows)
    got = case.run()
    monkeypatch.setenv("EMBER_CPU_SPLIT", "0")
    on_fma = case.run()
    want = case.linear(case.x)
    # the bound: each weight times 2^-22 of its block's largest |x| (x's parts leave 2^-24 of it, the float32
    # sums as much again); the FMA path's float32 sums keep it too
    bound = case.bound(22)
    assert ((got - want).abs() <= bound).all()
    assert ((on_fma - want).abs() <= bound).all()
    assert not torch.equal(got, on_fma)
    # one int8 part alone (the activations' rounding in int4_gemv) would be far past it
    assert ((case.linear(case.int8_rounded()) - want).abs() > 10 * bound).any()


@pytest.mark.parametrize(
    "kind,block,with_mins", [("int5", 32, True), ("int5", 16, False), ("int6", 16, True), ("int6", 32, False)]
)
def test_many_rows_meet_the_codes_as_floats_with_the_same_bits(ops, float_fmas, kind, block, with_mins):
    """From 32 rows the 5- and 6-bit float kernels turn each tile's codes into floats once, for all the runs of
    rows that meet it, where fewer rows turn them again for each run: the same sums, bit for bit (rows in calls
    of 8 against one call of 40, then 75), and the float linear's values."""
    if "amx" in ops.simd():
        pytest.skip("from 16 rows the tile unit takes them here (the other builds run this)")
    g = torch.Generator().manual_seed(block + 7 * with_mins)
    N, K = 48, 512
    codes, scales, mins, operands, factors = float_kernel_operands(kind, block, with_mins, N, K, g)
    op = getattr(ops, f"{kind}_gemv_f32")
    for rows in (40, 75):
        x = activations(rows, K)
        got = op(x, *operands, *factors)
        in_runs = torch.cat([op(x[i : i + 8].contiguous(), *operands, *factors) for i in range(0, rows, 8)])
        if rows % 8 > 2:  # (a last call of 1 or 2 rows takes x in int8 parts instead: other sums)
            assert torch.equal(got, in_runs)
        want = cpu_ext.int8_f32_reference(x, codes.to(torch.int8), scales, mins)
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize(
    "kind,block,with_mins",
    [("int4", 32, True), ("int4", 128, True), ("int5", 32, True), ("int5", 16, False), ("int6", 16, True),
     ("int6", 32, False), ("int8", 32, False), ("int8", 16, True)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [4, 9, 40, 270])  # 270: past a chunk of rows (256 of K 512), a last run of 6
def test_a_prefills_rows_take_x_as_int16_codes(ops, monkeypatch, kind, block, with_mins, rows):
    """From 4 rows (AVX512-VNNI, the rows the tile unit leaves) each block of 32 activations is one int16 code of
    its scale, multiplied by the codes in integer dot products: the float64 linear on x rounded so
    (`quantize_blocks(x, 32767)`; the min term from x as it is) but for float32 sums, so within 2^-16 of each
    block's largest |x| of the float linear, beside an outlier 10^4 times its block; not the FMA path's bits."""
    if not ops.simd().startswith("avx512-vnni"):
        pytest.skip("only the AVX512-VNNI build takes x as int16 codes")
    monkeypatch.setenv("EMBER_CPU_AMX_F32", "0")  # every row on the vector path
    case = OutlierCase(ops, kind, block, with_mins, rows)
    got = case.run()
    rounded = case.linear(cpu_ext.quantize_blocks(case.x, 32767), mins=False)
    if case.mins is not None:  # sum_k x over each block of the mins, x as it is
        rounded += case.x.double().reshape(rows, -1, block).sum(-1) @ case.mins.double().T
    assert (got - rounded).abs().max() <= 2e-6 * rounded.abs().max()
    want = case.linear(case.x)
    bound = case.bound(16)
    assert ((got - want).abs() <= bound).all()
    monkeypatch.setenv("EMBER_CPU_WIDE", "0")
    assert not torch.equal(got, case.run())
    # int8 codes (`--quantize gguf`'s activations) would be past the bound
    assert ((case.linear(case.int8_rounded()) - want).abs() > bound).any()


def amx_builds() -> tuple:
    """The native build and one without AMX, for CPUs whose kernels run on the tile unit (else a skip)."""
    if not cpu_ext.available() or not cpu_ext.amx_bf16():
        pytest.skip("no AMX on this CPU (or no tile state for this process)")
    cpu_ext.load("ember_cpu_no_amx", ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"))
    assert "amx" not in torch.ops.ember_cpu_no_amx.simd()
    return torch.ops.ember_cpu, torch.ops.ember_cpu_no_amx


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [16, 37, 130])
def test_int4_gemv_on_the_tile_unit_is_the_vector_path_bit_for_bit(group_size, rows):
    """From 16 rows the int8 codes' sums come from AMX (16 rows at a time, the rest on the vector path), and
    are scaled with the vector path's instructions in its order: the same bits."""
    amx, vector = amx_builds()
    torch.manual_seed(rows)
    N, K = 80, 640  # five tiles; 20 blocks (pairs of them on the tile unit)
    (codes, scales, mins), qweight, (tiles, scale_min) = int4_weights(N, K, group_size)
    x = activations(rows, K)
    got = amx.int4_gemv(x, tiles, scale_min, group_size)
    assert torch.equal(got, vector.int4_gemv(x, tiles, scale_min, group_size))
    want = cpu_ext.int4_reference(x, qweight, scales, mins, group_size)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("group_size", [32, 64, 256])
@pytest.mark.parametrize("rows,N", [(1, 48), (17, 48), (64, 80), (100, 96)])
def test_int4_gemm_bf16_is_its_twin(group_size, rows, N):
    """bf16 activations and dequantized bf16 weights on the tile unit, float32 sums: rows padded to pairs of
    16, output tiles in pairs and an odd one, every group size."""
    amx, _ = amx_builds()
    torch.manual_seed(group_size + rows)
    K = 512
    (codes, scales, mins), qweight, (tiles, scale_min) = int4_weights(N, K, group_size)
    x = activations(rows, K)
    got = amx.int4_gemm_bf16(x, tiles, scale_min, group_size)
    assert got.shape == (rows, N) and got.is_contiguous()
    want = cpu_ext.int4_bf16_reference(x, qweight, scales, mins, group_size)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # float32 sums in another order
    # bf16 activations are closer to the float product than the int8 codes are
    w = codes.float().reshape(N, -1, group_size) * scales[..., None] + mins[..., None]
    exact = x @ w.reshape(N, K).T
    codes_err = (amx.int4_gemv(x, tiles, scale_min, group_size) - exact).abs().mean()
    assert (got - exact).abs().mean() < codes_err


@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("rows,N", [(1, 64), (17, 96), (64, 64), (100, 160)])
def test_int4_silu_gate_up_bf16_is_its_twin(group_size, rows, N):
    """silu(gate) * up applied to int4_gemm_bf16's sums (gate rows over up rows) as they leave the tile unit:
    gate tiles paired with their up tiles, an odd number of pairs, large sums of either sign."""
    amx, _ = amx_builds()
    torch.manual_seed(group_size + rows)
    K = 512
    (codes, scales, mins), qweight, (tiles, scale_min) = int4_weights(N, K, group_size)
    x = activations(rows, K) * 8  # sums past the exponent's clamp (|gate| > 88) in both directions
    got = amx.int4_silu_gate_up_bf16(x, tiles, scale_min, group_size)
    assert got.shape == (rows, N // 2) and got.is_contiguous()
    want = cpu_ext.int4_silu_gate_up_bf16_reference(x, qweight, scales, mins, group_size)
    gate = cpu_ext.int4_bf16_reference(x, qweight, scales, mins, group_size)[:, : N // 2]
    assert gate.abs().max() > 88
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(RuntimeError, match="whole tiles of 16 rows; got 48 rows"):
        amx.int4_silu_gate_up_bf16(x, tiles[:3], scale_min[:3], group_size)


@pytest.mark.parametrize(
    "kind,block,with_mins",
    [
        ("int4", 32, True),
        ("int4", 128, True),
        ("int8", 16, False),
        ("int8", 32, True),
        ("int6", 16, True),
        ("int5", 32, False),
    ],
)
@pytest.mark.parametrize("rows,N,K", [(16, 48, 512), (37, 80, 1280), (130, 64, 2304)])
def test_float_kernels_on_the_tile_unit_keep_float32_sums(kind, block, with_mins, rows, N, K, float_fmas):
    """From 16 rows the float kernels take their rows 16 at a time to the tile unit, x as three bf16 parts whose
    products with the codes are exact: the float64 linear within float32 sums' error, as on the vector path
    (its FMAs: `float_fmas`), though not in its order; rounding x to bf16 instead would be far off. Ranges of K
    past one (1280, 2304), an odd tile, rows left to the vector path, blocks of 16 and 32 and int4 groups."""
    amx, vector = amx_builds()
    g = torch.Generator().manual_seed(rows + block)
    x = activations(rows, K)
    codes, scales, mins, operands, factors = float_kernel_operands(kind, block, with_mins, N, K, g)
    name = f"{kind}_gemv_f32"
    got = getattr(amx, name)(x, *operands, *factors)
    on_vector = getattr(vector, name)(x, *operands, *factors)
    want = cpu_ext.int8_f32_reference(x.double(), codes.to(torch.int8), scales.double(),
                                      None if mins is None else mins.double())  # fmt: skip
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    assert (on_vector - want).abs().max() <= 2e-6 * want.abs().max()
    assert not torch.equal(got, on_vector)  # the tile unit's sums, not the vector path's
    left = rows // 16 * 16  # the rows left over: as the vector path computes them alone
    assert torch.equal(got[left:], getattr(vector, name)(x[left:].contiguous(), *operands, *factors))
    rounded = cpu_ext.int8_f32_reference(x.bfloat16().double(), codes.to(torch.int8), scales.double(),
                                         None if mins is None else mins.double())  # fmt: skip
    assert (rounded - want).abs().max() > 1e-4 * want.abs().max()


def int4_projection(out_features: int) -> tuple[nn.Module, tuple]:
    """A prepared int4-g32 projection of 128 features (dynamo reset for a fresh compile) and its canonical
    operands, as the twins take them."""
    torch._dynamo.reset()
    q = QuantSpec.parse("int4-g32").make(nn.Linear(128, out_features, bias=False))
    q.prepare()
    return q, (q.qweight, q.scales, q.mins, 32)


def test_int4_gate_up_takes_the_fused_activation_from_amx_bf16_rows():
    """An int4 MLP's gate/up and its activation run as one kernel from AMX_BF16_ROWS rows, eager and compiled
    alike; fewer rows run the projection, then the activation."""
    amx_builds()
    from torch._inductor.utils import run_and_get_code

    from ember.ops.linear import silu_gate_up

    q, args = int4_projection(96)
    compiled = torch.compile(silu_gate_up, dynamic=True)
    with torch.no_grad():
        for rows, fused in ((cpu_ext.AMX_BF16_ROWS - 1, False), (cpu_ext.AMX_BF16_ROWS, True), (150, True)):
            x = torch.randn(rows, 128)
            y = silu_gate_up(q, x)
            if fused:
                want = cpu_ext.int4_silu_gate_up_bf16_reference(x, *args)
            else:
                gate, up = cpu_ext.int4_reference(x, *args).chunk(2, dim=-1)
                want = torch.nn.functional.silu(gate) * up
            assert (y - want).abs().max() <= 1e-5 * want.abs().max()
            got, code = run_and_get_code(compiled, q, x)
            assert ("ember_cpu.int4_silu_gate_up_bf16" in "".join(code)) == fused
            if fused:  # one op, eager or compiled
                assert torch.equal(got, y)
            else:  # inductor's silu and aten's may differ in the last bit
                assert (got - y).abs().max() <= 1e-6 * y.abs().max()


def test_int4_projections_take_the_tile_unit_from_amx_bf16_rows():
    """A prefill's rows (from AMX_BF16_ROWS) run int4_gemm_bf16, eager and compiled alike; fewer rows keep the
    int8 codes."""
    amx_builds()
    from torch._inductor.utils import run_and_get_code

    q, args = int4_projection(64)
    compiled = torch.compile(q, dynamic=True)
    with torch.no_grad():
        for rows, twin, op in (
            (cpu_ext.AMX_BF16_ROWS - 1, cpu_ext.int4_reference, "int4_gemv"),
            (cpu_ext.AMX_BF16_ROWS, cpu_ext.int4_bf16_reference, "int4_gemm_bf16"),
            (200, cpu_ext.int4_bf16_reference, "int4_gemm_bf16"),
        ):
            x = torch.randn(rows, 128)
            y = q(x)
            want = twin(x, *args)
            assert (y - want).abs().max() <= 1e-5 * want.abs().max()
            got, code = run_and_get_code(compiled, x)
            assert f"ember_cpu.{op}" in "".join(code)
            assert torch.equal(got, y)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_int8_gemv_gives_int_mm_sums(ops, rows):
    """One int8 scale per activation row (int8-dyn's): the exact int32 sums torch._int_mm gives, times both
    scales."""
    torch.manual_seed(rows)
    N, K = 64, 320
    qweight, scales = quantize_int8_per_channel(torch.randn(N, K))
    x = activations(rows, K)
    got = ops.int8_gemv(x, cpu_ext.int8_tiles(qweight), scales)
    want = cpu_ext.int8_reference(x, qweight, scales)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    xq = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    sums = torch._int_mm(xq, qweight.t())
    assert torch.allclose(got, sums.float() * x_scale * scales, rtol=1e-6, atol=0)


def test_bad_operands_are_refused(ops):
    tiles, scale_min = cpu_ext.int4_tiles(
        torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    with pytest.raises(RuntimeError, match="do not match K"):
        ops.int4_gemv(torch.zeros(1, 96), tiles, scale_min, 32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int4_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), tiles, scale_min, 32)
    with pytest.raises(RuntimeError, match=r"scale_min .* \(float32 or float16\)"):
        ops.int4_gemv_f32(torch.zeros(1, 64), tiles, scale_min.double(), 32)
    tiles, scale_min = cpu_ext.int4_tiles(
        torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2), torch.float32
    )
    with pytest.raises(RuntimeError, match="does not tile K"):
        ops.int4_gemv_f32(torch.zeros(1, 64), tiles, scale_min, 48)


def test_an_error_message_formats_its_sizes(ops):
    # The kernels' errors are formatted by c10's streams: a build holding a second, static libstdc++ (a g++
    # wrapper adding -static-libstdc++, on one GPU host) cut such a message after "[" here and crashed the
    # process there. The sizes must come out whole.
    with pytest.raises(RuntimeError, match=r"logits \[3, 5\] Double: \(B, V\) float32"):
        ops.argmax_rows(torch.zeros(3, 5, dtype=torch.float64))


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")
def test_the_kernels_link_the_process_libstdcxx():
    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    dynamic = subprocess.run(["readelf", "-d", str(cpu_ext.build())], capture_output=True, text=True).stdout
    assert "[libstdc++.so" in dynamic  # shared, as torch's libraries use it; not a second copy inside


@pytest.mark.skipif(
    shutil.which("readelf") is None or shutil.which("g++") is None, reason="no readelf or g++"
)
def test_the_link_takes_the_process_libstdcxx_where_the_driver_finds_the_archive_first(tmp_path):
    # One GPU host's g++ searched folders of its own first, holding only libstdc++.a: "-lstdc++" took the archive
    # there. Here a folder named first with -L does the same; the process's library, named by its path, does not.
    static = subprocess.run(
        ["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(static):
        pytest.skip("no static libstdc++ to stand in for that driver's")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libstdc++.a").symlink_to(static)
    src = tmp_path / "t.cpp"
    src.write_text(
        "#include <sstream>\n#include <string>\nstd::string f(long x) { std::ostringstream s; s << x; return s.str(); }\n"
    )
    for name, lib in (("archive", "-lstdc++"), ("process", cpu_ext._process_libstdcxx())):
        so = tmp_path / f"{name}.so"
        link = ["g++", f"-L{tmp_path / 'lib'}", "-shared", "-fPIC", str(src), "-o", str(so), lib]
        subprocess.run(link, check=True, capture_output=True)
        dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
        assert ("[libstdc++.so" in dynamic) == (name == "process"), name


def test_modules_run_ember_kernels_and_int8_dyn_agrees_across_its_kernels():
    """int4 projections take the kernel at any row count eager; int8-dyn up to INT8_GEMV_ROWS rows, then
    torch._int_mm, with the same sums."""
    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    q4 = QuantSpec.parse("int4-g64").make(linear)
    q4.prepare()
    assert q4._kernel == "cpu_dot"
    assert q4.bytes_read() == q4._tiles.numel() + 2 * q4._scale_min.numel() + 4 * 96  # codes, scales, bias
    x = torch.randn(7, 256)
    with torch.no_grad():
        want = cpu_ext.int4_reference(x, q4.qweight, q4.scales, q4.mins, 64) + linear.bias
        assert torch.allclose(q4(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
        q8 = QuantSpec.parse("int8-dyn").make(linear)
        q8.prepare()
        assert q8._gemv
        x = torch.randn(INT8_GEMV_ROWS + 1, 256)
        whole = q8(x)  # _int_mm
        rows = torch.cat([q8(x[i : i + 4]) for i in range(0, len(x), 4)])  # Ember's kernel
        assert torch.allclose(rows, whole, rtol=1e-6, atol=1e-6)
        want = cpu_ext.int8_reference(x, q8.qweight, q8.scales) + linear.bias
        assert torch.allclose(whole, want, rtol=1e-6, atol=1e-6)


def test_compiled_int4_projections_call_the_kernel_at_any_rows():
    """A decode step's row and a prefill's many (where torch's int4 kernel gives way to a bf16 GEMM; Ember's
    runs on the tile unit in bf16 there where the CPU has one)."""
    if not cpu_ext.available():
        pytest.skip("Ember's CPU kernels are not built on this machine")
    from torch._inductor.utils import run_and_get_code

    q, _ = int4_projection(64)
    compiled = torch.compile(q, dynamic=True)
    with torch.no_grad():
        for rows in (1, 200):
            x = torch.randn(rows, 128)
            y, code = run_and_get_code(compiled, x)
            many = rows >= cpu_ext.AMX_BF16_ROWS and cpu_ext.amx_bf16()
            assert f"ember_cpu.{'int4_gemm_bf16' if many else 'int4_gemv'}" in "".join(code)
            assert torch.equal(y, q(x))


def test_kernels_that_cannot_be_built_leave_torch_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_ext, "_LOADED", {})  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="ember.ops.cpu_ext"):
        assert cpu_ext.available.__wrapped__() is False
    assert "could not be built" in caplog.text and "no-such-compiler" in caplog.text
    monkeypatch.setenv("EMBER_CPU_KERNELS", "0")
    assert cpu_ext.available.__wrapped__() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,H,K,S,D,window",
    [
        (1, 9, 3, 256, 64, 0),
        (3, 8, 2, 100, 80, 0),
        (2, 4, 4, 64, 32, 7),
        (1, 2, 1, 40, 256, 40),
        (3, 12, 2, 300, 64, 0),
        (2, 5, 1, 400, 128, 200),
    ],
)
def test_decode_attention_reads_the_slots_each_row_sees(ops, dtype, B, H, K, S, D, window):
    """Against the masked reference over every slot: grouped heads (1 to 6 a kv head), rows at their own
    positions (the first and last slot among them), a sliding window; slots past a row's position hold values
    it must not read. Rows past 128 visible slots are split into runs and merged (a window's too), beside rows
    with fewer runs."""
    from ember.ops.decode_attention import attend_reference

    torch.manual_seed(S + D)
    q = torch.randn(B, H, D, dtype=dtype)
    k_cache, v_cache = (torch.randn(B, K, S, D, dtype=dtype) for _ in range(2))
    positions = torch.tensor([0, S - 1, S // 2][:B])
    for b, p in enumerate(positions.tolist()):
        k_cache[b, :, p + 1 :] = 1e4  # the reference masks these (a NaN would poison its matmul)
        v_cache[b, :, p + 1 :] = 1e4
    want = attend_reference(q.float(), k_cache.float(), v_cache.float(), positions, D**-0.5, window)
    got = ops.decode_attention(q, k_cache, v_cache, positions, D**-0.5, window)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the result's rounding
    assert (got.float() - want).abs().max() < tol


def test_decode_attention_refuses_a_position_outside_the_cache(ops):
    q, cache = torch.zeros(1, 2, 16), torch.zeros(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="position 8 is outside the cache's 8 slots"):
        ops.decode_attention(q, cache, cache, torch.tensor([8]), 0.25, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("S", [24, 200])
def test_paged_decode_attention_follows_each_rows_slots(ops, dtype, window, S):
    """Rows whose tokens lie in scattered pool slots (a block table's), at their own positions: the static
    kernel's answer on the rows gathered in order (runs of slots merged alike); pool slots no row sees hold
    values that would show."""
    torch.manual_seed(window)
    B, H, K, D, pool = 3, 6, 2, 64, 100 + S
    q = torch.randn(B, H, D, dtype=dtype)
    k_pool, v_pool = (torch.full((pool, K, D), 1e4, dtype=dtype) for _ in range(2))
    slots = torch.stack([torch.randperm(pool)[:S] for _ in range(B)])  # (B, S)
    positions = torch.tensor([0, S - 1, 10])
    for b, p in enumerate(positions.tolist()):
        k_pool[slots[b, : p + 1]] = torch.randn(p + 1, K, D, dtype=dtype)
        v_pool[slots[b, : p + 1]] = torch.randn(p + 1, K, D, dtype=dtype)
    got = ops.paged_decode_attention(q, k_pool, v_pool, slots, positions, D**-0.5, window)
    k_rows, v_rows = (pool_[slots].transpose(1, 2) for pool_ in (k_pool, v_pool))  # (B, K, S, D)
    want = ops.decode_attention(q, k_rows.contiguous(), v_rows.contiguous(), positions, D**-0.5, window)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=f"outside the pool's {pool}"):
        bad = slots.clone()
        bad[1, S - 1] = pool  # row 1 sees its last slot under any window
        ops.paged_decode_attention(q, k_pool, v_pool, bad, positions, D**-0.5, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,H,K,D,rotary,window", [(1, 9, 3, 64, 64, 0), (2, 4, 2, 32, 16, 5), (3, 8, 8, 128, 128, 0)]
)
def test_rope_decode_attention_is_the_rope_the_writes_and_decode_attention(
    ops, dtype, B, H, K, D, rotary, window
):
    """Bit for bit the eager ops it stands for in a decode step (`apply_rope_qk`, the cache writes at each row's
    position, `decode_attention`), partial rotary included; the caches' other slots and rows untouched, and a
    cache of another dtype written as index_put converts."""
    from ember.ops.rope import apply_rope_qk

    torch.manual_seed(D + rotary)
    S = 40
    q, k, v = (torch.randn(B, 1, n, D, dtype=dtype) for n in (H, K, K))
    cos, sin = torch.randn(B, 1, rotary), torch.randn(B, 1, rotary)
    positions = torch.tensor([0, S - 1, 17][:B])
    for cache_dtype in (dtype, torch.float32 if dtype == torch.bfloat16 else torch.bfloat16):
        k_cache, v_cache = (torch.randn(B + 1, K, S, D, dtype=dtype).to(cache_dtype) for _ in range(2))
        want_k, want_v = k_cache.clone(), v_cache.clone()
        qr, kr = apply_rope_qk(q, k, cos, sin)
        rows = torch.arange(B)[:, None]
        want_k[rows, :, positions[:, None]] = kr.to(cache_dtype)
        want_v[rows, :, positions[:, None]] = v.to(cache_dtype)
        want = ops.decode_attention(qr[:, 0], want_k[:B], want_v[:B], positions, D**-0.5, window)
        got = ops.rope_decode_attention(
            q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], k_cache, v_cache, positions, D**-0.5, window
        )
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), cache_dtype
        assert got.dtype == dtype and torch.equal(got, want), cache_dtype
    with pytest.raises(RuntimeError, match=f"position {S} is outside the cache's {S} slots"):
        ops.rope_decode_attention(
            q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], k_cache, v_cache, positions + S, 0.1, 0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,K,D,rotary", [(1, 37, 9, 3, 64, 64), (2, 5, 4, 2, 32, 16)])
def test_rope_prompt_write_is_the_rope_and_the_cache_writes(ops, dtype, B, T, H, K, D, rotary):
    """A prompt's rows on a static cache (q, k, v strided views of one projection's output, as a layer hands them
    over): bit for bit `apply_rope_qk` and the writes at each row's positions; the caches' other slots and rows
    untouched, and a cache of another dtype written as index_put converts."""
    from ember.ops.rope import apply_rope_qk

    torch.manual_seed(T + rotary)
    S = 50
    qkv = torch.randn(B, T, (H + 2 * K) * D, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, K * D, K * D], dim=-1))
    cos, sin = torch.randn(B, T, rotary), torch.randn(B, T, rotary)
    positions = torch.arange(T)[None] + torch.tensor([0, S - T][:B])[:, None]  # (B, T)
    for cache_dtype in (dtype, torch.float32 if dtype == torch.bfloat16 else torch.bfloat16):
        k_cache, v_cache = (torch.randn(B + 1, K, S, D, dtype=dtype).to(cache_dtype) for _ in range(2))
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_q, kr = apply_rope_qk(q, k, cos, sin)
        rows = torch.arange(B)[:, None]
        want_k[rows, :, positions], want_v[rows, :, positions] = kr.to(cache_dtype), v.to(cache_dtype)
        got_q, got_k = ops.rope_prompt_write(q, k, v, cos, sin, k_cache, v_cache, positions)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, kr), cache_dtype
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), cache_dtype
    with pytest.raises(RuntimeError, match=f"position {S} is outside the cache's {S} slots"):
        ops.rope_prompt_write(q, k, v, cos, sin, k_cache, v_cache, positions + S - positions.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_write_is_the_rope_and_the_pool_writes(ops, dtype, rotary):
    """A paged cache's tokens (each its own rope angles and pool slot): bit for bit `apply_rope_qk` and the
    writes at slot_mapping; the pool's other slots untouched."""
    from ember.ops.rope import apply_rope_qk

    torch.manual_seed(rotary)
    N, H, K, D, pool = 5, 6, 2, 64, 30
    q, k, v = (torch.randn(1, N, n, D, dtype=dtype) for n in (H, K, K))
    cos, sin = torch.randn(1, N, rotary), torch.randn(1, N, rotary)
    slot_mapping = torch.randperm(pool)[:N]
    k_pool, v_pool = (torch.randn(pool, K, D, dtype=dtype) for _ in range(2))
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_q, kr = apply_rope_qk(q, k, cos, sin)
    want_k[slot_mapping], want_v[slot_mapping] = kr[0], v[0]
    got = ops.rope_write(q[0], k[0], v[0], cos[0], sin[0], k_pool, v_pool, slot_mapping)
    assert torch.equal(got, want_q[0]) and torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(RuntimeError, match=f"slot {pool} is outside the pool's {pool}"):
        ops.rope_write(q[0], k[0], v[0], cos[0], sin[0], k_pool, v_pool, slot_mapping.clamp(max=0) + pool)
