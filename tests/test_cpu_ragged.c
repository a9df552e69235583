/* CPU ragged MHA (mla_attention_ragged) and the k/v expansion helper
 * (mla_expand_kv) against float64 references.
 *
 * Ragged: random varlen batches with zero-length query and key sides,
 * H in {1, 3, 16} with every kv-head count that divides H, head dims
 * 192/128, 128/128 and odd 40/24 (plus the 256 limit), causal (bottom-right,
 * including rows that see no key) and not, logit soft cap, the base-2 LSE
 * flag, NULL lse, f32/bf16/f16 activations, 1 vs 2 threads bit-identical,
 * every SIMD build the machine has. Outputs are poisoned with guard
 * elements; the oracle is rounded to the output dtype before comparing.
 * Bad arguments: exact status, a message, output untouched. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/cpu.h" /* white box: mla_cpu_set_isa */
#include "mla.h"
#include "ref.h"
#include "test_util.h"

#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5
#define GUARD 64
#define MAXB 16

static tu_rng rng;
static mla_ctx *ctx2, *ctx1;

/* Output tolerance per dtype: f32 keeps the fp32 accumulation error only. */
static void tol_for(mla_dtype t, double *atol, double *rtol) {
  if (t == MLA_DTYPE_F32) {
    *atol = 2e-5;
    *rtol = 2e-4;
  } else {
    *atol = 8e-4;
    *rtol = 2.0 / 128.0;
  }
}

/* Random activations in dtype t (bf16-representable values) and their
 * exact double values. */
static void *rand_act(mla_dtype t, int64_t n, double sigma, double **dbl) {
  float *f = malloc(sizeof(float) * (size_t)(n + 1));
  void *a = malloc(tu_act_size(t) * (size_t)(n + 1));
  *dbl = malloc(sizeof(double) * (size_t)(n + 1));
  tu_fill_bf16_normal(&rng, f, n, sigma);
  tu_to_dtype(t, f, a, n);
  tu_from_dtype(t, a, *dbl, n);
  free(f);
  return a;
}

typedef struct rcase {
  int bs, H, Hkv, dqk, dv, causal;
  float softcap;
  mla_dtype act;
  unsigned flags;
  int null_lse;
} rcase;

static void case_str(const rcase *c, char *b, size_t n) {
  snprintf(b, n, "bs=%d H=%d Hkv=%d dims=%d/%d causal=%d cap=%g act=%s flags=%u lse=%s", c->bs,
           c->H, c->Hkv, c->dqk, c->dv, c->causal, (double)c->softcap, mla_dtype_name(c->act),
           c->flags, c->null_lse ? "NULL" : "yes");
}

