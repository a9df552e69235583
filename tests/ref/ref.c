/* float64 oracle: attention, merge, dtype rounding and comparison.
 *
 * Written for clarity first, speed second: every result is the textbook
 * formula evaluated in double, with reductions split over several
 * accumulators (shorter dependency chains and a smaller rounding error than
 * one running sum). It includes only the C standard library and ref.h so that
 * nothing it computes can share a bug with src/. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

#define REF_LATENT 512
#define REF_ROPE 64

/* Test code: an allocation failure is a broken test machine, not a result. */
static void *ref_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "ref: out of memory (%zu bytes)\n", bytes);
    abort();
  }
  return p;
}

/* Dot product with four interleaved partial sums (a pairwise-like order whose
 * error bound is ~n/4 ulps instead of n). */
static double ref_dot(const double *a /* [n] */, const double *b /* [n] */, int n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; i++) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

/* Keys visible to query i of a request with q queries and k keys. */
static int ref_visible(int causal, int q, int k, int i) {
  if (!causal) return k;
  long n = (long)k - (long)q + (long)i + 1; /* keys j <= K - Q + i */
  if (n < 0) return 0;
  return n > k ? k : (int)n;
}

/* Softmax of s [n] in place into weights; returns lse. The caller handles
 * n == 0. NaN scores propagate (to every weight and to lse). */
static double ref_softmax(double *s /* [n] */, int n) {
  double m = -INFINITY;
  int has_nan = 0;
  for (int j = 0; j < n; j++) {
    if (isnan(s[j])) has_nan = 1;
    else if (s[j] > m) m = s[j];
  }
  if (has_nan) {
    for (int j = 0; j < n; j++) s[j] = NAN;
    return NAN;
  }
  if (m == -INFINITY) { /* every score -inf: no key carries weight */
    for (int j = 0; j < n; j++) s[j] = 0.0;
    return -INFINITY;
  }
  long double sum = 0.0L;
  for (int j = 0; j < n; j++) {
    /* s[j] == m also covers m = +inf (inf - inf would be NaN). */
    double w = (s[j] == m) ? 1.0 : exp(s[j] - m);
    s[j] = w;
    sum += w;
  }
  double inv = (double)(1.0L / sum);
  for (int j = 0; j < n; j++) s[j] *= inv;
  return m + (double)logl(sum);
}

/* o [dim] = sum_j p[j] * rows[j * stride + 0 .. dim). Independent per
 * element, so the loop over d runs in parallel in hardware. */
static void ref_weighted_sum(const double *p /* [n] */, int n, const double *rows, int64_t stride,
                             int dim, double *o /* [dim] */, double *acc /* [dim] scratch */) {
  for (int d = 0; d < dim; d++) acc[d] = 0.0;
  for (int j = 0; j < n; j++) {
    const double pj = p[j];
    const double *row = rows + (int64_t)j * stride;
    for (int d = 0; d < dim; d++) acc[d] += pj * row[d];
  }
  for (int d = 0; d < dim; d++) o[d] = acc[d];
}

static int ref_max_len(int batch, const int *len) {
  int m = 0;
  for (int b = 0; b < batch; b++)
    if (len[b] > m) m = len[b];
  return m;
}

void ref_absorbed(int batch, const int *q_len, const int *kv_len, int heads, double scale,
                  int causal, const double *q_nope, const double *q_rope, const double *c,
                  const double *r, double *o, double *lse) {
  const int kmax = ref_max_len(batch, kv_len);
  double *s = ref_alloc(sizeof(double) * (size_t)(kmax > 0 ? kmax : 1));
  double *acc = ref_alloc(sizeof(double) * REF_LATENT);
  int64_t q0 = 0, k0 = 0; /* first query row / key row of request b */
  for (int b = 0; b < batch; b++) {
    const int Q = q_len[b], K = kv_len[b];
    for (int i = 0; i < Q; i++) {
      const int n = ref_visible(causal, Q, K, i);
      for (int h = 0; h < heads; h++) {
        const int64_t row = (q0 + i) * heads + h;
        const double *qn = q_nope + row * REF_LATENT; /* [512] */
        const double *qr = q_rope + row * REF_ROPE;   /* [64] */
        double *out = o + row * REF_LATENT;           /* [512] */
        if (n == 0) { /* nothing visible: the empty state */
          for (int d = 0; d < REF_LATENT; d++) out[d] = 0.0;
          lse[row] = -INFINITY;
          continue;
        }
        for (int j = 0; j < n; j++) {
          const double *cj = c + (k0 + j) * REF_LATENT;
          const double *rj = r + (k0 + j) * REF_ROPE;
          s[j] = scale * (ref_dot(qn, cj, REF_LATENT) + ref_dot(qr, rj, REF_ROPE));
        }
        lse[row] = ref_softmax(s, n);
        /* V is the latent part of the same row. */
        ref_weighted_sum(s, n, c + k0 * REF_LATENT, REF_LATENT, REF_LATENT, out, acc);
      }
    }
    q0 += Q;
    k0 += K;
  }
  free(acc);
  free(s);
}

