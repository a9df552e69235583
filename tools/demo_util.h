/* Helpers shared by the two parts of `mla demo`: the per-mode table
 * (demo.c) and the serving simulation (serve.c). A seeded RNG, a clock, the
 * oracle comparison, and the cache read-back the oracle works on. Public API
 * (and tests/ref) only. */
#ifndef MLA_TOOLS_DEMO_UTIL_H
#define MLA_TOOLS_DEMO_UTIL_H

#include <stdint.h>

#include "mla.h"

/* splitmix64: tiny, seedable, good enough for test data. */
typedef struct demo_rng {
  uint64_t s;
} demo_rng;

uint64_t demo_rng_next(demo_rng *g);
int demo_rng_int(demo_rng *g, int lo, int hi); /* uniform in [lo, hi] */
double demo_rng_uniform(demo_rng *g);          /* uniform in [0, 1) */
double demo_rng_normal(demo_rng *g);           /* N(0, 1) */

double demo_now_ms(void); /* monotonic clock */

/* Round n doubles in place to what dtype t holds (F32, BF16, F16). */
void demo_round_to(mla_dtype t, double *x /* [n] */, int64_t n);

/* One oracle comparison (STYLE practice 11). */
typedef struct demo_cmp {
  double max_abs_err; /* output, over finite pairs */
  double cos_dist;    /* output, 1 - cos in double */
  double lse_err;     /* max |lse - ref lse|, 0 without lse */
  int ok;             /* within the tolerances of the output dtype */
} demo_cmp;

/* Compare the library's output `got` (converted to double) with the oracle's
 * `ref`, which is first rounded to the output dtype t (a copy; ref is not
 * changed). got_lse/ref_lse may be NULL (n_lse ignored); LSE passes within
 * lse_atol + 1e-5 |ref| (DEMO_LSE_ATOL, or DEMO_LSE_ATOL_EXPANDED below). */
demo_cmp demo_compare(const double *got /* [n] */, const double *ref /* [n] */, int64_t n,
                      mla_dtype t, const double *got_lse /* [n_lse] */,
                      const double *ref_lse /* [n_lse] */, int64_t n_lse, double lse_atol);

/* The same with p_round added to every element's absolute tolerance: the
 * GPU kernels round the softmax weights P to the 16-bit operand type before
 * P V, which moves an output by up to u sum_j p_j |v_j| <= u max_j |v_j|
 * (u = 2^-8 for bf16, 2^-11 for f16); the caller passes that bound. With
 * p_round > 0 the cosine-distance limit is 1e-4 (the library's GPU tests'),
 * else 5e-6. */
demo_cmp demo_compare_p(const double *got, const double *ref, int64_t n, mla_dtype t, const double *got_lse,
                        const double *ref_lse, int64_t n_lse, double lse_atol, double p_round);
#define DEMO_LSE_ATOL 1e-5
/* Chunked-prefix MHA with 16-bit activations: the library rounds each
 * expanded prefix key from an fp32 sum, the oracle from a double sum; where
 * a sum lies within fp32 noise of a rounding midpoint the two differ by one
 * ulp (~1 in 1000 elements), which moves a logit by up to ~1e-3. The LSE
 * follows by its softmax weight; the outputs keep the usual tolerance. */
#define DEMO_LSE_ATOL_EXPANDED 2e-3
/* The LSE tolerance of a check of chunked-prefix MHA in act dtype t. */
double demo_lse_atol_expanded(mla_dtype t);

/* The first len rows of request req in `layer`, as the cache holds them
 * (dequantized, read back with mla_kv_cache_read), in double. Returns 0 on
 * success. */
int demo_read_request(mla_backend *be, int layer, int32_t req, int len, double *c /* [len, 512] */,
                      double *r /* [len, 64] */);

/* What chunked-prefix MHA makes of cached latent rows, in double: for each of
 * nh heads, k[t,h] = (c[t] . w[h] nope rows, r[t]) and v[t,h] = c[t] . w[h]
 * v rows, rounded to act dtype as the library stores its expanded k and v.
 * w holds the kv_b_proj slices of those nh heads. */
void demo_ref_expand(int T, int nh, int nope, int dv, mla_dtype act, const double *c /* [T, 512] */,
                     const double *r /* [T, 64] */, const double *w /* [nh, nope+dv, 512] */,
                     double *k /* [T, nh, nope+64] */, double *v /* [T, nh, dv] */);

#endif
