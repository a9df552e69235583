/* Decode context parallel plan: the keys of every request are dealt round
 * robin over `world` ranks (position p on rank p mod world, at local slot
 * global_slot / world), so rank r attends over its own share and the ranks'
 * partial (o, lse) are merged afterwards. This derives rank r's share from
 * the global key metadata. */
#include "plan.h"

typedef struct dcp_arrays {
  int32_t *kv_lens;    /* [bs] */
  int32_t *kv_indptr;  /* [bs+1] */
  int32_t *kv_indices; /* [total] */
} dcp_arrays;

static void dcp_layout(mla_ws *w, int64_t bs, int64_t total, dcp_arrays *a) {
  a->kv_lens = mla_ws_take(w, (size_t)bs * sizeof(int32_t));
  a->kv_indptr = mla_ws_take(w, (size_t)(bs + 1) * sizeof(int32_t));
  a->kv_indices = mla_ws_take(w, (size_t)total * sizeof(int32_t));
}

size_t mla_dcp_plan_bytes(int64_t bs, int64_t total_indices) {
  mla_ws w = mla_ws_counter();
  dcp_arrays a;
  dcp_layout(&w, bs, total_indices, &a);
  return mla_ws_total(&w);
}

/* Positions p < k with p mod world == rank. */
static int32_t local_len(int32_t k, int rank, int world) {
  return k > rank ? (k - rank - 1) / world + 1 : 0;
}

mla_status mla_dcp_plan_workspace_size(mla_ctx *ctx, int max_bs, int max_kv_tokens, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, bytes);
  MLA_REQUIRE(eb, max_bs >= 1, MLA_ERR_INVALID_ARGUMENT, "max_bs = %d, expected >= 1", max_bs);
  MLA_REQUIRE(eb, max_kv_tokens >= 1, MLA_ERR_INVALID_ARGUMENT, "max_kv_tokens = %d, expected >= 1",
              max_kv_tokens);
  /* world = 1 keeps every key on rank 0: the largest share. */
  *bytes = mla_dcp_plan_bytes(max_bs, max_kv_tokens);
  return MLA_OK;
}

mla_status mla_dcp_plan_build(mla_ctx *ctx, int batch_size, const int32_t *kv_lens,
                              const int32_t *kv_indptr, const int32_t *kv_indices, int rank,
                              int world, void *workspace, size_t workspace_bytes,
                              mla_dcp_plan *plan) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, plan);
  MLA_REQUIRE_PTR(eb, workspace);
  MLA_REQUIRE(eb, batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "batch_size = %d", batch_size);
  MLA_REQUIRE(eb, world >= 1, MLA_ERR_INVALID_ARGUMENT, "world = %d, expected >= 1", world);
  MLA_REQUIRE(eb, rank >= 0 && rank < world, MLA_ERR_OUT_OF_RANGE,
              "rank = %d, expected 0..world-1 = %d", rank, world - 1);
  const int bs = batch_size;
  if (bs > 0) {
    MLA_REQUIRE_PTR(eb, kv_lens);
    MLA_REQUIRE_PTR(eb, kv_indptr);
    MLA_REQUIRE_PTR(eb, kv_indices);
    MLA_REQUIRE(eb, kv_indptr[0] >= 0, MLA_ERR_INVALID_ARGUMENT, "kv_indptr[0] = %d",
                (int)kv_indptr[0]);
  }
  int64_t total = 0;
  for (int i = 0; i < bs; i++) {
    MLA_REQUIRE(eb, kv_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "kv_lens[%d] = %d", i,
                (int)kv_lens[i]);
    MLA_REQUIRE(eb, (int64_t)kv_indptr[i + 1] - kv_indptr[i] == kv_lens[i],
                MLA_ERR_INVALID_ARGUMENT,
                "kv_indptr[%d] - kv_indptr[%d] = %lld, but kv_lens[%d] = %d", i + 1, i,
                (long long)kv_indptr[i + 1] - kv_indptr[i], i, (int)kv_lens[i]);
    /* Only the positions this rank keeps are read. */
    const int32_t *g = kv_indices + kv_indptr[i];
    for (int64_t p = rank; p < kv_lens[i]; p += world)
      MLA_REQUIRE(eb, g[p] >= 0, MLA_ERR_INVALID_ARGUMENT, "kv_indices[%lld] = %d",
                  (long long)kv_indptr[i] + p, (int)g[p]);
    total += local_len(kv_lens[i], rank, world);
  }
  size_t need = mla_dcp_plan_bytes(bs, total);
  MLA_REQUIRE(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
              "workspace_bytes = %zu, this batch needs %zu", workspace_bytes, need);

  /* Everything is valid: from here on only writes. */
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  dcp_arrays a;
  dcp_layout(&w, bs, total, &a);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace layout overflow");

  a.kv_indptr[0] = 0;
  for (int i = 0; i < bs; i++) {
    int32_t n = local_len(kv_lens[i], rank, world);
    const int32_t *g = kv_indices + kv_indptr[i];
    int32_t *out = a.kv_indices + a.kv_indptr[i];
    for (int32_t j = 0; j < n; j++) out[j] = g[rank + (int64_t)j * world] / world;
    a.kv_lens[i] = n;
    a.kv_indptr[i + 1] = a.kv_indptr[i] + n;
  }

  mla_dcp_plan p;
  p.batch_size = bs;
  p.rank = rank;
  p.world = world;
  p.kv_lens = a.kv_lens;
  p.kv_indptr = a.kv_indptr;
  p.kv_indices = a.kv_indices;
  *plan = p;
  return MLA_OK;
}