void ref_mha(int batch, const int *q_len, const int *kv_len, int heads, int kv_heads, int dqk,
             int dv, double scale, double softcap, int causal, const double *q, const double *k,
             const double *v, double *o, double *lse) {
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    fprintf(stderr, "ref_mha: kv_heads %d does not divide heads %d\n", kv_heads, heads);
    abort();
  }
  const int group = heads / kv_heads; /* query heads per kv head */
  const int kmax = ref_max_len(batch, kv_len);
  double *s = ref_alloc(sizeof(double) * (size_t)(kmax > 0 ? kmax : 1));
  double *acc = ref_alloc(sizeof(double) * (size_t)(dv > 0 ? dv : 1));
  const int64_t kstride = (int64_t)kv_heads * dqk; /* between keys */
  const int64_t vstride = (int64_t)kv_heads * dv;
  int64_t q0 = 0, k0 = 0;
  for (int b = 0; b < batch; b++) {
    const int Q = q_len[b], K = kv_len[b];
    for (int i = 0; i < Q; i++) {
      const int n = ref_visible(causal, Q, K, i);
      for (int h = 0; h < heads; h++) {
        const int hk = h / group;
        const int64_t row = (q0 + i) * heads + h;
        const double *qh = q + row * dqk; /* [dqk] */
        double *out = o + row * dv;       /* [dv] */
        if (n == 0) {
          for (int d = 0; d < dv; d++) out[d] = 0.0;
          lse[row] = -INFINITY;
          continue;
        }
        for (int j = 0; j < n; j++) {
          const double *kj = k + (k0 + j) * kstride + (int64_t)hk * dqk;
          double x = scale * ref_dot(qh, kj, dqk);
          if (softcap > 0.0) x = softcap * tanh(x / softcap);
          s[j] = x;
        }
        lse[row] = ref_softmax(s, n);
        ref_weighted_sum(s, n, v + k0 * vstride + (int64_t)hk * dv, vstride, dv, out, acc);
      }
    }
    q0 += Q;
    k0 += K;
  }
  free(acc);
  free(s);
}

void ref_merge(int n, int tokens, int heads, int dim, const double *const *o_parts,
               const double *const *lse_parts, double *o, double *lse) {
  double *w = ref_alloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  for (int64_t row = 0; row < (int64_t)tokens * heads; row++) {
    double *out = o + row * dim; /* [dim] */
    double m = -INFINITY;
    int has_nan = 0;
    for (int p = 0; p < n; p++) {
      const double l = lse_parts[p][row];
      if (isnan(l)) has_nan = 1;
      else if (l > m) m = l;
    }
    if (has_nan) { /* a NaN lse is a broken input: make it visible */
      for (int d = 0; d < dim; d++) out[d] = NAN;
      lse[row] = NAN;
      continue;
    }
    if (m == -INFINITY) { /* every side empty (or n == 0) */
      for (int d = 0; d < dim; d++) out[d] = 0.0;
      lse[row] = -INFINITY;
      continue;
    }
    long double wsum = 0.0L;
    for (int p = 0; p < n; p++) {
      const double l = lse_parts[p][row];
      w[p] = (l == m) ? 1.0 : exp(l - m); /* l == m also covers m = +inf */
      wsum += w[p];
    }
    for (int d = 0; d < dim; d++) {
      long double a = 0.0L;
      /* A side of weight 0 is skipped: its o may be garbage (never NaN out). */
      for (int p = 0; p < n; p++)
        if (w[p] != 0.0) a += (long double)w[p] * o_parts[p][row * dim + d];
      out[d] = (double)(a / wsum);
    }
    lse[row] = m + (double)logl(wsum);
  }
  free(w);
}

