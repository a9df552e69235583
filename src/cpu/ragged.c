/* Ragged (varlen) MHA on the CPU: the EXTEND prefill path (192/128) and the
 * prefix-chunk path of chunked-prefix MHA.
 *
 * Work item = (request, kv head, block of the query heads sharing it,
 * RAG_SUB blocks of query tokens), each block at most RAG_ROWS (token, head)
 * rows, so a key/value tile
 * converted to fp32 once serves every query head of its group. Items are
 * numbered kv head first, query block last, so the items a worker takes in
 * a chunk walk the same head's keys while they are in its L2; the next
 * tile's k / v rows are prefetched a line at a time by the kernels
 * (mla_cpu_pf). Key rows of a tile are MLA_MAX_HEAD_DIM floats apart (a
 * compile-time stride for the scores kernel). An item holds RAG_SUB
 * (2 for large head dims) consecutive query blocks of RAG_ROWS rows and
 * walks the keys once: each k / v tile of RAG_KEYS rows is converted to
 * fp32 once and used by every query block that sees it (a query block past
 * the causal limit of a tile skips it), which divides the conversion work
 * by the block count (measured: 2K causal 192/128 from 44 % to ~50 % of
 * the FMA peak with 4 blocks and 64-key tiles; 2 blocks gave ~45 %). There
 * is no workspace argument and no allocation on the hot path: the tiles
 * live in the context's per-worker scratch (allocated with its workers),
 * ~455 KiB for 192/128, at most ~480 KiB (RAG_SUB_DIMS): far too much for
 * the stack of a caller's thread.
 *
 * Tensor sizes cannot be checked: q has qo_indptr[bs] rows and k / v have
 * kv_indptr[bs] rows, each of the documented width; the caller guarantees
 * the buffers are that large. */
#include <limits.h>

#include "cpu.h"

#define RAG_ROWS 64
#define RAG_KEYS 64
/* Query blocks of RAG_ROWS rows per item (one k / v tile serves them all):
 * RAG_SUB, or 2 for head dims above RAG_SUB_DIMS (qk_dim + padded v_dim)
 * so the stack tiles stay below ~480 KiB (256/256: ~420 KiB). */
#define RAG_SUB 4
#define RAG_SUB_DIMS 320

typedef struct rg_job {
  const mla_ragged_args *a;
  const mla_cpu_kernels *k;
  int G;       /* query heads per kv head */
  int hb, qb;  /* heads and tokens per item */
  int nhb;     /* head blocks per kv head */
  float qscale;
  float cap2;  /* softcap * log2(e) (0 = off) */
  int nsub;    /* query blocks per item (<= RAG_SUB) */
  float *scratch;         /* the context's per-worker tile memory */
  size_t scratch_floats;  /* floats per worker */
} rg_job;

static int64_t items_of(const rg_job *J, int i) {
  const int Q = J->a->qo_indptr[i + 1] - J->a->qo_indptr[i];
  return mla_cdiv(Q, (int64_t)J->qb * J->nsub) * J->a->num_kv_heads * J->nhb;
}

/* Per-worker tiles, carved from the context's scratch (floats, 64-byte
 * aligned). They are too large (~0.5 MB at 256/256) for the stack of a
 * caller's thread, and the context allocates them once, with its workers. */
typedef struct rg_tiles {
  float *QT;  /* [RAG_SUB][dqk, RAG_ROWS] */
  float *Kt;  /* [RAG_KEYS, KT_LD] */
  float *Vt;  /* [RAG_KEYS, dvp] */
  float *S;   /* [RAG_KEYS, RAG_ROWS] */
  float *acc; /* [RAG_SUB][RAG_ROWS, dvp] */
  float *stage; /* [16, dqk]: query rows before the transpose */
  int32_t *idx; /* [RAG_KEYS]: the next tile's row indices (prefetch) */
} rg_tiles;

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Key rows of the tile are MLA_MAX_HEAD_DIM floats apart whatever qk_dim
 * is: a compile-time stride lets the scores kernel address every key of a
 * block from one register (kernels_avx512.c). */
