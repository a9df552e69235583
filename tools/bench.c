/* `mla bench`: time the CPU attention kernels and put each figure next to
 * the machine's peak for the instruction the kernels use.
 *
 * Uses only the public API. The peak is not a data-sheet number: a small
 * micro-benchmark in this file measures, in the same run and on as many
 * threads as the kernels get, the throughput of independent chains of the
 * instruction each kernel build is made of (fp32 FMA on zmm for "avx512",
 * on ymm for "avx2", scalar mul + add for "scalar"; the AVX512-BF16 dot
 * product is measured too, for reference). Peaks are the best of three
 * measurements, kernel times the median of several runs after a warm-up:
 * on a shared machine both are disturbed, the median least.
 *
 * FLOPs are analytic (2 per multiply-add of the two products, only the keys
 * the causal mask lets a query see); bytes are what the operation must move
 * at least once: the KV rows (or k / v), q and o. */
#include "bench.h"
#include "bench_cuda.h"
#include "bench_dcp.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mla.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define BENCH_X86 1
#include <immintrin.h>
#endif

/* ---- small helpers -------------------------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct brng {
  uint64_t s;
} brng;

static uint64_t brng_next(brng *g) {
  uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Roughly N(0, 1) (sum of four uniforms, rescaled): the values only need to
 * be finite and of ordinary size. */
static float brng_val(brng *g) {
  double s = 0.0;
  for (int i = 0; i < 4; i++) s += (double)(brng_next(g) >> 11) * 0x1.0p-53;
  return (float)((s - 2.0) * 1.7320508);
}

static void fill_random(brng *g, mla_dtype t, void *dst, int64_t n) {
  enum { CH = 4096 };
  float buf[CH];
  const size_t es = mla_dtype_size(t);
  for (int64_t i = 0; i < n; i += CH) {
    const int m = n - i < CH ? (int)(n - i) : CH;
    for (int j = 0; j < m; j++) buf[j] = brng_val(g);
    mla_convert(buf, MLA_DTYPE_F32, (char *)dst + (size_t)i * es, t, m);
  }
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* ---- peak micro-benchmarks -------------------------------------------------- */
/* Each kernel runs `iters` rounds of 16 independent chains of one instruction
 * (enough to cover its latency on two ports) and returns a value that
 * depends on every chain so nothing is optimised away. The empty asm
 * statements pin the chains to registers. */

enum { PK_SCALAR, PK_AVX2, PK_AVX512, PK_BF16DOT, PK_COUNT };
static const char *const pk_name[PK_COUNT] = {"fp32 mul+add xmm (SSE, scalar build)",
                                              "fp32 FMA ymm (AVX2)",
                                              "fp32 FMA zmm (AVX-512)",
                                              "bf16 dot zmm (AVX512-BF16 vdpbf16ps)"};
/* flops of one round of a kernel's chains */
static const double pk_flops[PK_COUNT] = {8.0 * 12, 16.0 * 12, 32.0 * 16, 64.0 * 16};

#define PK_STEP16(OP)                                                                        \
  a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5), a6 = OP(a6), \
  a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11), a12 = OP(a12),      \
  a13 = OP(a13), a14 = OP(a14), a15 = OP(a15)
#define PK_PIN(C)                                                                          \
  __asm__ volatile("" : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4), "+" C(a5), \
                   "+" C(a6), "+" C(a7));                                                  \
  __asm__ volatile("" : "+" C(a8), "+" C(a9), "+" C(a10), "+" C(a11), "+" C(a12),         \
                   "+" C(a13), "+" C(a14), "+" C(a15))
#define PK_DECL(T, init)                                                                  \
  T a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init, \
    a8 = init, a9 = init, a10 = init, a11 = init, a12 = init, a13 = init, a14 = init,       \
    a15 = init

/* The "scalar" build is portable C, which the compiler vectorises with the
 * baseline ISA: on x86-64 that is SSE (4 lanes, separate mul and add). */
