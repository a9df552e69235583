/* The CPU kernels against every golden case (tests/golden, float64 results
 * computed outside the project): absorbed cases through a real paged cache
 * (bf16: the inputs are bf16-representable, so storage is exact), request
 * table and plan; MHA cases through mla_attention_ragged; merge cases through
 * mla_merge_states. f32 activations; o within 1e-5 + 1e-4 |ref|, lse within
 * 1e-6 + 1e-5 |ref|, cosine distance < 5e-6, nonfinite positions exact. */
#define _POSIX_C_SOURCE 200809L /* opendir: every case in the folder is run */
#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "ref.h"
#include "test_util.h"

#define O_ATOL 1e-5
#define O_RTOL 1e-4
#define LSE_ATOL 1e-6
#define LSE_RTOL 1e-5
#define MAX_COS 5e-6

static tu_rng rng;

static void compare(const char *what, const char *name, const double *got, const double *ref,
                    int64_t n, double atol, double rtol) {
  ref_cmp c = ref_compare(got, ref, n, atol, rtol);
  TU_CHECK(ref_cmp_ok(&c, MAX_COS),
           "%s %s: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g), "
           "max abs %.3g, cos dist %.3g",
           name, what, (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)n,
           (long long)c.first_bad, c.first_bad >= 0 ? got[c.first_bad] : 0.0,
           c.first_bad >= 0 ? ref[c.first_bad] : 0.0, c.max_abs_err, c.cos_dist);
}

static float *to_f32(const ref_tensor *t) {
  float *f = malloc(sizeof(float) * (size_t)(t->numel ? t->numel : 1));
  for (int64_t i = 0; i < t->numel; i++) f[i] = (float)t->data[i];
  return f;
}

static double *from_f32(const float *f, int64_t n) {
  if (n < 0) n = 0;
  double *d = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) d[i] = f[i];
  return d;
}

/* ---- absorbed: cache + request table + plan ------------------------------ */

typedef enum { AS_DECODE, AS_VERIFY, AS_EXTEND } absorbed_mode;

