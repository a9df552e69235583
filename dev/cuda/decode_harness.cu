// Harness of the decode kernel ladder (llm.c style: one harness, numbered
// kernel versions picked with a switch).
//
//   decode_harness unit                     descriptor / TMA unit tests
//   decode_harness check  -v N [--tiny] [--seed S]   correctness grid vs float64
//   decode_harness bench  -v 1,2,... [--quick] [--runs R] [--b B] [--h H] [--sq S] [--sk K]   timing table
//   decode_harness copybw                   device copy bandwidth
//
// Every check case: random paged bf16 cache with a shuffled block table, NaN
// in every row no request may read, 2147480000 in unused table entries,
// random q, kv lengths including 0 and short ones, the library's host split
// schedule (src/plan/split_schedule.c, num_sm 132), outputs poisoned before
// each run, compared with a float64 reference (out: abs 8e-4 + rel 2/128 vs
// the bf16-rounded reference, widened by the bf16 rounding bound of P,
// 2^-8 sum_j w_j |c_j| (the count under the bare DESIGN tolerance is printed
// too), and cosine distance < 5e-6; lse: 1e-5 relative (of max(1, |lse|));
// -inf positions exact).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "common.cuh"
#include "tmap.h"

extern "C" {
#include "../../tests/ref/ref.h"
int mla_sched_num_parts(int num_sm, int max_q_len, int num_heads);
int mla_split_schedule(const int32_t *kv_lens, int bs, int num_parts, int nocut_div, int32_t *sched_meta,
                       int32_t *num_splits);
}
int run_desc_tests(FILE *out);

static const int kNumSm = 132;
static const int32_t kPad = 2147480000;


static cudaError_t launch_version(int v, const mla_decode_params *p, cudaStream_t s) {
  switch (v) {
    case 1: return decode_v1_launch(p, s);
    case 2: return decode_v2_launch(p, s);
    case 3: return decode_v3_launch(p, s);
    case 4: return decode_v4_launch(p, s);
    case 5: return decode_v5_launch(p, s);
    case 6: return decode_v6_launch(p, s);
    case 7: return decode_v7_launch(p, s);
    case 8: return decode_v8_launch(p, s);
    case 9: return decode_v9_launch(p, s);
    case 10: return decode_v10_launch(p, s);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------
// host bf16 and RNG
// ---------------------------------------------------------------------------
static inline float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (uint32_t)(s >> 11);
  }
  float uni() { return (next() & 0xffffff) / 16777216.f; }  // [0,1)
  int range(int lo, int hi) { return lo + (int)(next() % (uint32_t)(hi - lo + 1)); }
};

// ---------------------------------------------------------------------------
// one test problem
// ---------------------------------------------------------------------------
struct Case {
  std::string name;
  int b, max_q, H, P, causal, lse_base2, want_lse;
  float scale;
  std::vector<int> qlen, klen;
};

struct HostData {
  std::vector<int32_t> qo, klen, bt, meta, splits;
  int width, num_pages, parts, total_splits, Tq;
  std::vector<uint16_t> cache, q;  // [num_pages*P, 576], [Tq, H, 576]
};

struct DevData {
  uint16_t *cache = nullptr, *q = nullptr, *out = nullptr;
  int32_t *qo = nullptr, *klen = nullptr, *bt = nullptr, *meta = nullptr, *splits = nullptr;
  float *lse = nullptr, *oacc = nullptr, *lacc = nullptr;
  size_t out_elems = 0, lse_elems = 0, oacc_elems = 0, lacc_elems = 0;
};

static void build_schedule(const Case &c, HostData &h) {
  h.parts = mla_sched_num_parts(kNumSm, c.max_q, c.H);
  h.meta.assign((size_t)h.parts * SCHED_INTS, 0);
  h.splits.assign(c.b + 1, 0);
  if (mla_split_schedule(h.klen.data(), c.b, h.parts, 0, h.meta.data(), h.splits.data()) != 0) {
    fprintf(stderr, "split schedule failed\n");
    exit(2);
  }
  h.total_splits = h.splits[c.b];
}

