/* Helpers shared by the demo table and the serving simulation. */
#include "demo_util.h"
#include "serve_dev.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref.h"

uint64_t demo_rng_next(demo_rng *g) {
  uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int demo_rng_int(demo_rng *g, int lo, int hi) {
  return lo + (int)(demo_rng_next(g) % (uint64_t)(hi - lo + 1));
}

double demo_rng_uniform(demo_rng *g) { return (demo_rng_next(g) >> 11) * 0x1.0p-53; }

double demo_rng_normal(demo_rng *g) {
  double u1 = ((demo_rng_next(g) >> 11) + 1.0) * 0x1.0p-53, u2 = demo_rng_uniform(g);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

double demo_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

void demo_round_to(mla_dtype t, double *x, int64_t n) {
  void *tmp = malloc((size_t)(n ? n : 1) * mla_dtype_size(t));
  if (!tmp) return;
  mla_convert(x, MLA_DTYPE_F64, tmp, t, n);
  mla_convert(tmp, t, x, MLA_DTYPE_F64, n);
  free(tmp);
}

demo_cmp demo_compare(const double *got, const double *ref, int64_t n, mla_dtype t, const double *got_lse,
                      const double *ref_lse, int64_t n_lse, double lse_atol) {
  return demo_compare_p(got, ref, n, t, got_lse, ref_lse, n_lse, lse_atol, 0.0);
}

demo_cmp demo_compare_p(const double *got, const double *ref, int64_t n, mla_dtype t, const double *got_lse,
                        const double *ref_lse, int64_t n_lse, double lse_atol, double p_round) {
  demo_cmp r;
  memset(&r, 0, sizeof r);
  double *ref_r = malloc((size_t)(n ? n : 1) * sizeof(double));
  if (!ref_r) return r; /* ok = 0: an unchecked result is not a pass */
  /* Round the oracle to the output dtype before comparing (STYLE 11): the
   * library cannot return more precision than its output holds. */
  memcpy(ref_r, ref, (size_t)n * sizeof(double));
  demo_round_to(t, ref_r, n);
  double atol = (t == MLA_DTYPE_F32 ? 1e-5 : 8e-4) + p_round, rtol = t == MLA_DTYPE_F32 ? 1e-4 : 2.0 / 128;
  ref_cmp c = ref_compare(got, ref_r, n, atol, rtol);
  /* (with P rounded to 16 bits the cosine distance grows too: the library's
   * own GPU tests allow 1e-4, tests/test_cuda_ragged.c) */
  r.ok = ref_cmp_ok(&c, p_round > 0 ? 1e-4 : 5e-6);
  r.max_abs_err = c.max_abs_err;
  r.cos_dist = c.cos_dist;
  if (got_lse && ref_lse && n_lse) {
    ref_cmp cl = ref_compare(got_lse, ref_lse, n_lse, lse_atol, 1e-5);
    r.ok = r.ok && cl.bad == 0 && cl.nonfinite_mismatch == 0;
    r.lse_err = cl.max_abs_err;
  }
  free(ref_r);
  return r;
}

double demo_lse_atol_expanded(mla_dtype t) {
  return t == MLA_DTYPE_F32 ? DEMO_LSE_ATOL : DEMO_LSE_ATOL_EXPANDED;
}

int demo_read_request(mla_backend *be, int layer, int32_t req, int len, double *c, double *r) {
  mla_kv_cache *cache;
  mla_req_table *rt;
  const int32_t *r2t;
  mla_req_table_desc rd;
  if (mla_backend_cache(be, &cache) || mla_backend_req_table(be, &rt) || mla_req_table_data(rt, &r2t) ||
      mla_req_table_get_desc(rt, &rd))
    return -1;
  float *cf = malloc((size_t)(len ? len : 1) * MLA_LATENT * sizeof(float));
  float *rf = malloc((size_t)(len ? len : 1) * MLA_ROPE * sizeof(float));
  /* A cache on a CUDA context reads through device buffers (serve_dev.c). */
  void *data = NULL;
  mla_kv_cache_layer_data(cache, layer, &data);
  const int32_t *slots = r2t + (size_t)req * rd.max_context;
  mla_status st = !cf || !rf                ? MLA_ERR_OUT_OF_MEMORY
                  : sdev_is_device(data)    ? (sdev_cache_read(cache, layer, len, slots, cf, rf) ? MLA_ERR_DEVICE
                                                                                               : MLA_OK)
                                            : mla_kv_cache_read(cache, layer, len, slots, cf, rf, MLA_DTYPE_F32);
  if (st == MLA_OK) {
    for (int64_t i = 0; i < (int64_t)len * MLA_LATENT; i++) c[i] = cf[i];
    for (int64_t i = 0; i < (int64_t)len * MLA_ROPE; i++) r[i] = rf[i];
  }
  free(cf);
  free(rf);
  return st == MLA_OK ? 0 : -1;
}

void demo_ref_expand(int T, int nh, int nope, int dv, mla_dtype act, const double *c, const double *r,
                     const double *w, double *k, double *v) {
  const int dqk = nope + MLA_ROPE;
  for (int t = 0; t < T; t++)
    for (int h = 0; h < nh; h++) {
      const double *wh = w + (size_t)h * (nope + dv) * MLA_LATENT;
      const double *ct = c + (size_t)t * MLA_LATENT;
      for (int j = 0; j < nope + dv; j++) {
        double s = 0;
        for (int x = 0; x < MLA_LATENT; x++) s += ct[x] * wh[(size_t)j * MLA_LATENT + x];
        if (j < nope) k[((size_t)t * nh + h) * dqk + j] = s;
        else v[((size_t)t * nh + h) * dv + j - nope] = s;
      }
      for (int j = 0; j < MLA_ROPE; j++) k[((size_t)t * nh + h) * dqk + nope + j] = r[(size_t)t * MLA_ROPE + j];
    }
  demo_round_to(act, k, (int64_t)T * nh * dqk);
  demo_round_to(act, v, (int64_t)T * nh * dv);
}
