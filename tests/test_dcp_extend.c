/* EXTEND under decode context parallel, on the CPU (N shards in one
 * process, so CI tests the algorithm): every rank's share of a batch's keys
 * is written with mla_kv_cache_write_shard, packed with
 * mla_kv_cache_pack_rows into its block of a gathered cache (page size 1),
 * and an EXTEND step over the gathered cache with mla_dcp_gather_table's
 * table must equal the EXTEND step over one cache holding every key.
 *
 * Also: the gathered rows are byte-equal to the single cache's rows of the
 * same positions (for every cache format), the table's layout for any N
 * (3 and 5 included: the table does not need a power of two), rows past a
 * rank's count are never read (poisoned NaN), and the refusals of the three
 * calls (nothing written on refusal). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

static tu_rng rng;
static mla_ctx *cpu;

#define MAX_CTX 1400
#define BS 6
static const float SCALE = 0.0721687836f;

/* Local rows of rank r for a request of k keys. */
static int local_len(int k, int r, int n) { return k > r ? (k - r - 1) / n + 1 : 0; }

/* Every (request, position) maps into rank p mod N's block, in order. */
static void table_layout(int N) {
  char name[48];
  snprintf(name, sizeof name, "table N=%d", N);
  int32_t lens[5] = {0, 1, N + 1, 37, 4 * N};
  const int bs = 5, stride = 64, base = 3;
  int32_t *t = malloc(sizeof(int32_t) * bs * stride), m = -1;
  TU_STATUS(mla_dcp_gather_table(cpu, bs, lens, N, base, stride, t, &m), MLA_OK);
  int want_m = 0;
  for (int i = 0; i < bs; i++) want_m += local_len(lens[i], 0, N);
  TU_CHECK(m == want_m, "%s: rows_per_rank %d, expected %d", name, m, want_m);
  int32_t m2 = -1;
  TU_STATUS(mla_dcp_gather_table(cpu, bs, lens, N, base, 0, NULL, &m2), MLA_OK);
  TU_CHECK(m2 == m, "%s: size query %d vs %d", name, m2, m);
  int bad = 0, next[8];
  for (int r = 0; r < N; r++) next[r] = base + r * m;
  for (int i = 0; i < bs; i++)
    for (int p = 0; p < stride; p++) {
      const int32_t s = t[i * stride + p];
      if (p >= lens[i]) {
        bad += s != MLA_SLOT_UNUSED;
        continue;
      }
      bad += s != next[p % N]++;
    }
  for (int r = 0; r < N; r++) bad += next[r] > base + (r + 1) * m; /* no block overflows into the next */
  TU_CHECK(bad == 0, "%s: %d table entries off the layout", name, bad);
  free(t);
}

typedef struct world {
  int Pg, N, H;
  mla_dtype dt;
  mla_kv_cache *gc, *lc[8], *gath;
  mla_req_table *rt;
  int32_t ids[BS], seq[BS], ext[BS];
  int32_t *table, m;
  int tq;
} world;

static mla_kv_cache *make_cache(int pages, int page, mla_dtype dt) {
  const float scales[1] = {0.375f}; /* fp8_e4m3: a non-unit layer scale on every cache */
  mla_kv_cache_desc d = {1, pages, page, dt, dt == MLA_DTYPE_FP8_E4M3 ? scales : NULL};
  mla_kv_cache *c = NULL;
  TU_STATUS(mla_kv_cache_create(cpu, &d, &c), MLA_OK);
  if (c) tu_poison_cache(c);
  return c;
}

/* Rows of every position written to the single cache and (shard write) to
 * every rank's cache. */
