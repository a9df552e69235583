/* Sanity checks of the float64 oracle that do not lean on the golden cases:
 * identities attention must satisfy (split keys + merge = one shot, zero
 * queries average the values, causal = a loop of growing decodes, grouped
 * heads = replicated heads), small cases solved by hand, the rounding
 * functions against hand-derived values and against an enumeration of every
 * code of each format, and the comparison helper. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ref.h"
#include "test_util.h"

#define L 512
#define R 64
#define TOL 1e-12

static double *dalloc(int64_t n) {
  double *p = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

static double *randn(tu_rng *rng, int64_t n, double sigma) {
  double *p = dalloc(n);
  for (int64_t i = 0; i < n; i++) p[i] = sigma * tu_normal(rng);
  return p;
}

static int64_t sum(const int *a, int n) {
  int64_t s = 0;
  for (int i = 0; i < n; i++) s += a[i];
  return s;
}

/* Keys query i of (Q queries, K keys) sees, written out independently of ref.c. */
static int visible(int causal, int Q, int K, int i) {
  if (!causal) return K;
  int n = K - Q + i + 1;
  return n < 0 ? 0 : (n > K ? K : n);
}

static void check_close(const char *what, const double *got, const double *want, int64_t n,
                        double tol) {
  ref_cmp c = ref_compare(got, want, n, tol, tol);
  TU_CHECK(ref_cmp_ok(&c, 1e-12), "%s: max abs err %.3e, bad %lld, nonfinite mismatch %lld, first %lld",
           what, c.max_abs_err, (long long)c.bad, (long long)c.nonfinite_mismatch,
           (long long)c.first_bad);
}

/* Rows [k0, k0+n) of a [*, width] array, for every request, concatenated. */
static double *gather_keys(const double *src, int width, int batch, const int *kv_len,
                           const int *begin, const int *count) {
  double *dst = dalloc(sum(count, batch) * width);
  int64_t k0 = 0, out = 0;
  for (int b = 0; b < batch; b++) {
    memcpy(dst + out * width, src + (k0 + begin[b]) * width, sizeof(double) * (size_t)count[b] * width);
    out += count[b];
    k0 += kv_len[b];
  }
  return dst;
}

/* ---- split keys in two parts, attend to each, merge == attend to all ------ */
static void test_split_merge_absorbed(tu_rng *rng) {
  for (int trial = 0; trial < 6; trial++) {
    int B = tu_randint(rng, 1, 4), H = tu_randint(rng, 1, 5);
    int q_len[4], kv_len[4], cut[4], zero[4] = {0, 0, 0, 0}, rest[4];
    for (int b = 0; b < B; b++) {
      q_len[b] = tu_randint(rng, 1, 3);
      kv_len[b] = tu_randint(rng, 0, 40);
      cut[b] = tu_randint(rng, 0, kv_len[b]); /* 0 or K makes one side empty */
      rest[b] = kv_len[b] - cut[b];
    }
    const int64_t tq = sum(q_len, B), tk = sum(kv_len, B);
    /* Large-ish logits (sigma 3 after scale) stress the max subtraction. */
    const double scale = 3.0 / sqrt((double)(L + R));
    double *qn = randn(rng, tq * H * L, 1.0), *qr = randn(rng, tq * H * R, 1.0);
    double *c = randn(rng, tk * L, 1.0), *r = randn(rng, tk * R, 1.0);
    double *cA = gather_keys(c, L, B, kv_len, zero, cut), *rA = gather_keys(r, R, B, kv_len, zero, cut);
    double *cB = gather_keys(c, L, B, kv_len, cut, rest), *rB = gather_keys(r, R, B, kv_len, cut, rest);
    double *o = dalloc(tq * H * L), *oA = dalloc(tq * H * L), *oB = dalloc(tq * H * L);
    double *om = dalloc(tq * H * L);
    double *lse = dalloc(tq * H), *lA = dalloc(tq * H), *lB = dalloc(tq * H), *lm = dalloc(tq * H);
    ref_absorbed(B, q_len, kv_len, H, scale, 0, qn, qr, c, r, o, lse);
    ref_absorbed(B, q_len, cut, H, scale, 0, qn, qr, cA, rA, oA, lA);
    ref_absorbed(B, q_len, rest, H, scale, 0, qn, qr, cB, rB, oB, lB);
    const double *op[2] = {oA, oB}, *lp[2] = {lA, lB};
    ref_merge(2, (int)tq, H, L, op, lp, om, lm);
    check_close("absorbed split+merge o", om, o, tq * H * L, TOL);
    check_close("absorbed split+merge lse", lm, lse, tq * H, TOL);
    /* A request without keys is the empty state in both. */
    int64_t q0 = 0;
    for (int b = 0; b < B; b++) {
      for (int i = 0; i < q_len[b]; i++)
        for (int h = 0; h < H; h++) {
          const int64_t row = (q0 + i) * H + h;
          if (kv_len[b] == 0)
            TU_CHECK(lse[row] == -INFINITY && o[row * L] == 0.0 && o[row * L + L - 1] == 0.0,
                     "request %d without keys: lse %g o[0] %g", b, lse[row], o[row * L]);
          else
            TU_CHECK(isfinite(lse[row]), "request %d: lse %g not finite", b, lse[row]);
        }
      q0 += q_len[b];
    }
    free(qn), free(qr), free(c), free(r), free(cA), free(rA), free(cB), free(rB);
    free(o), free(oA), free(oB), free(om), free(lse), free(lA), free(lB), free(lm);
  }
}

