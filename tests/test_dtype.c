/* Scalar dtype conversions (src/core/dtype.c): exhaustive round trips and a
 * comparison with the compiler's own conversions where it has them. */
#include <math.h>
#include <string.h>

#include "core/internal.h"
#include "test_util.h"

static int same_bits(float a, float b) { return memcmp(&a, &b, 4) == 0; }

int main(void) {
  tu_rng rng = {tu_seed("test_dtype", 7)};

  /* Every f16 pattern decodes and re-encodes to itself (NaNs stay NaN). */
  int f16_bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = mla_f16_to_f32((uint16_t)h);
    uint16_t back = mla_f32_to_f16(f);
    if (isnan(f) ? !isnan(mla_f16_to_f32(back)) : back != h) f16_bad++;
  }
  TU_CHECK(f16_bad == 0, "%d f16 patterns do not round trip", f16_bad);

#if defined(__FLT16_MAX__)
  /* f32 -> f16 rounding agrees with the compiler's _Float16 conversion. */
  int f16_mismatch = 0;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)tu_next(&rng);
    float f;
    memcpy(&f, &u, 4);
    if (isnan(f)) continue;
    _Float16 c = (_Float16)f;
    uint16_t want;
    memcpy(&want, &c, 2);
    if (mla_f32_to_f16(f) != want) f16_mismatch++;
  }
  /* Values near the f16 range too (the random bits above are mostly huge/tiny). */
  for (int i = 0; i < 200000; i++) {
    float f = (float)(tu_normal(&rng) * ldexp(1.0, tu_randint(&rng, -26, 17)));
    _Float16 c = (_Float16)f;
    uint16_t want;
    memcpy(&want, &c, 2);
    if (mla_f32_to_f16(f) != want) f16_mismatch++;
  }
  TU_CHECK(f16_mismatch == 0, "%d f32->f16 conversions differ from _Float16", f16_mismatch);
