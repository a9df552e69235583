/* mla_step_*: decode-type steps whose metadata is built where the kernels run
 * (include/mla.h, "Device-built steps"). The per-row and schedule arithmetic
 * is step_build.h's, shared with the CUDA kernels (src/cuda/step.cu).
 *
 * Workspace layout (device memory on a CUDA context):
 *   [qo_indptr bs+1][kv_lens bs][block_table bs x W][sched_meta parts x 8]
 *   [num_splits bs+1]
 *   CUDA: [o_accum S x R x 512 f32][lse_accum S x R f32] (none when S = 0)
 *         [sched_probe MLA_STEP_SCHED_PROBES x 3 i32]
 *   CPU:  [kv_indptr bs+1][kv_indices bs x max_kv_len][CPU attention scratch]
 * with W = ceil(max_kv_len / P), R = q_len * H and S the kernels' partial
 * slots, 2 per part (../cuda/decode.h). */
#include <stdlib.h>
#include <string.h>

#include "../cache/cache.h"
#include "../core/internal.h"
#include "../cpu/cpu.h"
#include "../cuda/decode.h" /* plain C: the partial-slot rule of the CUDA kernels */
#include "plan.h"
#include "step_build.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/attention.h"
#include "../cuda/runtime.h"
#include "../cuda/step.h"
#endif

/* Largest step batch (the CUDA schedule kernel stages the lengths in shared
 * memory); the same bound on both devices so a shape valid on one is on both. */
#define STEP_MAX_BS 8192
#define STEP_MAX_WINDOW 64
#define STEP_MAX_DRAFT_STEPS 16
#define STEP_MAX_TOKENS 65536

typedef struct step_layout {
  int32_t *qo_indptr, *kv_lens, *block_table, *sched_meta, *num_splits;
  float *o_accum, *lse_accum;              /* CUDA */
  int32_t *sched_probe;                    /* CUDA: the schedule's answers per candidate budget */
  int32_t *kv_indptr, *kv_indices;         /* CPU */
  void *cpu_ws;                            /* CPU attention scratch */
  size_t cpu_ws_bytes;
} step_layout;

static int log2_of(int x) {
  int s = 0;
  while ((1 << s) < x) s++;
  return s;
}

void mla_step_sched_rule(int32_t *piece_cost, int32_t *unit) {
  *piece_cost = MLA_SCHED_FIXED_OVERHEAD;
  *unit = MLA_SCHED_BLOCK;
#ifdef MLA_DEV_SCHED_OV /* (dev timing only: another piece cost / block for the step's schedule, not the plan's) */
  const char *ov_env = getenv("MLA_DEV_SCHED_OV"), *unit_env = getenv("MLA_DEV_SCHED_UNIT");
  if (ov_env && atoi(ov_env) >= 1 && atoi(ov_env) <= 64) *piece_cost = atoi(ov_env);
  if (unit_env && (atoi(unit_env) == 64 || atoi(unit_env) == 128)) *unit = atoi(unit_env);
#endif
}

