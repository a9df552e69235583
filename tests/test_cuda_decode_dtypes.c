/* mla_attention_absorbed on a CUDA context for the cache formats and page
 * sizes beyond bf16 / page >= 8 (docs/decode-kernel.md section 9): fp8 e4m3
 * per-tensor and block-scaled caches (dequantized inside the kernel, bf16
 * activations), f16 caches with f16 activations, and page sizes 1, 2, 4
 * (cp.async row gather), against the float64 oracle:
 * every new dtype (f16, fp8, fp8-block) x page sizes {1, 2, 4, 16, 64} x
 * H {1, 16, 128} x DECODE and TARGET_VERIFY (2 draft tokens), plus bf16 at
 * page sizes {1, 2, 4}. Each batch holds a ~1600-key request (split into
 * pieces: the combine runs), a zero-length one (decode) and random ones.
 *
 * Setup as tests/test_cuda_attention.c: the cache is written on a CPU
 * context (quantized there: src/core/convert.h), every row no request owns is
 * 0xFF (NaN in every format, block scales included), block-table entries past
 * each request are TU_SENTINEL, and the GPU cache gets the CPU cache's bytes.
 * Outputs poisoned, with guards after them.
 *
 * Oracle inputs: the CPU's dequantization (mla_kv_cache_read) rounded to the
 * kernel's operand type: bf16 for bf16 and both fp8 caches (the kernel
 * dequantizes e4m3 * scale in fp32 and rounds once to bf16), f16 for f16;
 * not rounded where the ring kernels (<= 32 rows per m-block, page >= 8) or
 * the wide kernel (> 32 rows, any page size) run a per-tensor fp8 cache: e4m3
 * values exact as f16 operands, the scale applied to the scores and the
 * output (exact_fp8 below). One such case has q times 2^20 (past f16's
 * range: the kernel must scale Q before converting it).
 * Tolerance as test_cuda_attention: |o - round(ref)| <= 8e-4 + 2/128 |ref| +
 * u sum_j p_j |c_j| with u = 2^-8 (P rounded to bf16) or 2^-11 (P in f16),
 * cosine distance < 5e-6, lse 1e-5 abs + 1e-5 rel, -inf with no key.
 * Bit-exactness of the dequantization: in DECODE batches two requests have a
 * single key, so their output is that key's latent row as the kernel holds
 * it (P = 1, l = 1); it must equal the CPU's dequantization rounded to the
 * operand type bit for bit (NaN aside: none there).
 * Also the refusals (fp8 cache or bf16 cache with f16 activations, f16 cache
 * with bf16 activations: UNSUPPORTED, outputs untouched).
 *
 * MLA_FLAG_FP8_MATH (fp8m_case): per-tensor fp8 caches at more than 32 rows
 * per request, page sizes 64 and 16, H 64 / 128 with DECODE, TARGET_VERIFY
 * and DRAFT_EXTEND (fixed window) at 1, 2, 4 query tokens, and H = 3 with 16
 * tokens (48 rows); lengths 0, 1, 63, 64, 65, a few thousand and random ones
 * (DRAFT_EXTEND's short requests have queries that see no key). The route
 * must be "wide-fp8math". Oracle: float64 over the dequantized cache (not
 * rounded) and q as given (not quantized), so the measure is the whole error
 * of the fp8 math (q and P in e4m3): per request ||o - ref|| / ||ref|| over its
 * rows, per row max |o - ref| / max |ref|, and the lse's absolute error, each
 * printed per case and bounded by FP8M_* below; rows without a visible key
 * must give o = 0 exactly and lse = -inf, rows with one visible key that key's
 * latent row (P = 1) within one ulp of the output type: the kernel's P is
 * 2^(4 + d), d a few float ulps from rounding the row max, rounded to e4m3
 * (16) in the P.V but not in the row sum l, so o / l is the row times 2^-d,
 * and a value at a rounding boundary may land one ulp off. (1/256 relative,
 * the bound until session 19, failed at the bf16 value 1.5 x 2^-3, whose
 * ulp is 1/192 of it: got 0.18652, want 0.1875, in 4 of 128 heads.) q
 * scaled by 2^20 and 2^-20 (the softmax scale by the inverse, so the logits stay as they were: the kernel's per-block power of
 * two for q must adapt), and a peaky request (one key ~8-16 above the rest,
 * late in a split request: the running max jumps, the other P are tiny). The
 * flag must leave everything else bit for bit as it was (flag_noop_case):
 * bf16 and block-scaled fp8 caches, per-tensor fp8 at <= 32 rows or page 4.
 * Skips (passing) without CUDA or without a GPU. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/convert.h" /* e4m3 rounding: q as the fp8 math kernel quantizes it */
#include "mla.h"
#include "ref.h"
#include "decode_world.h"
#include "test_util.h"

#ifndef MLA_TEST_CUDA
int main(void) {
  printf("test_cuda_decode_dtypes: skipped: built without CUDA\n");
  return tu_finish("test_cuda_decode_dtypes");
}
#else
#include "cuda_util.h"
#include "cuda/decode_sm90.h" /* white box: mla_cuda_decode_route */

#define O_ATOL 8e-4
#define O_RTOL (2.0 / 128.0)
#define MAX_COS 5e-6
#define LSE_ATOL 1e-5
#define LSE_RTOL 1e-5
#define GUARD 64 /* poisoned 4-byte elements after every output */
#define MAXB 8
#define NPAD 5
#define NTHREADS 8 /* oracle threads */
/* MLA_FLAG_FP8_MATH against the exact answer. q in e4m3 (3 mantissa bits)
 * moves each logit by ~0.045 rms at these scales and P in e4m3 each weight
 * by ~2.6 %; on this data (independent N(0, 1) q and keys: the output is the
 * weights' noise, so it sees their relative error undamped) a model of that
 * math gives per-request relative errors of 0.035-0.045 (0.06 when P is not
 * scaled up before rounding), row maxima up to ~0.16 and lse errors up to
 * ~0.19 (rows with 1-3 keys or one peak: the lse is then one rounded
 * logit); q rounding alone measured 0.041 / 0.16 / 0.185 over these cases.
 * The exact path gives ~2e-3 / 4e-3 / 1e-5. */
#define FP8M_REL_L2 1e-1
#define FP8M_ROW 3e-1
#define FP8M_LSE 3e-1
#define FP8M_LSE_REL 2e-2 /* e4m3 q: a logit s moves by up to ~|s| 2^-5 */
/* Against the oracle over the kernel's own e4m3 q (q8_like_kernel): what is
 * left is the fp8 wgmma's short accumulator and P's rounding (bounds per
 * element and per row in oracle_item), plus bf16 output rounding; the lse
 * comes from the unrounded P' sums in fp32. */
#define FP8M_ATOL 1e-3
#define FP8M_RTOL (1.0 / 128.0) /* the bf16 output and fp32 accumulation */
#define FP8M_LSE8_ATOL 2e-4
#define FP8M_LSE8_RTOL 2e-5

static const double SCALE = 0.0721687836; /* 192^-0.5 */
static tu_rng rng;
static mla_ctx *cpu, *gpu;
static int small_run; /* --small: short requests (compute-sanitizer) */

