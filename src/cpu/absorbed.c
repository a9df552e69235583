/* Absorbed MLA attention on the CPU: every mode a plan describes (decode,
 * target verify, draft extend, extend over a prefix).
 *
 * Work item = (request, block of query tokens, block of heads), at most
 * MLA_CPU_ROWS (token, head) rows: the query heads (x query tokens) of a
 * request form one small matrix, so a cache row is read once for all of
 * them. An item walks its request's visible keys in tiles of MLA_CPU_KEYS
 * rows with an online softmax in fp32.
 *
 * A tile's rows are converted to fp32 once, in 9 blocks of COLS columns
 * (NBLK buffers of 16 KiB, 144 KiB per worker: they live in L2, each block
 * is hot in L1 while it is used). The 9 blocks feed the scores (accumulated
 * block by block into S); after the softmax the first 8 (c, the first 512
 * columns) are reused as the value blocks of P x V, so no row is converted
 * twice (an earlier version re-converted the value blocks through two L1
 * buffers: 17 conversions per row instead of 9, ~5 % slower for H = 16).
 * Each conversion overlaps a kernel call: the kernels advance a pending
 * conversion (mla_cpu_conv) a row at a time between their FMAs, so its
 * loads and stores overlap the arithmetic. The conversions are spread over
 * both phases: while value block b >= 1 is used, buffer b - 1 is free and
 * receives the next tile's block b - 1; the next tile's last two blocks are
 * converted during its first score blocks. The same steps prefetch the
 * next tile's rows into L2 (mla_cpu_pf, row after row), and a piece's
 * last tile prefetches the first tile of the piece its worker runs next.
 * The kernels walk the rows through their addresses (mla_cpu_conv.rowp /
 * pf_rowp, resolved once per tile), which keeps a step at a few uops. bf16
 * rows are converted in pair-split order (cpu.h): the query block and the
 * accumulator use that column order and the output restores the natural
 * one.
 *
 * 16-row items (decode with <= 16 heads) take their own path where the
 * build has the kernels (AVX-512): the scores of a 12-key block over all 9
 * column blocks in one call (qk16pb, accumulators in registers: 64-column
 * calls spent ~15 % of their time starting and ending), P x V with the
 * query rows as the vector lanes (pv16p: every value element is loaded
 * once, as a 64-bit broadcast feeding two FMAs; acc in a pair layout,
 * turned back into rows once per piece, or for a split piece once per
 * item by the merge), and a schedule where the P x V steps convert the
 * next tile's blocks 8, 0 .. 6 and the first score call block 7; a
 * piece's last tile converts the first tile of the piece its worker runs
 * next (converted without overlap, that tile's 8 blocks cost ~5 % of a
 * 16-tile piece; a worker's first tile, which nothing converted, runs its
 * scores block by block, each call converting the next block). The steps
 * sit between unrolled pairs of FMA iterations (a test and a branch per
 * iteration cost ~10 % of the scores).
 *
 * Split-KV: when a batch has fewer than SPLIT_MIN_ITEMS items (small-batch
 * decode), each item's keys are cut into pieces (at most SPLIT_MAX_PIECES in
 * all, each >= SPLIT_MIN_KEYS keys) that run in parallel and write partial
 * (o, lse) states into the workspace; the worker that finishes an item's
 * last piece merges them, with the workers that have no pieces left
 * (help_merges), a few rows at a time. Each worker builds the query block
 * of the item its piece belongs to in its own scratch, once per item in a
 * row (built once by the caller and shared, it took 4-6 us of the call's
 * serial start and was read from the other core); the pieces are handed
 * out one at a time
 * (pieces_worker). The decision depends only on the plan and the head
 * count, never on the thread count, and a row's merge does not depend on
 * which worker runs it, so results are bit-identical for any number of
 * threads.
 *
 * Keys past a request's kv length, and keys no row of an item may see under
 * the causal mask, are never loaded: the cache rows behind them may hold
 * anything (tests fill them with NaN). */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_yield under -std=c11 */
#endif
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>

#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLA_CPU_PAUSE() _mm_pause()
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define MLA_CPU_PAUSE() __asm__ volatile("yield")
#else
#define MLA_CPU_PAUSE() ((void)0)
#endif

#define SPLIT_MIN_ITEMS 16
#define SPLIT_MAX_PIECES 32
/* A piece pays for its first tile's start, its partial state's trip
 * through memory and its share of the merge: ~5 % of a 512-key piece (H =
 * 16). Pieces get SPLIT_PIECE_KEYS keys where that still leaves
 * SPLIT_WANT_PIECES pieces in all (as many as 16 cores use), down to
 * SPLIT_MIN_KEYS otherwise. Measured on a 2-core AVX-512 VM where the
 * pieces grow (H = 16 s_k = 16384, 4 x 4096; H = 128 s_k = 8192): 2-4 %
 * faster on 1 and 2 threads; elsewhere the cut is unchanged. */
#define SPLIT_MIN_KEYS 512
#define SPLIT_PIECE_KEYS 1024
#define SPLIT_WANT_PIECES 16
/* Rows of a split item merged as one unit of work (items of 16 padded
 * rows on the pair path: MERGE_ROWS_PAIR): the worker that finishes the
 * item's last piece and any worker without pieces left take such groups
 * from a counter, so the merge (reads of every piece's partial state,
 * ~10-14 us for 16 rows x 8 pieces) is shared instead of running alone
 * while the other workers wait for the call to end. */
#define MERGE_ROWS 2
#define COLS 64 /* columns of a tile converted at a time (divides 512 and 576) */
/* A split piece's partial state per row: the unnormalised accumulator
 * (512, in the tile's column order), then m and l (base 2); padded so rows
 * stay 64-byte aligned. */
#define PART_W (MLA_LATENT + 16)
#define PART_M MLA_LATENT
#define PART_L (MLA_LATENT + 1)
/* A 16-row piece of the pair path (pairv) leaves its state in pv16p's
 * pair layout instead, split by halves: [2][256][16] (vector v of every
 * column pair, rows 8v .. 8v + 7, then the other), then m [16] and l [16]
 * (within the 16 x PART_W floats of its slot). The merge (merge16p) reads
 * it as it is, 8 rows per vector, and unpacks once per item instead of
 * once per piece: at H = 16 s_k = 4096 on 2 threads the merge took
 * ~7.5-8.5 us instead of ~10.5-13 (2-core AVX-512 VM). With the halves in
 * alternate 64-byte lines (the accumulator's own layout) both workers
 * fetched every line and it took ~14. */
#define PAIR_M (16 * MLA_LATENT)
#define PAIR_L (PAIR_M + 16)
/* Rows of a pair-layout item merged as one unit: a vector of the layout
 * holds 8 rows (cpu.h, pv16p), so an item is two units, one per half. */
#define MERGE_ROWS_PAIR 8
#define NBLK (MLA_ROW / COLS) /* column blocks of a tile */
/* How many tiles ahead the kernels' steps prefetch (1: the next tile,
 * whose P x V conversions then overtake the prefetch in the last rows).
 * 2: the per-tile medians of P x V 1-2 % lower (H = 16, 2-core AVX-512
 * VM, rdtsc per tile), the scores unchanged. */
#define PF_TILES 2

/* Item geometry: heads per item, query tokens per item, padded rows. */
typedef struct geom {
  int hb, qb, rb;
} geom;

