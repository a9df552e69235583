// Unit tests of the "derived" Hopper facts the wgmma versions rely on
// (HOPPER-NOTES §1-§2), run before any decode kernel:
//  1. QK^T: Q and K as nine 128B-swizzled 64x64 sub-tiles, K-major
//     descriptors advanced by (k/4)*8192 + (k%4)*32 bytes, m64n32k16 per
//     warpgroup (keys 32w..).
//  2. PV with V as an MN-major (transposed) view of the K tile, m64n256k16,
//     for candidate (LBO, SBO) pairs; the harness uses the pair that passes.
//  3. PV with P as a register A operand (accumulator layout packed to bf16).
//  4. TMA with SWIZZLE_128B lands a page's rows in exactly the layout of
//     sw128_off (boxes of 64 rows and of P < 64 rows).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "common.cuh"
#include "tmap.h"
#include "wgmma_ops.cuh"

namespace {

constexpr uint32_t kSub = 8192;

__global__ void __launch_bounds__(256, 1)
    desc_kernel(const __nv_bfloat16 *q, const __nv_bfloat16 *k, const __nv_bfloat16 *pm, float *s_out,
                float *o_out, float *o_rs_out, uint32_t lbo, uint32_t sbo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t raw[];
  uint8_t *sm = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~(uintptr_t)1023);
  const uint32_t sb = smem_u32(sm);
  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int rA = 16 * wi + (lane >> 2), rB = rA + 8, cq = 2 * (lane & 3);
  // Generic stores into the swizzled layouts.
  for (int i = tid; i < 64 * 576; i += 256) {
    const int r = i / 576, c = i % 576;
    *reinterpret_cast<__nv_bfloat16 *>(sm + (c >> 6) * kSub + sw128_off(r, c & 63)) = q[i];
    *reinterpret_cast<__nv_bfloat16 *>(sm + 9 * kSub + (c >> 6) * kSub + sw128_off(r, c & 63)) = k[i];
  }
  for (int i = tid; i < 64 * 64; i += 256)
    *reinterpret_cast<__nv_bfloat16 *>(sm + 18 * kSub + sw128_off(i / 64, i % 64)) = pm[i];
  fence_proxy_async();
  __syncthreads();

  float s[16];
#pragma unroll
  for (int i = 0; i < 16; i++) s[i] = 0.f;
  const uint64_t dq = desc_sw128(sb, 16, 1024), dk = desc_sw128(sb + 9 * kSub + wg * 4096, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 36; kk++) {
    const uint32_t off = ((kk >> 2) * kSub + (kk & 3) * 32) >> 4;
    wgmma_m64n32k16_ss(s, dq + off, dk + off, kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(s);
#pragma unroll
  for (int i = 0; i < 16; i++) {
    const int r = ((i >> 1) & 1) ? rB : rA, c = 32 * wg + 8 * (i >> 2) + cq + (i & 1);
    s_out[r * 64 + c] = s[i];
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; i++) o[i] = 0.f;
  const uint64_t dp = desc_sw128(sb + 18 * kSub, 16, 1024);
  const uint64_t dv = desc_sw128(sb + 9 * kSub + wg * 4 * kSub, lbo, sbo);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; kk++) wgmma_m64n256k16_ss_tb(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(o);
#pragma unroll
  for (int i = 0; i < 128; i++) {
    const int r = ((i >> 1) & 1) ? rB : rA, c = 256 * wg + 8 * (i >> 2) + cq + (i & 1);
    o_out[r * 512 + c] = o[i];
  }

  // Register A: the accumulator layout of a 64x64 S packed to bf16.
#pragma unroll
  for (int i = 0; i < 128; i++) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
    uint32_t a[4];
    const int c0 = 16 * kk + cq;
    const __nv_bfloat16 *pa = pm + rA * 64 + c0, *pb = pm + rB * 64 + c0;
    a[0] = pack_bf16(__bfloat162float(pa[0]), __bfloat162float(pa[1]));
    a[1] = pack_bf16(__bfloat162float(pb[0]), __bfloat162float(pb[1]));
    a[2] = pack_bf16(__bfloat162float(pa[8]), __bfloat162float(pa[9]));
    a[3] = pack_bf16(__bfloat162float(pb[8]), __bfloat162float(pb[9]));
    wgmma_m64n256k16_rs_tb(o, a, dv + ((kk * 2048) >> 4), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(o);
#pragma unroll
  for (int i = 0; i < 128; i++) {
    const int r = ((i >> 1) & 1) ? rB : rA, c = 256 * wg + 8 * (i >> 2) + cq + (i & 1);
    o_rs_out[r * 512 + c] = o[i];
  }
#endif
}

// TMA: one 64-key tile of `page` (rows row0.. of it, or 64/P whole pages)
// copied raw from shared memory to out (9 x 8192 bytes).
__global__ void tma_kernel(const __grid_constant__ CUtensorMap map, const int *pages, int P, int row0,
                           uint8_t *out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t raw[];
  uint8_t *sm = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~(uintptr_t)1023);
  __shared__ __align__(8) uint64_t bar;
  const uint32_t sb = smem_u32(sm), b = smem_u32(&bar);
  if (threadIdx.x == 0) {
    mbar_init(b, 1);
    fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (P >= 64) {
      mbar_expect_tx(b, 9 * kSub);
      for (int j = 0; j < 9; j++) tma_load_3d(sb + j * kSub, &map, b, 64 * j, row0, pages[0]);
    } else {
      mbar_expect_tx(b, 9 * 64 * 128);
      for (int bx = 0; bx < 64 / P; bx++)
        for (int j = 0; j < 9; j++) tma_load_3d(sb + j * kSub + bx * P * 128, &map, b, 64 * j, 0, pages[bx]);
    }
  }
  mbar_wait(b, 0);
  for (int i = threadIdx.x; i < 9 * (int)kSub; i += blockDim.x) out[i] = sm[i];
#endif
}

float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
uint32_t host_sw128(int r, int c) { return (uint32_t)(r * 128 + ((((c >> 3) ^ (r & 7)) & 7) << 4) + (c & 7) * 2); }

double max_rel(const std::vector<float> &got, const std::vector<double> &ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); i++) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return sqrt(num / (den > 0 ? den : 1));
}

