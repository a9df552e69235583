/* The chunked-prefix, multi-step draft and DCP plans.
 *
 * Random batches over a request table built with the real request-table
 * calls, each plan checked against a construction written here from mla.h
 * and for coverage (every prefix token in exactly one chunk; every position
 * on exactly one DCP rank); the worst batch the limits allow fits the
 * reported workspace exactly (size - 1 fails, an unaligned base works); bad
 * arguments give their exact status and write nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_plan_world.h"
#include "test_util.h"

static const int kPageSizes[4] = {1, 16, 64, 128};

/* Fill pattern of output structs and workspaces before calls that must fail. */
#define STRUCT_FILL 0x5A
#define WS_FILL 0x33

/* Workspace of `bytes` at base + shift (shift 0 or 1), poisoned. */
static unsigned char *ws_alloc(size_t bytes, unsigned char **base, int shift) {
  *base = malloc(bytes + 1);
  memset(*base, 0xAB, bytes + 1);
  return *base + shift;
}

/* ---- chunked prefix ---------------------------------------------------------- */
static int chunk_ok(const mla_chunk_plan *cp, const world *w, int bs, const int32_t *ids,
                    const int32_t *pre, int cap, char *why, size_t wn) {
#define BAD(...)                    \
  do {                              \
    snprintf(why, wn, __VA_ARGS__); \
    return 0;                       \
  } while (0)
  int cl = bs > 0 ? cap / bs : cap;
  if (cl < 1) cl = 1;
  int maxpre = 0;
  int64_t total = 0;
  for (int i = 0; i < bs; i++) {
    if (pre[i] > maxpre) maxpre = pre[i];
    total += pre[i];
  }
  int nc = (maxpre + cl - 1) / cl;
  if (cp->batch_size != bs || cp->chunk_len != cl || cp->num_chunks != nc)
    BAD("bs %d chunk_len %d (want %d) num_chunks %d (want %d)", cp->batch_size, cp->chunk_len, cl,
        cp->num_chunks, nc);
  if (cp->slot_indptr[0] != 0) BAD("slot_indptr[0]");
  /* Coverage: every prefix position of every request in exactly one chunk. */
  int64_t *first = calloc((size_t)bs + 1, sizeof(int64_t));
  for (int i = 0; i < bs; i++) first[i + 1] = first[i] + pre[i];
  unsigned char *seen = calloc((size_t)total + 1, 1);
  int ok = 1;
  int64_t so = 0;
  for (int c = 0; c < nc && ok; c++) {
    int mx = 0, cu = 0;
    if (cp->cu_seq_lens[(size_t)c * (bs + 1)] != 0) {
      snprintf(why, wn, "cu_seq_lens[%d][0]", c);
      ok = 0;
    }
    for (int i = 0; i < bs && ok; i++) {
      int st = c * cl < pre[i] ? c * cl : pre[i];
      int len = pre[i] - st;
      if (len > cl) len = cl;
      if (cp->starts[(size_t)c * bs + i] != st || cp->lens[(size_t)c * bs + i] != len) {
        snprintf(why, wn, "chunk %d request %d: start %d len %d, want %d %d", c, i,
                 cp->starts[(size_t)c * bs + i], cp->lens[(size_t)c * bs + i], st, len);
        ok = 0;
        break;
      }
      const int32_t *row = w->r2t + (size_t)ids[i] * w->max_context;
      for (int j = 0; j < len; j++) {
        if (cp->slots[so + cu + j] != row[st + j]) {
          snprintf(why, wn, "chunk %d request %d pos %d: slot %d, want %d", c, i, st + j,
                   cp->slots[so + cu + j], row[st + j]);
          ok = 0;
          break;
        }
        seen[first[i] + st + j]++;
      }
      cu += len;
      if (len > mx) mx = len;
      if (cp->cu_seq_lens[(size_t)c * (bs + 1) + i + 1] != cu) {
        snprintf(why, wn, "cu_seq_lens[%d][%d]", c, i + 1);
        ok = 0;
      }
    }
    so += cu;
    if (ok && (cp->max_lens[c] != mx || cp->slot_indptr[c + 1] != so)) {
      snprintf(why, wn, "chunk %d: max_len %d (want %d) slot_indptr %d (want %lld)", c,
               cp->max_lens[c], mx, cp->slot_indptr[c + 1], (long long)so);
      ok = 0;
    }
  }
  for (int64_t t = 0; t < total && ok; t++)
    if (seen[t] != 1) {
      snprintf(why, wn, "prefix token %lld covered %d times", (long long)t, seen[t]);
      ok = 0;
    }
  free(first);
  free(seen);
  return ok;
#undef BAD
}

