/* Paged latent KV cache: write/read round trips for every cache dtype and
 * activation dtype against the float64 oracle's rounding (tests/ref), fp8
 * saturation and NaN, duplicate slots, copy_rows, layer scales, and every bad
 * argument of every mla_kv_cache_* call. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h" /* white-box: mla_cache_row_bytes_for, row helpers */
#include "test_util.h"

#define L MLA_LATENT
#define R MLA_ROPE

static mla_ctx *g_ctx;
static tu_rng g_rng;

static const mla_dtype k_cache_dtypes[] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3,
                                           MLA_DTYPE_FP8_E4M3_BLOCK};
static const mla_dtype k_act_dtypes[] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
static const int k_page_sizes[] = {1, 16, 64, 128, 256};

static mla_kv_cache *make_cache(mla_dtype dt, int layers, int pages, int page_size,
                                const float *scales) {
  mla_kv_cache_desc d = {layers, pages, page_size, dt, scales};
  mla_kv_cache *c = NULL;
  mla_status st = mla_kv_cache_create(g_ctx, &d, &c);
  TU_CHECK(st == MLA_OK && c, "create %s P=%d: %s (%s)", mla_dtype_name(dt), page_size,
           mla_status_string(st), mla_ctx_last_error(g_ctx));
  return c;
}

/* ---- the expected contents, from the oracle's rounding ------------------------- */

/* What the cache stores and a read gives back (as a float, before the
 * destination dtype), for a source value x already in float. */
static double expect_stored(mla_dtype cdt, double x, float scale) {
  switch (cdt) {
    case MLA_DTYPE_BF16: return ref_round_bf16(x);
    case MLA_DTYPE_F16: return ref_round_f16(x);
    case MLA_DTYPE_FP8_E4M3:
      /* e4m3 * scale is exact in double; the library multiplies in float. */
      return (double)(float)(ref_round_e4m3(x / (double)scale) * (double)scale);
    default: return NAN;
  }
}

/* Block scale as the format defines it: amax / 448 in fp32 over the finite
 * values, 1 for an all-zero block, NaN when the block holds a NaN. */
static float test_block_scale(const double *x /* [128] */) {
  float amax = 0.0f;
  for (int i = 0; i < MLA_FP8_BLOCK; i++) {
    if (isnan(x[i])) return NAN;
    if (isfinite(x[i]) && fabs(x[i]) > amax) amax = (float)fabs(x[i]);
  }
  return amax == 0.0f ? 1.0f : amax / 448.0f;
}

/* Expected decoded row (before the destination dtype) for source values
 * xc [512], xr [64]. */
static void expect_row(mla_dtype cdt, float scale, const double *xc, const double *xr, double *ec,
                       double *er) {
  if (cdt == MLA_DTYPE_FP8_E4M3_BLOCK) {
    for (int b = 0; b < L / MLA_FP8_BLOCK; b++) {
      const double *x = xc + b * MLA_FP8_BLOCK;
      float s = test_block_scale(x);
      for (int i = 0; i < MLA_FP8_BLOCK; i++)
        ec[b * MLA_FP8_BLOCK + i] = (double)(float)(ref_round_e4m3(x[i] / (double)s) * (double)s);
    }
    for (int i = 0; i < R; i++) er[i] = ref_round_bf16(xr[i]);
    return;
  }
  for (int i = 0; i < L; i++) ec[i] = expect_stored(cdt, xc[i], scale);
  for (int i = 0; i < R; i++) er[i] = expect_stored(cdt, xr[i], scale);
}

static double round_dst(mla_dtype t, double v) {
  switch (t) {
    case MLA_DTYPE_BF16: return ref_round_bf16(v);
    case MLA_DTYPE_F16: return ref_round_f16(v);
    default: return (double)(float)v;
  }
}

static int same(double a, double b) { return (isnan(a) && isnan(b)) || a == b; }

/* Count mismatches of got [n] vs want [n] (exact, NaN == NaN); report the first. */
static int64_t count_diff(const double *got, const double *want, int64_t n, const char *what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    if (!same(got[i], want[i])) {
      if (bad == 0)
        fprintf(stderr, "  %s: first mismatch at %lld: got %.9g want %.9g\n", what, (long long)i,
                got[i], want[i]);
      bad++;
    }
  }
  return bad;
}

/* Source rows as the library sees them: x converted to src dtype and back. */
static void as_source(mla_dtype src, const float *x, void *buf, double *xd, int64_t n) {
  tu_to_dtype(src, x, buf, n);
  tu_from_dtype(src, buf, xd, n);
}

/* Read T rows at slots and compare with the expected decoded rows ec/er
 * [T, 512]/[T, 64] in every destination dtype. Returns mismatches. */
