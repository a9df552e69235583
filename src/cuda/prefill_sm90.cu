// Ragged (varlen) MHA prefill on sm_90a and the merge of partial states,
// behind mla_prefill_params (prefill.h). Design notes: docs/prefill-kernel.md.
//
// Ragged MHA, one persistent kernel (grid = SM count, 384 threads):
//  - warpgroup 0 is the producer: Q (128 query rows x qk_dim of one head),
//    then K and V tiles of 128 keys into two 2-stage rings (K runs a tile
//    ahead of V). MODE | 8 (the default, overlap232-tma) loads full tiles
//    with TMA, its maps bounded by the allocation holding each tensor
//    (cuMemGetAddressRange on the host: the host never sees the lengths,
//    the index arrays are device memory), and a request's partial V tile
//    with cp.async and zero fill. Without MODE | 8 (or when the driver
//    cannot bound a pointer) every tile is 16-byte cp.async into
//    128B-swizzled shared memory, zero-filling rows past a request's end;
//    each thread arrives on the stage's mbarrier when its copies land.
//  - warpgroups 1 and 2 are consumers, 64 query rows each: S = Q K^T with
//    wgmma (both operands from shared memory), online softmax in registers
//    (base 2), P packed to 16-bit as the register A operand of O += P V with V
//    the MN-major (transposed) B operand. MODE 0 ("plain") runs scores,
//    softmax and P V in sequence and lets the two warpgroups overlap each
//    other; MODE 1 ("overlap", FA3's intra-warpgroup overlap) issues the next
//    tile's Q K^T with this tile's P V and runs the softmax while P V runs;
//    MODE 2 ("pingpong") adds turns at the tensor cores between the two
//    warpgroups; MODE 3 ("overlap232") is MODE 1 with a 40 / 232 register
//    split instead of 24 / 240. MODE 11 = 3 | TMA is the measured fastest
//    on the H200 and the default; the others (and the PIN / ES refinements
//    of 11, slower when measured) stay selectable (MLA_PREFILL_VARIANT).
//  - work items are (request, 128-row m-block, head); every CTA builds the
//    prefix table of the requests' m-block counts in shared memory from the
//    device index arrays, then takes items in the item order either as they
//    are drawn from a counter in the caller's workspace (dynamic: a CTA
//    claims the next item near the end of its current one, draw_item) or,
//    without a workspace, in rounds of gridDim.x (snake: odd rounds
//    backwards, item_of); the item order is
//    head group (kHeadGroup heads, 1 for a batch of one request) > request >
//    m-block, last (heaviest, causal) first > head. Key tiles are walked from the last
//    (the masked diagonal ones) down; fully masked tiles are never loaded.
//    The producer decodes each item and hands it to the consumers through a
//    2-slot ring in shared memory; in the overlapped loops an item's O / lse
//    stores run under the next item's first Q K^T (item_epilogue).
//    (docs/prefill-kernel.md: design, variants, measurements.)
//
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>  // (the MLA_DEV_TIMELINE dev build's printout)
#include <stdlib.h>
#include <string.h>

#include "decode_wgmma.cuh"  // (wg_m64n64k16_ss: the half-width first tile)
#include "launch_once.cuh"
#include "mla.h"
#include "prefill.h"

namespace {

#include "ragged_common.cuh"

constexpr int kBM = 128;       // query rows per item (64 per consumer warpgroup)
constexpr int kBN = 128;       // keys per tile
constexpr int kThreads = 384;  // producer + 2 consumer warpgroups
// Default heads walked together (MLA_PREFILL_HEAD_GROUP overrides it). On the
// H=128 bench shapes 2 and 4 measured 3-5 % faster than 8 (2 under 1 % ahead of
// 4), 16 and 128 slower (docs/prefill-kernel.md §6, session 21).
constexpr int kHeadGroup = 2;
constexpr int kDefaultMode = 11;  // overlap232-tma: measured fastest (prefill_kernel MODE; docs/prefill-kernel.md)
constexpr int kSub = 16384;    // one [128 rows x 64 cols] 16-bit sub-tile, 128B swizzle
constexpr uint32_t kVtLbo = 16384, kVtSbo = 1024;  // V as MN-major B: 64-col blocks, 8-key groups
// Registers per thread (setmaxnreg) by consumer loop, producer + 2 x consumer
// = 504 <= 65536 / 128. The overlapped loops hold S, P and O at once: with
// fewer than 240 ptxas moves most of the softmax below the P V wait (SASS),
// which undoes the overlap; the producer then spills a few words.
__host__ __device__ constexpr int producer_regs(int mode) { return mode == 0 ? 56 : mode == 3 ? 40 : 24; }
__host__ __device__ constexpr int consumer_regs(int mode) { return mode == 0 ? 224 : mode == 3 ? 232 : 240; }

// Shared memory: Q, K[2], V[2] (each a run of 16 KiB sub-tiles, 1024-aligned),
// 14 mbarriers and the item ring (kBar: 256 bytes), the request prefix table.
template <int DQK, int DV>
struct Lay {
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + DQK / 64 * kSub;
  static constexpr int kKBytes = DQK / 64 * kSub;
  static constexpr int kV = kK + 2 * kKBytes;
  static constexpr int kVBytes = DV / 64 * kSub;
  static constexpr int kBar = kV + 2 * kVBytes;
  static constexpr int kTab = kBar + 256;
  static constexpr int kSmem = kTab + 4 * (MLA_CUDA_PREFILL_MAX_BATCH + 1) + 1024;  // + alignment slack
};
static_assert(Lay<192, 128>::kSmem <= 232448, "192/128 tiles exceed the shared memory of an SM");
// Separate K and V rings (2 stages each): K is released as soon as the
// scores are done, so the producer can run a K tile ahead of V.
// Tensor maps of q, k, v as {dim, heads, rows} with the row count bounded by
// the allocation holding the tensor (host side: cuMemGetAddressRange), so a
// box never reads outside it; rows past a request's end inside it are masked
// (K, Q) or loaded by cp.async with zero fill (the partial V tile).
struct TmaMaps {
  CUtensorMap q, k, v;
};
enum {
  BAR_QFULL = 0,
  BAR_QEMPTY = 1,
  BAR_KFULL = 2,
  BAR_VFULL = 4,
  BAR_KEMPTY = 6,
  BAR_VEMPTY = 8,
  BAR_IFULL = 10,  // item ring, 2 slots
  BAR_IEMPTY = 12
};
// A scratch word after the 14 mbarriers (written by PIN loops, never read).
constexpr uint32_t kPinWord = 112;
// The item ring: 2 decoded Items (32 bytes each, slot = round & 1) at this
// offset of the barrier area, written by the producer, read by the consumers.
constexpr uint32_t kItemRing = 128;
// The dynamic order's item ids (2 words, slot = round & 1) at this offset:
// producer thread 0 draws them, the other producer threads read them here.
constexpr uint32_t kIdSlots = 192;

// ---------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool valid) {
  // src-size 0: 16 zero bytes written, nothing read (rows past a request).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// Arrive on bar once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive on bar once this thread's cp.asyncs landed, counting itself into the
// phase first (no .noinc): net zero arrivals, so a barrier of count 1 can mix
// these with one ordinary arrive (the TMA producer's partial V tiles).
__device__ __forceinline__ void cp_async_arrive_inc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// One TMA box {64 columns, 1 head, 128 rows} = one 16 KiB swizzled sub-tile.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// A phase bug would hang: after ~2^24 polls the trap turns it into a launch
// error. One asm block (a C loop between wgmmas makes ptxas serialise them).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u32 n;\nmov.u32 n, 0;\n"
      "PFW_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra PFW_DONE;\n"
      "add.u32 n, n, 1;\n"
      "setp.gt.u32 p, n, 16777216;\n"
      "@p trap;\n"
      "bra PFW_LOOP;\n"
      "PFW_DONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Named barriers 1 and 2: the consumer warpgroups' turns at the tensor cores.
__device__ __forceinline__ void named_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins accumulator registers at this point (no reads/writes move across).
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
// 128B-swizzle matrix descriptor in two words: lo (start address >> 4, LBO
// >> 4 at bit 16) and hi (SBO >> 4, swizzle mode at bit 62). A shared address
// is below 2^18, so the descriptor of saddr + off is lo + off / 16 (no carry
// out of the 14-bit address field): one add per wgmma instead of recomputing
// and masking the whole descriptor (the steady loop: 628 -> 570 instructions
// a tile, docs/prefill-kernel.md section 6, session 24).
__device__ __forceinline__ uint32_t desc_lo(uint32_t saddr, uint32_t lbo) {
  return ((saddr & 0x3FFFF) >> 4) | ((lbo & 0x3FFFF) >> 4) << 16;
}
__device__ __forceinline__ uint64_t desc_at(uint32_t lo, uint32_t off, uint32_t sbo) {
  return (uint64_t)(lo + (off >> 4)) | (uint64_t)(((sbo & 0x3FFFF) >> 4) | (1u << 30)) << 32;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <bool F16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if (F16) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
}

// ---------------------------------------------------------------------------
// wgmma m64n128k16 (generated by dev/cuda/prefill/gen_wgmma.py)
// ---------------------------------------------------------------------------
// D[64x128] (+)= A[64x16] (smem, K-major) * B[16x128] (smem, K-major), bf16.
static __device__ __forceinline__ void wgmma_ss_bf16(float (&d)[64], uint64_t da, uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accum));
}
// D[64x128] (+)= A[64x16] (registers) * B[16x128] (smem, MN-major), bf16.
static __device__ __forceinline__ void wgmma_rs_bf16(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}
// D[64x128] (+)= A[64x16] (smem, K-major) * B[16x128] (smem, K-major), f16.
static __device__ __forceinline__ void wgmma_ss_f16(float (&d)[64], uint64_t da, uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accum));
}
// D[64x128] (+)= A[64x16] (registers) * B[16x128] (smem, MN-major), f16.
static __device__ __forceinline__ void wgmma_rs_f16(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accum) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));
}

