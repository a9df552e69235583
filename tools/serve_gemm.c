/* fp32 products for the serving simulation (see serve_gemm.h).
 *
 * Without a BLAS the loop below is what runs: each thread takes a share of
 * (product, row block, column block) items; an item walks K in blocks, and
 * inside a block keeps a 4 x 32 tile of C in registers while streaming a
 * 32-wide panel of B (kept in L1) and four rows of A. On x86-64 Linux the
 * function is cloned for AVX-512 / AVX2+FMA / baseline and the loader picks
 * one (target_clones); contraction to FMA is allowed for this file only. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#elif defined(__clang__)
#pragma clang fp contract(fast)
#endif

#include "serve_gemm.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifdef MLA_HAVE_CBLAS
#include <cblas.h>
#endif

/* Function multiversioning (GCC, clang >= 14) on x86-64 Linux: the build
 * flags carry no -march, so the loop is compiled three times. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    (!defined(__clang__) || __clang_major__ >= 14)
#define SERVE_GEMM_CLONES 1
#else
#define SERVE_GEMM_CLONES 0
#endif

static int g_threads = 1;
static char g_name[160];

#ifndef MLA_HAVE_CBLAS
enum {
  MR = 4,   /* rows of a register tile */
  NR = 32,  /* columns of a register tile (two AVX-512 vectors) */
  KB = 256, /* K block: a B panel of KB x NR floats is 32 KiB */
  MB = 128, /* rows per work item */
  NB = 256  /* columns per work item */
};

/* C [mr, NR] (=|+=) A [mr, kb] . B [kb, NR]; mr is a constant after
 * inlining, so acc stays in registers. */