typedef struct world {
  tu_dworld d; /* kv_scale: FP8_E4M3 layer scale; scale: the softmax scale the call passes */
  int q_log2; /* q scaled by 2^q_log2 (exact in bf16) */
  int fp8m;   /* MLA_FLAG_FP8_MATH case: oracle over the unrounded dequantized cache, softmax scale 2^-q_log2 */
  int peaky;  /* fp8m: one key of request 0 stands out (make_peaky) */
  /* fp8m: q as the kernel quantizes it (q8_like_kernel) and the oracle over
   * it; pbound8: the bound for P's e4m3 rounding (oracle_item) */
  double *qn8, *qr8, *o_ref8, *lse_ref8, *pbound8, *lse_drift8; /* lse_drift8: effect (1)'s lse bound */
} world;
_Static_assert(MAXB <= TU_DW_MAXB, "MAXB");

static int q_len_of(const world *w) { return w->d.mode == MLA_MODE_DECODE ? 1 : w->d.ndt; }

static const char *mode_str(mla_mode m) {
  return m == MLA_MODE_DECODE ? "decode" : m == MLA_MODE_TARGET_VERIFY ? "verify" : "draft_extend";
}

static const char *dt_name(mla_dtype t) {
  switch (t) {
    case MLA_DTYPE_BF16: return "bf16";
    case MLA_DTYPE_F16: return "f16";
    case MLA_DTYPE_FP8_E4M3: return "fp8";
    case MLA_DTYPE_FP8_E4M3_BLOCK: return "fp8-block";
    default: return "?";
  }
}

/* Whether this case runs a per-tensor fp8 cache with exact e4m3 operands
 * (src/cuda/decode_sm90.cu route_of): the ring and ring32 routes (page >= 8,
 * query tokens x heads <= 32) and the wide kernel (> 32 rows, any page size:
 * decode_seesaw.cuh lm_raw). The narrow kernels (<= 32 rows, page < 8) round
 * to bf16. */
static int exact_fp8(const world *w) {
  const int rows = q_len_of(w) * w->d.H;
  return w->d.kv == MLA_DTYPE_FP8_E4M3 && (rows > 32 || w->d.P >= 8);
}

static void case_str(const world *w, char *buf, size_t n) {
  snprintf(buf, n, "%s%s ndt=%d kv=%s act=%s P=%d H=%d bs=%d q*2^%d%s%s", w->fp8m ? "fp8-math " : "",
           mode_str(w->d.mode), w->d.ndt, dt_name(w->d.kv), dt_name(w->d.act), w->d.P, w->d.H, w->d.bs, w->q_log2,
           w->peaky ? " peaky" : "", !w->fp8m && exact_fp8(w) ? " (exact fp8)" : "");
}

/* The kernel's operand type for keys of this cache (F32: not rounded). */
static mla_dtype operand_dtype(const world *w) {
  if (w->fp8m || exact_fp8(w)) return MLA_DTYPE_F32;
  return w->d.kv == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16;
}

/* fp8m: q of request 0's rows pulled toward one of its keys (late, visible
 * to every row): 20 added to that key's logit puts it ~8-16 above the
 * next one. */
static void make_peaky(world *w) {
  const int K = w->d.kv_len[0], Q = w->d.q_len[0];
  if (K - Q < 8) return;
  const int j = K - Q - tu_randint(&rng, 0, (K - Q) / 8);
  const double *c = w->d.c_d + (int64_t)j * MLA_LATENT, *r = w->d.r_d + (int64_t)j * MLA_ROPE;
  double n2 = 0;
  for (int d = 0; d < MLA_LATENT; d++) n2 += c[d] * c[d];
  for (int d = 0; d < MLA_ROPE; d++) n2 += r[d] * r[d];
  const double lambda = 20.0 / ((double)w->d.scale * n2); /* scale * lambda * |k|^2 = 20 */
  const int64_t rows = (int64_t)Q * w->d.H;
  float *tn = malloc(sizeof(float) * (size_t)rows * MLA_LATENT), *tr = malloc(sizeof(float) * (size_t)rows * MLA_ROPE);
  for (int64_t i = 0; i < rows; i++) {
    for (int d = 0; d < MLA_LATENT; d++)
      tn[i * MLA_LATENT + d] = (float)(w->d.qn_d[i * MLA_LATENT + d] + lambda * c[d]);
    for (int d = 0; d < MLA_ROPE; d++) tr[i * MLA_ROPE + d] = (float)(w->d.qr_d[i * MLA_ROPE + d] + lambda * r[d]);
  }
  /* request 0's rows are the first ones */
  tu_to_dtype(w->d.act, tn, w->d.qn, rows * MLA_LATENT);
  tu_from_dtype(w->d.act, w->d.qn, w->d.qn_d, rows * MLA_LATENT);
  tu_to_dtype(w->d.act, tr, w->d.qr, rows * MLA_ROPE);
  tu_from_dtype(w->d.act, w->d.qr, w->d.qr_d, rows * MLA_ROPE);
  free(tn);
  free(tr);
}

static int world_build(world *w) {
  /* request 0 long (the schedule splits it), request 1 empty (decode) or the
   * shortest verify, requests 2 and 3 a single key (decode), the rest random.
   * fp8m: request 0 a few thousand keys, then 0, 1, 63, 64, 65, random. */
  static const int fp8m_lens[5] = {0, 1, 63, 64, 65};
  for (int i = 0; i < w->d.bs; i++) {
    int kv = i == 0 ? tu_randint(&rng, 1550, 1750) : i == 1 ? 0 : tu_randint(&rng, 1, 300);
    if (w->d.mode == MLA_MODE_DECODE && (i == 2 || i == 3)) kv = 1;
    if (w->fp8m)
      kv = i == 0 ? (small_run ? tu_randint(&rng, 500, 700) : tu_randint(&rng, 2500, 4000))
                  : i <= 5 ? fp8m_lens[i - 1] : tu_randint(&rng, 1, 300);
    if (w->d.mode == MLA_MODE_DECODE) {
      w->d.seq[i] = kv;
      w->d.q_len[i] = 1;
      w->d.kv_len[i] = kv;
    } else if (w->d.mode == MLA_MODE_DRAFT_EXTEND) { /* a fixed window; kv < ndt: early queries see nothing */
      w->d.seq[i] = kv;
      w->d.q_len[i] = w->d.ndt;
      w->d.kv_len[i] = kv;
    } else {
      w->d.seq[i] = kv > w->d.ndt ? kv - w->d.ndt : 0;
      w->d.q_len[i] = w->d.ndt;
      w->d.kv_len[i] = w->d.seq[i] + w->d.ndt;
    }
  }
  const int pages = tu_dworld_totals(&w->d, NPAD), maxkv = w->d.maxkv;
  if (tu_dworld_create(&w->d, cpu, gpu, pages, NPAD)) return -1;
  /* pages handed out shuffled, requests grown interleaved; their rows:
   * c, r ~ N(0, 1), quantized by the CPU cache; the oracle reads the CPU's
   * dequantization rounded to the kernel's operand type */
  const int cap = 2 * w->d.P < 64 ? 64 : 2 * w->d.P;
  if (tu_grow_requests(&rng, w->d.rt, w->d.bs, w->d.kv_len, NPAD, w->d.P, cap, w->d.req_ids) ||
      tu_fill_owned_rows(&rng, w->d.cache, w->d.rt, w->d.bs, w->d.req_ids, w->d.kv_len, maxkv, operand_dtype(w),
                         &w->d.c_d,
                         &w->d.r_d))
    return -1;
  /* the GPU cache: the CPU cache's bytes (owned rows and NaN rows alike) */
  tu_cache_to_device(w->d.cache, w->d.dcache, (size_t)pages * w->d.P);
  if (tu_dworld_plan(&w->d, cpu, 132)) return -1;
  tu_guard_block_table(&w->d.plan, w->d.bs, w->d.kv_len, w->d.P);
  /* q in the activation dtype */
  tu_make_q(&rng, w->d.act, (int64_t)w->d.Tq * w->d.H, 0, &w->d.qn, &w->d.qr, &w->d.qn_d, &w->d.qr_d);
  if (w->q_log2) { /* a power of two: the act-dtype values stay exact */
    const int64_t n[2] = {(int64_t)w->d.Tq * w->d.H * MLA_LATENT, (int64_t)w->d.Tq * w->d.H * MLA_ROPE};
    void *q[2] = {w->d.qn, w->d.qr};
    double *qd[2] = {w->d.qn_d, w->d.qr_d};
    float *tmp = malloc(sizeof(float) * (size_t)(n[0] + 1));
    for (int part = 0; part < 2; part++) {
      for (int64_t i = 0; i < n[part]; i++) tmp[i] = (float)ldexp(qd[part][i], w->q_log2);
      tu_to_dtype(w->d.act, tmp, q[part], n[part]);
      tu_from_dtype(w->d.act, q[part], qd[part], n[part]);
    }
    free(tmp);
  }
  if (w->peaky) make_peaky(w);
  w->d.p_unit = w->d.act == MLA_DTYPE_F16 || exact_fp8(w) ? 1.0 / 2048.0 : 1.0 / 256.0;
  return 0;
}