static int build(world *w) {
  const int prefix[BS] = {0, 1, 300, 1000, 37, w->N - 1};
  const int extl[BS] = {5, 1, 40, 100, 1, 3};
  int pages = 4;
  for (int i = 0; i < BS; i++) pages += (prefix[i] + extl[i] + w->Pg - 1) / w->Pg + 1;
  w->gc = make_cache(pages, w->Pg, w->dt);
  for (int r = 0; r < w->N; r++) w->lc[r] = make_cache(pages, w->Pg / w->N, w->dt);
  mla_req_table_desc rd = {BS + 2, MAX_CTX, pages, w->Pg};
  TU_STATUS(mla_req_table_create(cpu, &rd, NULL, &w->rt), MLA_OK);
  if (!w->gc || !w->rt) return -1;
  w->tq = 0;
  for (int i = 0; i < BS; i++) {
    const int k = prefix[i] + extl[i];
    if (mla_req_add(w->rt, &w->ids[i]) != MLA_OK) return -1;
    int32_t *sl = malloc(sizeof(int32_t) * k);
    float *c = malloc(sizeof(float) * k * MLA_LATENT), *r = malloc(sizeof(float) * k * MLA_ROPE);
    TU_STATUS(mla_req_extend(w->rt, w->ids[i], k, sl), MLA_OK);
    tu_fill_bf16_normal(&rng, c, (int64_t)k * MLA_LATENT, 1.0);
    tu_fill_bf16_normal(&rng, r, (int64_t)k * MLA_ROPE, 1.0);
    TU_STATUS(mla_kv_cache_write(w->gc, 0, k, sl, c, r, MLA_DTYPE_F32), MLA_OK);
    for (int rk = 0; rk < w->N; rk++)
      TU_STATUS(mla_kv_cache_write_shard(w->lc[rk], 0, k, sl, c, r, MLA_DTYPE_F32, w->N, rk), MLA_OK);
    w->seq[i] = k;
    w->ext[i] = extl[i];
    w->tq += extl[i];
    free(sl);
    free(c);
    free(r);
  }
  return 0;
}

/* One EXTEND step: req_to_token [max_reqs, MAX_CTX], page P, cache c. */
static void extend_step(world *w, mla_kv_cache *c, int P, const int32_t *r2t, int max_reqs, const int32_t *ids,
                        const float *qn, const float *qr, float *o, float *l) {
  mla_step_desc d;
  memset(&d, 0, sizeof d);
  d.mode = MLA_MODE_EXTEND;
  d.batch_size = BS;
  d.max_kv_len = MAX_CTX;
  d.num_heads = w->H;
  d.page_size = P;
  d.num_sm = 5;
  d.num_tokens = w->tq;
  mla_step_inputs in = {r2t, MAX_CTX, max_reqs, ids, w->seq, w->ext};
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  void *ws = malloc(wsb);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = SCALE;
  a.act_dtype = MLA_DTYPE_F32;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = o;
  a.lse = l;
  TU_STATUS(mla_step_prepare(cpu, &d, c, &in, ws, wsb), MLA_OK);
  TU_STATUS(mla_step_attention(cpu, &d, c, 0, &a, ws, wsb), MLA_OK);
  free(ws);
}

