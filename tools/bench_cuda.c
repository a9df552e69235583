/* `mla bench --device cuda`: the CUDA decode path through the public API
 * (mla_step_prepare once, then mla_step_attention timed), on the shapes of
 * the decode issue: b = 128, s_k in {4096, 8192, 16384}, H in {16, 128}, s_q in
 * {1, 2} (DECODE / TARGET_VERIFY), page 64, every cache dtype the library
 * takes on the GPU (refused ones are listed with the library's reason). The
 * `fp8-math` rows are the fp8 calls again with MLA_FLAG_FP8_MATH, right after
 * the fp8 rows of the same H (same cache, same run), for the shapes where the
 * flag takes effect (s_q * H > 32: H = 128 by default); same formulas.
 *
 * Time: CUDA events around one attention call, L2 flushed before each
 * (a 256 MiB memset), median of --runs after warm-ups. `graph_us` is one
 * whole step (mla_step_prepare + mla_step_attention) captured in a CUDA
 * graph and replayed, timed the same way; `host_us` the host time of the two
 * calls (what eager serving pays on the CPU per step and layer). TFLOP/s =
 * b s_q H s_k 1088 2 / t; GB/s = (KV rows + q + o bytes) / t. The device's
 * copy rate (cudaMemcpy device to device, read + write bytes) is measured in
 * the same run. Then the prefill shapes: causal ragged MHA 192/128, H=128, one
 * 8K and one 16K sequence and 16 x 1K, TFLOP/s with causal FLOPs counted once;
 * and the paged absorbed prefill: 16 requests of a 4K prefix + 512 new tokens
 * (the shape), 1 x (16K + 1K), 4 x (8K + 256), H=128. And the KV
 * write (8K and 128K rows into bf16 / fp8 / fp8-block caches) against the
 * copy rate. Compiled to a stub without CUDA. */
#include "bench_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mla.h"

#ifndef MLA_CLI_CUDA
int bench_cuda_main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "mla bench: --device cuda: this build has no CUDA\n");
  return 2;
}
#else
#include <cuda_runtime.h>

#define BC_CK(x)                                                                               \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "mla bench: CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__);                                                                       \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

