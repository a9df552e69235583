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
 * All arithmetic is fp32 FMA on fp32 operands: cache rows and activations are
 * converted (exactly) to fp32 in small blocks right before use. On the
 * development machine (AVX512-BF16 present) vdpbf16ps measured at half the
 * fp32 FMA flop rate (one per two cycles), so a bf16 dot product path would
 * be slower than converting and would also round q to bf16; it is not used.
 * What makes the kernels fast instead (see absorbed.c): the scores are
 * accumulated over 64-column blocks that stay in L1, each cache row of a
 * tile is converted once (its latent blocks serve the scores and then
 * P x V), the conversion of the next block is software-pipelined into the
 * FMA loops (mla_cpu_conv), the next tile is prefetched a line at a time
 * (mla_cpu_pf), key row strides are compile-time constants in the hot
 * kernels, and 16-row items use pair-layout kernels (qk16p / qk16pb for
 * the scores, pv16p for P x V with the rows as lanes) that halve the
 * broadcast loads. Ragged MHA (ragged.c) walks the keys once per
 * group of RAG_SUB query blocks, so a converted k / v tile serves all of
 * them.
 *
 * The micro-kernels come in three builds (scalar C, AVX2+FMA+F16C, AVX-512F)
 * chosen once at run time from the CPU's features; MLA_CPU_ISA=scalar|avx2|
 * avx512 in the environment (or mla_cpu_set_isa() from a white-box test)
 * forces one; mla_ctx_cpu_isa() reports the choice. Optional entries of the
 * table are NULL in builds that lack them. The schedule never depends on
 * the ISA or on the thread count, so one ISA gives bit-identical results
 * for any number of threads (different ISAs differ in rounding only).
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

/* A conversion of bf16 cache rows that the AVX-512 micro-kernels advance
 * between their FMAs (software pipelining: the next block of a tile is
 * converted while the current one is computed, so the conversion's stores
 * overlap the arithmetic). Rows [next, count) of slots: columns [c0, c0 +
 * 64) -> dst [count, 64] in pair-split order. Kernels without the feature
 * leave it alone; mla_cpu_conv_finish converts what is left. */
typedef struct mla_cpu_conv {
  const unsigned char *base;
  size_t row_bytes;
  const int32_t *slots;
  int c0;
  float *dst;
  int next, count;
  struct mla_cpu_pf *pf; /* NULL, or rows to prefetch a line per step */
  /* NULL, or the rows' addresses (rowp[i] = base + slots[i] * row_bytes):
   * with them (and a pf that has them or nothing left to prefetch) the
   * AVX-512 kernels' steps cost a few uops instead of ~50 */
  const unsigned char *const *rowp;
  const unsigned char *const *pf_rowp; /* NULL, or the same for pf's rows (!by_col) */
} mla_cpu_conv;

/* Rows to bring into L2 a cache line at a time, spread over a tile's
 * computation (a burst of prefetches would stall on the fill buffers):
 * the next tile's rows while the current one is computed. */
typedef struct mla_cpu_pf {
  const unsigned char *base;
  size_t row_bytes;
  const int32_t *slots;
  int rows, row;  /* rows in all, the current one */
  size_t off;     /* byte offset of the next line in the current row */
  /* 0: one line per step, row after row. 1: two lines per step, line
   * offset after line offset (a line of every row, then the next line of
   * every row), so the first column blocks of all rows arrive first. */
  int by_col;
} mla_cpu_pf;

