// Device-built step metadata (mla_step_prepare on a CUDA context): block
// table and kv lengths from req_to_token, then the split schedule (the host
// greedy walk, rebuilt in parallel from cost prefix sums). The
// arithmetic is src/plan/step_build.h's, shared with the CPU path and with
// mla_plan_build, so the three agree by construction (tests/test_step.c and
// tests/test_cuda_step.c check it anyway).
#include <cuda_runtime.h>
#include <pthread.h>

#include "step.h"

namespace {

constexpr int kRowThreads = 128;

// One block per row: every thread takes block-table entries j, j + 128, ...
// The row is valid only if all its page ids are (__syncthreads_or).
__global__ void __launch_bounds__(kRowThreads)
    step_rows_kernel(const mla_step_geom g, const int32_t *__restrict__ req_to_token,
                     const int32_t *__restrict__ req_ids, const int32_t *__restrict__ seq_lens,
                     const int32_t *__restrict__ extend_lens, int32_t *__restrict__ qo_indptr,
                     int32_t *__restrict__ kv_lens, int32_t *__restrict__ block_table, int *bad) {
  const int i = blockIdx.x;
  const int32_t rid = req_ids[i];
  const int32_t kv = mla_step_row_kv(&g, rid, seq_lens[i]);
  const int32_t q = kv < 0 ? -1 : mla_step_row_q(&g, g.varlen ? extend_lens[i] : 0, kv);
  int row_bad = kv < 0 || q < 0;
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
    // EXTEND: the row's query count, turned into the running sum by the schedule kernel
    qo_indptr[i + 1] = g.varlen ? (row_bad ? 0 : q) : (i + 1) * g.q_len;
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

// The split schedule of src/plan/step_build.h (the greedy walk mla_plan_build
// runs on the host), rebuilt in parallel. On the cost line (request i at
// [C_i, C_{i+1}), c_i = ceil(kv_i/64) + OV) a part that starts at request
// r's beginning has budget Q + OV (Q: the walk's q, below) and one that
// starts at a cut has Q, so from a beginning at C_r the walk visits
// y_j = C_r + OV + j*Q (j = 1, 2, ...): each y_j is a cut until one lands
// within the first OV units of a request t (y_j in [C_t, min(C_t + OV,
// C_{t+1} - 1)]), where the greedy closes at t's beginning instead. So:
//   1. per request r (in parallel): where the run from C_r lands (nb[r]) and
//      after how many parts (steps[r]);
//   2. one thread follows nb from request 0 (one hop per run, not per part);
//   3. per part and per request (in parallel): its range and piece counts
//      from the run it belongs to.
// Q is the host's (mla_sb_sched_q): the smallest that fits, by the same
// bisection, each trial answered by step 1 and a count of the parts and runs
// on the chain from request 0 by pointer jumping (log2(bs) parallel rounds
// instead of step 2's walk, one hop per run); then FlashMLA's q if the
// smaller one cuts the batch into more pieces (bs + parts - runs).
// tests/test_cuda_step.c checks the result equal to the host walk.

__device__ int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
__device__ int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// Step 1 at Q: for every request r, the request where the run from C_r
// closes (nb[r], bs: it runs to the end) and after how many parts (steps[r]).
// The visits y_j are followed request by request (y = the first one at or
// past the request's beginning): one step per request where cuts are dense
// (parts no longer than requests), a binary search to the request holding y
// where they are sparse, and a division only to cross a request holding many
// cuts. (Locating every y_j with a binary search and a 64-bit division made
// each trial of the bisection cost ~5 us at b = 128, s_k = 8192.)
// All threads; the caller syncs after.
__device__ void runs_at(const int64_t *C, int bs, int64_t total, int64_t OV, int64_t Q, int32_t *nb, int32_t *steps) {
  for (int r = threadIdx.x; r < bs; r += blockDim.x) {
    const int64_t base = C[r] + OV;
    int64_t y = base + Q;  // y_1
    int32_t land = bs;
    int q = r + 1;
    while (q < bs) {
      const int64_t cq = C[q], cn = C[q + 1];
      if (y >= cn) {  // no visit in q: on to the request that holds y
        q = locate(C, bs, y);
        continue;
      }
      if (y < cq) {  // the first visit at or past q's beginning
        const int64_t gap = cq - y;
        y += gap <= 2 * Q ? (gap <= Q ? Q : 2 * Q) : ceil_div(gap, Q) * Q;
      }
      if (y <= (cq + OV < cn - 1 ? cq + OV : cn - 1)) {  // within q's first units: the run closes at q's beginning
        land = q;
        break;
      }
      q++;
    }
    nb[r] = land;
    steps[r] = (int32_t)(land < bs ? (y - base) / Q : (ceil_div(total - base, Q) > 1 ? ceil_div(total - base, Q) : 1));
  }
}

// Step 1 of the cut-free walk (mla_sb_walk with nocut) at Q: every run is one
// part, holding requests [r, nb[r]) with C[nb[r]] - C[r] <= Q + OV (the
// caller has checked that every request fits alone: nb[r] > r).
__device__ void runs_nocut(const int64_t *C, int bs, int64_t OV, int64_t Q, int32_t *nb, int32_t *steps) {
  for (int r = threadIdx.x; r < bs; r += blockDim.x) {
    nb[r] = locate(C, bs, C[r] + Q + OV);
    steps[r] = 1;
  }
}

// Parts and runs on the chain from request 0 (what step 2's walk follows), by
// pointer jumping over step 1's nb / steps: after round k, nx[i] is the run
// 2^k hops after i and ct[i] the parts and hops on the way, packed as parts
// << 14 | hops. On the chain from 0 the parts stay < 2^17 (at most num_parts
// + (OV + 1) bs for any Q >= ceil(blocks / parts): the launcher refuses a
// step past it; the library's piece cost leaves room for 2^16 parts at the
// largest batch, asserted below) and the hops <= bs < 2^14;
// off it the sums may wrap (unsigned, never read). Overwrites nb / steps and
// the spare pair nx2 / ct2 ([bs] each). All threads.
constexpr int64_t kChainPartsBound = 1 << 17;
static_assert((MLA_SCHED_FIXED_OVERHEAD + 1) * MLA_CUDA_STEP_MAX_BS + (1 << 16) < kChainPartsBound &&
                  MLA_CUDA_STEP_MAX_BS < (1 << 14),
              "chain_count's packing at the library's piece cost: parts < 2^17, runs < 2^14");
struct ChainCount {
  int64_t parts, runs;
};
__device__ ChainCount chain_count(int bs, int32_t *nb, int32_t *steps, int32_t *nx2, int32_t *ct2,
                                  uint32_t *out) {
  int32_t *nx = nb;
  uint32_t *ct = reinterpret_cast<uint32_t *>(steps), *cs = reinterpret_cast<uint32_t *>(ct2);
  __syncthreads();  // step 1's nb / steps are complete
  for (int i = threadIdx.x; i < bs; i += blockDim.x) ct[i] = ct[i] << 14 | 1u;
  __syncthreads();
  for (int span = 1; span < bs; span <<= 1) {
    for (int i = threadIdx.x; i < bs; i += blockDim.x) {
      const int j = nx[i];
      nx2[i] = j < bs ? nx[j] : bs;
      cs[i] = ct[i] + (j < bs ? ct[j] : 0u);
    }
    __syncthreads();
    int32_t *t0 = nx;
    uint32_t *t1 = ct;
    nx = nx2;
    ct = cs;
    nx2 = t0;
    cs = t1;
  }
  if (threadIdx.x == 0) *out = ct[0];
  __syncthreads();
  const uint32_t v = *out;
  __syncthreads();  // *out read by all before a later call rewrites it
  return ChainCount{(int64_t)(v >> 14), (int64_t)(v & 0x3FFFu)};
}

// Cost prefix sums C [bs + 1] of kv_lens (c_i = ceil(kv_i / U) + OV) with
// C[bs] = the total; returns the total, *longest = the longest request in
// blocks. i0 / i1: this thread's requests. All threads.
__device__ int64_t cost_prefix(const int32_t *kv_lens, int bs, int64_t OV, int64_t U, int i0, int i1, int64_t *C,
                               int64_t *sums64, unsigned long long *longest_s, int64_t *longest) {
  if (threadIdx.x == 0) *longest_s = 0;
  __syncthreads();
  int64_t local = 0, longest_local = 0;
  for (int i = i0; i < i1; i++) {
    const int64_t b = mla_sb_cdiv(kv_lens[i], U);
    local += b + OV;
    longest_local = b > longest_local ? b : longest_local;
  }
  atomicMax(longest_s, (unsigned long long)longest_local);
  int64_t total;
  int64_t run = block_exclusive_scan<int64_t>(local, sums64, &total);
  for (int i = i0; i < i1; i++) {
    C[i] = run;
    run += mla_sb_cdiv(kv_lens[i], U) + OV;
  }
  if (threadIdx.x == 0) C[bs] = total;
  __syncthreads();
  *longest = (int64_t)*longest_s;
  return total;
}

// The shared arrays of one whole-block trial (runs_at / runs_nocut and
// chain_count) after C [bs + 1]: nb, steps, nx2, ct2 [bs] each.
struct TrialSmem {
  int32_t *nb, *steps, *nx2, *ct2;
  uint32_t *count;
};

// One whole-block trial at Q: the parts and runs of the walk (cut-free with
// nocut) on the chain from request 0. All threads.
__device__ ChainCount trial_at(const int64_t *C, int bs, int64_t total, int64_t OV, int64_t Q, bool nocut,
                               const TrialSmem &m) {
  if (nocut) runs_nocut(C, bs, OV, Q, m.nb, m.steps);
  else runs_at(C, bs, total, OV, Q, m.nb, m.steps);
  return chain_count(bs, m.nb, m.steps, m.nx2, m.ct2, m.count);
}

// A trial at q (cut-free with whole) as the schedule block needs it: the
// probe grid's answer when it has one (answers [MLA_STEP_SCHED_PROBES, 3],
// shared), else the block's own. Block-uniform.
__device__ ChainCount trial_or_probe(const int32_t *answers, int64_t q_low, int64_t q, bool whole, const int64_t *C,
                                     int bs, int64_t total, int64_t OV, const TrialSmem &m) {
  const int64_t j = q - q_low;
  if (j >= 0 && j < MLA_STEP_SCHED_PROBES && answers[3 * j + (whole ? 2 : 0)] >= 0)
    return ChainCount{answers[3 * j + (whole ? 2 : 0)], whole ? 0 : answers[3 * j + 1]};
  return trial_at(C, bs, total, OV, q, whole, m);
}

// The probe grid: block j tries budget q = q_low + j (q_low:
// mla_sb_sched_q_low), the cutting walk if q <= FlashMLA's q (parts and
// runs) and the cut-free one if q may be asked for it (longest <= q <=
// q_flash + q_flash / nocut_div: parts), into
// probe[j] = {cut parts, cut runs, cut-free parts}, -1 where not tried.
// Every budget mla_sb_sched_q can ask about lies in [q_low, q_flash +
// q_flash / nocut_div]; the schedule block tries the ones past the grid.
__global__ void __launch_bounds__(kSchedThreads, 1)
    step_probe_kernel(const mla_step_geom g, const int32_t *__restrict__ kv_lens, int32_t *__restrict__ probe) {
  extern __shared__ int64_t C[];  // [bs + 1], then the trial arrays
  const int bs = g.batch_size, nt = blockDim.x, t = threadIdx.x, parts = g.num_parts;
  const int64_t OV = g.sched_ov, U = g.sched_unit;
  int32_t *nb = (int32_t *)(C + bs + 1);
  __shared__ int64_t sums64[32];
  __shared__ unsigned long long longest_s;
  __shared__ uint32_t trial_count;
  const TrialSmem m = {nb, nb + bs, nb + 2 * bs, nb + 3 * bs, &trial_count};
  const int per = (bs + nt - 1) / nt, i0 = t * per, i1 = min(bs, i0 + per);
  int64_t longest;
  const int64_t total = cost_prefix(kv_lens, bs, OV, U, i0, i1, C, sums64, &longest_s, &longest);
  const int64_t q_flash = mla_sb_cdiv(total, parts);
  const int64_t q = mla_sb_sched_q_low(total, total - OV * bs, parts) + blockIdx.x;
  int32_t cut_parts = -1, cut_runs = -1, whole_parts = -1;
  if (q <= q_flash) {  // block-uniform
    const ChainCount c = trial_at(C, bs, total, OV, q, false, m);
    cut_parts = (int32_t)c.parts;
    cut_runs = (int32_t)c.runs;
  }
  if (g.nocut_div > 0 && longest <= q && q <= q_flash + q_flash / g.nocut_div)
    whole_parts = (int32_t)trial_at(C, bs, total, OV, q, true, m).parts;
  if (t == 0) {
    probe[3 * blockIdx.x] = cut_parts;
    probe[3 * blockIdx.x + 1] = cut_runs;
    probe[3 * blockIdx.x + 2] = whole_parts;
  }
}

__global__ void __launch_bounds__(kSchedThreads, 1)
    step_schedule_kernel(const mla_step_geom g, int32_t *__restrict__ qo_indptr, int32_t *__restrict__ kv_lens,
                         int32_t *__restrict__ sched_meta, int32_t *__restrict__ num_splits,
                         const int32_t *__restrict__ probe, int n_probe, int *bad) {
  extern __shared__ int64_t C[];                 // [bs + 1]
  const int bs = g.batch_size, nt = blockDim.x, t = threadIdx.x, parts = g.num_parts;
  const int64_t OV = g.sched_ov, U = g.sched_unit;  // a piece's cost in blocks; a block's tokens
  int32_t *nb = (int32_t *)(C + bs + 1);         // [bs]
  int32_t *steps = nb + bs;                      // [bs]
  int32_t *chain_b = steps + bs;                 // [chain_cap]: boundary requests of the runs
  const int chain_cap = (bs < parts ? bs : parts) + 2;
  int32_t *chain_p = chain_b + chain_cap;        // [chain_cap]: first part of each run
  int32_t *nx2 = chain_p + chain_cap;            // [bs]: pointer jumping's spare pair
  int32_t *ct2 = nx2 + bs;                       // [bs]
  __shared__ int64_t sums64[32];
  __shared__ uint32_t trial_count;
  __shared__ unsigned long long longest_s;
  __shared__ int32_t sums32[32];
  __shared__ int chain_len;
  __shared__ int32_t answers[3 * MLA_STEP_SCHED_PROBES];  // the probe grid's [n_probe, 3], then -1
  const TrialSmem m = {nb, steps, nx2, ct2, &trial_count};

  const int per = (bs + nt - 1) / nt, i0 = t * per, i1 = min(bs, i0 + per);
  if (g.varlen) {
    // EXTEND: qo_indptr[1..bs] holds each row's query count; make it the
    // running sum. Over the token bound: the batch is not attended at all.
    int64_t q_local = 0;
    for (int i = i0; i < i1; i++) q_local += qo_indptr[i + 1];
    int64_t q_total;
    int64_t q_run = block_exclusive_scan<int64_t>(q_local, sums64, &q_total);
    const bool over = q_total > g.num_tokens;
    for (int i = i0; i < i1; i++) {
      q_run += qo_indptr[i + 1];
      qo_indptr[i + 1] = over ? 0 : (int32_t)q_run;
      if (over) kv_lens[i] = 0;
    }
    if (over && t == 0) atomicAdd(bad, 1);
    __syncthreads();  // kv_lens as the costs below read them
  }
  // cost prefix sums, and the longest request in blocks
  int64_t longest;
  const int64_t total = cost_prefix(kv_lens, bs, OV, U, i0, i1, C, sums64, &longest_s, &longest);
  for (int j = t; j < 3 * MLA_STEP_SCHED_PROBES; j += nt) answers[j] = j < 3 * n_probe ? probe[j] : -1;
  __syncthreads();
  const int64_t q_low = mla_sb_sched_q_low(total, total - OV * bs, parts);
  // Q: bisection between ceil(blocks / parts) and FlashMLA's ceil(total /
  // parts) (>= 1: total >= OV * bs), then FlashMLA's if the smallest that
  // fits cuts more pieces (bs + parts - runs), then the cut-free q' <= Q +
  // Q / nocut_div if Q cuts a request and one fits, as mla_sb_sched_q.
  int64_t Q;
  bool nocut = false;
  {
    const int64_t q_flash = mla_sb_cdiv(total, parts);
    int64_t lo = q_low, hi = q_flash, pieces_hi = 0;
    while (lo < hi) {  // block-uniform
      const int64_t mid = lo + (hi - lo) / 2;
      const ChainCount c = trial_or_probe(answers, q_low, mid, false, C, bs, total, OV, m);
      if (c.parts <= parts) {
        hi = mid;
        pieces_hi = bs + c.parts - c.runs;
      } else {
        lo = mid + 1;
      }
    }
    const int64_t q_fit = hi;  // the cut-free q is >= it (a walk that never cuts fills no part further)
    if (hi < q_flash) {  // (hi was a trial that fit)
      const ChainCount c = trial_or_probe(answers, q_low, q_flash, false, C, bs, total, OV, m);
      if (pieces_hi > bs + c.parts - c.runs) {
        hi = q_flash;
        pieces_hi = bs + c.parts - c.runs;
      }
    } else if (g.nocut_div > 0) {  // q_flash without a trial: count its pieces
      const ChainCount c = trial_or_probe(answers, q_low, hi, false, C, bs, total, OV, m);
      pieces_hi = bs + c.parts - c.runs;
    }
    const int64_t top = g.nocut_div > 0 ? hi + hi / g.nocut_div : hi;
    if (g.nocut_div > 0 && pieces_hi > bs && longest <= top &&
        trial_or_probe(answers, q_low, top, true, C, bs, total, OV, m).parts <= parts) {
      int64_t a = q_fit > longest ? q_fit : longest, b = top;
      while (a < b) {  // block-uniform
        const int64_t mid = a + (b - a) / 2;
        if (trial_or_probe(answers, q_low, mid, true, C, bs, total, OV, m).parts <= parts) b = mid;
        else a = mid + 1;
      }
      nocut = true;
      hi = b;
    }
    Q = hi;
  }

  // 1. the run from each request's beginning
  if (nocut) runs_nocut(C, bs, OV, Q, nb, steps);
  else runs_at(C, bs, total, OV, Q, nb, steps);
  __syncthreads();

  // 2. follow the runs from request 0
  if (t == 0) {
    int b = 0, p = 0, n = 0;
    chain_b[n] = 0;
    chain_p[n++] = 0;
    while (b < bs && p < parts && n < chain_cap) {
      p += steps[b];
      b = nb[b];
      chain_b[n] = b;
      chain_p[n++] = p;
    }
    if (b < bs || p > parts) atomicAdd(bad, 1);  // the host walk would fail too (cannot happen)
    chain_len = n;
  }
  __syncthreads();
  const int n = chain_len;
  const int p_end = chain_p[n - 1];  // parts with work: [0, p_end)

  // 3a. parts
  for (int p = t; p < parts; p += nt) {
    int32_t m[MLA_SCHED_META_INTS];
#pragma unroll
    for (int j = 0; j < MLA_SCHED_META_INTS; j++) m[j] = 0;
    m[MLA_SCHED_BEGIN_REQ] = bs;
    m[MLA_SCHED_END_REQ] = bs;
    if (p < p_end) {
      int lo = 0, hi = n - 2;  // the run i with chain_p[i] <= p < chain_p[i + 1]
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (chain_p[mid] <= p) lo = mid;
        else hi = mid - 1;
      }
      const int b = chain_b[lo];
      const int64_t j = p - chain_p[lo], base = C[b] + OV;
      int br, bt, split = 0;
      if (j == 0) {
        br = b;
        bt = 0;
      } else {
        const int64_t y = base + j * Q;
        br = locate(C, bs, y);
        bt = (int)((y - C[br] - OV) * U);
        split = (int)(j - (floor_div(C[br] - C[b], Q) + 1)) + 1;
      }
      int er, et;
      if (p + 1 == chain_p[lo + 1]) {  // the next part begins a request (or the work ends)
        er = chain_b[lo + 1] - 1;
        et = kv_lens[er];
      } else {
        const int64_t y = base + (j + 1) * Q;
        er = locate(C, bs, y);
        et = (int)((y - C[er] - OV) * U);
      }
      m[MLA_SCHED_BEGIN_REQ] = br;
      m[MLA_SCHED_BEGIN_TOK] = bt;
      m[MLA_SCHED_END_REQ] = er;
      m[MLA_SCHED_END_TOK] = et;
      m[MLA_SCHED_BEGIN_SPLIT] = split;
      m[MLA_SCHED_NUM_REQS] = er - br + 1;
    }
#pragma unroll
    for (int k = 0; k < MLA_SCHED_META_INTS; k++) sched_meta[(int64_t)p * MLA_SCHED_META_INTS + k] = m[k];
  }

  // 3b. pieces per request: 1 + the cuts y_j of its run inside its blocks
  int32_t mine = 0;
  for (int i = i0; i < i1; i++) {
    int lo = 0, hi = n - 2;  // the run whose boundary is the last one <= i
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (chain_b[mid] <= i) lo = mid;
      else hi = mid - 1;
    }
    const int64_t base = C[chain_b[lo]] + OV;
    const int64_t j1 = floor_div(C[i] - C[chain_b[lo]], Q) + 1, j2 = ceil_div(C[i + 1] - base, Q) - 1;
    const int32_t pieces = nocut ? 1 : 1 + (int32_t)(j2 >= j1 ? j2 - j1 + 1 : 0);
    mine += pieces;
    steps[i] = pieces;  // reuse: pieces of i
  }
  int32_t all;
  int32_t acc = block_exclusive_scan<int32_t>(mine, sums32, &all);
  for (int i = i0; i < i1; i++) {
    num_splits[i] = acc;
    acc += steps[i];
  }
  if (t == 0) num_splits[bs] = all;
}

