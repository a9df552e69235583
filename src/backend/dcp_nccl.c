/* Decode context parallel: the exchange of the ranks' partial (o, lse)
 * through NCCL and their merge (mla_dcp_merge_workspace_size,
 * mla_dcp_merge_nccl; contract in include/mla.h).
 *
 * All-gather rather than reduce-scatter of weighted o: every rank needs the
 * whole output for the next layer's projections, and the merge weights come
 * from every rank's lse, so a reduce would first need the lse all-gathered
 * anyway. The gathered states land rank-major in the workspace and the CUDA
 * merge kernel of mla_merge_states (src/cuda/prefill_sm90.cu) combines them
 * on the same stream, so the ordering is the stream's: no host wait.
 *
 * Always compiled (the symbols exist in every build); without CUDA or NCCL
 * the calls validate their arguments and return MLA_ERR_UNSUPPORTED. */
#include <stdint.h>

#include "../cache/cache.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/prefill.h"
#include "../cuda/runtime.h"
#endif
#ifdef MLA_WITH_NCCL
#include <nccl.h>
#endif

/* Ranks one merge takes: the CUDA merge kernel's states per launch
 * (MLA_CUDA_MERGE_PASS_STATES). */
#define DCP_MAX_WORLD 128
#ifdef MLA_WITH_CUDA
_Static_assert(DCP_MAX_WORLD <= MLA_CUDA_MERGE_PASS_STATES, "one merge launch takes every rank's state");
#endif
/* Bound on head_dim so world * T * H * dim * 4 bytes cannot overflow. */
#define DCP_MAX_DIM 4096

/* The gathered states in the workspace: [world, T, H, dim] act dtype, then
 * [world, T, H] fp32. */
typedef struct dcp_layout {
  char *o;
  float *lse;
  size_t o_part_bytes;   /* one rank's o: T * H * dim * elem */
  size_t lse_part_bytes; /* one rank's lse: T * H * 4 */
} dcp_layout;

static void dcp_carve(mla_ws *w, int world, int num_tokens, int num_heads, int head_dim, mla_dtype t,
                      dcp_layout *L) {
  const size_t rows = (size_t)num_tokens * (size_t)num_heads;
  L->o_part_bytes = rows * (size_t)head_dim * mla_dtype_size(t);
  L->lse_part_bytes = rows * sizeof(float);
  L->o = mla_ws_take(w, L->o_part_bytes * (size_t)world);
  L->lse = mla_ws_take(w, L->lse_part_bytes * (size_t)world);
}

/* The scalar arguments both calls share. */
static mla_status check_shape(mla_errbuf *eb, const char *fn, int world, int num_tokens, int num_heads,
                              int head_dim, mla_dtype t) {
  if (world < 1 || world > DCP_MAX_WORLD)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "world = %d, expected 1..%d", world, DCP_MAX_WORLD);
  if (num_tokens < 0) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "num_tokens = %d is negative", num_tokens);
  if (num_heads < 1 || num_heads > MLA_MAX_HEADS)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  if (head_dim < 1 || head_dim > DCP_MAX_DIM)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "head_dim = %d, expected 1..%d", head_dim, DCP_MAX_DIM);
  if ((int)t < MLA_DTYPE_F32 || (int)t > MLA_DTYPE_F64)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "act_dtype = %d is not an mla_dtype", (int)t);
  if (!mla_is_act_dtype(t))
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "act_dtype = %s, expected f32, bf16 or f16", mla_dtype_name(t));
  return MLA_OK;
}

/* What this build and context can do: a CUDA context and NCCL compiled in. */
static mla_status check_capable(mla_ctx *ctx, const char *fn) {
  if (ctx->device != MLA_DEVICE_CUDA)
    return mla_fail(&ctx->err, MLA_ERR_UNSUPPORTED, fn,
                    "a CPU context has no NCCL exchange (merge the ranks' states with mla_merge_states)");
#ifndef MLA_WITH_NCCL
  return mla_fail(&ctx->err, MLA_ERR_UNSUPPORTED, fn,
                  "libmla was built without NCCL (configure with MLA_NCCL_ROOT pointing at an NCCL install)");
#else
  return MLA_OK;
#endif
}

