/* mla_step_* on a CPU context: the metadata a step builds from (req_to_token,
 * req_ids, seq_lens) equals mla_plan_build's for the same batch (lengths,
 * pages, split schedule), the step's attention equals mla_attention_absorbed
 * over the host plan bit for bit, for DECODE, TARGET_VERIFY and DRAFT_EXTEND
 * (fixed window) x page sizes 1, 16, 64 x heads 3, 16, with padding rows. The
 * same inputs reused with new lengths give the new plan's result (the
 * workspace carries no stale state). Refusals: out-of-range request ids,
 * lengths and slots (OUT_OF_RANGE, workspace untouched), and every bad
 * descriptor field. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_step_world.h"
#include "test_util.h"

static tu_rng rng;
static mla_ctx *cpu;

typedef struct run_out {
  void *o;
  float *lse;
} run_out;

static mla_absorbed_args args_of(const sw_world *w, run_out *ro) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = SW_SCALE;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = w->qn;
  a.q_rope = w->qr;
  a.out = ro->o;
  a.lse = ro->lse;
  return a;
}

/* The step's attention into a and the host plan's (w->plan) into b; with
 * ob / lb > 0, a and b are first allocated and poisoned (0xFF). */
static void step_and_plan(sw_world *w, const mla_step_desc *d, void *ws, size_t wsb, size_t ob, size_t lb,
                          run_out *a, run_out *b) {
  if (ob) {
    *a = (run_out){malloc(ob), malloc(lb)};
    *b = (run_out){malloc(ob), malloc(lb)};
    tu_poison(a->o, ob);
    tu_poison(a->lse, lb);
    tu_poison(b->o, ob);
    tu_poison(b->lse, lb);
  }
  mla_absorbed_args aa = args_of(w, a), ab = args_of(w, b);
  TU_STATUS(mla_step_attention(cpu, d, w->cache, 0, &aa, ws, wsb), MLA_OK);
  size_t pwb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(cpu, &w->plan, w->H, &pwb), MLA_OK);
  void *pw = malloc(pwb);
  TU_STATUS(mla_attention_absorbed(cpu, w->cache, 0, &w->plan, &ab, pw, pwb), MLA_OK);
  free(pw);
}

