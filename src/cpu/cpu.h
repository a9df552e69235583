/* Internal interface of the CPU attention kernels (not installed).
 *
 * Every attention path of the CPU backend is written as the same two small
 * matrix products over a tile of keys plus an online softmax:
 *
 *   S[j][r]  = sum_d K[j][d] * QT[d][r]          (scores: keys x query rows)
 *   acc[r][e] = alpha[r] * acc[r][e] + sum_j P[j][r] * V[j][e]
 *
 * The query block is stored transposed (QT, rows padded to a multiple of 16)
 * once per work item, so the per-key work never transposes anything and the
 * softmax bookkeeping is vectorised over query rows. Logits are kept in base 2
 * (the query block is pre-multiplied by scale * log2(e)) so the exponential
 * is an exp2; the LSE is converted to the caller's base at the end.
 *
 * The micro-kernels come in three builds (scalar C, AVX2+FMA+F16C, AVX-512F)
 * chosen once at run time from the CPU's features; MLA_CPU_ISA=scalar|avx2|
 * avx512 in the environment (or mla_cpu_set_isa() from a white-box test)
 * forces one. The schedule never depends on the ISA or on the thread count,
 * so one ISA gives bit-identical results for any number of threads.
 */
#ifndef MLA_CPU_CPU_H
#define MLA_CPU_CPU_H

#include "../cache/cache.h"
#include "../core/internal.h"

/* Tile geometry shared by the kernels. */
#define MLA_CPU_ROWS 64      /* max query rows (tokens x heads) of one work item */
#define MLA_CPU_ROW_ALIGN 16 /* query rows are padded to a multiple of this */
#define MLA_CPU_KEYS 64      /* max keys of one tile */
#define MLA_CPU_DV_ALIGN 64  /* value / accumulator width is padded to this */

typedef enum mla_cpu_isa {
  MLA_CPU_ISA_AUTO = -1,
  MLA_CPU_ISA_SCALAR = 0,
  MLA_CPU_ISA_AVX2 = 1,
  MLA_CPU_ISA_AVX512 = 2
} mla_cpu_isa;

typedef struct mla_cpu_kernels {
  mla_cpu_isa isa;
  const char *name;
  /* S [n, rb] = K [n, D] (row stride ldk) x QT [D, rb].
   * n <= MLA_CPU_KEYS, rb a multiple of MLA_CPU_ROW_ALIGN <= MLA_CPU_ROWS. */
  void (*qk)(int n, int D, const float *K, int ldk, const float *QT, int rb, float *S);
  /* Online-softmax step over one tile for rb rows: S [n, rb] holds base-2
   * logits (-inf = masked); on return S holds P = exp2(S - m_new), m [rb] the
   * running max, l [rb] the running sum (rescaled) and alpha [rb] the factor
   * by which the old accumulator must be scaled. A row that has seen no key
   * keeps m = -inf, l = 0, alpha = 1 and P = 0. */
  void (*softmax)(int n, int rb, float *S, float *m, float *l, float *alpha);
  /* acc [rows, lda] = alpha [rows] * acc + P^T x V for P [n, rb], V [n, ldv];
   * only the first dvp columns (a multiple of MLA_CPU_DV_ALIGN) are touched. */
  void (*pv)(int n, int rows, const float *P, int rb, const float *V, int ldv, int dvp,
             const float *alpha, float *acc, int lda);
  /* dst [n] = f16 / bf16 src [n] as float (exact). */
  void (*f16_to_f32)(const uint16_t *src, float *dst, int n);
  void (*bf16_to_f32)(const uint16_t *src, float *dst, int n);
  /* dst [n] = lut[src[i]] * scale (e4m3 bytes through a 256-entry table). */
  void (*e4m3_to_f32)(const uint8_t *src, const float *lut, float scale, float *dst, int n);
  /* Logit soft cap on base-2 logits: x [n] = cap2 * tanh(x) (cap2 = cap *
   * log2(e); the scores were computed with scale / cap folded in). */
  void (*softcap)(float *x, int n, float cap2);
} mla_cpu_kernels;

/* Activations (F32 / BF16 / F16) -> float: dst [n] = src[offset .. offset+n)
 * through the kernels' converters (mla_load_f32 semantics, vectorised). */
void mla_cpu_load_act(const mla_cpu_kernels *k, mla_dtype t, const void *src, int64_t offset,
                      int n, float *dst);

/* The kernels in use (auto-detected on first use unless forced). */
const mla_cpu_kernels *mla_cpu_kernels_get(void);
/* Force an ISA (AUTO = detect again). Returns 0 on success, -1 when the
 * machine (or the build) does not support it; then nothing changes. For
 * tests and benchmarks; not thread-safe against running kernels. */
int mla_cpu_set_isa(mla_cpu_isa isa);
/* 1 when the ISA can run here. */
int mla_cpu_isa_available(mla_cpu_isa isa);

/* Per-ISA tables (NULL when the build lacks that ISA). */
const mla_cpu_kernels *mla_cpu_kernels_scalar(void);
const mla_cpu_kernels *mla_cpu_kernels_avx2(void);
const mla_cpu_kernels *mla_cpu_kernels_avx512(void);

/* ---- cache rows ---------------------------------------------------------- */
/* What a tile loader needs to dequantize rows of one layer. */
typedef struct mla_cpu_rows {
  const unsigned char *base; /* layer storage [num_slots, row_bytes] */
  size_t row_bytes;
  mla_dtype dtype;
  float lut[256]; /* e4m3 byte -> value */
  float fp8_scale; /* FP8_E4M3: the layer's scale */
  const mla_cpu_kernels *k;
} mla_cpu_rows;

void mla_cpu_rows_init(mla_cpu_rows *rows, const mla_kv_cache *cache, int layer,
                       const mla_cpu_kernels *k);
/* Dequantize n rows: slots [n] -> c [n, ldc] (first 512) and, when r is not
 * NULL, r [n, ldr] (64). With r == NULL and ldc >= 576 the rope part lands in
 * c[512..575] (the absorbed kernel's [c | r] key rows). Slots unchecked. */
void mla_cpu_load_rows(const mla_cpu_rows *rows, const int32_t *slots, int n, float *c,
                       int ldc, float *r, int ldr);

/* exp2 of a float for the scalar paths (-inf -> 0). */
static inline float mla_cpu_exp2(float x) { return exp2f(x); }

#define MLA_CPU_LOG2E 1.44269504088896340736
#define MLA_CPU_LN2 0.69314718055994530942

/* Activation dtype check with the library's convention: a value outside the
 * enum is malformed (INVALID_ARGUMENT), a known dtype that cannot be an
 * activation (fp8, f64) is UNSUPPORTED. */
static inline mla_status mla_cpu_check_act(mla_errbuf *eb, const char *fn, const char *name,
                                           mla_dtype t) {
  if ((int)t < MLA_DTYPE_F32 || (int)t > MLA_DTYPE_F64)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "%s = %d is not an mla_dtype", name, (int)t);
  if (!mla_is_act_dtype(t))
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, fn, "%s = %s, expected f32, bf16 or f16", name,
                    mla_dtype_name(t));
  return MLA_OK;
}

static inline int mla_cpu_round_up(int x, int a) { return (x + a - 1) / a * a; }

#endif /* MLA_CPU_CPU_H */
