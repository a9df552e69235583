/* Request table (req_to_token) and reference-counted page allocator.
 *
 * Invariants kept by every call (the tests check them after each operation):
 *  - a live request of length len references pages req_pages[id][0 .. ceil(len/P));
 *    position p lives at slot req_pages[id][p/P] * P + p % P;
 *  - page_refs[k] (k >= 1) = number of (live request, page index) pairs
 *    naming page k; pages with 0 references are exactly those on the free
 *    stack; page 0 is reserved and reports 1;
 *  - req_to_token entries past a request's length, and whole rows of
 *    requests that are not live, hold MLA_SLOT_UNUSED.
 * Every call validates and counts what it needs before changing anything,
 * so a failure leaves the table bit-identical. */
#include <limits.h>
#include <stdlib.h>

#include "cache.h"

static mla_errbuf *errbuf_of(const mla_req_table *rt) { return &((mla_req_table *)rt)->err; }

static inline int32_t *row_tokens(const mla_req_table *rt, int32_t id) {
  return rt->req_to_token + (size_t)id * (size_t)rt->max_context;
}
static inline int32_t *row_pages(const mla_req_table *rt, int32_t id) {
  return rt->req_pages + (size_t)id * (size_t)rt->max_pages_per_req;
}
static inline int pages_for(const mla_req_table *rt, int64_t len) {
  return (int)mla_cdiv(len, rt->page_size);
}

/* Validate a request id: OUT_OF_RANGE outside [0, max_reqs), BAD_STATE when
 * the request is not live. */
static mla_status check_live(const mla_req_table *rt, const char *fn, const char *name,
                             int32_t id) {
  if (id < 0 || id >= rt->max_reqs)
    return mla_fail(errbuf_of(rt), MLA_ERR_OUT_OF_RANGE, fn, "%s = %d, expected 0..%d", name,
                    (int)id, rt->max_reqs - 1);
  if (!rt->live[id])
    return mla_fail(errbuf_of(rt), MLA_ERR_BAD_STATE, fn, "%s = %d is not a live request", name,
                    (int)id);
  return MLA_OK;
}

static int32_t lowest_free_id(const mla_req_table *rt) {
  for (int32_t i = 0; i < rt->max_reqs; i++)
    if (!rt->live[i]) return i;
  return -1;
}

static int32_t page_pop(mla_req_table *rt) {
  int32_t page = rt->free_list[--rt->num_free];
  rt->page_refs[page] = 1;
  return page;
}

/* Positions [lo, hi) of request id changed. */
static void mark_dirty(mla_req_table *rt, int32_t id, int32_t lo, int32_t hi) {
  if (lo >= hi) return;
  if (rt->dirty_lo[id] == INT32_MAX) {
    rt->dirty_ids[rt->num_dirty++] = id;
    rt->dirty_lo[id] = lo;
    rt->dirty_hi[id] = hi;
    return;
  }
  if (lo < rt->dirty_lo[id]) rt->dirty_lo[id] = lo;
  if (hi > rt->dirty_hi[id]) rt->dirty_hi[id] = hi;
}

void mla_req_table_take_dirty(mla_req_table *rt, int32_t *ids, int32_t *lo, int32_t *hi, int *n) {
  for (int k = 0; k < rt->num_dirty; k++) {
    const int32_t id = rt->dirty_ids[k];
    ids[k] = id;
    lo[k] = rt->dirty_lo[id];
    hi[k] = rt->dirty_hi[id];
    rt->dirty_lo[id] = INT32_MAX;
  }
  *n = rt->num_dirty;
  rt->num_dirty = 0;
}

static void page_release(mla_req_table *rt, int32_t page) {
  if (--rt->page_refs[page] == 0) rt->free_list[rt->num_free++] = page;
}

/* Drop the page references of positions [new_len, len) of a live request and
 * clear their req_to_token entries. */
static void shrink(mla_req_table *rt, int32_t id, int new_len) {
  int len = rt->req_len[id];
  int32_t *pages = row_pages(rt, id);
  int keep = pages_for(rt, new_len), have = pages_for(rt, len);
  for (int k = keep; k < have; k++) {
    page_release(rt, pages[k]);
    pages[k] = 0;
  }
  int32_t *tok = row_tokens(rt, id);
  for (int p = new_len; p < len; p++) tok[p] = MLA_SLOT_UNUSED;
  rt->req_len[id] = new_len;
}

/* ---- create / destroy / queries ------------------------------------------------ */

