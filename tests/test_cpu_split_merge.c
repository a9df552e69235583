/* The split-KV decode path of the CPU absorbed attention with more workers
 * than pieces to go round, and its output kernel.
 *
 * 1. out512 (cpu.h; AVX-512 builds) against the scalar path it replaces:
 *    the row scaled, put back in natural column order, stored as f32 or
 *    bf16 (mla_f32_to_bf16: round to nearest even, NaN kept quiet).
 *    Bit-identical on random rows and on the edge values of the rounding
 *    (ties, the largest finites, infinities, NaN payloads, subnormals).
 *    qt16p_bf16 (the query block built from bf16 rows in registers) against
 *    the rows converted to fp32 and given to qt16p: bit-identical, with
 *    zero (absent) rows, infinities and NaNs among the values.
 * 2. Split decode batches (fewer than 16 items: pieces run in parallel,
 *    the workers that finish first help merge) on 1, 2, 3 and 5 threads:
 *    bit-identical outputs and LSEs, including requests with no keys, a
 *    single key, lengths that are not multiples of a tile, every ISA the
 *    machine has, and bf16 / f32 / f16 activations; the 1-thread result is
 *    checked against the float64 oracle.
 * 3. A slot outside the cache, negative or past the end, anywhere in a
 *    long request: OUT_OF_RANGE naming the key, nothing written. */
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "test_util.h"

static tu_rng rng;

/* ---- 1. out512 ------------------------------------------------------------ */

static void out_ref(const float *acc, int split, float inv, int bf16, void *dst) {
  float o[MLA_LATENT];
  /* position p of a pair-split row holds column MLA_CPU_SPLIT32(p) */
  for (int p = 0; p < MLA_LATENT; p++) o[split ? MLA_CPU_SPLIT32(p) : p] = acc[p] * inv;
  for (int c = 0; c < MLA_LATENT; c++) {
    if (bf16)
      ((uint16_t *)dst)[c] = mla_f32_to_bf16(o[c]);
    else
      ((float *)dst)[c] = o[c];
  }
}

static void test_out512(void) {
  const mla_cpu_kernels *k = mla_cpu_kernels_avx512();
  if (!k || !mla_cpu_isa_available(MLA_CPU_ISA_AVX512) || !k->out512) {
    printf("out512: skipped (no AVX-512 kernels on this build / machine)\n");
    return;
  }
  /* edge values: bf16 rounding ties (even and odd), just below / above a
   * tie, the largest finite floats (round up to inf), infinities, quiet and
   * signalling NaNs with payloads, subnormals, zeros */
  static const uint32_t edge[] = {
      0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x7f7fffffu, 0xff7fffffu,
      0x7f7f8000u, 0x7f7f7fffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u,
      0x7f800001u, 0x7fbfffffu, 0xff80ffffu, 0x00000001u, 0x80008000u, 0x007fffffu,
      0x00000000u, 0x80000000u, 0x3f7fffffu, 0x477fe000u};
  const int nedge = (int)(sizeof edge / sizeof edge[0]);
  float acc[MLA_LATENT];
  uint16_t gb[MLA_LATENT], rb[MLA_LATENT];
  float gf[MLA_LATENT], rf[MLA_LATENT];
  int bad_b = 0, bad_f = 0, runs = 0;
  for (int rep = 0; rep < 200; rep++) {
    for (int c = 0; c < MLA_LATENT; c++) {
      if (rep % 2 && tu_randint(&rng, 0, 3) == 0) {
        const uint32_t u = edge[tu_randint(&rng, 0, nedge - 1)];
        memcpy(&acc[c], &u, 4);
      } else {
        acc[c] = (float)(tu_normal(&rng) * (rep % 5 == 0 ? 1e30 : 3.0));
      }
    }
    /* inv = 1 keeps the edge values as they are; others scale them */
    const float inv = rep % 3 == 0 ? 1.0f : (float)(tu_uniform(&rng) * 2.0 + 1e-3);
    for (int split = 0; split < 2; split++) {
      out_ref(acc, split, inv, 1, rb);
      k->out512(acc, split, inv, 1, gb);
      bad_b += memcmp(gb, rb, sizeof gb) != 0;
      out_ref(acc, split, inv, 0, rf);
      k->out512(acc, split, inv, 0, gf);
      bad_f += memcmp(gf, rf, sizeof gf) != 0;
      runs++;
    }
  }
  TU_CHECK(bad_b == 0, "out512 bf16 differs from the scalar path in %d of %d rows", bad_b, runs);
  TU_CHECK(bad_f == 0, "out512 f32 differs from the scalar path in %d of %d rows", bad_f, runs);
}

