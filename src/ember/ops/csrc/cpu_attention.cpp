// Decode attention on a CPU: one query token per row over a static or a paged KV cache, reading only the slots
// the row sees (0..p, or the last `window` of them), in float32 whatever the cache's dtype.
//
// The graph's version (ember.ops.attention.grouped_decode_attention) multiplies every slot of the cache behind
// a mask with two batched matmuls: on SmolLM2's 2-core decode step that was ~1.3 ms of ~4.5 (bmm calls of
// ~18 us on (3 x 3, 64) x (64, S) operands). Here a task is one kv head's G query heads over a run of at most
// kRunSlots of its slots: their scores in a buffer, a softmax with an exp of our own that the compiler
// vectorizes (a call to expf per slot cost more than the matmuls), and the weighted sums of the values, each key
// and value read once for the G heads. A row's runs are then merged (their maxima, sums and outputs, as flash
// decoding merges), so a few kv heads still make enough tasks for every thread; and small work runs on the
// calling thread alone (`kParallelWork`). With float32 caches and AVX-512, the scores of 16 slots are summed as
// 16 vectors reduced together and the weighted sums of up to 4 heads share each loaded value. Where each query
// head was a task (reading its kv head's slots once a head, 9 tasks for SmolLM2's 3 kv heads), SmolLM2's eager
// decode at positions 1800-1864 ran 109-114 tok/s on a 2-core Zen 4; now 134-135 (BENCHMARKS.md).
//
// Shape legend: B rows, H query heads, K kv heads (H a multiple), S cache slots, D head dim.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_attention.h"
#include "library.h"

namespace {

constexpr int kLanes = 16;  // independent partial sums: one AVX-512 register, two AVX2 ones

using ember::exp_nonpositive;
using ember::first_visible;

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float acc[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += q[d + l] * static_cast<float>(k[d + l]);
  for (; d < D; ++d) acc[0] += q[d] * static_cast<float>(k[d]);
  // A tree: summed in order, the 16 lanes were 16 dependent adds (the compiler may not reorder them), the
  // largest cost of a score.
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

// Where a head's slot j lies: a static cache's slots are consecutive rows (`Consecutive`), a paged cache's are
// wherever a block table puts them (`Indexed`); either way as an offset into the cache tensor.
struct Consecutive {
  int64_t first, stride;
  int64_t operator()(int64_t j) const { return (first + j) * stride; }
};
struct Indexed {
  const int64_t* slots;  // the head's first visible slot onwards
  int64_t stride;
  int64_t operator()(int64_t j) const { return slots[j] * stride; }
};

// out (D) = scale * sum_j w[j] * v[row(j)] over n rows.
template <typename T, typename Rows>
void weighted_sum(const float* w, const T* v, Rows row, int64_t n, int64_t D, float scale, float* out) {
  std::fill(out, out + D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + row(j);
    for (int64_t d = 0; d < D; ++d) out[d] += w[j] * static_cast<float>(vj[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] *= scale;
}

// s[g * n + j] = scale * (q_g . k[row(j)]) for each of the G query heads (q: G rows of D) and n slots.
template <typename T, typename Rows>
void scores_of(const float* q, const T* k, Rows row, int64_t n, int64_t D, int64_t G, float scale, float* s) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; ++j) s[g * n + j] = dot(q + g * D, k + row(j), D) * scale;
}

// acc (G rows of D) = sum_j w[g * n + j] * v[row(j)] for each head g.
template <typename T, typename Rows>
void weighted_sums(const float* w, const T* v, Rows row, int64_t n, int64_t D, int64_t G, float* acc) {
  for (int64_t g = 0; g < G; ++g) weighted_sum(w + g * n, v, row, n, D, 1.f, acc + g * D);
}

#if defined(__AVX512F__)
#include <immintrin.h>
// float32 caches, D a multiple of 64: 64 sums at a time in registers (the generic loop kept them in memory,
// a store and a load per row).
template <typename Rows>
void weighted_sum(const float* w, const float* v, Rows row, int64_t n, int64_t D, float scale, float* out) {
  if (D % (4 * kLanes)) {
    std::fill(out, out + D, 0.f);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) out[d] += w[j] * v[row(j) + d];
    for (int64_t d = 0; d < D; ++d) out[d] *= scale;
    return;
  }
  for (int64_t d = 0; d < D; d += 4 * kLanes) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + row(j) + d;
      const __m512 wj = _mm512_set1_ps(w[j]);
      a0 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj), a0);
      a1 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + kLanes), a1);
      a2 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + 2 * kLanes), a2);
      a3 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + 3 * kLanes), a3);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(a0, sc));
    _mm512_storeu_ps(out + d + kLanes, _mm512_mul_ps(a1, sc));
    _mm512_storeu_ps(out + d + 2 * kLanes, _mm512_mul_ps(a2, sc));
    _mm512_storeu_ps(out + d + 3 * kLanes, _mm512_mul_ps(a3, sc));
  }
}

