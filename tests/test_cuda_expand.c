/* mla_expand_kv and mla_gather_latent on a CUDA context (cuBLAS GEMMs and the
 * cache's read kernel) against the CPU context's results on the same inputs:
 * bf16, f16 and f32 with nope 128 / v 128 (DeepSeek) and odd shapes (nope 0,
 * v 24, 3 heads, 1 and 300 tokens); every element within 2 units in the last
 * place of the output dtype of the CPU value plus a small absolute floor
 * (both accumulate in fp32; the order of the sums differs). The gather of an
 * fp8 cache on the GPU equals the CPU's bit for bit. Refusals: latent dtype
 * other than act dtype (UNSUPPORTED), host pointers (INVALID_ARGUMENT).
 * Skips without CUDA or a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_expand: skipped: built without CUDA\n");
  return tu_finish("test_cuda_expand");
}
#else
#include "cuda_util.h"

static tu_rng rng;
static mla_ctx *cpu, *gpu;

static double ulp_of(mla_dtype t) { return t == MLA_DTYPE_BF16 ? 1.0 / 128 : t == MLA_DTYPE_F16 ? 1.0 / 1024 : 1e-6; }

static void expand_case(mla_dtype t, int T, int H, int nope, int dv) {
  char name[80];
  snprintf(name, sizeof name, "expand %s T=%d H=%d nope=%d v=%d", mla_dtype_name(t), T, H, nope, dv);
  const size_t es = tu_act_size(t);
  const int64_t nc = (int64_t)T * MLA_LATENT, nr = (int64_t)T * MLA_ROPE, nw = (int64_t)H * (nope + dv) * MLA_LATENT;
  const int64_t nk = (int64_t)T * H * (nope + MLA_ROPE), nv = (int64_t)T * H * dv;
  float *f = malloc(sizeof(float) * (size_t)(nw > nc ? nw : nc));
  void *c = malloc(es * nc), *r = malloc(es * nr), *w = malloc(es * nw);
  tu_fill_bf16_normal(&rng, f, nc, 1.0);
  tu_to_dtype(t, f, c, nc);
  tu_fill_bf16_normal(&rng, f, nr, 1.0);
  tu_to_dtype(t, f, r, nr);
  tu_fill_bf16_normal(&rng, f, nw, 0.05);
  tu_to_dtype(t, f, w, nw);
  void *k_ref = malloc(es * nk), *v_ref = malloc(es * nv), *k_got = malloc(es * nk), *v_got = malloc(es * nv);
  TU_STATUS(mla_expand_kv(cpu, T, H, nope, dv, t, t, c, r, w, k_ref, v_ref), MLA_OK);
  void *dc = tu_dev_copy(c, es * nc), *dr = tu_dev_copy(r, es * nr), *dw = tu_dev_copy(w, es * nw);
  void *dk = tu_dev_alloc(es * nk), *dv_ = tu_dev_alloc(es * nv);
  CK(cudaMemset(dk, 0xFF, es * nk));
  CK(cudaMemset(dv_, 0xFF, es * nv));
  TU_STATUS(mla_expand_kv(gpu, T, H, nope, dv, t, t, dc, dr, dw, dk, dv_), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  CK(cudaMemcpy(k_got, dk, es * nk, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(v_got, dv_, es * nv, cudaMemcpyDeviceToHost));
  double *a = malloc(sizeof(double) * (size_t)(nk > nv ? nk : nv)), *b = malloc(sizeof(double) * (size_t)(nk > nv ? nk : nv));
  int far = 0, rope_diff = 0;
  double worst = 0;
  tu_from_dtype(t, k_ref, a, nk);
  tu_from_dtype(t, k_got, b, nk);
  for (int64_t i = 0; i < nk; i++) {
    const double tol = 2 * ulp_of(t) * fabs(a[i]) + 1e-3;
    const int rope = (int)(i % (nope + MLA_ROPE)) >= nope;
    if (rope) rope_diff += a[i] != b[i];
    else if (!(fabs(a[i] - b[i]) <= tol)) far++;
    if (fabs(a[i] - b[i]) > worst) worst = fabs(a[i] - b[i]);
  }
  tu_from_dtype(t, v_ref, a, nv);
  tu_from_dtype(t, v_got, b, nv);
  for (int64_t i = 0; i < nv; i++) {
    const double tol = 2 * ulp_of(t) * fabs(a[i]) + 1e-3;
    if (!(fabs(a[i] - b[i]) <= tol)) far++;
    if (fabs(a[i] - b[i]) > worst) worst = fabs(a[i] - b[i]);
  }
  TU_CHECK(far == 0, "%s: %d elements outside tolerance (worst |diff| %.3g)", name, far, worst);
  TU_CHECK(rope_diff == 0, "%s: %d rope elements differ (they are copies)", name, rope_diff);
  if (T > 1 && t == MLA_DTYPE_BF16) {
    /* refusals, nothing written */
    TU_STATUS(mla_expand_kv(gpu, T, H, nope, dv, MLA_DTYPE_F32, t, dc, dr, dw, dk, dv_), MLA_ERR_UNSUPPORTED);
    TU_STATUS(mla_expand_kv(gpu, T, H, nope, dv, t, t, c, dr, dw, dk, dv_), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_expand_kv(gpu, T, H, nope, dv, t, t, dc, dr, w, dk, dv_), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_expand_kv(gpu, T, 0, nope, dv, t, t, dc, dr, dw, dk, dv_), MLA_ERR_INVALID_ARGUMENT);
  }
  free(f);
  free(c);
  free(r);
  free(w);
  free(k_ref);
  free(v_ref);
  free(k_got);
  free(v_got);
  free(a);
  free(b);
  cudaFree(dc);
  cudaFree(dr);
  cudaFree(dw);
  cudaFree(dk);
  cudaFree(dv_);
}