void mla_req_table_destroy(mla_req_table *rt) {
  if (!rt) return;
  free(rt->req_to_token);
  free(rt->req_pages);
  free(rt->req_len);
  free(rt->live);
  free(rt->page_refs);
  free(rt->free_list);
  free(rt->dirty_lo);
  free(rt->dirty_hi);
  free(rt->dirty_ids);
  free(rt);
}

/* n * m * elem bytes, or 0 on overflow of size_t. */
static size_t array_bytes(size_t n, size_t m, size_t elem) {
  if (m != 0 && n > SIZE_MAX / m) return 0;
  size_t nm = n * m;
  if (elem != 0 && nm > SIZE_MAX / elem) return 0;
  return nm * elem;
}

mla_status mla_req_table_create(mla_ctx *ctx, const mla_req_table_desc *desc, mla_kv_cache *cache,
                                mla_req_table **out) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT; /* no handle to record a message in */
  mla_errbuf *eb = &ctx->err;
  MLA_REQUIRE_PTR(eb, out);
  *out = NULL;
  MLA_REQUIRE_PTR(eb, desc);
  MLA_REQUIRE(eb, desc->max_reqs >= 1, MLA_ERR_INVALID_ARGUMENT,
              "desc->max_reqs = %d, expected >= 1", desc->max_reqs);
  MLA_REQUIRE(eb, desc->max_context >= 1, MLA_ERR_INVALID_ARGUMENT,
              "desc->max_context = %d, expected >= 1", desc->max_context);
  MLA_REQUIRE(eb, desc->num_pages >= 2, MLA_ERR_INVALID_ARGUMENT,
              "desc->num_pages = %d, expected >= 2 (page 0 is reserved)", desc->num_pages);
  MLA_REQUIRE(eb, mla_is_pow2(desc->page_size) && desc->page_size <= MLA_MAX_PAGE_SIZE,
              MLA_ERR_INVALID_ARGUMENT, "desc->page_size = %d, expected a power of two in 1..%d",
              desc->page_size, MLA_MAX_PAGE_SIZE);
  MLA_REQUIRE(eb, (int64_t)desc->num_pages * desc->page_size <= INT32_MAX,
              MLA_ERR_INVALID_ARGUMENT,
              "desc->num_pages * desc->page_size = %lld exceeds INT32_MAX slots",
              (long long)desc->num_pages * desc->page_size);
  if (cache) {
    MLA_REQUIRE(eb, desc->num_pages == cache->num_pages && desc->page_size == cache->page_size,
                MLA_ERR_INVALID_ARGUMENT,
                "desc has num_pages = %d, page_size = %d but the cache has %d, %d",
                desc->num_pages, desc->page_size, cache->num_pages, cache->page_size);
  }
  int max_pages_per_req = (int)mla_cdiv(desc->max_context, desc->page_size);
  size_t tok_bytes = array_bytes((size_t)desc->max_reqs, (size_t)desc->max_context, 4);
  size_t page_bytes = array_bytes((size_t)desc->max_reqs, (size_t)max_pages_per_req, 4);
  MLA_REQUIRE(eb, tok_bytes != 0 && page_bytes != 0, MLA_ERR_OUT_OF_MEMORY,
              "max_reqs = %d x max_context = %d overflows size_t", desc->max_reqs,
              desc->max_context);

  mla_req_table *rt = calloc(1, sizeof *rt);
  if (!rt) return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "cannot allocate the table handle");
  rt->ctx = ctx;
  rt->cache = cache;
  rt->max_reqs = desc->max_reqs;
  rt->max_context = desc->max_context;
  rt->num_pages = desc->num_pages;
  rt->page_size = desc->page_size;
  rt->max_pages_per_req = max_pages_per_req;
  /* calloc: every entry starts as MLA_SLOT_UNUSED (0), every page index 0. */
  rt->req_to_token = calloc(1, tok_bytes);
  rt->req_pages = calloc(1, page_bytes);
  rt->req_len = calloc((size_t)desc->max_reqs, sizeof *rt->req_len);
  rt->live = calloc((size_t)desc->max_reqs, 1);
  rt->page_refs = calloc((size_t)desc->num_pages, sizeof *rt->page_refs);
  rt->free_list = malloc((size_t)desc->num_pages * sizeof *rt->free_list);
  rt->dirty_lo = malloc((size_t)desc->max_reqs * sizeof *rt->dirty_lo);
  rt->dirty_hi = malloc((size_t)desc->max_reqs * sizeof *rt->dirty_hi);
  rt->dirty_ids = malloc((size_t)desc->max_reqs * sizeof *rt->dirty_ids);
  if (!rt->req_to_token || !rt->req_pages || !rt->req_len || !rt->live || !rt->page_refs ||
      !rt->free_list || !rt->dirty_lo || !rt->dirty_hi || !rt->dirty_ids) {
    mla_req_table_destroy(rt);
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__,
                    "cannot allocate the table (%zu bytes of req_to_token)", tok_bytes);
  }
  /* Stack with page 1 on top: a fresh table hands out pages 1, 2, 3, ... */
  rt->num_free = 0;
  for (int32_t p = desc->num_pages - 1; p >= 1; p--) rt->free_list[rt->num_free++] = p;
  rt->page_refs[0] = 1; /* reserved dummy page, never on the free stack */
  for (int i = 0; i < desc->max_reqs; i++) rt->dirty_lo[i] = INT32_MAX;
  rt->num_dirty = 0;
  *out = rt;
  return MLA_OK;
}

