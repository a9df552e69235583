/* Execution context and its CPU worker pool.
 *
 * The pool keeps num_threads - 1 persistent pthreads; mla_parallel_for hands
 * them one job at a time (the caller works too) and waits for all. Work is
 * distributed dynamically in chunks through an atomic counter so uneven rows
 * (ragged batches) balance. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

size_t mla_cpu_worker_scratch_floats(void); /* src/cpu/ragged.c */

#ifdef MLA_WITH_CUDA
#include "../cuda/expand.h"
#include "../cuda/runtime.h"
#endif

struct mla_threadpool {
  int num_workers; /* extra threads (total - 1) */
  pthread_t *threads;
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  unsigned long generation;
  int pending; /* workers still running the current job */
  int stop;
  /* current job */
  mla_range_fn fn;
  void *arg;
  int64_t n, chunk;
  atomic_llong next;
};

static void run_chunks(struct mla_threadpool *p, int worker) {
  for (;;) {
    int64_t b = (int64_t)atomic_fetch_add(&p->next, p->chunk);
    if (b >= p->n) break;
    int64_t e = b + p->chunk < p->n ? b + p->chunk : p->n;
    p->fn(p->arg, b, e, worker);
  }
}

typedef struct {
  struct mla_threadpool *pool;
  int worker;
} worker_arg;

static void *worker_main(void *v) {
  worker_arg wa = *(worker_arg *)v;
  free(v);
  struct mla_threadpool *p = wa.pool;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, wa.worker);
    pthread_mutex_lock(&p->mu);
    if (--p->pending == 0) pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static void pool_destroy(struct mla_threadpool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->num_workers; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->done);
  free(p->threads);
  free(p);
}

static struct mla_threadpool *pool_create(int total_threads) {
  struct mla_threadpool *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->threads = calloc((size_t)total_threads, sizeof(pthread_t));
  if (!p->threads) {
    free(p);
    return NULL;
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  for (int i = 0; i < total_threads - 1; i++) {
    worker_arg *wa = malloc(sizeof *wa);
    if (!wa) break;
    wa->pool = p;
    wa->worker = i + 1;
    if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
      free(wa);
      break;
    }
    p->num_workers++;
  }
  if (p->num_workers == 0) {
    pool_destroy(p);
    return NULL;
  }
  return p;
}

int mla_ctx_workers(const mla_ctx *ctx) {
  return (ctx && ctx->pool) ? ctx->pool->num_workers + 1 : 1;
}

