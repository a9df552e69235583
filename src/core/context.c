/* Execution context and its CPU worker pool.
 *
 * The pool keeps num_threads - 1 persistent pthreads; mla_parallel_for hands
 * them one job at a time (the caller works too) and waits for all. Work is
 * distributed dynamically in chunks through an atomic counter so uneven rows
 * (ragged batches) balance.
 *
 * Waiting spins briefly before it sleeps: a worker that finished a job
 * polls for the next one for up to MLA_POOL_SPIN_NS, and the caller polls
 * for the workers' completion as long, before either blocks on a condition
 * variable. Waking a sleeping thread costs 20-50 us on a VM (the vCPU
 * itself has to be woken), a visible share of a millisecond decode call;
 * back-to-back calls (a model's layers) find the workers still polling.
 * The spin is bounded, so idle pools sleep; the poll yields the CPU
 * (sched_yield) between short pause loops, so a worker that shares a CPU
 * with the caller does not hold it up. MLA_CPU_SPIN_US in the environment
 * (read when a pool starts) sets the bound in microseconds, 0 = no spin.
 *
 * On Linux, when the creating thread's affinity mask has at least as many
 * CPUs as the pool has threads, the workers are pinned one per CPU of that
 * mask, away from the CPU the caller runs on; a call that finds the caller
 * on another CPU than last time moves them (one sched_getcpu per call, a
 * re-pin only when the caller migrated). Unpinned, the scheduler at times
 * kept a worker on the caller's CPU and the call ran serially (2-vCPU VM).
 * MLA_CPU_PIN=0 turns pinning off; a failed call leaves a worker as it
 * was. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* pthread_setaffinity_np, CPU_SET, sched_yield */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define POOL_PAUSE() __asm__ volatile("yield")
#else
#define POOL_PAUSE() ((void)0)
#endif

size_t mla_cpu_worker_scratch_floats(void); /* src/cpu/ragged.c */

#ifdef MLA_WITH_CUDA
#include "../cuda/expand.h"
#include "../cuda/runtime.h"
#endif

#define MLA_POOL_SPIN_NS 100000 /* default bound of a spin-wait (100 us) */

struct mla_threadpool {
  int num_workers; /* extra threads (total - 1) */
  pthread_t *threads;
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  /* Written under mu (so a sleeper cannot miss a change) and read without
   * it by spinning threads. */
  atomic_ulong generation;
  atomic_int stop;
  atomic_int pending; /* workers still running the current job */
  long spin_ns;       /* bound of every spin-wait, 0 = sleep at once */
  /* Pinning (see the top of the file): the CPUs of the creating thread's
   * mask (NULL: workers not pinned) and the caller's CPU they avoid. */
  int *cpus, num_cpus;
  int caller_cpu;
  /* current job (written before generation is published) */
  mla_range_fn fn;
  void *arg;
  int64_t n, chunk;
  atomic_llong next;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Poll until done(p, v) or spin_ns have passed; returns done's last value.
 * Short pause loops between clock reads, and a sched_yield after each, so a
 * thread runnable on the same CPU gets it. */
static int spin_until(struct mla_threadpool *p, int (*done)(struct mla_threadpool *, unsigned long),
                      unsigned long v) {
  if (done(p, v)) return 1;
  if (p->spin_ns <= 0) return 0;
  const int64_t t_end = now_ns() + p->spin_ns;
  for (;;) {
    for (int i = 0; i < 32; i++) {
      POOL_PAUSE();
      if (done(p, v)) return 1;
    }
    if (now_ns() >= t_end) return done(p, v);
    sched_yield();
  }
}

static int job_posted(struct mla_threadpool *p, unsigned long seen) {
  return atomic_load_explicit(&p->stop, memory_order_relaxed) ||
         atomic_load_explicit(&p->generation, memory_order_acquire) != seen;
}

static int job_done(struct mla_threadpool *p, unsigned long unused) {
  (void)unused;
  return atomic_load_explicit(&p->pending, memory_order_acquire) == 0;
}

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
  for (;;) {
    if (!spin_until(p, job_posted, seen)) {
      pthread_mutex_lock(&p->mu);
      while (!job_posted(p, seen)) pthread_cond_wait(&p->wake, &p->mu);
      pthread_mutex_unlock(&p->mu);
    }
    if (atomic_load(&p->stop)) break;
    seen = atomic_load_explicit(&p->generation, memory_order_acquire);
    run_chunks(p, wa.worker);
    /* the last worker out tells the caller, which may be asleep */
    if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
      pthread_mutex_lock(&p->mu);
      pthread_cond_signal(&p->done);
      pthread_mutex_unlock(&p->mu);
    }
  }
  return NULL;
}

