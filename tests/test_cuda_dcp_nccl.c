/* Decode context parallel over NCCL (mla_dcp_merge_nccl) on two GPUs, one
 * host thread per rank, as a serving engine drives them.
 *
 * Each rank has its own CUDA context (device_id = rank), its own NCCL
 * communicator (ncclCommInitRank from one ncclGetUniqueId), and a cache that
 * holds only its shard: position p of every request on rank p mod 2, written
 * by mla_kv_cache_write_shard from the same global rows (every other row NaN,
 * page 0 zero). A DCP step (mla_step_prepare / mla_step_attention with
 * dcp_world = 2 over the global req_to_token, local page = global page / 2)
 * gives the rank's partial (o, lse); mla_dcp_merge_nccl all-gathers and
 * merges them. Checked against the float64 oracle (tests/ref) for a varlen
 * batch with requests of 0, 1, 2 and 3 keys (ranks with no key), a
 * ~2100-key request (split KV on each rank) and a padding row, H 16 and 128,
 * global pages 64, 128 and 4; both ranks must hold the same bytes; the plain
 * single-GPU step over the whole cache (rank 0's device) is checked against
 * the oracle too and its distance to the merged result printed. A merge-only
 * case (f32 and f16 states, head_dim 100, rows empty on one or both ranks,
 * in place, lse_out NULL) against ref_merge. Refusals (bad world / rank /
 * communicator / device, NULL and host pointers, overlap, small workspace,
 * cache dtypes; outputs untouched) on every context kind.
 *
 * Tolerance as tests/test_cuda_attention.c, with the rounding of each rank's
 * partial o to bf16 added: |o - ref| <= 8e-4 + 2/128 |ref| + 2^-7 sum_j p_j
 * |c_j|, cosine distance <= 1e-5, lse 2e-5 abs + 2e-5 rel, -inf exactly.
 *
 * Without a GPU: "skipped: no GPU"; one GPU: a one-rank communicator (world
 * 1) only, then "skipped: needs 2 GPUs"; without NCCL in the build: the
 * refusal (UNSUPPORTED) only, "skipped: built without NCCL". The CPU-context
 * refusals run in every build. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "test_util.h"

static tu_rng rng;

/* A CPU context: every call validates, then refuses (UNSUPPORTED). */
static void cpu_refusals(void) {
  mla_ctx *cpu = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  if (!cpu) return;
  size_t b = 0;
  int fake_comm = 0; /* never dereferenced: a CPU context stops before the communicator */
  char buf[64];
  float lbuf[16];
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_UNSUPPORTED);
  TU_CHECK(strstr(mla_ctx_last_error(cpu), "CPU context") != NULL, "message: %s", mla_ctx_last_error(cpu));
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_UNSUPPORTED);
  TU_STATUS(mla_dcp_merge_workspace_size(NULL, 2, 4, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 16, 512, MLA_DTYPE_BF16, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 0, 4, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 129, 4, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, -1, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 0, 512, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 16, 0, MLA_DTYPE_BF16, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 16, 512, (mla_dtype)77, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_workspace_size(cpu, 2, 4, 16, 512, MLA_DTYPE_FP8_E4M3, &b), MLA_ERR_UNSUPPORTED);
  TU_STATUS(mla_dcp_merge_nccl(NULL, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 2, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, -1, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, NULL, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, NULL, lbuf, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, NULL, buf, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, NULL, 64, buf, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_F32, buf, lbuf, buf, 64, NULL, lbuf),
            MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_merge_nccl(cpu, &fake_comm, 2, 0, 1, 1, 8, MLA_DTYPE_FP8_E4M3_BLOCK, buf, lbuf, buf, 64, buf,
                               lbuf),
            MLA_ERR_UNSUPPORTED);
  mla_ctx_destroy(cpu);
}

#if !defined(MLA_TEST_CUDA)
int main(void) {
  rng.s = tu_seed("test_cuda_dcp_nccl", 20261201);
  cpu_refusals();
  printf("test_cuda_dcp_nccl: skipped: built without CUDA\n");
  return tu_finish("test_cuda_dcp_nccl");
}
#elif !defined(MLA_HAVE_NCCL)
#include "cuda_util.h"
int main(void) {
  rng.s = tu_seed("test_cuda_dcp_nccl", 20261201);
  cpu_refusals();
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
    /* A CUDA context of a build without NCCL refuses, saying why. */
    mla_ctx *gpu = NULL;
    mla_ctx_desc gd = {MLA_DEVICE_CUDA, 0, 0};
    TU_STATUS(mla_ctx_create(&gd, &gpu), MLA_OK);
    size_t b = 0;
    if (gpu) {
      TU_STATUS(mla_dcp_merge_workspace_size(gpu, 2, 4, 16, 512, MLA_DTYPE_BF16, &b), MLA_ERR_UNSUPPORTED);
      TU_CHECK(strstr(mla_ctx_last_error(gpu), "without NCCL") != NULL, "message: %s", mla_ctx_last_error(gpu));
    }
    mla_ctx_destroy(gpu);
  }
  printf("test_cuda_dcp_nccl: skipped: built without NCCL\n");
  return tu_finish("test_cuda_dcp_nccl");
}
#else
#include <nccl.h>
#include <pthread.h>

#include "cuda_util.h"

/* TU_CHECK from the rank threads: its counters are shared. */
static pthread_mutex_t check_mu = PTHREAD_MUTEX_INITIALIZER;
#define RK_CHECK(cond, ...)                 \
  do {                                      \
    pthread_mutex_lock(&check_mu);          \
    TU_CHECK(cond, __VA_ARGS__);            \
    pthread_mutex_unlock(&check_mu);        \
  } while (0)
#define RK_STATUS(expr, want)                                                                    \
  do {                                                                                           \
    mla_status rk_st_ = (expr);                                                                  \
    RK_CHECK(rk_st_ == (want), "%s returned %s, expected %s", #expr, mla_status_string(rk_st_), \
             mla_status_string(want));                                                           \
  } while (0)

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define P_FACTOR (1.0 / 128.0) /* P rounded to bf16 before P V, plus each rank's o rounded to bf16 */
#define MAX_COS 1e-5
#define LSE_ATOL 2e-5
#define LSE_RTOL 2e-5
#define MAXR 8 /* ranks a test world holds */

/* ---- ranks: one thread each, a context and a communicator -------------- */
typedef struct rank_group rank_group;
typedef struct rank_env {
  int rank;
  rank_group *g;
  mla_ctx *ctx;
  ncclComm_t comm;
  int ok; /* the rank's setup and calls so far succeeded */
} rank_env;

struct rank_group {
  int world;
  ncclUniqueId id;
  pthread_barrier_t bar;
  int ok[MAXR];
  ncclComm_t comms[MAXR]; /* every rank's communicator (the cross-device refusal) */
  void (*body)(rank_env *e, void *job);
  void *job;
  rank_env env[MAXR];
};

