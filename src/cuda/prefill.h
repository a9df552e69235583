/* CUDA prefill path: ragged (varlen) MHA and the merge of partial states.
 * Plain C (included by the C host code and by prefill_sm90.cu).
 *
 *  - mla_cuda_attention_ragged / mla_cuda_merge_states (ragged.c): the
 *    public calls for CUDA contexts (dispatched from src/backend/dispatch.c);
 *    validate like the CPU path, then launch.
 *  - mla_cuda_prefill_launch / mla_cuda_merge_launch (prefill_sm90.cu): the
 *    kernels behind them. */
#ifndef MLA_CUDA_PREFILL_H
#define MLA_CUDA_PREFILL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Requests a launch can take: each CTA keeps a prefix table of the
 * requests' m-block counts in shared memory (prefill_sm90.cu). */
#define MLA_CUDA_PREFILL_MAX_BATCH 4096
/* The optional workspace of mla_attention_ragged: the dynamic item order's
 * counter (4 bytes; 16 leave room without changing the reported size). */
#define MLA_CUDA_RAGGED_WORKSPACE_BYTES 16
/* States one merge pass takes: their pointers travel as kernel parameters
 * (CUDA 12.1's 32 764-byte parameter space; 16 B a state). More states are
 * merged in passes, the running result held in out and lse_out. */
#define MLA_CUDA_MERGE_PASS_STATES 2032

/* One ragged MHA launch. Every pointer is device memory. Request i owns query
 * rows [qo_indptr[i], qo_indptr[i+1]) and key rows [kv_indptr[i],
 * kv_indptr[i+1]); the host never reads the index arrays (a request whose
 * lengths are negative is skipped and counted into *bad). */
typedef struct mla_prefill_params {
  int batch_size;            /* 1..MLA_CUDA_PREFILL_MAX_BATCH */
  int num_heads, num_kv_heads; /* num_kv_heads divides num_heads */
  int qk_dim, v_dim;         /* 192/128 or 128/128 (the generic kernel: 1..256 each) */
  float scale;               /* softmax scale */
  float softcap;             /* 0 = off */
  int causal;                /* bottom-right */
  int lse_base2;             /* lse as log2 of the denominator */
  int out_f32;               /* out is fp32 (else act dtype) */
  int act_dtype;             /* mla_dtype: BF16 or F16 (the generic kernel: also F32) */
  const int32_t *qo_indptr;  /* [bs+1] */
  const int32_t *kv_indptr;  /* [bs+1] */
  const void *q;             /* [Tq, H, qk_dim] */
  const void *k;             /* [Tk, Hkv, qk_dim] */
  const void *v;             /* [Tk, Hkv, v_dim] */
  void *out;                 /* [Tq, H, v_dim] */
  float *lse;                /* [Tq, H] or NULL */
  int *bad;                  /* device counter of skipped requests */
  int head_group;            /* set by the launcher: heads per group of the item order */
  int order_snake;           /* set by the launcher: odd rounds of items run backwards (default) */
  unsigned *item_counter;    /* device word no other launch uses meanwhile: items handed out as CTAs
                                ask (the launcher zeroes it on the stream first); NULL: static order */
} mla_prefill_params;

/* NULL when the kernels take these dims and dtype, else what they take. */
const char *mla_cuda_prefill_unsupported(int qk_dim, int v_dim, int act_dtype);
/* Launch on `stream` (cudaStream_t) with `grid` persistent CTAs (the SM
 * count). Returns 0 or a CUDA error code; asynchronous. */
int mla_cuda_prefill_launch(const mla_prefill_params *p, int grid, void *stream);

/* The generic ragged kernel (ragged_generic.cu): any qk_dim / v_dim up to
 * MLA_MAX_HEAD_DIM, f32 / bf16 / f16 activations, any batch size; plain CUDA,
 * slow. Used for what mla_cuda_prefill_unsupported refuses and for batches
 * over MLA_CUDA_PREFILL_MAX_BATCH. Returns 0 or a CUDA error code;
 * asynchronous. */
int mla_cuda_prefill_generic_launch(const mla_prefill_params *p, int sm_count, void *stream);

/* Merge of n >= 1 partial states, rows = T * H of dim values each; device
 * pointers; out may be o_parts[k], lse_out may be lse_parts[k] (any k) or
 * NULL. n > MLA_CUDA_MERGE_PASS_STATES runs in passes and needs lse_out (the
 * running lse between passes; cudaErrorInvalidValue without it); out is
 * rounded to its dtype once per pass. */
int mla_cuda_merge_launch(int n, int64_t rows, int dim, int act_dtype, int base2,
                          const void *const *o_parts, const float *const *lse_parts, void *out,
                          float *lse_out, void *stream);

#ifndef __CUDACC__
#include "mla.h"
/* The public calls for CUDA contexts (ragged.c). */
mla_status mla_cuda_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args);
mla_status mla_cuda_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads,
                                 int head_dim, mla_dtype act_dtype, unsigned flags,
                                 const void *const *o_parts, const float *const *lse_parts,
                                 void *out, float *lse_out);
#endif

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_PREFILL_H */