#ifdef BENCH_X86
static double pk_scalar(long iters) {
  const __m128 x = _mm_set1_ps(0.999999f), y = _mm_set1_ps(1e-7f);
  __m128 a0 = _mm_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
         a8 = a0, a9 = a0, a10 = a0, a11 = a0;
#define PK_OPS(a) _mm_add_ps(_mm_mul_ps((a), x), y)
  for (long i = 0; i < iters; i++) {
    a0 = PK_OPS(a0), a1 = PK_OPS(a1), a2 = PK_OPS(a2), a3 = PK_OPS(a3), a4 = PK_OPS(a4),
    a5 = PK_OPS(a5), a6 = PK_OPS(a6), a7 = PK_OPS(a7), a8 = PK_OPS(a8), a9 = PK_OPS(a9),
    a10 = PK_OPS(a10), a11 = PK_OPS(a11);
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
#undef PK_OPS
  float o[4];
  _mm_storeu_ps(o, _mm_add_ps(_mm_add_ps(a0, a11), _mm_add_ps(a5, a6)));
  return (double)o[0];
}
#else
static double pk_scalar(long iters) { /* 12 chains of 4 floats, plain C */
  float a[12][4];
  for (int c = 0; c < 12; c++)
    for (int l = 0; l < 4; l++) a[c][l] = 1.0f;
  for (long i = 0; i < iters; i++)
    for (int c = 0; c < 12; c++)
      for (int l = 0; l < 4; l++) a[c][l] = a[c][l] * 0.999999f + 1e-7f;
  return (double)(a[0][0] + a[11][3]);
}
#endif

#ifdef BENCH_X86
/* 16 ymm registers only: 12 chains plus the two operands */
__attribute__((target("avx2,fma"))) static double pk_avx2(long iters) {
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
#define PK_OPS(a) _mm256_fmadd_ps((a), x, y)
  for (long i = 0; i < iters; i++) {
    a0 = PK_OPS(a0), a1 = PK_OPS(a1), a2 = PK_OPS(a2), a3 = PK_OPS(a3), a4 = PK_OPS(a4),
    a5 = PK_OPS(a5), a6 = PK_OPS(a6), a7 = PK_OPS(a7), a8 = PK_OPS(a8), a9 = PK_OPS(a9),
    a10 = PK_OPS(a10), a11 = PK_OPS(a11);
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
#undef PK_OPS
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a11), _mm256_add_ps(a5, a6));
  float o[8];
  _mm256_storeu_ps(o, s);
  return (double)o[0];
}

__attribute__((target("avx512f"))) static double pk_avx512(long iters) {
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  PK_DECL(__m512, _mm512_set1_ps(1.0f));
#define PK_OPS(a) _mm512_fmadd_ps((a), x, y)
  for (long i = 0; i < iters; i++) {
    PK_STEP16(PK_OPS);
    PK_PIN("v");
  }
#undef PK_OPS
  return (double)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a15), _mm512_add_ps(a7, a8)));
}

__attribute__((target("avx512f,avx512bf16"))) static double pk_bf16dot(long iters) {
  /* 1.0 and 2^-20 as bf16 pairs: the sums stay small and finite */
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3580);
  PK_DECL(__m512, _mm512_set1_ps(1.0f));
#define PK_OPS(a) _mm512_dpbf16_ps((a), x, y)
  for (long i = 0; i < iters; i++) {
    PK_STEP16(PK_OPS);
    PK_PIN("v");
  }
#undef PK_OPS
  return (double)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a15), _mm512_add_ps(a7, a8)));
}
#endif

static int pk_available(int kind) {
#ifdef BENCH_X86
  __builtin_cpu_init();
  switch (kind) {
    case PK_SCALAR: return 1;
    case PK_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case PK_AVX512: return __builtin_cpu_supports("avx512f") != 0;
    case PK_BF16DOT:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    default: return 0;
  }
#else
  return kind == PK_SCALAR;
#endif
}

static double pk_call(int kind, long iters) {
  switch (kind) {
#ifdef BENCH_X86
    case PK_AVX2: return pk_avx2(iters);
    case PK_AVX512: return pk_avx512(iters);
    case PK_BF16DOT: return pk_bf16dot(iters);
#endif
    default: return pk_scalar(iters);
  }
}

typedef struct pk_arg {
  int kind;
  long iters;
  atomic_int *go;
  volatile double sink;
} pk_arg;

