/* The backend on a CUDA context against the same backend on a CPU context:
 * identical descriptors and request-table operations, then per step the
 * same inputs: EXTEND without prefix (ragged MHA), EXTEND over a cached
 * prefix through chunked MHA (gather, cuBLAS expansion, ragged per chunk,
 * merge; a small chunk capacity forces several chunks), DECODE and
 * TARGET_VERIFY (device-built steps), over 2 layers with KV writes.
 * With the absorbed impl, EXTEND over the prefix runs the paged absorbed
 * prefill instead, and both flows end with a varlen DRAFT_EXTEND (host plans
 * on the GPU). Outputs agree within bf16 tolerance (per element |gpu - cpu|
 * <= 0.02 + 0.02 |cpu|, cosine distance < 1e-4) and LSEs within 2e-3. Every
 * absorbed step's last layer is also captured in a CUDA graph on the GPU
 * backend: the capture holds kernel nodes only (the host plans are uploaded
 * once by mla_backend_plan, not per layer) and its replay writes what the
 * eager call wrote, bit for bit. Skips without CUDA or a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_backend: skipped: built without CUDA\n");
  return tu_finish("test_cuda_backend");
}
#else
#include "cuda_util.h"

#define H 8
#define NOPE 128
#define DV 128
#define LAYERS 2
#define BS 4
static tu_rng rng;

typedef struct pair {
  mla_ctx *cc, *gc;
  mla_backend *cb, *gb;
  mla_req_table *crt, *grt;
  uint16_t *w;  /* kv_b_proj bf16 [H, NOPE + DV, 512] (host) */
  void *dw;     /* its device copy */
} pair;

static mla_backend_desc desc_of(mla_extend_impl impl) {
  mla_backend_desc d;
  memset(&d, 0, sizeof d);
  d.cache.num_layers = LAYERS;
  d.cache.num_pages = 200;
  d.cache.page_size = 16;
  d.cache.dtype = MLA_DTYPE_BF16;
  d.max_reqs = 8;
  d.max_context = 700;
  d.max_bs = BS;
  d.max_q_tokens = 1200;
  d.num_heads = H;
  d.scale = 0.0721687836f;
  d.act_dtype = MLA_DTYPE_BF16;
  d.qk_nope_dim = NOPE;
  d.v_dim = DV;
  d.extend_impl = impl;
  d.chunk_capacity = 256;
  d.num_sm = 16;
  return d;
}

static void rand_bf16(uint16_t *dst, int64_t n, double sigma) {
  float *f = malloc(sizeof(float) * (size_t)n);
  tu_fill_bf16_normal(&rng, f, n, sigma);
  tu_to_dtype(MLA_DTYPE_BF16, f, dst, n);
  free(f);
}

/* The GPU backend's forward of a (already written) layer again, captured on
 * a non-blocking stream with no new rows: kernels only, and the replay
 * equals the eager output oe [no] / lse le [nl] bit for bit. */
static void capture_forward(pair *p, mla_forward_args a, const uint16_t *oe, int64_t no, const float *le, int64_t nl,
                            const char *what) {
  CK(cudaDeviceSynchronize());
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TU_STATUS(mla_ctx_set_stream(p->gc, s), MLA_OK);
  a.num_new = 0;
  a.new_slots = NULL;
  a.new_c = a.new_r = NULL;
  cudaGraph_t graph = NULL;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const mla_status st = mla_backend_forward(p->gb, &a);
  const cudaError_t ce = cudaStreamEndCapture(s, &graph);
  TU_CHECK(st == MLA_OK && ce == cudaSuccess, "%s: forward under stream capture: %s (%s)", what,
           cudaGetErrorString(ce), st == MLA_OK ? "ok" : mla_backend_last_error(p->gb));
  if (st == MLA_OK && ce == cudaSuccess) {
    int kernels = 0, others = 0;
    tu_count_graph_nodes(graph, &kernels, &others);
    TU_CHECK(kernels >= 1 && others == 0, "%s: captured forward has %d kernel and %d other nodes (want kernels only)",
             what, kernels, others);
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaMemset(a.out, 0xFF, 2 * (size_t)no));
    CK(cudaMemset(a.lse, 0xFF, sizeof(float) * (size_t)nl));
    CK(cudaDeviceSynchronize());
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    uint16_t *og = malloc(2 * (size_t)no);
    float *lg = malloc(sizeof(float) * (size_t)nl);
    CK(cudaMemcpy(og, a.out, 2 * (size_t)no, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lg, a.lse, sizeof(float) * (size_t)nl, cudaMemcpyDeviceToHost));
    TU_CHECK(memcmp(og, oe, 2 * (size_t)no) == 0 && memcmp(lg, le, sizeof(float) * (size_t)nl) == 0,
             "%s: graph replay differs from the eager forward", what);
    free(og);
    free(lg);
    CK(cudaGraphExecDestroy(exec));
  }
  if (graph) CK(cudaGraphDestroy(graph));
  cudaGetLastError(); /* a failed capture leaves its error behind */
  TU_STATUS(mla_ctx_set_stream(p->gc, NULL), MLA_OK);
  CK(cudaStreamDestroy(s));
}

