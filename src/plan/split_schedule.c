/* Split-KV schedule: how the decode work of a batch is spread over the SMs.
 *
 * Cost model (FlashMLA's): a request of k keys costs ceil(k / 64) blocks of
 * work plus a fixed overhead (loading its queries, writing its output or a
 * partial state) paid once per piece it is cut into. Every part gets the same
 * budget and takes requests in order until the budget runs out, cutting the
 * request it is in when the rest does not fit. Requests that end up in one
 * piece need no combine. */
#include "plan.h"

int mla_sched_num_parts(int num_sm, int max_q_len, int num_heads) {
  int64_t q = max_q_len < 1 ? 1 : max_q_len;
  int64_t h = num_heads < 1 ? 1 : num_heads;
  int64_t tiles = mla_cdiv(q * h, MLA_SCHED_BLOCK);
  int64_t parts = (int64_t)num_sm / tiles;
  return parts < 1 ? 1 : (int)parts;
}

int mla_split_schedule(const int32_t *kv_lens, int bs, int num_parts, int32_t *sched_meta,
                       int32_t *num_splits) {
  const int64_t ov = MLA_SCHED_FIXED_OVERHEAD;
  int64_t total = 0;
  for (int i = 0; i < bs; i++) total += mla_cdiv(kv_lens[i], MLA_SCHED_BLOCK) + ov;
  const int64_t payload = mla_cdiv(total, num_parts) + ov;

  int req = 0;       /* request the walk is in */
  int64_t blk = 0;   /* first block of `req` not yet given to a part */
  int32_t piece = 0; /* pieces of `req` already given out */
  int32_t cum = 0;   /* pieces of the finished requests */
  num_splits[0] = 0;
  for (int p = 0; p < num_parts; p++) {
    int32_t *m = sched_meta + (size_t)p * MLA_SCHED_META_INTS;
    for (int j = 0; j < MLA_SCHED_META_INTS; j++) m[j] = 0;
    if (req >= bs) {
      m[MLA_SCHED_BEGIN_REQ] = bs;
      m[MLA_SCHED_END_REQ] = bs;
      continue;
    }
    m[MLA_SCHED_BEGIN_REQ] = req;
    m[MLA_SCHED_BEGIN_TOK] = (int32_t)(blk * MLA_SCHED_BLOCK);
    m[MLA_SCHED_BEGIN_SPLIT] = piece;
    int64_t remain = payload;
    while (req < bs) {
      int64_t rest = mla_cdiv(kv_lens[req], MLA_SCHED_BLOCK) - blk;
      if (remain >= rest + ov) {
        /* The rest of this request fits: it is finished here. */
        cum += piece + 1;
        num_splits[req + 1] = cum;
        remain -= rest + ov;
        req++;
        blk = 0;
        piece = 0;
      } else {
        /* Cut it: take what the budget allows (rest > remain - ov here, so
         * the cut is strictly inside the request) and close the part. */
        if (remain > ov) {
          blk += remain - ov;
          piece++;
        }
        break;
      }
    }
    int32_t end_req, end_tok;
    if (blk > 0) { /* ended inside `req` */
      end_req = req;
      int64_t t = blk * MLA_SCHED_BLOCK;
      end_tok = (int32_t)(t < kv_lens[req] ? t : kv_lens[req]);
    } else { /* ended at a request boundary */
      end_req = req - 1;
      end_tok = end_req >= 0 ? kv_lens[end_req] : 0;
    }
    if (end_req < m[MLA_SCHED_BEGIN_REQ]) return -1; /* a part took nothing */
    m[MLA_SCHED_END_REQ] = end_req;
    m[MLA_SCHED_END_TOK] = end_tok;
    m[MLA_SCHED_NUM_REQS] = end_req - m[MLA_SCHED_BEGIN_REQ] + 1;
  }
  return req < bs ? -1 : 0;
}
