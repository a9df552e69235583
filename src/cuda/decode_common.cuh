// Device pieces of the sm_90a decode kernels (decode_sm90.cu): PTX wrappers
// and the walk over one split-KV part. Copied from the kernel ladder's
// dev/cuda/common.cuh (the ladder stays there with its harness).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "decode.h"

#define DEV_CUDA_OK(x)                    \
  do {                                    \
    cudaError_t e_ = (x);                 \
    if (e_ != cudaSuccess) return e_;     \
  } while (0)

// Schedule layout (include/mla.h MLA_SCHED_*), repeated here so device code
// does not pull in the public header's C-only parts.
enum { SCHED_BEGIN_REQ = 0, SCHED_BEGIN_TOK = 1, SCHED_END_REQ = 2, SCHED_END_TOK = 3,
       SCHED_BEGIN_SPLIT = 4, SCHED_NUM_REQS = 5, SCHED_INTS = 8 };

// mla_dtype values (include/mla.h, pinned there; decode_sm90.cu asserts them).
static constexpr int kDtBF16 = 1, kDtF16 = 2, kDtFP8 = 3, kDtFP8Block = 4;

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
// Arrives on the mbarrier once this thread's earlier cp.async copies have
// landed (noinc: the arrival counts against the barrier's expected count).
static __device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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
// One probe of a phase: try_wait may suspend the thread for a system-dependent
// time before it answers; test_wait answers at once (the dev timelines).
#define MLA_MBAR_PROBE(op, ok, bar, parity)                                                                 \
  asm volatile("{\n.reg .pred p;\nmbarrier." op ".parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n" \
               : "=r"(ok)                                                                                    \
               : "r"(bar), "r"(parity)                                                                       \
               : "memory")
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  MLA_MBAR_PROBE("try_wait", ok, bar, parity);
  return ok != 0;
}
static __device__ __forceinline__ bool mbar_test_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  MLA_MBAR_PROBE("test_wait", ok, bar, parity);
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

// The same load with an L2 eviction-priority hint (createpolicy below).
static __device__ __forceinline__ void tma_load_3d_hint(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                                        int c0, int c1, int c2, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
      : "memory");
}
// 4-D box, with the L2 policy when hint (the per-tensor fp8 ring's latent)
static __device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1,
                                                   int c2, int c3, bool hint, uint64_t policy) {
  if (hint)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;" ::"r"(dst),
        "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
        "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
// L2 policy for data read exactly once (a K tile of a single m-block): its
// lines are replaced first, so streaming the cache does not evict what else
// lives in L2 (other kernels' data, dirty lines that would be written back).
static __device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
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

static __device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
static __device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
// Two 16-bit operands of the compile-time type (P of the f16 kernels is f16).
template <bool kF16>
static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kF16) return pack_f16(lo, hi);
  else return pack_bf16(lo, hi);
}

// Per-tensor fp8 caches with f16 operands: Q is stored as f16 times 2^e, e
// chosen from the largest |q| m of the rows sharing the scores' scale so that
// m 2^e lands in [2^14, 2^15) (f16 then holds every bf16 value of that binade
// and the 2^29 below exactly; what flushes is < 2^-29 of the largest term).
// NaN never reaches m (fmaxf), inf or 0 leave e = 0 (the result is inf / NaN
// or all-zero scores either way); e is clamped so 2^e stays normal.
static __device__ __forceinline__ int q_f16_exponent(float m) {
  int e = 0;
  if (m > 0.f && m <= 3.0e38f) {
    const int x = (int)(__float_as_uint(m) >> 23) - 126;  // m = f 2^x, f in [0.5, 1) (subnormal m: clamped below)
    e = min(max(15 - x, -100), 100);
  }
  return e;
}
// The largest magnitude of the two bf16 in a word, as f32 (the magnitude bits
// of each half, shifted up).
static __device__ __forceinline__ float bf16x2_absmax(uint32_t x) {
  return fmaxf(__uint_as_float((x & 0x7fffu) << 16), __uint_as_float(x & 0x7fff0000u));
}
// Two bf16 (one word) times a power of two, as f16x2.
static __device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x, float up) {
  return pack_f16(__uint_as_float(x << 16) * up, __uint_as_float(x & 0xffff0000u) * up);
}
// Four e4m3 (bytes 0-3) to two f16x2, (b0, b1) and (b2, b3), exactly (every
// e4m3 value is an f16 value); the halves come from a PTX register split (no
// shifts or masks). The raw-operand paths apply the cache scale outside the
// GEMMs (the ring kernels' register operands, the wide kernel's lm_raw tiles).
static __device__ __forceinline__ void e4m3x4_f16x2x2(uint32_t v, uint32_t &lo, uint32_t &hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
}

// Four e4m3 values (one word, byte 0 first) dequantized and rounded to bf16:
// e4m3 -> f16 is exact, the product with the scale is the fp32 one of the
// CPU (convert.h mla_e4m3_to_f32(b) * scale), then one round to nearest even
// to bf16 (NaN stays NaN).
static __device__ __forceinline__ uint2 dq4_e4m3(uint32_t w, float sc) {
  const __half2 lo = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3));
  const __half2 hi = __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3));
  const float2 a = __half22float2(lo), b = __half22float2(hi);
  uint2 r;
  r.x = pack_bf16(__fmul_rn(a.x, sc), __fmul_rn(a.y, sc));
  r.y = pack_bf16(__fmul_rn(b.x, sc), __fmul_rn(b.y, sc));
  return r;
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
  int split_idx; // partial-state slot (decode.h: mla_decode_partial_slot)
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
  const int pieces = p.num_splits[req + 1] - p.num_splits[req];
  w.split_idx = mla_decode_partial_slot(blockIdx.x, req == br);  // the grid's x is the part
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