/* A library call inside a rank: a failure is a check failure with the message. */
#define RK_OK(e, expr)                                                                                    \
  do {                                                                                                    \
    mla_status rk_s_ = (expr);                                                                            \
    if (rk_s_ != MLA_OK) {                                                                                \
      RK_CHECK(0, "rank %d: %s returned %s: %s", (e)->rank, #expr, mla_status_string(rk_s_),              \
               mla_ctx_last_error((e)->ctx));                                                             \
      (e)->ok = 0;                                                                                        \
    }                                                                                                     \
  } while (0)

/* 1 when every rank is still ok. A collective is entered only when all are,
 * so one rank's failure cannot leave the other waiting in NCCL forever. */
static int rk_agree(rank_env *e) {
  rank_group *g = e->g;
  g->ok[e->rank] = e->ok;
  pthread_barrier_wait(&g->bar);
  int all = 1;
  for (int r = 0; r < g->world; r++) all &= g->ok[r];
  pthread_barrier_wait(&g->bar); /* everyone has read before the next round writes */
  return all;
}

static void *rank_main(void *arg) {
  rank_env *e = arg;
  rank_group *g = e->g;
  e->ok = 1;
  if (cudaSetDevice(e->rank) != cudaSuccess) e->ok = 0;
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 0, e->rank};
  if (e->ok && mla_ctx_create(&gd, &e->ctx) != MLA_OK) e->ok = 0;
  /* Every rank enters the init even after a failure: it is itself collective. */
  ncclResult_t r = ncclCommInitRank(&e->comm, g->world, g->id, e->rank);
  if (r != ncclSuccess) {
    RK_CHECK(0, "rank %d: ncclCommInitRank: %s", e->rank, ncclGetErrorString(r));
    e->ok = 0;
    e->comm = NULL;
  }
  g->comms[e->rank] = e->comm;
  RK_CHECK(e->ok, "rank %d: setup failed", e->rank);
  if (rk_agree(e)) g->body(e, g->job);
  rk_agree(e);
  if (e->comm) ncclCommDestroy(e->comm);
  mla_ctx_destroy(e->ctx);
  return NULL;
}

