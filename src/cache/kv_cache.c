/* Paged latent KV cache: storage, quantize-on-write, dequantize-on-read.
 *
 * Each layer is one calloc'd array of num_slots rows in the cache dtype (row
 * layouts in cache.h). Writes validate every argument and every slot before
 * touching a byte, so a failed call leaves the cache unchanged. */
#include <float.h>
#include <limits.h>
#include <stdlib.h>

#include "cache.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/runtime.h"
#endif

/* Byte offsets inside one row of each format. */
#define ROW16_R_OFF (MLA_LATENT * 2)               /* bf16/f16: r after 512 x 2 B */
#define ROW8_R_OFF MLA_LATENT                      /* fp8 per-tensor: r after 512 B */
#define BLOCK_SCALE_OFF MLA_LATENT                 /* block: 4 fp32 scales after c */
#define BLOCK_NUM_SCALES (MLA_LATENT / MLA_FP8_BLOCK)
#define BLOCK_R_OFF (MLA_LATENT + BLOCK_NUM_SCALES * 4)

/* Rows below this count are written serially; above it the write is spread
 * over the context's workers (see write_bucket_range). */
#define PARALLEL_MIN_ROWS 128

size_t mla_cache_row_bytes_for(mla_dtype t) {
  switch (t) {
    case MLA_DTYPE_BF16:
    case MLA_DTYPE_F16: return (size_t)MLA_ROW * 2;
    case MLA_DTYPE_FP8_E4M3: return (size_t)MLA_ROW;
    case MLA_DTYPE_FP8_E4M3_BLOCK: return (size_t)MLA_FP8_BLOCK_ROW_BYTES;
    default: return 0;
  }
}

/* ---- scalar formats --------------------------------------------------------- */

/* ---- one row ------------------------------------------------------------------ */

void mla_cache_row_from_f32(mla_kv_cache *cache, int layer, int64_t slot,
                            const float *c /* [512] */, const float *r /* [64] */) {
  unsigned char *row = cache->layers[layer] + (size_t)slot * cache->row_bytes;
  switch (cache->dtype) {
    case MLA_DTYPE_BF16:
    case MLA_DTYPE_F16: {
      uint16_t h[MLA_ROW];
      mla_dtype t = cache->dtype;
      for (int i = 0; i < MLA_LATENT; i++)
        h[i] = t == MLA_DTYPE_BF16 ? mla_f32_to_bf16(c[i]) : mla_f32_to_f16(c[i]);
      for (int i = 0; i < MLA_ROPE; i++)
        h[MLA_LATENT + i] = t == MLA_DTYPE_BF16 ? mla_f32_to_bf16(r[i]) : mla_f32_to_f16(r[i]);
      memcpy(row, h, sizeof h);
      break;
    }
    case MLA_DTYPE_FP8_E4M3: {
      float s = cache->fp8_scales[layer];
      for (int i = 0; i < MLA_LATENT; i++) row[i] = mla_e4m3_quantize(c[i], s);
      for (int i = 0; i < MLA_ROPE; i++) row[ROW8_R_OFF + i] = mla_e4m3_quantize(r[i], s);
      break;
    }
    case MLA_DTYPE_FP8_E4M3_BLOCK: {
      float scales[BLOCK_NUM_SCALES];
      for (int b = 0; b < BLOCK_NUM_SCALES; b++) {
        const float *x = c + b * MLA_FP8_BLOCK;
        float s = mla_fp8_block_scale(x);
        scales[b] = s;
        for (int i = 0; i < MLA_FP8_BLOCK; i++) row[b * MLA_FP8_BLOCK + i] = mla_e4m3_quantize(x[i], s);
      }
      memcpy(row + BLOCK_SCALE_OFF, scales, sizeof scales);
      uint16_t h[MLA_ROPE];
      for (int i = 0; i < MLA_ROPE; i++) h[i] = mla_f32_to_bf16(r[i]);
      memcpy(row + BLOCK_R_OFF, h, sizeof h);
      break;
    }
    default:
      break; /* create admits cache dtypes only */
  }
}

