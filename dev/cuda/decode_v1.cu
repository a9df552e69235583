// v1: the simplest correct split-KV decode kernel. One CTA = one split-KV
// part x one 64-row m-block; 8 warps; tiles of 64 keys loaded with cp.async
// (zero-filled past the piece, so NaN rows are never read) into padded
// shared memory; S = Q K^T and O += P V with mma.sync m16n8k16 bf16; the
// online softmax goes through shared memory. Any page size.
#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kLd = 584;   // padded row (elements): 1168 B = 292 words, 4 banks apart
constexpr int kLdS = 68;   // S row (floats)
constexpr int kLdP = 72;   // P row (elements)

struct Smem {
  __nv_bfloat16 q[64 * kLd];
  __nv_bfloat16 k[64 * kLd];
  float s[64 * kLdS];
  __nv_bfloat16 pm[64 * kLdP];
  float alpha[64], m[64], l[64];
  int lim[64];
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16 *p) {
  return *reinterpret_cast<const uint32_t *>(p);
}
__device__ __forceinline__ uint32_t pack2(const __nv_bfloat16 *lo, const __nv_bfloat16 *hi) {
  uint16_t a = *reinterpret_cast<const uint16_t *>(lo), b = *reinterpret_cast<const uint16_t *>(hi);
  return (uint32_t)a | ((uint32_t)b << 16);
}

