/* mla_plan_build and the split-KV schedule.
 *
 * Random batches of every mode over a request table built with the real
 * request-table calls (add, extend in interleaved steps, fork, free), each
 * plan checked against a construction written here from the contract in
 * mla.h; the schedule checked for its properties (every 64-token block of
 * every request covered exactly once, parts contiguous and in order, pieces
 * agreeing with num_splits, the payload respected); every bad argument with
 * its exact status and nothing written; workspace edge cases; a timing print. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "plan/plan.h" /* white box: mla_split_schedule, mla_sched_num_parts */
#include "test_plan_world.h"
#include "test_util.h"

#define BLK 64 /* MLA_SCHED_BLOCK, spelled out so a change there is noticed */
#define OVH 5  /* MLA_SCHED_FIXED_OVERHEAD */

/* ---- split schedule properties --------------------------------------------- */
/* Whether the batch fits in `parts` parts of budget q + OVH, by a count of its
 * own: a part holds whole requests while their blocks + OVH fit, then cuts
 * the next one if more than OVH is left. *pieces: the (part, request) pairs. */
static int greedy_fits(const int32_t *kv, int bs, int parts, int64_t q, int64_t *pieces) {
  int req = 0;
  int64_t left = bs > 0 ? (kv[0] + BLK - 1) / BLK : 0; /* blocks of `req` not yet placed */
  *pieces = 0;
  for (int p = 0; p < parts && req < bs; p++) {
    int64_t room = q + OVH;
    for (;;) {
      if (room >= left + OVH) {
        room -= left + OVH;
        ++*pieces;
        if (++req == bs) break;
        left = (kv[req] + BLK - 1) / BLK;
      } else {
        if (room > OVH) {
          left -= room - OVH;
          ++*pieces;
        }
        break;
      }
    }
  }
  return req == bs;
}

/* Whether the batch fits in `parts` parts of budget q + OVH holding whole
 * requests only (each part takes requests while they fit, a request that
 * does not fit an empty part never fits). */
static int whole_fits(const int32_t *kv, int bs, int parts, int64_t q) {
  int req = 0;
  for (int p = 0; p < parts && req < bs; p++) {
    int64_t room = q + OVH;
    int took = 0;
    while (req < bs && room >= (kv[req] + BLK - 1) / BLK + OVH) {
      room -= (kv[req] + BLK - 1) / BLK + OVH;
      req++;
      took++;
    }
    if (!took) return 0;
  }
  return req == bs;
}

/* Checks sched_meta / num_splits against the rules written in mla.h (with
 * the cut-free alternative up to q / div above the budget q, div > 0); on a
 * violation writes a reason to `why` and returns 0. *whole (or NULL): 1 when
 * the cut-free budget was the one to expect. */