#define KT_LD MLA_MAX_HEAD_DIM

static size_t tiles_floats(int nsub, int dqk, int dvp) {
  return (size_t)nsub * al16((size_t)dqk * RAG_ROWS) + al16((size_t)RAG_KEYS * KT_LD) +
         al16((size_t)RAG_KEYS * dvp) + al16((size_t)RAG_KEYS * RAG_ROWS) +
         (size_t)nsub * al16((size_t)RAG_ROWS * dvp) + al16((size_t)16 * dqk) + al16(RAG_KEYS);
}

static rg_tiles tiles_carve(float *buf, int nsub, int dqk, int dvp) {
  rg_tiles t;
  float *p = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
  t.QT = p, p += (size_t)nsub * al16((size_t)dqk * RAG_ROWS);
  t.Kt = p, p += al16((size_t)RAG_KEYS * KT_LD);
  t.Vt = p, p += al16((size_t)RAG_KEYS * dvp);
  t.S = p, p += al16((size_t)RAG_KEYS * RAG_ROWS);
  t.acc = p, p += (size_t)nsub * al16((size_t)RAG_ROWS * dvp);
  t.stage = p, p += al16((size_t)16 * dqk);
  t.idx = (int32_t *)p;
  return t;
}

/* The online-softmax state of one block of query rows. */
typedef struct rg_sub {
  int qa0, nq, rows, rb, minlim, maxlim;
  float *QT, *acc;
  float m[RAG_ROWS], l[RAG_ROWS], alpha[RAG_ROWS];
  int lim[RAG_ROWS];
} rg_sub;

