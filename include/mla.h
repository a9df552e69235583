/*
 * libmla: Multi-head Latent Attention for LLM serving engines.
 *
 * Public C API (C11). Every function returns an mla_status unless it is a pure
 * query (version, status string, last-error text). Handles are opaque; every
 * *_destroy accepts NULL. No function allocates on the hot path: attention and
 * plan calls take a caller-owned workspace whose size a *_workspace_size()
 * query reports.
 *
 * Conventions used throughout (see README "Conventions"):
 *  - Shapes are written [dim0, dim1, ...], row-major, innermost last.
 *  - LSE is the natural log of the softmax denominator of the *scaled* logits,
 *    fp32, shape [T, H]. A query with no visible key gets o = 0, lse = -inf.
 *    MLA_FLAG_LSE_BASE2 returns lse * log2(e) instead.
 *  - Causal masks are bottom-right aligned: a request with Q queries and K keys
 *    lets query i (0-based) see keys j <= K - Q + i.
 *  - Geometry: latent width L = 512, rope width R = 64, row width D = 576.
 */
#ifndef MLA_H
#define MLA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(MLA_BUILD_SHARED)
#define MLA_API __declspec(dllexport)
#elif defined(__GNUC__)
#define MLA_API __attribute__((visibility("default")))
#else
#define MLA_API
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */
/* ------------------------------------------------------------------------ */
#define MLA_VERSION_MAJOR 0
#define MLA_VERSION_MINOR 2
#define MLA_VERSION_PATCH 0
#define MLA_VERSION_NUMBER \
  (MLA_VERSION_MAJOR * 10000 + MLA_VERSION_MINOR * 100 + MLA_VERSION_PATCH)

/* MLA_VERSION_NUMBER of the library actually linked. */
MLA_API unsigned mla_version(void);
/* "MAJOR.MINOR.PATCH" of the library actually linked. */
MLA_API const char *mla_version_string(void);

/* ------------------------------------------------------------------------ */
/* Geometry                                                                  */
/* ------------------------------------------------------------------------ */
#define MLA_LATENT 512 /* kv_lora_rank: latent width = absorbed V width */
#define MLA_ROPE 64    /* rope width */
#define MLA_ROW 576    /* MLA_LATENT + MLA_ROPE: one KV cache row */
#define MLA_FP8_BLOCK 128      /* values per fp32 scale in the block-scaled format */
#define MLA_FP8_BLOCK_ROW_BYTES 656 /* 512 e4m3 + 4 fp32 scales + 64 bf16 rope */
#define MLA_MAX_PAGE_SIZE 256
#define MLA_MAX_HEADS 1024
#define MLA_MAX_HEAD_DIM 256   /* ragged MHA: Dqk, Dv <= this */
/* Planner's fill value for block-table entries past a request's pages. */
#define MLA_BLOCK_TABLE_PAD (-1)

/* ------------------------------------------------------------------------ */
/* Status                                                                    */
/* ------------------------------------------------------------------------ */
/* Values are pinned: they never change between versions. */
typedef enum mla_status {
  MLA_OK = 0,
  MLA_ERR_INVALID_ARGUMENT = 1, /* NULL where required, negative or zero size,
                                   malformed shape, non-power-of-two page */
  MLA_ERR_OUT_OF_RANGE = 2,     /* id/index outside the object's bounds
                                   (layer, request id, slot, token position) */
  MLA_ERR_UNSUPPORTED = 3,      /* well-formed but not implemented for this
                                   combination (dtype x mode x device) */
  MLA_ERR_OUT_OF_MEMORY = 4,    /* host or device allocation failed */
  MLA_ERR_CACHE_FULL = 5,       /* the page allocator has too few free pages;
                                   nothing was changed */
  MLA_ERR_WORKSPACE_TOO_SMALL = 6, /* caller workspace below the reported size */
  MLA_ERR_CAPACITY = 7,         /* exceeds a limit fixed at creation
                                   (max_reqs, max_context, max_bs, max_tokens) */
  MLA_ERR_BAD_STATE = 8,        /* call not valid now (request not live, no plan) */
  MLA_ERR_DEVICE = 9,           /* a CUDA / device error; message has details */
  MLA_ERR_INTERNAL = 10         /* a library bug: please report */
} mla_status;

/* Static, never NULL: "MLA_OK", "MLA_ERR_INVALID_ARGUMENT", ...; unknown
 * values give "MLA_ERR_UNKNOWN". */
MLA_API const char *mla_status_string(mla_status s);

/* ------------------------------------------------------------------------ */
/* Data types                                                                */
/* ------------------------------------------------------------------------ */
typedef enum mla_dtype {
  MLA_DTYPE_F32 = 0,
  MLA_DTYPE_BF16 = 1,
  MLA_DTYPE_F16 = 2,
  MLA_DTYPE_FP8_E4M3 = 3,       /* cache only: e4m3fn, one fp32 scale per layer */
  MLA_DTYPE_FP8_E4M3_BLOCK = 4, /* cache only: 656 B/row block-scaled format */
  MLA_DTYPE_F64 = 5             /* reserved for references; not accepted */
} mla_dtype;

/* Bytes per element for F32/BF16/F16/FP8_E4M3; 0 for the block format. */
MLA_API size_t mla_dtype_size(mla_dtype t);
MLA_API const char *mla_dtype_name(mla_dtype t);
/* Convert n elements between F32, BF16, F16 and F64 (round to nearest even;
 * NaN stays NaN; F64 to BF16/F16 rounds through F32). src and dst must not
 * overlap. */
MLA_API mla_status mla_convert(const void *src, mla_dtype src_dtype, void *dst, mla_dtype dst_dtype,
                               int64_t n);

/* ------------------------------------------------------------------------ */
/* Context: device, threads, last error                                      */
/* ------------------------------------------------------------------------ */
typedef struct mla_ctx_s mla_ctx;

typedef enum mla_device { MLA_DEVICE_CPU = 0, MLA_DEVICE_CUDA = 1 } mla_device;

typedef struct mla_ctx_desc {
  mla_device device; /* CPU, or CUDA (UNSUPPORTED when built without CUDA,
                        DEVICE when no GPU is present) */
  int num_threads;   /* CPU worker threads; 0 = number of online CPUs */
  int device_id;     /* CUDA device ordinal (CUDA contexts) */
} mla_ctx_desc;

/* desc may be NULL (CPU, all cores). */
MLA_API mla_status mla_ctx_create(const mla_ctx_desc *desc, mla_ctx **out);
MLA_API void mla_ctx_destroy(mla_ctx *ctx);
MLA_API mla_status mla_ctx_set_threads(mla_ctx *ctx, int num_threads);
MLA_API mla_status mla_ctx_get_threads(const mla_ctx *ctx, int *num_threads);
/* Name of the CPU micro-kernel build this process uses for the CPU kernels
 * ("scalar", "avx2" or "avx512"; chosen from the CPU's features on first use,
 * or forced by MLA_CPU_ISA in the environment). *name is static. The choice
 * is per process, not per context; ctx must be a CPU context (UNSUPPORTED
 * otherwise). */