mla_status mla_dcp_merge_workspace_size(mla_ctx *ctx, int world, int num_tokens, int num_heads, int head_dim,
                                        mla_dtype act_dtype, size_t *bytes) {
  static const char *const FN = "mla_dcp_merge_workspace_size";
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  if (!bytes) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'bytes' is NULL");
  mla_status st = check_shape(eb, FN, world, num_tokens, num_heads, head_dim, act_dtype);
  if (st != MLA_OK) return st;
  if ((st = check_capable(ctx, FN)) != MLA_OK) return st;
  mla_ws w = mla_ws_counter();
  dcp_layout L;
  dcp_carve(&w, world, num_tokens, num_heads, head_dim, act_dtype, &L);
  *bytes = mla_ws_total(&w);
  return MLA_OK;
}

#ifdef MLA_WITH_NCCL
/* 1 when [a, a + na) and [b, b + nb) share a byte. */
static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
  const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return na && nb && x < y + nb && y < x + na;
}

static mla_status nccl_fail(mla_errbuf *eb, const char *fn, const char *what, ncclResult_t r, ncclComm_t comm) {
  const char *detail = comm ? ncclGetLastError(comm) : NULL;
  return mla_fail(eb, MLA_ERR_DEVICE, fn, "%s: NCCL error %d (%s)%s%s", what, (int)r, ncclGetErrorString(r),
                  detail && *detail ? ": " : "", detail ? detail : "");
}

/* The communicator is the one the arguments describe: size, rank, device;
 * and has no asynchronous error pending (a failed earlier collective or an
 * abort: enqueuing more would only hang or fail later). */
static mla_status check_comm(mla_ctx *ctx, const char *fn, ncclComm_t comm, int world, int rank) {
  mla_errbuf *eb = &ctx->err;
  int n = 0, me = -1, dev = -1;
  ncclResult_t r, async = ncclSuccess;
  if ((r = ncclCommGetAsyncError(comm, &async)) != ncclSuccess) return nccl_fail(eb, fn, "ncclCommGetAsyncError", r, comm);
  if (async != ncclSuccess && async != ncclInProgress)
    return nccl_fail(eb, fn, "the communicator has an asynchronous error", async, comm);
  if ((r = ncclCommCount(comm, &n)) != ncclSuccess) return nccl_fail(eb, fn, "ncclCommCount", r, comm);
  if (n != world)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "world = %d but the communicator has %d ranks", world, n);
  if ((r = ncclCommUserRank(comm, &me)) != ncclSuccess) return nccl_fail(eb, fn, "ncclCommUserRank", r, comm);
  if (me != rank)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "rank = %d but this communicator is rank %d", rank, me);
  if ((r = ncclCommCuDevice(comm, &dev)) != ncclSuccess) return nccl_fail(eb, fn, "ncclCommCuDevice", r, comm);
  if (dev != ctx->device_id)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "the communicator is on CUDA device %d, the context on device %d", dev, ctx->device_id);
  return MLA_OK;
}

/* A non-blocking communicator may leave the group "in progress": the
 * collectives are only on the stream once it settles, and the merge must
 * queue behind them. */
