/* Activation load/store and mla_convert (scalar formats: convert.h). */
#include "internal.h"

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