size_t schedule_smem(const mla_step_geom *g) {
  const size_t bs = (size_t)g->batch_size, cap = (bs < (size_t)g->num_parts ? bs : (size_t)g->num_parts) + 2;
  return sizeof(int64_t) * (bs + 1) + sizeof(int32_t) * (4 * bs + 2 * cap);
}

constexpr int kProbeFromBatch = 65;  // the smallest batch the probe grid runs for (see the launcher)

// Probe blocks a step launches: every budget the schedule can ask about,
// [q_low, q_flash + q_flash / nocut_div], bounded from the step's shape
// (q_flash - q_low <= ceil(OV bs / parts) + 1, q_flash <= ceil(bs (ceil(
// max_kv_len / U) + OV) / parts)), at most MLA_STEP_SCHED_PROBES.
int probe_blocks(const mla_step_geom *g) {
  const int64_t bs = g->batch_size, parts = g->num_parts, OV = g->sched_ov;
  const int64_t q_max = mla_sb_cdiv(bs * (mla_sb_cdiv(g->max_kv_len, g->sched_unit) + OV), parts);
  int64_t n = mla_sb_cdiv(OV * bs, parts) + 2 + (g->nocut_div > 0 ? q_max / g->nocut_div : 0);
  return (int)(n < MLA_STEP_SCHED_PROBES ? n : MLA_STEP_SCHED_PROBES);
}

