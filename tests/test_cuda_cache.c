/* The KV cache on a CUDA device: the quantize-on-write and dequantizing read
 * kernels store and return exactly the bytes and values of the CPU cache, for
 * every cache dtype, source dtype and page size (layer 0 through the
 * vectorized write of 16-byte-aligned sources, layer 1 through the
 * row-per-block write of misaligned ones; rows of ties, zeros, tiny, huge and
 * non-finite values; enough rows that each warp of the vectorized write walks
 * several); bad slots are skipped and reported; host pointers are refused;
 * copy-on-write copies device rows. Skips (passing) where the library was
 * built without CUDA or no GPU is present, after the CPU check of the GPU's
 * division-free e4m3 quantizer (mla_e4m3_quotient_rcp) against the
 * definition (mla_e4m3_quantize), and of its block scale (mla_div448). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/convert.h"
#include "test_util.h"

/* mla_e4m3_quotient_rcp, the fast path of the GPU's fp8 write, gives the
 * bytes of mla_e4m3_quantize for every value of its domain: every bf16 and
 * f16 value, the floats within 4 ulps of every e4m3 midpoint and value times
 * the scale, and random floats, at the domain's edge scales, scales with all
 * mantissa bits set and random ones. The domain holds no NaN or inf. */
static void check_rcp_quantizer(tu_rng *rng) {
  enum { kMax = 3 * 65536 + 126 * 9 * 4 };
  float *v = malloc(sizeof(float) * kMax);
  long bad = 0, n = 0, nonfinite_in = 0;
  for (int si = 0; si < 24; si++) {
    static const float fixed[8] = {1.0f, 0x1p-40f, 0x1p40f, 0x1.fffffep39f, 0x1.000002p-40f, 0.37f, 2.5f,
                                   1.0f / 448.0f};
    const float s = si < 8 ? fixed[si]
                    : si < 12 ? ldexpf(0x1.fffffep0f, tu_randint(rng, -40, 39))
                              : ldexpf((float)(1.0 + tu_uniform(rng)), tu_randint(rng, -40, 39));
    TU_CHECK(mla_e4m3_rcp_scale_ok(s), "scale %a in the domain", (double)s);
    /* 1 / s split, from the rounded reciprocal or (as the GPU's approximate
     * one may be) from one a float step or two off it */
    float hi, lo;
    mla_e4m3_rcp_split(s, &hi, &lo);
    for (int k = si % 5 - 2; k != 0; k += k > 0 ? -1 : 1) hi = nextafterf(hi, k > 0 ? INFINITY : 0.0f);
    lo = hi * fmaf(-s, hi, 1.0f);
    int m = 0;
    for (uint32_t h = 0; h < 65536; h++) {
      v[m++] = mla_bf16_to_f32((uint16_t)h);
      v[m++] = mla_f16_to_f32((uint16_t)h);
      v[m++] = mla_bits_f32((uint32_t)tu_next(rng));
    }
    for (int b = 0; b < 126; b++) {
      const double lo = mla_e4m3_to_f32((uint8_t)b), hi = mla_e4m3_to_f32((uint8_t)(b + 1));
      float mid = (float)((lo + hi) / 2 * s), at = (float)(hi * s);
      for (int k = 0; k < 4; k++) mid = nextafterf(mid, 0.0f), at = nextafterf(at, 0.0f);
      for (int k = 0; k < 9; k++) {
        v[m++] = mid, v[m++] = -mid, v[m++] = at, v[m++] = -at;
        mid = nextafterf(mid, INFINITY), at = nextafterf(at, INFINITY);
      }
    }
    for (int i = 0; i < m; i++) {
      if (!mla_e4m3_rcp_value_ok(v[i])) continue;
      nonfinite_in += !isfinite(v[i]);
      n++;
      const uint8_t got = mla_f32_to_e4m3(mla_e4m3_quotient_rcp(v[i], s, hi, lo)), want = mla_e4m3_quantize(v[i], s);
      if (got != want && bad++ < 5)
        TU_CHECK(0, "e4m3 of %a / %a: reciprocal path %02x, definition %02x", (double)v[i], (double)s, got, want);
    }
  }
  free(v);
  /* mla_div448 (the GPU's block scale) is the division by 448: the range
   * edges, random floats (the whole range is checked offline), subnormals */
  long div_bad = 0;
  for (int i = 0; i < 200000; i++) {
    float a = i < 4 ? (float[]){0x1p-100f, 0x1p127f, 0x1.fffffep-101f, FLT_MAX}[i]
                    : fabsf(mla_bits_f32((uint32_t)tu_next(rng)));
    if (isnan(a)) continue;
    const volatile float d = a / 448.0f;
    div_bad += mla_f32_bits(mla_div448(a)) != mla_f32_bits(d);
  }
  TU_CHECK(div_bad == 0, "mla_div448 differs from the division for %ld floats", div_bad);
  TU_CHECK(!mla_e4m3_rcp_value_ok(NAN) && !mla_e4m3_rcp_value_ok(-INFINITY) && nonfinite_in == 0,
           "NaN and inf are outside the reciprocal path's domain");
  TU_CHECK(bad == 0 && n > 3000000, "reciprocal e4m3 quantizer: %ld of %ld values differ", bad, n);
}

