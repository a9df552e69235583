/* mla_attention_absorbed on a CUDA context for the cache formats and page
 * sizes beyond bf16 / page >= 8 (docs/decode-kernel.md section 9): fp8 e4m3
 * per-tensor and block-scaled caches (dequantized inside the kernel, bf16
 * activations), f16 caches with f16 activations, and page sizes 1, 2, 4
 * (cp.async row gather), against the float64 oracle:
 * every new dtype (f16, fp8, fp8-block) x page sizes {1, 2, 4, 16, 64} x
 * H {1, 16, 128} x DECODE and TARGET_VERIFY (2 draft tokens), plus bf16 at
 * page sizes {1, 2, 4}. Each batch holds a ~1600-key request (split into
 * pieces: the combine runs), a zero-length one (decode) and random ones.
 *
 * Setup as tests/test_cuda_attention.c: the cache is written on a CPU
 * context (quantized there: src/core/convert.h), every row no request owns is
 * 0xFF (NaN in every format, block scales included), block-table entries past
 * each request are TU_SENTINEL, and the GPU cache gets the CPU cache's bytes.
 * Outputs poisoned, with guards after them.
 *
 * Oracle inputs: the CPU's dequantization (mla_kv_cache_read) rounded to the
 * kernel's operand type: bf16 for bf16 and both fp8 caches (the kernel
 * dequantizes e4m3 * scale in fp32 and rounds once to bf16), f16 for f16;
 * not rounded where the ring kernel runs a per-tensor fp8 cache (<= 16 rows
 * per m-block, page >= 8: e4m3 values exact as f16 operands, the scale applied
 * to the scores and the output; exact_fp8 below). One such case has q times
 * 2^20 (past f16's range: the kernel must scale Q before converting it).
 * Tolerance as test_cuda_attention: |o - round(ref)| <= 8e-4 + 2/128 |ref| +
 * u sum_j p_j |c_j| with u = 2^-8 (P rounded to bf16) or 2^-11 (P in f16),
 * cosine distance < 5e-6, lse 1e-5 abs + 1e-5 rel, -inf with no key.
 * Bit-exactness of the dequantization: in DECODE batches two requests have a
 * single key, so their output is that key's latent row as the kernel holds
 * it (P = 1, l = 1); it must equal the CPU's dequantization rounded to the
 * operand type bit for bit (NaN aside: none there).
 * Also the refusals (fp8 cache or bf16 cache with f16 activations, f16 cache
 * with bf16 activations: UNSUPPORTED, outputs untouched). Skips (passing)
 * without CUDA or without a GPU. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "paged_world.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_decode_dtypes: skipped: built without CUDA\n");
  return tu_finish("test_cuda_decode_dtypes");
}
#else
#include "cuda_util.h"

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5
#define GUARD 64 /* poisoned 4-byte elements after every output */
#define MAXB 8
#define NPAD 5
#define NTHREADS 8 /* oracle threads */

static const double SCALE = 0.0721687836; /* 192^-0.5 */
static tu_rng rng;
static mla_ctx *cpu, *gpu;

typedef struct world {
  mla_mode mode;
  mla_dtype kv, act;
  float kv_scale; /* FP8_E4M3 layer scale */
  int ndt, P, H, bs;
  int q_log2; /* q scaled by 2^q_log2 (exact in bf16) */
  mla_kv_cache *cache;  /* CPU */
  mla_kv_cache *dcache; /* GPU, same bytes */
  mla_req_table *rt;
  int32_t req_ids[MAXB], seq[MAXB];
  int q_len[MAXB], kv_len[MAXB];
  int Tq, Tk;
  void *pws;
  mla_plan plan;
  void *qn, *qr; /* act dtype [Tq, H, 512], [Tq, H, 64] */
  double *qn_d, *qr_d, *c_d, *r_d, *o_ref, *lse_ref, *pbound;
  double p_unit; /* unit roundoff of P: 2^-8 (bf16) or 2^-11 (f16) */
} world;

static const char *dt_name(mla_dtype t) {
  switch (t) {
    case MLA_DTYPE_BF16: return "bf16";
    case MLA_DTYPE_F16: return "f16";
    case MLA_DTYPE_FP8_E4M3: return "fp8";
    case MLA_DTYPE_FP8_E4M3_BLOCK: return "fp8-block";
    default: return "?";
  }
}