/* Three-way split of MHA keys (grouped heads, optional soft cap). */
static void test_split_merge_mha(tu_rng *rng) {
  for (int trial = 0; trial < 8; trial++) {
    int B = tu_randint(rng, 1, 3);
    const int groups[4] = {1, 2, 3, 4};
    int hkv = tu_randint(rng, 1, 3), H = hkv * groups[tu_randint(rng, 0, 3)];
    int dqk = tu_randint(rng, 1, 80), dv = tu_randint(rng, 1, 70);
    double softcap = (trial & 1) ? 5.0 + 20.0 * tu_uniform(rng) : 0.0;
    int q_len[3], kv_len[3], len[3][3], beg[3][3];
    for (int b = 0; b < B; b++) {
      q_len[b] = tu_randint(rng, 1, 4);
      kv_len[b] = tu_randint(rng, 0, 30);
      int a = tu_randint(rng, 0, kv_len[b]), z = tu_randint(rng, a, kv_len[b]);
      beg[0][b] = 0, len[0][b] = a;
      beg[1][b] = a, len[1][b] = z - a;
      beg[2][b] = z, len[2][b] = kv_len[b] - z;
    }
    const int64_t tq = sum(q_len, B), tk = sum(kv_len, B);
    const double scale = 2.0 / sqrt((double)dqk);
    double *q = randn(rng, tq * H * dqk, 1.0), *k = randn(rng, tk * hkv * dqk, 1.0);
    double *v = randn(rng, tk * hkv * dv, 1.0);
    double *o = dalloc(tq * H * dv), *lse = dalloc(tq * H);
    ref_mha(B, q_len, kv_len, H, hkv, dqk, dv, scale, softcap, 0, q, k, v, o, lse);
    double *kp[3], *vp[3], *op[3], *lp[3];
    for (int p = 0; p < 3; p++) {
      kp[p] = gather_keys(k, hkv * dqk, B, kv_len, beg[p], len[p]);
      vp[p] = gather_keys(v, hkv * dv, B, kv_len, beg[p], len[p]);
      op[p] = dalloc(tq * H * dv);
      lp[p] = dalloc(tq * H);
      ref_mha(B, q_len, len[p], H, hkv, dqk, dv, scale, softcap, 0, q, kp[p], vp[p], op[p], lp[p]);
    }
    double *om = dalloc(tq * H * dv), *lm = dalloc(tq * H);
    ref_merge(3, (int)tq, H, dv, (const double *const *)op, (const double *const *)lp, om, lm);
    check_close("mha 3-way split+merge o", om, o, tq * H * dv, TOL);
    check_close("mha 3-way split+merge lse", lm, lse, tq * H, TOL);
    for (int p = 0; p < 3; p++) free(kp[p]), free(vp[p]), free(op[p]), free(lp[p]);
    free(q), free(k), free(v), free(o), free(lse), free(om), free(lm);
  }
}

/* ---- zero queries: every visible key has weight 1/n ----------------------- */
static void test_uniform(tu_rng *rng) {
  for (int causal = 0; causal <= 1; causal++) {
    /* Request 1 has K < Q (early queries see nothing when causal). */
    int B = 3, H = tu_randint(rng, 1, 4);
    int q_len[3] = {tu_randint(rng, 1, 5), 6, 1}, kv_len[3] = {tu_randint(rng, 5, 20), 3, 0};
    const int64_t tq = sum(q_len, B), tk = sum(kv_len, B);
    double *qn = dalloc(tq * H * L), *qr = dalloc(tq * H * R);
    memset(qn, 0, sizeof(double) * (size_t)(tq * H * L));
    memset(qr, 0, sizeof(double) * (size_t)(tq * H * R));
    double *c = randn(rng, tk * L, 1.0), *r = randn(rng, tk * R, 1.0);
    double *o = dalloc(tq * H * L), *lse = dalloc(tq * H);
    double *want = dalloc(tq * H * L), *wlse = dalloc(tq * H);
    ref_absorbed(B, q_len, kv_len, H, 0.7, causal, qn, qr, c, r, o, lse);
    int64_t q0 = 0, k0 = 0;
    for (int b = 0; b < B; b++) {
      for (int i = 0; i < q_len[b]; i++) {
        const int n = visible(causal, q_len[b], kv_len[b], i);
        for (int h = 0; h < H; h++) {
          const int64_t row = (q0 + i) * H + h;
          wlse[row] = n ? log((double)n) : -INFINITY;
          for (int d = 0; d < L; d++) {
            double s = 0.0;
            for (int j = 0; j < n; j++) s += c[(k0 + j) * L + d];
            want[row * L + d] = n ? s / n : 0.0;
          }
        }
      }
      q0 += q_len[b];
      k0 += kv_len[b];
    }
    check_close(causal ? "uniform causal o" : "uniform o", o, want, tq * H * L, TOL);
    check_close(causal ? "uniform causal lse" : "uniform lse", lse, wlse, tq * H, TOL);
    free(qn), free(qr), free(c), free(r), free(o), free(lse), free(want), free(wlse);
  }
}

