// Which TMA load pattern can stream a per-tensor fp8 cache at the DRAM rate?
// (docs/decode-kernel.md §3.5.2: the fp8 ring kernel pulls 2.97 TB/s where
// the bf16 ring pulls 4.3 through the same ring; its compute alone is 134 µs
// with three warpgroups, 169 with two, yet it takes 204 µs with loads.)
//
// One CTA per SM, one thread: it streams 64-key tiles of a paged cache (page
// 64, pages shuffled over the CTAs as mla bench does) through `nbuf` tile
// buffers, each tile as one load pattern issues it, waits for each tile,
// holds it `work` cycles, then refills its buffer with the tile nbuf ahead.
// No compute, so the rate is what the pattern and the depth in flight give:
//   bf16      9 boxes {64 bf16, 64 rows}, rows of 1152 B (the bf16 ring)
//   fp8row    5 boxes {128 B, 64 rows}, rows of 576 B, at bytes 0 128 256 384
//             and 448 (the fp8 ring's rope box overlaps the last latent box)
//   fp8lat    the 4 latent boxes only (what the row view costs without rope)
//   fp8half   the 4 latent boxes + a {64 B, 64 rows} rope box (4.5 slots)
//   fp8pair   9 boxes {128 B, 32 row pairs} over rows of 1152 B (whole lines)
//   fp8bulk   one cp.async.bulk of the page's contiguous 36 864 bytes
//   bf16bulk  one cp.async.bulk of 73 728 bytes
// Reported: ms (CUDA events, L2 flushed by a 256 MiB memset first, median
// of `reps`), distinct bytes / time (the DRAM-side rate) and bytes landed in
// shared memory / time, and the SM clock CTA 0 saw (clock64 over
// %globaltimer): `work` is in cycles, so a lower clock stretches it.
//
//   build: make -C dev/cuda build/tma_pattern
//   run:   dev/cuda/build/tma_pattern                 (the default sweep)
//          dev/cuda/build/tma_pattern fp8row 5 0 2500 (pattern, nbuf, work...)
//          dev/cuda/build/tma_pattern ring MODE U NC WORK ROPE_AT [STAGGER [BACKOFF]]
//          dev/cuda/build/tma_pattern ringsweep
//          dev/cuda/build/tma_pattern readsweep  (n = 0-4 warps reading shared
//          memory beside the streaming thread; `rd B/c`: their bytes per SM
//          cycle, against the `idle` pattern's: the same readers, no TMA)
//          (REPS=n: median of n runs instead of 5; `wait` / `issue` = mean
//          cycles per tile spent waiting for it / issuing its boxes)
// `ring` emulates the ring kernel without its compute (tma_ring below).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.cuh"

// (idle: no loads, the thread only holds `work` cycles a tile: the readers' rate with no TMA traffic)
enum Pattern { BF16, FP8ROW, FP8LAT, FP8HALF, FP8PAIR, FP8BULK, BF16BULK, IDLE, NPAT };
static const char *kNames[NPAT] = {"bf16", "fp8row", "fp8lat", "fp8half", "fp8pair", "fp8bulk", "bf16bulk", "idle"};
static __host__ __device__ bool is_bf16(int pat) { return pat == BF16 || pat == BF16BULK; }
// bytes one tile lands in shared memory, and its footprint there
static __host__ __device__ int landed_bytes(int pat) {
  switch (pat) {
    case BF16: return 9 * 8192;
    case FP8ROW: return 5 * 8192;
    case FP8LAT: return 4 * 8192;
    case FP8HALF: return 4 * 8192 + 4096;
    case FP8PAIR: return 9 * 4096;
    case FP8BULK: return 36864;
    case IDLE: return 36864;  // (the buffers the readers read; nothing lands)
    default: return 73728;
  }
}
static __host__ __device__ int footprint(int pat) { return (landed_bytes(pat) + 1023) & ~1023; }
static constexpr int kSmemMax = 227 * 1024;

struct Maps {
  CUtensorMap row;   // {576 or 1152 B, 64 rows, pages}: box {128 B, 64}
  CUtensorMap row32; // fp8: box {128 B, 32}
  CUtensorMap half;  // fp8: box {64 B, 64}
  CUtensorMap pair;  // fp8: {1152 B, 32 pairs, pages}, box {128 B, 32}
};

