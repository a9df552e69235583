// Device-built step metadata (mla_step_prepare on a CUDA context): block
// table and kv lengths from req_to_token, then the split schedule. The
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

// The schedule is a sequential walk (each part starts where the previous
// one stopped); one thread runs it entirely in shared memory (lengths in,
// schedule and split counts out: no global access and no aliasing between
// them on the serial path), then the block copies the results out.
__global__ void __launch_bounds__(256)
    step_schedule_kernel(const mla_step_geom g, const int32_t *__restrict__ kv_lens,
                         int32_t *__restrict__ sched_meta, int32_t *__restrict__ num_splits, int *bad) {
  extern __shared__ int32_t smem[];
  const int bs = g.batch_size, nm = g.num_parts * MLA_SCHED_META_INTS;
  int32_t *lens = smem, *splits = smem + bs, *meta = splits + bs + 1;
  for (int i = threadIdx.x; i < bs; i += blockDim.x) lens[i] = kv_lens[i];
  __syncthreads();
  __shared__ int ok;
  if (threadIdx.x == 0) ok = mla_split_schedule_body(lens, bs, g.num_parts, meta, splits) == 0;
  __syncthreads();
  for (int i = threadIdx.x; i <= bs; i += blockDim.x) num_splits[i] = splits[i];
  for (int i = threadIdx.x; i < nm; i += blockDim.x) sched_meta[i] = meta[i];
  if (threadIdx.x == 0 && !ok) atomicAdd(bad, 1);  // cannot happen for bs >= 1; counted rather than hidden
}

size_t schedule_smem(const mla_step_geom *g) {
  return sizeof(int32_t) * ((size_t)g->batch_size * 2 + 1 + (size_t)g->num_parts * MLA_SCHED_META_INTS);
}

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
  step_schedule_kernel<<<1, 256, smem, stream>>>(*g, kv_lens, sched_meta, num_splits, bad);
  return (int)cudaGetLastError();
}
