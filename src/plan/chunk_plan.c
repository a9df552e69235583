/* Chunked-prefix plan: EXTEND with a prefix through MHA attends to the prefix
 * in chunks (so the expanded k/v of one chunk fits a fixed buffer) and merges
 * the chunks' partial states by LSE. Each chunk gives every request the same
 * window of chunk_len prefix positions. */
#include "plan.h"

/* Every array of a chunk plan for bs requests and nc chunks. */
typedef struct chunk_arrays {
  int32_t *starts;      /* [nc, bs] */
  int32_t *lens;        /* [nc, bs] */
  int32_t *cu_seq_lens; /* [nc, bs+1] */
  int32_t *max_lens;    /* [nc] */
  int32_t *slot_indptr; /* [nc+1] */
  int32_t *slots;       /* [total] */
} chunk_arrays;

static void chunk_layout(mla_ws *w, int64_t bs, int64_t nc, int64_t total, chunk_arrays *a) {
  a->starts = mla_ws_take(w, (size_t)(nc * bs) * sizeof(int32_t));
  a->lens = mla_ws_take(w, (size_t)(nc * bs) * sizeof(int32_t));
  a->cu_seq_lens = mla_ws_take(w, (size_t)(nc * (bs + 1)) * sizeof(int32_t));
  a->max_lens = mla_ws_take(w, (size_t)nc * sizeof(int32_t));
  a->slot_indptr = mla_ws_take(w, (size_t)(nc + 1) * sizeof(int32_t));
  a->slots = mla_ws_take(w, (size_t)total * sizeof(int32_t));
}

size_t mla_chunk_plan_bytes(int64_t bs, int64_t num_chunks, int64_t total_slots) {
  mla_ws w = mla_ws_counter();
  chunk_arrays a;
  chunk_layout(&w, bs, num_chunks, total_slots, &a);
  return mla_ws_total(&w);
}

/* A batch of 0 requests has no chunks; its chunk_len is the capacity. */
static int64_t chunk_len_for(int64_t capacity, int64_t bs) {
  int64_t cl = bs > 0 ? capacity / bs : capacity;
  return cl < 1 ? 1 : cl;
}

/* Keeps [nc, bs+1] tables and byte counts far from overflow. */
#define CHUNK_MAX_ENTRIES ((int64_t)1 << 56)

mla_status mla_chunk_plan_workspace_size(mla_ctx *ctx, int max_bs, int max_prefix_tokens,
                                         int chunk_capacity, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, bytes);
  MLA_REQUIRE(eb, max_bs >= 1, MLA_ERR_INVALID_ARGUMENT, "max_bs = %d, expected >= 1", max_bs);
  MLA_REQUIRE(eb, max_prefix_tokens >= 1, MLA_ERR_INVALID_ARGUMENT,
              "max_prefix_tokens = %d, expected >= 1", max_prefix_tokens);
  MLA_REQUIRE(eb, chunk_capacity >= 1, MLA_ERR_INVALID_ARGUMENT,
              "chunk_capacity = %d, expected >= 1", chunk_capacity);
  /* Worst case: max_bs requests (the shortest chunks), one of them holding
   * every prefix token (the most chunks). Array sizes grow with both bs and
   * the chunk count, so any batch within the limits fits. */
  int64_t nc = mla_cdiv(max_prefix_tokens, chunk_len_for(chunk_capacity, max_bs));
  MLA_REQUIRE(eb, nc * ((int64_t)max_bs + 1) <= CHUNK_MAX_ENTRIES, MLA_ERR_CAPACITY,
              "limits ask for %lld chunks x %d requests, too large", (long long)nc, max_bs);
  *bytes = mla_chunk_plan_bytes(max_bs, nc, max_prefix_tokens);
  return MLA_OK;
}

mla_status mla_chunk_plan_build(mla_ctx *ctx, const mla_req_table *rt, int batch_size,
                                const int32_t *req_ids, const int32_t *prefix_lens,
                                int chunk_capacity, void *workspace, size_t workspace_bytes,
                                mla_chunk_plan *plan) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, rt);
  MLA_REQUIRE_PTR(eb, plan);
  MLA_REQUIRE_PTR(eb, workspace);
  MLA_REQUIRE(eb, batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "batch_size = %d", batch_size);
  MLA_REQUIRE(eb, chunk_capacity >= 1, MLA_ERR_INVALID_ARGUMENT,
              "chunk_capacity = %d, expected >= 1", chunk_capacity);
  const int bs = batch_size;
  if (bs > 0) {
    MLA_REQUIRE_PTR(eb, req_ids);
    MLA_REQUIRE_PTR(eb, prefix_lens);
  }
  int64_t total = 0, max_pre = 0;
  for (int i = 0; i < bs; i++) {
    MLA_REQUIRE(eb, prefix_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "prefix_lens[%d] = %d", i,
                (int)prefix_lens[i]);
    mla_status st = mla_plan_check_req(eb, __func__, rt, "req_ids", i, req_ids[i], prefix_lens[i]);
    if (st != MLA_OK) return st;
    total += prefix_lens[i];
    if (prefix_lens[i] > max_pre) max_pre = prefix_lens[i];
  }
  MLA_REQUIRE(eb, total <= INT32_MAX, MLA_ERR_CAPACITY,
              "%lld prefix tokens in one batch, more than int32 offsets hold", (long long)total);
  const int64_t cl = chunk_len_for(chunk_capacity, bs);
  const int64_t nc = mla_cdiv(max_pre, cl);
  MLA_REQUIRE(eb, nc * ((int64_t)bs + 1) <= CHUNK_MAX_ENTRIES, MLA_ERR_CAPACITY,
              "%lld chunks x %d requests, too large", (long long)nc, bs);
  size_t need = mla_chunk_plan_bytes(bs, nc, total);
  MLA_REQUIRE(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
              "workspace_bytes = %zu, this batch needs %zu", workspace_bytes, need);

  /* Everything is valid: from here on only writes. */
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  chunk_arrays a;
  chunk_layout(&w, bs, nc, total, &a);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace layout overflow");

  a.slot_indptr[0] = 0;
  for (int64_t c = 0; c < nc; c++) {
    int32_t *starts = a.starts + c * bs;
    int32_t *lens = a.lens + c * bs;
    int32_t *cu = a.cu_seq_lens + c * (bs + 1);
    int32_t *slots = a.slots + a.slot_indptr[c];
    int32_t mx = 0;
    cu[0] = 0;
    for (int i = 0; i < bs; i++) {
      int64_t pre = prefix_lens[i];
      int64_t start = c * cl < pre ? c * cl : pre;
      int64_t len = pre - start < cl ? pre - start : cl;
      starts[i] = (int32_t)start;
      lens[i] = (int32_t)len;
      cu[i + 1] = cu[i] + (int32_t)len;
      if (len > mx) mx = (int32_t)len;
      const int32_t *row = rt->req_to_token + (size_t)req_ids[i] * rt->max_context;
      memcpy(slots + cu[i], row + start, (size_t)len * sizeof(int32_t));
    }
    a.max_lens[c] = mx;
    a.slot_indptr[c + 1] = a.slot_indptr[c] + cu[bs];
  }

  mla_chunk_plan p;
  p.batch_size = bs;
  p.num_chunks = (int32_t)nc;
  p.chunk_len = (int32_t)cl;
  p.starts = a.starts;
  p.lens = a.lens;
  p.cu_seq_lens = a.cu_seq_lens;
  p.max_lens = a.max_lens;
  p.slot_indptr = a.slot_indptr;
  p.slots = a.slots;
  *plan = p;
  return MLA_OK;
}
