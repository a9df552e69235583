/* mla_attention_absorbed on a CUDA context (the sm_90a decode kernels behind
 * the public call) against the float64 oracle: DECODE and TARGET_VERIFY (2
 * draft tokens) x heads 16, 128, 3 x page sizes 64 and 16, varlen batches
 * with a zero-length request and a ~2000-key one (the split schedule cuts it
 * into pieces and the combine runs).
 *
 * Setup as tests/test_cpu_absorbed.c: a bf16 cache and request table on a CPU
 * context (pages handed out shuffled, every unowned row NaN, block-table
 * entries past each request TU_SENTINEL), planned on the host; the GPU cache
 * gets the CPU cache's layer bytes, so both hold the same rows and the same
 * NaN. Outputs poisoned (0xFF) with guard elements after them.
 *
 * Tolerance (docs/decode-kernel.md section 5, as the kernel harness): per
 * element |o - bf16(ref)| <= 8e-4 + 2/128 |ref| + 2^-8 sum_j p_j |c_j| (the
 * bound of rounding P to bf16 before P V), cosine distance < 5e-6, lse within
 * 1e-5 abs + 1e-5 rel, -inf where no key is visible. Also: packed strided q
 * with a NULL lse, the base-2 LSE flag, and the refusals (f16 cache with bf16
 * activations, f32 activations: UNSUPPORTED; a page-size-4 cache with this
 * page-64 plan, host pointers: INVALID_ARGUMENT; outputs untouched). Other
 * dtypes and small pages: tests/test_cuda_decode_dtypes.c. Skips (passing)
 * without CUDA or without a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "paged_world.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_attention: skipped: built without CUDA\n");
  return tu_finish("test_cuda_attention");
}
#else
#include "cuda_util.h"

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5
#define GUARD 64 /* poisoned 4-byte elements after every output */
#define MAXB 16
#define NPAD 9

static const double SCALE = 0.0721687836; /* 192^-0.5 */
static tu_rng rng;
static mla_ctx *cpu, *gpu;

typedef struct world {
  mla_mode mode;
  int ndt, P, H, bs;
  mla_kv_cache *cache;  /* CPU */
  mla_kv_cache *dcache; /* GPU, same bytes */
  mla_req_table *rt;
  int32_t req_ids[MAXB], seq[MAXB];
  int q_len[MAXB], kv_len[MAXB];
  int Tq, Tk;
  void *pws;
  mla_plan plan;
  void *qn, *qr; /* bf16 [Tq, H, 512], [Tq, H, 64] */
  double *qn_d, *qr_d, *c_d, *r_d, *o_ref, *lse_ref, *pbound;
} world;

static void case_str(const world *w, char *buf, size_t n) {
  snprintf(buf, n, "%s ndt=%d P=%d H=%d bs=%d", w->mode == MLA_MODE_DECODE ? "decode" : "verify", w->ndt, w->P,
           w->H, w->bs);
}

