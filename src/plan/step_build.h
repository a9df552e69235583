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

/* Split-KV schedule (the rule documented at MLA_SCHED_BLOCK in mla.h).
 *
 * The greedy walk at part budget q + OV (cost units: 64-token blocks, OV per
 * piece): each part takes requests in order while they fit whole and cuts the
 * one that does not; with `nocut` it closes the part instead (a request that
 * does not fit an empty part: the walk fails). Returns 0 when the batch fits
 * in num_parts parts, else -1. Writes sched_meta [num_parts, 8] and
 * num_splits [bs+1] only when both are non-NULL (NULL: a trial walk that only
 * answers whether q fits). */
static inline MLA_SB_HD int mla_sb_walk(const int32_t *kv_lens /* [bs] */, int bs, int num_parts, int64_t ov,
                                        int64_t unit, int64_t q, int nocut,
                                        int32_t *sched_meta /* [parts, 8] or NULL */,
                                        int32_t *num_splits /* [bs+1] or NULL */, int64_t *pieces /* or NULL */) {
  const int64_t payload = q + ov;
  const int out = sched_meta != 0 && num_splits != 0;
  int req = 0;       /* request the walk is in */
  int64_t blk = 0;   /* first block of `req` not yet given to a part */
  int32_t piece = 0; /* pieces of `req` already given out */
  int32_t cum = 0;   /* pieces of the finished requests */
  if (out) num_splits[0] = 0;
  for (int p = 0; p < num_parts; p++) {
    int32_t m[MLA_SCHED_META_INTS];
    for (int j = 0; j < MLA_SCHED_META_INTS; j++) m[j] = 0;
    if (req >= bs) {
      if (!out) break;
      m[MLA_SCHED_BEGIN_REQ] = bs;
      m[MLA_SCHED_END_REQ] = bs;
    } else {
      m[MLA_SCHED_BEGIN_REQ] = req;
      m[MLA_SCHED_BEGIN_TOK] = (int32_t)(blk * unit);
      m[MLA_SCHED_BEGIN_SPLIT] = piece;
      int64_t remain = payload;
      int took = 0; /* requests finished in this part (nocut) */
      while (req < bs) {
        int64_t rest = mla_sb_cdiv(kv_lens[req], unit) - blk;
        if (remain >= rest + ov) {
          /* The rest of this request fits: it is finished here. */
          cum += piece + 1;
          if (out) num_splits[req + 1] = cum;
          remain -= rest + ov;
          req++;
          blk = 0;
          piece = 0;
          took++;
        } else if (nocut) {
          if (!took) return -1; /* longer than a part's budget on its own */
          break;
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
        int64_t t = blk * unit;
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
    if (out)
      for (int j = 0; j < MLA_SCHED_META_INTS; j++) sched_meta[(int64_t)p * MLA_SCHED_META_INTS + j] = m[j];
  }
  if (pieces) *pieces = cum;
  return req < bs ? -1 : 0;
}

/* The lowest budget the search for q tries: ceil(blocks / parts) (>= 1), or
 * FlashMLA's ceil(total / parts) if that is lower (total = blocks + the
 * pieces' cost). The device's probe grid numbers its candidates from it. */
static inline MLA_SB_HD int64_t mla_sb_sched_q_low(int64_t total, int64_t blocks, int num_parts) {
  const int64_t q_flash = mla_sb_cdiv(total, num_parts), lo = mla_sb_cdiv(blocks, num_parts);
  const int64_t lo0 = lo < 1 ? 1 : lo;
  return lo0 < q_flash ? lo0 : q_flash;
}

/* The schedule's q: the smallest that fits, found by bisection between a
 * bound no q below can beat (every part covers at most q blocks: q >=
 * ceil(blocks / parts)) and FlashMLA's q = ceil(total / parts), which always
 * fits; FlashMLA's q itself when the smaller one cuts the batch into more
 * pieces (more partial states to write and combine, which the cost model does
 * not count: e.g. b = 96 requests of 16 blocks over 132 parts would all be
 * cut in two to save one block a part). FlashMLA's q alone can leave parts
 * well under the budget: b = 64 requests of 64 blocks over 132 parts get
 * pieces of 34 + 30 blocks at q = 34, of 32 + 32 at q = 32 (docs/decode-
 * kernel.md §7). Then, when that q cuts any request and `nocut_div` > 0
 * (MLA_SCHED_NOCUT_DIV; 0 in EXTEND): the smallest q' <= q + q / nocut_div
 * at which a walk that never cuts fits (*nocut = 1, q' returned). A cut
 * request costs more than the model's overhead (its pieces' query loads and
 * fp32 partial rows, and the combine): b = 128 requests of 128 blocks over
 * 66 parts (H = 128) are cut 62 times at q = 258 and not at all at q' = 261
 * (two whole requests a part, 64 parts used), which an H100 ran 5-7 %
 * faster; q' = q + 7..11 still gained 3.5-5.4 % at H = 128 and 0-2.6 % at
 * H = 16 (bench/RESULTS.md session 37). The device scheduler (src/cuda/
 * step.cu) makes the same choice from the same trial answers. Returns q. */
static inline MLA_SB_HD int64_t mla_sb_sched_q(const int32_t *kv_lens /* [bs] */, int bs, int num_parts,
                                               int64_t ov, int64_t unit, int nocut_div, int *nocut) {
  int64_t blocks = 0, longest = 0;
  for (int i = 0; i < bs; i++) {
    const int64_t b = mla_sb_cdiv(kv_lens[i], unit);
    blocks += b;
    if (b > longest) longest = b;
  }
  const int64_t total = blocks + ov * bs;
  const int64_t q_flash = mla_sb_cdiv(total, num_parts);
  int64_t lo = mla_sb_sched_q_low(total, blocks, num_parts), hi = q_flash;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (mla_sb_walk(kv_lens, bs, num_parts, ov, unit, mid, 0, 0, 0, 0) == 0) hi = mid;
    else lo = mid + 1;
  }
  /* A walk that never cuts fits at q only if the cutting walk does (that one
   * fills every part at least as far), so the cut-free q is >= this one. */
  const int64_t q_fit = hi;
  /* pieces at hi: needed to compare with FlashMLA's q, or for the cut-free test */
  int64_t pieces = 0;
  if (hi < q_flash || nocut_div > 0) mla_sb_walk(kv_lens, bs, num_parts, ov, unit, hi, 0, 0, 0, &pieces);
  if (hi < q_flash) {
    int64_t pieces_flash = 0;
    mla_sb_walk(kv_lens, bs, num_parts, ov, unit, q_flash, 0, 0, 0, &pieces_flash);
    if (pieces > pieces_flash) {
      hi = q_flash;
      pieces = pieces_flash;
    }
  }
  *nocut = 0;
  const int64_t top = nocut_div > 0 ? hi + hi / nocut_div : hi;
  if (nocut_div > 0 && pieces > bs && longest <= top &&
      mla_sb_walk(kv_lens, bs, num_parts, ov, unit, top, 1, 0, 0, 0) == 0) {
    /* A cut-free walk's fit is monotone in q: bisect in [max(q_fit, longest), top]. */
    int64_t a = q_fit > longest ? q_fit : longest, b = top;
    while (a < b) {
      const int64_t mid = a + (b - a) / 2;
      if (mla_sb_walk(kv_lens, bs, num_parts, ov, unit, mid, 1, 0, 0, 0) == 0) b = mid;
      else a = mid + 1;
    }
    *nocut = 1;
    hi = b;
  }
  return hi;
}

/* Budgets q the device schedule evaluates at once before it chooses one
 * (src/cuda/step.cu: a block per candidate, answers in the step workspace);
 * a q outside them is tried by the choosing block itself. */
#define MLA_STEP_SCHED_PROBES 512

/* The cut-free divisor the library schedules mode's batches with: none in
 * EXTEND, whose step (a token bucket) and host plan (the real query counts)
 * must agree on the schedule (tests/test_step.c). */
static inline MLA_SB_HD int mla_sb_nocut_div(int mode) { return mode == MLA_MODE_EXTEND ? 0 : MLA_SCHED_NOCUT_DIV; }

/* Returns 0, or -1 when the parts did not cover the batch (cannot happen for
 * valid inputs). */
static inline MLA_SB_HD int mla_split_schedule_body(const int32_t *kv_lens /* [bs] */, int bs,
                                                    int num_parts, int64_t ov, int64_t unit, int nocut_div,
                                                    int32_t *sched_meta /* [parts, 8] */,
                                                    int32_t *num_splits /* [bs+1] */) {
  int nocut = 0;
  const int64_t q = mla_sb_sched_q(kv_lens, bs, num_parts, ov, unit, nocut_div, &nocut);
  return mla_sb_walk(kv_lens, bs, num_parts, ov, unit, q, nocut, sched_meta, num_splits, 0);
}

/* Fixed shape of a step, resolved from mla_step_desc and the cache.
 *
 * Decode context parallel (dcp_world = N > 1): position p of a request lives
 * on rank p mod N, at local slot = global slot / N. With the global pages
 * N times the local ones (req_to_token is global, page size P * N), local
 * key q of rank r is global position q * N + r, and its local page index is
 * the global one: the block table is the global table, the kv length the
 * rank's count of positions. */
typedef struct mla_step_geom {
  int32_t mode;         /* mla_mode */
  int32_t batch_size;
  int32_t q_len;        /* queries per row (EXTEND: the most of one row = num_tokens) */
  int32_t varlen;       /* EXTEND: row i has extend_lens[i] queries (qo_indptr a running sum) */
  int32_t num_tokens;   /* EXTEND: bound on the batch's total queries */
  int32_t kv_extra;     /* kv_len = seq_len + kv_extra (TARGET_VERIFY: ndt) */
  int32_t max_kv_len;   /* bound on the (global) kv length */
  int32_t page_shift;   /* log2(page_size) of the cache the kernels read */
  int32_t gpage_shift;  /* log2 of req_to_token's page size (page_shift + log2(N)) */
  int32_t dcp_world, dcp_rank; /* 1, 0 without context parallelism */
  int32_t width;        /* block-table width = local pages of max_kv_len */
  int32_t num_parts;    /* split-schedule parts */
  int32_t nocut_div;    /* mla_sb_nocut_div(mode) */
  int32_t sched_ov;     /* cost of a piece in blocks: MLA_SCHED_FIXED_OVERHEAD */
  int32_t sched_unit;   /* the schedule's block in tokens: MLA_SCHED_BLOCK */
  int32_t max_splits;   /* batch_size + num_parts: a part cuts at most one request */
  int32_t max_reqs;
  int64_t stride;       /* req_to_token row stride */
  int64_t num_pages;    /* pages of the cache */
} mla_step_geom;

/* Keys of rank r among global kv keys (all of them without DCP). */
static inline MLA_SB_HD int32_t mla_step_local_kv(const mla_step_geom *g, int64_t kv) {
  if (g->dcp_world <= 1) return (int32_t)kv;
  return kv > g->dcp_rank ? (int32_t)((kv - g->dcp_rank + g->dcp_world - 1) / g->dcp_world) : 0;
}

/* (Local) kv length of row i, or -1 when its request id or length is out of range. */
static inline MLA_SB_HD int32_t mla_step_row_kv(const mla_step_geom *g, int32_t req_id, int32_t seq_len) {
  if (req_id != MLA_REQ_PAD && (req_id < 0 || req_id >= g->max_reqs)) return -1;
  if (seq_len < 0) return -1;
  const int64_t kv = (int64_t)seq_len + g->kv_extra;
  if (kv > g->max_kv_len) return -1;
  return mla_step_local_kv(g, kv);
}

/* Queries of row i: q_len, or (EXTEND) its extend length when 0..kv_len
 * (the queries are the row's last keys), else -1. */
static inline MLA_SB_HD int32_t mla_step_row_q(const mla_step_geom *g, int32_t extend_len, int32_t kv_len) {
  if (!g->varlen) return g->q_len;
  return extend_len >= 0 && extend_len <= kv_len ? extend_len : -1;
}

/* Block-table entry j of a row with kv_len (local) keys: the page holding
 * local keys [j*P, (j+1)*P) (global positions [j*P*N, (j+1)*P*N)),
 * MLA_BLOCK_TABLE_PAD past the row's pages, or -2 when the slot at the
 * global page start is not the first slot of a page inside the cache. */
static inline MLA_SB_HD int32_t mla_step_page(const mla_step_geom *g, const int32_t *req_to_token,
                                              int32_t req_id, int32_t kv_len, int32_t j) {
  if ((int64_t)j << g->page_shift >= kv_len) return MLA_BLOCK_TABLE_PAD;
  if (req_id == MLA_REQ_PAD) return 0;
  const int32_t slot = req_to_token[(int64_t)req_id * g->stride + ((int64_t)j << g->gpage_shift)];
  const int32_t page = slot >> g->gpage_shift;
  if (slot < 0 || (slot & ((1 << g->gpage_shift) - 1)) != 0 || page >= g->num_pages) return -2;
  return page;
}

#endif /* MLA_PLAN_STEP_BUILD_H */
