// Ember's int8 weight-only GEMV for CUDA decode steps, compiled at run time by NVRTC (ember.ops.cuda_rtc).
//
// y[m, n] = round(scale[n] * sum_k q[n, k] * x[m, k]) for a few activation rows m: q int8 codes (N, K)
// row-major, scale (N,) and x, y in bf16 or fp16 (raw 16-bit words here: no CUDA headers needed). GLU: the
// weight is gate rows over up rows and y[m, n] = silu(gate) * up, each rounded where the unfused ops round.
// Two folds of a pre-norm layer's work between its projections (`ember.quant.kernels.int8_linear_add`,
// `int8_norm_linear`): RESID stores y = resid + the product (the residual add, rounded as torch adds), and
// NORM takes x as the residual stream h and multiplies RMSNorm(h) instead: the norm is a scalar r of the row
// times a weight of each k, so each activation is scaled by (offset + weight[k]) as it is loaded, the block
// sums h^2 beside the products, and r = rsqrt(mean(h^2) + eps) scales the row's sums at the end (the
// normalised activations are not rounded to 16 bits on the way, as the unfused ops round them).
//
// Decoding reads every weight once per token, so this kernel is judged by bytes of weights per second.
// A block owns R output rows (2R with GLU) of one activation row, and its threads walk K together, each
// taking 16-byte chunks of every row (16 codes) a block-width apart; the partial sums meet in shuffles and
// shared memory at the end. What it does that the Triton GEMV could not be made to do:
// - the next chunks' weights are loaded before this chunk's are multiplied (a register double buffer),
//   streamed with the evict-first hint;
// - a thread's 16 activations are loaded and converted once for its R rows;
// - a code becomes a float with one byte permute: u = q + 128 under 2^15's exponent is the float 32768 + u,
//   and 32896 * sum(x) leaves the sum once at the end (each thread sums its x as it goes: an add per
//   activation, not per weight). The float32 sums stay well under the bf16 output's rounding (tested);
// - launched with programmatic dependent launch: the first weights load before griddepcontrol.wait.
//
// (A persistent grid of a few blocks a multiprocessor, each walking row blocks with the next one's weights in
// flight across its reduction, was slower on an H200: BENCHMARKS.md, twenty-first session.)

#include "ember_cuda.cuh"

// Two 16-bit activations of one word as floats (low word first).
template <bool BF16>
__device__ __forceinline__ void pair(u32 v, float& lo, float& hi) {
  if (BF16) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xFFFF0000u);
  } else {
    lo = to_f32<false>(v & 0xFFFFu);
    hi = to_f32<false>(v >> 16);
  }
}

// Weights: read once a step, streamed (evict-first). Activations: read by every block, by ld.global.ca (L1 and
// L2, coherent once griddepcontrol.wait returns), not through the read-only cache (__ldg): the kernel before
// wrote them, and with programmatic dependent launch it still runs when this one starts, so that cache's
// contract (nothing changes while the kernel lives) does not hold for them.
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ uint4 load_cached(const uint4* p) { return __ldca(p); }

// acc += the 4 codes of word w, each as the float 32768 + u (u = q + 128), times x[0..3]: u under 2^15's
// exponent (bits 8-15 of the mantissa) by one byte permute each. 32896 * sum(x) is taken off at the end.
__device__ __forceinline__ float dot4(u32 w, const float* x, float acc) {
  const u32 t = w ^ 0x80808080u;  // u = q + 128, unsigned
  acc = fmaf(__uint_as_float(__byte_perm(t, 0x47000000u, 0x7504)), x[0], acc);
  acc = fmaf(__uint_as_float(__byte_perm(t, 0x47000000u, 0x7514)), x[1], acc);
  acc = fmaf(__uint_as_float(__byte_perm(t, 0x47000000u, 0x7524)), x[2], acc);
  acc = fmaf(__uint_as_float(__byte_perm(t, 0x47000000u, 0x7534)), x[3], acc);
  return acc;
}

__device__ __forceinline__ float dot16(uint4 w, const float* x, float acc) {
  acc = dot4(w.x, x, acc);
  acc = dot4(w.y, x + 4, acc);
  acc = dot4(w.z, x + 8, acc);
  return dot4(w.w, x + 12, acc);
}

template <int NR>
struct Sums {
  float acc[NR];
  float sx;
  float sq;  // NORM: the sum of h^2
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    sx = 0.0f;
    sq = 0.0f;
  }
  // One chunk: 16 activations (two 16-byte words) against the chunk of each of the NR rows; with NORM, the
  // activations are h, scaled by offset + the norm's weights n0, n1 (summed squared first).
  template <bool BF16, bool NORM>
  __device__ __forceinline__ void add(const uint4* rows, uint4 x0, uint4 x1, uint4 n0, uint4 n1, float offset) {
    float xf[16];
    const u32 words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) pair<BF16>(words[i], xf[2 * i], xf[2 * i + 1]);
    if (NORM) {
      float nf[16];
      const u32 nwords[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) pair<BF16>(nwords[i], nf[2 * i], nf[2 * i + 1]);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        sq = fmaf(xf[i], xf[i], sq);
        xf[i] *= offset + nf[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) sx += xf[i];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = dot16(rows[r], xf, acc[r]);
  }
};

