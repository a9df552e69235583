/* AVX-512F micro-kernels (see cpu.h for what each computes).
 *
 * Register blocking: scores use up to 8 keys x 1..4 vectors of 16 query rows
 * (8 to 16 accumulators, e.g. 4 loads + 4 broadcasts per 16 FMAs); P x V uses 4 rows x 64
 * value columns (16 accumulators). Block sizes are compile-time constants of
 * small always-inline functions so the accumulators live in registers. */
#include "cpu.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TGT __attribute__((target("avx512f")))
#define INL static inline __attribute__((always_inline)) TGT

INL void qk_block(const int NK, const int NV, int D, const float *K, int ldk, const float *QT,
                  int rb, float *S) {
  __m512 acc[8][4];
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++) acc[k][v] = _mm512_setzero_ps();
  for (int d = 0; d < D; d++) {
    __m512 q[4];
    for (int v = 0; v < NV; v++) q[v] = _mm512_loadu_ps(QT + (size_t)d * rb + 16 * v);
    for (int k = 0; k < NK; k++) {
      __m512 b = _mm512_set1_ps(K[(size_t)k * ldk + d]);
      for (int v = 0; v < NV; v++) acc[k][v] = _mm512_fmadd_ps(b, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(S + (size_t)k * rb + 16 * v, acc[k][v]);
}

#define QK_FN(NK, NV)                                                                     \
  static TGT void qk_##NK##_##NV(int D, const float *K, int ldk, const float *QT, int rb, \
                                 float *S) {                                              \
    qk_block(NK, NV, D, K, ldk, QT, rb, S);                                               \
  }
#define QK_ROW(NK) QK_FN(NK, 1) QK_FN(NK, 2) QK_FN(NK, 3) QK_FN(NK, 4)
QK_ROW(1) QK_ROW(2) QK_ROW(3) QK_ROW(4) QK_ROW(5) QK_ROW(6) QK_ROW(7) QK_ROW(8)

typedef void (*qk_fn)(int, const float *, int, const float *, int, float *);
#define QK_TAB_ROW(NK) {qk_##NK##_1, qk_##NK##_2, qk_##NK##_3, qk_##NK##_4}
static const qk_fn qk_tab[8][4] = {QK_TAB_ROW(1), QK_TAB_ROW(2), QK_TAB_ROW(3), QK_TAB_ROW(4),
                                   QK_TAB_ROW(5), QK_TAB_ROW(6), QK_TAB_ROW(7), QK_TAB_ROW(8)};
/* Keys per block for 1..4 row vectors: enough independent accumulators
 * (>= 8) to cover the FMA latency on two ports, at most 16 of them. */
static const int qk_keys[4] = {8, 6, 5, 4};

static TGT void qk_avx512(int n, int D, const float *K /* [n, ldk] */, int ldk,
                          const float *QT /* [D, rb] */, int rb, float *S /* [n, rb] */) {
  const int nv = rb / 16;
  for (int v0 = 0; v0 < nv; v0 += 4) {
    const int cv = nv - v0 < 4 ? nv - v0 : 4;
    const int bk = qk_keys[cv - 1];
    for (int j = 0; j < n; j += bk) {
      const int nk = n - j < bk ? n - j : bk;
      qk_tab[nk - 1][cv - 1](D, K + (size_t)j * ldk, ldk, QT + 16 * v0, rb,
                             S + (size_t)j * rb + 16 * v0);
    }
  }
}

/* 2^x for x <= 0 (any x works; NaN stays NaN, -inf and x < -126 give 0):
 * round to the nearest integer i, f = x - i in [-1/2, 1/2], 2^f by its
 * degree-7 Taylor series (truncation < 6e-9 relative), then scale by 2^i. */
INL __m512 exp2_avx512(__m512 x) {
  __m512 xc = _mm512_max_ps(_mm512_set1_ps(-127.0f), x); /* NaN in x is returned */
  xc = _mm512_min_ps(_mm512_set1_ps(127.0f), xc);
  __m512 xi = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(xc, xi);
  __m512 p = _mm512_set1_ps(1.5252733804059838e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821576e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  __m512 r = _mm512_scalef_ps(p, xi);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(r, tiny, _mm512_setzero_ps());
}

static TGT void softmax_avx512(int n, int rb, float *S /* [n, rb] */, float *m, float *l,
                               float *alpha) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int v = 0; v < rb; v += 16) {
    __m512 mt = ninf;
    for (int j = 0; j < n; j++)
      mt = _mm512_max_ps(_mm512_loadu_ps(S + (size_t)j * rb + v), mt); /* NaN never wins */
    __m512 mo = _mm512_loadu_ps(m + v);
    __m512 mn = _mm512_max_ps(mt, mo);
    __mmask16 empty = _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ);
    __m512 mu = _mm512_mask_mov_ps(mn, empty, _mm512_setzero_ps());
    __m512 a = exp2_avx512(_mm512_sub_ps(mo, mu));
    a = _mm512_mask_mov_ps(a, empty, _mm512_set1_ps(1.0f));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
      float *s = S + (size_t)j * rb + v;
      __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s), mu));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(l + v, _mm512_fmadd_ps(_mm512_loadu_ps(l + v), a, sum));
    _mm512_storeu_ps(m + v, mn);
    _mm512_storeu_ps(alpha + v, a);
  }
}

