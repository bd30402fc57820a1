// Ember's int4 decode GEMV on tensor cores in CUDA C++, compiled at run time by NVRTC (ember.ops.cuda_rtc).
//
// The weights are in the fragment layout of the Triton tensor-core GEMV (ember.quant.triton_mma, whose
// docstring derives it; kernels.int4_mma_tile builds it): rows in tiles of 16, K in steps of 64, and a
// (tile, step) block is 32 16-byte words, one per lane, holding the A operands of the step's 4
// mma.m16n8k16. One LOP3 makes an A register, two bf16 128 + q, exactly; a second mma per 16 k multiplies
// the same activations by ones, so a group's sum is s * sum((128 + q) x) + (min - 128 s) * sum(x), with the
// group's factors sz = (s, min) as bf16 (kernels.int4_mma_scales). B column n is activation row n (up to 8).
//
// y (M, N) bf16 = x (M, K) bf16 @ w.T, or with SPLIT float32 partial sums (gridDim.y, M, N) over equal runs
// of K's groups (for a consumer that adds them as it reads them: ember.quant.kernels.SplitSum), or with GLU
// SwiGLU's silu(gate) * up of a gate/up weight.
//
// What the Triton kernel could not be made to do: a warp keeps DEPTH groups of weights in flight (and the
// next group's activations) while it multiplies one; KW warps of a block share a tile, each taking every
// KW-th group of the run, and add their sums in shared memory, so K is split without float32 partials
// leaving the kernel; programmatic dependent launch, the first weights loading before griddepcontrol.wait.
// What the kernel before wrote (the activations, FOLD's sums of squares) is read with ld.global.ca (__ldca:
// L1 and L2, coherent once griddepcontrol.wait returns), never through the read-only cache (__ldg,
// ld.global.nc, whose contract is that nothing changes while the kernel lives): with programmatic dependent
// launch this kernel starts while that one still writes, and stale lines there made greedy decoding differ run
// to run (H100, thirty-sixth session; from L2 alone, ld.global.cg, int4 steps took 6% longer).
//
// ASYNC: the DEPTH groups in flight wait in shared memory instead of registers (cp.async, each lane copying
// and later reading back its own 16-byte words, so nothing but cp.async.wait_group orders them). A warp's
// registers hold DEPTH 2 groups (ptxas: 72-96 registers at DEPTH 2-4, LEAN spills at DEPTH 4), about 7 MB in
// flight over an H200, which its memory needs more of to run at its bandwidth; shared memory holds DEPTH 8.
//
// A8 (one activation row): the row rounded to int8, a float scale for each block of 32 activations (amax /
// 127, as Ember's CPU int4 kernel and llama.cpp's q8 activations), by the block into shared memory (A8 1) or
// before, by the kernel that wrote the row (A8 2: x points at the rounded row), and multiplied on the integer
// tensor cores: one LOP3 makes four u8 codes of an A register (the shift by 4 a second four), and an
// mma.m16n8k32 of u8 codes and s8 activations does the work of four bf16 mma (two with the ones). A step is
// two of them, each over one block of 32 (k 16 q + 8 i + 0..7 of lanes q, i = 0, 1: the bf16 layout's
// nibbles, their activations permuted within 4s as `A8_ORDER` says), their int32 sums scaled by the block's
// scale as floats. A group's sum is s * sum(q x') + min * sum(x'), x' the rounded activations (so the sum's
// error is sum(w (x' - x)), of the weights as they are). On an H100 the integer mma alone took 8% off whole
// int4-g128 Llama-3-8B steps, but every block rounding the row first (A8 1) cost more (the step +4%:
// BENCHMARKS.md, thirty-second session); A8 2 is the rounding where the row is written.

#include "ember_cuda.cuh"