static inline __attribute__((always_inline)) void tile(int mr, int kb, const float *A, int64_t lda,
                                                       const float *B, int64_t ldb, float *C, int64_t ldc,
                                                       int load) {
  float acc[MR][NR];
  for (int r = 0; r < mr; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = load ? C[r * ldc + j] : 0.0f;
  for (int k = 0; k < kb; k++) {
    const float *b = B + k * ldb;
    for (int r = 0; r < mr; r++) {
      const float a = A[r * lda + k];
      for (int j = 0; j < NR; j++) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < mr; r++)
    for (int j = 0; j < NR; j++) C[r * ldc + j] = acc[r][j];
}

/* The ragged right edge (nr < NR columns), one row at a time. */
static void edge(int mr, int nr, int kb, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                 int64_t ldc, int load) {
  for (int r = 0; r < mr; r++) {
    float acc[NR];
    for (int j = 0; j < nr; j++) acc[j] = load ? C[r * ldc + j] : 0.0f;
    for (int k = 0; k < kb; k++) {
      const float a = A[r * lda + k], *b = B + k * ldb;
      for (int j = 0; j < nr; j++) acc[j] += a * b[j];
    }
    for (int j = 0; j < nr; j++) C[r * ldc + j] = acc[j];
  }
}

typedef struct job {
  int count, M, N, K, mblocks, nblocks;
  const float *A, *B;
  float *C;
  int64_t lda, sa, ldb, sb, ldc, sc;
  int accumulate;
  int64_t item0, item1; /* this thread's share */
} job;

#if SERVE_GEMM_CLONES
__attribute__((target_clones("avx512f", "arch=haswell", "default")))
#endif
static void run_items(const job *j) {
  for (int64_t it = j->item0; it < j->item1; it++) {
    const int p = (int)(it / ((int64_t)j->mblocks * j->nblocks));
    const int rest = (int)(it % ((int64_t)j->mblocks * j->nblocks));
    const int m0 = rest / j->nblocks * MB, n0 = rest % j->nblocks * NB;
    const int mb = j->M - m0 < MB ? j->M - m0 : MB, nb = j->N - n0 < NB ? j->N - n0 : NB;
    const float *A = j->A + p * j->sa + m0 * j->lda, *B = j->B + p * j->sb + n0;
    float *C = j->C + p * j->sc + m0 * j->ldc + n0;
    for (int k0 = 0; k0 < j->K; k0 += KB) {
      const int kb = j->K - k0 < KB ? j->K - k0 : KB, load = j->accumulate || k0 > 0;
      for (int c0 = 0; c0 < nb; c0 += NR) {
        const float *b = B + k0 * j->ldb + c0;
        if (nb - c0 < NR) {
          edge(mb, nb - c0, kb, A + k0, j->lda, b, j->ldb, C + c0, j->ldc, load);
          continue;
        }
        int r0 = 0;
        for (; r0 + MR <= mb; r0 += MR)
          tile(MR, kb, A + r0 * j->lda + k0, j->lda, b, j->ldb, C + r0 * j->ldc + c0, j->ldc, load);
        const float *a = A + r0 * j->lda + k0;
        float *c = C + r0 * j->ldc + c0;
        switch (mb - r0) { /* constant row counts keep the tile in registers */
          case 3: tile(3, kb, a, j->lda, b, j->ldb, c, j->ldc, load); break;
          case 2: tile(2, kb, a, j->lda, b, j->ldb, c, j->ldc, load); break;
          case 1: tile(1, kb, a, j->lda, b, j->ldb, c, j->ldc, load); break;
          default: break;
        }
      }
    }
  }
}

static void *thread_main(void *arg) {
  run_items((const job *)arg);
  return NULL;
}
#endif /* !MLA_HAVE_CBLAS */

void serve_gemm_init(int threads) {
  if (threads <= 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (int)n : 1;
  }
  if (threads > 256) threads = 256;
  g_threads = threads;
#ifdef MLA_HAVE_CBLAS
#ifdef OPENBLAS_VERSION
  openblas_set_num_threads(threads);
  const char *v = OPENBLAS_VERSION; /* " OpenBLAS 0.3.21 " */
  while (*v == ' ') v++;
  snprintf(g_name, sizeof g_name, "%.40s", v);
  for (size_t n = strlen(g_name); n && g_name[n - 1] == ' ';) g_name[--n] = 0;
  snprintf(g_name + strlen(g_name), sizeof g_name - strlen(g_name), " cblas_sgemm, %d threads", threads);
#else
  snprintf(g_name, sizeof g_name, "CBLAS cblas_sgemm");
#endif
#else
  const char *isa = "baseline";
#if SERVE_GEMM_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) isa = "avx512f";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = "avx2+fma";
#endif
  snprintf(g_name, sizeof g_name, "C loop (%s; no BLAS found at build time), %d threads", isa, threads);
#endif
}

const char *serve_gemm_name(void) { return g_name[0] ? g_name : "not initialised"; }

void serve_gemm(int count, int M, int N, int K, const float *A, int64_t lda, int64_t sa, const float *B,
                int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int accumulate) {
  if (count <= 0 || M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int p = 0; p < count; p++)
        for (int i = 0; i < M; i++) memset(C + p * sc + i * ldc, 0, (size_t)N * sizeof(float));
    return;
  }
#ifdef MLA_HAVE_CBLAS
  for (int p = 0; p < count; p++)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, A + p * sa, (int)lda, B + p * sb,
                (int)ldb, accumulate ? 1.0f : 0.0f, C + p * sc, (int)ldc);
#else
  job base = {count, M, N, K, (M + MB - 1) / MB, (N + NB - 1) / NB, A, B, C, lda, sa, ldb, sb, ldc, sc,
              accumulate, 0, 0};
  const int64_t items = (int64_t)count * base.mblocks * base.nblocks;
  int nt = g_threads < items ? g_threads : (int)items;
  /* Small products are not worth a thread start (~20 us). */
  if ((double)count * M * N * K < 2e5) nt = 1;
  job jobs[256];
  pthread_t tid[256];
  int started[256] = {0};
  for (int t = 0; t < nt; t++) {
    jobs[t] = base;
    jobs[t].item0 = items * t / nt;
    jobs[t].item1 = items * (t + 1) / nt;
  }
  for (int t = 1; t < nt; t++) started[t] = pthread_create(&tid[t], NULL, thread_main, &jobs[t]) == 0;
  run_items(&jobs[0]);
  for (int t = 1; t < nt; t++) {
    if (started[t]) pthread_join(tid[t], NULL);
    else run_items(&jobs[t]); /* no thread to be had: do its share here */
  }
#endif
}
