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
// AMX (Sapphire Rapids and later, where the compiler targets AMX and Linux grants the tile state):
//   int4_gemv runs rows 16 at a time on the tile unit, one TDPBSUD per tile of weights and block of 32 k (the
//     activation codes signed, the weights' codes unpacked to unsigned bytes once per tile for all rows), then
//     applies the scales to the block's sums with the vector path's instructions in its order: the same bits
//     (tested). Only 1.1-1.3x faster (2 threads of a Xeon VM): every block's sums must leave the tile unit
//     through memory to be scaled, and that, not the products, bounds it.
//   int4_gemm_bf16 (a prefill's many rows) keeps its sums on the tile unit across K instead: x rounded to bf16,
//     the weights dequantized to bf16 (q * scale + min, rounded) a tile at a time, float32 sums.
//   The float kernels (*_gemv_f32) take rows 16 at a time there too, x as three bf16 parts (amx_f32_rows).
//
// The float kernels' one or two rows (decode steps) on AVX512-VNNI, AVX-VNNI or AVX2: x as three int8 parts of a
// block's scale against the codes in integer dot products (split_tile), in place of a float conversion and an
// FMA a weight. Their rows from kWideRows (a prefill's) on AVX512-VNNI, those the tile unit leaves: x as one int16
// code of a block's scale against the codes made int16 pairs once a tile (wide_tile).
//
// Shape legend: M rows of activations, K input features, N output features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EMBER_AVX512_VNNI 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define EMBER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define EMBER_AMX_BF16 1
#endif
#endif
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
// Rows from which the 5- and 6-bit float kernels turn every tile's codes into floats once, rather than for each
// run of kMaxRows rows (FloatCodes).
constexpr int64_t kFloatCodeRows = 32;
// Bytes ahead of a tile's codes the float kernels ask of the cache (EMBER_CPU_PREFETCH, read once; 0: none).
const int64_t kPrefetch = [] {
  const char* env = std::getenv("EMBER_CPU_PREFETCH");
  return env != nullptr ? std::atoll(env) : int64_t{4096};
}();

// Asks the cache for `lines` lines from kPrefetch bytes past p (a block's codes, the next blocks' being what the
// kernel reads after: a tile's, then the next tile's, lie one after another).
inline void prefetch_ahead(const uint8_t* p, int lines) {
  if (kPrefetch > 0)
    for (int l = 0; l < lines; ++l) __builtin_prefetch(p + kPrefetch + 64 * l, 0, 3);
}
// Rows of activations a thread quantizes at least (a prefill's; a decode step's one row stays on the caller's).
constexpr int64_t kQuantizeRows = 16;