static ncclResult_t settle(ncclComm_t comm, ncclResult_t r) {
  while (r == ncclInProgress) {
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}
#endif

mla_status mla_dcp_merge_nccl(mla_ctx *ctx, void *nccl_comm, int world, int rank, int num_tokens, int num_heads,
                              int head_dim, mla_dtype act_dtype, const void *o_local, const float *lse_local,
                              void *workspace, size_t workspace_bytes, void *out, float *lse_out) {
  static const char *const FN = "mla_dcp_merge_nccl";
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  mla_status st = check_shape(eb, FN, world, num_tokens, num_heads, head_dim, act_dtype);
  if (st != MLA_OK) return st;
  if (rank < 0 || rank >= world)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "rank = %d, expected 0..%d", rank, world - 1);
  if (!nccl_comm) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'nccl_comm' is NULL");
  if (num_tokens > 0) {
    if (!o_local) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'o_local' is NULL");
    if (!lse_local) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'lse_local' is NULL");
    if (!workspace) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'workspace' is NULL");
    if (!out) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'out' is NULL");
  }
  if ((st = check_capable(ctx, FN)) != MLA_OK) return st;
#ifndef MLA_WITH_NCCL
  (void)o_local;
  (void)lse_local;
  (void)workspace;
  (void)workspace_bytes;
  (void)out;
  (void)lse_out;
  return MLA_ERR_UNSUPPORTED; /* check_capable said so */
#else
  ncclComm_t comm = (ncclComm_t)nccl_comm;
  if ((st = check_comm(ctx, FN, comm, world, rank)) != MLA_OK) return st;
  if (num_tokens == 0) return MLA_OK; /* every rank has the same T: no rank waits on this one */
  mla_ws cw = mla_ws_counter();
  dcp_layout L;
  dcp_carve(&cw, world, num_tokens, num_heads, head_dim, act_dtype, &L);
  const size_t need = mla_ws_total(&cw);
  if (workspace_bytes < need)
    return mla_fail(eb, MLA_ERR_WORKSPACE_TOO_SMALL, FN, "workspace_bytes = %zu, need %zu (mla_dcp_merge_workspace_size)",
                    workspace_bytes, need);
  const size_t es = mla_dtype_size(act_dtype);
  if (((uintptr_t)o_local % es) != 0 || ((uintptr_t)out % es) != 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "o_local / out is not aligned to its element size (%zu)", es);
  if (((uintptr_t)lse_local & 3) != 0 || ((uintptr_t)lse_out & 3) != 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "lse_local / lse_out is not 4-byte aligned");
  const void *dev_ptrs[5] = {o_local, lse_local, workspace, out, lse_out};
  static const char *const names[5] = {"o_local", "lse_local", "workspace", "out", "lse_out"};
  for (int k = 0; k < 5; k++)
    if (dev_ptrs[k] && !mla_cuda_is_device_ptr(dev_ptrs[k]))
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "%s is host memory; a CUDA context takes device pointers",
                      names[k]);
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  dcp_carve(&w, world, num_tokens, num_heads, head_dim, act_dtype, &L);
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, FN, "workspace carve overflow");
  /* The gathered region is written by NCCL and read by the merge: none of
   * the caller's tensors may share it. out and lse_out are written last. */
  const void *ws_used = L.o;
  const size_t ws_len = (size_t)((char *)(L.lse) - L.o) + L.lse_part_bytes * (size_t)world;
  if (overlaps(ws_used, ws_len, o_local, L.o_part_bytes) || overlaps(ws_used, ws_len, lse_local, L.lse_part_bytes) ||
      overlaps(ws_used, ws_len, out, L.o_part_bytes) || (lse_out && overlaps(ws_used, ws_len, lse_out, L.lse_part_bytes)))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "the workspace overlaps o_local, lse_local, out or lse_out");
  if (lse_out && overlaps(out, L.o_part_bytes, lse_out, L.lse_part_bytes))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "out and lse_out overlap");

  /* Both gathers in one group: one NCCL launch moves o and lse. Bytes, not
   * typed elements, so the dtype needs no NCCL counterpart. */
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_fail(eb, FN, "ncclGroupStart", r, comm);
  ncclResult_t r1 = ncclAllGather(o_local, L.o, L.o_part_bytes, ncclUint8, comm, ctx->stream);
  ncclResult_t r2 = r1 == ncclSuccess || r1 == ncclInProgress
                        ? ncclAllGather(lse_local, L.lse, L.lse_part_bytes, ncclUint8, comm, ctx->stream)
                        : ncclSuccess;
  r = settle(comm, ncclGroupEnd()); /* always closes the group opened above */
  if (r1 != ncclSuccess && r1 != ncclInProgress) return nccl_fail(eb, FN, "ncclAllGather (o)", r1, comm);
  if (r2 != ncclSuccess && r2 != ncclInProgress) return nccl_fail(eb, FN, "ncclAllGather (lse)", r2, comm);
  if (r != ncclSuccess) return nccl_fail(eb, FN, "ncclGroupEnd", r, comm);

  const void *o_parts[DCP_MAX_WORLD];
  const float *lse_parts[DCP_MAX_WORLD];
  for (int k = 0; k < world; k++) {
    o_parts[k] = L.o + (size_t)k * L.o_part_bytes;
    lse_parts[k] = (const float *)((const char *)L.lse + (size_t)k * L.lse_part_bytes);
  }
  const int e = mla_cuda_merge_launch(world, (int64_t)num_tokens * num_heads, head_dim, (int)act_dtype, 0, o_parts,
                                      lse_parts, out, lse_out, ctx->stream);
  if (e) return mla_cuda_fail(eb, FN, "merge launch", e);
  return MLA_OK;
