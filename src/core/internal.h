/* Internal helpers shared by every part of libmla (never installed). */
#ifndef MLA_CORE_INTERNAL_H
#define MLA_CORE_INTERNAL_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "mla.h"

/* ---- last-error text, one per handle ----------------------------------- */
#define MLA_ERRBUF_LEN 256
typedef struct mla_errbuf {
  char msg[MLA_ERRBUF_LEN];
} mla_errbuf;

/* Record "fn: message" in eb (eb may be NULL) and return st. */
mla_status mla_fail(mla_errbuf *eb, mla_status st, const char *fn, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
static inline void mla_clear_error(mla_errbuf *eb) {
  if (eb) eb->msg[0] = '\0';
}

/* Argument checks: return from the enclosing function with a message naming
 * the argument. `EB` is the errbuf of the handle, `__func__` names the call. */
#define MLA_REQUIRE(EB, cond, st, ...)                         \
  do {                                                         \
    if (!(cond)) return mla_fail((EB), (st), __func__, __VA_ARGS__); \
  } while (0)
#define MLA_REQUIRE_PTR(EB, p) \
  MLA_REQUIRE(EB, (p) != NULL, MLA_ERR_INVALID_ARGUMENT, "argument '%s' is NULL", #p)

/* ---- context ------------------------------------------------------------ */
typedef void (*mla_range_fn)(void *arg, int64_t begin, int64_t end, int worker);

struct mla_threadpool; /* src/core/threads.c */

struct mla_ctx_s {
  mla_device device;
  int num_threads;
  struct mla_threadpool *pool; /* NULL when num_threads == 1 */
  float *cpu_scratch;           /* [num_threads, cpu_scratch_floats] CPU kernel tiles */
  size_t cpu_scratch_floats;
  /* CUDA contexts */
  int device_id;
  int sm_count;
  void *stream;  /* cudaStream_t */
  int *d_bad;    /* device counter of values kernels skipped as out of range */
  void *blas;    /* cublasHandle_t, created by the first call that needs one */
  mla_errbuf err;
};

/* Record a CUDA error (code err from src/cuda/runtime.h) as MLA_ERR_DEVICE. */
mla_status mla_cuda_fail(mla_errbuf *eb, const char *fn, const char *what, int err);

/* Run fn over [0, n) split into contiguous chunks of at least `grain` items,
 * on the context's workers (the caller participates). Blocks until done.
 * ctx may be NULL (runs serially). worker is in [0, mla_ctx_workers(ctx)). */
void mla_parallel_for(mla_ctx *ctx, int64_t n, int64_t grain, mla_range_fn fn, void *arg);
int mla_ctx_workers(const mla_ctx *ctx);

/* ---- workspace carving (bump allocator with a count-only mode) --------- */
#define MLA_WS_ALIGN 256
typedef struct mla_ws {
  char *base;     /* NULL = count only */
  size_t cap;     /* bytes available (ignored when counting) */
  size_t used;    /* bytes carved so far, including alignment padding */
  int overflow;   /* set when a carve did not fit */
} mla_ws;

static inline mla_ws mla_ws_counter(void) {
  mla_ws w = {NULL, 0, 0, 0};
  return w;
}
static inline mla_ws mla_ws_over(void *base, size_t cap) {
  mla_ws w = {(char *)base, cap, 0, 0};
  return w;
}
/* Carve `bytes` aligned to MLA_WS_ALIGN; returns NULL in count mode or on
 * overflow (then w->overflow is set). Offsets are relative to an aligned base
 * so that counting and carving agree for any base alignment. */
void *mla_ws_take(mla_ws *w, size_t bytes);
/* Size to request so that carving works from any (unaligned) base. */
static inline size_t mla_ws_total(const mla_ws *w) { return w->used + MLA_WS_ALIGN; }

/* ---- dtype conversion (scalar formats in convert.h, shared with CUDA) ---- */
#include "convert.h"

/* Activation tensors (F32/BF16/F16): load n values starting at element
 * `offset` into dst; store n floats. */
void mla_load_f32(mla_dtype t, const void *src, int64_t offset, int64_t n, float *dst);
void mla_store_f32(mla_dtype t, void *dst, int64_t offset, int64_t n, const float *src);
static inline int mla_is_act_dtype(mla_dtype t) {
  return t == MLA_DTYPE_F32 || t == MLA_DTYPE_BF16 || t == MLA_DTYPE_F16;
}
static inline int mla_is_cache_dtype(mla_dtype t) {
  return t == MLA_DTYPE_BF16 || t == MLA_DTYPE_F16 || t == MLA_DTYPE_FP8_E4M3 ||
         t == MLA_DTYPE_FP8_E4M3_BLOCK;
}
static inline int mla_is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }
static inline int64_t mla_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#endif /* MLA_CORE_INTERNAL_H */