static void *pk_thread(void *p) {
  pk_arg *a = p;
  while (!atomic_load(a->go)) {
  }
  a->sink = pk_call(a->kind, a->iters);
  return NULL;
}

/* GFLOP/s of `threads` threads each running the kind's loop at once (0 when
 * the threads cannot be started). */
static double pk_measure(int kind, int threads, double seconds) {
  long iters = 1000;
  for (;;) { /* calibrate on one thread: about `seconds` per run */
    double t = now_s();
    volatile double s = pk_call(kind, iters);
    (void)s;
    t = now_s() - t;
    if (t > seconds / 4 || iters > (1L << 40)) {
      iters = (long)((double)iters * seconds / (t > 1e-9 ? t : 1e-9));
      break;
    }
    iters *= 4;
  }
  if (iters < 1000) iters = 1000;
  atomic_int go = 0;
  pthread_t *th = calloc((size_t)threads, sizeof *th);
  pk_arg *args = calloc((size_t)threads, sizeof *args);
  if (!th || !args) {
    free(th);
    free(args);
    return 0.0;
  }
  int started = 0;
  for (int i = 0; i < threads; i++) {
    args[i].kind = kind;
    args[i].iters = iters;
    args[i].go = &go;
    if (pthread_create(&th[i], NULL, pk_thread, &args[i]) != 0) break;
    started++;
  }
  const double t = now_s();
  atomic_store(&go, 1);
  for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
  const double dt = now_s() - t;
  free(th);
  free(args);
  return started == threads ? (double)threads * (double)iters * pk_flops[kind] / dt * 1e-9 : 0.0;
}

/* ---- read bandwidth (for the roofline) --------------------------------------- */

typedef struct bw_arg {
  const float *p;
  size_t n;
  int passes;
  atomic_int *go;
  volatile float sink;
} bw_arg;

static void *bw_thread(void *q) {
  bw_arg *a = q;
  while (!atomic_load(a->go)) {
  }
  float s[16] = {0};
  for (int r = 0; r < a->passes; r++)
    for (size_t i = 0; i + 16 <= a->n; i += 16)
      for (int j = 0; j < 16; j++) s[j] += a->p[i + j];
  float t = 0;
  for (int j = 0; j < 16; j++) t += s[j];
  a->sink = t;
  return NULL;
}

static double measure_read_bw(size_t bytes, int threads) {
  const size_t n = bytes / sizeof(float);
  float *buf = malloc(n * sizeof(float));
  if (!buf) return 0.0;
  for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 7);
  const size_t per = n / (size_t)threads / 16 * 16;
  double best = 0.0;
  pthread_t *th = calloc((size_t)threads, sizeof *th);
  bw_arg *a = calloc((size_t)threads, sizeof *a);
  for (int rep = 0; rep < 3 && th && a; rep++) {
    atomic_int go = 0;
    int started = 0;
    for (int i = 0; i < threads; i++) {
      a[i].p = buf + (size_t)i * per;
      a[i].n = per;
      a[i].passes = 2;
      a[i].go = &go;
      if (pthread_create(&th[i], NULL, bw_thread, &a[i]) != 0) break;
      started++;
    }
    const double t = now_s();
    atomic_store(&go, 1);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    const double dt = now_s() - t;
    const double gbs = 2.0 * (double)per * started * sizeof(float) / dt * 1e-9;
    if (started == threads && gbs > best) best = gbs;
  }
  free(th);
  free(a);
  free(buf);
  return best;
}

/* ---- cases ------------------------------------------------------------------ */

typedef enum { CASE_DECODE, CASE_VERIFY, CASE_MHA } case_kind;

typedef struct bcase {
  case_kind kind;
  int H, sk, bs, q; /* q: query tokens per request (decode 1, verify s_q); MHA: sk tokens */
} bcase;

static void case_name(const bcase *c, char *buf, size_t n) {
  switch (c->kind) {
    case CASE_DECODE: snprintf(buf, n, "decode_h%d_sk%d_bs%d", c->H, c->sk, c->bs); break;
    case CASE_VERIFY:
      snprintf(buf, n, "verify%d_h%d_sk%d_bs%d", c->q, c->H, c->sk, c->bs);
      break;
    default: snprintf(buf, n, "mha192_h%d_t%d_causal", c->H, c->sk); break;
  }
}