/* ---- rounding to a storage format ---------------------------------------- */
/* Round x to the nearest value with `prec` significant bits (implicit bit
 * included) and minimum normal exponent emin (below it the quantum stays
 * 2^(emin - prec + 1): subnormals), ties to even. Values whose magnitude ends
 * above max_finite become +-inf, or +-max_finite when `saturate`. */
static double ref_round_format(double x, int prec, int emin, double max_finite, int saturate) {
  if (isnan(x)) return x;
  if (isinf(x)) return saturate ? copysign(max_finite, x) : x;
  if (x == 0.0) return x; /* keeps the sign of zero */
  int e;
  (void)frexp(x, &e);     /* |x| in [2^(e-1), 2^e) */
  int ex = e - 1;         /* exponent of the leading bit */
  if (ex < emin) ex = emin;
  const int qexp = ex - (prec - 1); /* quantum 2^qexp */
  const double y = ldexp(fabs(x), -qexp); /* exact: a power-of-two scaling */
  double n = floor(y);
  const double frac = y - n; /* exact: y < 2^(prec+1) fits a double */
  if (frac > 0.5 || (frac == 0.5 && fmod(n, 2.0) != 0.0)) n += 1.0;
  double res = ldexp(n, qexp);
  if (res > max_finite) res = saturate ? max_finite : INFINITY;
  return copysign(res, x);
}

double ref_round_bf16(double x) {
  /* 8 significant bits, emin -126, max (2 - 2^-7) 2^127. */
  return ref_round_format(x, 8, -126, ldexp(255.0, 120), 0);
}

double ref_round_f16(double x) {
  /* 11 significant bits, emin -14, max 65504. */
  return ref_round_format(x, 11, -14, 65504.0, 0);
}

double ref_round_e4m3(double x) {
  /* e4m3fn: 4 significant bits, bias 7 (emin -6), no inf, max 448; out of
   * range values (inf included) saturate to +-448. */
  return ref_round_format(x, 4, -6, 448.0, 1);
}

/* ---- comparison ------------------------------------------------------------ */
ref_cmp ref_compare(const double *got, const double *ref, int64_t n, double atol, double rtol) {
  ref_cmp c;
  memset(&c, 0, sizeof(c));
  c.n = n;
  c.first_bad = -1;
  long double dot = 0.0L, ng = 0.0L, nr = 0.0L;
  for (int64_t i = 0; i < n; i++) {
    const double g = got[i], x = ref[i];
    if (!isfinite(g) || !isfinite(x)) {
      /* Nonfinite positions must agree exactly: NaN with NaN, or an inf of
       * the same sign. A finite value against a nonfinite one is a mismatch. */
      int same = (isnan(g) && isnan(x)) || (isinf(g) && isinf(x) && (g > 0) == (x > 0));
      if (!same) {
        c.nonfinite_mismatch++;
        if (c.first_bad < 0) c.first_bad = i;
      }
      continue;
    }
    const double err = fabs(g - x);
    if (err > c.max_abs_err) c.max_abs_err = err;
    if (x != 0.0) { /* relative error is undefined at ref == 0; atol covers it */
      const double rel = err / fabs(x);
      if (rel > c.max_rel_err) c.max_rel_err = rel;
    }
    if (!(err <= atol + rtol * fabs(x))) {
      c.bad++;
      if (c.first_bad < 0) c.first_bad = i;
    }
    dot += (long double)g * x;
    ng += (long double)g * g;
    nr += (long double)x * x;
  }
  if (ng == 0.0L && nr == 0.0L) {
    c.cos_dist = 0.0;
  } else if (ng == 0.0L || nr == 0.0L) {
    c.cos_dist = 1.0;
  } else {
    long double cosv = dot / (sqrtl(ng) * sqrtl(nr));
    double dist = (double)(1.0L - cosv);
    c.cos_dist = dist < 0.0 ? 0.0 : dist; /* rounding can dip below 0 */
  }
  return c;
}

int ref_cmp_ok(const ref_cmp *c, double max_cos_dist) {
  return c->bad == 0 && c->nonfinite_mismatch == 0 && c->cos_dist <= max_cos_dist;
}
