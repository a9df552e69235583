/* The state of one paged absorbed-attention test batch (a "decode world"),
 * shared by the decode, prefill and flag tests: lengths, the CPU cache and
 * request table (and the GPU copy of the cache), the host plan, q in its
 * activation dtype and the float64 oracle's inputs and outputs. Each test
 * chooses its own lengths, dtypes, seeds and tolerances; the building blocks
 * (paged_world.h) fill the rows and q. With MLA_TEST_CUDA also the device
 * buffers of one run (tu_dbufs). */
#ifndef MLA_TEST_DECODE_WORLD_H
#define MLA_TEST_DECODE_WORLD_H

#include <stdint.h>

#include "mla.h"
#include "paged_world.h"
#include "test_util.h"

#define TU_DW_MAXB 64 /* requests per batch at most */

typedef struct tu_dworld {
  mla_mode mode;
  mla_dtype kv, act;    /* cache dtype, activation dtype */
  float kv_scale;       /* FP8_E4M3 layer scale */
  float scale;          /* softmax scale the call passes */
  double p_unit;        /* unit roundoff of P for pbound: 2^-8 (bf16) or 2^-11 (f16) */
  int ndt, P, H, bs;    /* draft tokens / fixed window, page size, heads, batch size */
  int maxkv;            /* longest request: the table's row width */
  unsigned plan_flags;  /* mla_plan_limits.flags of tu_dworld_plan (e.g. MLA_PLAN_PAGES_ONLY) */
  mla_kv_cache *cache;  /* CPU */
  mla_kv_cache *dcache; /* GPU, the same bytes (NULL in CPU tests) */
  mla_req_table *rt;
  int32_t req_ids[TU_DW_MAXB], seq[TU_DW_MAXB], ext[TU_DW_MAXB], pre[TU_DW_MAXB];
  int q_len[TU_DW_MAXB], kv_len[TU_DW_MAXB];
  int64_t Tq, Tk; /* sums of q_len, kv_len */
  void *pws;      /* the plan's workspace */
  mla_plan plan;
  void *qn, *qr;       /* act dtype [Tq, H, 512], [Tq, H, 64] */
  double *qn_d, *qr_d; /* the same as float64 */
  double *c_d, *r_d;   /* [Tk, 512], [Tk, 64]: the rows as the oracle reads them */
  double *o_ref, *lse_ref; /* [Tq, H, 512], [Tq, H] */
  double *pbound;          /* [Tq, H, 512]: p_unit sum_j p_j |c_j| per element */
} tu_dworld;

/* From kv_len[] and q_len[]: Tq, Tk, maxkv (at least 1). Returns the pages
 * the requests need plus 2 + npad (the padding requests' and spare pages). */
int tu_dworld_totals(tu_dworld *w, int npad);

/* The CPU cache (dtype kv; kv_scale when FP8_E4M3) of `pages` pages, its
 * copy on gpu (when gpu is not NULL) and a request table of bs + npad
 * requests x maxkv rows on cpu; the cache's rows poisoned (NaN). Returns 0,
 * or -1 after a failed check. */
int tu_dworld_create(tu_dworld *w, mla_ctx *cpu, mla_ctx *gpu, int pages, int npad);

/* The host plan of the batch on ctx: mode, bs, req_ids, seq; EXTEND takes
 * prefix_lens = pre, DRAFT_EXTEND with ndt = 0 extend_lens = ext, every
 * other non-DECODE mode ndt draft tokens. Limits {bs, Tq + 1, Tk + 1, maxkv,
 * P, num_sm, plan_flags}, the workspace in pws. Returns 0, or -1 after a
 * failed check. */
int tu_dworld_plan(tu_dworld *w, mla_ctx *ctx, int num_sm);

/* o_ref, lse_ref: ref_absorbed over the whole batch at softmax scale
 * (double)w->scale, causal as the plan says; with_pbound: also pbound with
 * unit p_unit (rows without a visible key: 0). After tu_dworld_totals. */
void tu_dworld_oracle(tu_dworld *w, int with_pbound);

/* Arguments of one absorbed call: heads, scale, act dtype from w; the
 * pointers given (host or device); flags 0, strides packed. */
mla_absorbed_args tu_dworld_args(const tu_dworld *w, const void *qn, const void *qr, void *out, float *lse);

/* Destroys and frees everything w holds (NULL members are fine). */
void tu_dworld_free(tu_dworld *w);

#ifdef MLA_TEST_CUDA
#include <string.h>

#include "cuda_util.h"

/* Device buffers of one run: q (2-byte act dtype) copied from w, out and lse
 * with `guard` poisoned bytes after them, the attention workspace on gpu. */
typedef struct tu_dbufs {
  void *qn, *qr, *o, *ws;
  float *lse;
  size_t o_bytes, lse_bytes, ws_bytes, guard;
} tu_dbufs;

/* Outputs and their guards to 0xFF (poison). */
static inline void tu_dbufs_poison(tu_dbufs *d) {
  CK(cudaMemset(d->o, 0xFF, d->o_bytes + d->guard));
  CK(cudaMemset(d->lse, 0xFF, d->lse_bytes + d->guard));
  CK(cudaDeviceSynchronize()); /* the library's stream may be a non-blocking one */
}

/* Allocates and poisons the buffers (tu_dbufs_poison). */
static inline tu_dbufs tu_dbufs_new(const tu_dworld *w, mla_ctx *gpu, size_t guard) {
  tu_dbufs d;
  const int64_t nq = w->Tq * w->H;
  d.guard = guard;
  d.qn = tu_dev_copy(w->qn, 2 * (size_t)nq * MLA_LATENT);
  d.qr = tu_dev_copy(w->qr, 2 * (size_t)nq * MLA_ROPE);
  d.o_bytes = 2 * (size_t)nq * MLA_LATENT;
  d.lse_bytes = sizeof(float) * (size_t)nq;
  d.o = tu_dev_alloc(d.o_bytes + guard);
  d.lse = tu_dev_alloc(d.lse_bytes + guard);
  d.ws_bytes = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w->plan, w->H, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  tu_dbufs_poison(&d);
  return d;
}

static inline void tu_dbufs_free(tu_dbufs *d) {
  cudaFree(d->qn);
  cudaFree(d->qr);
  cudaFree(d->o);
  cudaFree(d->lse);
  cudaFree(d->ws);
}
#endif

#endif