void mla_cache_row_to_f32(const mla_kv_cache *cache, int layer, int64_t slot,
                          float *c /* [512] or NULL */, float *r /* [64] or NULL */) {
  const unsigned char *row = mla_cache_row_ptr(cache, layer, slot);
  switch (cache->dtype) {
    case MLA_DTYPE_BF16:
    case MLA_DTYPE_F16: {
      uint16_t h[MLA_ROW];
      memcpy(h, row, sizeof h);
      int bf = cache->dtype == MLA_DTYPE_BF16;
      if (c)
        for (int i = 0; i < MLA_LATENT; i++) c[i] = bf ? mla_bf16_to_f32(h[i]) : mla_f16_to_f32(h[i]);
      if (r)
        for (int i = 0; i < MLA_ROPE; i++)
          r[i] = bf ? mla_bf16_to_f32(h[MLA_LATENT + i]) : mla_f16_to_f32(h[MLA_LATENT + i]);
      break;
    }
    case MLA_DTYPE_FP8_E4M3: {
      float s = cache->fp8_scales[layer];
      if (c)
        for (int i = 0; i < MLA_LATENT; i++) c[i] = mla_e4m3_to_f32(row[i]) * s;
      if (r)
        for (int i = 0; i < MLA_ROPE; i++) r[i] = mla_e4m3_to_f32(row[ROW8_R_OFF + i]) * s;
      break;
    }
    case MLA_DTYPE_FP8_E4M3_BLOCK: {
      if (c) {
        float scales[BLOCK_NUM_SCALES];
        memcpy(scales, row + BLOCK_SCALE_OFF, sizeof scales);
        for (int i = 0; i < MLA_LATENT; i++) c[i] = mla_e4m3_to_f32(row[i]) * scales[i / MLA_FP8_BLOCK];
      }
      if (r) {
        uint16_t h[MLA_ROPE];
        memcpy(h, row + BLOCK_R_OFF, sizeof h);
        for (int i = 0; i < MLA_ROPE; i++) r[i] = mla_bf16_to_f32(h[i]);
      }
      break;
    }
    default:
      break;
  }
}

/* ---- create / destroy / queries ------------------------------------------------ */

/* A dtype value outside the enum is malformed; a known dtype the call cannot
 * take is merely unsupported. */
static int dtype_known(mla_dtype t) { return (int)t >= MLA_DTYPE_F32 && (int)t <= MLA_DTYPE_F64; }