constexpr u32 NIBBLES = 0x000F000Fu;  // a register's two nibbles after a shift by 0, 4, 8 or 12
constexpr u32 BIAS = 0x43004300u;     // under 128's exponent: the bf16 pair 128 + q
constexpr u32 ONES = 0x3F803F80u;     // the bf16 pair (1, 1)
constexpr u32 NIBBLES8 = 0x0F0F0F0Fu; // four u8 codes of a register: its nibbles at bits 0-3 of each byte
constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23: an int32 accumulator started at its bits holds it + the sum
// Blocks a multiprocessor must hold (__launch_bounds__): LEAN kernels, 1024 threads' worth (at most 64
// registers a thread); the others leave the registers to ptxas (0).
#define MIN_BLOCKS(threads, lean) ((lean) && 1024 / (threads) > 0 ? 1024 / (threads) : 0)

// cp.async of 16 bytes (through L2 only: weights are read once) and of 4 bytes, to this thread's own slots.
__device__ __forceinline__ void copy16_async(uint4* dst, const uint4* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

__device__ __forceinline__ void copy4_async(u32* dst, const u32* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups of copies are still in flight.
template <int N>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The two nibbles of v under NIBBLES as the bf16 pair 128 + q: one LOP3 ((v & NIBBLES) | BIAS; written as two
// C operations the compiler emits two, an instruction taking one immediate).
__device__ __forceinline__ u32 operand(u32 v) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "n"(NIBBLES), "n"(BIAS));
  return r;
}

// *p, by ld.global.ca where it is global memory (GLOBAL: a row the kernel before wrote), else from shared
// memory.
template <bool GLOBAL, typename T>
__device__ __forceinline__ T read(const T* p) {
  return GLOBAL ? __ldca(p) : *p;
}

// D = A B + the accumulators' start, an int32 start of MAGIC's bits: the sum (|sum| < 2^22) then reads as the
// float MAGIC + sum.
__device__ __forceinline__ void imma(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(__float_as_uint(MAGIC)));
}

// One A8 step of 64 k: C += s_b * sum over block b of q x' for its 2 blocks, xq the lane's 16 int8 activations
// and sc their blocks' scales. Only accumulators 0 and 2 (activation row 0) are summed: A8 runs one row.
__device__ __forceinline__ void step8(uint4 w, uint4 xq, float2 sc, float (&C)[4]) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
  u32 lo[4], hi[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    lo[m] = words[m] & NIBBLES8;         // row g: the nibbles at bits 0, 8, 16, 24
    hi[m] = (words[m] >> 4) & NIBBLES8;  // row g + 8: bits 4, 12, 20, 28
  }
  int D[2][4];
  imma(D[0], lo[0], hi[0], lo[1], hi[1], xq.x, xq.y);
  imma(D[1], lo[2], hi[2], lo[3], hi[3], xq.z, xq.w);
#pragma unroll
  for (int c = 0; c < 4; c += 2) {
    C[c] = fmaf(sc.x, __int_as_float(D[0][c]) - MAGIC, C[c]);
    C[c] = fmaf(sc.y, __int_as_float(D[1][c]) - MAGIC, C[c]);
  }
}

// A8: one step's rounded activations, the lane's 16 codes and the step's two blocks' scales and sums.
struct Step8 {
  uint4 codes;
  float2 scale, sum;
};

template <bool GLOBAL>
__device__ __forceinline__ Step8 load8(const uint4* xr, const float2* xscale, const float2* xsum, int st) {
  return {read<GLOBAL>(xr + 4 * st), read<GLOBAL>(xscale + st), read<GLOBAL>(xsum + st)};
}

