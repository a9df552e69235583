// Thin wrappers over the CUDA runtime for the C host code (see runtime.h).
#include <cuda.h>  // CUdeviceptr, CUresult: the driver's cuMemGetAddressRange through the runtime
#include <cuda_runtime.h>
#include <stdint.h>

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

// ---- device-pointer checks ------------------------------------------------
// Every call on a CUDA context refuses host pointers where it needs device
// memory, and a decode step (prepare + attention) checks about ten of them
// per layer; a driver query (cudaPointerGetAttributes) for each was the
// larger part of the step's host time.
// So the "device" answers are remembered, per thread (no locking), as the
// whole allocation the pointer lies in (cuMemGetAddressRange: activation
// buffers of one caching-allocator segment then share one entry).
//
// Why a remembered "device" answer stays right: with unified addressing a
// device (or managed) allocation occupies virtual addresses the CUDA driver
// reserved for device memory. Freeing it (cudaFree, cudaFreeAsync, a pool
// trim) gives the range back to the driver, which places later device
// allocations there; host allocators (malloc, mmap) do not get those
// addresses while the driver holds them (this is how unified addressing
// keeps host and device addresses apart; NVIDIA's documentation does not
// spell it out for freed ranges). So an address once found to be
// device memory is device memory again or not mapped at all, never the host
// memory this check exists to refuse; unlike host memory, where free + malloc
// at the same address can change the answer (host answers are therefore never
// cached: every refusal still comes from the driver's query, as before).
// Two differences remain, both outside the contract: a freed pointer passed
// again (a use-after-free, which the query caught only while nothing else had
// been allocated there) now passes, as it already did whenever cudaMalloc had
// reused the address; and a program that releases a range it reserved itself
// (cuMemAddressFree) and then maps host memory at that address with
// mmap(MAP_FIXED) would defeat the cache.
namespace {
typedef CUresult (*AddressRangeFn)(CUdeviceptr *, size_t *, CUdeviceptr);

AddressRangeFn lookup_address_range(void) {
  void *f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    return (AddressRangeFn)f;
  cudaGetLastError();
  return nullptr;
}

struct DevRange {
  uintptr_t base, size;  // size 0: empty entry
};
constexpr int kDevRanges = 16;
thread_local DevRange t_dev_range[kDevRanges];
thread_local unsigned t_dev_next;  // round-robin replacement

void remember_device(uintptr_t a) {
  static const AddressRangeFn range_fn = lookup_address_range();
  CUdeviceptr base = 0;
  size_t size = 0;
  if (!range_fn || range_fn(&base, &size, (CUdeviceptr)a) != CUDA_SUCCESS || size == 0 || a - base >= size) {
    base = (CUdeviceptr)a;  // no range known: remember the pointer itself
    size = 1;
  }
  DevRange &r = t_dev_range[t_dev_next++ % kDevRanges];
  r.base = (uintptr_t)base;
  r.size = (uintptr_t)size;
}
}  // namespace

extern "C" int mla_cuda_is_device_ptr(const void *p) {
  const uintptr_t a = (uintptr_t)p;
  if (p)
    for (int i = 0; i < kDevRanges; i++)
      if (a - t_dev_range[i].base < t_dev_range[i].size) return 1;
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int dev = at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
  if (dev && p) remember_device(a);
  return dev;
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