static void run_absorbed(mla_ctx *ctx, const char *name, const ref_golden *g, int page_size,
                         absorbed_mode am) {
  const int bs = g->batch, H = g->heads;
  const ref_tensor *tq = ref_golden_tensor(g, "q_nope"), *tqr = ref_golden_tensor(g, "q_rope");
  const ref_tensor *tc = ref_golden_tensor(g, "c"), *tr = ref_golden_tensor(g, "r");
  const ref_tensor *to = ref_golden_tensor(g, "o"), *tl = ref_golden_tensor(g, "lse");
  TU_CHECK(tq && tqr && tc && tr && to && tl, "%s: missing tensors", name);
  if (!(tq && tqr && tc && tr && to && tl)) return;
  int Tq = 0, Tk = 0, max_kv = 1, npad = 7;
  for (int i = 0; i < bs; i++) {
    Tq += g->q_len[i];
    Tk += g->kv_len[i];
    if (g->kv_len[i] > max_kv) max_kv = g->kv_len[i];
  }
  int pages = 2 + npad;
  for (int i = 0; i < bs; i++) pages += (g->kv_len[i] + page_size - 1) / page_size;

  mla_kv_cache_desc cd = {1, pages, page_size, MLA_DTYPE_BF16, NULL};
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  TU_STATUS(mla_kv_cache_create(ctx, &cd, &cache), MLA_OK);
  mla_req_table_desc rd = {bs + npad, max_kv, pages, page_size};
  TU_STATUS(mla_req_table_create(ctx, &rd, cache, &rt), MLA_OK);
  if (!cache || !rt) goto done_early;
  tu_poison_cache(cache);

  /* Scatter the free list: take pages for padding requests, free them in a
   * random order. */
  int32_t pad_ids[16];
  for (int p = 0; p < npad; p++) {
    TU_STATUS(mla_req_add(rt, &pad_ids[p]), MLA_OK);
    TU_STATUS(mla_req_extend(rt, pad_ids[p], page_size, NULL), MLA_OK);
  }
  tu_shuffle_i32(&rng, pad_ids, npad);
  for (int p = 0; p < npad; p++) TU_STATUS(mla_req_free(rt, pad_ids[p]), MLA_OK);

  int32_t *req_ids = calloc((size_t)bs, sizeof(int32_t));
  int32_t *slots = calloc((size_t)(Tk ? Tk : 1), sizeof(int32_t));
  float *c32 = to_f32(tc), *r32 = to_f32(tr);
  int koff = 0;
  for (int i = 0; i < bs; i++) {
    TU_STATUS(mla_req_add(rt, &req_ids[i]), MLA_OK);
    TU_STATUS(mla_req_extend(rt, req_ids[i], g->kv_len[i], slots + koff), MLA_OK);
    koff += g->kv_len[i];
  }
  if (Tk > 0)
    TU_STATUS(mla_kv_cache_write(cache, 0, Tk, slots, c32, r32, MLA_DTYPE_F32), MLA_OK);

  /* the batch in the planner's terms */
  int32_t *seq = calloc((size_t)bs, sizeof(int32_t)), *pre = calloc((size_t)bs, sizeof(int32_t));
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.batch_size = bs;
  b.req_ids = req_ids;
  b.seq_lens = seq;
  for (int i = 0; i < bs; i++) {
    switch (am) {
      case AS_DECODE: seq[i] = g->kv_len[i]; break;
      case AS_VERIFY: seq[i] = g->kv_len[i] - g->q_len[i]; break;
      case AS_EXTEND:
        seq[i] = g->kv_len[i];
        pre[i] = g->kv_len[i] - g->q_len[i];
        break;
    }
  }
  b.mode = am == AS_DECODE ? MLA_MODE_DECODE : am == AS_VERIFY ? MLA_MODE_TARGET_VERIFY
                                                               : MLA_MODE_EXTEND;
  if (am == AS_VERIFY) b.num_draft_tokens = g->q_len[0];
  if (am == AS_EXTEND) b.prefix_lens = pre;
  mla_plan_limits lim = {bs, Tq > 0 ? Tq : 1, Tk > 0 ? Tk : 1, max_kv, page_size, 2, 0};
  size_t pbytes = 0, wbytes = 0;
  TU_STATUS(mla_plan_workspace_size(ctx, &lim, &pbytes), MLA_OK);
  void *pws = malloc(pbytes);
  mla_plan plan;
  TU_STATUS(mla_plan_build(ctx, rt, &b, &lim, H, pws, pbytes, &plan), MLA_OK);
  TU_CHECK(plan.causal == g->causal || am == AS_DECODE, "%s: plan causal %d vs %d", name,
           (int)plan.causal, g->causal);
  TU_STATUS(mla_attention_absorbed_workspace_size(ctx, &plan, H, &wbytes), MLA_OK);
  void *ws = malloc(wbytes);

  float *qn = to_f32(tq), *qr = to_f32(tqr);
  float *out = malloc(sizeof(float) * (size_t)Tq * H * MLA_LATENT + 4);
  float *lse = malloc(sizeof(float) * (size_t)Tq * H + 4);
  tu_poison(out, sizeof(float) * (size_t)Tq * H * MLA_LATENT);
  tu_poison(lse, sizeof(float) * (size_t)Tq * H);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  a.scale = (float)g->scale;
  a.act_dtype = MLA_DTYPE_F32;
  a.q_nope = qn;
  a.q_rope = qr;
  a.out = out;
  a.lse = lse;
  TU_STATUS(mla_attention_absorbed(ctx, cache, 0, &plan, &a, ws, wbytes), MLA_OK);
  char what[96];
  snprintf(what, sizeof what, "absorbed P=%d mode=%d o", page_size, (int)b.mode);
  double *od = from_f32(out, (int64_t)Tq * H * MLA_LATENT), *ld = from_f32(lse, (int64_t)Tq * H);
  compare(what, name, od, to->data, to->numel, O_ATOL, O_RTOL);
  snprintf(what, sizeof what, "absorbed P=%d mode=%d lse", page_size, (int)b.mode);
  compare(what, name, ld, tl->data, tl->numel, LSE_ATOL, LSE_RTOL);

  free(od);
  free(ld);
  free(qn);
  free(qr);
  free(out);
  free(lse);
  free(ws);
  free(pws);
  free(seq);
  free(pre);
  free(c32);
  free(r32);
  free(slots);
  free(req_ids);
done_early:
  mla_req_table_destroy(rt);
  mla_kv_cache_destroy(cache);
}