static int sched_ok(const int32_t *kv, int bs, int parts, int div, const int32_t *meta, const int32_t *nsp,
                    char *why, size_t wn, int *whole) {
  int ok = 0;
  int64_t total = 0;
  int64_t *off = calloc((size_t)bs + 1, sizeof(int64_t));
  int32_t *pieces = calloc((size_t)bs + 1, sizeof(int32_t));
  int64_t *cost = calloc((size_t)parts, sizeof(int64_t));
  for (int i = 0; i < bs; i++) {
    int64_t nb = (kv[i] + BLK - 1) / BLK;
    total += nb + OVH;
    off[i + 1] = off[i] + nb;
  }
  unsigned char *marks = calloc((size_t)off[bs] + 1, 1);
  int cur_req = 0, cur_tok = 0, last_work = -1;
#define BAD(...)                    \
  do {                              \
    snprintf(why, wn, __VA_ARGS__); \
    goto out;                       \
  } while (0)
  /* The budget: the smallest q whose greedy walk fits (an independent linear
   * scan, up to FlashMLA's ceil(total / parts), which always fits), unless it
   * cuts the batch into more pieces than FlashMLA's q. Every q from the
   * smallest on must fit too, or bisecting for it (as the library does) could
   * miss it. */
  const int64_t q_flash = (total + parts - 1) / parts;
  int64_t q_min = q_flash, pc_min = 0, pc_flash = 0, pc;
  for (int64_t q = 1; q < q_flash; q++)
    if (greedy_fits(kv, bs, parts, q, &pc)) {
      q_min = q;
      break;
    }
  for (int64_t q = q_min; q <= q_flash; q++)
    if (!greedy_fits(kv, bs, parts, q, &pc)) BAD("q %lld fits but %lld does not", (long long)q_min, (long long)q);
  greedy_fits(kv, bs, parts, q_min, &pc_min);
  greedy_fits(kv, bs, parts, q_flash, &pc_flash);
  int64_t q_use = pc_min > pc_flash ? q_flash : q_min;
  /* The cut-free budget: the smallest q' <= q_use + q_use / div at which
   * whole requests fit, taken when q_use cuts one. */
  int nocut = 0;
  const int64_t top = div > 0 ? q_use + q_use / div : q_use;
  if (div > 0 && (pc_min > pc_flash ? pc_flash : pc_min) > bs)
    for (int64_t q = 1; q <= top; q++)
      if (whole_fits(kv, bs, parts, q)) {
        for (int64_t r = q; r <= top; r++)
          if (!whole_fits(kv, bs, parts, r))
            BAD("whole requests fit at q %lld but not at %lld", (long long)q, (long long)r);
        q_use = q;
        nocut = 1;
        break;
      }
  if (whole) *whole = nocut;
  const int64_t payload = q_use + OVH;
  for (int p = 0; p < parts; p++) {
    const int32_t *m = meta + (size_t)p * MLA_SCHED_META_INTS;
    if (m[6] != 0 || m[7] != 0) BAD("part %d: reserved entries %d %d", p, m[6], m[7]);
    if (m[MLA_SCHED_NUM_REQS] == 0) {
      if (cur_req != bs) BAD("part %d is empty while request %d is not done", p, cur_req);
      if (m[0] != bs || m[1] != 0 || m[2] != bs || m[3] != 0 || m[4] != 0)
        BAD("empty part %d = {%d %d %d %d %d}", p, m[0], m[1], m[2], m[3], m[4]);
      continue;
    }
    if (cur_req >= bs) BAD("part %d has work after the end", p);
    if (m[MLA_SCHED_BEGIN_REQ] != cur_req || m[MLA_SCHED_BEGIN_TOK] != cur_tok)
      BAD("part %d begins at %d:%d, previous part ended at %d:%d", p, m[0], m[1], cur_req, cur_tok);
    if (m[MLA_SCHED_BEGIN_SPLIT] != pieces[cur_req])
      BAD("part %d begin_split %d, request %d has %d pieces before it", p, m[4], cur_req,
          pieces[cur_req]);
    int b = m[MLA_SCHED_BEGIN_REQ], e = m[MLA_SCHED_END_REQ];
    if (e < b || e >= bs || m[MLA_SCHED_NUM_REQS] != e - b + 1)
      BAD("part %d: begin %d end %d num_reqs %d (bs %d)", p, b, e, m[5], bs);
    for (int q = b; q <= e; q++) {
      int lo = q == b ? m[MLA_SCHED_BEGIN_TOK] : 0;
      int hi = q == e ? m[MLA_SCHED_END_TOK] : kv[q];
      if (lo < 0 || lo > hi || hi > kv[q])
        BAD("part %d request %d: range [%d, %d) of %d", p, q, lo, hi, kv[q]);
      if (lo % BLK != 0 || (hi != kv[q] && hi % BLK != 0))
        BAD("part %d request %d: [%d, %d) not on block bounds", p, q, lo, hi);
      if (kv[q] > 0 && lo == hi) BAD("part %d request %d: empty piece", p, q);
      for (int64_t k = lo / BLK; k < (hi + BLK - 1) / BLK; k++) marks[off[q] + k]++;
      pieces[q]++;
      cost[p] += (hi + BLK - 1) / BLK - lo / BLK + OVH;
    }
    if (cost[p] > payload)
      BAD("part %d costs %lld > payload %lld", p, (long long)cost[p], (long long)payload);
    last_work = p;
    if (m[MLA_SCHED_END_TOK] == kv[e]) {
      cur_req = e + 1;
      cur_tok = 0;
    } else {
      cur_req = e;
      cur_tok = m[MLA_SCHED_END_TOK];
    }
  }
  if (cur_req != bs) BAD("work left after all %d parts: at %d:%d", parts, cur_req, cur_tok);
  /* Greedy: every part but the last with work was filled to within one
   * overhead, or (cut-free) could not take the next request whole. */
  for (int p = 0; p < last_work && nocut; p++) {
    const int32_t *m = meta + (size_t)(p + 1) * MLA_SCHED_META_INTS;
    const int next = m[MLA_SCHED_BEGIN_REQ];
    if (m[MLA_SCHED_BEGIN_TOK] != 0) BAD("part %d begins inside request %d under the cut-free budget", p + 1, next);
    if (next < bs && cost[p] + (kv[next] + BLK - 1) / BLK + OVH <= payload)
      BAD("part %d costs %lld and closed before request %d (%d keys) under payload %lld", p, (long long)cost[p],
          next, kv[next], (long long)payload);
  }
  for (int p = 0; p < last_work && !nocut; p++)
    if (cost[p] < payload - OVH)
      BAD("part %d costs %lld, payload %lld: under-filled", p, (long long)cost[p],
          (long long)payload);
  for (int64_t k = 0; k < off[bs]; k++)
    if (marks[k] != 1) BAD("block %lld covered %d times", (long long)k, marks[k]);
  if (nsp[0] != 0) BAD("num_splits[0] = %d", nsp[0]);
  if (nocut && nsp[bs] != bs) BAD("cut-free budget %lld, yet %d pieces for %d requests", (long long)q_use, nsp[bs], bs);
  for (int i = 0; i < bs; i++)
    if (nsp[i + 1] - nsp[i] != pieces[i])
      BAD("request %d: num_splits says %d pieces, parts hold %d", i, nsp[i + 1] - nsp[i],
          pieces[i]);
  ok = 1;
#undef BAD
out:
  free(off);
  free(pieces);
  free(cost);
  free(marks);
  return ok;
}

static int expected_parts(int num_sm, int max_q, int heads) {
  int q = max_q < 1 ? 1 : max_q;
  int tiles = (q * heads + BLK - 1) / BLK;
  int parts = num_sm / tiles;
  return parts < 1 ? 1 : parts;
}

