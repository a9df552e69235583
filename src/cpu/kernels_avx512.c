/* AVX-512F micro-kernels (see cpu.h for what each computes).
 *
 * Register blocking: scores use up to 16 keys x 1..4 vectors of 16 query
 * rows (16 to 24 accumulators, e.g. 4 loads + 6 broadcasts per 24 FMAs for
 * 64 rows), 16-row blocks the pair layout (12 keys x 2 vectors, qk16p);
 * P x V uses 6 rows x 64 value columns (24 accumulators). Block sizes are
 * compile-time constants of small always-inline functions so the
 * accumulators live in registers. The absorbed kernel's variants also
 * advance a pending bf16 conversion and a prefetch stream between FMAs
 * (conv_step; cpu.h: mla_cpu_conv / mla_cpu_pf).
 *
 * Measured on the development machine (a 2-core AVX-512 Xeon VM): in L1
 * these kernels run at ~70-78% of the FMA-only peak; an idealised loop with
 * the same 1:2 load:FMA mix reaches ~85%. vdpbf16ps runs at one per two
 * cycles there (half the fp32 FMA flop rate), see cpu.h. */
#include "cpu.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TGT __attribute__((target("avx512f")))
#define INL static inline __attribute__((always_inline)) TGT

/* 64 bf16 columns of a row to fp32 in pair-split order (cpu.h): per 32
 * columns the even ones (low halves shifted up) then the odd ones (high
 * halves masked). */
INL void conv_row64(const uint16_t *src /* [64] */, float *d /* [64] */) {
  const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i x0 = _mm512_loadu_si512((const void *)src);
  const __m512i x1 = _mm512_loadu_si512((const void *)(src + 32));
  _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)));
  _mm512_storeu_ps(d + 16, _mm512_castsi512_ps(_mm512_and_si512(x0, hi)));
  _mm512_storeu_ps(d + 32, _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)));
  _mm512_storeu_ps(d + 48, _mm512_castsi512_ps(_mm512_and_si512(x1, hi)));
}

/* One step of a pipelined conversion (cpu.h), the general form working
 * on *cv: a line of the rows to prefetch, and the next row's 64 columns. */
INL void conv_step_mem(mla_cpu_conv *cv) {
  mla_cpu_pf *pf = cv->pf;
  if (pf && pf->row < pf->rows) {
    if (pf->by_col) { /* two lines, column block by column block */
      for (int t = 0; t < 2 && pf->row < pf->rows; t++) {
        _mm_prefetch((const char *)pf->base + (size_t)pf->slots[pf->row] * pf->row_bytes +
                         pf->off,
                     _MM_HINT_T1);
        if (++pf->row == pf->rows && pf->off + 64 < pf->row_bytes) pf->off += 64, pf->row = 0;
      }
    } else {
      _mm_prefetch((const char *)pf->base + (size_t)pf->slots[pf->row] * pf->row_bytes + pf->off,
                   _MM_HINT_T1);
      pf->off += 64;
      if (pf->off >= pf->row_bytes) pf->off = 0, pf->row++;
    }
  }
  if (cv->next < cv->count) {
    const int i = cv->next++;
    const uint16_t *src =
        (const uint16_t *)(cv->base + (size_t)cv->slots[i] * cv->row_bytes) + cv->c0;
    float *d = cv->dst + (size_t)i * 64;
    conv_row64(src, d);
  }
}

/* The fast form (cv->rowp set; prefetch row by row through pf_rowp, or
 * none): the state is copied into locals for one kernel call, walked with
 * pointers (few registers: no spills onto the FMA ports) and written back
 * once. Working on *cv directly, every step reloads and re-stores its
 * fields (the kernels' float stores may alias them): ~50 uops a step. */
typedef struct conv_fast {
  const unsigned char *const *rp, *const *re; /* rows left to convert */
  size_t c0b;                                  /* byte offset of column c0 */
  float *d;                                    /* destination of *rp */
  const unsigned char *const *pp, *const *pb, *const *pe; /* prefetch rows */
  size_t poff, plim;
} conv_fast;

INL int conv_fast_ok(const mla_cpu_conv *cv) {
  const mla_cpu_pf *pf = cv->pf;
  return (cv->rowp || cv->next >= cv->count) &&
         (!pf || pf->row >= pf->rows || (cv->pf_rowp && !pf->by_col));
}

INL void cf_begin(conv_fast *s, const mla_cpu_conv *cv) {
  if (cv->rowp && cv->next < cv->count) {
    s->rp = cv->rowp + cv->next;
    s->re = cv->rowp + cv->count;
    s->c0b = 2 * (size_t)cv->c0;
    s->d = cv->dst + (size_t)cv->next * 64;
  } else {
    s->rp = s->re = NULL;
    s->c0b = 0;
    s->d = NULL;
  }
  const mla_cpu_pf *pf = cv->pf;
  if (pf && pf->row < pf->rows) {
    s->pb = cv->pf_rowp;
    s->pp = cv->pf_rowp + pf->row;
    s->pe = cv->pf_rowp + pf->rows;
    s->poff = pf->off;
    s->plim = pf->row_bytes;
  } else {
    s->pb = s->pp = s->pe = NULL;
    s->poff = s->plim = 0;
  }
}