#ifndef MLA_TEST_CUDA
int main(void) {
  tu_rng rng = {tu_seed("test_cuda_cache", 17)};
  check_rcp_quantizer(&rng);
  printf("test_cuda_cache: skipped: built without CUDA\n");
  return tu_finish("test_cuda_cache");
}
#else
#include "cuda_util.h"

static size_t act_bytes(mla_dtype t) { return t == MLA_DTYPE_F32 ? 4 : 2; }

/* Equal values, NaN matching NaN: the GPU's arithmetic NaN has another bit
 * pattern than the CPU's, and a NaN's payload carries no meaning. */
static int same_values(mla_dtype t, const void *a, const void *b, int64_t n) {
  double *x = malloc(sizeof(double) * (size_t)n), *y = malloc(sizeof(double) * (size_t)n);
  tu_from_dtype(t, a, x, n);
  tu_from_dtype(t, b, y, n);
  int ok = 1;
  for (int64_t i = 0; i < n && ok; i++) ok = isnan(x[i]) ? isnan(y[i]) : x[i] == y[i];
  free(x);
  free(y);
  return ok;
}

/* Many rows (T > 8 warps x 4 blocks x SMs on an H200), so that each warp of
 * the vectorized write walks several rows and prefetches: bf16 rows into a
 * cache of `cdt`, and the shard write of world 2, against the CPU's bytes. */
