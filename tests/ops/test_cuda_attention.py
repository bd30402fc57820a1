"""The CUDA C++ decode attention (`ember.ops.cuda_attention`, sm_90+, built by NVRTC).

On CPU: the chunks its clusters split a cache into cover every slot in whole steps, and the op keeps CPU
tensors off it. On an sm_90+ GPU with NVRTC: every head dim and group size it takes, bf16 and fp16, positions
at the edges of chunks, sliding windows, partial rotary and several block shapes, against the plain-torch
reference (outputs within float32-softmax rounding, the caches' new keys and values bit-equal); slots from a
row's position on poisoned, since they must never be read; in a CUDA graph with programmatic dependent launch
after a kernel it waits on; and through `ember::decode_attention`.
"""

from __future__ import annotations

import pytest
import torch

from ember.ops import cuda_attention
from ember.ops.decode_attention import decode_attention_reference
from ember.ops.rope import Rope, RopeConfig

CONFIGS = [(4, 8, 8), (4, 4, 8), (8, 2, 4), (2, 1, 2), (4, 8, 1)]  # (warps, steps in flight, cluster blocks)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("S", [1, 7, 64, 384, 1000, 1024])
@pytest.mark.parametrize("D", cuda_attention.HEAD_DIMS)
def test_a_clusters_chunks_cover_the_cache_in_whole_steps(config, S, D):
    warps, _, cluster = config
    chunk = cuda_attention.chunk_of(S, D, config)
    step = warps * 32 // (D // 8)
    assert chunk % step == 0 and chunk * cluster >= S
    assert chunk * (cluster - 1) < S or chunk == step  # no block is left a chunk wholly past the cache


def test_the_default_block_shape_fits_shared_memory_at_every_head_dim_and_group():
    # A shape the default does not fit would leave the op on the Triton kernel for that model.
    for D in cuda_attention.HEAD_DIMS:
        for G in range(1, cuda_attention.MAX_GROUP + 1):
            warps, steps, cluster = cuda_attention.default_config(1024, D, G)
            assert cuda_attention._shared_bytes(D, G, warps, cluster) <= cuda_attention.SHARED_BYTES, (D, G)
            assert steps <= 4 or G <= 4, (D, G)  # 8 steps past 4 heads spill registers


def test_cpu_tensors_are_not_taken():
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, 128)
    assert not cuda_attention.fits(q, k, v, cos, sin, cache, cache, torch.zeros(1, dtype=torch.int64))


def _sm90_ready() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    from ember.ops import cuda_rtc

    return cuda_rtc.available()


