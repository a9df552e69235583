// Absorbed-MLA split-KV decode on sm_90a behind mla_decode_params (decode.h):
// the winners of the kernel ladder in dev/cuda/ (docs/decode-kernel.md).
//  - m-blocks of <= 16 valid rows of a 16-bit or per-tensor fp8 cache with
//    page size >= 8: the ring kernel (v11, below);
//  - m-blocks of <= 32 valid rows (max_q_len * H <= 32): the narrow kernel
//    (ladder v10): transposed GEMMs (keys = M, rows = N = 16 or 32), two
//    independent warpgroups merged per request;
//  - wider m-blocks: the wide seesaw kernel (ladder v9); with
//    MLA_FLAG_FP8_MATH over a per-tensor fp8 cache (page size >= 8) its fp8
//    tensor-core variant (decode_wide_fp8.cuh);
//  - both load K tiles of 16-bit caches with TMA (page size >= 8;
//    instantiated for P >= 64 and 8 <= P < 64), or, for page sizes 1..4 and
//    the fp8 caches, with a cp.async row gather by the refilling warpgroup
//    (fp8: raw bytes staged inside the K buffer and dequantized there to the
//    bf16 tile by the warpgroup that owns it; decode_seesaw.cuh LOAD_*);
//  - bf16 or f16 operands (f16 cache with f16 activations, kF16);
//  - then the split-KV combine as a programmatic dependent.
#include <pthread.h>
#include <stdio.h>  // (the MLA_DEV_TIMELINE dev build's printout)
#include <stdlib.h>
#include <string.h>

#include "decode_seesaw.cuh"
#include "decode_wgmma_narrow.cuh"
#include "decode_wide_fp8.cuh"
#include "decode_fp8_rs.cuh"
#include "launch_once.cuh"
#include "mla.h"
#include "runtime.h"