#define TCK(x)                                                                      \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(out, "desc_test: %s failed: %s\n", #x, cudaGetErrorString(e_));     \
      return -1;                                                                    \
    }                                                                               \
  } while (0)

int tma_case(FILE *out, int P) {
  // A small paged cache: 8 pages, random rows, and a page order to gather.
  const int pages = 8;
  const size_t rows = (size_t)pages * P;
  std::vector<uint16_t> h(rows * 576);
  uint32_t st = 12345 + P;
  for (auto &v : h) {
    st = st * 1664525u + 1013904223u;
    v = f2bf(((st >> 8) & 0xffff) / 65536.f - 0.5f);
  }
  uint16_t *d;
  uint8_t *dout;
  int *dpages;
  TCK(cudaMalloc(&d, h.size() * 2));
  TCK(cudaMalloc(&dout, 9 * kSub));
  TCK(cudaMalloc(&dpages, 64 * sizeof(int)));
  TCK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  std::vector<int> pg(64);
  for (int i = 0; i < 64; i++) pg[i] = (5 + 3 * i) % pages;
  TCK(cudaMemcpy(dpages, pg.data(), 64 * sizeof(int), cudaMemcpyHostToDevice));
  mla_decode_params p;
  memset(&p, 0, sizeof(p));
  p.kv = d;
  p.page_size = P;
  p.num_pages = pages;
  p.row_bytes = 1152;
  CUtensorMap map;
  TCK(make_kv_tmap(&p, &map));
  const int row0 = P >= 128 ? 64 : 0;
  TCK(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 9 * kSub + 1024));
  tma_kernel<<<1, 128, 9 * kSub + 1024>>>(map, dpages, P, row0, dout);
  TCK(cudaGetLastError());
  TCK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(9 * kSub);
  TCK(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r = 0; r < 64; r++) {
    size_t row = P >= 64 ? (size_t)pg[0] * P + row0 + r : (size_t)pg[r / P] * P + r % P;
    for (int c = 0; c < 576; c++) {
      uint16_t g;
      memcpy(&g, &got[(c >> 6) * kSub + host_sw128(r, c & 63)], 2);
      if (g != h[row * 576 + c]) bad++;
    }
  }
  cudaFree(d);
  cudaFree(dout);
  cudaFree(dpages);
  fprintf(out, "desc_test: TMA SW128 page %d: %s (%d bad)\n", P, bad ? "FAIL" : "PASS", bad);
  return bad ? -1 : 0;
}

}  // namespace