static void test_chunk_random(tu_rng *r, mla_ctx *ctx) {
  int bad = 0, cases = 0;
  char why[256] = "";
  for (int it = 0; it < 160 && !bad; it++) {
    int P = kPageSizes[it % 4];
    int bs = it % 16 == 0 ? tu_randint(r, 0, 2) : tu_randint(r, 0, 128);
    int nl = bs > 0 ? bs : 1;
    int32_t *target = malloc((size_t)nl * 4);
    for (int i = 0; i < nl; i++) target[i] = random_len(r);
    world w;
    if (world_make(&w, ctx, r, nl, tu_randint(r, 0, 2), target, P, 3200) != 0) {
      TU_CHECK(0, "setup");
      free(target);
      return;
    }
    int32_t *ids = malloc((size_t)nl * 4), *pre = malloc((size_t)nl * 4);
    for (int i = 0; i < bs; i++) ids[i] = i;
    tu_shuffle_i32(r, ids, bs);
    int64_t total = 0;
    for (int i = 0; i < bs; i++) {
      int L = w.len[ids[i]];
      double u = tu_uniform(r);
      pre[i] = u < 0.15 ? 0 : u < 0.3 ? L : tu_randint(r, 0, L);
      total += pre[i];
    }
    int caps[4] = {1, tu_randint(r, 1, 200), tu_randint(r, 64, 4096), bs > 0 ? bs : 1};
    int cap = caps[tu_randint(r, 0, 3)];
    size_t bytes;
    mla_status st =
        mla_chunk_plan_workspace_size(ctx, bs + tu_randint(r, 0, 3) + (bs == 0),
                                      (int)total + 1 + tu_randint(r, 0, 50), cap, &bytes);
    unsigned char *base = NULL;
    void *ws = ws_alloc(bytes, &base, tu_randint(r, 0, 1));
    mla_chunk_plan cp;
    memset(&cp, STRUCT_FILL, sizeof cp);
    if (st == MLA_OK) st = mla_chunk_plan_build(ctx, w.rt, bs, ids, pre, cap, ws, bytes, &cp);
    if (st != MLA_OK) {
      snprintf(why, sizeof why, "bs %d cap %d: %s (%s)", bs, cap, mla_status_string(st),
               mla_ctx_last_error(ctx));
      bad = 1;
    } else if (!chunk_ok(&cp, &w, bs, ids, pre, cap, why, sizeof why)) {
      fprintf(stderr, "chunk case it=%d bs=%d P=%d cap=%d\n", it, bs, P, cap);
      bad = 1;
    }
    cases++;
    free(base);
    free(ids);
    free(pre);
    free(target);
    world_free(&w);
  }
  TU_CHECK(!bad, "%s", why);
  printf("chunk plans: %d cases\n", cases);
}

/* The worst batch the limits allow needs exactly the reported size. */
static void test_chunk_workspace(tu_rng *r, mla_ctx *ctx) {
  for (int t = 0; t < 6; t++) {
    int B = tu_randint(r, 1, 40), mpt = tu_randint(r, 1, 900), cap = tu_randint(r, 1, 300);
    int32_t *target = calloc((size_t)B, 4);
    target[0] = mpt;
    world w;
    if (world_make(&w, ctx, r, B, 0, target, kPageSizes[t % 4], 1000) != 0) {
      TU_CHECK(0, "setup");
      free(target);
      return;
    }
    int32_t *ids = malloc((size_t)B * 4), *pre = calloc((size_t)B, 4);
    for (int i = 0; i < B; i++) ids[i] = i;
    pre[0] = mpt; /* request 0 is never a fork: its length is exactly mpt */
    size_t bytes;
    TU_STATUS(mla_chunk_plan_workspace_size(ctx, B, mpt, cap, &bytes), MLA_OK);
    unsigned char *base = malloc(bytes + 1);
    mla_chunk_plan cp, cp0;
    memset(&cp, STRUCT_FILL, sizeof cp);
    cp0 = cp;
    TU_STATUS(mla_chunk_plan_build(ctx, w.rt, B, ids, pre, cap, base, bytes - 1, &cp),
              MLA_ERR_WORKSPACE_TOO_SMALL);
    TU_CHECK(memcmp(&cp, &cp0, sizeof cp) == 0, "chunk plan written on WORKSPACE_TOO_SMALL");
    TU_STATUS(mla_chunk_plan_build(ctx, w.rt, B, ids, pre, cap, base + 1, bytes, &cp), MLA_OK);
    char why[256] = "";
    TU_CHECK(chunk_ok(&cp, &w, B, ids, pre, cap, why, sizeof why), "worst case: %s", why);
    free(base);
    free(ids);
    free(pre);
    free(target);
    world_free(&w);
  }
}

