// The fp8 math kernel's P.V as O^T = V^T P^T with V^T built in registers: a
// check of the layout and a timing against today's shared-memory transpose.
//
// decode_wide8_kernel (src/cuda/decode_wide_fp8.cuh, docs/decode-kernel.md
// §12) needs V K-major for the e4m3 wgmma (keys contiguous per output dim), so
// each warpgroup writes V^T of its 256 dims into shared memory per tile
// (transpose_v: ldmatrix.trans, byte permutes, stmatrix) and then runs
// O[64 x 256] += P[64 x 64] V[64 x 256] as m64n256k32 with V^T as B. Swapping
// the roles, O^T[256 x 64] += V^T[256 x 64] P^T[64 x 64], makes V^T the A
// operand, which may come from registers in any row order:
//  - per warp and 64-dim m-tile, its 16 dims x 32 keys per k32 step from one
//    ldmatrix.x4.trans (b16 view, four 8-key matrices of the warp's 16-byte
//    dim unit): lane (g, c) gets keys {2c, 2c + 1} x dims {2g, 2g + 1} of each;
//    two byte permutes per matrix pair give dim 2g (fragment row g) and dim
//    2g + 1 (row g + 8) with keys {2c, 2c + 1, 8 + 2c, 9 + 2c}, i.e. the
//    fragment's logical k 4c..4c + 3 hold pack_p8's permuted keys;
//  - B = P as stored for the other warpgroup today (64 rows x 64 keys, the
//    same key permutation, 128-byte swizzled rows): K-major as B too.
// The accumulator then holds O^T with dims permuted inside each warp's 16
// (row g: dim 2g, row g + 8: dim 2g + 1), as merge_rows' kPermD.
//
// `fp8_ot check`: one warpgroup, one tile, against float64 (exact e4m3 values).
// `fp8_ot time [tiles]`: every SM, two warpgroups looping over one
// smem-resident tile each (no loads, no softmax), cycles per tile per
// warpgroup of (a) today's P.V (transpose_v into a V^T buffer, a warpgroup
// barrier, two m64n256k32 with P from shared memory), (b) O^T with the V^T
// fragments from registers (8 ldmatrix.x4 + 32 permutes + 8 m64n64k32 per
// warp and tile), (c) (b) without the permutes (timing only, wrong values),
// (d) today's m64n256k32 with P from registers over a V^T left in place (no
// transposes: the floor of today's layout).
//
// Build: make -C dev/cuda build/fp8_ot (needs no GPU). Run on the device.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>

#include "fp8_host.h"  // e4m3_to_float, CK

#include "fp8_ot_base.cuh"  // transpose_v, pv8_rs, pv8_ss (and decode_wide_fp8.cuh, decode_common.cuh)

namespace {

using namespace seesaw;

constexpr int kKeys = 64, kDims = 256, kRows = 64;
constexpr int kVBytes = 2 * 8192;   // V: 64 keys x 256 dims e4m3, two 128-dim chunks as TMA lands them
constexpr int kPBytes = 8192;       // P: 64 rows x 128 B (keys in bytes 0..63)
constexpr int kVtBytes = 4 * 8192;  // V^T buffer of transpose_v (256 rows x 128 B)

// Byte offset of V[key][dim] in the raw tile (128B swizzle, 16-byte units).
__host__ __device__ __forceinline__ uint32_t v_off(int key, int dim) {
  const int c = dim >> 7, b = dim & 127;
  return (uint32_t)(c * 8192 + key * 128 + ((((b >> 4) ^ (key & 7)) & 7) << 4) + (b & 15));
}
// Position of logical key k inside a P row (pack_p8's order: position 4q + e
// of each 16-key block holds key 8 (e >> 1) + 2q + (e & 1)).
__host__ __device__ __forceinline__ int p_pos(int k) {
  const int kk = k & 15, q = (kk & 7) >> 1, e = 2 * (kk >> 3) + (kk & 1);
  return (k & ~15) + 4 * q + e;
}
__host__ __device__ __forceinline__ uint32_t p_off(int row, int k) {
  const int b = p_pos(k);
  return (uint32_t)(row * 128 + ((((b >> 4) ^ (row & 7)) & 7) << 4) + (b & 15));
}

// (wgmma_m64n64k32_rs_e4m3: decode_wide_fp8.cuh, where the library kernel built on this uses it.)

// The A fragments of one k32 step of m-tile mt (dims 64 mt ..) for warp wi:
// one ldmatrix.x4.trans of keys 32 kk .. 32 kk + 31 x the warp's 16 dims,
// then (kPerm) the byte permutes that make rows g / g + 8 dims 2g / 2g + 1.
template <bool kPerm>
__device__ __forceinline__ void vt_frag(uint32_t vb, int mt, int kk, int wi, int lane, uint32_t (&a)[4]) {
  const int key = 32 * kk + 8 * (lane >> 3) + (lane & 7);  // row (lane % 8) of matrix lane / 8
  const int dim0 = 64 * mt + 16 * wi;
  uint32_t r[4];
  ldsm_x4_trans(vb + v_off(key, dim0), r);
  if (kPerm) {
    a[0] = __byte_perm(r[0], r[1], 0x6420);  // dim 2g: keys 2c, 2c + 1, 8 + 2c, 9 + 2c
    a[1] = __byte_perm(r[0], r[1], 0x7531);  // dim 2g + 1
    a[2] = __byte_perm(r[2], r[3], 0x6420);  // the next 16 keys
    a[3] = __byte_perm(r[2], r[3], 0x7531);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = r[i];
  }
}

// O^T of one tile: 4 m-tiles x 2 k32 steps; o[mt] the m-tile's accumulator.
template <bool kPerm>
__device__ __forceinline__ void pv_ot(float (&o)[4][32], uint32_t vb, uint32_t sP, int wi, int lane) {
  uint32_t a[4][2][4];
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int kk = 0; kk < 2; kk++) vt_frag<kPerm>(vb, mt, kk, wi, lane, a[mt][kk]);
  pv8_ot(o, a, sP);  // the library kernel's wgmmas (decode_wide_fp8.cuh)
  wgmma_wait<0>();
  reg_fence2(o);
}

