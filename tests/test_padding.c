/* Padded batch rows (MLA_REQ_PAD, what a CUDA-graph batch padded to its
 * captured size carries) are harmless: they read only the dummy slot 0, the
 * real rows' results do not change, and the draft plan treats them alike. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define H 3

int main(void) {
  tu_rng rng = {tu_seed("test_padding", 5)};
  mla_ctx *ctx;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &ctx), MLA_OK);
  int page_sizes[2] = {1, 16};
  for (int pi = 0; pi < 2; pi++) {
    int P = page_sizes[pi];
    mla_kv_cache_desc kd = {1, 4096 / P, P, MLA_DTYPE_BF16, NULL};
    mla_kv_cache *cache;
    TU_STATUS(mla_kv_cache_create(ctx, &kd, &cache), MLA_OK);
    TU_CHECK(tu_poison_cache(cache) == 0, "poison");
    mla_req_table_desc rd = {8, 512, kd.num_pages, P};
    mla_req_table *rt;
    TU_STATUS(mla_req_table_create(ctx, &rd, cache, &rt), MLA_OK);

    /* Three real requests with data; everything else (slot 0 too) is NaN. */
    int32_t ids[3], lens[3] = {45, 1, 130};
    for (int i = 0; i < 3; i++) {
      TU_STATUS(mla_req_add(rt, &ids[i]), MLA_OK);
      int32_t slots[130];
      float c[130 * 512], r[130 * 64];
      tu_fill_bf16_normal(&rng, c, (int64_t)lens[i] * 512, 1.0);
      tu_fill_bf16_normal(&rng, r, (int64_t)lens[i] * 64, 1.0);
      TU_STATUS(mla_req_extend(rt, ids[i], lens[i], slots), MLA_OK);
      TU_STATUS(mla_kv_cache_write(cache, 0, lens[i], slots, c, r, MLA_DTYPE_F32), MLA_OK);
    }
    mla_plan_limits lim = {8, 64, 4096, 512, P, 4, 0};
    size_t pws;
    TU_STATUS(mla_plan_workspace_size(ctx, &lim, &pws), MLA_OK);
    void *pw1 = malloc(pws), *pw2 = malloc(pws);

    /* Unpadded decode batch. */
    mla_batch b1 = {MLA_MODE_DECODE, 3, ids, lens, NULL, NULL, 0};
    mla_plan p1, p2;
    TU_STATUS(mla_plan_build(ctx, rt, &b1, &lim, H, pw1, pws, &p1), MLA_OK);
    /* The same requests with padding rows around them (seq_len 1 each). */
    int32_t pids[7] = {MLA_REQ_PAD, ids[0], ids[1], MLA_REQ_PAD, ids[2], MLA_REQ_PAD, MLA_REQ_PAD};
    int32_t plens[7] = {1, lens[0], lens[1], 1, lens[2], 1, 1};
    int real_row[7] = {-1, 0, 1, -1, 2, -1, -1};
    mla_batch b2 = {MLA_MODE_DECODE, 7, pids, plens, NULL, NULL, 0};
    TU_STATUS(mla_plan_build(ctx, rt, &b2, &lim, H, pw2, pws, &p2), MLA_OK);
    int pad_ok = 1;
    for (int i = 0; i < 7; i++) {
      if (real_row[i] >= 0) continue;
      pad_ok &= p2.kv_lens[i] == 1 && p2.kv_indices[p2.kv_indptr[i]] == 0;
      pad_ok &= p2.block_table[(size_t)i * p2.block_table_width] == 0;
      for (int j = 1; j < p2.block_table_width; j++)
        pad_ok &= p2.block_table[(size_t)i * p2.block_table_width + j] == MLA_BLOCK_TABLE_PAD;
    }
    TU_CHECK(pad_ok, "P=%d: padding rows point at slot 0 / page 0 only", P);

    /* A padding row with a request id nobody holds is still fine; a negative
     * id other than MLA_REQ_PAD is not. */
    int32_t bad_ids[2] = {ids[0], -2};
    int32_t bad_lens[2] = {lens[0], 1};
    mla_batch b3 = {MLA_MODE_DECODE, 2, bad_ids, bad_lens, NULL, NULL, 0};
    mla_plan p3;
    TU_STATUS(mla_plan_build(ctx, rt, &b3, &lim, H, pw1, pws, &p3), MLA_ERR_OUT_OF_RANGE);
    TU_STATUS(mla_plan_build(ctx, rt, &b1, &lim, H, pw1, pws, &p1), MLA_OK);

    /* Attention: the real rows agree; padding rows only ever see slot 0. */
    float qn[7 * H * 512], qr[7 * H * 64];
    tu_fill_bf16_normal(&rng, qn, 7 * H * 512, 1.0);
    tu_fill_bf16_normal(&rng, qr, 7 * H * 64, 1.0);
    float qn1[3 * H * 512], qr1[3 * H * 64];
    for (int i = 0; i < 7; i++)
      if (real_row[i] >= 0) {
        memcpy(qn1 + (size_t)real_row[i] * H * 512, qn + (size_t)i * H * 512, sizeof(float) * H * 512);
        memcpy(qr1 + (size_t)real_row[i] * H * 64, qr + (size_t)i * H * 64, sizeof(float) * H * 64);
      }
    static float o1[3 * H * 512], o2[7 * H * 512];
    float l1[3 * H], l2[7 * H];
    size_t aw1, aw2;
    TU_STATUS(mla_attention_absorbed_workspace_size(ctx, &p1, H, &aw1), MLA_OK);
    TU_STATUS(mla_attention_absorbed_workspace_size(ctx, &p2, H, &aw2), MLA_OK);
    void *ws = malloc(aw1 > aw2 ? aw1 : aw2);
    mla_absorbed_args a;
    memset(&a, 0, sizeof a);
    a.num_heads = H;
    a.scale = 0.07f;
    a.act_dtype = MLA_DTYPE_F32;
    a.q_nope = qn1;
    a.q_rope = qr1;
    a.out = o1;
    a.lse = l1;
    TU_STATUS(mla_attention_absorbed(ctx, cache, 0, &p1, &a, ws, aw1), MLA_OK);
    /* The dummy slot holds a finite row here, as after a padded KV write. */
    int32_t zero = 0;
    float zc[512], zr[64];
    tu_fill_bf16_normal(&rng, zc, 512, 1.0);
    tu_fill_bf16_normal(&rng, zr, 64, 1.0);
    TU_STATUS(mla_kv_cache_write(cache, 0, 1, &zero, zc, zr, MLA_DTYPE_F32), MLA_OK);
    a.q_nope = qn;
    a.q_rope = qr;
    a.out = o2;
    a.lse = l2;
    TU_STATUS(mla_attention_absorbed(ctx, cache, 0, &p2, &a, ws, aw2), MLA_OK);
    double max_diff = 0;
    int finite_pad = 1;
    for (int i = 0; i < 7; i++) {
      for (int e = 0; e < H * 512; e++) {
        float v2 = o2[(size_t)i * H * 512 + e];
        if (real_row[i] < 0) {
          finite_pad &= isfinite(v2);
          continue;
        }
        double dlt = fabs((double)v2 - o1[(size_t)real_row[i] * H * 512 + e]);
        if (!(dlt <= max_diff)) max_diff = isnan(dlt) ? INFINITY : dlt;
      }
    }
    TU_CHECK(max_diff <= 1e-5, "P=%d: real rows change with padding: max diff %g", P, max_diff);
    TU_CHECK(finite_pad, "P=%d: padding rows read something other than the (finite) dummy slot", P);

    /* Draft plan: padding rows get slot 0 for every key of every step. */
    size_t dws;
    TU_STATUS(mla_draft_plan_workspace_size(ctx, 8, 3, 512, &dws), MLA_OK);
    void *dw = malloc(dws);
    mla_draft_plan dp;
    int32_t dids[2] = {MLA_REQ_PAD, ids[2]}, dlens[2] = {1, lens[2] - 3};
    TU_STATUS(mla_draft_plan_build(ctx, rt, 2, dids, dlens, 3, dw, dws, &dp), MLA_OK);
    int dok = 1;
    for (int s = 0; s < 3; s++) {
      const int32_t *ip = dp.kv_indptr + s * 3, *ix = dp.kv_indices + dp.step_offset[s];
      dok &= ip[1] - ip[0] == 1 + s + 1;
      for (int j = ip[0]; j < ip[1]; j++) dok &= ix[j] == 0;
    }
    TU_CHECK(dok, "P=%d: draft plan padding rows", P);
    free(dw);
    free(ws);
    free(pw1);
    free(pw2);
    mla_req_table_destroy(rt);
    mla_kv_cache_destroy(cache);
  }
  mla_ctx_destroy(ctx);
  return tu_finish("test_padding");
}
