// KV cache kernels: scatter this step's latent rows into the paged cache
// with quantize-on-write (set_mla_kv_buffer), and gather rows back
// dequantized. The write: one warp per row when the pointers are 16-byte
// aligned (kv_write_rows_kernel), else one 128-thread block per row; the read:
// one block per row. The scalar conversions are src/core/convert.h, shared
// with the CPU so both store identical bytes (and a 16-bit source into a
// cache of its own dtype is copied bit for bit, as the CPU copies it).
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

// v / s rounded once to e4m3, bit for bit mla_e4m3_quantize: on the fast
// path (convert.h: mla_e4m3_quotient_rcp, 1 / s split in two floats, three
// float operations and a rounding to odd, no branch, no division) the float
// whose hardware e4m3 rounding (the same rounding and saturation as
// mla_f32_to_e4m3) is the answer. The exact path it replaced (a division and
// branches per value) made the fp8 writes compute-bound, at a third of the
// copy rate. The fast
// path's domain (mla_e4m3_rcp_*_ok) is checked once per lane; a lane with a
// value outside it (NaN, inf, |v| > 2^64) or an odd scale redoes its values
// with the exact mla_e4m3_quantize, out of line.
__device__ __noinline__ uint32_t e4m3x4_exact(float a, float b, float c, float d, float s) {
  return (uint32_t)mla_e4m3_quantize(a, s) | ((uint32_t)mla_e4m3_quantize(b, s) << 8) |
         ((uint32_t)mla_e4m3_quantize(c, s) << 16) | ((uint32_t)mla_e4m3_quantize(d, s) << 24);
}

// Four values, little-endian bytes of one word, without their signs.
__device__ __forceinline__ uint32_t e4m3x4_rcp_abs(const float *x, float s, float hi, float lo) {
  const uint32_t a =
      e4m3x2(mla_e4m3_quotient_rcp_abs(x[0], s, hi, lo), mla_e4m3_quotient_rcp_abs(x[1], s, hi, lo));
  const uint32_t b =
      e4m3x2(mla_e4m3_quotient_rcp_abs(x[2], s, hi, lo), mla_e4m3_quotient_rcp_abs(x[3], s, hi, lo));
  return a | (b << 16);
}

// The sign bits of four source values at the e4m3 sign bits of their bytes:
// two words of 16-bit values (signs at bits 15 and 31) or four floats.
__device__ __forceinline__ uint32_t signs4_16(uint32_t x, uint32_t y) { return __byte_perm(x, y, 0x7531) & 0x80808080u; }
__device__ __forceinline__ uint32_t signs4_32(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0073), __byte_perm(c, d, 0x0073), 0x5410) & 0x80808080u;
}

// One value (the row-per-block write).
__device__ __forceinline__ uint8_t e4m3_quantize_fast(float v, float s) {
  if (mla_e4m3_rcp_scale_ok(s) && mla_e4m3_rcp_value_ok(v)) {
    float hi, lo;
    mla_e4m3_rcp_split(s, &hi, &lo);
    return (uint8_t)(e4m3x2(mla_e4m3_quotient_rcp(v, s, hi, lo), 0.0f) & 0xFFu);
  }
  return mla_e4m3_quantize(v, s);
}

// mla_fp8_block_scale_from(amax, 0), its division by 448 done as
// mla_div448 (the same bits).
__device__ __forceinline__ float block_scale_finite(float amax) {
  if (amax == 0.0f) return 1.0f;
  const float s = mla_div448(amax);
  return s > 0.0f ? s : 1.40129846e-45f;
}

