// KV cache kernels: scatter this step's latent rows into the paged cache
// with quantize-on-write (set_mla_kv_buffer), and gather rows back
// dequantized. One 128-thread block per token row; the scalar conversions are
// src/core/convert.h, shared with the CPU so both store identical bytes.
#include <cuda_runtime.h>

#include "../core/convert.h"
#include "runtime.h"

namespace {

// mla_dtype values (include/mla.h; the header is C, the values are pinned).
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_FP8 = 3, DT_FP8_BLOCK = 4 };
constexpr int kLatent = 512, kRope = 64, kThreads = 128;
constexpr int kBlockScaleOff = kLatent, kBlockRopeOff = kLatent + 16;

__device__ __forceinline__ float load_act(const void *p, int dtype, int64_t i) {
  if (dtype == DT_F32) return static_cast<const float *>(p)[i];
  uint16_t h = static_cast<const uint16_t *>(p)[i];
  return dtype == DT_BF16 ? mla_bf16_to_f32(h) : mla_f16_to_f32(h);
}

__device__ __forceinline__ void store_act(void *p, int dtype, int64_t i, float v) {
  if (dtype == DT_F32) {
    static_cast<float *>(p)[i] = v;
    return;
  }
  static_cast<uint16_t *>(p)[i] = dtype == DT_BF16 ? mla_f32_to_bf16(v) : mla_f32_to_f16(v);
}