typedef struct mla_cpu_kernels {
  mla_cpu_isa isa;
  const char *name;
  /* S [n, rb] = K [n, D] (row stride ldk) x QT [D, rb], or S += ... when
   * accumulate is non-zero. n <= MLA_CPU_KEYS, rb a multiple of
   * MLA_CPU_ROW_ALIGN <= MLA_CPU_ROWS. */
  void (*qk)(int n, int D, const float *K, int ldk, const float *QT, int rb, float *S,
             int accumulate, mla_cpu_conv *cv);
  /* Online-softmax step over one tile for rb rows: S [n, rb] holds base-2
   * logits (-inf = masked); on return S holds P = exp2(S - m_new), m [rb] the
   * running max, l [rb] the running sum (rescaled) and alpha [rb] the factor
   * by which the old accumulator must be scaled. A row that has seen no key
   * keeps m = -inf, l = 0, alpha = 1 and P = 0. */
  void (*softmax)(int n, int rb, float *S, float *m, float *l, float *alpha);
  /* acc [rows, lda] = alpha [rows] * acc + P^T x V for P [n, rb], V [n, ldv]
   * (alpha NULL: no rescaling, acc += P^T x V); only the first dvp columns
   * (a multiple of MLA_CPU_DV_ALIGN) are touched. */
  void (*pv)(int n, int rows, const float *P, int rb, const float *V, int ldv, int dvp,
             const float *alpha, float *acc, int lda, mla_cpu_conv *cv);
  /* dst [n] = f16 / bf16 src [n] as float (exact). */
  void (*f16_to_f32)(const uint16_t *src, float *dst, int n);
  void (*bf16_to_f32)(const uint16_t *src, float *dst, int n);
  /* dst [n] = lut[src[i]] * scale (e4m3 bytes through a 256-entry table). */
  void (*e4m3_to_f32)(const uint8_t *src, const float *lut, float scale, float *dst, int n);
  /* Logit soft cap on base-2 logits: x [n] = cap2 * tanh(x) (cap2 = cap *
   * log2(e); the scores were computed with scale / cap folded in). */
  void (*softcap)(float *x, int n, float cap2);
  /* Columns [c0, c0 + w) of n bf16 rows (row i at base + slots[i] *
   * row_bytes) -> fp32 in pair-split order (MLA_CPU_SPLIT32), in blocks of
   * 64 columns: dst [w / 64][n, ldd], block b at dst + b * bstride. c0 and
   * w are multiples of 64. */
  void (*bf16_rows)(const unsigned char *base, size_t row_bytes, const int32_t *slots, int n,
                    int c0, int w, float *dst, int ldd, size_t bstride);
  /* Columns [0, 16) of QT [D, rb] = scale * Q [16, ldq] transposed: the
   * query block of 16 rows in the layout the scores kernel reads. QT's rows
   * follow the pair-split order (MLA_CPU_SPLIT32; D a multiple of 32) when
   * split is non-zero, the natural order otherwise (any D). */
  void (*qt16)(const float *Q, int ldq, int D, float scale, int split, float *QT, int rb);
  /* Optional (NULL when a build lacks them): the scores of exactly 16 rows
   * with the query block in "pair" layout, QTp [D / 2][2][16]: vector v of
   * pair p holds rows 8v .. 8v + 7, lane 2i + e = row 8v + i at column
   * 2p + e. One 64-bit broadcast of two key values then feeds two FMAs (the
   * plain 16-row layout needs a broadcast load per FMA and is load-bound).
   * qt16p builds QTp like qt16 with rb = 16 (D even, a multiple of 32 when
   * split). qk16p: S2 [n, 32] (+)= the unreduced products of K [n, D] (row
   * stride 64, D even) with QTp, two partial sums per row; red16p:
   * S [n, 16] = their sums. */
  void (*qt16p)(const float *Q, int ldq, int D, float scale, int split, float *QTp);
  void (*qk16p)(int n, int D, const float *K, const float *QTp, float *S2, int accumulate,
                mla_cpu_conv *cv);
  void (*red16p)(int n, const float *S2, float *S);
  /* Optional (NULL when a build lacks them): P x V for exactly 16 rows with
   * the query rows as the vector lanes, the transpose of qk16p's layout. The
   * accumulator is kept in "pair" layout, accp [dvp / 2][2][16]: vector v of
   * column pair p holds rows 8v .. 8v + 7, lane 2i + e = row 8v + i at
   * column 2p + e. One 64-bit broadcast of two adjacent values of a V row
   * then feeds two FMAs, and every V element is read once (the row-major
   * kernel reads a value block once per group of 6 rows); the same sums in
   * the same order as pv, so the results are bit-identical to it.
   * pdup16p: Pd [n][2][16] = P [n, 16] with every value twice (lane 2i + e
   * of vector v = P[j][8v + i]), alpha likewise into alphad [2][16] when
   * alpha is not NULL. pv16p: accp [32][2][16] = alphad * accp + the
   * products of Pd [n][2][16] with the 64 columns of V [n, 64] (row stride
   * 64; alphad NULL: no rescaling). unpack16p: acc [16, lda] (columns
   * [0, w)) = accp [w / 2][2][16] in row-major order (w a multiple of 16). */
  void (*pdup16p)(int n, const float *P, const float *alpha, float *Pd, float *alphad);
  void (*pv16p)(int n, const float *Pd, const float *V, const float *alphad, float *accp,
                mla_cpu_conv *cv);
  void (*unpack16p)(const float *accp, int w, float *acc, int lda);
  /* Optional: qk16p over nb column blocks in one call, the blocks at K +
   * b * bstride ([n, 64] each, row stride 64) and QTp [nb * 32][2][16]:
   * S2 [n, 32] (+)= the unreduced products (same sums, same order as nb
   * calls of qk16p; the accumulators stay in registers across the blocks). */
  void (*qk16pb)(int n, int nb, const float *K, size_t bstride, const float *QTp, float *S2,
                 int accumulate, mla_cpu_conv *cv);
  /* Optional: an output row, dst [512] = acc [512] * inv stored as f32
   * (bf16 == 0) or bf16 (round to nearest even, NaN kept quiet: exactly
   * mla_f32_to_bf16); acc in pair-split order (MLA_CPU_SPLIT32) when split
   * is non-zero, the natural order otherwise. The same products as the
   * scalar path, so the results are bit-identical to it. */
  void (*out512)(const float *acc, int split, float inv, int bf16, void *dst);
  /* Optional: qt16p (split order) straight from 16 bf16 query rows, no
   * fp32 staging: QTp [288][2][16] = scale * rows i = 0..15 of [q_nope [512]
   * at qn[i] | q_rope [64] at qr[i]] (qn[i] == NULL: a zero row). The same
   * products as loading the rows to fp32 and calling qt16p, so the results
   * are bit-identical. */
  void (*qt16p_bf16)(const uint16_t *const *qn, const uint16_t *const *qr, float scale,
                     float *QTp);
  /* Optional: the split-KV merge of 8 rows of np partial accumulators,
   * each one half of pv16p's pair layout taken apart: piece p's at part +
   * p * pstride, [256][16], vector q = column pair q of the 8 rows (lane
   * 2i + e = row i at column 2q + e). rows [8, ldr] (columns [0, 512), row-major) =
   * sum_p wd[p] * piece p's rows, wd [np][16] the weights in the same lane
   * order. Each sum is an FMA chain in piece order starting from 0, the
   * operations pv performs on the unpacked rows with a row of weights, so
   * the results are bit-identical to unpack16p followed by pv. */
  void (*merge16p)(int np, const float *part, size_t pstride, const float *wd, float *rows,
                   int ldr);
} mla_cpu_kernels;

