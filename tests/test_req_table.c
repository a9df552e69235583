/* Request table and page allocator: add / extend / free / fork / truncate,
 * page alignment, reference counts, copy-on-write with real cache data,
 * all-or-nothing failures, a long random sequence of operations checked
 * against a model after every step, and every bad argument. */
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h" /* white-box: req_pages, to check req_to_token against it */
#include "test_util.h"

#define L MLA_LATENT
#define R MLA_ROPE

static mla_ctx *g_ctx;
static tu_rng g_rng;

static mla_req_table *make_table(int max_reqs, int max_context, int pages, int P,
                                 mla_kv_cache *cache) {
  mla_req_table_desc d = {max_reqs, max_context, pages, P};
  mla_req_table *rt = NULL;
  mla_status st = mla_req_table_create(g_ctx, &d, cache, &rt);
  TU_CHECK(st == MLA_OK && rt, "req_table_create: %s (%s)", mla_status_string(st),
           mla_ctx_last_error(g_ctx));
  return rt;
}

static mla_kv_cache *make_cache(int layers, int pages, int P) {
  mla_kv_cache_desc d = {layers, pages, P, MLA_DTYPE_BF16, NULL};
  mla_kv_cache *c = NULL;
  mla_status st = mla_kv_cache_create(g_ctx, &d, &c);
  TU_CHECK(st == MLA_OK && c, "kv_cache_create: %s", mla_status_string(st));
  return c;
}

static int free_pages(const mla_req_table *rt) {
  int n = -1;
  mla_req_table_free_pages(rt, &n);
  return n;
}
static int refs_of(const mla_req_table *rt, int page) {
  int n = -1;
  mla_req_table_page_refs(rt, page, &n);
  return n;
}
static int length_of(const mla_req_table *rt, int32_t id) {
  int n = -1;
  mla_req_length(rt, id, &n);
  return n;
}
static const int32_t *tokens_of(const mla_req_table *rt, int32_t id) {
  const int32_t *t = NULL;
  mla_req_table_data(rt, &t);
  return t ? t + (size_t)id * rt->max_context : NULL;
}

/* ---- invariants ----------------------------------------------------------------- */

/* Checks every structural invariant through the public queries (plus
 * req_pages). expected_len[id] < 0 means "not live". Returns violations. */
static int check_invariants(const mla_req_table *rt, const int *expected_len, const char *when) {
  const int P = rt->page_size, NP = rt->num_pages, C = rt->max_context;
  int bad = 0;
  int *count = calloc((size_t)NP, sizeof(int));
  /* owner of each slot: request+1 and position, to catch a slot handed out twice */
  int32_t *own_req = calloc((size_t)NP * P, sizeof(int32_t));
  int32_t *own_pos = calloc((size_t)NP * P, sizeof(int32_t));
  for (int32_t id = 0; id < rt->max_reqs; id++) {
    int live = -1;
    mla_req_is_live(rt, id, &live);
    const int32_t *tok = tokens_of(rt, id);
    if ((expected_len[id] >= 0) != (live == 1)) {
      if (bad++ < 5) fprintf(stderr, "  [%s] req %d live = %d, model %d\n", when, id, live, expected_len[id]);
      continue;
    }
    if (!live) {
      for (int p = 0; p < C; p++)
        if (tok[p] != MLA_SLOT_UNUSED) {
          if (bad++ < 5) fprintf(stderr, "  [%s] dead req %d has tok[%d] = %d\n", when, id, p, tok[p]);
          break;
        }
      continue;
    }
    int len = length_of(rt, id);
    if (len != expected_len[id]) {
      if (bad++ < 5) fprintf(stderr, "  [%s] req %d length %d, model %d\n", when, id, len, expected_len[id]);
      continue;
    }
    const int32_t *pages = rt->req_pages + (size_t)id * rt->max_pages_per_req;
    int np = (len + P - 1) / P;
    for (int k = 0; k < np; k++) {
      if (pages[k] < 1 || pages[k] >= NP) {
        if (bad++ < 5) fprintf(stderr, "  [%s] req %d page[%d] = %d\n", when, id, k, pages[k]);
        continue;
      }
      count[pages[k]]++;
    }
    for (int p = 0; p < len; p++) {
      int32_t s = tok[p];
      /* page-aligned: position p sits at offset p % P of the page of its index */
      if (s / P != pages[p / P] || s % P != p % P) {
        if (bad++ < 5)
          fprintf(stderr, "  [%s] req %d tok[%d] = %d, page %d\n", when, id, p, s, pages[p / P]);
        continue;
      }
      if (own_req[s] == 0) {
        own_req[s] = id + 1;
        own_pos[s] = p;
      } else if (own_pos[s] != p || refs_of(rt, s / P) < 2) {
        /* the same slot in two requests is only legal for a shared page */
        if (bad++ < 5)
          fprintf(stderr, "  [%s] slot %d used by req %d pos %d and req %d pos %d (refs %d)\n", when,
                  s, own_req[s] - 1, own_pos[s], id, p, refs_of(rt, s / P));
      }
    }
    for (int p = len; p < C; p++)
      if (tok[p] != MLA_SLOT_UNUSED) {
        if (bad++ < 5) fprintf(stderr, "  [%s] req %d tok[%d] = %d past length %d\n", when, id, p, tok[p], len);
        break;
      }
  }
  int used = 0, zero = 0;
  for (int pg = 1; pg < NP; pg++) {
    int r = refs_of(rt, pg);
    if (r != count[pg]) {
      if (bad++ < 5) fprintf(stderr, "  [%s] page %d refs %d, counted %d\n", when, pg, r, count[pg]);
    }
    if (count[pg] > 0) used++;
    else zero++;
  }
  if (refs_of(rt, 0) != 1) bad++, fprintf(stderr, "  [%s] page 0 refs %d\n", when, refs_of(rt, 0));
  if (free_pages(rt) + used != NP - 1 || free_pages(rt) != zero) {
    bad++;
    fprintf(stderr, "  [%s] free %d + used %d != %d\n", when, free_pages(rt), used, NP - 1);
  }
  free(count);
  free(own_req);
  free(own_pos);
  return bad;
}

