/* CUDA side of mla_attention_absorbed (attention.c): called by the public
 * functions in src/cpu/absorbed.c for CUDA contexts. Only compiled when
 * MLA_WITH_CUDA. */
#ifndef MLA_CUDA_ATTENTION_H
#define MLA_CUDA_ATTENTION_H

#include <stdint.h>

#include "mla.h"

/* Device workspace bytes: the plan arrays the kernels read (uploaded per
 * call, or once per plan: mla_cuda_attention_plan_place) plus the split
 * partials (decode.h: mla_decode_partial_slots(parts) x max_q_len *
 * num_heads rows; none for a one-part schedule). */
mla_status mla_cuda_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                      int num_heads, size_t *bytes);
/* The cache / activation pairs mla_cuda_decode_unsupported() accepts; q, out, lse and the workspace are device
 * memory; the plan is host memory (mla_plan_build). Asynchronous on the
 * context's stream. */
mla_status mla_cuda_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                       const mla_plan *plan, const mla_absorbed_args *args,
                                       void *workspace, size_t workspace_bytes);

/* Device metadata of a prepared step (src/plan/step.c carves it from the
 * step workspace; src/cuda/step.cu writes it). */
typedef struct mla_cuda_step_meta {
  int batch_size, q_len, causal, block_table_width, num_sm_parts;
  int num_heads;              /* the head count the partials were sized for (args->num_heads must match) */
  const int32_t *qo_indptr;   /* [bs+1] */
  const int32_t *kv_lens;     /* [bs] */
  const int32_t *block_table; /* [bs, block_table_width] */
  const int32_t *sched_meta;  /* [num_sm_parts, 8] */
  const int32_t *num_splits;  /* [bs+1] */
  float *o_accum;             /* [mla_decode_partial_slots(num_sm_parts), q_len * H, 512] or NULL (one part) */
  float *lse_accum;           /* [mla_decode_partial_slots(num_sm_parts), q_len * H] or NULL */
} mla_cuda_step_meta;

/* One layer over metadata already on the device (a prepared step, or a host
 * plan placed by mla_cuda_attention_plan_place): the args checks of
 * mla_attention_absorbed (same statuses, messages in the name of fn), then
 * the kernels. No copy and no host sync: capturable in a CUDA graph. */
mla_status mla_cuda_attention_meta(mla_ctx *ctx, const char *fn, const mla_kv_cache *cache, int layer,
                                   const mla_absorbed_args *args, const mla_cuda_step_meta *m);

/* Where a host plan's arrays go in a device workspace of
 * mla_cuda_attention_absorbed_workspace_size bytes (device memory). */
typedef struct mla_cuda_plan_dst {
  int32_t *qo_indptr;   /* [bs+1] */
  int32_t *kv_lens;     /* [bs] */
  int32_t *block_table; /* [bs, block_table_width] */
  int32_t *sched_meta;  /* [num_sm_parts, 8] */
  int32_t *num_splits;  /* [bs+1] */
} mla_cuda_plan_dst;

/* For callers that run one host plan over many layers (the backend): the
 * plan checks of mla_attention_absorbed against the cache, num_heads and
 * the workspace, done once; *dst gets where the caller copies the plan's
 * arrays (in stream order, before the first layer), *m the metadata every
 * layer then launches from (mla_cuda_attention_meta). Requires a plan with
 * queries (not IDLE, batch_size and num_q_tokens > 0). Writes nothing to the
 * device. */
mla_status mla_cuda_attention_plan_place(mla_ctx *ctx, const char *fn, const mla_kv_cache *cache,
                                         const mla_plan *plan, int num_heads, void *workspace,
                                         size_t workspace_bytes, mla_cuda_plan_dst *dst, mla_cuda_step_meta *m);

#endif /* MLA_CUDA_ATTENTION_H */
