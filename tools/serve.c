/* `mla demo`, part 2: the serving simulation (see serve.h).
 *
 * The model. A layer is DeepSeek's attention block (no q-LoRA, and no FFN:
 * the FFN never touches attention, and leaving it out keeps the run short):
 *   xn    = rmsnorm(x)                                   [T, D]
 *   q     = xn . Wq                 [T, H, 192] = q_nope 128 | q_pe 64 (RoPE)
 *   c     = rmsnorm((xn . Wkv_a)[:, :512])               [T, 512] latent
 *   r     = rope((xn . Wkv_a)[:, 512:])                  [T, 64]
 *   absorbed modes (decode, verify, prefix extend):
 *     q_abs = q_nope . W_UK[h]                           [T, H, 512]
 *     o_lat = attention(q_abs, q_pe; cached c, r)        [T, H, 512]
 *     o     = o_lat . W_UV[h]^T                          [T, H, 128]
 *   MHA modes (prefill; prefix extend when chunked):
 *     k = (c . W_UK[h]^T, r), v = c . W_UV[h]^T; o = attention(q, k, v)
 *   x    += o . Wo                                       [T, D]
 * W_UK and W_UV are the two halves of kv_b_proj [H, 256, 512], which the
 * backend also receives for chunked-prefix MHA. An embedding [V, D] and an
 * LM head [D, V] close the loop: each sequence's greedy next token is its
 * next input. Weights are random, rounded to the activation dtype (a bf16
 * model held in fp32 for the products).
 *
 * The serving loop, per step: admit arriving requests (a fresh one is
 * prefilled by EXTEND without prefix, ragged MHA; one that shares an earlier
 * request's prompt prefix is forked from it, mla_req_fork, and prefilled by
 * EXTEND with that prefix); one DECODE batch for the running requests; one
 * request in turn runs TARGET_VERIFY on draft tokens, and the rejected ones
 * are rolled back (mla_req_truncate); finished requests free their pages.
 * Every few steps a sampled layer's attention is compared with the float64
 * oracle (tests/ref) on the rows the cache holds, read back with
 * mla_kv_cache_read. Oracle time is kept out of the throughput figures.
 *
 * With --spec the decode batch and the single verifying request give way to
 * a speculative round for every running request (spec_round below): a
 * multi-step draft through the backend's draft steps with a one-layer draft
 * model, one TARGET_VERIFY batch of all requests, acceptance by comparing
 * drafts with the target's tokens, and rollback of the rest.
 *
 * With --dcp N (serve_run_dcp) there is no backend: the sim keeps its own
 * request table (global slots, page P * N, metadata only) and serve_dcp's N
 * rank threads, one per GPU, each hold a shard of the KV and run the
 * attention (forward_dcp below: DECODE as DCP steps merged over NCCL;
 * TARGET_VERIFY and EXTEND over a prefix as EXTEND over the KV pooled by an
 * NCCL all-gather; EXTEND without prefix as ragged MHA on rank 0). The
 * oracle checks read rows back from the shards. */
#include "serve.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "demo_util.h"
#include "ref.h"
#include "serve_dcp.h"
#include "serve_dev.h"
#include "serve_gemm.h"

#define L MLA_LATENT
#define R MLA_ROPE
#define NOPE 128         /* qk_nope_head_dim */
#define DQK (NOPE + R)   /* 192 */
#define DV 128           /* v_head_dim */
#define VOCAB 4096       /* embedding rows; only the loop's shape matters */
#define CHECK_HEADS 8    /* heads the oracle recomputes per check */
#define CHECK_QUERIES 8  /* last query rows per request the oracle recomputes */
#define MAX_BATCH 256    /* --max-batch limit (fixed-size arrays below) */
#define NBUCKETS 9       /* decode graph batch buckets: 1, 2, 4, ..., 256 */

typedef struct layer_w {
  float *wq;    /* [D, H*192] */
  float *wkva;  /* [D, 576] */
  float *kvb;   /* [H, 256, 512] kv_b_proj: rows 0..127 W_UK[h], 128..255 W_UV[h] */
  float *wukt;  /* [H, 512, 128] W_UK[h]^T (k_nope expansion) */
  float *wuvt;  /* [H, 512, 128] W_UV[h]^T (v expansion and o_lat -> o) */
  void *kvb_a;  /* [H, 256, 512] kv_b_proj in the activation dtype */
  float *wo;    /* [H*128, D] */
} layer_w;

enum { WAITING = 0, RUNNING = 1, DONE = 2 };

typedef struct sim_req {
  int arrival;   /* step it arrives at */
  int prompt;    /* prompt tokens (planned; a fork re-draws it) */
  int target;    /* tokens to generate */
  int state;
  int32_t id;    /* request-table id while running */
  int prefix;    /* shared prefix length */
  int len;       /* tokens in the request table (all have cache rows) */
  int generated;
  int32_t next;  /* sampled token, not yet fed */
  int admitted;  /* step of admission */
} sim_req;

typedef struct stats {
  double t_attn, t_check, t_total; /* ms; t_total excludes checks */
  int64_t tok_prefill, tok_decode, tok_verify, generated;
  int64_t drafts, accepted, rolled_back;
  int64_t tok_draft;      /* --spec: query rows through the draft model */
  int64_t first_ok;       /* --spec: rounds whose first draft was accepted */
  double t_draft;         /* --spec: ms in the draft passes (in t_total) */
  int forks, finished, verify_rounds;
  int checks, failed, attn_checks;
  double max_err, max_cos, max_lse; /* attention checks */
  double cache_err;                 /* cache rows read back vs written */
  int pages_peak, shared_peak;
  double t_replay;        /* CUDA: ms in decode steps replayed from graphs (upload, layers, download) */
  int replay_steps, graphs_captured;
  double t_dcp_decode;    /* --dcp: ms of attention in DECODE batches (draft steps included) */
  int dcp_decode_steps;
  int cow_checks;         /* --dcp: copy-on-write pages checked in the shards */
} stats;

typedef struct sim {
  const demo_opts *o;
  FILE *out;
  demo_rng g;
  int H, D, layers, P, ndt, N, max_batch, max_ctx, max_tokens, usable_pages;
  mla_dtype act;
  size_t es; /* bytes per activation element */
  double scale;
  mla_ctx *ctx;
  mla_backend *be;
  mla_req_table *rt;
  /* weights */
  layer_w *lw;
  float *embed; /* [V, D] */
  float *head;  /* [D, V] */
  float inv_freq[R / 2];
  /* activations, sized for max_tokens rows */
  float *x, *xn, *q, *kv; /* [T, D], [T, D], [T, H*192], [T, 576] */
  float *c, *r;           /* [T, 512], [T, 64] rounded to the act dtype */
  float *big;             /* [T, H, 512] per-head staging */
  float *oh;              /* [T, H*128] attention output per head, after W_UV */
  void *c_a, *r_a;        /* [T, 512], [T, 64] act: rows written to the cache */
  void *in_a;             /* [T, H, 512] act: q_abs, or q | k | v for MHA */
  void *qr_a;             /* [T, H, 64] act: q_pe (absorbed) */
  void *out_a;            /* [T, H, 512] act: attention output */
  float *lse;             /* [T, H] */
  float *logits;          /* [T, V] */
  /* requests and the current batch */
  sim_req *req;
  int32_t *ids, *seq, *pre; /* [max_batch] batch rows */
  int32_t *tok, *pos, *slots; /* [max_tokens] query rows */
  int *sample_rows;           /* [max_tokens] rows whose next token is sampled */
  int32_t *sampled;           /* [max_tokens] */
  int rr;                     /* round robin of the verifying request */
  /* --spec: multi-step draft through the backend's draft steps */
  int spec, ns;               /* on; draft tokens per round */
  int32_t *g_ids, *g_seq;     /* [max_batch] the backend's graph inputs (host memory: CPU context) */
  int32_t *committed;         /* [max_batch] request lengths before the round */
  int32_t *dslot;             /* [max_batch, ns+1] slots of positions committed .. committed+ns */
  int32_t *dtok;              /* [max_batch, ns] draft tokens */
  int32_t *vidx;              /* [max_batch] sim_req index of each round row */
  int32_t *qo, *kvl;          /* [max_batch+1], [max_batch] a draft step's rows, as the oracle sees them */
  int draft_rows;             /* > 0: the running pass is a device-built step (draft step, CUDA decode-type
                                 step or graph) of this many rows: no host plan; ids / qo / kvl describe it */
  int rows_causal;            /* that step's queries are causal (TARGET_VERIFY, DRAFT_EXTEND) */
  /* CUDA context: the projections stay on the host; the attention's inputs
   * and outputs go through these device buffers (fixed addresses, so decode
   * layers can be captured in CUDA graphs and replayed). */
  int cuda, graphs;
  void *stream;
  void *d_in, *d_qr, *d_c, *d_r, *d_out; /* as in_a, qr_a, c_a, r_a, out_a */
  float *d_lse;
  int32_t *d_slots;
  void **d_kvb;               /* [layers] kv_b_proj in the act dtype */
  void **gexec;               /* [layers * NBUCKETS] decode layer graphs per batch bucket */
  int bucket;                 /* > 0: this pass replays the decode graphs of a batch of this size */
  /* --dcp: no backend; the request table is the sim's own (global slots,
   * page P * dcp, metadata only: copy-on-write goes to the shards through
   * req_extend) and the attention is serve_dcp's ranks. */
  int dcp;                    /* ranks, 0 = off */
  sdcp *dc;
  int32_t *dext;              /* [max_batch] query tokens per batch row */
  mla_plan dplan;             /* the rows of a prefill batch, as check_mha reads them */
  stats st;
  /* the step's oracle check */
  int check_layer;            /* -1: none this step */
  int step_checks, step_failed;
  int last_checked;           /* layer of the last check */
} sim;

static int fail_status(sim *s, mla_status st, const char *what, const char *detail) {
  if (st == MLA_OK) return 0;
  fprintf(s->out, "error: %s: %s (%s)\n", what, mla_status_string(st), detail ? detail : "");
  return -1;
}
#define TRY(s, call, detail)                                                  \
  do {                                                                        \
    if (fail_status((s), (call), #call, (detail)) != 0) return -1;            \
  } while (0)

/* ---- model ---------------------------------------------------------------- */

/* n values uniform with standard deviation sigma, rounded to the act dtype. */
static void fill(sim *s, float *w, int64_t n, double sigma) {
  const double a = sqrt(3.0) * sigma;
  for (int64_t i = 0; i < n; i++) w[i] = (float)((2.0 * demo_rng_uniform(&s->g) - 1.0) * a);
  void *tmp = malloc((size_t)(n ? n : 1) * s->es);
  if (!tmp) return;
  mla_convert(w, MLA_DTYPE_F32, tmp, s->act, n);
  mla_convert(tmp, s->act, w, MLA_DTYPE_F32, n);
  free(tmp);
}

/* malloc that notes a failure in *oom (checked once after a group). */
static void *xmalloc(size_t bytes, int *oom) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) *oom = 1;
  return p;
}