// A8's prologue: the activation row x (K) rounded to int8 into shared memory, xq[64 s + 16 q + p] = the
// rounding of x[64 s + 16 q + A8_ORDER(p)] (A8_ORDER swaps the middle two of each 4), with each block of 32's
// scale amax / 127 and the sum of its rounded activations (block 2 s + i: k 64 s + 16 q + 8 i + 0..7 for q <
// 4). A thread takes chunks of 8 activations, chunk c at k 8 c (its block 2 (c / 8) + c % 2: lanes 2 and 4
// apart share one), BATCH of them loaded before any is rounded (one wait on L2, not BATCH); every thread calls
// it. A code is rounded as MAGIC + v is (to nearest even, as torch.round), whose low byte is then v's.
template <int WARPS, int BATCH>
__device__ __forceinline__ void round_row(const u16* __restrict__ x, int K, unsigned char* xq, float* scales,
                                          float* sums) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, chunks = K >> 3;
  for (int c0 = warp * 32; c0 < chunks; c0 += BATCH * WARPS * 32) {
    uint4 v[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int c = c0 + b * WARPS * 32 + lane;
      v[b] = c < chunks ? __ldca(reinterpret_cast<const uint4*>(x) + c) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int c = c0 + b * WARPS * 32 + lane;
      if (c - lane >= chunks) break;  // the warp's chunks are all past the row
      const u32 pairs[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
      float f[8], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(pairs[i] << 16);
        f[2 * i + 1] = __uint_as_float(pairs[i] & 0xFFFF0000u);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 4));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // |x inv| <= 127: no clamp
      u32 r[8];
      int sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r[i] = __float_as_uint(__fadd_rn(__fmul_rn(f[i], inv), MAGIC));
        sum += (int)(r[i] - __float_as_uint(MAGIC));
      }
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
      if (c < chunks) {  // the low bytes in A8_ORDER: 0, 2, 1, 3 of each 4
        const u32 lo = __byte_perm(__byte_perm(r[0], r[2], 0x0040), __byte_perm(r[1], r[3], 0x0040), 0x5410);
        const u32 hi = __byte_perm(__byte_perm(r[4], r[6], 0x0040), __byte_perm(r[5], r[7], 0x0040), 0x5410);
        reinterpret_cast<uint2*>(xq)[c] = make_uint2(lo, hi);
        if ((lane & 6) == 0) {  // one lane of the block's four
          const int block = 2 * (c >> 3) + (c & 1);
          const float scale = amax / 127.0f;
          scales[block] = scale;
          sums[block] = scale * (float)sum;
        }
      }
    }
  }
}

// One step of 64 k: C += (128 + q) x and X += x over the step's 4 mma. x: the lane's 16 activations, pairs
// 2m and 2m + 1 being mma m's B operands.
__device__ __forceinline__ void step(uint4 w, const uint4 (&x)[2], float (&C)[4], float (&X)[4]) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
  const u32 xs[8] = {x[0].x, x[0].y, x[0].z, x[0].w, x[1].x, x[1].y, x[1].z, x[1].w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const u32 v = words[m];
    mma(C, operand(v), operand(v >> 4), operand(v >> 8), operand(v >> 12), xs[2 * m], xs[2 * m + 1]);
    mma(X, ONES, ONES, ONES, ONES, xs[2 * m], xs[2 * m + 1]);
  }
}

// Grid (cdiv(N / 16, TW), S); a block is TW x H x KW warps, H = 2 with GLU (else 1). Warp w serves slot
// w % (TW H) (tile blockIdx.x * TW + slot % TW, of the up half with GLU when slot >= TW) and, of the run of
// groups blockIdx.y owns, every KW-th from w / (TW H). A group is GS steps (64 GS weights of a row).
// Accumulator c of lane (g, q): row 16 tile + g + 8 (c / 2), activation row 2q + c % 2.
// GLU: the weight is gate rows over up rows (2N of them) and y (M, N) = silu(gate) * up, each rounded where
// the unfused bf16 ops round. LEAN: a group's activations are loaded as it is multiplied (not one group
// ahead), for fewer registers and so more warps a multiprocessor (a small projection is all ramp and tail).
// FOLD (one activation row) carries a pre-norm layer's RMSNorm across a GEMV boundary, with no norm kernel:
// 1, a projection before the norm, stores h = resid + the product (rounded as torch adds), hw = h (offset +
// wn) in bf16 (the norm's weight applied, not its factor) and each tile's sum of h^2 (sq, N / 16 floats); 2,
// the projection after it, takes hw as x and sq, and scales its sums by RMSNorm's factor of the row,
// rsqrt(sum(sq) / K + eps), before it stores them (with GLU, before the activation).
#ifndef STAMP  // points of a block's path that `benchmarks/gpu_attention_stamps.py --o-proj` times (nothing here)
#define STAMP(point)
#endif