mla_status mla_kv_cache_create(mla_ctx *ctx, const mla_kv_cache_desc *desc, mla_kv_cache **out) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT; /* no handle to record a message in */
  mla_errbuf *eb = &ctx->err;
  MLA_REQUIRE_PTR(eb, out);
  *out = NULL;
  MLA_REQUIRE_PTR(eb, desc);
  MLA_REQUIRE(eb, desc->num_layers >= 1, MLA_ERR_INVALID_ARGUMENT,
              "desc->num_layers = %d, expected >= 1", desc->num_layers);
  MLA_REQUIRE(eb, desc->num_pages >= 2, MLA_ERR_INVALID_ARGUMENT,
              "desc->num_pages = %d, expected >= 2 (page 0 is reserved)", desc->num_pages);
  MLA_REQUIRE(eb, mla_is_pow2(desc->page_size) && desc->page_size <= MLA_MAX_PAGE_SIZE,
              MLA_ERR_INVALID_ARGUMENT, "desc->page_size = %d, expected a power of two in 1..%d",
              desc->page_size, MLA_MAX_PAGE_SIZE);
  MLA_REQUIRE(eb, dtype_known(desc->dtype), MLA_ERR_INVALID_ARGUMENT,
              "desc->dtype = %d is not an mla_dtype", (int)desc->dtype);
  MLA_REQUIRE(eb, mla_is_cache_dtype(desc->dtype), MLA_ERR_UNSUPPORTED,
              "desc->dtype = %s, expected bf16, f16, fp8_e4m3 or fp8_e4m3_block",
              mla_dtype_name(desc->dtype));
  int64_t num_slots = (int64_t)desc->num_pages * desc->page_size;
  /* Slots travel as int32 (req_to_token, slot arrays). */
  MLA_REQUIRE(eb, num_slots <= INT32_MAX, MLA_ERR_INVALID_ARGUMENT,
              "desc->num_pages * desc->page_size = %lld exceeds INT32_MAX slots",
              (long long)num_slots);
  if (desc->dtype == MLA_DTYPE_FP8_E4M3 && desc->fp8_scales) {
    for (int l = 0; l < desc->num_layers; l++) {
      float s = desc->fp8_scales[l];
      MLA_REQUIRE(eb, isfinite(s) && s > 0.0f, MLA_ERR_INVALID_ARGUMENT,
                  "desc->fp8_scales[%d] = %g, expected finite and > 0", l, (double)s);
    }
  }
  size_t row_bytes = mla_cache_row_bytes_for(desc->dtype);
  MLA_REQUIRE(eb, (uint64_t)num_slots <= SIZE_MAX / row_bytes, MLA_ERR_OUT_OF_MEMORY,
              "%lld slots x %zu bytes overflows size_t", (long long)num_slots, row_bytes);
  size_t layer_bytes = (size_t)num_slots * row_bytes;

  mla_kv_cache *cache = calloc(1, sizeof *cache);
  if (!cache) return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "cannot allocate the cache handle");
  cache->ctx = ctx;
  cache->num_layers = desc->num_layers;
  cache->num_pages = desc->num_pages;
  cache->page_size = desc->page_size;
  cache->num_slots = num_slots;
  cache->dtype = desc->dtype;
  cache->row_bytes = row_bytes;
  cache->layers = calloc((size_t)desc->num_layers, sizeof *cache->layers);
  cache->fp8_scales = malloc((size_t)desc->num_layers * sizeof *cache->fp8_scales);
  if (!cache->layers || !cache->fp8_scales) {
    mla_kv_cache_destroy(cache);
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__, "cannot allocate %d layer headers",
                    desc->num_layers);
  }
  for (int l = 0; l < desc->num_layers; l++) {
    /* Scales only matter for the per-tensor fp8 format; the others keep 1.0
     * so that get_desc reports something meaningful. */
    int use = desc->dtype == MLA_DTYPE_FP8_E4M3 && desc->fp8_scales;
    cache->fp8_scales[l] = use ? desc->fp8_scales[l] : 1.0f;
  }
  cache->on_device = ctx->device == MLA_DEVICE_CUDA;
  for (int l = 0; l < desc->num_layers; l++) {
#ifdef MLA_WITH_CUDA
    if (cache->on_device) {
      /* Zeroed like the host storage, so an unwritten row reads as 0. */
      int e = mla_cuda_malloc((void **)&cache->layers[l], layer_bytes);
      if (!e) e = mla_cuda_memset_async(cache->layers[l], 0, layer_bytes, ctx->stream);
      if (!e && l == desc->num_layers - 1) e = mla_cuda_stream_sync(ctx->stream);
      if (e) {
        mla_status st = mla_cuda_fail(eb, __func__, "layer storage", e);
        mla_kv_cache_destroy(cache);
        return st;
      }
      continue;
    }
#endif
    cache->layers[l] = calloc(1, layer_bytes);
    if (!cache->layers[l]) {
      mla_kv_cache_destroy(cache);
      return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, __func__,
                      "cannot allocate layer %d (%zu bytes)", l, layer_bytes);
    }
  }
  *out = cache;
  return MLA_OK;
}

static void free_layer(mla_kv_cache *cache, void *p) {
#ifdef MLA_WITH_CUDA
  if (cache->on_device) {
    if (p) mla_cuda_free(p);
    return;
  }
#endif
  free(p);
}

void mla_kv_cache_destroy(mla_kv_cache *cache) {
  if (!cache) return;
  if (cache->layers)
    for (int l = 0; l < cache->num_layers; l++) free_layer(cache, cache->layers[l]);
  free(cache->layers);
  free(cache->fp8_scales);
  free(cache);
}

const char *mla_kv_cache_last_error(const mla_kv_cache *cache) {
  return cache ? cache->err.msg : "mla_kv_cache_last_error: cache is NULL";
}

/* Const query functions still record their failure on the handle: the
 * handle was allocated non-const by create, so casting the const away is
 * defined behaviour. */
static mla_errbuf *errbuf_of(const mla_kv_cache *cache) {
  return &((mla_kv_cache *)cache)->err;
}

mla_status mla_kv_cache_get_desc(const mla_kv_cache *cache, mla_kv_cache_desc *desc) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(cache), desc);
  desc->num_layers = cache->num_layers;
  desc->num_pages = cache->num_pages;
  desc->page_size = cache->page_size;
  desc->dtype = cache->dtype;
  desc->fp8_scales = cache->fp8_scales;
  return MLA_OK;
}

