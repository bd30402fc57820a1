// Ember's decode attention for CUDA, sm_90 and later, compiled at run time by NVRTC (ember.ops.cuda_rtc).
//
// One query token per row: rope on this step's q (B, H, D) and k (B, KV, D), k and v stored at the row's
// position in the caches (B, KV, S, D), then attention over the slots up to that position. The same function
// as the Triton kernel of `ember.ops.triton_attention` (and its reference), with a shorter critical path:
// - the G = H / KV query heads of a kv head are one block's rows, so each cached key and value is read once;
//   D / 8 threads hold one slot (8 dims, 16 bytes each), a warp 32 / (D / 8) slots at a time;
// - a kv head's slots are split over a thread-block cluster of CL blocks; each block merges its warps'
//   (max, sum, output) in shared memory, then pushes each share of its outputs into the shared memory of the
//   block that stores that share (st.async, counted in bytes by that block's mbarrier, set up before the
//   wait): no partials in global memory, no second kernel, no cluster barrier after the wait;
// - launched with programmatic dependent launch, a block reads the row's position, cos, sin and the first
//   P steps of its cached keys and values before griddepcontrol.wait, then q, k and v once the qkv
//   projection has completed (why those reads are safe: `ember.ops.triton_attention`'s notes; this step's
//   slot is never read from memory, each row's new key and value are attended from registers). cos and sin
//   are rounded after the wait: while the qkv GEMV streams its weights a load takes microseconds, and blocks
//   that waited on theirs before the wait (and the cluster barrier on the slowest of them) left it late;
// - after the wait, q and k are roped once a block, into shared memory, by (G + 1) D / 8 of its threads
//   (every thread roping the rows it holds, 16 times a row at D 128, was most of the path after the wait);
// - exponentials in base 2, with scale * log2(e) folded into the roped query.
// Rounding follows the reference: rope in the activation dtype (each product and the sum rounded), scores,
// softmax and the output in float32, the output rounded once.

#include "ember_cuda.cuh"

#define NEG_INF __int_as_float(0xff800000u)  // -inf: no slot seen yet
#ifndef STAMP  // points of a block's path that `benchmarks/gpu_attention_stamps.py` times (nothing here)
#define STAMP(point)
#endif

// The 8 16-bit values of a 16-byte word as floats, and back.
template <bool BF16>
__device__ __forceinline__ void unpack8(uint4 w, float* f) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_f32<BF16>(words[i] & 0xFFFFu);
    f[2 * i + 1] = to_f32<BF16>(words[i] >> 16);
  }
}

template <bool BF16>
__device__ __forceinline__ uint4 pack8(const float* f) {
  u32 words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) words[i] = (u32)from_f32<BF16>(f[2 * i]) | ((u32)from_f32<BF16>(f[2 * i + 1]) << 16);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Ask L2 for [p, p + bytes) (16-byte multiples); nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// This block's share of [p, p + bytes) (p 16-byte aligned, bytes a multiple of 16) asked of L2, in chunks of 16
// KiB, one a thread: weights a later kernel reads, fetched while attention leaves the memory idle.
__device__ __forceinline__ void prefetch_share(const unsigned char* p, u32 bytes) {
  constexpr u32 CHUNK = 16384;
  const u32 share = ((bytes + gridDim.x - 1) / gridDim.x + 255u) & ~255u;
  const u32 lo = blockIdx.x * share, hi = min(bytes, lo + share);
  for (u32 off = lo + threadIdx.x * CHUNK; off < hi; off += blockDim.x * CHUNK)
    prefetch_l2(p + off, min(CHUNK, hi - off));
}

// Every thread of the cluster arrives; shared-memory writes before it are seen by reads after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// A load issued here and used later: asm volatile keeps it before griddepcontrol.wait (the compiler moves
// plain read-only loads past it), and nothing waits for it until its value is used.
__device__ __forceinline__ float load_early(const float* p) {
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

// The shared-memory address of p, as a 32-bit shared::cta address.
__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// An mbarrier of one arrival (this thread's, now) that completes once `bytes` more have been stored into
// this block's shared memory by st.async (`put`), from any block of the cluster.
__device__ __forceinline__ void expect_bytes(u32 bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }" ::"r"(bar),
               "r"(bytes)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Stores v at p's place in block `rank`'s shared memory, counted by that block's barrier at bar's place.
__device__ __forceinline__ void put(const float* p, float v, u32 rank, u32 bar) {
#if __CUDA_ARCH__ >= 900
  u32 dst, dst_bar;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(shared_address(p)), "r"(rank));
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst),
               "r"(__float_as_uint(v)), "r"(dst_bar)
               : "memory");