static void one_case(mla_mode mode, int ndt, int P, int H) {
  char name[96];
  snprintf(name, sizeof name, "mode=%d ndt=%d P=%d H=%d", (int)mode, ndt, P, H);
  sw_world w;
  if (sw_make(&w, cpu, &rng, mode, ndt, P, H, 12) != 0) {
    TU_CHECK(0, "%s: world setup: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, NULL};
  for (int round = 0; round < 3; round++) {
    const int bs = round == 0 ? 12 : round == 1 ? 9 : 12, npad = round == 0 ? 0 : round == 1 ? 3 : 5;
    if (sw_batch(&w, cpu, &rng, bs, npad) != 0) {
      TU_CHECK(0, "%s: batch: %s", name, mla_ctx_last_error(cpu));
      break;
    }
    mla_step_desc d = sw_desc(&w);
    size_t wsb = 0;
    TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
    void *ws = malloc(wsb);
    tu_poison(ws, wsb);
    TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_OK);
    mla_step_metadata m;
    TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_OK);
    TU_CHECK(m.batch_size == bs && m.q_len == (mode == MLA_MODE_DECODE ? 1 : ndt) &&
                 m.block_table_width == (w.max_context + P - 1) / P && m.max_splits == bs + m.num_sm_parts,
             "%s: metadata shape", name);
    const int bad = sw_compare_meta(&w, &m, m.qo_indptr, m.kv_lens, m.block_table, m.sched_meta, m.num_splits);
    TU_CHECK(bad == 0, "%s round %d: %d metadata fields differ from mla_plan_build", name, round, bad);

    /* attention: step vs host plan, bit for bit */
    const size_t ob = 2 * (size_t)w.Tq * H * MLA_LATENT, lb = sizeof(float) * (size_t)w.Tq * H;
    run_out a, b;
    step_and_plan(&w, &d, ws, wsb, ob, lb, &a, &b);
    TU_CHECK(memcmp(a.o, b.o, ob) == 0 && memcmp(a.lse, b.lse, lb) == 0,
             "%s round %d: step attention differs from the host-plan attention", name, round);
    /* live rows are real results (not poison) */
    int poisoned = 0;
    for (int i = 0; i < bs; i++)
      if (w.req_ids[i] != MLA_REQ_PAD)
        poisoned += tu_all_poisoned((char *)a.o + 2 * (size_t)i * sw_q_len(&w) * H * MLA_LATENT, 2 * MLA_LATENT);
    TU_CHECK(poisoned == 0, "%s: %d live rows left unwritten", name, poisoned);

    /* refusals leave the workspace as it was */
    if (round == 0) {
      void *copy = malloc(wsb);
      memcpy(copy, ws, wsb);
      int32_t save_id = w.req_ids[2], save_seq = w.seq[2];
      w.req_ids[2] = w.max_reqs;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.req_ids[2] = -7;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.req_ids[2] = save_id;
      w.seq[2] = w.max_context + 1;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.seq[2] = -1;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.seq[2] = save_seq;
      /* a slot that does not start a page (P > 1), or one past the cache */
      int32_t *r2t = malloc(sizeof(int32_t) * (size_t)w.max_reqs * w.max_context);
      memcpy(r2t, w.r2t, sizeof(int32_t) * (size_t)w.max_reqs * w.max_context);
      int row = 0;
      while (w.req_ids[row] == MLA_REQ_PAD) row++;
      int32_t *first = &r2t[(size_t)w.req_ids[row] * w.max_context];
      const int32_t keep = *first;
      mla_step_inputs bad_in = in;
      bad_in.req_to_token = r2t;
      if (P > 1) {
        *first = keep + 1;
        TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      }
      mla_kv_cache_desc cdsc;
      mla_kv_cache_get_desc(w.cache, &cdsc);
      *first = cdsc.num_pages * P;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      *first = -P;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      *first = keep;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_OK);
      TU_CHECK(memcmp(copy, ws, wsb) == 0, "%s: a refused or repeated prepare changed the workspace", name);
      free(r2t);
      free(copy);
    }
    free(a.o);
    free(a.lse);
    free(b.o);
    free(b.lse);
    free(ws);
  }
  sw_free(&w);
}

/* EXTEND steps (the capturable paged prefill): live rows with extend lens
 * (0..300, one row without a prefix; `small`: 0..4) and padding rows, the
 * bucket num_tokens at or above their sum. The metadata equals
 * mla_plan_build's for the same EXTEND batch (its num_sm chosen so both have
 * the same part count: the schedule then matches too) and the attention bit
 * for bit; rows past the real total are left untouched. Refusals: an extend
 * len past seq_len or negative, lens over the bucket (OUT_OF_RANGE, the
 * workspace unchanged), NULL extend_lens, num_tokens out of range or set
 * outside EXTEND, num_draft_tokens set. */
