/* MLA_FLAG_FP8_MATH on a CPU context: a permission the CPU never uses, so
 * every absorbed entry point must accept it and compute bit for bit what it
 * computes without it (out and lse), in the shapes where the CUDA backend
 * would switch to fp8 math (per-tensor fp8 cache, > 32 rows per request,
 * pages >= 8) and elsewhere (bf16 and block-scaled fp8 caches):
 *  - mla_attention_absorbed and mla_step_attention for DECODE (H 64, 128),
 *    TARGET_VERIFY (2 and 4 draft tokens) and DRAFT_EXTEND (a fixed window of
 *    16 tokens with H = 3: 48 rows; its first queries see no key in the short
 *    requests), lengths 0, 1, 63, 64, 65 and longer, with and without
 *    MLA_FLAG_LSE_BASE2 next to it;
 *  - mla_backend_forward in an absorbed mode (DECODE) and an MHA one (EXTEND
 *    without prefix: the backend drops the flag there rather than hand
 *    mla_attention_ragged an unknown bit);
 *  - an unknown bit (8) next to it is still refused (INVALID_ARGUMENT),
 *    nothing written; mla_attention_ragged and mla_merge_states do not take
 *    the flag (it is absorbed attention's).
 * Outputs are poisoned before every call; live rows must be written. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "decode_world.h"
#include "test_util.h"

#define MAXB 8
#define NPAD 3
#define NUM_SM 6 /* split schedule target: long requests get split */

static const float SCALE = 0.0721687836f; /* 192^-0.5 */
static tu_rng rng;
static mla_ctx *cpu;

typedef struct world {
  tu_dworld d; /* bf16 q [Tq, H, 512], [Tq, H, 64] */
  size_t o_bytes, l_bytes;
} world;
_Static_assert(MAXB <= TU_DW_MAXB, "MAXB");

static const char *mode_name(mla_mode m) {
  return m == MLA_MODE_DECODE ? "decode" : m == MLA_MODE_TARGET_VERIFY ? "verify" : "draft_extend";
}

static void case_str(const world *w, char *buf, size_t n) {
  snprintf(buf, n, "%s ndt=%d kv=%s P=%d H=%d bs=%d", mode_name(w->d.mode), w->d.ndt, mla_dtype_name(w->d.kv), w->d.P,
           w->d.H, w->d.bs);
}

static void world_free(world *w) { tu_dworld_free(&w->d); }

/* Key lengths 0 (decode), 1, 63, 64, 65, then random ones up to 700. */
static int world_build(world *w) {
  static const int fixed[5] = {0, 1, 63, 64, 65};
  for (int i = 0; i < w->d.bs; i++) {
    int kv = i < 5 ? fixed[i] : tu_randint(&rng, 100, 700);
    if (w->d.mode == MLA_MODE_TARGET_VERIFY && kv < w->d.ndt) kv = w->d.ndt;     /* seq_len 0: drafts only */
    w->d.kv_len[i] = kv;
    w->d.q_len[i] = w->d.mode == MLA_MODE_DECODE ? 1 : w->d.ndt;
    w->d.seq[i] = w->d.mode == MLA_MODE_TARGET_VERIFY ? kv - w->d.ndt : kv;
  }
  const int pages = tu_dworld_totals(&w->d, NPAD);
  if (tu_dworld_create(&w->d, cpu, NULL, pages, NPAD)) return -1;
  double *c_d = NULL, *r_d = NULL;
  const int cap = 2 * w->d.P < 64 ? 64 : 2 * w->d.P;
  int rc = tu_grow_requests(&rng, w->d.rt, w->d.bs, w->d.kv_len, NPAD, w->d.P, cap, w->d.req_ids);
  if (rc == 0)
    rc = tu_fill_owned_rows(&rng, w->d.cache, w->d.rt, w->d.bs, w->d.req_ids, w->d.kv_len, w->d.maxkv, MLA_DTYPE_F32,
                            &c_d, &r_d);
  free(c_d);
  free(r_d);
  if (rc) return -1;
  if (tu_dworld_plan(&w->d, cpu, NUM_SM)) return -1; /* DECODE: ndt = 0 */
  tu_make_q(&rng, MLA_DTYPE_BF16, (int64_t)w->d.Tq * w->d.H, 0, &w->d.qn, &w->d.qr, &w->d.qn_d, &w->d.qr_d);
  w->o_bytes = 2 * (size_t)w->d.Tq * w->d.H * MLA_LATENT;
  w->l_bytes = sizeof(float) * (size_t)w->d.Tq * w->d.H;
  return 0;
}