static void extend_case(int Pg, int N, int H, mla_dtype dt) {
  char name[80];
  snprintf(name, sizeof name, "extend Pg=%d N=%d H=%d %s", Pg, N, H, mla_dtype_name(dt));
  world w;
  memset(&w, 0, sizeof w);
  w.Pg = Pg;
  w.N = N;
  w.H = H;
  w.dt = dt;
  if (build(&w) != 0) {
    TU_CHECK(0, "%s: setup failed", name);
    return;
  }
  const int32_t *r2t = NULL;
  mla_req_table_data(w.rt, &r2t);

  /* each rank's local slots in position order: its mla_dcp_plan */
  int32_t kv_indptr[BS + 1] = {0};
  for (int i = 0; i < BS; i++) kv_indptr[i + 1] = kv_indptr[i] + w.seq[i];
  int32_t *kv_indices = malloc(sizeof(int32_t) * kv_indptr[BS]);
  for (int i = 0; i < BS; i++) memcpy(kv_indices + kv_indptr[i], r2t + (size_t)w.ids[i] * MAX_CTX, sizeof(int32_t) * w.seq[i]);
  size_t pwb = 0;
  TU_STATUS(mla_dcp_plan_workspace_size(cpu, BS, kv_indptr[BS], &pwb), MLA_OK);
  void *pws = malloc(pwb);

  /* the gathered cache and its table */
  w.table = malloc(sizeof(int32_t) * BS * MAX_CTX);
  TU_STATUS(mla_dcp_gather_table(cpu, BS, w.seq, N, 1, MAX_CTX, w.table, &w.m), MLA_OK);
  w.gath = make_cache(1 + N * w.m, 1, dt);
  size_t rb = 0;
  mla_kv_cache_row_bytes(w.gc, &rb);
  for (int r = 0; r < N && w.gath; r++) {
    mla_dcp_plan plan;
    TU_STATUS(mla_dcp_plan_build(cpu, BS, w.seq, kv_indptr, kv_indices, r, N, pws, pwb, &plan), MLA_OK);
    TU_CHECK(plan.kv_indptr[BS] <= w.m, "%s: rank %d holds %d rows, block %d", name, r, plan.kv_indptr[BS], w.m);
    TU_STATUS(mla_kv_cache_pack_rows(w.lc[r], 0, plan.kv_indptr[BS], plan.kv_indices, w.gath, 0, 1 + r * w.m),
              MLA_OK);
  }
  if (!w.gath) goto done;

  /* every gathered row is the single cache's row of that position, byte for byte */
  {
    void *gd = NULL, *sd = NULL;
    mla_kv_cache_layer_data(w.gath, 0, &gd);
    mla_kv_cache_layer_data(w.gc, 0, &sd);
    int bad = 0;
    for (int i = 0; i < BS; i++)
      for (int p = 0; p < w.seq[i]; p++) {
        const int32_t gs = w.table[i * MAX_CTX + p], ss = r2t[(size_t)w.ids[i] * MAX_CTX + p];
        bad += memcmp((char *)gd + (size_t)gs * rb, (char *)sd + (size_t)ss * rb, rb) != 0;
      }
    TU_CHECK(bad == 0, "%s: %d gathered rows differ from the single cache's", name, bad);
  }

  /* EXTEND over the single cache vs over the gathered one */
  {
    const int64_t nq = (int64_t)w.tq * H;
    float *qn = malloc(sizeof(float) * nq * MLA_LATENT), *qr = malloc(sizeof(float) * nq * MLA_ROPE);
    float *o1 = malloc(sizeof(float) * nq * MLA_LATENT), *l1 = malloc(sizeof(float) * nq);
    float *o2 = malloc(sizeof(float) * nq * MLA_LATENT), *l2 = malloc(sizeof(float) * nq);
    tu_fill_bf16_normal(&rng, qn, nq * MLA_LATENT, 1.0);
    tu_fill_bf16_normal(&rng, qr, nq * MLA_ROPE, 1.0);
    tu_poison(o1, sizeof(float) * nq * MLA_LATENT);
    tu_poison(o2, sizeof(float) * nq * MLA_LATENT);
    extend_step(&w, w.gc, Pg, r2t, BS + 2, w.ids, qn, qr, o1, l1);
    int32_t gids[BS];
    for (int i = 0; i < BS; i++) gids[i] = i;
    extend_step(&w, w.gath, 1, w.table, BS, gids, qn, qr, o2, l2);
    double worst = 0, lworst = 0, mag = 0;
    int nonfinite = 0;
    for (int64_t k = 0; k < nq * MLA_LATENT; k++) {
      nonfinite += !isfinite(o1[k]) || !isfinite(o2[k]);
      const double e = fabs((double)o1[k] - o2[k]);
      if (!(e <= worst)) worst = e;
      if (fabs(o1[k]) > mag) mag = fabs(o1[k]);
    }
    for (int64_t k = 0; k < nq; k++) {
      const double e = fabs((double)l1[k] - l2[k]);
      if (!(e <= lworst)) lworst = e;
    }
    /* Same rows, same key order, same split schedule: the CPU kernels tile
     * keys by 64 whatever the page size, so the results agree bit for bit. */
    const int same = memcmp(o1, o2, sizeof(float) * nq * MLA_LATENT) == 0 && memcmp(l1, l2, sizeof(float) * nq) == 0;
    TU_CHECK(nonfinite == 0 && same,
             "%s: gathered vs single cache: %d non-finite, max |o| err %.3g (max |o| %.3g), lse err %.3g", name,
             nonfinite, worst, mag, lworst);
    printf("  %s: %d query rows, rows per rank %d, max |o| diff %.3g, lse diff %.3g\n", name, w.tq, w.m, worst,
           lworst);
    free(qn);
    free(qr);
    free(o1);
    free(l1);
    free(o2);
    free(l2);
  }
done:
  free(pws);
  free(kv_indices);
  free(w.table);
  for (int r = 0; r < N; r++) mla_kv_cache_destroy(w.lc[r]);
  mla_kv_cache_destroy(w.gath);
  mla_kv_cache_destroy(w.gc);
  mla_req_table_destroy(w.rt);
}

