/* White-box test of the AVX-512 16-row pair kernels (src/cpu/cpu.h:
 * qk16pb, pdup16p, pv16p, unpack16p, merge16p) against the kernels they
 * stand in for (qk16p, pv; merge16p: unpack16p, then pv with a row of
 * weights). They compute the same sums in the same order, so the
 * results must be bit-identical, for every key count (the 12 / 10 / 8 /
 * 4 / 2 / 1-key blocks, odd counts). With a pending bf16 conversion
 * (mla_cpu_conv, the fast form with row addresses and the general one)
 * the converted rows must equal bf16_rows' and the products must not
 * change. Passes with "skipped" where the build or the machine lacks
 * AVX-512. */
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "test_util.h"

#define ROWB 1152 /* bytes of a bf16 cache row (576 columns) */
#define NROWS 96  /* rows of the fake cache */

static tu_rng rng;

static void fill(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = (float)tu_normal(&rng);
}

/* accp [32][2][16] <-> acc [16, 64]: lane 2i + e of vector v of pair p is
 * row 8v + i, column 2p + e (the layout cpu.h describes). */
static void pack(const float *acc, float *accp) {
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 64; c++)
      accp[(c / 2) * 32 + (r / 8) * 16 + 2 * (r % 8) + c % 2] = acc[r * 64 + c];
}

static int same(const float *a, const float *b, size_t n) {
  return memcmp(a, b, n * sizeof(float)) == 0;
}

/* A conversion of rows slots[0..n) columns [c0, c0 + 64) into dst, with
 * (fast != 0) or without the row addresses, and a prefetch of other rows. */
typedef struct conv_case {
  mla_cpu_conv cv;
  mla_cpu_pf pf;
  const unsigned char *rowp[NROWS], *pfp[NROWS];
} conv_case;

/* fast: 0 the general form, 1 the fast one (row addresses) */
static void conv_setup(conv_case *c, const unsigned char *raw, const int32_t *slots, int n,
                       int c0, float *dst, int fast) {
  memset(c, 0, sizeof *c);
  for (int i = 0; i < NROWS; i++) c->rowp[i] = raw + (size_t)slots[i] * ROWB;
  for (int i = 0; i < 8; i++) c->pfp[i] = raw + (size_t)slots[NROWS - 1 - i] * ROWB;
  c->pf = (mla_cpu_pf){raw, ROWB, slots + NROWS - 8, 8, 0, 0, 0};
  /* the general form walks pf.slots front to back; the fast one pf_rowp */
  c->cv = (mla_cpu_conv){raw, ROWB, slots, c0, dst, 0, n, &c->pf,
                         fast ? c->rowp : NULL, fast ? c->pfp : NULL};
}

