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

// v / scale rounded once to e4m3, bit for bit mla_e4m3_quantize (convert.h:
// the exact quotient narrowed to float with round-to-odd, then rounded to 4
// significant bits), without its double division and its integer rounding
// steps, which make the fp8 write compute-bound: the float quotient
// f = RN(v / s) is exact iff the remainder v - f s is 0 (that remainder is
// exactly representable, and exactly what the fma returns, when |v| >= 2^-100
// and f and s are normal floats), and its sign says on which side of f the
// exact quotient lies; the odd-rounded f then goes through the hardware's
// round-to-nearest-even, saturating e4m3 conversion (sm_89+), the same
// rounding and saturation as mla_f32_to_e4m3. Anything outside those ranges
// (zero, tiny, NaN or infinite values or scales, a quotient outside the
// normal range) takes the exact software path.
__device__ __forceinline__ bool quotient_odd(float v, float s, float *q) {
  const float av = fabsf(v);
  if (!(av >= 0x1p-100f && av <= FLT_MAX && s >= FLT_MIN && s <= FLT_MAX)) return false;
  float f = __fdiv_rn(v, s);
  if (!(fabsf(f) >= FLT_MIN && fabsf(f) <= FLT_MAX)) return false;
  const float r = fmaf(-f, s, v);  // v - f s, exact
  if (r != 0.0f) {
    const uint32_t u = __float_as_uint(f);
    if (!(u & 1u)) {  // step to the odd neighbour on the quotient's side (s > 0: the side of r's sign)
      const bool mag_up = (r > 0.0f) == ((u >> 31) == 0);
      f = __uint_as_float(mag_up ? u + 1u : u - 1u);
    }
  }
  *q = f;
  return true;
}

// Two floats to e4m3 (round to nearest even, saturating): lo in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)mla_f32_to_e4m3(lo) | ((uint32_t)mla_f32_to_e4m3(hi) << 8);
#endif
}

// n (even) values of x quantized with scale s, packed little-endian into bytes.
template <int n>
__device__ __forceinline__ void e4m3_quantize_n(const float *x, float s, uint8_t *out) {
  float q[n];
  bool ok[n];
#pragma unroll
  for (int k = 0; k < n; k++) {
    ok[k] = quotient_odd(x[k], s, &q[k]);
    if (!ok[k]) q[k] = 0.0f;
  }
#pragma unroll
  for (int k = 0; k < n; k += 2) {
    const uint32_t w = e4m3x2(q[k], q[k + 1]);
    out[k] = ok[k] ? (uint8_t)(w & 0xFFu) : mla_e4m3_quantize(x[k], s);
    out[k + 1] = ok[k + 1] ? (uint8_t)(w >> 8) : mla_e4m3_quantize(x[k + 1], s);
  }
}

__device__ __forceinline__ uint8_t e4m3_quantize_fast(float v, float s) {
  float x[2] = {v, 0.0f};
  uint8_t b[2];
  e4m3_quantize_n<2>(x, s, b);
  return b[0];
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
      for (int k = 0; k < 4; k++) row[k * kThreads + tid] = e4m3_quantize_fast(cv[k], fp8_scale);
      if (tid < kRope) row[kLatent + tid] = e4m3_quantize_fast(rv, fp8_scale);
      break;
    }
    case DT_FP8_BLOCK: {
      float *scales = reinterpret_cast<float *>(row + kBlockScaleOff);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float s = block_scale(cv[k], red_amax, red_nan);
        row[k * kThreads + tid] = e4m3_quantize_fast(cv[k], s);
        if (tid == 0) scales[k] = s;
      }
      if (tid < kRope) reinterpret_cast<uint16_t *>(row + kBlockRopeOff)[tid] = mla_f32_to_bf16(rv);
      break;
    }
  }
}