static void extend_case(int P, int H, int small) {
  char name[96];
  snprintf(name, sizeof name, "extend step P=%d H=%d%s", P, H, small ? " small" : "");
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_EXTEND, 0, P, H, 12) != 0) {
    TU_CHECK(0, "%s: world setup: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  const int bs = 14, npad = 3;
  w.bs = bs;
  int32_t ids[SW_MAXB], rows[SW_MAXB], ext[SW_MAXB], pre[SW_MAXB];
  for (int i = 0; i < w.num_live; i++) ids[i] = i;
  tu_shuffle_i32(&rng, ids, w.num_live);
  for (int i = 0; i < bs; i++) rows[i] = i < npad ? MLA_REQ_PAD : ids[i - npad];
  tu_shuffle_i32(&rng, rows, bs);
  int total = 0, whole = -1;
  for (int i = 0; i < bs; i++) {
    w.req_ids[i] = rows[i];
    if (rows[i] == MLA_REQ_PAD) {
      w.seq[i] = 1;
      ext[i] = tu_randint(&rng, 0, 1);
    } else {
      const int len = w.live_len[rows[i]];
      w.seq[i] = tu_randint(&rng, len / 2 > 0 ? len / 2 : 1, len);
      const int cap = small ? 4 : 300;
      ext[i] = tu_randint(&rng, 0, w.seq[i] < cap ? w.seq[i] : cap);
      if (!small && whole < 0 && w.seq[i] <= 400) { /* a request without prefix */
        ext[i] = w.seq[i];
        whole = i;
      }
    }
    pre[i] = w.seq[i] - ext[i];
    total += ext[i];
  }
  const int bucket = total + tu_randint(&rng, 0, 40);
  mla_step_desc d = sw_desc(&w);
  d.num_draft_tokens = 0;
  d.num_tokens = bucket;
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, ext};
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  void *ws = malloc(wsb);
  tu_poison(ws, wsb);
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_OK);
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_OK);
  TU_CHECK(m.q_len == bucket && m.qo_indptr[bs] == total, "%s: q_len %d (bucket %d), qo_indptr[bs] %d (total %d)",
           name, (int)m.q_len, bucket, (int)m.qo_indptr[bs], total);

  /* the host plan of the same batch, with the step's part count */
  int maxq = 1;
  for (int i = 0; i < bs; i++)
    if (ext[i] > maxq) maxq = ext[i];
  const int tiles = (maxq * H + 63) / 64;
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = MLA_MODE_EXTEND;
  b.batch_size = bs;
  b.req_ids = w.req_ids;
  b.seq_lens = w.seq;
  b.prefix_lens = pre;
  mla_plan_limits lim = {bs, total + 1, bs * w.max_context, w.max_context, P, m.num_sm_parts * tiles, 0};
  size_t pb = 0;
  TU_STATUS(mla_plan_workspace_size(cpu, &lim, &pb), MLA_OK);
  w.pws = malloc(pb);
  mla_status st = mla_plan_build(cpu, w.rt, &b, &lim, H, w.pws, pb, &w.plan);
  TU_CHECK(st == MLA_OK, "%s: mla_plan_build: %s", name, mla_ctx_last_error(cpu));
  if (st != MLA_OK) {
    free(ws);
    sw_free(&w);
    return;
  }
  const int bad = sw_compare_meta(&w, &m, m.qo_indptr, m.kv_lens, m.block_table, m.sched_meta, m.num_splits);
  TU_CHECK(bad == 0, "%s: %d metadata fields differ from mla_plan_build (parts %d / %d)", name, bad,
           (int)m.num_sm_parts, (int)w.plan.num_sm_parts);

  /* attention over a bucket-sized q / out: step vs plan, bit for bit */
  const int64_t nq = (int64_t)bucket * H;
  float *tmp = malloc(sizeof(float) * (size_t)nq * MLA_LATENT);
  w.qn = malloc(2 * (size_t)nq * MLA_LATENT);
  w.qr = malloc(2 * (size_t)nq * MLA_ROPE);
  tu_fill_bf16_normal(&rng, tmp, nq * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, w.qn, nq * MLA_LATENT);
  tu_fill_bf16_normal(&rng, tmp, nq * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, w.qr, nq * MLA_ROPE);
  free(tmp);
  const size_t ob = 2 * (size_t)nq * MLA_LATENT, lb = sizeof(float) * (size_t)nq;
  run_out ra, rb;
  step_and_plan(&w, &d, ws, wsb, ob, lb, &ra, &rb);
  const size_t used = 2 * (size_t)total * H * MLA_LATENT;
  TU_CHECK(memcmp(ra.o, rb.o, used) == 0 && memcmp(ra.lse, rb.lse, sizeof(float) * (size_t)total * H) == 0,
           "%s: step attention differs from the host-plan attention", name);
  TU_CHECK(tu_all_poisoned((char *)ra.o + used, ob - used) &&
               tu_all_poisoned(ra.lse + (size_t)total * H, lb - sizeof(float) * (size_t)total * H),
           "%s: rows past the real total were written", name);
  int unwritten = 0; /* live rows see at least their own key (padding rows read the dummy slot) */
  for (int i = 0; i < bs; i++)
    if (w.req_ids[i] != MLA_REQ_PAD)
      for (int64_t r = (int64_t)m.qo_indptr[i] * H; r < (int64_t)m.qo_indptr[i + 1] * H; r++)
        unwritten += isnan(ra.lse[r]) || isinf(ra.lse[r]);
  TU_CHECK(unwritten == 0, "%s: %d live query rows without a result", name, unwritten);

  /* refusals: nothing written */
  void *copy = malloc(wsb);
  memcpy(copy, ws, wsb);
  int k = 0;
  while (w.req_ids[k] == MLA_REQ_PAD) k++;
  const int32_t keep = ext[k];
  ext[k] = w.seq[k] + 1;
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  ext[k] = -1;
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  ext[k] = keep;
  mla_step_desc dd = d;
  dd.num_tokens = total - 1;
  if (total > 1) TU_STATUS(mla_step_prepare(cpu, &dd, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  TU_CHECK(memcmp(copy, ws, wsb) == 0, "%s: a refused prepare changed the workspace", name);
  mla_step_inputs no_ext = in;
  no_ext.extend_lens = NULL;
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &no_ext, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  size_t n = 0;
  dd = d;
  dd.num_tokens = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &dd, &n), MLA_ERR_INVALID_ARGUMENT);
  dd.num_tokens = 65537;
  TU_STATUS(mla_step_workspace_size(cpu, &dd, &n), MLA_ERR_INVALID_ARGUMENT);
  dd.num_tokens = 40000;
  dd.num_heads = 128;
  TU_STATUS(mla_step_workspace_size(cpu, &dd, &n), MLA_ERR_UNSUPPORTED);
  dd = d;
  dd.num_draft_tokens = 2;
  TU_STATUS(mla_step_workspace_size(cpu, &dd, &n), MLA_ERR_INVALID_ARGUMENT);
  dd = d;
  dd.mode = MLA_MODE_DECODE;
  TU_STATUS(mla_step_workspace_size(cpu, &dd, &n), MLA_ERR_INVALID_ARGUMENT); /* num_tokens outside EXTEND */
  free(copy);
  free(ra.o), free(ra.lse), free(rb.o), free(rb.lse), free(ws);
  sw_free(&w);
}