/* ---- snapshots for all-or-nothing checks ---------------------------------------- */

typedef struct snapshot {
  int32_t *tok;
  int *len, *refs;
  int free_pages;
} snapshot;

static snapshot snap_take(const mla_req_table *rt) {
  snapshot s;
  size_t n = (size_t)rt->max_reqs * rt->max_context;
  s.tok = malloc(n * sizeof(int32_t));
  memcpy(s.tok, tokens_of(rt, 0), n * sizeof(int32_t));
  s.len = malloc(sizeof(int) * (size_t)rt->max_reqs);
  for (int i = 0; i < rt->max_reqs; i++) {
    int live = 0;
    mla_req_is_live(rt, i, &live);
    s.len[i] = live ? length_of(rt, i) : -1;
  }
  s.refs = malloc(sizeof(int) * (size_t)rt->num_pages);
  for (int p = 0; p < rt->num_pages; p++) s.refs[p] = refs_of(rt, p);
  s.free_pages = free_pages(rt);
  return s;
}

static int snap_same(const mla_req_table *rt, const snapshot *s) {
  snapshot t = snap_take(rt);
  size_t n = (size_t)rt->max_reqs * rt->max_context;
  int same = memcmp(s->tok, t.tok, n * sizeof(int32_t)) == 0 &&
             memcmp(s->len, t.len, sizeof(int) * (size_t)rt->max_reqs) == 0 &&
             memcmp(s->refs, t.refs, sizeof(int) * (size_t)rt->num_pages) == 0 &&
             s->free_pages == t.free_pages;
  free(t.tok);
  free(t.len);
  free(t.refs);
  return same;
}

static void snap_free(snapshot *s) {
  free(s->tok);
  free(s->len);
  free(s->refs);
}

/* ---- basic life cycle ------------------------------------------------------------ */

static void test_lifecycle(void) {
  const int P = 16, NP = 10;
  mla_req_table *rt = make_table(3, 100, NP, P, NULL);
  if (!rt) return;
  int lens[3] = {-1, -1, -1};
  TU_CHECK(free_pages(rt) == NP - 1, "fresh free pages %d", free_pages(rt));
  int32_t a = -1, b = -1, c = -1;
  TU_STATUS(mla_req_add(rt, &a), MLA_OK);
  TU_STATUS(mla_req_add(rt, &b), MLA_OK);
  TU_CHECK(a == 0 && b == 1, "ids %d %d", a, b);
  int32_t sa[40], sb[40];
  TU_STATUS(mla_req_extend(rt, a, 20, sa), MLA_OK);
  TU_STATUS(mla_req_extend(rt, b, 33, sb), MLA_OK);
  lens[0] = 20, lens[1] = 33;
  TU_CHECK(check_invariants(rt, lens, "lifecycle 1") == 0, "invariants");
  TU_CHECK(memcmp(sa, tokens_of(rt, a), sizeof(int32_t) * 20) == 0, "slots_out == req_to_token");
  TU_CHECK(free_pages(rt) == NP - 1 - 2 - 3, "free after extends %d", free_pages(rt));
  /* extend by 0 and with NULL slots_out */
  TU_STATUS(mla_req_extend(rt, a, 0, NULL), MLA_OK);
  TU_STATUS(mla_req_extend(rt, a, 5, NULL), MLA_OK);
  lens[0] = 25;
  TU_CHECK(check_invariants(rt, lens, "lifecycle 2") == 0, "invariants");
  TU_CHECK(length_of(rt, a) == 25, "length");
  /* free a: its pages return; the id is reused, empty */
  TU_STATUS(mla_req_free(rt, a), MLA_OK);
  lens[0] = -1;
  TU_CHECK(free_pages(rt) == NP - 1 - 3, "free after free %d", free_pages(rt));
  TU_CHECK(check_invariants(rt, lens, "lifecycle 3") == 0, "invariants");
  int live = 1;
  TU_STATUS(mla_req_is_live(rt, a, &live), MLA_OK);
  TU_CHECK(live == 0, "freed request still live");
  TU_STATUS(mla_req_add(rt, &c), MLA_OK);
  TU_CHECK(c == 0, "lowest free id reused: %d", c);
  lens[0] = 0;
  TU_CHECK(length_of(rt, c) == 0, "reused id has length %d", length_of(rt, c));
  TU_STATUS(mla_req_extend(rt, c, 17, sa), MLA_OK);
  lens[0] = 17;
  TU_CHECK(check_invariants(rt, lens, "lifecycle 4") == 0, "invariants");
  /* page 0 is never handed out */
  for (int i = 0; i < 17; i++) TU_CHECK(sa[i] >= P, "slot %d in page 0", sa[i]);
  mla_req_table_desc d;
  TU_STATUS(mla_req_table_get_desc(rt, &d), MLA_OK);
  TU_CHECK(d.max_reqs == 3 && d.max_context == 100 && d.num_pages == NP && d.page_size == P,
           "get_desc");
  mla_req_table_destroy(rt);
  mla_req_table_destroy(NULL);
}

