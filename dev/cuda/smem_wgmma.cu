// Is the wide decode kernel's pair bound by shared-memory bandwidth?
// (docs/decode-kernel.md §7, session 20 status: the 64-row seesaw moves ~576 KB
// through shared memory per pair of tiles, ~4500 cycles at 128 B/cycle, more
// than its 4352 tensor cycles; and its P.V ran at ~70 % of the tensor rate while
// a tile landed beside them.) Written in session 20 without device time: not
// yet run.
//
// One CTA per SM (or --ctas N; 288 threads), NWG consumer warpgroups (1 or 2) each looping
// over one of the kernel's GEMM patterns on garbage data (only the timing
// matters; the operands sit where the kernel puts them, 1024-aligned, 128B
// swizzle), plus an optional streaming warp that keeps --depth bulk copies of
// --chunk bytes in flight from global memory into a separate 64 KB region of
// shared memory (cp.async.bulk, as TMA writes land in the kernel), optionally
// --gap cycles apart. Reported: cycles per wgmma of each pattern (median over
// CTAs of the per-CTA mean) against its tensor-rate ideal, and the stream's
// bytes per cycle per SM.
//
// Patterns (--op): qk_ss  m64n64k16, A (Q, K-major) and B (K, K-major) from
//                         shared memory: 4 KB per 32 tensor cycles = 128 B/cycle
//                  pv_ss  m64n256k16, A (P) K-major, B (V) MN-major: 10 KB / 128
//                  qk_rs, pv_rs (A from registers: 2 KB / 32, 8 KB / 128) are
//                  written but ptxas serializes them (C7512: at 288 threads it
//                  caps registers at 168); they need the library kernels'
//                  setmaxnreg split first, so the default sweep leaves them out.
//
//   build: make -C dev/cuda build/smem_wgmma   (here or on the device)
//   run:   dev/cuda/build/smem_wgmma            (the default sweep: qk_ss and pv_ss, 1 and 2
//                                                warpgroups, without and with the stream)
//          dev/cuda/build/smem_wgmma --op qk_ss --wgs 2 --stream 1 --chunk 8192 --depth 4
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "common.cuh"
#include "wgmma_ops.cuh"

enum { OP_QK_SS = 0, OP_QK_RS = 1, OP_PV_SS = 2, OP_PV_RS = 3 };
static const char *kOpName[4] = {"qk_ss", "qk_rs", "pv_ss", "pv_rs"};
static const double kIdeal[4] = {32.0, 32.0, 128.0, 128.0};  // tensor cycles per wgmma at 4096 FLOP/cycle/SM

constexpr uint32_t kOffQ = 0;                  // 64 KB: the Q latent (8 chunks of 64 rows x 128 B)
constexpr uint32_t kOffK = 65536;              // 72 KB: one K tile (9 chunks)
constexpr uint32_t kOffP = kOffK + 73728;      // 8 KB: a P tile
constexpr uint32_t kOffS = kOffP + 8192;       // 64 KB: the stream's landing region
constexpr uint32_t kOffBar = kOffS + 65536;    // the stream's mbarriers (8)
constexpr uint32_t kSmem = kOffBar + 64 + 1024;

struct Args {
  int op, wgs, iters, stream, chunk, depth, gap;
};

__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// One group of the pattern: qk: 32 wgmmas (8 chunks x 4 k-steps, the kernel's
// latent part of a 64-key tile); pv: 4 (64 keys of one 256-wide half).
template <int OP, int NS, int NO>
__device__ __forceinline__ void group(float (&s)[NS], float (&o)[NO], uint32_t sb, const uint32_t (&a)[4]) {
  wgmma_fence();
  if constexpr (OP == OP_QK_SS || OP == OP_QK_RS) {
    const uint64_t dq = desc_sw128(sb + kOffQ, 16, 1024), dk = desc_sw128(sb + kOffK, 16, 1024);
#pragma unroll
    for (int c = 0; c < 8; c++)
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t off = (c * 8192 + k * 32) >> 4;
        if constexpr (OP == OP_QK_SS) wgmma_m64n64k16_ss(s, dq + off, dk + off, 1);
        else wgmma_m64n64k16_rs(s, a, dk + off, 1);
      }
  } else {
    const uint64_t dp = desc_sw128(sb + kOffP, 16, 1024), dv = desc_sw128(sb + kOffK, 8192, 1024);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      if constexpr (OP == OP_PV_SS) wgmma_m64n256k16_ss_tb(o, dp + ((k * 32) >> 4), dv + ((k * 2048) >> 4), 1);
      else wgmma_m64n256k16_rs_tb(o, a, dv + ((k * 2048) >> 4), 1);
    }
  }
  wgmma_commit();
}

