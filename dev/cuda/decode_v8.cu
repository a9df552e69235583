// v8: narrow m-blocks (at most 32 (query, head) rows: H <= 16 at s_q <= 2,
// H <= 32 at s_q = 1), the memory-bound decode shapes. v3-v7 compute 64 rows
// whatever the row count (wgmma's M is 64), so at H = 16 three quarters of
// the tensor work, the softmax and the P traffic are padding, and the
// per-tile compute (~2 us, DECODE_NOLOAD) is as long as the tile's load
// (2.24 us at 4.2 TB/s): loads could not run ahead. Here the GEMMs are
// transposed so that the 64 keys of a tile are M and the rows are N (16 or
// 32, template N):
//   S^T = K Q^T   m64nNk16, A = K tile (K-major, as TMA lands it), B = Q (smem)
//   O^T += V^T P^T  m64nNk16 per 64-dim m-tile, A = V^T (the MN-major,
//                 transposed view of the same K tile), B = P^T (smem)
// 36 + 32 narrow wgmmas per tile instead of 36 + 16 m64 ones at N = 64.
// The two warpgroups work independently, each on its own buffer and its
// own tiles (WG g: tiles t = g mod 2 of the part): own running max, row
// sums and full O^T (512 x N in registers), no handoffs inside the loop.
// The two states are merged per request through shared memory.
// Softmax runs down the columns of S^T (keys are spread over the 4 warps):
// P is computed against the running max of the previous tiles as long as no
// score exceeds it by more than 8 (log2, one warpgroup vote per tile); only
// then are the column maxima exchanged across warps and O^T rescaled
// (always on a request's first tile). P^T goes to shared memory with
// stmatrix.trans (the accumulator fragment transposed on the way).
// Refills: a buffer's rope chunk after its QK^T, chunks 0-7 after its P V.
// Wider m-blocks go to v7.
#include "seesaw.cuh"
#include "wgmma_narrow.cuh"