/* Interleaved extends of several requests: the positions of one page index
 * are contiguous in one page, at offsets 0..P-1. */
static void test_alignment(int P) {
  const int nreq = 3, ctx = 4 * P + 7;
  int NP = nreq * (ctx + P - 1) / P + 2;
  mla_req_table *rt = make_table(nreq, ctx, NP, P, NULL);
  if (!rt) return;
  int lens[3];
  int32_t id[3];
  for (int i = 0; i < nreq; i++) {
    mla_req_add(rt, &id[i]);
    lens[i] = 0;
  }
  for (int step = 0; step < 40; step++) {
    int i = tu_randint(&g_rng, 0, nreq - 1);
    int n = tu_randint(&g_rng, 1, P + 3);
    if (lens[i] + n > ctx) continue;
    TU_STATUS(mla_req_extend(rt, id[i], n, NULL), MLA_OK);
    lens[i] += n;
  }
  int bad = 0;
  for (int i = 0; i < nreq; i++) {
    const int32_t *tok = tokens_of(rt, id[i]);
    for (int p = 0; p < lens[i]; p++) {
      int32_t first = tok[p - p % P];
      if (tok[p] != first + p % P || first % P != 0) bad++;
    }
  }
  TU_CHECK(bad == 0, "P=%d: %d positions not page aligned", P, bad);
  char when[32];
  snprintf(when, sizeof when, "alignment P=%d", P);
  TU_CHECK(check_invariants(rt, lens, when) == 0, "invariants");
  mla_req_table_destroy(rt);
}

/* ---- exhaustion and capacity ------------------------------------------------------ */

static void test_exhaustion(void) {
  const int P = 16, NP = 4; /* 3 usable pages */
  mla_req_table *rt = make_table(2, 64, NP, P, NULL);
  if (!rt) return;
  int32_t a, b;
  mla_req_add(rt, &a);
  int32_t so[64];
  TU_STATUS(mla_req_extend(rt, a, 20, so), MLA_OK); /* pages: 2, the second partial */
  TU_STATUS(mla_req_fork(rt, a, 20, &b), MLA_OK);   /* shares both */
  TU_CHECK(free_pages(rt) == 1, "free %d", free_pages(rt));
  /* b extending to position 32 needs a new page and a CoW copy: 2 > 1 free */
  snapshot s = snap_take(rt);
  for (int v = 0; v < 64; v++) so[v] = -7;
  TU_STATUS(mla_req_extend(rt, b, 13, so), MLA_ERR_CACHE_FULL);
  TU_CHECK(strstr(mla_req_table_last_error(rt), "free") != NULL, "last_error '%s'",
           mla_req_table_last_error(rt));
  TU_CHECK(snap_same(rt, &s), "CACHE_FULL changed the table");
  TU_CHECK(so[0] == -7, "CACHE_FULL wrote slots_out");
  /* the other request too: a's last page is shared, so it needs CoW + a new page */
  TU_STATUS(mla_req_extend(rt, a, 30, so), MLA_ERR_CACHE_FULL);
  TU_CHECK(snap_same(rt, &s), "CACHE_FULL changed the table");
  snap_free(&s);
  /* exactly enough: CoW only (stays inside the page) */
  TU_STATUS(mla_req_extend(rt, b, 12, so), MLA_OK);
  TU_CHECK(free_pages(rt) == 0, "free %d", free_pages(rt));
  int lens[2] = {20, 32};
  TU_CHECK(check_invariants(rt, lens, "exhaustion 1") == 0, "invariants");
  /* full, and b's last page is full: any growth needs a page */
  s = snap_take(rt);
  TU_STATUS(mla_req_extend(rt, b, 1, so), MLA_ERR_CACHE_FULL);
  TU_CHECK(snap_same(rt, &s), "CACHE_FULL changed the table");
  /* a no longer shares its last page (b moved away): it may fill it in place */
  TU_STATUS(mla_req_extend(rt, a, 12, so), MLA_OK);
  lens[0] = 32;
  TU_CHECK(check_invariants(rt, lens, "exhaustion 2") == 0, "invariants");
  snap_free(&s);

  /* CAPACITY: max_context, then max_reqs for add and fork */
  s = snap_take(rt);
  TU_STATUS(mla_req_extend(rt, a, 33, so), MLA_ERR_CAPACITY);
  TU_CHECK(strstr(mla_req_table_last_error(rt), "max_context") != NULL, "last_error '%s'",
           mla_req_table_last_error(rt));
  TU_STATUS(mla_req_extend(rt, a, INT32_MAX, so), MLA_ERR_CAPACITY);
  int32_t c = -5;
  TU_STATUS(mla_req_add(rt, &c), MLA_ERR_CAPACITY);
  TU_STATUS(mla_req_fork(rt, a, 3, &c), MLA_ERR_CAPACITY);
  TU_CHECK(c == -5, "failed add/fork wrote the id");
  TU_CHECK(snap_same(rt, &s), "CAPACITY changed the table");
  snap_free(&s);
  mla_req_table_destroy(rt);

  /* max_context alone (plenty of pages) */
  rt = make_table(1, 10, 64, 1, NULL);
  if (!rt) return;
  mla_req_add(rt, &a);
  TU_STATUS(mla_req_extend(rt, a, 10, NULL), MLA_OK);
  TU_STATUS(mla_req_extend(rt, a, 1, NULL), MLA_ERR_CAPACITY);
  TU_STATUS(mla_req_truncate(rt, a, 4), MLA_OK);
  TU_STATUS(mla_req_extend(rt, a, 7, NULL), MLA_ERR_CAPACITY);
  TU_STATUS(mla_req_extend(rt, a, 6, NULL), MLA_OK);
  mla_req_table_destroy(rt);
}

