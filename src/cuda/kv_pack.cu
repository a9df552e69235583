// Raw row copy between KV caches: the pack of EXTEND under decode context
// parallel (each rank's rows into its block of the gathered cache). Bytes
// as stored, so any cache format moves unchanged (fp8 scales included).
//
// One warp per row, 16-byte vectors: a 1152-byte bf16 row is 72 vectors,
// fp8 576 B is 36, the block format's 656 B is 41 (all multiples of 16).
#include <cuda_runtime.h>

#include "kv_pack.h"

namespace {

constexpr int kWarps = 8;  // rows per 256-thread block

__global__ void __launch_bounds__(32 * kWarps)
    kv_pack_kernel(const uint4 *__restrict__ src /* [src_num_slots, vec] */, int64_t src_num_slots,
                   uint4 *__restrict__ dst /* [n, vec] */, int vec /* 16-byte vectors per row */, int n,
                   const int32_t *__restrict__ slots /* [n] */, int *bad) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const int32_t s = slots[row];
  if (s < 0 || s >= src_num_slots) {
    if (lane == 0) atomicAdd(bad, 1);
    return;
  }
  const uint4 *from = src + (int64_t)s * vec;
  uint4 *to = dst + row * vec;
  for (int k = lane; k < vec; k += 32) to[k] = __ldg(from + k);
}

}  // namespace

extern "C" int mla_cuda_kv_pack(const void *src_layer, int64_t src_num_slots, void *dst_rows, size_t row_bytes,
                                int n, const int32_t *src_slots, int *bad, void *stream) {
  if (n <= 0) return 0;
  const int vec = (int)(row_bytes / 16);
  const unsigned grid = (unsigned)((n + kWarps - 1) / kWarps);
  kv_pack_kernel<<<grid, 32 * kWarps, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4 *>(src_layer), src_num_slots, static_cast<uint4 *>(dst_rows), vec, n, src_slots,
      bad);
  return (int)cudaGetLastError();
}
