// fp8 K / V as register A operands of the narrow (transposed) decode GEMMs:
// a check of the layout tricks and a timing of the compute they cost.
//
// The ring kernel's per-tensor fp8 path (docs/decode-kernel.md §3.5) converts
// each raw e4m3 tile into an own 72 KB f16 tile per warpgroup, so only ~56 KB
// of raw bytes fit in flight per SM (2.35 TB/s at b=128, H=16). If both GEMMs
// took their A operand from registers, converted straight from the raw bytes,
// no f16 tile would be needed and the whole ring could hold raw bytes:
//
//  - S^T = K Q^T (m64n16k16, A = K: 64 keys x 16 dims per k-step).
//    ldmatrix (b16 view of the bytes) gives a thread bytes 4c..4c+3 of a
//    16-byte row piece (c = lane % 4); as f16 they fill the fragment's k slots
//    {2c, 2c+1} and {2c+8, 2c+9}. The reduction order does not matter, so Q
//    is stored with each 16-dim group permuted the same way:
//    slot s holds dim pi(s), pi(s) = 4 (s/2) + s%2 for s < 8, 4 ((s-8)/2) + 2 + s%2 else.
//  - O^T += V^T P^T (m64n16k16, A = V^T: 64 dims x 16 keys per k-step).
//    ldmatrix.trans of the b16 view gives a thread, for keys 2c, 2c+1 and the
//    byte pair 2g, 2g+1 (g = lane / 4), four bytes; a byte permute makes them
//    (dim 2g: keys 2c, 2c+1) and (dim 2g+1: keys 2c, 2c+1), i.e. the fragment
//    rows g and g+8 hold dims 2g and 2g+1: the output's dims are permuted
//    within each warp's 16, which the writer undoes.
//
// `fp8_rs check` runs one warpgroup on one tile against a float64 host
// reference (S and O, exact e4m3 values, f16 Q and P). `fp8_rs time [tiles]`
// runs every SM with two warpgroups looping over smem-resident tiles, no
// loads: (a) SS: f16 tiles already in shared memory (the bf16 ring kernel's
// compute, softmax left out), (b) RS: the raw bytes converted in registers,
// (c) RS with block-format scales (two roundings; timing only, not checked),
// (d) (b) without the conversions (raw registers as A; timing only), and prints cycles per tile per warpgroup.
//
// Build: make -C dev/cuda build/fp8_rs (needs no GPU). Run on the device.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>

#include "fp8_host.h"  // e4m3_to_float, CK

#include "decode_common.cuh"
#include "decode_fp8_rs.cuh"  // rs_k_pair, rs_vt_pair, wgmma_rs_m64n16k16_h

namespace {

constexpr int kKeys = 64, kRow = 576, kRows = 16;  // tile keys, bytes per fp8 row, query rows (N)
// Raw tile in shared memory as the ring kernel's raw ring holds it: 5 boxes of
// 64 rows x 128 bytes, 128B-swizzled; box 0 = row bytes 448..575 (rope box),
// boxes 1-4 = bytes 0..511.
constexpr int kBox = kKeys * 128;
constexpr int kRaw = 5 * kBox;               // 40 KB
constexpr int kQChunk = kRows * 128;         // 64 dims of Q (f16): 16 rows x 128 B
constexpr int kQ = 9 * kQChunk;              // 18 KB
constexpr int kP = kRows * 128;              // P^T: 16 rows x 64 keys f16
constexpr int kChunk16 = kKeys * 128;        // a 64x64 f16 chunk (SS variant)

__device__ __forceinline__ uint32_t raw_off(int key, int byte) {  // byte 0..575 of row key
  const int box = byte < 448 ? 1 + (byte >> 7) : 0;
  const int b = byte < 448 ? (byte & 127) : byte - 448;
  return (uint32_t)(box * kBox + key * 128 + ((((b >> 4) ^ (key & 7)) & 7) << 4) + (b & 15));
}
__host__ __device__ __forceinline__ int pi16(int s) { return s < 8 ? 4 * (s >> 1) + (s & 1) : 4 * ((s - 8) >> 1) + 2 + (s & 1); }

// SS variants (f16): A K-major / A MN-major (V^T view)
__device__ __forceinline__ void wgmma_ss(float (&d)[8], uint64_t da, uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db), "r"(accum));
}
__device__ __forceinline__ void wgmma_ss_ta(float (&d)[8], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db));
}