// mla_div448 in its domain (amax in [2^-100, 2^127]: the same operations,
// the same bits; the quotient is then a positive normal float), and that
// domain with 0 (block_scale_finite's 1.0) added: the block write's common
// case, without mla_div448's and block_scale_finite's branches.
__device__ __forceinline__ bool div448_fast_ok(float amax) {
  return amax == 0.0f || (amax >= 0x1p-100f && amax <= 0x1p127f);
}
__device__ __forceinline__ float div448_fast(float amax) {
  const float y = 1.0f / 448.0f, q = __fmul_rn(amax, y);
  return __fmaf_rn(__fmaf_rn(-q, 448.0f, amax), y, q);
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
  if (cache_dtype == src_dtype) {  // a 16-bit source into the same cache: the bits as given, as the CPU's copy
    const uint16_t *cs = static_cast<const uint16_t *>(c) + t * kLatent;
    uint16_t *h = reinterpret_cast<uint16_t *>(row);
#pragma unroll
    for (int k = 0; k < 4; k++) h[k * kThreads + tid] = cs[k * kThreads + tid];
    if (tid < kRope) h[kLatent + tid] = static_cast<const uint16_t *>(r)[t * kRope + tid];
    return;
  }
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

// The vectorized write, used when every base pointer is 16-byte aligned
// (which the row sizes then keep for every row): one warp per row, 8 warps
// per block, a grid of at most rows_blocks_per_sm blocks per SM in which each
// warp walks rows t, t + (warps in the grid), ..., issuing the next row's
// loads before it converts the current one, so that a row stays in flight
// while the warp computes (an fp8 value costs ~11 instructions).
// Lane l owns the latent elements [8 l, 8 l + 8) and [256 + 8 l, 264 + 8 l):
// each half of a row is one contiguous 512-byte load (bf16 / f16 sources)
// and one contiguous store per warp instruction. For the block format the
// first half of lanes 0-15 is block 0 and their second half block 2; lanes
// 16-31 hold blocks 1 and 3. Rope: lane l owns [2 l, 2 l + 2). Same bytes as
// kv_write_kernel (the same conversions; the block scale is the same max over
// the same 128 values).
constexpr int kWarpRows = 8;
// Resident blocks per SM (the register budget): an f32 source keeps two rows
// of 18 registers a lane, and 64 registers would spill.
constexpr int rows_blocks_per_sm(int src) { return src == DT_F32 ? 3 : 4; }

// One lane's share of a source row as loaded: c[0..1] (16-bit sources) or
// c[0..3] (f32) hold the latent elements, r.x (16-bit) or r (f32) the rope.
struct RawRow {
  uint4 c[4];
  uint2 r;
};

template <int kSrc>
__device__ __forceinline__ void load_row(const void *c /* [T, 512] */, const void *r /* [T, 64] */, int64_t t,
                                         int lane, RawRow *raw) {
  if (kSrc == DT_F32) {
    const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const float *>(c) + t * kLatent);
    raw->c[0] = __ldg(p + 2 * lane);
    raw->c[1] = __ldg(p + 2 * lane + 1);
    raw->c[2] = __ldg(p + 64 + 2 * lane);
    raw->c[3] = __ldg(p + 64 + 2 * lane + 1);
    raw->r = __ldg(reinterpret_cast<const uint2 *>(static_cast<const float *>(r) + t * kRope) + lane);
  } else {
    const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(c) + t * kLatent);
    raw->c[0] = __ldg(p + lane);
    raw->c[1] = __ldg(p + 32 + lane);
    raw->r.x = __ldg(reinterpret_cast<const unsigned int *>(static_cast<const uint16_t *>(r) + t * kRope) + lane);
  }
}

template <int kSrc>
__device__ __forceinline__ float unpack16(uint32_t w, int hi) {
  const uint16_t h = (uint16_t)(hi ? w >> 16 : w & 0xFFFFu);
  return kSrc == DT_BF16 ? mla_bf16_to_f32(h) : mla_f16_to_f32(h);
}

// cv[0..7]: elements 8 l..; cv[8..15]: elements 256 + 8 l..; rv: rope 2 l, 2 l + 1.
template <int kSrc>
__device__ __forceinline__ void unpack_row(const RawRow &raw, float *cv, float *rv) {
  if (kSrc == DT_F32) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
      cv[4 * k] = __uint_as_float(raw.c[k].x), cv[4 * k + 1] = __uint_as_float(raw.c[k].y);
      cv[4 * k + 2] = __uint_as_float(raw.c[k].z), cv[4 * k + 3] = __uint_as_float(raw.c[k].w);
    }
    rv[0] = __uint_as_float(raw.r.x), rv[1] = __uint_as_float(raw.r.y);
  } else {
#pragma unroll
    for (int k = 0; k < 2; k++) {
      const uint32_t u[4] = {raw.c[k].x, raw.c[k].y, raw.c[k].z, raw.c[k].w};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        cv[8 * k + 2 * j] = unpack16<kSrc>(u[j], 0);
        cv[8 * k + 2 * j + 1] = unpack16<kSrc>(u[j], 1);
      }
    }
    rv[0] = unpack16<kSrc>(raw.r.x, 0), rv[1] = unpack16<kSrc>(raw.r.x, 1);
  }
}

