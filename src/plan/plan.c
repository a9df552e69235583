/* mla_plan_build: turns a batch description into the metadata the attention
 * kernels read (query/key offsets, slot and page indices, block table, and
 * the split-KV schedule), all carved from a caller-owned workspace.
 *
 * The workspace layout depends only on the limits, so the plan's arrays sit
 * at the same offsets for every batch (what a CUDA-graph replay that copies
 * the host plan into fixed device buffers needs). */
#include "plan.h"
#include "step_build.h" /* mla_sb_nocut_div */

/* Largest array (in int32 entries) a limit set may ask for; keeps every byte
 * count far from size_t overflow. */
#define PLAN_MAX_ENTRIES ((int64_t)1 << 56)
/* Below this many keys the gather is not worth waking the worker threads. */
#define PLAN_PARALLEL_MIN_TOKENS (1 << 16)

mla_status mla_plan_check_req(mla_errbuf *eb, const char *fn, const mla_req_table *rt,
                              const char *name, int idx, int32_t req_id, int64_t need_len) {
  if (req_id < 0 || req_id >= rt->max_reqs)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn, "%s[%d] = %d, request ids are 0..%d", name, idx,
                    (int)req_id, rt->max_reqs - 1);
  if (!rt->live[req_id])
    return mla_fail(eb, MLA_ERR_BAD_STATE, fn, "%s[%d] = %d is not a live request", name, idx,
                    (int)req_id);
  if (need_len > rt->req_len[req_id])
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                    "%s[%d] = %d: needs %lld positions, the request holds %d", name, idx,
                    (int)req_id, (long long)need_len, (int)rt->req_len[req_id]);
  return MLA_OK;
}

/* Every array of a plan, at capacity. */
typedef struct plan_arrays {
  int32_t *req_ids;      /* [max_bs] */
  int32_t *qo_indptr;    /* [max_bs+1] */
  int32_t *kv_indptr;    /* [max_bs+1] */
  int32_t *kv_lens;      /* [max_bs] */
  int32_t *kv_indices;   /* [max_kv_tokens] */
  int32_t *page_indptr;  /* [max_bs+1] */
  int32_t *page_indices; /* [max_pages] */
  int32_t *block_table;  /* [max_bs, max_width] (used as [bs, width]) */
  int32_t *sched_meta;   /* [num_sm, MLA_SCHED_META_INTS] */
  int32_t *num_splits;   /* [max_bs+1] */
} plan_arrays;

static int64_t max_pages_for(const mla_plan_limits *lim) {
  /* sum ceil(k_i/P) <= sum k_i / P + bs, and never more than one page per key. */
  int64_t a = (int64_t)lim->max_kv_tokens / lim->page_size + lim->max_bs;
  return a < lim->max_kv_tokens ? a : lim->max_kv_tokens;
}

static int64_t max_width_for(const mla_plan_limits *lim) {
  int64_t longest = lim->max_context < lim->max_kv_tokens ? lim->max_context : lim->max_kv_tokens;
  return mla_cdiv(longest, lim->page_size);
}

static int32_t *take_i32(mla_ws *w, int64_t n) {
  return (int32_t *)mla_ws_take(w, (size_t)n * sizeof(int32_t));
}

/* Carve (or, on a counting mla_ws, measure) every array. */
static void plan_layout(mla_ws *w, const mla_plan_limits *lim, plan_arrays *a) {
  int64_t bs = lim->max_bs;
  a->req_ids = take_i32(w, bs);
  a->qo_indptr = take_i32(w, bs + 1);
  a->kv_indptr = take_i32(w, bs + 1);
  a->kv_lens = take_i32(w, bs);
  a->page_indptr = take_i32(w, bs + 1);
  a->num_splits = take_i32(w, bs + 1);
  a->sched_meta = take_i32(w, (int64_t)lim->num_sm * MLA_SCHED_META_INTS);
  a->page_indices = take_i32(w, max_pages_for(lim));
  a->block_table = take_i32(w, bs * max_width_for(lim));
  a->kv_indices = (lim->flags & MLA_PLAN_PAGES_ONLY) ? NULL : take_i32(w, lim->max_kv_tokens);
}

