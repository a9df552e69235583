/* The backend: one object owning the KV cache, the request table, the plan
 * and every workspace, serving all forward modes of DESIGN §3.
 *
 * Flow per forward step: the engine extends its requests in the request
 * table (those slots are this step's out_cache_loc), calls
 * mla_backend_plan() once, then mla_backend_forward() per layer, which writes
 * this step's latent rows into the cache and runs attention. All buffers are
 * sized at creation from the descriptor's limits, so steps do not allocate. */
#include <stdlib.h>

#include "../cache/cache.h"
#include "../core/internal.h"
#include "../plan/plan.h"
#include "mirror.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/attention.h"
#include "../cuda/runtime.h"
#endif

#define MLA_DEFAULT_CHUNK_CAPACITY 1024

struct mla_backend_s {
  mla_ctx *ctx;
  mla_backend_desc desc;
  mla_kv_cache *cache;
  mla_req_table *rt;
  mla_plan_limits lim;

  void *plan_ws;
  size_t plan_ws_bytes;
  mla_plan plan;
  int planned;
  int has_prefix; /* EXTEND batch with a non-zero prefix */

  void *attn_ws;
  size_t attn_ws_bytes;
#ifdef MLA_WITH_CUDA
  /* CUDA host plans run by absorbed attention (the paged absorbed prefill,
   * varlen DRAFT_EXTEND): uploaded once per plan into attn_ws, then every
   * layer launches from plan_meta (place_cuda_plan). */
  int plan_on_device;
  mla_cuda_step_meta plan_meta;
  int32_t *plan_img;          /* host image of the uploaded arrays, grown to the largest plan seen */
  size_t plan_img_bytes;
#endif

  /* Chunked-prefix MHA (only when extend_impl == MLA_EXTEND_MHA_CHUNKED). */
  void *chunk_ws;
  size_t chunk_ws_bytes;
  mla_chunk_plan chunks;
  float *chunk_c, *chunk_r; /* [cap, 512], [cap, 64] dequantized latent rows (fp32: exact) */
  void *chunk_k, *chunk_v;  /* [cap, H, nope+64], [cap, H, v_dim] act dtype, as engines expand */
  float *acc_o, *part_o;    /* [max_q_tokens, H, v_dim] running and per-chunk states, fp32 */
  float *part_lse;          /* [max_q_tokens, H] */
  float *main_lse;          /* [max_q_tokens, H] when the caller wants none */

  /* Device-built steps (mla_step_*): every decode-type step on a CUDA
   * context, and graph steps on any context. */
  int on_cuda;
  mla_mirror mirror;          /* CUDA: device copy of the request table */
  int step_active;            /* the current plan is a step: forward runs mla_step_attention */
  mla_step_desc step;
  void *step_ws;              /* eager steps (device memory on CUDA), grown on demand */
  size_t step_ws_bytes;
  int32_t *stage_scratch;     /* [2 * max_bs] ids then seq_lens, staged together */
  int32_t *d_qo;              /* CUDA EXTEND through MHA: qo_indptr [max_bs+1] (device) */
  void *d_ragged_ws;          /* CUDA: the ragged MHA calls' workspace (their item counter; the
                                 backend's calls run in stream order, so one serves them all) */
  size_t ragged_ws_bytes;
  int32_t *d_chunk_slots;     /* CUDA chunked prefix: the chunk plan's slots [max_bs * max_context] */
  int32_t *d_chunk_cu;        /* and its cu_seq_lens [(max_context+1) * (max_bs+1)] */
  /* Graph steps (mla_backend_graph_*): fixed buffers. */
  int graph_max_bs, graph_max_ndt;
  int32_t *g_ids, *g_seq;     /* [graph_max_bs] device (CUDA) or host (CPU) */
  void *g_ws;
  size_t g_ws_bytes;
  int graph_step;             /* the active step uses g_ws (1), d_ws (2: draft steps) or e_ws (3: EXTEND) */
  /* EXTEND graph steps (mla_backend_graph_init_extend). */
  int graph_max_tokens;
  int32_t *g_ext;             /* [graph_max_bs] extend lens */
  void *e_ws;
  size_t e_ws_bytes;
  /* Multi-step draft (mla_backend_draft_*): one workspace for every step. */
  int draft_max_steps;
  void *d_ws;
  size_t d_ws_bytes;

  mla_errbuf err;
};

/* Copy the failing sub-call's message (kept in the ctx, cache or table) into
 * the backend's own error slot. */
static mla_status forward_fail(mla_backend *be, mla_status st, const char *what, const char *detail) {
  return mla_fail(&be->err, st, what, "%s", detail && detail[0] ? detail : mla_status_string(st));
}

static void dev_free(const mla_backend *be, void *p) {
  if (!p) return;
#ifdef MLA_WITH_CUDA
  if (be->on_cuda) {
    mla_cuda_free(p);
    return;
  }
#endif
  (void)be;
  free(p);
}

/* Workspace memory of the backend's device (CUDA or host). */
static void *dev_alloc(const mla_backend *be, size_t bytes) {
#ifdef MLA_WITH_CUDA
  if (be->on_cuda) {
    void *p = NULL;
    return mla_cuda_malloc(&p, bytes ? bytes : 16) ? NULL : p;
  }
#endif
  (void)be;
  return malloc(bytes ? bytes : 16);
}

void mla_backend_destroy(mla_backend *be) {
  if (!be) return;
  if (be->on_cuda) {
#ifdef MLA_WITH_CUDA
    mla_cuda_stream_sync(be->ctx->stream); /* nothing in flight may still read what is freed */
#endif
    mla_mirror_free(&be->mirror);
  }
  dev_free(be, be->step_ws);
  dev_free(be, be->g_ws);
  dev_free(be, be->d_ws);
  dev_free(be, be->g_ids);
  dev_free(be, be->g_seq);
  dev_free(be, be->g_ext);
  dev_free(be, be->e_ws);
  free(be->stage_scratch);
  mla_req_table_destroy(be->rt);
  mla_kv_cache_destroy(be->cache);
  free(be->plan_ws);
  if (be->on_cuda) dev_free(be, be->attn_ws);
  else free(be->attn_ws); /* host: grown by realloc (size_attention_workspace) */
#ifdef MLA_WITH_CUDA
  free(be->plan_img);
#endif
  free(be->chunk_ws);
  dev_free(be, be->chunk_c);
  dev_free(be, be->chunk_r);
  dev_free(be, be->chunk_k);
  dev_free(be, be->chunk_v);
  dev_free(be, be->acc_o);
  dev_free(be, be->part_o);
  dev_free(be, be->part_lse);
  dev_free(be, be->main_lse);
  dev_free(be, be->d_qo);
  dev_free(be, be->d_ragged_ws);
  dev_free(be, be->d_chunk_slots);
  dev_free(be, be->d_chunk_cu);
  free(be);
}

const char *mla_backend_last_error(const mla_backend *be) {
  return be ? be->err.msg : "mla_backend_last_error: backend is NULL";
}

