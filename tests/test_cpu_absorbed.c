/* CPU absorbed MLA kernel (mla_attention_absorbed) against the float64
 * oracle, over the DESIGN section 7 grid: every mode (DECODE, TARGET_VERIFY
 * with 1/2/4 draft tokens, DRAFT_EXTEND varlen and fixed window, EXTEND over
 * a prefix) x cache dtype (bf16, f16, fp8 per-tensor with scale != 1, fp8
 * block) x page size (1, 16, 64, 128) x heads (1, 3, 16, 128), varlen batches
 * with zero lengths.
 *
 * Hostile setup: pages handed out in shuffled order (padding requests freed
 * in random order first), every cache row NaN except the rows requests own,
 * block-table entries past each request set to TU_SENTINEL after planning,
 * outputs poisoned before each run with guard elements after them. The
 * oracle runs on the dequantized cache rows (read back with
 * mla_kv_cache_read) and on the activations as the kernel sees them, and is
 * rounded to the output dtype before comparing.
 *
 * Also: strided q (one packed [T, H, 576] buffer), the base-2 LSE flag, a
 * NULL lse, 1 vs 2 threads bit-identical, every SIMD build the machine has,
 * mla_gather_latent, and every bad-argument path (status, message, output
 * untouched). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/cpu.h" /* white box: mla_cpu_set_isa */
#include "mla.h"
#include "ref.h"
#include "decode_world.h"
#include "test_util.h"

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5
#define GUARD 64 /* poisoned elements after every output */
#define MAXB 64
#define NPAD 9

static tu_rng rng;
static mla_ctx *ctx2, *ctx1; /* 2 threads, 1 thread */

/* ---- one batch in a real cache / request table / plan -------------------- */

typedef struct acase {
  mla_mode mode;
  int ndt;    /* TARGET_VERIFY draft tokens, DRAFT_EXTEND fixed window (0 = varlen) */
  mla_dtype cdt;
  int P, H, bs, maxkv;
  mla_dtype act;
} acase;

typedef struct world {
  tu_dworld d; /* lengths, cache, table, plan, q, oracle */
  acase c;
  mla_batch batch;
  mla_plan_limits lim;
} world;
_Static_assert(MAXB <= TU_DW_MAXB, "MAXB");

static const char *mode_name(mla_mode m) {
  switch (m) {
    case MLA_MODE_DECODE: return "decode";
    case MLA_MODE_TARGET_VERIFY: return "verify";
    case MLA_MODE_DRAFT_EXTEND: return "draft_extend";
    case MLA_MODE_EXTEND: return "extend";
    default: return "idle";
  }
}

static void case_str(const acase *c, char *buf, size_t n) {
  snprintf(buf, n, "%s ndt=%d cache=%s P=%d H=%d bs=%d act=%s", mode_name(c->mode), c->ndt,
           mla_dtype_name(c->cdt), c->P, c->H, c->bs, mla_dtype_name(c->act));
}

/* Lengths of the batch: zero lengths on purpose, as the modes allow. */
static void make_lengths(world *w) {
  const acase *c = &w->c;
  for (int i = 0; i < c->bs; i++) {
    const int zero = tu_uniform(&rng) < 0.15;
    int kv = zero ? 0 : tu_randint(&rng, 1, c->maxkv);
    switch (c->mode) {
      case MLA_MODE_DECODE:
        w->d.seq[i] = kv;
        w->d.q_len[i] = 1;
        w->d.kv_len[i] = kv;
        break;
      case MLA_MODE_TARGET_VERIFY:
        w->d.seq[i] = kv > c->ndt ? kv - c->ndt : 0;
        w->d.q_len[i] = c->ndt;
        w->d.kv_len[i] = w->d.seq[i] + c->ndt;
        break;
      case MLA_MODE_DRAFT_EXTEND:
        w->d.seq[i] = kv;
        w->d.ext[i] = c->ndt ? c->ndt : tu_randint(&rng, 0, 5);
        w->d.q_len[i] = w->d.ext[i];
        w->d.kv_len[i] = kv;
        break;
      default: { /* EXTEND with a prefix: at most 24 new tokens */
        int e = tu_randint(&rng, 0, kv < 24 ? kv : 24);
        w->d.seq[i] = kv;
        w->d.pre[i] = kv - e;
        w->d.q_len[i] = e;
        w->d.kv_len[i] = kv;
        break;
      }
    }
  }
}

