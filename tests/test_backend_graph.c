/* The backend's graph steps (mla_backend_graph_*) against its eager steps,
 * through a decode loop with continuous batching: two backends with the same
 * descriptor get the same request-table operations (so the same slots); one
 * runs each step eagerly (mla_backend_plan + forward), the other as a graph
 * step (inputs written into the fixed buffers, mla_backend_sync,
 * mla_backend_graph_step + forward). Each step writes this step's latent
 * rows (KV write inside forward) then attends, over 2 layers; requests join
 * and finish, and the batch is padded to a bucket. Outputs must be equal bit
 * for bit, at every step.
 *
 * CPU context (always): graph steps run eagerly from host buffers. CUDA
 * context (when a GPU is present): the graph step and the layers are
 * captured once per bucket in a CUDA graph on a non-blocking stream and
 * replayed; the eager backend plans on the device too; and a CUDA step is
 * compared with the CPU backend on the same inputs (bf16 tolerance). Also the
 * refusals of the graph calls. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

#ifdef MLA_TEST_CUDA
#include "cuda_util.h"
#endif

#define LAYERS 2
#define H 16
#define MAXB 8
#define STEPS 40
static const float SCALE = 0.0721687836f;
static tu_rng rng;

typedef struct twin {
  mla_ctx *ctx;
  int cuda;
  mla_backend *eager, *graph;
  mla_req_table *rt_e, *rt_g;
} twin;

static mla_backend_desc desc_of(void) {
  mla_backend_desc d;
  memset(&d, 0, sizeof d);
  d.cache.num_layers = LAYERS;
  d.cache.num_pages = 160;
  d.cache.page_size = 16;
  d.cache.dtype = MLA_DTYPE_BF16;
  d.max_reqs = 16;
  d.max_context = 600;
  d.max_bs = MAXB;
  d.max_q_tokens = 64;
  d.num_heads = H;
  d.scale = SCALE;
  d.act_dtype = MLA_DTYPE_BF16;
  d.num_sm = 10;
  return d;
}

/* ---- buffers on the context's device --------------------------------------- */
static void *buf_new(const twin *t, size_t n) {
#ifdef MLA_TEST_CUDA
  if (t->cuda) return tu_dev_alloc(n);
#endif
  (void)t;
  return calloc(1, n ? n : 16);
}
static void buf_free(const twin *t, void *p) {
#ifdef MLA_TEST_CUDA
  if (t->cuda) {
    cudaFree(p);
    return;
  }
#endif
  (void)t;
  free(p);
}
static void buf_put(const twin *t, void *dst, const void *src, size_t n) {
#ifdef MLA_TEST_CUDA
  if (t->cuda) {
    CK(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
    return;
  }
#endif
  (void)t;
  memcpy(dst, src, n);
}
static void buf_get(const twin *t, void *dst, const void *src, size_t n) {
#ifdef MLA_TEST_CUDA
  if (t->cuda) {
    CK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
    return;
  }
#endif
  (void)t;
  memcpy(dst, src, n);
}

static void rand_bf16(uint16_t *dst, int64_t n) {
  float *f = malloc(sizeof(float) * (size_t)n);
  tu_fill_bf16_normal(&rng, f, n, 1.0);
  tu_to_dtype(MLA_DTYPE_BF16, f, dst, n);
  free(f);
}

/* One decode loop; returns the number of steps whose outputs differed. */
static void decode_loop(twin *t) {
  const char *dev = t->cuda ? "cuda" : "cpu";
  mla_backend_desc d = desc_of();
  TU_STATUS(mla_backend_create(t->ctx, &d, &t->eager), MLA_OK);
  TU_STATUS(mla_backend_create(t->ctx, &d, &t->graph), MLA_OK);
  if (!t->eager || !t->graph) return;
  mla_backend_req_table(t->eager, &t->rt_e);
  mla_backend_req_table(t->graph, &t->rt_g);
  TU_STATUS(mla_backend_graph_init(t->graph, MAXB, 3), MLA_OK);
  int32_t *g_ids = NULL, *g_seq = NULL;
  TU_STATUS(mla_backend_graph_inputs(t->graph, &g_ids, &g_seq), MLA_OK);

  /* fixed-address per-step buffers (what a captured graph reads) */
  const int TQ = MAXB; /* one query per row (DECODE) */
  uint16_t *hq_n = malloc(2 * (size_t)TQ * H * MLA_LATENT), *hq_r = malloc(2 * (size_t)TQ * H * MLA_ROPE);
  uint16_t *hc = malloc(2 * (size_t)TQ * MLA_LATENT), *hr = malloc(2 * (size_t)TQ * MLA_ROPE);
  uint16_t *oe = malloc(2 * (size_t)TQ * H * MLA_LATENT), *og = malloc(2 * (size_t)TQ * H * MLA_LATENT);
  void *q_n = buf_new(t, 2 * (size_t)TQ * H * MLA_LATENT), *q_r = buf_new(t, 2 * (size_t)TQ * H * MLA_ROPE);
  void *c = buf_new(t, 2 * (size_t)TQ * MLA_LATENT), *r = buf_new(t, 2 * (size_t)TQ * MLA_ROPE);
  int32_t *slots = buf_new(t, sizeof(int32_t) * TQ);
  void *out[LAYERS];
  for (int l = 0; l < LAYERS; l++) out[l] = buf_new(t, 2 * (size_t)TQ * H * MLA_LATENT);

#ifdef MLA_TEST_CUDA
  cudaStream_t s = NULL;
  cudaGraphExec_t exec[MAXB + 1];
  memset(exec, 0, sizeof exec);
  if (t->cuda) {
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TU_STATUS(mla_ctx_set_stream(t->ctx, s), MLA_OK);
  }
#endif
  /* live requests: id -> length; both tables see the same calls */
  int live[16] = {0}, nlive = 0;
  int32_t ids[16];
  int mismatch = 0, errors = 0, replays = 0;
  for (int step = 0; step < STEPS; step++) {
    /* continuous batching: requests join (with a prompt) and finish */
    while (nlive < 6 || (nlive < MAXB && tu_uniform(&rng) < 0.3)) {
      int32_t a = -1, b = -1;
      const int prompt = tu_randint(&rng, 1, 300);
      if (mla_req_add(t->rt_e, &a) != MLA_OK || mla_req_add(t->rt_g, &b) != MLA_OK || a != b) errors++;
      if (mla_req_extend(t->rt_e, a, prompt, NULL) != MLA_OK || mla_req_extend(t->rt_g, b, prompt, NULL) != MLA_OK)
        errors++;
      ids[nlive] = a;
      live[nlive++] = prompt;
    }
    if (nlive > 3 && tu_uniform(&rng) < 0.25) {
      const int k = tu_randint(&rng, 0, nlive - 1);
      if (mla_req_free(t->rt_e, ids[k]) != MLA_OK || mla_req_free(t->rt_g, ids[k]) != MLA_OK) errors++;
      ids[k] = ids[nlive - 1];
      live[k] = live[nlive - 1];
      nlive--;
    }
    /* this step: every live request decodes one token; bucket = next even size */
    const int bs = nlive + (nlive & 1) > MAXB ? MAXB : nlive + (nlive & 1);
    int32_t rid[MAXB], seq[MAXB], slot[MAXB], slot_g[MAXB];
    for (int i = 0; i < bs; i++) {
      if (i < nlive) {
        if (mla_req_extend(t->rt_e, ids[i], 1, &slot[i]) != MLA_OK ||
            mla_req_extend(t->rt_g, ids[i], 1, &slot_g[i]) != MLA_OK || slot[i] != slot_g[i])
          errors++;
        live[i]++;
        rid[i] = ids[i];
        seq[i] = live[i];
      } else {
        rid[i] = MLA_REQ_PAD;
        seq[i] = 1;
        slot[i] = 0; /* the dummy slot */
      }
    }
    rand_bf16(hq_n, (int64_t)bs * H * MLA_LATENT);
    rand_bf16(hq_r, (int64_t)bs * H * MLA_ROPE);
    rand_bf16(hc, (int64_t)bs * MLA_LATENT);
    rand_bf16(hr, (int64_t)bs * MLA_ROPE);
    buf_put(t, q_n, hq_n, 2 * (size_t)bs * H * MLA_LATENT);
    buf_put(t, q_r, hq_r, 2 * (size_t)bs * H * MLA_ROPE);
    buf_put(t, c, hc, 2 * (size_t)bs * MLA_LATENT);
    buf_put(t, r, hr, 2 * (size_t)bs * MLA_ROPE);
    buf_put(t, slots, slot, sizeof(int32_t) * bs);

    /* the layers of one step on backend `be` (new rows of padding rows go
     * to the dummy slot 0, as engines do) */
#define RUN_LAYERS(be)                                                                   \
  do {                                                                                   \
    for (int l = 0; l < LAYERS; l++) {                                                   \
      mla_forward_args fa;                                                               \
      memset(&fa, 0, sizeof fa);                                                         \
      fa.layer = l;                                                                      \
      fa.num_new = bs;                                                                   \
      fa.new_slots = slots;                                                              \
      fa.new_c = c;                                                                      \
      fa.new_r = r;                                                                      \
      fa.q_nope = q_n;                                                                   \
      fa.q_rope = q_r;                                                                   \
      fa.out = out[l];                                                                   \
      if (mla_backend_forward((be), &fa) != MLA_OK) {                                    \
        errors++;                                                                        \
        printf("forward (%s): %s\n", dev, mla_backend_last_error(be));                    \
      }                                                                                  \
    }                                                                                    \
  } while (0)

    /* eager */
    mla_batch b;
    memset(&b, 0, sizeof b);
    b.mode = MLA_MODE_DECODE;
    b.batch_size = bs;
    b.req_ids = rid;
    b.seq_lens = seq;
    if (mla_backend_plan(t->eager, &b) != MLA_OK) {
      errors++;
      printf("plan (%s): %s\n", dev, mla_backend_last_error(t->eager));
    }
    RUN_LAYERS(t->eager);
    if (mla_ctx_synchronize(t->ctx) != MLA_OK) errors++;
    buf_get(t, oe, out[LAYERS - 1], 2 * (size_t)bs * H * MLA_LATENT);

    /* graph */
    buf_put(t, g_ids, rid, sizeof(int32_t) * bs);
    buf_put(t, g_seq, seq, sizeof(int32_t) * bs);
    if (mla_backend_sync(t->graph) != MLA_OK) errors++;
    if (!t->cuda) {
      if (mla_backend_graph_step(t->graph, MLA_MODE_DECODE, bs, 0) != MLA_OK) {
        errors++;
        printf("graph_step: %s\n", mla_backend_last_error(t->graph));
      }
      RUN_LAYERS(t->graph);
    }
#ifdef MLA_TEST_CUDA
    else {
      if (!exec[bs]) { /* capture this bucket once */
        cudaGraph_t gr;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        mla_status st = mla_backend_graph_step(t->graph, MLA_MODE_DECODE, bs, 0);
        RUN_LAYERS(t->graph);
        CK(cudaStreamEndCapture(s, &gr));
        if (st != MLA_OK) errors++;
        CK(cudaGraphInstantiate(&exec[bs], gr, 0));
        CK(cudaGraphDestroy(gr));
      }
      CK(cudaGraphLaunch(exec[bs], s));
      replays++;
    }
#endif
    if (mla_ctx_synchronize(t->ctx) != MLA_OK) errors++;
    buf_get(t, og, out[LAYERS - 1], 2 * (size_t)bs * H * MLA_LATENT);
    /* live rows only: padding rows are to be ignored */
    mismatch += memcmp(oe, og, 2 * (size_t)nlive * H * MLA_LATENT) != 0;
  }
  TU_CHECK(errors == 0, "%s: %d failed calls in the decode loop", dev, errors);
  TU_CHECK(mismatch == 0, "%s: %d of %d graph steps differ from the eager steps", dev, mismatch, STEPS);
  if (t->cuda) TU_CHECK(replays == STEPS, "cuda: %d replays", replays);

  /* refusals */
  TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_DECODE, MAXB + 1, 0), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_TARGET_VERIFY, 2, 4), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_EXTEND, 2, 0), MLA_ERR_BAD_STATE); /* no init_extend */
  TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_IDLE, 2, 0), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_DECODE, 2, 1), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_init(t->graph, MAXB, 3), MLA_ERR_BAD_STATE);
  TU_STATUS(mla_backend_graph_init(t->eager, MAXB + 1, 0), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_init(t->eager, MAXB, 65), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_inputs(t->eager, &g_ids, &g_seq), MLA_ERR_BAD_STATE);
  TU_STATUS(mla_backend_graph_step(t->eager, MLA_MODE_DECODE, 1, 0), MLA_ERR_BAD_STATE);
  TU_STATUS(mla_backend_graph_inputs(t->graph, NULL, &g_seq), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_graph_init(NULL, 1, 0), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_sync(NULL), MLA_ERR_INVALID_ARGUMENT);
  /* TARGET_VERIFY through the graph buffers: a live request of enough length */
  {
    int32_t rid1 = ids[0], seq1 = live[0] - 3;
    buf_put(t, g_ids, &rid1, sizeof rid1);
    buf_put(t, g_seq, &seq1, sizeof seq1);
    TU_STATUS(mla_backend_sync(t->graph), MLA_OK);
    TU_STATUS(mla_backend_graph_step(t->graph, MLA_MODE_TARGET_VERIFY, 1, 3), MLA_OK);
    const mla_plan *p = NULL;
    TU_STATUS(mla_backend_get_plan(t->graph, &p), MLA_ERR_UNSUPPORTED);
  }
