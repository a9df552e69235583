/* The CPU kernels run on the caller's thread too (it joins the workers), so
 * they must not need a large stack: run ragged MHA (192/128 and 256/256) and
 * the k/v expansion from a thread with a 192 KiB stack. Their tiles come from
 * the context's scratch; a stack-resident tile (~0.5 MB) would crash here. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

typedef struct {
  mla_status st[3];
} result;

static void *body(void *arg) {
  result *res = arg;
  tu_rng rng = {3};
  mla_ctx *ctx = NULL;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 1, 0};
  if (mla_ctx_create(&cd, &ctx) != MLA_OK) return NULL;
  const int dims[2][2] = {{192, 128}, {256, 256}};
  for (int d = 0; d < 2; d++) {
    int T = 200, H = 2, dqk = dims[d][0], dv = dims[d][1];
    float *q = malloc(sizeof(float) * T * H * dqk), *k = malloc(sizeof(float) * T * H * dqk);
    float *v = malloc(sizeof(float) * T * H * dv), *o = malloc(sizeof(float) * T * H * dv);
    tu_fill_bf16_normal(&rng, q, (int64_t)T * H * dqk, 1.0);
    tu_fill_bf16_normal(&rng, k, (int64_t)T * H * dqk, 1.0);
    tu_fill_bf16_normal(&rng, v, (int64_t)T * H * dv, 1.0);
    int32_t indptr[2] = {0, T};
    mla_ragged_args a;
    memset(&a, 0, sizeof a);
    a.batch_size = 1;
    a.num_heads = a.num_kv_heads = H;
    a.qk_dim = dqk;
    a.v_dim = dv;
    a.scale = 0.07f;
    a.causal = 1;
    a.act_dtype = MLA_DTYPE_F32;
    a.qo_indptr = a.kv_indptr = indptr;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = o;
    res->st[d] = mla_attention_ragged(ctx, &a);
    free(q);
    free(k);
    free(v);
    free(o);
  }
  int T = 40, H = 2;
  float *c = calloc((size_t)T * 512, 4), *r = calloc((size_t)T * 64, 4);
  float *w = calloc((size_t)H * 256 * 512, 4), *ko = malloc(sizeof(float) * T * H * 192);
  float *vo = malloc(sizeof(float) * T * H * 128);
  res->st[2] = mla_expand_kv(ctx, T, H, 128, 128, MLA_DTYPE_F32, MLA_DTYPE_F32, c, r, w, ko, vo);
  free(c);
  free(r);
  free(w);
  free(ko);
  free(vo);
  mla_ctx_destroy(ctx);
  return NULL;
}

int main(void) {
  tu_seed("test_small_stack", 3);
  result res = {{MLA_ERR_INTERNAL, MLA_ERR_INTERNAL, MLA_ERR_INTERNAL}};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 192 * 1024);
  pthread_t th;
  TU_CHECK(pthread_create(&th, &attr, body, &res) == 0, "thread with a small stack");
  pthread_join(th, NULL);
  TU_STATUS(res.st[0], MLA_OK);
  TU_STATUS(res.st[1], MLA_OK);
  TU_STATUS(res.st[2], MLA_OK);
  return tu_finish("test_small_stack");
}