static uint64_t bc_rng(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static float bc_val(uint64_t *s) { return (float)((double)(bc_rng(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0); }

static double bc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_f(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

/* Device buffer of n random 16-bit values of type t (bf16 or f16, converted
 * through mla_convert). */
static void *rand_16(uint64_t *seed, size_t n, mla_dtype t) {
  float *f = malloc(sizeof(float) * n);
  uint16_t *h = malloc(2 * n);
  void *d = NULL;
  if (f && h) {
    for (size_t i = 0; i < n; i++) f[i] = bc_val(seed);
    mla_convert(f, MLA_DTYPE_F32, h, t, (int64_t)n);
    if (cudaMalloc(&d, 2 * n) == cudaSuccess) cudaMemcpy(d, h, 2 * n, cudaMemcpyHostToDevice);
  }
  free(f);
  free(h);
  return d;
}
static void *rand_bf16(uint64_t *seed, size_t n) { return rand_16(seed, n, MLA_DTYPE_BF16); }

typedef struct bc_opts {
  int b, runs, csv, quick, P, no_prefill, no_kv_write;
  int spread;      /* --kv-spread: request lengths uniform in s_k (1 +- spread / 100); 0: all s_k */
  int sk[8], nsk, H[4], nh, sq[4], nsq;
  mla_dtype dt[4];
  int dt_plain[4]; /* 1: the dtype's own rows (0: fp8 only for its fp8-math rows) */
  int ndt;
  int fp8_math;    /* `fp8-math` rows after the fp8 ones */
} bc_opts;

/* One cache (all requests' pages, shuffled) and its req_to_token, shared by
 * every H and s_q of one (s_k, dtype). */
typedef struct bc_world {
  mla_kv_cache *cache;
  int32_t *r2t;  /* device [b, s_k] */
  int pages;
  int32_t *lens; /* [b] each request's kv length (bc_lens) */
  int max_len;   /* the longest: req_to_token's row stride */
  mla_dtype act; /* the activations' dtype: f16 for an f16 cache (what the CUDA kernels take), else bf16 */
} bc_world;

/* The kv length of each request for mean length sk: all sk, or with
 * --kv-spread S uniform in [sk - sk S / 100, sk + sk S / 100] (at least 64),
 * drawn from a generator seeded by (sk, S) alone, so every build, dtype, H
 * and s_q of a run and of later runs sees the same lengths. Returns the
 * longest. */
static int bc_lens(const bc_opts *o, int sk, int32_t *lens /* [o->b] */) {
  const int64_t d = (int64_t)sk * o->spread / 100;
  uint64_t s = 0x6b76ull * 1000003u + (uint64_t)sk * 131u + (uint64_t)o->spread;
  int longest = 0;
  for (int i = 0; i < o->b; i++) {
    int64_t len = sk;
    if (d > 0) len = sk - d + (int64_t)(bc_rng(&s) % (uint64_t)(2 * d + 1));
    lens[i] = (int32_t)(len < 64 ? 64 : len);
    if (lens[i] > longest) longest = lens[i];
  }
  return longest;
}

static int world_make(mla_ctx *ctx, const bc_opts *o, int sk_mean, mla_dtype dt, uint64_t *seed, bc_world *w,
                      char *why, size_t why_n) {
  memset(w, 0, sizeof *w);
  w->act = dt == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16;
  w->lens = malloc(sizeof(int32_t) * (size_t)o->b);
  if (!w->lens) {
    snprintf(why, why_n, "out of host memory");
    return 1;
  }
  const int sk = w->max_len = bc_lens(o, sk_mean, w->lens); /* the cache holds o->b requests this long */
  const int P = o->P, per = (sk + P - 1) / P;
  w->pages = o->b * per + 1;
  mla_kv_cache_desc cd = {1, w->pages, P, dt, NULL};
  mla_status st = mla_kv_cache_create(ctx, &cd, &w->cache);
  if (st != MLA_OK) {
    snprintf(why, why_n, "mla_kv_cache_create: %s", mla_ctx_last_error(ctx));
    return 1;
  }
  /* pages 1..pages-1 shuffled over the requests */
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)w->pages);
  int32_t *r2t = malloc(sizeof(int32_t) * (size_t)o->b * sk);
  for (int i = 0; i < w->pages - 1; i++) perm[i] = i + 1;
  for (int i = w->pages - 2; i > 0; i--) {
    int j = (int)(bc_rng(seed) % (uint64_t)(i + 1));
    int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int r = 0; r < o->b; r++)
    for (int j = 0; j < sk; j++) r2t[(size_t)r * sk + j] = perm[r * per + j / P] * P + j % P;
  BC_CK(cudaMalloc((void **)&w->r2t, sizeof(int32_t) * (size_t)o->b * sk));
  BC_CK(cudaMemcpy(w->r2t, r2t, sizeof(int32_t) * (size_t)o->b * sk, cudaMemcpyHostToDevice));
  /* rows: one random chunk written over all slots (values repeat; timing only) */
  enum { CH = 65536 };
  void *c = rand_bf16(seed, (size_t)CH * MLA_LATENT), *rr = rand_bf16(seed, (size_t)CH * MLA_ROPE);
  int32_t *slots_h = malloc(sizeof(int32_t) * CH), *slots_d = NULL;
  BC_CK(cudaMalloc((void **)&slots_d, sizeof(int32_t) * CH));
  const int64_t total = (int64_t)w->pages * P;
  for (int64_t s0 = 0; s0 < total && c && rr; s0 += CH) {
    const int n = total - s0 < CH ? (int)(total - s0) : CH;
    for (int i = 0; i < n; i++) slots_h[i] = (int32_t)(s0 + i);
    BC_CK(cudaMemcpy(slots_d, slots_h, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
    st = mla_kv_cache_write(w->cache, 0, n, slots_d, c, rr, MLA_DTYPE_BF16);
    if (st != MLA_OK) {
      snprintf(why, why_n, "mla_kv_cache_write: %s", mla_kv_cache_last_error(w->cache));
      break;
    }
  }
  cudaFree(c);
  cudaFree(rr);
  cudaFree(slots_d);
  free(slots_h);
  free(perm);
  free(r2t);
  return st == MLA_OK && mla_ctx_synchronize(ctx) == MLA_OK ? 0 : 1;
}

static void world_free(bc_world *w) {
  free(w->lens);
  mla_kv_cache_destroy(w->cache);
  cudaFree(w->r2t);
}

typedef struct bc_result {
  double us, tflops, gbs, prep_us, graph_us, host_us;
  char note[200];
} bc_result;

static int run_case(mla_ctx *ctx, const bc_opts *o, const bc_world *w, int H, int sq, unsigned flags,
                    void *flush, size_t flush_bytes, uint64_t *seed, bc_result *res) {
  memset(res, 0, sizeof *res);
  const int b = o->b, Tq = b * sq;
  const int32_t *lens = w->lens; /* the world's batch */
  const int sk = w->max_len;
  double kv_sum = 0;
  for (int i = 0; i < b; i++) kv_sum += lens[i];
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = sq == 1 ? MLA_MODE_DECODE : MLA_MODE_TARGET_VERIFY;
  d.batch_size = b;
  d.num_draft_tokens = sq == 1 ? 0 : sq;
  d.max_kv_len = sk;
  d.num_heads = H;
  d.page_size = o->P;
  size_t wsb = 0;
  mla_status st = mla_step_workspace_size(ctx, &d, &wsb);
  if (st != MLA_OK) {
    snprintf(res->note, sizeof res->note, "%s", mla_ctx_last_error(ctx));
    return 0;
  }
  int32_t *ids_h = malloc(sizeof(int32_t) * b), *seq_h = malloc(sizeof(int32_t) * b);
  for (int i = 0; i < b; i++) {
    ids_h[i] = i;
    seq_h[i] = lens[i] - (sq == 1 ? 0 : sq); /* kv = lens[i] in both modes */
  }
  int32_t *ids = NULL, *seq = NULL;
  void *ws = NULL, *out = NULL;
  float *lse = NULL;
  void *qn = rand_16(seed, (size_t)Tq * H * MLA_LATENT, w->act), *qr = rand_16(seed, (size_t)Tq * H * MLA_ROPE, w->act);
  BC_CK(cudaMalloc((void **)&ids, sizeof(int32_t) * b));
  BC_CK(cudaMalloc((void **)&seq, sizeof(int32_t) * b));
  BC_CK(cudaMemcpy(ids, ids_h, sizeof(int32_t) * b, cudaMemcpyHostToDevice));
  BC_CK(cudaMemcpy(seq, seq_h, sizeof(int32_t) * b, cudaMemcpyHostToDevice));
  BC_CK(cudaMalloc(&ws, wsb));
  BC_CK(cudaMalloc(&out, 2 * (size_t)Tq * H * MLA_LATENT));
  BC_CK(cudaMalloc((void **)&lse, sizeof(float) * (size_t)Tq * H));
  free(ids_h);
  free(seq_h);
  mla_step_inputs in = {w->r2t, sk, b, ids, seq, NULL};
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = 0.0721687836f;
  a.flags = flags;
  a.act_dtype = w->act;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  cudaStream_t s = NULL;
  cudaEvent_t e0, e1;
  BC_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BC_CK(cudaEventCreate(&e0));
  BC_CK(cudaEventCreate(&e1));
  mla_ctx_set_stream(ctx, s);
  float *t = malloc(sizeof(float) * (size_t)o->runs), *tp = malloc(sizeof(float) * (size_t)o->runs);
  float *th = malloc(sizeof(float) * (size_t)o->runs); /* host time of the two calls (enqueue only) */
  int rc = 0;
  for (int r = -2; r < o->runs && rc == 0; r++) {
    BC_CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, s));
    BC_CK(cudaEventRecord(e0, s));
    const double h0 = bc_now();
    st = mla_step_prepare(ctx, &d, w->cache, &in, ws, wsb);
    const double h1 = bc_now();
    BC_CK(cudaEventRecord(e1, s));
    if (st != MLA_OK) {
      snprintf(res->note, sizeof res->note, "%s", mla_ctx_last_error(ctx));
      rc = -1;
      break;
    }
    BC_CK(cudaEventSynchronize(e1));
    float ms_p = 0;
    BC_CK(cudaEventElapsedTime(&ms_p, e0, e1));
    BC_CK(cudaMemsetAsync(flush, (r + 1) & 0xff, flush_bytes, s));
    BC_CK(cudaEventRecord(e0, s));
    const double h2 = bc_now();
    st = mla_step_attention(ctx, &d, w->cache, 0, &a, ws, wsb);
    const double h3 = bc_now();
    BC_CK(cudaEventRecord(e1, s));
    if (st != MLA_OK) {
      snprintf(res->note, sizeof res->note, "%s", mla_ctx_last_error(ctx));
      rc = -1;
      break;
    }
    BC_CK(cudaEventSynchronize(e1));
    float ms = 0;
    BC_CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 0) {
      t[r] = ms;
      tp[r] = ms_p;
      th[r] = (float)((h1 - h0 + h3 - h2) * 1e6);
    }
  }
  if (rc == 0) {
    qsort(t, (size_t)o->runs, sizeof(float), cmp_f);
    qsort(tp, (size_t)o->runs, sizeof(float), cmp_f);
    res->prep_us = 1e3 * tp[o->runs / 2];
    qsort(th, (size_t)o->runs, sizeof(float), cmp_f);
    res->host_us = th[o->runs / 2];
  }
  /* One step (metadata build + attention) captured in a CUDA graph and
   * replayed: what a serving engine's decode step costs per layer here. */
  if (rc == 0) {
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    BC_CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    mla_status s1 = mla_step_prepare(ctx, &d, w->cache, &in, ws, wsb);
    mla_status s2 = mla_step_attention(ctx, &d, w->cache, 0, &a, ws, wsb);
    BC_CK(cudaStreamEndCapture(s, &graph));
    if (s1 == MLA_OK && s2 == MLA_OK && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
      for (int r = -2; r < o->runs; r++) {
        BC_CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, s));
        BC_CK(cudaEventRecord(e0, s));
        BC_CK(cudaGraphLaunch(exec, s));
        BC_CK(cudaEventRecord(e1, s));
        BC_CK(cudaEventSynchronize(e1));
        float ms = 0;
        BC_CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) tp[r] = ms;
      }
      qsort(tp, (size_t)o->runs, sizeof(float), cmp_f);
      res->graph_us = 1e3 * tp[o->runs / 2];
      cudaGraphExecDestroy(exec);
    }
    if (graph) cudaGraphDestroy(graph);
  }
  if (rc == 0 && (st = mla_ctx_synchronize(ctx)) != MLA_OK) {
    snprintf(res->note, sizeof res->note, "%s", mla_ctx_last_error(ctx));
    rc = -1;
  }
  if (rc == 0) {
    res->us = 1e3 * t[o->runs / 2];
    size_t rb = 0;
    mla_kv_cache_row_bytes(w->cache, &rb);
    const double flops = 2.0 * sq * H * kv_sum * 1088.0;
    const double bytes = kv_sum * rb + (double)Tq * H * 2 * (MLA_ROW + MLA_LATENT);
    res->tflops = flops / (res->us * 1e-6) / 1e12;
    res->gbs = bytes / (res->us * 1e-6) / 1e9;
  }
  mla_ctx_set_stream(ctx, NULL);
  cudaStreamDestroy(s);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(ids);
  cudaFree(seq);
  cudaFree(ws);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(qn);
  cudaFree(qr);
  free(t);
  free(tp);
  free(th);
  return 0;
}

