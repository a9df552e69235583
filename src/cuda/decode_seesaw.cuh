// Pieces of the sm_90a decode kernels (decode_sm90.cu), copied from the
// ladder's dev/cuda/seesaw.cuh and trimmed to what v9/v10 use: shared-memory
// layout of the wide kernel, per-buffer tile cursors, grouped TMA refills
// with the page id fetched ahead, the QK^T of one tile, lazy-rescale softmax
// helpers, the P store with stmatrix, and the PDL trigger.
#pragma once

#include "decode_common.cuh"
#include "decode_wgmma.cuh"

namespace seesaw {

constexpr int kThreads = 256;
constexpr uint32_t kChunk = 8192;  // 64 rows x 128 B, one 128B-swizzled sub-tile
constexpr uint32_t kTile = 9 * kChunk;
constexpr uint32_t kOffQ = 0;  // Q latent: 8 chunks (rope lives in registers)
constexpr uint32_t kOffB0 = 8 * kChunk;
constexpr uint32_t kOffB1 = kOffB0 + kTile;
constexpr uint32_t kOffP = kOffB1 + kTile;  // two P tiles, roles swap every pair
constexpr uint32_t kOffM = kOffP + 2 * kChunk;  // float[64] running max (log2 units)
constexpr uint32_t kOffS0 = kOffM + 256;        // float[64] scale of tile 0 of the pair
constexpr uint32_t kOffS1 = kOffS0 + 256;       // float[64] scale of tile 1
constexpr uint32_t kOffL = kOffS1 + 256;        // float[2][64]
constexpr uint32_t kOffLim = kOffL + 512;       // int[64]
constexpr uint32_t kOffBar = kOffLim + 256;     // 18 mbarriers: full[buf][chunk]
constexpr uint32_t kSmemBytes = kOffBar + 18 * 8 + 1024;  // + alignment slack

// Lazy rescale: the running max m only moves when a tile's row max exceeds it
// by more than this (log2 units), so P = 2^(s - m) <= 2^8 (exact in bf16's
// range, fp32 O and l have room) and the 128-wide O rescale is skipped
// whenever no row moved (almost always after the first tile).
constexpr float kLazy = 8.f;

// Named barriers (0 is __syncthreads).
constexpr int BAR_A = 1;     // WG0 -> WG1 handoff (m0 / s0, and P0 in v7)
constexpr int BAR_P1 = 2;    // WG1 -> WG0: P1 / s1 / m1
constexpr int BAR_P0 = 3;    // WG0 -> WG1: final P0 in shared memory (v6)
constexpr int BAR_WG0 = 4;   // WG0 only (zeroed tail rows)
constexpr int BAR_WG1 = 5;   // WG1 only
constexpr int BAR_RED0 = 6;  // WG0-wide vote
constexpr int BAR_RED1 = 7;  // WG1-wide vote

__device__ __forceinline__ void named_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// OR of pred over the 128 threads of one warpgroup (all of them call it):
// a warpgroup-uniform answer, needed before a wgmma.wait_group in a branch.
__device__ __forceinline__ bool wg_any(bool pred, int id) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"((uint32_t)pred), "r"(id)
      : "memory");
  return r != 0;
}
__device__ __forceinline__ float ex2(float x) {  // 2^x, -inf -> 0, no denormal fix-up
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Four 8x8 bf16 matrices from the accumulator-layout fragment of one warp.
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// Programmatic dependent launch: lets the combine grid launch early; it
// waits (griddepcontrol.wait) for this grid's completion before reading.
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// P (64 rows x 64 keys, packed bf16 in accumulator layout) -> one swizzled
// 64x64 tile at sP: per 16-key step, one stmatrix.x4 per warp. Lane l gives
// the address of row l%8 of matrix l/8: matrices (rows +0, keys +0),
// (rows +8, keys +0), (rows +0, keys +8), (rows +8, keys +8) = pa[k][0..3].
__device__ __forceinline__ void store_p(uint32_t sP, const uint32_t (&pa)[4][4], int wi, int lane) {
  const int mat = lane >> 3;
  const int r = 16 * wi + (lane & 7) + 8 * (mat & 1);
#pragma unroll
  for (int k = 0; k < 4; k++)
    stsm_x4(sP + sw128_off(r, 16 * k + 8 * (mat >> 1)), pa[k][0], pa[k][1], pa[k][2], pa[k][3]);
}

__device__ __forceinline__ void pack_p(uint32_t (&pa)[4][4], const float (&s)[32]) {
#pragma unroll
  for (int k = 0; k < 4; k++)
#pragma unroll
    for (int j = 0; j < 4; j++) pa[k][j] = pack_bf16(s[8 * k + 2 * j], s[8 * k + 2 * j + 1]);
}
// Keeps a register A operand alive and unmodified until the wgmma reading
// it has retired (call after the wait_group that retires it).
__device__ __forceinline__ void keep_alive(const uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int k = 0; k < 4; k++)
#pragma unroll
    for (int j = 0; j < 4; j++) asm volatile("" ::"r"(pa[k][j]) : "memory");
}