template <>
inline float dot<float>(const float* q, const float* k, int64_t D) {
  if (D % kLanes) {
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += q[d] * k[d];
    return sum;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  return _mm512_reduce_add_ps(acc);
}

// The 16 sums of vectors a[0..15] (each a's 16 lanes added), in order: pairs of vectors, then of those, folded
// lane into lane, ~2 instructions a sum where a horizontal sum each took ~8.
inline __m512 sum16(const __m512* a) {
  __m512 r[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i + 1]
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: vectors 4i..4i+3's partial sums
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes 0 + 2 and 1 + 3 of w[2i], then of w[2i + 1]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// float32 keys, D a multiple of 16: 16 slots at a time, each head's 16 dot products summed by `sum16`.
template <typename Rows>
void scores_of(const float* q, const float* k, Rows row, int64_t n, int64_t D, int64_t G, float scale, float* s) {
  if (D % kLanes) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < n; ++j) s[g * n + j] = dot(q + g * D, k + row(j), D) * scale;
    return;
  }
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + kLanes <= n; j0 += kLanes) {
    const float* kj[kLanes];
    for (int i = 0; i < kLanes; ++i) kj[i] = k + row(j0 + i);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 a[kLanes];
      for (int i = 0; i < kLanes; ++i) a[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += kLanes) {
        const __m512 qd = _mm512_loadu_ps(qg + d);
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) a[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kj[i] + d), a[i]);
      }
      _mm512_storeu_ps(s + g * n + j0, _mm512_mul_ps(sum16(a), sc));
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = j0; j < n; ++j) s[g * n + j] = dot(q + g * D, k + row(j), D) * scale;
}

// NG heads' sums of DC vectors of D from d0, each value's vectors loaded once for the NG heads.
template <int NG, int DC, typename Rows>
void weighted_block(const float* w, const float* v, Rows row, int64_t n, int64_t d0, int64_t D, float* acc) {
  __m512 a[NG][DC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + row(j) + d0;
    __m512 x[DC];
    for (int c = 0; c < DC; ++c) x[c] = _mm512_loadu_ps(vj + c * kLanes);
    for (int g = 0; g < NG; ++g) {
      const __m512 wj = _mm512_set1_ps(w[g * n + j]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(wj, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * D + d0 + c * kLanes, a[g][c]);
}

template <int DC, typename Rows>
void weighted_heads(const float* w, const float* v, Rows row, int64_t n, int64_t d0, int64_t D, int64_t G,
                    float* acc) {
  for (int64_t g = 0; g < G; g += 4) {
    const float* wg = w + g * n;
    float* ag = acc + g * D;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: weighted_block<4, DC>(wg, v, row, n, d0, D, ag); break;
      case 3: weighted_block<3, DC>(wg, v, row, n, d0, D, ag); break;
      case 2: weighted_block<2, DC>(wg, v, row, n, d0, D, ag); break;
      default: weighted_block<1, DC>(wg, v, row, n, d0, D, ag);
    }
  }
}

// float32 values, D a multiple of 16: up to 4 heads x 64 dims of sums in registers a pass.
template <typename Rows>
void weighted_sums(const float* w, const float* v, Rows row, int64_t n, int64_t D, int64_t G, float* acc) {
  if (D % kLanes) {
    for (int64_t g = 0; g < G; ++g) weighted_sum(w + g * n, v, row, n, D, 1.f, acc + g * D);
    return;
  }
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) weighted_heads<4>(w, v, row, n, d0, D, G, acc);
  for (; d0 < D; d0 += kLanes) weighted_heads<1>(w, v, row, n, d0, D, G, acc);
}
#endif

// The largest of x[0..n) (-inf for none), in kLanes independent lanes: one running maximum was a chain of
// dependent instructions, a quarter of the attention's time.
inline float largest(const float* x, int64_t n) {
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], x[j + l]);
  for (; j < n; ++j) lane[0] = std::max(lane[0], x[j]);
  return *std::max_element(lane, lane + kLanes);
}

