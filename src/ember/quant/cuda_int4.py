"""The int4 decode GEMV on tensor cores in CUDA C++ (`csrc/int4_gemv.cu`, built by NVRTC: `ember.ops.cuda_rtc`).

Same layout, function and outputs as the Triton tensor-core GEMV (`ember.quant.triton_mma.int4_mma_gemv`:
`kernels.int4_mma_tile` words, `kernels.int4_mma_scales` factors, bf16 activations, up to 8 rows; y in bf16
or float32 partial sums over runs of K). A configuration is a block shape (`CONFIGS`); where `OFFERED`, they
join the Triton kernel's tuner candidates, so each shape runs whichever kernel is faster on the device in hand.
It also runs a gate/up projection with SwiGLU applied as it stores (`silu_gate_up`), which the Triton kernel
does not: with `WHOLE_ROWS` an int4 MLP's gate/up is one kernel (`Int4WeightOnlyLinear.fused_silu_gate_up`).
With `A8` (off: it lost, see below), one activation row (a decode step) is rounded to int8 in blocks of 32 by
each block of the kernel and multiplied on the integer tensor cores (`rounds`; `a8_reference` is that arithmetic
in torch). With `ROUNDED_ROWS` the row comes rounded by the norm kernel before the GEMV (`round_row`'s layout;
`linear_rounded`), for a pre-norm int4 layer's qkv and gate/up (`ember.models.decoder.DecoderLayer.rounds`).
With `FOLD_NORMS` an int4 layer's RMSNorms are carried across the GEMVs either side of them, with no norm
kernel: the projection before a norm (o; down, into the next layer) adds the residual and hands on the row
times the norm's weight and its sums of squares (`linear_add_norm`), the one after it (gate/up; qkv) applies
the norm's factor to its sums (`normed_linear`; `ember.models.decoder.DecoderLayer.carries_norm`).

Shape legend: M rows of activations, K input features, N output features, g group size, S runs of K.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ember.ops import cuda_rtc

SOURCE = Path(__file__).with_name("csrc") / "int4_gemv.cu"
MAX_ROWS = 8  # activation rows: the mma's 8 columns
GROUP_STEPS = (1, 2, 4)  # steps of 64 k a group: the int4 module's group sizes of 64 and more
# (TW, KW, DEPTH, LEAN, ASYNC): TW tiles of 16 rows a block, KW warps a tile (each taking every KW-th group of
# the run), DEPTH groups of weights a warp keeps in flight; LEAN: the activations loaded where used (not a
# group ahead) and at most 64 registers, so that 1024 threads fit a multiprocessor; ASYNC: the groups in
# flight held in shared memory (cp.async), not registers, so DEPTH can be 8.
_SHAPES = [
    *[(4, 1, 2), (8, 1, 2), (4, 1, 4), (2, 2, 2)],  # for short runs (K split over blocks)
    *[(2, 4, 2), (1, 4, 2), (1, 4, 4), (1, 8, 2), (1, 8, 4), (2, 8, 2), (1, 16, 2)],  # for long runs
]
# ASYNC: rings of 4-8 groups a warp (the register ones hold 2-4), within 48 KB of shared memory a block
_ASYNC_SHAPES = [(1, 4, 8), (1, 4, 6), (1, 8, 4), (2, 4, 4), (1, 16, 2), (4, 1, 8)]
CONFIGS = (
    [(*c, False, False) for c in _SHAPES]
    + [(*c, True, False) for c in _SHAPES if c[2] == 2]
    + [(*c, False, True) for c in _ASYNC_SHAPES]
)
# Whether the tuner times these block shapes beside the Triton kernel's (tests/quant/test_cuda_int4.py passed
# on an H100; BENCHMARKS.md, twenty-fourth session).
OFFERED = True

# With the kernel offered, K is split by the warps of a block (KW) instead of over blocks leaving float32
# partials (`ember.quant.triton_mma.row_splits`): the int4-g128 Llama-3-8B step took 2357 us against 2425, and
# 2088 us against 2181 with gate/up + SwiGLU as one kernel (H100, BENCHMARKS.md, twenty-fourth session).
WHOLE_ROWS = True

# Gate/up + SwiGLU (`silu_gate_up`): a block holds TW gate tiles and their TW up tiles, so 2 TW KW warps.
_GLU_SHAPES = [(2, 1, 2), (1, 2, 2), (1, 4, 2), (1, 4, 4), (2, 2, 2), (1, 8, 2), (2, 4, 2)]
_GLU_ASYNC_SHAPES = [(1, 2, 8), (1, 2, 4), (2, 1, 8), (1, 4, 4), (2, 2, 4)]
GLU_CONFIGS = (
    [(*c, False, False) for c in _GLU_SHAPES]
    + [(*c, True, False) for c in _GLU_SHAPES if c[2] == 2]
    + [(*c, False, True) for c in _GLU_ASYNC_SHAPES]
)
# LEAN spills registers to the stack past groups of 128 (ptxas, sm_90: 112-120 bytes at 256; 8-24 at 128)
LEAN_MAX_STEPS = 2
# Whether the tuner times the LEAN configurations too (GPU tests passed on an H100; it took one for down, and
# the int4-g128 step went 2086 -> 2060 us: BENCHMARKS.md, twenty-fourth session).
LEAN_OFFERED = True
# Whether the tuner times the ASYNC configurations too (GPU tests passed on an H100; offered, the int4-g128
# step went 2016.2 -> 2007.4 us there, same tokens: BENCHMARKS.md, twenty-ninth session).
ASYNC_OFFERED = True
ASYNC_SHARED = 48 * 1024  # shared memory a block may have without asking for more
# Whether one activation row runs the A8 kernels: the row rounded to int8 (a scale for each block of 32), and
# u8 codes times s8 activations on the integer tensor cores, a quarter of the bf16 mma (`int4_gemv.cu`). The
# integer mma alone took 8% off a whole int4-g128 Llama-3-8B step on an H100, but each block rounding the row
# first cost more: the step took 4% longer with A8 (GPU tests passed; BENCHMARKS.md, thirty-second session).
# So off, and its instances are not built; the rounding belongs in the kernels that write the activations.
A8 = False
A8_BLOCK = 32  # activations an int8 scale
# Whether pre-norm int4 layers hand their qkv and gate/up GEMVs rows rounded by the norm before them (its
# kernel holds the whole row: `ember.ops.norm.add_rms_norm_rounded`), for the kernels that read them as they
# are (`linear_rounded`). Its GPU tests pass, but on an H100 the whole int4-g128 Llama-3-8B step does not gain
# (+0.4% to +0.8%, and +0.2% with gate/up alone reading a rounded row): the GEMVs that read it save about what
# the norms' rounding adds (64 norms 81 -> 122-132 us a step; BENCHMARKS.md, thirty-third session). Off; an
# H200's faster memory leaves the bf16 mma more exposed, so it is to be measured there.
ROUNDED_ROWS = False
# Whether pre-norm int4 layers carry their RMSNorms across the GEMVs either side of them (`FOLD` in
# `int4_gemv.cu`: o, and down into the next layer, store h, h times the norm's weight and its tiles' sums of
# h^2; gate/up, and the next layer's qkv, scale their sums by the norm's factor), with no norm kernel between
# them (`linear_add_norm`, `normed_linear`; `DecoderLayer.carries_norm`): 63 of Llama-3-8B's 65 norm kernels
# a step, ~80 us on an H100. GPU tests passed on an H100; with every block shape pinned alike, the whole
# int4-g128 step took 1887-1893 us against 1918 (-1.3% to -1.6%), once FOLD's operands were read before the
# main loop (read after it, each read's latency was the kernel's tail, and the step took 0.7% longer;
# BENCHMARKS.md, thirty-fourth session).
FOLD_NORMS = True
FOLD_MAX_K = 8192  # the row a FOLD 2 GEMV reads: its tiles' sums, 16 a lane of a warp


Config = tuple[int, int, int, bool, bool]  # (TW, KW, DEPTH, LEAN, ASYNC)


def _name(
    group_steps: int, config: Config, split: bool, glu: bool = False, a8: int = 0, fold: int = 0
) -> str:
    """a8: 0 bf16 activations, 1 a row rounded by each block (`A8`), 2 a row rounded before (`round_row`).
    fold: 0 none, 1 the GEMV before a norm, 2 the one after it (`FOLD_NORMS`)."""
    tw, kw, depth, lean, asynchronous = config
    flags = ", ".join("true" if f else "false" for f in (lean, split, glu, asynchronous))
    return f"int4_mma_gemv<{group_steps}, {tw}, {kw}, {depth}, {flags}, {a8}, {fold}>"


def _shared_bytes(group_steps: int, config: Config, glu: bool) -> int:
    """Static shared memory of a block: its ring of groups (ASYNC), the KW warps' sums, gate/up's up sums."""
    tw, kw, depth, _, asynchronous = config
    slots = tw * (2 if glu else 1)
    ring = slots * kw * depth * (group_steps * 512 + 256) if asynchronous else 0
    return ring + 4 * (kw - 1) * slots * 128 + (4 * tw * 128 if glu else 0)


def rounded_bytes(K: int) -> int:
    """A rounded row's bytes (`round_row`; A8's dynamic shared memory): K int8 codes, and a float scale and sum
    a block of 32."""
    return K + 8 * (K // A8_BLOCK)


def rounds(rows: int, split: int, K: int) -> bool:
    """Whether a GEMV of `rows` activation rows of K over `split` runs of K runs the A8 kernels (`A8`): one
    row, whole, whose rounding fits in 32 KB of shared memory (K up to 26214)."""
    return A8 and rows == 1 and split == 1 and rounded_bytes(K) <= 32 * 1024


def round_row(x: torch.Tensor) -> torch.Tensor:
    """A row x (K,) or (1, K) rounded as the A8 kernels round it, in their layout: uint8 (K + 8 K / 32,) = K int8
    codes, then a float32 scale and a float32 sum for each block of 32. Block 2 s + i holds k 64 s + 16 t + 8 i +
    0..7 for t < 4 (the 64-k step s's lanes t hold k 16 t + 0..15); its scale is amax / 127 and its codes
    round(x * (127 / amax)) (to nearest even), its sum theirs times the scale; lane t's 16 codes lie at 64 s +
    16 t in their k order with the middle two of each 4 swapped (the order of the weights' nibbles)."""
    K = x.shape[-1]
    blocks = x.float().reshape(K // 64, 4, 2, 8)  # (step, lane t, block i, 8)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    # Divisions of two tensors, rounded once (IEEE) on every device: torch computes `127.0 / t` as
    # reciprocal(t) * 127, and on CUDA `t / 127.0` as t * (1 / 127), each rounded twice.
    full = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, full / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-127, 127)
    scale = amax / full
    sums = codes.sum(dim=(1, 3), keepdim=True) * scale
    ordered = codes.reshape(K // 64, 4, 4, 2, 2).transpose(-1, -2).reshape(K)
    parts = (ordered.to(torch.int8).view(torch.uint8), scale.reshape(-1), sums.reshape(-1))
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts])


def unround_row(r: torch.Tensor, K: int) -> torch.Tensor:
    """The float32 row (1, K) a `round_row` buffer stands for: each code times its block's scale."""
    codes = r[:K].view(torch.int8).float().reshape(K // 64, 4, 4, 2, 2).transpose(-1, -2)
    scale = r[K : K + 4 * (K // A8_BLOCK)].view(torch.float32).reshape(K // 64, 1, 2, 1)
    return (codes.reshape(K // 64, 4, 2, 8) * scale).reshape(1, K)


def a8_reference(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """What the A8 kernels compute, in float32 (M, N), for x (M, K) and `kernels.int4_mma_tile` words and
    `kernels.int4_mma_scales` factors: x' @ w.T, w = q * s + min, x' each row as `round_row` rounds it."""
    from ember.quant.kernels import int4_mma_dequantize

    K = x.shape[1]
    rounded = torch.cat([unround_row(round_row(row), K) for row in x])
    return rounded @ int4_mma_dequantize(words, sz, group_size).T


def fits(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> bool:
    """Whether the CUDA kernel takes these operands (else the Triton kernel runs)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and x.shape[0] <= MAX_ROWS
        and words.dtype == torch.int32
        and sz.dtype == torch.int32
        and x.is_contiguous()
        and words.is_contiguous()
        and sz.is_contiguous()
        and x.data_ptr() % 16 == 0
        and words.data_ptr() % 16 == 0
        and _ready(cuda_rtc.device_index(x.device), group_size)
    )


@functools.cache
def _ready(index: int, group_size: int) -> bool:
    """Whether the kernels for groups of `group_size` run on CUDA device `index`: sm80+ (bf16 mma), NVRTC, the
    build done (asked on every launch, so answered once)."""
    device = torch.device("cuda", index)
    return (
        group_size % 64 == 0
        and group_size // 64 in GROUP_STEPS
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and cuda_rtc.available()
        and kernels(device, group_size // 64) is not None
    )


def _built(group_steps: int, glu: bool) -> list[Config]:
    """The configurations (GLU_CONFIGS with glu, else CONFIGS) built for groups of `group_steps` steps: LEAN
    ones up to LEAN_MAX_STEPS, ASYNC ones whose ring fits the static shared memory."""
    return [
        c
        for c in (GLU_CONFIGS if glu else CONFIGS)
        if (not c[3] or group_steps <= LEAN_MAX_STEPS)
        and (not c[4] or _shared_bytes(group_steps, c, glu) <= ASYNC_SHARED)
    ]


def configs(
    group_size: int,
    groups: int,
    split: int,
    glu: bool = False,
    lean: bool | None = None,
    asynchronous: bool | None = None,
    a8: bool = False,
) -> list[Config]:
    """The configurations worth timing for rows of `groups` groups of `group_size` cut into `split` runs (with
    glu, of a gate/up weight): no warp of a tile without a group of its own; LEAN ones where `lean` (default
    LEAN_OFFERED), ASYNC ones where `asynchronous` (default ASYNC_OFFERED), and built; with a8 (`rounds`),
    those with room for the rounded row."""
    lean = LEAN_OFFERED if lean is None else lean
    asynchronous = ASYNC_OFFERED if asynchronous is None else asynchronous
    steps = group_size // 64
    room = ASYNC_SHARED - (rounded_bytes(groups * group_size) if a8 else 0)
    return [
        c
        for c in _built(steps, glu)
        if c[1] <= groups // split
        and (lean or not c[3])
        and (asynchronous or not c[4])
        and _shared_bytes(steps, c, glu) <= room
    ]


def whole_rows(device: torch.device, group_size: int) -> bool:
    """Whether decode GEMVs of this group size run whole rows of K on `device` (the kernel built and chosen)."""
    return (
        OFFERED and WHOLE_ROWS and device.type == "cuda" and _ready(cuda_rtc.device_index(device), group_size)
    )


def kernels(device: torch.device, group_steps: int, asynchronous: bool = False) -> dict | None:
    """The built kernels for `device` and groups of `group_steps` steps (the ASYNC ones, or the others), or None
    where they cannot be built (logged once). ASYNC ones are built apart, on first use: nothing pays for their
    build while they are not offered."""
    what = "CUDA int4 GEMV" + (" (ASYNC)" if asynchronous else "")
    names = _names(group_steps, asynchronous, (1,) * A8 + (2,) * ROUNDED_ROWS, FOLD_NORMS)
    return cuda_rtc.load_or_none(SOURCE, list(names), device, what)


@functools.cache
def _names(group_steps: int, asynchronous: bool, a8: tuple[int, ...], fold: bool = False) -> tuple[str, ...]:
    """Every instance built for groups of `group_steps` steps, ASYNC or not, with the A8 ones of the modes `a8`
    and with fold the FOLD ones (named once: `kernels` runs on every launch)."""
    plain = [c for c in _built(group_steps, False) if c[4] == asynchronous]
    glu = [c for c in _built(group_steps, True) if c[4] == asynchronous]
    names = [_name(group_steps, c, split) for c in plain for split in (False, True)]
    names += [_name(group_steps, c, False, glu=True) for c in glu]
    for mode in a8:
        names += [
            _name(group_steps, c, False, g, mode) for g, cs in ((False, plain), (True, glu)) for c in cs
        ]
    if fold:
        names += [_name(group_steps, c, False, fold=1) for c in plain]
        names += [
            _name(group_steps, c, False, g, fold=2) for g, cs in ((False, plain), (True, glu)) for c in cs
        ]
    return tuple(names)


def gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    y: torch.Tensor,
    group_size: int,
    config: Config,
    split: int,
    pdl: bool,
    glu: bool = False,
    rounded: bool = False,
    fold: tuple | None = None,
) -> None:
    """y (M, N) bf16 = x (M, K) @ w.T; with split > 1, y (split, M, N) float32 partial sums over equal runs
    of K's groups; with glu (w is gate rows over up rows, 2N of them), y (M, N) = silu(gate) * up. words, sz:
    `kernels.int4_mma_tile` and `kernels.int4_mma_scales` of w. Where `rounds`, the A8 kernels that round the
    row (the config from `configs(..., a8=True)`); with `rounded`, x is a row as `round_row` leaves it (M = 1)
    and the A8 kernels read it as it is. fold (one row): (1, resid, hw, sq, weight, offset), y taking h =
    resid + the product and hw, sq the rest of `linear_add_norm`; or (2, sq, eps), x being hw and y scaled as
    `normed_linear` scales it."""
    steps = group_size // 64
    fns = kernels(x.device, steps, config[4])
    if fns is None:
        raise cuda_rtc.CudaError("the CUDA int4 GEMV is not built")
    M, K = (1, words.shape[1] * 8) if rounded else x.shape
    N = words.shape[0] // (2 if glu else 1)
    tw, kw = config[:2]
    grid = (-(-(N // 16) // tw), split)
    mode = 0 if fold is None else fold[0]
    if mode == 1:
        _, resid, hw, sq, weight, offset = fold
        args = (x, words, sz, y, N, K, M, resid, hw, sq, weight, float(offset), 0.0)
    elif mode == 2:
        _, sq, eps = fold
        args = (x, words, sz, y, N, K, M, x, y, sq, x, 0.0, float(eps))
    else:
        args = (x, words, sz, y, N, K, M, x, y, sz, x, 0.0, 0.0)  # the FOLD operands, unread
    threads = tw * (2 if glu else 1) * kw * 32
    a8 = 0 if mode else 2 if rounded else int(rounds(M, split, K))
    if a8 == 1 and _shared_bytes(steps, config, glu) + rounded_bytes(K) > ASYNC_SHARED:
        raise ValueError(
            f"block shape {config} leaves no room for a rounded row of {K}: see configs(a8=True)"
        )
    fn = fns[_name(steps, config, split > 1, glu, a8, mode)]
    cuda_rtc.launch(fn, grid, threads, args, x.device, pdl, shared=rounded_bytes(K) if a8 == 1 else 0)


def silu_gate_up(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """silu(gate) * up (M, N) of x (M, K) bf16 and a gate/up weight (2N rows) in the tensor-core layout, as
    one kernel; the block shape timed once per shape (`ember.quant.tuning`). Needs `fits`."""
    from ember.ops.launch import pdl
    from ember.quant import tuning

    M, K = x.shape
    y = torch.empty(M, words.shape[0] // 2, device=x.device, dtype=x.dtype)
    on = pdl(x.device)

    def run(config: Config, w: tuple[torch.Tensor, ...]) -> None:
        gemv(x, w[0], w[1], y, group_size, config, 1, on, glu=True)

    a8 = rounds(M, 1, K)
    shapes = configs(group_size, K // group_size, 1, glu=True, a8=a8)
    key = ("int4_glu", M, words.shape[0], K, group_size, a8)
    run(tuning.pick(key, shapes, run, (words, sz)), (words, sz))
    return y


def rounded_fits(r: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> bool:
    """Whether the A8 kernels that read a rounded row (`round_row`) run with these operands."""
    return (
        ROUNDED_ROWS
        and r.is_cuda
        and r.dtype == torch.uint8
        and r.numel() == rounded_bytes(words.shape[1] * 8)
        and r.data_ptr() % 16 == 0
        and words.dtype == torch.int32
        and sz.dtype == torch.int32
        and words.is_contiguous()
        and sz.is_contiguous()
        and _ready(cuda_rtc.device_index(r.device), group_size)
    )


def linear_rounded(
    r: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int, glu: bool = False
) -> torch.Tensor:
    """y (1, N) bf16 of a rounded row r (`round_row`) and a weight in the tensor-core layout (with glu, a gate/up
    weight of 2N rows, and y = silu(gate) * up), as one kernel; the block shape timed once per shape. Needs
    `rounded_fits`."""
    from ember.ops.launch import pdl
    from ember.quant import tuning

    K = words.shape[1] * 8
    y = torch.empty(1, words.shape[0] // (2 if glu else 1), device=r.device, dtype=torch.bfloat16)
    on = pdl(r.device)

    def run(config: Config, w: tuple[torch.Tensor, ...]) -> None:
        gemv(r, w[0], w[1], y, group_size, config, 1, on, glu=glu, rounded=True)

    shapes = configs(group_size, K // group_size, 1, glu=glu)
    key = ("int4_rounded", words.shape[0], K, group_size, glu)
    run(tuning.pick(key, shapes, run, (words, sz)), (words, sz))
    return y


def fold_fits(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group_size: int) -> bool:
    """Whether the FOLD kernels (`linear_add_norm`; `normed_linear`, whose row is at most FOLD_MAX_K) run with
    one row x and these weights."""
    return FOLD_NORMS and x.numel() == x.shape[-1] and fits(x.reshape(1, -1), words, sz, group_size)


def linear_add_norm(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    resid: torch.Tensor,
    weight: torch.Tensor,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one row x (1, K) and a weight in the tensor-core layout: (h, hw, sq) with h (1, N) = resid + x @ w.T
    (the sum rounded to bf16, then the add, as torch rounds them), hw = h (offset + weight) rounded to bf16, and
    sq (N / 16,) float32 the sums of h^2 of each 16 rows: what `normed_linear` takes for RMSNorm(h) with that
    weight. One kernel; the block shape timed once per shape. Needs `fold_fits`."""
    from ember.ops.launch import pdl
    from ember.quant import tuning

    N, K = words.shape[0], x.shape[-1]
    h, hw = (
        torch.empty(1, N, device=x.device, dtype=x.dtype),
        torch.empty(1, N, device=x.device, dtype=x.dtype),
    )
    sq = torch.empty(N // 16, device=x.device, dtype=torch.float32)
    on = pdl(x.device)

    def run(config: Config, w: tuple[torch.Tensor, ...]) -> None:
        gemv(x, w[0], w[1], h, group_size, config, 1, on, fold=(1, resid, hw, sq, weight, offset))

    shapes = configs(group_size, K // group_size, 1)
    key = ("int4_fold_before", N, K, group_size)
    run(tuning.pick(key, shapes, run, (words, sz)), (words, sz))
    return h, hw, sq


def normed_linear(
    hw: torch.Tensor,
    sq: torch.Tensor,
    eps: float,
    words: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    glu: bool = False,
) -> torch.Tensor:
    """RMSNorm(h) @ w.T (1, N) for h carried as `linear_add_norm` leaves it (hw, sq): the sums of hw @ w.T
    scaled by rsqrt(sum(sq) / K + eps), rounded to bf16; with glu (a gate/up weight of 2N rows), silu(gate) *
    up of those. One kernel; the block shape timed once per shape. Needs `fold_fits`."""
    from ember.ops.launch import pdl
    from ember.quant import tuning

    K = hw.shape[-1]
    y = torch.empty(1, words.shape[0] // (2 if glu else 1), device=hw.device, dtype=hw.dtype)
    on = pdl(hw.device)

    def run(config: Config, w: tuple[torch.Tensor, ...]) -> None:
        gemv(hw, w[0], w[1], y, group_size, config, 1, on, glu=glu, fold=(2, sq, eps))

    shapes = configs(group_size, K // group_size, 1, glu=glu)
    key = ("int4_fold_after", words.shape[0], K, group_size, glu)
    run(tuning.pick(key, shapes, run, (words, sz)), (words, sz))
    return y