/* Attention workspace for the largest plan the limits allow. */
static mla_status size_attention_workspace(mla_backend *be, const mla_plan *plan) {
  size_t need = 0;
  mla_status st = mla_attention_absorbed_workspace_size(be->ctx, plan, be->desc.num_heads, &need);
  if (st != MLA_OK) return forward_fail(be, st, "mla_backend", mla_ctx_last_error(be->ctx));
  if (need <= be->attn_ws_bytes) return MLA_OK;
  void *p = realloc(be->attn_ws, need);
  if (!p) return mla_fail(&be->err, MLA_ERR_OUT_OF_MEMORY, "mla_backend", "workspace of %zu bytes", need);
  be->attn_ws = p;
  be->attn_ws_bytes = need;
  return MLA_OK;
}

static void *alloc_or_null(size_t bytes) { return bytes ? malloc(bytes) : NULL; }

/* The query lengths 1..max_q at which a workspace sized by query length can
 * peak: its partial states follow the split rule (mla_sched_num_parts: the
 * wider the query side, the fewer the parts, and one part keeps none), so
 * once a length gives one part only the widest, max_q, can still be larger
 * (its per-row arrays). Iterate as for (q = 1; q <= max_q; q = next_q(...)). */
static int next_q(const mla_backend *be, int q, int max_q) {
  if (q < max_q && mla_sched_num_parts(be->desc.num_sm, q, be->desc.num_heads) < 2) return max_q;
  return q + 1;
}

/* CUDA: the device workspace of mla_attention_absorbed over host plans (the
 * paged absorbed prefill: EXTEND over a prefix, varlen DRAFT_EXTEND), sized
 * once for every plan the limits allow: the largest over the query lengths
 * (next_q). */
static mla_status size_cuda_attention_workspace(mla_backend *be) {
  const mla_backend_desc *d = &be->desc;
  mla_plan shape;
  memset(&shape, 0, sizeof shape);
  shape.mode = MLA_MODE_EXTEND;
  shape.batch_size = d->max_bs;
  shape.page_size = d->cache.page_size;
  shape.block_table_width = (int32_t)mla_cdiv(d->max_context, d->cache.page_size);
  shape.num_heads = d->num_heads;
  size_t need = 0;
  for (int q = 1; q <= d->max_q_tokens; q = next_q(be, q, d->max_q_tokens)) {
    shape.max_q_len = q;
    shape.num_sm_parts = mla_sched_num_parts(d->num_sm, q, d->num_heads);
    shape.total_splits = d->max_bs + shape.num_sm_parts;
    size_t n = 0;
    mla_status st = mla_attention_absorbed_workspace_size(be->ctx, &shape, d->num_heads, &n);
    if (st != MLA_OK) return forward_fail(be, st, "mla_backend_create", mla_ctx_last_error(be->ctx));
    if (n > need) need = n;
  }
  be->attn_ws = dev_alloc(be, need);
  if (!be->attn_ws)
    return mla_fail(&be->err, MLA_ERR_OUT_OF_MEMORY, "mla_backend_create",
                    "device attention workspace of %zu bytes", need);
  be->attn_ws_bytes = need;
  return MLA_OK;
}