// x[j] = exp(x[j] - mx) for j < n (each at most mx), and their sum, in kLanes lanes added as a tree.
inline float exp_sum(float* x, int64_t n, float mx) {
  float lane[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[j + l] = exp_nonpositive(x[j + l] - mx);
      lane[l] += x[j + l];
    }
  for (; j < n; ++j) {
    x[j] = exp_nonpositive(x[j] - mx);
    lane[0] += x[j];
  }
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

// Below this many multiply-adds of a kind (scores, or weighted sums) the tasks run on the calling thread: a
// parallel region's start and end (~3-4 us on 2 threads) cost more than a second thread saves (2-core Zen 4:
// even at ~110K, one thread faster below).
constexpr int64_t kParallelWork = 128 * 1024;

// Slots a task takes at most: a row's visible slots are split into runs of this many, merged at the end
// (fixed, not from the thread count: the same sums on any machine).
constexpr int64_t kRunSlots = 128;

// A kv head's G query heads (q: G rows of D) over its n slots (slot j's key at k + row(j), value at v + row(j)):
// each head's largest score m[g], the sum l[g] of exp(score - m[g]), and acc (G rows of D) the sum of exp(score
// - m[g]) v; n = 0 leaves m = -inf, l = 0 and acc 0. s: G * n floats of scratch.
template <typename T, typename Rows>
void attend_run(const float* q, const T* k, const T* v, Rows row, int64_t n, int64_t D, int64_t G, float scale,
                float* s, float* m, float* l, float* acc) {
  scores_of(q, k, row, n, D, G, scale, s);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
    m[g] = largest(sg, n);
    l[g] = exp_sum(sg, n, m[g]);
  }
  if (n == 0) {
    std::fill(acc, acc + G * D, 0.f);
    return;
  }
  weighted_sums(s, v, row, n, D, G, acc);
}


// Every row's attention, q (B, H, D) -> (B, H, D) in q's dtype: K kv heads, each serving G = H / K query heads;
// row b sees `visible(b)` slots. Tasks (row, kv head, run of kRunSlots) on torch's threads, each calling
// run(kv dtype tag, b, kv head, first slot of the run, slots, q rows, m, l, acc, scratch) (`attend_run`'s
// outputs); then each row's runs merged.
template <typename Visible, typename Run>
at::Tensor each_group(const at::Tensor& q, at::ScalarType kv_dtype, int64_t K, Visible visible, Run run) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), G = H / K;
  const auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty({B, H, D}, qf.options());
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t runs = 1, work = 0;
  for (int64_t b = 0; b < B; ++b) {
    runs = std::max(runs, (visible(b) + kRunSlots - 1) / kRunSlots);
    work += H * D * visible(b);
  }
  // Each task's (m, l) of G heads, then its acc of G x D.
  const int64_t per = G * (D + 2);
  std::vector<float> parts(B * K * runs * per);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_dtype, "decode_attention", [&] {
    at::parallel_for(0, B * K * runs, work < kParallelWork ? B * K * runs : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(G * kRunSlots);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / (K * runs), g = (t / runs) % K, r = t % runs;
        const int64_t lo = std::min(r * kRunSlots, visible(b)), n = std::min(kRunSlots, visible(b) - lo);
        float* part = parts.data() + t * per;
        run(scalar_t{}, b, g, lo, n, qp + (b * H + g * G) * D, part, part + G, part + 2 * G, scratch.data());
      }
    });
  });
  // One run: acc / l, as the sums stand. More: each run's sums scaled to the row's largest score first.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < K; ++g) {
      const float* first = parts.data() + (b * K + g) * runs * per;
      for (int64_t h = 0; h < G; ++h) {
        float* o = op + (b * H + g * G + h) * D;
        if (runs == 1) {
          const float inv = 1.f / first[G + h];
          for (int64_t d = 0; d < D; ++d) o[d] = first[2 * G + h * D + d] * inv;
          continue;
        }
        float mx = -INFINITY;
        for (int64_t r = 0; r < runs; ++r) mx = std::max(mx, first[r * per + h]);
        float sum = 0.f;
        std::fill(o, o + D, 0.f);
        for (int64_t r = 0; r < runs; ++r) {
          const float* part = first + r * per;
          if (part[G + h] == 0.f) continue;  // a run the row does not reach
          const float f = exp_nonpositive(part[h] - mx);
          sum += part[G + h] * f;
          for (int64_t d = 0; d < D; ++d) o[d] += part[2 * G + h * D + d] * f;
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  return out.to(q.scalar_type());
}

// q (B, H, D), caches (B, K, S, D) already holding this step's keys and values, positions (B,) int64 ->
// (B, H, D) in q's dtype. Row b's query at position p sees slots 0..p, and with window > 0 only the last
// `window` of them (p - window < slot).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& positions, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q (B, H, D) and caches (B, K, S, D), got ", q.sizes(), ", ", k_cache.sizes(), ", ",
              v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), K = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) >= B && k_cache.size(3) == D && K > 0 && H % K == 0,
              "q ", q.sizes(), " does not match caches ", k_cache.sizes());
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the caches must share one layout with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == B, "positions must be (B,) int64");
  const auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pp[b] >= 0 && pp[b] < S, "position ", pp[b], " is outside the cache's ", S, " slots");
  const int64_t sb = k_cache.stride(0), sk = k_cache.stride(1), ss = k_cache.stride(2);
  auto visible = [&](int64_t b) { return pp[b] - first_visible(pp[b], window) + 1; };
  return each_group(q, k_cache.scalar_type(), K, visible,
                    [&](auto tag, int64_t b, int64_t g, int64_t lo, int64_t n, const float* qg, float* m, float* l,
                        float* acc, float* scratch) {
                      using T = decltype(tag);
                      const int64_t offset = b * sb + g * sk, first = first_visible(pp[b], window) + lo;
                      attend_run(qg, static_cast<const T*>(k_cache.const_data_ptr()) + offset,
                                 static_cast<const T*>(v_cache.const_data_ptr()) + offset, Consecutive{first, ss},
                                 n, D, H / K, static_cast<float>(scale), scratch, m, l, acc);
                    });
}

