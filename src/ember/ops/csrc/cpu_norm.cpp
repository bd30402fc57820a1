// RMSNorm on a CPU, and the residual add before it, one call a norm: an eager decode step ran each as ~10
// aten ops (add, pow, mean, add, rsqrt, mul, to, mul, with their dispatches), ~13 us a norm on 2 cores for a
// row of 576, 61 norms a SmolLM2 step. The values are `ember.ops.norm.rms_norm_reference`'s: float32
// statistics, the weight applied to the result rounded to x's dtype, or with an offset (Gemma: 1 + w) to the
// float32 result before rounding; h = x + delta rounded to x's dtype first. Only the sum of squares is added
// in another order than torch's (16 partial sums, then a tree).
//
// Shape legend: R rows, E features.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "library.h"

namespace {

constexpr int kLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16: round to nearest even, as torch's casts
}

// One row: h (float, already rounded to T) in hf[0..E), the norm of it into out.
template <typename T>
void norm_row(const float* hf, const T* w, float eps, float offset, bool has_offset, int64_t E, T* out) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= E; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += hf[i + l] * hf[i + l];
  for (; i < E; ++i) acc[0] += hf[i] * hf[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  const float r = 1.0f / std::sqrt(acc[0] / static_cast<float>(E) + eps);
  if (has_offset) {
    for (int64_t j = 0; j < E; ++j) out[j] = from_float<T>(hf[j] * r * (offset + to_float(w[j])));
  } else {
    for (int64_t j = 0; j < E; ++j) out[j] = from_float<T>(to_float(w[j]) * to_float(from_float<T>(hf[j] * r)));
  }
}

template <typename T>
void norm_rows(const T* x, const T* delta, const T* w, float eps, float offset, int64_t R, int64_t E, T* h,
               T* out) {
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> hf(E);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * E;
      for (int64_t j = 0; j < E; ++j) {
        if (delta != nullptr) {
          const T sum = from_float<T>(to_float(xr[j]) + to_float(delta[r * E + j]));
          h[r * E + j] = sum;
          hf[j] = to_float(sum);
        } else {
          hf[j] = to_float(xr[j]);
        }
      }
      norm_row<T>(hf.data(), w, eps, offset, offset != 0.0f, E, out + r * E);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dtype() == at::kFloat || x.dtype() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  TORCH_CHECK(weight.dtype() == x.dtype(), op, ": the weight must have x's dtype");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": the weight must be (E,) for x (..., E)");
}

std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x_, const at::Tensor* delta_, const at::Tensor& w_,
                                       double eps, double offset) {
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const at::Tensor delta = delta_ != nullptr ? delta_->contiguous() : at::Tensor();
  const int64_t E = x.size(-1), R = E > 0 ? x.numel() / E : 0;
  at::Tensor out = at::empty_like(x);
  at::Tensor h = delta_ != nullptr ? at::empty_like(x) : x;
  if (x.dtype() == at::kFloat) {
    norm_rows<float>(x.data_ptr<float>(), delta_ != nullptr ? delta.data_ptr<float>() : nullptr,
                     w.data_ptr<float>(), static_cast<float>(eps), static_cast<float>(offset), R, E,
                     delta_ != nullptr ? h.data_ptr<float>() : nullptr, out.data_ptr<float>());
  } else {
    using B = c10::BFloat16;
    norm_rows<B>(x.data_ptr<B>(), delta_ != nullptr ? delta.data_ptr<B>() : nullptr, w.data_ptr<B>(),
                 static_cast<float>(eps), static_cast<float>(offset), R, E,
                 delta_ != nullptr ? h.data_ptr<B>() : nullptr, out.data_ptr<B>());
  }
  return {h, out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check(x, weight, "rms_norm");
  return std::get<1>(run(x, nullptr, weight, eps, offset));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps, double offset) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.dtype() == x.dtype(),
              "add_rms_norm: delta must have x's shape and dtype");
  return run(x, &delta, weight, eps, offset);
}

}  // namespace

EMBER_LIBRARY_FRAGMENT(EMBER_CPU_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
}

EMBER_LIBRARY_IMPL(EMBER_CPU_NAMESPACE, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