#endif
}

// Waits for the barrier's first phase: every byte it expects stored and visible.
__device__ __forceinline__ void wait_bytes(u32 bar) {
#if __CUDA_ARCH__ >= 900
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  }
#endif
}

// Slot p of a batch (P steps of SPB slots): its keys' and values' 16 bytes for dims 8j..8j+7, or zeros where
// the slot is outside [lo, hi) (a predicated-off load moves no memory).
template <int TPS, int P, int SPB>
__device__ __forceinline__ void load_batch(uint4* kb, uint4* vb, const uint4* kc, const uint4* vc, int step,
                                           int steps, int first, int lo, int hi) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int s = first + (step + p) * SPB;
    const bool ok = step + p < steps && s >= lo && s < hi;
    kb[p] = ok ? __ldcg(kc + (size_t)s * TPS) : zero;
    vb[p] = ok ? __ldcg(vc + (size_t)s * TPS) : zero;
  }
}

// Rope of 8 dims (x) with their partners' (xp), in the activation dtype as the reference rounds: c and s are
// cos and sin already rounded to it, s negated where the dims are in the first half. Returns the 8 results.
template <bool BF16>
__device__ __forceinline__ uint4 rope8(uint4 xw, uint4 pw, const float* c, const float* s) {
  float x[8], xp[8], y[8];
  unpack8<BF16>(xw, x);
  unpack8<BF16>(pw, xp);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = round_to<BF16>(x[i] * c[i]);
    const float r = round_to<BF16>(xp[i] * s[i]);
    y[i] = a + r;  // rounded by pack8
  }
  return pack8<BF16>(y);
}

// Fold another (max, sum, acc) state in: m in base-2 logits; -inf max means nothing seen.
template <int G>
__device__ __forceinline__ void merge_state(float* m, float* l, float (*acc)[8], const float* m2, const float* l2,
                                            const float (*acc2)[8]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float mx = fmaxf(m[g], m2[g]);
    const float ref = mx == NEG_INF ? 0.0f : mx;
    const float a = exp2f(m[g] - ref), b = exp2f(m2[g] - ref);
    l[g] = l[g] * a + l2[g] * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * a + acc2[g][i] * b;
    m[g] = mx;
  }
}

