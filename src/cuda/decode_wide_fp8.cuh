// The wide kernel's fp8 math mode (MLA_FLAG_FP8_MATH; docs/decode-kernel.md
// §12): a per-tensor e4m3 cache at m-blocks of 64 rows, with Q.K^T and P.V on
// fp8 tensor cores (wgmma e4m3 x e4m3 -> f32, twice the bf16 rate).
//  - K is used as TMA lands it (raw e4m3, 128B-swizzled 128-byte boxes):
//    fp8 wgmma needs both operands K-major, and a cache row is K-major for
//    Q.K^T. The rope box is the row's bytes 448..575 (rope at 64..127 of the
//    box), so every chunk has the one verified layout.
//  - Q is quantized per request and m-block to e4m3 with a power-of-two
//    scale 2^e (largest |q| in (224, 448]); 2^-e and the cache's scale go
//    into the score factor.
//  - P' = 2^(s - m + 4) <= 2^8 (the running max moves lazily by > 4) is
//    rounded to e4m3; the row sums are the fp32 P'. Storing m - 4 as the
//    running max keeps lse = m + log2(l) exact.
//  - P.V needs V K-major (keys contiguous per dim): each warpgroup writes
//    V^T of its 256 output dims of both tiles of a pair into a 32 KB buffer
//    per tile (ldmatrix.trans, two byte permutes, stmatrix; transpose_v),
//    the first one while its own Q.K^T runs. Keys inside each 16-key block
//    are permuted the way the S accumulator holds them, so P's A fragments
//    are packed straight from S (pack_p8).
//  - The schedule is the wide kernel's seesaw (decode_sm90.cu, ladder v9);
//    a K buffer is refilled as soon as its Q.K^T and its two transposes are
//    done (not after the P.V, as V now lives in the V^T buffers).
#pragma once

#include "decode_seesaw.cuh"
#include "decode_wgmma_fp8.cuh"