static void test_chunk_bad(tu_rng *r, mla_ctx *ctx) {
  int32_t target[4] = {30, 10, 0, 50};
  world w;
  if (world_make(&w, ctx, r, 4, 2, target, 16, 64) != 0) {
    TU_CHECK(0, "setup");
    return;
  }
  int32_t ids[4] = {0, 1, 2, 3}, pre[4];
  for (int i = 0; i < 4; i++) pre[i] = w.len[i] / 2;
  size_t bytes;
  TU_STATUS(mla_chunk_plan_workspace_size(ctx, 4, 256, 8, &bytes), MLA_OK);
  unsigned char *ws = malloc(bytes), *ref = malloc(bytes);
  memset(ref, WS_FILL, bytes);
  const mla_status INV = MLA_ERR_INVALID_ARGUMENT;
  mla_chunk_plan cp, cp0;
#define CHUNK_FAIL(want, msg, rt_, bs_, ids_, pre_, cap_, ws_, bytes_)                        \
  do {                                                                                        \
    memset(&cp, STRUCT_FILL, sizeof cp);                                                      \
    cp0 = cp;                                                                                 \
    memset(ws, WS_FILL, bytes);                                                               \
    mla_status st_ = mla_chunk_plan_build(ctx, rt_, bs_, ids_, pre_, cap_, ws_, bytes_, &cp); \
    TU_CHECK(st_ == (want), "%s: got %s (%s)", msg, mla_status_string(st_),                   \
             mla_ctx_last_error(ctx));                                                        \
    TU_CHECK(memcmp(&cp, &cp0, sizeof cp) == 0, "%s: plan written on error", msg);            \
    TU_CHECK(memcmp(ws, ref, bytes) == 0, "%s: workspace written on error", msg);             \
  } while (0)
  TU_STATUS(mla_chunk_plan_build(ctx, w.rt, 4, ids, pre, 8, ws, bytes, &cp), MLA_OK);
  CHUNK_FAIL(INV, "rt NULL", NULL, 4, ids, pre, 8, ws, bytes);
  CHUNK_FAIL(INV, "workspace NULL", w.rt, 4, ids, pre, 8, NULL, bytes);
  CHUNK_FAIL(INV, "bs -1", w.rt, -1, ids, pre, 8, ws, bytes);
  CHUNK_FAIL(INV, "capacity 0", w.rt, 4, ids, pre, 0, ws, bytes);
  CHUNK_FAIL(INV, "req_ids NULL", w.rt, 4, NULL, pre, 8, ws, bytes);
  CHUNK_FAIL(INV, "prefix_lens NULL", w.rt, 4, ids, NULL, 8, ws, bytes);
  CHUNK_FAIL(MLA_ERR_WORKSPACE_TOO_SMALL, "tiny workspace", w.rt, 4, ids, pre, 8, ws, 16);
  {
    int32_t p2[4];
    memcpy(p2, pre, sizeof p2);
    p2[1] = -1;
    CHUNK_FAIL(INV, "prefix -1", w.rt, 4, ids, p2, 8, ws, bytes);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "prefix_lens[1] = -1") != NULL, "message: %s",
             mla_ctx_last_error(ctx));
    memcpy(p2, pre, sizeof p2);
    p2[3] = w.len[3] + 1;
    CHUNK_FAIL(MLA_ERR_OUT_OF_RANGE, "prefix past the request", w.rt, 4, ids, p2, 8, ws, bytes);
  }
  {
    int32_t i2[4] = {0, 1, 2, 3}, p0[4] = {0, 0, 0, 0};
    i2[2] = -5;
    CHUNK_FAIL(MLA_ERR_OUT_OF_RANGE, "id -5", w.rt, 4, i2, p0, 8, ws, bytes);
    i2[2] = w.max_reqs;
    CHUNK_FAIL(MLA_ERR_OUT_OF_RANGE, "id max_reqs", w.rt, 4, i2, p0, 8, ws, bytes);
    i2[2] = 4; /* freed */
    CHUNK_FAIL(MLA_ERR_BAD_STATE, "freed request", w.rt, 4, i2, p0, 8, ws, bytes);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "req_ids[2]") != NULL, "message: %s",
             mla_ctx_last_error(ctx));
  }
  TU_STATUS(mla_chunk_plan_build(NULL, w.rt, 4, ids, pre, 8, ws, bytes, &cp), INV);
  TU_STATUS(mla_chunk_plan_build(ctx, w.rt, 4, ids, pre, 8, ws, bytes, NULL), INV);
