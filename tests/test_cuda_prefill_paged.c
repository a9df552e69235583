/* The paged absorbed prefill on a CUDA context: mla_attention_absorbed over
 * host plans of EXTEND batches with a cached prefix, and of varlen
 * DRAFT_EXTEND batches, against a float64 oracle.
 *
 * Grid: prefixes 0 .. ~16K keys, extends 0 .. 300 tokens, page sizes 1 and 64
 * (plus 16 for f16), heads 1, 3, 16, 128, bf16 / f16 / fp8 per-tensor / fp8
 * block-scaled caches. Long query sides are what this path adds over decode:
 * a request of Q tokens x H heads is Q*H kernel rows cut into 64-row
 * m-blocks, the split rule gives such plans one part (nothing cut, no partial
 * states, no combine), and short-query batches (DRAFT_EXTEND) still split.
 *
 * Setup as tests/test_cuda_decode_dtypes.c: cache written on a CPU context
 * (quantized there), every row no request owns NaN, pages handed out in a
 * shuffled order, block-table entries past each request TU_SENTINEL, the GPU
 * cache gets the CPU cache's bytes; outputs poisoned with guards after them.
 *
 * The oracle is float64 on sampled rows (first and last token of every
 * request, random tokens between, up to 4 heads each, all heads for H <= 4):
 * a 16K-key prefix times every (token, head) row would be minutes of float64
 * on the host. Every other output row is checked to be written (finite), the
 * guards untouched. Oracle inputs: the CPU's dequantization rounded to the
 * kernel's operand type. Tolerance as test_cuda_attention: |o - ref| <= 8e-4
 * + 2/128 |ref| + u sum_j p_j |c_j| (u = 2^-8 for bf16 P, 2^-11 for f16), lse
 * within 1e-4 + 1e-5 |lse| (fp32 sums over up to 16K keys).
 *
 * Also: the workspace of such a plan holds no partial states (its size is
 * far below one partial state per request), and a request too long for the
 * grid is refused (UNSUPPORTED) with the outputs untouched. Skips (passing)
 * without CUDA or without a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "decode_world.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_prefill_paged: skipped: built without CUDA\n");
  return tu_finish("test_cuda_prefill_paged");
}
#else
#include "cuda_util.h"

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define LSE_ATOL 1e-4
#define LSE_RTOL 1e-5
#define GUARD 64 /* poisoned 4-byte elements after every output */
#define MAXB 8
#define NPAD 7
#define SAMPLE_TOKENS 6

static const double SCALE = 0.0721687836; /* 192^-0.5 */
static tu_rng rng;
static mla_ctx *cpu, *gpu;

typedef struct pcase {
  const char *name;
  mla_mode mode; /* EXTEND (prefix + extend) or DRAFT_EXTEND (varlen) */
  mla_dtype kv, act;
  int P, H, bs;
  int prefix[MAXB], ext[MAXB];
} pcase;

typedef struct world {
  tu_dworld d; /* c_d, r_d: the rows as the kernel's operands */
  const pcase *c;
} world;
_Static_assert(MAXB <= TU_DW_MAXB, "MAXB");

static mla_dtype operand_of(mla_dtype kv) { return kv == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16; }

static int world_build(world *w, const pcase *c, int with_q) {
  memset(w, 0, sizeof *w);
  w->c = c;
  tu_dworld *d = &w->d;
  d->mode = c->mode;
  d->kv = c->kv;
  d->kv_scale = 0.5f; /* fp8 per-tensor: stored = value / scale */
  d->P = c->P;
  d->H = c->H;
  d->bs = c->bs;
  for (int i = 0; i < c->bs; i++) {
    d->kv_len[i] = c->prefix[i] + c->ext[i];
    d->q_len[i] = d->ext[i] = c->ext[i];
    d->pre[i] = c->prefix[i];
    d->seq[i] = d->kv_len[i];
  }
  const int pages = tu_dworld_totals(d, NPAD);
  if (tu_dworld_create(d, cpu, gpu, pages, NPAD)) return -1;
  /* free pages handed out in a shuffled order, requests grown interleaved;
   * the rows they own: c, r ~ N(0, 1), quantized by the CPU cache */
  if (tu_grow_requests(&rng, d->rt, c->bs, d->kv_len, NPAD, c->P, 3 * c->P + 40, d->req_ids) ||
      tu_fill_owned_rows(&rng, d->cache, d->rt, c->bs, d->req_ids, d->kv_len, d->maxkv, operand_of(c->kv), &d->c_d,
                         &d->r_d))
    return -1;
  tu_cache_to_device(d->cache, d->dcache, (size_t)pages * c->P);
  /* pages only: what a GPU consumer plans (the kernels read the block table) */
  d->plan_flags = MLA_PLAN_PAGES_ONLY;
  if (tu_dworld_plan(d, cpu, 132)) return -1;
  tu_guard_block_table(&d->plan, c->bs, d->kv_len, c->P);
  if (!with_q) return 0;
  tu_make_q(&rng, c->act, d->Tq * c->H, 1, &d->qn, &d->qr, &d->qn_d, &d->qr_d);
  return 0;
}