/* Multi-step draft: one prepare builds num_steps DECODE steps, step k with
 * kv = seq_len + k + 1; each equals mla_plan_build's DECODE plan for those
 * lengths, and its attention equals the plan path's bit for bit. */
static void draft_case(int P, int H, int num_steps) {
  char name[64];
  snprintf(name, sizeof name, "draft P=%d H=%d steps=%d", P, H, num_steps);
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, P, H, 10) != 0 || sw_batch(&w, cpu, &rng, 10, 2) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  for (int i = 0; i < w.bs; i++)
    if (w.req_ids[i] != MLA_REQ_PAD) w.seq[i] = w.seq[i] > num_steps ? w.seq[i] - num_steps : 0;
  mla_step_desc d = sw_desc(&w);
  d.num_steps = num_steps;
  size_t wsb = 0, one = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  mla_step_desc d1 = sw_desc(&w);
  TU_STATUS(mla_step_workspace_size(cpu, &d1, &one), MLA_OK);
  TU_CHECK(wsb > one * (size_t)(num_steps - 1), "%s: workspace %zu for %d steps of %zu", name, wsb, num_steps, one);
  void *ws = malloc(wsb);
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, NULL};
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_OK);
  const size_t ob = 2 * (size_t)w.bs * H * MLA_LATENT;
  run_out a = {malloc(ob), NULL}, b = {malloc(ob), NULL};
  for (int k = 0; k < num_steps; k++) {
    int32_t seqk[SW_MAXB];
    for (int i = 0; i < w.bs; i++) seqk[i] = w.seq[i] + k + 1;
    mla_batch bt;
    memset(&bt, 0, sizeof bt);
    bt.mode = MLA_MODE_DECODE;
    bt.batch_size = w.bs;
    bt.req_ids = w.req_ids;
    bt.seq_lens = seqk;
    mla_plan_limits lim = {w.bs, w.bs, w.bs * w.max_context, w.max_context, P, SW_NUM_SM, 0};
    size_t pb = 0;
    TU_STATUS(mla_plan_workspace_size(cpu, &lim, &pb), MLA_OK);
    void *pws = malloc(pb);
    mla_status st = mla_plan_build(cpu, w.rt, &bt, &lim, H, pws, pb, &w.plan);
    TU_CHECK(st == MLA_OK, "%s: plan: %s", name, mla_ctx_last_error(cpu));
    d.step = k;
    mla_step_metadata m;
    TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_OK);
    const int bad = sw_compare_meta(&w, &m, m.qo_indptr, m.kv_lens, m.block_table, m.sched_meta, m.num_splits);
    TU_CHECK(bad == 0, "%s: step %d: %d metadata fields differ from the DECODE plan", name, k, bad);
    step_and_plan(&w, &d, ws, wsb, 0, 0, &a, &b);
    TU_CHECK(memcmp(a.o, b.o, ob) == 0, "%s: step %d attention differs from the plan path", name, k);
    free(pws);
  }
  /* refusals specific to draft steps */
  d.step = num_steps;
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_ERR_INVALID_ARGUMENT);
  d.step = 0;
  d.mode = MLA_MODE_TARGET_VERIFY;
  d.num_draft_tokens = 2;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d = sw_desc(&w);
  d.num_steps = 17;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d.num_steps = 0;
  d.step = 1;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  /* a request too short for the last step: refused before anything is written */
  d = sw_desc(&w);
  d.num_steps = num_steps;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  int row = 0;
  while (w.req_ids[row] == MLA_REQ_PAD) row++;
  w.seq[row] = w.max_context - num_steps + 1;
  tu_poison(ws, wsb);
  void *copy = malloc(wsb);
  memcpy(copy, ws, wsb);
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  TU_CHECK(memcmp(copy, ws, wsb) == 0, "%s: a refused draft prepare wrote into the workspace", name);
  free(copy);
  free(a.o);
  free(b.o);
  free(ws);
  sw_free(&w);
}