static mla_status check_limits(mla_errbuf *eb, const char *fn, const mla_plan_limits *lim) {
  MLA_PLAN_REQUIRE(eb, fn, lim->max_bs >= 1, MLA_ERR_INVALID_ARGUMENT,
                   "lim->max_bs = %d, expected >= 1", lim->max_bs);
  MLA_PLAN_REQUIRE(eb, fn, lim->max_q_tokens >= 1, MLA_ERR_INVALID_ARGUMENT,
                   "lim->max_q_tokens = %d, expected >= 1", lim->max_q_tokens);
  MLA_PLAN_REQUIRE(eb, fn, lim->max_kv_tokens >= 1, MLA_ERR_INVALID_ARGUMENT,
                   "lim->max_kv_tokens = %d, expected >= 1", lim->max_kv_tokens);
  MLA_PLAN_REQUIRE(eb, fn, lim->max_context >= 1, MLA_ERR_INVALID_ARGUMENT,
                   "lim->max_context = %d, expected >= 1", lim->max_context);
  MLA_PLAN_REQUIRE(eb, fn, mla_is_pow2(lim->page_size) && lim->page_size <= MLA_MAX_PAGE_SIZE,
                   MLA_ERR_INVALID_ARGUMENT, "lim->page_size = %d, expected a power of two 1..%d",
                   lim->page_size, MLA_MAX_PAGE_SIZE);
  MLA_PLAN_REQUIRE(eb, fn, lim->num_sm >= 1, MLA_ERR_INVALID_ARGUMENT,
                   "lim->num_sm = %d, expected >= 1", lim->num_sm);
  MLA_PLAN_REQUIRE(eb, fn, (lim->flags & ~MLA_PLAN_PAGES_ONLY) == 0, MLA_ERR_INVALID_ARGUMENT,
                   "lim->flags = 0x%x has unknown bits", lim->flags);
  int64_t bt = (int64_t)lim->max_bs * max_width_for(lim);
  MLA_PLAN_REQUIRE(
      eb, fn,
      bt <= PLAN_MAX_ENTRIES && (int64_t)lim->num_sm * MLA_SCHED_META_INTS <= PLAN_MAX_ENTRIES,
      MLA_ERR_CAPACITY, "limits ask for a %lld-entry block table, too large", (long long)bt);
  return MLA_OK;
}

static size_t plan_bytes(const mla_plan_limits *lim) {
  mla_ws w = mla_ws_counter();
  plan_arrays a;
  plan_layout(&w, lim, &a);
  return mla_ws_total(&w);
}

mla_status mla_plan_workspace_size(mla_ctx *ctx, const mla_plan_limits *lim, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, lim);
  MLA_REQUIRE_PTR(eb, bytes);
  mla_status st = check_limits(eb, __func__, lim);
  if (st != MLA_OK) return st;
  *bytes = plan_bytes(lim);
  return MLA_OK;
}

/* Queries and keys of batch entry i (lengths already checked >= 0 where the
 * caller needs it). */
static void req_q_k(const mla_batch *b, int i, int64_t *q, int64_t *k) {
  int64_t s = b->seq_lens[i];
  switch (b->mode) {
    case MLA_MODE_DECODE:
      *q = 1;
      *k = s;
      break;
    case MLA_MODE_TARGET_VERIFY:
      *q = b->num_draft_tokens;
      *k = s + b->num_draft_tokens;
      break;
    case MLA_MODE_DRAFT_EXTEND:
      *q = b->extend_lens ? b->extend_lens[i] : b->num_draft_tokens;
      *k = s;
      break;
    default: /* EXTEND */
      *q = s - (b->prefix_lens ? b->prefix_lens[i] : 0);
      *k = s;
      break;
  }
}

