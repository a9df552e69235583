/* mla_attention_absorbed for CUDA contexts: validates like the CPU path (same
 * statuses), uploads the host plan's arrays into the device workspace on the
 * context's stream and launches the sm_90a decode kernels (decode_sm90.cu).
 * mla_cuda_attention_meta (the device-built steps, and the backend's host
 * plans placed once per step by mla_cuda_attention_plan_place) shares the
 * checks and the launch, reading metadata already on the device.
 *
 * Scope: what mla_cuda_decode_unsupported() accepts (bf16 activations with a
 * bf16 or fp8 cache, f16 with f16; page sizes 1..256), 1..128 heads, q
 * pointers 16-byte aligned with strides that are multiples of 8 elements.
 * The kernels walk the plan's block table (page ids), the CPU path its
 * kv_indices: both are checked to name the same page at every page start.
 *
 * Any mode the planner builds runs here: decode and verify, and also the
 * paged absorbed prefill (EXTEND over a cached prefix, varlen DRAFT_EXTEND),
 * whose long query side the kernels cut into 64-row m-blocks; the split rule
 * gives such plans one part, so nothing is cut and no partials are kept.
 *
 * Device workspace: [qo_indptr bs+1][kv_lens bs][block_table bs x width]
 * [sched_meta parts x 8][num_splits bs+1][o_accum S x R x 512 f32]
 * [lse_accum S x R f32], R = max_q_len * num_heads, S =
 * mla_decode_partial_slots(parts) (decode.h: 0 for one part, and S x R <=
 * 2 x 64 x num_sm otherwise). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../cache/cache.h"
#include "../core/internal.h"
#include "attention.h"
#include "decode_sm90.h"
#include "runtime.h"

static const char *const FN = "mla_attention_absorbed";

#define REQ(EB, cond, st, ...)                        \
  do {                                                \
    if (!(cond)) return mla_fail((EB), (st), FN, __VA_ARGS__); \
  } while (0)

typedef struct dev_ws {
  int32_t *qo_indptr, *kv_lens, *block_table, *sched_meta, *num_splits;
  float *o_accum, *lse_accum;
} dev_ws;

/* Carves the layout above (count mode when w has no base). */
static void carve(mla_ws *w, const mla_plan *p, int H, dev_ws *d) {
  const size_t bs = (size_t)p->batch_size, rows = (size_t)p->max_q_len * (size_t)H;
  const size_t ts = (size_t)mla_decode_partial_slots(p->num_sm_parts);
  d->qo_indptr = mla_ws_take(w, sizeof(int32_t) * (bs + 1));
  d->kv_lens = mla_ws_take(w, sizeof(int32_t) * (bs ? bs : 1));
  d->block_table = mla_ws_take(w, sizeof(int32_t) * (bs * (size_t)p->block_table_width + 1));
  d->sched_meta = mla_ws_take(w, sizeof(int32_t) * ((size_t)p->num_sm_parts * MLA_SCHED_META_INTS + 1));
  d->num_splits = mla_ws_take(w, sizeof(int32_t) * (bs + 1));
  d->o_accum = ts ? mla_ws_take(w, sizeof(float) * ts * rows * MLA_LATENT) : NULL;
  d->lse_accum = ts ? mla_ws_take(w, sizeof(float) * ts * rows) : NULL;
}

static mla_status check_sizes(mla_errbuf *eb, const mla_plan *p) {
  REQ(eb, p->batch_size >= 0 && p->max_q_len >= 0 && p->block_table_width >= 0 && p->num_sm_parts >= 0 &&
              p->total_splits >= 0,
      MLA_ERR_INVALID_ARGUMENT,
      "plan: batch_size %d, max_q_len %d, block_table_width %d, num_sm_parts %d, total_splits %d: "
      "none may be negative",
      (int)p->batch_size, (int)p->max_q_len, (int)p->block_table_width, (int)p->num_sm_parts,
      (int)p->total_splits);
  return MLA_OK;
}

/* The size depends only on the plan (batch_size, block_table_width,
 * num_sm_parts, total_splits, max_q_len) and num_heads. */