/* Decode context parallel on one CPU: a global request table (page size
 * Pg) and a global cache as the single-device reference; N rank caches of
 * page size Pg / N holding position p of every request at rank p mod N,
 * local slot = global slot / N. Each rank's DCP step (same req_to_token)
 * attends its shard with LSE; merging the N states equals the reference
 * (f32 activations: within 2e-5), including requests shorter than N (ranks
 * with no keys: lse = -inf) and padding rows. */
static void dcp_case(int Pg, int N, int H) {
  char name[64];
  snprintf(name, sizeof name, "dcp Pg=%d N=%d H=%d", Pg, N, H);
  const int bs = 7, max_ctx = 700;
  int lens[7] = {1, N - 1 > 0 ? N - 1 : 1, 300, 650, 64, 17, 1};
  int pages = 4;
  for (int i = 0; i < bs; i++) pages += (lens[i] + Pg - 1) / Pg + 1;
  mla_kv_cache_desc gd = {1, pages, Pg, MLA_DTYPE_BF16, NULL}, ld = {1, pages, Pg / N, MLA_DTYPE_BF16, NULL};
  mla_kv_cache *gc = NULL, *lc[8] = {0};
  mla_req_table *rt = NULL;
  mla_req_table_desc rd = {bs + 2, max_ctx, pages, Pg};
  TU_STATUS(mla_kv_cache_create(cpu, &gd, &gc), MLA_OK);
  for (int r = 0; r < N; r++) TU_STATUS(mla_kv_cache_create(cpu, &ld, &lc[r]), MLA_OK);
  TU_STATUS(mla_req_table_create(cpu, &rd, gc, &rt), MLA_OK);
  int32_t ids[8], seq[8];
  for (int i = 0; i < bs; i++) {
    TU_STATUS(mla_req_add(rt, &ids[i]), MLA_OK);
    int32_t *sl = malloc(sizeof(int32_t) * lens[i]);
    TU_STATUS(mla_req_extend(rt, ids[i], lens[i], sl), MLA_OK);
    float *c = malloc(sizeof(float) * lens[i] * MLA_LATENT), *r = malloc(sizeof(float) * lens[i] * MLA_ROPE);
    for (int64_t k = 0; k < (int64_t)lens[i] * MLA_LATENT; k++) c[k] = (float)tu_normal(&rng);
    for (int64_t k = 0; k < (int64_t)lens[i] * MLA_ROPE; k++) r[k] = (float)tu_normal(&rng);
    TU_STATUS(mla_kv_cache_write(gc, 0, lens[i], sl, c, r, MLA_DTYPE_F32), MLA_OK);
    /* each rank writes its share of the rows (mla_kv_cache_write_shard) */
    int misplaced = 0;
    for (int p = 0; p < lens[i]; p++) misplaced += sl[p] % N != p % N;
    TU_CHECK(misplaced == 0, "%s: %d positions whose slot is not on rank p mod N", name, misplaced);
    for (int rk = 0; rk < N; rk++)
      TU_STATUS(mla_kv_cache_write_shard(lc[rk], 0, lens[i], sl, c, r, MLA_DTYPE_F32, N, rk), MLA_OK);
    seq[i] = lens[i];
    free(sl);
    free(c);
    free(r);
  }
  ids[bs - 1] = MLA_REQ_PAD; /* a padding row */
  seq[bs - 1] = 1;
  const int32_t *r2t = NULL;
  mla_req_table_data(rt, &r2t);
  mla_step_inputs in = {r2t, max_ctx, bs + 2, ids, seq, NULL};
  const int64_t nq = (int64_t)bs * H;
  float *qn = malloc(sizeof(float) * nq * MLA_LATENT), *qr = malloc(sizeof(float) * nq * MLA_ROPE);
  for (int64_t k = 0; k < nq * MLA_LATENT; k++) qn[k] = (float)tu_normal(&rng);
  for (int64_t k = 0; k < nq * MLA_ROPE; k++) qr[k] = (float)tu_normal(&rng);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = SW_SCALE;
  a.act_dtype = MLA_DTYPE_F32;
  a.q_nope = qn;
  a.q_rope = qr;
  /* reference: one device, all keys */
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = MLA_MODE_DECODE;
  d.batch_size = bs;
  d.max_kv_len = max_ctx;
  d.num_heads = H;
  d.page_size = Pg;
  d.num_sm = 5;
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  void *ws = malloc(wsb);
  float *o_ref = malloc(sizeof(float) * nq * MLA_LATENT), *l_ref = malloc(sizeof(float) * nq);
  a.out = o_ref;
  a.lse = l_ref;
  TU_STATUS(mla_step_prepare(cpu, &d, gc, &in, ws, wsb), MLA_OK);
  TU_STATUS(mla_step_attention(cpu, &d, gc, 0, &a, ws, wsb), MLA_OK);
  free(ws);
  /* the ranks */
  float *o_r[8], *l_r[8];
  for (int r = 0; r < N; r++) {
    mla_step_desc dr = d;
    dr.page_size = Pg / N;
    dr.dcp_world = N;
    dr.dcp_rank = r;
    TU_STATUS(mla_step_workspace_size(cpu, &dr, &wsb), MLA_OK);
    ws = malloc(wsb);
    o_r[r] = malloc(sizeof(float) * nq * MLA_LATENT);
    l_r[r] = malloc(sizeof(float) * nq);
    a.out = o_r[r];
    a.lse = l_r[r];
    TU_STATUS(mla_step_prepare(cpu, &dr, lc[r], &in, ws, wsb), MLA_OK);
    mla_step_metadata m;
    TU_STATUS(mla_step_get_metadata(cpu, &dr, ws, wsb, &m), MLA_OK);
    int bad = 0;
    for (int i = 0; i < bs; i++) {
      const int kv = seq[i];
      bad += m.kv_lens[i] != (kv > r ? (kv - r + N - 1) / N : 0);
    }
    TU_CHECK(bad == 0, "%s rank %d: local kv lengths", name, r);
    TU_STATUS(mla_step_attention(cpu, &dr, lc[r], 0, &a, ws, wsb), MLA_OK);
    free(ws);
  }
  float *o_m = malloc(sizeof(float) * nq * MLA_LATENT), *l_m = malloc(sizeof(float) * nq);
  TU_STATUS(mla_merge_states(cpu, N, bs, H, MLA_LATENT, MLA_DTYPE_F32, 0, (const void *const *)o_r,
                             (const float *const *)l_r, o_m, l_m),
            MLA_OK);
  double worst = 0, lworst = 0;
  for (int64_t k = 0; k < (int64_t)(bs - 1) * H * MLA_LATENT; k++) {
    const double e = fabs((double)o_m[k] - o_ref[k]);
    if (!(e <= worst)) worst = e;
  }
  for (int64_t k = 0; k < (int64_t)(bs - 1) * H; k++) {
    const double e = fabs((double)l_m[k] - l_ref[k]);
    if (!(e <= lworst)) lworst = e;
  }
  TU_CHECK(worst < 2e-5 && lworst < 2e-5, "%s: merged ranks vs one device: max |o| err %.3g, lse err %.3g", name,
           worst, lworst);
  /* shard-write refusals: bad world / rank, a local slot past the rank's cache; nothing written */
  {
    int32_t gs[2] = {0, pages * Pg + N * 3}; /* the second row's local slot is out of range on rank (N*3) % N = 0 */
    float cz[2 * MLA_LATENT] = {0}, rz[2 * MLA_ROPE] = {0};
    TU_STATUS(mla_kv_cache_write_shard(lc[0], 0, 2, gs, cz, rz, MLA_DTYPE_F32, 3, 0), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_write_shard(lc[0], 0, 2, gs, cz, rz, MLA_DTYPE_F32, N, N), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_write_shard(lc[0], 0, 2, gs, cz, rz, MLA_DTYPE_F32, N, 0), MLA_ERR_OUT_OF_RANGE);
    gs[1] = -1;
    TU_STATUS(mla_kv_cache_write_shard(lc[0], 0, 2, gs, cz, rz, MLA_DTYPE_F32, N, 0), MLA_ERR_OUT_OF_RANGE);
  }
  /* refusals */
  mla_step_desc bad_d = d;
  bad_d.dcp_world = 3;
  TU_STATUS(mla_step_workspace_size(cpu, &bad_d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  bad_d.dcp_world = N;
  bad_d.dcp_rank = N;
  TU_STATUS(mla_step_workspace_size(cpu, &bad_d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  bad_d.dcp_rank = 0;
  bad_d.mode = MLA_MODE_TARGET_VERIFY;
  bad_d.num_draft_tokens = 2;
  TU_STATUS(mla_step_workspace_size(cpu, &bad_d, &wsb), MLA_ERR_UNSUPPORTED);
  for (int r = 0; r < N; r++) {
    free(o_r[r]);
    free(l_r[r]);
    mla_kv_cache_destroy(lc[r]);
  }
  free(o_m);
  free(l_m);
  free(o_ref);
  free(l_ref);
  free(qn);
  free(qr);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(gc);
}

static void refusals(void) {
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, 16, 4, 4) != 0 || sw_batch(&w, cpu, &rng, 4, 1) != 0) {
    TU_CHECK(0, "refusal world: %s", mla_ctx_last_error(cpu));
    return;
  }
  const mla_step_desc good = sw_desc(&w);
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &good, &wsb), MLA_OK);
  void *ws = malloc(wsb);
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, NULL};
  mla_step_desc d;
