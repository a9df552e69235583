// How long a decode K-tile refill takes to land, alone and under the load of
// the H=128 decode kernel (docs/decode-kernel.md §6, session 10: the wide
// kernel's refills land 2500-3600 cycles after issue at ~86 % L2 throughput;
// is that the hardware's floor at that load, or something the kernel adds?).
//
// One CTA per SM streams 64-key tiles of a paged bf16 cache (page 64, rows of
// 1152 bytes: the decode layout) through NBUF shared-memory buffers of 72 KB,
// each tile as the wide kernel loads it (9 TMA boxes of 64 columns x 64 rows,
// one mbarrier per buffer). Thread 0 is the consumer: it waits for a buffer,
// holds it for `work` cycles (the compute a real kernel does on it), then
// issues the buffer's next tile and stamps the issue time. Lanes of warp 1
// watch one buffer each and stamp the moment each load completes, so the
// latency (land - issue) does not depend on when the consumer looks.
//
// With --shared, CTAs 2k and 2k+1 read the same tiles (the two m-blocks of an
// H=128 request); otherwise every CTA its own. Reported per configuration:
// the latency's percentiles in cycles, the L2 -> SM rate (bytes delivered to
// shared memory / kernel time) and the DRAM-side rate (distinct bytes / time).
//
//   build: make -C dev/cuda build/tma_latency   (here or on the device)
//   run:   dev/cuda/build/tma_latency            (the default sweep)
//          dev/cuda/build/tma_latency --ctas 132 --nbuf 2 --work 3500 --shared 1 --tiles 248
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.cuh"
#include "tmap.h"


static constexpr int kTileBytes = 64 * 576 * 2;  // 73728: one 64-key tile of 576 bf16 columns
static constexpr int kMaxBuf = 3;

struct Stamps {
  long long *issue;  // [ctas, tiles] clock64 when the tile's loads were issued
  long long *land;   // [ctas, tiles] clock64 when its barrier completed (-1: the watcher gave up)
};

// The page of tile t of CTA c: a walk through the cache that no two streams
// share (unless `shared`), so every tile is a first read (L2 flushed before).
__device__ __forceinline__ int page_of(int c, int t, int tiles, int shared, int64_t num_pages) {
  const int stream = shared ? c >> 1 : c;
  return (int)(((int64_t)stream * tiles + t) % num_pages);
}

__global__ void __launch_bounds__(64, 1)
    tma_stream(const __grid_constant__ CUtensorMap map, int64_t num_pages, int tiles, int nbuf, int shared,
               long long work, Stamps st) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  const uint32_t bars = sb + kMaxBuf * kTileBytes;
  const int c = blockIdx.x, tid = threadIdx.x;
  long long *issue = st.issue + (size_t)c * tiles, *land = st.land + (size_t)c * tiles;
  if (tid == 0) {
    for (int b = 0; b < nbuf; b++) mbar_init(bars + 8 * b, 1);
    fence_mbar_init();
  }
  __syncthreads();
  auto load = [&](int t) {
    const int b = t % nbuf;
    const int page = page_of(c, t, tiles, shared, num_pages);
    mbar_expect_tx(bars + 8 * b, kTileBytes);
    issue[t] = clock64();
    for (int cc = 0; cc < 9; cc++)
      tma_load_3d(sb + b * kTileBytes + cc * 8192, &map, bars + 8 * b, 64 * cc, 0, page);
  };
  if (tid == 0) {
    for (int t = 0; t < nbuf && t < tiles; t++) load(t);
    for (int t = 0; t < tiles; t++) {
      const int b = t % nbuf;
      mbar_wait(bars + 8 * b, (uint32_t)(t / nbuf) & 1u);
      const long long t0 = clock64();
      while (clock64() - t0 < work) {
      }
      if (t + nbuf < tiles) load(t + nbuf);
    }
  } else if (tid >= 32 && tid < 32 + nbuf) {
    // watcher of buffer b: its k-th completion is tile b + k nbuf
    const int b = tid - 32;
    for (int t = b, k = 0; t < tiles; t += nbuf, k++) {
      long long n = 0;
      while (!mbar_try_wait(bars + 8 * b, (uint32_t)k & 1u) && ++n < (1ll << 26)) {
      }
      land[t] = n < (1ll << 26) ? clock64() : -1;
    }
  }
}

struct Config {
  int ctas, nbuf, shared, tiles;
  long long work;
};