typedef struct outs {
  void *o;
  float *lse;
} outs;

static outs outs_new(const world *w) {
  outs r = {malloc(w->o_bytes), malloc(w->l_bytes)};
  tu_poison(r.o, w->o_bytes);
  tu_poison(r.lse, w->l_bytes);
  return r;
}

static void outs_free(outs *r) {
  free(r->o);
  free(r->lse);
}

static mla_absorbed_args args_of(const world *w, outs *r, unsigned flags) {
  mla_absorbed_args a = tu_dworld_args(&w->d, w->d.qn, w->d.qr, r->o, r->lse);
  a.flags = flags;
  return a;
}

/* Every query row of a request with a key was written (not poison), and the
 * rows with no visible key hold o = 0, lse = -inf. */
static int rows_written(const world *w, const outs *r) {
  int bad = 0;
  int64_t t = 0;
  for (int i = 0; i < w->d.bs; i++)
    for (int q = 0; q < w->d.q_len[i]; q++, t++)
      for (int h = 0; h < w->d.H; h++) {
        const int64_t row = t * w->d.H + h;
        const int vis = w->d.kv_len[i] - w->d.q_len[i] + q + 1; /* causal, bottom-right (decode: all keys) */
        const uint16_t *o = (const uint16_t *)r->o + row * MLA_LATENT;
        int nonzero = 0;
        for (int d = 0; d < MLA_LATENT; d++) nonzero += o[d] != 0;
        if (tu_all_poisoned(o, 2 * MLA_LATENT)) bad++;
        else if (vis <= 0 && !(nonzero == 0 && isinf(r->lse[row]) && r->lse[row] < 0)) bad++;
        else if (vis > 0 && !isfinite(r->lse[row])) bad++;
      }
  return bad;
}

static int same(const world *w, const outs *a, const outs *b) {
  return memcmp(a->o, b->o, w->o_bytes) == 0 && memcmp(a->lse, b->lse, w->l_bytes) == 0;
}

/* mla_attention_absorbed: flags f and f | FP8_MATH bit for bit (f = 0 and
 * LSE_BASE2); an unknown bit refused, nothing written. */
static void absorbed_calls(const world *w, const char *cs) {
  size_t wsb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(cpu, &w->d.plan, w->d.H, &wsb), MLA_OK);
  void *ws = malloc(wsb ? wsb : 1);
  for (int base2 = 0; base2 < 2; base2++) {
    const unsigned f = base2 ? MLA_FLAG_LSE_BASE2 : 0;
    outs a = outs_new(w), b = outs_new(w);
    mla_absorbed_args aa = args_of(w, &a, f), ab = args_of(w, &b, f | MLA_FLAG_FP8_MATH);
    TU_STATUS(mla_attention_absorbed(cpu, w->d.cache, 0, &w->d.plan, &aa, ws, wsb), MLA_OK);
    const mla_status st = mla_attention_absorbed(cpu, w->d.cache, 0, &w->d.plan, &ab, ws, wsb);
    TU_CHECK(st == MLA_OK, "%s base2=%d: mla_attention_absorbed with MLA_FLAG_FP8_MATH: %s (%s)", cs, base2,
             mla_status_string(st), mla_ctx_last_error(cpu));
    TU_CHECK(rows_written(w, &a) == 0, "%s base2=%d: %d rows not written as expected", cs, base2,
             rows_written(w, &a));
    TU_CHECK(same(w, &a, &b), "%s base2=%d: mla_attention_absorbed differs with MLA_FLAG_FP8_MATH", cs, base2);
    outs_free(&a);
    outs_free(&b);
  }
  outs c = outs_new(w);
  mla_absorbed_args ac = args_of(w, &c, MLA_FLAG_FP8_MATH | 8u);
  TU_STATUS(mla_attention_absorbed(cpu, w->d.cache, 0, &w->d.plan, &ac, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(cpu), "flags") != NULL, "%s: the message names flags: %s", cs,
           mla_ctx_last_error(cpu));
  TU_CHECK(tu_all_poisoned(c.o, w->o_bytes) && tu_all_poisoned(c.lse, w->l_bytes), "%s: a refused call wrote",
           cs);
  outs_free(&c);
  free(ws);
}