/* ---- causal == loop of decodes with growing K ----------------------------- */
static void test_causal_loop(tu_rng *rng) {
  for (int trial = 0; trial < 4; trial++) {
    const int H = tu_randint(rng, 1, 4);
    const int Q = tu_randint(rng, 1, 8);
    const int K = (trial & 1) ? Q : Q + tu_randint(rng, 1, 20); /* K == Q, then a prefix */
    double *qn = randn(rng, (int64_t)Q * H * L, 1.0), *qr = randn(rng, (int64_t)Q * H * R, 1.0);
    double *c = randn(rng, (int64_t)K * L, 1.0), *r = randn(rng, (int64_t)K * R, 1.0);
    double *o = dalloc((int64_t)Q * H * L), *lse = dalloc((int64_t)Q * H);
    double *o1 = dalloc((int64_t)Q * H * L), *l1 = dalloc((int64_t)Q * H);
    const double scale = 2.0 / sqrt((double)(L + R));
    ref_absorbed(1, &Q, &K, H, scale, 1, qn, qr, c, r, o, lse);
    for (int i = 0; i < Q; i++) {
      int one = 1, kv = K - Q + i + 1;
      ref_absorbed(1, &one, &kv, H, scale, 0, qn + (int64_t)i * H * L, qr + (int64_t)i * H * R, c,
                   r, o1 + (int64_t)i * H * L, l1 + (int64_t)i * H);
    }
    check_close("absorbed causal vs decode loop o", o, o1, (int64_t)Q * H * L, TOL);
    check_close("absorbed causal vs decode loop lse", lse, l1, (int64_t)Q * H, TOL);
    free(qn), free(qr), free(c), free(r), free(o), free(lse), free(o1), free(l1);

    /* Same for MHA with grouped heads and a soft cap. */
    const int hkv = tu_randint(rng, 1, 2), Hm = hkv * tu_randint(rng, 1, 3);
    const int dqk = tu_randint(rng, 1, 40), dv = tu_randint(rng, 1, 40);
    const double cap = (trial & 2) ? 10.0 : 0.0;
    double *q = randn(rng, (int64_t)Q * Hm * dqk, 1.0), *k = randn(rng, (int64_t)K * hkv * dqk, 1.0);
    double *v = randn(rng, (int64_t)K * hkv * dv, 1.0);
    double *om = dalloc((int64_t)Q * Hm * dv), *lm = dalloc((int64_t)Q * Hm);
    double *om1 = dalloc((int64_t)Q * Hm * dv), *lm1 = dalloc((int64_t)Q * Hm);
    ref_mha(1, &Q, &K, Hm, hkv, dqk, dv, 0.5, cap, 1, q, k, v, om, lm);
    for (int i = 0; i < Q; i++) {
      int one = 1, kv = K - Q + i + 1;
      ref_mha(1, &one, &kv, Hm, hkv, dqk, dv, 0.5, cap, 0, q + (int64_t)i * Hm * dqk, k, v,
              om1 + (int64_t)i * Hm * dv, lm1 + (int64_t)i * Hm);
    }
    check_close("mha causal vs decode loop o", om, om1, (int64_t)Q * Hm * dv, TOL);
    check_close("mha causal vs decode loop lse", lm, lm1, (int64_t)Q * Hm, TOL);
    free(q), free(k), free(v), free(om), free(lm), free(om1), free(lm1);
  }
}

