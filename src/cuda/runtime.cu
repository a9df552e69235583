// Thin wrappers over the CUDA runtime for the C host code (see runtime.h).
#include <cuda_runtime.h>

#include "../core/convert.h"
#include "mla.h"
#include "runtime.h"

extern "C" int mla_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

extern "C" const char *mla_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

extern "C" int mla_cuda_set_device(int device) { return (int)cudaSetDevice(device); }

extern "C" int mla_cuda_sm_count(int device, int *sms) {
  return (int)cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

extern "C" int mla_cuda_malloc(void **p, size_t bytes) { return (int)cudaMalloc(p, bytes); }

extern "C" int mla_cuda_free(void *p) { return (int)cudaFree(p); }

extern "C" int mla_cuda_memset_async(void *p, int value, size_t bytes, void *stream) {
  return (int)cudaMemsetAsync(p, value, bytes, (cudaStream_t)stream);
}

extern "C" int mla_cuda_memcpy_async(void *dst, const void *src, size_t bytes, void *stream) {
  return (int)cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream);
}

extern "C" int mla_cuda_stream_sync(void *stream) { return (int)cudaStreamSynchronize((cudaStream_t)stream); }

extern "C" int mla_cuda_is_device_ptr(const void *p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

extern "C" int mla_cuda_host_alloc(void **p, size_t bytes) {
  return (int)cudaHostAlloc(p, bytes, cudaHostAllocDefault);
}

extern "C" int mla_cuda_host_free(void *p) { return (int)cudaFreeHost(p); }

extern "C" int mla_cuda_event_create(void **ev) {
  return (int)cudaEventCreateWithFlags((cudaEvent_t *)ev, cudaEventDisableTiming);
}

extern "C" int mla_cuda_event_destroy(void *ev) { return (int)cudaEventDestroy((cudaEvent_t)ev); }

extern "C" int mla_cuda_event_record(void *ev, void *stream) {
  return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream);
}

extern "C" int mla_cuda_event_sync(void *ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }

// One block per segment; the segments of a table sync are request rows.
__global__ void scatter_segments_kernel(int32_t *__restrict__ dst, const int64_t *__restrict__ dst_off,
                                        const int32_t *__restrict__ src_off, const int32_t *__restrict__ count,
                                        const int32_t *__restrict__ src) {
  const int s = blockIdx.x;
  int32_t *d = dst + dst_off[s];
  const int32_t *v = src + src_off[s];
  for (int i = threadIdx.x; i < count[s]; i += blockDim.x) d[i] = v[i];
}

extern "C" int mla_cuda_scatter_segments(int32_t *dst, const int64_t *dst_off, const int32_t *src_off,
                                         const int32_t *count, const int32_t *src, int n, void *stream) {
  if (n <= 0) return 0;
  scatter_segments_kernel<<<n, 256, 0, (cudaStream_t)stream>>>(dst, dst_off, src_off, count, src);
  return (int)cudaGetLastError();
}

// fp32 -> activation dtype (round to nearest even), times a scale.
__global__ void f32_to_kernel(const float *__restrict__ src, void *__restrict__ dst, int dtype, int64_t n,
                              float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = src[i] * scale;
    // The CPU's conversions (convert.h), so both devices store the same bits.
    if (dtype == MLA_DTYPE_F32) ((float *)dst)[i] = v;
    else if (dtype == MLA_DTYPE_BF16) ((uint16_t *)dst)[i] = mla_f32_to_bf16(v);
    else ((uint16_t *)dst)[i] = mla_f32_to_f16(v);
  }
}

extern "C" int mla_cuda_f32_to(const float *src, void *dst, int dst_dtype, int64_t n, float scale, void *stream) {
  if (n <= 0) return 0;
  const int64_t want = (n + 255) / 256;
  const int blocks = (int)(want < 8192 ? want : 8192);
  f32_to_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(src, dst, dst_dtype, n, scale);
  return (int)cudaGetLastError();
}