static int model_init(sim *s) {
  const int H = s->H, D = s->D;
  int oom = 0;
  s->lw = calloc((size_t)s->layers, sizeof(layer_w));
  if (!s->lw) return -1;
  for (int l = 0; l < s->layers; l++) {
    layer_w *w = &s->lw[l];
    w->wq = xmalloc((size_t)D * H * DQK * sizeof(float), &oom);
    w->wkva = xmalloc((size_t)D * (L + R) * sizeof(float), &oom);
    w->kvb = xmalloc((size_t)H * (NOPE + DV) * L * sizeof(float), &oom);
    w->wukt = xmalloc((size_t)H * L * NOPE * sizeof(float), &oom);
    w->wuvt = xmalloc((size_t)H * L * DV * sizeof(float), &oom);
    w->kvb_a = xmalloc((size_t)H * (NOPE + DV) * L * s->es, &oom);
    w->wo = xmalloc((size_t)H * DV * D * sizeof(float), &oom);
    if (oom) return -1;
    /* Scales keep activations near unit size: q_abs . c then has the
     * spread of a real model's logits (std ~1.7 after the 192^-0.5 scale). */
    fill(s, w->wq, (int64_t)D * H * DQK, 1.0 / sqrt(D));
    fill(s, w->wkva, (int64_t)D * (L + R), 1.0 / sqrt(D));
    for (int h = 0; h < H; h++) {
      float *kh = w->kvb + (size_t)h * (NOPE + DV) * L;
      fill(s, kh, (int64_t)NOPE * L, 1.0 / sqrt(NOPE));
      fill(s, kh + (size_t)NOPE * L, (int64_t)DV * L, 1.0 / sqrt(L));
      for (int j = 0; j < NOPE; j++)
        for (int x = 0; x < L; x++) w->wukt[((size_t)h * L + x) * NOPE + j] = kh[(size_t)j * L + x];
      for (int j = 0; j < DV; j++)
        for (int x = 0; x < L; x++) w->wuvt[((size_t)h * L + x) * DV + j] = kh[(size_t)(NOPE + j) * L + x];
    }
    mla_convert(w->kvb, MLA_DTYPE_F32, w->kvb_a, s->act, (int64_t)H * (NOPE + DV) * L);
    fill(s, w->wo, (int64_t)H * DV * D, 1.0 / sqrt((double)H * DV));
  }
  s->embed = xmalloc((size_t)VOCAB * D * sizeof(float), &oom);
  s->head = xmalloc((size_t)D * VOCAB * sizeof(float), &oom);
  if (oom) return -1;
  fill(s, s->embed, (int64_t)VOCAB * D, 1.0);
  fill(s, s->head, (int64_t)D * VOCAB, 1.0 / sqrt(D));
  for (int i = 0; i < R / 2; i++) s->inv_freq[i] = (float)pow(10000.0, -2.0 * i / R);
  return 0;
}

static void model_free(sim *s) {
  for (int l = 0; s->lw && l < s->layers; l++) {
    layer_w *w = &s->lw[l];
    free(w->wq);
    free(w->wkva);
    free(w->kvb);
    free(w->wukt);
    free(w->wuvt);
    free(w->kvb_a);
    free(w->wo);
  }
  free(s->lw);
  free(s->embed);
  free(s->head);
}

static void rmsnorm(float *y /* [n] */, const float *x /* [n] */, int n) {
  double ss = 0;
  for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
  const float inv = (float)(1.0 / sqrt(ss / n + 1e-6));
  for (int i = 0; i < n; i++) y[i] = x[i] * inv;
}

/* Rotary embedding (rotate-half form) of one 64-wide vector, with the
 * position's cos/sin table cs [32], sn [32]. */
static void rope(float *v /* [64] */, const float *cs, const float *sn) {
  for (int i = 0; i < R / 2; i++) {
    const float x0 = v[i], x1 = v[i + R / 2];
    v[i] = x0 * cs[i] - x1 * sn[i];
    v[i + R / 2] = x0 * sn[i] + x1 * cs[i];
  }
}

/* ---- oracle checks ---------------------------------------------------------- */

/* Rows [r0, r0+m) x heads hs[0..nh) of an act tensor [rows, H, dim] as double
 * [m, nh, dim]. */
static void pick(const sim *s, const void *src, int dim, int r0, int m, const int *hs, int nh, double *dst) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < nh; j++)
      mla_convert((const char *)src + (((size_t)(r0 + i) * s->H + hs[j]) * dim) * s->es, s->act,
                  dst + ((size_t)i * nh + j) * dim, MLA_DTYPE_F64, dim);
}

static void pick_lse(const sim *s, int r0, int m, const int *hs, int nh, double *dst) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < nh; j++) dst[i * nh + j] = s->lse[(size_t)(r0 + i) * s->H + hs[j]];
}

/* Count one check; attention checks (not cache-row or page checks) also
 * feed the error maxima of the summary. */
static void record(sim *s, const demo_cmp *c, int attention) {
  s->st.checks++;
  s->step_checks++;
  if (!c->ok) {
    s->st.failed++;
    s->step_failed++;
  }
  if (!attention) return;
  s->st.attn_checks++;
  if (c->max_abs_err > s->st.max_err) s->st.max_err = c->max_abs_err;
  if (c->cos_dist > s->st.max_cos) s->st.max_cos = c->cos_dist;
  if (c->lse_err > s->st.max_lse) s->st.max_lse = c->lse_err;
}

typedef struct check_bufs {
  double *q, *qr, *k, *v, *c, *r, *w, *o, *lse, *got, *got_lse;
} check_bufs;

/* The GPU kernels round P to the 16-bit activation type before P V: an
 * output may move by up to u max_j |v_j| (demo_compare_p). 0 on the CPU,
 * whose kernels keep P in fp32. */
static double p_round(const sim *s, const double *v /* [n] */, int64_t n) {
  if (!(s->cuda || (s->dc && sdcp_on_gpu(s->dc))) || s->act == MLA_DTYPE_F32) return 0.0;
  double vmax = 0;
  for (int64_t i = 0; i < n; i++) vmax = fmax(vmax, fabs(v[i]));
  return (s->act == MLA_DTYPE_F16 ? 0x1p-11 : 0x1p-8) * vmax;
}

/* --dcp DECODE: each rank's partial output is rounded to the activation
 * type before the merge (mla_dcp_merge_nccl takes act-dtype states), so
 * the merged output moves by up to u max_k |o_k| <= u max_j |v_j| (u = 2^-8
 * bf16, 2^-11 f16): a merge of partials that nearly cancel keeps their
 * rounding error. Added to the absolute tolerance like p_round. 0 for the
 * pooled EXTEND (one state) and without --dcp. */
static double dcp_round(const sim *s, const double *v /* [n] */, int64_t n) {
  if (!s->dc || s->rows_causal || s->act == MLA_DTYPE_F32) return 0.0;
  double vmax = 0;
  for (int64_t i = 0; i < n; i++) vmax = fmax(vmax, fabs(v[i]));
  return (s->act == MLA_DTYPE_F16 ? 0x1p-11 : 0x1p-8) * vmax;
}

static void bufs_free(check_bufs *b) {
  free(b->q), free(b->qr), free(b->k), free(b->v), free(b->c), free(b->r), free(b->w);
  free(b->o), free(b->lse), free(b->got), free(b->got_lse);
}

/* Enough for one request: m query rows, K keys, nh heads. */
static int bufs_alloc(check_bufs *b, int m, int K, int nh) {
  memset(b, 0, sizeof *b);
  size_t qn = (size_t)m * nh, kn = (size_t)(K ? K : 1) * nh, d = sizeof(double);
  b->q = malloc(qn * L * d), b->qr = malloc(qn * R * d);
  b->k = malloc(kn * DQK * d), b->v = malloc(kn * DV * d);
  b->c = malloc((size_t)(K ? K : 1) * L * d), b->r = malloc((size_t)(K ? K : 1) * R * d);
  b->w = malloc((size_t)nh * (NOPE + DV) * L * d);
  b->o = malloc(qn * L * d), b->lse = malloc(qn * d), b->got = malloc(qn * L * d), b->got_lse = malloc(qn * d);
  return b->q && b->qr && b->k && b->v && b->c && b->r && b->w && b->o && b->lse && b->got && b->got_lse ? 0 : -1;
}

/* The rows this batch wrote to the cache, read back, against what was
 * written rounded the way the cache dtype stores it. */
static void check_cache_write(sim *s, int layer, int T) {
  mla_kv_cache *cache = NULL;
  if (!s->dc) mla_backend_cache(s->be, &cache);
  float *cf = malloc((size_t)T * L * sizeof(float)), *rf = malloc((size_t)T * R * sizeof(float));
  demo_cmp c;
  memset(&c, 0, sizeof c);
  const int read_ok = cf && rf &&
                      (s->dc     ? sdcp_read(s->dc, layer, T, s->slots, cf, rf) == 0 /* from the ranks' shards */
                       : s->cuda ? sdev_cache_read(cache, layer, T, s->slots, cf, rf) == 0
                                 : mla_kv_cache_read(cache, layer, T, s->slots, cf, rf, MLA_DTYPE_F32) == MLA_OK);
  if (read_ok) {
    const mla_dtype cd = s->o->cache_dtype;
    c.ok = 1;
    for (int t = 0; t < T; t++) {
      const float *want_c = s->c + (size_t)t * L, *want_r = s->r + (size_t)t * R;
      double amax = 0;
      for (int i = 0; i < L; i++) amax = fmax(amax, fabs(want_c[i]));
      for (int i = 0; i < L + R; i++) {
        const double x = i < L ? want_c[i] : want_r[i - L], got = i < L ? cf[(size_t)t * L + i] : rf[(size_t)t * R + i - L];
        double want, tol = 0;
        if (cd == MLA_DTYPE_F16) want = ref_round_f16(x);
        else if (cd == MLA_DTYPE_FP8_E4M3) want = ref_round_e4m3(x); /* c and r; per-layer scale 1 */
        else if (cd == MLA_DTYPE_FP8_E4M3_BLOCK && i < L) want = x, tol = 0.0625 * fabs(x) + amax / 448 * 0x1p-9;
        else want = ref_round_bf16(x); /* bf16 cache; the rope part of the block format */
        const double err = fabs(got - want);
        if (!(err <= tol)) c.ok = 0;
        if (err > c.max_abs_err) c.max_abs_err = err;
      }
    }
  }
  record(s, &c, 0);
  if (c.max_abs_err > s->st.cache_err) s->st.cache_err = c.max_abs_err;
  free(cf);
  free(rf);
}

/* The first len rows of request req in `layer` as the cache holds them, in
 * double: the backend's cache, or under --dcp the ranks' shards. */
static int read_request(sim *s, int layer, int32_t req, int len, double *c /* [len, 512] */,
                        double *r /* [len, 64] */) {
  if (!s->dc) return demo_read_request(s->be, layer, req, len, c, r);
  const int32_t *r2t = NULL;
  float *cf = malloc((size_t)(len ? len : 1) * L * sizeof(float)), *rf = malloc((size_t)(len ? len : 1) * R * sizeof(float));
  int rc = !cf || !rf || mla_req_table_data(s->rt, &r2t) != MLA_OK ||
           sdcp_read(s->dc, layer, len, r2t + (size_t)req * s->max_ctx, cf, rf) != 0;
  for (int64_t i = 0; !rc && i < (int64_t)len * L; i++) c[i] = cf[i];
  for (int64_t i = 0; !rc && i < (int64_t)len * R; i++) r[i] = rf[i];
  free(cf);
  free(rf);
  return rc ? -1 : 0;
}

/* Absorbed modes: per request, its last query rows and a spread of heads,
 * against ref_absorbed on the keys the cache holds. Rows i of the batch:
 * request req_ids[i], queries qo_indptr[i] .. qo_indptr[i+1], kv_lens[i] keys. */
static void check_absorbed(sim *s, int layer, int bs, const int32_t *req_ids /* [bs] */,
                           const int32_t *qo_indptr /* [bs+1] */, const int32_t *kv_lens /* [bs] */, int causal,
                           const int *hs, int nh) {
  for (int i = 0; i < bs; i++) {
    const int nq = qo_indptr[i + 1] - qo_indptr[i], kv = kv_lens[i];
    int m = nq < CHECK_QUERIES ? nq : CHECK_QUERIES;
    const int r0 = qo_indptr[i + 1] - m;
    check_bufs b;
    demo_cmp c;
    memset(&c, 0, sizeof c);
    if (bufs_alloc(&b, m, kv, nh) == 0 && read_request(s, layer, req_ids[i], kv, b.c, b.r) == 0) {
      pick(s, s->in_a, L, r0, m, hs, nh, b.q);
      pick(s, s->qr_a, R, r0, m, hs, nh, b.qr);
      /* m of the request's nq queries: bottom-right alignment makes the
       * mask of the last m rows the same as for all nq. */
      ref_absorbed(1, &m, &kv, nh, s->scale, causal, b.q, b.qr, b.c, b.r, b.o, b.lse);
      pick(s, s->out_a, L, r0, m, hs, nh, b.got);
      pick_lse(s, r0, m, hs, nh, b.got_lse);
      c = demo_compare_p(b.got, b.o, (int64_t)m * nh * L, s->act, b.got_lse, b.lse, (int64_t)m * nh, DEMO_LSE_ATOL,
                         p_round(s, b.c, (int64_t)kv * L) + dcp_round(s, b.c, (int64_t)kv * L));
    }
    record(s, &c, 1);
    bufs_free(&b);
  }
}

