/* See serve_dev.h. */
#include "serve_dev.h"

#include <stdlib.h>
#include <string.h>

#ifdef MLA_CLI_CUDA
#include <cuda_runtime.h>

void *sdev_stream_create(void) {
  cudaStream_t s = NULL;
  return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess ? (void *)s : NULL;
}
void sdev_stream_destroy(void *stream) {
  if (stream) cudaStreamDestroy((cudaStream_t)stream);
}
void *sdev_alloc(size_t n) {
  void *p = NULL;
  if (cudaMalloc(&p, n ? n : 16) != cudaSuccess) return NULL;
  if (cudaMemset(p, 0, n ? n : 16) != cudaSuccess) {
    cudaFree(p);
    return NULL;
  }
  return p;
}
void sdev_free(void *p) {
  if (p) cudaFree(p);
}
int sdev_put(void *stream, void *dst, const void *src, size_t n) {
  if (!n) return 0;
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, (cudaStream_t)stream) == cudaSuccess ? 0 : -1;
}
int sdev_get(void *stream, void *dst, const void *src, size_t n) {
  if (n && cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream) != cudaSuccess) return -1;
  return cudaStreamSynchronize((cudaStream_t)stream) == cudaSuccess ? 0 : -1;
}
const char *sdev_name(void) {
  static char name[256];
  struct cudaDeviceProp prop;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return "";
  memcpy(name, prop.name, sizeof name - 1);
  return name;
}
int sdev_capture_begin(void *stream) {
  return cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess ? 0 : -1;
}
int sdev_capture_end(void *stream, void **exec, const char **why) {
  cudaGraph_t g = NULL;
  cudaGraphExec_t e = NULL;
  cudaError_t err = cudaStreamEndCapture((cudaStream_t)stream, &g);
  if (err == cudaSuccess) err = cudaGraphInstantiate(&e, g, 0);
  if (g) cudaGraphDestroy(g);
  if (err != cudaSuccess) {
    *why = cudaGetErrorString(err);
    return -1;
  }
  *exec = e;
  return 0;
}
int sdev_launch(void *stream, void *exec) {
  return cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream) == cudaSuccess ? 0 : -1;
}
void sdev_graph_free(void *exec) {
  if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}
int sdev_is_device(const void *p) {
  struct cudaPointerAttributes a;
  if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}
int sdev_cache_read(mla_kv_cache *cache, int layer, int n, const int32_t *slots, float *cf, float *rf) {
  if (n <= 0) return 0;
  int32_t *ds = NULL;
  float *dc = NULL, *dr = NULL;
  int rc = -1;
  if (cudaMalloc((void **)&ds, sizeof(int32_t) * (size_t)n) == cudaSuccess &&
      cudaMalloc((void **)&dc, sizeof(float) * (size_t)n * MLA_LATENT) == cudaSuccess &&
      cudaMalloc((void **)&dr, sizeof(float) * (size_t)n * MLA_ROPE) == cudaSuccess &&
      cudaDeviceSynchronize() == cudaSuccess &&
      cudaMemcpy(ds, slots, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice) == cudaSuccess &&
      mla_kv_cache_read(cache, layer, n, ds, dc, dr, MLA_DTYPE_F32) == MLA_OK && cudaDeviceSynchronize() == cudaSuccess &&
      cudaMemcpy(cf, dc, sizeof(float) * (size_t)n * MLA_LATENT, cudaMemcpyDeviceToHost) == cudaSuccess &&
      cudaMemcpy(rf, dr, sizeof(float) * (size_t)n * MLA_ROPE, cudaMemcpyDeviceToHost) == cudaSuccess)
    rc = 0;
  cudaFree(ds);
  cudaFree(dc);
  cudaFree(dr);
  return rc;
}
#else
void *sdev_stream_create(void) { return NULL; }
void sdev_stream_destroy(void *stream) { (void)stream; }
void *sdev_alloc(size_t n) {
  (void)n;
  return NULL;
}
void sdev_free(void *p) { (void)p; }
int sdev_put(void *stream, void *dst, const void *src, size_t n) {
  (void)stream, (void)dst, (void)src, (void)n;
  return -1;
}
int sdev_get(void *stream, void *dst, const void *src, size_t n) {
  (void)stream, (void)dst, (void)src, (void)n;
  return -1;
}
const char *sdev_name(void) { return ""; }
int sdev_capture_begin(void *stream) {
  (void)stream;
  return -1;
}
int sdev_capture_end(void *stream, void **exec, const char **why) {
  (void)stream, (void)exec;
  *why = "built without CUDA";
  return -1;
}
int sdev_launch(void *stream, void *exec) {
  (void)stream, (void)exec;
  return -1;
}
void sdev_graph_free(void *exec) { (void)exec; }
int sdev_is_device(const void *p) {
  (void)p;
  return 0;
}
int sdev_cache_read(mla_kv_cache *cache, int layer, int n, const int32_t *slots, float *cf, float *rf) {
  (void)cache, (void)layer, (void)n, (void)slots, (void)cf, (void)rf;
  return -1;
}
#endif
