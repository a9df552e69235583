/* mla_attention_ragged and mla_merge_states for CUDA contexts (dispatched
 * from src/backend/dispatch.c): the CPU path's argument checks with the same
 * statuses, then the sm_90a kernels of prefill_sm90.cu on the context's
 * stream. Asynchronous: nothing is waited for.
 *
 * Ragged MHA scope: f32, bf16 or f16 q / k / v, any qk_dim / v_dim up to
 * MLA_MAX_HEAD_DIM, any batch size, 16-byte aligned tensors; any head count
 * with grouped kv heads, causal or not, softcap, lse, MLA_FLAG_OUT_F32. The
 * sm_90a kernels (prefill_sm90.cu) take bf16 / f16 at 192/128 and 128/128 with
 * up to MLA_CUDA_PREFILL_MAX_BATCH requests; the rest runs on the generic
 * kernel (ragged_generic.cu: plain CUDA, correct but slow).
 *
 * The index arrays qo_indptr / kv_indptr are device memory and the host
 * never reads them (no synchronisation, graph-capturable): their contents
 * cannot be validated here. A request whose lengths are negative (or
 * indptr[0] != 0) is skipped by the kernel and reported as OUT_OF_RANGE by
 * mla_ctx_synchronize, like the other device-side bad values. The optional
 * workspace holds the sm_90a kernel's item counter (dynamic order); the
 * generic kernel does not use it. For the same
 * reason q, k, v and out must be non-NULL whenever batch_size > 0 (the CPU
 * path accepts NULL k / v when every key length is 0). */
#include <math.h>
#include <stdint.h>

#include "../core/internal.h"
#include "prefill.h"
#include "runtime.h"

#define REQ(EB, FN, cond, st, ...)                         \
  do {                                                     \
    if (!(cond)) return mla_fail((EB), (st), (FN), __VA_ARGS__); \
  } while (0)

static mla_status check_dtype(mla_errbuf *eb, const char *fn, const char *name, mla_dtype t) {
  if ((int)t < MLA_DTYPE_F32 || (int)t > MLA_DTYPE_F64)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "%s = %d is not an mla_dtype", name, (int)t);
  if (!mla_is_act_dtype(t))
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "%s = %s, expected f32, bf16 or f16", name, mla_dtype_name(t));
  return MLA_OK;
}

static mla_status require_device(mla_errbuf *eb, const char *fn, const char *name, const void *p) {
  REQ(eb, fn, !p || mla_cuda_is_device_ptr(p), MLA_ERR_INVALID_ARGUMENT,
      "%s is host memory; a CUDA context takes device pointers", name);
  return MLA_OK;
}