/* MHA modes: q, k, v as handed to the backend; with a prefix (chunked), the
 * prefix keys are the cached latent rows expanded with kv_b_proj. */
static void check_mha(sim *s, const mla_plan *p, int layer, int T, const int32_t *prefix, const int *hs,
                      int nh) {
  const char *in = s->in_a;
  const void *qa = in, *ka = in + (size_t)T * s->H * DQK * s->es, *va = in + (size_t)2 * T * s->H * DQK * s->es;
  for (int i = 0; i < p->batch_size; i++) {
    const int q0 = p->qo_indptr[i], E = p->qo_indptr[i + 1] - q0, P = prefix ? prefix[i] : 0;
    int K = P + E, m = E < CHECK_QUERIES ? E : CHECK_QUERIES;
    check_bufs b;
    demo_cmp c;
    memset(&c, 0, sizeof c);
    int ok = bufs_alloc(&b, m, K, nh) == 0;
    if (ok && P) {
      ok = read_request(s, layer, p->req_ids[i], P, b.c, b.r) == 0;
      for (int j = 0; ok && j < nh; j++)
        mla_convert((const char *)s->lw[layer].kvb_a + (size_t)hs[j] * (NOPE + DV) * L * s->es, s->act,
                    b.w + (size_t)j * (NOPE + DV) * L, MLA_DTYPE_F64, (int64_t)(NOPE + DV) * L);
      if (ok) demo_ref_expand(P, nh, NOPE, DV, s->act, b.c, b.r, b.w, b.k, b.v);
    }
    if (ok) {
      pick(s, ka, DQK, q0, E, hs, nh, b.k + (size_t)P * nh * DQK);
      pick(s, va, DV, q0, E, hs, nh, b.v + (size_t)P * nh * DV);
      pick(s, qa, DQK, q0 + E - m, m, hs, nh, b.q);
      ref_mha(1, &m, &K, nh, nh, DQK, DV, s->scale, 0.0, 1, b.q, b.k, b.v, b.o, b.lse);
      pick(s, s->out_a, DV, q0 + E - m, m, hs, nh, b.got);
      pick_lse(s, q0 + E - m, m, hs, nh, b.got_lse);
      c = demo_compare_p(b.got, b.o, (int64_t)m * nh * DV, s->act, b.got_lse, b.lse, (int64_t)m * nh,
                       P ? demo_lse_atol_expanded(s->act) : DEMO_LSE_ATOL, p_round(s, b.v, (int64_t)K * nh * DV));
    }
    record(s, &c, 1);
    bufs_free(&b);
  }
}

static void check_layer(sim *s, int layer, int T, int mha, const int32_t *prefix) {
  double t0 = demo_now_ms();
  s->last_checked = layer;
  /* A draft step has no host plan (its metadata is a device-built step):
   * its rows are the ones the sim handed over (qo, kvl, ids). */
  const mla_plan *p = s->dc ? &s->dplan : NULL; /* --dcp: no backend plan; the sim's rows */
  if (!s->dc && !s->draft_rows && mla_backend_get_plan(s->be, &p) != MLA_OK) return;
  int hs[CHECK_HEADS], nh = s->H < CHECK_HEADS ? s->H : CHECK_HEADS;
  const int off = demo_rng_int(&s->g, 0, s->H - 1);
  for (int j = 0; j < nh; j++) hs[j] = (off + j * s->H / nh) % s->H;
  check_cache_write(s, layer, T);
  if (s->draft_rows) check_absorbed(s, layer, s->draft_rows, s->ids, s->qo, s->kvl, s->rows_causal, hs, nh);
  else if (mha) check_mha(s, p, layer, T, prefix, hs, nh);
  else check_absorbed(s, layer, p->batch_size, p->req_ids, p->qo_indptr, p->kv_lens, p->causal, hs, nh);
  s->st.t_check += demo_now_ms() - t0;
}

/* The attention checks take the projections' results as given, so check
 * serve_gemm itself once, against a double loop, on an awkward shape: ragged
 * row and column edges, K past one block, several strided products,
 * accumulation. Returns the worst error relative to sum |a b|. */
static double check_gemm(sim *s) {
  enum { COUNT = 3, M = 5, N = 70, K = 300, LDA = K + 3, LDB = N + 5, LDC = N + 2 };
  const int64_t sa = (int64_t)M * LDA, sb = (int64_t)K * LDB, sc = (int64_t)M * LDC;
  float *a = malloc(COUNT * sa * sizeof(float)), *b = malloc(COUNT * sb * sizeof(float));
  float *c = malloc(COUNT * sc * sizeof(float)), *c0 = malloc(COUNT * sc * sizeof(float));
  double worst = a && b && c && c0 ? 0 : INFINITY;
  if (worst == 0) {
    for (int64_t i = 0; i < COUNT * sa; i++) a[i] = (float)(2 * demo_rng_uniform(&s->g) - 1);
    for (int64_t i = 0; i < COUNT * sb; i++) b[i] = (float)(2 * demo_rng_uniform(&s->g) - 1);
    for (int64_t i = 0; i < COUNT * sc; i++) c[i] = c0[i] = (float)(2 * demo_rng_uniform(&s->g) - 1);
    serve_gemm(COUNT, M, N, K, a, LDA, sa, b, LDB, sb, c, LDC, sc, 1);
    for (int p = 0; p < COUNT; p++)
      for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
          double ref = c0[p * sc + i * LDC + j], mag = fabs(ref);
          for (int k = 0; k < K; k++) {
            const double x = (double)a[p * sa + i * LDA + k] * b[p * sb + k * LDB + j];
            ref += x;
            mag += fabs(x);
          }
          const double err = fabs(c[p * sc + i * LDC + j] - ref) / mag;
          if (!(err <= worst)) worst = err; /* NaN too */
        }
  }
  free(a), free(b), free(c), free(c0);
  demo_cmp r;
  memset(&r, 0, sizeof r);
  r.ok = worst <= 1e-5; /* fp32 sums of 300 terms: ~1e-7 */
  record(s, &r, 0);
  return worst;
}

/* ---- one forward pass of a batch through the stack -------------------------- */

/* Projections in front of attention for layer l: fills c/r (and c_a/r_a),
 * and q with RoPE applied. */
static void project_in(sim *s, int l, int T) {
  const layer_w *w = &s->lw[l];
  const int H = s->H, D = s->D;
  for (int t = 0; t < T; t++) rmsnorm(s->xn + (size_t)t * D, s->x + (size_t)t * D, D);
  serve_gemm(1, T, H * DQK, D, s->xn, D, 0, w->wq, H * DQK, 0, s->q, H * DQK, 0, 0);
  serve_gemm(1, T, L + R, D, s->xn, D, 0, w->wkva, L + R, 0, s->kv, L + R, 0, 0);
  for (int t = 0; t < T; t++) {
    float cs[R / 2], sn[R / 2];
    for (int i = 0; i < R / 2; i++) {
      const double a = s->pos[t] * (double)s->inv_freq[i];
      cs[i] = (float)cos(a);
      sn[i] = (float)sin(a);
    }
    rmsnorm(s->c + (size_t)t * L, s->kv + (size_t)t * (L + R), L);
    memcpy(s->r + (size_t)t * R, s->kv + (size_t)t * (L + R) + L, R * sizeof(float));
    rope(s->r + (size_t)t * R, cs, sn);
    for (int h = 0; h < H; h++) rope(s->q + ((size_t)t * H + h) * DQK + NOPE, cs, sn);
  }
  /* The latent as the engine holds it (act dtype) feeds both the cache and
   * the MHA expansion, so the two paths agree. */
  mla_convert(s->c, MLA_DTYPE_F32, s->c_a, s->act, (int64_t)T * L);
  mla_convert(s->c_a, s->act, s->c, MLA_DTYPE_F32, (int64_t)T * L);
  mla_convert(s->r, MLA_DTYPE_F32, s->r_a, s->act, (int64_t)T * R);
  mla_convert(s->r_a, s->act, s->r, MLA_DTYPE_F32, (int64_t)T * R);
}

/* MHA inputs in in_a: q [T, H, 192] | k [T, H, 192] | v [T, H, 128]. */
static void mha_inputs(sim *s, int l, int T) {
  const layer_w *w = &s->lw[l];
  const int H = s->H;
  const int64_t n = (int64_t)T * H;
  float *kn = s->big, *v = s->big + n * NOPE, *k = s->big + 2 * n * NOPE; /* 128 + 128 + 192 <= 512 */
  serve_gemm(H, T, NOPE, L, s->c, L, 0, w->wukt, NOPE, (int64_t)L * NOPE, kn, (int64_t)H * NOPE, NOPE, 0);
  serve_gemm(H, T, DV, L, s->c, L, 0, w->wuvt, DV, (int64_t)L * DV, v, (int64_t)H * DV, DV, 0);
  for (int64_t i = 0; i < n; i++) {
    memcpy(k + i * DQK, kn + i * NOPE, NOPE * sizeof(float));
    memcpy(k + i * DQK + NOPE, s->r + (i / H) * R, R * sizeof(float));
  }
  char *in = s->in_a;
  mla_convert(s->q, MLA_DTYPE_F32, in, s->act, n * DQK);
  mla_convert(k, MLA_DTYPE_F32, in + (size_t)n * DQK * s->es, s->act, n * DQK);
  mla_convert(v, MLA_DTYPE_F32, in + (size_t)2 * n * DQK * s->es, s->act, n * DV);
}

/* Absorbed inputs: q_abs [T, H, 512] in in_a, q_pe [T, H, 64] in qr_a. */
static void absorbed_inputs(sim *s, int l, int T) {
  const layer_w *w = &s->lw[l];
  const int H = s->H;
  const int64_t n = (int64_t)T * H;
  serve_gemm(H, T, L, NOPE, s->q, (int64_t)H * DQK, DQK, w->kvb, L, (int64_t)(NOPE + DV) * L, s->big,
             (int64_t)H * L, L, 0);
  mla_convert(s->big, MLA_DTYPE_F32, s->in_a, s->act, n * L);
  for (int64_t i = 0; i < n; i++) memcpy(s->big + i * R, s->q + i * DQK + NOPE, R * sizeof(float));
  mla_convert(s->big, MLA_DTYPE_F32, s->qr_a, s->act, n * R);
}

/* Attention output -> oh [T, H*128] -> x += oh . Wo. */
static void project_out(sim *s, int l, int T, int mha) {
  const layer_w *w = &s->lw[l];
  const int H = s->H;
  if (mha) {
    mla_convert(s->out_a, s->act, s->oh, MLA_DTYPE_F32, (int64_t)T * H * DV);
  } else {
    mla_convert(s->out_a, s->act, s->big, MLA_DTYPE_F32, (int64_t)T * H * L);
    serve_gemm(H, T, DV, L, s->big, (int64_t)H * L, L, w->wuvt, DV, (int64_t)L * DV, s->oh, (int64_t)H * DV, DV, 0);
  }
  serve_gemm(1, T, s->D, H * DV, s->oh, (int64_t)H * DV, 0, w->wo, s->D, 0, s->x, s->D, 0, 1);
}

/* Greedy next token of the n rows listed in sample_rows, into sampled[]. */
static void sample(sim *s, int n) {
  const int D = s->D;
  for (int i = 0; i < n; i++) rmsnorm(s->xn + (size_t)i * D, s->x + (size_t)s->sample_rows[i] * D, D);
  serve_gemm(1, n, VOCAB, D, s->xn, D, 0, s->head, VOCAB, 0, s->logits, VOCAB, 0, 0);
  for (int i = 0; i < n; i++) {
    const float *lg = s->logits + (size_t)i * VOCAB;
    int best = 0;
    for (int v = 1; v < VOCAB; v++)
      if (lg[v] > lg[best]) best = v;
    s->sampled[i] = best;
  }
}

