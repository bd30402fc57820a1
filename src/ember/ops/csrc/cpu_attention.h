// What the CPU attention kernels share: which keys a query sees, and the exp of a softmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ember {

// The first key (slot) a query at position p sees: 0, or with a sliding window the last `window` (p - window <
// key).
inline int64_t first_visible(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

// 2^f for f in [-0.5, 0.5] by its Taylor series to degree 7 (error < 1e-8): kExp2Series[0] f^7 + ... + 1, by
// Horner's rule.
constexpr float kExp2Series[8] = {1.525273e-05f, 1.540353e-04f, 1.333355e-03f, 9.618129e-03f,
                                  5.550411e-02f, 2.402265e-01f, 6.931472e-01f, 1.0f};

// exp(x) for x <= 0 (a score minus its row's max), to ~1e-7 relative: 2^(x log2 e) as 2^n * 2^f with f in
// [-0.5, 0.5], 2^n put into the exponent bits. Written as plain arithmetic so that a loop of it vectorizes (a
// call to expf a slot cost more than the matmuls).
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Series[0];
  for (int i = 1; i < 8; ++i) p = p * f + kExp2Series[i];
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace ember