static void world_free(world *w) { tu_dworld_free(&w->d); }

/* Float64 attention of one (token, head) row: o [512], lse (natural), and the
 * P-rounding bound per element. Returns the visible key count. */
static int oracle_row(const world *w, int64_t k0, int K, int Q, int t, int64_t row, double *o, double *lse,
                      double *bound, double *s) {
  const double sc = (double)(float)SCALE;
  const double u = operand_of(w->c->kv) == MLA_DTYPE_F16 ? 1.0 / 2048 : 1.0 / 256;
  const int vis = K - Q + t + 1; /* causal, bottom-right */
  const double *c = w->d.c_d + k0 * MLA_LATENT;
  *lse = tu_row_softmax(w->d.qn_d + row * MLA_LATENT, w->d.qr_d + row * MLA_ROPE, c, w->d.r_d + k0 * MLA_ROPE, vis,
                        sc, s);
  for (int d = 0; d < MLA_LATENT; d++) o[d] = bound[d] = 0;
  for (int j = 0; j < vis; j++)
    for (int d = 0; d < MLA_LATENT; d++) o[d] += s[j] * c[(size_t)j * MLA_LATENT + d];
  tu_p_round_bound(s, c, vis, u, bound);
  return vis;
}

static void run_case(const pcase *c) {
  world w;
  if (world_build(&w, c, 1) != 0) {
    world_free(&w);
    return;
  }
  const int H = c->H;
  const int64_t nq = w.d.Tq * H;
  const size_t es = tu_act_size(c->act);
  const size_t ob = es * (size_t)nq * MLA_LATENT, lb = sizeof(float) * (size_t)nq;
  void *dqn = tu_dev_copy(w.d.qn, es * (size_t)(nq ? nq : 1) * MLA_LATENT);
  void *dqr = tu_dev_copy(w.d.qr, es * (size_t)(nq ? nq : 1) * MLA_ROPE);
  void *dout = tu_dev_alloc(ob + 4 * GUARD);
  float *dlse = tu_dev_alloc(lb + 4 * GUARD);
  CK(cudaMemset(dout, 0xFF, ob + 4 * GUARD));
  CK(cudaMemset(dlse, 0xFF, lb + 4 * GUARD));
  size_t wsb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w.d.plan, H, &wsb), MLA_OK);
  void *dws = tu_dev_alloc(wsb ? wsb : 16);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = (float)SCALE;
  a.act_dtype = c->act;
  a.q_nope = dqn;
  a.q_rope = dqr;
  a.out = dout;
  a.lse = dlse;
  mla_status st = mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, dws, wsb);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s", c->name, mla_ctx_last_error(gpu));
  CK(cudaDeviceSynchronize());
  unsigned char *out = malloc(ob + 4 * GUARD);
  float *lse = malloc(lb + 4 * GUARD);
  CK(cudaMemcpy(out, dout, ob + 4 * GUARD, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, dlse, lb + 4 * GUARD, cudaMemcpyDeviceToHost));

  /* every row written, guards untouched */
  double *got = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_LATENT);
  tu_from_dtype(c->act, out, got, nq * MLA_LATENT);
  int64_t unwritten = 0;
  for (int64_t i = 0; i < nq * MLA_LATENT; i++) unwritten += !isfinite(got[i]);
  for (int64_t i = 0; i < nq; i++) unwritten += !isfinite(lse[i]); /* every row sees >= 1 key */
  TU_CHECK(unwritten == 0, "%s: %lld output / lse elements not written (still poisoned)", c->name,
           (long long)unwritten);
  TU_CHECK(tu_all_poisoned(out + ob, 4 * GUARD) && tu_all_poisoned((unsigned char *)lse + lb, 4 * GUARD),
           "%s: guard elements after out / lse overwritten", c->name);

  /* sampled rows against the float64 oracle */
  double o[MLA_LATENT], bound[MLA_LATENT], lref;
  int maxk = 1;
  for (int i = 0; i < c->bs; i++)
    if (w.d.kv_len[i] > maxk) maxk = w.d.kv_len[i];
  double *s = malloc(sizeof(double) * (size_t)maxk);
  int64_t t0 = 0, k0 = 0, rows = 0, bad = 0, lbad = 0;
  double worst = 0, lworst = 0;
  for (int i = 0; i < c->bs; i++) {
    const int Q = w.d.ext[i], K = w.d.kv_len[i];
    for (int n = 0; n < SAMPLE_TOKENS && n < Q; n++) {
      const int t = n == 0 ? 0 : n == 1 ? Q - 1 : tu_randint(&rng, 0, Q - 1);
      for (int m = 0; m < (H <= 4 ? H : 4); m++) {
        const int h = H <= 4 ? m : m == 0 ? 0 : m == 1 ? H - 1 : tu_randint(&rng, 1, H - 2);
        const int64_t row = (t0 + t) * H + h;
        oracle_row(&w, k0, K, Q, t, row, o, &lref, bound, s);
        rows++;
        for (int d = 0; d < MLA_LATENT; d++) {
          const double e = fabs(got[row * MLA_LATENT + d] - o[d]);
          const double tol = O_ATOL + O_RTOL * fabs(o[d]) + bound[d];
          if (!(e <= tol)) bad++;
          if (e / tol > worst) worst = e / tol;
        }
        const double le = fabs((double)lse[row] - lref);
        if (!(le <= LSE_ATOL + LSE_RTOL * fabs(lref))) lbad++;
        if (le > lworst) lworst = le;
      }
    }
    t0 += Q;
    k0 += K;
  }
  TU_CHECK(bad == 0 && lbad == 0 && rows > 0,
           "%s: %lld sampled rows: %lld elements out of tolerance (worst err/tol %.3g), %lld lse off (worst %.3g)",
           c->name, (long long)rows, (long long)bad, worst, (long long)lbad, lworst);
  printf("  %-44s P=%-3d H=%-3d Tq=%-5lld Tk=%-6lld parts=%-3d splits=%d ws=%zu B: %lld rows, worst err/tol %.3f, "
         "lse err %.2g\n",
         c->name, c->P, H, (long long)w.d.Tq, (long long)w.d.Tk, (int)w.d.plan.num_sm_parts,
                            (int)w.d.plan.total_splits, wsb,
         (long long)rows, worst, lworst);
  /* a one-part plan keeps no partial states: far below one per request */
  if (w.d.plan.num_sm_parts == 1)
    TU_CHECK(wsb < (size_t)c->bs * w.d.plan.max_q_len * H * MLA_LATENT * sizeof(float),
             "%s: one-part plan, workspace %zu bytes holds partial states", c->name, wsb);
  free(s);
  free(got);
  free(out);
  free(lse);
  cudaFree(dqn);
  cudaFree(dqr);
  cudaFree(dout);
  cudaFree(dlse);
  cudaFree(dws);
  world_free(&w);
}