/* Checks desc and resolves the step's fixed shape (num_pages left 0). */
static mla_status step_geom(mla_ctx *ctx, const char *fn, const mla_step_desc *d, mla_step_geom *g) {
  mla_errbuf *eb = &ctx->err;
  if (!d) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc is NULL");
  if (d->mode != MLA_MODE_DECODE && d->mode != MLA_MODE_TARGET_VERIFY && d->mode != MLA_MODE_DRAFT_EXTEND &&
      d->mode != MLA_MODE_EXTEND)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "desc->mode = %d: a step is DECODE, TARGET_VERIFY, DRAFT_EXTEND (fixed window) or EXTEND",
                    (int)d->mode);
  const int extend = d->mode == MLA_MODE_EXTEND;
  if (extend && (d->num_tokens < 1 || d->num_tokens > STEP_MAX_TOKENS))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_tokens = %d, expected 1..%d for EXTEND",
                    (int)d->num_tokens, STEP_MAX_TOKENS);
  if (!extend && d->num_tokens != 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_tokens = %d, expected 0 outside EXTEND",
                    (int)d->num_tokens);
  if (d->batch_size < 1 || d->batch_size > STEP_MAX_BS)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->batch_size = %d, expected 1..%d",
                    (int)d->batch_size, STEP_MAX_BS);
  if ((d->mode == MLA_MODE_DECODE || extend) && d->num_draft_tokens != 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_draft_tokens = %d, expected 0 for %s",
                    (int)d->num_draft_tokens, extend ? "EXTEND" : "DECODE");
  if (d->mode != MLA_MODE_DECODE && !extend && (d->num_draft_tokens < 1 || d->num_draft_tokens > STEP_MAX_WINDOW))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_draft_tokens = %d, expected 1..%d",
                    (int)d->num_draft_tokens, STEP_MAX_WINDOW);
  if (d->max_kv_len < 1 || d->max_kv_len > (1 << 30))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->max_kv_len = %d, expected 1..2^30",
                    (int)d->max_kv_len);
  if (d->num_heads < 1 || d->num_heads > MLA_MAX_HEADS)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_heads = %d, expected 1..%d",
                    (int)d->num_heads, MLA_MAX_HEADS);
  if (!mla_is_pow2(d->page_size) || d->page_size > 256)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->page_size = %d, expected a power of two 1..256",
                    (int)d->page_size);
  /* Bounded so the schedule (parts x 8 ints) fits the CUDA kernel's shared memory. */
  if (d->num_sm < 0 || d->num_sm > 1024)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_sm = %d, expected 0..1024", (int)d->num_sm);
  if (d->num_steps < 0 || d->num_steps > STEP_MAX_DRAFT_STEPS)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_steps = %d, expected 0..%d", (int)d->num_steps,
                    STEP_MAX_DRAFT_STEPS);
  if (d->num_steps > 0 && d->mode != MLA_MODE_DECODE)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->num_steps = %d needs mode DECODE (draft steps)",
                    (int)d->num_steps);
  if (d->step < 0 || d->step >= (d->num_steps > 0 ? d->num_steps : 1))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->step = %d, expected 0..%d", (int)d->step,
                    (d->num_steps > 0 ? d->num_steps : 1) - 1);
  if (d->dcp_world < 0 || d->dcp_world > 64 || (d->dcp_world > 0 && !mla_is_pow2(d->dcp_world)) ||
      d->dcp_rank < 0 || d->dcp_rank >= (d->dcp_world > 0 ? d->dcp_world : 1))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "desc->dcp_world = %d, dcp_rank = %d: expected world 0 or a power of two 1..64, rank 0..world-1",
                    (int)d->dcp_world, (int)d->dcp_rank);
  if ((int64_t)d->page_size * (d->dcp_world > 0 ? d->dcp_world : 1) > 256 * 64)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "desc->page_size x dcp_world too large");
  /* Every field is well-formed from here on: what follows is UNSUPPORTED
   * (a valid descriptor this library does not run), so a descriptor that
   * is both bad and unsupported reports INVALID_ARGUMENT. */
  if (d->dcp_world > 1 && d->mode != MLA_MODE_DECODE)
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn,
                    "desc->dcp_world = %d with mode %d: context-parallel steps are DECODE (a shard's keys are "
                    "not a contiguous causal window)",
                    (int)d->dcp_world, (int)d->mode);
  /* One grid row of CUDA blocks per 64 (query token, head) rows of the
   * longest request, at most 65535 of them; the same bound on both devices. */
  if (extend && (int64_t)d->num_tokens * d->num_heads > 65535LL * 64)
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn,
                    "desc->num_tokens = %d with %d heads: an EXTEND step takes at most 4194240 (token, head) rows",
                    (int)d->num_tokens, (int)d->num_heads);
  memset(g, 0, sizeof *g);
  g->mode = (int32_t)d->mode;
  g->batch_size = d->batch_size;
  g->q_len = d->mode == MLA_MODE_DECODE ? 1 : d->mode == MLA_MODE_EXTEND ? d->num_tokens : d->num_draft_tokens;
  g->varlen = d->mode == MLA_MODE_EXTEND;
  g->num_tokens = d->num_tokens;
  g->kv_extra = d->mode == MLA_MODE_TARGET_VERIFY ? d->num_draft_tokens : 0;
  g->max_kv_len = d->max_kv_len;
  const int world = d->dcp_world > 0 ? d->dcp_world : 1;
  g->page_shift = log2_of(d->page_size);
  g->gpage_shift = g->page_shift + log2_of(world);
  g->dcp_world = world;
  g->dcp_rank = d->dcp_rank;
  g->width = (int32_t)mla_cdiv(mla_cdiv(d->max_kv_len, world), d->page_size);
  int num_sm = d->num_sm;
  if (num_sm == 0) num_sm = ctx->device == MLA_DEVICE_CUDA ? ctx->sm_count : mla_ctx_workers(ctx);
  g->num_parts = mla_sched_num_parts(num_sm < 1 ? 1 : num_sm, g->q_len, d->num_heads);
  g->nocut_div = mla_sb_nocut_div(d->mode);
  mla_step_sched_rule(&g->sched_ov, &g->sched_unit);
  g->max_splits = g->batch_size + g->num_parts;
  return MLA_OK;
}