/* EXTEND under DCP: where each position's row lands once every rank has
 * packed its share into its block of the gathered cache (layout in
 * include/mla.h). Rank r's rows of request i start at the sum of its
 * earlier requests' shares, so one running offset per rank suffices. */
#define DCP_GATHER_MAX_WORLD 128

mla_status mla_dcp_gather_table(mla_ctx *ctx, int batch_size, const int32_t *kv_lens, int world, int base_slot,
                                int64_t table_stride, int32_t *table, int32_t *rows_per_rank) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, rows_per_rank);
  MLA_REQUIRE(eb, batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "batch_size = %d, expected >= 0", batch_size);
  MLA_REQUIRE(eb, world >= 1 && world <= DCP_GATHER_MAX_WORLD, MLA_ERR_INVALID_ARGUMENT,
              "world = %d, expected 1..%d", world, DCP_GATHER_MAX_WORLD);
  MLA_REQUIRE(eb, base_slot >= 1, MLA_ERR_INVALID_ARGUMENT,
              "base_slot = %d, expected >= 1 (slot 0 is the cache's dummy row)", base_slot);
  if (batch_size > 0) MLA_REQUIRE_PTR(eb, kv_lens);
  if (table) MLA_REQUIRE(eb, table_stride >= 1, MLA_ERR_INVALID_ARGUMENT, "table_stride = %lld, expected >= 1",
                         (long long)table_stride);
  int64_t m = 0; /* rank 0's share: it holds position 0 of every non-empty request */
  for (int i = 0; i < batch_size; i++) {
    MLA_REQUIRE(eb, kv_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "kv_lens[%d] = %d, expected >= 0", i,
                (int)kv_lens[i]);
    if (table)
      MLA_REQUIRE(eb, kv_lens[i] <= table_stride, MLA_ERR_OUT_OF_RANGE,
                  "kv_lens[%d] = %d does not fit a table row of table_stride = %lld", i, (int)kv_lens[i],
                  (long long)table_stride);
    m += local_len(kv_lens[i], 0, world);
  }
  MLA_REQUIRE(eb, (int64_t)base_slot + (int64_t)world * m <= INT32_MAX, MLA_ERR_OUT_OF_RANGE,
              "the gathered cache would need %lld slots (base_slot %d + world %d x %lld rows), past 2^31 - 1",
              (long long)((int64_t)base_slot + (int64_t)world * m), base_slot, world, (long long)m);
  *rows_per_rank = (int32_t)m;
  if (!table) return MLA_OK;
  int64_t off[DCP_GATHER_MAX_WORLD]; /* next row of each rank's block */
  for (int r = 0; r < world; r++) off[r] = (int64_t)base_slot + (int64_t)r * m;
  for (int i = 0; i < batch_size; i++) {
    int32_t *row = table + (size_t)i * (size_t)table_stride;
    const int32_t k = kv_lens[i];
    for (int32_t p = 0; p < k; p++) row[p] = (int32_t)(off[p % world] + p / world);
    for (int64_t p = k; p < table_stride; p++) row[p] = MLA_SLOT_UNUSED;
    for (int r = 0; r < world; r++) off[r] += local_len(k, r, world);
  }
  return MLA_OK;
}
