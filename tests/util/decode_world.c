/* A paged absorbed-attention test batch (decode_world.h). */
#include "decode_world.h"

#include <stdlib.h>
#include <string.h>

#include "ref.h"

int tu_dworld_totals(tu_dworld *w, int npad) {
  int pages = 2 + npad;
  w->Tq = w->Tk = 0;
  w->maxkv = 1;
  for (int i = 0; i < w->bs; i++) {
    pages += (w->kv_len[i] + w->P - 1) / w->P;
    w->Tq += w->q_len[i];
    w->Tk += w->kv_len[i];
    if (w->kv_len[i] > w->maxkv) w->maxkv = w->kv_len[i];
  }
  return pages;
}

int tu_dworld_create(tu_dworld *w, mla_ctx *cpu, mla_ctx *gpu, int pages, int npad) {
  mla_kv_cache_desc cd = {1, pages, w->P, w->kv, w->kv == MLA_DTYPE_FP8_E4M3 ? &w->kv_scale : NULL};
  mla_req_table_desc rd = {w->bs + npad, w->maxkv, pages, w->P};
  if (mla_kv_cache_create(cpu, &cd, &w->cache) != MLA_OK ||
      (gpu && mla_kv_cache_create(gpu, &cd, &w->dcache) != MLA_OK) ||
      mla_req_table_create(cpu, &rd, w->cache, &w->rt) != MLA_OK) {
    if (gpu)
      TU_CHECK(0, "cannot create caches / table: %s / %s", mla_ctx_last_error(cpu), mla_ctx_last_error(gpu));
    else
      TU_CHECK(0, "cannot create cache / table: %s", mla_ctx_last_error(cpu));
    return -1;
  }
  tu_poison_cache(w->cache);
  return 0;
}

int tu_dworld_plan(tu_dworld *w, mla_ctx *ctx, int num_sm) {
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = w->mode;
  b.batch_size = w->bs;
  b.req_ids = w->req_ids;
  b.seq_lens = w->seq;
  if (w->mode == MLA_MODE_EXTEND) b.prefix_lens = w->pre;
  else if (w->mode == MLA_MODE_DRAFT_EXTEND && w->ndt == 0) b.extend_lens = w->ext;
  else if (w->mode != MLA_MODE_DECODE) b.num_draft_tokens = w->ndt;
  mla_plan_limits lim = {w->bs, (int)w->Tq + 1, (int)w->Tk + 1, w->maxkv, w->P, num_sm, w->plan_flags};
  size_t pb = 0;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &pb), MLA_OK);
  w->pws = malloc(pb);
  mla_status st = mla_plan_build(ctx, w->rt, &b, &lim, w->H, w->pws, pb, &w->plan);
  TU_CHECK(st == MLA_OK, "mla_plan_build: %s", mla_ctx_last_error(ctx));
  return st == MLA_OK ? 0 : -1;
}

void tu_dworld_oracle(tu_dworld *w, int with_pbound) {
  const int H = w->H;
  const int64_t nq = w->Tq * H;
  const double sc = (double)w->scale;
  w->o_ref = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_LATENT);
  w->lse_ref = malloc(sizeof(double) * (size_t)(nq + 1));
  ref_absorbed(w->bs, w->q_len, w->kv_len, H, sc, w->plan.causal, w->qn_d, w->qr_d, w->c_d, w->r_d, w->o_ref,
               w->lse_ref);
  if (!with_pbound) return;
  /* softmax weights in float64, bottom-right causal as the plan says */
  w->pbound = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  double *s = malloc(sizeof(double) * (size_t)w->maxkv); /* (tu_dworld_totals set maxkv) */
  int64_t t0 = 0, k0 = 0;
  for (int i = 0; i < w->bs; i++) {
    const int Q = w->q_len[i], K = w->kv_len[i];
    for (int t = 0; t < Q; t++)
      for (int h = 0; h < H; h++) {
        const int64_t row = (t0 + t) * H + h;
        const int vis = w->plan.causal ? K - Q + t + 1 : K;
        if (vis <= 0) continue;
        tu_row_softmax(w->qn_d + row * MLA_LATENT, w->qr_d + row * MLA_ROPE, w->c_d + k0 * MLA_LATENT,
                       w->r_d + k0 * MLA_ROPE, vis, sc, s);
        tu_p_round_bound(s, w->c_d + k0 * MLA_LATENT, vis, w->p_unit, w->pbound + row * MLA_LATENT);
      }
    t0 += Q;
    k0 += K;
  }
  free(s);
}

mla_absorbed_args tu_dworld_args(const tu_dworld *w, const void *qn, const void *qr, void *out, float *lse) {
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = w->H;
  a.scale = w->scale;
  a.act_dtype = w->act;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  return a;
}

void tu_dworld_free(tu_dworld *w) {
  mla_req_table_destroy(w->rt);
  mla_kv_cache_destroy(w->cache);
  mla_kv_cache_destroy(w->dcache);
  free(w->pws);
  free(w->qn);
  free(w->qr);
  free(w->qn_d);
  free(w->qr_d);
  free(w->c_d);
  free(w->r_d);
  free(w->o_ref);
  free(w->lse_ref);
  free(w->pbound);
}