#endif

  /* bf16: every pattern round trips; rounding is to nearest even. */
  int bf_bad = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = mla_bf16_to_f32((uint16_t)h);
    if (!isnan(f) && mla_f32_to_bf16(f) != h) bf_bad++;
  }
  TU_CHECK(bf_bad == 0, "%d bf16 patterns do not round trip", bf_bad);
  TU_CHECK(mla_f32_to_bf16(1.0f + ldexpf(1.0f, -8)) == mla_f32_to_bf16(1.0f), "bf16 tie to even (down)");
  TU_CHECK(same_bits(mla_bf16_to_f32(mla_f32_to_bf16(1.0f + 3 * ldexpf(1.0f, -8))),
                     1.0f + ldexpf(1.0f, -6)),
           "bf16 tie to even (up)");
  TU_CHECK(isnan(mla_bf16_to_f32(mla_f32_to_bf16(NAN))), "bf16 NaN");

  /* e4m3fn: every non-NaN pattern round trips; saturation; ties to even. */
  int e_bad = 0;
  for (int b = 0; b < 256; b++) {
    float f = mla_e4m3_to_f32((uint8_t)b);
    if ((b & 0x7f) == 0x7f) {
      if (!isnan(f)) e_bad++;
      continue;
    }
    if (mla_f32_to_e4m3(f) != b) e_bad++;
  }
  TU_CHECK(e_bad == 0, "%d e4m3 patterns do not round trip", e_bad);
  TU_CHECK(mla_e4m3_to_f32(0x7e) == 448.0f, "e4m3 max is 448");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(1000.0f)) == 448.0f, "e4m3 saturates");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(-1e30f)) == -448.0f, "e4m3 saturates negative");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(INFINITY)) == 448.0f, "e4m3 saturates inf");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(17.0f)) == 16.0f, "e4m3 17 -> 16 (tie to even)");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(1.0625f)) == 1.0f, "e4m3 1.0625 -> 1 (tie to even)");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(1.1875f)) == 1.25f, "e4m3 1.1875 -> 1.25 (tie to even)");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(ldexpf(1.0f, -9))) == ldexpf(1.0f, -9), "e4m3 min subnormal");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(ldexpf(1.0f, -10))) == 0.0f, "e4m3 half min subnormal -> 0");
  TU_CHECK(mla_e4m3_to_f32(mla_f32_to_e4m3(ldexpf(3.0f, -10))) == ldexpf(1.0f, -8), "e4m3 1.5 ulp tie -> even");
  TU_CHECK(isnan(mla_e4m3_to_f32(mla_f32_to_e4m3(NAN))), "e4m3 NaN");
  /* Random values: the result is one of the two neighbours and the nearer. */
  int e_round_bad = 0;
  for (int i = 0; i < 100000; i++) {
    float f = (float)(tu_normal(&rng) * ldexp(1.0, tu_randint(&rng, -12, 9)));
    float q = mla_e4m3_to_f32(mla_f32_to_e4m3(f));
    if (fabsf(f) >= 448.0f) {
      if (fabsf(q) != 448.0f) e_round_bad++;
      continue;
    }
    /* nearest over all patterns */
    float best = 0;
    for (int b = 0; b < 256; b++) {
      float c = mla_e4m3_to_f32((uint8_t)b);
      if (!isnan(c) && fabsf(c - f) < fabsf(best - f)) best = c;
    }
    if (fabsf(q - f) != fabsf(best - f)) e_round_bad++;
  }
  TU_CHECK(e_round_bad == 0, "%d e4m3 roundings are not nearest", e_round_bad);

  /* Activation load/store through every dtype. */
  float src[5] = {1.0f, -2.5f, 0.0f, 65504.0f, 3.0e-5f}, dst[5];
  uint16_t buf16[5];
  mla_store_f32(MLA_DTYPE_F16, buf16, 0, 5, src);
  mla_load_f32(MLA_DTYPE_F16, buf16, 0, 5, dst);
  TU_CHECK(dst[0] == 1.0f && dst[1] == -2.5f && dst[3] == 65504.0f && fabsf(dst[4] - 3.0e-5f) < 1e-7f,
           "f16 load/store");
  mla_store_f32(MLA_DTYPE_BF16, buf16, 0, 5, src);
  mla_load_f32(MLA_DTYPE_BF16, buf16, 0, 5, dst);
  TU_CHECK(dst[0] == 1.0f && dst[1] == -2.5f && dst[2] == 0.0f, "bf16 load/store");
  TU_CHECK(mla_dtype_size(MLA_DTYPE_BF16) == 2 && mla_dtype_size(MLA_DTYPE_FP8_E4M3_BLOCK) == 0,
           "dtype sizes");
  TU_CHECK(strcmp(mla_status_string(MLA_ERR_CACHE_FULL), "MLA_ERR_CACHE_FULL") == 0 &&
               strcmp(mla_status_string((mla_status)999), "MLA_ERR_UNKNOWN") == 0,
           "status strings");
  TU_CHECK(mla_version() == MLA_VERSION_NUMBER && strcmp(mla_version_string(), "0.2.0") == 0,
           "version");
  /* mla_convert: through every pair, and its argument checks. */
  {
    double src64[6] = {1.0, -2.5, 0.1, 1e-3, 300.0, NAN}, back[6];
    float f32[6];
    uint16_t h[6];
    TU_STATUS(mla_convert(src64, MLA_DTYPE_F64, f32, MLA_DTYPE_F32, 6), MLA_OK);
    TU_CHECK(f32[2] == 0.1f && isnan(f32[5]), "f64 -> f32");
    mla_dtype ts[3] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
    for (int i = 0; i < 3; i++) {
      void *buf = ts[i] == MLA_DTYPE_F32 ? (void *)f32 : (void *)h;
      TU_STATUS(mla_convert(src64, MLA_DTYPE_F64, buf, ts[i], 6), MLA_OK);
      TU_STATUS(mla_convert(buf, ts[i], back, MLA_DTYPE_F64, 6), MLA_OK);
      TU_CHECK(back[0] == 1.0 && back[1] == -2.5 && back[4] == 300.0 && isnan(back[5]), "%s round trip",
               mla_dtype_name(ts[i]));
      double tol = ts[i] == MLA_DTYPE_F32 ? 1.0 / (1 << 24) : (ts[i] == MLA_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048);
      TU_CHECK(fabs(back[2] - 0.1) <= 0.1 * tol, "%s rounding of 0.1", mla_dtype_name(ts[i]));
    }
    TU_STATUS(mla_convert(src64, MLA_DTYPE_F64, back, MLA_DTYPE_F64, 6), MLA_OK);
    TU_CHECK(back[2] == 0.1, "f64 copy exact");
    TU_STATUS(mla_convert(NULL, MLA_DTYPE_F32, f32, MLA_DTYPE_F32, 1), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_convert(f32, MLA_DTYPE_F32, NULL, MLA_DTYPE_F32, 1), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_convert(f32, MLA_DTYPE_F32, h, MLA_DTYPE_F16, -1), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_convert(f32, MLA_DTYPE_F32, h, MLA_DTYPE_FP8_E4M3, 1), MLA_ERR_UNSUPPORTED);
    TU_STATUS(mla_convert(f32, (mla_dtype)77, h, MLA_DTYPE_F16, 1), MLA_ERR_UNSUPPORTED);
    TU_STATUS(mla_convert(NULL, MLA_DTYPE_F32, NULL, MLA_DTYPE_F16, 0), MLA_OK);
  }
  return tu_finish("test_dtype");
}