typedef struct result {
  double ms, best_ms, flops, bytes; /* median and fastest of the runs */
} result;

static void time_stats(double *t, int n, result *r) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  r->ms = (n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2])) * 1e3;
  r->best_ms = t[0] * 1e3;
}

#define BENCH_PAGE 64

static int fail(mla_ctx *ctx, const char *what, mla_status st) {
  fprintf(stderr, "mla bench: %s: %s (%s)\n", what, mla_status_string(st), mla_ctx_last_error(ctx));
  return 1;
}

/* Absorbed MLA over a bf16 paged cache: DECODE or TARGET_VERIFY. */
static int run_absorbed(mla_ctx *ctx, int threads, const bcase *c, int runs, brng *g,
                        result *res) {
  int rc = 1;
  mla_status st;
  const int bs = c->bs, H = c->H, sk = c->sk, q = c->q;
  const int pages = bs * ((sk + BENCH_PAGE - 1) / BENCH_PAGE) + 2;
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  int32_t *ids = calloc((size_t)bs, sizeof *ids), *seq = calloc((size_t)bs, sizeof *seq);
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)sk);
  float *cbuf = malloc(sizeof(float) * (size_t)1024 * MLA_LATENT);
  float *rbuf = malloc(sizeof(float) * (size_t)1024 * MLA_ROPE);
  void *pws = NULL, *ws = NULL, *qn = NULL, *qr = NULL, *out = NULL;
  float *lse = NULL;
  double *times = calloc((size_t)runs, sizeof *times);
  if (!ids || !seq || !slots || !cbuf || !rbuf || !times) goto done;

  mla_kv_cache_desc cd = {1, pages, BENCH_PAGE, MLA_DTYPE_BF16, NULL};
  if ((st = mla_kv_cache_create(ctx, &cd, &cache)) != MLA_OK) {
    rc = fail(ctx, "mla_kv_cache_create", st);
    goto done;
  }
  mla_req_table_desc rd = {bs, sk, pages, BENCH_PAGE};
  if ((st = mla_req_table_create(ctx, &rd, cache, &rt)) != MLA_OK) {
    rc = fail(ctx, "mla_req_table_create", st);
    goto done;
  }
  for (int i = 0; i < bs; i++) {
    if ((st = mla_req_add(rt, &ids[i])) != MLA_OK ||
        (st = mla_req_extend(rt, ids[i], sk, slots)) != MLA_OK) {
      fprintf(stderr, "mla bench: request table: %s\n", mla_req_table_last_error(rt));
      goto done;
    }
    for (int t0 = 0; t0 < sk; t0 += 1024) {
      const int n = sk - t0 < 1024 ? sk - t0 : 1024;
      for (int64_t j = 0; j < (int64_t)n * MLA_LATENT; j++) cbuf[j] = brng_val(g);
      for (int64_t j = 0; j < (int64_t)n * MLA_ROPE; j++) rbuf[j] = brng_val(g);
      if ((st = mla_kv_cache_write(cache, 0, n, slots + t0, cbuf, rbuf, MLA_DTYPE_F32)) != MLA_OK) {
        fprintf(stderr, "mla bench: cache write: %s\n", mla_kv_cache_last_error(cache));
        goto done;
      }
    }
    seq[i] = c->kind == CASE_DECODE ? sk : sk - q;
  }
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = c->kind == CASE_DECODE ? MLA_MODE_DECODE : MLA_MODE_TARGET_VERIFY;
  b.batch_size = bs;
  b.req_ids = ids;
  b.seq_lens = seq;
  b.num_draft_tokens = c->kind == CASE_DECODE ? 0 : q;
  mla_plan_limits lim = {bs, bs * q, bs * sk, sk, BENCH_PAGE, threads, 0};
  size_t pbytes = 0, wbytes = 0;
  if ((st = mla_plan_workspace_size(ctx, &lim, &pbytes)) != MLA_OK) {
    rc = fail(ctx, "mla_plan_workspace_size", st);
    goto done;
  }
  pws = malloc(pbytes);
  mla_plan plan;
  if (!pws || (st = mla_plan_build(ctx, rt, &b, &lim, H, pws, pbytes, &plan)) != MLA_OK) {
    rc = pws ? fail(ctx, "mla_plan_build", st) : 1;
    goto done;
  }
  if ((st = mla_attention_absorbed_workspace_size(ctx, &plan, H, &wbytes)) != MLA_OK) {
    rc = fail(ctx, "mla_attention_absorbed_workspace_size", st);
    goto done;
  }
  const int64_t rows = (int64_t)plan.num_q_tokens * H;
  ws = malloc(wbytes ? wbytes : 1);
  qn = malloc((size_t)rows * MLA_LATENT * 2);
  qr = malloc((size_t)rows * MLA_ROPE * 2);
  out = malloc((size_t)rows * MLA_LATENT * 2);
  lse = malloc((size_t)rows * sizeof(float));
  if (!ws || !qn || !qr || !out || !lse) goto done;
  fill_random(g, MLA_DTYPE_BF16, qn, rows * MLA_LATENT);
  fill_random(g, MLA_DTYPE_BF16, qr, rows * MLA_ROPE);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = 0.0721687836f; /* 192^-0.5, DeepSeek's */
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
    const double t = now_s();
    st = mla_attention_absorbed(ctx, cache, 0, &plan, &a, ws, wbytes);
    if (st != MLA_OK) {
      rc = fail(ctx, "mla_attention_absorbed", st);
      goto done;
    }
    if (r >= 0) times[r] = now_s() - t;
  }
  time_stats(times, runs, res);
  res->flops = 0.0;
  for (int i = 0; i < bs; i++)
    for (int j = 0; j < q; j++) /* query j of q sees keys [0, sk - q + j] */
      res->flops += 2.0 * H * (MLA_ROW + MLA_LATENT) * (double)(sk - q + j + 1);
  res->bytes = (double)bs * sk * 2 * MLA_ROW + (double)rows * 2 * (MLA_ROW + MLA_LATENT);
  rc = 0;
