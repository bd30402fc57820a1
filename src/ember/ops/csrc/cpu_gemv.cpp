// Ember's CPU kernels for a few rows of activations against int4 and int8 weights (decode steps), built on
// first use by ember/ops/cpu_ext.py with -march=native for the machine that runs them.
//
// Both multiply int8 codes of the activations by the weights' codes with integer dot products (AVX512-VNNI's
// vpdpbusd: 64 byte products an instruction, or AVX2's vpmaddubsw / AVX-VNNI), then apply the float scales once
// per block of 32 k. torch's CPU int4 kernel converts every weight to float first; at one row that conversion,
// not memory, bounds it (SmolLM2's projections on a 2-core Zen 4, one decode step's worth: 3.5 ms of torch's
// kernel, 1.4 ms of these with the weights in cache, ~2.3 ms streaming them from memory).
//
//   int4_gemv: weights w = q * scale + min, q in [0, 15], scale and min per group of g along K (g a multiple
//     of 32); activations quantized per block of 32 k (x ~ xq * d, xq in [-127, 127], d = max|x| / 127), so
//     y[n] = sum_b d_b * (scale * sum_k q_k xq_k + min * sum_k xq_k), the min term from the activations alone.
//   int8_gemv: weights w = q * scale per output row, q in [-127, 127]; activations quantized per row (the
//     int8-dyn scheme's rounding, bit for bit the int32 sums of torch._int_mm), y[n] = scale_n * d * sum_k q_k xq_k.
//
// Layouts (built by cpu_ext.py from the canonical codes), tiles of 16 output rows:
//   int4 packed (N/16, K/32 * 256) uint8: per tile and block of 32 k, 4 runs of 64 bytes; run i holds for row
//     l (16 lanes of 4 bytes) at byte t the code of k = 4i + t in its low nibble and of k = 16 + 4i + t in its
//     high one. int4 scale_min (N/16, K/g, 2, 16) float16: the tile's 16 scales, then its 16 mins.
//   int8 packed (N/16, K/32 * 512) uint8: per tile and block, 8 runs of 64 bytes; run i holds for row l at byte
//     t the code of k = 4i + t, plus 128 (an unsigned operand for vpdpbusd; XOR 0x80 gives the signed code).
//
// Shape legend: M rows of activations, K input features, N output features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EMBER_AVX512_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 16;   // output rows of a tile
constexpr int kBlock = 32;  // k of an activation block
// Activation rows a tile's weights meet while loaded: with 32 vector registers (AVX-512) 8 rows' sums fit.
#ifndef EMBER_MAX_ROWS
#if defined(__AVX512F__)
#define EMBER_MAX_ROWS 8
#else
#define EMBER_MAX_ROWS 4
#endif
#endif
constexpr int kMaxRows = EMBER_MAX_ROWS;
// Rows of activations a thread quantizes at least (a prefill's; a decode step's one row stays on the caller's).
constexpr int64_t kQuantizeRows = 16;

