/* mla_step_* on a CPU context: the metadata a step builds from (req_to_token,
 * req_ids, seq_lens) equals mla_plan_build's for the same batch (lengths,
 * pages, split schedule), the step's attention equals mla_attention_absorbed
 * over the host plan bit for bit, for DECODE, TARGET_VERIFY and DRAFT_EXTEND
 * (fixed window) x page sizes 1, 16, 64 x heads 3, 16, with padding rows. The
 * same inputs reused with new lengths give the new plan's result (the
 * workspace carries no stale state). Refusals: out-of-range request ids,
 * lengths and slots (OUT_OF_RANGE, workspace untouched), and every bad
 * descriptor field. */
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_step_world.h"
#include "test_util.h"

static tu_rng rng;
static mla_ctx *cpu;

typedef struct run_out {
  void *o;
  float *lse;
} run_out;

static mla_absorbed_args args_of(const sw_world *w, run_out *ro) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = SW_SCALE;
  a.act_dtype = MLA_DTYPE_BF16;
  a.q_nope = w->qn;
  a.q_rope = w->qr;
  a.out = ro->o;
  a.lse = ro->lse;
  return a;
}

static void one_case(mla_mode mode, int ndt, int P, int H) {
  char name[96];
  snprintf(name, sizeof name, "mode=%d ndt=%d P=%d H=%d", (int)mode, ndt, P, H);
  sw_world w;
  if (sw_make(&w, cpu, &rng, mode, ndt, P, H, 12) != 0) {
    TU_CHECK(0, "%s: world setup: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq};
  for (int round = 0; round < 3; round++) {
    const int bs = round == 0 ? 12 : round == 1 ? 9 : 12, npad = round == 0 ? 0 : round == 1 ? 3 : 5;
    if (sw_batch(&w, cpu, &rng, bs, npad) != 0) {
      TU_CHECK(0, "%s: batch: %s", name, mla_ctx_last_error(cpu));
      break;
    }
    mla_step_desc d = sw_desc(&w);
    size_t wsb = 0;
    TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
    void *ws = malloc(wsb);
    tu_poison(ws, wsb);
    TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_OK);
    mla_step_metadata m;
    TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_OK);
    TU_CHECK(m.batch_size == bs && m.q_len == (mode == MLA_MODE_DECODE ? 1 : ndt) &&
                 m.block_table_width == (w.max_context + P - 1) / P && m.max_splits == bs + m.num_sm_parts,
             "%s: metadata shape", name);
    const int bad = sw_compare_meta(&w, &m, m.qo_indptr, m.kv_lens, m.block_table, m.sched_meta, m.num_splits);
    TU_CHECK(bad == 0, "%s round %d: %d metadata fields differ from mla_plan_build", name, round, bad);

    /* attention: step vs host plan, bit for bit */
    const size_t ob = 2 * (size_t)w.Tq * H * MLA_LATENT, lb = sizeof(float) * (size_t)w.Tq * H;
    run_out a = {malloc(ob), malloc(lb)}, b = {malloc(ob), malloc(lb)};
    tu_poison(a.o, ob);
    tu_poison(a.lse, lb);
    tu_poison(b.o, ob);
    tu_poison(b.lse, lb);
    mla_absorbed_args aa = args_of(&w, &a), ab = args_of(&w, &b);
    TU_STATUS(mla_step_attention(cpu, &d, w.cache, 0, &aa, ws, wsb), MLA_OK);
    size_t pwb = 0;
    TU_STATUS(mla_attention_absorbed_workspace_size(cpu, &w.plan, H, &pwb), MLA_OK);
    void *pw = malloc(pwb);
    TU_STATUS(mla_attention_absorbed(cpu, w.cache, 0, &w.plan, &ab, pw, pwb), MLA_OK);
    TU_CHECK(memcmp(a.o, b.o, ob) == 0 && memcmp(a.lse, b.lse, lb) == 0,
             "%s round %d: step attention differs from the host-plan attention", name, round);
    /* live rows are real results (not poison) */
    int poisoned = 0;
    for (int i = 0; i < bs; i++)
      if (w.req_ids[i] != MLA_REQ_PAD)
        poisoned += tu_all_poisoned((char *)a.o + 2 * (size_t)i * sw_q_len(&w) * H * MLA_LATENT, 2 * MLA_LATENT);
    TU_CHECK(poisoned == 0, "%s: %d live rows left unwritten", name, poisoned);

    /* refusals leave the workspace as it was */
    if (round == 0) {
      void *copy = malloc(wsb);
      memcpy(copy, ws, wsb);
      int32_t save_id = w.req_ids[2], save_seq = w.seq[2];
      w.req_ids[2] = w.max_reqs;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.req_ids[2] = -7;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.req_ids[2] = save_id;
      w.seq[2] = w.max_context + 1;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.seq[2] = -1;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      w.seq[2] = save_seq;
      /* a slot that does not start a page (P > 1), or one past the cache */
      int32_t *r2t = malloc(sizeof(int32_t) * (size_t)w.max_reqs * w.max_context);
      memcpy(r2t, w.r2t, sizeof(int32_t) * (size_t)w.max_reqs * w.max_context);
      int row = 0;
      while (w.req_ids[row] == MLA_REQ_PAD) row++;
      int32_t *first = &r2t[(size_t)w.req_ids[row] * w.max_context];
      const int32_t keep = *first;
      mla_step_inputs bad_in = in;
      bad_in.req_to_token = r2t;
      if (P > 1) {
        *first = keep + 1;
        TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      }
      mla_kv_cache_desc cdsc;
      mla_kv_cache_get_desc(w.cache, &cdsc);
      *first = cdsc.num_pages * P;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      *first = -P;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
      *first = keep;
      TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &bad_in, ws, wsb), MLA_OK);
      TU_CHECK(memcmp(copy, ws, wsb) == 0, "%s: a refused or repeated prepare changed the workspace", name);
      free(r2t);
      free(copy);
    }
    free(a.o);
    free(a.lse);
    free(b.o);
    free(b.lse);
    free(pw);
    free(ws);
  }
  sw_free(&w);
}