// The unsigned max of each 16-bit half (one instruction on sm_90).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return __vmaxu2(a, b);
#endif
}

// A finite 16-bit source magnitude (no sign) as float, exact.
template <int kSrc>
__device__ __forceinline__ float half_to_f32(uint32_t h) {
  if (kSrc == DT_BF16) return __uint_as_float(h << 16);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 530
  float f;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "r"(h));
  return f;
#else
  return mla_f16_to_f32((uint16_t)h);
#endif
}

// The finite amax and any-NaN of a 128-value block, the exact reduction
// (a block holding an inf or a NaN), over the 16 lanes that share it.
__device__ __forceinline__ float block_scale_exact(const float *x /* [8] */) {
  float fin = 0.0f;
  int nan = 0;
#pragma unroll
  for (int k = 0; k < 8; k++) {
    const float a = fabsf(x[k]);
    nan |= a != a;
    fin = fmaxf(fin, (a != a || a > FLT_MAX) ? 0.0f : a);
  }
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) {
    fin = fmaxf(fin, __shfl_xor_sync(0xffffffffu, fin, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  return mla_fp8_block_scale_from(fin, nan);
}

template <int kSrc, int kCache>
__device__ __forceinline__ void write_row(unsigned char *row, const RawRow &raw, int lane, float fp8_scale,
                                          float fp8_hi, float fp8_lo, bool fp8_scale_ok) {
  if (kCache == kSrc) {
    // A 16-bit source into the same cache: the bits as given, as the CPU's
    // copy (a round trip through float would quiet signalling NaNs).
    reinterpret_cast<uint4 *>(row)[lane] = raw.c[0];
    reinterpret_cast<uint4 *>(row + kLatent)[lane] = raw.c[1];
    reinterpret_cast<uint32_t *>(row + 2 * kLatent)[lane] = raw.r.x;
    return;
  }
  float cv[16], rv[2];
  unpack_row<kSrc>(raw, cv, rv);
  if (kCache == DT_BF16 || kCache == DT_F16) {
    const bool bf = kCache == DT_BF16;
    uint32_t u[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const uint16_t lo = bf ? mla_f32_to_bf16(cv[2 * j]) : mla_f32_to_f16(cv[2 * j]);
      const uint16_t hi = bf ? mla_f32_to_bf16(cv[2 * j + 1]) : mla_f32_to_f16(cv[2 * j + 1]);
      u[j] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
    reinterpret_cast<uint4 *>(row)[lane] = make_uint4(u[0], u[1], u[2], u[3]);
    reinterpret_cast<uint4 *>(row + kLatent)[lane] = make_uint4(u[4], u[5], u[6], u[7]);
    const uint16_t lo = bf ? mla_f32_to_bf16(rv[0]) : mla_f32_to_f16(rv[0]);
    const uint16_t hi = bf ? mla_f32_to_bf16(rv[1]) : mla_f32_to_f16(rv[1]);
    reinterpret_cast<uint32_t *>(row + 2 * kLatent)[lane] = (uint32_t)lo | ((uint32_t)hi << 16);
    return;
  }
  // scales of cv[0..7] and cv[8..15], their reciprocals split (mla_e4m3_rcp_split)
  float sa = fp8_scale, sb = fp8_scale, ha = fp8_hi, la = fp8_lo, hb = fp8_hi, lb = fp8_lo;
  bool ok;
  if (kCache == DT_FP8_BLOCK) {
    // The amax of each block over its 16 lanes, then whether any block of
    // the row holds an inf or a NaN (then every lane takes the exact
    // reduction). |x| bit patterns order like the values, NaNs above inf.
    float amax_a, amax_b;
    bool lane_finite, half_nonfinite;
    if (kSrc == DT_F32) {
      uint32_t ka = 0, kb = 0;
#pragma unroll
      for (int k = 0; k < 8; k++) {
        ka = max(ka, __float_as_uint(cv[k]) & 0x7FFFFFFFu);
        kb = max(kb, __float_as_uint(cv[8 + k]) & 0x7FFFFFFFu);
      }
      lane_finite = max(ka, kb) < 0x7F800000u;
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) {
        ka = max(ka, __shfl_xor_sync(0xffffffffu, ka, o));
        kb = max(kb, __shfl_xor_sync(0xffffffffu, kb, o));
      }
      half_nonfinite = max(ka, kb) >= 0x7F800000u;
      amax_a = __uint_as_float(ka);
      amax_b = __uint_as_float(kb);
    } else {
      // 16-bit sources: on the source words, two magnitudes a word (one
      // max.u16x2 for two values), both blocks in one word for the 16-lane
      // reduction (block a low, block b high): 4 shuffles instead of 8 and
      // no unpacking first. The 32-bit reduction cost ~40 more instructions
      // a row (of ~350), the most of what made this format the slowest
      // write (80 % of the copy rate against 87 % for per-tensor fp8).
      const uint32_t m = 0x7FFF7FFFu;
      const uint4 &A = raw.c[0], &B = raw.c[1];
      const uint32_t ma = max_u16x2(max_u16x2(A.x & m, A.y & m), max_u16x2(A.z & m, A.w & m));
      const uint32_t mb = max_u16x2(max_u16x2(B.x & m, B.y & m), max_u16x2(B.z & m, B.w & m));
      uint32_t p = max_u16x2(__byte_perm(ma, mb, 0x5410), __byte_perm(ma, mb, 0x7632));
      // a half at or above the format's inf (0x7F80 bf16, 0x7C00 f16) gets
      // bit 15 of its half set (no carry out: magnitudes are below 0x8000)
      const uint32_t bias = (0x8000u - (kSrc == DT_BF16 ? 0x7F80u : 0x7C00u)) * 0x10001u;
      lane_finite = ((p + bias) & 0x80008000u) == 0;
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) p = max_u16x2(p, __shfl_xor_sync(0xffffffffu, p, o));
      half_nonfinite = ((p + bias) & 0x80008000u) != 0;
      amax_a = half_to_f32<kSrc>(p & 0xFFFFu);
      amax_b = half_to_f32<kSrc>(p >> 16);
    }
    if (__any_sync(0xffffffffu, half_nonfinite)) {  // an inf or NaN in some block of the row
      sa = block_scale_exact(cv);
      sb = block_scale_exact(cv + 8);
    } else if (div448_fast_ok(amax_a) && div448_fast_ok(amax_b)) {
      sa = amax_a == 0.0f ? 1.0f : div448_fast(amax_a);
      sb = amax_b == 0.0f ? 1.0f : div448_fast(amax_b);
    } else {
      sa = block_scale_finite(amax_a);
      sb = block_scale_finite(amax_b);
    }
    ok = lane_finite && mla_e4m3_rcp_scale_ok(sa) && mla_e4m3_rcp_scale_ok(sb);
    mla_e4m3_rcp_split(sa, &ha, &la);
    mla_e4m3_rcp_split(sb, &hb, &lb);
    if ((lane & 15) == 0) {
      float *scales = reinterpret_cast<float *>(row + kBlockScaleOff);
      scales[lane >> 4] = sa;
      scales[2 + (lane >> 4)] = sb;
    }
  } else {
    ok = fp8_scale_ok;
#pragma unroll
    for (int k = 0; k < 16; k++) ok &= mla_e4m3_rcp_value_ok(cv[k]);
    ok &= mla_e4m3_rcp_value_ok(rv[0]) & mla_e4m3_rcp_value_ok(rv[1]);
  }
  // magnitudes, then the sign bits taken from the source words
  uint32_t w[4];
  w[0] = e4m3x4_rcp_abs(cv, sa, ha, la);
  w[1] = e4m3x4_rcp_abs(cv + 4, sa, ha, la);
  w[2] = e4m3x4_rcp_abs(cv + 8, sb, hb, lb);
  w[3] = e4m3x4_rcp_abs(cv + 12, sb, hb, lb);
  uint32_t wr = kCache == DT_FP8 ? e4m3x2(mla_e4m3_quotient_rcp_abs(rv[0], sa, ha, la),
                                          mla_e4m3_quotient_rcp_abs(rv[1], sa, ha, la))
                                 : 0u;
  if (kSrc == DT_F32) {
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] |= signs4_32(raw.c[k].x, raw.c[k].y, raw.c[k].z, raw.c[k].w);
    wr |= signs4_32(raw.r.x, raw.r.y, 0u, 0u) & 0xFFFFu;
  } else {
    w[0] |= signs4_16(raw.c[0].x, raw.c[0].y);
    w[1] |= signs4_16(raw.c[0].z, raw.c[0].w);
    w[2] |= signs4_16(raw.c[1].x, raw.c[1].y);
    w[3] |= signs4_16(raw.c[1].z, raw.c[1].w);
    wr |= signs4_16(raw.r.x, 0u) & 0xFFFFu;
  }
  if (!ok) {  // rare: a value or scale outside the fast path's domain
    w[0] = e4m3x4_exact(cv[0], cv[1], cv[2], cv[3], sa);
    w[1] = e4m3x4_exact(cv[4], cv[5], cv[6], cv[7], sa);
    w[2] = e4m3x4_exact(cv[8], cv[9], cv[10], cv[11], sb);
    w[3] = e4m3x4_exact(cv[12], cv[13], cv[14], cv[15], sb);
    if (kCache == DT_FP8) wr = e4m3x4_exact(rv[0], rv[1], 0.0f, 0.0f, sa) & 0xFFFFu;
  }
  reinterpret_cast<uint2 *>(row)[lane] = make_uint2(w[0], w[1]);
  reinterpret_cast<uint2 *>(row + kLatent / 2)[lane] = make_uint2(w[2], w[3]);
  if (kCache == DT_FP8) {
    reinterpret_cast<uint16_t *>(row + kLatent)[lane] = (uint16_t)wr;
  } else if (kSrc == DT_BF16) {
    // bf16 to bf16 through float is the identity but for a NaN, which
    // mla_f32_to_bf16 quiets (0x40): a half above 0x7F80 gets its bit 15 set
    const uint32_t w = raw.r.x, nan = ((w & 0x7FFF7FFFu) + 0x007F007Fu) & 0x80008000u;
    reinterpret_cast<uint32_t *>(row + kBlockRopeOff)[lane] = w | (nan >> 9);
  } else {
    const uint32_t b = (uint32_t)mla_f32_to_bf16(rv[0]) | ((uint32_t)mla_f32_to_bf16(rv[1]) << 16);
    reinterpret_cast<uint32_t *>(row + kBlockRopeOff)[lane] = b;
  }
}