static int world_build(world *w, const acase *c) {
  memset(w, 0, sizeof *w);
  w->c = *c;
  make_lengths(w);
  int pages = 2 + NPAD, maxkv = 1;
  for (int i = 0; i < c->bs; i++) {
    pages += (w->d.kv_len[i] + c->P - 1) / c->P;
    w->d.Tq += w->d.q_len[i];
    w->d.Tk += w->d.kv_len[i];
    if (w->d.kv_len[i] > maxkv) maxkv = w->d.kv_len[i];
  }
  float fp8_scale = 0.0371f;
  mla_kv_cache_desc cd = {1, pages, c->P, c->cdt, c->cdt == MLA_DTYPE_FP8_E4M3 ? &fp8_scale : NULL};
  mla_req_table_desc rd = {c->bs + NPAD, maxkv, pages, c->P};
  if (mla_kv_cache_create(ctx2, &cd, &w->d.cache) != MLA_OK ||
      mla_req_table_create(ctx2, &rd, w->d.cache, &w->d.rt) != MLA_OK) {
    TU_CHECK(0, "cannot create cache / table: %s", mla_ctx_last_error(ctx2));
    return -1;
  }
  tu_poison_cache(w->d.cache);

  /* Scattered free list, interleaved growth, random rows (c, r ~ N(0,1) in
   * f32: the cache quantizes them; the oracle sees what the cache holds). */
  if (tu_grow_requests(&rng, w->d.rt, c->bs, w->d.kv_len, NPAD, c->P, 2 * c->P, w->d.req_ids) ||
      tu_fill_owned_rows(&rng, w->d.cache, w->d.rt, c->bs, w->d.req_ids, w->d.kv_len, maxkv, MLA_DTYPE_F32,
                         &w->d.c_d, &w->d.r_d))
    return -1;

  /* plan */
  mla_batch *b = &w->batch;
  b->mode = c->mode;
  b->batch_size = c->bs;
  b->req_ids = w->d.req_ids;
  b->seq_lens = w->d.seq;
  if (c->mode == MLA_MODE_TARGET_VERIFY) b->num_draft_tokens = c->ndt;
  if (c->mode == MLA_MODE_DRAFT_EXTEND) {
    if (c->ndt) b->num_draft_tokens = c->ndt;
    else b->extend_lens = w->d.ext;
  }
  if (c->mode == MLA_MODE_EXTEND) b->prefix_lens = w->d.pre;
  mla_plan_limits lim = {c->bs, w->d.Tq + 1, w->d.Tk + 1, maxkv, c->P, 2, 0};
  w->lim = lim;
  size_t pb = 0;
  TU_STATUS(mla_plan_workspace_size(ctx2, &lim, &pb), MLA_OK);
  w->d.pws = malloc(pb);
  mla_status st = mla_plan_build(ctx2, w->d.rt, b, &lim, c->H, w->d.pws, pb, &w->d.plan);
  TU_CHECK(st == MLA_OK, "mla_plan_build: %s", mla_ctx_last_error(ctx2));
  if (st != MLA_OK) return -1;
  /* The kernel must never read block-table entries past a request. */
  tu_guard_block_table(&w->d.plan, c->bs, w->d.kv_len, c->P);
  /* q: bf16-representable, in the activation dtype; the oracle reads it back */
  tu_make_q(&rng, c->act, (int64_t)w->d.Tq * c->H, 1, &w->d.qn, &w->d.qr, &w->d.qn_d, &w->d.qr_d);
  return 0;
}

static void world_free(world *w) { tu_dworld_free(&w->d); }

static const double SCALE = 0.0721687836; /* 192^-0.5: never assume 576^-0.5 */

static void oracle(world *w) {
  const int64_t nq = (int64_t)w->d.Tq * w->c.H;
  w->d.o_ref = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_LATENT);
  w->d.lse_ref = malloc(sizeof(double) * (size_t)(nq + 1));
  ref_absorbed(w->c.bs, w->d.q_len, w->d.kv_len, w->c.H, (double)(float)SCALE, w->d.plan.causal,
               w->d.qn_d, w->d.qr_d, w->d.c_d, w->d.r_d, w->d.o_ref, w->d.lse_ref);
}

/* Output buffers with GUARD poisoned elements after them. */
typedef struct outs {
  void *o;
  float *lse;
  size_t o_bytes, lse_bytes; /* payload, without the guard */
} outs;

static outs outs_new(const world *w) {
  outs b;
  const int64_t nq = (int64_t)w->d.Tq * w->c.H;
  b.o_bytes = tu_act_size(w->c.act) * (size_t)nq * MLA_LATENT;
  b.lse_bytes = sizeof(float) * (size_t)nq;
  b.o = malloc(b.o_bytes + GUARD * 4);
  b.lse = malloc(b.lse_bytes + GUARD * 4);
  tu_poison(b.o, b.o_bytes + GUARD * 4);
  tu_poison(b.lse, b.lse_bytes + GUARD * 4);
  return b;
}

static void outs_free(outs *b) {
  free(b->o);
  free(b->lse);
}

static mla_absorbed_args args_for(const world *w, outs *b) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->c.H;
  a.scale = (float)SCALE;
  a.act_dtype = w->c.act;
  a.q_nope = w->d.qn;
  a.q_rope = w->d.qr;
  a.out = b->o;
  a.lse = b->lse;
  return a;
}