static void pool_destroy(struct mla_threadpool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stop, 1);
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->num_workers; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->done);
  free(p->threads);
  free(p->cpus);
  free(p);
}

/* A non-negative integer from the environment, or def. */
static long env_long(const char *name, long def, long max) {
  const char *s = getenv(name);
  if (!s || !*s) return def;
  char *end = NULL;
  long v = strtol(s, &end, 10);
  if (*end != '\0' || v < 0) return def;
  return v > max ? max : v;
}

/* Pin the workers one per CPU of cpus[], skipping the caller's CPU. */
static void pin_workers(struct mla_threadpool *p, int caller_cpu) {
#if defined(__linux__) && defined(CPU_SET)
  p->caller_cpu = caller_cpu;
  int k = 0;
  for (int w = 0; w < p->num_workers; w++, k++) {
    if (k < p->num_cpus && p->cpus[k] == caller_cpu) k++;
    if (k >= p->num_cpus) k = 0; /* a guard: num_cpus > num_workers */
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(p->cpus[k], &one);
    (void)pthread_setaffinity_np(p->threads[w], sizeof one, &one);
  }
#else
  (void)p;
  (void)caller_cpu;
#endif
}

/* Decide on pinning (the calling thread's mask must hold every thread)
 * and pin the workers away from the calling thread's CPU. Best effort:
 * without pinning nothing changes. */
static void pin_setup(struct mla_threadpool *p) {
#if defined(__linux__) && defined(CPU_SET)
  if (env_long("MLA_CPU_PIN", 1, 1) == 0) return;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (pthread_getaffinity_np(pthread_self(), sizeof mask, &mask) != 0) return;
  const int n = CPU_COUNT(&mask);
  if (n < p->num_workers + 1) return;
  const int self = sched_getcpu();
  if (self < 0) return;
  p->cpus = malloc(sizeof(int) * (size_t)n);
  if (!p->cpus) return;
  for (int c = 0; c < CPU_SETSIZE && p->num_cpus < n; c++)
    if (CPU_ISSET(c, &mask)) p->cpus[p->num_cpus++] = c;
  pin_workers(p, self);
#else
  (void)p;
#endif
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
  atomic_init(&p->generation, 0);
  atomic_init(&p->stop, 0);
  atomic_init(&p->pending, 0);
  atomic_init(&p->next, 0);
  p->spin_ns = env_long("MLA_CPU_SPIN_US", MLA_POOL_SPIN_NS / 1000, 1000000) * 1000;
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
  pin_setup(p);
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
#if defined(__linux__) && defined(CPU_SET)
  if (p->cpus) { /* the caller changed CPU since the last call: re-pin */
    const int self = sched_getcpu();
    if (self >= 0 && self != p->caller_cpu) pin_workers(p, self);
  }
#endif
  int workers = p->num_workers + 1;
  /* About 4 chunks per worker for balance, never below the grain. */
  int64_t chunk = n / ((int64_t)workers * 4);
  if (chunk < grain) chunk = grain;
  /* Every worker has finished the previous job (pending reached 0), so
   * none reads these fields now; publishing the new generation releases
   * them to the spinners, the mutex to the sleepers. */
  p->fn = fn;
  p->arg = arg;
  p->n = n;
  p->chunk = chunk;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  atomic_store_explicit(&p->pending, p->num_workers, memory_order_relaxed);
  pthread_mutex_lock(&p->mu);
  atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  run_chunks(p, 0);
  if (!spin_until(p, job_done, 0)) {
    pthread_mutex_lock(&p->mu);
    while (!job_done(p, 0)) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
  }
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