/* Device-to-device copy rate (bytes read + written per second), best of 5. */
static double copy_rate(void *a, void *b, size_t bytes) {
  cudaEvent_t e0, e1;
  double best = 0;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) return 0;
  for (int r = 0; r < 6; r++) {
    cudaEventRecord(e0, NULL);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, NULL);
    cudaEventRecord(e1, NULL);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
    if (r > 0 && gbs > best) best = gbs;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}

/* The median time (µs) of `runs` calls of call(arg) on the default stream:
 * CUDA events around each call, the L2 flushed (a 256 MiB memset) before
 * each, two warm-ups first. *st gets the library's status (timing stops at
 * the first failure). Returns 1 on a CUDA error (printed), else 0. */
typedef mla_status (*bc_call)(void *arg);
static int median_us(bc_call call, void *arg, int runs, void *flush, size_t flush_bytes, mla_status *st,
                     double *us) {
  cudaEvent_t e0, e1;
  BC_CK(cudaEventCreate(&e0));
  BC_CK(cudaEventCreate(&e1));
  float *t = malloc(sizeof(float) * (size_t)runs);
  *st = MLA_OK;
  for (int r = -2; r < runs && *st == MLA_OK; r++) {
    BC_CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, NULL));
    BC_CK(cudaEventRecord(e0, NULL));
    *st = call(arg);
    BC_CK(cudaEventRecord(e1, NULL));
    BC_CK(cudaEventSynchronize(e1));
    float ms = 0;
    BC_CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 0) t[r] = ms;
  }
  if (*st == MLA_OK) {
    qsort(t, (size_t)runs, sizeof(float), cmp_f);
    *us = 1e3 * t[runs / 2];
  }
  free(t);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0;
}