static int world_build(world *w) {
  /* lengths: request 0 is long (splits), request 1 empty (decode) or the
   * shortest verify, the rest random */
  for (int i = 0; i < w->bs; i++) {
    int kv = i == 0 ? tu_randint(&rng, 1900, 2100) : i == 1 ? 0 : tu_randint(&rng, 1, 300);
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
  mla_kv_cache_desc cd = {1, pages, w->P, MLA_DTYPE_BF16, NULL};
  mla_req_table_desc rd = {w->bs + NPAD, maxkv, pages, w->P};
  if (mla_kv_cache_create(cpu, &cd, &w->cache) != MLA_OK || mla_kv_cache_create(gpu, &cd, &w->dcache) != MLA_OK ||
      mla_req_table_create(cpu, &rd, w->cache, &w->rt) != MLA_OK) {
    TU_CHECK(0, "cannot create caches / table: %s / %s", mla_ctx_last_error(cpu), mla_ctx_last_error(gpu));
    return -1;
  }
  tu_poison_cache(w->cache);
  /* scattered free list, interleaved growth; the rows the requests own:
   * c, r ~ N(0, 1), stored as bf16 */
  if (tu_grow_requests(&rng, w->rt, w->bs, w->kv_len, NPAD, w->P, 2 * w->P, w->req_ids) ||
      tu_fill_owned_rows(&rng, w->cache, w->rt, w->bs, w->req_ids, w->kv_len, maxkv, MLA_DTYPE_F32, &w->c_d, &w->r_d))
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
  /* q: bf16 */
  tu_make_q(&rng, MLA_DTYPE_BF16, (int64_t)w->Tq * w->H, 1, &w->qn, &w->qr, &w->qn_d, &w->qr_d);
  return 0;
}

/* Oracle, and per element the bf16-P rounding bound 2^-8 sum_j p_j |c_j[d]|
 * (softmax weights in float64, bottom-right causal as the plan says). */
static void oracle(world *w) {
  const int H = w->H;
  const int64_t nq = (int64_t)w->Tq * H;
  w->o_ref = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_LATENT);
  w->lse_ref = malloc(sizeof(double) * (size_t)(nq + 1));
  w->pbound = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  const double sc = (double)(float)SCALE;
  ref_absorbed(w->bs, w->q_len, w->kv_len, H, sc, w->plan.causal, w->qn_d, w->qr_d, w->c_d, w->r_d, w->o_ref,
               w->lse_ref);
  double *s = malloc(sizeof(double) * 4096);
  int64_t t0 = 0, k0 = 0;
  for (int i = 0; i < w->bs; i++) {
    const int Q = w->q_len[i], K = w->kv_len[i];
    for (int t = 0; t < Q; t++)
      for (int h = 0; h < H; h++) {
        const int64_t row = (t0 + t) * H + h;
        const int vis = w->plan.causal ? K - Q + t + 1 : K;
        if (vis <= 0) continue;
        tu_row_softmax(w->qn_d + row * MLA_LATENT, w->qr_d + row * MLA_ROPE, w->c_d + k0 * MLA_LATENT,
                       w->r_d + k0 * MLA_ROPE, vis, sc, s);
        tu_p_round_bound(s, w->c_d + k0 * MLA_LATENT, vis, 0.00390625, w->pbound + row * MLA_LATENT);
      }
    t0 += Q;
    k0 += K;
  }
  free(s);
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

/* Device buffers of one run: q (plain or packed [T, H, 576]), out, lse with
 * poisoned guards, workspace. */
typedef struct dbufs {
  void *qn, *qr, *qpk, *o, *ws;
  float *lse;
  size_t o_bytes, lse_bytes, ws_bytes;
} dbufs;

static dbufs dbufs_new(const world *w) {
  dbufs d;
  const int64_t nq = (int64_t)w->Tq * w->H;
  d.qn = tu_dev_alloc(2 * (size_t)nq * MLA_LATENT);
  d.qr = tu_dev_alloc(2 * (size_t)nq * MLA_ROPE);
  CK(cudaMemcpy(d.qn, w->qn, 2 * (size_t)nq * MLA_LATENT, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.qr, w->qr, 2 * (size_t)nq * MLA_ROPE, cudaMemcpyHostToDevice));
  /* packed [T, H, 576]: nope then rope of each (token, head) */
  uint16_t *pk = malloc(2 * (size_t)(nq + 1) * MLA_ROW);
  for (int64_t r = 0; r < nq; r++) {
    memcpy(pk + r * MLA_ROW, (const uint16_t *)w->qn + r * MLA_LATENT, 2 * MLA_LATENT);
    memcpy(pk + r * MLA_ROW + MLA_LATENT, (const uint16_t *)w->qr + r * MLA_ROPE, 2 * MLA_ROPE);
  }
  d.qpk = tu_dev_alloc(2 * (size_t)nq * MLA_ROW);
  CK(cudaMemcpy(d.qpk, pk, 2 * (size_t)nq * MLA_ROW, cudaMemcpyHostToDevice));
  free(pk);
  d.o_bytes = 2 * (size_t)nq * MLA_LATENT;
  d.lse_bytes = sizeof(float) * (size_t)nq;
  d.o = tu_dev_alloc(d.o_bytes + GUARD * 4);
  d.lse = tu_dev_alloc(d.lse_bytes + GUARD * 4);
  d.ws_bytes = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w->plan, w->H, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  return d;
}

static void dbufs_poison(dbufs *d) {
  CK(cudaMemset(d->o, 0xFF, d->o_bytes + GUARD * 4));
  CK(cudaMemset(d->lse, 0xFF, d->lse_bytes + GUARD * 4));
  CK(cudaDeviceSynchronize()); /* the library's stream may be a non-blocking one */
}

static void dbufs_free(dbufs *d) {
  cudaFree(d->qn);
  cudaFree(d->qr);
  cudaFree(d->qpk);
  cudaFree(d->o);
  cudaFree(d->lse);
  cudaFree(d->ws);
}

static mla_absorbed_args args_for(const world *w, dbufs *d) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = (float)SCALE;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = d->qn;
  a.q_rope = d->qr;
  a.out = d->o;
  a.lse = d->lse;
  return a;
}