const char *mla_req_table_last_error(const mla_req_table *rt) {
  return rt ? rt->err.msg : "mla_req_table_last_error: rt is NULL";
}

mla_status mla_req_table_get_desc(const mla_req_table *rt, mla_req_table_desc *desc) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), desc);
  desc->max_reqs = rt->max_reqs;
  desc->max_context = rt->max_context;
  desc->num_pages = rt->num_pages;
  desc->page_size = rt->page_size;
  return MLA_OK;
}

mla_status mla_req_length(const mla_req_table *rt, int32_t req_id, int *len) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), len);
  mla_status st = check_live(rt, __func__, "req_id", req_id);
  if (st != MLA_OK) return st;
  *len = rt->req_len[req_id];
  return MLA_OK;
}

mla_status mla_req_is_live(const mla_req_table *rt, int32_t req_id, int *live) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), live);
  MLA_REQUIRE(errbuf_of(rt), req_id >= 0 && req_id < rt->max_reqs, MLA_ERR_OUT_OF_RANGE,
              "req_id = %d, expected 0..%d", (int)req_id, rt->max_reqs - 1);
  *live = rt->live[req_id] ? 1 : 0;
  return MLA_OK;
}

mla_status mla_req_table_data(const mla_req_table *rt, const int32_t **req_to_token) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), req_to_token);
  *req_to_token = rt->req_to_token;
  return MLA_OK;
}

mla_status mla_req_table_free_pages(const mla_req_table *rt, int *free_pages) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), free_pages);
  *free_pages = rt->num_free;
  return MLA_OK;
}

mla_status mla_req_table_page_refs(const mla_req_table *rt, int page, int *refs) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(rt), refs);
  MLA_REQUIRE(errbuf_of(rt), page >= 0 && page < rt->num_pages, MLA_ERR_OUT_OF_RANGE,
              "page = %d, expected 0..%d", page, rt->num_pages - 1);
  *refs = rt->page_refs[page]; /* page 0 holds 1 permanently */
  return MLA_OK;
}

/* ---- request operations --------------------------------------------------------- */

mla_status mla_req_add(mla_req_table *rt, int32_t *req_id) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&rt->err, req_id);
  int32_t id = lowest_free_id(rt);
  MLA_REQUIRE(&rt->err, id >= 0, MLA_ERR_CAPACITY, "all %d request ids are live", rt->max_reqs);
  /* The row is already all MLA_SLOT_UNUSED (invariant of non-live rows). */
  rt->live[id] = 1;
  rt->req_len[id] = 0;
  *req_id = id;
  return MLA_OK;
}