/* Run body on `world` ranks (GPUs 0..world-1), one thread each. */
static void run_ranks(int world, void (*body)(rank_env *, void *), void *job) {
  static rank_group g; /* big (NCCL ids); one group at a time */
  memset(&g, 0, sizeof g);
  g.world = world;
  g.body = body;
  g.job = job;
  ncclResult_t r = ncclGetUniqueId(&g.id);
  TU_CHECK(r == ncclSuccess, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  if (r != ncclSuccess) return;
  pthread_barrier_init(&g.bar, NULL, (unsigned)world);
  pthread_t th[MAXR];
  for (int k = 0; k < world; k++) {
    g.env[k].rank = k;
    g.env[k].g = &g;
    pthread_create(&th[k], NULL, rank_main, &g.env[k]);
  }
  for (int k = 0; k < world; k++) pthread_join(th[k], NULL);
  pthread_barrier_destroy(&g.bar);
}

/* ---- merge only: random states of every act dtype vs ref_merge ---------- */
typedef struct merge_job {
  mla_dtype t;
  int T, H, D, in_place, with_lse;
  double *o_src[MAXR], *l_src[MAXR]; /* [T, H, D], [T, H] per rank (values as the dtype holds them) */
  double *got_o[MAXR], *got_l[MAXR];  /* what each rank's merge returned */
} merge_job;

static void merge_body(rank_env *e, void *arg) {
  merge_job *j = arg;
  const int64_t rows = (int64_t)j->T * j->H, n = rows * j->D;
  const size_t es = tu_act_size(j->t);
  float *f = malloc(sizeof(float) * (size_t)n);
  void *h = malloc(es * (size_t)n);
  float *lh = malloc(sizeof(float) * (size_t)rows);
  for (int64_t i = 0; i < n; i++) f[i] = (float)j->o_src[e->rank][i];
  for (int64_t i = 0; i < rows; i++) lh[i] = (float)j->l_src[e->rank][i];
  tu_to_dtype(j->t, f, h, n);
  void *o_local = tu_dev_copy(h, es * (size_t)n);
  float *l_local = tu_dev_copy(lh, sizeof(float) * (size_t)rows);
  void *out = j->in_place ? o_local : tu_dev_alloc(es * (size_t)n);
  float *lse_out = !j->with_lse ? NULL : j->in_place ? l_local : tu_dev_alloc(sizeof(float) * (size_t)rows);
  size_t wsb = 0;
  RK_OK(e, mla_dcp_merge_workspace_size(e->ctx, e->g->world, j->T, j->H, j->D, j->t, &wsb));
  void *ws = tu_dev_alloc(wsb);
  if (rk_agree(e)) {
    RK_OK(e, mla_dcp_merge_nccl(e->ctx, e->comm, e->g->world, e->rank, j->T, j->H, j->D, j->t, o_local, l_local, ws,
                                wsb, out, lse_out));
    RK_OK(e, mla_ctx_synchronize(e->ctx));
  }
  CK(cudaMemcpy(h, out, es * (size_t)n, cudaMemcpyDeviceToHost));
  tu_from_dtype(j->t, h, j->got_o[e->rank], n);
  if (lse_out) {
    CK(cudaMemcpy(lh, lse_out, sizeof(float) * (size_t)rows, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < rows; i++) j->got_l[e->rank][i] = lh[i];
  }
  cudaFree(ws);
  if (!j->in_place) {
    cudaFree(out);
    if (lse_out) cudaFree(lse_out);
  }
  cudaFree(o_local);
  cudaFree(l_local);
  free(f);
  free(h);
  free(lh);
}

static void merge_case(int world, mla_dtype t, int in_place, int with_lse) {
  char name[96];
  snprintf(name, sizeof name, "merge world=%d %s%s%s", world, mla_dtype_name(t), in_place ? " in place" : "",
           with_lse ? "" : " lse_out=NULL");
  merge_job j;
  memset(&j, 0, sizeof j);
  j.t = t;
  j.T = 37;
  j.H = 3;
  j.D = 100;
  j.in_place = in_place;
  j.with_lse = with_lse;
  const int64_t rows = (int64_t)j.T * j.H, n = rows * j.D;
  for (int r = 0; r < world; r++) {
    j.o_src[r] = malloc(sizeof(double) * (size_t)n);
    j.l_src[r] = malloc(sizeof(double) * (size_t)rows);
    j.got_o[r] = malloc(sizeof(double) * (size_t)n);
    j.got_l[r] = malloc(sizeof(double) * (size_t)rows);
    for (int64_t i = 0; i < n; i++) j.o_src[r][i] = tu_round_to(t, tu_normal(&rng));
    for (int64_t i = 0; i < rows; i++) {
      /* token 0: empty on every rank; token 1: empty on rank 0 only */
      const int64_t tok = i / j.H;
      const int empty = tok == 0 || (tok == 1 && r == 0) || tu_uniform(&rng) < 0.1;
      j.l_src[r][i] = empty ? -INFINITY : (double)(float)(3.0 * tu_normal(&rng));
      if (empty)
        for (int d = 0; d < j.D; d++) j.o_src[r][i * j.D + d] = 0.0;
      for (int d = 0; d < j.D; d++) j.got_o[r][i * j.D + d] = NAN;
      j.got_l[r][i] = NAN;
    }
  }
  run_ranks(world, merge_body, &j);
  double *ro = malloc(sizeof(double) * (size_t)n), *rl = malloc(sizeof(double) * (size_t)rows);
  ref_merge(world, j.T, j.H, j.D, (const double *const *)j.o_src, (const double *const *)j.l_src, ro, rl);
  for (int64_t i = 0; i < n; i++) ro[i] = tu_round_to(t, ro[i]);
  const double rt = t == MLA_DTYPE_F32 ? 1e-5 : 2.0 / 1024.0;
  for (int r = 0; r < world; r++) {
    ref_cmp c = ref_compare(j.got_o[r], ro, n, 1e-5, rt);
    TU_CHECK(ref_cmp_ok(&c, 1e-6), "%s rank %d: o: %lld bad (first %lld), %lld non-finite mismatches, max err %.3g",
             name, r, (long long)c.bad, (long long)c.first_bad, (long long)c.nonfinite_mismatch, c.max_abs_err);
    if (with_lse) {
      c = ref_compare(j.got_l[r], rl, rows, 1e-5, 1e-5);
      TU_CHECK(ref_cmp_ok(&c, 1e-6), "%s rank %d: lse: %lld bad, %lld non-finite mismatches, max err %.3g", name,
               r, (long long)c.bad, (long long)c.nonfinite_mismatch, c.max_abs_err);
    }
    if (r > 0)
      TU_CHECK(!memcmp(j.got_o[r], j.got_o[0], sizeof(double) * (size_t)n), "%s: rank %d differs from rank 0", name, r);
  }
  for (int r = 0; r < world; r++) {
    free(j.o_src[r]);
    free(j.l_src[r]);
    free(j.got_o[r]);
    free(j.got_l[r]);
  }
  free(ro);
  free(rl);
}

/* ---- refusals on a CUDA context with a live communicator ---------------- */
static void refusal_body(rank_env *e, void *arg) {
  (void)arg;
  const int W = e->g->world, T = 5, H = 4, D = 512;
  const size_t on = 2 * (size_t)T * H * D, ln = sizeof(float) * (size_t)T * H;
  void *o = tu_dev_alloc(on), *out = tu_dev_alloc(on);
  float *l = tu_dev_alloc(ln), *lo = tu_dev_alloc(ln);
  CK(cudaMemset(out, 0xFF, on));
  CK(cudaMemset(lo, 0xFF, ln));
  size_t wsb = 0;
  RK_OK(e, mla_dcp_merge_workspace_size(e->ctx, W, T, H, D, MLA_DTYPE_BF16, &wsb));
  char *ws = tu_dev_alloc(wsb + on);
  void *host = malloc(on);
  mla_ctx *c = e->ctx;
  const mla_dtype B = MLA_DTYPE_BF16;
  /* the communicator's size, rank and device must be what the call says */
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W + 1, e->rank, T, H, D, B, o, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_CHECK(strstr(mla_ctx_last_error(c), "ranks") != NULL, "message: %s", mla_ctx_last_error(c));
  if (W > 1) {
    RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, (e->rank + 1) % W, T, H, D, B, o, l, ws, wsb, out, lo),
              MLA_ERR_INVALID_ARGUMENT);
    RK_CHECK(strstr(mla_ctx_last_error(c), "this communicator is rank") != NULL, "message: %s",
             mla_ctx_last_error(c));
    /* another rank's communicator (another device), with its rank */
    const int other = (e->rank + 1) % W;
    RK_STATUS(mla_dcp_merge_nccl(c, e->g->comms[other], W, other, T, H, D, B, o, l, ws, wsb, out, lo),
              MLA_ERR_INVALID_ARGUMENT);
    RK_CHECK(strstr(mla_ctx_last_error(c), "device") != NULL, "message: %s", mla_ctx_last_error(c));
  }
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, 0, 0, T, H, D, B, o, l, ws, wsb, out, lo), MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, W, T, H, D, B, o, l, ws, wsb, out, lo), MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, NULL, W, e->rank, T, H, D, B, o, l, ws, wsb, out, lo), MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, NULL, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, NULL, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, NULL, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, ws, wsb, NULL, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, ws, wsb - 1, out, lo),
            MLA_ERR_WORKSPACE_TOO_SMALL);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, host, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, ws, wsb, host, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, (char *)o + 1, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, MLA_DTYPE_FP8_E4M3, o, l, ws, wsb, out, lo),
            MLA_ERR_UNSUPPORTED);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, (mla_dtype)-3, o, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, 0, D, B, o, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, -1, H, D, B, o, l, ws, wsb, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  /* out inside the gathered region; the workspace over o_local */
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, ws, wsb + on, ws + 256, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, ws + wsb - on / 2, l, ws, wsb + on, out, lo),
            MLA_ERR_INVALID_ARGUMENT);
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, T, H, D, B, o, l, ws, wsb, out, (float *)out),
            MLA_ERR_INVALID_ARGUMENT);
  /* num_tokens 0: nothing to exchange, nothing enqueued (every rank has T = 0) */
  RK_STATUS(mla_dcp_merge_nccl(c, e->comm, W, e->rank, 0, H, D, B, NULL, NULL, NULL, 0, NULL, NULL), MLA_OK);
  RK_OK(e, mla_ctx_synchronize(c));
  char *hb = malloc(on);
  CK(cudaMemcpy(hb, out, on, cudaMemcpyDeviceToHost));
  RK_CHECK(tu_all_poisoned(hb, on), "rank %d: a refused call wrote out", e->rank);
  CK(cudaMemcpy(hb, lo, ln, cudaMemcpyDeviceToHost));
  RK_CHECK(tu_all_poisoned(hb, ln), "rank %d: a refused call wrote lse_out", e->rank);
  free(hb);
  free(host);
  cudaFree(ws);
  cudaFree(o);
  cudaFree(out);
  cudaFree(l);
  cudaFree(lo);
}

/* ---- the DCP step on every rank, merged, vs the oracle ------------------- */
#define NREQ 9
#define BS (NREQ + 1) /* one padding row */
#define MAX_CTX 2200
typedef struct dcp_job {
  int Pg, H, world, pages;
  int32_t *r2t;                 /* [NREQ, MAX_CTX] global slots */
  int32_t ids[BS], seq[BS];
  int tk;                       /* keys of all requests */
  int32_t *slots;               /* [tk] global slot of each key */
  uint16_t *c, *r;              /* bf16 [tk, 512], [tk, 64] */
  uint16_t *qn, *qr;            /* bf16 [BS, H, 512], [BS, H, 64] */
  uint16_t *got_o[MAXR];        /* merged out per rank, bf16 [BS, H, 512] */
  float *got_l[MAXR];           /* merged lse per rank [BS, H] */
  uint16_t *single_o;           /* plain single-GPU step (rank 0's device) */
  float *single_l;
} dcp_job;