/* fp8m: q as the fp8 math kernel quantizes it (decode_wide_fp8.cuh load_q8):
 * per request and 64-row block of its (token, head) rows, 2^e with the
 * block's largest |q| in (224, 448], each value rounded to e4m3 (nearest
 * even, saturating) and scaled back. */
static void q8_like_kernel(world *w) {
  const int H = w->d.H;
  const int64_t nq = (int64_t)w->d.Tq * H;
  w->qn8 = malloc(sizeof(double) * (size_t)(nq * MLA_LATENT + 1));
  w->qr8 = malloc(sizeof(double) * (size_t)(nq * MLA_ROPE + 1));
  int64_t t0 = 0;
  for (int i = 0; i < w->d.bs; i++) {
    const int rows = w->d.q_len[i] * H;
    for (int r0 = 0; r0 < rows; r0 += 64) {
      const int r1 = r0 + 64 < rows ? r0 + 64 : rows;
      float m = 0.f;
      for (int r = r0; r < r1; r++) {
        const int64_t row = t0 * H + r;
        for (int d = 0; d < MLA_LATENT; d++) m = fmaxf(m, (float)fabs(w->d.qn_d[row * MLA_LATENT + d]));
        for (int d = 0; d < MLA_ROPE; d++) m = fmaxf(m, (float)fabs(w->d.qr_d[row * MLA_ROPE + d]));
      }
      int e = 0;
      if (m > 0.f && m <= 3.0e38f) {
        uint32_t b;
        memcpy(&b, &m, 4);
        e = ((b & 0x7fffffu) <= 0x600000u ? 8 : 7) - ((int)(b >> 23) - 127);
        e = e < -120 ? -120 : e > 120 ? 120 : e;
      }
      for (int r = r0; r < r1; r++) {
        const int64_t row = t0 * H + r;
        for (int d = 0; d < MLA_LATENT; d++)
          w->qn8[row * MLA_LATENT + d] =
              ldexp(mla_e4m3_to_f32(mla_f32_to_e4m3(ldexpf((float)w->d.qn_d[row * MLA_LATENT + d], e))), -e);
        for (int d = 0; d < MLA_ROPE; d++)
          w->qr8[row * MLA_ROPE + d] =
              ldexp(mla_e4m3_to_f32(mla_f32_to_e4m3(ldexpf((float)w->d.qr_d[row * MLA_ROPE + d], e))), -e);
      }
    }
    t0 += w->d.q_len[i];
  }
}

/* fp8m: how far Hopper's e4m3 wgmma accumulation can move one logit
 * (oracle_item, effect (1)): k32 steps over the latent (dims 0..511) then the
 * rope (0..63), each losing up to 2^-13 of the largest of its 32 products per
 * product and 2^-12 of the running sum (see there); natural units.
 * qn [512], qr [64], c [512], r [64]. */
static double acc_drift8(const double *qn, const double *qr, const double *c, const double *r, double sc) {
  double run = 0.0, lost = 0.0;
  for (int g = 0; g < (MLA_LATENT + MLA_ROPE) / 32; g++) {
    double big = 0.0;
    for (int i = 32 * g; i < 32 * g + 32; i++) {
      const double pr = i < MLA_LATENT ? qn[i] * c[i] : qr[i - MLA_LATENT] * r[i - MLA_LATENT];
      run += pr;
      if (fabs(pr) > big) big = fabs(pr);
    }
    lost += 32.0 * big + fabs(run);
  }
  return fabs(sc) * lost / 4096.0;
}

/* ---- oracle: ref_absorbed per (request, 8-head slice), threaded, and per
 * element the P-rounding bound p_unit sum_j p_j |c_j[d]| ---------------------- */
typedef struct oracle_job {
  world *w;
  int n_items;
  int item_req[MAXB * 16], item_h0[MAXB * 16];
  atomic_int next;
} oracle_job;

