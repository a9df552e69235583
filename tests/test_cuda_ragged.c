/* mla_attention_ragged and mla_merge_states on a CUDA context (the sm_90a
 * kernels of src/cuda/prefill_sm90.cu behind the public calls) against the
 * float64 oracle (tests/ref).
 *
 * Ragged MHA: random varlen batches with a zero-length request, a request
 * with queries but no keys, causal requests with fewer keys than queries,
 * lengths crossing the 128-row / 128-key tiles, one long request (~2.5K),
 * heads 1, 16 (grouped kv heads 4 and 2) and 128, qk/v dims 192/128 and
 * 128/128, bf16 and f16, causal and not, softcap, natural and base-2 LSE,
 * MLA_FLAG_OUT_F32, a NULL lse, a batch of 600 short requests, batches of one
 * request (H 128, 16 and 3: the default's head group 1); the generic
 * kernel (what the sm_90a kernels do not take: dims 64/64, 256/256, 100/36,
 * 72/40, 1/1, f32 activations, 5000 requests); long varlen
 * batches (lengths up to 8192, >= 32K tokens, heads 1, 16, 128; the oracle
 * on sampled rows there); every
 * consumer loop of the sm_90a kernel
 * (MLA_PREFILL_VARIANT plain, pingpong), the default with 3 heads per item
 * group (MLA_PREFILL_HEAD_GROUP) and the default (the generic
 * kernel's cases under the default only). Outputs are poisoned (0xFF) with guard
 * elements after them: every row must be written, the guards must not.
 *
 * Tolerance: the kernel rounds P to 16 bits before P V, so per element
 * |o - ref| <= 1e-3 + |ref| / 128 + 2^-7 sum_j p_j |v_j| (twice the bound of
 * that rounding; sum_j p_j |v_j| is the oracle run on |v|), cosine distance
 * < 1e-4 per case; lse within 1e-4 abs + 1e-5 rel, -inf exactly where a row
 * sees no key.
 *
 * Merge: 1..5 states, 128, 300 and 2032 (one launch), 2500 and 4500 (passes
 * through out / lse_out), f32 / bf16 / f16, dims 128, 16, 8 and 7, empty sides (lse = -inf) holding NaN in o, rows where every side
 * is empty (o = 0, lse = -inf, never NaN), base-2 flag, in place (out =
 * o_parts[0], lse_out = lse_parts[0]) and a NULL lse_out.
 *
 * The optional workspace (dynamic item order): the default runs with and
 * without it and must give the same bits; the long batches and the head
 * group 3 pass use it; a CUDA graph of the call replayed over other lengths
 * equals the eager calls; a small / host / misaligned workspace is refused.
 *
 * Refusals with the CPU path's statuses (and outputs untouched), the CUDA
 * scope (host pointers: INVALID_ARGUMENT; more than 2032 merge states
 * without lse_out: UNSUPPORTED), a decreasing index array reported by
 * mla_ctx_synchronize (OUT_OF_RANGE). Skips (passing) without CUDA or GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_ragged: skipped: built without CUDA\n");
  return tu_finish("test_cuda_ragged");
}
#else
#include "cuda_util.h"

#define GUARD 64 /* poisoned elements after every output */
#define MAXB 5000 /* the batches of "many requests" (the generic kernel's: over MLA_CUDA_PREFILL_MAX_BATCH) */

static tu_rng rng;
static mla_ctx *gpu, *cpu;
/* the optional ragged workspace (mla_attention_ragged_workspace_size) */
static void *g_ws;
static size_t g_ws_bytes;

typedef struct rcase {
  const char *name;
  int bs, H, Hkv, dqk, dv, causal;
  float softcap;
  unsigned flags;
  mla_dtype act;
  int with_lse;
  int maxq, maxprefix; /* random lengths: q in [1, maxq], kv = q + [0, maxprefix] */
  int longq;           /* > 0: request 2 gets this many queries */
} rcase;

static double *to_double(mla_dtype t, const void *src, int64_t n) {
  double *d = malloc(sizeof(double) * (size_t)(n ? n : 1));
  tu_from_dtype(t, src, d, n);
  return d;
}

/* n random values of dtype t (bits in *bits, exact values in double). */
static double *rand_act(mla_dtype t, int64_t n, void **bits) {
  float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
  tu_fill_bf16_normal(&rng, f, n, 1.0);
  *bits = malloc(tu_act_size(t) * (size_t)(n ? n : 1));
  tu_to_dtype(t, f, *bits, n);
  free(f);
  return to_double(t, *bits, n);
}

/* all_variants 0: the default only (the generic kernel's cases: the
 * variants change the sm_90a kernel alone) */