MLA_API mla_status mla_ctx_cpu_isa(const mla_ctx *ctx, const char **name);
/* Text of the last failure on this handle ("" if none); valid until the next
 * call on the handle. NULL handle gives a static message. */
MLA_API const char *mla_ctx_last_error(const mla_ctx *ctx);
MLA_API mla_status mla_ctx_get_device(const mla_ctx *ctx, mla_device *device);
/* CUDA contexts: the cudaStream_t every launch goes to (NULL = the legacy
 * default stream, the initial value). UNSUPPORTED on a CPU context. */
MLA_API mla_status mla_ctx_set_stream(mla_ctx *ctx, void *cuda_stream);
/* Wait for the context's work (CUDA: the stream). Device kernels cannot
 * return a status for a bad value they read from device memory (a slot out of
 * range): they skip it and count it; this call reports such skips since the
 * last call as OUT_OF_RANGE, and CUDA errors as DEVICE. */
MLA_API mla_status mla_ctx_synchronize(mla_ctx *ctx);

/* ------------------------------------------------------------------------ */
/* Paged latent KV cache                                                     */
/* ------------------------------------------------------------------------ */
/* Per layer: num_pages * page_size rows ("slots") of one MLA_ROW-wide row.
 * Slot s lives in page s / page_size. Page 0 is reserved as the dummy target
 * of padded rows (the request table never hands it out). */
typedef struct mla_kv_cache_s mla_kv_cache;

typedef struct mla_kv_cache_desc {
  int num_layers;     /* >= 1 */
  int num_pages;      /* >= 2 (page 0 reserved) */
  int page_size;      /* power of two, 1..256 */
  mla_dtype dtype;    /* BF16, F16, FP8_E4M3, FP8_E4M3_BLOCK */
  const float *fp8_scales; /* [num_layers] for FP8_E4M3, NULL = all 1.0; >0 */
} mla_kv_cache_desc;

MLA_API mla_status mla_kv_cache_create(mla_ctx *ctx, const mla_kv_cache_desc *desc,
                                       mla_kv_cache **out);
MLA_API void mla_kv_cache_destroy(mla_kv_cache *cache);
MLA_API const char *mla_kv_cache_last_error(const mla_kv_cache *cache);
/* Copy of the creation descriptor (fp8_scales points into the cache). */
MLA_API mla_status mla_kv_cache_get_desc(const mla_kv_cache *cache, mla_kv_cache_desc *desc);
/* Bytes of one row: 1152 (bf16/f16), 576 (fp8 per-tensor), 656 (fp8 block). */
MLA_API mla_status mla_kv_cache_row_bytes(const mla_kv_cache *cache, size_t *bytes);
/* Raw storage of one layer: [num_pages * page_size, row_bytes]; device
 * memory for a cache of a CUDA context. */
MLA_API mla_status mla_kv_cache_layer_data(mla_kv_cache *cache, int layer, void **data);
MLA_API mla_status mla_kv_cache_set_fp8_scale(mla_kv_cache *cache, int layer, float scale);

/* Scatter T rows: row t of c [T,512] and r [T,64] (src_dtype F32/BF16/F16,
 * contiguous) goes to slot slots[t] of `layer`, converted/quantized to the
 * cache dtype (fp8: divide by the scale, saturate to +-448, round to nearest
 * even; NaN stays NaN). Duplicate slots: the last row wins. Every slot is
 * checked before anything is written.
 * CUDA caches: slots, c and r are device memory (host pointers are refused),
 * the call is asynchronous on the context's stream, a slot out of range is
 * skipped and reported by mla_ctx_synchronize, and with duplicate slots one
 * of the rows wins (which one is unspecified). */
MLA_API mla_status mla_kv_cache_write(mla_kv_cache *cache, int layer, int num_tokens,
                                      const int32_t *slots /* [T] */,
                                      const void *c /* [T, 512] */,
                                      const void *r /* [T, 64] */, mla_dtype src_dtype);
/* Gather T rows back, dequantized to dst_dtype (F32/BF16/F16). c_out or r_out
 * may be NULL to skip that part. CUDA caches: device pointers, asynchronous,
 * bad slots as for write. */
MLA_API mla_status mla_kv_cache_read(const mla_kv_cache *cache, int layer, int num_tokens,
                                     const int32_t *slots /* [T] */,
                                     void *c_out /* [T, 512] */, void *r_out /* [T, 64] */,
                                     mla_dtype dst_dtype);
/* Decode context parallel: this rank's share of a KV write. global_slots
 * are the allocator's (global) slots; a row whose slot mod world != rank
 * belongs to another rank and is skipped, the others go to local slot
 * global / world of this rank's cache. world: power of two 1..64. */
MLA_API mla_status mla_kv_cache_write_shard(mla_kv_cache *cache, int layer, int num_tokens,
                                            const int32_t *global_slots /* [T] */,
                                            const void *c /* [T, 512] */, const void *r /* [T, 64] */,
                                            mla_dtype src_dtype, int world, int rank);

/* Copy rows src_slots[i] -> dst_slots[i] in every layer (bytes as stored).
 * The slot arrays are host memory for every cache (this is allocator work). */
MLA_API mla_status mla_kv_cache_copy_rows(mla_kv_cache *cache, int num_rows,
                                          const int32_t *src_slots, const int32_t *dst_slots);

/* ------------------------------------------------------------------------ */
/* Request table + page allocator (req_to_token)                             */
/* ------------------------------------------------------------------------ */
/* req_to_token: int32 [max_reqs, max_context], slot of each position of each
 * live request; entries past a request's length hold MLA_SLOT_UNUSED.
 * Allocation is page-aligned: positions [k*P, (k+1)*P) of a request live in
 * one page, at offsets 0..P-1. Pages are reference counted: a fork shares the
 * parent's prefix pages; writing (extend) into a page whose count is > 1
 * first copies it to a fresh page (copy-on-write, rows copied in every layer
 * of the attached cache). */
#define MLA_SLOT_UNUSED 0 /* slot 0 is the reserved dummy row */
typedef struct mla_req_table_s mla_req_table;

typedef struct mla_req_table_desc {
  int max_reqs;    /* >= 1: request ids are 0..max_reqs-1 */
  int max_context; /* >= 1: max tokens per request */
  int num_pages;   /* must equal the cache's when a cache is attached */
  int page_size;   /* must equal the cache's when a cache is attached */
} mla_req_table_desc;

/* cache may be NULL (metadata only: copy-on-write then moves no data). */
MLA_API mla_status mla_req_table_create(mla_ctx *ctx, const mla_req_table_desc *desc,
                                        mla_kv_cache *cache, mla_req_table **out);
MLA_API void mla_req_table_destroy(mla_req_table *rt);
MLA_API const char *mla_req_table_last_error(const mla_req_table *rt);
MLA_API mla_status mla_req_table_get_desc(const mla_req_table *rt, mla_req_table_desc *desc);

/* New empty request; *req_id = lowest free id. CAPACITY when all are live. */
MLA_API mla_status mla_req_add(mla_req_table *rt, int32_t *req_id);
/* Append n >= 0 positions; their slots are written to slots_out [n] (may be
 * NULL). All-or-nothing: CACHE_FULL / CAPACITY leave every request as it was. */
