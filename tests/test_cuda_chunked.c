/* Chunked-prefix MHA on a CUDA context, composed from the public calls the
 * way an engine (or the backend's MLA_EXTEND_MHA_CHUNKED path) runs it, against
 * one-shot attention over the whole prefix and the float64 oracle.
 *
 * Per case: a batch of requests with varlen cached prefixes (one of 0, one
 * of max_prefix, one exactly one chunk long) and extends 1..max_ext (one of
 * 1, one of max_ext), pages handed out round-robin so that the requests'
 * pages interleave, over a bf16 or per-tensor fp8 cache (page 64 or 1) whose
 * rows were poisoned (NaN) before the writes. Chunked path:
 *   mla_chunk_plan_build (chunk_capacity small enough for >= 3 chunks), then
 *   per chunk mla_gather_latent of its slots (dequantized to bf16), the cuBLAS
 *   mla_expand_kv with a random kv_b_proj, mla_attention_ragged non-causal
 *   (LSE, MLA_FLAG_OUT_F32); the extend tokens' own causal ragged attention;
 *   mla_merge_states of all the states in one call, or (some cases) pairwise
 *   in place into a running state as the backend does.
 * One-shot: one causal (bottom-right) ragged call per request over [prefix +
 * extend] keys whose k/v are exactly the bits the chunked path consumed (each
 * chunk's expansion copied into place, the extend rows shared), so the two
 * differ only by the attention arithmetic.
 *
 * Checks and bounds (fp32 outputs; Sp|v| below is sum_j p_j |v_j| of the row,
 * computed by a one-shot run on |v| for all rows and by the oracle on
 * sampled rows):
 *  - the latent rows gathered with the test's own slot list equal what was
 *    written (bf16 exactly; fp8 within half an e4m3 step, 2^-4 relative, plus
 *    the bf16 rounding and the subnormal step);
 *  - the k/v the chunks expanded equal an independent expansion of all rows
 *    (gather with the test's slots, one mla_expand_kv call): rope columns bit
 *    for bit, the GEMM columns within one bf16 step (2^-7 |x|) + 1e-3 (cuBLAS
 *    may sum in another order for another row count); a chunk that gathered
 *    the wrong slots is off by O(1);
 *  - chunked vs one-shot, every row: |o_c - o_1| <= 2e-4 + 2^-7 Sp|v| (the
 *    kernels round P to bf16 before P V, at most 2^-9 relative per weight,
 *    so each result is within 2^-9 Sp|v| (+2^-9 |o| for a rounded
 *    denominator) of exact attention over the same k/v; 2^-7 leaves a factor
 *    two over both sides' worst cases; 2e-4 covers fp32 accumulation and the
 *    fp32 merge), cosine distance < 1e-5; LSE within 1e-4 + 1e-5 |lse| (it
 *    comes from fp32 scores: no P rounding in it; fp32 sums over <= 4.4K keys
 *    and the merge's log-sum-exp are ~1e-6); every row finite;
 *  - chunked vs the float64 oracle (ref_mha over the request's visible keys,
 *    from the same bf16 k/v) on sampled rows (first, last and a random extend
 *    token of every request, all heads), same bounds.
 * The measured maxima are printed per case. Skips (passing) without CUDA or
 * a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_chunked: skipped: built without CUDA\n");
  return tu_finish("test_cuda_chunked");
}
#else
#include "cuda_util.h"

#define NOPE 128
#define DV 128
#define DQK (NOPE + MLA_ROPE)
#define MAXB 8
#define LAYER 1 /* of 2: the layer offset is exercised */
#define FP8_SCALE 0.0173f

static tu_rng rng;
static mla_ctx *gpu;

typedef struct ccase {
  const char *name;
  mla_dtype cache_dtype; /* BF16 or FP8_E4M3 (per-tensor scale) */
  int page, H, bs;
  int max_prefix, max_ext; /* prefixes 0..max_prefix, extends 1..max_ext */
  int chunk_capacity;
  int pairwise; /* merge into a running state in place (as the backend) */
} ccase;