#undef CHUNK_FAIL
  /* Empty batch: no chunks, valid pointers. */
  memset(&cp, STRUCT_FILL, sizeof cp);
  TU_STATUS(mla_chunk_plan_build(ctx, w.rt, 0, NULL, NULL, 8, ws, bytes, &cp), MLA_OK);
  TU_CHECK(cp.batch_size == 0 && cp.num_chunks == 0 && cp.slot_indptr && cp.slot_indptr[0] == 0,
           "empty chunk plan");
  size_t sz = 777;
  TU_STATUS(mla_chunk_plan_workspace_size(NULL, 4, 256, 8, &sz), INV);
  TU_STATUS(mla_chunk_plan_workspace_size(ctx, 0, 256, 8, &sz), INV);
  TU_STATUS(mla_chunk_plan_workspace_size(ctx, 4, 0, 8, &sz), INV);
  TU_STATUS(mla_chunk_plan_workspace_size(ctx, 4, 256, 0, &sz), INV);
  TU_STATUS(mla_chunk_plan_workspace_size(ctx, 4, 256, 8, NULL), INV);
  TU_CHECK(sz == 777, "bytes written on error");
  free(ws);
  free(ref);
  world_free(&w);
}

/* ---- multi-step draft ---------------------------------------------------------- */
static int draft_ok(const mla_draft_plan *dp, const world *w, int bs, const int32_t *ids,
                    const int32_t *seq, int ns, char *why, size_t wn) {
  if (dp->batch_size != bs || dp->num_steps != ns) {
    snprintf(why, wn, "batch_size %d num_steps %d", dp->batch_size, dp->num_steps);
    return 0;
  }
  int64_t off = 0;
  for (int s = 0; s < ns; s++) {
    if (dp->step_offset[s] != off) {
      snprintf(why, wn, "step_offset[%d] = %d, want %lld", s, dp->step_offset[s], (long long)off);
      return 0;
    }
    const int32_t *ip = dp->kv_indptr + (size_t)s * (bs + 1);
    int64_t acc = 0;
    if (ip[0] != 0) {
      snprintf(why, wn, "step %d indptr[0] = %d", s, ip[0]);
      return 0;
    }
    for (int i = 0; i < bs; i++) {
      int kv = seq[i] + s + 1;
      const int32_t *row = w->r2t + (size_t)ids[i] * w->max_context;
      for (int j = 0; j < kv; j++)
        if (dp->kv_indices[off + acc + j] != row[j]) {
          snprintf(why, wn, "step %d request %d key %d: %d, want %d", s, i, j,
                   dp->kv_indices[off + acc + j], row[j]);
          return 0;
        }
      acc += kv;
      if (ip[i + 1] != acc) {
        snprintf(why, wn, "step %d indptr[%d] = %d, want %lld", s, i + 1, ip[i + 1],
                 (long long)acc);
        return 0;
      }
    }
    off += acc;
  }
  if (dp->step_offset[ns] != off) {
    snprintf(why, wn, "step_offset[%d] = %d, want %lld", ns, dp->step_offset[ns], (long long)off);
    return 0;
  }
  return 1;
}

static void test_draft_random(tu_rng *r, mla_ctx *ctx) {
  int bad = 0, cases = 0;
  char why[256] = "";
  for (int it = 0; it < 120 && !bad; it++) {
    int P = kPageSizes[it % 4];
    int bs = it % 16 == 0 ? tu_randint(r, 0, 2) : tu_randint(r, 0, 128);
    int ns = tu_randint(r, 1, 5), nl = bs > 0 ? bs : 1;
    int32_t *target = malloc((size_t)nl * 4);
    for (int i = 0; i < nl; i++) {
      target[i] = random_len(r);
      if (target[i] < ns) target[i] = ns; /* every step's keys must exist */
    }
    world w;
    if (world_make(&w, ctx, r, nl, tu_randint(r, 0, 2), target, P, 3200) != 0) {
      TU_CHECK(0, "setup");
      free(target);
      return;
    }
    int32_t *ids = malloc((size_t)nl * 4), *seq = malloc((size_t)nl * 4);
    for (int i = 0; i < bs; i++) ids[i] = i;
    tu_shuffle_i32(r, ids, bs);
    for (int i = 0; i < bs; i++) {
      int L = w.len[ids[i]];
      seq[i] = tu_uniform(r) < 0.1 ? 0 : tu_randint(r, 0, L - ns);
    }
    size_t bytes;
    mla_status st = mla_draft_plan_workspace_size(ctx, bs + (bs == 0) + tu_randint(r, 0, 2), ns,
                                                  w.max_context, &bytes);
    unsigned char *base = NULL;
    void *ws = ws_alloc(bytes, &base, tu_randint(r, 0, 1));
    mla_draft_plan dp;
    memset(&dp, STRUCT_FILL, sizeof dp);
    if (st == MLA_OK) st = mla_draft_plan_build(ctx, w.rt, bs, ids, seq, ns, ws, bytes, &dp);
    if (st != MLA_OK) {
      snprintf(why, sizeof why, "bs %d ns %d: %s (%s)", bs, ns, mla_status_string(st),
               mla_ctx_last_error(ctx));
      bad = 1;
    } else if (!draft_ok(&dp, &w, bs, ids, seq, ns, why, sizeof why)) {
      fprintf(stderr, "draft case it=%d bs=%d P=%d ns=%d\n", it, bs, P, ns);
      bad = 1;
    }
    cases++;
    free(base);
    free(ids);
    free(seq);
    free(target);
    world_free(&w);
  }
  TU_CHECK(!bad, "%s", why);
  printf("draft plans: %d cases\n", cases);
}

