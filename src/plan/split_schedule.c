/* Split-KV schedule: how the decode work of a batch is spread over the SMs.
 *
 * Cost model (FlashMLA's): a request of k keys costs ceil(k / 64) blocks of
 * work plus a fixed overhead (loading its queries, writing its output or a
 * partial state) paid once per piece it is cut into. Every part gets the same
 * budget and takes requests in order until the budget runs out, cutting the
 * request it is in when the rest does not fit. Requests that end up in one
 * piece need no combine. A budget up to 1/MLA_SCHED_NOCUT_DIV larger is taken
 * when it keeps every request whole (src/plan/step_build.h). */
#include "plan.h"
#include "step_build.h"

int mla_sched_num_parts(int num_sm, int max_q_len, int num_heads) {
  int64_t q = max_q_len < 1 ? 1 : max_q_len;
  int64_t h = num_heads < 1 ? 1 : num_heads;
  int64_t tiles = mla_cdiv(q * h, MLA_SCHED_BLOCK);
  int64_t parts = (int64_t)num_sm / tiles;
  return parts < 1 ? 1 : (int)parts;
}

int mla_split_schedule(const int32_t *kv_lens, int bs, int num_parts, int nocut_div, int32_t *sched_meta,
                       int32_t *num_splits) {
  return mla_split_schedule_body(kv_lens, bs, num_parts, MLA_SCHED_FIXED_OVERHEAD, MLA_SCHED_BLOCK, nocut_div,
                                 sched_meta, num_splits);
}