static mla_status run(mla_ctx *ctx, const world *w, const mla_absorbed_args *a) {
  size_t bytes = 0;
  mla_status st = mla_attention_absorbed_workspace_size(ctx, &w->d.plan, a->num_heads, &bytes);
  if (st != MLA_OK) return st;
  void *ws = malloc(bytes);
  st = mla_attention_absorbed(ctx, w->d.cache, 0, &w->d.plan, a, ws, bytes);
  free(ws);
  return st;
}

static void check_against_oracle(const world *w, const outs *b, int base2, const char *tag) {
  char cs[160];
  case_str(&w->c, cs, sizeof cs);
  const int64_t nq = (int64_t)w->d.Tq * w->c.H, no = nq * MLA_LATENT;
  double *got = malloc(sizeof(double) * (size_t)(no + 1));
  double *ref = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(w->c.act, b->o, got, no);
  for (int64_t i = 0; i < no; i++) ref[i] = tu_round_to(w->c.act, w->d.o_ref[i]);
  ref_cmp c = ref_compare(got, ref, no, O_ATOL, O_RTOL);
  TU_CHECK(ref_cmp_ok(&c, MAX_COS),
           "%s [%s] o: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g) "
           "max abs %.3g cos %.3g",
           cs, tag, (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)no,
           (long long)c.first_bad, c.first_bad >= 0 ? got[c.first_bad] : 0.0,
           c.first_bad >= 0 ? ref[c.first_bad] : 0.0, c.max_abs_err, c.cos_dist);
  for (int64_t i = 0; i < nq; i++) {
    got[i] = b->lse[i];
    ref[i] = (double)(float)(w->d.lse_ref[i] * (base2 ? 1.4426950408889634 : 1.0));
  }
  c = ref_compare(got, ref, nq, LSE_ATOL, LSE_RTOL);
  TU_CHECK(c.bad == 0 && c.nonfinite_mismatch == 0,
           "%s [%s] lse: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g)",
           cs, tag, (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)nq,
           (long long)c.first_bad, c.first_bad >= 0 ? got[c.first_bad] : 0.0,
           c.first_bad >= 0 ? ref[c.first_bad] : 0.0);
  TU_CHECK(tu_all_poisoned((char *)b->o + b->o_bytes, GUARD * 4) &&
               tu_all_poisoned((char *)b->lse + b->lse_bytes, GUARD * 4),
           "%s [%s]: wrote past the end of out / lse", cs, tag);
  free(got);
  free(ref);
}

