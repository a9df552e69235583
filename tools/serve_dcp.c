/* See serve_dcp.h. */
#define _POSIX_C_SOURCE 200809L /* pthread barriers, setenv */
#include "serve_dcp.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo_util.h"

#ifdef MLA_CLI_CUDA
#include <cuda_runtime.h>
#if defined(MLA_HAVE_NCCL)
#include <nccl.h>
#define SDCP_NCCL 1
#endif
#endif

enum { OP_EXIT = 0, OP_LAYER, OP_READ, OP_COPY };

typedef struct job {
  int op, layer, T, n;
  const int32_t *slots;          /* [T] global slots of the new rows / [n] rows to read */
  const void *c, *r, *q, *qr;    /* host: new rows, queries */
  void *out;                     /* host: rank 0's output */
  float *lse;
  const int32_t *src, *dst;      /* OP_COPY: [n] global slots */
  float *cf, *rf;                /* OP_READ: [n, 512], [n, 64] */
} job;

typedef struct rank {
  sdcp *d;
  int id, ok;
  mla_ctx *ctx;
  void *stream, *comm;
  mla_kv_cache *shard, *gath;
  /* rank memory (device on a GPU, host for CPU ranks) */
  void *q, *qr, *c, *r, *o, *mo, *mws, *wsd, *wse;
  float *lse, *mlse, *rcf, *rrf;
  int32_t *slots, *r2t, *ids, *seq, *ext, *qo, *local, *table, *rslots;
  size_t mwsb, wsdb, wseb, row_bytes;
  /* host scratch for reads and copies */
  int32_t *hs, *hs2;
  int *hidx;
  float *hcf, *hrf;
  void *ev0, *ev1;               /* CUDA events around the exchange */
  int timed;                     /* events recorded this job (1 merge, 2 gather) */
  double xms, mms;
  int64_t rows;
  char err[320];
} rank;

struct sdcp {
  sdcp_desc desc;
  int N, es, read_cap;
  char where[320], err[400];
  rank rk[SDCP_MAX_RANKS];
  pthread_t th[SDCP_MAX_RANKS];
  int nthreads;
  pthread_barrier_t start, done, peers;
  job j;
  /* the current batch (host) */
  int kind, bs, T0, prepared, m, m_cap;
  int32_t *ids, *kv, *ext, *qo, *table, *gslots, *indptr, *iota;
  const int32_t *r2t;
  int32_t *local[SDCP_MAX_RANKS];
  int nlocal[SDCP_MAX_RANKS];
  mla_ctx *cpu;                  /* host planning: gather table, each rank's local slots */
  void *pws;
  size_t pwsb;
  /* host exchange (CPU ranks) */
  const void *xo[SDCP_MAX_RANKS];
  const float *xl[SDCP_MAX_RANKS];
  int64_t merges, gathers, gathered_rows;
  int failed;                    /* a job failed: no further jobs (a rank may be out of step) */
  int trace;                     /* SDCP_TRACE set: each rank prints its stages to stderr */
#ifdef SDCP_NCCL
  ncclUniqueId nid;
#endif
};

/* ---- rank memory: device memory on a GPU, host memory for CPU ranks ------ */

static void *r_alloc(rank *k, size_t n) {
  if (!n) n = 16;
  if (k->d->desc.host) return calloc(1, n);
#ifdef MLA_CLI_CUDA
  void *p = NULL;
  if (cudaMalloc(&p, n) != cudaSuccess) return NULL;
  if (cudaMemset(p, 0, n) != cudaSuccess) {
    cudaFree(p);
    return NULL;
  }
  return p;
#else
  return NULL;
#endif
}

static void r_free(rank *k, void *p) {
  if (!p) return;
  if (k->d->desc.host) {
    free(p);
    return;
  }
#ifdef MLA_CLI_CUDA
  cudaFree(p);
#endif
}

/* Copies in stream order (the job ends with a synchronize), either way
 * (unified addressing tells the direction). 0 or -1. */
static int r_copy(rank *k, void *dst, const void *src, size_t n) {
  if (!n) return 0;
  if (k->d->desc.host) {
    memcpy(dst, src, n);
    return 0;
  }
#ifdef MLA_CLI_CUDA
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, (cudaStream_t)k->stream) == cudaSuccess ? 0 : -1;
#else
  return -1;
#endif
}
#define r_put r_copy
#define r_get r_copy