template <int GS, int TW, int KW, int DEPTH, bool LEAN, bool SPLIT, bool GLU, bool ASYNC, int A8, int FOLD>
__global__ void __launch_bounds__(TW * (GLU ? 2 : 1) * KW * 32, MIN_BLOCKS(TW * (GLU ? 2 : 1) * KW * 32, LEAN))
    int4_mma_gemv(const u16* __restrict__ x, const uint4* __restrict__ w, const u32* __restrict__ sz,
                  void* __restrict__ y, int N, int K, int M, const u16* __restrict__ resid, u16* __restrict__ hw,
                  float* __restrict__ sq, const u16* __restrict__ wn, float offset, float eps) {
  static_assert(!(GLU && SPLIT), "a gate/up GEMV stores whole rows");
  static_assert(!(ASYNC && LEAN), "LEAN's point is registers; ASYNC's ring is in shared memory");
  static_assert(!(A8 && SPLIT), "A8 runs whole rows");
  static_assert(!FOLD || (!SPLIT && !A8), "FOLD runs whole rows of bf16 activations");
  static_assert(FOLD != 1 || !GLU, "FOLD 1 is a projection into the residual stream");
  constexpr int SLOTS = TW * (GLU ? 2 : 1);
  constexpr int WARPS = SLOTS * KW;
  pdl_launch_dependents();
  STAMP(0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int T = N >> 4, steps = K >> 6, G = steps / GS;
  const int slot = warp % SLOTS, kr = warp / SLOTS;
  const bool up = GLU && slot >= TW;
  const int own = blockIdx.x * TW + slot % TW;
  const int tile = min(own, T - 1) + (up ? T : 0);  // warps past the last tile redo it and store nothing
  const int run = G / gridDim.y;
  const int first = blockIdx.y * run + kr;  // the warp's groups: first + j KW for j < n
  const int n = (run - kr + KW - 1) / KW;
  const int top = blockIdx.y * run + run - 1;  // the run's last group: loads past the warp's own read it
  const uint4* wp = w + (size_t)tile * steps * 32 + lane;
  const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)min(g, M - 1) * K) + 2 * q;
  const u32* zp = sz + (size_t)(tile * 16 + g) * G;  // row g; row g + 8 is 8 G further

  // The ring of DEPTH groups in flight: registers, or with ASYNC this thread's slots of shared memory, slot d
  // holding group j when j % DEPTH == d (one cp.async group committed per group, so waiting until DEPTH - 1
  // are in flight means the oldest has landed).
  uint4 wb[DEPTH][GS];
  u32 zb[DEPTH][2];
  __shared__ uint4 ring[ASYNC ? WARPS * DEPTH * GS * 32 : 1];
  __shared__ u32 zring[ASYNC ? WARPS * DEPTH * 2 * 32 : 1];
  uint4* const wr = ring + (size_t)warp * DEPTH * GS * 32 + lane;  // slot d, step s: wr[(d * GS + s) * 32]
  u32* const zr = zring + (size_t)warp * DEPTH * 2 * 32 + lane;    // slot d, row g + 8 h: zr[(2 d + h) * 32]
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int grp = min(first + d * KW, top);  // past the warp's groups: a group of the run (not used)
    if (ASYNC) {
#pragma unroll
      for (int s = 0; s < GS; ++s) copy16_async(wr + (d * GS + s) * 32, wp + (size_t)(grp * GS + s) * 32);
      copy4_async(zr + 2 * d * 32, zp + grp);
      copy4_async(zr + (2 * d + 1) * 32, zp + 8 * G + grp);
      commit_async();
    } else {
#pragma unroll
      for (int s = 0; s < GS; ++s) wb[d][s] = __ldcs(wp + (size_t)(grp * GS + s) * 32);
      zb[d][0] = __ldg(zp + grp);
      zb[d][1] = __ldg(zp + 8 * G + grp);
    }
  }
  pdl_wait();
  STAMP(1);
  // A8: the row rounded to int8 (K bytes), then each block of 32's scale and sum (K / 32 floats each): with
  // A8 1 rounded here into shared memory, with A8 2 what x points at (`ember.quant.cuda_int4.round_row`).
  extern __shared__ __align__(16) unsigned char shared_row[];
  const unsigned char* const rounded = A8 == 2 ? reinterpret_cast<const unsigned char*>(x) : shared_row;
  const float2* const xscale = reinterpret_cast<const float2*>(rounded + K);  // step s's two at xscale[s]
  const float2* const xsum = xscale + (K >> 6);
  if (A8 == 1) {
    float* const scales = reinterpret_cast<float*>(shared_row + K);
    round_row<WARPS, LEAN ? 2 : 4>(x, K, shared_row, scales, scales + (K >> 5));
    __syncthreads();
  }
  const uint4* const xr = reinterpret_cast<const uint4*>(rounded) + q;  // A8: step s's at xr[4 s]
  uint4 xc[GS][2];  // LEAN: unused (the compiler drops them); A8: xc8
  Step8 xc8[GS];
