// Split-KV combine shared by every version: one warp per (request, row);
// requests cut into one piece are skipped (the split kernel wrote them).
#include <string.h>

#include "common.cuh"

static constexpr int kCombineWarps = 8;

template <bool kPdl>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const mla_decode_params p) {
  // Launched as a programmatic dependent (v6+): wait until the split kernel
  // has completed and its partials are visible (never read them before).
  if (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int req = blockIdx.x;
  const int s0 = p.num_splits[req], pieces = p.num_splits[req + 1] - s0;
  if (pieces <= 1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rg = blockIdx.y * kCombineWarps + warp;
  const int q0 = p.qo_indptr[req], qlen = p.qo_indptr[req + 1] - q0;
  const int H = p.num_heads;
  if (rg >= qlen * H) return;
  const int R = mla_decode_rows(&p);

  // Global lse over the pieces (natural log); empty pieces carry -inf.
  float mx = -INFINITY;
  for (int j = lane; j < pieces; j += 32) mx = fmaxf(mx, p.lse_accum[(size_t)(s0 + j) * R + rg]);
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  if (mx != -INFINITY)
    for (int j = lane; j < pieces; j += 32) sum += __expf(p.lse_accum[(size_t)(s0 + j) * R + rg] - mx);
#pragma unroll
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);

  // Each lane owns 16 columns: 4 float4 at lane*4 + 128*c (coalesced).
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; i++) acc[i] = 0.f;
  if (mx != -INFINITY) {
    for (int j = 0; j < pieces; j++) {
      const float l = p.lse_accum[(size_t)(s0 + j) * R + rg];
      if (l == -INFINITY) continue;  // an empty piece's o is 0 but never weigh it
      const float wgt = __expf(l - lse);
      const float4 *src = reinterpret_cast<const float4 *>(p.o_accum + ((size_t)(s0 + j) * R + rg) * 512);
#pragma unroll
      for (int c = 0; c < 4; c++) {
        float4 v = src[lane + 32 * c];
        acc[4 * c + 0] += wgt * v.x;
        acc[4 * c + 1] += wgt * v.y;
        acc[4 * c + 2] += wgt * v.z;
        acc[4 * c + 3] += wgt * v.w;
      }
    }
  }
  const int t = rg / H, h = rg % H;
  uint16_t *dst = p.out + ((size_t)(q0 + t) * H + h) * 512;
#pragma unroll
  for (int c = 0; c < 4; c++) {
    uint2 v;
    v.x = pack_bf16(acc[4 * c + 0], acc[4 * c + 1]);
    v.y = pack_bf16(acc[4 * c + 2], acc[4 * c + 3]);
    *reinterpret_cast<uint2 *>(dst + 4 * (lane + 32 * c)) = v;
  }
  if (lane == 0 && p.lse) p.lse[(size_t)(q0 + t) * H + h] = p.lse_base2 ? lse * kLog2e : lse;
}

cudaError_t decode_combine_launch(const mla_decode_params *p, cudaStream_t stream) {
  const int rows = mla_decode_rows(p);
  dim3 grid(p->batch_size, (rows + kCombineWarps - 1) / kCombineWarps);
  if (p->batch_size == 0) return cudaSuccess;
  decode_combine_kernel<false><<<grid, kCombineWarps * 32, 0, stream>>>(*p);
  return cudaGetLastError();
}

// Same, as a programmatic dependent launch of the kernel before it in the
// stream: the launch overlaps that kernel's tail (it triggers early).
cudaError_t decode_combine_launch_pdl(const mla_decode_params *p, cudaStream_t stream) {
  const int rows = mla_decode_rows(p);
  if (p->batch_size == 0) return cudaSuccess;
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gridDim = dim3(p->batch_size, (rows + kCombineWarps - 1) / kCombineWarps);
  cfg.blockDim = dim3(kCombineWarps * 32);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, decode_combine_kernel<true>, *p);
}