mla_status mla_cuda_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                      int num_heads, size_t *bytes) {
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  REQ(eb, plan, MLA_ERR_INVALID_ARGUMENT, "plan is NULL");
  REQ(eb, bytes, MLA_ERR_INVALID_ARGUMENT, "bytes is NULL");
  REQ(eb, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
      "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  mla_status st = check_sizes(eb, plan);
  if (st != MLA_OK) return st;
  mla_ws w = mla_ws_counter();
  dev_ws d;
  carve(&w, plan, num_heads, &d);
  *bytes = mla_ws_total(&w);
  return MLA_OK;
}

/* The plan arrays the kernels read, checked for internal consistency and
 * against the cache (the CPU path's checks plus the block table and the
 * split schedule). */
static mla_status check_plan(mla_errbuf *eb, const mla_kv_cache *cache, const mla_plan *p) {
  mla_status st = check_sizes(eb, p);
  if (st != MLA_OK) return st;
  REQ(eb, p->qo_indptr && p->kv_indptr && p->kv_lens, MLA_ERR_INVALID_ARGUMENT,
      "plan->qo_indptr, kv_indptr and kv_lens must be non-NULL");
  REQ(eb, p->page_size == cache->page_size, MLA_ERR_INVALID_ARGUMENT,
      "plan->page_size = %d differs from the cache's page size %d", (int)p->page_size, cache->page_size);
  REQ(eb, p->causal == 0 || p->causal == 1, MLA_ERR_INVALID_ARGUMENT, "plan->causal = %d, expected 0 or 1",
      (int)p->causal);
  REQ(eb, p->qo_indptr[0] == 0 && p->kv_indptr[0] == 0, MLA_ERR_INVALID_ARGUMENT,
      "plan->qo_indptr[0] and kv_indptr[0] must be 0");
  for (int i = 0; i < p->batch_size; i++) {
    const int64_t q = (int64_t)p->qo_indptr[i + 1] - p->qo_indptr[i];
    const int64_t kv = (int64_t)p->kv_indptr[i + 1] - p->kv_indptr[i];
    REQ(eb, q >= 0 && q <= p->max_q_len, MLA_ERR_INVALID_ARGUMENT,
        "plan: request %d has %lld query rows, expected 0..max_q_len = %d", i, (long long)q,
        (int)p->max_q_len);
    REQ(eb, kv >= 0, MLA_ERR_INVALID_ARGUMENT, "plan->kv_indptr decreases at %d", i);
    REQ(eb, p->kv_lens[i] >= 0 && p->kv_lens[i] <= kv, MLA_ERR_INVALID_ARGUMENT,
        "plan->kv_lens[%d] = %d outside 0..%lld (its kv_indptr span)", i, (int)p->kv_lens[i], (long long)kv);
  }
  REQ(eb, p->qo_indptr[p->batch_size] == p->num_q_tokens, MLA_ERR_INVALID_ARGUMENT,
      "plan->qo_indptr[bs] = %d differs from num_q_tokens = %d", (int)p->qo_indptr[p->batch_size],
      (int)p->num_q_tokens);
  /* The kernels read the block table and the split schedule. */
  REQ(eb, p->block_table && p->sched_meta && p->num_splits, MLA_ERR_INVALID_ARGUMENT,
      "plan->block_table, sched_meta and num_splits must be non-NULL");
  REQ(eb, p->num_sm_parts >= 1, MLA_ERR_INVALID_ARGUMENT, "plan->num_sm_parts = %d, expected >= 1",
      (int)p->num_sm_parts);
  REQ(eb, p->num_splits[0] == 0 && p->num_splits[p->batch_size] == p->total_splits, MLA_ERR_INVALID_ARGUMENT,
      "plan->num_splits must start at 0 and end at total_splits = %d", (int)p->total_splits);
  const int P = p->page_size;
  for (int i = 0; i < p->batch_size; i++) {
    REQ(eb, p->num_splits[i + 1] >= p->num_splits[i], MLA_ERR_INVALID_ARGUMENT,
        "plan->num_splits decreases at %d", i);
    /* one part cuts nothing (the workspace then holds no partial states) */
    REQ(eb, p->num_sm_parts >= 2 || p->num_splits[i + 1] - p->num_splits[i] <= 1, MLA_ERR_INVALID_ARGUMENT,
        "plan: request %d is cut into %d pieces by a schedule of one part", i,
        (int)(p->num_splits[i + 1] - p->num_splits[i]));
    const int64_t pages = mla_cdiv(p->kv_lens[i], P);
    REQ(eb, pages <= p->block_table_width, MLA_ERR_INVALID_ARGUMENT,
        "plan: request %d needs %lld pages, block_table_width = %d", i, (long long)pages,
        (int)p->block_table_width);
    /* The kernels read pages, the CPU path kv_indices: both must name the
     * same slots. Checked at page starts (O(pages), not O(keys), on this
     * per-layer path; mla_plan_build derives both from one page list). */
    const int32_t *bt = p->block_table + (size_t)i * (size_t)p->block_table_width;
    const int32_t *idx = p->kv_indices ? p->kv_indices + p->kv_indptr[i] : NULL; /* NULL: pages-only plan */
    for (int64_t j = 0; j < pages; j++) {
      const int32_t pg = bt[j];
      REQ(eb, pg >= 0 && pg < cache->num_pages, MLA_ERR_OUT_OF_RANGE,
          "plan->block_table[%d][%lld] = %d, outside the cache's %d pages", i, (long long)j, (int)pg,
          cache->num_pages);
      REQ(eb, !idx || (int64_t)pg * P == idx[j * P], MLA_ERR_INVALID_ARGUMENT,
          "plan: key %lld of request %d is slot %d in kv_indices but page %d in the block table",
          (long long)(j * P), i, (int)idx[j * P], (int)pg);
    }
  }
  for (int k = 0; k < p->num_sm_parts; k++) {
    const int32_t *m = p->sched_meta + (size_t)k * MLA_SCHED_META_INTS;
    if (m[MLA_SCHED_NUM_REQS] == 0) continue;
    REQ(eb, m[MLA_SCHED_BEGIN_REQ] >= 0 && m[MLA_SCHED_BEGIN_REQ] <= m[MLA_SCHED_END_REQ] &&
                m[MLA_SCHED_END_REQ] < p->batch_size && m[MLA_SCHED_BEGIN_TOK] >= 0 &&
                m[MLA_SCHED_BEGIN_TOK] % MLA_SCHED_BLOCK == 0 && m[MLA_SCHED_BEGIN_SPLIT] >= 0,
        MLA_ERR_INVALID_ARGUMENT, "plan->sched_meta of part %d is inconsistent", k);
  }
  return MLA_OK;
}

static mla_status require_device(mla_errbuf *eb, const char *fn, const char *name, const void *p) {
  if (p && !mla_cuda_is_device_ptr(p))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "%s is host memory; a CUDA context takes device pointers",
                    name);
  return MLA_OK;
}

