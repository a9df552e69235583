/* Internal pieces of the metadata planner (never installed).
 *
 * The split-KV schedule is a pure function of the kv lengths so that the
 * device-side scheduler (CUDA-graph replay) can be checked for equality
 * against it, entry for entry. */
#ifndef MLA_PLAN_PLAN_H
#define MLA_PLAN_PLAN_H

#include "../cache/cache.h"

/* MLA_REQUIRE for helpers that check on behalf of a public function: the
 * message names `fn`, the public call, not the helper. */
#define MLA_PLAN_REQUIRE(EB, FN, cond, st, ...)                  \
  do {                                                           \
    if (!(cond)) return mla_fail((EB), (st), (FN), __VA_ARGS__); \
  } while (0)

/* Parts the schedule cuts the work into: max(1, num_sm / ceil(q * H / 64)).
 * One part runs on one SM, and a query tile of 64 rows (q tokens x H heads)
 * occupies one SM, so several tiles per request mean fewer parts.
 * max_q_len < 1 counts as 1. */
int mla_sched_num_parts(int num_sm, int max_q_len, int num_heads);

/* The piece cost (blocks) and block (tokens) a step's schedule uses:
 * MLA_SCHED_FIXED_OVERHEAD and MLA_SCHED_BLOCK, or in a build with
 * -DMLA_DEV_SCHED_OV (dev timing only) the environment's MLA_DEV_SCHED_OV
 * (1..64) and MLA_DEV_SCHED_UNIT (64 or 128). The host plan keeps the
 * library's values. src/plan/step.c. */
void mla_step_sched_rule(int32_t *piece_cost, int32_t *unit);

/* Split-KV schedule over kv_lens [bs] into num_parts parts (FlashMLA's rule):
 * 64-token blocks, MLA_SCHED_FIXED_OVERHEAD blocks of cost per piece,
 * requests walked in order and filled greedily up to a payload of q + overhead
 * per part, q the smallest that fits the batch in num_parts parts unless that
 * cuts it into more pieces than FlashMLA's q = ceil(total / parts) does
 * (then FlashMLA's); and if that q cuts a request and nocut_div > 0, the
 * smallest q' <= q + q / nocut_div at which the parts hold whole requests
 * only, when there is one (then no request is cut; src/plan/step_build.h).
 * The library passes mla_sb_nocut_div(mode) (src/plan/step_build.h).
 *
 * Writes sched_meta [num_parts, MLA_SCHED_META_INTS] and num_splits [bs+1].
 * A part with work covers [begin_req:begin_tok, end_req:end_tok) and has
 * num_reqs = end_req - begin_req + 1 >= 1. An empty part (past the end of
 * the work) is {begin_req = bs, begin_tok = 0, end_req = bs, end_tok = 0,
 * begin_split = 0, num_reqs = 0}. Entries 6 and 7 are always 0.
 * A zero-length request is one piece covering [0, 0) inside one part.
 * Returns 0, or -1 if the walk did not finish (cannot happen for valid
 * inputs; kept so a bug surfaces as MLA_ERR_INTERNAL, not as bad metadata).
 * kv_lens must be >= 0 and num_parts >= 1; bs >= 0. */
int mla_split_schedule(const int32_t *kv_lens /* [bs] */, int bs, int num_parts, int nocut_div,
                       int32_t *sched_meta /* [num_parts, 8] */, int32_t *num_splits /* [bs+1] */);

/* Check that `req_id` (the batch entry `idx` of the argument `name`) names a
 * live request of rt holding at least `need_len` positions; records the
 * failure in eb. OUT_OF_RANGE for an id outside [0, max_reqs) or a length
 * past the request's, BAD_STATE for a request that is not live. */
mla_status mla_plan_check_req(mla_errbuf *eb, const char *fn, const mla_req_table *rt,
                              const char *name, int idx, int32_t req_id, int64_t need_len);

/* Workspace bytes needed by the chunk, draft and DCP plans for one batch's
 * actual sizes; the *_workspace_size functions evaluate them at the worst
 * case the limits allow, so both go through the same carving code. */
size_t mla_chunk_plan_bytes(int64_t bs, int64_t num_chunks, int64_t total_slots);
size_t mla_draft_plan_bytes(int64_t bs, int64_t num_steps, int64_t total_indices);
size_t mla_dcp_plan_bytes(int64_t bs, int64_t total_indices);

#endif /* MLA_PLAN_PLAN_H */