static __device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__global__ void __launch_bounds__(160, 1)
    tma_pattern(const __grid_constant__ Maps maps, const uint8_t *kv, const int *pages, int pat, int tiles, int nbuf,
                long long work, unsigned long long *clk) {
  // warps 1..4 (READERS): ldmatrix.x4 over the tile buffers, conflict-free, as fast as they can, until thread 0 is
  // done: the consumers' shared-memory reads against the TMA's writes (the fp8 kernel reads ~100 KB of shared
  // memory a tile: K for Q.K^T, V for P V, Q and P^T as wgmma B operands)
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  const int foot = footprint(pat);
  const uint32_t bars = sb + nbuf * foot;
  int *spages = reinterpret_cast<int *>(smem + nbuf * foot + 8 * nbuf);
  volatile int *done = reinterpret_cast<volatile int *>(spages + tiles);
  if (threadIdx.x == 0) *done = 0;
  for (int t = threadIdx.x; t < tiles; t += blockDim.x) spages[t] = pages[(size_t)blockIdx.x * tiles + t];
  __syncthreads();
  if (threadIdx.x >= 32) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) - 1;
    const uint32_t span = (uint32_t)(nbuf * foot) & ~1023u;
    uint32_t acc = 0, x0, x1, x2, x3;
    unsigned long long n = 0;
    uint32_t off = (uint32_t)w * 8192u % span;
    while (!*done) {
#pragma unroll
      for (int i = 0; i < 8; i++) {  // 8 x 512 bytes: rows lane of a 1024-byte group, 16-byte unit (lane & 7) ^ i
        const uint32_t a = sb + off + (uint32_t)(lane & 7) * 128u + (uint32_t)(((lane >> 3) + 4 * (i & 1)) ^ (lane & 7)) * 16u;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                     : "r"(a));
        acc ^= x0 ^ x1 ^ x2 ^ x3;
        off += 1024u;
        if (off >= span) off -= span;
      }
      n += 8;
    }
    if (lane == 0) atomicAdd(clk + 6, n);
    if (acc == 0x12345678u) clk[7] = acc;  // (keeps the loads)
    return;
  }
  if (threadIdx.x != 0) return;
  for (int b = 0; b < nbuf; b++) mbar_init(bars + 8 * b, 1);
  fence_mbar_init();
  if (blockIdx.x == 0) {  // the SM clock over the run: clock64 against %globaltimer (ns)
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    clk[0] = clock64();
    clk[1] = g;
  }
  const size_t page_bytes = is_bf16(pat) ? 73728 : 36864;
  auto load = [&](int t) {
    const int b = t % nbuf, page = spages[t];
    const uint32_t dst = sb + b * foot, bar = bars + 8 * b;
    switch (pat) {
      case BF16:
        mbar_expect_tx(bar, 9 * 8192);
        for (int c = 0; c < 9; c++) tma_load_3d(dst + c * 8192, &maps.row, bar, 128 * c, 0, page);
        break;
      case FP8ROW:
      case FP8LAT: {
        const int n = pat == FP8ROW ? 5 : 4;
        mbar_expect_tx(bar, n * 8192);
        for (int c = 0; c < n; c++) tma_load_3d(dst + c * 8192, &maps.row, bar, c < 4 ? 128 * c : 448, 0, page);
        break;
      }
      case FP8HALF:
        mbar_expect_tx(bar, 4 * 8192 + 4096);
        for (int c = 0; c < 4; c++) tma_load_3d(dst + c * 8192, &maps.row, bar, 128 * c, 0, page);
        tma_load_3d(dst + 4 * 8192, &maps.half, bar, 512, 0, page);
        break;
      case FP8PAIR:
        mbar_expect_tx(bar, 9 * 4096);
        for (int c = 0; c < 9; c++) tma_load_3d(dst + c * 4096, &maps.pair, bar, 128 * c, 0, page);
        break;
      default:
        mbar_expect_tx(bar, (uint32_t)page_bytes);
        bulk_load(dst, kv + (size_t)page * page_bytes, (uint32_t)page_bytes, bar);
        break;
    }
  };
  if (pat == IDLE) {
    const long long t0 = clock64();
    while (clock64() - t0 < work * tiles) {
    }
    tiles = 0;
  }
  for (int t = 0; t < nbuf && t < tiles; t++) load(t);
  long long waited = 0, issuing = 0;  // cycles this CTA spent waiting for its tiles, issuing them
  for (int t = 0; t < tiles; t++) {
    const int b = t % nbuf;
    const long long w0 = clock64();
    mbar_wait(bars + 8 * b, (uint32_t)(t / nbuf) & 1u);
    const long long t0 = clock64();
    waited += t0 - w0;
    while (clock64() - t0 < work) {
    }
    const long long i0 = clock64();
    if (t + nbuf < tiles) load(t + nbuf);
    issuing += clock64() - i0;
  }
  *done = 1;
  if (blockIdx.x == 0) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    clk[2] = clock64();
    clk[3] = g;
  }
  atomicAdd(clk + 4, (unsigned long long)waited);
  atomicAdd(clk + 5, (unsigned long long)issuing);
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static void encode(CUtensorMap *m, void *base, uint64_t d0, uint64_t d1, uint64_t d2, uint64_t s1, uint64_t s2,
                   uint32_t b0, uint32_t b1, CUtensorMapSwizzle sw) {
  static EncodeTiledFn fn = nullptr;
  if (!fn) {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    fn = (EncodeTiledFn)f;
  }
  cuuint64_t dims[3] = {d0, d1, d2}, strides[2] = {s1, s2};
  cuuint32_t box[3] = {b0, b1, 1}, one[3] = {1, 1, 1};
  CUresult r = fn(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, base, dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  sw, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", (int)r);
    exit(1);
  }
}