namespace {
using namespace seesaw;

template <int N>
struct Lay {
  static constexpr uint32_t kQChunk = N * 128;  // 64 dims of Q: N rows x 128 B (swizzled)
  static constexpr uint32_t kOffQ = 0;          // 9 chunks: latent 0-7, rope 8
  static constexpr uint32_t kOffB0 = 9 * kQChunk;  // 1024-aligned (N = 16, 32)
  static constexpr uint32_t kOffB1 = kOffB0 + kTile;
  static constexpr uint32_t kOffP = kOffB1 + kTile;   // P^T of WG g at kOffP + g * kQChunk
  static constexpr uint32_t kOffScr = kOffP + 2 * kQChunk;  // merge scratch [N][kScr] fp32
  static constexpr uint32_t kScr = 260;               // 256 dims + 4: conflict-free column writes
  static constexpr uint32_t kOffRed = kOffScr + N * kScr * 4;  // float [2][4][N] column maxima
  static constexpr uint32_t kOffRedL = kOffRed + 2 * 4 * N * 4;  // float [2][4][N] column sums
  static constexpr uint32_t kOffMf = kOffRedL + 2 * 4 * N * 4;   // float [2][N] final max per WG
  static constexpr uint32_t kOffLf = kOffMf + 2 * N * 4;         // float [N] 1 / l
  static constexpr uint32_t kOffLim = kOffLf + N * 4;            // int [N]
  static constexpr uint32_t kOffBar = kOffLim + N * 4;           // 18 mbarriers
  static constexpr uint32_t kSmem = kOffBar + 18 * 8 + 1024;
  static_assert(kOffB0 % 1024 == 0 && kOffP % 1024 == 0, "swizzled tiles must be 1024-aligned");
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");
};

// Per-warpgroup named barriers (WG g uses base + 3 g): vote, max exchange, P ready.
constexpr int NB_VOTE = 1, NB_MAX = 2, NB_P = 3;

// Rows past the piece end may hold NaN: zero V rows >= nvalid in chunks 0-7.
__device__ __forceinline__ void zero_tail8(uint8_t *kb, int nvalid, int t128) {
  const int nz = (64 - nvalid) * 64;  // rows x 8 chunks x 8 16-byte pieces
  for (int i = t128; i < nz; i += 128) {
    const int r = nvalid + (i >> 6), ch = (i >> 3) & 7, x = i & 7;
    *reinterpret_cast<uint4 *>(kb + ch * kChunk + r * 128 + x * 16) = make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

template <int N>
__device__ __forceinline__ void qk_wgmma(float (&s)[N / 2], uint64_t da, uint64_t db, int accum) {
  if constexpr (N == 16) wgmma_nr_m64n16k16_ss(s, da, db, accum);
  else wgmma_nr_m64n32k16_ss(s, da, db, accum);
}
template <int N>
__device__ __forceinline__ void pv_wgmma(float (&o)[N / 2], uint64_t da, uint64_t db) {
  if constexpr (N == 16) wgmma_nr_m64n16k16_ss_ta(o, da, db, 1);
  else wgmma_nr_m64n32k16_ss_ta(o, da, db, 1);
}

template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    decode_v8_kernel(const mla_decode_params p, const __grid_constant__ CUtensorMap kv_map, uint32_t vt_lbo,
                     uint32_t vt_sbo, int noload) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = Lay<N>;
  constexpr int NR = N / 2;  // accumulator registers per m64nN tile
  constexpr int NC = N / 4;  // columns (rows of the m-block) per thread
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  pdl_trigger();
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  const int er = meta[SCHED_END_REQ];
  const bool issuer = !noload && t128 == 0;
  const float sl2 = p.scale * kLog2e;
  float *red = reinterpret_cast<float *>(smem + L::kOffRed);
  float *redL = reinterpret_cast<float *>(smem + L::kOffRedL);
  float *mfin = reinterpret_cast<float *>(smem + L::kOffMf);
  float *lfin = reinterpret_cast<float *>(smem + L::kOffLf);
  float *scr = reinterpret_cast<float *>(smem + L::kOffScr);
  int *lim = reinterpret_cast<int *>(smem + L::kOffLim);
  const uint32_t bars = sb + L::kOffBar + wg * 9 * 8;  // this warpgroup's buffer barriers
  const uint32_t kb = sb + (wg ? L::kOffB1 : L::kOffB0);
  uint8_t *kbp = smem + (wg ? L::kOffB1 : L::kOffB0);
  const uint32_t sP = sb + L::kOffP + wg * L::kQChunk;
  const uint32_t sQ = sb + L::kOffQ;
  const int nb = 1 + 3 * wg;  // this warpgroup's named barrier ids: nb + NB_* - 1
  // Columns (m-block rows) of this thread: c_j = 8 (j / 2) + 2 (lane % 4) + j % 2.
  int col[NC];
#pragma unroll
  for (int j = 0; j < NC; j++) col[j] = 8 * (j >> 1) + 2 * (lane & 3) + (j & 1);

  if (tid == 0) {
    for (int i = 0; i < 18; i++) mbar_init(sb + L::kOffBar + 8 * i, 1);
    fence_mbar_init();
  }
  __syncthreads();

  BufCursor cur = cursor_first(p, meta, mb, wg);
  if (tid == 0) {
    const BufCursor c0 = cursor_first(p, meta, mb, 0), c1 = cursor_first(p, meta, mb, 1);
    const TileSrc s0 = tile_src(p, er, c0), s1 = tile_src(p, er, c1);
    if (s0.valid) load_chunks(p, &kv_map, s0, sb + L::kOffB0, sb + L::kOffBar, 0, 9);
    if (s1.valid) load_chunks(p, &kv_map, s1, sb + L::kOffB1, sb + L::kOffBar + 72, 0, 9);
  }
  uint32_t use = 0;  // loads of this warpgroup's buffer consumed (barrier parity)

  for (int req = meta[SCHED_BEGIN_REQ]; req <= er; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;
    __syncthreads();  // the last request is done with Q, the scratch and the row arrays
    {
      // Q (latent + rope) into 9 swizzled chunks of N rows; zero rows past the m-block.
      const int H = p.num_heads;
      for (int ci = tid; ci < N * 72; ci += kThreads) {
        const int r = ci / 72, pc = ci - r * 72, ch = pc >> 3;
        const bool ok = r < w.rows;
        const int rg = mb * 64 + r, t = ok ? rg / H : 0, h = ok ? rg % H : 0;
        const uint16_t *src = ch < 8 ? p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + pc * 8
                                     : p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head +
                                           (pc - 64) * 8;
        cp_async_16(sQ + ch * L::kQChunk + sw128_off(r, (pc & 7) * 8), ok ? (const void *)src : p.kv, ok);
      }
      cp_async_commit();
      if (tid < N) lim[tid] = tid < w.rows ? row_limit(p, w, mb, tid) : 0;  // padding rows see no key
      cp_async_wait_all();
      fence_proxy_async();
    }
    __syncthreads();
    const int lim0 = lim[0];  // row 0 has the lowest limit
    int limc[NC];
#pragma unroll
    for (int j = 0; j < NC; j++) limc[j] = lim[col[j]];

    float o[8][NR];
#pragma unroll
    for (int mt = 0; mt < 8; mt++)
#pragma unroll
      for (int i = 0; i < NR; i++) o[mt][i] = 0.f;
    float m[NC], lp[NC];  // running max (log2 units, warpgroup-uniform per column), partial sums
#pragma unroll
    for (int j = 0; j < NC; j++) {
      m[j] = -INFINITY;
      lp[j] = 0.f;
    }

    for (int t = wg; t < w.n_tiles; t += 2) {
      const int kt = w.kstart + 64 * t;
      const int nv = min(64, w.kend_blk - kt);
      const bool full = kt + 64 <= lim0;
      const uint32_t par = noload ? 0 : use & 1;
      BufCursor nx = cur;
      cursor_next(p, meta, mb, nx);
      TileSrc ld;
      ld.valid = 0;
      if (issuer) ld = tile_src(p, er, nx);

      // ---- S^T = K Q^T (keys x rows): rope chunk first, then 0-7 ----
      float s[NR];
#pragma unroll
      for (int i = 0; i < NR; i++) s[i] = 0.f;
#pragma unroll
      for (int ci = 0; ci < 9; ci++) {
        const int c = ci == 0 ? 8 : ci - 1;
        mbar_wait(bars + 8 * c, par);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; k++)
          qk_wgmma<N>(s, desc_sw128(kb + c * kChunk + k * 32, 16, 1024), desc_sw128(sQ + c * L::kQChunk + k * 32, 16, 1024),
                      ci > 0 || k > 0);
        wgmma_commit();
      }
      wgmma_wait<0>();
      reg_fence(s);
      if (ld.valid) load_chunks(p, &kv_map, ld, kb, bars, 8, 9);  // rope chunk: read by QK^T only

      // ---- softmax down the columns ----
      bool need = false;
#pragma unroll
      for (int i = 0; i < NR; i++) {
        const int j = 2 * (i >> 2) + (i & 1);
        float x = s[i] * sl2;
        if (!full) {
          const int key = kt + 16 * wi + (lane >> 2) + 8 * ((i >> 1) & 1);
          x = key < limc[j] ? x : -INFINITY;
        }
        s[i] = x;
        need |= x > m[j] + kLazy;
      }
      if (wg_any(need, nb + NB_VOTE - 1)) {
        // Exchange the column maxima across the warps; move m, rescale O^T.
        float mx[NC];
#pragma unroll
        for (int j = 0; j < NC; j++) mx[j] = -INFINITY;
#pragma unroll
        for (int i = 0; i < NR; i++) {
          const int j = 2 * (i >> 2) + (i & 1);
          mx[j] = fmaxf(mx[j], s[i]);
        }
#pragma unroll
        for (int j = 0; j < NC; j++) {
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 4));
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 8));
          mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 16));
        }
        if (lane < 4) {
#pragma unroll
          for (int j = 0; j < NC; j++) red[(wg * 4 + wi) * N + col[j]] = mx[j];
        }
        named_bar_sync(nb + NB_MAX - 1, 128);
        float f[NC];
        bool mv = false;