/* One step (prepare + attention) on this rank's device, bf16 q / out. */
static void rank_step(rank_env *e, const mla_step_desc *d, mla_kv_cache *cache, const mla_step_inputs *in, void *qn,
                      void *qr, void *o, float *lse) {
  size_t wsb = 0;
  RK_OK(e, mla_step_workspace_size(e->ctx, d, &wsb));
  void *ws = tu_dev_alloc(wsb);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = d->num_heads;
  a.scale = 0.0721687836f;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = o;
  a.lse = lse;
  if (e->ok) RK_OK(e, mla_step_prepare(e->ctx, d, cache, in, ws, wsb));
  if (e->ok) RK_OK(e, mla_step_attention(e->ctx, d, cache, 0, &a, ws, wsb));
  RK_OK(e, mla_ctx_synchronize(e->ctx));
  cudaFree(ws);
}

/* The decode batch's step. */
static void run_step(rank_env *e, const mla_step_desc *d, mla_kv_cache *cache, void *qn, void *qr, int32_t *r2t,
                     int32_t *ids, int32_t *seq, void *o, float *lse) {
  mla_step_inputs in;
  memset(&in, 0, sizeof in);
  in.req_to_token = r2t;
  in.req_to_token_stride = MAX_CTX;
  in.max_reqs = NREQ;
  in.req_ids = ids;
  in.seq_lens = seq;
  rank_step(e, d, cache, &in, qn, qr, o, lse);
}

/* A cache of this rank's context in dtype dt (fp8 per-tensor scale 0.375),
 * every row NaN (0xFF in every format: a row read by mistake shows) except
 * page 0 (zero: the padding row's target). */
static mla_kv_cache *poisoned_cache(rank_env *e, int pages, int page, mla_dtype dt) {
  const float sc[1] = {0.375f};
  mla_kv_cache_desc cd = {1, pages, page, dt, dt == MLA_DTYPE_FP8_E4M3 ? sc : NULL};
  mla_kv_cache *cache = NULL;
  RK_OK(e, mla_kv_cache_create(e->ctx, &cd, &cache));
  if (!cache) return NULL;
  void *data = NULL;
  size_t rb = 0;
  mla_kv_cache_layer_data(cache, 0, &data);
  mla_kv_cache_row_bytes(cache, &rb);
  CK(cudaMemset(data, 0xFF, rb * (size_t)pages * page));
  CK(cudaMemset(data, 0, rb * (size_t)page));
  return cache;
}

static void dcp_body(rank_env *e, void *arg) {
  dcp_job *j = arg;
  const int W = e->g->world, H = j->H;
  const size_t no = 2 * (size_t)BS * H * MLA_LATENT, nl = sizeof(float) * (size_t)BS * H;
  int32_t *r2t = tu_dev_copy(j->r2t, sizeof(int32_t) * NREQ * MAX_CTX);
  int32_t *ids = tu_dev_copy(j->ids, sizeof j->ids), *seq = tu_dev_copy(j->seq, sizeof j->seq);
  int32_t *slots = tu_dev_copy(j->slots, sizeof(int32_t) * (size_t)j->tk);
  void *c = tu_dev_copy(j->c, 2 * (size_t)j->tk * MLA_LATENT), *r = tu_dev_copy(j->r, 2 * (size_t)j->tk * MLA_ROPE);
  void *qn = tu_dev_copy(j->qn, 2 * (size_t)BS * H * MLA_LATENT), *qr = tu_dev_copy(j->qr, 2 * (size_t)BS * H * MLA_ROPE);
  void *o_local = tu_dev_alloc(no), *out = tu_dev_alloc(no);
  float *l_local = tu_dev_alloc(nl), *l_out = tu_dev_alloc(nl);
  CK(cudaMemset(out, 0xFF, no));
  CK(cudaMemset(l_out, 0xFF, nl));
  /* this rank's shard of the same global rows */
  mla_kv_cache *cache = poisoned_cache(e, j->pages, j->Pg / W, MLA_DTYPE_BF16);
  if (cache) RK_OK(e, mla_kv_cache_write_shard(cache, 0, j->tk, slots, c, r, MLA_DTYPE_BF16, W, e->rank));
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = MLA_MODE_DECODE;
  d.batch_size = BS;
  d.max_kv_len = MAX_CTX;
  d.num_heads = H;
  d.page_size = j->Pg / W;
  d.dcp_world = W;
  d.dcp_rank = e->rank;
  if (cache && e->ok) run_step(e, &d, cache, qn, qr, r2t, ids, seq, o_local, l_local);
  size_t wsb = 0;
  RK_OK(e, mla_dcp_merge_workspace_size(e->ctx, W, BS, H, MLA_LATENT, MLA_DTYPE_BF16, &wsb));
  void *ws = tu_dev_alloc(wsb);
  if (rk_agree(e)) {
    RK_OK(e, mla_dcp_merge_nccl(e->ctx, e->comm, W, e->rank, BS, H, MLA_LATENT, MLA_DTYPE_BF16, o_local, l_local, ws,
                                wsb, out, l_out));
    RK_OK(e, mla_ctx_synchronize(e->ctx));
  }
  CK(cudaMemcpy(j->got_o[e->rank], out, no, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(j->got_l[e->rank], l_out, nl, cudaMemcpyDeviceToHost));
  if (e->rank == 0) {
    /* the single-GPU reference: a plain step over the whole cache */
    mla_kv_cache *whole = poisoned_cache(e, j->pages, j->Pg, MLA_DTYPE_BF16);
    if (whole) RK_OK(e, mla_kv_cache_write(whole, 0, j->tk, slots, c, r, MLA_DTYPE_BF16));
    mla_step_desc d1 = d;
    d1.page_size = j->Pg;
    d1.dcp_world = 0;
    d1.dcp_rank = 0;
    CK(cudaMemset(o_local, 0xFF, no));
    if (whole && e->ok) run_step(e, &d1, whole, qn, qr, r2t, ids, seq, o_local, l_local);
    CK(cudaMemcpy(j->single_o, o_local, no, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(j->single_l, l_local, nl, cudaMemcpyDeviceToHost));
    mla_kv_cache_destroy(whole);
  }
  mla_kv_cache_destroy(cache);
  void *bufs[] = {r2t, ids, seq, slots, c, r, qn, qr, o_local, out, l_local, l_out, ws};
  for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) cudaFree(bufs[k]);
}

/* got (bf16 / f32) vs the oracle over the non-padding rows. */
static void check_vs_oracle(const char *name, const dcp_job *j, const uint16_t *o, const float *l, const double *ro,
                            const double *rl, const double *pb, const int *row_of, int nrows) {
  const int H = j->H;
  const int64_t no = (int64_t)nrows * H * MLA_LATENT, nl = (int64_t)nrows * H;
  double *go = malloc(sizeof(double) * (size_t)no), *gl = malloc(sizeof(double) * (size_t)nl);
  for (int i = 0; i < nrows; i++)
    for (int64_t k = 0; k < (int64_t)H * MLA_LATENT; k++)
      go[i * (int64_t)H * MLA_LATENT + k] = tu_bf16_to_f32(o[(int64_t)row_of[i] * H * MLA_LATENT + k]);
  for (int i = 0; i < nrows; i++)
    for (int h = 0; h < H; h++) gl[i * H + h] = l[row_of[i] * H + h];
  ref_cmp c = ref_compare(go, ro, no, O_ATOL, O_RTOL);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < no; i++) {
    const double err = fabs(go[i] - ro[i]);
    if (!(err <= O_ATOL + O_RTOL * fabs(ro[i]) + P_FACTOR * pb[i])) {
      if (first < 0) first = i;
      bad++;
    }
  }
  TU_CHECK(bad == 0 && c.nonfinite_mismatch == 0 && c.cos_dist <= MAX_COS,
           "%s: o: %lld outside the bound (first %lld: got %.6g ref %.6g), %lld non-finite mismatches, cos %.3g", name,
           (long long)bad, (long long)first, first >= 0 ? go[first] : 0.0, first >= 0 ? ro[first] : 0.0,
           (long long)c.nonfinite_mismatch, c.cos_dist);
  c = ref_compare(gl, rl, nl, LSE_ATOL, LSE_RTOL);
  TU_CHECK(c.bad == 0 && c.nonfinite_mismatch == 0, "%s: lse: %lld bad (max err %.3g), %lld non-finite mismatches",
           name, (long long)c.bad, c.max_abs_err, (long long)c.nonfinite_mismatch);
  free(go);
  free(gl);
}