static void run_item(const rg_job *J, const rg_tiles *T, int req, int64_t local) {
  const mla_ragged_args *a = J->a;
  const mla_cpu_kernels *k = J->k;
  const int H = a->num_heads, Hkv = a->num_kv_heads;
  const int dqk = a->qk_dim, dv = a->v_dim, dvp = mla_cpu_round_up(dv, MLA_CPU_DV_ALIGN);
  const int64_t q0g = a->qo_indptr[req], k0g = a->kv_indptr[req];
  const int Q = a->qo_indptr[req + 1] - a->qo_indptr[req];
  const int K = a->kv_indptr[req + 1] - a->kv_indptr[req];

  /* kv head outermost, query blocks innermost: consecutive items (which a
   * worker takes in chunks) read the same head's keys, still in its L2 */
  const int nqb = (int)mla_cdiv(Q, (int64_t)J->qb * J->nsub);
  const int g = (int)(local / ((int64_t)J->nhb * nqb));
  const int rest = (int)(local % ((int64_t)J->nhb * nqb));
  const int hblk = rest / nqb, qblk = rest % nqb;
  const int h0 = g * J->G + hblk * J->hb;
  const int nh = g * J->G + J->G - h0 < J->hb ? g * J->G + J->G - h0 : J->hb;

  float *Kt = T->Kt, *Vt = T->Vt, *S = T->S;
  rg_sub sub[RAG_SUB];
  int nsub = 0, maxlim = -1;
  for (int s = 0; s < J->nsub; s++) {
    const int qa0 = (qblk * J->nsub + s) * J->qb;
    if (qa0 >= Q) break;
    rg_sub *u = &sub[nsub++];
    u->qa0 = qa0;
    u->nq = Q - qa0 < J->qb ? Q - qa0 : J->qb;
    u->rows = u->nq * nh;
    u->rb = mla_cpu_round_up(u->rows, MLA_CPU_ROW_ALIGN);
    u->QT = T->QT + (size_t)s * al16((size_t)dqk * RAG_ROWS);
    u->acc = T->acc + (size_t)s * al16((size_t)RAG_ROWS * dvp);
    u->minlim = INT_MAX, u->maxlim = -1;
    /* Query block, transposed and pre-scaled, 16 rows at a time; padded
     * rows are zero. */
    for (int r0 = 0; r0 < u->rb; r0 += 16) {
      for (int i = 0; i < 16; i++) {
        const int r = r0 + i;
        float *qrow = T->stage + (size_t)i * dqk;
        if (r < u->rows) {
          const int qa = qa0 + r / nh, h = h0 + r % nh;
          mla_cpu_load_act(k, a->act_dtype, a->q, ((q0g + qa) * H + h) * (int64_t)dqk, dqk,
                           qrow);
          u->lim[r] = a->causal ? K - Q + qa : K - 1;
          if (u->lim[r] < u->minlim) u->minlim = u->lim[r];
          if (u->lim[r] > u->maxlim) u->maxlim = u->lim[r];
        } else {
          memset(qrow, 0, (size_t)dqk * sizeof(float));
        }
        u->m[r] = -INFINITY;
        u->l[r] = 0.0f;
      }
      k->qt16(T->stage, dqk, dqk, J->qscale, 0, u->QT + r0, u->rb);
    }
    if (u->maxlim > maxlim) maxlim = u->maxlim;
    memset(u->acc, 0, (size_t)u->rows * dvp * sizeof(float));
  }
  /* value columns [dv, dvp) stay zero: the kernels compute on them */
  for (int j = 0; j < RAG_KEYS; j++) memset(Vt + (size_t)j * dvp + dv, 0, (size_t)(dvp - dv) * 4);

  /* Keys outermost: a k / v tile is converted once and used by every
   * query block of the item that sees it. */
  const int kend = K < maxlim + 1 ? K : maxlim + 1;
  const size_t es = mla_dtype_size(a->act_dtype);
  for (int kt = 0; kt < kend; kt += RAG_KEYS) {
    const int n = kend - kt < RAG_KEYS ? kend - kt : RAG_KEYS;
    for (int j = 0; j < n; j++) {
      const int64_t row = (k0g + kt + j) * Hkv + g;
      mla_cpu_load_act(k, a->act_dtype, a->k, row * dqk, dqk, Kt + (size_t)j * KT_LD);
      mla_cpu_load_act(k, a->act_dtype, a->v, row * dv, dv, Vt + (size_t)j * dvp);
    }
    /* The next tile's k and v rows into L2, a line at a time between the
     * kernels' FMAs (mla_cpu_pf; a head's rows are H * dim apart, too far
     * apart for the hardware prefetcher). */
    const int nn = kend - (kt + n) < RAG_KEYS ? kend - (kt + n) : RAG_KEYS;
    for (int j = 0; j < nn; j++) T->idx[j] = (int32_t)(k0g + kt + n + j);
    mla_cpu_pf pfk = {(const unsigned char *)a->k + (size_t)g * dqk * es, (size_t)Hkv * dqk * es,
                      T->idx, nn, 0, 0, 0};
    mla_cpu_pf pfv = {(const unsigned char *)a->v + (size_t)g * dv * es, (size_t)Hkv * dv * es,
                      T->idx, nn, 0, 0, 0};
    mla_cpu_conv cvk, cvv; /* prefetch only: nothing to convert */
    memset(&cvk, 0, sizeof cvk);
    memset(&cvv, 0, sizeof cvv);
    cvk.pf = &pfk;
    cvv.pf = &pfv;
    for (int s = 0; s < nsub; s++) {
      rg_sub *u = &sub[s];
      if (kt > u->maxlim) continue; /* no row of this block sees the tile */
      const int rows = u->rows, rb = u->rb;
      k->qk(n, dqk, Kt, KT_LD, u->QT, rb, S, 0, &cvk);
      if (J->cap2 > 0.0f) /* s2 = cap log2(e) tanh(scale q.k / cap): QT holds scale / cap */
        for (int j = 0; j < n; j++) k->softcap(S + (size_t)j * rb, rows, J->cap2);
      if (kt + n - 1 > u->minlim)
        for (int j = 0; j < n; j++)
          for (int r = 0; r < rows; r++)
            if (kt + j > u->lim[r]) S[j * rb + r] = -INFINITY;
      k->softmax(n, rb, S, u->m, u->l, u->alpha);
      k->pv(n, rows, S, rb, Vt, dvp, dvp, u->alpha, u->acc, dvp, &cvv);
    }
  }

  for (int s = 0; s < nsub; s++) {
    rg_sub *u = &sub[s];
    for (int r = 0; r < u->rows; r++) {
      const int64_t t = q0g + u->qa0 + r / nh;
      const int h = h0 + r % nh;
      float *o = u->acc + (size_t)r * dvp;
      double lse2;
      if (u->m[r] == -INFINITY) {
        memset(o, 0, (size_t)dv * sizeof(float));
        lse2 = -INFINITY;
      } else {
        const float inv = 1.0f / u->l[r];
        for (int e = 0; e < dv; e++) o[e] *= inv;
        lse2 = (double)u->m[r] + log2((double)u->l[r]);
      }
      mla_store_f32((a->flags & MLA_FLAG_OUT_F32) ? MLA_DTYPE_F32 : a->act_dtype, a->out,
                    (t * H + h) * (int64_t)dv, dv, o);
      if (a->lse)
        a->lse[t * H + h] = (float)((a->flags & MLA_FLAG_LSE_BASE2) ? lse2 : lse2 * MLA_CPU_LN2);
    }
  }
}