/* A request with more (token, head) rows than the kernels' grid takes is
 * refused before any launch, outputs untouched. The plan is a shape only
 * (the check precedes any launch: q buffers of a few KiB stand in). */
static void too_long(void) {
  pcase c = {"too long", MLA_MODE_EXTEND, MLA_DTYPE_BF16, MLA_DTYPE_BF16, 64, 128, 1, {0}, {32768}};
  world w;
  if (world_build(&w, &c, 0) != 0) {
    world_free(&w);
    return;
  }
  void *dqn = tu_dev_alloc(1 << 16), *dqr = tu_dev_alloc(1 << 16);
  void *dout = tu_dev_alloc(2 * 64);
  CK(cudaMemset(dout, 0xFF, 2 * 64));
  size_t wsb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w.d.plan, 128, &wsb), MLA_OK);
  void *dws = tu_dev_alloc(wsb);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = 128;
  a.scale = (float)SCALE;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = dqn;
  a.q_rope = dqr;
  a.out = dout;
  TU_STATUS(mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, dws, wsb), MLA_ERR_UNSUPPORTED);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "max_q_len") != NULL, "too long: message names the bound: %s",
           mla_ctx_last_error(gpu));
  unsigned char chk[128];
  CK(cudaMemcpy(chk, dout, sizeof chk, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(chk, sizeof chk), "too long: output touched after a refusal");
  printf("  refusal: %s\n", mla_ctx_last_error(gpu));
  cudaFree(dqn);
  cudaFree(dqr);
  cudaFree(dout);
  cudaFree(dws);
  world_free(&w);
}

