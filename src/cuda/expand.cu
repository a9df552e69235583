// mla_expand_kv on a CUDA context: the per-head k / v expansion of
// chunked-prefix MHA as two strided-batched cuBLAS GEMMs (one batch entry per
// head, the latent rows shared), fp32 accumulation, plus a kernel copying the
// rope part into every head's k. cuBLAS, not a hand-written GEMM: this is a
// plain dense matmul that cuBLAS runs at the device's matmul rate.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "expand.h"
#include "mla.h"

namespace {

// k_out[t, h, nope : nope + 64] = r[t] for every head.
template <typename T>
__global__ void rope_copy_kernel(const T *__restrict__ r, T *__restrict__ k_out, int tokens, int heads, int nope) {
  const int64_t n = (int64_t)tokens * heads * MLA_ROPE;
  const int kdim = nope + MLA_ROPE;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int d = (int)(i % MLA_ROPE);
    const int64_t th = i / MLA_ROPE;  // t * heads + h
    const int64_t t = th / heads;
    k_out[th * kdim + nope + d] = r[t * MLA_ROPE + d];
  }
}

cudaDataType_t cuda_type(int dtype) {
  return dtype == MLA_DTYPE_BF16 ? CUDA_R_16BF : dtype == MLA_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

}  // namespace

extern "C" int mla_cuda_blas_destroy(void *handle) {
  return handle ? (int)cublasDestroy((cublasHandle_t)handle) : 0;
}

extern "C" const char *mla_cuda_expand_kv(void **blas, void *stream, int tokens, int heads, int nope, int v_dim,
                                          int dtype, const void *c, const void *r, const void *w, void *k_out,
                                          void *v_out) {
  if (!*blas) {
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return "cublasCreate failed";
    *blas = h;
  }
  cublasHandle_t h = (cublasHandle_t)*blas;
  if (cublasSetStream(h, (cudaStream_t)stream) != CUBLAS_STATUS_SUCCESS) return "cublasSetStream failed";
  const cudaDataType_t t = cuda_type(dtype);
  const size_t es = dtype == MLA_DTYPE_F32 ? 4 : 2;
  const int rows = nope + v_dim, kdim = nope + MLA_ROPE;
  const float one = 1.0f, zero = 0.0f;
  // Row-major out_h [T, m] = c [T, 512] x W_h[part]^T is column-major
  // out_h^T [m, T] = W_h[part] (stored row-major [m, 512]: op = T) x c^T.
  if (nope > 0) {
    cublasStatus_t s = cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, nope, tokens, MLA_LATENT, &one, w, t, MLA_LATENT,
        (long long)rows * MLA_LATENT, c, t, MLA_LATENT, 0, &zero, k_out, t, heads * kdim, kdim, heads,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return "cublasGemmStridedBatchedEx (k) failed";
  }
  cublasStatus_t s = cublasGemmStridedBatchedEx(
      h, CUBLAS_OP_T, CUBLAS_OP_N, v_dim, tokens, MLA_LATENT, &one, (const char *)w + (size_t)nope * MLA_LATENT * es,
      t, MLA_LATENT, (long long)rows * MLA_LATENT, c, t, MLA_LATENT, 0, &zero, v_out, t, heads * v_dim, v_dim, heads,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return "cublasGemmStridedBatchedEx (v) failed";
  const int64_t n = (int64_t)tokens * heads * MLA_ROPE;
  const int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
  if (dtype == MLA_DTYPE_F32)
    rope_copy_kernel<float><<<blocks, 256, 0, (cudaStream_t)stream>>>((const float *)r, (float *)k_out, tokens, heads,
                                                                      nope);
  else
    rope_copy_kernel<uint16_t><<<blocks, 256, 0, (cudaStream_t)stream>>>((const uint16_t *)r, (uint16_t *)k_out,
                                                                         tokens, heads, nope);
  return cudaGetLastError() == cudaSuccess ? nullptr : "rope copy launch failed";
}