done:
  free(ids);
  free(seq);
  free(slots);
  free(cbuf);
  free(rbuf);
  free(pws);
  free(ws);
  free(qn);
  free(qr);
  free(out);
  free(lse);
  free(times);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
  return rc;
}

/* Ragged MHA prefill (EXTEND without prefix): one request of sk tokens,
 * qk 192 / v 128, causal, bf16. */
static int run_mha(mla_ctx *ctx, const bcase *c, int runs, brng *g, result *res) {
  int rc = 1;
  const int T = c->sk, H = c->H, dqk = 192, dv = 128;
  void *qb = malloc((size_t)T * H * dqk * 2), *kb = malloc((size_t)T * H * dqk * 2);
  void *vb = malloc((size_t)T * H * dv * 2), *ob = malloc((size_t)T * H * dv * 2);
  float *lse = malloc((size_t)T * H * sizeof(float));
  double *times = calloc((size_t)runs, sizeof *times);
  if (!qb || !kb || !vb || !ob || !lse || !times) goto done;
  fill_random(g, MLA_DTYPE_BF16, qb, (int64_t)T * H * dqk);
  fill_random(g, MLA_DTYPE_BF16, kb, (int64_t)T * H * dqk);
  fill_random(g, MLA_DTYPE_BF16, vb, (int64_t)T * H * dv);
  int32_t indptr[2] = {0, T};
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = 1;
  a.num_heads = H;
  a.num_kv_heads = H;
  a.qk_dim = dqk;
  a.v_dim = dv;
  a.scale = 0.0721687836f;
  a.causal = 1;
  a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = indptr;
  a.kv_indptr = indptr;
  a.q = qb;
  a.k = kb;
  a.v = vb;
  a.out = ob;
  a.lse = lse;
  for (int r = -1; r < runs; r++) {
    const double t = now_s();
    mla_status st = mla_attention_ragged(ctx, &a);
    if (st != MLA_OK) {
      rc = fail(ctx, "mla_attention_ragged", st);
      goto done;
    }
    if (r >= 0) times[r] = now_s() - t;
  }
  time_stats(times, runs, res);
  res->flops = 2.0 * H * (dqk + dv) * ((double)T * (T + 1) / 2.0);
  res->bytes = (double)T * H * 2 * (dqk + dqk + dv + dv);
  rc = 0;
done:
  free(qb);
  free(kb);
  free(vb);
  free(ob);
  free(lse);
  free(times);
  return rc;
}