// QK^T of one tile with A from the raw bytes: 36 k-steps in 6 batches of 6
// (two register buffers: a batch's A registers are read by its wgmmas
// asynchronously, so they are rewritten only after wait_group 1).
template <int NB>
__device__ __forceinline__ void qk_rs(float (&s)[8], uint32_t raw, uint32_t sQ, int wi, int lane) {
  uint32_t a[NB][6][4];
  const int rsel = 16 * wi + (lane & 7) + 8 * ((lane >> 3) & 1);  // this lane's ldmatrix row (key)
  const int usel = lane >> 4;                                     // 0 / 1: first / second 16-byte unit
#pragma unroll
  for (int b = 0; b < 6; b++) {  // batch b: k-steps 6b .. 6b+5 (dims 96 b .. 96 b + 95)
    uint32_t(&A)[6][4] = a[b % NB];
    if (b >= NB) wgmma_wait<NB - 1>();
#pragma unroll
    for (int j = 0; j < 6; j += 2)  // ldmatrix.x4 covers two k-steps (32 bytes)
      rs_k_pair(raw + raw_off(rsel, 16 * (6 * b + j) + 16 * usel), A[j], A[j + 1]);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 6; j++) {
      const int k = 6 * b + j;  // Q chunk k / 4, k-step k % 4 inside it
      wgmma_rs_m64n16k16_h(s, A[j], desc_sw128(sQ + (k >> 2) * kQChunk + (k & 3) * 32, 16, 1024), k > 0);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
}

// O^T += V^T P^T with A from the raw bytes: 8 m-tiles x 4 k-steps, one
// batch per m-tile (ldmatrix.x4.trans covers two k-steps), two buffers.
// Fragment rows g / g+8 of warp wi hold dims 16 wi + 2g / 2g+1 of the m-tile.
template <int NB>
__device__ __forceinline__ void pv_rs(float (&o)[8][8], uint32_t raw, uint32_t sP, int wi, int lane) {
  uint32_t a[NB][4][4];
  const int ksel = (lane & 7) + 8 * (lane >> 3);  // this lane's ldmatrix row: key 0..31 of a k-step pair
#pragma unroll
  for (int mt = 0; mt < 8; mt++) {
    uint32_t(&A)[4][4] = a[mt % NB];
    if (mt >= NB) wgmma_wait<NB - 1>();
    const int byte = 64 * mt + 16 * wi;  // this warp's 16 dims
#pragma unroll
    for (int kp = 0; kp < 2; kp++)  // keys 32 kp .. 32 kp + 31
      rs_vt_pair(raw + raw_off(32 * kp + ksel, byte), A[2 * kp], A[2 * kp + 1]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) wgmma_rs_m64n16k16_h(o[mt], A[ks], desc_sw128(sP + ks * 32, 16, 1024), 1);
    wgmma_commit();
  }
  wgmma_wait<0>();
}

// Timing only (mode 5): the same loops with the raw registers as A, no
// conversion (wrong values): what the conversions add to the chain.
__device__ __forceinline__ void qk_raw(float (&s)[8], uint32_t raw, uint32_t sQ, int wi, int lane) {
  uint32_t a[2][6][4];
  const int rsel = 16 * wi + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int usel = lane >> 4;
#pragma unroll
  for (int b = 0; b < 6; b++) {
    uint32_t(&A)[6][4] = a[b % 2];
    if (b >= 2) wgmma_wait<1>();
#pragma unroll
    for (int j = 0; j < 6; j += 2)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(A[j][0]), "=r"(A[j][1]), "=r"(A[j + 1][0]), "=r"(A[j + 1][1])
                   : "r"(raw + raw_off(rsel, 16 * (6 * b + j) + 16 * usel))
                   : "memory");
#pragma unroll
    for (int j = 0; j < 6; j++) A[j][2] = A[j][0], A[j][3] = A[j][1];
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 6; j++) {
      const int k = 6 * b + j;
      wgmma_rs_m64n16k16_h(s, A[j], desc_sw128(sQ + (k >> 2) * kQChunk + (k & 3) * 32, 16, 1024), k > 0);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
}
__device__ __forceinline__ void pv_raw(float (&o)[8][8], uint32_t raw, uint32_t sP, int wi, int lane) {
  uint32_t a[2][4][4];
  const int ksel = (lane & 7) + 8 * (lane >> 3);
#pragma unroll
  for (int mt = 0; mt < 8; mt++) {
    uint32_t(&A)[4][4] = a[mt % 2];
    if (mt >= 2) wgmma_wait<1>();
    const int byte = 64 * mt + 16 * wi;
#pragma unroll
    for (int kp = 0; kp < 2; kp++)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(A[2 * kp][0]), "=r"(A[2 * kp][1]), "=r"(A[2 * kp + 1][0]), "=r"(A[2 * kp + 1][1])
                   : "r"(raw + raw_off(32 * kp + ksel, byte))
                   : "memory");
#pragma unroll
    for (int j = 0; j < 4; j++) A[j][2] = A[j][0], A[j][3] = A[j][1];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) wgmma_rs_m64n16k16_h(o[mt], A[ks], desc_sw128(sP + ks * 32, 16, 1024), 1);
    wgmma_commit();
  }
  wgmma_wait<0>();
}