/* ---- grouped kv heads == explicitly replicated kv heads ------------------- */
static void test_gqa(tu_rng *rng) {
  const int hkv = 2, H = 6, g = H / hkv, dqk = 24, dv = 16, Q = 3, K = 11;
  double *q = randn(rng, Q * H * dqk, 1.0), *k = randn(rng, K * hkv * dqk, 1.0);
  double *v = randn(rng, K * hkv * dv, 1.0);
  double *kr = dalloc(K * H * dqk), *vr = dalloc(K * H * dv);
  for (int t = 0; t < K; t++)
    for (int h = 0; h < H; h++) { /* query head h reads kv head h / g */
      memcpy(kr + (t * H + h) * dqk, k + (t * hkv + h / g) * dqk, sizeof(double) * dqk);
      memcpy(vr + (t * H + h) * dv, v + (t * hkv + h / g) * dv, sizeof(double) * dv);
    }
  double *o = dalloc(Q * H * dv), *lse = dalloc(Q * H), *o2 = dalloc(Q * H * dv), *l2 = dalloc(Q * H);
  ref_mha(1, &Q, &K, H, hkv, dqk, dv, 0.3, 0.0, 1, q, k, v, o, lse);
  ref_mha(1, &Q, &K, H, H, dqk, dv, 0.3, 0.0, 1, q, kr, vr, o2, l2);
  check_close("gqa vs replicated o", o, o2, Q * H * dv, 0.0);
  check_close("gqa vs replicated lse", lse, l2, Q * H, 0.0);
  free(q), free(k), free(v), free(kr), free(vr), free(o), free(lse), free(o2), free(l2);
}

/* ---- cases solved by hand -------------------------------------------------- */
static void test_hand(void) {
  /* MHA, one dim: s = [0, ln 3] -> p = [1/4, 3/4]; o = 1/4 + 3/4 * 5 = 4; lse = ln 4. */
  {
    int Q = 1, K = 2;
    double q[1] = {1.0}, k[2] = {0.0, log(3.0)}, v[2] = {1.0, 5.0}, o[1], lse[1];
    ref_mha(1, &Q, &K, 1, 1, 1, 1, 1.0, 0.0, 0, q, k, v, o, lse);
    TU_CHECK(fabs(o[0] - 4.0) < 1e-14 && fabs(lse[0] - log(4.0)) < 1e-14, "hand mha: o %.17g lse %.17g",
             o[0], lse[0]);
    /* scale 0.5 with q = 2 is the same logits. */
    q[0] = 2.0;
    ref_mha(1, &Q, &K, 1, 1, 1, 1, 0.5, 0.0, 0, q, k, v, o, lse);
    TU_CHECK(fabs(o[0] - 4.0) < 1e-14, "hand mha scale: o %.17g", o[0]);
    /* Causal with Q = K = 2 and query 0: sees key 0 only -> o = 1, lse = 0. */
    int Q2 = 2;
    double q2[2] = {1.0, 1.0}, o2[2], l2[2];
    ref_mha(1, &Q2, &K, 1, 1, 1, 1, 1.0, 0.0, 1, q2, k, v, o2, l2);
    TU_CHECK(o2[0] == 1.0 && l2[0] == 0.0 && fabs(o2[1] - 4.0) < 1e-14,
             "hand mha causal: o %.17g %.17g lse %.17g", o2[0], o2[1], l2[0]);
    /* Causal with K = 1 < Q = 2: query 0 sees nothing, query 1 sees key 0. */
    int K1 = 1;
    ref_mha(1, &Q2, &K1, 1, 1, 1, 1, 1.0, 0.0, 1, q2, k, v, o2, l2);
    TU_CHECK(o2[0] == 0.0 && l2[0] == -INFINITY && o2[1] == 1.0 && l2[1] == 0.0,
             "hand mha K<Q: o %g %g lse %g %g", o2[0], o2[1], l2[0], l2[1]);
  }
  /* Soft cap 2: k = [0, 2 atanh(1/2)] gives s = 2 tanh(k / 2) = [0, 1]. */
  {
    int Q = 1, K = 2;
    double q[1] = {1.0}, k[2] = {0.0, 2.0 * atanh(0.5)}, v[2] = {0.0, 1.0}, o[1], lse[1];
    ref_mha(1, &Q, &K, 1, 1, 1, 1, 1.0, 2.0, 0, q, k, v, o, lse);
    const double e = exp(1.0);
    TU_CHECK(fabs(o[0] - e / (1.0 + e)) < 1e-14 && fabs(lse[0] - log(1.0 + e)) < 1e-14,
             "hand softcap: o %.17g lse %.17g", o[0], lse[0]);
  }
  /* Absorbed: the rope part counts in the logits, V = latent part.
   * key 0: c = e1, r = ln2 e0 -> s0 = ln 2; key 1: c = ln3 e0 -> s1 = ln 3.
   * p = [2/5, 3/5]; o[0] = 3/5 ln 3, o[1] = 2/5; lse = ln 5. */
  {
    int Q = 1, K = 2;
    double qn[L] = {0}, qr[R] = {0}, c[2 * L] = {0}, r[2 * R] = {0}, o[L], lse[1];
    qn[0] = 1.0, qr[0] = 1.0;
    c[1] = 1.0, r[0] = log(2.0);
    c[L] = log(3.0);
    ref_absorbed(1, &Q, &K, 1, 1.0, 0, qn, qr, c, r, o, lse);
    TU_CHECK(fabs(o[0] - 0.6 * log(3.0)) < 1e-14 && fabs(o[1] - 0.4) < 1e-14 && o[2] == 0.0 &&
                 fabs(lse[0] - log(5.0)) < 1e-14,
             "hand absorbed: o %.17g %.17g %.17g lse %.17g", o[0], o[1], o[2], lse[0]);
  }
}

