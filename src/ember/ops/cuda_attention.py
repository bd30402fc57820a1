"""Decode attention in CUDA C++ for sm_90 and later (`csrc/decode_attention.cu`, built by NVRTC:
`ember.ops.cuda_rtc`).

The same function as the Triton decode attention (`ember.ops.triton_attention`: rope, this step's cache
write, attention over the slots up to each row's position), shaped for a short critical path after the qkv
projection: each kv head's slots are split over a thread-block cluster whose blocks merge their softmax
states through distributed shared memory (no partials in global memory, no merge kernel). The custom op
`ember::decode_attention` runs it where `fits` holds and the cache is in the measured range (`MAX_SLOTS`).

Shape legend: B rows, H query heads, K kv heads, S cache slots, D head dim, G = H / K.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ember.ops import cuda_rtc, launch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cu"
HEAD_DIMS = (64, 128, 256)  # D / 8 threads hold a slot: a power of two up to a warp
MAX_GROUP = 8  # query heads a kv head (registers: 8 floats of each head's query and output a thread)
# Caches up to this many slots run this kernel in `ember::decode_attention`: the range timed against the Triton
# kernel (H100, Llama-3-8B layers, S = 384-1024: 7.1-9.1 us a layer against 11.3-13.7; BENCHMARKS.md).
MAX_SLOTS = 1024
# Bytes of a later kernel's operand (`ahead`: the output projection's weights) that the kernel asks L2 for while
# it runs, its own traffic being small. On an H100 the whole Llama-3-8B step lost with all of the output
# projection's codes asked for (int4 +0.6%, int8 +1.3%, the same tokens; BENCHMARKS.md, thirty-third session):
# off, to be measured on an H200, whose attention is a larger share of the step.
AHEAD_BYTES = 0
SHARED_BYTES = 48 * 1024  # static shared memory a block may take
_DTYPES = {torch.bfloat16: "true", torch.float16: "false"}


def default_config(S: int, D: int, G: int) -> tuple[int, int, int]:
    """(warps a block, steps of slots each thread keeps loading, blocks a cluster) for S slots of head dim D
    and G query heads a kv head: 8 warps of 4 steps, the fastest of nine shapes at every S timed (H100,
    Llama-3-8B, S = 384-1024; BENCHMARKS.md); where 8 warps' shared memory does not fit (D 256 with G past
    4), 4 warps, the next fastest, of 8 steps up to G = 4. A thread holds 16 floats a query head besides
    2 x steps 16-byte loads: past G = 4, 8 steps spill registers to the stack (ptxas, sm_90), 4 do not."""
    if _shared_bytes(D, G, 8, 8) <= SHARED_BYTES:
        return 8, 4, 8
    return 4, 8 if G <= 4 else 4, 8


def chunk_of(S: int, D: int, config: tuple[int, int, int]) -> int:
    """Slots each block of a cluster owns: S over the cluster, rounded up to whole steps of the block's slots."""
    warps, _, cluster = config
    step = warps * (32 // (D // 8))
    return math.ceil(math.ceil(S / cluster) / step) * step


def _shared_bytes(D: int, G: int, warps: int, cluster: int) -> int:
    """Static shared memory of a block: its warps' states, the cluster's partials of its share of the outputs,
    their barrier, the roped q and k rows."""
    share = math.ceil(G * D / cluster)
    return 4 * (warps * G * D + 2 * warps * G) + 4 * cluster * (share + 2 * G) + 8 + 2 * (G + 1) * D


def _name(dtype: torch.dtype, D: int, G: int, config: tuple[int, int, int]) -> str:
    warps, steps, cluster = config
    return f"decode_attention<{_DTYPES[dtype]}, {D}, {G}, {warps}, {steps}, {cluster}>"


def fits(q, k, v, cos, sin, k_cache, v_cache, positions, config: tuple[int, int, int] | None = None) -> bool:
    """Whether the CUDA kernel takes these operands (see `decode_attention`), on this device."""
    B, H, D = q.shape
    KV, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KV
    rot = cos.shape[-1]
    config = config or default_config(S, D, G)
    rows = (q, k, v)
    return (
        q.is_cuda
        and q.dtype in _DTYPES
        and D in HEAD_DIMS
        and 1 <= G <= MAX_GROUP
        and H == G * KV
        and rot % 16 == 0  # each thread's 8 dims rotate whole, with partners 8 dims apart
        and 0 < rot <= D
        and _shared_bytes(D, G, config[0], config[2]) <= SHARED_BYTES
        and all(t.dtype == q.dtype and t.stride(-1) == 1 and t.stride(1) == D for t in rows)
        and all(t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in rows)  # 16-byte loads
        and cos.dtype == sin.dtype == torch.float32
        and cos.stride(-1) == sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and k_cache.dtype == v_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape == (B, KV, S, D)
        and torch.cuda.get_device_capability(q.device)[0] >= 9  # clusters, distributed shared memory
        and cuda_rtc.available()
    )


def _kernel(dtype: torch.dtype, D: int, G: int, config: tuple[int, int, int], device: torch.device):
    # SOURCE is read at each launch, so a benchmark may point the module at a candidate or a stamped copy.
    fns = cuda_rtc.load_or_none(SOURCE, [_name(dtype, D, G, config)], device, "CUDA decode attention")
    return None if fns is None else fns[_name(dtype, D, G, config)]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
    k_next: torch.Tensor | None = None,
    v_next: torch.Tensor | None = None,
    ahead: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int] | None = None,
    prefetch: bool | None = None,
    pdl: bool | None = None,
) -> torch.Tensor | None:
    """`ember.ops.triton_attention.decode_attention`'s function: rope on q (B, H, D) and k (B, K, D), k and v
    stored at `positions` (B,, int64) in the caches (B, K, S, D), attention -> (B, H, D); None where the
    kernel cannot be built (the caller runs the Triton kernel). Operands as `fits` requires. k_next, v_next:
    the next layer's caches, pulled into L2 when `prefetch` (default: 256 < S <= 512, as measured for the
    Triton kernel); the kernel reads nothing else of them. ahead: what a later kernel reads, of which the first
    `AHEAD_BYTES` are pulled into L2 (a hint, not read here)."""
    B, H, D = q.shape
    KV, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KV
    config = config or default_config(S, D, G)
    fn = _kernel(q.dtype, D, G, config, q.device)
    if fn is None:
        return None
    if prefetch is None:
        prefetch = 256 < S <= 512
    prefetch = prefetch and k_next is not None and v_next is not None
    if prefetch:
        prefetch = all(
            t.shape == k_cache.shape and t.dtype == k_cache.dtype and t.is_contiguous()
            for t in (k_next, v_next)
        )
    ahead_bytes = 0
    if ahead is not None and ahead.is_cuda and ahead.is_contiguous() and ahead.data_ptr() % 16 == 0:
        ahead_bytes = min(AHEAD_BYTES, ahead.numel() * ahead.element_size(), 2**30) // 16 * 16  # a C int
    out = q.new_empty(B, H, D)
    warps, _, cluster = config
    chunk = chunk_of(S, D, config)
    args = (
        q, k, v, cos, sin, k_cache, v_cache, positions, out,
        k_cache if k_next is None else k_next, v_cache if v_next is None else v_next,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), S, KV, window, cos.shape[-1], chunk,
        int(prefetch), float(scale * math.log2(math.e)), q if ahead is None else ahead, ahead_bytes,
    )  # fmt: skip
    pdl = launch.pdl(q.device) if pdl is None else pdl
    cuda_rtc.launch(fn, B * KV * cluster, warps * 32, args, q.device, pdl=pdl, cluster=cluster)
    return out