/* The calls median_us times, with their arguments. */
typedef struct bc_args {
  mla_ctx *ctx;
  mla_kv_cache *cache;
  const mla_plan *plan;
  const void *args; /* mla_ragged_args or mla_absorbed_args */
  void *ws;
  size_t ws_bytes;
  int n;                        /* KV write: rows */
  const int32_t *slots;         /* [n] device */
  const void *c, *r;            /* [n, 512], [n, 64] bf16 device */
} bc_args;
static mla_status call_ragged(void *p) {
  const bc_args *a = p;
  return mla_attention_ragged(a->ctx, a->args);
}
static mla_status call_absorbed(void *p) {
  const bc_args *a = p;
  return mla_attention_absorbed(a->ctx, a->cache, 0, a->plan, a->args, a->ws, a->ws_bytes);
}
static mla_status call_kv_write(void *p) {
  const bc_args *a = p;
  return mla_kv_cache_write(a->cache, 0, a->n, a->slots, a->c, a->r, MLA_DTYPE_BF16);
}

/* Causal ragged MHA prefill (192/128, H = 128, bf16) through
 * mla_attention_ragged: one sequence of n tokens or `seqs` of them; TFLOP/s
 * with causal FLOPs counted once: sum over sequences of 2 H (192 + 128) n (n + 1) / 2. */
static int run_prefill(mla_ctx *ctx, int seqs, int n, int runs, void *flush, size_t flush_bytes, uint64_t *seed,
                       double *us, double *tflops, char *note, size_t note_n) {
  const int H = 128, dqk = 192, dv = 128;
  const int64_t T = (int64_t)seqs * n;
  int32_t *ind = malloc(sizeof(int32_t) * (size_t)(seqs + 1));
  for (int i = 0; i <= seqs; i++) ind[i] = i * n;
  int32_t *d_ind = NULL;
  float *lse = NULL;
  void *q = rand_bf16(seed, (size_t)T * H * dqk), *k = rand_bf16(seed, (size_t)T * H * dqk);
  void *v = rand_bf16(seed, (size_t)T * H * dv), *out = NULL;
  BC_CK(cudaMalloc((void **)&d_ind, sizeof(int32_t) * (size_t)(seqs + 1)));
  BC_CK(cudaMemcpy(d_ind, ind, sizeof(int32_t) * (size_t)(seqs + 1), cudaMemcpyHostToDevice));
  BC_CK(cudaMalloc(&out, 2 * (size_t)T * H * dv));
  BC_CK(cudaMalloc((void **)&lse, sizeof(float) * (size_t)T * H));
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = seqs;
  a.num_heads = a.num_kv_heads = H;
  a.qk_dim = dqk;
  a.v_dim = dv;
  a.scale = 0.0721687836f;
  a.causal = 1;
  a.act_dtype = MLA_DTYPE_BF16;
  a.qo_indptr = a.kv_indptr = d_ind;
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = lse;
  /* the optional workspace, as an engine would pass it (the dynamic item
   * order; MLA_PREFILL_ORDER=snake times the static one) */
  size_t ws_bytes = 0;
  void *ws = NULL;
  if (mla_attention_ragged_workspace_size(ctx, &ws_bytes) == MLA_OK && ws_bytes)
    BC_CK(cudaMalloc(&ws, ws_bytes));
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  bc_args ca = {.ctx = ctx, .args = &a};
  mla_status st = MLA_OK;
  if (median_us(call_ragged, &ca, runs, flush, flush_bytes, &st, us)) return 1;
  if (st == MLA_OK) st = mla_ctx_synchronize(ctx);
  if (st != MLA_OK) {
    snprintf(note, note_n, "%s", mla_ctx_last_error(ctx));
  } else {
    const double flops = 2.0 * H * (dqk + dv) * (double)seqs * n * (n + 1) / 2.0;
    *tflops = flops / (*us * 1e-6) / 1e12;
  }
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(d_ind);
  cudaFree(ws);
  free(ind);
  return 0;
}

/* Paged absorbed prefill (EXTEND over a cached prefix, the absorbed impl)
 * through a host plan and mla_attention_absorbed: b requests of `prefix`
 * cached keys plus `ext` new tokens each, page 64, bf16, pages of the
 * requests interleaved. TFLOP/s with causal FLOPs counted once: token t of
 * a request sees prefix + t + 1 keys, 2 H (576 + 512) FLOPs per key. The
 * time includes the plan upload mla_attention_absorbed does per call. */