mla_status mla_backend_create(mla_ctx *ctx, const mla_backend_desc *desc, mla_backend **out) {
  if (!out) return ctx ? mla_fail(&ctx->err, MLA_ERR_INVALID_ARGUMENT, __func__, "argument 'out' is NULL")
                       : MLA_ERR_INVALID_ARGUMENT;
  *out = NULL;
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  MLA_REQUIRE_PTR(eb, desc);
  const int on_cuda = ctx->device == MLA_DEVICE_CUDA;
  mla_backend_desc d = *desc;
  if (d.qk_nope_dim == 0) d.qk_nope_dim = 128;
  if (d.v_dim == 0) d.v_dim = 128;
  if (d.chunk_capacity == 0) d.chunk_capacity = MLA_DEFAULT_CHUNK_CAPACITY;
  if (d.num_sm == 0) d.num_sm = on_cuda ? ctx->sm_count : mla_ctx_workers(ctx);
  MLA_REQUIRE(eb, d.max_bs >= 1, MLA_ERR_INVALID_ARGUMENT, "max_bs = %d, expected >= 1", d.max_bs);
  MLA_REQUIRE(eb, d.max_q_tokens >= 1, MLA_ERR_INVALID_ARGUMENT, "max_q_tokens = %d, expected >= 1",
              d.max_q_tokens);
  MLA_REQUIRE(eb, d.max_context >= 1, MLA_ERR_INVALID_ARGUMENT, "max_context = %d, expected >= 1",
              d.max_context);
  MLA_REQUIRE(eb, d.num_heads >= 1 && d.num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "num_heads = %d, expected 1..%d", d.num_heads, MLA_MAX_HEADS);
  MLA_REQUIRE(eb, isfinite(d.scale) && d.scale > 0, MLA_ERR_INVALID_ARGUMENT,
              "scale = %g, expected finite > 0", (double)d.scale);
  MLA_REQUIRE(eb, mla_is_act_dtype(d.act_dtype), MLA_ERR_UNSUPPORTED,
              "act_dtype = %s, expected f32, bf16 or f16", mla_dtype_name(d.act_dtype));
  MLA_REQUIRE(eb, d.qk_nope_dim >= 1 && d.qk_nope_dim + MLA_ROPE <= MLA_MAX_HEAD_DIM,
              MLA_ERR_INVALID_ARGUMENT, "qk_nope_dim = %d, expected 1..%d", d.qk_nope_dim,
              MLA_MAX_HEAD_DIM - MLA_ROPE);
  MLA_REQUIRE(eb, d.v_dim >= 1 && d.v_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
              "v_dim = %d, expected 1..%d", d.v_dim, MLA_MAX_HEAD_DIM);
  MLA_REQUIRE(eb, d.extend_impl == MLA_EXTEND_ABSORBED || d.extend_impl == MLA_EXTEND_MHA_CHUNKED,
              MLA_ERR_INVALID_ARGUMENT, "extend_impl = %d", (int)d.extend_impl);
  MLA_REQUIRE(eb, d.chunk_capacity >= 1, MLA_ERR_INVALID_ARGUMENT, "chunk_capacity = %d, expected >= 1",
              d.chunk_capacity);
  MLA_REQUIRE(eb, d.num_sm >= 1, MLA_ERR_INVALID_ARGUMENT, "num_sm = %d, expected >= 0", d.num_sm);
  int64_t max_kv = (int64_t)d.max_bs * d.max_context;
  MLA_REQUIRE(eb, max_kv <= INT32_MAX && (int64_t)d.max_q_tokens * d.num_heads * MLA_LATENT <= INT32_MAX * 8LL,
              MLA_ERR_INVALID_ARGUMENT, "max_bs * max_context = %lld exceeds int32 indexing",
              (long long)max_kv);

  mla_backend *be = calloc(1, sizeof *be);
  if (!be) return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "backend struct");
  be->ctx = ctx;
  be->desc = d;
  be->on_cuda = on_cuda;
  mla_status st = mla_kv_cache_create(ctx, &d.cache, &be->cache);
  if (st != MLA_OK) {
    mla_backend_destroy(be);
    return st; /* the cache recorded its message in ctx */
  }
  be->desc.cache.fp8_scales = be->cache->fp8_scales;
  mla_req_table_desc rd = {d.max_reqs, d.max_context, d.cache.num_pages, d.cache.page_size};
  st = mla_req_table_create(ctx, &rd, be->cache, &be->rt);
  if (st != MLA_OK) {
    mla_backend_destroy(be);
    return st;
  }

  /* CUDA kernels read the block table, never token-level kv_indices: plan
   * pages only there (O(pages) host work instead of O(keys)). */
  mla_plan_limits lim = {d.max_bs,  d.max_q_tokens, (int)max_kv, d.max_context, d.cache.page_size, d.num_sm,
                         on_cuda ? MLA_PLAN_PAGES_ONLY : 0u};
  be->lim = lim;
  st = mla_plan_workspace_size(ctx, &lim, &be->plan_ws_bytes);
  if (st == MLA_OK && !(be->plan_ws = malloc(be->plan_ws_bytes))) st = MLA_ERR_OUT_OF_MEMORY;
  if (st == MLA_OK && !(be->stage_scratch = malloc(sizeof(int32_t) * 2 * (size_t)d.max_bs)))
    st = mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "staging scratch");
  if (st == MLA_OK && on_cuda) st = mla_mirror_init(&be->mirror, be->rt, eb);
  if (st == MLA_OK && on_cuda && !(be->d_qo = dev_alloc(be, sizeof(int32_t) * ((size_t)d.max_bs + 1))))
    st = mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "device qo_indptr");
  if (st == MLA_OK && on_cuda) st = mla_attention_ragged_workspace_size(ctx, &be->ragged_ws_bytes);
  if (st == MLA_OK && be->ragged_ws_bytes && !(be->d_ragged_ws = dev_alloc(be, be->ragged_ws_bytes)))
    st = mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "ragged workspace");
  if (st == MLA_OK && on_cuda) st = size_cuda_attention_workspace(be);
  if (st == MLA_OK && !on_cuda) {
    /* The largest plan the limits allow sizes the attention workspace. */
    mla_plan worst;
    memset(&worst, 0, sizeof worst);
    worst.mode = MLA_MODE_EXTEND;
    worst.batch_size = d.max_bs;
    worst.num_q_tokens = d.max_q_tokens;
    worst.num_kv_tokens = (int32_t)max_kv;
    worst.max_q_len = d.max_q_tokens;
    worst.max_kv_len = d.max_context;
    worst.causal = 1;
    worst.page_size = d.cache.page_size;
    worst.num_heads = d.num_heads;
    st = size_attention_workspace(be, &worst);
  }
  if (st == MLA_OK && d.extend_impl == MLA_EXTEND_MHA_CHUNKED) {
    int cap = d.chunk_capacity;
    size_t es = mla_dtype_size(d.act_dtype), H = (size_t)d.num_heads;
    size_t dqk = (size_t)d.qk_nope_dim + MLA_ROPE, dv = (size_t)d.v_dim;
    st = mla_chunk_plan_workspace_size(ctx, d.max_bs, (int)max_kv, cap, &be->chunk_ws_bytes);
    if (st == MLA_OK) {
      /* Latent rows: fp32 on the CPU (dequantized fp8 stays exact); in the
       * activation dtype on the GPU, where cuBLAS multiplies one dtype. */
      const size_t les = on_cuda ? es : sizeof(float);
      be->chunk_ws = alloc_or_null(be->chunk_ws_bytes);
      be->chunk_c = dev_alloc(be, (size_t)cap * MLA_LATENT * les);
      be->chunk_r = dev_alloc(be, (size_t)cap * MLA_ROPE * les);
      be->chunk_k = dev_alloc(be, (size_t)cap * H * dqk * es);
      be->chunk_v = dev_alloc(be, (size_t)cap * H * dv * es);
      be->acc_o = dev_alloc(be, (size_t)d.max_q_tokens * H * dv * sizeof(float));
      be->part_o = dev_alloc(be, (size_t)d.max_q_tokens * H * dv * sizeof(float));
      be->part_lse = dev_alloc(be, (size_t)d.max_q_tokens * H * sizeof(float));
      be->main_lse = dev_alloc(be, (size_t)d.max_q_tokens * H * sizeof(float));
      if (on_cuda) {
        be->d_chunk_slots = dev_alloc(be, sizeof(int32_t) * (size_t)max_kv);
        be->d_chunk_cu = dev_alloc(be, sizeof(int32_t) * ((size_t)d.max_context + 1) * ((size_t)d.max_bs + 1));
      }
      if (!be->chunk_ws || !be->chunk_c || !be->chunk_r || !be->chunk_k || !be->chunk_v ||
          !be->acc_o || !be->part_o || !be->part_lse || !be->main_lse ||
          (on_cuda && (!be->d_chunk_slots || !be->d_chunk_cu)))
        st = mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "chunked-prefix buffers (chunk_capacity %d)", cap);
    }
  }
  if (st != MLA_OK) {
    if (be->err.msg[0]) mla_fail(eb, st, __func__, "%s", be->err.msg);
    mla_backend_destroy(be);
    return st;
  }
  *out = be;
  return MLA_OK;
}

mla_status mla_backend_cache(mla_backend *be, mla_kv_cache **cache) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&be->err, cache);
  *cache = be->cache;
  return MLA_OK;
}

mla_status mla_backend_req_table(mla_backend *be, mla_req_table **rt) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&be->err, rt);
  *rt = be->rt;
  return MLA_OK;
}

/* A decode-type batch every row of which has the same query count: the
 * modes a device-built step (mla_step_*) covers. */
static int is_step_mode(const mla_batch *b) {
  return b->mode == MLA_MODE_DECODE || b->mode == MLA_MODE_TARGET_VERIFY ||
         (b->mode == MLA_MODE_DRAFT_EXTEND && !b->extend_lens);
}

static mla_step_desc step_desc_of(const mla_backend *be, mla_mode mode, int bs, int ndt) {
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = mode;
  d.batch_size = bs;
  d.num_draft_tokens = mode == MLA_MODE_DECODE ? 0 : ndt;
  d.max_kv_len = be->desc.max_context;
  d.num_heads = be->desc.num_heads;
  d.page_size = be->desc.cache.page_size;
  d.num_sm = be->desc.num_sm;
  return d;
}

/* Host checks of a step batch (what mla_plan_build checks for these modes,
 * without building host metadata). */