static void test_draft_workspace_and_bad(tu_rng *r, mla_ctx *ctx) {
  /* Worst case: max_bs requests whose last step sees max_context keys. */
  const int B = 5, mc = 300, ns = 4;
  int32_t target[5] = {mc, mc, mc, mc, mc};
  world w;
  if (world_make(&w, ctx, r, B, 1, target, 16, mc) != 0) {
    TU_CHECK(0, "setup");
    return;
  }
  int32_t ids[5] = {4, 2, 0, 1, 3}, seq[5];
  for (int i = 0; i < B; i++) seq[i] = mc - ns;
  size_t bytes;
  TU_STATUS(mla_draft_plan_workspace_size(ctx, B, ns, mc, &bytes), MLA_OK);
  unsigned char *ws = malloc(bytes + 1), *ref = malloc(bytes + 1);
  memset(ref, WS_FILL, bytes + 1);
  mla_draft_plan dp, dp0;
  char why[256] = "";
  TU_STATUS(mla_draft_plan_build(ctx, w.rt, B, ids, seq, ns, ws + 1, bytes, &dp), MLA_OK);
  TU_CHECK(draft_ok(&dp, &w, B, ids, seq, ns, why, sizeof why), "worst case: %s", why);
  const mla_status INV = MLA_ERR_INVALID_ARGUMENT;
#define DRAFT_FAIL(want, msg, rt_, bs_, ids_, seq_, ns_, ws_, bytes_)                        \
  do {                                                                                       \
    memset(&dp, STRUCT_FILL, sizeof dp);                                                     \
    dp0 = dp;                                                                                \
    memset(ws, WS_FILL, bytes + 1);                                                          \
    mla_status st_ = mla_draft_plan_build(ctx, rt_, bs_, ids_, seq_, ns_, ws_, bytes_, &dp); \
    TU_CHECK(st_ == (want), "%s: got %s (%s)", msg, mla_status_string(st_),                  \
             mla_ctx_last_error(ctx));                                                       \
    TU_CHECK(memcmp(&dp, &dp0, sizeof dp) == 0, "%s: plan written on error", msg);           \
    TU_CHECK(memcmp(ws, ref, bytes + 1) == 0, "%s: workspace written on error", msg);        \
  } while (0)
  DRAFT_FAIL(MLA_ERR_WORKSPACE_TOO_SMALL, "size-1", w.rt, B, ids, seq, ns, ws, bytes - 1);
  DRAFT_FAIL(INV, "rt NULL", NULL, B, ids, seq, ns, ws, bytes);
  DRAFT_FAIL(INV, "workspace NULL", w.rt, B, ids, seq, ns, NULL, bytes);
  DRAFT_FAIL(INV, "bs -1", w.rt, -1, ids, seq, ns, ws, bytes);
  DRAFT_FAIL(INV, "steps 0", w.rt, B, ids, seq, 0, ws, bytes);
  DRAFT_FAIL(INV, "ids NULL", w.rt, B, NULL, seq, ns, ws, bytes);
  DRAFT_FAIL(INV, "seq NULL", w.rt, B, ids, NULL, ns, ws, bytes);
  {
    int32_t s2[5];
    memcpy(s2, seq, sizeof s2);
    s2[2] = -1;
    DRAFT_FAIL(INV, "seq -1", w.rt, B, ids, s2, ns, ws, bytes);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "seq_lens[2] = -1") != NULL, "message: %s",
             mla_ctx_last_error(ctx));
    memcpy(s2, seq, sizeof s2);
    s2[0] = mc - ns + 1; /* last step would read position mc */
    DRAFT_FAIL(MLA_ERR_OUT_OF_RANGE, "last step past the request", w.rt, B, ids, s2, ns, ws, bytes);
  }
  {
    int32_t i2[5] = {4, 2, 0, 1, 3}, s0[5] = {0, 0, 0, 0, 0};
    i2[1] = -2; /* -1 is MLA_REQ_PAD */
    DRAFT_FAIL(MLA_ERR_OUT_OF_RANGE, "id -2", w.rt, B, i2, s0, 1, ws, bytes);
    i2[1] = 5; /* the freed one */
    DRAFT_FAIL(MLA_ERR_BAD_STATE, "freed request", w.rt, B, i2, s0, 1, ws, bytes);
  }
  TU_STATUS(mla_draft_plan_build(NULL, w.rt, B, ids, seq, ns, ws, bytes, &dp), INV);
  TU_STATUS(mla_draft_plan_build(ctx, w.rt, B, ids, seq, ns, ws, bytes, NULL), INV);