#define BAD_DESC(field, value)                                               \
  do {                                                                       \
    d = good;                                                                \
    d.field = value;                                                         \
    size_t n_ = 0;                                                           \
    TU_STATUS(mla_step_workspace_size(cpu, &d, &n_), MLA_ERR_INVALID_ARGUMENT); \
    TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_INVALID_ARGUMENT); \
  } while (0)
  BAD_DESC(mode, MLA_MODE_EXTEND);
  BAD_DESC(mode, MLA_MODE_IDLE);
  BAD_DESC(batch_size, 0);
  BAD_DESC(batch_size, 8193);
  BAD_DESC(num_draft_tokens, 2); /* DECODE takes none */
  BAD_DESC(max_kv_len, 0);
  BAD_DESC(num_heads, 0);
  BAD_DESC(num_heads, MLA_MAX_HEADS + 1);
  BAD_DESC(page_size, 3);
  BAD_DESC(page_size, 512);
  BAD_DESC(num_sm, -1);
  BAD_DESC(num_sm, 1025);
  d = good;
  d.mode = MLA_MODE_TARGET_VERIFY;
  d.num_draft_tokens = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d.num_draft_tokens = 65;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(cpu, &good, &wsb), MLA_OK);
  TU_STATUS(mla_step_workspace_size(cpu, NULL, &wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(cpu, &good, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(NULL, &good, &wsb), MLA_ERR_INVALID_ARGUMENT);
  /* page size that differs from the cache's */
  d = good;
  d.page_size = 32;
  size_t wsb32 = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb32), MLA_OK);
  void *ws32 = malloc(wsb32);
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws32, wsb32), MLA_ERR_INVALID_ARGUMENT);
  free(ws32);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, ws, wsb - 1), MLA_ERR_WORKSPACE_TOO_SMALL);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, NULL, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, NULL, &in, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, NULL, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  mla_step_inputs bi = in;
  bi.req_to_token_stride = good.max_kv_len - 1;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  bi = in;
  bi.seq_lens = NULL;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  bi = in;
  bi.max_reqs = 0;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, ws, wsb), MLA_OK);
  /* attention with heads other than the workspace was sized for */
  const size_t ob = 2 * (size_t)w.Tq * w.H * MLA_LATENT;
  run_out ro = {malloc(ob), NULL};
  mla_absorbed_args a = args_of(&w, &ro);
  a.num_heads = w.H + 1;
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  a.num_heads = w.H;
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 1, &a, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, NULL, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb / 2), MLA_ERR_WORKSPACE_TOO_SMALL);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb), MLA_OK);
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(cpu, &good, ws, wsb, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_get_metadata(cpu, &good, ws, 16, &m), MLA_ERR_WORKSPACE_TOO_SMALL);
  free(ro.o);
  free(ws);
  sw_free(&w);
}

int main(void) {
  rng.s = tu_seed("test_step", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  if (mla_ctx_create(&cd, &cpu) != MLA_OK) {
    TU_CHECK(0, "mla_ctx_create failed");
    return tu_finish("test_step");
  }
  const int Ps[3] = {1, 16, 64};
  for (int pi = 0; pi < 3; pi++) {
    one_case(MLA_MODE_DECODE, 0, Ps[pi], pi == 1 ? 3 : 16);
    one_case(MLA_MODE_TARGET_VERIFY, 3, Ps[pi], pi == 2 ? 3 : 16);
    one_case(MLA_MODE_DRAFT_EXTEND, 2, Ps[pi], 3);
  }
  draft_case(16, 16, 3);
  draft_case(1, 3, 4);
  draft_case(64, 128, 2);
  dcp_case(16, 2, 16);
  dcp_case(64, 4, 3);
  dcp_case(8, 8, 1);
  extend_case(16, 16, 0);
  extend_case(1, 3, 0);
  extend_case(64, 16, 1);
  refusals();
  mla_ctx_destroy(cpu);
  return tu_finish("test_step");
}