static mla_status check_step_batch(mla_backend *be, const mla_batch *b) {
  const char *fn = "mla_backend_plan";
  mla_errbuf *eb = &be->err;
  const int ndt = b->mode == MLA_MODE_DECODE ? 1 : b->num_draft_tokens;
  MLA_PLAN_REQUIRE(eb, fn, b->batch_size >= 1 && b->batch_size <= be->desc.max_bs, MLA_ERR_CAPACITY,
                   "batch_size = %d, the backend takes 1..max_bs = %d", (int)b->batch_size, be->desc.max_bs);
  MLA_PLAN_REQUIRE(eb, fn, b->req_ids && b->seq_lens, MLA_ERR_INVALID_ARGUMENT, "req_ids / seq_lens is NULL");
  MLA_PLAN_REQUIRE(eb, fn, b->mode == MLA_MODE_DECODE || (ndt >= 1 && ndt <= 64), MLA_ERR_INVALID_ARGUMENT,
                   "num_draft_tokens = %d, expected 1..64", (int)b->num_draft_tokens);
  MLA_PLAN_REQUIRE(eb, fn, (int64_t)b->batch_size * ndt <= be->desc.max_q_tokens, MLA_ERR_CAPACITY,
                   "batch has %lld query tokens, max_q_tokens = %d", (long long)b->batch_size * ndt,
                   be->desc.max_q_tokens);
  const int extra = b->mode == MLA_MODE_TARGET_VERIFY ? b->num_draft_tokens : 0;
  for (int i = 0; i < b->batch_size; i++) {
    MLA_PLAN_REQUIRE(eb, fn, b->seq_lens[i] >= 0, MLA_ERR_INVALID_ARGUMENT, "seq_lens[%d] = %d", i,
                     (int)b->seq_lens[i]);
    const int64_t k = (int64_t)b->seq_lens[i] + extra;
    MLA_PLAN_REQUIRE(eb, fn, k <= be->desc.max_context, MLA_ERR_CAPACITY,
                     "request %d has %lld keys, max_context = %d", i, (long long)k, be->desc.max_context);
    if (b->req_ids[i] == MLA_REQ_PAD) continue;
    mla_status st = mla_plan_check_req(eb, fn, be->rt, "req_ids", i, b->req_ids[i], k);
    if (st != MLA_OK) return st;
  }
  return MLA_OK;
}

/* Plan a step on the CUDA backend: sync the table mirror, stage the ids and
 * lengths, build the metadata on the device. */
static mla_status plan_cuda_step(mla_backend *be, const mla_batch *b) {
  mla_status st = check_step_batch(be, b);
  if (st != MLA_OK) return st;
  const int bs = b->batch_size;
  mla_step_desc d = step_desc_of(be, b->mode, bs, b->num_draft_tokens);
  size_t need = 0;
  st = mla_step_workspace_size(be->ctx, &d, &need);
  if (st != MLA_OK) return forward_fail(be, st, "mla_backend_plan", mla_ctx_last_error(be->ctx));
  if (need > be->step_ws_bytes) {
    /* Grows to the largest step seen (a freed buffer may still be read by
     * enqueued work: wait for it first). */
#ifdef MLA_WITH_CUDA
    int e = mla_cuda_stream_sync(be->ctx->stream);
    if (e) return mla_cuda_fail(&be->err, "mla_backend_plan", "stream", e);
#endif
    dev_free(be, be->step_ws);
    be->step_ws_bytes = 0;
    if (!(be->step_ws = dev_alloc(be, need)))
      return mla_fail(&be->err, MLA_ERR_OUT_OF_MEMORY, "mla_backend_plan", "step workspace of %zu bytes", need);
    be->step_ws_bytes = need;
  }
  st = mla_mirror_sync(&be->mirror, be->rt, be->ctx->stream, &be->err);
  if (st != MLA_OK) return st;
  memcpy(be->stage_scratch, b->req_ids, sizeof(int32_t) * (size_t)bs);
  memcpy(be->stage_scratch + bs, b->seq_lens, sizeof(int32_t) * (size_t)bs);
  const int32_t *staged = NULL;
  st = mla_mirror_stage(&be->mirror, be->stage_scratch, 2 * bs, be->ctx->stream, &staged, &be->err);
  if (st != MLA_OK) return st;
  mla_step_inputs in = {be->mirror.d_r2t, be->desc.max_context, be->desc.max_reqs, staged, staged + bs, NULL};
  st = mla_step_prepare(be->ctx, &d, be->cache, &in, be->step_ws, be->step_ws_bytes);
  if (st != MLA_OK) return forward_fail(be, st, "mla_backend_plan", mla_ctx_last_error(be->ctx));
  be->step = d;
  be->step_active = 1;
  be->graph_step = 0;
  return MLA_OK;
}

/* The query-row view of a step that forward needs (rows, mode). */
static void plan_from_step(mla_backend *be, const mla_step_desc *d) {
  memset(&be->plan, 0, sizeof be->plan);
  const int ext = d->mode == MLA_MODE_EXTEND;
  const int q = d->mode == MLA_MODE_DECODE ? 1 : ext ? d->num_tokens : d->num_draft_tokens;
  be->plan.mode = d->mode;
  be->plan.batch_size = d->batch_size;
  be->plan.num_q_tokens = ext ? d->num_tokens : d->batch_size * q; /* EXTEND: the bucket's rows */
  be->plan.max_q_len = q;
  be->plan.causal = d->mode != MLA_MODE_DECODE;
  be->plan.page_size = d->page_size;
  be->plan.num_heads = d->num_heads;
  be->has_prefix = 0;
}

#ifdef MLA_WITH_CUDA
/* A CUDA host plan that absorbed attention runs (EXTEND over a prefix with
 * the absorbed impl, varlen DRAFT_EXTEND): checked once here against the
 * cache and the device attention workspace, and its arrays uploaded once, in
 * stream order, as one image through the mirror's page-locked staging (one
 * staging flush: the host does not wait on the stream). Every layer's
 * forward then launches from the device copy: no copy per layer, so a
 * forward can be captured in a CUDA graph. */
static mla_status place_cuda_plan(mla_backend *be, const mla_plan *plan) {
  static const char *const fn = "mla_backend_plan";
  mla_cuda_plan_dst dst;
  mla_status st = mla_cuda_attention_plan_place(be->ctx, "mla_attention_absorbed", be->cache, plan,
                                                be->desc.num_heads, be->attn_ws, be->attn_ws_bytes, &dst,
                                                &be->plan_meta);
  if (st != MLA_OK) return forward_fail(be, st, fn, mla_ctx_last_error(be->ctx));
  const int64_t bs = plan->batch_size;
  /* The five arrays as they lie in the workspace (carved in this order,
   * qo_indptr first), each copied to its offset in the image. */
  struct {
    int32_t *dst;
    const int32_t *src;
    int64_t n;
  } part[5] = {{dst.qo_indptr, plan->qo_indptr, bs + 1},
               {dst.kv_lens, plan->kv_lens, bs},
               {dst.block_table, plan->block_table, bs * plan->block_table_width},
               {dst.sched_meta, plan->sched_meta, (int64_t)plan->num_sm_parts * MLA_SCHED_META_INTS},
               {dst.num_splits, plan->num_splits, bs + 1}};
  int64_t total = 0;
  for (int k = 0; k < 5; k++) {
    const int64_t end = (int64_t)(part[k].dst - dst.qo_indptr) + part[k].n;
    if (part[k].dst < dst.qo_indptr)
      return mla_fail(&be->err, MLA_ERR_INTERNAL, fn, "plan arrays out of workspace order");
    if (end > total) total = end;
  }
  const size_t bytes = sizeof(int32_t) * (size_t)total;
  if (bytes > be->plan_img_bytes) { /* grows to the largest plan seen (host memory, no stream involved) */
    int32_t *img = realloc(be->plan_img, bytes);
    if (!img) return mla_fail(&be->err, MLA_ERR_OUT_OF_MEMORY, fn, "plan image of %zu bytes", bytes);
    be->plan_img = img;
    be->plan_img_bytes = bytes;
  }
  for (int k = 0; k < 5; k++)
    if (part[k].n > 0)
      memcpy(be->plan_img + (part[k].dst - dst.qo_indptr), part[k].src, sizeof(int32_t) * (size_t)part[k].n);
  st = mla_mirror_upload(&be->mirror, dst.qo_indptr, be->plan_img, total, be->ctx->stream, &be->err);
  if (st != MLA_OK) return st;
  be->plan_on_device = 1;
  return MLA_OK;
}
#endif