// Block (row b, kv head h, split) of a cluster of CL: slots [split * chunk, (split + 1) * chunk) of its kv head.
// q, kn, vn: this step's rows (strides given, unit within a row); cos, sin (B, rot) float32; caches (B, KV, S, D);
// positions (B,) int64; out (B, KV * G, D). k_next, v_next: the next layer's caches, prefetched into L2 when
// `prefetch` (read by nothing here). ahead: `ahead_bytes` of what a later kernel reads (the output projection's
// weights), prefetched into L2 by the grid's blocks in shares, after their first cache loads.
template <bool BF16, int D, int G, int WARPS, int P, int CL>
__global__ void __launch_bounds__(WARPS * 32)
    decode_attention(const u16* __restrict__ q, const u16* __restrict__ kn, const u16* __restrict__ vn,
                     const float* __restrict__ cos, const float* __restrict__ sin, u16* k_cache, u16* v_cache,
                     const long long* __restrict__ positions, u16* __restrict__ out, const u16* k_next,
                     const u16* v_next, int stride_q, int stride_kn, int stride_vn, int stride_cos, int S, int KV,
                     int window, int rot, int chunk, int prefetch, float scale_log2,
                     const unsigned char* ahead, u32 ahead_bytes) {
  pdl_launch_dependents();
  STAMP(0);
  constexpr int TPS = D / 8;  // threads a slot
  constexpr int SPW = 32 / TPS;  // slots a warp a step
  constexpr int SPB = WARPS * SPW;  // slots a block a step
  constexpr int T = WARPS * 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane / TPS, j = lane % TPS, d0 = 8 * j;
  const int bh = blockIdx.x / CL, split = blockIdx.x % CL;  // split is the block's rank in its cluster
  const int b = bh / KV, h = bh % KV;
  const bool rotates = d0 < rot, first_half = d0 < rot / 2;
  float c[8], s[8];  // read now; after the wait rounded to the activation dtype, s negated in the first half
  if (rotates) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      c[i] = load_early(cos + (size_t)b * stride_cos + d0 + i);
      s[i] = load_early(sin + (size_t)b * stride_cos + d0 + i);
    }
  }
  const int pos = (int)positions[b];
  const int start = split * chunk;
  const int lo = window > 0 ? max(start, pos - window + 1) : start;
  const int hi = min(start + chunk, pos);  // the row's own slot is attended from registers
  const int steps = hi > start ? (hi - start + SPB - 1) / SPB : 0;
  const int step0 = lo > start ? (lo - start) / SPB : 0;
  const int first = start + warp * SPW + sub;  // this thread's slot in step 0
  const size_t head = (size_t)bh * S * D;
  const uint4* kc = reinterpret_cast<const uint4*>(k_cache + head) + j;
  const uint4* vc = reinterpret_cast<const uint4*>(v_cache + head) + j;
  if (prefetch && threadIdx.x == 0 && hi > lo) {
    prefetch_l2(k_next + head + (size_t)lo * D, (u32)((hi - lo) * D * 2));
    prefetch_l2(v_next + head + (size_t)lo * D, (u32)((hi - lo) * D * 2));
  }

  uint4 kb[P], vb[P];
  load_batch<TPS, P, SPB>(kb, vb, kc, vc, step0, steps, first, lo, hi);
  if (ahead_bytes) prefetch_share(ahead, ahead_bytes);
  const int pd = !rotates ? d0 : first_half ? d0 + rot / 2 : d0 - rot / 2;
  // With a cluster, each block merges and stores a share of the outputs, PER of them, from the partials the
  // cluster's blocks push into its shared memory (their arrival counted in bytes by `bar`).
  constexpr int PER = (G * D + CL - 1) / CL;
  __shared__ float part_acc[CL][PER];  // the blocks' partial outputs of this block's share (CL 1: all of its own)
  __shared__ float part_ml[CL][2 * G];  // and their (max, sum) of each query head
  __shared__ unsigned long long bar;
  const u32 bar_at = shared_address(&bar);
  if (CL > 1) {
    if (threadIdx.x == 0) expect_bytes(bar_at, CL * (min(PER, G * D - split * PER) + 2 * G) * 4);
    cluster_sync();  // every block's barrier is set before any partial is pushed
  }
  pdl_wait();
  STAMP(1);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float si = rotates ? round_to<BF16>(s[i]) : 0.0f;
    c[i] = rotates ? round_to<BF16>(c[i]) : 1.0f;
    s[i] = first_half ? -si : si;
  }

  // This step's query rows and key, roped once for the block: thread t ropes dims 8 (t % TPS).. of row t / TPS
  // (the G query rows, then the key) into shared memory, where every thread reads the rows it needs. T is a
  // multiple of TPS, so t % TPS is this thread's j and c, s, pd are its own.
  __shared__ uint4 roped[(G + 1) * TPS];
  const uint4 v_new = warp == 0
                          ? __ldcg(reinterpret_cast<const uint4*>(vn + (size_t)b * stride_vn + (size_t)h * D + d0))
                          : make_uint4(0, 0, 0, 0);  // attended and stored by warp 0 only
  for (int t = threadIdx.x; t < (G + 1) * TPS; t += T) {
    const int r = t / TPS;
    const u16* row = r < G ? q + (size_t)b * stride_q + (size_t)(h * G + r) * D
                           : kn + (size_t)b * stride_kn + (size_t)h * D;
    const uint4 xw = __ldcg(reinterpret_cast<const uint4*>(row + d0));
    roped[t] = rotates ? rope8<BF16>(xw, __ldcg(reinterpret_cast<const uint4*>(row + pd)), c, s) : xw;
  }
  __syncthreads();
  float qf[G][8], kf_new[8];  // the query rows scaled into base-2 logits
#pragma unroll
  for (int g = 0; g < G; ++g) {
    unpack8<BF16>(roped[g * TPS + j], qf[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[g][i] *= scale_log2;
  }
  unpack8<BF16>(roped[G * TPS + j], kf_new);
  STAMP(2);

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  }
  for (int step = step0; step < steps; step += P) {
    uint4 nk[P], nv[P];
    load_batch<TPS, P, SPB>(nk, nv, kc, vc, step + P, steps, first, lo, hi);
    float sc[P][G];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float kf[8];
      unpack8<BF16>(kb[p], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) t = fmaf(qf[g][i], kf[i], t);
        sc[p][g] = t;
      }
    }
#pragma unroll
    for (int o = TPS / 2; o > 0; o >>= 1)
#pragma unroll
      for (int p = 0; p < P; ++p)