mla_status mla_cuda_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args) {
  static const char *const FN = "mla_attention_ragged";
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  REQ(eb, FN, args, MLA_ERR_INVALID_ARGUMENT, "args is NULL");
  const mla_ragged_args *a = args;
  /* The CPU path's checks, in its order. */
  REQ(eb, FN, a->batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "args->batch_size = %d is negative", a->batch_size);
  REQ(eb, FN, a->num_heads >= 1 && a->num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
      "args->num_heads = %d, expected 1..%d", a->num_heads, MLA_MAX_HEADS);
  REQ(eb, FN, a->num_kv_heads >= 1 && a->num_heads % a->num_kv_heads == 0, MLA_ERR_INVALID_ARGUMENT,
      "args->num_kv_heads = %d must be >= 1 and divide num_heads = %d", a->num_kv_heads, a->num_heads);
  REQ(eb, FN, a->qk_dim >= 1 && a->qk_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
      "args->qk_dim = %d, expected 1..%d", a->qk_dim, MLA_MAX_HEAD_DIM);
  REQ(eb, FN, a->v_dim >= 1 && a->v_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
      "args->v_dim = %d, expected 1..%d", a->v_dim, MLA_MAX_HEAD_DIM);
  REQ(eb, FN, isfinite(a->scale) && a->scale > 0.0f, MLA_ERR_INVALID_ARGUMENT,
      "args->scale = %g, expected finite and > 0", (double)a->scale);
  REQ(eb, FN, isfinite(a->softcap) && a->softcap >= 0.0f, MLA_ERR_INVALID_ARGUMENT,
      "args->softcap = %g, expected finite and >= 0 (0 = off)", (double)a->softcap);
  REQ(eb, FN, a->causal == 0 || a->causal == 1, MLA_ERR_INVALID_ARGUMENT, "args->causal = %d, expected 0 or 1",
      a->causal);
  REQ(eb, FN, (a->flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_OUT_F32)) == 0, MLA_ERR_INVALID_ARGUMENT,
      "args->flags = 0x%x has unknown bits", a->flags);
  mla_status st = check_dtype(eb, FN, "args->act_dtype", a->act_dtype);
  if (st != MLA_OK) return st;
  /* The optional workspace (the dynamic order's counter): checked even for an
   * empty batch, so a bad one shows on the first call. */
  if (a->workspace) {
    REQ(eb, FN, a->workspace_bytes >= MLA_CUDA_RAGGED_WORKSPACE_BYTES, MLA_ERR_WORKSPACE_TOO_SMALL,
        "args->workspace_bytes = %zu, need %d (mla_attention_ragged_workspace_size)", a->workspace_bytes,
        MLA_CUDA_RAGGED_WORKSPACE_BYTES);
    REQ(eb, FN, ((uintptr_t)a->workspace & 3) == 0, MLA_ERR_INVALID_ARGUMENT,
        "args->workspace must be 4-byte aligned");
    if ((st = require_device(eb, FN, "args->workspace", a->workspace)) != MLA_OK) return st;
  }
  if (a->batch_size == 0) return MLA_OK;
  REQ(eb, FN, a->qo_indptr, MLA_ERR_INVALID_ARGUMENT, "args->qo_indptr is NULL");
  REQ(eb, FN, a->kv_indptr, MLA_ERR_INVALID_ARGUMENT, "args->kv_indptr is NULL");
  REQ(eb, FN, a->q, MLA_ERR_INVALID_ARGUMENT, "args->q is NULL");
  REQ(eb, FN, a->out, MLA_ERR_INVALID_ARGUMENT, "args->out is NULL");
  REQ(eb, FN, a->k, MLA_ERR_INVALID_ARGUMENT,
      "args->k is NULL (a CUDA context cannot see the key lengths: k and v are always required)");
  REQ(eb, FN, a->v, MLA_ERR_INVALID_ARGUMENT,
      "args->v is NULL (a CUDA context cannot see the key lengths: k and v are always required)");
  /* The sm_90a kernels where they apply, else the generic one. */
  const int fast = !mla_cuda_prefill_unsupported(a->qk_dim, a->v_dim, (int)a->act_dtype) &&
                   a->batch_size <= MLA_CUDA_PREFILL_MAX_BATCH;
  /* cp.async moves 16-byte pieces; out is written in 4 / 8-byte pairs. */
  REQ(eb, FN,
      ((uintptr_t)a->q & 15) == 0 && ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0 &&
          ((uintptr_t)a->out & 15) == 0 && ((uintptr_t)a->lse & 3) == 0 && ((uintptr_t)a->qo_indptr & 3) == 0 &&
          ((uintptr_t)a->kv_indptr & 3) == 0,
      MLA_ERR_UNSUPPORTED, "args->q, k, v and out must be 16-byte aligned for the CUDA kernels");
  if ((st = require_device(eb, FN, "args->qo_indptr", a->qo_indptr)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->kv_indptr", a->kv_indptr)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->q", a->q)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->k", a->k)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->v", a->v)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->out", a->out)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "args->lse", a->lse)) != MLA_OK) return st;

  mla_prefill_params p;
  memset(&p, 0, sizeof p);
  p.batch_size = a->batch_size;
  p.num_heads = a->num_heads;
  p.num_kv_heads = a->num_kv_heads;
  p.qk_dim = a->qk_dim;
  p.v_dim = a->v_dim;
  p.scale = a->scale;
  p.softcap = a->softcap;
  p.causal = a->causal;
  p.lse_base2 = (a->flags & MLA_FLAG_LSE_BASE2) != 0;
  p.out_f32 = (a->flags & MLA_FLAG_OUT_F32) != 0;
  p.act_dtype = (int)a->act_dtype;
  p.qo_indptr = a->qo_indptr;
  p.kv_indptr = a->kv_indptr;
  p.q = a->q;
  p.k = a->k;
  p.v = a->v;
  p.out = a->out;
  p.lse = a->lse;
  p.bad = ctx->d_bad;
  p.item_counter = (unsigned *)a->workspace;
  const int sms = ctx->sm_count > 0 ? ctx->sm_count : 132;
  const int e = fast ? mla_cuda_prefill_launch(&p, sms, ctx->stream)
                     : mla_cuda_prefill_generic_launch(&p, sms, ctx->stream);
  if (e) return mla_cuda_fail(eb, FN, "ragged MHA launch", e);
  return MLA_OK;
}

