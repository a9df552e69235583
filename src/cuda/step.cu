// Device-built step metadata (mla_step_prepare on a CUDA context): block
// table and kv lengths from req_to_token, then the split schedule (every
// part and request computed in parallel from cost prefix sums). The
// arithmetic is src/plan/step_build.h's, shared with the CPU path and with
// mla_plan_build, so the three agree by construction (tests/test_step.c and
// tests/test_cuda_step.c check it anyway).
#include <cuda_runtime.h>

#include "step.h"

namespace {

constexpr int kRowThreads = 128;

// One block per row: every thread takes block-table entries j, j + 128, ...
// The row is valid only if all its page ids are (__syncthreads_or).
__global__ void __launch_bounds__(kRowThreads)
    step_rows_kernel(const mla_step_geom g, const int32_t *__restrict__ req_to_token,
                     const int32_t *__restrict__ req_ids, const int32_t *__restrict__ seq_lens,
                     int32_t *__restrict__ qo_indptr, int32_t *__restrict__ kv_lens,
                     int32_t *__restrict__ block_table, int *bad) {
  const int i = blockIdx.x;
  const int32_t rid = req_ids[i];
  const int32_t kv = mla_step_row_kv(&g, rid, seq_lens[i]);
  int row_bad = kv < 0;
  int32_t *bt = block_table + (int64_t)i * g.width;
  for (int j = threadIdx.x; j < g.width; j += kRowThreads) {
    int32_t e = kv < 0 ? MLA_BLOCK_TABLE_PAD : mla_step_page(&g, req_to_token, rid, kv, j);
    if (e == -2) {
      row_bad = 1;
      e = MLA_BLOCK_TABLE_PAD;
    }
    bt[j] = e;
  }
  row_bad = __syncthreads_or(row_bad);
  if (threadIdx.x == 0) {
    kv_lens[i] = row_bad ? 0 : kv;
    qo_indptr[i + 1] = (i + 1) * g.q_len;
    if (i == 0) qo_indptr[0] = 0;
    if (row_bad) atomicAdd(bad, 1);
  }
}

constexpr int kSchedThreads = 256;

// Exclusive scan of one value per thread over the block; *total gets the
// sum. warp_sums: [32] shared scratch.
template <typename T>
__device__ T block_exclusive_scan(T v, T *warp_sums, T *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    T w = lane < nwarps ? warp_sums[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const T pre = warp > 0 ? warp_sums[warp - 1] : T(0);
  *total = warp_sums[nwarps - 1];
  __syncthreads();  // warp_sums is reused by the next scan
  return pre + x - v;
}

// Request r holding cost position s: C[r] <= s < C[r+1], or bs past the end.
__device__ int locate(const int64_t *C, int bs, int64_t s) {
  int lo = 0, hi = bs;  // answer in [0, bs]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (C[mid + 1] <= s) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The split schedule in closed form (src/plan/step_build.h): cost prefix
// sums by a block scan, then one thread per part (two binary searches) and
// one per request (its piece count), the split counts by a second scan.
__global__ void __launch_bounds__(kSchedThreads)
    step_schedule_kernel(const mla_step_geom g, const int32_t *__restrict__ kv_lens,
                         int32_t *__restrict__ sched_meta, int32_t *__restrict__ num_splits) {
  extern __shared__ int64_t C[];  // [bs + 1]
  __shared__ int64_t sums64[32];
  __shared__ int32_t sums32[32];
  const int bs = g.batch_size, nt = blockDim.x, t = threadIdx.x;
  const int per = (bs + nt - 1) / nt, i0 = t * per, i1 = min(bs, i0 + per);
  int64_t local = 0;
  for (int i = i0; i < i1; i++) local += mla_sb_cdiv(kv_lens[i], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD;
  int64_t total;
  int64_t run = block_exclusive_scan<int64_t>(local, sums64, &total);
  for (int i = i0; i < i1; i++) {
    C[i] = run;
    run += mla_sb_cdiv(kv_lens[i], MLA_SCHED_BLOCK) + MLA_SCHED_FIXED_OVERHEAD;
  }
  if (t == 0) C[bs] = total;
  __syncthreads();
  const int parts = g.num_parts;
  const int64_t qc = total > 0 ? mla_sb_cdiv(total, parts) : 1;
  for (int p = t; p < parts; p += nt) {
    const int64_t sa = (int64_t)p * qc < total ? (int64_t)p * qc : total;
    const int64_t sb = p + 1 < parts && (int64_t)(p + 1) * qc < total ? (int64_t)(p + 1) * qc : total;
    const int ra = locate(C, bs, sa), rb = locate(C, bs, sb);
    const mla_sched_pos a = mla_sched_pos_at(sa, ra, C[ra], bs), b = mla_sched_pos_at(sb, rb, C[rb], bs);
    int32_t m[MLA_SCHED_META_INTS];
    mla_sched_write_part(a, b, kv_lens, bs, qc, p, m);
#pragma unroll
    for (int j = 0; j < MLA_SCHED_META_INTS; j++) sched_meta[(int64_t)p * MLA_SCHED_META_INTS + j] = m[j];
  }
  int32_t mine = 0;
  for (int i = i0; i < i1; i++) mine += mla_sched_pieces(C[i], C[i + 1], qc, parts);
  int32_t all;
  int32_t acc = block_exclusive_scan<int32_t>(mine, sums32, &all);
  for (int i = i0; i < i1; i++) {
    num_splits[i] = acc;
    acc += mla_sched_pieces(C[i], C[i + 1], qc, parts);
  }
  if (t == 0) num_splits[bs] = all;
}

size_t schedule_smem(const mla_step_geom *g) { return sizeof(int64_t) * ((size_t)g->batch_size + 1); }

}  // namespace

extern "C" int mla_cuda_step_build(const mla_step_geom *g, const int32_t *req_to_token, const int32_t *req_ids,
                                   const int32_t *seq_lens, int32_t *qo_indptr, int32_t *kv_lens,
                                   int32_t *block_table, int32_t *sched_meta, int32_t *num_splits, int *bad,
                                   void *stream_) {
  cudaStream_t stream = (cudaStream_t)stream_;
  if (g->batch_size < 1 || g->batch_size > MLA_CUDA_STEP_MAX_BS) return (int)cudaErrorInvalidValue;
  step_rows_kernel<<<g->batch_size, kRowThreads, 0, stream>>>(*g, req_to_token, req_ids, seq_lens, qo_indptr,
                                                             kv_lens, block_table, bad);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return (int)e;
  const size_t smem = schedule_smem(g);
  if (smem > 48 * 1024) {
    e = cudaFuncSetAttribute(step_schedule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  step_schedule_kernel<<<1, kSchedThreads, smem, stream>>>(*g, kv_lens, sched_meta, num_splits);
  return (int)cudaGetLastError();
}