/* Carves the layout above (count mode when w has no base). */
static mla_status carve(mla_ctx *ctx, const mla_step_geom *g, int H, mla_ws *w, step_layout *L) {
  const size_t bs = (size_t)g->batch_size;
  memset(L, 0, sizeof *L);
  L->qo_indptr = mla_ws_take(w, sizeof(int32_t) * (bs + 1));
  L->kv_lens = mla_ws_take(w, sizeof(int32_t) * bs);
  L->block_table = mla_ws_take(w, sizeof(int32_t) * bs * (size_t)g->width);
  L->sched_meta = mla_ws_take(w, sizeof(int32_t) * (size_t)g->num_parts * MLA_SCHED_META_INTS);
  L->num_splits = mla_ws_take(w, sizeof(int32_t) * (bs + 1));
  const size_t rows = (size_t)g->q_len * (size_t)H;
  if (ctx->device == MLA_DEVICE_CUDA) {
    /* partial states by slot, 2 per part (none for one part): decode.h */
    const size_t slots = (size_t)mla_decode_partial_slots(g->num_parts);
    L->o_accum = slots ? mla_ws_take(w, sizeof(float) * slots * rows * MLA_LATENT) : NULL;
    L->lse_accum = slots ? mla_ws_take(w, sizeof(float) * slots * rows) : NULL;
    L->sched_probe = mla_ws_take(w, sizeof(int32_t) * 3 * MLA_STEP_SCHED_PROBES);
    return MLA_OK;
  }
  L->kv_indptr = mla_ws_take(w, sizeof(int32_t) * (bs + 1));
  L->kv_indices = mla_ws_take(w, sizeof(int32_t) * bs * (size_t)g->max_kv_len);
  mla_plan shape;
  memset(&shape, 0, sizeof shape);
  shape.max_q_len = g->q_len;
  mla_status st = mla_cpu_attention_absorbed_workspace_size(ctx, &shape, H, &L->cpu_ws_bytes);
  if (st != MLA_OK) return st;
  L->cpu_ws = mla_ws_take(w, L->cpu_ws_bytes);
  return MLA_OK;
}

/* Steps a workspace holds: num_steps draft steps, or one. */
static int steps_of(const mla_step_desc *d) { return d->num_steps > 0 ? d->num_steps : 1; }

