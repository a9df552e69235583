// Does compute-sanitizer racecheck flag shared-memory hand-offs that a
// barrier orders? The access pattern of merge_rows (decode_sm90.cu) and of
// the seesaw epilogue, stripped of everything else: warpgroup 1 writes a
// scratch row, barrier, warpgroup 0 adds to it, barrier, every thread reads,
// barrier, repeated. Modes (argv[1]):
//   0  __syncthreads, 256 threads
//   1  bar.sync 10, 256 (named, the ring kernel's cons_sync), 256 threads
//   2  as 1 with a 32-thread producer warp that returns at once (288 threads)
//   3  as 2, each warpgroup first doing bar.sync on its own id (1, 4) with 128
//   4  as 0 with the seesaw's bar.arrive -> bar.sync hand-off (ids 2, 3) before
//   5  as 0 with an mbarrier wait (one thread arrives) before the hand-off
//   6  as 0 with the scratch first filled by cp.async (wait_group 0, then
//      __syncthreads) in every round
//   7  as 0 after a generic write/read of a second buffer by the two
//      warpgroups through their own 128-thread named barriers (ids 1, 4) and
//      a cp.async.mbarrier.arrive.noinc on an mbarrier every thread waits on
//   9  7's named-barrier part only;  10  7's cp.async + mbarrier part only
//   8  as 4 with bar.sync instead of bar.arrive on the publishing side
//   11 as 0 with each warpgroup first voting through bar.red.or.pred on its
//      own id (6, 7; 128 threads), as wg_any in the narrow / ring kernels
//   12 as 0 with each warp first storing a fragment with stmatrix, then
//      fence.proxy.async and a 128-thread named barrier per warpgroup (1, 4),
//      as the narrow kernel's P^T store
// Run: compute-sanitizer --tool racecheck ./repro MODE (reports should be 0
// for every mode; a report means the tool does not credit that barrier).
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__global__ void repro(float *out, int mode) {
  __shared__ float scr[128 * 9];
  __shared__ float hand[128];
  __shared__ float own[256];
  __shared__ __align__(8) unsigned long long mbar;
  __shared__ __align__(16) unsigned short frag[8][4 * 64];
  const int tid = threadIdx.x;
  if (mode >= 2 && mode <= 3) {
    if (tid >= 256) return;  // the producer warp: done
  }
  const int wg = tid >> 7, t = tid & 127;
  auto sync = [&]() {
    if (mode == 0 || mode >= 4) __syncthreads();
    else bar_sync(10, 256);
  };
  if ((mode == 5 || mode == 7 || mode == 10) && tid == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(&mbar)),
                 "r"(mode == 5 ? 1 : 256));
  }
  if (mode == 5 || mode == 7 || mode == 10) __syncthreads();
  float acc = 0.f;
  for (int it = 0; it < 4; it++) {
    if (mode == 3) bar_sync(1 + 3 * wg, 128);
    if (mode == 4 || mode == 8) {  // warpgroup 1 publishes, warpgroup 0 consumes (seesaw)
      if (wg == 1) {
        hand[t] = (float)(it + t);
        if (mode == 4) bar_arrive(2, 256);
        else bar_sync(2, 256);
      } else {
        bar_sync(2, 256);
        acc += hand[(t * 5) & 127];
      }
      __syncthreads();
    }
    if (mode == 5) {
      const unsigned a = (unsigned)__cvta_generic_to_shared(&mbar);
      if (tid == 0) asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(a) : "memory");
      asm volatile(
          "{\n.reg .pred P;\nW: mbarrier.try_wait.parity.shared.b64 P, [%0], %1;\n@!P bra W;\n}" ::"r"(a), "r"(it & 1)
          : "memory");
    }
    if (mode == 11) {
      unsigned r;
      asm volatile(
          "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\nselp.u32 %0, 1, 0, q;\n}\n"
          : "=r"(r)
          : "r"((unsigned)((t + it) & 1)), "r"(6 + wg)
          : "memory");
      acc += (float)r;
    }
    if (mode == 12) {
      const int w = tid >> 5, lane = tid & 31;
      const unsigned a = (unsigned)__cvta_generic_to_shared(&frag[w][(lane & 7) * 8 + (lane >> 3) * 64]);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(it), "r"(t),
                   "r"(lane), "r"(w)
                   : "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      bar_sync(1 + 3 * wg, 128);
      acc += (float)frag[w ^ 1][lane];
    }
    if (mode == 6) {
      const unsigned dst = (unsigned)__cvta_generic_to_shared(&scr[tid * 4]);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(out + (tid & 127)) : "memory");
      asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
      __syncthreads();
    }
    if (mode == 7 || mode == 9) {
      own[tid] = (float)t;  // each warpgroup its own half
      bar_sync(1 + 3 * wg, 128);
      acc += own[128 * wg + ((t + 1) & 127)];
      if (mode == 9) __syncthreads();
    }
    if (mode == 7 || mode == 10) {
      const unsigned a = (unsigned)__cvta_generic_to_shared(&mbar);
      const unsigned dst = (unsigned)__cvta_generic_to_shared(&scr[tid * 4 + 1]);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(out + (tid & 127)) : "memory");
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(a) : "memory");
      asm volatile(
          "{\n.reg .pred P;\nW: mbarrier.try_wait.parity.shared.b64 P, [%0], %1;\n@!P bra W;\n}" ::"r"(a), "r"(it & 1)
          : "memory");
      __syncthreads();
    }
    for (int d = 0; d < 8; d++)
      if (wg == 1) scr[t * 9 + d] = (float)(it * 8 + d + t);
    sync();
    for (int d = 0; d < 8; d++)
      if (wg == 0) scr[t * 9 + d] += 1.f;
    sync();
    for (int x = tid; x < 128 * 8; x += 256) acc += scr[(x >> 3) * 9 + (x & 7)];
    sync();
  }
  out[tid] = acc;
}

int main(int argc, char **argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  const int threads = (mode == 2 || mode == 3) ? 288 : 256;
  float *out = nullptr;
  cudaMalloc(&out, 288 * sizeof(float));
  repro<<<2, threads>>>(out, mode);
  const cudaError_t e = cudaDeviceSynchronize();
  printf("mode %d: %s\n", mode, cudaGetErrorString(e));
  cudaFree(out);
  return e != cudaSuccess;
}