/* Host buffers for every rank's output (bf16 o of no bytes, lse of nl
 * bytes) and the single-GPU reference's, all poisoned (0xFF: NaN). */
static void poisoned_outputs(int W, size_t no, size_t nl, uint16_t **got_o, float **got_l, uint16_t **single_o,
                             float **single_l) {
  for (int r = 0; r < W; r++) {
    got_o[r] = malloc(no);
    got_l[r] = malloc(nl);
    tu_poison(got_o[r], no);
    tu_poison(got_l[r], nl);
  }
  *single_o = malloc(no);
  *single_l = malloc(nl);
  tu_poison(*single_o, no);
  tu_poison(*single_l, nl);
}

/* A global request table (page Pg, `pages` pages) on the CPU context with
 * n requests of lens[i] positions, pages handed out interleaved (steps of
 * 1 .. cap_pages pages) after `dummies` requests of 1, 2, ... pages were
 * freed in a shuffled order, so each request's pages are scattered.
 * Returns req_to_token's rows in request order, [n, MAX_CTX] (malloc), or
 * NULL. */
static int32_t *scattered_r2t(mla_ctx *cpu, int n, const int32_t *lens, int Pg, int pages, int dummies,
                              int cap_pages) {
  mla_req_table_desc rd = {n + (dummies > 2 ? dummies : 2), MAX_CTX, pages, Pg};
  mla_req_table *rt = NULL;
  TU_STATUS(mla_req_table_create(cpu, &rd, NULL, &rt), MLA_OK);
  if (!rt) return NULL;
  int32_t dummy[8], rid[16], have[16] = {0};
  for (int k = 0; k < dummies; k++) {
    TU_STATUS(mla_req_add(rt, &dummy[k]), MLA_OK);
    TU_STATUS(mla_req_extend(rt, dummy[k], Pg * (k + 1), NULL), MLA_OK);
  }
  if (dummies) tu_shuffle_i32(&rng, dummy, dummies);
  for (int k = 0; k < dummies; k++) TU_STATUS(mla_req_free(rt, dummy[k]), MLA_OK);
  for (int i = 0; i < n; i++) TU_STATUS(mla_req_add(rt, &rid[i]), MLA_OK);
  for (int left = 1; left;) {
    left = 0;
    for (int i = 0; i < n; i++) {
      const int m = lens[i] - have[i];
      if (m <= 0) continue;
      const int step = tu_randint(&rng, 1, m < cap_pages * Pg ? m : cap_pages * Pg);
      TU_STATUS(mla_req_extend(rt, rid[i], step, NULL), MLA_OK);
      have[i] += step;
      left |= have[i] < lens[i];
    }
  }
  const int32_t *r2t = NULL;
  mla_req_table_data(rt, &r2t);
  int32_t *out = malloc(sizeof(int32_t) * (size_t)n * MAX_CTX);
  for (int i = 0; i < n; i++) memcpy(out + (size_t)i * MAX_CTX, r2t + (size_t)rid[i] * MAX_CTX, sizeof(int32_t) * MAX_CTX);
  mla_req_table_destroy(rt);
  return out;
}