/* The query side of a layer's forward args from one input buffer of n =
 * T * H rows: absorbed, q_nope = in [T, H, 512] (+ q_rope); MHA, q | k | v =
 * in [T, H, 192] | [T, H, 192] | [T, H, 128] (+ kv_b_proj for a prefix). */
static void set_queries(mla_forward_args *a, int mha, const char *in, size_t n, size_t es, const void *q_rope,
                        const void *kv_b_proj) {
  if (mha) {
    a->q = in;
    a->k = in + n * DQK * es;
    a->v = in + 2 * n * DQK * es;
    a->kv_b_proj = kv_b_proj;
  } else {
    a->q_nope = in;
    a->q_rope = q_rope;
  }
}

static mla_status dev_fail(sim *s, const char *what) {
  fprintf(s->out, "error: %s failed\n", what);
  return MLA_ERR_DEVICE;
}

/* CUDA: one layer's attention with the inputs of a (host pointers, as the
 * CPU path takes them) moved to the device buffers and the outputs moved
 * back. In a decode pass with graphs (s->bucket > 0) the layer is a graph
 * per batch bucket, captured the first time (layer 0's holds the metadata
 * update, mla_backend_graph_step) and replayed after the engine-side inputs
 * (ids and lengths: decode()) and this layer's rows are in place; rows past
 * the real batch are padding (request MLA_REQ_PAD, new row at slot 0, the
 * reserved page). */
static mla_status forward_cuda(sim *s, const mla_forward_args *h, int T, int mha) {
  const double t0 = demo_now_ms();
  const size_t es = s->es, n = (size_t)T * s->H;
  const int B = s->bucket > 0 ? s->bucket : T;
  int e = 0;
  /* in_a holds q_nope [T, H, 512], or q | k | v ([T, H, 192], [T, H, 192], [T, H, 128]): 512 per head either way */
  e |= sdev_put(s->stream, s->d_in, s->in_a, n * L * es);
  if (!mha) e |= sdev_put(s->stream, s->d_qr, s->qr_a, n * R * es);
  e |= sdev_put(s->stream, s->d_c, s->c_a, (size_t)T * L * es);
  e |= sdev_put(s->stream, s->d_r, s->r_a, (size_t)T * R * es);
  for (int t = T; t < B; t++) s->slots[t] = 0;
  e |= sdev_put(s->stream, s->d_slots, s->slots, sizeof(int32_t) * (size_t)B);
  if (e) return dev_fail(s, "device upload");
  mla_forward_args a = *h;
  const char *in = s->d_in;
  a.num_new = B;
  a.new_slots = s->d_slots;
  a.new_c = s->d_c;
  a.new_r = s->d_r;
  set_queries(&a, mha, in, n, es, s->d_qr, s->d_kvb[h->layer]);
  a.out = s->d_out;
  a.lse = s->d_lse;
  mla_status st = MLA_OK;
  if (s->bucket > 0) {
    int bi = 0;
    while ((1 << bi) < B) bi++;
    void **g = &s->gexec[(size_t)h->layer * NBUCKETS + bi];
    if (!*g) {
      const char *why = "";
      if (sdev_capture_begin(s->stream)) return dev_fail(s, "cudaStreamBeginCapture");
      if (h->layer == 0) st = mla_backend_graph_step(s->be, MLA_MODE_DECODE, B, 0);
      if (st == MLA_OK) st = mla_backend_forward(s->be, &a);
      if (sdev_capture_end(s->stream, g, &why) && st == MLA_OK) {
        fprintf(s->out, "error: CUDA graph capture of layer %d, batch %d: %s\n", h->layer, B, why);
        return MLA_ERR_DEVICE;
      }
      if (st != MLA_OK) return st;
      s->st.graphs_captured++;
    }
    if (sdev_launch(s->stream, *g)) return dev_fail(s, "cudaGraphLaunch");
  } else {
    st = mla_backend_forward(s->be, &a);
    if (st != MLA_OK) return st;
  }
  if (sdev_get(s->stream, s->out_a, s->d_out, n * (mha ? DV : L) * es) ||
      sdev_get(s->stream, s->lse, s->d_lse, n * sizeof(float)))
    return dev_fail(s, "device download");
  if (s->bucket > 0) s->st.t_replay += demo_now_ms() - t0;
  st = mla_ctx_synchronize(s->ctx); /* rows the device found out of range, kernel errors */
  if (st != MLA_OK) fprintf(s->out, "error: %s\n", mla_ctx_last_error(s->ctx));
  return st;
}

/* Run T query rows (tok, pos, slots filled) through the first n_layers
 * layers of the planned step, then sample n_sample rows; ta: ms spent in the
 * library so far this pass. */
static int run_layers(sim *s, int T, int mha, const int32_t *prefix, int n_sample, int n_layers, double ta) {
  for (int t = 0; t < T; t++) memcpy(s->x + (size_t)t * s->D, s->embed + (size_t)s->tok[t] * s->D, s->D * sizeof(float));
  for (int l = 0; l < n_layers; l++) {
    project_in(s, l, T);
    if (mha) mha_inputs(s, l, T);
    else absorbed_inputs(s, l, T);
    const int64_t n = (int64_t)T * s->H;
    const char *in = s->in_a;
    mla_forward_args a;
    memset(&a, 0, sizeof a);
    a.layer = l;
    a.num_new = T;
    a.new_slots = s->slots;
    a.new_c = s->c_a;
    a.new_r = s->r_a;
    set_queries(&a, mha, in, (size_t)n, s->es, s->qr_a, s->lw[l].kvb_a);
    a.out = s->out_a;
    a.lse = s->lse;
    const double t1 = demo_now_ms();
    if (s->dc) { /* the ranks: new rows to the shards, then this batch kind's attention (serve_dcp.h) */
      const int rc = sdcp_layer(s->dc, l, T, s->slots, s->c_a, s->r_a, s->in_a, s->qr_a, s->out_a, s->lse);
      ta += demo_now_ms() - t1;
      if (rc) {
        fprintf(s->out, "error: --dcp layer %d: %s\n", l, sdcp_error(s->dc));
        return -1;
      }
    } else {
      mla_status st = s->cuda ? forward_cuda(s, &a, T, mha) : mla_backend_forward(s->be, &a);
      ta += demo_now_ms() - t1;
      TRY(s, st, mla_backend_last_error(s->be));
    }
    if (l == s->check_layer) check_layer(s, l, T, mha, prefix);
    project_out(s, l, T, mha);
  }
  sample(s, n_sample);
  s->st.t_attn += ta;
  return 0;
}

/* --dcp: batch b through the ranks (serve_dcp.h). DECODE runs as DCP
 * steps with the NCCL merge. TARGET_VERIFY, which the DCP step does not
 * take (DECODE only), runs as what it is: an EXTEND of ndt tokens per
 * request over the committed prefix (extend_lens = ndt, kv = seq_len + ndt),
 * on the KV the ranks pool with mla_dcp_gather_kv_nccl; EXTEND over a prefix
 * likewise (always absorbed under --dcp). EXTEND without prefix is the
 * ragged MHA over the new tokens (no cache read) on rank 0. The oracle
 * checks see the rows through ids / qo / kvl (absorbed) or dplan (MHA). */
static int forward_dcp(sim *s, const mla_batch *b, int T, const int32_t *prefix, int n_sample) {
  const double t0 = demo_now_ms();
  const int bs = b->batch_size, verify = b->mode == MLA_MODE_TARGET_VERIFY, decode = b->mode == MLA_MODE_DECODE;
  const int mha = b->mode == MLA_MODE_EXTEND && !prefix;
  s->qo[0] = 0;
  for (int i = 0; i < bs; i++) {
    s->dext[i] = decode ? 1 : verify ? b->num_draft_tokens : b->seq_lens[i] - (prefix ? prefix[i] : 0);
    s->kvl[i] = b->seq_lens[i] + (verify ? b->num_draft_tokens : 0);
    s->qo[i + 1] = s->qo[i] + s->dext[i];
  }
  if (s->qo[bs] != T || b->req_ids != s->ids) {
    fprintf(s->out, "error: --dcp: a batch of %d query rows with %d planned\n", T, s->qo[bs]);
    return -1;
  }
  const int32_t *r2t = NULL;
  mla_req_table_data(s->rt, &r2t);
  if (sdcp_batch(s->dc, decode ? SDCP_DECODE : mha ? SDCP_PREFILL : SDCP_EXTEND, bs, s->ids, s->kvl, s->dext, r2t)) {
    fprintf(s->out, "error: --dcp: %s\n", sdcp_error(s->dc));
    return -1;
  }
  if (mha) {
    memset(&s->dplan, 0, sizeof s->dplan);
    s->dplan.batch_size = bs;
    s->dplan.req_ids = s->ids;
    s->dplan.qo_indptr = s->qo;
  } else {
    s->draft_rows = bs;
    s->rows_causal = !decode;
  }
  const double attn0 = s->st.t_attn;
  const int rc = run_layers(s, T, mha, prefix, n_sample, s->layers, demo_now_ms() - t0);
  if (decode) {
    s->st.t_dcp_decode += s->st.t_attn - attn0;
    s->st.dcp_decode_steps++;
  }
  s->draft_rows = 0;
  s->rows_causal = 0;
  return rc;
}

/* Plan batch b (T query rows: tok, pos, slots filled) and run it through
 * every layer, then sample n_sample rows. prefix: EXTEND prefix lengths (for
 * the chunked check), or NULL. */
static int forward(sim *s, const mla_batch *b, int T, const int32_t *prefix, int n_sample) {
  if (s->dc) return forward_dcp(s, b, T, prefix, n_sample);
  double t0 = demo_now_ms();
  TRY(s, mla_backend_plan(s->be, b), mla_backend_last_error(s->be));
  int mha = 0;
  TRY(s, mla_backend_uses_mha(s->be, &mha), "");
  const mla_plan *p = NULL;
  if (s->cuda && mla_backend_get_plan(s->be, &p) != MLA_OK) {
    /* A decode-type batch on CUDA is a device-built step (no host plan):
     * the rows as the oracle checks see them, from the batch itself. */
    const int q = b->mode == MLA_MODE_DECODE ? 1 : b->num_draft_tokens;
    for (int i = 0; i < b->batch_size; i++) {
      s->qo[i] = i * q;
      s->kvl[i] = b->seq_lens[i] + (b->mode == MLA_MODE_TARGET_VERIFY ? q : 0);
    }
    s->qo[b->batch_size] = b->batch_size * q;
    s->draft_rows = b->batch_size;
    s->rows_causal = b->mode != MLA_MODE_DECODE;
  }
  const int rc = run_layers(s, T, mha, prefix, n_sample, s->layers, demo_now_ms() - t0);
  s->draft_rows = 0;
  s->rows_causal = 0;
  return rc;
}

/* ---- the serving loop ------------------------------------------------------- */

/* mla_req_extend. Under --dcp the table is metadata only: when the extend
 * made a private copy of a shared partial last page (copy-on-write), the
 * rows it holds are copied in the ranks' shards too (page ids are the same
 * on every rank). */