/* ---- truncate then extend (rejected drafts) ---------------------------------------- */

static void test_rollback(void) {
  const int P = 16, NP = 8;
  mla_req_table *rt = make_table(2, 100, NP, P, NULL);
  if (!rt) return;
  int32_t a;
  mla_req_add(rt, &a);
  int32_t s1[40], s2[40];
  TU_STATUS(mla_req_extend(rt, a, 10, s1), MLA_OK);
  TU_STATUS(mla_req_extend(rt, a, 4, s1 + 10), MLA_OK); /* 4 drafts */
  TU_STATUS(mla_req_truncate(rt, a, 11), MLA_OK);       /* 1 accepted */
  const int32_t *tok = tokens_of(rt, a);
  TU_CHECK(tok[11] == MLA_SLOT_UNUSED && tok[13] == MLA_SLOT_UNUSED && tok[10] == s1[10],
           "truncate cleared entries");
  TU_STATUS(mla_req_extend(rt, a, 3, s2), MLA_OK);
  /* same page, not shared: the rejected slots are reused in place */
  TU_CHECK(s2[0] == s1[11] && s2[2] == s1[13], "rollback reuse %d %d", s2[0], s1[11]);
  int lens[2] = {14, -1};
  TU_CHECK(check_invariants(rt, lens, "rollback 1") == 0, "invariants");
  /* drafts spilling into new pages: truncation gives the pages back */
  int before = free_pages(rt);
  TU_STATUS(mla_req_extend(rt, a, 40, s1), MLA_OK); /* to 54: pages 0..3 */
  TU_CHECK(free_pages(rt) == before - 3, "free %d", free_pages(rt));
  TU_STATUS(mla_req_truncate(rt, a, 16), MLA_OK); /* keeps exactly 1 page */
  TU_CHECK(free_pages(rt) == before + 0, "truncate to a page boundary: free %d, want %d",
           free_pages(rt), before);
  lens[0] = 16;
  TU_CHECK(check_invariants(rt, lens, "rollback 2") == 0, "invariants");
  TU_STATUS(mla_req_truncate(rt, a, 16), MLA_OK); /* no-op */
  TU_STATUS(mla_req_truncate(rt, a, 0), MLA_OK);
  TU_CHECK(free_pages(rt) == NP - 1, "truncate to 0 frees all: %d", free_pages(rt));
  lens[0] = 0;
  TU_CHECK(check_invariants(rt, lens, "rollback 3") == 0, "invariants");
  TU_STATUS(mla_req_extend(rt, a, 5, s1), MLA_OK);
  lens[0] = 5;
  TU_CHECK(check_invariants(rt, lens, "rollback 4") == 0, "invariants");
  mla_req_table_destroy(rt);
}

/* ---- fork + copy-on-write with cache data ------------------------------------------ */

static void write_rows(mla_kv_cache *cache, int layers, int n, const int32_t *slots, float *c,
                       float *r) {
  for (int l = 0; l < layers; l++) {
    tu_fill_bf16_normal(&g_rng, c + (size_t)l * n * L, (int64_t)n * L, 1.0);
    tu_fill_bf16_normal(&g_rng, r + (size_t)l * n * R, (int64_t)n * R, 1.0);
    TU_STATUS(mla_kv_cache_write(cache, l, n, slots, c + (size_t)l * n * L, r + (size_t)l * n * R,
                                 MLA_DTYPE_F32),
              MLA_OK);
  }
}

/* Read positions [p0, p0+n) of request id in layer l and compare with c/r
 * rows (row stride given). */
static int rows_match(const mla_kv_cache *cache, const mla_req_table *rt, int32_t id, int l,
                      int p0, int n, const float *c, const float *r) {
  float *gc = malloc(sizeof(float) * (size_t)n * L), *gr = malloc(sizeof(float) * (size_t)n * R);
  const int32_t *tok = tokens_of(rt, id) + p0;
  int ok = mla_kv_cache_read(cache, l, n, tok, gc, gr, MLA_DTYPE_F32) == MLA_OK &&
           memcmp(gc, c, sizeof(float) * (size_t)n * L) == 0 &&
           memcmp(gr, r, sizeof(float) * (size_t)n * R) == 0;
  free(gc);
  free(gr);
  return ok;
}

