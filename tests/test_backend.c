/* The backend object: creation checks, plan/forward state machine, IDLE and
 * empty batches, bad arguments (nothing written), and a decode through the
 * backend equal to the same decode through the low-level calls. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static mla_backend_desc good_desc(void) {
  mla_backend_desc d;
  memset(&d, 0, sizeof d);
  d.cache.num_layers = 2;
  d.cache.num_pages = 64;
  d.cache.page_size = 16;
  d.cache.dtype = MLA_DTYPE_BF16;
  d.max_reqs = 8;
  d.max_context = 256;
  d.max_bs = 8;
  d.max_q_tokens = 512;
  d.num_heads = 3;
  d.scale = 0.07f;
  d.act_dtype = MLA_DTYPE_F32;
  return d;
}

int main(void) {
  tu_rng rng = {tu_seed("test_backend", 21)};
  mla_ctx *ctx;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &ctx), MLA_OK);

  /* ---- creation: every field checked, nothing returned on failure ---- */
  {
    mla_backend *be = (mla_backend *)&rng;
    mla_backend_desc d = good_desc();
    TU_STATUS(mla_backend_create(NULL, &d, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(be == NULL, "out cleared on failure");
    TU_STATUS(mla_backend_create(ctx, NULL, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_STATUS(mla_backend_create(ctx, &d, NULL), MLA_ERR_INVALID_ARGUMENT);
    mla_backend_desc bad;
    bad = d; bad.max_bs = 0;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "max_bs") != NULL, "message names max_bs: %s", mla_ctx_last_error(ctx));
    bad = d; bad.max_q_tokens = -1;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.num_heads = 0;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(strstr(mla_ctx_last_error(ctx), "num_heads") != NULL, "message names num_heads");
    bad = d; bad.num_heads = MLA_MAX_HEADS + 1;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.scale = NAN;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.scale = -1;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.act_dtype = MLA_DTYPE_FP8_E4M3;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_UNSUPPORTED);
    bad = d; bad.qk_nope_dim = 250;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.v_dim = 300;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.extend_impl = (mla_extend_impl)9;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.chunk_capacity = -5;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.cache.page_size = 3;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    bad = d; bad.cache.dtype = MLA_DTYPE_F32;
    mla_status st = mla_backend_create(ctx, &bad, &be);
    TU_CHECK(st == MLA_ERR_UNSUPPORTED || st == MLA_ERR_INVALID_ARGUMENT, "f32 cache refused: %s",
             mla_status_string(st));
    bad = d; bad.max_reqs = 0;
    TU_STATUS(mla_backend_create(ctx, &bad, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(be == NULL, "out stays NULL");
    mla_backend_destroy(NULL);
    TU_CHECK(mla_backend_last_error(NULL) != NULL, "last error of NULL");
  }

  mla_backend_desc d = good_desc();
  mla_backend *be = NULL;
  TU_STATUS(mla_backend_create(ctx, &d, &be), MLA_OK);
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  TU_STATUS(mla_backend_cache(be, &cache), MLA_OK);
  TU_STATUS(mla_backend_req_table(be, &rt), MLA_OK);
  TU_STATUS(mla_backend_cache(NULL, &cache), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_cache(be, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_req_table(be, NULL), MLA_ERR_INVALID_ARGUMENT);

  /* ---- before any plan ---- */
  const mla_plan *plan = NULL;
  TU_STATUS(mla_backend_get_plan(be, &plan), MLA_ERR_BAD_STATE);
  TU_CHECK(strstr(mla_backend_last_error(be), "mla_backend_plan") != NULL, "get_plan says why: %s",
           mla_backend_last_error(be));
  TU_STATUS(mla_backend_get_plan(be, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_backend_last_error(be), "plan") != NULL, "names the argument: %s",
           mla_backend_last_error(be));
  int uses = -1;
  TU_STATUS(mla_backend_uses_mha(be, &uses), MLA_ERR_BAD_STATE);
  TU_STATUS(mla_backend_uses_mha(be, NULL), MLA_ERR_INVALID_ARGUMENT);
  mla_forward_args a;
  memset(&a, 0, sizeof a);
  TU_STATUS(mla_backend_forward(be, &a), MLA_ERR_BAD_STATE);
  TU_CHECK(strstr(mla_backend_last_error(be), "plan") != NULL, "message says plan first: %s",
           mla_backend_last_error(be));

  /* ---- IDLE and empty batches ---- */
  mla_batch idle = {MLA_MODE_IDLE, 0, NULL, NULL, NULL, NULL, 0};
  TU_STATUS(mla_backend_plan(be, &idle), MLA_OK);
  TU_STATUS(mla_backend_forward(be, &a), MLA_OK);
  mla_batch empty = {MLA_MODE_DECODE, 0, NULL, NULL, NULL, NULL, 0};
  TU_STATUS(mla_backend_plan(be, &empty), MLA_OK);
  TU_STATUS(mla_backend_get_plan(be, &plan), MLA_OK);
  TU_CHECK(plan->num_q_tokens == 0, "empty plan has no rows");
  TU_STATUS(mla_backend_forward(be, &a), MLA_OK);

  /* ---- a decode batch: backend == low-level calls on the same data ---- */
  int bs = 3, H = d.num_heads;
  int32_t ids[3], lens[3], slots[3];
  int prompt[3] = {37, 0, 100};
  for (int i = 0; i < bs; i++) {
    TU_STATUS(mla_req_add(rt, &ids[i]), MLA_OK);
    if (prompt[i]) {
      int32_t *s = malloc(sizeof(int32_t) * (size_t)prompt[i]);
      float *c = malloc(sizeof(float) * (size_t)prompt[i] * 512), *r = malloc(sizeof(float) * (size_t)prompt[i] * 64);
      tu_fill_bf16_normal(&rng, c, (int64_t)prompt[i] * 512, 1.0);
      tu_fill_bf16_normal(&rng, r, (int64_t)prompt[i] * 64, 1.0);
      TU_STATUS(mla_req_extend(rt, ids[i], prompt[i], s), MLA_OK);
      for (int l = 0; l < d.cache.num_layers; l++)
        TU_STATUS(mla_kv_cache_write(cache, l, prompt[i], s, c, r, MLA_DTYPE_F32), MLA_OK);
      free(s);
      free(c);
      free(r);
    }
    TU_STATUS(mla_req_extend(rt, ids[i], 1, &slots[i]), MLA_OK);
    TU_STATUS(mla_req_length(rt, ids[i], &lens[i]), MLA_OK);
  }
  float new_c[3 * 512], new_r[3 * 64], qn[3 * 3 * 512], qr[3 * 3 * 64];
  tu_fill_bf16_normal(&rng, new_c, 3 * 512, 1.0);
  tu_fill_bf16_normal(&rng, new_r, 3 * 64, 1.0);
  tu_fill_bf16_normal(&rng, qn, 3 * 3 * 512, 1.0);
  tu_fill_bf16_normal(&rng, qr, 3 * 3 * 64, 1.0);
  static float out[3 * 3 * 512], out2[3 * 3 * 512];
  float lse[9], lse2[9];
  mla_batch dec = {MLA_MODE_DECODE, bs, ids, lens, NULL, NULL, 0};
  TU_STATUS(mla_backend_plan(be, &dec), MLA_OK);
  TU_STATUS(mla_backend_uses_mha(be, &uses), MLA_OK);
  TU_CHECK(uses == 0, "decode is absorbed");

  /* Bad forward arguments write nothing (outputs stay poisoned). */
  tu_poison(out, sizeof out);
  tu_poison(lse, sizeof lse);
  a.layer = 1;
  a.num_new = bs;
  a.new_slots = slots;
  a.new_c = new_c;
  a.new_r = new_r;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  mla_forward_args b = a;
  b.layer = 2;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_OUT_OF_RANGE);
  TU_CHECK(strstr(mla_backend_last_error(be), "layer") != NULL, "names layer");
  b = a;
  b.layer = -1;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_OUT_OF_RANGE);
  b = a;
  b.q_rope = NULL;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  b = a;
  b.out = NULL;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  b = a;
  b.new_c = NULL;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  b = a;
  b.num_new = -1;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  b = a;
  b.flags = 0x80;
  TU_STATUS(mla_backend_forward(be, &b), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_forward(NULL, &a), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_backend_forward(be, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(tu_all_poisoned(out, sizeof out) && tu_all_poisoned(lse, sizeof lse),
           "failed calls wrote nothing");

  TU_STATUS(mla_backend_forward(be, &a), MLA_OK);

  /* The same attention through the low-level calls. */
  mla_plan_limits lim = {d.max_bs, d.max_q_tokens, d.max_bs * d.max_context, d.max_context, d.cache.page_size, 2, 0};
  size_t pws = 0, aws = 0;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &pws), MLA_OK);
  void *pw = malloc(pws);
  mla_plan p2;
  TU_STATUS(mla_plan_build(ctx, rt, &dec, &lim, H, pw, pws, &p2), MLA_OK);
  TU_STATUS(mla_attention_absorbed_workspace_size(ctx, &p2, H, &aws), MLA_OK);
  void *aw = malloc(aws ? aws : 1);
  mla_absorbed_args aa;
  memset(&aa, 0, sizeof aa);
  aa.num_heads = H;
  aa.scale = d.scale;
  aa.act_dtype = MLA_DTYPE_F32;
  aa.q_nope = qn;
  aa.q_rope = qr;
  aa.out = out2;
  aa.lse = lse2;
  TU_STATUS(mla_attention_absorbed(ctx, cache, 1, &p2, &aa, aw, aws), MLA_OK);
  TU_CHECK(memcmp(out, out2, sizeof out) == 0 && memcmp(lse, lse2, sizeof lse) == 0,
           "backend and low-level results differ");
  /* The step's rows went into layer 1 only (written before attention). */
  float back_c[3 * 512], back_r[3 * 64];
  TU_STATUS(mla_kv_cache_read(cache, 1, bs, slots, back_c, back_r, MLA_DTYPE_F32), MLA_OK);
  TU_CHECK(memcmp(back_c, new_c, sizeof new_c) == 0 && memcmp(back_r, new_r, sizeof new_r) == 0,
           "layer 1 holds this step's rows");
  TU_STATUS(mla_kv_cache_read(cache, 0, bs, slots, back_c, back_r, MLA_DTYPE_F32), MLA_OK);
  int zeros = 1;
  for (int i = 0; i < 3 * 512; i++) zeros &= back_c[i] == 0.0f;
  TU_CHECK(zeros, "layer 0 untouched by a layer-1 forward");
  free(pw);
  free(aw);

  mla_backend_destroy(be);
  mla_ctx_destroy(ctx);
  return tu_finish("test_backend");
}