#undef REQ
#define REQ(EB, cond, st, ...)                        \
  do {                                                \
    if (!(cond)) return mla_fail((EB), (st), fn, __VA_ARGS__); \
  } while (0)

/* Everything about the cache, the layer and args that the kernels rely on
 * (the plan aside); fills the params fields they determine. */
static mla_status check_args(mla_errbuf *eb, const char *fn, const mla_kv_cache *cache, int layer,
                             const mla_absorbed_args *args, mla_decode_params *p) {
  REQ(eb, cache, MLA_ERR_INVALID_ARGUMENT, "cache is NULL");
  REQ(eb, args, MLA_ERR_INVALID_ARGUMENT, "args is NULL");
  REQ(eb, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE, "layer = %d, the cache has %d layers",
      layer, cache->num_layers);
  REQ(eb, cache->on_device, MLA_ERR_INVALID_ARGUMENT,
      "the cache lives on the host; a CUDA context needs a cache created on a CUDA context");
  const int H = args->num_heads;
  REQ(eb, H >= 1 && H <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT, "args->num_heads = %d, expected 1..%d", H,
      MLA_MAX_HEADS);
  REQ(eb, (int)args->act_dtype >= MLA_DTYPE_F32 && (int)args->act_dtype <= MLA_DTYPE_F64,
      MLA_ERR_INVALID_ARGUMENT, "args->act_dtype = %d is not an mla_dtype", (int)args->act_dtype);
  const char *why = mla_cuda_decode_unsupported((int)cache->dtype, (int)args->act_dtype, cache->page_size);
  REQ(eb, !why, MLA_ERR_UNSUPPORTED, "cache dtype %s, act_dtype %s, page size %d: %s",
      mla_dtype_name(cache->dtype), mla_dtype_name(args->act_dtype), cache->page_size, why);
  REQ(eb, isfinite(args->scale) && args->scale > 0.0f, MLA_ERR_INVALID_ARGUMENT,
      "args->scale = %g, expected finite and > 0", (double)args->scale);
  REQ(eb, (args->flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_FP8_MATH)) == 0, MLA_ERR_INVALID_ARGUMENT,
      "args->flags = 0x%x has unknown bits", args->flags);
  REQ(eb, args->q_stride_token >= 0 && args->q_stride_head >= 0, MLA_ERR_INVALID_ARGUMENT,
      "args->q_stride_token / q_stride_head are negative");
  REQ(eb, args->q_nope, MLA_ERR_INVALID_ARGUMENT, "args->q_nope is NULL");
  REQ(eb, args->q_rope, MLA_ERR_INVALID_ARGUMENT, "args->q_rope is NULL");
  REQ(eb, args->out, MLA_ERR_INVALID_ARGUMENT, "args->out is NULL");
  const int64_t nope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_LATENT;
  const int64_t nope_sh = args->q_stride_head ? args->q_stride_head : MLA_LATENT;
  const int64_t rope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_ROPE;
  const int64_t rope_sh = args->q_stride_head ? args->q_stride_head : MLA_ROPE;
  /* q rows are read in 16-byte pieces (cp.async), out in 4/8-byte pairs. */
  REQ(eb, ((uintptr_t)args->q_nope & 15) == 0 && ((uintptr_t)args->q_rope & 15) == 0, MLA_ERR_UNSUPPORTED,
      "args->q_nope / q_rope must be 16-byte aligned for the CUDA kernels");
  REQ(eb, nope_st % 8 == 0 && nope_sh % 8 == 0 && rope_st % 8 == 0 && rope_sh % 8 == 0, MLA_ERR_UNSUPPORTED,
      "args->q_stride_token / q_stride_head must be multiples of 8 elements for the CUDA kernels");
  REQ(eb, ((uintptr_t)args->out & 15) == 0 && ((uintptr_t)args->lse & 3) == 0, MLA_ERR_UNSUPPORTED,
      "args->out must be 16-byte and args->lse 4-byte aligned for the CUDA kernels");
  mla_status st;
  if ((st = require_device(eb, fn, "args->q_nope", args->q_nope)) != MLA_OK) return st;
  if ((st = require_device(eb, fn, "args->q_rope", args->q_rope)) != MLA_OK) return st;
  if ((st = require_device(eb, fn, "args->out", args->out)) != MLA_OK) return st;
  if ((st = require_device(eb, fn, "args->lse", args->lse)) != MLA_OK) return st;

  memset(p, 0, sizeof *p);
  p->num_heads = H;
  p->page_size = cache->page_size;
  p->num_pages = cache->num_pages;
  p->scale = args->scale;
  p->lse_base2 = (args->flags & MLA_FLAG_LSE_BASE2) != 0;
  /* A permission only: mla_cuda_decode takes the fp8 math kernel where it
   * pays (per-tensor fp8 cache, > 32 rows, TMA pages) and ignores it elsewhere. */
  p->fp8_math = (args->flags & MLA_FLAG_FP8_MATH) != 0;
  p->q_nope = (const uint16_t *)args->q_nope;
  p->q_rope = (const uint16_t *)args->q_rope;
  p->q_nope_stride_token = nope_st;
  p->q_nope_stride_head = nope_sh;
  p->q_rope_stride_token = rope_st;
  p->q_rope_stride_head = rope_sh;
  p->kv = cache->layers[layer];
  p->row_bytes = (int64_t)cache->row_bytes;
  p->kv_dtype = (int)cache->dtype;
  p->act_dtype = (int)args->act_dtype;
  p->kv_scale = cache->fp8_scales ? cache->fp8_scales[layer] : 1.0f;
  p->out = (uint16_t *)args->out;
  p->lse = args->lse;
  return MLA_OK;
}