#ifdef MLA_TEST_CUDA
  if (t->cuda) {
    for (int i = 0; i <= MAXB; i++)
      if (exec[i]) CK(cudaGraphExecDestroy(exec[i]));
    TU_STATUS(mla_ctx_set_stream(t->ctx, NULL), MLA_OK);
    CK(cudaStreamDestroy(s));
  }
#endif
  free(hq_n);
  free(hq_r);
  free(hc);
  free(hr);
  free(oe);
  free(og);
  buf_free(t, q_n);
  buf_free(t, q_r);
  buf_free(t, c);
  buf_free(t, r);
  buf_free(t, slots);
  for (int l = 0; l < LAYERS; l++) buf_free(t, out[l]);
  mla_backend_destroy(t->eager);
  mla_backend_destroy(t->graph);
}

/* Multi-step draft: draft_prepare once, then step i (select + forward with
 * draft token i's row and queries) on the graph backend, against an eager
 * DECODE plan with seq_len + i + 1 keys on the eager backend, bit for bit;
 * on CUDA the prepare and all steps are one captured graph. */
static void draft_flow(twin *t) {
  const char *dev = t->cuda ? "cuda" : "cpu";
  enum { STEPS_N = 3, NB = 5 };
  mla_backend_desc d = desc_of();
  mla_backend *eb_ = NULL, *gb = NULL;
  TU_STATUS(mla_backend_create(t->ctx, &d, &eb_), MLA_OK);
  TU_STATUS(mla_backend_create(t->ctx, &d, &gb), MLA_OK);
  if (!eb_ || !gb) return;
  mla_req_table *rte, *rtg;
  mla_backend_req_table(eb_, &rte);
  mla_backend_req_table(gb, &rtg);
  TU_STATUS(mla_backend_draft_init(gb, STEPS_N), MLA_ERR_BAD_STATE); /* graph buffers first */
  TU_STATUS(mla_backend_graph_init(gb, MAXB, 0), MLA_OK);
  TU_STATUS(mla_backend_draft_init(gb, 17), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_draft_init(gb, STEPS_N), MLA_OK);
  TU_STATUS(mla_backend_draft_select(gb, 0), MLA_ERR_BAD_STATE);
  int32_t *g_ids = NULL, *g_seq = NULL;
  TU_STATUS(mla_backend_graph_inputs(gb, &g_ids, &g_seq), MLA_OK);
  mla_kv_cache *ce, *cg;
  mla_backend_cache(eb_, &ce);
  mla_backend_cache(gb, &cg);
  /* requests with prompts whose rows are written directly into both caches */
  int32_t ids[NB], seq[NB], slot_draft[NB][STEPS_N];
  int errors = 0;
  for (int i = 0; i < NB; i++) {
    int32_t a = -1, b = -1;
    const int n = tu_randint(&rng, 30, 250);
    int32_t *sl = malloc(sizeof(int32_t) * n), *sl2 = malloc(sizeof(int32_t) * n);
    if (mla_req_add(rte, &a) || mla_req_add(rtg, &b) || a != b || mla_req_extend(rte, a, n, sl) ||
        mla_req_extend(rtg, b, n, sl2) || memcmp(sl, sl2, sizeof(int32_t) * n))
      errors++;
    uint16_t *hc = malloc(2 * (size_t)n * MLA_LATENT), *hr = malloc(2 * (size_t)n * MLA_ROPE);
    rand_bf16(hc, (int64_t)n * MLA_LATENT);
    rand_bf16(hr, (int64_t)n * MLA_ROPE);
    void *dc = buf_new(t, 2 * (size_t)n * MLA_LATENT), *dr = buf_new(t, 2 * (size_t)n * MLA_ROPE);
    int32_t *ds = buf_new(t, sizeof(int32_t) * n);
    buf_put(t, dc, hc, 2 * (size_t)n * MLA_LATENT);
    buf_put(t, dr, hr, 2 * (size_t)n * MLA_ROPE);
    buf_put(t, ds, sl, sizeof(int32_t) * n);
    if (mla_kv_cache_write(ce, 0, n, ds, dc, dr, MLA_DTYPE_BF16) || mla_kv_cache_write(cg, 0, n, ds, dc, dr, MLA_DTYPE_BF16))
      errors++;
    if (mla_ctx_synchronize(t->ctx)) errors++;
    buf_free(t, dc);
    buf_free(t, dr);
    buf_free(t, ds);
    free(hc);
    free(hr);
    free(sl);
    free(sl2);
    /* the draft tokens' slots */
    int32_t s2[STEPS_N];
    if (mla_req_extend(rte, a, STEPS_N, slot_draft[i]) || mla_req_extend(rtg, b, STEPS_N, s2) ||
        memcmp(s2, slot_draft[i], sizeof s2))
      errors++;
    ids[i] = a;
    seq[i] = n;
  }
  /* per step: q, one new row per request, the output; fixed buffers */
  void *q_n[STEPS_N], *q_r[STEPS_N], *c[STEPS_N], *r[STEPS_N], *out[STEPS_N];
  int32_t *slots[STEPS_N];
  uint16_t *hq = malloc(2 * (size_t)NB * H * MLA_LATENT);
  for (int k = 0; k < STEPS_N; k++) {
    q_n[k] = buf_new(t, 2 * (size_t)NB * H * MLA_LATENT);
    q_r[k] = buf_new(t, 2 * (size_t)NB * H * MLA_ROPE);
    c[k] = buf_new(t, 2 * (size_t)NB * MLA_LATENT);
    r[k] = buf_new(t, 2 * (size_t)NB * MLA_ROPE);
    out[k] = buf_new(t, 2 * (size_t)NB * H * MLA_LATENT);
    slots[k] = buf_new(t, sizeof(int32_t) * NB);
    rand_bf16(hq, (int64_t)NB * H * MLA_LATENT);
    buf_put(t, q_n[k], hq, 2 * (size_t)NB * H * MLA_LATENT);
    rand_bf16(hq, (int64_t)NB * H * MLA_ROPE);
    buf_put(t, q_r[k], hq, 2 * (size_t)NB * H * MLA_ROPE);
    rand_bf16(hq, (int64_t)NB * MLA_LATENT);
    buf_put(t, c[k], hq, 2 * (size_t)NB * MLA_LATENT);
    rand_bf16(hq, (int64_t)NB * MLA_ROPE);
    buf_put(t, r[k], hq, 2 * (size_t)NB * MLA_ROPE);
    int32_t sk[NB];
    for (int i = 0; i < NB; i++) sk[i] = slot_draft[i][k];
    buf_put(t, slots[k], sk, sizeof sk);
  }
  uint16_t *oe = malloc(2 * (size_t)NB * H * MLA_LATENT), *og = malloc(2 * (size_t)NB * H * MLA_LATENT);
#define DRAFT_FORWARD(be, k)                \
  do {                                      \
    mla_forward_args fa;                    \
    memset(&fa, 0, sizeof fa);              \
    fa.layer = 0;                           \
    fa.num_new = NB;                        \
    fa.new_slots = slots[k];                \
    fa.new_c = c[k];                        \
    fa.new_r = r[k];                        \
    fa.q_nope = q_n[k];                     \
    fa.q_rope = q_r[k];                     \
    fa.out = out[k];                        \
    if (mla_backend_forward((be), &fa)) {   \
      errors++;                             \
      printf("draft forward (%s): %s\n", dev, mla_backend_last_error(be)); \
    }                                       \
  } while (0)
  /* graph backend: prepare once, then the steps */
  buf_put(t, g_ids, ids, sizeof ids);
  buf_put(t, g_seq, seq, sizeof seq);
  if (mla_backend_sync(gb)) errors++;
  if (!t->cuda) {
    if (mla_backend_draft_prepare(gb, NB, STEPS_N)) errors++;
    for (int k = 0; k < STEPS_N; k++) {
      if (mla_backend_draft_select(gb, k)) errors++;
      DRAFT_FORWARD(gb, k);
    }
  }
#ifdef MLA_TEST_CUDA
  else {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TU_STATUS(mla_ctx_set_stream(t->ctx, s), MLA_OK);
    cudaGraph_t gr;
    cudaGraphExec_t ex;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    if (mla_backend_draft_prepare(gb, NB, STEPS_N)) errors++;
    for (int k = 0; k < STEPS_N; k++) {
      if (mla_backend_draft_select(gb, k)) errors++;
      DRAFT_FORWARD(gb, k);
    }
    CK(cudaStreamEndCapture(s, &gr));
    CK(cudaGraphInstantiate(&ex, gr, 0));
    CK(cudaGraphLaunch(ex, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaGraphExecDestroy(ex));
    CK(cudaGraphDestroy(gr));
    TU_STATUS(mla_ctx_set_stream(t->ctx, NULL), MLA_OK);
    CK(cudaStreamDestroy(s));
  }
#endif
  if (mla_ctx_synchronize(t->ctx)) errors++;
  int mismatch = 0;
  uint16_t *gsave = malloc(2 * (size_t)NB * H * MLA_LATENT * STEPS_N);
  for (int k = 0; k < STEPS_N; k++) buf_get(t, gsave + (size_t)k * NB * H * MLA_LATENT, out[k], 2 * (size_t)NB * H * MLA_LATENT);
  /* eager: DECODE with seq + k + 1 keys */
  for (int k = 0; k < STEPS_N; k++) {
    int32_t sk[NB];
    for (int i = 0; i < NB; i++) sk[i] = seq[i] + k + 1;
    mla_batch b;
    memset(&b, 0, sizeof b);
    b.mode = MLA_MODE_DECODE;
    b.batch_size = NB;
    b.req_ids = ids;
    b.seq_lens = sk;
    if (mla_backend_plan(eb_, &b)) errors++;
    DRAFT_FORWARD(eb_, k);
    if (mla_ctx_synchronize(t->ctx)) errors++;
    buf_get(t, oe, out[k], 2 * (size_t)NB * H * MLA_LATENT);
    mismatch += memcmp(oe, gsave + (size_t)k * NB * H * MLA_LATENT, 2 * (size_t)NB * H * MLA_LATENT) != 0;
  }
  TU_CHECK(errors == 0, "%s draft: %d failed calls", dev, errors);
  TU_CHECK(mismatch == 0, "%s draft: %d of %d steps differ from eager DECODE", dev, mismatch, STEPS_N);
  /* the selected draft step's metadata: kv lengths seq + step + 1 */
  {
    mla_step_metadata m;
    TU_STATUS(mla_backend_draft_select(gb, 1), MLA_OK);
    TU_STATUS(mla_backend_step_metadata(gb, &m), MLA_OK);
    int32_t kv[NB];
    buf_get(t, kv, m.kv_lens, sizeof kv);
    int bad = m.batch_size != NB;
    for (int i = 0; i < NB; i++) bad += kv[i] != seq[i] + 2;
    TU_CHECK(bad == 0, "%s draft: step 1 metadata kv_lens", dev);
    TU_STATUS(mla_backend_step_metadata(gb, NULL), MLA_ERR_INVALID_ARGUMENT);
    /* the eager backend's last DECODE: a host plan on the CPU, a device step on CUDA */
    TU_STATUS(mla_backend_step_metadata(eb_, &m), t->cuda ? MLA_OK : MLA_ERR_BAD_STATE);
  }
  TU_STATUS(mla_backend_draft_select(gb, STEPS_N), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_draft_prepare(gb, MAXB + 1, 2), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_draft_prepare(gb, 2, STEPS_N + 1), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_draft_init(gb, STEPS_N), MLA_ERR_BAD_STATE);
  free(gsave);
  free(hq);
  free(oe);
  free(og);
  for (int k = 0; k < STEPS_N; k++) {
    buf_free(t, q_n[k]);
    buf_free(t, q_r[k]);
    buf_free(t, c[k]);
    buf_free(t, r[k]);
    buf_free(t, out[k]);
    buf_free(t, slots[k]);
  }
  mla_backend_destroy(eb_);
  mla_backend_destroy(gb);
}

/* EXTEND graph steps (the paged absorbed prefill at a token bucket) against
 * the eager EXTEND plan over a prefix (absorbed impl) on a twin backend with
 * the same table operations: per round every request extends by 0..9 tokens
 * (the graph rows padded to a batch bucket, the queries to the token
 * bucket); the graph step's schedule is sized for the bucket, the plan's for
 * the longest extend, so results agree to rounding (bf16 outputs: |g - e| <=
 * 0.02 + 0.02 |e|, cosine distance < 1e-5); rows past the real total stay
 * untouched. Refusals: EXTEND before mla_backend_graph_init_extend, a bucket
 * past its max_tokens, init_extend twice. */
static void extend_flow(twin *t) {
  const char *dev = t->cuda ? "cuda" : "cpu";
  mla_backend_desc d = desc_of();
  d.extend_impl = MLA_EXTEND_ABSORBED;
  mla_backend *be_e = NULL, *be_g = NULL;
  TU_STATUS(mla_backend_create(t->ctx, &d, &be_e), MLA_OK);
  TU_STATUS(mla_backend_create(t->ctx, &d, &be_g), MLA_OK);
  if (!be_e || !be_g) return;
  mla_req_table *rt_e, *rt_g;
  mla_backend_req_table(be_e, &rt_e);
  mla_backend_req_table(be_g, &rt_g);
  const int BS = 5, BUCKET = 48;
  TU_STATUS(mla_backend_graph_init(be_g, MAXB, 0), MLA_OK);
  int32_t *g_ids = NULL, *g_seq = NULL, *g_ext = NULL;
  TU_STATUS(mla_backend_graph_inputs(be_g, &g_ids, &g_seq), MLA_OK);
  TU_STATUS(mla_backend_graph_step(be_g, MLA_MODE_EXTEND, BS, 8), MLA_ERR_BAD_STATE); /* not initialised */
  TU_STATUS(mla_backend_graph_init_extend(be_g, BUCKET, &g_ext), MLA_OK);
  TU_STATUS(mla_backend_graph_init_extend(be_g, BUCKET, &g_ext), MLA_ERR_BAD_STATE);
  TU_STATUS(mla_backend_graph_step(be_g, MLA_MODE_EXTEND, BS, BUCKET + 1), MLA_ERR_INVALID_ARGUMENT);

  /* requests with cached prefixes (rows written straight into both caches) */
  int32_t ids[MAXB], len[MAXB];
  int ok = 1;
  mla_kv_cache *ce, *cg;
  mla_backend_cache(be_e, &ce);
  mla_backend_cache(be_g, &cg);
  for (int i = 0; i < BS; i++) {
    int32_t a = -1, b = -1;
    ok &= mla_req_add(rt_e, &a) == MLA_OK && mla_req_add(rt_g, &b) == MLA_OK && a == b;
    ids[i] = a;
    len[i] = tu_randint(&rng, 1, 300);
    int32_t *se = malloc(sizeof(int32_t) * (size_t)len[i]), *sg = malloc(sizeof(int32_t) * (size_t)len[i]);
    ok &= mla_req_extend(rt_e, a, len[i], se) == MLA_OK && mla_req_extend(rt_g, b, len[i], sg) == MLA_OK &&
          memcmp(se, sg, sizeof(int32_t) * (size_t)len[i]) == 0;
    uint16_t *hc = malloc(2 * (size_t)len[i] * MLA_LATENT), *hr = malloc(2 * (size_t)len[i] * MLA_ROPE);
    void *dc = buf_new(t, 2 * (size_t)len[i] * MLA_LATENT), *dr = buf_new(t, 2 * (size_t)len[i] * MLA_ROPE);
    int32_t *ds = buf_new(t, sizeof(int32_t) * (size_t)len[i]);
    buf_put(t, ds, se, sizeof(int32_t) * (size_t)len[i]);
    for (int l = 0; l < LAYERS; l++) {
      rand_bf16(hc, (int64_t)len[i] * MLA_LATENT);
      rand_bf16(hr, (int64_t)len[i] * MLA_ROPE);
      buf_put(t, dc, hc, 2 * (size_t)len[i] * MLA_LATENT);
      buf_put(t, dr, hr, 2 * (size_t)len[i] * MLA_ROPE);
      ok &= mla_kv_cache_write(ce, l, len[i], ds, dc, dr, MLA_DTYPE_BF16) == MLA_OK &&
            mla_kv_cache_write(cg, l, len[i], ds, dc, dr, MLA_DTYPE_BF16) == MLA_OK;
    }
    free(se), free(sg), free(hc), free(hr);
    buf_free(t, dc), buf_free(t, dr), buf_free(t, ds);
  }
  TU_CHECK(ok, "%s extend flow: set-up", dev);

  const size_t qn_b = 2 * (size_t)BUCKET * H * MLA_LATENT, qr_b = 2 * (size_t)BUCKET * H * MLA_ROPE;
  uint16_t *hq_n = malloc(qn_b), *hq_r = malloc(qr_b), *hc = malloc(2 * (size_t)BUCKET * MLA_LATENT),
           *hr = malloc(2 * (size_t)BUCKET * MLA_ROPE), *oe = malloc(qn_b), *og = malloc(qn_b);
  void *q_n = buf_new(t, qn_b), *q_r = buf_new(t, qr_b), *c = buf_new(t, 2 * (size_t)BUCKET * MLA_LATENT),
       *r = buf_new(t, 2 * (size_t)BUCKET * MLA_ROPE), *out_e = buf_new(t, qn_b), *out_g = buf_new(t, qn_b);
  int32_t *slots = buf_new(t, sizeof(int32_t) * BUCKET), *hslots = malloc(sizeof(int32_t) * BUCKET);
  int far = 0, touched = 0, fails = 0, rows_total = 0;
  double dot = 0, n1 = 0, n2 = 0;
  for (int round = 0; round < 6; round++) {
    int32_t pre[MAXB], seq[MAXB], ext[MAXB], hid[MAXB], hseq[MAXB], hext[MAXB];
    int T = 0;
    for (int i = 0; i < BS; i++) {
      ext[i] = tu_randint(&rng, 0, 9);
      pre[i] = len[i];
      int32_t *se = hslots + T, sg[16];
      ok &= mla_req_extend(rt_e, ids[i], ext[i], se) == MLA_OK && mla_req_extend(rt_g, ids[i], ext[i], sg) == MLA_OK &&
            memcmp(se, sg, sizeof(int32_t) * (size_t)ext[i]) == 0;
      len[i] += ext[i];
      seq[i] = len[i];
      T += ext[i];
    }
    rows_total += T;
    int B = 1; /* the batch bucket: rows past BS are padding */
    while (B < BS) B <<= 1;
    for (int i = 0; i < B; i++) {
      hid[i] = i < BS ? ids[i] : MLA_REQ_PAD;
      hseq[i] = i < BS ? seq[i] : 1;
      hext[i] = i < BS ? ext[i] : 0;
    }
    for (int k = T; k < BUCKET; k++) hslots[k] = 0; /* padding rows write the reserved slot 0 */
    rand_bf16(hq_n, (int64_t)BUCKET * H * MLA_LATENT);
    rand_bf16(hq_r, (int64_t)BUCKET * H * MLA_ROPE);
    buf_put(t, q_n, hq_n, qn_b);
    buf_put(t, q_r, hq_r, qr_b);
    buf_put(t, slots, hslots, sizeof(int32_t) * BUCKET);
    for (int l = 0; l < LAYERS; l++) {
      rand_bf16(hc, (int64_t)BUCKET * MLA_LATENT);
      rand_bf16(hr, (int64_t)BUCKET * MLA_ROPE);
      buf_put(t, c, hc, 2 * (size_t)BUCKET * MLA_LATENT);
      buf_put(t, r, hr, 2 * (size_t)BUCKET * MLA_ROPE);
      /* eager: the host plan of EXTEND over the prefix */
      mla_batch b;
      memset(&b, 0, sizeof b);
      b.mode = MLA_MODE_EXTEND;
      b.batch_size = BS;
      b.req_ids = ids;
      b.seq_lens = seq;
      b.prefix_lens = pre;
      mla_forward_args a;
      memset(&a, 0, sizeof a);
      a.layer = l;
      a.num_new = T;
      a.new_slots = slots;
      a.new_c = c;
      a.new_r = r;
      a.q_nope = q_n;
      a.q_rope = q_r;
      a.out = out_e;
      if (l == 0) fails += mla_backend_plan(be_e, &b) != MLA_OK;
      fails += mla_backend_forward(be_e, &a) != MLA_OK;
      /* graph step: fixed inputs, the whole bucket */
      if (l == 0) {
        buf_put(t, g_ids, hid, sizeof(int32_t) * (size_t)B);
        buf_put(t, g_seq, hseq, sizeof(int32_t) * (size_t)B);
        buf_put(t, g_ext, hext, sizeof(int32_t) * (size_t)B);
        fails += mla_backend_sync(be_g) != MLA_OK;
        fails += mla_backend_graph_step(be_g, MLA_MODE_EXTEND, B, BUCKET) != MLA_OK;
        int uses_mha = 1;
        fails += mla_backend_uses_mha(be_g, &uses_mha) != MLA_OK || uses_mha != 0;
      }
      uint16_t *poison = malloc(qn_b);
      memset(poison, 0xFF, qn_b);
      buf_put(t, out_g, poison, qn_b);
      free(poison);
      a.num_new = BUCKET;
      a.out = out_g;
      const mla_status st = mla_backend_forward(be_g, &a);
      if (st != MLA_OK) {
        fails++;
        printf("  graph EXTEND forward: %s\n", mla_backend_last_error(be_g));
      }
      fails += mla_ctx_synchronize(t->ctx) != MLA_OK;
      buf_get(t, oe, out_e, 2 * (size_t)T * H * MLA_LATENT);
      buf_get(t, og, out_g, qn_b);
      for (int64_t k = 0; k < (int64_t)T * H * MLA_LATENT; k++) {
        double x, y;
        tu_from_dtype(MLA_DTYPE_BF16, oe + k, &x, 1);
        tu_from_dtype(MLA_DTYPE_BF16, og + k, &y, 1);
        far += !(fabs(x - y) <= 0.02 + 0.02 * fabs(x));
        dot += x * y, n1 += x * x, n2 += y * y;
      }
      touched += !tu_all_poisoned(og + (size_t)T * H * MLA_LATENT, qn_b - 2 * (size_t)T * H * MLA_LATENT);
    }
  }
  const double cosd = n1 > 0 && n2 > 0 ? 1.0 - dot / sqrt(n1 * n2) : 1.0;
  TU_CHECK(ok && fails == 0, "%s extend flow: %d failed calls", dev, fails);
  TU_CHECK(far == 0 && cosd < 1e-5, "%s extend flow: %d elements differ from the eager plan's (cos dist %.3g)", dev,
           far, cosd);
  TU_CHECK(touched == 0, "%s extend flow: %d layers wrote rows past the real total", dev, touched);
  printf("  %s EXTEND graph steps: 6 rounds, %d query tokens, bucket %d, cos dist %.2e\n", dev, rows_total, BUCKET,
         cosd);
  free(hq_n), free(hq_r), free(hc), free(hr), free(oe), free(og), free(hslots);
  buf_free(t, q_n), buf_free(t, q_r), buf_free(t, c), buf_free(t, r), buf_free(t, out_e), buf_free(t, out_g);
  buf_free(t, slots);
  mla_backend_destroy(be_e);
  mla_backend_destroy(be_g);
}

int main(void) {
  rng.s = tu_seed("test_backend_graph", 20261130);
  twin t;
  memset(&t, 0, sizeof t);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &t.ctx), MLA_OK);
  if (t.ctx) {
    decode_loop(&t);
    draft_flow(&t);
    extend_flow(&t);
    mla_ctx_destroy(t.ctx);
  }
#ifdef MLA_TEST_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
    memset(&t, 0, sizeof t);
    mla_ctx_desc gd = {MLA_DEVICE_CUDA, 0, 0};
    TU_STATUS(mla_ctx_create(&gd, &t.ctx), MLA_OK);
    t.cuda = 1;
    if (t.ctx) {
      decode_loop(&t);
      draft_flow(&t);
      extend_flow(&t);
      mla_ctx_destroy(t.ctx);
    }
  } else {
    printf("test_backend_graph: cuda part skipped: no GPU\n");
  }
#else
  printf("test_backend_graph: cuda part skipped: built without CUDA\n");
#endif
  return tu_finish("test_backend_graph");
}
