// A prompt's attention on a CPU, float32: every query of a prompt (or of a prompt's chunk after a prefix) over
// the keys it sees, causal and, for a sliding-window layer, within the window.
//
// torch's SDPA (its CPU flash kernel) ran SmolLM2's attention at ~62 G multiply-adds/s over an 1800-token prompt on
// 2 Zen 4 cores (the FMA units' peak is ~116; a third of the prefill), and at ~27 over 128 tokens. Here a task is one kv
// head's G query heads at kPositions positions (G * kPositions rows, each key and value loaded once for all of
// them) over blocks of kKeys keys, flash-attention style: a block's scores of 4 rows x 64 keys in 16 registers,
// their softmax (running maximum and sum) applied in those registers, then the block's weighted values added to
// the rows' outputs, 4 rows x 64 dims in 16 registers. Keys are packed transposed once a kv head (scores read
// 64 keys of one dim in 4 loads); blocks above the diagonal or before a window are never read. Tasks go to
// threads by an atomic counter, the costliest (the last positions) first. The same heads: 1.6x SDPA's rate at 128
// tokens, 1.8x at 512, 1.2x at 1800 (~75 G multiply-adds/s); SmolLM2's whole prefill 1.25x as fast at 1800 tokens,
// Gemma 3 270M's 1.09x (BENCHMARKS.md).
//
// Shape legend: B batch, T query positions, S keys (the queries are positions S - T .. S - 1), H query heads, K kv
// heads (H a multiple), G = H / K, D head dim (a multiple of 16).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_attention.h"
#include "library.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
#define EMBER_PROMPT_ATTENTION 1

constexpr int kKeys = 64;       // keys a block: a row's scores are 4 vectors
constexpr int kPositions = 16;  // query positions a task (its rows: G heads each)
constexpr int kRows = 4;        // rows a pass of either product

// `ember::exp_nonpositive` of 16 scores (each minus its row's maximum) at once: the same series.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(ember::kExp2Series[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ember::kExp2Series[i]));
  return _mm512_scalef_ps(p, n);
}

// Keeps each vector in a register from here: a load the compiler would otherwise fold into each FMA that uses it
// (4 rows, 4 loads of one vector) makes the loops bound by loads (one 512-bit load a cycle on a Zen 4).
inline void in_register(__m512& v) { asm volatile("" : "+v"(v)); }
template <typename... V>
inline void in_register(__m512& v, V&... rest) {
  in_register(v);
  in_register(rest...);
}

using ember::first_visible;

// One task's rows (r = i G + h: position i of the task, head h of the group), their running state.
struct Rows {
  int64_t n;           // rows in use (G * positions), a multiple of kRows allocated
  int64_t D;
  float* q;            // rows x D, scaled by the softmax scale
  float* o;            // rows x D, unnormalized outputs
  float* m;            // each row's largest score so far (-inf: none yet)
  float* l;            // each row's sum of exp(score - m)
  float* p;            // rows x kKeys: the block's exp(score - m)
  float* correction;   // each row's exp(old m - new m) for the block
  const int64_t* pos;  // each row's position
  const int64_t* lo;   // each row's first visible key
};

// Row `row`'s scores of a block of keys from j0 (s0..s3: 64 keys), masked to the keys it sees where `kMasked`,
// folded into its running softmax: p (the block's exp(score - m)), m, l, correction.
template <bool kMasked>
inline void fold_row(Rows& rows, int64_t row, int64_t j0, int64_t keys, __m512 s0, __m512 s1, __m512 s2, __m512 s3) {
  __mmask16 seen0 = 0xFFFF, seen1 = 0xFFFF, seen2 = 0xFFFF, seen3 = 0xFFFF;
  if constexpr (kMasked) {  // keys lo..pos of the row, and of the block
    const int64_t first = std::max<int64_t>(rows.lo[row] - j0, 0);
    const int64_t last = std::min<int64_t>(rows.pos[row] - j0, keys - 1);
    const __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i f = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(first, kKeys)));
    const __m512i l = _mm512_set1_epi32(static_cast<int32_t>(std::max<int64_t>(last, -1)));
    const auto seen = [&](int v) {
      const __m512i jv = _mm512_add_epi32(j, _mm512_set1_epi32(16 * v));
      return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(jv, f) & _mm512_cmple_epi32_mask(jv, l));
    };
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    seen0 = seen(0), seen1 = seen(1), seen2 = seen(2), seen3 = seen(3);
    s0 = _mm512_mask_blend_ps(seen0, minus_inf, s0);
    s1 = _mm512_mask_blend_ps(seen1, minus_inf, s1);
    s2 = _mm512_mask_blend_ps(seen2, minus_inf, s2);
    s3 = _mm512_mask_blend_ps(seen3, minus_inf, s3);
  }
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s0, s1), _mm512_max_ps(s2, s3)));
  const float old = rows.m[row], mx = std::max(old, block_max);
  float* p = rows.p + row * kKeys;
  if (mx == -INFINITY) {  // nothing seen yet, nor in this block
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(p + 16 * v, _mm512_setzero_ps());
    rows.correction[row] = 1.f;
    return;
  }
  const __m512 m = _mm512_set1_ps(mx);
  const __m512 e0 = _mm512_maskz_mov_ps(seen0, exp_nonpositive(_mm512_sub_ps(s0, m)));
  const __m512 e1 = _mm512_maskz_mov_ps(seen1, exp_nonpositive(_mm512_sub_ps(s1, m)));
  const __m512 e2 = _mm512_maskz_mov_ps(seen2, exp_nonpositive(_mm512_sub_ps(s2, m)));
  const __m512 e3 = _mm512_maskz_mov_ps(seen3, exp_nonpositive(_mm512_sub_ps(s3, m)));
  _mm512_storeu_ps(p, e0);
  _mm512_storeu_ps(p + 16, e1);
  _mm512_storeu_ps(p + 32, e2);
  _mm512_storeu_ps(p + 48, e3);
  const float c = old == -INFINITY ? 0.f : std::exp(old - mx);
  rows.correction[row] = c;
  rows.m[row] = mx;
  rows.l[row] = rows.l[row] * c + _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3)));
}