/* Pass 1: every per-request check; nothing is written. */
static mla_status check_batch(mla_errbuf *eb, const mla_req_table *rt, const mla_batch *b,
                              const mla_plan_limits *lim) {
  const char *fn = "mla_plan_build";
  int64_t sum_q = 0, sum_k = 0;
  for (int i = 0; i < b->batch_size; i++) {
    MLA_PLAN_REQUIRE(eb, fn, b->seq_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "seq_lens[%d] = %d", i,
                     (int)b->seq_lens[i]);
    if (b->mode == MLA_MODE_DRAFT_EXTEND && b->extend_lens)
      MLA_PLAN_REQUIRE(eb, fn, b->extend_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT,
                       "extend_lens[%d] = %d", i, (int)b->extend_lens[i]);
    if (b->mode == MLA_MODE_EXTEND) {
      int32_t pre = b->prefix_lens ? b->prefix_lens[i] : 0;
      MLA_PLAN_REQUIRE(eb, fn, pre >= 0 && pre <= b->seq_lens[i], MLA_ERR_INVALID_ARGUMENT,
                       "prefix_lens[%d] = %d, expected 0..seq_lens[%d] = %d", i, (int)pre, i,
                       (int)b->seq_lens[i]);
      if (b->extend_lens)
        MLA_PLAN_REQUIRE(eb, fn, b->extend_lens[i] == b->seq_lens[i] - pre,
                         MLA_ERR_INVALID_ARGUMENT,
                         "extend_lens[%d] = %d, but seq_lens - prefix_lens = %d", i,
                         (int)b->extend_lens[i], (int)(b->seq_lens[i] - pre));
    }
    int64_t q, k;
    req_q_k(b, i, &q, &k);
    MLA_PLAN_REQUIRE(eb, fn, k <= lim->max_context, MLA_ERR_CAPACITY,
                     "request %d has %lld keys, lim->max_context = %d", i, (long long)k,
                     lim->max_context);
    sum_q += q;
    sum_k += k;
    if (b->req_ids[i] == MLA_REQ_PAD) continue; /* padding row: reads the dummy slot only */
    mla_status st = mla_plan_check_req(eb, fn, rt, "req_ids", i, b->req_ids[i], k);
    if (st != MLA_OK) return st;
  }
  MLA_PLAN_REQUIRE(eb, fn, sum_q <= lim->max_q_tokens, MLA_ERR_CAPACITY,
                   "batch has %lld query tokens, lim->max_q_tokens = %d", (long long)sum_q,
                   lim->max_q_tokens);
  MLA_PLAN_REQUIRE(eb, fn, sum_k <= lim->max_kv_tokens, MLA_ERR_CAPACITY,
                   "batch has %lld keys, lim->max_kv_tokens = %d", (long long)sum_k,
                   lim->max_kv_tokens);
  return MLA_OK;
}

typedef struct gather_job {
  const mla_req_table *rt;
  const plan_arrays *a;
  int shift; /* log2(page_size) */
  int width; /* block_table_width */
} gather_job;

/* Keys, pages and block-table row of requests [begin, end). Requests write
 * disjoint ranges, so workers never share an output element. */