static void test_schedule_alone(tu_rng *r) {
  int bad = 0, n_whole = 0;
  char why[256] = "";
  for (int it = 0; it < 3000 && !bad; it++) {
    int bs = tu_randint(r, 0, 160);
    if (it % 10 == 0) bs = tu_randint(r, 0, 3);
    int32_t *kv = malloc(((size_t)bs + 1) * sizeof(int32_t));
    int kind = it % 4;
    for (int i = 0; i < bs; i++) {
      if (kind == 0)
        kv[i] = 0; /* all empty */
      else if (kind == 1)
        kv[i] = tu_randint(r, 0, 1) ? 0 : tu_randint(r, 1, 300);
      else if (kind == 2)
        kv[i] = random_len(r);
      else
        kv[i] = i == 0 ? tu_randint(r, 1, 200000) : tu_randint(r, 0, 64); /* one giant */
    }
    int num_sm = tu_randint(r, 1, 132), heads = tu_randint(r, 1, 128), q = tu_randint(r, 1, 4);
    int parts = mla_sched_num_parts(num_sm, q, heads);
    if (parts != expected_parts(num_sm, q, heads)) {
      snprintf(why, sizeof why, "num_parts(%d, %d, %d) = %d, expected %d", num_sm, q, heads, parts,
               expected_parts(num_sm, q, heads));
      bad = 1;
    }
    const int div = it % 3 ? MLA_SCHED_NOCUT_DIV : 0;
    int32_t *meta = malloc((size_t)parts * MLA_SCHED_META_INTS * sizeof(int32_t));
    int32_t *nsp = malloc(((size_t)bs + 1) * sizeof(int32_t));
    memset(meta, 0x7f, (size_t)parts * MLA_SCHED_META_INTS * sizeof(int32_t));
    memset(nsp, 0x7f, ((size_t)bs + 1) * sizeof(int32_t));
    if (!bad && mla_split_schedule(kv, bs, parts, div, meta, nsp) != 0) {
      snprintf(why, sizeof why, "mla_split_schedule failed (bs %d parts %d)", bs, parts);
      bad = 1;
    }
    int whole = 0;
    if (!bad && !sched_ok(kv, bs, parts, div, meta, nsp, why, sizeof why, &whole)) bad = 1;
    n_whole += whole;
    if (bad) fprintf(stderr, "schedule case it=%d bs=%d parts=%d kind=%d\n", it, bs, parts, kind);
    free(kv);
    free(meta);
    free(nsp);
  }
  TU_CHECK(!bad, "%s", why);
  TU_CHECK(n_whole > 0, "no random batch took the cut-free budget"); /* the test would not see it break */
  /* A request one block long fits one part whatever the part count. */
  int32_t one = 64, meta[8 * 4], nsp[2];
  TU_CHECK(mla_split_schedule(&one, 1, 4, 0, meta, nsp) == 0 && nsp[1] == 1 && meta[5] == 1 &&
               meta[8 + 5] == 0,
           "single short request: splits %d, parts %d %d", nsp[1], meta[5], meta[8 + 5]);
  /* 64 requests of 64 blocks over 132 parts: FlashMLA's payload (ceil(4416 /
   * 132) = 34 blocks + 5) cuts each into 34 + 30 blocks; the smallest budget
   * that fits cuts them into 32 + 32. */
  {
    int32_t kv64[64], meta64[132 * 8], nsp64[65];
    for (int i = 0; i < 64; i++) kv64[i] = 4096;
    int most = 0, used = 0;
    TU_CHECK(mla_split_schedule(kv64, 64, 132, 0, meta64, nsp64) == 0, "b=64 schedule");
    for (int p = 0; p < 132; p++) {
      const int32_t *m = meta64 + 8 * p;
      if (m[MLA_SCHED_NUM_REQS] == 0) continue;
      used++;
      const int blocks = (m[MLA_SCHED_END_TOK] - m[MLA_SCHED_BEGIN_TOK]) / BLK; /* one request per part here */
      if (m[MLA_SCHED_NUM_REQS] == 1 && blocks > most) most = blocks;
      if (m[MLA_SCHED_NUM_REQS] != 1) most = 1 << 30;
    }
    TU_CHECK(used == 128 && most == 32 && nsp64[64] == 128, "b=64 s_k=4096: %d parts used, largest %d blocks, %d pieces",
             used, most, nsp64[64]);
  }
  /* b = 128 requests of 8192 keys over 66 parts (H = 128): the smallest budget
   * (258 blocks) cuts 62 requests; 3 blocks more hold two whole requests a
   * part (64 parts used, no combine). Without the divisor the cuts stay. */
  {
    static int32_t kv128[128], m128[66 * 8], n128[129];
    for (int i = 0; i < 128; i++) kv128[i] = 8192;
    char w2[256] = "";
    int whole = 0;
    TU_CHECK(mla_split_schedule(kv128, 128, 66, 16, m128, n128) == 0 &&
                 sched_ok(kv128, 128, 66, 16, m128, n128, w2, sizeof w2, &whole) && whole && n128[128] == 128 &&
                 m128[63 * 8 + MLA_SCHED_NUM_REQS] == 2 && m128[64 * 8 + MLA_SCHED_NUM_REQS] == 0,
             "b=128 s_k=8192 66 parts div 16: %s, whole %d, %d pieces, part 63 %d requests, part 64 %d", w2, whole,
             n128[128], m128[63 * 8 + 5], m128[64 * 8 + 5]);
    TU_CHECK(mla_split_schedule(kv128, 128, 66, 0, m128, n128) == 0 &&
                 sched_ok(kv128, 128, 66, 0, m128, n128, w2, sizeof w2, &whole) && !whole && n128[128] == 190,
             "b=128 s_k=8192 66 parts no divisor: %s, %d pieces", w2, n128[128]);
    /* b = 96: whole requests need 261 blocks against the 193 that fit: cut. */
    TU_CHECK(mla_split_schedule(kv128, 96, 66, 16, m128, n128) == 0 &&
                 sched_ok(kv128, 96, 66, 16, m128, n128, w2, sizeof w2, &whole) && !whole && n128[96] > 96,
             "b=96 s_k=8192 66 parts div 16: %s, whole %d, %d pieces", w2, whole, n128[96]);
  }
  /* Many parts over one long request: every part but the first continues it. */
  int32_t longk = 64 * 1000;
  int32_t meta2[8 * 10], nsp2[2];
  TU_CHECK(mla_split_schedule(&longk, 1, 10, 16, meta2, nsp2) == 0 && nsp2[1] >= 9,
           "long request cut into %d pieces over 10 parts", nsp2[1]);
}

/* ---- plan vs a construction from the contract ------------------------------- */
typedef struct exp_batch {
  mla_batch b;
  int32_t *req_ids, *seq_lens, *extend_lens, *prefix_lens;
  int32_t *q, *k; /* expected queries and keys per request */
} exp_batch;

static void exp_free(exp_batch *e) {
  free(e->req_ids);
  free(e->seq_lens);
  free(e->extend_lens);
  free(e->prefix_lens);
  free(e->q);
  free(e->k);
  memset(e, 0, sizeof *e);
}

/* A random valid batch of `mode` over the live requests of w. */
static void random_batch(exp_batch *e, tu_rng *r, const world *w, mla_mode mode, int bs) {
  memset(e, 0, sizeof *e);
  size_t n = (size_t)bs + 1;
  e->req_ids = calloc(n, 4);
  e->seq_lens = calloc(n, 4);
  e->extend_lens = calloc(n, 4);
  e->prefix_lens = calloc(n, 4);
  e->q = calloc(n, 4);
  e->k = calloc(n, 4);
  int ndt = tu_randint(r, 1, 4);
  int varlen = tu_randint(r, 0, 1), with_prefix = tu_randint(r, 0, 1);
  int with_extend = tu_randint(r, 0, 1);
  for (int i = 0; i < bs; i++) {
    /* Mostly distinct requests in shuffled order, sometimes a repeat. */
    int32_t id = (i < w->num_live && tu_uniform(r) < 0.9) ? i : tu_randint(r, 0, w->num_live - 1);
    e->req_ids[i] = id;
    int L = w->len[id];
    switch (mode) {
      case MLA_MODE_DECODE:
        e->seq_lens[i] = tu_randint(r, 0, L);
        e->q[i] = 1;
        e->k[i] = e->seq_lens[i];
        break;
      case MLA_MODE_TARGET_VERIFY:
        e->seq_lens[i] = L >= ndt ? tu_randint(r, 0, L - ndt) : 0;
        e->q[i] = ndt;
        e->k[i] = e->seq_lens[i] + ndt;
        break;
      case MLA_MODE_DRAFT_EXTEND:
        e->seq_lens[i] = tu_randint(r, 0, L);
        e->extend_lens[i] = tu_randint(r, 0, 6);
        e->q[i] = varlen ? e->extend_lens[i] : ndt;
        e->k[i] = e->seq_lens[i];
        break;
      default: /* EXTEND */
        e->seq_lens[i] = tu_randint(r, 0, L);
        e->prefix_lens[i] = with_prefix ? tu_randint(r, 0, e->seq_lens[i]) : 0;
        e->extend_lens[i] = e->seq_lens[i] - e->prefix_lens[i];
        e->q[i] = e->extend_lens[i];
        e->k[i] = e->seq_lens[i];
        break;
    }
  }
  /* Shuffle the entries together. */
  for (int i = bs - 1; i > 0; i--) {
    int j = tu_randint(r, 0, i);
    int32_t *arrs[6] = {e->req_ids, e->seq_lens, e->extend_lens, e->prefix_lens, e->q, e->k};
    for (int a = 0; a < 6; a++) {
      int32_t t = arrs[a][i];
      arrs[a][i] = arrs[a][j];
      arrs[a][j] = t;
    }
  }
  e->b.mode = mode;
  e->b.batch_size = bs;
  e->b.req_ids = e->req_ids;
  e->b.seq_lens = e->seq_lens;
  e->b.num_draft_tokens = ndt;
  if (mode == MLA_MODE_DRAFT_EXTEND && varlen) e->b.extend_lens = e->extend_lens;
  if (mode == MLA_MODE_EXTEND) {
    if (with_prefix) e->b.prefix_lens = e->prefix_lens;
    if (with_extend) e->b.extend_lens = e->extend_lens;
  }
  if (mode == MLA_MODE_DECODE && tu_uniform(r) < 0.5) e->b.num_draft_tokens = 0;
}

