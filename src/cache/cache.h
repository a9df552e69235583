/* Internal view of the KV cache and request table (not installed). */
#ifndef MLA_CACHE_CACHE_H
#define MLA_CACHE_CACHE_H

#include "../core/internal.h"

/* Row layouts (bytes):
 *  BF16 / F16:       [c: 512 x 2][r: 64 x 2]                  = 1152
 *  FP8_E4M3:         [c: 512 x 1][r: 64 x 1] (times the layer scale) = 576
 *  FP8_E4M3_BLOCK:   [c: 512 x e4m3][4 x fp32 scale][r: 64 x bf16] = 656
 *                    value = e4m3 * scale[i / 128]; scale = amax / 448
 *                    (1.0 when the block is all zero). */
struct mla_kv_cache_s {
  mla_ctx *ctx;
  int num_layers, num_pages, page_size;
  int64_t num_slots; /* num_pages * page_size */
  mla_dtype dtype;
  size_t row_bytes;
  unsigned char **layers; /* [num_layers] -> [num_slots, row_bytes]; device memory when on_device */
  int on_device;          /* the context is CUDA: storage lives on the GPU */
  float *fp8_scales;      /* [num_layers] */
  mla_errbuf err;
};

size_t mla_cache_row_bytes_for(mla_dtype t);

/* Dequantize one stored row of `layer` at `slot` into c [512] and r [64]
 * (either may be NULL). No bounds checks: callers validate slots. */
void mla_cache_row_to_f32(const mla_kv_cache *cache, int layer, int64_t slot, float *c,
                          float *r);
/* Quantize/convert one row c [512], r [64] into the stored format. */
void mla_cache_row_from_f32(mla_kv_cache *cache, int layer, int64_t slot, const float *c,
                            const float *r);
/* Copy n consecutive slots src_slot.. to dst_slot.. in every layer (host or
 * device storage); the request table's copy-on-write. Slots unchecked. */
mla_status mla_cache_copy_slot_range(mla_kv_cache *cache, int64_t dst_slot, int64_t src_slot, int64_t n);
/* mla_kv_cache_pack_rows' checks and copy, recording failures in eb under
 * the public name fn (the DCP gather reports into its context instead). */
mla_status mla_cache_pack_rows(mla_errbuf *eb, const char *fn, const mla_kv_cache *src, int src_layer,
                               int num_rows, const int32_t *src_slots /* [num_rows] */, mla_kv_cache *dst,
                               int dst_layer, int64_t dst_first_slot);
static inline const unsigned char *mla_cache_row_ptr(const mla_kv_cache *cache, int layer,
                                                     int64_t slot) {
  return cache->layers[layer] + (size_t)slot * cache->row_bytes;
}

struct mla_req_table_s {
  mla_ctx *ctx;
  mla_kv_cache *cache; /* may be NULL */
  int max_reqs, max_context, num_pages, page_size;
  int max_pages_per_req;  /* ceil(max_context / page_size) */
  int32_t *req_to_token;  /* [max_reqs, max_context] */
  int32_t *req_pages;     /* [max_reqs, max_pages_per_req] page of each page index */
  int32_t *req_len;       /* [max_reqs] */
  unsigned char *live;    /* [max_reqs] */
  int32_t *page_refs;     /* [num_pages] */
  int32_t *free_list;     /* stack of free pages */
  int num_free;
  /* Rows changed since the last mla_req_table_take_dirty (a device copy of
   * req_to_token is brought up to date from them): positions
   * [dirty_lo, dirty_hi) of each request listed in dirty_ids. */
  int32_t *dirty_lo, *dirty_hi; /* [max_reqs]; lo = INT32_MAX when clean */
  int32_t *dirty_ids;           /* [max_reqs] */
  int num_dirty;
  mla_errbuf err;
};

/* Hands out the changed rows and marks the table clean: ids[k], lo[k],
 * hi[k] for k < *n (arrays of max_reqs entries). */
void mla_req_table_take_dirty(mla_req_table *rt, int32_t *ids, int32_t *lo, int32_t *hi, int *n);

#endif /* MLA_CACHE_CACHE_H */