// ---- The ring kernel's structure without its compute (tma_ring): a producer
// thread fills a ring of U units of 4 KB in the consumers' order, each unit
// once the use before it has been released; NC consumer threads (one per
// warp, standing for the consumer warpgroups) take tiles t = c, c + NC, ...,
// wait for each of its units, hold the tile `work` cycles and give its rope
// units back after `rope_at` of them, the rest at the end (K and V are the
// same bytes). A tile is
//   row10: the library's fp8 ring (5 boxes of 8 KB, each as two 4 KB boxes
//          of 32 rows: the rope box, row bytes 448..575, then latent 0..3)
//   half9: a {64 B, 64 rows} rope box + the 8 latent half boxes (4.5 slots)
//   row5:  the library's exact boxes, 5 of 8 KB in units of 8 KB (MODE 2)
// so U = 50 (200 KB) holds 5 row10 tiles or 5.55 half9 tiles (row5: U = 25).
__global__ void __launch_bounds__(128, 1)
    tma_ring(const __grid_constant__ Maps maps, const int *pages, int mode, int tiles, int U, int NC, long long work,
             long long rope_at, int stagger, int backoff, unsigned long long *clk) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  const int ub = mode == 2 ? 8192 : 4096;  // unit bytes
  const uint32_t full = sb + U * ub, empty = full + 8 * U, iss = empty + 8 * U;
  int *spages = reinterpret_cast<int *>(smem + U * ub + 16 * U + 16);
  const int P = mode == 1 ? 9 : mode == 2 ? 5 : 10, R = mode == 0 ? 2 : 1;  // units per tile, rope units (the first R)
  if (threadIdx.x == 0) {
    for (int u = 0; u < U; u++) {
      mbar_init(full + 8 * u, 1);
      mbar_init(empty + 8 * u, 1);
    }
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(iss), "r"(0) : "memory");
    fence_mbar_init();
  }
  for (int t = threadIdx.x; t < tiles; t += blockDim.x) spages[t] = pages[(size_t)blockIdx.x * tiles + t];
  __syncthreads();
  // (the threads with no role leave now: parked at a final __syncthreads in a
  // first version, they made the emulation ~10 % slower: 435 vs 395 us)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp == 0 && lane == 0) {
    int u = 0;
    uint32_t use = 0;
    long long pw = 0, pi = 0;  // producer: cycles waiting for empty units, issuing
    for (int t = 0; t < tiles; t++) {
      const int page = spages[t];
      if (backoff == 3) {  // (3: all of the tile's units free first, then its boxes back to back)
        int u2 = u;
        uint32_t use2 = use;
        const long long c0 = clock64();
        for (int k = 0; k < P; k++) {
          if (use2 > 0)
            while (!mbar_try_wait(empty + 8 * u2, (use2 - 1) & 1)) {
            }
          if (++u2 == U) {
            u2 = 0;
            use2++;
          }
        }
        pw += clock64() - c0;
      }
      for (int k = 0; k < P; k++) {
        const long long c0 = clock64();
        if (use > 0) {
          // backoff 0 / 3: a tight try_wait loop (the library's producer); 1: __nanosleep(64) between polls;
          // 2: try_wait with a 20 us suspend hint (the thread sleeps until the phase completes)
          if (backoff == 2) {
            uint32_t ok = 0;
            while (!ok)
              asm volatile(
                  "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 20000;\nselp.u32 %0, 1, 0, p;\n}\n"
                  : "=r"(ok)
                  : "r"(empty + 8 * u), "r"((use - 1) & 1)
                  : "memory");
          } else {
            while (!mbar_try_wait(empty + 8 * u, (use - 1) & 1))
              if (backoff == 1) __nanosleep(64);
          }
        }
        const long long c1 = clock64();
        const uint32_t dst = sb + u * ub, bar = full + 8 * u;
        mbar_expect_tx(bar, ub);
        if (mode == 2) tma_load_3d(dst, &maps.row, bar, k == 0 ? 448 : 128 * (k - 1), 0, page);
        else if (mode && k == 0) tma_load_3d(dst, &maps.half, bar, 512, 0, page);
        else if (!mode && k < 2) tma_load_3d(dst, &maps.row32, bar, 448, 32 * k, page);
        else {
          const int j = k - R;  // latent half box j: bytes 128 (j / 2).., rows 32 (j % 2)..
          tma_load_3d(dst, &maps.row32, bar, 128 * (j >> 1), 32 * (j & 1), page);
        }
        pw += c1 - c0;
        pi += clock64() - c1;
        if (++u == U) {
          u = 0;
          use++;
        }
      }
      asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(iss), "r"((t + 1) * P) : "memory");
    }
    atomicAdd(clk + 0, (unsigned long long)pw);
    atomicAdd(clk + 1, (unsigned long long)pi);
  } else if (warp >= 1 && warp <= NC && lane == 0) {
    long long waited = 0;
    unsigned long long g0, g1;
    const long long k0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    for (int t = warp - 1; t < tiles; t += NC) {
      const long long w0 = clock64();
      const int q0 = t * P;
      for (;;) {
        int v;
        asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"(iss) : "memory");
        if (v >= q0 + P) break;
        if (backoff == 1 || backoff == 2) __nanosleep(64);
      }
      for (int k = 0; k < P; k++) {
        const int q = q0 + k;
        mbar_wait(full + 8 * (q % U), (uint32_t)(q / U) & 1u);
      }
      const long long t0 = clock64();
      waited += t0 - w0;
      while (clock64() - t0 < rope_at) {
      }
      for (int k = 0; k < R; k++) mbar_arrive(empty + 8 * ((q0 + k) % U));
      // the latent units go back in 4 steps between rope_at + 530 (the softmax) and work, as the P V's
      // m-tile pairs retire (stagger), or all at the end
      const int per = (P - R) / 4;
      for (int j = 0; j < 4; j++) {
        const long long until = stagger ? rope_at + 530 + (work - rope_at - 530) * (j + 1) / 4 : work;
        while (clock64() - t0 < until) {
        }
        for (int k = R + per * j; k < R + per * (j + 1); k++) mbar_arrive(empty + 8 * ((q0 + k) % U));
      }
    }
    atomicAdd(clk + 4, (unsigned long long)waited);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    if (blockIdx.x == 0 && warp == 1) {  // the SM clock over the run
      clk[6] = clock64() - k0;
      clk[7] = g1 - g0;
    }
  }
}