/* Returns 1 when every field and array of pl is what the contract says. */
static int plan_ok(const mla_plan *pl, const exp_batch *e, const world *w, int num_sm, int heads,
                   char *why, size_t wn) {
#define BAD(...)                    \
  do {                              \
    snprintf(why, wn, __VA_ARGS__); \
    return 0;                       \
  } while (0)
  const int bs = e->b.batch_size, P = w->page_size;
  int64_t sq = 0, sk = 0;
  int32_t mq = 0, mk = 0;
  for (int i = 0; i < bs; i++) {
    sq += e->q[i];
    sk += e->k[i];
    if (e->q[i] > mq) mq = e->q[i];
    if (e->k[i] > mk) mk = e->k[i];
  }
  const int W = (mk + P - 1) / P;
  if (pl->mode != e->b.mode || pl->batch_size != bs) BAD("mode/batch_size");
  if (pl->num_q_tokens != sq || pl->num_kv_tokens != sk)
    BAD("num_q_tokens %d (want %lld) num_kv_tokens %d (want %lld)", pl->num_q_tokens, (long long)sq,
        pl->num_kv_tokens, (long long)sk);
  if (pl->max_q_len != mq || pl->max_kv_len != mk)
    BAD("max_q_len %d/%d max_kv_len %d/%d", pl->max_q_len, mq, pl->max_kv_len, mk);
  if (pl->causal != (e->b.mode != MLA_MODE_DECODE)) BAD("causal = %d", pl->causal);
  if (pl->page_size != P || pl->block_table_width != W || pl->num_heads != heads)
    BAD("page_size %d width %d (want %d) heads %d", pl->page_size, pl->block_table_width, W,
        pl->num_heads);
  if (pl->qo_indptr[0] != 0 || pl->kv_indptr[0] != 0 || pl->page_indptr[0] != 0)
    BAD("indptr[0] not 0");
  int64_t qo = 0, ko = 0, po = 0;
  for (int i = 0; i < bs; i++) {
    const int32_t *row = w->r2t + (size_t)e->req_ids[i] * w->max_context;
    int np = (e->k[i] + P - 1) / P;
    if (pl->req_ids[i] != e->req_ids[i]) BAD("req_ids[%d]", i);
    if (pl->kv_lens[i] != e->k[i]) BAD("kv_lens[%d] = %d, want %d", i, pl->kv_lens[i], e->k[i]);
    qo += e->q[i];
    ko += e->k[i];
    po += np;
    if (pl->qo_indptr[i + 1] != qo) BAD("qo_indptr[%d]", i + 1);
    if (pl->kv_indptr[i + 1] != ko) BAD("kv_indptr[%d]", i + 1);
    if (pl->page_indptr[i + 1] != po) BAD("page_indptr[%d]", i + 1);
    const int32_t *ki = pl->kv_indices + (ko - e->k[i]);
    const int32_t *pg = pl->page_indices + (po - np);
    const int32_t *bt = pl->block_table + (size_t)i * W;
    for (int j = 0; j < e->k[i]; j++) {
      if (ki[j] != row[j]) BAD("kv_indices of request %d pos %d: %d, want %d", i, j, ki[j], row[j]);
      /* The page list must reproduce every key: slot = page * P + offset. */
      if (pg[j / P] * P + j % P != row[j]) BAD("page of request %d pos %d", i, j);
    }
    for (int j = 0; j < np; j++) {
      if (pg[j] != row[j * P] / P) BAD("page_indices of request %d page %d", i, j);
      if (bt[j] != pg[j]) BAD("block_table[%d][%d] = %d, want %d", i, j, bt[j], pg[j]);
    }
    for (int j = np; j < W; j++)
      if (bt[j] != MLA_BLOCK_TABLE_PAD) BAD("block_table[%d][%d] = %d past the end", i, j, bt[j]);
  }
  int parts = expected_parts(num_sm, mq, heads);
  if (pl->num_sm_parts != parts) BAD("num_sm_parts %d, want %d", pl->num_sm_parts, parts);
  /* MLA_SCHED_NOCUT_DIV, spelled out; none for EXTEND */
  const int div = e->b.mode != MLA_MODE_EXTEND ? 16 : 0;
  if (!sched_ok(pl->kv_lens, bs, parts, div, pl->sched_meta, pl->num_splits, why, wn, NULL)) return 0;
  if (pl->total_splits != pl->num_splits[bs]) BAD("total_splits");
  return 1;
#undef BAD
}