MLA_API mla_status mla_req_extend(mla_req_table *rt, int32_t req_id, int n, int32_t *slots_out);
/* Release a request and its page references. */
MLA_API mla_status mla_req_free(mla_req_table *rt, int32_t req_id);
/* New request sharing positions [0, prefix_len) of src (prefix_len <= src's
 * length); *new_id receives its id. Shares pages, copies nothing now. */
MLA_API mla_status mla_req_fork(mla_req_table *rt, int32_t src_id, int prefix_len,
                                int32_t *new_id);
/* Shrink to new_len <= length (roll back rejected drafts); whole pages past
 * the new length are released. */
MLA_API mla_status mla_req_truncate(mla_req_table *rt, int32_t req_id, int new_len);
MLA_API mla_status mla_req_length(const mla_req_table *rt, int32_t req_id, int *len);
MLA_API mla_status mla_req_is_live(const mla_req_table *rt, int32_t req_id, int *live);
/* Pointer to req_to_token [max_reqs, max_context] (row stride = max_context). */
MLA_API mla_status mla_req_table_data(const mla_req_table *rt, const int32_t **req_to_token);
MLA_API mla_status mla_req_table_free_pages(const mla_req_table *rt, int *free_pages);
/* Reference count of a page (0 = free); page 0 reports 1 (reserved). */
MLA_API mla_status mla_req_table_page_refs(const mla_req_table *rt, int page, int *refs);

/* ------------------------------------------------------------------------ */
/* Forward modes and batch description                                       */
/* ------------------------------------------------------------------------ */
typedef enum mla_mode {
  MLA_MODE_IDLE = 0,          /* nothing to do; batch_size may be 0 */
  MLA_MODE_DECODE = 1,        /* 1 query/request, kv = seq_lens[i] (incl. this token) */
  MLA_MODE_TARGET_VERIFY = 2, /* num_draft_tokens queries, kv = seq_lens[i] + ndt, causal */
  MLA_MODE_DRAFT_EXTEND = 3,  /* extend_lens[i] queries (varlen) or a fixed window of
                                 num_draft_tokens queries when extend_lens == NULL;
                                 kv = seq_lens[i], causal */
  MLA_MODE_EXTEND = 4         /* extend_lens[i] = seq_lens[i] - prefix_lens[i] queries,
                                 kv = seq_lens[i], causal; prefix_lens NULL = no prefix */
} mla_mode;

/* A batch row whose req_ids entry is MLA_REQ_PAD is padding (CUDA-graph
 * batches padded to a captured size): its keys are all the reserved dummy
 * slot 0 (page 0), it reads and writes nothing else, and its output rows are
 * to be ignored. Give such rows seq_len 1. */
#define MLA_REQ_PAD (-1)

typedef struct mla_batch {
  mla_mode mode;
  int32_t batch_size;          /* >= 0 */
  const int32_t *req_ids;      /* [bs] rows of req_to_token, or MLA_REQ_PAD */
  const int32_t *seq_lens;     /* [bs] see mla_mode */
  const int32_t *extend_lens;  /* [bs] DRAFT_EXTEND varlen; EXTEND: optional check */
  const int32_t *prefix_lens;  /* [bs] EXTEND only; NULL = all zero */
  int32_t num_draft_tokens;    /* TARGET_VERIFY ndt; DRAFT_EXTEND fixed window W */
} mla_batch;

/* ------------------------------------------------------------------------ */
/* Plan (metadata)                                                           */
/* ------------------------------------------------------------------------ */
/* Fixed capacities a plan workspace is sized for. */
typedef struct mla_plan_limits {
  int max_bs;          /* max requests per batch */
  int max_q_tokens;    /* max total query rows per batch */
  int max_kv_tokens;   /* max total visible keys per batch (sum of kv lens) */
  int max_context;     /* max kv length of one request */
  int page_size;       /* power of two 1..256 */
  int num_sm;          /* SM (or worker) count the split schedule targets, >= 1 */
  unsigned flags;      /* MLA_PLAN_* */
} mla_plan_limits;

/* The plan holds no token-level kv_indices (plan.kv_indices = NULL; every
 * other array as usual): planning then costs O(pages), not O(keys), which is
 * what a GPU consumer needs (its kernels read the block table). The CPU
 * attention takes such a plan too: it derives the slots from the block table
 * into its workspace (mla_attention_absorbed_workspace_size counts them). */
#define MLA_PLAN_PAGES_ONLY 1u

/* Split-KV schedule (FlashMLA's rule as baseline): KV is cut into 64-token
 * blocks; each request costs ceil(kv/64) + MLA_SCHED_FIXED_OVERHEAD blocks;
 * the total is spread over num_sm_parts = max(1, num_sm / ceil(q_per_req*H/64))
 * parts, walked greedily in request order with a payload of q + overhead
 * blocks per part: q the smallest that fits, or FlashMLA's ceil(total/parts)
 * when the smaller q would cut the batch into more pieces. When q cuts a
 * request (any mode but EXTEND), the smallest q' <= q + q /
 * MLA_SCHED_NOCUT_DIV (16) at which the parts hold whole requests only is
 * taken instead, if there is one: no request is cut and no combine runs
 * (b=128 H=128 s_k=8192 over 66 parts: q = 258 cuts 62 requests, q' = 261
 * fits two whole requests a part: 5-7 % faster on an H100). Part p covers the
 * token range [begin_req:begin_tok, end_req:end_tok) (end exclusive; a part
 * may span several requests). Request i is cut into num_splits[i+1]-num_splits[i]
 * pieces, piece k's partial state index being num_splits[i] + k. A request
 * with one piece needs no combine. */
#define MLA_SCHED_BLOCK 64
#define MLA_SCHED_FIXED_OVERHEAD 5
#define MLA_SCHED_NOCUT_DIV 16
#define MLA_SCHED_META_INTS 8
enum {
  MLA_SCHED_BEGIN_REQ = 0,   /* first request (batch index) of the part */
  MLA_SCHED_BEGIN_TOK = 1,   /* first kv token of begin_req */
  MLA_SCHED_END_REQ = 2,     /* last request of the part (inclusive) */
  MLA_SCHED_END_TOK = 3,     /* end kv token (exclusive) within end_req */
  MLA_SCHED_BEGIN_SPLIT = 4, /* piece index (within begin_req) of the first piece */
  MLA_SCHED_NUM_REQS = 5     /* end_req - begin_req + 1, or 0 for an empty part */
  /* 6, 7: reserved, zero */
};

typedef struct mla_plan {
  mla_mode mode;
  int32_t batch_size;
  int32_t num_q_tokens;      /* qo_indptr[bs] */
  int32_t num_kv_tokens;     /* kv_indptr[bs] */
  int32_t max_q_len;
  int32_t max_kv_len;
  int32_t causal;            /* 1 for every mode with several queries/request */
  int32_t page_size;
  int32_t block_table_width; /* pages per block-table row = ceil(max_kv_len / P) */
  int32_t num_heads;         /* heads the split schedule was sized for */
  const int32_t *req_ids;    /* [bs] */
  const int32_t *qo_indptr;  /* [bs+1] query row offsets */
  const int32_t *kv_indptr;  /* [bs+1] kv token offsets */
  const int32_t *kv_lens;    /* [bs] */
  const int32_t *kv_indices; /* [num_kv_tokens] slot of each visible key (NULL: MLA_PLAN_PAGES_ONLY) */
  const int32_t *page_indptr;  /* [bs+1] */
  const int32_t *page_indices; /* [page_indptr[bs]] page id of each used page */
  const int32_t *block_table;  /* [bs, block_table_width], MLA_BLOCK_TABLE_PAD past */
  int32_t num_sm_parts;
  const int32_t *sched_meta;   /* [num_sm_parts, MLA_SCHED_META_INTS] */
  const int32_t *num_splits;   /* [bs+1] prefix sums of pieces per request */
  int32_t total_splits;        /* num_splits[bs] */
} mla_plan;