template <bool F16>
__device__ __forceinline__ void mma_qk(float (&d)[64], uint64_t da, uint64_t db, int accum) {
  if (F16) wgmma_ss_f16(d, da, db, accum);
  else wgmma_ss_bf16(d, da, db, accum);
}
template <bool F16>
__device__ __forceinline__ void mma_pv(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accum) {
  if (F16) wgmma_rs_f16(d, a, db, accum);
  else wgmma_rs_bf16(d, a, db, accum);
}

// ---------------------------------------------------------------------------
// Work items
// ---------------------------------------------------------------------------
struct Item {
  int req, mb, h;   // request, m-block, query head
  int q0, Q, k0, K; // first rows and lengths
  int ntiles;       // key tiles visited (0: no row of the m-block sees a key; -1: no more items)
};
static_assert(sizeof(Item) == 32, "an item is one 32-byte slot of the ring");

// Lengths of request i, or 0 / 0 for one the kernel must skip.
__device__ __forceinline__ void lengths(const mla_prefill_params &p, int i, int &Q, int &K) {
  Q = p.qo_indptr[i + 1] - p.qo_indptr[i];
  K = p.kv_indptr[i + 1] - p.kv_indptr[i];
  if (Q < 0 || K < 0 || p.qo_indptr[0] != 0 || p.kv_indptr[0] != 0) Q = K = 0;
}

__device__ __forceinline__ Item decode_item(const mla_prefill_params &p, const int *pre, int total_mb,
                                            uint32_t id) {
  Item it;
  const int hg = p.head_group;
  const uint32_t per_group = (uint32_t)total_mb * (uint32_t)hg;  // (<= items: 32 bits)
  const int g = (int)(id / per_group);
  const int rem = (int)(id - (uint32_t)g * per_group);
  const int hs = min(hg, p.num_heads - g * hg);
  const int mbi = rem / hs;
  it.h = g * hg + rem % hs;
  int lo = 0, hi = p.batch_size;  // pre[lo] <= mbi < pre[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (pre[mid] <= mbi) lo = mid;
    else hi = mid;
  }
  it.req = lo;
  const int nmb = pre[lo + 1] - pre[lo];
  it.mb = nmb - 1 - (mbi - pre[lo]);  // last m-block first
  lengths(p, lo, it.Q, it.K);
  it.q0 = p.qo_indptr[lo];
  it.k0 = p.kv_indptr[lo];
  const int t_last = min(it.Q, (it.mb + 1) * kBM) - 1;
  const int kend = p.causal ? min(it.K, it.K - it.Q + t_last + 1) : it.K;
  it.ntiles = kend > 0 ? (kend + kBN - 1) / kBN : 0;
  return it;
}

// Item ids are 32-bit: 2^32 items of 128 query rows x 1 head would need a
// q tensor of more than a terabyte. kNoItem: past the last item.
constexpr uint32_t kNoItem = 0xffffffffu;
// This CTA's item of round r (items r * grid .. r * grid + grid - 1), or
// kNoItem past the last. With p.order_snake the odd rounds run backwards (CTA b
// takes item grid - 1 - b), which evens out the per-CTA sums of the
// decreasing causal item sizes (simulated max / mean 1.023 -> 1.015 on
// 1 x 8K, H = 128; no change on 16 x 1K).
__device__ __forceinline__ uint32_t item_of(const mla_prefill_params &p, uint32_t r, uint32_t items) {
  const uint32_t g = gridDim.x;
  const uint32_t id = r * g + ((p.order_snake && (r & 1)) ? g - 1 - blockIdx.x : blockIdx.x);
  return id < items && id >= r * g ? id : kNoItem;  // (a wrap past 2^32 ends the walk)
}

// Dynamic order: the next item id from the launch's counter (zeroed by the
// launcher on the stream before the kernel). A CTA draws until it gets an id
// past the last item; ids are handed out in item order (within a head group,
// request by request, each request's heaviest m-block first), each to
// whichever CTA asks next.
__device__ __forceinline__ uint32_t draw_item(unsigned *counter) { return atomicAdd(counter, 1u); }
__device__ __forceinline__ void st_shared_u32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}

// An Item into ring slot `slot` (shared address; the producer's write).
__device__ __forceinline__ void ring_put(uint32_t slot, const Item &it) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(slot), "r"(it.req), "r"(it.mb), "r"(it.h), "r"(it.q0)
               : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(slot + 16), "r"(it.Q), "r"(it.k0), "r"(it.K),
               "r"(it.ntiles)
               : "memory");
}
// The Item in ring slot `slot` (shared address; the consumers' read).
__device__ __forceinline__ Item ring_item(uint32_t slot) {
  Item it;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(it.req), "=r"(it.mb), "=r"(it.h), "=r"(it.q0)
               : "r"(slot)
               : "memory");
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(it.Q), "=r"(it.k0), "=r"(it.K), "=r"(it.ntiles)
               : "r"(slot + 16)
               : "memory");
  return it;
}

// ---------------------------------------------------------------------------
// Producer: rows [0, 128) of a [128, D] tile (row r at src + r * stride
// bytes, valid while r < nvalid) into D / 64 swizzled sub-tiles at dst.
// Thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 i.
// ---------------------------------------------------------------------------
template <int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const char *src, int64_t stride, int nvalid, int t,
                                          const void *safe) {
  const int rsub = t >> 3, c = t & 7;
  dst += (uint32_t)(rsub * 128 + ((c ^ (rsub & 7)) << 4));
  const char *row = src + (int64_t)rsub * stride + c * 16;
  const int64_t step = 16 * stride;
  // rolled: the producer runs on few registers (setmaxnreg)
#pragma unroll 1
  for (int i = 0; i < 8; i++, row += step, dst += 16 * 128) {
    const bool ok = 16 * i + rsub < nvalid;
#pragma unroll
    for (int s = 0; s < D / 64; s++) cp_async_16(dst + s * kSub, ok ? (const void *)(row + s * 128) : safe, ok);
  }
}

// ---------------------------------------------------------------------------
// Consumer pieces. Accumulator register i of a thread (lane l of warp w of
// the warpgroup) holds row 16 w + l / 4 + 8 ((i >> 1) & 1), column
// 8 (i >> 2) + 2 (l % 4) + (i & 1).
// ---------------------------------------------------------------------------
struct Soft {
  float sl;       // multiplier to log2 units: scale * log2(e), or 1 with a softcap
  float cap_in;   // scale / softcap
  float cap_out;  // softcap * log2(e)
};

// tanh from ex2 and a reciprocal: absolute error ~1e-7 (tanh.approx's 2^-11
// would be ~0.01 on a logit of cap 30).
__device__ __forceinline__ float tanh_acc(float x) {
  return 1.0f - __fdividef(2.0f, 1.0f + ex2(2.0f * kLog2e * x));
}

// Max (MAX) or sum of 16 values as a tree; constant trip counts so that t
// stays in registers (a loop bound computed from the outer index left t in
// local memory).
template <bool MAX>
__device__ __forceinline__ float tree16(float (&t)[16]) {
#pragma unroll
  for (int j = 0; j < 8; j++) t[j] = MAX ? fmaxf(t[j], t[j + 8]) : t[j] + t[j + 8];
#pragma unroll
  for (int j = 0; j < 4; j++) t[j] = MAX ? fmaxf(t[j], t[j + 4]) : t[j] + t[j + 4];
#pragma unroll
  for (int j = 0; j < 2; j++) t[j] = MAX ? fmaxf(t[j], t[j + 2]) : t[j] + t[j + 2];
  return MAX ? fmaxf(t[0], t[1]) : t[0] + t[1];
}

// One tile's online-softmax step: s [64] holds raw q.k; on return s holds P
// (fp32; pack_p makes the A fragments), m / l the running max (log2 units)
// and the thread's partial row sums, alpha the rescale of the old O.
template <bool CAP>
__device__ __forceinline__ void softmax_tile(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             const Soft &sf, bool need_mask, int kt,
                                             int lim_lo, int lim_hi, int lane) {
  if (CAP) {
#pragma unroll
    for (int i = 0; i < 64; i++) s[i] = sf.cap_out * tanh_acc(s[i] * sf.cap_in);
  }
  if (need_mask) {
    // key = kt + 8 (i >> 2) + 2 (lane % 4) + (i & 1) > lim, with the
    // register-dependent part folded into one threshold per row: the test
    // is then a compare against a constant (no per-element index math).
    const int th_lo = lim_lo - kt - 2 * (lane & 3), th_hi = lim_hi - kt - 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < 64; i++)
      if (8 * (i >> 2) + (i & 1) > ((i & 2) ? th_hi : th_lo)) s[i] = -INFINITY;
  }
  // Row max and row sum as trees (depth 5, not a 32-long dependent chain):
  // the same instruction count, less latency for the warp.
  float mx[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float t[16];
#pragma unroll
    for (int j = 0; j < 16; j++) t[j] = fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]);
    mx[r] = tree16<true>(t);
  }
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r] * sf.sl);
    mu[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: p = 0, never NaN
    alpha[r] = ex2(m[r] - mu[r]);
    m[r] = m_new;
  }
#pragma unroll
  for (int i = 0; i < 64; i++) s[i] = ex2(fmaf(s[i], sf.sl, -mu[(i >> 1) & 1]));
  float rs[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float t[16];
#pragma unroll
    for (int j = 0; j < 16; j++) t[j] = s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    rs[r] = tree16<false>(t);
  }
  l[0] = l[0] * alpha[0] + rs[0];
  l[1] = l[1] * alpha[1] + rs[1];
}

