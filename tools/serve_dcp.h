/* `mla demo --dcp N`: the serving simulation's attention service under
 * decode context parallel (serve.c calls it; plain C, public API only).
 *
 * N rank threads, one per GPU, each with its own CUDA mla_ctx on GPU r, its
 * stream, its NCCL communicator and its shard of the KV cache: position p of
 * every request lives on rank p mod N, at local slot = global slot / N (the
 * simulation's request table hands out global slots with page size P * N;
 * each shard has page size P and the same page ids). The host thread hands
 * the ranks one job at a time and waits for all of them (a host barrier).
 *
 * Per layer of a batch (sdcp_layer), by the batch's kind (sdcp_batch):
 *  - SDCP_PREFILL (EXTEND without prefix, ragged MHA over the new tokens
 *    only: no cache read): every rank writes its shard of the new rows; rank
 *    0 runs the ragged MHA.
 *  - SDCP_DECODE (one query per request; also the --spec draft steps): every
 *    rank writes its shard of the new rows, runs the DCP DECODE step over its
 *    keys (mla_step_desc.dcp_world / dcp_rank; prepared once per batch), then
 *    mla_dcp_merge_nccl all-gathers the ranks' (o, lse) and merges them.
 *  - SDCP_EXTEND (EXTEND over a cached prefix, and TARGET_VERIFY, which the
 *    DCP step does not take: a verify batch of ndt tokens per request is
 *    exactly an EXTEND with extend_lens = ndt over the committed prefix):
 *    every rank writes its shard of the new rows, then
 *    mla_dcp_gather_kv_nccl pools the batch's rows of the layer into a
 *    gathered cache (page size 1, laid out by mla_dcp_gather_table) on every
 *    rank, and rank 0 runs the EXTEND step over it (prepared once per batch).
 *    Every rank holds the pooled rows; the demo needs one output.
 * No CUDA graphs: each job runs eagerly (the caller says so).
 *
 * Testing without GPUs: with host = 1 the ranks are CPU contexts in this
 * process and the two NCCL exchanges are done through host memory (the same
 * all-gather + merge, and pack + all-gather), so the whole flow runs on a
 * CPU-only machine (MLA_DEMO_DCP_HOST=1 in the environment; serve.c).
 * SDCP_TRACE=1 makes each rank print its stages to stderr (a hang or a
 * failure shows where each rank stood). */
#ifndef MLA_TOOLS_SERVE_DCP_H
#define MLA_TOOLS_SERVE_DCP_H

#include <stddef.h>
#include <stdint.h>

#include "mla.h"

#define SDCP_MAX_RANKS 8

typedef struct sdcp sdcp;

enum { SDCP_PREFILL = 1, SDCP_DECODE = 2, SDCP_EXTEND = 3 };

typedef struct sdcp_desc {
  int world;              /* ranks: power of two 2..SDCP_MAX_RANKS */
  int host;               /* 1: CPU ranks in this process (testing, see above) */
  int threads;            /* host: CPU threads per rank (0 = 1) */
  int layers, num_pages;  /* shard cache: as the global table's pages */
  int page_size;          /* shard page size = the table's page size / world */
  mla_dtype cache_dtype, act;
  int heads;
  float scale;
  int qk_dim, v_dim;      /* ragged MHA (prefill): 192, 128 */
  int max_reqs, max_ctx;  /* the request table's rows and row stride */
  int max_batch, max_tokens; /* requests / query rows of one batch at most */
} sdcp_desc;

typedef struct sdcp_stats {
  int world;
  double exchange_ms[SDCP_MAX_RANKS]; /* per rank: in the NCCL exchanges (CUDA events around them) */
  double merge_ms[SDCP_MAX_RANKS];    /* of which mla_dcp_merge_nccl (decode) */
  int64_t merges, gathers;            /* layer exchanges: decode merges, EXTEND KV all-gathers */
  int64_t gathered_rows;              /* rows pooled by the all-gathers (all ranks' blocks) */
  int64_t shard_rows[SDCP_MAX_RANKS]; /* rows each rank wrote into its shard */
} sdcp_stats;

/* 0 when `world` ranks can run here (a build with CUDA and NCCL, at least
 * world GPUs, a library with NCCL), else -1 with the reason in why. */
int sdcp_available(int world, char *why, size_t why_len);
/* Start the ranks (contexts, shard caches, buffers, communicators). 0, or
 * -1 with the message in err (nothing left running). */
int sdcp_create(const sdcp_desc *desc, sdcp **out, char *err, size_t err_len);
void sdcp_destroy(sdcp *d);
/* The last failure of a call below ("rank r: what: message"). */
const char *sdcp_error(const sdcp *d);
/* "2 x NVIDIA H200" or "2 CPU ranks (host exchange)". */
const char *sdcp_where(const sdcp *d);
int sdcp_on_gpu(const sdcp *d);

/* A new batch (host memory, copied): bs requests ids [bs] of the table
 * r2t [max_reqs, max_ctx] (global slots), each with kv_lens [bs] keys (its
 * new tokens included) and ext_lens [bs] query tokens (DECODE: NULL, one
 * each). The next sdcp_layer prepares the batch's step. 0 or -1. */
int sdcp_batch(sdcp *d, int kind, int bs, const int32_t *ids, const int32_t *kv_lens, const int32_t *ext_lens,
               const int32_t *r2t);
/* One layer of the current batch: T new rows (global slots [T], c [T, 512],
 * r [T, 64] act dtype) written to the shards, then the attention: q is
 * q_nope [T, H, 512] (DECODE, EXTEND; q_rope qr [T, H, 64]) or q | k | v
 * [T, H, 192] | [T, H, 192] | [T, H, 128] (PREFILL); out [T, H, 512] or
 * [T, H, 128] (PREFILL) and lse [T, H] receive rank 0's result. 0 or -1. */
int sdcp_layer(sdcp *d, int layer, int T, const int32_t *slots, const void *c, const void *r, const void *q,
               const void *qr, void *out, float *lse);
/* Rows at n global slots of a layer, gathered from their ranks, as fp32 cf
 * [n, 512], rf [n, 64] (the oracle's read-back). 0 or -1. */
int sdcp_read(sdcp *d, int layer, int n, const int32_t *slots, float *cf, float *rf);
/* Copy-on-write the table did on its metadata only: rows src[i] -> dst[i]
 * (global slots) in every layer, each rank its own. 0 or -1. */
int sdcp_copy(sdcp *d, int n, const int32_t *src, const int32_t *dst);
void sdcp_get_stats(const sdcp *d, sdcp_stats *st);

#endif