static void make_host(const Case &c, uint64_t seed, HostData &h) {
  Rng rng(seed);
  h.qo.assign(c.b + 1, 0);
  for (int i = 0; i < c.b; i++) h.qo[i + 1] = h.qo[i] + c.qlen[i];
  h.Tq = h.qo[c.b];
  h.klen = c.klen;
  h.width = 1;
  int used = 0;
  for (int i = 0; i < c.b; i++) {
    const int np = (c.klen[i] + c.P - 1) / c.P;
    h.width = std::max(h.width, np);
    used += np;
  }
  h.num_pages = used + 3 + used / 8;
  std::vector<int> perm(h.num_pages);
  for (int i = 0; i < h.num_pages; i++) perm[i] = i;
  for (int i = h.num_pages - 1; i > 0; i--) std::swap(perm[i], perm[rng.next() % (uint32_t)(i + 1)]);
  h.bt.assign((size_t)c.b * h.width, kPad);
  const uint16_t nan = 0x7fc1;
  h.cache.assign((size_t)h.num_pages * c.P * 576, nan);
  int k = 0;
  for (int i = 0; i < c.b; i++) {
    const int np = (c.klen[i] + c.P - 1) / c.P;
    for (int j = 0; j < np; j++) h.bt[(size_t)i * h.width + j] = perm[k++];
    for (int t = 0; t < c.klen[i]; t++) {
      const size_t row = (size_t)h.bt[(size_t)i * h.width + t / c.P] * c.P + t % c.P;
      for (int d = 0; d < 576; d++) h.cache[row * 576 + d] = f2bf(2.f * rng.uni() - 1.f);
    }
  }
  h.q.resize((size_t)h.Tq * c.H * 576);
  for (auto &v : h.q) v = f2bf(2.f * rng.uni() - 1.f);
  build_schedule(c, h);
}