// The vectorized write: one warp per row, 8 rows per block; lane l owns the
// latent elements [16 l, 16 l + 16) (16-byte loads and stores) and the rope
// elements [2 l, 2 l + 2). Same results as kv_write_kernel, bit for bit (the
// same conversion helpers; the block scale is the same max over the same 128
// elements, reduced over the 8 lanes that hold them). Used when every base
// pointer is 16-byte aligned, which the row sizes then keep for every row.
constexpr int kWarpRows = 8;

template <int kSrc>
__device__ __forceinline__ void load16(const void *c, const void *r, int64_t t, int lane, float *cv, float *rv) {
  if (kSrc == DT_F32) {
    const float4 *p = reinterpret_cast<const float4 *>(static_cast<const float *>(c) + t * kLatent + 16 * lane);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float4 v = p[k];
      cv[4 * k] = v.x, cv[4 * k + 1] = v.y, cv[4 * k + 2] = v.z, cv[4 * k + 3] = v.w;
    }
    const float2 w = reinterpret_cast<const float2 *>(static_cast<const float *>(r) + t * kRope)[lane];
    rv[0] = w.x, rv[1] = w.y;
  } else {
    const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(c) + t * kLatent + 16 * lane);
#pragma unroll
    for (int k = 0; k < 2; k++) {
      const uint4 v = p[k];
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const uint16_t lo = (uint16_t)(u[j] & 0xFFFFu), hi = (uint16_t)(u[j] >> 16);
        cv[8 * k + 2 * j] = kSrc == DT_BF16 ? mla_bf16_to_f32(lo) : mla_f16_to_f32(lo);
        cv[8 * k + 2 * j + 1] = kSrc == DT_BF16 ? mla_bf16_to_f32(hi) : mla_f16_to_f32(hi);
      }
    }
    const uint32_t w = reinterpret_cast<const uint32_t *>(static_cast<const uint16_t *>(r) + t * kRope)[lane];
    const uint16_t lo = (uint16_t)(w & 0xFFFFu), hi = (uint16_t)(w >> 16);
    rv[0] = kSrc == DT_BF16 ? mla_bf16_to_f32(lo) : mla_f16_to_f32(lo);
    rv[1] = kSrc == DT_BF16 ? mla_bf16_to_f32(hi) : mla_f16_to_f32(hi);
  }
}

