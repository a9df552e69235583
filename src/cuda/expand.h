/* cuBLAS side of mla_expand_kv for CUDA contexts (expand.cu). Plain C. */
#ifndef MLA_CUDA_EXPAND_H
#define MLA_CUDA_EXPAND_H

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues on `stream` the expansion of `tokens` latent rows c [T, 512] and
 * r [T, 64] with kv_b_proj w [H, nope + v_dim, 512] into k_out
 * [T, H, nope + 64] and v_out [T, H, v_dim]; every tensor in one dtype (mla_dtype
 * BF16, F16 or F32), device memory. *blas is a cublasHandle_t created on
 * first use (the context owns it). Returns NULL or what failed. */
const char *mla_cuda_expand_kv(void **blas, void *stream, int tokens, int heads, int nope, int v_dim, int dtype,
                               const void *c, const void *r, const void *w, void *k_out, void *v_out);
/* Destroys a handle made by mla_cuda_expand_kv (NULL: nothing). */
int mla_cuda_blas_destroy(void *handle);

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_EXPAND_H */
