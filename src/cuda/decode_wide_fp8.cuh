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
//  - P.V runs in the O^T form: O^T = V^T P^T, with V^T loaded straight from
//    the raw K tile into registers as the A operand (ldmatrix.trans and
//    byte permutes: vt_frags) and P as the K-major B operand from shared
//    memory. Keys inside each 16-key block are permuted the way the S
//    accumulator holds them, so P's tiles are packed straight from S
//    (pack_p8). No V^T buffers; three K buffers (W8T).
//  - The schedule is the wide kernel's seesaw (decode_sm90.cu, ladder v9).
//  - The transposing kernel this replaced (V^T written to shared memory per
//    tile, two K buffers; session 7 to 27) is
//    dev/cuda/variants/s28-wide8-transposing.patch; dev/cuda/fp8_ot_base.cuh
//    keeps its P.V building blocks for the fp8_ot timing.
#pragma once

#include "decode_seesaw.cuh"
#include "decode_wgmma_fp8.cuh"

namespace seesaw {

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
// two k32 fragments of e4m3 (store_p8 writes them as a P tile). Fragment kk, register j: row rA (j even)
// or rB (j odd), logical k 4q..4q+3 (j < 2) or 16 + 4q.. (j >= 2) of the
// step, i.e. keys 32 kk + 16 (j >> 1) + {2q, 2q + 1, 8 + 2q, 9 + 2q}: what
// the thread holds of S, so no data moves; vt_frags loads V^T in the same
// key order.
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
// 0..63 of 128-byte rows), the K-major B operand of O^T += V^T P^T: per k32 step one
// stmatrix.x4 (4-byte words of a row = two b16; the same geometry as
// store_p's k16 steps of bf16).
__device__ __forceinline__ void store_p8(uint32_t sP, const uint32_t (&pa)[2][4], int wi, int lane) {
  const int mat = lane >> 3;
  const int r = 16 * wi + (lane & 7) + 8 * (mat & 1);
#pragma unroll
  for (int kk = 0; kk < 2; kk++)
    stsm_x4(sP + sw128_off(r, 16 * kk + 8 * (mat >> 1)), pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
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

// load8_group for the pair loop's refills, called by lane 0 of every warp of
// the warpgroup that holds s (page >= 64) or of its warp 0 (smaller pages,
// which take load8_group whole). At page >= 64 a group's one or two boxes go
// from lane 0 of warps w0 and w0 + 1 (mod 4) side by side, since a TMA issue
// stalls its warp ~200-300 cycles beside busy warpgroups (docs/decode-kernel.md
// §12); warp w0 posts the group's expect_tx, the barrier's one arrival, so a
// box of the other warp that completes first cannot end the phase (tx-count
// may go below zero until then). Callers pass different w0 to back-to-back
// calls. 4-7 % faster than one issuing thread at b=128 H=128 (bench/RESULTS.md
// session 31 run 1).
__device__ __forceinline__ void refill8_group(const mla_decode_params &p, const CUtensorMap *map, const TileSrc &s,
                                              uint32_t kbuf, uint32_t bar, int g, int wi, int w0) {
  if (p.page_size < 64) {
    load8_group(p, map, s, kbuf, bar, g);
    return;
  }
  const int c0 = g == 2 ? 4 : 2 * g, nc = g == 2 ? 1 : 2, i = (wi - w0) & 3;
  if (i == 0) mbar_expect_tx(bar, (uint32_t)(nc * 64 * 128));
  if (i < nc) tma_load_3d(kbuf + (c0 + i) * kChunk, map, bar, c0 + i == 4 ? 448 : 128 * (c0 + i), s.row0, s.page);
}

// The Q.K^T of one tile issued (18 wgmma m64n64k32: the rope's two k-steps,
// then the warpgroup's own latent half, then the other), not waited for: the
// caller works under it, then waits (wgmma_wait<0>, reg_fence(s)).
__device__ __forceinline__ void qk8_tile_nt_issue(float (&s)[32], uint32_t sq, uint32_t kb, uint32_t bars,
                                                  uint32_t par, int wg) {
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
    const int g = wg == 0 ? h : 1 - h;
    mbar_wait(bars + 8 * g, par);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t off = ((2 * g + c) * kChunk + 32 * k) >> 4;
        wgmma_m64n64k32_ss_e4m3(s, dq + off, dk + off, 1);
      }
  }
  wgmma_commit();
}

// ---- the O^T form (decode_wide8t_kernel; docs/decode-kernel.md §4, §12) ----
// O^T[256 x 64] += V^T P^T per warpgroup: V^T from registers as the A operand
// of wgmma m64n64k32 (four m-tiles of 64 dims), P the K-major B from shared
// memory. No V^T buffers, and a K buffer's latent half is free once its
// fragments are loaded; the 64 KB they took hold a third K buffer, and the
// epilogue stages its rows over Q and the P tiles (free at a request's end).
struct W8T {
  static constexpr uint32_t kOffQ = 0;                        // Q e4m3: chunks 0-3 latent (128 dims each), 4 rope (bytes 64..127)
  static constexpr uint32_t kOffPa = 5 * kChunk;              // P0 (WG0's own P.V)
  static constexpr uint32_t kOffPb = kOffPa + kChunk;         // P1, two by pair parity (both warpgroups read it)
  static constexpr uint32_t kOffPc = kOffPb + 2 * kChunk;     // P0' = s1 P0 (WG1's P0' V0_R)
  static constexpr uint32_t kOffStage = 0;                    // the epilogue's 64 rows x 1 KB over Q, P0 and P1
  static constexpr uint32_t kOffB0 = kOffPc + kChunk;         // three K buffers: tile g of a part in g % 3
  static constexpr uint32_t kBuf = 5 * kChunk;
  static constexpr uint32_t kOffM = kOffB0 + 3 * kBuf;
  static constexpr uint32_t kOffS0 = kOffM + 256;   // float[2][64] by pair parity: the rescales of O^T read
  static constexpr uint32_t kOffS1 = kOffS0 + 512;  // every row's factor after the hand-off that frees them
  static constexpr uint32_t kOffL = kOffS1 + 512;
  static constexpr uint32_t kOffLim = kOffL + 512;
  static constexpr uint32_t kOffRed = kOffLim + 256;
  static constexpr uint32_t kOffBar = kOffRed + 32;           // 9 mbarriers: [buffer][latent 0-255, 256-511, rope]
  static constexpr uint32_t kSmem = kOffBar + 9 * 8 + 1024;
  static_assert(kOffPc + kChunk >= 8 * kChunk && kOffB0 % 1024 == 0, "staging fits below the K buffers");
  static_assert(kSmem <= 232448, "over the opt-in shared memory of sm_90");
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");
};

// O^T[64 x 64] (+)= A[64 x 32] (registers) * B[32 x 64] (smem desc, K-major), e4m3.
__device__ __forceinline__ void wgmma_m64n64k32_rs_e4m3(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// V^T fragments of one tile for this warpgroup's 256 dims (half): per m-tile
// (64 dims) and k32 step one ldmatrix.x4.trans of the raw tile at kb (keys
// 32 kk + 8 i .. of matrix i, the warp's 16-byte dim unit) and four byte
// permutes: fragment row g = dim 2g, row g + 8 = dim 2g + 1 of the warp's 16;
// logical k 4c..4c + 3 = keys {2c, 2c + 1, 8 + 2c, 9 + 2c} (pack_p8's order).
// Keys >= nvalid become 0 (past the piece: NaN possible).
__device__ __forceinline__ void vt_frags(uint32_t kb, int half, int nvalid, int wi, int lane, uint32_t (&a)[4][2][4]) {
  const int c = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
      const int key = 32 * kk + 8 * (lane >> 3) + (lane & 7);
      const int unit = 4 * (mt & 1) + wi;  // 16-byte unit of dims 256 half + 64 mt + 16 wi in chunk 2 half + mt / 2
      uint32_t r[4];
      ldsm_x4_trans(kb + (2 * half + (mt >> 1)) * kChunk + key * 128 + (((unit ^ (key & 7)) & 7) << 4), r);
      a[mt][kk][0] = __byte_perm(r[0], r[1], 0x6420);
      a[mt][kk][1] = __byte_perm(r[0], r[1], 0x7531);
      a[mt][kk][2] = __byte_perm(r[2], r[3], 0x6420);
      a[mt][kk][3] = __byte_perm(r[2], r[3], 0x7531);
    }
  if (nvalid < 64) {
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int k0 = 32 * kk + 16 * h + 2 * c;
        const uint32_t keep = (k0 < nvalid ? 0xffu : 0u) | (k0 + 1 < nvalid ? 0xff00u : 0u) |
                              (k0 + 8 < nvalid ? 0xff0000u : 0u) | (k0 + 9 < nvalid ? 0xff000000u : 0u);
#pragma unroll
        for (int mt = 0; mt < 4; mt++) {
          a[mt][kk][2 * h] &= keep;
          a[mt][kk][2 * h + 1] &= keep;
        }
      }
  }
}
__device__ __forceinline__ void keep_alive_a(const uint32_t (&a)[4][2][4]) {
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
      for (int j = 0; j < 4; j++) asm volatile("" ::"r"(a[mt][kk][j]) : "memory");
}
template <int N>
__device__ __forceinline__ void reg_fence2(float (&r)[4][N]) {
#pragma unroll
  for (int mt = 0; mt < 4; mt++) reg_fence(r[mt]);
}
// O^T += V^T P^T of one tile (P at sP: 64 rows x 64 keys), left in flight.
__device__ __forceinline__ void pv8_ot(float (&o)[4][32], const uint32_t (&a)[4][2][4], uint32_t sP) {
  wgmma_fence();
#pragma unroll
  for (int mt = 0; mt < 4; mt++)
#pragma unroll
    for (int kk = 0; kk < 2; kk++) wgmma_m64n64k32_rs_e4m3(o[mt], a[mt][kk], desc_sw128(sP + 32 * kk, 16, 1024));
  wgmma_commit();
}
// O^T's columns (the m-block's rows 8 j + 2c + e) times per-row factors f
// from shared memory (f1 != nullptr: times f1 too).
__device__ __forceinline__ void rescale_ot(float (&o)[4][32], const float *f0, const float *f1, int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int n = 8 * j + 2 * c + e;
      const float f = f1 ? f0[n] * f1[n] : f0[n];
#pragma unroll
      for (int mt = 0; mt < 4; mt++) {
        o[mt][4 * j + e] *= f;
        o[mt][4 * j + 2 + e] *= f;
      }
    }
}