namespace {
using namespace seesaw;

// V read as the MN-major view of the K tile: leading / stride byte offsets
// verified on the device by dev/cuda/desc_test.cu.
constexpr uint32_t kVtLbo = 8192, kVtSbo = 1024;

typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn lookup_encode_fn(void) {
  void *f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    return (EncodeTiledFn)f;
  cudaGetLastError();
  return nullptr;
}

// The driver's tensor-map encoder through the runtime (no -lcuda needed);
// looked up once (thread-safe static initialization).
EncodeTiledFn encode_fn() {
  static const EncodeTiledFn fn = lookup_encode_fn();
  return fn;
}

// Paged cache [num_pages][P][576] bf16 viewed as a 3-D tensor {576, P, pages};
// the box is 64 columns (128 B, one 128B-swizzle row) by min(P, 64) rows.
// Encoded on the host (kv_maps_cached below keeps them across calls).
// promo: the L2 fetch granularity of a miss (256 B for the wide / v10
// kernels; the ring kernel's map uses 128 B, see its comment).
cudaError_t make_kv_tmap(const mla_decode_params *p, CUtensorMap *map, CUtensorMapL2promotion promo) {
  memset(map, 0, sizeof(*map));
  EncodeTiledFn fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  cuuint64_t dims[3] = {576, (cuuint64_t)p->page_size, (cuuint64_t)p->num_pages};
  cuuint64_t strides[2] = {(cuuint64_t)p->row_bytes, (cuuint64_t)p->row_bytes * p->page_size};
  cuuint32_t box[3] = {64, (cuuint32_t)(p->page_size < 64 ? p->page_size : 64), 1};
  cuuint32_t one[3] = {1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(p->kv), dims, strides, box,
                  one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// fp8 cache rows as bytes, a 3-D tensor {row_bytes, P, pages}: boxes of
// `cols` bytes by min(P, 64) rows (load_group's fp8 TMA path; the ring
// kernel's with 128-byte L2 promotion, as its 16-bit map).
cudaError_t make_kv_tmap_bytes(const mla_decode_params *p, CUtensorMap *map, int cols, bool swizzle,
                               CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  memset(map, 0, sizeof(*map));
  EncodeTiledFn fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  cuuint64_t dims[3] = {(cuuint64_t)p->row_bytes, (cuuint64_t)p->page_size, (cuuint64_t)p->num_pages};
  cuuint64_t strides[2] = {(cuuint64_t)p->row_bytes, (cuuint64_t)p->row_bytes * p->page_size};
  cuuint32_t box[3] = {(cuuint32_t)cols, (cuuint32_t)(p->page_size < 64 ? p->page_size : 64), 1};
  cuuint32_t one[3] = {1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void *>(p->kv), dims, strides, box, one,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                  promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A cache row's first 128 * chunks bytes as {128 bytes, rows, chunks of 128
// bytes, pages} (the chunk stride below the row's: the driver takes any
// order), box {128, 64, box_chunks, 1}, 128B-swizzled: one TMA instruction
// fills box_chunks contiguous 1024-aligned 8 KB slots ([chunk][row][128 B])
// in the layout as many row-view boxes give them. Page size >= 64. A box
// costs its issuing thread ~200-300 cycles beside busy warpgroups whatever
// its size (bench/RESULTS.md sessions 18 and 29), so fewer, larger boxes:
//  - per-tensor fp8 ring (KvMaps [3], chunks 4, box 4): a tile's four latent
//    slots, 2 boxes a tile instead of 5: 1.2-2.2 % faster at b = 128, H = 16
//    (session 18, run 5);
//  - 16-bit wide / narrow kernels (KvMaps [3], chunks 8, box 4): a latent
//    half, 2 boxes instead of 8 (bench/RESULTS.md session 30, run 1).
// (The fp8 math kernel's latent pairs as 2-chunk boxes issued faster but
// landed later and ran ~1 % slower: session 30, run 1.)
// ring_latent4: where the fp8 ring's applies: the one test the host (which
// map to encode), the producer (which loads to issue) and the consumers
// (which barriers to wait for) share; kv_dtype per-tensor fp8 is the
// caller's part.
static __host__ __device__ __forceinline__ bool ring_latent4(int page_size) { return page_size >= 64; }
cudaError_t make_kv_tmap_chunked(const mla_decode_params *p, CUtensorMap *map, int chunks, int box_chunks,
                                 CUtensorMapL2promotion promo) {
  memset(map, 0, sizeof(*map));
  EncodeTiledFn fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  cuuint64_t dims[4] = {128, (cuuint64_t)p->page_size, (cuuint64_t)chunks, (cuuint64_t)p->num_pages};
  cuuint64_t strides[3] = {(cuuint64_t)p->row_bytes, 128, (cuuint64_t)p->row_bytes * p->page_size};
  cuuint32_t box[4] = {128, 64, (cuuint32_t)box_chunks, 1};
  cuuint32_t one[4] = {1, 1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void *>(p->kv), dims, strides, box, one,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// ---------------------------------------------------------------------------
// Split-KV combine: requests cut into one piece are skipped (the split kernel
// wrote them); launched only when the schedule has >= 2 parts.
// ---------------------------------------------------------------------------
static constexpr int kCombineWarps = 8;

// The v11 combines. The v6 kernel before them (one warp per (request, row))
// cost ~7 us at b = 64 and ~33 us at b = 1 (128 pieces) although it moved
// little data: every warp runs a chain of
// dependent loads (a 7-step binary search for the request's first part, the
// lse passes, then one piece after another). Both kernels below find the
// first part in one parallel step and keep several pieces' loads in flight:
//  - few pieces per request (combine_warp): one warp per (request, row) as
//    in v6, pieces two at a time, the first two loaded with the lse;
//  - many pieces (combine_row: small batches over long contexts; at b = 1
//    the schedule cuts the request into ~128 pieces): one block per
//    (request, row, quarter of the 512 columns), its 8 warps splitting the
//    pieces, sixteen pieces' lse and rows in flight per warp, the warps'
//    partial sums added through shared memory.

// First part holding a piece of request req (the parts' END_REQ never
// decrease) and whether req is that part's first request, by all threads of
// the block in one round trip: every thread reads its parts' END_REQ,
// their predecessors' and their BEGIN_REQ together. The caller syncs.
__device__ __forceinline__ void find_first_part_begin(const mla_decode_params &p, int req, int *sp0, int *sfirst) {
  for (int i = threadIdx.x; i < p.num_sm_parts; i += blockDim.x) {
    const int e = p.sched_meta[i * SCHED_INTS + SCHED_END_REQ];
    const int e_prev = i > 0 ? p.sched_meta[(i - 1) * SCHED_INTS + SCHED_END_REQ] : -1;
    const int b = p.sched_meta[i * SCHED_INTS + SCHED_BEGIN_REQ];
    if (e >= req && e_prev < req) {
      *sp0 = i;
      *sfirst = b == req;
    }
  }
}

// (<= 64 registers: a block fitted beside a ring kernel block of 288 x 168;
// the ring block is 384 x 168 since session 12 and leaves no room, with no
// change at b = 64, bench/RESULTS.md session 12 run 12.)
// Grid (bs, ceil(kSplit rows / 8)): warp w of block (req, y) merges part
// (8 y + w) % kSplit of row (8 y + w) / kSplit, a lane 16 / kSplit of its
// columns, 2 kSplit pieces' loads in flight per round trip (the same
// registers either way). Whole rows (kSplit 1) where requests have few
// pieces; halves (2) where they have more: whole rows ran 4-12 dependent
// rounds at the 8-24 pieces a request of b = 2-8 at H = 128, and halves are
// 2-3 us faster there but 2-5 us slower at b = 128 H = 128 (2-4 pieces: twice
// the warps, each redoing the lse pass; bench/RESULTS.md session 34 run 11).
template <bool kF16, int kSplit>
__global__ void __launch_bounds__(kCombineWarps * 32, 4)
    decode_combine_warp_kernel(const mla_decode_params p) {  // kF16: f16 output
  // The metadata (inputs of the split kernel, complete before it started)
  // is read before the wait: resident blocks do that during the split
  // kernel; only the partial states wait for its completion.
  __shared__ int sp0, sfirst;
  const int req = blockIdx.x;
  const int pieces = p.num_splits[req + 1] - p.num_splits[req];
  if (pieces <= 1) return;
  find_first_part_begin(p, req, &sp0, &sfirst);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kP = 2 * kSplit, kC = 4 / kSplit;  // pieces a round, float4 a lane
  const int hr = blockIdx.y * kCombineWarps + warp, rg = hr / kSplit;
  const int c0 = (128 / kSplit) * (hr % kSplit) + lane;  // the lane's first float4 of the row
  const int q0 = p.qo_indptr[req], qlen = p.qo_indptr[req + 1] - q0;
  const int H = p.num_heads;
  if (rg >= qlen * H) return;
  const int R = mla_decode_rows(&p);
  const int p0 = sp0;
  const bool first_req = sfirst;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  auto lse_of = [&](int j) {
    return p.lse_accum[(size_t)mla_decode_partial_slot(p0 + j, j > 0 || first_req) * R + rg];
  };
  auto row_of = [&](int j) {
    return reinterpret_cast<const float4 *>(
        p.o_accum + ((size_t)mla_decode_partial_slot(p0 + j, j > 0 || first_req) * R + rg) * 512);
  };
  // One round trip for up to kP pieces: lane j loads piece j's lse (pieces
  // >= 32 are read again where needed) while every lane loads its columns of
  // the first kP pieces' rows. An empty piece's row may
  // hold anything (NaN included): it is loaded but never weighed.
  const float myl = lane < pieces ? lse_of(lane) : -INFINITY;
  float4 v[kP][kC];
#pragma unroll
  for (int u = 0; u < kP; u++)
#pragma unroll
    for (int c = 0; c < kC; c++)
      v[u][c] = u < pieces ? row_of(u)[c0 + 32 * c] : make_float4(0.f, 0.f, 0.f, 0.f);  // (pieces >= 2 here)
  float mx = myl;
  for (int j = lane + 32; j < pieces; j += 32) mx = fmaxf(mx, lse_of(j));
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  if (mx != -INFINITY) {
    sum = myl == -INFINITY ? 0.f : __expf(myl - mx);
    for (int j = lane + 32; j < pieces; j += 32) sum += __expf(lse_of(j) - mx);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = mx == -INFINITY ? -INFINITY : mx + logf(sum);

  // Each lane owns 16 / kSplit columns: kC float4 at c0 + 32 c (coalesced).
  float4 acc[kC];
#pragma unroll
  for (int c = 0; c < kC; c++) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (mx != -INFINITY) {
    for (int j = 0; j < pieces; j += kP) {
      float wt[kP];
#pragma unroll
      for (int u = 0; u < kP; u++) {
        const int jj = j + u;  // warp-uniform
        float l = -INFINITY;
        if (jj < pieces) l = jj < 32 ? __shfl_sync(0xffffffffu, myl, jj) : lse_of(jj);
        wt[u] = l == -INFINITY ? 0.f : __expf(l - lse);  // an empty piece is never weighed
        if (j > 0)
#pragma unroll
          for (int c = 0; c < kC; c++)
            v[u][c] = wt[u] != 0.f ? row_of(jj)[c0 + 32 * c] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kP; u++)
        if (wt[u] != 0.f)
#pragma unroll
          for (int c = 0; c < kC; c++) {
            acc[c].x += wt[u] * v[u][c].x;
            acc[c].y += wt[u] * v[u][c].y;
            acc[c].z += wt[u] * v[u][c].z;
            acc[c].w += wt[u] * v[u][c].w;
          }
    }
  }
  const int t = rg / H, h = rg % H;
  uint16_t *dst = p.out + ((size_t)(q0 + t) * H + h) * 512;
#pragma unroll
  for (int c = 0; c < kC; c++) {
    uint2 w2;
    w2.x = pack2<kF16>(acc[c].x, acc[c].y);
    w2.y = pack2<kF16>(acc[c].z, acc[c].w);
    *reinterpret_cast<uint2 *>(dst + 4 * (c0 + 32 * c)) = w2;
  }
  if (hr % kSplit == 0 && lane == 0 && p.lse) p.lse[(size_t)(q0 + t) * H + h] = p.lse_base2 ? lse * kLog2e : lse;
}

template <bool kF16>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_row_kernel(const mla_decode_params p) {  // kF16: f16 output
  // Two round trips to global memory: the metadata (request bounds and the
  // first part, read together), then every piece's lse and this block's
  // columns of its row at once, warp w taking pieces w, w + 8, ... 16 at a
  // time with an online maximum (one round for up to 128 pieces). Before
  // session 28 the lse and the rows were separate rounds, and the first
  // part's BEGIN_REQ one more (bench/RESULTS.md session 28, run 4).
  constexpr int kU = 16;  // pieces a warp loads per round
  __shared__ float4 sacc[kCombineWarps][32];  // each warp's sum of weighted rows (quarter row, 128 floats)
  __shared__ float swm[kCombineWarps], sws[kCombineWarps];  // each warp's maximum lse and weight sum
  __shared__ int sp0, sfirst;
  const int req = blockIdx.x, rg = blockIdx.y, qt = blockIdx.z;  // qt: columns 128 qt .. 128 qt + 127
  const int n0 = p.num_splits[req], n1 = p.num_splits[req + 1];
  const int q0 = p.qo_indptr[req], qlen = p.qo_indptr[req + 1] - q0;
  find_first_part_begin(p, req, &sp0, &sfirst);
  const int pieces = n1 - n0, H = p.num_heads;
  if (pieces <= 1 || rg >= qlen * H) return;  // block-uniform, before any barrier
  const int R = mla_decode_rows(&p);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __syncthreads();
  const int p0 = sp0;
  const bool first_req = sfirst;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  float m = -INFINITY, ws = 0.f;  // warp-uniform: every lane reads the same lse values
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = warp; base < pieces; base += kU * kCombineWarps) {
    float l[kU];
    float4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int j = base + u * kCombineWarps;
      l[u] = -INFINITY;
      v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (j < pieces) {  // an empty piece's row may hold anything: loaded, never weighed
        const size_t slot = (size_t)mla_decode_partial_slot(p0 + j, j > 0 || first_req);
        l[u] = p.lse_accum[slot * R + rg];
        v[u] = reinterpret_cast<const float4 *>(p.o_accum + (slot * R + rg) * 512)[32 * qt + lane];
      }
    }
    float cm = m;
#pragma unroll
    for (int u = 0; u < kU; u++) cm = fmaxf(cm, l[u]);
    if (cm == -INFINITY) continue;  // nothing weighed yet
    if (m != -INFINITY && cm != m) {
      const float f = __expf(m - cm);
      ws *= f;
      acc.x *= f;
      acc.y *= f;
      acc.z *= f;
      acc.w *= f;
    }
    m = cm;
#pragma unroll
    for (int u = 0; u < kU; u++)
      if (l[u] != -INFINITY) {
        const float w = __expf(l[u] - m);
        ws += w;
        acc.x += w * v[u].x;
        acc.y += w * v[u].y;
        acc.z += w * v[u].z;
        acc.w += w * v[u].w;
      }
  }
  sacc[warp][lane] = acc;
  if (lane == 0) {
    swm[warp] = m;
    sws[warp] = ws;
  }
  __syncthreads();
  if (tid < 64) {  // columns 128 qt + 2 tid, + 1
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kCombineWarps; w++) M = fmaxf(M, swm[w]);
    const float *sf = reinterpret_cast<const float *>(sacc);
    float S = 0.f, x = 0.f, y = 0.f;
    if (M != -INFINITY)
#pragma unroll
      for (int w = 0; w < kCombineWarps; w++)
        if (swm[w] != -INFINITY) {
          const float f = __expf(swm[w] - M);
          S += f * sws[w];
          x += f * sf[w * 128 + 2 * tid];
          y += f * sf[w * 128 + 2 * tid + 1];
        }
    const float inv = S > 0.f ? 1.f / S : 0.f;  // all pieces empty: o = 0, lse = -inf
    const int t = rg / H, h = rg % H;
    uint16_t *dst = p.out + ((size_t)(q0 + t) * H + h) * 512 + 128 * qt;
    *reinterpret_cast<uint32_t *>(dst + 2 * tid) = pack2<kF16>(x * inv, y * inv);
    if (tid == 0 && qt == 0 && p.lse) {
      const float lse = M == -INFINITY ? -INFINITY : M + logf(S);
      p.lse[(size_t)(q0 + t) * H + h] = p.lse_base2 ? lse * kLog2e : lse;
    }
  }
}

// The combine after the split kernel before it in the stream: one of two
// kernels, by the pieces a request has on average (parts / batch size).
//  - Many pieces (small batches over long contexts): the row kernel, one
//    block per (request, row, quarter of the columns), its 8 warps splitting
//    the pieces; launched plainly: its blocks (8 KB of shared memory) cannot
//    sit beside a split block, and as a programmatic dependent it measured
//    2 us slower at b = 1 (29.3 vs 27.5 us, s_k = 32768; b = 4 the same:
//    bench/RESULTS.md session 10, run 4).
//  - Few pieces: one warp per row, pieces two at a time, as a programmatic
//    dependent (the launch overlaps the split kernel's tail; it triggers
//    early).
// The row kernel's blocks grow with the rows (bs x rows x 4) while its work
// per block shrinks with the pieces, so its break-even moves up with the
// rows: measured both ways (H100, bench/RESULTS.md session 34 run 7), the row
// kernel wins at >= 16.5 pieces for 16 rows (b = 8, H = 16: 72.5 against
// 75.5 us) and >= 33 for 128 rows (b = 2, H = 128: 68 against 75.6), the
// warp kernel at 8.25 pieces for 16 rows (b = 16: 72.7 against 75.8) and
// 16.5 for 128 (b = 4: 68 against 75; b = 16: 92 against 143). Until session
// 34 the rule was >= 4 pieces at any width (b = 16, H = 128 spent 60 us in
// the row combine). (Whether the row kernel's grid.y can hold the rows is
// combine_launch's to check.)
bool combine_by_row(const mla_decode_params *p) {
  const int64_t min_pieces = mla_decode_rows(p) <= 32 ? 12 : 24;
  return (int64_t)p->num_sm_parts >= min_pieces * p->batch_size;
}

cudaError_t combine_launch(const mla_decode_params *p, cudaStream_t stream) {
  const int rows = mla_decode_rows(p);
  if (p->batch_size == 0 || p->num_sm_parts < 2) return cudaSuccess;  // one part cuts nothing
#ifdef MLA_DEV_NOCOMBINE  // (dev timing only: the split kernel alone, cut requests left unmerged: wrong results)
  if (getenv("MLA_DEV_NOCOMBINE")) return cudaSuccess;
#endif
  bool by_row = combine_by_row(p);
#ifdef MLA_DEV_COMBINE_PICK  // (dev timing only: MLA_DEV_COMBINE=row / warp picks the kernel whatever the rule says)
  if (const char *c = getenv("MLA_DEV_COMBINE")) by_row = strcmp(c, "row") == 0;
#endif
  by_row = by_row && rows <= 65535;  // (the row kernel's grid.y)
  // the warp kernel over half rows from 6 pieces a request (decode_combine_warp_kernel)
  // (whole rows where half rows would pass the grid.y bound: not reached by today's plans, whose 6 pieces a
  // request leave at most num_sm / 6 m-blocks of rows)
  const int split = p->num_sm_parts >= 6 * (int64_t)p->batch_size && 2 * (int64_t)rows <= 65535 * kCombineWarps ? 2 : 1;
  const int warp_y = (split * rows + kCombineWarps - 1) / kCombineWarps;  // decode_combine_warp_kernel's grid.y
  if (!by_row && warp_y > 65535) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = by_row ? dim3(p->batch_size, rows, 4) : dim3(p->batch_size, warp_y);
  cfg.blockDim = dim3(kCombineWarps * 32);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = by_row ? 0 : 1;
  if (by_row)
    return p->act_dtype == MLA_DTYPE_F16 ? cudaLaunchKernelEx(&cfg, decode_combine_row_kernel<true>, *p)
                                         : cudaLaunchKernelEx(&cfg, decode_combine_row_kernel<false>, *p);
  const bool f16 = p->act_dtype == MLA_DTYPE_F16;
  if (split == 2)
    return f16 ? cudaLaunchKernelEx(&cfg, decode_combine_warp_kernel<true, 2>, *p)
               : cudaLaunchKernelEx(&cfg, decode_combine_warp_kernel<false, 2>, *p);
  return f16 ? cudaLaunchKernelEx(&cfg, decode_combine_warp_kernel<true, 1>, *p)
             : cudaLaunchKernelEx(&cfg, decode_combine_warp_kernel<false, 1>, *p);
}

// ---------------------------------------------------------------------------
// Wide kernel (ladder v9): 64-row m-blocks, seesaw over two K buffers.
// ---------------------------------------------------------------------------
template <int LM, bool kF16>
__global__ void __launch_bounds__(kThreads, 1)
    decode_wide_kernel(const mla_decode_params p, const __grid_constant__ KvMaps kv_maps, uint32_t vt_lbo,
                     uint32_t vt_sbo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  // Derived from smem_raw (not through an integer): the compiler keeps the
  // shared state space and emits LDS/STS.
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  pdl_trigger();
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  const int rA = 16 * wi + (lane >> 2), rB = rA + 8;
  const int cq = 2 * (lane & 3);
  const bool lead = (lane & 3) == 0;
  float *sM = reinterpret_cast<float *>(smem + kOffM);
  float *sS0 = reinterpret_cast<float *>(smem + kOffS0);
  float *sS1 = reinterpret_cast<float *>(smem + kOffS1);
  const int *lim = reinterpret_cast<const int *>(smem + kOffLim);
  const uint32_t bars0 = sb + kOffBar, bars1 = sb + kOffBar + 3 * 8;  // [0-3, 4-7, rope]
  const uint32_t kb0 = sb + kOffB0, kb1 = sb + kOffB1;
  // Per-tensor fp8 (lm_raw): f16 operands (the e4m3 values exact, Q times
  // 2^e), the cache scale and 2^-e in the scores' factor, the cache scale in
  // the output's. kF16 stays the activations' type (the output's).
  constexpr bool kRaw = lm_raw(LM), kOp = kF16 || kRaw;
  // Each buffer's rope chunk (read by its Q.K^T only) is refilled under the
  // warpgroup's register-operand P.V at page >= 64 (a TMA issue costs its
  // thread ~200-300 cycles beside busy warpgroups: 1-2 % faster, bench/RESULTS.md
  // session 29), right after the Q.K^T in the other modes (moved, they spill more).
  constexpr bool kRopeLate = LM == LOAD_TMA_BIG;
  float sl2 = p.scale * kLog2e;
  const int er = meta[SCHED_END_REQ];
  // TMA: one elected refill thread per warpgroup; other modes: all of it.
  const bool issuer = lm_cp(LM) || t128 == 0;
  const int myrow = t128 >> 1;  // row a thread copies in the cp.async modes
  const float kvs = p.kv_scale;

  if (tid == 0) {
    for (int i = 0; i < 6; i++) mbar_init(bars0 + 8 * i, lm_cp(LM) ? 128 : 1);
    fence_mbar_init();
  }
  __syncthreads();

  BufCursor cur0 = cursor_first(p, meta, mb, 0), cur1 = cursor_first(p, meta, mb, 1);
  if (!lm_cp(LM) && tid == 0) {
    const TileSrc s0 = tile_src<LM>(p, er, cur0, 0), s1 = tile_src<LM>(p, er, cur1, 0);
    for (int g = 0; g < 3; g++) {
      if (s0.valid) load_group<LM>(p, kv_maps.m, s0, kb0, bars0 + 8 * g, 4 * g, g < 2 ? 4 * g + 4 : 9, 0);
      if (s1.valid) load_group<LM>(p, kv_maps.m, s1, kb1, bars1 + 8 * g, 4 * g, g < 2 ? 4 * g + 4 : 9, 0);
    }
  } else if (lm_cp(LM)) {
    // warpgroup g fills buffer g
    const TileSrc sg = tile_src<LM>(p, er, wg ? cur1 : cur0, myrow);
    if (sg.valid)
      for (int g = 0; g < 3; g++)
        load_group<LM>(p, kv_maps.m, sg, wg ? kb1 : kb0, (wg ? bars1 : bars0) + 8 * g, 4 * g, g < 2 ? 4 * g + 4 : 9,
                       t128);
  }
  uint32_t use0 = 0, use1 = 0;  // loads consumed per buffer (barrier parity)
  uint32_t pairs = 0;           // pairs done (P tile roles)

  for (int req = meta[SCHED_BEGIN_REQ]; req <= er; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;
    __syncthreads();  // the last request is done with Q, sM and the row arrays
    uint32_t qr[4][4];
    if constexpr (kRaw)
      sl2 = p.scale * kLog2e * p.kv_scale *
            load_q_f16(p, w, mb, sb, smem, tid, rA, rB, cq, qr, reinterpret_cast<float *>(smem + kOffL));
    else
      load_q(p, w, mb, sb, smem, tid, rA, rB, cq, qr);
    __syncthreads();
    const int limA = lim[rA], limB = lim[rB], lim0 = lim[0];  // row 0 has the lowest limit

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    float lsA = 0.f, lsB = 0.f;  // this warpgroup's partial row sums (thread part)

    for (int t0 = 0; t0 < w.n_tiles; t0 += 2, pairs++) {
      const bool has1 = t0 + 1 < w.n_tiles;
      const int kt0 = w.kstart + 64 * t0, kt1 = kt0 + 64;
      const int nv0 = min(64, w.kend_blk - kt0), nv1 = has1 ? min(64, w.kend_blk - kt1) : 0;
      const bool full0 = kt0 + 64 <= lim0, full1 = kt1 + 64 <= lim0;
      const uint32_t par0 = use0 & 1, par1 = use1 & 1;
      const uint32_t sPa = sb + kOffP + (pairs & 1) * kChunk, sPb = sb + kOffP + ((pairs & 1) ^ 1) * kChunk;
      // The next tiles of both buffers and where their refills read from
      // (under each warpgroup's Q.K^T where next_under_qk).
      constexpr bool kUnderQk = next_under_qk(LM);
      BufCursor nx0, nx1;
      TileSrc ld0, ld1;
      if (!kUnderQk) next_tiles<LM>(p, meta, mb, er, issuer, myrow, has1, cur0, cur1, nx0, nx1, ld0, ld1);
      float s[32];
      uint32_t pa[4][4];
      if (wg == 0) {
        // ---------------- WG0: tile T0 in B0 ----------------
        qk_tile3_issue<0, LM, kOp>(s, sb + kOffQ, kb0, bars0, par0, qr, lm_fp8(LM) ? smem + kOffB0 : nullptr, t128, kvs,
                                    nv0);
        if (kUnderQk) next_tiles<LM>(p, meta, mb, er, issuer, myrow, has1, cur0, cur1, nx0, nx1, ld0, ld1);
        qk_wait(s);
        if (!kRopeLate && ld0.valid) load_group<LM>(p, kv_maps.m, ld0, kb0, bars0 + 16, 8, 9, t128);  // rope chunk
        float mxA, mxB;
        row_max(s, full0, kt0, limA, limB, cq, mxA, mxB);
        const float mpA = sM[rA], mpB = sM[rB];
        const float m0A = lazy_max(mpA, mxA * sl2), m0B = lazy_max(mpB, mxB * sl2);
        const float s0A = lazy_scale(mpA, m0A), s0B = lazy_scale(mpB, m0B);
        float sumA, sumB;
        exp_rows<kRaw>(s, sl2, m0A, m0B, sumA, sumB);
        pack_p<kOp>(pa, s);
        store_p(sPa, pa, wi, lane);
        fence_proxy_async();
        __syncwarp();
        publish_rows(sM, sS0, rA, rB, m0A, m0B, s0A, s0B, lead);
        named_bar_arrive(BAR_A, kThreads);
        rescale_acc(o, lsA, lsB, s0A, s0B, sumA, sumB);
        // O_L = s0 O_L + P0 V0_L
        if (lm_tma16(LM) && nv0 < 64) {  // (cp.async modes zero-fill those rows, fp8 dequantizes them to 0)
          zero_tail(smem + kOffB0, nv0, 0, t128);
          fence_proxy_async();
          named_bar_sync(BAR_WG0, 128);
        }
        pv_rs<kOp>(o, pa, kb0, 0, vt_lbo, vt_sbo);
        if (kRopeLate && ld0.valid) load_group<LM>(p, kv_maps.m, ld0, kb0, bars0 + 16, 8, 9, t128);
        // WG1's P1 / s1; rows whose max moved get P0' = s1 P0 re-stored.
        named_bar_sync(BAR_P1, kThreads);
        const float s1A = sS1[rA], s1B = sS1[rB];
        const bool mv = s1A != 1.f || s1B != 1.f;
        if (__any_sync(0xffffffffu, mv)) {
          uint32_t pb[4][4];
#pragma unroll
          for (int k = 0; k < 4; k++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
              const float f = (j & 1) ? s1B : s1A;
              pb[k][j] = pack2<kOp>(s[8 * k + 2 * j] * f, s[8 * k + 2 * j + 1] * f);
            }
          store_p(sPa, pb, wi, lane);
          fence_proxy_async();
        }
        named_bar_arrive(BAR_P0, kThreads);
        const bool drain = wg_any(mv, BAR_RED0);  // warpgroup-uniform
        lsA *= s1A;
        lsB *= s1B;
        if (has1) {
          if (drain) {
            wgmma_wait<0>();
            reg_fence(o);
            keep_alive(pa);
            rescale_o(o, s1A, s1B);
          }
          // B1 chunks 0-3 (fp8: dequantized by WG1 before BAR_P1)
          mbar_wait(bars1, par1);
          if (LM == LOAD_GATHER) fence_proxy_async();
          if (lm_tma16(LM) && nv1 < 64) {
            zero_tail(smem + kOffB1, nv1, 0, t128);
            fence_proxy_async();
            named_bar_sync(BAR_WG0, 128);
          }
          pv_ss<kOp>(o, sPb, kb1, 0, vt_lbo, vt_sbo);  // O_L += P1 V1_L, queued behind P0 V0_L
          wgmma_wait<1>();
          keep_alive(pa);
          if (ld0.valid) load_group<LM>(p, kv_maps.m, ld0, kb0, bars0, 0, 4, t128);
          wgmma_wait<0>();
          reg_fence(o);
          if (ld1.valid) load_group<LM>(p, kv_maps.m, ld1, kb1, bars1, 0, 4, t128);
        } else {
          wgmma_wait<0>();
          reg_fence(o);
          keep_alive(pa);
          if (ld0.valid) load_group<LM>(p, kv_maps.m, ld0, kb0, bars0, 0, 4, t128);
        }
      } else {
        // ---------------- WG1: tile T1 in B1 ----------------
        float mxA = -INFINITY, mxB = -INFINITY;
        if (has1) {
          qk_tile3_issue<1, LM, kOp>(s, sb + kOffQ, kb1, bars1, par1, qr, lm_fp8(LM) ? smem + kOffB1 : nullptr, t128,
                                      kvs, nv1);
          if (kUnderQk) next_tiles<LM>(p, meta, mb, er, issuer, myrow, has1, cur0, cur1, nx0, nx1, ld0, ld1);
          qk_wait(s);
          if (!kRopeLate && ld1.valid) load_group<LM>(p, kv_maps.m, ld1, kb1, bars1 + 16, 8, 9, t128);
          row_max(s, full1, kt1, limA, limB, cq, mxA, mxB);
        } else if (kUnderQk) {
          next_tiles<LM>(p, meta, mb, er, issuer, myrow, has1, cur0, cur1, nx0, nx1, ld0, ld1);
        }
        named_bar_sync(BAR_A, kThreads);
        const float m0A = sM[rA], m0B = sM[rB];
        const float s0A = sS0[rA], s0B = sS0[rB];
        const float m1A = lazy_max(m0A, mxA * sl2), m1B = lazy_max(m0B, mxB * sl2);
        const float s1A = lazy_scale(m0A, m1A), s1B = lazy_scale(m0B, m1B);
        float sumA = 0.f, sumB = 0.f;
        if (has1) {
          exp_rows<kRaw>(s, sl2, m1A, m1B, sumA, sumB);
          pack_p<kOp>(pa, s);
          store_p(sPb, pa, wi, lane);
          fence_proxy_async();
        }
        __syncwarp();
        publish_rows(sM, sS1, rA, rB, m1A, m1B, s1A, s1B, lead);
        named_bar_arrive(BAR_P1, kThreads);
        const float fA = s0A * s1A, fB = s0B * s1B;
        rescale_acc(o, lsA, lsB, fA, fB, sumA, sumB);
        if (has1) {
          // O_R += P1 V1_R (P1 from registers), left in flight.
          if (lm_tma16(LM) && nv1 < 64) {
            zero_tail(smem + kOffB1, nv1, 4, t128);
            fence_proxy_async();
            named_bar_sync(BAR_WG1, 128);
          }
          pv_rs<kOp>(o, pa, kb1, 1, vt_lbo, vt_sbo);
          if (kRopeLate && ld1.valid) load_group<LM>(p, kv_maps.m, ld1, kb1, bars1 + 16, 8, 9, t128);  // B1's rope
        }
        // O_R += P0' V0_R (P0' from shared memory), queued right behind it.
        named_bar_sync(BAR_P0, kThreads);
        mbar_wait(bars0 + 8, par0);  // B0 chunks 4-7 (fp8: dequantized by WG0 before BAR_A)
        if (LM == LOAD_GATHER) fence_proxy_async();
        if (lm_tma16(LM) && nv0 < 64) {
          zero_tail(smem + kOffB0, nv0, 4, t128);
          fence_proxy_async();
          named_bar_sync(BAR_WG1, 128);
        }
        pv_ss<kOp>(o, sPa, kb0, 1, vt_lbo, vt_sbo);
        if (has1) {
          wgmma_wait<1>();  // P1 V1_R retired: B1 chunks 4-7 are free
          keep_alive(pa);
          if (ld1.valid) load_group<LM>(p, kv_maps.m, ld1, kb1, bars1 + 8, 4, 8, t128);
        }
        wgmma_wait<0>();
        reg_fence(o);
        if (ld0.valid) load_group<LM>(p, kv_maps.m, ld0, kb0, bars0 + 8, 4, 8, t128);
      }
      use0++;
      if (has1) use1++;
      cur0 = nx0;
      if (has1) cur1 = nx1;
    }
    epilogue<kF16>(p, w, mb, smem, o, lsA, lsB, wg, rA, rB, cq, lead, kRaw ? p.kv_scale : 1.f);
  }
#endif
}

// Development timeline of the fp8 math kernel (compile with -DMLA_DEV_TIMELINE;
// never in a library build): thread 0 of each warpgroup of CTA (0, 0) stamps
// %clock64 at kTl8Ph points of each of its first kTl8Pairs pairs (W8_TL(k),
// the points named where launch_wide8 prints them), and slot 9 records which
// of its tile's three groups had landed when the pair began.
#ifdef MLA_DEV_TIMELINE
// Whether this launch (counted in *calls per launcher) is the one to print.
static bool dev_timeline_due(int *calls) {
  const char *at = getenv("MLA_DEV_TIMELINE_AT");
  return ++*calls == (at ? atoi(at) : 5);
}
constexpr int kTl8Pairs = 64, kTl8Ph = 14;
__device__ long long g_tl8[2][kTl8Pairs][kTl8Ph];
#define W8_TL(k) \
  do { \
    if (tl_on && pairs < (uint32_t)kTl8Pairs) g_tl8[wg][pairs][k] = clock64(); \
  } while (0)
#define W8_TL_LANDED(bars, par) \
  do { \
    if (tl_on && pairs < (uint32_t)kTl8Pairs) \
      g_tl8[wg][pairs][9] = (mbar_test_wait((bars), (par)) ? 1 : 0) | (mbar_test_wait((bars) + 8, (par)) ? 2 : 0) | \
                            (mbar_test_wait((bars) + 16, (par)) ? 4 : 0); \
  } while (0)
#else
#define W8_TL(k) \
  do { \
  } while (0)
#define W8_TL_LANDED(bars, par) \
  do { \
  } while (0)
#endif

// ---------------------------------------------------------------------------
// The fp8 math kernel (MLA_FLAG_FP8_MATH, per-tensor e4m3 cache, page size
// >= 8; decode_wide_fp8.cuh, docs/decode-kernel.md §12), in the O^T form
// since session 27: the wide kernel's seesaw on fp8 tensor cores computing
// O^T = V^T P^T, the V^T fragments loaded from the raw K tile into registers
// (vt_frags) and P read from shared memory, so no V^T buffers and no
// transposes. That frees room for a third K buffer: tile g of the part
// lives in buffer g % 3, and each buffer's refill (tile g + 3) is issued as
// soon as its tile's Q.K^T and fragment loads are done, ~a pair earlier than
// with two buffers. P0 (WG0's own), P1 (two by pair parity) and P0' = s1 P0
// (for WG1) each have a tile; O^T's per-row rescales read the factors of all
// 64 rows from shared memory (after a warpgroup vote); the epilogue stages
// the rows over Q and the P tiles.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 1)
    decode_wide8t_kernel(const mla_decode_params p, const __grid_constant__ KvMaps kv_maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = W8T;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  pdl_trigger();
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int rA = 16 * wi + (lane >> 2), rB = rA + 8;
  const int cq = 2 * (lane & 3);
  const bool lead = (lane & 3) == 0;
  float *sM = reinterpret_cast<float *>(smem + L::kOffM);
  float *sS0 = reinterpret_cast<float *>(smem + L::kOffS0);
  float *sS1 = reinterpret_cast<float *>(smem + L::kOffS1);
  const int *lim = reinterpret_cast<const int *>(smem + L::kOffLim);
  const uint32_t barb = sb + L::kOffBar, kbb = sb + L::kOffB0;  // buffer b: barb + 24 b, kbb + kBuf b
  const uint32_t sPa = sb + L::kOffPa, sPc = sb + L::kOffPc;
  const CUtensorMap *map = &kv_maps.m[2];  // the swizzled byte view
  const int er = meta[SCHED_END_REQ];
  // the pair loop's refills: lane 0 of each warp at page >= 64 (refill8_group), else of warp 0
  const bool issuer = lane == 0 && (p.page_size >= 64 || wi == 0);
#ifdef MLA_DEV_TIMELINE
  const bool tl_on = blockIdx.x == 0 && blockIdx.y == 0 && (tid & 127) == 0;
#endif

  if (tid == 0) {
    for (int i = 0; i < 9; i++) mbar_init(barb + 8 * i, 1);
    fence_mbar_init();
  }
  __syncthreads();

  // la: the part's tile 3 ahead of the pair's first (the refill of that tile's buffer)
  BufCursor la = cursor_first(p, meta, mb, 0);
  for (int b = 0; b < 3; b++) {
    if (tid == 0) {
      const TileSrc s0 = tile_src<LOAD_FP8_TMA>(p, er, la, 0);
      if (s0.valid)
        for (int g = 0; g < 3; g++) load8_group(p, map, s0, kbb + L::kBuf * b, barb + 24 * b + 8 * g, g);
    }
    cursor_next<1>(p, meta, mb, la);
  }
  uint32_t gt = 0;     // the pair's first tile in the part's order
  uint32_t pairs = 0;  // pairs done (P1 tile parity)

  for (int req = meta[SCHED_BEGIN_REQ]; req <= er; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;
    __syncthreads();  // the last request is done with Q, sM and the row arrays
    const float sl2 = p.scale * kLog2e * p.kv_scale * load_q8(p, w, mb, sb + L::kOffQ, smem, tid);
    __syncthreads();
    const int limA = lim[rA], limB = lim[rB], lim0 = lim[0];  // row 0 has the lowest limit

    float o[4][32];  // O^T: m-tile mt = dims 256 wg + 64 mt .., columns = the m-block's rows
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
      for (int i = 0; i < 32; i++) o[mt][i] = 0.f;
    float lsA = 0.f, lsB = 0.f;  // this warpgroup's partial row sums of P' (thread part)

    for (int t0 = 0; t0 < w.n_tiles; t0 += 2, pairs++) {
      const bool has1 = t0 + 1 < w.n_tiles;
      const int kt0 = w.kstart + 64 * t0, kt1 = kt0 + 64;
      const int nv0 = min(64, w.kend_blk - kt0), nv1 = has1 ? min(64, w.kend_blk - kt1) : 0;
      const bool full0 = kt0 + 64 <= lim0, full1 = kt1 + 64 <= lim0;
      const uint32_t ba = gt % 3, bb = (gt + 1) % 3;           // the pair's buffers
      const uint32_t par0 = (gt / 3) & 1, par1 = ((gt + 1) / 3) & 1;
      const uint32_t kb0 = kbb + L::kBuf * ba, kb1 = kbb + L::kBuf * bb;
      const uint32_t bars0 = barb + 24 * ba, bars1 = barb + 24 * bb;
      const uint32_t sPb = sb + L::kOffPb + (pairs & 1) * kChunk;
      float *sS0p = sS0 + 64 * (pairs & 1), *sS1p = sS1 + 64 * (pairs & 1);  // this pair's factors
      BufCursor la1 = la;  // the refill of the pair's second tile's buffer
      cursor_next<1>(p, meta, mb, la1);
      TileSrc ld0, ld1;
      ld0.valid = ld1.valid = 0;
      if (issuer) {
        ld0 = tile_src<LOAD_FP8_TMA>(p, er, la, 0);
        if (has1) ld1 = tile_src<LOAD_FP8_TMA>(p, er, la1, 0);
      }
      float s[32];
      uint32_t pa[2][4];
      uint32_t va[4][2][4];
      if (wg == 0) {
        // ---------------- WG0: tile T0 in B0 ----------------
        W8_TL(0);
        W8_TL_LANDED(bars0, par0);
        qk8_tile_nt_issue(s, sb + L::kOffQ, kb0, bars0, par0, 0);
        vt_frags(kb0, 0, nv0, wi, lane, va);  // V0_L^T, under the Q.K^T
        wgmma_wait<0>();
        reg_fence(s);
        named_bar_sync(BAR_WG0, 128);  // the four warps' Q.K^T and fragment reads of B0 retired
        if (has1) named_bar_arrive(BAR_QK, kThreads);  // WG1's Q.K^T may start
        W8_TL(1);
        float mxA, mxB;
        row_max(s, full0, kt0, limA, limB, cq, mxA, mxB);
        const float mpA = sM[rA], mpB = sM[rB];
        const float m0A = lazy_max8(mpA, mxA * sl2), m0B = lazy_max8(mpB, mxB * sl2);
        const float s0A = lazy_scale(mpA, m0A), s0B = lazy_scale(mpB, m0B);
        float sumA, sumB;
        exp_rows(s, sl2, m0A, m0B, sumA, sumB);
        pack_p8(pa, s, 1.f, 1.f);
        store_p8(sPa, pa, wi, lane);
        fence_proxy_async();
        publish_rows(sM, sS0p, rA, rB, m0A, m0B, s0A, s0B, lead);
        named_bar_arrive(BAR_A, kThreads);
        W8_TL(2);
        // every row's s0 (the vote is a warpgroup barrier: the four warps' s0 are written; this
        // parity's are not rewritten before WG1's BAR_P1 of the next pair)
        if (wg_any(s0A != 1.f || s0B != 1.f, BAR_RED0)) rescale_ot(o, sS0p, nullptr, lane);
        lsA = lsA * s0A + sumA;
        lsB = lsB * s0B + sumB;
        pv8_ot(o, va, sPa);  // O^T_L = s0 O^T_L + V0_L^T P0^T
        W8_TL(10);
        if (ld0.valid) {  // B0's rope and latent 0-255: read by nothing else in this pair
          refill8_group(p, map, ld0, kb0, bars0 + 16, 2, wi, 0);
          refill8_group(p, map, ld0, kb0, bars0, 0, wi, 1);
        }
        W8_TL(11);
        wgmma_wait<0>();     // (while WG1 computes its softmax) its fragment registers are free again
        reg_fence2(o);
        keep_alive_a(va);
        W8_TL(3);
        if (has1) {  // V1_L^T before the hand-off
          mbar_wait(bars1, par1);  // B1 latent 0-255
          W8_TL(4);
          vt_frags(kb1, 0, nv1, wi, lane, va);
        }
        W8_TL(5);
        // WG1's P1 / s1; P0' = s1 P0 for WG1's P0' V0_R.
        named_bar_sync(BAR_P1, kThreads);
        W8_TL(6);
        const float s1A = sS1p[rA], s1B = sS1p[rB];
        {
          uint32_t pb[2][4];
          pack_p8(pb, s, s1A, s1B);
          store_p8(sPc, pb, wi, lane);
          fence_proxy_async();
        }
        const bool drain = wg_any(s1A != 1.f || s1B != 1.f, BAR_RED0);  // (also: the four warps' P0' written)
        named_bar_arrive(BAR_P0, kThreads);
        W8_TL(7);
        lsA *= s1A;
        lsB *= s1B;
        if (drain) rescale_ot(o, sS1p, nullptr, lane);
        if (has1) {
          // (the vote above was a warpgroup barrier: the four warps' fragment reads of B1 latent 0-255 are
          // done; WG1's Q.K^T on B1 retired before BAR_P1)
          pv8_ot(o, va, sPb);  // O^T_L += V1_L^T P1^T
          W8_TL(12);
          if (ld1.valid) refill8_group(p, map, ld1, kb1, bars1, 0, wi, 3);
          W8_TL(13);
          wgmma_wait<0>();
          reg_fence2(o);
          keep_alive_a(va);
        }
        W8_TL(8);
      } else {
        // ---------------- WG1: tile T1 in B1 ----------------
        float mxA = -INFINITY, mxB = -INFINITY;
        W8_TL(0);
        if (has1) {
          W8_TL_LANDED(bars1, par1);
          // The two Q.K^T in turn: each reads 4 KB of shared memory per
          // 32-cycle wgmma, all of its bandwidth, so together they took
          // ~1780 cycles where WG0's alone takes ~1220, and WG0's softmax,
          // the next link of the pair's chain, started only then: 0.2-0.9 %
          // faster (bench/RESULTS.md session 28, runs 6-7).
          named_bar_sync(BAR_QK, kThreads);
          qk8_tile_nt_issue(s, sb + L::kOffQ, kb1, bars1, par1, 1);
          vt_frags(kb1, 1, nv1, wi, lane, va);  // V1_R^T, under the Q.K^T
          wgmma_wait<0>();
          reg_fence(s);
          named_bar_sync(BAR_WG1, 128);
          W8_TL(1);
          row_max(s, full1, kt1, limA, limB, cq, mxA, mxB);
        }
        named_bar_sync(BAR_A, kThreads);
        W8_TL(2);
        const float m0A = sM[rA], m0B = sM[rB];
        const float s0A = sS0p[rA], s0B = sS0p[rB];
        const float m1A = lazy_max8(m0A, mxA * sl2), m1B = lazy_max8(m0B, mxB * sl2);
        const float s1A = lazy_scale(m0A, m1A), s1B = lazy_scale(m0B, m1B);
        float sumA = 0.f, sumB = 0.f;
        if (has1) {
          exp_rows(s, sl2, m1A, m1B, sumA, sumB);
          pack_p8(pa, s, 1.f, 1.f);
          store_p8(sPb, pa, wi, lane);
          fence_proxy_async();
        }
        publish_rows(sM, sS1p, rA, rB, m1A, m1B, s1A, s1B, lead);
        named_bar_arrive(BAR_P1, kThreads);
        W8_TL(3);
        const float fA = s0A * s1A, fB = s0B * s1B;
        // every row's s0 s1 (this parity's stay until WG0's BAR_A two pairs on)
        if (wg_any(fA != 1.f || fB != 1.f, BAR_RED1)) rescale_ot(o, sS0p, sS1p, lane);
        lsA = lsA * fA + sumA;
        lsB = lsB * fB + sumB;
        if (has1) {
          pv8_ot(o, va, sPb);  // O^T_R += V1_R^T P1^T
          W8_TL(10);
          if (ld1.valid) {  // B1's rope and latent 256-511: nothing else reads them in this pair
            refill8_group(p, map, ld1, kb1, bars1 + 16, 2, wi, 0);
            refill8_group(p, map, ld1, kb1, bars1 + 8, 1, wi, 1);
          }
          W8_TL(11);
          wgmma_wait<0>();
          reg_fence2(o);
          keep_alive_a(va);
        }
        W8_TL(4);
        mbar_wait(bars0 + 8, par0);  // B0 latent 256-511 (WG0's Q.K^T on B0 retired before BAR_A)
        W8_TL(5);
        vt_frags(kb0, 1, nv0, wi, lane, va);
        named_bar_sync(BAR_WG1, 128);
        W8_TL(6);
        named_bar_sync(BAR_P0, kThreads);
        W8_TL(7);
        pv8_ot(o, va, sPc);  // O^T_R += V0_R^T P0'^T
        W8_TL(12);
        if (ld0.valid) refill8_group(p, map, ld0, kb0, bars0 + 8, 1, wi, 3);
        W8_TL(13);
        wgmma_wait<0>();
        reg_fence2(o);
        keep_alive_a(va);
        W8_TL(8);
      }
      gt += has1 ? 2 : 1;
      la = la1;
      if (has1) cursor_next<1>(p, meta, mb, la);
    }
    epilogue_ot(p, w, mb, smem, o, lsA, lsB, wg, wi, lane, rA, rB, lead, p.kv_scale);
  }
#endif
}


// ---------------------------------------------------------------------------
// Narrow kernel (ladder v10): m-blocks of <= 32 rows, transposed GEMMs.
// ---------------------------------------------------------------------------
// The ring kernel's 256 consumer threads (bar 0 would count its producer warpgroup).
constexpr int kBarCons = 10;
// Row stride (floats) of the merge scratch: 256 dims + 4, conflict-free column writes.
constexpr uint32_t kMergeScr = 260;

template <int N>
struct Lay {
  static constexpr uint32_t kQChunk = N * 128;  // 64 dims of Q: N rows x 128 B (swizzled)
  static constexpr uint32_t kOffQ = 0;          // 9 chunks: latent 0-7, rope 8
  static constexpr uint32_t kOffB0 = 9 * kQChunk;  // 1024-aligned (N = 16, 32)
  static constexpr uint32_t kOffB1 = kOffB0 + kTile;
  static constexpr uint32_t kOffP = kOffB1 + kTile;   // P^T of WG g at kOffP + g * kQChunk
  static constexpr uint32_t kOffScr = kOffP + 2 * kQChunk;  // merge scratch [N][kMergeScr] fp32
  static constexpr uint32_t kOffRed = kOffScr + N * kMergeScr * 4;  // float [2][4][N] column maxima
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

// The column softmax of the transposed kernels (narrow and ring), one tile:
// S^T (keys x rows, accumulator layout, raw scores) -> P^T in shared memory
// at sP (rows x keys, stmatrix.trans, kPF16: f16 P, else bf16). Scores scaled
// to the log2 domain by sl2, keys >= a column's limit masked (only on tiles
// that are not full); the running max m moves only past kLazy (a warpgroup
// vote; then the column maxima are exchanged across the four warps through
// red and O^T and the partial sums lp are rescaled); P = 2^(s - m) summed
// into lp. All 128 threads of the warpgroup (named barriers nb + NB_* - 1).
template <int N, bool kPF16>
__device__ __forceinline__ void col_softmax_p(float (&s)[N / 2], float (&m)[N / 4], float (&lp)[N / 4],
                                              float (&o)[8][N / 2], const int (&col)[N / 4],
                                              const int (&limc)[N / 4], float sl2, bool full, int kt, int wg,
                                              int wi, int lane, int nb, float *red, uint32_t sP) {
  constexpr int NR = N / 2, NC = N / 4;
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
      const float *rj = red + wg * 4 * N + col[j];
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
      stsm_x4_t(sP + sw128_off(8 * cb + (lane & 7), 16 * wi + 8 * kh), pack2<kPF16>(s[8 * q], s[8 * q + 1]),
                pack2<kPF16>(s[8 * q + 2], s[8 * q + 3]), pack2<kPF16>(s[8 * q + 4], s[8 * q + 5]),
                pack2<kPF16>(s[8 * q + 6], s[8 * q + 7]));
    }
  }
}

template <int N, bool kF16>
__device__ __forceinline__ void qk_wgmma(float (&s)[N / 2], uint64_t da, uint64_t db, int accum) {
  if constexpr (N == 16 && kF16) wgmma_nr_m64n16k16_ss_h(s, da, db, accum);
  else if constexpr (N == 16) wgmma_nr_m64n16k16_ss(s, da, db, accum);
  else if constexpr (kF16) wgmma_nr_m64n32k16_ss_h(s, da, db, accum);
  else wgmma_nr_m64n32k16_ss(s, da, db, accum);
}
template <int N, bool kF16>
__device__ __forceinline__ void pv_wgmma(float (&o)[N / 2], uint64_t da, uint64_t db) {
  if constexpr (N == 16 && kF16) wgmma_nr_m64n16k16_ss_ta_h(o, da, db, 1);
  else if constexpr (N == 16) wgmma_nr_m64n16k16_ss_ta(o, da, db, 1);
  else if constexpr (kF16) wgmma_nr_m64n32k16_ss_ta_h(o, da, db, 1);
  else wgmma_nr_m64n32k16_ss_ta(o, da, db, 1);
}

// Both warpgroups (256 threads) at a request's end: merge their (m, l, O^T)
// states per column (row of the m-block) through the fp32 scratch scr
// [N][kMergeScr] (two rounds of 256 dims), write the rows (out times osc / l,
// or the split piece's o_accum) and the LSE. kNamed: the consumers' named
// barrier (the ring kernel, whose producer warpgroup takes no part), else
// __syncthreads.
template <bool kNamed, int NWG = 2>
__device__ __forceinline__ void cons_sync() {
  if constexpr (kNamed) named_bar_sync(kBarCons, NWG * 128);
  else __syncthreads();
}
// One half (256 dims) of the merged rows from the scratch to global memory in
// 16-byte units, a warp writing 512 contiguous bytes: bf16 / f16 rows of
// `out` (8 values a thread) or the split piece's fp32 o_accum rows (4). The
// pairs written before (a warp writing 128 bytes, a division per pair) were
// 0.2-2.6 us slower per call (bench/RESULTS.md session 12, run 4).
// Both destinations are 16-byte aligned: `out` by attention.c's check,
// o_accum by the workspace carving (256 bytes), rows of 512 values.
// NWG warpgroups (tid < NWG * 128) share the units.
template <int N, bool kF16, int NWG = 2>
__device__ __forceinline__ void store_rows_half(const mla_decode_params &p, const ReqWork &w, int mb, int half,
                                                const float *scr, const float *lfin, int tid) {
  if (w.is_split) {
    const size_t base = ((size_t)w.split_idx * mla_decode_rows(&p) + mb * 64) * 512 + 256 * half;
    for (int idx = tid; idx < N * 64; idx += NWG * 128) {  // rows x 64 units of 4 floats
      const int c = idx >> 6, u = idx & 63;
      if (c < w.rows) {
        const float il = lfin[c];
        const float4 v = *reinterpret_cast<const float4 *>(scr + c * kMergeScr + 4 * u);
        *reinterpret_cast<float4 *>(p.o_accum + base + (size_t)c * 512 + 4 * u) =
            make_float4(v.x * il, v.y * il, v.z * il, v.w * il);
      }
    }
  } else {
    for (int idx = tid; idx < N * 32; idx += NWG * 128) {  // rows x 32 units of 8 values
      const int c = idx >> 5, u = idx & 31;
      if (c < w.rows) {
        const float il = lfin[c];
        const float4 a = *reinterpret_cast<const float4 *>(scr + c * kMergeScr + 8 * u);
        const float4 b = *reinterpret_cast<const float4 *>(scr + c * kMergeScr + 8 * u + 4);
        const int rg = mb * 64 + c, t = rg / p.num_heads, h = rg - t * p.num_heads;
        uint4 pk;
        pk.x = pack2<kF16>(a.x * il, a.y * il);
        pk.y = pack2<kF16>(a.z * il, a.w * il);
        pk.z = pack2<kF16>(b.x * il, b.y * il);
        pk.w = pack2<kF16>(b.z * il, b.w * il);
        *reinterpret_cast<uint4 *>(p.out + ((size_t)(w.q0 + t) * p.num_heads + h) * 512 + 256 * half + 8 * u) = pk;
      }
    }
  }
}

// kPermD: O^T's fragment rows g / g + 8 of warp w hold dims 16 w + 2g / 2g + 1
// (the register-operand P V of the per-tensor fp8 ring), not 16 w + g / g + 8.
// NWG warpgroups' states (the ring kernel's per-tensor fp8 runs three): the
// last warpgroup writes its O^T into the scratch, the others add theirs in
// turn, highest first.
template <int N, bool kF16, bool kNamed, bool kPermD = false, int NWG = 2>
__device__ __forceinline__ void merge_rows(const mla_decode_params &p, const ReqWork &w, int mb, const float (&lp)[N / 4],
                                           const float (&m)[N / 4], const float (&o)[8][N / 2],
                                           const int (&col)[N / 4], float osc, int tid, int wg, int wi, int lane,
                                           float *redL, float *mfin, float *lfin, float *scr) {
  constexpr int NR = N / 2, NC = N / 4;
#pragma unroll
  for (int j = 0; j < NC; j++) {
    float v = lp[j];
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    if (lane < 4) redL[(wg * 4 + wi) * N + col[j]] = v;
    if (wi == 0 && lane < 4) mfin[wg * N + col[j]] = m[j];
  }
  cons_sync<kNamed, NWG>();
  float fg[NC];
#pragma unroll
  for (int j = 0; j < NC; j++) {
    const int c = col[j];
    float mg[NWG], fw[NWG], mf = -INFINITY;
#pragma unroll
    for (int g = 0; g < NWG; g++) {
      mg[g] = mfin[g * N + c];
      mf = fmaxf(mf, mg[g]);
    }
#pragma unroll
    for (int g = 0; g < NWG; g++) fw[g] = mg[g] == -INFINITY ? 0.f : ex2(mg[g] - mf);
    fg[j] = fw[0];
#pragma unroll
    for (int g = 1; g < NWG; g++) fg[j] = wg == g ? fw[g] : fg[j];
    if (wg == 0 && wi == 0 && lane < 4) {
      float l = 0.f;
#pragma unroll
      for (int g = 0; g < NWG; g++) {
        float lg = 0.f;
#pragma unroll
        for (int x = 0; x < 4; x++) lg += redL[(4 * g + x) * N + c];
        l += lg * fw[g];
      }
      lfin[c] = l > 0.f ? osc / l : 0.f;
      if (c < w.rows) store_lse(p, w, mb, c, l > 0.f ? mf + log2f(l) : -INFINITY);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {
#pragma unroll
    for (int g = NWG - 1; g >= 0; g--) {
      if (wg == g) {
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
          for (int i = 0; i < NR; i++) {
            const int j = 2 * (i >> 2) + (i & 1);
            const int d = kPermD ? 64 * q + 16 * wi + 2 * (lane >> 2) + ((i >> 1) & 1)
                                 : 64 * q + 16 * wi + (lane >> 2) + 8 * ((i >> 1) & 1);
            const float v = o[4 * half + q][i] * fg[j];
            if (g == NWG - 1) scr[col[j] * kMergeScr + d] = v;
            else scr[col[j] * kMergeScr + d] += v;
          }
      }
      cons_sync<kNamed, NWG>();
    }
    store_rows_half<N, kF16, NWG>(p, w, mb, half, scr, lfin, tid);
    cons_sync<kNamed, NWG>();
  }
}

template <int N, int LM, bool kF16>
__global__ void __launch_bounds__(kThreads, 1)
    decode_narrow_kernel(const mla_decode_params p, const __grid_constant__ KvMaps kv_maps, uint32_t vt_lbo,
                     uint32_t vt_sbo) {
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
  const bool issuer = lm_cp(LM) || t128 == 0;  // TMA: one thread; cp.async: the warpgroup
  const int myrow = t128 >> 1;
  const float kvs = p.kv_scale;
  const int cvbar = 7 + wg;  // this warpgroup's fp8 dequantization barrier
  const float sl2 = p.scale * kLog2e;
  float *red = reinterpret_cast<float *>(smem + L::kOffRed);
  float *redL = reinterpret_cast<float *>(smem + L::kOffRedL);
  float *mfin = reinterpret_cast<float *>(smem + L::kOffMf);
  float *lfin = reinterpret_cast<float *>(smem + L::kOffLf);
  float *scr = reinterpret_cast<float *>(smem + L::kOffScr);
  int *lim = reinterpret_cast<int *>(smem + L::kOffLim);
  const uint32_t bars = sb + L::kOffBar + wg * 2 * 8;  // this buffer's barriers: [chunks 0-7, rope]
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
    for (int i = 0; i < 4; i++) mbar_init(sb + L::kOffBar + 8 * i, lm_cp(LM) ? 128 : 1);
    fence_mbar_init();
  }
  __syncthreads();

  BufCursor cur = cursor_first(p, meta, mb, wg);
  if (!lm_cp(LM) && tid == 0) {
    const BufCursor c0 = cursor_first(p, meta, mb, 0), c1 = cursor_first(p, meta, mb, 1);
    const TileSrc s0 = tile_src<LM>(p, er, c0, 0), s1 = tile_src<LM>(p, er, c1, 0);
    if (s0.valid) {
      load_group<LM>(p, kv_maps.m, s0, sb + L::kOffB0, sb + L::kOffBar + 8, 8, 9, 0);
      load_group<LM>(p, kv_maps.m, s0, sb + L::kOffB0, sb + L::kOffBar, 0, 8, 0);
    }
    if (s1.valid) {
      load_group<LM>(p, kv_maps.m, s1, sb + L::kOffB1, sb + L::kOffBar + 24, 8, 9, 0);
      load_group<LM>(p, kv_maps.m, s1, sb + L::kOffB1, sb + L::kOffBar + 16, 0, 8, 0);
    }
  } else if (lm_cp(LM)) {
    // each warpgroup fills its own buffer
    const TileSrc sg = tile_src<LM>(p, er, cur, myrow);
    if (sg.valid) {
      load_group<LM>(p, kv_maps.m, sg, kb, bars + 8, 8, 9, t128);
      load_group<LM>(p, kv_maps.m, sg, kb, bars, 0, 8, t128);
    }
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
      const uint32_t par = use & 1;
      // The next tile and its refill source (under the Q.K^T where
      // next_under_qk).
      constexpr bool kUnderQk = next_under_qk(LM);
      BufCursor nx;
      TileSrc ld;
      if (!kUnderQk) next_tile<LM>(p, meta, mb, er, issuer, myrow, cur, nx, ld);

      // ---- S^T = K Q^T (keys x rows): rope chunk first, then 0-7 ----
      float s[NR];
#pragma unroll
      for (int i = 0; i < NR; i++) s[i] = 0.f;
#pragma unroll
      for (int ci = 0; ci < 9; ci++) {
        const int c = ci == 0 ? 8 : ci - 1;
        if (ci < 2) {
          mbar_wait(bars + (ci == 0 ? 8 : 0), par);  // rope chunk, then chunks 0-7
          group_ready<LM>(kbp, ci == 0 ? 8 : 0, ci == 0 ? 9 : 8, t128, kvs, nv, cvbar);
          wgmma_fence();
        }
#pragma unroll
        for (int k = 0; k < 4; k++)
          qk_wgmma<N, kF16>(s, desc_sw128(kb + c * kChunk + k * 32, 16, 1024), desc_sw128(sQ + c * L::kQChunk + k * 32, 16, 1024),
                      ci > 0 || k > 0);
      }
      wgmma_commit();
      if (kUnderQk) next_tile<LM>(p, meta, mb, er, issuer, myrow, cur, nx, ld);
      wgmma_wait<0>();
      reg_fence(s);
      if (ld.valid) load_group<LM>(p, kv_maps.m, ld, kb, bars + 8, 8, 9, t128);  // rope chunk: read by QK^T only

      // ---- softmax down the columns, P^T -> shared memory ----
      col_softmax_p<N, kF16>(s, m, lp, o, col, limc, sl2, full, kt, wg, wi, lane, nb, red, sP);
      if (lm_tma16(LM) && nv < 64) zero_tail8(kbp, nv, t128);  // (cp.async modes zero-fill, fp8 converts to 0)
      fence_proxy_async();
      named_bar_sync(nb + NB_P - 1, 128);

      // ---- O^T += V^T P^T: 8 m-tiles of 64 dims x 4 key steps ----
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int mt = 0; mt < 8; mt++)
          pv_wgmma<N, kF16>(o[mt], desc_sw128(kb + mt * kChunk + ks * 2048, vt_lbo, vt_sbo), desc_sw128(sP + ks * 32, 16, 1024));
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
      if (ld.valid) load_group<LM>(p, kv_maps.m, ld, kb, bars, 0, 8, t128);
      use++;
      cur = nx;
    }

    // ---- merge the two warpgroups' states, write the request's rows ----
    merge_rows<N, kF16, false>(p, w, mb, lp, m, o, col, 1.f, tid, wg, wi, lane, redL, mfin, lfin, scr);
  }
#endif
}


// ---------------------------------------------------------------------------
// Ring kernel (v11): the narrow kernel's transposed GEMMs for m-blocks of
// <= 16 rows, with the K tiles streamed through a ring of 8 KB chunk slots
// (docs/decode-kernel.md §3.3). v10 gave each warpgroup one 72 KB buffer,
// refilled only after its P V: a buffer was either in flight or computed on,
// and each warpgroup waited out a full DRAM latency per tile. Here a producer
// warp fills the slots in the order the tiles are consumed (per tile: the
// rope chunk, then latent chunks 0-7) as soon as a slot is released: the rope
// slot right after QK^T, the latent slots pairwise as the P V groups retire.
// 25 slots = 2.8 tiles, all of them in flight whenever the warpgroups wait
// (per-tensor fp8: 5 raw tiles, qk_rs_tile).
// 16-bit caches and the per-tensor fp8 cache (f16 operands,
// a raw ring, each warpgroup dequantizing into its own tile; §3.5), through
// TMA (page size >= 8).
// ---------------------------------------------------------------------------
// NWG consumer warpgroups: 2, or 3 for the per-tensor fp8 cache (its
// register-operand GEMMs leave the SM's pipes idle behind two warpgroups'
// chains; a third warpgroup's tiles fill part of that: dev/cuda/fp8_rs wgs,
// bench/RESULTS.md session 14; faster than two at every shape measured once
// the producer issued from several lanes, session 18). With 3 the row arrays used only by
// merge_rows (redL, mfin, lfin) move into the Q region's tail past the merge
// scratch, written after a consumers' barrier (Q is free then): the region
// after the ring would otherwise overflow the 227 KB by 216 bytes.
// N = 32 (per-tensor fp8 at 17-32 rows, two warpgroups: m64n32 GEMMs, twice
// the accumulators): Q and P are twice as large, so the ring holds 20 slots
// (4 raw tiles) instead of 25.
template <int NWG, int N_ = 16>
struct RingLayT {
  static constexpr int N = N_;
  static constexpr int kSlots = N == 16 ? 25 : 20;
  static constexpr bool kMergeInQ = NWG > 2;                 // redL / mfin / lfin in the Q region's tail
  static constexpr uint32_t kQChunk = N * 128;               // 64 dims of Q: N rows x 128 B
  static constexpr uint32_t kOffQ = 0;                       // Q chunks 0-8; the merge scratch aliases them
  static constexpr uint32_t kOffP = 9 * kQChunk;             // P^T of WG g at kOffP + g * kQChunk
  static constexpr uint32_t kOffRing = kOffP + NWG * kQChunk;  // kSlots slots of 64 rows x 128 B
  static constexpr uint32_t kOffRed = kOffRing + kSlots * kChunk;  // float [NWG][4][N] column maxima
  static constexpr uint32_t kOffRedL =                             // float [NWG][4][N] column sums
      kMergeInQ ? N * kMergeScr * 4 : kOffRed + NWG * 4 * N * 4;
  static constexpr uint32_t kOffMf = kOffRedL + NWG * 4 * N * 4;  // float [NWG][N] final max per WG
  static constexpr uint32_t kOffLf = kOffMf + NWG * N * 4;        // float [N] 1 / l
  static constexpr uint32_t kOffLim = kMergeInQ ? kOffRed + NWG * 4 * N * 4 : kOffLf + N * 4;  // int [N]
  static constexpr uint32_t kOffBar = kOffLim + N * 4;              // full[kSlots], empty[kSlots]
  static constexpr uint32_t kOffIss = kOffBar + 2 * kSlots * 8;     // int: ring positions issued
  static constexpr uint32_t kSmem = kOffIss + 8 + 1024;
  static_assert(kOffP % 1024 == 0 && kOffRing % 1024 == 0, "swizzled tiles must be 1024-aligned");
  static_assert(N * kMergeScr * 4 <= kOffP, "the merge scratch must fit in the Q region");
  static_assert(!kMergeInQ || kOffLf + N * 4 <= kOffP, "the merge's row arrays must fit in the Q region's tail");
  static_assert(kOffBar % 8 == 0, "mbarrier alignment");
  static_assert(kSmem <= 232448, "over the opt-in shared memory of sm_90");
  static_assert(N == 16 || (N == 32 && NWG == 2), "32 rows: two warpgroups (o alone is 128 registers)");
  static_assert(kSlots % 5 == 0, "a tile's 5 raw positions must share one slot group");
};
using RingLay = RingLayT<2>;
// Two (or three) consumer warpgroups and a producer warpgroup whose first
// warp issues the loads, a tile's positions from as many lanes
// (ring_produce; the other lanes and warps leave at once). A whole producer warpgroup so
// that setmaxnreg can hand the consumers 232 registers: with a lone producer
// warp (288 threads) the SM sub-partition holding it had three warps, which
// capped every thread at 168 (512 / 3), and the per-tensor fp8 path spilled
// there; 40 / 232 made it 3.7 % faster at b = 128, H = 16 (bench/RESULTS.md
// session 12, run 12). Until session 15 ptxas ignored both setmaxnreg (a
// C-level __trap() in wait_issued, see there) and compiled the consumers at
// the launch bound's 168; they now get their 232.
// With three consumer warpgroups (512 threads: 128 registers a thread at
// launch) the producer gives back to kRing3ProdRegs and the consumers take
// kRing3ConsRegs (prod + 3 cons <= 512: a lane's share of the 64K file;
// ptxas: 152 spills 40 B in the per-tensor fp8 kernel, 160 none; with the
// five-lane producer its 32 spill 8 B).
#ifndef MLA_DEV_RING3_PROD
#define MLA_DEV_RING3_PROD 32
#endif
#ifndef MLA_DEV_RING3_CONS
#define MLA_DEV_RING3_CONS 160
#endif
constexpr int kRingThreads = kThreads + 128, kRingProdRegs = 40, kRingConsRegs = 232;
constexpr int kRing3ProdRegs = MLA_DEV_RING3_PROD, kRing3ConsRegs = MLA_DEV_RING3_CONS;
template <int NWG>
constexpr int ring_threads() { return NWG * 128 + 128; }
static_assert(ring_threads<2>() == kRingThreads, "two consumer warpgroups and the producer's");
static_assert(kRing3ProdRegs + 3 * kRing3ConsRegs <= 512 && kRing3ConsRegs % 8 == 0 && kRing3ProdRegs % 8 == 0,
              "the register file: a lane's share is 512");
// The per-tensor fp8 ring runs three consumer warpgroups: with the producer
// issuing from five lanes (ring_produce) 1.20x faster than two at b = 128,
// H = 16 (bench/RESULTS.md session 18).

// The block-scaled fp8 cache (bf16 operands): the ring region holds the two
// consumer warpgroups' own tiles (slots 0-8 and 9-17, each dequantized by its
// warpgroup) and a raw ring of kRawSlots slots (18-24) the producer fills
// with 5 positions per tile (ring_load's k = 0 the rope box, 1-4 the latent
// pairs). A consumer releases a raw slot as soon as it has read it, so the
// raw ring holds only bytes in flight: ~1.4 tiles of 36 KB. (The per-tensor
// format ran this way until session 12, 255 us at b = 128, H = 16, s_k =
// 8192; it now reads the raw bytes as register operands over the whole ring,
// 210 us: qk_rs_tile below, docs/decode-kernel.md section 3.5.)
constexpr int kRawBase = 18, kRawSlots = 7;
static_assert(kRawBase == 2 * 9 && kRawBase + kRawSlots == RingLay::kSlots, "two f16 tiles, then the raw ring");

// Where the producer loads one tile from (page ids fetched a tile ahead).
struct RingSrc {
  int page, row0;  // TMA_BIG: the page holding the tile's 64 rows, first row in it
  int nbox;        // TMA_SMALL: boxes of P rows to load (those past the piece end are skipped)
  int pages[8];    // TMA_SMALL: their pages (P >= 8: at most 8)
};

template <int LM>
__device__ __forceinline__ RingSrc ring_src(const mla_decode_params &p, int req, int kt0, int nvalid) {
  RingSrc s;
  const int lp = __ffs(p.page_size) - 1;
  const int *bt = p.block_table + (size_t)req * p.block_table_width + (kt0 >> lp);
  s.page = 0;
  s.row0 = 0;
  s.nbox = 0;
#pragma unroll
  for (int b = 0; b < 8; b++) s.pages[b] = 0;
  // (fp8: one instantiation for both page classes)
  if (LM == LOAD_TMA_BIG || (lm_fp8(LM) && p.page_size >= 64)) {
    s.page = bt[0];
    s.row0 = kt0 & (p.page_size - 1);
  } else {
    s.nbox = (nvalid + p.page_size - 1) >> lp;
#pragma unroll
    for (int b = 0; b < 8; b++)
      if (b < s.nbox) s.pages[b] = bt[b];
  }
  return s;
}

// Position k of the tile: 16-bit caches k = 0 the rope chunk 8, then latent
// chunk k - 1; fp8 (the raw ring) k = 0 the rope box (per-tensor: row bytes
// 448..575, the rope is bytes 64..127 of each 128-byte row; block format:
// the bf16 rope, row bytes 528..655, swizzled as a 16-bit chunk), k = 1..4
// the latent pairs (row bytes 128 (k - 1) .. + 127), raw. maps: the launch's
// KvMaps (16-bit and per-tensor fp8 read [1], the 128-byte L2 promotion
// view; the block format [0] and its rope map [2]). Per-tensor fp8 at page
// size >= 64 (ring_latent4) positions 1-4 come as one 4-D box through [3]
// (make_kv_tmap_chunked): k = 1 loads all four slots, completing its own
// barrier (the caller has waited for all four to be free), k = 2-4 load
// nothing and their full barriers stay as they are.
template <int LM>
__device__ __forceinline__ void ring_load(const mla_decode_params &p, const CUtensorMap *maps, const RingSrc &s,
                                          uint32_t dst, uint32_t bar, int k, uint64_t pol, bool hint) {
  const bool latent4 = LM == LOAD_FP8_TMA && ring_latent4(p.page_size) && k >= 1;
  if (latent4 && k > 1) return;
#ifdef MLA_DEV_FAKELOAD  // (dev timing only: the ring's handshakes and waits without the bytes, wrong results;
                         // bench/RESULTS.md session 16 run 8)
  mbar_arrive(bar);
  return;
#endif
  if (latent4) {
    mbar_expect_tx(bar, 4 * kChunk);
    tma_load_4d(dst, maps + 3, bar, 0, s.row0, 0, s.page, hint, pol);
    return;
  }
  const int c = k == 0 ? 8 : k - 1;
  const CUtensorMap *map = maps + 1;
  if constexpr (LM == LOAD_FP8_TMA || LM == LOAD_FP8_BLOCK_TMA) {
    const int P = p.page_size, rows = P < 64 ? P : 64, nbox = P < 64 ? s.nbox : 1;
    const int col = k == 0 ? (LM == LOAD_FP8_TMA ? 448 : 528) : 128 * (k - 1);
    if (LM == LOAD_FP8_BLOCK_TMA) map = maps + (k == 0 ? 2 : 0);
    mbar_expect_tx(bar, (uint32_t)(nbox * rows * 128));
#pragma unroll 1
    for (int b = 0; b < nbox; b++) {
      const int page = P < 64 ? s.pages[b] : s.page, r0 = P < 64 ? 0 : s.row0;
      if (hint) tma_load_3d_hint(dst + b * rows * 128, map, bar, col, r0, page, pol);
      else tma_load_3d(dst + b * rows * 128, map, bar, col, r0, page);
    }
  } else if constexpr (LM == LOAD_TMA_BIG) {
    mbar_expect_tx(bar, kChunk);
    if (hint) tma_load_3d_hint(dst, map, bar, 64 * c, s.row0, s.page, pol);
    else tma_load_3d(dst, map, bar, 64 * c, s.row0, s.page);
  } else {
    const int P = p.page_size;
    mbar_expect_tx(bar, (uint32_t)(s.nbox * P * 128));
#pragma unroll
    for (int b = 0; b < 8; b++)
      if (b < s.nbox) {
        if (hint) tma_load_3d_hint(dst + b * P * 128, map, bar, 64 * c, 0, s.pages[b], pol);
        else tma_load_3d(dst + b * P * 128, map, bar, 64 * c, 0, s.pages[b]);
      }
  }
}

__device__ __forceinline__ void st_release_s32(uint32_t addr, int v) {
  asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Spins until the producer has issued ring positions < n; traps (a launch
// error instead of a hang) after ~2^24 polls, as mbar_wait does. One asm
// block with a predicated trap: a C-level __trap() (an unconditional trap in
// a block of its own) makes ptxas ignore every setmaxnreg of the kernel and
// allocate all of it at the launch-bound count (168 registers for 384
// threads, 128 for 512), which silently cost the consumers their 232.
__device__ __forceinline__ void wait_issued(uint32_t iss, int n) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u32 k;\n.reg .s32 v;\nmov.u32 k, 0;\n"
      "WI_LOOP:\n"
      "ld.acquire.cta.shared::cta.b32 v, [%0];\n"
      "setp.ge.s32 p, v, %1;\n"
      "@p bra WI_DONE;\n"
      "add.u32 k, k, 1;\n"
      "setp.gt.u32 p, k, 16777216;\n"
      "@p trap;\n"
      "bra WI_LOOP;\n"
      "WI_DONE:\n}\n" ::"r"(iss),
      "r"(n)
      : "memory");
}

// The producer (lanes 0 .. kPos - 1 of one warp): walks the part's tiles in
// the consumers' order; lane k fills position k of each tile, ring position
// q (slot q % kSlots, use q / kSlots), once the use before it has been
// released (empty barrier: one arrival per consumer warp); after a
// __syncwarp lane 0 publishes the positions issued (iss). (Per-tensor fp8
// at page size >= 64: lane 1 issues positions 1-4 as one box, ring_load.)
// Why lanes: beside busy consumers one thread took ~2200 cycles to issue a
// tile's five fp8 boxes (each wait + expect_tx + TMA instruction ~440
// cycles, against ~150 with the SM otherwise idle); five lanes issue them
// in ~1440, and the three-warpgroup fp8 ring went from 205 to 170 us at
// b = 128, H = 16, s_k 8192, bf16 292.6 -> 288 (bench/RESULTS.md session 18).
// No watchdog here: a hang shows as the consumers' full-barrier trap.
//
// Why the consumers read iss before the full barriers: kSlots is not a
// multiple of 9, so the previous use of a slot may belong to the other
// warpgroup's tile; if that tile's data had not landed yet, the barrier
// would still be in the phase before and a parity wait would pass at once.
// Once position q is issued, the use before it has landed, been consumed and
// released, so the parity wait is exact.
#ifdef MLA_DEV_TIMELINE
// (dev timeline) the producer of CTA (0, 0): per tile, %clock64 at the loop
// top, after its first slot wait, after its five boxes are issued
constexpr int kTlpTiles = 120;
__device__ long long g_tlp[kTlpTiles][3];
#endif
template <int LM, int kSlots>
__device__ __forceinline__ void ring_produce(const mla_decode_params &p, const CUtensorMap *map, const int *meta,
                                             int mb, uint32_t ring, uint32_t fullb, uint32_t emptyb, uint32_t iss,
                                             int l2_hint, int lane) {
  // Positions per tile, the slots filled (16-bit: all; fp8: the raw ring).
  // (per-tensor fp8: 5 raw positions per tile over the whole ring; the block
  // format: 5 over the raw ring beside the warpgroups' own tiles)
  constexpr bool kRaw = LM == LOAD_FP8_TMA || LM == LOAD_FP8_BLOCK_TMA, kOwn = LM == LOAD_FP8_BLOCK_TMA;
  constexpr int kPos = kRaw ? 5 : 9, kBase = kOwn ? kRawBase : 0, kN = kOwn ? kRawSlots : kSlots;
  const int er = meta[SCHED_END_REQ];
  const uint64_t pol = l2_evict_first();
  const bool hint = l2_hint != 0;
  int req = meta[SCHED_BEGIN_REQ], t = 0;
  ReqWork w = req_work(p, meta, req, mb);
  while (req <= er && t >= w.n_tiles)
    if (++req <= er) w = req_work(p, meta, req, mb);
  if (req > er) return;
  RingSrc cur = ring_src<LM>(p, req, w.kstart, min(64, w.kend_blk - w.kstart));
  int q = 0;
  for (;;) {
    int nreq = req, nt = t + 1;
    ReqWork nw = w;
    while (nreq <= er && nt >= nw.n_tiles) {
      nt = 0;
      if (++nreq <= er) nw = req_work(p, meta, nreq, mb);
    }
    const bool more = nreq <= er;
    RingSrc nxt = cur;
    if (more) {
      const int kt = nw.kstart + 64 * nt;
      nxt = ring_src<LM>(p, nreq, kt, min(64, nw.kend_blk - kt));
    }
#ifdef MLA_DEV_TIMELINE
    const int tq = q / kPos;
    const bool tlp = blockIdx.x == 0 && blockIdx.y == 0 && tq < kTlpTiles && lane == 0;
    if (tlp) g_tlp[tq][0] = clock64();
#endif
    {  // lane k: position q + k
      const int k = lane, pos = q + k, sg = kBase + pos % kN;
      const uint32_t u = (uint32_t)(pos / kN);
      if (u > 0)
        while (!mbar_try_wait(emptyb + 8 * sg, (u - 1) & 1)) {
        }
#ifdef MLA_DEV_TIMELINE
      if (tlp) g_tlp[tq][1] = clock64();
#endif
      // Per-tensor fp8, page size >= 64: lane 1's one box fills the slots
      // of positions 1-4, so all four lanes' slots must be free first.
      if (LM == LOAD_FP8_TMA && ring_latent4(p.page_size)) __syncwarp((1u << kPos) - 1);
      ring_load<LM>(p, map, cur, ring + sg * kChunk, fullb + 8 * sg, k, pol, hint);
      __syncwarp((1u << kPos) - 1);
    }
#ifdef MLA_DEV_TIMELINE
    if (tlp) g_tlp[tq][2] = clock64();
#endif
    q += kPos;
    if (lane == 0) st_release_s32(iss, q);
    if (!more) break;
    req = nreq;
    t = nt;
    w = nw;
    cur = nxt;
  }
}

// The block format, one tile: the raw positions q0 .. q0 + 4 -> this
// warpgroup's bf16 tile at own (chunks 0-7 latent, 8 the rope), each value
// bf16_rn(f32(e4m3) * its row's block scale) as the CPU rounds it (the scale
// varies along the reduction, so it cannot move to the scores); the scales
// (16 bytes a row) are read from global memory at the start, one 16-byte
// load per row of the lane's four; the bf16 rope box is copied as it is.
// Warp w of the warpgroup takes row quads w, w + 4, w + 8, w + 12, 8 lanes
// per row on consecutive pieces: contiguous reads, conflict-free swizzled
// writes. Each raw slot goes back (one arrival per warp) right after the
// warp's reads. Rows >= nvalid become zeros.
template <int LM>
__device__ __forceinline__ void ring_dequant_own(const mla_decode_params &p, int req, int kt, uint8_t *ringp,
                                                 uint8_t *own, uint32_t fullb, uint32_t emptyb, int q0, int w,
                                                 int lane, int nvalid) {
  static_assert(LM == LOAD_FP8_BLOCK_TMA, "the block format only (per-tensor fp8: qk_rs_tile / pv_rs_tile)");
  const int j = lane & 7, rq = lane >> 3, h = j >> 2;
  float4 bs[4];  // the scales of the lane's rows
#pragma unroll
  for (int i = 0; i < 4; i++) {
    bs[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int r = 4 * (w + 4 * i) + rq;
    if (r < nvalid) {
      const int key = kt + r, lp = __ffs(p.page_size) - 1;
      const int page = p.block_table[(size_t)req * p.block_table_width + (key >> lp)];
      const size_t row = (size_t)page * p.page_size + (key & (p.page_size - 1));
      bs[i] = __ldg(reinterpret_cast<const float4 *>(static_cast<const uint8_t *>(p.kv) + row * p.row_bytes + 512));
    }
  }
#pragma unroll
  for (int k = 0; k < 5; k++) {
    const int q = q0 + k, sg = kRawBase + q % kRawSlots;
    mbar_wait(fullb + 8 * sg, (uint32_t)(q / kRawSlots) & 1u);
    const uint8_t *raw = ringp + sg * kChunk;
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int r = 4 * (w + 4 * i) + rq;
      v[i] = *reinterpret_cast<const uint4 *>(raw + r * 128 + 16 * j);  // (the rope: the swizzled bf16 row, piece j)
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(emptyb + 8 * sg);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int r = 4 * (w + 4 * i) + rq, sw = r & 7;
      const bool zero = r >= nvalid;
      if (k == 0) {
        *reinterpret_cast<uint4 *>(own + 8 * kChunk + r * 128 + 16 * j) = zero ? make_uint4(0, 0, 0, 0) : v[i];
      } else {
        const float sc = k == 1 ? bs[i].x : k == 2 ? bs[i].y : k == 3 ? bs[i].z : bs[i].w;
        const uint2 a = dq4_e4m3(v[i].x, sc), b = dq4_e4m3(v[i].y, sc);
        const uint2 c = dq4_e4m3(v[i].z, sc), d = dq4_e4m3(v[i].w, sc);
        uint8_t *dst = own + (2 * (k - 1) + h) * kChunk + r * 128;
        *reinterpret_cast<uint4 *>(dst + (((2 * (j & 3)) ^ sw) << 4)) =
            zero ? make_uint4(0, 0, 0, 0) : make_uint4(a.x, a.y, b.x, b.y);
        *reinterpret_cast<uint4 *>(dst + (((2 * (j & 3) + 1) ^ sw) << 4)) =
            zero ? make_uint4(0, 0, 0, 0) : make_uint4(c.x, c.y, d.x, d.y);
      }
    }
  }
}

// Rows past the piece end may hold NaN (or a slot's stale rows): zero V rows
// >= nvalid in the 8 latent slots of the tile at ring position q0.
__device__ __forceinline__ void zero_tail_ring(uint8_t *ringp, int q0, int nvalid, int t128) {
  const int nz = (64 - nvalid) * 64;  // rows x 8 chunks x 8 16-byte pieces
  for (int i = t128; i < nz; i += 128) {
    const int r = nvalid + (i >> 6), ch = (i >> 3) & 7, x = i & 7;
    const int slot = (q0 + 1 + ch) % RingLay::kSlots;
    *reinterpret_cast<uint4 *>(ringp + slot * kChunk + r * 128 + x * 16) = make_uint4(0, 0, 0, 0);
  }
}


// The slots of ring positions q0 .. q0 + 8 and their full-barrier parities
// (bit k: position q0 + k).
__device__ __forceinline__ uint32_t ring_slots(int q0, int (&sl)[9]) {
  constexpr int S = RingLay::kSlots;
  uint32_t parm = 0;
  int s0 = q0 % S;
  uint32_t u = (uint32_t)(q0 / S);
#pragma unroll
  for (int k = 0; k < 9; k++) {
    sl[k] = s0;
    parm |= (u & 1u) << k;
    if (++s0 == S) {
      s0 = 0;
      u++;
    }
  }
  return parm;
}


// ---- Per-tensor fp8 through the whole ring: the raw bytes as register A
// operands (docs/decode-kernel.md §3.5, session 12; dev/cuda/fp8_rs.cu checks
// the layouts). A tile takes 5 ring positions (ring_load: k = 0 the rope box,
// row bytes 448..575, k = 1..4 the latent bytes 128 (k - 1) .. + 127), and 25
// slots hold 5 tiles, aligned (a tile's positions share one slot group).
//  - S^T = K Q^T: ldmatrix of the b16 view of a box gives a thread bytes
//    4c..4c+3 (c = lane % 4) of a 16-byte row piece; as f16 they fill the
//    fragment's k slots {2c, 2c+1} and {2c+8, 2c+9}, so Q is stored with each
//    16-dim group permuted the same way (ring_q_f16).
//  - O^T += V^T P^T: ldmatrix.trans gives a thread keys 2c, 2c+1 of the byte
//    pair 2g, 2g+1 (g = lane / 4); a byte permute makes (dim 2g: keys 2c,
//    2c+1) and (dim 2g+1: keys 2c, 2c+1): fragment rows g / g + 8 of warp w
//    hold dims 16 w + 2g / 2g + 1 of the m-tile (merge_rows<.., kPermD>).
// Byte b (0..127) of row `key` of a raw box (128B-swizzled, 1024-aligned).
__device__ __forceinline__ uint32_t box_off(int key, int b) {
  return (uint32_t)(key * 128 + ((((b >> 4) ^ (key & 7)) & 7) << 4));
}
// A register buffers of the P V (one batch per m-tile): a batch's registers
// are rewritten only after wait_group kRsBuf - 1. The MLA_DEV_* values here
// and below are compile-time overrides for A/B builds only; at 168 registers
// 3 P V buffers (spills) and Q.K^T batches of 2 k-steps with 3 or 4 buffers
// measured slower (bench/RESULTS.md session 12, run 9).
#ifndef MLA_DEV_PVBUF
#define MLA_DEV_PVBUF 2
#endif
constexpr int kRsBuf = MLA_DEV_PVBUF;

// S^T = K Q^T of one tile (positions' slots sl[0..4], full-barrier parity
// par): the rope box first, then the latent chunks 0-7, in batches of kQkB
// k-steps (16 dims each) over kQkBuf register buffers; each box waited for
// just before its first ldmatrix. The rope box goes back to the producer once
// the last batch has retired.
#ifndef MLA_DEV_QKB
#define MLA_DEV_QKB 4
#endif
#ifndef MLA_DEV_QKBUF
#define MLA_DEV_QKBUF 2
#endif
// kQkAcc accumulators, k-step j adding into acc[j % kQkAcc], summed at the
// end: the 36 m64n16k16 of one accumulator form a dependency chain whose
// latency, not the tensor pipe, set the Q.K^T's time (a timeline, session 13
// run 2: 2613 cycles for 36 k-steps against 1605 for the P V's 32, which
// are 8 chains of 4).
#ifndef MLA_DEV_QKACC
#define MLA_DEV_QKACC 1
#endif
constexpr int kQkAcc = MLA_DEV_QKACC;
#ifndef MLA_DEV_SSACC
#define MLA_DEV_SSACC 1
#endif
constexpr int kSsAcc = MLA_DEV_SSACC;  // the same for the 16-bit ring's shared-memory Q.K^T
constexpr int kQkB = MLA_DEV_QKB, kQkBuf = MLA_DEV_QKBUF;
static_assert(kQkB == 2 || kQkB == 4, "a batch is one or two ldmatrix.x4 of the same chunk");
template <int N>
__device__ __forceinline__ void qk_rs_tile(float (&s)[N / 2], uint32_t ring, uint32_t fullb, uint32_t emptyb,
                                           const int (&sl)[5], uint32_t par, uint32_t sQ, int wi, int lane,
                                           bool latent4) {
  float acc[kQkAcc][N / 2];  // (each one's first k-step does not accumulate: no zeroing needed)
  uint32_t a[kQkBuf][kQkB][4];
  const int key = 16 * wi + (lane & 7) + 8 * ((lane >> 3) & 1);  // this lane's ldmatrix row
  const int usel = 16 * (lane >> 4);                              // first / second 16-byte piece
  // Each box waited for before its first batch (all five before batch 0 was
  // 3-4 % slower: MLA_DEV_WAITALL, bench/RESULTS.md session 17).
#pragma unroll
  for (int bt = 0; bt < 36 / kQkB; bt++) {
    const int ks0 = bt * kQkB, ci = ks0 >> 2, j0 = ks0 & 3;  // first k-step, its chunk (in order) and step
    const int c = ci == 0 ? 8 : ci - 1;                      // Q chunk: rope, then latent 0-7
    const int box = ci == 0 ? 0 : 1 + (c >> 1);              // raw box holding those 64 dims
    const int b0 = ci == 0 ? 64 : 64 * (c & 1);              // their first byte in the box's rows
#ifndef MLA_DEV_NOLOAD
    // (latent4: position 1's barrier completes with all four latent boxes)
    if (j0 == 0 && (ci <= 1 || (!latent4 && (c & 1) == 0))) mbar_wait(fullb + 8 * sl[box], par);
#endif
    uint32_t(&A)[kQkB][4] = a[bt % kQkBuf];
    if (bt >= kQkBuf) wgmma_wait<kQkBuf - 1>();
    const uint32_t base = ring + sl[box] * kChunk;
#pragma unroll
    for (int j = 0; j < kQkB; j += 2) rs_k_pair(base + box_off(key, b0 + 16 * (j0 + j) + usel), A[j], A[j + 1]);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kQkB; j++)
      wgmma_rs_h<N>(acc[(ks0 + j) % kQkAcc], A[j], desc_sw128(sQ + c * RingLayT<2, N>::kQChunk + (j0 + j) * 32, 16, 1024),
                    ks0 + j >= kQkAcc);
    wgmma_commit();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int k = 0; k < kQkAcc; k++) reg_fence(acc[k]);
#pragma unroll
  for (int i = 0; i < N / 2; i++) {
    float v = acc[0][i];
#pragma unroll
    for (int k = 1; k < kQkAcc; k++) v += acc[k][i];
    s[i] = v;
  }
  if (lane == 0) mbar_arrive(emptyb + 8 * sl[0]);  // the rope box: read by QK^T only
}

// O^T += V^T P^T of one tile: m-tile mt reads dims 64 mt .. 64 mt + 63 of box
// 1 + mt / 2; a latent box goes back to the producer once both its m-tiles'
// groups have retired.
template <int N>
__device__ __forceinline__ void pv_rs_tile(float (&o)[8][N / 2], uint32_t ring, uint32_t emptyb, const int (&sl)[5],
                                           uint32_t sP, int wi, int lane) {
  uint32_t a[kRsBuf][4][4];
  const int kr = (lane & 7) + 8 * (lane >> 3);  // this lane's ldmatrix row: key 0..31 of a k-step pair
#pragma unroll
  for (int mt = 0; mt < 8; mt++) {
    uint32_t(&A)[4][4] = a[mt % kRsBuf];
    if (mt >= kRsBuf) {
      wgmma_wait<kRsBuf - 1>();  // m-tiles <= mt - kRsBuf have retired
      const int done = mt - kRsBuf;
      if ((done & 1) && lane == 0) mbar_arrive(emptyb + 8 * sl[1 + (done >> 1)]);
    }
    const uint32_t base = ring + sl[1 + (mt >> 1)] * kChunk;
    const int b = 64 * (mt & 1) + 16 * wi;  // this warp's 16 dims
#pragma unroll
    for (int kp = 0; kp < 2; kp++)
      rs_vt_pair(base + box_off(32 * kp + kr, b), A[2 * kp], A[2 * kp + 1]);  // keys 32 kp ..
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) wgmma_rs_h<N>(o[mt], A[ks], desc_sw128(sP + ks * 32, 16, 1024), 1);
    wgmma_commit();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
  if (lane == 0) {
#pragma unroll
    for (int m = 8 - kRsBuf; m < 8; m += 2) mbar_arrive(emptyb + 8 * sl[1 + (m >> 1)]);
  }
}

// Rows past the piece end may hold anything (NaN codes, a slot's stale rows):
// zero latent rows >= nvalid of the tile's four latent boxes (raw bytes).
__device__ __forceinline__ void zero_tail_raw(uint8_t *ringp, const int (&sl)[5], int nvalid, int t128) {
  const int nz = (64 - nvalid) * 32;  // rows x 4 boxes x 8 16-byte pieces
  for (int i = t128; i < nz; i += 128) {
    const int r = nvalid + (i >> 5);
    const int bx = 1 + ((i >> 3) & 3), x = i & 7;
    *reinterpret_cast<uint4 *>(ringp + sl[bx] * kChunk + r * 128 + x * 16) = make_uint4(0, 0, 0, 0);
  }
}

// Per-tensor fp8: the request's Q rows as f16 in the swizzled Q chunks, times
// 2^e (q_f16_exponent). Returns 2^-e, the factor the scores need
// back. The NWG * 128 consumer threads; red: 4 NWG floats of scratch. Each 16-dim group
// is stored permuted for qk_rs_tile: slot s holds dim 4 (s / 2) + s % 2
// (s < 8) or 4 ((s - 8) / 2) + 2 + s % 2, i.e. the group's 32-bit words 0, 2,
// 4, 6 then 1, 3, 5, 7.
template <class L, int NWG>
__device__ __forceinline__ float ring_q_f16(const mla_decode_params &p, const ReqWork &w, int mb, uint32_t sQ,
                                            float *red, int tid) {
  // units: 16-dim groups, two 16-byte loads of bf16 each
  constexpr int N = L::N, kU = 2, kPerRow = 72 / kU, kT = NWG * 128;
  constexpr int kPer = (N * kPerRow + kT - 1) / kT;
  const int H = p.num_heads;
  uint4 v[kPer][kU];
  float mx = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kT, r = ci / kPerRow, pc = (ci - r * kPerRow) * kU;  // first 8-dim piece
#pragma unroll
    for (int u = 0; u < kU; u++) v[i][u] = make_uint4(0, 0, 0, 0);
    if (ci < N * kPerRow && r < w.rows) {
      const int rg = mb * 64 + r, t = rg / H, h = rg % H;
      const uint16_t *src = pc < 64 ? p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + pc * 8
                                    : p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head +
                                          (pc - 64) * 8;
#pragma unroll
      for (int u = 0; u < kU; u++) {
        v[i][u] = *reinterpret_cast<const uint4 *>(src + 8 * u);
        const uint32_t x[4] = {v[i][u].x, v[i][u].y, v[i][u].z, v[i][u].w};
#pragma unroll
        for (int k = 0; k < 4; k++) mx = fmaxf(mx, bf16x2_absmax(x[k]));
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  named_bar_sync(kBarCons, kT);
  float m = red[0];
#pragma unroll
  for (int i = 1; i < kT / 32; i++) m = fmaxf(m, red[i]);
  const int e = q_f16_exponent(m);
  const float up = __uint_as_float((uint32_t)(127 + e) << 23);  // 2^e, a normal float
#pragma unroll
  for (int i = 0; i < kPer; i++) {
    const int ci = tid + i * kT, r = ci / kPerRow, pc = (ci - r * kPerRow) * kU, ch = pc >> 3;
    if (ci < N * kPerRow) {
      uint32_t y[4 * kU];
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const uint32_t x[4] = {v[i][u].x, v[i][u].y, v[i][u].z, v[i][u].w};
#pragma unroll
        for (int k = 0; k < 4; k++) y[4 * u + k] = bf16x2_to_f16x2(x[k], up);
      }
      st_shared_v4(sQ + ch * L::kQChunk + sw128_off(r, (pc & 7) * 8), y[0], y[2], y[4], y[6]);
      st_shared_v4(sQ + ch * L::kQChunk + sw128_off(r, (pc & 7) * 8 + 8), y[1], y[3], y[5], y[7]);
    }
  }
  return __uint_as_float((uint32_t)(127 - e) << 23);
}

// Development timeline (compile with -DMLA_DEV_TIMELINE; never in a library
// build): %clock64 stamps by thread 0 of each consumer warpgroup of CTA (0, 0)
// at the phases of each of its first kTlTiles tiles; the launcher prints them
// after the MLA_DEV_TIMELINE_AT-th launch (docs/decode-kernel.md §3.5.2).
#ifdef MLA_DEV_TIMELINE
constexpr int kTlTiles = 80, kTlPh = 7;
__device__ long long g_tl[3][kTlTiles][kTlPh];
#define RING_TL(ph) \
  do { \
    if (tl_on && tli < kTlTiles) g_tl[wg][tli][ph] = clock64(); \
  } while (0)
#else
#define RING_TL(ph) \
  do { \
  } while (0)
#endif

template <int LM, bool kF16, int NWG, int NROWS>
__global__ void __launch_bounds__(ring_threads<NWG>(), 1)
    decode_ring_kernel(const mla_decode_params p, const __grid_constant__ KvMaps kv_maps, uint32_t vt_lbo,
                       uint32_t vt_sbo, int l2_hint) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = RingLayT<NWG, NROWS>;
  static_assert(NROWS == 16 || LM == LOAD_FP8_TMA, "32 rows: the per-tensor fp8 ring only");
  constexpr int kCons = NWG * 128;  // consumer threads (the producer warpgroup follows)
  constexpr int N = L::N, S = L::kSlots;
  // Per-tensor fp8 runs f16 operands (exact e4m3 values, Q in f16) and
  // writes the activations' bf16; kF16 is the 16-bit f16 cache.
  // kRs: per-tensor fp8, exact f16 operands converted from the raw bytes in
  // registers (qk_rs_tile / pv_rs_tile), the whole ring raw; kOwn: the block
  // format through the raw ring, each warpgroup dequantizing into its own tile
  // (ring_dequant_own).
  constexpr bool kRs = LM == LOAD_FP8_TMA, kOwn = LM == LOAD_FP8_BLOCK_TMA, kRaw = kRs || kOwn;
  constexpr bool kMF16 = kF16 || kRs;  // f16 operands
  constexpr int kPos = kRaw ? 5 : 9;  // ring positions per tile (ring_produce)
  constexpr int NR = N / 2;  // accumulator registers per m64nN tile
  constexpr int NC = N / 4;  // columns (rows of the m-block) per thread
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  pdl_trigger();
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x;
  const uint32_t fullb = sb + L::kOffBar, emptyb = fullb + S * 8, ring = sb + L::kOffRing, iss = sb + L::kOffIss;
  if (tid == 0) {
    *reinterpret_cast<int *>(smem + L::kOffIss) = 0;
    for (int i = 0; i < S; i++) {
      mbar_init(fullb + 8 * i, 1);   // the producer's expect_tx arrival + the bytes
      mbar_init(emptyb + 8 * i, 4);  // lane 0 of each warp of the consuming warpgroup
    }
    fence_mbar_init();
  }
  __syncthreads();
  if (tid >= kCons) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(NWG == 2 ? kRingProdRegs : kRing3ProdRegs));
#ifndef MLA_DEV_NOLOAD  // (dev timing only: no loads, no waits for them; wrong results)
    if (tid - kCons < kPos) ring_produce<LM, S>(p, kv_maps.m, meta, mb, ring, fullb, emptyb, iss, l2_hint, tid - kCons);
#endif
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(NWG == 2 ? kRingConsRegs : kRing3ConsRegs));
  const int wg = tid >> 7, t128 = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  const int er = meta[SCHED_END_REQ];
  float sl2 = p.scale * kLog2e;  // fp8: times the per-tensor scale and Q's 2^-e, per request
  const float osc = kRs ? p.kv_scale : 1.f;  // per-tensor fp8: the output's factor
  float *red = reinterpret_cast<float *>(smem + L::kOffRed);
  float *redL = reinterpret_cast<float *>(smem + L::kOffRedL);
  float *mfin = reinterpret_cast<float *>(smem + L::kOffMf);
  float *lfin = reinterpret_cast<float *>(smem + L::kOffLf);
  float *scr = reinterpret_cast<float *>(smem + L::kOffQ);  // after the request's last QK^T
  int *lim = reinterpret_cast<int *>(smem + L::kOffLim);
  uint8_t *ringp = smem + L::kOffRing;
  const uint32_t sP = sb + L::kOffP + wg * L::kQChunk;
  const uint32_t sQ = sb + L::kOffQ;
  const int nb = 1 + 3 * wg;  // this warpgroup's named barrier ids: nb + NB_* - 1
  int col[NC];
#pragma unroll
  for (int j = 0; j < NC; j++) col[j] = 8 * (j >> 1) + 2 * (lane & 3) + (j & 1);
  int gbase = 0;  // tiles of the part's earlier requests: tile i of the part is at ring position 9 i
#ifdef MLA_DEV_TIMELINE
  const bool tl_on = blockIdx.x == 0 && blockIdx.y == 0 && t128 == 0;
  int tli = 0;
#endif

