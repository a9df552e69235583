// Thin wrappers over the CUDA runtime for the C host code (see runtime.h).
#include <cuda_runtime.h>

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