static int r_fail(rank *k, const char *what, const char *msg) {
  if (!k->err[0]) snprintf(k->err, sizeof k->err, "%s: %s", what, msg ? msg : "");
  k->ok = 0;
  return -1;
}
#define R_MLA(k, call)                                                                  \
  do {                                                                                  \
    if ((call) != MLA_OK) return r_fail((k), #call, mla_ctx_last_error((k)->ctx));      \
  } while (0)
#define R_MEM(k, cond, what)                                                            \
  do {                                                                                  \
    if (!(cond)) return r_fail((k), (what), "out of memory or a failed copy");          \
  } while (0)

static void trace(rank *k, const job *j, const char *stage) {
  if (!k->d->trace) return;
  fprintf(stderr, "[sdcp rank %d] op %d kind %d layer %d T %d: %s (ok %d%s%s)\n", k->id, j->op, k->d->kind, j->layer,
          j->T, stage, k->ok, k->err[0] ? ", " : "", k->err);
  fflush(stderr);
}

/* 1 when every rank is still ok: all enter the next collective or none does
 * (a rank that failed alone would leave the others waiting in NCCL). */
static int agree(rank *k) {
  pthread_barrier_wait(&k->d->peers);
  int all = 1;
  for (int r = 0; r < k->d->N; r++) all &= k->d->rk[r].ok;
  pthread_barrier_wait(&k->d->peers);
  return all;
}

/* ---- rank set-up ---------------------------------------------------------- */

static int rank_setup(rank *k) {
  sdcp *d = k->d;
  const sdcp_desc *s = &d->desc;
  const size_t es = (size_t)d->es, T = (size_t)s->max_tokens, H = (size_t)s->heads, B = (size_t)s->max_batch;
  mla_ctx_desc cd = {s->host ? MLA_DEVICE_CPU : MLA_DEVICE_CUDA, s->host ? (s->threads > 0 ? s->threads : 1) : 0,
                     s->host ? 0 : k->id};
#ifdef MLA_CLI_CUDA
  if (!s->host && cudaSetDevice(k->id) != cudaSuccess) return r_fail(k, "cudaSetDevice", "failed");
#endif
  if (mla_ctx_create(&cd, &k->ctx) != MLA_OK) return r_fail(k, "mla_ctx_create", "no context");
#ifdef MLA_CLI_CUDA
  if (!s->host) {
    cudaStream_t st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) return r_fail(k, "stream", "failed");
    k->stream = st;
    R_MLA(k, mla_ctx_set_stream(k->ctx, st));
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)
      return r_fail(k, "cudaEventCreate", "failed");
    k->ev0 = e0, k->ev1 = e1;
  }
#endif
  mla_kv_cache_desc kd = {s->layers, s->num_pages, s->page_size, s->cache_dtype, NULL};
  R_MLA(k, mla_kv_cache_create(k->ctx, &kd, &k->shard));
  /* The gathered cache: page size 1 (the table addresses single slots),
   * slot 0 the reserved row, then world blocks of m_cap rows; one layer,
   * refilled for each layer of a batch. */
  mla_kv_cache_desc gd = {1, 1 + d->N * d->m_cap, 1, s->cache_dtype, NULL};
  R_MLA(k, mla_kv_cache_create(k->ctx, &gd, &k->gath));
  R_MLA(k, mla_kv_cache_row_bytes(k->shard, &k->row_bytes));
  k->q = r_alloc(k, T * H * MLA_LATENT * es);
  k->qr = r_alloc(k, T * H * MLA_ROPE * es);
  k->c = r_alloc(k, T * MLA_LATENT * es);
  k->r = r_alloc(k, T * MLA_ROPE * es);
  k->o = r_alloc(k, T * H * MLA_LATENT * es);
  k->lse = r_alloc(k, T * H * sizeof(float));
  k->mo = r_alloc(k, B * H * MLA_LATENT * es);
  k->mlse = r_alloc(k, B * H * sizeof(float));
  k->slots = r_alloc(k, T * sizeof(int32_t));
  k->r2t = r_alloc(k, (size_t)s->max_reqs * s->max_ctx * sizeof(int32_t));
  k->table = r_alloc(k, B * s->max_ctx * sizeof(int32_t));
  k->local = r_alloc(k, (size_t)d->m_cap * sizeof(int32_t));
  k->ids = r_alloc(k, B * sizeof(int32_t));
  k->seq = r_alloc(k, B * sizeof(int32_t));
  k->ext = r_alloc(k, B * sizeof(int32_t));
  k->qo = r_alloc(k, (B + 1) * sizeof(int32_t));
  const size_t rc = (size_t)d->read_cap;
  k->rslots = r_alloc(k, rc * sizeof(int32_t));
  k->rcf = r_alloc(k, rc * MLA_LATENT * sizeof(float));
  k->rrf = r_alloc(k, rc * MLA_ROPE * sizeof(float));
  k->hs = malloc(rc * sizeof(int32_t));
  k->hs2 = malloc(rc * sizeof(int32_t));
  k->hidx = malloc(rc * sizeof(int));
  k->hcf = malloc(rc * MLA_LATENT * sizeof(float));
  k->hrf = malloc(rc * MLA_ROPE * sizeof(float));
  R_MEM(k, k->q && k->qr && k->c && k->r && k->o && k->lse && k->mo && k->mlse && k->slots && k->r2t && k->table &&
               k->local && k->ids && k->seq && k->ext && k->qo && k->rslots && k->rcf && k->rrf && k->hs && k->hs2 &&
               k->hidx && k->hcf && k->hrf,
        "buffers");
  /* Step workspaces sized for the largest batch: DCP DECODE over the shard,
   * EXTEND over the gathered cache. */
  mla_step_desc dd;
  memset(&dd, 0, sizeof dd);
  dd.mode = MLA_MODE_DECODE;
  dd.batch_size = (int32_t)B;
  dd.max_kv_len = s->max_ctx;
  dd.num_heads = s->heads;
  dd.page_size = s->page_size;
  dd.dcp_world = d->N;
  dd.dcp_rank = k->id;
  R_MLA(k, mla_step_workspace_size(k->ctx, &dd, &k->wsdb));
  mla_step_desc de;
  memset(&de, 0, sizeof de);
  de.mode = MLA_MODE_EXTEND;
  de.batch_size = (int32_t)B;
  de.max_kv_len = s->max_ctx;
  de.num_heads = s->heads;
  de.page_size = 1;
  de.num_tokens = (int32_t)T;
  R_MLA(k, mla_step_workspace_size(k->ctx, &de, &k->wseb));
  k->wsd = r_alloc(k, k->wsdb);
  k->wse = r_alloc(k, k->wseb);
  R_MEM(k, k->wsd && k->wse, "step workspaces");
  if (s->host) {
    k->mwsb = 0;
  } else {
    R_MLA(k, mla_dcp_merge_workspace_size(k->ctx, d->N, (int)B, s->heads, MLA_LATENT, s->act, &k->mwsb));
    k->mws = r_alloc(k, k->mwsb);
    R_MEM(k, k->mws, "merge workspace");
  }
  return 0;
}