/* Whether the ring kernel runs this case with exact e4m3 operands
 * (src/cuda/decode_sm90.cu launch_mode: per-tensor fp8, page >= 8, query
 * tokens x heads <= 16; MLA_DECODE_LEGACY=1 routes it to the older kernel). */
static int exact_fp8(const world *w) {
  const char *legacy = getenv("MLA_DECODE_LEGACY");
  const int q = w->mode == MLA_MODE_TARGET_VERIFY ? w->ndt : 1;
  return w->kv == MLA_DTYPE_FP8_E4M3 && w->P >= 8 && q * w->H <= 16 && !(legacy && legacy[0] && legacy[0] != '0');
}

static void case_str(const world *w, char *buf, size_t n) {
  snprintf(buf, n, "%s kv=%s act=%s P=%d H=%d bs=%d q*2^%d%s", w->mode == MLA_MODE_DECODE ? "decode" : "verify",
           dt_name(w->kv), dt_name(w->act), w->P, w->H, w->bs, w->q_log2, exact_fp8(w) ? " (exact fp8)" : "");
}

/* The kernel's operand type for keys of this cache (F32: not rounded). */
static mla_dtype operand_dtype(const world *w) {
  if (exact_fp8(w)) return MLA_DTYPE_F32;
  return w->kv == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16;
}

static int world_build(world *w) {
  /* request 0 long (the schedule splits it), request 1 empty (decode) or the
   * shortest verify, requests 2 and 3 a single key (decode), the rest random */
  for (int i = 0; i < w->bs; i++) {
    int kv = i == 0 ? tu_randint(&rng, 1550, 1750) : i == 1 ? 0 : tu_randint(&rng, 1, 300);
    if (w->mode == MLA_MODE_DECODE && (i == 2 || i == 3)) kv = 1;
    if (w->mode == MLA_MODE_DECODE) {
      w->seq[i] = kv;
      w->q_len[i] = 1;
      w->kv_len[i] = kv;
    } else {
      w->seq[i] = kv > w->ndt ? kv - w->ndt : 0;
      w->q_len[i] = w->ndt;
      w->kv_len[i] = w->seq[i] + w->ndt;
    }
  }
  int pages = 2 + NPAD, maxkv = 1;
  for (int i = 0; i < w->bs; i++) {
    pages += (w->kv_len[i] + w->P - 1) / w->P;
    w->Tq += w->q_len[i];
    w->Tk += w->kv_len[i];
    if (w->kv_len[i] > maxkv) maxkv = w->kv_len[i];
  }
  mla_kv_cache_desc cd = {1, pages, w->P, w->kv, w->kv == MLA_DTYPE_FP8_E4M3 ? &w->kv_scale : NULL};
  mla_req_table_desc rd = {w->bs + NPAD, maxkv, pages, w->P};
  if (mla_kv_cache_create(cpu, &cd, &w->cache) != MLA_OK || mla_kv_cache_create(gpu, &cd, &w->dcache) != MLA_OK ||
      mla_req_table_create(cpu, &rd, w->cache, &w->rt) != MLA_OK) {
    TU_CHECK(0, "cannot create caches / table: %s / %s", mla_ctx_last_error(cpu), mla_ctx_last_error(gpu));
    return -1;
  }
  tu_poison_cache(w->cache);
  /* pages handed out shuffled, requests grown interleaved; their rows:
   * c, r ~ N(0, 1), quantized by the CPU cache; the oracle reads the CPU's
   * dequantization rounded to the kernel's operand type */
  const int cap = 2 * w->P < 64 ? 64 : 2 * w->P;
  if (tu_grow_requests(&rng, w->rt, w->bs, w->kv_len, NPAD, w->P, cap, w->req_ids) ||
      tu_fill_owned_rows(&rng, w->cache, w->rt, w->bs, w->req_ids, w->kv_len, maxkv, operand_dtype(w), &w->c_d,
                         &w->r_d))
    return -1;
  /* the GPU cache: the CPU cache's bytes (owned rows and NaN rows alike) */
  tu_cache_to_device(w->cache, w->dcache, (size_t)pages * w->P);
  mla_batch *b = calloc(1, sizeof *b);
  b->mode = w->mode;
  b->batch_size = w->bs;
  b->req_ids = w->req_ids;
  b->seq_lens = w->seq;
  if (w->mode == MLA_MODE_TARGET_VERIFY) b->num_draft_tokens = w->ndt;
  mla_plan_limits lim = {w->bs, w->Tq + 1, w->Tk + 1, maxkv, w->P, 132, 0};
  size_t pb = 0;
  TU_STATUS(mla_plan_workspace_size(cpu, &lim, &pb), MLA_OK);
  w->pws = malloc(pb);
  mla_status st = mla_plan_build(cpu, w->rt, b, &lim, w->H, w->pws, pb, &w->plan);
  free(b);
  TU_CHECK(st == MLA_OK, "mla_plan_build: %s", mla_ctx_last_error(cpu));
  if (st != MLA_OK) return -1;
  tu_guard_block_table(&w->plan, w->bs, w->kv_len, w->P);
  /* q in the activation dtype */
  tu_make_q(&rng, w->act, (int64_t)w->Tq * w->H, 0, &w->qn, &w->qr, &w->qn_d, &w->qr_d);
  if (w->q_log2) { /* a power of two: the act-dtype values stay exact */
    const int64_t n[2] = {(int64_t)w->Tq * w->H * MLA_LATENT, (int64_t)w->Tq * w->H * MLA_ROPE};
    void *q[2] = {w->qn, w->qr};
    double *qd[2] = {w->qn_d, w->qr_d};
    float *tmp = malloc(sizeof(float) * (size_t)(n[0] + 1));
    for (int part = 0; part < 2; part++) {
      for (int64_t i = 0; i < n[part]; i++) tmp[i] = (float)ldexp(qd[part][i], w->q_log2);
      tu_to_dtype(w->act, tmp, q[part], n[part]);
      tu_from_dtype(w->act, q[part], qd[part], n[part]);
    }
    free(tmp);
  }
  w->p_unit = w->act == MLA_DTYPE_F16 || exact_fp8(w) ? 1.0 / 2048.0 : 1.0 / 256.0;
  return 0;
}

