/* Ragged MHA prefill benchmark through the public API (mla_attention_ragged
 * on a CUDA context): causal 192/128 bf16, H = 128, one 8K sequence, one 16K
 * sequence and a batch of 16 x 1K (or the shapes given as arguments:
 * "bs x len", e.g. 16x1024). TFLOP/s with causal FLOPs counted once
 * (2 * visible (q, k) pairs * (qk_dim + v_dim) * H), CUDA events around each
 * call, L2 flushed before each, median of the runs.
 *
 *   make -C dev/cuda/prefill BUILD=<cmake build dir with libmla.a>
 *   dev/cuda/prefill/bench [--runs N] [--noncausal] [shape ...]
 * MLA_PREFILL_VARIANT=plain|overlap|pingpong|overlap232|plain-tma|overlap232-tma|overlap232-pin|
 * overlap232-tma-pin selects the kernel, MLA_PREFILL_HEAD_GROUP the heads per group of the work order and
 * MLA_PREFILL_ORDER=rr the plain round-robin item order instead of the snake one (prefill_sm90.cu,
 * item_of). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static int cmp_f(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* bf16 values ~ U(-1, 1) from a fixed LCG (the data does not affect speed). */
static void fill_bf16(uint16_t *p, size_t n, uint32_t seed) {
  uint32_t s = seed;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    const float f = ((s >> 8) / 16777216.0f) * 2.0f - 1.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    p[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
}

static int bench_shape(mla_ctx *ctx, int bs, int len, int causal, int runs) {
  const int H = 128, DQK = 192, DV = 128;
  const int64_t T = (int64_t)bs * len;
  int32_t *ind = malloc(sizeof(int32_t) * (size_t)(bs + 1));
  for (int i = 0; i <= bs; i++) ind[i] = i * len;
  const size_t nq = (size_t)T * H * DQK, nv = (size_t)T * H * DV;
  uint16_t *h = malloc(sizeof(uint16_t) * nq);
  void *q, *k, *v, *o, *dind, *flush;
  CK(cudaMalloc(&q, nq * 2));
  CK(cudaMalloc(&k, nq * 2));
  CK(cudaMalloc(&v, nv * 2));
  CK(cudaMalloc(&o, nv * 2));
  CK(cudaMalloc(&dind, sizeof(int32_t) * (size_t)(bs + 1)));
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  fill_bf16(h, nq, 1);
  CK(cudaMemcpy(q, h, nq * 2, cudaMemcpyHostToDevice));
  fill_bf16(h, nq, 2);
  CK(cudaMemcpy(k, h, nq * 2, cudaMemcpyHostToDevice));
  fill_bf16(h, nv, 3);
  CK(cudaMemcpy(v, h, nv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dind, ind, sizeof(int32_t) * (size_t)(bs + 1), cudaMemcpyHostToDevice));
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = bs, a.num_heads = H, a.num_kv_heads = H, a.qk_dim = DQK, a.v_dim = DV;
  a.scale = 0.0721687836f, a.causal = causal, a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = dind, a.kv_indptr = dind, a.q = q, a.k = k, a.v = v, a.out = o;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float *ms = malloc(sizeof(float) * (size_t)runs);
  int rc = 0;
  for (int r = -3; r < runs && !rc; r++) {
    CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, 0));
    CK(cudaEventRecord(e0, 0));
    mla_status st = mla_attention_ragged(ctx, &a);
    CK(cudaEventRecord(e1, 0));
    if (st != MLA_OK) {
      fprintf(stderr, "mla_attention_ragged: %s (%s)\n", mla_status_string(st), mla_ctx_last_error(ctx));
      rc = 1;
    }
    st = mla_ctx_synchronize(ctx);
    if (st != MLA_OK) {
      fprintf(stderr, "synchronize: %s (%s)\n", mla_status_string(st), mla_ctx_last_error(ctx));
      rc = 1;
    }
    CK(cudaEventSynchronize(e1));
    if (r >= 0) CK(cudaEventElapsedTime(&ms[r], e0, e1));
  }
  if (!rc) {
    qsort(ms, (size_t)runs, sizeof(float), cmp_f);
    const double med = ms[runs / 2];
    const double pairs = causal ? (double)len * (len + 1) / 2.0 : (double)len * len;
    const double flops = 2.0 * pairs * (DQK + DV) * H * bs;
    const char *var = getenv("MLA_PREFILL_VARIANT"), *hg = getenv("MLA_PREFILL_HEAD_GROUP");
    const char *ord = getenv("MLA_PREFILL_ORDER");
    printf("libmla %-8s%s hg=%-2s causal=%d bs=%d len=%d H=%d 192/128 bf16: median %.3f ms (min %.3f, max %.3f) "
           "%.1f TFLOP/s\n",
           var ? var : "default", ord && !strcmp(ord, "rr") ? "+rr" : "", hg ? hg : "8", causal, bs, len, H, med, ms[0], ms[runs - 1],
           flops / (med * 1e-3) / 1e12);
  }
  free(ms), free(h), free(ind);
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(dind), cudaFree(flush);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return rc;
}

int main(int argc, char **argv) {
  int runs = 20, causal = 1, rc = 0, nshape = 0;
  mla_ctx *ctx = NULL;
  mla_ctx_desc d = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&d, &ctx);
  if (st != MLA_OK) {
    fprintf(stderr, "no CUDA context: %s\n", mla_status_string(st));
    return 1;
  }
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--noncausal")) causal = 0;
    else {
      int bs, len;
      if (sscanf(argv[i], "%dx%d", &bs, &len) != 2 || bs < 1 || len < 1) {
        fprintf(stderr, "usage: bench [--runs N] [--noncausal] [BSxLEN ...]\n");
        return 2;
      }
      rc |= bench_shape(ctx, bs, len, causal, runs);
      nshape++;
    }
  }
  if (runs < 1) runs = 1;
  if (!nshape) {
    rc |= bench_shape(ctx, 1, 8192, causal, runs);
    rc |= bench_shape(ctx, 1, 16384, causal, runs);
    rc |= bench_shape(ctx, 16, 1024, causal, runs);
  }
  mla_ctx_destroy(ctx);
  return rc;
}
