/* Test helper shared by tests/test_step.c and tests/test_cuda_step.c: a
 * bf16 cache and request table on a CPU context (pages handed out shuffled,
 * unowned rows NaN), a decode-type batch over them with padding rows, the
 * host plan mla_plan_build makes for it, and bf16 queries. */
#ifndef MLA_TEST_STEP_WORLD_H
#define MLA_TEST_STEP_WORLD_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

#define SW_MAXB 64
#define SW_NUM_SM 24 /* split-schedule target of both the plan and the step */
static const float SW_SCALE = 0.0721687836f;

typedef struct sw_world {
  mla_mode mode;
  int ndt, P, H, bs, max_context, max_reqs, num_live;
  mla_kv_cache *cache;
  mla_req_table *rt;
  const int32_t *r2t;         /* [max_reqs, max_context] */
  int32_t live_len[SW_MAXB];  /* length of live request i (ids 0..num_live-1) */
  int32_t req_ids[SW_MAXB], seq[SW_MAXB];
  int Tq;
  void *pws;
  mla_plan plan;
  uint16_t *qn, *qr;          /* bf16 [Tq, H, 512], [Tq, H, 64] */
} sw_world;

static int sw_q_len(const sw_world *w) { return w->mode == MLA_MODE_DECODE ? 1 : w->ndt; }
static int sw_kv_extra(const sw_world *w) { return w->mode == MLA_MODE_TARGET_VERIFY ? w->ndt : 0; }

/* num_live requests (request 0 long enough to be split), filled with
 * N(0,1) rows; unowned rows stay NaN. */
static int sw_make(sw_world *w, mla_ctx *cpu, tu_rng *r, mla_mode mode, int ndt, int P, int H, int num_live) {
  memset(w, 0, sizeof *w);
  w->mode = mode;
  w->ndt = ndt;
  w->P = P;
  w->H = H;
  w->num_live = num_live;
  w->max_context = 2600;
  w->max_reqs = num_live + 6;
  int pages = 8;
  for (int i = 0; i < num_live; i++) {
    w->live_len[i] = i == 0 ? tu_randint(r, 1900, 2200) : tu_randint(r, ndt + 1, 400);
    pages += (w->live_len[i] + P - 1) / P + 1;
  }
  mla_kv_cache_desc cd = {1, pages, P, MLA_DTYPE_BF16, NULL};
  mla_req_table_desc rd = {w->max_reqs, w->max_context, pages, P};
  if (mla_kv_cache_create(cpu, &cd, &w->cache) != MLA_OK || mla_req_table_create(cpu, &rd, w->cache, &w->rt) != MLA_OK)
    return -1;
  tu_poison_cache(w->cache);
  /* pages handed out in a scrambled order: a few requests grab and free some first */
  int32_t tmp[6];
  for (int p = 0; p < 6; p++) {
    if (mla_req_add(w->rt, &tmp[p]) != MLA_OK || mla_req_extend(w->rt, tmp[p], P * (p + 1), NULL) != MLA_OK) return -1;
  }
  tu_shuffle_i32(r, tmp, 6);
  for (int p = 0; p < 6; p++) mla_req_free(w->rt, tmp[p]);
  for (int i = 0; i < num_live; i++) {
    int32_t id;
    if (mla_req_add(w->rt, &id) != MLA_OK || id != i) return -1;
  }
  int have[SW_MAXB] = {0}, left = 1;
  while (left) {
    left = 0;
    for (int i = 0; i < num_live; i++) {
      int n = w->live_len[i] - have[i];
      if (n <= 0) continue;
      int step = tu_randint(r, 1, n < 2 * P ? n : 2 * P);
      if (mla_req_extend(w->rt, i, step, NULL) != MLA_OK) return -1;
      have[i] += step;
      left |= have[i] < w->live_len[i];
    }
  }
  mla_req_table_data(w->rt, &w->r2t);
  int tk = 0;
  for (int i = 0; i < num_live; i++) tk += w->live_len[i];
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)tk);
  float *cf = malloc(sizeof(float) * (size_t)tk * MLA_LATENT);
  float *rf = malloc(sizeof(float) * (size_t)tk * MLA_ROPE);
  int k = 0;
  for (int i = 0; i < num_live; i++)
    for (int j = 0; j < w->live_len[i]; j++) slots[k++] = w->r2t[(size_t)i * w->max_context + j];
  for (int64_t i = 0; i < (int64_t)tk * MLA_LATENT; i++) cf[i] = (float)tu_normal(r);
  for (int64_t i = 0; i < (int64_t)tk * MLA_ROPE; i++) rf[i] = (float)tu_normal(r);
  mla_status st = mla_kv_cache_write(w->cache, 0, tk, slots, cf, rf, MLA_DTYPE_F32);
  free(slots);
  free(cf);
  free(rf);
  return st == MLA_OK ? 0 : -1;
}