static geom geom_for(int num_heads, int max_q_len) {
  geom g;
  g.hb = num_heads < MLA_CPU_ROWS ? num_heads : MLA_CPU_ROWS;
  g.qb = MLA_CPU_ROWS / g.hb;
  if (g.qb > max_q_len) g.qb = max_q_len;
  if (g.qb < 1) g.qb = 1;
  g.rb = mla_cpu_round_up(g.hb * g.qb, MLA_CPU_ROW_ALIGN);
  return g;
}

/* Per-worker scratch layout (offsets in floats, each 64-byte aligned).
 * Every worker's scratch starts on a page and spans whole pages, so all
 * workers' buffers sit at the same offsets within their pages. With a
 * stride of 65 pages + 384 bytes (H = 16) the second worker's pieces ran
 * 4-5 % slower than the first's, whichever thread ran them (2-core
 * AVX-512 VM, 2026-11-30: swapping the scratches swapped the slow
 * worker); at split decode's end the first then waited for the second. */
#define SCRATCH_PAGE ((size_t)4096)
typedef struct scratch_layout {
  size_t kt, qt, stage, s, s2, acc, m, l, alpha, alphad, lim, total;
} scratch_layout;

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

static scratch_layout layout_for(int rb) {
  scratch_layout L;
  size_t o = 0;
  L.kt = o, o += al16((size_t)NBLK * MLA_CPU_KEYS * COLS); /* tile [NBLK][KEYS, COLS] */
  L.qt = o, o += al16((size_t)MLA_ROW * rb);             /* QT [576, rb] */
  L.stage = o, o += al16((size_t)16 * MLA_ROW);          /* 16 query rows [16, 576] */
  L.s = o, o += al16((size_t)MLA_CPU_KEYS * rb);         /* S / P [KEYS, rb] */
  L.s2 = o, o += al16((size_t)MLA_CPU_KEYS * 32);        /* 16-row partials [KEYS, 32] */
  L.acc = o, o += al16((size_t)rb * MLA_LATENT);         /* acc [rb, 512] */
  L.m = o, o += al16((size_t)rb);
  L.l = o, o += al16((size_t)rb);
  L.alpha = o, o += al16((size_t)rb);
  L.alphad = o, o += 32; /* alpha in pv16p's pair layout [2][16] */
  L.lim = o, o += al16((size_t)rb); /* int32 per row, same size as a float */
  L.total = (o + SCRATCH_PAGE / sizeof(float) - 1) & ~(SCRATCH_PAGE / sizeof(float) - 1);
  return L;
}

/* Workspace: [workers x scratch][split partials: SPLIT_MAX_PIECES x rb x
 * PART_W]. */
static size_t carve(mla_ws *w, int workers, geom g, float **scratch, float **partial) {
  scratch_layout L = layout_for(g.rb);
  size_t pw = L.total * sizeof(float);
  float *a = mla_ws_take(w, pw * (size_t)workers + SCRATCH_PAGE);
  if (a) a = (float *)(((uintptr_t)a + SCRATCH_PAGE - 1) & ~(uintptr_t)(SCRATCH_PAGE - 1));
  float *b = mla_ws_take(w, (size_t)SPLIT_MAX_PIECES * g.rb * PART_W * sizeof(float));
  if (scratch) *scratch = a;
  if (partial) *partial = b;
  return L.total;
}

/* One unit of parallel work: rows [q0, q0+nq) x heads [h0, h0+nh) of request
 * req over its keys [k0, k1). part >= 0: write the partial state to slot part
 * of the split area; part < 0: write the final outputs. */
typedef struct piece {
  int32_t req, q0, nq, h0, nh, k0, k1, part;
  int32_t item; /* split path: index of the item the piece was cut from */
} piece;

typedef struct ab_job {
  const mla_plan *plan;
  const mla_absorbed_args *args;
  const mla_cpu_kernels *k;
  mla_cpu_rows rows;
  int split; /* bf16 cache: tiles in pair-split column order */
  geom g;
  int H;
  float qscale; /* scale * log2(e): logits are kept in base 2 */
  int64_t nope_st, nope_sh, rope_st, rope_sh;
  float *scratch;
  size_t scratch_floats;
  float *partial;
  int num_heads_blocks;
  /* split path: the pieces, and for the merge the items before cutting */
  const piece *pieces;
  const piece *items;
  const int *item_first_part, *item_num_parts;
  /* split path: pieces of each item not finished yet; the worker that
   * finishes an item's last piece starts merging it, and workers without
   * pieces left join it (no separate merge pass: that would cost another
   * wake-up of the pool and a barrier) */
  atomic_int *item_left;
  /* split path: the next group of MERGE_ROWS rows of each item to merge */
  atomic_int *merge_next;
  int num_items;
  /* split path: the next piece to hand out, and how many there are */
  atomic_int *next_piece;
  int num_pieces;
} ab_job;

static void finish_row(int split, const float *acc, float inv, float *o);

/* Output row (t, h) = acc [512] * inv (acc in the tile's column order),
 * lse2 its base-2 LSE; acc NULL: a row that saw no key (o = 0). f32 and
 * bf16 outputs go through the kernels' out512 where the build has it (the
 * scalar reorder and bf16 rounding of 16 rows cost ~4 us, a visible part
 * of the serial merge at the end of a split decode call). */
static void write_row(const ab_job *J, int64_t t, int h, const float *acc /* [512] */,
                      float inv, double lse2) {
  const mla_absorbed_args *a = J->args;
  const int64_t off = (t * J->H + h) * (int64_t)MLA_LATENT;
  const int bf16 = a->act_dtype == MLA_DTYPE_BF16;
  if (acc && J->k->out512 && (bf16 || a->act_dtype == MLA_DTYPE_F32)) {
    void *dst = bf16 ? (void *)((uint16_t *)a->out + off) : (void *)((float *)a->out + off);
    J->k->out512(acc, J->split, inv, bf16, dst);
  } else {
    float o[MLA_LATENT];
    if (acc)
      finish_row(J->split, acc, inv, o);
    else
      memset(o, 0, sizeof o);
    mla_store_f32(a->act_dtype, a->out, off, MLA_LATENT, o);
  }
  if (a->lse) {
    double v = (a->flags & MLA_FLAG_LSE_BASE2) ? lse2 : lse2 * MLA_CPU_LN2;
    a->lse[t * J->H + h] = (float)v;
  }
}

/* Prefetch rows slots [n] into L2 (the first tile of a piece; later tiles
 * are prefetched a line at a time by the kernels, mla_cpu_pf). */
static void prefetch_rows(const mla_cpu_rows *R, const int32_t *slots, int n) {
  for (int i = 0; i < n; i++) {
    const unsigned char *p = R->base + (size_t)slots[i] * R->row_bytes;
    for (size_t off = 0; off < R->row_bytes; off += 64) MLA_CPU_PREFETCH_L2(p + off);
  }
}

/* Request a cache line for writing (prefetchw: the line arrives owned, so
 * a store to it needs no further round trip; a hint, a no-op on x86
 * processors without the instruction). */
static inline void prefetch_w(const void *p) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 1, 3);
#else
  (void)p;
#endif
}

/* Whether rb padded rows take the pair path: 16 rows where the build has
 * the whole set, the scores over all the column blocks in one call
 * (qk16pb), P x V with the rows as lanes and acc in pv16p's pair layout,
 * a split piece's state left in that layout for merge16p. run_piece and
 * the merge both decide by it. */
static int pair_path(const mla_cpu_kernels *k, int rb) {
  return rb == 16 && k->qk16p && k->pv16p && k->qk16pb && k->merge16p;
}