/* mla_step_attention over the same batch (the step builds its metadata from
 * the request table): with and without the flag, bit for bit, and equal to
 * the host plan's result. */
static void step_calls(const world *w, const char *cs) {
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = w->d.mode;
  d.batch_size = w->d.bs;
  d.num_draft_tokens = w->d.ndt;
  d.max_kv_len = w->d.maxkv;
  d.num_heads = w->d.H;
  d.page_size = w->d.P;
  d.num_sm = NUM_SM;
  const int32_t *r2t = NULL;
  TU_STATUS(mla_req_table_data(w->d.rt, &r2t), MLA_OK);
  mla_step_inputs in = {r2t, w->d.maxkv, w->d.bs + NPAD, w->d.req_ids, w->d.seq, NULL};
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  void *ws = malloc(wsb ? wsb : 1);
  mla_status st = mla_step_prepare(cpu, &d, w->d.cache, &in, ws, wsb);
  TU_CHECK(st == MLA_OK, "%s: mla_step_prepare: %s", cs, mla_ctx_last_error(cpu));
  if (st != MLA_OK) {
    free(ws);
    return;
  }
  size_t pwb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(cpu, &w->d.plan, w->d.H, &pwb), MLA_OK);
  void *pw = malloc(pwb ? pwb : 1);
  const unsigned f = tu_uniform(&rng) < 0.5 ? MLA_FLAG_LSE_BASE2 : 0;
  outs a = outs_new(w), b = outs_new(w), p = outs_new(w);
  mla_absorbed_args aa = args_of(w, &a, f), ab = args_of(w, &b, f | MLA_FLAG_FP8_MATH), ap = args_of(w, &p, f);
  TU_STATUS(mla_step_attention(cpu, &d, w->d.cache, 0, &aa, ws, wsb), MLA_OK);
  st = mla_step_attention(cpu, &d, w->d.cache, 0, &ab, ws, wsb);
  TU_CHECK(st == MLA_OK, "%s: mla_step_attention with MLA_FLAG_FP8_MATH: %s (%s)", cs, mla_status_string(st),
           mla_ctx_last_error(cpu));
  TU_STATUS(mla_attention_absorbed(cpu, w->d.cache, 0, &w->d.plan, &ap, pw, pwb), MLA_OK);
  TU_CHECK(rows_written(w, &a) == 0, "%s: step: %d rows not written as expected", cs, rows_written(w, &a));
  TU_CHECK(same(w, &a, &b), "%s: mla_step_attention differs with MLA_FLAG_FP8_MATH", cs);
  TU_CHECK(same(w, &a, &p), "%s: mla_step_attention differs from the host plan's attention", cs);
  outs c = outs_new(w);
  mla_absorbed_args ac = args_of(w, &c, f | MLA_FLAG_FP8_MATH | 8u);
  TU_STATUS(mla_step_attention(cpu, &d, w->d.cache, 0, &ac, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(tu_all_poisoned(c.o, w->o_bytes) && tu_all_poisoned(c.lse, w->l_bytes),
           "%s: a refused step call wrote", cs);
  outs_free(&a);
  outs_free(&b);
  outs_free(&p);
  outs_free(&c);
  free(pw);
  free(ws);
}

static void run_case(mla_mode mode, int ndt, mla_dtype kv, int P, int H, int bs) {
  world w;
  memset(&w, 0, sizeof w);
  w.d.mode = mode;
  w.d.ndt = ndt;
  w.d.kv = kv;
  w.d.P = P;
  w.d.H = H;
  w.d.bs = bs;
  w.d.kv_scale = (float)(0.004 + 0.02 * tu_uniform(&rng));
  w.d.act = MLA_DTYPE_BF16;
  w.d.scale = SCALE;
  char cs[128];
  case_str(&w, cs, sizeof cs);
  if (world_build(&w) == 0) {
    absorbed_calls(&w, cs);
    step_calls(&w, cs);
  }
  world_free(&w);
}

/* The backend: an absorbed DECODE and an MHA EXTEND (no prefix), each with
 * and without the flag, bit for bit; an unknown bit refused. */
static void backend_calls(void) {
  const int H = 64, bs = 3, nope = 128, vd = 128, dqk = nope + MLA_ROPE;
  float kv_scale = 0.015f;
  mla_backend_desc d;
  memset(&d, 0, sizeof d);
  d.cache.num_layers = 1;
  d.cache.num_pages = 64;
  d.cache.page_size = 16;
  d.cache.dtype = MLA_DTYPE_FP8_E4M3;
  d.cache.fp8_scales = &kv_scale;
  d.max_reqs = 4;
  d.max_context = 256;
  d.max_bs = 4;
  d.max_q_tokens = 512;
  d.num_heads = H;
  d.scale = SCALE;
  d.act_dtype = MLA_DTYPE_F32;
  mla_backend *be = NULL;
  TU_STATUS(mla_backend_create(cpu, &d, &be), MLA_OK);
  if (!be) return;
  mla_req_table *rt = NULL;
  TU_STATUS(mla_backend_req_table(be, &rt), MLA_OK);
  int32_t ids[3], lens[3];
  const int prompt[3] = {70, 1, 33};
  int T = 0;
  for (int i = 0; i < bs; i++) {
    TU_STATUS(mla_req_add(rt, &ids[i]), MLA_OK);
    lens[i] = prompt[i];
    T += prompt[i];
  }
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)T);
  for (int i = 0, k = 0; i < bs; k += prompt[i], i++)
    TU_STATUS(mla_req_extend(rt, ids[i], prompt[i], slots + k), MLA_OK);
  float *c = malloc(sizeof(float) * (size_t)T * MLA_LATENT), *r = malloc(sizeof(float) * (size_t)T * MLA_ROPE);
  float *q = malloc(sizeof(float) * (size_t)T * H * dqk), *k = malloc(sizeof(float) * (size_t)T * H * dqk);
  float *v = malloc(sizeof(float) * (size_t)T * H * vd);
  tu_fill_bf16_normal(&rng, c, (int64_t)T * MLA_LATENT, 1.0);
  tu_fill_bf16_normal(&rng, r, (int64_t)T * MLA_ROPE, 1.0);
  tu_fill_bf16_normal(&rng, q, (int64_t)T * H * dqk, 1.0);
  tu_fill_bf16_normal(&rng, k, (int64_t)T * H * dqk, 1.0);
  tu_fill_bf16_normal(&rng, v, (int64_t)T * H * vd, 1.0);
  const size_t ob = sizeof(float) * (size_t)T * H * MLA_LATENT, lb = sizeof(float) * (size_t)T * H;
  float *o1 = malloc(ob), *o2 = malloc(ob), *l1 = malloc(lb), *l2 = malloc(lb);

  /* EXTEND without prefix: MHA over the prompt, rows written to the cache */
  mla_batch ext = {MLA_MODE_EXTEND, bs, ids, lens, NULL, NULL, 0};
  TU_STATUS(mla_backend_plan(be, &ext), MLA_OK);
  int uses = 0;
  TU_STATUS(mla_backend_uses_mha(be, &uses), MLA_OK);
  TU_CHECK(uses == 1, "an EXTEND without prefix runs MHA");
  mla_forward_args a;
  memset(&a, 0, sizeof a);
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = o1;
  a.lse = l1;
  a.num_new = T;
  a.new_slots = slots;
  a.new_c = c;
  a.new_r = r;
  const size_t mob = sizeof(float) * (size_t)T * H * vd;
  tu_poison(o1, ob);
  tu_poison(o2, ob);
  TU_STATUS(mla_backend_forward(be, &a), MLA_OK);
  mla_forward_args b = a;
  b.out = o2;
  b.lse = l2;
  b.num_new = 0; /* the rows are in */
  b.flags = MLA_FLAG_FP8_MATH;
  mla_status st = mla_backend_forward(be, &b);
  TU_CHECK(st == MLA_OK, "MHA EXTEND with MLA_FLAG_FP8_MATH: %s (%s)", mla_status_string(st),
           mla_backend_last_error(be));
  TU_CHECK(!tu_all_poisoned(o1, mob) && memcmp(o1, o2, mob) == 0 && memcmp(l1, l2, lb) == 0,
           "MHA EXTEND differs with MLA_FLAG_FP8_MATH");
  b.flags = MLA_FLAG_FP8_MATH | MLA_FLAG_LSE_BASE2;
  TU_STATUS(mla_backend_forward(be, &b), MLA_OK);
  int base2_ok = 1;
  for (int i = 0; i < T * H; i++) base2_ok &= fabs(l2[i] - l1[i] * 1.4426950408889634) <= 1e-5 * (1 + fabs(l2[i]));
  TU_CHECK(base2_ok, "MHA EXTEND with MLA_FLAG_FP8_MATH | MLA_FLAG_LSE_BASE2: lse not in base 2");

  /* DECODE (absorbed): one new token each; H = 64 rows per request */
  int32_t dslot[3];
  for (int i = 0; i < bs; i++) {
    TU_STATUS(mla_req_extend(rt, ids[i], 1, &dslot[i]), MLA_OK);
    lens[i] = prompt[i] + 1;
  }
  mla_batch dec = {MLA_MODE_DECODE, bs, ids, lens, NULL, NULL, 0};
  TU_STATUS(mla_backend_plan(be, &dec), MLA_OK);
  TU_STATUS(mla_backend_uses_mha(be, &uses), MLA_OK);
  TU_CHECK(uses == 0, "decode is absorbed");
  memset(&a, 0, sizeof a);
  a.num_new = bs;
  a.new_slots = dslot;
  a.new_c = c; /* the first rows again */
  a.new_r = r;
  a.q_nope = q; /* [bs, H, 512] + [bs, H, 64] fit in q */
  a.q_rope = q + (size_t)bs * H * MLA_LATENT;
  a.out = o1;
  a.lse = l1;
  const size_t dob = sizeof(float) * (size_t)bs * H * MLA_LATENT, dlb = sizeof(float) * (size_t)bs * H;
  tu_poison(o1, ob);
  tu_poison(o2, ob);
  TU_STATUS(mla_backend_forward(be, &a), MLA_OK);
  b = a;
  b.num_new = 0;
  b.out = o2;
  b.lse = l2;
  b.flags = MLA_FLAG_FP8_MATH;
  st = mla_backend_forward(be, &b);
  TU_CHECK(st == MLA_OK, "DECODE with MLA_FLAG_FP8_MATH: %s (%s)", mla_status_string(st), mla_backend_last_error(be));
  TU_CHECK(!tu_all_poisoned(o1, dob) && memcmp(o1, o2, dob) == 0 && memcmp(l1, l2, dlb) == 0,
           "DECODE through the backend differs with MLA_FLAG_FP8_MATH");
  tu_poison(o2, ob);
  b.flags = MLA_FLAG_FP8_MATH | 8u;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_backend_last_error(be), "flags") != NULL, "the message names flags: %s",
           mla_backend_last_error(be));
  TU_CHECK(tu_all_poisoned(o2, ob), "a refused forward wrote");

  /* mla_attention_ragged and mla_merge_states: not absorbed attention, the
   * flag is an unknown bit there */
  mla_ragged_args ra;
  memset(&ra, 0, sizeof ra);
  int32_t qo[2] = {0, 4};
  ra.batch_size = 1;
  ra.num_heads = ra.num_kv_heads = 1;
  ra.qk_dim = dqk;
  ra.v_dim = vd;
  ra.scale = SCALE;
  ra.causal = 1;
  ra.flags = MLA_FLAG_FP8_MATH;
  ra.act_dtype = MLA_DTYPE_F32;
  ra.qo_indptr = qo;
  ra.kv_indptr = qo;
  ra.q = q;
  ra.k = k;
  ra.v = v;
  ra.out = o2;
  ra.lse = l2;
  TU_STATUS(mla_attention_ragged(cpu, &ra), MLA_ERR_INVALID_ARGUMENT);
  ra.flags = 0;
  TU_STATUS(mla_attention_ragged(cpu, &ra), MLA_OK); /* the same call without it runs */
  const void *parts[2] = {o1, o1};
  const float *lses[2] = {l1, l1};
  TU_STATUS(mla_merge_states(cpu, 2, 2, 1, 64, MLA_DTYPE_F32, MLA_FLAG_FP8_MATH, parts, lses, o2, l2),
            MLA_ERR_INVALID_ARGUMENT);

  free(slots);
  free(c);
  free(r);
  free(q);
  free(k);
  free(v);
  free(o1);
  free(o2);
  free(l1);
  free(l2);
  mla_backend_destroy(be);
}