// Rows of a prompt a thread ropes (or writes to a cache) at least.
constexpr int64_t kRopeRows = 16;

// x (N, D) rows of one token: the first Dr dims rotated at cos, sin (Dr,) with the half-split convention, as
// `ember.ops.rope.apply_rope` computes it in T: cos and sin rounded to T, each product and the sum rounded to
// T (the products kept apart: a fused multiply-add would round once where torch rounds twice).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_row(const T* __restrict__ x, const float* __restrict__ cos,
                                                             const float* __restrict__ sin, int64_t N, int64_t D,
                                                             int64_t Dr, T* __restrict__ out) {
  const int64_t half = Dr / 2;
  auto r = [](float v) { return static_cast<float>(static_cast<T>(v)); };
  for (int64_t n = 0; n < N; ++n) {
    const T* xi = x + n * D;
    T* oi = out + n * D;
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = static_cast<float>(xi[d]), x2 = static_cast<float>(xi[d + half]);
      const float a = r(x1 * r(cos[d])), b = r(-x2 * r(sin[d]));
      const float c = r(x2 * r(cos[d + half])), e = r(x1 * r(sin[d + half]));
      oi[d] = static_cast<T>(a + b);
      oi[d + half] = static_cast<T>(c + e);
    }
    for (int64_t d = Dr; d < D; ++d) oi[d] = xi[d];
  }
}

// q (M, H, D) and k (M, K, D), one token a row, roped at that row's cos, sin (M, Dr); v (M, K, D) only checked
// against them. -> (q roped, k roped), contiguous.
std::pair<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "expected q (M, H, D), k and v (M, K, D) of one dtype, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t M = q.size(0), H = q.size(1), D = q.size(2), K = k.size(1), Dr = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == M && sin.sizes() == cos.sizes() && Dr % 2 == 0 && Dr <= D,
              "cos and sin must be (M, Dr), Dr even and at most ", D, ", got ", cos.sizes());
  const auto cf = cos.to(at::kFloat).contiguous(), sf = sin.to(at::kFloat).contiguous();
  const auto qc = q.contiguous(), kc = k.contiguous();
  auto q_roped = at::empty_like(qc), k_roped = at::empty_like(kc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_qk", [&] {
    at::parallel_for(0, M, kRopeRows, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const float* cm = cf.data_ptr<float>() + m * Dr;
        const float* sm = sf.data_ptr<float>() + m * Dr;
        rope_row<scalar_t>(qc.data_ptr<scalar_t>() + m * H * D, cm, sm, H, D, Dr,
                           q_roped.data_ptr<scalar_t>() + m * H * D);
        rope_row<scalar_t>(kc.data_ptr<scalar_t>() + m * K * D, cm, sm, K, D, Dr,
                           k_roped.data_ptr<scalar_t>() + m * K * D);
      }
    });
  });
  return {q_roped, k_roped};
}