static void check_many_rows(tu_rng *rng, mla_ctx *gpu, mla_ctx *cpu, mla_dtype cdt) {
  enum { T = 12000, P = 64, kPages = 192 };
  float scale = (float)ldexp(1.0 + tu_uniform(rng), -2);
  mla_kv_cache_desc kd = {1, kPages, P, cdt, cdt == MLA_DTYPE_FP8_E4M3 ? &scale : NULL};
  float *c = malloc(sizeof(float) * T * 512), *r = malloc(sizeof(float) * T * 64);
  uint16_t *cb = malloc(2 * (size_t)T * 512), *rb16 = malloc(2 * (size_t)T * 64);
  int32_t *slots = malloc(sizeof(int32_t) * kPages * P);
  for (int t = 0; t < T; t++) {
    const double sigma = ldexp(1.0, tu_randint(rng, -8, 9));
    for (int i = 0; i < 512; i++) c[t * 512 + i] = (float)(tu_normal(rng) * sigma);
    for (int i = 0; i < 64; i++) r[t * 64 + i] = (float)(tu_normal(rng) * sigma);
  }
  c[7777 * 512 + 300] = NAN;
  c[9000 * 512 + 3] = -INFINITY;
  for (int i = 0; i < kPages * P; i++) slots[i] = i;
  tu_shuffle_i32(rng, slots, kPages * P);
  tu_to_dtype(MLA_DTYPE_BF16, c, cb, (int64_t)T * 512);
  tu_to_dtype(MLA_DTYPE_BF16, r, rb16, (int64_t)T * 64);
  void *d_c = tu_dev_copy(cb, 2 * (size_t)T * 512), *d_r = tu_dev_copy(rb16, 2 * (size_t)T * 64);
  int32_t *d_slots = tu_dev_copy(slots, sizeof(int32_t) * T);
  for (int world = 1; world <= 2; world++) {
    mla_kv_cache *hc = NULL, *dc = NULL;
    TU_STATUS(mla_kv_cache_create(cpu, &kd, &hc), MLA_OK);
    TU_STATUS(mla_kv_cache_create(gpu, &kd, &dc), MLA_OK);
    if (!hc || !dc) break;
    TU_STATUS(mla_kv_cache_write_shard(hc, 0, T, slots, cb, rb16, MLA_DTYPE_BF16, world, world - 1), MLA_OK);
    TU_STATUS(mla_kv_cache_write_shard(dc, 0, T, d_slots, d_c, d_r, MLA_DTYPE_BF16, world, world - 1), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
    size_t rowb = 0;
    mla_kv_cache_row_bytes(hc, &rowb);
    const size_t lb = rowb * kPages * P;
    unsigned char *got = malloc(lb);
    void *hp = NULL, *dp = NULL;
    mla_kv_cache_layer_data(hc, 0, &hp);
    mla_kv_cache_layer_data(dc, 0, &dp);
    CK(cudaMemcpy(got, dp, lb, cudaMemcpyDeviceToHost));
    size_t diff = 0;
    for (size_t i = 0; i < lb; i++) diff += got[i] != ((unsigned char *)hp)[i];
    TU_CHECK(diff == 0, "%s cache, %d bf16 rows, world %d: %zu stored bytes differ from the CPU's",
             mla_dtype_name(cdt), T, world, diff);
    free(got);
    mla_kv_cache_destroy(hc);
    mla_kv_cache_destroy(dc);
  }
  CK(cudaFree(d_c));
  CK(cudaFree(d_r));
  CK(cudaFree(d_slots));
  free(c);
  free(r);
  free(cb);
  free(rb16);
  free(slots);
}

int main(void) {
  tu_rng rng = {tu_seed("test_cuda_cache", 17)};
  check_rcp_quantizer(&rng);
  mla_ctx *gpu = NULL, *cpu = NULL;
  mla_ctx_desc gd = {MLA_DEVICE_CUDA, 1, 0};
  mla_status st = mla_ctx_create(&gd, &gpu);
  if (st == MLA_ERR_DEVICE) {
    printf("test_cuda_cache: skipped: no GPU (%s)\n", mla_status_string(st));
    return tu_finish("test_cuda_cache");
  }
  TU_STATUS(st, MLA_OK);
  if (!gpu) return tu_finish("test_cuda_cache");
  mla_ctx_desc cd = {MLA_DEVICE_CPU, 2, 0};
  TU_STATUS(mla_ctx_create(&cd, &cpu), MLA_OK);

  const mla_dtype cdts[4] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK};
  const mla_dtype acts[3] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16};
  const int Ps[2] = {1, 64};
  for (int di = 0; di < 4; di++)
    for (int ai = 0; ai < 3; ai++)
      for (int pi = 0; pi < 2; pi++) {
        mla_dtype cdt = cdts[di], act = acts[ai];
        int P = Ps[pi], pages = 4096 / P, T = 300;
        /* layer 1's scale has a random significand: the reciprocal path
         * (mla_e4m3_quotient_rcp) at an inexact 1 / s */
        float scales[2] = {0.37f, (float)ldexp(1.0 + tu_uniform(&rng), tu_randint(&rng, -3, 3))};
        mla_kv_cache_desc kd = {2, pages, P, cdt, cdt == MLA_DTYPE_FP8_E4M3 ? scales : NULL};
        mla_kv_cache *hc = NULL, *dc = NULL;
        TU_STATUS(mla_kv_cache_create(cpu, &kd, &hc), MLA_OK);
        TU_STATUS(mla_kv_cache_create(gpu, &kd, &dc), MLA_OK);
        /* Rows: N(0, sigma) with sigma spanning tiny to saturating, plus a NaN
         * and an inf in a few rows; distinct shuffled slots. */
        float *c = malloc(sizeof(float) * T * 512), *r = malloc(sizeof(float) * T * 64);
        for (int t = 0; t < T; t++) {
          double sigma = ldexp(1.0, tu_randint(&rng, -12, 10));
          for (int i = 0; i < 512; i++) c[t * 512 + i] = (float)(tu_normal(&rng) * sigma);
          for (int i = 0; i < 64; i++) r[t * 64 + i] = (float)(tu_normal(&rng) * sigma);
        }
        if (cdt == MLA_DTYPE_FP8_E4M3) {
          /* Rows 20..39: values whose quotient by the layer's scale lies on or
           * within a float ulp of a midpoint between two e4m3 values (the
           * cases where a quotient rounded twice would differ). */
          for (int t = 20; t < 40; t++) {
            const double sc = t < 30 ? scales[0] : scales[1];
            for (int i = 0; i < 512; i++) {
              const int b = tu_randint(&rng, 0, 125), e = b >> 3, m = b & 7, e1 = (b + 1) >> 3, m1 = (b + 1) & 7;
              const double v0 = e ? (1 + m / 8.0) * ldexp(1.0, e - 7) : m / 8.0 * ldexp(1.0, -6);
              const double v1 = e1 ? (1 + m1 / 8.0) * ldexp(1.0, e1 - 7) : m1 / 8.0 * ldexp(1.0, -6);
              float f = (float)((v0 + v1) / 2 * sc);
              const int nudge = tu_randint(&rng, -1, 1);
              if (nudge) f = nextafterf(f, nudge > 0 ? INFINITY : 0.0f);
              c[t * 512 + i] = tu_randint(&rng, 0, 1) ? -f : f;
            }
          }
        }
        /* Rows 40..43: signed zeros; tiny values (f32 subnormals included,
         * block scales below the fast path's domain); huge ones (past 2^64,
         * block scales above it); all of these mixed with normal values and
         * ties. Rows 44..51: per 128-value block, an amax and values on or
         * one float ulp off the e4m3 midpoints times the block's scale. */
        for (int t = 40; t < 52; t++) {
          float *x = c + t * 512, *y = r + t * 64, amax[4];
          for (int blk = 0; blk < 4; blk++) amax[blk] = (float)ldexp(1.0 + tu_uniform(&rng), (t * 7 + blk * 3) % 41 - 20);
          for (int i = 0; i < 576; i++) {
            float *p = i < 512 ? x + i : y + (i - 512);
            const int kind = t < 43 ? t - 40 : t == 43 ? tu_randint(&rng, 0, 3) : 4;
            const int b = tu_randint(&rng, 0, 125);
            const double mid = ((double)mla_e4m3_to_f32((uint8_t)b) + mla_e4m3_to_f32((uint8_t)(b + 1))) / 2;
            float f = 0.0f;
            if (kind == 1) f = (float)ldexp(1.0 + tu_uniform(&rng), tu_randint(&rng, -150, -60));
            if (kind == 2) f = (float)ldexp(1.0 + tu_uniform(&rng), tu_randint(&rng, 60, 126));
            if (kind == 3) f = (float)(mid * (tu_randint(&rng, 0, 1) ? scales[0] : scales[1]));
            if (kind == 4) {
              const int blk = i < 512 ? i / 128 : 0;
              f = (float)(mid * mla_fp8_block_scale_from(amax[blk], 0));
            }
            const int nudge = tu_randint(&rng, -1, 1);
            if (kind >= 3 && nudge) f = nextafterf(f, nudge > 0 ? INFINITY : 0.0f);
            if (kind == 4 && i < 512 && i % 128 == t % 128) f = amax[i / 128];
            *p = tu_randint(&rng, 0, 1) ? -f : f;
          }
        }
        c[5 * 512 + 130] = NAN;
        c[9 * 512 + 7] = INFINITY;
        r[11 * 64 + 3] = -INFINITY;
        int32_t *slots = malloc(sizeof(int32_t) * (size_t)pages * P);
        for (int i = 0; i < pages * P; i++) slots[i] = i;
        tu_shuffle_i32(&rng, slots, pages * P);
        size_t es = act_bytes(act);
        void *ca = malloc(es * T * 512), *ra = malloc(es * T * 64);
        tu_to_dtype(act, c, ca, (int64_t)T * 512);
        tu_to_dtype(act, r, ra, (int64_t)T * 64);
        if (act != MLA_DTYPE_F32) {
          /* 16-bit NaNs that no float converts to (signalling, or with a
           * payload): the cache of the same dtype keeps their bits (the CPU
           * copies them), the block format's bf16 rope quiets a bf16 one (the
           * GPU copies bf16 rope words and quiets them itself); in the rope
           * and in the latent. */
          const int bf = act == MLA_DTYPE_BF16;
          ((uint16_t *)ra)[13 * 64 + 5] = bf ? 0x7f81 : 0x7c01;
          ((uint16_t *)ra)[13 * 64 + 6] = bf ? 0xffa0 : 0xfd55;
          ((uint16_t *)ca)[14 * 512 + 300] = bf ? 0xff81 : 0xfc03;
        }
        void *d_c = tu_dev_copy(ca, es * T * 512), *d_r = tu_dev_copy(ra, es * T * 64);
        int32_t *d_slots = tu_dev_copy(slots, sizeof(int32_t) * T);
        /* Layer 1 from sources one element off 16-byte alignment: the
         * row-per-block write instead of the vectorized warp-per-row one. */
        unsigned char *d_cm = tu_dev_alloc(es * (T * 512 + 1)), *d_rm = tu_dev_alloc(es * (T * 64 + 1));
        CK(cudaMemcpy(d_cm + es, ca, es * T * 512, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_rm + es, ra, es * T * 64, cudaMemcpyHostToDevice));
        for (int layer = 0; layer < 2; layer++) {
          TU_STATUS(mla_kv_cache_write(hc, layer, T, slots, ca, ra, act), MLA_OK);
          TU_STATUS(mla_kv_cache_write(dc, layer, T, d_slots, layer ? (void *)(d_cm + es) : d_c,
                                       layer ? (void *)(d_rm + es) : d_r, act),
                    MLA_OK);
        }
        TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
        /* Stored bytes identical to the CPU cache's, whole layer. */
        size_t rb = 0;
        mla_kv_cache_row_bytes(hc, &rb);
        size_t lb = rb * (size_t)pages * P;
        unsigned char *got = malloc(lb);
        for (int layer = 0; layer < 2; layer++) {
          void *hp = NULL, *dp = NULL;
          mla_kv_cache_layer_data(hc, layer, &hp);
          mla_kv_cache_layer_data(dc, layer, &dp);
          CK(cudaMemcpy(got, dp, lb, cudaMemcpyDeviceToHost));
          size_t diff = 0;
          for (size_t i = 0; i < lb; i++) diff += got[i] != ((unsigned char *)hp)[i];
          TU_CHECK(diff == 0, "%s cache, %s rows, P=%d, layer %d: %zu stored bytes differ from the CPU's",
                   mla_dtype_name(cdt), mla_dtype_name(act), P, layer, diff);
        }
        /* The shard write of decode context parallel: the rows of one rank
         * (global slot mod world) at local slot global / world, the same bytes
         * as the CPU's shard write. */
        for (int world = 2; world <= 4; world *= 2) {
          const int rank = (int)(tu_next(&rng) % (uint64_t)world);
          mla_kv_cache *hs = NULL, *ds = NULL;
          mla_kv_cache_desc sd = kd;
          sd.num_layers = 1;
          TU_STATUS(mla_kv_cache_create(cpu, &sd, &hs), MLA_OK);
          TU_STATUS(mla_kv_cache_create(gpu, &sd, &ds), MLA_OK);
          TU_STATUS(mla_kv_cache_write_shard(hs, 0, T, slots, ca, ra, act, world, rank), MLA_OK);
          TU_STATUS(mla_kv_cache_write_shard(ds, 0, T, d_slots, d_c, d_r, act, world, rank), MLA_OK);
          TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
          void *hp = NULL, *dp = NULL;
          mla_kv_cache_layer_data(hs, 0, &hp);
          mla_kv_cache_layer_data(ds, 0, &dp);
          CK(cudaMemcpy(got, dp, lb, cudaMemcpyDeviceToHost));
          size_t diff = 0;
          for (size_t i = 0; i < lb; i++) diff += got[i] != ((unsigned char *)hp)[i];
          TU_CHECK(diff == 0, "%s cache, %s rows, P=%d, shard %d of %d: %zu stored bytes differ from the CPU's",
                   mla_dtype_name(cdt), mla_dtype_name(act), P, rank, world, diff);
          mla_kv_cache_destroy(hs);
          mla_kv_cache_destroy(ds);
        }
        /* Reads back identical to the CPU's read, in every dtype. */
        for (int oi = 0; oi < 3; oi++) {
          mla_dtype odt = acts[oi];
          size_t ob = act_bytes(odt);
          void *hc_out = malloc(ob * T * 512), *hr_out = malloc(ob * T * 64);
          void *gc_out = malloc(ob * T * 512), *gr_out = malloc(ob * T * 64);
          void *d_co = NULL, *d_ro = NULL;
          CK(cudaMalloc(&d_co, ob * T * 512));
          CK(cudaMalloc(&d_ro, ob * T * 64));
          TU_STATUS(mla_kv_cache_read(hc, 1, T, slots, hc_out, hr_out, odt), MLA_OK);
          TU_STATUS(mla_kv_cache_read(dc, 1, T, d_slots, d_co, d_ro, odt), MLA_OK);
          TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
          CK(cudaMemcpy(gc_out, d_co, ob * T * 512, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(gr_out, d_ro, ob * T * 64, cudaMemcpyDeviceToHost));
          TU_CHECK(same_values(odt, hc_out, gc_out, (int64_t)T * 512) &&
                       same_values(odt, hr_out, gr_out, (int64_t)T * 64),
                   "%s cache read as %s differs from the CPU read", mla_dtype_name(cdt), mla_dtype_name(odt));
          /* gather_latent on the GPU context is the same read */
          TU_STATUS(mla_gather_latent(gpu, dc, 1, T, d_slots, odt, d_co, NULL), MLA_OK);
          TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
          CK(cudaMemcpy(gc_out, d_co, ob * T * 512, cudaMemcpyDeviceToHost));
          TU_CHECK(same_values(odt, hc_out, gc_out, (int64_t)T * 512), "gather_latent differs");
          CK(cudaFree(d_co));
          CK(cudaFree(d_ro));
          free(hc_out);
          free(hr_out);
          free(gc_out);
          free(gr_out);
        }
        free(got);
        free(ca);
        free(ra);
        free(c);
        free(r);
        free(slots);
        CK(cudaFree(d_c));
        CK(cudaFree(d_r));
        CK(cudaFree(d_cm));
        CK(cudaFree(d_rm));
        CK(cudaFree(d_slots));
        mla_kv_cache_destroy(hc);
        mla_kv_cache_destroy(dc);
      }

  for (int di = 0; di < 4; di++) check_many_rows(&rng, gpu, cpu, cdts[di]);

  /* Bad slots are skipped and reported; host pointers refused; CPU-only calls
   * refuse a CUDA context. */
  {
    mla_kv_cache_desc kd = {1, 16, 16, MLA_DTYPE_BF16, NULL};
    mla_kv_cache *dc = NULL;
    TU_STATUS(mla_kv_cache_create(gpu, &kd, &dc), MLA_OK);
    float c[3 * 512], r[3 * 64];
    tu_fill_bf16_normal(&rng, c, 3 * 512, 1.0);
    tu_fill_bf16_normal(&rng, r, 3 * 64, 1.0);
    int32_t slots[3] = {5, 16 * 16, 7}; /* the middle one is past the end */
    void *d_c = tu_dev_copy(c, sizeof c), *d_r = tu_dev_copy(r, sizeof r);
    int32_t *d_slots = tu_dev_copy(slots, sizeof slots);
    TU_STATUS(mla_kv_cache_write(dc, 0, 3, d_slots, d_c, d_r, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_ERR_OUT_OF_RANGE);
    TU_CHECK(strstr(mla_ctx_last_error(gpu), "skipped") != NULL, "message: %s", mla_ctx_last_error(gpu));
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK); /* the count was reset */
    float back[512];
    void *d_back = NULL;
    CK(cudaMalloc(&d_back, sizeof back));
    int32_t *d_one = tu_dev_copy(&slots[2], sizeof(int32_t));
    TU_STATUS(mla_kv_cache_read(dc, 0, 1, d_one, d_back, NULL, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
    CK(cudaMemcpy(back, d_back, sizeof back, cudaMemcpyDeviceToHost));
    TU_CHECK(!memcmp(back, c + 2 * 512, sizeof back), "the good rows around a bad slot were written");
    TU_STATUS(mla_kv_cache_write(dc, 0, 3, slots, d_c, d_r, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(strstr(mla_kv_cache_last_error(dc), "host memory") != NULL, "message: %s",
             mla_kv_cache_last_error(dc));
    TU_STATUS(mla_kv_cache_write(dc, 0, 3, d_slots, c, d_r, MLA_DTYPE_F32), MLA_ERR_INVALID_ARGUMENT);

    /* Copy-on-write on the device: the child keeps the parent's rows. */
    mla_req_table_desc rd = {4, 64, 16, 16};
    mla_req_table *rt = NULL;
    TU_STATUS(mla_req_table_create(gpu, &rd, dc, &rt), MLA_OK);
    int32_t a, b, s_a[20], s_b[5];
    TU_STATUS(mla_req_add(rt, &a), MLA_OK);
    TU_STATUS(mla_req_extend(rt, a, 20, s_a), MLA_OK);
    float pc[20 * 512], pr[20 * 64];
    tu_fill_bf16_normal(&rng, pc, 20 * 512, 1.0);
    tu_fill_bf16_normal(&rng, pr, 20 * 64, 1.0);
    void *d_pc = tu_dev_copy(pc, sizeof pc), *d_pr = tu_dev_copy(pr, sizeof pr);
    int32_t *d_sa = tu_dev_copy(s_a, sizeof s_a);
    TU_STATUS(mla_kv_cache_write(dc, 0, 20, d_sa, d_pc, d_pr, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_req_fork(rt, a, 18, &b), MLA_OK);
    TU_STATUS(mla_req_extend(rt, b, 5, s_b), MLA_OK); /* writes into the shared page: CoW */
    const int32_t *r2t = NULL;
    TU_STATUS(mla_req_table_data(rt, &r2t), MLA_OK);
    int32_t child[18];
    memcpy(child, r2t + (size_t)b * 64, sizeof child);
    TU_CHECK(child[17] != s_a[17], "the shared partial page was copied (slot %d)", child[17]);
    int32_t *d_child = tu_dev_copy(child, sizeof child);
    float cb[18 * 512];
    void *d_cb = NULL;
    CK(cudaMalloc(&d_cb, sizeof cb));
    TU_STATUS(mla_kv_cache_read(dc, 0, 18, d_child, d_cb, NULL, MLA_DTYPE_F32), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(gpu), MLA_OK);
    CK(cudaMemcpy(cb, d_cb, sizeof cb, cudaMemcpyDeviceToHost));
    TU_CHECK(!memcmp(cb, pc, sizeof cb), "the child reads the parent's prefix rows after copy-on-write");

    /* Ragged MHA and the backend run on CUDA contexts now: empty arguments
     * are refused as invalid, nothing is launched. */
    mla_ragged_args ra;
    memset(&ra, 0, sizeof ra);
    TU_STATUS(mla_attention_ragged(gpu, &ra), MLA_ERR_INVALID_ARGUMENT);
    mla_backend_desc bd;
    memset(&bd, 0, sizeof bd);
    mla_backend *be = NULL;
    TU_STATUS(mla_backend_create(gpu, &bd, &be), MLA_ERR_INVALID_ARGUMENT);
    TU_CHECK(be == NULL, "no backend handed out on failure");

    mla_req_table_destroy(rt);
    CK(cudaFree(d_pc));
    CK(cudaFree(d_pr));
    CK(cudaFree(d_sa));
    CK(cudaFree(d_child));
    CK(cudaFree(d_cb));
    CK(cudaFree(d_one));
    CK(cudaFree(d_back));
    CK(cudaFree(d_c));
    CK(cudaFree(d_r));
    CK(cudaFree(d_slots));
    mla_kv_cache_destroy(dc);
  }
  mla_ctx_destroy(cpu);
  mla_ctx_destroy(gpu);
  return tu_finish("test_cuda_cache");
}
#endif