/* ---- merge edge cases -------------------------------------------------------- */
static void test_merge_edges(tu_rng *rng) {
  const int D = 7;
  double oa[2 * D], ob[2 * D], o[2 * D], la[2], lb[2], lse[2];
  const double *op[2] = {oa, ob}, *lp[2] = {la, lb};
  /* Both empty, with NaN garbage in o: o = 0, lse = -inf. */
  for (int d = 0; d < 2 * D; d++) oa[d] = NAN, ob[d] = NAN;
  la[0] = lb[0] = la[1] = lb[1] = -INFINITY;
  ref_merge(2, 2, 1, D, op, lp, o, lse);
  int ok = lse[0] == -INFINITY && lse[1] == -INFINITY;
  for (int d = 0; d < 2 * D; d++) ok = ok && o[d] == 0.0;
  TU_CHECK(ok, "merge of two empty states must be o = 0, lse = -inf");
  /* One side empty with garbage: the other side comes out unchanged. */
  for (int d = 0; d < 2 * D; d++) ob[d] = tu_normal(rng);
  lb[0] = 1.5, lb[1] = -3.0;
  ref_merge(2, 2, 1, D, op, lp, o, lse);
  ok = lse[0] == 1.5 && lse[1] == -3.0;
  for (int d = 0; d < 2 * D; d++) ok = ok && fabs(o[d] - ob[d]) <= 1e-15 * fabs(ob[d]);
  TU_CHECK(ok, "merge with an empty side must return the other side");
  /* Hand case: lse [0, ln 3], o [1, 5] -> o = 4, lse = ln 4; and identical
   * states: o unchanged, lse + ln 2. */
  for (int d = 0; d < D; d++) oa[d] = 1.0, ob[d] = 5.0, oa[D + d] = ob[D + d] = 0.25 * d - 0.5;
  la[0] = 0.0, lb[0] = log(3.0), la[1] = lb[1] = 7.0;
  ref_merge(2, 2, 1, D, op, lp, o, lse);
  ok = fabs(lse[0] - log(4.0)) < 1e-14 && fabs(lse[1] - (7.0 + log(2.0))) < 1e-14;
  for (int d = 0; d < D; d++)
    ok = ok && fabs(o[d] - 4.0) < 1e-14 && fabs(o[D + d] - (0.25 * d - 0.5)) < 1e-15;
  TU_CHECK(ok, "merge hand case: lse %.17g %.17g o %.17g", lse[0], lse[1], o[0]);
  /* LSEs 160 apart: the small side weighs e^-160 (no overflow, no NaN). */
  la[0] = -80.0, lb[0] = 80.0;
  for (int d = 0; d < D; d++) oa[d] = 1e6, ob[d] = 1.0;
  ref_merge(2, 1, 1, D, op, lp, o, lse);
  TU_CHECK(lse[0] == 80.0 && fabs(o[0] - (1.0 + 1e6 * exp(-160.0))) < 1e-15,
           "merge 160 apart: lse %.17g o %.17g", lse[0], o[0]);
  /* Three parts, one empty: same as merging the two others. */
  double oc[D], lc[1] = {-INFINITY}, o3[D], l3[1];
  for (int d = 0; d < D; d++) oa[d] = tu_normal(rng), ob[d] = tu_normal(rng), oc[d] = NAN;
  la[0] = tu_normal(rng), lb[0] = tu_normal(rng);
  const double *op3[3] = {oc, oa, ob}, *lp3[3] = {lc, la, lb};
  ref_merge(2, 1, 1, D, op, lp, o, lse);
  ref_merge(3, 1, 1, D, op3, lp3, o3, l3);
  check_close("merge 3 parts with an empty one o", o3, o, D, 1e-15);
  check_close("merge 3 parts with an empty one lse", l3, lse, 1, 1e-15);
  /* A NaN lse is broken input and must show as NaN, not vanish. */
  la[0] = NAN, lb[0] = 0.0;
  ref_merge(2, 1, 1, D, op, lp, o, lse);
  TU_CHECK(isnan(lse[0]) && isnan(o[0]), "merge with a NaN lse must give NaN");
}

