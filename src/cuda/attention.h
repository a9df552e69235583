/* CUDA side of mla_attention_absorbed (attention.c): called by the public
 * functions in src/cpu/absorbed.c for CUDA contexts. Only compiled when
 * MLA_WITH_CUDA. */
#ifndef MLA_CUDA_ATTENTION_H
#define MLA_CUDA_ATTENTION_H

#include "mla.h"

/* Device workspace bytes: the plan arrays the kernels read (uploaded per
 * call) plus the split partials (total_splits x max_q_len * num_heads rows). */
mla_status mla_cuda_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                      int num_heads, size_t *bytes);
/* bf16 cache and activations only; q, out, lse and the workspace are device
 * memory; the plan is host memory (mla_plan_build). Asynchronous on the
 * context's stream. */
mla_status mla_cuda_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                       const mla_plan *plan, const mla_absorbed_args *args,
                                       void *workspace, size_t workspace_bytes);

#endif /* MLA_CUDA_ATTENTION_H */