/* Multi-step draft: one prepare builds num_steps DECODE steps, step k with
 * kv = seq_len + k + 1; each equals mla_plan_build's DECODE plan for those
 * lengths, and its attention equals the plan path's bit for bit. */
static void draft_case(int P, int H, int num_steps) {
  char name[64];
  snprintf(name, sizeof name, "draft P=%d H=%d steps=%d", P, H, num_steps);
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, P, H, 10) != 0 || sw_batch(&w, cpu, &rng, 10, 2) != 0) {
    TU_CHECK(0, "%s: world: %s", name, mla_ctx_last_error(cpu));
    return;
  }
  for (int i = 0; i < w.bs; i++)
    if (w.req_ids[i] != MLA_REQ_PAD) w.seq[i] = w.seq[i] > num_steps ? w.seq[i] - num_steps : 0;
  mla_step_desc d = sw_desc(&w);
  d.num_steps = num_steps;
  size_t wsb = 0, one = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  mla_step_desc d1 = sw_desc(&w);
  TU_STATUS(mla_step_workspace_size(cpu, &d1, &one), MLA_OK);
  TU_CHECK(wsb > one * (size_t)(num_steps - 1), "%s: workspace %zu for %d steps of %zu", name, wsb, num_steps, one);
  void *ws = malloc(wsb);
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq};
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_OK);
  const size_t ob = 2 * (size_t)w.bs * H * MLA_LATENT;
  run_out a = {malloc(ob), NULL}, b = {malloc(ob), NULL};
  for (int k = 0; k < num_steps; k++) {
    int32_t seqk[SW_MAXB];
    for (int i = 0; i < w.bs; i++) seqk[i] = w.seq[i] + k + 1;
    mla_batch bt;
    memset(&bt, 0, sizeof bt);
    bt.mode = MLA_MODE_DECODE;
    bt.batch_size = w.bs;
    bt.req_ids = w.req_ids;
    bt.seq_lens = seqk;
    mla_plan_limits lim = {w.bs, w.bs, w.bs * w.max_context, w.max_context, P, SW_NUM_SM};
    size_t pb = 0;
    TU_STATUS(mla_plan_workspace_size(cpu, &lim, &pb), MLA_OK);
    void *pws = malloc(pb);
    mla_status st = mla_plan_build(cpu, w.rt, &bt, &lim, H, pws, pb, &w.plan);
    TU_CHECK(st == MLA_OK, "%s: plan: %s", name, mla_ctx_last_error(cpu));
    d.step = k;
    mla_step_metadata m;
    TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_OK);
    const int bad = sw_compare_meta(&w, &m, m.qo_indptr, m.kv_lens, m.block_table, m.sched_meta, m.num_splits);
    TU_CHECK(bad == 0, "%s: step %d: %d metadata fields differ from the DECODE plan", name, k, bad);
    mla_absorbed_args aa = args_of(&w, &a), ab = args_of(&w, &b);
    TU_STATUS(mla_step_attention(cpu, &d, w.cache, 0, &aa, ws, wsb), MLA_OK);
    size_t pwb = 0;
    TU_STATUS(mla_attention_absorbed_workspace_size(cpu, &w.plan, H, &pwb), MLA_OK);
    void *pw = malloc(pwb);
    TU_STATUS(mla_attention_absorbed(cpu, w.cache, 0, &w.plan, &ab, pw, pwb), MLA_OK);
    TU_CHECK(memcmp(a.o, b.o, ob) == 0, "%s: step %d attention differs from the plan path", name, k);
    free(pw);
    free(pws);
  }
  /* refusals specific to draft steps */
  d.step = num_steps;
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(cpu, &d, ws, wsb, &m), MLA_ERR_INVALID_ARGUMENT);
  d.step = 0;
  d.mode = MLA_MODE_TARGET_VERIFY;
  d.num_draft_tokens = 2;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d = sw_desc(&w);
  d.num_steps = 17;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d.num_steps = 0;
  d.step = 1;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  /* a request too short for the last step: refused before anything is written */
  d = sw_desc(&w);
  d.num_steps = num_steps;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_OK);
  int row = 0;
  while (w.req_ids[row] == MLA_REQ_PAD) row++;
  w.seq[row] = w.max_context - num_steps + 1;
  tu_poison(ws, wsb);
  void *copy = malloc(wsb);
  memcpy(copy, ws, wsb);
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  TU_CHECK(memcmp(copy, ws, wsb) == 0, "%s: a refused draft prepare wrote into the workspace", name);
  free(copy);
  free(a.o);
  free(b.o);
  free(ws);
  sw_free(&w);
}