/* ---- options and report ------------------------------------------------------ */

static void bench_usage(FILE *f) {
  fprintf(f,
          "usage: mla bench [options]\n"
          "  --device D     cpu (default) or cuda (`mla bench --device cuda --help`)\n"
          "  --dcp N        decode context parallel on N GPUs vs one (`mla bench --dcp 2 --help`)\n"
          "  --threads N    CPU threads, 0 = all online CPUs (default 0)\n"
          "  --quick        small shapes, few runs (a few seconds; for CI)\n"
          "  --case S       only the cases whose name contains S\n"
          "  --runs N       timed runs per case after one warm-up (default 7, quick 3)\n"
          "  --isa I        force the CPU kernel build: scalar, avx2, avx512 (sets MLA_CPU_ISA)\n"
          "  --csv          comma-separated output\n"
          "  --plot F.png   roofline plot through gnuplot (skipped when gnuplot is missing)\n");
}

static int bench_bad(const char *what, const char *value) {
  fprintf(stderr, "mla bench: invalid %s '%s'\n\n", what, value ? value : "(missing)");
  bench_usage(stderr);
  return 2;
}

static int parse_long(const char *s, long lo, long hi, long *v) {
  if (!s || !*s) return 0;
  char *end = NULL;
  errno = 0;
  long x = strtol(s, &end, 10);
  if (errno || *end || x < lo || x > hi) return 0;
  *v = x;
  return 1;
}

static int on_path(const char *prog) {
  const char *path = getenv("PATH");
  if (!path) return 0;
  char buf[4096];
  while (*path) {
    const char *e = strchr(path, ':');
    size_t n = e ? (size_t)(e - path) : strlen(path);
    if (n > 0 && n + strlen(prog) + 2 < sizeof buf) {
      memcpy(buf, path, n);
      buf[n] = '/';
      strcpy(buf + n + 1, prog);
      if (access(buf, X_OK) == 0) return 1;
    }
    if (!e) break;
    path = e + 1;
  }
  return 0;
}

typedef struct row {
  char name[64];
  result r;
  double peak;
} row;

static void plot(const char *file, const row *rows, int n, double peak, const char *peak_name,
                 double bw) {
  if (!on_path("gnuplot")) {
    printf("plot: gnuplot not found on PATH, %s not written (the figures above are complete)\n",
           file);
    return;
  }
  FILE *gp = popen("gnuplot", "w");
  if (!gp) {
    printf("plot: cannot start gnuplot, %s not written\n", file);
    return;
  }
  fprintf(gp, "set terminal pngcairo size 1000,700 noenhanced\nset output '%s'\n", file);
  fprintf(gp, "set logscale xy\nset xlabel 'arithmetic intensity (FLOP / byte moved)'\n");
  fprintf(gp, "set ylabel 'GFLOP/s'\nset grid\nset key bottom right\n");
  fprintf(gp, "set title 'libmla CPU kernels: roofline (peak %.0f GFLOP/s %s, read %.1f GB/s)'\n",
          peak, peak_name, bw);
  fprintf(gp, "$d << EOD\n");
  for (int i = 0; i < n; i++)
    fprintf(gp, "%g %g %s\n", rows[i].r.flops / rows[i].r.bytes,
            rows[i].r.flops / (rows[i].r.ms * 1e-3) * 1e-9, rows[i].name);
  fprintf(gp, "EOD\n");
  fprintf(gp, "set xrange [0.1:10000]\n");
  fprintf(gp,
          "plot (x * %g < %g ? x * %g : %g) title 'roof' lw 2, "
          "$d using 1:2 with points pt 7 title 'cases', "
          "$d using 1:2:3 with labels offset 0,1 font ',8' notitle\n",
          bw, peak, bw, peak);
  const int st = pclose(gp);
  if (st != 0) printf("plot: gnuplot failed (status %d); %s may be missing\n", st, file);
  else printf("plot: %s written\n", file);
}

/* The instruction a kernel build is made of. */
static int peak_kind_of(const char *isa) {
  if (!strcmp(isa, "avx512")) return PK_AVX512;
  if (!strcmp(isa, "avx2")) return PK_AVX2;
  return PK_SCALAR;
}