static void rank_teardown(rank *k) {
  if (k->ctx) mla_ctx_synchronize(k->ctx);
#ifdef SDCP_NCCL
  if (k->comm) ncclCommDestroy((ncclComm_t)k->comm);
#endif
  void *bufs[] = {k->q,   k->qr,  k->c,  k->r,     k->o,     k->mo,    k->mws,    k->wsd,  k->wse,  k->lse,
                  k->mlse, k->rcf, k->rrf, k->slots, k->r2t, k->ids, k->seq, k->ext, k->qo, k->local, k->table,
                  k->rslots};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) r_free(k, bufs[i]);
  free(k->hs), free(k->hs2), free(k->hidx), free(k->hcf), free(k->hrf);
  mla_kv_cache_destroy(k->shard);
  mla_kv_cache_destroy(k->gath);
#ifdef MLA_CLI_CUDA
  if (k->ev0) cudaEventDestroy((cudaEvent_t)k->ev0);
  if (k->ev1) cudaEventDestroy((cudaEvent_t)k->ev1);
  if (k->ctx && k->stream) mla_ctx_set_stream(k->ctx, NULL);
  if (k->stream) cudaStreamDestroy((cudaStream_t)k->stream);
#endif
  mla_ctx_destroy(k->ctx);
}

/* ---- the exchanges ------------------------------------------------------- */

static double now_or_event(rank *k, int start) {
#ifdef MLA_CLI_CUDA
  if (!k->d->desc.host) {
    cudaEventRecord((cudaEvent_t)(start ? k->ev0 : k->ev1), (cudaStream_t)k->stream);
    return 0;
  }
#endif
  (void)k;
  (void)start;
  return demo_now_ms();
}

/* DECODE: every rank's partial (o, lse) over its keys, all-gathered and
 * merged into mo / mlse on every rank. */
static int exchange_merge(rank *k, int bs) {
  sdcp *d = k->d;
  const sdcp_desc *s = &d->desc;
  const double t0 = now_or_event(k, 1);
  if (s->host) {
    d->xo[k->id] = k->o;
    d->xl[k->id] = k->lse;
    pthread_barrier_wait(&d->peers);
    mla_status st = mla_merge_states(k->ctx, d->N, bs, s->heads, MLA_LATENT, s->act, 0, d->xo, d->xl, k->mo, k->mlse);
    pthread_barrier_wait(&d->peers); /* nobody reuses its o before all have merged */
    if (st != MLA_OK) return r_fail(k, "mla_merge_states", mla_ctx_last_error(k->ctx));
    const double ms = demo_now_ms() - t0;
    k->xms += ms, k->mms += ms;
    return 0;
  }
#ifdef SDCP_NCCL
  R_MLA(k, mla_dcp_merge_nccl(k->ctx, k->comm, d->N, k->id, bs, s->heads, MLA_LATENT, s->act, k->o, k->lse, k->mws,
                              k->mwsb, k->mo, k->mlse));
  now_or_event(k, 0);
  k->timed = 1;
  return 0;
#else
  (void)bs;
  (void)t0;
  return r_fail(k, "mla_dcp_merge_nccl", "this build has no NCCL");
#endif
}

/* EXTEND: this rank's rows of the batch (its local slots, in the gathered
 * layout's order) into its block of the gathered cache, and every block to
 * every rank. */