/* ---- oracle: ref_absorbed per (request, 8-head slice), threaded, and per
 * element the P-rounding bound p_unit sum_j p_j |c_j[d]| ---------------------- */
typedef struct oracle_job {
  world *w;
  int n_items;
  int item_req[MAXB * 16], item_h0[MAXB * 16];
  atomic_int next;
} oracle_job;

static void oracle_item(world *w, int req, int h0) {
  const int H = w->H, nh = H - h0 < 8 ? H - h0 : 8;
  int64_t t0 = 0, k0 = 0;
  for (int i = 0; i < req; i++) {
    t0 += w->q_len[i];
    k0 += w->kv_len[i];
  }
  const int Q = w->q_len[req], K = w->kv_len[req];
  const double sc = (double)(float)SCALE;
  double *qn = malloc(sizeof(double) * (size_t)Q * nh * MLA_LATENT + 8);
  double *qr = malloc(sizeof(double) * (size_t)Q * nh * MLA_ROPE + 8);
  double *o = malloc(sizeof(double) * (size_t)Q * nh * MLA_LATENT + 8);
  double *lse = malloc(sizeof(double) * (size_t)Q * nh + 8);
  double *s = malloc(sizeof(double) * (size_t)(K + 1));
  for (int t = 0; t < Q; t++)
    for (int h = 0; h < nh; h++) {
      const int64_t row = (t0 + t) * H + h0 + h;
      memcpy(qn + ((size_t)t * nh + h) * MLA_LATENT, w->qn_d + row * MLA_LATENT, sizeof(double) * MLA_LATENT);
      memcpy(qr + ((size_t)t * nh + h) * MLA_ROPE, w->qr_d + row * MLA_ROPE, sizeof(double) * MLA_ROPE);
    }
  ref_absorbed(1, &Q, &K, nh, sc, w->plan.causal, qn, qr, w->c_d + k0 * MLA_LATENT, w->r_d + k0 * MLA_ROPE, o, lse);
  for (int t = 0; t < Q; t++)
    for (int h = 0; h < nh; h++) {
      const int64_t row = (t0 + t) * H + h0 + h;
      memcpy(w->o_ref + row * MLA_LATENT, o + ((size_t)t * nh + h) * MLA_LATENT, sizeof(double) * MLA_LATENT);
      w->lse_ref[row] = lse[(size_t)t * nh + h];
      const int vis = w->plan.causal ? K - Q + t + 1 : K;
      if (vis <= 0) continue;
      tu_row_softmax(qn + ((size_t)t * nh + h) * MLA_LATENT, qr + ((size_t)t * nh + h) * MLA_ROPE,
                     w->c_d + k0 * MLA_LATENT, w->r_d + k0 * MLA_ROPE, vis, sc, s);
      tu_p_round_bound(s, w->c_d + k0 * MLA_LATENT, vis, w->p_unit, w->pbound + row * MLA_LATENT);
    }
  free(qn);
  free(qr);
  free(o);
  free(lse);
  free(s);
}