template <int kSrc>
__global__ void __launch_bounds__(32 * kWarpRows) kv_write_rows_kernel(
    unsigned char *layer, int64_t num_slots, int cache_dtype, size_t row_bytes, float fp8_scale,
    const int32_t *slots, const void *c /* [T, 512] */, const void *r /* [T, 64] */, int num_tokens, int *bad,
    int world, int rank) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (int64_t)blockIdx.x * kWarpRows + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  int32_t slot = slots[t];
  if (world > 1 && slot >= 0) {
    if (slot % world != rank) return;
    slot /= world;
  }
  if (slot < 0 || slot >= num_slots) {
    if (lane == 0) atomicAdd(bad, 1);
    return;
  }
  unsigned char *row = layer + static_cast<size_t>(slot) * row_bytes;
  float cv[16], rv[2];
  load16<kSrc>(c, r, t, lane, cv, rv);
  if (cache_dtype == DT_BF16 || cache_dtype == DT_F16) {
    const bool bf = cache_dtype == DT_BF16;
    uint32_t u[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const uint16_t lo = bf ? mla_f32_to_bf16(cv[2 * j]) : mla_f32_to_f16(cv[2 * j]);
      const uint16_t hi = bf ? mla_f32_to_bf16(cv[2 * j + 1]) : mla_f32_to_f16(cv[2 * j + 1]);
      u[j] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
    uint4 *dst = reinterpret_cast<uint4 *>(row + 32 * lane);
    dst[0] = make_uint4(u[0], u[1], u[2], u[3]);
    dst[1] = make_uint4(u[4], u[5], u[6], u[7]);
    const uint16_t lo = bf ? mla_f32_to_bf16(rv[0]) : mla_f32_to_f16(rv[0]);
    const uint16_t hi = bf ? mla_f32_to_bf16(rv[1]) : mla_f32_to_f16(rv[1]);
    reinterpret_cast<uint32_t *>(row + 2 * kLatent)[lane] = (uint32_t)lo | ((uint32_t)hi << 16);
    return;
  }
  float s = fp8_scale;
  if (cache_dtype == DT_FP8_BLOCK) {  // amax over the 128 elements of lanes 8b..8b+7
    float fin = 0.0f;
    int nan = 0;
#pragma unroll
    for (int k = 0; k < 16; k++) {
      const float a = fabsf(cv[k]);
      nan |= a != a;
      fin = fmaxf(fin, (a != a || a > FLT_MAX) ? 0.0f : a);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
      fin = fmaxf(fin, __shfl_xor_sync(0xffffffffu, fin, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    s = mla_fp8_block_scale_from(fin, nan);
    if ((lane & 7) == 0) reinterpret_cast<float *>(row + kBlockScaleOff)[lane >> 3] = s;
  }
  uint8_t b[16];
  e4m3_quantize_n<16>(cv, s, b);
  uint32_t u[4];
#pragma unroll
  for (int j = 0; j < 4; j++)
    u[j] = (uint32_t)b[4 * j] | ((uint32_t)b[4 * j + 1] << 8) | ((uint32_t)b[4 * j + 2] << 16) |
           ((uint32_t)b[4 * j + 3] << 24);
  reinterpret_cast<uint4 *>(row)[lane] = make_uint4(u[0], u[1], u[2], u[3]);
  if (cache_dtype == DT_FP8_BLOCK) {
    const uint32_t w = (uint32_t)mla_f32_to_bf16(rv[0]) | ((uint32_t)mla_f32_to_bf16(rv[1]) << 16);
    reinterpret_cast<uint32_t *>(row + kBlockRopeOff)[lane] = w;
  } else {
    uint8_t rb[2];
    e4m3_quantize_n<2>(rv, fp8_scale, rb);
    reinterpret_cast<uint16_t *>(row + kLatent)[lane] = (uint16_t)(rb[0] | (rb[1] << 8));
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
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  unsigned char *l = static_cast<unsigned char *>(layer);
  const bool aligned = ((reinterpret_cast<uintptr_t>(layer) | reinterpret_cast<uintptr_t>(c) |
                         reinterpret_cast<uintptr_t>(r)) & 15) == 0 && row_bytes % 16 == 0;
  if (aligned) {  // every row keeps the alignment: rows of 1152 / 576 / 656 bytes, src rows of 1 or 2 KiB
    const unsigned grid = (unsigned)((num_tokens + kWarpRows - 1) / kWarpRows);
    if (src_dtype == DT_F32)
      kv_write_rows_kernel<DT_F32><<<grid, 32 * kWarpRows, 0, st>>>(l, num_slots, cache_dtype, row_bytes, fp8_scale,
                                                                    slots, c, r, num_tokens, bad, world, rank);
    else if (src_dtype == DT_BF16)
      kv_write_rows_kernel<DT_BF16><<<grid, 32 * kWarpRows, 0, st>>>(l, num_slots, cache_dtype, row_bytes,
                                                                     fp8_scale, slots, c, r, num_tokens, bad, world,
                                                                     rank);
    else
      kv_write_rows_kernel<DT_F16><<<grid, 32 * kWarpRows, 0, st>>>(l, num_slots, cache_dtype, row_bytes, fp8_scale,
                                                                    slots, c, r, num_tokens, bad, world, rank);
    return static_cast<int>(cudaGetLastError());
  }
  kv_write_kernel<<<num_tokens, kThreads, 0, st>>>(l, num_slots, cache_dtype, row_bytes, fp8_scale, slots, c, r,
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