static int exchange_gather(rank *k, int layer) {
  sdcp *d = k->d;
  const int base = 1;
  const double t0 = now_or_event(k, 1);
  if (d->desc.host) {
    mla_status st = mla_kv_cache_pack_rows(k->shard, layer, d->nlocal[k->id], k->local, k->gath, 0,
                                           base + k->id * d->m);
    pthread_barrier_wait(&d->peers);
    void *mine = NULL;
    mla_kv_cache_layer_data(k->gath, 0, &mine);
    for (int q = 0; q < d->N; q++) {
      void *theirs = NULL;
      if (q == k->id || mla_kv_cache_layer_data(d->rk[q].gath, 0, &theirs) != MLA_OK) continue;
      const size_t off = ((size_t)base + (size_t)q * d->m) * k->row_bytes;
      memcpy((char *)mine + off, (const char *)theirs + off, (size_t)d->m * k->row_bytes);
    }
    pthread_barrier_wait(&d->peers);
    if (st != MLA_OK) return r_fail(k, "mla_kv_cache_pack_rows", mla_ctx_last_error(k->ctx));
    k->xms += demo_now_ms() - t0;
    return 0;
  }
#ifdef SDCP_NCCL
  R_MLA(k, mla_dcp_gather_kv_nccl(k->ctx, k->comm, d->N, k->id, k->shard, layer, d->nlocal[k->id], k->local, d->m,
                                  k->gath, 0, base));
  now_or_event(k, 0);
  k->timed = 2;
  return 0;
#else
  (void)layer;
  (void)t0;
  return r_fail(k, "mla_dcp_gather_kv_nccl", "this build has no NCCL");
#endif
}

/* ---- the jobs ----------------------------------------------------------- */

/* The step workspace for this batch's shape. mla_step_workspace_size is
 * not monotonic in the shape (on a GPU a small EXTEND gets split-KV
 * accumulators sized by the SM count, a large one none), so a workspace
 * sized for the largest batch can be too small for a smaller one: grow it
 * when a batch needs more. */
static int fit_workspace(rank *k, const mla_step_desc *sd, void **ws, size_t *bytes) {
  size_t need = 0;
  R_MLA(k, mla_step_workspace_size(k->ctx, sd, &need));
  if (need <= *bytes) return 0;
  r_free(k, *ws);
  *ws = r_alloc(k, need);
  *bytes = *ws ? need : 0;
  R_MEM(k, *ws, "step workspace");
  return 0;
}

/* A step over the batch with the fields the two modes share. */
static mla_step_desc batch_desc(const sdcp *d, mla_mode mode, int page_size) {
  mla_step_desc sd;
  memset(&sd, 0, sizeof sd);
  sd.mode = mode;
  sd.batch_size = d->bs;
  sd.max_kv_len = d->desc.max_ctx;
  sd.num_heads = d->desc.heads;
  sd.page_size = page_size;
  return sd;
}

/* This rank's DECODE step over its shard (prepare and every layer). */
static mla_step_desc decode_desc(const rank *k) {
  mla_step_desc sd = batch_desc(k->d, MLA_MODE_DECODE, k->d->desc.page_size);
  sd.dcp_world = k->d->N;
  sd.dcp_rank = k->id;
  return sd;
}

/* Rank 0's EXTEND step over the pooled rows (page 1, the batch's token count). */
static mla_step_desc extend_desc(const rank *k) {
  mla_step_desc sd = batch_desc(k->d, MLA_MODE_EXTEND, 1);
  sd.num_tokens = k->d->T0;
  return sd;
}

/* The absorbed attention's arguments over this rank's q / out buffers. */
static mla_absorbed_args rank_args(const rank *k) {
  const sdcp_desc *s = &k->d->desc;
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = s->heads;
  a.scale = s->scale;
  a.act_dtype = s->act;
  a.q_nope = k->q;
  a.q_rope = k->qr;
  a.out = k->o;
  a.lse = k->lse;
  return a;
}

/* The batch's step metadata, once per batch (first layer). */
static int prepare(rank *k) {
  sdcp *d = k->d;
  const sdcp_desc *s = &d->desc;
  const size_t bs = (size_t)d->bs, i4 = sizeof(int32_t);
  if (d->kind == SDCP_DECODE) {
    R_MEM(k, !r_put(k, k->r2t, d->r2t, (size_t)s->max_reqs * s->max_ctx * i4) && !r_put(k, k->ids, d->ids, bs * i4) &&
                 !r_put(k, k->seq, d->kv, bs * i4),
          "decode inputs");
    const mla_step_desc sd = decode_desc(k);
    mla_step_inputs in = {k->r2t, s->max_ctx, s->max_reqs, k->ids, k->seq, NULL};
    if (fit_workspace(k, &sd, &k->wsd, &k->wsdb)) return -1;
    R_MLA(k, mla_step_prepare(k->ctx, &sd, k->shard, &in, k->wsd, k->wsdb));
  } else if (d->kind == SDCP_EXTEND) {
    R_MEM(k, !r_put(k, k->local, d->local[k->id], (size_t)d->nlocal[k->id] * i4), "local slots");
    if (k->id == 0) {
      R_MEM(k, !r_put(k, k->table, d->table, bs * s->max_ctx * i4) && !r_put(k, k->ids, d->iota, bs * i4) &&
                   !r_put(k, k->seq, d->kv, bs * i4) && !r_put(k, k->ext, d->ext, bs * i4),
            "extend inputs");
      const mla_step_desc sd = extend_desc(k);
      mla_step_inputs in = {k->table, s->max_ctx, d->bs, k->ids, k->seq, k->ext};
      if (fit_workspace(k, &sd, &k->wse, &k->wseb)) return -1;
      R_MLA(k, mla_step_prepare(k->ctx, &sd, k->gath, &in, k->wse, k->wseb));
    }
  } else if (k->id == 0) {
    R_MEM(k, !r_put(k, k->qo, d->qo, (bs + 1) * i4), "prefill indptr");
  }
  return 0;
}