static void test_random_plans(tu_rng *r, mla_ctx *ctx) {
  static const int page_sizes[4] = {1, 16, 64, 128};
  static const mla_mode modes[4] = {MLA_MODE_DECODE, MLA_MODE_TARGET_VERIFY, MLA_MODE_DRAFT_EXTEND,
                                    MLA_MODE_EXTEND};
  int cases = 0, bad = 0;
  char why[256] = "";
  for (int it = 0; it < 240 && !bad; it++) {
    int P = page_sizes[it % 4];
    mla_mode mode = modes[(it / 4) % 4];
    int bs = it % 16 == 0 ? tu_randint(r, 0, 2) : tu_randint(r, 0, 128);
    int num_live = bs > 0 ? bs : 1;
    int32_t *target = malloc((size_t)num_live * sizeof(int32_t));
    for (int i = 0; i < num_live; i++) {
      target[i] = random_len(r);
      /* Verify reads seq + ndt (ndt <= 4) keys, so no request is shorter. */
      if (mode == MLA_MODE_TARGET_VERIFY && target[i] < 4) target[i] = 4;
    }
    world w;
    if (world_make(&w, ctx, r, num_live, tu_randint(r, 0, 3), target, P, 3200) != 0) {
      TU_CHECK(0, "request table setup failed");
      free(target);
      return;
    }
    exp_batch e;
    random_batch(&e, r, &w, mode, bs);
    int64_t sq = 0, sk = 0;
    for (int i = 0; i < bs; i++) sq += e.q[i], sk += e.k[i];
    mla_plan_limits lim = {bs + tu_randint(r, 0, 3),
                           (int)sq + tu_randint(r, 0, 5),
                           (int)sk + tu_randint(r, 0, 100),
                           w.max_context,
                           P,
                           tu_randint(r, 1, 132), 0};
    if (lim.max_bs < 1) lim.max_bs = 1;
    if (lim.max_q_tokens < 1) lim.max_q_tokens = 1;
    if (lim.max_kv_tokens < 1) lim.max_kv_tokens = 1;
    int heads = tu_randint(r, 1, 128);
    size_t bytes = 0;
    mla_status st = mla_plan_workspace_size(ctx, &lim, &bytes);
    unsigned char *buf = malloc(bytes + 1);
    int shift = tu_randint(r, 0, 1); /* unaligned base half the time */
    memset(buf, 0xAB, bytes + 1);
    mla_plan pl;
    memset(&pl, 0x5A, sizeof pl);
    if (st == MLA_OK) st = mla_plan_build(ctx, w.rt, &e.b, &lim, heads, buf + shift, bytes, &pl);
    if (st != MLA_OK) {
      snprintf(why, sizeof why, "mode %d bs %d P %d: %s (%s)", mode, bs, P, mla_status_string(st),
               mla_ctx_last_error(ctx));
      bad = 1;
    } else if (!plan_ok(&pl, &e, &w, lim.num_sm, heads, why, sizeof why)) {
      fprintf(stderr, "case it=%d mode=%d bs=%d P=%d heads=%d num_sm=%d\n", it, mode, bs, P, heads,
              lim.num_sm);
      bad = 1;
    }
    cases++;
    free(buf);
    exp_free(&e);
    world_free(&w);
    free(target);
  }
  TU_CHECK(!bad, "%s", why);
  printf("random plans: %d cases\n", cases);
}

/* IDLE: any batch size, an empty plan. */
static void test_idle(mla_ctx *ctx) {
  mla_plan_limits lim = {4, 16, 64, 32, 16, 8, 0};
  size_t bytes;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &bytes), MLA_OK);
  void *ws = malloc(bytes);
  int bss[3] = {0, 3, 1000};
  for (int t = 0; t < 3; t++) {
    mla_batch b = {MLA_MODE_IDLE, bss[t], NULL, NULL, NULL, NULL, 0};
    mla_plan pl;
    memset(&pl, 0x5A, sizeof pl);
    TU_STATUS(mla_plan_build(ctx, NULL, &b, &lim, 16, ws, bytes, &pl), MLA_OK);
    TU_CHECK(pl.mode == MLA_MODE_IDLE && pl.batch_size == 0 && pl.num_q_tokens == 0 &&
                 pl.num_kv_tokens == 0 && pl.max_q_len == 0 && pl.max_kv_len == 0 &&
                 pl.block_table_width == 0 && pl.num_sm_parts == 0 && pl.total_splits == 0,
             "IDLE plan with bs %d is not empty", bss[t]);
    TU_CHECK(pl.qo_indptr && pl.qo_indptr[0] == 0 && pl.kv_indptr[0] == 0 &&
                 pl.page_indptr[0] == 0 && pl.num_splits[0] == 0,
             "IDLE indptrs");
  }
  free(ws);
}

/* ---- bad arguments ------------------------------------------------------------ */
typedef struct bad_env {
  mla_ctx *ctx;
  world w;
  mla_plan_limits lim;
  size_t bytes;
  unsigned char *ws, *ws_copy;
} bad_env;

/* Calls mla_plan_build with the given inputs and checks the status, that the
 * plan struct and the workspace were left as they were, and that a message
 * was recorded (containing `msg` when given). */
static void expect_plan_fail(bad_env *E, const mla_req_table *rt, const mla_batch *b,
                             const mla_plan_limits *lim, int heads, size_t bytes, mla_status want,
                             const char *msg, const char *what) {
  mla_plan pl, pl0;
  memset(&pl, 0x5A, sizeof pl);
  memcpy(&pl0, &pl, sizeof pl);
  memset(E->ws, 0x33, E->bytes);
  mla_status st = mla_plan_build(E->ctx, rt, b, lim, heads, E->ws, bytes, &pl);
  TU_CHECK(st == want, "%s: got %s, want %s (%s)", what, mla_status_string(st),
           mla_status_string(want), mla_ctx_last_error(E->ctx));
  TU_CHECK(memcmp(&pl, &pl0, sizeof pl) == 0, "%s: plan struct written on error", what);
  memset(E->ws_copy, 0x33, E->bytes);
  TU_CHECK(memcmp(E->ws, E->ws_copy, E->bytes) == 0, "%s: workspace written on error", what);
  const char *m = mla_ctx_last_error(E->ctx);
  TU_CHECK(m[0] != '\0', "%s: no error message", what);
  if (msg) TU_CHECK(strstr(m, msg) != NULL, "%s: message '%s' lacks '%s'", what, m, msg);
}