mla_status mla_req_extend(mla_req_table *rt, int32_t req_id, int n,
                          int32_t *slots_out /* [n] or NULL */) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &rt->err;
  mla_status st = check_live(rt, __func__, "req_id", req_id);
  if (st != MLA_OK) return st;
  MLA_REQUIRE(eb, n >= 0, MLA_ERR_INVALID_ARGUMENT, "n = %d, expected >= 0", n);
  int len = rt->req_len[req_id];
  MLA_REQUIRE(eb, (int64_t)len + n <= rt->max_context, MLA_ERR_CAPACITY,
              "request %d: length %d + n = %d exceeds max_context = %d", (int)req_id, len, n,
              rt->max_context);
  if (n == 0) return MLA_OK;

  const int P = rt->page_size;
  int32_t *pages = row_pages(rt, req_id);
  int32_t *tok = row_tokens(rt, req_id);
  int have = pages_for(rt, len), want = pages_for(rt, (int64_t)len + n);
  /* Writing into a partially filled last page that others share needs a
   * private copy first (copy-on-write). A full last page is never written. */
  int cow = (len % P != 0) && rt->page_refs[pages[have - 1]] > 1;
  int need = (want - have) + cow;
  MLA_REQUIRE(eb, need <= rt->num_free, MLA_ERR_CACHE_FULL,
              "request %d: extending by %d needs %d free pages, %d left", (int)req_id, n, need,
              rt->num_free);

  if (cow) {
    int32_t old = pages[have - 1], fresh = page_pop(rt);
    int page_start = (have - 1) * P, used = len - page_start; /* rows [0, used) in use */
    if (rt->cache) {
      mla_status st = mla_cache_copy_slot_range(rt->cache, (int64_t)fresh * P, (int64_t)old * P, used);
      if (st != MLA_OK) { /* a device copy failed: hand the page back, change nothing */
        page_release(rt, fresh);
        return mla_fail(eb, st, __func__, "copy-on-write of page %d: %s", (int)old, rt->cache->err.msg);
      }
    }
    page_release(rt, old); /* stays > 0: it was shared */
    pages[have - 1] = fresh;
    for (int p = page_start; p < len; p++) tok[p] = fresh * P + (p - page_start);
    mark_dirty(rt, req_id, page_start, len);
  }
  for (int k = have; k < want; k++) pages[k] = page_pop(rt);
  for (int i = 0; i < n; i++) {
    int p = len + i;
    int32_t slot = pages[p / P] * P + p % P;
    tok[p] = slot;
    if (slots_out) slots_out[i] = slot;
  }
  rt->req_len[req_id] = len + n;
  mark_dirty(rt, req_id, len, len + n);
  return MLA_OK;
}

mla_status mla_req_free(mla_req_table *rt, int32_t req_id) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  mla_status st = check_live(rt, __func__, "req_id", req_id);
  if (st != MLA_OK) return st;
  shrink(rt, req_id, 0);
  rt->live[req_id] = 0;
  return MLA_OK;
}

mla_status mla_req_fork(mla_req_table *rt, int32_t src_id, int prefix_len, int32_t *new_id) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &rt->err;
  mla_status st = check_live(rt, __func__, "src_id", src_id);
  if (st != MLA_OK) return st;
  MLA_REQUIRE_PTR(eb, new_id);
  MLA_REQUIRE(eb, prefix_len >= 0, MLA_ERR_INVALID_ARGUMENT, "prefix_len = %d, expected >= 0",
              prefix_len);
  MLA_REQUIRE(eb, prefix_len <= rt->req_len[src_id], MLA_ERR_OUT_OF_RANGE,
              "prefix_len = %d exceeds the length %d of request %d", prefix_len,
              rt->req_len[src_id], (int)src_id);
  int32_t id = lowest_free_id(rt);
  MLA_REQUIRE(eb, id >= 0, MLA_ERR_CAPACITY, "all %d request ids are live", rt->max_reqs);

  int np = pages_for(rt, prefix_len);
  const int32_t *src_pages = row_pages(rt, src_id);
  int32_t *dst_pages = row_pages(rt, id);
  for (int k = 0; k < np; k++) {
    dst_pages[k] = src_pages[k];
    rt->page_refs[src_pages[k]]++;
  }
  memcpy(row_tokens(rt, id), row_tokens(rt, src_id), (size_t)prefix_len * sizeof(int32_t));
  rt->live[id] = 1;
  rt->req_len[id] = prefix_len;
  mark_dirty(rt, id, 0, prefix_len);
  *new_id = id;
  return MLA_OK;
}

mla_status mla_req_truncate(mla_req_table *rt, int32_t req_id, int new_len) {
  if (!rt) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &rt->err;
  mla_status st = check_live(rt, __func__, "req_id", req_id);
  if (st != MLA_OK) return st;
  MLA_REQUIRE(eb, new_len >= 0, MLA_ERR_INVALID_ARGUMENT, "new_len = %d, expected >= 0",
              new_len);
  MLA_REQUIRE(eb, new_len <= rt->req_len[req_id], MLA_ERR_OUT_OF_RANGE,
              "new_len = %d exceeds the length %d of request %d", new_len, rt->req_len[req_id],
              (int)req_id);
  shrink(rt, req_id, new_len);
  return MLA_OK;
}