/* The lines of a split piece's partial-state slot, requested for writing
 * a few at a time between the piece's kernel calls (p .. end, n per
 * call), so that the state written at its end finds them owned. The slot
 * was last read by whichever worker merged it in the previous call, and
 * writing the state stalled on every line (the other core's copy
 * invalidated first): ~1.8 us a piece at H = 16, ~1.1 with these
 * requests (2-core AVX-512 VM); a burst of the 528 requests would stall
 * on the fill buffers as long. */
typedef struct wpf {
  const unsigned char *p, *end;
  int n;
} wpf;

static void wpf_step(wpf *w) {
  for (int i = 0; i < w->n && w->p < w->end; i++, w->p += 64) prefetch_w(w->p);
}

/* Columns [c0, c0 + COLS) of n rows -> blk [n, COLS]. For a bf16 cache the
 * conversion is only set up in cv: the micro-kernels advance it while they
 * compute the previous block, mla_cpu_conv_finish completes it. */
static void start_block(const ab_job *J, const int32_t *slots, int n, int c0, float *blk,
                        mla_cpu_conv *cv, mla_cpu_pf *pf, const unsigned char *const *rowp,
                        const unsigned char *const *pf_rowp) {
  cv->pf = pf;
  cv->rowp = rowp;
  cv->pf_rowp = pf ? pf_rowp : NULL;
  cv->base = J->rows.base;
  cv->row_bytes = J->rows.row_bytes;
  cv->slots = slots;
  cv->c0 = c0;
  cv->dst = blk;
  cv->next = 0;
  cv->count = n;
  if (!J->split) { /* other dtypes: converted here, nothing left to pipeline */
    mla_cpu_load_cols(&J->rows, slots, n, c0, COLS, blk, COLS);
    cv->next = n;
  }
}

/* Nothing to convert: the kernels' steps only advance the prefetch. */
static void idle_conv(mla_cpu_conv *cv, mla_cpu_pf *pf, const unsigned char *const *pf_rowp) {
  memset(cv, 0, sizeof *cv);
  cv->pf = pf;
  cv->pf_rowp = pf_rowp;
}

/* The query block of a piece's rows, transposed into the layout the scores
 * kernel reads (in the tile's column order) and pre-scaled; padded rows are
 * zero. stage: [16, 576] scratch. */
static void build_qt(const ab_job *J, const piece *pc, float *stage, float *QT /* [576, rb] */) {
  const mla_absorbed_args *a = J->args;
  const int rows = pc->nq * pc->nh, rb = mla_cpu_round_up(rows, MLA_CPU_ROW_ALIGN);
  const int64_t tq0 = J->plan->qo_indptr[pc->req];
  if (rb == 16 && J->split && a->act_dtype == MLA_DTYPE_BF16 && J->k->qt16p_bf16) {
    /* bf16 queries, 16-row layout: converted and transposed in registers */
    const uint16_t *qn[16], *qr[16];
    for (int r = 0; r < 16; r++) {
      qn[r] = qr[r] = NULL;
      if (r >= rows) continue;
      const int64_t t = tq0 + pc->q0 + r / pc->nh;
      const int h = pc->h0 + r % pc->nh;
      qn[r] = (const uint16_t *)a->q_nope + t * J->nope_st + h * J->nope_sh;
      qr[r] = (const uint16_t *)a->q_rope + t * J->rope_st + h * J->rope_sh;
    }
    J->k->qt16p_bf16(qn, qr, J->qscale, QT);
    return;
  }
  for (int r0 = 0; r0 < rb; r0 += 16) {
    for (int i = 0; i < 16; i++) {
      float *qrow = stage + (size_t)i * MLA_ROW;
      const int r = r0 + i;
      if (r >= rows) {
        memset(qrow, 0, MLA_ROW * sizeof(float));
        continue;
      }
      const int64_t t = tq0 + pc->q0 + r / pc->nh;
      const int h = pc->h0 + r % pc->nh;
      mla_cpu_load_act(J->k, a->act_dtype, a->q_nope, t * J->nope_st + h * J->nope_sh,
                       MLA_LATENT, qrow);
      mla_cpu_load_act(J->k, a->act_dtype, a->q_rope, t * J->rope_st + h * J->rope_sh, MLA_ROPE,
                       qrow + MLA_LATENT);
    }
    if (rb == 16 && J->k->qt16p) /* the 16-row scores kernel's layout */
      J->k->qt16p(stage, MLA_ROW, MLA_ROW, J->qscale, J->split, QT);
    else
      J->k->qt16(stage, MLA_ROW, MLA_ROW, J->qscale, J->split, QT + r0, rb);
  }
}

/* The rows of tile u (0: the first) of the sequence "this piece's tiles
 * (keys [k0, kend)), then those of the piece next" -> *s; 0 when there is
 * no such tile. */
static int tile_rows(const ab_job *J, const piece *pc, int kend, const piece *next, int u,
                     const int32_t **s) {
  const mla_plan *P = J->plan;
  const int nt = kend > pc->k0 ? (kend - pc->k0 + MLA_CPU_KEYS - 1) / MLA_CPU_KEYS : 0;
  const piece *q = pc;
  int e = kend;
  if (u >= nt) {
    if (!next) return 0;
    u -= nt;
    q = next;
    e = next->k1;
  }
  const int k0 = q->k0 + u * MLA_CPU_KEYS;
  if (k0 >= e) return 0;
  *s = P->kv_indices + P->kv_indptr[q->req] + k0;
  return e - k0 < MLA_CPU_KEYS ? e - k0 : MLA_CPU_KEYS;
}

/* The end of the keys a piece may see: up to the causal limit of its last
 * row (run_piece's kend). */
static int piece_kend(const ab_job *J, const piece *pc) {
  const mla_plan *P = J->plan;
  const int Q = P->qo_indptr[pc->req + 1] - P->qo_indptr[pc->req];
  const int K = P->kv_lens[pc->req];
  const int e = P->causal ? K - Q + pc->q0 + pc->nq : K;
  return pc->k1 < e ? pc->k1 : e;
}

/* o [512] = acc [512] * inv, in the natural column order (acc is in the
 * tile's pair-split order when split). */
static void finish_row(int split, const float *acc, float inv, float *o) {
  if (split)
    for (int g = 0; g < MLA_LATENT; g += 32)
      for (int i = 0; i < 16; i++) {
        o[g + 2 * i] = acc[g + i] * inv;
        o[g + 2 * i + 1] = acc[g + 16 + i] * inv;
      }
  else
    for (int c = 0; c < MLA_LATENT; c++) o[c] = acc[c] * inv;
}

/* One piece on one worker. next: the piece this worker runs after this
 * one (NULL: unknown), whose first tile this piece's last tile prefetches
 * and, on the 16-row path, converts; prefetched / converted: this piece's
 * first tile was prefetched / converted that way. Returns whether it
 * converted next's first tile. */