MLA_API mla_status mla_plan_workspace_size(mla_ctx *ctx, const mla_plan_limits *lim,
                                           size_t *bytes);
/* Build a plan for `batch` from the request table into `workspace` (host
 * memory; the plan's pointers point into it, so the plan is valid while the
 * workspace is unchanged). num_heads sizes the split schedule. Fails with
 * CAPACITY when the batch exceeds `lim`, OUT_OF_RANGE for a request id
 * outside the table or a kv length past the request's length in the table,
 * BAD_STATE for a request that is not live. rt may be NULL for IDLE. */
MLA_API mla_status mla_plan_build(mla_ctx *ctx, const mla_req_table *rt, const mla_batch *batch,
                                  const mla_plan_limits *lim, int num_heads, void *workspace,
                                  size_t workspace_bytes, mla_plan *plan);

/* Chunked-prefix plan (EXTEND with prefix through MHA): the prefixes are cut
 * into chunks of chunk_len = max(1, chunk_capacity / bs) tokens per request;
 * chunk c of request i covers prefix positions [c*chunk_len,
 * min((c+1)*chunk_len, prefix_lens[i])). */
typedef struct mla_chunk_plan {
  int32_t batch_size;
  int32_t num_chunks;       /* ceil(max prefix / chunk_len); 0 when no prefix */
  int32_t chunk_len;
  const int32_t *starts;    /* [num_chunks, bs] first prefix position */
  const int32_t *lens;      /* [num_chunks, bs] tokens (may be 0) */
  const int32_t *cu_seq_lens; /* [num_chunks, bs+1] prefix sums of lens */
  const int32_t *max_lens;  /* [num_chunks] */
  const int32_t *slot_indptr; /* [num_chunks+1] offsets into slots */
  const int32_t *slots;     /* [total prefix tokens] chunk-major, then request */
} mla_chunk_plan;

MLA_API mla_status mla_chunk_plan_workspace_size(mla_ctx *ctx, int max_bs,
                                                 int max_prefix_tokens, int chunk_capacity,
                                                 size_t *bytes);
MLA_API mla_status mla_chunk_plan_build(mla_ctx *ctx, const mla_req_table *rt, int batch_size,
                                        const int32_t *req_ids /* [bs] */,
                                        const int32_t *prefix_lens /* [bs] */,
                                        int chunk_capacity, void *workspace,
                                        size_t workspace_bytes, mla_chunk_plan *plan);

/* Multi-step draft decode (EAGLE/MTP, topk = 1): step i (0 <= i < num_steps)
 * has one query per request and kv_len = seq_lens[r] + i + 1, keys being
 * req_to_token[req, 0 : kv_len]. Built for all steps in one call. */
typedef struct mla_draft_plan {
  int32_t batch_size;
  int32_t num_steps;
  const int32_t *kv_indptr;  /* [num_steps, bs+1] */
  const int32_t *kv_indices; /* step i at offset step_offset[i] */
  const int32_t *step_offset;/* [num_steps+1] offsets into kv_indices */
} mla_draft_plan;

MLA_API mla_status mla_draft_plan_workspace_size(mla_ctx *ctx, int max_bs, int num_steps,
                                                 int max_context, size_t *bytes);
MLA_API mla_status mla_draft_plan_build(mla_ctx *ctx, const mla_req_table *rt, int batch_size,
                                        const int32_t *req_ids /* [bs] */,
                                        const int32_t *seq_lens /* [bs] */, int num_steps,
                                        void *workspace, size_t workspace_bytes,
                                        mla_draft_plan *plan);

/* Decode context parallel: position p of every request lives on rank p mod N,
 * in that rank's cache at local slot = global slot / N. For rank r the local
 * kv length of a request of length K is the count of p < K with p mod N == r. */
typedef struct mla_dcp_plan {
  int32_t batch_size;
  int32_t rank, world;
  const int32_t *kv_lens;    /* [bs] local lengths */
  const int32_t *kv_indptr;  /* [bs+1] */
  const int32_t *kv_indices; /* [kv_indptr[bs]] local slots, in position order */
} mla_dcp_plan;

MLA_API mla_status mla_dcp_plan_workspace_size(mla_ctx *ctx, int max_bs, int max_kv_tokens,
                                               size_t *bytes);
/* kv_lens [bs] and kv_indptr [bs+1] / kv_indices describe the global (token
 * granularity) keys, e.g. a plan's arrays. */
MLA_API mla_status mla_dcp_plan_build(mla_ctx *ctx, int batch_size, const int32_t *kv_lens,
                                      const int32_t *kv_indptr, const int32_t *kv_indices,
                                      int rank, int world, void *workspace,
                                      size_t workspace_bytes, mla_dcp_plan *plan);

/* ------------------------------------------------------------------------ */
/* Attention kernels                                                         */
/* ------------------------------------------------------------------------ */
#define MLA_FLAG_LSE_BASE2 1u /* lse returned as log2 of the denominator */
#define MLA_FLAG_OUT_F32 2u   /* mla_attention_ragged: out is fp32 whatever
                                 act_dtype is (for partial states to merge) */
/* Absorbed attention (mla_attention_absorbed, mla_step_attention,
 * mla_backend_forward) over an FP8_E4M3 (per-tensor) cache: permission to
 * run Q.K^T and P.V on fp8 tensor cores. q is quantized to e4m3 on the fly
 * (one power-of-two scale per 64-row block of (query token, head) rows of a
 * request) and the softmax weights P are rounded to e4m3; expect a relative
 * error of the output up to ~2e-2 instead of the exact path's ~4e-3. Used by
 * the CUDA backend where it pays (blocks of more than 32 rows, i.e.
 * max_q_len * H > 32, page size >= 8); everywhere else (other caches, the
 * CPU backend, few heads) the call computes exactly as without the flag. */
#define MLA_FLAG_FP8_MATH 4u

/* Absorbed MLA over the paged latent cache, for every mode the plan
 * describes: query row t of request i (qo_indptr[i] <= t < qo_indptr[i+1])
 * attends to that request's plan kv_indices, bottom-right causal when
 * plan->causal. s_j = scale * (q_nope.c_j + q_rope.r_j); o = sum softmax * c_j. */