/* ---- mha ------------------------------------------------------------------ */

static void run_mha(mla_ctx *ctx, const char *name, const ref_golden *g) {
  const ref_tensor *tq = ref_golden_tensor(g, "q"), *tk = ref_golden_tensor(g, "k");
  const ref_tensor *tv = ref_golden_tensor(g, "v"), *to = ref_golden_tensor(g, "o");
  const ref_tensor *tl = ref_golden_tensor(g, "lse");
  TU_CHECK(tq && tk && tv && to && tl, "%s: missing tensors", name);
  if (!(tq && tk && tv && to && tl)) return;
  const int bs = g->batch, H = g->heads;
  int32_t qo[257], kv[257];
  qo[0] = kv[0] = 0;
  for (int i = 0; i < bs; i++) {
    qo[i + 1] = qo[i] + g->q_len[i];
    kv[i + 1] = kv[i] + g->kv_len[i];
  }
  const int64_t Tq = qo[bs];
  float *q = to_f32(tq), *k = to_f32(tk), *v = to_f32(tv);
  float *out = malloc(sizeof(float) * (size_t)(Tq * H * g->v_dim + 1));
  float *lse = malloc(sizeof(float) * (size_t)(Tq * H + 1));
  tu_poison(out, sizeof(float) * (size_t)(Tq * H * g->v_dim));
  tu_poison(lse, sizeof(float) * (size_t)(Tq * H));
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  a.batch_size = bs;
  a.num_heads = a.num_kv_heads = H;
  a.qk_dim = g->qk_dim;
  a.v_dim = g->v_dim;
  a.scale = (float)g->scale;
  a.softcap = (float)g->softcap;
  a.causal = g->causal;
  a.act_dtype = MLA_DTYPE_F32;
  a.qo_indptr = qo;
  a.kv_indptr = kv;
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = lse;
  TU_STATUS(mla_attention_ragged(ctx, &a), MLA_OK);
  double *od = from_f32(out, Tq * H * g->v_dim), *ld = from_f32(lse, Tq * H);
  compare("mha o", name, od, to->data, to->numel, O_ATOL, O_RTOL);
  compare("mha lse", name, ld, tl->data, tl->numel, LSE_ATOL, LSE_RTOL);
  free(od);
  free(ld);
  free(q);
  free(k);
  free(v);
  free(out);
  free(lse);
}

/* ---- merge ---------------------------------------------------------------- */

static void run_merge(mla_ctx *ctx, const char *name, const ref_golden *g, int in_place) {
  const ref_tensor *ta = ref_golden_tensor(g, "o_a"), *tb = ref_golden_tensor(g, "o_b");
  const ref_tensor *tla = ref_golden_tensor(g, "lse_a"), *tlb = ref_golden_tensor(g, "lse_b");
  const ref_tensor *to = ref_golden_tensor(g, "o"), *tl = ref_golden_tensor(g, "lse");
  TU_CHECK(ta && tb && tla && tlb && to && tl, "%s: missing tensors", name);
  if (!(ta && tb && tla && tlb && to && tl)) return;
  const int T = g->tokens, H = g->heads, D = g->dim;
  float *oa = to_f32(ta), *ob = to_f32(tb), *la = to_f32(tla), *lb = to_f32(tlb);
  float *out = in_place ? oa : malloc(sizeof(float) * (size_t)T * H * D);
  float *lse = in_place ? la : malloc(sizeof(float) * (size_t)T * H);
  if (!in_place) {
    tu_poison(out, sizeof(float) * (size_t)T * H * D);
    tu_poison(lse, sizeof(float) * (size_t)T * H);
  }
  const void *parts[2] = {oa, ob};
  const float *lses[2] = {la, lb};
  TU_STATUS(mla_merge_states(ctx, 2, T, H, D, MLA_DTYPE_F32, 0, parts, lses, out, lse), MLA_OK);
  double *od = from_f32(out, (int64_t)T * H * D), *ld = from_f32(lse, (int64_t)T * H);
  compare(in_place ? "merge (in place) o" : "merge o", name, od, to->data, to->numel, O_ATOL,
          O_RTOL);
  compare(in_place ? "merge (in place) lse" : "merge lse", name, ld, tl->data, tl->numel,
          LSE_ATOL, LSE_RTOL);
  free(od);
  free(ld);
  if (!in_place) {
    free(out);
    free(lse);
  }
  free(oa);
  free(ob);
  free(la);
  free(lb);
}