__device__ __forceinline__ void rescale_o(float (&o)[128], float fA, float fB) {
#pragma unroll
  for (int i = 0; i < 128; i++) o[i] *= ((i >> 1) & 1) ? fB : fA;
}

// Row max of the raw scores of this thread's two rows (quad-reduced). On
// tiles that are not full (piece end, causal edge) keys past a row's limit
// become -inf (a select: NaN in unreadable rows cannot leak).
__device__ __forceinline__ void row_max(float (&s)[32], bool full, int kt, int limA, int limB, int cq, float &mxA,
                                        float &mxB) {
  mxA = -INFINITY;
  mxB = -INFINITY;
  if (!full) {
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const bool rowB = (i >> 1) & 1;
      const int key = kt + 8 * (i >> 2) + cq + (i & 1);
      s[i] = key < (rowB ? limB : limA) ? s[i] : -INFINITY;
    }
  }
#pragma unroll
  for (int i = 0; i < 32; i++) {
    if ((i >> 1) & 1) mxB = fmaxf(mxB, s[i]);
    else mxA = fmaxf(mxA, s[i]);
  }
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
  mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
  mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
}

// New running max after a tile whose scaled row max is x, and the factor
// that takes state relative to mp to state relative to it: the max moves
// only by more than kLazy; from -inf (nothing seen, O = l = 0) the factor is 1.
__device__ __forceinline__ float lazy_max(float mp, float x) { return x > mp + kLazy ? x : mp; }
__device__ __forceinline__ float lazy_scale(float mp, float mn) {
  return (mn == mp || mp == -INFINITY) ? 1.f : ex2(mp - mn);
}

// P = 2^(s * sl2 - m) in place (one FFMA + one MUFU each), row sums.
__device__ __forceinline__ void exp_rows(float (&s)[32], float sl2, float mA, float mB, float &sumA, float &sumB) {
  const float uA = mA == -INFINITY ? 0.f : mA, uB = mB == -INFINITY ? 0.f : mB;  // finite stand-in
  sumA = 0.f;
  sumB = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i++) {
    const bool rowB = (i >> 1) & 1;
    s[i] = ex2(fmaf(s[i], sl2, -(rowB ? uB : uA)));
    if (rowB) sumB += s[i];
    else sumA += s[i];
  }
}

// Next tile of one buffer: tiles t with t % 2 == buf, over the part's requests.
struct BufCursor {
  int req, t;
  ReqWork w;
};

__device__ __forceinline__ void cursor_settle(const mla_decode_params &p, const int *meta, int mb, BufCursor &c) {
  const int er = meta[SCHED_END_REQ];
  while (c.req <= er && c.t >= c.w.n_tiles) {
    const int buf = c.t & 1;
    c.req++;
    c.t = buf;
    if (c.req <= er) c.w = req_work(p, meta, c.req, mb);
  }
}
__device__ __forceinline__ BufCursor cursor_first(const mla_decode_params &p, const int *meta, int mb, int buf) {
  BufCursor c;
  c.req = meta[SCHED_BEGIN_REQ];
  c.t = buf;
  c.w = req_work(p, meta, c.req, mb);
  cursor_settle(p, meta, mb, c);
  return c;
}
__device__ __forceinline__ void cursor_next(const mla_decode_params &p, const int *meta, int mb, BufCursor &c) {
  c.t += 2;
  cursor_settle(p, meta, mb, c);
}

// Where a refill reads from; the page id is fetched when the pair starts, so
// the elected thread does not wait on a global load at refill time.
// (page_size is a power of two: shifts, not divisions, on this path.)
struct TileSrc {
  int valid;
  int req;
  int kt0;
  int page;  // P >= 64: the page holding the tile's 64 rows
  int row0;  // P >= 64: first row of the tile in that page
  int nvalid;
};
__device__ __forceinline__ TileSrc tile_src(const mla_decode_params &p, int er, const BufCursor &c) {
  TileSrc s;
  s.valid = c.req <= er;
  s.req = c.req;
  s.kt0 = c.w.kstart + 64 * c.t;
  s.nvalid = min(64, c.w.kend_blk - s.kt0);
  s.page = 0;
  s.row0 = 0;
  if (s.valid && p.page_size >= 64) {
    const int lp = __ffs(p.page_size) - 1;
    s.page = p.block_table[(size_t)c.req * p.block_table_width + (s.kt0 >> lp)];
    s.row0 = s.kt0 & (p.page_size - 1);
  }
  return s;
}

