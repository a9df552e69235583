/* Dense fp32 matrix products for the serving simulation's projections:
 * cblas_sgemm when the build found a CBLAS (OpenBLAS: MLA_HAVE_CBLAS), a
 * cache-blocked C loop split over threads otherwise. Row-major throughout. */
#ifndef MLA_TOOLS_SERVE_GEMM_H
#define MLA_TOOLS_SERVE_GEMM_H

#include <stdint.h>

/* Threads for the products (0 = online CPUs). Call before serve_gemm. */
void serve_gemm_init(int threads);
/* What does the work, for the banner: "OpenBLAS ... cblas_sgemm" or
 * "C loop (avx512f), 2 threads". */
const char *serve_gemm_name(void);

/* count independent products i = 0..count-1:
 *   C_i [M, N] = A_i [M, K] . B_i [K, N]   (accumulate: C_i += ...)
 * with A_i = A + i*sa (row stride lda), B_i = B + i*sb (ldb), C_i = C + i*sc
 * (ldc); strides in elements. The C_i must not overlap A or B. */
void serve_gemm(int count, int M, int N, int K, const float *A, int64_t lda, int64_t sa, const float *B,
                int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int accumulate);

#endif