static void *oracle_thread(void *arg) {
  oracle_job *j = arg;
  for (;;) {
    const int it = atomic_fetch_add(&j->next, 1);
    if (it >= j->n_items) return NULL;
    oracle_item(j->w, j->item_req[it], j->item_h0[it]);
  }
}

static void oracle(world *w) {
  const int64_t nq = (int64_t)w->Tq * w->H;
  w->o_ref = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  w->lse_ref = malloc(sizeof(double) * (size_t)(nq + 1));
  w->pbound = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  static oracle_job job; /* one oracle at a time */
  job.w = w;
  job.n_items = 0;
  atomic_store(&job.next, 0);
  for (int i = 0; i < w->bs; i++) /* the long request first: it bounds the wall time */
    for (int h0 = 0; h0 < w->H; h0 += 8) {
      job.item_req[job.n_items] = i;
      job.item_h0[job.n_items++] = h0;
    }
  pthread_t th[NTHREADS];
  int started = 0;
  for (int t = 0; t < NTHREADS; t++)
    if (pthread_create(&th[t], NULL, oracle_thread, &job) == 0) started++;
    else break;
  if (started == 0) oracle_thread(&job);
  for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
}

static void world_free(world *w) {
  mla_req_table_destroy(w->rt);
  mla_kv_cache_destroy(w->cache);
  mla_kv_cache_destroy(w->dcache);
  free(w->pws);
  free(w->qn);
  free(w->qr);
  free(w->qn_d);
  free(w->qr_d);
  free(w->c_d);
  free(w->r_d);
  free(w->o_ref);
  free(w->lse_ref);
  free(w->pbound);
}

typedef struct dbufs {
  void *qn, *qr, *o, *ws;
  float *lse;
  size_t o_bytes, lse_bytes, ws_bytes;
} dbufs;

static dbufs dbufs_new(const world *w) {
  dbufs d;
  const int64_t nq = (int64_t)w->Tq * w->H;
  d.qn = tu_dev_copy(w->qn, 2 * (size_t)nq * MLA_LATENT);
  d.qr = tu_dev_copy(w->qr, 2 * (size_t)nq * MLA_ROPE);
  d.o_bytes = 2 * (size_t)nq * MLA_LATENT;
  d.lse_bytes = sizeof(float) * (size_t)nq;
  d.o = tu_dev_alloc(d.o_bytes + GUARD * 4);
  d.lse = tu_dev_alloc(d.lse_bytes + GUARD * 4);
  d.ws_bytes = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w->plan, w->H, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  CK(cudaMemset(d.o, 0xFF, d.o_bytes + GUARD * 4));
  CK(cudaMemset(d.lse, 0xFF, d.lse_bytes + GUARD * 4));
  CK(cudaDeviceSynchronize()); /* the library's stream may be a non-blocking one */
  return d;
}

static void dbufs_free(dbufs *d) {
  cudaFree(d->qn);
  cudaFree(d->qr);
  cudaFree(d->o);
  cudaFree(d->lse);
  cudaFree(d->ws);
}

static mla_absorbed_args args_for(const world *w, dbufs *d, int base2) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = (float)SCALE;
  a.act_dtype = w->act;
  a.q_nope = d->qn;
  a.q_rope = d->qr;
  a.out = d->o;
  a.lse = d->lse;
  a.flags = base2 ? MLA_FLAG_LSE_BASE2 : 0;
  return a;
}

