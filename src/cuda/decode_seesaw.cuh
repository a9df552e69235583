// Pieces of the sm_90a decode kernels (decode_sm90.cu), copied from the
// ladder's dev/cuda/seesaw.cuh and trimmed to what v9/v10 use: shared-memory
// layout of the wide kernel, per-buffer tile cursors, grouped TMA refills
// with the page id fetched ahead, the QK^T of one tile, lazy-rescale softmax
// helpers, the P store with stmatrix, and the PDL trigger. Added in the
// library: the cp.async gather refill (any page size) and the in-buffer fp8
// staging and dequantization (load modes, LOAD_*), f16 operands (kF16).
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
static_assert(kOffB0 - kOffQ == 65536, "the epilogue stages 64 rows x 1 KB over Q");

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
constexpr int BAR_CV0 = 8;   // WG0 only: its converted fp8 tile is in shared memory
constexpr int BAR_CV1 = 9;   // WG1 only
constexpr int BAR_QK = 11;   // WG0 -> WG1: WG0's Q.K^T retired (fp8 math: the two Q.K^T in turn)

// How an instantiation fills its K buffers (template parameter LM).
//  TMA_BIG / TMA_SMALL: 16-bit cache, page size >= 64 / 8..32 (TMA boxes).
//  GATHER: 16-bit cache, any page size (used for 1..4): the refilling
//    warpgroup copies the tile row by row with cp.async (page id per row from
//    the block table) straight into the swizzled layout; one noinc arrival
//    per thread.
//  FP8 / FP8_BLOCK (page size 1..4: cp.async like GATHER) and FP8_TMA /
//    FP8_BLOCK_TMA (page size >= 8: TMA boxes of a uint8 view, one thread):
//    e4m3 caches (576 / 656-byte rows). The raw bytes land inside the K
//    buffer itself (load_group), the warpgroup owning the buffer dequantizes
//    them in place into the bf16 swizzled tile before its QK^T; from there on
//    the tile is an ordinary bf16 tile (QK^T and P V).
enum { LOAD_TMA_BIG = 0, LOAD_TMA_SMALL = 1, LOAD_GATHER = 2, LOAD_FP8 = 3, LOAD_FP8_BLOCK = 4,
       LOAD_FP8_TMA = 5, LOAD_FP8_BLOCK_TMA = 6 };
// cp.async modes: every thread of the refilling warpgroup copies (barrier
// count 128); the others: one thread issues TMA (count 1 + transaction bytes).
__host__ __device__ constexpr bool lm_cp(int lm) { return lm == LOAD_GATHER || lm == LOAD_FP8 || lm == LOAD_FP8_BLOCK; }
__host__ __device__ constexpr bool lm_fp8(int lm) { return lm >= LOAD_FP8; }
__host__ __device__ constexpr bool lm_block(int lm) { return lm == LOAD_FP8_BLOCK || lm == LOAD_FP8_BLOCK_TMA; }
__host__ __device__ constexpr bool lm_tma16(int lm) { return lm <= LOAD_TMA_SMALL; }
// The wide kernel's per-tensor fp8 modes keep the cache's e4m3 values as exact
// f16 operands (the scale applied to the scores and the output instead, Q as
// f16 times 2^e: load_q_f16); the other kernels dequantize them to bf16.
__host__ __device__ constexpr bool lm_raw(int lm) { return lm == LOAD_FP8 || lm == LOAD_FP8_TMA; }

// The tensor maps of a launch (kernel parameter): [0] the 16-bit cache
// (SWIZZLE_128B, 64 columns) or the fp8 rows as bytes (128-byte boxes, no
// swizzle); 16-bit and per-tensor fp8 caches: [1] the same view with
// 128-byte L2 promotion (the ring kernel's); per-tensor fp8: [2] 128-byte
// boxes with the 128B swizzle (the fp8 math kernel's K-major tiles); fp8
// block-scaled only: [1] the 16 scale bytes of a row, [2] the bf16 rope as
// 128 swizzled bytes.
struct KvMaps {
  // [3]: page size >= 64, a 4-D map of 128-byte chunks (make_kv_tmap_chunked in decode_sm90.cu): per-tensor
  // fp8 a tile's latent, 16-bit caches a latent half
  CUtensorMap m[4];
};

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

template <bool kF16>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[4][4], const float (&s)[32]) {
#pragma unroll
  for (int k = 0; k < 4; k++)
#pragma unroll
    for (int j = 0; j < 4; j++) pa[k][j] = pack2<kF16>(s[8 * k + 2 * j], s[8 * k + 2 * j + 1]);
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
// kRounded: 2^(round(s * sl2) - m) instead (FMUL, FADD), so the key that set
// m (m = round(max s * sl2)) gets P = 1 exactly rather than 2^(the product's
// rounding error): with logits of ~1e5 that error is ~4e-3, and the wide
// kernel's exact fp8 path, whose P is f16, must return a lone key's row bit
// for bit (test_cuda_decode_dtypes' q * 2^20 cases).
template <bool kRounded = false>
__device__ __forceinline__ void exp_rows(float (&s)[32], float sl2, float mA, float mB, float &sumA, float &sumB) {
  const float uA = mA == -INFINITY ? 0.f : mA, uB = mB == -INFINITY ? 0.f : mB;  // finite stand-in
  sumA = 0.f;
  sumB = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i++) {
    const bool rowB = (i >> 1) & 1;
    if constexpr (kRounded) s[i] = ex2(__fmul_rn(s[i], sl2) - (rowB ? uB : uA));
    else s[i] = ex2(fmaf(s[i], sl2, -(rowB ? uB : uA)));
    if (rowB) sumB += s[i];
    else sumA += s[i];
  }
}