static void cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "model name", 10)) {
      const char *p = strchr(line, ':');
      if (p) {
        p++;
        while (*p == ' ') p++;
        snprintf(buf, n, "%s", p);
        buf[strcspn(buf, "\n")] = 0;
      }
      break;
    }
  }
  fclose(f);
}

int bench_main(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    if (!strcmp(argv[i], "--dcp")) return bench_dcp_main(argc, argv);
  for (int i = 0; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--device") && !strcmp(argv[i + 1], "cuda")) return bench_cuda_main(argc, argv);
  int threads = 0, quick = 0, csv = 0, runs = 0;
  const char *filter = NULL, *plot_file = NULL, *isa_req = NULL;
  for (int i = 0; i < argc; i++) {
    const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    long x;
    if (!strcmp(k, "--quick")) {
      quick = 1;
      continue;
    }
    if (!strcmp(k, "--csv")) {
      csv = 1;
      continue;
    }
    if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
      bench_usage(stdout);
      return 0;
    }
    if (!strcmp(k, "--device")) {
      if (!v) return bench_bad("--device", v);
      if (strcmp(v, "cpu")) return bench_bad("--device", v);
    } else if (!strcmp(k, "--threads")) {
      if (!parse_long(v, 0, 1024, &x)) return bench_bad("--threads", v);
      threads = (int)x;
    } else if (!strcmp(k, "--runs")) {
      if (!parse_long(v, 1, 1000, &x)) return bench_bad("--runs", v);
      runs = (int)x;
    } else if (!strcmp(k, "--case")) {
      if (!v) return bench_bad("--case", v);
      filter = v;
    } else if (!strcmp(k, "--plot")) {
      if (!v || !*v) return bench_bad("--plot", v);
      plot_file = v;
    } else if (!strcmp(k, "--isa")) {
      if (!v || (strcmp(v, "scalar") && strcmp(v, "avx2") && strcmp(v, "avx512")))
        return bench_bad("--isa", v);
      isa_req = v;
    } else {
      return bench_bad("option", k);
    }
    i++; /* the options above take a value */
  }
  if (!runs) runs = quick ? 3 : 7;
  /* before the first kernel call: the library reads it once */
  if (isa_req) setenv("MLA_CPU_ISA", isa_req, 1);

  mla_ctx *ctx = NULL;
  mla_ctx_desc d;
  memset(&d, 0, sizeof d);
  d.device = MLA_DEVICE_CPU;
  d.num_threads = threads;
  mla_status st = mla_ctx_create(&d, &ctx);
  if (st != MLA_OK) {
    fprintf(stderr, "mla bench: mla_ctx_create: %s\n", mla_status_string(st));
    return 1;
  }
  int nt = 1;
  const char *isa = "?";
  mla_ctx_get_threads(ctx, &nt);
  if ((st = mla_ctx_cpu_isa(ctx, &isa)) != MLA_OK) {
    fprintf(stderr, "mla bench: mla_ctx_cpu_isa: %s\n", mla_status_string(st));
    mla_ctx_destroy(ctx);
    return 1;
  }

  /* peaks, on as many threads as the kernels use */
  const double pk_seconds = quick ? 0.02 : 0.15;
  double peak[PK_COUNT] = {0};
  for (int k = 0; k < PK_COUNT; k++) {
    if (!pk_available(k)) continue;
    for (int rep = 0; rep < 3; rep++) {
      const double v = pk_measure(k, nt, pk_seconds);
      if (v > peak[k]) peak[k] = v;
    }
  }
  const double bw = measure_read_bw(quick ? ((size_t)32 << 20) : ((size_t)256 << 20), nt);
  const int pk = peak_kind_of(isa);

  char model[256];
  cpu_model(model, sizeof model);
  const char *pfx = csv ? "# " : "";
  printf("%slibmla %s CPU bench: %s, %ld online CPUs, %d threads\n", pfx, mla_version_string(),
         model, sysconf(_SC_NPROCESSORS_ONLN), nt);
  printf("%skernel ISA: %s (instruction: %s)\n", pfx, isa, pk_name[pk]);
  printf("%smeasured peak on %d thread%s (best of 3):", pfx, nt, nt > 1 ? "s" : "");
  for (int k = 0; k < PK_COUNT; k++)
    if (peak[k] > 0) printf("%s %s %.1f GFLOP/s", k ? ";" : "", pk_name[k], peak[k]);
  printf("\n%sread bandwidth (%s MiB buffer, best of 3): %.1f GB/s\n", pfx, quick ? "32" : "256",
         bw);
  printf("%stimes: median (and fastest) of %d runs after a warm-up; bf16 cache, bf16 "
         "activations, page 64\n",
         pfx, runs);

  bcase cases[32];
  int nc = 0;
  if (quick) {
    cases[nc++] = (bcase){CASE_DECODE, 16, 512, 1, 1};
    cases[nc++] = (bcase){CASE_DECODE, 128, 512, 2, 1};
    cases[nc++] = (bcase){CASE_VERIFY, 16, 512, 1, 2};
    cases[nc++] = (bcase){CASE_MHA, 16, 256, 1, 0};
  } else {
    const int Hs[2] = {16, 128}, sks[3] = {4096, 8192, 16384};
    for (int h = 0; h < 2; h++)
      for (int s = 0; s < 3; s++) cases[nc++] = (bcase){CASE_DECODE, Hs[h], sks[s], 1, 1};
    for (int h = 0; h < 2; h++) cases[nc++] = (bcase){CASE_DECODE, Hs[h], 4096, 4, 1};
    for (int h = 0; h < 2; h++) cases[nc++] = (bcase){CASE_VERIFY, Hs[h], 8192, 1, 2};
    cases[nc++] = (bcase){CASE_MHA, 16, 2048, 1, 0};
  }

  if (csv)
    printf("case,threads,isa,time_ms,best_ms,gflops,gbs,peak_gflops,pct_peak,pct_peak_best\n");
  else
    printf("\n%-24s %3s %-6s %9s %9s %8s %7s %7s %7s %6s\n", "case", "thr", "isa", "median ms",
           "best ms", "GFLOP/s", "GB/s", "peak", "% peak", "(best)");
  row rows[32];
  int nr = 0, rc = 0;
  brng g = {0x5eed1234ull};
  for (int i = 0; i < nc; i++) {
    char name[64];
    case_name(&cases[i], name, sizeof name);
    if (filter && !strstr(name, filter)) continue;
    result r;
    const int e = cases[i].kind == CASE_MHA ? run_mha(ctx, &cases[i], runs, &g, &r)
                                            : run_absorbed(ctx, nt, &cases[i], runs, &g, &r);
    if (e) {
      rc = 1;
      continue;
    }
    /* GFLOP/s, GB/s and % of peak from the median time; (best): from the
     * fastest run, the kernel's capability to set against the peak's */
    const double gf = r.flops / (r.ms * 1e-3) * 1e-9, gbs = r.bytes / (r.ms * 1e-3) * 1e-9;
    const double gfb = r.flops / (r.best_ms * 1e-3) * 1e-9;
    const double pct = peak[pk] > 0 ? 100.0 * gf / peak[pk] : 0.0;
    const double pctb = peak[pk] > 0 ? 100.0 * gfb / peak[pk] : 0.0;
    if (csv)
      printf("%s,%d,%s,%.4f,%.4f,%.2f,%.3f,%.1f,%.1f,%.1f\n", name, nt, isa, r.ms, r.best_ms, gf,
             gbs, peak[pk], pct, pctb);
    else
      printf("%-24s %3d %-6s %9.3f %9.3f %8.1f %7.2f %7.1f %6.1f%% %5.1f%%\n", name, nt, isa, r.ms,
             r.best_ms, gf, gbs, peak[pk], pct, pctb);
    fflush(stdout);
    snprintf(rows[nr].name, sizeof rows[nr].name, "%s", name);
    rows[nr].r = r;
    rows[nr].peak = peak[pk];
    nr++;
  }
  if (nr == 0 && filter) printf("%sno case matches '%s'\n", pfx, filter);
  if (plot_file) plot(plot_file, rows, nr, peak[pk], pk_name[pk], bw);
  mla_ctx_destroy(ctx);
  return rc;
}