// The schedule kernels' dynamic shared memory opt-in, per device: raised
// when a batch needs more than the device was last opted into, never
// lowered (so a concurrent smaller batch cannot undo a larger one's), under
// a lock taken only by batches past the 48 KiB default (thousands of rows).
pthread_mutex_t g_sched_smem_mu = PTHREAD_MUTEX_INITIALIZER;
int g_sched_smem[64];  // bytes opted into on device d (0..63; larger ordinals set it every time)

// Both schedule kernels (the probe grid reads the same arrays) opted into bytes.
cudaError_t set_schedule_smem(int bytes) {
  cudaError_t e = cudaFuncSetAttribute(step_schedule_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(step_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

cudaError_t raise_schedule_smem(int bytes) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool tracked = dev >= 0 && dev < 64;
  if (!tracked) return set_schedule_smem(bytes);
  pthread_mutex_lock(&g_sched_smem_mu);
  if (g_sched_smem[dev] < bytes) {
    e = set_schedule_smem(bytes);
    if (e == cudaSuccess) g_sched_smem[dev] = bytes;
  }
  pthread_mutex_unlock(&g_sched_smem_mu);
  return e;
}

}  // namespace

extern "C" int mla_cuda_step_build(const mla_step_geom *g, const int32_t *req_to_token, const int32_t *req_ids,
                                   const int32_t *seq_lens, const int32_t *extend_lens, int32_t *qo_indptr,
                                   int32_t *kv_lens,
                                   int32_t *block_table, int32_t *sched_meta, int32_t *num_splits,
                                   int32_t *sched_probe, int *bad, void *stream_) {
  cudaStream_t stream = (cudaStream_t)stream_;
  if (g->batch_size < 1 || g->batch_size > MLA_CUDA_STEP_MAX_BS) return (int)cudaErrorInvalidValue;
  // chain_count packs the chain's parts, at most num_parts + (OV + 1) bs
  if (g->num_parts < 1 || g->sched_ov < 0 ||
      (int64_t)(g->sched_ov + 1) * g->batch_size + g->num_parts >= kChainPartsBound)
    return (int)cudaErrorInvalidValue;
  if (g->varlen && !extend_lens) return (int)cudaErrorInvalidValue;
  step_rows_kernel<<<g->batch_size, kRowThreads, 0, stream>>>(*g, req_to_token, req_ids, seq_lens, extend_lens,
                                                             qo_indptr, kv_lens, block_table, bad);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return (int)e;
  const size_t smem = schedule_smem(g);
  if (smem > 48 * 1024) {
    e = raise_schedule_smem((int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  // EXTEND's lengths are final only inside the schedule kernel (an over-full
  // batch is emptied there): no probes. Nor for batches of <= 64 rows, whose
  // trials are short enough that the grid's launch costs more than it saves
  // (H100, session 40: b=1 +5 us, b=64 uniform +2 us; b=128 -2 to -96 us).
  const int n_probe = g->varlen || !sched_probe || g->batch_size < kProbeFromBatch ? 0 : probe_blocks(g);
  if (n_probe > 0) {
    step_probe_kernel<<<n_probe, kSchedThreads, smem, stream>>>(*g, kv_lens, sched_probe);
    if ((e = cudaGetLastError()) != cudaSuccess) return (int)e;
  }
  step_schedule_kernel<<<1, kSchedThreads, smem, stream>>>(*g, qo_indptr, kv_lens, sched_meta, num_splits,
                                                           n_probe > 0 ? sched_probe : nullptr, n_probe, bad);
  return (int)cudaGetLastError();
}