static int run_piece(const ab_job *J, const piece *pc, int worker, const piece *next,
                     int prefetched, int converted, int *qt_item) {
  const mla_plan *P = J->plan;
  const mla_cpu_kernels *k = J->k;
  scratch_layout L = layout_for(J->g.rb);
  float *base = J->scratch + (size_t)worker * J->scratch_floats;
  float *Kt = base + L.kt, *QTs = base + L.qt, *S = base + L.s, *acc = base + L.acc;
  float *S2 = base + L.s2;
  float *m = base + L.m, *l = base + L.l, *alpha = base + L.alpha, *alphad = base + L.alphad;
  int32_t *lim = (int32_t *)(base + L.lim);

  const int req = pc->req;
  const int64_t tq0 = P->qo_indptr[req];
  const int Q = P->qo_indptr[req + 1] - P->qo_indptr[req];
  const int K = P->kv_lens[req];
  const int rows = pc->nq * pc->nh;
  const int rb = mla_cpu_round_up(rows, MLA_CPU_ROW_ALIGN);
  const int32_t *slots = P->kv_indices + P->kv_indptr[req];
  const int pair = rb == 16 && k->qk16p; /* 16 rows: the pair-layout scores (build_qt) */
  const int pairv = pair_path(k, rb);

  /* Causal limits first: they bound the keys, whose first tile is
   * prefetched while the query block is built. */
  int minlim = INT_MAX, maxlim = -1;
  for (int r = 0; r < rb; r++) {
    if (r < rows) {
      const int qa = pc->q0 + r / pc->nh;
      /* last visible key (bottom-right causal); may be negative: no key */
      lim[r] = P->causal ? K - Q + qa : K - 1;
      if (lim[r] < minlim) minlim = lim[r];
      if (lim[r] > maxlim) maxlim = lim[r];
    } else {
      lim[r] = -1;
    }
  }
  const int kend = pc->k1 < maxlim + 1 ? pc->k1 : maxlim + 1;
  if (pc->k0 < kend && !prefetched)
    for (int u = 0; u < PF_TILES; u++) {
      const int32_t *ps;
      const int pn = tile_rows(J, pc, kend, NULL, u, &ps);
      if (pn > 0) prefetch_rows(&J->rows, ps, pn);
    }
  const float *QT = QTs;
  if (!qt_item || pc->item < 0 || *qt_item != pc->item) { /* (unsplit pieces carry item -1: always built) */
    build_qt(J, pc, base + L.stage, QTs);
    if (qt_item) *qt_item = pc->item;
  }
  for (int r = 0; r < rb; r++) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  memset(acc, 0, (size_t)(pairv ? rb : rows) * MLA_LATENT * sizeof(float));

  /* The tile's blocks: the 9 column blocks of the scores, each converted
   * once; the first 8 (the latent part, c) are also the value blocks of
   * P x V. Conversions are spread over both phases, each overlapping a
   * kernel call (the next block is never converted by the call that reads
   * it): while value block b >= 1 is used, block b - 1 is free and receives
   * the next tile's block b - 1; the next tile's blocks 7 and 8 follow
   * during its first score blocks. have / nhave: the leading blocks of this
   * / the next tile already converted. The next tile's rows are prefetched
   * during this tile's score blocks, row after row, so they are in L2
   * when the value blocks convert them. */
  float *blk[NBLK];
  for (int b = 0; b < NBLK; b++) blk[b] = Kt + (size_t)b * MLA_CPU_KEYS * COLS;
  mla_cpu_conv cv;
  int have = pairv && converted; /* pairv: the first tile is converted but block 7 */
  /* pairv: the last tile's P x V steps convert the next piece's first tile
   * (nxn rows at nxs) when it takes this path too: a piece's first tile
   * converted without overlap cost ~16k cycles, ~5 % of a 16-tile piece */
  int nxn = 0, conv_next = 0;
  const int32_t *nxs = NULL;
  if (pairv && next && mla_cpu_round_up(next->nq * next->nh, MLA_CPU_ROW_ALIGN) == 16) {
    const int e = piece_kend(J, next);
    if (e > next->k0) {
      nxn = e - next->k0 < MLA_CPU_KEYS ? e - next->k0 : MLA_CPU_KEYS;
      nxs = P->kv_indices + P->kv_indptr[next->req] + next->k0;
    }
  }
  /* The addresses of this tile's and the next tile's rows (the kernels'
   * conversion and prefetch steps walk them with a pointer). */
  const unsigned char *rowp_a[MLA_CPU_KEYS], *rowp_b[MLA_CPU_KEYS], *rp_pf[MLA_CPU_KEYS];
  /* a split piece's slot (rows x PART_W floats), over its tiles' calls */
  wpf own = {NULL, NULL, 0};
  if (pc->part >= 0 && kend > pc->k0) {
    const int calls = (pairv ? 9 : 2 * NBLK) * ((kend - pc->k0 + MLA_CPU_KEYS - 1) / MLA_CPU_KEYS);
    const size_t lines = (size_t)rows * PART_W * sizeof(float) / 64;
    own.p = (const unsigned char *)(J->partial + (size_t)pc->part * J->g.rb * PART_W);
    own.end = own.p + lines * 64;
    own.n = (int)((lines + (size_t)calls - 1) / (size_t)calls);
  }
  const unsigned char **rp_cur = rowp_a, **rp_next = rowp_b;
  for (int j = 0; pc->k0 + j < kend && j < MLA_CPU_KEYS; j++)
    rp_cur[j] = J->rows.base + (size_t)slots[pc->k0 + j] * J->rows.row_bytes;
  for (int kt = pc->k0; kt < kend; kt += MLA_CPU_KEYS) {
    const int n = kend - kt < MLA_CPU_KEYS ? kend - kt : MLA_CPU_KEYS;
    const int knext = kt + n, nn = kend - knext < MLA_CPU_KEYS ? kend - knext : MLA_CPU_KEYS;
    mla_cpu_pf pf = {J->rows.base, J->rows.row_bytes, NULL, 0, 0, 0, 0};
    pf.rows = tile_rows(J, pc, kend, next, (kt - pc->k0) / MLA_CPU_KEYS + PF_TILES, &pf.slots);
    for (int j = 0; j < pf.rows; j++)
      rp_pf[j] = J->rows.base + (size_t)pf.slots[j] * J->rows.row_bytes;
    /* the rows the P x V steps convert (pairv): the next tile's, or after
     * the last tile the next piece's first */
    const int cn = nn > 0 ? nn : nxn;
    const int32_t *cs = nn > 0 ? slots + knext : nxs;
    for (int j = 0; j < cn; j++)
      rp_next[j] = J->rows.base + (size_t)cs[j] * J->rows.row_bytes;
    if (nn == 0 && cn > 0) conv_next = 1;
    if (pairv && have == 0) {
      /* A piece's first tile, which no earlier tile converted: block by
       * block through qk16p (the same sums in the same order as qk16pb,
       * so bit-identical), each call converting the next block, so only
       * block 0 is converted without overlap. Converting the 8 blocks
       * first (the rows arriving from L3 while nothing else ran) and then
       * running qk16pb, a worker's first tile took 22-24 us against ~15.7
       * for the others at H = 16 s_k = 4096 (2-core AVX-512 VM), this way
       * 20-21. */
      start_block(J, slots + kt, n, 0, blk[0], &cv, NULL, rp_cur, NULL);
      mla_cpu_conv_finish(k, &cv);
      for (int b = 0; b < NBLK; b++) {
        if (b + 1 < NBLK)
          start_block(J, slots + kt, n, (b + 1) * COLS, blk[b + 1], &cv, &pf, rp_cur, rp_pf);
        else
          idle_conv(&cv, &pf, rp_pf);
        wpf_step(&own);
        k->qk16p(n, COLS, blk[b], QT + (size_t)b * COLS * 16, S2, b > 0, &cv);
        mla_cpu_conv_finish(k, &cv);
      }
    } else if (pairv) {
      /* The last tile's P x V converted every block but 7; block 7 is
       * converted during the first 12-key block of the scores, which
       * reads its own rows of it last (after ~224 of its 288 pair steps,
       * the conversion steps a row every 2 or 4), and the later key
       * blocks find it complete. */
      start_block(J, slots + kt, n, 7 * COLS, blk[7], &cv, &pf, rp_cur, rp_pf);
      wpf_step(&own);
      k->qk16pb(n, NBLK, Kt, (size_t)MLA_CPU_KEYS * COLS, QT, S2, 0, &cv);
      mla_cpu_conv_finish(k, &cv);
    } else if (have == 0) { /* a piece's first tile: nothing converted it yet */
      start_block(J, slots + kt, n, 0, blk[0], &cv, NULL, rp_cur, NULL);
      mla_cpu_conv_finish(k, &cv);
      have = 1;
    }
    for (int b = 0; !pairv && b < NBLK; b++) {
      const int c0 = b * COLS;
      if (have < NBLK)
        start_block(J, slots + kt, n, have * COLS, blk[have], &cv, &pf, rp_cur, rp_pf);
      else
        idle_conv(&cv, &pf, rp_pf);
      wpf_step(&own);
      if (pair)
        k->qk16p(n, COLS, blk[b], QT + (size_t)c0 * 16, S2, c0 > 0, &cv);
      else
        k->qk(n, COLS, blk[b], COLS, QT + (size_t)c0 * rb, rb, S, c0 > 0, &cv);
      mla_cpu_conv_finish(k, &cv);
      if (have < NBLK) have++;
    }
    if (pair) k->red16p(n, S2, S);
    if (kt + n - 1 > minlim)
      for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++)
          if (kt + j > lim[r]) S[(size_t)j * rb + r] = -INFINITY;
    k->softmax(n, rb, S, m, l, alpha);
    const float *pvP = S, *pva = alpha;
    if (pairv) { /* P and alpha in pv16p's layout (S2 is free until the next tile) */
      int scale = 0;
      for (int r = 0; r < rb; r++) scale |= alpha[r] != 1.0f;
      k->pdup16p(n, S, scale ? alpha : NULL, S2, alphad);
      pvP = S2;
      pva = scale ? alphad : NULL;
    }
    int nhave = 0;
    for (int b = 0; b < MLA_LATENT / COLS; b++) {
      if (pairv && cn > 0) { /* the next tile's block 8, then b - 1 */
        const int nb = b ? b - 1 : 8;
        start_block(J, cs, cn, nb * COLS, blk[nb], &cv, &pf, rp_next, rp_pf);
        nhave = 1;
      } else if (b >= 1 && nn > 0) {
        start_block(J, slots + knext, nn, (b - 1) * COLS, blk[b - 1], &cv, &pf, rp_next, rp_pf);
        nhave = b;
      } else {
        idle_conv(&cv, &pf, rp_pf);
      }
      wpf_step(&own);
      if (pairv)
        k->pv16p(n, pvP, blk[b], pva, acc + (size_t)b * COLS * 16, &cv);
      else
        k->pv(n, rows, pvP, rb, blk[b], COLS, COLS, pva, acc + (size_t)b * COLS, MLA_LATENT, &cv);
      mla_cpu_conv_finish(k, &cv);
    }
    have = nhave;
    const unsigned char **t = rp_cur;
    rp_cur = rp_next;
    rp_next = t;
  }

  if (pairv && pc->part >= 0) { /* the raw state, in the pair layout (PAIR_M) */
    float *o = J->partial + (size_t)pc->part * J->g.rb * PART_W;
    for (int v = 0; v < 2; v++) /* the halves apart (PAIR_M) */
      for (int q = 0; q < MLA_LATENT / 2; q++)
        memcpy(o + (size_t)v * 8 * MLA_LATENT + (size_t)q * 16, acc + (size_t)q * 32 + 16 * v,
               16 * sizeof(float));
    memcpy(o + PAIR_M, m, 16 * sizeof(float));
    memcpy(o + PAIR_L, l, 16 * sizeof(float));
    return conv_next;
  }
  if (pairv) { /* back to rows [16, 512] (in the tile's column order) */
    k->unpack16p(acc, MLA_LATENT, base + L.stage, MLA_LATENT);
    acc = base + L.stage;
  }
  if (pc->part >= 0) { /* the raw state: the merge normalises and reorders once */
    for (int r = 0; r < rows; r++) {
      float *o = J->partial + ((size_t)pc->part * J->g.rb + r) * PART_W;
      memcpy(o, acc + (size_t)r * MLA_LATENT, MLA_LATENT * sizeof(float));
      o[PART_M] = m[r];
      o[PART_L] = l[r];
    }
    return conv_next;
  }
  for (int r = 0; r < rows; r++) {
    const int64_t t = tq0 + pc->q0 + r / pc->nh;
    const int h = pc->h0 + r % pc->nh;
    if (m[r] == -INFINITY) /* no visible key in this range */
      write_row(J, t, h, NULL, 0.0f, -INFINITY);
    else
      write_row(J, t, h, acc + (size_t)r * MLA_LATENT, 1.0f / l[r],
                (double)m[r] + log2((double)l[r]));
  }
  return conv_next;
}