INL void cf_end(const conv_fast *s, mla_cpu_conv *cv) {
  if (s->rp) cv->next = (int)(s->rp - cv->rowp);
  if (s->pb) {
    cv->pf->row = (int)(s->pp - s->pb);
    cv->pf->off = s->poff;
  }
}

INL void conv_step_fast(conv_fast *s) {
  /* one line, row after row. Two lines a step finished the next tile's
   * rows within the first ~6 score blocks of the 16-row path, a burst that
   * holds most line-fill buffers on memory latency while the kernels' own
   * L1 misses (the tile blocks, in L2) wait for them; one line spreads it
   * over the scores and the first value blocks (0-1 % faster at H = 16
   * and 128 on the 2-core VM, 2026-11-30, within its noise; first-columns-
   * first measured 1-2 % slower). */
  if (s->pp != s->pe) {
    _mm_prefetch((const char *)*s->pp + s->poff, _MM_HINT_T1);
    s->poff += 64;
    if (s->poff >= s->plim) s->poff = 0, s->pp++;
  }
  if (s->rp != s->re) {
    const uint16_t *src = (const uint16_t *)(*s->rp++ + s->c0b);
    float *d = s->d;
    s->d += 64;
    conv_row64(src, d);
  }
}

/* CV: 0 no conversion, 1 the general form on *cv, 2 the fast form. */
#define CV_BEGIN(CV, cv)                                                                     conv_fast cf_;                                                                             if ((CV) == 2) cf_begin(&cf_, cv)
#define CV_STEP(CV, cv)                                                                      do {                                                                                         if ((CV) == 1) conv_step_mem(cv);                                                          if ((CV) == 2) conv_step_fast(&cf_);                                                     } while (0)
#define CV_END(CV, cv)                                                                       do {                                                                                         if ((CV) == 2) cf_end(&cf_, cv);                                                         } while (0)

/* S [NK, 16 NV] (+)= K [NK, D] x QT [D, 16 NV]: NK x NV accumulators. With
 * CV, one row of the pending conversion every 4 steps of the reduction. */
