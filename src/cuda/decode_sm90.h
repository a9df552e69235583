/* Host entry points of the sm_90a decode kernels (decode_sm90.cu). Plain C. */
#ifndef MLA_CUDA_DECODE_SM90_H
#define MLA_CUDA_DECODE_SM90_H

#include "decode.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NULL when the kernels take this combination of cache dtype, activation
 * dtype (mla_dtype values) and page size; otherwise a sentence saying what
 * they take, for the caller's UNSUPPORTED message. */
const char *mla_cuda_decode_unsupported(int kv_dtype, int act_dtype, int page_size);

/* Launches the split-KV kernel (narrow for max_q_len * H <= 32 rows, wide
 * above) and the combine on `stream` (a cudaStream_t). Every pointer in p is
 * device memory; p->kv is a cache layer of p->kv_dtype with p->row_bytes per
 * row (fp8: dequantized in the kernel with p->kv_scale or the rows' block
 * scales). Returns 0 or a CUDA error code (cudaErrorNotSupported for a
 * combination mla_cuda_decode_unsupported refuses, or a row_bytes that does
 * not match the cache dtype). Asynchronous: nothing is waited for. */
int mla_cuda_decode(const mla_decode_params *p, void *stream);

/* Which split kernel mla_cuda_decode launches for p (tests and the bench
 * check routing with it): "ring", "ring32", "narrow16", "narrow32", "wide" or
 * "wide-fp8math"; "none" for an empty batch or a combination it refuses. */
const char *mla_cuda_decode_route(const mla_decode_params *p);

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_DECODE_SM90_H */
