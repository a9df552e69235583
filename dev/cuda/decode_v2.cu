// v2: Hopper split-KV decode. One CTA = one split-KV part x one 64-row
// m-block, two warpgroups (256 threads), no producer warpgroup.
//  - K tiles (64 keys x 576) land by TMA (page size >= 8) as nine 64x64
//    128B-swizzled sub-tiles, two buffers, full/empty mbarriers; thread 0
//    issues tile n+1 when tile n starts. Page sizes < 8 use 16-byte cp.async
//    into the same swizzled layout (zero-filled past the piece).
//  - S = Q K^T with wgmma m64n32k16: warpgroup w takes keys 32w..32w+31, so
//    QK^T is not duplicated; the row maxima meet in shared memory.
//  - P (bf16) goes to shared memory (128B-swizzled, K-major); each
//    warpgroup then runs O_w += P V_w with wgmma m64n256k16, V being a
//    transposed (MN-major) view of the same K tile: columns 256w..256w+255.
// Correctness first: the phases of one tile run one after the other.
#include "common.cuh"
#include "tmap.h"
#include "wgmma_ops.cuh"

namespace {

constexpr int kThreads = 256;
constexpr uint32_t kSubTile = 8192;          // 64 rows x 128 B
constexpr uint32_t kTileBytes = 9 * kSubTile; // 64 keys x 576
constexpr uint32_t kOffQ = 0;
constexpr uint32_t kOffK = kTileBytes;        // two buffers
constexpr uint32_t kOffP = 3 * kTileBytes;
constexpr uint32_t kOffRedMax = kOffP + kSubTile;  // float [2][64]
constexpr uint32_t kOffRedL = kOffRedMax + 512;     // float [2][64]
constexpr uint32_t kOffLim = kOffRedL + 512;        // int [64]
constexpr uint32_t kOffBar = kOffLim + 256;         // full[2], empty[2]
constexpr uint32_t kSmemBytes = kOffBar + 32 + 1024; // + alignment slack

struct Cursor {
  int req, it;
  ReqWork w;
};

// Advance to the next tile of the part (across requests) for this m-block.
__device__ __forceinline__ void cursor_skip(const mla_decode_params &p, const int *meta, int mb,
                                            Cursor &c) {
  const int er = meta[SCHED_END_REQ];
  while (c.req <= er && c.it >= c.w.n_tiles) {
    c.req++;
    c.it = 0;
    if (c.req <= er) c.w = req_work(p, meta, c.req, mb);
  }
}

// Loads the tile the cursor points at into buffer `buf` (TMA path, thread 0).
__device__ __forceinline__ void issue_tma(const mla_decode_params &p, const CUtensorMap *map,
                                          const Cursor &c, uint32_t kbuf, uint32_t bar) {
  const int P = p.page_size;
  const int kt0 = c.w.kstart + 64 * c.it;
  const int nvalid = min(64, c.w.kend_blk - kt0);
  const int *bt = p.block_table + (size_t)c.req * p.block_table_width;
  if (P >= 64) {
    const int page = bt[kt0 / P], row0 = kt0 % P;
    mbar_expect_tx(bar, kTileBytes);
#pragma unroll
    for (int j = 0; j < 9; j++) tma_load_3d(kbuf + j * kSubTile, map, bar, 64 * j, row0, page);
  } else {
    const int nbox = (nvalid + P - 1) / P;  // boxes past the end are never read
    mbar_expect_tx(bar, (uint32_t)(nbox * 9 * P * 128));
    for (int b = 0; b < nbox; b++) {
      const int page = bt[(kt0 + b * P) / P];
      for (int j = 0; j < 9; j++) tma_load_3d(kbuf + j * kSubTile + b * P * 128, map, bar, 64 * j, 0, page);
    }
  }
}

// cp.async path (page size < 8): every thread copies 18 16-byte chunks.
__device__ __forceinline__ void issue_cpasync(const mla_decode_params &p, const Cursor &c, uint32_t kbuf,
                                              int tid) {
  const int P = p.page_size;
  const int kt0 = c.w.kstart + 64 * c.it;
  const uint8_t *kv = static_cast<const uint8_t *>(p.kv);
  const int *bt = p.block_table + (size_t)c.req * p.block_table_width;
  for (int ci = tid; ci < 64 * 72; ci += kThreads) {
    const int r = ci / 72, ch = ci % 72;
    const int key = kt0 + r;
    const bool ok = key < c.w.kend_blk;
    const uint8_t *src = kv;
    if (ok) src = kv + ((int64_t)bt[key / P] * P + key % P) * p.row_bytes + ch * 16;
    cp_async_16(kbuf + (ch >> 3) * kSubTile + sw128_off(r, (ch & 7) * 8), src, ok);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    decode_v2_kernel(const mla_decode_params p, const __grid_constant__ CUtensorMap kv_map, uint32_t vt_lbo,
                     uint32_t vt_sbo, int noload) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~(uintptr_t)1023);
  const uint32_t sbase = smem_u32(smem);
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int rA = 16 * wi + (lane >> 2), rB = rA + 8;  // the two rows this thread holds
  const int cq = 2 * (lane & 3);
  float *red_max = reinterpret_cast<float *>(smem + kOffRedMax);
  float *red_l = reinterpret_cast<float *>(smem + kOffRedL);
  int *lim = reinterpret_cast<int *>(smem + kOffLim);
  const uint32_t bar_full = sbase + kOffBar, bar_empty = sbase + kOffBar + 16;
  const bool use_tma = p.page_size >= 8;
  const float sl2 = p.scale * kLog2e;
  const int H = p.num_heads;

  if (tid == 0) {
    mbar_init(bar_full, 1);
    mbar_init(bar_full + 8, 1);
    mbar_init(bar_empty, kThreads);
    mbar_init(bar_empty + 8, kThreads);
    fence_mbar_init();
  }
  __syncthreads();

  // Producer cursor (tile n+1) and consumer position; n counts tiles of the CTA.
  Cursor pc;
  pc.req = meta[SCHED_BEGIN_REQ];
  pc.it = 0;
  pc.w = req_work(p, meta, pc.req, mb);
  cursor_skip(p, meta, mb, pc);
  const int er = meta[SCHED_END_REQ];
  // Tile 0.
  if (pc.req <= er) {
    if (use_tma) {
      if (tid == 0) issue_tma(p, &kv_map, pc, sbase + kOffK, bar_full);
      if (noload && tid == 0) issue_tma(p, &kv_map, pc, sbase + kOffK + kTileBytes, bar_full + 8);
    } else {
      issue_cpasync(p, pc, sbase + kOffK, tid);
    }
    pc.it++;
    cursor_skip(p, meta, mb, pc);
  }
  if (!use_tma) cp_async_commit();

  uint32_t n = 0;
  const uint64_t dq0 = desc_sw128(sbase + kOffQ, 16, 1024);
  const uint64_t dp0 = desc_sw128(sbase + kOffP, 16, 1024);

  for (int req = meta[SCHED_BEGIN_REQ]; req <= er; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;
    __syncthreads();  // the last request is done with Q and the row arrays
    // Q rows of the m-block into nine swizzled sub-tiles (zero rows past the end).
    for (int ci = tid; ci < 64 * 72; ci += kThreads) {
      const int r = ci / 72, ch = ci % 72;
      const bool ok = r < w.rows;
      const int rg = mb * 64 + r, t = ok ? rg / H : 0, h = ok ? rg % H : 0;
      const uint16_t *src = ch < 64 ? p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + ch * 8
                                    : p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head + (ch - 64) * 8;
      cp_async_16(sbase + kOffQ + (ch >> 3) * kSubTile + sw128_off(r, (ch & 7) * 8), ok ? (const void *)src : p.kv, ok);
    }
    cp_async_commit();
    if (tid < 64) lim[tid] = row_limit(p, w, mb, tid);
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    const int limA = lim[rA], limB = lim[rB];

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

    for (int it = 0; it < w.n_tiles; it++, n++) {
      const uint32_t buf = n & 1;
      const uint32_t kbuf = sbase + kOffK + buf * kTileBytes;
      // Prefetch tile n+1 into the other buffer once tile n-1 is released.
      if (use_tma) {
        if (!noload && tid == 0 && pc.req <= er) {
          const uint32_t nb = (n + 1) & 1;
          mbar_wait(bar_empty + 8 * nb, (((n + 1) >> 1) & 1) ^ 1);
          issue_tma(p, &kv_map, pc, sbase + kOffK + nb * kTileBytes, bar_full + 8 * nb);
          pc.it++;
          cursor_skip(p, meta, mb, pc);
        }
        mbar_wait(bar_full + 8 * buf, noload ? 0 : (n >> 1) & 1);  // noload: timing diagnostic
      } else {
        if (pc.req <= er) {
          const uint32_t nb = (n + 1) & 1;
          mbar_wait(bar_empty + 8 * nb, (((n + 1) >> 1) & 1) ^ 1);
          issue_cpasync(p, pc, sbase + kOffK + nb * kTileBytes, tid);
          pc.it++;
          cursor_skip(p, meta, mb, pc);
        }
        cp_async_commit();
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        fence_proxy_async();
        named_bar_sync(1, kThreads);
      }
      const int kt0 = w.kstart + 64 * it;
      const int nvalid = w.kend_blk - kt0;
      if (use_tma && nvalid < 64) {
        // Rows past the piece hold stale data or NaN: zero their V part (0 * NaN = NaN).
        const int nz = (64 - nvalid) * 64;  // 16-byte chunks: rows x 8 sub-tiles x 8
        for (int ci = tid; ci < nz; ci += kThreads) {
          const int r = nvalid + (ci >> 6), st = (ci >> 3) & 7, ch = ci & 7;
          *reinterpret_cast<uint4 *>(smem + kOffK + buf * kTileBytes + st * kSubTile + r * 128 + ch * 16) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
        named_bar_sync(3, kThreads);
      }

      // S_w = Q K[32w .. 32w+31]^T
      float s[16];
#pragma unroll
      for (int i = 0; i < 16; i++) s[i] = 0.f;
      const uint64_t dk0 = desc_sw128(kbuf + wg * 32 * 128, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 36; k++) {
        const uint32_t off = ((k >> 2) * kSubTile + (k & 3) * 32) >> 4;
        wgmma_m64n32k16_ss(s, dq0 + off, dk0 + off, k > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(s);

      // Scale to log2 units and mask.
      float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
      for (int i = 0; i < 16; i++) {
        const int key = kt0 + 32 * wg + 8 * (i >> 2) + cq + (i & 1);
        const bool rowB = (i >> 1) & 1;
        const bool ok = key < (rowB ? limB : limA);
        s[i] = ok ? s[i] * sl2 : -INFINITY;
        if (rowB) mxB = fmaxf(mxB, s[i]);
        else mxA = fmaxf(mxA, s[i]);
      }
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
      if ((lane & 3) == 0) {
        red_max[wg * 64 + rA] = mxA;
        red_max[wg * 64 + rB] = mxB;
      }
      named_bar_sync(1, kThreads);
      const float nmA = fmaxf(mA, fmaxf(red_max[rA], red_max[64 + rA]));
      const float nmB = fmaxf(mB, fmaxf(red_max[rB], red_max[64 + rB]));
      const float uA = nmA == -INFINITY ? 0.f : nmA, uB = nmB == -INFINITY ? 0.f : nmB;
      const float aA = exp2f(mA - uA), aB = exp2f(mB - uB);
      mA = nmA;
      mB = nmB;
      float sumA = 0.f, sumB = 0.f;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const bool rowB = (i >> 1) & 1;
        const float u = rowB ? uB : uA;
        const float e0 = exp2f(s[i] - u), e1 = exp2f(s[i + 1] - u);
        if (rowB) sumB += e0 + e1;
        else sumA += e0 + e1;
        const int col = 32 * wg + 8 * (i >> 2) + cq;
        *reinterpret_cast<uint32_t *>(smem + kOffP + sw128_off(rowB ? rB : rA, col)) = pack_bf16(e0, e1);
      }
      lA = lA * aA + sumA;
      lB = lB * aB + sumB;
      fence_proxy_async();
      named_bar_sync(2, kThreads);

      // O_w = alpha O_w + P V[:, 256w .. 256w+255]
#pragma unroll
      for (int i = 0; i < 128; i++) o[i] *= ((i >> 1) & 1) ? aB : aA;
      const uint64_t dv0 = desc_sw128(kbuf + wg * 4 * kSubTile, vt_lbo, vt_sbo);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; k++) wgmma_m64n256k16_ss_tb(o, dp0 + ((k * 32) >> 4), dv0 + ((k * 2048) >> 4), 1);
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(o);
      mbar_arrive(bar_empty + 8 * buf);
    }

    // Epilogue: l over the quad and both warpgroups, then normalise and store.
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    if ((lane & 3) == 0) {
      red_l[wg * 64 + rA] = lA;
      red_l[wg * 64 + rB] = lB;
    }
    named_bar_sync(1, kThreads);
    const float tA = red_l[rA] + red_l[64 + rA], tB = red_l[rB] + red_l[64 + rB];
    const float iA = tA > 0.f ? 1.f / tA : 0.f, iB = tB > 0.f ? 1.f / tB : 0.f;
#pragma unroll
    for (int i = 0; i < 128; i += 2) {
      const bool rowB = (i >> 1) & 1;
      const int r = rowB ? rB : rA;
      if (r < w.rows)
        store_out_pair(p, w, mb, r, 256 * wg + 8 * (i >> 2) + cq, o[i], o[i + 1], rowB ? iB : iA);
    }
    if (wg == 0 && (lane & 3) == 0) {
      if (rA < w.rows) store_lse(p, w, mb, rA, tA > 0.f ? mA + log2f(tA) : -INFINITY);
      if (rB < w.rows) store_lse(p, w, mb, rB, tB > 0.f ? mB + log2f(tB) : -INFINITY);
    }
  }
  if (!use_tma) cp_async_wait_all();
#endif
}

}  // namespace

// The noload diagnostic needs the TMA path (page size >= 8).
static int use_noload(const mla_decode_params *p) { return p->page_size >= 8 ? decode_noload() : 0; }

cudaError_t decode_v2_launch(const mla_decode_params *p, cudaStream_t stream) {
  CUtensorMap map;
  DEV_CUDA_OK(make_kv_tmap(p, &map));
  uint32_t lbo, sbo;
  decode_get_vview(&lbo, &sbo);
  static bool attr_set = false;  // once: keeps host work out of timed launches
  if (!attr_set) {
    DEV_CUDA_OK(cudaFuncSetAttribute(decode_v2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmemBytes));
    attr_set = true;
  }
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  decode_v2_kernel<<<grid, kThreads, kSmemBytes, stream>>>(*p, map, lbo, sbo, use_noload(p));
  DEV_CUDA_OK(cudaGetLastError());
  return decode_combine_launch(p, stream);
}