static mla_status req_extend(sim *s, int32_t id, int n, int32_t *slots_out /* [n] or NULL */) {
  if (!s->dc) return mla_req_extend(s->rt, id, n, slots_out);
  const int PN = s->P * s->dcp;
  const int32_t *r2t = NULL;
  int len = 0;
  if (mla_req_table_data(s->rt, &r2t) != MLA_OK || mla_req_length(s->rt, id, &len) != MLA_OK)
    return mla_req_extend(s->rt, id, n, slots_out); /* reports the bad id */
  const int32_t *row = r2t + (size_t)id * s->max_ctx;
  const int32_t old = len % PN ? row[len - 1] / PN : -1;
  mla_status st = mla_req_extend(s->rt, id, n, slots_out);
  if (st != MLA_OK || old < 0 || row[len - 1] / PN == old) return st;
  const int used = len % PN, fresh = row[len - 1] / PN;
  int32_t src[MLA_MAX_PAGE_SIZE], dst[MLA_MAX_PAGE_SIZE];
  for (int j = 0; j < used; j++) src[j] = old * PN + j, dst[j] = fresh * PN + j;
  if (sdcp_copy(s->dc, used, src, dst)) {
    fprintf(s->out, "error: --dcp: copy-on-write of page %d: %s\n", (int)old, sdcp_error(s->dc));
    return MLA_ERR_DEVICE;
  }
  /* The copies hold the originals' rows (a missed copy would go unseen by
   * the attention checks, which read the same rows the kernels do): the
   * first and last layer, read back from the shards. */
  const double t0 = demo_now_ms();
  float *a = malloc(sizeof(float) * (size_t)used * (L + R) * 2);
  demo_cmp c;
  memset(&c, 0, sizeof c);
  for (int l = 0, k = 0; a && k < 2; k++, l = s->layers - 1) {
    float *ac = a, *ar = a + (size_t)used * L, *bc = ar + (size_t)used * R, *br = bc + (size_t)used * L;
    c.ok = sdcp_read(s->dc, l, used, src, ac, ar) == 0 && sdcp_read(s->dc, l, used, dst, bc, br) == 0 &&
           !memcmp(ac, bc, sizeof(float) * (size_t)used * L) && !memcmp(ar, br, sizeof(float) * (size_t)used * R);
    if (!c.ok) break;
  }
  free(a);
  s->st.checks++; /* in the summary's count; in the step's line only when it fails */
  if (!c.ok) s->st.failed++, s->step_checks++, s->step_failed++;
  s->st.cow_checks++;
  s->st.t_check += demo_now_ms() - t0;
  return MLA_OK;
}

/* Pages held by requests now (and how many of them are shared by several
 * requests), folded into the peaks. */
static int pages_in_use(sim *s, int *shared) {
  int free_pages = 0, refs = 0;
  mla_req_table_free_pages(s->rt, &free_pages);
  *shared = 0;
  for (int p = 1; p <= s->usable_pages; p++)
    if (mla_req_table_page_refs(s->rt, p, &refs) == MLA_OK && refs > 1) (*shared)++;
  const int used = s->usable_pages - free_pages;
  if (used > s->st.pages_peak) s->st.pages_peak = used;
  if (*shared > s->st.shared_peak) s->st.shared_peak = *shared;
  return used;
}

/* Admit arrived requests (first come, first served) while the batch, the
 * step's prefill budget and the page pool allow, and prefill them: fresh
 * ones in one EXTEND without prefix, forked ones in one EXTEND with prefix. */
static int admit_and_prefill(sim *s, int step, int *n_new, int *n_fork) {
  int running = 0, used = 0;
  for (int i = 0; i < s->N; i++) running += s->req[i].state == RUNNING;
  /* Admitted requests by kind, and where each one's new slots start in
   * all_slots (mla_req_extend writes them in admission order). */
  int list[2][MAX_BATCH], at[2][MAX_BATCH], n[2] = {0, 0};
  int32_t *all_slots = malloc((size_t)s->max_tokens * sizeof(int32_t));
  if (!all_slots) return -1;
  for (int i = 0; i < s->N && running < s->max_batch; i++) {
    sim_req *q = &s->req[i];
    if (q->state != WAITING) continue;
    if (q->arrival > step) break;
    /* Share a prompt prefix with a request that is already prefilled? */
    int parent = -1, cand[MAX_BATCH], nc = 0;
    if (demo_rng_uniform(&s->g) < 0.4)
      for (int j = 0; j < s->N; j++)
        if (s->req[j].state == RUNNING && s->req[j].admitted < step) cand[nc++] = j;
    if (nc) parent = cand[demo_rng_int(&s->g, 0, nc - 1)];
    int prefix = 0, fresh_tokens = q->prompt;
    if (parent >= 0) { /* a shared "system prompt", then a question of its own */
      const int pp = s->req[parent].prompt;
      prefix = demo_rng_int(&s->g, (pp + 1) / 2, pp);
      const int room = s->o->max_prompt - prefix, cap = s->o->max_prompt / 2, hi = room < cap ? room : cap;
      fresh_tokens = demo_rng_int(&s->g, 1, hi > 1 ? hi : 1);
    }
    if (used + fresh_tokens > s->max_tokens) break;
    mla_status st = parent >= 0 ? mla_req_fork(s->rt, s->req[parent].id, prefix, &q->id) : mla_req_add(s->rt, &q->id);
    if (fail_status(s, st, parent >= 0 ? "mla_req_fork" : "mla_req_add", mla_req_table_last_error(s->rt))) {
      free(all_slots);
      return -1;
    }
    st = req_extend(s, q->id, fresh_tokens, all_slots + used);
    if (st != MLA_OK) {
      mla_req_free(s->rt, q->id);
      if (st == MLA_ERR_CACHE_FULL) break; /* wait for pages to come back */
      fail_status(s, st, "mla_req_extend", mla_req_table_last_error(s->rt));
      free(all_slots);
      return -1;
    }
    const int kind = parent >= 0;
    list[kind][n[kind]] = i;
    at[kind][n[kind]++] = used;
    q->prefix = prefix;
    q->prompt = q->len = prefix + fresh_tokens;
    q->state = RUNNING;
    q->admitted = step;
    used += fresh_tokens;
    running++;
  }
  *n_new = n[0] + n[1];
  *n_fork = n[1];
  int rc = 0;
  for (int kind = 0; kind < 2 && rc == 0; kind++) {
    if (!n[kind]) continue;
    int T = 0;
    for (int b = 0; b < n[kind]; b++) {
      sim_req *q = &s->req[list[kind][b]];
      const int E = q->prompt - q->prefix;
      s->ids[b] = q->id;
      s->seq[b] = q->len;
      s->pre[b] = q->prefix;
      memcpy(s->slots + T, all_slots + at[kind][b], (size_t)E * sizeof(int32_t));
      for (int t = 0; t < E; t++) {
        s->tok[T + t] = demo_rng_int(&s->g, 0, VOCAB - 1); /* the prompt's tokens */
        s->pos[T + t] = q->prefix + t;
      }
      T += E;
      s->sample_rows[b] = T - 1;
    }
    mla_batch bt = {MLA_MODE_EXTEND, n[kind], s->ids, s->seq, NULL, kind ? s->pre : NULL, 0};
    /* Prefix sharing is the rarest path: check every such batch. */
    const int sched = s->check_layer;
    if (kind && sched < 0) s->check_layer = demo_rng_int(&s->g, 0, s->layers - 1);
    rc = forward(s, &bt, T, kind ? s->pre : NULL, n[kind]);
    s->check_layer = sched;
    for (int b = 0; rc == 0 && b < n[kind]; b++) {
      s->req[list[kind][b]].next = s->sampled[b];
      s->req[list[kind][b]].generated = 1;
    }
    s->st.tok_prefill += T;
    s->st.generated += n[kind];
  }
  s->st.forks += n[1];
  free(all_slots);
  return rc;
}

/* One DECODE batch of the running requests (all but the verifying one). */
static int decode(sim *s, int step, int skip, int *bs_out) {
  int bs = 0, idx[MAX_BATCH];
  for (int i = 0; i < s->N; i++) {
    sim_req *q = &s->req[i];
    if (q->state != RUNNING || q->admitted == step || i == skip) continue;
    TRY(s, req_extend(s, q->id, 1, s->slots + bs), mla_req_table_last_error(s->rt));
    q->len++;
    s->ids[bs] = q->id;
    s->seq[bs] = q->len;
    s->tok[bs] = q->next;
    s->pos[bs] = q->len - 1;
    s->sample_rows[bs] = bs;
    idx[bs++] = i;
  }
  *bs_out = bs;
  if (!bs) return 0;
  if (s->cuda && s->graphs) {
    /* Replayed from CUDA graphs: the batch padded to a power-of-two bucket
     * in the backend's fixed graph inputs, the device copy of the request
     * table synced outside the graph, then each layer's graph. The oracle
     * checks read the rows from ids / qo / kvl (no host plan exists). */
    int B = 1;
    while (B < bs) B <<= 1;
    if (B > s->max_batch) B = s->max_batch;
    for (int j = bs; j < B; j++) s->ids[j] = MLA_REQ_PAD, s->seq[j] = 1;
    for (int j = 0; j < bs; j++) s->qo[j] = j, s->kvl[j] = s->seq[j];
    s->qo[bs] = bs;
    if (sdev_put(s->stream, s->g_ids, s->ids, sizeof(int32_t) * (size_t)B) ||
        sdev_put(s->stream, s->g_seq, s->seq, sizeof(int32_t) * (size_t)B))
      return (void)dev_fail(s, "graph input upload"), -1;
    TRY(s, mla_backend_sync(s->be), mla_backend_last_error(s->be));
    s->bucket = B;
    s->draft_rows = bs;
    const int rc = run_layers(s, bs, 0, NULL, bs, s->layers, 0.0);
    s->bucket = 0;
    s->draft_rows = 0;
    if (rc) return -1;
    s->st.replay_steps++;
  } else {
    mla_batch b = {MLA_MODE_DECODE, bs, s->ids, s->seq, NULL, NULL, 0};
    if (forward(s, &b, bs, NULL, bs)) return -1;
  }
  for (int j = 0; j < bs; j++) {
    s->req[idx[j]].next = s->sampled[j];
    s->req[idx[j]].generated++;
  }
  s->st.tok_decode += bs;
  s->st.generated += bs;
  return 0;
}

/* TARGET_VERIFY of one request: its pending token and ndt-1 draft tokens;
 * a random prefix of the drafts is accepted (a stand-in for comparing them
 * with the target's choices), the rest rolled back. */
static int verify(sim *s, int i, int *kept) {
  sim_req *q = &s->req[i];
  const int ndt = s->ndt, committed = q->len;
  TRY(s, req_extend(s, q->id, ndt, s->slots), mla_req_table_last_error(s->rt));
  s->ids[0] = q->id;
  s->seq[0] = committed; /* TARGET_VERIFY: kv = seq_len + ndt */
  for (int t = 0; t < ndt; t++) {
    s->tok[t] = t == 0 ? q->next : demo_rng_int(&s->g, 0, VOCAB - 1);
    s->pos[t] = committed + t;
    s->sample_rows[t] = t;
  }
  mla_batch b = {MLA_MODE_TARGET_VERIFY, 1, s->ids, s->seq, NULL, NULL, ndt};
  if (forward(s, &b, ndt, NULL, ndt)) return -1;
  int accepted = 0;
  while (accepted < ndt - 1 && demo_rng_uniform(&s->g) < 0.6) accepted++;
  TRY(s, mla_req_truncate(s->rt, q->id, committed + 1 + accepted), mla_req_table_last_error(s->rt));
  q->len = committed + 1 + accepted;
  q->next = s->sampled[accepted]; /* the target's token after the last accepted one */
  q->generated += 1 + accepted;
  *kept = 1 + accepted;
  s->st.tok_verify += ndt;
  s->st.generated += 1 + accepted;
  s->st.drafts += ndt - 1;
  s->st.accepted += accepted;
  s->st.rolled_back += ndt - 1 - accepted;
  s->st.verify_rounds++;
  return 0;
}

/* ---- --spec: speculative decoding for every running request ------------------ */

/* The draft model is the stack's first layer plus the LM head (an early-exit
 * draft, topk = 1): a layer-0 row depends only on its token and position, so
 * the draft and the target share layer 0 of the cache (no draft-extend pass
 * is needed after a round), and the verify pass rewrites the draft's rows
 * with the target's (the same values, up to the projections' rounding). */
#define DRAFT_LAYERS 1

/* The metadata mla_backend_draft_prepare built for the selected draft step,
 * against the rows the sim expects (one query, committed + i + 1 keys each). */
static void check_draft_metadata(sim *s, int bs) {
  mla_step_metadata md;
  demo_cmp c;
  memset(&c, 0, sizeof c);
  if (mla_backend_step_metadata(s->be, &md) == MLA_OK && md.batch_size == bs && md.q_len == 1) {
    /* device memory on a CUDA context: copied back first */
    int32_t kv[MAX_BATCH], qo[MAX_BATCH + 1];
    const int32_t *pk = md.kv_lens, *pq = md.qo_indptr;
    c.ok = 1;
    if (s->cuda) {
      c.ok = sdev_get(s->stream, kv, md.kv_lens, sizeof(int32_t) * (size_t)bs) == 0 &&
             sdev_get(s->stream, qo, md.qo_indptr, sizeof(int32_t) * (size_t)(bs + 1)) == 0;
      pk = kv, pq = qo;
    }
    for (int b = 0; c.ok && b < bs; b++) {
      if (pk[b] != s->kvl[b] || pq[b + 1] != b + 1) c.ok = 0;
      c.max_abs_err = fmax(c.max_abs_err, fabs((double)pk[b] - s->kvl[b]));
    }
  }
  record(s, &c, 0);
}