/* Items of request i: ceil(Q_i / qb) token blocks x head blocks. */
static int64_t items_of(const ab_job *J, int i) {
  const int Q = J->plan->qo_indptr[i + 1] - J->plan->qo_indptr[i];
  return mla_cdiv(Q, J->g.qb) * J->num_heads_blocks;
}

static piece piece_of(const ab_job *J, int req, int64_t local) {
  piece pc;
  const int Q = J->plan->qo_indptr[req + 1] - J->plan->qo_indptr[req];
  const int qblk = (int)(local / J->num_heads_blocks), hblk = (int)(local % J->num_heads_blocks);
  pc.req = req;
  pc.q0 = qblk * J->g.qb;
  pc.nq = Q - pc.q0 < J->g.qb ? Q - pc.q0 : J->g.qb;
  pc.h0 = hblk * J->g.hb;
  pc.nh = J->H - pc.h0 < J->g.hb ? J->H - pc.h0 : J->g.hb;
  pc.k0 = 0;
  pc.k1 = J->plan->kv_lens[req];
  pc.part = -1;
  pc.item = -1;
  return pc;
}

static void items_range(void *arg, int64_t b, int64_t e, int worker) {
  const ab_job *J = arg;
  /* Find the request holding item b: a scan over the batch, done once per
   * chunk (a handful of chunks per worker), so no index table is needed. */
  int i = 0;
  int64_t first = 0;
  while (i < J->plan->batch_size && first + items_of(J, i) <= b) first += items_of(J, i++);
  piece pc, nx;
  int conv = 0;
  for (int64_t it = b; it < e; it++) {
    if (it == b) {
      while (it - first >= items_of(J, i)) first += items_of(J, i++);
      pc = piece_of(J, i, it - first);
    } else {
      pc = nx;
    }
    int have_next = 0;
    if (it + 1 < e) { /* the following item, whose first tile is prefetched */
      while (it + 1 - first >= items_of(J, i)) first += items_of(J, i++);
      nx = piece_of(J, i, it + 1 - first);
      have_next = 1;
    }
    conv = run_piece(J, &pc, worker, have_next ? &nx : NULL, it > b, it > b && conv, NULL);
  }
}

static void merge_range(void *arg, int64_t b, int64_t e, int worker);
static void merge_pair(const ab_job *J, int it, int r0, int worker);