int main(void) {
  rng.s = tu_seed("test_fp8_math_flag", 77);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  if (!cpu) return tu_finish("test_fp8_math_flag");
  TU_CHECK(MLA_FLAG_FP8_MATH != MLA_FLAG_LSE_BASE2 && MLA_FLAG_FP8_MATH != MLA_FLAG_OUT_F32 &&
               (MLA_FLAG_FP8_MATH & (MLA_FLAG_FP8_MATH - 1)) == 0,
           "MLA_FLAG_FP8_MATH is a bit of its own");
  /* where CUDA would run fp8 math (per-tensor fp8, > 32 rows, pages >= 8) */
  run_case(MLA_MODE_DECODE, 0, MLA_DTYPE_FP8_E4M3, 64, 128, 7);
  run_case(MLA_MODE_DECODE, 0, MLA_DTYPE_FP8_E4M3, 16, 64, 6);
  run_case(MLA_MODE_TARGET_VERIFY, 2, MLA_DTYPE_FP8_E4M3, 64, 64, 6);
  run_case(MLA_MODE_TARGET_VERIFY, 4, MLA_DTYPE_FP8_E4M3, 16, 128, 5);
  run_case(MLA_MODE_DRAFT_EXTEND, 16, MLA_DTYPE_FP8_E4M3, 16, 3, 6);
  /* where it would not: other caches, small pages */
  run_case(MLA_MODE_DECODE, 0, MLA_DTYPE_BF16, 64, 128, 6);
  run_case(MLA_MODE_TARGET_VERIFY, 2, MLA_DTYPE_BF16, 16, 64, 6);
  run_case(MLA_MODE_DECODE, 0, MLA_DTYPE_FP8_E4M3_BLOCK, 64, 64, 6);
  run_case(MLA_MODE_DECODE, 0, MLA_DTYPE_FP8_E4M3, 4, 64, 6);
  backend_calls();
  mla_ctx_destroy(cpu);
  return tu_finish("test_fp8_math_flag");
}
