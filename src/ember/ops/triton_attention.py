"""Triton decode attention: one query token per row over a static (B, K, S, D) KV cache (flash-decoding),
with rope and the cache write of this step's key and value in the same kernel.

A decode step's attention reads each kv head's cached keys and values once; the G = H/K query heads that
share a kv head ride along as the rows of one small matmul (padded to 16 rows for the tensor cores), so k/v
are never repeated. Each program owns one (row, kv head) and one chunk of the cache and reads only the
slots up to the row's position (read on the device: no host sync, and a CUDA graph replays at any length).
With more than one chunk the programs write partial (max, sum, output) triples and a second kernel merges
them with the usual log-sum-exp rescaling.

Launched with programmatic dependent launch (`ember.ops.launch`), a program reads the row's position, cos,
sin and its chunk's first block of cached keys and values before waiting on the kernel before it (the qkv
projection): its main memory traffic then overlaps that kernel's tail (3-4 us of a ~13 us layer on an H200,
`benchmarks/gpu_decode_step.py`). This is safe because no kernel of the current step writes any of them: the
positions, cos and sin are written before the step's first layer by kernels that are not PDL launches
(torch's and inductor's, which a PDL chain cannot overtake: a kernel after one starts only once it has
finished), and a cache slot other than this step's position was written by this op in an earlier step (or
by the prefill), with such kernels in between. This step's slot is never read from memory.

On sm_90 and later each program also asks L2 to fetch the next layer's cached keys and values of its chunk
(`cp.async.bulk.prefetch.L2`, no wait), and the decode GEMVs load weights with `evict_first`: weights are
read once a step, so they leave L2 first, and the next layer's attention finds its keys and values there
after the layer of weights in between (Llama-3-8B: 110-440 MB of weights, 1.5 MB of cache at 384 slots).
L2 is where global memory is coherent (the next layer's write of this step's slot lands there too), so a
prefetch can never make a later read return stale bytes. Together with 64-slot chunks (`default_tiles`) the H200 A/B measured 2567 -> 2521
us an int8 Llama-3-8B step and 2235 -> 2168 an int4 one at 384 slots (BENCHMARKS.md); each change alone was
no faster. At 192 slots the prefetch and its tiles lost 5.5% and at 2048 0.7%, so caches of 257-512 slots
prefetch, others do not.

Tested against `ember.ops.decode_attention.decode_attention_reference`, also in Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.ops.launch import hopper, launch_options


@triton.jit
def _kv_block(k_ptr, v_ptr, kv_base, s, pos, lo, hi, rd, d_ok, D: tl.constexpr):
    # One step's (BLOCK_S, BLOCK_D) keys and values: slots in [lo, hi) other than the row's own position (that
    # one comes from registers); masked slots move no memory and read as 0.
    sd_ok = ((s >= lo) & (s < hi) & (s != pos))[:, None] & d_ok[None, :]
    offs = kv_base + s[:, None] * D + rd[None, :]
    return tl.load(k_ptr + offs, mask=sd_ok, other=0.0), tl.load(v_ptr + offs, mask=sd_ok, other=0.0)


@triton.jit
def _attend(q, k, v, s, pos, lo, hi, m_i, l_i, acc, scale):
    # Online softmax over one step's cached slots s in [lo, hi), the row's own position left out (this step's
    # key and value are attended apart, in registers: see the chunk kernel).
    scores = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_G, BLOCK_S) float32
    scores = tl.where(((s >= lo) & (s < hi) & (s != pos))[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # Nothing seen yet (-inf): keep exp() off -inf - -inf.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attention_chunk_kernel(
    q_ptr,
    kn_ptr,
    vn_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    part_ptr,
    m_ptr,
    l_ptr,
    k_next_ptr,
    v_next_ptr,
    stride_q,
    stride_kn,
    stride_vn,
    stride_cos,
    S,
    window,
    scale,
    KV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # This step's q (B, H, D), k and v (B, KV, D), row strides given, before rope; cos, sin (B, ROT) of the
    # rows' positions; caches (B, KV, S, D); pos (B,). H = KV * G. Program (b * KV + h, split).
    # EARLY (with PDL): the position, cos, sin and the chunk's first cached keys and values are read before
    # waiting on the kernel before (see the module's notes: no kernel of this step writes them).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not EARLY:
            tl.extra.cuda.gdc_wait()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // KV
    h = bh % KV
    pos = tl.load(pos_ptr + b).to(tl.int32)
    start = split * CHUNK
    lo = start
    if window > 0:  # sliding-window layer: keys at pos - window or before are out of view
        lo = tl.maximum(lo, pos - window + 1)
    hi = tl.minimum(start + CHUNK, pos + 1)  # keys after the query's own position are never read
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, BLOCK_D)
    rs = tl.arange(0, BLOCK_S)
    d_ok = rd < D
    rot = rd < ROT
    half: tl.constexpr = ROT // 2
    c = tl.load(cos_ptr + b * stride_cos + rd, mask=rot, other=1.0)
    sn = tl.load(sin_ptr + b * stride_cos + rd, mask=rot, other=0.0)
    kv_base = bh.to(tl.int64) * S * D
    if PREFETCH:  # the next layer's keys and values of this chunk's slots, into L2 (see the module's notes)
        nbytes = tl.maximum(hi - start, 0) * ROW_BYTES
        if nbytes > 0:
            _prefetch_l2(k_next_ptr + kv_base + start * D, nbytes)
            _prefetch_l2(v_next_ptr + kv_base + start * D, nbytes)
    k0, v0 = _kv_block(k_ptr, v_ptr, kv_base, start + rs, pos, lo, hi, rd, d_ok, D)
    if PDL and EARLY:
        tl.extra.cuda.gdc_wait()

    # Rows 0..G-1 of one tile are the query heads h*G .. h*G + G - 1 (which share kv head h); row G is the new
    # key. Rope turns each row by the half-split rule: dim d < ROT/2 pairs with d + ROT/2 (negated), dims at
    # ROT and past pass through. Rounded as apply_rope rounds in the activation dtype.
    is_q = rg < G
    row_ptr = tl.where(is_q, q_ptr + b * stride_q + (h * G + rg) * D, kn_ptr + b * stride_kn + h * D)
    row_ok = (rg <= G)[:, None] & d_ok[None, :]
    x = tl.load(row_ptr[:, None] + rd[None, :], mask=row_ok, other=0.0)  # (BLOCK_G, BLOCK_D)
    partner = tl.where(rd < half, rd + half, rd - half)
    partner = tl.where(rot, partner, rd)
    xp = tl.load(row_ptr[:, None] + partner[None, :], mask=row_ok, other=0.0)
    dt = x.dtype
    c = c.to(dt).to(tl.float32)
    sn = sn.to(dt).to(tl.float32)
    sn = tl.where(rd < half, -sn, sn)
    a = (x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)
    r = (xp.to(tl.float32) * sn[None, :]).to(dt).to(tl.float32)
    x = (a + r).to(dt)
    q = tl.where(is_q[:, None], x, 0.0).to(dt)
    k_new = tl.sum(tl.where((rg == G)[:, None], x.to(tl.float32), 0.0), axis=0).to(dt)  # (BLOCK_D,), exact
    v_new = tl.load(vn_ptr + b * stride_vn + h * D + rd, mask=d_ok, other=0.0)
    # The program whose chunk holds the row's position stores the new key and value in the cache and attends
    # to them from registers after the loop; the loop leaves that slot out, so no program reads a slot
    # another one is writing.
    owner = rd < tl.where(pos // CHUNK == split, D, 0)  # all head dims in that program, none elsewhere
    tl.store(k_ptr + kv_base + pos * D + rd, k_new, mask=owner)
    tl.store(v_ptr + kv_base + pos * D + rd, v_new, mask=owner)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i, l_i, acc = _attend(q, k0, v0, start + rs, pos, lo, hi, m_i, l_i, acc, scale)
    # A static trip count: the loop walks the whole chunk and slots out of [lo, hi) are masked (a masked load
    # moves no memory). Triton's interpreter, which runs this kernel in tests, cannot loop to a loaded bound;
    # and skipping blocks past the position with a branch was measured slower on an H200 (it stops the
    # loads from being pipelined; `benchmarks/gpu_decode_step.py`).
    for s0 in range(BLOCK_S, CHUNK, BLOCK_S):
        s = start + s0 + rs
        k, v = _kv_block(k_ptr, v_ptr, kv_base, s, pos, lo, hi, rd, d_ok, D)
        m_i, l_i, acc = _attend(q, k, v, s, pos, lo, hi, m_i, l_i, acc, scale)
    # This step's key and value, in the program whose chunk holds the position (its probability rounded as
    # the loop rounds p for the second matmul).
    mine = pos // CHUNK == split
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # (BLOCK_G,)
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.exp(m_i - m_new)
    p_new = tl.exp(s_new - m_new).to(dt).to(tl.float32)
    l_i = tl.where(mine, l_i * alpha + p_new, l_i)
    acc = tl.where(mine, acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :], acc)
    m_i = tl.where(mine, m_new, m_i)
    if SPLITS == 1:
        q_rows = b * KV * G + h * G + rg
        out = acc / l_i[:, None]
        gd_ok = is_q[:, None] & d_ok[None, :]
        tl.store(o_ptr + q_rows[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=gd_ok)
    else:  # partials (B*KV, SPLITS, BLOCK_G, BLOCK_D) and (B*KV, SPLITS, BLOCK_G); an empty chunk leaves -inf, 0
        row = (bh * SPLITS + split) * BLOCK_G + rg
        tl.store(part_ptr + row[:, None] * BLOCK_D + rd[None, :], acc)
        tl.store(m_ptr + row, m_i)
        tl.store(l_ptr + row, l_i)


@triton.jit
def _prefetch_l2(ptr, nbytes):
    # One thread of the program asks for [ptr, ptr + nbytes) in L2 (sm_90 and later; ptr and nbytes multiples
    # of 16). Nothing waits for it: a hint, whose only effect is where later reads find the bytes.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr.to(tl.int64, bitcast=True), nbytes.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _attention_merge_kernel(
    part_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    KV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # One program per (row, kv head): out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i.
    bh = tl.program_id(0)
    rsp = tl.arange(0, SPLITS)
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, BLOCK_D)
    row = (bh * SPLITS + rsp)[:, None] * BLOCK_G + rg[None, :]  # (SPLITS, BLOCK_G)
    m = tl.load(m_ptr + row)
    l_sum = tl.load(l_ptr + row)
    m_max = tl.max(m, axis=0)  # (BLOCK_G,): finite, the chunk holding the query's own position has keys
    w = tl.exp(m - m_max[None, :])  # an empty chunk (-inf) weighs 0
    part = tl.load(part_ptr + row[:, :, None] * BLOCK_D + rd[None, None, :])  # (SPLITS, BLOCK_G, BLOCK_D)
    out = tl.sum(part * w[:, :, None], axis=0) / tl.sum(l_sum * w, axis=0)[:, None]
    rows = bh * G + rg  # (b * KV + h) * G + g = b * H + h * G + g
    mask = (rg < G)[:, None] & (rd < D)[None, :]
    tl.store(o_ptr + rows[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)


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
    *,
    splits: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    early: bool = True,
) -> torch.Tensor:
    """Rope on this step's q (B, H, D) and k (B, K, D), k and v (B, K, D) stored at `positions` (B,) in the
    caches (B, K, S, D, contiguous), attention over slots 0..position -> (B, H, D) in q's dtype.

    cos, sin (B, R) for the positions, R <= D rotary dims, with one row stride. Each of q, k, v, cos and
    sin needs unit stride within a row (heads D apart); rows may be strided (views of a fused qkv
    projection). window <= 0: no sliding window. k_next, v_next: the next layer's caches, read by nothing here
    but pulled into L2 where they can be (see the module's notes). `splits` (a power of two), `block_s` and
    `num_warps` default to `default_tiles`; `early=False` makes the kernel read nothing before waiting on the
    kernel before it (see `_attention_chunk_kernel`), for benchmarks.
    """
    B, H, D = q.shape
    KV, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KV
    row_bytes = D * k_cache.element_size()
    prefetch = (
        256 < S <= 512  # where it was measured faster: 3.7% at 384 slots; 5.5% slower at 192, 0.7% at 2048
        and k_next is not None
        and v_next is not None
        and hopper(q.device)
        and row_bytes % 16 == 0  # bulk prefetches take 16-byte multiples from 16-byte aligned addresses
        and all(
            t.shape == k_cache.shape
            and t.dtype == k_cache.dtype
            and t.is_contiguous()
            and t.data_ptr() % 16 == 0
            for t in (k_next, v_next)
        )
    )
    tiles = default_tiles(S, D, prefetch)
    splits = tiles[0] if splits is None else splits
    block_s = (tiles[1] if splits == tiles[0] else 64) if block_s is None else block_s
    num_warps = (tiles[2] if splits == tiles[0] else 4) if num_warps is None else num_warps
    chunk = triton.cdiv(triton.cdiv(S, splits), block_s) * block_s
    BLOCK_G = max(16, triton.next_power_of_2(G + 1))  # + 1: the new key rides in the query tile
    BLOCK_D = max(16, triton.next_power_of_2(D))
    out = q.new_empty(B, H, D)
    if splits == 1:
        part = m = l_sum = out  # unread stand-ins
    else:
        part = torch.empty(B * KV * splits * BLOCK_G * BLOCK_D, device=q.device, dtype=torch.float32)
        m = torch.empty(B * KV * splits * BLOCK_G, device=q.device, dtype=torch.float32)
        l_sum = torch.empty_like(m)
    consts = dict(KV=KV, G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, **launch_options(q.device))
    _attention_chunk_kernel[(B * KV, splits)](
        q, k, v, cos, sin, k_cache, v_cache, positions, out, part, m, l_sum,
        k_next if prefetch else k_cache, v_next if prefetch else v_cache,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), S, window, scale,
        ROT=cos.shape[-1], BLOCK_S=block_s, CHUNK=chunk, SPLITS=splits, EARLY=early,
        ROW_BYTES=row_bytes, PREFETCH=prefetch, num_warps=num_warps, **consts,
    )  # fmt: skip
    if splits > 1:
        _attention_merge_kernel[(B * KV,)](part, m, l_sum, out, SPLITS=splits, num_warps=4, **consts)
    return out


def default_tiles(S: int, D: int, prefetch: bool = False) -> tuple[int, int, int]:
    """(chunks of the cache per (row, kv head), slots per loop step, warps) for S slots of head dim D, the
    fastest measured on an H200 (`benchmarks/gpu_decode_step.py`, and whole-step A/Bs in BENCHMARKS.md).

    With the next layer's keys and values prefetched into L2 (`prefetch`: from 257 to 512 slots), where D <= 128:
    one 64-slot step per chunk, 4 warps (up to 8 chunks; 8 x 64 at 384 slots beat 2 x 256 by 1.8% of an int8
    Llama-3-8B step and 3% of an int4 one, and 4 x 2 x 64 lost 4%). Otherwise, up to 512 slots two chunks of
    8 warps, each chunk one step of up to 256 slots where D <= 128 (so that all of a chunk's keys and values
    are loaded before the wait on the qkv projection; the kernel's fixed costs dominate at these lengths;
    else steps of 64). Past 512 slots about one chunk per 128 slots, at most 16, in steps of 64."""
    if S <= 512 and D <= 128 and prefetch:
        return max(2, triton.next_power_of_2(triton.cdiv(S, 64))), 64, 4
    if S <= 512:
        return 2, ((256 if S > 256 else 128) if D <= 128 else 64), 8
    return min(16, triton.next_power_of_2(triton.cdiv(S, 128))), 64, 4