/* Extra checks on some cases: strided q, base 2, lse NULL, 1 thread. */
static void variants(const world *w, const outs *b0) {
  char cs[160];
  case_str(&w->c, cs, sizeof cs);
  const int H = w->c.H;
  const int64_t nq = (int64_t)w->d.Tq * H;
  const size_t es = tu_act_size(w->c.act);
  { /* strided q: one packed [T, H, 576] buffer, q_rope = q_nope + 512 */
    unsigned char *packed = malloc(es * (size_t)(nq + 1) * MLA_ROW);
    for (int64_t i = 0; i < nq; i++) {
      memcpy(packed + es * (size_t)i * MLA_ROW, (char *)w->d.qn + es * (size_t)i * MLA_LATENT,
             es * MLA_LATENT);
      memcpy(packed + es * ((size_t)i * MLA_ROW + MLA_LATENT),
             (char *)w->d.qr + es * (size_t)i * MLA_ROPE, es * MLA_ROPE);
    }
    outs b = outs_new(w);
    mla_absorbed_args a = args_for(w, &b);
    a.q_nope = packed;
    a.q_rope = packed + es * MLA_LATENT;
    a.q_stride_token = (int64_t)H * MLA_ROW;
    a.q_stride_head = MLA_ROW;
    TU_STATUS(run(ctx2, w, &a), MLA_OK);
    TU_CHECK(!memcmp(b.o, b0->o, b.o_bytes) && !memcmp(b.lse, b0->lse, b.lse_bytes),
             "%s: strided q differs from packed q", cs);
    outs_free(&b);
    free(packed);
  }
  { /* base-2 LSE: same o, lse * log2(e) */
    outs b = outs_new(w);
    mla_absorbed_args a = args_for(w, &b);
    a.flags = MLA_FLAG_LSE_BASE2;
    TU_STATUS(run(ctx2, w, &a), MLA_OK);
    TU_CHECK(!memcmp(b.o, b0->o, b.o_bytes), "%s: base-2 flag changed o", cs);
    check_against_oracle(w, &b, 1, "base2");
    outs_free(&b);
  }
  { /* lse NULL: o unchanged */
    outs b = outs_new(w);
    mla_absorbed_args a = args_for(w, &b);
    a.lse = NULL;
    TU_STATUS(run(ctx2, w, &a), MLA_OK);
    TU_CHECK(!memcmp(b.o, b0->o, b.o_bytes), "%s: lse = NULL changed o", cs);
    TU_CHECK(tu_all_poisoned(b.lse, b.lse_bytes + GUARD * 4), "%s: lse = NULL but lse written", cs);
    outs_free(&b);
  }
  { /* a plan whose kv_indptr spans are longer than kv_lens, the gaps holding
     * TU_SENTINEL: only kv_lens[i] keys may be read (and validated) */
    const mla_plan *p0 = &w->d.plan;
    int32_t *indptr = malloc(sizeof(int32_t) * (size_t)(p0->batch_size + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(p0->num_kv_tokens + 5 * p0->batch_size + 1));
    indptr[0] = 0;
    for (int i = 0; i < p0->batch_size; i++) {
      const int pad = tu_randint(&rng, 0, 5);
      memcpy(idx + indptr[i], p0->kv_indices + p0->kv_indptr[i],
             sizeof(int32_t) * (size_t)p0->kv_lens[i]);
      for (int j = 0; j < pad; j++) idx[indptr[i] + p0->kv_lens[i] + j] = TU_SENTINEL;
      indptr[i + 1] = indptr[i] + p0->kv_lens[i] + pad;
    }
    world w2 = *w;
    w2.d.plan.kv_indptr = indptr;
    w2.d.plan.kv_indices = idx;
    w2.d.plan.num_kv_tokens = indptr[p0->batch_size];
    outs b = outs_new(w);
    mla_absorbed_args a = args_for(w, &b);
    TU_STATUS(run(ctx2, &w2, &a), MLA_OK);
    TU_CHECK(!memcmp(b.o, b0->o, b.o_bytes) && !memcmp(b.lse, b0->lse, b.lse_bytes),
             "%s: padded kv_indptr spans change the result", cs);
    outs_free(&b);
    free(indptr);
    free(idx);
  }
  { /* one thread: bit-identical */
    outs b = outs_new(w);
    mla_absorbed_args a = args_for(w, &b);
    TU_STATUS(run(ctx1, w, &a), MLA_OK);
    TU_CHECK(!memcmp(b.o, b0->o, b.o_bytes) && !memcmp(b.lse, b0->lse, b.lse_bytes),
             "%s: 1 thread differs from 2 threads", cs);
    outs_free(&b);
  }
}

static void run_case(const acase *c, int extra) {
  world w;
  if (world_build(&w, c) == 0) {
    oracle(&w);
    outs b = outs_new(&w);
    mla_absorbed_args a = args_for(&w, &b);
    mla_status st = run(ctx2, &w, &a);
    char cs[160];
    case_str(c, cs, sizeof cs);
    TU_CHECK(st == MLA_OK, "%s: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(ctx2));
    if (st == MLA_OK) {
      check_against_oracle(&w, &b, 0, mla_cpu_kernels_get()->name);
      if (extra) variants(&w, &b);
    }
    outs_free(&b);
  }
  world_free(&w);
}

/* ---- the grid ------------------------------------------------------------- */

static void grid(int stride, int offset, int extra_every) {
  static const mla_dtype cdts[4] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3,
                                    MLA_DTYPE_FP8_E4M3_BLOCK};
  static const int Ps[4] = {1, 16, 64, 128};
  static const int Hs[4] = {1, 3, 16, 128};
  static const mla_dtype acts[3] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_F32};
  int idx = 0;
  for (int m = 0; m < 5; m++)
    for (int d = 0; d < 4; d++)
      for (int p = 0; p < 4; p++)
        for (int h = 0; h < 4; h++, idx++) {
          if (idx % stride != offset) continue;
          acase c;
          memset(&c, 0, sizeof c);
          c.cdt = cdts[d];
          c.P = Ps[p];
          c.H = Hs[h];
          /* bf16 activations most of the time, f16 / f32 now and then */
          c.act = idx % 5 == 3 ? acts[1 + (idx / 5) % 2] : MLA_DTYPE_BF16;
          /* the oracle is the slow part: fewer, shorter requests for many heads */
          c.bs = c.H >= 128 ? tu_randint(&rng, 1, 3) : c.H >= 16 ? tu_randint(&rng, 1, 5)
                                                                 : tu_randint(&rng, 1, 24);
          c.maxkv = c.H >= 128 ? 160 : 300;
          switch (m) {
            case 0: c.mode = MLA_MODE_DECODE; break;
            case 1:
              c.mode = MLA_MODE_TARGET_VERIFY;
              c.ndt = (int[]){1, 2, 4}[(idx / 4) % 3];
              break;
            case 2: c.mode = MLA_MODE_DRAFT_EXTEND; break; /* varlen */
            case 3:
              c.mode = MLA_MODE_DRAFT_EXTEND;
              c.ndt = 2 + idx % 2; /* fixed window */
              break;
            default: c.mode = MLA_MODE_EXTEND; break;
          }
          if (c.mode == MLA_MODE_EXTEND && c.H >= 128) c.maxkv = 80;
          run_case(&c, extra_every > 0 && idx % extra_every == 0);
        }
}