static void test_bad_args(tu_rng *r, mla_ctx *ctx) {
  bad_env E;
  memset(&E, 0, sizeof E);
  E.ctx = ctx;
  int32_t target[6] = {40, 20, 0, 33, 17, 64};
  if (world_make(&E.w, ctx, r, 6, 2, target, 16, 128) != 0) {
    TU_CHECK(0, "setup");
    return;
  }
  /* ids 6, 7 exist in the table but are not live. */
  int32_t ids[5] = {0, 1, 2, 3, 4};
  int32_t seq[5], ext[5], pre[5];
  for (int i = 0; i < 5; i++) {
    seq[i] = E.w.len[i] < 10 ? E.w.len[i] : 10;
    pre[i] = seq[i] / 2;
    ext[i] = seq[i] - pre[i];
  }
  E.lim = (mla_plan_limits){5, 64, 1000, 128, 16, 16, 0};
  TU_STATUS(mla_plan_workspace_size(ctx, &E.lim, &E.bytes), MLA_OK);
  E.ws = malloc(E.bytes);
  E.ws_copy = malloc(E.bytes);
  const mla_batch good = {MLA_MODE_DECODE, 5, ids, seq, NULL, NULL, 0};
  {
    mla_plan pl;
    TU_STATUS(mla_plan_build(ctx, E.w.rt, &good, &E.lim, 16, E.ws, E.bytes, &pl), MLA_OK);
  }
  mla_batch b;
  mla_plan_limits lim;
  const mla_status INV = MLA_ERR_INVALID_ARGUMENT;

  /* NULL pointers. */
  {
    mla_plan pl;
    memset(&pl, 0x5A, sizeof pl);
    mla_plan pl0 = pl;
    TU_STATUS(mla_plan_build(NULL, E.w.rt, &good, &E.lim, 16, E.ws, E.bytes, &pl), INV);
    TU_CHECK(memcmp(&pl, &pl0, sizeof pl) == 0, "NULL ctx: plan written");
    TU_STATUS(mla_plan_build(ctx, E.w.rt, &good, &E.lim, 16, E.ws, E.bytes, NULL), INV);
    TU_STATUS(mla_plan_build(ctx, E.w.rt, &good, &E.lim, 16, NULL, E.bytes, &pl), INV);
    TU_CHECK(memcmp(&pl, &pl0, sizeof pl) == 0, "NULL workspace: plan written");
  }
  expect_plan_fail(&E, NULL, &good, &E.lim, 16, E.bytes, INV, "rt", "rt NULL");
  expect_plan_fail(&E, E.w.rt, NULL, &E.lim, 16, E.bytes, INV, "batch", "batch NULL");
  expect_plan_fail(&E, E.w.rt, &good, NULL, 16, E.bytes, INV, "lim", "lim NULL");
  b = good, b.req_ids = NULL;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "req_ids", "req_ids NULL");
  b = good, b.seq_lens = NULL;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "seq_lens", "seq_lens NULL");

  /* Limits. */
  lim = E.lim, lim.max_bs = 0;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "max_bs", "max_bs 0");
  lim = E.lim, lim.max_q_tokens = 0;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "max_q_tokens", "max_q_tokens 0");
  lim = E.lim, lim.max_kv_tokens = -1;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "max_kv_tokens", "max_kv -1");
  lim = E.lim, lim.max_context = 0;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "max_context", "max_context 0");
  lim = E.lim, lim.page_size = 24;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "page_size", "page_size 24");
  lim = E.lim, lim.page_size = 512;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "page_size", "page_size 512");
  lim = E.lim, lim.page_size = 32; /* valid, but not the table's */
  {
    size_t b32;
    TU_STATUS(mla_plan_workspace_size(ctx, &lim, &b32), MLA_OK);
    TU_CHECK(b32 <= E.bytes, "P=32 workspace larger than P=16's");
    expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "page_size", "page mismatch");
  }
  lim = E.lim, lim.num_sm = 0;
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, INV, "num_sm", "num_sm 0");

  /* Scalars. */
  expect_plan_fail(&E, E.w.rt, &good, &E.lim, 0, E.bytes, INV, "num_heads", "heads 0");
  expect_plan_fail(&E, E.w.rt, &good, &E.lim, MLA_MAX_HEADS + 1, E.bytes, INV, "num_heads",
                   "heads too many");
  b = good, b.mode = (mla_mode)9;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "mode", "mode 9");
  b = good, b.batch_size = -1;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "batch_size", "bs -1");
  {
    int32_t ids6[6] = {0, 1, 2, 3, 4, 5}, seq6[6] = {1, 1, 1, 1, 1, 1};
    b = good, b.batch_size = 6, b.req_ids = ids6, b.seq_lens = seq6;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_CAPACITY, "max_bs",
                     "bs > max_bs");
  }
  b = good, b.mode = MLA_MODE_TARGET_VERIFY, b.num_draft_tokens = 0;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "num_draft_tokens", "verify ndt 0");
  b = good, b.mode = MLA_MODE_DRAFT_EXTEND, b.num_draft_tokens = 0;
  expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "num_draft_tokens",
                   "draft extend window 0");

  /* Per-request values. */
  {
    int32_t s2[5];
    memcpy(s2, seq, sizeof s2);
    s2[3] = -1;
    b = good, b.seq_lens = s2;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "seq_lens[3] = -1", "seq -1");
    b.mode = MLA_MODE_EXTEND;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "seq_lens[3] = -1", "extend seq -1");
  }
  {
    int32_t e2[5];
    memcpy(e2, ext, sizeof e2);
    e2[1] = -2;
    b = good, b.mode = MLA_MODE_DRAFT_EXTEND, b.extend_lens = e2;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "extend_lens[1] = -2",
                     "draft extend_lens -2");
  }
  {
    int32_t p2[5];
    memcpy(p2, pre, sizeof p2);
    p2[0] = seq[0] + 1;
    b = good, b.mode = MLA_MODE_EXTEND, b.prefix_lens = p2;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "prefix_lens[0]", "prefix > seq");
    p2[0] = -1;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "prefix_lens[0]", "prefix -1");
    int32_t e3[5];
    memcpy(e3, ext, sizeof e3);
    e3[4] += 1;
    b = good, b.mode = MLA_MODE_EXTEND, b.prefix_lens = pre, b.extend_lens = e3;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, INV, "extend_lens[4]",
                     "extend_lens mismatch");
    b.extend_lens = ext; /* consistent: fine */
    mla_plan pl;
    TU_STATUS(mla_plan_build(ctx, E.w.rt, &b, &E.lim, 16, E.ws, E.bytes, &pl), MLA_OK);
  }
  /* Capacity. */
  lim = E.lim, lim.max_q_tokens = 4; /* decode of 5 needs 5 */
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, MLA_ERR_CAPACITY, "max_q_tokens", "sum q");
  {
    int64_t sk = 0;
    for (int i = 0; i < 5; i++) sk += seq[i];
    lim = E.lim, lim.max_kv_tokens = (int)sk - 1;
    expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, MLA_ERR_CAPACITY, "max_kv_tokens",
                     "sum k");
  }
  lim = E.lim, lim.max_context = 9; /* seq[0] = 10 */
  expect_plan_fail(&E, E.w.rt, &good, &lim, 16, E.bytes, MLA_ERR_CAPACITY, "max_context",
                   "k > max_context");
  /* Request ids and lengths. */
  {
    int32_t i2[5];
    memcpy(i2, ids, sizeof i2);
    b = good, b.req_ids = i2;
    i2[2] = -2; /* -1 is MLA_REQ_PAD */
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_OUT_OF_RANGE, "req_ids[2]",
                     "id -2");
    i2[2] = E.w.max_reqs;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_OUT_OF_RANGE, "req_ids[2]",
                     "id max_reqs");
    i2[2] = 6; /* freed */
    int32_t s3[5];
    memcpy(s3, seq, sizeof s3);
    s3[2] = 0;
    b.seq_lens = s3;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_BAD_STATE, "req_ids[2]",
                     "freed request");
  }
  {
    int32_t s4[5];
    memcpy(s4, seq, sizeof s4);
    s4[1] = E.w.len[1] + 1;
    b = good, b.seq_lens = s4;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_OUT_OF_RANGE, "req_ids[1]",
                     "seq past the request");
    /* Verify reads seq + ndt keys: the last ones must exist too. */
    s4[1] = E.w.len[1] - 1;
    b.mode = MLA_MODE_TARGET_VERIFY, b.num_draft_tokens = 2;
    b.batch_size = 1, b.req_ids = ids + 1, b.seq_lens = s4 + 1;
    expect_plan_fail(&E, E.w.rt, &b, &E.lim, 16, E.bytes, MLA_ERR_OUT_OF_RANGE, "req_ids[0]",
                     "verify past the request");
    s4[1] = E.w.len[1] - 2;
    mla_plan pl;
    TU_STATUS(mla_plan_build(ctx, E.w.rt, &b, &E.lim, 16, E.ws, E.bytes, &pl), MLA_OK);
  }
  /* Workspace. */
  expect_plan_fail(&E, E.w.rt, &good, &E.lim, 16, E.bytes - 1, MLA_ERR_WORKSPACE_TOO_SMALL,
                   "workspace", "workspace size-1");
  {
    mla_batch empty = good;
    empty.batch_size = 0; /* too small does not depend on the batch */
    expect_plan_fail(&E, E.w.rt, &empty, &E.lim, 16, E.bytes - 1, MLA_ERR_WORKSPACE_TOO_SMALL,
                     "workspace", "workspace size-1, bs 0");
  }
  /* Workspace size query. */
  {
    size_t sz = 12345;
    TU_STATUS(mla_plan_workspace_size(NULL, &E.lim, &sz), INV);
    TU_STATUS(mla_plan_workspace_size(ctx, NULL, &sz), INV);
    TU_STATUS(mla_plan_workspace_size(ctx, &E.lim, NULL), INV);
    lim = E.lim, lim.page_size = 0;
    TU_STATUS(mla_plan_workspace_size(ctx, &lim, &sz), INV);
    lim = E.lim, lim.num_sm = -3;
    TU_STATUS(mla_plan_workspace_size(ctx, &lim, &sz), INV);
    TU_CHECK(sz == 12345, "bytes written on error");
    lim = (mla_plan_limits){1 << 30, 1 << 30, 1 << 30, 1 << 30, 1, 132, 0};
    TU_STATUS(mla_plan_workspace_size(ctx, &lim, &sz), MLA_ERR_CAPACITY);
  }
  free(E.ws);
  free(E.ws_copy);
  world_free(&E.w);
}