static void dcp_case(int Pg, int H) {
  const int W = 2;
  char name[64];
  snprintf(name, sizeof name, "dcp N=%d Pg=%d H=%d", W, Pg, H);
  static const int lens[NREQ] = {0, 1, 2, 3, 5, 63, 130, 777, 2100};
  dcp_job j;
  memset(&j, 0, sizeof j);
  j.Pg = Pg;
  j.H = H;
  j.world = W;
  /* the global request table (page Pg), pages handed out interleaved and
   * after a few freed requests, so each request's pages are scattered */
  mla_ctx *cpu = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  j.pages = 8;
  for (int i = 0; i < NREQ; i++) j.pages += (lens[i] + Pg - 1) / Pg + 1;
  j.pages += 4 * (1 + 2 + 3 + 4);
  j.r2t = scattered_r2t(cpu, NREQ, lens, Pg, j.pages, 4, 3);
  mla_ctx_destroy(cpu);
  if (!j.r2t) return;
  /* the rows: request i's keys at offset key0[i] */
  int key0[NREQ + 1];
  j.tk = 0;
  for (int i = 0; i < NREQ; i++) {
    key0[i] = j.tk;
    j.tk += lens[i];
  }
  key0[NREQ] = j.tk;
  j.slots = malloc(sizeof(int32_t) * (size_t)j.tk);
  int misplaced = 0;
  for (int i = 0; i < NREQ; i++)
    for (int p = 0; p < lens[i]; p++) {
      j.slots[key0[i] + p] = j.r2t[(size_t)i * MAX_CTX + p];
      misplaced += j.slots[key0[i] + p] % W != p % W;
    }
  TU_CHECK(misplaced == 0, "%s: %d positions not on rank p mod N", name, misplaced);
  float *tmp = malloc(sizeof(float) * (size_t)(j.tk > BS * H ? j.tk : BS * H) * MLA_LATENT);
  j.c = malloc(2 * (size_t)j.tk * MLA_LATENT);
  j.r = malloc(2 * (size_t)j.tk * MLA_ROPE);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tk * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.c, (int64_t)j.tk * MLA_LATENT);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tk * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.r, (int64_t)j.tk * MLA_ROPE);
  j.qn = malloc(2 * (size_t)BS * H * MLA_LATENT);
  j.qr = malloc(2 * (size_t)BS * H * MLA_ROPE);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)BS * H * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.qn, (int64_t)BS * H * MLA_LATENT);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)BS * H * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.qr, (int64_t)BS * H * MLA_ROPE);
  free(tmp);
  /* the batch: every request once with its whole length, a padding row, shuffled */
  int32_t rows[BS];
  for (int i = 0; i < BS; i++) rows[i] = i < NREQ ? i : MLA_REQ_PAD;
  tu_shuffle_i32(&rng, rows, BS);
  for (int i = 0; i < BS; i++) {
    j.ids[i] = rows[i];
    j.seq[i] = rows[i] == MLA_REQ_PAD ? 1 : lens[rows[i]];
  }
  const size_t no = 2 * (size_t)BS * H * MLA_LATENT, nl = sizeof(float) * (size_t)BS * H;
  poisoned_outputs(W, no, nl, j.got_o, j.got_l, &j.single_o, &j.single_l);

  run_ranks(W, dcp_body, &j);

  /* every rank holds the same merged bytes, the padding row too */
  for (int r = 1; r < W; r++)
    TU_CHECK(!memcmp(j.got_o[r], j.got_o[0], no) && !memcmp(j.got_l[r], j.got_l[0], nl),
             "%s: rank %d's merged output differs from rank 0's", name, r);
  /* the oracle over the non-padding rows (request order of the batch) */
  int row_of[BS], nrows = 0, qlen[BS], kvlen[BS], tkr = 0;
  for (int i = 0; i < BS; i++)
    if (j.ids[i] != MLA_REQ_PAD) {
      row_of[nrows] = i;
      qlen[nrows] = 1;
      kvlen[nrows] = j.seq[i];
      tkr += j.seq[i];
      nrows++;
    }
  const int64_t nq = (int64_t)nrows * H;
  double *qnd = malloc(sizeof(double) * (size_t)nq * MLA_LATENT), *qrd = malloc(sizeof(double) * (size_t)nq * MLA_ROPE);
  double *cd_ = malloc(sizeof(double) * (size_t)(tkr + 1) * MLA_LATENT), *rd_ = malloc(sizeof(double) * (size_t)(tkr + 1) * MLA_ROPE);
  double *ro = malloc(sizeof(double) * (size_t)nq * MLA_LATENT), *rl = malloc(sizeof(double) * (size_t)nq);
  double *pb = calloc((size_t)nq * MLA_LATENT, sizeof(double));
  int kk = 0;
  for (int i = 0; i < nrows; i++) {
    const int b = row_of[i], req = j.ids[b];
    for (int64_t k = 0; k < (int64_t)H * MLA_LATENT; k++)
      qnd[i * (int64_t)H * MLA_LATENT + k] = tu_bf16_to_f32(j.qn[(int64_t)b * H * MLA_LATENT + k]);
    for (int64_t k = 0; k < (int64_t)H * MLA_ROPE; k++)
      qrd[i * (int64_t)H * MLA_ROPE + k] = tu_bf16_to_f32(j.qr[(int64_t)b * H * MLA_ROPE + k]);
    for (int p = 0; p < j.seq[b]; p++, kk++) {
      for (int d = 0; d < MLA_LATENT; d++) cd_[(int64_t)kk * MLA_LATENT + d] = tu_bf16_to_f32(j.c[(int64_t)(key0[req] + p) * MLA_LATENT + d]);
      for (int d = 0; d < MLA_ROPE; d++) rd_[(int64_t)kk * MLA_ROPE + d] = tu_bf16_to_f32(j.r[(int64_t)(key0[req] + p) * MLA_ROPE + d]);
    }
  }
  const double scale = (double)0.0721687836f;
  ref_absorbed(nrows, qlen, kvlen, H, scale, 1, qnd, qrd, cd_, rd_, ro, rl);
  /* the P-rounding bound: sum_j p_j |c_j| per output element */
  kk = 0;
  double *s = malloc(sizeof(double) * MAX_CTX);
  for (int i = 0; i < nrows; i++) {
    const int K = kvlen[i];
    for (int h = 0; h < H; h++) {
      const double *qa = qnd + ((int64_t)i * H + h) * MLA_LATENT, *qb = qrd + ((int64_t)i * H + h) * MLA_ROPE;
      double mx = -INFINITY, sum = 0;
      for (int k = 0; k < K; k++) {
        const double *ck = cd_ + (int64_t)(kk + k) * MLA_LATENT, *rk = rd_ + (int64_t)(kk + k) * MLA_ROPE;
        double t = 0;
        for (int d = 0; d < MLA_LATENT; d++) t += qa[d] * ck[d];
        for (int d = 0; d < MLA_ROPE; d++) t += qb[d] * rk[d];
        s[k] = scale * t;
        if (s[k] > mx) mx = s[k];
      }
      for (int k = 0; k < K; k++) sum += (s[k] = exp(s[k] - mx));
      double *pbr = pb + ((int64_t)i * H + h) * MLA_LATENT;
      for (int k = 0; k < K; k++) {
        const double *ck = cd_ + (int64_t)(kk + k) * MLA_LATENT;
        for (int d = 0; d < MLA_LATENT; d++) pbr[d] += s[k] / sum * fabs(ck[d]);
      }
    }
    kk += K;
  }
  free(s);
  for (int64_t k = 0; k < nq * MLA_LATENT; k++) ro[k] = ref_round_bf16(ro[k]);
  char sub[96];
  snprintf(sub, sizeof sub, "%s merged (rank 0)", name);
  check_vs_oracle(sub, &j, j.got_o[0], j.got_l[0], ro, rl, pb, row_of, nrows);
  snprintf(sub, sizeof sub, "%s single GPU", name);
  check_vs_oracle(sub, &j, j.single_o, j.single_l, ro, rl, pb, row_of, nrows);
  double dmax = 0;
  for (int i = 0; i < nrows; i++)
    for (int64_t k = 0; k < (int64_t)H * MLA_LATENT; k++) {
      const int64_t x = (int64_t)row_of[i] * H * MLA_LATENT + k;
      const double dd = fabs((double)tu_bf16_to_f32(j.got_o[0][x]) - tu_bf16_to_f32(j.single_o[x]));
      if (!(dd <= dmax)) dmax = dd;
    }
  printf("%s: max |o(2 GPUs, merged) - o(1 GPU)| = %.3g\n", name, dmax);
  for (int r = 0; r < W; r++) {
    free(j.got_o[r]);
    free(j.got_l[r]);
  }
  free(j.single_o);
  free(j.single_l);
  free(qnd);
  free(qrd);
  free(cd_);
  free(rd_);
  free(ro);
  free(rl);
  free(pb);
  free(j.r2t);
  free(j.slots);
  free(j.c);
  free(j.r);
  free(j.qn);
  free(j.qr);
}

/* ---- EXTEND under DCP: shards pooled over NCCL, then one EXTEND --------- */
#define EREQ 6
typedef struct ext_job {
  int Pg, H, world;
  mla_dtype dt;
  int32_t *r2t;                 /* [EREQ, MAX_CTX] global slots */
  int32_t seq[EREQ], ext[EREQ], ids[EREQ];
  int tk, tq;
  int32_t *slots;               /* [tk] global slot of each key */
  uint16_t *c, *r;              /* bf16 [tk, 512], [tk, 64] */
  uint16_t *qn, *qr;            /* bf16 [tq, H, 512], [tq, H, 64] */
  int32_t *table, m;            /* mla_dcp_gather_table: [EREQ, MAX_CTX], rows per rank */
  int32_t *local[MAXR];         /* each rank's local slots (its mla_dcp_plan kv_indices) */
  int nlocal[MAXR];
  uint16_t *got_o[MAXR];        /* bf16 [tq, H, 512] per rank */
  float *got_l[MAXR];           /* [tq, H] */
  uint16_t *single_o;           /* the single-GPU EXTEND (rank 0's device) */
  float *single_l;
  unsigned char *gath_rows;     /* rank 0's gathered layer, [1 + world m, row_bytes] */
  unsigned char *whole_rows;    /* the single cache's layer, [pages Pg, row_bytes] */
  int pages;
  size_t rb;
} ext_job;