const char* simd_name() {
#if defined(EMBER_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return "avx512-vnni+amx-bf16";
#elif defined(EMBER_AMX)
  return "avx512-vnni+amx";
#elif defined(EMBER_AVX512_VNNI)
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
// Byte j of each lane's 4 as a signed int8, sign-extended to the lane's int32.
inline I16 signed_byte(__m512i v, int j) { return {_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24)}; }
inline __m512i flip_bytes(__m512i v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
// The nibble at bit `shift` of each lane as a float: vpermps looks the shifted lane up in 0..15 by its low 4
// bits alone (no mask, no conversion).
inline F16x nibble_float(__m512i v, int shift) {
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(v, shift), values)};
}
// Run i of a block of 5-bit codes (high_bits_tile_f32's layout: the nibbles v, the fifth bits h) as two words a lane
// whose byte j holds the code of k = 4i + j (lo) or 16 + 4i + j (hi) in its low 5 bits: the fifth bits (bit
// 8j + i, 8j + 4 + i of h) moved to bit 8j + 4 by one shift and put in place by one bitwise select.
struct QuintRun {
  __m512i lo, hi;
};
inline QuintRun quint_run(__m512i v, __m512i h, int i) {
  const __m512i at4 = _mm512_set1_epi32(0x10101010);
  // 0xD8: c ? b : a, bit by bit (a the nibbles, b the fifth bits, c bit 4 of each byte)
  return {_mm512_ternarylogic_epi32(v, _mm512_slli_epi32(h, 4 - i), at4, 0xD8),
          _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4), _mm512_srli_epi32(h, i), at4, 0xD8)};
}
// Code j (of 4) of the run's lo (half 0) or hi (half 1) codes as a float: vpermt2ps looks the shifted lane up
// in 0..31 by its low 5 bits alone.
inline F16x quint_float(const QuintRun& q, int j, int half) {
  const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 high = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  return {_mm512_permutex2var_ps(low, _mm512_srli_epi32(half ? q.hi : q.lo, 8 * j), high)};
}
// Run i of a block of 6-bit codes (high_bits_tile_f32's layout: the fifth bits h, the sixth h6 laid out alike): the
// quint run's words with the sixth bits moved to bit 8j + 5 by one shift and put in place by one select.
inline QuintRun hex_run(__m512i v, __m512i h, __m512i h6, int i) {
  const QuintRun q = quint_run(v, h, i);
  const __m512i at5 = _mm512_set1_epi32(0x20202020);
  const __m512i high = i <= 1 ? _mm512_slli_epi32(h6, 1 - i) : _mm512_srli_epi32(h6, i - 1);
  return {_mm512_ternarylogic_epi32(q.lo, _mm512_slli_epi32(h6, 5 - i), at5, 0xD8),
          _mm512_ternarylogic_epi32(q.hi, high, at5, 0xD8)};
}
// Code j of the run's lo (half 0) or hi (half 1) 6-bit codes as a float, a signed one (-32..31, two's
// complement in 6 bits): shifted up to the lane's top and back, its sign extended.
inline F16x hex_float(const QuintRun& q, int j, int half) {
  return {_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(half ? q.hi : q.lo, 26 - 8 * j), 26))};
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
inline F16x load_int8_float(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F16x fmul_scalar(F16x a, float s) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(s))}; }
inline F16x fma(F16x a, F16x b, F16x c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16x fmul(F16x a, F16x b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16x fadd(F16x a, F16x b) { return {_mm512_add_ps(a.v, b.v)}; }
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
inline I16 signed_byte(W64 v, int j) {
  return {_mm256_srai_epi32(_mm256_slli_epi32(v.lo, 24 - 8 * j), 24), _mm256_srai_epi32(_mm256_slli_epi32(v.hi, 24 - 8 * j), 24)};
}
inline W64 flip_bytes(W64 v) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(v.lo, m), _mm256_xor_si256(v.hi, m)};
}
inline F16x nibble_float(W64 v, int shift) {
  const __m256i m = _mm256_set1_epi32(0xF);
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.lo, shift), m)),
          _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.hi, shift), m))};
}
struct QuintRun {
  W64 v, h;
  int i;
};
inline QuintRun quint_run(W64 v, W64 h, int i) { return {v, h, i}; }
inline __m256i quint_256(__m256i v, __m256i h, int shift, int hbit) {
  const __m256i nibble = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xF));
  const __m256i fifth = _mm256_and_si256(_mm256_srli_epi32(h, hbit), _mm256_set1_epi32(1));
  return _mm256_or_si256(nibble, _mm256_slli_epi32(fifth, 4));
}
inline F16x quint_float(const QuintRun& q, int j, int half) {
  const int shift = 8 * j + 4 * half, hbit = shift + q.i;
  return {_mm256_cvtepi32_ps(quint_256(q.v.lo, q.h.lo, shift, hbit)),
          _mm256_cvtepi32_ps(quint_256(q.v.hi, q.h.hi, shift, hbit))};
}
struct HexRun {
  W64 v, h, h6;
  int i;
};
inline HexRun hex_run(W64 v, W64 h, W64 h6, int i) { return {v, h, h6, i}; }
inline __m256i hex_256(__m256i v, __m256i h, __m256i h6, int shift, int hbit) {
  const __m256i sixth = _mm256_and_si256(_mm256_srli_epi32(h6, hbit), _mm256_set1_epi32(1));
  const __m256i code = _mm256_or_si256(quint_256(v, h, shift, hbit), _mm256_slli_epi32(sixth, 5));
  return _mm256_srai_epi32(_mm256_slli_epi32(code, 26), 26);  // signed: -32..31
}
inline F16x hex_float(const HexRun& q, int j, int half) {
  const int shift = 8 * j + 4 * half, hbit = shift + q.i;
  return {_mm256_cvtepi32_ps(hex_256(q.v.lo, q.h.lo, q.h6.lo, shift, hbit)),
          _mm256_cvtepi32_ps(hex_256(q.v.hi, q.h.hi, q.h6.hi, shift, hbit))};
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
inline F16x load_int8_float(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline F16x fmul_scalar(F16x a, float s) {
  __m256 v = _mm256_set1_ps(s);
  return {_mm256_mul_ps(a.lo, v), _mm256_mul_ps(a.hi, v)};
}
inline F16x fma(F16x a, F16x b, F16x c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16x fmul(F16x a, F16x b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16x fadd(F16x a, F16x b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
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
inline I16 signed_byte(const W64& w, int j) {
  I16 c;
  for (int l = 0; l < kTile; ++l) c.v[l] = static_cast<int8_t>(w.b[4 * l + j]);
  return c;
}
inline W64 flip_bytes(W64 w) {
  for (auto& b : w.b) b ^= 0x80;
  return w;
}
inline F16x nibble_float(const W64& w, int shift) {
  F16x f;
  for (int l = 0; l < kTile; ++l) {
    uint32_t lane;
    std::memcpy(&lane, w.b + 4 * l, 4);
    f.v[l] = static_cast<float>((lane >> shift) & 0xF);
  }
  return f;
}
struct QuintRun {
  W64 v, h;
  int i;
};
inline QuintRun quint_run(const W64& v, const W64& h, int i) { return {v, h, i}; }
inline F16x quint_float(const QuintRun& q, int j, int half) {
  const int shift = 8 * j + 4 * half, hbit = shift + q.i;
  F16x f;
  for (int l = 0; l < kTile; ++l) {
    uint32_t lane, high;
    std::memcpy(&lane, q.v.b + 4 * l, 4);
    std::memcpy(&high, q.h.b + 4 * l, 4);
    f.v[l] = static_cast<float>(((lane >> shift) & 0xF) | (((high >> hbit) & 1) << 4));
  }
  return f;
}
struct HexRun {
  W64 v, h, h6;
  int i;
};
inline HexRun hex_run(const W64& v, const W64& h, const W64& h6, int i) { return {v, h, h6, i}; }
inline F16x hex_float(const HexRun& q, int j, int half) {
  const int shift = 8 * j + 4 * half, hbit = shift + q.i;
  F16x f;
  for (int l = 0; l < kTile; ++l) {
    uint32_t lane, high, high6;
    std::memcpy(&lane, q.v.b + 4 * l, 4);
    std::memcpy(&high, q.h.b + 4 * l, 4);
    std::memcpy(&high6, q.h6.b + 4 * l, 4);
    const int32_t code = ((lane >> shift) & 0xF) | (((high >> hbit) & 1) << 4) | (((high6 >> hbit) & 1) << 5);
    f.v[l] = static_cast<float>(code >= 32 ? code - 64 : code);  // signed: -32..31
  }
  return f;
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
inline F16x load_int8_float(const int8_t* p) {
  F16x f;
  for (int l = 0; l < kTile; ++l) f.v[l] = static_cast<float>(p[l]);
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
inline F16x fadd(F16x a, F16x b) {
  for (int l = 0; l < kTile; ++l) a.v[l] += b.v[l];
  return a;
}
inline void store(float* p, F16x a) { std::memcpy(p, a.v, sizeof(a.v)); }
constexpr bool kInt8Offset = true;
inline I16 dot4_int8(I16 acc, const W64& w, int32_t x4) { return dot4(acc, w, x4); }
#endif

// ---- activations --------------------------------------------------------------------------------------

// Row x (K floats) -> xq (K int8), and per block of 32: d (its scale) and d * sum(xq) (the min term's factor).
// With AVX-512 a block is two vectors: the same products, rounded half to even as nearbyint rounds (the
// default rounding mode), the same codes.
void quantize_blocks(const float* x, int64_t K, int8_t* xq, float* d, float* dsum) {
#if defined(EMBER_AVX512_VNNI)
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, magnitude), _mm512_and_ps(hi, magnitude)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    d[b] = amax / 127.f;
    dsum[b] = d[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
#else
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
#endif
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

// acc + one block's integer sums of a row, scaled: d * scale * sum + (d * sum(xq)) * min. The vector and the
// tile paths both call it, so that their outputs are the same bits.
inline F16x add_block(F16x acc, I16 sums, F16x scale, F16x mn, float d, float dsum) {
  return fma(mn, fset(dsum), fma(to_float(sums), fmul_scalar(scale, d), acc));
}

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
      acc[r] = add_block(acc[r], sums[r], scale, mn, d[r * KB + b], dsum[r * KB + b]);
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}

// The float kernels' factors (scales, or mins) of a tile's blocks (or groups), 16 lanes a block, kStride floats
// apart: float32 or float16 as they are (a pointer; null: none), or `Coded` (`cpu_ext.coded_factors`): an int8 a block (at
// q) times a float16 unit for each run of 1 << shift blocks (256 k), the float32 values themselves where the
// units and codes were found exact (a GGUF K type's f16 d times its small integer scales: 0.625 bits a weight of
// factors, not 2). Each kernel is instantiated for each form (float32's is the loop as it was before codes: a
// branch, or a struct for all, cost it 10-18%).
struct Coded {
  const int8_t* q = nullptr;
  const at::Half* unit = nullptr;
  int64_t stride = kTile;
  int shift = 0;
  // Tile t's, of `blocks` blocks a tile.
  Coded tile(int64_t t, int64_t blocks) const {
    if (q == nullptr) return *this;
    return {q + t * blocks * stride, unit + t * (blocks >> shift) * stride, stride, shift};
  }
  // The lanes `lanes` elements on (the mins of int4's (scale, min) pairs).
  Coded shifted(int64_t lanes) const { return {q + lanes, unit + lanes, stride, shift}; }
};
template <int kStride = kTile>
inline F16x factor_at(const float* f, int64_t b) {
  return load_float(f + b * kStride);
}
template <int kStride = kTile>
inline F16x factor_at(const at::Half* f, int64_t b) {
  return load_half(f + b * kStride);
}
template <int kStride = kTile>
inline F16x factor_at(const Coded& c, int64_t b) {
  return fmul(load_half(c.unit + (b >> c.shift) * kStride), load_int8_float(c.q + b * kStride));
}
inline bool given(const float* f) { return f != nullptr; }
inline bool given(const at::Half* f) { return f != nullptr; }
inline bool given(const Coded& c) { return c.q != nullptr; }

// float32 (T float) or float16 (T at::Half) factors of `tiles` tiles of `blocks` blocks of `lanes` lanes (16, or
// int4's pairs' 32), checked; float16 where they hold the factors exactly (a GGUF Q8_0's, Q4_1's f16 d and m).
template <typename T>
const T* float_factors(const at::Tensor& f, int64_t tiles, int64_t blocks, int64_t lanes, const char* name) {
  TORCH_CHECK((f.scalar_type() == at::kFloat || f.scalar_type() == at::kHalf) && f.is_contiguous() &&
                  f.numel() == tiles * blocks * lanes,
              name, " ", f.sizes(), " do not match ", tiles, " tiles of ", blocks, " blocks (float32 or float16)");
  return f.data_ptr<T>();
}

// The same factors coded: int8 codes `f` with their float16 `units` (tiles, K/256, lanes), checked.
Coded coded_factors(const at::Tensor& f, const at::Tensor& units, int64_t tiles, int64_t blocks, int64_t K,
                    int64_t lanes, const char* name) {
  const int64_t per = K % 256 == 0 && blocks % (K / 256) == 0 ? blocks / (K / 256) : 0;
  TORCH_CHECK(per > 0 && (per & (per - 1)) == 0, name, ": units of 256 k do not tile K = ", K, " in ", blocks,
              " blocks of a power of two k");
  TORCH_CHECK(f.scalar_type() == at::kChar && f.is_contiguous() && f.numel() == tiles * blocks * lanes, name, " ",
              f.sizes(), " do not match ", tiles, " tiles of ", blocks, " blocks (int8 codes beside units)");
  TORCH_CHECK(units.scalar_type() == at::kHalf && units.is_contiguous() && units.numel() == tiles * (K / 256) * lanes,
              name, " units ", units.sizes(), " do not match ", tiles, " tiles of ", K / 256, " units (float16)");
  int shift = 0;
  while ((int64_t{1} << shift) < per) ++shift;
  return {f.data_ptr<int8_t>(), units.data_ptr<at::Half>(), lanes, shift};
}

// R float activation rows (x + r * K, their sums per group of k at xs + r * G) against one int4 tile with
// float32 scale_min (G, 2, 16): out[r * N + l] = sum_g scale * sum_k q x + min * sum_k x, the products in
// float32. C independent sums a row per group (C R <= 4 registers), so that one row is not one chain of FMAs.
template <int R, typename F>
void int4_tile_f32(const uint8_t* w, F sc, F mins, const float* x, const float* xs, int64_t K, int64_t group_size,
                   float* out, int64_t N) {
  constexpr int C = R >= 4 ? 1 : 4 / R;
  const int64_t G = K / group_size, blocks = group_size / kBlock;
  F16x acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t g = 0; g < G; ++g) {
    F16x part[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) part[r][c] = fzero();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      const uint8_t* wb = w + b * 256;
      prefetch_ahead(wb, 4);
      for (int i = 0; i < 4; ++i) {
        const auto v = load64(wb + 64 * i);
        for (int j = 0; j < 4; ++j) {  // k = 4i + j (byte j's low nibble) and 16 + 4i + j (its high one)
          const F16x ql = nibble_float(v, 8 * j), qh = nibble_float(v, 8 * j + 4);
          for (int r = 0; r < R; ++r) {
            const float* xb = x + r * K + b * kBlock + 4 * i + j;
            part[r][(2 * j) % C] = fma(ql, fset(xb[0]), part[r][(2 * j) % C]);
            part[r][(2 * j + 1) % C] = fma(qh, fset(xb[16]), part[r][(2 * j + 1) % C]);
          }
        }
      }
    }
    const F16x scale = factor_at<2 * kTile>(sc, g), mn = factor_at<2 * kTile>(mins, g);
    for (int r = 0; r < R; ++r) {
      F16x sum = part[r][0];
      for (int c = 1; c < C; ++c) sum = fadd(sum, part[r][c]);
      acc[r] = fma(sum, scale, fma(mn, fset(xs[r * G + g]), acc[r]));
    }
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

#if defined(EMBER_AMX)
// ---- AMX: 16 rows of activations at a time -------------------------------------------------------------

constexpr int64_t kAmxRows = 16;  // rows of an A tile (and of the C tile)

// Whether this process may use the tile unit: Linux hands out the AMX state on request (once a process), and
// EMBER_CPU_AMX=0 keeps the vector path (to compare the two).
bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("EMBER_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// LDTILECFG's operand: each tile's bytes a row and rows (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16];
  uint8_t rows[16];
};

// int4_gemv's tiles: C (tmm0, tmm1) 16 rows of 16 int32; A (tmm2, tmm3) 16 rows of a block's 32 int8 codes;
// B (tmm4, tmm5) a block's 32 k as 8 rows of 4 k for each of the 16 output rows.
const TileConfig kCodeTiles{.colsb = {64, 64, 32, 32, 64, 64}, .rows = {16, 16, 16, 16, 8, 8}};

// One int4 tile's codes (K/32 blocks of 4 runs of 64 bytes, low and high nibbles) -> B tiles, 512 bytes a
// block: row i < 4 holds k = 4i + t of each output row (low nibbles of run i), row 4 + i k = 16 + 4i + t.
void unpack_int4_tile(const uint8_t* w, int64_t KB, uint8_t* b) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < KB; ++blk) {
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(w + blk * 256 + 64 * i);
      _mm512_store_si512(b + blk * 512 + 64 * i, _mm512_and_si512(v, mask));
      _mm512_store_si512(b + blk * 512 + 256 + 64 * i, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
  }
}

// acc[r] of 16 rows from one block's int32 sums (C tile stored at c).
inline void amx_scale_block(const int32_t* c, const F16x& scale, const F16x& mn, const float* d, const float* dsum,
                            int64_t KB, int64_t b, F16x* acc) {
  for (int r = 0; r < kAmxRows; ++r)
    acc[r] = add_block(acc[r], I16{_mm512_load_si512(c + 16 * r)}, scale, mn, d[r * KB + b], dsum[r * KB + b]);
}

// Rows [0, 16 * chunks) of xq against one int4 tile whose codes are unpacked at b: out[r * N + l]. Blocks go
// two at a time through the tile unit (one C tile each) into one of two buffers, and the vector unit scales a
// pair's sums while the tile unit computes the next pair's: the sums are read a pair after they were stored.
void int4_tile_amx(const uint8_t* b, const at::Half* sm, const int8_t* xq, const float* d, const float* dsum,
                   int64_t K, int64_t blocks_per_group, int64_t chunks, float* out, int64_t N) {
  const int64_t KB = K / kBlock, pairs = (KB + 1) / 2;
  alignas(64) int32_t c[2][2][kAmxRows * kTile];  // [pair % 2][block of the pair]
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int8_t* xa = xq + chunk * kAmxRows * K;
    const float* da = d + chunk * kAmxRows * KB;
    const float* sa = dsum + chunk * kAmxRows * KB;
    F16x acc[kAmxRows];
    for (auto& a : acc) a = fzero();
    for (int64_t p = 0; p <= pairs; ++p) {
      if (p < pairs) {  // pair p's sums
        const int64_t blk = 2 * p;
        _tile_zero(0);
        _tile_loadd(2, xa + blk * kBlock, K);
        _tile_loadd(4, b + blk * 512, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_stored(0, c[p & 1][0], 64);
        if (blk + 1 < KB) {
          _tile_zero(1);
          _tile_loadd(3, xa + (blk + 1) * kBlock, K);
          _tile_loadd(5, b + (blk + 1) * 512, 64);
          _tile_dpbsud(1, 3, 5);
          _tile_stored(1, c[p & 1][1], 64);
        }
      }
      if (p > 0) {  // pair p - 1's scales
        for (int64_t j = 2 * (p - 1); j < std::min(2 * p, KB); ++j) {
          const at::Half* s = sm + (j / blocks_per_group) * 2 * kTile;
          amx_scale_block(c[(p - 1) & 1][j & 1], load_half(s), load_half(s + kTile), da, sa, KB, j, acc);
        }
      }
    }
    for (int r = 0; r < kAmxRows; ++r) store(out + (chunk * kAmxRows + r) * N, acc[r]);
  }
}
#endif


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

// Calls tile(R, t, m) for every tile t of weights (threads share the tiles) and each run of rows m of x.
template <typename Tile>
void over_tiles(int64_t tiles, int64_t M, Tile tile) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) by_rows(M, [&](auto R, int64_t m) { tile(R, t, m); });
  });
}

void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous (M, K) float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kBlock == 0, "K = ", x.size(1), " is not a multiple of ", kBlock);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) / kBlock * bytes_per_block,
              "packed weights ", packed.sizes(), " do not match K = ", x.size(1));
}