// Scores of rows r0..r0+3 against the block of keys from j0 (kt: D rows of the keys' dims, `stride` floats apart),
// masked to each row's visible keys where `masked`, folded into the rows' running softmax: p, m, l, correction.
template <bool kMasked>
void score_block(Rows& rows, int64_t r0, const float* kt, int64_t stride, int64_t j0, int64_t keys) {
  __m512 s[kRows][4];
  for (auto& row : s)
    for (auto& v : row) v = _mm512_setzero_ps();
  const float* q = rows.q + r0 * rows.D;
  for (int64_t d = 0; d < rows.D; ++d) {
    const float* k = kt + d * stride;
    __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
           k3 = _mm512_loadu_ps(k + 48);
    in_register(k0, k1, k2, k3);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 qr = _mm512_set1_ps(q[r * rows.D + d]);
      s[r][0] = _mm512_fmadd_ps(qr, k0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(qr, k1, s[r][1]);
      s[r][2] = _mm512_fmadd_ps(qr, k2, s[r][2]);
      s[r][3] = _mm512_fmadd_ps(qr, k3, s[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
    if (r0 + r < rows.n) fold_row<kMasked>(rows, r0 + r, j0, keys, s[r][0], s[r][1], s[r][2], s[r][3]);
}

// o[r] = o[r] * correction[r] + sum_j p[r][j] v[j] for rows r0..r0+3, keys j_first.. of the block (those before
// it none of the rows sees, and may hold anything) and the dims d0..d0+63 (or the last 16s).
template <int kDims>
void weigh_block(Rows& rows, int64_t r0, const float* v, int64_t v_stride, int64_t j_first, int64_t keys, int64_t d0) {
  __m512 a[kRows][kDims];
  for (int r = 0; r < kRows; ++r) {
    const __m512 c = _mm512_set1_ps(rows.correction[r0 + r]);
    for (int x = 0; x < kDims; ++x)
      a[r][x] = _mm512_mul_ps(_mm512_loadu_ps(rows.o + (r0 + r) * rows.D + d0 + 16 * x), c);
  }
  const float* p = rows.p + r0 * kKeys;
  for (int64_t j = j_first; j < keys; ++j) {
    const float* vj = v + j * v_stride + d0;
    __m512 vx[kDims];
    for (int x = 0; x < kDims; ++x) {
      vx[x] = _mm512_loadu_ps(vj + 16 * x);
      in_register(vx[x]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeys + j]);
      for (int x = 0; x < kDims; ++x) a[r][x] = _mm512_fmadd_ps(pr, vx[x], a[r][x]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int x = 0; x < kDims; ++x) _mm512_storeu_ps(rows.o + (r0 + r) * rows.D + d0 + 16 * x, a[r][x]);
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "prompt_attention: q, k, v must be (B, heads, T or S, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prompt_attention: float32 q, k and v");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), K = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == K && v.size(2) == S && k.size(3) == D && v.size(3) == D,
              "prompt_attention: k and v must be (B, K, S, D) for q (B, H, T, D)");
  TORCH_CHECK(K > 0 && H % K == 0 && D % 16 == 0 && S >= T, "prompt_attention: H a multiple of K, D of 16, S >= T");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prompt_attention: each head's D contiguous");
  const int64_t G = H / K, start = S - T, S_pad = (S + kKeys - 1) / kKeys * kKeys;
  // The output as (B, T, H, D) in memory: the layer reshapes it to (B, T, H * D) for its output projection.
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Each kv head's keys a block of kKeys at a time, transposed (D rows of kKeys keys, zeros past S), and its values
  // (S rows of D): one contiguous piece a block, whatever the strides of k and v.
  std::vector<float> kt(B * K * D * S_pad, 0.f), vs(B * K * S * D, 0.f);
  at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / K, g = bg % K;
      float* t = kt.data() + bg * D * S_pad;
      for (int64_t j = first_visible(start, window); j < S; ++j) {  // none before the first query's window
        const float* kj = kp + b * k.stride(0) + g * k.stride(1) + j * k.stride(2);
        float* tj = t + j / kKeys * D * kKeys + j % kKeys;
        for (int64_t d = 0; d < D; ++d) tj[d * kKeys] = kj[d];
        const float* vj = vp + b * v.stride(0) + g * v.stride(1) + j * v.stride(2);
        std::copy(vj, vj + D, vs.data() + (bg * S + j) * D);
      }
    }
  });
  const int64_t blocks = (T + kPositions - 1) / kPositions, tasks = B * K * blocks;
  std::atomic<int64_t> next{0};
  const int64_t rows_cap = (G * kPositions + kRows - 1) / kRows * kRows;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q_rows(rows_cap * D), o_rows(rows_cap * D), m(rows_cap), l(rows_cap), p(rows_cap * kKeys),
        correction(rows_cap);
    std::vector<int64_t> pos(rows_cap), lo(rows_cap);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      // the last positions first: they see the most keys
      const int64_t block = blocks - 1 - task / (B * K), b = (task % (B * K)) / K, g = task % K;
      const int64_t i0 = block * kPositions, positions = std::min<int64_t>(kPositions, T - i0);
      Rows rows{G * positions, D, q_rows.data(), o_rows.data(), m.data(), l.data(), p.data(), correction.data(),
                pos.data(), lo.data()};
      std::fill(q_rows.begin(), q_rows.end(), 0.f);
      std::fill(o_rows.begin(), o_rows.end(), 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t h = 0; h < G; ++h) {
          const int64_t r = i * G + h;
          const float* qr = qp + b * q.stride(0) + (g * G + h) * q.stride(1) + (i0 + i) * q.stride(2);
          for (int64_t d = 0; d < D; ++d) q_rows[r * D + d] = qr[d] * static_cast<float>(scale);
          pos[r] = start + i0 + i;
          lo[r] = first_visible(pos[r], window);
        }
      for (int64_t r = rows.n; r < rows_cap; ++r) pos[r] = -1, lo[r] = 0;  // padding rows: see nothing
      const int64_t first = start + i0, last = first + positions - 1;
      const int64_t lo_all = first_visible(first, window), lo_last = first_visible(last, window);
      const float* t = kt.data() + (b * K + g) * D * S_pad;
      const float* vg = vs.data() + (b * K + g) * S * D;
      for (int64_t j0 = lo_all / kKeys * kKeys; j0 <= last; j0 += kKeys) {
        const int64_t keys = std::min<int64_t>(kKeys, S - j0);
        // every row sees every key of the block: none past the first row's position, none before the last
        // row's window
        const bool whole = j0 + kKeys - 1 <= first && j0 >= lo_last && keys == kKeys;
        const int64_t j_first = std::max<int64_t>(lo_all - j0, 0);
        for (int64_t r0 = 0; r0 < rows.n; r0 += kRows) {
          if (whole)
            score_block<false>(rows, r0, t + j0 * D, kKeys, j0, keys);
          else
            score_block<true>(rows, r0, t + j0 * D, kKeys, j0, keys);
        }
        for (int64_t r0 = 0; r0 < rows.n; r0 += kRows) {
          int64_t d0 = 0;
          for (; d0 + 64 <= D; d0 += 64) weigh_block<4>(rows, r0, vg + j0 * D, D, j_first, keys, d0);
          for (; d0 < D; d0 += 16) weigh_block<1>(rows, r0, vg + j0 * D, D, j_first, keys, d0);
        }
      }
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t h = 0; h < G; ++h) {
          const int64_t r = i * G + h;
          float* dst = op + ((b * T + i0 + i) * H + g * G + h) * D;
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) dst[d] = o_rows[r * D + d] * inv;
        }
    }
  });
  return out.transpose(1, 2);  // (B, H, T, D)
}
#endif

}  // namespace

#if defined(EMBER_PROMPT_ATTENTION)
EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale, int window) -> Tensor");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
#endif
