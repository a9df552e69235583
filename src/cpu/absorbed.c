/* Absorbed MLA attention on the CPU: every mode a plan describes (decode,
 * target verify, draft extend, extend over a prefix).
 *
 * Work item = (request, block of query tokens, block of heads), at most
 * MLA_CPU_ROWS (token, head) rows. An item walks its request's visible keys
 * in tiles of MLA_CPU_KEYS rows: each tile is dequantized once into the
 * worker's scratch ([c | r] rows, 576 floats; c doubles as V) and used by
 * every row of the item, with an online softmax in fp32.
 *
 * Split-KV: when a batch has fewer than SPLIT_MIN_ITEMS items (small-batch
 * decode), each item's keys are cut into pieces (at most SPLIT_MAX_PIECES in
 * all, each >= SPLIT_MIN_KEYS keys) that run in parallel and write partial
 * (o, lse) states into the workspace, merged afterwards. The decision depends
 * only on the plan and the head count, never on the thread count, so results
 * are bit-identical for any number of threads.
 *
 * Keys past a request's kv length, and keys no row of an item may see under
 * the causal mask, are never loaded: the cache rows behind them may hold
 * anything (tests fill them with NaN). */
#include <limits.h>

#include "cpu.h"

#define SPLIT_MIN_ITEMS 16
#define SPLIT_MAX_PIECES 32
#define SPLIT_MIN_KEYS 128

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

/* Per-worker scratch layout (offsets in floats, each 64-byte aligned). */
typedef struct scratch_layout {
  size_t kt, qt, s, acc, m, l, alpha, lim, total;
} scratch_layout;

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

static scratch_layout layout_for(int rb) {
  scratch_layout L;
  size_t o = 0;
  L.kt = o, o += al16((size_t)MLA_CPU_KEYS * MLA_ROW);   /* key tile [KEYS, 576] */
  L.qt = o, o += al16((size_t)MLA_ROW * rb);             /* QT [576, rb] */
  L.s = o, o += al16((size_t)MLA_CPU_KEYS * rb);         /* S / P [KEYS, rb] */
  L.acc = o, o += al16((size_t)rb * MLA_LATENT);         /* acc [rb, 512] */
  L.m = o, o += al16((size_t)rb);
  L.l = o, o += al16((size_t)rb);
  L.alpha = o, o += al16((size_t)rb);
  L.lim = o, o += al16((size_t)rb); /* int32 per row, same size as a float */
  L.total = o;
  return L;
}

/* Workspace: [workers x scratch][split partials: SPLIT_MAX_PIECES x rb x (512 + 1)]. */
static size_t carve(mla_ws *w, int workers, geom g, float **scratch, float **partial) {
  scratch_layout L = layout_for(g.rb);
  size_t pw = L.total * sizeof(float);
  float *a = mla_ws_take(w, pw * (size_t)workers);
  float *b = mla_ws_take(w, (size_t)SPLIT_MAX_PIECES * g.rb * (MLA_LATENT + 1) * sizeof(float));
  if (scratch) *scratch = a;
  if (partial) *partial = b;
  return L.total;
}

/* One unit of parallel work: rows [q0, q0+nq) x heads [h0, h0+nh) of request
 * req over its keys [k0, k1). part >= 0: write the partial state to slot part
 * of the split area; part < 0: write the final outputs. */
typedef struct piece {
  int32_t req, q0, nq, h0, nh, k0, k1, part;
} piece;

typedef struct ab_job {
  const mla_plan *plan;
  const mla_absorbed_args *args;
  const mla_cpu_kernels *k;
  mla_cpu_rows rows;
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
} ab_job;

static void write_row(const ab_job *J, int64_t t, int h, const float *o /* [512] */,
                      double lse2) {
  const mla_absorbed_args *a = J->args;
  mla_store_f32(a->act_dtype, a->out, (t * J->H + h) * (int64_t)MLA_LATENT, MLA_LATENT, o);
  if (a->lse) {
    double v = (a->flags & MLA_FLAG_LSE_BASE2) ? lse2 : lse2 * MLA_CPU_LN2;
    a->lse[t * J->H + h] = (float)v;
  }
}

