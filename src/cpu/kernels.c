/* Scalar micro-kernels, ISA selection, and cache row dequantization.
 *
 * The scalar kernels are the portable fallback and the readable statement of
 * what the SIMD builds (kernels_avx2.c, kernels_avx512.c) compute. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* ---- scalar kernels ----------------------------------------------------- */

static void qk_scalar(int n, int D, const float *K /* [n, ldk] */, int ldk,
                      const float *QT /* [D, rb] */, int rb, float *S /* [n, rb] */,
                      int accumulate, mla_cpu_conv *cv) {
  (void)cv; /* no pipelined conversion: mla_cpu_conv_finish does it */
  for (int j = 0; j < n; j++) {
    const float *kj = K + (size_t)j * ldk;
    float *s = S + (size_t)j * rb;
    if (!accumulate)
      for (int r = 0; r < rb; r++) s[r] = 0.0f;
    for (int d = 0; d < D; d++) {
      const float kd = kj[d];
      const float *q = QT + (size_t)d * rb;
      for (int r = 0; r < rb; r++) s[r] += kd * q[r];
    }
  }
}

static void softmax_scalar(int n, int rb, float *S /* [n, rb] */, float *m /* [rb] */,
                           float *l /* [rb] */, float *alpha /* [rb] */) {
  for (int r = 0; r < rb; r++) {
    float mt = -INFINITY;
    for (int j = 0; j < n; j++) {
      float s = S[(size_t)j * rb + r];
      mt = s > mt ? s : mt; /* a NaN logit never becomes the max; it still poisons P */
    }
    float mn = m[r] > mt ? m[r] : mt;
    if (mn == -INFINITY) { /* nothing visible yet: keep the row empty */
      alpha[r] = 1.0f;
      for (int j = 0; j < n; j++) S[(size_t)j * rb + r] = 0.0f;
      continue;
    }
    float a = mla_cpu_exp2(m[r] - mn); /* m = -inf -> 0: the empty accumulator is dropped */
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
      float p = mla_cpu_exp2(S[(size_t)j * rb + r] - mn);
      S[(size_t)j * rb + r] = p;
      sum += p;
    }
    l[r] = l[r] * a + sum;
    m[r] = mn;
    alpha[r] = a;
  }
}

static void pv_scalar(int n, int rows, const float *P /* [n, rb] */, int rb,
                      const float *V /* [n, ldv] */, int ldv, int dvp,
                      const float *alpha /* [rows] */, float *acc /* [rows, lda] */, int lda,
                      mla_cpu_conv *cv) {
  (void)cv;
  for (int r = 0; r < rows; r++) {
    float *a = acc + (size_t)r * lda;
    if (alpha)
      for (int e = 0; e < dvp; e++) a[e] *= alpha[r];
    for (int j = 0; j < n; j++) {
      const float p = P[(size_t)j * rb + r];
      const float *v = V + (size_t)j * ldv;
      for (int e = 0; e < dvp; e++) a[e] += p * v[e];
    }
  }
}

static void f16_scalar(const uint16_t *src, float *dst, int n) {
  for (int i = 0; i < n; i++) dst[i] = mla_f16_to_f32(src[i]);
}

static void bf16_scalar(const uint16_t *src, float *dst, int n) {
  for (int i = 0; i < n; i++) dst[i] = mla_bf16_to_f32(src[i]);
}

static void e4m3_scalar(const uint8_t *src, const float *lut, float scale, float *dst, int n) {
  for (int i = 0; i < n; i++) dst[i] = lut[src[i]] * scale;
}

static void softcap_scalar(float *x, int n, float cap2) {
  for (int i = 0; i < n; i++) x[i] = cap2 * tanhf(x[i]);
}

static void bf16_rows_scalar(const unsigned char *base, size_t row_bytes,
                             const int32_t *slots /* [n] */, int n, int c0, int w,
                             float *dst /* [w / 64][n, ldd] */, int ldd, size_t bstride) {
  for (int i = 0; i < n; i++) {
    const uint16_t *src = (const uint16_t *)(base + (size_t)slots[i] * row_bytes) + c0;
    for (int p = 0; p < w; p++)
      dst[(size_t)(p / 64) * bstride + (size_t)i * ldd + p % 64] =
          mla_bf16_to_f32(src[MLA_CPU_SPLIT32(p)]);
  }
}

void mla_cpu_qt16_c(const float *Q /* [16, ldq] */, int ldq, int D, float scale, int split,
                        float *QT /* [D, rb] */, int rb) {
  for (int d = 0; d < D; d++) {
    const int c = split ? MLA_CPU_SPLIT32(d) : d;
    for (int r = 0; r < 16; r++) QT[(size_t)d * rb + r] = Q[(size_t)r * ldq + c] * scale;
  }
}

