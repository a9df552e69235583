/* CPU merge of partial attention states (mla_merge_states) against the
 * float64 oracle (ref_merge): n = 1..5 states, empty sides (lse = -inf, with
 * NaN garbage in their o: it must never leak), LSEs 160 apart, all-empty
 * rows, f32/bf16/f16, natural and base-2 LSE, in place (out = o_parts[0],
 * lse_out = lse_parts[0]) bit-identical to out of place, 1 vs 2 threads,
 * NaN / +inf LSE inputs (propagate NaN), bad arguments (status, message,
 * output untouched). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "test_util.h"

#define MAXN 5
#define GUARD 64

static tu_rng rng;
static mla_ctx *ctx2, *ctx1;

typedef struct mcase {
  int n, T, H, dim;
  mla_dtype act;
  int base2;
} mcase;

static void run_case(const mcase *c) {
  char cs[160];
  snprintf(cs, sizeof cs, "merge n=%d T=%d H=%d dim=%d act=%s base2=%d", c->n, c->T, c->H, c->dim,
           mla_dtype_name(c->act), c->base2);
  const int64_t rows = (int64_t)c->T * c->H, no = rows * c->dim;
  const size_t es = tu_act_size(c->act), ob = es * (size_t)no, lb = 4 * (size_t)rows;
  void *o[MAXN];
  float *l[MAXN];
  double *od[MAXN], *ld[MAXN];
  float *tmp = malloc(sizeof(float) * (size_t)(no + 1));
  for (int k = 0; k < c->n; k++) {
    o[k] = malloc(ob + 4);
    l[k] = malloc(lb + 4);
    od[k] = malloc(sizeof(double) * (size_t)(no + 1));
    ld[k] = malloc(sizeof(double) * (size_t)(rows + 1));
    tu_fill_bf16_normal(&rng, tmp, no, 1.0);
    tu_to_dtype(c->act, tmp, o[k], no);
    tu_from_dtype(c->act, o[k], od[k], no);
  }
  /* LSE pattern per row: normal, one side far ahead, all empty, some empty */
  for (int64_t x = 0; x < rows; x++) {
    const double u = tu_uniform(&rng);
    for (int k = 0; k < c->n; k++) {
      float v = (float)(3.0 + 2.0 * tu_normal(&rng));
      if (u < 0.1) v = -INFINITY;                            /* every side empty */
      else if (u < 0.4 && tu_uniform(&rng) < 0.5) v = -INFINITY; /* this side empty */
      else if (u > 0.85 && k == (int)(x % c->n)) v += 160.0f;    /* 160 apart */
      l[k][x] = v;
      if (v == -INFINITY) { /* garbage in an empty side's o must not leak */
        memset((char *)o[k] + es * (size_t)(x * c->dim), 0xFF, es * (size_t)c->dim);
      }
      ld[k][x] = c->base2 ? (double)v * 0.69314718055994530942 : (double)v;
    }
  }
  double *o_ref = malloc(sizeof(double) * (size_t)(no + 1));
  double *l_ref = malloc(sizeof(double) * (size_t)(rows + 1));
  ref_merge(c->n, c->T, c->H, c->dim, (const double *const *)od, (const double *const *)ld, o_ref,
            l_ref);

  /* out of place */
  void *out = malloc(ob + GUARD * 4);
  float *lse = malloc(lb + GUARD * 4);
  tu_poison(out, ob + GUARD * 4);
  tu_poison(lse, lb + GUARD * 4);
  const unsigned flags = c->base2 ? MLA_FLAG_LSE_BASE2 : 0;
  TU_STATUS(mla_merge_states(ctx2, c->n, c->T, c->H, c->dim, c->act, flags,
                             (const void *const *)o, (const float *const *)l, out, lse),
            MLA_OK);
  double *got = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(c->act, out, got, no);
  for (int64_t i = 0; i < no; i++) o_ref[i] = tu_round_to(c->act, o_ref[i]);
  const double atol = c->act == MLA_DTYPE_F32 ? 1e-6 : 8e-4;
  const double rtol = c->act == MLA_DTYPE_F32 ? 1e-6 : 1.0 / 128.0;
  ref_cmp cm = ref_compare(got, o_ref, no, atol, rtol);
  TU_CHECK(ref_cmp_ok(&cm, 1e-6),
           "%s o: %lld bad, %lld nonfinite mismatches (first %lld: got %g ref %g)", cs,
           (long long)cm.bad, (long long)cm.nonfinite_mismatch, (long long)cm.first_bad,
           cm.first_bad >= 0 ? got[cm.first_bad] : 0.0,
           cm.first_bad >= 0 ? o_ref[cm.first_bad] : 0.0);
  int nan_out = 0;
  for (int64_t i = 0; i < no; i++) nan_out += isnan(got[i]);
  TU_CHECK(nan_out == 0, "%s: %d NaN outputs (from empty sides)", cs, nan_out);
  for (int64_t x = 0; x < rows; x++) {
    got[x] = lse[x];
    l_ref[x] = (double)(float)(c->base2 ? l_ref[x] * 1.4426950408889634 : l_ref[x]);
  }
  cm = ref_compare(got, l_ref, rows, 1e-6, 1e-6);
  TU_CHECK(cm.bad == 0 && cm.nonfinite_mismatch == 0,
           "%s lse: %lld bad, %lld nonfinite mismatches (first %lld: got %g ref %g)", cs,
           (long long)cm.bad, (long long)cm.nonfinite_mismatch, (long long)cm.first_bad,
           cm.first_bad >= 0 ? got[cm.first_bad] : 0.0,
           cm.first_bad >= 0 ? l_ref[cm.first_bad] : 0.0);
  TU_CHECK(tu_all_poisoned((char *)out + ob, GUARD * 4) && tu_all_poisoned((char *)lse + lb, GUARD * 4),
           "%s: wrote past the end", cs);

  /* one thread: identical */
  void *out1 = malloc(ob + 4);
  float *lse1 = malloc(lb + 4);
  TU_STATUS(mla_merge_states(ctx1, c->n, c->T, c->H, c->dim, c->act, flags,
                             (const void *const *)o, (const float *const *)l, out1, lse1),
            MLA_OK);
  TU_CHECK(!memcmp(out1, out, ob) && !memcmp(lse1, lse, lb), "%s: 1 thread differs", cs);

  /* in place: out = o_parts[0], lse_out = lse_parts[0]; bit-identical */
  TU_STATUS(mla_merge_states(ctx2, c->n, c->T, c->H, c->dim, c->act, flags,
                             (const void *const *)o, (const float *const *)l, o[0], l[0]),
            MLA_OK);
  TU_CHECK(!memcmp(o[0], out, ob) && !memcmp(l[0], lse, lb), "%s: in place differs", cs);

  free(out1);
  free(lse1);
  free(got);
  free(o_ref);
  free(l_ref);
  free(out);
  free(lse);
  free(tmp);
  for (int k = 0; k < c->n; k++) {
    free(o[k]);
    free(l[k]);
    free(od[k]);
    free(ld[k]);
  }
}