static void run_piece(const ab_job *J, const piece *pc, int worker) {
  const mla_plan *P = J->plan;
  const mla_absorbed_args *a = J->args;
  const mla_cpu_kernels *k = J->k;
  scratch_layout L = layout_for(J->g.rb);
  float *base = J->scratch + (size_t)worker * J->scratch_floats;
  float *Kt = base + L.kt, *QT = base + L.qt, *S = base + L.s, *acc = base + L.acc;
  float *m = base + L.m, *l = base + L.l, *alpha = base + L.alpha;
  int32_t *lim = (int32_t *)(base + L.lim);

  const int req = pc->req;
  const int64_t tq0 = P->qo_indptr[req];
  const int Q = P->qo_indptr[req + 1] - P->qo_indptr[req];
  const int K = P->kv_lens[req];
  const int rows = pc->nq * pc->nh;
  const int rb = mla_cpu_round_up(rows, MLA_CPU_ROW_ALIGN);

  /* Query block, transposed and pre-scaled; padded rows are zero. */
  float qrow[MLA_ROW];
  int minlim = INT_MAX, maxlim = -1;
  for (int r = 0; r < rb; r++) {
    if (r < rows) {
      const int qa = pc->q0 + r / pc->nh, h = pc->h0 + r % pc->nh;
      const int64_t t = tq0 + qa;
      mla_cpu_load_act(k, a->act_dtype, a->q_nope, t * J->nope_st + h * J->nope_sh, MLA_LATENT,
                       qrow);
      mla_cpu_load_act(k, a->act_dtype, a->q_rope, t * J->rope_st + h * J->rope_sh, MLA_ROPE,
                       qrow + MLA_LATENT);
      for (int d = 0; d < MLA_ROW; d++) QT[(size_t)d * rb + r] = qrow[d] * J->qscale;
      /* last visible key (bottom-right causal); may be negative: no key */
      lim[r] = P->causal ? K - Q + qa : K - 1;
      if (lim[r] < minlim) minlim = lim[r];
      if (lim[r] > maxlim) maxlim = lim[r];
    } else {
      for (int d = 0; d < MLA_ROW; d++) QT[(size_t)d * rb + r] = 0.0f;
      lim[r] = -1;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  memset(acc, 0, (size_t)rows * MLA_LATENT * sizeof(float));

  const int32_t *slots = P->kv_indices + P->kv_indptr[req];
  const int kend = pc->k1 < maxlim + 1 ? pc->k1 : maxlim + 1;
  for (int kt = pc->k0; kt < kend; kt += MLA_CPU_KEYS) {
    const int n = kend - kt < MLA_CPU_KEYS ? kend - kt : MLA_CPU_KEYS;
    mla_cpu_load_rows(&J->rows, slots + kt, n, Kt, MLA_ROW, NULL, 0);
    k->qk(n, MLA_ROW, Kt, MLA_ROW, QT, rb, S);
    if (kt + n - 1 > minlim)
      for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++)
          if (kt + j > lim[r]) S[(size_t)j * rb + r] = -INFINITY;
    k->softmax(n, rb, S, m, l, alpha);
    k->pv(n, rows, S, rb, Kt, MLA_ROW, MLA_LATENT, alpha, acc, MLA_LATENT);
  }

  for (int r = 0; r < rows; r++) {
    float *o = acc + (size_t)r * MLA_LATENT;
    double lse2;
    if (m[r] == -INFINITY) { /* no visible key in this range */
      memset(o, 0, MLA_LATENT * sizeof(float));
      lse2 = -INFINITY;
    } else {
      const float inv = 1.0f / l[r];
      for (int e = 0; e < MLA_LATENT; e++) o[e] *= inv;
      lse2 = (double)m[r] + log2((double)l[r]);
    }
    if (pc->part >= 0) {
      float *dst = J->partial + ((size_t)pc->part * J->g.rb + r) * (MLA_LATENT + 1);
      memcpy(dst, o, MLA_LATENT * sizeof(float));
      dst[MLA_LATENT] = (float)lse2;
    } else {
      write_row(J, tq0 + pc->q0 + r / pc->nh, pc->h0 + r % pc->nh, o, lse2);
    }
  }
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
  return pc;
}

static void items_range(void *arg, int64_t b, int64_t e, int worker) {
  const ab_job *J = arg;
  /* Find the request holding item b: a scan over the batch, done once per
   * chunk (a handful of chunks per worker), so no index table is needed. */
  int i = 0;
  int64_t first = 0;
  while (i < J->plan->batch_size && first + items_of(J, i) <= b) first += items_of(J, i++);
  for (int64_t it = b; it < e; it++) {
    while (it - first >= items_of(J, i)) first += items_of(J, i++);
    piece pc = piece_of(J, i, it - first);
    run_piece(J, &pc, worker);
  }
}

static void pieces_range(void *arg, int64_t b, int64_t e, int worker) {
  const ab_job *J = arg;
  for (int64_t p = b; p < e; p++) run_piece(J, &J->pieces[p], worker);
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
    double mx = -INFINITY;
    for (int p = 0; p < np; p++) {
      double v = J->partial[((size_t)(p0 + p) * J->g.rb + r) * (MLA_LATENT + 1) + MLA_LATENT];
      if (v > mx) mx = v;
    }
    float o[MLA_LATENT];
    double lse2 = -INFINITY;
    if (mx == -INFINITY) {
      memset(o, 0, sizeof o);
    } else {
      double accd[MLA_LATENT] = {0}, wsum = 0.0;
      for (int p = 0; p < np; p++) {
        const float *src = J->partial + ((size_t)(p0 + p) * J->g.rb + r) * (MLA_LATENT + 1);
        if (src[MLA_LATENT] == -INFINITY) continue; /* empty piece: no weight, no NaN */
        const double w = exp2((double)src[MLA_LATENT] - mx);
        wsum += w;
        for (int c = 0; c < MLA_LATENT; c++) accd[c] += w * src[c];
      }
      for (int c = 0; c < MLA_LATENT; c++) o[c] = (float)(accd[c] / wsum);
      lse2 = mx + log2(wsum);
    }
    write_row(J, J->plan->qo_indptr[pc->req] + pc->q0 + r / pc->nh, pc->h0 + r % pc->nh, o,
              lse2);
  }
}