#pragma unroll
        for (int j = 0; j < NC; j++) {
          const float* rj = red + wg * 4 * N + col[j];
          const float tm = fmaxf(fmaxf(rj[0], rj[N]), fmaxf(rj[2 * N], rj[3 * N]));
          const float mn = lazy_max(m[j], tm);
          f[j] = lazy_scale(m[j], mn);
          m[j] = mn;
          lp[j] *= f[j];
          mv |= f[j] != 1.f;
        }
        if (mv) {
#pragma unroll
          for (int mt = 0; mt < 8; mt++)
#pragma unroll
            for (int i = 0; i < NR; i++) o[mt][i] *= f[2 * (i >> 2) + (i & 1)];
        }
      }
#pragma unroll
      for (int i = 0; i < NR; i++) {
        const int j = 2 * (i >> 2) + (i & 1);
        s[i] = ex2(s[i] - (m[j] == -INFINITY ? 0.f : m[j]));
        lp[j] += s[i];
      }
      // ---- P^T -> shared memory (rows x keys), stmatrix.trans ----
      {
        const int mi = lane >> 3;
#pragma unroll
        for (int q = 0; q < N / 16; q++) {
          const int cb = 2 * q + (mi >> 1), kh = mi & 1;
          stsm_x4_t(sP + sw128_off(8 * cb + (lane & 7), 16 * wi + 8 * kh), pack_bf16(s[8 * q], s[8 * q + 1]),
                    pack_bf16(s[8 * q + 2], s[8 * q + 3]), pack_bf16(s[8 * q + 4], s[8 * q + 5]),
                    pack_bf16(s[8 * q + 6], s[8 * q + 7]));
        }
      }
      if (nv < 64) zero_tail8(kbp, nv, t128);
      fence_proxy_async();
      named_bar_sync(nb + NB_P - 1, 128);

      // ---- O^T += V^T P^T: 8 m-tiles of 64 dims x 4 key steps ----
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int mt = 0; mt < 8; mt++)
          pv_wgmma<N>(o[mt], desc_sw128(kb + mt * kChunk + ks * 2048, vt_lbo, vt_sbo), desc_sw128(sP + ks * 32, 16, 1024));
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
      if (ld.valid) load_chunks(p, &kv_map, ld, kb, bars, 0, 8);
      use++;
      cur = nx;
    }

    // ---- merge the two warpgroups' states, write the request's rows ----