static void run_ragged(const rcase *c, int all_variants) {
  int q_len[MAXB], kv_len[MAXB];
  int32_t qo[MAXB + 1], kvp[MAXB + 1];
  qo[0] = kvp[0] = 0;
  for (int i = 0; i < c->bs; i++) {
    int q = c->bs == 1 ? c->maxq : tu_randint(&rng, 1, c->maxq); /* one request: several m-blocks */
    int kv = q + tu_randint(&rng, 0, c->maxprefix);
    if (i == 0 && c->bs > 1) q = 0;                         /* zero-length request */
    if (i == 1) kv = 0;                                     /* queries, no keys */
    if (i == 3 && c->causal) kv = q > 1 ? q / 2 : kv;       /* fewer keys than queries */
    if (i == 2 && c->longq > 0) q = c->longq, kv = q + tu_randint(&rng, 0, c->maxprefix);
    q_len[i] = q;
    kv_len[i] = kv;
    qo[i + 1] = qo[i] + q;
    kvp[i + 1] = kvp[i] + kv;
  }
  const int Tq = qo[c->bs], Tk = kvp[c->bs], H = c->H, Hkv = c->Hkv;
  char cs[200];
  snprintf(cs, sizeof cs, "%s (bs=%d H=%d/%d %d/%d %s causal=%d cap=%g flags=%u Tq=%d Tk=%d)", c->name, c->bs, H,
           Hkv, c->dqk, c->dv, mla_dtype_name(c->act), c->causal, (double)c->softcap, c->flags, Tq, Tk);
  void *qb, *kb, *vb;
  double *q = rand_act(c->act, (int64_t)Tq * H * c->dqk, &qb);
  double *k = rand_act(c->act, (int64_t)Tk * Hkv * c->dqk, &kb);
  double *v = rand_act(c->act, (int64_t)Tk * Hkv * c->dv, &vb);
  const size_t es = tu_act_size(c->act);
  const mla_dtype odt = (c->flags & MLA_FLAG_OUT_F32) ? MLA_DTYPE_F32 : c->act;
  const size_t oes = tu_act_size(odt);
  const int64_t no = (int64_t)Tq * H * c->dv, nl = (int64_t)Tq * H;
  void *dq = tu_dev_copy(qb, es * (size_t)Tq * H * c->dqk);
  void *dk = tu_dev_copy(kb, es * (size_t)Tk * Hkv * c->dqk);
  void *dv = tu_dev_copy(vb, es * (size_t)Tk * Hkv * c->dv);
  void *dqo = tu_dev_copy(qo, sizeof(int32_t) * (size_t)(c->bs + 1));
  void *dkvp = tu_dev_copy(kvp, sizeof(int32_t) * (size_t)(c->bs + 1));
  void *dout = tu_dev_alloc(oes * (size_t)(no + GUARD));
  float *dlse = tu_dev_alloc(sizeof(float) * (size_t)(nl + GUARD));

  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = c->bs;
  a.num_heads = H;
  a.num_kv_heads = Hkv;
  a.qk_dim = c->dqk;
  a.v_dim = c->dv;
  a.scale = (float)(1.0 / sqrt((double)c->dqk)) * (c->softcap > 0.0f ? 4.0f : 1.0f);
  a.softcap = c->softcap;
  a.causal = c->causal;
  a.flags = c->flags;
  a.act_dtype = c->act;
  a.qo_indptr = dqo;
  a.kv_indptr = dkvp;
  a.q = dq;
  a.k = dk;
  a.v = dv;
  a.out = dout;
  a.lse = c->with_lse ? dlse : NULL;

  /* oracle, and sum_j p_j |v_j| (the oracle on |v|; same scores, same lse) */
  double *o_ref = malloc(sizeof(double) * (size_t)(no ? no : 1));
  double *l_ref = malloc(sizeof(double) * (size_t)(nl ? nl : 1));
  double *pb = malloc(sizeof(double) * (size_t)(no ? no : 1));
  ref_mha(c->bs, q_len, kv_len, H, Hkv, c->dqk, c->dv, a.scale, c->softcap, c->causal, q, k, v, o_ref, l_ref);
  for (int64_t i = 0; i < (int64_t)Tk * Hkv * c->dv; i++) v[i] = fabs(v[i]);
  ref_mha(c->bs, q_len, kv_len, H, Hkv, c->dqk, c->dv, a.scale, c->softcap, c->causal, q, k, v, pb, l_ref);

  unsigned char *out = malloc(oes * (size_t)(no + GUARD));
  float *lse = malloc(sizeof(float) * (size_t)(nl + GUARD));
  unsigned char *out_static = malloc(oes * (size_t)(no + GUARD));
  float *lse_static = malloc(sizeof(float) * (size_t)(nl + GUARD));
  /* every consumer loop of the kernel (src/cuda/prefill_sm90.cu), the default
   * also with another item order (3 heads per group: a partial last group at
   * H = 16 and 128), the default with its fixed item order (no workspace),
   * then with the workspace (dynamic order: the same bits as the fixed one) */
  static const struct {
    const char *variant, *head_group, *label;
    int ws;
  } variants[] = {{"plain", NULL, "plain", 0},
                  {"pingpong", NULL, "pingpong", 0},
                  {NULL, "3", "default, head group 3, dynamic order", 1},
                  {NULL, NULL, "default", 0},
                  {NULL, NULL, "default, dynamic order", 1}};
  const int nvar = (int)(sizeof variants / sizeof variants[0]);
  for (int vi = all_variants ? 0 : nvar - 2; vi < nvar; vi++) {
    char cv[260];
    snprintf(cv, sizeof cv, "%s [%s]", cs, variants[vi].label);
    if (variants[vi].variant) setenv("MLA_PREFILL_VARIANT", variants[vi].variant, 1);
    else unsetenv("MLA_PREFILL_VARIANT");
    if (variants[vi].head_group) setenv("MLA_PREFILL_HEAD_GROUP", variants[vi].head_group, 1);
    else unsetenv("MLA_PREFILL_HEAD_GROUP");
    a.workspace = variants[vi].ws ? g_ws : NULL;
    a.workspace_bytes = variants[vi].ws ? g_ws_bytes : 0;
    /* the counter as a previous call may leave it: the call must zero it */
    if (variants[vi].ws) CK(cudaMemset(g_ws, 0x5a, g_ws_bytes));
    CK(cudaMemset(dout, 0xff, oes * (size_t)(no + GUARD)));
    CK(cudaMemset(dlse, 0xff, sizeof(float) * (size_t)(nl + GUARD)));
    mla_status st = mla_attention_ragged(gpu, &a);
    TU_CHECK(st == MLA_OK, "%s: %s (%s)", cv, mla_status_string(st), mla_ctx_last_error(gpu));
    st = mla_ctx_synchronize(gpu);
    TU_CHECK(st == MLA_OK, "%s: synchronize %s (%s)", cv, mla_status_string(st), mla_ctx_last_error(gpu));
    CK(cudaMemcpy(out, dout, oes * (size_t)(no + GUARD), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse, dlse, sizeof(float) * (size_t)(nl + GUARD), cudaMemcpyDeviceToHost));
    TU_CHECK(tu_all_poisoned(out + oes * (size_t)no, oes * GUARD), "%s: out guard written", cv);
    TU_CHECK(tu_all_poisoned(lse + nl, sizeof(float) * GUARD), "%s: lse guard written", cv);
    if (!c->with_lse) TU_CHECK(tu_all_poisoned(lse, sizeof(float) * (size_t)nl), "%s: lse written though NULL", cv);
    double *o = to_double(odt, out, no);
    int64_t bad = 0, first = -1, nonfinite = 0;
    double dot = 0, n1 = 0, n2 = 0, worst = 0;
    for (int64_t i = 0; i < no; i++) {
      if (!isfinite(o[i])) {
        nonfinite++;
        continue;
      }
      const double err = fabs(o[i] - o_ref[i]);
      const double tol = 1e-3 + fabs(o_ref[i]) / 128.0 + pb[i] / 128.0;
      if (err > tol) {
        if (first < 0) first = i;
        bad++;
      }
      if (err / tol > worst) worst = err / tol;
      dot += o[i] * o_ref[i];
      n1 += o[i] * o[i];
      n2 += o_ref[i] * o_ref[i];
    }
    const double cosd = n1 > 0 && n2 > 0 ? 1.0 - dot / sqrt(n1 * n2) : (n1 == n2 ? 0.0 : 1.0);
    TU_CHECK(nonfinite == 0, "%s: %lld non-finite outputs", cv, (long long)nonfinite);
    TU_CHECK(bad == 0, "%s: %lld of %lld outside tolerance, first at %lld: got %g want %g", cv, (long long)bad,
             (long long)no, (long long)first, first >= 0 ? o[first] : 0.0, first >= 0 ? o_ref[first] : 0.0);
    TU_CHECK(cosd < 1e-4, "%s: cosine distance %.3g", cv, cosd);
    double lse_worst = 0;
    if (c->with_lse) {
      int64_t lbad = 0;
      const double conv = (c->flags & MLA_FLAG_LSE_BASE2) ? 1.4426950408889634 : 1.0;
      for (int64_t i = 0; i < nl; i++) {
        const double want = l_ref[i] * conv, got = lse[i];
        if (isinf(want) || isinf(got)) {
          lbad += !(isinf(want) && isinf(got) && (want < 0) == (got < 0));
          continue;
        }
        const double e = fabs(got - want);
        if (e > 1e-4 + 1e-5 * fabs(want) || isnan(got)) lbad++;
        if (e > lse_worst) lse_worst = e;
      }
      TU_CHECK(lbad == 0, "%s: %lld lse values wrong (worst finite error %.3g)", cv, (long long)lbad, lse_worst);
    }
    printf("  %s: max err/tol %.3f, cos dist %.2e, lse max err %.2e\n", cv, worst, cosd, lse_worst);
    free(o);
    /* the dynamic order computes every item as the fixed one does */
    if (vi == nvar - 2) {
      memcpy(out_static, out, oes * (size_t)(no + GUARD));
      memcpy(lse_static, lse, sizeof(float) * (size_t)(nl + GUARD));
    } else if (vi == nvar - 1) {
      TU_CHECK(memcmp(out, out_static, oes * (size_t)no) == 0, "%s: out differs from the fixed order's", cv);
      TU_CHECK(memcmp(lse, lse_static, sizeof(float) * (size_t)nl) == 0, "%s: lse differs from the fixed order's",
               cv);
    }
  }
  free(q), free(k), free(v), free(qb), free(kb), free(vb), free(o_ref), free(l_ref), free(pb);
  free(out), free(lse), free(out_static), free(lse_static);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dqo), cudaFree(dkvp), cudaFree(dout), cudaFree(dlse);
}