INL void qk_block(const int NK, const int NV, const int CV, int D, const float *K, int ldk,
                  const float *QT, int rb, float *S, int accumulate, mla_cpu_conv *cv) {
  __m512 acc[16][4];
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++)
      acc[k][v] = accumulate ? _mm512_loadu_ps(S + (size_t)k * rb + 16 * v) : _mm512_setzero_ps();
  CV_BEGIN(CV, cv);
  for (int d = 0; d < D; d++) {
    if (CV && (d & 3) == 0) CV_STEP(CV, cv);
    __m512 q[4];
    for (int v = 0; v < NV; v++) q[v] = _mm512_loadu_ps(QT + (size_t)d * rb + 16 * v);
    for (int k = 0; k < NK; k++) {
      __m512 b = _mm512_set1_ps(K[(size_t)k * ldk + d]);
      for (int v = 0; v < NV; v++) acc[k][v] = _mm512_fmadd_ps(b, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(S + (size_t)k * rb + 16 * v, acc[k][v]);
  CV_END(CV, cv);
}

/* One function per block shape and key row stride. With the stride a
 * compile-time constant (64: the absorbed kernel's converted blocks, 256:
 * the ragged kernel's padded tiles) every key's broadcast is a displacement
 * from one base register; with a run-time stride each key needs an index
 * register of its own, and 16 keys would run out of them, so that variant
 * stops at 8 keys and ignores a pipelined conversion (cv). */
#define QK_FN(NK, NV, LD)                                                                  \
  static TGT void qk##LD##_##NK##_##NV(int D, const float *K, int ldk, const float *QT,    \
                                       int rb, float *S, int accumulate, mla_cpu_conv *cv) { \
    if (LD != 0 && cv && conv_fast_ok(cv))                                                 \
      qk_block(NK, NV, 2, D, K, LD, QT, rb, S, accumulate, cv);                            \
    else if (LD != 0 && cv)                                                                \
      qk_block(NK, NV, 1, D, K, LD, QT, rb, S, accumulate, cv);                            \
    else                                                                                   \
      qk_block(NK, NV, 0, D, K, LD ? LD : ldk, QT, rb, S, accumulate, cv);                 \
  }
/* Key counts per block for 1..4 row vectors: the largest count leaves
 * enough independent accumulators (16..24 of the 32 registers) to hide the
 * FMA latency on two ports. Smaller counts finish a tile's tail (greedy,
 * largest first). */
#define QK_FNS(LD, NK1)                                                                    \
  QK_FN(NK1, 1, LD) QK_FN(8, 1, LD) QK_FN(4, 1, LD) QK_FN(2, 1, LD) QK_FN(1, 1, LD)        \
  QK_FN(8, 2, LD) QK_FN(4, 2, LD) QK_FN(2, 2, LD) QK_FN(1, 2, LD)                          \
  QK_FN(6, 3, LD) QK_FN(4, 3, LD) QK_FN(2, 3, LD) QK_FN(1, 3, LD)                          \
  QK_FN(6, 4, LD) QK_FN(4, 4, LD) QK_FN(2, 4, LD) QK_FN(1, 4, LD)
QK_FNS(64, 16)
QK_FNS(256, 16)
QK_FN(8, 1, 0) QK_FN(4, 1, 0) QK_FN(2, 1, 0) QK_FN(1, 1, 0)
QK_FN(8, 2, 0) QK_FN(4, 2, 0) QK_FN(2, 2, 0) QK_FN(1, 2, 0)
QK_FN(6, 3, 0) QK_FN(4, 3, 0) QK_FN(2, 3, 0) QK_FN(1, 3, 0)
QK_FN(6, 4, 0) QK_FN(4, 4, 0) QK_FN(2, 4, 0) QK_FN(1, 4, 0)

typedef void (*qk_fn)(int, const float *, int, const float *, int, float *, int, mla_cpu_conv *);
typedef struct qk_step {
  int nk;
  qk_fn fn;
} qk_step;
#define QK_TAB(LD, NK1)                                                                    \
  {{{NK1, qk##LD##_##NK1##_1}, {8, qk##LD##_8_1}, {4, qk##LD##_4_1}, {2, qk##LD##_2_1},     \
    {1, qk##LD##_1_1}},                                                                     \
   {{8, qk##LD##_8_2}, {4, qk##LD##_4_2}, {2, qk##LD##_2_2}, {1, qk##LD##_1_2}, {0, NULL}}, \
   {{6, qk##LD##_6_3}, {4, qk##LD##_4_3}, {2, qk##LD##_2_3}, {1, qk##LD##_1_3}, {0, NULL}}, \
   {{6, qk##LD##_6_4}, {4, qk##LD##_4_4}, {2, qk##LD##_2_4}, {1, qk##LD##_1_4}, {0, NULL}}}
static const qk_step qk_steps64[4][5] = QK_TAB(64, 16);
static const qk_step qk_steps256[4][5] = QK_TAB(256, 16);
static const qk_step qk_steps0[4][5] = QK_TAB(0, 8);

/* The reduction is cut into blocks of QK_DB so the block of QT (at most
 * 16 KiB for 64 rows) and the keys' slices stay in L1 while every key of
 * the tile streams past them; S carries the partial sums between blocks. */
#define QK_DB 64

static TGT void qk_avx512(int n, int D, const float *K /* [n, ldk] */, int ldk,
                          const float *QT /* [D, rb] */, int rb, float *S /* [n, rb] */,
                          int accumulate, mla_cpu_conv *cv) {
  const int nv = rb / 16;
  const qk_step(*steps)[5] = ldk == 64 ? qk_steps64 : ldk == 256 ? qk_steps256 : qk_steps0;
  for (int d0 = 0; d0 < D; d0 += QK_DB) {
    const int db = D - d0 < QK_DB ? D - d0 : QK_DB;
    const int acc = accumulate || d0 > 0;
    for (int v0 = 0; v0 < nv; v0 += 4) {
      const int nvb = nv - v0 < 4 ? nv - v0 : 4;
      const qk_step *st = steps[nvb - 1];
      int j = 0;
      for (int s = 0; j < n; s++) {
        while (n - j >= st[s].nk) {
          st[s].fn(db, K + (size_t)j * ldk + d0, ldk, QT + (size_t)d0 * rb + 16 * v0, rb,
                   S + (size_t)j * rb + 16 * v0, acc, cv);
          j += st[s].nk;
        }
      }
    }
  }
}

/* ---- 16-row scores in pair layout (cpu.h: qt16p / qk16p / red16p) -------- */
/* Vector v of pair p (columns 2p, 2p + 1) holds rows 8v .. 8v + 7, lane
 * 2i + e = row 8v + i at column 2p + e. A 64-bit broadcast of two key
 * values (a pure load) feeds two FMAs, so 8 keys x 2 vectors take 2 vector
 * and 8 broadcast loads per 16 FMAs instead of a broadcast per FMA. Each
 * accumulator keeps two partial sums per row, reduced once per tile. (A
 * 4-wide variant with 128-bit broadcasts measured slower: that broadcast
 * costs a shuffle on an FMA port.) Tiles run 12 keys at a time (24
 * accumulators, ~1-2 % faster than 8 in place, 82 % vs 79 % of peak in
 * L1); a 12-key block steps the conversion every 2 pairs so that 64 rows
 * still fit in one block's calls. */

INL void qkp_block(const int NK, const int CV, int D, const float *K, const float *QTp,
                   float *S2, int accumulate, mla_cpu_conv *cv) {
  __m512 acc[12][2];
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < 2; v++)
      acc[k][v] = accumulate ? _mm512_loadu_ps(S2 + (size_t)k * 32 + 16 * v) : _mm512_setzero_ps();
  CV_BEGIN(CV, cv);
#pragma GCC unroll 2
  for (int p = 0; p < D / 2; p++) {
    if (CV && (p & (NK > 8 ? 1 : 3)) == 0) CV_STEP(CV, cv);
    const __m512 q0 = _mm512_loadu_ps(QTp + (size_t)p * 32);
    const __m512 q1 = _mm512_loadu_ps(QTp + (size_t)p * 32 + 16);
    for (int k = 0; k < NK; k++) {
      double pair; /* two adjacent key values as one 64-bit lane */
      memcpy(&pair, K + (size_t)k * 64 + 2 * p, sizeof pair);
      const __m512 b = _mm512_castpd_ps(_mm512_set1_pd(pair));
      acc[k][0] = _mm512_fmadd_ps(b, q0, acc[k][0]);
      acc[k][1] = _mm512_fmadd_ps(b, q1, acc[k][1]);
    }
  }
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < 2; v++) _mm512_storeu_ps(S2 + (size_t)k * 32 + 16 * v, acc[k][v]);
  CV_END(CV, cv);
}

#define QKP_FN(NK)                                                                         \
  static TGT void qkp_##NK(int D, const float *K, const float *QTp, float *S2,             \
                           int accumulate, mla_cpu_conv *cv) {                             \
    if (cv && conv_fast_ok(cv))                                                            \
      qkp_block(NK, 2, D, K, QTp, S2, accumulate, cv);                                     \
    else if (cv)                                                                           \
      qkp_block(NK, 1, D, K, QTp, S2, accumulate, cv);                                     \
    else                                                                                   \
      qkp_block(NK, 0, D, K, QTp, S2, accumulate, cv);                                     \
  }
QKP_FN(12) QKP_FN(10) QKP_FN(8) QKP_FN(4) QKP_FN(2) QKP_FN(1)

static TGT void qk16p_avx512(int n, int D, const float *K /* [n, 64] */,
                             const float *QTp /* [D / 2][2][16] */, float *S2 /* [n, 32] */,
                             int accumulate, mla_cpu_conv *cv) {
  int j = 0;
  /* A full tile (64 = 5 x 12 + 4) would end on a 4-key block, whose 8
   * accumulators barely cover the FMA latency (profiled ~30 % slower per
   * key than 12; the whole call gained < 1 %): such counts (12 k + 4,
   * k >= 3) run their last 40 keys as 4 x 10. Same sums, same order. */
  const int tens = n % 12 == 4 && n >= 40 ? 4 : 0;
  for (; j + 12 <= n - 10 * tens; j += 12)
    qkp_12(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv);
  for (int t = 0; t < tens; t++, j += 10)
    qkp_10(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv);
  for (; j + 12 <= n; j += 12) qkp_12(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv);
  if (n - j >= 8) qkp_8(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv), j += 8;
  if (n - j >= 4) qkp_4(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv), j += 4;
  if (n - j >= 2) qkp_2(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv), j += 2;
  if (n - j >= 1) qkp_1(D, K + (size_t)j * 64, QTp, S2 + (size_t)j * 32, accumulate, cv);
}

/* qk16p over nb column blocks in one call (cpu.h: qk16pb): a 12-key block
 * keeps its 24 accumulators in registers across all the blocks. A call per
 * 64-column block (32 pair steps) spent a large part of its time starting
 * and ending: a tile's scores ran at 75 % of the FMA peak in L1 that way,
 * 84 % with the 9 blocks in one call. */
INL void qkpb_block(const int NK, const int CV, int nb, const float *K, size_t bstride,
                    const float *QTp, float *S2, int accumulate, mla_cpu_conv *cv) {
  __m512 acc[12][2];
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < 2; v++)
      acc[k][v] =
          accumulate ? _mm512_loadu_ps(S2 + (size_t)k * 32 + 16 * v) : _mm512_setzero_ps();
  CV_BEGIN(CV, cv);
  /* a conversion step every SP pair steps, the pairs of a step unrolled
   * (a step inside a loop of single pairs cost a test and a branch each) */
  const int SP = NK > 8 ? 2 : 4;
  for (int b = 0; b < nb; b++) {
    const float *Kb = K + (size_t)b * bstride, *Qb = QTp + (size_t)b * 32 * 32;
    for (int p0 = 0; p0 < 32; p0 += SP) {
      if (CV) CV_STEP(CV, cv);
      for (int p = p0; p < p0 + SP; p++) {
        const __m512 q0 = _mm512_loadu_ps(Qb + (size_t)p * 32);
        const __m512 q1 = _mm512_loadu_ps(Qb + (size_t)p * 32 + 16);
        for (int k = 0; k < NK; k++) {
          double pair; /* two adjacent key values as one 64-bit lane */
          memcpy(&pair, Kb + (size_t)k * 64 + 2 * p, sizeof pair);
          const __m512 x = _mm512_castpd_ps(_mm512_set1_pd(pair));
          acc[k][0] = _mm512_fmadd_ps(x, q0, acc[k][0]);
          acc[k][1] = _mm512_fmadd_ps(x, q1, acc[k][1]);
        }
      }
    }
  }
  for (int k = 0; k < NK; k++)
    for (int v = 0; v < 2; v++) _mm512_storeu_ps(S2 + (size_t)k * 32 + 16 * v, acc[k][v]);
  CV_END(CV, cv);
}

#define QKPB_FN(NK)                                                                        \
  static TGT void qkpb_##NK(int nb, const float *K, size_t bstride, const float *QTp,      \
                            float *S2, int acc, mla_cpu_conv *cv) {                        \
    if (cv && conv_fast_ok(cv))                                                            \
      qkpb_block(NK, 2, nb, K, bstride, QTp, S2, acc, cv);                                 \
    else if (cv)                                                                           \
      qkpb_block(NK, 1, nb, K, bstride, QTp, S2, acc, cv);                                 \
    else                                                                                   \
      qkpb_block(NK, 0, nb, K, bstride, QTp, S2, acc, cv);                                 \
  }
QKPB_FN(12) QKPB_FN(10) QKPB_FN(8) QKPB_FN(4) QKPB_FN(2) QKPB_FN(1)

static TGT void qk16pb_avx512(int n, int nb, const float *K /* nb x [n, 64] */,
                              size_t bstride, const float *QTp /* [nb * 32][2][16] */,
                              float *S2 /* [n, 32] */, int accumulate, mla_cpu_conv *cv) {
  int j = 0;
  const int tens = n % 12 == 4 && n >= 40 ? 4 : 0; /* as qk16p_avx512 */
#define QKPB_CALL(NK) \
  qkpb_##NK(nb, K + (size_t)j * 64, bstride, QTp, S2 + (size_t)j * 32, accumulate, cv)
  for (; j + 12 <= n - 10 * tens; j += 12) QKPB_CALL(12);
  for (int t = 0; t < tens; t++, j += 10) QKPB_CALL(10);
  for (; j + 12 <= n; j += 12) QKPB_CALL(12);
  if (n - j >= 8) QKPB_CALL(8), j += 8;
  if (n - j >= 4) QKPB_CALL(4), j += 4;
  if (n - j >= 2) QKPB_CALL(2), j += 2;
  if (n - j >= 1) QKPB_CALL(1);
#undef QKPB_CALL
}

/* S [n, 16] = the sums of S2's two partials per row. */
static TGT void red16p_avx512(int n, const float *S2 /* [n, 32] */, float *S /* [n, 16] */) {
  /* lanes 0..7 <- even (odd) lanes of a, lanes 8..15 <- even (odd) lanes of b */
  const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int j = 0; j < n; j++) {
    const __m512 a = _mm512_loadu_ps(S2 + (size_t)j * 32), b = _mm512_loadu_ps(S2 + (size_t)j * 32 + 16);
    _mm512_storeu_ps(S + (size_t)j * 16, _mm512_add_ps(_mm512_permutex2var_ps(a, ev, b),
                                                       _mm512_permutex2var_ps(a, od, b)));
  }
}

static TGT void qt16_avx512(const float *Q, int ldq, int D, float scale, int split, float *QT,
                            int rb);

static TGT void qt16p_avx512(const float *Q /* [16, ldq] */, int ldq, int D, float scale,
                             int split, float *QTp /* [D / 2][2][16] */) {
  /* the plain transposed block, then each pair of its rows interleaved in
   * place (rows 2p and 2p + 1 occupy exactly pair p's 32 floats) */
  qt16_avx512(Q, ldq, D, scale, split, QTp, 16);
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int p = 0; p < D / 2; p++) {
    float *x = QTp + (size_t)p * 32;
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    _mm512_storeu_ps(x, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(a, hi, b));
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

INL void pv_block(const int NR, const int CV, int n, const float *P, int rb, const float *V,
                  int ldv, const float *alpha, float *acc, int lda, mla_cpu_conv *cv) {
  __m512 a[6][4];
  for (int i = 0; i < NR; i++) {
    /* alpha is 1 whenever the row's running max did not move (most tiles
     * after the first few): skip the multiplies, they take FMA ports */
    const int scale = alpha && alpha[i] != 1.0f;
    __m512 al = _mm512_set1_ps(scale ? alpha[i] : 1.0f);
    for (int c = 0; c < 4; c++) {
      a[i][c] = _mm512_loadu_ps(acc + (size_t)i * lda + 16 * c);
      if (scale) a[i][c] = _mm512_mul_ps(al, a[i][c]);
    }
  }
  CV_BEGIN(CV, cv);
#pragma GCC unroll 2
  for (int j = 0; j < n; j++) {
    if (CV && (j & 1) == 0) CV_STEP(CV, cv);
    __m512 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(V + (size_t)j * ldv + 16 * c);
    for (int i = 0; i < NR; i++) {
      __m512 p = _mm512_set1_ps(P[(size_t)j * rb + i]);
      for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(p, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NR; i++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)i * lda + 16 * c, a[i][c]);
  CV_END(CV, cv);
}

#define PV_ROWS 6 /* rows per P x V block (24 accumulators) */
#define PV_FN(NR)                                                                         \
  static TGT void pv_##NR(int n, const float *P, int rb, const float *V, int ldv,         \
                          const float *alpha, float *acc, int lda, mla_cpu_conv *cv) {    \
    if (cv && conv_fast_ok(cv))                                                           \
      pv_block(NR, 2, n, P, rb, V, ldv, alpha, acc, lda, cv);                             \
    else if (cv)                                                                          \
      pv_block(NR, 1, n, P, rb, V, ldv, alpha, acc, lda, cv);                             \
    else                                                                                  \
      pv_block(NR, 0, n, P, rb, V, ldv, alpha, acc, lda, cv);                             \
  }
PV_FN(1) PV_FN(2) PV_FN(3) PV_FN(4) PV_FN(5) PV_FN(6)
typedef void (*pv_fn)(int, const float *, int, const float *, int, const float *, float *, int,
                      mla_cpu_conv *);
static const pv_fn pv_tab[6] = {pv_1, pv_2, pv_3, pv_4, pv_5, pv_6};

static TGT void pv_avx512(int n, int rows, const float *P /* [n, rb] */, int rb,
                          const float *V /* [n, ldv] */, int ldv, int dvp,
                          const float *alpha /* [rows] */, float *acc /* [rows, lda] */,
                          int lda, mla_cpu_conv *cv) {
  /* Column chunks outermost: one 64-wide slice of the V tile stays in L1
   * while every row group streams over it. */
  for (int e0 = 0; e0 < dvp; e0 += 64)
    for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
      const int nr = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;
      pv_tab[nr - 1](n, P + r0, rb, V + e0, ldv, alpha ? alpha + r0 : NULL,
                     acc + (size_t)r0 * lda + e0, lda, cv);
    }
}

/* ---- 16-row P x V with the rows as lanes (cpu.h: pdup16p / pv16p) ------- */
/* The transpose of qk16p: the keys are the reduction, a register block of
 * NP column pairs of the accumulator (2 NP registers) streams over them;
 * per key 2 vector loads of Pd and NP 64-bit broadcasts of V feed 2 NP
 * FMAs, and each V element is loaded once. A 64-column block runs as 12 +
 * 12 + 8 pairs (bytes 0-95, 96-191, 192-255 of each V row). The pending
 * conversion steps every 2 keys: 64 rows fit in the first two register
 * blocks. */

INL void pvp_block(const int NP, const int CV, int n, const float *Pd, const float *V,
                   const float *alphad, float *accp, mla_cpu_conv *cv) {
  __m512 acc[12][2];
  for (int p = 0; p < NP; p++)
    for (int v = 0; v < 2; v++) {
      acc[p][v] = _mm512_loadu_ps(accp + (size_t)p * 32 + 16 * v);
      if (alphad) acc[p][v] = _mm512_mul_ps(acc[p][v], _mm512_loadu_ps(alphad + 16 * v));
    }
  CV_BEGIN(CV, cv);
  /* a conversion step every 2 keys, the two keys unrolled (a step inside a
   * loop of single keys cost a test and a branch each) */
  for (int j0 = 0; j0 < n; j0 += 2) {
    if (CV) CV_STEP(CV, cv);
    for (int j = j0; j < j0 + 2; j++) {
      if (j0 + 1 == n && j > j0) break; /* odd n: the last key alone */
      const __m512 p0 = _mm512_loadu_ps(Pd + (size_t)j * 32);
      const __m512 p1 = _mm512_loadu_ps(Pd + (size_t)j * 32 + 16);
      for (int p = 0; p < NP; p++) {
        double pair; /* two adjacent values of V row j as one 64-bit lane */
        memcpy(&pair, V + (size_t)j * 64 + 2 * p, sizeof pair);
        const __m512 b = _mm512_castpd_ps(_mm512_set1_pd(pair));
        acc[p][0] = _mm512_fmadd_ps(b, p0, acc[p][0]);
        acc[p][1] = _mm512_fmadd_ps(b, p1, acc[p][1]);
      }
    }
  }
  for (int p = 0; p < NP; p++)
    for (int v = 0; v < 2; v++) _mm512_storeu_ps(accp + (size_t)p * 32 + 16 * v, acc[p][v]);
  CV_END(CV, cv);
}

#define PVP_FN(NP)                                                                         \
  static TGT void pvp_##NP(int n, const float *Pd, const float *V, const float *alphad,    \
                           float *accp, mla_cpu_conv *cv) {                                \
    if (cv && conv_fast_ok(cv))                                                            \
      pvp_block(NP, 2, n, Pd, V, alphad, accp, cv);                                        \
    else if (cv)                                                                           \
      pvp_block(NP, 1, n, Pd, V, alphad, accp, cv);                                        \
    else                                                                                   \
      pvp_block(NP, 0, n, Pd, V, alphad, accp, cv);                                        \
  }
PVP_FN(12) PVP_FN(8)

static TGT void pv16p_avx512(int n, const float *Pd /* [n][2][16] */,
                             const float *V /* [n, 64] */, const float *alphad /* [2][16] */,
                             float *accp /* [32][2][16] */, mla_cpu_conv *cv) {
  pvp_12(n, Pd, V, alphad, accp, cv);
  pvp_12(n, Pd, V + 24, alphad, accp + 12 * 32, cv);
  pvp_8(n, Pd, V + 48, alphad, accp + 24 * 32, cv);
}

static TGT void pdup16p_avx512(int n, const float *P /* [n, 16] */, const float *alpha /* [16] */,
                               float *Pd /* [n][2][16] */, float *alphad /* [2][16] */) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int j = 0; j < n; j++) {
    const __m512 x = _mm512_loadu_ps(P + (size_t)j * 16);
    _mm512_storeu_ps(Pd + (size_t)j * 32, _mm512_permutexvar_ps(lo, x));
    _mm512_storeu_ps(Pd + (size_t)j * 32 + 16, _mm512_permutexvar_ps(hi, x));
  }
  if (alpha) {
    const __m512 x = _mm512_loadu_ps(alpha);
    _mm512_storeu_ps(alphad, _mm512_permutexvar_ps(lo, x));
    _mm512_storeu_ps(alphad + 16, _mm512_permutexvar_ps(hi, x));
  }
}

/* t = the 8 x 8 transpose of x's 64-bit lanes (lane q of t[i] = lane i of
 * x[q]): 2 x 2 blocks of 64-bit lanes, then 4 x 4 of 128-bit, then 8 x 8.
 * x is clobbered. Pure data movement (unpack16p, merge16p). */
static TGT inline void transpose8_pd(__m512d x[8], __m512d t[8]) {
  const __m512i i0 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i i1 = _mm512_add_epi64(i0, _mm512_set1_epi64(2));
  for (int q = 0; q < 8; q += 2) {
    t[q] = _mm512_unpacklo_pd(x[q], x[q + 1]);
    t[q + 1] = _mm512_unpackhi_pd(x[q], x[q + 1]);
  }
  for (int q = 0; q < 8; q += 4)
    for (int e = 0; e < 2; e++) {
      x[q + e] = _mm512_permutex2var_pd(t[q + e], i0, t[q + e + 2]);
      x[q + e + 2] = _mm512_permutex2var_pd(t[q + e], i1, t[q + e + 2]);
    }
  for (int e = 0; e < 4; e++) { /* low and high 256 bits of x[e], x[e + 4] */
    t[e] = _mm512_shuffle_f64x2(x[e], x[e + 4], 0x44);
    t[e + 4] = _mm512_shuffle_f64x2(x[e], x[e + 4], 0xee);
  }
}

/* 8 column pairs x 2 vectors = rows 0..15 x 16 columns: the vectors v of
 * pairs q = 0..7, read as 8 64-bit lanes i (the pair's two columns for row
 * 8v + i), are transposed 8 x 8 so that lane q of result i holds row
 * 8v + i's pair q: 16 consecutive columns of that row. */
static TGT void unpack16p_avx512(const float *accp /* [w / 2][2][16] */, int w,
                                 float *acc /* [16, lda] */, int lda) {
  for (int c0 = 0; c0 < w; c0 += 16)
    for (int v = 0; v < 2; v++) {
      __m512d x[8], t[8];
      for (int q = 0; q < 8; q++)
        x[q] = _mm512_castps_pd(_mm512_loadu_ps(accp + (size_t)(c0 / 2 + q) * 32 + 16 * v));
      transpose8_pd(x, t);
      for (int i = 0; i < 8; i++)
        _mm512_storeu_pd((double *)(acc + (size_t)(8 * v + i) * lda + c0), t[i]);
    }
}

/* cpu.h: merge16p. For each 16 columns, the 8 column pairs' vectors are
 * merged over the pieces (FMAs on 8 rows at once) and then transposed as
 * in unpack16p, so the pieces' states need no unpacking of their own and
 * the merge's arithmetic is a sixteenth of pv's on single rows. */
static TGT void merge16p_avx512(int np, const float *part /* np x [256][16] */, size_t pstride,
                                const float *wd /* [np][16] */, float *rows /* [8, ldr] */,
                                int ldr) {
  for (int c0 = 0; c0 < MLA_LATENT; c0 += 16) {
    __m512d x[8], t[8];
    const float *src = part + (size_t)(c0 / 2) * 16;
    __m512 a[8];
    for (int q = 0; q < 8; q++) a[q] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
      const __m512 w = _mm512_loadu_ps(wd + (size_t)p * 16);
      const float *s = src + (size_t)p * pstride;
      for (int q = 0; q < 8; q++)
        a[q] = _mm512_fmadd_ps(w, _mm512_loadu_ps(s + (size_t)q * 16), a[q]);
    }
    for (int q = 0; q < 8; q++) x[q] = _mm512_castps_pd(a[q]);
    transpose8_pd(x, t);
    for (int i = 0; i < 8; i++) _mm512_storeu_pd((double *)(rows + (size_t)i * ldr + c0), t[i]);
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

/* bf16 cache rows in the "pair-split" order (see cpu.h): a 32-bit word holds
 * elements 2i (low half) and 2i+1 (high half), so a shift and a mask turn 16
 * words into the 16 even and the 16 odd elements as fp32, without a shuffle. */
static TGT void bf16_rows_avx512(const unsigned char *base, size_t row_bytes,
                                 const int32_t *slots /* [n] */, int n, int c0, int w,
                                 float *dst /* [w / 64][n, ldd] */, int ldd, size_t bstride) {
  const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
  for (int i = 0; i < n; i++) {
    const uint16_t *src = (const uint16_t *)(base + (size_t)slots[i] * row_bytes) + c0;
    float *d = dst + (size_t)i * ldd;
    for (int c = 0; c < w; c += 64, d += bstride) { /* one 64-column block */
      const __m512i x0 = _mm512_loadu_si512((const void *)(src + c));
      const __m512i x1 = _mm512_loadu_si512((const void *)(src + c + 32));
      _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)));
      _mm512_storeu_ps(d + 16, _mm512_castsi512_ps(_mm512_and_si512(x0, hi)));
      _mm512_storeu_ps(d + 32, _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)));
      _mm512_storeu_ps(d + 48, _mm512_castsi512_ps(_mm512_and_si512(x1, hi)));
    }
  }
}