typedef struct worst {
  double out, out_ratio, lse, cos;
  int64_t bad, lbad, nonfinite;
} worst;

static uint16_t *rand_bf16_host(int64_t n, double sigma, float *keep /* [n] or NULL */) {
  float *f = keep ? keep : malloc(sizeof(float) * (size_t)(n ? n : 1));
  tu_fill_bf16_normal(&rng, f, n, sigma);
  uint16_t *b = malloc(sizeof(uint16_t) * (size_t)(n ? n : 1));
  tu_to_dtype(MLA_DTYPE_BF16, f, b, n);
  if (!keep) free(f);
  return b;
}

static void *dev_get(const void *d, size_t bytes) {
  void *h = malloc(bytes ? bytes : 1);
  if (bytes) CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
  return h;
}

/* One ragged call over device indptrs (fp32 output). */
static mla_status ragged(int bs, int H, int causal, const int32_t *d_qo, const int32_t *d_kv, const void *q,
                         const void *k, const void *v, float *out, float *lse) {
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = bs;
  a.num_heads = a.num_kv_heads = H;
  a.qk_dim = DQK;
  a.v_dim = DV;
  a.scale = (float)(1.0 / sqrt((double)DQK));
  a.causal = causal;
  a.flags = MLA_FLAG_OUT_F32;
  a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = d_qo;
  a.kv_indptr = d_kv;
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = lse;
  return mla_attention_ragged(gpu, &a);
}

/* Compare one output row (H * DV values, H LSEs) against a reference. */
static void cmp_row(worst *w, const float *o, const float *l, const double *o_ref, const double *l_ref,
                    const double *pabs, int H, double *dot, double *n1, double *n2) {
  for (int i = 0; i < H * DV; i++) {
    const double x = o[i], y = o_ref[i];
    if (!isfinite(x) || !isfinite(y)) {
      w->nonfinite++;
      continue;
    }
    const double e = fabs(x - y), tol = 2e-4 + pabs[i] / 128.0;
    w->bad += !(e <= tol);
    if (e > w->out) w->out = e;
    if (e / tol > w->out_ratio) w->out_ratio = e / tol;
    *dot += x * y, *n1 += x * x, *n2 += y * y;
  }
  for (int h = 0; h < H; h++) {
    if (!isfinite(l[h]) || !isfinite(l_ref[h])) {
      w->nonfinite++;
      continue;
    }
    const double e = fabs((double)l[h] - l_ref[h]);
    w->lbad += !(e <= 1e-4 + 1e-5 * fabs(l_ref[h]));
    if (e > w->lse) w->lse = e;
  }
}