/* The cases this test was written against; any other case found in the
 * folder runs too. */
static const char *known[] = {"decode_h16",         "decode_h128",         "verify_s3_h8",
                              "extend_prefix_h4",   "mha_causal_192_128",  "mha_chunk_noncausal",
                              "mha_prefix_causal",  "mha_softcap",         "merge_states"};
#define NKNOWN (int)(sizeof known / sizeof known[0])

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int main(void) {
  rng.s = tu_seed("test_golden_cpu", 20240607);
  mla_ctx *ctx = NULL;
  mla_ctx_desc cdesc = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cdesc, &ctx), MLA_OK);
  if (!ctx) return tu_finish("test_golden_cpu");
  /* every sub-folder holding a meta.txt, in name order */
  char root[1024];
  tu_golden_path("", root, sizeof root);
  char *names[256];
  int nn = 0;
  DIR *dir = opendir(root);
  TU_CHECK(dir != NULL, "cannot open the golden folder %s", root);
  for (struct dirent *e; dir && (e = readdir(dir)) != NULL && nn < 256;) {
    char meta[1400];
    if (e->d_name[0] == '.') continue;
    snprintf(meta, sizeof meta, "%s/%s/meta.txt", root, e->d_name);
    FILE *f = fopen(meta, "r");
    if (!f) continue;
    fclose(f);
    names[nn] = malloc(strlen(e->d_name) + 1);
    strcpy(names[nn++], e->d_name);
  }
  if (dir) closedir(dir);
  qsort(names, (size_t)nn, sizeof names[0], cmp_str);
  int found_known = 0;
  for (int k = 0; k < NKNOWN; k++)
    for (int i = 0; i < nn; i++) found_known += !strcmp(names[i], known[k]);
  TU_CHECK(found_known == NKNOWN, "only %d of the %d known golden cases found in %s", found_known,
           NKNOWN, root);
  for (int ci = 0; ci < nn; ci++) {
    const char *name = names[ci];
    char path[1024];
    ref_golden g;
    tu_golden_path(name, path, sizeof path);
    int ok = ref_golden_load(path, &g) == 0;
    TU_CHECK(ok, "cannot load golden case %s", path);
    if (!ok) continue;
    printf("case %s (%s)\n", name, g.kind);
    if (!strcmp(g.kind, "absorbed")) {
      int all_decode = !g.causal;
      for (int i = 0; i < g.batch; i++) all_decode &= g.q_len[i] == 1;
      int uniform_q = g.causal && g.batch > 0;
      for (int i = 0; i < g.batch; i++) {
        uniform_q &= g.q_len[i] == g.q_len[0];
        uniform_q &= g.kv_len[i] >= g.q_len[i];
      }
      int extend_ok = g.causal;
      for (int i = 0; i < g.batch; i++) extend_ok &= g.kv_len[i] >= g.q_len[i];
      TU_CHECK(all_decode || extend_ok, "%s: no forward mode expresses this case", name);
      const int psizes[3] = {1, 16, 64};
      for (int p = 0; p < 3; p++) {
        if (all_decode) run_absorbed(ctx, name, &g, psizes[p], AS_DECODE);
        if (extend_ok) run_absorbed(ctx, name, &g, psizes[p], AS_EXTEND);
        if (uniform_q) run_absorbed(ctx, name, &g, psizes[p], AS_VERIFY);
      }
    } else if (!strcmp(g.kind, "mha")) {
      run_mha(ctx, name, &g);
    } else if (!strcmp(g.kind, "merge")) {
      run_merge(ctx, name, &g, 0);
      run_merge(ctx, name, &g, 1);
    } else {
      TU_CHECK(0, "%s: unknown kind %s", name, g.kind);
    }
    ref_golden_free(&g);
  }
  for (int i = 0; i < nn; i++) free(names[i]);
  mla_ctx_destroy(ctx);
  return tu_finish("test_golden_cpu");
}
