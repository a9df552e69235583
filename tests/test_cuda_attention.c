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
#include "decode_world.h"
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

typedef tu_dworld world;
_Static_assert(MAXB <= TU_DW_MAXB, "MAXB");

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
  /* a bf16 cache, bf16 activations */
  w->kv = w->act = MLA_DTYPE_BF16;
  w->scale = (float)SCALE;
  w->p_unit = 0.00390625;
  const int pages = tu_dworld_totals(w, NPAD), maxkv = w->maxkv;
  if (tu_dworld_create(w, cpu, gpu, pages, NPAD)) return -1;
  /* scattered free list, interleaved growth; the rows the requests own:
   * c, r ~ N(0, 1), stored as bf16 */
  if (tu_grow_requests(&rng, w->rt, w->bs, w->kv_len, NPAD, w->P, 2 * w->P, w->req_ids) ||
      tu_fill_owned_rows(&rng, w->cache, w->rt, w->bs, w->req_ids, w->kv_len, maxkv, MLA_DTYPE_F32, &w->c_d, &w->r_d))
    return -1;
  /* the GPU cache: the CPU cache's bytes (owned rows and NaN rows alike) */
  tu_cache_to_device(w->cache, w->dcache, (size_t)pages * w->P);
  if (tu_dworld_plan(w, cpu, 132)) return -1;
  tu_guard_block_table(&w->plan, w->bs, w->kv_len, w->P);
  /* q: bf16 */
  tu_make_q(&rng, MLA_DTYPE_BF16, (int64_t)w->Tq * w->H, 1, &w->qn, &w->qr, &w->qn_d, &w->qr_d);
  return 0;
}

/* q packed [T, H, 576] on the device: nope then rope of each (token, head). */
static void *packed_q(const world *w) {
  const int64_t nq = w->Tq * w->H;
  uint16_t *pk = malloc(2 * (size_t)(nq + 1) * MLA_ROW);
  for (int64_t r = 0; r < nq; r++) {
    memcpy(pk + r * MLA_ROW, (const uint16_t *)w->qn + r * MLA_LATENT, 2 * MLA_LATENT);
    memcpy(pk + r * MLA_ROW + MLA_LATENT, (const uint16_t *)w->qr + r * MLA_ROPE, 2 * MLA_ROPE);
  }
  void *d = tu_dev_copy(pk, 2 * (size_t)nq * MLA_ROW);
  free(pk);
  return d;
}

/* Copies the outputs back, checks them against the oracle and the guards. */
static void check(const world *w, tu_dbufs *d, int with_lse, int base2, const char *tag) {
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
    tu_dworld_free(&w);
    return;
  }
  tu_dworld_oracle(&w, 1);
  char cs[128];
  case_str(&w, cs, sizeof cs);
  tu_dbufs d = tu_dbufs_new(&w, gpu, GUARD * 4);
  void *qpk = packed_q(&w);
  /* plain q, natural-log lse */
  tu_dbufs_poison(&d);
  mla_absorbed_args a = tu_dworld_args(&w, d.qn, d.qr, d.o, d.lse);
  mla_status st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 1, 0, "plain");
  /* base-2 lse */
  tu_dbufs_poison(&d);
  a.flags = MLA_FLAG_LSE_BASE2;
  st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: base2: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 1, 1, "lse base 2");
  /* packed strided q, no lse */
  tu_dbufs_poison(&d);
  a.flags = 0;
  a.q_nope = qpk;
  a.q_rope = (const uint16_t *)qpk + MLA_LATENT;
  a.q_stride_token = (int64_t)H * MLA_ROW;
  a.q_stride_head = MLA_ROW;
  a.lse = NULL;
  st = mla_attention_absorbed(gpu, w.dcache, 0, &w.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: strided: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 0, 0, "strided q, NULL lse");
  cudaFree(qpk);
  tu_dbufs_free(&d);
  tu_dworld_free(&w);
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
    tu_dworld_free(&w);
    return;
  }
  tu_dbufs d = tu_dbufs_new(&w, gpu, GUARD * 4);
  tu_dbufs_poison(&d);
  mla_absorbed_args a = tu_dworld_args(&w, d.qn, d.qr, d.o, d.lse);
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
  tu_dbufs_free(&d);
  tu_dworld_free(&w);
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