#endif
}

/* ---- EXTEND under DCP: pooling the shards' rows ------------------------------ */

/* Pack this rank's rows into its block of the gathered cache, then one
 * in-place all-gather of the blocks: NCCL's in-place form (send buffer = the
 * receive buffer at rank * count) moves no byte of this rank's own block. The
 * rows travel as bytes, so every cache format (fp8 scales included) does. */
mla_status mla_dcp_gather_kv_nccl(mla_ctx *ctx, void *nccl_comm, int world, int rank, const mla_kv_cache *shard,
                                  int layer, int num_local_rows, const int32_t *local_slots, int rows_per_rank,
                                  mla_kv_cache *gathered, int gathered_layer, int base_slot) {
  static const char *const FN = "mla_dcp_gather_kv_nccl";
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  if (world < 1 || world > DCP_MAX_WORLD)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "world = %d, expected 1..%d", world, DCP_MAX_WORLD);
  if (rank < 0 || rank >= world)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "rank = %d, expected 0..%d", rank, world - 1);
  if (!nccl_comm) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument 'nccl_comm' is NULL");
  if (!shard || !gathered)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "argument '%s' is NULL", !shard ? "shard" : "gathered");
  if (shard->ctx != ctx || gathered->ctx != ctx)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "%s is not a cache of this context",
                    shard->ctx != ctx ? "shard" : "gathered");
  if (rows_per_rank < 0 || num_local_rows < 0 || num_local_rows > rows_per_rank)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN,
                    "num_local_rows = %d, rows_per_rank = %d: expected 0 <= num_local_rows <= rows_per_rank",
                    num_local_rows, rows_per_rank);
  if (base_slot < 1) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, FN, "base_slot = %d, expected >= 1", base_slot);
  const int64_t end = (int64_t)base_slot + (int64_t)world * rows_per_rank;
  if (end > gathered->num_slots)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, FN, "the blocks need slots up to %lld, the gathered cache has %lld",
                    (long long)end, (long long)gathered->num_slots);
  mla_status st = check_capable(ctx, FN);
  if (st != MLA_OK) return st;
#ifndef MLA_WITH_NCCL
  (void)layer;
  (void)local_slots;
  (void)gathered_layer;
  return MLA_ERR_UNSUPPORTED; /* check_capable said so */
#else
  ncclComm_t comm = (ncclComm_t)nccl_comm;
  if ((st = check_comm(ctx, FN, comm, world, rank)) != MLA_OK) return st;
  /* Every layout argument is checked (the pack's own checks) before the
   * collective: a refusal here enqueues nothing. */
  const int64_t block = (int64_t)base_slot + (int64_t)rank * rows_per_rank;
  if ((st = mla_cache_pack_rows(eb, FN, shard, layer, num_local_rows, local_slots, gathered, gathered_layer,
                                block)) != MLA_OK)
    return st;
  if (rows_per_rank == 0) return MLA_OK; /* every rank has the same M: no rank waits on this one */
  const size_t rb = gathered->row_bytes, count = (size_t)rows_per_rank * rb;
  unsigned char *recv = gathered->layers[gathered_layer] + (size_t)base_slot * rb;
  ncclResult_t r = settle(comm, ncclAllGather(recv + (size_t)rank * count, recv, count, ncclUint8, comm, ctx->stream));
  if (r != ncclSuccess) return nccl_fail(eb, FN, "ncclAllGather (rows)", r, comm);
  return MLA_OK;
#endif
}
