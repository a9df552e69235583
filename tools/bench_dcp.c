/* `mla bench --dcp N`: decode context parallel on N GPUs against one GPU,
 * through the public API (bench_dcp.h).
 *
 * One GPU: a plain DECODE step (mla_step_prepare once, mla_step_attention
 * timed) over b requests of s_k keys, H heads, bf16, page P. N GPUs: the same
 * batch with each request's keys sharded (position p on rank p mod N, written
 * by mla_kv_cache_write_shard; req_to_token page P * N so every rank reads
 * pages of P rows, the kernel shape of the one-GPU run), one host thread and
 * one NCCL communicator per rank, each rank timing its DCP step's attention
 * plus mla_dcp_merge_nccl with CUDA events on its own stream. The ranks start
 * each run together (a host barrier); a run's time is the slowest rank's
 * (the merge's all-gather waits for it anyway), and the median over runs is
 * reported, as is the one-GPU median, and their ratio. Rows hold the same
 * values for the same (request, position) in both layouts, so rank 0's merged
 * output is compared with the one-GPU output (max |difference|).
 *
 * The KV (b s_k 1152 bytes, 4.8 GB for the default shape) is far larger than
 * L2, so no flush between runs. Compiled to a stub without CUDA or NCCL. */
#include "bench_dcp.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"

#if !defined(MLA_CLI_CUDA) || !defined(MLA_HAVE_NCCL)
int bench_dcp_main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "mla bench: --dcp: this build has no %s\n",
#ifndef MLA_CLI_CUDA
          "CUDA"
#else
          "NCCL (configure with MLA_NCCL_ROOT)"
#endif
  );
  return 2;
}
#else
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>

#define BD_MAX_RANKS 8
#define BD_MAX_RUNS 1000

typedef struct bd_opts {
  int world, b, sk, H, P, runs;
  unsigned long long seed;
} bd_opts;

static uint64_t bd_rng(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int cmp_f(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

static float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof(float), cmp_f);
  return v[n / 2];
}

static float bf16_to_f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Host data both layouts share: the queries and one chunk of random rows
 * (row of flattened position f = request * s_k + position is f mod CH). */
enum { CH = 65536 };
typedef struct bd_data {
  uint16_t *qn, *qr; /* bf16 [b, H, 512], [b, H, 64] */
  uint16_t *c, *r;   /* bf16 [CH, 512], [CH, 64] */
} bd_data;