/* A batch of bs rows: live requests in random order (each used at most
 * once, seq_len up to its length), npad padding rows (seq_len 1) at random
 * places. Then the host plan and fresh bf16 queries. */
static int sw_batch(sw_world *w, mla_ctx *cpu, tu_rng *r, int bs, int npad) {
  if (bs > SW_MAXB || bs - npad > w->num_live) return -1;
  w->bs = bs;
  int32_t ids[SW_MAXB];
  for (int i = 0; i < w->num_live; i++) ids[i] = i;
  tu_shuffle_i32(r, ids, w->num_live);
  /* the long request 0 first among the live rows, so the schedule cuts it */
  for (int i = 0; i < w->num_live; i++)
    if (ids[i] == 0) {
      ids[i] = ids[0];
      ids[0] = 0;
    }
  int32_t rows[SW_MAXB];
  for (int i = 0; i < bs; i++) rows[i] = i < npad ? MLA_REQ_PAD : ids[i - npad];
  tu_shuffle_i32(r, rows, bs);
  const int extra = sw_kv_extra(w);
  for (int i = 0; i < bs; i++) {
    w->req_ids[i] = rows[i];
    if (rows[i] == MLA_REQ_PAD) {
      w->seq[i] = 1;
    } else {
      /* kv = seq + extra must stay within the request; the long request keeps its length */
      const int len = w->live_len[rows[i]];
      w->seq[i] = rows[i] == 0 ? len - extra : tu_randint(r, (len - extra) / 2, len - extra);
    }
  }
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = w->mode;
  b.batch_size = bs;
  b.req_ids = w->req_ids;
  b.seq_lens = w->seq;
  if (w->mode != MLA_MODE_DECODE) b.num_draft_tokens = w->ndt;
  w->Tq = bs * sw_q_len(w);
  mla_plan_limits lim = {bs, w->Tq, bs * w->max_context, w->max_context, w->P, SW_NUM_SM, 0};
  size_t pb = 0;
  if (mla_plan_workspace_size(cpu, &lim, &pb) != MLA_OK) return -1;
  free(w->pws);
  w->pws = malloc(pb);
  if (mla_plan_build(cpu, w->rt, &b, &lim, w->H, w->pws, pb, &w->plan) != MLA_OK) return -1;
  const int64_t nq = (int64_t)w->Tq * w->H;
  float *tmp = malloc(sizeof(float) * (size_t)nq * MLA_LATENT);
  free(w->qn);
  free(w->qr);
  w->qn = malloc(2 * (size_t)nq * MLA_LATENT);
  w->qr = malloc(2 * (size_t)nq * MLA_ROPE);
  tu_fill_bf16_normal(r, tmp, nq * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, w->qn, nq * MLA_LATENT);
  tu_fill_bf16_normal(r, tmp, nq * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, w->qr, nq * MLA_ROPE);
  free(tmp);
  return 0;
}

static mla_step_desc sw_desc(const sw_world *w) {
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = w->mode;
  d.batch_size = w->bs;
  d.num_draft_tokens = w->mode == MLA_MODE_DECODE ? 0 : w->ndt;
  d.max_kv_len = w->max_context;
  d.num_heads = w->H;
  d.page_size = w->P;
  d.num_sm = SW_NUM_SM;
  return d;
}

static void sw_free(sw_world *w) {
  mla_req_table_destroy(w->rt);
  mla_kv_cache_destroy(w->cache);
  free(w->pws);
  free(w->qn);
  free(w->qr);
  memset(w, 0, sizeof *w);
}

/* Step metadata (host copies) against the host plan: same lengths, query
 * offsets, pages of every row (PAD past them), schedule and split counts.
 * Returns the number of mismatching fields. */
static int sw_compare_meta(const sw_world *w, const mla_step_metadata *m, const int32_t *qo, const int32_t *kv,
                           const int32_t *bt, const int32_t *sched, const int32_t *splits) {
  const mla_plan *p = &w->plan;
  int bad = 0;
  if (m->num_sm_parts != p->num_sm_parts) return 1000;
  for (int i = 0; i <= w->bs; i++) bad += qo[i] != p->qo_indptr[i];
  for (int i = 0; i < w->bs; i++) {
    bad += kv[i] != p->kv_lens[i];
    const int np = (p->kv_lens[i] + w->P - 1) / w->P;
    for (int j = 0; j < m->block_table_width; j++) {
      const int32_t want = j < np ? p->block_table[(size_t)i * p->block_table_width + j] : MLA_BLOCK_TABLE_PAD;
      bad += bt[(size_t)i * m->block_table_width + j] != want;
    }
  }
  for (int k = 0; k < p->num_sm_parts * MLA_SCHED_META_INTS; k++) bad += sched[k] != p->sched_meta[k];
  for (int i = 0; i <= w->bs; i++) bad += splits[i] != p->num_splits[i];
  return bad;
}

#endif /* MLA_TEST_STEP_WORLD_H */