// Block-wide (128 threads) reduction of (finite amax, any NaN).
__device__ float block_scale(float v, float *red_amax, int *red_nan) {
  float a = fabsf(v);
  int nan = a != a;
  float fin = (nan || a > FLT_MAX) ? 0.0f : a;
  for (int o = 16; o > 0; o >>= 1) {
    fin = fmaxf(fin, __shfl_xor_sync(0xffffffffu, fin, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  int w = threadIdx.x >> 5;
  __syncthreads();  // red_* reused across calls
  if ((threadIdx.x & 31) == 0) {
    red_amax[w] = fin;
    red_nan[w] = nan;
  }
  __syncthreads();
  float amax = fmaxf(fmaxf(red_amax[0], red_amax[1]), fmaxf(red_amax[2], red_amax[3]));
  int any_nan = red_nan[0] | red_nan[1] | red_nan[2] | red_nan[3];
  return mla_fp8_block_scale_from(amax, any_nan);
}

__global__ void __launch_bounds__(kThreads) kv_write_kernel(unsigned char *layer, int64_t num_slots,
                                                            int cache_dtype, size_t row_bytes,
                                                            float fp8_scale, const int32_t *slots,
                                                            const void *c, const void *r, int src_dtype,
                                                            int *bad, int world, int rank) {
  __shared__ float red_amax[4];
  __shared__ int red_nan[4];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  int32_t slot = slots[t];
  // Context parallel (world > 1): a global slot; only this rank's rows, at slot / world.
  if (world > 1 && slot >= 0) {
    if (slot % world != rank) return;
    slot /= world;
  }
  if (slot < 0 || slot >= num_slots) {  // checked per row: the host cannot see device slots
    if (tid == 0) atomicAdd(bad, 1);
    return;
  }
  unsigned char *row = layer + static_cast<size_t>(slot) * row_bytes;
  float cv[4];
#pragma unroll
  for (int k = 0; k < 4; k++) cv[k] = load_act(c, src_dtype, t * kLatent + k * kThreads + tid);
  const float rv = tid < kRope ? load_act(r, src_dtype, t * kRope + tid) : 0.0f;
  switch (cache_dtype) {
    case DT_BF16:
    case DT_F16: {
      uint16_t *h = reinterpret_cast<uint16_t *>(row);
      const bool bf = cache_dtype == DT_BF16;
#pragma unroll
      for (int k = 0; k < 4; k++) h[k * kThreads + tid] = bf ? mla_f32_to_bf16(cv[k]) : mla_f32_to_f16(cv[k]);
      if (tid < kRope) h[kLatent + tid] = bf ? mla_f32_to_bf16(rv) : mla_f32_to_f16(rv);
      break;
    }
    case DT_FP8: {
#pragma unroll
      for (int k = 0; k < 4; k++) row[k * kThreads + tid] = mla_e4m3_quantize(cv[k], fp8_scale);
      if (tid < kRope) row[kLatent + tid] = mla_e4m3_quantize(rv, fp8_scale);
      break;
    }
    case DT_FP8_BLOCK: {
      float *scales = reinterpret_cast<float *>(row + kBlockScaleOff);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float s = block_scale(cv[k], red_amax, red_nan);
        row[k * kThreads + tid] = mla_e4m3_quantize(cv[k], s);
        if (tid == 0) scales[k] = s;
      }
      if (tid < kRope) reinterpret_cast<uint16_t *>(row + kBlockRopeOff)[tid] = mla_f32_to_bf16(rv);
      break;
    }
  }
}

__global__ void __launch_bounds__(kThreads) kv_read_kernel(const unsigned char *layer, int64_t num_slots,
                                                           int cache_dtype, size_t row_bytes, float fp8_scale,
                                                           const int32_t *slots, void *c, void *r,
                                                           int dst_dtype, int *bad) {
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int32_t slot = slots[t];
  if (slot < 0 || slot >= num_slots) {
    if (tid == 0) atomicAdd(bad, 1);
    return;
  }
  const unsigned char *row = layer + static_cast<size_t>(slot) * row_bytes;
  float cv[4], rv = 0.0f;
  switch (cache_dtype) {
    case DT_BF16:
    case DT_F16: {
      const uint16_t *h = reinterpret_cast<const uint16_t *>(row);
      const bool bf = cache_dtype == DT_BF16;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        uint16_t x = h[k * kThreads + tid];
        cv[k] = bf ? mla_bf16_to_f32(x) : mla_f16_to_f32(x);
      }
      if (tid < kRope) rv = bf ? mla_bf16_to_f32(h[kLatent + tid]) : mla_f16_to_f32(h[kLatent + tid]);
      break;
    }
    case DT_FP8: {
#pragma unroll
      for (int k = 0; k < 4; k++) cv[k] = mla_e4m3_to_f32(row[k * kThreads + tid]) * fp8_scale;
      if (tid < kRope) rv = mla_e4m3_to_f32(row[kLatent + tid]) * fp8_scale;
      break;
    }
    default: {  // DT_FP8_BLOCK
      const float *scales = reinterpret_cast<const float *>(row + kBlockScaleOff);
#pragma unroll
      for (int k = 0; k < 4; k++) cv[k] = mla_e4m3_to_f32(row[k * kThreads + tid]) * scales[k];
      if (tid < kRope) rv = mla_bf16_to_f32(reinterpret_cast<const uint16_t *>(row + kBlockRopeOff)[tid]);
      break;
    }
  }
  if (c) {
#pragma unroll
    for (int k = 0; k < 4; k++) store_act(c, dst_dtype, t * kLatent + k * kThreads + tid, cv[k]);
  }
  if (r && tid < kRope) store_act(r, dst_dtype, t * kRope + tid, rv);
}

}  // namespace

extern "C" int mla_cuda_kv_write(void *layer, int64_t num_slots, int cache_dtype, size_t row_bytes,
                                 float fp8_scale, int num_tokens, const int32_t *slots, const void *c,
                                 const void *r, int src_dtype, int *bad, int world, int rank, void *stream) {
  if (num_tokens <= 0) return 0;
  kv_write_kernel<<<num_tokens, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<unsigned char *>(layer), num_slots, cache_dtype, row_bytes, fp8_scale, slots, c, r,
      src_dtype, bad, world, rank);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int mla_cuda_kv_read(const void *layer, int64_t num_slots, int cache_dtype, size_t row_bytes,
                                float fp8_scale, int num_tokens, const int32_t *slots, void *c, void *r,
                                int dst_dtype, int *bad, void *stream) {
  if (num_tokens <= 0) return 0;
  kv_read_kernel<<<num_tokens, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const unsigned char *>(layer), num_slots, cache_dtype, row_bytes, fp8_scale, slots, c, r,
      dst_dtype, bad);
  return static_cast<int>(cudaGetLastError());
}