static void fill_bf16(uint64_t *seed, uint16_t *dst, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const float f = (float)((double)(bd_rng(seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    mla_convert(&f, MLA_DTYPE_F32, &dst[i], MLA_DTYPE_BF16, 1);
  }
}

/* req_to_token [b, s_k] with page size pg over shuffled pages 1..: pages
 * returned in *num_pages. */
static int32_t *make_r2t(const bd_opts *o, int pg, uint64_t *seed, int *num_pages) {
  const int per = (o->sk + pg - 1) / pg;
  const int pages = o->b * per + 1;
  int32_t *perm = malloc(sizeof(int32_t) * (size_t)pages);
  int32_t *r2t = malloc(sizeof(int32_t) * (size_t)o->b * o->sk);
  if (!perm || !r2t) {
    free(perm);
    free(r2t);
    return NULL;
  }
  for (int i = 0; i < pages - 1; i++) perm[i] = i + 1;
  for (int i = pages - 2; i > 0; i--) {
    const int j = (int)(bd_rng(seed) % (uint64_t)(i + 1));
    const int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int r = 0; r < o->b; r++)
    for (int j = 0; j < o->sk; j++) r2t[(size_t)r * o->sk + j] = perm[r * per + j / pg] * pg + j % pg;
  free(perm);
  *num_pages = pages;
  return r2t;
}

/* One device's share of a run: its context, stream, cache and step. */
typedef struct bd_dev {
  mla_ctx *ctx;
  cudaStream_t s;
  mla_kv_cache *cache;
  int32_t *r2t, *ids, *seq;
  void *c, *r, *qn, *qr, *o, *ws, *mo, *mws;
  float *lse, *mlse;
  size_t wsb, mwsb;
  mla_step_desc d;
  char err[320];
} bd_dev;

static int dev_fail(bd_dev *v, const char *what, const char *msg) {
  if (!v->err[0]) snprintf(v->err, sizeof v->err, "%s: %s", what, msg);
  return 1;
}
#define BD_CUDA(v, x)                                                          \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) return dev_fail((v), #x, cudaGetErrorString(e_));   \
  } while (0)
#define BD_MLA(v, x)                                                           \
  do {                                                                         \
    mla_status s_ = (x);                                                       \
    if (s_ != MLA_OK) return dev_fail((v), #x, mla_ctx_last_error((v)->ctx));  \
  } while (0)

/* Build a device's cache (world > 1: this rank's shard of page-(P*world)
 * global slots) and step. The context is created on `device`. */
static int dev_setup(bd_dev *v, const bd_opts *o, const bd_data *hd, const int32_t *r2t_h, int num_pages, int device,
                     int world, int rank) {
  memset(v, 0, sizeof *v);
  mla_ctx_desc cd = {MLA_DEVICE_CUDA, 0, device};
  if (mla_ctx_create(&cd, &v->ctx) != MLA_OK) return dev_fail(v, "mla_ctx_create", "no CUDA context");
  BD_CUDA(v, cudaStreamCreateWithFlags(&v->s, cudaStreamNonBlocking));
  BD_MLA(v, mla_ctx_set_stream(v->ctx, v->s));
  const size_t nflat = (size_t)o->b * o->sk, nq = (size_t)o->b * o->H;
  mla_kv_cache_desc kd = {1, num_pages, o->P, MLA_DTYPE_BF16, NULL};
  BD_MLA(v, mla_kv_cache_create(v->ctx, &kd, &v->cache));
  BD_CUDA(v, cudaMalloc((void **)&v->r2t, sizeof(int32_t) * nflat));
  BD_CUDA(v, cudaMemcpy(v->r2t, r2t_h, sizeof(int32_t) * nflat, cudaMemcpyHostToDevice));
  BD_CUDA(v, cudaMalloc(&v->c, 2 * (size_t)CH * MLA_LATENT));
  BD_CUDA(v, cudaMalloc(&v->r, 2 * (size_t)CH * MLA_ROPE));
  BD_CUDA(v, cudaMemcpy(v->c, hd->c, 2 * (size_t)CH * MLA_LATENT, cudaMemcpyHostToDevice));
  BD_CUDA(v, cudaMemcpy(v->r, hd->r, 2 * (size_t)CH * MLA_ROPE, cudaMemcpyHostToDevice));
  /* the rows in request order: req_to_token flattened is the slot list */
  for (size_t f0 = 0; f0 < nflat; f0 += CH) {
    const int n = nflat - f0 < CH ? (int)(nflat - f0) : CH;
    if (world > 1)
      BD_MLA(v, mla_kv_cache_write_shard(v->cache, 0, n, v->r2t + f0, v->c, v->r, MLA_DTYPE_BF16, world, rank));
    else
      BD_MLA(v, mla_kv_cache_write(v->cache, 0, n, v->r2t + f0, v->c, v->r, MLA_DTYPE_BF16));
  }
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)o->b), *seq = malloc(sizeof(int32_t) * (size_t)o->b);
  if (!ids || !seq) {
    free(ids);
    free(seq);
    return dev_fail(v, "malloc", "out of host memory");
  }
  for (int i = 0; i < o->b; i++) {
    ids[i] = i;
    seq[i] = o->sk;
  }
  BD_CUDA(v, cudaMalloc((void **)&v->ids, sizeof(int32_t) * (size_t)o->b));
  BD_CUDA(v, cudaMalloc((void **)&v->seq, sizeof(int32_t) * (size_t)o->b));
  BD_CUDA(v, cudaMemcpy(v->ids, ids, sizeof(int32_t) * (size_t)o->b, cudaMemcpyHostToDevice));
  BD_CUDA(v, cudaMemcpy(v->seq, seq, sizeof(int32_t) * (size_t)o->b, cudaMemcpyHostToDevice));
  free(ids);
  free(seq);
  BD_CUDA(v, cudaMalloc(&v->qn, 2 * nq * MLA_LATENT));
  BD_CUDA(v, cudaMalloc(&v->qr, 2 * nq * MLA_ROPE));
  BD_CUDA(v, cudaMemcpy(v->qn, hd->qn, 2 * nq * MLA_LATENT, cudaMemcpyHostToDevice));
  BD_CUDA(v, cudaMemcpy(v->qr, hd->qr, 2 * nq * MLA_ROPE, cudaMemcpyHostToDevice));
  BD_CUDA(v, cudaMalloc(&v->o, 2 * nq * MLA_LATENT));
  BD_CUDA(v, cudaMalloc((void **)&v->lse, sizeof(float) * nq));
  memset(&v->d, 0, sizeof v->d);
  v->d.mode = MLA_MODE_DECODE;
  v->d.batch_size = o->b;
  v->d.max_kv_len = o->sk;
  v->d.num_heads = o->H;
  v->d.page_size = o->P;
  v->d.dcp_world = world > 1 ? world : 0;
  v->d.dcp_rank = world > 1 ? rank : 0;
  BD_MLA(v, mla_step_workspace_size(v->ctx, &v->d, &v->wsb));
  BD_CUDA(v, cudaMalloc(&v->ws, v->wsb));
  mla_step_inputs in;
  memset(&in, 0, sizeof in);
  in.req_to_token = v->r2t;
  in.req_to_token_stride = o->sk;
  in.max_reqs = o->b;
  in.req_ids = v->ids;
  in.seq_lens = v->seq;
  BD_MLA(v, mla_step_prepare(v->ctx, &v->d, v->cache, &in, v->ws, v->wsb));
  if (world > 1) {
    BD_MLA(v, mla_dcp_merge_workspace_size(v->ctx, world, o->b, o->H, MLA_LATENT, MLA_DTYPE_BF16, &v->mwsb));
    BD_CUDA(v, cudaMalloc(&v->mws, v->mwsb));
    BD_CUDA(v, cudaMalloc(&v->mo, 2 * nq * MLA_LATENT));
    BD_CUDA(v, cudaMalloc((void **)&v->mlse, sizeof(float) * nq));
  }
  BD_MLA(v, mla_ctx_synchronize(v->ctx));
  return 0;
}