static int64_t check_read(const mla_kv_cache *cache, int layer, int T, const int32_t *slots,
                          const double *ec, const double *er, const char *what) {
  int64_t bad = 0;
  void *co = malloc((size_t)T * L * 4), *ro = malloc((size_t)T * R * 4);
  double *gc = malloc(sizeof(double) * (size_t)T * L), *gr = malloc(sizeof(double) * (size_t)T * R);
  double *wc = malloc(sizeof(double) * (size_t)T * L), *wr = malloc(sizeof(double) * (size_t)T * R);
  for (size_t d = 0; d < 3; d++) {
    mla_dtype dst = k_act_dtypes[d];
    tu_poison(co, (size_t)T * L * 4);
    tu_poison(ro, (size_t)T * R * 4);
    mla_status st = mla_kv_cache_read(cache, layer, T, slots, co, ro, dst);
    TU_CHECK(st == MLA_OK, "%s read -> %s: %s", what, mla_dtype_name(dst), mla_status_string(st));
    tu_from_dtype(dst, co, gc, (int64_t)T * L);
    tu_from_dtype(dst, ro, gr, (int64_t)T * R);
    for (int64_t i = 0; i < (int64_t)T * L; i++) wc[i] = round_dst(dst, ec[i]);
    for (int64_t i = 0; i < (int64_t)T * R; i++) wr[i] = round_dst(dst, er[i]);
    char buf[160];
    snprintf(buf, sizeof buf, "%s c -> %s", what, mla_dtype_name(dst));
    int64_t b1 = count_diff(gc, wc, (int64_t)T * L, buf);
    snprintf(buf, sizeof buf, "%s r -> %s", what, mla_dtype_name(dst));
    int64_t b2 = count_diff(gr, wr, (int64_t)T * R, buf);
    TU_CHECK(b1 == 0 && b2 == 0, "%s -> %s: %lld c and %lld r mismatches", what,
             mla_dtype_name(dst), (long long)b1, (long long)b2);
    bad += b1 + b2;
  }
  free(co);
  free(ro);
  free(gc);
  free(gr);
  free(wc);
  free(wr);
  return bad;
}

/* ---- round trips ------------------------------------------------------------- */

/* Fill T rows, write them with every source dtype to random distinct slots of
 * every layer, read them back in every destination dtype. */
static void test_round_trip(mla_dtype cdt, int P) {
  const int T = 40, layers = 2;
  int pages = (int)((T + P - 1) / P) + 2;
  const float scales[2] = {0.75f, 0.0213f}; /* the second is not a short binary fraction */
  mla_kv_cache *cache = make_cache(cdt, layers, pages, P, scales);
  if (!cache) return;
  int64_t nslots = (int64_t)pages * P;
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)nslots);
  float *xc = malloc(sizeof(float) * T * L), *xr = malloc(sizeof(float) * T * R);
  void *bc = malloc((size_t)T * L * 4), *br = malloc((size_t)T * R * 4);
  double *dc = malloc(sizeof(double) * T * L), *dr = malloc(sizeof(double) * T * R);
  double *ec = malloc(sizeof(double) * T * L), *er = malloc(sizeof(double) * T * R);
  char what[128];
  for (size_t s = 0; s < 3; s++) {
    mla_dtype src = k_act_dtypes[s];
    for (int layer = 0; layer < layers; layer++) {
      for (int64_t i = 0; i < nslots; i++) perm[i] = (int32_t)i;
      tu_shuffle_i32(&g_rng, perm, (int)nslots);
      /* fp8: spread values over most of the e4m3 range of this layer's scale. */
      double sigma = cdt == MLA_DTYPE_FP8_E4M3 ? 60.0 * scales[layer] : 1.0;
      tu_fill_bf16_normal(&g_rng, xc, (int64_t)T * L, sigma);
      tu_fill_bf16_normal(&g_rng, xr, (int64_t)T * R, sigma);
      as_source(src, xc, bc, dc, (int64_t)T * L);
      as_source(src, xr, br, dr, (int64_t)T * R);
      float sc = cdt == MLA_DTYPE_FP8_E4M3 ? scales[layer] : 1.0f;
      for (int t = 0; t < T; t++) expect_row(cdt, sc, dc + t * L, dr + t * R, ec + t * L, er + t * R);
      mla_status st = mla_kv_cache_write(cache, layer, T, perm, bc, br, src);
      TU_CHECK(st == MLA_OK, "write %s <- %s: %s (%s)", mla_dtype_name(cdt), mla_dtype_name(src),
               mla_status_string(st), mla_kv_cache_last_error(cache));
      snprintf(what, sizeof what, "cache %s P=%d layer %d src %s", mla_dtype_name(cdt), P, layer,
               mla_dtype_name(src));
      check_read(cache, layer, T, perm, ec, er, what);

      /* bf16 cache, bf16-representable input: bit-exact without the oracle. */
      if (cdt == MLA_DTYPE_BF16 && src != MLA_DTYPE_F16) {
        float *oc = malloc(sizeof(float) * T * L), *orr = malloc(sizeof(float) * T * R);
        mla_kv_cache_read(cache, layer, T, perm, oc, orr, MLA_DTYPE_F32);
        TU_CHECK(memcmp(oc, xc, sizeof(float) * T * L) == 0 &&
                     memcmp(orr, xr, sizeof(float) * T * R) == 0,
                 "%s: bf16 round trip not exact", what);
        free(oc);
        free(orr);
      }
    }
  }
  free(perm);
  free(xc);
  free(xr);
  free(bc);
  free(br);
  free(dc);
  free(dr);
  free(ec);
  free(er);
  mla_kv_cache_destroy(cache);
}