  for (int req = meta[SCHED_BEGIN_REQ]; req <= er; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;  // (n_tiles == 0: the producer skips it too)
    named_bar_sync(kBarCons, kCons);  // the last request is done with Q / the scratch and the row arrays
    if constexpr (kRs) {
      if (tid < N) lim[tid] = tid < w.rows ? row_limit(p, w, mb, tid) : 0;  // padding rows see no key
      sl2 = p.scale * kLog2e * p.kv_scale * ring_q_f16<L, NWG>(p, w, mb, sQ, red, tid);
      fence_proxy_async();
    } else {
      const int H = p.num_heads;
      for (int ci = tid; ci < N * 72; ci += kCons) {
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
    named_bar_sync(kBarCons, kCons);
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

    // The warpgroups take the part's tiles in turn (tile i: warpgroup i % NWG).
    for (int t = (wg + NWG - gbase % NWG) % NWG; t < w.n_tiles; t += NWG) {
      const int kt = w.kstart + 64 * t;
      const int nv = min(64, w.kend_blk - kt);
      const bool full = kt + 64 <= lim0;
      const int q0 = kPos * (gbase + t);  // ring positions q0 (rope), q0 + 1 + c (latent chunk c)
      int sl[9], rsl[5];
      uint32_t parm = 0;  // bit k: full-barrier parity of position q0 + k (kRs: of all five)
      if constexpr (kRs) {
#pragma unroll
        for (int k = 0; k < 5; k++) rsl[k] = q0 % S + k;  // (the ring holds S / 5 aligned tiles)
        parm = (uint32_t)(q0 / S) & 1u;
      } else if constexpr (kOwn) {
#pragma unroll
        for (int k = 0; k < 9; k++) sl[k] = 9 * wg + (k == 0 ? 8 : k - 1);  // this warpgroup's f16 tile
      } else {
        parm = ring_slots(q0, sl);
      }

      // ---- S^T = K Q^T (keys x rows): rope chunk first, then 0-7 ----
      float s[NR];
#pragma unroll
      for (int i = 0; i < NR; i++) s[i] = 0.f;
      RING_TL(0);
#ifndef MLA_DEV_NOLOAD
      wait_issued(iss, q0 + kPos);  // the tile is issued (ring_produce says why)
#endif
      RING_TL(1);
#ifdef MLA_DEV_TIMELINE
      if constexpr (kRs) {  // (the timeline waits for the whole tile here: stamp 2 = its data landed;
                            // page size >= 64: position 1's barrier counts all four latent boxes)
        for (int k = 0; k < (ring_latent4(p.page_size) ? 2 : 5); k++) mbar_wait(fullb + 8 * rsl[k], parm);
      }
#endif
      RING_TL(2);
      if constexpr (kRs) {
        qk_rs_tile<N>(s, ring, fullb, emptyb, rsl, parm, sQ, wi, lane, ring_latent4(p.page_size));
      } else {
        if constexpr (kOwn) {
          // Into this warpgroup's own bf16 tile: its last P V (two tiles ago)
          // must have retired in all four warps first. (Three converter warps
          // doing this ahead of the consumers measured slower: 369 vs 316 us
          // at b = 128, s_k = 8192, in-place staging; docs section 3.5.)
          named_bar_sync(nb + NB_MAX - 1, 128);
          ring_dequant_own<LM>(p, req, kt, ringp, ringp + 9 * wg * kChunk, fullb, emptyb, q0, wi, lane, nv);
          fence_proxy_async();
          named_bar_sync(nb + NB_P - 1, 128);
        }
        // (kSsAcc accumulators, as kQkAcc in qk_rs_tile)
        float acc[kSsAcc][NR];
#pragma unroll
        for (int k = 0; k < 9; k++) {
          const int c = k == 0 ? 8 : k - 1;
#ifndef MLA_DEV_NOLOAD
          if constexpr (!kRaw) mbar_wait(fullb + 8 * sl[k], (parm >> k) & 1u);
#endif
          wgmma_fence();
          const uint32_t sa = ring + sl[k] * kChunk;
#pragma unroll
          for (int kk = 0; kk < 4; kk++)
            qk_wgmma<N, kMF16>(acc[(4 * k + kk) % kSsAcc], desc_sw128(sa + kk * 32, 16, 1024),
                               desc_sw128(sQ + c * L::kQChunk + kk * 32, 16, 1024), 4 * k + kk >= kSsAcc);
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int k = 0; k < kSsAcc; k++) reg_fence(acc[k]);
#pragma unroll
        for (int i = 0; i < NR; i++) {
          float v = acc[0][i];
#pragma unroll
          for (int k = 1; k < kSsAcc; k++) v += acc[k][i];
          s[i] = v;
        }
        if (!kRaw && lane == 0) mbar_arrive(emptyb + 8 * sl[0]);  // the rope slot: read by QK^T only
      }

      // ---- softmax down the columns, P^T -> shared memory ----
      RING_TL(3);
      col_softmax_p<N, kMF16>(s, m, lp, o, col, limc, sl2, full, kt, wg, wi, lane, nb, red, sP);
      RING_TL(4);
      if (kRs && nv < 64) zero_tail_raw(ringp, rsl, nv, t128);
      if (!kRaw && nv < 64) zero_tail_ring(ringp, q0, nv, t128);  // (block format: dequantized to zeros)
      fence_proxy_async();
      named_bar_sync(nb + NB_P - 1, 128);
      RING_TL(5);
      if constexpr (kRs) {
        pv_rs_tile<N>(o, ring, emptyb, rsl, sP, wi, lane);
        RING_TL(6);
#ifdef MLA_DEV_TIMELINE
        tli++;
#endif
        continue;
      }

      // ---- O^T += V^T P^T: m-tile pairs in four commit groups; a pair's
      // two slots go back to the producer as soon as its group retires ----
      wgmma_fence();
#pragma unroll
      for (int g = 0; g < 4; g++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int mt = 2 * g + h;
          const uint32_t sa = ring + sl[mt + 1] * kChunk;
#pragma unroll
          for (int ks = 0; ks < 4; ks++)
            pv_wgmma<N, kMF16>(o[mt], desc_sw128(sa + ks * 2048, vt_lbo, vt_sbo), desc_sw128(sP + ks * 32, 16, 1024));
        }
        wgmma_commit();
      }
      if constexpr (kRaw) {  // (its own tile: nothing goes back to the producer)
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
      } else {
        wgmma_wait<3>();
        if (lane == 0) {
          mbar_arrive(emptyb + 8 * sl[1]);
          mbar_arrive(emptyb + 8 * sl[2]);
        }
        wgmma_wait<2>();
        if (lane == 0) {
          mbar_arrive(emptyb + 8 * sl[3]);
          mbar_arrive(emptyb + 8 * sl[4]);
        }
        wgmma_wait<1>();
        if (lane == 0) {
          mbar_arrive(emptyb + 8 * sl[5]);
          mbar_arrive(emptyb + 8 * sl[6]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < 8; mt++) reg_fence(o[mt]);
        if (lane == 0) {
          mbar_arrive(emptyb + 8 * sl[7]);
          mbar_arrive(emptyb + 8 * sl[8]);
        }
      }
      RING_TL(6);
#ifdef MLA_DEV_TIMELINE
      tli++;
#endif
    }
    gbase += w.n_tiles;

    // ---- merge the warpgroups' states, write the request's rows ----
    // (merge_rows' first barrier: all warpgroups past their last QK^T, Q
    // becomes the scratch; with the row arrays in Q's tail, one before too)
    if constexpr (L::kMergeInQ) named_bar_sync(kBarCons, kCons);
    merge_rows<N, kF16, true, kRs, NWG>(p, w, mb, lp, m, o, col, osc, tid, wg, wi, lane, redL, mfin, lfin, scr);
  }
#endif
}


// ---- host-side state kept across calls: launch_once.cuh --------------------

// The m-blocks of a part (blockIdx.y) read the same K tiles. Launched as
// 2-CTA clusters (when the m-blocks are even) the two CTAs of a pair start
// together on one GPC, and the wide kernels get faster and lose the bimodal
// spread they had launched plainly: b = 128, H = 128, s_k = 8192, bf16 537-539
// us in six processes against 550-606 (H100), 493-494 against 504-505 (H200);
// fp8 math 389-391 against 396-398 (H200); the DRAM bytes are the same either
// way (ncu), so it is not the second CTA missing L2 (bench/RESULTS.md session
// 32, runs 3-5). Clusters of 4 (s_q = 2, 4 m-blocks) were 1.9x slower. Nothing
// in the kernels uses the cluster. A device where the cluster does not fit
// (cudaOccupancyMaxActiveClusters 0, found once per device) gets the plain
// launch.
template <typename... KArgs, typename... Args>
cudaError_t launch_part_cluster(void (*kernel)(KArgs...), dim3 grid, int smem, cudaStream_t stream, uint64_t *known,
                                uint64_t *fits, const Args &...args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 0;  // a plain launch unless the cluster applies and fits
  const int cy = grid.y % 2 == 0 ? 2 : 1;
  if (cy > 1) {
    attr[0].val.clusterDim.y = (unsigned)cy;
    int dev = -1;
    DEV_CUDA_OK(cudaGetDevice(&dev));
    if (!device_bit_set(known, dev)) {  // (the first launch on this device: not on the hot path)
      cudaLaunchConfig_t probe = cfg;
      probe.gridDim = dim3(1, (unsigned)cy, 1);
      probe.numAttrs = 1;
      int n = 0;
      DEV_CUDA_OK(cudaOccupancyMaxActiveClusters(&n, kernel, &probe));
      if (n > 0) device_bit_mark(fits, dev);
      device_bit_mark(known, dev);
    }
    if (device_bit_set(fits, dev)) cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}


template <int LM, bool kF16>
cudaError_t launch_wide(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  static uint64_t smem_set;  // per instantiation and device
  DEV_CUDA_OK(set_smem_once(decode_wide_kernel<LM, kF16>, (int)kSmemBytes, &smem_set));
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  static uint64_t cl_known, cl_fits;
  return launch_part_cluster(decode_wide_kernel<LM, kF16>, grid, (int)kSmemBytes, stream, &cl_known, &cl_fits, *p,
                             map, kVtLbo, kVtSbo);
}

// The fp8 math kernel: the O^T form with three K buffers (decode_wide8t_kernel;
// the transposing kernel it replaced, 3-7 % slower at b = 128, H = 128, is
// dev/cuda/variants/s28-wide8-transposing.patch).
cudaError_t launch_wide8(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  static uint64_t smem_set;
  const dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  DEV_CUDA_OK(set_smem_once(decode_wide8t_kernel, (int)W8T::kSmem, &smem_set));
  static uint64_t cl_known, cl_fits;
  DEV_CUDA_OK(launch_part_cluster(decode_wide8t_kernel, grid, (int)W8T::kSmem, stream, &cl_known, &cl_fits, *p, map));
#ifdef MLA_DEV_TIMELINE
  {  // dev only: mean cycles between the stamps of the MLA_DEV_TIMELINE_AT-th launch (default 5); syncs
    static int calls = 0;
    if (dev_timeline_due(&calls)) {
      static long long h[2][kTl8Pairs][kTl8Ph];
      cudaStreamSynchronize(stream);
      cudaMemcpyFromSymbol(h, g_tl8, sizeof(h));
      static const char *names[2][9] = {
          {"start", "qk+frags", "softmax>A", "pv V0_L", "B1 lat-L wait", "frags V1_L", "wait P1", "P0'>P0", "pv V1_L"},
          {"start", "qk+frags", "wait A", "softmax>P1", "pv V1_R", "B0 lat-R wait", "frags V0_R", "wait P0", "pv V0_R"}};
      for (int wgi = 0; wgi < 2; wgi++) {
        double sum[kTl8Ph] = {0}, per = 0;
        int n = 0, notl[3] = {0, 0, 0}, ni[2] = {0, 0};
        double iss[2] = {0, 0};
        for (int i = 4; i + 1 < kTl8Pairs; i++) {
          if (h[wgi][i][0] == 0 || h[wgi][i + 1][0] == 0 || h[wgi][i][8] == 0) continue;
          for (int k = 1; k < 9; k++)
            if (h[wgi][i][k]) sum[k] += (double)(h[wgi][i][k] - h[wgi][i][k - 1] > 0 && h[wgi][i][k - 1] ? h[wgi][i][k] - h[wgi][i][k - 1] : 0);
          per += (double)(h[wgi][i + 1][0] - h[wgi][i][0]);
          for (int g = 0; g < 3; g++) notl[g] += !((h[wgi][i][9] >> g) & 1);
          if (h[wgi][i][11]) iss[0] += (double)(h[wgi][i][11] - h[wgi][i][10]), ni[0]++;
          if (h[wgi][i][13]) iss[1] += (double)(h[wgi][i][13] - h[wgi][i][12]), ni[1]++;
          n++;
        }
        fprintf(stderr, "tl8 wg%d refill issue: first %.0f cycles (%d), second %.0f cycles (%d)\n", wgi,
                ni[0] ? iss[0] / ni[0] : 0., ni[0], ni[1] ? iss[1] / ni[1] : 0., ni[1]);
        fprintf(stderr, "tl8 wg%d, mean of %d pairs (cycles since the previous stamp):", wgi, n);
        for (int k = 1; k < 9; k++) fprintf(stderr, " %s %.0f,", names[wgi][k], n ? sum[k] / n : 0.);
        fprintf(stderr, " period %.0f; not landed at start: lat-L %d, lat-R %d, rope %d of %d\n", n ? per / n : 0.,
                notl[0], notl[1], notl[2], n);
      }
      fprintf(stderr, "tl8 wg1 start - wg0 start, pair 10: %lld\n", h[1][10][0] - h[0][10][0]);
    }
  }
#endif
  return cudaGetLastError();
}

template <int N, int LM, bool kF16>
cudaError_t launch_narrow(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  static uint64_t smem_set;
  DEV_CUDA_OK(set_smem_once(decode_narrow_kernel<N, LM, kF16>, (int)Lay<N>::kSmem, &smem_set));
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  decode_narrow_kernel<N, LM, kF16><<<grid, kThreads, Lay<N>::kSmem, stream>>>(*p, map, kVtLbo, kVtSbo);
  return cudaGetLastError();
}

template <int LM, bool kF16, int NWG, int NROWS = 16>
cudaError_t launch_ring_wgs(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  using L = RingLayT<NWG, NROWS>;
  static uint64_t smem_set;  // per instantiation and device
  auto kernel = decode_ring_kernel<LM, kF16, NWG, NROWS>;
  DEV_CUDA_OK(set_smem_once(kernel, (int)L::kSmem, &smem_set));
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  // evict_first when every part holds >= 4 of the request's pieces on
  // average (small batches): measured 2-3 us faster at b = 1, 4 (s_k 32K);
  // slower at b = 128 (docs/decode-kernel.md §3.3).
  const int l2_hint = p->num_sm_parts >= 4 * p->batch_size;
  kernel<<<grid, ring_threads<NWG>(), L::kSmem, stream>>>(*p, map, kVtLbo, kVtSbo, l2_hint);
#ifdef MLA_DEV_TIMELINE
  {  // dev only: print the stamps of the MLA_DEV_TIMELINE_AT-th launch (default 5); syncs
    static int calls = 0;
    if (dev_timeline_due(&calls)) {
      static long long h[3][kTlTiles][kTlPh];
      cudaStreamSynchronize(stream);
      cudaMemcpyFromSymbol(h, g_tl, sizeof(h));
      fprintf(stderr, "timeline (cycles from each tile's phase 0: issued, landed, qk, softmax, P barrier, pv; period)\n");
      double sum[kTlPh] = {0}, per = 0;
      int n = 0;
      for (int wgi = 0; wgi < 3; wgi++)
        for (int i = 0; i < kTlTiles; i++) {
          if (h[wgi][i][0] == 0) continue;
          const long long nx = i + 1 < kTlTiles ? h[wgi][i + 1][0] : 0;
          fprintf(stderr, "tl wg%d tile %2d:", wgi, i);
          for (int k = 1; k < kTlPh; k++) fprintf(stderr, " %6lld", h[wgi][i][k] - h[wgi][i][k - 1]);
          // (then the tile's phase-0 stamp from the first warpgroup's first: bunched or staggered starts)
          fprintf(stderr, " | %6lld | at %8lld\n", nx ? nx - h[wgi][i][0] : 0, h[wgi][i][0] - h[0][0][0]);
          if (i >= 4 && nx) {
            for (int k = 1; k < kTlPh; k++) sum[k] += (double)(h[wgi][i][k] - h[wgi][i][k - 1]);
            per += (double)(nx - h[wgi][i][0]);
            n++;
          }
        }
      {  // the producer: per tile, cycles from its loop top to the first slot free, then issuing its boxes,
         // then to the next tile's loop top (the next tile's source: block table, request bookkeeping)
        static long long hp[kTlpTiles][3];
        cudaMemcpyFromSymbol(hp, g_tlp, sizeof(hp));
        double a = 0, b = 0, c = 0;
        int np = 0;
        for (int i = 4; i + 1 < kTlpTiles; i++)
          if (hp[i][0] && hp[i + 1][0]) {
            a += (double)(hp[i][1] - hp[i][0]), b += (double)(hp[i][2] - hp[i][1]), c += (double)(hp[i + 1][0] - hp[i][2]);
            np++;
          }
        if (np) fprintf(stderr, "tlp producer mean of %d tiles: slot wait %.0f, issue %.0f, to next tile %.0f\n", np,
                        a / np, b / np, c / np);
      }
      fprintf(stderr, "tl mean of %d tiles (from tile 4):", n);
      for (int k = 1; k < kTlPh; k++) fprintf(stderr, " %6.0f", n ? sum[k] / n : 0.);
      fprintf(stderr, " | %6.0f\n", n ? per / n : 0.);
    }
  }
#endif
  return cudaGetLastError();
}

// Three consumer warpgroups for the per-tensor fp8 cache (RingLayT says
// why), two otherwise. (The two-warpgroup fp8 ring and the v10 narrow kernel
// for every batch were development switches until session 28:
// dev/cuda/variants/s28-decode-legacy-ring2.patch.)
template <int LM, bool kF16>
cudaError_t launch_ring(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  if constexpr (LM == LOAD_FP8_TMA) return launch_ring_wgs<LM, kF16, 3>(p, map, stream);
  else return launch_ring_wgs<LM, kF16, 2>(p, map, stream);
}


// Which split kernel a launch takes: the one decision behind both
// launch_mode and mla_cuda_decode_route. fp8 math: MLA_FLAG_FP8_MATH over a
// per-tensor fp8 cache through TMA (page size >= 8), m-blocks wider than the
// narrow kernels take. Ring: <= 16 rows of any cache through TMA (page size
// >= 8: the TMA load modes); the 32-row ring for 17-32 rows of a per-tensor
// fp8 cache, likewise. Then narrow for <= 16 / <= 32 rows, wide above.
enum DecodeRoute { ROUTE_WIDE8, ROUTE_RING, ROUTE_RING32, ROUTE_NARROW16, ROUTE_NARROW32, ROUTE_WIDE };
DecodeRoute route_of(const mla_decode_params *p) {
  const int rows = mla_decode_rows(p);
  const bool fp8 = p->kv_dtype == MLA_DTYPE_FP8_E4M3, tma = p->page_size >= 8;
  if (p->fp8_math && fp8 && tma && rows > 32) return ROUTE_WIDE8;
  if (tma && rows <= 16) return ROUTE_RING;
  if (fp8 && tma && rows <= 32) return ROUTE_RING32;
  return rows <= 16 ? ROUTE_NARROW16 : rows <= 32 ? ROUTE_NARROW32 : ROUTE_WIDE;
}

// One load mode and operand type, the kernel route_of picks (the TMA modes
// are exactly the page sizes >= 8, so the ring and fp8 math routes only
// reach their instantiations).
template <int LM, bool kF16>
cudaError_t launch_mode(const mla_decode_params *p, const KvMaps &map, cudaStream_t stream) {
  switch (route_of(p)) {
    case ROUTE_WIDE8:
      if constexpr (LM == LOAD_FP8_TMA) return launch_wide8(p, map, stream);
      break;
    case ROUTE_RING:
      if constexpr (lm_tma16(LM) || LM == LOAD_FP8_TMA || LM == LOAD_FP8_BLOCK_TMA)
        return launch_ring<LM, kF16>(p, map, stream);
      break;
    case ROUTE_RING32:
      if constexpr (LM == LOAD_FP8_TMA) return launch_ring_wgs<LM, kF16, 2, 32>(p, map, stream);
      break;
    case ROUTE_NARROW16:
      return launch_narrow<16, LM, kF16>(p, map, stream);
    case ROUTE_NARROW32:
      return launch_narrow<32, LM, kF16>(p, map, stream);
    case ROUTE_WIDE:
      return launch_wide<LM, kF16>(p, map, stream);
  }
  return cudaErrorNotSupported;  // (a route outside this load mode's kernels: not reached)
}

// Tensor maps of a cache layer, kept across calls: a map is a pure function
// of the layer's base address, its dtype and geometry (the key), so an entry
// found under an equal key holds exactly the bits encoding would produce,
// whatever was freed or allocated in between; nothing needs invalidating.
// One slot per hash of the address (a model's layers spread over the slots;
// a collision just encodes again). Shared by all threads under a mutex held
// only for the lookup or the store.
struct KvMapKey {
  const void *kv;
  int64_t num_pages, row_bytes;
  int page_size, kv_dtype;
};
struct KvMapEntry {
  KvMapKey key;
  int valid;
  KvMaps maps;
};
constexpr int kMapSlotsLog2 = 7;
KvMapEntry g_kv_maps[1 << kMapSlotsLog2];
pthread_mutex_t g_kv_maps_mu = PTHREAD_MUTEX_INITIALIZER;

bool same_key(const KvMapKey &a, const KvMapKey &b) {
  return a.kv == b.kv && a.num_pages == b.num_pages && a.row_bytes == b.row_bytes && a.page_size == b.page_size &&
         a.kv_dtype == b.kv_dtype;
}

// The maps the TMA load modes read (page size >= 8): fp8 caches as bytes
// (latent pairs and the per-tensor rope; block scales and the bf16 rope of
// the block format), 16-bit caches as one bf16 / f16 view.
cudaError_t encode_kv_maps(const mla_decode_params *p, KvMaps *map) {
  memset(map, 0, sizeof *map);
  const bool fp8 = p->kv_dtype == MLA_DTYPE_FP8_E4M3, fp8b = p->kv_dtype == MLA_DTYPE_FP8_E4M3_BLOCK;
  if (!fp8 && !fp8b) {
    cudaError_t e = make_kv_tmap(p, &map->m[0], CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
    if (e == cudaSuccess) e = make_kv_tmap(p, &map->m[1], CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
    if (e == cudaSuccess && p->page_size >= 64)  // LOAD_TMA_BIG: a latent half (4 chunks of 128 B) as one box
      e = make_kv_tmap_chunked(p, &map->m[3], 8, 4, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
    return e;
  }
  cudaError_t e = make_kv_tmap_bytes(p, &map->m[0], 128, false);  // latent pairs (and the per-tensor rope)
  if (e == cudaSuccess && fp8)  // the ring kernel's boxes: swizzled for its ldmatrix reads (qk_rs_tile)
    e = make_kv_tmap_bytes(p, &map->m[1], 128, true, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  if (e == cudaSuccess && fp8) e = make_kv_tmap_bytes(p, &map->m[2], 128, true);  // swizzled: the fp8 math kernel
  if (e == cudaSuccess && fp8 && ring_latent4(p->page_size))
    e = make_kv_tmap_chunked(p, &map->m[3], 4, 4, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  if (e == cudaSuccess && fp8b) e = make_kv_tmap_bytes(p, &map->m[1], 16, false);  // block scales
  if (e == cudaSuccess && fp8b) e = make_kv_tmap_bytes(p, &map->m[2], 128, true);  // bf16 rope, swizzled
  return e;
}

cudaError_t kv_maps_cached(const mla_decode_params *p, KvMaps *map) {
  const KvMapKey key = {p->kv, p->num_pages, p->row_bytes, p->page_size, p->kv_dtype};
  const uint64_t h = ((uint64_t)(uintptr_t)p->kv >> 8) * 0x9E3779B97F4A7C15ull;
  KvMapEntry &slot = g_kv_maps[h >> (64 - kMapSlotsLog2)];
  pthread_mutex_lock(&g_kv_maps_mu);
  const bool hit = slot.valid && same_key(slot.key, key);
  if (hit) *map = slot.maps;
  pthread_mutex_unlock(&g_kv_maps_mu);
  if (hit) return cudaSuccess;
  const cudaError_t e = encode_kv_maps(p, map);
  if (e != cudaSuccess) return e;
  pthread_mutex_lock(&g_kv_maps_mu);
  slot.key = key;
  slot.maps = *map;
  slot.valid = 1;
  pthread_mutex_unlock(&g_kv_maps_mu);
  return cudaSuccess;
}

// Whether this build holds sm_90a code for the current device (without it
// the kernel bodies are compiled out), found once per device.
uint64_t g_arch_ok;

cudaError_t check_arch(void) { return check_sm90_once(decode_wide_kernel<LOAD_TMA_BIG, false>, &g_arch_ok); }

}  // namespace

static_assert(kDtBF16 == MLA_DTYPE_BF16 && kDtF16 == MLA_DTYPE_F16 && kDtFP8 == MLA_DTYPE_FP8_E4M3 &&
                  kDtFP8Block == MLA_DTYPE_FP8_E4M3_BLOCK,
              "decode_common.cuh repeats the mla_dtype values");

static int supported_page_size(int page_size) {
  return page_size >= 1 && page_size <= 256 && (page_size & (page_size - 1)) == 0;
}

// Cache row bytes each cache dtype's load path expects (src/cache/cache.h).
static int64_t expected_row_bytes(int kv_dtype) {
  return kv_dtype == MLA_DTYPE_FP8_E4M3 ? 576 : kv_dtype == MLA_DTYPE_FP8_E4M3_BLOCK ? 656 : 1152;
}

extern "C" const char *mla_cuda_decode_unsupported(int kv_dtype, int act_dtype, int page_size) {
  const int ok = (kv_dtype == MLA_DTYPE_BF16 && act_dtype == MLA_DTYPE_BF16) ||
                 (kv_dtype == MLA_DTYPE_F16 && act_dtype == MLA_DTYPE_F16) ||
                 ((kv_dtype == MLA_DTYPE_FP8_E4M3 || kv_dtype == MLA_DTYPE_FP8_E4M3_BLOCK) &&
                  act_dtype == MLA_DTYPE_BF16);
  if (!ok)
    return "the CUDA decode kernels take a bf16 cache with bf16 activations, an f16 cache with f16 "
           "activations, or an fp8 (e4m3 or e4m3 block-scaled) cache with bf16 activations";
  if (!supported_page_size(page_size)) return "the CUDA decode kernels take page sizes that are powers of two 1..256";
  return NULL;
}

extern "C" const char *mla_cuda_decode_route(const mla_decode_params *p) {
  if (mla_cuda_decode_unsupported(p->kv_dtype, p->act_dtype, p->page_size) || p->batch_size == 0 ||
      p->num_sm_parts == 0)
    return "none";
  static const char *const names[] = {"wide-fp8math", "ring", "ring32", "narrow16", "narrow32", "wide"};
  return names[route_of(p)];
}

extern "C" int mla_cuda_decode(const mla_decode_params *p, void *stream_) {
  cudaStream_t stream = (cudaStream_t)stream_;
  if (mla_cuda_decode_unsupported(p->kv_dtype, p->act_dtype, p->page_size) ||
      p->row_bytes != expected_row_bytes(p->kv_dtype))
    return (int)cudaErrorNotSupported;
  if (p->batch_size == 0 || p->num_sm_parts == 0) return (int)cudaSuccess;
  if (mla_decode_m_blocks(p) > 65535) return (int)cudaErrorInvalidConfiguration;  // grid.y
  if (p->num_sm_parts >= 2 && (!p->o_accum || !p->lse_accum)) return (int)cudaErrorInvalidValue;
  // Built without sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90a) the
  // kernel bodies are compiled out: refuse instead of returning garbage.
  cudaError_t e = check_arch();
  if (e != cudaSuccess) return (int)e;
  // Page size >= 8 loads through TMA (tensor maps, kept across calls),
  // smaller pages through a cp.async row gather.
  KvMaps map;  // passed by value (kernel parameter)
  memset(&map, 0, sizeof map);
  const bool f16 = p->kv_dtype == MLA_DTYPE_F16, fp8 = p->kv_dtype == MLA_DTYPE_FP8_E4M3;
  const bool fp8b = p->kv_dtype == MLA_DTYPE_FP8_E4M3_BLOCK;
  const bool tma = p->page_size >= 8;
  if (tma) e = kv_maps_cached(p, &map);
  if (e != cudaSuccess) return (int)e;
  const bool big = p->page_size >= 64;
  if (fp8) e = tma ? launch_mode<LOAD_FP8_TMA, false>(p, map, stream) : launch_mode<LOAD_FP8, false>(p, map, stream);
  else if (fp8b)
    e = tma ? launch_mode<LOAD_FP8_BLOCK_TMA, false>(p, map, stream) : launch_mode<LOAD_FP8_BLOCK, false>(p, map, stream);
  else if (!tma) e = f16 ? launch_mode<LOAD_GATHER, true>(p, map, stream) : launch_mode<LOAD_GATHER, false>(p, map, stream);
  else if (big) e = f16 ? launch_mode<LOAD_TMA_BIG, true>(p, map, stream) : launch_mode<LOAD_TMA_BIG, false>(p, map, stream);
  else e = f16 ? launch_mode<LOAD_TMA_SMALL, true>(p, map, stream) : launch_mode<LOAD_TMA_SMALL, false>(p, map, stream);
  if (e != cudaSuccess) return (int)e;
  return (int)combine_launch(p, stream);
}