/* ---- rounding ----------------------------------------------------------------- */
typedef double (*round_fn)(double);

static void expect_round(const char *fmt, round_fn f, double x, double want) {
  double got = f(x);
  int ok = (isnan(want) && isnan(got)) || (got == want && signbit(got) == signbit(want));
  TU_CHECK(ok, "%s(%.17g) = %.17g, expected %.17g", fmt, x, got, want);
}

static void test_round_known(void) {
  round_fn b = ref_round_bf16, h = ref_round_f16, e = ref_round_e4m3;
  /* bf16: 8 significant bits, quantum 2^-7 at 1. */
  expect_round("bf16", b, 1.0 + ldexp(1, -8), 1.0);                       /* tie -> even 1 */
  expect_round("bf16", b, 1.0 + 3 * ldexp(1, -8), 1.0 + ldexp(1, -6));    /* tie -> even */
  expect_round("bf16", b, 1.0 + ldexp(1, -8) + ldexp(1, -30), 1.0 + ldexp(1, -7)); /* above tie */
  expect_round("bf16", b, -(1.0 + 3 * ldexp(1, -8)), -(1.0 + ldexp(1, -6)));
  expect_round("bf16", b, 1.0 / 3.0, 0.333984375);                        /* 0x3EAB */
  expect_round("bf16", b, ldexp(255, 120), ldexp(255, 120));              /* max finite */
  expect_round("bf16", b, ldexp(511, 119), INFINITY);                     /* tie above max */
  expect_round("bf16", b, ldexp(511, 119) - ldexp(1, 100), ldexp(255, 120));
  expect_round("bf16", b, ldexp(1, -133), ldexp(1, -133));                /* min subnormal */
  expect_round("bf16", b, ldexp(1, -134), 0.0);                           /* tie -> 0 */
  expect_round("bf16", b, 3 * ldexp(1, -135), ldexp(1, -133));            /* 0.75 quantum */
  expect_round("bf16", b, -0.0, -0.0);
  expect_round("bf16", b, -INFINITY, -INFINITY);
  expect_round("bf16", b, NAN, NAN);
  /* f16: 11 significant bits, emin -14, max 65504. */
  expect_round("f16", h, 1.0 / 3.0, 0.333251953125);                      /* 0x3555 */
  expect_round("f16", h, 1.0 + ldexp(1, -11), 1.0);
  expect_round("f16", h, 1.0 + 3 * ldexp(1, -11), 1.0 + ldexp(1, -9));
  expect_round("f16", h, 2049.0, 2048.0);
  expect_round("f16", h, 2051.0, 2052.0);
  expect_round("f16", h, 65504.0, 65504.0);
  expect_round("f16", h, 65519.99, 65504.0);
  expect_round("f16", h, 65520.0, INFINITY);
  expect_round("f16", h, -1e6, -INFINITY);
  expect_round("f16", h, ldexp(1, -24), ldexp(1, -24));
  expect_round("f16", h, ldexp(1, -25), 0.0);
  expect_round("f16", h, 3 * ldexp(1, -25), ldexp(1, -23));
  expect_round("f16", h, ldexp(1023, -24), ldexp(1023, -24));             /* max subnormal */
  expect_round("f16", h, NAN, NAN);
  /* e4m3fn: 4 significant bits, emin -6 (subnormal step 2^-9), max 448. */
  expect_round("e4m3", e, 448.0, 448.0);
  expect_round("e4m3", e, 449.0, 448.0);
  expect_round("e4m3", e, 464.0, 448.0); /* tie of 448 and (NaN) 480 */
  expect_round("e4m3", e, 500.0, 448.0);
  expect_round("e4m3", e, -500.0, -448.0);
  expect_round("e4m3", e, 1e30, 448.0);
  expect_round("e4m3", e, INFINITY, 448.0);
  expect_round("e4m3", e, -INFINITY, -448.0);
  expect_round("e4m3", e, NAN, NAN);
  expect_round("e4m3", e, ldexp(1, -9), ldexp(1, -9));                    /* 0.001953125 */
  expect_round("e4m3", e, ldexp(1, -10), 0.0);                            /* tie -> 0 */
  expect_round("e4m3", e, -ldexp(1, -10), -0.0);
  expect_round("e4m3", e, 3 * ldexp(1, -10), ldexp(1, -8));               /* tie -> even 2 */
  expect_round("e4m3", e, 7 * ldexp(1, -9), 7 * ldexp(1, -9));            /* max subnormal */
  expect_round("e4m3", e, ldexp(1, -6), ldexp(1, -6));                    /* min normal */
  expect_round("e4m3", e, 17.0, 16.0);     /* neighbours 16 and 18: tie -> 16 */
  expect_round("e4m3", e, 19.0, 20.0);     /* neighbours 18 and 20: tie -> 20 */
  expect_round("e4m3", e, 1.0625, 1.0);    /* tie of 1 and 1.125 -> 1 */
  expect_round("e4m3", e, 1.1875, 1.25);   /* tie of 1.125 and 1.25 -> 1.25 */
  expect_round("e4m3", e, 0.1, 0.1015625); /* 13 * 2^-7 */
  expect_round("e4m3", e, 0.3, 0.3125);    /* 10 * 2^-5 */
  expect_round("e4m3", e, 240.0, 240.0);
  expect_round("e4m3", e, 250.0, 256.0);
}