// The int4 kernels' operands: x and the packed codes (check_operands), and a group size and scale_min that
// tile them.
void check_int4_operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                         int64_t group_size) {
  check_operands(x, packed, 256);
  const int64_t K = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(group_size % kBlock == 0 && K % group_size == 0, "group size ", group_size, " does not tile K = ", K);
  const int64_t groups = K / group_size;
  TORCH_CHECK(scale_min.scalar_type() == at::kHalf && scale_min.is_contiguous() &&
                  scale_min.numel() == tiles * groups * 2 * kTile,
              "scale_min ", scale_min.sizes(), " does not match ", tiles, " tiles of ", groups, " groups");
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                     int64_t group_size) {
  check_int4_operands(x, packed, scale_min, group_size);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  const int64_t groups = K / group_size, KB = K / kBlock;
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
  int64_t amx_rows = 0;  // rows [0, amx_rows) on the tile unit, 16 at a time; the rest on the vector path
#if defined(EMBER_AMX)
  if (M >= kAmxRows && amx_ready()) amx_rows = M / kAmxRows * kAmxRows;
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(EMBER_AMX)
    std::vector<__m512i> unpacked;  // this thread's tile as B tiles, 512 bytes a block
    if (amx_rows > 0) {
      _tile_loadconfig(&kCodeTiles);
      unpacked.resize(KB * 8);
    }
#endif
    for (int64_t t = begin; t < end; ++t) {
#if defined(EMBER_AMX)
      if (amx_rows > 0) {
        auto* b = reinterpret_cast<uint8_t*>(unpacked.data());
        unpack_int4_tile(wp + t * KB * 256, KB, b);
        int4_tile_amx(b, sp + t * groups * 2 * kTile, xq.data(), d.data(), dsum.data(), K, group_size / kBlock,
                      amx_rows / kAmxRows, op + t * kTile, N);
      }
#endif
      by_rows(M - amx_rows, [&](auto R, int64_t m) {
        m += amx_rows;
        int4_tile<decltype(R)::value>(wp + t * KB * 256, sp + t * groups * 2 * kTile, &xq[m * K], &d[m * KB],
                                      &dsum[m * KB], K, group_size / kBlock, op + m * N + t * kTile, N);
      });
    }
#if defined(EMBER_AMX)
    if (amx_rows > 0) _tile_release();
#endif
  });
  return out;
}

// R float activation rows (x + r * K) against one int8 tile (int8_tiles' layout, codes plus 128) with a float32
// scale for each block of `block` k, 16 or 32 (scales: (K/block, 16)), and with `mins` (the same layout; or
// null) a float32 min: out[r * N + l] = sum_b scale_b * sum_k q x + min_b * xs_b, in float32, xs_b (at
// xs + r * K/block) the row's sum of x over block b.
template <int R, typename F>
void int8_tile_f32(const uint8_t* w, F scales, F mins, const float* x, const float* xs, int64_t K, int64_t block,
                   float* out, int64_t N) {
  const int64_t B = K / block;
  constexpr int C = R >= 4 ? 1 : 4 / R;
  F16x acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    prefetch_ahead(w + b * 512, 8);
    for (int h = 0; h < 2; ++h) {  // runs 4h..4h+3: k 16h..16h+15, a block of 16 (with blocks of 32, half one)
      F16x part[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) part[r][c] = fzero();
      for (int i = 4 * h; i < 4 * h + 4; ++i) {  // run i: k = 4i + j of each row
        const auto v = flip_bytes(load64(w + b * 512 + 64 * i));
        for (int j = 0; j < 4; ++j) {
          const F16x q = to_float(signed_byte(v, j));
          for (int r = 0; r < R; ++r)
            part[r][j % C] = fma(q, fset(x[r * K + b * kBlock + 4 * i + j]), part[r][j % C]);
        }
      }
      const int64_t at = block == 16 ? 2 * b + h : b;
      const F16x scale = factor_at(scales, at);
      for (int r = 0; r < R; ++r) {
        F16x sum = part[r][0];
        for (int c = 1; c < C; ++c) sum = fadd(sum, part[r][c]);
        acc[r] = fma(sum, scale, acc[r]);
      }
      if (given(mins) && (block == 16 || h == 1)) {  // once a block
        const F16x mn = factor_at(mins, at);
        for (int r = 0; r < R; ++r) acc[r] = fma(mn, fset(xs[r * B + at]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}

// Each row's sum of x over each block of `block` k (M * K / block floats): the min term's factor.
std::vector<float> block_sums(const float* x, int64_t M, int64_t K, int64_t block) {
  std::vector<float> xs(M * K / block);
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i) {
    float s = 0.f;
    for (int64_t k = i * block; k < (i + 1) * block; ++k) s += x[k];  // row i / B, block i % B: k from i * block
    xs[i] = s;
  }
  return xs;
}

// A run of 5-bit (quint_run) or 6-bit (hex_run) codes, and its code j as a float.
template <int kBits, typename W>
inline auto high_run(const W& v, const W& h, const W& h6, int i) {
  if constexpr (kBits == 5)
    return quint_run(v, h, i);
  else
    return hex_run(v, h, h6, i);
}
template <int kBits, typename Q>
inline F16x high_float(const Q& q, int j, int half) {
  if constexpr (kBits == 5)
    return quint_float(q, j, half);
  else
    return hex_float(q, j, half);
}

// A tile of 5-bit codes (kBits 5: 0..31) or signed 6-bit ones (kBits 6: -32..31, two's complement in 6 bits):
// their low nibbles in int4_tiles' layout (256 bytes a block of 32 k; run i byte j of a row: k = 4i + j low,
// 16 + 4i + j high) and their fifth bits (`high`, 64 bytes a block: each row's 32 as one int32, k = 4i + j at bit
// 8j + i and 16 + 4i + j at bit 8j + 4 + i, so that one shift a run puts them beside their nibbles: quint_run),
// with 6 bits the sixth bits after them laid out alike (128 bytes a block: hex_run). run(b, i).at(j, h) is the
// float of k = 4i + j (h 0) or 16 + 4i + j (h 1) of block b, for the tile's 16 rows.
template <int kBits>
struct PackedCodes {
  static constexpr int kHigh = 64 * (kBits - 4);  // bytes of high bits a block
  const uint8_t* w;
  const uint8_t* high;
  template <typename Q>
  struct Run {
    Q q;
    F16x at(int j, int h) const { return high_float<kBits>(q, j, h); }
  };
  void prefetch(int64_t b) const {
    prefetch_ahead(w + b * 256, 4);
    prefetch_ahead(high + b * kHigh, kBits - 4);
  }
  auto run(int64_t b, int i) const {
    const uint8_t* h = high + b * kHigh;
    const auto q = high_run<kBits>(load64(w + b * 256 + 64 * i), load64(h), load64(h + kHigh - 64), i);
    return Run<decltype(q)>{q};
  }
};

// The same codes as floats, written once by `float_codes` (32 x 16 floats a block, in run(b, i).at(j, h)'s
// order): a prefill's runs of rows then load each code where the packed form turned bits into it for every run.
struct FloatCodes {
  const float* codes;
  struct Run {
    const float* p;
    F16x at(int j, int h) const { return load_float(p + (2 * j + h) * kTile); }
  };
  void prefetch(int64_t) const {}
  Run run(int64_t b, int i) const { return {codes + (4 * b + i) * 8 * kTile}; }
};

template <int kBits>
void float_codes(PackedCodes<kBits> packed, int64_t blocks, float* codes) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int i = 0; i < 4; ++i) {
      const auto run = packed.run(b, i);
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h) store(codes + ((4 * b + i) * 8 + 2 * j + h) * kTile, run.at(j, h));
    }
}