/* 16 x 16 transpose in registers (4 rounds of 16 shuffles). */
INL void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; j++) {
      r[i + j] = _mm512_castpd_ps(
          _mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
      r[i + j + 2] = _mm512_castpd_ps(
          _mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; j++) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; j++) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

/* After transpose16 the output order of rows is a fixed permutation of
 * the input columns: row k of the result holds column tr_col[k]. */
static const int tr_col[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};

static TGT void qt16_avx512(const float *Q /* [16, ldq] */, int ldq, int D, float scale,
                            int split, float *QT /* [D, rb] */, int rb) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  __m512 r[16];
  int d = 0;
  if (split) {
    for (; d + 32 <= D; d += 32)
      for (int half = 0; half < 2; half++) { /* evens, then odds of the group */
        for (int i = 0; i < 16; i++) {
          const __m512 a = _mm512_loadu_ps(Q + (size_t)i * ldq + d);
          const __m512 b = _mm512_loadu_ps(Q + (size_t)i * ldq + d + 16);
          r[i] = _mm512_mul_ps(vs, _mm512_permutex2var_ps(a, half ? od : ev, b));
        }
        transpose16(r);
        for (int k = 0; k < 16; k++)
          _mm512_storeu_ps(QT + (size_t)(d + 16 * half + tr_col[k]) * rb, r[k]);
      }
  } else {
    for (; d + 16 <= D; d += 16) {
      for (int i = 0; i < 16; i++) r[i] = _mm512_mul_ps(vs, _mm512_loadu_ps(Q + (size_t)i * ldq + d));
      transpose16(r);
      for (int k = 0; k < 16; k++) _mm512_storeu_ps(QT + (size_t)(d + tr_col[k]) * rb, r[k]);
    }
  }
  for (; d < D; d++) {
    const int c = split ? MLA_CPU_SPLIT32(d) : d;
    for (int i = 0; i < 16; i++) QT[(size_t)d * rb + i] = Q[(size_t)i * ldq + c] * scale;
  }
}