/* Pair-split order of bf16 columns: within each aligned group of 32
 * columns, position p < 16 holds column 2p and position 16 + p column
 * 2p + 1. A 32-bit word of a bf16 row holds an even column in its low half
 * and the next odd column in its high half, so a shift and a mask convert
 * a vector of words to fp32 with no shuffle; the kernels lay out the query
 * (QT rows) and the accumulator columns in the same order and restore the
 * natural order only when the output is written. */
#define MLA_CPU_SPLIT32(p) ((((p) & ~31) | (((p) & 15) << 1)) + (((p) >> 4) & 1))

/* Convert the rows of cv the kernels did not get to. */
static inline void mla_cpu_conv_finish(const struct mla_cpu_kernels *k, mla_cpu_conv *cv) {
  if (cv->next < cv->count)
    k->bf16_rows(cv->base, cv->row_bytes, cv->slots + cv->next, cv->count - cv->next, cv->c0, 64,
                 cv->dst + (size_t)cv->next * 64, 64, 0);
  cv->next = cv->count;
}

/* The portable qt16 (the scalar and AVX2 tables use it). */
void mla_cpu_qt16_c(const float *Q, int ldq, int D, float scale, int split, float *QT, int rb);

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

/* Columns [c0, c0 + w) of n rows (any cache dtype, natural order) ->
 * dst [n, ldd]: the rows of a tile, one block of columns at a time. c0 and
 * w are multiples of 64 within [0, 576); a block never straddles the latent
 * / rope boundary nor an fp8 scale block. Slots unchecked. */
void mla_cpu_load_cols(const mla_cpu_rows *rows, const int32_t *slots, int n, int c0, int w,
                       float *dst, int ldd);

/* Prefetch one cache line into L2 (a hint; nothing where unsupported). */
#if defined(__GNUC__) || defined(__clang__)
#define MLA_CPU_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#else
#define MLA_CPU_PREFETCH_L2(p) ((void)(p))
#endif

/* exp2 of a float for the scalar paths (-inf -> 0). */
static inline float mla_cpu_exp2(float x) { return exp2f(x); }

#define MLA_CPU_LOG2E 1.44269504088896340736
#define MLA_CPU_LN2 0.69314718055994530942

/* The CPU kernels run on host memory: a CUDA context's tensors are device
 * pointers they must not touch. The CUDA kernels land with the CUDA issues. */
#define MLA_CPU_REQUIRE_CPU_CTX(EB, CTX)                                                    \
  MLA_REQUIRE(EB, (CTX)->device == MLA_DEVICE_CPU, MLA_ERR_UNSUPPORTED,                    \
              "no CUDA implementation of this call yet: use a CPU context")

/* The CPU implementations behind the public entry points (dispatched by
 * device in src/backend/dispatch.c). */
mla_status mla_cpu_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                     int num_heads, size_t *bytes);
mla_status mla_cpu_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                      const mla_plan *plan, const mla_absorbed_args *args,
                                      void *workspace, size_t workspace_bytes);
mla_status mla_cpu_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args);
mla_status mla_cpu_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads,
                                int head_dim, mla_dtype act_dtype, unsigned flags,
                                const void *const *o_parts, const float *const *lse_parts,
                                void *out, float *lse_out);

/* Floats of per-worker scratch the CPU kernels need (ragged MHA tiles); the
 * context allocates num_threads of these when its workers start. */
size_t mla_cpu_worker_scratch_floats(void);
size_t mla_cpu_expand_scratch_floats(void); /* part of the above */

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