int main(void) {
  rng.s = tu_seed("test_cpu_pair16", 4242);
  const mla_cpu_kernels *k = mla_cpu_kernels_avx512();
  if (!k || !mla_cpu_isa_available(MLA_CPU_ISA_AVX512) || !k->qk16pb || !k->pv16p) {
    printf("skipped: no AVX-512 kernels on this build / machine\n");
    return tu_finish("test_cpu_pair16");
  }
  float *K = aligned_alloc(64, sizeof(float) * 9 * 64 * 64);   /* 9 blocks [64, 64] */
  float *QTp = aligned_alloc(64, sizeof(float) * 288 * 32);    /* [288][2][16] */
  float *S2a = aligned_alloc(64, sizeof(float) * 64 * 32), *S2b = aligned_alloc(64, sizeof(float) * 64 * 32);
  float *P = aligned_alloc(64, sizeof(float) * 64 * 16), *Pd = aligned_alloc(64, sizeof(float) * 64 * 32);
  float *V = aligned_alloc(64, sizeof(float) * 64 * 64);
  float *acc0 = aligned_alloc(64, sizeof(float) * 16 * 64), *accr = aligned_alloc(64, sizeof(float) * 16 * 64);
  float *accp = aligned_alloc(64, sizeof(float) * 16 * 64), *got = aligned_alloc(64, sizeof(float) * 16 * 64);
  float *cdst = aligned_alloc(64, sizeof(float) * NROWS * 64), *cref = aligned_alloc(64, sizeof(float) * NROWS * 64);
  unsigned char *raw = malloc((size_t)NROWS * ROWB + 16);
  float alpha[16], alphad[32];
  int32_t slots[NROWS];
  if (!K || !QTp || !S2a || !S2b || !P || !Pd || !V || !acc0 || !accr || !accp || !got || !cdst ||
      !cref || !raw) {
    TU_CHECK(0, "out of memory");
    return tu_finish("test_cpu_pair16");
  }
  /* bf16 rows at a 16-byte offset, as a calloc'd cache's are */
  unsigned char *rows = raw + 16;
  for (size_t i = 0; i < (size_t)NROWS * ROWB / 2; i++) {
    const float f = (float)tu_normal(&rng);
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t h = (uint16_t)(u >> 16);
    memcpy(rows + 2 * i, &h, 2);
  }
  for (int i = 0; i < NROWS; i++) slots[i] = i;
  tu_shuffle_i32(&rng, slots, NROWS);

  static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 16, 20, 23, 24, 33, 40, 52, 63, 64};
  for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
    const int n = ns[t];
    fill(K, 9 * 64 * 64);
    fill(QTp, 288 * 32);
    /* scores: 9 calls of qk16p against one of qk16pb, and one split 4 + 5 */
    for (int b = 0; b < 9; b++) k->qk16p(n, 64, K + b * 4096, QTp + b * 1024, S2a, b > 0, NULL);
    k->qk16pb(n, 9, K, 4096, QTp, S2b, 0, NULL);
    TU_CHECK(same(S2a, S2b, (size_t)n * 32), "qk16pb n=%d differs from 9 x qk16p", n);
    k->qk16pb(n, 4, K, 4096, QTp, S2b, 0, NULL);
    k->qk16pb(n, 5, K + 4 * 4096, 4096, QTp + 4 * 1024, S2b, 1, NULL);
    TU_CHECK(same(S2a, S2b, (size_t)n * 32), "qk16pb n=%d, 4 + 5 blocks, differs", n);
    /* with a pending conversion (both forms): same scores, rows converted */
    for (int fast = 0; fast < 2; fast++) {
      const int cn = tu_randint(&rng, 1, 64), c0 = 64 * tu_randint(&rng, 0, 8);
      conv_case cc;
      conv_setup(&cc, rows, slots, cn, c0, cdst, fast);
      k->qk16pb(n, 9, K, 4096, QTp, S2b, 0, &cc.cv);
      mla_cpu_conv_finish(k, &cc.cv);
      TU_CHECK(same(S2a, S2b, (size_t)n * 32), "qk16pb n=%d with a conversion differs", n);
      k->bf16_rows(rows, ROWB, slots, cn, c0, 64, cref, 64, 0);
      TU_CHECK(same(cdst, cref, (size_t)cn * 64), "conversion during qk16pb (fast %d) differs",
               fast);
    }

    /* P x V: pv against pdup16p + pv16p + unpack16p, alpha none / some */
    for (int ai = 0; ai < 3; ai++) {
      fill(V, 64 * 64);
      fill(acc0, 16 * 64);
      for (int j = 0; j < n * 16; j++) P[j] = (float)tu_uniform(&rng);
      int scale = 0;
      for (int r = 0; r < 16; r++) {
        alpha[r] = ai == 2 || tu_randint(&rng, 0, 1) ? 1.0f : (float)tu_uniform(&rng);
        scale |= alpha[r] != 1.0f;
      }
      const float *al = ai == 0 ? NULL : alpha;
      memcpy(accr, acc0, sizeof(float) * 16 * 64);
      k->pv(n, 16, P, 16, V, 64, 64, al, accr, 64, NULL);
      pack(acc0, accp);
      k->pdup16p(n, P, al && scale ? al : NULL, Pd, alphad);
      conv_case cc;
      const int cn = tu_randint(&rng, 1, 64), c0 = 64 * tu_randint(&rng, 0, 8);
      conv_setup(&cc, rows, slots, cn, c0, cdst, ai != 1);
      k->pv16p(n, Pd, V, al && scale ? alphad : NULL, accp, ai ? &cc.cv : NULL);
      mla_cpu_conv_finish(k, &cc.cv);
      k->unpack16p(accp, 64, got, 64);
      TU_CHECK(same(accr, got, 16 * 64), "pv16p n=%d alpha case %d differs from pv", n, ai);
      k->bf16_rows(rows, ROWB, slots, cn, c0, 64, cref, 64, 0);
      TU_CHECK(same(cdst, cref, (size_t)cn * 64), "conversion during pv16p (case %d) differs", ai);
    }
  }
  /* unpack16p over 512 columns into a wider row stride */
  {
    float *ap = aligned_alloc(64, sizeof(float) * 16 * 512), *rowsf = aligned_alloc(64, sizeof(float) * 16 * 528);
    if (ap && rowsf) {
      fill(ap, 16 * 512);
      k->unpack16p(ap, 512, rowsf, 528);
      int bad = 0;
      for (int r = 0; r < 16; r++)
        for (int c = 0; c < 512; c++)
          bad += rowsf[r * 528 + c] != ap[(c / 2) * 32 + (r / 8) * 16 + 2 * (r % 8) + c % 2];
      TU_CHECK(bad == 0, "unpack16p w=512: %d values misplaced", bad);
    }
    free(ap);
    free(rowsf);
  }
  /* merge16p against unpack16p + pv (the split-KV merge's two forms): 1
   * to 9 pieces, a padded piece stride, both halves of the pair layout
   * taken apart as the absorbed kernel stores them; the weights in
   * [0, 1), some exactly 0 (an empty piece's) */
  if (k->merge16p) {
    enum { MAXP = 9, PST = 16 * 528 };
    float *accps = aligned_alloc(64, sizeof(float) * MAXP * 16 * 512); /* [MAXP][256][2][16] */
    float *parts = aligned_alloc(64, sizeof(float) * MAXP * PST);       /* [MAXP][2][256][16] + pad */
    float *rowsp = aligned_alloc(64, sizeof(float) * MAXP * 16 * 512);
    float *mg = aligned_alloc(64, sizeof(float) * 8 * 520), *ref = aligned_alloc(64, sizeof(float) * 512);
    if (accps && parts && rowsp && mg && ref) {
      fill(accps, (size_t)MAXP * 16 * 512);
      fill(parts, (size_t)MAXP * PST);
      for (int p = 0; p < MAXP; p++) {
        const float *ap = accps + (size_t)p * 16 * 512;
        k->unpack16p(ap, 512, rowsp + (size_t)p * 16 * 512, 512);
        for (int v = 0; v < 2; v++)
          for (int q = 0; q < 256; q++)
            memcpy(parts + (size_t)p * PST + (size_t)v * 4096 + (size_t)q * 16, ap + (size_t)q * 32 + 16 * v,
                   16 * sizeof(float));
      }
      for (int np = 1; np <= MAXP; np++)
        for (int half = 0; half < 2; half++) {
          float wd[MAXP][16], w[16][MAXP];
          for (int p = 0; p < np; p++)
            for (int i = 0; i < 8; i++) {
              const float x = (p + i) % 5 == 3 ? 0.0f : (float)tu_uniform(&rng);
              wd[p][2 * i] = wd[p][2 * i + 1] = w[8 * half + i][p] = x;
            }
          k->merge16p(np, parts + (size_t)half * 4096, PST, &wd[0][0], mg, 520);
          int bad = 0;
          for (int i = 0; i < 8; i++) {
            const int r = 8 * half + i;
            memset(ref, 0, sizeof(float) * 512);
            k->pv(np, 1, w[r], 1, rowsp + (size_t)r * 512, 16 * 512, 512, NULL, ref, 512, NULL);
            bad += !same(ref, mg + (size_t)i * 520, 512);
          }
          TU_CHECK(bad == 0, "merge16p np=%d half %d: %d of 8 rows differ from unpack16p + pv", np, half, bad);
        }
    } else {
      TU_CHECK(0, "out of memory");
    }
    free(accps);
    free(parts);
    free(rowsp);
    free(mg);
    free(ref);
  }
  free(K);
  free(QTp);
  free(S2a);
  free(S2b);
  free(P);
  free(Pd);
  free(V);
  free(acc0);
  free(accr);
  free(accp);
  free(got);
  free(cdst);
  free(cref);
  free(raw);
  return tu_finish("test_cpu_pair16");
}
