/* Helpers of the GPU tests (only built when MLA_TEST_CUDA): a checked CUDA
 * call and device buffers. A test's own CUDA calls may exit on failure; the
 * library's never do. */
#ifndef MLA_TEST_CUDA_UTIL_H
#define MLA_TEST_CUDA_UTIL_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "mla.h"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

/* Device buffer of n bytes (at least 16, so zero-size arrays still get a
 * valid device pointer). */
static inline void *tu_dev_alloc(size_t n) {
  void *p = NULL;
  CK(cudaMalloc(&p, n ? n : 16));
  return p;
}

/* Device copy of n host bytes. */
static inline void *tu_dev_copy(const void *host, size_t n) {
  void *d = tu_dev_alloc(n);
  if (n) CK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
  return d;
}

/* Copies layer 0 of a host cache (rows owned and unowned alike) into a device
 * cache of the same shape: `rows` = pages * page size. */
static inline void tu_cache_to_device(mla_kv_cache *host, mla_kv_cache *dev, size_t rows) {
  void *hp = NULL, *dp = NULL;
  size_t rb = 0;
  mla_kv_cache_layer_data(host, 0, &hp);
  mla_kv_cache_layer_data(dev, 0, &dp);
  mla_kv_cache_row_bytes(host, &rb);
  CK(cudaMemcpy(dp, hp, rb * rows, cudaMemcpyHostToDevice));
}
/* Kernel nodes and other nodes (memcpy, memset, host...) of a captured graph. */
static inline void tu_count_graph_nodes(cudaGraph_t graph, int *kernels, int *others) {
  size_t n = 0;
  CK(cudaGraphGetNodes(graph, NULL, &n));
  cudaGraphNode_t *nodes = malloc(sizeof(cudaGraphNode_t) * (n ? n : 1));
  CK(cudaGraphGetNodes(graph, nodes, &n));
  *kernels = *others = 0;
  for (size_t i = 0; i < n; i++) {
    enum cudaGraphNodeType t;
    CK(cudaGraphNodeGetType(nodes[i], &t));
    if (t == cudaGraphNodeTypeKernel) ++*kernels;
    else ++*others;
  }
  free(nodes);
}

#endif