// ---- check: one warpgroup, one tile ----------------------------------------
// v8 [64 keys][256 dims], p8 [64 rows][64 keys] e4m3 bytes (logical order);
// out [64 rows][256 dims] fp32.
__global__ void __launch_bounds__(128) ot_check(const uint8_t *v8, const uint8_t *p8, float *out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(sm), sP = sb + kVBytes;
  const int tid = threadIdx.x, wi = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kKeys * kDims; i += 128) sm[v_off(i / kDims, i % kDims)] = v8[i];
  for (int i = tid; i < kRows * kKeys; i += 128) sm[kVBytes + p_off(i / kKeys, i % kKeys)] = p8[i];
  fence_proxy_async();
  __syncthreads();
  float o[4][32];
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int i = 0; i < 32; i++) o[mt][i] = 0.f;
  pv_ot<true>(o, sb, sP, wi, lane);
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const int slot = g + 8 * ((i >> 1) & 1);                      // fragment row in the warp's 16
      const int dim = 64 * mt + 16 * wi + 2 * (slot & 7) + (slot >> 3);  // row g: dim 2g, row g + 8: 2g + 1
      const int n = 8 * (i >> 2) + 2 * c + (i & 1);                  // query row (the accumulator's column)
      out[n * kDims + dim] = o[mt][i];
    }
}

// ---- timing: every SM, two warpgroups, one smem-resident tile each ---------
// MODE 0: transpose_v of this warpgroup's 256 dims of its tile into its V^T
// buffer, warpgroup barrier, two m64n256k32 SS (P from shared memory); MODE 1:
// O^T with register V^T; MODE 2: MODE 1 without the permutes; MODE 3: today's
// m64n256k32 with P from registers and the V^T buffer as it is (no transposes).
template <int MODE>
__global__ void __launch_bounds__(256, 1) ot_time(int tiles, long long *cycles, float *sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(sm);
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127, wi = t128 >> 5, lane = tid & 31;
  // per warpgroup: a raw tile (its 256 dims of latent), a P tile, a V^T buffer
  const uint32_t vb = sb + wg * (kVBytes + kPBytes + kVtBytes), sP = vb + kVBytes, vt = sP + kPBytes;
  for (int i = t128; i < (kVBytes + kPBytes) / 4; i += 128)
    reinterpret_cast<uint32_t *>(sm + wg * (kVBytes + kPBytes + kVtBytes))[i] = 0x38383838u ^ (uint32_t)(i * 2654435761u & 0x07070707u);
  fence_proxy_async();
  __syncthreads();
  float acc = 0.f;
  long long t0 = clock64();
  if (MODE == 0) {
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    for (int t = 0; t < tiles; t++) {
      // this warpgroup's 256 dims of the tile (latent chunks 0, 1): what each consumer transposes per tile
      transpose_v(vb, vt, 0, 64, wi, lane);
      fence_proxy_async();
      named_bar_sync(4 + wg, 128);
      pv8_ss(o, sP, vt, 0);
      wgmma_wait<0>();
      reg_fence(o);
      named_bar_sync(4 + wg, 128);  // the V^T buffer is read before the next tile rewrites it
    }
#pragma unroll
    for (int i = 0; i < 128; i++) acc += o[i];
  } else if (MODE == 3) {
    // today's layout with the V^T already there (no transposes): P from registers (RS), as WG0's own tile
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    uint32_t pa[2][4];
#pragma unroll
    for (int k = 0; k < 2; k++)
#pragma unroll
      for (int j = 0; j < 4; j++) pa[k][j] = 0x30303030u + (uint32_t)(lane * (k + 1) * (j + 3));
    for (int t = 0; t < tiles; t++) {
      pv8_rs(o, pa, vt, 0);
      wgmma_wait<0>();
      reg_fence(o);
    }
#pragma unroll
    for (int i = 0; i < 128; i++) acc += o[i];
  } else {
    float o[4][32];
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
      for (int i = 0; i < 32; i++) o[mt][i] = 0.f;
    for (int t = 0; t < tiles; t++) pv_ot<MODE == 1>(o, vb, sP, wi, lane);
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
      for (int i = 0; i < 32; i++) acc += o[mt][i];
  }
  const long long t1 = clock64();
  if (t128 == 0) cycles[blockIdx.x * 2 + wg] = t1 - t0;
  if (acc == 12345.f) sink[tid] = acc;
}