// R float activation rows against one tile of codes (PackedCodes or FloatCodes); a float32 scale and (or null)
// min a block of 16 or 32 k as int8_tile_f32 takes them.
template <int R, typename Codes, typename F>
void high_bits_tile_f32(Codes codes, F scales, F mins, const float* x, const float* xs, int64_t K, int64_t block,
                        float* out, int64_t N) {
  constexpr int C = R >= 2 ? 1 : 2;
  const int64_t B = K / block;
  F16x acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    F16x part[R][2][C];  // k 0..15 (the low nibbles) and 16..31 (the high ones) apart, for blocks of 16
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < C; ++c) part[r][h][c] = fzero();
    codes.prefetch(b);
    for (int i = 0; i < 4; ++i) {
      const auto q = codes.run(b, i);
      for (int j = 0; j < 4; ++j) {  // k = 4i + j and 16 + 4i + j
        const F16x ql = q.at(j, 0), qh = q.at(j, 1);
        for (int r = 0; r < R; ++r) {
          const float* xb = x + r * K + b * kBlock + 4 * i + j;
          part[r][0][j % C] = fma(ql, fset(xb[0]), part[r][0][j % C]);
          part[r][1][j % C] = fma(qh, fset(xb[16]), part[r][1][j % C]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      F16x sum[2];
      for (int h = 0; h < 2; ++h) {
        sum[h] = part[r][h][0];
        for (int c = 1; c < C; ++c) sum[h] = fadd(sum[h], part[r][h][c]);
      }
      if (block == 16) {
        for (int h = 0; h < 2; ++h) {
          acc[r] = fma(sum[h], factor_at(scales, 2 * b + h), acc[r]);
          if (given(mins)) acc[r] = fma(factor_at(mins, 2 * b + h), fset(xs[r * B + 2 * b + h]), acc[r]);
        }
      } else {
        acc[r] = fma(fadd(sum[0], sum[1]), factor_at(scales, b), acc[r]);
        if (given(mins)) acc[r] = fma(factor_at(mins, b), fset(xs[r * B + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}


#if defined(EMBER_AMX_BF16)
// ---- AMX-BF16 for the float kernels: a prefill's rows, float32 sums of exact products -------------------
//
// The float kernels promise the float linear's values on the dequantized weights, which rounding x to bf16
// would not keep. On the tile unit they keep it this way: a weight's code is a small integer, exact in bf16,
// and a float32 activation is exactly the sum of three bf16s (x = x0 + x1 + x2, each the rounding of what the
// ones before leave: 8 significant bits each), so each of TDPBF16PS's products is exact and its float32 sums
// are the vector path's sums in another order; a block's (or group's) sums then leave the tile unit to be
// scaled (and their min added) as the vector path does it. Three bf16 products a weight and row against one
// float32 FMA, on a unit that does 16 x 16 x 32 of them in one instruction.
//
// A thread takes weight tiles two at a time against 16 rows of x: C tmm0-1 and tmm2-3 (a block's sums, blocks
// alternating between the two pairs, so that the vector unit scales one block's sums while the tile unit computes
// the next's), B tmm4-5 (the two tiles' codes), A tmm6-7 (x's parts in turn). Loops: K in ranges whose three
// parts of x stay in L2 for every tile a thread takes; a range's codes of two tiles decoded to bf16 (L2), then
// run 256 k at a time (L1) against every 16 rows; the sums kept across ranges in the rows of out.

constexpr int kAmxTiles = 2;         // weight tiles a pass
constexpr int64_t kAmxRange = 1024;  // k of a range (x's three parts: 6 KB a row)
constexpr int64_t kAmxSub = 256;     // k run against every 16 rows while its codes are in L1

// A's k 32 (16 rows of 64 bytes; B 16 rows of 16 (k, k + 1) pairs) or 16 (blocks of 16: 32 bytes, B 8 rows).
const TileConfig kSplitTiles32{.colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
const TileConfig kSplitTiles16{.colsb = {64, 64, 64, 64, 64, 64, 32, 32}, .rows = {16, 16, 16, 16, 8, 8, 16, 16}};

// The words of a B row from the floats of k (lo) and k + 1 (hi), 16 output rows each: (lo[l], hi[l]) in bf16.
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// x (rows, K), rows a multiple of 16 -> its three bf16 parts (part p the rounding of x less the parts before it),
// each 16 rows laid out as A tiles of kc k one after another (16 rows of kc, then the next kc k): part p's tile
// of rows 16c.. at k is at parts + (p * rows + 16c) * K + 16k, its rows kc * 2 bytes apart (not K * 2: rows a
// power of two bytes apart would share L1's sets).
void split_bf16(const float* x, int64_t rows, int64_t K, int64_t kc, uint16_t* parts) {
  at::parallel_for(0, rows, kQuantizeRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t chunk = m / kAmxRows * kAmxRows, r = m % kAmxRows;
      for (int64_t k = 0; k < K; k += 16) {
        __m512 left = _mm512_loadu_ps(x + m * K + k);
        const int64_t at = chunk * K + (k / kc) * kAmxRows * kc + r * kc + k % kc;
        for (int p = 0; p < 3; ++p) {
          const __m256i h = (__m256i)_mm512_cvtneps_pbh(left);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + p * rows * K + at), h);
          left = _mm512_sub_ps(left, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
      }
    }
  });
}

// One C tile's sums (stored at c, 16 rows of 16) of factor block j into acc (16 rows): times its scales, plus
// its mins times the rows' block sums (xs, B a row), as the vector kernels apply them.
template <int kStride, typename F>
inline void amx_scale(const float* c, const F& sc, const F& mn, int64_t j, const float* xs, int64_t B, __m512* acc) {
  const F16x scale = factor_at<kStride>(sc, j);
  if (given(mn)) {
    const F16x m = factor_at<kStride>(mn, j);
    for (int r = 0; r < kAmxRows; ++r)
      acc[r] = fma(F16x{_mm512_load_ps(c + 16 * r)}, scale, fma(m, fset(xs[r * B + j]), F16x{acc[r]})).v;
  } else {
    for (int r = 0; r < kAmxRows; ++r) acc[r] = fma(F16x{_mm512_load_ps(c + 16 * r)}, scale, F16x{acc[r]}).v;
  }
}

// One block's sums of 16 rows against two tiles into C tiles c0 and c1 (literals: GCC's tile intrinsics take
// only those), stored at s0 and s1: S k in steps of kc, A (x's three parts at the block's k) at a, a part `part`
// elements on, B (the two tiles' at the block's k) at b, b1 bytes on.
#define EMBER_AMX_BLOCK(name, c0, c1)                                                                        \
  inline void name(const uint16_t* a, int64_t part, const uint8_t* b, int64_t b1, int64_t S, int64_t kc,      \
                   float* s0, float* s1) {                                                                   \
    _tile_zero(c0);                                                                                          \
    _tile_zero(c1);                                                                                          \
    for (int64_t at = 0; at < S; at += kc) {                                                                 \
      const uint8_t* bk = b + at * 32;                                                                       \
      _tile_loadd(4, bk, 64);                                                                                \
      _tile_loadd(5, bk + b1, 64);                                                                           \
      const uint16_t* ak = a + 16 * at;                                                                      \
      _tile_loadd(6, ak, kc * 2);                                                                            \
      _tile_dpbf16ps(c0, 6, 4);                                                                              \
      _tile_dpbf16ps(c1, 6, 5);                                                                              \
      _tile_loadd(7, ak + part, kc * 2);                                                                     \
      _tile_dpbf16ps(c0, 7, 4);                                                                              \
      _tile_dpbf16ps(c1, 7, 5);                                                                              \
      _tile_loadd(6, ak + 2 * part, kc * 2);                                                                 \
      _tile_dpbf16ps(c0, 6, 4);                                                                              \
      _tile_dpbf16ps(c1, 6, 5);                                                                              \
    }                                                                                                        \
    _tile_stored(c0, s0, 64);                                                                                \
    _tile_stored(c1, s1, 64);                                                                                \
  }
EMBER_AMX_BLOCK(amx_block_even, 0, 1)
EMBER_AMX_BLOCK(amx_block_odd, 2, 3)
#undef EMBER_AMX_BLOCK

// Rows [0, rows) (a multiple of 16) of out (N a row) for `tiles` weight tiles whose factors come a block of S k
// (16, 32, or an int4 group): decode(t, b0, b1, rows) writes tile t's codes of blocks of 32 k [b0, b1) as bf16
// B rows (k / 2 from b0's, 64 bytes each), sc(t) and mn(t) its factors (factor_at<kStride>; mn not given: none),
// xs the rows' sums of x a block of S (given mins).
template <int kStride, typename Decode, typename Sc, typename Mn>
void amx_f32_rows(const float* x, int64_t rows, int64_t K, int64_t tiles, int64_t S, const Decode& decode,
                  const Sc& sc, const Mn& mn, const float* xs, float* out, int64_t N) {
  const int64_t B = K / S, kc = S == 16 ? 16 : 32, chunks = rows / kAmxRows;
  const int64_t range = std::max(kAmxRange / S, int64_t{1}) * S, sub = std::max(kAmxSub / S, int64_t{1}) * S;
  const int64_t part = rows * K;  // elements of x's part
  std::unique_ptr<uint16_t[]> parts(new uint16_t[3 * part]);
  split_bf16(x, rows, K, kc, parts.get());
  const int64_t pairs = (tiles + kAmxTiles - 1) / kAmxTiles;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(kc == 32 ? &kSplitTiles32 : &kSplitTiles16);
    std::unique_ptr<__m512i[]> codes(new __m512i[kAmxTiles * range / 2]);  // B rows of two tiles' range
    std::unique_ptr<__m512[]> acc(new __m512[chunks * kAmxTiles * kAmxRows]);
    alignas(64) float c[2][kAmxTiles][kAmxRows * kTile];  // [block % 2][tile]
    auto* b = reinterpret_cast<uint8_t*>(codes.get());
    const int64_t b1 = range * 32;  // bytes from tile 0's B rows to tile 1's
    for (int64_t k0 = 0; k0 < K; k0 += range) {
      const int64_t k1 = std::min(K, k0 + range);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t t0 = g * kAmxTiles, nt = std::min<int64_t>(kAmxTiles, tiles - t0);
        for (int i = 0; i < kAmxTiles; ++i) {
          if (i < nt)
            decode(t0 + i, k0 / kBlock, k1 / kBlock, b + i * b1);
          else
            std::memset(b + i * b1, 0, (k1 - k0) * 32);
        }
        // This range's sums start from the ranges' before (in out) or from zero.
        for (int64_t ch = 0; ch < chunks; ++ch)
          for (int i = 0; i < nt; ++i)
            for (int r = 0; r < kAmxRows; ++r)
              acc[(ch * kAmxTiles + i) * kAmxRows + r] =
                  k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (ch * kAmxRows + r) * N + (t0 + i) * kTile);
        const auto scale = [&](int64_t ch, int64_t j) {  // block j's sums (in c[j % 2]) into acc
          const float* xr = xs ? xs + ch * kAmxRows * B : nullptr;
          for (int i = 0; i < nt; ++i)
            amx_scale<kStride>(c[j & 1][i], sc(t0 + i), mn(t0 + i), j, xr, B, &acc[(ch * kAmxTiles + i) * kAmxRows]);
        };
        for (int64_t s0 = k0; s0 < k1; s0 += sub) {
          const int64_t s1 = std::min(k1, s0 + sub);
          for (int64_t ch = 0; ch < chunks; ++ch) {
            const uint16_t* a = parts.get() + ch * kAmxRows * K;
            for (int64_t j = s0 / S; j < s1 / S; ++j) {
              const uint16_t* aj = a + 16 * j * S;
              const uint8_t* bj = b + (j * S - k0) * 32;
              if (j & 1)
                amx_block_odd(aj, part, bj, b1, S, kc, c[1][0], c[1][1]);
              else
                amx_block_even(aj, part, bj, b1, S, kc, c[0][0], c[0][1]);
              if (j > s0 / S) scale(ch, j - 1);  // the block before's, while the tile unit runs this one
            }
            scale(ch, s1 / S - 1);
          }
        }
        for (int64_t ch = 0; ch < chunks; ++ch)
          for (int i = 0; i < nt; ++i)
            for (int r = 0; r < kAmxRows; ++r)
              _mm512_storeu_ps(out + (ch * kAmxRows + r) * N + (t0 + i) * kTile,
                               acc[(ch * kAmxTiles + i) * kAmxRows + r]);
      }
    }
    _tile_release();
  });
}

// Decoders of a tile's codes of blocks [b0, b1) to B rows (amx_f32_rows): int4 (int4_tiles' layout: run i of a
// block holds k = 4i + j in byte j's low nibble and 16 + 4i + j in its high one), 5- and 6-bit
// (high_bits_tile_f32's), int8 (int8_tiles': run i byte j k = 4i + j, plus 128).
void decode_int4_bf16(const uint8_t* w, int64_t b0, int64_t b1, uint8_t* rows) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    uint8_t* r = rows + (blk - b0) * 16 * 64;
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(w + blk * 256 + 64 * i);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; j += 2)
          _mm512_store_si512(r + (8 * h + 2 * i + j / 2) * 64,
                             bf16_pairs(nibble_float(v, 8 * j + 4 * h).v, nibble_float(v, 8 * j + 8 + 4 * h).v));
    }
  }
}

template <int kBits>
void decode_high_bits_bf16(const uint8_t* w, const uint8_t* high, int64_t b0, int64_t b1, uint8_t* rows) {
  constexpr int kHigh = 64 * (kBits - 4);
  for (int64_t blk = b0; blk < b1; ++blk) {
    uint8_t* r = rows + (blk - b0) * 16 * 64;
    const __m512i hv = load64(high + blk * kHigh), h6 = load64(high + blk * kHigh + kHigh - 64);
    for (int i = 0; i < 4; ++i) {
      const auto q = high_run<kBits>(load64(w + blk * 256 + 64 * i), hv, h6, i);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; j += 2)
          _mm512_store_si512(r + (8 * h + 2 * i + j / 2) * 64,
                             bf16_pairs(high_float<kBits>(q, j, h).v, high_float<kBits>(q, j + 1, h).v));
    }
  }
}

void decode_int8_bf16(const uint8_t* w, int64_t b0, int64_t b1, uint8_t* rows) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    uint8_t* r = rows + (blk - b0) * 16 * 64;
    for (int i = 0; i < 8; ++i) {
      const __m512i v = flip_bytes(load64(w + blk * 512 + 64 * i));
      for (int j = 0; j < 4; j += 2)
        _mm512_store_si512(r + (2 * i + j / 2) * 64,
                           bf16_pairs(to_float(signed_byte(v, j)).v, to_float(signed_byte(v, j + 1)).v));
    }
  }
}

// Whether rows of x run on the tile unit (amx_f32_rows): from 16, where this process may use it.
int64_t amx_f32_row_count(int64_t M) {
  const char* env = std::getenv("EMBER_CPU_AMX_F32");
  if (env != nullptr && std::strcmp(env, "0") == 0) return 0;
  return M >= kAmxRows && amx_ready() ? M / kAmxRows * kAmxRows : 0;
}
#endif

#if defined(EMBER_AVX512_VNNI) || defined(EMBER_AVX2)
#define EMBER_SPLIT 1
// ---- the float kernels' few rows as three int8 parts (AVX512-VNNI, AVX-VNNI or AVX2) ----------------------
//
// A decode step's row against a GGUF file's codes: converting every code to a float for its FMA bounds the
// float kernels on cores whose 512-bit units are two 256-bit halves (a Zen 4's 2 threads reach ~25 G weights/s
// of Q4_K, ~75% of its memory's rate, and less of Q6_K). Here a block of 32 activations is three int8 parts of one
// scale d = max|x| / 127: x = d (a + b / 254 + c / 254^2), each part the rounding of what the ones before leave,
// so x is held to within 2^-24 of the block's largest |x| (float32's own rounding is 2^-24 of each |x|), and
// each part meets the codes in VNNI's integer dot products (64 products an instruction, exact), their int32
// sums then scaled once a block, in float32. The codes as unsigned bytes: int4 and 5-bit as they are, 6-bit
// and int8 offset by 32 and 128 (taken back off with each part's sum).

constexpr float kSplitBase = 254.f;