static void items_range(void *arg, int64_t b, int64_t e, int worker) {
  const rg_job *J = arg;
  const int dvp = mla_cpu_round_up(J->a->v_dim, MLA_CPU_DV_ALIGN);
  float *buf = J->scratch + (size_t)worker * J->scratch_floats;
  const rg_tiles T = tiles_carve(buf, J->nsub, J->a->qk_dim, dvp);
  int i = 0;
  int64_t first = 0;
  while (i < J->a->batch_size && first + items_of(J, i) <= b) first += items_of(J, i++);
  for (int64_t it = b; it < e; it++) {
    while (it - first >= items_of(J, i)) first += items_of(J, i++);
    run_item(J, &T, i, it - first);
  }
}

mla_status mla_cpu_attention_ragged(mla_ctx *ctx, const mla_ragged_args *args) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  MLA_CPU_REQUIRE_CPU_CTX(eb, ctx);
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, args);
  const mla_ragged_args *a = args;
  MLA_REQUIRE(eb, a->batch_size >= 0, MLA_ERR_INVALID_ARGUMENT, "args->batch_size = %d is negative",
              a->batch_size);
  MLA_REQUIRE(eb, a->num_heads >= 1 && a->num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "args->num_heads = %d, expected 1..%d", a->num_heads, MLA_MAX_HEADS);
  MLA_REQUIRE(eb, a->num_kv_heads >= 1 && a->num_heads % a->num_kv_heads == 0,
              MLA_ERR_INVALID_ARGUMENT,
              "args->num_kv_heads = %d must be >= 1 and divide num_heads = %d",
              a->num_kv_heads, a->num_heads);
  MLA_REQUIRE(eb, a->qk_dim >= 1 && a->qk_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
              "args->qk_dim = %d, expected 1..%d", a->qk_dim, MLA_MAX_HEAD_DIM);
  MLA_REQUIRE(eb, a->v_dim >= 1 && a->v_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
              "args->v_dim = %d, expected 1..%d", a->v_dim, MLA_MAX_HEAD_DIM);
  MLA_REQUIRE(eb, isfinite(a->scale) && a->scale > 0.0f, MLA_ERR_INVALID_ARGUMENT,
              "args->scale = %g, expected finite and > 0", (double)a->scale);
  MLA_REQUIRE(eb, isfinite(a->softcap) && a->softcap >= 0.0f, MLA_ERR_INVALID_ARGUMENT,
              "args->softcap = %g, expected finite and >= 0 (0 = off)", (double)a->softcap);
  MLA_REQUIRE(eb, a->causal == 0 || a->causal == 1, MLA_ERR_INVALID_ARGUMENT,
              "args->causal = %d, expected 0 or 1", a->causal);
  MLA_REQUIRE(eb, (a->flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_OUT_F32)) == 0,
              MLA_ERR_INVALID_ARGUMENT, "args->flags = 0x%x has unknown bits", a->flags);
  {
    mla_status st_ = mla_cpu_check_act(eb, __func__, "args->act_dtype", a->act_dtype);
    if (st_ != MLA_OK) return st_;
  }
  if (a->batch_size == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, a->qo_indptr);
  MLA_REQUIRE_PTR(eb, a->kv_indptr);
  MLA_REQUIRE(eb, a->qo_indptr[0] == 0 && a->kv_indptr[0] == 0, MLA_ERR_INVALID_ARGUMENT,
              "args->qo_indptr[0] and kv_indptr[0] must be 0");
  for (int i = 0; i < a->batch_size; i++) {
    MLA_REQUIRE(eb, a->qo_indptr[i + 1] >= a->qo_indptr[i], MLA_ERR_INVALID_ARGUMENT,
                "args->qo_indptr decreases at %d (%d -> %d)", i, (int)a->qo_indptr[i],
                (int)a->qo_indptr[i + 1]);
    MLA_REQUIRE(eb, a->kv_indptr[i + 1] >= a->kv_indptr[i], MLA_ERR_INVALID_ARGUMENT,
                "args->kv_indptr decreases at %d (%d -> %d)", i, (int)a->kv_indptr[i],
                (int)a->kv_indptr[i + 1]);
  }
  const int64_t Tq = a->qo_indptr[a->batch_size], Tk = a->kv_indptr[a->batch_size];
  if (Tq == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, a->q);
  MLA_REQUIRE_PTR(eb, a->out);
  if (Tk > 0) {
    MLA_REQUIRE_PTR(eb, a->k);
    MLA_REQUIRE_PTR(eb, a->v);
  }

  rg_job J;
  J.a = a;
  J.k = mla_cpu_kernels_get();
  J.G = a->num_heads / a->num_kv_heads;
  J.hb = J.G < RAG_ROWS ? J.G : RAG_ROWS;
  J.qb = RAG_ROWS / J.hb;
  J.nhb = (int)mla_cdiv(J.G, J.hb);
  J.nsub = a->qk_dim + mla_cpu_round_up(a->v_dim, MLA_CPU_DV_ALIGN) <= RAG_SUB_DIMS ? RAG_SUB : 2;
  J.scratch = ctx->cpu_scratch;
  J.scratch_floats = ctx->cpu_scratch_floats;
  if (a->softcap > 0.0f) {
    J.qscale = a->scale / a->softcap;
    J.cap2 = (float)(a->softcap * MLA_CPU_LOG2E);
  } else {
    J.qscale = (float)(a->scale * MLA_CPU_LOG2E);
    J.cap2 = 0.0f;
  }
  int64_t n = 0;
  for (int i = 0; i < a->batch_size; i++) n += items_of(&J, i);
  mla_parallel_for(ctx, n, 1, items_range, &J);
  return MLA_OK;
}

size_t mla_cpu_worker_scratch_floats(void) {
  /* The largest tiles any call can carve: RAG_SUB blocks at the widest dims
   * that still take them, or 2 blocks at 256/256; +16 for the alignment. */
  const int dmax = MLA_MAX_HEAD_DIM, dvmax = mla_cpu_round_up(MLA_MAX_HEAD_DIM, MLA_CPU_DV_ALIGN);
  size_t a = tiles_floats(2, dmax, dvmax);
  for (int dqk = 1; dqk <= dmax; dqk++) {
    int dvp = RAG_SUB_DIMS - dqk; /* widest v tile that still uses RAG_SUB blocks */
    dvp = dvp / MLA_CPU_DV_ALIGN * MLA_CPU_DV_ALIGN;
    if (dvp <= 0) break;
    if (dvp > dvmax) dvp = dvmax;
    size_t b = tiles_floats(RAG_SUB, dqk, dvp);
    if (b > a) a = b;
  }
  a += 16;
  /* The same scratch serves mla_expand_kv's tiles. */
  size_t ex = mla_cpu_expand_scratch_floats();
  return a > ex ? a : ex;
}