// v9+: a buffer's chunks in groups with one mbarrier each (v6-v8: one per
// chunk). Loads chunks [c0, c1) of the tile into kbuf, all completing `bar`;
// one thread. kBig: page_size >= 64 (one box per chunk), else 64/P boxes.
template <bool kBig>
__device__ __forceinline__ void load_group(const mla_decode_params &p, const CUtensorMap *map, const TileSrc &s,
                                           uint32_t kbuf, uint32_t bar, int c0, int c1) {
  if (kBig) {
    mbar_expect_tx(bar, (uint32_t)(c1 - c0) * kChunk);
    for (int cc = c0; cc < c1; cc++) tma_load_3d(kbuf + cc * kChunk, map, bar, 64 * cc, s.row0, s.page);
  } else {
    const int P = p.page_size, lp = __ffs(P) - 1;
    const int *bt = p.block_table + (size_t)s.req * p.block_table_width + (s.kt0 >> lp);
    const int nbox = (s.nvalid + P - 1) >> lp;  // boxes past the end are never read
    mbar_expect_tx(bar, (uint32_t)((c1 - c0) * nbox * P * 128));
    for (int cc = c0; cc < c1; cc++)
      for (int b = 0; b < nbox; b++) tma_load_3d(kbuf + cc * kChunk + b * P * 128, map, bar, 64 * cc, 0, bt[b]);
  }
}
// Rows past the piece may hold NaN (0 * NaN = NaN): zero them in chunks
// [c0, c0+4) before a P V reads them; 128 threads of one warpgroup.
__device__ __forceinline__ void zero_tail(uint8_t *kb, int nvalid, int c0, int t128) {
  const int nz = (64 - nvalid) * 32;  // rows x 4 chunks x 8 16-byte pieces
  for (int i = t128; i < nz; i += 128) {
    const int r = nvalid + (i >> 5), ch = c0 + ((i >> 3) & 3), x = i & 7;
    *reinterpret_cast<uint4 *>(kb + ch * kChunk + r * 128 + x * 16) = make_uint4(0, 0, 0, 0);
  }
}

// S = Q K^T for one 64-key tile with three barriers per buffer (bars + 8 g:
// g = 0 chunks 0-3, 1 chunks 4-7, 2 the rope chunk): rope first (Q rope from
// registers), then the warpgroup's own half (WG0: 0-3, WG1: 4-7, the half its
// own P V released first), then the other half. The sum is order-free.
template <int WG>
__device__ __forceinline__ void qk_tile3(float (&s)[32], uint32_t sq, uint32_t kb, uint32_t bars, uint32_t par,
                                         const uint32_t (&qr)[4][4]) {
  const uint64_t dq = desc_sw128(sq, 16, 1024), dk = desc_sw128(kb, 16, 1024);
#pragma unroll
  for (int i = 0; i < 32; i++) s[i] = 0.f;
  mbar_wait(bars + 16, par);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wgmma_m64n64k16_rs(s, qr[k], dk + ((8 * kChunk + k * 32) >> 4), k > 0);
  wgmma_commit();
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int g = WG == 0 ? h : 1 - h;
    mbar_wait(bars + 8 * g, par);
    wgmma_fence();
#pragma unroll
    for (int c = 4 * g; c < 4 * g + 4; c++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t off = (c * kChunk + k * 32) >> 4;
        wgmma_m64n64k16_ss(s, dq + off, dk + off, 1);
      }
    wgmma_commit();
  }
  wgmma_wait<0>();
  reg_fence(s);
}

// O[:, half] (+)= P V[:, half] with P from registers (pa) or from shared
// memory (sP); V = chunks 4*half .. 4*half+3 of buffer kb, MN-major view.
__device__ __forceinline__ void pv_rs(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t kb, int half,
                                      uint32_t lbo, uint32_t sbo) {
  const uint64_t dv = desc_sw128(kb + half * 4 * kChunk, lbo, sbo);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wgmma_m64n256k16_rs_tb(o, pa[k], dv + ((k * 2048) >> 4), 1);
  wgmma_commit();
}
__device__ __forceinline__ void pv_ss(float (&o)[128], uint32_t sP, uint32_t kb, int half, uint32_t lbo,
                                      uint32_t sbo) {
  const uint64_t dp = desc_sw128(sP, 16, 1024), dv = desc_sw128(kb + half * 4 * kChunk, lbo, sbo);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wgmma_m64n256k16_ss_tb(o, dp + ((k * 32) >> 4), dv + ((k * 2048) >> 4), 1);
  wgmma_commit();
}