// The row loop of kv_write_rows_kernel; kShard: a shard write (world > 1),
// whose slot arithmetic the plain write then does not carry.
template <int kSrc, int kCache, bool kShard>
__device__ __forceinline__ void write_rows(unsigned char *layer /* [num_slots, row_bytes] */, int64_t num_slots,
                                           size_t row_bytes, float fp8_scale, const int32_t *slots /* [T] */,
                                           const void *c /* [T, 512] */, const void *r /* [T, 64] */,
                                           int num_tokens, int *bad, int world, int rank) {
  // Row indices in int (num_tokens is an int; `more` is tested before t
  // grows, so t + stride never overflows): 64-bit ones lengthened the
  // per-row address arithmetic.
  const int lane = threadIdx.x & 31;
  const int stride = (int)gridDim.x * kWarpRows;
  int t = (int)blockIdx.x * kWarpRows + (int)(threadIdx.x >> 5);
  if (t >= num_tokens) return;
  float fp8_hi, fp8_lo;
  mla_e4m3_rcp_split(fp8_scale, &fp8_hi, &fp8_lo);
  const bool fp8_scale_ok = mla_e4m3_rcp_scale_ok(fp8_scale);
  RawRow cur;
  int32_t slot = __ldg(slots + t);
  if (!kShard || (slot >= 0 && slot % world == rank)) load_row<kSrc>(c, r, t, lane, &cur);
  for (;;) {
    // Prefetch the next row. A shard write reads only its own rows: the load
    // waits for the slot there.
    const bool more = t < num_tokens - stride;
    RawRow nxt;
    int32_t next_slot = -1;
    if (more) {
      next_slot = __ldg(slots + t + stride);
      if (!kShard || (next_slot >= 0 && next_slot % world == rank)) load_row<kSrc>(c, r, t + stride, lane, &nxt);
    }
    // Context parallel (world > 1): a global slot; only this rank's rows, at slot / world.
    bool mine = true;
    if (kShard && slot >= 0) {
      mine = slot % world == rank;
      slot /= world;
    }
    if (mine) {
      if (slot < 0 || slot >= num_slots) {  // checked per row: the host cannot see device slots
        if (lane == 0) atomicAdd(bad, 1);
      } else {
        write_row<kSrc, kCache>(layer + static_cast<size_t>(slot) * row_bytes, cur, lane, fp8_scale, fp8_hi,
                                fp8_lo, fp8_scale_ok);
      }
    }
    if (!more) break;
    t += stride;
    cur = nxt;
    slot = next_slot;
  }
}

