/* Test helper shared by tests/test_plan*.c: a request table filled through
 * the real request-table calls (add, fork, interleaved extends, free). */
#ifndef MLA_TEST_PLAN_WORLD_H
#define MLA_TEST_PLAN_WORLD_H

#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* ---- a request table with random content ---------------------------------- */
typedef struct world {
  mla_req_table *rt;
  const int32_t *r2t; /* [max_reqs, max_context] */
  int max_reqs, max_context, page_size;
  int num_live; /* ids 0..num_live-1 are live */
  int32_t *len; /* [max_reqs] length of each live request */
} world;

/* num_live live requests of about target[i] positions (forks may make one
 * longer), then `num_dead` requests added and freed again (ids past num_live
 * that are not live). Extends are interleaved in small steps so that the
 * pages of a request are scattered. Returns 0 on success. */
static int world_make(world *w, mla_ctx *ctx, tu_rng *r, int num_live, int num_dead,
                      const int32_t *target, int page_size, int max_context) {
  memset(w, 0, sizeof *w);
  int64_t pages = 4;
  for (int i = 0; i < num_live; i++) pages += (target[i] + page_size - 1) / page_size + 2;
  pages += (int64_t)num_dead * 2;
  mla_req_table_desc d = {num_live + num_dead + 1, max_context, (int)pages, page_size};
  if (mla_req_table_create(ctx, &d, NULL, &w->rt) != MLA_OK) return -1;
  w->max_reqs = d.max_reqs;
  w->max_context = max_context;
  w->page_size = page_size;
  w->num_live = num_live;
  w->len = calloc((size_t)d.max_reqs, sizeof(int32_t));
  int32_t *want = calloc((size_t)num_live + 1, sizeof(int32_t));
  if (!w->len || !want) return -1;
  for (int i = 0; i < num_live; i++) {
    int32_t id = -1;
    if (i > 0 && tu_uniform(r) < 0.3) {
      int32_t src = tu_randint(r, 0, i - 1);
      int pre = tu_randint(r, 0, w->len[src]);
      if (mla_req_fork(w->rt, src, pre, &id) != MLA_OK) return -1;
      w->len[id] = pre;
    } else {
      if (mla_req_add(w->rt, &id) != MLA_OK) return -1;
    }
    if (id != i) return -1;
    want[i] = target[i] > w->len[i] ? target[i] : w->len[i];
    /* Grow part of it now, the rest interleaved with the others below. */
    int now = tu_randint(r, 0, (want[i] - w->len[i]) / 2);
    if (mla_req_extend(w->rt, i, now, NULL) != MLA_OK) return -1;
    w->len[i] += now;
  }
  for (int d0 = 0; d0 < num_dead; d0++) {
    int32_t id;
    if (mla_req_add(w->rt, &id) != MLA_OK) return -1;
    if (mla_req_extend(w->rt, id, tu_randint(r, 0, 3), NULL) != MLA_OK) return -1;
  }
  for (int i = num_live; i < num_live + num_dead; i++)
    if (mla_req_free(w->rt, i) != MLA_OK) return -1;
  for (;;) {
    int pending = 0;
    for (int i = 0; i < num_live; i++) pending += w->len[i] < want[i];
    if (!pending) break;
    int pick = tu_randint(r, 0, pending - 1), i = 0;
    for (;; i++)
      if (w->len[i] < want[i] && pick-- == 0) break;
    int n =
        tu_randint(r, 1, want[i] - w->len[i] < 3 * page_size ? want[i] - w->len[i] : 3 * page_size);
    if (mla_req_extend(w->rt, i, n, NULL) != MLA_OK) return -1;
    w->len[i] += n;
  }
  free(want);
  for (int i = 0; i < num_live; i++) {
    int l = -1;
    if (mla_req_length(w->rt, i, &l) != MLA_OK || l != w->len[i]) return -1;
  }
  return mla_req_table_data(w->rt, &w->r2t) == MLA_OK ? 0 : -1;
}

static void world_free(world *w) {
  mla_req_table_destroy(w->rt);
  free(w->len);
  memset(w, 0, sizeof *w);
}

/* Lengths: about 10% zero, many short, some long (several split blocks). */
static int32_t random_len(tu_rng *r) {
  double u = tu_uniform(r);
  if (u < 0.1) return 0;
  if (u < 0.5) return tu_randint(r, 1, 70);
  if (u < 0.95) return tu_randint(r, 1, 700);
  return tu_randint(r, 700, 3000);
}

#endif /* MLA_TEST_PLAN_WORLD_H */