mla_status mla_kv_cache_row_bytes(const mla_kv_cache *cache, size_t *bytes) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(errbuf_of(cache), bytes);
  *bytes = cache->row_bytes;
  return MLA_OK;
}

mla_status mla_kv_cache_layer_data(mla_kv_cache *cache, int layer, void **data) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&cache->err, data);
  MLA_REQUIRE(&cache->err, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, expected 0..%d", layer, cache->num_layers - 1);
  *data = cache->layers[layer];
  return MLA_OK;
}

mla_status mla_kv_cache_set_fp8_scale(mla_kv_cache *cache, int layer, float scale) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE(&cache->err, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, expected 0..%d", layer, cache->num_layers - 1);
  MLA_REQUIRE(&cache->err, isfinite(scale) && scale > 0.0f, MLA_ERR_INVALID_ARGUMENT,
              "scale = %g, expected finite and > 0", (double)scale);
  /* Only the per-tensor format has a layer scale; the block format carries
   * its own per row, and silently ignoring the call would hide a mistake. */
  MLA_REQUIRE(&cache->err, cache->dtype == MLA_DTYPE_FP8_E4M3, MLA_ERR_UNSUPPORTED,
              "cache dtype is %s; a layer scale exists only for fp8_e4m3",
              mla_dtype_name(cache->dtype));
  cache->fp8_scales[layer] = scale;
  return MLA_OK;
}

/* ---- argument checks shared by write / read / copy ------------------------------ */

static mla_status check_slots(mla_errbuf *eb, const char *fn, const char *name,
                              const mla_kv_cache *cache, int n, const int32_t *slots /* [n] */) {
  for (int t = 0; t < n; t++) {
    if (slots[t] < 0 || slots[t] >= cache->num_slots)
      return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn, "%s[%d] = %d, expected 0..%lld", name, t,
                      (int)slots[t], (long long)cache->num_slots - 1);
  }
  return MLA_OK;
}

static mla_status check_act_dtype(mla_errbuf *eb, const char *fn, const char *name, mla_dtype t) {
  if (!dtype_known(t))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "%s = %d is not an mla_dtype", name, (int)t);
  if (!mla_is_act_dtype(t))
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "%s = %s, expected f32, bf16 or f16", name,
                    mla_dtype_name(t));
  return MLA_OK;
}

/* ---- device storage (CUDA contexts) ----------------------------------------------- */

#ifdef MLA_WITH_CUDA
/* Device kernels read device arrays: a host pointer here would crash the
 * kernel, so it is refused up front. */
static mla_status require_device(mla_errbuf *eb, const char *fn, const char *name, const void *p) {
  if (p && !mla_cuda_is_device_ptr(p))
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "%s is host memory; a CUDA cache takes device pointers",
                    name);
  return MLA_OK;
}
#endif

static mla_status device_write(mla_kv_cache *cache, int layer, int n, const int32_t *slots, const void *c,
                               const void *r, mla_dtype src, int world, int rank) {
  mla_errbuf *eb = &cache->err;
#ifdef MLA_WITH_CUDA
  const char *fn = "mla_kv_cache_write";
  mla_status st = require_device(eb, fn, "slots", slots);
  if (st == MLA_OK) st = require_device(eb, fn, "c", c);
  if (st == MLA_OK) st = require_device(eb, fn, "r", r);
  if (st != MLA_OK) return st;
  mla_ctx *ctx = cache->ctx;
  int e = mla_cuda_kv_write(cache->layers[layer], cache->num_slots, (int)cache->dtype, cache->row_bytes,
                            cache->fp8_scales[layer], n, slots, c, r, (int)src, ctx->d_bad, world, rank, ctx->stream);
  return e ? mla_cuda_fail(eb, fn, "kv write launch", e) : MLA_OK;
#else
  (void)layer, (void)n, (void)slots, (void)c, (void)r, (void)src, (void)world, (void)rank;
  return mla_fail(eb, MLA_ERR_INTERNAL, "mla_kv_cache_write", "device cache without CUDA");
#endif
}