// Rows up to which the rows the tile unit does not take run split: past them the FMA path, whose code conversions
// serve up to 8 rows at once, is as fast or faster (one row against a 1B model's projections on Zen 4, split
// against FMAs: 1.09-1.52x; two rows 1.01-1.07x; four 0.90-0.94x; its 128-row prefill 73.6 tok/s to 79.8).
constexpr int64_t kSplitRows = 2;

// Whether the split path runs (EMBER_CPU_SPLIT=0: float FMAs, for comparisons).
bool split_on() {
  const char* env = std::getenv("EMBER_CPU_SPLIT");
  return !(env != nullptr && std::strcmp(env, "0") == 0);
}

// Row x (K floats) -> its three parts (part p's K codes at xq + p * K), each block's d, and each part's sum of
// codes over each half block of 16 k (qsum + p * 2KB + h): what the offset codes take back.
void split_blocks(const float* x, int64_t K, int8_t* xq, float* d, int32_t* qsum) {
  const int64_t KB = K / kBlock;
#if !defined(EMBER_AVX512_VNNI)
  for (int64_t b = 0; b < KB; ++b) {
    float amax = 0.f;
    for (int t = 0; t < kBlock; ++t) amax = std::max(amax, std::fabs(x[b * kBlock + t]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int h = 0; h < 2; ++h) {
      float left[16];
      for (int t = 0; t < 16; ++t) left[t] = x[b * kBlock + 16 * h + t] * inv;
      for (int p = 0; p < 3; ++p) {
        int32_t sum = 0;
        for (int t = 0; t < 16; ++t) {
          const float q = std::nearbyint(left[t]);
          xq[p * K + b * kBlock + 16 * h + t] = static_cast<int8_t>(q);
          sum += static_cast<int32_t>(q);
          left[t] = (left[t] - q) * kSplitBase;
        }
        qsum[p * 2 * KB + 2 * b + h] = sum;
      }
    }
  }
#else
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF)), base = _mm512_set1_ps(kSplitBase);
  for (int64_t b = 0; b < KB; ++b) {
    __m512 t[2] = {_mm512_loadu_ps(x + b * kBlock), _mm512_loadu_ps(x + b * kBlock + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(t[0], magnitude), _mm512_and_ps(t[1], magnitude)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    d[b] = amax / 127.f;
    for (int h = 0; h < 2; ++h) {
      __m512 left = _mm512_mul_ps(t[h], inv);
      for (int p = 0; p < 3; ++p) {
        const __m512 q = _mm512_roundscale_ps(left, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + p * K + b * kBlock + 16 * h), _mm512_cvtsepi32_epi8(qi));
        qsum[p * 2 * KB + 2 * b + h] = _mm512_reduce_add_epi32(qi);
        left = _mm512_mul_ps(_mm512_sub_ps(left, q), base);
      }
    }
  }
#endif
}

// A row's three parts, blocks' scales and half blocks' code sums (split_blocks), for `rows` rows.
struct SplitRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> qsum;
  SplitRows(const float* x, int64_t rows, int64_t K) : q(rows * 3 * K), d(rows * K / kBlock), qsum(rows * 3 * K / 16) {
    at::parallel_for(0, rows, kQuantizeRows, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        split_blocks(x + m * K, K, &q[m * 3 * K], &d[m * K / kBlock], &qsum[m * 3 * K / 16]);
    });
  }
};

// Block b's codes of run i (4 of a block; int8: 4 of each half) as unsigned bytes (byte j of a lane: k = 4i + j,
// and in hi 16 + 4i + j), in int4_tiles', high_bits_tile_f32's or int8_tiles' layout.
#if defined(EMBER_AVX512_VNNI)
struct CodeWords {
  __m512i lo, hi;
};
#else
struct CodeWords {
  W64 lo, hi;
};
// The 5- or 6-bit codes of run i as bytes: the nibbles, the fifth bits (bit 8j + i of h: lo, 8j + 4 + i: hi) at
// bit 4, and with 6 bits the sixth (from h6 alike) at bit 5, then offset by 32 (byte ^ 32: 0..63).
template <int kBits>
inline __m256i high_bytes(__m256i v, __m256i h, __m256i h6, int i, int half) {
  const __m256i nibble = _mm256_and_si256(half ? _mm256_srli_epi32(v, 4) : v, _mm256_set1_epi8(0x0F));
  const __m256i h_at = half ? _mm256_srli_epi32(h, i) : _mm256_slli_epi32(h, 4 - i);  // bit 8j + 4
  __m256i code = _mm256_or_si256(nibble, _mm256_and_si256(h_at, _mm256_set1_epi8(0x10)));
  if constexpr (kBits == 6) {
    const int at = half ? 4 + i : i;  // the sixth bit's place in its byte, to go to 5
    const __m256i h6_at = at <= 5 ? _mm256_slli_epi32(h6, 5 - at) : _mm256_srli_epi32(h6, at - 5);
    code = _mm256_xor_si256(_mm256_or_si256(code, _mm256_and_si256(h6_at, _mm256_set1_epi8(0x20))),
                            _mm256_set1_epi8(0x20));
  }
  return code;
}
#endif
template <int kBits>
inline CodeWords code_words(const uint8_t* w, const uint8_t* high, int64_t b, int i) {
  if constexpr (kBits == 8) {
    return {load64(w + b * 512 + 64 * i), load64(w + b * 512 + 64 * (i + 4))};
  } else if constexpr (kBits == 4) {
    const auto v = load64(w + b * 256 + 64 * i);
    return {low_nibbles(v), high_nibbles(v)};
  } else {
    constexpr int kHigh = 64 * (kBits - 4);
#if !defined(EMBER_AVX512_VNNI)
    const W64 v = load64(w + b * 256 + 64 * i);
    const W64 hv = load64(high + b * kHigh), h6 = load64(high + b * kHigh + kHigh - 64);
    return {{high_bytes<kBits>(v.lo, hv.lo, h6.lo, i, 0), high_bytes<kBits>(v.hi, hv.hi, h6.hi, i, 0)},
            {high_bytes<kBits>(v.lo, hv.lo, h6.lo, i, 1), high_bytes<kBits>(v.hi, hv.hi, h6.hi, i, 1)}};
#else
    const __m512i v = load64(w + b * 256 + 64 * i);
    const __m512i hv = load64(high + b * kHigh), h6 = load64(high + b * kHigh + kHigh - 64);
    const QuintRun q = high_run<kBits>(v, hv, h6, i);
    if constexpr (kBits == 5) {
      const __m512i mask = _mm512_set1_epi8(0x1F);
      return {_mm512_and_si512(q.lo, mask), _mm512_and_si512(q.hi, mask)};
    } else {  // (byte & 63) ^ 32: the signed code plus 32
      const __m512i mask = _mm512_set1_epi8(0x3F), sign = _mm512_set1_epi8(0x20);
      return {_mm512_ternarylogic_epi32(q.lo, mask, sign, 0x6A), _mm512_ternarylogic_epi32(q.hi, mask, sign, 0x6A)};
    }
#endif
  }
}

// R split rows (row r's parts at xq + r * 3K + p * K, d + r * KB, qsum + r * 6KB) against one tile of kBits
// codes, the codes' bytes made once for all R: out[r * N + l] = sum over factor blocks of scale * (the block's
// sum of q x) + min * xs (xs + r * B), the factors a block of S k (16: kHalves, each half of a block of 32 its
// own; else 32 or an int4 group of S), kStride floats apart (factor_at).
template <int R, int kBits, bool kHalves, int kStride, typename F>
void split_tile(const uint8_t* w, const uint8_t* high, F scales, F mins, const int8_t* xq, const float* d,
                const int32_t* qsum, const float* xs, int64_t K, int64_t S, float* out, int64_t N) {
  // int8 codes are stored plus 128 (AVX2's int8 product takes them signed: no offset), 6-bit ones made so above
  constexpr int32_t kOffset = kBits == 8 ? (kInt8Offset ? 128 : 0) : kBits == 6 ? 32 : 0;
  constexpr int kH = kHalves ? 2 : 1;
  const int64_t KB = K / kBlock, per = kHalves ? 1 : S / kBlock, B = kHalves ? 2 * KB : KB / per;
  F16x acc[R], group[R];
  for (int r = 0; r < R; ++r) acc[r] = group[r] = fzero();
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_ahead(w + b * (kBits == 8 ? 512 : 256), kBits == 8 ? 8 : 4);
    if constexpr (kBits == 5 || kBits == 6) prefetch_ahead(high + b * 64 * (kBits - 4), kBits - 4);
    I16 s[R][kH][3];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kH; ++h)
        for (int p = 0; p < 3; ++p) s[r][h][p] = izero();
    for (int i = 0; i < 4; ++i) {
      const CodeWords c = code_words<kBits>(w, high, b, i);
      for (int r = 0; r < R; ++r) {
        for (int p = 0; p < 3; ++p) {
          const int8_t* xb = xq + r * 3 * K + p * K + b * kBlock + 4 * i;
          if constexpr (kBits == 8) {
            s[r][0][p] = dot4_int8(s[r][0][p], c.lo, load4(xb));
            s[r][kH - 1][p] = dot4_int8(s[r][kH - 1][p], c.hi, load4(xb + 16));
          } else {
            s[r][0][p] = dot4(s[r][0][p], c.lo, load4(xb));
            s[r][kH - 1][p] = dot4(s[r][kH - 1][p], c.hi, load4(xb + 16));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dr = d[r * KB + b];
      const float dp[3] = {dr, dr / kSplitBase, dr / (kSplitBase * kSplitBase)};
      for (int h = 0; h < kH; ++h) {
        F16x f = fzero();
        for (int p = 0; p < 3; ++p) {
          I16 sum = s[r][h][p];
          if constexpr (kOffset != 0) {
            const int32_t* qs = qsum + r * 6 * KB + p * 2 * KB + 2 * b;
            sum = isub_scalar(sum, kOffset * (kHalves ? qs[h] : qs[0] + qs[1]));
          }
          f = fma(to_float(sum), fset(dp[p]), f);
        }
        if constexpr (kHalves) {
          acc[r] = fma(f, factor_at<kStride>(scales, 2 * b + h), acc[r]);
          if (given(mins)) acc[r] = fma(factor_at<kStride>(mins, 2 * b + h), fset(xs[r * B + 2 * b + h]), acc[r]);
        } else {
          group[r] = fadd(group[r], f);
        }
      }
    }
    if constexpr (!kHalves) {
      if ((b + 1) % per == 0) {  // the end of a factor block: scale its sums, add its min term
        const int64_t g = b / per;
        const F16x scale = factor_at<kStride>(scales, g);
        for (int r = 0; r < R; ++r) {
          acc[r] = fma(group[r], scale, acc[r]);
          if (given(mins)) acc[r] = fma(factor_at<kStride>(mins, g), fset(xs[r * B + g]), acc[r]);
          group[r] = fzero();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}

// Rows of split x a tile meets at once (kSplitRows at most): with blocks of 16 (two halves' sums a part) on AVX2,
// whose registers are half as wide, one, so that the sums stay in registers.
#if defined(EMBER_AVX512_VNNI)
constexpr int kSplitRun = 2, kSplitRunHalves = 2;
#else
constexpr int kSplitRun = 2, kSplitRunHalves = 1;
#endif

// Calls tile(R, first row) for rows [0, M) in runs of at most kRun.
template <int kRun, typename Tile>
void split_runs(int64_t M, const Tile& tile) {
  int64_t m = 0;
  for (; m + kRun <= M; m += kRun) tile(std::integral_constant<int, kRun>{}, m);
  if constexpr (kRun > 1) {
    if (M - m > 0) split_runs<kRun - 1>(M - m, [&](auto R, int64_t first) { tile(R, m + first); });
  }
}

// All M rows of out split: tile(R, t, first row, its parts, d, qsum) for every tile and run of R rows (at most
// kRun), threads sharing the tiles.
template <int kRun, typename Tile>
void over_split_rows(const float* x, int64_t M, int64_t K, int64_t tiles, const Tile& tile) {
  const SplitRows split(x, M, K);
  const int64_t KB = K / kBlock;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      split_runs<kRun>(M, [&](auto R, int64_t m) {
        tile(R, t, m, &split.q[m * 3 * K], &split.d[m * KB], &split.qsum[m * 3 * K / 16]);
      });
  });
}
#endif

// ---- a prefill's rows as one int16 code a weight (AVX512-VNNI) -------------------------------------------
//
// From kWideRows rows the float kernels' FMAs (16 products an instruction, on float codes) bound a prefill. Here
// each block of 32 activations is one int16 code of one scale d = max|x| / 32767 (x held to 2^-16 of the block's
// largest |x|, where float32 holds each |x| to 2^-24 and the int8 activations of `--quantize gguf` and llama.cpp
// to 2^-8), and each tile's codes are int16 pairs, made once a tile for all its rows: vpdpwssd takes two k of 16
// lanes an instruction, 32 exact products summed in int32, scaled once a block in float32, the scales' and mins'
// order the split path's. Off with EMBER_CPU_WIDE=0 (the FMA path, for comparisons).
#if defined(EMBER_AVX512_VNNI)
#define EMBER_WIDE 1

// Rows from which the float kernels take x as int16 codes (those the tile unit leaves).
constexpr int64_t kWideRows = 4;

bool wide_on() {
  const char* env = std::getenv("EMBER_CPU_WIDE");
  return !(env != nullptr && std::strcmp(env, "0") == 0);
}

// Row x (K floats) -> its int16 codes, a scale a block of 32 (d), rounded half to even (the default rounding mode),
// as row r of a run of R rows packed for wide_tile: a block's pairs of codes (k = 2p, 2p + 1) as int32, pair by
// pair, each pair's R rows one after another (pairs[(16 b + p) R + r]; d[b R + r]), so that the pairs a tile's
// run broadcasts in turn lie at offsets known when it compiles, from one pointer.
void wide_blocks(const float* x, int64_t K, int64_t R, int32_t* pairs, float* d) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  alignas(64) int32_t block[16];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 t0 = _mm512_loadu_ps(x + b * kBlock), t1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(t0, magnitude), _mm512_and_ps(t1, magnitude)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    d[b * R] = amax / 32767.f;
    const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(t0, inv)));
    const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(t1, inv)));
    // 16 stores (a scatter instruction took 5x the time of the rest of the loop on a Zen 4)
    _mm512_store_si512(block, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    for (int p = 0; p < 16; ++p) pairs[(b * 16 + p) * R] = block[p];
  }
}