static double pct(std::vector<long long> &v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, (size_t)(q * (double)(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + (long)i, v.end());
  return (double)v[i];
}

static void run(const Config &cf, const CUtensorMap &map, int64_t num_pages, void *flush, size_t flush_bytes,
                int clock_khz) {
  Stamps st;
  const size_t n = (size_t)cf.ctas * cf.tiles;
  CK(cudaMalloc(&st.issue, n * sizeof(long long)));
  CK(cudaMalloc(&st.land, n * sizeof(long long)));
  const int smem = kMaxBuf * kTileBytes + 64 + 1024;
  CK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaMemset(flush, 1, flush_bytes));  // L2 flushed (as the bench does)
  CK(cudaEventRecord(e0));
  tma_stream<<<cf.ctas, 64, smem>>>(map, num_pages, cf.tiles, cf.nbuf, cf.shared, cf.work, st);
  CK(cudaEventRecord(e1));
  CK(cudaGetLastError());
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<long long> hi(n), hl(n), lat;
  CK(cudaMemcpy(hi.data(), st.issue, n * sizeof(long long), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl.data(), st.land, n * sizeof(long long), cudaMemcpyDeviceToHost));
  int lost = 0;
  for (size_t i = 0; i < n; i++) {
    const int t = (int)(i % (size_t)cf.tiles);
    if (t < cf.nbuf) continue;  // the first loads of a CTA start together: not the steady state
    if (hl[i] < 0) {
      lost++;
      continue;
    }
    lat.push_back(hl[i] - hi[i]);
  }
  const double bytes = (double)n * kTileBytes;
  const double distinct = cf.shared ? bytes / 2 : bytes;
  const double p10 = pct(lat, 0.1), p50 = pct(lat, 0.5), p90 = pct(lat, 0.9), p99 = pct(lat, 0.99);
  printf("%5d %4d %6d %7lld %6d | %7.0f %7.0f %7.0f %7.0f | %6.2f | %8.3f %8.0f %8.0f%s\n", cf.ctas, cf.nbuf,
         cf.shared, cf.work, cf.tiles, p10, p50, p90, p99, p50 / (double)clock_khz * 1e3, ms,
         bytes / (ms * 1e-3) / 1e9, distinct / (ms * 1e-3) / 1e9, lost ? "  (watcher gave up)" : "");
  fflush(stdout);
  CK(cudaFree(st.issue));
  CK(cudaFree(st.land));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

int main(int argc, char **argv) {
  int dev = 0, sms = 0, clock_khz = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  Config one = {sms, 2, 1, 248, 3500};
  bool sweep = true;
  for (int i = 1; i < argc; i += 2) {
    sweep = false;
    if (i + 1 == argc) {
      fprintf(stderr, "option %s needs a value\n", argv[i]);
      return 2;
    }
    if (!strcmp(argv[i], "--ctas")) one.ctas = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--nbuf")) one.nbuf = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--shared")) one.shared = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--tiles")) one.tiles = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--work")) one.work = atoll(argv[i + 1]);
    else {
      fprintf(stderr, "unknown option %s (see the header of tma_latency.cu)\n", argv[i]);
      return 2;
    }
  }
  if (one.nbuf < 1 || one.nbuf > kMaxBuf || one.ctas < 1 || one.ctas > sms || one.tiles < 1 ||
      (one.shared && one.ctas % 2)) {
    fprintf(stderr, "need 1 <= nbuf <= %d, 1 <= ctas <= %d (even with --shared 1), tiles >= 1\n", kMaxBuf, sms);
    return 2;
  }

  // The cache: twice b=128 requests of s_k=8192 at page 64 (2.4 GB; the H=128 bench reads 1.2 GB).
  const int64_t num_pages = 2 * 128 * 8192 / 64;  // twice the bench cache: unshared streams never meet
  const int64_t row_bytes = 1152;
  void *kv = nullptr, *flush = nullptr;
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&kv, (size_t)num_pages * 64 * row_bytes));
  CK(cudaMemset(kv, 0, (size_t)num_pages * 64 * row_bytes));
  CK(cudaMalloc(&flush, flush_bytes));
  mla_decode_params p;
  memset(&p, 0, sizeof p);
  p.kv = kv;
  p.page_size = 64;
  p.num_pages = num_pages;
  p.row_bytes = row_bytes;
  CUtensorMap map;
  CK(make_kv_tmap(&p, &map));

  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("# tma_latency: %s, %d SMs, clock %d MHz (the rate clock64 ticks at when not throttled); 72 KB tiles as 9\n"
         "# boxes of 64 x 64 bf16, page 64, L2 flushed; latency = completion - issue of one tile's loads, cycles\n",
         prop.name, sms, clock_khz / 1000);
  printf("%5s %4s %6s %7s %6s | %7s %7s %7s %7s | %6s | %8s %8s %8s\n", "ctas", "nbuf", "shared", "work", "tiles",
         "p10", "p50", "p90", "p99", "p50 us", "ms", "L2>SM", "distinct");
  printf("%5s %4s %6s %7s %6s | %7s %7s %7s %7s | %6s | %8s %8s %8s\n", "", "", "", "cycles", "", "", "", "", "",
         "", "", "GB/s", "GB/s");
  if (!sweep) {
    run(one, map, num_pages, flush, flush_bytes, clock_khz);
  } else {
    // unloaded (one SM), then the whole GPU: the wide kernel's pattern (two
    // buffers, shared tiles, ~3500 cycles of compute per tile) and around it
    const Config cs[] = {
        {1, 1, 0, 64, 0},        {1, 2, 0, 64, 0},        {2, 2, 1, 64, 3500},
        {sms, 2, 1, 248, 3500},  {sms, 2, 0, 248, 3500},  {sms, 2, 1, 248, 0},
        {sms, 3, 1, 248, 3500},  {sms, 2, 1, 248, 2200},  {sms, 2, 1, 248, 5000},
        {sms / 2, 2, 1, 248, 3500},
    };
    for (const Config &cf : cs)
      if (!(cf.shared && cf.ctas % 2)) run(cf, map, num_pages, flush, flush_bytes, clock_khz);
  }
  CK(cudaFree(kv));
  CK(cudaFree(flush));
  return 0;
}
