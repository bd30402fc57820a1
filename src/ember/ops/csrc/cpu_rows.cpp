// Two per-token pieces of an eager CPU step around the layers, each one call where aten took ~50-600 us a token.
//
// tile_rows: rows of a tiled weight of 4-, 5-, 6- or 8-bit codes, dequantized: a tied embedding looked up in its
// output projection's kept codes (`ember.quant.linear.CodesEmbedding`: a GGUF file's Q8_0, Q6_K, Q5_K, Q4_K ...
// token table; llama.cpp's mixes put a tied table in Q6_K). In Python the lookup untiled the row's whole tile
// (16 rows) in ~10-20 aten ops, 150-180 us a token for Q8_0 (SmolLM2, Gemma 3 270M), ~600 us for Q6_K at width
// 2048: ~3% of an eager decode step. The values are the modules' `weight_rows` exactly: float32(q) * scale, then +
// min, each rounded in float32 (no fused multiply-add), the factors float32, float16 or an int8 code times its
// run's float16 unit (`cpu_ext.compact_factors`), as `cpu_ext.uncoded` multiplies them.
//
// Layouts (`cpu_ext.int8_tiles`, `nibble_tiles`, `int5_tiles`, `int6_tiles`, `int8_block_scales`, `int4_tiles`):
// - 8 bits: codes (N/16, K/32 * 512) uint8, q + 128; block b of 32 k of a tile at 512 b, its run r of 4 k at
//   + 64 r, row i of the tile at + 4 i;
// - 4, 5 and 6 bits: low nibbles (N/16, K/32 * 256); block b at 256 b, run r at + 64 r, row i at + 4 i, byte j:
//   k = 4 r + j in the low nibble, 16 + 4 r + j in the high one. 5 and 6 bits add planes of high bits (N/16,
//   K/32 * 64 a plane): a block's plane at 64 b (6 bits: the fifth bits at 128 b, the sixth at 128 b + 64), row
//   i's byte j at + 4 i + j holding bit 4 h + r for k = 16 h + 4 r + j. 4 and 5 bits are unsigned (0..15,
//   0..31), 6 bits signed (two's complement in 6 bits);
// - factors (N/16, K/block, 16), units (N/16, K/256, 16); or an int4 weight's pairs (N/16, K/g, 2, 16) of scale
//   and min, units (N/16, K/256, 2, 16).
//
// argmax_rows: each row's greedy token, as torch.argmax picks it (the first index of the largest value, a NaN
// counting as larger than everything, so the first NaN): aten's reduction took ~50 us a row of 49152 on 2 cores.
// A pass for the largest value (and whether a NaN is there), then one for its first index; AVX-512 where built
// for it, else the same in scalar code.
//
// Shape legend: n rows asked for, N output features (rows of the weight), K input features; B rows of logits, V
// vocabulary.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "library.h"

namespace {

constexpr int64_t kTile = 16, kBlock = 32;

// One form of a tile's factors (scales, or mins): float32, float16, or int8 codes of float16 units; one lane at
// a time, where cpu_gemv.cpp's `factor_at` (over `Coded` and the float forms) reads a block's 16 lanes as a vector.
// `lanes` factors a block (1; 2 for an int4 weight's scale and min pairs), this form's at `lane`.
struct Factors {
  const float* f32 = nullptr;
  const at::Half* f16 = nullptr;
  const int8_t* q = nullptr;
  const at::Half* unit = nullptr;
  int64_t blocks = 0, per = 1;  // blocks of a tile, blocks of a unit's run of 256 k
  int64_t lanes = 1, lane = 0;

  bool given() const { return f32 != nullptr || f16 != nullptr || q != nullptr; }

  // Row i of tile t, block c.
  float at(int64_t t, int64_t c, int64_t i) const {
    const int64_t j = ((t * blocks + c) * lanes + lane) * kTile + i;
    if (f32 != nullptr) return f32[j];
    if (f16 != nullptr) return static_cast<float>(f16[j]);
    const int64_t u = ((t * (blocks / per) + c / per) * lanes + lane) * kTile + i;
    return static_cast<float>(q[j]) * static_cast<float>(unit[u]);
  }
};

Factors factors(const at::Tensor& f, const std::optional<at::Tensor>& units, int64_t tiles, int64_t blocks, int64_t K,
                int64_t lanes, int64_t lane, const char* name) {
  TORCH_CHECK(f.is_contiguous() && f.numel() == tiles * blocks * lanes * kTile, name, " ", f.sizes(),
              " do not match ", tiles, " tiles of ", blocks, " blocks");
  Factors out;
  out.blocks = blocks;
  out.lanes = lanes;
  out.lane = lane;
  if (units.has_value()) {
    TORCH_CHECK(f.scalar_type() == at::kChar && units->scalar_type() == at::kHalf && units->is_contiguous() &&
                    K % 256 == 0 && blocks % (K / 256) == 0 && units->numel() == tiles * (K / 256) * lanes * kTile,
                name, ": int8 codes ", f.sizes(), " with float16 units ", units->sizes(), " expected for K = ", K);
    out.q = f.data_ptr<int8_t>();
    out.unit = units->data_ptr<at::Half>();
    out.per = blocks / (K / 256);
  } else if (f.scalar_type() == at::kFloat) {
    out.f32 = f.data_ptr<float>();
  } else {
    TORCH_CHECK(f.scalar_type() == at::kHalf, name, ": float32 or float16 expected, got ", f.scalar_type());
    out.f16 = f.data_ptr<at::Half>();
  }
  return out;
}

// Code of row i of tile t at k: the tile's codes at `codes` (its packed bytes), its high planes at `high`.
template <int BITS>
int code_at(const uint8_t* codes, const uint8_t* high, int64_t k, int64_t i) {
  const int64_t b = k / kBlock, h = (k % kBlock) / 16, r = (k % 16) / 4, j = k % 4;
  if (BITS == 8) return static_cast<int>(codes[b * 512 + ((k % kBlock) / 4) * 64 + 4 * i + j]) - 128;
  const int byte = codes[b * 256 + r * 64 + 4 * i + j];
  int code = h != 0 ? byte >> 4 : byte & 0xF;
  if (BITS >= 5) {
    const int64_t plane = b * 64 * (BITS - 4) + 4 * i + j, bit = 4 * h + r;
    code |= ((high[plane] >> bit) & 1) << 4;
    if (BITS == 6) code = ((code | (((high[plane + 64] >> bit) & 1) << 5)) ^ 32) - 32;  // signed
  }
  return code;
}

// Row `row` of the weight into out (K floats).
template <int BITS>
__attribute__((optimize("fp-contract=off"))) void dequantize_row(const uint8_t* packed, const uint8_t* high,
                                                                 const Factors& scales, const Factors& mins,
                                                                 int64_t row, int64_t K, int64_t block, float* out) {
  const int64_t t = row / kTile, i = row % kTile;
  const uint8_t* codes = packed + t * (K / kBlock) * (BITS == 8 ? 512 : 256);
  const uint8_t* planes = BITS >= 5 ? high + t * (K / kBlock) * 64 * (BITS - 4) : nullptr;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t c = k / block;
    const float w = static_cast<float>(code_at<BITS>(codes, planes, k, i)) * scales.at(t, c, i);
    out[k] = mins.given() ? w + mins.at(t, c, i) : w;
  }
}