/* The kernels over device metadata (uploaded from a host plan, or built by
 * a step); p holds what check_args filled in. */
static mla_status launch(mla_errbuf *eb, const char *fn, mla_decode_params *p, const mla_cuda_step_meta *m,
                         void *stream) {
  p->batch_size = m->batch_size;
  p->max_q_len = m->q_len;
  p->causal = m->causal;
  p->block_table_width = m->block_table_width;
  p->qo_indptr = m->qo_indptr;
  p->kv_lens = m->kv_lens;
  p->block_table = m->block_table;
  p->num_sm_parts = m->num_sm_parts;
  p->sched_meta = m->sched_meta;
  p->num_splits = m->num_splits;
  p->o_accum = m->o_accum;
  p->lse_accum = m->lse_accum;
  const int e = mla_cuda_decode(p, stream);
  if (e) return mla_cuda_fail(eb, fn, "decode kernel launch", e);
  return MLA_OK;
}

/* The plan checks of mla_attention_absorbed for a plan with queries, the
 * workspace's included, in that call's order; carves the workspace into *d. */
static mla_status place(mla_errbuf *eb, const char *fn, const mla_kv_cache *cache, const mla_plan *plan, int H,
                        void *workspace, size_t workspace_bytes, dev_ws *d) {
  mla_status st = check_plan(eb, cache, plan);
  if (st != MLA_OK) return st;
  /* The kernels' grid has one row of blocks per 64 (query token, head) rows
   * of the longest request, and CUDA caps a grid dimension at 65535. */
  REQ(eb, (int64_t)plan->max_q_len * H <= 65535LL * 64, MLA_ERR_UNSUPPORTED,
      "plan->max_q_len = %d with %d heads: the CUDA kernels take at most 4194240 (query token, head) rows "
      "per request (%d tokens at this head count); split the request's extend",
      (int)plan->max_q_len, H, (int)(65535LL * 64 / H));
  size_t need;
  {
    mla_ws w = mla_ws_counter();
    carve(&w, plan, H, d);
    need = mla_ws_total(&w);
  }
  REQ(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
      "workspace_bytes = %zu, need %zu (mla_attention_absorbed_workspace_size)", workspace_bytes, need);
  REQ(eb, workspace, MLA_ERR_INVALID_ARGUMENT, "workspace is NULL");
  if ((st = require_device(eb, fn, "workspace", workspace)) != MLA_OK) return st;
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  carve(&w, plan, H, d);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, fn, "workspace carve overflow");
  return MLA_OK;
}