const char* simd_name() {
#if defined(EMBER_AVX512_VNNI)
  return "avx512-vnni";
#elif defined(EMBER_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(EMBER_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- 16 int32 / float lanes, one per output row of a tile ------------------------------------------------

#if defined(EMBER_AVX512_VNNI)
struct I16 {
  __m512i v;
};
struct F16x {
  __m512 v;
};
inline I16 izero() { return {_mm512_setzero_si512()}; }
// acc + per lane sum_{t<4} u8(w)[lane][t] * s8(x4)[t]
inline I16 dot4(I16 acc, __m512i w, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, w, _mm512_set1_epi32(x4))}; }
inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline __m512i high_nibbles(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 isub_scalar(I16 a, int32_t s) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(s))}; }
inline F16x fzero() { return {_mm512_setzero_ps()}; }
inline F16x fset(float s) { return {_mm512_set1_ps(s)}; }
inline F16x to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F16x load_half(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16x load_float(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16x fmul_scalar(F16x a, float s) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(s))}; }
inline F16x fma(F16x a, F16x b, F16x c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16x fmul(F16x a, F16x b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline void store(float* p, F16x a) { _mm512_storeu_ps(p, a.v); }
// int8 weights are stored plus 128, so a dot product of unsigned weights over one block of activations
// counts 128 * sum(xq) too: subtract it once per block.
constexpr bool kInt8Offset = true;
inline I16 dot4_int8(I16 acc, __m512i w, int32_t x4) { return dot4(acc, w, x4); }

#elif defined(EMBER_AVX2)
struct I16 {
  __m256i lo, hi;
};
struct F16x {
  __m256 lo, hi;
};
struct W64 {
  __m256i lo, hi;
};
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot4_256(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else  // u8 codes of at most 15 x s8: pairs of products stay far inside int16
  __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline I16 dot4(I16 acc, W64 w, int32_t x4) {
  __m256i x = _mm256_set1_epi32(x4);
  return {dot4_256(acc.lo, w.lo, x), dot4_256(acc.hi, w.hi, x)};
}
inline W64 load64(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline W64 low_nibbles(W64 v) {
  __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
inline W64 high_nibbles(W64 v) {
  __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
inline I16 iadd(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I16 isub_scalar(I16 a, int32_t s) {
  __m256i v = _mm256_set1_epi32(s);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline F16x fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16x fset(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline F16x to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F16x load_half(const at::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F16x load_float(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16x fmul_scalar(F16x a, float s) {
  __m256 v = _mm256_set1_ps(s);
  return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)};
}
inline F16x fma(F16x a, F16x b, F16x c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16x fmul(F16x a, F16x b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline void store(float* p, F16x a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// Unsigned weights up to 255 would overflow vpmaddubsw's int16 pairs: take the signed codes (XOR 0x80) and
// multiply |w| by x with w's sign, as the instruction's unsigned and signed operands.
constexpr bool kInt8Offset = false;
inline __m256i dot4_int8_256(__m256i acc, __m256i w_off, __m256i x) {
  __m256i w = _mm256_xor_si256(w_off, _mm256_set1_epi8(static_cast<char>(0x80)));
  __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline I16 dot4_int8(I16 acc, W64 w, int32_t x4) {
  __m256i x = _mm256_set1_epi32(x4);
  return {dot4_int8_256(acc.lo, w.lo, x), dot4_int8_256(acc.hi, w.hi, x)};
}

#else  // portable: the same arithmetic, lane by lane
struct I16 {
  int32_t v[kTile];
};
struct F16x {
  float v[kTile];
};
struct W64 {
  uint8_t b[64];
};
inline I16 izero() { return I16{}; }
inline I16 dot4(I16 acc, const W64& w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int l = 0; l < kTile; ++l)
    for (int t = 0; t < 4; ++t) acc.v[l] += static_cast<int32_t>(w.b[4 * l + t]) * x[t];
  return acc;
}
inline W64 load64(const uint8_t* p) {
  W64 w;
  std::memcpy(w.b, p, 64);
  return w;
}
inline W64 low_nibbles(W64 w) {
  for (auto& b : w.b) b &= 0x0F;
  return w;
}
inline W64 high_nibbles(W64 w) {
  for (auto& b : w.b) b >>= 4;
  return w;
}
inline I16 iadd(I16 a, I16 b) {
  for (int l = 0; l < kTile; ++l) a.v[l] += b.v[l];
  return a;
}
inline I16 isub_scalar(I16 a, int32_t s) {
  for (auto& x : a.v) x -= s;
  return a;
}
inline F16x fzero() { return F16x{}; }
inline F16x fset(float s) {
  F16x f;
  for (auto& x : f.v) x = s;
  return f;
}
inline F16x to_float(I16 a) {
  F16x f;
  for (int l = 0; l < kTile; ++l) f.v[l] = static_cast<float>(a.v[l]);
  return f;
}
inline F16x load_half(const at::Half* p) {
  F16x f;
  for (int l = 0; l < kTile; ++l) f.v[l] = static_cast<float>(p[l]);
  return f;
}
inline F16x load_float(const float* p) {
  F16x f;
  std::memcpy(f.v, p, sizeof(f.v));
  return f;
}
inline F16x fmul_scalar(F16x a, float s) {
  for (auto& x : a.v) x *= s;
  return a;
}
inline F16x fma(F16x a, F16x b, F16x c) {
  for (int l = 0; l < kTile; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline F16x fmul(F16x a, F16x b) {
  for (int l = 0; l < kTile; ++l) a.v[l] *= b.v[l];
  return a;
}
inline void store(float* p, F16x a) { std::memcpy(p, a.v, sizeof(a.v)); }
constexpr bool kInt8Offset = true;
inline I16 dot4_int8(I16 acc, const W64& w, int32_t x4) { return dot4(acc, w, x4); }
#endif

// ---- activations --------------------------------------------------------------------------------------

// Row x (K floats) -> xq (K int8), and per block of 32: d (its scale) and d * sum(xq) (the min term's factor).
void quantize_blocks(const float* x, int64_t K, int8_t* xq, float* d, float* dsum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int t = 0; t < kBlock; ++t) amax = std::max(amax, std::fabs(xb[t]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int t = 0; t < kBlock; ++t) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[t] * inv));
      xq[b * kBlock + t] = static_cast<int8_t>(q);
      sum += q;
    }
    d[b] = amax / 127.f;
    dsum[b] = d[b] * static_cast<float>(sum);
  }
}

// Row x (K floats) -> xq (K int8) with one scale, rounded as the int8-dyn module rounds for torch._int_mm
// (x / scale, half to even); returns the scale and sets *sum to sum(xq).
float quantize_row(const float* x, int64_t K, int8_t* xq, int32_t* sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = std::max(amax, 1e-8f) / 127.f;
  int32_t total = 0;
  for (int64_t k = 0; k < K; ++k) {
    xq[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / scale), -127.f, 127.f));
    total += xq[k];
  }
  *sum = total;
  return scale;
}

// ---- tiles --------------------------------------------------------------------------------------------

// R activation rows (at xq + r * K) against one int4 tile: out[r * N + l] for its 16 rows l.
template <int R>
void int4_tile(const uint8_t* w, const at::Half* sm, const int8_t* xq, const float* d, const float* dsum,
               int64_t K, int64_t blocks_per_group, float* out, int64_t N) {
  const int64_t KB = K / kBlock;
  F16x acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* wb = w + b * 256;
    I16 sums[R];  // one register a row: a block's 8 dot products (a fresh chain each block)
    for (int r = 0; r < R; ++r) sums[r] = izero();
    for (int i = 0; i < 4; ++i) {
      const auto v = load64(wb + 64 * i);
      const auto low = low_nibbles(v), high = high_nibbles(v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = xq + r * K + b * kBlock;
        sums[r] = dot4(dot4(sums[r], low, load4(xb + 4 * i)), high, load4(xb + 16 + 4 * i));
      }
    }
    const at::Half* s = sm + (b / blocks_per_group) * 2 * kTile;
    const F16x scale = load_half(s), mn = load_half(s + kTile);
    for (int r = 0; r < R; ++r)
      acc[r] = fma(mn, fset(dsum[r * KB + b]), fma(to_float(sums[r]), fmul_scalar(scale, d[r * KB + b]), acc[r]));
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}

// R activation rows (at xq + r * K, scales d[r], code sums xsum[r]) against one int8 tile of weights with
// per-row scales: out[r * N + l] for its 16 rows l.
template <int R>
void int8_tile(const uint8_t* w, const float* scales, const int8_t* xq, const float* d, const int32_t* xsum,
               int64_t K, float* out, int64_t N) {
  I16 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = izero(), acc[r][1] = izero();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* wb = w + b * 512;
    for (int i = 0; i < 8; ++i) {  // two accumulators a row: shorter dependency chains
      const auto v = load64(wb + 64 * i);
      for (int r = 0; r < R; ++r) acc[r][i & 1] = dot4_int8(acc[r][i & 1], v, load4(xq + r * K + b * kBlock + 4 * i));
    }
  }
  const F16x s = load_float(scales);
  for (int r = 0; r < R; ++r) {
    I16 a = iadd(acc[r][0], acc[r][1]);
    if (kInt8Offset) a = isub_scalar(a, 128 * xsum[r]);
    store(out + r * N, fmul(to_float(a), fmul_scalar(s, d[r])));
  }
}

// Calls tile(R, first row) for the rows of x in runs of at most kMaxRows.
template <int R, typename Tile>
void rows_left(int64_t left, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R)
      tile(std::integral_constant<int, R>{}, m);
    else
      rows_left<R - 1>(left, m, tile);
  }
}

template <typename Tile>
void by_rows(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) tile(std::integral_constant<int, kMaxRows>{}, m);
  rows_left<kMaxRows - 1>(M - m, m, tile);
}

void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous (M, K) float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kBlock == 0, "K = ", x.size(1), " is not a multiple of ", kBlock);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) / kBlock * bytes_per_block,
              "packed weights ", packed.sizes(), " do not match K = ", x.size(1));
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                     int64_t group_size) {
  check_operands(x, packed, 256);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  TORCH_CHECK(group_size % kBlock == 0 && K % group_size == 0, "group size ", group_size, " does not tile K = ", K);
  const int64_t groups = K / group_size, KB = K / kBlock;
  TORCH_CHECK(scale_min.scalar_type() == at::kHalf && scale_min.is_contiguous() &&
                  scale_min.numel() == tiles * groups * 2 * kTile,
              "scale_min ", scale_min.sizes(), " does not match ", tiles, " tiles of ", groups, " groups");
  auto out = at::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * KB), dsum(M * KB);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, kQuantizeRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_blocks(xp + m * K, K, &xq[m * K], &d[m * KB], &dsum[m * KB]);
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scale_min.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      by_rows(M, [&](auto R, int64_t m) {
        int4_tile<decltype(R)::value>(wp + t * KB * 256, sp + t * groups * 2 * kTile, &xq[m * K], &d[m * KB],
                                      &dsum[m * KB], K, group_size / kBlock, op + m * N + t * kTile, N);
      });
    }
  });
  return out;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  check_operands(x, packed, 512);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  TORCH_CHECK(K <= 65536, "K = ", K, " could overflow int32 sums");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales ", scales.sizes(), " do not match N = ", N);
  auto out = at::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M);
  std::vector<int32_t> xsum(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, kQuantizeRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) d[m] = quantize_row(xp + m * K, K, &xq[m * K], &xsum[m]);
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      by_rows(M, [&](auto R, int64_t m) {
        int8_tile<decltype(R)::value>(wp + t * (K / kBlock) * 512, sp + t * kTile, &xq[m * K], &d[m], &xsum[m], K,
                                      op + m * N + t * kTile, N);
      });
    }
  });
  return out;
}

std::string simd() { return simd_name(); }

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale_min, int group_size) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("simd() -> str");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CompositeExplicitAutograd, m) { m.impl("simd", &simd); }