// A block's codes (code_words: bytes, run i's lanes k = 4i + j and 16 + 4i + j, offset by kOffset) -> 16 words of 16
// lanes, word p holding each lane's int16 codes of k = 2p and 2p + 1 (tile words: a tile's KB * 16 words).
template <int kBits>
void tile_words(const uint8_t* w, const uint8_t* high, int64_t KB, __m512i* words) {
  constexpr int16_t kOffset = kBits == 8 ? 128 : kBits == 6 ? 32 : 0;
  // bytes 0, 1 (and 2, 3) of each lane zero-extended to its two int16s
  const __m512i first = _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
  const __m512i second = _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
  const __m512i offset = _mm512_set1_epi16(kOffset);
  for (int64_t b = 0; b < KB; ++b) {
    for (int i = 0; i < 4; ++i) {
      const CodeWords c = code_words<kBits>(w, high, b, i);
      const __m512i halves[2] = {c.lo, c.hi};
      for (int h = 0; h < 2; ++h) {
        __m512i* at = words + b * 16 + 8 * h + 2 * i;
        at[0] = _mm512_sub_epi16(_mm512_shuffle_epi8(halves[h], first), offset);
        at[1] = _mm512_sub_epi16(_mm512_shuffle_epi8(halves[h], second), offset);
      }
    }
  }
}

// A run of R rows of int16 codes (pairs and d, packed as wide_blocks packs them) against one tile's words: out[r *
// N + l] = sum over factor blocks of scale * (the block's sum of q x) + min * xs (xs + r * B); the factors as
// split_tile takes them, a factor block of kFactorK k: 16 (each half of a block its own), 32, or 0: S (an int4
// group of 64 k or more, its blocks' sums added before they are scaled).
template <int R, int kFactorK, int kStride, typename F>
void wide_tile(const __m512i* words, F scales, F mins, const int32_t* pairs, const float* d, const float* xs, int64_t K,
               int64_t S, float* out, int64_t N) {
  constexpr int kH = kFactorK == 16 ? 2 : 1, kWords = 16 / kH;
  constexpr bool kGroups = kFactorK == 0;
  const int64_t KB = K / kBlock, per = kGroups ? S / kBlock : 1, B = kH * KB / per;
  F16x acc[R], group[kGroups ? R : 1];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (auto& g : group) g = fzero();
  int64_t in_group = 0;  // blocks of the group summed so far (a count, not b % per: no division a block)
  for (int64_t b = 0; b < KB; ++b) {
    for (int h = 0; h < kH; ++h) {  // a half block (kFactorK 16), or all 32
      __m512i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int p = kWords * h; p < kWords * (h + 1); ++p) {
        const __m512i wp = _mm512_load_si512(words + b * 16 + p);
        const int32_t* at = pairs + (b * 16 + p) * R;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s[r] = _mm512_dpwssd_epi32(s[r], wp, _mm512_set1_epi32(at[r]));
      }
      if constexpr (!kGroups) {  // the factor block ends here: scale its sums, add its min term
        const int64_t f = kH * b + h;
        const F16x scale = factor_at<kStride>(scales, f);
        const F16x mn = given(mins) ? factor_at<kStride>(mins, f) : fzero();
        for (int r = 0; r < R; ++r) {
          acc[r] = fma(fmul_scalar(to_float(I16{s[r]}), d[b * R + r]), scale, acc[r]);
          if (given(mins)) acc[r] = fma(mn, fset(xs[r * B + f]), acc[r]);
        }
      } else {
        for (int r = 0; r < R; ++r) group[r] = fadd(group[r], fmul_scalar(to_float(I16{s[r]}), d[b * R + r]));
      }
    }
    if constexpr (kGroups) {
      if (++in_group == per) {  // the end of a group: scale its sums, add its min term
        in_group = 0;
        const int64_t g = b / per;
        const F16x scale = factor_at<kStride>(scales, g);
        const F16x mn = given(mins) ? factor_at<kStride>(mins, g) : fzero();
        for (int r = 0; r < R; ++r) {
          acc[r] = fma(group[r], scale, acc[r]);
          if (given(mins)) acc[r] = fma(mn, fset(xs[r * B + g]), acc[r]);
          group[r] = fzero();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * N, acc[r]);
}

// Bytes of int16 codes of x a thread runs its tiles over before it moves to the next rows: a chunk of rows stays in
// its L2 for every tile it takes, where a long prompt's rows (5.5 MB for 1800 rows of 1536) came from memory again
// for each tile. Each tile's words are made again for each chunk, a few percent of a chunk's products; 3-5% faster
// at 1800 rows (SmolLM2's projections, 2 Zen 4 cores).
constexpr int64_t kWideChunkBytes = 256 << 10;

// All M rows of x (M * K floats) as int16 codes, in runs of kMaxRows rows (the last one shorter) packed as
// wide_blocks packs them: for each chunk of rows, each thread makes a tile's words (words(t, buffer)), then calls
// tile(R, t, the run's first row, its pairs, their scales, the words) for each run of R rows of the chunk
// (kMaxRows at most; 12 measured no faster).
template <typename Words, typename Tile>
void over_wide_rows(const float* x, int64_t M, int64_t K, int64_t tiles, const Words& words, const Tile& tile) {
  const int64_t KB = K / kBlock;
  std::unique_ptr<int32_t[]> pairs(new int32_t[M * K / 2]);
  std::unique_ptr<float[]> d(new float[M * KB]);
  at::parallel_for(0, M, kQuantizeRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t run = m / kMaxRows * kMaxRows, R = std::min<int64_t>(kMaxRows, M - run), r = m - run;
      wide_blocks(x + m * K, K, R, &pairs[run * K / 2 + r], &d[run * KB + r]);
    }
  });
  const int64_t chunk = std::max<int64_t>(kMaxRows, kWideChunkBytes / (2 * K) / kMaxRows * kMaxRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<__m512i[]> buffer(new __m512i[KB * 16]);
    for (int64_t first = 0; first < M; first += chunk) {
      for (int64_t t = begin; t < end; ++t) {
        words(t, buffer.get());
        by_rows(std::min(chunk, M - first), [&](auto R, int64_t m) {
          m += first;
          tile(R, t, m, &pairs[m * K / 2], &d[m * KB], buffer.get());
        });
      }
    }
  });
}
#endif

// y = x @ w.T in float32 with int4 weights as they are: x not rounded, w = q * scale + min with float32 factors
// (scale_min (N/16, K/g, 2, 16)), each group's products summed, then scaled. The float linear's values on the
// dequantized weights to float32's precision (x as it is, or as three int8 or bf16 parts: split_tile,
// amx_f32_rows), or a prefill's rows to 2^-16 of each block's largest |x| (int16 codes: wide_tile): a GGUF file's
// 4-bit weights computed without a float copy of them.
// With `units`, scale_min holds int8 codes of the factors and units (N/16, K/256, 2, 16) their float16 units
// (`Coded`).
at::Tensor int4_gemv_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                         int64_t group_size, const std::optional<at::Tensor>& units) {
  check_operands(x, packed, 256);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  TORCH_CHECK(group_size % kBlock == 0 && K % group_size == 0, "group size ", group_size, " does not tile K = ", K);
  const int64_t G = K / group_size;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const std::vector<float> xs = block_sums(xp, M, K, group_size);  // the min term's factors, a group each
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const auto run = [&](const auto& sc, const auto& mn) {  // the tile's scales and mins from each tile's factors
    int64_t first = 0;  // rows [0, first) on the tile unit
#if defined(EMBER_AMX_BF16)
    first = amx_f32_row_count(M);
    if (first > 0) {
      const auto decode = [&](int64_t t, int64_t b0, int64_t b1, uint8_t* rows) {
        decode_int4_bf16(wp + t * (K / kBlock) * 256, b0, b1, rows);
      };
      amx_f32_rows<2 * kTile>(xp, first, K, tiles, group_size, decode, sc, mn, xs.data(), op, N);
    }
#endif
    if (first == M) return;
#if defined(EMBER_SPLIT)
    if (split_on() && M - first <= kSplitRows) {  // the rows left, a few
      over_split_rows<kSplitRun>(xp + first * K, M - first, K, tiles, [&](auto R, int64_t t, int64_t m,
                                                                          const int8_t* q, const float* d,
                                                                          const int32_t* qs) {
        m += first;
        split_tile<decltype(R)::value, 4, false, 2 * kTile>(wp + t * (K / kBlock) * 256, nullptr, sc(t), mn(t), q, d,
                                                            qs, &xs[m * G], K, group_size, op + m * N + t * kTile, N);
      });
      return;
    }
#endif
#if defined(EMBER_WIDE)
    if (wide_on() && M - first >= kWideRows) {  // a prefill's rows
      const int64_t KB = K / kBlock;
      const auto run_wide = [&](auto factor_k) {
        constexpr int kFactorK = decltype(factor_k)::value;
        over_wide_rows(
            xp + first * K, M - first, K, tiles,
            [&](int64_t t, __m512i* words) { tile_words<4>(wp + t * KB * 256, nullptr, KB, words); },
            [&](auto R, int64_t t, int64_t m, const int32_t* q, const float* d, const __m512i* words) {
              m += first;
              wide_tile<decltype(R)::value, kFactorK, 2 * kTile>(words, sc(t), mn(t), q, d, &xs[m * G], K,
                                                                 group_size, op + m * N + t * kTile, N);
            });
      };
      if (group_size == kBlock)
        run_wide(std::integral_constant<int, kBlock>{});
      else
        run_wide(std::integral_constant<int, 0>{});
      return;
    }
#endif
    over_tiles(tiles, M - first, [&](auto R, int64_t t, int64_t m) {
      m += first;
      int4_tile_f32<decltype(R)::value>(wp + t * (K / kBlock) * 256, sc(t), mn(t), xp + m * K, &xs[m * G], K,
                                        group_size, op + m * N + t * kTile, N);
    });
  };
  if (units) {
    const Coded sc = coded_factors(scale_min, *units, tiles, G, K, 2 * kTile, "scale_min"), mn = sc.shifted(kTile);
    run([&](int64_t t) { return sc.tile(t, G); }, [&](int64_t t) { return mn.tile(t, G); });
  } else {
    const auto floats = [&](auto* type) {
      const auto* sp = float_factors<std::remove_pointer_t<decltype(type)>>(scale_min, tiles, G, 2 * kTile, "scale_min");
      run([&](int64_t t) { return sp + t * G * 2 * kTile; }, [&](int64_t t) { return sp + t * G * 2 * kTile + kTile; });
    };
    if (scale_min.scalar_type() == at::kHalf)
      floats(static_cast<at::Half*>(nullptr));
    else
      floats(static_cast<float*>(nullptr));
  }
  return out;
}