/* The layout of step `step` (carving the steps before it first). */
static mla_status carve_step(mla_ctx *ctx, const mla_step_geom *g, int H, int step, mla_ws *w, step_layout *L) {
  mla_status st = MLA_OK;
  for (int k = 0; k <= step && st == MLA_OK; k++) st = carve(ctx, g, H, w, L);
  return st;
}

static mla_status layout_of_step(mla_ctx *ctx, const char *fn, const mla_step_desc *desc, int step,
                                 void *workspace, size_t workspace_bytes, mla_step_geom *g, step_layout *L) {
  mla_status st = step_geom(ctx, fn, desc, g);
  if (st != MLA_OK) return st;
  mla_ws cw = mla_ws_counter();
  if ((st = carve_step(ctx, g, desc->num_heads, steps_of(desc) - 1, &cw, L)) != MLA_OK) return st;
  const size_t need = mla_ws_total(&cw);
  if (workspace_bytes < need)
    return mla_fail(&ctx->err, MLA_ERR_WORKSPACE_TOO_SMALL, fn,
                    "workspace_bytes = %zu, need %zu (mla_step_workspace_size)", workspace_bytes, need);
  if (!workspace) return mla_fail(&ctx->err, MLA_ERR_INVALID_ARGUMENT, fn, "workspace is NULL");
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA && !mla_cuda_is_device_ptr(workspace))
    return mla_fail(&ctx->err, MLA_ERR_INVALID_ARGUMENT, fn,
                    "workspace is host memory; a CUDA context takes a device workspace");
#endif
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  if ((st = carve_step(ctx, g, desc->num_heads, step, &w, L)) != MLA_OK) return st;
  if (w.overflow) return mla_fail(&ctx->err, MLA_ERR_INTERNAL, fn, "workspace carve overflow");
  return MLA_OK;
}

/* The step desc->step addresses. */
static mla_status layout_of(mla_ctx *ctx, const char *fn, const mla_step_desc *desc, void *workspace,
                            size_t workspace_bytes, mla_step_geom *g, step_layout *L) {
  if (!desc) return mla_fail(&ctx->err, MLA_ERR_INVALID_ARGUMENT, fn, "desc is NULL");
  return layout_of_step(ctx, fn, desc, desc->step, workspace, workspace_bytes, g, L);
}

mla_status mla_step_workspace_size(mla_ctx *ctx, const mla_step_desc *desc, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_clear_error(&ctx->err);
  MLA_REQUIRE_PTR(&ctx->err, bytes);
  mla_step_geom g;
  mla_status st = step_geom(ctx, __func__, desc, &g);
  if (st != MLA_OK) return st;
  mla_ws w = mla_ws_counter();
  step_layout L;
  if ((st = carve_step(ctx, &g, desc->num_heads, steps_of(desc) - 1, &w, &L)) != MLA_OK) return st;
  *bytes = mla_ws_total(&w);
  return MLA_OK;
}