// P (fp32 in s) -> the 16-bit A fragments of P V.
template <bool F16>
__device__ __forceinline__ void pack_p(const float (&s)[64], uint32_t (&pa)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; kk++)
#pragma unroll
    for (int j = 0; j < 4; j++) pa[kk][j] = pack2<F16>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
}


// S (+)= Q K^T over DQK: the warpgroup's 64 Q rows at qa against the K tile
// at sK, 128 keys into s[0..63] or, HALF, its first 64 keys into s[0..31]
// (wgmma issues only; the caller fences, commits and waits).
template <int DQK, bool F16, bool HALF>
__device__ __forceinline__ void qk_issue(float (&s)[64], uint32_t qa, uint32_t sK) {
  const uint32_t a0 = desc_lo(qa, 16), b0 = desc_lo(sK, 16);
#pragma unroll
  for (int k = 0; k < DQK / 16; k++) {
    const uint64_t da = desc_at(a0, (k >> 2) * kSub + (k & 3) * 32, 1024);
    const uint64_t db = desc_at(b0, (k >> 2) * kSub + (k & 3) * 32, 1024);
    if (HALF) wg_m64n64k16_ss<F16>(*reinterpret_cast<float(*)[32]>(s), da, db, k > 0);
    else mma_qk<F16>(s, da, db, k > 0);
  }
}

// One tile of the overlapped consumer loop: issue S = Q K_n^T and O += P V
// of the previous tile, run the softmax of S while P V runs, then rescale O.
// Branch-free between the issues and the last wait (MASK is compile-time).
// ES ("early scale"): O is rescaled by the previous tile's alpha (carried in
// alpha_c) between the two issues, while the tensor cores run Q K^T, rather
// than after the P V wait; only the P packing is then left between that
// wait and the next issue.
template <int DQK, int DV, bool F16, bool CAP, bool MASK, bool PP, bool PIN, bool ES>
__device__ __forceinline__ void ovl_step(float (&o)[64], float (&s)[64], uint32_t (&pa)[8][4], float (&m)[2],
                                         float (&l)[2], float (&alpha_c)[2], const Soft &sf, uint32_t sbase,
                                         uint32_t bar, uint32_t qa,
                                         uint32_t &kv_it, int &cur, uint32_t &cur_ph, int n, int lim_lo, int lim_hi,
                                         int lane, int cw) {
  using L = Lay<DQK, DV>;
  const int st = kv_it & 1;
  const uint32_t ph = (kv_it >> 1) & 1;
  const int kt = n * kBN;
  const uint32_t sK = sbase + L::kK + st * L::kKBytes, sVc = sbase + L::kV + cur * L::kVBytes;
  // Both waits before the first issue (V of the current tile was loaded
  // before K of the next one).
  mbar_wait(bar + 8 * (BAR_VFULL + cur), cur_ph);
  mbar_wait(bar + 8 * (BAR_KFULL + st), ph);
  fence_proxy_async();
  if (PP) named_bar_sync(1 + cw, 256);  // our turn at the tensor cores
  wgmma_fence();
  qk_issue<DQK, F16, false>(s, qa, sK);
  wgmma_commit();
  if (ES) {
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] *= alpha_c[(i >> 1) & 1];
    wgmma_fence();  // O was written by these multiplies
  }
#pragma unroll
  for (int kk = 0; kk < 8; kk++) mma_pv<F16>(o, pa[kk], desc_at(desc_lo(sVc, kVtLbo), kk * 2048, kVtSbo), 1);
  wgmma_commit();
  if (PP) named_bar_arrive(2 - cw, 256);  // the other warpgroup's turn
  wgmma_wait<1>();
  reg_fence(s);
  mbar_arrive(bar + 8 * (BAR_KEMPTY + st));  // the scores are done with K_n
  if (n == 0) mbar_arrive(bar + 8 * BAR_QEMPTY);
  // Only s, m, l and alpha are written while P V runs: its A registers (pa)
  // and O stay untouched until the wait (else ptxas serialises, C7520).
  float alpha[2];
  softmax_tile<CAP>(s, m, l, alpha, sf, MASK, kt, lim_lo, lim_hi, lane);
  // Pin the softmax before the wait: its arithmetic touches no memory, so
  // without these the compiler sinks it below wgmma.wait_group (measured in
  // the SASS: only the row max stayed above), and P V no longer overlaps it.
  reg_fence(s);
  reg_fence(m);
  reg_fence(l);
  reg_fence(alpha);
  // The fences above order nothing in ptxas (an empty asm emits no PTX):
  // its scheduler still hoists the wait over most of the softmax (SASS:
  // 0 of 64 MUFU.EX2 above it in masked tiles, ~20 in unmasked ones). PIN
  // stores l[0] + l[1], which depends on every exponential of the tile, to
  // a scratch word before the wait; ptxas keeps shared stores and the wait
  // in order, so the whole softmax now runs while P V does (SASS: 64 of 64).
  if (PIN) asm volatile("st.shared.f32 [%0], %1;" ::"r"(bar + kPinWord), "f"(l[0] + l[1]) : "memory");
  wgmma_wait<0>();
  reg_fence(o);
  mbar_arrive(bar + 8 * (BAR_VEMPTY + cur));
  if (ES) {
    alpha_c[0] = alpha[0];
    alpha_c[1] = alpha[1];
  } else {
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] *= alpha[(i >> 1) & 1];
  }
  pack_p<F16>(s, pa);
  cur = st;
  cur_ph = ph;
  kv_it++;
}

// Predicated stores and arrive: the deferred epilogue runs while a wgmma
// group is in flight, where a branch (divergent, to ptxas) serialises every
// wgmma of the kernel (C7518), so nothing in it branches.
__device__ __forceinline__ void st_v4_if(bool c, void *ptr, uint32_t a, uint32_t b, uint32_t d, uint32_t e) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v4.b32 [%1], {%2, %3, %4, %5};\n}" ::"r"((int)c),
               "l"(ptr), "r"(a), "r"(b), "r"(d), "r"(e)
               : "memory");
}
__device__ __forceinline__ void st_b32_if(bool c, void *ptr, uint32_t a) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.b32 [%1], %2;\n}" ::"r"((int)c), "l"(ptr), "r"(a)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_if(bool c, uint32_t bar) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%1];\n}" ::"r"((int)c),
               "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_v2f32_if(bool c, void *ptr, float a, float b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v2.f32 [%1], {%2, %3};\n}" ::"r"((int)c),
               "l"(ptr), "f"(a), "f"(b)
               : "memory");
}
template <bool PRED>
__device__ __forceinline__ void st8f_if(bool c, void *ptr, float a, float b) {
  if (PRED) st_v2f32_if(c, ptr, a, b);
  else if (c) *reinterpret_cast<float2 *>(ptr) = make_float2(a, b);
}
// The same as plain branches (PRED false: an epilogue with no wgmma in flight,
// where ptxas allocates registers better around branches than predicates).
template <bool PRED>
__device__ __forceinline__ void st16_if(bool c, void *ptr, uint32_t a, uint32_t b, uint32_t d, uint32_t e) {
  if (PRED) st_v4_if(c, ptr, a, b, d, e);
  else if (c) *reinterpret_cast<uint4 *>(ptr) = make_uint4(a, b, d, e);
}
template <bool PRED>
__device__ __forceinline__ void st4_if(bool c, void *ptr, uint32_t a) {
  if (PRED) st_b32_if(c, ptr, a);
  else if (c) *reinterpret_cast<uint32_t *>(ptr) = a;
}

// The rows' totals over the quad, 1 / l (0 for a row without a key, whose O
// is 0) and the base-2 lse (-inf there).
__device__ __forceinline__ void finish_rows(const float (&m)[2], float (&l)[2], float (&inv)[2], float (&lse2)[2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    lse2[r] = l[r] > 0.0f ? m[r] + log2f(l[r]) : -INFINITY;
  }
}