static void gather_range(void *arg, int64_t begin, int64_t end, int worker) {
  (void)worker;
  const gather_job *J = arg;
  const plan_arrays *a = J->a;
  const int shift = J->shift;
  for (int64_t i = begin; i < end; i++) {
    int32_t k = a->kv_lens[i];
    if (a->req_ids[i] == MLA_REQ_PAD) {
      /* Padding row: every key is the reserved dummy slot 0 (page 0). */
      int32_t np = (int32_t)(((int64_t)k + (1 << shift) - 1) >> shift);
      int32_t *bt = a->block_table + (size_t)i * J->width;
      if (a->kv_indices) memset(a->kv_indices + a->kv_indptr[i], 0, (size_t)k * sizeof(int32_t));
      memset(a->page_indices + a->page_indptr[i], 0, (size_t)np * sizeof(int32_t));
      memset(bt, 0, (size_t)np * sizeof(int32_t));
      for (int32_t j = np; j < J->width; j++) bt[j] = MLA_BLOCK_TABLE_PAD;
      continue;
    }
    const int32_t *row = J->rt->req_to_token + (size_t)a->req_ids[i] * J->rt->max_context;
    if (a->kv_indices) memcpy(a->kv_indices + a->kv_indptr[i], row, (size_t)k * sizeof(int32_t));
    /* Page j holds positions [j*P, (j+1)*P), i.e. slot(j*P) / P; the table
     * keeps that list contiguously per request (req_pages), which is far
     * cheaper to read than every P-th entry of a req_to_token row. */
    int32_t np = (int32_t)(((int64_t)k + (1 << shift) - 1) >> shift);
    const int32_t *src = J->rt->req_pages + (size_t)a->req_ids[i] * J->rt->max_pages_per_req;
    int32_t *pages = a->page_indices + a->page_indptr[i];
    int32_t *bt = a->block_table + (size_t)i * J->width;
    memcpy(pages, src, (size_t)np * sizeof(int32_t));
    memcpy(bt, src, (size_t)np * sizeof(int32_t));
    for (int32_t j = np; j < J->width; j++) bt[j] = MLA_BLOCK_TABLE_PAD;
  }
}

static int log2_pow2(int x) {
  int s = 0;
  while ((1 << s) < x) s++;
  return s;
}