// Per request: Q latent into 8 swizzled chunks (cp.async, zero rows past the
// m-block), Q rope straight into A fragments, row limits, running max reset.
// Caller: __syncthreads() before (previous request done) and after.
__device__ __forceinline__ void load_q(const mla_decode_params &p, const ReqWork &w, int mb, uint32_t sb,
                                       uint8_t *smem, int tid, int rA, int rB, int cq, uint32_t (&qr)[4][4]) {
  const int H = p.num_heads;
  for (int ci = tid; ci < 64 * 64; ci += kThreads) {
    const int r = ci >> 6, ch = ci & 63;
    const bool ok = r < w.rows;
    const int rg = mb * 64 + r, t = ok ? rg / H : 0, h = ok ? rg % H : 0;
    const uint16_t *src = p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + ch * 8;
    cp_async_16(sb + kOffQ + (ch >> 3) * kChunk + sw128_off(r, (ch & 7) * 8), ok ? (const void *)src : p.kv, ok);
  }
  cp_async_commit();
  const int rows2[2] = {rA, rB};
  uint32_t v[2][8];
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rows2[hh];
    const bool ok = r < w.rows;
    const int rg = mb * 64 + r, t = ok ? rg / H : 0, h = ok ? rg % H : 0;
    const uint16_t *src = p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      v[hh][2 * k] = ok ? *reinterpret_cast<const uint32_t *>(src + 16 * k + cq) : 0u;
      v[hh][2 * k + 1] = ok ? *reinterpret_cast<const uint32_t *>(src + 16 * k + 8 + cq) : 0u;
    }
  }
#pragma unroll
  for (int k = 0; k < 4; k++) {
    qr[k][0] = v[0][2 * k];
    qr[k][1] = v[1][2 * k];
    qr[k][2] = v[0][2 * k + 1];
    qr[k][3] = v[1][2 * k + 1];
  }
  int *lim = reinterpret_cast<int *>(smem + kOffLim);
  float *sM = reinterpret_cast<float *>(smem + kOffM);
  if (tid < 64) {
    // Rows past the m-block's end see no key on masked tiles (their scores
    // stay finite or -inf, so they never trigger a rescale).
    lim[tid] = tid < w.rows ? row_limit(p, w, mb, tid) : 0;
    sM[tid] = -INFINITY;
  }
  cp_async_wait_all();
  fence_proxy_async();
}

// Epilogue of one request: l = both warpgroups' partial sums; m is the final
// running max in shared memory.
__device__ __forceinline__ void epilogue(const mla_decode_params &p, const ReqWork &w, int mb, uint8_t *smem,
                                         const float (&o)[128], float lsA, float lsB, int wg, int rA, int rB, int cq,
                                         bool lead) {
  float *sL = reinterpret_cast<float *>(smem + kOffL);
  const float *sM = reinterpret_cast<const float *>(smem + kOffM);
  lsA += __shfl_xor_sync(0xffffffffu, lsA, 1);
  lsA += __shfl_xor_sync(0xffffffffu, lsA, 2);
  lsB += __shfl_xor_sync(0xffffffffu, lsB, 1);
  lsB += __shfl_xor_sync(0xffffffffu, lsB, 2);
  if (lead) {
    sL[wg * 64 + rA] = lsA;
    sL[wg * 64 + rB] = lsB;
  }
  __syncthreads();
  const float tA = sL[rA] + sL[64 + rA], tB = sL[rB] + sL[64 + rB];
  const float iA = tA > 0.f ? 1.f / tA : 0.f, iB = tB > 0.f ? 1.f / tB : 0.f;
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    const bool rowB = (i >> 1) & 1;
    const int r = rowB ? rB : rA;
    if (r < w.rows) store_out_pair(p, w, mb, r, 256 * wg + 8 * (i >> 2) + cq, o[i], o[i + 1], rowB ? iB : iA);
  }
  if (wg == 0 && lead) {
    if (rA < w.rows) store_lse(p, w, mb, rA, tA > 0.f ? sM[rA] + log2f(tA) : -INFINITY);
    if (rB < w.rows) store_lse(p, w, mb, rB, tB > 0.f ? sM[rB] + log2f(tB) : -INFINITY);
  }
}

}  // namespace seesaw