static int dev_attention(bd_dev *v, const bd_opts *o) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = o->H;
  a.scale = 0.0721687836f;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = v->qn;
  a.q_rope = v->qr;
  a.out = v->o;
  a.lse = v->lse;
  BD_MLA(v, mla_step_attention(v->ctx, &v->d, v->cache, 0, &a, v->ws, v->wsb));
  return 0;
}

static void dev_free(bd_dev *v) {
  void *bufs[] = {v->r2t, v->ids, v->seq, v->c, v->r, v->qn, v->qr, v->o, v->ws, v->mo, v->mws, v->lse, v->mlse};
  for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++)
    if (bufs[k]) cudaFree(bufs[k]);
  mla_kv_cache_destroy(v->cache);
  if (v->ctx) mla_ctx_set_stream(v->ctx, NULL);
  if (v->s) cudaStreamDestroy(v->s);
  mla_ctx_destroy(v->ctx);
  memset(v, 0, sizeof *v);
}

/* ---- the N-rank run --------------------------------------------------- */
typedef struct bd_group {
  const bd_opts *o;
  const bd_data *hd;
  const int32_t *r2t; /* global req_to_token, page P * world */
  int num_pages;
  ncclUniqueId id;
  pthread_barrier_t bar;
  int ok[BD_MAX_RANKS];
  float att[BD_MAX_RANKS][BD_MAX_RUNS], tot[BD_MAX_RANKS][BD_MAX_RUNS];
  uint16_t *out0; /* rank 0's merged output, host bf16 [b, H, 512] */
  char err[BD_MAX_RANKS][320];
} bd_group;

typedef struct bd_rank {
  bd_group *g;
  int rank;
} bd_rank;

/* 1 when every rank is ok (all enter the next collective or none does). */
static int agree(bd_group *g, int rank, int ok) {
  g->ok[rank] = ok;
  pthread_barrier_wait(&g->bar);
  int all = 1;
  for (int r = 0; r < g->o->world; r++) all &= g->ok[r];
  pthread_barrier_wait(&g->bar);
  return all;
}