void mla_parallel_for(mla_ctx *ctx, int64_t n, int64_t grain, mla_range_fn fn, void *arg) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  struct mla_threadpool *p = ctx ? ctx->pool : NULL;
  if (!p || n <= grain) {
    fn(arg, 0, n, 0);
    return;
  }
  int workers = p->num_workers + 1;
  /* About 4 chunks per worker for balance, never below the grain. */
  int64_t chunk = n / ((int64_t)workers * 4);
  if (chunk < grain) chunk = grain;
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  p->n = n;
  p->chunk = chunk;
  atomic_store(&p->next, 0);
  p->pending = p->num_workers;
  p->generation++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  run_chunks(p, 0);
  pthread_mutex_lock(&p->mu);
  while (p->pending > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

static int online_cpus(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : (n > 1024 ? 1024 : (int)n);
}

static mla_status apply_threads(mla_ctx *ctx, int num_threads) {
  int want = num_threads == 0 ? online_cpus() : num_threads;
  struct mla_threadpool *pool = NULL;
  if (want > 1) {
    pool = pool_create(want);
    if (!pool) return mla_fail(&ctx->err, MLA_ERR_OUT_OF_MEMORY, "mla_ctx", "cannot start %d threads", want);
    want = pool->num_workers + 1;
  }
  /* Per-worker scratch of the CPU kernels, taken here (context creation,
   * thread-count changes) so that kernel calls never allocate. */
  size_t per = mla_cpu_worker_scratch_floats();
  float *scratch = malloc((size_t)want * per * sizeof(float));
  if (!scratch) {
    pool_destroy(pool);
    return mla_fail(&ctx->err, MLA_ERR_OUT_OF_MEMORY, "mla_ctx", "CPU scratch for %d threads", want);
  }
  pool_destroy(ctx->pool);
  free(ctx->cpu_scratch);
  ctx->pool = pool;
  ctx->num_threads = want;
  ctx->cpu_scratch = scratch;
  ctx->cpu_scratch_floats = per;
  return MLA_OK;
}

#ifdef MLA_WITH_CUDA
/* Bind the device and take the small buffers every CUDA context needs. */
static mla_status cuda_ctx_init(mla_ctx *ctx) {
  int n = mla_cuda_device_count();
  if (n <= 0) return mla_fail(&ctx->err, MLA_ERR_DEVICE, "mla_ctx_create", "no CUDA device found");
  if (ctx->device_id < 0 || ctx->device_id >= n)
    return mla_fail(&ctx->err, MLA_ERR_OUT_OF_RANGE, "mla_ctx_create",
                    "desc->device_id = %d, %d CUDA device(s) present", ctx->device_id, n);
  int e = mla_cuda_set_device(ctx->device_id);
  if (!e) e = mla_cuda_sm_count(ctx->device_id, &ctx->sm_count);
  if (!e) e = mla_cuda_malloc((void **)&ctx->d_bad, sizeof(int));
  if (!e) e = mla_cuda_memset_async(ctx->d_bad, 0, sizeof(int), NULL);
  if (!e) e = mla_cuda_stream_sync(NULL);
  return e ? mla_cuda_fail(&ctx->err, "mla_ctx_create", "device setup", e) : MLA_OK;
}
#endif

mla_status mla_cuda_fail(mla_errbuf *eb, const char *fn, const char *what, int err) {
#ifdef MLA_WITH_CUDA
  return mla_fail(eb, MLA_ERR_DEVICE, fn, "%s: CUDA error %d (%s)", what, err, mla_cuda_error_string(err));
#else
  return mla_fail(eb, MLA_ERR_DEVICE, fn, "%s: CUDA error %d", what, err);
#endif
}

mla_status mla_ctx_create(const mla_ctx_desc *desc, mla_ctx **out) {
  if (!out) return MLA_ERR_INVALID_ARGUMENT;
  *out = NULL;
  mla_ctx_desc d = {MLA_DEVICE_CPU, 0, 0};
  if (desc) d = *desc;
  if (d.num_threads < 0 || d.num_threads > 1024) return MLA_ERR_INVALID_ARGUMENT;
  if (d.device != MLA_DEVICE_CPU && d.device != MLA_DEVICE_CUDA) return MLA_ERR_INVALID_ARGUMENT;
#ifndef MLA_WITH_CUDA
  if (d.device == MLA_DEVICE_CUDA) return MLA_ERR_UNSUPPORTED; /* built without CUDA */
#endif
  mla_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return MLA_ERR_OUT_OF_MEMORY;
  ctx->device = d.device;
  ctx->device_id = d.device_id;
  /* CPU worker threads serve CPU contexts and host-side work of CUDA ones. */
  mla_status st = apply_threads(ctx, d.num_threads);
#ifdef MLA_WITH_CUDA
  if (st == MLA_OK && d.device == MLA_DEVICE_CUDA) st = cuda_ctx_init(ctx);
#endif
  if (st != MLA_OK) {
    mla_ctx_destroy(ctx);
    return st;
  }
  *out = ctx;
  return MLA_OK;
}

void mla_ctx_destroy(mla_ctx *ctx) {
  if (!ctx) return;
  pool_destroy(ctx->pool);
  free(ctx->cpu_scratch);
#ifdef MLA_WITH_CUDA
  if (ctx->d_bad) mla_cuda_free(ctx->d_bad);
  mla_cuda_blas_destroy(ctx->blas);
#endif
  free(ctx);
}

/* Const queries still record a failure: the handle was allocated non-const
 * by mla_ctx_create, so casting the const away is defined. */
static mla_errbuf *ctx_errbuf(const mla_ctx *ctx) { return &((mla_ctx *)ctx)->err; }

mla_status mla_ctx_get_device(const mla_ctx *ctx, mla_device *device) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(ctx_errbuf(ctx), device);
  *device = ctx->device;
  return MLA_OK;
}

mla_status mla_ctx_set_stream(mla_ctx *ctx, void *cuda_stream) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE(&ctx->err, ctx->device == MLA_DEVICE_CUDA, MLA_ERR_UNSUPPORTED,
              "a CPU context has no stream");
  ctx->stream = cuda_stream;
  return MLA_OK;
}

mla_status mla_ctx_synchronize(mla_ctx *ctx) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  if (ctx->device != MLA_DEVICE_CUDA) return MLA_OK; /* CPU calls return when done */
#ifdef MLA_WITH_CUDA
  int bad = 0;
  int e = mla_cuda_memcpy_async(&bad, ctx->d_bad, sizeof bad, ctx->stream);
  if (!e) e = mla_cuda_stream_sync(ctx->stream);
  if (!e && bad) e = mla_cuda_memset_async(ctx->d_bad, 0, sizeof(int), ctx->stream);
  if (e) return mla_cuda_fail(&ctx->err, __func__, "stream", e);
  MLA_REQUIRE(&ctx->err, bad == 0, MLA_ERR_OUT_OF_RANGE,
              "%d row(s) skipped by device kernels: slot out of range", bad);
#endif
  return MLA_OK;
}

mla_status mla_ctx_set_threads(mla_ctx *ctx, int num_threads) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE(&ctx->err, num_threads >= 0 && num_threads <= 1024, MLA_ERR_INVALID_ARGUMENT,
              "num_threads = %d, expected 0 (all CPUs) .. 1024", num_threads);
  mla_clear_error(&ctx->err);
  return apply_threads(ctx, num_threads);
}

mla_status mla_ctx_get_threads(const mla_ctx *ctx, int *num_threads) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(ctx_errbuf(ctx), num_threads);
  *num_threads = ctx->num_threads;
  return MLA_OK;
}

const char *mla_ctx_last_error(const mla_ctx *ctx) {
  return ctx ? ctx->err.msg : "mla_ctx_last_error: ctx is NULL";
}