static void ext_step(rank_env *e, ext_job *j, mla_kv_cache *cache, int page, const int32_t *r2t_d, void *qn, void *qr,
                     void *o, float *l) {
  int32_t *ids = tu_dev_copy(j->ids, sizeof j->ids), *seq = tu_dev_copy(j->seq, sizeof j->seq);
  int32_t *ext = tu_dev_copy(j->ext, sizeof j->ext);
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = MLA_MODE_EXTEND;
  d.batch_size = EREQ;
  d.max_kv_len = MAX_CTX;
  d.num_heads = j->H;
  d.page_size = page;
  d.num_tokens = j->tq;
  mla_step_inputs in = {r2t_d, MAX_CTX, EREQ, ids, seq, ext};
  rank_step(e, &d, cache, &in, qn, qr, o, l);
  cudaFree(ids);
  cudaFree(seq);
  cudaFree(ext);
}

static void ext_body(rank_env *e, void *arg) {
  ext_job *j = arg;
  const int W = e->g->world, H = j->H;
  const size_t no = 2 * (size_t)j->tq * H * MLA_LATENT, nl = sizeof(float) * (size_t)j->tq * H;
  int32_t *slots = tu_dev_copy(j->slots, sizeof(int32_t) * (size_t)j->tk);
  void *c = tu_dev_copy(j->c, 2 * (size_t)j->tk * MLA_LATENT), *r = tu_dev_copy(j->r, 2 * (size_t)j->tk * MLA_ROPE);
  void *qn = tu_dev_copy(j->qn, no), *qr = tu_dev_copy(j->qr, 2 * (size_t)j->tq * H * MLA_ROPE);
  int32_t *local = tu_dev_copy(j->local[e->rank], sizeof(int32_t) * (size_t)(j->nlocal[e->rank] + 1));
  int32_t *table = tu_dev_copy(j->table, sizeof(int32_t) * EREQ * MAX_CTX);
  void *o = tu_dev_alloc(no);
  float *l = tu_dev_alloc(nl);
  CK(cudaMemset(o, 0xFF, no));
  CK(cudaMemset(l, 0xFF, nl));
  /* this rank's shard (page Pg / W, every position p mod W == rank) */
  mla_kv_cache *shard = poisoned_cache(e, j->pages, j->Pg / W, j->dt);
  if (shard) RK_OK(e, mla_kv_cache_write_shard(shard, 0, j->tk, slots, c, r, MLA_DTYPE_BF16, W, e->rank));
  mla_kv_cache *gath = poisoned_cache(e, 1 + W * j->m, 1, j->dt);
  if (rk_agree(e)) {
    RK_OK(e, mla_dcp_gather_kv_nccl(e->ctx, e->comm, W, e->rank, shard, 0, j->nlocal[e->rank], local, j->m, gath, 0,
                                    1));
    RK_OK(e, mla_ctx_synchronize(e->ctx));
  }
  if (e->ok) ext_step(e, j, gath, 1, table, qn, qr, o, l);
  CK(cudaMemcpy(j->got_o[e->rank], o, no, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(j->got_l[e->rank], l, nl, cudaMemcpyDeviceToHost));
  if (e->rank == 0 && gath) {
    void *gd = NULL;
    mla_kv_cache_layer_data(gath, 0, &gd);
    CK(cudaMemcpy(j->gath_rows, gd, j->rb * (size_t)(1 + W * j->m), cudaMemcpyDeviceToHost));
    /* the single-GPU reference: every row in one cache of page Pg */
    mla_kv_cache *whole = poisoned_cache(e, j->pages, j->Pg, j->dt);
    int32_t *r2t = tu_dev_copy(j->r2t, sizeof(int32_t) * EREQ * MAX_CTX);
    if (whole) RK_OK(e, mla_kv_cache_write(whole, 0, j->tk, slots, c, r, MLA_DTYPE_BF16));
    CK(cudaMemset(o, 0xFF, no));
    if (whole && e->ok) ext_step(e, j, whole, j->Pg, r2t, qn, qr, o, l);
    CK(cudaMemcpy(j->single_o, o, no, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(j->single_l, l, nl, cudaMemcpyDeviceToHost));
    if (whole) {
      void *wd = NULL;
      mla_kv_cache_layer_data(whole, 0, &wd);
      CK(cudaMemcpy(j->whole_rows, wd, j->rb * (size_t)j->pages * j->Pg, cudaMemcpyDeviceToHost));
    }
    mla_kv_cache_destroy(whole);
    cudaFree(r2t);
  }
  mla_kv_cache_destroy(gath);
  mla_kv_cache_destroy(shard);
  void *bufs[] = {slots, c, r, qn, qr, local, table, o, l};
  for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) cudaFree(bufs[k]);
}

static void ext_case(int W, int Pg, int H, mla_dtype dt) {
  char name[80];
  snprintf(name, sizeof name, "extend N=%d Pg=%d H=%d %s", W, Pg, H, mla_dtype_name(dt));
  static const int prefix[EREQ] = {0, 1, 2, 700, 1800, 33}, extl[EREQ] = {7, 1, 64, 130, 300, 1};
  ext_job j;
  memset(&j, 0, sizeof j);
  j.Pg = Pg;
  j.H = H;
  j.world = W;
  j.dt = dt;
  mla_ctx *cpu = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  j.pages = 8;
  for (int i = 0; i < EREQ; i++) j.pages += (prefix[i] + extl[i] + Pg - 1) / Pg + 1;
  for (int i = 0; i < EREQ; i++) {
    j.seq[i] = prefix[i] + extl[i];
    j.ext[i] = extl[i];
    j.ids[i] = i;
    j.tq += extl[i];
    j.tk += j.seq[i];
  }
  j.r2t = scattered_r2t(cpu, EREQ, j.seq, Pg, j.pages, 0, 2);
  if (!j.r2t) {
    mla_ctx_destroy(cpu);
    return;
  }
  /* the rows, the global kv indices, each rank's plan and the gathered table */
  int32_t kv_indptr[EREQ + 1] = {0};
  for (int i = 0; i < EREQ; i++) kv_indptr[i + 1] = kv_indptr[i] + j.seq[i];
  j.slots = malloc(sizeof(int32_t) * (size_t)j.tk);
  for (int i = 0; i < EREQ; i++) memcpy(j.slots + kv_indptr[i], j.r2t + (size_t)i * MAX_CTX, sizeof(int32_t) * j.seq[i]);
  j.table = malloc(sizeof(int32_t) * EREQ * MAX_CTX);
  TU_STATUS(mla_dcp_gather_table(cpu, EREQ, j.seq, W, 1, MAX_CTX, j.table, &j.m), MLA_OK);
  size_t pwb = 0;
  TU_STATUS(mla_dcp_plan_workspace_size(cpu, EREQ, j.tk, &pwb), MLA_OK);
  void *pws = malloc(pwb);
  for (int r = 0; r < W; r++) {
    mla_dcp_plan plan;
    memset(&plan, 0, sizeof plan);
    TU_STATUS(mla_dcp_plan_build(cpu, EREQ, j.seq, kv_indptr, j.slots, r, W, pws, pwb, &plan), MLA_OK);
    j.nlocal[r] = plan.kv_indptr ? plan.kv_indptr[EREQ] : 0;
    j.local[r] = malloc(sizeof(int32_t) * (size_t)(j.nlocal[r] + 1));
    if (plan.kv_indices) memcpy(j.local[r], plan.kv_indices, sizeof(int32_t) * (size_t)j.nlocal[r]);
  }
  free(pws);
  mla_ctx_destroy(cpu);
  float *tmp = malloc(sizeof(float) * (size_t)(j.tk > j.tq * H ? j.tk : j.tq * H) * MLA_LATENT);
  j.c = malloc(2 * (size_t)j.tk * MLA_LATENT);
  j.r = malloc(2 * (size_t)j.tk * MLA_ROPE);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tk * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.c, (int64_t)j.tk * MLA_LATENT);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tk * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.r, (int64_t)j.tk * MLA_ROPE);
  j.qn = malloc(2 * (size_t)j.tq * H * MLA_LATENT);
  j.qr = malloc(2 * (size_t)j.tq * H * MLA_ROPE);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tq * H * MLA_LATENT, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.qn, (int64_t)j.tq * H * MLA_LATENT);
  tu_fill_bf16_normal(&rng, tmp, (int64_t)j.tq * H * MLA_ROPE, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, tmp, j.qr, (int64_t)j.tq * H * MLA_ROPE);
  free(tmp);
  j.rb = dt == MLA_DTYPE_BF16 || dt == MLA_DTYPE_F16 ? 1152 : dt == MLA_DTYPE_FP8_E4M3 ? 576 : 656;
  const size_t no = 2 * (size_t)j.tq * H * MLA_LATENT, nl = sizeof(float) * (size_t)j.tq * H;
  poisoned_outputs(W, no, nl, j.got_o, j.got_l, &j.single_o, &j.single_l);
  j.gath_rows = malloc(j.rb * (size_t)(1 + W * j.m));
  j.whole_rows = malloc(j.rb * (size_t)j.pages * Pg);
  tu_poison(j.gath_rows, j.rb * (size_t)(1 + W * j.m));
  tu_poison(j.whole_rows, j.rb * (size_t)j.pages * Pg);

  run_ranks(W, ext_body, &j);

  /* the pooled rows are the single cache's rows of the same positions */
  int rows_bad = 0;
  for (int i = 0; i < EREQ; i++)
    for (int p = 0; p < j.seq[i]; p++)
      rows_bad += memcmp(j.gath_rows + (size_t)j.table[i * MAX_CTX + p] * j.rb,
                         j.whole_rows + (size_t)j.r2t[(size_t)i * MAX_CTX + p] * j.rb, j.rb) != 0;
  TU_CHECK(rows_bad == 0, "%s: %d gathered rows differ from the single cache's", name, rows_bad);
  for (int r = 1; r < W; r++)
    TU_CHECK(!memcmp(j.got_o[r], j.got_o[0], no) && !memcmp(j.got_l[r], j.got_l[0], nl),
             "%s: rank %d's EXTEND output differs from rank 0's", name, r);
  /* against the single-GPU EXTEND: the same rows in the same key order and
   * split schedule, only the cache page size differs */
  double dmax = 0, lmax = 0;
  int64_t bad = 0, nonfinite = 0;
  const int64_t n_o = (int64_t)j.tq * H * MLA_LATENT, n_l = (int64_t)j.tq * H;
  for (int64_t k = 0; k < n_o; k++) {
    const double a = tu_bf16_to_f32(j.got_o[0][k]), b = tu_bf16_to_f32(j.single_o[k]);
    if (!isfinite(a) || !isfinite(b)) {
      nonfinite++;
      continue;
    }
    const double d = fabs(a - b);
    if (!(d <= dmax)) dmax = d;
    bad += !(d <= 1e-6 + fabs(b) / 256.0); /* one bf16 rounding step */
  }
  for (int64_t k = 0; k < n_l; k++) {
    const double d = fabs((double)j.got_l[0][k] - j.single_l[k]);
    if (!(d <= lmax)) lmax = d;
  }
  TU_CHECK(nonfinite == 0 && bad == 0 && lmax <= 1e-5,
           "%s: vs single GPU: %lld non-finite, %lld beyond one bf16 step (max |o| diff %.3g), lse diff %.3g", name,
           (long long)nonfinite, (long long)bad, dmax, lmax);
  printf("%s: %d query rows, %d rows per rank; max |o(DCP) - o(1 GPU)| = %.3g, lse %.3g%s\n", name, j.tq, j.m, dmax,
         lmax, !memcmp(j.got_o[0], j.single_o, no) ? " (bit-identical)" : "");
  for (int r = 0; r < W; r++) {
    free(j.got_o[r]);
    free(j.got_l[r]);
    free(j.local[r]);
  }
  free(j.single_o);
  free(j.single_l);
  free(j.gath_rows);
  free(j.whole_rows);
  free(j.table);
  free(j.r2t);
  free(j.slots);
  free(j.c);
  free(j.r);
  free(j.qn);
  free(j.qr);
}