/* Many rows (parallel path) with heavy slot duplication: the last row of each
 * slot wins, for every cache dtype; checked for T below and above the
 * parallel threshold. */
static void test_duplicates(mla_dtype cdt, int T) {
  const int P = 16, pages = 8;
  const float scale = 0.05f;
  mla_kv_cache *cache = make_cache(cdt, 1, pages, P, &scale);
  if (!cache) return;
  const int distinct = 37;
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)T);
  float *xc = malloc(sizeof(float) * (size_t)T * L), *xr = malloc(sizeof(float) * (size_t)T * R);
  double *dc = malloc(sizeof(double) * (size_t)T * L), *dr = malloc(sizeof(double) * (size_t)T * R);
  int32_t pool[37], last[37];
  int32_t perm[8 * 16];
  for (int i = 0; i < pages * P; i++) perm[i] = i;
  tu_shuffle_i32(&g_rng, perm, pages * P);
  for (int k = 0; k < distinct; k++) {
    pool[k] = perm[k];
    last[k] = -1;
  }
  for (int t = 0; t < T; t++) {
    int k = tu_randint(&g_rng, 0, distinct - 1);
    slots[t] = pool[k];
    last[k] = t;
  }
  tu_fill_bf16_normal(&g_rng, xc, (int64_t)T * L, 1.0);
  tu_fill_bf16_normal(&g_rng, xr, (int64_t)T * R, 1.0);
  for (int64_t i = 0; i < (int64_t)T * L; i++) dc[i] = xc[i];
  for (int64_t i = 0; i < (int64_t)T * R; i++) dr[i] = xr[i];
  TU_STATUS(mla_kv_cache_write(cache, 0, T, slots, xc, xr, MLA_DTYPE_F32), MLA_OK);
  double *ec = malloc(sizeof(double) * distinct * L), *er = malloc(sizeof(double) * distinct * R);
  int32_t rs[37];
  int n = 0;
  for (int k = 0; k < distinct; k++) {
    if (last[k] < 0) continue;
    rs[n] = pool[k];
    expect_row(cdt, scale, dc + (size_t)last[k] * L, dr + (size_t)last[k] * R, ec + n * L,
               er + n * R);
    n++;
  }
  char what[96];
  snprintf(what, sizeof what, "duplicates %s T=%d", mla_dtype_name(cdt), T);
  check_read(cache, 0, n, rs, ec, er, what);
  free(slots);
  free(xc);
  free(xr);
  free(dc);
  free(dr);
  free(ec);
  free(er);
  mla_kv_cache_destroy(cache);
}

/* fp8 per-tensor: values beyond 448 * scale clamp (inf too); NaN stays NaN
 * in every format; the block format turns its block NaN. */