#pragma unroll
        for (int g = 0; g < G; ++g) sc[p][g] += __shfl_xor_sync(0xFFFFFFFFu, sc[p][g], o);
    float ref[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int slot = first + (step + p) * SPB;
        const bool ok = step + p < steps && slot >= lo && slot < hi;
        sc[p][g] = ok ? sc[p][g] : NEG_INF;
        mx = fmaxf(mx, sc[p][g]);
      }
      ref[g] = mx == NEG_INF ? 0.0f : mx;
      const float alpha = exp2f(m[g] - ref[g]);
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= alpha;
      m[g] = mx;
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float vf[8];
      unpack8<BF16>(vb[p], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float e = exp2f(sc[p][g] - ref[g]);
        l[g] += e;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(e, vf[i], acc[g][i]);
      }
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      kb[p] = nk[p];
      vb[p] = nv[p];
    }
  }

  STAMP(3);
  // The row's own key and value, in the block whose chunk holds the position: stored, and attended by the
  // first slot group of warp 0.
  const bool owner = pos / chunk == split;
  if (warp == 0) {
    float t[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      t[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) t[g] = fmaf(qf[g][i], kf_new[i], t[g]);
#pragma unroll
      for (int o = TPS / 2; o > 0; o >>= 1) t[g] += __shfl_xor_sync(0xFFFFFFFFu, t[g], o);
    }
    if (owner && sub == 0) {
      float vf[8];
      unpack8<BF16>(v_new, vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float mx = fmaxf(m[g], t[g]);
        const float alpha = exp2f(m[g] - mx), e = exp2f(t[g] - mx);
        l[g] = l[g] * alpha + e;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(e, vf[i], acc[g][i] * alpha);
        m[g] = mx;
      }
      const size_t slot = head + (size_t)pos * D + d0;
      *reinterpret_cast<uint4*>(k_cache + slot) = roped[G * TPS + j];
      *reinterpret_cast<uint4*>(v_cache + slot) = v_new;
    }
  }

  STAMP(4);
  // The warp's slot groups, then the block's warps, then the cluster's blocks.
#pragma unroll
  for (int o = TPS; o < 32; o <<= 1) {
    float m2[G], l2[G], acc2[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m2[g] = __shfl_xor_sync(0xFFFFFFFFu, m[g], o);
      l2[g] = __shfl_xor_sync(0xFFFFFFFFu, l[g], o);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc2[g][i] = __shfl_xor_sync(0xFFFFFFFFu, acc[g][i], o);
    }
    merge_state<G>(m, l, acc, m2, l2, acc2);
  }
  __shared__ float4 warp_acc[WARPS][G][D / 4];
  __shared__ float warp_m[WARPS][G], warp_l[WARPS][G];
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      warp_acc[warp][g][2 * j] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      warp_acc[warp][g][2 * j + 1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      if (j == 0) {
        warp_m[warp][g] = m[g];
        warp_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  const float* wacc = reinterpret_cast<const float*>(warp_acc);
  for (int e = threadIdx.x; e < G * D; e += T) {
    const int g = e / D;
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, warp_m[w][g]);
    const float ref = mx == NEG_INF ? 0.0f : mx;
    float sum = 0.0f, a = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = exp2f(warp_m[w][g] - ref);
      sum = fmaf(warp_l[w][g], f, sum);
      a = fmaf(wacc[w * G * D + e], f, a);
    }
    if (CL == 1) {
      part_acc[0][e] = a;
      if (e % D == 0) {
        part_ml[0][g] = mx;
        part_ml[0][G + g] = sum;
      }
    } else {
      const int r = e / PER;  // the block of the cluster whose share holds e
      put(&part_acc[split][e - r * PER], a, r, bar_at);
      if (e % D == 0) {  // every block merges some of head g's outputs, or may: each gets its (max, sum)
        for (int to = 0; to < CL; ++to) {
          put(&part_ml[split][g], mx, to, bar_at);
          put(&part_ml[split][G + g], sum, to, bar_at);
        }
      }
    }
  }
  STAMP(5);
  if (CL == 1)
    __syncthreads();
  else
    wait_bytes(bar_at);
  STAMP(6);

  // This block's share of the outputs, merged over the cluster's blocks (the owner's state is finite).
  const int e_end = min((split + 1) * PER, G * D);
  for (int e = split * PER + threadIdx.x; e < e_end; e += T) {
    const int g = e / D;
    float mx = part_ml[0][g];
#pragma unroll
    for (int r = 1; r < CL; ++r) mx = fmaxf(mx, part_ml[r][g]);
    float sum = 0.0f, a = 0.0f;
#pragma unroll
    for (int r = 0; r < CL; ++r) {
      const float f = exp2f(part_ml[r][g] - mx);
      sum = fmaf(part_ml[r][G + g], f, sum);
      a = fmaf(part_acc[r][e - split * PER], f, a);
    }
    out[((size_t)bh * G + g) * D + e % D] = from_f32<BF16>(a / sum);
  }
  STAMP(7);
}