static mla_cuda_step_meta meta_of(const mla_plan *plan, int H, const dev_ws *d) {
  const mla_cuda_step_meta m = {.batch_size = plan->batch_size,
                                .q_len = plan->max_q_len,
                                .causal = plan->causal,
                                .block_table_width = plan->block_table_width,
                                .num_sm_parts = plan->num_sm_parts,
                                .num_heads = H,
                                .qo_indptr = d->qo_indptr,
                                .kv_lens = d->kv_lens,
                                .block_table = d->block_table,
                                .sched_meta = d->sched_meta,
                                .num_splits = d->num_splits,
                                .o_accum = d->o_accum,
                                .lse_accum = d->lse_accum};
  return m;
}

mla_status mla_cuda_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                       const mla_plan *plan, const mla_absorbed_args *args,
                                       void *workspace, size_t workspace_bytes) {
  const char *const fn = FN;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  REQ(eb, plan, MLA_ERR_INVALID_ARGUMENT, "plan is NULL");
  mla_decode_params p;
  mla_status st = check_args(eb, FN, cache, layer, args, &p);
  if (st != MLA_OK) return st;
  const int H = args->num_heads;
  REQ(eb, plan->batch_size >= 0 && plan->num_q_tokens >= 0, MLA_ERR_INVALID_ARGUMENT,
      "plan->batch_size = %d / num_q_tokens = %d is negative", (int)plan->batch_size, (int)plan->num_q_tokens);
  if (plan->mode == MLA_MODE_IDLE || plan->batch_size == 0 || plan->num_q_tokens == 0)
    return MLA_OK; /* nothing to compute, nothing written */
  dev_ws d;
  if ((st = place(eb, FN, cache, plan, H, workspace, workspace_bytes, &d)) != MLA_OK) return st;
  const size_t bs = (size_t)plan->batch_size;
  void *stream = ctx->stream;
  /* Pageable host sources: each copy has read its source when it returns, so
   * the plan may change right after this call. (The device-built step,
   * mla_step_*, needs no upload at all, and the backend uploads its host
   * plans once per step: mla_cuda_attention_plan_place.) */
  int e = mla_cuda_memcpy_async(d.qo_indptr, plan->qo_indptr, sizeof(int32_t) * (bs + 1), stream);
  if (!e) e = mla_cuda_memcpy_async(d.kv_lens, plan->kv_lens, sizeof(int32_t) * bs, stream);
  if (!e && plan->block_table_width > 0)
    e = mla_cuda_memcpy_async(d.block_table, plan->block_table,
                              sizeof(int32_t) * bs * (size_t)plan->block_table_width, stream);
  if (!e)
    e = mla_cuda_memcpy_async(d.sched_meta, plan->sched_meta,
                              sizeof(int32_t) * (size_t)plan->num_sm_parts * MLA_SCHED_META_INTS, stream);
  if (!e) e = mla_cuda_memcpy_async(d.num_splits, plan->num_splits, sizeof(int32_t) * (bs + 1), stream);
  if (e) return mla_cuda_fail(eb, FN, "plan upload", e);
  const mla_cuda_step_meta m = meta_of(plan, H, &d);
  return launch(eb, FN, &p, &m, stream);
}