static const mla_cpu_kernels k_scalar = {MLA_CPU_ISA_SCALAR, "scalar",    qk_scalar,
                                         softmax_scalar,     pv_scalar,   f16_scalar,
                                         bf16_scalar,        e4m3_scalar, softcap_scalar,
                                         bf16_rows_scalar,   mla_cpu_qt16_c,
                                         NULL,               NULL,
                                         NULL,               NULL,
                                         NULL,               NULL,
                                         NULL,               NULL,
                                         NULL,               NULL};

void mla_cpu_load_act(const mla_cpu_kernels *k, mla_dtype t, const void *src, int64_t offset,
                      int n, float *dst) {
  switch (t) {
    case MLA_DTYPE_BF16: k->bf16_to_f32((const uint16_t *)src + offset, dst, n); break;
    case MLA_DTYPE_F16: k->f16_to_f32((const uint16_t *)src + offset, dst, n); break;
    default: mla_load_f32(t, src, offset, n, dst); break;
  }
}

const mla_cpu_kernels *mla_cpu_kernels_scalar(void) { return &k_scalar; }

/* ---- ISA selection ------------------------------------------------------ */

static const mla_cpu_kernels *table_of(mla_cpu_isa isa) {
  switch (isa) {
    case MLA_CPU_ISA_SCALAR: return mla_cpu_kernels_scalar();
    case MLA_CPU_ISA_AVX2: return mla_cpu_kernels_avx2();
    case MLA_CPU_ISA_AVX512: return mla_cpu_kernels_avx512();
    default: return NULL;
  }
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define MLA_CPU_X86 1
#include <cpuid.h>

/* F16C straight from CPUID (leaf 1, ECX bit 29): not every compiler's
 * __builtin_cpu_supports knows the name. The AVX state check that makes it
 * usable is the avx2 test next to it. */
static int has_f16c(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  return (c >> 29) & 1u;
}
#endif

int mla_cpu_isa_available(mla_cpu_isa isa) {
  if (!table_of(isa)) return 0;
#ifdef MLA_CPU_X86
  __builtin_cpu_init();
  switch (isa) {
    case MLA_CPU_ISA_SCALAR: return 1;
    case MLA_CPU_ISA_AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case MLA_CPU_ISA_AVX512:
      return __builtin_cpu_supports("avx512f") != 0;
    default: return 0;
  }
#else
  return isa == MLA_CPU_ISA_SCALAR;
#endif
}

static const mla_cpu_kernels *detect(void) {
  const char *env = getenv("MLA_CPU_ISA");
  if (env && *env) {
    mla_cpu_isa want = MLA_CPU_ISA_AUTO;
    if (!strcmp(env, "scalar")) want = MLA_CPU_ISA_SCALAR;
    else if (!strcmp(env, "avx2")) want = MLA_CPU_ISA_AVX2;
    else if (!strcmp(env, "avx512")) want = MLA_CPU_ISA_AVX512;
    /* An unknown or unavailable request falls back to detection rather
     * than failing: the variable is a tuning knob, not a contract. */
    if (want != MLA_CPU_ISA_AUTO && mla_cpu_isa_available(want)) return table_of(want);
  }
  if (mla_cpu_isa_available(MLA_CPU_ISA_AVX512)) return table_of(MLA_CPU_ISA_AVX512);
  if (mla_cpu_isa_available(MLA_CPU_ISA_AVX2)) return table_of(MLA_CPU_ISA_AVX2);
  return &k_scalar;
}

static _Atomic(const mla_cpu_kernels *) g_kernels;

const mla_cpu_kernels *mla_cpu_kernels_get(void) {
  const mla_cpu_kernels *k = atomic_load_explicit(&g_kernels, memory_order_acquire);
  if (!k) {
    /* Racing first calls compute the same answer; either store wins. */
    k = detect();
    atomic_store_explicit(&g_kernels, k, memory_order_release);
  }
  return k;
}

int mla_cpu_set_isa(mla_cpu_isa isa) {
  if (isa == MLA_CPU_ISA_AUTO) {
    atomic_store_explicit(&g_kernels, detect(), memory_order_release);
    return 0;
  }
  if (!mla_cpu_isa_available(isa)) return -1;
  atomic_store_explicit(&g_kernels, table_of(isa), memory_order_release);
  return 0;
}

mla_status mla_ctx_cpu_isa(const mla_ctx *ctx, const char **name) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  /* A const query still records its failure (the handle was created non-const). */
  mla_errbuf *eb = &((mla_ctx *)ctx)->err;
  MLA_REQUIRE_PTR(eb, name);
  MLA_REQUIRE(eb, ctx->device == MLA_DEVICE_CPU, MLA_ERR_UNSUPPORTED,
              "ctx is not a CPU context");
  *name = mla_cpu_kernels_get()->name;
  return MLA_OK;
}

