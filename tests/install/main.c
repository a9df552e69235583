/* Consumer of an installed libmla (tests/install/run.sh builds it through
 * pkg-config and through find_package(mla)): one context, one cache, one row
 * written and read back, a merge of two attention states, and the header's
 * version against the library's. */
#include <mla.h>
#include <stdio.h>
#include <string.h>

static int fail(const char *what, mla_status st, const char *msg) {
  fprintf(stderr, "FAIL %s: %s (%s)\n", what, mla_status_string(st), msg ? msg : "");
  return 1;
}

int main(void) {
  if (mla_version() != MLA_VERSION_NUMBER) {
    fprintf(stderr, "FAIL header version %d, library %u\n", MLA_VERSION_NUMBER, mla_version());
    return 1;
  }
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", MLA_VERSION_MAJOR, MLA_VERSION_MINOR, MLA_VERSION_PATCH);
  if (strcmp(mla_version_string(), want) != 0) {
    fprintf(stderr, "FAIL version string %s, expected %s\n", mla_version_string(), want);
    return 1;
  }

  mla_ctx_desc cd = {.device = MLA_DEVICE_CPU, .num_threads = 1};
  mla_ctx *ctx = NULL;
  mla_status st = mla_ctx_create(&cd, &ctx);
  if (st != MLA_OK) return fail("mla_ctx_create", st, NULL);

  mla_kv_cache_desc kd = {.num_layers = 1, .num_pages = 4, .page_size = 16,
                          .dtype = MLA_DTYPE_BF16};
  mla_kv_cache *cache = NULL;
  st = mla_kv_cache_create(ctx, &kd, &cache);
  if (st != MLA_OK) return fail("mla_kv_cache_create", st, mla_ctx_last_error(ctx));

  /* Values exact in bf16, so the row must come back bit for bit. */
  float c[MLA_LATENT], r[MLA_ROPE], c2[MLA_LATENT], r2[MLA_ROPE];
  for (int i = 0; i < MLA_LATENT; i++) c[i] = (float)(i % 37) - 18.0f;
  for (int i = 0; i < MLA_ROPE; i++) r[i] = 0.25f * (float)i;
  const int32_t slot = 17;
  st = mla_kv_cache_write(cache, 0, 1, &slot, c, r, MLA_DTYPE_F32);
  if (st != MLA_OK) return fail("mla_kv_cache_write", st, mla_kv_cache_last_error(cache));
  st = mla_kv_cache_read(cache, 0, 1, &slot, c2, r2, MLA_DTYPE_F32);
  if (st != MLA_OK) return fail("mla_kv_cache_read", st, mla_kv_cache_last_error(cache));
  if (memcmp(c, c2, sizeof c) != 0 || memcmp(r, r2, sizeof r) != 0) {
    fprintf(stderr, "FAIL the row read back differs from the row written\n");
    return 1;
  }
  /* A bad slot is refused with a message, not a crash. */
  const int32_t bad = 4 * 16;
  st = mla_kv_cache_write(cache, 0, 1, &bad, c, r, MLA_DTYPE_F32);
  if (st != MLA_ERR_OUT_OF_RANGE || mla_kv_cache_last_error(cache)[0] == '\0')
    return fail("mla_kv_cache_write(bad slot)", st, "expected MLA_ERR_OUT_OF_RANGE");

  /* Merge two partial states (pulls in the math library in a static link):
   * weights e^0 : e^ln3 = 1 : 3, so o = (o1 + 3 o2) / 4 and lse = ln 4. */
  float o1[4] = {1, 2, 3, 4}, o2[4] = {5, 6, 7, 8}, om[4], l1 = 0.0f, l2 = 1.0986123f, lm;
  const void *parts[2] = {o1, o2};
  const float *lses[2] = {&l1, &l2};
  st = mla_merge_states(ctx, 2, 1, 1, 4, MLA_DTYPE_F32, 0, parts, lses, om, &lm);
  if (st != MLA_OK) return fail("mla_merge_states", st, mla_ctx_last_error(ctx));
  for (int i = 0; i < 4; i++) {
    float want = (o1[i] + 3.0f * o2[i]) / 4.0f;
    if (om[i] < want - 1e-4f || om[i] > want + 1e-4f) {
      fprintf(stderr, "FAIL merge: o[%d] = %g, expected %g\n", i, (double)om[i], (double)want);
      return 1;
    }
  }
  if (lm < 1.3862f || lm > 1.3864f) {
    fprintf(stderr, "FAIL merge: lse = %g, expected ln 4\n", (double)lm);
    return 1;
  }

  mla_kv_cache_destroy(cache);
  mla_ctx_destroy(ctx);
  printf("OK libmla %s\n", mla_version_string());
  return 0;
}