/* Large batches take the non-split path (>= 16 work items). */
static void big_batches(void) {
  acase c = {MLA_MODE_DECODE, 0, MLA_DTYPE_BF16, 16, 3, 40, 200, MLA_DTYPE_BF16};
  run_case(&c, 1);
  acase c2 = {MLA_MODE_TARGET_VERIFY, 4, MLA_DTYPE_FP8_E4M3_BLOCK, 64, 16, 20, 150, MLA_DTYPE_BF16};
  run_case(&c2, 1);
  acase c3 = {MLA_MODE_EXTEND, 0, MLA_DTYPE_F16, 1, 1, 6, 300, MLA_DTYPE_F32};
  run_case(&c3, 1);
  /* one long request, few heads: split over many pieces */
  acase c4 = {MLA_MODE_DECODE, 0, MLA_DTYPE_BF16, 64, 16, 1, 3000, MLA_DTYPE_BF16};
  run_case(&c4, 1);
  /* heads not a multiple of the 64-row block */
  acase c5 = {MLA_MODE_TARGET_VERIFY, 2, MLA_DTYPE_BF16, 16, 100, 2, 120, MLA_DTYPE_BF16};
  run_case(&c5, 1);
}

/* ---- bad arguments ---------------------------------------------------------- */

static void expect_fail(mla_status got, mla_status want, const outs *b, const char *what) {
  TU_CHECK(got == want, "%s: got %s, expected %s", what, mla_status_string(got),
           mla_status_string(want));
  TU_CHECK(mla_ctx_last_error(ctx2)[0] != '\0', "%s: no error message", what);
  if (b)
    TU_CHECK(tu_all_poisoned(b->o, b->o_bytes) && tu_all_poisoned(b->lse, b->lse_bytes), "%s: output written",
             what);
}