/* Gather of an fp8 cache: GPU rows (bf16 and f32) equal the CPU's. */
static void gather_case(mla_dtype cache_dtype, mla_dtype dst) {
  const int pages = 40, P = 16, T = 200;
  mla_kv_cache_desc cd = {1, pages, P, cache_dtype, NULL};
  mla_kv_cache *hc = NULL, *dcache = NULL;
  TU_STATUS(mla_kv_cache_create(cpu, &cd, &hc), MLA_OK);
  TU_STATUS(mla_kv_cache_create(gpu, &cd, &dcache), MLA_OK);
  if (!hc || !dcache) return;
  const int n = pages * P;
  int32_t *all = malloc(sizeof(int32_t) * n);
  for (int i = 0; i < n; i++) all[i] = i;
  float *cf = malloc(sizeof(float) * (size_t)n * MLA_LATENT), *rf = malloc(sizeof(float) * (size_t)n * MLA_ROPE);
  for (int64_t i = 0; i < (int64_t)n * MLA_LATENT; i++) cf[i] = (float)tu_normal(&rng);
  for (int64_t i = 0; i < (int64_t)n * MLA_ROPE; i++) rf[i] = (float)tu_normal(&rng);
  TU_STATUS(mla_kv_cache_write(hc, 0, n, all, cf, rf, MLA_DTYPE_F32), MLA_OK);
  void *hp = NULL, *dp = NULL;
  size_t rb = 0;
  mla_kv_cache_layer_data(hc, 0, &hp);
  mla_kv_cache_layer_data(dcache, 0, &dp);
  mla_kv_cache_row_bytes(hc, &rb);
  CK(cudaMemcpy(dp, hp, rb * (size_t)n, cudaMemcpyHostToDevice));
  int32_t slots[T];
  for (int i = 0; i < T; i++) slots[i] = tu_randint(&rng, 0, n - 1);
  const size_t es = tu_act_size(dst);
  void *c1 = malloc(es * T * MLA_LATENT), *r1 = malloc(es * T * MLA_ROPE), *c2 = malloc(es * T * MLA_LATENT),
       *r2 = malloc(es * T * MLA_ROPE);
  TU_STATUS(mla_gather_latent(cpu, hc, 0, T, slots, dst, c1, r1), MLA_OK);
  int32_t *ds = tu_dev_copy(slots, sizeof slots);
  void *dc = tu_dev_alloc(es * T * MLA_LATENT), *dr = tu_dev_alloc(es * T * MLA_ROPE);
  TU_STATUS(mla_gather_latent(gpu, dcache, 0, T, ds, dst, dc, dr), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  CK(cudaMemcpy(c2, dc, es * T * MLA_LATENT, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r2, dr, es * T * MLA_ROPE, cudaMemcpyDeviceToHost));
  TU_CHECK(memcmp(c1, c2, es * T * MLA_LATENT) == 0 && memcmp(r1, r2, es * T * MLA_ROPE) == 0,
           "gather %s -> %s: GPU rows differ from the CPU's", mla_dtype_name(cache_dtype), mla_dtype_name(dst));
  free(all);
  free(cf);
  free(rf);
  free(c1);
  free(r1);
  free(c2);
  free(r2);
  cudaFree(ds);
  cudaFree(dc);
  cudaFree(dr);
  mla_kv_cache_destroy(hc);
  mla_kv_cache_destroy(dcache);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_expand: skipped: no GPU\n");
    return tu_finish("test_cuda_expand");
  }
  rng.s = tu_seed("test_cuda_expand", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0}, gd = {MLA_DEVICE_CUDA, 0, 0};
  if (mla_ctx_create(&cd, &cpu) != MLA_OK || mla_ctx_create(&gd, &gpu) != MLA_OK) {
    TU_CHECK(0, "context creation failed");
    return tu_finish("test_cuda_expand");
  }
  expand_case(MLA_DTYPE_BF16, 300, 16, 128, 128);
  expand_case(MLA_DTYPE_F16, 77, 8, 128, 128);
  expand_case(MLA_DTYPE_F32, 33, 3, 40, 24);
  expand_case(MLA_DTYPE_BF16, 1, 3, 0, 24);
  gather_case(MLA_DTYPE_FP8_E4M3, MLA_DTYPE_BF16);
  gather_case(MLA_DTYPE_FP8_E4M3_BLOCK, MLA_DTYPE_F32);
  gather_case(MLA_DTYPE_BF16, MLA_DTYPE_BF16);
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_expand");
}
#endif