mla_status mla_cuda_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads, int head_dim,
                                 mla_dtype act_dtype, unsigned flags, const void *const *o_parts,
                                 const float *const *lse_parts, void *out, float *lse_out) {
  static const char *const FN = "mla_merge_states";
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  REQ(eb, FN, num_states >= 1, MLA_ERR_INVALID_ARGUMENT, "num_states = %d, expected >= 1", num_states);
  REQ(eb, FN, num_tokens >= 0, MLA_ERR_INVALID_ARGUMENT, "num_tokens = %d is negative", num_tokens);
  REQ(eb, FN, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
      "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  REQ(eb, FN, head_dim >= 1, MLA_ERR_INVALID_ARGUMENT, "head_dim = %d, expected >= 1", head_dim);
  mla_status st = check_dtype(eb, FN, "act_dtype", act_dtype);
  if (st != MLA_OK) return st;
  REQ(eb, FN, (flags & ~MLA_FLAG_LSE_BASE2) == 0, MLA_ERR_INVALID_ARGUMENT, "flags = 0x%x has unknown bits",
      flags);
  if (num_tokens == 0) return MLA_OK;
  /* The pointer arrays are host memory (they become kernel parameters); the
   * pointers in them are device memory. */
  REQ(eb, FN, o_parts, MLA_ERR_INVALID_ARGUMENT, "argument 'o_parts' is NULL");
  REQ(eb, FN, lse_parts, MLA_ERR_INVALID_ARGUMENT, "argument 'lse_parts' is NULL");
  REQ(eb, FN, out, MLA_ERR_INVALID_ARGUMENT, "argument 'out' is NULL");
  for (int k = 0; k < num_states; k++) {
    REQ(eb, FN, o_parts[k] != NULL, MLA_ERR_INVALID_ARGUMENT, "o_parts[%d] is NULL", k);
    REQ(eb, FN, lse_parts[k] != NULL, MLA_ERR_INVALID_ARGUMENT, "lse_parts[%d] is NULL", k);
  }
  if (num_states > MLA_CUDA_MERGE_PASS_STATES) {
    /* passes of MLA_CUDA_MERGE_PASS_STATES states, the running lse in lse_out;
     * the states out / lse_out alias all go into the first pass */
    REQ(eb, FN, lse_out != NULL, MLA_ERR_UNSUPPORTED,
        "num_states = %d: more than %d states on a CUDA context need lse_out (it holds the running lse "
        "between merge passes)", num_states, MLA_CUDA_MERGE_PASS_STATES);
    int aliased = 0;
    for (int k = 0; k < num_states; k++) aliased += o_parts[k] == out || lse_parts[k] == lse_out;
    REQ(eb, FN, aliased <= MLA_CUDA_MERGE_PASS_STATES, MLA_ERR_UNSUPPORTED,
        "%d states alias out or lse_out: at most %d can", aliased, MLA_CUDA_MERGE_PASS_STATES);
  }
  const size_t es = mla_dtype_size(act_dtype);
  for (int k = 0; k < num_states; k++) {
    REQ(eb, FN, ((uintptr_t)o_parts[k] % es) == 0 && ((uintptr_t)lse_parts[k] & 3) == 0,
        MLA_ERR_INVALID_ARGUMENT, "o_parts[%d] / lse_parts[%d] is not aligned to its element size", k, k);
    REQ(eb, FN, mla_cuda_is_device_ptr(o_parts[k]) && mla_cuda_is_device_ptr(lse_parts[k]),
        MLA_ERR_INVALID_ARGUMENT, "o_parts[%d] / lse_parts[%d] is host memory; a CUDA context takes device pointers",
        k, k);
  }
  if ((st = require_device(eb, FN, "out", out)) != MLA_OK) return st;
  if ((st = require_device(eb, FN, "lse_out", lse_out)) != MLA_OK) return st;
  const int e = mla_cuda_merge_launch(num_states, (int64_t)num_tokens * num_heads, head_dim, (int)act_dtype,
                                      (flags & MLA_FLAG_LSE_BASE2) != 0, o_parts, lse_parts, out, lse_out,
                                      ctx->stream);
  if (e) return mla_cuda_fail(eb, FN, "merge launch", e);
  return MLA_OK;
}
