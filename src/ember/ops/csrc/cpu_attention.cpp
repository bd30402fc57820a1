// Decode attention on a CPU: one query token per row over a static or a paged KV cache, reading only the slots
// the row sees (0..p, or the last `window` of them), in float32 whatever the cache's dtype.
//
// The graph's version (ember.ops.attention.grouped_decode_attention) multiplies every slot of the cache behind
// a mask with two batched matmuls: on SmolLM2's 2-core decode step that was ~1.3 ms of ~4.5 (bmm calls of
// ~18 us on (3 x 3, 64) x (64, S) operands). Here each query head is one task: its scores in a buffer, a
// softmax with an exp of our own that the compiler vectorizes (a call to expf per slot cost more than the
// matmuls), and the weighted sum of the values.
//
// Shape legend: B rows, H query heads, K kv heads (H a multiple), S cache slots, D head dim.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "library.h"

namespace {

constexpr int kLanes = 16;  // independent partial sums: one AVX-512 register, two AVX2 ones

// exp(x) for x <= 0 (a score minus the row's max), to ~1e-7 relative: 2^(x log2 e) as 2^n * 2^f with
// f in [-0.5, 0.5], 2^f by its Taylor series to degree 7 (error < 1e-8), 2^n put into the exponent bits.
// Written as plain arithmetic so that a loop of it vectorizes.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.525273e-05f;
  p = p * f + 1.540353e-04f;
  p = p * f + 1.333355e-03f;
  p = p * f + 9.618129e-03f;
  p = p * f + 5.550411e-02f;
  p = p * f + 2.402265e-01f;
  p = p * f + 6.931472e-01f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

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
#endif

// One query head (q, D floats) over n slots of its kv head, slot j's key at k + row(j) and value at v + row(j).
template <typename T, typename Rows>
void attend_head(const float* q, const T* k, const T* v, Rows row, int64_t n, int64_t D, float scale,
                 std::vector<float>& scores, float* out) {
  scores.resize(n);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = dot(q, k + row(j), D) * scale;
    mx = std::max(mx, scores[j]);
  }
  float* s = scores.data();
  for (int64_t j = 0; j < n; ++j) s[j] = exp_nonpositive(s[j] - mx);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += s[j];
  weighted_sum(s, v, row, n, D, 1.f / sum, out);
}

// The first slot a query at position p sees: 0, or with a sliding window the last `window` (p - window < slot).
inline int64_t first_visible(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

// Calls head(kv dtype tag, row b, kv head g, q row, out row, scores buffer) for every (row, query head) on
// torch's threads: q in float32, the result back in q's dtype. K kv heads, each serving H / K query heads.
template <typename Head>
at::Tensor each_head(const at::Tensor& q, at::ScalarType kv_dtype, int64_t K, Head head) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), group = H / K;
  const auto qf = q.to(at::kFloat).contiguous();
  auto out = at::empty({B, H, D}, qf.options());
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_dtype, "decode_attention", [&] {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t i = begin; i < end; ++i)
        head(scalar_t{}, i / H, (i % H) / group, qp + i * D, op + i * D, scores);
    });
  });
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
  return each_head(q, k_cache.scalar_type(), K, [&](auto tag, int64_t b, int64_t g, const float* qi, float* oi,
                                                    std::vector<float>& scores) {
    using T = decltype(tag);
    const int64_t offset = b * sb + g * sk, p = pp[b], first = first_visible(p, window);
    attend_head(qi, static_cast<const T*>(k_cache.const_data_ptr()) + offset,
                static_cast<const T*>(v_cache.const_data_ptr()) + offset, Consecutive{first, ss}, p - first + 1, D,
                static_cast<float>(scale), scores, oi);
  });
}

// x (N, D) rows of one token: the first Dr dims rotated at cos, sin (Dr,) with the half-split convention, as
// `ember.ops.rope.apply_rope` computes it in T: cos and sin rounded to T, each product and the sum rounded to
// T (the products kept apart: a fused multiply-add would round once where torch rounds twice).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_row(const T* x, const float* cos, const float* sin,
                                                             int64_t N, int64_t D, int64_t Dr, T* out) {
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
    for (int64_t m = 0; m < M; ++m) {
      const float* cm = cf.data_ptr<float>() + m * Dr;
      const float* sm = sf.data_ptr<float>() + m * Dr;
      rope_row<scalar_t>(qc.data_ptr<scalar_t>() + m * H * D, cm, sm, H, D, Dr, q_roped.data_ptr<scalar_t>() + m * H * D);
      rope_row<scalar_t>(kc.data_ptr<scalar_t>() + m * K * D, cm, sm, K, D, Dr, k_roped.data_ptr<scalar_t>() + m * K * D);
    }
  });
  return {q_roped, k_roped};
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
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pp[b] >= 0 && pp[b] < k_cache.size(2), "position ", pp[b], " is outside the cache's ",
                k_cache.size(2), " slots");
  // This step's slot of each row and kv head, in the caches' dtype (converted as index_put converts).
  if (k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
      k_cache.stride(3) == 1 && v_cache.stride(3) == 1) {
    const auto vc = v.contiguous();
    const int64_t size = k_cache.element_size();
    auto* kd = static_cast<char*>(k_cache.data_ptr());
    auto* vd = static_cast<char*>(v_cache.data_ptr());
    const auto* ks = static_cast<const char*>(k_roped.const_data_ptr());
    const auto* vs = static_cast<const char*>(vc.const_data_ptr());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < K; ++g) {
        const int64_t src = (b * K + g) * D * size;
        std::memcpy(kd + (b * k_cache.stride(0) + g * k_cache.stride(1) + pp[b] * k_cache.stride(2)) * size,
                    ks + src, D * size);
        std::memcpy(vd + (b * v_cache.stride(0) + g * v_cache.stride(1) + pp[b] * v_cache.stride(2)) * size,
                    vs + src, D * size);
      }
  } else {
    const auto slots = at::arange(B, pos.options());
    using at::indexing::Slice;
    k_cache.index_put_({slots, Slice(), pos}, k_roped.to(k_cache.scalar_type()));
    v_cache.index_put_({slots, Slice(), pos}, v.to(v_cache.scalar_type()));
  }
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
  return each_head(q, k_pool.scalar_type(), K, [&](auto tag, int64_t b, int64_t g, const float* qi, float* oi,
                                                   std::vector<float>& scores) {
    using T = decltype(tag);
    const int64_t p = pp[b], first = first_visible(p, window);
    attend_head(qi, static_cast<const T*>(k_pool.const_data_ptr()) + g * sk,
                static_cast<const T*>(v_pool.const_data_ptr()) + g * sk, Indexed{tp + b * S + first, ss},
                p - first + 1, D, static_cast<float>(scale), scores, oi);
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
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_decode_attention", &rope_decode_attention);
  m.impl("rope_write", &rope_write);
}