/* A split row's merge weights: over the np pieces' maxima m [np] and sums
 * l [np] (stride floats apart), w [np] = 2^(m_p - mx) (0 for an empty
 * piece, m_p = -inf) and *den = sum_p w_p l_p in double; returns mx, -inf
 * when no piece saw a key. merge_range and merge_pair both weigh by it, so
 * the two layouts give the same results. */
static float merge_weights(const float *m, const float *l, size_t stride, int np, float *w, double *den) {
  float mx = -INFINITY;
  for (int p = 0; p < np; p++)
    if (m[p * stride] > mx) mx = m[p * stride];
  *den = 0.0;
  for (int p = 0; p < np; p++) {
    const float mp = m[p * stride];
    w[p] = mp == -INFINITY ? 0.0f : (float)exp2((double)mp - (double)mx);
    *den += (double)w[p] * l[p * stride];
  }
  return mx;
}

/* Whether split item it's pieces leave their states in the pair layout
 * (run_piece's pairv: 16 padded rows and the kernels for them). */
static int item_pair(const ab_job *J, int it) {
  return pair_path(J->k, mla_cpu_round_up(J->items[it].nq * J->items[it].nh, MLA_CPU_ROW_ALIGN));
}

static int merge_unit_rows(const ab_job *J, int it) {
  return item_pair(J, it) ? MERGE_ROWS_PAIR : MERGE_ROWS;
}

/* Merge the row groups of split item it that nobody took yet (all of its
 * pieces have finished). */
static void merge_item(const ab_job *J, int it, int worker) {
  const int rows = J->items[it].nq * J->items[it].nh;
  const int64_t x0 = (int64_t)it * J->g.rb;
  const int pair = item_pair(J, it), unit = pair ? MERGE_ROWS_PAIR : MERGE_ROWS;
  for (;;) {
    const int r = unit * atomic_fetch_add_explicit(&J->merge_next[it], 1, memory_order_relaxed);
    if (r >= rows) return;
    if (pair)
      merge_pair(J, it, r, worker);
    else
      merge_range((void *)J, x0 + r, x0 + (r + unit < rows ? r + unit : rows), worker);
  }
}

/* A worker without pieces left: take part in the merges of the split
 * items, waiting (spinning, it has nothing else to do) for those whose
 * last pieces still run elsewhere. The wait yields the CPU now and then,
 * for a worker that shares it. */
static void help_merges(const ab_job *J, int worker) {
  for (int spins = 0;; spins++) {
    int waiting = 0;
    for (int it = 0; it < J->num_items; it++) {
      if (J->item_num_parts[it] <= 1 ||
          merge_unit_rows(J, it) * atomic_load_explicit(&J->merge_next[it], memory_order_relaxed) >=
              J->items[it].nq * J->items[it].nh)
        continue;
      /* acquire: pairs with the pieces' acq_rel decrements, so every
       * partial state of the item is visible */
      if (atomic_load_explicit(&J->item_left[it], memory_order_acquire) != 0) {
        waiting = 1;
        continue;
      }
      merge_item(J, it, worker);
    }
    if (!waiting) return;
    MLA_CPU_PAUSE();
    if ((spins & 63) == 63) sched_yield();
  }
}

/* One call per worker: the pieces are handed out one at a time from a
 * counter (the pool's chunks are an eighth of the work for 2 workers, and
 * the worker that wakes late leaves up to a chunk of imbalance at the
 * end); a worker claims its next piece before it runs the current one, so
 * the current one's last tile prefetches the next one's first. */
static void pieces_worker(void *arg, int64_t b, int64_t e, int worker) {
  const ab_job *J = arg;
  (void)b;
  (void)e;
  int p = atomic_fetch_add_explicit(J->next_piece, 1, memory_order_relaxed);
  int conv = 0, qt_item = -1;
  for (int first = 1; p < J->num_pieces; first = 0) {
    const int q = atomic_fetch_add_explicit(J->next_piece, 1, memory_order_relaxed);
    const piece *pc = &J->pieces[p];
    conv = run_piece(J, pc, worker, q < J->num_pieces ? &J->pieces[q] : NULL, !first,
                     !first && conv, &qt_item);
    /* acq_rel: the last one sees every other piece's partial state */
    if (pc->part >= 0 &&
        atomic_fetch_sub_explicit(&J->item_left[pc->item], 1, memory_order_acq_rel) == 1)
      merge_item(J, pc->item, worker);
    p = q;
  }
  help_merges(J, worker);
}

/* Merge the partial states of split items: one row = one (token, head). */
static void merge_range(void *arg, int64_t b, int64_t e, int worker) {
  const ab_job *J = arg;
  (void)worker;
  for (int64_t x = b; x < e; x++) {
    const int it = (int)(x / J->g.rb), r = (int)(x % J->g.rb);
    const piece *pc = &J->items[it];
    if (r >= pc->nq * pc->nh || J->item_num_parts[it] <= 1) continue;
    const int p0 = J->item_first_part[it], np = J->item_num_parts[it];
    const float *part = J->partial + ((size_t)p0 * J->g.rb + r) * PART_W;
    const size_t pst = (size_t)J->g.rb * PART_W; /* from one piece's row to the next's */
    const int64_t t = J->plan->qo_indptr[pc->req] + pc->q0 + r / pc->nh;
    const int h = pc->h0 + r % pc->nh;
    float w[SPLIT_MAX_PIECES];
    double den;
    const float mx = merge_weights(part + PART_M, part + PART_L, pst, np, w, &den);
    if (mx == -INFINITY) {
      write_row(J, t, h, NULL, 0.0f, -INFINITY);
    } else {
      /* o = sum_p w_p acc_p / sum_p w_p l_p as one P x V product of the
       * kernels (a row of weights against the pieces' rows); an empty
       * piece (m_p = -inf) has w_p = 0, acc_p = 0. */
      float acc[MLA_LATENT];
      memset(acc, 0, sizeof acc);
      J->k->pv(np, 1, w, 1, part, (int)pst, MLA_LATENT, NULL, acc, MLA_LATENT, NULL);
      write_row(J, t, h, acc, (float)(1.0 / den), (double)mx + log2(den));
    }
  }
}

/* Rows r0 .. r0 + 7 of split item it, whose pieces left their states in
 * the pair layout: the same weights, sums and output as merge_range on
 * the unpacked rows (merge16p's sums are pv's), so the results do not
 * depend on the layout. */
static void merge_pair(const ab_job *J, int it, int r0, int worker) {
  const piece *pc = &J->items[it];
  const int rows = pc->nq * pc->nh;
  const int p0 = J->item_first_part[it], np = J->item_num_parts[it];
  const float *part = J->partial + (size_t)p0 * J->g.rb * PART_W;
  const size_t pst = (size_t)J->g.rb * PART_W; /* from one piece's state to the next's */
  float wd[SPLIT_MAX_PIECES][16], mx[8];
  double den[8];
  for (int i = 0; i < 8; i++) {
    /* (a row without keys, mx = -inf: every weight 0, written as zeros) */
    float w[SPLIT_MAX_PIECES];
    mx[i] = merge_weights(part + PAIR_M + r0 + i, part + PAIR_L + r0 + i, pst, np, w, &den[i]);
    for (int p = 0; p < np; p++) wd[p][2 * i] = wd[p][2 * i + 1] = w[p];
  }
  /* the 8 merged rows [8, 512] in the worker's staging rows (free between
   * pieces: build_qt uses them only while it runs) */
  scratch_layout L = layout_for(J->g.rb);
  float *acc = J->scratch + (size_t)worker * J->scratch_floats + L.stage;
  J->k->merge16p(np, part + (size_t)(r0 / 8) * 8 * MLA_LATENT, pst, &wd[0][0], acc, MLA_LATENT);
  for (int i = 0; i < 8 && r0 + i < rows; i++) {
    const int r = r0 + i;
    const int64_t t = J->plan->qo_indptr[pc->req] + pc->q0 + r / pc->nh;
    const int h = pc->h0 + r % pc->nh;
    if (mx[i] == -INFINITY)
      write_row(J, t, h, NULL, 0.0f, -INFINITY);
    else
      write_row(J, t, h, acc + (size_t)i * MLA_LATENT, (float)(1.0 / den[i]),
                (double)mx[i] + log2(den[i]));
  }
}