/* Workspace at an unaligned address of exactly the reported size, built for
 * the largest batch the limits allow; and the size is independent of the batch. */
static void test_workspace_edges(tu_rng *r, mla_ctx *ctx) {
  int32_t target[8];
  for (int i = 0; i < 8; i++) target[i] = 256;
  world w;
  if (world_make(&w, ctx, r, 8, 0, target, 64, 256) != 0) {
    TU_CHECK(0, "setup");
    return;
  }
  int32_t ids[8], seq[8];
  for (int i = 0; i < 8; i++) ids[i] = i, seq[i] = w.len[i];
  mla_plan_limits lim = {8, 8, 8 * 256, 256, 64, 132, 0};
  size_t bytes;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &bytes), MLA_OK);
  unsigned char *buf = malloc(bytes + 64);
  for (int off = 1; off < 64; off += 31) {
    mla_batch b = {MLA_MODE_DECODE, 8, ids, seq, NULL, NULL, 0};
    mla_plan pl;
    TU_STATUS(mla_plan_build(ctx, w.rt, &b, &lim, 128, buf + off, bytes, &pl), MLA_OK);
    uintptr_t lo = (uintptr_t)(buf + off), hi = lo + bytes;
    TU_CHECK((uintptr_t)pl.kv_indices >= lo &&
                 (uintptr_t)(pl.kv_indices + pl.num_kv_tokens) <= hi &&
                 (uintptr_t)(pl.block_table + 8 * pl.block_table_width) <= hi,
             "plan arrays outside the workspace at offset %d", off);
    TU_CHECK(pl.num_kv_tokens == 8 * 256 &&
                 pl.kv_indices[8 * 256 - 1] == w.r2t[(size_t)7 * w.max_context + 255],
             "full batch at offset %d", off);
  }
  free(buf);
  world_free(&w);
}

/* ---- pages-only plans ---------------------------------------------------------- */
/* MLA_PLAN_PAGES_ONLY: no kv_indices, a smaller workspace, every other array
 * identical to the full plan's, for every mode; unknown flag bits refused. */