static void refusals(void) {
  int32_t lens[2] = {5, 3}, m = 0, t[2 * 8];
  TU_STATUS(mla_dcp_gather_table(NULL, 2, lens, 2, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 2, 1, 8, t, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, -1, lens, 2, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, NULL, 2, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 0, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 129, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 2, 0, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 2, 1, 0, t, &m), MLA_ERR_INVALID_ARGUMENT);
  tu_poison(t, sizeof t);
  TU_STATUS(mla_dcp_gather_table(cpu, 2, lens, 2, 1, 4, t, &m), MLA_ERR_OUT_OF_RANGE); /* 5 keys, 4 wide rows */
  int32_t neg[2] = {5, -1};
  TU_STATUS(mla_dcp_gather_table(cpu, 2, neg, 2, 1, 8, t, &m), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(tu_all_poisoned(t, sizeof t), "a refused gather_table wrote its table");
  int32_t huge[2] = {1 << 30, 1 << 30};
  TU_STATUS(mla_dcp_gather_table(cpu, 2, huge, 4, 1, 0, NULL, &m), MLA_ERR_OUT_OF_RANGE); /* past 2^31 slots */
  TU_STATUS(mla_dcp_gather_table(cpu, 0, NULL, 2, 1, 8, t, &m), MLA_OK);
  TU_CHECK(m == 0, "empty batch: rows_per_rank %d", m);

  /* pack_rows */
  const float sc[1] = {0.5f}, sc2[1] = {0.25f};
  mla_kv_cache_desc bd = {2, 8, 4, MLA_DTYPE_BF16, NULL}, fd = {1, 8, 4, MLA_DTYPE_FP8_E4M3, sc},
                    fd2 = {1, 8, 1, MLA_DTYPE_FP8_E4M3, sc2}, fd3 = {1, 8, 1, MLA_DTYPE_FP8_E4M3, sc};
  mla_kv_cache *a = NULL, *b = NULL, *f = NULL, *f2 = NULL, *f3 = NULL, *other = NULL;
  mla_ctx *cpu2 = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu2), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu, &bd, &a), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu, &bd, &b), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu, &fd, &f), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu, &fd2, &f2), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu, &fd3, &f3), MLA_OK);
  TU_STATUS(mla_kv_cache_create(cpu2, &bd, &other), MLA_OK);
  if (a && b && f && f2 && f3 && other) {
    tu_poison_cache(b);
    int32_t s[3] = {4, 5, 31};
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, NULL, 0, 4), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_pack_rows(NULL, 0, 3, s, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_pack_rows(a, 2, 3, s, b, 0, 4), MLA_ERR_OUT_OF_RANGE);
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, b, -1, 4), MLA_ERR_OUT_OF_RANGE);
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, -1, s, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, NULL, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, b, 0, 3), MLA_ERR_OUT_OF_RANGE);  /* touches page 0 */
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, b, 0, 30), MLA_ERR_OUT_OF_RANGE); /* past the end */
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, f, 0, 4), MLA_ERR_INVALID_ARGUMENT); /* dtype */
    TU_STATUS(mla_kv_cache_pack_rows(f, 0, 3, s, f2, 0, 4), MLA_ERR_INVALID_ARGUMENT); /* fp8 scales */
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, a, 0, 8), MLA_ERR_INVALID_ARGUMENT); /* same layer */
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, other, 0, 4), MLA_ERR_INVALID_ARGUMENT); /* two contexts */
    s[2] = 32;
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, b, 0, 4), MLA_ERR_OUT_OF_RANGE); /* a source slot */
    s[2] = -1;
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, b, 0, 4), MLA_ERR_OUT_OF_RANGE);
    TU_CHECK(strstr(mla_kv_cache_last_error(b), "src_slots") != NULL, "message: %s", mla_kv_cache_last_error(b));
    void *bdat = NULL;
    size_t rb = 0;
    mla_kv_cache_layer_data(b, 0, &bdat);
    mla_kv_cache_row_bytes(b, &rb);
    TU_CHECK(tu_all_poisoned(bdat, rb * 32), "a refused pack wrote the destination");
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 0, NULL, b, 0, 4), MLA_OK);
    /* accepted: another layer of the same cache, and equal fp8 scales across page sizes */
    s[2] = 6;
    TU_STATUS(mla_kv_cache_pack_rows(a, 0, 3, s, a, 1, 8), MLA_OK);
    TU_STATUS(mla_kv_cache_pack_rows(f, 0, 3, s, f3, 0, 1), MLA_OK);
  }
  /* the NCCL exchange has no CPU form */
  TU_STATUS(mla_dcp_gather_kv_nccl(cpu, (void *)1, 2, 0, a, 0, 0, NULL, 0, b, 0, 4), MLA_ERR_UNSUPPORTED);
  TU_STATUS(mla_dcp_gather_kv_nccl(cpu, (void *)1, 2, 2, a, 0, 0, NULL, 0, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_kv_nccl(cpu, (void *)1, 2, 0, a, 0, 3, NULL, 2, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_dcp_gather_kv_nccl(cpu, (void *)1, 2, 0, a, 0, 0, NULL, 20, b, 0, 4), MLA_ERR_OUT_OF_RANGE);
  TU_STATUS(mla_dcp_gather_kv_nccl(cpu, (void *)1, 2, 0, other, 0, 0, NULL, 0, b, 0, 4), MLA_ERR_INVALID_ARGUMENT);
  mla_kv_cache_destroy(a);
  mla_kv_cache_destroy(b);
  mla_kv_cache_destroy(f);
  mla_kv_cache_destroy(f2);
  mla_kv_cache_destroy(f3);
  mla_kv_cache_destroy(other);
  mla_ctx_destroy(cpu2);
}

int main(void) {
  rng.s = tu_seed("test_dcp_extend", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  if (mla_ctx_create(&cd, &cpu) != MLA_OK) {
    printf("cannot create a CPU context\n");
    return 1;
  }
  for (int n = 1; n <= 5; n++) table_layout(n);
  extend_case(64, 2, 16, MLA_DTYPE_BF16);
  extend_case(16, 4, 3, MLA_DTYPE_FP8_E4M3);
  extend_case(4, 2, 8, MLA_DTYPE_FP8_E4M3_BLOCK);
  extend_case(8, 8, 1, MLA_DTYPE_F16);
  extend_case(2, 2, 128, MLA_DTYPE_BF16);
  refusals();
  mla_ctx_destroy(cpu);
  return tu_finish("test_dcp_extend");
}