// ---- block-scaled fp8 (timing only): A values = e4m3 x a per-(key, 128-byte
// box) scale. SC 0: bf16_rn(f32(e4m3) * scale), the CPU's rounding, bf16
// wgmma; SC 1: f16 e4m3 times the scale in f16 (hmul2; a different rounding,
// and f16 range), f16 wgmma. Scales in shared memory as [4 boxes][64 keys]
// floats. (docs/decode-kernel.md §3.5.1: is the conversion's ALU cost
// affordable for the block format?)
__device__ __forceinline__ void wgmma_rs_bf16(float (&d)[8], const uint32_t (&a)[4], uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}
// four e4m3 -> two pairs, the low pair times (s0, s1), the high pair times (s2, s3)
template <int SC>
__device__ __forceinline__ void cvt4_scaled(uint32_t v, float s0, float s1, float s2, float s3, uint32_t &lo,
                                            uint32_t &hi) {
  uint32_t h0, h1;
  e4m3x4_f16x2x2(v, h0, h1);
  if constexpr (SC == 0) {
    const float2 f0 = __half22float2(*reinterpret_cast<const __half2 *>(&h0));
    const float2 f1 = __half22float2(*reinterpret_cast<const __half2 *>(&h1));
    lo = pack_bf16(f0.x * s0, f0.y * s1);
    hi = pack_bf16(f1.x * s2, f1.y * s3);
  } else {
    const __half2 a = __hmul2(*reinterpret_cast<const __half2 *>(&h0), __floats2half2_rn(s0, s1));
    const __half2 b = __hmul2(*reinterpret_cast<const __half2 *>(&h1), __floats2half2_rn(s2, s3));
    lo = *reinterpret_cast<const uint32_t *>(&a);
    hi = *reinterpret_cast<const uint32_t *>(&b);
  }
}
template <int SC>
__device__ __forceinline__ void wgmma_rs_sc(float (&d)[8], const uint32_t (&a)[4], uint64_t db, int accum) {
  if constexpr (SC == 0) wgmma_rs_bf16(d, a, db, accum);
  else wgmma_rs_m64n16k16_h(d, a, db, accum);
}
template <int SC>
__device__ __forceinline__ void qk_rs_blk(float (&s)[8], uint32_t raw, uint32_t sQ, const float *ssc, int wi,
                                          int lane) {
  uint32_t a[2][6][4];
  const int rsel = 16 * wi + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int usel = lane >> 4, kg = 16 * wi + (lane >> 2);
  float sg[4], sg8[4];  // this lane's fragment rows kg, kg + 8: their four box scales
#pragma unroll
  for (int bx = 0; bx < 4; bx++) {
    sg[bx] = ssc[bx * 64 + kg];
    sg8[bx] = ssc[bx * 64 + kg + 8];
  }
#pragma unroll
  for (int b = 0; b < 6; b++) {
    uint32_t(&A)[6][4] = a[b & 1];
    if (b >= 2) wgmma_wait<1>();
#pragma unroll
    for (int j = 0; j < 6; j += 2) {
      const int dim = 16 * (6 * b + j), bx = dim < 512 ? dim >> 7 : 3;
      uint32_t x0, x1, x2, x3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                   : "r"(raw + raw_off(rsel, dim + 16 * usel))
                   : "memory");
      cvt4_scaled<SC>(x0, sg[bx], sg[bx], sg[bx], sg[bx], A[j][0], A[j][2]);
      cvt4_scaled<SC>(x1, sg8[bx], sg8[bx], sg8[bx], sg8[bx], A[j][1], A[j][3]);
      cvt4_scaled<SC>(x2, sg[bx], sg[bx], sg[bx], sg[bx], A[j + 1][0], A[j + 1][2]);
      cvt4_scaled<SC>(x3, sg8[bx], sg8[bx], sg8[bx], sg8[bx], A[j + 1][1], A[j + 1][3]);
    }
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 6; j++) {
      const int k = 6 * b + j;
      wgmma_rs_sc<SC>(s, A[j], desc_sw128(sQ + (k >> 2) * kQChunk + (k & 3) * 32, 16, 1024), k > 0);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
}
template <int SC>
__device__ __forceinline__ void pv_rs_blk(float (&o)[8][8], uint32_t raw, uint32_t sP, const float *ssc, int wi,
                                          int lane) {
  uint32_t a[2][4][4];
  const int ksel = (lane & 7) + 8 * (lane >> 3), c2 = 2 * (lane & 3);
  float2 sk[8];  // keys 8 m + 2c, + 1 (m = 0..7) of the current box
#pragma unroll
  for (int mt = 0; mt < 8; mt++) {
    uint32_t(&A)[4][4] = a[mt & 1];
    if (mt >= 2) wgmma_wait<1>();
    if ((mt & 1) == 0)
#pragma unroll
      for (int m = 0; m < 8; m++) sk[m] = *reinterpret_cast<const float2 *>(ssc + (mt >> 1) * 64 + 8 * m + c2);
    const int byte = 64 * mt + 16 * wi;
#pragma unroll
    for (int kp = 0; kp < 2; kp++) {
      uint32_t x[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                   : "r"(raw + raw_off(32 * kp + ksel, byte))
                   : "memory");
#pragma unroll
      for (int q = 0; q < 4; q++) {  // matrix q: keys 32 kp + 8 q + 2c, + 1
        const float2 k2 = sk[4 * kp + q];
        cvt4_scaled<SC>(__byte_perm(x[q], 0, 0x3120), k2.x, k2.y, k2.x, k2.y, A[2 * kp + (q >> 1)][2 * (q & 1)],
                        A[2 * kp + (q >> 1)][2 * (q & 1) + 1]);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) wgmma_rs_sc<SC>(o[mt], A[ks], desc_sw128(sP + ks * 32, 16, 1024), 1);
    wgmma_commit();
  }
  wgmma_wait<0>();
}

// ---- check: one warpgroup, one tile --------------------------------------
// k8 [64][576] e4m3 bytes, q [16][576] f16 bits, p [16][64] f16 bits;
// s_out [16][64], o_out [16][512] fp32.
__global__ void __launch_bounds__(128) rs_check(const uint8_t *k8, const uint16_t *q, const uint16_t *p,
                                                float *s_out, float *o_out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(sm);
  const uint32_t raw = sb, sQ = sb + kRaw, sP = sQ + kQ;
  const int tid = threadIdx.x, wi = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kKeys * kRow; i += 128) sm[raw_off(i / kRow, i % kRow)] = k8[i];
  for (int i = tid; i < kRows * kRow; i += 128) {  // Q permuted within each 16-dim group
    const int r = i / kRow, s = i % kRow, d = (s & ~15) + pi16(s & 15);
    *reinterpret_cast<uint16_t *>(sm + kRaw + (s >> 6) * kQChunk + sw128_off(r, s & 63)) = q[r * kRow + d];
  }
  for (int i = tid; i < kRows * kKeys; i += 128) {
    const int r = i / kKeys, key = i % kKeys;
    *reinterpret_cast<uint16_t *>(sm + kRaw + kQ + sw128_off(r, key)) = p[i];
  }
  fence_proxy_async();
  __syncthreads();
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; i++) s[i] = 0.f;
  qk_rs<2>(s, raw, sQ, wi, lane);
  float o[8][8];