// Rows of rows `rows` (M, K, D) written to a static cache (B', K, S, D) at [b, :, positions[b, t]] for row m = b T
// + t, converted to the cache's dtype as index_put converts: positions (B, T) int64, checked against its slots.
void write_rows(const at::Tensor& rows, at::Tensor cache, const at::Tensor& positions) {
  const int64_t B = positions.size(0), T = positions.size(1), K = rows.size(1), D = rows.size(2);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cache.size(2), "position ", pp[i], " is outside the cache's ", cache.size(2),
                " slots");
  if (cache.scalar_type() != rows.scalar_type() || cache.stride(3) != 1) {
    using at::indexing::Slice;
    const auto slots = at::arange(B, positions.options()).unsqueeze(1).expand({B, T});
    cache.index_put_({slots, Slice(), positions}, rows.view({B, T, K, D}).to(cache.scalar_type()));
    return;
  }
  const int64_t size = cache.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(rows.const_data_ptr());
  at::parallel_for(0, B * T, kRopeRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < K; ++g)
        std::memcpy(dst + ((i / T) * cache.stride(0) + g * cache.stride(1) + pp[i] * cache.stride(2)) * size,
                    src + (i * K + g) * D * size, D * size);
  });
}

// A prompt's rows on a static cache, for eager steps: q (B, T, H, D) and k (B, T, K, D) roped at cos, sin (B, T,
// Dr), k roped and v (B, T, K, D) written to the caches (B', K, S, D) at positions (B, T) -> (q roped, k roped),
// contiguous. What `apply_rope_qk` and the cache's index_put writes compute, in one call: SmolLM2's eager prefill
// 1.08-1.09x as fast at 128 tokens, 1.05x at 1800 (2 Zen 4 cores; `kv_cache.PROMPT_ROPE_KERNEL` alternated).
std::tuple<at::Tensor, at::Tensor> rope_prompt_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cos, const at::Tensor& sin,
                                                     at::Tensor k_cache, at::Tensor v_cache,
                                                     const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && cos.dim() == 3 && positions.dim() == 2,
              "expected q (B, T, H, D), k and v (B, T, K, D), cos and sin (B, T, Dr), positions (B, T), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", cos.sizes(), ", ", positions.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), K = k.size(2);
  TORCH_CHECK(positions.size(0) == B && positions.size(1) == T && positions.scalar_type() == at::kLong,
              "positions must be (B, T) int64");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) >= B && k_cache.size(1) == K && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches ", k_cache.sizes(), " do not match k ", k.sizes());
  auto [q_roped, k_roped] = rope_qk(q.reshape({B * T, H, D}), k.reshape({B * T, K, D}), v.reshape({B * T, K, D}),
                                    cos.reshape({B * T, cos.size(2)}), sin.reshape({B * T, sin.size(2)}));
  const auto pos = positions.contiguous();
  write_rows(k_roped, k_cache, pos);
  write_rows(v.reshape({B * T, K, D}).contiguous(), v_cache, pos);
  return {q_roped.view({B, T, H, D}), k_roped.view({B, T, K, D})};
}

// One decode step of a layer on a static cache, all in one call (an eager step ran ~20 aten ops for the rope
// and the cache writes): q (B, H, D) and k (B, K, D) roped at cos, sin (B, Dr), k and v (B, K, D) written to
// the caches (B', K, S, D) at slot positions[b], then `decode_attention` of the roped q. q, k, v of one dtype.
at::Tensor rope_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                 at::Tensor v_cache, const at::Tensor& positions, double scale, int64_t window) {
  auto [q_roped, k_roped] = rope_qk(q, k, v, cos, sin);
  const int64_t B = q.size(0), D = q.size(2), K = k.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) >= B && k_cache.size(1) == K && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches ", k_cache.sizes(), " do not match k ", k.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == B, "positions must be (B,) int64");
  const auto pos = positions.contiguous();
  write_rows(k_roped, k_cache, pos.view({B, 1}));
  write_rows(v.contiguous(), v_cache, pos.view({B, 1}));
  return decode_attention(q_roped, k_cache, v_cache, pos, scale, window);
}