/* CPU: validate every row first (nothing written on error), then build. */
static mla_status prepare_cpu(mla_ctx *ctx, const mla_step_geom *g, const mla_step_inputs *in,
                              const step_layout *L) {
  const int bs = g->batch_size, P = 1 << g->page_shift;
  int64_t q_total = 0;
  for (int i = 0; i < bs; i++) {
    const int32_t kv = mla_step_row_kv(g, in->req_ids[i], in->seq_lens[i]);
    if (kv < 0)
      return mla_fail(&ctx->err, MLA_ERR_OUT_OF_RANGE, "mla_step_prepare",
                      "row %d: req_ids = %d, seq_lens = %d outside max_reqs = %d / desc->max_kv_len = %d", i,
                      (int)in->req_ids[i], (int)in->seq_lens[i], (int)g->max_reqs, (int)g->max_kv_len);
    const int32_t q = mla_step_row_q(g, g->varlen ? in->extend_lens[i] : 0, kv);
    if (q < 0)
      return mla_fail(&ctx->err, MLA_ERR_OUT_OF_RANGE, "mla_step_prepare",
                      "row %d: extend_lens = %d outside 0..seq_lens = %d", i, (int)in->extend_lens[i], (int)kv);
    q_total += q;
    const int32_t np = (int32_t)mla_cdiv(kv, P);
    for (int32_t j = 0; j < np; j++)
      if (mla_step_page(g, in->req_to_token, in->req_ids[i], kv, j) == -2)
        return mla_fail(&ctx->err, MLA_ERR_OUT_OF_RANGE, "mla_step_prepare",
                        "row %d (request %d): position %lld holds a slot that does not start a page of the "
                        "cache's %lld",
                        i, (int)in->req_ids[i], (long long)j * P, (long long)g->num_pages);
  }
  if (g->varlen && q_total > g->num_tokens)
    return mla_fail(&ctx->err, MLA_ERR_OUT_OF_RANGE, "mla_step_prepare",
                    "the extend lens add up to %lld query tokens, more than desc->num_tokens = %d",
                    (long long)q_total, (int)g->num_tokens);
  if (!L) return MLA_OK; /* validation only */
  L->qo_indptr[0] = 0;
  L->kv_indptr[0] = 0;
  for (int i = 0; i < bs; i++) {
    const int32_t rid = in->req_ids[i];
    const int32_t kv = mla_step_row_kv(g, rid, in->seq_lens[i]);
    int32_t *bt = L->block_table + (size_t)i * (size_t)g->width;
    for (int32_t j = 0; j < g->width; j++) bt[j] = mla_step_page(g, in->req_to_token, rid, kv, j);
    /* Keys as the GPU reads them: page bt[j / P], offset j % P. */
    int32_t *idx = L->kv_indices + L->kv_indptr[i];
    for (int32_t j = 0; j < kv; j++) idx[j] = bt[j >> g->page_shift] * P + (j & (P - 1));
    L->kv_lens[i] = kv;
    L->qo_indptr[i + 1] = g->varlen ? L->qo_indptr[i] + in->extend_lens[i] : (i + 1) * g->q_len;
    L->kv_indptr[i + 1] = L->kv_indptr[i] + kv;
  }
  if (mla_split_schedule_body(L->kv_lens, bs, g->num_parts, g->sched_ov, g->sched_unit, g->nocut_div, L->sched_meta,
                              L->num_splits) != 0)
    return mla_fail(&ctx->err, MLA_ERR_INTERNAL, "mla_step_prepare", "split schedule did not cover the batch");
  return MLA_OK;
}

mla_status mla_step_prepare(mla_ctx *ctx, const mla_step_desc *desc, const mla_kv_cache *cache,
                            const mla_step_inputs *in, void *workspace, size_t workspace_bytes) {
  static const char *const fn = "mla_step_prepare";
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, cache);
  MLA_REQUIRE_PTR(eb, in);
  mla_step_geom g;
  step_layout L;
  mla_status st = layout_of(ctx, fn, desc, workspace, workspace_bytes, &g, &L);
  if (st != MLA_OK) return st;
  MLA_REQUIRE(eb, cache->on_device == (ctx->device == MLA_DEVICE_CUDA), MLA_ERR_INVALID_ARGUMENT,
              "the cache was created on a %s context, this context is %s", cache->on_device ? "CUDA" : "CPU",
              ctx->device == MLA_DEVICE_CUDA ? "CUDA" : "CPU");
  MLA_REQUIRE(eb, cache->page_size == desc->page_size, MLA_ERR_INVALID_ARGUMENT,
              "desc->page_size = %d differs from the cache's page size %d", (int)desc->page_size,
              cache->page_size);
  MLA_REQUIRE(eb, in->req_to_token && in->req_ids && in->seq_lens, MLA_ERR_INVALID_ARGUMENT,
              "in->req_to_token, req_ids and seq_lens must be non-NULL");
  MLA_REQUIRE(eb, desc->mode != MLA_MODE_EXTEND || in->extend_lens, MLA_ERR_INVALID_ARGUMENT,
              "in->extend_lens is NULL: an EXTEND step needs each row's query count");
  MLA_REQUIRE(eb, in->max_reqs >= 1, MLA_ERR_INVALID_ARGUMENT, "in->max_reqs = %d, expected >= 1",
              (int)in->max_reqs);
  MLA_REQUIRE(eb, in->req_to_token_stride >= desc->max_kv_len, MLA_ERR_INVALID_ARGUMENT,
              "in->req_to_token_stride = %lld is less than desc->max_kv_len = %d",
              (long long)in->req_to_token_stride, (int)desc->max_kv_len);
  g.max_reqs = in->max_reqs;
  g.stride = in->req_to_token_stride;
  g.num_pages = cache->num_pages;
  const int draft = desc->num_steps > 0;
