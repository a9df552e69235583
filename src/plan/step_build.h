/* The metadata of a device-built step (mla_step_*), as inline functions that
 * compile both as host C and as CUDA device code, so the CPU path, the CUDA
 * kernels (src/cuda/step.cu) and mla_plan_build's split schedule run the very
 * same arithmetic. Plain C; no libc. */
#ifndef MLA_PLAN_STEP_BUILD_H
#define MLA_PLAN_STEP_BUILD_H

#include <stdint.h>

#include "mla.h"

#ifdef __CUDACC__
#define MLA_SB_HD __host__ __device__
#else
#define MLA_SB_HD
#endif

static inline MLA_SB_HD int64_t mla_sb_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Split-KV schedule (the rule documented at MLA_SCHED_BLOCK in mla.h), in
 * closed form so that every part and every request can be computed on its
 * own (one GPU thread each) from the cost prefix sums:
 *   cost of request i: c_i = ceil(kv_i / 64) + OV, C_i = c_0 + ... + c_{i-1},
 *   total = C_bs, Q = ceil(total / parts); part p starts at cost position
 *   p * Q. Position s inside request r (C_r <= s < C_{r+1}) means block
 *   k = s - C_r - OV of r when that is > 0 (a cut: r continues from block k),
 *   else r's beginning (the first OV positions stand for the request's fixed
 *   cost). Part p covers [start(p), start(p+1)); a part whose start equals
 *   the next one's is empty. Each part costs at most Q + OV. */

/* A cost position resolved to (request, first block); r = bs past the end. */
typedef struct mla_sched_pos {
  int32_t r, k;
  int64_t cr; /* C_r */
} mla_sched_pos;

static inline MLA_SB_HD mla_sched_pos mla_sched_pos_at(int64_t s, int32_t r, int64_t cr, int bs) {
  mla_sched_pos q;
  q.r = r;
  q.cr = cr;
  q.k = 0;
  if (r < bs && s - cr > MLA_SCHED_FIXED_OVERHEAD) q.k = (int32_t)(s - cr - MLA_SCHED_FIXED_OVERHEAD);
  return q;
}

/* Writes part [a, b) (b is the next part's start) into m [8]. */
static inline MLA_SB_HD void mla_sched_write_part(mla_sched_pos a, mla_sched_pos b, const int32_t *kv_lens, int bs,
                                                  int64_t q_cost, int p, int32_t *m) {
  for (int j = 0; j < MLA_SCHED_META_INTS; j++) m[j] = 0;
  m[MLA_SCHED_BEGIN_REQ] = bs;
  m[MLA_SCHED_END_REQ] = bs;
  if (a.r >= bs || (a.r == b.r && a.k == b.k)) return; /* empty */
  int32_t end_req, end_tok;
  if (b.r < bs && b.k > 0) {
    end_req = b.r;
    end_tok = b.k * MLA_SCHED_BLOCK;
  } else {
    end_req = b.r - 1;
    end_tok = kv_lens[end_req];
  }
  m[MLA_SCHED_BEGIN_REQ] = a.r;
  m[MLA_SCHED_BEGIN_TOK] = a.k * MLA_SCHED_BLOCK;
  m[MLA_SCHED_END_REQ] = end_req;
  m[MLA_SCHED_END_TOK] = end_tok;
  /* pieces of a.r before this one: its first, plus one per earlier cut */
  m[MLA_SCHED_BEGIN_SPLIT] = a.k > 0 ? (int32_t)(p - (a.cr + MLA_SCHED_FIXED_OVERHEAD) / q_cost) : 0;
  m[MLA_SCHED_NUM_REQS] = end_req - a.r + 1;
}

/* Pieces request [cr, cr1) is cut into by parts 0..parts-1. */
static inline MLA_SB_HD int32_t mla_sched_pieces(int64_t cr, int64_t cr1, int64_t q_cost, int parts) {
  const int64_t first = (cr + MLA_SCHED_FIXED_OVERHEAD) / q_cost + 1; /* first p with p*Q > cr + OV */
  int64_t last = (cr1 + q_cost - 1) / q_cost - 1;                    /* last p with p*Q < cr1 */
  if (last > parts - 1) last = parts - 1;
  return 1 + (int32_t)(last >= first ? last - first + 1 : 0);
}