#undef DRAFT_FAIL
  size_t sz = 99;
  TU_STATUS(mla_draft_plan_workspace_size(ctx, 0, 2, 10, &sz), INV);
  TU_STATUS(mla_draft_plan_workspace_size(ctx, 2, 0, 10, &sz), INV);
  TU_STATUS(mla_draft_plan_workspace_size(ctx, 2, 2, 0, &sz), INV);
  TU_STATUS(mla_draft_plan_workspace_size(ctx, 2, 2, 10, NULL), INV);
  TU_STATUS(mla_draft_plan_workspace_size(NULL, 2, 2, 10, &sz), INV);
  TU_CHECK(sz == 99, "bytes written on error");
  free(ws);
  free(ref);
  world_free(&w);
}

/* ---- DCP ----------------------------------------------------------------------- */
/* Global keys where position p of every request sits at a distinct slot with
 * slot % N == p % N (the DCP cache layout), so (rank, local slot) identifies
 * the key: local slot = the key's unique number u. */
static void test_dcp_random(tu_rng *r, mla_ctx *ctx) {
  int bad = 0, cases = 0;
  char why[256] = "";
  for (int it = 0; it < 150 && !bad; it++) {
    int bs = it % 16 == 0 ? tu_randint(r, 0, 2) : tu_randint(r, 0, 128);
    int N = tu_randint(r, 1, 8);
    int32_t *kl = malloc(((size_t)bs + 1) * 4), *ip = malloc(((size_t)bs + 1) * 4);
    int64_t total = 0;
    for (int i = 0; i < bs; i++) {
      kl[i] = tu_uniform(r) < 0.1 ? tu_randint(r, 0, N) : random_len(r);
      total += kl[i];
    }
    int32_t start = tu_randint(r, 0, 9); /* a view into a larger index array */
    ip[0] = start;
    for (int i = 0; i < bs; i++) ip[i + 1] = ip[i] + kl[i];
    int32_t *u = malloc(((size_t)total + 1) * 4);
    for (int64_t t = 0; t < total; t++) u[t] = (int32_t)t;
    tu_shuffle_i32(r, u, (int)total);
    int32_t *gi = malloc(((size_t)start + total + 1) * 4);
    for (int j = 0; j < start; j++) gi[j] = -7; /* never read */
    for (int i = 0; i < bs; i++)
      for (int p = 0; p < kl[i]; p++) gi[ip[i] + p] = u[ip[i] - start + p] * N + p % N;
    unsigned char *seen = calloc((size_t)total + 1, 1);
    size_t bytes;
    mla_status st = mla_dcp_plan_workspace_size(ctx, bs + 1, (int)(total > 0 ? total : 1), &bytes);
    unsigned char *base = NULL;
    void *ws = ws_alloc(bytes, &base, tu_randint(r, 0, 1));
    for (int rank = 0; rank < N && !bad; rank++) {
      mla_dcp_plan dp;
      memset(&dp, STRUCT_FILL, sizeof dp);
      if (st == MLA_OK) st = mla_dcp_plan_build(ctx, bs, kl, ip, gi, rank, N, ws, bytes, &dp);
      if (st != MLA_OK) {
        snprintf(why, sizeof why, "bs %d N %d rank %d: %s (%s)", bs, N, rank, mla_status_string(st),
                 mla_ctx_last_error(ctx));
        bad = 1;
        break;
      }
      if (dp.batch_size != bs || dp.rank != rank || dp.world != N || dp.kv_indptr[0] != 0) {
        snprintf(why, sizeof why, "header of rank %d", rank);
        bad = 1;
        break;
      }
      for (int i = 0; i < bs && !bad; i++) {
        /* Walk the positions of this rank in order. */
        int j = 0;
        for (int p = 0; p < kl[i]; p++) {
          if (p % N != rank) continue;
          int32_t want = gi[ip[i] + p] / N;
          if (j >= dp.kv_lens[i] || dp.kv_indices[dp.kv_indptr[i] + j] != want) {
            snprintf(why, sizeof why, "rank %d/%d request %d position %d: local %d, want %d", rank,
                     N, i, p, j < dp.kv_lens[i] ? dp.kv_indices[dp.kv_indptr[i] + j] : -1, want);
            bad = 1;
            break;
          }
          j++;
        }
        if (!bad && (dp.kv_lens[i] != j || dp.kv_indptr[i + 1] != dp.kv_indptr[i] + j)) {
          snprintf(why, sizeof why, "rank %d request %d: kv_len %d, want %d", rank, i,
                   dp.kv_lens[i], j);
          bad = 1;
        }
        /* (rank, local) names one key: local * N + rank is its global slot. */
        for (int k = 0; k < dp.kv_lens[i] && !bad; k++) {
          int32_t loc = dp.kv_indices[dp.kv_indptr[i] + k];
          if (loc < 0 || loc >= total) {
            snprintf(why, sizeof why, "local slot %d out of range", loc);
            bad = 1;
          } else {
            seen[loc]++;
          }
        }
      }
    }
    for (int64_t t = 0; t < total && !bad; t++)
      if (seen[t] != 1) {
        snprintf(why, sizeof why, "key %lld on %d ranks (N %d)", (long long)t, seen[t], N);
        bad = 1;
      }
    cases++;
    free(base);
    free(kl);
    free(ip);
    free(u);
    free(gi);
    free(seen);
  }
  TU_CHECK(!bad, "%s", why);
  printf("dcp plans: %d cases\n", cases);
}