#pragma unroll
  for (int mt = 0; mt < 8; mt++)
#pragma unroll
    for (int i = 0; i < 8; i++) o[mt][i] = 0.f;
  pv_rs<2>(o, raw, sP, wi, lane);
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int row = 16 * wi + g + 8 * ((i >> 1) & 1), n = 8 * (i >> 2) + 2 * c + (i & 1);
    s_out[n * kKeys + row] = s[i];  // S^T row = key
#pragma unroll
    for (int mt = 0; mt < 8; mt++) {
      const int slot = g + 8 * ((i >> 1) & 1);
      const int dim = 64 * mt + 16 * wi + (slot < 8 ? 2 * slot : 2 * (slot - 8) + 1);
      o_out[n * 512 + dim] = o[mt][i];
    }
  }
}

// ---- timing: every SM, two warpgroups, smem-resident tiles ---------------
// mode 0: SS (f16 tiles: 9 chunks per warpgroup), mode 1 / 2: RS from the raw
// bytes with two / three A register buffers; mode 3 / 4: block-scaled RS
// (SC 0 / 1 above), a 1 KB scale table per warpgroup after the P^T; mode 5:
// mode 1 with the raw registers as A, no conversion (wrong values). cycles[cta * NWG + wg] = clock64 cycles of the loop.
// NWG warpgroups per CTA (session 14: does a third consumer warpgroup add
// throughput?); warpgroup w works on tile slot w % 2 (two tiles in shared
// memory, read concurrently by the warpgroups sharing one: timing only).
template <int MODE, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) rs_time(int tiles, long long *cycles, float *sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(sm);
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  // per warpgroup: tile (raw 40 KB or f16 72 KB), then Q 18 KB and P^T 2 KB shared by both
  const uint32_t tileb = MODE == 0 ? 9 * kChunk16 : kRaw;
  const uint32_t tile = sb + (wg & 1) * tileb, sQ = sb + 2 * tileb, sP = sQ + kQ + wg * kP;
  // small values everywhere (e4m3 0x30 = 0.5; f16 0x3800 = 0.5): no overflow
  for (uint32_t i = tid * 4; i < 2 * tileb; i += 128 * NWG * 4)
    *reinterpret_cast<uint32_t *>(sm + i) = MODE == 0 ? 0x38003800u : 0x30303030u;
  for (uint32_t i = tid * 4; i < kQ + NWG * kP; i += 128 * NWG * 4) *reinterpret_cast<uint32_t *>(sm + 2 * tileb + i) = 0x38003800u;
  float *ssc = reinterpret_cast<float *>(sm + 2 * tileb + kQ + NWG * kP) + wg * 256;  // [4][64] scales (modes 3, 4)
  for (int i = t128; i < 256; i += 128) ssc[i] = 0.5f;
  fence_proxy_async();
  __syncthreads();
  float o[8][8];
#pragma unroll
  for (int mt = 0; mt < 8; mt++)
#pragma unroll
    for (int i = 0; i < 8; i++) o[mt][i] = 0.f;
  float acc = 0.f;
  const long long t0 = clock64();
  for (int t = 0; t < tiles; t++) {
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; i++) s[i] = 0.f;
    if constexpr (MODE == 5) {
      qk_raw(s, tile, sQ, wi, lane);
    } else if constexpr (MODE >= 3) {
      qk_rs_blk<MODE - 3>(s, tile, sQ, ssc, wi, lane);
    } else if constexpr (MODE >= 1) {
      qk_rs<MODE == 1 ? 2 : 3>(s, tile, sQ, wi, lane);
    } else {
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 9; k++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
          wgmma_ss(s, desc_sw128(tile + k * kChunk16 + kk * 32, 16, 1024),
                   desc_sw128(sQ + k * kQChunk + kk * 32, 16, 1024), k > 0 || kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
    }
    reg_fence(s);
    // a stand-in for the softmax: P^T = s (f16) through shared memory
#pragma unroll
    for (int i = 0; i < 8; i++) acc += s[i];
    if (lane < 16)
      *reinterpret_cast<uint32_t *>(sm + (sP - sb) + sw128_off(lane, 16 * wi + 2 * (t & 7))) = pack_f16(s[0] * 1e-3f, s[1] * 1e-3f);
    fence_proxy_async();
    named_bar_sync(1 + wg, 128);
    if constexpr (MODE == 5) {
      pv_raw(o, tile, sP, wi, lane);
    } else if constexpr (MODE >= 3) {
      pv_rs_blk<MODE - 3>(o, tile, sP, ssc, wi, lane);
    } else if constexpr (MODE >= 1) {
      pv_rs<MODE == 1 ? 2 : 3>(o, tile, sP, wi, lane);
    } else {
      wgmma_fence();
#pragma unroll
      for (int mt = 0; mt < 8; mt++) {
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
          wgmma_ss_ta(o[mt], desc_sw128(tile + mt * kChunk16 + ks * 2048, 8192, 1024), desc_sw128(sP + ks * 32, 16, 1024));
        if (mt & 1) wgmma_commit();
      }
      wgmma_wait<0>();
    }
#pragma unroll
    for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
    named_bar_sync(1 + wg, 128);
  }
  const long long t1 = clock64();
  if (t128 == 0) cycles[blockIdx.x * NWG + wg] = t1 - t0;
#pragma unroll
  for (int mt = 0; mt < 8; mt++)
#pragma unroll
    for (int i = 0; i < 8; i++) acc += o[mt][i];
  if (acc == 12345.f) sink[tid] = acc;
}

