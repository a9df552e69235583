/* The device side of the serving simulation (serve.c) on a CUDA context:
 * buffers, copies on the context's stream, CUDA-graph capture and replay,
 * and reads of a device cache for the oracle checks. Without CUDA in the
 * CLI's build every call fails (sdev_available() is 0), so serve.c runs on
 * the CPU. Plain C. */
#ifndef MLA_TOOLS_SERVE_DEV_H
#define MLA_TOOLS_SERVE_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "mla.h"

/* A stream for the context (non-blocking: graphs are captured on it), or
 * NULL. */
void *sdev_stream_create(void);
void sdev_stream_destroy(void *stream);
/* Device memory of n bytes (NULL on failure), zeroed. */
void *sdev_alloc(size_t n);
void sdev_free(void *p);
/* Copies in stream order; sdev_get waits for the stream. 0 or -1. */
int sdev_put(void *stream, void *dst /* device */, const void *src /* host */, size_t n);
int sdev_get(void *stream, void *dst /* host */, const void *src /* device */, size_t n);
/* The device's name, or "" */
const char *sdev_name(void);
/* Graphs: begin / end a capture on the stream (end gives an executable
 * graph), launch one, free one. 0 or -1 (the CUDA message in *why). */
int sdev_capture_begin(void *stream);
int sdev_capture_end(void *stream, void **exec, const char **why);
int sdev_launch(void *stream, void *exec);
void sdev_graph_free(void *exec);
/* 1 when p is device memory. */
int sdev_is_device(const void *p);
/* mla_kv_cache_read of n rows at host slots, into host cf [n, 512] / rf
 * [n, 64] (fp32), for a cache in device memory: staged through device
 * buffers, the device synchronised. 0 or -1. */
int sdev_cache_read(mla_kv_cache *cache, int layer, int n, const int32_t *slots, float *cf, float *rf);

#endif