typedef struct mla_absorbed_args {
  int num_heads;          /* 1..MLA_MAX_HEADS */
  float scale;            /* softmax scale (> 0, finite) */
  unsigned flags;         /* MLA_FLAG_* */
  mla_dtype act_dtype;    /* dtype of q and out: F32, BF16, F16 */
  const void *q_nope;     /* [Tq, H, 512] at the strides below */
  const void *q_rope;     /* [Tq, H, 64] */
  int64_t q_stride_token; /* elements between tokens; 0 = H*512 (nope) / H*64 (rope) */
  int64_t q_stride_head;  /* elements between heads; 0 = 512 (nope) / 64 (rope) */
  void *out;              /* [Tq, H, 512] contiguous */
  float *lse;             /* [Tq, H] or NULL */
} mla_absorbed_args;

MLA_API mla_status mla_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                         int num_heads, size_t *bytes);
MLA_API mla_status mla_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                          const mla_plan *plan, const mla_absorbed_args *args,
                                          void *workspace, size_t workspace_bytes);

/* Ragged MHA: request i owns query rows [qo_indptr[i], qo_indptr[i+1]) and
 * key/value rows [kv_indptr[i], kv_indptr[i+1]). num_kv_heads divides
 * num_heads (grouped queries). Optional logit soft cap (> 0 enables):
 * s = cap * tanh(scale * q.k / cap). */
typedef struct mla_ragged_args {
  int batch_size;
  int num_heads, num_kv_heads;
  int qk_dim, v_dim;         /* 1..MLA_MAX_HEAD_DIM each; default 192 / 128 */
  float scale;
  float softcap;             /* 0 = off */
  int causal;                /* bottom-right */
  unsigned flags;
  mla_dtype act_dtype;       /* F32, BF16, F16 for q, k, v and out */
  const int32_t *qo_indptr;  /* [bs+1] */
  const int32_t *kv_indptr;  /* [bs+1] */
  const void *q;             /* [Tq, H, qk_dim] */
  const void *k;             /* [Tk, Hkv, qk_dim] */
  const void *v;             /* [Tk, Hkv, v_dim] */
  void *out;                 /* [Tq, H, v_dim] */
  float *lse;                /* [Tq, H] or NULL */
  /* Optional (NULL: none). CUDA contexts: device memory of at least
   * mla_attention_ragged_workspace_size bytes, 4-byte aligned, that no other
   * call uses while this one may run (another stream, a graph replayed
   * meanwhile). With it the sm_90a kernel hands out its work items to CTAs as
   * they become free (a counter the call zeroes on the stream before its
   * launch) instead of in a fixed order, which evens the SMs' loads on long
   * causal sequences. The result is the same bits either way. The CPU path
   * ignores it. */
  void *workspace;
  size_t workspace_bytes;
} mla_ragged_args;

/* Bytes of the optional mla_ragged_args workspace this context uses (0 on a
 * CPU context; a constant per context). */
MLA_API mla_status mla_attention_ragged_workspace_size(mla_ctx *ctx, size_t *bytes);
MLA_API mla_status mla_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args);

/* Merge n partial states over the same queries:
 * o = sum_k w_k o_k / sum_k w_k, w_k = exp(lse_k - max), lse = max + ln sum w.
 * All sides empty (lse = -inf) gives o = 0, lse = -inf; never NaN from an
 * empty side. out may alias o_parts[0] (in place); lse_out may alias
 * lse_parts[0]. lse inputs/outputs are natural log unless flags has
 * MLA_FLAG_LSE_BASE2 (then both are base 2). Any num_states >= 1; on a CUDA
 * context more than 2032 states run in passes and need lse_out (else
 * MLA_ERR_UNSUPPORTED), out rounded to act_dtype once per pass. */
MLA_API mla_status mla_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads,
                                    int head_dim, mla_dtype act_dtype, unsigned flags,
                                    const void *const *o_parts /* n x [T, H, dim] */,
                                    const float *const *lse_parts /* n x [T, H] */,
                                    void *out /* [T, H, dim] */, float *lse_out /* [T, H] */);

/* Gather latent rows (dequantized) for the MHA paths: row t = slot slots[t]. */
MLA_API mla_status mla_gather_latent(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                     int num_tokens, const int32_t *slots /* [T] */,
                                     mla_dtype dst_dtype, void *c_out /* [T, 512] */,
                                     void *r_out /* [T, 64] */);

/* The k/v expansion helper of chunked-prefix MHA (a plain matmul on the CPU):
 * k[t,h,0:nope] = c[t] . w_kc[h], k[t,h,nope:nope+64] = r[t],
 * v[t,h,:] = c[t] . w_vc[h], with kv_b_proj = [H, nope + v_dim, 512] (per head
 * the nope rows then the v rows, as DeepSeek's kv_b_proj weight).
 * c and r are in latent_dtype (F32 keeps dequantized fp8 rows exact);
 * kv_b_proj, k_out and v_out in act_dtype. Accumulation is fp32. */
MLA_API mla_status mla_expand_kv(mla_ctx *ctx, int num_tokens, int num_heads, int nope_dim,
                                 int v_dim, mla_dtype latent_dtype, mla_dtype act_dtype,
                                 const void *c /* [T, 512] */, const void *r /* [T, 64] */,
                                 const void *kv_b_proj /* [H, nope+v_dim, 512] */,
                                 void *k_out /* [T, H, nope+64] */,
                                 void *v_out /* [T, H, v_dim] */);

/* ------------------------------------------------------------------------ */
/* Device-built steps (CUDA graphs)                                          */
/* ------------------------------------------------------------------------ */
/* A decode-type step whose metadata is built where the kernels run, from
 * fixed-address inputs: mla_step_prepare turns (req_to_token, req_ids,
 * seq_lens) into the block table, kv lengths and split schedule inside the
 * step workspace, then mla_step_attention runs each layer from them. On a
 * CUDA context every pointer is device memory and both calls only enqueue
 * kernels on the context's stream (no host sync, no allocation, no copy), so
 * a whole step can be captured in a CUDA graph and replayed after the engine
 * rewrites the inputs in place. On a CPU context the same calls run on host
 * memory (the reference the device path is tested against).
 *
 * Row i reads req_to_token[req_ids[i], 0 : kv_len] where kv_len follows the
 * mode as in mla_batch (DECODE seq_len, TARGET_VERIFY seq_len + ndt,
 * DRAFT_EXTEND seq_len with a fixed window of ndt queries, EXTEND seq_len
 * with extend_lens[i] queries, see num_tokens). Only the slot at
 * the start of each page is read (slot / page_size is the page), as the
 * allocator places positions page-aligned. A row with req_ids[i] ==
 * MLA_REQ_PAD reads page 0 only. A row whose request id, length or page ids
 * are out of range is not attended (o = 0, lse = -inf) and counted: the next
 * mla_ctx_synchronize returns MLA_ERR_OUT_OF_RANGE (CPU: mla_step_prepare
 * returns it and writes nothing). Liveness and request lengths are host
 * state the device cannot see: positions past a request's end hold
 * MLA_SLOT_UNUSED and read page 0. The metadata equals mla_plan_build's for
 * the same batch and num_sm (the block table is max_kv_len / page_size wide). */