mla_status mla_backend_plan(mla_backend *be, const mla_batch *batch) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&be->err, batch);
  be->planned = 0;
  be->step_active = 0;
  be->graph_step = 0;
#ifdef MLA_WITH_CUDA
  be->plan_on_device = 0;
#endif
  if (be->on_cuda && batch->mode != MLA_MODE_IDLE && batch->batch_size > 0 && is_step_mode(batch)) {
    mla_status st = plan_cuda_step(be, batch);
    if (st != MLA_OK) return st;
    plan_from_step(be, &be->step);
    be->planned = 1;
    mla_clear_error(&be->err);
    return MLA_OK;
  }
  mla_plan plan;
  mla_status st = mla_plan_build(be->ctx, be->rt, batch, &be->lim, be->desc.num_heads, be->plan_ws,
                                 be->plan_ws_bytes, &plan);
  if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
  int has_prefix = 0;
  if (batch->mode == MLA_MODE_EXTEND && batch->prefix_lens)
    for (int i = 0; i < batch->batch_size; i++) has_prefix |= batch->prefix_lens[i] > 0;
  const int uses_mha = plan.mode == MLA_MODE_EXTEND && (!has_prefix || be->desc.extend_impl == MLA_EXTEND_MHA_CHUNKED);
  if (be->on_cuda && uses_mha && plan.batch_size > 0) {
    /* CUDA: decode-type steps went above. EXTEND through MHA needs qo_indptr
     * on the device; the paged absorbed prefill (EXTEND over a prefix,
     * varlen DRAFT_EXTEND) uploads its host plan below (place_cuda_plan). */
    st = mla_mirror_upload(&be->mirror, be->d_qo, plan.qo_indptr, plan.batch_size + 1, be->ctx->stream, &be->err);
    if (st != MLA_OK) return st;
  }
#ifdef MLA_WITH_CUDA
  if (be->on_cuda && !uses_mha && plan.mode != MLA_MODE_IDLE && plan.batch_size > 0 && plan.num_q_tokens > 0) {
    st = place_cuda_plan(be, &plan);
    if (st != MLA_OK) return st;
  }
#endif
  if (has_prefix && be->desc.extend_impl == MLA_EXTEND_MHA_CHUNKED) {
    st = mla_chunk_plan_build(be->ctx, be->rt, batch->batch_size, batch->req_ids, batch->prefix_lens,
                              be->desc.chunk_capacity, be->chunk_ws, be->chunk_ws_bytes, &be->chunks);
    if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
    if (be->on_cuda) { /* the slots and per-chunk offsets the kernels read */
      const mla_chunk_plan *cp = &be->chunks;
      st = mla_mirror_upload(&be->mirror, be->d_chunk_slots, cp->slots, cp->slot_indptr[cp->num_chunks],
                             be->ctx->stream, &be->err);
      if (st == MLA_OK)
        st = mla_mirror_upload(&be->mirror, be->d_chunk_cu, cp->cu_seq_lens,
                               (int64_t)cp->num_chunks * (cp->batch_size + 1), be->ctx->stream, &be->err);
      if (st != MLA_OK) return st;
    }
  }
  if (!be->on_cuda) {
    st = size_attention_workspace(be, &plan);
    if (st != MLA_OK) return st;
  }
  be->plan = plan;
  be->has_prefix = has_prefix;
  be->planned = 1;
  mla_clear_error(&be->err);
  return MLA_OK;
}

/* ---- CUDA-graph steps ------------------------------------------------------- */

mla_status mla_backend_graph_init(mla_backend *be, int max_bs, int max_draft_tokens) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  MLA_REQUIRE(eb, max_bs >= 1 && max_bs <= be->desc.max_bs, MLA_ERR_INVALID_ARGUMENT,
              "max_bs = %d, expected 1..%d (the backend's max_bs)", max_bs, be->desc.max_bs);
  MLA_REQUIRE(eb, max_draft_tokens >= 0 && max_draft_tokens <= 64, MLA_ERR_INVALID_ARGUMENT,
              "max_draft_tokens = %d, expected 0..64", max_draft_tokens);
  MLA_REQUIRE(eb, !be->g_ws, MLA_ERR_BAD_STATE, "graph buffers exist already (mla_backend_graph_init twice)");
  /* The largest step: every query count up to the window (the split count
   * depends on it), at max_bs. */
  size_t need = 0;
  for (int q = 1; q <= (max_draft_tokens > 0 ? max_draft_tokens : 1); q++) {
    mla_step_desc d = step_desc_of(be, q == 1 && max_draft_tokens == 0 ? MLA_MODE_DECODE : MLA_MODE_TARGET_VERIFY,
                                   max_bs, q);
    size_t n = 0;
    mla_status st = mla_step_workspace_size(be->ctx, &d, &n);
    if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
    if (n > need) need = n;
  }
  be->g_ids = dev_alloc(be, sizeof(int32_t) * (size_t)max_bs);
  be->g_seq = dev_alloc(be, sizeof(int32_t) * (size_t)max_bs);
  be->g_ws = dev_alloc(be, need);
  if (!be->g_ids || !be->g_seq || !be->g_ws) {
    dev_free(be, be->g_ids);
    dev_free(be, be->g_seq);
    dev_free(be, be->g_ws);
    be->g_ids = be->g_seq = NULL;
    be->g_ws = NULL;
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "graph buffers (%zu bytes of workspace)", need);
  }
  /* Padding until the engine writes real rows. */
  int32_t *tmp = malloc(sizeof(int32_t) * 2 * (size_t)max_bs);
  if (!tmp) return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "scratch");
  for (int i = 0; i < max_bs; i++) {
    tmp[i] = MLA_REQ_PAD;
    tmp[max_bs + i] = 1;
  }
  int e = 0;
#ifdef MLA_WITH_CUDA
  if (be->on_cuda) {
    e = mla_cuda_memcpy_async(be->g_ids, tmp, sizeof(int32_t) * (size_t)max_bs, be->ctx->stream);
    if (!e) e = mla_cuda_memcpy_async(be->g_seq, tmp + max_bs, sizeof(int32_t) * (size_t)max_bs, be->ctx->stream);
    if (!e) e = mla_cuda_stream_sync(be->ctx->stream);
  }
#endif
  if (!be->on_cuda) {
    memcpy(be->g_ids, tmp, sizeof(int32_t) * (size_t)max_bs);
    memcpy(be->g_seq, tmp + max_bs, sizeof(int32_t) * (size_t)max_bs);
  }
  free(tmp);
  if (e) return mla_cuda_fail(eb, __func__, "graph input init", e);
  be->g_ws_bytes = need;
  be->graph_max_bs = max_bs;
  be->graph_max_ndt = max_draft_tokens;
  mla_clear_error(eb);
  return MLA_OK;
}