/* One speculative round (EAGLE-style) for every running request admitted
 * before this step:
 *  1. draft: each request gets ns slots (positions committed .. committed +
 *     ns - 1); ids and committed lengths go into the backend's graph inputs;
 *     mla_backend_sync + mla_backend_draft_prepare build the metadata of all
 *     ns draft steps at once; draft step i (mla_backend_draft_select) feeds
 *     t_i (the pending token, then draft i-1) at position committed + i
 *     through the draft model, which writes its layer-0 row into slot i and
 *     attends committed + i + 1 keys, and samples draft d_i.
 *  2. verify: one more slot each; one TARGET_VERIFY batch of (pending, d_0 ..
 *     d_{ns-1}) per request through the whole stack.
 *  3. accept the longest prefix of drafts equal to the target's own greedy
 *     tokens (a real comparison); the target's token after it is the next
 *     pending one.
 *  4. roll back the rejected drafts' slots (mla_req_truncate).
 * Returns the requests drafted for (*bs_out) and the drafts accepted. */
static int spec_round(sim *s, int step, int *bs_out, int *acc_out) {
  const int ns = s->ns, w = ns + 1;
  int bs = 0;
  *bs_out = *acc_out = 0;
  for (int i = 0; i < s->N; i++) {
    sim_req *q = &s->req[i];
    if (q->state != RUNNING || q->admitted == step) continue;
    TRY(s, req_extend(s, q->id, ns, s->dslot + (size_t)bs * w), mla_req_table_last_error(s->rt));
    s->committed[bs] = q->len;
    s->vidx[bs++] = i;
  }
  *bs_out = bs;
  if (!bs) return 0;
  const double t0 = demo_now_ms(), check0 = s->st.t_check;
  /* The graph inputs are host memory on a CPU context, device memory on a
   * CUDA one (written with a copy on the stream). */
  for (int b = 0; b < bs; b++) {
    s->ids[b] = s->req[s->vidx[b]].id;
    s->qo[b] = b;
  }
  s->qo[bs] = bs;
  if (s->dc) {
    /* --dcp: no backend draft steps; draft step i is a DCP DECODE batch
     * (kv = committed + i + 1) of the draft model's one layer, below. */
  } else if (s->cuda) {
    if (sdev_put(s->stream, s->g_ids, s->ids, sizeof(int32_t) * (size_t)bs) ||
        sdev_put(s->stream, s->g_seq, s->committed, sizeof(int32_t) * (size_t)bs))
      return (void)dev_fail(s, "graph input upload"), -1;
  } else {
    for (int b = 0; b < bs; b++) s->g_ids[b] = s->ids[b], s->g_seq[b] = s->committed[b];
  }
  if (!s->dc) {
    TRY(s, mla_backend_sync(s->be), mla_backend_last_error(s->be));
    TRY(s, mla_backend_draft_prepare(s->be, bs, ns), mla_backend_last_error(s->be));
  }
  double ta = demo_now_ms() - t0;
  /* On a check step every draft step is checked too (its only layer). */
  const int sched = s->check_layer;
  s->check_layer = sched >= 0 ? 0 : -1;
  int rc = 0;
  for (int i = 0; i < ns && rc == 0; i++) {
    const double t1 = demo_now_ms();
    mla_status st = s->dc ? MLA_OK : mla_backend_draft_select(s->be, i);
    ta += demo_now_ms() - t1;
    if (fail_status(s, st, "mla_backend_draft_select", mla_backend_last_error(s->be))) {
      rc = -1;
      break;
    }
    for (int b = 0; b < bs; b++) {
      s->tok[b] = i ? s->dtok[(size_t)b * ns + i - 1] : s->req[s->vidx[b]].next;
      s->pos[b] = s->committed[b] + i;
      s->slots[b] = s->dslot[(size_t)b * w + i];
      s->sample_rows[b] = b;
      s->kvl[b] = s->committed[b] + i + 1;
    }
    if (s->check_layer == 0 && !s->dc) {
      const double tc = demo_now_ms();
      check_draft_metadata(s, bs);
      s->st.t_check += demo_now_ms() - tc;
    }
    if (s->dc) {
      const double t2 = demo_now_ms();
      const int32_t *r2t = NULL;
      mla_req_table_data(s->rt, &r2t);
      if (sdcp_batch(s->dc, SDCP_DECODE, bs, s->ids, s->kvl, NULL, r2t)) {
        fprintf(s->out, "error: --dcp: %s\n", sdcp_error(s->dc));
        rc = -1;
        break;
      }
      ta += demo_now_ms() - t2;
    }
    s->draft_rows = bs;
    const double attn0 = s->st.t_attn;
    rc = run_layers(s, bs, 0, NULL, bs, DRAFT_LAYERS, ta);
    if (s->dc) {
      s->st.t_dcp_decode += s->st.t_attn - attn0;
      s->st.dcp_decode_steps++;
    }
    s->draft_rows = 0;
    ta = 0;
    for (int b = 0; rc == 0 && b < bs; b++) s->dtok[(size_t)b * ns + i] = s->sampled[b];
  }
  s->check_layer = sched;
  if (rc) return -1;
  s->st.tok_draft += (int64_t)bs * ns;
  s->st.t_draft += demo_now_ms() - t0 - (s->st.t_check - check0);

  /* Verify: the pending token and the ns drafts of every request. */
  int T = 0;
  for (int b = 0; b < bs; b++) {
    sim_req *q = &s->req[s->vidx[b]];
    TRY(s, req_extend(s, q->id, 1, s->dslot + (size_t)b * w + ns), mla_req_table_last_error(s->rt));
    s->ids[b] = q->id;
    s->seq[b] = s->committed[b]; /* TARGET_VERIFY: kv = seq_len + ndt */
    for (int t = 0; t < w; t++, T++) {
      s->tok[T] = t ? s->dtok[(size_t)b * ns + t - 1] : q->next;
      s->pos[T] = s->committed[b] + t;
      s->slots[T] = s->dslot[(size_t)b * w + t];
      s->sample_rows[T] = T;
    }
  }
  mla_batch vb = {MLA_MODE_TARGET_VERIFY, bs, s->ids, s->seq, NULL, NULL, w};
  if (forward(s, &vb, T, NULL, T)) return -1;

  /* Accept, roll back, advance. */
  int acc = 0;
  for (int b = 0; b < bs; b++) {
    sim_req *q = &s->req[s->vidx[b]];
    const int32_t *target = s->sampled + (size_t)b * w; /* the target's token after each input */
    int a = 0;
    while (a < ns && s->dtok[(size_t)b * ns + a] == target[a]) a++;
    TRY(s, mla_req_truncate(s->rt, q->id, s->committed[b] + 1 + a), mla_req_table_last_error(s->rt));
    q->len = s->committed[b] + 1 + a;
    q->next = target[a];
    q->generated += 1 + a;
    acc += a;
    s->st.first_ok += a > 0;
    s->st.generated += 1 + a;
    s->st.accepted += a;
    s->st.rolled_back += ns - a;
  }
  s->st.tok_verify += T;
  s->st.drafts += (int64_t)bs * ns;
  s->st.verify_rounds += bs;
  *acc_out = acc;
  return 0;
}

static int retire(sim *s, int *finished) {
  *finished = 0;
  for (int i = 0; i < s->N; i++) {
    sim_req *q = &s->req[i];
    if (q->state != RUNNING) continue;
    if (q->generated < q->target && q->len + s->ndt + 1 <= s->max_ctx) continue;
    TRY(s, mla_req_free(s->rt, q->id), mla_req_table_last_error(s->rt));
    q->state = DONE;
    (*finished)++;
  }
  s->st.finished += *finished;
  return 0;
}

static int step(sim *s, int k) {
  const double t0 = demo_now_ms(), check0 = s->st.t_check, attn0 = s->st.t_attn;
  const int64_t tok0 = s->st.tok_prefill + s->st.tok_decode + s->st.tok_verify;
  s->check_layer = k % s->o->check_every == 0 ? (k / s->o->check_every) % s->layers : -1;
  s->step_checks = s->step_failed = 0;
  int n_new = 0, n_fork = 0, bs = 0, kept = 0, finished = 0;
  if (admit_and_prefill(s, k, &n_new, &n_fork)) return -1;
  /* The verifying request: the next running one in turn. */
  int spec = -1, eligible = 0;
  for (int i = 0; i < s->N; i++) eligible += s->req[i].state == RUNNING && s->req[i].admitted < k;
  if (eligible && s->ndt > 1) {
    int want = s->rr++ % eligible;
    for (int i = 0; i < s->N && spec < 0; i++)
      if (s->req[i].state == RUNNING && s->req[i].admitted < k && want-- == 0) spec = i;
  }
  if (decode(s, k, spec, &bs)) return -1;
  if (spec >= 0 && verify(s, spec, &kept)) return -1;
  int shared = 0, used = pages_in_use(s, &shared); /* the step's high-water mark */
  if (retire(s, &finished)) return -1;
  used = pages_in_use(s, &shared);
  const double ms = demo_now_ms() - t0 - (s->st.t_check - check0), attn = s->st.t_attn - attn0;
  s->st.t_total += ms;
  const int64_t toks = s->st.tok_prefill + s->st.tok_decode + s->st.tok_verify - tok0;
  char ver[16] = "-", chk[48] = "";
  if (spec >= 0) snprintf(ver, sizeof ver, "%d/%d", kept, s->ndt);
  if (s->step_checks)
    snprintf(chk, sizeof chk, "  oracle L%d %d/%d %s", s->last_checked, s->step_checks - s->step_failed,
             s->step_checks, s->step_failed ? "FAIL" : "ok");
  fprintf(s->out,
          "step %3d  decode %2d  prefill %d (%d forked)  verify %-4s  tokens %5lld  pages %4d/%d  done %d"
          "  %8.1f ms  attn %3.0f%%%s\n",
          k, bs, n_new, n_fork, ver, (long long)toks, used, s->usable_pages, finished, ms,
          ms > 0 ? 100.0 * attn / ms : 0.0, chk);
  return 0;
}

/* --spec: the step of step(), with one speculative round for every running
 * request in place of the decode batch and the single verifying request. */
