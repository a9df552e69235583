/* AVX2 + FMA + F16C micro-kernels (see cpu.h for what each computes).
 *
 * 16 ymm registers: scores use 4 keys x 2 vectors of 8 query rows (8
 * accumulators); P x V uses 2 rows x 32 value columns (8 accumulators). */
#include "cpu.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

INL void qk_block(const int NK, const int NV, int D, const float *K, int ldk, const float *QT,
                  int rb, float *S, int accumulate) {
  __m256 acc[4][2];
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++)
      acc[k][v] = accumulate ? _mm256_loadu_ps(S + (size_t)k * rb + 8 * v) : _mm256_setzero_ps();
  for (int d = 0; d < D; d++) {
    __m256 q[2];
    for (int v = 0; v < NV; v++) q[v] = _mm256_loadu_ps(QT + (size_t)d * rb + 8 * v);
    for (int k = 0; k < NK; k++) {
      __m256 b = _mm256_broadcast_ss(K + (size_t)k * ldk + d);
      for (int v = 0; v < NV; v++) acc[k][v] = _mm256_fmadd_ps(b, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(S + (size_t)k * rb + 8 * v, acc[k][v]);
}

#define QK_FN(NK)                                                                        \
  static TGT void qk_##NK(int D, const float *K, int ldk, const float *QT, int rb,       \
                          float *S, int accumulate) {                                    \
    qk_block(NK, 2, D, K, ldk, QT, rb, S, accumulate);                                   \
  }
QK_FN(1) QK_FN(2) QK_FN(3) QK_FN(4)
typedef void (*qk_fn)(int, const float *, int, const float *, int, float *, int);
static const qk_fn qk_tab[4] = {qk_1, qk_2, qk_3, qk_4};

/* Reduction blocks of QK_DB keep the QT block and the keys' slices in L1
 * (as in the AVX-512 build). */
#define QK_DB 64

static TGT void qk_avx2(int n, int D, const float *K /* [n, ldk] */, int ldk,
                        const float *QT /* [D, rb] */, int rb, float *S /* [n, rb] */,
                        int accumulate, mla_cpu_conv *cv) {
  (void)cv; /* no pipelined conversion: mla_cpu_conv_finish does it */
  /* rb is a multiple of 16, so vectors always come in pairs. */
  for (int d0 = 0; d0 < D; d0 += QK_DB) {
    const int db = D - d0 < QK_DB ? D - d0 : QK_DB;
    const int acc = accumulate || d0 > 0;
    for (int v0 = 0; v0 < rb; v0 += 16)
      for (int j = 0; j < n; j += 4) {
        const int nk = n - j < 4 ? n - j : 4;
        qk_tab[nk - 1](db, K + (size_t)j * ldk + d0, ldk, QT + (size_t)d0 * rb + v0, rb,
                       S + (size_t)j * rb + v0, acc);
      }
  }
}

/* 2^x, same method and constants as the AVX-512 version; the power of two
 * is built in the exponent field (x clamped to [-127, 127]). */
INL __m256 exp2_avx2(__m256 x) {
  __m256 xc = _mm256_max_ps(_mm256_set1_ps(-127.0f), x); /* NaN in x is returned */
  xc = _mm256_min_ps(_mm256_set1_ps(127.0f), xc);
  __m256 xi = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(xc, xi);
  __m256 p = _mm256_set1_ps(1.5252733804059838e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428441e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821576e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(xi), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  return _mm256_andnot_ps(tiny, r);
}

static TGT void softmax_avx2(int n, int rb, float *S /* [n, rb] */, float *m, float *l,
                             float *alpha) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int v = 0; v < rb; v += 8) {
    __m256 mt = ninf;
    for (int j = 0; j < n; j++)
      mt = _mm256_max_ps(_mm256_loadu_ps(S + (size_t)j * rb + v), mt); /* NaN never wins */
    __m256 mo = _mm256_loadu_ps(m + v);
    __m256 mn = _mm256_max_ps(mt, mo);
    __m256 empty = _mm256_cmp_ps(mn, ninf, _CMP_EQ_OQ);
    __m256 mu = _mm256_andnot_ps(empty, mn);
    __m256 a = exp2_avx2(_mm256_sub_ps(mo, mu));
    a = _mm256_blendv_ps(a, one, empty);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
      float *s = S + (size_t)j * rb + v;
      __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s), mu));
      _mm256_storeu_ps(s, p);
      sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(l + v, _mm256_fmadd_ps(_mm256_loadu_ps(l + v), a, sum));
    _mm256_storeu_ps(m + v, mn);
    _mm256_storeu_ps(alpha + v, a);
  }
}