/* The size depends only on mla_ctx_workers(ctx), num_heads and
 * plan->max_q_len (not on the batch's lengths), so a caller can size one
 * workspace for its largest batch by passing a plan whose max_q_len is its
 * maximum. It must be queried again after mla_ctx_set_threads. */
mla_status mla_attention_absorbed_workspace_size(mla_ctx *ctx, const mla_plan *plan,
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
  *bytes = mla_ws_total(&w);
  return MLA_OK;
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
  if (p->kv_indptr[p->batch_size] > 0 && !p->kv_indices)
    return mla_fail(eb, MLA_ERR_INVALID_ARGUMENT, fn, "plan->kv_indices is NULL");
  for (int i = 0; i < p->batch_size; i++) {
    const int32_t *idx = p->kv_indices + p->kv_indptr[i];
    for (int j = 0; j < p->kv_lens[i]; j++)
      if (idx[j] < 0 || idx[j] >= cache->num_slots)
        return mla_fail(eb, MLA_ERR_OUT_OF_RANGE, fn,
                        "plan: key %d of request %d is slot %d, outside the cache's [0, %lld)",
                        j, i, (int)idx[j], (long long)cache->num_slots);
  }
  return MLA_OK;
}

mla_status mla_attention_absorbed(mla_ctx *ctx, const mla_kv_cache *cache, int layer,
                                  const mla_plan *plan, const mla_absorbed_args *args,
                                  void *workspace, size_t workspace_bytes) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
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
  MLA_REQUIRE(eb, (args->flags & ~MLA_FLAG_LSE_BASE2) == 0, MLA_ERR_INVALID_ARGUMENT,
              "args->flags = 0x%x has unknown bits", args->flags);
  MLA_REQUIRE(eb, args->q_stride_token >= 0 && args->q_stride_head >= 0,
              MLA_ERR_INVALID_ARGUMENT, "args->q_stride_token / q_stride_head are negative");
  MLA_REQUIRE(eb, plan->batch_size >= 0 && plan->num_q_tokens >= 0, MLA_ERR_INVALID_ARGUMENT,
              "plan->batch_size = %d / num_q_tokens = %d is negative", (int)plan->batch_size,
              (int)plan->num_q_tokens);
  if (plan->mode == MLA_MODE_IDLE || plan->batch_size == 0 || plan->num_q_tokens == 0)
    return MLA_OK; /* nothing to compute, nothing written */
  mla_status st = check_plan(ctx, cache, plan);
  if (st != MLA_OK) return st;
  MLA_REQUIRE_PTR(eb, args->q_nope);
  MLA_REQUIRE_PTR(eb, args->q_rope);
  MLA_REQUIRE_PTR(eb, args->out);

  const geom g = geom_for(H, plan->max_q_len);
  const int workers = mla_ctx_workers(ctx);
  size_t need;
  {
    mla_ws w = mla_ws_counter();
    carve(&w, workers, g, NULL, NULL);
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
  J.g = g;
  J.H = H;
  J.qscale = (float)(args->scale * MLA_CPU_LOG2E);
  J.nope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_LATENT;
  J.nope_sh = args->q_stride_head ? args->q_stride_head : MLA_LATENT;
  J.rope_st = args->q_stride_token ? args->q_stride_token : (int64_t)H * MLA_ROPE;
  J.rope_sh = args->q_stride_head ? args->q_stride_head : MLA_ROPE;
  mla_ws w = mla_ws_over(workspace, workspace_bytes);
  J.scratch_floats = carve(&w, workers, g, &J.scratch, &J.partial);
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
      items[ni++] = pc;
      total_keys += kend;
    }
  int np = 0;
  for (int it = 0; it < ni; it++) {
    const int keys = items[it].k1;
    int s = 1;
    if (total_keys > 0) s += (int)((int64_t)(SPLIT_MAX_PIECES - ni) * keys / total_keys);
    const int cap = (int)mla_cdiv(keys, SPLIT_MIN_KEYS);
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
  mla_parallel_for(ctx, np, 1, pieces_range, &J);
  mla_parallel_for(ctx, (int64_t)ni * g.rb, 8, merge_range, &J);
  return MLA_OK;
}