static void test_saturation_nan(void) {
  const float scale = 0.5f;
  mla_kv_cache *c8 = make_cache(MLA_DTYPE_FP8_E4M3, 1, 2, 16, &scale);
  if (c8) {
    float xc[L], xr[R], oc[L], orr[R];
    for (int i = 0; i < L; i++) xc[i] = (i % 2 ? -1.0f : 1.0f) * (float)(100 + 3 * i);
    xc[7] = INFINITY;
    xc[8] = -INFINITY;
    for (int i = 0; i < R; i++) xr[i] = (i % 2 ? 1.0f : -1.0f) * 1000.0f;
    int32_t slot = 5;
    TU_STATUS(mla_kv_cache_write(c8, 0, 1, &slot, xc, xr, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_kv_cache_read(c8, 0, 1, &slot, oc, orr, MLA_DTYPE_F32), MLA_OK);
    int bad = 0;
    for (int i = 0; i < L; i++) {
      double want = fabs(xc[i]) >= 224.0 ? copysign(224.0, xc[i])
                                         : ref_round_e4m3(xc[i] / 0.5) * 0.5;
      if (oc[i] != want) bad++;
    }
    for (int i = 0; i < R; i++)
      if (orr[i] != copysign(224.0, xr[i])) bad++;
    TU_CHECK(bad == 0, "fp8 saturation: %d wrong values (c[7] = %g)", bad, (double)oc[7]);
    TU_CHECK(oc[7] == 224.0f && oc[8] == -224.0f, "inf saturates: %g %g", (double)oc[7],
             (double)oc[8]);
    mla_kv_cache_destroy(c8);
  }

  for (size_t k = 0; k < 4; k++) {
    mla_dtype cdt = k_cache_dtypes[k];
    mla_kv_cache *c = make_cache(cdt, 1, 2, 16, NULL);
    if (!c) continue;
    float xc[L], xr[R], oc[L], orr[R];
    tu_fill_bf16_normal(&g_rng, xc, L, 1.0);
    tu_fill_bf16_normal(&g_rng, xr, R, 1.0);
    xc[200] = NAN; /* block 1 */
    xr[3] = NAN;
    int32_t slot = 17;
    TU_STATUS(mla_kv_cache_write(c, 0, 1, &slot, xc, xr, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_kv_cache_read(c, 0, 1, &slot, oc, orr, MLA_DTYPE_F32), MLA_OK);
    int wrong = 0;
    for (int i = 0; i < L; i++) {
      int want_nan = cdt == MLA_DTYPE_FP8_E4M3_BLOCK ? (i / 128 == 1) : (i == 200);
      if (want_nan != (isnan(oc[i]) != 0)) wrong++;
    }
    for (int i = 0; i < R; i++)
      if ((i == 3) != (isnan(orr[i]) != 0)) wrong++;
    TU_CHECK(wrong == 0, "NaN propagation in %s: %d wrong positions", mla_dtype_name(cdt), wrong);
    mla_kv_cache_destroy(c);
  }

  /* Block format: an infinity saturates to +-448 * scale of the finite amax;
   * an all-zero block decodes to zeros (scale 1). */
  mla_kv_cache *cb = make_cache(MLA_DTYPE_FP8_E4M3_BLOCK, 1, 2, 1, NULL);
  if (cb) {
    float xc[L], xr[R], oc[L], orr[R];
    tu_fill_bf16_normal(&g_rng, xc, L, 2.0);
    memset(xr, 0, sizeof xr);
    for (int i = 128; i < 256; i++) xc[i] = 0.0f;
    xc[300] = -INFINITY;
    int32_t slot = 1;
    TU_STATUS(mla_kv_cache_write(cb, 0, 1, &slot, xc, xr, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_kv_cache_read(cb, 0, 1, &slot, oc, orr, MLA_DTYPE_F32), MLA_OK);
    double amax = 0;
    for (int i = 256; i < 384; i++)
      if (isfinite(xc[i]) && fabs(xc[i]) > amax) amax = fabs(xc[i]);
    float s = (float)amax / 448.0f;
    TU_CHECK(oc[300] == (float)(-448.0 * (double)s), "block inf -> %g, want %g", (double)oc[300],
             -448.0 * s);
    int nz = 0;
    for (int i = 128; i < 256; i++) nz += oc[i] != 0.0f;
    TU_CHECK(nz == 0, "all-zero block decoded %d non-zeros", nz);
    const unsigned char *raw = NULL;
    void *p = NULL;
    mla_kv_cache_layer_data(cb, 0, &p);
    raw = (const unsigned char *)p + (size_t)slot * MLA_FP8_BLOCK_ROW_BYTES;
    float sc[4];
    memcpy(sc, raw + 512, sizeof sc);
    TU_CHECK(sc[1] == 1.0f, "all-zero block scale = %g, want 1", (double)sc[1]);
    TU_CHECK(sc[2] == s, "block 2 scale %g, want %g", (double)sc[2], (double)s);
    mla_kv_cache_destroy(cb);
  }
}

static void test_copy_rows(void) {
  for (size_t k = 0; k < 4; k++) {
    mla_dtype cdt = k_cache_dtypes[k];
    const int layers = 3, P = 16, pages = 6, n = 20;
    mla_kv_cache *c = make_cache(cdt, layers, pages, P, NULL);
    if (!c) continue;
    int32_t src[20], dst[20];
    for (int i = 0; i < n; i++) {
      src[i] = (int32_t)(P + i);          /* pages 1..2 */
      dst[i] = (int32_t)(4 * P + 19 - i); /* pages 4..5, reversed */
    }
    float *xc = malloc(sizeof(float) * n * L), *xr = malloc(sizeof(float) * n * R);
    for (int l = 0; l < layers; l++) {
      tu_fill_bf16_normal(&g_rng, xc, (int64_t)n * L, 1.0);
      tu_fill_bf16_normal(&g_rng, xr, (int64_t)n * R, 1.0);
      TU_STATUS(mla_kv_cache_write(c, l, n, src, xc, xr, MLA_DTYPE_F32), MLA_OK);
    }
    TU_STATUS(mla_kv_cache_copy_rows(c, n, src, dst), MLA_OK);
    size_t rb = 0;
    mla_kv_cache_row_bytes(c, &rb);
    int bad = 0;
    for (int l = 0; l < layers; l++) {
      void *p = NULL;
      mla_kv_cache_layer_data(c, l, &p);
      const unsigned char *base = p;
      for (int i = 0; i < n; i++)
        if (memcmp(base + (size_t)src[i] * rb, base + (size_t)dst[i] * rb, rb) != 0) bad++;
      /* a row written with data is not all zero: the copy moved real bytes */
      int nonzero = 0;
      for (size_t b = 0; b < rb; b++) nonzero |= base[(size_t)dst[0] * rb + b];
      TU_CHECK(nonzero, "copied row of layer %d is all zero", l);
    }
    TU_CHECK(bad == 0, "copy_rows %s: %d rows differ", mla_dtype_name(cdt), bad);
    /* and the decoded values agree */
    float *a = malloc(sizeof(float) * n * L), *b = malloc(sizeof(float) * n * L);
    mla_kv_cache_read(c, layers - 1, n, src, a, NULL, MLA_DTYPE_F32);
    mla_kv_cache_read(c, layers - 1, n, dst, b, NULL, MLA_DTYPE_F32);
    int diff = 0;
    for (int i = 0; i < n * L; i++) diff += !same(a[i], b[i]);
    TU_CHECK(diff == 0, "copy_rows %s: %d decoded values differ", mla_dtype_name(cdt), diff);
    free(a);
    free(b);
    free(xc);
    free(xr);
    mla_kv_cache_destroy(c);
  }
}

static void test_queries_and_scale(void) {
  const size_t want_bytes[4] = {1152, 1152, 576, 656};
  for (size_t k = 0; k < 4; k++) {
    const float scales[3] = {0.5f, 2.0f, 0.125f};
    mla_kv_cache *c = make_cache(k_cache_dtypes[k], 3, 5, 64, scales);
    if (!c) continue;
    size_t rb = 0;
    TU_STATUS(mla_kv_cache_row_bytes(c, &rb), MLA_OK);
    TU_CHECK(rb == want_bytes[k], "%s row_bytes %zu, want %zu", mla_dtype_name(k_cache_dtypes[k]),
             rb, want_bytes[k]);
    TU_CHECK(mla_cache_row_bytes_for(k_cache_dtypes[k]) == want_bytes[k], "row_bytes_for");
    mla_kv_cache_desc d;
    memset(&d, 0, sizeof d);
    TU_STATUS(mla_kv_cache_get_desc(c, &d), MLA_OK);
    TU_CHECK(d.num_layers == 3 && d.num_pages == 5 && d.page_size == 64 &&
                 d.dtype == k_cache_dtypes[k] && d.fp8_scales,
             "get_desc");
    if (k_cache_dtypes[k] == MLA_DTYPE_FP8_E4M3 && d.fp8_scales)
      TU_CHECK(d.fp8_scales[0] == 0.5f && d.fp8_scales[1] == 2.0f && d.fp8_scales[2] == 0.125f,
               "get_desc scales");
    void *p0 = NULL, *p2 = NULL;
    TU_STATUS(mla_kv_cache_layer_data(c, 0, &p0), MLA_OK);
    TU_STATUS(mla_kv_cache_layer_data(c, 2, &p2), MLA_OK);
    TU_CHECK(p0 && p2 && p0 != p2, "layer_data pointers");
    /* fresh storage is zero */
    int nz = 0;
    for (size_t i = 0; i < 5 * 64 * rb; i++) nz |= ((unsigned char *)p2)[i];
    TU_CHECK(nz == 0, "fresh cache not zeroed");
    mla_kv_cache_destroy(c);
  }
  TU_CHECK(mla_cache_row_bytes_for(MLA_DTYPE_F32) == 0, "row_bytes_for(f32) = 0");

  /* set_fp8_scale: read multiplies by the current scale, write divides. */
  float s1 = 1.0f;
  mla_kv_cache *c = make_cache(MLA_DTYPE_FP8_E4M3, 2, 2, 16, NULL);
  if (!c) return;
  float xc[L], xr[R], a[L], ar[R], b[L], br[R];
  tu_fill_bf16_normal(&g_rng, xc, L, 10.0);
  tu_fill_bf16_normal(&g_rng, xr, R, 10.0);
  int32_t slot = 3;
  TU_STATUS(mla_kv_cache_write(c, 1, 1, &slot, xc, xr, MLA_DTYPE_F32), MLA_OK);
  TU_STATUS(mla_kv_cache_read(c, 1, 1, &slot, a, ar, MLA_DTYPE_F32), MLA_OK);
  TU_STATUS(mla_kv_cache_set_fp8_scale(c, 1, 4.0f), MLA_OK);
  TU_STATUS(mla_kv_cache_read(c, 1, 1, &slot, b, br, MLA_DTYPE_F32), MLA_OK);
  int bad = 0;
  for (int i = 0; i < L; i++) bad += !same(b[i], 4.0 * a[i]);
  for (int i = 0; i < R; i++) bad += !same(br[i], 4.0 * ar[i]);
  TU_CHECK(bad == 0, "set_fp8_scale: read does not use the new scale (%d)", bad);
  TU_STATUS(mla_kv_cache_write(c, 1, 1, &slot, xc, xr, MLA_DTYPE_F32), MLA_OK);
  TU_STATUS(mla_kv_cache_read(c, 1, 1, &slot, b, br, MLA_DTYPE_F32), MLA_OK);
  bad = 0;
  for (int i = 0; i < L; i++) bad += !same(b[i], expect_stored(MLA_DTYPE_FP8_E4M3, xc[i], 4.0f));
  TU_CHECK(bad == 0, "write after set_fp8_scale: %d wrong", bad);
  mla_kv_cache_desc d;
  mla_kv_cache_get_desc(c, &d);
  TU_CHECK(d.fp8_scales[1] == 4.0f && d.fp8_scales[0] == s1, "scales after set: %g %g",
           (double)d.fp8_scales[0], (double)d.fp8_scales[1]);
  mla_kv_cache_destroy(c);
}

/* ---- bad arguments ------------------------------------------------------------- */

static int has(const char *msg, const char *word) { return msg && *msg && strstr(msg, word); }

#define CHECK_CREATE_FAIL(DESCP, OUTP, WANT, WORD)                                      \
  do {                                                                                \
    mla_kv_cache *o_ = (mla_kv_cache *)&g_rng; /* non-NULL garbage: must be reset */ \
    mla_kv_cache **op_ = (OUTP) ? &o_ : NULL;                                          \
    TU_STATUS(mla_kv_cache_create(g_ctx, (DESCP), op_), (WANT));                        \
    TU_CHECK(has(mla_ctx_last_error(g_ctx), (WORD)), "ctx last_error '%s' lacks '%s'",  \
             mla_ctx_last_error(g_ctx), (WORD));                                       \
    if (op_) TU_CHECK(o_ == NULL, "*out not reset on failure");                        \
  } while (0)

static void test_bad_create(void) {
  mla_kv_cache_desc ok = {2, 4, 16, MLA_DTYPE_BF16, NULL}, d;
  mla_kv_cache *c = NULL;
  TU_STATUS(mla_kv_cache_create(NULL, &ok, &c), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(c == NULL, "create with NULL ctx produced a cache");
  CHECK_CREATE_FAIL(&ok, 0, MLA_ERR_INVALID_ARGUMENT, "out");
  CHECK_CREATE_FAIL(NULL, 1, MLA_ERR_INVALID_ARGUMENT, "desc");
  d = ok, d.num_layers = 0;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "num_layers");
  d = ok, d.num_layers = -3;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "num_layers");
  d = ok, d.num_pages = 1;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "num_pages");
  d = ok, d.num_pages = 0;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "num_pages");
  const int bad_ps[] = {0, 3, 512, -16, 48, 257};
  for (size_t i = 0; i < sizeof bad_ps / sizeof bad_ps[0]; i++) {
    d = ok, d.page_size = bad_ps[i];
    CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "page_size");
  }
  d = ok, d.num_pages = 1 << 24, d.page_size = 256; /* 2^32 slots */
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "INT32_MAX");
  d = ok, d.dtype = MLA_DTYPE_F32;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_UNSUPPORTED, "dtype");
  d = ok, d.dtype = MLA_DTYPE_F64;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_UNSUPPORTED, "dtype");
  d = ok, d.dtype = (mla_dtype)42;
  CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "dtype");
  const float bad_scales[][2] = {{1.0f, 0.0f}, {-1.0f, 1.0f}, {1.0f, NAN}, {INFINITY, 1.0f}};
  for (int i = 0; i < 4; i++) {
    d = ok, d.dtype = MLA_DTYPE_FP8_E4M3, d.fp8_scales = bad_scales[i];
    CHECK_CREATE_FAIL(&d, 1, MLA_ERR_INVALID_ARGUMENT, "fp8_scales");
  }
  /* Boundaries that are fine. */
  const int good_ps[] = {1, 2, 256};
  for (int i = 0; i < 3; i++) {
    d = ok, d.page_size = good_ps[i], d.num_pages = 2, d.num_layers = 1;
    c = NULL;
    TU_STATUS(mla_kv_cache_create(g_ctx, &d, &c), MLA_OK);
    mla_kv_cache_destroy(c);
  }
  mla_kv_cache_destroy(NULL); /* accepted */
  TU_CHECK(has(mla_kv_cache_last_error(NULL), "NULL"), "last_error(NULL)");
}

