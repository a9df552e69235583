// Host side of the TMA path: the tensor map over a paged cache layer and the
// V-view descriptor strides (set by the harness from the descriptor unit test).
#include <stdio.h>
#include <stdlib.h>

#include "tmap.h"

typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn encode_fn() {
  static EncodeTiledFn fn = nullptr;
  if (!fn) {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (EncodeTiledFn)f;
  }
  return fn;
}

// Paged cache [num_pages][P][576] bf16 viewed as a 3-D tensor {576, P, pages};
// the box is 64 columns (128 B, one 128B-swizzle row) by min(P, 64) rows.
cudaError_t make_kv_tmap(const mla_decode_params *p, CUtensorMap *map) {
  memset(map, 0, sizeof(*map));
  if (p->page_size < 8) return cudaSuccess;  // the cp.async path needs no map
  EncodeTiledFn fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  cuuint64_t dims[3] = {576, (cuuint64_t)p->page_size, (cuuint64_t)p->num_pages};
  cuuint64_t strides[2] = {(cuuint64_t)p->row_bytes, (cuuint64_t)p->row_bytes * p->page_size};
  cuuint32_t box[3] = {64, (cuuint32_t)(p->page_size < 64 ? p->page_size : 64), 1};
  cuuint32_t one[3] = {1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(p->kv), dims, strides, box,
                  one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", (int)r);
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

int decode_noload(void) {
  static int v = -1;
  if (v < 0) {
    const char *e = getenv("DECODE_NOLOAD");
    v = e && atoi(e) ? 1 : 0;
  }
  return v;
}

int decode_prefetch(void) {
  static int v = -1;
  if (v < 0) {
    const char *e = getenv("DECODE_PREFETCH");
    v = e && atoi(e) ? 1 : 0;
  }
  return v;
}

int decode_nocombine(void) {
  static int v = -1;
  if (v < 0) {
    const char *e = getenv("DECODE_NOCOMBINE");
    v = e && atoi(e) ? 1 : 0;
  }
  return v;
}

static uint32_t g_vt_lbo = 8192, g_vt_sbo = 1024;
void decode_set_vview(uint32_t lbo, uint32_t sbo) {
  g_vt_lbo = lbo;
  g_vt_sbo = sbo;
}
void decode_get_vview(uint32_t *lbo, uint32_t *sbo) {
  *lbo = g_vt_lbo;
  *sbo = g_vt_sbo;
}
