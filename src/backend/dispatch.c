/* Public attention entry points: one dispatch site mapping the context's
 * device to an implementation (STYLE 7), so the CPU and CUDA code never
 * include each other. */
#include "../cpu/cpu.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/attention.h"
#include "../cuda/prefill.h"
#endif

/* For a CUDA context the workspace is DEVICE memory, sized from the plan alone
 * (batch_size, block_table_width, num_sm_parts, total_splits, max_q_len) and
 * num_heads: the uploaded plan arrays plus the split partials. */
mla_status mla_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan, int num_heads,
                                                 size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA)
    return mla_cuda_attention_absorbed_workspace_size(ctx, plan, num_heads, bytes);
#endif
  return mla_cpu_attention_absorbed_workspace_size(ctx, plan, num_heads, bytes);
}

mla_status mla_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer, const mla_plan *plan,
                                  const mla_absorbed_args *args, void *workspace, size_t workspace_bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
#ifdef MLA_WITH_CUDA
  /* sm_90a kernels: bf16 cache and activations; device q, out, lse, workspace. */
  if (ctx->device == MLA_DEVICE_CUDA)
    return mla_cuda_attention_absorbed(ctx, cache, layer, plan, args, workspace, workspace_bytes);
#endif
  return mla_cpu_attention_absorbed(ctx, cache, layer, plan, args, workspace, workspace_bytes);
}

mla_status mla_attention_ragged_workspace_size(mla_ctx *ctx, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_clear_error(&ctx->err);
  MLA_REQUIRE_PTR(&ctx->err, bytes);
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA) {
    *bytes = MLA_CUDA_RAGGED_WORKSPACE_BYTES;
    return MLA_OK;
  }
#endif
  *bytes = 0;
  return MLA_OK;
}

/* CUDA contexts: the sm_90a ragged MHA kernel (src/cuda/ragged.c); device
 * q, k, v, out, lse and index arrays. */
mla_status mla_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA) return mla_cuda_attention_ragged(ctx, args);
#endif
  return mla_cpu_attention_ragged(ctx, args);
}

/* CUDA contexts: host arrays of device pointers (src/cuda/ragged.c). */
mla_status mla_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads, int head_dim,
                            mla_dtype act_dtype, unsigned flags, const void *const *o_parts,
                            const float *const *lse_parts, void *out, float *lse_out) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA)
    return mla_cuda_merge_states(ctx, num_states, num_tokens, num_heads, head_dim, act_dtype, flags, o_parts,
                                 lse_parts, out, lse_out);
#endif
  return mla_cpu_merge_states(ctx, num_states, num_tokens, num_heads, head_dim, act_dtype, flags, o_parts,
                              lse_parts, out, lse_out);
}