// The epilogue of the item in ring slot `is` when `on` (else nothing, and
// `is` names the consumers' current slot: the other may be one the producer
// is writing): this thread's rows
// r_lo, r_lo + 8 of its m-block as o * inv (16-bit quads when quad_ok, else
// the accumulator's pairs, 16-bit or fp32) and their lse; rows past the
// request unwritten; then frees the slot. Branch-free (see st_v4_if).
//
// The quads: per row and group g of 32 columns the quad's 4 x 4 words (lane
// j: the pair 8 c + 2 j, + 1 of each group c = 4 g .. 4 g + 3) are
// transposed with two xor shuffle stages, so lane q holds all eight columns
// of group 4 g + q: a quad writes 64 contiguous bytes of a row, a warp
// instruction 8 half lines. Measured on an H200 (docs/prefill-kernel.md §6):
// without any O store 16 x 1K ran 15 % faster; 8-byte stores made it 3 %
// faster than the 4-byte pairs, these 16-byte ones 2 % more.
template <bool F16, bool PRED>
__device__ __forceinline__ void item_epilogue(const mla_prefill_params &p, const float (&o)[64], const float (&inv)[2],
                                              const float (&lse2)[2], uint32_t bar, int is, int r_lo, int lane,
                                              bool quad_ok, bool on, bool release = true) {
  const Item et = ring_item(bar + kItemRing + 32 * is);
  const int t_lo = et.mb * kBM + r_lo;
  const int q = lane & 3;
  const bool b1 = q & 2, b0 = q & 1;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int t = t_lo + 8 * r;
    const bool row_on = on && (quad_ok || !PRED) && t < et.Q;  // (PRED: the quads only)
    const int64_t orow = ((int64_t)(et.q0 + t) * p.num_heads + et.h) * 128;
    uint16_t *row = (uint16_t *)p.out + orow;
#pragma unroll
    for (int g = 0; g < 4; g++) {
      uint32_t a[4];  // a[k]: columns 8 (4 g + k) + 2 q, + 1
#pragma unroll
      for (int k = 0; k < 4; k++)
        a[k] = pack2<F16>(o[4 * (4 * g + k) + 2 * r] * inv[r], o[4 * (4 * g + k) + 2 * r + 1] * inv[r]);
      // stage 1 (lanes q, q ^ 2): swap the off-diagonal 2 x 2 blocks
      const uint32_t x0 = __shfl_xor_sync(0xffffffffu, b1 ? a[0] : a[2], 2);
      const uint32_t x1 = __shfl_xor_sync(0xffffffffu, b1 ? a[1] : a[3], 2);
      a[0] = b1 ? x0 : a[0];
      a[1] = b1 ? x1 : a[1];
      a[2] = b1 ? a[2] : x0;
      a[3] = b1 ? a[3] : x1;
      // stage 2 (lanes q, q ^ 1): transpose each 2 x 2 block
      const uint32_t y0 = __shfl_xor_sync(0xffffffffu, b0 ? a[0] : a[1], 1);
      const uint32_t y1 = __shfl_xor_sync(0xffffffffu, b0 ? a[2] : a[3], 1);
      a[0] = b0 ? y0 : a[0];
      a[2] = b0 ? y1 : a[2];
      a[1] = b0 ? a[1] : y0;
      a[3] = b0 ? a[3] : y1;
      st16_if<PRED>(quad_ok && row_on, row + 32 * g + 8 * q, a[0], a[1], a[2], a[3]);
    }
    // the pairs (fp32 output, or one not 16-byte aligned; never deferred,
    // so not in the predicated form, which must fit under a Q.K^T)
#pragma unroll
    for (int c = 0; c < (PRED ? 0 : 16); c++) {
      const int col = 8 * c + 2 * q;
      const float v0 = o[4 * c + 2 * r] * inv[r], v1 = o[4 * c + 2 * r + 1] * inv[r];
      st8f_if<PRED>(!quad_ok && p.out_f32 && row_on, (float *)p.out + orow + col, v0, v1);
      st4_if<PRED>(!quad_ok && !p.out_f32 && row_on, row + col, pack2<F16>(v0, v1));
    }
    const float lse = p.lse_base2 ? lse2[r] : lse2[r] * kLn2;
    st4_if<PRED>(p.lse && q == 0 && row_on, p.lse + (int64_t)(et.q0 + t) * p.num_heads + et.h, __float_as_uint(lse));
  }
  if (PRED) mbar_arrive_if(on, bar + 8 * (BAR_IEMPTY + is));  // (after this thread's reads of the slot)
  else if (on && release) mbar_arrive(bar + 8 * (BAR_IEMPTY + is));
}

__device__ __forceinline__ void zero_state(float (&o)[64], float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int i = 0; i < 64; i++) o[i] = 0.0f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.0f;
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------
// Development timeline (compile with -DMLA_DEV_TIMELINE; never in a library
// build): %clock64 stamps by thread 0 of each consumer warpgroup at the
// phases of every item of the first kPfTlCtas CTAs; the launcher prints a
// summary by tile count after the MLA_DEV_PF_TIMELINE_AT-th launch
// (pf_timeline_print). Phases: 0 item start, 1 Q landed, 2 first scores,
// 3 first softmax packed, 4 last P V retired, 5 item done (the epilogue
// stored, or, DEFER, the rows finished: the stores then run in phase 2 of
// the next item, under its first Q.K^T).
#ifdef MLA_DEV_TIMELINE
constexpr int kPfTlCtas = 160, kPfTlItems = 160, kPfTlPh = 6;
__device__ long long g_pf_tl[kPfTlCtas][kPfTlItems][2][kPfTlPh];
__device__ int g_pf_tln[kPfTlCtas][kPfTlItems];  // the item's tiles
__device__ int g_pf_tlc[kPfTlCtas];              // items the CTA ran
#endif
// Development balance probe (-DMLA_DEV_BALANCE, also part of the timeline
// build): per CTA, %globaltimer at the consumers' item loop start and end and
// the CTA's work (2 x tiles + 1 per item), written by predicated stores only.
#if defined(MLA_DEV_TIMELINE) || defined(MLA_DEV_BALANCE)
constexpr int kPfBalCtas = 160;
__device__ unsigned long long g_pf_gt[kPfBalCtas][2];  // ns
__device__ unsigned g_pf_work[kPfBalCtas];
// %globaltimer into *dst where on; a predicated store, not a branch (a
// branch here made ptxas serialise the wgmmas of the kernel, C7518)
__device__ __forceinline__ void pf_globaltimer_if(unsigned long long *dst, bool on) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .u64 t;\n setp.ne.b32 p, %1, 0;\n mov.u64 t, %%globaltimer;\n @p st.global.u64 "
      "[%0], t;\n}\n" ::"l"(dst),
      "r"((int)on)
      : "memory");
}
#endif
#ifdef MLA_DEV_TIMELINE
#define PF_TL(ph) \
  do { \
    if (tl_on && round < kPfTlItems) g_pf_tl[blockIdx.x][round][cw][ph] = clock64(); \
  } while (0)
#else
#define PF_TL(ph) \
  do { \
  } while (0)
#endif