static mla_status device_read(const mla_kv_cache *cache, int layer, int n, const int32_t *slots, void *c,
                              void *r, mla_dtype dst) {
  mla_errbuf *eb = (mla_errbuf *)&cache->err; /* last-error text is not logical state */
#ifdef MLA_WITH_CUDA
  const char *fn = "mla_kv_cache_read";
  mla_status st = require_device(eb, fn, "slots", slots);
  if (st == MLA_OK) st = require_device(eb, fn, "c_out", c);
  if (st == MLA_OK) st = require_device(eb, fn, "r_out", r);
  if (st != MLA_OK) return st;
  mla_ctx *ctx = cache->ctx;
  int e = mla_cuda_kv_read(cache->layers[layer], cache->num_slots, (int)cache->dtype, cache->row_bytes,
                           cache->fp8_scales[layer], n, slots, c, r, (int)dst, ctx->d_bad, ctx->stream);
  return e ? mla_cuda_fail(eb, fn, "kv read launch", e) : MLA_OK;
#else
  (void)layer, (void)n, (void)slots, (void)c, (void)r, (void)dst;
  return mla_fail(eb, MLA_ERR_INTERNAL, "mla_kv_cache_read", "device cache without CUDA");
#endif
}

mla_status mla_cache_copy_slot_range(mla_kv_cache *cache, int64_t dst_slot, int64_t src_slot, int64_t n) {
  size_t rb = cache->row_bytes, bytes = (size_t)n * rb;
  if (n <= 0 || dst_slot == src_slot) return MLA_OK;
  for (int l = 0; l < cache->num_layers; l++) {
    unsigned char *base = cache->layers[l];
#ifdef MLA_WITH_CUDA
    if (cache->on_device) {
      int e = mla_cuda_memcpy_async(base + (size_t)dst_slot * rb, base + (size_t)src_slot * rb, bytes,
                                    cache->ctx->stream);
      if (e) return mla_cuda_fail(&cache->err, "mla_kv_cache_copy_rows", "row copy", e);
      continue;
    }
#endif
    memmove(base + (size_t)dst_slot * rb, base + (size_t)src_slot * rb, bytes);
  }
  return MLA_OK;
}

/* ---- write ---------------------------------------------------------------------- */

typedef struct write_job {
  mla_kv_cache *cache;
  int layer, num_tokens;
  const int32_t *slots; /* [T] */
  const void *c;        /* [T, 512] */
  const void *r;        /* [T, 64] */
  mla_dtype src_dtype;
  int64_t num_buckets;
  int world, rank;      /* > 1: slots are global, rows of other ranks skipped */
} write_job;

/* Row t of the job into its slot. */
static void write_one(const write_job *j, int t) {
  mla_kv_cache *cache = j->cache;
  int64_t slot = j->slots[t];
  if (j->world > 1) {
    if (slot % j->world != j->rank) return;
    slot /= j->world;
  }
  if (j->src_dtype == cache->dtype) {
    /* 16-bit source into the same 16-bit cache: bits as given. */
    unsigned char *row = cache->layers[j->layer] + (size_t)slot * cache->row_bytes;
    memcpy(row, (const uint16_t *)j->c + (size_t)t * MLA_LATENT, MLA_LATENT * 2);
    memcpy(row + ROW16_R_OFF, (const uint16_t *)j->r + (size_t)t * MLA_ROPE, MLA_ROPE * 2);
    return;
  }
  float c[MLA_LATENT], r[MLA_ROPE];
  mla_load_f32(j->src_dtype, j->c, (int64_t)t * MLA_LATENT, MLA_LATENT, c);
  mla_load_f32(j->src_dtype, j->r, (int64_t)t * MLA_ROPE, MLA_ROPE, r);
  mla_cache_row_from_f32(cache, j->layer, slot, c, r);
}

/* Parallel write without races on duplicate slots: every slot belongs to one
 * bucket (slot mod num_buckets) and each bucket is owned by one worker, which
 * walks the rows in order, so the last row of a duplicated slot wins exactly
 * as in the serial loop. Scanning all T slot ids per chunk is cheap next to
 * converting 576 values per row. */
static void write_bucket_range(void *arg, int64_t begin, int64_t end, int worker) {
  const write_job *j = (const write_job *)arg;
  for (int t = 0; t < j->num_tokens; t++) {
    int64_t b = j->slots[t] % j->num_buckets;
    if (b >= begin && b < end) write_one(j, t);
  }
}

/* Both writes: world 1 is the plain write (slots are the cache's), world > 1
 * a decode-context-parallel rank's share (global slots; rows of other ranks
 * skipped, the rest at slot / world). Every argument is checked before any
 * row is written. */