typedef struct mla_step_desc {
  mla_mode mode;             /* DECODE, TARGET_VERIFY, DRAFT_EXTEND (fixed window), or EXTEND */
  int32_t batch_size;        /* rows of the step (e.g. a graph's batch bucket), 1..8192 */
  int32_t num_draft_tokens;  /* TARGET_VERIFY ndt / DRAFT_EXTEND window 1..64; DECODE: 0 */
  int32_t max_kv_len;        /* bound on each row's kv length, 1..2^30 */
  int32_t num_heads;         /* 1..MLA_MAX_HEADS */
  int32_t page_size;         /* the cache's page size */
  int32_t num_sm;            /* split-schedule target 0..1024; 0 = the device's SMs (CPU: workers) */
  /* Multi-step draft decode (EAGLE/MTP, topk = 1): num_steps >= 1 makes the
   * workspace hold num_steps DECODE steps built by one mla_step_prepare,
   * step i with kv length seq_len + i + 1 (mode must be DECODE); `step`
   * (0..num_steps-1) picks the one mla_step_attention / get_metadata use.
   * num_steps = 0: one ordinary step (`step` must be 0). At most 16 steps. */
  int32_t num_steps;
  int32_t step;
  /* Decode context parallel (DECODE only): dcp_world N > 1 (power of two)
   * ranks, position p of a request living on rank p mod N at local slot =
   * global slot / N. req_to_token stays global (its page size is page_size *
   * N; N divides it, so slot mod N = position mod N), the cache is this
   * rank's (page_size, the same page ids), and the step attends the rank's
   * keys; merge the ranks' (o, lse) with mla_merge_states. 0 or 1: off. */
  int32_t dcp_world;
  int32_t dcp_rank;
  /* EXTEND steps: the paged absorbed prefill over a cached prefix, capturable
   * at a fixed token count (engines that capture prefill piecewise). Row i
   * has extend_lens[i] query tokens (mla_step_inputs.extend_lens, 0 ..
   * seq_lens[i]) and kv length seq_lens[i] (prefix included), causal
   * bottom-right; its queries follow the rows before it (qo_indptr is the
   * running sum, built on the device). num_tokens is the bucket: the most
   * query tokens of the whole batch (q and out hold that many rows; rows past
   * the real total are left untouched). A batch whose extend lens add up to
   * more is not attended at all (counted like a bad row). 1..65536 with
   * num_tokens * num_heads <= 4194240 (the kernels' grid); 0 for the other
   * modes. num_draft_tokens must be 0, dcp_world and num_steps 0 or 1/0. */
  int32_t num_tokens;
} mla_step_desc;

typedef struct mla_step_inputs {
  const int32_t *req_to_token; /* [max_reqs, req_to_token_stride] slot of each position */
  int64_t req_to_token_stride; /* elements per row, >= max_kv_len */
  int32_t max_reqs;            /* rows of req_to_token */
  const int32_t *req_ids;      /* [bs] row of req_to_token or MLA_REQ_PAD */
  const int32_t *seq_lens;     /* [bs] see mla_mode */
  const int32_t *extend_lens;  /* [bs] EXTEND steps: query tokens of each row; NULL otherwise */
} mla_step_inputs;

/* What mla_step_prepare writes, as pointers into the workspace (device
 * memory on a CUDA context), e.g. to hand the block table to other kernels. */
typedef struct mla_step_metadata {
  int32_t batch_size, q_len, block_table_width, num_sm_parts, max_splits;
  const int32_t *qo_indptr;   /* [bs+1] i * q_len (EXTEND: running sum of extend_lens; q_len is num_tokens) */
  const int32_t *kv_lens;     /* [bs] (0 for a row found out of range) */
  const int32_t *block_table; /* [bs, block_table_width], MLA_BLOCK_TABLE_PAD past */
  const int32_t *sched_meta;  /* [num_sm_parts, MLA_SCHED_META_INTS] */
  const int32_t *num_splits;  /* [bs+1] */
} mla_step_metadata;

/* Workspace for one step shape (the same for every layer and replay).
 * Not monotonic in the shape: fewer query rows per request (a smaller
 * num_tokens or num_draft_tokens, or DECODE) give the split schedule more
 * parts, and past one part the partial-state buffers (up to 2 x 64 x num_sm
 * rows of 512 floats) are needed; one part needs none. A workspace shared by
 * several descriptors (graph buckets) takes the largest of their sizes, as
 * mla_backend_graph_init does. */
MLA_API mla_status mla_step_workspace_size(mla_ctx *ctx, const mla_step_desc *desc,
                                           size_t *bytes);
/* Build the step's metadata (once per step, before the layers). cache gives
 * the page count the page ids are checked against. */
MLA_API mla_status mla_step_prepare(mla_ctx *ctx, const mla_step_desc *desc,
                                    const mla_kv_cache *cache, const mla_step_inputs *in,
                                    void *workspace, size_t workspace_bytes);
/* One layer's attention over the prepared step: args as for
 * mla_attention_absorbed with bs * q_len query rows. */
MLA_API mla_status mla_step_attention(mla_ctx *ctx, const mla_step_desc *desc,
                                      const mla_kv_cache *cache, int layer,
                                      const mla_absorbed_args *args, void *workspace,
                                      size_t workspace_bytes);
MLA_API mla_status mla_step_get_metadata(mla_ctx *ctx, const mla_step_desc *desc, void *workspace,
                                         size_t workspace_bytes, mla_step_metadata *out);

/* ------------------------------------------------------------------------ */
/* Decode context parallel: merging the ranks' partial states over NCCL     */
/* ------------------------------------------------------------------------ */
/* After each rank's DCP step (mla_step_desc.dcp_world = world) produced its
 * partial (o, lse) over its shard of the keys, mla_dcp_merge_nccl all-gathers
 * every rank's (o_local, lse_local) into the workspace (one NCCL group of two
 * ncclAllGather on the context's stream) and merges the `world` states there
 * (as mla_merge_states, natural-log LSE; a rank that held no key of a row,
 * lse = -inf, drops out). Every rank gets the whole merged out / lse_out.
 *
 * Requirements (NCCL's collective rules):
 *  - nccl_comm is the caller's ncclComm_t of exactly `world` ranks, in which
 *    this caller is `rank`, on the context's device; NCCL stays the caller's
 *    (the library never creates, aborts or destroys a communicator).
 *  - Every rank calls with the same num_tokens, num_heads, head_dim and
 *    act_dtype, in the same order relative to its other collectives.
 *  - One host thread (or process) per rank: the call enqueues the NCCL
 *    collectives and then the merge kernel on the same stream, so it must not
 *    run inside an ncclGroupStart/ncclGroupEnd the caller opened (the merge
 *    would be queued before the deferred gather), and one thread calling it
 *    for several ranks in turn can wait forever on the ranks it has not
 *    reached yet. The calling thread's current CUDA device is the context's.
 *  - Asynchronous like every CUDA call; capturable in a CUDA graph when the
 *    communicator allows capture. num_tokens = 0: nothing is enqueued.
 *
 * Without NCCL in the build (MLA_WITH_NCCL), or on a CPU context, both calls
 * return MLA_ERR_UNSUPPORTED: the size query doubles as the capability probe.
 * Every argument is checked before anything is enqueued: world 1..128, rank
 * 0..world-1, the communicator's size, rank and device; device pointers,
 * aligned to their element size; the workspace not overlapping o_local,
 * lse_local, out or lse_out. NCCL and CUDA failures (including an
 * asynchronous error already pending on the communicator) return
 * MLA_ERR_DEVICE with NCCL's / CUDA's text. out may alias o_local and
 * lse_out lse_local. */