static int spec_step(sim *s, int k) {
  const double t0 = demo_now_ms(), check0 = s->st.t_check, attn0 = s->st.t_attn, draft0 = s->st.t_draft;
  const int64_t tok0 = s->st.tok_prefill + s->st.tok_decode + s->st.tok_verify, gen0 = s->st.generated;
  s->check_layer = k % s->o->check_every == 0 ? (k / s->o->check_every) % s->layers : -1;
  s->step_checks = s->step_failed = 0;
  int n_new = 0, n_fork = 0, bs = 0, acc = 0, finished = 0;
  if (admit_and_prefill(s, k, &n_new, &n_fork)) return -1;
  if (spec_round(s, k, &bs, &acc)) return -1;
  int shared = 0, used = pages_in_use(s, &shared); /* the step's high-water mark */
  if (retire(s, &finished)) return -1;
  used = pages_in_use(s, &shared);
  const double ms = demo_now_ms() - t0 - (s->st.t_check - check0), attn = s->st.t_attn - attn0;
  s->st.t_total += ms;
  const int64_t toks = s->st.tok_prefill + s->st.tok_decode + s->st.tok_verify - tok0;
  char chk[64] = "";
  if (s->step_checks)
    snprintf(chk, sizeof chk, "  oracle %sL%d %d/%d %s", s->check_layer >= 0 && bs ? "draft L0 + " : "",
             s->last_checked, s->step_checks - s->step_failed, s->step_checks, s->step_failed ? "FAIL" : "ok");
  fprintf(s->out,
          "step %3d  spec %2d x %d drafts, accepted %3d, rolled back %3d  prefill %d (%d forked)  tokens %5lld"
          "  generated %3lld  pages %4d/%d  done %d  %8.1f ms  draft %3.0f%%  attn %3.0f%%%s\n",
          k, bs, s->ns, acc, bs * s->ns - acc, n_new, n_fork, (long long)toks,
          (long long)(s->st.generated - gen0), used, s->usable_pages, finished, ms,
          ms > 0 ? 100.0 * (s->st.t_draft - draft0) / ms : 0.0, ms > 0 ? 100.0 * attn / ms : 0.0, chk);
  return 0;
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static int setup(sim *s) {
  const demo_opts *o = s->o;
  /* Requests: a first wave at step 0, the rest arriving over the first two
   * thirds of the run. */
  s->req = calloc((size_t)s->N, sizeof(sim_req));
  int *arr = calloc((size_t)s->N, sizeof(int));
  if (!s->req || !arr) {
    free(arr);
    fprintf(s->out, "error: out of memory for %d requests\n", s->N);
    return -1;
  }
  const int wave = s->max_batch / 2 > 0 ? s->max_batch / 2 : 1, span = s->o->steps * 2 / 3 > 1 ? s->o->steps * 2 / 3 : 1;
  for (int i = 0; i < s->N; i++) arr[i] = i < wave ? 0 : demo_rng_int(&s->g, 1, span);
  qsort(arr, (size_t)s->N, sizeof(int), cmp_int);
  const int max_target = o->steps * 3 / 4 > 4 ? o->steps * 3 / 4 : 4;
  for (int i = 0; i < s->N; i++) {
    sim_req *q = &s->req[i];
    q->arrival = arr[i];
    q->prompt = demo_rng_int(&s->g, o->max_prompt / 8 > 1 ? o->max_prompt / 8 : 1, o->max_prompt);
    q->target = demo_rng_int(&s->g, 2, max_target);
    q->id = -1;
  }
  free(arr);
  /* Longest request: prompt + generated tokens (a verify round can overshoot
   * the target by ndt) + the drafts in flight. */
  s->max_ctx = o->max_prompt + max_target + 2 * s->ndt + 1;
  s->max_tokens = o->max_prompt > 256 ? o->max_prompt : 256; /* prefill rows per step */
  if (s->max_tokens < s->max_batch) s->max_tokens = s->max_batch;
  if (s->max_tokens < s->ndt) s->max_tokens = s->ndt;
  if (s->spec && s->max_tokens < s->max_batch * s->ndt) s->max_tokens = s->max_batch * s->ndt; /* verify rows */

  mla_backend_desc bd;
  memset(&bd, 0, sizeof bd);
  bd.cache.num_layers = s->layers;
  bd.cache.page_size = s->P;
  bd.cache.dtype = o->cache_dtype;
  /* Every running request at its longest, plus a page each for
   * copy-on-write of a shared page. */
  bd.cache.num_pages = 1 + s->max_batch * ((s->max_ctx + s->P - 1) / s->P + 2);
  bd.max_reqs = s->max_batch;
  bd.max_context = s->max_ctx;
  bd.max_bs = s->max_batch;
  bd.max_q_tokens = s->max_tokens;
  bd.num_heads = s->H;
  bd.scale = (float)s->scale;
  bd.act_dtype = s->act;
  bd.qk_nope_dim = NOPE;
  bd.v_dim = DV;
  bd.extend_impl = o->prefix_impl;
  bd.chunk_capacity = 256; /* a long shared prefix takes several chunks */
  s->usable_pages = bd.cache.num_pages - 1;
  if (s->dcp) {
    /* No backend: the sim's own request table hands out global slots with
     * page P * N (so slot mod N = position mod N), metadata only; each
     * rank's shard (serve_dcp) has page P and the same page ids. */
    const int PN = s->P * s->dcp;
    mla_req_table_desc rd = {s->max_batch, s->max_ctx, 1 + s->max_batch * ((s->max_ctx + PN - 1) / PN + 2), PN};
    s->usable_pages = rd.num_pages - 1;
    TRY(s, mla_req_table_create(s->ctx, &rd, NULL, &s->rt), mla_ctx_last_error(s->ctx));
  } else {
    TRY(s, mla_backend_create(s->ctx, &bd, &s->be), mla_ctx_last_error(s->ctx));
    TRY(s, mla_backend_req_table(s->be, &s->rt), "");
  }
  if (!s->dcp && (s->spec || s->cuda)) { /* the multi-step draft and the decode graphs run on the graph inputs */
    TRY(s, mla_backend_graph_init(s->be, s->max_batch, 0), mla_backend_last_error(s->be));
    if (s->spec) TRY(s, mla_backend_draft_init(s->be, s->ns), mla_backend_last_error(s->be));
    TRY(s, mla_backend_graph_inputs(s->be, &s->g_ids, &s->g_seq), mla_backend_last_error(s->be));
  }

  const size_t T = (size_t)s->max_tokens, H = (size_t)s->H, D = (size_t)s->D, f = sizeof(float);
  int oom = 0;
  s->x = xmalloc(T * D * f, &oom);
  s->xn = xmalloc(T * D * f, &oom);
  s->q = xmalloc(T * H * DQK * f, &oom);
  s->kv = xmalloc(T * (L + R) * f, &oom);
  s->c = xmalloc(T * L * f, &oom);
  s->r = xmalloc(T * R * f, &oom);
  s->big = xmalloc(T * H * L * f, &oom);
  s->oh = xmalloc(T * H * DV * f, &oom);
  s->c_a = xmalloc(T * L * s->es, &oom);
  s->r_a = xmalloc(T * R * s->es, &oom);
  s->in_a = xmalloc(T * H * L * s->es, &oom);
  s->qr_a = xmalloc(T * H * R * s->es, &oom);
  s->out_a = xmalloc(T * H * L * s->es, &oom);
  s->lse = xmalloc(T * H * f, &oom);
  s->logits = xmalloc(T * VOCAB * f, &oom);
  s->ids = xmalloc((size_t)s->max_batch * sizeof(int32_t), &oom);
  s->seq = xmalloc((size_t)s->max_batch * sizeof(int32_t), &oom);
  s->pre = xmalloc((size_t)s->max_batch * sizeof(int32_t), &oom);
  s->tok = xmalloc(T * sizeof(int32_t), &oom);
  s->pos = xmalloc(T * sizeof(int32_t), &oom);
  s->slots = xmalloc(T * sizeof(int32_t), &oom);
  s->sample_rows = xmalloc(T * sizeof(int), &oom);
  s->sampled = xmalloc(T * sizeof(int32_t), &oom);
  if (s->spec) {
    const size_t B = (size_t)s->max_batch, ns = (size_t)s->ns;
    s->committed = xmalloc(B * sizeof(int32_t), &oom);
    s->dslot = xmalloc(B * (ns + 1) * sizeof(int32_t), &oom);
    s->dtok = xmalloc(B * ns * sizeof(int32_t), &oom);
    s->vidx = xmalloc(B * sizeof(int32_t), &oom);
  }
  s->qo = xmalloc(((size_t)s->max_batch + 1) * sizeof(int32_t), &oom);
  s->kvl = xmalloc((size_t)s->max_batch * sizeof(int32_t), &oom);
  if (s->dcp) s->dext = xmalloc((size_t)s->max_batch * sizeof(int32_t), &oom);
  if (oom) {
    fprintf(s->out, "error: out of memory for the simulation's buffers (%zu rows, %d heads)\n", T, s->H);
    return -1;
  }
  if (model_init(s)) {
    fprintf(s->out, "error: out of memory for the weights\n");
    return -1;
  }
  if (s->dcp) {
    sdcp_desc dd;
    memset(&dd, 0, sizeof dd);
    dd.world = s->dcp;
    dd.host = serve_dcp_host();
    dd.threads = o->threads > 0 ? (o->threads + s->dcp - 1) / s->dcp : 1;
    dd.layers = s->layers;
    dd.num_pages = s->usable_pages + 1;
    dd.page_size = s->P;
    dd.cache_dtype = o->cache_dtype;
    dd.act = s->act;
    dd.heads = s->H;
    dd.scale = (float)s->scale;
    dd.qk_dim = DQK;
    dd.v_dim = DV;
    dd.max_reqs = s->max_batch;
    dd.max_ctx = s->max_ctx;
    dd.max_batch = s->max_batch;
    dd.max_tokens = s->max_tokens;
    char err[400];
    if (sdcp_create(&dd, &s->dc, err, sizeof err)) {
      fprintf(s->out, "error: --dcp %d: %s\n", s->dcp, err);
      return -1;
    }
  }
  if (s->cuda) { /* the attention's device buffers, and kv_b_proj per layer */
    const size_t es = s->es;
    s->d_in = sdev_alloc(T * H * L * es);
    s->d_qr = sdev_alloc(T * H * R * es);
    s->d_c = sdev_alloc(T * L * es);
    s->d_r = sdev_alloc(T * R * es);
    s->d_out = sdev_alloc(T * H * L * es);
    s->d_lse = sdev_alloc(T * H * f);
    s->d_slots = sdev_alloc(T * sizeof(int32_t));
    s->d_kvb = calloc((size_t)s->layers, sizeof(void *));
    s->gexec = calloc((size_t)s->layers * NBUCKETS, sizeof(void *));
    int bad = !s->d_in || !s->d_qr || !s->d_c || !s->d_r || !s->d_out || !s->d_lse || !s->d_slots || !s->d_kvb ||
              !s->gexec;
    const size_t kvb_bytes = H * (NOPE + DV) * L * es;
    for (int l = 0; !bad && l < s->layers; l++) {
      s->d_kvb[l] = sdev_alloc(kvb_bytes);
      bad = !s->d_kvb[l] || sdev_put(s->stream, s->d_kvb[l], s->lw[l].kvb_a, kvb_bytes) ||
            sdev_get(s->stream, NULL, NULL, 0);
    }
    if (bad) {
      fprintf(s->out, "error: out of device memory for the simulation's buffers\n");
      return -1;
    }
  }
  return 0;
}

static void teardown(sim *s) {
  model_free(s);
  void *bufs[] = {s->x,     s->xn,  s->q,   s->kv,  s->c,   s->r,   s->big, s->oh,  s->c_a,
                  s->r_a,   s->in_a, s->qr_a, s->out_a, s->lse, s->logits, s->ids, s->seq, s->pre,
                  s->tok,   s->pos, s->slots, s->sample_rows, s->sampled, s->req, s->committed, s->dslot,
                  s->dtok,  s->vidx, s->qo, s->kvl, s->dext};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
  mla_backend_destroy(s->be);
  if (s->dcp) { /* the ranks first (they read nothing of the table after their last job) */
    sdcp_destroy(s->dc);
    mla_req_table_destroy(s->rt);
  }
  if (s->cuda) {
    void *dbufs[] = {s->d_in, s->d_qr, s->d_c, s->d_r, s->d_out, s->d_lse, s->d_slots};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) sdev_free(dbufs[i]);
    for (int l = 0; s->d_kvb && l < s->layers; l++) sdev_free(s->d_kvb[l]);
    for (int k = 0; s->gexec && k < s->layers * NBUCKETS; k++) sdev_graph_free(s->gexec[k]);
    free(s->d_kvb);
    free(s->gexec);
  }
  mla_ctx_destroy(s->ctx);
  sdev_stream_destroy(s->stream);
}