static int run_paged_prefill(mla_ctx *ctx, int b, int prefix, int ext, int H, int runs, void *flush,
                             size_t flush_bytes, uint64_t *seed, double *us, double *tflops, char *note,
                             size_t note_n) {
  const int P = 64, K = prefix + ext, per = (K + P - 1) / P;
  const int64_t T = (int64_t)b * ext;
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  mla_kv_cache_desc cd = {1, b * per + 2, P, MLA_DTYPE_BF16, NULL};
  mla_req_table_desc rd = {b, K, b * per + 2, P};
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)b), *seq = malloc(sizeof(int32_t) * (size_t)b);
  int32_t *pre = malloc(sizeof(int32_t) * (size_t)b);
  void *pws = NULL, *ws = NULL, *qn = NULL, *qr = NULL, *out = NULL;
  float *lse = NULL;
  mla_status st = mla_kv_cache_create(ctx, &cd, &cache);
  if (st == MLA_OK) st = mla_req_table_create(ctx, &rd, cache, &rt);
  for (int i = 0; i < b && st == MLA_OK; i++) {
    st = mla_req_add(rt, &ids[i]);
    seq[i] = K;
    pre[i] = prefix;
  }
  for (int j = 0; j < per && st == MLA_OK; j++) /* a page per request in turn */
    for (int i = 0; i < b && st == MLA_OK; i++) st = mla_req_extend(rt, ids[i], K - j * P < P ? K - j * P : P, NULL);
  /* every slot of the cache: one random chunk of rows written over and over */
  if (st == MLA_OK) {
    enum { CH = 16384 };
    void *c = rand_bf16(seed, (size_t)CH * MLA_LATENT), *r = rand_bf16(seed, (size_t)CH * MLA_ROPE);
    int32_t *sh = malloc(sizeof(int32_t) * CH), *sd = NULL;
    BC_CK(cudaMalloc((void **)&sd, sizeof(int32_t) * CH));
    const int64_t total = (int64_t)cd.num_pages * P;
    for (int64_t s0 = 0; s0 < total && st == MLA_OK; s0 += CH) {
      const int n = total - s0 < CH ? (int)(total - s0) : CH;
      for (int i = 0; i < n; i++) sh[i] = (int32_t)(s0 + i);
      BC_CK(cudaMemcpy(sd, sh, sizeof(int32_t) * n, cudaMemcpyHostToDevice));
      st = mla_kv_cache_write(cache, 0, n, sd, c, r, MLA_DTYPE_BF16);
    }
    cudaFree(c);
    cudaFree(r);
    cudaFree(sd);
    free(sh);
  }
  mla_plan plan;
  mla_batch bt;
  memset(&bt, 0, sizeof bt);
  bt.mode = MLA_MODE_EXTEND;
  bt.batch_size = b;
  bt.req_ids = ids;
  bt.seq_lens = seq;
  bt.prefix_lens = pre;
  int sms = 0;
  BC_CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  mla_plan_limits lim = {b, (int)T, b * K, K, P, sms, MLA_PLAN_PAGES_ONLY};
  size_t pb = 0, wb = 0;
  if (st == MLA_OK) st = mla_plan_workspace_size(ctx, &lim, &pb);
  if (st == MLA_OK && !(pws = malloc(pb))) st = MLA_ERR_OUT_OF_MEMORY;
  if (st == MLA_OK) st = mla_plan_build(ctx, rt, &bt, &lim, H, pws, pb, &plan);
  if (st == MLA_OK) st = mla_attention_absorbed_workspace_size(ctx, &plan, H, &wb);
  if (st == MLA_OK) {
    qn = rand_bf16(seed, (size_t)T * H * MLA_LATENT);
    qr = rand_bf16(seed, (size_t)T * H * MLA_ROPE);
    BC_CK(cudaMalloc(&ws, wb ? wb : 16));
    BC_CK(cudaMalloc(&out, 2 * (size_t)T * H * MLA_LATENT));
    BC_CK(cudaMalloc((void **)&lse, sizeof(float) * (size_t)T * H));
  }
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = 0.0721687836f;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  bc_args ca = {.ctx = ctx, .cache = cache, .plan = &plan, .args = &a, .ws = ws, .ws_bytes = wb};
  if (st == MLA_OK && median_us(call_absorbed, &ca, runs, flush, flush_bytes, &st, us)) return 1;
  if (st == MLA_OK) st = mla_ctx_synchronize(ctx);
  if (st != MLA_OK) {
    snprintf(note, note_n, "%s", mla_ctx_last_error(ctx));
  } else {
    const double keys = (double)ext * prefix + (double)ext * (ext + 1) / 2.0;
    *tflops = 2.0 * H * (MLA_LATENT + MLA_ROPE + MLA_LATENT) * keys * b / (*us * 1e-6) / 1e12;
    snprintf(note, note_n, "parts %d, splits %d, workspace %.1f MiB", (int)plan.num_sm_parts, (int)plan.total_splits,
             wb / 1048576.0);
  }
  cudaFree(qn);
  cudaFree(qr);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(ws);
  free(pws);
  free(ids);
  free(seq);
  free(pre);
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
  return st == MLA_OK ? 0 : 1;
}

/* KV write (mla_kv_cache_write): n latent rows of bf16 activations into a
 * cache of `dt` at shuffled slots (whole pages of 64 in a random order), the
 * quantize-on-write included. GB/s = (source rows read + cache rows written
 * + slot ids read) / t: what the copy rate (read + write) bounds. */