mla_status mla_cuda_attention_plan_place(mla_ctx *ctx, const char *fn, const mla_kv_cache *cache,
                                         const mla_plan *plan, int num_heads, void *workspace,
                                         size_t workspace_bytes, mla_cuda_plan_dst *dst, mla_cuda_step_meta *m) {
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  REQ(eb, cache && plan && dst && m, MLA_ERR_INVALID_ARGUMENT, "cache, plan, dst and m must be non-NULL");
  REQ(eb, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT, "num_heads = %d, expected 1..%d",
      num_heads, MLA_MAX_HEADS);
  REQ(eb, plan->mode != MLA_MODE_IDLE && plan->batch_size > 0 && plan->num_q_tokens > 0, MLA_ERR_INVALID_ARGUMENT,
      "plan has no queries (mode %d, batch_size %d, num_q_tokens %d): nothing to place", (int)plan->mode,
      (int)plan->batch_size, (int)plan->num_q_tokens);
  dev_ws d;
  mla_status st = place(eb, fn, cache, plan, num_heads, workspace, workspace_bytes, &d);
  if (st != MLA_OK) return st;
  dst->qo_indptr = d.qo_indptr;
  dst->kv_lens = d.kv_lens;
  dst->block_table = d.block_table;
  dst->sched_meta = d.sched_meta;
  dst->num_splits = d.num_splits;
  *m = meta_of(plan, num_heads, &d);
  return MLA_OK;
}

mla_status mla_cuda_attention_meta(mla_ctx *ctx, const char *fn, const mla_kv_cache *cache, int layer,
                                   const mla_absorbed_args *args, const mla_cuda_step_meta *m) {
  mla_errbuf *eb = &ctx->err;
  mla_decode_params p;
  mla_status st = check_args(eb, fn, cache, layer, args, &p);
  if (st != MLA_OK) return st;
  REQ(eb, m, MLA_ERR_INVALID_ARGUMENT, "no device metadata");
  REQ(eb, m->num_heads == 0 || args->num_heads == m->num_heads, MLA_ERR_INVALID_ARGUMENT,
      "args->num_heads = %d differs from the %d heads the metadata was built for", args->num_heads, m->num_heads);
  return launch(eb, fn, &p, m, ctx->stream);
}