static mla_status write_rows(mla_kv_cache *cache, const char *fn, int layer, int num_tokens,
                             const int32_t *slots /* [T] */, const char *slots_name, const void *c /* [T, 512] */,
                             const void *r /* [T, 64] */, mla_dtype src_dtype, int world, int rank) {
  mla_errbuf *eb = &cache->err;
  if (layer < 0 || layer >= cache->num_layers)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn, "layer = %d, expected 0..%d", layer, cache->num_layers - 1);
  if (num_tokens < 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "num_tokens = %d, expected >= 0", num_tokens);
  mla_status st = check_act_dtype(eb, fn, "src_dtype", src_dtype);
  if (st != MLA_OK) return st;
  if (num_tokens == 0) return MLA_OK;
  if (!slots || !c || !r)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "argument '%s' is NULL", !slots ? slots_name : !c ? "c" : "r");
  if (cache->on_device) return device_write(cache, layer, num_tokens, slots, c, r, src_dtype, world, rank);
  if (world == 1) {
    st = check_slots(eb, fn, slots_name, cache, num_tokens, slots);
    if (st != MLA_OK) return st;
  } else {
    for (int t = 0; t < num_tokens; t++) {
      const int32_t g = slots[t];
      if (g < 0 || (g % world == rank && g / world >= cache->num_slots))
        return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                        "%s[%d] = %d: negative, or local slot %d outside this rank's %lld", slots_name, t, (int)g,
                        (int)(g / world), (long long)cache->num_slots);
    }
  }
  write_job j = {cache, layer, num_tokens, slots, c, r, src_dtype, 1, world, rank};
  int workers = mla_ctx_workers(cache->ctx);
  if (num_tokens < PARALLEL_MIN_ROWS || workers == 1) {
    for (int t = 0; t < num_tokens; t++) write_one(&j, t);
  } else {
    /* Buckets by the slot as given: repeated slots keep their order. */
    j.num_buckets = (int64_t)workers * 8;
    mla_parallel_for(cache->ctx, j.num_buckets, 1, write_bucket_range, &j);
  }
  return MLA_OK;
}

mla_status mla_kv_cache_write(mla_kv_cache *cache, int layer, int num_tokens,
                              const int32_t *slots /* [T] */, const void *c /* [T, 512] */,
                              const void *r /* [T, 64] */, mla_dtype src_dtype) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  return write_rows(cache, __func__, layer, num_tokens, slots, "slots", c, r, src_dtype, 1, 0);
}

mla_status mla_kv_cache_write_shard(mla_kv_cache *cache, int layer, int num_tokens,
                                    const int32_t *global_slots /* [T] */, const void *c /* [T, 512] */,
                                    const void *r /* [T, 64] */, mla_dtype src_dtype, int world, int rank) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE(&cache->err, world >= 1 && world <= 64 && mla_is_pow2(world) && rank >= 0 && rank < world,
              MLA_ERR_INVALID_ARGUMENT, "world = %d, rank = %d: expected a power of two 1..64 and 0..world-1",
              world, rank);
  return write_rows(cache, __func__, layer, num_tokens, global_slots, "global_slots", c, r, src_dtype, world,
                    rank);
}

/* ---- read ----------------------------------------------------------------------- */

typedef struct read_job {
  const mla_kv_cache *cache;
  int layer;
  const int32_t *slots; /* [T] */
  void *c_out;          /* [T, 512] or NULL */
  void *r_out;          /* [T, 64] or NULL */
  mla_dtype dst_dtype;
} read_job;

static void read_range(void *arg, int64_t begin, int64_t end, int worker) {
  const read_job *j = (const read_job *)arg;
  const mla_kv_cache *cache = j->cache;
  float c[MLA_LATENT], r[MLA_ROPE];
  for (int64_t t = begin; t < end; t++) {
    int64_t slot = j->slots[t];
    if (j->dst_dtype == cache->dtype) {
      /* Same 16-bit format: bits as stored. */
      const unsigned char *row = mla_cache_row_ptr(cache, j->layer, slot);
      if (j->c_out) memcpy((uint16_t *)j->c_out + t * MLA_LATENT, row, MLA_LATENT * 2);
      if (j->r_out) memcpy((uint16_t *)j->r_out + t * MLA_ROPE, row + ROW16_R_OFF, MLA_ROPE * 2);
      continue;
    }
    mla_cache_row_to_f32(cache, j->layer, slot, j->c_out ? c : NULL, j->r_out ? r : NULL);
    if (j->c_out) mla_store_f32(j->dst_dtype, j->c_out, t * MLA_LATENT, MLA_LATENT, c);
    if (j->r_out) mla_store_f32(j->dst_dtype, j->r_out, t * MLA_ROPE, MLA_ROPE, r);
  }
}