static int run_kv_write(mla_ctx *ctx, mla_dtype dt, int n, int runs, void *flush, size_t flush_bytes,
                        uint64_t *seed, double *us, double *gbs, char *note, size_t note_n) {
  const int P = 64, pages = n / P + 2;
  mla_kv_cache *cache = NULL;
  mla_kv_cache_desc cd = {1, pages, P, dt, NULL};
  mla_status st = mla_kv_cache_create(ctx, &cd, &cache);
  if (st != MLA_OK) {
    snprintf(note, note_n, "%s", mla_ctx_last_error(ctx));
    return 1;
  }
  size_t rb = 0;
  mla_kv_cache_row_bytes(cache, &rb);
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)pages), *slots = malloc(sizeof(int32_t) * (size_t)n);
  for (int i = 0; i < pages - 1; i++) perm[i] = i + 1;
  for (int i = pages - 2; i > 0; i--) {
    int j = (int)(bc_rng(seed) % (uint64_t)(i + 1));
    int32_t x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
  for (int i = 0; i < n; i++) slots[i] = perm[i / P] * P + i % P;
  int32_t *ds = NULL;
  BC_CK(cudaMalloc((void **)&ds, sizeof(int32_t) * (size_t)n));
  BC_CK(cudaMemcpy(ds, slots, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice));
  void *c = rand_bf16(seed, (size_t)n * MLA_LATENT), *r = rand_bf16(seed, (size_t)n * MLA_ROPE);
  bc_args ca = {.cache = cache, .n = n, .slots = ds, .c = c, .r = r};
  if (median_us(call_kv_write, &ca, runs, flush, flush_bytes, &st, us)) return 1;
  if (st == MLA_OK) st = mla_ctx_synchronize(ctx);
  if (st != MLA_OK) {
    snprintf(note, note_n, "%s", mla_kv_cache_last_error(cache));
  } else {
    *gbs = ((double)n * (2 * (MLA_LATENT + MLA_ROPE) + rb + 4)) / (*us * 1e-6) / 1e9;
  }
  cudaFree(ds);
  cudaFree(c);
  cudaFree(r);
  free(perm);
  free(slots);
  mla_kv_cache_destroy(cache);
  return st == MLA_OK ? 0 : 1;
}

static int bc_usage(FILE *f) {
  fprintf(f,
          "usage: mla bench --device cuda [options]\n"
          "  --b N          requests (default 128)\n"
          "  --sk LIST      kv lengths, comma-separated (default 4096,8192,16384)\n"
          "  --h LIST       query heads (default 16,128)\n"
          "  --sq LIST      queries per request, 1 = DECODE, more = TARGET_VERIFY (default 1,2)\n"
          "  --dtype LIST   cache dtypes: bf16, f16, fp8, fp8-block, and fp8-math (the fp8 cache with\n"
          "                 MLA_FLAG_FP8_MATH, where s_q * H > 32) (default bf16,fp8,fp8-math)\n"
          "  --page-size P  (default 64)\n"
          "  --kv-spread S  decode rows: each request's kv length uniform in s_k (1 +- S / 100), at least 64,\n"
          "                 the same lengths in every run (seeded by s_k and S); s_k is then the mean, and\n"
          "                 TFLOP/s and GB/s count the lengths drawn (default 0: all s_k)\n"
          "  --runs N       timed runs per case (default 30, quick 5)\n"
          "  --quick        s_k 8192 only, few runs\n"
          "  --no-prefill   skip the prefill cases (ragged MHA 1 x 8K, 1 x 16K, 16 x 1K, 192/128; paged absorbed\n"
          "                 prefill 16 x (4K + 512), 1 x (16K + 1K), 4 x (8K + 256)); H=128\n"
          "  --no-kv-write  skip the KV write cases (8K and 128K rows into bf16 / fp8 / fp8-block caches)\n"
          "  --csv          comma-separated output\n");
  return f == stderr ? 2 : 0;
}

static int parse_list(const char *v, int *out, int max, int lo, int hi) {
  int n = 0;
  char buf[256];
  if (!v || strlen(v) >= sizeof buf) return 0;
  strcpy(buf, v);
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
    char *end = NULL;
    errno = 0;
    long x = strtol(tok, &end, 10);
    if (errno || *end || x < lo || x > hi || n >= max) return 0;
    out[n++] = (int)x;
  }
  return n;
}

static const char *dt_name(mla_dtype t) {
  return t == MLA_DTYPE_BF16 ? "bf16" : t == MLA_DTYPE_F16 ? "f16" : t == MLA_DTYPE_FP8_E4M3 ? "fp8" : "fp8-block";
}