int main(int argc, char **argv) {
  int sms = 0;
  CK(cudaSetDevice(0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int tiles = 124;  // b=128 s_k 8192 over 132 CTAs, as the ring kernel gets it
  const int npages = sms * tiles;
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 5;
  int readers = getenv("READERS") ? atoi(getenv("READERS")) : 0;  // reader warps beside the streaming thread (0-4)
  if (readers < 0 || readers > 4) {
    fprintf(stderr, "READERS must be 0-4\n");
    return 2;
  }
  uint8_t *kv = nullptr, *flush = nullptr;
  int *dpages = nullptr;
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&kv, (size_t)npages * 73728));
  CK(cudaMemset(kv, 0, (size_t)npages * 73728));
  CK(cudaMalloc(&flush, flush_bytes));
  std::vector<int> perm(npages);
  for (int i = 0; i < npages; i++) perm[i] = i;
  srand(7);
  for (int i = npages - 1; i > 0; i--) std::swap(perm[i], perm[rand() % (i + 1)]);
  CK(cudaMalloc(&dpages, sizeof(int) * npages));
  CK(cudaMemcpy(dpages, perm.data(), sizeof(int) * npages, cudaMemcpyHostToDevice));
  Maps m8, m16;
  memset(&m8, 0, sizeof m8);
  memset(&m16, 0, sizeof m16);
  encode(&m16.row, kv, 1152, 64, npages, 1152, 73728, 128, 64, CU_TENSOR_MAP_SWIZZLE_128B);
  encode(&m8.row, kv, 576, 64, npages, 576, 36864, 128, 64, CU_TENSOR_MAP_SWIZZLE_128B);
  encode(&m8.row32, kv, 576, 64, npages, 576, 36864, 128, 32, CU_TENSOR_MAP_SWIZZLE_128B);
  encode(&m8.half, kv, 576, 64, npages, 576, 36864, 64, 64, CU_TENSOR_MAP_SWIZZLE_64B);
  encode(&m8.pair, kv, 1152, 32, npages, 1152, 36864, 128, 32, CU_TENSOR_MAP_SWIZZLE_128B);
  CK(cudaFuncSetAttribute(tma_pattern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax));
  CK(cudaFuncSetAttribute(tma_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax));
  unsigned long long *dclk = nullptr;
  CK(cudaMalloc(&dclk, 8 * sizeof(unsigned long long)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  // reps launches, each after a flush: their times and counters (dclk's 8 words); med() takes a median
  struct Rep {
    float ms;
    unsigned long long c[8];
  };
  auto timed = [&](auto launch) {
    std::vector<Rep> v(reps);
    for (Rep &r : v) {
      CK(cudaMemset(flush, (int)(&r - v.data()) + 1, flush_bytes));
      CK(cudaMemset(dclk, 0, sizeof r.c));
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaGetLastError());
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&r.ms, e0, e1));
      CK(cudaMemcpy(r.c, dclk, sizeof r.c, cudaMemcpyDeviceToHost));
    }
    return v;
  };
  auto med = [&](const std::vector<Rep> &v, auto f) {
    std::vector<double> x;
    for (const Rep &r : v) x.push_back(f(r));
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  const double per_tile = (double)sms * tiles;

  auto run = [&](int pat, int nbuf, long long work) {
    if (nbuf * footprint(pat) + 64 + 4 * tiles + 4 + 1024 > kSmemMax) return;
    const auto v = timed([&] {
      tma_pattern<<<sms, 32 * (1 + readers), kSmemMax>>>(is_bf16(pat) ? m16 : m8, kv, dpages, pat, tiles, nbuf, work,
                                                         dclk);
    });
    const double t = med(v, [](const Rep &r) { return r.ms; }) * 1e-3;
    const double distinct = (double)npages * (is_bf16(pat) ? 73728 : 36864);
    const double landed = (double)npages * landed_bytes(pat);
    printf("%-9s %4d %6lld %7d | %8.1f | %8.0f %8.0f | %5.0f %6.0f %6.0f | %d %5.1f\n", kNames[pat], nbuf, work,
           nbuf * landed_bytes(pat) / 1024, t * 1e6, distinct / t / 1e9, landed / t / 1e9,
           med(v, [](const Rep &r) { return (double)(r.c[2] - r.c[0]) / (double)(r.c[3] - r.c[1]) * 1e3; }),
           med(v, [&](const Rep &r) { return r.c[4] / per_tile; }), med(v, [&](const Rep &r) { return r.c[5] / per_tile; }),
           readers, med(v, [&](const Rep &r) { return r.c[6] * 512.0 / sms / (r.ms * 1e-3 * 1.98e9); }));
    fflush(stdout);
  };

  // one ring emulation: MODE (0 row10, 1 half9, 2 row5), U units, NC consumers
  auto run_ring = [&](int mode, int U, int NC, long long work, long long rope_at, int stagger = 0, int backoff = 0) {
    if (U * (mode == 2 ? 8192 : 4096) + 16 * U + 16 + 4 * tiles + 1024 > kSmemMax) return;
    const auto v = timed([&] {
      tma_ring<<<sms, 128, kSmemMax>>>(m8, dpages, mode, tiles, U, NC, work, rope_at, stagger, backoff, dclk);
    });
    const double t = med(v, [](const Rep &r) { return r.ms; }) * 1e-3;
    const double mhz = med(v, [](const Rep &r) { return (double)r.c[6] / (double)r.c[7] * 1e3; });
    printf("ring %-6s U %2d (%.2f tiles) NC %d work %5lld rope_at %5lld%s b%d | %7.1f us | %5.0f GB/s | ideal %6.1f us"
           " | wait %5.0f | producer waits %5.0f issues %5.0f | %4.0f MHz\n",
           mode == 1 ? "half9" : mode == 2 ? "row5" : "row10", U, U / (mode == 1 ? 9.0 : mode == 2 ? 5.0 : 10.0), NC,
           work, rope_at, stagger ? " stag" : "", backoff, t * 1e6, (double)npages * 36864 / t / 1e9,
           (double)tiles * work / NC / mhz, med(v, [&](const Rep &r) { return r.c[4] / per_tile; }),
           med(v, [&](const Rep &r) { return r.c[0] / per_tile; }), med(v, [&](const Rep &r) { return r.c[1] / per_tile; }),
           mhz);
    fflush(stdout);
  };
  if (argc >= 2 && !strcmp(argv[1], "readsweep")) {
    // does the consumers' shared-memory reading slow the TMA's streaming? (the fp8 kernel reads ~100 KB of shared
    // memory per tile, ~48 B a cycle at its three-warpgroup rate)
    for (int r : {0, 1, 2, 4}) {
      readers = r;
      run(FP8ROW, 2, 0);
      run(FP8ROW, 5, 0);
      run(FP8PAIR, 5, 0);
      run(BF16, 2, 0);
      if (r) run(IDLE, 5, 2400);  // the readers alone for about as long (their rate without TMA traffic)
    }
    return 0;
  }
  if (argc >= 2 && !strcmp(argv[1], "ring")) {
    // ring HALF U NC WORK ROPE_AT
    if (argc < 7) {
      fprintf(stderr, "ring HALF U NC WORK ROPE_AT\n");
      return 2;
    }
    run_ring(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoll(argv[5]), atoll(argv[6]), argc > 7 ? atoi(argv[7]) : 0,
             argc > 8 ? atoi(argv[8]) : 0);
    return 0;
  }
  if (argc >= 2 && !strcmp(argv[1], "ringsweep")) {
    // the library's situation (session 15 run 7's phases: Q.K^T 2560, softmax + barrier 530, P V 1910 per
    // tile and warpgroup, three warpgroups ~6400 a tile), the library's boxes (row5), the release points staggered
    // as the P V retires, and the pollers' backoff
    for (int b : {0, 3})
      for (int U : {15, 25}) {
        run_ring(2, U, 2, 5000, 2560, 1, b);
        run_ring(2, U, 3, 6400, 2750, 1, b);
      }
    for (int b : {0, 3}) run_ring(2, 25, 1, 2500, 1250, 0, b);
    return 0;
  }
  printf("# tma_pattern: %d CTAs x %d tiles of 64 keys, page 64, shuffled pages, L2 flushed, median of %d\n", sms,
         tiles, reps);
  printf("%-9s %4s %6s %7s | %8s | %8s %8s | %5s %6s %6s | %s %5s\n", "pattern", "nbuf", "work", "KB fly", "us", "DRAM GB/s", "smem GB/s",
         "MHz", "wait", "issue", "R", "rd B/c");
  if (argc >= 2) {
    int pat = -1;
    for (int i = 0; i < NPAT; i++)
      if (!strcmp(argv[1], kNames[i])) pat = i;
    if (pat < 0) {
      fprintf(stderr, "unknown pattern %s\n", argv[1]);
      return 2;
    }
    for (int i = 3; i < argc || i == 3; i++) run(pat, argc > 2 ? atoi(argv[2]) : 4, argc > i ? atoll(argv[i]) : 0);
  } else {
    for (int pat = 0; pat < NPAT; pat++)
      for (int nbuf = 1; nbuf <= 6; nbuf++) run(pat, nbuf, 0);
    // the fp8 kernel's situation: ~2990 cycles a tile per CTA (session 15 run 7)
    for (int pat = 0; pat < NPAT; pat++)
      for (int nbuf = 2; nbuf <= 6; nbuf++) run(pat, nbuf, 2500);
  }
  CK(cudaFree(kv));
  CK(cudaFree(flush));
  CK(cudaFree(dpages));
  CK(cudaFree(dclk));
  return 0;
}
