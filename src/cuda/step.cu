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
// one stopped); one thread runs it over lengths staged in shared memory,
// which is what keeps it at a few microseconds for a few hundred rows.
__global__ void __launch_bounds__(256)
    step_schedule_kernel(const mla_step_geom g, const int32_t *__restrict__ kv_lens,
                         int32_t *__restrict__ sched_meta, int32_t *__restrict__ num_splits, int *bad) {
  extern __shared__ int32_t lens[];
  for (int i = threadIdx.x; i < g.batch_size; i += blockDim.x) lens[i] = kv_lens[i];
  __syncthreads();
  if (threadIdx.x == 0 && mla_split_schedule_body(lens, g.batch_size, g.num_parts, sched_meta, num_splits) != 0)
    atomicAdd(bad, 1);  // cannot happen for bs >= 1; counted rather than hidden
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
  step_schedule_kernel<<<1, 256, sizeof(int32_t) * g->batch_size, stream>>>(*g, kv_lens, sched_meta, num_splits,
                                                                           bad);
  return (int)cudaGetLastError();
}