static void test_fork_cow(int parent_first) {
  const int P = 16, NP = 16, layers = 2;
  mla_kv_cache *cache = make_cache(layers, NP, P);
  mla_req_table *rt = cache ? make_table(4, 200, NP, P, cache) : NULL;
  if (!rt) {
    mla_kv_cache_destroy(cache);
    return;
  }
  const int plen = 40, prefix = 37, pn = 5, cn = 6;
  float *pc = malloc(sizeof(float) * layers * plen * L), *pr = malloc(sizeof(float) * layers * plen * R);
  float *nc = malloc(sizeof(float) * layers * pn * L), *nr = malloc(sizeof(float) * layers * pn * R);
  float *cc = malloc(sizeof(float) * layers * cn * L), *cr = malloc(sizeof(float) * layers * cn * R);
  int32_t parent, child, s[64];
  mla_req_add(rt, &parent);
  TU_STATUS(mla_req_extend(rt, parent, plen, s), MLA_OK);
  write_rows(cache, layers, plen, s, pc, pr);
  TU_STATUS(mla_req_fork(rt, parent, prefix, &child), MLA_OK);
  TU_CHECK(length_of(rt, child) == prefix, "child length");
  TU_CHECK(memcmp(tokens_of(rt, child), tokens_of(rt, parent), sizeof(int32_t) * prefix) == 0,
           "child shares the parent's slots");
  int shared_page = tokens_of(rt, parent)[32] / P;
  TU_CHECK(refs_of(rt, shared_page) == 2, "shared page refs %d", refs_of(rt, shared_page));
  int lens[4] = {-1, -1, -1, -1};
  lens[parent] = plen;
  lens[child] = prefix;
  TU_CHECK(check_invariants(rt, lens, "fork") == 0, "invariants");

  int32_t ps[8], cs[8];
  for (int step = 0; step < 2; step++) {
    if ((step == 0) == (parent_first != 0)) {
      TU_STATUS(mla_req_extend(rt, parent, pn, ps), MLA_OK);
      write_rows(cache, layers, pn, ps, nc, nr);
    } else {
      TU_STATUS(mla_req_extend(rt, child, cn, cs), MLA_OK);
      write_rows(cache, layers, cn, cs, cc, cr);
    }
  }
  lens[parent] = plen + pn;
  lens[child] = prefix + cn;
  TU_CHECK(check_invariants(rt, lens, "after cow") == 0, "invariants");
  /* the last pages diverged; the full pages are still shared */
  int pl = tokens_of(rt, parent)[32] / P, cl = tokens_of(rt, child)[32] / P;
  TU_CHECK(pl != cl && refs_of(rt, pl) == 1 && refs_of(rt, cl) == 1, "pages %d %d refs %d %d", pl,
           cl, refs_of(rt, pl), refs_of(rt, cl));
  TU_CHECK(tokens_of(rt, parent)[0] == tokens_of(rt, child)[0] &&
               refs_of(rt, tokens_of(rt, child)[0] / P) == 2,
           "full pages stay shared");
  for (int l = 0; l < layers; l++) {
    const float *lpc = pc + (size_t)l * plen * L, *lpr = pr + (size_t)l * plen * R;
    TU_CHECK(rows_match(cache, rt, child, l, 0, prefix, lpc, lpr),
             "layer %d: child lost the parent's prefix (parent_first=%d)", l, parent_first);
    TU_CHECK(rows_match(cache, rt, parent, l, 0, plen, lpc, lpr),
             "layer %d: parent lost its rows (parent_first=%d)", l, parent_first);
    TU_CHECK(rows_match(cache, rt, parent, l, plen, pn, nc + (size_t)l * pn * L,
                        nr + (size_t)l * pn * R),
             "layer %d: parent's new rows overwritten (parent_first=%d)", l, parent_first);
    TU_CHECK(rows_match(cache, rt, child, l, prefix, cn, cc + (size_t)l * cn * L,
                        cr + (size_t)l * cn * R),
             "layer %d: child's new rows overwritten (parent_first=%d)", l, parent_first);
  }
  /* freeing the parent keeps the child's shared pages alive */
  TU_STATUS(mla_req_free(rt, parent), MLA_OK);
  lens[parent] = -1;
  TU_CHECK(check_invariants(rt, lens, "free parent") == 0, "invariants");
  for (int l = 0; l < layers; l++)
    TU_CHECK(rows_match(cache, rt, child, l, 0, prefix, pc + (size_t)l * plen * L,
                        pr + (size_t)l * plen * R),
             "child prefix after the parent was freed");
  free(pc);
  free(pr);
  free(nc);
  free(nr);
  free(cc);
  free(cr);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
}

/* ---- random sequence against a model ---------------------------------------------- */

/* Each position written gets a signature in the rope part of its row (three
 * small integers, exact in bf16; layer 1 differs from layer 0). The model
 * knows every live position's signature, so any overwrite, lost CoW copy or
 * wrong remap shows up as a wrong signature. */
typedef struct model {
  int max_reqs, max_context;
  int *len;       /* [max_reqs], -1 = not live */
  uint32_t *sig;  /* [max_reqs, max_context] */
  uint32_t next_sig;
} model;