#pragma unroll
  for (int s = 0; s < GS; ++s) {
    if (A8) {
      xc8[s] = load8<A8 == 2>(xr, xscale, xsum, min(first, top) * GS + s);
    } else {
      xc[s][0] = __ldca(xp + (min(first, top) * GS + s) * 8);
      xc[s][1] = __ldca(xp + (min(first, top) * GS + s) * 8 + 1);
    }
  }
  // FOLD's operands read before the loop, while the first groups are in flight (after it, each read's latency
  // was the kernel's tail: o and qkv took ~1 us longer than without FOLD). FOLD 1: the tile's 16 rows of resid
  // and offset + wn, in shared memory (no registers held through the loop); FOLD 2: RMSNorm's factor of the
  // row, from its tiles' sums of h^2 (up to 16 a lane: K <= 8192), for the warps that store.
  __shared__ float held[FOLD == 1 ? TW * 32 : 1];
  if (FOLD == 1 && kr == 0 && slot < TW) {
    const int row = tile * 16 + (lane & 15);
    held[slot * 32 + lane] = lane < 16 ? to_f32<true>(resid[row]) : offset + to_f32<true>(wn[row]);
    __syncwarp();
  }
  float r = 1.0f;
  if (FOLD == 2 && kr == 0) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < (FOLD == 2 ? 16 : 0); ++i) {
      if (lane + 32 * i < (K >> 4)) total += __ldca(sq + lane + 32 * i);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
    r = rsqrtf(total / (float)K + eps);
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < n; j0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int j = j0 + d;
      if (j < n) {
        // LEAN: this group's activations; else the next group's, in flight while this one is multiplied.
        const int at = LEAN ? first + j * KW : first + min(j + 1, n - 1) * KW;
        uint4 xn[GS][2];
        Step8 xn8[GS];
#pragma unroll
        for (int s = 0; s < GS; ++s) {
          if (A8) {
            xn8[s] = load8<A8 == 2>(xr, xscale, xsum, at * GS + s);
          } else {
            xn[s][0] = __ldca(xp + (at * GS + s) * 8);
            xn[s][1] = __ldca(xp + (at * GS + s) * 8 + 1);
          }
        }
        if (ASYNC) {  // group j from its slot (read before the slot is refilled below)
          wait_async<DEPTH - 1>();
#pragma unroll
          for (int s = 0; s < GS; ++s) wb[d][s] = wr[(d * GS + s) * 32];
          zb[d][0] = zr[2 * d * 32];
          zb[d][1] = zr[(2 * d + 1) * 32];
        }
        float C[4] = {0.0f, 0.0f, 0.0f, 0.0f}, X[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (A8) {  // X: the sum of the group's rounded activations
#pragma unroll
          for (int s = 0; s < GS; ++s) {
            const Step8& a = LEAN ? xn8[s] : xc8[s];
            step8(wb[d][s], a.codes, a.scale, C);
            X[0] += a.sum.x + a.sum.y;
          }
          X[2] = X[0];
        } else {
#pragma unroll
          for (int s = 0; s < GS; ++s) step(wb[d][s], LEAN ? xn[s] : xc[s], C, X);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const u32 f = zb[d][c >> 1];
          const float scale = __uint_as_float(f & 0xFFFF0000u), low = __uint_as_float(f << 16);
          acc[c] = A8 ? fmaf(scale, C[c], fmaf(low, X[c], acc[c]))  // u8 codes q: no 128 to take off
                      : fmaf(scale, C[c], fmaf(-128.0f, scale, low) * X[c] + acc[c]);
        }
        if (j + DEPTH < n) {  // this slot's next group (ASYNC: the slot's words are in registers by now)
          const int grp = first + (j + DEPTH) * KW;
          if (ASYNC) {
#pragma unroll
            for (int s = 0; s < GS; ++s) copy16_async(wr + (d * GS + s) * 32, wp + (size_t)(grp * GS + s) * 32);
            copy4_async(zr + 2 * d * 32, zp + grp);
            copy4_async(zr + (2 * d + 1) * 32, zp + 8 * G + grp);
          } else {
#pragma unroll
            for (int s = 0; s < GS; ++s) wb[d][s] = __ldcs(wp + (size_t)(grp * GS + s) * 32);
            zb[d][0] = __ldg(zp + grp);
            zb[d][1] = __ldg(zp + 8 * G + grp);
          }
        }
        if (ASYNC) commit_async();  // one group a group, empty past the run's end
        if (j == 0) STAMP(2);
#pragma unroll
        for (int s = 0; s < GS; ++s) {
          xc[s][0] = xn[s][0];
          xc[s][1] = xn[s][1];
          xc8[s] = xn8[s];
        }
      }
    }
  }
  if (ASYNC) wait_async<0>();  // no copy may land in shared memory after the block has left it
  STAMP(3);
  if (KW > 1) {  // the slot's other warps hand their sums to warp `slot`, which adds them in order
    __shared__ float red[KW > 1 ? (KW - 1) * SLOTS * 128 : 1];
    if (kr > 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) red[((kr - 1) * SLOTS + slot) * 128 + c * 32 + lane] = acc[c];
    }
    __syncthreads();
    if (kr == 0) {
#pragma unroll
      for (int k = 1; k < KW; ++k) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[c] += red[((k - 1) * SLOTS + slot) * 128 + c * 32 + lane];
      }
    }
  }
  STAMP(4);
  if (GLU) {  // the up warps hand their sums to the gate warps of the same rows
    __shared__ float ups[GLU ? TW * 128 : 1];
    if (kr == 0 && up) {
#pragma unroll
      for (int c = 0; c < 4; ++c) ups[(slot - TW) * 128 + c * 32 + lane] = acc[c];
    }
    __syncthreads();
    if (kr > 0 || up || own >= T) return;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int m = 2 * q + (c & 1), row = own * 16 + g + 8 * (c >> 1);
      if (m < M) {
        const float gate = round_to<true>(FOLD == 2 ? acc[c] * r : acc[c]);
        const float act = round_to<true>(gate / (1.0f + __expf(-gate)));
        const float upv = ups[slot * 128 + c * 32 + lane];
        const float out = act * round_to<true>(FOLD == 2 ? upv * r : upv);
        static_cast<u16*>(y)[(size_t)m * N + row] = from_f32<true>(out);
      }
    }
    return;
  }
  if (kr > 0 || own >= T) return;
  float squares = 0.0f;  // FOLD 1: of the lane's h
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int m = 2 * q + (c & 1), row = tile * 16 + g + 8 * (c >> 1);
    if (m < M) {
      if (SPLIT) {
        static_cast<float*>(y)[((size_t)blockIdx.y * M + m) * N + row] = acc[c];
      } else if (FOLD == 1) {
        const int at = slot * 32 + g + 8 * (c >> 1);  // M = 1: m is 0
        const u16 h = from_f32<true>(held[at] + round_to<true>(acc[c]));
        const float hf = to_f32<true>(h);
        static_cast<u16*>(y)[row] = h;
        hw[row] = from_f32<true>(hf * held[at + 16]);
        squares = fmaf(hf, hf, squares);
      } else {
        static_cast<u16*>(y)[(size_t)m * N + row] = from_f32<true>(FOLD == 2 ? acc[c] * r : acc[c]);
      }
    }
  }
  if (FOLD == 1) {  // the tile's 16 rows: lanes q = 0 hold them (M = 1), g apart
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) squares += __shfl_xor_sync(0xFFFFFFFFu, squares, o);
    if (lane == 0) sq[tile] = squares;
  }
  STAMP(5);
}
