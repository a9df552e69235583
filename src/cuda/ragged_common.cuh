// Device pieces shared by the two ragged MHA kernels (prefill_sm90.cu, the
// sm_90a fast paths and the merge; ragged_generic.cu, the generic path):
// constants, activation loads / stores by runtime dtype, and the count of the
// requests a launch skips. CUDA only; included inside their anonymous
// namespaces.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mla.h"
#include "prefill.h"

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float load_act(const void *p, int64_t i, int dt) {
  if (dt == MLA_DTYPE_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
  if (dt == MLA_DTYPE_F16) return __half2float(((const __half *)p)[i]);
  return ((const float *)p)[i];
}
__device__ __forceinline__ void store_act(void *p, int64_t i, int dt, float v) {
  if (dt == MLA_DTYPE_BF16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
  else if (dt == MLA_DTYPE_F16) ((__half *)p)[i] = __float2half_rn(v);
  else ((float *)p)[i] = v;
}

// The requests a launch skips: all of them when an index array does not
// start at 0 (counted as one), else those with a negative length. One thread
// of the grid adds them to *p.bad (mla_ctx_synchronize reports OUT_OF_RANGE).
__device__ __forceinline__ void count_skipped_requests(const mla_prefill_params &p) {
  int nbad = p.qo_indptr[0] != 0 || p.kv_indptr[0] != 0;
  if (!nbad)
    for (int i = 0; i < p.batch_size; i++)
      nbad += p.qo_indptr[i + 1] < p.qo_indptr[i] || p.kv_indptr[i + 1] < p.kv_indptr[i];
  if (nbad) atomicAdd(p.bad, nbad);
}
