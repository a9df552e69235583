// The P.V building blocks of the fp8 math kernel before session 27 (V^T
// transposed into shared memory per tile; the kernel itself is
// dev/cuda/variants/s28-wide8-transposing.patch): fp8_ot times them as the
// baseline of the O^T form the library runs now (docs/decode-kernel.md §12).
// Moved here from src/cuda/decode_wide_fp8.cuh when that kernel left src/.
#pragma once

#include "decode_wide_fp8.cuh"

namespace seesaw {

// V^T of one half (256 output dims) of a raw tile at kb: its latent chunks
// 2 half, 2 half + 1 (64 key rows x 128 B, swizzled as TMA lands them) ->
// vt, 256 rows (dim - 256 half) x 128 B, swizzled, the half's 64 keys in
// bytes 64 half .. 64 half + 63 (the other warpgroup writes the other half
// of each row). Inside each 16-key block, position 4q + e holds key
// 8 (e >> 1) + 2q + (e & 1) (pack_p8's order). Keys >= nvalid become 0
// (past the piece: NaN possible, and P = 0 there would not cancel it).
// Warp wi does keys 16 wi .. 16 wi + 15; per 32 dims: one ldmatrix.trans of
// four 8x8 b16 matrices (keys +0-7 / +8-15 x dims +0-15 / +16-31), which
// gives lane (c = lane / 4, q = lane % 4) keys {2q, 2q + 1} x dims
// {2c, 2c + 1} per matrix; two byte permutes per matrix pair make dims 2c
// and 2c + 1 four keys each; one stmatrix writes them, each matrix taking
// even dims from lanes < 16 and odd ones from the others so that its 8 rows
// fall in 8 different 16-byte bank groups (no conflicts on either side).
// The caller fences (generic -> async proxy) and syncs the warpgroup.
__device__ __forceinline__ void transpose_v(uint32_t kb, uint32_t vt, int half, int nvalid, int wi, int lane) {
  const int m = lane >> 3, i = lane & 7, q = lane & 3;
  const int key = 16 * wi + 8 * (m & 1) + i;  // the ldmatrix row this lane addresses
  uint32_t keep = 0xffffffffu;
  if (nvalid < 64) {
    const int k0 = 16 * wi + 2 * q;
    keep = (k0 < nvalid ? 0xffu : 0u) | (k0 + 1 < nvalid ? 0xff00u : 0u) | (k0 + 8 < nvalid ? 0xff0000u : 0u) |
           (k0 + 9 < nvalid ? 0xff000000u : 0u);
  }
  const bool lo = lane < 16;
  const uint32_t selA = lo ? 0x6420u : 0x7531u, selB = lo ? 0x7531u : 0x6420u;  // even / odd dims of a pair
  const int drel = 16 * (m >> 1) + 2 * i + (((m & 1) ^ (i >= 4 ? 1 : 0)) ? 1 : 0);  // the stmatrix row (dim) it addresses
  const uint32_t unit = 4 * half + wi;
  // Per chunk the four loads first, then the four stores: a load-permute-
  // store chain per 32 dims would wait out the ldmatrix latency eight times.
#pragma unroll
  for (int c = 0; c < 2; c++) {
    uint32_t r[4][4];
#pragma unroll
    for (int g = 0; g < 4; g++)
      ldsm_x4_trans(kb + (2 * half + c) * kChunk + key * 128 + (((2 * g + (m >> 1)) ^ (key & 7)) << 4), r[g]);
#pragma unroll
    for (int g = 0; g < 4; g++) {
      // (even dims for matrix 0 / 2 from lanes < 16, odd ones from the rest:
      // the selector itself differs per lane, no select needed)
      const uint32_t w0 = __byte_perm(r[g][0], r[g][1], selA) & keep, w1 = __byte_perm(r[g][0], r[g][1], selB) & keep;
      const uint32_t w2 = __byte_perm(r[g][2], r[g][3], selA) & keep, w3 = __byte_perm(r[g][2], r[g][3], selB) & keep;
      const int n = 128 * c + 32 * g + drel;
      stsm_x4(vt + (n >> 3) * 1024 + (n & 7) * 128 + ((unit ^ (uint32_t)(n & 7)) << 4), w0, w1, w2, w3);
    }
  }
}

// O[:, 256 half ..] += P V with P from registers / from a P tile; V^T of the
// tile at vt (this half's keys at bytes 64 half of each row).
__device__ __forceinline__ void pv8_rs(float (&o)[128], const uint32_t (&pa)[2][4], uint32_t vt, int half) {
  const uint64_t dv = desc_sw128(vt + 64 * half, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 2; kk++) wgmma_m64n256k32_rs_e4m3(o, pa[kk], dv + ((32 * kk) >> 4), 1);
  wgmma_commit();
}
__device__ __forceinline__ void pv8_ss(float (&o)[128], uint32_t sP, uint32_t vt, int half) {
  const uint64_t dp = desc_sw128(sP, 16, 1024), dv = desc_sw128(vt + 64 * half, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 2; kk++) wgmma_m64n256k32_ss_e4m3(o, dp + ((32 * kk) >> 4), dv + ((32 * kk) >> 4), 1);
  wgmma_commit();
}

}  // namespace seesaw