/* One forward step on both backends with the same host inputs; compares the
 * last layer's outputs. mha: q/k/v inputs, else q_nope/q_rope. */
static void step_both(pair *p, const mla_batch *b, int T, int num_new, const int32_t *slots, int mha,
                      const char *what) {
  TU_STATUS(mla_backend_plan(p->cb, b), MLA_OK);
  mla_status gst = mla_backend_plan(p->gb, b);
  TU_CHECK(gst == MLA_OK, "%s: CUDA plan: %s", what, mla_backend_last_error(p->gb));
  if (gst != MLA_OK) return;
  const int dqk = NOPE + MLA_ROPE, dout = mha ? DV : MLA_LATENT;
  const int64_t nq = (int64_t)T * H * (mha ? dqk : MLA_LATENT), nr = (int64_t)T * H * MLA_ROPE;
  const int64_t nk = (int64_t)T * H * dqk, nv = (int64_t)T * H * DV, no = (int64_t)T * H * dout;
  uint16_t *q = malloc(2 * nq), *qr = malloc(2 * nr), *k = malloc(2 * nk), *v = malloc(2 * nv);
  uint16_t *c = malloc(2 * (size_t)num_new * MLA_LATENT + 2), *r = malloc(2 * (size_t)num_new * MLA_ROPE + 2);
  uint16_t *oc = malloc(2 * no), *og = malloc(2 * no);
  float *lc = malloc(4 * (size_t)T * H), *lg = malloc(4 * (size_t)T * H);
  void *dq = tu_dev_alloc(2 * nq), *dqr = tu_dev_alloc(2 * nr), *dk = tu_dev_alloc(2 * nk), *dv = tu_dev_alloc(2 * nv);
  void *dc = tu_dev_alloc(2 * (size_t)num_new * MLA_LATENT), *dr = tu_dev_alloc(2 * (size_t)num_new * MLA_ROPE);
  void *dout_ = tu_dev_alloc(2 * no);
  float *dl = tu_dev_alloc(4 * (size_t)T * H);
  int32_t *ds = tu_dev_alloc(4 * (size_t)(num_new + 1));
  if (num_new) CK(cudaMemcpy(ds, slots, 4 * (size_t)num_new, cudaMemcpyHostToDevice));
  double dot = 0, n1 = 0, n2 = 0, worst = 0, lworst = 0;
  int far = 0;
  mla_forward_args last; /* the GPU call of the last layer */
  memset(&last, 0, sizeof last);
  for (int layer = 0; layer < LAYERS; layer++) {
    rand_bf16(q, nq, 1.0);
    rand_bf16(qr, nr, 1.0);
    rand_bf16(k, nk, 1.0);
    rand_bf16(v, nv, 1.0);
    rand_bf16(c, (int64_t)num_new * MLA_LATENT, 1.0);
    rand_bf16(r, (int64_t)num_new * MLA_ROPE, 1.0);
    CK(cudaMemcpy(dq, q, 2 * nq, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dqr, qr, 2 * nr, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k, 2 * nk, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, v, 2 * nv, cudaMemcpyHostToDevice));
    if (num_new) {
      CK(cudaMemcpy(dc, c, 2 * (size_t)num_new * MLA_LATENT, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dr, r, 2 * (size_t)num_new * MLA_ROPE, cudaMemcpyHostToDevice));
    }
    mla_forward_args a;
    memset(&a, 0, sizeof a);
    a.layer = layer;
    a.num_new = num_new;
    a.new_slots = slots;
    a.new_c = c;
    a.new_r = r;
    if (mha) {
      a.q = q;
      a.k = k;
      a.v = v;
      a.kv_b_proj = p->w;
    } else {
      a.q_nope = q;
      a.q_rope = qr;
    }
    a.out = oc;
    a.lse = lc;
    TU_STATUS(mla_backend_forward(p->cb, &a), MLA_OK);
    a.new_slots = ds;
    a.new_c = dc;
    a.new_r = dr;
    if (mha) {
      a.q = dq;
      a.k = dk;
      a.v = dv;
      a.kv_b_proj = p->dw;
    } else {
      a.q_nope = dq;
      a.q_rope = dqr;
    }
    a.out = dout_;
    a.lse = dl;
    last = a;
    mla_status st = mla_backend_forward(p->gb, &a);
    TU_CHECK(st == MLA_OK, "%s: CUDA forward: %s", what, mla_backend_last_error(p->gb));
    TU_STATUS(mla_ctx_synchronize(p->gc), MLA_OK);
    CK(cudaMemcpy(og, dout_, 2 * no, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lg, dl, 4 * (size_t)T * H, cudaMemcpyDeviceToHost));
    double *x = malloc(sizeof(double) * (size_t)no), *y = malloc(sizeof(double) * (size_t)no);
    tu_from_dtype(MLA_DTYPE_BF16, oc, x, no);
    tu_from_dtype(MLA_DTYPE_BF16, og, y, no);
    for (int64_t i = 0; i < no; i++) {
      dot += x[i] * y[i];
      n1 += x[i] * x[i];
      n2 += y[i] * y[i];
      const double e = fabs(x[i] - y[i]);
      if (!(e <= 0.02 + 0.02 * fabs(x[i]))) far++;
      if (e > worst) worst = e;
    }
    for (int64_t i = 0; i < (int64_t)T * H; i++) {
      const double e = (isinf(lc[i]) && isinf(lg[i])) ? 0 : fabs((double)lc[i] - lg[i]);
      if (!(e <= lworst)) lworst = e;
    }
    free(x);
    free(y);
  }
  const double cosd = 1.0 - dot / sqrt(n1 * n2);
  TU_CHECK(far == 0 && cosd < 1e-4 && lworst < 2e-3,
           "%s: GPU vs CPU backend: %d far elements (worst %.3g), cosine distance %.3g, lse err %.3g", what, far,
           worst, cosd, lworst);
  if (!mha) capture_forward(p, last, og, no, lg, (int64_t)T * H, what);
  free(q);
  free(qr);
  free(k);
  free(v);
  free(c);
  free(r);
  free(oc);
  free(og);
  free(lc);
  free(lg);
  cudaFree(dq);
  cudaFree(dqr);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dc);
  cudaFree(dr);
  cudaFree(dout_);
  cudaFree(dl);
  cudaFree(ds);
}