/* A NaN or +inf LSE is not a state: that row's o and lse become NaN; other
 * rows are unaffected. */
static void nonfinite_inputs(void) {
  const int T = 2, H = 2, D = 8;
  float oa[T * H * D], ob[T * H * D], la[T * H], lb[T * H], out[T * H * D], lse[T * H];
  for (int i = 0; i < T * H * D; i++) oa[i] = 1.0f, ob[i] = 3.0f;
  for (int i = 0; i < T * H; i++) la[i] = lb[i] = 0.0f;
  la[1] = NAN;
  lb[2] = INFINITY;
  const void *o[2] = {oa, ob};
  const float *l[2] = {la, lb};
  TU_STATUS(mla_merge_states(ctx2, 2, T, H, D, MLA_DTYPE_F32, 0, o, l, out, lse), MLA_OK);
  for (int x = 0; x < T * H; x++) {
    int nan_row = x == 1 || x == 2, ok = 1;
    for (int d = 0; d < D; d++) ok &= nan_row ? isnan(out[x * D + d]) : out[x * D + d] == 2.0f;
    ok &= nan_row ? isnan(lse[x]) : fabsf(lse[x] - logf(2.0f)) < 1e-6f;
    TU_CHECK(ok, "nonfinite inputs: row %d wrong (o %g lse %g)", x, (double)out[x * D],
             (double)lse[x]);
  }
  /* lse_out may be NULL */
  memset(out, 0, sizeof out);
  TU_STATUS(mla_merge_states(ctx2, 2, T, H, D, MLA_DTYPE_F32, 0, o, l, out, NULL), MLA_OK);
  TU_CHECK(out[0] == 2.0f, "lse_out NULL: o not written");
}