static void run_case(const rcase *c, int check_threads) {
  char cs[200];
  case_str(c, cs, sizeof cs);
  int ql[MAXB], kl[MAXB];
  int32_t qo[MAXB + 1], kv[MAXB + 1];
  qo[0] = kv[0] = 0;
  for (int i = 0; i < c->bs; i++) {
    ql[i] = tu_uniform(&rng) < 0.15 ? 0 : tu_randint(&rng, 1, 70);
    kl[i] = tu_uniform(&rng) < 0.15 ? 0 : tu_randint(&rng, 1, 90);
    if (tu_uniform(&rng) < 0.3) kl[i] = ql[i]; /* the plain prefill shape */
    qo[i + 1] = qo[i] + ql[i];
    kv[i + 1] = kv[i] + kl[i];
  }
  const int64_t Tq = qo[c->bs], Tk = kv[c->bs];
  double *qd, *kd, *vd;
  void *q = rand_act(c->act, Tq * c->H * c->dqk, 1.0, &qd);
  void *k = rand_act(c->act, Tk * c->Hkv * c->dqk, 1.0, &kd);
  void *v = rand_act(c->act, Tk * c->Hkv * c->dv, 1.0, &vd);
  /* MLA_FLAG_OUT_F32: fp32 output whatever the activation dtype. */
  const mla_dtype odt = (c->flags & MLA_FLAG_OUT_F32) ? MLA_DTYPE_F32 : c->act;
  const size_t ob = tu_act_size(odt) * (size_t)(Tq * c->H * c->dv), lb = 4 * (size_t)(Tq * c->H);
  void *out = malloc(ob + GUARD * 4);
  float *lse = malloc(lb + GUARD * 4);
  tu_poison(out, ob + GUARD * 4);
  tu_poison(lse, lb + GUARD * 4);
  const double scale = 1.0 / sqrt((double)c->dqk);
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = c->bs;
  a.num_heads = c->H;
  a.num_kv_heads = c->Hkv;
  a.qk_dim = c->dqk;
  a.v_dim = c->dv;
  a.scale = (float)scale;
  a.softcap = c->softcap;
  a.causal = c->causal;
  a.flags = c->flags;
  a.act_dtype = c->act;
  a.qo_indptr = qo;
  a.kv_indptr = kv;
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = c->null_lse ? NULL : lse;
  mla_status st = mla_attention_ragged(ctx2, &a);
  TU_CHECK(st == MLA_OK, "%s: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(ctx2));

  double *o_ref = malloc(sizeof(double) * (size_t)(Tq * c->H * c->dv + 1));
  double *l_ref = malloc(sizeof(double) * (size_t)(Tq * c->H + 1));
  ref_mha(c->bs, ql, kl, c->H, c->Hkv, c->dqk, c->dv, (double)(float)scale, (double)c->softcap,
          c->causal, qd, kd, vd, o_ref, l_ref);
  const int64_t no = Tq * c->H * c->dv, nl = Tq * c->H;
  double *got = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(odt, out, got, no);
  for (int64_t i = 0; i < no; i++) o_ref[i] = tu_round_to(odt, o_ref[i]);
  double atol, rtol;
  tol_for(odt, &atol, &rtol);
  ref_cmp cm = ref_compare(got, o_ref, no, atol, rtol);
  TU_CHECK(ref_cmp_ok(&cm, MAX_COS),
           "%s o: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g) max abs "
           "%.3g cos %.3g",
           cs, (long long)cm.bad, (long long)cm.nonfinite_mismatch, (long long)no,
           (long long)cm.first_bad, cm.first_bad >= 0 ? got[cm.first_bad] : 0.0,
           cm.first_bad >= 0 ? o_ref[cm.first_bad] : 0.0, cm.max_abs_err, cm.cos_dist);
  if (c->null_lse) {
    TU_CHECK(tu_all_poisoned(lse, lb), "%s: lse NULL but written", cs);
  } else {
    const double f = (c->flags & MLA_FLAG_LSE_BASE2) ? 1.4426950408889634 : 1.0;
    for (int64_t i = 0; i < nl; i++) {
      got[i] = lse[i];
      l_ref[i] = (double)(float)(l_ref[i] * f);
    }
    cm = ref_compare(got, l_ref, nl, LSE_ATOL, LSE_RTOL);
    TU_CHECK(cm.bad == 0 && cm.nonfinite_mismatch == 0,
             "%s lse: %lld bad, %lld nonfinite mismatches (first %lld: got %g ref %g)", cs,
             (long long)cm.bad, (long long)cm.nonfinite_mismatch, (long long)cm.first_bad,
             cm.first_bad >= 0 ? got[cm.first_bad] : 0.0,
             cm.first_bad >= 0 ? l_ref[cm.first_bad] : 0.0);
  }
  TU_CHECK(tu_all_poisoned((char *)out + ob, GUARD * 4) && tu_all_poisoned((char *)lse + lb, GUARD * 4),
           "%s: wrote past the end", cs);
  if (check_threads && st == MLA_OK) {
    void *out1 = malloc(ob + 1);
    float *lse1 = malloc(lb + 4);
    a.out = out1;
    a.lse = c->null_lse ? NULL : lse1;
    TU_STATUS(mla_attention_ragged(ctx1, &a), MLA_OK);
    TU_CHECK(!memcmp(out1, out, ob) && (c->null_lse || !memcmp(lse1, lse, lb)),
             "%s: 1 thread differs from 2 threads", cs);
    free(out1);
    free(lse1);
  }
  free(got);
  free(o_ref);
  free(l_ref);
  free(q);
  free(k);
  free(v);
  free(qd);
  free(kd);
  free(vd);
  free(out);
  free(lse);
}

static void random_cases(int n, int check_threads) {
  static const int dims[5][2] = {{192, 128}, {128, 128}, {40, 24}, {256, 256}, {1, 3}};
  static const int Hs[3] = {1, 3, 16};
  static const mla_dtype acts[3] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_F32};
  for (int i = 0; i < n; i++) {
    rcase c;
    memset(&c, 0, sizeof c);
    c.H = Hs[i % 3];
    int divs[8], nd = 0;
    for (int d = 1; d <= c.H; d++)
      if (c.H % d == 0) divs[nd++] = d;
    c.Hkv = divs[tu_randint(&rng, 0, nd - 1)];
    const int di = (i / 3) % 5;
    c.dqk = dims[di][0];
    c.dv = dims[di][1];
    c.bs = tu_randint(&rng, 1, c.H >= 16 ? 4 : 8);
    c.causal = (i / 15) % 2;
    c.softcap = (i % 4 == 1) ? 30.0f : (i % 4 == 3 ? 5.0f : 0.0f);
    c.act = acts[(i / 2) % 3];
    c.flags = (i % 5 == 2) ? MLA_FLAG_LSE_BASE2 : 0;
    if (i % 6 == 5) c.flags |= MLA_FLAG_OUT_F32;
    c.null_lse = i % 7 == 4;
    run_case(&c, check_threads && i % 3 == 0);
  }
}