INL void pv_block(const int NR, int n, const float *P, int rb, const float *V, int ldv,
                  const float *alpha, float *acc, int lda) {
  __m512 a[4][4];
  for (int i = 0; i < NR; i++) {
    __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < 4; c++)
      a[i][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + (size_t)i * lda + 16 * c));
  }
  for (int j = 0; j < n; j++) {
    __m512 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(V + (size_t)j * ldv + 16 * c);
    for (int i = 0; i < NR; i++) {
      __m512 p = _mm512_set1_ps(P[(size_t)j * rb + i]);
      for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(p, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NR; i++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)i * lda + 16 * c, a[i][c]);
}

#define PV_FN(NR)                                                                         \
  static TGT void pv_##NR(int n, const float *P, int rb, const float *V, int ldv,         \
                          const float *alpha, float *acc, int lda) {                      \
    pv_block(NR, n, P, rb, V, ldv, alpha, acc, lda);                                      \
  }
PV_FN(1) PV_FN(2) PV_FN(3) PV_FN(4)
typedef void (*pv_fn)(int, const float *, int, const float *, int, const float *, float *, int);
static const pv_fn pv_tab[4] = {pv_1, pv_2, pv_3, pv_4};

static TGT void pv_avx512(int n, int rows, const float *P /* [n, rb] */, int rb,
                          const float *V /* [n, ldv] */, int ldv, int dvp,
                          const float *alpha /* [rows] */, float *acc /* [rows, lda] */,
                          int lda) {
  /* Column chunks outermost: one 64-wide slice of the V tile stays in L1
   * while every row group streams over it. */
  for (int e0 = 0; e0 < dvp; e0 += 64)
    for (int r0 = 0; r0 < rows; r0 += 4) {
      const int nr = rows - r0 < 4 ? rows - r0 : 4;
      pv_tab[nr - 1](n, P + r0, rb, V + e0, ldv, alpha + r0, acc + (size_t)r0 * lda + e0, lda);
    }
}

static TGT void f16_avx512(const uint16_t *src, float *dst, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
  for (; i < n; i++) dst[i] = mla_f16_to_f32(src[i]);
}

static TGT void bf16_avx512(const uint16_t *src, float *dst, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  for (; i < n; i++) dst[i] = mla_bf16_to_f32(src[i]);
}

/* e4m3 by bit surgery instead of a table gather: a normal byte's exponent
 * and mantissa shift into place with the bias moved from 7 to 127; a
 * subnormal (exponent 0) is mantissa * 2^-9; 0x7f / 0xff is NaN. */
static TGT void e4m3_avx512(const uint8_t *src, const float *lut, float scale, float *dst, int n) {
  const __m512 vs = _mm512_set1_ps(scale);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    __m512 v = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    v = _mm512_mask_mul_ps(v, sub, _mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
    v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(v, vs));
  }
  for (; i < n; i++) dst[i] = lut[src[i]] * scale;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = 2^(-2 |x| log2(e)): no overflow,
 * and the absolute error stays at a few fp32 ulps of 1 (what a logit
 * needs; the relative error near 0 is larger, the absolute is not). */
static TGT void softcap_avx512(float *x, int n, float cap2) {
  const __m512 k2 = _mm512_set1_ps(-2.0f * 1.4426950408889634f), one = _mm512_set1_ps(1.0f);
  const __m512 vc = _mm512_set1_ps(cap2);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __m512 a = _mm512_abs_ps(v);
    __m512 e = exp2_avx512(_mm512_mul_ps(a, k2));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    /* copy the sign of v onto t */
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u));
    t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(vc, t));
  }
  for (; i < n; i++) x[i] = cap2 * tanhf(x[i]);
}

static const mla_cpu_kernels k_avx512 = {MLA_CPU_ISA_AVX512, "avx512", qk_avx512,
                                         softmax_avx512, pv_avx512, f16_avx512, bf16_avx512,
                                         e4m3_avx512, softcap_avx512};

const mla_cpu_kernels *mla_cpu_kernels_avx512(void) { return &k_avx512; }

#else
const mla_cpu_kernels *mla_cpu_kernels_avx512(void) { return NULL; }
#endif
