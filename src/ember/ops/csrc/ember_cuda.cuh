// What Ember's CUDA C++ kernels share (`#include "ember_cuda.cuh"`; ember.ops.cuda_rtc hands it to NVRTC):
// 16-bit activation words <-> float, and programmatic dependent launch.

typedef unsigned short u16;
typedef unsigned int u32;

// A bf16 (BF16) or fp16 value, held in the low 16 bits, as a float.
template <bool BF16>
__device__ __forceinline__ float to_f32(u32 half) {
  if (BF16) return __uint_as_float(half << 16);
  float f;
  unsigned short h = (unsigned short)half;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// f rounded to nearest-even bf16 (BF16) or fp16 bits.
template <bool BF16>
__device__ __forceinline__ u16 from_f32(float f) {
  u16 r;
  if (BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// f as the activation dtype would hold it: what torch's bf16 / fp16 arithmetic rounds each result to.
template <bool BF16>
__device__ __forceinline__ float round_to(float f) {
  return to_f32<BF16>(from_f32<BF16>(f));
}

// Let the next kernel of the stream start launching (it waits in pdl_wait for this one's writes).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Wait until the kernels before this one have completed and their writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