static void run_case(const ccase *cs) {
  const int bs = cs->bs, H = cs->H;
  const int fp8 = cs->cache_dtype == MLA_DTYPE_FP8_E4M3;
  int32_t pre[MAXB], ext[MAXB], seq[MAXB], ids[MAXB];
  const int chunk_len_want = cs->chunk_capacity / bs > 1 ? cs->chunk_capacity / bs : 1;
  for (int i = 0; i < bs; i++) {
    pre[i] = tu_randint(&rng, 1, cs->max_prefix);
    ext[i] = tu_randint(&rng, 1, cs->max_ext);
  }
  pre[0] = 0;                   /* no prefix: no chunk has keys for it */
  pre[1] = cs->max_prefix;      /* the most chunks */
  if (bs > 4) pre[4] = chunk_len_want; /* exactly one chunk */
  ext[2 % bs] = 1;
  ext[3 % bs] = cs->max_ext;
  int32_t kvp[MAXB + 1], qo[MAXB + 1];
  kvp[0] = qo[0] = 0;
  int max_seq = 1, total_pre = 0;
  for (int i = 0; i < bs; i++) {
    seq[i] = pre[i] + ext[i];
    kvp[i + 1] = kvp[i] + seq[i];
    qo[i + 1] = qo[i] + ext[i];
    if (seq[i] > max_seq) max_seq = seq[i];
    total_pre += pre[i];
  }
  const int K = kvp[bs], T = qo[bs];
  char name[200];
  snprintf(name, sizeof name, "%s (bs=%d H=%d %s page %d, capacity %d, %d keys, %d queries)", cs->name, bs, H,
           mla_dtype_name(cs->cache_dtype), cs->page, cs->chunk_capacity, K, T);

  /* ---- cache, table, rows --------------------------------------------- */
  int num_pages = 8;
  for (int i = 0; i < bs; i++) num_pages += (seq[i] + cs->page - 1) / cs->page;
  float scales[2] = {1.0f, FP8_SCALE};
  mla_kv_cache_desc cd = {2, num_pages, cs->page, cs->cache_dtype, fp8 ? scales : NULL};
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  TU_STATUS(mla_kv_cache_create(gpu, &cd, &cache), MLA_OK);
  mla_req_table_desc rd = {bs + 2, max_seq, num_pages, cs->page};
  TU_STATUS(mla_req_table_create(gpu, &rd, cache, &rt), MLA_OK);
  if (!cache || !rt) {
    mla_req_table_destroy(rt);
    mla_kv_cache_destroy(cache);
    return;
  }
  {
    size_t row = 0;
    void *data = NULL;
    mla_kv_cache_row_bytes(cache, &row);
    for (int l = 0; l < 2; l++) /* 0xFF bytes: NaN in bf16 and e4m3 */
      if (mla_kv_cache_layer_data(cache, l, &data) == MLA_OK)
        CK(cudaMemset(data, 0xFF, (size_t)num_pages * cs->page * row));
  }
  /* Requests grow in random pieces, round-robin, so their pages interleave. */
  int ok = 1;
  for (int i = 0; i < bs; i++) ok &= mla_req_add(rt, &ids[i]) == MLA_OK;
  for (int left = 1; left;) {
    left = 0;
    for (int i = 0; i < bs; i++) {
      int len = 0;
      mla_req_length(rt, ids[i], &len);
      if (len < seq[i]) {
        const int n = tu_randint(&rng, 1, (seq[i] - len) < 700 ? seq[i] - len : 700);
        ok &= mla_req_extend(rt, ids[i], n, NULL) == MLA_OK;
        left = 1;
      }
    }
  }
  TU_CHECK(ok, "%s: request table set-up", name);
  const int32_t *r2t = NULL;
  mla_req_table_data(rt, &r2t);
  /* Key row kvp[i] + p is position p of request i: the one-shot layout. */
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)K);
  for (int i = 0; i < bs; i++)
    for (int p = 0; p < seq[i]; p++) slots[kvp[i] + p] = r2t[(size_t)ids[i] * max_seq + p];
  float *hc = malloc(sizeof(float) * (size_t)K * MLA_LATENT), *hr = malloc(sizeof(float) * (size_t)K * MLA_ROPE);
  uint16_t *bc = rand_bf16_host((int64_t)K * MLA_LATENT, 1.0, hc), *br = rand_bf16_host((int64_t)K * MLA_ROPE, 1.0, hr);
  int32_t *d_slots = tu_dev_copy(slots, sizeof(int32_t) * (size_t)K);
  void *d_c = tu_dev_copy(bc, 2 * (size_t)K * MLA_LATENT), *d_r = tu_dev_copy(br, 2 * (size_t)K * MLA_ROPE);
  TU_STATUS(mla_kv_cache_write(cache, LAYER, K, d_slots, d_c, d_r, MLA_DTYPE_BF16), MLA_OK);

  /* ---- weights, queries ------------------------------------------------ */
  const int64_t nw = (int64_t)H * (NOPE + DV) * MLA_LATENT, nq = (int64_t)T * H * DQK;
  uint16_t *bw = rand_bf16_host(nw, 0.05, NULL), *bq = rand_bf16_host(nq, 1.0, NULL);
  void *d_w = tu_dev_copy(bw, 2 * (size_t)nw), *d_q = tu_dev_copy(bq, 2 * (size_t)nq);
  int32_t *d_qo = tu_dev_copy(qo, sizeof qo), *d_kvp = tu_dev_copy(kvp, sizeof kvp);

  /* ---- independent gather + expansion of every key row ------------------ */
  const int64_t krow = (int64_t)H * DQK, vrow = (int64_t)H * DV;
  void *d_gc = tu_dev_alloc(2 * (size_t)K * MLA_LATENT), *d_gr = tu_dev_alloc(2 * (size_t)K * MLA_ROPE);
  uint16_t *d_ki = tu_dev_alloc(2 * (size_t)(K * krow)), *d_vi = tu_dev_alloc(2 * (size_t)(K * vrow));
  TU_STATUS(mla_gather_latent(gpu, cache, LAYER, K, d_slots, MLA_DTYPE_BF16, d_gc, d_gr), MLA_OK);
  TU_STATUS(mla_expand_kv(gpu, K, H, NOPE, DV, MLA_DTYPE_BF16, MLA_DTYPE_BF16, d_gc, d_gr, d_w, d_ki, d_vi), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  {
    uint16_t *gc = dev_get(d_gc, 2 * (size_t)K * MLA_LATENT), *gr = dev_get(d_gr, 2 * (size_t)K * MLA_ROPE);
    int64_t bad = 0;
    for (int part = 0; part < 2; part++) {
      const int64_t n = (int64_t)K * (part ? MLA_ROPE : MLA_LATENT);
      const uint16_t *g = part ? gr : gc;
      const float *x = part ? hr : hc;
      for (int64_t e = 0; e < n; e++) {
        const double got = tu_bf16_to_f32(g[e]), want = x[e];
        const double tol = fp8 ? 0.07 * fabs(want) + FP8_SCALE / 512.0 : 0.0;
        bad += !(fabs(got - want) <= tol);
      }
    }
    TU_CHECK(bad == 0, "%s: %lld gathered latent values differ from what was written", name, (long long)bad);
    free(gc), free(gr);
  }

  /* ---- chunk plan -------------------------------------------------------- */
  size_t cws_bytes = 0;
  TU_STATUS(mla_chunk_plan_workspace_size(gpu, bs, total_pre > 0 ? total_pre : 1, cs->chunk_capacity, &cws_bytes),
            MLA_OK);
  void *cws = malloc(cws_bytes ? cws_bytes : 1);
  mla_chunk_plan cp;
  memset(&cp, 0, sizeof cp);
  TU_STATUS(mla_chunk_plan_build(gpu, rt, bs, ids, pre, cs->chunk_capacity, cws, cws_bytes, &cp), MLA_OK);
  const int nc = cp.num_chunks;
  TU_CHECK(cp.chunk_len == chunk_len_want && nc == (cs->max_prefix + chunk_len_want - 1) / chunk_len_want && nc >= 3,
           "%s: chunk plan: %d chunks of %d (expected >= 3 of %d)", name, nc, cp.chunk_len, chunk_len_want);
  TU_CHECK(nc >= 1, "%s: %d chunks: nothing to merge", name, nc);
  if (nc >= 1) {
    int32_t *d_cslots = tu_dev_copy(cp.slots, sizeof(int32_t) * (size_t)(cp.slot_indptr[nc] ? cp.slot_indptr[nc] : 1));
    int32_t *d_ccu = tu_dev_copy(cp.cu_seq_lens, sizeof(int32_t) * (size_t)nc * (bs + 1));
    const int cap = cs->chunk_capacity;
    void *d_cc = tu_dev_alloc(2 * (size_t)cap * MLA_LATENT), *d_cr = tu_dev_alloc(2 * (size_t)cap * MLA_ROPE);
    uint16_t *d_ck = tu_dev_alloc(2 * (size_t)(cap * krow)), *d_cv = tu_dev_alloc(2 * (size_t)(cap * vrow));
    /* the one-shot k/v: the chunks' expansions put in place, the extend rows shared */
    uint16_t *d_k1 = tu_dev_alloc(2 * (size_t)(K * krow)), *d_v1 = tu_dev_alloc(2 * (size_t)(K * vrow));
    uint16_t *d_ke = tu_dev_alloc(2 * (size_t)(T * krow)), *d_ve = tu_dev_alloc(2 * (size_t)(T * vrow));
    CK(cudaMemset(d_k1, 0xFF, 2 * (size_t)(K * krow)));
    CK(cudaMemset(d_v1, 0xFF, 2 * (size_t)(K * vrow)));
    for (int i = 0; i < bs; i++) {
      const size_t src = (size_t)(kvp[i] + pre[i]), dst = (size_t)qo[i], n = (size_t)ext[i];
      CK(cudaMemcpy(d_ke + dst * krow, d_ki + src * krow, 2 * n * krow, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(d_ve + dst * vrow, d_vi + src * vrow, 2 * n * vrow, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(d_k1 + src * krow, d_ki + src * krow, 2 * n * krow, cudaMemcpyDeviceToDevice));
      CK(cudaMemcpy(d_v1 + src * vrow, d_vi + src * vrow, 2 * n * vrow, cudaMemcpyDeviceToDevice));
    }
    /* states: 0 = the extend tokens' own, c + 1 = prefix chunk c */
    const int64_t no = (int64_t)T * H * DV, nl = (int64_t)T * H;
    float **d_po = malloc(sizeof(float *) * (size_t)(nc + 1)), **d_pl = malloc(sizeof(float *) * (size_t)(nc + 1));
    for (int s = 0; s <= nc; s++) {
      d_po[s] = tu_dev_alloc(sizeof(float) * (size_t)no);
      d_pl[s] = tu_dev_alloc(sizeof(float) * (size_t)nl);
      CK(cudaMemset(d_po[s], 0xFF, sizeof(float) * (size_t)no));
      CK(cudaMemset(d_pl[s], 0xFF, sizeof(float) * (size_t)nl));
    }
    float *d_oc = tu_dev_alloc(sizeof(float) * (size_t)no), *d_lc = tu_dev_alloc(sizeof(float) * (size_t)nl);
    float *d_o1 = tu_dev_alloc(sizeof(float) * (size_t)no), *d_l1 = tu_dev_alloc(sizeof(float) * (size_t)nl);
    float *d_pa = tu_dev_alloc(sizeof(float) * (size_t)no), *d_la = tu_dev_alloc(sizeof(float) * (size_t)nl);
    CK(cudaMemset(d_oc, 0xFF, sizeof(float) * (size_t)no));
    CK(cudaMemset(d_lc, 0xFF, sizeof(float) * (size_t)nl));
    CK(cudaMemset(d_o1, 0xFF, sizeof(float) * (size_t)no));
    CK(cudaMemset(d_l1, 0xFF, sizeof(float) * (size_t)nl));

    /* ---- chunked prefix ------------------------------------------------- */
    int fails = 0;
    mla_status st = ragged(bs, H, 1, d_qo, d_qo, d_q, d_ke, d_ve, d_po[0], d_pl[0]);
    fails += st != MLA_OK;
    for (int c = 0; c < nc && st == MLA_OK; c++) {
      const int n = cp.slot_indptr[c + 1] - cp.slot_indptr[c];
      TU_CHECK(n > 0 && n <= cap, "%s: chunk %d has %d slots (capacity %d)", name, c, n, cap);
      if (n <= 0 || n > cap) break;
      st = mla_gather_latent(gpu, cache, LAYER, n, d_cslots + cp.slot_indptr[c], MLA_DTYPE_BF16, d_cc, d_cr);
      if (st == MLA_OK)
        st = mla_expand_kv(gpu, n, H, NOPE, DV, MLA_DTYPE_BF16, MLA_DTYPE_BF16, d_cc, d_cr, d_w, d_ck, d_cv);
      if (st == MLA_OK)
        st = ragged(bs, H, 0, d_qo, d_ccu + (size_t)c * (bs + 1), d_q, d_ck, d_cv, d_po[c + 1], d_pl[c + 1]);
      if (st == MLA_OK && cs->pairwise) { /* running state in d_po[0] / d_pl[0], in place */
        const void *parts[2] = {d_po[0], d_po[c + 1]};
        const float *lses[2] = {d_pl[0], d_pl[c + 1]};
        st = mla_merge_states(gpu, 2, T, H, DV, MLA_DTYPE_F32, 0, parts, lses, d_po[0], d_pl[0]);
      }
      for (int i = 0; st == MLA_OK && i < bs; i++) { /* this chunk's k/v into the one-shot layout */
        const int32_t len = cp.lens[(size_t)c * bs + i], at = cp.cu_seq_lens[(size_t)c * (bs + 1) + i];
        const size_t dst = (size_t)(kvp[i] + cp.starts[(size_t)c * bs + i]);
        if (len <= 0) continue;
        CK(cudaMemcpy(d_k1 + dst * krow, d_ck + (size_t)at * krow, 2 * (size_t)len * krow, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(d_v1 + dst * vrow, d_cv + (size_t)at * vrow, 2 * (size_t)len * vrow, cudaMemcpyDeviceToDevice));
      }
      fails += st != MLA_OK;
    }
    if (st == MLA_OK) {
      if (cs->pairwise) {
        CK(cudaMemcpy(d_oc, d_po[0], sizeof(float) * (size_t)no, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(d_lc, d_pl[0], sizeof(float) * (size_t)nl, cudaMemcpyDeviceToDevice));
      } else {
        st = mla_merge_states(gpu, nc + 1, T, H, DV, MLA_DTYPE_F32, 0, (const void *const *)d_po,
                              (const float *const *)d_pl, d_oc, d_lc);
        fails += st != MLA_OK;
      }
    }
    TU_CHECK(fails == 0, "%s: chunked path: %s (%s)", name, mla_status_string(st), mla_ctx_last_error(gpu));
    /* ---- one-shot over [prefix + extend], and the same on |v| ------------- */
    st = ragged(bs, H, 1, d_qo, d_kvp, d_q, d_k1, d_v1, d_o1, d_l1);
    TU_CHECK(st == MLA_OK, "%s: one-shot: %s (%s)", name, mla_status_string(st), mla_ctx_last_error(gpu));
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
    uint16_t *k1 = dev_get(d_k1, 2 * (size_t)(K * krow)), *v1 = dev_get(d_v1, 2 * (size_t)(K * vrow));
    {
      uint16_t *va = malloc(2 * (size_t)(K * vrow));
      for (int64_t e = 0; e < K * vrow; e++) va[e] = v1[e] & 0x7FFF; /* |v|: clear the bf16 sign */
      void *d_va = tu_dev_copy(va, 2 * (size_t)(K * vrow));
      st = ragged(bs, H, 1, d_qo, d_kvp, d_q, d_k1, d_va, d_pa, d_la);
      TU_CHECK(st == MLA_OK, "%s: one-shot on |v|: %s", name, mla_status_string(st));
      TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
      free(va);
      cudaFree(d_va);
    }
    /* ---- the chunks' k/v against the independent expansion -------------- */
    {
      uint16_t *ki = dev_get(d_ki, 2 * (size_t)(K * krow)), *vi = dev_get(d_vi, 2 * (size_t)(K * vrow));
      int64_t bad = 0, differ = 0, rope_bad = 0;
      for (int64_t e = 0; e < K * krow; e++) {
        if (k1[e] == ki[e]) continue;
        differ++;
        if (e % DQK >= NOPE) rope_bad++;
        const double a = tu_bf16_to_f32(k1[e]), b = tu_bf16_to_f32(ki[e]);
        bad += !(fabs(a - b) <= fabs(b) / 128.0 + 1e-3);
      }
      for (int64_t e = 0; e < K * vrow; e++) {
        if (v1[e] == vi[e]) continue;
        differ++;
        const double a = tu_bf16_to_f32(v1[e]), b = tu_bf16_to_f32(vi[e]);
        bad += !(fabs(a - b) <= fabs(b) / 128.0 + 1e-3);
      }
      TU_CHECK(bad == 0 && rope_bad == 0,
               "%s: the chunks' k/v differ from the independent expansion: %lld values off, %lld rope values "
               "not bit-equal",
               name, (long long)bad, (long long)rope_bad);
      printf("  %s: %d chunks of %d; chunk k/v vs one expansion: %lld of %lld values not bit-equal\n", name, nc,
             cp.chunk_len, (long long)differ, (long long)(K * (krow + vrow)));
      free(ki), free(vi);
    }
    /* ---- chunked vs one-shot, every row ----------------------------------- */
    float *oc = dev_get(d_oc, sizeof(float) * (size_t)no), *lc = dev_get(d_lc, sizeof(float) * (size_t)nl);
    float *o1 = dev_get(d_o1, sizeof(float) * (size_t)no), *l1 = dev_get(d_l1, sizeof(float) * (size_t)nl);
    float *pa = dev_get(d_pa, sizeof(float) * (size_t)no);
    worst w1;
    memset(&w1, 0, sizeof w1);
    double dot = 0, n1 = 0, n2 = 0;
    {
      double *ro = malloc(sizeof(double) * (size_t)H * DV), *rl = malloc(sizeof(double) * (size_t)H);
      double *rp = malloc(sizeof(double) * (size_t)H * DV);
      for (int64_t t = 0; t < T; t++) {
        for (int e = 0; e < H * DV; e++) ro[e] = o1[t * H * DV + e], rp[e] = pa[t * H * DV + e];
        for (int h = 0; h < H; h++) rl[h] = l1[t * H + h];
        cmp_row(&w1, oc + t * H * DV, lc + t * H, ro, rl, rp, H, &dot, &n1, &n2);
      }
      free(ro), free(rl), free(rp);
    }
    w1.cos = n1 > 0 && n2 > 0 ? 1.0 - dot / sqrt(n1 * n2) : 1.0;
    TU_CHECK(w1.bad == 0 && w1.lbad == 0 && w1.nonfinite == 0 && w1.cos < 1e-5,
             "%s: chunked vs one-shot: %lld values and %lld LSEs out of bounds, %lld non-finite (max err %.3g, "
             "err/bound %.3g, lse err %.3g, cos dist %.3g)",
             name, (long long)w1.bad, (long long)w1.lbad, (long long)w1.nonfinite, w1.out, w1.out_ratio, w1.lse,
             w1.cos);
    /* ---- chunked vs the float64 oracle, sampled rows --------------------- */
    worst w2;
    memset(&w2, 0, sizeof w2);
    double dot2 = 0, m1 = 0, m2 = 0;
    int rows = 0;
    for (int i = 0; i < bs; i++) {
      const int64_t nk = (int64_t)seq[i] * krow, nv = (int64_t)seq[i] * vrow;
      double *k = malloc(sizeof(double) * (size_t)nk), *v = malloc(sizeof(double) * (size_t)nv);
      double *va = malloc(sizeof(double) * (size_t)nv);
      tu_from_dtype(MLA_DTYPE_BF16, k1 + (size_t)kvp[i] * krow, k, nk);
      tu_from_dtype(MLA_DTYPE_BF16, v1 + (size_t)kvp[i] * vrow, v, nv);
      for (int64_t e = 0; e < nv; e++) va[e] = fabs(v[e]);
      double *q = malloc(sizeof(double) * (size_t)krow), *o = malloc(sizeof(double) * (size_t)vrow);
      double *p = malloc(sizeof(double) * (size_t)vrow), *l = malloc(sizeof(double) * (size_t)H);
      double *lp = malloc(sizeof(double) * (size_t)H);
      for (int s = 0; s < 3; s++) {
        const int t = s == 0 ? 0 : s == 1 ? ext[i] - 1 : tu_randint(&rng, 0, ext[i] - 1);
        const int vis = pre[i] + t + 1, one = 1; /* bottom-right causal: keys [0, prefix + t] */
        const int64_t row = qo[i] + t;
        const double scale = (float)(1.0 / sqrt((double)DQK)); /* the fp32 scale the kernels get */
        tu_from_dtype(MLA_DTYPE_BF16, bq + row * krow, q, krow);
        ref_mha(1, &one, &vis, H, H, DQK, DV, scale, 0.0, 0, q, k, v, o, l);
        ref_mha(1, &one, &vis, H, H, DQK, DV, scale, 0.0, 0, q, k, va, p, lp);
        cmp_row(&w2, oc + row * H * DV, lc + row * H, o, l, p, H, &dot2, &m1, &m2);
        rows++;
      }
      free(k), free(v), free(va), free(q), free(o), free(p), free(l), free(lp);
    }
    w2.cos = m1 > 0 && m2 > 0 ? 1.0 - dot2 / sqrt(m1 * m2) : 1.0;
    TU_CHECK(w2.bad == 0 && w2.lbad == 0 && w2.nonfinite == 0 && w2.cos < 1e-5,
             "%s: chunked vs float64 oracle on %d rows: %lld values and %lld LSEs out of bounds, %lld non-finite "
             "(max err %.3g, err/bound %.3g, lse err %.3g, cos dist %.3g)",
             name, rows, (long long)w2.bad, (long long)w2.lbad, (long long)w2.nonfinite, w2.out, w2.out_ratio,
             w2.lse, w2.cos);
    printf("  %s: chunked vs one-shot (all %d rows): max |err| %.3g (err/bound %.3f), max lse err %.3g, cos dist "
           "%.2e\n",
           name, T, w1.out, w1.out_ratio, w1.lse, w1.cos);
    printf("  %s: chunked vs float64 oracle (%d sampled rows): max |err| %.3g (err/bound %.3f), max lse err %.3g, "
           "cos dist %.2e\n",
           name, rows, w2.out, w2.out_ratio, w2.lse, w2.cos);
    free(k1), free(v1), free(oc), free(lc), free(o1), free(l1), free(pa);
    for (int s = 0; s <= nc; s++) cudaFree(d_po[s]), cudaFree(d_pl[s]);
    free(d_po), free(d_pl);
    cudaFree(d_cslots), cudaFree(d_ccu), cudaFree(d_cc), cudaFree(d_cr), cudaFree(d_ck), cudaFree(d_cv);
    cudaFree(d_k1), cudaFree(d_v1), cudaFree(d_ke), cudaFree(d_ve);
    cudaFree(d_oc), cudaFree(d_lc), cudaFree(d_o1), cudaFree(d_l1), cudaFree(d_pa), cudaFree(d_la);
  }
  free(cws), free(slots), free(hc), free(hr), free(bc), free(br), free(bw), free(bq);
  cudaFree(d_slots), cudaFree(d_c), cudaFree(d_r), cudaFree(d_w), cudaFree(d_q), cudaFree(d_qo), cudaFree(d_kvp);
  cudaFree(d_gc), cudaFree(d_gr), cudaFree(d_ki), cudaFree(d_vi);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_chunked: skipped: no GPU\n");
    return tu_finish("test_cuda_chunked");
  }
  rng.s = tu_seed("test_cuda_chunked", 20261207);
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 0, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  TU_CHECK(st == MLA_OK, "CUDA context: %s", mla_status_string(st));
  if (st != MLA_OK) return tu_finish("test_cuda_chunked");
  static const ccase cases[] = {
      /* name, cache, page, H, bs, max prefix, max extend, chunk capacity, pairwise */
      {"bf16 page 64", MLA_DTYPE_BF16, 64, 16, 6, 4096, 300, 2048, 0},
      {"fp8 page 64", MLA_DTYPE_FP8_E4M3, 64, 16, 6, 4096, 300, 3072, 1},
      {"bf16 page 1", MLA_DTYPE_BF16, 1, 16, 5, 4096, 300, 4000, 1},
      {"fp8 page 1", MLA_DTYPE_FP8_E4M3, 1, 16, 5, 2500, 300, 1500, 0},
      {"fp8 page 64 H=128 small", MLA_DTYPE_FP8_E4M3, 64, 128, 3, 600, 100, 300, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_chunked");
}
#endif