// MODE 0: plain loop (scores, softmax, P V in sequence); 1: overlapped (next
// tile's scores and this tile's P V issued together, softmax while P V
// runs); 2: overlapped with the two consumer warpgroups taking turns at the
// tensor cores (named barriers), so one's softmax runs under the other's
// matrix work; 3: MODE 1 with registers 40 / 232 (producer_regs /
// consumer_regs).
// MODE & 7 is the consumer loop, MODE & 8 the TMA producer, MODE & 16 the
// softmax pinned above the P V wait, MODE & 32 O rescaled before the P V
// issue (PIN and ES: ovl_step; overlapped loops only).
template <int DQK, int DV, bool F16, bool CAP, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_kernel(const mla_prefill_params p, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int LOOP = MODE & 7;
  constexpr bool TMA = (MODE & 8) != 0;
  constexpr bool PIN = (MODE & 16) != 0;
  constexpr bool ES = (MODE & 32) != 0;
  // Half-width first tiles (see the consumer loop) only in the TMA loops
  // without ES: in the others the extra branch cost ptxas the register room
  // of the wgmma pipeline (C7511: every wgmma serialised; measured with nvcc
  // 13.0, as was a half-width P V of that tile, which did it to MODE 11 too).
  constexpr bool HALFW = TMA && !ES;
  // The overlapped loops defer an item's epilogue (its O and lse stores)
  // into the next item's first Q.K^T, which would otherwise run alone.
  // (Not in the half-width loops with softcap: there the extra live
  // registers cost ptxas the wgmma pipeline, C7511, nvcc 13.0.)
  constexpr bool DEFER = LOOP != 0 && !(CAP && HALFW);
  static_assert(DV == 128, "the consumers hold one 64 x 128 O tile");
  using L = Lay<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t sbase = smem_u32(smem);
  const uint32_t sQ = sbase + L::kQ;
  const uint32_t bar = sbase + L::kBar;
  int *pre = (int *)(smem + L::kTab);
  const int tid = threadIdx.x;
  const int bs = p.batch_size;

  // Prefix table of m-block counts (all threads; the K stage is scratch).
  {
    int *part = (int *)(smem + L::kK);
    const int per = (bs + kThreads - 1) / kThreads;
    const int b0 = min(bs, tid * per), b1 = min(bs, b0 + per);
    int sum = 0;
    for (int i = b0; i < b1; i++) {
      int Q, K;
      lengths(p, i, Q, K);
      sum += (Q + kBM - 1) / kBM;
    }
    part[tid] = sum;
    if (tid == 0) {
      mbar_init(bar + 8 * BAR_QFULL, TMA ? 1 : 128);
      mbar_init(bar + 8 * BAR_QEMPTY, 256);
      for (int s = 0; s < 2; s++) {
        mbar_init(bar + 8 * (BAR_KFULL + s), TMA ? 1 : 128);
        mbar_init(bar + 8 * (BAR_VFULL + s), TMA ? 1 : 128);
        mbar_init(bar + 8 * (BAR_KEMPTY + s), 256);
        mbar_init(bar + 8 * (BAR_VEMPTY + s), 256);
        mbar_init(bar + 8 * (BAR_IFULL + s), 1);
        mbar_init(bar + 8 * (BAR_IEMPTY + s), 256);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      // Count the requests the kernel skips (once per launch).
      if (blockIdx.x == 0) count_skipped_requests(p);
    }
    __syncthreads();
    if (tid == 0) {
      int run = 0;
      for (int i = 0; i < kThreads; i++) {
        const int x = part[i];
        part[i] = run;
        run += x;
      }
      pre[bs] = run;
    }
    __syncthreads();
    int run = part[tid];
    for (int i = b0; i < b1; i++) {
      int Q, K;
      lengths(p, i, Q, K);
      pre[i] = run;
      run += (Q + kBM - 1) / kBM;
    }
    __syncthreads();
  }
  const int total_mb = pre[bs];
  const uint32_t items = (uint32_t)min((long long)total_mb * p.num_heads, (long long)kNoItem);
  const int G = p.num_heads / p.num_kv_heads;
  const int wg = tid >> 7;

  if (wg == 0) {
    // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(producer_regs(LOOP)));
    const int t = tid;
    const int64_t q_stride = (int64_t)p.num_heads * DQK * 2;
    const int64_t k_stride = (int64_t)p.num_kv_heads * DQK * 2;
    const int64_t v_stride = (int64_t)p.num_kv_heads * DV * 2;
    uint32_t kv_it = 0, q_it = 0;
    // Dynamic order (p.item_counter): thread 0 draws the next item's id
    // while this item's tiles load (two tiles before its last K tile) and
    // puts it in the next round's slot, so the draw's round trip hides under
    // the consumers' remaining tiles, and a CTA claims its next item near the
    // end of the current one (balance).
    bool drawn = false;  // (thread 0) this round's id is already in its slot
    for (uint32_t round = 0;; round++) {
      // Thread 0 picks the round's item id (drawn, or from the static order)
      // and the producer threads read it from its slot after a barrier. (Both
      // orders take this path, in 32-bit words: with the barrier under a
      // condition, or a few more live registers in the producer's 40, ptxas
      // serialised the wgmmas of the consumer loops, C7511, nvcc 13.0.)
      const uint32_t slot = bar + kIdSlots + 4 * (round & 1);
      if (t == 0 && !drawn) st_shared_u32(slot, p.item_counter ? draw_item(p.item_counter) : item_of(p, round, items));
      drawn = false;
      // (two slots: thread 0 writes the other one during this round, and
      // this one again only after every producer thread has passed the next
      // round's barrier)
      named_bar_sync(4, 128);
      const uint32_t u = ld_shared_u32(slot);
      const bool more = u < items;
      Item it = {0, 0, 0, 0, 0, 0, 0, -1};  // (-1 tiles: no more items)
      if (more) it = decode_item(p, pre, total_mb, u);
      // Hand the decoded item to the consumers: they read it from the ring
      // (also in the deferred epilogue, DEFER) instead of decoding it.
      if (t == 0) {
        const int is = (int)(round & 1);
        mbar_wait(bar + 8 * (BAR_IEMPTY + is), ((round >> 1) & 1) ^ 1);
        ring_put(bar + kItemRing + 32 * is, it);
        mbar_arrive(bar + 8 * (BAR_IFULL + is));  // (release: the slot's stores before it)
      }
      if (!more) break;
      if (it.ntiles == 0) continue;  // (the next round draws)
      mbar_wait(bar + 8 * BAR_QEMPTY, (q_it & 1) ^ 1);
      const int row0 = it.mb * kBM;
      if (TMA) {
        // rows past the request (another request's or the allocation's
        // tail, zero past it) only feed output rows that are never written
        if (t == 0) {
          mbar_expect_tx(bar + 8 * BAR_QFULL, DQK / 64 * kSub);
          for (int c = 0; c < DQK / 64; c++)
            tma_load_3d(sQ + c * kSub, &maps.q, bar + 8 * BAR_QFULL, 64 * c, it.h, it.q0 + row0);
        }
      } else {
        load_tile<DQK>(sQ, (const char *)p.q + ((int64_t)(it.q0 + row0) * p.num_heads + it.h) * DQK * 2, q_stride,
                       it.Q - row0, t, p.q);
        cp_async_arrive(bar + 8 * BAR_QFULL);
      }
      q_it++;
      const int kvh = it.h / G;
      // K runs one tile ahead of V: K_{j}, then V_{j-1} (j-th tile in walk
      // order, from the last key tile down), so the next scores' K can land
      // while the consumers still hold the V of the tile before.
      for (int j = 0; j <= it.ntiles; j++) {
        if (p.item_counter && t == 0 && j == max(0, it.ntiles - 2)) {
          st_shared_u32(bar + kIdSlots + 4 * ((round + 1) & 1), draw_item(p.item_counter));
          drawn = true;
        }
        if (j < it.ntiles) {
          const uint32_t x = kv_it + j;
          const int s = x & 1;
          mbar_wait(bar + 8 * (BAR_KEMPTY + s), ((x >> 1) & 1) ^ 1);
          const int kt = (it.ntiles - 1 - j) * kBN;
          if (TMA) {
            // keys past the request are masked by the consumers (the tile
            // that holds them is always a masked one)
            if (t == 0) {
              mbar_expect_tx(bar + 8 * (BAR_KFULL + s), DQK / 64 * kSub);
              for (int c = 0; c < DQK / 64; c++)
                tma_load_3d(sbase + L::kK + s * L::kKBytes + c * kSub, &maps.k, bar + 8 * (BAR_KFULL + s), 64 * c, kvh,
                            it.k0 + kt);
            }
          } else {
            const int64_t row = (int64_t)(it.k0 + kt) * p.num_kv_heads + kvh;
            load_tile<DQK>(sbase + L::kK + s * L::kKBytes, (const char *)p.k + row * DQK * 2, k_stride, it.K - kt, t,
                           p.k);
            cp_async_arrive(bar + 8 * (BAR_KFULL + s));
          }
        }
        if (j >= 1) {
          const uint32_t x = kv_it + j - 1;
          const int s = x & 1;
          mbar_wait(bar + 8 * (BAR_VEMPTY + s), ((x >> 1) & 1) ^ 1);
          const int kt = (it.ntiles - j) * kBN;
          const int64_t row = (int64_t)(it.k0 + kt) * p.num_kv_heads + kvh;
          if (TMA && kt + kBN <= it.K) {
            if (t == 0) {
              mbar_expect_tx(bar + 8 * (BAR_VFULL + s), DV / 64 * kSub);
              for (int c = 0; c < DV / 64; c++)
                tma_load_3d(sbase + L::kV + s * L::kVBytes + c * kSub, &maps.v, bar + 8 * (BAR_VFULL + s), 64 * c, kvh,
                            it.k0 + kt);
            }
          } else if (TMA) {
            // The partial tile: rows past the request must be zeros, not
            // whatever follows (0 * NaN), so cp.async with zero fill; the
            // 128 async arrivals count themselves in, then one plain arrive.
            load_tile<DV>(sbase + L::kV + s * L::kVBytes, (const char *)p.v + row * DV * 2, v_stride, it.K - kt, t,
                          p.v);
            cp_async_arrive_inc(bar + 8 * (BAR_VFULL + s));
            named_bar_sync(3, 128);
            if (t == 0) mbar_arrive(bar + 8 * (BAR_VFULL + s));
          } else {
            load_tile<DV>(sbase + L::kV + s * L::kVBytes, (const char *)p.v + row * DV * 2, v_stride, it.K - kt, t,
                          p.v);
            cp_async_arrive(bar + 8 * (BAR_VFULL + s));
          }
        }
      }
      kv_it += it.ntiles;
    }
    cp_async_wait_all();
  } else {
    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(consumer_regs(LOOP)));
    const int cw = wg - 1;
    const int lane = tid & 31, warp = (tid >> 5) & 3;
    const int r_lo = 64 * cw + 16 * warp + (lane >> 2);  // this thread's rows in the m-block: r_lo, r_lo + 8
    const uint32_t qa = sQ + 8192 * cw;                  // this warpgroup's 64 Q rows
    Soft sf;
    if (CAP) {
      sf.sl = 1.0f;
      sf.cap_in = p.scale / p.softcap;
      sf.cap_out = p.softcap * kLog2e;
    } else {
      sf.sl = p.scale * kLog2e;
      sf.cap_in = sf.cap_out = 0.0f;
    }
    uint32_t kv_it = 0, q_it = 0;
    // 16-bit output, 16-byte aligned (what ragged.c accepts): the O rows
    // leave as 16-byte stores (item_epilogue); fp32 output (or a misaligned
    // one) as the pairs the accumulator holds.
    const bool quad_ok = !p.out_f32 && ((uintptr_t)p.out & 15) == 0;
    // Turns alternate (warpgroup 0 first): every item gives both warpgroups
    // the same ntiles + 1 turns, so the sequence stays in step.
    if (LOOP == 2 && cw == 1) named_bar_arrive(1, 256);
#ifdef MLA_DEV_TIMELINE
    const bool tl_on = (tid & 127) == 0 && blockIdx.x < kPfTlCtas;
#endif
#if defined(MLA_DEV_TIMELINE) || defined(MLA_DEV_BALANCE)
    const bool bal_on = (tid & 255) == 128 && blockIdx.x < kPfBalCtas;  // thread 0 of consumer warpgroup 0
    unsigned bal_work = 0;
    pf_globaltimer_if(&g_pf_gt[blockIdx.x % kPfBalCtas][0], bal_on);
#endif
    // O, m and l of the current item; inv (1 / l) and lse2 (base 2) of its
    // rows once its tiles are done; pend: its epilogue not yet run (DEFER:
    // until the next item's first Q.K^T is in flight).
    float o[64], m[2], l[2], inv[2] = {0.0f, 0.0f}, lse2[2] = {-INFINITY, -INFINITY};
    zero_state(o, m, l);
    bool pend = false;
    for (long long round = 0;; round++) {
      // The item comes decoded from the producer through the ring; its slot
      // is held until its epilogue, which reads the item again from it.
      const uint32_t islot = bar + kItemRing + 32 * (uint32_t)(round & 1);
      mbar_wait(bar + 8 * (BAR_IFULL + (int)(round & 1)), (uint32_t)(round >> 1) & 1);
      const Item it = ring_item(islot);
      // The slot of the pending (previous) item's epilogue: the other one
      // from round 1 on; at round 0, when nothing is pending, the current
      // one, as the other may be one the producer is writing.
      const int eslot = (int)(round & 1) ^ (int)(round != 0);
      // The previous item's epilogue, unless it runs under this item's
      // first Q.K^T (branch-free: see st_v4_if).
      if (DEFER) {
        const bool now = pend && it.ntiles <= 0;
        item_epilogue<F16, true>(p, o, inv, lse2, bar, eslot, r_lo, lane, quad_ok, now);
        pend = pend && !now;
      }
      if (it.ntiles < 0) break;
#if defined(MLA_DEV_TIMELINE) || defined(MLA_DEV_BALANCE)
      bal_work += 2u * (unsigned)it.ntiles + 1u;
#endif
      const int t_lo = it.mb * kBM + r_lo, t_hi = t_lo + 8;
#ifdef MLA_DEV_TIMELINE
      if (tl_on && cw == 0 && round < kPfTlItems) {
        g_pf_tln[blockIdx.x][round] = it.ntiles;
        g_pf_tlc[blockIdx.x] = (int)round + 1;
      }
#endif
      PF_TL(0);
      if (!DEFER) {
        zero_state(o, m, l);
      } else {
        // O stays until the previous epilogue under the first Q.K^T; an
        // item without tiles (its epilogue: zeros) clears it here, by
        // selects: a write to a wgmma accumulator in a branch makes ptxas
        // serialise every wgmma (C7518)
        const bool z = it.ntiles == 0;
#pragma unroll
        for (int i = 0; i < 64; i++) o[i] = z ? 0.0f : o[i];
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.0f;
      }
      if (it.ntiles > 0) {
        mbar_wait(bar + 8 * BAR_QFULL, q_it & 1);
        PF_TL(1);
        fence_proxy_async();  // cp.async wrote Q through the generic proxy; wgmma reads it through the async one
        q_it++;
        const int lim_lo = p.causal ? min(it.K - 1, it.K - it.Q + t_lo) : it.K - 1;
        const int lim_hi = p.causal ? min(it.K - 1, it.K - it.Q + t_hi) : it.K - 1;
        // smallest limit of the warpgroup's rows: its first row
        const int wg_lim = p.causal ? min(it.K - 1, it.K - it.Q + it.mb * kBM + 64 * cw) : it.K - 1;
        uint32_t pa[8][4];
        float alpha[2];
        float s[64];
        if (LOOP == 0) {
          for (int n = it.ntiles - 1; n >= 0; n--) {
            const int st = kv_it & 1;
            const uint32_t ph = (kv_it >> 1) & 1;
            const int kt = n * kBN;
            const uint32_t sK = sbase + L::kK + st * L::kKBytes, sV = sbase + L::kV + st * L::kVBytes;
            mbar_wait(bar + 8 * (BAR_KFULL + st), ph);
            fence_proxy_async();
            wgmma_fence();
            qk_issue<DQK, F16, false>(s, qa, sK);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(s);
            mbar_arrive(bar + 8 * (BAR_KEMPTY + st));
            if (n == 0) mbar_arrive(bar + 8 * BAR_QEMPTY);
            softmax_tile<CAP>(s, m, l, alpha, sf, kt + kBN - 1 > wg_lim, kt, lim_lo, lim_hi, lane);
            pack_p<F16>(s, pa);
#pragma unroll
            for (int i = 0; i < 64; i++) o[i] *= alpha[(i >> 1) & 1];
            mbar_wait(bar + 8 * (BAR_VFULL + st), ph);
            fence_proxy_async();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
              mma_pv<F16>(o, pa[kk], desc_at(desc_lo(sV, kVtLbo), kk * 2048, kVtSbo), 1);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(o);
            mbar_arrive(bar + 8 * (BAR_VEMPTY + st));
            kv_it++;
          }
        } else {
          // first (last-in-sequence) tile: scores and softmax only
          int cur = kv_it & 1;
          uint32_t cur_ph = (kv_it >> 1) & 1;
          // The first tile holds the diagonal (causal) or the request's
          // last keys. When no row of this warpgroup sees its keys 64..127
          // (wg_top: the largest limit of its rows), its scores run at half
          // width (m64n64; P V stays whole, with P zero there): under a
          // causal mask with no prefix that is warpgroup 0 on every
          // m-block's diagonal, ~3 % of the tensor work of 16 x 1K.
          const int wg_top = p.causal ? min(it.K - 1, it.K - it.Q + it.mb * kBM + 64 * cw + 63) : it.K - 1;
          const bool half = HALFW && wg_top < (it.ntiles - 1) * kBN + 64;
          {
            const int kt = (it.ntiles - 1) * kBN;
            const uint32_t sK = sbase + L::kK + cur * L::kKBytes;
            mbar_wait(bar + 8 * (BAR_KFULL + cur), cur_ph);
            fence_proxy_async();
            if (LOOP == 2) named_bar_sync(1 + cw, 256);
            // Each branch waits for its own wgmmas: a group still in flight
            // where the branches join makes ptxas serialise every wgmma of
            // the kernel (C7515).
            if (half) {
              wgmma_fence();
              qk_issue<DQK, F16, true>(s, qa, sK);
              wgmma_commit();
              if (LOOP == 2) named_bar_arrive(2 - cw, 256);
              if (DEFER) item_epilogue<F16, true>(p, o, inv, lse2, bar, eslot, r_lo, lane, quad_ok, pend);
              wgmma_wait<0>();
              reg_fence(s);
#pragma unroll
              for (int i = 32; i < 64; i++) s[i] = -INFINITY;  // keys 64..127 (masked for every row anyway)
            } else {
              wgmma_fence();
              qk_issue<DQK, F16, false>(s, qa, sK);
              wgmma_commit();
              if (LOOP == 2) named_bar_arrive(2 - cw, 256);
              if (DEFER) item_epilogue<F16, true>(p, o, inv, lse2, bar, eslot, r_lo, lane, quad_ok, pend);
              wgmma_wait<0>();
              reg_fence(s);
            }
            if (DEFER) {
              zero_state(o, m, l);
              pend = false;
            }
            PF_TL(2);
            mbar_arrive(bar + 8 * (BAR_KEMPTY + cur));
            if (it.ntiles == 1) mbar_arrive(bar + 8 * BAR_QEMPTY);
            softmax_tile<CAP>(s, m, l, alpha, sf, kt + kBN - 1 > wg_lim, kt, lim_lo, lim_hi, lane);
            pack_p<F16>(s, pa);
            PF_TL(3);
            kv_it++;
          }
          // Tiles with a masked key for some row of this warpgroup come
          // first (walking down from the diagonal); the two loops keep the
          // mask test out of the code that runs while wgmmas are in flight.
          const int nu = (wg_lim + 1) / kBN - 1;  // highest tile no row masks
          int n = it.ntiles - 2;
          for (; n >= 0 && n > nu; n--)
            ovl_step<DQK, DV, F16, CAP, true, LOOP == 2, PIN, ES>(o, s, pa, m, l, alpha, sf, sbase, bar, qa, kv_it, cur, cur_ph, n,
                                                         lim_lo, lim_hi, lane, cw);
          for (; n >= 0; n--)
            ovl_step<DQK, DV, F16, CAP, false, LOOP == 2, PIN, ES>(o, s, pa, m, l, alpha, sf, sbase, bar, qa, kv_it, cur, cur_ph,
                                                          n, lim_lo, lim_hi, lane, cw);
          {
            const uint32_t sVc = sbase + L::kV + cur * L::kVBytes;
            if (ES) {
#pragma unroll
              for (int i = 0; i < 64; i++) o[i] *= alpha[(i >> 1) & 1];
            }
            mbar_wait(bar + 8 * (BAR_VFULL + cur), cur_ph);
            fence_proxy_async();
            if (LOOP == 2) named_bar_sync(1 + cw, 256);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
              mma_pv<F16>(o, pa[kk], desc_at(desc_lo(sVc, kVtLbo), kk * 2048, kVtSbo), 1);
            wgmma_commit();
            if (LOOP == 2) named_bar_arrive(2 - cw, 256);
            wgmma_wait<0>();
            reg_fence(o);
            PF_TL(4);
            mbar_arrive(bar + 8 * (BAR_VEMPTY + cur));
          }
        }
      }
      // epilogue: o / l and the lse of rows t_lo, t_hi (rows past Q
      // unwritten); DEFER: under the next item's first Q.K^T
      finish_rows(m, l, inv, lse2);
      pend = true;
      // The pairs (not quad_ok) are not deferred: stored here, while the
      // slot, as for the quads, is freed by the deferred call (which then
      // stores nothing), so every slot read is of a slot the consumers hold.
      if (!DEFER || !quad_ok)
        item_epilogue<F16, false>(p, o, inv, lse2, bar, (int)(round & 1), r_lo, lane, quad_ok, true, !DEFER);
      if (!DEFER) pend = false;
      PF_TL(5);
    }
#if defined(MLA_DEV_TIMELINE) || defined(MLA_DEV_BALANCE)
    pf_globaltimer_if(&g_pf_gt[blockIdx.x % kPfBalCtas][1], bal_on);
    st_b32_if(bal_on, &g_pf_work[blockIdx.x % kPfBalCtas], bal_work);
#endif
  }
#endif
}