/* ---- bad arguments ------------------------------------------------------ */

static void expect_fail(mla_status got, mla_status want, const void *o, size_t ob,
                        const float *l, size_t lb, const char *what) {
  TU_CHECK(got == want, "%s: got %s, expected %s", what, mla_status_string(got),
           mla_status_string(want));
  TU_CHECK(mla_ctx_last_error(ctx2)[0] != '\0', "%s: no error message", what);
  TU_CHECK(tu_all_poisoned(o, ob) && (!l || tu_all_poisoned(l, lb)), "%s: output written", what);
}

static void bad_args(void) {
  int32_t qo[3] = {0, 5, 9}, kv[3] = {0, 6, 6};
  const int H = 4, Hkv = 2, dqk = 24, dv = 16;
  double *qd, *kd, *vd;
  void *q = rand_act(MLA_DTYPE_F32, 9 * H * dqk, 1.0, &qd);
  void *k = rand_act(MLA_DTYPE_F32, 6 * Hkv * dqk, 1.0, &kd);
  void *v = rand_act(MLA_DTYPE_F32, 6 * Hkv * dv, 1.0, &vd);
  const size_t ob = 4 * 9 * H * dv, lb = 4 * 9 * H;
  float *out = malloc(ob), *lse = malloc(lb);
  tu_poison(out, ob);
  tu_poison(lse, lb);
  mla_ragged_args a0, a;
  memset(&a0, 0, sizeof a0);
  a0.batch_size = 2;
  a0.num_heads = H;
  a0.num_kv_heads = Hkv;
  a0.qk_dim = dqk;
  a0.v_dim = dv;
  a0.scale = 0.2f;
  a0.causal = 1;
  a0.act_dtype = MLA_DTYPE_F32;
  a0.qo_indptr = qo;
  a0.kv_indptr = kv;
  a0.q = q;
  a0.k = k;
  a0.v = v;
  a0.out = out;
  a0.lse = lse;
#define BAD(field, value, want, what) \
  a = a0, a.field = value;            \
  expect_fail(mla_attention_ragged(ctx2, &a), want, out, ob, lse, lb, what)
  TU_STATUS(mla_attention_ragged(NULL, &a0), MLA_ERR_INVALID_ARGUMENT);
  expect_fail(mla_attention_ragged(ctx2, NULL), MLA_ERR_INVALID_ARGUMENT, out, ob, lse, lb,
              "args NULL");
  BAD(batch_size, -1, MLA_ERR_INVALID_ARGUMENT, "batch_size -1");
  BAD(num_heads, 0, MLA_ERR_INVALID_ARGUMENT, "num_heads 0");
  BAD(num_heads, MLA_MAX_HEADS + 1, MLA_ERR_INVALID_ARGUMENT, "num_heads too many");
  BAD(num_kv_heads, 0, MLA_ERR_INVALID_ARGUMENT, "num_kv_heads 0");
  BAD(num_kv_heads, 3, MLA_ERR_INVALID_ARGUMENT, "num_kv_heads does not divide");
  BAD(qk_dim, 0, MLA_ERR_INVALID_ARGUMENT, "qk_dim 0");
  BAD(qk_dim, MLA_MAX_HEAD_DIM + 1, MLA_ERR_INVALID_ARGUMENT, "qk_dim too large");
  BAD(v_dim, 0, MLA_ERR_INVALID_ARGUMENT, "v_dim 0");
  BAD(v_dim, MLA_MAX_HEAD_DIM + 1, MLA_ERR_INVALID_ARGUMENT, "v_dim too large");
  BAD(scale, 0.0f, MLA_ERR_INVALID_ARGUMENT, "scale 0");
  BAD(scale, NAN, MLA_ERR_INVALID_ARGUMENT, "scale NaN");
  BAD(scale, INFINITY, MLA_ERR_INVALID_ARGUMENT, "scale inf");
  BAD(softcap, -1.0f, MLA_ERR_INVALID_ARGUMENT, "softcap < 0");
  BAD(softcap, NAN, MLA_ERR_INVALID_ARGUMENT, "softcap NaN");
  BAD(causal, 2, MLA_ERR_INVALID_ARGUMENT, "causal 2");
  BAD(flags, 8u, MLA_ERR_INVALID_ARGUMENT, "unknown flag");
  BAD(act_dtype, MLA_DTYPE_FP8_E4M3, MLA_ERR_UNSUPPORTED, "act fp8");
  BAD(act_dtype, MLA_DTYPE_F64, MLA_ERR_UNSUPPORTED, "act f64");
  BAD(act_dtype, (mla_dtype)-3, MLA_ERR_INVALID_ARGUMENT, "act -3");
  BAD(qo_indptr, NULL, MLA_ERR_INVALID_ARGUMENT, "qo_indptr NULL");
  BAD(kv_indptr, NULL, MLA_ERR_INVALID_ARGUMENT, "kv_indptr NULL");
  BAD(q, NULL, MLA_ERR_INVALID_ARGUMENT, "q NULL");
  BAD(k, NULL, MLA_ERR_INVALID_ARGUMENT, "k NULL");
  BAD(v, NULL, MLA_ERR_INVALID_ARGUMENT, "v NULL");
  BAD(out, NULL, MLA_ERR_INVALID_ARGUMENT, "out NULL");
  {
    int32_t bq[3] = {1, 5, 9}, dq[3] = {0, 5, 4}, dk[3] = {0, 7, 6};
    BAD(qo_indptr, bq, MLA_ERR_INVALID_ARGUMENT, "qo_indptr[0] != 0");
    BAD(qo_indptr, dq, MLA_ERR_INVALID_ARGUMENT, "qo_indptr decreasing");
    BAD(kv_indptr, dk, MLA_ERR_INVALID_ARGUMENT, "kv_indptr decreasing");
  }
#undef BAD
  /* nothing to do: OK, nothing written */
  a = a0, a.batch_size = 0, a.qo_indptr = NULL, a.q = NULL;
  TU_STATUS(mla_attention_ragged(ctx2, &a), MLA_OK);
  {
    int32_t zq[3] = {0, 0, 0};
    a = a0, a.qo_indptr = zq, a.q = NULL, a.out = NULL;
    TU_STATUS(mla_attention_ragged(ctx2, &a), MLA_OK);
  }
  TU_CHECK(tu_all_poisoned(out, ob) && tu_all_poisoned(lse, lb), "empty batches wrote output");
  /* no keys at all: k / v may be NULL, rows are empty states */
  {
    int32_t zk[3] = {0, 0, 0};
    a = a0, a.kv_indptr = zk, a.k = NULL, a.v = NULL;
    TU_STATUS(mla_attention_ragged(ctx2, &a), MLA_OK);
    int ok = 1;
    for (int i = 0; i < 9 * H * dv; i++) ok &= out[i] == 0.0f;
    for (int i = 0; i < 9 * H; i++) ok &= isinf(lse[i]) && lse[i] < 0;
    TU_CHECK(ok, "no keys: expected o = 0, lse = -inf");
  }
  free(q);
  free(k);
  free(v);
  free(qd);
  free(kd);
  free(vd);
  free(out);
  free(lse);
}

