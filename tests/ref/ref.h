/* float64 oracle for libmla's attention math. It shares no code with src/:
 * it includes only the C standard library, so a bug in the library cannot
 * hide in its own reference. Ragged batches are concatenated along the first
 * dimension in request order (request i owns q_len[i] query rows and
 * kv_len[i] key rows), exactly as in tests/golden/README.md. */
#ifndef MLA_REF_H
#define MLA_REF_H

#include <stddef.h>
#include <stdint.h>

/* Absorbed MLA: s_j = scale (q_nope.c_j + q_rope.r_j); o = sum_j p_j c_j.
 * q_nope [Tq, H, 512], q_rope [Tq, H, 64], c [Tk, 512], r [Tk, 64];
 * o [Tq, H, 512], lse [Tq, H] (natural log; -inf and o = 0 with no key).
 * causal: bottom-right (query i of Q sees keys j <= K - Q + i). */
void ref_absorbed(int batch, const int *q_len, const int *kv_len, int heads, double scale,
                  int causal, const double *q_nope, const double *q_rope, const double *c,
                  const double *r, double *o, double *lse);

/* Ragged MHA with grouped kv heads (kv_heads divides heads):
 * q [Tq, H, dqk], k [Tk, Hkv, dqk], v [Tk, Hkv, dv]; o [Tq, H, dv], lse [Tq, H].
 * softcap > 0: s = softcap * tanh(scale q.k / softcap). */
void ref_mha(int batch, const int *q_len, const int *kv_len, int heads, int kv_heads, int dqk,
             int dv, double scale, double softcap, int causal, const double *q, const double *k,
             const double *v, double *o, double *lse);

/* Merge n partial states: o_parts[i] [T, H, D], lse_parts[i] [T, H]. */
void ref_merge(int n, int tokens, int heads, int dim, const double *const *o_parts,
               const double *const *lse_parts, double *o, double *lse);

/* Rounding of a value to what a dtype stores (the oracle's own versions). */
double ref_round_bf16(double x);
double ref_round_f16(double x);
double ref_round_e4m3(double x); /* saturating to +-448, nearest even; NaN stays NaN */

/* ---- golden cases (tests/golden/<case>/, see its README) ---------------- */
typedef struct ref_tensor {
  char name[32];
  int ndim;
  int64_t dims[8];
  int64_t numel;
  double *data; /* converted to double from f32 or f64 */
} ref_tensor;

typedef struct ref_golden {
  char kind[16]; /* absorbed, mha, merge */
  int batch, heads, latent, rope, qk_dim, v_dim, causal, tokens, dim;
  double scale, softcap;
  int q_len[256], kv_len[256];
  int num_tensors;
  ref_tensor tensors[16];
} ref_golden;

/* Load dir/meta.txt and its tensors; returns 0 on success, -1 (with a
 * message on stderr) on failure. */
int ref_golden_load(const char *dir, ref_golden *g);
const ref_tensor *ref_golden_tensor(const ref_golden *g, const char *name); /* NULL if absent */
void ref_golden_free(ref_golden *g);

/* ---- comparison (STYLE practice 11) --------------------------------------- */
typedef struct ref_cmp {
  int64_t n;            /* elements compared */
  int64_t bad;          /* elements failing |x - ref| <= atol + rtol |ref| */
  int64_t nonfinite_mismatch; /* inf/NaN pattern differs (sign of inf included) */
  double max_abs_err;   /* over finite pairs */
  double max_rel_err;
  double cos_dist;      /* 1 - cos(x, ref) over finite pairs, in double; 0 for all-zero */
  int64_t first_bad;    /* index of the first failure or -1 */
} ref_cmp;

/* Compare got [n] (double) with ref [n]. */
ref_cmp ref_compare(const double *got, const double *ref, int64_t n, double atol, double rtol);
/* 1 when the comparison passes: bad == 0, nonfinite_mismatch == 0 and
 * cos_dist <= max_cos_dist. */
int ref_cmp_ok(const ref_cmp *c, double max_cos_dist);
#endif