static void oracle_item(world *w, int req, int h0) {
  const int H = w->d.H, nh = H - h0 < 8 ? H - h0 : 8;
  int64_t t0 = 0, k0 = 0;
  for (int i = 0; i < req; i++) {
    t0 += w->d.q_len[i];
    k0 += w->d.kv_len[i];
  }
  const int Q = w->d.q_len[req], K = w->d.kv_len[req];
  const double sc = (double)w->d.scale;
  double *qn = malloc(sizeof(double) * (size_t)Q * nh * MLA_LATENT + 8);
  double *qr = malloc(sizeof(double) * (size_t)Q * nh * MLA_ROPE + 8);
  double *o = malloc(sizeof(double) * (size_t)Q * nh * MLA_LATENT + 8);
  double *lse = malloc(sizeof(double) * (size_t)Q * nh + 8);
  double *s = malloc(sizeof(double) * (size_t)(K + 1));
  for (int t = 0; t < Q; t++)
    for (int h = 0; h < nh; h++) {
      const int64_t row = (t0 + t) * H + h0 + h;
      memcpy(qn + ((size_t)t * nh + h) * MLA_LATENT, w->d.qn_d + row * MLA_LATENT, sizeof(double) * MLA_LATENT);
      memcpy(qr + ((size_t)t * nh + h) * MLA_ROPE, w->d.qr_d + row * MLA_ROPE, sizeof(double) * MLA_ROPE);
    }
  ref_absorbed(1, &Q, &K, nh, sc, w->d.plan.causal, qn, qr, w->d.c_d + k0 * MLA_LATENT, w->d.r_d + k0 * MLA_ROPE, o,
               lse);
  for (int t = 0; t < Q; t++)
    for (int h = 0; h < nh; h++) {
      const int64_t row = (t0 + t) * H + h0 + h;
      memcpy(w->d.o_ref + row * MLA_LATENT, o + ((size_t)t * nh + h) * MLA_LATENT, sizeof(double) * MLA_LATENT);
      w->d.lse_ref[row] = lse[(size_t)t * nh + h];
      const int vis = w->d.plan.causal ? K - Q + t + 1 : K;
      if (vis <= 0 || w->fp8m) continue; /* fp8m: its P bound comes below */
      tu_row_softmax(qn + ((size_t)t * nh + h) * MLA_LATENT, qr + ((size_t)t * nh + h) * MLA_ROPE,
                     w->d.c_d + k0 * MLA_LATENT, w->d.r_d + k0 * MLA_ROPE, vis, sc, s);
      tu_p_round_bound(s, w->d.c_d + k0 * MLA_LATENT, vis, w->d.p_unit, w->d.pbound + row * MLA_LATENT);
    }
  if (w->fp8m) {
    /* The oracle over the kernel's q (q8_like_kernel). Two effects are left.
     * (1) Hopper's e4m3 wgmma does not accumulate in full fp32: per k32 step
     * the 32 products are aligned to the largest one keeping ~14 bits and
     * the sum is kept to ~13 mantissa bits, truncating (DeepSeek-V3 report
     * §3.5.2; SageAttention 2 measured a 1+8+13-bit accumulator). So a logit
     * moves by up to D_j = sc 2^-12 sum_k (32 max_g |prod| + |C_k|)
     * (acc_drift8: C_k the running sums; one bit under those figures: the
     * peaky rows' lse measured 0.46-0.57 of this bound on an H200, i.e. over
     * the 2^-13 model, other rows <= 0.19); the
     * lse by at most ln sum_j p_j e^(D_j) and a weight by a factor within
     * e^(+-(D_j + that)).
     * (2) P in e4m3: P' = 2^(s - m) with l' >= P'_max >= 16, so a weight
     * moves by at most 2^-4 of itself where P' is normal (P' >= 2^-6,
     * weight >= 2^-10) and by up to half a subnormal step (2^-10 / l' <=
     * 2^-14) below; those are rounding errors of independent values
     * (standard deviation 2^-13 / sqrt(12) each), bounded at 6 sigma of
     * their sum. */
    for (int t = 0; t < Q; t++)
      for (int h = 0; h < nh; h++) {
        const int64_t row = (t0 + t) * H + h0 + h;
        memcpy(qn + ((size_t)t * nh + h) * MLA_LATENT, w->qn8 + row * MLA_LATENT, sizeof(double) * MLA_LATENT);
        memcpy(qr + ((size_t)t * nh + h) * MLA_ROPE, w->qr8 + row * MLA_ROPE, sizeof(double) * MLA_ROPE);
      }
    ref_absorbed(1, &Q, &K, nh, sc, w->d.plan.causal, qn, qr, w->d.c_d + k0 * MLA_LATENT, w->d.r_d + k0 * MLA_ROPE, o,
                 lse);
    double *sub = malloc(sizeof(double) * MLA_LATENT);
    double *drift = malloc(sizeof(double) * (size_t)(K + 1));
    for (int t = 0; t < Q; t++)
      for (int h = 0; h < nh; h++) {
        const int64_t row = (t0 + t) * H + h0 + h;
        memcpy(w->o_ref8 + row * MLA_LATENT, o + ((size_t)t * nh + h) * MLA_LATENT, sizeof(double) * MLA_LATENT);
        w->lse_ref8[row] = lse[(size_t)t * nh + h];
        w->lse_drift8[row] = 0.0;
        const int vis = w->d.plan.causal ? K - Q + t + 1 : K;
        if (vis <= 0) continue;
        const double *qrow = qn + ((size_t)t * nh + h) * MLA_LATENT, *rrow = qr + ((size_t)t * nh + h) * MLA_ROPE;
        tu_row_softmax(qrow, rrow, w->d.c_d + k0 * MLA_LATENT, w->d.r_d + k0 * MLA_ROPE, vis, sc, s);
        double el = 0.0;
        for (int j = 0; j < vis; j++) {
          drift[j] = acc_drift8(qrow, rrow, w->d.c_d + (k0 + j) * MLA_LATENT, w->d.r_d + (k0 + j) * MLA_ROPE, sc);
          el += s[j] * exp(drift[j]);
        }
        const double L = log(el);
        w->lse_drift8[row] = L;
        double *pb = w->pbound8 + row * MLA_LATENT;
        for (int d = 0; d < MLA_LATENT; d++) sub[d] = 0.0;
        for (int j = 0; j < vis; j++) {
          const double f = 1.0 / 16.0 + (exp(drift[j] + L) - 1.0) * (1.0 + 1.0 / 16.0);
          const double *c = w->d.c_d + (k0 + j) * MLA_LATENT;
          for (int d = 0; d < MLA_LATENT; d++) pb[d] += s[j] * f * fabs(c[d]);
          if (s[j] < 1.0 / 1024.0)
            for (int d = 0; d < MLA_LATENT; d++) sub[d] += c[d] * c[d];
        }
        for (int d = 0; d < MLA_LATENT; d++) pb[d] += 6.0 * (1.0 / 8192.0) / sqrt(12.0) * sqrt(sub[d]);
      }
    free(drift);
    free(sub);
  }
  free(qn);
  free(qr);
  free(o);
  free(lse);
  free(s);
}

static void *oracle_thread(void *arg) {
  oracle_job *j = arg;
  for (;;) {
    const int it = atomic_fetch_add(&j->next, 1);
    if (it >= j->n_items) return NULL;
    oracle_item(j->w, j->item_req[it], j->item_h0[it]);
  }
}

static void oracle(world *w) {
  const int64_t nq = (int64_t)w->d.Tq * w->d.H;
  w->d.o_ref = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  w->d.lse_ref = malloc(sizeof(double) * (size_t)(nq + 1));
  w->d.pbound = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
  if (w->fp8m) {
    w->o_ref8 = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
    w->lse_ref8 = malloc(sizeof(double) * (size_t)(nq + 1));
    w->pbound8 = calloc((size_t)(nq + 1) * MLA_LATENT, sizeof(double));
    w->lse_drift8 = calloc((size_t)(nq + 1), sizeof(double));
  }
  static oracle_job job; /* one oracle at a time */
  job.w = w;
  job.n_items = 0;
  atomic_store(&job.next, 0);
  for (int i = 0; i < w->d.bs; i++) /* the long request first: it bounds the wall time */
    for (int h0 = 0; h0 < w->d.H; h0 += 8) {
      job.item_req[job.n_items] = i;
      job.item_h0[job.n_items++] = h0;
    }
  pthread_t th[NTHREADS];
  int started = 0;
  for (int t = 0; t < NTHREADS; t++)
    if (pthread_create(&th[t], NULL, oracle_thread, &job) == 0) started++;
    else break;
  if (started == 0) oracle_thread(&job);
  for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
}

static void world_free(world *w) {
  tu_dworld_free(&w->d);
  free(w->qn8);
  free(w->qr8);
  free(w->o_ref8);
  free(w->lse_ref8);
  free(w->pbound8);
  free(w->lse_drift8);
}

static mla_absorbed_args args_for(const world *w, tu_dbufs *d, int base2) {
  mla_absorbed_args a = tu_dworld_args(&w->d, d->qn, d->qr, d->o, d->lse);
  a.flags = base2 ? MLA_FLAG_LSE_BASE2 : 0;
  return a;
}

