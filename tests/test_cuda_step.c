/* mla_step_* on a CUDA context: the device-built metadata (index kernel +
 * schedule kernel) equals mla_plan_build's for the same batch; the step's
 * attention equals mla_attention_absorbed over the uploaded host plan bit for
 * bit, and the CPU step's result within bf16 tolerance; a row with an
 * out-of-range request id is emptied (o = 0, lse = -inf), reported by
 * mla_ctx_synchronize, and leaves the other rows as they were up to rounding
 * (the schedule changes with the row's length); and one step (prepare + attention) captured in a CUDA
 * graph on a non-blocking stream, then replayed 100 times after rewriting the
 * fixed-address inputs (request ids, lengths, padding rows), matches the
 * eager calls bit for bit. The captured graph holds kernel nodes only (no
 * memcpy: nothing comes back to the host). Host pointers are refused
 * (INVALID_ARGUMENT, nothing written) also after every device pointer of a
 * step has been seen. Skips without CUDA or a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_step: skipped: built without CUDA\n");
  return tu_finish("test_cuda_step");
}
#else
#include "cuda_util.h"
#include "plan/plan.h"       /* white box: mla_step_sched_rule */
#include "plan/step_build.h" /* white box: the host schedule (mla_split_schedule_body) */
#include "test_step_world.h"

static tu_rng rng;
static mla_ctx *cpu, *gpu;

typedef struct dev_step {
  mla_kv_cache *dcache;
  int32_t *r2t, *ids, *seq; /* device inputs at fixed addresses */
  void *qn, *qr, *o, *ws;
  float *lse;
  size_t o_bytes, lse_bytes, ws_bytes;
} dev_step;

static int dev_make(dev_step *d, const sw_world *w, int max_bs, int max_tq) {
  memset(d, 0, sizeof *d);
  mla_kv_cache_desc cd;
  mla_kv_cache_get_desc(w->cache, &cd);
  if (mla_kv_cache_create(gpu, &cd, &d->dcache) != MLA_OK) return -1;
  void *hp = NULL, *dp = NULL;
  size_t rb = 0;
  mla_kv_cache_layer_data(w->cache, 0, &hp);
  mla_kv_cache_layer_data(d->dcache, 0, &dp);
  mla_kv_cache_row_bytes(w->cache, &rb);
  CK(cudaMemcpy(dp, hp, rb * (size_t)cd.num_pages * cd.page_size, cudaMemcpyHostToDevice));
  d->r2t = tu_dev_copy(w->r2t, sizeof(int32_t) * (size_t)w->max_reqs * w->max_context);
  d->ids = tu_dev_alloc(sizeof(int32_t) * max_bs);
  d->seq = tu_dev_alloc(sizeof(int32_t) * max_bs);
  d->qn = tu_dev_alloc(2 * (size_t)max_tq * w->H * MLA_LATENT);
  d->qr = tu_dev_alloc(2 * (size_t)max_tq * w->H * MLA_ROPE);
  d->o_bytes = 2 * (size_t)max_tq * w->H * MLA_LATENT;
  d->lse_bytes = sizeof(float) * (size_t)max_tq * w->H;
  d->o = tu_dev_alloc(d->o_bytes);
  d->lse = tu_dev_alloc(d->lse_bytes);
  return 0;
}

static void dev_free(dev_step *d) {
  mla_kv_cache_destroy(d->dcache);
  cudaFree(d->r2t);
  cudaFree(d->ids);
  cudaFree(d->seq);
  cudaFree(d->qn);
  cudaFree(d->qr);
  cudaFree(d->o);
  cudaFree(d->lse);
  cudaFree(d->ws);
}

/* The batch's inputs and queries into the fixed device buffers. */
static void dev_load(dev_step *d, const sw_world *w) {
  CK(cudaMemcpy(d->ids, w->req_ids, sizeof(int32_t) * w->bs, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->seq, w->seq, sizeof(int32_t) * w->bs, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->qn, w->qn, 2 * (size_t)w->Tq * w->H * MLA_LATENT, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->qr, w->qr, 2 * (size_t)w->Tq * w->H * MLA_ROPE, cudaMemcpyHostToDevice));
}

static mla_absorbed_args dev_args(const sw_world *w, dev_step *d) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = SW_SCALE;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = d->qn;
  a.q_rope = d->qr;
  a.out = d->o;
  a.lse = d->lse;
  return a;
}

static void poison_out(dev_step *d) {
  CK(cudaMemset(d->o, 0xFF, d->o_bytes));
  CK(cudaMemset(d->lse, 0xFF, d->lse_bytes));
  CK(cudaDeviceSynchronize());
}

/* One eager step: prepare + attention, results copied to o / lse (host). */
static mla_status eager_step(const sw_world *w, dev_step *d, const mla_step_desc *desc, void *o, float *lse) {
  mla_step_inputs in = {d->r2t, w->max_context, w->max_reqs, d->ids, d->seq, NULL};
  mla_absorbed_args a = dev_args(w, d);
  mla_status st = mla_step_prepare(gpu, desc, d->dcache, &in, d->ws, d->ws_bytes);
  if (st == MLA_OK) st = mla_step_attention(gpu, desc, d->dcache, 0, &a, d->ws, d->ws_bytes);
  mla_status sy = mla_ctx_synchronize(gpu);
  if (st == MLA_OK) st = sy;
  CK(cudaMemcpy(o, d->o, 2 * (size_t)w->Tq * w->H * MLA_LATENT, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse, d->lse, sizeof(float) * (size_t)w->Tq * w->H, cudaMemcpyDeviceToHost));
  return st;
}

