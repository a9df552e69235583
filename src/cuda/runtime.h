/* The CUDA runtime as the C host code sees it: small extern "C" wrappers so
 * that C files never include CUDA headers, and every failure becomes a status
 * with the CUDA error string (never an exit). Implemented in runtime.cu;
 * only compiled when MLA_WITH_CUDA. */
#ifndef MLA_CUDA_RUNTIME_H
#define MLA_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* All return 0 on success or a CUDA error code; mla_cuda_error_string() names
 * a code. stream is a cudaStream_t (NULL = the legacy default stream). */
int mla_cuda_device_count(void);
const char *mla_cuda_error_string(int err);
int mla_cuda_set_device(int device);
int mla_cuda_sm_count(int device, int *sms);
int mla_cuda_malloc(void **p, size_t bytes);
int mla_cuda_free(void *p);
int mla_cuda_memset_async(void *p, int value, size_t bytes, void *stream);
int mla_cuda_memcpy_async(void *dst, const void *src, size_t bytes, void *stream); /* any direction */
int mla_cuda_stream_sync(void *stream);
/* Page-locked host memory (async copies from it are true DMA). */
int mla_cuda_host_alloc(void **p, size_t bytes);
int mla_cuda_host_free(void *p);
/* Events (cudaEvent_t as void *), timing disabled. */
int mla_cuda_event_create(void **ev);
int mla_cuda_event_destroy(void *ev);
int mla_cuda_event_record(void *ev, void *stream);
int mla_cuda_event_sync(void *ev);
/* Scatter of n segments (all arrays device memory): segment i copies
 * counts[i] int32 values from src + src_offsets[i] to dst + dst_offsets[i]. */
int mla_cuda_scatter_segments(int32_t *dst, const int64_t *dst_offsets, const int32_t *src_offsets,
                              const int32_t *counts, const int32_t *src, int n, void *stream);
/* dst [n] (mla_dtype F32, BF16 or F16) = src [n] * scale, on the device. */
int mla_cuda_f32_to(const float *src, void *dst, int dst_dtype, int64_t n, float scale, void *stream);
/* 1 when p is device (or managed) memory, 0 for host memory. Answers from
 * a small per-thread cache of allocation ranges already found to be device
 * memory when it can (runtime.cu says why that is sound), so the per-call
 * argument checks cost a few compares instead of a driver query. */
int mla_cuda_is_device_ptr(const void *p);

/* KV cache kernels (kv_cache.cu). Rows are MLA_ROW wide; slots [T] are device
 * int32; out-of-range slots are skipped and counted into *bad (device int). */
int mla_cuda_kv_write(void *layer, int64_t num_slots, int cache_dtype, size_t row_bytes, float fp8_scale,
                      int num_tokens, const int32_t *slots, const void *c, const void *r, int src_dtype,
                      int *bad, int world, int rank, void *stream); /* world > 1: global slots, this rank's rows */
int mla_cuda_kv_read(const void *layer, int64_t num_slots, int cache_dtype, size_t row_bytes,
                     float fp8_scale, int num_tokens, const int32_t *slots, void *c, void *r, int dst_dtype,
                     int *bad, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_RUNTIME_H */