/* Copies the outputs back, checks them against the oracle and the guards. */
static void check(const world *w, dbufs *d, int with_lse, int base2, const char *tag) {
  char cs[128];
  case_str(w, cs, sizeof cs);
  const int64_t nq = (int64_t)w->Tq * w->H, no = nq * MLA_LATENT;
  unsigned char *ob = malloc(d->o_bytes + GUARD * 4), *lb = malloc(d->lse_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d->o, d->o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lb, d->lse, d->lse_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  double *got = malloc(sizeof(double) * (size_t)(no + 1)), *ref = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(MLA_DTYPE_BF16, ob, got, no);
  for (int64_t i = 0; i < no; i++) ref[i] = tu_round_to(MLA_DTYPE_BF16, w->o_ref[i]);
  /* cosine distance and the non-finite pattern from ref_compare; the element
   * test with the bf16-P bound here */
  ref_cmp c = ref_compare(got, ref, no, O_ATOL, O_RTOL);
  int64_t bad = 0, design = c.bad, first = -1;
  for (int64_t i = 0; i < no; i++) {
    const double err = fabs(got[i] - ref[i]);
    if (!(err <= O_ATOL + O_RTOL * fabs(ref[i]) + w->pbound[i])) {
      if (first < 0) first = i;
      bad++;
    }
  }
  TU_CHECK(bad == 0 && c.nonfinite_mismatch == 0 && c.cos_dist <= MAX_COS,
           "%s [%s] o: %lld bad (design tol: %lld), %lld nonfinite mismatches of %lld (first %lld: got %g ref %g "
           "bound %g) cos %.3g",
           cs, tag, (long long)bad, (long long)design, (long long)c.nonfinite_mismatch, (long long)no,
           (long long)first, first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0,
           first >= 0 ? w->pbound[first] : 0.0, c.cos_dist);
  TU_CHECK(tu_all_poisoned(ob + d->o_bytes, GUARD * 4), "%s [%s]: out written past its end", cs, tag);
  if (with_lse) {
    const float *l = (const float *)lb;
    for (int64_t i = 0; i < nq; i++) {
      got[i] = l[i];
      ref[i] = (double)(float)(w->lse_ref[i] * (base2 ? 1.4426950408889634 : 1.0));
    }
    c = ref_compare(got, ref, nq, LSE_ATOL, LSE_RTOL);
    TU_CHECK(c.bad == 0 && c.nonfinite_mismatch == 0,
             "%s [%s] lse: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g)", cs, tag,
             (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)nq, (long long)c.first_bad,
             c.first_bad >= 0 ? got[c.first_bad] : 0.0, c.first_bad >= 0 ? ref[c.first_bad] : 0.0);
    TU_CHECK(tu_all_poisoned(lb + d->lse_bytes, GUARD * 4), "%s [%s]: lse written past its end", cs, tag);
  } else {
    TU_CHECK(tu_all_poisoned(lb, d->lse_bytes + GUARD * 4), "%s [%s]: lse written although NULL", cs, tag);
  }
  free(ob);
  free(lb);
  free(got);
  free(ref);
}

static void run_case(mla_mode mode, int ndt, int P, int H) {
  world w;
  memset(&w, 0, sizeof w);
  w.mode = mode;
  w.ndt = ndt;
  w.P = P;
  w.H = H;
  w.bs = tu_randint(&rng, 4, 7);
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  oracle(&w);
  char cs[128];
  case_str(&w, cs, sizeof cs);
  dbufs d = dbufs_new(&w);
  /* plain q, natural-log lse */
  dbufs_poison(&d);
  mla_absorbed_args a = args_for(&w, &d);
  mla_status st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 1, 0, "plain");
  /* base-2 lse */
  dbufs_poison(&d);
  a.flags = MLA_FLAG_LSE_BASE2;
  st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: base2: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 1, 1, "lse base 2");
  /* packed strided q, no lse */
  dbufs_poison(&d);
  a.flags = 0;
  a.q_nope = d.qpk;
  a.q_rope = (const uint16_t *)d.qpk + MLA_LATENT;
  a.q_stride_token = (int64_t)H * MLA_ROW;
  a.q_stride_head = MLA_ROW;
  a.lse = NULL;
  st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: strided: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 0, 0, "strided q, NULL lse");
  dbufs_free(&d);
  world_free(&w);
}