// rows (n, K) float32 of the weight of `bits`-bit codes `packed` (N/16 tiles; `high`, their high planes at 5 and
// 6 bits) and factors `scales` (and `mins`) of blocks of `block` k, for the row indices `ids` (int64, any shape, n
// of them, each in [0, N)). scales of 4 dimensions are an int4 weight's (scale, min) pairs: mins not given.
at::Tensor tile_rows(const at::Tensor& packed, const std::optional<at::Tensor>& high, const at::Tensor& ids,
                     int64_t bits, int64_t block, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     const std::optional<at::Tensor>& scale_units, const std::optional<at::Tensor>& min_units) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits ", bits, ": 4, 5, 6 or 8 expected");
  const int64_t per_block = bits == 8 ? 512 : 256;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % per_block == 0,
              "packed ", packed.sizes(), ": ", bits, "-bit tiles (N/16, K/32 * ", per_block, ") uint8 expected");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64 expected, got ", ids.scalar_type());
  const int64_t tiles = packed.size(0), N = tiles * kTile, K = packed.size(1) / per_block * kBlock;
  TORCH_CHECK(high.has_value() == (bits == 5 || bits == 6), "high bits ", high.has_value() ? "given" : "missing",
              " for ", bits, "-bit codes");
  if (high.has_value()) {
    TORCH_CHECK(high->scalar_type() == at::kByte && high->is_contiguous() &&
                    high->numel() == tiles * (K / kBlock) * 64 * (bits - 4),
                "high ", high->sizes(), ": (N/16, K/32 * ", 64 * (bits - 4), ") uint8 expected");
  }
  TORCH_CHECK(block > 0 && K % block == 0, "block ", block, " does not divide K = ", K);
  const bool pairs = scales.dim() == 4;
  TORCH_CHECK(!pairs || !mins.has_value(), "scale and min pairs take no separate mins");
  const int64_t lanes = pairs ? 2 : 1;
  const Factors s = factors(scales, scale_units, tiles, K / block, K, lanes, 0, "scales");
  const Factors m = pairs             ? factors(scales, scale_units, tiles, K / block, K, 2, 1, "scales")
                    : mins.has_value() ? factors(*mins, min_units, tiles, K / block, K, 1, 0, "mins")
                                       : Factors{};
  const at::Tensor flat = ids.contiguous().reshape(-1);
  const int64_t n = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  auto out = at::empty({n, K}, packed.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const uint8_t* hi = high.has_value() ? high->data_ptr<uint8_t>() : nullptr;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < N, "row ", id[r], " is outside [0, ", N, ")");
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = o + r * K;
      switch (bits) {
        case 4: dequantize_row<4>(p, hi, s, m, id[r], K, block, row); break;
        case 5: dequantize_row<5>(p, hi, s, m, id[r], K, block, row); break;
        case 6: dequantize_row<6>(p, hi, s, m, id[r], K, block, row); break;
        default: dequantize_row<8>(p, hi, s, m, id[r], K, block, row);
      }
    }
  });
  return out;
}

// The first index of row x's largest value (V >= 1), a NaN counting as the largest.
int64_t argmax_row(const float* x, int64_t V) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(top);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  top = _mm512_reduce_max_ps(best);
  nan = unordered != 0;
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(x[i]);
    top = x[i] > top ? x[i] : top;
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(x[j])) return j;
    }
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 want = _mm512_set1_ps(top);
  for (; j + 16 <= V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), want, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < V; ++j) {
    if (x[j] == top) return j;
  }
  return 0;  // a row of -inf only: the first
}

// logits (B, V) float32, V >= 1 -> (B,) int64.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                  logits.stride(1) == 1,
              "logits ", logits.sizes(), " ", logits.scalar_type(), ": (B, V) float32 with V > 0, rows contiguous");
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = argmax_row(x + b * stride, V);
  });
  return out;
}

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def(
      "tile_rows(Tensor packed, Tensor? high, Tensor ids, int bits, int block, Tensor scales, Tensor? mins=None, "
      "Tensor? scale_units=None, Tensor? min_units=None) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("tile_rows", &tile_rows);
  m.impl("argmax_rows", &argmax_rows);
}