/* Serial host version (a two-pointer walk over parts and requests).
 * Returns 0 (kept int for the callers' error path). */
static inline MLA_SB_HD int mla_split_schedule_body(const int32_t *kv_lens /* [bs] */, int bs, int num_parts,
                                                    int32_t *sched_meta /* [parts, 8] */,
                                                    int32_t *num_splits /* [bs+1] */) {
  int64_t total = 0;
  for (int i = 0; i < bs; i++) total += mla_sb_cdiv(kv_lens[i], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD;
  const int64_t qc = total > 0 ? mla_sb_cdiv(total, num_parts) : 1;
  int32_t r = 0;
  int64_t cr = 0;
  mla_sched_pos prev = mla_sched_pos_at(0, 0, 0, bs);
  for (int p = 1; p <= num_parts; p++) {
    const int64_t s = p < num_parts && (int64_t)p * qc < total ? (int64_t)p * qc : total;
    while (r < bs && cr + mla_sb_cdiv(kv_lens[r], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD <= s) {
      cr += mla_sb_cdiv(kv_lens[r], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD;
      r++;
    }
    const mla_sched_pos cur = mla_sched_pos_at(s, r, cr, bs);
    mla_sched_write_part(prev, cur, kv_lens, bs, qc, p - 1, sched_meta + (int64_t)(p - 1) * MLA_SCHED_META_INTS);
    prev = cur;
  }
  num_splits[0] = 0;
  cr = 0;
  for (int i = 0; i < bs; i++) {
    const int64_t cr1 = cr + mla_sb_cdiv(kv_lens[i], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD;
    num_splits[i + 1] = num_splits[i] + mla_sched_pieces(cr, cr1, qc, num_parts);
    cr = cr1;
  }
  return 0;
}

/* Fixed shape of a step, resolved from mla_step_desc and the cache. */
typedef struct mla_step_geom {
  int32_t mode;         /* mla_mode */
  int32_t batch_size;
  int32_t q_len;        /* queries per row */
  int32_t kv_extra;     /* kv_len = seq_len + kv_extra (TARGET_VERIFY: ndt) */
  int32_t max_kv_len;
  int32_t page_shift;   /* log2(page_size) */
  int32_t width;        /* block-table width = ceil(max_kv_len / page_size) */
  int32_t num_parts;    /* split-schedule parts */
  int32_t max_splits;   /* batch_size + num_parts: a part cuts at most one request */
  int32_t max_reqs;
  int64_t stride;       /* req_to_token row stride */
  int64_t num_pages;    /* pages of the cache */
} mla_step_geom;

/* kv length of row i, or -1 when its request id or length is out of range. */
static inline MLA_SB_HD int32_t mla_step_row_kv(const mla_step_geom *g, int32_t req_id, int32_t seq_len) {
  if (req_id != MLA_REQ_PAD && (req_id < 0 || req_id >= g->max_reqs)) return -1;
  if (seq_len < 0) return -1;
  const int64_t kv = (int64_t)seq_len + g->kv_extra;
  if (kv > g->max_kv_len) return -1;
  return (int32_t)kv;
}

/* Block-table entry j of a row with kv_len keys: the page holding positions
 * [j*P, (j+1)*P), MLA_BLOCK_TABLE_PAD past the row's pages, or -2 when the
 * slot at the page start is not the first slot of a page inside the cache. */
static inline MLA_SB_HD int32_t mla_step_page(const mla_step_geom *g, const int32_t *req_to_token,
                                              int32_t req_id, int32_t kv_len, int32_t j) {
  if ((int64_t)j << g->page_shift >= kv_len) return MLA_BLOCK_TABLE_PAD;
  if (req_id == MLA_REQ_PAD) return 0;
  const int32_t slot = req_to_token[(int64_t)req_id * g->stride + ((int64_t)j << g->page_shift)];
  const int32_t page = slot >> g->page_shift;
  if (slot < 0 || (slot & ((1 << g->page_shift) - 1)) != 0 || page >= g->num_pages) return -2;
  return page;
}

#endif /* MLA_PLAN_STEP_BUILD_H */