template <int kSrc, int kCache>
__global__ void __launch_bounds__(32 * kWarpRows, rows_blocks_per_sm(kSrc)) kv_write_rows_kernel(
    unsigned char *layer /* [num_slots, row_bytes] */, int64_t num_slots, size_t row_bytes, float fp8_scale,
    const int32_t *slots /* [T] */, const void *c /* [T, 512] */, const void *r /* [T, 64] */, int num_tokens,
    int *bad, int world, int rank) {
  if (world > 1)
    write_rows<kSrc, kCache, true>(layer, num_slots, row_bytes, fp8_scale, slots, c, r, num_tokens, bad, world, rank);
  else
    write_rows<kSrc, kCache, false>(layer, num_slots, row_bytes, fp8_scale, slots, c, r, num_tokens, bad, world,
                                    rank);
}

// Enough blocks to fill the SMs once, fewer when there are fewer rows; the
// warps walk the rest.
template <int kSrc>
int launch_rows(int cache_dtype, int sms, cudaStream_t st, unsigned char *l, int64_t num_slots, size_t row_bytes,
                float fp8_scale, const int32_t *slots, const void *c, const void *r, int num_tokens, int *bad,
                int world, int rank) {
  const int64_t want = ((int64_t)num_tokens + kWarpRows - 1) / kWarpRows, fill = (int64_t)sms * rows_blocks_per_sm(kSrc);
  const unsigned grid = (unsigned)(want < fill ? want : fill);
  const dim3 block(32 * kWarpRows);
  switch (cache_dtype) {
    case DT_BF16:
      kv_write_rows_kernel<kSrc, DT_BF16><<<grid, block, 0, st>>>(l, num_slots, row_bytes, fp8_scale, slots, c, r,
                                                                  num_tokens, bad, world, rank);
      break;
    case DT_F16:
      kv_write_rows_kernel<kSrc, DT_F16><<<grid, block, 0, st>>>(l, num_slots, row_bytes, fp8_scale, slots, c, r,
                                                                 num_tokens, bad, world, rank);
      break;
    case DT_FP8:
      kv_write_rows_kernel<kSrc, DT_FP8><<<grid, block, 0, st>>>(l, num_slots, row_bytes, fp8_scale, slots, c, r,
                                                                 num_tokens, bad, world, rank);
      break;
    default:
      kv_write_rows_kernel<kSrc, DT_FP8_BLOCK><<<grid, block, 0, st>>>(l, num_slots, row_bytes, fp8_scale, slots, c,
                                                                       r, num_tokens, bad, world, rank);
      break;
  }
  return static_cast<int>(cudaGetLastError());
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
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (src_dtype == DT_F32)
      return launch_rows<DT_F32>(cache_dtype, sms, st, l, num_slots, row_bytes, fp8_scale, slots, c, r, num_tokens,
                                 bad, world, rank);
    if (src_dtype == DT_BF16)
      return launch_rows<DT_BF16>(cache_dtype, sms, st, l, num_slots, row_bytes, fp8_scale, slots, c, r,
                                  num_tokens, bad, world, rank);
    return launch_rows<DT_F16>(cache_dtype, sms, st, l, num_slots, row_bytes, fp8_scale, slots, c, r, num_tokens,
                               bad, world, rank);
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