/* Value of a code of a binary format with `mbits` stored mantissa bits and
 * exponent `bias` (the code's low bits are the mantissa). */
static double decode(unsigned code, int mbits, int bias) {
  const unsigned m = code & ((1u << mbits) - 1u), ex = code >> mbits;
  return ex == 0 ? ldexp((double)m, 1 - bias - mbits)
                 : ldexp((double)(m | (1u << mbits)), (int)ex - bias - mbits);
}

/* Walk every positive finite code in order: each value rounds to itself, the
 * midpoint to the neighbour with the even code, and points just off the
 * midpoint to the nearer neighbour; negatives mirror. `top` is the value
 * the last gap's midpoint and beyond round to (inf, or max when saturating). */
static void enumerate(const char *fmt, round_fn f, unsigned last_code, int mbits, int bias,
                      double beyond) {
  int64_t bad = 0;
  for (unsigned k = 0; k <= last_code; k++) {
    const double v = decode(k, mbits, bias);
    const double next = k < last_code ? decode(k + 1, mbits, bias)
                                      : v + ldexp(1.0, (int)(k >> mbits) - bias - mbits);
    const double up = k < last_code ? next : beyond;
    const double mid = 0.5 * (v + next);
    const double tie = (k & 1u) ? up : v; /* the even code of the pair */
    int ok = f(v) == v && f(-v) == -v && f(mid) == tie && f(-mid) == -tie &&
             f(nextafter(mid, 0.0)) == v && f(nextafter(mid, INFINITY)) == up &&
             (k == 0 || f(nextafter(v, 0.0)) == v);
    if (!ok) {
      if (bad < 5) fprintf(stderr, "%s: code 0x%x value %.17g (mid %.17g -> %.17g)\n", fmt, k, v, mid, f(mid));
      bad++;
    }
  }
  TU_CHECK(bad == 0, "%s: %lld codes round wrongly", fmt, (long long)bad);
}

static void test_round_enumerate(void) {
  enumerate("bf16", ref_round_bf16, 0x7F7Fu, 7, 127, INFINITY);
  enumerate("f16", ref_round_f16, 0x7BFFu, 10, 15, INFINITY);
  enumerate("e4m3", ref_round_e4m3, 0x7Eu, 3, 7, 448.0); /* 0x7F is NaN; saturate */
}

/* ref_round_* against the bit-level conversions of test_util (two separate
 * implementations of the same rounding) on random floats of every scale. */
static void test_round_vs_util(tu_rng *rng) {
  enum { N = 20000 };
  static float x[N];
  static uint16_t bits[N];
  static double back[N];
  for (int i = 0; i < N; i++) {
    /* Every float exponent for bf16 (kept below 2^127 so the float
     * conversion is exact-or-rounded, never out of range), half of them in
     * f16's range; exact ties of each format sprinkled in. */
    const double m = 1.0 + tu_uniform(rng);
    const int ex = (i & 2) ? tu_randint(rng, -27, 16) : tu_randint(rng, -149, 126);
    double v = ldexp(m, ex);
    if (i % 7 == 0) v = ldexp(2 * tu_randint(rng, 128, 255) + 1, tu_randint(rng, -141, 100));
    if (i % 11 == 0) v = ldexp(2 * tu_randint(rng, 1024, 2047) + 1, tu_randint(rng, -36, 3));
    x[i] = (float)((i & 1) ? -v : v);
  }
  const mla_dtype types[2] = {MLA_DTYPE_BF16, MLA_DTYPE_F16};
  const round_fn fns[2] = {ref_round_bf16, ref_round_f16};
  for (int t = 0; t < 2; t++) {
    tu_to_dtype(types[t], x, bits, N);
    tu_from_dtype(types[t], bits, back, N);
    int64_t bad = 0;
    for (int i = 0; i < N; i++) {
      const double want = fns[t]((double)x[i]);
      if (!(back[i] == want || (isnan(back[i]) && isnan(want)))) {
        if (bad < 5)
          fprintf(stderr, "%s: x %.9g util %.17g ref %.17g\n", t ? "f16" : "bf16", x[i], back[i], want);
        bad++;
      }
    }
    TU_CHECK(bad == 0, "%s: %lld of %d random values differ between tu_* and ref_round_*",
             t ? "f16" : "bf16", (long long)bad, N);
  }
  /* bf16-representable fill really is representable. */
  float fill[256];
  tu_fill_bf16_normal(rng, fill, 256, 2.0);
  int rep = 1;
  for (int i = 0; i < 256; i++) rep = rep && ref_round_bf16(fill[i]) == fill[i];
  TU_CHECK(rep, "tu_fill_bf16_normal produced a value bf16 cannot hold");
}