mla_status mla_backend_graph_init_extend(mla_backend *be, int max_tokens, int32_t **extend_lens) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  MLA_REQUIRE_PTR(eb, extend_lens);
  MLA_REQUIRE(eb, be->g_ws, MLA_ERR_BAD_STATE, "no graph buffers: call mla_backend_graph_init first");
  MLA_REQUIRE(eb, !be->e_ws, MLA_ERR_BAD_STATE, "EXTEND graph buffers exist already");
  MLA_REQUIRE(eb, max_tokens >= 1 && max_tokens <= be->desc.max_q_tokens, MLA_ERR_INVALID_ARGUMENT,
              "max_tokens = %d, expected 1..%d (the backend's max_q_tokens)", max_tokens, be->desc.max_q_tokens);
  /* The largest EXTEND step over the buckets (next_q). */
  size_t need = 0;
  for (int b = 1; b <= max_tokens; b = next_q(be, b, max_tokens)) {
    mla_step_desc d = step_desc_of(be, MLA_MODE_EXTEND, be->graph_max_bs, 0);
    d.num_tokens = b;
    size_t n = 0;
    mla_status st = mla_step_workspace_size(be->ctx, &d, &n);
    if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
    if (n > need) need = n;
  }
  be->g_ext = dev_alloc(be, sizeof(int32_t) * (size_t)be->graph_max_bs);
  be->e_ws = dev_alloc(be, need);
  if (!be->g_ext || !be->e_ws) {
    dev_free(be, be->g_ext);
    dev_free(be, be->e_ws);
    be->g_ext = NULL;
    be->e_ws = NULL;
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "EXTEND graph buffers (%zu bytes of workspace)", need);
  }
  int e = 0;
#ifdef MLA_WITH_CUDA
  if (be->on_cuda) {
    e = mla_cuda_memset_async(be->g_ext, 0, sizeof(int32_t) * (size_t)be->graph_max_bs, be->ctx->stream);
    if (!e) e = mla_cuda_stream_sync(be->ctx->stream);
  }
#endif
  if (!be->on_cuda) memset(be->g_ext, 0, sizeof(int32_t) * (size_t)be->graph_max_bs);
  if (e) return mla_cuda_fail(eb, __func__, "EXTEND graph input init", e);
  be->e_ws_bytes = need;
  be->graph_max_tokens = max_tokens;
  *extend_lens = be->g_ext;
  mla_clear_error(eb);
  return MLA_OK;
}

mla_status mla_backend_graph_inputs(mla_backend *be, int32_t **req_ids, int32_t **seq_lens) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE(&be->err, req_ids && seq_lens, MLA_ERR_INVALID_ARGUMENT, "req_ids / seq_lens is NULL");
  MLA_REQUIRE(&be->err, be->g_ws, MLA_ERR_BAD_STATE, "no graph buffers: call mla_backend_graph_init first");
  *req_ids = be->g_ids;
  *seq_lens = be->g_seq;
  return MLA_OK;
}

/* Workspace of a device-built step of kind 0 (eager), 1 (graph step) or 2
 * (draft steps); the active step's kind is be->graph_step. */
static void *ws_of(const mla_backend *be, int kind, size_t *bytes) {
  *bytes = kind == 3 ? be->e_ws_bytes : kind == 2 ? be->d_ws_bytes : kind ? be->g_ws_bytes : be->step_ws_bytes;
  return kind == 3 ? be->e_ws : kind == 2 ? be->d_ws : kind ? be->g_ws : be->step_ws;
}

/* Builds step d from the graph inputs into the graph (kind 1) or draft
 * (kind 2) workspace and makes it the step forward runs. */
static mla_status prepare_from_inputs(mla_backend *be, const char *fn, mla_step_desc d, int kind) {
  const int32_t *r2t = be->on_cuda ? be->mirror.d_r2t : be->rt->req_to_token;
  mla_step_inputs in = {r2t, be->desc.max_context, be->desc.max_reqs, be->g_ids, be->g_seq,
                        d.mode == MLA_MODE_EXTEND ? be->g_ext : NULL};
  size_t bytes;
  void *ws = ws_of(be, kind, &bytes);
  mla_status st = mla_step_prepare(be->ctx, &d, be->cache, &in, ws, bytes);
  if (st != MLA_OK) return forward_fail(be, st, fn, mla_ctx_last_error(be->ctx));
  be->step = d;
  be->step_active = 1;
  be->graph_step = kind;
  plan_from_step(be, &d);
  be->planned = 1;
  mla_clear_error(&be->err);
  return MLA_OK;
}

mla_status mla_backend_graph_step(mla_backend *be, mla_mode mode, int batch_size, int num_draft_tokens) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  be->planned = 0;
  be->step_active = 0;
  be->graph_step = 0;
  MLA_REQUIRE(eb, be->g_ws, MLA_ERR_BAD_STATE, "no graph buffers: call mla_backend_graph_init first");
  MLA_REQUIRE(eb,
              mode == MLA_MODE_DECODE || mode == MLA_MODE_TARGET_VERIFY || mode == MLA_MODE_DRAFT_EXTEND ||
                  mode == MLA_MODE_EXTEND,
              MLA_ERR_INVALID_ARGUMENT, "mode = %d: graph steps are DECODE, TARGET_VERIFY, DRAFT_EXTEND or EXTEND",
              (int)mode);
  MLA_REQUIRE(eb, batch_size >= 1 && batch_size <= be->graph_max_bs, MLA_ERR_INVALID_ARGUMENT,
              "batch_size = %d, expected 1..%d (mla_backend_graph_init)", batch_size, be->graph_max_bs);
  if (mode == MLA_MODE_EXTEND) {
    MLA_REQUIRE(eb, be->e_ws, MLA_ERR_BAD_STATE, "EXTEND graph steps: call mla_backend_graph_init_extend first");
    MLA_REQUIRE(eb, num_draft_tokens >= 1 && num_draft_tokens <= be->graph_max_tokens, MLA_ERR_INVALID_ARGUMENT,
                "EXTEND token bucket = %d, expected 1..%d (mla_backend_graph_init_extend)", num_draft_tokens,
                be->graph_max_tokens);
    mla_step_desc d = step_desc_of(be, MLA_MODE_EXTEND, batch_size, 0);
    d.num_tokens = num_draft_tokens;
    return prepare_from_inputs(be, __func__, d, 3);
  }
  const int ndt = mode == MLA_MODE_DECODE ? 0 : num_draft_tokens;
  MLA_REQUIRE(eb, mode == MLA_MODE_DECODE ? num_draft_tokens == 0
                                          : (ndt >= 1 && ndt <= be->graph_max_ndt),
              MLA_ERR_INVALID_ARGUMENT, "num_draft_tokens = %d, expected %s", num_draft_tokens,
              mode == MLA_MODE_DECODE ? "0 for DECODE" : "1..max_draft_tokens of mla_backend_graph_init");
  MLA_REQUIRE(eb, (int64_t)batch_size * (ndt ? ndt : 1) <= be->desc.max_q_tokens, MLA_ERR_CAPACITY,
              "%d query tokens exceed max_q_tokens = %d", batch_size * (ndt ? ndt : 1), be->desc.max_q_tokens);
  return prepare_from_inputs(be, __func__, step_desc_of(be, mode, batch_size, ndt), 1);
}