/* ---- long varlen batches, sampled oracle ----------------------------------- */
/* n bf16 values, uniform in [-1, 1), from a cheap generator (the long batches
 * hold billions of values: tu_normal would take minutes). */
static uint16_t *rand_bf16_bits(int64_t n) {
  uint16_t *b = malloc(sizeof(uint16_t) * (size_t)(n ? n : 1));
  float f[4096];
  uint64_t st = tu_next(&rng) | 1;
  for (int64_t i0 = 0; i0 < n; i0 += 4096) {
    const int m = n - i0 < 4096 ? (int)(n - i0) : 4096;
    for (int i = 0; i < m; i++) {
      st ^= st << 13, st ^= st >> 7, st ^= st << 17;
      f[i] = (float)((double)(st >> 11) * 0x1.0p-52 - 1.0);
    }
    tu_to_dtype(MLA_DTYPE_BF16, f, b + i0, m);
  }
  return b;
}

/* Lengths 1..8192 (one request of exactly 8192), total >= 32768 tokens,
 * self-attention prefill (kv = q), bf16 192/128: every row must be written;
 * the float64 oracle runs on sampled rows (first and last token of each
 * request and random ones, 4 heads each), same tolerance as run_ragged. */
#define LONG_MAXB 32
static void run_long(int H, int Hkv, int causal) {
  int q_len[LONG_MAXB], kv_len[LONG_MAXB], bs = 0;
  int32_t qo[LONG_MAXB + 1];
  qo[0] = 0;
  while (bs < LONG_MAXB && (bs == 0 || qo[bs] < 32768)) {
    const int q = bs == 0 ? 8192 : tu_randint(&rng, 1, 8192);
    q_len[bs] = kv_len[bs] = q;
    qo[bs + 1] = qo[bs] + q;
    bs++;
  }
  const int T = qo[bs], dqk = 192, dv = 128;
  char cs[160];
  snprintf(cs, sizeof cs, "long varlen (bs=%d H=%d/%d causal=%d T=%d)", bs, H, Hkv, causal, T);
  const int64_t nq = (int64_t)T * H * dqk, nk = (int64_t)T * Hkv * dqk, nv = (int64_t)T * Hkv * dv;
  const int64_t no = (int64_t)T * H * dv, nl = (int64_t)T * H;
  uint16_t *qb = rand_bf16_bits(nq), *kb = rand_bf16_bits(nk), *vb = rand_bf16_bits(nv);
  void *dq = tu_dev_copy(qb, 2 * (size_t)nq), *dk = tu_dev_copy(kb, 2 * (size_t)nk), *dv_ = tu_dev_copy(vb, 2 * (size_t)nv);
  void *dqo = tu_dev_copy(qo, sizeof(int32_t) * (size_t)(bs + 1));
  uint16_t *dout = tu_dev_alloc(2 * (size_t)(no + GUARD));
  float *dlse = tu_dev_alloc(sizeof(float) * (size_t)(nl + GUARD));
  CK(cudaMemset(dout, 0xff, 2 * (size_t)(no + GUARD)));
  CK(cudaMemset(dlse, 0xff, sizeof(float) * (size_t)(nl + GUARD)));
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = bs;
  a.num_heads = H;
  a.num_kv_heads = Hkv;
  a.qk_dim = dqk;
  a.v_dim = dv;
  a.scale = (float)(1.0 / sqrt((double)dqk));
  a.causal = causal;
  a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = a.kv_indptr = dqo;
  a.q = dq;
  a.k = dk;
  a.v = dv_;
  a.out = dout;
  a.lse = dlse;
  a.workspace = g_ws; /* the dynamic order: many rounds of items over the SMs */
  a.workspace_bytes = g_ws_bytes;
  mla_status st = mla_attention_ragged(gpu, &a);
  TU_CHECK(st == MLA_OK, "%s: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  st = mla_ctx_synchronize(gpu);
  TU_CHECK(st == MLA_OK, "%s: synchronize %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  uint16_t *out = malloc(2 * (size_t)(no + GUARD));
  float *lse = malloc(sizeof(float) * (size_t)(nl + GUARD));
  CK(cudaMemcpy(out, dout, 2 * (size_t)(no + GUARD), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, dlse, sizeof(float) * (size_t)(nl + GUARD), cudaMemcpyDeviceToHost));
  int64_t unwritten = 0;
  for (int64_t i = 0; i < no; i++) unwritten += !isfinite(tu_bf16_to_f32(out[i]));
  for (int64_t i = 0; i < nl; i++) unwritten += !isfinite(lse[i]);
  TU_CHECK(unwritten == 0, "%s: %lld outputs / lse not written", cs, (long long)unwritten);
  TU_CHECK(tu_all_poisoned(out + no, 2 * GUARD) && tu_all_poisoned(lse + nl, sizeof(float) * GUARD),
           "%s: guards written", cs);

  double *s = malloc(sizeof(double) * 8192), o[128], pb[128];
  int64_t rows = 0, bad = 0, lbad = 0;
  double worst = 0, lworst = 0;
  const int group = H / Hkv;
  for (int i = 0; i < bs; i++)
    for (int n = 0; n < 6; n++) {
      const int t = n == 0 ? 0 : n == 1 ? q_len[i] - 1 : tu_randint(&rng, 0, q_len[i] - 1);
      const int vis = causal ? t + 1 : kv_len[i]; /* kv = q: bottom-right = top-left */
      for (int m = 0; m < (H < 4 ? H : 4); m++) {
        const int h = H < 4 ? m : m == 0 ? 0 : m == 1 ? H - 1 : tu_randint(&rng, 0, H - 1);
        const int hk = h / group;
        const int64_t qrow = ((int64_t)(qo[i] + t) * H + h) * dqk;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < vis; j++) {
          const int64_t krow = ((int64_t)(qo[i] + j) * Hkv + hk) * dqk;
          double d = 0;
          for (int e = 0; e < dqk; e++) d += (double)tu_bf16_to_f32(qb[qrow + e]) * tu_bf16_to_f32(kb[krow + e]);
          s[j] = d * (double)a.scale;
          if (s[j] > mx) mx = s[j];
        }
        for (int j = 0; j < vis; j++) sum += (s[j] = exp(s[j] - mx));
        for (int e = 0; e < dv; e++) o[e] = pb[e] = 0;
        for (int j = 0; j < vis; j++) {
          const int64_t vrow = ((int64_t)(qo[i] + j) * Hkv + hk) * dv;
          const double p = s[j] / sum;
          for (int e = 0; e < dv; e++) {
            const double x = tu_bf16_to_f32(vb[vrow + e]);
            o[e] += p * x;
            pb[e] += p * fabs(x);
          }
        }
        const int64_t orow = ((int64_t)(qo[i] + t) * H + h);
        for (int e = 0; e < dv; e++) {
          const double err = fabs(tu_bf16_to_f32(out[orow * dv + e]) - o[e]);
          const double tol = 1e-3 + fabs(o[e]) / 128.0 + pb[e] / 128.0;
          bad += !(err <= tol);
          if (err / tol > worst) worst = err / tol;
        }
        const double lref = mx + log(sum), le = fabs((double)lse[orow] - lref);
        lbad += !(le <= 1e-4 + 1e-5 * fabs(lref));
        if (le > lworst) lworst = le;
        rows++;
      }
    }
  TU_CHECK(bad == 0 && lbad == 0, "%s: %lld sampled rows: %lld elements out of tolerance (worst err/tol %.3g), "
           "%lld lse off (worst %.3g)", cs, (long long)rows, (long long)bad, worst, (long long)lbad, lworst);
  printf("  %s: %lld sampled rows, max err/tol %.3f, lse max err %.2e\n", cs, (long long)rows, worst, lworst);
  free(s), free(qb), free(kb), free(vb), free(out), free(lse);
  cudaFree(dq), cudaFree(dk), cudaFree(dv_), cudaFree(dqo), cudaFree(dout), cudaFree(dlse);
}

/* ---- graph capture with the workspace ---------------------------------------- */
/* mla_attention_ragged with its workspace captured on a stream, replayed with
 * other lengths in the same device index arrays (the dynamic order's counter
 * is zeroed inside the graph): every replay equals the eager call on the
 * same lengths bit for bit, replays of the same lengths included. */
static void graph_replay(void) {
  enum { BS = 3, H = 16, DQK = 192, DV = 128, MAXT = 3 * 700 };
  static const int32_t lens[3][BS + 1] = {{0, 700, 1300, 1900}, {0, 5, 650, 2100}, {0, 0, 1024, 1536}};
  const int64_t nq = (int64_t)MAXT * H * DQK, nv = (int64_t)MAXT * H * DV, no = nv, nl = (int64_t)MAXT * H;
  void *qb, *kb, *vb;
  double *d0 = rand_act(MLA_DTYPE_BF16, nq, &qb), *d1 = rand_act(MLA_DTYPE_BF16, nq, &kb);
  double *d2 = rand_act(MLA_DTYPE_BF16, nv, &vb);
  free(d0), free(d1), free(d2);
  void *dq = tu_dev_copy(qb, 2 * (size_t)nq), *dk = tu_dev_copy(kb, 2 * (size_t)nq), *dv = tu_dev_copy(vb, 2 * (size_t)nv);
  int32_t *dind = tu_dev_alloc(sizeof(int32_t) * (BS + 1));
  void *dout = tu_dev_alloc(2 * (size_t)no);
  float *dlse = tu_dev_alloc(sizeof(float) * (size_t)nl);
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = BS, a.num_heads = a.num_kv_heads = H, a.qk_dim = DQK, a.v_dim = DV;
  a.scale = 0.07f, a.causal = 1, a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = a.kv_indptr = dind;
  a.q = dq, a.k = dk, a.v = dv, a.out = dout, a.lse = dlse;
  a.workspace = g_ws, a.workspace_bytes = g_ws_bytes;
  uint16_t *oe[3], *og = malloc(2 * (size_t)no);
  float *le[3], *lg = malloc(sizeof(float) * (size_t)nl);
  for (int r = 0; r < 3; r++) { /* eager */
    oe[r] = malloc(2 * (size_t)no), le[r] = malloc(sizeof(float) * (size_t)nl);
    CK(cudaMemcpy(dind, lens[r], sizeof lens[r], cudaMemcpyHostToDevice));
    CK(cudaMemset(dout, 0xff, 2 * (size_t)no));
    CK(cudaMemset(dlse, 0xff, sizeof(float) * (size_t)nl));
    TU_STATUS(mla_attention_ragged(gpu, &a), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
    CK(cudaMemcpy(oe[r], dout, 2 * (size_t)no, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(le[r], dlse, sizeof(float) * (size_t)nl, cudaMemcpyDeviceToHost));
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TU_STATUS(mla_ctx_set_stream(gpu, s), MLA_OK);
  cudaGraph_t graph = NULL;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const mla_status st = mla_attention_ragged(gpu, &a);
  const cudaError_t ce = cudaStreamEndCapture(s, &graph);
  TU_CHECK(st == MLA_OK && ce == cudaSuccess, "ragged graph: capture %s / %s (%s)", mla_status_string(st),
           cudaGetErrorString(ce), mla_ctx_last_error(gpu));
  if (st == MLA_OK && ce == cudaSuccess) {
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    static const int order[5] = {1, 0, 2, 2, 1};
    for (int i = 0; i < 5; i++) {
      const int r = order[i];
      CK(cudaMemcpy(dind, lens[r], sizeof lens[r], cudaMemcpyHostToDevice));
      CK(cudaMemset(dout, 0xff, 2 * (size_t)no));
      CK(cudaMemset(dlse, 0xff, sizeof(float) * (size_t)nl));
      CK(cudaDeviceSynchronize());
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(og, dout, 2 * (size_t)no, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(lg, dlse, sizeof(float) * (size_t)nl, cudaMemcpyDeviceToHost));
      const int64_t t = lens[r][BS];
      TU_CHECK(memcmp(og, oe[r], 2 * (size_t)no) == 0 && memcmp(lg, le[r], sizeof(float) * (size_t)nl) == 0,
               "ragged graph: replay %d (lengths %d) differs from the eager call", i, r);
      int64_t unwritten = 0;
      for (int64_t e = 0; e < t * H * DV; e++) unwritten += og[e] == 0xffff;
      TU_CHECK(unwritten == 0, "ragged graph: replay %d: %lld outputs unwritten", i, (long long)unwritten);
    }
    printf("  ragged graph with the workspace: 5 replays over 3 length sets equal the eager calls\n");
    CK(cudaGraphExecDestroy(exec));
  }
  if (graph) CK(cudaGraphDestroy(graph));
  cudaGetLastError();
  TU_STATUS(mla_ctx_set_stream(gpu, NULL), MLA_OK);
  CK(cudaStreamDestroy(s));
  for (int r = 0; r < 3; r++) free(oe[r]), free(le[r]);
  free(og), free(lg), free(qb), free(kb), free(vb);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dind), cudaFree(dout), cudaFree(dlse);
}

/* ---- merge ---------------------------------------------------------------- */
static void run_merge(int n, int T, int H, int dim, mla_dtype t, int base2, int in_place, int with_lse) {
  char cs[160];
  snprintf(cs, sizeof cs, "merge n=%d T=%d H=%d dim=%d %s base2=%d in_place=%d lse=%d", n, T, H, dim,
           mla_dtype_name(t), base2, in_place, with_lse);
  const int64_t rows = (int64_t)T * H, ne = rows * dim;
  const size_t es = tu_act_size(t);
  double **o_d = malloc(sizeof(double *) * (size_t)n), **l_d = malloc(sizeof(double *) * (size_t)n);
  void **d_o = malloc(sizeof(void *) * (size_t)n);
  float **d_l = malloc(sizeof(float *) * (size_t)n);
  float *lf = malloc(sizeof(float) * (size_t)rows);
  for (int k = 0; k < n; k++) {
    void *bits;
    o_d[k] = rand_act(t, ne, &bits);
    l_d[k] = malloc(sizeof(double) * (size_t)rows);
    for (int64_t x = 0; x < rows; x++) {
      /* row x % 5 == 0: every side empty; else side k empty one time in 4 */
      const int empty = x % 5 == 0 || tu_randint(&rng, 0, 3) == 0;
      const float v = empty ? -INFINITY : (float)(4.0 * tu_normal(&rng));
      lf[x] = base2 ? v : v;
      l_d[k][x] = (double)v; /* the value the kernel sees, in its base */
      if (empty) { /* garbage the merge must never read: NaN in the part, 0 for the oracle */
        memset((unsigned char *)bits + (size_t)x * dim * es, 0xff, (size_t)dim * es);
        for (int c = 0; c < dim; c++) o_d[k][x * dim + c] = 0.0;
      }
    }
    d_o[k] = tu_dev_copy(bits, es * (size_t)ne);
    d_l[k] = tu_dev_copy(lf, sizeof(float) * (size_t)rows);
    free(bits);
  }
  /* the oracle works in natural log */
  double **ln = malloc(sizeof(double *) * (size_t)n);
  for (int k = 0; k < n; k++) {
    ln[k] = malloc(sizeof(double) * (size_t)rows);
    for (int64_t x = 0; x < rows; x++) ln[k][x] = base2 ? l_d[k][x] * 0.6931471805599453 : l_d[k][x];
  }
  double *o_ref = malloc(sizeof(double) * (size_t)ne), *l_ref = malloc(sizeof(double) * (size_t)rows);
  ref_merge(n, T, H, dim, (const double *const *)o_d, (const double *const *)ln, o_ref, l_ref);
  void *dout = in_place ? d_o[0] : tu_dev_alloc(es * (size_t)(ne + GUARD));
  float *dlse = in_place ? d_l[0] : tu_dev_alloc(sizeof(float) * (size_t)(rows + GUARD));
  if (!in_place) {
    CK(cudaMemset(dout, 0xff, es * (size_t)(ne + GUARD)));
    CK(cudaMemset(dlse, 0xff, sizeof(float) * (size_t)(rows + GUARD)));
  }
  mla_status st = mla_merge_states(gpu, n, T, H, dim, t, base2 ? MLA_FLAG_LSE_BASE2 : 0, (const void *const *)d_o,
                                   (const float *const *)d_l, dout, with_lse ? dlse : NULL);
  TU_CHECK(st == MLA_OK, "%s: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  const size_t ob = es * (size_t)(ne + (in_place ? 0 : GUARD));
  unsigned char *out = malloc(ob);
  float *lse = malloc(sizeof(float) * (size_t)(rows + GUARD));
  CK(cudaMemcpy(out, dout, ob, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, dlse, sizeof(float) * (size_t)(rows + (in_place ? 0 : GUARD)), cudaMemcpyDeviceToHost));
  if (!in_place) {
    TU_CHECK(tu_all_poisoned(out + es * (size_t)ne, es * GUARD), "%s: out guard written", cs);
    TU_CHECK(tu_all_poisoned(lse + rows, sizeof(float) * GUARD), "%s: lse guard written", cs);
  }
  double *o = to_double(t, out, ne);
  const double atol = t == MLA_DTYPE_F32 ? 1e-5 : 1e-3, rtol = t == MLA_DTYPE_F32 ? 1e-5 : 1.0 / 128.0;
  ref_cmp cmp = ref_compare(o, o_ref, ne, atol, rtol);
  TU_CHECK(ref_cmp_ok(&cmp, 1e-5), "%s: %lld bad, %lld non-finite mismatches, max abs err %.3g", cs,
           (long long)cmp.bad, (long long)cmp.nonfinite_mismatch, cmp.max_abs_err);
  if (with_lse) {
    int64_t lbad = 0;
    for (int64_t x = 0; x < rows; x++) {
      const double want = base2 ? l_ref[x] * 1.4426950408889634 : l_ref[x], got = lse[x];
      if (isinf(want) || isinf(got) || isnan(got)) lbad += !(isinf(want) && isinf(got) && want < 0 && got < 0);
      else lbad += fabs(got - want) > 1e-5 + 1e-6 * fabs(want);
    }
    TU_CHECK(lbad == 0, "%s: %lld lse values wrong", cs, (long long)lbad);
  }
  for (int k = 0; k < n; k++) {
    free(o_d[k]), free(l_d[k]), free(ln[k]);
    cudaFree(d_o[k]), cudaFree(d_l[k]);
  }
  if (!in_place) cudaFree(dout), cudaFree(dlse);
  free(o_d), free(l_d), free(ln), free(d_o), free(d_l), free(lf), free(o_ref), free(l_ref), free(out), free(lse),
      free(o);
}

/* ---- refusals ------------------------------------------------------------- */
static void refusals(void) {
  const int H = 4, T = 8;
  int32_t ind[3] = {0, 4, 8}, bad_ind[3] = {0, 6, 2};
  void *dq = tu_dev_alloc(2 * T * H * 192), *dk = tu_dev_alloc(2 * T * H * 192), *dv = tu_dev_alloc(2 * T * H * 128);
  CK(cudaMemset(dq, 0, 2 * T * H * 192));
  CK(cudaMemset(dk, 0, 2 * T * H * 192));
  CK(cudaMemset(dv, 0, 2 * T * H * 128));
  void *dind = tu_dev_copy(ind, sizeof ind), *dbad = tu_dev_copy(bad_ind, sizeof bad_ind);
  const size_t ob = 4 * T * H * 128;
  void *dout = tu_dev_alloc(ob);
  float *dlse = tu_dev_alloc(4 * T * H);
  unsigned char *host = malloc(ob);
  mla_ragged_args g;
  memset(&g, 0, sizeof g);
  g.batch_size = 2, g.num_heads = H, g.num_kv_heads = H, g.qk_dim = 192, g.v_dim = 128, g.scale = 0.1f;
  g.act_dtype = MLA_DTYPE_BF16, g.qo_indptr = dind, g.kv_indptr = dind, g.q = dq, g.k = dk, g.v = dv;
  g.out = dout, g.lse = dlse, g.causal = 1;
  /* host twin for the CPU path's statuses (its arrays are host memory) */
  mla_ragged_args hcpu = g;
  void *hq = calloc(1, 2 * T * H * 192), *hk = calloc(1, 2 * T * H * 192), *hv = calloc(1, 2 * T * H * 128);
  void *hout = malloc(ob);
  hcpu.qo_indptr = ind, hcpu.kv_indptr = ind, hcpu.q = hq, hcpu.k = hk, hcpu.v = hv, hcpu.out = hout, hcpu.lse = NULL;
  struct {
    const char *what;
    int field; /* which field to spoil */
  } bads[] = {{"num_heads 0", 0},  {"num_kv_heads 3", 1}, {"qk_dim 0", 2},   {"v_dim 300", 3},
              {"scale NaN", 4},    {"softcap -1", 5},     {"causal 2", 6},   {"flags 0x80", 7},
              {"dtype 42", 8},     {"dtype fp8", 9},      {"batch -1", 10},  {"qo_indptr NULL", 11},
              {"q NULL", 12}};
  for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
    mla_ragged_args x[2] = {g, hcpu};
    for (int s = 0; s < 2; s++) {
      mla_ragged_args *y = &x[s];
      switch (bads[i].field) {
        case 0: y->num_heads = 0; break;
        case 1: y->num_kv_heads = 3; break;
        case 2: y->qk_dim = 0; break;
        case 3: y->v_dim = 300; break;
        case 4: y->scale = NAN; break;
        case 5: y->softcap = -1.0f; break;
        case 6: y->causal = 2; break;
        case 7: y->flags = 0x80; break;
        case 8: y->act_dtype = (mla_dtype)42; break;
        case 9: y->act_dtype = MLA_DTYPE_FP8_E4M3; break;
        case 10: y->batch_size = -1; break;
        case 11: y->qo_indptr = NULL; break;
        case 12: y->q = NULL; break;
      }
    }
    CK(cudaMemset(dout, 0xff, ob));
    const mla_status want = mla_attention_ragged(cpu, &x[1]);
    const mla_status got = mla_attention_ragged(gpu, &x[0]);
    TU_CHECK(got == want && got != MLA_OK, "%s: GPU %s, CPU %s", bads[i].what, mla_status_string(got),
             mla_status_string(want));
    TU_CHECK(mla_ctx_last_error(gpu)[0] != '\0', "%s: no message", bads[i].what);
    CK(cudaMemcpy(host, dout, ob, cudaMemcpyDeviceToHost));
    TU_CHECK(tu_all_poisoned(host, ob), "%s: out written", bads[i].what);
  }
  /* the CUDA scope */
  mla_ragged_args x = g;
  x.q = hq;
  TU_STATUS(mla_attention_ragged(gpu, &x), MLA_ERR_INVALID_ARGUMENT);
  x = g, x.qo_indptr = ind;
  TU_STATUS(mla_attention_ragged(gpu, &x), MLA_ERR_INVALID_ARGUMENT);
  x = g, x.batch_size = 0;
  CK(cudaMemset(dout, 0xff, ob));
  TU_STATUS(mla_attention_ragged(gpu, &x), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  CK(cudaMemcpy(host, dout, ob, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(host, ob), "batch 0: out written");
  /* the optional workspace: too small, host memory, misaligned (checked
   * even for an empty batch); nothing written */
  {
    unsigned char *hws = malloc(g_ws_bytes);
    char *dws = tu_dev_alloc(g_ws_bytes + 8);
    struct {
      const char *what;
      void *ws;
      size_t bytes;
      int bs;
      mla_status want;
    } wb[] = {{"workspace too small", g_ws, 3, 2, MLA_ERR_WORKSPACE_TOO_SMALL},
              {"workspace too small, empty batch", g_ws, g_ws_bytes - 1, 0, MLA_ERR_WORKSPACE_TOO_SMALL},
              {"workspace in host memory", hws, g_ws_bytes, 2, MLA_ERR_INVALID_ARGUMENT},
              {"workspace misaligned", dws + 2, g_ws_bytes, 2, MLA_ERR_INVALID_ARGUMENT}};
    for (size_t i = 0; i < sizeof wb / sizeof wb[0]; i++) {
      x = g, x.workspace = wb[i].ws, x.workspace_bytes = wb[i].bytes, x.batch_size = wb[i].bs;
      CK(cudaMemset(dout, 0xff, ob));
      TU_CHECK(mla_attention_ragged(gpu, &x) == wb[i].want, "%s: want %s", wb[i].what,
               mla_status_string(wb[i].want));
      TU_CHECK(mla_ctx_last_error(gpu)[0] != '\0', "%s: no message", wb[i].what);
      TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
      CK(cudaMemcpy(host, dout, ob, cudaMemcpyDeviceToHost));
      TU_CHECK(tu_all_poisoned(host, ob), "%s: out written", wb[i].what);
    }
    /* the CPU path ignores it (whatever it points at) */
    x = hcpu, x.workspace = hws, x.workspace_bytes = 1;
    TU_STATUS(mla_attention_ragged(cpu, &x), MLA_OK);
    free(hws);
    cudaFree(dws);
  }
  /* a decreasing index array: skipped on the device, reported on synchronize */
  x = g, x.kv_indptr = dbad;
  TU_STATUS(mla_attention_ragged(gpu, &x), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_ERR_OUT_OF_RANGE);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);

  /* merge refusals */
  const void *op[2] = {dout, dout};
  const float *lp[2] = {dlse, dlse};
  const void *hop[2] = {hout, hout};
  TU_STATUS(mla_merge_states(gpu, 0, T, H, 128, MLA_DTYPE_F32, 0, op, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, T, 0, 128, MLA_DTYPE_F32, 0, op, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, T, H, 0, MLA_DTYPE_F32, 0, op, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, T, H, 128, MLA_DTYPE_F32, 4, op, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, T, H, 128, MLA_DTYPE_FP8_E4M3, 0, op, lp, dout, dlse), MLA_ERR_UNSUPPORTED);
  TU_STATUS(mla_merge_states(gpu, 2, T, H, 128, MLA_DTYPE_F32, 0, hop, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, T, H, 128, MLA_DTYPE_F32, 0, NULL, lp, dout, dlse), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_merge_states(gpu, 2, 0, H, 128, MLA_DTYPE_F32, 0, NULL, NULL, NULL, NULL), MLA_OK);
  { /* passes need lse_out for the running lse; at most one pass's worth of states may alias out */
    enum { NS = 2033 }; /* one more than MLA_CUDA_MERGE_PASS_STATES */
    const void **mo = malloc(sizeof(void *) * NS);
    const float **ml = malloc(sizeof(float *) * NS);
    void *o2 = tu_dev_alloc(sizeof(float) * (size_t)T * H * 128);
    for (int k = 0; k < NS; k++) mo[k] = dout, ml[k] = dlse;
    TU_STATUS(mla_merge_states(gpu, NS, T, H, 128, MLA_DTYPE_F32, 0, mo, ml, o2, NULL), MLA_ERR_UNSUPPORTED);
    TU_STATUS(mla_merge_states(gpu, NS, T, H, 128, MLA_DTYPE_F32, 0, mo, ml, dout, dlse), MLA_ERR_UNSUPPORTED);
    free(mo), free(ml);
    cudaFree(o2);
  }
  free(host), free(hq), free(hk), free(hv), free(hout);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dind), cudaFree(dbad), cudaFree(dout), cudaFree(dlse);
}

int main(int argc, char **argv) {
  rng.s = tu_seed("test_cuda_ragged", 57);
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  if (st == MLA_ERR_DEVICE) {
    printf("test_cuda_ragged: skipped: no GPU (%s)\n", mla_status_string(st));
    return tu_finish("test_cuda_ragged");
  }
  TU_STATUS(st, MLA_OK);
  if (!gpu) return tu_finish("test_cuda_ragged");
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  {
    size_t cpu_bytes = 1;
    TU_STATUS(mla_attention_ragged_workspace_size(gpu, &g_ws_bytes), MLA_OK);
    TU_STATUS(mla_attention_ragged_workspace_size(cpu, &cpu_bytes), MLA_OK);
    TU_CHECK(g_ws_bytes >= 4 && cpu_bytes == 0, "ragged workspace: %zu bytes on the GPU, %zu on the CPU", g_ws_bytes,
             cpu_bytes);
    TU_STATUS(mla_attention_ragged_workspace_size(gpu, NULL), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_attention_ragged_workspace_size(NULL, &cpu_bytes), MLA_ERR_INVALID_ARGUMENT);
    g_ws = tu_dev_alloc(g_ws_bytes);
  }
  /* "small": the compute-sanitizer run (one small case of each kind) */
  const int small = argc > 1 && strcmp(argv[1], "small") == 0;
  const rcase cases[] = {
      /* name, bs, H, Hkv, dqk, dv, causal, softcap, flags, act, lse, maxq, maxprefix, longq */
      {"h1 long causal", 6, 1, 1, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 300, 300, 2500},
      {"h16 gqa4 noncausal softcap base2", 5, 16, 4, 192, 128, 0, 30.0f, MLA_FLAG_LSE_BASE2, MLA_DTYPE_BF16, 1, 260,
       200, 0},
      {"h128 causal", 4, 128, 128, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 150, 100, 0},
      {"h16 128/128 f16 out_f32", 5, 16, 16, 128, 128, 1, 0.0f, MLA_FLAG_OUT_F32, MLA_DTYPE_F16, 1, 200, 300, 0},
      {"h16 gqa2 causal softcap no-lse", 5, 16, 2, 192, 128, 1, 20.0f, 0, MLA_DTYPE_BF16, 0, 200, 150, 0},
      {"h1 128/128 noncausal", 5, 1, 1, 128, 128, 0, 0.0f, MLA_FLAG_LSE_BASE2 | MLA_FLAG_OUT_F32, MLA_DTYPE_BF16, 1,
       400, 600, 0},
      /* a batch of one request of maxq queries: the default walks one head at a time (head group 1) */
      {"h128 one request causal", 1, 128, 128, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 400, 200, 0},
      {"h16 gqa4 one request noncausal softcap base2", 1, 16, 4, 192, 128, 0, 30.0f, MLA_FLAG_LSE_BASE2,
       MLA_DTYPE_BF16, 1, 650, 300, 0},
      {"h3 one request 128/128 f16 out_f32", 1, 3, 1, 128, 128, 1, 0.0f, MLA_FLAG_OUT_F32, MLA_DTYPE_F16, 1, 900, 400,
       0},
      /* many short requests: a long prefix table, items of one or two tiles */
      {"h4 many requests", 600, 4, 2, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 24, 40, 0},
  };
  /* the generic kernel (src/cuda/ragged_generic.cu: other dims, f32, > MLA_CUDA_PREFILL_MAX_BATCH requests) */
  const rcase generic[] = {
      {"generic 64/64", 5, 8, 8, 64, 64, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 200, 100, 0},
      {"generic 256/256 gqa2 noncausal softcap base2", 4, 4, 2, 256, 256, 0, 30.0f, MLA_FLAG_LSE_BASE2,
       MLA_DTYPE_BF16, 1, 150, 100, 0},
      {"generic 100/36 f16 out_f32", 5, 3, 1, 100, 36, 1, 0.0f, MLA_FLAG_OUT_F32, MLA_DTYPE_F16, 1, 120, 80, 0},
      {"generic f32 192/128", 4, 4, 4, 192, 128, 1, 0.0f, 0, MLA_DTYPE_F32, 1, 100, 60, 0},
      {"generic 1/1 no-lse", 4, 2, 1, 1, 1, 1, 0.0f, 0, MLA_DTYPE_BF16, 0, 70, 40, 0},
      {"generic 192/128 5000 requests", 5000, 2, 1, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 4, 6, 0},
  };
  if (small) {
    const rcase sc = {"small", 4, 2, 1, 192, 128, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 140, 60, 0};
    run_ragged(&sc, 1);
    const rcase gc = {"small generic 72/40", 4, 2, 1, 72, 40, 1, 0.0f, 0, MLA_DTYPE_BF16, 1, 90, 50, 0};
    run_ragged(&gc, 0);
    run_merge(3, 5, 2, 128, MLA_DTYPE_BF16, 0, 0, 1);
  } else {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_ragged(&cases[i], 1);
    for (size_t i = 0; i < sizeof generic / sizeof generic[0]; i++) run_ragged(&generic[i], 0);
    const mla_dtype ts[3] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
    for (int ti = 0; ti < 3; ti++) {
      run_merge(2, 37, 4, 128, ts[ti], 0, 0, 1);
      run_merge(3, 21, 3, 7, ts[ti], 1, 0, 1);
      run_merge(1, 10, 2, 128, ts[ti], 0, 0, 1);
      run_merge(5, 13, 4, 128, ts[ti], ti == 1, 1, 1);
      run_merge(2, 9, 2, 64, ts[ti], 0, 0, 0);
    }
    run_merge(128, 6, 2, 32, MLA_DTYPE_F32, 0, 0, 1);
    /* the full parameter block (65..2032 states) and passes (more; lse_out needed) */
    run_merge(300, 3, 2, 16, MLA_DTYPE_BF16, 1, 0, 0);
    run_merge(2032, 2, 1, 8, MLA_DTYPE_F32, 0, 1, 1);
    run_merge(2500, 3, 1, 8, MLA_DTYPE_BF16, 0, 0, 1);
    run_merge(4500, 2, 2, 8, MLA_DTYPE_F32, 1, 1, 1);
    run_long(1, 1, 1);
    run_long(16, 16, 1);
    run_long(128, 128, 1);
    run_long(16, 4, 0);
    graph_replay();
    refusals();
  }
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_ragged");
}
#endif
