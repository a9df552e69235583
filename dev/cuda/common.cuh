// Shared pieces of the decode kernel ladder (dev/cuda/decode_v*.cu): PTX
// wrappers, the walk over one split-KV part, and the combine kernel that all
// versions share. Everything here is device code or launch glue; the harness
// (decode_harness.cu) owns the host-side checking.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../src/cuda/decode.h"

// Host tools of this folder (decode_harness, tma_latency, tma_pattern): a
// CUDA error ends the tool with its location and the call that failed.
#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                                  \
    }                                                                                           \
  } while (0)

#define DEV_CUDA_OK(x)                    \
  do {                                    \
    cudaError_t e_ = (x);                 \
    if (e_ != cudaSuccess) return e_;     \
  } while (0)

// Schedule layout (include/mla.h MLA_SCHED_*), repeated here so device code
// does not pull in the public header's C-only parts.
enum { SCHED_BEGIN_REQ = 0, SCHED_BEGIN_TOK = 1, SCHED_END_REQ = 2, SCHED_END_TOK = 3,
       SCHED_BEGIN_SPLIT = 4, SCHED_NUM_REQS = 5, SCHED_INTS = 8 };

static constexpr float kLog2e = 1.4426950408889634f;
static constexpr float kLn2 = 0.6931471805599453f;

// --------------------------------------------------------------------------
// Small PTX wrappers
// --------------------------------------------------------------------------
static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool valid) {
  // src-size 0 writes 16 zero bytes and reads nothing: masked rows never
  // touch the cache (rows past a request's end may hold NaN).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
static __device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
static __device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

static __device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

static __device__ __forceinline__ void named_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

static __device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// A phase or byte-count bug hangs; the watchdog turns the hang into a
// launch error the harness can report. The whole loop is one asm block: a
// C-level loop between wgmmas makes ptxas serialise them (C7520).
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u32 n;\nmov.u32 n, 0;\n"
      "MBW_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra MBW_DONE;\n"
      "add.u32 n, n, 1;\n"
      "setp.gt.u32 p, n, 1048576;\n"
      "@p trap;\n"
      "bra MBW_LOOP;\n"
      "MBW_DONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                                   int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

static __device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across a wgmma
// wait (registers named here are "used" at this point).
template <int N>
static __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// 128B-swizzle shared-memory matrix descriptor (HOPPER-NOTES §1).
static __device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | (uint64_t)((lbo & 0x3FFFF) >> 4) << 16 |
         (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}

// Byte offset of element (r, c) inside one 64x64 bf16 sub-tile stored with
// the 128B swizzle (1024-aligned): 16-byte chunk index XOR row mod 8.
static __device__ __forceinline__ uint32_t sw128_off(int r, int c) {
  return (uint32_t)(r * 128 + ((((c >> 3) ^ (r & 7)) & 7) << 4) + (c & 7) * 2);
}

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

// --------------------------------------------------------------------------
// The work of one request inside one split-KV part, for one m-block.
// --------------------------------------------------------------------------
struct ReqWork {
  int q0;        // first query row (token) of the request
  int qlen;      // query tokens
  int K;         // kv length
  int kstart;    // first key of this piece (multiple of 64)
  int kend;      // end key of this piece (exclusive)
  int kend_blk;  // kend cut by the causal limit of the m-block's last row
  int rows;      // valid rows of this m-block (0: the m-block has no rows here)
  int split_idx; // partial-state index
  int is_split;  // 1: write partials, 0: write the final output
  int n_tiles;   // 64-key tiles to visit
};

static __device__ __forceinline__ ReqWork req_work(const mla_decode_params &p, const int *meta,
                                                   int req, int mb) {
  ReqWork w;
  const int br = meta[SCHED_BEGIN_REQ], er = meta[SCHED_END_REQ];
  w.q0 = p.qo_indptr[req];
  w.qlen = p.qo_indptr[req + 1] - w.q0;
  w.K = p.kv_lens[req];
  w.kstart = req == br ? meta[SCHED_BEGIN_TOK] : 0;
  w.kend = req == er ? meta[SCHED_END_TOK] : w.K;
  const int piece = req == br ? meta[SCHED_BEGIN_SPLIT] : 0;
  const int pieces = p.num_splits[req + 1] - p.num_splits[req];
  w.split_idx = p.num_splits[req] + piece;
  w.is_split = pieces > 1;
  const int H = p.num_heads;
  const int r0 = mb * 64;
  int rows = w.qlen * H - r0;
  w.rows = rows < 0 ? 0 : (rows > 64 ? 64 : rows);
  w.kend_blk = w.kend;
  if (w.rows > 0 && p.causal) {
    const int t_last = (r0 + w.rows - 1) / H;
    const int lim = w.K - w.qlen + t_last + 1;
    if (lim < w.kend_blk) w.kend_blk = lim;
  }
  if (w.rows == 0 || w.kend_blk <= w.kstart)
    w.n_tiles = 0;
  else
    w.n_tiles = (w.kend_blk - w.kstart + 63) / 64;
  return w;
}

// Key limit (exclusive) of row r of the m-block: causal cut and piece end.
static __device__ __forceinline__ int row_limit(const mla_decode_params &p, const ReqWork &w, int mb,
                                                int r) {
  int lim = w.kend;
  if (p.causal) {
    const int t = (mb * 64 + r) / p.num_heads;
    const int c = w.K - w.qlen + t + 1;
    if (c < lim) lim = c;
  }
  return lim;
}

// Writes one (row, 2 columns) pair of the result: final bf16 output or the
// fp32 partial of a split request. inv_l = 1/l (0 for an empty row).
static __device__ __forceinline__ void store_out_pair(const mla_decode_params &p, const ReqWork &w,
                                                      int mb, int r, int col, float o0, float o1,
                                                      float inv_l) {
  const int rg = mb * 64 + r;
  if (w.is_split) {
    float2 v = make_float2(o0 * inv_l, o1 * inv_l);
    size_t off = ((size_t)w.split_idx * mla_decode_rows(&p) + rg) * 512 + col;
    *reinterpret_cast<float2 *>(p.o_accum + off) = v;
  } else {
    const int t = rg / p.num_heads, h = rg % p.num_heads;
    size_t off = ((size_t)(w.q0 + t) * p.num_heads + h) * 512 + col;
    *reinterpret_cast<uint32_t *>(p.out + off) = pack_bf16(o0 * inv_l, o1 * inv_l);
  }
}

// lse2: log2-domain lse of the row (-inf when empty).
static __device__ __forceinline__ void store_lse(const mla_decode_params &p, const ReqWork &w, int mb,
                                                 int r, float lse2) {
  const int rg = mb * 64 + r;
  if (w.is_split) {
    p.lse_accum[(size_t)w.split_idx * mla_decode_rows(&p) + rg] = lse2 * kLn2;
  } else if (p.lse) {
    const int t = rg / p.num_heads, h = rg % p.num_heads;
    p.lse[(size_t)(w.q0 + t) * p.num_heads + h] = p.lse_base2 ? lse2 : lse2 * kLn2;
  }
}

// --------------------------------------------------------------------------
// Combine: merges the pieces of split requests; unsplit ones were written
// directly by the split-KV kernel and are skipped.
// --------------------------------------------------------------------------
cudaError_t decode_combine_launch(const mla_decode_params *p, cudaStream_t stream);
