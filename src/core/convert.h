/* Scalar number-format conversions shared by the CPU code and the CUDA
 * kernels (one source, so both quantize bit-identically). Plain C that nvcc
 * also compiles as __host__ __device__. */
#ifndef MLA_CORE_CONVERT_H
#define MLA_CORE_CONVERT_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MLA_HD __host__ __device__ __forceinline__
#else
#define MLA_HD static inline
#endif

MLA_HD uint32_t mla_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MLA_HD float mla_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---- bf16 ---------------------------------------------------------------- */
MLA_HD float mla_bf16_to_f32(uint16_t h) { return mla_bits_f32((uint32_t)h << 16); }
/* Round to nearest even; NaN stays a (quiet) NaN. */
MLA_HD uint16_t mla_f32_to_bf16(float f) {
  uint32_t u = mla_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ---- fp16 ---------------------------------------------------------------- */
MLA_HD float mla_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) /* zero or subnormal: man * 2^-24, exact in f32 */
    return mla_bits_f32(sign | mla_f32_bits((float)man * 5.9604644775390625e-8f));
  if (exp == 31) return mla_bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));
  return mla_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
/* Round to nearest even; overflow to inf; NaN stays NaN. */
MLA_HD uint16_t mla_f32_to_f16(float f) {
  uint32_t u = mla_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520 */
  if (a < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
    /* units of 2^-24: the scaling is exact, rintf rounds to nearest even, and
     * 0x400 (= 2^-14) is the smallest normal. */
    float q = rintf(mla_bits_f32(a) * 16777216.0f);
    return sign | (uint16_t)q;
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return sign | (uint16_t)(r >> 13);
}

/* ---- e4m3fn: bias 7, no inf, 0x7f/0xff NaN, max finite 448 -------------- */
MLA_HD float mla_e4m3_to_f32(uint8_t b) {
  uint32_t sign = (uint32_t)(b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
  if (exp == 0xf && man == 7) return NAN;
  if (exp == 0) /* subnormal: man * 2^-9, exact */
    return mla_bits_f32(sign | mla_f32_bits((float)man * (1.0f / 512.0f)));
  return mla_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}
/* Saturating (|x| > 448 -> +-448), round to nearest even, NaN -> 0x7f. */
MLA_HD uint8_t mla_f32_to_e4m3(float f) {
  if (f != f) return 0x7f;
  uint32_t u = mla_f32_bits(f);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x43e00000u) return sign | 0x7e;   /* >= 448 (incl. inf) */
  if (a < 0x3c800000u) {                      /* below 2^-6: subnormal, step 2^-9 */
    float q = rintf(mla_bits_f32(a) * 512.0f); /* exact scaling; ties to even */
    return sign | (uint8_t)q;                 /* q == 8 is 2^-6, the smallest normal */
  }
  /* Normal: keep 3 mantissa bits, round to nearest even on the 20 dropped. */
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t e = (r >> 23) - 120u, m = (r >> 20) & 7u;
  if (e > 15 || (e == 15 && m == 7)) return sign | 0x7e; /* rounded past 448 */
  return sign | (uint8_t)((e << 3) | m);
}

/* v / scale quantized to e4m3 with one rounding of the exact quotient: the
 * quotient is formed in double and narrowed to float with round-to-odd, which
 * keeps the later rounding to 4 significant bits exact (24 >= 4 + 2). */
MLA_HD uint8_t mla_e4m3_quantize(float v, float scale) {
  double q = (double)v / (double)scale;
  float f = (float)q;
  if ((double)f != q && q == q) {
    uint32_t u = mla_f32_bits(f);
    if (!(u & 1u)) {
      /* step one ulp toward q: the odd neighbour on q's side (the sign is
       * read from the bit so that -0.0 steps to the negative side) */
      uint32_t mag_up = ((double)f < q) == ((u >> 31) == 0);
      f = mla_bits_f32(mag_up ? u + 1u : u - 1u);
    }
  }
  return mla_f32_to_e4m3(f);
}

/* mla_e4m3_quantize(v, s) without a division (the GPU write's fast path; the
 * function above stays the definition): returns a float f with
 * mla_f32_to_e4m3(f) == mla_e4m3_quantize(v, s) for every v with |v| <= 2^64
 * (NaN, inf and larger values are the caller's to send to mla_e4m3_quantize)
 * when 2^-40 <= s <= 2^40 and hi + lo is 1 / s split by mla_e4m3_rcp_split
 * (any hi with |1 - s hi| <= 2^-20). It works on a = |v| and sets v's sign
 * at the end (e4m3 rounding is symmetric). Why it is exact, q = a / s:
 * - a < 2^-56 is raised to 2^-56: both quotients are below 2^-16, and e4m3
 *   rounds either to zero.
 * - Then q lies in [2^-96, 2^104]: every quotient below is a normal float,
 *   and a nonzero residual a - f s (f a float near q) is a multiple of
 *   ulp(f) ulp(s) >= 2^-103, so an fma rounds it with its sign, never to 0.
 * - hi + lo is 1 / s within 2^-39 relative (one Newton step from hi), so
 *   a hi + RN(a lo) is q within 2^-38 q, far inside half a float spacing
 *   (>= 2^-25 q): f, its rounding, is q when q is a float and one of the two
 *   floats around q otherwise (f is faithful).
 * - r = a - f s then says which: q's truncation toward zero is f, or the
 *   float below f when r < 0; with its last bit set when r != 0 that is q
 *   rounded to odd, the float that mla_e4m3_quantize rounds to e4m3 (its
 *   double quotient, q rounded to 53 bits, is at least 2^-47 q from every
 *   float but q, so it has the same rounding to odd), and rounding to odd
 *   then to 4 significant bits is rounding once.
 * Cost: three float operations and a few integer ones, no branch, no
 * division (the definition's double division and branches made the GPU's fp8
 * write compute-bound). */
MLA_HD float mla_fmaf_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}
MLA_HD float mla_fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MLA_HD void mla_e4m3_rcp_split(float s, float *hi, float *lo) {
#ifdef __CUDA_ARCH__
  float h;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(h) : "f"(s)); /* 2^-23 relative, no division */