static void bad_args(void) {
  acase c = {MLA_MODE_TARGET_VERIFY, 2, MLA_DTYPE_BF16, 16, 4, 3, 100, MLA_DTYPE_BF16};
  world w;
  if (world_build(&w, &c) != 0) {
    world_free(&w);
    return;
  }
  /* make sure rows exist */
  TU_CHECK(w.d.Tq > 0, "bad_args world has no rows");
  outs b = outs_new(&w);
  size_t need = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(ctx2, &w.d.plan, 4, &need), MLA_OK);
  void *ws = malloc(need);
  mla_absorbed_args a0 = args_for(&w, &b), a;
  mla_plan p;

  TU_STATUS(mla_attention_absorbed(NULL, w.d.cache, 0, &w.d.plan, &a0, ws, need),
            MLA_ERR_INVALID_ARGUMENT);
  expect_fail(mla_attention_absorbed(ctx2, NULL, 0, &w.d.plan, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "cache NULL");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, NULL, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "plan NULL");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, NULL, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "args NULL");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, -1, &w.d.plan, &a0, ws, need),
              MLA_ERR_OUT_OF_RANGE, &b, "layer -1");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 1, &w.d.plan, &a0, ws, need),
              MLA_ERR_OUT_OF_RANGE, &b, "layer 1 of 1");
  a = a0, a.num_heads = 0;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "num_heads 0");
  a = a0, a.num_heads = MLA_MAX_HEADS + 1;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "num_heads too large");
  a = a0, a.act_dtype = MLA_DTYPE_FP8_E4M3;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_UNSUPPORTED, &b, "act fp8");
  a = a0, a.act_dtype = (mla_dtype)77;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "act 77");
  const float bad_scales[4] = {0.0f, -0.1f, NAN, INFINITY};
  for (int i = 0; i < 4; i++) {
    a = a0, a.scale = bad_scales[i];
    expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
                MLA_ERR_INVALID_ARGUMENT, &b, "bad scale");
  }
  a = a0, a.flags = 8; /* (4 is MLA_FLAG_FP8_MATH) */
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "unknown flag");
  a = a0, a.q_stride_token = -1;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "negative stride");
  a = a0, a.q_nope = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "q_nope NULL");
  a = a0, a.q_rope = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "q_rope NULL");
  a = a0, a.out = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "out NULL");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a0, ws, need - 1),
              MLA_ERR_WORKSPACE_TOO_SMALL, &b, "workspace one byte short");
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a0, NULL, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "workspace NULL");
  { /* a workspace sized for fewer heads than the call uses */
    size_t big = 0;
    TU_STATUS(mla_attention_absorbed_workspace_size(ctx2, &w.d.plan, 64, &big), MLA_OK);
    TU_CHECK(need < big, "workspace for 4 heads (%zu) not below 64 heads (%zu)", need, big);
    const size_t rows64 = (size_t)w.d.Tq * 64;
    void *qn64 = calloc(rows64 * MLA_LATENT, 2), *qr64 = calloc(rows64 * MLA_ROPE, 2);
    outs b64 = {malloc(rows64 * MLA_LATENT * 2), malloc(rows64 * 4), rows64 * MLA_LATENT * 2,
                rows64 * 4};
    tu_poison(b64.o, b64.o_bytes);
    tu_poison(b64.lse, b64.lse_bytes);
    a = a0, a.num_heads = 64, a.q_nope = qn64, a.q_rope = qr64, a.out = b64.o, a.lse = b64.lse;
    expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a, ws, need),
                MLA_ERR_WORKSPACE_TOO_SMALL, &b64, "workspace for fewer heads");
    free(qn64);
    free(qr64);
    outs_free(&b64);
  }
  p = w.d.plan, p.page_size = 64;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "page size mismatch");
  p = w.d.plan, p.causal = 2;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "causal 2");
  p = w.d.plan, p.num_q_tokens = w.d.plan.num_q_tokens + 1;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "num_q_tokens inconsistent");
  p = w.d.plan, p.max_q_len = 1;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "max_q_len below a request's rows");
  p = w.d.plan, p.qo_indptr = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "qo_indptr NULL");
  /* A pages-only plan (kv_indices NULL) needs its block table and room for
   * the slots it derives; then it gives the full plan's output bit for bit. */
  p = w.d.plan, p.kv_indices = NULL, p.block_table = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_INVALID_ARGUMENT, &b, "kv_indices and block_table NULL");
  p = w.d.plan, p.kv_indices = NULL;
  expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
              MLA_ERR_WORKSPACE_TOO_SMALL, &b, "pages-only plan, workspace without its slots");
  {
    size_t pneed = 0;
    TU_STATUS(mla_attention_absorbed_workspace_size(ctx2, &p, a0.num_heads, &pneed), MLA_OK);
    TU_CHECK(pneed >= need + sizeof(int32_t) * (size_t)w.d.plan.num_kv_tokens, "pages-only workspace %zu vs %zu",
             pneed, need);
    void *pws = malloc(pneed);
    outs full = {malloc(b.o_bytes), malloc(b.lse_bytes), b.o_bytes, b.lse_bytes};
    outs pages = {malloc(b.o_bytes), malloc(b.lse_bytes), b.o_bytes, b.lse_bytes};
    mla_absorbed_args af = a0, ap = a0;
    af.out = full.o, af.lse = full.lse, ap.out = pages.o, ap.lse = pages.lse;
    TU_STATUS(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &af, ws, need), MLA_OK);
    TU_STATUS(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &ap, pws, pneed), MLA_OK);
    TU_CHECK(memcmp(full.o, pages.o, b.o_bytes) == 0 && memcmp(full.lse, pages.lse, b.lse_bytes) == 0,
             "a pages-only plan gives another output than the full plan");
    int32_t *bt = (int32_t *)w.d.plan.block_table, saved = bt[0];
    bt[0] = -1;
    expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &ap, pws, pneed), MLA_ERR_OUT_OF_RANGE, NULL,
                "pages-only plan with a page outside the cache");
    bt[0] = saved;
    free(pws);
    outs_free(&full);
    outs_free(&pages);
  }
  {
    int32_t lens[MAXB];
    memcpy(lens, w.d.plan.kv_lens, sizeof(int32_t) * (size_t)c.bs);
    lens[c.bs - 1] += 1;
    p = w.d.plan, p.kv_lens = lens;
    expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need),
                MLA_ERR_INVALID_ARGUMENT, &b, "kv_lens past kv_indptr");
  }
  { /* kv indices out of the cache: -1, num_slots, the sentinel */
    int64_t slots = 0;
    mla_kv_cache_desc cd;
    mla_kv_cache_get_desc(w.d.cache, &cd);
    slots = (int64_t)cd.num_pages * cd.page_size;
    const int32_t bad[3] = {-1, (int32_t)slots, TU_SENTINEL};
    int32_t *idx = (int32_t *)w.d.plan.kv_indices;
    int last = w.d.plan.num_kv_tokens - 1;
    TU_CHECK(last >= 0, "no keys in bad_args world");
    if (last >= 0) {
      int32_t keep = idx[last];
      for (int i = 0; i < 3; i++) {
        idx[last] = bad[i];
        expect_fail(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a0, ws, need),
                    MLA_ERR_OUT_OF_RANGE, &b, "kv index out of range");
      }
      idx[last] = keep;
    }
  }
  /* workspace size query */
  size_t sz = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(NULL, &w.d.plan, 4, &sz), MLA_ERR_INVALID_ARGUMENT);
  expect_fail(mla_attention_absorbed_workspace_size(ctx2, NULL, 4, &sz), MLA_ERR_INVALID_ARGUMENT,
              NULL, "size: plan NULL");
  expect_fail(mla_attention_absorbed_workspace_size(ctx2, &w.d.plan, 4, NULL),
              MLA_ERR_INVALID_ARGUMENT, NULL, "size: bytes NULL");
  expect_fail(mla_attention_absorbed_workspace_size(ctx2, &w.d.plan, 0, &sz),
              MLA_ERR_INVALID_ARGUMENT, NULL, "size: 0 heads");

  /* IDLE and empty plans: OK, nothing written */
  p = w.d.plan, p.mode = MLA_MODE_IDLE;
  TU_STATUS(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, ws, need), MLA_OK);
  TU_CHECK(tu_all_poisoned(b.o, b.o_bytes) && tu_all_poisoned(b.lse, b.lse_bytes), "IDLE wrote output");
  p = w.d.plan, p.batch_size = 0, p.num_q_tokens = 0;
  TU_STATUS(mla_attention_absorbed(ctx2, w.d.cache, 0, &p, &a0, NULL, 0), MLA_OK);
  TU_CHECK(tu_all_poisoned(b.o, b.o_bytes) && tu_all_poisoned(b.lse, b.lse_bytes), "empty plan wrote output");
  /* and the good call still works afterwards */
  TU_STATUS(mla_attention_absorbed(ctx2, w.d.cache, 0, &w.d.plan, &a0, ws, need), MLA_OK);
  oracle(&w);
  check_against_oracle(&w, &b, 0, "after bad args");
  free(ws);
  outs_free(&b);
  world_free(&w);
}