static void check(const world *w, dbufs *d, int base2) {
  char cs[160];
  case_str(w, cs, sizeof cs);
  const int64_t nq = (int64_t)w->Tq * w->H, no = nq * MLA_LATENT;
  unsigned char *ob = malloc(d->o_bytes + GUARD * 4), *lb = malloc(d->lse_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d->o, d->o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lb, d->lse, d->lse_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  double *got = malloc(sizeof(double) * (size_t)(no + 1)), *ref = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(w->act, ob, got, no);
  for (int64_t i = 0; i < no; i++) ref[i] = tu_round_to(w->act, w->o_ref[i]);
  ref_cmp c = ref_compare(got, ref, no, O_ATOL, O_RTOL);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < no; i++) {
    const double err = fabs(got[i] - ref[i]);
    if (!(err <= O_ATOL + O_RTOL * fabs(ref[i]) + w->pbound[i])) {
      if (first < 0) first = i;
      bad++;
    }
  }
  TU_CHECK(bad == 0 && c.nonfinite_mismatch == 0 && c.cos_dist <= MAX_COS,
           "%s o: %lld bad (design tol: %lld), %lld nonfinite mismatches of %lld (first %lld: got %g ref %g "
           "bound %g) cos %.3g",
           cs, (long long)bad, (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)no, (long long)first,
           first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0, first >= 0 ? w->pbound[first] : 0.0,
           c.cos_dist);
  TU_CHECK(tu_all_poisoned(ob + d->o_bytes, GUARD * 4), "%s: out written past its end", cs);
  /* single-key requests: out = that key's latent as the kernel holds it */
  if (w->mode == MLA_MODE_DECODE) {
    int64_t t0 = 0, k0 = 0, nexact = 0, miss = 0;
    for (int i = 0; i < w->bs; i++) {
      if (w->kv_len[i] == 1)
        for (int h = 0; h < w->H; h++)
          for (int dd = 0; dd < MLA_LATENT; dd++) {
            nexact++;
            const double g = got[(t0 * w->H + h) * MLA_LATENT + dd];
            const double want = tu_round_to(w->act, w->c_d[k0 * MLA_LATENT + dd]);
            if (!(g == want)) {
              if (miss == 0)
                fprintf(stderr, "%s: request %d head %d dim %d: got %.9g, dequantized %.9g\n", cs, i, h, dd, g, want);
              miss++;
            }
          }
      t0 += w->q_len[i];
      k0 += w->kv_len[i];
    }
    TU_CHECK(nexact > 0 && miss == 0, "%s: %lld of %lld single-key outputs differ from the dequantized row", cs,
             (long long)miss, (long long)nexact);
  }
  const float *l = (const float *)lb;
  for (int64_t i = 0; i < nq; i++) {
    got[i] = l[i];
    ref[i] = (double)(float)(w->lse_ref[i] * (base2 ? 1.4426950408889634 : 1.0));
  }
  c = ref_compare(got, ref, nq, LSE_ATOL, LSE_RTOL);
  TU_CHECK(c.bad == 0 && c.nonfinite_mismatch == 0,
           "%s lse: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g)", cs, (long long)c.bad,
           (long long)c.nonfinite_mismatch, (long long)nq, (long long)c.first_bad,
           c.first_bad >= 0 ? got[c.first_bad] : 0.0, c.first_bad >= 0 ? ref[c.first_bad] : 0.0);
  TU_CHECK(tu_all_poisoned(lb + d->lse_bytes, GUARD * 4), "%s: lse written past its end", cs);
  free(ob);
  free(lb);
  free(got);
  free(ref);
}

static int case_no;

static void run_case(mla_mode mode, mla_dtype kv, int P, int H, int q_log2) {
  world w;
  memset(&w, 0, sizeof w);
  w.q_log2 = q_log2;
  w.mode = mode;
  w.kv = kv;
  w.act = kv == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16;
  /* per-tensor scale: N(0, 1) / scale stays inside e4m3's +-448 mostly, the
   * tail saturates (the CPU quantizer's business; the oracle reads back) */
  w.kv_scale = (float)(0.004 + 0.02 * tu_uniform(&rng));
  w.ndt = mode == MLA_MODE_TARGET_VERIFY ? 2 : 0;
  w.P = P;
  w.H = H;
  w.bs = H >= 64 ? tu_randint(&rng, 4, 5) : tu_randint(&rng, 4, 7);
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  oracle(&w);
  char cs[160];
  case_str(&w, cs, sizeof cs);
  dbufs d = dbufs_new(&w);
  const int base2 = case_no++ & 1;
  mla_absorbed_args a = args_for(&w, &d, base2);
  mla_status st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, base2);
  dbufs_free(&d);
  world_free(&w);
}