needs_sm90 = pytest.mark.skipif(not _sm90_ready(), reason="needs an sm_90+ GPU and NVRTC")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def operands(B, H, K, D, rotary, S, pos, dtype, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(B, (H + 2 * K) * D, device=dev, dtype=dtype, generator=g)  # q, k, v: strided views
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, K * D, K * D], dim=-1))
    rope = Rope(RopeConfig(theta=10000.0, rotary_dim=rotary, max_position_embeddings=8192))
    rope.init_buffers(dev)
    pos = torch.tensor(pos, device=dev)
    cos, sin = (t[:, 0] for t in rope(pos[:, None]))
    k_cache = torch.randn(B, K, S, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(B, K, S, D, device=dev, dtype=dtype, generator=g)
    return q, k, v, cos, sin, k_cache, v_cache, pos


def check(q, k, v, cos, sin, k_cache, v_cache, pos, window, config=None, prefetch=None, ahead=None):
    D = q.shape[-1]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = decode_attention_reference(q, k, v, cos, sin, want_k, want_v, pos, D**-0.5, window)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    for b, p in enumerate(pos.tolist()):  # slots from a row's position on are never read: poison them
        got_k[b, :, p:] = float("nan")
        got_v[b, :, p:] = float("nan")
    assert cuda_attention.fits(q, k, v, cos, sin, got_k, got_v, pos, config)
    nxt = torch.zeros_like(k_cache)
    got = cuda_attention.decode_attention(
        q,
        k,
        v,
        cos,
        sin,
        got_k,
        got_v,
        pos,
        D**-0.5,
        window,
        nxt,
        nxt,
        ahead,
        config=config,
        prefetch=prefetch,
    )
    torch.cuda.synchronize()
    assert got is not None
    for b, p in enumerate(pos.tolist()):
        assert torch.equal(got_k[b, :, p], want_k[b, :, p]), (b, p)  # the roped key, rounded as the reference
        assert torch.equal(got_v[b, :, p], want_v[b, :, p]), (b, p)
        assert torch.equal(got_k[b, :, :p], want_k[b, :, :p])  # nothing else written
    assert rel_err(got, want) < 5e-3, (config, window)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "H,K,D,rotary",
    [
        (32, 8, 128, 128),  # Llama-3-8B: G = 4
        (9, 3, 64, 64),  # SmolLM2-135M: G = 3
        (4, 1, 256, 256),  # Gemma 3 270M: one kv head
        (12, 2, 256, 256),  # G = 6 at D 256: the default's 4-warp shape (8 warps' shared memory does not fit)
        (14, 2, 64, 64),  # G = 7
        (16, 2, 128, 64),  # G = 8, partial rotary: dims 64..127 pass through
        (4, 4, 128, 32),  # no grouping
    ],
)
def test_against_the_reference(dtype, H, K, D, rotary):
    S = 384
    config = cuda_attention.default_config(S, D, H // K)
    chunk = cuda_attention.chunk_of(S, D, config)
    pos = [0, chunk - 1, chunk, S - 1]  # first slot, the edges of a chunk, the last slot
    for window in (0, 100):
        check(*operands(len(pos), H, K, D, rotary, S, pos, dtype), window)


@needs_sm90
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("S", [64, 384, 1024])
def test_block_shapes_and_lengths(config, S, monkeypatch):
    chunk = cuda_attention.chunk_of(S, 128, config)
    pos = sorted({0, min(chunk, S - 1), S // 2, S - 1})
    # With prefetching on, also the L2 hint for weights read after attention: more bytes than asked for, and
    # not a multiple of the grid's shares; nothing reads or writes them.
    monkeypatch.setattr(cuda_attention, "AHEAD_BYTES", 3 << 20)
    ahead = torch.randint(0, 256, ((3 << 20) + 4096 + 48,), dtype=torch.uint8, device="cuda")
    before = ahead.clone()
    for prefetch in (False, True):
        operand = operands(len(pos), 32, 8, 128, 128, S, pos, torch.bfloat16, seed=S)
        check(*operand, 0, config, prefetch, ahead if prefetch else None)
    assert torch.equal(ahead, before)


@needs_sm90
def test_in_a_cuda_graph_with_pdl_and_through_the_op(monkeypatch):
    from ember.ops import decode_attention  # noqa: F401  (registers ember::decode_attention)

    monkeypatch.setattr(cuda_attention, "MAX_SLOTS", 384)
    launched = []
    monkeypatch.setattr(
        cuda_attention, "_kernel", lambda *a, f=cuda_attention._kernel: launched.append(a) or f(*a)
    )

    q, k, v, cos, sin, k_cache, v_cache, pos = operands(2, 32, 8, 128, 128, 384, [5, 300], torch.bfloat16)
    qkv0 = torch.cat([t.reshape(2, -1) for t in (q, k, v)], 1)
    qkv = qkv0.clone()
    views = [t.view(2, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    work_k, work_v = k_cache.clone(), v_cache.clone()
    with torch.cuda.stream(stream):
        torch.ops.ember.decode_attention(
            *views, cos, sin, work_k.clone(), work_v.clone(), pos, 0.1, 0, None, None
        )
        with torch.cuda.graph(graph, stream=stream):
            qkv.copy_(qkv0 * 1.0)  # a kernel before, whose output the attention waits on
            out = torch.ops.ember.decode_attention(
                *views, cos, sin, work_k, work_v, pos, 128**-0.5, 0, None, None
            )
    for step in range(3):
        qkv0.normal_()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        wq, wk, wv = (t.view(2, -1, 128) for t in qkv0.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
        want = decode_attention_reference(wq, wk, wv, cos, sin, want_k, want_v, pos, 128**-0.5, 0)
        work_k.copy_(k_cache)
        work_v.copy_(v_cache)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want) < 5e-3, step
        assert torch.equal(work_k, want_k) and torch.equal(work_v, want_v), step
    assert launched  # the op ran this kernel, not the Triton one