MLA_API mla_status mla_dcp_merge_workspace_size(mla_ctx *ctx, int world, int num_tokens, int num_heads,
                                                int head_dim, mla_dtype act_dtype, size_t *bytes);
MLA_API mla_status mla_dcp_merge_nccl(mla_ctx *ctx, void *nccl_comm /* ncclComm_t */, int world, int rank,
                                      int num_tokens, int num_heads, int head_dim, mla_dtype act_dtype,
                                      const void *o_local /* [T, H, head_dim] act_dtype */,
                                      const float *lse_local /* [T, H] natural log */,
                                      void *workspace /* device, mla_dcp_merge_workspace_size */,
                                      size_t workspace_bytes,
                                      void *out /* [T, H, head_dim] act_dtype */,
                                      float *lse_out /* [T, H] or NULL */);

/* ------------------------------------------------------------------------ */
/* EXTEND under decode context parallel: pooling the ranks' shards          */
/* ------------------------------------------------------------------------ */
/* Under DCP a rank holds only its shard of each request's keys (position p
 * on rank p mod N), but an EXTEND (prefill over a cached prefix) attends to
 * all of them. The ranks pool the batch's rows into a "gathered" cache (an
 * ordinary mla_kv_cache of the same dtype and, for fp8_e4m3, the same layer
 * scale; page size 1 fits best: the table below addresses single slots) and
 * the EXTEND then runs there exactly as on one GPU:
 *  1. each rank writes its share of the new tokens' rows
 *     (mla_kv_cache_write_shard), as for decode;
 *  2. once per batch, mla_dcp_gather_table gives every position of every
 *     request its slot in the gathered cache, and the block size M;
 *  3. per layer, mla_dcp_gather_kv_nccl packs this rank's rows into its block
 *     of the gathered cache and all-gathers the blocks (one NCCL call); a
 *     process holding every shard (the CPU backend, tests) does the same with
 *     mla_kv_cache_pack_rows into each rank's block;
 *  4. an EXTEND step over the gathered cache (mla_step_prepare with
 *     req_to_token = the table, stride table_stride, max_reqs = bs, req_ids
 *     0..bs-1, the batch's seq_lens and extend_lens; mla_step_attention).
 * Layout: rank r's block is slots [base_slot + r M, base_slot + (r+1) M);
 * in it come the rows of request 0's positions r, r+N, r+2N, ... below
 * kv_lens[0], then request 1's, and so on: exactly the local slots of rank
 * r's mla_dcp_plan (kv_indices) in order. M is rank 0's row count, the
 * largest. Rows past a rank's count in its block are never read. */

/* Host work, once per batch. kv_lens [bs]: each request's keys (prefix and
 * new tokens), host memory. table [bs, table_stride] (host; NULL: only
 * *rows_per_rank is computed): entry (i, p) = the gathered slot of position
 * p for p < kv_lens[i], MLA_SLOT_UNUSED after. world 1..128, base_slot >= 1
 * (slot 0 is the cache's reserved dummy row: give the gathered cache page
 * size 1, or base_slot = its page size). The gathered cache needs base_slot
 * + world * M slots; OUT_OF_RANGE when that passes 2^31 - 1. */
MLA_API mla_status mla_dcp_gather_table(mla_ctx *ctx, int batch_size, const int32_t *kv_lens /* [bs] */,
                                        int world, int base_slot, int64_t table_stride,
                                        int32_t *table /* [bs, table_stride] or NULL */,
                                        int32_t *rows_per_rank);

/* Copy rows between two caches of one context, bytes as stored: row
 * src_slots[i] of src's src_layer goes to slot dst_first_slot + i of dst's
 * dst_layer. Same cache dtype required, and for fp8_e4m3 the same layer
 * scale (else the bytes would mean other values): INVALID_ARGUMENT. The
 * destination range must lie in dst and not touch page 0 (the dummy rows):
 * OUT_OF_RANGE. src == dst with src_layer == dst_layer is refused (use
 * mla_kv_cache_copy_rows). CPU caches: src_slots is host memory, every slot
 * checked before anything is written. CUDA caches: src_slots is device
 * memory, the copy is asynchronous on the context's stream, and a slot out
 * of range is skipped (its row left as it was) and reported by the next
 * mla_ctx_synchronize. */
MLA_API mla_status mla_kv_cache_pack_rows(const mla_kv_cache *src, int src_layer, int num_rows,
                                          const int32_t *src_slots /* [num_rows] */, mla_kv_cache *dst,
                                          int dst_layer, int dst_first_slot);

/* Step 3 on a CUDA context with NCCL: mla_kv_cache_pack_rows of this rank's
 * num_local_rows rows (local_slots: device memory, e.g. its mla_dcp_plan's
 * kv_indices uploaded) into its block of `gathered`, then one in-place
 * ncclAllGather of the world blocks (M rows each) on the context's stream.
 * Every rank calls with the same world, rows_per_rank, base_slot and
 * gathered layout, one host thread per rank, outside any NCCL group (the
 * rules of mla_dcp_merge_nccl). 0 <= num_local_rows <= rows_per_rank;
 * rows_per_rank = 0: nothing is enqueued. shard and gathered are caches of
 * ctx. Without NCCL in the build, or on a CPU context: MLA_ERR_UNSUPPORTED. */
MLA_API mla_status mla_dcp_gather_kv_nccl(mla_ctx *ctx, void *nccl_comm /* ncclComm_t */, int world, int rank,
                                          const mla_kv_cache *shard, int layer, int num_local_rows,
                                          const int32_t *local_slots /* [num_local_rows] device */,
                                          int rows_per_rank, mla_kv_cache *gathered, int gathered_layer,
                                          int base_slot);

/* ------------------------------------------------------------------------ */
/* Backend: cache + request table + workspace, one call per forward mode      */
/* ------------------------------------------------------------------------ */
typedef struct mla_backend_s mla_backend;

typedef enum mla_extend_impl {
  MLA_EXTEND_ABSORBED = 0,   /* EXTEND with prefix: absorbed paged attention */
  MLA_EXTEND_MHA_CHUNKED = 1 /* EXTEND with prefix: MHA over extend + prefix chunks, merged */
} mla_extend_impl;

typedef struct mla_backend_desc {
  mla_kv_cache_desc cache;   /* layers, pages, page size, cache dtype */
  int max_reqs, max_context; /* request table */
  int max_bs, max_q_tokens;  /* per batch */
  int num_heads;             /* local query heads */
  float scale;               /* softmax scale of the absorbed and MHA paths */
  mla_dtype act_dtype;       /* F32, BF16, F16 for q, new kv, out */
  int qk_nope_dim, v_dim;    /* MHA path (default 128, 128): Dqk = nope + 64 */
  mla_extend_impl extend_impl;
  int chunk_capacity;        /* chunked-prefix tokens per chunk (all requests) */
  int num_sm;                /* split schedule target; 0 = ctx threads */
} mla_backend_desc;