static void metadata_and_attention(mla_mode mode, int ndt, int P, int H) {
  char name[96];
  snprintf(name, sizeof name, "mode=%d ndt=%d P=%d H=%d", (int)mode, ndt, P, H);
  sw_world w;
  if (sw_make(&w, cpu, &rng, mode, ndt, P, H, 16) != 0 || sw_batch(&w, cpu, &rng, 16, 3) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  dev_step d;
  if (dev_make(&d, &w, 16, w.Tq) != 0) {
    TU_CHECK(0, "%s: device setup: %s", name, mla_ctx_last_error(gpu));
    return;
  }
  dev_load(&d, &w);
  const mla_step_desc desc = sw_desc(&w);
  TU_STATUS(mla_step_workspace_size(gpu, &desc, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  CK(cudaMemset(d.ws, 0xA5, d.ws_bytes));
  mla_step_inputs in = {d.r2t, w.max_context, w.max_reqs, d.ids, d.seq, NULL};
  TU_STATUS(mla_step_prepare(gpu, &desc, d.dcache, &in, d.ws, d.ws_bytes), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(gpu, &desc, d.ws, d.ws_bytes, &m), MLA_OK);
  const size_t bt_n = (size_t)w.bs * m.block_table_width, sm_n = (size_t)m.num_sm_parts * MLA_SCHED_META_INTS;
  int32_t *qo = malloc(4 * (w.bs + 1)), *kv = malloc(4 * w.bs), *bt = malloc(4 * bt_n), *sc = malloc(4 * sm_n),
          *ns = malloc(4 * (w.bs + 1));
  CK(cudaMemcpy(qo, m.qo_indptr, 4 * (w.bs + 1), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(kv, m.kv_lens, 4 * w.bs, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(bt, m.block_table, 4 * bt_n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sc, m.sched_meta, 4 * sm_n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ns, m.num_splits, 4 * (w.bs + 1), cudaMemcpyDeviceToHost));
  const int bad = sw_compare_meta(&w, &m, qo, kv, bt, sc, ns);
  TU_CHECK(bad == 0, "%s: %d device metadata fields differ from mla_plan_build", name, bad);
  TU_CHECK(w.plan.total_splits > w.bs, "%s: the batch should have a split request (total_splits %d)", name,
           (int)w.plan.total_splits);

  /* step attention vs the host-plan attention on the same GPU, bit for bit */
  const size_t ob = 2 * (size_t)w.Tq * H * MLA_LATENT, lb = sizeof(float) * (size_t)w.Tq * H;
  uint16_t *o1 = malloc(ob), *o2 = malloc(ob), *oc = malloc(ob);
  float *l1 = malloc(lb), *l2 = malloc(lb), *lc = malloc(lb);
  poison_out(&d);
  TU_STATUS(eager_step(&w, &d, &desc, o1, l1), MLA_OK);
  poison_out(&d);
  size_t pwb = 0;
  TU_STATUS(mla_attention_absorbed_workspace_size(gpu, &w.plan, H, &pwb), MLA_OK);
  void *pw = tu_dev_alloc(pwb);
  mla_absorbed_args a = dev_args(&w, &d);
  TU_STATUS(mla_attention_absorbed(gpu, d.dcache, 0, &w.plan, &a, pw, pwb), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  CK(cudaMemcpy(o2, d.o, ob, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(l2, d.lse, lb, cudaMemcpyDeviceToHost));
  TU_CHECK(memcmp(o1, o2, ob) == 0 && memcmp(l1, l2, lb) == 0,
           "%s: step attention differs from the host-plan attention on the GPU", name);

  /* against the CPU step (the reference): cosine distance and lse, live rows */
  {
    size_t cwb = 0;
    TU_STATUS(mla_step_workspace_size(cpu, &desc, &cwb), MLA_OK);
    void *cws = malloc(cwb);
    mla_step_inputs cin = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, NULL};
    mla_absorbed_args ca;
    memset(&ca, 0, sizeof ca);
    ca.num_heads = H;
    ca.scale = SW_SCALE;
    ca.act_dtype = MLA_DTYPE_BF16;
    ca.q_nope = w.qn;
    ca.q_rope = w.qr;
    ca.out = oc;
    ca.lse = lc;
    TU_STATUS(mla_step_prepare(cpu, &desc, w.cache, &cin, cws, cwb), MLA_OK);
    TU_STATUS(mla_step_attention(cpu, &desc, w.cache, 0, &ca, cws, cwb), MLA_OK);
    double dot = 0, n1 = 0, n2 = 0, lerr = 0;
    const int ql = sw_q_len(&w);
    for (int i = 0; i < w.bs; i++) {
      if (w.req_ids[i] == MLA_REQ_PAD) continue;
      for (int64_t e = (int64_t)i * ql * H * MLA_LATENT; e < (int64_t)(i + 1) * ql * H * MLA_LATENT; e++) {
        const double x = tu_bf16_to_f32(o1[e]), y = tu_bf16_to_f32(oc[e]);
        dot += x * y;
        n1 += x * x;
        n2 += y * y;
      }
      for (int64_t e = (int64_t)i * ql * H; e < (int64_t)(i + 1) * ql * H; e++)
        if (isfinite(lc[e]) || isfinite(l1[e])) {
          const double de = fabs((double)l1[e] - lc[e]);
          if (!(de <= lerr)) lerr = de;
        }
    }
    const double cosd = 1.0 - dot / sqrt(n1 * n2);
    TU_CHECK(cosd < 5e-5 && lerr < 1e-3, "%s: GPU step vs CPU step: cosine distance %.3g, lse err %.3g", name, cosd,
             lerr);
    free(cws);
  }

  /* an out-of-range request id: that row is emptied and counted, the others unchanged */
  {
    int row = 0;
    while (w.req_ids[row] == MLA_REQ_PAD) row++;
    int32_t bad_id = w.max_reqs + 3;
    CK(cudaMemcpy(d.ids + row, &bad_id, 4, cudaMemcpyHostToDevice));
    poison_out(&d);
    TU_STATUS(eager_step(&w, &d, &desc, o2, l2), MLA_ERR_OUT_OF_RANGE);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK); /* reported once, then cleared */
    const int ql = sw_q_len(&w);
    const size_t r0 = (size_t)row * ql * H, rn = (size_t)ql * H;
    int zero = 1, ninf = 1;
    for (size_t e = r0 * MLA_LATENT; e < (r0 + rn) * MLA_LATENT; e++) zero &= o2[e] == 0;
    for (size_t e = r0; e < r0 + rn; e++) ninf &= isinf(l2[e]) && l2[e] < 0;
    TU_CHECK(zero && ninf, "%s: the out-of-range row is not o = 0, lse = -inf", name);
    /* The emptied row changes the split schedule, so the other rows may
     * differ in rounding only (partials summed in other pieces). */
    int far = 0;
    for (size_t e = 0; e < ob / 2; e++) {
      if (e >= r0 * MLA_LATENT && e < (r0 + rn) * MLA_LATENT) continue;
      if (w.req_ids[e / (rn * MLA_LATENT)] == MLA_REQ_PAD) continue; /* reads page 0 (NaN here); ignored */
      const double x = tu_bf16_to_f32(o1[e]), y = tu_bf16_to_f32(o2[e]);
      far += !(fabs(x - y) <= 1e-2 + 1e-2 * fabs(x));
    }
    TU_CHECK(far == 0, "%s: an out-of-range row changed %d elements of the other rows", name, far);
  }
  free(qo);
  free(kv);
  free(bt);
  free(sc);
  free(ns);
  free(o1);
  free(o2);
  free(oc);
  free(l1);
  free(l2);
  free(lc);
  cudaFree(pw);
  dev_free(&d);
  sw_free(&w);
}

/* Multi-step draft on the GPU: every step's device metadata equals the CPU
 * step's (which tests/test_step.c checks against mla_plan_build). */
static void draft_steps(int P, int H, int num_steps) {
  char name[64];
  snprintf(name, sizeof name, "draft P=%d H=%d steps=%d", P, H, num_steps);
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, P, H, 12) != 0 || sw_batch(&w, cpu, &rng, 12, 2) != 0) {
    TU_CHECK(0, "%s: world", name);
    return;
  }
  for (int i = 0; i < w.bs; i++)
    if (w.req_ids[i] != MLA_REQ_PAD) w.seq[i] = w.seq[i] > num_steps ? w.seq[i] - num_steps : 0;
  dev_step d;
  if (dev_make(&d, &w, w.bs, w.Tq) != 0) {
    TU_CHECK(0, "%s: device setup", name);
    return;
  }
  dev_load(&d, &w);
  mla_step_desc desc = sw_desc(&w);
  desc.num_steps = num_steps;
  size_t cwb = 0;
  TU_STATUS(mla_step_workspace_size(gpu, &desc, &d.ws_bytes), MLA_OK);
  TU_STATUS(mla_step_workspace_size(cpu, &desc, &cwb), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  void *cws = malloc(cwb);
  mla_step_inputs in = {d.r2t, w.max_context, w.max_reqs, d.ids, d.seq, NULL};
  mla_step_inputs cin = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, NULL};
  TU_STATUS(mla_step_prepare(gpu, &desc, d.dcache, &in, d.ws, d.ws_bytes), MLA_OK);
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  TU_STATUS(mla_step_prepare(cpu, &desc, w.cache, &cin, cws, cwb), MLA_OK);
  int bad = 0;
  for (int k = 0; k < num_steps; k++) {
    desc.step = k;
    mla_step_metadata g, c;
    TU_STATUS(mla_step_get_metadata(gpu, &desc, d.ws, d.ws_bytes, &g), MLA_OK);
    TU_STATUS(mla_step_get_metadata(cpu, &desc, cws, cwb, &c), MLA_OK);
    const size_t n_bt = (size_t)w.bs * c.block_table_width, n_sm = (size_t)c.num_sm_parts * MLA_SCHED_META_INTS;
    int32_t *buf = malloc(4 * (n_bt + n_sm + 3 * (size_t)(w.bs + 1)));
    int32_t *qo = buf, *kv = qo + w.bs + 1, *ns = kv + w.bs + 1, *bt = ns + w.bs + 1, *sc = bt + n_bt;
    CK(cudaMemcpy(qo, g.qo_indptr, 4 * (w.bs + 1), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(kv, g.kv_lens, 4 * w.bs, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ns, g.num_splits, 4 * (w.bs + 1), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(bt, g.block_table, 4 * n_bt, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sc, g.sched_meta, 4 * n_sm, cudaMemcpyDeviceToHost));
    bad += memcmp(qo, c.qo_indptr, 4 * (w.bs + 1)) != 0;
    bad += memcmp(kv, c.kv_lens, 4 * w.bs) != 0;
    bad += memcmp(ns, c.num_splits, 4 * (w.bs + 1)) != 0;
    bad += memcmp(bt, c.block_table, 4 * n_bt) != 0;
    bad += memcmp(sc, c.sched_meta, 4 * n_sm) != 0;
    for (int i = 0; i < w.bs; i++) bad += kv[i] != w.seq[i] + k + 1;
    free(buf);
  }
  TU_CHECK(bad == 0, "%s: %d differences between device and CPU draft-step metadata", name, bad);
  free(cws);
  dev_free(&d);
  sw_free(&w);
}

/* The device schedule (a parallel rebuild of the host's greedy walk) equals
 * the host walk (mla_split_schedule_body) on many random length mixes: short, long, zero-length,
 * uniform, batch sizes 1..600, part counts 1..132 (q below FlashMLA's, or
 * kept at it for the pieces: src/plan/step_build.h). Synthetic req_to_token
 * (pages cycle through a small cache): only the lengths matter here. */
static void schedule_equality(int cases) {
  const int P = 64, maxbs = 600, maxkv = 20000, pages = 64;
  mla_kv_cache_desc cd = {1, pages, P, MLA_DTYPE_BF16, NULL};
  mla_kv_cache *dc = NULL;
  TU_STATUS(mla_kv_cache_create(gpu, &cd, &dc), MLA_OK);
  if (!dc) return;
  int32_t *r2t = malloc(sizeof(int32_t) * (size_t)maxkv);
  for (int j = 0; j < maxkv; j++) r2t[j] = ((j / P) % (pages - 1) + 1) * P + j % P;
  int32_t *d_r2t = tu_dev_copy(r2t, sizeof(int32_t) * (size_t)maxkv);
  int32_t *ids = calloc(maxbs, sizeof(int32_t)), *seq = malloc(sizeof(int32_t) * maxbs);
  int32_t *d_ids = tu_dev_copy(ids, sizeof(int32_t) * maxbs), *d_seq = tu_dev_alloc(sizeof(int32_t) * maxbs);
  int32_t *hm = malloc(sizeof(int32_t) * 132 * MLA_SCHED_META_INTS), *hn = malloc(sizeof(int32_t) * (maxbs + 1));
  int32_t *gm = malloc(sizeof(int32_t) * 132 * MLA_SCHED_META_INTS), *gn = malloc(sizeof(int32_t) * (maxbs + 1));
  int bad = 0, first_bad = -1, n_whole = 0;
  for (int c = 0; c < cases; c++) {
    /* kind 4: uniform batches over all 132 SMs, where the schedule's q is
     * often below FlashMLA's (b = 64 x 4096, 64 x 1024) or kept at it because
     * a smaller one would cut more pieces (b = 96 x 1024) */
    static const int ubs[6] = {16, 32, 48, 64, 96, 128}, ukv[4] = {1024, 2048, 4096, 8192};
    const int kind = c % 5;
    const int bs = c < 2 ? 128 << c
                   : kind == 4 ? ubs[tu_randint(&rng, 0, 5)]
                   : c % 7 == 0 ? tu_randint(&rng, 100, maxbs) : tu_randint(&rng, 1, 48);
    const int ukvc = ukv[tu_randint(&rng, 0, 3)];
    for (int i = 0; i < bs; i++)
      seq[i] = kind == 0 ? tu_randint(&rng, 0, 100)
               : kind == 1 ? tu_randint(&rng, 0, maxkv)
               : kind == 2 ? (tu_randint(&rng, 0, 2) == 0 ? 0 : tu_randint(&rng, 1, 5000))
               : kind == 3 ? 4096 : ukvc;
    mla_step_desc d;
    memset(&d, 0, sizeof d);
    d.mode = MLA_MODE_DECODE;
    d.batch_size = bs;
    d.max_kv_len = maxkv;
    d.num_heads = tu_randint(&rng, 0, 1) ? 16 : 128;
    d.page_size = P;
    d.num_sm = kind == 4 ? 132 : tu_randint(&rng, 1, 132);
    if (c < 2) { /* the cut-free budget for sure: b = 128 x 8192 (then 256 x 4096) over 66 parts */
      for (int i = 0; i < bs; i++) seq[i] = c == 0 ? 8192 : 4096;
      d.num_heads = 128;
      d.num_sm = 132;
    }
    size_t wsb = 0;
    TU_STATUS(mla_step_workspace_size(gpu, &d, &wsb), MLA_OK);
    void *ws = tu_dev_alloc(wsb);
    CK(cudaMemcpy(d_seq, seq, sizeof(int32_t) * bs, cudaMemcpyHostToDevice));
    mla_step_inputs in = {d_r2t, maxkv, 1, d_ids, d_seq, NULL};
    mla_status st = mla_step_prepare(gpu, &d, dc, &in, ws, wsb);
    if (st == MLA_OK) st = mla_ctx_synchronize(gpu);
    mla_step_metadata m;
    if (st == MLA_OK) st = mla_step_get_metadata(gpu, &d, ws, wsb, &m);
    if (st != MLA_OK) {
      bad++;
      cudaFree(ws);
      continue;
    }
    CK(cudaMemcpy(gm, m.sched_meta, sizeof(int32_t) * m.num_sm_parts * MLA_SCHED_META_INTS, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gn, m.num_splits, sizeof(int32_t) * (bs + 1), cudaMemcpyDeviceToHost));
    int32_t sched_ov, sched_unit; /* the step's rule (a dev build's override included) */
    mla_step_sched_rule(&sched_ov, &sched_unit);
    mla_split_schedule_body(seq, bs, m.num_sm_parts, sched_ov, sched_unit, MLA_SCHED_NOCUT_DIV, hm, hn);
    n_whole += hn[bs] == bs && bs > m.num_sm_parts; /* the cut-free walk on the device */
    if (memcmp(gm, hm, sizeof(int32_t) * m.num_sm_parts * MLA_SCHED_META_INTS) != 0 ||
        memcmp(gn, hn, sizeof(int32_t) * (bs + 1)) != 0) {
      if (first_bad < 0) first_bad = c;
      bad++;
    }
    cudaFree(ws);
  }
  TU_CHECK(bad == 0, "schedule: %d of %d random cases differ from the host walk (first: case %d)", bad, cases,
           first_bad);
  TU_CHECK(n_whole > 0 || cases < 100, "schedule: no case took the cut-free budget in %d cases", cases);
  free(r2t);
  free(ids);
  free(seq);
  free(hm);
  free(hn);
  free(gm);
  free(gn);
  cudaFree(d_r2t);
  cudaFree(d_ids);
  cudaFree(d_seq);
  mla_kv_cache_destroy(dc);
}

/* EXTEND steps (the capturable paged prefill): per round a batch of live
 * rows with random extend lens (0..max_ext) and padding rows under a fixed
 * token bucket. The GPU step's metadata equals the CPU step's, its output
 * the CPU step's within bf16 tolerance; one step captured in a CUDA graph
 * (kernel nodes only) and replayed per round after rewriting ids, lengths,
 * extend lens and queries equals the eager GPU step bit for bit. A batch
 * over the bucket is emptied and reported by mla_ctx_synchronize. */
static void extend_steps(int P, int H, int max_ext, int rounds) {
  char name[96];
  snprintf(name, sizeof name, "extend steps P=%d H=%d max_ext=%d", P, H, max_ext);
  const int BS = 10;
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_EXTEND, 0, P, H, 14) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  w.bs = BS;
  const int bucket = BS * max_ext;
  dev_step d;
  if (dev_make(&d, &w, BS, bucket) != 0) {
    TU_CHECK(0, "%s: device setup", name);
    return;
  }
  int32_t *d_ext = tu_dev_alloc(sizeof(int32_t) * BS);
  mla_step_desc desc = sw_desc(&w);
  desc.num_draft_tokens = 0;
  desc.num_tokens = bucket;
  TU_STATUS(mla_step_workspace_size(gpu, &desc, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  size_t cwb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &desc, &cwb), MLA_OK);
  void *cws = malloc(cwb);
  const int64_t nq = (int64_t)bucket * H;
  const size_t ob = 2 * (size_t)nq * MLA_LATENT, lb = sizeof(float) * (size_t)nq;
  uint16_t *qn = malloc(2 * (size_t)nq * MLA_LATENT), *qr = malloc(2 * (size_t)nq * MLA_ROPE);
  uint16_t *oc = malloc(ob), *oe = malloc(ob), *og = malloc(ob);
  float *lc = malloc(lb), *le = malloc(lb), *lg = malloc(lb), *tmp = malloc(sizeof(float) * (size_t)nq * MLA_LATENT);
  int32_t ext[SW_MAXB];
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TU_STATUS(mla_ctx_set_stream(gpu, s), MLA_OK);
  mla_step_inputs gin = {d.r2t, w.max_context, w.max_reqs, d.ids, d.seq, d_ext};
  mla_step_inputs cin = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq, ext};
  mla_absorbed_args ga = dev_args(&w, &d);
  cudaGraphExec_t exec = NULL;
  int meta_bad = 0, far = 0, mismatches = 0, errors = 0, total_rows = 0;
  for (int round = 0; round < rounds; round++) {
    /* the batch: live requests in random order, 0..4 padding rows */
    int32_t ids[SW_MAXB];
    for (int i = 0; i < w.num_live; i++) ids[i] = i;
    tu_shuffle_i32(&rng, ids, w.num_live);
    const int npad = tu_randint(&rng, 0, 4);
    int total = 0;
    for (int i = 0; i < BS; i++) {
      const int pad = i >= BS - npad;
      w.req_ids[i] = pad ? MLA_REQ_PAD : ids[i];
      w.seq[i] = pad ? 1 : tu_randint(&rng, 1, w.live_len[ids[i]]);
      ext[i] = pad ? tu_randint(&rng, 0, 1) : tu_randint(&rng, 0, w.seq[i] < max_ext ? w.seq[i] : max_ext);
      total += ext[i];
    }
    tu_fill_bf16_normal(&rng, tmp, nq * MLA_LATENT, 1.0);
    tu_to_dtype(MLA_DTYPE_BF16, tmp, qn, nq * MLA_LATENT);
    tu_fill_bf16_normal(&rng, tmp, nq * MLA_ROPE, 1.0);
    tu_to_dtype(MLA_DTYPE_BF16, tmp, qr, nq * MLA_ROPE);
    CK(cudaMemcpy(d.ids, w.req_ids, sizeof(int32_t) * BS, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.seq, w.seq, sizeof(int32_t) * BS, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ext, ext, sizeof(int32_t) * BS, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.qn, qn, 2 * (size_t)nq * MLA_LATENT, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.qr, qr, 2 * (size_t)nq * MLA_ROPE, cudaMemcpyHostToDevice));
    total_rows += total;

    /* the CPU step */
    mla_absorbed_args ca;
    memset(&ca, 0, sizeof ca);
    ca.num_heads = H;
    ca.scale = SW_SCALE;
    ca.act_dtype = MLA_DTYPE_BF16;
    ca.q_nope = qn;
    ca.q_rope = qr;
    ca.out = oc;
    ca.lse = lc;
    if (mla_step_prepare(cpu, &desc, w.cache, &cin, cws, cwb) != MLA_OK ||
        mla_step_attention(cpu, &desc, w.cache, 0, &ca, cws, cwb) != MLA_OK) {
      TU_CHECK(0, "%s: CPU step: %s", name, mla_ctx_last_error(cpu));
      break;
    }
    /* the eager GPU step, its metadata against the CPU step's */
    poison_out(&d);
    mla_status st = mla_step_prepare(gpu, &desc, d.dcache, &gin, d.ws, d.ws_bytes);
    if (st == MLA_OK) st = mla_step_attention(gpu, &desc, d.dcache, 0, &ga, d.ws, d.ws_bytes);
    if (st == MLA_OK) st = mla_ctx_synchronize(gpu);
    if (st != MLA_OK) {
      TU_CHECK(0, "%s: GPU step: %s", name, mla_ctx_last_error(gpu));
      break;
    }
    CK(cudaMemcpy(oe, d.o, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(le, d.lse, lb, cudaMemcpyDeviceToHost));
    mla_step_metadata cm, gm;
    TU_STATUS(mla_step_get_metadata(cpu, &desc, cws, cwb, &cm), MLA_OK);
    TU_STATUS(mla_step_get_metadata(gpu, &desc, d.ws, d.ws_bytes, &gm), MLA_OK);
    {
      const size_t nbt = (size_t)BS * gm.block_table_width, nsm = (size_t)gm.num_sm_parts * MLA_SCHED_META_INTS;
      int32_t *g_qo = malloc(4 * (BS + 1)), *g_kv = malloc(4 * BS), *g_bt = malloc(4 * nbt), *g_sm = malloc(4 * nsm);
      int32_t *g_ns = malloc(4 * (BS + 1));
      CK(cudaMemcpy(g_qo, gm.qo_indptr, 4 * (BS + 1), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(g_kv, gm.kv_lens, 4 * BS, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(g_bt, gm.block_table, 4 * nbt, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(g_sm, gm.sched_meta, 4 * nsm, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(g_ns, gm.num_splits, 4 * (BS + 1), cudaMemcpyDeviceToHost));
      meta_bad += memcmp(g_qo, cm.qo_indptr, 4 * (BS + 1)) != 0 || memcmp(g_kv, cm.kv_lens, 4 * BS) != 0 ||
                  memcmp(g_bt, cm.block_table, 4 * nbt) != 0 || memcmp(g_sm, cm.sched_meta, 4 * nsm) != 0 ||
                  memcmp(g_ns, cm.num_splits, 4 * (BS + 1)) != 0 || g_qo[BS] != total;
      free(g_qo), free(g_kv), free(g_bt), free(g_sm), free(g_ns);
    }
    /* live rows: GPU vs CPU within bf16 tolerance */
    for (int i = 0; i < BS; i++) {
      if (w.req_ids[i] == MLA_REQ_PAD) continue;
      for (int64_t e = (int64_t)cm.qo_indptr[i] * H * MLA_LATENT; e < (int64_t)cm.qo_indptr[i + 1] * H * MLA_LATENT;
           e++) {
        const double c = tu_bf16_to_f32(oc[e]), g = tu_bf16_to_f32(oe[e]);
        far += !(fabs(g - c) <= 0.02 + 0.02 * fabs(c));
      }
    }
    /* the graph: captured once (round 0), replayed every round */
    if (!exec) {
      cudaGraph_t graph;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      mla_status s1 = mla_step_prepare(gpu, &desc, d.dcache, &gin, d.ws, d.ws_bytes);
      mla_status s2 = mla_step_attention(gpu, &desc, d.dcache, 0, &ga, d.ws, d.ws_bytes);
      cudaError_t ce = cudaStreamEndCapture(s, &graph);
      TU_CHECK(s1 == MLA_OK && s2 == MLA_OK && ce == cudaSuccess, "%s: capture: %d %d %s", name, (int)s1, (int)s2,
               cudaGetErrorString(ce));
      if (ce != cudaSuccess) break;
      int kernels = 0, others = 0;
      tu_count_graph_nodes(graph, &kernels, &others);
      TU_CHECK(kernels >= 3 && others == 0, "%s: graph of %d kernel and %d other nodes (want kernels only)", name,
               kernels, others);
      CK(cudaGraphInstantiate(&exec, graph, 0));
      CK(cudaGraphDestroy(graph));
    }
    poison_out(&d);
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    if (mla_ctx_synchronize(gpu) != MLA_OK) errors++;
    CK(cudaMemcpy(og, d.o, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lg, d.lse, lb, cudaMemcpyDeviceToHost));
    mismatches += memcmp(oe, og, ob) != 0 || memcmp(le, lg, lb) != 0;
  }
  TU_CHECK(meta_bad == 0, "%s: %d rounds with GPU metadata unlike the CPU step's", name, meta_bad);
  TU_CHECK(far == 0, "%s: %d output elements off the CPU step's", name, far);
  TU_CHECK(mismatches == 0 && errors == 0, "%s: %d of %d replays differ from eager (%d errors)", name, mismatches,
           rounds, errors);
  /* over the bucket: every row emptied, reported */
  if (exec) {
    int32_t big[SW_MAXB];
    for (int i = 0; i < BS; i++) big[i] = w.req_ids[i] == MLA_REQ_PAD ? 0 : w.seq[i];
    int sum = 0;
    for (int i = 0; i < BS; i++) sum += big[i];
    if (sum > bucket) {
      CK(cudaMemcpy(d_ext, big, sizeof(int32_t) * BS, cudaMemcpyHostToDevice));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      TU_STATUS(mla_ctx_synchronize(gpu), MLA_ERR_OUT_OF_RANGE);
      mla_step_metadata gm;
      TU_STATUS(mla_step_get_metadata(gpu, &desc, d.ws, d.ws_bytes, &gm), MLA_OK);
      int32_t q_end = -1;
      CK(cudaMemcpy(&q_end, gm.qo_indptr + BS, 4, cudaMemcpyDeviceToHost));
      TU_CHECK(q_end == 0, "%s: a batch over the bucket keeps %d query rows", name, (int)q_end);
    }
    CK(cudaGraphExecDestroy(exec));
  }
  printf("  %s: %d rounds, %d query tokens, bucket %d\n", name, rounds, total_rows, bucket);
  TU_STATUS(mla_ctx_set_stream(gpu, NULL), MLA_OK);
  CK(cudaStreamDestroy(s));
  free(qn), free(qr), free(oc), free(oe), free(og), free(lc), free(le), free(lg), free(tmp), free(cws);
  cudaFree(d_ext);
  dev_free(&d);
  sw_free(&w);
}

/* The host-pointer refusals once every device pointer of a step has been
 * validated (the library remembers device ranges it has seen): each host
 * pointer in turn still gives INVALID_ARGUMENT naming it, before anything is
 * launched (out and lse keep their poison); a pointer inside a validated
 * allocation (an offset q) is still taken; and the eager step afterwards
 * gives what it gave before, bit for bit. */
static void refusals_after_validation(int P, int H) {
  char name[64];
  snprintf(name, sizeof name, "refusals P=%d H=%d", P, H);
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, P, H, 16) != 0 || sw_batch(&w, cpu, &rng, 8, 1) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  dev_step d;
  if (dev_make(&d, &w, 8, w.Tq + 1) != 0) { /* one token more: the offset q below */
    TU_CHECK(0, "%s: device setup", name);
    return;
  }
  dev_load(&d, &w);
  const mla_step_desc desc = sw_desc(&w);
  TU_STATUS(mla_step_workspace_size(gpu, &desc, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  const size_t ob = 2 * (size_t)w.Tq * H * MLA_LATENT, lb = sizeof(float) * (size_t)w.Tq * H;
  uint16_t *o1 = malloc(ob), *o2 = malloc(ob), *op = malloc(ob);
  float *l1 = malloc(lb), *l2 = malloc(lb), *lp = malloc(lb);
  poison_out(&d);
  TU_STATUS(eager_step(&w, &d, &desc, o1, l1), MLA_OK); /* every pointer validated once */

  /* host stand-ins, aligned like the device buffers (only "host" is wrong) */
  const size_t hb = d.ws_bytes > d.o_bytes ? d.ws_bytes : d.o_bytes;
  void *host = aligned_alloc(256, (hb + 255) / 256 * 256);
  memset(host, 0, hb);
  mla_absorbed_args good = dev_args(&w, &d);
  static const char *const names[5] = {"q_nope", "q_rope", "out", "lse", "workspace"};
  poison_out(&d);
  CK(cudaMemcpy(op, d.o, ob, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lp, d.lse, lb, cudaMemcpyDeviceToHost));
  for (int k = 0; k < 5; k++) {
    mla_absorbed_args a = good;
    void *ws = d.ws;
    if (k == 0) a.q_nope = host;
    if (k == 1) a.q_rope = host;
    if (k == 2) a.out = host;
    if (k == 3) a.lse = host;
    if (k == 4) ws = host;
    const mla_status st = mla_step_attention(gpu, &desc, d.dcache, 0, &a, ws, d.ws_bytes);
    TU_CHECK(st == MLA_ERR_INVALID_ARGUMENT && strstr(mla_ctx_last_error(gpu), names[k]) != NULL,
             "%s: host %s: status %d (%s)", name, names[k], (int)st, mla_ctx_last_error(gpu));
  }
  mla_step_inputs in = {d.r2t, w.max_context, w.max_reqs, d.ids, d.seq, NULL};
  for (int k = 0; k < 4; k++) {
    mla_step_inputs hin = in;
    void *ws = d.ws;
    if (k == 0) hin.req_to_token = host;
    if (k == 1) hin.req_ids = host;
    if (k == 2) hin.seq_lens = host;
    if (k == 3) ws = host;
    const mla_status st = mla_step_prepare(gpu, &desc, d.dcache, &hin, ws, d.ws_bytes);
    TU_CHECK(st == MLA_ERR_INVALID_ARGUMENT, "%s: prepare with host input %d: status %d (%s)", name, k, (int)st,
             mla_ctx_last_error(gpu));
  }
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  CK(cudaMemcpy(o2, d.o, ob, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(l2, d.lse, lb, cudaMemcpyDeviceToHost));
  TU_CHECK(memcmp(o2, op, ob) == 0 && memcmp(l2, lp, lb) == 0, "%s: a refused call wrote out / lse", name);

  /* a q inside the validated allocation, one token further: taken */
  {
    mla_absorbed_args a = good;
    a.q_nope = (const uint16_t *)d.qn + (size_t)H * MLA_LATENT;
    a.q_rope = (const uint16_t *)d.qr + (size_t)H * MLA_ROPE;
    TU_STATUS(mla_step_prepare(gpu, &desc, d.dcache, &in, d.ws, d.ws_bytes), MLA_OK);
    TU_STATUS(mla_step_attention(gpu, &desc, d.dcache, 0, &a, d.ws, d.ws_bytes), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  }
  poison_out(&d);
  TU_STATUS(eager_step(&w, &d, &desc, o2, l2), MLA_OK);
  TU_CHECK(memcmp(o1, o2, ob) == 0 && memcmp(l1, l2, lb) == 0, "%s: the step changed after the refusals", name);
  free(host);
  free(o1);
  free(o2);
  free(op);
  free(l1);
  free(l2);
  free(lp);
  dev_free(&d);
  sw_free(&w);
}

/* Capture one step in a graph, replay with new inputs, compare with eager. */
static void graph_replay(mla_mode mode, int ndt, int P, int H, int replays) {
  char name[96];
  snprintf(name, sizeof name, "graph mode=%d ndt=%d P=%d H=%d", (int)mode, ndt, P, H);
  const int BS = 12;
  sw_world w;
  if (sw_make(&w, cpu, &rng, mode, ndt, P, H, 20) != 0 || sw_batch(&w, cpu, &rng, BS, 2) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  dev_step d;
  if (dev_make(&d, &w, BS, w.Tq) != 0) {
    TU_CHECK(0, "%s: device setup", name);
    return;
  }
  const mla_step_desc desc = sw_desc(&w);
  TU_STATUS(mla_step_workspace_size(gpu, &desc, &d.ws_bytes), MLA_OK);
  d.ws = tu_dev_alloc(d.ws_bytes);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TU_STATUS(mla_ctx_set_stream(gpu, s), MLA_OK);
  dev_load(&d, &w);

  mla_step_inputs in = {d.r2t, w.max_context, w.max_reqs, d.ids, d.seq, NULL};
  mla_absorbed_args a = dev_args(&w, &d);
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  mla_status st1 = mla_step_prepare(gpu, &desc, d.dcache, &in, d.ws, d.ws_bytes);
  mla_status st2 = mla_step_attention(gpu, &desc, d.dcache, 0, &a, d.ws, d.ws_bytes);
  cudaError_t ce = cudaStreamEndCapture(s, &graph);
  TU_CHECK(st1 == MLA_OK && st2 == MLA_OK && ce == cudaSuccess, "%s: capture: %d %d %s (%s)", name, (int)st1,
           (int)st2, cudaGetErrorString(ce), mla_ctx_last_error(gpu));
  if (ce != cudaSuccess) {
    dev_free(&d);
    sw_free(&w);
    return;
  }
  int kernels = 0, others = 0;
  tu_count_graph_nodes(graph, &kernels, &others);
  TU_CHECK(kernels >= 3 && others == 0, "%s: graph has %d kernel and %d other nodes (want kernels only)", name,
           kernels, others);
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));

  const size_t ob = 2 * (size_t)w.Tq * H * MLA_LATENT, lb = sizeof(float) * (size_t)w.Tq * H;
  uint16_t *oe = malloc(ob), *og = malloc(ob);
  float *le = malloc(lb), *lg = malloc(lb);
  int mismatches = 0, errors = 0;
  for (int it = 0; it < replays; it++) {
    /* new request ids, lengths and padding (0..BS-1 padded rows) */
    const int npad = tu_randint(&rng, 0, BS - 1);
    if (sw_batch(&w, cpu, &rng, BS, npad) != 0) {
      errors++;
      break;
    }
    dev_load(&d, &w);
    poison_out(&d);
    if (eager_step(&w, &d, &desc, oe, le) != MLA_OK) errors++;
    poison_out(&d);
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    if (mla_ctx_synchronize(gpu) != MLA_OK) errors++;
    CK(cudaMemcpy(og, d.o, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lg, d.lse, lb, cudaMemcpyDeviceToHost));
    mismatches += memcmp(oe, og, ob) != 0 || memcmp(le, lg, lb) != 0;
  }
  TU_CHECK(errors == 0, "%s: %d eager/replay errors", name, errors);
  TU_CHECK(mismatches == 0, "%s: %d of %d replays differ from eager", name, mismatches, replays);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  TU_STATUS(mla_ctx_set_stream(gpu, NULL), MLA_OK);
  CK(cudaStreamDestroy(s));
  free(oe);
  free(og);
  free(le);
  free(lg);
  dev_free(&d);
  sw_free(&w);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_step: skipped: no GPU\n");
    return tu_finish("test_cuda_step");
  }
  rng.s = tu_seed("test_cuda_step", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0}, gd = {MLA_DEVICE_CUDA, 0, 0};
  if (mla_ctx_create(&cd, &cpu) != MLA_OK || mla_ctx_create(&gd, &gpu) != MLA_OK) {
    TU_CHECK(0, "context creation failed");
    return tu_finish("test_cuda_step");
  }
  metadata_and_attention(MLA_MODE_DECODE, 0, 64, 128);
  metadata_and_attention(MLA_MODE_DECODE, 0, 64, 16);
  metadata_and_attention(MLA_MODE_TARGET_VERIFY, 2, 16, 16);
  metadata_and_attention(MLA_MODE_DRAFT_EXTEND, 3, 64, 3);
  schedule_equality(400);
  draft_steps(64, 16, 3);
  draft_steps(16, 128, 5);
  refusals_after_validation(64, 16);
  refusals_after_validation(4, 128);
  graph_replay(MLA_MODE_DECODE, 0, 64, 16, 100);
  graph_replay(MLA_MODE_TARGET_VERIFY, 2, 64, 128, 20);
  extend_steps(64, 16, 120, 12);
  extend_steps(1, 128, 40, 6);
  extend_steps(16, 3, 4, 12);
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_step");
}
#endif