int bench_cuda_main(int argc, char **argv) {
  bc_opts o;
  memset(&o, 0, sizeof o);
  o.b = 128;
  o.P = 64;
  int sk_set = 0;
  o.nsk = parse_list("4096,8192,16384", o.sk, 8, 1, 1 << 20);
  o.nh = parse_list("16,128", o.H, 4, 1, MLA_MAX_HEADS);
  o.nsq = parse_list("1,2", o.sq, 4, 1, 64);
  o.dt[0] = MLA_DTYPE_BF16;
  o.dt[1] = MLA_DTYPE_FP8_E4M3;
  o.dt_plain[0] = o.dt_plain[1] = 1;
  o.ndt = 2;
  o.fp8_math = 1;
  for (int i = 0; i < argc; i++) {
    const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int x[8];
    if (!strcmp(k, "--device")) {
      i++;
    } else if (!strcmp(k, "--quick")) {
      o.quick = 1;
    } else if (!strcmp(k, "--no-prefill")) {
      o.no_prefill = 1;
    } else if (!strcmp(k, "--no-kv-write")) {
      o.no_kv_write = 1;
    } else if (!strcmp(k, "--csv")) {
      o.csv = 1;
    } else if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
      return bc_usage(stdout);
    } else if (!strcmp(k, "--b") && parse_list(v, x, 1, 1, 8192) == 1) {
      o.b = x[0];
      i++;
    } else if (!strcmp(k, "--runs") && parse_list(v, x, 1, 1, 1000) == 1) {
      o.runs = x[0];
      i++;
    } else if (!strcmp(k, "--page-size") && parse_list(v, x, 1, 1, 256) == 1) {
      o.P = x[0];
      i++;
    } else if (!strcmp(k, "--kv-spread") && parse_list(v, x, 1, 0, 100) == 1) {
      o.spread = x[0];
      i++;
    } else if (!strcmp(k, "--sk") && (o.nsk = parse_list(v, o.sk, 8, 1, 1 << 20)) > 0) {
      sk_set = 1;
      i++;
    } else if (!strcmp(k, "--h") && (o.nh = parse_list(v, o.H, 4, 1, MLA_MAX_HEADS)) > 0) {
      i++;
    } else if (!strcmp(k, "--sq") && (o.nsq = parse_list(v, o.sq, 4, 1, 64)) > 0) {
      i++;
    } else if (!strcmp(k, "--dtype") && v) {
      char buf[128];
      snprintf(buf, sizeof buf, "%s", v);
      o.ndt = 0;
      o.fp8_math = 0;
      for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        mla_dtype t;
        const int math = !strcmp(tok, "fp8-math");
        if (!strcmp(tok, "bf16")) t = MLA_DTYPE_BF16;
        else if (!strcmp(tok, "f16")) t = MLA_DTYPE_F16;
        else if (!strcmp(tok, "fp8") || math) t = MLA_DTYPE_FP8_E4M3;
        else if (!strcmp(tok, "fp8-block")) t = MLA_DTYPE_FP8_E4M3_BLOCK;
        else return bc_usage(stderr);
        /* one cache per dtype: fp8-math shares fp8's (its rows follow fp8's) */
        int k = 0;
        while (k < o.ndt && o.dt[k] != t) k++;
        if (k == o.ndt) {
          if (o.ndt == 4) return bc_usage(stderr);
          o.dt[o.ndt] = t;
          o.dt_plain[o.ndt++] = 0;
        }
        if (math) o.fp8_math = 1;
        else o.dt_plain[k] = 1;
      }
      i++;
    } else {
      fprintf(stderr, "mla bench: invalid option or value '%s'\n\n", k);
      return bc_usage(stderr);
    }
  }
  if (o.quick && !sk_set) o.nsk = parse_list("8192", o.sk, 8, 1, 1 << 20);
  if (!o.runs) o.runs = o.quick ? 5 : 30;

  mla_ctx *ctx = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CUDA, 0, 0};
  mla_status st = mla_ctx_create(&cd, &ctx);
  if (st != MLA_OK) {
    fprintf(stderr, "mla bench: no CUDA device: %s\n", mla_status_string(st));
    return 2;
  }
  struct cudaDeviceProp prop;
  int dev = 0;
  BC_CK(cudaGetDevice(&dev));
  BC_CK(cudaGetDeviceProperties(&prop, dev));
  const size_t flush_bytes = (size_t)256 << 20;
  void *flush = NULL, *flush2 = NULL;
  BC_CK(cudaMalloc(&flush, flush_bytes));
  BC_CK(cudaMalloc(&flush2, flush_bytes));
  const double copy = copy_rate(flush, flush2, flush_bytes);
  cudaFree(flush2);
  printf("# mla bench --device cuda: %s, %d SMs; device copy %.0f GB/s (read + write, 256 MiB); "
         "median of %d runs, L2 flushed; page %d\n",
         prop.name, prop.multiProcessorCount, copy, o.runs, o.P);
  if (o.spread)
    printf("# kv lengths: uniform in s_k (1 +- %d %%) per request, at least 64 (seeded; s_k below is the mean)\n",
           o.spread);
  if (o.csv)
    printf("b,H,s_q,s_k,dtype,t_us,tflops,gbs,prepare_us,graph_step_us,host_us,note\n");
  else
    printf("%5s %4s %4s %6s %-9s %10s %9s %8s %11s %10s %8s  %s\n", "b", "H", "s_q", "s_k", "dtype", "t_us", "TFLOP/s",
           "GB/s", "prepare_us", "graph_us", "host_us", "note");
  uint64_t seed = 20261130;
  int rc = 0;
  for (int di = 0; di < o.ndt; di++)
    for (int si = 0; si < o.nsk; si++) {
      bc_world w;
      char why[256] = "";
      if (world_make(ctx, &o, o.sk[si], o.dt[di], &seed, &w, why, sizeof why) != 0) {
        printf("%5d %4s %4s %6d %-9s %s\n", o.b, "-", "-", o.sk[si],
               o.dt_plain[di] ? dt_name(o.dt[di]) : "fp8-math", why);
        world_free(&w);
        continue;
      }
      /* per H: the dtype's rows, then (fp8) the same calls with MLA_FLAG_FP8_MATH */
      for (int hi = 0; hi < o.nh; hi++)
        for (int pass = 0; pass < 2; pass++) {
          const int math = pass == 1;
          if (math ? !(o.fp8_math && o.dt[di] == MLA_DTYPE_FP8_E4M3) : !o.dt_plain[di]) continue;
          const char *name = math ? "fp8-math" : dt_name(o.dt[di]);
          for (int qi = 0; qi < o.nsq; qi++) {
            if (math && o.sq[qi] * o.H[hi] <= 32) continue; /* mla.h, MLA_FLAG_FP8_MATH: a no-op there */
            bc_result r;
            if (run_case(ctx, &o, &w, o.H[hi], o.sq[qi], math ? MLA_FLAG_FP8_MATH : 0u, flush,
                         flush_bytes, &seed, &r) != 0)
              rc = 1;
            if (o.csv)
              printf("%d,%d,%d,%d,%s,%.2f,%.1f,%.0f,%.2f,%.2f,%.2f,\"%s\"\n", o.b, o.H[hi], o.sq[qi], o.sk[si],
                     name, r.us, r.tflops, r.gbs, r.prep_us, r.graph_us, r.host_us, r.note);
            else if (r.note[0])
              printf("%5d %4d %4d %6d %-9s %10s %9s %8s %11s %10s %8s  %s\n", o.b, o.H[hi], o.sq[qi], o.sk[si], name,
                     "-", "-", "-", "-", "-", "-", r.note);
            else
              printf("%5d %4d %4d %6d %-9s %10.1f %9.1f %8.0f %11.1f %10.1f %8.1f\n", o.b, o.H[hi], o.sq[qi],
                     o.sk[si], name, r.us, r.tflops, r.gbs, r.prep_us, r.graph_us, r.host_us);
            fflush(stdout);
          }
        }
      world_free(&w);
    }
  if (!o.no_kv_write) {
    /* KV write with quantize-on-write, against the copy rate measured above. */
    printf("# KV write (mla_kv_cache_write, bf16 rows in, shuffled pages of 64), median of %d runs, L2 flushed; "
           "copy %.0f GB/s\n",
           o.runs, copy);
    printf("%8s %-9s %10s %8s %8s  %s\n", "rows", "cache", "t_us", "GB/s", "%copy", "note");
    static const mla_dtype wdt[3] = {MLA_DTYPE_BF16, MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK};
    static const int wn[2] = {8192, 131072};
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 2; j++) {
        double us = 0, gb = 0;
        char note[200] = "";
        if (run_kv_write(ctx, wdt[i], wn[j], o.runs, flush, flush_bytes, &seed, &us, &gb, note, sizeof note)) {
          rc = 1;
          printf("%8d %-9s %10s %8s %8s  %s\n", wn[j], dt_name(wdt[i]), "-", "-", "-", note);
        } else {
          printf("%8d %-9s %10.1f %8.0f %7.1f%%\n", wn[j], dt_name(wdt[i]), us, gb, 100.0 * gb / copy);
        }
        fflush(stdout);
      }
  }
  if (!o.no_prefill) {
    /* The prefill shapes of the CUDA prefill issue: causal ragged MHA. */
    static const int shapes[3][2] = {{1, 8192}, {1, 16384}, {16, 1024}};
    const char *ord = getenv("MLA_PREFILL_ORDER");
    printf("# causal ragged MHA prefill, 192/128, H=128, bf16 (mla_attention_ragged, with its workspace: item "
           "order %s), median of %d runs, L2 flushed\n",
           ord && (!strcmp(ord, "snake") || !strcmp(ord, "rr")) ? ord : "dynamic", o.runs);
    printf("%6s %6s %10s %9s  %s\n", "seqs", "len", "t_us", "TFLOP/s", "note");
    for (int i = 0; i < 3; i++) {
      double us = 0, tf = 0;
      char note[200] = "";
      if (run_prefill(ctx, shapes[i][0], shapes[i][1], o.runs, flush, flush_bytes, &seed, &us, &tf, note,
                      sizeof note) != 0)
        rc = 1;
      if (note[0])
        printf("%6d %6d %10s %9s  %s\n", shapes[i][0], shapes[i][1], "-", "-", note);
      else
        printf("%6d %6d %10.1f %9.1f\n", shapes[i][0], shapes[i][1], us, tf);
      fflush(stdout);
    }
    /* The paged absorbed prefill shape of the same issue. */
    printf("# paged absorbed prefill (EXTEND over a cached prefix, mla_attention_absorbed), H=128, bf16 cache, "
           "page 64, median of %d runs, L2 flushed\n",
           o.runs);
    printf("%6s %6s %6s %10s %9s  %s\n", "b", "prefix", "extend", "t_us", "TFLOP/s", "note");
    static const int pshapes[][3] = {{16, 4096, 512}, {1, 16384, 1024}, {4, 8192, 256}};
    for (int i = 0; i < 3; i++) {
      double us = 0, tf = 0;
      char note[200] = "";
      const int failed = run_paged_prefill(ctx, pshapes[i][0], pshapes[i][1], pshapes[i][2], 128, o.runs, flush,
                                           flush_bytes, &seed, &us, &tf, note, sizeof note);
      rc |= failed;
      if (failed)
        printf("%6d %6d %6d %10s %9s  %s\n", pshapes[i][0], pshapes[i][1], pshapes[i][2], "-", "-", note);
      else
        printf("%6d %6d %6d %10.1f %9.1f  %s\n", pshapes[i][0], pshapes[i][1], pshapes[i][2], us, tf, note);
      fflush(stdout);
    }
  }
  cudaFree(flush);
  mla_ctx_destroy(ctx);
  return rc;
}
#endif