// ---------------------------------------------------------------------------
// Merge of partial states: one warp per (token, head) row.
// ---------------------------------------------------------------------------
// K state pointers as kernel parameters: a small instantiation for the usual
// few states (a 32 KB parameter block costs launch time) and a full one.
template <int K>
struct MergeArgs {
  const void *o[K];
  const float *lse[K];
};
constexpr int kMergeSmall = 64;

// Every element of a row is read from all parts by the lane that then writes
// it, and the row's lse is written after __syncwarp: out may alias a part.
template <int K>
__global__ void __launch_bounds__(256) merge_kernel(const __grid_constant__ MergeArgs<K> a, int n, int64_t rows,
                                                    int dim, int dt, int base2, void *out, float *lse_out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t x = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); x < rows; x += warps) {
    float mx = -INFINITY;
    bool bad = false;
    for (int k = 0; k < n; k++) {
      const float v = a.lse[k][x];
      if (isnan(v) || v == INFINITY) bad = true;
      else mx = fmaxf(mx, v);
    }
    float wsum = 0.0f;
    for (int k = 0; k < n; k++) {
      const float v = a.lse[k][x];
      if (!bad && mx != -INFINITY) wsum += base2 ? exp2f(v - mx) : expf(v - mx);
    }
    __syncwarp();
    const int64_t off = x * dim;
    for (int c = lane; c < dim; c += 32) {
      float acc;
      if (bad) acc = NAN;
      else if (mx == -INFINITY) acc = 0.0f;
      else {
        acc = 0.0f;
        for (int k = 0; k < n; k++) {
          const float v = a.lse[k][x];
          const float w = base2 ? exp2f(v - mx) : expf(v - mx);
          if (w == 0.0f) continue;  // an empty side: its o (maybe garbage) is never read
          acc += w * load_act(a.o[k], off + c, dt);
        }
        acc /= wsum;
      }
      store_act(out, off + c, dt, acc);
    }
    __syncwarp();
    if (lse_out && lane == 0)
      lse_out[x] = bad ? NAN : mx == -INFINITY ? -INFINITY : mx + (base2 ? log2f(wsum) : logf(wsum));
  }
}