/* The size depends only on mla_ctx_workers(ctx), num_heads and
 * plan->max_q_len (not on the batch's lengths), so a caller can size one
 * workspace for its largest batch by passing a plan whose max_q_len is its
 * maximum; a pages-only plan (kv_indices NULL) adds num_kv_tokens slots. It must be queried again after mla_ctx_set_threads.
 * (The public entry point, src/backend/dispatch.c, sends CUDA contexts to
 * src/cuda/attention.c instead.) */
mla_status mla_cpu_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
                                                     int num_heads, size_t *bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  MLA_REQUIRE_PTR(&ctx->err, plan);
  MLA_REQUIRE_PTR(&ctx->err, bytes);
  MLA_REQUIRE(&ctx->err, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  MLA_REQUIRE(&ctx->err, plan->max_q_len >= 0, MLA_ERR_INVALID_ARGUMENT,
              "plan->max_q_len = %d is negative", (int)plan->max_q_len);
  mla_ws w = mla_ws_counter();
  carve(&w, mla_ctx_workers(ctx), geom_for(num_heads, plan->max_q_len), NULL, NULL);
  if (!plan->kv_indices) /* MLA_PLAN_PAGES_ONLY: the slots, derived from the block table */
    mla_ws_take(&w, sizeof(int32_t) * (size_t)(plan->num_kv_tokens > 0 ? plan->num_kv_tokens : 0));
  *bytes = mla_ws_total(&w);
  return MLA_OK;
}

/* Slots of a pages-only plan (MLA_PLAN_PAGES_ONLY) from its block table:
 * key j of request i is page bt[i][j / P], offset j % P. */
static void slots_from_pages(const mla_plan *p, int32_t *idx /* [num_kv_tokens] */) {
  const int P = p->page_size;
  for (int i = 0; i < p->batch_size; i++) {
    const int32_t *bt = p->block_table + (size_t)i * (size_t)p->block_table_width;
    int32_t *out = idx + p->kv_indptr[i];
    for (int32_t j = 0; j < p->kv_lens[i]; j++) out[j] = bt[j / P] * P + j % P;
  }
}

/* Plan arrays the kernel reads, checked for internal consistency. */
static mla_status check_plan(mla_ctx *ctx, const mla_kv_cache *cache, const mla_plan *p) {
  const char *fn = "mla_attention_absorbed";
  mla_errbuf *eb = &ctx->err;
  if (!p->qo_indptr || !p->kv_indptr || !p->kv_lens)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "plan->qo_indptr, kv_indptr and kv_lens must be non-NULL");
  if (p->page_size != cache->page_size)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "plan->page_size = %d differs from the cache's page size %d",
                    (int)p->page_size, cache->page_size);
  if (p->causal != 0 && p->causal != 1)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "plan->causal = %d, expected 0 or 1",
                    (int)p->causal);
  if (p->qo_indptr[0] != 0 || p->kv_indptr[0] != 0)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "plan->qo_indptr[0] and kv_indptr[0] must be 0");
  for (int i = 0; i < p->batch_size; i++) {
    const int64_t q = (int64_t)p->qo_indptr[i + 1] - p->qo_indptr[i];
    const int64_t kv = (int64_t)p->kv_indptr[i + 1] - p->kv_indptr[i];
    if (q < 0 || q > p->max_q_len)
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                      "plan: request %d has %lld query rows, expected 0..max_q_len = %d", i,
                      (long long)q, (int)p->max_q_len);
    if (kv < 0)
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "plan->kv_indptr decreases at %d", i);
    if (p->kv_lens[i] < 0 || p->kv_lens[i] > kv)
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                      "plan->kv_lens[%d] = %d outside 0..%lld (its kv_indptr span)", i,
                      (int)p->kv_lens[i], (long long)kv);
  }
  if (p->qo_indptr[p->batch_size] != p->num_q_tokens)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                    "plan->qo_indptr[bs] = %d differs from num_q_tokens = %d",
                    (int)p->qo_indptr[p->batch_size], (int)p->num_q_tokens);
  if (!p->kv_indices) { /* pages only: the block table names the keys */
    if (p->kv_indptr[p->batch_size] > 0 && (!p->block_table || p->page_size != cache->page_size))
      return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn,
                      "plan->kv_indices is NULL and the block table is missing or of another page size");
    for (int i = 0; i < p->batch_size; i++) {
      const int64_t pages = mla_cdiv(p->kv_lens[i], p->page_size);
      if (pages > p->block_table_width)
        return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "plan: request %d needs %lld pages, block_table_width = %d",
                        i, (long long)pages, (int)p->block_table_width);
      const int32_t *bt = p->block_table + (size_t)i * (size_t)p->block_table_width;
      for (int64_t j = 0; j < pages; j++)
        if (bt[j] < 0 || bt[j] >= cache->num_pages)
          return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                          "plan->block_table[%d][%lld] = %d, outside the cache's %d pages", i, (long long)j,
                          (int)bt[j], cache->num_pages);
    }
    return MLA_OK;
  }
  /* Every slot in [0, num_slots): one unsigned compare per slot (a
   * negative one wraps above any bound), OR-ed over the request without an
   * early exit so that the loop vectorises (a decode call with 16K keys
   * spent ~10 us here, serially, before its workers started); the rare
   * failure is then located by a second pass. */
  const uint32_t cap = cache->num_slots >= 0x80000000LL ? 0x80000000u : (uint32_t)cache->num_slots;
  for (int i = 0; i < p->batch_size; i++) {
    const int32_t *idx = p->kv_indices + p->kv_indptr[i];
    const int n = p->kv_lens[i];
    unsigned bad = 0;
    for (int j = 0; j < n; j++) bad |= (uint32_t)idx[j] >= cap;
    if (!bad) continue;
    for (int j = 0; j < n; j++)
      if (idx[j] < 0 || idx[j] >= cache->num_slots)
        return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                        "plan: key %d of request %d is slot %d, outside the cache's [0, %lld)",
                        j, i, (int)idx[j], (long long)cache->num_slots);
  }
  return MLA_OK;
}