/* ---- mla_expand_kv ---------------------------------------------------- */

static void expand_case(int T, int H, int nope, int dv, mla_dtype lat, mla_dtype act) {
  char cs[120];
  snprintf(cs, sizeof cs, "expand T=%d H=%d nope=%d v=%d latent=%s act=%s", T, H, nope, dv,
           mla_dtype_name(lat), mla_dtype_name(act));
  double *cd, *rd, *wd;
  void *c = rand_act(lat, (int64_t)T * MLA_LATENT, 1.0, &cd);
  void *r = rand_act(lat, (int64_t)T * MLA_ROPE, 1.0, &rd);
  void *w = rand_act(act, (int64_t)H * (nope + dv) * MLA_LATENT, 1.0 / sqrt(512.0), &wd);
  const int kd = nope + MLA_ROPE;
  const int64_t nk = (int64_t)T * H * kd, nv = (int64_t)T * H * dv;
  const size_t es = tu_act_size(act);
  void *k = malloc(es * (size_t)nk + GUARD * 4), *v = malloc(es * (size_t)nv + GUARD * 4);
  tu_poison(k, es * (size_t)nk + GUARD * 4);
  tu_poison(v, es * (size_t)nv + GUARD * 4);
  TU_STATUS(mla_expand_kv(ctx2, T, H, nope, dv, lat, act, c, r, w, k, v), MLA_OK);
  double *kr = malloc(sizeof(double) * (size_t)(nk + 1));
  double *vr = malloc(sizeof(double) * (size_t)(nv + 1));
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      for (int n = 0; n < nope + dv; n++) {
        long double s = 0.0L;
        const double *wr = wd + ((int64_t)h * (nope + dv) + n) * MLA_LATENT;
        for (int d = 0; d < MLA_LATENT; d++)
          s += (long double)cd[(int64_t)t * MLA_LATENT + d] * wr[d];
        if (n < nope) kr[((int64_t)t * H + h) * kd + n] = tu_round_to(act, (double)s);
        else vr[((int64_t)t * H + h) * dv + n - nope] = tu_round_to(act, (double)s);
      }
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      for (int e = 0; e < MLA_ROPE; e++)
        kr[((int64_t)t * H + h) * kd + nope + e] = tu_round_to(act, rd[(int64_t)t * MLA_ROPE + e]);
  double atol, rtol;
  tol_for(act, &atol, &rtol);
  double *got = malloc(sizeof(double) * (size_t)(nk + nv + 1));
  tu_from_dtype(act, k, got, nk);
  ref_cmp cm = ref_compare(got, kr, nk, atol, rtol);
  TU_CHECK(ref_cmp_ok(&cm, MAX_COS), "%s k: %lld bad of %lld (first %lld: got %g ref %g)", cs,
           (long long)cm.bad + cm.nonfinite_mismatch, (long long)nk, (long long)cm.first_bad,
           cm.first_bad >= 0 ? got[cm.first_bad] : 0.0, cm.first_bad >= 0 ? kr[cm.first_bad] : 0.0);
  tu_from_dtype(act, v, got, nv);
  cm = ref_compare(got, vr, nv, atol, rtol);
  TU_CHECK(ref_cmp_ok(&cm, MAX_COS), "%s v: %lld bad of %lld (first %lld)", cs,
           (long long)cm.bad + cm.nonfinite_mismatch, (long long)nv, (long long)cm.first_bad);
  TU_CHECK(tu_all_poisoned((char *)k + es * (size_t)nk, GUARD * 4) &&
               tu_all_poisoned((char *)v + es * (size_t)nv, GUARD * 4),
           "%s: wrote past the end", cs);
  /* the rope part is a plain copy: bit-exact when the dtypes agree */
  int rope_ok = 1;
  if (lat == act)
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      rope_ok &= !memcmp((char *)k + es * (size_t)(((int64_t)t * H + h) * kd + nope),
                         (char *)r + es * (size_t)t * MLA_ROPE, es * MLA_ROPE);
  TU_CHECK(rope_ok, "%s: rope part is not a copy of r", cs);
  free(got);
  free(kr);
  free(vr);
  free(c);
  free(r);
  free(w);
  free(cd);
  free(rd);
  free(wd);
  free(k);
  free(v);
}