static void test_dcp_workspace_and_bad(tu_rng *r, mla_ctx *ctx) {
  const int B = 4;
  int32_t kl[4] = {5, 0, 7, 3}, ip[5] = {0, 5, 5, 12, 15}, gi[15];
  for (int j = 0; j < 15; j++) gi[j] = tu_randint(r, 0, 1000);
  size_t bytes;
  /* Worst case: one rank holds everything (world 1), the index array full. */
  TU_STATUS(mla_dcp_plan_workspace_size(ctx, B, 15, &bytes), MLA_OK);
  unsigned char *ws = malloc(bytes + 1), *ref = malloc(bytes + 1);
  memset(ref, WS_FILL, bytes + 1);
  mla_dcp_plan dp, dp0;
  TU_STATUS(mla_dcp_plan_build(ctx, B, kl, ip, gi, 0, 1, ws + 1, bytes, &dp), MLA_OK);
  TU_CHECK(dp.kv_indptr[B] == 15 && memcmp(dp.kv_indices, gi, sizeof gi) == 0,
           "world 1 keeps every key as it is");
  const mla_status INV = MLA_ERR_INVALID_ARGUMENT;
#define DCP_FAIL(want, msg, bs_, kl_, ip_, gi_, rank_, world_, ws_, bytes_)                        \
  do {                                                                                             \
    memset(&dp, STRUCT_FILL, sizeof dp);                                                           \
    dp0 = dp;                                                                                      \
    memset(ws, WS_FILL, bytes + 1);                                                                \
    mla_status st_ = mla_dcp_plan_build(ctx, bs_, kl_, ip_, gi_, rank_, world_, ws_, bytes_, &dp); \
    TU_CHECK(st_ == (want), "%s: got %s (%s)", msg, mla_status_string(st_),                        \
             mla_ctx_last_error(ctx));                                                             \
    TU_CHECK(memcmp(&dp, &dp0, sizeof dp) == 0, "%s: plan written on error", msg);                 \
    TU_CHECK(memcmp(ws, ref, bytes + 1) == 0, "%s: workspace written on error", msg);              \
  } while (0)
  DCP_FAIL(MLA_ERR_WORKSPACE_TOO_SMALL, "size-1", B, kl, ip, gi, 0, 1, ws, bytes - 1);
  DCP_FAIL(INV, "workspace NULL", B, kl, ip, gi, 0, 1, NULL, bytes);
  DCP_FAIL(INV, "bs -1", -1, kl, ip, gi, 0, 1, ws, bytes);
  DCP_FAIL(INV, "world 0", B, kl, ip, gi, 0, 0, ws, bytes);
  DCP_FAIL(MLA_ERR_OUT_OF_RANGE, "rank -1", B, kl, ip, gi, -1, 2, ws, bytes);
  DCP_FAIL(MLA_ERR_OUT_OF_RANGE, "rank == world", B, kl, ip, gi, 2, 2, ws, bytes);
  DCP_FAIL(INV, "kv_lens NULL", B, NULL, ip, gi, 0, 2, ws, bytes);
  DCP_FAIL(INV, "kv_indptr NULL", B, kl, NULL, gi, 0, 2, ws, bytes);
  DCP_FAIL(INV, "kv_indices NULL", B, kl, ip, NULL, 0, 2, ws, bytes);
  {
    int32_t k2[4] = {5, 0, 7, 3};
    k2[2] = -1;
    DCP_FAIL(INV, "kv_lens -1", B, k2, ip, gi, 0, 2, ws, bytes);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "kv_lens[2] = -1") != NULL, "message: %s",
             mla_ctx_last_error(ctx));
    int32_t i2[5] = {0, 5, 5, 11, 15}; /* request 2: 6 entries for 7 keys */
    DCP_FAIL(INV, "indptr disagrees with kv_lens", B, kl, i2, gi, 0, 2, ws, bytes);
    int32_t g2[15];
    memcpy(g2, gi, sizeof g2);
    g2[5 + 4] = -3; /* request 2, position 4: on rank 0 of 2 */
    DCP_FAIL(INV, "negative slot", B, kl, ip, g2, 0, 2, ws, bytes);
    /* Rank 1 never reads that position. */
    TU_STATUS(mla_dcp_plan_build(ctx, B, kl, ip, g2, 1, 2, ws, bytes, &dp), MLA_OK);
  }
  TU_STATUS(mla_dcp_plan_build(NULL, B, kl, ip, gi, 0, 1, ws, bytes, &dp), INV);
  TU_STATUS(mla_dcp_plan_build(ctx, B, kl, ip, gi, 0, 1, ws, bytes, NULL), INV);