uint8_t rand_e4m3(bool nonneg) {
  for (;;) {
    uint8_t b = (uint8_t)(rand() & 0xff);
    if (nonneg) b &= 0x7f;
    if (((b >> 3) & 15) == 15 && (b & 7) == 7) continue;  // NaN codes
    if (((b >> 3) & 15) > 13) continue;                     // keep |x| <= 2^6 so sums stay moderate
    return b;
  }
}

int run_check() {
  srand(11);
  std::vector<uint8_t> v8(kKeys * kDims), p8(kRows * kKeys);
  for (auto &b : v8) b = rand_e4m3(false);
  for (auto &b : p8) b = rand_e4m3(true);
  uint8_t *dv, *dp;
  float *dout;
  CK(cudaMalloc(&dv, v8.size()));
  CK(cudaMalloc(&dp, p8.size()));
  CK(cudaMalloc(&dout, kRows * kDims * 4));
  CK(cudaMemset(dout, 0xff, kRows * kDims * 4));  // NaN poison: a slot the kernel never writes fails
  CK(cudaMemcpy(dv, v8.data(), v8.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, p8.data(), p8.size(), cudaMemcpyHostToDevice));
  const int smem = kVBytes + kPBytes + 1024;
  CK(cudaFuncSetAttribute(ot_check, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  ot_check<<<1, 128, smem>>>(dv, dp, dout);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> o(kRows * kDims);
  CK(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
  // The fp8 wgmma's short accumulator (docs/decode-kernel.md §12: each k32 step's products aligned to the
  // largest, ~13 bits kept of the sum): per element, 2^-12 of the sum over the two k32 steps of
  // (32 max |product| + |running sum|).
  double worst = 0, emax = 0;
  int bad = 0;
  for (int n = 0; n < kRows; n++)
    for (int d = 0; d < kDims; d++) {
      double r = 0, ra = 0;
      for (int k0 = 0; k0 < kKeys; k0 += 32) {
        double mx = 0;
        for (int k = k0; k < k0 + 32; k++) {
          const double x = (double)e4m3_to_float(p8[n * kKeys + k]) * e4m3_to_float(v8[k * kDims + d]);
          r += x;
          mx = fmax(mx, fabs(x));
        }
        ra += 32 * mx + fabs(r);
      }
      const double err = fabs(r - (double)o[n * kDims + d]), bound = ldexp(ra, -12) + 1e-30;
      if (!(err <= bound)) bad++;  // (NaN fails)
      worst = fmax(worst, err / bound);
      emax = fmax(emax, err);
    }
  printf("check O^T = V^T P^T (e4m3 m64n64k32, V^T from registers): max |err| %.3g, worst err / bound %.3f, %d of %d past: %s\n",
         emax, worst, bad, kRows * kDims, bad == 0 ? "PASS" : "FAIL");
  return bad == 0 ? 0 : 1;
}

template <int MODE>
int run_time(int tiles) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int smem = 2 * (kVBytes + kPBytes + kVtBytes) + 1024;
  long long *dc;
  float *sink;
  CK(cudaMalloc(&dc, sms * 2 * 8));
  CK(cudaMalloc(&sink, 256 * 4));
  CK(cudaFuncSetAttribute(ot_time<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 3; rep++) {
    ot_time<MODE><<<sms, 256, smem>>>(tiles, dc, sink);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<long long> c(sms * 2);
    CK(cudaMemcpy(c.data(), dc, c.size() * 8, cudaMemcpyDeviceToHost));
    double avg = 0;
    for (long long v : c) avg += (double)v;
    avg /= c.size();
    printf("time %-44s %d tiles per warpgroup: %.0f cycles per tile per warpgroup (m64n256k64 of e4m3 work: 256 at the dense fp8 rate, 512 with two warpgroups sharing the pipe)\n",
           MODE == 0   ? "transpose_v + SS m64n256k32 (today)"
           : MODE == 1 ? "O^T, V^T fragments from registers"
           : MODE == 2 ? "O^T without the permutes (wrong values)"
                       : "RS m64n256k32, V^T left in place (no transposes)",
           tiles, avg / tiles);
  }
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  const char *what = argc > 1 ? argv[1] : "check";
  if (!strcmp(what, "check")) return run_check();
  const int tiles = argc > 2 ? atoi(argv[2]) : 4000;
  if (run_time<0>(tiles) || run_time<1>(tiles) || run_time<2>(tiles)) return 1;
  return run_time<3>(tiles);
}