int main(int argc, char **argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_prefill_paged: skipped: no GPU\n");
    return tu_finish("test_cuda_prefill_paged");
  }
  rng.s = tu_seed("test_cuda_prefill_paged", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 0, 0}, gd = {MLA_DEVICE_CUDA, 0, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  TU_STATUS(mla_ctx_create(&gd, &gpu), MLA_OK);
  const mla_dtype B = MLA_DTYPE_BF16, F = MLA_DTYPE_F16, E = MLA_DTYPE_FP8_E4M3, EB = MLA_DTYPE_FP8_E4M3_BLOCK;
  const mla_mode X = MLA_MODE_EXTEND, D = MLA_MODE_DRAFT_EXTEND;
  /* prefix / extend per request; a random part added below */
  pcase cases[] = {
      {"extend H=128 long prefix", X, B, B, 64, 128, 3, {16000, 0, 3000}, {40, 300, 1}},
      {"extend H=128 page 1", X, B, B, 1, 128, 2, {5000, 700}, {64, 129}},
      {"extend H=16 page 1, a zero extend", X, B, B, 1, 16, 3, {16300, 0, 900}, {100, 250, 0}},
      {"extend H=16 page 64", X, B, B, 64, 16, 4, {0, 64, 4095, 12000}, {200, 64, 33, 7}},
      {"extend H=1", X, B, B, 64, 1, 4, {8000, 1, 0, 333}, {300, 5, 100, 64}},
      {"extend H=3", X, B, B, 64, 3, 3, {2000, 0, 10}, {77, 190, 1}},
      {"extend f16 cache page 16", X, F, F, 16, 16, 3, {6000, 0, 100}, {90, 120, 20}},
      {"extend fp8 per-tensor", X, E, B, 64, 16, 3, {9000, 0, 200}, {50, 160, 3}},
      {"extend fp8 block-scaled H=128", X, EB, B, 64, 128, 2, {4000, 0}, {48, 100}},
      {"extend fp8 block-scaled page 1", X, EB, B, 1, 16, 3, {3000, 10, 0}, {30, 2, 150}},
      {"draft extend varlen H=16", D, B, B, 64, 16, 6, {900, 2500, 40, 0, 7000, 1}, {1, 4, 2, 3, 1, 2}},
      {"draft extend varlen H=128 page 1", D, B, B, 1, 128, 4, {3000, 100, 0, 600}, {3, 1, 2, 4}},
  };
  /* "small": the compute-sanitizer run (small shapes: one part, many parts
   * with cut requests, page 1, fp8 block) */
  const pcase small_cases[] = {
      {"small extend", X, B, B, 64, 16, 2, {100, 0}, {20, 40}},
      {"small extend page 1 H=128", X, B, B, 1, 128, 2, {70, 5}, {3, 2}},
      {"small draft extend fp8 block", D, EB, B, 64, 16, 3, {200, 1, 30}, {1, 2, 3}},
  };
  const int small = argc > 1 && strcmp(argv[1], "small") == 0;
  const pcase *list = small ? small_cases : cases;
  const int nc = small ? 3 : (int)(sizeof cases / sizeof cases[0]);
  for (int k = 0; k < nc; k++) {
    pcase c = list[k];
    for (int i = 0; i < c.bs; i++) /* a random part, keeping zero / tiny lengths as they are */
      if (c.prefix[i] > 100) c.prefix[i] += tu_randint(&rng, 0, 60);
    run_case(&c);
  }
  if (!small) too_long();
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_prefill_paged");
}
#endif