static uint16_t bf16_of_small_int(int v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

static uint32_t layer_sig(uint32_t sig, int l) { return l == 0 ? sig : sig ^ 0x5a5a5au; }

static void write_sigs(mla_kv_cache *cache, int n, const int32_t *slots, const uint32_t *sigs,
                       float *cbuf, float *rbuf) {
  for (int l = 0; l < 2; l++) {
    memset(cbuf, 0, sizeof(float) * (size_t)n * L);
    memset(rbuf, 0, sizeof(float) * (size_t)n * R);
    for (int i = 0; i < n; i++) {
      uint32_t s = layer_sig(sigs[i], l);
      rbuf[i * R + 0] = (float)(s & 255u);
      rbuf[i * R + 1] = (float)((s >> 8) & 255u);
      rbuf[i * R + 2] = (float)((s >> 16) & 255u);
    }
    TU_STATUS(mla_kv_cache_write(cache, l, n, slots, cbuf, rbuf, MLA_DTYPE_F32), MLA_OK);
  }
}

/* Raw check of the signatures of every live position (bf16 row: r at byte 1024). */
static int check_sigs(mla_kv_cache *cache, const mla_req_table *rt, const model *m) {
  int bad = 0;
  for (int l = 0; l < 2; l++) {
    void *p = NULL;
    mla_kv_cache_layer_data(cache, l, &p);
    const unsigned char *base = p;
    for (int id = 0; id < m->max_reqs; id++) {
      if (m->len[id] < 0) continue;
      const int32_t *tok = tokens_of(rt, id);
      for (int q = 0; q < m->len[id]; q++) {
        uint32_t s = layer_sig(m->sig[(size_t)id * m->max_context + q], l);
        uint16_t want[3] = {bf16_of_small_int((int)(s & 255u)),
                            bf16_of_small_int((int)((s >> 8) & 255u)),
                            bf16_of_small_int((int)((s >> 16) & 255u))};
        if (memcmp(base + (size_t)tok[q] * 1152 + 1024, want, sizeof want) != 0) {
          if (bad++ < 3) fprintf(stderr, "  layer %d req %d pos %d: wrong signature\n", l, id, q);
        }
      }
    }
  }
  return bad;
}

static void test_random_ops(int P, int NP, int max_reqs, int max_context, int nops) {
  mla_kv_cache *cache = make_cache(2, NP, P);
  mla_req_table *rt = cache ? make_table(max_reqs, max_context, NP, P, cache) : NULL;
  if (!rt) {
    mla_kv_cache_destroy(cache);
    return;
  }
  model m = {max_reqs, max_context, malloc(sizeof(int) * (size_t)max_reqs),
             calloc((size_t)max_reqs * max_context, sizeof(uint32_t)), 1};
  for (int i = 0; i < max_reqs; i++) m.len[i] = -1;
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)max_context);
  uint32_t *sigs = malloc(sizeof(uint32_t) * (size_t)max_context);
  float *cbuf = malloc(sizeof(float) * (size_t)max_context * L);
  float *rbuf = malloc(sizeof(float) * (size_t)max_context * R);
  int counts[5][3] = {{0}}; /* op x {ok, cache_full, capacity} */
  int bad_total = 0, mismatch = 0;
  for (int op = 0; op < nops && bad_total == 0; op++) {
    int kind = tu_randint(&g_rng, 0, 99);
    /* pick a live request (or -1) */
    int live_ids[256], nl = 0, lowest_free = -1;
    for (int i = 0; i < max_reqs; i++) {
      if (m.len[i] >= 0) live_ids[nl++] = i;
      else if (lowest_free < 0) lowest_free = i;
    }
    int id = nl ? live_ids[tu_randint(&g_rng, 0, nl - 1)] : -1;
    snapshot before = snap_take(rt);
    mla_status st = MLA_OK, want = MLA_OK;
    int which;
    if (kind < 15 || id < 0) { /* add */
      which = 0;
      int32_t nid = -1;
      want = lowest_free < 0 ? MLA_ERR_CAPACITY : MLA_OK;
      st = mla_req_add(rt, &nid);
      if (st == MLA_OK) {
        if (nid != lowest_free) mismatch++;
        m.len[nid] = 0;
      }
    } else if (kind < 60) { /* extend */
      which = 1;
      int len = m.len[id];
      int n = tu_randint(&g_rng, 0, 99) < 80 ? tu_randint(&g_rng, 0, 2 * P + 2)
                                              : tu_randint(&g_rng, 0, max_context / 2);
      /* expected status from the table's (already verified) reference counts */
      int have = (len + P - 1) / P, wantp = (len + n + P - 1) / P;
      int cow = 0;
      if (n > 0 && len % P != 0) cow = refs_of(rt, tokens_of(rt, id)[len - 1] / P) > 1;
      if (len + n > max_context) want = MLA_ERR_CAPACITY;
      else if (wantp - have + cow > free_pages(rt)) want = MLA_ERR_CACHE_FULL;
      st = mla_req_extend(rt, id, n, slots);
      if (st == MLA_OK) {
        if (memcmp(slots, tokens_of(rt, id) + len, sizeof(int32_t) * (size_t)n) != 0) mismatch++;
        for (int i = 0; i < n; i++) {
          sigs[i] = m.next_sig++ & 0xffffffu;
          m.sig[(size_t)id * max_context + len + i] = sigs[i];
          /* new positions are only ever in pages this request owns alone */
          if (refs_of(rt, slots[i] / P) != 1) mismatch++;
        }
        if (n > 0) write_sigs(cache, n, slots, sigs, cbuf, rbuf);
        m.len[id] = len + n;
      }
    } else if (kind < 75) { /* fork */
      which = 2;
      int prefix = tu_randint(&g_rng, 0, m.len[id]);
      int32_t nid = -1;
      want = lowest_free < 0 ? MLA_ERR_CAPACITY : MLA_OK;
      st = mla_req_fork(rt, id, prefix, &nid);
      if (st == MLA_OK) {
        if (nid != lowest_free) mismatch++;
        m.len[nid] = prefix;
        memcpy(m.sig + (size_t)nid * max_context, m.sig + (size_t)id * max_context,
               sizeof(uint32_t) * (size_t)prefix);
      }
    } else if (kind < 90) { /* truncate */
      which = 3;
      int nl2 = tu_randint(&g_rng, 0, m.len[id]);
      st = mla_req_truncate(rt, id, nl2);
      if (st == MLA_OK) m.len[id] = nl2;
    } else { /* free */
      which = 4;
      st = mla_req_free(rt, id);
      if (st == MLA_OK) m.len[id] = -1;
    }
    if (st != want) {
      mismatch++;
      fprintf(stderr, "  op %d kind %d: %s, expected %s\n", op, which, mla_status_string(st),
                      mla_status_string(want));
    }
    if (st != MLA_OK && !snap_same(rt, &before)) {
      mismatch++;
      fprintf(stderr, "  op %d: failed call changed the table\n", op);
    }
    snap_free(&before);
    counts[which][st == MLA_OK ? 0 : st == MLA_ERR_CACHE_FULL ? 1 : 2]++;
    char when[48];
    snprintf(when, sizeof when, "P=%d op %d", P, op);
    bad_total += check_invariants(rt, m.len, when);
    bad_total += check_sigs(cache, rt, &m);
    bad_total += mismatch;
  }
  TU_CHECK(bad_total == 0, "P=%d random ops: %d violations", P, bad_total);
  /* the sequence must have exercised every path, failures included */
  TU_CHECK(counts[1][0] > 50 && counts[1][1] > 5 && counts[2][0] > 20 && counts[3][0] > 20 &&
               counts[4][0] > 10 && counts[0][2] > 0,
           "P=%d op mix: extend ok %d full %d, fork %d, truncate %d, free %d, add-capacity %d", P,
           counts[1][0], counts[1][1], counts[2][0], counts[3][0], counts[4][0], counts[0][2]);
  printf("  P=%d: %d ops (extend ok %d, cache_full %d, capacity %d; forks %d; truncates %d; "
         "frees %d)\n",
         P, nops, counts[1][0], counts[1][1], counts[1][2], counts[2][0], counts[3][0],
         counts[4][0]);
  free(m.len);
  free(m.sig);
  free(slots);
  free(sigs);
  free(cbuf);
  free(rbuf);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
}

