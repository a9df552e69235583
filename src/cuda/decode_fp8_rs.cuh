// Raw e4m3 bytes as register A operands of the narrow (transposed) decode
// GEMMs, f16 m64n16k16 / m64n32k16 (docs/decode-kernel.md §3.5.1): the conversions shared
// by the ring kernel (decode_sm90.cu: qk_rs_tile / pv_rs_tile) and its dev
// check (dev/cuda/fp8_rs.cu). Device-only; include after decode_common.cuh
// (which holds their e4m3 -> f16 conversion, e4m3x4_f16x2x2).
#pragma once
#include <stdint.h>

// D[64x16] (+)= A[64x16] (registers, f16) * B[16x16] (smem desc, K-major, f16)
static __device__ __forceinline__ void wgmma_rs_m64n16k16_h(float (&d)[8], const uint32_t (&a)[4], uint64_t db,
                                                            int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}

// D[64x32] (+)= A[64x16] (registers, f16) * B[16x32] (smem desc, K-major, f16)
static __device__ __forceinline__ void wgmma_rs_m64n32k16_h(float (&d)[16], const uint32_t (&a)[4], uint64_t db,
                                                            int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}

// The m64nNk16 of the two above (N = 16 or 32 columns: rows of the m-block).
template <int N>
static __device__ __forceinline__ void wgmma_rs_h(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int accum) {
  static_assert(N == 16 || N == 32, "m64n16 or m64n32");
  if constexpr (N == 16) wgmma_rs_m64n16k16_h(d, a, db, accum);
  else wgmma_rs_m64n32k16_h(d, a, db, accum);
}

// Two k-steps of K (64 keys x 32 bytes) as the A fragments of S^T = K Q^T:
// one ldmatrix.x4 of the b16 view; lane l addresses row (key) 16 w + l % 8 +
// 8 ((l / 8) % 2) of its warp w, at the k-step pair's byte + 16 (l / 16). Lane
// (g, c) = (l / 4, l % 4) gets bytes 4c..4c+3 of rows g and g + 8, which fill
// the k slots {2c, 2c+1} (low half) and {2c+8, 2c+9} (high half): B's dims
// must be permuted the same way within each 16-group.
static __device__ __forceinline__ void rs_k_pair(uint32_t addr, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  uint32_t x0, x1, x2, x3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
               : "r"(addr)
               : "memory");
  e4m3x4_f16x2x2(x0, a0[0], a0[2]);
  e4m3x4_f16x2x2(x1, a0[1], a0[3]);
  e4m3x4_f16x2x2(x2, a1[0], a1[2]);
  e4m3x4_f16x2x2(x3, a1[1], a1[3]);
}

// Two k-steps of V^T (16 dims of a warp x 32 keys) as the A fragments of
// O^T += V^T P^T: one ldmatrix.x4.trans of the b16 view; lane l addresses key
// l (of the 32) at the warp's 16-byte piece. Lane (g, c) gets keys 2c, 2c+1 of
// byte pair (2g, 2g+1); a byte permute regroups them as (dim 2g: keys 2c,
// 2c+1) and (dim 2g+1: ...), so fragment rows g / g + 8 hold dims 2g / 2g + 1.
static __device__ __forceinline__ void rs_vt_pair(uint32_t addr, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  uint32_t x0, x1, x2, x3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
               : "r"(addr)
               : "memory");
  e4m3x4_f16x2x2(__byte_perm(x0, 0, 0x3120), a0[0], a0[1]);  // keys 0-7 of the first step: dims 2g, 2g + 1
  e4m3x4_f16x2x2(__byte_perm(x1, 0, 0x3120), a0[2], a0[3]);  // keys 8-15
  e4m3x4_f16x2x2(__byte_perm(x2, 0, 0x3120), a1[0], a1[1]);
  e4m3x4_f16x2x2(__byte_perm(x3, 0, 0x3120), a1[2], a1[3]);
}