// The block's sums -> y. red: WARPS x (NR + 2) floats of shared memory; every thread calls it.
template <bool BF16, int R, int WARPS, bool GLU, bool RESID, bool NORM>
__device__ __forceinline__ void finish(Sums<GLU ? 2 * R : R>& s, float* red, const u16* __restrict__ scale,
                                       u16* __restrict__ y, int m, int n0, int N, int K,
                                       const u16* __restrict__ resid, float eps) {
  constexpr int NR = GLU ? 2 * R : R;
  constexpr int NS = NR + (NORM ? 2 : 1);
  float part[NS];
#pragma unroll
  for (int r = 0; r < NR; ++r) part[r] = s.acc[r];
  part[NR] = s.sx;
  if (NORM) part[NS - 1] = s.sq;
#pragma unroll
  for (int r = 0; r < NS; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) part[r] += __shfl_xor_sync(0xFFFFFFFFu, part[r], o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < NS; ++r) red[warp * NS + r] = part[r];
  }
  __syncthreads();
  if (threadIdx.x < R) {
    const int r = threadIdx.x, n = n0 + r;
    float gate = 0.0f, up = 0.0f, sx = 0.0f, sq = 0.0f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      gate += red[i * NS + r];
      if (GLU) up += red[i * NS + R + r];
      sx += red[i * NS + NR];
      if (NORM) sq += red[i * NS + NS - 1];
    }
    gate = fmaf(-32896.0f, sx, gate);
    up = fmaf(-32896.0f, sx, up);
    if (NORM) {  // RMSNorm's factor of the row, as the unfused norm computes it in float32
      const float rn = rsqrtf(sq / (float)K + eps);
      gate *= rn;
      up *= rn;
    }
    if (n < N) {
      float out = gate * to_f32<BF16>(scale[n]);
      if (GLU) {
        const float g = round_to<BF16>(out);
        const float act = round_to<BF16>(g / (1.0f + __expf(-g)));
        out = act * round_to<BF16>(up * to_f32<BF16>(scale[N + n]));
      }
      if (RESID) out = to_f32<BF16>(resid[(size_t)m * N + n]) + round_to<BF16>(out);
      y[(size_t)m * N + n] = from_f32<BF16>(out);
    }
  }
}

// Block b serves activation row b % M and rows (b / M) * R onwards; a thread keeps U
// chunks of each row in flight, and the next U while it multiplies these. resid (M, N): RESID's addend;
// norm (K,), eps, offset: NORM's weight, epsilon and weight offset (Gemma's 1); unread otherwise.
template <bool BF16, int R, int U, int WARPS, bool GLU, bool RESID, bool NORM>
__global__ void __launch_bounds__(WARPS * 32)
    int8_gemv(const u16* __restrict__ x, const signed char* __restrict__ w, const u16* __restrict__ scale,
              u16* __restrict__ y, int N, int K, int M, const u16* __restrict__ resid, const u16* __restrict__ norm,
              float eps, float offset) {
  pdl_launch_dependents();
  constexpr int T = WARPS * 32;
  constexpr int NR = GLU ? 2 * R : R;
  const int m = blockIdx.x % M;
  const int n0 = (blockIdx.x / M) * R;
  const int C = K >> 4;  // 16-byte chunks a row
  const uint4* rows[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    int n = min(n0 + (r % R), N - 1);  // rows past N read row N - 1 and are not stored
    if (GLU && r >= R) n += N;       // the up rows of gate row n
    rows[r] = reinterpret_cast<const uint4*>(w + (size_t)n * K);
  }
  const uint4* xs = reinterpret_cast<const uint4*>(x + (size_t)m * K);
  const uint4* ns = reinterpret_cast<const uint4*>(norm);
  Sums<NR> s;
  s.clear();
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 cur[U][NR];
  int c = threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int cc = c + u * T;
#pragma unroll
    for (int r = 0; r < NR; ++r) cur[u][r] = cc < C ? load_stream(rows[r] + cc) : zero;
  }
  pdl_wait();
  for (; c < C; c += U * T) {
    uint4 xv[U][2], nv[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * T;
      xv[u][0] = cc < C ? load_cached(xs + 2 * cc) : zero;
      xv[u][1] = cc < C ? load_cached(xs + 2 * cc + 1) : zero;
      nv[u][0] = NORM && cc < C ? load_cached(ns + 2 * cc) : zero;
      nv[u][1] = NORM && cc < C ? load_cached(ns + 2 * cc + 1) : zero;
    }
    uint4 next[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + (U + u) * T;
#pragma unroll
      for (int r = 0; r < NR; ++r) next[u][r] = cc < C ? load_stream(rows[r] + cc) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) s.template add<BF16, NORM>(cur[u], xv[u][0], xv[u][1], nv[u][0], nv[u][1], offset);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r) cur[u][r] = next[u][r];
  }
  __shared__ float red[WARPS * (NR + 2)];
  finish<BF16, R, WARPS, GLU, RESID, NORM>(s, red, scale, y, m, n0, N, K, resid, eps);
}