#undef DCP_FAIL
  memset(&dp, STRUCT_FILL, sizeof dp);
  TU_STATUS(mla_dcp_plan_build(ctx, 0, NULL, NULL, NULL, 1, 3, ws, bytes, &dp), MLA_OK);
  TU_CHECK(dp.batch_size == 0 && dp.kv_indptr && dp.kv_indptr[0] == 0, "empty DCP plan");
  size_t sz = 5;
  TU_STATUS(mla_dcp_plan_workspace_size(ctx, 0, 10, &sz), INV);
  TU_STATUS(mla_dcp_plan_workspace_size(ctx, 2, 0, &sz), INV);
  TU_STATUS(mla_dcp_plan_workspace_size(ctx, 2, 10, NULL), INV);
  TU_STATUS(mla_dcp_plan_workspace_size(NULL, 2, 10, &sz), INV);
  TU_CHECK(sz == 5, "bytes written on error");
  free(ws);
  free(ref);
}

/* DCP over a real decode plan's arrays, as the backend will use it. */
static void test_dcp_from_plan(tu_rng *r, mla_ctx *ctx) {
  int32_t target[24];
  for (int i = 0; i < 24; i++) target[i] = random_len(r);
  world w;
  if (world_make(&w, ctx, r, 24, 0, target, 16, 3200) != 0) {
    TU_CHECK(0, "setup");
    return;
  }
  int32_t ids[24];
  int64_t sk = 0;
  for (int i = 0; i < 24; i++) ids[i] = i, sk += w.len[i];
  mla_plan_limits lim = {24, 24, (int)sk + 1, w.max_context, 16, 8, 0};
  size_t pb, db;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &pb), MLA_OK);
  TU_STATUS(mla_dcp_plan_workspace_size(ctx, 24, (int)sk + 1, &db), MLA_OK);
  void *pws = malloc(pb), *dws = malloc(db);
  mla_batch b = {MLA_MODE_DECODE, 24, ids, w.len, NULL, NULL, 0};
  mla_plan pl;
  TU_STATUS(mla_plan_build(ctx, w.rt, &b, &lim, 16, pws, pb, &pl), MLA_OK);
  int N = 3, ok = 1;
  int64_t sum = 0;
  for (int rank = 0; rank < N; rank++) {
    mla_dcp_plan dp;
    TU_STATUS(
        mla_dcp_plan_build(ctx, 24, pl.kv_lens, pl.kv_indptr, pl.kv_indices, rank, N, dws, db, &dp),
        MLA_OK);
    for (int i = 0; i < 24; i++) {
      const int32_t *row = w.r2t + (size_t)i * w.max_context;
      for (int j = 0; j < dp.kv_lens[i]; j++)
        if (dp.kv_indices[dp.kv_indptr[i] + j] != row[rank + j * N] / N) ok = 0;
      sum += dp.kv_lens[i];
    }
  }
  TU_CHECK(ok && sum == sk, "DCP from a plan: ok %d, %lld keys over ranks, want %lld", ok,
           (long long)sum, (long long)sk);
  free(pws);
  free(dws);
  world_free(&w);
}

int main(void) {
  tu_rng r = {tu_seed("test_plan_aux", 0x5eed7a1ull)};
  mla_ctx *ctx = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  if (mla_ctx_create(&cd, &ctx) != MLA_OK) {
    fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  test_chunk_random(&r, ctx);
  test_chunk_workspace(&r, ctx);
  test_chunk_bad(&r, ctx);
  test_draft_random(&r, ctx);
  test_draft_workspace_and_bad(&r, ctx);
  test_dcp_random(&r, ctx);
  test_dcp_workspace_and_bad(&r, ctx);
  test_dcp_from_plan(&r, ctx);
  mla_ctx_destroy(ctx);
  return tu_finish("test_plan_aux");
}