/* extend both tables identically; slots must agree */
static int extend_both(pair *p, int32_t id, int n, int32_t *slots) {
  int32_t *s2 = malloc(sizeof(int32_t) * (size_t)(n + 1));
  int ok = mla_req_extend(p->crt, id, n, slots) == MLA_OK && mla_req_extend(p->grt, id, n, s2) == MLA_OK &&
           memcmp(slots, s2, sizeof(int32_t) * (size_t)n) == 0;
  free(s2);
  return ok;
}

static void flow(mla_extend_impl impl) {
  pair p;
  memset(&p, 0, sizeof p);
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0}, gd = {MLA_DEVICE_CUDA, 0, 0};
  TU_STATUS(mla_ctx_create(&cd, &p.cc), MLA_OK);
  TU_STATUS(mla_ctx_create(&gd, &p.gc), MLA_OK);
  mla_backend_desc d = desc_of(impl);
  TU_STATUS(mla_backend_create(p.cc, &d, &p.cb), MLA_OK);
  mla_status st = mla_backend_create(p.gc, &d, &p.gb);
  TU_CHECK(st == MLA_OK, "CUDA backend create: %s", mla_ctx_last_error(p.gc));
  if (!p.cb || !p.gb) return;
  mla_backend_req_table(p.cb, &p.crt);
  mla_backend_req_table(p.gb, &p.grt);
  const int64_t nw = (int64_t)H * (NOPE + DV) * MLA_LATENT;
  p.w = malloc(2 * nw);
  rand_bf16(p.w, nw, 0.05);
  p.dw = tu_dev_copy(p.w, 2 * nw);

  /* EXTEND without prefix: prompts */
  int32_t ids[BS], seq[BS], pre[BS], ext[BS];
  int32_t *slots = malloc(sizeof(int32_t) * 2000);
  int T = 0, ok = 1;
  for (int i = 0; i < BS; i++) {
    int32_t a = -1, b = -1;
    ok &= mla_req_add(p.crt, &a) == MLA_OK && mla_req_add(p.grt, &b) == MLA_OK && a == b;
    ids[i] = a;
    ext[i] = tu_randint(&rng, 20, 200);
    ok &= extend_both(&p, a, ext[i], slots + T);
    seq[i] = ext[i];
    T += ext[i];
  }
  TU_CHECK(ok, "table setup");
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = MLA_MODE_EXTEND;
  b.batch_size = BS;
  b.req_ids = ids;
  b.seq_lens = seq;
  step_both(&p, &b, T, T, slots, 1, impl == MLA_EXTEND_MHA_CHUNKED ? "extend (chunked backend)" : "extend");

  /* EXTEND over the cached prefix: a second chunk of every prompt */
  T = 0;
  for (int i = 0; i < BS; i++) {
    pre[i] = seq[i];
    ext[i] = tu_randint(&rng, 10, 120);
    ok &= extend_both(&p, ids[i], ext[i], slots + T);
    seq[i] += ext[i];
    T += ext[i];
  }
  b.prefix_lens = pre;
  if (impl == MLA_EXTEND_MHA_CHUNKED)
    step_both(&p, &b, T, T, slots, 1, "extend over a prefix (chunked MHA)");
  else
    step_both(&p, &b, T, T, slots, 0, "extend over a prefix (absorbed: paged prefill)");
  b.prefix_lens = NULL;

  /* DECODE, then TARGET_VERIFY (ndt 3) over what is cached */
  for (int i = 0; i < BS; i++) {
    ok &= extend_both(&p, ids[i], 1, slots + i);
    seq[i] += 1;
  }
  b.mode = MLA_MODE_DECODE;
  step_both(&p, &b, BS, BS, slots, 0, "decode");
  for (int i = 0; i < BS; i++) ok &= extend_both(&p, ids[i], 3, slots + 3 * i);
  b.mode = MLA_MODE_TARGET_VERIFY;
  b.num_draft_tokens = 3;
  step_both(&p, &b, 3 * BS, 3 * BS, slots, 0, "target verify");
  /* DRAFT_EXTEND, varlen (accepted + 1 tokens per request): a host plan on
   * the GPU too, like the paged prefill */
  T = 0;
  for (int i = 0; i < BS; i++) {
    ext[i] = tu_randint(&rng, 1, 4);
    ok &= extend_both(&p, ids[i], ext[i], slots + T);
    seq[i] += ext[i];
    T += ext[i];
  }
  b.mode = MLA_MODE_DRAFT_EXTEND;
  b.num_draft_tokens = 0;
  b.extend_lens = ext;
  step_both(&p, &b, T, T, slots, 0, "draft extend (varlen)");
  b.extend_lens = NULL;
  TU_CHECK(ok, "table operations agree");
  free(slots);
  free(p.w);
  cudaFree(p.dw);
  mla_backend_destroy(p.cb);
  mla_backend_destroy(p.gb);
  mla_ctx_destroy(p.cc);
  mla_ctx_destroy(p.gc);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_cuda_backend: skipped: no GPU\n");
    return tu_finish("test_cuda_backend");
  }
  rng.s = tu_seed("test_cuda_backend", 20261130);
  flow(MLA_EXTEND_MHA_CHUNKED);
  flow(MLA_EXTEND_ABSORBED);
  return tu_finish("test_cuda_backend");
}
#endif