static void expand_tests(void) {
  expand_case(37, 3, 128, 128, MLA_DTYPE_BF16, MLA_DTYPE_BF16);
  expand_case(70, 1, 128, 128, MLA_DTYPE_F32, MLA_DTYPE_F32);
  expand_case(5, 2, 40, 24, MLA_DTYPE_F16, MLA_DTYPE_F16);
  expand_case(33, 2, 0, 8, MLA_DTYPE_BF16, MLA_DTYPE_BF16);
  expand_case(1, 4, 192, 256, MLA_DTYPE_F32, MLA_DTYPE_F32);
  expand_case(29, 2, 128, 128, MLA_DTYPE_F32, MLA_DTYPE_BF16); /* backend's chunked path */
  expand_case(9, 3, 64, 32, MLA_DTYPE_BF16, MLA_DTYPE_F32);
  /* bad arguments */
  double *cd;
  float *c = rand_act(MLA_DTYPE_F32, 4 * MLA_LATENT, 1.0, &cd);
  float w[2 * 16 * MLA_LATENT] = {0};
  float k[4 * 2 * (8 + 64)], v[4 * 2 * 8];
  tu_poison(k, sizeof k);
  tu_poison(v, sizeof v);
#define EX(CTX, T, H, N, DV, ACT, ...) mla_expand_kv(CTX, T, H, N, DV, ACT, ACT, __VA_ARGS__)
  TU_STATUS(EX(NULL, 4, 2, 8, 8, MLA_DTYPE_F32, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT);
  expect_fail(EX(ctx2, -1, 2, 8, 8, MLA_DTYPE_F32, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand T < 0");
  expect_fail(EX(ctx2, 4, 0, 8, 8, MLA_DTYPE_F32, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand H 0");
  expect_fail(EX(ctx2, 4, 2, -1, 8, MLA_DTYPE_F32, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand nope < 0");
  expect_fail(EX(ctx2, 4, 2, MLA_MAX_HEAD_DIM, 8, MLA_DTYPE_F32, c, c, w, k, v),
              MLA_ERR_INVALID_ARGUMENT, k, sizeof k, v, sizeof v, "expand nope + 64 too wide");
  expect_fail(EX(ctx2, 4, 2, 8, 0, MLA_DTYPE_F32, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand v_dim 0");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_FP8_E4M3, c, c, w, k, v), MLA_ERR_UNSUPPORTED, k,
              sizeof k, v, sizeof v, "expand fp8");
  expect_fail(EX(ctx2, 4, 2, 8, 8, (mla_dtype)42, c, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand dtype 42");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_F32, NULL, c, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand c NULL");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_F32, c, NULL, w, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand r NULL");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_F32, c, c, NULL, k, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand w NULL");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_F32, c, c, w, NULL, v), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand k NULL");
  expect_fail(EX(ctx2, 4, 2, 8, 8, MLA_DTYPE_F32, c, c, w, k, NULL), MLA_ERR_INVALID_ARGUMENT, k,
              sizeof k, v, sizeof v, "expand v NULL");
  TU_STATUS(EX(ctx2, 0, 2, 8, 8, MLA_DTYPE_F32, NULL, NULL, NULL, NULL, NULL), MLA_OK);
#undef EX
  free(c);
  free(cd);
}

int main(void) {
  rng.s = tu_seed("test_cpu_ragged", 4242);
  mla_ctx_desc d2 = {MLA_DEVICE_CPU, 2, 0}, d1 = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&d2, &ctx2), MLA_OK);
  TU_STATUS(mla_ctx_create(&d1, &ctx1), MLA_OK);
  if (!ctx1 || !ctx2) return tu_finish("test_cpu_ragged");
  clock_t t0 = clock();
  bad_args();
  expand_tests();
  const mla_cpu_kernels *best = mla_cpu_kernels_get();
  printf("best ISA: %s\n", best->name);
  random_cases(90, 1);
  const mla_cpu_isa isas[3] = {MLA_CPU_ISA_SCALAR, MLA_CPU_ISA_AVX2, MLA_CPU_ISA_AVX512};
  for (int i = 0; i < 3; i++) {
    if (isas[i] == best->isa || mla_cpu_set_isa(isas[i]) != 0) continue;
    printf("ISA %s\n", mla_cpu_kernels_get()->name);
    random_cases(30, 0);
    expand_case(20, 2, 128, 128, MLA_DTYPE_F32, MLA_DTYPE_BF16);
  }
  mla_cpu_set_isa(MLA_CPU_ISA_AUTO);
  printf("cpu time %.1f s\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
  mla_ctx_destroy(ctx1);
  mla_ctx_destroy(ctx2);
  return tu_finish("test_cpu_ragged");
}