/* Refused combinations: UNSUPPORTED with a message naming the dtypes, and
 * the output untouched. */
static void refusals(void) {
  world w;
  memset(&w, 0, sizeof w);
  w.mode = MLA_MODE_DECODE;
  w.kv = MLA_DTYPE_BF16;
  w.act = MLA_DTYPE_BF16;
  w.P = 16;
  w.H = 16;
  w.bs = 4;
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  dbufs d = dbufs_new(&w);
  const int pages = (int)(w.plan.block_table_width * w.bs + 2 + NPAD);
  const mla_dtype kvs[3] = {MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK, MLA_DTYPE_BF16};
  for (int k = 0; k < 3; k++) { /* f16 activations with an fp8 or bf16 cache */
    mla_kv_cache_desc cd = {1, pages, 16, kvs[k], NULL};
    mla_kv_cache *c = NULL;
    TU_STATUS(mla_kv_cache_create(gpu, &cd, &c), MLA_OK);
    mla_absorbed_args a = args_for(&w, &d, 0);
    a.act_dtype = MLA_DTYPE_F16;
    TU_STATUS(mla_attention_absorbed(gpu, c, 0, &w.plan, &a, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
    TU_CHECK(strstr(mla_ctx_last_error(gpu), "f16") != NULL, "%s cache, f16 act: message %s", dt_name(kvs[k]),
             mla_ctx_last_error(gpu));
    mla_kv_cache_destroy(c);
  }
  { /* an f16 cache with bf16 activations */
    mla_kv_cache_desc cd = {1, pages, 16, MLA_DTYPE_F16, NULL};
    mla_kv_cache *c = NULL;
    TU_STATUS(mla_kv_cache_create(gpu, &cd, &c), MLA_OK);
    mla_absorbed_args a = args_for(&w, &d, 0);
    TU_STATUS(mla_attention_absorbed(gpu, c, 0, &w.plan, &a, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
    mla_kv_cache_destroy(c);
  }
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  unsigned char *ob = malloc(d.o_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d.o, d.o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(ob, d.o_bytes + GUARD * 4), "a refused call wrote the output");
  free(ob);
  dbufs_free(&d);
  world_free(&w);
}

int main(int argc, char **argv) {
  rng.s = tu_seed("test_cuda_decode_dtypes", 43);
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  if (st == MLA_ERR_DEVICE) {
    printf("test_cuda_decode_dtypes: skipped: no GPU (%s)\n", mla_status_string(st));
    return tu_finish("test_cuda_decode_dtypes");
  }
  TU_STATUS(st, MLA_OK);
  if (!gpu) return tu_finish("test_cuda_decode_dtypes");
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  /* "--small": a case per new load path (for compute-sanitizer) */
  const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  if (small) {
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 1, 16, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 1, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 16, 16, 20); /* ring kernel, small pages */
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3_BLOCK, 16, 128, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_F16, 64, 128, 0);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_BF16, 2, 16, 0);
  } else {
    const mla_dtype dts[4] = {MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK, MLA_DTYPE_F16, MLA_DTYPE_BF16};
    const int Ps[5] = {1, 2, 4, 16, 64}, Hs[3] = {1, 16, 128};
    for (int di = 0; di < 4; di++)
      for (int pi = 0; pi < 5; pi++) {
        if (dts[di] == MLA_DTYPE_BF16 && Ps[pi] >= 8) continue; /* test_cuda_attention's */
        for (int hi = 0; hi < 3; hi++)
          for (int mi = 0; mi < 2; mi++)
            run_case(mi ? MLA_MODE_TARGET_VERIFY : MLA_MODE_DECODE, dts[di], Ps[pi], Hs[hi], 0);
      }
    /* q past f16's range: the ring kernel's f16 Q (both page classes, 1 and
     * 16 rows), and the bf16-operand kernels for comparison */
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 16, 20);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 16, 16, 20);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 1, 20);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 16, 20);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3_BLOCK, 64, 16, 20);
  }
  refusals();
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_decode_dtypes");
}
#endif