static void expect_fail(mla_status got, mla_status want, const void *o, size_t ob,
                        const float *l, size_t lb, const char *what) {
  TU_CHECK(got == want, "%s: got %s, expected %s", what, mla_status_string(got),
           mla_status_string(want));
  TU_CHECK(mla_ctx_last_error(ctx2)[0] != '\0', "%s: no error message", what);
  TU_CHECK(tu_all_poisoned(o, ob) && tu_all_poisoned(l, lb), "%s: output written", what);
}

static void bad_args(void) {
  enum { T = 3, H = 2, D = 16 };
  float oa[T * H * D] = {0}, obb[T * H * D] = {0}, la[T * H] = {0}, lb[T * H] = {0};
  float out[T * H * D], lse[T * H];
  tu_poison(out, sizeof out);
  tu_poison(lse, sizeof lse);
  const void *o[2] = {oa, obb}, *o_bad[2] = {oa, NULL};
  const float *l[2] = {la, lb}, *l_bad[2] = {la, NULL};
  const size_t OB = sizeof out, LB = sizeof lse;
  const mla_dtype F = MLA_DTYPE_F32;
  TU_STATUS(mla_merge_states(NULL, 2, T, H, D, F, 0, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT);
  expect_fail(mla_merge_states(ctx2, 0, T, H, D, F, 0, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT,
              out, OB, lse, LB, "n = 0");
  expect_fail(mla_merge_states(ctx2, 2, -1, H, D, F, 0, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT,
              out, OB, lse, LB, "T < 0");
  expect_fail(mla_merge_states(ctx2, 2, T, 0, D, F, 0, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT,
              out, OB, lse, LB, "H = 0");
  expect_fail(mla_merge_states(ctx2, 2, T, MLA_MAX_HEADS + 1, D, F, 0, o, l, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "H too large");
  expect_fail(mla_merge_states(ctx2, 2, T, H, 0, F, 0, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT,
              out, OB, lse, LB, "dim = 0");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, MLA_DTYPE_FP8_E4M3_BLOCK, 0, o, l, out, lse),
              MLA_ERR_UNSUPPORTED, out, OB, lse, LB, "fp8 block dtype");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, (mla_dtype)99, 0, o, l, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "dtype 99");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 2u, o, l, out, lse), MLA_ERR_INVALID_ARGUMENT,
              out, OB, lse, LB, "unknown flag");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 0, NULL, l, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "o_parts NULL");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 0, o, NULL, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "lse_parts NULL");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 0, o_bad, l, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "o_parts[1] NULL");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 0, o, l_bad, out, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "lse_parts[1] NULL");
  expect_fail(mla_merge_states(ctx2, 2, T, H, D, F, 0, o, l, NULL, lse),
              MLA_ERR_INVALID_ARGUMENT, out, OB, lse, LB, "out NULL");
  TU_STATUS(mla_merge_states(ctx2, 2, 0, H, D, F, 0, NULL, NULL, NULL, NULL), MLA_OK);
  TU_CHECK(tu_all_poisoned(out, OB) && tu_all_poisoned(lse, LB), "T = 0 wrote output");
}

int main(void) {
  rng.s = tu_seed("test_cpu_merge", 99);
  mla_ctx_desc d2 = {MLA_DEVICE_CPU, 2, 0}, d1 = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&d2, &ctx2), MLA_OK);
  TU_STATUS(mla_ctx_create(&d1, &ctx1), MLA_OK);
  if (!ctx1 || !ctx2) return tu_finish("test_cpu_merge");
  bad_args();
  nonfinite_inputs();
  static const int Hs[3] = {1, 3, 16}, Ds[4] = {512, 128, 7, 300};
  static const mla_dtype acts[3] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
  for (int i = 0; i < 120; i++) {
    mcase c;
    c.n = 1 + i % MAXN;
    c.T = tu_randint(&rng, 0, 17);
    c.H = Hs[(i / 5) % 3];
    c.dim = Ds[(i / 15) % 4];
    c.act = acts[(i / 2) % 3];
    c.base2 = (i / 3) % 2;
    run_case(&c);
  }
  mla_ctx_destroy(ctx1);
  mla_ctx_destroy(ctx2);
  return tu_finish("test_cpu_merge");
}