mla_status mla_kv_cache_read(const mla_kv_cache *cache, int layer, int num_tokens,
                             const int32_t *slots /* [T] */, void *c_out /* [T, 512] */,
                             void *r_out /* [T, 64] */, mla_dtype dst_dtype) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = errbuf_of(cache);
  MLA_REQUIRE(eb, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, expected 0..%d", layer, cache->num_layers - 1);
  MLA_REQUIRE(eb, num_tokens >= 0, MLA_ERR_INVALID_ARGUMENT, "num_tokens = %d, expected >= 0",
              num_tokens);
  mla_status st = check_act_dtype(eb, __func__, "dst_dtype", dst_dtype);
  if (st != MLA_OK) return st;
  if (num_tokens == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, slots);
  MLA_REQUIRE(eb, c_out || r_out, MLA_ERR_INVALID_ARGUMENT,
              "c_out and r_out are both NULL (nothing to read)");
  if (cache->on_device) return device_read(cache, layer, num_tokens, slots, c_out, r_out, dst_dtype);
  st = check_slots(eb, __func__, "slots", cache, num_tokens, slots);
  if (st != MLA_OK) return st;
  read_job j = {cache, layer, slots, c_out, r_out, dst_dtype};
  mla_parallel_for(cache->ctx, num_tokens, 64, read_range, &j);
  return MLA_OK;
}

/* ---- copy ----------------------------------------------------------------------- */

typedef struct copy_job {
  mla_kv_cache *cache;
  int num_rows;
  const int32_t *src, *dst; /* [n] */
} copy_job;

/* One worker per layer: within a layer the copies run in index order, so
 * chained or duplicated targets behave as the serial loop. */
static void copy_layers(void *arg, int64_t begin, int64_t end, int worker) {
  const copy_job *j = (const copy_job *)arg;
  size_t rb = j->cache->row_bytes;
  for (int64_t l = begin; l < end; l++) {
    unsigned char *base = j->cache->layers[l];
    for (int i = 0; i < j->num_rows; i++) {
      if (j->src[i] == j->dst[i]) continue;
      memcpy(base + (size_t)j->dst[i] * rb, base + (size_t)j->src[i] * rb, rb);
    }
  }
}

mla_status mla_kv_cache_copy_rows(mla_kv_cache *cache, int num_rows,
                                  const int32_t *src_slots /* [num_rows] */,
                                  const int32_t *dst_slots /* [num_rows] */) {
  if (!cache) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &cache->err;
  MLA_REQUIRE(eb, num_rows >= 0, MLA_ERR_INVALID_ARGUMENT, "num_rows = %d, expected >= 0",
              num_rows);
  if (num_rows == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, src_slots);
  MLA_REQUIRE_PTR(eb, dst_slots);
  mla_status st = check_slots(eb, __func__, "src_slots", cache, num_rows, src_slots);
  if (st != MLA_OK) return st;
  st = check_slots(eb, __func__, "dst_slots", cache, num_rows, dst_slots);
  if (st != MLA_OK) return st;
  if (cache->on_device) {
    /* In index order on the stream, so chained targets behave as a loop. */
    for (int i = 0; i < num_rows; i++) {
      st = mla_cache_copy_slot_range(cache, dst_slots[i], src_slots[i], 1);
      if (st != MLA_OK) return st;
    }
    return MLA_OK;
  }
  copy_job j = {cache, num_rows, src_slots, dst_slots};
  /* Small copies are not worth waking the pool. */
  int64_t grain = (int64_t)num_rows >= 256 ? 1 : cache->num_layers;
  mla_parallel_for(cache->ctx, cache->num_layers, grain, copy_layers, &j);
  return MLA_OK;
}

/* ---- pack: rows of one cache into consecutive slots of another ------------------- */