#pragma unroll
    for (int j = 0; j < NC; j++) {
      float v = lp[j];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) redL[(wg * 4 + wi) * N + col[j]] = v;
      if (wi == 0 && lane < 4) mfin[wg * N + col[j]] = m[j];
    }
    __syncthreads();
    float fg[NC];
#pragma unroll
    for (int j = 0; j < NC; j++) {
      const int c = col[j];
      const float m0 = mfin[c], m1 = mfin[N + c], mf = fmaxf(m0, m1);
      const float f0 = m0 == -INFINITY ? 0.f : ex2(m0 - mf), f1 = m1 == -INFINITY ? 0.f : ex2(m1 - mf);
      fg[j] = wg ? f1 : f0;
      if (wg == 0 && wi == 0 && lane < 4) {
        float l0 = 0.f, l1 = 0.f;
#pragma unroll
        for (int x = 0; x < 4; x++) {
          l0 += redL[x * N + c];
          l1 += redL[(4 + x) * N + c];
        }
        const float l = l0 * f0 + l1 * f1;
        lfin[c] = l > 0.f ? 1.f / l : 0.f;
        if (c < w.rows) store_lse(p, w, mb, c, l > 0.f ? mf + log2f(l) : -INFINITY);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
      if (wg == 1) {
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
          for (int i = 0; i < NR; i++) {
            const int j = 2 * (i >> 2) + (i & 1);
            const int d = 64 * q + 16 * wi + (lane >> 2) + 8 * ((i >> 1) & 1);
            scr[col[j] * L::kScr + d] = o[4 * half + q][i] * fg[j];
          }
      }
      __syncthreads();
      if (wg == 0) {
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
          for (int i = 0; i < NR; i++) {
            const int j = 2 * (i >> 2) + (i & 1);
            const int d = 64 * q + 16 * wi + (lane >> 2) + 8 * ((i >> 1) & 1);
            scr[col[j] * L::kScr + d] += o[4 * half + q][i] * fg[j];
          }
      }
      __syncthreads();
      for (int idx = tid; idx < N * 128; idx += kThreads) {
        const int c = idx >> 7, d = (idx & 127) * 2;
        if (c < w.rows)
          store_out_pair(p, w, mb, c, 256 * half + d, scr[c * L::kScr + d], scr[c * L::kScr + d + 1], lfin[c]);
      }
      __syncthreads();
    }
  }
#endif
}

template <int N>
cudaError_t launch_n(const mla_decode_params *p, cudaStream_t stream) {
  CUtensorMap map;
  DEV_CUDA_OK(make_kv_tmap(p, &map));
  uint32_t lbo, sbo;
  decode_get_vview(&lbo, &sbo);
  static bool attr_set = false;  // once: keeps host work out of timed launches
  if (!attr_set) {
    DEV_CUDA_OK(cudaFuncSetAttribute(decode_v8_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)Lay<N>::kSmem));
    attr_set = true;
  }
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  decode_v8_kernel<N><<<grid, kThreads, Lay<N>::kSmem, stream>>>(*p, map, lbo, sbo, decode_noload());
  DEV_CUDA_OK(cudaGetLastError());
  if (decode_nocombine()) return cudaSuccess;
  return decode_combine_launch_pdl(p, stream);
}

}  // namespace

cudaError_t decode_v8_launch(const mla_decode_params *p, cudaStream_t stream) {
  if (p->page_size < 8) return decode_v2_launch(p, stream);  // cp.async path
  const int rows = mla_decode_rows(p);
  if (rows <= 16) return launch_n<16>(p, stream);
  if (rows <= 32) return launch_n<32>(p, stream);
  return decode_v7_launch(p, stream);  // full 64-row m-blocks
}