/* ---- ref_compare -------------------------------------------------------------- */
static void test_compare(void) {
  const double ref[6] = {1.0, -2.0, NAN, INFINITY, 0.0, 100.0};
  double got[6] = {1.0 + 1e-9, -2.0, NAN, INFINITY, 0.0, 100.0};
  ref_cmp c = ref_compare(got, ref, 6, 1e-6, 0.0);
  TU_CHECK(c.n == 6 && c.bad == 0 && c.nonfinite_mismatch == 0 && ref_cmp_ok(&c, 1e-12) && c.first_bad == -1,
           "matching vectors: bad %lld mismatch %lld", (long long)c.bad, (long long)c.nonfinite_mismatch);
  TU_CHECK(fabs(c.max_abs_err - 1e-9) < 1e-15, "max_abs_err %.3e", c.max_abs_err);
  got[5] = 100.5; /* |err| 0.5 > 1e-6 + 1e-3 * 100 = 0.100001 */
  c = ref_compare(got, ref, 6, 1e-6, 1e-3);
  TU_CHECK(c.bad == 1 && c.first_bad == 5 && !ref_cmp_ok(&c, 1.0), "tolerance: bad %lld first %lld",
           (long long)c.bad, (long long)c.first_bad);
  TU_CHECK(fabs(c.max_rel_err - 0.005) < 1e-12, "max_rel_err %.3e", c.max_rel_err);
  got[5] = 100.09; /* within 0.100001 */
  c = ref_compare(got, ref, 6, 1e-6, 1e-3);
  TU_CHECK(c.bad == 0 && ref_cmp_ok(&c, 1e-3), "within rtol: bad %lld", (long long)c.bad);
  got[5] = 100.0;
  got[3] = -INFINITY; /* sign of inf differs */
  c = ref_compare(got, ref, 6, 1e-6, 0.0);
  TU_CHECK(c.nonfinite_mismatch == 1 && c.first_bad == 3 && !ref_cmp_ok(&c, 1.0), "-inf vs +inf");
  got[3] = INFINITY;
  got[2] = 3.0; /* finite where NaN is expected */
  c = ref_compare(got, ref, 6, 1e-6, 0.0);
  TU_CHECK(c.nonfinite_mismatch == 1 && c.first_bad == 2, "finite vs NaN");
  got[2] = NAN;
  got[0] = NAN; /* NaN where a finite value is expected */
  c = ref_compare(got, ref, 6, 1e-6, 0.0);
  TU_CHECK(c.nonfinite_mismatch == 1 && c.first_bad == 0 && !ref_cmp_ok(&c, 1.0), "NaN vs finite");
  /* Cosine distance. */
  const double z[3] = {0, 0, 0}, a[3] = {1, 2, 3}, a2[3] = {2, 4, 6}, orth[3] = {3, 0, -1};
  c = ref_compare(z, z, 3, 0, 0);
  TU_CHECK(c.cos_dist == 0.0, "zero vs zero cos %g", c.cos_dist);
  c = ref_compare(z, a, 3, 0, 0);
  TU_CHECK(c.cos_dist == 1.0 && !ref_cmp_ok(&c, 0.5), "zero vs a cos %g", c.cos_dist);
  c = ref_compare(a, z, 3, 0, 0);
  TU_CHECK(c.cos_dist == 1.0, "a vs zero cos %g", c.cos_dist);
  c = ref_compare(a2, a, 3, 0, 0);
  TU_CHECK(fabs(c.cos_dist) < 1e-15 && c.bad == 3, "parallel cos %g bad %lld", c.cos_dist, (long long)c.bad);
  c = ref_compare(orth, a, 3, 100, 0);
  TU_CHECK(fabs(c.cos_dist - 1.0) < 1e-15 && c.bad == 0 && !ref_cmp_ok(&c, 0.5), "orthogonal cos %g",
           c.cos_dist);
}

int main(void) {
  tu_rng rng = {tu_seed("test_ref_selfcheck", (uint64_t)time(NULL))};
  test_split_merge_absorbed(&rng);
  test_split_merge_mha(&rng);
  test_uniform(&rng);
  test_causal_loop(&rng);
  test_gqa(&rng);
  test_hand();
  test_merge_edges(&rng);
  test_round_known();
  test_round_enumerate();
  test_round_vs_util(&rng);
  test_compare();
  return tu_finish("test_ref_selfcheck");
}