mla_status mla_plan_build(mla_ctx *ctx, const mla_req_table *rt, const mla_batch *batch,
                          const mla_plan_limits *lim, int num_heads, void *workspace,
                          size_t workspace_bytes, mla_plan *plan) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, batch);
  MLA_REQUIRE_PTR(eb, lim);
  MLA_REQUIRE_PTR(eb, plan);
  MLA_REQUIRE_PTR(eb, workspace);
  mla_status st = check_limits(eb, __func__, lim);
  if (st != MLA_OK) return st;
  MLA_REQUIRE(eb, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  const mla_mode mode = batch->mode;
  MLA_REQUIRE(eb, (int)mode >= (int)MLA_MODE_IDLE && (int)mode <= (int)MLA_MODE_EXTEND,
              MLA_ERR_INVALID_ARGUMENT, "batch->mode = %d is not an mla_mode", (int)mode);
  const int bs_in = batch->batch_size;
  MLA_REQUIRE(eb, bs_in >= 0, MLA_ERR_INVALID_ARGUMENT, "batch->batch_size = %d", bs_in);
  size_t need = plan_bytes(lim);
  MLA_REQUIRE(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
              "workspace_bytes = %zu, the limits need %zu", workspace_bytes, need);

  if (mode != MLA_MODE_IDLE) {
    MLA_REQUIRE_PTR(eb, rt);
    MLA_REQUIRE(eb, bs_in <= lim->max_bs, MLA_ERR_CAPACITY,
                "batch->batch_size = %d, lim->max_bs = %d", bs_in, lim->max_bs);
    MLA_REQUIRE(eb, lim->page_size == rt->page_size, MLA_ERR_INVALID_ARGUMENT,
                "lim->page_size = %d, the request table's page size is %d", lim->page_size,
                rt->page_size);
    if (bs_in > 0) {
      MLA_REQUIRE(eb, batch->req_ids != NULL, MLA_ERR_INVALID_ARGUMENT, "batch->req_ids is NULL");
      MLA_REQUIRE(eb, batch->seq_lens != NULL, MLA_ERR_INVALID_ARGUMENT, "batch->seq_lens is NULL");
    }
    if (mode == MLA_MODE_TARGET_VERIFY)
      MLA_REQUIRE(eb, batch->num_draft_tokens >= 1, MLA_ERR_INVALID_ARGUMENT,
                  "batch->num_draft_tokens = %d, TARGET_VERIFY needs >= 1",
                  (int)batch->num_draft_tokens);
    if (mode == MLA_MODE_DRAFT_EXTEND && !batch->extend_lens)
      MLA_REQUIRE(eb, batch->num_draft_tokens >= 1, MLA_ERR_INVALID_ARGUMENT,
                  "batch->num_draft_tokens = %d, a fixed DRAFT_EXTEND window needs >= 1 "
                  "(or pass extend_lens)",
                  (int)batch->num_draft_tokens);
    st = check_batch(eb, rt, batch, lim);
    if (st != MLA_OK) return st;
  }

  /* Everything is valid: from here on only writes. */
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  plan_arrays a;
  plan_layout(&w, lim, &a);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace layout overflow");

  mla_plan p;
  memset(&p, 0, sizeof p);
  p.mode = mode;
  p.page_size = lim->page_size;
  p.num_heads = num_heads;
  p.req_ids = a.req_ids;
  p.qo_indptr = a.qo_indptr;
  p.kv_indptr = a.kv_indptr;
  p.kv_lens = a.kv_lens;
  p.kv_indices = a.kv_indices;
  p.page_indptr = a.page_indptr;
  p.page_indices = a.page_indices;
  p.block_table = a.block_table;
  p.sched_meta = a.sched_meta;
  p.num_splits = a.num_splits;
  a.qo_indptr[0] = a.kv_indptr[0] = a.page_indptr[0] = a.num_splits[0] = 0;

  if (mode == MLA_MODE_IDLE) { /* empty plan: every count 0, indptrs {0} */
    *plan = p;
    return MLA_OK;
  }

  const int bs = bs_in;
  const int P = lim->page_size;
  const int shift = log2_pow2(P);
  int32_t max_q = 0, max_k = 0;
  for (int i = 0; i < bs; i++) {
    int64_t q, k;
    req_q_k(batch, i, &q, &k);
    a.req_ids[i] = batch->req_ids[i];
    a.kv_lens[i] = (int32_t)k;
    a.qo_indptr[i + 1] = a.qo_indptr[i] + (int32_t)q;
    a.kv_indptr[i + 1] = a.kv_indptr[i] + (int32_t)k;
    a.page_indptr[i + 1] = a.page_indptr[i] + (int32_t)((k + P - 1) >> shift);
    if (q > max_q) max_q = (int32_t)q;
    if (k > max_k) max_k = (int32_t)k;
  }
  const int width = (int)((max_k + P - 1) >> shift);

  gather_job job = {rt, &a, shift, width};
  int64_t total_k = a.kv_indptr[bs];
  /* Token copies make the work O(keys); pages only, O(pages). */
  const int64_t work = a.kv_indices ? total_k : (int64_t)a.page_indptr[bs];
  if (work >= PLAN_PARALLEL_MIN_TOKENS && bs > 1) {
    mla_parallel_for(ctx, bs, 1, gather_range, &job);
  } else {
    gather_range(&job, 0, bs, 0);
  }

  /* Split schedule sized for the widest query tile of the batch. */
  p.num_sm_parts = mla_sched_num_parts(lim->num_sm, max_q, num_heads);
  if (mla_split_schedule(a.kv_lens, bs, p.num_sm_parts, mla_sb_nocut_div(mode), a.sched_meta, a.num_splits) != 0)
    return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "split schedule did not cover the batch");

  p.batch_size = bs;
  p.num_q_tokens = a.qo_indptr[bs];
  p.num_kv_tokens = a.kv_indptr[bs];
  p.max_q_len = max_q;
  p.max_kv_len = max_k;
  p.causal = mode != MLA_MODE_DECODE;
  p.block_table_width = width;
  p.total_splits = a.num_splits[bs];
  *plan = p;
  return MLA_OK;
}