mla_status mla_backend_draft_init(mla_backend *be, int max_steps) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  MLA_REQUIRE(eb, be->g_ws, MLA_ERR_BAD_STATE, "no graph buffers: call mla_backend_graph_init first");
  MLA_REQUIRE(eb, !be->d_ws, MLA_ERR_BAD_STATE, "draft buffers exist already (mla_backend_draft_init twice)");
  MLA_REQUIRE(eb, max_steps >= 1 && max_steps <= 16, MLA_ERR_INVALID_ARGUMENT, "max_steps = %d, expected 1..16",
              max_steps);
  mla_step_desc d = step_desc_of(be, MLA_MODE_DECODE, be->graph_max_bs, 0);
  d.num_steps = max_steps;
  size_t need = 0;
  mla_status st = mla_step_workspace_size(be->ctx, &d, &need);
  if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
  if (!(be->d_ws = dev_alloc(be, need)))
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "draft workspace of %zu bytes", need);
  be->d_ws_bytes = need;
  be->draft_max_steps = max_steps;
  mla_clear_error(eb);
  return MLA_OK;
}

mla_status mla_backend_draft_prepare(mla_backend *be, int batch_size, int num_steps) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  be->planned = 0;
  be->step_active = 0;
  be->graph_step = 0;
  MLA_REQUIRE(eb, be->d_ws, MLA_ERR_BAD_STATE, "no draft buffers: call mla_backend_draft_init first");
  MLA_REQUIRE(eb, batch_size >= 1 && batch_size <= be->graph_max_bs, MLA_ERR_INVALID_ARGUMENT,
              "batch_size = %d, expected 1..%d (mla_backend_graph_init)", batch_size, be->graph_max_bs);
  MLA_REQUIRE(eb, num_steps >= 1 && num_steps <= be->draft_max_steps, MLA_ERR_INVALID_ARGUMENT,
              "num_steps = %d, expected 1..%d (mla_backend_draft_init)", num_steps, be->draft_max_steps);
  mla_step_desc d = step_desc_of(be, MLA_MODE_DECODE, batch_size, 0);
  d.num_steps = num_steps;
  return prepare_from_inputs(be, __func__, d, 2);
}

mla_status mla_backend_draft_select(mla_backend *be, int step) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  MLA_REQUIRE(eb, be->planned && be->graph_step == 2, MLA_ERR_BAD_STATE,
              "no draft steps prepared: call mla_backend_draft_prepare first");
  MLA_REQUIRE(eb, step >= 0 && step < be->step.num_steps, MLA_ERR_INVALID_ARGUMENT, "step = %d, expected 0..%d",
              step, be->step.num_steps - 1);
  be->step.step = step;
  mla_clear_error(eb);
  return MLA_OK;
}

/* The last-error text is not logical state: queries on a const handle may
 * still record why they failed. */
static mla_errbuf *query_err(const mla_backend *be) { return (mla_errbuf *)&be->err; }

mla_status mla_backend_step_metadata(const mla_backend *be, mla_step_metadata *out) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(query_err(be), out);
  MLA_REQUIRE(query_err(be), be->planned && be->step_active, MLA_ERR_BAD_STATE,
              "the current plan is not a device-built step (no plan, or a host plan: mla_backend_get_plan)");
  size_t bytes;
  void *ws = ws_of(be, be->graph_step, &bytes);
  mla_status st = mla_step_get_metadata(be->ctx, &be->step, ws, bytes, out);
  if (st != MLA_OK) return forward_fail((mla_backend *)be, st, __func__, mla_ctx_last_error(be->ctx));
  return MLA_OK;
}

mla_status mla_backend_sync(mla_backend *be) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  if (!be->on_cuda) return MLA_OK;
  mla_status st = mla_mirror_sync(&be->mirror, be->rt, be->ctx->stream, &be->err);
  if (st == MLA_OK) mla_clear_error(&be->err);
  return st;
}


mla_status mla_backend_get_plan(const mla_backend *be, const mla_plan **plan) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(query_err(be), plan);
  MLA_REQUIRE(query_err(be), be->planned, MLA_ERR_BAD_STATE, "no plan: call mla_backend_plan first");
  MLA_REQUIRE(query_err(be), !be->step_active, MLA_ERR_UNSUPPORTED,
              "this step's metadata was built on the device (CUDA decode-type or graph step): it has no "
              "host plan");
  *plan = &be->plan;
  return MLA_OK;
}

mla_status mla_backend_uses_mha(const mla_backend *be, int *uses_mha) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(query_err(be), uses_mha);
  MLA_REQUIRE(query_err(be), be->planned, MLA_ERR_BAD_STATE, "no plan: call mla_backend_plan first");
  /* (an EXTEND graph step is the paged absorbed prefill) */
  *uses_mha = !be->step_active && be->plan.mode == MLA_MODE_EXTEND &&
              (!be->has_prefix || be->desc.extend_impl == MLA_EXTEND_MHA_CHUNKED);
  return MLA_OK;
}

static mla_status run_absorbed(mla_backend *be, const mla_forward_args *a) {
  mla_absorbed_args aa;
  memset(&aa, 0, sizeof aa);
  aa.num_heads = be->desc.num_heads;
  aa.scale = be->desc.scale;
  aa.flags = a->flags;
  aa.act_dtype = be->desc.act_dtype;
  aa.q_nope = a->q_nope;
  aa.q_rope = a->q_rope;
  aa.out = a->out;
  aa.lse = a->lse;
  mla_status st;
  if (be->step_active) {
    size_t bytes;
    void *ws = ws_of(be, be->graph_step, &bytes);
    st = mla_step_attention(be->ctx, &be->step, be->cache, a->layer, &aa, ws, bytes);
  } else {
#ifdef MLA_WITH_CUDA
    if (be->plan_on_device) { /* uploaded by mla_backend_plan: launch from the device copy */
      mla_clear_error(&be->ctx->err);
      st = mla_cuda_attention_meta(be->ctx, "mla_attention_absorbed", be->cache, a->layer, &aa, &be->plan_meta);
      if (st != MLA_OK) return forward_fail(be, st, "mla_backend_forward", mla_ctx_last_error(be->ctx));
      return MLA_OK;
    }
#endif
    st = mla_attention_absorbed(be->ctx, be->cache, a->layer, &be->plan, &aa, be->attn_ws, be->attn_ws_bytes);
  }
  if (st != MLA_OK) return forward_fail(be, st, "mla_backend_forward", mla_ctx_last_error(be->ctx));
  return MLA_OK;
}

/* MHA over this step's tokens only: q, k, v of the extend tokens, causal. */
static mla_ragged_args extend_ragged(const mla_backend *be, const mla_forward_args *a) {
  mla_ragged_args r;
  memset(&r, 0, sizeof r);
  r.batch_size = be->plan.batch_size;
  r.num_heads = r.num_kv_heads = be->desc.num_heads;
  r.qk_dim = be->desc.qk_nope_dim + MLA_ROPE;
  r.v_dim = be->desc.v_dim;
  r.scale = be->desc.scale;
  r.causal = 1;
  r.act_dtype = be->desc.act_dtype;
  r.qo_indptr = be->on_cuda ? be->d_qo : be->plan.qo_indptr;
  r.kv_indptr = r.qo_indptr;
  r.q = a->q;
  r.k = a->k;
  r.v = a->v;
  r.out = a->out;
  r.lse = a->lse;
  r.workspace = be->d_ragged_ws;
  r.workspace_bytes = be->ragged_ws_bytes;
  return r;
}