static void test_qt16p_bf16(void) {
  const mla_cpu_kernels *k = mla_cpu_kernels_avx512();
  if (!k || !mla_cpu_isa_available(MLA_CPU_ISA_AVX512) || !k->qt16p_bf16 || !k->qt16p) {
    printf("qt16p_bf16: skipped (no AVX-512 kernels on this build / machine)\n");
    return;
  }
  enum { LDN = 512 + 40, LDR = 64 + 8 }; /* row strides of the fake q tensors */
  uint16_t *qn = malloc(sizeof(uint16_t) * 16 * LDN), *qr = malloc(sizeof(uint16_t) * 16 * LDR);
  float *stage = malloc(sizeof(float) * 16 * MLA_ROW);
  float *want = malloc(sizeof(float) * 288 * 32), *got = malloc(sizeof(float) * 288 * 32);
  if (!qn || !qr || !stage || !want || !got) {
    TU_CHECK(0, "out of memory");
    return;
  }
  int bad = 0;
  for (int rep = 0; rep < 50; rep++) {
    const int rows = rep < 16 ? rep + 1 : 16 - rep % 3; /* the first `rows` present */
    for (int i = 0; i < 16 * LDN; i++) qn[i] = (uint16_t)tu_next(&rng);
    for (int i = 0; i < 16 * LDR; i++) qr[i] = (uint16_t)tu_next(&rng);
    const uint16_t *pn[16], *pr[16];
    for (int i = 0; i < 16; i++) {
      pn[i] = i < rows ? qn + i * LDN + (i % 3) : NULL; /* odd offsets: unaligned rows */
      pr[i] = i < rows ? qr + i * LDR + (i % 5) : NULL;
      for (int c = 0; c < MLA_ROW; c++)
        stage[i * MLA_ROW + c] =
            i >= rows ? 0.0f : tu_bf16_to_f32(c < MLA_LATENT ? pn[i][c] : pr[i][c - MLA_LATENT]);
    }
    const float scale = rep % 4 == 0 ? 1.0f : (float)(tu_uniform(&rng) + 0.01);
    k->qt16p(stage, MLA_ROW, MLA_ROW, scale, 1, want);
    memset(got, 0xff, sizeof(float) * 288 * 32);
    k->qt16p_bf16(pn, pr, scale, got);
    bad += memcmp(got, want, sizeof(float) * 288 * 32) != 0;
  }
  TU_CHECK(bad == 0, "qt16p_bf16 differs from qt16p on fp32 rows in %d of 50 blocks", bad);
  free(qn);
  free(qr);
  free(stage);
  free(want);
  free(got);
}

/* ---- 2. split decode on many workers --------------------------------------- */

#define PAGE 16
static const float SCALE = 0.0721687836f; /* 192^-0.5 */

typedef struct batch {
  int bs, H;
  mla_kv_cache *cache;
  mla_plan plan;
  int32_t *indptr, *indices, *lens, *qo;
  float *qn, *qr; /* f32 copies of the queries */
  void *qn_a, *qr_a;
  int32_t num_slots;
} batch;

/* bs requests with the given key counts over one shuffled slot set of a
 * fresh bf16 cache; a decode plan (one query each) built by hand. */