/* qt16p with split order from bf16 rows (cpu.h: qt16p_bf16): per group
 * of 32 columns, a row's 16 words give its even columns (shifted up) and
 * odd ones (masked), exactly the two halves of the pair-split order; the
 * 16 rows of each half are transposed in registers and each pair of
 * transposed rows interleaved into the pair layout as qt16p does. The
 * staged version (rows to fp32, qt16p, its in-place interleave) spent
 * ~10 us per call moving 100 KiB through L1 and L2 in the serial prologue
 * of a split decode call. */
static TGT void qt16p_bf16_avx512(const uint16_t *const *qn /* [16] -> [512] */,
                                  const uint16_t *const *qr /* [16] -> [64] */, float scale,
                                  float *QTp /* [288][2][16] */) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int g = 0; g < MLA_ROW; g += 32) {
    __m512 e[16], o[16];
    for (int i = 0; i < 16; i++) {
      const uint16_t *src = g < MLA_LATENT ? (qn[i] ? qn[i] + g : NULL)
                                           : (qr[i] ? qr[i] + (g - MLA_LATENT) : NULL);
      const __m512i x = src ? _mm512_loadu_si512((const void *)src) : _mm512_setzero_si512();
      e[i] = _mm512_mul_ps(vs, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
      o[i] = _mm512_mul_ps(vs, _mm512_castsi512_ps(_mm512_and_si512(x, hi16)));
    }
    transpose16(e); /* e[k]: position tr_col[k] of the group's first half */
    transpose16(o);
    for (int half = 0; half < 2; half++) {
      const __m512 *t = half ? o : e;
      float *dst = QTp + (size_t)(g / 2 + 8 * half) * 32;
      for (int j = 0; j < 8; j++) { /* pair j of the half: positions 2j, 2j + 1 */
        const __m512 a = t[tr_col[2 * j]], b = t[tr_col[2 * j + 1]];
        _mm512_storeu_ps(dst + (size_t)j * 32, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(dst + (size_t)j * 32 + 16, _mm512_permutex2var_ps(a, hi, b));
      }
    }
  }
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

/* 16 floats -> bf16, round to nearest even, a NaN quieted as
 * mla_f32_to_bf16 does ((u >> 16) | 0x40). */
INL __m256i bf16_of(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i r = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

static TGT void out512_avx512(const float *acc /* [512] */, int split, float inv, int bf16,
                              void *dst /* [512] f32 or bf16 */) {
  const __m512 vi = _mm512_set1_ps(inv);
  /* pair-split group of 32: positions 0..15 = even columns, 16..31 = odd */
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int g = 0; g < MLA_LATENT; g += 32) {
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + g), vi);
    const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(acc + g + 16), vi);
    __m512 x0 = a, x1 = b;
    if (split) {
      x0 = _mm512_permutex2var_ps(a, lo, b);
      x1 = _mm512_permutex2var_ps(a, hi, b);
    }
    if (bf16) {
      uint16_t *d = (uint16_t *)dst + g;
      _mm256_storeu_si256((__m256i *)d, bf16_of(x0));
      _mm256_storeu_si256((__m256i *)(d + 16), bf16_of(x1));
    } else {
      float *d = (float *)dst + g;
      _mm512_storeu_ps(d, x0);
      _mm512_storeu_ps(d + 16, x1);
    }
  }
}

static const mla_cpu_kernels k_avx512 = {MLA_CPU_ISA_AVX512, "avx512",  qk_avx512,
                                         softmax_avx512,     pv_avx512, f16_avx512,
                                         bf16_avx512,        e4m3_avx512, softcap_avx512,
                                         bf16_rows_avx512,   qt16_avx512,
                                         qt16p_avx512,       qk16p_avx512,
                                         red16p_avx512,      pdup16p_avx512,
                                         pv16p_avx512,       unpack16p_avx512,
                                         qk16pb_avx512,      out512_avx512,
                                         qt16p_bf16_avx512,  merge16p_avx512};

const mla_cpu_kernels *mla_cpu_kernels_avx512(void) { return &k_avx512; }

#else
const mla_cpu_kernels *mla_cpu_kernels_avx512(void) { return NULL; }
#endif