#else
  const float h = 1.0f / s;
#endif
  *hi = h;
  *lo = mla_fmul_rn(h, mla_fmaf_rn(-s, h, 1.0f));
}
/* The float for |v| (the GPU sets the e4m3 sign bits four at a time: the
 * byte of -x is the byte of x | 0x80). */
MLA_HD float mla_e4m3_quotient_rcp_abs(float v, float s, float hi, float lo) {
  const float a = fmaxf(fabsf(v), 0x1p-56f);
  const float f = mla_fmaf_rn(a, hi, mla_fmul_rn(a, lo));
  const float r = mla_fmaf_rn(-f, s, a);
  uint32_t u = mla_f32_bits(f);
  if (r != 0.0f) u = (u - (mla_f32_bits(r) >> 31)) | 1u; /* the float below f when r < 0 */
  return mla_bits_f32(u);
}
MLA_HD float mla_e4m3_quotient_rcp(float v, float s, float hi, float lo) {
  return mla_bits_f32(mla_f32_bits(mla_e4m3_quotient_rcp_abs(v, s, hi, lo)) | (mla_f32_bits(v) & 0x80000000u));
}
/* The domain of mla_e4m3_quotient_rcp(_abs): scale and value checks. */
MLA_HD int mla_e4m3_rcp_scale_ok(float s) { return s >= 0x1p-40f && s <= 0x1p40f; }
MLA_HD int mla_e4m3_rcp_value_ok(float v) { return fabsf(v) <= 0x1p64f; }

/* amax / 448 rounded to nearest without a division, for amax in
 * [2^-100, 2^127]: a product by RN(1 / 448) and one correction, which checked
 * against the division for every float of that range gives the same bits.
 * Elsewhere, the division. */
MLA_HD float mla_div448(float amax) {
  if (!(amax >= 0x1p-100f && amax <= 0x1p127f)) return amax / 448.0f;
  const float y = 1.0f / 448.0f, q = mla_fmul_rn(amax, y);
  return mla_fmaf_rn(mla_fmaf_rn(-q, 448.0f, amax), y, q);
}

/* Block-scaled format: the scale of one 128-value block is amax / 448 over
 * the finite values (1.0 when that is 0), NaN when any value is NaN (the
 * whole block then decodes as NaN); infinities saturate to +-448 * scale.
 * Split in two so a GPU block can reduce amax/has_nan in parallel. */
MLA_HD float mla_fp8_block_scale_from(float finite_amax, int has_nan) {
  if (has_nan) return NAN;
  if (finite_amax == 0.0f) return 1.0f;
  float s = finite_amax / 448.0f;
  /* amax below 448 * FLT_TRUE_MIN underflows; any positive scale of that
   * size keeps every quotient below 448. */
  return s > 0.0f ? s : 1.40129846e-45f;
}
MLA_HD float mla_fp8_block_scale(const float *x /* [128] */) {
  float amax = 0.0f;
  int has_nan = 0;
  for (int i = 0; i < 128; i++) {
    float a = fabsf(x[i]);
    if (a != a)
      has_nan = 1;
    else if (a <= FLT_MAX && a > amax)
      amax = a;
  }
  return mla_fp8_block_scale_from(amax, has_nan);
}

#endif /* MLA_CORE_CONVERT_H */