// Heads per group of the item order; MLA_PREFILL_HEAD_GROUP overrides it
// (tuning in dev/cuda/prefill; read at every launch, a few nanoseconds).
// A batch of one request walks one head at a time: its m-blocks alone fill
// the grid's rounds, and one head's K and V (10.5 MB at 16K, 192/128) stay in
// L2 while every CTA reads them (1 x 16K 1.5-2.8 % faster than with 2 in
// three rounds of session 24; batches lose 0.5-1.5 % with 1;
// docs/prefill-kernel.md section 6).
static int head_group(int batch_size) {
  const int dflt = batch_size == 1 ? 1 : kHeadGroup;
  const char *e = getenv("MLA_PREFILL_HEAD_GROUP");
  const int v = e ? atoi(e) : dflt;
  return v >= 1 ? v : dflt;
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
typedef CUresult (*AddressRangeFn)(CUdeviceptr *, size_t *, CUdeviceptr);

// Driver entry points through the runtime (no -lcuda); NULL when missing.
static void *driver_fn(const char *name) {
  void *f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return nullptr;
  return f;
}

// Rows of row_bytes from ptr to the end of the allocation holding it: the
// host-side bound a tensor map needs and mla_ragged_args does not carry. 0
// when the driver cannot tell (then the cp.async producer runs).
static uint64_t rows_to_end(const void *ptr, uint64_t row_bytes) {
  static AddressRangeFn fn = (AddressRangeFn)driver_fn("cuMemGetAddressRange");
  if (!fn) return 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  if (fn(&base, &size, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS) return 0;
  const uint64_t end = (uint64_t)base + size, at = (uint64_t)(uintptr_t)ptr;
  if (at < (uint64_t)base || at >= end) return 0;
  const uint64_t rows = (end - at) / row_bytes;
  return rows < (1ull << 31) ? rows : (1ull << 31) - 1;  // box coordinates are int32
}

// [rows, heads, dim] 16-bit tensor as {dim, heads, rows}; box {64, 1, 128} =
// one 128B-swizzled [128 x 64] sub-tile; zeros past `rows`.
static bool make_map(CUtensorMap *map, const void *ptr, int dim, int heads, bool f16) {
  static EncodeTiledFn fn = (EncodeTiledFn)driver_fn("cuTensorMapEncodeTiled");
  if (!fn) return false;
  const uint64_t row_bytes = (uint64_t)heads * dim * 2;
  const uint64_t rows = rows_to_end(ptr, row_bytes);
  if (rows == 0) return false;
  cuuint64_t dims[3] = {(cuuint64_t)dim, (cuuint64_t)heads, (cuuint64_t)rows};
  cuuint64_t strides[2] = {(cuuint64_t)dim * 2, (cuuint64_t)row_bytes};
  cuuint32_t box[3] = {64, 1, (cuuint32_t)kBM}, one[3] = {1, 1, 1};
  return fn(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(ptr),
            dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#if defined(MLA_DEV_TIMELINE) || defined(MLA_DEV_BALANCE)
// Dev only: whether this launch is one MLA_DEV_PF_TIMELINE_AT names (a
// comma-separated list of launch numbers, default 5; `mla bench --runs 20`
// launches 1 x 8K as 1-21, 1 x 16K as 22-42, 16 x 1K as 43-63).
static int pf_dev_calls = 0;  // launches so far (the timeline's printout names its launch)
static bool pf_dev_hit() {
  const char *at = getenv("MLA_DEV_PF_TIMELINE_AT");
  const int calls = ++pf_dev_calls;
  if (!at) return calls == 5;
  for (const char *c = at; c && *c;) {
    if (atoi(c) == calls) return true;
    c = strchr(c, ',');
    if (c) c++;
  }
  return false;
}
static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
// Per CTA, the consumers' item loop in wall time (%globaltimer) against its
// work: how even the static item order leaves the SMs, and whether some SMs
// run slower per unit of work. Call after the launch has completed.
static void pf_balance_print(int grid) {
  static unsigned long long gt[kPfBalCtas][2];
  static unsigned work[kPfBalCtas];
  cudaMemcpyFromSymbol(gt, g_pf_gt, sizeof gt);
  cudaMemcpyFromSymbol(work, g_pf_work, sizeof work);
  const int n = grid < kPfBalCtas ? grid : kPfBalCtas;
  unsigned long long t0 = ~0ull;
  for (int c = 0; c < n; c++) t0 = gt[c][0] < t0 ? gt[c][0] : t0;
  double end[kPfBalCtas], rate[kPfBalCtas];
  double sb = 0, sw = 0, max_b = 0, max_w = 0;
  for (int c = 0; c < n; c++) {
    end[c] = 1e-3 * (double)(gt[c][1] - t0);
    const double busy = 1e-3 * (double)(gt[c][1] - gt[c][0]), w = 0.5 * work[c];
    rate[c] = 1e3 * busy / (w > 0 ? w : 1);
    sb += busy, sw += w;
    max_b = busy > max_b ? busy : max_b;
    max_w = w > max_w ? w : max_w;
  }
  qsort(end, n, sizeof(double), cmp_double);
  qsort(rate, n, sizeof(double), cmp_double);
  fprintf(stderr,
          "pf balance: CTA end (us from the first start) p0 %.1f p10 %.1f p50 %.1f p90 %.1f max %.1f | busy max / "
          "mean %.4f | work (tiles + 0.5 per item) max / mean %.4f | ns per work unit p0 %.1f p50 %.1f max %.1f\n",
          end[0], end[n / 10], end[n / 2], end[n * 9 / 10], end[n - 1], max_b / (sb / n), max_w / (sw / n), rate[0],
          rate[n / 2], rate[n - 1]);
}
#endif

#ifdef MLA_DEV_TIMELINE
// Dev only: after the launches pf_dev_hit names, print the balance and, per
// tile count, the mean cycles of each phase of the items (both warpgroups,
// every item but each CTA's first) and their period (start to the next
// item's start). Syncs the stream. (nvcc 13.0: ptxas serialises the wgmmas
// of this build, C7518, so its cycle counts are not the library kernel's.)
static void pf_timeline_print(cudaStream_t stream, int grid) {
  if (!pf_dev_hit()) return;
  static long long h[kPfTlCtas][kPfTlItems][2][kPfTlPh];
  static int hn[kPfTlCtas][kPfTlItems], hc[kPfTlCtas];
  cudaStreamSynchronize(stream);
  cudaMemcpyFromSymbol(h, g_pf_tl, sizeof h);
  cudaMemcpyFromSymbol(hn, g_pf_tln, sizeof hn);
  cudaMemcpyFromSymbol(hc, g_pf_tlc, sizeof hc);
  pf_balance_print(grid);
  constexpr int kB = 18;  // tile counts 1..16, then > 16 (bucket 17)
  double sum[kB][kPfTlPh + 1] = {{0}};
  long long n[kB] = {0};
  double total = 0;
  for (int c = 0; c < kPfTlCtas; c++)
    for (int i = 1; i + 1 < hc[c] && i + 1 < kPfTlItems; i++)
      for (int w = 0; w < 2; w++) {
        const int nt = hn[c][i];
        if (nt <= 0) continue;
        const int b = nt > 16 ? 17 : nt;
        for (int k = 1; k < kPfTlPh; k++) sum[b][k] += (double)(h[c][i][w][k] - h[c][i][w][k - 1]);
        sum[b][kPfTlPh] += (double)(h[c][i + 1][w][0] - h[c][i][w][0]);
        total += (double)(h[c][i + 1][w][0] - h[c][i][w][0]);
        n[b]++;
      }
  fprintf(stderr,
          "pf timeline (launch %d; mean cycles per item and warpgroup: Q wait, first Q.K^T (deferred loops: with the "
          "previous epilogue), first softmax, the other tiles, epilogue | gap to the next item | period, share of all "
          "item time)\n",
          pf_dev_calls);
  for (int b = 1; b < kB; b++) {
    if (!n[b]) continue;
    fprintf(stderr, "pf tiles %s%2d: n %6lld |", b == 17 ? ">" : " ", b == 17 ? 16 : b, n[b]);
    double phases = 0;
    for (int k = 1; k < kPfTlPh; k++) {
      fprintf(stderr, " %7.0f", sum[b][k] / n[b]);
      phases += sum[b][k];
    }
    // gap: from one item's epilogue stamp to the next one's start (the loop
    // head: the item decode, and whatever waits behind the epilogue's stores)
    fprintf(stderr, " | gap %5.0f | %7.0f %5.1f %%", (sum[b][kPfTlPh] - phases) / n[b], sum[b][kPfTlPh] / n[b],
            total > 0 ? 100.0 * sum[b][kPfTlPh] / total : 0.0);
    if (b > 1 && b < 17) fprintf(stderr, "  (%.0f per further tile)", sum[b][4] / n[b] / (b - 1));
    fprintf(stderr, "\n");
  }
}
#endif

template <int DQK, bool F16, bool CAP, int MODE>
cudaError_t launch(const mla_prefill_params *p, int grid, cudaStream_t stream, const TmaMaps &maps) {
  auto kern = prefill_kernel<DQK, 128, F16, CAP, MODE>;
  const int smem = Lay<DQK, 128>::kSmem;
  static uint64_t smem_set;  // per instantiation and device
  const cudaError_t e = set_smem_once(kern, smem, &smem_set);
  if (e != cudaSuccess) return e;
  mla_prefill_params q = *p;
  q.head_group = head_group(p->batch_size);
  // The static orders: snake unless MLA_PREFILL_ORDER=rr (plain round
  // robin): +3-5 % on 1 x 16K in five of five paired runs, neutral on
  // 16 x 1K (docs/prefill-kernel.md section 5). With a counter (the caller's
  // workspace) the dynamic order runs instead, unless MLA_PREFILL_ORDER
  // names a static one (rr or snake; for A/B runs).
  const char *ord = getenv("MLA_PREFILL_ORDER");
  q.order_snake = !(ord && !strcmp(ord, "rr"));
  if (ord && (!strcmp(ord, "rr") || !strcmp(ord, "snake"))) q.item_counter = nullptr;
  if (q.item_counter) {
    const cudaError_t z = cudaMemsetAsync(q.item_counter, 0, sizeof(unsigned), stream);
    if (z != cudaSuccess) return z;
  }
  kern<<<grid, kThreads, smem, stream>>>(q, maps);
#ifdef MLA_DEV_TIMELINE
  pf_timeline_print(stream, grid);
#elif defined(MLA_DEV_BALANCE)
  if (pf_dev_hit()) {
    cudaStreamSynchronize(stream);
    pf_balance_print(grid);
  }
#endif
  return cudaGetLastError();
}

template <int DQK, bool F16>
cudaError_t launch_dims(const mla_prefill_params *p, int grid, cudaStream_t stream, int mode) {
  const bool cap = p->softcap > 0.0f;
  TmaMaps maps;
  memset(&maps, 0, sizeof maps);
  // The TMA producer when every tensor's allocation bound is known, else
  // the same consumer loop (less PIN / ES) with the cp.async producer.
  if ((mode & 8) && !(make_map(&maps.q, p->q, DQK, p->num_heads, F16) &&
                      make_map(&maps.k, p->k, DQK, p->num_kv_heads, F16) &&
                      make_map(&maps.v, p->v, 128, p->num_kv_heads, F16)))
    mode &= 7;
#define PF_LAUNCH(M) \
  return cap ? launch<DQK, F16, true, M>(p, grid, stream, maps) : launch<DQK, F16, false, M>(p, grid, stream, maps)
  if (mode == 8) PF_LAUNCH(8);
  if (mode == 11) PF_LAUNCH(11);
  if (mode == 27) PF_LAUNCH(27);
  if (mode == 43) PF_LAUNCH(43);
  if (mode == 59) PF_LAUNCH(59);
  if (mode == 1) PF_LAUNCH(1);
  if (mode == 3) PF_LAUNCH(3);
  if (mode == 2) PF_LAUNCH(2);
  PF_LAUNCH(0);
#undef PF_LAUNCH
}

}  // namespace

extern "C" const char *mla_cuda_prefill_unsupported(int qk_dim, int v_dim, int act_dtype) {
  if (act_dtype != MLA_DTYPE_BF16 && act_dtype != MLA_DTYPE_F16)
    return "the CUDA ragged kernels take bf16 or f16 q, k, v";
  if (!((qk_dim == 192 || qk_dim == 128) && v_dim == 128))
    return "the CUDA ragged kernels take qk_dim / v_dim = 192/128 or 128/128";
  return NULL;
}

// The consumer loop and producer (MODE of prefill_kernel) by name:
// MLA_PREFILL_VARIANT = plain, overlap, pingpong, overlap232, plain-tma or
// overlap232-tma overrides the default (the harness in
// dev/cuda/prefill and the GPU test use it; read at every launch). MODE 9
// (the TMA producer under the 24 / 240 split) is not offered: it failed with
// a launch error on large inputs (docs/prefill-kernel.md section 6).
static int mode_named(const char *e) {
  static const struct {
    const char *name;
    int mode;
  } names[] = {{"plain", 0},    {"overlap", 1},    {"pingpong", 2},
               {"overlap232", 3}, {"plain-tma", 8}, {"overlap232-tma", 11},
               {"overlap232-tma-pin", 27}, {"overlap232-tma-es", 43}, {"overlap232-tma-pin-es", 59}};
  for (size_t i = 0; e && i < sizeof names / sizeof names[0]; i++)
    if (!strcmp(e, names[i].name)) return names[i].mode;
  return -1;
}
// MLA_PREFILL_DEFAULT replaces the built-in default (so the GPU test's
// "default" pass can run any variant).
static int kernel_mode() {
  int m = mode_named(getenv("MLA_PREFILL_VARIANT"));
  if (m < 0) m = mode_named(getenv("MLA_PREFILL_DEFAULT"));
  return m >= 0 ? m : kDefaultMode;
}

extern "C" int mla_cuda_prefill_launch(const mla_prefill_params *p, int grid, void *stream_) {
  cudaStream_t stream = (cudaStream_t)stream_;
  if (mla_cuda_prefill_unsupported(p->qk_dim, p->v_dim, p->act_dtype)) return (int)cudaErrorNotSupported;
  if (p->batch_size <= 0) return (int)cudaSuccess;
  if (p->batch_size > MLA_CUDA_PREFILL_MAX_BATCH) return (int)cudaErrorNotSupported;
  // Built without sm_90a code the kernel bodies are empty: refuse.
  static uint64_t arch_ok;
  cudaError_t e = check_sm90_once(prefill_kernel<192, 128, false, false, 0>, &arch_ok);
  if (e != cudaSuccess) return (int)e;
  const bool f16 = p->act_dtype == MLA_DTYPE_F16;
  const int mode = kernel_mode();
  if (p->qk_dim == 192)
    e = f16 ? launch_dims<192, true>(p, grid, stream, mode) : launch_dims<192, false>(p, grid, stream, mode);
  else
    e = f16 ? launch_dims<128, true>(p, grid, stream, mode) : launch_dims<128, false>(p, grid, stream, mode);
  return (int)e;
}

template <int K>
static cudaError_t merge_pass(const MergeArgs<K> &a, int n, int64_t rows, int dim, int dt, int base2, void *out,
                              float *lse_out, cudaStream_t stream) {
  const int64_t warps_per_block = 8;
  int64_t blocks = (rows + warps_per_block - 1) / warps_per_block;
  if (blocks > 65536) blocks = 65536;
  merge_kernel<K><<<(unsigned)blocks, 256, 0, stream>>>(a, n, rows, dim, dt, base2, out, lse_out);
  return cudaGetLastError();
}

// Every state into a, in passes of up to K. One pass takes the states in
// order. More than one: pass 1 takes every state that out or lse_out
// aliases (later passes would read them overwritten), later passes the
// running result (out, lse_out) as their state 0 plus the next states in
// order.
template <int K>
static cudaError_t merge_passes(MergeArgs<K> &a, int n, int64_t rows, int dim, int dt, int base2,
                                const void *const *o_parts, const float *const *lse_parts, void *out,
                                float *lse_out, cudaStream_t st) {
  const bool passes = n > K;
  auto first = [&](int k) { return !passes || o_parts[k] == out || lse_parts[k] == lse_out; };
  int m = 0;
  for (int k = 0; k < n; k++)
    if (first(k)) {
      if (m == K) return cudaErrorInvalidValue;  // (ragged.c refuses this with a message first)
      a.o[m] = o_parts[k], a.lse[m] = lse_parts[k], m++;
    }
  int next = 0;  // the next state not yet taken
  for (;;) {
    for (; m < K && next < n; next++)
      if (!first(next)) a.o[m] = o_parts[next], a.lse[m] = lse_parts[next], m++;
    const cudaError_t e = merge_pass(a, m, rows, dim, dt, base2, out, lse_out, st);
    if (e != cudaSuccess || next == n) return e;
    a.o[0] = out, a.lse[0] = lse_out, m = 1;
  }
}

extern "C" int mla_cuda_merge_launch(int n, int64_t rows, int dim, int act_dtype, int base2,
                                     const void *const *o_parts, const float *const *lse_parts, void *out,
                                     float *lse_out, void *stream) {
  constexpr int K = MLA_CUDA_MERGE_PASS_STATES;
  if (n < 1) return (int)cudaErrorInvalidValue;
  if (rows <= 0) return (int)cudaSuccess;
  cudaStream_t st = (cudaStream_t)stream;
  if (n <= kMergeSmall) {
    MergeArgs<kMergeSmall> a = {};
    return (int)merge_passes(a, n, rows, dim, act_dtype, base2, o_parts, lse_parts, out, lse_out, st);
  }
  if (n > K && !lse_out) return (int)cudaErrorInvalidValue;  // passes carry the running lse
  // 32 KB: not on the stack; per thread (contexts may be driven from several
  // threads); the launch copies it.
  static thread_local MergeArgs<K> a;
  static_assert(sizeof(MergeArgs<K>) + 64 <= 32764, "the kernel parameter space");
  return (int)merge_passes(a, n, rows, dim, act_dtype, base2, o_parts, lse_parts, out, lse_out, st);
}