static int rank_runs(bd_dev *v, bd_group *g, int rank, ncclComm_t comm) {
  const bd_opts *o = g->o;
  cudaEvent_t e0 = NULL, e1 = NULL, e2 = NULL;
  int ok = cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess &&
           cudaEventCreate(&e2) == cudaSuccess;
  if (!ok) dev_fail(v, "cudaEventCreate", "failed");
  /* Every rank passes the same agree() calls; a failure anywhere makes all
   * of them stop at the next one. The second agree keeps a rank whose
   * attention was refused from leaving the others inside the all-gather. */
  for (int it = -3; it < o->runs; it++) {
    if (!agree(g, rank, ok)) break; /* the ranks start each run together */
    ok = cudaEventRecord(e0, v->s) == cudaSuccess && dev_attention(v, o) == 0 &&
         cudaEventRecord(e1, v->s) == cudaSuccess;
    if (!agree(g, rank, ok)) break;
    mla_status st = mla_dcp_merge_nccl(v->ctx, comm, o->world, rank, o->b, o->H, MLA_LATENT, MLA_DTYPE_BF16, v->o,
                                       v->lse, v->mws, v->mwsb, v->mo, v->mlse);
    if (st != MLA_OK) {
      dev_fail(v, "mla_dcp_merge_nccl", mla_ctx_last_error(v->ctx));
      ok = 0;
      continue;
    }
    float a = 0, t = 0;
    ok = cudaEventRecord(e2, v->s) == cudaSuccess && cudaEventSynchronize(e2) == cudaSuccess &&
         cudaEventElapsedTime(&a, e0, e1) == cudaSuccess && cudaEventElapsedTime(&t, e0, e2) == cudaSuccess;
    if (!ok) dev_fail(v, "CUDA events", cudaGetErrorString(cudaGetLastError()));
    if (it >= 0) {
      g->att[rank][it] = 1e3f * a;
      g->tot[rank][it] = 1e3f * t;
    }
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (e2) cudaEventDestroy(e2);
  if (!ok) return 1;
  BD_MLA(v, mla_ctx_synchronize(v->ctx));
  if (rank == 0)
    BD_CUDA(v, cudaMemcpy(g->out0, v->mo, 2 * (size_t)o->b * o->H * MLA_LATENT, cudaMemcpyDeviceToHost));
  return 0;
}

static void *rank_main(void *arg) {
  bd_rank *rk = arg;
  bd_group *g = rk->g;
  bd_dev v;
  memset(&v, 0, sizeof v);
  int ok = cudaSetDevice(rk->rank) == cudaSuccess;
  if (ok) ok = dev_setup(&v, g->o, g->hd, g->r2t, g->num_pages, rk->rank, g->o->world, rk->rank) == 0;
  ncclComm_t comm = NULL;
  /* the init is collective: every rank enters it */
  ncclResult_t r = ncclCommInitRank(&comm, g->o->world, g->id, rk->rank);
  if (r != ncclSuccess) {
    dev_fail(&v, "ncclCommInitRank", ncclGetErrorString(r));
    comm = NULL;
    ok = 0;
  }
  if (agree(g, rk->rank, ok)) rank_runs(&v, g, rk->rank, comm);
  snprintf(g->err[rk->rank], sizeof g->err[rk->rank], "%s", v.err);
  if (comm) ncclCommDestroy(comm);
  dev_free(&v);
  return NULL;
}

static int bd_usage(FILE *f) {
  fprintf(f,
          "usage: mla bench --dcp N [options]\n"
          "  decode context parallel on N GPUs (power of two 2..%d) vs one GPU, bf16, through\n"
          "  mla_step_* + mla_dcp_merge_nccl; prints both medians and the speed-up.\n"
          "  --batch B   requests (default 64)\n"
          "  --seq S     keys per request (default 65536)\n"
          "  --heads H   query heads (default 128)\n"
          "  --page P    cache page size of every GPU (default 64; req_to_token page P*N under DCP)\n"
          "  --runs R    timed runs after 3 warm-ups (default 20, at most %d)\n"
          "  --seed S    data seed (default 1)\n"
          "  --device cuda is implied.\n",
          BD_MAX_RANKS, BD_MAX_RUNS);
  return f == stdout ? 0 : 2;
}

static int parse_long(const char *s, long lo, long hi, long *v) {
  if (!s || !*s) return 0;
  char *end = NULL;
  errno = 0;
  const long x = strtol(s, &end, 10);
  if (errno || *end || x < lo || x > hi) return 0;
  *v = x;
  return 1;
}

int bench_dcp_main(int argc, char **argv) {
  bd_opts o = {2, 64, 65536, 128, 64, 20, 1};
  for (int i = 0; i < argc; i++) {
    const char *k = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    long x = 0;
    if (!strcmp(k, "--help") || !strcmp(k, "-h")) return bd_usage(stdout);
    if (!strcmp(k, "--device")) {
      if (!val || strcmp(val, "cuda")) return bd_usage(stderr);
      i++;
      continue;
    }
    int good = 1;
    if (!strcmp(k, "--dcp")) {
      good = parse_long(val, 2, BD_MAX_RANKS, &x) && !(x & (x - 1));
      o.world = (int)x;
    } else if (!strcmp(k, "--batch")) {
      good = parse_long(val, 1, 4096, &x);
      o.b = (int)x;
    } else if (!strcmp(k, "--seq")) {
      good = parse_long(val, 1, 1 << 20, &x);
      o.sk = (int)x;
    } else if (!strcmp(k, "--heads")) {
      good = parse_long(val, 1, 128, &x);
      o.H = (int)x;
    } else if (!strcmp(k, "--page")) {
      good = parse_long(val, 1, 256, &x) && !(x & (x - 1));
      o.P = (int)x;
    } else if (!strcmp(k, "--runs")) {
      good = parse_long(val, 1, BD_MAX_RUNS, &x);
      o.runs = (int)x;
    } else if (!strcmp(k, "--seed")) {
      good = parse_long(val, 0, 1L << 30, &x);
      o.seed = (unsigned long long)x;
    } else {
      good = 0;
    }
    if (!good) {
      fprintf(stderr, "mla bench: invalid option or value '%s %s'\n", k, val ? val : "");
      return bd_usage(stderr);
    }
    i++;
  }
  if ((long long)o.b * o.sk > (1LL << 31) - CH) {
    fprintf(stderr, "mla bench: --batch x --seq too large\n");
    return 2;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < o.world) {
    fprintf(stderr, "mla bench: --dcp %d needs %d GPUs, %d present\n", o.world, o.world, ndev);
    return 2;
  }
  /* NVLink multicast stays off on shared hosts unless the caller chose. */
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  uint64_t seed = o.seed * 0x2545F4914F6CDD1Dull + 7;
  const size_t nq = (size_t)o.b * o.H;
  bd_data hd;
  hd.qn = malloc(2 * nq * MLA_LATENT);
  hd.qr = malloc(2 * nq * MLA_ROPE);
  hd.c = malloc(2 * (size_t)CH * MLA_LATENT);
  hd.r = malloc(2 * (size_t)CH * MLA_ROPE);
  uint16_t *out1 = malloc(2 * nq * MLA_LATENT), *outn = malloc(2 * nq * MLA_LATENT);
  if (!hd.qn || !hd.qr || !hd.c || !hd.r || !out1 || !outn) {
    fprintf(stderr, "mla bench: out of host memory\n");
    return 1;
  }
  fill_bf16(&seed, hd.qn, nq * MLA_LATENT);
  fill_bf16(&seed, hd.qr, nq * MLA_ROPE);
  fill_bf16(&seed, hd.c, (size_t)CH * MLA_LATENT);
  fill_bf16(&seed, hd.r, (size_t)CH * MLA_ROPE);
  int rc = 0;

  /* one GPU */
  float *t1 = malloc(sizeof(float) * (size_t)o.runs);
  int pages1 = 0;
  int32_t *r2t1 = make_r2t(&o, o.P, &seed, &pages1);
  bd_dev v;
  memset(&v, 0, sizeof v);
  cudaSetDevice(0);
  if (!r2t1 || !t1 || dev_setup(&v, &o, &hd, r2t1, pages1, 0, 1, 0)) {
    fprintf(stderr, "mla bench: one-GPU setup: %s\n", v.err[0] ? v.err : "out of host memory");
    rc = 1;
  }
  cudaEvent_t e0 = NULL, e1 = NULL;
  if (rc == 0 && (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)) rc = 1;
  for (int it = -3; it < o.runs && rc == 0; it++) {
    cudaEventRecord(e0, v.s);
    if (dev_attention(&v, &o)) {
      fprintf(stderr, "mla bench: one GPU: %s\n", v.err);
      rc = 1;
      break;
    }
    cudaEventRecord(e1, v.s);
    float ms = 0;
    if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) rc = 1;
    if (it >= 0) t1[it] = 1e3f * ms;
  }
  if (rc == 0 && mla_ctx_synchronize(v.ctx) != MLA_OK) {
    fprintf(stderr, "mla bench: one GPU: %s\n", mla_ctx_last_error(v.ctx));
    rc = 1;
  }
  if (rc == 0) cudaMemcpy(out1, v.o, 2 * nq * MLA_LATENT, cudaMemcpyDeviceToHost);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  dev_free(&v);
  free(r2t1);
  const float us1 = rc == 0 ? median(t1, o.runs) : 0.0f;

  /* N GPUs, one thread each */
  static bd_group g;
  memset(&g, 0, sizeof g);
  g.o = &o;
  g.hd = &hd;
  g.out0 = outn;
  int32_t *r2tn = rc == 0 ? make_r2t(&o, o.P * o.world, &seed, &g.num_pages) : NULL;
  g.r2t = r2tn;
  if (rc == 0 && !r2tn) rc = 1;
  ncclResult_t nr = ncclSuccess;
  if (rc == 0 && (nr = ncclGetUniqueId(&g.id)) != ncclSuccess) {
    fprintf(stderr, "mla bench: ncclGetUniqueId: %s\n", ncclGetErrorString(nr));
    rc = 1;
  }
  if (rc == 0) {
    pthread_barrier_init(&g.bar, NULL, (unsigned)o.world);
    pthread_t th[BD_MAX_RANKS];
    bd_rank rk[BD_MAX_RANKS];
    for (int r = 0; r < o.world; r++) {
      rk[r].g = &g;
      rk[r].rank = r;
      pthread_create(&th[r], NULL, rank_main, &rk[r]);
    }
    for (int r = 0; r < o.world; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
    for (int r = 0; r < o.world; r++)
      if (g.err[r][0]) {
        fprintf(stderr, "mla bench: rank %d: %s\n", r, g.err[r]);
        rc = 1;
      }
  }
  free(r2tn);
  if (rc == 0) {
    float *step = malloc(sizeof(float) * (size_t)o.runs), *tmp = malloc(sizeof(float) * (size_t)o.runs);
    for (int it = 0; it < o.runs; it++) {
      step[it] = 0;
      for (int r = 0; r < o.world; r++)
        if (g.tot[r][it] > step[it]) step[it] = g.tot[r][it];
    }
    const float usn = median(step, o.runs);
    double dmax = 0;
    for (size_t i = 0; i < nq * MLA_LATENT; i++) {
      const double d = fabs((double)bf16_to_f(outn[i]) - bf16_to_f(out1[i]));
      if (!(d <= dmax)) dmax = d;
    }
    const double flops = 2.0 * o.b * o.H * (double)o.sk * 1088.0;
    int nccl_v = 0;
    ncclGetVersion(&nccl_v);
    printf("DCP decode b=%d s_k=%d H=%d bf16, page %d (DCP: req_to_token page %d, %d GPUs), %d runs, NCCL %d\n", o.b,
           o.sk, o.H, o.P, o.P * o.world, o.world, o.runs, nccl_v);
    printf("  1 GPU : attention %9.1f us  (%.0f TFLOP/s)\n", us1, flops / (us1 * 1e-6) / 1e12);
    printf("  %d GPUs: step      %9.1f us  (slowest rank per run; attention + merge)\n", o.world, usn);
    for (int r = 0; r < o.world; r++) {
      for (int it = 0; it < o.runs; it++) tmp[it] = g.att[r][it];
      const float a = median(tmp, o.runs);
      for (int it = 0; it < o.runs; it++) tmp[it] = g.tot[r][it] - g.att[r][it];
      const float m = median(tmp, o.runs);
      printf("    rank %d: attention %9.1f us, all-gather + merge %7.1f us\n", r, a, m);
    }
    printf("  speed-up %.2fx (1 GPU / %d GPUs)\n", us1 / usn, o.world);
    printf("  max |o(%d GPUs, merged) - o(1 GPU)| = %.3g\n", o.world, dmax);
    printf("BENCH_DCP b=%d sk=%d H=%d P=%d world=%d us_1gpu=%.1f us_dcp=%.1f speedup=%.3f maxdiff=%.3g\n", o.b, o.sk,
           o.H, o.P, o.world, us1, usn, us1 / usn, dmax);
    /* the two outputs are the same attention up to bf16 rounding of the partial states */
    if (!(dmax < 0.05)) {
      fprintf(stderr, "mla bench: the %d-GPU output differs from the one-GPU output by %.3g\n", o.world, dmax);
      rc = 1;
    }
    free(step);
    free(tmp);
  }
  free(t1);
  free(hd.qn);
  free(hd.qr);
  free(hd.c);
  free(hd.r);
  free(out1);
  free(outn);
  return rc;
}
#endif