/* ---- bad arguments ------------------------------------------------------------------ */

static int has(const char *msg, const char *word) { return msg && *msg && strstr(msg, word); }

static void test_bad_args(void) {
  mla_req_table_desc ok = {4, 64, 8, 16}, d;
  mla_req_table *rt = NULL, *o;
  TU_STATUS(mla_req_table_create(NULL, &ok, NULL, &rt), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(rt == NULL, "NULL ctx gave a table");
#define CREATE_FAIL(DP, CACHE, WANT, WORD)                                              \
  do {                                                                                  \
    o = (mla_req_table *)&g_rng;                                                        \
    TU_STATUS(mla_req_table_create(g_ctx, (DP), (CACHE), &o), (WANT));                  \
    TU_CHECK(o == NULL, "*out not reset");                                              \
    TU_CHECK(has(mla_ctx_last_error(g_ctx), WORD), "ctx last_error '%s' lacks '%s'",    \
             mla_ctx_last_error(g_ctx), WORD);                                          \
  } while (0)
  TU_STATUS(mla_req_table_create(g_ctx, &ok, NULL, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(has(mla_ctx_last_error(g_ctx), "out"), "last_error");
  CREATE_FAIL(NULL, NULL, MLA_ERR_INVALID_ARGUMENT, "desc");
  d = ok, d.max_reqs = 0;
  CREATE_FAIL(&d, NULL, MLA_ERR_INVALID_ARGUMENT, "max_reqs");
  d = ok, d.max_context = 0;
  CREATE_FAIL(&d, NULL, MLA_ERR_INVALID_ARGUMENT, "max_context");
  d = ok, d.max_context = -1;
  CREATE_FAIL(&d, NULL, MLA_ERR_INVALID_ARGUMENT, "max_context");
  d = ok, d.num_pages = 1;
  CREATE_FAIL(&d, NULL, MLA_ERR_INVALID_ARGUMENT, "num_pages");
  const int bad_ps[] = {0, 3, 512, -2};
  for (int i = 0; i < 4; i++) {
    d = ok, d.page_size = bad_ps[i];
    CREATE_FAIL(&d, NULL, MLA_ERR_INVALID_ARGUMENT, "page_size");
  }
  mla_kv_cache *cache = make_cache(1, 8, 16);
  if (cache) {
    d = ok, d.num_pages = 9;
    CREATE_FAIL(&d, cache, MLA_ERR_INVALID_ARGUMENT, "cache");
    d = ok, d.page_size = 32;
    CREATE_FAIL(&d, cache, MLA_ERR_INVALID_ARGUMENT, "cache");
    d = ok;
    TU_STATUS(mla_req_table_create(g_ctx, &d, cache, &o), MLA_OK);
    mla_req_table_destroy(o);
  }
#undef CREATE_FAIL

  rt = make_table(4, 64, 8, 16, NULL);
  if (!rt) {
    mla_kv_cache_destroy(cache);
    return;
  }
  int32_t a, b, nid;
  mla_req_add(rt, &a);
  mla_req_add(rt, &b);
  mla_req_extend(rt, a, 20, NULL);
  mla_req_free(rt, b); /* b: valid id, not live */
  int v;
  const int32_t *data;
  snapshot s = snap_take(rt);
#define EXPECT(call, want, word)                                                       \
  do {                                                                                 \
    TU_STATUS(call, want);                                                             \
    TU_CHECK(has(mla_req_table_last_error(rt), word), "last_error '%s' lacks '%s'",   \
             mla_req_table_last_error(rt), word);                                      \
  } while (0)
  /* NULL handle: every function */
  TU_STATUS(mla_req_add(NULL, &nid), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_extend(NULL, a, 1, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_free(NULL, a), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_fork(NULL, a, 1, &nid), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_truncate(NULL, a, 1), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_length(NULL, a, &v), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_is_live(NULL, a, &v), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_table_data(NULL, &data), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_table_free_pages(NULL, &v), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_table_page_refs(NULL, 1, &v), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_req_table_get_desc(NULL, &d), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(has(mla_req_table_last_error(NULL), "NULL"), "last_error(NULL)");
  /* NULL outputs */
  EXPECT(mla_req_add(rt, NULL), MLA_ERR_INVALID_ARGUMENT, "req_id");
  EXPECT(mla_req_fork(rt, a, 1, NULL), MLA_ERR_INVALID_ARGUMENT, "new_id");
  EXPECT(mla_req_length(rt, a, NULL), MLA_ERR_INVALID_ARGUMENT, "len");
  EXPECT(mla_req_is_live(rt, a, NULL), MLA_ERR_INVALID_ARGUMENT, "live");
  EXPECT(mla_req_table_data(rt, NULL), MLA_ERR_INVALID_ARGUMENT, "req_to_token");
  EXPECT(mla_req_table_free_pages(rt, NULL), MLA_ERR_INVALID_ARGUMENT, "free_pages");
  EXPECT(mla_req_table_page_refs(rt, 1, NULL), MLA_ERR_INVALID_ARGUMENT, "refs");
  EXPECT(mla_req_table_get_desc(rt, NULL), MLA_ERR_INVALID_ARGUMENT, "desc");
  /* ids out of range and not live */
  const int32_t bad_ids[] = {-1, 4, INT32_MIN, INT32_MAX};
  for (int i = 0; i < 4; i++) {
    int32_t x = bad_ids[i];
    EXPECT(mla_req_extend(rt, x, 1, NULL), MLA_ERR_OUT_OF_RANGE, "req_id");
    EXPECT(mla_req_free(rt, x), MLA_ERR_OUT_OF_RANGE, "req_id");
    EXPECT(mla_req_fork(rt, x, 0, &nid), MLA_ERR_OUT_OF_RANGE, "src_id");
    EXPECT(mla_req_truncate(rt, x, 0), MLA_ERR_OUT_OF_RANGE, "req_id");
    EXPECT(mla_req_length(rt, x, &v), MLA_ERR_OUT_OF_RANGE, "req_id");
    EXPECT(mla_req_is_live(rt, x, &v), MLA_ERR_OUT_OF_RANGE, "req_id");
  }
  EXPECT(mla_req_extend(rt, b, 1, NULL), MLA_ERR_BAD_STATE, "live");
  EXPECT(mla_req_free(rt, b), MLA_ERR_BAD_STATE, "live");
  EXPECT(mla_req_fork(rt, b, 0, &nid), MLA_ERR_BAD_STATE, "live");
  EXPECT(mla_req_truncate(rt, b, 0), MLA_ERR_BAD_STATE, "live");
  EXPECT(mla_req_length(rt, b, &v), MLA_ERR_BAD_STATE, "live");
  v = 7;
  TU_STATUS(mla_req_is_live(rt, b, &v), MLA_OK);
  TU_CHECK(v == 0, "is_live of a freed id = %d", v);
  /* sizes */
  EXPECT(mla_req_extend(rt, a, -1, NULL), MLA_ERR_INVALID_ARGUMENT, "n =");
  EXPECT(mla_req_extend(rt, a, INT32_MIN, NULL), MLA_ERR_INVALID_ARGUMENT, "n =");
  EXPECT(mla_req_fork(rt, a, -1, &nid), MLA_ERR_INVALID_ARGUMENT, "prefix_len");
  EXPECT(mla_req_fork(rt, a, 21, &nid), MLA_ERR_OUT_OF_RANGE, "prefix_len");
  EXPECT(mla_req_truncate(rt, a, -1), MLA_ERR_INVALID_ARGUMENT, "new_len");
  EXPECT(mla_req_truncate(rt, a, 21), MLA_ERR_OUT_OF_RANGE, "new_len");
  EXPECT(mla_req_table_page_refs(rt, -1, &v), MLA_ERR_OUT_OF_RANGE, "page");
  EXPECT(mla_req_table_page_refs(rt, 8, &v), MLA_ERR_OUT_OF_RANGE, "page");
  TU_CHECK(snap_same(rt, &s), "a failed call changed the table");
  snap_free(&s);
  TU_STATUS(mla_req_table_page_refs(rt, 0, &v), MLA_OK);
  TU_CHECK(v == 1, "page 0 refs %d", v);
  TU_STATUS(mla_req_fork(rt, a, 20, &nid), MLA_OK); /* prefix = whole length is fine */
  TU_STATUS(mla_req_fork(rt, a, 0, &nid), MLA_OK);  /* and so is an empty prefix */
  TU_CHECK(length_of(rt, nid) == 0, "empty fork length");
#undef EXPECT
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
}

int main(void) {
  uint64_t seed = tu_seed("test_req_table", 777);
  g_rng.s = seed;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  if (mla_ctx_create(&cd, &g_ctx) != MLA_OK) {
    fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  test_lifecycle();
  const int ps[] = {1, 16, 64, 128};
  for (int i = 0; i < 4; i++) test_alignment(ps[i]);
  test_exhaustion();
  test_rollback();
  test_fork_cow(1);
  test_fork_cow(0);
  /* P, pages, max_reqs, max_context, ops */
  test_random_ops(1, 400, 12, 160, 4000);
  test_random_ops(16, 40, 12, 300, 4000);
  test_random_ops(64, 14, 10, 600, 3000);
  test_random_ops(128, 9, 8, 700, 3000);
  test_bad_args();
  mla_ctx_destroy(g_ctx);
  return tu_finish("test_req_table");
}