#ifdef MLA_WITH_CUDA
#include "../cuda/kv_pack.h"
#endif

typedef struct pack_job {
  const unsigned char *src; /* [num_slots, rb] */
  unsigned char *dst;       /* [num_rows, rb] from the first destination row */
  const int32_t *slots;     /* [num_rows] */
  size_t rb;
} pack_job;

static void pack_range(void *arg, int64_t begin, int64_t end, int worker) {
  const pack_job *j = (const pack_job *)arg;
  (void)worker;
  for (int64_t i = begin; i < end; i++) memcpy(j->dst + (size_t)i * j->rb, j->src + (size_t)j->slots[i] * j->rb, j->rb);
}

mla_status mla_cache_pack_rows(mla_errbuf *eb, const char *fn, const mla_kv_cache *src, int src_layer, int num_rows,
                               const int32_t *src_slots, mla_kv_cache *dst, int dst_layer, int64_t dst_first_slot) {
  if (!src || !dst) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "argument '%s' is NULL", !src ? "src" : "dst");
  if (src->ctx != dst->ctx)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "src and dst belong to different contexts");
  if (src_layer < 0 || src_layer >= src->num_layers)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn, "src_layer = %d, expected 0..%d", src_layer, src->num_layers - 1);
  if (dst_layer < 0 || dst_layer >= dst->num_layers)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn, "dst_layer = %d, expected 0..%d", dst_layer, dst->num_layers - 1);
  if (num_rows < 0) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "num_rows = %d, expected >= 0", num_rows);
  if (src->dtype != dst->dtype)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "src holds %s rows, dst %s: rows move as stored",
                    mla_dtype_name(src->dtype), mla_dtype_name(dst->dtype));
  if (src->dtype == MLA_DTYPE_FP8_E4M3 && src->fp8_scales[src_layer] != dst->fp8_scales[dst_layer])
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "fp8 layer scales differ (src %g, dst %g): the copied bytes would mean other values",
                    (double)src->fp8_scales[src_layer], (double)dst->fp8_scales[dst_layer]);
  if (src == dst && src_layer == dst_layer)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "src and dst are the same layer of one cache (mla_kv_cache_copy_rows copies within a cache)");
  if (dst_first_slot < dst->page_size || dst_first_slot + num_rows > dst->num_slots)
    return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                    "destination slots [%lld, %lld) outside %lld..%lld (page 0 holds the dummy rows)",
                    (long long)dst_first_slot, (long long)dst_first_slot + num_rows, (long long)dst->page_size,
                    (long long)dst->num_slots);
  if (num_rows == 0) return MLA_OK;
  if (!src_slots) return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "argument 'src_slots' is NULL");
  unsigned char *to = dst->layers[dst_layer] + (size_t)dst_first_slot * dst->row_bytes;
  if (src->on_device) {
#ifdef MLA_WITH_CUDA
    if (!mla_cuda_is_device_ptr(src_slots))
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "src_slots is host memory; a CUDA cache takes device pointers");
    mla_ctx *ctx = src->ctx;
    int e = mla_cuda_kv_pack(src->layers[src_layer], src->num_slots, to, src->row_bytes, num_rows, src_slots,
                             ctx->d_bad, ctx->stream);
    return e ? mla_cuda_fail(eb, fn, "kv pack launch", e) : MLA_OK;
#else
    return mla_fail(eb, MLA_ERR_INTERNAL, fn, "device cache without CUDA");
#endif
  }
  mla_status st = check_slots(eb, fn, "src_slots", src, num_rows, src_slots);
  if (st != MLA_OK) return st;
  /* Different layers or caches: the source rows never overlap the destination. */
  pack_job j = {src->layers[src_layer], to, src_slots, src->row_bytes};
  mla_parallel_for(src->ctx, num_rows, 256, pack_range, &j);
  return MLA_OK;
}

mla_status mla_kv_cache_pack_rows(const mla_kv_cache *src, int src_layer, int num_rows, const int32_t *src_slots,
                                  mla_kv_cache *dst, int dst_layer, int dst_first_slot) {
  if (!dst) return MLA_ERR_INVALID_ARGUMENT;
  mla_clear_error(&dst->err);
  return mla_cache_pack_rows(&dst->err, __func__, src, src_layer, num_rows, src_slots, dst, dst_layer,
                             dst_first_slot);
}
