// A kernel that holds the GPU for a given time without touching memory: what a decode step's latency-bound
// kernels (attention, the norms) are to the GEMV launched after them. The GEMV tuner times candidates behind it
// (`ember.quant.tuning.PRECEDED_NS`), so that a block shape which loads more of its weights before its wait
// (programmatic dependent launch) gains as it does in the step. One thread spins on the global timer; the
// next kernel may start at once, and waits for this one to end.

#include "ember_cuda.cuh"

__global__ void hold(int ns) {
  pdl_launch_dependents();
  pdl_wait();
  if (threadIdx.x != 0) return;
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < (unsigned long long)ns);
}