/* ---- cache rows --------------------------------------------------------- */

void mla_cpu_rows_init(mla_cpu_rows *rows, const mla_kv_cache *cache, int layer,
                       const mla_cpu_kernels *k) {
  rows->base = cache->layers[layer];
  rows->row_bytes = cache->row_bytes;
  rows->dtype = cache->dtype;
  rows->k = k;
  rows->fp8_scale = cache->dtype == MLA_DTYPE_FP8_E4M3 ? cache->fp8_scales[layer] : 1.0f;
  if (cache->dtype == MLA_DTYPE_FP8_E4M3 || cache->dtype == MLA_DTYPE_FP8_E4M3_BLOCK)
    for (int b = 0; b < 256; b++) rows->lut[b] = mla_e4m3_to_f32((uint8_t)b);
}

void mla_cpu_load_rows(const mla_cpu_rows *rows, const int32_t *slots /* [n] */, int n,
                       float *c /* [n, ldc] */, int ldc, float *r /* [n, ldr] */, int ldr) {
  for (int i = 0; i < n; i++) {
    const unsigned char *p = rows->base + (size_t)slots[i] * rows->row_bytes;
    float *ci = c + (size_t)i * ldc;
    float *ri = r ? r + (size_t)i * ldr : ci + MLA_LATENT;
    const mla_cpu_kernels *k = rows->k;
    switch (rows->dtype) {
      case MLA_DTYPE_BF16:
        k->bf16_to_f32((const uint16_t *)p, ci, MLA_LATENT);
        k->bf16_to_f32((const uint16_t *)p + MLA_LATENT, ri, MLA_ROPE);
        break;
      case MLA_DTYPE_F16:
        k->f16_to_f32((const uint16_t *)p, ci, MLA_LATENT);
        k->f16_to_f32((const uint16_t *)p + MLA_LATENT, ri, MLA_ROPE);
        break;
      case MLA_DTYPE_FP8_E4M3: /* value = e4m3 * layer scale, one fp32 rounding */
        k->e4m3_to_f32(p, rows->lut, rows->fp8_scale, ci, MLA_LATENT);
        k->e4m3_to_f32(p + MLA_LATENT, rows->lut, rows->fp8_scale, ri, MLA_ROPE);
        break;
      case MLA_DTYPE_FP8_E4M3_BLOCK: {
        float sc[MLA_LATENT / MLA_FP8_BLOCK];
        memcpy(sc, p + MLA_LATENT, sizeof sc);
        for (int b = 0; b < MLA_LATENT / MLA_FP8_BLOCK; b++)
          k->e4m3_to_f32(p + b * MLA_FP8_BLOCK, rows->lut, sc[b], ci + b * MLA_FP8_BLOCK,
                         MLA_FP8_BLOCK);
        k->bf16_to_f32((const uint16_t *)(p + MLA_LATENT + sizeof sc), ri, MLA_ROPE);
        break;
      }
      default: /* unreachable: caches only hold the dtypes above */
        for (int e = 0; e < MLA_LATENT; e++) ci[e] = NAN;
        for (int e = 0; e < MLA_ROPE; e++) ri[e] = NAN;
    }
  }
}

void mla_cpu_load_cols(const mla_cpu_rows *rows, const int32_t *slots /* [n] */, int n, int c0,
                       int w, float *dst /* [n, ldd] */, int ldd) {
  const mla_cpu_kernels *k = rows->k;
  const int rope = c0 >= MLA_LATENT;
  for (int i = 0; i < n; i++) {
    const unsigned char *p = rows->base + (size_t)slots[i] * rows->row_bytes;
    float *d = dst + (size_t)i * ldd;
    switch (rows->dtype) {
      case MLA_DTYPE_BF16: k->bf16_to_f32((const uint16_t *)p + c0, d, w); break;
      case MLA_DTYPE_F16: k->f16_to_f32((const uint16_t *)p + c0, d, w); break;
      case MLA_DTYPE_FP8_E4M3: k->e4m3_to_f32(p + c0, rows->lut, rows->fp8_scale, d, w); break;
      case MLA_DTYPE_FP8_E4M3_BLOCK: {
        const size_t scales = (MLA_LATENT / MLA_FP8_BLOCK) * sizeof(float);
        if (rope) {
          k->bf16_to_f32((const uint16_t *)(p + MLA_LATENT + scales) + (c0 - MLA_LATENT), d, w);
        } else {
          float sc;
          memcpy(&sc, p + MLA_LATENT + (size_t)(c0 / MLA_FP8_BLOCK) * sizeof(float), sizeof sc);
          k->e4m3_to_f32(p + c0, rows->lut, sc, d, w);
        }
        break;
      }
      default: /* unreachable: caches only hold the dtypes above */
        for (int e = 0; e < w; e++) d[e] = NAN;
    }
  }
}