static void summary(sim *s, int steps_run) {
  const stats *t = &s->st;
  const int64_t toks = t->tok_prefill + t->tok_decode + t->tok_verify;
  const double sec = t->t_total / 1e3;
  fprintf(s->out, "\nsummary: %d steps, %d requests (%d forked from a shared prefix, %d finished)\n", steps_run,
          s->N, t->forks, t->finished);
  fprintf(s->out, "  tokens: %lld through the stack (prefill %lld, decode %lld, verify %lld) in %.2f s = %.1f tok/s;"
                  " %lld generated = %.1f tok/s\n",
          (long long)toks, (long long)t->tok_prefill, (long long)t->tok_decode, (long long)t->tok_verify, sec,
          sec > 0 ? toks / sec : 0.0, (long long)t->generated, sec > 0 ? t->generated / sec : 0.0);
  fprintf(s->out, "  time: attention %.2f s (%.0f%%), projections and the rest %.2f s; oracle checks %.2f s (not counted)\n",
          t->t_attn / 1e3, t->t_total > 0 ? 100.0 * t->t_attn / t->t_total : 0.0, (t->t_total - t->t_attn) / 1e3,
          t->t_check / 1e3);
  if (s->spec) {
    const int rounds = t->verify_rounds;
    fprintf(s->out,
            "  speculative decoding: draft model = layer 0 of the stack + LM head, %d draft steps per round;"
            " %d request rounds\n"
            "    drafted %lld, accepted %lld, rolled back %lld; mean accepted length %.2f drafts per round"
            " (%.2f tokens per round with the target's own)\n"
            "    acceptance: the longest prefix of drafts equal to the target's greedy tokens (a real comparison,"
            " not a random length: the random-weight draft agrees with the target on %.0f%% of first drafts)\n"
            "    draft passes: %lld rows through the draft model in %.2f s (%.0f%% of the time)\n",
            s->ns, rounds, (long long)t->drafts, (long long)t->accepted, (long long)t->rolled_back,
            rounds ? (double)t->accepted / rounds : 0.0, rounds ? (double)(t->accepted + rounds) / rounds : 0.0,
            rounds ? 100.0 * t->first_ok / rounds : 0.0, (long long)t->tok_draft, t->t_draft / 1e3,
            t->t_total > 0 ? 100.0 * t->t_draft / t->t_total : 0.0);
  } else {
    fprintf(s->out, "  speculative verify: %d rounds, %lld drafts, %lld accepted, %lld rolled back\n", t->verify_rounds,
            (long long)t->drafts, (long long)t->accepted, (long long)t->rolled_back);
  }
  if (s->cuda)
    fprintf(s->out,
            "  GPU: attention times include the host<->device copies of its inputs and outputs (the projections"
            " run on the host)\n");
  if (t->replay_steps)
    fprintf(s->out,
            "  CUDA graphs: %d decode steps replayed (%d layer graphs captured over the batch buckets);"
            " attention per step %.3f ms (%d layers, each: input upload, graph launch, output download)\n",
            t->replay_steps, t->graphs_captured, t->t_replay / t->replay_steps, s->layers);
  if (s->dc) {
    sdcp_stats ds;
    sdcp_get_stats(s->dc, &ds);
    const int gpu = sdcp_on_gpu(s->dc);
    fprintf(s->out,
            "  DCP: %d ranks on %s; position p on rank p mod %d (request table page %d, shard page %d)\n"
            "    DECODE%s: DCP step on each rank's shard + %s (%lld layer merges)\n"
            "    TARGET_VERIFY and EXTEND over a prefix: run as EXTEND (verify = extend_lens ndt over the committed"
            " prefix; the DCP step is DECODE only) over the KV pooled by %s (%lld layer gathers, %lld rows)\n"
            "    EXTEND without prefix: ragged MHA on rank 0 (no cache read); every rank writes its shard of the"
            " new rows\n",
            ds.world, sdcp_where(s->dc), ds.world, s->P * ds.world, s->P, s->spec ? " (and the draft steps)" : "",
            gpu ? "mla_dcp_merge_nccl" : "a host all-gather + mla_merge_states", (long long)ds.merges,
            gpu ? "mla_dcp_gather_kv_nccl" : "mla_kv_cache_pack_rows + a host all-gather", (long long)ds.gathers,
            (long long)ds.gathered_rows);
    fprintf(s->out, "    time in the %s exchange:", gpu ? "NCCL" : "host");
    for (int r = 0; r < ds.world; r++)
      fprintf(s->out, "%s rank %d %.1f ms (merge %.1f, KV all-gather %.1f)", r ? ";" : "", r, ds.exchange_ms[r],
              ds.merge_ms[r], ds.exchange_ms[r] - ds.merge_ms[r]);
    fprintf(s->out, "; %.3f ms per DECODE batch (rank 0)\n",
            t->dcp_decode_steps ? ds.merge_ms[0] / t->dcp_decode_steps : 0.0);
    fprintf(s->out, "    rows written per shard:");
    for (int r = 0; r < ds.world; r++) fprintf(s->out, "%s rank %d %lld", r ? "," : "", r, (long long)ds.shard_rows[r]);
    fprintf(s->out, "; copy-on-write pages copied in the shards and read back: %d", t->cow_checks);
    fprintf(s->out,
            "\n  CUDA graphs: not used under --dcp (each layer's shard write, DCP step and exchange run eagerly);"
            " DECODE attention per step %.3f ms over %d DECODE batches (%d layer%s, each: input upload, step, %s,"
            " output download)\n",
            t->dcp_decode_steps ? t->t_dcp_decode / t->dcp_decode_steps : 0.0, t->dcp_decode_steps,
            s->spec ? DRAFT_LAYERS : s->layers, (s->spec ? DRAFT_LAYERS : s->layers) > 1 ? "s" : "",
            gpu ? "NCCL merge" : "host merge");
  }
  fprintf(s->out, "  pages: peak %d of %d in use (%d shared by forks at most)\n", t->pages_peak, s->usable_pages,
          t->shared_peak);
  fprintf(s->out,
          "  oracle: %d attention checks on sampled layers (max |err| %.2e, cos dist %.2e, lse err %.2e),"
          " %d other (cache rows read back: max |err| %.2e; pages; projections): %s\n",
          t->attn_checks, t->max_err, t->max_cos, t->max_lse, t->checks - t->attn_checks, t->cache_err,
          t->failed ? "FAILED" : "all ok");
}

int serve_dcp_host(void) {
  const char *e = getenv("MLA_DEMO_DCP_HOST");
  return e && *e && strcmp(e, "0") != 0;
}

int serve_run(const demo_opts *o, FILE *out) { return serve_run_dcp(o, 0, out); }

int serve_run_dcp(const demo_opts *o, int dcp, FILE *out) {
  sim s;
  memset(&s, 0, sizeof s);
  s.o = o;
  s.out = out;
  s.g.s = o->seed * 0x9e3779b97f4a7c15ull + 7; /* not the table's stream */
  s.H = o->heads ? o->heads : 128;
  s.N = o->requests ? o->requests : 16;
  s.D = o->hidden;
  s.layers = o->layers;
  s.P = o->page_size;
  s.spec = o->spec;
  s.ns = o->spec_steps;
  s.ndt = s.spec ? s.ns + 1 : o->draft_tokens; /* a verify round's query tokens */
  s.max_batch = o->max_batch;
  s.act = o->act_dtype;
  s.es = mla_dtype_size(o->act_dtype);
  s.scale = 1.0 / sqrt((double)DQK); /* DeepSeek's softmax scale, 192^-0.5 */
  s.check_layer = -1;
  demo_opts resolved = *o;
  if (!resolved.max_prompt) resolved.max_prompt = 160;
  s.o = &resolved;
  mla_ctx_desc cd;
  memset(&cd, 0, sizeof cd);
  cd.num_threads = o->threads;
  mla_status st = MLA_ERR_UNSUPPORTED;
  s.dcp = dcp;
  if (dcp) {
    /* The ranks hold the attention; the sim's context only plans (the
     * request table, the gathered layout): a CPU one. Prefix EXTEND is
     * absorbed (the pooled KV feeds the paged EXTEND step). */
    resolved.prefix_impl = MLA_EXTEND_ABSORBED;
    cd.device = MLA_DEVICE_CPU;
    cd.num_threads = 1;
    st = mla_ctx_create(&cd, &s.ctx);
    if (st != MLA_OK) {
      fprintf(out, "error: mla_ctx_create: %s\n", mla_status_string(st));
      return -1;
    }
  } else if (o->device != 1) { /* a GPU when there is one (auto), or required */
    cd.device = MLA_DEVICE_CUDA;
    st = mla_ctx_create(&cd, &s.ctx);
    if (st == MLA_OK) {
      s.cuda = 1;
      s.graphs = !o->no_graphs;
      s.stream = sdev_stream_create();
      if (!s.stream || mla_ctx_set_stream(s.ctx, s.stream) != MLA_OK) {
        fprintf(out, "error: no CUDA stream for the simulation\n");
        mla_ctx_destroy(s.ctx);
        sdev_stream_destroy(s.stream);
        return -1;
      }
    } else if (o->device == 2) {
      fprintf(out, "error: --device cuda: mla_ctx_create: %s\n", mla_status_string(st));
      return -1;
    }
  }
  if (!s.cuda && !dcp) {
    cd.device = MLA_DEVICE_CPU;
    st = mla_ctx_create(&cd, &s.ctx);
    if (st != MLA_OK) {
      fprintf(out, "error: mla_ctx_create: %s\n", mla_status_string(st));
      return -1;
    }
  }
  int threads = 0;
  mla_ctx_get_threads(s.ctx, &threads);
  char where[320];
  if (dcp)
    snprintf(where, sizeof where,
             "libmla with decode context parallel over %d ranks (--dcp%s; no CUDA graphs under --dcp)", dcp,
             serve_dcp_host() ? ", CPU ranks in one process: MLA_DEMO_DCP_HOST" : "");
  else if (s.cuda)
    snprintf(where, sizeof where, "libmla on %s (CUDA context%s)", sdev_name(),
             s.graphs ? "; decode steps replayed from CUDA graphs" : "");
  else
    snprintf(where, sizeof where, "libmla on the CPU, %d threads", threads);
  serve_gemm_init(o->threads);
  fprintf(out,
          "\nserving simulation: %d layers, hidden %d, %d heads (MLA: latent %d, rope %d, qk_nope %d, v %d), "
          "cache %s, act %s, page %d\n"
          "  %d requests (prompts up to %d tokens), at most %d running, %d steps, %s %d %s, "
          "prefix extend %s\n"
          "  projections: %s (host); attention: %s\n",
          s.layers, s.D, s.H, L, R, NOPE, DV, mla_dtype_name(o->cache_dtype), mla_dtype_name(s.act), s.P, s.N,
          resolved.max_prompt, s.max_batch, o->steps, s.spec ? "speculative decoding (--spec):" : "verify with",
          s.spec ? s.ns : s.ndt,
          s.spec ? "draft steps (layer 0 + LM head) then one verify batch per step" : "draft tokens",
          resolved.prefix_impl == MLA_EXTEND_MHA_CHUNKED ? "chunked MHA"
          : dcp && o->prefix_impl == MLA_EXTEND_MHA_CHUNKED ? "absorbed (--dcp: the pooled KV feeds the paged EXTEND)"
                                                             : "absorbed",
          serve_gemm_name(), where);
  const double t0 = demo_now_ms();
  int rc = setup(&s);
  if (rc == 0) {
    const double gemm_err = check_gemm(&s);
    fprintf(out, "  set-up (random weights): %.1f s; projection self-check: rel err %.1e %s\n",
            (demo_now_ms() - t0) / 1e3, gemm_err, gemm_err <= 1e-5 ? "ok" : "FAIL");
    if (s.dc) fprintf(out, "  DCP ranks: %s, each with its shard of the KV and its NCCL communicator\n", sdcp_where(s.dc));
  }
  int k = 0;
  for (; rc == 0 && k < o->steps; k++) {
    int left = 0;
    for (int i = 0; i < s.N; i++) left += s.req[i].state != DONE;
    if (!left) break;
    rc = s.spec ? spec_step(&s, k) : step(&s, k);
  }
  if (rc == 0) {
    /* Free what still runs: every page must come back. */
    for (int i = 0; i < s.N; i++)
      if (s.req[i].state == RUNNING && mla_req_free(s.rt, s.req[i].id) == MLA_OK) s.req[i].state = DONE;
    int shared = 0, used = pages_in_use(&s, &shared);
    demo_cmp c;
    memset(&c, 0, sizeof c);
    c.ok = used == 0;
    record(&s, &c, 0);
    summary(&s, k);
    fprintf(out, "  pages in use after every request is freed: %d%s\n", used, used ? " (LEAK)" : "");
  }
  const int failed = s.st.failed;
  teardown(&s);
  if (rc != 0) return -1;
  fprintf(out, "%s: %d check(s) failed\n", failed ? "FAILED" : "the simulation matches the float64 oracle", failed);
  return failed;
}