/* Refusals: status, message, outputs untouched. */
static void refusals(void) {
  world w;
  memset(&w, 0, sizeof w);
  w.mode = MLA_MODE_DECODE;
  w.P = 64;
  w.H = 16;
  w.bs = 4;
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  dbufs d = dbufs_new(&w);
  dbufs_poison(&d);
  mla_absorbed_args a = args_for(&w, &d);
  /* f16 cache (bf16 activations: refused) and page size 4 (taken by the
   * kernels since the small-page gather path, so this page-64 plan no longer
   * matches it) */
  const int pages = (int)(w.plan.block_table_width * w.bs + 2 + NPAD);
  mla_kv_cache_desc f16d = {1, pages, 64, MLA_DTYPE_F16, NULL}, p4d = {1, pages * 16, 4, MLA_DTYPE_BF16, NULL};
  mla_kv_cache *f16c = NULL, *p4c = NULL;
  TU_STATUS(mla_kv_cache_create(gpu, &f16d, &f16c), MLA_OK);
  TU_STATUS(mla_kv_cache_create(gpu, &p4d, &p4c), MLA_OK);
  TU_STATUS(mla_attention_absorbed(gpu, f16c, 0, &w.plan, &a, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "bf16") != NULL, "f16 cache message: %s", mla_ctx_last_error(gpu));
  TU_STATUS(mla_attention_absorbed(gpu, p4c, 0, &w.plan, &a, d.ws, d.ws_bytes), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "page size") != NULL, "page size message: %s", mla_ctx_last_error(gpu));
  mla_absorbed_args b = a;
  b.act_dtype = MLA_DTYPE_F32;
  TU_STATUS(mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &b, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "act_dtype") != NULL, "act message: %s", mla_ctx_last_error(gpu));
  /* host pointers */
  b = a;
  b.q_nope = w.qn;
  TU_STATUS(mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &b, d.ws, d.ws_bytes), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "q_nope") != NULL, "host q message: %s", mla_ctx_last_error(gpu));
  void *hws = malloc(d.ws_bytes);
  TU_STATUS(mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, hws, d.ws_bytes), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "workspace") != NULL, "host ws message: %s", mla_ctx_last_error(gpu));
  free(hws);
  TU_STATUS(mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes - 1),
            MLA_ERR_WORKSPACE_TOO_SMALL);
  /* a CPU (host) cache on the CUDA context */
  TU_STATUS(mla_attention_absorbed(gpu, w.cache, 0, &w.plan, &a, d.ws, d.ws_bytes), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  unsigned char *ob = malloc(d.o_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d.o, d.o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(ob, d.o_bytes + GUARD * 4), "a refused call wrote the output");
  free(ob);
  mla_kv_cache_destroy(f16c);
  mla_kv_cache_destroy(p4c);
  dbufs_free(&d);
  world_free(&w);
}

int main(void) {
  rng.s = tu_seed("test_cuda_attention", 41);
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  if (st == MLA_ERR_DEVICE) {
    printf("test_cuda_attention: skipped: no GPU (%s)\n", mla_status_string(st));
    return tu_finish("test_cuda_attention");
  }
  TU_STATUS(st, MLA_OK);
  if (!gpu) return tu_finish("test_cuda_attention");
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  const int Hs[3] = {16, 128, 3}, Ps[2] = {64, 16};
  for (int mi = 0; mi < 2; mi++)
    for (int hi = 0; hi < 3; hi++)
      for (int pi = 0; pi < 2; pi++)
        run_case(mi ? MLA_MODE_TARGET_VERIFY : MLA_MODE_DECODE, mi ? 2 : 0, Ps[pi], Hs[hi]);
  refusals();
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_attention");
}
#endif