INL void pv_block(const int NR, int n, const float *P, int rb, const float *V, int ldv,
                  const float *alpha, float *acc, int lda) {
  __m256 a[2][4];
  for (int i = 0; i < NR; i++) {
    __m256 al = _mm256_set1_ps(alpha ? alpha[i] : 1.0f);
    for (int c = 0; c < 4; c++) {
      a[i][c] = _mm256_loadu_ps(acc + (size_t)i * lda + 8 * c);
      if (alpha) a[i][c] = _mm256_mul_ps(al, a[i][c]);
    }
  }
  for (int j = 0; j < n; j++) {
    __m256 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_ps(V + (size_t)j * ldv + 8 * c);
    for (int i = 0; i < NR; i++) {
      __m256 p = _mm256_broadcast_ss(P + (size_t)j * rb + i);
      for (int c = 0; c < 4; c++) a[i][c] = _mm256_fmadd_ps(p, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NR; i++)
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (size_t)i * lda + 8 * c, a[i][c]);
}

static TGT void pv_1(int n, const float *P, int rb, const float *V, int ldv,
                     const float *alpha, float *acc, int lda) {
  pv_block(1, n, P, rb, V, ldv, alpha, acc, lda);
}
static TGT void pv_2(int n, const float *P, int rb, const float *V, int ldv,
                     const float *alpha, float *acc, int lda) {
  pv_block(2, n, P, rb, V, ldv, alpha, acc, lda);
}

static TGT void pv_avx2(int n, int rows, const float *P /* [n, rb] */, int rb,
                        const float *V /* [n, ldv] */, int ldv, int dvp,
                        const float *alpha /* [rows] */, float *acc /* [rows, lda] */, int lda,
                        mla_cpu_conv *cv) {
  (void)cv;
  for (int e0 = 0; e0 < dvp; e0 += 32)
    for (int r0 = 0; r0 < rows; r0 += 2) {
      const float *p = P + r0, *al = alpha ? alpha + r0 : NULL;
      float *a = acc + (size_t)r0 * lda + e0;
      if (rows - r0 >= 2)
        pv_2(n, p, rb, V + e0, ldv, al, a, lda);
      else
        pv_1(n, p, rb, V + e0, ldv, al, a, lda);
    }
}

static TGT void f16_avx2(const uint16_t *src, float *dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  for (; i < n; i++) dst[i] = mla_f16_to_f32(src[i]);
}

static TGT void bf16_avx2(const uint16_t *src, float *dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; i++) dst[i] = mla_bf16_to_f32(src[i]);
}

/* bf16 rows in pair-split order (cpu.h): shift / mask of 32-bit words. */
static TGT void bf16_rows_avx2(const unsigned char *base, size_t row_bytes,
                               const int32_t *slots /* [n] */, int n, int c0, int w,
                               float *dst /* [w / 64][n, ldd] */, int ldd, size_t bstride) {
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  for (int i = 0; i < n; i++) {
    const uint16_t *src = (const uint16_t *)(base + (size_t)slots[i] * row_bytes) + c0;
    float *d0 = dst + (size_t)i * ldd;
    for (int c = 0; c < w; c += 64, d0 += bstride)
      for (int g = 0; g < 64; g += 32) { /* the block's two groups of 32 */
        float *d = d0 + g;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(src + c + g));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(src + c + g + 16));
        _mm256_storeu_ps(d, _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)));
        _mm256_storeu_ps(d + 8, _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)));
        _mm256_storeu_ps(d + 16, _mm256_castsi256_ps(_mm256_and_si256(x0, hi)));
        _mm256_storeu_ps(d + 24, _mm256_castsi256_ps(_mm256_and_si256(x1, hi)));
      }
  }
}

/* e4m3 by bit surgery, as in the AVX-512 build. */
static TGT void e4m3_avx2(const uint8_t *src, const float *lut, float scale, float *dst, int n) {
  const __m256 vs = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
    __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    __m256 v = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 subv = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
    v = _mm256_blendv_ps(v, subv, sub);
    __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
    v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(v, vs));
  }
  for (; i < n; i++) dst[i] = lut[src[i]] * scale;
}

/* tanh as in the AVX-512 build. */
static TGT void softcap_avx2(float *x, int n, float cap2) {
  const __m256 k2 = _mm256_set1_ps(-2.0f * 1.4426950408889634f), one = _mm256_set1_ps(1.0f);
  const __m256 vc = _mm256_set1_ps(cap2), signbit = _mm256_set1_ps(-0.0f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 a = _mm256_andnot_ps(signbit, v);
    __m256 e = exp2_avx2(_mm256_mul_ps(a, k2));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    t = _mm256_or_ps(t, _mm256_and_ps(signbit, v));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(vc, t));
  }
  for (; i < n; i++) x[i] = cap2 * tanhf(x[i]);
}

static const mla_cpu_kernels k_avx2 = {MLA_CPU_ISA_AVX2, "avx2",  qk_avx2,      softmax_avx2,
                                       pv_avx2,          f16_avx2, bf16_avx2,    e4m3_avx2,
                                       softcap_avx2,     bf16_rows_avx2, mla_cpu_qt16_c,
                                       NULL,             NULL,           NULL,
                                       NULL,             NULL,           NULL,
                                       NULL,             NULL,
                                       NULL,             NULL};

const mla_cpu_kernels *mla_cpu_kernels_avx2(void) { return &k_avx2; }

#else
const mla_cpu_kernels *mla_cpu_kernels_avx2(void) { return NULL; }
#endif