namespace seesaw {

// Shared memory of the fp8 math kernel (offsets from a 1024-aligned base).
struct W8 {
  static constexpr uint32_t kOffQ = 0;                     // Q e4m3: chunks 0-3 latent (128 dims each), 4 rope (bytes 64..127)
  static constexpr uint32_t kOffB0 = 5 * kChunk;           // raw tile: chunks 0-3 latent, 4 = row bytes 448..575
  static constexpr uint32_t kOffB1 = kOffB0 + 5 * kChunk;
  static constexpr uint32_t kOffV0 = kOffB1 + 5 * kChunk;  // V^T of B0's tile: 256 rows x 128 B (dims d and 256 + d)
  static constexpr uint32_t kOffV1 = kOffV0 + 4 * kChunk;  // V^T of B1's tile
  static constexpr uint32_t kOffP = kOffV1 + 4 * kChunk;   // two P tiles, 64 rows x 128 B (bytes 0..63 used)
  static constexpr uint32_t kOffM = kOffP + 2 * kChunk;    // float[64] running max - 4 (log2 units)
  static constexpr uint32_t kOffS0 = kOffM + 256;          // float[64]
  static constexpr uint32_t kOffS1 = kOffS0 + 256;         // float[64]
  static constexpr uint32_t kOffL = kOffS1 + 256;          // float[2][64]
  static constexpr uint32_t kOffLim = kOffL + 512;         // int[64]
  static constexpr uint32_t kOffRed = kOffLim + 256;       // float[8]: |q| maxima per warp
  static constexpr uint32_t kOffBar = kOffRed + 32;        // 6 mbarriers: [buf][latent 0-255, 256-511, rope]
  static constexpr uint32_t kSmem = kOffBar + 6 * 8 + 1024;  // + alignment slack
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");
  static_assert(kOffP - kOffV0 == 65536, "the epilogue stages 64 rows x 1 KB over V^T");
  static_assert(kSmem <= 232448, "over the opt-in shared memory of sm_90");
};

// Lazy max of the fp8 kernel: P' <= 2^(kPOff8 + kLazy8) = 256 < 448 (e4m3 max).
constexpr float kLazy8 = 4.f, kPOff8 = 4.f;
__device__ __forceinline__ float lazy_max8(float mp, float x) {
  const float c = x - kPOff8;  // the stored max is 4 below the row max: P' = 16 P
  return c > mp + kLazy8 ? c : mp;
}

// Four floats -> four e4m3 (byte 0 = a), round to nearest even, saturating.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// P' (64 rows x 64 keys in the S accumulator layout) times f (row A / B) ->
// the two k32 A fragments of P.V. Fragment kk, register j: row rA (j even)
// or rB (j odd), logical k 4q..4q+3 (j < 2) or 16 + 4q.. (j >= 2) of the
// step, i.e. keys 32 kk + 16 (j >> 1) + {2q, 2q + 1, 8 + 2q, 9 + 2q}: what
// the thread holds of S, so no data moves; transpose_v lays V^T out in the
// same key order.
__device__ __forceinline__ void pack_p8(uint32_t (&pa)[2][4], const float (&s)[32], float fA, float fB) {
#pragma unroll
  for (int kk = 0; kk < 2; kk++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int b = 16 * kk + 8 * (j >> 1) + 2 * (j & 1);
      const float f = (j & 1) ? fB : fA;
      pa[kk][j] = e4m3x4(s[b] * f, s[b + 1] * f, s[b + 4] * f, s[b + 5] * f);
    }
}
// The fragments into one swizzled P tile (64 rows x 64 keys of e4m3 in bytes
// 0..63 of 128-byte rows) for the other warpgroup's SS P.V: per k32 step one
// stmatrix.x4 (4-byte words of a row = two b16; the same geometry as
// store_p's k16 steps of bf16).
__device__ __forceinline__ void store_p8(uint32_t sP, const uint32_t (&pa)[2][4], int wi, int lane) {
  const int mat = lane >> 3;
  const int r = 16 * wi + (lane & 7) + 8 * (mat & 1);
#pragma unroll
  for (int kk = 0; kk < 2; kk++)
    stsm_x4(sP + sw128_off(r, 16 * kk + 8 * (mat >> 1)), pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
}
__device__ __forceinline__ void keep_alive8(const uint32_t (&pa)[2][4]) {
#pragma unroll
  for (int k = 0; k < 2; k++)
#pragma unroll
    for (int j = 0; j < 4; j++) asm volatile("" ::"r"(pa[k][j]) : "memory");
}

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

// TMA refill of one group of a raw tile: g 0 = latent 0-255 (chunks 0, 1),
// 1 = latent 256-511 (chunks 2, 3), 2 = row bytes 448..575 (chunk 4: the
// rope at 64..127). Boxes of min(P, 64) rows of the swizzled byte map; with
// P < 64 the tile's boxes land at row b P (those past the piece skipped).
__device__ __forceinline__ void load8_group(const mla_decode_params &p, const CUtensorMap *map, const TileSrc &s,
                                            uint32_t kbuf, uint32_t bar, int g) {
  const int P = p.page_size, lp = __ffs(P) - 1;
  const bool big = P >= 64;
  const int rows = big ? 64 : P;
  const int nbox = big ? 1 : (s.nvalid + P - 1) >> lp;
  const int c0 = g == 2 ? 4 : 2 * g, nc = g == 2 ? 1 : 2;
  const int *bt = p.block_table + (size_t)s.req * p.block_table_width + (s.kt0 >> lp);
  mbar_expect_tx(bar, (uint32_t)(nbox * nc * rows * 128));
#pragma unroll 1
  for (int b = 0; b < nbox; b++) {
    const int page = big ? s.page : bt[b], r0 = big ? s.row0 : 0;
    for (int c = c0; c < c0 + nc; c++)
      tma_load_3d(kbuf + c * kChunk + b * rows * 128, map, bar, c == 4 ? 448 : 128 * c, r0, page);
  }
}

// S = Q K^T of one tile (18 wgmma m64n64k32: the rope's two k-steps, then
// the warpgroup's own latent half, then the other), and while they run this
// warpgroup's half of the tile's V^T (its own half was waited for first).
template <int WG>
__device__ __forceinline__ void qk8_tile(float (&s)[32], uint32_t sq, uint32_t kb, uint32_t bars, uint32_t par,
                                         uint32_t vt, int nvalid, int wi, int lane) {
  const uint64_t dq = desc_sw128(sq, 16, 1024), dk = desc_sw128(kb, 16, 1024);
#pragma unroll
  for (int i = 0; i < 32; i++) s[i] = 0.f;
  mbar_wait(bars + 16, par);
  wgmma_fence();
#pragma unroll
  for (int k = 2; k < 4; k++) {
    const uint32_t off = (4 * kChunk + 32 * k) >> 4;
    wgmma_m64n64k32_ss_e4m3(s, dq + off, dk + off, 1);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int g = WG == 0 ? h : 1 - h;
    mbar_wait(bars + 8 * g, par);
    wgmma_fence();
#pragma unroll
    for (int c = 2 * g; c < 2 * g + 2; c++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t off = (c * kChunk + 32 * k) >> 4;
        wgmma_m64n64k32_ss_e4m3(s, dq + off, dk + off, 1);
      }
  }
  wgmma_commit();
  transpose_v(kb, vt, WG, nvalid, wi, lane);
  fence_proxy_async();
  wgmma_wait<0>();
  reg_fence(s);
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

// |x| of 8 bf16 (one 16-byte piece) as a float maximum.
__device__ __forceinline__ float absmax8_bf16(uint4 v) {
  const uint32_t x[4] = {v.x, v.y, v.z, v.w};
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < 4; k++)
    m = fmaxf(m, fmaxf(__uint_as_float((x[k] & 0x7fffu) << 16), __uint_as_float(x[k] & 0x7fff0000u)));
  return m;
}

// Per request: Q rows of the m-block (bf16) -> e4m3 x 2^e in the swizzled Q
// chunks (rows past the m-block zero), row limits, running max reset; 2^e
// puts the largest |q| in (224, 448]. Returns 2^-e. All 256 threads; the
// caller syncs before (the last request is done with Q) and after. Each
// thread loads its 18 pieces at once (one round trip to L2; a loop of
// dependent loads, read twice, took ~15 % of the kernel's stall samples),
// keeps them in registers over the block reduction, then converts them.
template <class L>
__device__ __forceinline__ float load_q8(const mla_decode_params &p, const ReqWork &w, int mb, uint32_t sq,
                                         uint8_t *smem, int tid) {
  constexpr int kPer = 64 * 72 / kThreads;  // 16-byte pieces per thread (64 rows x 72)
  static_assert(kPer * kThreads == 64 * 72, "pieces split evenly");
  const int H = p.num_heads;
  uint4 v[kPer];
  float mx = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kThreads, r = ci / 72, pc = ci - r * 72;
    v[i] = make_uint4(0, 0, 0, 0);
    if (r < w.rows) {
      const int rg = mb * 64 + r, t = rg / H, h = rg % H;
      const uint16_t *src = pc < 64 ? p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + pc * 8
                                    : p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head +
                                          (pc - 64) * 8;
      v[i] = *reinterpret_cast<const uint4 *>(src);
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; i++) mx = fmaxf(mx, absmax8_bf16(v[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float *red = reinterpret_cast<float *>(smem + L::kOffRed);
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  int *lim = reinterpret_cast<int *>(smem + L::kOffLim);
  float *sM = reinterpret_cast<float *>(smem + L::kOffM);
  if (tid < 64) {
    lim[tid] = tid < w.rows ? row_limit(p, w, mb, tid) : 0;  // padding rows see no key
    sM[tid] = -INFINITY;
  }
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; i++) m = fmaxf(m, red[i]);
  // (NaN never wins fmaxf; inf or 0 keep the scale at 1: NaN / inf or zero
  // scores come out either way.)
  int e = 0;
  if (m > 0.f && m <= 3.0e38f) {
    const uint32_t b = __float_as_uint(m);
    const int x = (int)(b >> 23) - 127;  // m = f 2^x, f in [1, 2) (subnormal m: clamped below)
    e = ((b & 0x7fffffu) <= 0x600000u ? 8 : 7) - x;  // f <= 1.75: m 2^e in (224, 448]
    e = min(max(e, -120), 120);
  }
  const float up = __uint_as_float((uint32_t)(127 + e) << 23);
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kThreads, r = ci / 72, pc = ci - r * 72;
    const uint4 x = v[i];  // (zero past the m-block's rows)
    const uint32_t y0 = e4m3x4(__uint_as_float(x.x << 16) * up, __uint_as_float(x.x & 0xffff0000u) * up,
                               __uint_as_float(x.y << 16) * up, __uint_as_float(x.y & 0xffff0000u) * up);
    const uint32_t y1 = e4m3x4(__uint_as_float(x.z << 16) * up, __uint_as_float(x.z & 0xffff0000u) * up,
                               __uint_as_float(x.w << 16) * up, __uint_as_float(x.w & 0xffff0000u) * up);
    // 8 bytes at dims 8 pc: latent chunk pc / 16, 16-byte unit (pc % 16) / 2;
    // rope (pc >= 64) at bytes 64 + 8 (pc - 64) of chunk 4
    const int ch = pc < 64 ? pc >> 4 : 4, u = pc < 64 ? (pc & 15) >> 1 : 4 + ((pc - 64) >> 1);
    const uint32_t addr = sq + ch * kChunk + r * 128 + ((u ^ (r & 7)) << 4) + 8 * (pc & 1);
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(y0), "r"(y1) : "memory");
  }
  fence_proxy_async();
  return __uint_as_float((uint32_t)(127 - e) << 23);
}

}  // namespace seesaw