/* Chunked-prefix MHA: causal attention over the extend tokens, then each
 * prefix chunk (gathered latent rows expanded to k/v with kv_b_proj) attended
 * non-causally, merged into the running (o, lse) by log-sum-exp. The running
 * state stays fp32 (rounding it to bf16 after every merge would compound) and
 * the LSE natural-log until the end; the output is converted once. */
static mla_status run_mha_chunked(mla_backend *be, const mla_forward_args *a) {
  const mla_backend_desc *d = &be->desc;
  int T = be->plan.num_q_tokens, H = d->num_heads;
  float *lse = a->lse ? a->lse : be->main_lse;
  mla_ragged_args r = extend_ragged(be, a);
  r.flags = MLA_FLAG_OUT_F32;
  r.out = be->acc_o;
  r.lse = lse;
  mla_status st = mla_attention_ragged(be->ctx, &r);
  const mla_chunk_plan *cp = &be->chunks;
  for (int c = 0; st == MLA_OK && c < cp->num_chunks; c++) {
    int n = cp->slot_indptr[c + 1] - cp->slot_indptr[c];
    if (n == 0) continue;
    const mla_dtype lat = be->on_cuda ? d->act_dtype : MLA_DTYPE_F32;
    const int32_t *slots = (be->on_cuda ? be->d_chunk_slots : cp->slots) + cp->slot_indptr[c];
    st = mla_gather_latent(be->ctx, be->cache, a->layer, n, slots, lat, be->chunk_c, be->chunk_r);
    if (st == MLA_OK)
      st = mla_expand_kv(be->ctx, n, H, d->qk_nope_dim, d->v_dim, lat, d->act_dtype, be->chunk_c, be->chunk_r,
                         a->kv_b_proj, be->chunk_k, be->chunk_v);
    if (st == MLA_OK) {
      mla_ragged_args rc = r;
      rc.causal = 0;
      rc.kv_indptr = (be->on_cuda ? be->d_chunk_cu : cp->cu_seq_lens) + (size_t)c * (cp->batch_size + 1);
      rc.k = be->chunk_k;
      rc.v = be->chunk_v;
      rc.out = be->part_o;
      rc.lse = be->part_lse;
      st = mla_attention_ragged(be->ctx, &rc);
    }
    if (st == MLA_OK) {
      const void *parts[2] = {be->acc_o, be->part_o};
      const float *lses[2] = {lse, be->part_lse};
      st = mla_merge_states(be->ctx, 2, T, H, d->v_dim, MLA_DTYPE_F32, 0, parts, lses, be->acc_o, lse);
    }
  }
  if (st != MLA_OK) return forward_fail(be, st, "mla_backend_forward", mla_ctx_last_error(be->ctx));
  if (be->on_cuda) {
#ifdef MLA_WITH_CUDA
    int e = mla_cuda_f32_to(be->acc_o, a->out, (int)d->act_dtype, (int64_t)T * H * d->v_dim, 1.0f, be->ctx->stream);
    if (!e && a->lse && (a->flags & MLA_FLAG_LSE_BASE2))
      e = mla_cuda_f32_to(a->lse, a->lse, MLA_DTYPE_F32, (int64_t)T * H, 1.4426950408889634f, be->ctx->stream);
    if (e) return mla_cuda_fail(&be->err, "mla_backend_forward", "output conversion", e);
#endif
    return MLA_OK;
  }
  mla_convert(be->acc_o, MLA_DTYPE_F32, a->out, d->act_dtype, (int64_t)T * H * d->v_dim);
  if (a->lse && (a->flags & MLA_FLAG_LSE_BASE2))
    for (int64_t i = 0; i < (int64_t)T * H; i++) a->lse[i] *= 1.4426950408889634f; /* log2(e) */
  return MLA_OK;
}

mla_status mla_backend_forward(mla_backend *be, const mla_forward_args *a) {
  if (!be) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &be->err;
  MLA_REQUIRE_PTR(eb, a);
  MLA_REQUIRE(eb, be->planned, MLA_ERR_BAD_STATE, "no plan: call mla_backend_plan first");
  MLA_REQUIRE(eb, a->layer >= 0 && a->layer < be->desc.cache.num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, expected 0..%d", a->layer, be->desc.cache.num_layers - 1);
  MLA_REQUIRE(eb, a->num_new >= 0, MLA_ERR_INVALID_ARGUMENT, "num_new = %d", a->num_new);
  MLA_REQUIRE(eb, (a->flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_FP8_MATH)) == 0, MLA_ERR_INVALID_ARGUMENT,
              "flags = 0x%x has unknown bits", a->flags);
  const mla_plan *p = &be->plan;
  int rows = p->num_q_tokens;
  int uses_mha = 0;
  mla_backend_uses_mha(be, &uses_mha);
  int chunked = uses_mha && be->has_prefix;
  if (rows > 0) {
    MLA_REQUIRE_PTR(eb, a->out);
    if (uses_mha) {
      MLA_REQUIRE(eb, a->q && a->k && a->v, MLA_ERR_INVALID_ARGUMENT,
                  "EXTEND through MHA needs q, k and v (one is NULL)");
      if (chunked) MLA_REQUIRE_PTR(eb, a->kv_b_proj);
    } else {
      MLA_REQUIRE(eb, a->q_nope && a->q_rope, MLA_ERR_INVALID_ARGUMENT,
                  "absorbed attention needs q_nope and q_rope (one is NULL)");
    }
  }
  /* This step's latent rows go into the cache before attention reads them. */
  if (a->num_new > 0) {
    MLA_REQUIRE(eb, a->new_slots && a->new_c && a->new_r, MLA_ERR_INVALID_ARGUMENT,
                "num_new = %d but new_slots, new_c or new_r is NULL", a->num_new);
    mla_status st = mla_kv_cache_write(be->cache, a->layer, a->num_new, a->new_slots, a->new_c, a->new_r,
                                       be->desc.act_dtype);
    if (st != MLA_OK) return forward_fail(be, st, __func__, mla_kv_cache_last_error(be->cache));
  }
  mla_clear_error(eb);
  if (p->mode == MLA_MODE_IDLE || rows == 0) return MLA_OK;
  if (!uses_mha) return run_absorbed(be, a);
  if (chunked) return run_mha_chunked(be, a);
  mla_ragged_args r = extend_ragged(be, a);
  /* MLA_FLAG_FP8_MATH is a permission for the absorbed kernels: an engine
   * sets it once for every forward, so the MHA steps drop it (computing
   * exactly) rather than refuse it. */
  r.flags = a->flags & ~MLA_FLAG_FP8_MATH;
  mla_status st = mla_attention_ragged(be->ctx, &r);
  if (st != MLA_OK) return forward_fail(be, st, __func__, mla_ctx_last_error(be->ctx));
  return MLA_OK;
}