#ifdef MLA_WITH_CUDA
  if (ctx->device == MLA_DEVICE_CUDA)
    MLA_REQUIRE(eb, mla_cuda_is_device_ptr(in->req_to_token) && mla_cuda_is_device_ptr(in->req_ids) &&
                        mla_cuda_is_device_ptr(in->seq_lens) &&
                        (desc->mode != MLA_MODE_EXTEND || mla_cuda_is_device_ptr(in->extend_lens)),
                MLA_ERR_INVALID_ARGUMENT,
                "in->req_to_token, req_ids, seq_lens (and extend_lens) must be device memory on a CUDA context");
#endif
  /* CPU: check every step before writing any (draft step i reads i + 1
   * more positions than step 0). */
  if (ctx->device != MLA_DEVICE_CUDA && draft) {
    mla_step_geom last = g;
    last.kv_extra = desc->num_steps;
    if ((st = prepare_cpu(ctx, &last, in, NULL)) != MLA_OK) return st;
  }
  for (int k = 0; k < steps_of(desc); k++) {
    mla_step_geom gk;
    if ((st = layout_of_step(ctx, fn, desc, k, workspace, workspace_bytes, &gk, &L)) != MLA_OK) return st;
    gk = g;
    if (draft) gk.kv_extra = k + 1;
    if (ctx->device != MLA_DEVICE_CUDA) {
      if ((st = prepare_cpu(ctx, &gk, in, &L)) != MLA_OK) return st;
      continue;
    }
#ifdef MLA_WITH_CUDA
    const int e = mla_cuda_step_build(&gk, in->req_to_token, in->req_ids, in->seq_lens,
                                      gk.varlen ? in->extend_lens : NULL, L.qo_indptr, L.kv_lens,
                                      L.block_table, L.sched_meta, L.num_splits, L.sched_probe, ctx->d_bad,
                                      ctx->stream);
    if (e) return mla_cuda_fail(eb, fn, "step metadata kernels", e);
#else
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "built without CUDA");
#endif
  }
  return MLA_OK;
}