// A warpgroup's hand-off of its rows' running max and scale (one lane per
// quad), before the named-barrier arrival that publishes them.
__device__ __forceinline__ void publish_rows(float *sM, float *sS, int rA, int rB, float mA, float mB, float sA,
                                             float sB, bool lead) {
  if (lead) {
    sM[rA] = mA;
    sM[rB] = mB;
    sS[rA] = sA;
    sS[rB] = sB;
  }
}
// O and the partial row sums taken to a new max (factors fA / fB) plus this
// tile's sums; the 128-wide rescale only when a row of the warp moved.
__device__ __forceinline__ void rescale_acc(float (&o)[128], float &lsA, float &lsB, float fA, float fB, float sumA,
                                            float sumB) {
  if (__any_sync(0xffffffffu, fA != 1.f || fB != 1.f)) rescale_o(o, fA, fB);
  lsA = lsA * fA + sumA;
  lsB = lsB * fB + sumB;
}

// Next tile of one buffer: tiles t with t % 2 == buf, over the part's requests.
struct BufCursor {
  int req, t;
  ReqWork w;
};

// kStep: the cursor visits tiles t = first, first + kStep, ... of each request
// (2: a buffer of the two-buffer kernels, tiles of its parity; 1: every tile
// of the part in order, the three-buffer fp8 math kernel's).
template <int kStep = 2>
__device__ __forceinline__ void cursor_settle(const mla_decode_params &p, const int *meta, int mb, BufCursor &c) {
  static_assert(kStep == 1 || kStep == 2, "a tile step of 1 or 2");
  const int er = meta[SCHED_END_REQ];
  while (c.req <= er && c.t >= c.w.n_tiles) {
    const int first = c.t & (kStep - 1);
    c.req++;
    c.t = first;
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
template <int kStep = 2>
__device__ __forceinline__ void cursor_next(const mla_decode_params &p, const int *meta, int mb, BufCursor &c) {
  c.t += kStep;
  cursor_settle<kStep>(p, meta, mb, c);
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
  int rvalid;    // LM >= GATHER: this thread's row (myrow) is a key of the piece
  int64_t roff;  // LM >= GATHER: byte offset of that row in the cache layer
};
// LM >= GATHER: every thread of the refilling warpgroup calls it for the row
// it copies (myrow = t128 / 2); rows past the piece are zero-filled, never read.
template <int LM>
__device__ __forceinline__ TileSrc tile_src(const mla_decode_params &p, int er, const BufCursor &c, int myrow) {
  TileSrc s;
  s.valid = c.req <= er;
  s.req = c.req;
  s.kt0 = c.w.kstart + 64 * c.t;
  s.nvalid = min(64, c.w.kend_blk - s.kt0);
  s.page = 0;
  s.row0 = 0;
  s.rvalid = 0;
  s.roff = 0;
  const int lp = __ffs(p.page_size) - 1;
  if constexpr (lm_cp(LM)) {
    s.rvalid = s.valid && myrow < s.nvalid;
    if (s.rvalid) {
      const int key = s.kt0 + myrow;
      const int page = p.block_table[(size_t)c.req * p.block_table_width + (key >> lp)];
      s.roff = ((int64_t)page * p.page_size + (key & (p.page_size - 1))) * p.row_bytes;
    }
  } else if (s.valid && p.page_size >= 64) {
    s.page = p.block_table[(size_t)c.req * p.block_table_width + (s.kt0 >> lp)];
    s.row0 = s.kt0 & (p.page_size - 1);
  }
  return s;
}

// Where a kernel works out its next tiles (next_tile / next_tiles): between
// its Q.K^T issue and wait in the 16-bit modes (the gather's dependent page
// lookup otherwise stalls each tile's start: page 1 3.5-5 % faster, page 64
// s_q = 2 ~1 %), at the loop top in the fp8 modes (under the Q.K^T ptxas
// spilled there, 2 % slower; bench/RESULTS.md session 9, runs 10 and 13).
__host__ __device__ constexpr bool next_under_qk(int lm) { return !lm_fp8(lm); }

// A buffer's next tile (nx: the cursor one step on) and where the refilling
// thread reads it from (ld; valid = 0 elsewhere): the narrow kernel's one
// buffer per warpgroup; next_tiles below is the wide kernel's pair.
template <int LM>
__device__ __forceinline__ void next_tile(const mla_decode_params &p, const int *meta, int mb, int er, bool issuer,
                                          int myrow, const BufCursor &cur, BufCursor &nx, TileSrc &ld) {
  nx = cur;
  cursor_next(p, meta, mb, nx);
  ld.valid = 0;
  if (issuer) ld = tile_src<LM>(p, er, nx, myrow);
}
// The pair's next tile of each buffer (nx0, nx1: cursors one pair on) and
// where the refilling thread reads it from (ld0, ld1; valid = 0 elsewhere).
template <int LM>
__device__ __forceinline__ void next_tiles(const mla_decode_params &p, const int *meta, int mb, int er, bool issuer,
                                           int myrow, bool has1, const BufCursor &cur0, const BufCursor &cur1,
                                           BufCursor &nx0, BufCursor &nx1, TileSrc &ld0, TileSrc &ld1) {
  next_tile<LM>(p, meta, mb, er, issuer, myrow, cur0, nx0, ld0);
  if (has1) {
    next_tile<LM>(p, meta, mb, er, issuer, myrow, cur1, nx1, ld1);
  } else {
    nx1 = cur1;
    ld1.valid = 0;
  }
}

// cp.async modes: the source row rl (0..15) of this lane's warp, looked up
// by lanes 2 rl and 2 rl + 1 (tile_src's myrow); all 32 lanes call it.
struct RowSrc {
  const uint8_t *row;
  int ok;
};
__device__ __forceinline__ RowSrc row_of(const mla_decode_params &p, const TileSrc &s, int rl) {
  const uint64_t off = (uint64_t)s.roff;
  const uint32_t lo = __shfl_sync(0xffffffffu, (uint32_t)off, 2 * rl);
  const uint32_t hi = __shfl_sync(0xffffffffu, (uint32_t)(off >> 32), 2 * rl);
  RowSrc r;
  r.ok = __shfl_sync(0xffffffffu, s.rvalid, 2 * rl);
  r.row = static_cast<const uint8_t *>(p.kv) + (((uint64_t)hi << 32) | lo);
  return r;
}

// v9+: a buffer's chunks in groups with one mbarrier each (v6-v8: one per
// chunk). Loads chunks [c0, c1) of the tile into kbuf, all completing `bar`.
// TMA modes: one thread; TMA_BIG: page_size >= 64 (one box per chunk), else
// 64/P boxes. Other modes: all 128 threads of the refilling warpgroup (t128),
// then one noinc arrival each (the barrier counts 128).
//
// In-buffer staging of the fp8 modes (a group is chunks [c0, c0 + 2n) of
// latent, or the rope chunk 8): the raw e4m3 bytes of chunk pair i (128
// latent values per row, = one scale block) land linearly in chunk c0 + n + i
// (row r at r * 128), the block format's 4 fp32 scales of row r at byte
// r * 16 of chunk c0, the per-tensor rope (64 bytes) at bytes 64..127 of row
// r of chunk 8 (the TMA box is row bytes 448..575). The dequantization
// (convert_group) writes chunk pair i over chunks c0 + 2i, c0 + 2i + 1,
// never over raw bytes still to be read: only the last pair overwrites its
// own staging, per row, after both of the row's threads (adjacent lanes)
// have read it; the scales are read by all before anything is written.
template <int LM>
__device__ __forceinline__ void load_group(const mla_decode_params &p, const CUtensorMap *maps, const TileSrc &s,
                                           uint32_t kbuf, uint32_t bar, int c0, int c1, int t128) {
  const CUtensorMap *map = maps;
  (void)map;
  if constexpr (lm_cp(LM)) {
    // Warp w copies its rows 16 w .. 16 w + 15 with consecutive lanes on
    // consecutive 16-byte pieces of a row (coalesced: a warp instruction
    // reads whole 128-byte lines); a row's source comes from the lanes that
    // looked it up (row_of).
    const int lane = t128 & 31, w = t128 >> 5;
    const void *dummy = p.kv;  // zero-fill source (nothing is read)
    if (LM == LOAD_GATHER || (LM == LOAD_FP8_BLOCK && c0 == 8)) {
      // 16-bit rows (the block format's bf16 rope at byte 528) straight into
      // the 128B-swizzled layout TMA would produce.
      const int base = LM == LOAD_GATHER ? 0 : 528 - 8 * 128;
      const int lcpr = 31 - __clz(8 * (c1 - c0));  // log2(pieces per row)
#pragma unroll 1
      for (int idx = lane; idx < (16 << lcpr); idx += 32) {
        const int rl = idx >> lcpr, pc = idx & ((1 << lcpr) - 1);
        const RowSrc rs = row_of(p, s, rl);
        const int r = 16 * w + rl, cc = c0 + (pc >> 3), j = pc & 7;
        cp_async_16(kbuf + cc * kChunk + r * 128 + ((j ^ (r & 7)) << 4),
                    rs.ok ? (const void *)(rs.row + base + cc * 128 + j * 16) : dummy, rs.ok);
      }
    } else if (c0 == 8) {
      // per-tensor fp8 rope: 64 raw bytes at bytes 64..127 of row r of chunk 8
#pragma unroll 1
      for (int idx = lane; idx < 64; idx += 32) {
        const int rl = idx >> 2, j = idx & 3;
        const RowSrc rs = row_of(p, s, rl);
        cp_async_16(kbuf + 8 * kChunk + (16 * w + rl) * 128 + 64 + j * 16,
                    rs.ok ? (const void *)(rs.row + 512 + j * 16) : dummy, rs.ok);
      }
    } else {
      const int n = (c1 - c0) >> 1, lcpr = 31 - __clz(8 * n);
#pragma unroll 1
      for (int idx = lane; idx < (16 << lcpr); idx += 32) {
        const int rl = idx >> lcpr, q = idx & ((1 << lcpr) - 1), i = q >> 3, j = q & 7;
        const RowSrc rs = row_of(p, s, rl);
        cp_async_16(kbuf + (c0 + n + i) * kChunk + (16 * w + rl) * 128 + j * 16,
                    rs.ok ? (const void *)(rs.row + 64 * (c0 + 2 * i) + j * 16) : dummy, rs.ok);
      }
      if (LM == LOAD_FP8_BLOCK) {
        const RowSrc rs = row_of(p, s, lane & 15);
        if (lane < 16)
          cp_async_16(kbuf + c0 * kChunk + (16 * w + lane) * 16, rs.ok ? (const void *)(rs.row + 512) : dummy, rs.ok);
      }
    }
    cp_async_mbar_arrive(bar);
  } else if constexpr (lm_fp8(LM)) {
    // fp8, page size >= 8: boxes of min(P, 64) rows of the byte view; a box
    // of P < 64 rows lands at row b * P (boxes past the piece end skipped).
    const int P = p.page_size, lp = __ffs(P) - 1;
    const bool big = P >= 64;
    const int rows = big ? 64 : P;
    const int nbox = big ? 1 : (s.nvalid + P - 1) >> lp;
    const int *bt = p.block_table + (size_t)s.req * p.block_table_width + (s.kt0 >> lp);
    const int n = (c1 - c0) >> 1;
    const uint32_t per_box = c0 == 8 ? rows * 128 : n * rows * 128 + (lm_block(LM) ? rows * 16 : 0);
    mbar_expect_tx(bar, (uint32_t)nbox * per_box);
#pragma unroll 1
    for (int b = 0; b < nbox; b++) {
      const int page = big ? s.page : bt[b], r0 = big ? s.row0 : 0;
      if (c0 == 8) {
        if (lm_block(LM)) tma_load_3d(kbuf + 8 * kChunk + b * rows * 128, &maps[2], bar, 528, r0, page);
        else tma_load_3d(kbuf + 8 * kChunk + b * rows * 128, &maps[0], bar, 448, r0, page);
      } else {
#pragma unroll 1
        for (int i = 0; i < n; i++)
          tma_load_3d(kbuf + (c0 + n + i) * kChunk + b * rows * 128, &maps[0], bar, 64 * (c0 + 2 * i), r0, page);
        if (lm_block(LM)) tma_load_3d(kbuf + c0 * kChunk + b * rows * 16, &maps[1], bar, 512, r0, page);
      }
    }
  } else if constexpr (LM == LOAD_TMA_BIG) {
    mbar_expect_tx(bar, (uint32_t)(c1 - c0) * kChunk);
    if (((c1 - c0) & 3) == 0) {  // latent halves as 4-D boxes (maps[3]: {128 B, rows, chunk, page}): 1 issue, not 4
      for (int cc = c0; cc < c1; cc += 4)
        tma_load_4d(kbuf + cc * kChunk, maps + 3, bar, 0, s.row0, cc, s.page, false, 0);
      return;
    }
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

// fp8 modes: dequantizes the staged group [c0, c1) of the buffer at kb (see
// load_group) into bf16 swizzled chunks; 128 threads of the owning
// warpgroup, two adjacent lanes per row, so the only ordering needed is a
// __syncwarp between a pair's reads and its writes (and one warpgroup
// barrier after the block scales are read). Rows >= nvalid (past the piece:
// never loaded, or TMA rows that may hold NaN) become zeros, so P V never
// sees them. The caller then fences (generic -> async proxy) and syncs the
// warpgroup before its wgmma.
//
// Per-tensor fp8 uses another thread mapping (convert_group_pt): consecutive
// lanes on consecutive 16-byte pieces of a row (the rope: 4 lanes per row, a
// latent pair: 8), so each warp's reads are contiguous and its swizzled writes
// conflict-free; with two lanes per row every access was 4-way bank-
// conflicted. Warp w owns rows 16 w .. 16 w + 15, so the ordering argument
// is the same with __syncwarp.
// kRaw (the wide kernel's per-tensor modes): the e4m3 values become f16
// unscaled (exact; lm_raw) instead of bf16 times the scale.
template <bool kRaw>
__device__ __forceinline__ uint2 dq4_pt(uint32_t w, float kv_scale) {
  uint2 r;
  if constexpr (kRaw) e4m3x4_f16x2x2(w, r.x, r.y);
  else r = dq4_e4m3(w, kv_scale);
  return r;
}
template <int LM, bool kRaw = false>
__device__ __forceinline__ void convert_group_pt(uint8_t *kb, int c0, int c1, int t128, float kv_scale, int nvalid) {
  const int w = t128 >> 5, lane = t128 & 31;
  if (c0 == 8) {  // rope: raw bytes 64..127 of the row -> the row's 64 bf16, in place
    const int j = lane & 3;
    uint4 v[2];
#pragma unroll
    for (int it = 0; it < 2; it++) {
      const int r = 16 * w + 8 * it + (lane >> 2);
      v[it] = *reinterpret_cast<const uint4 *>(kb + 8 * kChunk + r * 128 + 64 + 16 * j);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 2; it++) {
      const int r = 16 * w + 8 * it + (lane >> 2), sw = r & 7;
      const bool zero = r >= nvalid;
      uint8_t *dst = kb + 8 * kChunk + r * 128;
      const uint2 a = dq4_pt<kRaw>(v[it].x, kv_scale), b = dq4_pt<kRaw>(v[it].y, kv_scale);
      const uint2 c = dq4_pt<kRaw>(v[it].z, kv_scale), d = dq4_pt<kRaw>(v[it].w, kv_scale);
      *reinterpret_cast<uint4 *>(dst + (((2 * j) ^ sw) << 4)) = zero ? make_uint4(0, 0, 0, 0) : make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4 *>(dst + (((2 * j + 1) ^ sw) << 4)) =
          zero ? make_uint4(0, 0, 0, 0) : make_uint4(c.x, c.y, d.x, d.y);
    }
    return;
  }
  const int n = (c1 - c0) >> 1, j = lane & 7, h = j >> 2;
  // Not unrolled: the kernels' registers are spoken for (O, S, Q rope).
#pragma unroll 1
  for (int i = 0; i < n; i++) {
    uint4 v[4];
#pragma unroll
    for (int it = 0; it < 4; it++) {
      const int r = 16 * w + 4 * it + (lane >> 3);
      v[it] = *reinterpret_cast<const uint4 *>(kb + (c0 + n + i) * kChunk + r * 128 + 16 * j);
    }
    __syncwarp();
    uint8_t *dbase = kb + (c0 + 2 * i + h) * kChunk;
#pragma unroll
    for (int it = 0; it < 4; it++) {
      const int r = 16 * w + 4 * it + (lane >> 3), sw = r & 7;
      const bool zero = r >= nvalid;
      uint8_t *dst = dbase + r * 128;
      const uint2 a = dq4_pt<kRaw>(v[it].x, kv_scale), b = dq4_pt<kRaw>(v[it].y, kv_scale);
      const uint2 c = dq4_pt<kRaw>(v[it].z, kv_scale), d = dq4_pt<kRaw>(v[it].w, kv_scale);
      *reinterpret_cast<uint4 *>(dst + (((2 * (j & 3)) ^ sw) << 4)) =
          zero ? make_uint4(0, 0, 0, 0) : make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4 *>(dst + (((2 * (j & 3) + 1) ^ sw) << 4)) =
          zero ? make_uint4(0, 0, 0, 0) : make_uint4(c.x, c.y, d.x, d.y);
    }
  }
}

template <int LM, bool kRaw = false>
__device__ __forceinline__ void convert_group(uint8_t *kb, int c0, int c1, int t128, float kv_scale, int nvalid,
                                              int bar_id) {
  if constexpr (!lm_block(LM)) {
    convert_group_pt<LM, kRaw>(kb, c0, c1, t128, kv_scale, nvalid);
    return;
  }
  const int r = t128 >> 1, h = t128 & 1, sw = r & 7;
  const bool zero = r >= nvalid;
  uint8_t *rb = kb + r * 128;
  // (block format from here on: per-tensor went to convert_group_pt)
  const float4 bs = *reinterpret_cast<const float4 *>(kb + c0 * kChunk + r * 16);
  named_bar_sync(bar_id, 128);  // every row's scales read before chunk c0 is written
  const int n = (c1 - c0) >> 1;
  // Not unrolled: the kernels' registers are spoken for (O, S, Q rope).
#pragma unroll 1
  for (int i = 0; i < n; i++) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = *reinterpret_cast<const uint4 *>(rb + (c0 + n + i) * kChunk + 64 * h + 16 * k);
    __syncwarp();
    const int blk = (c0 >> 1) + i;  // scale block (128 latent values) of the pair
    const float sc = blk == 0 ? bs.x : blk == 1 ? bs.y : blk == 2 ? bs.z : bs.w;
    uint8_t *dst = rb + (c0 + 2 * i + h) * kChunk;
#pragma unroll
    for (int q = 0; q < 8; q++) {
      const uint32_t w0 = (q & 1) ? v[q >> 1].z : v[q >> 1].x, w1 = (q & 1) ? v[q >> 1].w : v[q >> 1].y;
      const uint2 lo = dq4_e4m3(w0, sc), hi = dq4_e4m3(w1, sc);
      *reinterpret_cast<uint4 *>(dst + ((q ^ sw) << 4)) = zero ? make_uint4(0, 0, 0, 0) : make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
  }
}

// After waiting for a group's barrier, before the wgmma reading it: GATHER
// fences its cp.async data (generic proxy) against the async proxy; the fp8
// modes dequantize (the owning warpgroup) and publish the bf16 chunks to the
// whole warpgroup.
template <int LM, bool kRaw = false>
__device__ __forceinline__ void group_ready(uint8_t *kb, int c0, int c1, int t128, float kv_scale, int nvalid,
                                            int bar_id) {
  if constexpr (LM == LOAD_GATHER) {
    fence_proxy_async();
  } else if constexpr (lm_fp8(LM)) {
    if (!(lm_block(LM) && c0 == 8)) {  // (the block format's rope is bf16 already)
      convert_group<LM, kRaw>(kb, c0, c1, t128, kv_scale, nvalid, bar_id);
      fence_proxy_async();
      named_bar_sync(bar_id, 128);
    } else if (LM == LOAD_FP8_BLOCK) {
      fence_proxy_async();  // cp.async data read by wgmma (as GATHER)
    }
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
// The fp8 modes dequantize each group of the buffer here (this warpgroup
// owns it; the other warpgroup reads it only after a handoff barrier); the
// per-tensor ones to exact f16 (lm_raw: kF16 is then the operand type f16).
// Returns with the wgmmas in flight: the caller does its bookkeeping for the
// pair under them, then qk_wait (docs/decode-kernel.md §6, session 9).
template <int WG, int LM, bool kF16>
__device__ __forceinline__ void qk_tile3_issue(float (&s)[32], uint32_t sq, uint32_t kb, uint32_t bars,
                                               uint32_t par, const uint32_t (&qr)[4][4], uint8_t *kbp, int t128,
                                               float kv_scale, int nvalid) {
  const uint64_t dq = desc_sw128(sq, 16, 1024), dk = desc_sw128(kb, 16, 1024);
  const int cv = WG == 0 ? BAR_CV0 : BAR_CV1;
#pragma unroll
  for (int i = 0; i < 32; i++) s[i] = 0.f;
  mbar_wait(bars + 16, par);
  group_ready<LM, lm_raw(LM)>(kbp, 8, 9, t128, kv_scale, nvalid, cv);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wg_m64n64k16_rs<kF16>(s, qr[k], dk + ((8 * kChunk + k * 32) >> 4), k > 0);
  wgmma_commit();
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int g = WG == 0 ? h : 1 - h;
    mbar_wait(bars + 8 * g, par);
    group_ready<LM, lm_raw(LM)>(kbp, 4 * g, 4 * g + 4, t128, kv_scale, nvalid, cv);
    wgmma_fence();
#pragma unroll
    for (int c = 4 * g; c < 4 * g + 4; c++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t off = (c * kChunk + k * 32) >> 4;
        wg_m64n64k16_ss<kF16>(s, dq + off, dk + off, 1);
      }
    wgmma_commit();
  }
}
__device__ __forceinline__ void qk_wait(float (&s)[32]) {
  wgmma_wait<0>();
  reg_fence(s);
}

// O[:, half] (+)= P V[:, half] with P from registers (pa) or from shared
// memory (sP); V = chunks 4*half .. 4*half+3 of buffer kb, MN-major view.
template <bool kF16>
__device__ __forceinline__ void pv_rs(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t kb, int half,
                                      uint32_t lbo, uint32_t sbo) {
  const uint64_t dv = desc_sw128(kb + half * 4 * kChunk, lbo, sbo);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wg_m64n256k16_rs_tb<kF16>(o, pa[k], dv + ((k * 2048) >> 4), 1);
  wgmma_commit();
}
template <bool kF16>
__device__ __forceinline__ void pv_ss(float (&o)[128], uint32_t sP, uint32_t kb, int half, uint32_t lbo,
                                      uint32_t sbo) {
  const uint64_t dp = desc_sw128(sP, 16, 1024), dv = desc_sw128(kb + half * 4 * kChunk, lbo, sbo);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; k++) wg_m64n256k16_ss_tb<kF16>(o, dp + ((k * 32) >> 4), dv + ((k * 2048) >> 4), 1);
  wgmma_commit();
}

// The Q rope words of this thread's rows rA, rB (zero past the m-block's
// rows): v[row][2k], v[row][2k + 1] hold dims 16k + cq, +1 and 16k + 8 + cq, +1,
// the A fragment's words for k-step k (load_q's order).
__device__ __forceinline__ void load_q_rope_words(const mla_decode_params &p, const ReqWork &w, int mb, int rA, int rB,
                                                  int cq, uint32_t (&v)[2][8]) {
  const int H = p.num_heads;
  const int rows2[2] = {rA, rB};
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
}

// A request's per-row state: the causal key limits and the running max reset.
// Rows past the m-block's end see no key on masked tiles (their scores stay
// finite or -inf, so they never trigger a rescale).
__device__ __forceinline__ void reset_rows(const mla_decode_params &p, const ReqWork &w, int mb, uint8_t *smem,
                                           int tid) {
  int *lim = reinterpret_cast<int *>(smem + kOffLim);
  float *sM = reinterpret_cast<float *>(smem + kOffM);
  if (tid < 64) {
    lim[tid] = tid < w.rows ? row_limit(p, w, mb, tid) : 0;
    sM[tid] = -INFINITY;
  }
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
  uint32_t v[2][8];
  load_q_rope_words(p, w, mb, rA, rB, cq, v);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    qr[k][0] = v[0][2 * k];
    qr[k][1] = v[1][2 * k];
    qr[k][2] = v[0][2 * k + 1];
    qr[k][3] = v[1][2 * k + 1];
  }
  reset_rows(p, w, mb, smem, tid);
  cp_async_wait_all();
  fence_proxy_async();
}

// load_q for the per-tensor fp8 modes (lm_raw): the same rows as f16 times
// 2^e (q_f16_exponent over the m-block's latent and rope), the latent through
// registers into the swizzled chunks. Returns 2^-e, the factor the scores need
// back. red: 8 floats of scratch, free until the caller's next __syncthreads.
__device__ __forceinline__ float load_q_f16(const mla_decode_params &p, const ReqWork &w, int mb, uint32_t sb,
                                            uint8_t *smem, int tid, int rA, int rB, int cq, uint32_t (&qr)[4][4],
                                            float *red) {
  const int H = p.num_heads;
  constexpr int kPer = 64 * 64 / kThreads;  // 16-byte latent pieces per thread
  uint4 v[kPer];
  float mx = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kThreads, r = ci >> 6, ch = ci & 63;
    v[i] = make_uint4(0, 0, 0, 0);
    if (r < w.rows) {
      const int rg = mb * 64 + r, t = rg / H, h = rg % H;
      v[i] = *reinterpret_cast<const uint4 *>(p.q_nope + (w.q0 + t) * p.q_nope_stride_token +
                                              h * p.q_nope_stride_head + ch * 8);
      mx = fmaxf(mx, fmaxf(fmaxf(bf16x2_absmax(v[i].x), bf16x2_absmax(v[i].y)),
                           fmaxf(bf16x2_absmax(v[i].z), bf16x2_absmax(v[i].w))));
    }
  }
  uint32_t rv[2][8];
  load_q_rope_words(p, w, mb, rA, rB, cq, rv);
#pragma unroll
  for (int hh = 0; hh < 2; hh++)
#pragma unroll
    for (int k = 0; k < 8; k++) mx = fmaxf(mx, bf16x2_absmax(rv[hh][k]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; i++) m = fmaxf(m, red[i]);
  const int e = q_f16_exponent(m);
  const float up = __uint_as_float((uint32_t)(127 + e) << 23);  // 2^e
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kThreads, r = ci >> 6, ch = ci & 63;
    st_shared_v4(sb + kOffQ + (ch >> 3) * kChunk + sw128_off(r, (ch & 7) * 8), bf16x2_to_f16x2(v[i].x, up),
                 bf16x2_to_f16x2(v[i].y, up), bf16x2_to_f16x2(v[i].z, up), bf16x2_to_f16x2(v[i].w, up));
  }
#pragma unroll
  for (int k = 0; k < 4; k++) {
    qr[k][0] = bf16x2_to_f16x2(rv[0][2 * k], up);
    qr[k][1] = bf16x2_to_f16x2(rv[1][2 * k], up);
    qr[k][2] = bf16x2_to_f16x2(rv[0][2 * k + 1], up);
    qr[k][3] = bf16x2_to_f16x2(rv[1][2 * k + 1], up);
  }
  reset_rows(p, w, mb, smem, tid);
  fence_proxy_async();  // the chunks are read by wgmma (async proxy) after the caller's __syncthreads
  return __uint_as_float((uint32_t)(127 - e) << 23);
}

// Staged rows: row r of the m-block at r * 1024 bytes, its 16-byte unit u at
// unit u ^ (r & 7) (the accumulator fragments put a warp's eight rows in one
// store, so unswizzled they would all hit the same four banks).
__device__ __forceinline__ uint32_t staged_off(int r, int unit) { return r * 1024 + ((unit ^ (r & 7)) << 4); }

// Copies staged rows [0, rows) to dst + r * dst_row_bytes (16-byte aligned):
// a warp writes 512 contiguous bytes per instruction.
__device__ __forceinline__ void copy_staged_rows(const uint8_t *st, uint8_t *dst, int rows, int dst_row_bytes,
                                                 int tid) {
  for (int idx = tid; idx < rows * 64; idx += kThreads) {
    const int r = idx >> 6, u = idx & 63;
    const uint4 v = *reinterpret_cast<const uint4 *>(st + staged_off(r, u));
    *reinterpret_cast<uint4 *>(dst + (size_t)r * dst_row_bytes + (u << 4)) = v;
  }
}

// A warpgroup's partial row sums (thread parts, quad-reduced here) into
// sL[wg][row]; the caller synchronises before reading both warpgroups'.
__device__ __forceinline__ void publish_row_sums(float *sL, float lsA, float lsB, int wg, int rA, int rB, bool lead) {
  lsA += __shfl_xor_sync(0xffffffffu, lsA, 1);
  lsA += __shfl_xor_sync(0xffffffffu, lsA, 2);
  lsB += __shfl_xor_sync(0xffffffffu, lsB, 1);
  lsB += __shfl_xor_sync(0xffffffffu, lsB, 2);
  if (lead) {
    sL[wg * 64 + rA] = lsA;
    sL[wg * 64 + rB] = lsB;
  }
}

// The m-block's rows to `out` (bf16 / f16) or, for a split piece, o_accum
// (fp32) through the staging area st (64 rows x 1 KB, staged_off):
// stage16() writes this thread's 16-bit values, stage32() its fp32 values of
// its warpgroup's half (called in warpgroup `half` for each half in turn);
// the rows are then copied out in whole 16-byte units. All 256 threads.
template <class Stage16, class Stage32>
__device__ __forceinline__ void write_rows_staged(const mla_decode_params &p, const ReqWork &w, int mb, uint8_t *st,
                                                  int wg, Stage16 stage16, Stage32 stage32) {
  const int tid = threadIdx.x;
  if (!w.is_split) {
    stage16();
    __syncthreads();
    uint16_t *dst = p.out + ((size_t)w.q0 * p.num_heads + mb * 64) * 512;
    copy_staged_rows(st, reinterpret_cast<uint8_t *>(dst), w.rows, 1024, tid);
  } else {
    // [rows, 512] fp32: one warpgroup's 256 columns (1 KB a row) at a time
    float *dst = p.o_accum + ((size_t)w.split_idx * mla_decode_rows(&p) + mb * 64) * 512;
#pragma unroll 1
    for (int half = 0; half < 2; half++) {
      if (half) __syncthreads();  // the first half is copied out
      if (wg == half) stage32();
      __syncthreads();
      copy_staged_rows(st, reinterpret_cast<uint8_t *>(dst + 256 * half), w.rows, 2048, tid);
    }
  }
}
// lse of this thread's rows rA / rB (tA / tB: their full row sums); warpgroup 0's quad leaders.
__device__ __forceinline__ void store_row_lses(const mla_decode_params &p, const ReqWork &w, int mb, const float *sM,
                                               int rA, int rB, float tA, float tB) {
  if (rA < w.rows) store_lse(p, w, mb, rA, tA > 0.f ? sM[rA] + log2f(tA) : -INFINITY);
  if (rB < w.rows) store_lse(p, w, mb, rB, tB > 0.f ? sM[rB] + log2f(tB) : -INFINITY);
}

// Epilogue of one request: l = both warpgroups' partial sums; m is the final
// running max in shared memory.
//
// The m-block's rows are contiguous in either destination (out: token-major
// rows q0 * H + 64 mb + r; o_accum: rows split_idx * R + 64 mb + r), so they
// are staged in shared memory and written out in whole 16-byte units. Stored
// straight from the fragments (each warp store touching eight rows, 16 or 32
// bytes apiece), a request boundary at H = 128 spent 11-25 us in these stores;
// staged, ~5 (docs/decode-kernel.md §6, session 11).
template <bool kF16>
// osc: the output's factor (the cache scale when the tiles are raw per-tensor
// fp8). The rows are staged over Q (kOffQ), free once both warpgroups are
// past their last Q.K^T (the caller's next use of it comes after a
// __syncthreads).
__device__ __forceinline__ void epilogue(const mla_decode_params &p, const ReqWork &w, int mb, uint8_t *smem,
                                         const float (&o)[128], float lsA, float lsB, int wg, int rA, int rB, int cq,
                                         bool lead, float osc) {
  float *sL = reinterpret_cast<float *>(smem + kOffL);
  const float *sM = reinterpret_cast<const float *>(smem + kOffM);
  publish_row_sums(sL, lsA, lsB, wg, rA, rB, lead);
  __syncthreads();
  const float tA = sL[rA] + sL[64 + rA], tB = sL[rB] + sL[64 + rB];
  const float iA = tA > 0.f ? osc / tA : 0.f, iB = tB > 0.f ? osc / tB : 0.f;
  uint8_t *st = smem + kOffQ;
  // (o[i], o[i + 1]): row rowB ? rB : rA, columns 256 wg + 8 (i / 4) + cq, + 1
  write_rows_staged(
      p, w, mb, st, wg,
      [&] {  // bf16 / f16: each warpgroup stages its 256 columns (units 32 wg ..)
#pragma unroll
        for (int i = 0; i < 128; i += 2) {
          const bool rowB = (i >> 1) & 1;
          const int r = rowB ? rB : rA;
          const float f = rowB ? iB : iA;
          *reinterpret_cast<uint32_t *>(st + staged_off(r, 32 * wg + (i >> 2)) + 2 * cq) =
              pack2<kF16>(o[i] * f, o[i + 1] * f);
        }
      },
      [&] {  // fp32: this warpgroup's 256 columns
#pragma unroll
        for (int i = 0; i < 128; i += 2) {
          const bool rowB = (i >> 1) & 1;
          const int r = rowB ? rB : rA;
          const float f = rowB ? iB : iA;
          *reinterpret_cast<float2 *>(st + staged_off(r, 2 * (i >> 2) + (cq >> 2)) + 4 * (cq & 3)) =
              make_float2(o[i] * f, o[i + 1] * f);
        }
      });
  if (wg == 0 && lead) store_row_lses(p, w, mb, sM, rA, rB, tA, tB);
}

}  // namespace seesaw