MLA_API mla_status mla_backend_create(mla_ctx *ctx, const mla_backend_desc *desc,
                                      mla_backend **out);
MLA_API void mla_backend_destroy(mla_backend *be);
MLA_API const char *mla_backend_last_error(const mla_backend *be);
MLA_API mla_status mla_backend_cache(mla_backend *be, mla_kv_cache **cache);
MLA_API mla_status mla_backend_req_table(mla_backend *be, mla_req_table **rt);

/* Plan a batch (once per forward, shared by all layers). The batch's
 * requests must already hold every position the mode reads (extend the
 * request table first; the slots it returns are this step's out_cache_loc). */
MLA_API mla_status mla_backend_plan(mla_backend *be, const mla_batch *batch);
/* The current plan (valid until the next mla_backend_plan). */
MLA_API mla_status mla_backend_get_plan(const mla_backend *be, const mla_plan **plan);

typedef struct mla_forward_args {
  int layer;
  /* KV write of this step, done before attention (skipped when num_new == 0). */
  int num_new;                 /* rows to write */
  const int32_t *new_slots;    /* [num_new] */
  const void *new_c;           /* [num_new, 512] act dtype */
  const void *new_r;           /* [num_new, 64] */
  /* Absorbed modes (DECODE, TARGET_VERIFY, DRAFT_EXTEND, EXTEND+prefix absorbed). */
  const void *q_nope;          /* [Tq, H, 512] */
  const void *q_rope;          /* [Tq, H, 64] */
  /* MHA modes (EXTEND without prefix; EXTEND+prefix chunked). */
  const void *q;               /* [Tq, H, nope+64] */
  const void *k;               /* [Tq, H, nope+64]  this step's keys */
  const void *v;               /* [Tq, H, v_dim] */
  const void *kv_b_proj;       /* [H, nope+v_dim, 512] chunked prefix only */
  void *out;                   /* [Tq, H, 512] absorbed, [Tq, H, v_dim] MHA */
  float *lse;                  /* [Tq, H] or NULL */
  unsigned flags;              /* MLA_FLAG_* */
} mla_forward_args;

/* Run one layer of the planned batch. IDLE and empty batches return MLA_OK
 * without touching anything. */
MLA_API mla_status mla_backend_forward(mla_backend *be, const mla_forward_args *args);
/* Which path a planned EXTEND takes: 1 when it uses MHA (no prefix, or
 * chunked), 0 when absorbed. */
MLA_API mla_status mla_backend_uses_mha(const mla_backend *be, int *uses_mha);

/* CUDA graphs. On a CUDA context the backend keeps a device copy of its
 * request table and plans DECODE, TARGET_VERIFY and fixed-window
 * DRAFT_EXTEND batches on the device (mla_step_*); mla_backend_get_plan then
 * has no host plan to return (UNSUPPORTED). A graph step goes further: its
 * inputs live in fixed buffers, so a step can be captured once and replayed:
 *
 *   init:    mla_backend_graph_init(be, max_bs, max_draft_tokens);
 *            mla_backend_graph_inputs(be, &req_ids, &seq_lens);
 *   capture: (inputs written) mla_backend_sync(be); begin capture on the
 *            context's stream; mla_backend_graph_step(be, mode, bs, ndt);
 *            mla_backend_forward(...) per layer; end capture.
 *   replay:  the engine writes req_ids [bs] / seq_lens [bs] (padding rows:
 *            MLA_REQ_PAD, seq_len 1) and its q / new-row buffers in place;
 *            mla_backend_sync(be) (outside the graph: it enqueues the copy
 *            of the request-table rows changed since the last sync);
 *            launch the graph.
 *
 * The metadata update inside the graph runs on the device from those
 * inputs. The buffers are device memory on a CUDA context, host memory on a
 * CPU context (where graph steps run the same flow eagerly, for testing).
 * An out-of-range id or length is not attended and is reported by the next
 * mla_ctx_synchronize (CUDA) or returned by the step (CPU). */
/* max_bs: 1..the backend's max_bs; max_draft_tokens: 0..64 (the largest
 * TARGET_VERIFY / DRAFT_EXTEND window a graph step will use). A graph step
 * whose batch_size x queries exceeds the backend's max_q_tokens is refused
 * with MLA_ERR_CAPACITY. */
MLA_API mla_status mla_backend_graph_init(mla_backend *be, int max_bs, int max_draft_tokens);
MLA_API mla_status mla_backend_graph_inputs(mla_backend *be, int32_t **req_ids /* [max_bs] */,
                                            int32_t **seq_lens /* [max_bs] */);
/* Builds the step's metadata from the graph inputs (enqueued; capturable);
 * mla_backend_forward then runs this step until the next plan or step.
 * mode EXTEND (after mla_backend_graph_init_extend): the paged absorbed
 * prefill over the cached prefix at a fixed token bucket, num_draft_tokens
 * then being the bucket (1..max_tokens): row i has extend_lens[i] queries
 * and seq_lens[i] keys (prefix included; mla_step_desc.num_tokens), and
 * mla_backend_forward takes q / out of `bucket` rows (rows past the real
 * total are left as they are; new rows of padding go to slot 0). */
MLA_API mla_status mla_backend_graph_step(mla_backend *be, mla_mode mode, int batch_size,
                                          int num_draft_tokens);
/* EXTEND graph steps: sizes their workspace for token buckets up to
 * max_tokens (<= the backend's max_q_tokens) at the graph_init max_bs, and
 * hands out the third fixed input, extend_lens [max_bs] (zeros until written;
 * device memory on a CUDA context). Once, after mla_backend_graph_init. */
MLA_API mla_status mla_backend_graph_init_extend(mla_backend *be, int max_tokens,
                                                 int32_t **extend_lens /* [max_bs] */);
/* Brings the device copy of the request table up to date (CUDA; a no-op on
 * the CPU). mla_backend_plan does it itself; call it before each replay. */
MLA_API mla_status mla_backend_sync(mla_backend *be);

/* Multi-step draft decode (EAGLE / MTP, topk = 1) on the graph inputs: one
 * mla_backend_draft_prepare builds the metadata of num_steps DECODE steps
 * (seq_lens are the lengths before drafting; step i attends seq_len + i + 1
 * keys, so the table must hold those positions), then
 * mla_backend_draft_select(be, i) makes mla_backend_forward run step i (host
 * state only: each step's layers can be captured in a graph of their own).
 * mla_backend_draft_init sizes the buffers once, after
 * mla_backend_graph_init. */
MLA_API mla_status mla_backend_draft_init(mla_backend *be, int max_steps /* 1..16 */);
MLA_API mla_status mla_backend_draft_prepare(mla_backend *be, int batch_size, int num_steps);
MLA_API mla_status mla_backend_draft_select(mla_backend *be, int step);
/* The metadata of the step planned on the device (CUDA decode-type plan,
 * graph step or selected draft step), as pointers into the backend's
 * workspace (device memory on CUDA): e.g. the block table for other
 * kernels. BAD_STATE when the current plan is a host plan. */
MLA_API mla_status mla_backend_step_metadata(const mla_backend *be, mla_step_metadata *out);

#ifdef __cplusplus
}
#endif
#endif /* MLA_H */