/* A layer's work before the exchange: the shard write, the batch's step
 * metadata, and (DECODE) this rank's partial attention. */
static int layer_local(rank *k, const job *j) {
  sdcp *d = k->d;
  const sdcp_desc *s = &d->desc;
  const size_t es = (size_t)d->es, T = (size_t)j->T, H = (size_t)s->heads, n = T * H;
  /* every rank: its shard of the new rows */
  int mine = 0;
  for (int t = 0; t < j->T; t++) mine += j->slots[t] % d->N == k->id;
  k->rows += mine;
  R_MEM(k, !r_put(k, k->slots, j->slots, T * sizeof(int32_t)) && !r_put(k, k->c, j->c, T * MLA_LATENT * es) &&
               !r_put(k, k->r, j->r, T * MLA_ROPE * es),
        "row upload");
  R_MLA(k, mla_kv_cache_write_shard(k->shard, j->layer, j->T, k->slots, k->c, k->r, s->act, d->N, k->id));
  if (!d->prepared && prepare(k)) return -1;
  if (d->kind == SDCP_DECODE) {
    const mla_absorbed_args a = rank_args(k);
    R_MEM(k, !r_put(k, k->q, j->q, n * MLA_LATENT * es) && !r_put(k, k->qr, j->qr, n * MLA_ROPE * es), "q upload");
    const mla_step_desc sd = decode_desc(k);
    R_MLA(k, mla_step_attention(k->ctx, &sd, k->shard, j->layer, &a, k->wsd, k->wsdb));
  } else if (d->kind == SDCP_PREFILL && k->id == 0) { /* ragged MHA over the new tokens, q | k | v in one buffer */
    R_MEM(k, !r_put(k, k->q, j->q, n * (2 * (size_t)s->qk_dim + (size_t)s->v_dim) * es), "q|k|v upload");
    mla_ragged_args ra;
    memset(&ra, 0, sizeof ra);
    ra.batch_size = d->bs;
    ra.num_heads = ra.num_kv_heads = s->heads;
    ra.qk_dim = s->qk_dim;
    ra.v_dim = s->v_dim;
    ra.scale = s->scale;
    ra.causal = 1;
    ra.act_dtype = s->act;
    ra.qo_indptr = ra.kv_indptr = k->qo;
    ra.q = k->q;
    ra.k = (const char *)k->q + n * (size_t)s->qk_dim * es;
    ra.v = (const char *)k->q + 2 * n * (size_t)s->qk_dim * es;
    ra.out = k->o;
    ra.lse = k->lse;
    R_MLA(k, mla_attention_ragged(k->ctx, &ra));
    R_MEM(k, !r_get(k, j->out, k->o, n * (size_t)s->v_dim * es) && !r_get(k, j->lse, k->lse, n * sizeof(float)),
          "output download");
  }
  return 0;
}

static int do_layer(rank *k, const job *j) {
  sdcp *d = k->d;
  const sdcp_desc *s = &d->desc;
  const size_t es = (size_t)d->es, T = (size_t)j->T, H = (size_t)s->heads, n = T * H;
  trace(k, j, "local");
  layer_local(k, j); /* a failure shows in k->ok */
  if (d->kind == SDCP_PREFILL) return k->ok ? 0 : -1;
  /* Every rank reaches this, failed or not: all enter the exchange or none. */
  trace(k, j, "agree");
  if (!agree(k)) return -1;
  trace(k, j, "exchange");
  if (d->kind == SDCP_DECODE) {
    if (exchange_merge(k, d->bs)) return -1;
    if (k->id == 0)
      R_MEM(k, !r_get(k, j->out, k->mo, n * MLA_LATENT * es) && !r_get(k, j->lse, k->mlse, n * sizeof(float)),
            "output download");
  } else {
    if (exchange_gather(k, j->layer)) return -1;
    if (k->id == 0) {
      const mla_absorbed_args a = rank_args(k);
      R_MEM(k, !r_put(k, k->q, j->q, n * MLA_LATENT * es) && !r_put(k, k->qr, j->qr, n * MLA_ROPE * es), "q upload");
      const mla_step_desc sd = extend_desc(k);
      R_MLA(k, mla_step_attention(k->ctx, &sd, k->gath, 0, &a, k->wse, k->wseb));
      R_MEM(k, !r_get(k, j->out, k->o, n * MLA_LATENT * es) && !r_get(k, j->lse, k->lse, n * sizeof(float)),
            "output download");
    }
  }
  trace(k, j, "done");
  return 0;
}

/* This rank's rows among n global slots: their local slots into hs, their
 * positions in the list into hidx. */
static int pick_mine(rank *k, int n, const int32_t *slots) {
  int m = 0;
  for (int i = 0; i < n; i++)
    if (slots[i] % k->d->N == k->id) {
      k->hs[m] = slots[i] / k->d->N;
      k->hidx[m++] = i;
    }
  return m;
}