static int batch_new(mla_ctx *ctx, batch *b, int bs, int H, const int *lens, mla_dtype act) {
  memset(b, 0, sizeof *b);
  b->bs = bs;
  b->H = H;
  int total = 0;
  for (int i = 0; i < bs; i++) total += lens[i];
  const int pages = total / PAGE + 4;
  b->num_slots = pages * PAGE;
  mla_kv_cache_desc cd = {1, pages, PAGE, MLA_DTYPE_BF16, NULL};
  if (mla_kv_cache_create(ctx, &cd, &b->cache) != MLA_OK) return -1;
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)b->num_slots);
  float *c = malloc(sizeof(float) * MLA_LATENT * (size_t)b->num_slots);
  float *r = malloc(sizeof(float) * MLA_ROPE * (size_t)b->num_slots);
  b->indptr = malloc(sizeof(int32_t) * (size_t)(bs + 1));
  b->indices = malloc(sizeof(int32_t) * (size_t)(total + 1));
  b->lens = malloc(sizeof(int32_t) * (size_t)bs);
  b->qo = malloc(sizeof(int32_t) * (size_t)(bs + 1));
  if (!perm || !c || !r || !b->indptr || !b->indices || !b->lens || !b->qo) return -1;
  for (int s = 0; s < b->num_slots; s++) perm[s] = s;
  tu_shuffle_i32(&rng, perm, b->num_slots);
  tu_fill_bf16_normal(&rng, c, (int64_t)MLA_LATENT * b->num_slots, 1.0);
  tu_fill_bf16_normal(&rng, r, (int64_t)MLA_ROPE * b->num_slots, 1.0);
  if (mla_kv_cache_write(b->cache, 0, b->num_slots, perm, c, r, MLA_DTYPE_F32) != MLA_OK) return -1;
  b->indptr[0] = 0;
  for (int i = 0; i < bs; i++) {
    b->lens[i] = lens[i];
    b->indptr[i + 1] = b->indptr[i] + lens[i];
    b->qo[i] = i;
  }
  b->qo[bs] = bs;
  for (int j = 0; j < total; j++) b->indices[j] = perm[j];
  free(perm);
  free(c);
  free(r);
  memset(&b->plan, 0, sizeof b->plan);
  b->plan.mode = MLA_MODE_DECODE;
  b->plan.batch_size = bs;
  b->plan.num_q_tokens = bs;
  b->plan.max_q_len = 1;
  b->plan.num_kv_tokens = total;
  b->plan.page_size = PAGE;
  b->plan.causal = 1;
  b->plan.qo_indptr = b->qo;
  b->plan.kv_indptr = b->indptr;
  b->plan.kv_indices = b->indices;
  b->plan.kv_lens = b->lens;
  const size_t nq = (size_t)bs * H;
  b->qn = malloc(sizeof(float) * nq * MLA_LATENT);
  b->qr = malloc(sizeof(float) * nq * MLA_ROPE);
  b->qn_a = malloc(4 * nq * MLA_LATENT);
  b->qr_a = malloc(4 * nq * MLA_ROPE);
  if (!b->qn || !b->qr || !b->qn_a || !b->qr_a) return -1;
  tu_fill_bf16_normal(&rng, b->qn, (int64_t)(nq * MLA_LATENT), 1.0);
  tu_fill_bf16_normal(&rng, b->qr, (int64_t)(nq * MLA_ROPE), 1.0);
  tu_to_dtype(act, b->qn, b->qn_a, (int64_t)(nq * MLA_LATENT));
  tu_to_dtype(act, b->qr, b->qr_a, (int64_t)(nq * MLA_ROPE));
  return 0;
}

static void batch_free(batch *b) {
  mla_kv_cache_destroy(b->cache);
  free(b->indptr);
  free(b->indices);
  free(b->lens);
  free(b->qo);
  free(b->qn);
  free(b->qr);
  free(b->qn_a);
  free(b->qr_a);
}

/* Run on ctx into a poisoned o / lse; returns the status. */
static mla_status run(mla_ctx *ctx, batch *b, mla_dtype act, void *o, float *lse) {
  const size_t nq = (size_t)b->bs * b->H;
  tu_poison(o, tu_act_size(act) * nq * MLA_LATENT);
  tu_poison(lse, sizeof(float) * nq);
  size_t wb = 0;
  mla_status st = mla_attention_absorbed_workspace_size(ctx, &b->plan, b->H, &wb);
  if (st != MLA_OK) return st;
  void *ws = malloc(wb);
  if (!ws) return MLA_ERR_OUT_OF_MEMORY;
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = b->H;
  a.scale = SCALE;
  a.act_dtype = act;
  a.q_nope = b->qn_a;
  a.q_rope = b->qr_a;
  a.out = o;
  a.lse = lse;
  st = mla_attention_absorbed(ctx, b->cache, 0, &b->plan, &a, ws, wb);
  free(ws);
  return st;
}

/* The tolerances of test_cpu_absorbed. */
#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5