// Epilogue of one request for O^T (the wide epilogue's arithmetic): l = both
// warpgroups' partial sums; rows staged at st (64 x 1 KB, staged_off) and
// written out in whole 16-byte units. Element (mt, 4 j + 2 h + e) of a thread
// is row 8 j + 2c + e, dim 256 wg + 64 mt + 16 wi + 2g + h: the pair h = 0, 1
// is two adjacent dims, stored together.
__device__ __forceinline__ void epilogue_ot(const mla_decode_params &p, const ReqWork &w, int mb, uint8_t *smem,
                                            const float (&o)[4][32], float lsA, float lsB, int wg, int wi, int lane,
                                            int rA, int rB, bool lead, float osc) {
  float *sL = reinterpret_cast<float *>(smem + W8T::kOffL);
  const float *sM = reinterpret_cast<const float *>(smem + W8T::kOffM);
  publish_row_sums(sL, lsA, lsB, wg, rA, rB, lead);
  __syncthreads();
  const int g = lane >> 2, c = lane & 3;
  float inv[16];
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int n = 8 * j + 2 * c + e;
      const float t = sL[n] + sL[64 + n];
      inv[2 * j + e] = t > 0.f ? osc / t : 0.f;
    }
  uint8_t *st = smem + W8T::kOffStage;
  // element (mt, 4 j + 2 h + e): row 8 j + 2c + e, dim 64 mt + 16 wi + 2g + h of this warpgroup's 256
  auto each = [&](auto put) {
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float f = inv[2 * j + e];
          put(8 * j + 2 * c + e, 64 * mt + 16 * wi + 2 * g, o[mt][4 * j + e] * f, o[mt][4 * j + 2 + e] * f);
        }
  };
  write_rows_staged(
      p, w, mb, st, wg,
      [&] {  // bf16 rows, both warpgroups' halves
        each([&](int n, int d, float x, float y) {
          *reinterpret_cast<uint32_t *>(st + staged_off(n, (256 * wg + d) >> 3) + 2 * (d & 7)) = pack2<false>(x, y);
        });
      },
      [&] {  // fp32, this warpgroup's half
        each([&](int n, int d, float x, float y) {
          *reinterpret_cast<float2 *>(st + staged_off(n, d >> 2) + 4 * (d & 3)) = make_float2(x, y);
        });
      });
  if (wg == 0 && lead) store_row_lses(p, w, mb, sM, rA, rB, sL[rA] + sL[64 + rA], sL[rB] + sL[64 + rB]);
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
  float *red = reinterpret_cast<float *>(smem + W8T::kOffRed);
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  int *lim = reinterpret_cast<int *>(smem + W8T::kOffLim);
  float *sM = reinterpret_cast<float *>(smem + W8T::kOffM);
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