static int do_read(rank *k, const job *j) {
  const int m = pick_mine(k, j->n, j->slots);
  if (!m) return 0;
  R_MEM(k, !r_put(k, k->rslots, k->hs, (size_t)m * sizeof(int32_t)), "slot upload");
  R_MLA(k, mla_kv_cache_read(k->shard, j->layer, m, k->rslots, k->rcf, k->rrf, MLA_DTYPE_F32));
  R_MEM(k, !r_get(k, k->hcf, k->rcf, (size_t)m * MLA_LATENT * sizeof(float)) &&
               !r_get(k, k->hrf, k->rrf, (size_t)m * MLA_ROPE * sizeof(float)),
        "row download");
  R_MLA(k, mla_ctx_synchronize(k->ctx));
  for (int i = 0; i < m; i++) { /* each rank fills its own rows of the caller's arrays */
    memcpy(j->cf + (size_t)k->hidx[i] * MLA_LATENT, k->hcf + (size_t)i * MLA_LATENT, MLA_LATENT * sizeof(float));
    memcpy(j->rf + (size_t)k->hidx[i] * MLA_ROPE, k->hrf + (size_t)i * MLA_ROPE, MLA_ROPE * sizeof(float));
  }
  return 0;
}

static int do_copy(rank *k, const job *j) {
  int m = 0;
  for (int i = 0; i < j->n; i++)
    if (j->src[i] % k->d->N == k->id) {
      k->hs[m] = j->src[i] / k->d->N;
      k->hs2[m++] = j->dst[i] / k->d->N;
    }
  if (m) R_MLA(k, mla_kv_cache_copy_rows(k->shard, m, k->hs, k->hs2));
  return 0;
}

static void *rank_main(void *arg) {
  rank *k = arg;
  sdcp *d = k->d;
  k->ok = 1;
  job j0;
  memset(&j0, 0, sizeof j0);
  trace(k, &j0, "set-up");
  rank_setup(k);
  trace(k, &j0, "communicator");
#ifdef SDCP_NCCL
  if (!d->desc.host) { /* collective: every rank enters it, set up or not */
    ncclComm_t comm = NULL;
    ncclResult_t nr = ncclCommInitRank(&comm, d->N, d->nid, k->id);
    if (nr != ncclSuccess) r_fail(k, "ncclCommInitRank", ncclGetErrorString(nr));
    else k->comm = comm;
  }
#endif
  trace(k, &j0, "ready");
  pthread_barrier_wait(&d->done);
  for (;;) {
    pthread_barrier_wait(&d->start);
    const job j = d->j;
    if (j.op == OP_EXIT) break;
    if (k->ok) {
      k->timed = 0;
      int rc = j.op == OP_LAYER ? do_layer(k, &j) : j.op == OP_READ ? do_read(k, &j) : do_copy(k, &j);
      if (rc == 0 && mla_ctx_synchronize(k->ctx) != MLA_OK)
        r_fail(k, "mla_ctx_synchronize", mla_ctx_last_error(k->ctx));
#ifdef MLA_CLI_CUDA
      float ms = 0;
      if (k->ok && k->timed &&
          cudaEventElapsedTime(&ms, (cudaEvent_t)k->ev0, (cudaEvent_t)k->ev1) == cudaSuccess) {
        k->xms += ms;
        if (k->timed == 1) k->mms += ms;
      }
#endif
    }
    pthread_barrier_wait(&d->done);
  }
  rank_teardown(k);
  return NULL;
}

/* Hand the ranks a job and wait for all of them. 0, or -1 (d->err). */
static int run_job(sdcp *d, const job *j) {
  if (d->failed) return -1; /* d->err holds the first failure */
  d->j = *j;
  pthread_barrier_wait(&d->start);
  pthread_barrier_wait(&d->done);
  for (int r = 0; r < d->N; r++)
    if (!d->rk[r].ok) {
      snprintf(d->err, sizeof d->err, "rank %d: %s", r, d->rk[r].err[0] ? d->rk[r].err : "failed");
      d->failed = 1;
      return -1;
    }
  return 0;
}

/* ---- public -------------------------------------------------------------- */

int sdcp_available(int world, char *why, size_t why_len) {
#if !defined(MLA_CLI_CUDA)
  (void)world;
  snprintf(why, why_len, "this build has no CUDA (decode context parallel runs on GPUs)");
  return -1;
#elif !defined(SDCP_NCCL)
  (void)world;
  snprintf(why, why_len, "this build has no NCCL (configure with MLA_NCCL_ROOT)");
  return -1;
#else
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();
  if (n < world) {
    snprintf(why, why_len, "needs %d GPUs, %d present", world, n);
    return -1;
  }
  mla_ctx *ctx = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CUDA, 0, 0};
  size_t b = 0;
  if (mla_ctx_create(&cd, &ctx) != MLA_OK) {
    snprintf(why, why_len, "no CUDA context on GPU 0");
    return -1;
  }
  const mla_status st = mla_dcp_merge_workspace_size(ctx, world, 1, 1, MLA_LATENT, MLA_DTYPE_BF16, &b);
  mla_ctx_destroy(ctx);
  if (st != MLA_OK) {
    snprintf(why, why_len, "the library was built without NCCL (mla_dcp_merge_workspace_size: %s)",
             mla_status_string(st));
    return -1;
  }
  return 0;
#endif
}