// The block ops' shared run (int5_gemv_f32, int8_gemv_f32): x and the codes (bytes_per_block a tile's block
// of 32 k) checked with the factors (N/16, K/block, 16) (float32, float16, or int8 codes with units: `Coded`),
// the rows' block sums where mins are given, then for each tile t and run of R rows m: tile(R, t, its scales,
// its mins (none without), the rows' x, their block sums or null, their out).
template <typename Tile, typename Decode, typename Split, typename Words>
at::Tensor block_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t bytes_per_block, const at::Tensor& scales,
                      int64_t block, const std::optional<at::Tensor>& mins,
                      const std::optional<at::Tensor>& scale_units, const std::optional<at::Tensor>& min_units,
                      Tile tile, Decode decode, Split split, Words words) {
  check_operands(x, packed, bytes_per_block);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  TORCH_CHECK(block == 16 || block == 32, "block ", block, " is not 16 or 32");
  TORCH_CHECK(mins ? min_units.has_value() == scale_units.has_value() : !min_units,
              "scales and mins are coded (given units) both or neither");
  const int64_t B = K / block;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const std::vector<float> xs = mins ? block_sums(xp, M, K, block) : std::vector<float>();
  float* op = out.data_ptr<float>();
  const auto run = [&](const auto& sc, const auto& mn) {  // the tile's scales and mins from each tile's factors
    int64_t first = 0;  // rows [0, first) on the tile unit
#if defined(EMBER_AMX_BF16)
    first = amx_f32_row_count(M);
    if (first > 0) amx_f32_rows<kTile>(xp, first, K, tiles, block, decode, sc, mn, mins ? xs.data() : nullptr, op, N);
#else
    (void)decode;
#endif
    if (first == M) return;
#if defined(EMBER_SPLIT)
    if (split_on() && M - first <= kSplitRows) {  // the rows left, a few
      const auto run_split = [&](auto halves, auto run) {
        over_split_rows<decltype(run)::value>(xp + first * K, M - first, K, tiles, [&](auto R, int64_t t, int64_t m,
                                                                                       const int8_t* q, const float* d,
                                                                                       const int32_t* qs) {
          m += first;
          const float* xr = mins ? xs.data() + m * B : nullptr;
          split(R, halves, t, sc(t), mn(t), q, d, qs, xr, op + m * N + t * kTile);
        });
      };
      if (block == 16)
        run_split(std::true_type{}, std::integral_constant<int, kSplitRunHalves>{});
      else
        run_split(std::false_type{}, std::integral_constant<int, kSplitRun>{});
      return;
    }
#else
    (void)split;
#endif
#if defined(EMBER_WIDE)
    if (wide_on() && M - first >= kWideRows) {  // a prefill's rows
      const auto run_wide = [&](auto factor_k) {
        constexpr int kFactorK = decltype(factor_k)::value;
        over_wide_rows(
            xp + first * K, M - first, K, tiles, words,
            [&](auto R, int64_t t, int64_t m, const int32_t* q, const float* d, const __m512i* w) {
              m += first;
              wide_tile<decltype(R)::value, kFactorK, kTile>(w, sc(t), mn(t), q, d, mins ? xs.data() + m * B : nullptr,
                                                             K, block, op + m * N + t * kTile, N);
            });
      };
      if (block == 16)
        run_wide(std::integral_constant<int, 16>{});
      else
        run_wide(std::integral_constant<int, kBlock>{});
      return;
    }
#else
    (void)words;
#endif
    over_tiles(tiles, M - first, [&](auto R, int64_t t, int64_t m) {
      m += first;
      tile(R, t, sc(t), mn(t), xp + m * K, mins ? xs.data() + m * B : nullptr, op + m * N + t * kTile);
    });
  };
  if (scale_units) {
    const Coded sc = coded_factors(scales, *scale_units, tiles, B, K, kTile, "scales");
    const Coded mn = mins ? coded_factors(*mins, *min_units, tiles, B, K, kTile, "mins") : Coded{};
    run([&](int64_t t) { return sc.tile(t, B); }, [&](int64_t t) { return mn.tile(t, B); });
  } else {
    TORCH_CHECK(!mins || mins->scalar_type() == scales.scalar_type(), "scales and mins of one dtype");
    const auto floats = [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      const T* sp = float_factors<T>(scales, tiles, B, kTile, "scales");
      const T* mp = mins ? float_factors<T>(*mins, tiles, B, kTile, "mins") : nullptr;
      run([&](int64_t t) { return sp + t * B * kTile; }, [&](int64_t t) { return mp ? mp + t * B * kTile : nullptr; });
    };
    if (scales.scalar_type() == at::kHalf)
      floats(static_cast<at::Half*>(nullptr));
    else
      floats(static_cast<float*>(nullptr));
  }
  return out;
}

// The 5- and 6-bit kernels' vector path from kFloatCodeRows rows (those the tile unit leaves): each thread turns a
// tile's codes into floats in a buffer of its own (16 K floats, in its L2) when it first meets the tile, and all
// its runs of rows read them there (over_tiles gives a thread each tile's runs one after another). Not for int4:
// its nibbles become floats in two instructions, and loading them instead ran 2-5% slower. Where the rows go as
// int16 codes (AVX512-VNNI, from kWideRows) it holds no buffers: the FMA path's, for builds without that and
// EMBER_CPU_WIDE=0.
class TileFloats {
 public:
  TileFloats(int64_t M, int64_t K) : K_(K) {
#if defined(EMBER_AMX_BF16)
    M -= amx_f32_row_count(M);
#endif
    if (M < kFloatCodeRows) return;
#if defined(EMBER_WIDE)
    if (wide_on() && M >= kWideRows) return;  // the rows go as int16 codes
#endif
    buffers_.assign(at::get_num_threads(), std::vector<float>(kTile * K));
    tile_of_.assign(buffers_.size(), -1);
  }
  // Tile t's codes as floats, from their packed form; null when off, or on a thread without a buffer (a call
  // from inside another parallel region runs on its caller's thread, whose number may be past them).
  template <int kBits>
  const float* of(int64_t t, PackedCodes<kBits> packed) {
    const int thread = at::get_thread_num();
    if (thread < 0 || thread >= static_cast<int>(buffers_.size())) return nullptr;
    float* codes = buffers_[thread].data();
    if (tile_of_[thread] != t) {
      float_codes(packed, K_ / kBlock, codes);
      tile_of_[thread] = t;
    }
    return codes;
  }

 private:
  int64_t K_;
  std::vector<std::vector<float>> buffers_;  // a thread's
  std::vector<int64_t> tile_of_;             // the tile a thread's buffer holds
};

// y = x @ w.T in float32 with 5-bit codes as they are (high_bits_tile_f32's layout), w = q * scale (+ min); a GGUF
// file's Q5_0 / Q5_1 / Q5_K (and Q3_K / Q2_K / 4-bit, beside them in one projection) in 5 bits a weight.
template <int kBits>
at::Tensor high_bits_gemv_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high,
                              const at::Tensor& scales, int64_t block, const std::optional<at::Tensor>& mins,
                              const std::optional<at::Tensor>& scale_units,
                              const std::optional<at::Tensor>& min_units) {
  check_operands(x, packed, 256);
  constexpr int64_t kHigh = 64 * (kBits - 4);
  const int64_t K = x.size(1), N = packed.size(0) * kTile, KB = K / kBlock;
  TORCH_CHECK(high.scalar_type() == at::kByte && high.is_contiguous() && high.numel() == packed.size(0) * KB * kHigh,
              "high bits ", high.sizes(), " do not match ", packed.size(0), " tiles of K = ", K, " (", kBits, "-bit codes)");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint8_t* hp = high.data_ptr<uint8_t>();
  const auto tile_codes = [&](int64_t t) { return PackedCodes<kBits>{wp + t * KB * 256, hp + t * KB * kHigh}; };
  TileFloats floats(x.size(0), K);
  return block_gemv(x, packed, 256, scales, block, mins, scale_units, min_units,
                    [&](auto R, int64_t t, auto s, auto mn, const float* xr, const float* xs, float* o) {
                      constexpr int kR = decltype(R)::value;
                      if (const float* codes = floats.of(t, tile_codes(t)))
                        high_bits_tile_f32<kR>(FloatCodes{codes}, s, mn, xr, xs, K, block, o, N);
                      else
                        high_bits_tile_f32<kR>(tile_codes(t), s, mn, xr, xs, K, block, o, N);
                    },
                    [&](int64_t t, int64_t b0, int64_t b1, uint8_t* rows) {
#if defined(EMBER_AMX_BF16)
                      decode_high_bits_bf16<kBits>(wp + t * KB * 256, hp + t * KB * kHigh, b0, b1, rows);
#endif
                    },
                    [&](auto R, auto halves, int64_t t, auto s, auto mn, const int8_t* q, const float* d,
                        const int32_t* qs, const float* xs, float* o) {
#if defined(EMBER_SPLIT)
                      split_tile<decltype(R)::value, kBits, decltype(halves)::value, kTile>(
                          wp + t * KB * 256, hp + t * KB * kHigh, s, mn, q, d, qs, xs, K, block, o, N);
#endif
                    },
                    [&](int64_t t, auto* words) {
#if defined(EMBER_WIDE)
                      tile_words<kBits>(wp + t * KB * 256, hp + t * KB * kHigh, KB, words);
#endif
                    });
}

at::Tensor int5_gemv_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& scales,
                         int64_t block, const std::optional<at::Tensor>& mins,
                         const std::optional<at::Tensor>& scale_units, const std::optional<at::Tensor>& min_units) {
  return high_bits_gemv_f32<5>(x, packed, high, scales, block, mins, scale_units, min_units);
}

// The same with signed 6-bit codes (-32..31: Q6_K's, and the narrower types' beside them) as int6_tiles lays
// them out, 6 bits a weight.
at::Tensor int6_gemv_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& scales,
                         int64_t block, const std::optional<at::Tensor>& mins,
                         const std::optional<at::Tensor>& scale_units, const std::optional<at::Tensor>& min_units) {
  return high_bits_gemv_f32<6>(x, packed, high, scales, block, mins, scale_units, min_units);
}

