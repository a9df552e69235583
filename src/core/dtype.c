/* Scalar dtype conversion (fp16, e4m3) and activation load/store. */
#include "internal.h"

float mla_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: renormalise */
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400u));
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t mla_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
  if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
    /* units of 2^-24 (the smallest subnormal); the scaling is exact and
     * rintf rounds to nearest even. 0x400 (= 2^-14) is a valid normal. */
    float q = rintf(ldexpf(fabsf(f), 24));
    return sign | (uint16_t)q;
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return sign | (uint16_t)(r >> 13);
}

float mla_e4m3_to_f32(uint8_t b) {
  int sign = b & 0x80, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7) return NAN;
  if (exp == 0)
    v = ldexpf((float)man, -9); /* subnormal: man * 2^-3 * 2^-6 */
  else
    v = ldexpf((float)(8 + man), exp - 10);
  return sign ? -v : v;
}

uint8_t mla_f32_to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  uint8_t sign = signbit(f) ? 0x80 : 0;
  float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e; /* saturate */
  if (a < ldexpf(1.0f, -10)) {         /* below half the smallest subnormal (2^-9) */
    return sign;
  }
  int e;
  frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) => unbiased exponent e-1 */
  int ue = e - 1;
  if (ue < -6) ue = -6; /* subnormal range shares the 2^-6 exponent, step 2^-9 */
  float step = ldexpf(1.0f, ue - 3);
  float q = a / step; /* exact: power-of-two division */
  float r = rintf(q); /* ties to even under the default rounding mode */
  float v = r * step;
  if (v >= 448.0f) return sign | 0x7e;
  /* re-encode v */
  if (v < ldexpf(1.0f, -6)) return sign | (uint8_t)(int)(v / ldexpf(1.0f, -9));
  int ve;
  float vm = frexpf(v, &ve); /* v = vm * 2^ve, vm in [0.5,1) */
  int exp_field = ve - 1 + 7;
  int man = (int)(vm * 16.0f) - 8;
  return sign | (uint8_t)(exp_field << 3) | (uint8_t)man;
}

void mla_load_f32(mla_dtype t, const void *src, int64_t offset, int64_t n, float *dst) {
  switch (t) {
    case MLA_DTYPE_F32:
      memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
      break;
    case MLA_DTYPE_BF16: {
      const uint16_t *s = (const uint16_t *)src + offset;
      for (int64_t i = 0; i < n; i++) dst[i] = mla_bf16_to_f32(s[i]);
      break;
    }
    case MLA_DTYPE_F16: {
      const uint16_t *s = (const uint16_t *)src + offset;
      for (int64_t i = 0; i < n; i++) dst[i] = mla_f16_to_f32(s[i]);
      break;
    }
    default:
      for (int64_t i = 0; i < n; i++) dst[i] = NAN;
  }
}

void mla_store_f32(mla_dtype t, void *dst, int64_t offset, int64_t n, const float *src) {
  switch (t) {
    case MLA_DTYPE_F32:
      memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
      break;
    case MLA_DTYPE_BF16: {
      uint16_t *d = (uint16_t *)dst + offset;
      for (int64_t i = 0; i < n; i++) d[i] = mla_f32_to_bf16(src[i]);
      break;
    }
    case MLA_DTYPE_F16: {
      uint16_t *d = (uint16_t *)dst + offset;
      for (int64_t i = 0; i < n; i++) d[i] = mla_f32_to_f16(src[i]);
      break;
    }
    default:
      break;
  }
}

size_t mla_dtype_size(mla_dtype t) {
  switch (t) {
    case MLA_DTYPE_F32: return 4;
    case MLA_DTYPE_BF16:
    case MLA_DTYPE_F16: return 2;
    case MLA_DTYPE_FP8_E4M3: return 1;
    case MLA_DTYPE_F64: return 8;
    default: return 0;
  }
}

const char *mla_dtype_name(mla_dtype t) {
  switch (t) {
    case MLA_DTYPE_F32: return "f32";
    case MLA_DTYPE_BF16: return "bf16";
    case MLA_DTYPE_F16: return "f16";
    case MLA_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case MLA_DTYPE_FP8_E4M3_BLOCK: return "fp8_e4m3_block";
    case MLA_DTYPE_F64: return "f64";
  }
  return "unknown";
}

static int convertible(mla_dtype t) { return mla_is_act_dtype(t) || t == MLA_DTYPE_F64; }

mla_status mla_convert(const void *src, mla_dtype src_dtype, void *dst, mla_dtype dst_dtype, int64_t n) {
  if (n < 0 || (n > 0 && (!src || !dst))) return MLA_ERR_INVALID_ARGUMENT;
  if (!convertible(src_dtype) || !convertible(dst_dtype)) return MLA_ERR_UNSUPPORTED;
  float buf[256];
  for (int64_t i = 0; i < n; i += 256) {
    int64_t m = n - i < 256 ? n - i : 256;
    /* f64 -> f64 keeps full precision; everything else passes through f32,
     * which holds bf16/f16 exactly. */
    if (src_dtype == MLA_DTYPE_F64 && dst_dtype == MLA_DTYPE_F64) {
      memcpy((double *)dst + i, (const double *)src + i, (size_t)m * sizeof(double));
      continue;
    }
    if (src_dtype == MLA_DTYPE_F64)
      for (int64_t j = 0; j < m; j++) buf[j] = (float)((const double *)src)[i + j];
    else
      mla_load_f32(src_dtype, src, i, m, buf);
    if (dst_dtype == MLA_DTYPE_F64)
      for (int64_t j = 0; j < m; j++) ((double *)dst)[i + j] = buf[j];
    else
      mla_store_f32(dst_dtype, dst, i, m, buf);
  }
  return MLA_OK;
}
