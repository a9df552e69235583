/* Public attention entry points: one dispatch site mapping the context's
 * device to an implementation (STYLE 7), so the CPU and CUDA code never
 * include each other. */
#include "../cpu/cpu.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/attention.h"
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
