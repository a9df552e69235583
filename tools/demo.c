/* `mla demo`, part 1: the per-mode table, a short step sequence through one
 * backend object (part 2, the serving simulation, is serve.c).
 *
 * Requests are prefilled (EXTEND without prefix: ragged MHA), one request is
 * forked from another's prefix, then the batch goes through EXTEND with a
 * prefix (absorbed, and on a second backend chunked MHA), DECODE,
 * TARGET_VERIFY with rollback of rejected drafts, DRAFT_EXTEND (varlen and
 * fixed window) and IDLE. Every attention output is compared with the float64
 * oracle (tests/ref) computed on the rows the cache really holds. */
#include "demo.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "demo_util.h"
#include "ref.h"

#define L MLA_LATENT
#define R MLA_ROPE

/* An activation tensor: random N(0, sigma) values held in the act dtype,
 * plus the same values as double (what the oracle sees). */
typedef struct act {
  void *data;
  double *ref;
  int64_t n;
} act;

static int act_random(act *a, int64_t n, mla_dtype t, demo_rng *g, double sigma) {
  a->n = n;
  a->data = malloc((size_t)(n ? n : 1) * mla_dtype_size(t));
  a->ref = malloc((size_t)(n ? n : 1) * sizeof(double));
  if (!a->data || !a->ref) return -1;
  for (int64_t i = 0; i < n; i++) a->ref[i] = demo_rng_normal(g) * sigma;
  mla_convert(a->ref, MLA_DTYPE_F64, a->data, t, n);
  mla_convert(a->data, t, a->ref, MLA_DTYPE_F64, n); /* what the library sees */
  return 0;
}
static void act_free(act *a) {
  free(a->data);
  free(a->ref);
  memset(a, 0, sizeof *a);
}

typedef struct demo {
  const demo_opts *o;
  FILE *out;
  demo_rng g;
  mla_ctx *ctx;
  int failures;
} demo;