/* ---- mla_gather_latent -------------------------------------------------- */

static void gather_tests(void) {
  static const mla_dtype cdts[4] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3,
                                    MLA_DTYPE_FP8_E4M3_BLOCK};
  static const mla_dtype acts[3] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
  for (int d = 0; d < 4; d++) {
    acase c = {MLA_MODE_DECODE, 0, cdts[d], 16, 1, 4, 150, MLA_DTYPE_BF16};
    world w;
    if (world_build(&w, &c) != 0 || w.d.Tk == 0) {
      world_free(&w);
      continue;
    }
    /* the rows the requests own, shuffled, repeated */
    const int T = w.d.Tk + 7;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)T);
    int k = 0;
    for (int i = 0; i < c.bs; i++)
      for (int j = 0; j < w.d.kv_len[i]; j++) slots[k++] = w.d.plan.kv_indices[w.d.plan.kv_indptr[i] + j];
    for (; k < T; k++) slots[k] = slots[tu_randint(&rng, 0, w.d.Tk - 1)];
    tu_shuffle_i32(&rng, slots, T);
    for (int ai = 0; ai < 3; ai++) {
      const size_t es = tu_act_size(acts[ai]);
      const size_t cb = es * (size_t)T * MLA_LATENT, rb = es * (size_t)T * MLA_ROPE;
      unsigned char *c1 = malloc(cb + 64), *r1 = malloc(rb + 64);
      unsigned char *c2 = malloc(cb), *r2 = malloc(rb);
      tu_poison(c1, cb + 64);
      tu_poison(r1, rb + 64);
      TU_STATUS(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, acts[ai], c1, r1), MLA_OK);
      TU_STATUS(mla_kv_cache_read(w.d.cache, 0, T, slots, c2, r2, acts[ai]), MLA_OK);
      TU_CHECK(!memcmp(c1, c2, cb) && !memcmp(r1, r2, rb),
               "gather_latent %s -> %s differs from mla_kv_cache_read", mla_dtype_name(cdts[d]),
               mla_dtype_name(acts[ai]));
      TU_CHECK(tu_all_poisoned(c1 + cb, 64) && tu_all_poisoned(r1 + rb, 64), "gather_latent wrote past the end");
      /* one part only */
      tu_poison(c1, cb);
      tu_poison(r1, rb);
      TU_STATUS(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, acts[ai], NULL, r1), MLA_OK);
      TU_CHECK(tu_all_poisoned(c1, cb) && !memcmp(r1, r2, rb), "gather_latent r only");
      TU_STATUS(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, acts[ai], c1, NULL), MLA_OK);
      TU_CHECK(!memcmp(c1, c2, cb), "gather_latent c only");
      if (d == 0 && ai == 0) { /* bad arguments */
        tu_poison(c1, cb);
        tu_poison(r1, rb);
        outs o = {c1, (float *)r1, cb, rb};
        TU_STATUS(mla_gather_latent(NULL, w.d.cache, 0, T, slots, acts[ai], c1, r1),
                  MLA_ERR_INVALID_ARGUMENT);
        expect_fail(mla_gather_latent(ctx2, NULL, 0, T, slots, acts[ai], c1, r1),
                    MLA_ERR_INVALID_ARGUMENT, &o, "gather: cache NULL");
        expect_fail(mla_gather_latent(ctx2, w.d.cache, 1, T, slots, acts[ai], c1, r1),
                    MLA_ERR_OUT_OF_RANGE, &o, "gather: layer");
        expect_fail(mla_gather_latent(ctx2, w.d.cache, 0, -1, slots, acts[ai], c1, r1),
                    MLA_ERR_INVALID_ARGUMENT, &o, "gather: T < 0");
        expect_fail(mla_gather_latent(ctx2, w.d.cache, 0, T, NULL, acts[ai], c1, r1),
                    MLA_ERR_INVALID_ARGUMENT, &o, "gather: slots NULL");
        expect_fail(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, MLA_DTYPE_FP8_E4M3, c1, r1),
                    MLA_ERR_UNSUPPORTED, &o, "gather: fp8 dst");
        expect_fail(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, acts[ai], NULL, NULL),
                    MLA_ERR_INVALID_ARGUMENT, &o, "gather: no outputs");
        const int32_t keep = slots[T - 1];
        mla_kv_cache_desc cd;
        mla_kv_cache_get_desc(w.d.cache, &cd);
        const int32_t bad[3] = {-1, cd.num_pages * cd.page_size, TU_SENTINEL};
        for (int i = 0; i < 3; i++) {
          slots[T - 1] = bad[i];
          expect_fail(mla_gather_latent(ctx2, w.d.cache, 0, T, slots, acts[ai], c1, r1),
                      MLA_ERR_OUT_OF_RANGE, &o, "gather: slot out of range");
        }
        slots[T - 1] = keep;
        TU_STATUS(mla_gather_latent(ctx2, w.d.cache, 0, 0, NULL, acts[ai], NULL, NULL), MLA_OK);
      }
      free(c1);
      free(r1);
      free(c2);
      free(r2);
    }
    free(slots);
    world_free(&w);
  }
}