static void check(const world *w, tu_dbufs *d, int base2) {
  char cs[160];
  case_str(w, cs, sizeof cs);
  const int64_t nq = (int64_t)w->d.Tq * w->d.H, no = nq * MLA_LATENT;
  unsigned char *ob = malloc(d->o_bytes + GUARD * 4), *lb = malloc(d->lse_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d->o, d->o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lb, d->lse, d->lse_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  double *got = malloc(sizeof(double) * (size_t)(no + 1)), *ref = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(w->d.act, ob, got, no);
  for (int64_t i = 0; i < no; i++) ref[i] = tu_round_to(w->d.act, w->d.o_ref[i]);
  ref_cmp c = ref_compare(got, ref, no, O_ATOL, O_RTOL);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < no; i++) {
    const double err = fabs(got[i] - ref[i]);
    if (!(err <= O_ATOL + O_RTOL * fabs(ref[i]) + w->d.pbound[i])) {
      if (first < 0) first = i;
      bad++;
    }
  }
  TU_CHECK(bad == 0 && c.nonfinite_mismatch == 0 && c.cos_dist <= MAX_COS,
           "%s o: %lld bad (design tol: %lld), %lld nonfinite mismatches of %lld (first %lld: got %g ref %g "
           "bound %g) cos %.3g",
           cs, (long long)bad, (long long)c.bad, (long long)c.nonfinite_mismatch, (long long)no, (long long)first,
           first >= 0 ? got[first] : 0.0, first >= 0 ? ref[first] : 0.0, first >= 0 ? w->d.pbound[first] : 0.0,
           c.cos_dist);
  TU_CHECK(tu_all_poisoned(ob + d->o_bytes, GUARD * 4), "%s: out written past its end", cs);
  /* single-key requests: out = that key's latent as the kernel holds it */
  if (w->d.mode == MLA_MODE_DECODE) {
    int64_t t0 = 0, k0 = 0, nexact = 0, miss = 0;
    for (int i = 0; i < w->d.bs; i++) {
      if (w->d.kv_len[i] == 1)
        for (int h = 0; h < w->d.H; h++)
          for (int dd = 0; dd < MLA_LATENT; dd++) {
            nexact++;
            const double g = got[(t0 * w->d.H + h) * MLA_LATENT + dd];
            const double want = tu_round_to(w->d.act, w->d.c_d[k0 * MLA_LATENT + dd]);
            if (!(g == want)) {
              if (miss == 0)
                fprintf(stderr, "%s: request %d head %d dim %d: got %.9g, dequantized %.9g\n", cs, i, h, dd, g, want);
              miss++;
            }
          }
      t0 += w->d.q_len[i];
      k0 += w->d.kv_len[i];
    }
    /* (world_build gives requests 2 and 3 one key; a batch of 2 has none) */
    TU_CHECK((nexact > 0 || w->d.bs < 3) && miss == 0,
             "%s: %lld of %lld single-key outputs differ from the dequantized row", cs, (long long)miss,
             (long long)nexact);
  }
  const float *l = (const float *)lb;
  for (int64_t i = 0; i < nq; i++) {
    got[i] = l[i];
    ref[i] = (double)(float)(w->d.lse_ref[i] * (base2 ? 1.4426950408889634 : 1.0));
  }
  /* q * 2^20: logits ~1e5, and fp32 accumulation of 576 products of that
   * size (tensor cores) leaves ~2e-5 of them (measured 0.22 at lse -9624) */
  c = ref_compare(got, ref, nq, LSE_ATOL, w->q_log2 > 0 ? 1e-4 : LSE_RTOL);
  TU_CHECK(c.bad == 0 && c.nonfinite_mismatch == 0,
           "%s lse: %lld bad, %lld nonfinite mismatches of %lld (first %lld: got %g ref %g)", cs, (long long)c.bad,
           (long long)c.nonfinite_mismatch, (long long)nq, (long long)c.first_bad,
           c.first_bad >= 0 ? got[c.first_bad] : 0.0, c.first_bad >= 0 ? ref[c.first_bad] : 0.0);
  TU_CHECK(tu_all_poisoned(lb + d->lse_bytes, GUARD * 4), "%s: lse written past its end", cs);
  free(ob);
  free(lb);
  free(got);
  free(ref);
}

static int case_no;
static int case_bs; /* run_case's batch size (0: 4-5 at H >= 64, else 4-7) */

/* ndt: TARGET_VERIFY's query tokens per request */
static void run_case_ndt(mla_mode mode, mla_dtype kv, int P, int H, int q_log2, int ndt) {
  world w;
  memset(&w, 0, sizeof w);
  w.q_log2 = q_log2;
  w.d.mode = mode;
  w.d.kv = kv;
  w.d.act = kv == MLA_DTYPE_F16 ? MLA_DTYPE_F16 : MLA_DTYPE_BF16;
  /* per-tensor scale: N(0, 1) / scale stays inside e4m3's +-448 mostly, the
   * tail saturates (the CPU quantizer's business; the oracle reads back) */
  w.d.kv_scale = (float)(0.004 + 0.02 * tu_uniform(&rng));
  w.d.scale = (float)SCALE;
  w.d.ndt = mode == MLA_MODE_TARGET_VERIFY ? ndt : 0;
  w.d.P = P;
  w.d.H = H;
  w.d.bs = case_bs ? case_bs : H >= 64 ? tu_randint(&rng, 4, 5) : tu_randint(&rng, 4, 7);
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  oracle(&w);
  char cs[160];
  case_str(&w, cs, sizeof cs);
  tu_dbufs d = tu_dbufs_new(&w.d, gpu, GUARD * 4);
  const int base2 = case_no++ & 1;
  mla_absorbed_args a = args_for(&w, &d, base2);
  mla_status st = mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, base2);
  tu_dbufs_free(&d);
  world_free(&w);
}
static void run_case(mla_mode mode, mla_dtype kv, int P, int H, int q_log2) {
  run_case_ndt(mode, kv, P, H, q_log2, 2);
}

/* ---- MLA_FLAG_FP8_MATH ---------------------------------------------------- */

/* The route mla_cuda_decode takes for a plan of this shape (what the
 * attention call hands it, metadata aside). */
static const char *route_of(int bs, int H, int max_q_len, int P, mla_dtype kv, int fp8_math) {
  mla_decode_params p;
  memset(&p, 0, sizeof p);
  p.batch_size = bs;
  p.num_heads = H;
  p.max_q_len = max_q_len;
  p.page_size = P;
  p.kv_dtype = (int)kv;
  p.act_dtype = MLA_DTYPE_BF16;
  p.num_sm_parts = 1;
  p.fp8_math = fp8_math;
  return mla_cuda_decode_route(&p);
}

/* Where the flag takes the fp8 kernel and where it is a no-op (host code:
 * runs without a GPU too). */