int sdcp_create(const sdcp_desc *desc, sdcp **out, char *err, size_t err_len) {
  *out = NULL;
  const int N = desc->world;
  if (N < 2 || N > SDCP_MAX_RANKS || (N & (N - 1))) {
    snprintf(err, err_len, "world %d: expected a power of two 2..%d", N, SDCP_MAX_RANKS);
    return -1;
  }
  if (!desc->host && sdcp_available(N, err, err_len)) return -1;
  sdcp *d = calloc(1, sizeof *d);
  if (!d) {
    snprintf(err, err_len, "out of memory");
    return -1;
  }
  d->desc = *desc;
  d->N = N;
  const char *tr = getenv("SDCP_TRACE");
  d->trace = tr && *tr && strcmp(tr, "0") != 0;
  d->es = (int)mla_dtype_size(desc->act);
  /* Rank 0's block holds at most ceil(kv / N) rows of each request. */
  d->m_cap = desc->max_batch * ((desc->max_ctx + N - 1) / N);
  d->read_cap = desc->max_tokens > desc->max_ctx ? desc->max_tokens : desc->max_ctx;
  const size_t B = (size_t)desc->max_batch, i4 = sizeof(int32_t);
  d->ids = malloc(B * i4), d->kv = malloc(B * i4), d->ext = malloc(B * i4), d->iota = malloc(B * i4);
  d->qo = malloc((B + 1) * i4), d->indptr = malloc((B + 1) * i4);
  d->table = malloc(B * desc->max_ctx * i4), d->gslots = malloc(B * desc->max_ctx * i4);
  int oom = !d->ids || !d->kv || !d->ext || !d->iota || !d->qo || !d->indptr || !d->table || !d->gslots;
  for (int r = 0; r < N; r++) oom |= !(d->local[r] = malloc((size_t)(d->m_cap + 1) * i4));
  for (int i = 0; !oom && i < desc->max_batch; i++) d->iota[i] = i;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  if (oom || mla_ctx_create(&cd, &d->cpu) != MLA_OK ||
      mla_dcp_plan_workspace_size(d->cpu, desc->max_batch, desc->max_batch * desc->max_ctx, &d->pwsb) != MLA_OK ||
      !(d->pws = malloc(d->pwsb))) {
    snprintf(err, err_len, "out of memory for the DCP planning buffers");
    sdcp_destroy(d);
    return -1;
  }
#ifdef SDCP_NCCL
  if (!desc->host) {
    setenv("NCCL_NVLS_ENABLE", "0", 0); /* NVLink multicast stays off on shared hosts unless the caller chose */
    ncclResult_t nr = ncclGetUniqueId(&d->nid);
    if (nr != ncclSuccess) {
      snprintf(err, err_len, "ncclGetUniqueId: %s", ncclGetErrorString(nr));
      sdcp_destroy(d);
      return -1;
    }
  }
#endif
  pthread_barrier_init(&d->start, NULL, (unsigned)N + 1);
  pthread_barrier_init(&d->done, NULL, (unsigned)N + 1);
  pthread_barrier_init(&d->peers, NULL, (unsigned)N);
  for (int r = 0; r < N; r++) {
    d->rk[r].d = d;
    d->rk[r].id = r;
    if (pthread_create(&d->th[r], NULL, rank_main, &d->rk[r]) != 0) break;
    d->nthreads++;
  }
  if (d->nthreads < N) { /* the started ranks wait at the set-up barrier forever: nothing to do but stop */
    snprintf(err, err_len, "pthread_create failed");
    fprintf(stderr, "mla demo: --dcp: %s\n", err);
    exit(1);
  }
  pthread_barrier_wait(&d->done); /* every rank set up (or failed) */
  for (int r = 0; r < N; r++)
    if (!d->rk[r].ok) {
      snprintf(err, err_len, "rank %d: %s", r, d->rk[r].err);
      sdcp_destroy(d);
      return -1;
    }
  char name[256] = "GPU";
#ifdef MLA_CLI_CUDA
  struct cudaDeviceProp prop;
  if (!desc->host && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) snprintf(name, sizeof name, "%s", prop.name);
#endif
  if (desc->host)
    snprintf(d->where, sizeof d->where, "%d CPU ranks in one process (exchanges through host memory: a test mode)", N);
  else
    snprintf(d->where, sizeof d->where, "%d x %s", N, name);
  *out = d;
  return 0;
}

void sdcp_destroy(sdcp *d) {
  if (!d) return;
  if (d->nthreads) {
    job j;
    memset(&j, 0, sizeof j);
    j.op = OP_EXIT;
    d->j = j;
    pthread_barrier_wait(&d->start);
    for (int r = 0; r < d->nthreads; r++) pthread_join(d->th[r], NULL);
    pthread_barrier_destroy(&d->start);
    pthread_barrier_destroy(&d->done);
    pthread_barrier_destroy(&d->peers);
  }
  free(d->ids), free(d->kv), free(d->ext), free(d->iota), free(d->qo), free(d->indptr), free(d->table);
  free(d->gslots);
  for (int r = 0; r < SDCP_MAX_RANKS; r++) free(d->local[r]);
  free(d->pws);
  mla_ctx_destroy(d->cpu);
  free(d);
}