// A paged cache's step, for eager steps: q (N, H, D) and k (N, K, D) roped at cos, sin (N, Dr) (each token its
// own), k and v written to the pools (slots, K, D) at slot_mapping (N,) -> q roped (N, H, D). What
// `apply_rope_qk` and the pool writes compute, in one call.
at::Tensor rope_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slot_mapping) {
  auto [q_roped, k_roped] = rope_qk(q, k, v, cos, sin);
  const int64_t N = q.size(0), D = q.size(2), K = k.size(1);
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.size(1) == K && k_pool.size(2) == D && v_pool.sizes() == k_pool.sizes(),
              "pools ", k_pool.sizes(), " do not match k ", k.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == N, "slot_mapping must be (N,) int64");
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(sp[n] >= 0 && sp[n] < k_pool.size(0), "slot ", sp[n], " is outside the pool's ", k_pool.size(0));
  k_pool.index_put_({slots}, k_roped.to(k_pool.scalar_type()));
  v_pool.index_put_({slots}, v.to(v_pool.scalar_type()));
  return q_roped;
}

// q (B, H, D), pools (slots, K, D) already holding this step's keys and values, slots (B, S) int64 (row b's
// token j lies in pool slot slots[b, j]), positions (B,) int64 -> (B, H, D) in q's dtype: decode_attention
// over a paged cache, reading each row's visible slots where its block table puts them.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& positions, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && slots.dim() == 2,
              "expected q (B, H, D), pools (slots, K, D) and slots (B, S), got ", q.sizes(), ", ", k_pool.sizes(),
              ", ", v_pool.sizes(), ", ", slots.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), K = k_pool.size(1), S = slots.size(1);
  TORCH_CHECK(slots.size(0) == B && k_pool.size(2) == D && K > 0 && H % K == 0,
              "q ", q.sizes(), " does not match pools ", k_pool.sizes(), " and slots ", slots.sizes());
  TORCH_CHECK(k_pool.stride(2) == 1 && k_pool.strides() == v_pool.strides() &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "the pools must share one layout with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && positions.numel() == B,
              "slots and positions must be int64");
  const auto pos = positions.contiguous();
  const auto table = slots.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t pool_slots = k_pool.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pp[b] >= 0 && pp[b] < S, "position ", pp[b], " is outside the table's ", S, " slots");
    for (int64_t j = first_visible(pp[b], window); j <= pp[b]; ++j)
      TORCH_CHECK(tp[b * S + j] >= 0 && tp[b * S + j] < pool_slots, "slot ", tp[b * S + j], " of row ", b,
                  " is outside the pool's ", pool_slots);
  }
  const int64_t ss = k_pool.stride(0), sk = k_pool.stride(1);
  auto visible = [&](int64_t b) { return pp[b] - first_visible(pp[b], window) + 1; };
  return each_group(q, k_pool.scalar_type(), K, visible,
                    [&](auto tag, int64_t b, int64_t g, int64_t lo, int64_t n, const float* qg, float* m, float* l,
                        float* acc, float* scratch) {
                      using T = decltype(tag);
                      const int64_t first = first_visible(pp[b], window) + lo;
                      attend_run(qg, static_cast<const T*>(k_pool.const_data_ptr()) + g * sk,
                                 static_cast<const T*>(v_pool.const_data_ptr()) + g * sk,
                                 Indexed{tp + b * S + first, ss}, n, D, H / K, static_cast<float>(scale), scratch,
                                 m, l, acc);
                    });
}

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, int window)"
        " -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor positions, "
        "float scale, int window) -> Tensor");
  m.def("rope_decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions, float scale, int window) -> Tensor");
  m.def("rope_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor slot_mapping) -> Tensor");
  m.def("rope_prompt_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions) -> (Tensor, Tensor)");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_decode_attention", &rope_decode_attention);
  m.impl("rope_write", &rope_write);
  m.impl("rope_prompt_write", &rope_prompt_write);
}
