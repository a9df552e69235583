/* Absorbed-MLA split-KV attention on the GPU: the params struct and the
 * launchers shared by src/cuda/ and the kernel ladder in dev/cuda/.
 * Plain C (included by C host code and by .cu files). */
#ifndef MLA_CUDA_DECODE_H
#define MLA_CUDA_DECODE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One launch covers a planned batch: request i owns query rows
 * [qo_indptr[i], qo_indptr[i+1]) (at most max_q_len of them) and kv_lens[i]
 * keys, found through its block-table row (page ids; slot = page * page_size
 * + offset). Inside a request the kernels see (query token, head) rows packed
 * as t * H + h, cut into 64-row m-blocks. Causal masks are bottom-right
 * aligned: query t of a request with Q queries and K keys sees keys
 * j <= K - Q + t; a row with no visible key gets o = 0 and lse = -inf.
 * All pointers are device pointers; q rows and strides must keep every
 * 16-byte chunk aligned (strides multiples of 8 elements). */
typedef struct mla_decode_params {
  int batch_size;
  int num_heads;       /* H, 1..128 */
  int max_q_len;       /* most query tokens of one request (>= 1) */
  int causal;          /* 1: query t of Q sees keys j <= K - Q + t */
  int page_size;       /* power of two, 1..256 */
  int block_table_width;
  int64_t num_pages;   /* pages in the cache layer (bounds the TMA map) */
  float scale;         /* softmax scale */
  int lse_base2;       /* 1: lse returned in base 2 */

  const uint16_t *q_nope; /* [Tq, H, 512] act_dtype (bf16, or f16 with an f16 cache) */
  const uint16_t *q_rope; /* [Tq, H, 64] act_dtype */
  int64_t q_nope_stride_token, q_nope_stride_head; /* elements */
  int64_t q_rope_stride_token, q_rope_stride_head;
  const void *kv;         /* [num_pages * page_size, row_bytes] cache layer, rows [c (512) | r (64)]
                             (src/cache/cache.h; fp8 rows are dequantized inside the kernels) */
  int64_t row_bytes;      /* 1152 for bf16/f16, 576 fp8 per-tensor, 656 fp8 block-scaled */
  int kv_dtype;           /* mla_dtype of the cache */
  int act_dtype;          /* mla_dtype of q and out */
  float kv_scale;         /* fp8 per-tensor cache: stored = value / kv_scale (1 otherwise) */
  int fp8_math;           /* MLA_FLAG_FP8_MATH: per-tensor fp8 cache, > 32 rows per request: e4m3 q and P
                             on fp8 tensor cores (the wide fp8 kernel); ignored elsewhere */

  const int32_t *qo_indptr;   /* [bs+1] */
  const int32_t *kv_lens;     /* [bs] */
  const int32_t *block_table; /* [bs, block_table_width] */

  /* Split-KV schedule (mla_plan: MLA_SCHED_* layout). */
  int num_sm_parts;
  const int32_t *sched_meta;  /* [num_sm_parts, 8] */
  const int32_t *num_splits;  /* [bs+1] */

  uint16_t *out;   /* [Tq, H, 512] act_dtype */
  float *lse;      /* [Tq, H] or NULL */
  /* Partial states of the requests the schedule cuts into pieces, by slot
   * (mla_decode_partial_slot below; NULL when num_sm_parts < 2: nothing is
   * cut then). The dev/cuda ladder indexes these by num_splits[i] + piece
   * instead and sizes them [total_splits, ...]. */
  float *o_accum;  /* [mla_decode_partial_slots(num_sm_parts), max_q_len * H, 512] (o / l) */
  float *lse_accum;/* [mla_decode_partial_slots(num_sm_parts), max_q_len * H] (natural log; -inf: empty piece) */
} mla_decode_params;

#ifdef __CUDACC__
#define MLA_DECODE_HD __host__ __device__
#else
#define MLA_DECODE_HD
#endif

/* Rows of one request as the kernels see them, and the 64-row m-blocks they
 * are cut into (each m-block re-reads the request's keys). */
static inline MLA_DECODE_HD int mla_decode_rows(const mla_decode_params *p) { return p->max_q_len * p->num_heads; }
static inline MLA_DECODE_HD int mla_decode_m_blocks(const mla_decode_params *p) {
  return (mla_decode_rows(p) + 63) / 64;
}

/* Where a piece of a cut request keeps its partial state: a part (the
 * schedule's unit of work) holds at most two cut requests, its first and its
 * last, so the piece a part computes for its first request goes to slot 2p
 * and the one for its last request to 2p + 1. A schedule of one part cuts
 * nothing. The partial buffers thus scale with the parts, not the batch:
 * with rows = max_q_len * H, the split schedule's rule (include/mla.h) gives
 * parts * rows <= 64 * num_sm whenever parts >= 2, so they never exceed
 * 2 * 64 * num_sm rows however long the query side (prefill) is. */
static inline MLA_DECODE_HD int mla_decode_partial_slots(int num_sm_parts) {
  return num_sm_parts >= 2 ? 2 * num_sm_parts : 0;
}
static inline MLA_DECODE_HD int mla_decode_partial_slot(int part, int is_first_req_of_part) {
  return 2 * part + (is_first_req_of_part ? 0 : 1);
}

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_DECODE_H */