__global__ void __launch_bounds__(kThreads, 1) decode_v1_kernel(const mla_decode_params p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem &sm = *reinterpret_cast<Smem *>(smem_raw);
  const int part = blockIdx.x, mb = blockIdx.y;
  const int *meta = p.sched_meta + part * SCHED_INTS;
  if (meta[SCHED_NUM_REQS] == 0) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const float sl2 = p.scale * kLog2e;
  const int H = p.num_heads, P = p.page_size;
  const uint8_t *kv = static_cast<const uint8_t *>(p.kv);

  for (int req = meta[SCHED_BEGIN_REQ]; req <= meta[SCHED_END_REQ]; req++) {
    const ReqWork w = req_work(p, meta, req, mb);
    if (w.rows == 0) continue;
    __syncthreads();  // the previous request is done with Q and the stats
    // Q rows of this m-block: row r = t * H + h; missing rows are zero.
    for (int c = tid; c < 64 * 72; c += kThreads) {
      const int r = c / 72, ch = c % 72;
      const bool ok = r < w.rows;
      const int rg = mb * 64 + r, t = ok ? rg / H : 0, h = ok ? rg % H : 0;
      const uint16_t *src = ch < 64 ? p.q_nope + (w.q0 + t) * p.q_nope_stride_token + h * p.q_nope_stride_head + ch * 8
                                    : p.q_rope + (w.q0 + t) * p.q_rope_stride_token + h * p.q_rope_stride_head + (ch - 64) * 8;
      cp_async_16(smem_u32(&sm.q[r * kLd + ch * 8]), ok ? (const void *)src : p.kv, ok);
    }
    cp_async_commit();
    if (tid < 64) {
      sm.m[tid] = -INFINITY;
      sm.l[tid] = 0.f;
      sm.lim[tid] = row_limit(p, w, mb, tid);
    }
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    for (int it = 0; it < w.n_tiles; it++) {
      const int kt0 = w.kstart + it * 64;
      for (int c = tid; c < 64 * 72; c += kThreads) {
        const int r = c / 72, ch = c % 72;
        const int key = kt0 + r;
        const bool ok = key < w.kend_blk;
        const uint8_t *src = kv;
        if (ok) {
          const int page = p.block_table[(size_t)req * p.block_table_width + key / P];
          src = kv + ((int64_t)page * P + key % P) * p.row_bytes + ch * 16;
        }
        cp_async_16(smem_u32(&sm.k[r * kLd + ch * 8]), src, ok);
      }
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();

      // S = Q K^T: warp owns rows 16*(warp&3).., keys 32*(warp>>2)..
      {
        const int rb = 16 * (warp & 3), nb = 32 * (warp >> 2);
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) s[n][e] = 0.f;
#pragma unroll 4
        for (int kb = 0; kb < 576; kb += 16) {
          const __nv_bfloat16 *qa = &sm.q[(rb + g) * kLd + kb + 2 * q4];
          uint32_t a0 = ld32(qa), a1 = ld32(qa + 8 * kLd), a2 = ld32(qa + 8), a3 = ld32(qa + 8 * kLd + 8);
#pragma unroll
          for (int n = 0; n < 4; n++) {
            const __nv_bfloat16 *kb_ = &sm.k[(nb + 8 * n + g) * kLd + kb + 2 * q4];
            mma_bf16(s[n], a0, a1, a2, a3, ld32(kb_), ld32(kb_ + 8));
          }
        }
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int r = rb + g + 8 * (e >> 1), col = nb + 8 * n + 2 * q4 + (e & 1);
            const int key = kt0 + col;
            sm.s[r * kLdS + col] = key < sm.lim[r] ? s[n][e] * sl2 : -INFINITY;
          }
      }
      __syncthreads();

      // Online softmax: 4 threads per row, 16 keys each.
      {
        const int r = tid >> 2, qq = tid & 3;
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 16; j++) mx = fmaxf(mx, sm.s[r * kLdS + qq * 16 + j]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_old = sm.m[r];
        const float m_new = fmaxf(m_old, mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
          const float e = exp2f(sm.s[r * kLdS + qq * 16 + j] - m_use);
          sum += e;
          sm.pm[r * kLdP + qq * 16 + j] = __float2bfloat16_rn(e);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        __syncwarp();
        if (qq == 0) {
          const float a = exp2f(m_old - m_use);
          sm.alpha[r] = a;
          sm.l[r] = sm.l[r] * a + sum;
          sm.m[r] = m_new;
        }
      }
      __syncthreads();

      // O = alpha O + P V: warp owns output columns 64*warp.. for all 64 rows.
      {
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const float a0 = sm.alpha[16 * i + g], a1 = sm.alpha[16 * i + g + 8];
#pragma unroll
          for (int j = 0; j < 8; j++) {
            acc[i][j][0] *= a0;
            acc[i][j][1] *= a0;
            acc[i][j][2] *= a1;
            acc[i][j][3] *= a1;
          }
        }
        const int cb = 64 * warp;
#pragma unroll
        for (int kb = 0; kb < 64; kb += 16) {
          uint32_t a[4][4];
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const __nv_bfloat16 *pa = &sm.pm[(16 * i + g) * kLdP + kb + 2 * q4];
            a[i][0] = ld32(pa);
            a[i][1] = ld32(pa + 8 * kLdP);
            a[i][2] = ld32(pa + 8);
            a[i][3] = ld32(pa + 8 * kLdP + 8);
          }
#pragma unroll
          for (int j = 0; j < 8; j++) {
            const __nv_bfloat16 *vb = &sm.k[(kb + 2 * q4) * kLd + cb + 8 * j + g];
            const uint32_t b0 = pack2(vb, vb + kLd), b1 = pack2(vb + 8 * kLd, vb + 9 * kLd);
#pragma unroll
            for (int i = 0; i < 4; i++) mma_bf16(acc[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b0, b1);
          }
        }
      }
      __syncthreads();  // K and P are reused by the next tile
    }
    cp_async_wait_all();  // Q of a request with no tiles
    __syncthreads();

    // Epilogue: normalise and write (final output or the piece's partial).
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int r = 16 * i + g + 8 * hh;
        if (r >= w.rows) continue;
        const float l = sm.l[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++)
          store_out_pair(p, w, mb, r, 64 * warp + 8 * j + 2 * q4, acc[i][j][2 * hh], acc[i][j][2 * hh + 1], inv);
      }
    if (tid < w.rows) {
      const float l = sm.l[tid];
      store_lse(p, w, mb, tid, l > 0.f ? sm.m[tid] + log2f(l) : -INFINITY);
    }
  }
}

}  // namespace

cudaError_t decode_v1_launch(const mla_decode_params *p, cudaStream_t stream) {
  const size_t smem = sizeof(Smem);
  static bool attr_set = false;  // once: keeps host work out of timed launches
  if (!attr_set) {
    DEV_CUDA_OK(cudaFuncSetAttribute(decode_v1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attr_set = true;
  }
  dim3 grid(p->num_sm_parts, mla_decode_m_blocks(p));
  decode_v1_kernel<<<grid, kThreads, smem, stream>>>(*p);
  DEV_CUDA_OK(cudaGetLastError());
  return decode_combine_launch(p, stream);
}