static int check_status(demo *d, mla_status st, const char *what, const char *detail) {
  if (st == MLA_OK) return 0;
  fprintf(d->out, "error: %s: %s (%s)\n", what, mla_status_string(st), detail ? detail : "");
  return -1;
}
#define TRY(d, call, detail)                                                  \
  do {                                                                        \
    if (check_status((d), (call), #call, (detail)) != 0) return -1;           \
  } while (0)

/* Compare an output with the oracle and print one table row. */
static void report(demo *d, const char *mode, const char *shape, const void *out, mla_dtype t,
                   const double *ref_o, int64_t n_o, const float *lse, const double *ref_lse, int64_t n_lse,
                   double lse_atol, double ms) {
  double *got = malloc((size_t)(n_o ? n_o : 1) * sizeof(double));
  double *gl = malloc((size_t)(n_lse ? n_lse : 1) * sizeof(double));
  demo_cmp c;
  memset(&c, 0, sizeof c); /* ok = 0 when the buffers could not be had */
  if (got && gl) {
    mla_convert(out, t, got, MLA_DTYPE_F64, n_o);
    for (int64_t i = 0; i < n_lse; i++) gl[i] = lse[i];
    c = demo_compare(got, ref_o, n_o, t, lse ? gl : NULL, ref_lse, n_lse, lse_atol);
  }
  if (!c.ok) d->failures++;
  fprintf(d->out, "%-26s %-28s %10.2e %10.2e %10.2e %9.3f  %s\n", mode, shape, c.max_abs_err, c.cos_dist,
          c.lse_err, ms, c.ok ? "ok" : "FAIL");
  free(got);
  free(gl);
}

/* Absorbed reference for a planned batch: per request, keys 0..kv_len-1. */
static void ref_absorbed_batch(mla_backend *be, const mla_plan *p, int H, double scale, const act *qn,
                               const act *qr, double *o, double *lse) {
  for (int i = 0; i < p->batch_size; i++) {
    int q0 = p->qo_indptr[i], nq = p->qo_indptr[i + 1] - q0, kv = p->kv_lens[i];
    double *c = malloc((size_t)(kv ? kv : 1) * L * sizeof(double));
    double *r = malloc((size_t)(kv ? kv : 1) * R * sizeof(double));
    demo_read_request(be, 0, p->req_ids[i], kv, c, r);
    ref_absorbed(1, &nq, &kv, H, scale, p->causal, qn->ref + (size_t)q0 * H * L, qr->ref + (size_t)q0 * H * R,
                 c, r, o + (size_t)q0 * H * L, lse + (size_t)q0 * H);
    free(c);
    free(r);
  }
}

typedef struct step {
  const char *name;
  mla_batch batch;
  int num_new;
  int32_t *new_slots;
} step;

/* Run one absorbed-mode step: write random latent rows for new_slots, run
 * attention, compare. */
static int run_absorbed_step(demo *d, mla_backend *be, const char *name, const mla_batch *b, int num_new,
                             const int32_t *new_slots) {
  const demo_opts *o = d->o;
  int H = o->heads;
  TRY(d, mla_backend_plan(be, b), mla_backend_last_error(be));
  const mla_plan *p;
  TRY(d, mla_backend_get_plan(be, &p), "");
  int T = p->num_q_tokens;
  act nc, nr, qn, qr;
  if (act_random(&nc, (int64_t)num_new * L, o->act_dtype, &d->g, 1.0) ||
      act_random(&nr, (int64_t)num_new * R, o->act_dtype, &d->g, 1.0) ||
      act_random(&qn, (int64_t)T * H * L, o->act_dtype, &d->g, 1.0) ||
      act_random(&qr, (int64_t)T * H * R, o->act_dtype, &d->g, 1.0))
    return -1;
  size_t es = mla_dtype_size(o->act_dtype);
  void *out = malloc((size_t)(T ? T : 1) * H * L * es);
  float *lse = malloc((size_t)(T ? T : 1) * H * sizeof(float));
  mla_forward_args a;
  memset(&a, 0, sizeof a);
  a.num_new = num_new;
  a.new_slots = new_slots;
  a.new_c = nc.data;
  a.new_r = nr.data;
  a.q_nope = qn.data;
  a.q_rope = qr.data;
  a.out = out;
  a.lse = lse;
  double t0 = demo_now_ms();
  mla_status st = mla_backend_forward(be, &a);
  double ms = demo_now_ms() - t0;
  if (st == MLA_OK) {
    double *ro = malloc((size_t)(T ? T : 1) * H * L * sizeof(double));
    double *rl = malloc((size_t)(T ? T : 1) * H * sizeof(double));
    ref_absorbed_batch(be, p, H, 1.0 / sqrt(192.0), &qn, &qr, ro, rl);
    char shape[64];
    snprintf(shape, sizeof shape, "bs=%d q=%d kv=%d H=%d", p->batch_size, T, p->num_kv_tokens, H);
    report(d, name, shape, out, o->act_dtype, ro, (int64_t)T * H * L, lse, rl, (int64_t)T * H, DEMO_LSE_ATOL, ms);
    free(ro);
    free(rl);
  } else {
    check_status(d, st, name, mla_backend_last_error(be));
  }
  free(out);
  free(lse);
  act_free(&nc);
  act_free(&nr);
  act_free(&qn);
  act_free(&qr);
  return st == MLA_OK ? 0 : -1;
}

/* Extend every listed request by n[i] tokens; slots appended to *slots. */
static int extend_all(demo *d, mla_req_table *rt, int bs, const int32_t *ids, const int *n, int32_t *slots,
                      int *num_slots) {
  *num_slots = 0;
  for (int i = 0; i < bs; i++) {
    mla_status st = mla_req_extend(rt, ids[i], n[i], slots + *num_slots);
    if (check_status(d, st, "mla_req_extend", mla_req_table_last_error(rt))) return -1;
    *num_slots += n[i];
  }
  return 0;
}

static int lengths(mla_req_table *rt, int bs, const int32_t *ids, int32_t *lens) {
  for (int i = 0; i < bs; i++) {
    int len;
    if (mla_req_length(rt, ids[i], &len) != MLA_OK) return -1;
    lens[i] = len;
  }
  return 0;
}

static mla_backend_desc backend_desc(const demo_opts *o, mla_extend_impl impl) {
  mla_backend_desc bd;
  memset(&bd, 0, sizeof bd);
  bd.cache.num_layers = 1;
  bd.cache.page_size = o->page_size;
  bd.cache.dtype = o->cache_dtype;
  int tokens_per_req = o->max_prompt + 128;
  bd.cache.num_pages = 2 + (o->requests + 1) * (tokens_per_req / o->page_size + 3);
  bd.max_reqs = o->requests + 1;
  bd.max_context = tokens_per_req;
  bd.max_bs = o->requests + 1;
  bd.max_q_tokens = (o->requests + 1) * tokens_per_req;
  bd.num_heads = o->heads;
  bd.scale = (float)(1.0 / sqrt(192.0)); /* sglang's 192^-0.5, not 576^-0.5 */
  bd.act_dtype = o->act_dtype;
  bd.extend_impl = impl;
  bd.chunk_capacity = 64 * (o->requests + 1); /* small: several chunks */
  return bd;
}

/* Prefill (EXTEND without prefix, ragged MHA) of n requests from scratch.
 * Returns the MHA inputs' reference check row. */
static int prefill(demo *d, mla_backend *be, int n, const int32_t *ids, const int *prompt) {
  const demo_opts *o = d->o;
  mla_req_table *rt;
  mla_backend_req_table(be, &rt);
  int H = o->heads, T = 0;
  for (int i = 0; i < n; i++) T += prompt[i];
  int32_t *slots = malloc((size_t)T * sizeof(int32_t)), *seq = malloc((size_t)n * sizeof(int32_t));
  int ns;
  if (extend_all(d, rt, n, ids, prompt, slots, &ns)) return -1;
  lengths(rt, n, ids, seq);
  mla_batch b = {MLA_MODE_EXTEND, n, ids, seq, NULL, NULL, 0};
  TRY(d, mla_backend_plan(be, &b), mla_backend_last_error(be));
  int dqk = 192, dv = 128;
  act nc, nr, q, k, v;
  if (act_random(&nc, (int64_t)T * L, o->act_dtype, &d->g, 1.0) ||
      act_random(&nr, (int64_t)T * R, o->act_dtype, &d->g, 1.0) ||
      act_random(&q, (int64_t)T * H * dqk, o->act_dtype, &d->g, 1.0) ||
      act_random(&k, (int64_t)T * H * dqk, o->act_dtype, &d->g, 1.0) ||
      act_random(&v, (int64_t)T * H * dv, o->act_dtype, &d->g, 1.0))
    return -1;
  void *out = malloc((size_t)T * H * dv * mla_dtype_size(o->act_dtype));
  float *lse = malloc((size_t)T * H * sizeof(float));
  mla_forward_args a;
  memset(&a, 0, sizeof a);
  a.num_new = ns;
  a.new_slots = slots;
  a.new_c = nc.data;
  a.new_r = nr.data;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.out = out;
  a.lse = lse;
  double t0 = demo_now_ms();
  mla_status st = mla_backend_forward(be, &a);
  double ms = demo_now_ms() - t0;
  if (st == MLA_OK) {
    double *ro = malloc((size_t)T * H * dv * sizeof(double)), *rl = malloc((size_t)T * H * sizeof(double));
    ref_mha(n, prompt, prompt, H, H, dqk, dv, 1.0 / sqrt(192.0), 0.0, 1, q.ref, k.ref, v.ref, ro, rl);
    char shape[64];
    snprintf(shape, sizeof shape, "bs=%d q=%d 192/128 H=%d", n, T, H);
    report(d, "EXTEND no prefix (MHA)", shape, out, o->act_dtype, ro, (int64_t)T * H * dv, lse, rl,
           (int64_t)T * H, DEMO_LSE_ATOL, ms);
    free(ro);
    free(rl);
  } else {
    check_status(d, st, "prefill", mla_backend_last_error(be));
  }
  free(out);
  free(lse);
  free(slots);
  free(seq);
  act_free(&nc);
  act_free(&nr);
  act_free(&q);
  act_free(&k);
  act_free(&v);
  return st == MLA_OK ? 0 : -1;
}

static int absorbed_backend_steps(demo *d) {
  const demo_opts *o = d->o;
  mla_backend_desc bd = backend_desc(o, MLA_EXTEND_ABSORBED);
  mla_backend *be = NULL;
  TRY(d, mla_backend_create(d->ctx, &bd, &be), mla_ctx_last_error(d->ctx));
  mla_req_table *rt;
  mla_backend_req_table(be, &rt);
  int n = o->requests, bs = n + 1, rc = -1;
  int32_t ids[65], seq[65];
  int prompt[65] = {0}, ext[65] = {0};
  int32_t *slots = malloc((size_t)bs * (o->max_prompt + 128) * sizeof(int32_t));
  int ns = 0;
  for (int i = 0; i < n; i++) {
    if (mla_req_add(rt, &ids[i]) != MLA_OK) goto done;
    prompt[i] = demo_rng_int(&d->g, 1, o->max_prompt);
  }
  if (prefill(d, be, n, ids, prompt)) goto done;

  /* A new request sharing request 0's prompt prefix (pages shared by
   * reference); both then extend, copy-on-write keeping them apart. */
  int share = prompt[0] / 2 + 1 > prompt[0] ? prompt[0] : prompt[0] / 2 + 1;
  if (check_status(d, mla_req_fork(rt, ids[0], share, &ids[n]), "mla_req_fork", mla_req_table_last_error(rt)))
    goto done;
  int32_t prefix[65];
  lengths(rt, bs, ids, prefix);
  for (int i = 0; i < bs; i++) ext[i] = demo_rng_int(&d->g, 1, 40);
  if (extend_all(d, rt, bs, ids, ext, slots, &ns)) goto done;
  lengths(rt, bs, ids, seq);
  {
    mla_batch b = {MLA_MODE_EXTEND, bs, ids, seq, NULL, prefix, 0};
    if (run_absorbed_step(d, be, "EXTEND+prefix (absorbed)", &b, ns, slots)) goto done;
  }
  /* DECODE: one new token each. */
  for (int i = 0; i < bs; i++) ext[i] = 1;
  if (extend_all(d, rt, bs, ids, ext, slots, &ns)) goto done;
  lengths(rt, bs, ids, seq);
  {
    mla_batch b = {MLA_MODE_DECODE, bs, ids, seq, NULL, NULL, 0};
    if (run_absorbed_step(d, be, "DECODE", &b, ns, slots)) goto done;
  }
  /* TARGET_VERIFY: ndt draft tokens appended, verified, the rejected ones
   * rolled back in the request table. */
  int ndt = 4;
  lengths(rt, bs, ids, seq); /* committed length, without drafts */
  for (int i = 0; i < bs; i++) ext[i] = ndt;
  if (extend_all(d, rt, bs, ids, ext, slots, &ns)) goto done;
  {
    mla_batch b = {MLA_MODE_TARGET_VERIFY, bs, ids, seq, NULL, NULL, ndt};
    if (run_absorbed_step(d, be, "TARGET_VERIFY ndt=4", &b, ns, slots)) goto done;
  }
  int accept[65];
  for (int i = 0; i < bs; i++) {
    accept[i] = demo_rng_int(&d->g, 1, ndt); /* tokens kept, incl. the bonus token */
    if (check_status(d, mla_req_truncate(rt, ids[i], seq[i] + accept[i]), "mla_req_truncate",
                     mla_req_table_last_error(rt)))
      goto done;
  }
  /* DRAFT_EXTEND (varlen): the draft model re-reads the accepted tokens. */
  lengths(rt, bs, ids, seq);
  ns = 0;
  {
    const int32_t *r2t;
    mla_req_table_data(rt, &r2t);
    for (int i = 0; i < bs; i++)
      for (int j = seq[i] - accept[i]; j < seq[i]; j++) slots[ns++] = r2t[(size_t)ids[i] * bd.max_context + j];
    int32_t el[65];
    for (int i = 0; i < bs; i++) el[i] = accept[i];
    mla_batch b = {MLA_MODE_DRAFT_EXTEND, bs, ids, seq, el, NULL, 0};
    if (run_absorbed_step(d, be, "DRAFT_EXTEND varlen", &b, ns, slots)) goto done;
    /* Fixed window: ndt query rows per request, the last ndt positions. */
    ns = 0;
    for (int i = 0; i < bs; i++)
      for (int j = seq[i] - ndt; j < seq[i]; j++) slots[ns++] = r2t[(size_t)ids[i] * bd.max_context + j];
    mla_batch bw = {MLA_MODE_DRAFT_EXTEND, bs, ids, seq, NULL, NULL, ndt};
    if (run_absorbed_step(d, be, "DRAFT_EXTEND window=4", &bw, ns, slots)) goto done;
  }
  {
    mla_batch idle = {MLA_MODE_IDLE, 0, NULL, NULL, NULL, NULL, 0};
    double t0 = demo_now_ms();
    mla_status st = mla_backend_plan(be, &idle);
    mla_forward_args a;
    memset(&a, 0, sizeof a);
    if (st == MLA_OK) st = mla_backend_forward(be, &a);
    int ok = st == MLA_OK;
    if (!ok) d->failures++;
    fprintf(d->out, "%-26s %-28s %10s %10s %10s %9.3f  %s\n", "IDLE", "bs=0", "-", "-", "-", demo_now_ms() - t0,
            ok ? "ok" : "FAIL");
  }
  rc = 0;
done:
  free(slots);
  mla_backend_destroy(be);
  return rc;
}

/* EXTEND with a prefix through chunked MHA: prefix rows are gathered in
 * chunks, expanded to k/v with kv_b_proj, attended and merged by LSE. */
static int chunked_backend_steps(demo *d) {
  const demo_opts *o = d->o;
  mla_backend_desc bd = backend_desc(o, MLA_EXTEND_MHA_CHUNKED);
  mla_backend *be = NULL;
  TRY(d, mla_backend_create(d->ctx, &bd, &be), mla_ctx_last_error(d->ctx));
  mla_req_table *rt;
  mla_backend_req_table(be, &rt);
  int n = o->requests, H = o->heads, nope = 128, dv = 128, dqk = nope + R, rc = -1;
  int32_t ids[65], seq[65], prefix[65];
  int prompt[65] = {0}, ext[65] = {0};
  int32_t *slots = malloc((size_t)n * 64 * sizeof(int32_t));
  act w = {0}, nc = {0}, nr = {0}, q = {0}, k = {0}, v = {0};
  void *out = NULL;
  float *lse = NULL;
  for (int i = 0; i < n; i++) {
    if (mla_req_add(rt, &ids[i]) != MLA_OK) goto done;
    prompt[i] = demo_rng_int(&d->g, 1, o->max_prompt);
  }
  if (prefill(d, be, n, ids, prompt)) goto done;
  lengths(rt, n, ids, prefix);
  int T = 0, ns;
  for (int i = 0; i < n; i++) T += ext[i] = demo_rng_int(&d->g, 1, 40);
  if (extend_all(d, rt, n, ids, ext, slots, &ns)) goto done;
  lengths(rt, n, ids, seq);
  mla_batch b = {MLA_MODE_EXTEND, n, ids, seq, NULL, prefix, 0};
  TRY(d, mla_backend_plan(be, &b), mla_backend_last_error(be));
  /* kv_b_proj with entries ~ N(0, 1/512) keeps k and v near unit scale. */
  if (act_random(&w, (int64_t)H * (nope + dv) * L, o->act_dtype, &d->g, 1.0 / sqrt(512.0)) ||
      act_random(&nc, (int64_t)T * L, o->act_dtype, &d->g, 1.0) ||
      act_random(&nr, (int64_t)T * R, o->act_dtype, &d->g, 1.0) ||
      act_random(&q, (int64_t)T * H * dqk, o->act_dtype, &d->g, 1.0) ||
      act_random(&k, (int64_t)T * H * dqk, o->act_dtype, &d->g, 1.0) ||
      act_random(&v, (int64_t)T * H * dv, o->act_dtype, &d->g, 1.0))
    goto done;
  out = malloc((size_t)T * H * dv * mla_dtype_size(o->act_dtype));
  lse = malloc((size_t)T * H * sizeof(float));
  mla_forward_args a;
  memset(&a, 0, sizeof a);
  a.num_new = ns;
  a.new_slots = slots;
  a.new_c = nc.data;
  a.new_r = nr.data;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.kv_b_proj = w.data;
  a.out = out;
  a.lse = lse;
  double t0 = demo_now_ms();
  mla_status st = mla_backend_forward(be, &a);
  double ms = demo_now_ms() - t0;
  if (check_status(d, st, "chunked extend", mla_backend_last_error(be))) goto done;
  /* Oracle: keys = expanded prefix rows (in double) then the extend rows. */
  double *ro = malloc((size_t)T * H * dv * sizeof(double)), *rl = malloc((size_t)T * H * sizeof(double));
  int q0 = 0;
  for (int i = 0; i < n; i++) {
    int P = prefix[i], E = ext[i], K = P + E;
    double *c = malloc((size_t)(P ? P : 1) * L * sizeof(double)), *r = malloc((size_t)(P ? P : 1) * R * sizeof(double));
    double *kk = malloc((size_t)K * H * dqk * sizeof(double)), *vv = malloc((size_t)K * H * dv * sizeof(double));
    demo_read_request(be, 0, ids[i], P, c, r);
    demo_ref_expand(P, H, nope, dv, o->act_dtype, c, r, w.ref, kk, vv);
    memcpy(kk + (size_t)P * H * dqk, k.ref + (size_t)q0 * H * dqk, (size_t)E * H * dqk * sizeof(double));
    memcpy(vv + (size_t)P * H * dv, v.ref + (size_t)q0 * H * dv, (size_t)E * H * dv * sizeof(double));
    ref_mha(1, &E, &K, H, H, dqk, dv, 1.0 / sqrt(192.0), 0.0, 1, q.ref + (size_t)q0 * H * dqk, kk, vv,
            ro + (size_t)q0 * H * dv, rl + (size_t)q0 * H);
    q0 += E;
    free(c);
    free(r);
    free(kk);
    free(vv);
  }
  char shape[64];
  snprintf(shape, sizeof shape, "bs=%d q=%d prefix~%d H=%d", n, T, prefix[0], H);
  report(d, "EXTEND+prefix (chunked)", shape, out, o->act_dtype, ro, (int64_t)T * H * dv, lse, rl, (int64_t)T * H,
         demo_lse_atol_expanded(o->act_dtype), ms);
  free(ro);
  free(rl);
  rc = 0;
done:
  free(slots);
  free(out);
  free(lse);
  act_free(&w);
  act_free(&nc);
  act_free(&nr);
  act_free(&q);
  act_free(&k);
  act_free(&v);
  mla_backend_destroy(be);
  return rc;
}

void demo_default_opts(demo_opts *o) {
  memset(o, 0, sizeof *o);
  o->cache_dtype = MLA_DTYPE_BF16;
  o->act_dtype = MLA_DTYPE_BF16;
  o->page_size = 64;
  o->threads = 0;
  o->seed = 1;
  /* heads, requests, max_prompt: 0 = each part's own default. */
  o->sim = 1;
  o->layers = 3;
  o->steps = 32;
  o->hidden = 512;
  o->max_batch = 8;
  o->draft_tokens = 4;
  o->check_every = 4;
  o->prefix_impl = MLA_EXTEND_ABSORBED;
  o->spec = 0;
  o->spec_steps = 3;
}

int demo_run(const demo_opts *opts, FILE *out) {
  /* The table is one batch per mode, checked against the full float64
   * oracle: it keeps its small defaults, and at most 64 requests. */
  demo_opts t = *opts;
  if (!t.heads) t.heads = 16;
  if (!t.requests) t.requests = 4;
  if (t.requests > 64) t.requests = 64;
  if (!t.max_prompt) t.max_prompt = 300;
  const demo_opts *o = &t;
  demo d;
  memset(&d, 0, sizeof d);
  d.o = o;
  d.out = out;
  d.g.s = o->seed;
  mla_ctx_desc cd = {MLA_DEVICE_CPU, o->threads, 0};
  mla_status st = mla_ctx_create(&cd, &d.ctx);
  if (st != MLA_OK) {
    fprintf(out, "error: mla_ctx_create: %s\n", mla_status_string(st));
    return -1;
  }
  int threads = 0;
  mla_ctx_get_threads(d.ctx, &threads);
  fprintf(out, "libmla %s demo on the CPU (%d threads): cache %s, activations %s, page size %d, %d heads, seed %llu\n",
          mla_version_string(), threads, mla_dtype_name(o->cache_dtype), mla_dtype_name(o->act_dtype), o->page_size,
          o->heads, (unsigned long long)o->seed);
  fprintf(out, "%-26s %-28s %10s %10s %10s %9s  %s\n", "mode", "shape", "max|err|", "cos dist", "lse err", "time ms",
          "check");
  int rc = absorbed_backend_steps(&d);
  if (rc == 0) rc = chunked_backend_steps(&d);
  mla_ctx_destroy(d.ctx);
  if (rc != 0) return -1;
  fprintf(out, "%s: %d check(s) failed\n", d.failures ? "FAILED" : "all modes match the float64 oracle",
          d.failures);
  return d.failures;
}