// y = x @ w.T in float32 with int8 weights as they are, a float32 scale a block of 16 or 32 k and, given mins,
// a float32 min: w = q * scale (+ min) (scales and mins (N/16, K/block, 16)); a GGUF file's block types (Q8_0,
// Q6_K, Q5_K, ...) without a float copy of their weights.
at::Tensor int8_gemv_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t block,
                         const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& scale_units,
                         const std::optional<at::Tensor>& min_units) {
  check_operands(x, packed, 512);
  const int64_t K = x.size(1), N = packed.size(0) * kTile, KB = K / kBlock;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  return block_gemv(x, packed, 512, scales, block, mins, scale_units, min_units,
                    [&](auto R, int64_t t, auto s, auto mn, const float* xr, const float* xs, float* o) {
                      int8_tile_f32<decltype(R)::value>(wp + t * KB * 512, s, mn, xr, xs, K, block, o, N);
                    },
                    [&](int64_t t, int64_t b0, int64_t b1, uint8_t* rows) {
#if defined(EMBER_AMX_BF16)
                      decode_int8_bf16(wp + t * KB * 512, b0, b1, rows);
#endif
                    },
                    [&](auto R, auto halves, int64_t t, auto s, auto mn, const int8_t* q, const float* d,
                        const int32_t* qs, const float* xs, float* o) {
#if defined(EMBER_SPLIT)
                      split_tile<decltype(R)::value, 8, decltype(halves)::value, kTile>(
                          wp + t * KB * 512, nullptr, s, mn, q, d, qs, xs, K, block, o, N);
#endif
                    },
                    [&](int64_t t, auto* words) {
#if defined(EMBER_WIDE)
                      tile_words<8>(wp + t * KB * 512, nullptr, KB, words);
#endif
                    });
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
  over_tiles(tiles, M, [&](auto R, int64_t t, int64_t m) {
    int8_tile<decltype(R)::value>(wp + t * (K / kBlock) * 512, sp + t * kTile, &xq[m * K], &d[m], &xsum[m], K,
                                  op + m * N + t * kTile, N);
  });
  return out;
}

#if defined(EMBER_AMX_BF16)
// ---- AMX-BF16: int4 weights as bf16, many rows (prefills) --------------------------------------------------
//
// int4_gemm_bf16: y = x @ w.T with x rounded to bf16 and w = q * scale + min (float16 factors) rounded to bf16,
// summed in float32 by TDPBF16PS. Per block of 32 k the tile unit takes a whole 16 x 16 x 32 product into a C
// tile that stays there across K (the int8 codes' per-block scales must leave the tile unit every block). A
// thread dequantizes two tiles of 16 output rows at a time into B tiles (K / 2 rows of 16 pairs of k, in L2)
// and runs every 32 rows of x against them.

// C (tmm0-3): rows r of chunk c against tile t as 16 x 16 float32; A (tmm4, tmm5) 16 rows of 32 bf16 of x;
// B (tmm6, tmm7) 32 k of a tile as 16 rows of 16 (k, k + 1) bf16 pairs.
const TileConfig kBf16Tiles{.colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

// One int4 tile (its packed codes and (K/g, 2, 16) scale_min) -> B tiles at b, K / 2 rows of 64 bytes: row
// k / 2 holds for output row l the pair (w[l][k], w[l][k + 1]) in bf16. Run i of a block holds for row l the
// codes of k = 4i + j (low nibbles) and 16 + 4i + j (high), j < 4: rows 2i, 2i + 1 and 8 + 2i, 9 + 2i.
void dequantize_int4_tile_bf16(const uint8_t* w, const at::Half* sm, int64_t KB, int64_t blocks_per_group,
                               uint8_t* b) {
  const __m512i byte = _mm512_set1_epi32(0xFF), nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < KB; ++blk) {
    const at::Half* s = sm + (blk / blocks_per_group) * 2 * kTile;
    const __m512 scale = load_half(s).v, mn = load_half(s + kTile).v;
    uint8_t* rows = b + blk * 16 * 64;
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(w + blk * 256 + 64 * i);
      const __m512i halves[2] = {_mm512_and_si512(v, nibbles), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles)};
      for (int h = 0; h < 2; ++h) {
        __m512 f[4];
        for (int j = 0; j < 4; ++j) {
          const __m512i q = _mm512_and_si512(_mm512_srli_epi32(halves[h], 8 * j), byte);
          f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, mn);
        }
        for (int j = 0; j < 2; ++j) {
          _mm512_store_si512(rows + (8 * h + 2 * i + j) * 64, bf16_pairs(f[2 * j], f[2 * j + 1]));
        }
      }
    }
  }
}

// silu(g) * u, 16 lanes: g / (1 + e^-g) * u, with e^-g as 2^n * 2^f (f in [-0.5, 0.5], its Taylor series to
// degree 7; 2^n by scalef), the exponent clamped to +-88 (past it silu is g, or 0 to float precision).
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(g, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(clamped, _mm512_set1_ps(-1.44269504088896341f));  // -g log2(e)
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273e-05f);
  for (const float c : {1.540353e-04f, 1.333355e-03f, 9.618129e-03f, 5.550411e-02f, 2.402265e-01f, 6.931472e-01f,
                        1.0f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// kGlu: w holds a gate/up projection (gate rows over up rows); y = silu(gate) * up (rows, N / 2), a thread
// taking gate tile t with up tile t + tiles / 2, so that the activation is applied to the sums as they leave the
// tile unit. Else y = x @ w.T (rows, N), a thread taking tiles 2t and 2t + 1.
template <bool kGlu>
at::Tensor int4_gemm_bf16_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                                int64_t group_size) {
  check_int4_operands(x, packed, scale_min, group_size);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kTile;
  const int64_t groups = K / group_size, KB = K / kBlock;
  TORCH_CHECK(amx_ready(), "int4_gemm_bf16 needs the tile unit (AMX), which this process may not use");
  TORCH_CHECK(!kGlu || tiles % 2 == 0, "a gate/up projection needs gate and up of whole tiles of ", kTile,
              " rows; got ", N, " rows");
  const int64_t chunks = (M + 2 * kAmxRows - 1) / (2 * kAmxRows) * 2;  // 16-row chunks, an even number
  const int64_t rows = chunks * kAmxRows;
  // x in bf16, zero rows up to a whole pair of chunks; y likewise padded, its first M rows returned.
  // (Converted here: torch's copy_ took ~20 us for SmolLM2's 128 x 576, a few percent of a projection.)
  std::vector<__m512i> xb(rows * K / 32);  // 32 bf16 a vector (K is a multiple of 32)
  const float* xf = x.data_ptr<float>();
  at::parallel_for(0, rows, kQuantizeRows, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; k += 32) {
        const __m512 lo = m < M ? _mm512_loadu_ps(xf + m * K + k) : _mm512_setzero_ps();
        const __m512 hi = m < M ? _mm512_loadu_ps(xf + m * K + k + 16) : _mm512_setzero_ps();
        xb[(m * K + k) / 32] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
    }
  });
  const int64_t width = kGlu ? N / 2 : N;  // of y
  auto out = at::empty({rows, width}, x.options());
  const auto* xp = reinterpret_cast<const uint8_t*>(xb.data());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scale_min.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  const int64_t xs = K * 2, ys = width * 4;  // row strides in bytes
  const int64_t pairs = kGlu ? tiles / 2 : (tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&kBf16Tiles);
    std::vector<__m512i> buffer(2 * KB * 16);  // two tiles' B rows
    auto* b0 = reinterpret_cast<uint8_t*>(buffer.data());
    uint8_t* b1 = b0 + KB * 16 * 64;
    alignas(64) float sums[4][kAmxRows][kTile];  // kGlu: the C tiles on their way to the activation
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = kGlu ? pair : 2 * pair, t1 = kGlu ? pair + tiles / 2 : t + 1;
      const bool two = t1 < tiles;
      dequantize_int4_tile_bf16(wp + t * KB * 256, sp + t * groups * 2 * kTile, KB, group_size / kBlock, b0);
      if (two) dequantize_int4_tile_bf16(wp + t1 * KB * 256, sp + t1 * groups * 2 * kTile, KB,
                                         group_size / kBlock, b1);
      for (int64_t c = 0; c < chunks; c += 2) {
        const uint8_t* x0 = xp + c * kAmxRows * xs;
        const uint8_t* x1 = x0 + kAmxRows * xs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t blk = 0; blk < KB; ++blk) {
          _tile_loadd(4, x0 + blk * 64, xs);
          _tile_loadd(5, x1 + blk * 64, xs);
          _tile_loadd(6, b0 + blk * 1024, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          if (two) {
            _tile_loadd(7, b1 + blk * 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        if constexpr (kGlu) {
          _tile_stored(0, sums[0], kTile * 4);
          _tile_stored(1, sums[1], kTile * 4);
          _tile_stored(2, sums[2], kTile * 4);
          _tile_stored(3, sums[3], kTile * 4);
          for (int h = 0; h < 2; ++h) {
            float* y = op + (c + h) * kAmxRows * width + t * kTile;
            for (int r = 0; r < kAmxRows; ++r) {
              _mm512_storeu_ps(y + r * width, silu_mul(_mm512_load_ps(sums[h][r]), _mm512_load_ps(sums[2 + h][r])));
            }
          }
        } else {
          auto* y0 = reinterpret_cast<uint8_t*>(op + c * kAmxRows * N + t * kTile);
          _tile_stored(0, y0, ys);
          _tile_stored(1, y0 + kAmxRows * ys, ys);
          if (two) {
            _tile_stored(2, y0 + 64, ys);
            _tile_stored(3, y0 + kAmxRows * ys + 64, ys);
          }
        }
      }
    }
    _tile_release();
  });
  return out.narrow(0, 0, M);
}

at::Tensor int4_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                          int64_t group_size) {
  return int4_gemm_bf16_tiles<false>(x, packed, scale_min, group_size);
}

// silu(gate) * up of a gate/up projection (gate rows over up rows), as int4_gemm_bf16 sums them.
at::Tensor int4_silu_gate_up_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                                  int64_t group_size) {
  return int4_gemm_bf16_tiles<true>(x, packed, scale_min, group_size);
}
#endif

std::string simd() { return simd_name(); }

// Whether int4_gemm_bf16 runs in this process (built for AMX-BF16, and the tile state granted).
bool amx_bf16() {
#if defined(EMBER_AMX_BF16)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale_min, int group_size) -> Tensor");
  m.def("int4_gemv_f32(Tensor x, Tensor packed, Tensor scale_min, int group_size, Tensor? units=None) -> Tensor");
  m.def(
      "int8_gemv_f32(Tensor x, Tensor packed, Tensor scales, int block, Tensor? mins=None, Tensor? scale_units=None, "
      "Tensor? min_units=None) -> Tensor");
  m.def(
      "int5_gemv_f32(Tensor x, Tensor packed, Tensor high, Tensor scales, int block, Tensor? mins=None, "
      "Tensor? scale_units=None, Tensor? min_units=None) -> Tensor");
  m.def(
      "int6_gemv_f32(Tensor x, Tensor packed, Tensor high, Tensor scales, int block, Tensor? mins=None, "
      "Tensor? scale_units=None, Tensor? min_units=None) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("simd() -> str");
  m.def("int4_gemm_bf16(Tensor x, Tensor packed, Tensor scale_min, int group_size) -> Tensor");
  m.def("int4_silu_gate_up_bf16(Tensor x, Tensor packed, Tensor scale_min, int group_size) -> Tensor");
  m.def("amx_bf16() -> bool");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_f32", &int4_gemv_f32);
  m.impl("int8_gemv_f32", &int8_gemv_f32);
  m.impl("int5_gemv_f32", &int5_gemv_f32);
  m.impl("int6_gemv_f32", &int6_gemv_f32);
  m.impl("int8_gemv", &int8_gemv);
#if defined(EMBER_AMX_BF16)
  m.impl("int4_gemm_bf16", &int4_gemm_bf16);
  m.impl("int4_silu_gate_up_bf16", &int4_silu_gate_up_bf16);
#endif
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CompositeExplicitAutograd, m) {
  m.impl("simd", &simd);
  m.impl("amx_bf16", &amx_bf16);
}