static void refusals(void) {
  sw_world w;
  if (sw_make(&w, cpu, &rng, MLA_MODE_DECODE, 0, 16, 4, 4) != 0 || sw_batch(&w, cpu, &rng, 4, 1) != 0) {
    TU_CHECK(0, "refusal world: %s", mla_ctx_last_error(cpu));
    return;
  }
  const mla_step_desc good = sw_desc(&w);
  size_t wsb = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &good, &wsb), MLA_OK);
  void *ws = malloc(wsb);
  mla_step_inputs in = {w.r2t, w.max_context, w.max_reqs, w.req_ids, w.seq};
  mla_step_desc d;
#define BAD_DESC(field, value)                                               \
  do {                                                                       \
    d = good;                                                                \
    d.field = value;                                                         \
    size_t n_ = 0;                                                           \
    TU_STATUS(mla_step_workspace_size(cpu, &d, &n_), MLA_ERR_INVALID_ARGUMENT); \
    TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws, wsb), MLA_ERR_INVALID_ARGUMENT); \
  } while (0)
  BAD_DESC(mode, MLA_MODE_EXTEND);
  BAD_DESC(mode, MLA_MODE_IDLE);
  BAD_DESC(batch_size, 0);
  BAD_DESC(batch_size, 8193);
  BAD_DESC(num_draft_tokens, 2); /* DECODE takes none */
  BAD_DESC(max_kv_len, 0);
  BAD_DESC(num_heads, 0);
  BAD_DESC(num_heads, MLA_MAX_HEADS + 1);
  BAD_DESC(page_size, 3);
  BAD_DESC(page_size, 512);
  BAD_DESC(num_sm, -1);
  BAD_DESC(num_sm, 1025);
  d = good;
  d.mode = MLA_MODE_TARGET_VERIFY;
  d.num_draft_tokens = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  d.num_draft_tokens = 65;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(cpu, &good, &wsb), MLA_OK);
  TU_STATUS(mla_step_workspace_size(cpu, NULL, &wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(cpu, &good, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_workspace_size(NULL, &good, &wsb), MLA_ERR_INVALID_ARGUMENT);
  /* page size that differs from the cache's */
  d = good;
  d.page_size = 32;
  size_t wsb32 = 0;
  TU_STATUS(mla_step_workspace_size(cpu, &d, &wsb32), MLA_OK);
  void *ws32 = malloc(wsb32);
  TU_STATUS(mla_step_prepare(cpu, &d, w.cache, &in, ws32, wsb32), MLA_ERR_INVALID_ARGUMENT);
  free(ws32);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, ws, wsb - 1), MLA_ERR_WORKSPACE_TOO_SMALL);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, NULL, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, NULL, &in, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, NULL, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  mla_step_inputs bi = in;
  bi.req_to_token_stride = good.max_kv_len - 1;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  bi = in;
  bi.seq_lens = NULL;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  bi = in;
  bi.max_reqs = 0;
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &bi, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_prepare(cpu, &good, w.cache, &in, ws, wsb), MLA_OK);
  /* attention with heads other than the workspace was sized for */
  const size_t ob = 2 * (size_t)w.Tq * w.H * MLA_LATENT;
  run_out ro = {malloc(ob), NULL};
  mla_absorbed_args a = args_of(&w, &ro);
  a.num_heads = w.H + 1;
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  a.num_heads = w.H;
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 1, &a, ws, wsb), MLA_ERR_OUT_OF_RANGE);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, NULL, ws, wsb), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb / 2), MLA_ERR_WORKSPACE_TOO_SMALL);
  TU_STATUS(mla_step_attention(cpu, &good, w.cache, 0, &a, ws, wsb), MLA_OK);
  mla_step_metadata m;
  TU_STATUS(mla_step_get_metadata(cpu, &good, ws, wsb, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_step_get_metadata(cpu, &good, ws, 16, &m), MLA_ERR_WORKSPACE_TOO_SMALL);
  free(ro.o);
  free(ws);
  sw_free(&w);
}

int main(void) {
  rng.s = tu_seed("test_step", 20261130);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  if (mla_ctx_create(&cd, &cpu) != MLA_OK) {
    TU_CHECK(0, "mla_ctx_create failed");
    return tu_finish("test_step");
  }
  const int Ps[3] = {1, 16, 64};
  for (int pi = 0; pi < 3; pi++) {
    one_case(MLA_MODE_DECODE, 0, Ps[pi], pi == 1 ? 3 : 16);
    one_case(MLA_MODE_TARGET_VERIFY, 3, Ps[pi], pi == 2 ? 3 : 16);
    one_case(MLA_MODE_DRAFT_EXTEND, 2, Ps[pi], 3);
  }
  draft_case(16, 16, 3);
  draft_case(1, 3, 4);
  draft_case(64, 128, 2);
  refusals();
  mla_ctx_destroy(cpu);
  return tu_finish("test_step");
}
