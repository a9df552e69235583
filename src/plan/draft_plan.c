/* Multi-step draft decode plan (EAGLE/MTP, topk = 1): the draft model runs
 * num_steps decode steps back to back, step i seeing seq_len + i + 1 keys.
 * All steps' key metadata is built in one call, before the first step, so a
 * captured graph of the whole draft loop needs no host work in between. */
#include "plan.h"

typedef struct draft_arrays {
  int32_t *kv_indptr;   /* [ns, bs+1] */
  int32_t *step_offset; /* [ns+1] */
  int32_t *kv_indices;  /* [total] */
} draft_arrays;

static void draft_layout(mla_ws *w, int64_t bs, int64_t ns, int64_t total, draft_arrays *a) {
  a->kv_indptr = mla_ws_take(w, (size_t)(ns * (bs + 1)) * sizeof(int32_t));
  a->step_offset = mla_ws_take(w, (size_t)(ns + 1) * sizeof(int32_t));
  a->kv_indices = mla_ws_take(w, (size_t)total * sizeof(int32_t));
}

size_t mla_draft_plan_bytes(int64_t bs, int64_t num_steps, int64_t total_indices) {
  mla_ws w = mla_ws_counter();
  draft_arrays a;
  draft_layout(&w, bs, num_steps, total_indices, &a);
  return mla_ws_total(&w);
}

#define DRAFT_MAX_ENTRIES ((int64_t)1 << 56)

mla_status mla_draft_plan_workspace_size(mla_ctx *ctx, int max_bs, int num_steps, int max_context,
                                         size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, bytes);
  MLA_REQUIRE(eb, max_bs >= 1, MLA_ERR_INVALID_ARGUMENT, "max_bs = %d, expected >= 1", max_bs);
  MLA_REQUIRE(eb, num_steps >= 1, MLA_ERR_INVALID_ARGUMENT, "num_steps = %d, expected >= 1",
              num_steps);
  MLA_REQUIRE(eb, max_context >= 1, MLA_ERR_INVALID_ARGUMENT, "max_context = %d, expected >= 1",
              max_context);
  /* Worst request: its last step sees max_context keys, so step s sees
   * max_context - (ns - 1 - s); summed: ns * mc - ns (ns - 1) / 2. With
   * ns > mc no request fits at all. */
  int64_t ns = num_steps, mc = max_context;
  int64_t per_req = ns <= mc ? ns * mc - ns * (ns - 1) / 2 : 0; /* < 2^62 */
  /* per_req * max_bs can pass 2^63: compare before multiplying. */
  MLA_REQUIRE(eb,
              per_req <= DRAFT_MAX_ENTRIES / max_bs &&
                  ns * ((int64_t)max_bs + 1) <= DRAFT_MAX_ENTRIES,
              MLA_ERR_CAPACITY, "limits ask for %lld key indices x %d requests, too large",
              (long long)per_req, max_bs);
  int64_t total = per_req * max_bs;
  *bytes = mla_draft_plan_bytes(max_bs, ns, total);
  return MLA_OK;
}

mla_status mla_draft_plan_build(mla_ctx *ctx, const mla_req_table *rt, int batch_size,
                                const int32_t *req_ids, const int32_t *seq_lens, int num_steps,
                                void *workspace, size_t workspace_bytes, mla_draft_plan *plan) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, rt);
  MLA_REQUIRE_PTR(eb, plan);
  MLA_REQUIRE_PTR(eb, workspace);
  MLA_REQUIRE(eb, batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "batch_size = %d", batch_size);
  MLA_REQUIRE(eb, num_steps >= 1, MLA_ERR_INVALID_ARGUMENT, "num_steps = %d, expected >= 1",
              num_steps);
  const int bs = batch_size;
  const int64_t ns = num_steps;
  if (bs > 0) {
    MLA_REQUIRE_PTR(eb, req_ids);
    MLA_REQUIRE_PTR(eb, seq_lens);
  }
  int64_t total = 0;
  for (int i = 0; i < bs; i++) {
    MLA_REQUIRE(eb, seq_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "seq_lens[%d] = %d", i,
                (int)seq_lens[i]);
    /* The last step reads positions up to seq_len + num_steps - 1. */
    if (req_ids[i] != MLA_REQ_PAD) { /* padding rows read the dummy slot only */
      mla_status st =
          mla_plan_check_req(eb, __func__, rt, "req_ids", i, req_ids[i], seq_lens[i] + ns);
      if (st != MLA_OK) return st;
    }
    /* One row adds < 2^63; saturating keeps the sum of many from overflowing. */
    total += ns * seq_lens[i] + ns * (ns + 1) / 2;
    if (total > INT32_MAX) total = (int64_t)INT32_MAX + 1;
  }
  MLA_REQUIRE(eb, total <= INT32_MAX, MLA_ERR_CAPACITY,
              "%lld key indices over all steps, more than int32 offsets hold", (long long)total);
  size_t need = mla_draft_plan_bytes(bs, ns, total);
  MLA_REQUIRE(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
              "workspace_bytes = %zu, this batch needs %zu", workspace_bytes, need);

  /* Everything is valid: from here on only writes. */
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  draft_arrays a;
  draft_layout(&w, bs, ns, total, &a);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace layout overflow");

  a.step_offset[0] = 0;
  for (int64_t s = 0; s < ns; s++) {
    int32_t *indptr = a.kv_indptr + s * (bs + 1);
    int32_t *idx = a.kv_indices + a.step_offset[s];
    indptr[0] = 0;
    for (int i = 0; i < bs; i++) {
      int32_t kv = seq_lens[i] + (int32_t)s + 1;
      if (req_ids[i] == MLA_REQ_PAD) {
        memset(idx + indptr[i], 0, (size_t)kv * sizeof(int32_t));
      } else {
        const int32_t *row = rt->req_to_token + (size_t)req_ids[i] * rt->max_context;
        memcpy(idx + indptr[i], row, (size_t)kv * sizeof(int32_t));
      }
      indptr[i + 1] = indptr[i] + kv;
    }
    a.step_offset[s + 1] = a.step_offset[s] + indptr[bs];
  }

  mla_draft_plan p;
  p.batch_size = bs;
  p.num_steps = num_steps;
  p.kv_indptr = a.kv_indptr;
  p.kv_indices = a.kv_indices;
  p.step_offset = a.step_offset;
  *plan = p;
  return MLA_OK;
}