// Returns 0 when every fact holds; sets the V-view pair that passed.
int run_desc_tests(FILE *out) {
  const int nq = 64 * 576;
  std::vector<uint16_t> hq(nq), hk(nq), hp(64 * 64);
  uint32_t st = 777;
  auto rnd = [&]() {
    st = st * 1664525u + 1013904223u;
    return ((st >> 8) & 0xffff) / 32768.f - 1.f;
  };
  for (auto &v : hq) v = f2bf(rnd());
  for (auto &v : hk) v = f2bf(rnd());
  for (auto &v : hp) v = f2bf(rnd());
  std::vector<double> sref(64 * 64), oref(64 * 512);
  for (int r = 0; r < 64; r++)
    for (int j = 0; j < 64; j++) {
      double a = 0;
      for (int c = 0; c < 576; c++) a += (double)bf2f(hq[r * 576 + c]) * bf2f(hk[j * 576 + c]);
      sref[r * 64 + j] = a;
    }
  for (int r = 0; r < 64; r++)
    for (int c = 0; c < 512; c++) {
      double a = 0;
      for (int j = 0; j < 64; j++) a += (double)bf2f(hp[r * 64 + j]) * bf2f(hk[j * 576 + c]);
      oref[r * 512 + c] = a;
    }
  __nv_bfloat16 *dq, *dk, *dp;
  float *ds, *dob, *dor;
  TCK(cudaMalloc(&dq, nq * 2));
  TCK(cudaMalloc(&dk, nq * 2));
  TCK(cudaMalloc(&dp, 64 * 64 * 2));
  TCK(cudaMalloc(&ds, 64 * 64 * 4));
  TCK(cudaMalloc(&dob, 64 * 512 * 4));
  TCK(cudaMalloc(&dor, 64 * 512 * 4));
  TCK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  TCK(cudaMemcpy(dk, hk.data(), nq * 2, cudaMemcpyHostToDevice));
  TCK(cudaMemcpy(dp, hp.data(), 64 * 64 * 2, cudaMemcpyHostToDevice));
  const int smem = 19 * kSub + 1024;
  TCK(cudaFuncSetAttribute(desc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const uint32_t cand[3][2] = {{8192, 1024}, {1024, 8192}, {16, 1024}};
  int chosen = -1, rc = 0;
  for (int v = 0; v < 3; v++) {
    TCK(cudaMemset(ds, 0xff, 64 * 64 * 4));
    TCK(cudaMemset(dob, 0xff, 64 * 512 * 4));
    TCK(cudaMemset(dor, 0xff, 64 * 512 * 4));
    desc_kernel<<<1, 256, smem>>>(dq, dk, dp, ds, dob, dor, cand[v][0], cand[v][1]);
    TCK(cudaGetLastError());
    TCK(cudaDeviceSynchronize());
    std::vector<float> s(64 * 64), o(64 * 512), orr(64 * 512);
    TCK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
    TCK(cudaMemcpy(o.data(), dob, o.size() * 4, cudaMemcpyDeviceToHost));
    TCK(cudaMemcpy(orr.data(), dor, orr.size() * 4, cudaMemcpyDeviceToHost));
    const double es = max_rel(s, sref), eo = max_rel(o, oref), er = max_rel(orr, oref);
    fprintf(out, "desc_test: V view lbo=%u sbo=%u: QK rel %.2e, PV(smem A) rel %.2e, PV(reg A) rel %.2e\n",
            cand[v][0], cand[v][1], es, eo, er);
    if (v == 0 && !(es < 1e-5)) rc = -1;
    if (eo < 1e-5 && er < 1e-5 && chosen < 0) chosen = v;
  }
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dp);
  cudaFree(ds);
  cudaFree(dob);
  cudaFree(dor);
  fprintf(out, "desc_test: QK^T K-major descriptors: %s\n", rc ? "FAIL" : "PASS");
  if (chosen >= 0) {
    decode_set_vview(cand[chosen][0], cand[chosen][1]);
    fprintf(out, "desc_test: V view: PASS with lbo=%u sbo=%u\n", cand[chosen][0], cand[chosen][1]);
  } else {
    fprintf(out, "desc_test: V view: FAIL for every candidate\n");
    rc = -1;
  }
  for (int P : {64, 128, 16, 8})
    if (tma_case(out, P)) rc = -1;
  return rc;
}