// cyc[cta * 2 + wg]: the warpgroup's cycles for `iters` groups; sbytes[cta],
// scyc[cta]: what the stream moved and over how many cycles; sink: keeps the
// accumulators alive.
template <int OP>
__global__ void __launch_bounds__(288, 1)
    smem_wgmma(Args a, const uint8_t *src, int64_t src_bytes, long long *cyc, long long *sbytes, long long *scyc,
               float *sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sb = smem_u32(smem);
  const int tid = threadIdx.x, wg = tid >> 7, cta = blockIdx.x;
  volatile int *stop = reinterpret_cast<volatile int *>(smem + kOffBar + 48);
  if (tid == 0) {
    for (int i = 0; i < 4; i++) mbar_init(sb + kOffBar + 8 * i, 1);
    *stop = 0;
    fence_mbar_init();
  }
  __syncthreads();
  if (wg < a.wgs) {
    // only the pattern's own accumulator is live (the other is a dummy the
    // compiler drops), so ptxas has the registers to keep the wgmmas async
    constexpr bool kQk = OP == OP_QK_SS || OP == OP_QK_RS;
    float s[kQk ? 32 : 1], o[kQk ? 1 : 128];
#pragma unroll
    for (int i = 0; i < (kQk ? 32 : 128); i++) (kQk ? s[i] : o[i]) = 0.f;
    const uint32_t ra[4] = {0x3c003c00u ^ (uint32_t)tid, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    group<OP>(s, o, sb, ra);  // warm-up
    wgmma_wait<0>();
    // kG groups back to back, then a full wait: nothing in flight across the
    // loop's back edge (otherwise ptxas serializes the register-operand
    // variants, C7511/C7512); the drain costs one wgmma latency per kG groups
    constexpr int kG = kQk ? 4 : 16;
    const long long t0 = clock64();
    for (int it = 0; it < a.iters; it++) {
#pragma unroll
      for (int g = 0; g < kG; g++) group<OP>(s, o, sb, ra);
      wgmma_wait<0>();
    }
    reg_fence(s);
    reg_fence(o);
    const long long t1 = clock64();
    if ((tid & 127) == 0) cyc[cta * 2 + wg] = t1 - t0;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < (kQk ? 32 : 128); i++) acc += kQk ? s[i] : o[i];
    sink[cta * 288 + tid] = acc;
    named_bar_sync(1, 128 * a.wgs);
    if (tid == 0) *stop = 1;
  } else if (tid == 256 && a.stream) {
    // keep `depth` copies in flight until the consumers are done
    const int64_t nchunks = src_bytes / a.chunk;
    const int slots = 65536 / a.chunk;
    long long moved = 0;
    uint32_t ph[4] = {0, 0, 0, 0};
    int64_t next = (int64_t)cta * 977;
    const long long t0 = clock64();
    for (int d = 0; d < a.depth; d++) {
      mbar_expect_tx(sb + kOffBar + 8 * d, (uint32_t)a.chunk);
      bulk_g2s(sb + kOffS + (uint32_t)((d % slots) * a.chunk), src + (next++ % nchunks) * a.chunk, a.chunk,
               sb + kOffBar + 8 * d);
    }
    int n = 0;
    while (!*stop) {
      const int d = n % a.depth;
      mbar_wait(sb + kOffBar + 8 * d, ph[d]);
      ph[d] ^= 1;
      moved += a.chunk;
      if (a.gap) {
        const long long w = clock64();
        while (clock64() - w < a.gap) {
        }
      }
      mbar_expect_tx(sb + kOffBar + 8 * d, (uint32_t)a.chunk);
      bulk_g2s(sb + kOffS + (uint32_t)(((n + a.depth) % slots) * a.chunk), src + (next++ % nchunks) * a.chunk, a.chunk,
               sb + kOffBar + 8 * d);
      n++;
    }
    for (int d = 0; d < a.depth; d++) {  // drain (so the CTA exits with nothing in flight)
      const int dd = (n + d) % a.depth;
      mbar_wait(sb + kOffBar + 8 * dd, ph[dd]);
      ph[dd] ^= 1;
    }
    sbytes[cta] = moved;
    scyc[cta] = clock64() - t0;
  }
}

template <int OP>
static void launch(const Args &a, int ctas, const uint8_t *src, int64_t sbytes_total, long long *cyc,
                   long long *sby, long long *scy, float *sink) {
  CK(cudaFuncSetAttribute(smem_wgmma<OP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem));
  smem_wgmma<OP><<<ctas, 288, kSmem>>>(a, src, sbytes_total, cyc, sby, scy, sink);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
}