static void route_checks(void) {
  static const struct {
    int H, q, P;
    mla_dtype kv;
    int flag;
    const char *want;
  } c[] = {
      {64, 1, 64, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {128, 1, 16, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {64, 2, 16, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {128, 4, 64, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {3, 16, 64, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {33, 1, 8, MLA_DTYPE_FP8_E4M3, 1, "wide-fp8math"},
      {128, 1, 64, MLA_DTYPE_FP8_E4M3, 0, "wide"},           /* no flag */
      {16, 1, 64, MLA_DTYPE_FP8_E4M3, 1, "ring"},            /* <= 16 rows: a no-op */
      {16, 2, 64, MLA_DTYPE_FP8_E4M3, 1, "ring32"},          /* 32 rows: not > 32 */
      {16, 2, 64, MLA_DTYPE_FP8_E4M3, 0, "ring32"},          /* 17-32 rows, per-tensor fp8 */
      {3, 8, 16, MLA_DTYPE_FP8_E4M3, 0, "ring32"},
      {16, 2, 64, MLA_DTYPE_FP8_E4M3_BLOCK, 0, "narrow32"},  /* block-scaled: no 32-row ring */
      {16, 2, 64, MLA_DTYPE_BF16, 0, "narrow32"},
      {16, 2, 4, MLA_DTYPE_FP8_E4M3, 0, "narrow32"},         /* page < 8 (cp.async) */
      {128, 1, 4, MLA_DTYPE_FP8_E4M3, 1, "wide"},            /* page < 8 (cp.async) */
      {128, 1, 64, MLA_DTYPE_BF16, 1, "wide"},               /* bf16 cache */
      {128, 2, 16, MLA_DTYPE_FP8_E4M3_BLOCK, 1, "wide"},     /* block-scaled fp8 */
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    const char *r = route_of(4, c[i].H, c[i].q, c[i].P, c[i].kv, c[i].flag);
    TU_CHECK(strcmp(r, c[i].want) == 0,
             "route of H=%d q=%d P=%d kv=%s flag=%d: %s, expected %s", c[i].H, c[i].q, c[i].P, dt_name(c[i].kv),
             c[i].flag, r, c[i].want);
  }
  TU_CHECK(strcmp(route_of(0, 128, 1, 64, MLA_DTYPE_FP8_E4M3, 1), "none") == 0, "an empty batch routes nowhere");
}

/* The fp8-math measures (file comment); prints one line per case. */
static void check_fp8m(const world *w, tu_dbufs *d, int base2, const char *route) {
  char cs[200];
  case_str(w, cs, sizeof cs);
  const int H = w->d.H;
  const int64_t nq = (int64_t)w->d.Tq * H, no = nq * MLA_LATENT;
  unsigned char *ob = malloc(d->o_bytes + GUARD * 4), *lb = malloc(d->lse_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d->o, d->o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lb, d->lse, d->lse_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  double *got = malloc(sizeof(double) * (size_t)(no + 1));
  tu_from_dtype(w->d.act, ob, got, no);
  const float *l = (const float *)lb;
  const double to_base = base2 ? 1.4426950408889634 : 1.0;
  double worst_rel = 0, worst_row = 0, worst_lse = 0;
  int64_t bad_rel = 0, bad_row = 0, bad_lse = 0, bad_empty = 0, bad_one = 0, n_empty = 0, n_one = 0;
  int64_t bad8 = 0, bad8_lse = 0;
  double worst8 = 0, worst8_lse = 0, worst8_lse_ratio = 0; /* error / bound against the q8 oracle; lse error */
  int64_t t0 = 0, k0 = 0;
  for (int i = 0; i < w->d.bs; i++) {
    const int Q = w->d.q_len[i], K = w->d.kv_len[i];
    double e2 = 0, r2 = 0;
    for (int t = 0; t < Q; t++) {
      const int vis = w->d.plan.causal ? K - Q + t + 1 : K;
      for (int h = 0; h < H; h++) {
        const int64_t row = (t0 + t) * H + h;
        const double *g = got + row * MLA_LATENT, *ref = w->d.o_ref + row * MLA_LATENT;
        if (vis <= 0) { /* no visible key: o = 0 exactly, lse = -inf */
          int nz = 0;
          for (int dd = 0; dd < MLA_LATENT; dd++) nz += g[dd] != 0.0;
          n_empty++;
          bad_empty += nz != 0 || !(isinf(l[row]) && l[row] < 0);
          continue;
        }
        double emax = 0, rmax = 0;
        for (int dd = 0; dd < MLA_LATENT; dd++) {
          const double e = fabs(g[dd] - ref[dd]); /* NaN fails below */
          e2 += e * e;
          r2 += ref[dd] * ref[dd];
          if (!(e <= emax)) emax = e;
          if (fabs(ref[dd]) > rmax) rmax = fabs(ref[dd]);
        }
        /* against the oracle over the kernel's own q: P's rounding bound */
        for (int dd = 0; dd < MLA_LATENT; dd++) {
          const double e8 = fabs(g[dd] - w->o_ref8[row * MLA_LATENT + dd]);
          const double b8 = FP8M_ATOL + FP8M_RTOL * fabs(w->o_ref8[row * MLA_LATENT + dd]) +
                            w->pbound8[row * MLA_LATENT + dd];
          if (!(e8 <= b8)) bad8++;
          if (e8 / b8 > worst8) worst8 = e8 / b8;
        }
        {
          const double l8 = w->lse_ref8[row] * to_base, e8 = fabs((double)l[row] - l8);
          if (!(e8 <= (FP8M_LSE8_ATOL + w->lse_drift8[row]) * to_base + FP8M_LSE8_RTOL * fabs(l8))) bad8_lse++;
          const double r8 = e8 / ((FP8M_LSE8_ATOL + w->lse_drift8[row]) * to_base + FP8M_LSE8_RTOL * fabs(l8));
          if (!(r8 <= worst8_lse_ratio)) worst8_lse_ratio = r8;
          if (!(e8 <= worst8_lse)) worst8_lse = e8;
        }
        const double row_err = rmax > 0 ? emax / rmax : emax;
        if (!(row_err <= worst_row)) worst_row = row_err;
        bad_row += !(row_err <= FP8M_ROW);
        const double lref = w->d.lse_ref[row] * to_base, le = fabs((double)l[row] - lref);
        if (!(le <= worst_lse)) worst_lse = le;
        bad_lse += !(le <= FP8M_LSE * to_base + FP8M_LSE_REL * fabs(lref)); /* peaky rows: one big rounded logit */
        if (vis == 1) { /* P = 1: the key's latent row as dequantized, rounded once to the output (one ulp) */
          n_one++;
          int miss = 0;
          const int frac_bits = w->d.act == MLA_DTYPE_F16 ? 10 : 7;
          for (int dd = 0; dd < MLA_LATENT; dd++) {
            const double want = tu_round_to(w->d.act, w->d.c_d[k0 * MLA_LATENT + dd]);
            const double ulp = want != 0.0 ? ldexp(1.0, ilogb(want) - frac_bits) : 0.0;
            const int m = !(fabs(g[dd] - want) <= ulp);
            if (m && !miss && bad_one < 4) /* (the first few, to see how they differ) */
              printf("    one-key row %lld (request %d, token %d, head %d): dim %d got %.9g, want %.9g\n", (long long)row,
                     i, t, h, dd, g[dd], want);
            miss += m;
          }
          bad_one += miss != 0;
        }
      }
    }
    if (r2 > 0) {
      const double rel = sqrt(e2 / r2);
      if (!(rel <= worst_rel)) worst_rel = rel;
      bad_rel += !(rel <= FP8M_REL_L2);
    }
    t0 += Q;
    k0 += K;
  }
  printf("  %s: route %s: max rel L2 %.3e (<= %.2g), max row %.3e (<= %.2g), max lse err %.3e (<= %.2g)\n", cs,
         route, worst_rel, FP8M_REL_L2, worst_row, FP8M_ROW, worst_lse / to_base, FP8M_LSE);
  printf("    against the oracle over the kernel's e4m3 q: worst error / bound %.3f, lse err %.3e (%.3f of its bound)\n",
         worst8, worst8_lse / to_base, worst8_lse_ratio);
  TU_CHECK(bad8 == 0, "%s: %lld elements past the P-rounding bound of the q8 oracle (worst %.3f of it)", cs,
           (long long)bad8, worst8);
  TU_CHECK(bad8_lse == 0, "%s: %lld lse off the q8 oracle (worst %.3e)", cs, (long long)bad8_lse,
           worst8_lse / to_base);
  TU_CHECK(bad_rel == 0, "%s: %lld requests over the relative L2 bound (worst %.3e)", cs, (long long)bad_rel,
           worst_rel);
  TU_CHECK(bad_row == 0, "%s: %lld rows over the row bound (worst %.3e)", cs, (long long)bad_row, worst_row);
  TU_CHECK(bad_lse == 0, "%s: %lld lse over the bound (worst %.3e, natural log)", cs, (long long)bad_lse,
           worst_lse / to_base);
  TU_CHECK(bad_empty == 0, "%s: %lld of %lld rows without a key not o = 0, lse = -inf", cs, (long long)bad_empty,
           (long long)n_empty);
  TU_CHECK(bad_one == 0, "%s: %lld of %lld one-key rows differ from the key's row", cs, (long long)bad_one,
           (long long)n_one);
  TU_CHECK(tu_all_poisoned(ob + d->o_bytes, GUARD * 4), "%s: out written past its end", cs);
  TU_CHECK(tu_all_poisoned(lb + d->lse_bytes, GUARD * 4), "%s: lse written past its end", cs);
  free(ob);
  free(lb);
  free(got);
}

/* One MLA_FLAG_FP8_MATH case over a per-tensor fp8 cache. ndt: query tokens
 * per request (TARGET_VERIFY, DRAFT_EXTEND). */
static void fp8m_case(mla_mode mode, int ndt, int P, int H, int q_log2, int peaky) {
  world w;
  memset(&w, 0, sizeof w);
  w.fp8m = 1;
  w.peaky = peaky;
  w.q_log2 = q_log2;
  w.d.mode = mode;
  w.d.kv = MLA_DTYPE_FP8_E4M3;
  w.d.act = MLA_DTYPE_BF16;
  w.d.kv_scale = (float)(0.004 + 0.02 * tu_uniform(&rng));
  w.d.scale = ldexpf((float)SCALE, -q_log2); /* the logits stay as for q * 1 */
  w.d.ndt = mode == MLA_MODE_DECODE ? 0 : ndt;
  w.d.P = P;
  w.d.H = H;
  w.d.bs = tu_randint(&rng, 6, MAXB);
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  char cs[200];
  case_str(&w, cs, sizeof cs);
  const char *route = route_of(w.d.bs, H, (int)w.d.plan.max_q_len, P, w.d.kv, 1);
  TU_CHECK(strcmp(route, "wide-fp8math") == 0, "%s: route %s, expected wide-fp8math", cs, route);
  q8_like_kernel(&w);
  oracle(&w);
  tu_dbufs d = tu_dbufs_new(&w.d, gpu, GUARD * 4);
  const int base2 = case_no++ & 1;
  mla_absorbed_args a = args_for(&w, &d, base2);
  a.flags |= MLA_FLAG_FP8_MATH;
  mla_status st = mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, d.ws, d.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: mla_attention_absorbed: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  if (st == MLA_OK) check_fp8m(&w, &d, base2, route);
  tu_dbufs_free(&d);
  world_free(&w);
}

/* Outside its domain the flag changes nothing: out and lse bit for bit as
 * without it (and the call is checked against the oracle as usual). */
static void flag_noop_case(mla_mode mode, mla_dtype kv, int P, int H) {
  world w;
  memset(&w, 0, sizeof w);
  w.d.mode = mode;
  w.d.kv = kv;
  w.d.act = MLA_DTYPE_BF16;
  w.d.kv_scale = (float)(0.004 + 0.02 * tu_uniform(&rng));
  w.d.scale = (float)SCALE;
  w.d.ndt = mode == MLA_MODE_TARGET_VERIFY ? 2 : 0;
  w.d.P = P;
  w.d.H = H;
  w.d.bs = tu_randint(&rng, 4, 5);
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  char cs[200];
  case_str(&w, cs, sizeof cs);
  const char *route = route_of(w.d.bs, H, (int)w.d.plan.max_q_len, P, kv, 1);
  TU_CHECK(strcmp(route, "wide-fp8math") != 0, "%s: route %s with the flag outside its domain", cs, route);
  oracle(&w);
  tu_dbufs d = tu_dbufs_new(&w.d, gpu, GUARD * 4), e = tu_dbufs_new(&w.d, gpu, GUARD * 4);
  mla_absorbed_args a = args_for(&w, &d, 0), b = args_for(&w, &e, 0);
  b.flags |= MLA_FLAG_FP8_MATH;
  TU_STATUS(mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, d.ws, d.ws_bytes), MLA_OK);
  mla_status st = mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &b, e.ws, e.ws_bytes);
  TU_CHECK(st == MLA_OK, "%s: with MLA_FLAG_FP8_MATH: %s (%s)", cs, mla_status_string(st), mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  check(&w, &d, 0);
  unsigned char *o1 = malloc(d.o_bytes + d.lse_bytes), *o2 = malloc(d.o_bytes + d.lse_bytes);
  CK(cudaMemcpy(o1, d.o, d.o_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o1 + d.o_bytes, d.lse, d.lse_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o2, e.o, e.o_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o2 + e.o_bytes, e.lse, e.lse_bytes, cudaMemcpyDeviceToHost));
  TU_CHECK(memcmp(o1, o2, d.o_bytes + d.lse_bytes) == 0, "%s: route %s: MLA_FLAG_FP8_MATH changed out or lse", cs,
           route);
  free(o1);
  free(o2);
  tu_dbufs_free(&d);
  tu_dbufs_free(&e);
  world_free(&w);
}

/* An unknown flag bit next to MLA_FLAG_FP8_MATH: INVALID_ARGUMENT, nothing
 * written. */
static void fp8m_refusal(void) {
  world w;
  memset(&w, 0, sizeof w);
  w.d.mode = MLA_MODE_DECODE;
  w.d.kv = MLA_DTYPE_FP8_E4M3;
  w.d.act = MLA_DTYPE_BF16;
  w.d.kv_scale = 0.01f;
  w.d.scale = (float)SCALE;
  w.d.P = 64;
  w.d.H = 64;
  w.d.bs = 4;
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  tu_dbufs d = tu_dbufs_new(&w.d, gpu, GUARD * 4);
  mla_absorbed_args a = args_for(&w, &d, 0);
  a.flags = MLA_FLAG_FP8_MATH | 8u;
  TU_STATUS(mla_attention_absorbed(gpu, w.d.dcache, 0, &w.d.plan, &a, d.ws, d.ws_bytes), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(gpu), "flags") != NULL, "unknown flag bit: message %s", mla_ctx_last_error(gpu));
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  unsigned char *ob = malloc(d.o_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d.o, d.o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(ob, d.o_bytes + GUARD * 4), "a refused fp8-math call wrote the output");
  free(ob);
  tu_dbufs_free(&d);
  world_free(&w);
}

/* Refused combinations: UNSUPPORTED with a message naming the dtypes, and
 * the output untouched. */
static void refusals(void) {
  world w;
  memset(&w, 0, sizeof w);
  w.d.scale = (float)SCALE;
  w.d.mode = MLA_MODE_DECODE;
  w.d.kv = MLA_DTYPE_BF16;
  w.d.act = MLA_DTYPE_BF16;
  w.d.P = 16;
  w.d.H = 16;
  w.d.bs = 4;
  if (world_build(&w) != 0) {
    world_free(&w);
    return;
  }
  tu_dbufs d = tu_dbufs_new(&w.d, gpu, GUARD * 4);
  const int pages = (int)(w.d.plan.block_table_width * w.d.bs + 2 + NPAD);
  const mla_dtype kvs[3] = {MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK, MLA_DTYPE_BF16};
  for (int k = 0; k < 3; k++) { /* f16 activations with an fp8 or bf16 cache */
    mla_kv_cache_desc cd = {1, pages, 16, kvs[k], NULL};
    mla_kv_cache *c = NULL;
    TU_STATUS(mla_kv_cache_create(gpu, &cd, &c), MLA_OK);
    mla_absorbed_args a = args_for(&w, &d, 0);
    a.act_dtype = MLA_DTYPE_F16;
    TU_STATUS(mla_attention_absorbed(gpu, c, 0, &w.d.plan, &a, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
    TU_CHECK(strstr(mla_ctx_last_error(gpu), "f16") != NULL, "%s cache, f16 act: message %s", dt_name(kvs[k]),
             mla_ctx_last_error(gpu));
    mla_kv_cache_destroy(c);
  }
  { /* an f16 cache with bf16 activations */
    mla_kv_cache_desc cd = {1, pages, 16, MLA_DTYPE_F16, NULL};
    mla_kv_cache *c = NULL;
    TU_STATUS(mla_kv_cache_create(gpu, &cd, &c), MLA_OK);
    mla_absorbed_args a = args_for(&w, &d, 0);
    TU_STATUS(mla_attention_absorbed(gpu, c, 0, &w.d.plan, &a, d.ws, d.ws_bytes), MLA_ERR_UNSUPPORTED);
    mla_kv_cache_destroy(c);
  }
  TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
  unsigned char *ob = malloc(d.o_bytes + GUARD * 4);
  CK(cudaMemcpy(ob, d.o, d.o_bytes + GUARD * 4, cudaMemcpyDeviceToHost));
  TU_CHECK(tu_all_poisoned(ob, d.o_bytes + GUARD * 4), "a refused call wrote the output");
  free(ob);
  tu_dbufs_free(&d);
  world_free(&w);
}

int main(int argc, char **argv) {
  rng.s = tu_seed("test_cuda_decode_dtypes", 43);
  route_checks(); /* host code: runs without a GPU too */
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  if (st == MLA_ERR_DEVICE) {
    printf("test_cuda_decode_dtypes: skipped: no GPU (%s)\n", mla_status_string(st));
    return tu_finish("test_cuda_decode_dtypes");
  }
  TU_STATUS(st, MLA_OK);
  if (!gpu) return tu_finish("test_cuda_decode_dtypes");
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);
  /* "--small": a case per new load path (for compute-sanitizer) */
  const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
  small_run = small;
  if (small) {
    fp8m_case(MLA_MODE_DECODE, 0, 64, 128, 0, 0);
    fp8m_case(MLA_MODE_TARGET_VERIFY, 2, 16, 64, 0, 1);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 1, 16, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 1, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 16, 16, 20); /* ring kernel, small pages */
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 16, 0); /* the 32-row ring */
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 16, 16, 0);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3_BLOCK, 16, 128, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_F16, 64, 128, 0);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_BF16, 2, 16, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 64, 20); /* the wide kernel's exact f16 operands */
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 2, 64, 0);
  } else {
    const mla_dtype dts[4] = {MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK, MLA_DTYPE_F16, MLA_DTYPE_BF16};
    const int Ps[5] = {1, 2, 4, 16, 64}, Hs[3] = {1, 16, 128};
    for (int di = 0; di < 4; di++)
      for (int pi = 0; pi < 5; pi++) {
        if (dts[di] == MLA_DTYPE_BF16 && Ps[pi] >= 8) continue; /* test_cuda_attention's */
        for (int hi = 0; hi < 3; hi++)
          for (int mi = 0; mi < 2; mi++)
            run_case(mi ? MLA_MODE_TARGET_VERIFY : MLA_MODE_DECODE, dts[di], Ps[pi], Hs[hi], 0);
      }
    /* q past f16's range: the ring kernel's f16 Q (both page classes, 1 and
     * 16 rows), and the bf16-operand kernels for comparison */
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 16, 20);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 16, 16, 20);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 1, 20);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 16, 20);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3_BLOCK, 64, 16, 20);
    /* ... and the wide kernel's f16 Q (> 32 rows; TMA and cp.async pages) */
    run_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 128, 20);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 2, 64, 20);
    /* The row combine over two m-blocks a request: since session 34 it takes
     * >= 24 pieces a request above 32 rows (decode_sm90.cu, combine_by_row),
     * i.e. at most 2 requests of 128 rows on 132 SMs (66 parts); the batches
     * above (4-5 requests) go to the warp combine. */
    case_bs = 2;
    run_case(MLA_MODE_DECODE, MLA_DTYPE_BF16, 64, 128, 0);
    run_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 64, 0);
    run_case(MLA_MODE_DECODE, MLA_DTYPE_F16, 16, 128, 0);
    case_bs = 0;
    /* the 32-row ring (17-32 rows of a per-tensor fp8 cache) at other row
     * counts than H = 16 x 2: 24 rows (8 tokens x 3 heads), 32 (4 x 8), 17,
     * and 32 (16 x 2) with q past f16's range */
    run_case_ndt(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 3, 0, 8);
    run_case_ndt(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 16, 8, 0, 4);
    run_case_ndt(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 128, 17, 0, 1);
    run_case_ndt(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 32, 2, 20, 16);
    /* MLA_FLAG_FP8_MATH: both TMA page classes, s_q 1, 2, 4, H 64 / 128 */
    printf("test_cuda_decode_dtypes: MLA_FLAG_FP8_MATH against the exact answer:\n");
    const int fPs[2] = {64, 16}, fHs[2] = {64, 128};
    for (int pi = 0; pi < 2; pi++)
      for (int hi = 0; hi < 2; hi++) {
        fp8m_case(MLA_MODE_DECODE, 0, fPs[pi], fHs[hi], 0, 0);
        for (int q = 2; q <= 4; q += 2) {
          fp8m_case(MLA_MODE_TARGET_VERIFY, q, fPs[pi], fHs[hi], 0, 0);
          fp8m_case(MLA_MODE_DRAFT_EXTEND, q, fPs[pi], fHs[hi], 0, 0);
        }
      }
    fp8m_case(MLA_MODE_DRAFT_EXTEND, 16, 64, 3, 0, 0); /* 48 rows */
    fp8m_case(MLA_MODE_TARGET_VERIFY, 16, 16, 3, 0, 0);
    fp8m_case(MLA_MODE_DECODE, 0, 64, 128, 20, 0); /* q's block scale must adapt */
    fp8m_case(MLA_MODE_TARGET_VERIFY, 2, 16, 64, -20, 0);
    fp8m_case(MLA_MODE_DECODE, 0, 64, 128, 0, 1); /* peaky softmax */
    fp8m_case(MLA_MODE_TARGET_VERIFY, 4, 16, 64, 0, 1);
    fp8m_case(MLA_MODE_DRAFT_EXTEND, 2, 64, 128, 0, 1);
    /* pages past one 64-row box: TMA boxes start inside a page (row0 64, 192) */
    fp8m_case(MLA_MODE_DECODE, 0, 128, 128, 0, 0);
    fp8m_case(MLA_MODE_TARGET_VERIFY, 2, 256, 64, 0, 0);
    fp8m_case(MLA_MODE_DRAFT_EXTEND, 4, 256, 128, 0, 0);
    /* the flag outside its domain: bit for bit as without it */
    flag_noop_case(MLA_MODE_DECODE, MLA_DTYPE_BF16, 64, 128);
    flag_noop_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_BF16, 16, 64);
    flag_noop_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3_BLOCK, 64, 128);
    flag_noop_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3_BLOCK, 16, 64);
    flag_noop_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 64, 16);  /* 16 rows: the ring */
    flag_noop_case(MLA_MODE_TARGET_VERIFY, MLA_DTYPE_FP8_E4M3, 64, 16); /* 32 rows */
    flag_noop_case(MLA_MODE_DECODE, MLA_DTYPE_FP8_E4M3, 4, 128);  /* page 4: cp.async */
  }
  fp8m_refusal();
  refusals();
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_decode_dtypes");
}
#endif