mla_status mla_cpu_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                  const mla_plan *plan, const mla_absorbed_args *args,
                                  void *workspace, size_t workspace_bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  MLA_CPU_REQUIRE_CPU_CTX(eb, ctx);
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, cache);
  MLA_REQUIRE_PTR(eb, plan);
  MLA_REQUIRE_PTR(eb, args);
  MLA_REQUIRE(eb, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, the cache has %d layers", layer, cache->num_layers);
  const int H = args->num_heads;
  MLA_REQUIRE(eb, H >= 1 && H <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "args->num_heads = %d, expected 1..%d", H, MLA_MAX_HEADS);
  {
    mla_status st_ = mla_cpu_check_act(eb, __func__, "args->act_dtype", args->act_dtype);
    if (st_ != MLA_OK) return st_;
  }
  MLA_REQUIRE(eb, isfinite(args->scale) && args->scale > 0.0f, MLA_ERR_INVALID_ARGUMENT,
              "args->scale = %g, expected finite and > 0", (double)args->scale);
  /* MLA_FLAG_FP8_MATH is a permission the CPU never uses: it computes
   * exactly, bit-identical to the call without the flag. */
  MLA_REQUIRE(eb, (args->flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_FP8_MATH)) == 0, MLA_ERR_INVALID_ARGUMENT,
              "args->flags = 0x%x has unknown bits", args->flags);
  MLA_REQUIRE(eb, args->q_stride_token >= 0 && args->q_stride_head >= 0,
              MLA_ERR_INVALID_ARGUMENT, "args->q_stride_token / q_stride_head are negative");
  MLA_REQUIRE(eb, plan->batch_size >= 0 && plan->num_q_tokens >= 0, MLA_ERR_INVALID_ARGUMENT,
              "plan->batch_size = %d / num_q_tokens = %d is negative", (int)plan->batch_size,
              (int)plan->num_q_tokens);
  /* q and out are required even when the plan has no query rows, as on a
   * CUDA context: the same call must not pass on one device and fail on
   * the other. */
  MLA_REQUIRE_PTR(eb, args->q_nope);
  MLA_REQUIRE_PTR(eb, args->q_rope);
  MLA_REQUIRE_PTR(eb, args->out);
  if (plan->mode == MLA_MODE_IDLE || plan->batch_size == 0 || plan->num_q_tokens == 0)
    return MLA_OK; /* nothing to compute, nothing written */
  mla_status st = check_plan(ctx, cache, plan);
  if (st != MLA_OK) return st;

  const geom g = geom_for(H, plan->max_q_len);
  const int workers = mla_ctx_workers(ctx);
  size_t need;
  const size_t nslots = plan->kv_indices ? 0 : (size_t)plan->num_kv_tokens;
  {
    mla_ws w = mla_ws_counter();
    carve(&w, workers, g, NULL, NULL);
    if (!plan->kv_indices) mla_ws_take(&w, sizeof(int32_t) * nslots);
    need = mla_ws_total(&w);
  }
  MLA_REQUIRE(eb, workspace_bytes >= need, MLA_ERR_WORKSPACE_TOO_SMALL,
              "workspace_bytes = %zu, need %zu (mla_attention_absorbed_workspace_size)",
              workspace_bytes, need);
  MLA_REQUIRE_PTR(eb, workspace);

  ab_job J;
  memset(&J, 0, sizeof J);
  J.plan = plan;
  J.args = args;
  J.k = mla_cpu_kernels_get();
  mla_cpu_rows_init(&J.rows, cache, layer, J.k);
  J.split = cache->dtype == MLA_DTYPE_BF16;
  J.g = g;
  J.H = H;
  J.qscale = (float)(args->scale * MLA_CPU_LOG2E);
  J.nope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_LATENT;
  J.nope_sh = args->q_stride_head ? args->q_stride_head : MLA_LATENT;
  J.rope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_ROPE;
  J.rope_sh = args->q_stride_head ? args->q_stride_head : MLA_ROPE;
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  J.scratch_floats = carve(&w, workers, g, &J.scratch, &J.partial);
  mla_plan paged; /* a pages-only plan with the slots filled in */
  if (!plan->kv_indices) {
    int32_t *slots = mla_ws_take(&w, sizeof(int32_t) * nslots);
    if (w.overflow || !slots) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace carve overflow");
    slots_from_pages(plan, slots);
    paged = *plan;
    paged.kv_indices = slots;
    J.plan = plan = &paged;
  }
  if (w.overflow) return mla_fail(eb, MLA_ERR_INTERNAL, __func__, "workspace carve overflow");
  J.num_heads_blocks = (int)mla_cdiv(H, g.hb);

  int64_t n_items = 0;
  for (int i = 0; i < plan->batch_size; i++) n_items += items_of(&J, i);

  if (n_items >= SPLIT_MIN_ITEMS) {
    mla_parallel_for(ctx, n_items, 1, items_range, &J);
    return MLA_OK;
  }

  /* Few items: cut each one's keys into pieces. Piece budget: one per item
   * plus a share of the rest proportional to the item's keys. */
  piece items[SPLIT_MIN_ITEMS], pieces[SPLIT_MAX_PIECES];
  int first_part[SPLIT_MIN_ITEMS], num_parts[SPLIT_MIN_ITEMS];
  int ni = 0;
  int64_t total_keys = 0;
  for (int i = 0; i < plan->batch_size; i++)
    for (int64_t x = 0; x < items_of(&J, i); x++) {
      piece pc = piece_of(&J, i, x);
      /* keys the item may see: up to the causal limit of its last row */
      const int Q = plan->qo_indptr[i + 1] - plan->qo_indptr[i];
      int kend = plan->causal ? pc.k1 - Q + pc.q0 + pc.nq : pc.k1;
      if (kend < 0) kend = 0;
      if (kend > pc.k1) kend = pc.k1;
      pc.k1 = kend;
      pc.item = ni;
      items[ni++] = pc;
      total_keys += kend;
    }
  int min_len = mla_cpu_round_up((int)(total_keys / SPLIT_WANT_PIECES), MLA_CPU_KEYS);
  if (min_len < SPLIT_MIN_KEYS) min_len = SPLIT_MIN_KEYS;
  if (min_len > SPLIT_PIECE_KEYS) min_len = SPLIT_PIECE_KEYS;
  int np = 0;
  for (int it = 0; it < ni; it++) {
    const int keys = items[it].k1;
    int s = 1;
    if (total_keys > 0) s += (int)((int64_t)(SPLIT_MAX_PIECES - ni) * keys / total_keys);
    const int cap = (int)mla_cdiv(keys, min_len);
    if (s > cap) s = cap;
    if (s < 1) s = 1;
    /* tile-aligned piece length, then the count it really gives */
    int len = mla_cpu_round_up((int)mla_cdiv(keys, s), MLA_CPU_KEYS);
    if (len < 1) len = 1;
    s = keys > 0 ? (int)mla_cdiv(keys, len) : 1;
    first_part[it] = np;
    num_parts[it] = s;
    for (int p = 0; p < s; p++) {
      piece pc = items[it];
      pc.k0 = p * len;
      pc.k1 = (p + 1) * len < keys ? (p + 1) * len : keys;
      pc.part = s > 1 ? np : -1;
      pieces[np++] = pc;
    }
  }
  J.pieces = pieces;
  J.items = items;
  J.item_first_part = first_part;
  J.item_num_parts = num_parts;
  atomic_int left[SPLIT_MIN_ITEMS], merge_next[SPLIT_MIN_ITEMS];
  for (int it = 0; it < ni; it++) {
    atomic_init(&left[it], num_parts[it]);
    atomic_init(&merge_next[it], 0);
  }
  J.item_left = left;
  J.merge_next = merge_next;
  J.num_items = ni;
  /* the last piece of a split item merges it */
  atomic_int next_piece;
  atomic_init(&next_piece, 0);
  J.next_piece = &next_piece;
  J.num_pieces = np;
  mla_parallel_for(ctx, workers, 1, pieces_worker, &J);
  return MLA_OK;
}