const char *sdcp_error(const sdcp *d) { return d ? d->err : ""; }
const char *sdcp_where(const sdcp *d) { return d->where; }
int sdcp_on_gpu(const sdcp *d) { return !d->desc.host; }

int sdcp_batch(sdcp *d, int kind, int bs, const int32_t *ids, const int32_t *kv_lens, const int32_t *ext_lens,
               const int32_t *r2t) {
  const sdcp_desc *s = &d->desc;
  if (bs < 1 || bs > s->max_batch || (kind != SDCP_DECODE && !ext_lens)) {
    snprintf(d->err, sizeof d->err, "sdcp_batch: batch of %d rows (at most %d)", bs, s->max_batch);
    return -1;
  }
  d->kind = kind;
  d->bs = bs;
  d->r2t = r2t;
  d->prepared = 0;
  d->T0 = 0;
  for (int i = 0; i < bs; i++) {
    d->ids[i] = ids[i];
    d->kv[i] = kv_lens[i];
    d->ext[i] = ext_lens ? ext_lens[i] : 1;
    d->qo[i] = d->T0;
    d->T0 += d->ext[i];
  }
  d->qo[bs] = d->T0;
  if (kind != SDCP_EXTEND) return 0;
  /* The gathered layout: the table, and each rank's local slots in the
   * layout's order (its mla_dcp_plan over the batch's global keys). */
  mla_status st = mla_dcp_gather_table(d->cpu, bs, d->kv, d->N, 1, s->max_ctx, d->table, &d->m);
  if (st == MLA_OK && d->m > d->m_cap) st = MLA_ERR_CAPACITY;
  d->indptr[0] = 0;
  for (int i = 0; st == MLA_OK && i < bs; i++) {
    d->indptr[i + 1] = d->indptr[i] + d->kv[i];
    memcpy(d->gslots + d->indptr[i], r2t + (size_t)ids[i] * s->max_ctx, sizeof(int32_t) * (size_t)d->kv[i]);
  }
  for (int r = 0; st == MLA_OK && r < d->N; r++) {
    mla_dcp_plan p;
    memset(&p, 0, sizeof p);
    st = mla_dcp_plan_build(d->cpu, bs, d->kv, d->indptr, d->gslots, r, d->N, d->pws, d->pwsb, &p);
    if (st != MLA_OK) break;
    d->nlocal[r] = p.kv_indptr[bs];
    if (d->nlocal[r] > d->m) st = MLA_ERR_CAPACITY;
    else memcpy(d->local[r], p.kv_indices, sizeof(int32_t) * (size_t)d->nlocal[r]);
  }
  if (st != MLA_OK) {
    snprintf(d->err, sizeof d->err, "gathered layout of the batch: %s (%s)", mla_status_string(st),
             mla_ctx_last_error(d->cpu));
    return -1;
  }
  return 0;
}

int sdcp_layer(sdcp *d, int layer, int T, const int32_t *slots, const void *c, const void *r, const void *q,
               const void *qr, void *out, float *lse) {
  if (T != d->T0) {
    snprintf(d->err, sizeof d->err, "sdcp_layer: %d rows, the batch has %d", T, d->T0);
    return -1;
  }
  job j;
  memset(&j, 0, sizeof j);
  j.op = OP_LAYER;
  j.layer = layer;
  j.T = T;
  j.slots = slots;
  j.c = c, j.r = r, j.q = q, j.qr = qr, j.out = out, j.lse = lse;
  const int rc = run_job(d, &j);
  if (rc == 0 && !d->prepared) d->prepared = 1;
  if (rc == 0 && d->kind == SDCP_DECODE) d->merges++;
  if (rc == 0 && d->kind == SDCP_EXTEND) d->gathers++, d->gathered_rows += (int64_t)d->m * d->N;
  return rc;
}

int sdcp_read(sdcp *d, int layer, int n, const int32_t *slots, float *cf, float *rf) {
  if (n > d->read_cap) {
    snprintf(d->err, sizeof d->err, "sdcp_read: %d rows (at most %d)", n, d->read_cap);
    return -1;
  }
  job j;
  memset(&j, 0, sizeof j);
  j.op = OP_READ;
  j.layer = layer;
  j.n = n;
  j.slots = slots;
  j.cf = cf, j.rf = rf;
  return run_job(d, &j);
}

int sdcp_copy(sdcp *d, int n, const int32_t *src, const int32_t *dst) {
  if (n > d->read_cap) {
    snprintf(d->err, sizeof d->err, "sdcp_copy: %d rows (at most %d)", n, d->read_cap);
    return -1;
  }
  job j;
  memset(&j, 0, sizeof j);
  j.op = OP_COPY;
  j.n = n;
  j.src = src, j.dst = dst;
  return run_job(d, &j);
}

void sdcp_get_stats(const sdcp *d, sdcp_stats *st) {
  memset(st, 0, sizeof *st);
  st->world = d->N;
  for (int r = 0; r < d->N; r++) {
    st->exchange_ms[r] = d->rk[r].xms;
    st->merge_ms[r] = d->rk[r].mms;
    st->shard_rows[r] = d->rk[r].rows;
  }
  st->merges = d->merges;
  st->gathers = d->gathers;
  st->gathered_rows = d->gathered_rows;
}