/* Against the float64 oracle (the cache rows as stored: bf16 values). */
static void check_oracle(batch *b, mla_dtype act, const void *o, const float *lse, const char *cs) {
  const int64_t nq = (int64_t)b->bs * b->H, no = nq * MLA_LATENT;
  const int total = b->indptr[b->bs];
  double *qn = malloc(sizeof(double) * (size_t)no), *qr = malloc(sizeof(double) * (size_t)nq * MLA_ROPE);
  double *c = malloc(sizeof(double) * (size_t)(total + 1) * MLA_LATENT);
  double *r = malloc(sizeof(double) * (size_t)(total + 1) * MLA_ROPE);
  double *ro = malloc(sizeof(double) * (size_t)no), *rl = malloc(sizeof(double) * (size_t)nq);
  double *got = malloc(sizeof(double) * (size_t)no);
  float *cf = malloc(sizeof(float) * (size_t)(total + 1) * MLA_LATENT);
  float *rf = malloc(sizeof(float) * (size_t)(total + 1) * MLA_ROPE);
  int *ql = malloc(sizeof(int) * (size_t)b->bs), *kl = malloc(sizeof(int) * (size_t)b->bs);
  if (!qn || !qr || !c || !r || !ro || !rl || !got || !cf || !rf || !ql || !kl) {
    TU_CHECK(0, "out of memory");
    return;
  }
  mla_ctx *ctx = NULL;
  mla_ctx_desc d = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&d, &ctx), MLA_OK);
  if (total > 0)
    TU_STATUS(mla_gather_latent(ctx, b->cache, 0, total, b->indices, MLA_DTYPE_F32, cf, rf), MLA_OK);
  mla_ctx_destroy(ctx);
  for (int64_t i = 0; i < (int64_t)total * MLA_LATENT; i++) c[i] = cf[i];
  for (int64_t i = 0; i < (int64_t)total * MLA_ROPE; i++) r[i] = rf[i];
  /* the queries as the call sees them: rounded to the activation dtype */
  for (int64_t i = 0; i < no; i++) qn[i] = tu_round_to(act, b->qn[i]);
  for (int64_t i = 0; i < nq * MLA_ROPE; i++) qr[i] = tu_round_to(act, b->qr[i]);
  for (int i = 0; i < b->bs; i++) ql[i] = 1, kl[i] = b->lens[i];
  ref_absorbed(b->bs, ql, kl, b->H, (double)SCALE, 1, qn, qr, c, r, ro, rl);
  tu_from_dtype(act, o, got, no);
  for (int64_t i = 0; i < no; i++) ro[i] = tu_round_to(act, ro[i]);
  ref_cmp k = ref_compare(got, ro, no, O_ATOL, O_RTOL);
  TU_CHECK(ref_cmp_ok(&k, MAX_COS), "%s o: %lld bad, %lld nonfinite mismatches of %lld, max abs %.3g cos %.3g",
           cs, (long long)k.bad, (long long)k.nonfinite_mismatch, (long long)no, k.max_abs_err, k.cos_dist);
  for (int64_t i = 0; i < nq; i++) got[i] = lse[i], rl[i] = (double)(float)rl[i];
  k = ref_compare(got, rl, nq, LSE_ATOL, LSE_RTOL);
  TU_CHECK(k.bad == 0 && k.nonfinite_mismatch == 0, "%s lse: %lld bad, %lld nonfinite mismatches of %lld",
           cs, (long long)k.bad, (long long)k.nonfinite_mismatch, (long long)nq);
  free(qn); free(qr); free(c); free(r); free(ro); free(rl); free(got); free(cf); free(rf); free(ql); free(kl);
}