mla_status mla_step_attention(mla_ctx *ctx, const mla_step_desc *desc, const mla_kv_cache *cache, int layer,
                              const mla_absorbed_args *args, void *workspace, size_t workspace_bytes) {
  static const char *const fn = "mla_step_attention";
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, args);
  mla_step_geom g;
  step_layout L;
  mla_status st = layout_of(ctx, fn, desc, workspace, workspace_bytes, &g, &L);
  if (st != MLA_OK) return st;
  MLA_REQUIRE(eb, args->num_heads == desc->num_heads, MLA_ERR_INVALID_ARGUMENT,
              "args->num_heads = %d differs from desc->num_heads = %d (the workspace was sized for it)",
              args->num_heads, (int)desc->num_heads);
  /* Checked here for every step, also one without queries (an EXTEND batch
   * whose extend lens are all 0), so a call's validity never depends on
   * what the device-built metadata holds. */
  MLA_REQUIRE(eb, args->q_nope && args->q_rope && args->out, MLA_ERR_INVALID_ARGUMENT,
              "args->q_nope, q_rope and out must be non-NULL");
  MLA_REQUIRE(eb, mla_is_act_dtype(args->act_dtype), MLA_ERR_INVALID_ARGUMENT,
              "args->act_dtype = %d is not an activation dtype (f32, bf16, f16)", (int)args->act_dtype);
  if (ctx->device == MLA_DEVICE_CUDA) {
#ifdef MLA_WITH_CUDA
    MLA_REQUIRE_PTR(eb, cache);
    MLA_REQUIRE(eb, cache->page_size == desc->page_size, MLA_ERR_INVALID_ARGUMENT,
                "desc->page_size = %d differs from the cache's page size %d", (int)desc->page_size,
                cache->page_size);
    mla_cuda_step_meta m;
    m.batch_size = g.batch_size;
    m.q_len = g.q_len;
    m.causal = g.mode != MLA_MODE_DECODE;
    m.block_table_width = g.width;
    m.num_sm_parts = g.num_parts;
    m.num_heads = desc->num_heads;
    m.qo_indptr = L.qo_indptr;
    m.kv_lens = L.kv_lens;
    m.block_table = L.block_table;
    m.sched_meta = L.sched_meta;
    m.num_splits = L.num_splits;
    m.o_accum = L.o_accum;
    m.lse_accum = L.lse_accum;
    return mla_cuda_attention_meta(ctx, fn, cache, layer, args, &m);
#else
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "built without CUDA");
#endif
  }
  /* CPU: the prepared arrays as an mla_plan (kv_indices follow the block
   * table, as on the GPU). */
  mla_plan p;
  memset(&p, 0, sizeof p);
  p.mode = (mla_mode)g.mode;
  p.batch_size = g.batch_size;
  p.num_q_tokens = L.qo_indptr[g.batch_size];
  p.num_kv_tokens = L.kv_indptr[g.batch_size];
  p.max_q_len = g.q_len;
  for (int i = 0; i < g.batch_size; i++)
    if (L.kv_lens[i] > p.max_kv_len) p.max_kv_len = L.kv_lens[i];
  p.causal = g.mode != MLA_MODE_DECODE;
  p.page_size = desc->page_size;
  p.block_table_width = g.width;
  p.num_heads = desc->num_heads;
  p.qo_indptr = L.qo_indptr;
  p.kv_indptr = L.kv_indptr;
  p.kv_lens = L.kv_lens;
  p.kv_indices = L.kv_indices;
  p.block_table = L.block_table;
  p.num_sm_parts = g.num_parts;
  p.sched_meta = L.sched_meta;
  p.num_splits = L.num_splits;
  p.total_splits = L.num_splits[g.batch_size];
  return mla_cpu_attention_absorbed(ctx, cache, layer, &p, args, L.cpu_ws, L.cpu_ws_bytes);
}

mla_status mla_step_get_metadata(mla_ctx *ctx, const mla_step_desc *desc, void *workspace, size_t workspace_bytes,
                                 mla_step_metadata *out) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_clear_error(&ctx->err);
  MLA_REQUIRE_PTR(&ctx->err, out);
  mla_step_geom g;
  step_layout L;
  mla_status st = layout_of(ctx, __func__, desc, workspace, workspace_bytes, &g, &L);
  if (st != MLA_OK) return st;
  memset(out, 0, sizeof *out);
  out->batch_size = g.batch_size;
  out->q_len = g.q_len;
  out->block_table_width = g.width;
  out->num_sm_parts = g.num_parts;
  out->max_splits = g.max_splits;
  out->qo_indptr = L.qo_indptr;
  out->kv_lens = L.kv_lens;
  out->block_table = L.block_table;
  out->sched_meta = L.sched_meta;
  out->num_splits = L.num_splits;
  return MLA_OK;
}