static void test_bad_calls(void) {
  const int P = 16, pages = 4, layers = 2;
  mla_kv_cache *c = make_cache(MLA_DTYPE_BF16, layers, pages, P, NULL);
  if (!c) return;
  const int T = 6;
  float xc[6 * L], xr[6 * R];
  tu_fill_bf16_normal(&g_rng, xc, 6 * L, 1.0);
  tu_fill_bf16_normal(&g_rng, xr, 6 * R, 1.0);
  int32_t good[6] = {1, 5, 20, 33, 63, 0};
  TU_STATUS(mla_kv_cache_write(c, 1, T, good, xc, xr, MLA_DTYPE_F32), MLA_OK);
  const char *e = mla_kv_cache_last_error(c);
  TU_CHECK(e && e[0] == '\0', "last_error not empty on a fresh handle: '%s'", e);

  /* snapshot of both layers */
  size_t lb = (size_t)pages * P * 1152;
  unsigned char *snap[2];
  for (int l = 0; l < layers; l++) {
    void *p;
    mla_kv_cache_layer_data(c, l, &p);
    snap[l] = malloc(lb);
    memcpy(snap[l], p, lb);
  }
  float yc[6 * L], yr[6 * R];
  tu_fill_bf16_normal(&g_rng, yc, 6 * L, 3.0);
  tu_fill_bf16_normal(&g_rng, yr, 6 * R, 3.0);

#define EXPECT(call, want, word)                                                   \
  do {                                                                             \
    TU_STATUS(call, want);                                                         \
    TU_CHECK(has(mla_kv_cache_last_error(c), word), "last_error '%s' lacks '%s'", \
             mla_kv_cache_last_error(c), word);                                    \
  } while (0)

  /* write */
  TU_STATUS(mla_kv_cache_write(NULL, 0, T, good, yc, yr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_write(c, -1, T, good, yc, yr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE, "layer");
  EXPECT(mla_kv_cache_write(c, layers, T, good, yc, yr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE,
         "layer");
  EXPECT(mla_kv_cache_write(c, 0, -1, good, yc, yr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "num_tokens");
  EXPECT(mla_kv_cache_write(c, 0, T, NULL, yc, yr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "slots");
  EXPECT(mla_kv_cache_write(c, 0, T, good, NULL, yr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "'c'");
  EXPECT(mla_kv_cache_write(c, 0, T, good, yc, NULL, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "'r'");
  EXPECT(mla_kv_cache_write(c, 0, T, good, yc, yr, MLA_DTYPE_FP8_E4M3), MLA_ERR_UNSUPPORTED,
         "src_dtype");
  EXPECT(mla_kv_cache_write(c, 0, T, good, yc, yr, MLA_DTYPE_FP8_E4M3_BLOCK), MLA_ERR_UNSUPPORTED,
         "src_dtype");
  EXPECT(mla_kv_cache_write(c, 0, T, good, yc, yr, MLA_DTYPE_F64), MLA_ERR_UNSUPPORTED,
         "src_dtype");
  EXPECT(mla_kv_cache_write(c, 0, T, good, yc, yr, (mla_dtype)-1), MLA_ERR_INVALID_ARGUMENT,
         "src_dtype");
  /* one bad slot among good ones, at every position: nothing is written */
  const int32_t bad_vals[] = {-1, pages * P, INT32_MAX, INT32_MIN};
  for (int pos = 0; pos < T; pos++) {
    for (int v = 0; v < 4; v++) {
      int32_t s[6];
      memcpy(s, good, sizeof s);
      s[pos] = bad_vals[v];
      EXPECT(mla_kv_cache_write(c, 1, T, s, yc, yr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE, "slots[");
    }
  }
  TU_STATUS(mla_kv_cache_write(c, 0, 0, NULL, NULL, NULL, MLA_DTYPE_F32), MLA_OK);
  /* nothing changed: raw bytes, and the good slots read back the old rows */
  for (int l = 0; l < layers; l++) {
    void *p;
    mla_kv_cache_layer_data(c, l, &p);
    TU_CHECK(memcmp(p, snap[l], lb) == 0, "a failed write changed layer %d", l);
  }
  {
    float oc[6 * L], orr[6 * R];
    TU_STATUS(mla_kv_cache_read(c, 1, T, good, oc, orr, MLA_DTYPE_F32), MLA_OK);
    TU_CHECK(memcmp(oc, xc, sizeof oc) == 0 && memcmp(orr, xr, sizeof orr) == 0,
             "good slots lost their old contents after failed writes");
  }

  /* read */
  float oc[6 * L], orr[6 * R];
  TU_STATUS(mla_kv_cache_read(NULL, 0, T, good, oc, orr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_read(c, -1, T, good, oc, orr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE, "layer");
  EXPECT(mla_kv_cache_read(c, 2, T, good, oc, orr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE, "layer");
  EXPECT(mla_kv_cache_read(c, 0, -5, good, oc, orr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "num_tokens");
  EXPECT(mla_kv_cache_read(c, 0, T, NULL, oc, orr, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "slots");
  EXPECT(mla_kv_cache_read(c, 0, T, good, NULL, NULL, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT,
         "c_out");
  EXPECT(mla_kv_cache_read(c, 0, T, good, oc, orr, MLA_DTYPE_FP8_E4M3), MLA_ERR_UNSUPPORTED,
         "dst_dtype");
  EXPECT(mla_kv_cache_read(c, 0, T, good, oc, orr, (mla_dtype)17), MLA_ERR_INVALID_ARGUMENT,
         "dst_dtype");
  {
    int32_t s[6];
    memcpy(s, good, sizeof s);
    s[3] = pages * P;
    tu_poison(oc, sizeof oc);
    EXPECT(mla_kv_cache_read(c, 1, T, s, oc, orr, MLA_DTYPE_F32), MLA_ERR_OUT_OF_RANGE, "slots[3]");
    unsigned char *b = (unsigned char *)oc;
    int touched = 0;
    for (size_t i = 0; i < sizeof oc; i++) touched |= b[i] != 0xFF;
    TU_CHECK(!touched, "a failed read wrote its output");
  }
  /* c_out or r_out alone is fine */
  {
    float rc[6 * R];
    TU_STATUS(mla_kv_cache_read(c, 1, T, good, NULL, rc, MLA_DTYPE_F32), MLA_OK);
    TU_CHECK(memcmp(rc, xr, sizeof rc) == 0, "r-only read");
    TU_STATUS(mla_kv_cache_read(c, 1, T, good, oc, NULL, MLA_DTYPE_F32), MLA_OK);
    TU_CHECK(memcmp(oc, xc, sizeof(float) * 6 * L) == 0, "c-only read");
  }

  /* copy_rows */
  int32_t src[3] = {1, 5, 20}, dst[3] = {40, 41, 42};
  TU_STATUS(mla_kv_cache_copy_rows(NULL, 3, src, dst), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_copy_rows(c, -1, src, dst), MLA_ERR_INVALID_ARGUMENT, "num_rows");
  EXPECT(mla_kv_cache_copy_rows(c, 3, NULL, dst), MLA_ERR_INVALID_ARGUMENT, "src_slots");
  EXPECT(mla_kv_cache_copy_rows(c, 3, src, NULL), MLA_ERR_INVALID_ARGUMENT, "dst_slots");
  {
    int32_t s2[3] = {1, 64, 20}, d2[3] = {40, -1, 42};
    EXPECT(mla_kv_cache_copy_rows(c, 3, s2, dst), MLA_ERR_OUT_OF_RANGE, "src_slots[1]");
    EXPECT(mla_kv_cache_copy_rows(c, 3, src, d2), MLA_ERR_OUT_OF_RANGE, "dst_slots[1]");
  }
  TU_STATUS(mla_kv_cache_copy_rows(c, 0, NULL, NULL), MLA_OK);
  for (int l = 0; l < layers; l++) {
    void *p;
    mla_kv_cache_layer_data(c, l, &p);
    TU_CHECK(memcmp(p, snap[l], lb) == 0, "a failed call changed layer %d", l);
  }

  /* queries */
  size_t rb;
  void *p;
  mla_kv_cache_desc d;
  TU_STATUS(mla_kv_cache_row_bytes(NULL, &rb), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_row_bytes(c, NULL), MLA_ERR_INVALID_ARGUMENT, "bytes");
  TU_STATUS(mla_kv_cache_get_desc(NULL, &d), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_get_desc(c, NULL), MLA_ERR_INVALID_ARGUMENT, "desc");
  TU_STATUS(mla_kv_cache_layer_data(NULL, 0, &p), MLA_ERR_INVALID_ARGUMENT);
  EXPECT(mla_kv_cache_layer_data(c, 0, NULL), MLA_ERR_INVALID_ARGUMENT, "data");
  EXPECT(mla_kv_cache_layer_data(c, -1, &p), MLA_ERR_OUT_OF_RANGE, "layer");
  EXPECT(mla_kv_cache_layer_data(c, layers, &p), MLA_ERR_OUT_OF_RANGE, "layer");
  /* set_fp8_scale on a bf16 cache: unsupported */
  EXPECT(mla_kv_cache_set_fp8_scale(c, 0, 1.0f), MLA_ERR_UNSUPPORTED, "fp8");
  TU_STATUS(mla_kv_cache_set_fp8_scale(NULL, 0, 1.0f), MLA_ERR_INVALID_ARGUMENT);
  mla_kv_cache_destroy(c);

  const float ones[2] = {1.0f, 1.0f};
  c = make_cache(MLA_DTYPE_FP8_E4M3, 2, 2, 1, ones);
  if (c) {
    EXPECT(mla_kv_cache_set_fp8_scale(c, -1, 1.0f), MLA_ERR_OUT_OF_RANGE, "layer");
    EXPECT(mla_kv_cache_set_fp8_scale(c, 2, 1.0f), MLA_ERR_OUT_OF_RANGE, "layer");
    const float bad[] = {0.0f, -0.5f, NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 5; i++)
      EXPECT(mla_kv_cache_set_fp8_scale(c, 0, bad[i]), MLA_ERR_INVALID_ARGUMENT, "scale");
    mla_kv_cache_desc dd;
    mla_kv_cache_get_desc(c, &dd);
    TU_CHECK(dd.fp8_scales[0] == 1.0f, "a failed set_fp8_scale changed the scale");
    mla_kv_cache_destroy(c);
  }
#undef EXPECT
  for (int l = 0; l < layers; l++) free(snap[l]);
}

int main(void) {
  uint64_t seed = tu_seed("test_kv_cache", 20240611);
  g_rng.s = seed;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0}; /* two workers: exercises the parallel write */
  if (mla_ctx_create(&cd, &g_ctx) != MLA_OK) {
    fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  for (size_t k = 0; k < 4; k++)
    for (size_t p = 0; p < sizeof k_page_sizes / sizeof k_page_sizes[0]; p++)
      test_round_trip(k_cache_dtypes[k], k_page_sizes[p]);
  for (size_t k = 0; k < 4; k++) {
    test_duplicates(k_cache_dtypes[k], 60);   /* serial path */
    test_duplicates(k_cache_dtypes[k], 1000); /* parallel path */
  }
  test_saturation_nan();
  test_copy_rows();
  test_queries_and_scale();
  test_bad_create();
  test_bad_calls();
  mla_ctx_destroy(g_ctx);
  return tu_finish("test_kv_cache");
}