int main(void) {
  rng.s = tu_seed("test_cuda_dcp_nccl", 20261201);
  cpu_refusals();
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_dcp_nccl: skipped: no GPU\n");
    return tu_finish("test_cuda_dcp_nccl");
  }
  /* NVLink multicast stays off on shared hosts unless the caller chose. */
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  int v = 0;
  ncclGetVersion(&v);
  printf("NCCL %d, %d GPU(s)\n", v, n);
  /* one rank (any machine with a GPU): the communicator checks and a world-1 merge */
  run_ranks(1, refusal_body, NULL);
  merge_case(1, MLA_DTYPE_F32, 0, 1);
  ext_case(1, 64, 16, MLA_DTYPE_BF16);
  if (n < 2) {
    printf("test_cuda_dcp_nccl: skipped: needs 2 GPUs (ran the one-rank cases)\n");
    return tu_finish("test_cuda_dcp_nccl");
  }
  run_ranks(2, refusal_body, NULL);
  merge_case(2, MLA_DTYPE_F32, 0, 1);
  merge_case(2, MLA_DTYPE_F16, 1, 1);
  merge_case(2, MLA_DTYPE_BF16, 0, 0);
  dcp_case(64, 16);
  dcp_case(128, 128);
  dcp_case(4, 16);
  ext_case(2, 64, 16, MLA_DTYPE_BF16);
  ext_case(2, 128, 128, MLA_DTYPE_BF16);
  ext_case(2, 16, 16, MLA_DTYPE_FP8_E4M3);
  ext_case(2, 4, 64, MLA_DTYPE_FP8_E4M3_BLOCK);
  return tu_finish("test_cuda_dcp_nccl");
}
#endif