template <class T>
static void dmalloc_copy(T **d, const std::vector<T> &h) {
  CK(cudaMalloc(d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(*d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

static void upload(const Case &c, const HostData &h, DevData &d) {
  dmalloc_copy(&d.cache, h.cache);
  dmalloc_copy(&d.q, h.q);
  dmalloc_copy(&d.qo, h.qo);
  dmalloc_copy(&d.klen, h.klen);
  dmalloc_copy(&d.bt, h.bt);
  dmalloc_copy(&d.meta, h.meta);
  dmalloc_copy(&d.splits, h.splits);
  d.out_elems = (size_t)h.Tq * c.H * 512;
  d.lse_elems = (size_t)h.Tq * c.H;
  d.oacc_elems = (size_t)std::max(h.total_splits, 1) * c.max_q * c.H * 512;
  d.lacc_elems = (size_t)std::max(h.total_splits, 1) * c.max_q * c.H;
  CK(cudaMalloc(&d.out, std::max<size_t>(d.out_elems, 1) * 2));
  CK(cudaMalloc(&d.lse, std::max<size_t>(d.lse_elems, 1) * 4));
  CK(cudaMalloc(&d.oacc, d.oacc_elems * 4));
  CK(cudaMalloc(&d.lacc, d.lacc_elems * 4));
}

static void free_dev(DevData &d) {
  cudaFree(d.cache);
  cudaFree(d.q);
  cudaFree(d.qo);
  cudaFree(d.klen);
  cudaFree(d.bt);
  cudaFree(d.meta);
  cudaFree(d.splits);
  cudaFree(d.out);
  cudaFree(d.lse);
  cudaFree(d.oacc);
  cudaFree(d.lacc);
  d = DevData();
}

static mla_decode_params make_params(const Case &c, const HostData &h, const DevData &d) {
  mla_decode_params p;
  memset(&p, 0, sizeof(p));
  p.batch_size = c.b;
  p.num_heads = c.H;
  p.max_q_len = c.max_q;
  p.causal = c.causal;
  p.page_size = c.P;
  p.block_table_width = h.width;
  p.num_pages = h.num_pages;
  p.scale = c.scale;
  p.lse_base2 = c.lse_base2;
  p.q_nope = d.q;
  p.q_rope = d.q + 512;
  p.q_nope_stride_token = p.q_rope_stride_token = (int64_t)c.H * 576;
  p.q_nope_stride_head = p.q_rope_stride_head = 576;
  p.kv = d.cache;
  p.row_bytes = 1152;
  p.kv_dtype = 0;
  p.qo_indptr = d.qo;
  p.kv_lens = d.klen;
  p.block_table = d.bt;
  p.num_sm_parts = h.parts;
  p.sched_meta = d.meta;
  p.num_splits = d.splits;
  p.out = d.out;
  p.lse = c.want_lse ? d.lse : nullptr;
  p.o_accum = d.oacc;
  p.lse_accum = d.lacc;
  return p;
}

static void poison(const DevData &d) {
  CK(cudaMemset(d.out, 0xff, std::max<size_t>(d.out_elems, 1) * 2));
  CK(cudaMemset(d.lse, 0xff, std::max<size_t>(d.lse_elems, 1) * 4));
  CK(cudaMemset(d.oacc, 0xff, d.oacc_elems * 4));
  CK(cudaMemset(d.lacc, 0xff, d.lacc_elems * 4));
}

// ---------------------------------------------------------------------------
// float64 reference (own, threaded), cross-checked once against ref_absorbed
// ---------------------------------------------------------------------------
// o, lse, and wabs = sum_j w_j |c_j| per output element (w = softmax weights):
// a kernel that rounds P to bf16 (unit roundoff 2^-8) before P V can be off
// by up to 2^-8 * wabs, whatever else it does right.
static void reference(const Case &c, const HostData &h, std::vector<double> &o, std::vector<double> &lse,
                      std::vector<double> &wabs) {
  const int H = c.H;
  o.assign((size_t)h.Tq * H * 512, 0.0);
  wabs.assign((size_t)h.Tq * H * 512, 0.0);
  lse.assign((size_t)h.Tq * H, -INFINITY);
  std::vector<float> cf(h.cache.size());
  for (size_t i = 0; i < cf.size(); i++) cf[i] = bf2f(h.cache[i]);
  std::vector<int> row_req(h.Tq);
  for (int i = 0; i < c.b; i++)
    for (int t = h.qo[i]; t < h.qo[i + 1]; t++) row_req[t] = i;
  const int units = h.Tq * H;
  unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> th;
  for (unsigned w = 0; w < nt; w++)
    th.emplace_back([&, w]() {
      std::vector<double> s, q(576), acc(512), aab(512);
      for (int u = (int)w; u < units; u += (int)nt) {
        const int tok = u / H, i = row_req[tok];
        const int Q = h.qo[i + 1] - h.qo[i], K = h.klen[i], t = tok - h.qo[i];
        int lim = c.causal ? K - Q + t + 1 : K;
        lim = std::max(0, std::min(K, lim));
        if (lim == 0) continue;
        for (int d = 0; d < 576; d++) q[d] = bf2f(h.q[(size_t)u * 576 + d]);
        s.resize(lim);
        double mx = -INFINITY;
        for (int j = 0; j < lim; j++) {
          const float *kr = &cf[((size_t)h.bt[(size_t)i * h.width + j / c.P] * c.P + j % c.P) * 576];
          double a = 0;
          for (int d = 0; d < 576; d++) a += q[d] * (double)kr[d];
          s[j] = a * (double)c.scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        std::fill(aab.begin(), aab.end(), 0.0);
        for (int j = 0; j < lim; j++) {
          const double e = exp(s[j] - mx);
          sum += e;
          const float *kr = &cf[((size_t)h.bt[(size_t)i * h.width + j / c.P] * c.P + j % c.P) * 576];
          for (int d = 0; d < 512; d++) {
            acc[d] += e * kr[d];
            aab[d] += e * fabs((double)kr[d]);
          }
        }
        for (int d = 0; d < 512; d++) {
          o[(size_t)u * 512 + d] = acc[d] / sum;
          wabs[(size_t)u * 512 + d] = aab[d] / sum;
        }
        lse[u] = mx + log(sum);
      }
    });
  for (auto &x : th) x.join();
}

// The project oracle on the same inputs (gathered into ragged arrays).
static double oracle_diff(const Case &c, const HostData &h, const std::vector<double> &o,
                          const std::vector<double> &lse) {
  const int H = c.H;
  int Tk = 0;
  for (int i = 0; i < c.b; i++) Tk += h.klen[i];
  std::vector<double> qn((size_t)h.Tq * H * 512), qr((size_t)h.Tq * H * 64), cc((size_t)Tk * 512 + 1),
      rr((size_t)Tk * 64 + 1), oo((size_t)h.Tq * H * 512), ll((size_t)h.Tq * H);
  for (size_t u = 0; u < (size_t)h.Tq * H; u++) {
    for (int d = 0; d < 512; d++) qn[u * 512 + d] = bf2f(h.q[u * 576 + d]);
    for (int d = 0; d < 64; d++) qr[u * 64 + d] = bf2f(h.q[u * 576 + 512 + d]);
  }
  int k = 0;
  for (int i = 0; i < c.b; i++)
    for (int j = 0; j < h.klen[i]; j++, k++) {
      const size_t row = (size_t)h.bt[(size_t)i * h.width + j / c.P] * c.P + j % c.P;
      for (int d = 0; d < 512; d++) cc[(size_t)k * 512 + d] = bf2f(h.cache[row * 576 + d]);
      for (int d = 0; d < 64; d++) rr[(size_t)k * 64 + d] = bf2f(h.cache[row * 576 + 512 + d]);
    }
  ref_absorbed(c.b, c.qlen.data(), h.klen.data(), H, c.scale, c.causal, qn.data(), qr.data(), cc.data(),
               rr.data(), oo.data(), ll.data());
  double md = 0;
  for (size_t i = 0; i < oo.size(); i++) md = std::max(md, fabs(oo[i] - o[i]));
  for (size_t i = 0; i < ll.size(); i++) {
    if (std::isinf(ll[i]) || std::isinf(lse[i])) {
      if (ll[i] != lse[i]) md = INFINITY;
    } else {
      md = std::max(md, fabs(ll[i] - lse[i]));
    }
  }
  return md;
}

// ---------------------------------------------------------------------------
// correctness grid
// ---------------------------------------------------------------------------
static Case make_case(const char *tag, Rng &rng, int b, int max_q, int H, int P, bool varlen_q, int max_k) {
  Case c;
  char nm[128];
  snprintf(nm, sizeof nm, "%s b=%d sq=%d%s H=%d P=%d", tag, b, max_q, varlen_q ? "v" : "", H, P);
  c.name = nm;
  c.b = b;
  c.max_q = max_q;
  c.H = H;
  c.P = P;
  c.causal = 1;
  c.lse_base2 = (int)(rng.next() & 1);
  c.want_lse = (rng.next() % 5) != 0;
  c.scale = (rng.next() & 3) == 0 ? 0.3f : 0.0722f;  // sometimes peaky softmax
  for (int i = 0; i < b; i++) {
    c.qlen.push_back(varlen_q ? rng.range(1, max_q) : max_q);
    int k;
    switch (i % 6) {
      case 0: k = 0; break;                      // empty request
      case 1: k = rng.range(1, 9); break;        // shorter than the queries at times
      case 2: k = rng.range(60, 70); break;      // around one tile
      case 3: k = rng.range(100, max_k); break;
      case 4: k = max_k - rng.range(0, 63); break;
      default: k = rng.range(1, max_k); break;
    }
    c.klen.push_back(k);
  }
  std::swap(c.klen[0], c.klen[b - 1]);  // the empty request is not always first
  return c;
}

static std::vector<Case> check_grid(uint64_t seed, bool tiny) {
  Rng rng(seed);
  std::vector<Case> g;
  if (tiny) {
    g.push_back(make_case("tiny", rng, 4, 1, 16, 64, false, 300));
    g.push_back(make_case("tiny", rng, 4, 2, 128, 1, false, 200));
    g.push_back(make_case("tiny", rng, 3, 4, 3, 16, true, 150));
    return g;
  }
  const int Hs[] = {1, 3, 16, 64, 128};
  const int Ps[] = {1, 64, 16, 128, 4};
  for (int P : Ps)
    for (int H : Hs)
      for (int sq : {1, 2, 4}) {
        if ((P == 16 || P == 128 || P == 4) && !(sq == 2 || H == 128 || H == 3)) continue;  // lighter grid off the main page sizes
        const int max_k = H >= 64 ? 700 : 2500;
        const int b = rng.range(6, 12);
        g.push_back(make_case("grid", rng, b, sq, H, P, sq > 1 && (rng.next() & 1), max_k));
      }
  // Large batches: most requests in one piece (written directly, no combine).
  g.push_back(make_case("batch", rng, 64, 1, 16, 64, false, 400));
  g.push_back(make_case("batch", rng, 128, 1, 128, 64, false, 200));
  g.push_back(make_case("batch", rng, 48, 2, 64, 1, false, 300));
  return g;
}

static int check_version(int v, const Case &c, const HostData &h, const std::vector<double> &ro,
                         const std::vector<double> &rl, const std::vector<double> &rw) {
  DevData d;
  upload(c, h, d);
  mla_decode_params p = make_params(c, h, d);
  poison(d);
  cudaError_t e = launch_version(v, &p, 0);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("CHECK v%d %-32s FAIL launch: %s\n", v, c.name.c_str(), cudaGetErrorString(e));
    fflush(stdout);
    exit(3);  // the context is gone
  }
  std::vector<uint16_t> out(d.out_elems);
  std::vector<float> lse(d.lse_elems);
  CK(cudaMemcpy(out.data(), d.out, out.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse.data(), d.lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  free_dev(d);
  std::vector<double> got(out.size()), ref(out.size());
  for (size_t i = 0; i < out.size(); i++) {
    got[i] = bf2f(out[i]);
    ref[i] = bf2f(f2bf((float)ro[i]));
  }
  // DESIGN §7 tolerance (reported), and the same plus the bf16-P rounding
  // bound 2^-8 * sum_j w_j |c_j| (decides, with the cosine and every other check).
  ref_cmp oc = ref_compare(got.data(), ref.data(), (int64_t)got.size(), 8e-4, 2.0 / 128);
  int64_t pbad = 0, pfirst = -1;
  for (size_t i = 0; i < got.size(); i++) {
    const double tol = 8e-4 + 2.0 / 128 * fabs(ref[i]) + rw[i] / 256.0;
    if (!(fabs(got[i] - ref[i]) <= tol)) {
      if (pfirst < 0) pfirst = (int64_t)i;
      pbad++;
    }
  }
  const bool out_ok = pbad == 0 && oc.nonfinite_mismatch == 0 && oc.cos_dist <= 5e-6;
  int64_t lbad = 0, linf = 0;
  double lmax = 0;
  if (c.want_lse)
    for (size_t i = 0; i < lse.size(); i++) {
      const double r = c.lse_base2 ? rl[i] * 1.4426950408889634 : rl[i];
      const double g = lse[i];
      if (std::isinf(r) || std::isinf(g) || std::isnan(g)) {
        if (!(std::isinf(r) && g == r)) linf++;
        continue;
      }
      const double err = fabs(g - r) / std::max(1.0, fabs(r));
      lmax = std::max(lmax, err);
      if (err > 1e-5) lbad++;
    }
  const bool ok = out_ok && lbad == 0 && linf == 0;
  printf("CHECK v%d %-32s splits=%-4d out: bad=%lld (design tol: %lld) nonfin=%lld maxabs=%.2e cos=%.1e | lse%s: bad=%lld inf=%lld maxrel=%.1e  %s\n",
         v, c.name.c_str(), h.total_splits, (long long)pbad, (long long)oc.bad, (long long)oc.nonfinite_mismatch, oc.max_abs_err,
         oc.cos_dist, c.want_lse ? (c.lse_base2 ? "2" : "e") : "-", (long long)lbad, (long long)linf, lmax,
         ok ? "PASS" : "FAIL");
  if (!ok && (pfirst >= 0 || oc.first_bad >= 0)) {
    const int64_t i = pfirst >= 0 ? pfirst : oc.first_bad;
    printf("   first bad out[%lld] (row %lld col %lld): got %.6f ref %.6f\n", (long long)i, (long long)(i / 512),
           (long long)(i % 512), got[i], ref[i]);
  }
  fflush(stdout);
  return ok ? 0 : 1;
}

static int cmd_check(const std::vector<int> &versions, uint64_t seed, bool tiny) {
  printf("check: seed %llu%s\n", (unsigned long long)seed, tiny ? " (tiny)" : "");
  if (run_desc_tests(stdout) != 0) printf("check: descriptor tests failed; wgmma versions will fail\n");
  std::vector<Case> grid = check_grid(seed, tiny);
  int fails = 0, n = 0;
  Rng rng(seed ^ 0xabcdef);
  for (size_t ci = 0; ci < grid.size(); ci++) {
    const Case &c = grid[ci];
    HostData h;
    make_host(c, rng.next(), h);
    std::vector<double> ro, rl, rw;
    reference(c, h, ro, rl, rw);
    if (ci == 0) {
      const double md = oracle_diff(c, h, ro, rl);
      printf("check: own reference vs tests/ref ref_absorbed on case 0: max diff %.2e %s\n", md,
             md < 1e-9 ? "(agree)" : "(DISAGREE)");
      if (!(md < 1e-9)) fails++;
    }
    for (int v : versions) {
      fails += check_version(v, c, h, ro, rl, rw);
      n++;
    }
  }
  printf("check: %d runs, %d failed\n", n, fails);
  return fails ? 1 : 0;
}

// ---------------------------------------------------------------------------
// benchmark
// ---------------------------------------------------------------------------
__global__ void fill_bf16(uint16_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    x *= 3266489917u;
    x ^= x >> 16;
    const float f = (x & 0xffffff) / 8388608.f - 1.f;
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    p[i] = *reinterpret_cast<uint16_t *>(&b);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static int g_only_h = 0, g_only_sq = 0, g_only_sk = 0;  // bench filters (0: all)
static int g_bench_b = 128;                             // bench batch size

static int cmd_bench(const std::vector<int> &versions, bool quick, int runs) {
  run_desc_tests(stdout);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("bench: %s, %d SMs, L2 %d MB; split schedule num_sm %d; kernel time = split + combine, L2 flushed "
         "(256 MB write) before each run, median of %d\n",
         prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, kNumSm, runs);
  const int b = g_bench_b, P = 64;
  std::vector<int> sks = quick ? std::vector<int>{8192} : std::vector<int>{4096, 8192, 16384};
  const int max_sk = *std::max_element(sks.begin(), sks.end());
  const size_t max_pages = (size_t)b * max_sk / P + 1;
  uint16_t *cache, *q, *out, *ref_out;
  float *lse, *oacc, *lacc;
  int32_t *qo, *klen, *bt, *meta, *splits;
  uint8_t *flush;
  CK(cudaMalloc(&cache, max_pages * P * 1152));
  CK(cudaMalloc(&q, (size_t)b * 2 * 128 * 576 * 2));
  CK(cudaMalloc(&out, (size_t)b * 2 * 128 * 512 * 2));
  CK(cudaMalloc(&ref_out, (size_t)b * 2 * 128 * 512 * 2));
  CK(cudaMalloc(&lse, (size_t)b * 2 * 128 * 4));
  const size_t max_splits = (size_t)b + kNumSm + 8;
  CK(cudaMalloc(&oacc, max_splits * 2 * 128 * 512 * 4));
  CK(cudaMalloc(&lacc, max_splits * 2 * 128 * 4));
  CK(cudaMalloc(&qo, (b + 1) * 4));
  CK(cudaMalloc(&klen, b * 4));
  CK(cudaMalloc(&bt, (size_t)b * (max_sk / P) * 4));
  CK(cudaMalloc(&meta, kNumSm * SCHED_INTS * 4));
  CK(cudaMalloc(&splits, (b + 1) * 4));
  const size_t flush_bytes = 256ull << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  fill_bf16<<<4096, 256>>>(cache, max_pages * P * 576, 1234u);
  fill_bf16<<<4096, 256>>>(q, (size_t)b * 2 * 128 * 576, 999u);
  CK(cudaGetLastError());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  for (int sk : sks)
    for (int H : {16, 128})
      for (int sq : {1, 2}) {
        if ((g_only_h && H != g_only_h) || (g_only_sq && sq != g_only_sq) || (g_only_sk && sk != g_only_sk)) continue;
        Case c;
        c.b = b;
        c.max_q = sq;
        c.H = H;
        c.P = P;
        c.causal = 1;
        c.lse_base2 = 0;
        c.want_lse = 1;
        c.scale = 0.0722f;
        c.qlen.assign(b, sq);
        c.klen.assign(b, sk);
        HostData h;
        h.qo.assign(b + 1, 0);
        for (int i = 0; i < b; i++) h.qo[i + 1] = h.qo[i] + sq;
        h.Tq = h.qo[b];
        h.klen = c.klen;
        h.width = sk / P;
        h.num_pages = (int)max_pages;
        std::vector<int> perm(b * h.width);
        for (size_t i = 0; i < perm.size(); i++) perm[i] = (int)i + 1;  // page 0: the dummy page
        Rng rng(sk * 31 + H * 7 + sq);
        for (int i = (int)perm.size() - 1; i > 0; i--) std::swap(perm[i], perm[rng.next() % (uint32_t)(i + 1)]);
        h.bt = perm;
        build_schedule(c, h);
        CK(cudaMemcpy(qo, h.qo.data(), (b + 1) * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(klen, h.klen.data(), b * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(bt, h.bt.data(), h.bt.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(meta, h.meta.data(), h.meta.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(splits, h.splits.data(), (b + 1) * 4, cudaMemcpyHostToDevice));
        mla_decode_params p;
        memset(&p, 0, sizeof(p));
        p.batch_size = b;
        p.num_heads = H;
        p.max_q_len = sq;
        p.causal = 1;
        p.page_size = P;
        p.block_table_width = h.width;
        p.num_pages = h.num_pages;
        p.scale = c.scale;
        p.q_nope = q;
        p.q_rope = q + 512;
        p.q_nope_stride_token = p.q_rope_stride_token = (int64_t)H * 576;
        p.q_nope_stride_head = p.q_rope_stride_head = 576;
        p.kv = cache;
        p.row_bytes = 1152;
        p.qo_indptr = qo;
        p.kv_lens = klen;
        p.block_table = bt;
        p.num_sm_parts = h.parts;
        p.sched_meta = meta;
        p.num_splits = splits;
        p.out = out;
        p.lse = lse;
        p.o_accum = oacc;
        p.lse_accum = lacc;
        const size_t out_elems = (size_t)h.Tq * H * 512;
        const double flop = 2.0 * b * sq * H * (double)sk * 1088;
        const double bytes = (double)b * sk * 1152 + (double)h.Tq * H * 576 * 2 + (double)out_elems * 2;
        // Warm-up and a consistency check against the first version's output.
        std::vector<std::vector<float>> times(versions.size());
        std::vector<double> vs_first(versions.size(), 0.0);
        for (size_t vi = 0; vi < versions.size(); vi++) {
          CK(cudaMemset(out, 0xff, out_elems * 2));
          for (int w = 0; w < 3; w++) CK(launch_version(versions[vi], &p, 0));
          CK(cudaDeviceSynchronize());
          if (vi == 0) {
            CK(cudaMemcpy(ref_out, out, out_elems * 2, cudaMemcpyDeviceToDevice));
          } else {
            std::vector<uint16_t> a(out_elems), r(out_elems);
            CK(cudaMemcpy(a.data(), out, out_elems * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(r.data(), ref_out, out_elems * 2, cudaMemcpyDeviceToHost));
            double md = 0;
            for (size_t i = 0; i < out_elems; i++) {
              const double dd = fabs((double)bf2f(a[i]) - bf2f(r[i]));
              md = std::isnan(dd) ? INFINITY : std::max(md, dd);
            }
            vs_first[vi] = md;
          }
        }
        // Interleaved timing: every version sees the same clock/thermal drift.
        for (int r = 0; r < runs; r++)
          for (size_t vi = 0; vi < versions.size(); vi++) {
            CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
            CK(cudaEventRecord(e0));
            CK(launch_version(versions[vi], &p, 0));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            times[vi].push_back(ms);
          }
        for (size_t vi = 0; vi < versions.size(); vi++) {
          std::vector<float> &t = times[vi];
          const float med = median(t);
          const float mn = *std::min_element(t.begin(), t.end());
          const double s = med * 1e-3;
          printf("BENCH v%d b=%d sq=%d H=%d sk=%d P=%d parts=%d splits=%d t_us=%.1f min_us=%.1f tflops=%.1f gbs=%.0f "
                 "maxdiff_vs_v%d=%.2e\n",
                 versions[vi], b, sq, H, sk, P, h.parts, h.total_splits, med * 1e3, mn * 1e3, flop / s * 1e-12,
                 bytes / s * 1e-9, versions[0], vs_first[vi]);
        }
        fflush(stdout);
      }
  return 0;
}

static int cmd_copybw() {
  const size_t n = 2ull << 30;
  uint8_t *a, *b;
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&b, n));
  CK(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int r = 0; r < 13; r++) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 3) t.push_back(ms);
  }
  const float med = median(t);
  printf("COPYBW d2d %zu MB: %.3f ms median, %.0f GB/s (read + write)\n", n >> 20, med, 2.0 * n / (med * 1e-3) * 1e-9);
  return 0;
}

// Host-only self-check (no GPU): the grid's cases, their schedules, and the
// own reference against the project oracle on every case.
static int cmd_refcheck(uint64_t seed, bool tiny) {
  std::vector<Case> grid = check_grid(seed, tiny);
  Rng rng(seed ^ 0xabcdef);
  int bad = 0;
  for (const Case &c : grid) {
    HostData h;
    make_host(c, rng.next(), h);
    std::vector<double> ro, rl, rw;
    reference(c, h, ro, rl, rw);
    const double md = oracle_diff(c, h, ro, rl);
    int ninf = 0;
    for (double x : rl) ninf += std::isinf(x);
    printf("REFCHECK %-32s parts=%d splits=%d Tq=%d -inf rows=%d diff=%.1e %s\n", c.name.c_str(), h.parts,
           h.total_splits, h.Tq, ninf, md, md < 1e-9 ? "ok" : "BAD");
    bad += !(md < 1e-9);
  }
  return bad ? 1 : 0;
}

static std::vector<int> parse_versions(const char *s) {
  std::vector<int> v;
  while (*s) {
    v.push_back(atoi(s));
    while (*s && *s != ',') s++;
    if (*s == ',') s++;
  }
  return v;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s unit | check -v N [--tiny] [--seed S] | bench -v 1,2 [--quick] [--runs R] [--h H] [--sq S] [--sk K] [--b B] | copybw | refcheck\n",
            argv[0]);
    return 2;
  }
  std::string cmd = argv[1];
  std::vector<int> versions = {1};
  uint64_t seed = 20261130;
  bool tiny = false, quick = false;
  int runs = 30;
  for (int i = 2; i < argc; i++) {
    std::string a = argv[i];
    if (a == "-v" && i + 1 < argc) versions = parse_versions(argv[++i]);
    else if (a == "--seed" && i + 1 < argc) seed = strtoull(argv[++i], nullptr, 10);
    else if (a == "--tiny") tiny = true;
    else if (a == "--quick") quick = true;
    else if (a == "--runs" && i + 1 < argc) runs = atoi(argv[++i]);
    else if (a == "--h" && i + 1 < argc) g_only_h = atoi(argv[++i]);
    else if (a == "--sq" && i + 1 < argc) g_only_sq = atoi(argv[++i]);
    else if (a == "--sk" && i + 1 < argc) g_only_sk = atoi(argv[++i]);
    else if (a == "--b" && i + 1 < argc) g_bench_b = atoi(argv[++i]);
  }
  if (cmd == "unit") return run_desc_tests(stdout) ? 1 : 0;
  if (cmd == "check") return cmd_check(versions, seed, tiny);
  if (cmd == "bench") return cmd_bench(versions, quick, runs);
  if (cmd == "copybw") return cmd_copybw();
  if (cmd == "refcheck") return cmd_refcheck(seed, tiny);
  fprintf(stderr, "unknown command %s\n", cmd.c_str());
  return 2;
}