/* ---- the SIMD row converters against the scalar definitions -------------- */

static int same_float(float a, float b) {
  if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
  return memcmp(&a, &b, sizeof a) == 0;
}

static void convert_tests(void) {
  const mla_cpu_kernels *tabs[3] = {mla_cpu_kernels_scalar(), mla_cpu_kernels_avx2(),
                                    mla_cpu_kernels_avx512()};
  for (int t = 0; t < 3; t++) {
    if (!tabs[t] || !mla_cpu_isa_available(tabs[t]->isa)) continue;
    const mla_cpu_kernels *k = tabs[t];
    enum { N = 256 + 3 }; /* a tail that is no multiple of the vector width */
    uint8_t b8[N];
    float lut[256], got[N];
    for (int i = 0; i < N; i++) b8[i] = (uint8_t)(i % 256);
    for (int i = 0; i < 256; i++) lut[i] = mla_e4m3_to_f32((uint8_t)i);
    const float scales[3] = {1.0f, 0.0371f, 3.5f};
    int bad = 0;
    for (int si = 0; si < 3; si++) {
      k->e4m3_to_f32(b8, lut, scales[si], got, N);
      for (int i = 0; i < N; i++) bad += !same_float(got[i], mla_e4m3_to_f32(b8[i]) * scales[si]);
    }
    TU_CHECK(bad == 0, "%s e4m3 conversion: %d wrong values", k->name, bad);
    bad = 0;
    static uint16_t h[65536 + 5];
    static float gh[65536 + 5];
    for (int i = 0; i < 65536 + 5; i++) h[i] = (uint16_t)(i & 0xffff);
    k->f16_to_f32(h, gh, 65536 + 5);
    for (int i = 0; i < 65536 + 5; i++) bad += !same_float(gh[i], mla_f16_to_f32(h[i]));
    TU_CHECK(bad == 0, "%s f16 conversion: %d wrong values", k->name, bad);
    bad = 0;
    k->bf16_to_f32(h, gh, 65536 + 5);
    for (int i = 0; i < 65536 + 5; i++) {
      uint32_t u;
      memcpy(&u, &gh[i], 4);
      bad += u != (uint32_t)h[i] << 16;
    }
    TU_CHECK(bad == 0, "%s bf16 conversion: %d wrong values", k->name, bad);
  }
}

int main(void) {
  rng.s = tu_seed("test_cpu_absorbed", 7031);
  mla_ctx_desc d2 = {MLA_DEVICE_CPU, 2, 0}, d1 = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&d2, &ctx2), MLA_OK);
  TU_STATUS(mla_ctx_create(&d1, &ctx1), MLA_OK);
  if (!ctx1 || !ctx2) return tu_finish("test_cpu_absorbed");
  clock_t t0 = clock();

  convert_tests();
  bad_args();
  gather_tests();
  /* the full grid on the best ISA, every 4th case on the others */
  const mla_cpu_kernels *best = mla_cpu_kernels_get();
  printf("best ISA: %s\n", best->name);
  grid(1, 0, 7);
  big_batches();
  const mla_cpu_isa others[3] = {MLA_CPU_ISA_SCALAR, MLA_CPU_ISA_AVX2, MLA_CPU_ISA_AVX512};
  for (int i = 0; i < 3; i++) {
    if (others[i] == best->isa || mla_cpu_set_isa(others[i]) != 0) continue;
    printf("ISA %s: a quarter of the grid\n", mla_cpu_kernels_get()->name);
    grid(4, 1 + i, 0);
  }
  mla_cpu_set_isa(MLA_CPU_ISA_AUTO);

  printf("cpu time %.1f s\n", (double)(clock() - t0) / CLOCKS_PER_SEC);
  mla_ctx_destroy(ctx1);
  mla_ctx_destroy(ctx2);
  return tu_finish("test_cpu_absorbed");
}