static void run(Args a, int ctas, const uint8_t *src, int64_t src_bytes, long long *d_cyc, long long *d_sby,
                long long *d_scy, float *sink) {
  CK(cudaMemset(d_cyc, 0, sizeof(long long) * 2 * ctas));
  CK(cudaMemset(d_sby, 0, sizeof(long long) * ctas));
  CK(cudaMemset(d_scy, 0, sizeof(long long) * ctas));
  switch (a.op) {
    case OP_QK_SS: launch<OP_QK_SS>(a, ctas, src, src_bytes, d_cyc, d_sby, d_scy, sink); break;
    case OP_QK_RS: launch<OP_QK_RS>(a, ctas, src, src_bytes, d_cyc, d_sby, d_scy, sink); break;
    case OP_PV_SS: launch<OP_PV_SS>(a, ctas, src, src_bytes, d_cyc, d_sby, d_scy, sink); break;
    default: launch<OP_PV_RS>(a, ctas, src, src_bytes, d_cyc, d_sby, d_scy, sink); break;
  }
  std::vector<long long> cyc(2 * ctas), sby(ctas), scy(ctas);
  CK(cudaMemcpy(cyc.data(), d_cyc, sizeof(long long) * 2 * ctas, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sby.data(), d_sby, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(scy.data(), d_scy, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
  const int per = (a.op <= OP_QK_RS ? 32 * 4 : 4 * 16) * a.iters;  // wgmmas per warpgroup (kG groups an iteration)
  std::vector<double> c, r;
  for (int i = 0; i < ctas; i++) {
    double m = 0;
    for (int g = 0; g < a.wgs; g++) m += (double)cyc[2 * i + g] / per;
    c.push_back(m / a.wgs);
    if (a.stream && scy[i] > 0) r.push_back((double)sby[i] / (double)scy[i]);
  }
  std::sort(c.begin(), c.end());
  std::sort(r.begin(), r.end());
  // with 2 warpgroups sharing the tensor pipe, the ideal per warpgroup's wgmma doubles
  printf("%-6s wgs %d ctas %3d stream %d chunk %6d depth %d gap %5d | cycles/wgmma p50 %7.1f (ideal %5.1f, %3.0f %%) | "
         "stream %6.1f B/cycle/SM\n",
         kOpName[a.op], a.wgs, ctas, a.stream, a.chunk, a.depth, a.gap, c[c.size() / 2], kIdeal[a.op] * a.wgs,
         100.0 * kIdeal[a.op] * a.wgs / c[c.size() / 2], r.empty() ? 0.0 : r[r.size() / 2]);
}

int main(int argc, char **argv) {
  Args a = {-1, 0, 500, -1, 8192, 4, 0};
  int ctas = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--op")) {
      for (int k = 0; k < 4; k++)
        if (!strcmp(argv[i + 1], kOpName[k])) a.op = k;
    } else if (!strcmp(argv[i], "--wgs")) a.wgs = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters")) a.iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--stream")) a.stream = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--chunk")) a.chunk = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--depth")) a.depth = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--gap")) a.gap = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--ctas")) ctas = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "smem_wgmma: unknown argument %s (see the header)\n", argv[i]);
      return 2;
    }
  }
  if (a.chunk < 1024 || a.chunk > 65536 || 65536 % a.chunk || a.depth < 1 || a.depth > 4) {
    fprintf(stderr, "smem_wgmma: --chunk must divide 65536 (>= 1024), --depth 1..4\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (ctas <= 0) ctas = sms;
  const int64_t src_bytes = (int64_t)1 << 30;  // 1 GiB: the stream reads mostly from DRAM, as the kernel's refills
  uint8_t *src;
  long long *d_cyc, *d_sby, *d_scy;
  float *sink;
  CK(cudaMalloc(&src, src_bytes));
  CK(cudaMemset(src, 0, src_bytes));
  CK(cudaMalloc(&d_cyc, sizeof(long long) * 2 * ctas));
  CK(cudaMalloc(&d_sby, sizeof(long long) * ctas));
  CK(cudaMalloc(&d_scy, sizeof(long long) * ctas));
  CK(cudaMalloc(&sink, sizeof(float) * 288 * ctas));
  const int sweep[2] = {OP_QK_SS, OP_PV_SS};
  for (int oi = 0; oi < (a.op >= 0 ? 1 : 2); oi++) {
    const int op = a.op >= 0 ? a.op : sweep[oi];
    for (int w = a.wgs ? a.wgs : 1; w <= (a.wgs ? a.wgs : 2); w++)
      for (int st = a.stream >= 0 ? a.stream : 0; st <= (a.stream >= 0 ? a.stream : 1); st++) {
        Args b = a;
        b.op = op;
        b.wgs = w;
        b.stream = st;
        run(b, ctas, src, src_bytes, d_cyc, d_sby, d_scy, sink);
      }
  }
  return 0;
}