static void test_split(void) {
  static const int nthreads[] = {1, 2, 3, 5};
  mla_ctx *ctx[4] = {NULL, NULL, NULL, NULL};
  for (int t = 0; t < 4; t++) {
    mla_ctx_desc d = {MLA_DEVICE_CPU, nthreads[t], 0};
    TU_STATUS(mla_ctx_create(&d, &ctx[t]), MLA_OK);
    if (!ctx[t]) return;
  }
  /* key counts: long (several split pieces), ragged, 0, 1, a tile +- 1 */
  static const int L1[] = {1500};
  static const int L2[] = {0, 1, 63, 65, 777};
  static const int L3[] = {2049, 0, 1200, 130, 1, 900, 64, 511, 1024, 33, 700, 5, 1999};
  static const int L4[] = {4100, 3};
  struct {
    const int *lens;
    int bs, H;
    mla_dtype act;
  } cases[] = {
      {L1, 1, 16, MLA_DTYPE_BF16}, {L1, 1, 128, MLA_DTYPE_BF16}, {L2, 5, 16, MLA_DTYPE_F32},
      {L2, 5, 3, MLA_DTYPE_BF16},  {L3, 13, 16, MLA_DTYPE_BF16}, {L3, 13, 1, MLA_DTYPE_F16},
      {L4, 2, 128, MLA_DTYPE_F32}, {L4, 2, 16, MLA_DTYPE_F16},
  };
  const mla_cpu_isa isas[] = {MLA_CPU_ISA_AVX512, MLA_CPU_ISA_AVX2, MLA_CPU_ISA_SCALAR};
  for (int ci = 0; ci < (int)(sizeof cases / sizeof cases[0]); ci++) {
    batch b;
    if (batch_new(ctx[0], &b, cases[ci].bs, cases[ci].H, cases[ci].lens, cases[ci].act) != 0) {
      TU_CHECK(0, "case %d: setup failed", ci);
      continue;
    }
    const mla_dtype act = cases[ci].act;
    const size_t nq = (size_t)b.bs * b.H, ob = tu_act_size(act) * nq * MLA_LATENT;
    void *o0 = malloc(ob), *o1 = malloc(ob);
    float *l0 = malloc(sizeof(float) * nq), *l1 = malloc(sizeof(float) * nq);
    for (int ii = 0; ii < 3; ii++) {
      if (!mla_cpu_isa_available(isas[ii]) || mla_cpu_set_isa(isas[ii]) != 0) continue;
      /* the scalar build is slow: one long case is enough there */
      if (isas[ii] == MLA_CPU_ISA_SCALAR && ci != 2 && ci != 5) continue;
      char cs[96];
      snprintf(cs, sizeof cs, "case %d (bs %d, H %d, act %s, %s)", ci, b.bs, b.H, mla_dtype_name(act),
               mla_cpu_kernels_get()->name);
      TU_STATUS(run(ctx[0], &b, act, o0, l0), MLA_OK);
      if (ii == 0) check_oracle(&b, act, o0, l0, cs);
      for (int t = 1; t < 4; t++) {
        for (int rep = 0; rep < 3; rep++) { /* repeats: the pieces go round differently */
          TU_STATUS(run(ctx[t], &b, act, o1, l1), MLA_OK);
          TU_CHECK(!memcmp(o0, o1, ob) && !memcmp(l0, l1, sizeof(float) * nq),
                   "%s: %d threads differ from 1 thread (repeat %d)", cs, nthreads[t], rep);
        }
      }
    }
    mla_cpu_set_isa(MLA_CPU_ISA_AUTO);
    free(o0);
    free(o1);
    free(l0);
    free(l1);
    batch_free(&b);
  }

  /* 3. a slot outside the cache anywhere in a long request */
  {
    static const int L[] = {3000};
    batch b;
    if (batch_new(ctx[1], &b, 1, 16, L, MLA_DTYPE_BF16) == 0) {
      const size_t nq = 16, ob = 2 * nq * MLA_LATENT;
      void *o = malloc(ob);
      float *l = malloc(sizeof(float) * nq);
      const int at[] = {0, 17, 1500, 2999};
      const int32_t bad[] = {-1, INT32_MIN, b.num_slots, INT32_MAX};
      for (int i = 0; i < 4; i++) {
        const int32_t keep = b.indices[at[i]];
        b.indices[at[i]] = bad[i];
        TU_STATUS(run(ctx[1], &b, MLA_DTYPE_BF16, o, l), MLA_ERR_OUT_OF_RANGE);
        char want[64];
        snprintf(want, sizeof want, "key %d of request 0 is slot %d", at[i], (int)bad[i]);
        TU_CHECK(strstr(mla_ctx_last_error(ctx[1]), want) != NULL, "message '%s' lacks '%s'",
                 mla_ctx_last_error(ctx[1]), want);
        TU_CHECK(tu_all_poisoned(o, ob) && tu_all_poisoned(l, sizeof(float) * nq),
                 "a refused call wrote its outputs (bad slot %d at key %d)", (int)bad[i], at[i]);
        b.indices[at[i]] = keep;
      }
      /* the last slot of the cache is valid */
      b.indices[2999] = b.num_slots - 1;
      TU_STATUS(run(ctx[1], &b, MLA_DTYPE_BF16, o, l), MLA_OK);
      free(o);
      free(l);
      batch_free(&b);
    } else {
      TU_CHECK(0, "bad-slot case: setup failed");
    }
  }
  for (int t = 0; t < 4; t++) mla_ctx_destroy(ctx[t]);
}

int main(void) {
  rng.s = tu_seed("test_cpu_split_merge", 9001);
  test_out512();
  test_qt16p_bf16();
  test_split();
  return tu_finish("test_cpu_split_merge");
}
