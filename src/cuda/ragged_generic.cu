// Ragged MHA for the shapes the sm_90a kernels (prefill_sm90.cu) do not take:
// any qk_dim / v_dim up to MLA_MAX_HEAD_DIM (256), f32 activations, and any
// number of requests. Correct first, not fast: plain CUDA, one warp per
// (query row, head), keys 32 at a time (each lane one key's dot product),
// online softmax in the log2 domain, each lane owning the output dims
// lane, lane + 32, ... Same contract as the fast kernel (mla_prefill_params):
// the index arrays stay on the device, requests with negative lengths (or
// indptr[0] != 0) are skipped and counted into *bad, causal is bottom-right,
// rows that see no key get o = 0 and lse = -inf (the CPU backend's rule).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "mla.h"
#include "prefill.h"

namespace {

#include "ragged_common.cuh"

constexpr int kWarps = 8;                      // warps per block
constexpr int kMaxD = MLA_MAX_HEAD_DIM;        // 256
constexpr int kPerLane = kMaxD / 32;           // output dims per lane

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

// One warp per (request, query row, head), the rows of all requests taken in
// turn by the grid's warps (global row index G = rows of earlier requests +
// row, warp w takes G = w mod W): every warp walks the index arrays once, so
// no binary search over possibly bad indices is needed.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 2) ragged_generic_kernel(const mla_prefill_params p, int out_dtype) {
  __shared__ float sq[kWarps][kMaxD];  // this warp's query row (fp32, times scale / cap and log2 e as used)
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int64_t W = (int64_t)gridDim.x * kWarps, w = (int64_t)blockIdx.x * kWarps + wib;
  const int bs = p.batch_size, H = p.num_heads, Hkv = p.num_kv_heads, dqk = p.qk_dim, dv = p.v_dim;
  const int grp = H / Hkv;
  const T *q = static_cast<const T *>(p.q);
  const T *k = static_cast<const T *>(p.k);
  const T *v = static_cast<const T *>(p.v);
  const bool bad0 = p.qo_indptr[0] != 0 || p.kv_indptr[0] != 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) count_skipped_requests(p);
  if (bad0) return;
  // Scores in the log2 domain: x = scale q.k log2 e, or with softcap
  // x = cap log2 e tanh(scale q.k / cap).
  const bool cap = p.softcap > 0.0f;
  const float qmul = cap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap2 = p.softcap * kLog2e;
  const bool vec = (dqk * (int)sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(p.k) & 15) == 0;
  int64_t base = 0;  // global row index of the request's first row
  for (int i = 0; i < bs; i++) {
    const int q0 = p.qo_indptr[i], k0 = p.kv_indptr[i];
    const int ql = p.qo_indptr[i + 1] - q0, kl = p.kv_indptr[i + 1] - k0;
    if (ql < 0 || kl < 0) continue;  // skipped (counted above)
    const int64_t rows = (int64_t)ql * H;
    int64_t r = ((w - base) % W + W) % W;  // this warp's first row of the request
    base += rows;
    for (; r < rows; r += W) {
      const int qi = (int)(r / H), h = (int)(r % H), hk = h / grp;
      const int64_t t = (int64_t)q0 + qi;
      const int lim = p.causal ? kl - ql + qi : kl - 1;  // last key this row sees
      const int nk = min(lim + 1, kl);
      __syncwarp();
      for (int d = lane; d < dqk; d += 32) sq[wib][d] = to_f(q[(t * H + h) * dqk + d]) * qmul;
      __syncwarp();
      float m = -INFINITY, l = 0.f, o[kPerLane];
#pragma unroll
      for (int c = 0; c < kPerLane; c++) o[c] = 0.f;
      for (int j0 = 0; j0 < nk; j0 += 32) {
        const int j = j0 + lane;
        float x = -INFINITY;
        if (j < nk) {
          const T *kr = k + ((int64_t)(k0 + j) * Hkv + hk) * dqk;
          float s = 0.f;
          if (vec) {  // 16-byte loads (k is 16-byte aligned and a row is a multiple of 16 bytes)
            constexpr int kE = 16 / sizeof(T);
            for (int d = 0; d < dqk; d += kE) {
              const uint4 u = *reinterpret_cast<const uint4 *>(kr + d);
              const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
              for (int x4 = 0; x4 < kE; x4++) s = fmaf(sq[wib][d + x4], to_f(e[x4]), s);
            }
          } else {
            for (int d = 0; d < dqk; d++) s = fmaf(sq[wib][d], to_f(kr[d]), s);
          }
          x = cap ? cap2 * tanhf(s) : s;
        }
        float bm = x;
#pragma unroll
        for (int off = 16; off; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, off));
        const float mn = fmaxf(m, bm);  // finite: key j0 is visible
        const float alpha = exp2f(m - mn);  // 0 on the first block (m = -inf)
        const float pj = j < nk ? exp2f(x - mn) : 0.f;
        float ps = pj;
#pragma unroll
        for (int off = 16; off; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
        l = l * alpha + ps;
        m = mn;
#pragma unroll
        for (int c = 0; c < kPerLane; c++) o[c] *= alpha;
        const int nj = min(32, nk - j0);
        for (int jj = 0; jj < nj; jj++) {
          const float pw = __shfl_sync(0xffffffffu, pj, jj);
          const T *vr = v + ((int64_t)(k0 + j0 + jj) * Hkv + hk) * dv;
#pragma unroll
          for (int c = 0; c < kPerLane; c++) {
            const int d = lane + 32 * c;
            if (d < dv) o[c] = fmaf(pw, to_f(vr[d]), o[c]);
          }
        }
      }
      const float inv = nk > 0 ? 1.0f / l : 0.f;
#pragma unroll
      for (int c = 0; c < kPerLane; c++) {
        const int d = lane + 32 * c;
        if (d < dv) store_act(p.out, (t * H + h) * dv + d, out_dtype, nk > 0 ? o[c] * inv : 0.f);
      }
      if (p.lse && lane == 0) {
        const float lse2 = nk > 0 ? m + log2f(l) : -INFINITY;
        p.lse[t * H + h] = p.lse_base2 ? lse2 : lse2 * kLn2;
      }
    }
  }
}

}  // namespace

extern "C" int mla_cuda_prefill_generic_launch(const mla_prefill_params *p, int sm_count, void *stream_) {
  cudaStream_t stream = (cudaStream_t)stream_;
  if (p->batch_size <= 0) return (int)cudaSuccess;
  if (p->qk_dim < 1 || p->qk_dim > kMaxD || p->v_dim < 1 || p->v_dim > kMaxD || p->num_kv_heads < 1 ||
      p->num_heads % p->num_kv_heads != 0)
    return (int)cudaErrorInvalidValue;
  const int out_dtype = p->out_f32 ? MLA_DTYPE_F32 : p->act_dtype;
  const int blocks = (sm_count > 0 ? sm_count : 132) * 2;  // resident at once: 2 per SM (launch bounds)
  if (p->act_dtype == MLA_DTYPE_F32)
    ragged_generic_kernel<float><<<blocks, kWarps * 32, 0, stream>>>(*p, out_dtype);
  else if (p->act_dtype == MLA_DTYPE_BF16)
    ragged_generic_kernel<__nv_bfloat16><<<blocks, kWarps * 32, 0, stream>>>(*p, out_dtype);
  else if (p->act_dtype == MLA_DTYPE_F16)
    ragged_generic_kernel<__half><<<blocks, kWarps * 32, 0, stream>>>(*p, out_dtype);
  else
    return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}