float h2f(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? ldexpf((float)m, -24) : ldexpf(1.f + m / 1024.f, e - 15);
  return s ? -v : v;
}
uint16_t f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }


int run_check() {
  srand(7);
  std::vector<uint8_t> k8(kKeys * kRow);
  std::vector<uint16_t> q(kRows * kRow), p(kRows * kKeys);
  for (auto &b : k8) {
    b = (uint8_t)(rand() & 0xff);
    if (((b >> 3) & 15) == 15 && (b & 7) == 7) b ^= 1;  // no NaN codes
  }
  for (auto &h : q) h = f2h((rand() / (float)RAND_MAX - 0.5f) * 2.f);
  for (auto &h : p) h = f2h(rand() / (float)RAND_MAX);
  uint8_t *dk;
  uint16_t *dq, *dp;
  float *ds, *dout;
  CK(cudaMalloc(&dk, k8.size()));
  CK(cudaMalloc(&dq, q.size() * 2));
  CK(cudaMalloc(&dp, p.size() * 2));
  CK(cudaMalloc(&ds, kRows * kKeys * 4));
  CK(cudaMalloc(&dout, kRows * 512 * 4));
  CK(cudaMemcpy(dk, k8.data(), k8.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice));
  const int smem = kRaw + kQ + kP + 1024;
  CK(cudaFuncSetAttribute(rs_check, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  rs_check<<<1, 128, smem>>>(dk, dq, dp, ds, dout);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> s(kRows * kKeys), o(kRows * 512);
  CK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
  double es = 0, eo = 0, ms = 0, mo = 0;
  for (int n = 0; n < kRows; n++) {
    for (int key = 0; key < kKeys; key++) {
      double r = 0;
      for (int d = 0; d < kRow; d++) r += (double)e4m3_to_float(k8[key * kRow + d]) * h2f(q[n * kRow + d]);
      es = fmax(es, fabs(r - s[n * kKeys + key]));
      ms = fmax(ms, fabs(r));
    }
    for (int d = 0; d < 512; d++) {
      double r = 0;
      for (int key = 0; key < kKeys; key++) r += (double)e4m3_to_float(k8[key * kRow + d]) * h2f(p[n * kKeys + key]);
      eo = fmax(eo, fabs(r - o[n * 512 + d]));
      mo = fmax(mo, fabs(r));
    }
  }
  const bool ok = es <= 1e-5 * ms && eo <= 1e-5 * mo;
  printf("check: S max |err| %.3g (max |S| %.3g), O max |err| %.3g (max |O| %.3g): %s\n", es, ms, eo, mo,
         ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

template <int MODE, int NWG = 2>
int run_time(int tiles) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int tileb = MODE == 0 ? 9 * kChunk16 : kRaw;
  const int smem = 2 * tileb + kQ + NWG * kP + NWG * 1024 + 1024;
  long long *dc;
  float *sink;
  CK(cudaMalloc(&dc, sms * NWG * 8));
  CK(cudaMalloc(&sink, 128 * NWG * 4));
  CK(cudaFuncSetAttribute(rs_time<MODE, NWG>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int rep = 0; rep < 3; rep++) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    rs_time<MODE, NWG><<<sms, 128 * NWG, smem>>>(tiles, dc, sink);
    cudaEventRecord(e1);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    std::vector<long long> c(sms * NWG);
    CK(cudaMemcpy(c.data(), dc, c.size() * 8, cudaMemcpyDeviceToHost));
    double avg = 0;
    for (long long v : c) avg += (double)v;
    avg /= c.size();
    printf("time %s, %d WG: %d tiles per warpgroup, %.1f us, %.0f cycles per tile per warpgroup, %.0f per tile per SM (%.3f us per tile per CTA)\n",
           MODE == 0   ? "SS f16 tile "
           : MODE == 1 ? "RS raw fp8 2 buffers"
           : MODE == 2 ? "RS raw fp8 3 buffers"
           : MODE == 3 ? "RS block fp8, exact bf16"
           : MODE == 4 ? "RS block fp8, f16 hmul2"
                       : "RS raw bits, no conversion (timing only)", NWG, tiles, ms * 1e3, avg / tiles, avg / tiles / NWG,
           ms * 1e3 / ((double)NWG * tiles));
  }
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  const char *what = argc > 1 ? argv[1] : "check";
  if (!strcmp(what, "check")) return run_check();
  const int tiles = argc > 2 ? atoi(argv[2]) : 2000;
  if (!strcmp(what, "wgs")) {  // modes 0 / 1 / 5 with 1-4 warpgroups per CTA
    if (run_time<0, 1>(tiles) || run_time<0, 2>(tiles) || run_time<0, 3>(tiles) || run_time<0, 4>(tiles)) return 1;
    if (run_time<1, 1>(tiles) || run_time<1, 2>(tiles) || run_time<1, 3>(tiles) || run_time<1, 4>(tiles)) return 1;
    return run_time<5, 1>(tiles) || run_time<5, 2>(tiles) || run_time<5, 3>(tiles) || run_time<5, 4>(tiles);
  }
  if (run_time<0>(tiles)) return 1;
  if (run_time<1>(tiles)) return 1;
  if (run_time<2>(tiles)) return 1;
  if (run_time<3>(tiles)) return 1;
  if (run_time<4>(tiles)) return 1;
  return run_time<5>(tiles);
}