static void test_pages_only(tu_rng *r, mla_ctx *ctx) {
  int32_t target[12];
  for (int i = 0; i < 12; i++) target[i] = tu_randint(r, 5, 600);
  world w;
  if (world_make(&w, ctx, r, 12, 2, target, 16, 700) != 0) {
    TU_CHECK(0, "pages-only setup");
    return;
  }
  int32_t ids[12], seq[12], ext[12], pre[12];
  for (int i = 0; i < 12; i++) {
    ids[i] = i;
    seq[i] = w.len[i] - 4 > 0 ? w.len[i] - 4 : 0;
    ext[i] = seq[i] < 3 ? seq[i] : 3;
    pre[i] = seq[i] / 2;
  }
  ids[5] = MLA_REQ_PAD;
  seq[5] = 1;
  ext[5] = 1;
  pre[5] = 0;
  mla_plan_limits lim = {12, 12 * 700, 12 * 700, 700, 16, 20, 0}, plim = lim;
  plim.flags = MLA_PLAN_PAGES_ONLY;
  size_t fb = 0, pb = 0;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &fb), MLA_OK);
  TU_STATUS(mla_plan_workspace_size(ctx, &plim, &pb), MLA_OK);
  TU_CHECK(pb + sizeof(int32_t) * 12 * 700 <= fb + 256, "pages-only workspace %zu, full %zu", pb, fb);
  void *fw = malloc(fb), *pw = malloc(pb);
  for (int mode = MLA_MODE_DECODE; mode <= MLA_MODE_EXTEND; mode++) {
    mla_batch b = {(mla_mode)mode, 12, ids, seq, NULL, NULL, 0};
    if (mode == MLA_MODE_TARGET_VERIFY) b.num_draft_tokens = 3, seq[0] = seq[0] > 3 ? seq[0] - 3 : 0;
    if (mode == MLA_MODE_DRAFT_EXTEND) b.extend_lens = ext;
    if (mode == MLA_MODE_EXTEND) b.prefix_lens = pre;
    mla_plan f, p;
    TU_STATUS(mla_plan_build(ctx, w.rt, &b, &lim, 16, fw, fb, &f), MLA_OK);
    TU_STATUS(mla_plan_build(ctx, w.rt, &b, &plim, 16, pw, pb, &p), MLA_OK);
    int bad = p.kv_indices != NULL;
    bad += p.batch_size != f.batch_size || p.num_q_tokens != f.num_q_tokens || p.num_kv_tokens != f.num_kv_tokens ||
           p.block_table_width != f.block_table_width || p.num_sm_parts != f.num_sm_parts ||
           p.total_splits != f.total_splits;
    bad += memcmp(p.qo_indptr, f.qo_indptr, 4 * 13) != 0;
    bad += memcmp(p.kv_indptr, f.kv_indptr, 4 * 13) != 0;
    bad += memcmp(p.kv_lens, f.kv_lens, 4 * 12) != 0;
    bad += memcmp(p.block_table, f.block_table, 4 * (size_t)12 * f.block_table_width) != 0;
    bad += memcmp(p.page_indices, f.page_indices, 4 * (size_t)f.page_indptr[12]) != 0;
    bad += memcmp(p.sched_meta, f.sched_meta, 4 * (size_t)f.num_sm_parts * MLA_SCHED_META_INTS) != 0;
    bad += memcmp(p.num_splits, f.num_splits, 4 * 13) != 0;
    TU_CHECK(bad == 0, "mode %d: the pages-only plan differs from the full plan in %d ways", mode, bad);
  }
  plim.flags = 2;
  TU_STATUS(mla_plan_workspace_size(ctx, &plim, &pb), MLA_ERR_INVALID_ARGUMENT);
  free(fw);
  free(pw);
  world_free(&w);
}

/* ---- timing ----------------------------------------------------------------- */
static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void time_decode_plan(tu_rng *r, mla_ctx *ctx) {
  const int bs = 256, P = 64, mc = 4608;
  int32_t *target = malloc(bs * sizeof(int32_t));
  for (int i = 0; i < bs; i++) target[i] = tu_randint(r, 3584, 4608);
  world w;
  if (world_make(&w, ctx, r, bs, 0, target, P, mc) != 0) {
    TU_CHECK(0, "timing setup");
    free(target);
    return;
  }
  int32_t *ids = malloc(bs * sizeof(int32_t));
  int64_t sk = 0;
  for (int i = 0; i < bs; i++) ids[i] = i, sk += w.len[i];
  mla_plan_limits lim = {bs, bs, (int)sk, mc, P, 132, 0};
  size_t bytes;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &bytes), MLA_OK);
  void *ws = malloc(bytes);
  mla_batch b = {MLA_MODE_DECODE, bs, ids, w.len, NULL, NULL, 0};
  mla_plan pl;
  mla_status st = mla_plan_build(ctx, w.rt, &b, &lim, 128, ws, bytes, &pl); /* warm-up */
  TU_STATUS(st, MLA_OK);
  const int iters = 1000;
  double t0 = now_us();
  for (int i = 0; i < iters && st == MLA_OK; i++)
    st = mla_plan_build(ctx, w.rt, &b, &lim, 128, ws, bytes, &pl);
  double dt = (now_us() - t0) / iters;
  int threads = 0;
  mla_ctx_get_threads(ctx, &threads);
  printf(
      "timing: mla_plan_build decode bs=%d s_k~4096 P=%d H=128 (%d keys, %d threads): "
      "%.1f us/call (DESIGN target <= 20 us)\n",
      bs, P, pl.num_kv_tokens, threads, dt);
  /* the same batch as a pages-only plan (what GPU consumers need) */
  mla_plan_limits plim = lim;
  plim.flags = MLA_PLAN_PAGES_ONLY;
  size_t pbytes;
  TU_STATUS(mla_plan_workspace_size(ctx, &plim, &pbytes), MLA_OK);
  void *pws = malloc(pbytes);
  st = mla_plan_build(ctx, w.rt, &b, &plim, 128, pws, pbytes, &pl);
  TU_STATUS(st, MLA_OK);
  t0 = now_us();
  for (int i = 0; i < iters && st == MLA_OK; i++)
    st = mla_plan_build(ctx, w.rt, &b, &plim, 128, pws, pbytes, &pl);
  dt = (now_us() - t0) / iters;
  printf("timing: the same, MLA_PLAN_PAGES_ONLY: %.1f us/call\n", dt);
  free(pws);
  free(ws);
  free(ids);
  free(target);
  world_free(&w);
}

int main(void) {
  tu_rng r = {tu_seed("test_plan", 0x91a7e5ull)};
  mla_ctx *ctx = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  if (mla_ctx_create(&cd, &ctx) != MLA_OK) {
    fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  test_schedule_alone(&r);
  test_random_plans(&r, ctx);
  test_idle(ctx);
  test_bad_args(&r, ctx);
  test_workspace_edges(&r, ctx);
  test_pages_only(&r, ctx);
  time_decode_plan(&r, ctx);
  mla_ctx_destroy(ctx);
  return tu_finish("test_plan");
}
