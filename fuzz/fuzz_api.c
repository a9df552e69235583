/* libFuzzer target over libmla's public API.
 *
 * One input drives one session:
 *   1. a context, a KV cache and a request table of small random geometry
 *      (plus creation calls with hostile descriptors, which must fail);
 *   2. a sequence of request-table operations (add / extend / fork /
 *      truncate / free / queries) with arbitrary, possibly invalid arguments.
 *      After each one the allocator's invariants are checked against
 *      req_to_token (page reference counts, free count, page-aligned slots),
 *      a failed call must have changed nothing, and every row written through
 *      the slots extend returned still reads back its stamp (so a missing
 *      copy-on-write shows up);
 *   3. a random mla_batch (any mode, arbitrary lengths and ids including
 *      negative, MLA_REQ_PAD, out of range, NULL arrays) through
 *      mla_plan_build, mla_chunk_plan_build, mla_draft_plan_build and
 *      mla_dcp_plan_build with workspaces of the reported size (sometimes too
 *      small, NULL or misaligned). The plan call's status is predicted from
 *      the documented rules and every successful plan is checked entry by
 *      entry (indptrs, kv_indices = req_to_token, pages, block table, and a
 *      split schedule covering every request's keys exactly once). A
 *      successful plan then runs mla_attention_absorbed with small H, and one
 *      output row is checked against a float64 recomputation;
 *   4. direct calls with arbitrary arguments (NULLs, negatives, huge values)
 *      to cache write/read/copy, gather, merge, ragged attention, expand,
 *      convert and the context functions;
 *   5. device-built steps on the CPU context: a random mla_step_desc (any
 *      mode, batch sizes 0..huge, ndt, max_kv_len, heads, page size, num_sm
 *      past 1024, draft num_steps / step in and out of range) and
 *      mla_step_inputs (the world's table or a private copy with a wider
 *      stride and corrupted page-start slots, or hostile: NULLs, a stride
 *      below max_kv_len, max_reqs 0; ids incl. MLA_REQ_PAD, dead and out of
 *      range; lengths incl. negative and past max_kv_len) through
 *      mla_step_workspace_size / mla_step_prepare with workspaces as in 3.
 *      The status is predicted from the header (INVALID_ARGUMENT,
 *      WORKSPACE_TOO_SMALL, OUT_OF_RANGE for a row out of range) and a
 *      refused prepare must leave the workspace as it was. A successful one
 *      is checked through mla_step_get_metadata for every step (kv lengths,
 *      qo_indptr, block table, the split schedule with the plan phase's
 *      checker, equality with mla_plan_build's metadata where a plan
 *      applies), then mla_step_attention runs with small H and one output
 *      row is checked in float64;
 *   6. (1 input in 4) a small backend on the CPU context driven through the
 *      graph calls: hostile then valid mla_backend_graph_init, graph_inputs,
 *      random ids / lengths written into the input buffers, mla_backend_sync,
 *      mla_backend_graph_step with hostile and valid mode / batch / ndt (its
 *      status predicted; a refused step leaves nothing to forward), and one
 *      layer of mla_backend_forward whose output row is checked in float64.
 * Phases 5 and 6 come last so that older corpus inputs drive 1-4 as before.
 * Every call must return a valid mla_status other than MLA_ERR_INTERNAL, and
 * a failure on a live handle must leave a non-empty "mla...: ..." message.
 *
 * A "huge" size is only ever passed where the library must reject it (with
 * NULL arrays, or above a documented limit): a valid size is a promise about
 * the caller's buffers, which no library can check. Sizes that are valid are
 * kept small so the fuzzer runs thousands of inputs per second.
 *
 * Invariant failures abort() (this is the harness, not library code). The
 * same file, compiled without libFuzzer, is the regression replayer
 * (replay.c). */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ------------------------------------------------------------------------ */
/* Checks                                                                    */
/* ------------------------------------------------------------------------ */
#define FZ_ASSERT(cond, ...)                                                          \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "fuzz_api: %s:%d: invariant failed: %s\n  ", __FILE__, __LINE__, \
              #cond);                                                                 \
      fprintf(stderr, __VA_ARGS__);                                                   \
      fputc('\n', stderr);                                                            \
      abort();                                                                        \
    }                                                                                 \
  } while (0)

/* Every status is one of the pinned values and never INTERNAL; a failure on
 * a handle (err != NULL) leaves a message naming the call. */
static mla_status chk(mla_status st, const char *call, const char *err) {
  FZ_ASSERT((int)st >= (int)MLA_OK && (int)st <= (int)MLA_ERR_INTERNAL, "%s returned %d", call,
            (int)st);
  FZ_ASSERT(st != MLA_ERR_INTERNAL, "%s returned MLA_ERR_INTERNAL: %s", call, err ? err : "");
  if (st != MLA_OK && err)
    FZ_ASSERT(err[0] != '\0' && strncmp(err, "mla", 3) == 0,
              "%s failed with %s but the last-error message is \"%s\"", call,
              mla_status_string(st), err);
  return st;
}
#define CTX_CHK(w, call) chk((call), #call, mla_ctx_last_error((w)->ctx))
#define RT_CHK(w, call) chk((call), #call, mla_req_table_last_error((w)->rt))
#define CACHE_CHK(w, call) chk((call), #call, mla_kv_cache_last_error((w)->cache))

/* How often each path succeeded (printed by fuzz_replay with FZ_STATS=1):
 * shows whether the decoding reaches the deep paths. */
long fz_stats[8];
const char *const fz_stat_names[8] = {"table ops ok", "plans ok", "absorbed ok", "dcp ok",
                                      "chunk ok", "draft ok", "ragged ok", "merge ok"};
#define FZ_COUNT(k) (fz_stats[k]++)

/* ------------------------------------------------------------------------ */
/* Input decoding: bytes -> choices. An exhausted input reads as zeros, which */
/* always decode to a valid, small choice.                                   */
/* ------------------------------------------------------------------------ */
typedef struct fz {
  const uint8_t *p;
  size_t n, i;
} fz;

static unsigned fz_u8(fz *f) { return f->i < f->n ? f->p[f->i++] : 0u; }
static unsigned fz_u16(fz *f) {
  unsigned a = fz_u8(f);
  return a | fz_u8(f) << 8;
}
/* 0..n-1 */
static int fz_pick(fz *f, int n) { return (int)(fz_u8(f) % (unsigned)n); }
/* lo..hi inclusive (hi - lo < 65536) */
static int fz_int(fz *f, int lo, int hi) {
  unsigned span = (unsigned)(hi - lo) + 1u;
  return lo + (int)((span <= 256 ? fz_u8(f) : fz_u16(f)) % span);
}
/* 1 in n (n >= 2): mostly false */
static int fz_rare(fz *f, int n) { return fz_pick(f, n) == n - 1; }

/* Mostly lo..hi; about 1 in 8 a hostile value. Only for arguments whose
 * hostile values the library must reject or that index nothing the caller
 * sized (ids, lengths checked against a table). */
static int32_t fz_wild(fz *f, int lo, int hi) {
  unsigned s = fz_u8(f);
  if (s < 224) return fz_int(f, lo, hi);
  switch (s & 7) {
    case 0: return -1;
    case 1: return lo - 1;
    case 2: return hi + 1;
    case 3: return INT32_MIN;
    case 4: return INT32_MAX;
    case 5: return -(1 << 20);
    case 6: return 1 << 24;
    default: return hi + 1000;
  }
}

/* Deterministic filler for tensors (xorshift32 seeded from the input). */
typedef struct fz_rng {
  uint32_t s;
} fz_rng;
static uint32_t rng_next(fz_rng *r) {
  uint32_t x = r->s ? r->s : 0x9e3779b9u;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return r->s = x;
}
/* Multiples of 1/8 in [-2, 2]: exact in f32, bf16, f16 and (|x| <= 2) e4m3. */
static float rng_val(fz_rng *r) { return (float)((int)(rng_next(r) % 33u) - 16) * 0.125f; }

/* ------------------------------------------------------------------------ */
/* Activation dtypes (values used here are exactly representable)            */
/* ------------------------------------------------------------------------ */
static size_t act_size(mla_dtype t) { return t == MLA_DTYPE_F32 ? 4 : 2; }

static uint16_t f32_to_f16(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0) return (uint16_t)sign; /* zero (inputs have no subnormals) */
  if (e <= 0) { /* f16 subnormal (truncating is exact for the values used) */
    m |= 0x800000u;
    return (uint16_t)(sign | (m >> (14 - e)));
  }
  return (uint16_t)(sign | (uint32_t)e << 10 | m >> 13);
}

static float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, u;
  if (e == 0) {
    float v = ldexpf((float)m, -24);
    return sign ? -v : v;
  }
  if (e == 31) {
    u = sign | 0x7f800000u | m << 13;
  } else {
    u = sign | (e - 15 + 127) << 23 | m << 13;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static void put_act(mla_dtype t, void *buf, int64_t i, float v) {
  if (t == MLA_DTYPE_F32) {
    ((float *)buf)[i] = v;
  } else if (t == MLA_DTYPE_BF16) {
    uint32_t u;
    memcpy(&u, &v, 4);
    ((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
  } else {
    ((uint16_t *)buf)[i] = f32_to_f16(v);
  }
}

static float get_act(mla_dtype t, const void *buf, int64_t i) {
  if (t == MLA_DTYPE_F32) return ((const float *)buf)[i];
  uint16_t h = ((const uint16_t *)buf)[i];
  if (t == MLA_DTYPE_BF16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  return f16_to_f32(h);
}

/* An activation dtype the caller may pick, including invalid ones. */
static mla_dtype fz_act_dtype(fz *f) {
  static const int v[] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_F32,
                          MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3, MLA_DTYPE_F64,
                          MLA_DTYPE_FP8_E4M3_BLOCK, 6, -1, 1000};
  int k = fz_u8(f) < 232 ? fz_pick(f, 6) : 6 + fz_pick(f, 6);
  return (mla_dtype)v[k];
}
static int is_act(mla_dtype t) {
  return t == MLA_DTYPE_F32 || t == MLA_DTYPE_BF16 || t == MLA_DTYPE_F16;
}

/* A float argument: mostly `normal`, sometimes hostile. */
static float fz_float(fz *f, float normal) {
  switch (fz_u8(f) < 224 ? 0 : fz_pick(f, 6)) {
    case 0: return normal;
    case 1: return 0.0f;
    case 2: return -normal;
    case 3: return NAN;
    case 4: return INFINITY;
    default: return FLT_MAX;
  }
}

/* Caller-owned buffer of exactly `bytes`, at an offset of 0..7 bytes from a
 * malloc'd base (the library must cope with any alignment). */
typedef struct fz_buf {
  char *base;
  void *p;
} fz_buf;
static fz_buf buf_alloc(size_t bytes, int misalign) {
  fz_buf b;
  b.base = malloc(bytes + (size_t)misalign + 1);
  FZ_ASSERT(b.base != NULL, "harness malloc(%zu)", bytes);
  b.p = b.base + misalign;
  return b;
}

/* Workspace the caller would pass for a reported size: usually exactly it,
 * sometimes 1 byte short, 0 bytes, or NULL. Sizes above WS_CAP are not
 * allocated (a caller would not have them): a WS_CAP buffer is passed. */
#define WS_CAP ((size_t)4 << 20)
typedef struct fz_ws {
  fz_buf buf;
  void *p;
  size_t bytes;
  int full; /* bytes >= reported and p != NULL */
} fz_ws;
static fz_ws ws_for(fz *f, size_t reported, int have_report) {
  fz_ws w;
  size_t want = have_report ? reported : (size_t)fz_int(f, 0, 4096);
  int how = fz_pick(f, 16);
  if (how == 13 && want > 0) want -= 1;
  if (how == 14) want = 0;
  if (want > WS_CAP) want = WS_CAP;
  w.buf = buf_alloc(want, fz_pick(f, 8));
  w.p = how == 15 ? NULL : w.buf.p;
  w.bytes = want;
  w.full = have_report && w.p != NULL && want >= reported;
  return w;
}
static void ws_free(fz_ws *w) { free(w->buf.base); }

/* ------------------------------------------------------------------------ */
/* The session                                                               */
/* ------------------------------------------------------------------------ */
typedef struct world {
  mla_ctx *ctx;
  mla_kv_cache *cache;
  mla_req_table *rt;
  int rt_has_cache;
  int num_layers, num_pages, page_size; /* the cache's */
  mla_dtype dtype;
  int rt_pages, rt_page_size, max_reqs, max_context; /* the table's */
  /* Row stamps: stamp[req * max_context + pos] = value written into the rope
   * part of that position's row (digits in r[0..3]), -1 = unknown. */
  int32_t *stamp;
  int32_t next_stamp;
  fz_rng rng;
  /* Set once direct calls may have left a non-finite value in the cache (a
   * NaN row, a huge fp8 scale): later phases then skip the numeric checks. */
  int cache_not_finite;
} world;

#define STAMP_DIGITS 4

/* The row of stamp s: c from s (small multiples of 1/8), r[0..3] the base-16
 * digits of s (exact in every cache format at the scales used), r[4..] small. */
static void stamp_row(int32_t s, float *c, float *r) {
  for (int j = 0; j < MLA_LATENT; j++) c[j] = (float)((s * 31 + j) % 17 - 8) * 0.125f;
  for (int j = 0; j < MLA_ROPE; j++)
    r[j] = j < STAMP_DIGITS ? (float)((s >> (4 * j)) & 15) : (float)((s + j) % 5 - 2) * 0.5f;
}

/* Write stamped rows into `slots` in every layer and record the stamps of
 * positions [pos0, pos0 + n) of request `req`. */
static void write_stamps(world *w, int32_t req, int pos0, int n, const int32_t *slots) {
  if (n <= 0) return;
  float *c = malloc((size_t)n * MLA_LATENT * sizeof(float));
  float *r = malloc((size_t)n * MLA_ROPE * sizeof(float));
  FZ_ASSERT(c && r, "harness malloc");
  for (int i = 0; i < n; i++) {
    int32_t s = w->next_stamp++ & 0xffff;
    stamp_row(s, c + (size_t)i * MLA_LATENT, r + (size_t)i * MLA_ROPE);
    w->stamp[(size_t)req * w->max_context + pos0 + i] = s;
  }
  for (int l = 0; l < w->num_layers; l++) {
    mla_status st = CACHE_CHK(w, mla_kv_cache_write(w->cache, l, n, slots, c, r, MLA_DTYPE_F32));
    FZ_ASSERT(st == MLA_OK, "writing slots extend returned failed: %s",
              mla_kv_cache_last_error(w->cache));
  }
  free(c);
  free(r);
}

/* Every known stamp reads back from the slot req_to_token gives now. */
static void check_stamps(world *w) {
  if (!w->rt_has_cache) return;
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(w->rt, &r2t) == MLA_OK, "mla_req_table_data");
  int cap = w->max_reqs * w->max_context, n = 0;
  int32_t *slots = malloc((size_t)cap * sizeof(int32_t));
  int32_t *want = malloc((size_t)cap * sizeof(int32_t));
  float *r = malloc((size_t)cap * MLA_ROPE * sizeof(float));
  FZ_ASSERT(slots && want && r, "harness malloc");
  for (int q = 0; q < w->max_reqs; q++) {
    int live = 0, len = 0;
    FZ_ASSERT(mla_req_is_live(w->rt, q, &live) == MLA_OK, "mla_req_is_live(%d)", q);
    if (!live) continue;
    FZ_ASSERT(mla_req_length(w->rt, q, &len) == MLA_OK, "mla_req_length(%d)", q);
    for (int p = 0; p < len; p++) {
      int32_t s = w->stamp[(size_t)q * w->max_context + p];
      if (s < 0) continue;
      slots[n] = r2t[(size_t)q * w->max_context + p];
      want[n++] = s;
    }
  }
  for (int l = 0; l < w->num_layers && n > 0; l++) {
    mla_status st = CACHE_CHK(w, mla_kv_cache_read(w->cache, l, n, slots, NULL, r, MLA_DTYPE_F32));
    FZ_ASSERT(st == MLA_OK, "reading live slots failed: %s", mla_kv_cache_last_error(w->cache));
    for (int i = 0; i < n; i++) {
      int32_t got = 0;
      for (int d = 0; d < STAMP_DIGITS; d++) got |= (int32_t)r[(size_t)i * MLA_ROPE + d] << (4 * d);
      FZ_ASSERT(got == want[i], "layer %d slot %d holds stamp %d, expected %d (lost write or "
                "missing copy-on-write)", l, (int)slots[i], (int)got, (int)want[i]);
    }
  }
  free(slots);
  free(want);
  free(r);
}

/* Snapshot of everything a failed request-table call must leave unchanged. */
typedef struct rt_snap {
  int32_t *r2t; /* [max_reqs * max_context] */
  int32_t *len; /* [max_reqs], -1 = not live */
  int32_t *refs; /* [rt_pages] */
  int free_pages;
} rt_snap;

static rt_snap snap_take(world *w) {
  rt_snap s;
  size_t nt = (size_t)w->max_reqs * w->max_context;
  s.r2t = malloc(nt * sizeof(int32_t));
  s.len = malloc((size_t)w->max_reqs * sizeof(int32_t));
  s.refs = malloc((size_t)w->rt_pages * sizeof(int32_t));
  FZ_ASSERT(s.r2t && s.len && s.refs, "harness malloc");
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(w->rt, &r2t) == MLA_OK, "mla_req_table_data");
  memcpy(s.r2t, r2t, nt * sizeof(int32_t));
  for (int q = 0; q < w->max_reqs; q++) {
    int live = 0, len = -1;
    FZ_ASSERT(mla_req_is_live(w->rt, q, &live) == MLA_OK, "mla_req_is_live");
    if (live) FZ_ASSERT(mla_req_length(w->rt, q, &len) == MLA_OK, "mla_req_length");
    s.len[q] = live ? len : -1;
  }
  for (int p = 0; p < w->rt_pages; p++)
    FZ_ASSERT(mla_req_table_page_refs(w->rt, p, &s.refs[p]) == MLA_OK, "page_refs");
  FZ_ASSERT(mla_req_table_free_pages(w->rt, &s.free_pages) == MLA_OK, "free_pages");
  return s;
}
static void snap_free(rt_snap *s) {
  free(s->r2t);
  free(s->len);
  free(s->refs);
}
static void snap_same(world *w, const rt_snap *a, const char *call) {
  rt_snap b = snap_take(w);
  size_t nt = (size_t)w->max_reqs * w->max_context;
  FZ_ASSERT(memcmp(a->r2t, b.r2t, nt * sizeof(int32_t)) == 0, "failed %s changed req_to_token", call);
  FZ_ASSERT(memcmp(a->len, b.len, (size_t)w->max_reqs * sizeof(int32_t)) == 0,
            "failed %s changed a request's length or liveness", call);
  FZ_ASSERT(memcmp(a->refs, b.refs, (size_t)w->rt_pages * sizeof(int32_t)) == 0,
            "failed %s changed page reference counts", call);
  FZ_ASSERT(a->free_pages == b.free_pages, "failed %s changed the free page count", call);
  snap_free(&b);
}

/* The allocator's invariants, recomputed from req_to_token. */
static void check_table(world *w) {
  const int P = w->rt_page_size, NP = w->rt_pages, MC = w->max_context;
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(w->rt, &r2t) == MLA_OK, "mla_req_table_data");
  int32_t *refs = calloc((size_t)NP, sizeof(int32_t));
  FZ_ASSERT(refs, "harness calloc");
  refs[0] = 1; /* reserved */
  for (int q = 0; q < w->max_reqs; q++) {
    const int32_t *row = r2t + (size_t)q * MC;
    int live = -1, len = -1;
    FZ_ASSERT(mla_req_is_live(w->rt, q, &live) == MLA_OK && (live == 0 || live == 1),
              "mla_req_is_live(%d) = %d", q, live);
    if (!live) {
      FZ_ASSERT(mla_req_length(w->rt, q, &len) == MLA_ERR_BAD_STATE,
                "mla_req_length of dead request %d", q);
      for (int p = 0; p < MC; p++)
        FZ_ASSERT(row[p] == MLA_SLOT_UNUSED, "dead request %d has slot %d at %d", q, (int)row[p], p);
      continue;
    }
    FZ_ASSERT(mla_req_length(w->rt, q, &len) == MLA_OK && len >= 0 && len <= MC,
              "request %d length %d", q, len);
    for (int p = 0; p < len; p++) {
      int32_t s = row[p];
      FZ_ASSERT(s >= P && s < (int64_t)NP * P, "request %d position %d has slot %d (pages 1..%d)",
                q, p, (int)s, NP - 1);
      FZ_ASSERT(s % P == p % P, "request %d position %d: slot %d is not page-aligned", q, p, (int)s);
      FZ_ASSERT(s / P == row[p - p % P] / P, "request %d position %d leaves its page", q, p);
    }
    for (int p = len; p < MC; p++)
      FZ_ASSERT(row[p] == MLA_SLOT_UNUSED, "request %d (length %d) has slot %d at %d", q, len,
                (int)row[p], p);
    for (int p = 0; p < len; p += P) refs[row[p] / P]++;
  }
  int free_count = 0;
  for (int pg = 0; pg < NP; pg++) {
    int got = -1;
    FZ_ASSERT(mla_req_table_page_refs(w->rt, pg, &got) == MLA_OK, "page_refs(%d)", pg);
    FZ_ASSERT(got == refs[pg], "page %d has %d references, req_to_token uses it %d times", pg,
              got, (int)refs[pg]);
    if (pg > 0 && refs[pg] == 0) free_count++;
  }
  int fp = -1;
  FZ_ASSERT(mla_req_table_free_pages(w->rt, &fp) == MLA_OK && fp == free_count,
            "free_pages = %d, %d pages are unreferenced", fp, free_count);
  free(refs);
}

/* A request id: mostly 0..max_reqs-1, sometimes padding or out of range. */
static int32_t fz_req(fz *f, const world *w) {
  unsigned s = fz_u8(f);
  if (s < 208) return (int32_t)(s % (unsigned)w->max_reqs);
  switch (s % 6) {
    case 0: return MLA_REQ_PAD;
    case 1: return w->max_reqs;
    case 2: return INT32_MAX;
    case 3: return INT32_MIN;
    case 4: return -2;
    default: return w->max_reqs + 7;
  }
}
static int req_len(const world *w, int32_t q) {
  int len = -1;
  if (q < 0 || q >= w->max_reqs) return -1;
  if (mla_req_length(w->rt, q, &len) != MLA_OK) return -1;
  return len;
}

/* ---- 1. set-up ---------------------------------------------------------- */
static int setup(fz *f, world *w) {
  memset(w, 0, sizeof *w);
  w->rng.s = fz_u16(f) * 2654435761u + 1u;

  /* Hostile context descriptors first: all must be refused. */
  if (fz_rare(f, 4)) {
    mla_ctx_desc bad = {.device = MLA_DEVICE_CPU, .num_threads = 1};
    switch (fz_pick(f, 4)) {
      case 0: bad.num_threads = -1; break;
      case 1: bad.num_threads = INT32_MAX; break;
      case 2: bad.device = (mla_device)7; break;
      default: bad.num_threads = INT32_MIN; break;
    }
    mla_ctx *c = (mla_ctx *)&bad; /* must be overwritten with NULL */
    mla_status st = chk(mla_ctx_create(&bad, &c), "mla_ctx_create(bad)", NULL);
    FZ_ASSERT(st != MLA_OK && c == NULL, "mla_ctx_create accepted a bad descriptor (%s)",
              mla_status_string(st));
    FZ_ASSERT(chk(mla_ctx_create(&bad, NULL), "mla_ctx_create(NULL)", NULL) != MLA_OK,
              "mla_ctx_create(out = NULL)");
  }
  mla_ctx_desc cd = {.device = MLA_DEVICE_CPU, .num_threads = 1 + fz_pick(f, 2)};
  FZ_ASSERT(mla_ctx_create(&cd, &w->ctx) == MLA_OK && w->ctx, "mla_ctx_create");
  /* The const queries record their failures too (fuzz/regressions/ctx_query_*);
   * a successful call that clears the message goes first, so that a stale
   * message cannot stand in for a missing one. */
  size_t dummy;
  FZ_ASSERT(mla_dcp_plan_workspace_size(w->ctx, 1, 1, &dummy) == MLA_OK &&
                mla_ctx_last_error(w->ctx)[0] == '\0',
            "a successful call leaves the last error \"%s\"", mla_ctx_last_error(w->ctx));
  FZ_ASSERT(CTX_CHK(w, mla_ctx_get_threads(w->ctx, NULL)) == MLA_ERR_INVALID_ARGUMENT, "threads");
  mla_dcp_plan_workspace_size(w->ctx, 1, 1, &dummy);
  FZ_ASSERT(CTX_CHK(w, mla_ctx_get_device(w->ctx, NULL)) == MLA_ERR_INVALID_ARGUMENT, "device");
  mla_dcp_plan_workspace_size(w->ctx, 1, 1, &dummy);
  FZ_ASSERT(CTX_CHK(w, mla_ctx_cpu_isa(w->ctx, NULL)) == MLA_ERR_INVALID_ARGUMENT, "cpu_isa");

  /* Cache. */
  static const mla_dtype dts[] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3,
                                  MLA_DTYPE_FP8_E4M3_BLOCK};
  mla_kv_cache_desc kd;
  memset(&kd, 0, sizeof kd);
  kd.num_layers = 1 + fz_pick(f, 2);
  kd.num_pages = 2 + fz_pick(f, 11);
  kd.page_size = 1 << fz_pick(f, 5);
  kd.dtype = dts[fz_pick(f, 4)];
  float scales[2] = {1.0f, 1.0f};
  if (kd.dtype == MLA_DTYPE_FP8_E4M3 && fz_pick(f, 2)) {
    scales[0] = (float)(1 + fz_pick(f, 2)); /* 1 or 2 keep the stamps exact */
    scales[1] = (float)(1 + fz_pick(f, 2));
    kd.fp8_scales = scales;
  }
  if (fz_rare(f, 3)) {
    mla_kv_cache_desc bad = kd;
    float bad_scales[2] = {1.0f, 1.0f};
    switch (fz_pick(f, 6)) {
      case 0: bad.num_layers = fz_pick(f, 2) ? 0 : INT32_MIN; break;
      case 1: bad.num_pages = fz_pick(f, 2) ? 1 : -1; break;
      case 2: {
        static const int ps[] = {0, 3, -4, 512, 6, INT32_MIN};
        bad.page_size = ps[fz_pick(f, 6)];
        break;
      }
      case 3: {
        static const int dt[] = {MLA_DTYPE_F32, MLA_DTYPE_F64, 6, -1};
        bad.dtype = (mla_dtype)dt[fz_pick(f, 4)];
        break;
      }
      case 4:
        bad.num_pages = INT32_MAX; /* x page_size >= 2 overflows the int32 slot space */
        bad.page_size = 2 << fz_pick(f, 7);
        break;
      default: {
        static const float sv[] = {0.0f, -1.0f, NAN, INFINITY};
        bad.dtype = MLA_DTYPE_FP8_E4M3;
        const float sval = sv[fz_pick(f, 4)]; /* read first, as gcc and clang did */
        bad_scales[fz_pick(f, 2) % bad.num_layers] = sval;
        bad.fp8_scales = bad_scales;
        break;
      }
    }
    mla_kv_cache *c = (mla_kv_cache *)&bad;
    mla_status st = CTX_CHK(w, mla_kv_cache_create(w->ctx, &bad, &c));
    FZ_ASSERT(st != MLA_OK && c == NULL, "mla_kv_cache_create accepted a bad descriptor");
    CTX_CHK(w, mla_kv_cache_create(w->ctx, NULL, &c));
    FZ_ASSERT(c == NULL, "mla_kv_cache_create(desc = NULL) returned a cache");
    FZ_ASSERT(CTX_CHK(w, mla_kv_cache_create(w->ctx, &kd, NULL)) != MLA_OK, "out = NULL");
    FZ_ASSERT(mla_kv_cache_create(NULL, &kd, &c) == MLA_ERR_INVALID_ARGUMENT, "ctx = NULL");
  }
  mla_status st = CTX_CHK(w, mla_kv_cache_create(w->ctx, &kd, &w->cache));
  FZ_ASSERT(st == MLA_OK && w->cache, "mla_kv_cache_create of a valid descriptor: %s",
            mla_ctx_last_error(w->ctx));
  w->num_layers = kd.num_layers;
  w->num_pages = kd.num_pages;
  w->page_size = kd.page_size;
  w->dtype = kd.dtype;

  /* Request table, attached to the cache (usually) or metadata only. */
  mla_req_table_desc rd;
  rd.max_reqs = 1 + fz_pick(f, 6);
  rd.max_context = 1 + fz_pick(f, 48);
  w->rt_has_cache = fz_pick(f, 4) != 0;
  if (w->rt_has_cache || fz_pick(f, 2)) {
    rd.num_pages = kd.num_pages;
    rd.page_size = kd.page_size;
  } else { /* detached and a different geometry: plans may point past the cache */
    rd.num_pages = 2 + fz_pick(f, 15);
    rd.page_size = 1 << fz_pick(f, 5);
  }
  if (fz_rare(f, 3)) {
    mla_req_table_desc bad = rd;
    int attach = w->rt_has_cache;
    switch (fz_pick(f, 5)) {
      case 0: bad.max_reqs = fz_pick(f, 2) ? 0 : INT32_MIN; break;
      case 1: bad.max_context = fz_pick(f, 2) ? 0 : -5; break;
      case 2: bad.num_pages = fz_pick(f, 2) ? 1 : -1; break;
      case 3: bad.page_size = fz_pick(f, 2) ? 3 : 1024; break;
      default: /* geometry differing from the attached cache */
        attach = 1;
        bad.num_pages = kd.num_pages + 1 + fz_pick(f, 3);
        break;
    }
    mla_req_table *t = (mla_req_table *)&bad;
    mla_status s2 = CTX_CHK(w, mla_req_table_create(w->ctx, &bad, attach ? w->cache : NULL, &t));
    FZ_ASSERT(s2 != MLA_OK && t == NULL, "mla_req_table_create accepted a bad descriptor");
    FZ_ASSERT(CTX_CHK(w, mla_req_table_create(w->ctx, NULL, NULL, &t)) != MLA_OK && t == NULL,
              "desc = NULL");
  }
  st = CTX_CHK(w, mla_req_table_create(w->ctx, &rd, w->rt_has_cache ? w->cache : NULL, &w->rt));
  FZ_ASSERT(st == MLA_OK && w->rt, "mla_req_table_create of a valid descriptor: %s",
            mla_ctx_last_error(w->ctx));
  w->rt_pages = rd.num_pages;
  w->rt_page_size = rd.page_size;
  w->max_reqs = rd.max_reqs;
  w->max_context = rd.max_context;
  w->stamp = malloc((size_t)rd.max_reqs * rd.max_context * sizeof(int32_t));
  FZ_ASSERT(w->stamp, "harness malloc");
  for (int i = 0; i < rd.max_reqs * rd.max_context; i++) w->stamp[i] = -1;

  mla_req_table_desc got;
  FZ_ASSERT(mla_req_table_get_desc(w->rt, &got) == MLA_OK && got.max_reqs == rd.max_reqs &&
                got.max_context == rd.max_context && got.num_pages == rd.num_pages &&
                got.page_size == rd.page_size,
            "mla_req_table_get_desc differs from the creation descriptor");
  mla_kv_cache_desc kg;
  FZ_ASSERT(mla_kv_cache_get_desc(w->cache, &kg) == MLA_OK && kg.num_layers == kd.num_layers &&
                kg.num_pages == kd.num_pages && kg.page_size == kd.page_size &&
                kg.dtype == kd.dtype,
            "mla_kv_cache_get_desc differs from the creation descriptor");
  return 0;
}

static void teardown(world *w) {
  mla_req_table_destroy(w->rt);
  mla_kv_cache_destroy(w->cache);
  mla_ctx_destroy(w->ctx);
  free(w->stamp);
}

/* ---- 2. request-table operations ----------------------------------------- */
static void table_ops(fz *f, world *w) {
  int nops = fz_int(f, 0, 31);
  for (int k = 0; k < nops; k++) {
    int op = fz_pick(f, 9);
    rt_snap before = snap_take(w);
    mla_status st = MLA_OK;
    const char *call = "";
    switch (op) {
      case 0: { /* add */
        int32_t id = -7;
        call = "mla_req_add";
        if (fz_rare(f, 16)) {
          FZ_ASSERT(RT_CHK(w, mla_req_add(w->rt, NULL)) == MLA_ERR_INVALID_ARGUMENT, "add(NULL)");
          break;
        }
        st = RT_CHK(w, mla_req_add(w->rt, &id));
        if (st == MLA_OK) {
          FZ_ASSERT(id >= 0 && id < w->max_reqs && before.len[id] < 0,
                    "mla_req_add returned id %d (live before: %d)", (int)id,
                    id >= 0 && id < w->max_reqs ? before.len[id] : -2);
          for (int i = 0; i < id; i++)
            FZ_ASSERT(before.len[i] >= 0, "mla_req_add skipped free id %d for %d", i, (int)id);
          FZ_ASSERT(req_len(w, id) == 0, "new request %d is not empty", (int)id);
        } else {
          FZ_ASSERT(st == MLA_ERR_CAPACITY, "mla_req_add failed with %s", mla_status_string(st));
        }
        break;
      }
      case 1:
      case 2:
      case 3: { /* extend */
        int32_t id = fz_req(f, w);
        int n = fz_wild(f, 0, 12);
        int len0 = req_len(w, id);
        int use_out = !fz_rare(f, 8);
        int cap = n >= 0 && n <= w->max_context ? n : w->max_context;
        int32_t *slots = use_out ? malloc((size_t)(cap > 0 ? cap : 1) * sizeof(int32_t)) : NULL;
        call = "mla_req_extend";
        st = RT_CHK(w, mla_req_extend(w->rt, id, n, slots));
        if (st == MLA_OK) {
          FZ_ASSERT(len0 >= 0 && n >= 0 && req_len(w, id) == len0 + n,
                    "extend(%d, %d) from length %d gave length %d", (int)id, n, len0,
                    req_len(w, id));
          const int32_t *r2t;
          mla_req_table_data(w->rt, &r2t);
          for (int i = 0; i < n && slots; i++)
            FZ_ASSERT(slots[i] == r2t[(size_t)id * w->max_context + len0 + i],
                      "slots_out[%d] = %d differs from req_to_token", i, (int)slots[i]);
          if (slots && w->rt_has_cache) {
            write_stamps(w, id, len0, n, slots);
          } else {
            for (int i = 0; i < n; i++) w->stamp[(size_t)id * w->max_context + len0 + i] = -1;
          }
        } else if (len0 >= 0 && n >= 0 && (int64_t)len0 + n <= w->max_context) {
          FZ_ASSERT(st == MLA_ERR_CACHE_FULL, "extend(%d, %d) of a live request failed with %s",
                    (int)id, n, mla_status_string(st));
        }
        free(slots);
        break;
      }
      case 4: { /* fork */
        int32_t src = fz_req(f, w), nid = -7;
        int pre = fz_wild(f, 0, w->max_context);
        int len0 = req_len(w, src);
        call = "mla_req_fork";
        if (fz_rare(f, 16)) {
          st = RT_CHK(w, mla_req_fork(w->rt, src, pre, NULL));
          FZ_ASSERT(st != MLA_OK, "fork(new_id = NULL) succeeded");
          break;
        }
        st = RT_CHK(w, mla_req_fork(w->rt, src, pre, &nid));
        if (st == MLA_OK) {
          FZ_ASSERT(len0 >= 0 && pre >= 0 && pre <= len0, "fork(%d, %d) of length %d succeeded",
                    (int)src, pre, len0);
          FZ_ASSERT(nid >= 0 && nid < w->max_reqs && before.len[nid] < 0 && req_len(w, nid) == pre,
                    "fork returned id %d", (int)nid);
          memcpy(w->stamp + (size_t)nid * w->max_context, w->stamp + (size_t)src * w->max_context,
                 (size_t)pre * sizeof(int32_t));
          const int32_t *r2t;
          mla_req_table_data(w->rt, &r2t);
          FZ_ASSERT(memcmp(r2t + (size_t)nid * w->max_context, r2t + (size_t)src * w->max_context,
                           (size_t)pre * sizeof(int32_t)) == 0,
                    "fork does not share the prefix");
        }
        break;
      }
      case 5: { /* truncate */
        int32_t id = fz_req(f, w);
        int nl = fz_wild(f, 0, w->max_context);
        int len0 = req_len(w, id);
        call = "mla_req_truncate";
        st = RT_CHK(w, mla_req_truncate(w->rt, id, nl));
        if (st == MLA_OK)
          FZ_ASSERT(len0 >= 0 && nl >= 0 && nl <= len0 && req_len(w, id) == nl,
                    "truncate(%d, %d) from %d", (int)id, nl, len0);
        else if (len0 >= 0 && nl >= 0 && nl <= len0)
          FZ_ASSERT(0, "valid truncate(%d, %d) failed with %s", (int)id, nl,
                    mla_status_string(st));
        break;
      }
      case 6: { /* free */
        int32_t id = fz_req(f, w);
        int len0 = req_len(w, id);
        call = "mla_req_free";
        st = RT_CHK(w, mla_req_free(w->rt, id));
        FZ_ASSERT((st == MLA_OK) == (len0 >= 0), "free(%d) of a request of length %d: %s",
                  (int)id, len0, mla_status_string(st));
        break;
      }
      case 7: { /* queries with arbitrary arguments */
        int32_t id = fz_req(f, w);
        int v = -1;
        const int32_t *d = NULL;
        mla_req_table_desc rd;
        call = "query";
        switch (fz_pick(f, 7)) {
          case 0: st = RT_CHK(w, mla_req_length(w->rt, id, fz_pick(f, 4) ? &v : NULL)); break;
          case 1: st = RT_CHK(w, mla_req_is_live(w->rt, id, fz_pick(f, 4) ? &v : NULL)); break;
          case 2: {
            /* One read per statement: the order of evaluation of arguments
             * is unspecified (gcc and clang differ), and the replayer must
             * decode an input as libFuzzer did. */
            const int32_t pg = fz_wild(f, 0, w->rt_pages - 1);
            int *out = fz_pick(f, 4) ? &v : NULL;
            st = RT_CHK(w, mla_req_table_page_refs(w->rt, pg, out));
            break;
          }
          case 3: st = RT_CHK(w, mla_req_table_free_pages(w->rt, fz_pick(f, 4) ? &v : NULL)); break;
          case 4: st = RT_CHK(w, mla_req_table_get_desc(w->rt, fz_pick(f, 4) ? &rd : NULL)); break;
          case 5: st = RT_CHK(w, mla_req_table_data(w->rt, fz_pick(f, 4) ? &d : NULL)); break;
          default: {
            const char *e = mla_req_table_last_error(NULL);
            FZ_ASSERT(e != NULL, "mla_req_table_last_error(NULL) is NULL");
            break;
          }
        }
        /* queries change nothing, successful or not */
        snap_same(w, &before, "query");
        st = MLA_OK;
        break;
      }
      default: { /* NULL handle: refused, nothing to record the message in */
        int32_t id = 0;
        int v;
        call = "NULL handle";
        FZ_ASSERT(mla_req_add(NULL, &id) == MLA_ERR_INVALID_ARGUMENT, "add(NULL rt)");
        FZ_ASSERT(mla_req_extend(NULL, 0, 1, NULL) == MLA_ERR_INVALID_ARGUMENT, "extend(NULL rt)");
        FZ_ASSERT(mla_req_fork(NULL, 0, 0, &id) == MLA_ERR_INVALID_ARGUMENT, "fork(NULL rt)");
        FZ_ASSERT(mla_req_truncate(NULL, 0, 0) == MLA_ERR_INVALID_ARGUMENT, "truncate(NULL rt)");
        FZ_ASSERT(mla_req_free(NULL, 0) == MLA_ERR_INVALID_ARGUMENT, "free(NULL rt)");
        FZ_ASSERT(mla_req_length(NULL, 0, &v) == MLA_ERR_INVALID_ARGUMENT, "length(NULL rt)");
        mla_req_table_destroy(NULL);
        break;
      }
    }
    if (st != MLA_OK) snap_same(w, &before, call);
    else FZ_COUNT(0);
    snap_free(&before);
    check_table(w);
    check_stamps(w);
  }
}

/* ---- 3. batch, plans, attention ------------------------------------------ */
typedef struct fz_batch {
  mla_batch b;
  int32_t *req_ids, *seq_lens, *extend_lens, *prefix_lens;
} fz_batch;

/* Queries and keys of row i as the header defines them (64-bit). */
static void row_q_k(const mla_batch *b, int i, int64_t *q, int64_t *k) {
  int64_t s = b->seq_lens[i];
  switch (b->mode) {
    case MLA_MODE_DECODE: *q = 1; *k = s; break;
    case MLA_MODE_TARGET_VERIFY: *q = b->num_draft_tokens; *k = s + b->num_draft_tokens; break;
    case MLA_MODE_DRAFT_EXTEND:
      *q = b->extend_lens ? b->extend_lens[i] : b->num_draft_tokens;
      *k = s;
      break;
    default: *q = s - (b->prefix_lens ? b->prefix_lens[i] : 0); *k = s; break;
  }
}

static int32_t *arr_alloc(int n) {
  int32_t *a = calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
  FZ_ASSERT(a, "harness calloc");
  return a;
}

/* Batch arrays hold this many entries; a larger batch size goes with limits
 * that must refuse it (plan) or with NULL arrays (chunk, draft). */
#define MAX_ARR 64

static void make_batch(fz *f, world *w, fz_batch *fb) {
  memset(fb, 0, sizeof *fb);
  mla_batch *b = &fb->b;
  int m = fz_pick(f, 11);
  b->mode = m < 10 ? (mla_mode)(m % 5) : (mla_mode)(fz_pick(f, 2) ? 5 : -1);
  b->batch_size = fz_wild(f, 0, 6);
  b->num_draft_tokens = fz_wild(f, 1, 4);
  int n = b->batch_size >= 0 && b->batch_size <= MAX_ARR ? b->batch_size : MAX_ARR;
  fb->req_ids = arr_alloc(MAX_ARR);
  fb->seq_lens = arr_alloc(MAX_ARR);
  fb->extend_lens = arr_alloc(MAX_ARR);
  fb->prefix_lens = arr_alloc(MAX_ARR);
  for (int i = 0; i < n; i++) {
    int32_t id = fz_req(f, w);
    int len = req_len(w, id);
    if (len < 0) len = fz_int(f, 0, 8); /* not a live request: some length anyway */
    int32_t seq = len, ext = 0, pre = 0;
    switch (b->mode) {
      case MLA_MODE_TARGET_VERIFY: /* keys = seq + ndt = the request's length */
        if (b->num_draft_tokens > 0 && b->num_draft_tokens <= MAX_ARR) seq = len - b->num_draft_tokens;
        break;
      case MLA_MODE_DRAFT_EXTEND: ext = len > 0 ? fz_int(f, 1, len) : 0; break;
      case MLA_MODE_EXTEND:
        pre = fz_int(f, 0, len);
        ext = seq - pre;
        break;
      default: break;
    }
    if (id == MLA_REQ_PAD) seq = 1;
    /* then, now and then, any value at all */
    if (fz_rare(f, 8)) seq = fz_wild(f, 0, 64);
    if (fz_rare(f, 8)) ext = fz_wild(f, 0, 16);
    if (fz_rare(f, 8)) pre = fz_wild(f, 0, 16);
    fb->req_ids[i] = id;
    fb->seq_lens[i] = seq;
    fb->extend_lens[i] = ext;
    fb->prefix_lens[i] = pre;
  }
  b->req_ids = fz_rare(f, 16) ? NULL : fb->req_ids;
  b->seq_lens = fz_rare(f, 16) ? NULL : fb->seq_lens;
  b->extend_lens = fz_pick(f, 2) ? NULL : fb->extend_lens;
  b->prefix_lens = fz_pick(f, 3) == 0 ? NULL : fb->prefix_lens;
}

static void free_batch(fz_batch *fb) {
  free(fb->req_ids);
  free(fb->seq_lens);
  free(fb->extend_lens);
  free(fb->prefix_lens);
}

static int limits_valid(const mla_plan_limits *l) {
  return l->max_bs >= 1 && l->max_q_tokens >= 1 && l->max_kv_tokens >= 1 && l->max_context >= 1 &&
         l->page_size >= 1 && l->page_size <= MLA_MAX_PAGE_SIZE &&
         (l->page_size & (l->page_size - 1)) == 0 && l->num_sm >= 1;
}

/* Whether mla_plan_build must succeed, from the documented rules. */
static int plan_should_work(const world *w, const mla_req_table *rt, const mla_batch *b,
                            const mla_plan_limits *l, int H) {
  if (!b || !limits_valid(l) || H < 1 || H > MLA_MAX_HEADS) return 0;
  if ((int)b->mode < 0 || (int)b->mode > 4 || b->batch_size < 0) return 0;
  if (b->mode == MLA_MODE_IDLE) return 1;
  if (!rt || b->batch_size > l->max_bs || l->page_size != w->rt_page_size) return 0;
  if (b->batch_size > 0 && (!b->req_ids || !b->seq_lens)) return 0;
  if (b->mode == MLA_MODE_TARGET_VERIFY && b->num_draft_tokens < 1) return 0;
  if (b->mode == MLA_MODE_DRAFT_EXTEND && !b->extend_lens && b->num_draft_tokens < 1) return 0;
  int64_t sq = 0, sk = 0;
  for (int i = 0; i < b->batch_size; i++) {
    if (b->seq_lens[i] < 0) return 0;
    if (b->mode == MLA_MODE_DRAFT_EXTEND && b->extend_lens && b->extend_lens[i] < 0) return 0;
    if (b->mode == MLA_MODE_EXTEND) {
      int32_t pre = b->prefix_lens ? b->prefix_lens[i] : 0;
      if (pre < 0 || pre > b->seq_lens[i]) return 0;
      if (b->extend_lens && b->extend_lens[i] != b->seq_lens[i] - pre) return 0;
    }
    int64_t q, k;
    row_q_k(b, i, &q, &k);
    if (k > l->max_context) return 0;
    sq += q;
    sk += k;
    if (b->req_ids[i] == MLA_REQ_PAD) continue;
    int len = req_len(w, b->req_ids[i]);
    if (len < 0 || k > len) return 0;
  }
  return sq <= l->max_q_tokens && sk <= l->max_kv_tokens;
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* A split schedule (the rule at MLA_SCHED_BLOCK in mla.h) against the kv
 * lengths it was built for: parts (1..max_parts) walked in order must cover
 * the keys [0, kv_len) of every request exactly once, in order, cut at
 * 64-token block boundaries, each piece numbered as num_splits says. Shared
 * by the host plans and the device-built steps. */
static void check_schedule(int bs, const int32_t *kv_lens /* [bs] */, int parts, int max_parts,
                           const int32_t *sched_meta /* [parts, 8] */,
                           const int32_t *num_splits /* [bs+1] */, const char *who) {
  FZ_ASSERT(parts >= 1 && parts <= max_parts, "%s: num_sm_parts %d of at most %d", who,
            (int)parts, max_parts);
  int32_t *pieces = calloc((size_t)(bs > 0 ? bs : 1), sizeof(int32_t));
  FZ_ASSERT(pieces, "harness calloc");
  int req = 0;
  int64_t tok = 0;
  for (int part = 0; part < parts; part++) {
    const int32_t *m = sched_meta + (size_t)part * MLA_SCHED_META_INTS;
    FZ_ASSERT(m[6] == 0 && m[7] == 0, "part %d reserved entries", part);
    if (m[MLA_SCHED_NUM_REQS] == 0) {
      FZ_ASSERT(req == bs && m[MLA_SCHED_BEGIN_REQ] == bs && m[MLA_SCHED_END_REQ] == bs &&
                    m[MLA_SCHED_BEGIN_TOK] == 0 && m[MLA_SCHED_END_TOK] == 0 &&
                    m[MLA_SCHED_BEGIN_SPLIT] == 0,
                "empty part %d before the work is done (at request %d)", part, req);
      continue;
    }
    const int br = m[MLA_SCHED_BEGIN_REQ], er = m[MLA_SCHED_END_REQ];
    FZ_ASSERT(br == req && m[MLA_SCHED_BEGIN_TOK] == tok,
              "part %d starts at %d:%d, the previous part ended at %d:%lld", part, br,
              (int)m[MLA_SCHED_BEGIN_TOK], req, (long long)tok);
    FZ_ASSERT(er >= br && er < bs && m[MLA_SCHED_NUM_REQS] == er - br + 1,
              "part %d requests %d..%d (num_reqs %d)", part, br, er, (int)m[MLA_SCHED_NUM_REQS]);
    FZ_ASSERT(m[MLA_SCHED_BEGIN_SPLIT] == pieces[br], "part %d begin_split %d, expected %d", part,
              (int)m[MLA_SCHED_BEGIN_SPLIT], (int)pieces[br]);
    for (int r = br; r <= er; r++) {
      const int64_t s = r == br ? tok : 0;
      const int64_t e = r == er ? m[MLA_SCHED_END_TOK] : kv_lens[r];
      FZ_ASSERT(s <= e && e <= kv_lens[r] && (s < e || kv_lens[r] == 0),
                "part %d request %d covers [%lld, %lld) of %d keys", part, r, (long long)s,
                (long long)e, (int)kv_lens[r]);
      FZ_ASSERT(s % MLA_SCHED_BLOCK == 0 && (e == kv_lens[r] || e % MLA_SCHED_BLOCK == 0),
                "part %d request %d cut off a block boundary", part, r);
      pieces[r]++;
      if (e == kv_lens[r]) {
        req = r + 1;
        tok = 0;
      } else {
        FZ_ASSERT(r == er, "part %d leaves request %d unfinished in the middle", part, r);
        req = r;
        tok = e;
      }
    }
  }
  FZ_ASSERT(req == bs, "the schedule stops at request %d of %d", req, bs);
  FZ_ASSERT(num_splits[0] == 0, "%s: num_splits[0] = %d", who, (int)num_splits[0]);
  for (int i = 0; i < bs; i++)
    FZ_ASSERT(num_splits[i + 1] - num_splits[i] == pieces[i],
              "%s: num_splits: request %d has %d pieces, the parts cut it in %d", who, i,
              (int)(num_splits[i + 1] - num_splits[i]), (int)pieces[i]);
  free(pieces);
}

/* Every entry of a successful plan against the batch and the table. */
static void check_plan(const world *w, const mla_batch *b, const mla_plan_limits *l, int H,
                       const mla_plan *p) {
  FZ_ASSERT(p->mode == b->mode && p->page_size == l->page_size && p->num_heads == H,
            "plan header (mode %d, page %d, heads %d)", (int)p->mode, (int)p->page_size,
            (int)p->num_heads);
  FZ_ASSERT(p->qo_indptr && p->kv_indptr && p->page_indptr && p->num_splits,
            "plan arrays are NULL");
  FZ_ASSERT(p->qo_indptr[0] == 0 && p->kv_indptr[0] == 0 && p->page_indptr[0] == 0 &&
                p->num_splits[0] == 0,
            "indptr[0] != 0");
  if (b->mode == MLA_MODE_IDLE) {
    FZ_ASSERT(p->batch_size == 0 && p->num_q_tokens == 0 && p->num_kv_tokens == 0 &&
                  p->total_splits == 0,
              "IDLE plan is not empty");
    return;
  }
  const int bs = b->batch_size, P = l->page_size;
  FZ_ASSERT(p->batch_size == bs, "plan batch_size %d, batch %d", (int)p->batch_size, bs);
  FZ_ASSERT(p->causal == (b->mode != MLA_MODE_DECODE), "plan causal %d", (int)p->causal);
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(w->rt, &r2t) == MLA_OK, "data");
  int64_t mq = 0, mk = 0;
  for (int i = 0; i < bs; i++) {
    int64_t q, k;
    row_q_k(b, i, &q, &k);
    if (q > mq) mq = q;
    if (k > mk) mk = k;
    FZ_ASSERT(p->req_ids[i] == b->req_ids[i], "plan req_ids[%d]", i);
    FZ_ASSERT(p->qo_indptr[i + 1] - p->qo_indptr[i] == q, "qo_indptr row %d: %d, expected %lld", i,
              (int)(p->qo_indptr[i + 1] - p->qo_indptr[i]), (long long)q);
    FZ_ASSERT(p->kv_lens[i] == k && p->kv_indptr[i + 1] - p->kv_indptr[i] == k,
              "kv_lens / kv_indptr row %d: %d, expected %lld", i, (int)p->kv_lens[i],
              (long long)k);
    const int64_t np = cdiv(k, P);
    FZ_ASSERT(p->page_indptr[i + 1] - p->page_indptr[i] == np, "page_indptr row %d", i);
    const int32_t *kv = p->kv_indices + p->kv_indptr[i];
    const int32_t *pg = p->page_indices + p->page_indptr[i];
    const int32_t *bt = p->block_table + (size_t)i * p->block_table_width;
    const int pad = b->req_ids[i] == MLA_REQ_PAD;
    const int32_t *row = pad ? NULL : r2t + (size_t)b->req_ids[i] * w->max_context;
    for (int64_t j = 0; j < k; j++) {
      if (pad) {
        FZ_ASSERT(kv[j] == 0, "padding row %d key %lld reads slot %d", i, (long long)j, (int)kv[j]);
      } else {
        FZ_ASSERT(kv[j] == row[j], "row %d key %lld: slot %d, req_to_token has %d", i,
                  (long long)j, (int)kv[j], (int)row[j]);
        FZ_ASSERT(kv[j] >= P && kv[j] < (int64_t)w->rt_pages * P, "row %d key %lld: slot %d", i,
                  (long long)j, (int)kv[j]);
      }
    }
    for (int64_t m = 0; m < np; m++) {
      int32_t want = pad ? 0 : row[m * P] / P;
      FZ_ASSERT(pg[m] == want && bt[m] == want, "row %d page %lld: %d / %d, expected %d", i,
                (long long)m, (int)pg[m], (int)bt[m], (int)want);
    }
    for (int64_t m = np; m < p->block_table_width; m++)
      FZ_ASSERT(bt[m] == MLA_BLOCK_TABLE_PAD, "row %d block table entry %lld past its pages", i,
                (long long)m);
  }
  FZ_ASSERT(p->num_q_tokens == p->qo_indptr[bs] && p->num_kv_tokens == p->kv_indptr[bs],
            "plan totals");
  FZ_ASSERT(p->max_q_len == mq && p->max_kv_len == mk, "max_q_len %d / max_kv_len %d",
            (int)p->max_q_len, (int)p->max_kv_len);
  FZ_ASSERT(p->block_table_width == cdiv(mk, P), "block_table_width %d",
            (int)p->block_table_width);

  check_schedule(bs, p->kv_lens, p->num_sm_parts, l->num_sm, p->sched_meta, p->num_splits, "plan");
  FZ_ASSERT(p->total_splits == p->num_splits[bs], "total_splits");
}

/* Every output of an absorbed attention finite; a row with lse = -inf is
 * all zero. */
static void check_finite_out(mla_dtype dt, const void *out /* [rows, 512] */,
                             const float *lse /* [rows] or NULL */, int64_t rows, const char *who) {
  for (int64_t t = 0; t < rows; t++) {
    float l = lse ? lse[t] : 0.0f;
    FZ_ASSERT(!lse || isfinite(l) || l == -INFINITY, "%s: lse[%lld] = %g", who, (long long)t,
              (double)l);
    for (int d = 0; d < MLA_LATENT; d++) {
      float o = get_act(dt, out, t * MLA_LATENT + d);
      FZ_ASSERT(isfinite(o), "%s: out[%lld][%d] = %g", who, (long long)t, d, (double)o);
      if (lse && l == -INFINITY)
        FZ_ASSERT(o == 0.0f, "%s: empty row %lld has o = %g", who, (long long)t, (double)o);
    }
  }
}

/* Keys visible to query qi of a request with Q queries and K keys
 * (bottom-right causal when causal). */
static int64_t visible_keys(int64_t Q, int64_t K, int64_t qi, int causal) {
  const int64_t last = causal ? K - Q + qi : K - 1; /* visible keys j <= last */
  return last + 1 < K ? (last + 1 > 0 ? last + 1 : 0) : K;
}

/* Output row (t, h) of an absorbed attention with args a (default strides)
 * against a float64 recomputation over the first nk of the keys `slots`,
 * read back from the cache. */
static void check_row_f64(mla_kv_cache *cache, int layer, const mla_absorbed_args *a,
                          const void *qn /* [T, H, 512] */, const void *qr /* [T, H, 64] */,
                          const void *out /* [T, H, 512] */, const float *lse /* [T, H] */,
                          int64_t t, int h, int64_t nk, const int32_t *slots /* [nk] */,
                          const char *who) {
  const int H = a->num_heads;
  const mla_dtype dt = a->act_dtype;
  double ref[MLA_LATENT] = {0}, lse_ref = -INFINITY;
  if (nk > 0) {
    float *c = malloc((size_t)nk * MLA_LATENT * sizeof(float));
    float *r = malloc((size_t)nk * MLA_ROPE * sizeof(float));
    double *s = malloc((size_t)nk * sizeof(double));
    FZ_ASSERT(c && r && s, "harness malloc");
    FZ_ASSERT(mla_kv_cache_read(cache, layer, (int)nk, slots, c, r, MLA_DTYPE_F32) == MLA_OK,
              "%s: reading the keys back: %s", who, mla_kv_cache_last_error(cache));
    double mx = -INFINITY;
    for (int64_t j = 0; j < nk; j++) {
      double acc = 0.0;
      for (int d = 0; d < MLA_LATENT; d++)
        acc += (double)get_act(dt, qn, (t * H + h) * MLA_LATENT + d) * c[j * MLA_LATENT + d];
      for (int d = 0; d < MLA_ROPE; d++)
        acc += (double)get_act(dt, qr, (t * H + h) * MLA_ROPE + d) * r[j * MLA_ROPE + d];
      s[j] = acc * a->scale;
      if (s[j] > mx) mx = s[j];
    }
    double den = 0.0;
    for (int64_t j = 0; j < nk; j++) den += exp(s[j] - mx);
    for (int64_t j = 0; j < nk; j++) {
      double pj = exp(s[j] - mx) / den;
      for (int d = 0; d < MLA_LATENT; d++) ref[d] += pj * c[j * MLA_LATENT + d];
    }
    lse_ref = mx + log(den);
    free(c);
    free(r);
    free(s);
  }
  const double tol = dt == MLA_DTYPE_F32 ? 2e-3 : 2e-2;
  for (int d = 0; d < MLA_LATENT; d++) {
    double o = get_act(dt, out, (t * H + h) * MLA_LATENT + d);
    FZ_ASSERT(fabs(o - ref[d]) <= tol * (1.0 + fabs(ref[d])),
              "%s: out[%lld][%d][%d] = %g, float64 reference %g (%lld visible keys)", who,
              (long long)t, h, d, o, ref[d], (long long)nk);
  }
  if (a->lse) {
    double l = lse[t * H + h];
    if (a->flags & MLA_FLAG_LSE_BASE2) l *= log(2.0);
    if (nk == 0)
      FZ_ASSERT(l == -INFINITY, "%s: lse of a row with no key = %g", who, l);
    else
      FZ_ASSERT(fabs(l - lse_ref) <= 1e-3 * (1.0 + fabs(lse_ref)), "%s: lse %g, reference %g", who,
                l, lse_ref);
  }
}

/* Absorbed attention over a successful plan; one output row is recomputed in
 * float64 from the cache rows read back. */

/* Absorbed-attention flags from a pick 0..3: LSE_BASE2 and FP8_MATH (a
 * permission the CPU backend ignores) in every combination. */
static unsigned fz_flags_absorbed(unsigned v) {
  return ((v & 1u) ? MLA_FLAG_LSE_BASE2 : 0u) | ((v & 2u) ? MLA_FLAG_FP8_MATH : 0u);
}

static void run_absorbed(fz *f, world *w, const mla_plan *p) {
  const int H = fz_rare(f, 8) ? fz_wild(f, 1, 4) : 1 + fz_pick(f, 4);
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  a.num_heads = H;
  const float sane_scale = 0.04f + 0.02f * (float)fz_pick(f, 8);
  a.scale = fz_float(f, sane_scale);
  /* bit 0 LSE_BASE2, bit 2 FP8_MATH (a permission the CPU ignores); 8 is unknown */
  a.flags = fz_rare(f, 8) ? 8u : fz_flags_absorbed((unsigned)fz_pick(f, 4));
  a.act_dtype = fz_act_dtype(f);
  if (fz_rare(f, 16)) a.q_stride_token = -1;
  int layer = fz_rare(f, 8) ? fz_wild(f, 0, w->num_layers - 1) : fz_pick(f, w->num_layers);
  mla_kv_cache *cache = fz_rare(f, 32) ? NULL : w->cache;

  size_t need = 0;
  mla_status sst = CTX_CHK(w, mla_attention_absorbed_workspace_size(w->ctx, p, H, &need));
  fz_ws ws = ws_for(f, need, sst == MLA_OK);

  /* Heads the library accepts but the harness does not allocate for (> 4)
   * go with NULL q / out, which must then be refused. */
  const int valid_h = H >= 1 && H <= MLA_MAX_HEADS, small_h = H >= 1 && H <= 4;
  const int64_t T = p->num_q_tokens;
  const size_t es = is_act(a.act_dtype) ? act_size(a.act_dtype) : 4;
  const int64_t nq = small_h ? T * H : 1;
  void *qn = malloc((size_t)(nq > 0 ? nq : 1) * MLA_LATENT * es);
  void *qr = malloc((size_t)(nq > 0 ? nq : 1) * MLA_ROPE * es);
  void *out = malloc((size_t)(nq > 0 ? nq : 1) * MLA_LATENT * es);
  float *lse = malloc((size_t)(nq > 0 ? nq : 1) * sizeof(float));
  FZ_ASSERT(qn && qr && out && lse, "harness malloc");
  if (is_act(a.act_dtype)) {
    for (int64_t i = 0; i < nq * MLA_LATENT; i++) put_act(a.act_dtype, qn, i, rng_val(&w->rng));
    for (int64_t i = 0; i < nq * MLA_ROPE; i++) put_act(a.act_dtype, qr, i, rng_val(&w->rng));
  }
  memset(out, 0xff, (size_t)(nq > 0 ? nq : 1) * MLA_LATENT * es); /* NaN: must be overwritten */
  for (int64_t i = 0; i < nq; i++) lse[i] = NAN;
  a.q_nope = fz_rare(f, 32) || !small_h ? NULL : qn;
  a.q_rope = small_h ? qr : NULL;
  a.out = fz_rare(f, 32) || !small_h ? NULL : out;
  a.lse = fz_rare(f, 4) ? NULL : lse;

  mla_status st = CTX_CHK(w, mla_attention_absorbed(w->ctx, cache, layer, p, &a, ws.p, ws.bytes));
  /* The plan's slots must lie inside the cache and its pages be the cache's
   * (a detached table may differ in both). */
  int slots_ok = p->page_size == w->page_size;
  for (int64_t j = 0; j < p->num_kv_tokens; j++)
    if (p->kv_indices[j] >= (int64_t)w->num_pages * w->page_size) slots_ok = 0;
  const int expect = cache && layer >= 0 && layer < w->num_layers && valid_h &&
                     is_act(a.act_dtype) && isfinite(a.scale) && a.scale > 0 && (a.flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_FP8_MATH)) == 0 &&
                     a.q_stride_token >= 0 && a.q_nope && a.q_rope && a.out &&
                     (T == 0 || (ws.full && slots_ok));
  FZ_ASSERT((st == MLA_OK) == expect, "mla_attention_absorbed returned %s, expected %s: %s",
            mla_status_string(st), expect ? "MLA_OK" : "a failure", mla_ctx_last_error(w->ctx));
  /* Numbers are checked at sane scales only (FLT_MAX overflows the logits). */
  if (st == MLA_OK && T > 0 && a.scale == sane_scale) {
    FZ_COUNT(2);
    check_finite_out(a.act_dtype, out, a.lse, T * H, "mla_attention_absorbed");
    /* One row in float64. */
    const int64_t t = fz_int(f, 0, 65535) % T;
    const int h = fz_pick(f, H);
    int i = 0;
    while (p->qo_indptr[i + 1] <= t) i++;
    const int64_t Q = p->qo_indptr[i + 1] - p->qo_indptr[i], K = p->kv_lens[i];
    const int64_t nk = visible_keys(Q, K, t - p->qo_indptr[i], p->causal);
    check_row_f64(w->cache, layer, &a, qn, qr, out, lse, t, h, nk, p->kv_indices + p->kv_indptr[i],
                  "mla_attention_absorbed");
  }
  free(qn);
  free(qr);
  free(out);
  free(lse);
  ws_free(&ws);
}

static void run_plans(fz *f, world *w) {
  fz_batch fb;
  make_batch(f, w, &fb);
  mla_batch *b = &fb.b;

  mla_plan_limits lim;
  memset(&lim, 0, sizeof lim); /* flags 0: full plans (the checks below read kv_indices) */
  lim.max_bs = 1 + fz_pick(f, 8);
  lim.max_q_tokens = 1 + fz_pick(f, 64);
  lim.max_kv_tokens = 1 + fz_int(f, 0, 255);
  lim.max_context = 1 + fz_pick(f, 64);
  lim.page_size = w->rt_page_size;
  lim.num_sm = 1 + fz_pick(f, 8);
  if (fz_rare(f, 8)) {
    switch (fz_pick(f, 6)) {
      case 0: lim.max_bs = fz_pick(f, 2) ? 0 : -3; break;
      case 1: lim.max_q_tokens = 0; break;
      case 2: lim.max_kv_tokens = INT32_MIN; break;
      case 3: lim.page_size = fz_pick(f, 2) ? 3 : 1 << fz_pick(f, 10); break;
      case 4: lim.num_sm = 0; break;
      default: lim.max_context = -1; break;
    }
  }
  const int H = fz_rare(f, 8) ? fz_wild(f, 1, 4) : 1 + fz_pick(f, 4);

  size_t need = 0;
  if (fz_rare(f, 32))
    FZ_ASSERT(CTX_CHK(w, mla_plan_workspace_size(w->ctx, NULL, &need)) == MLA_ERR_INVALID_ARGUMENT,
              "mla_plan_workspace_size(lim = NULL)");
  mla_status sst = CTX_CHK(w, mla_plan_workspace_size(w->ctx, &lim, &need));
  FZ_ASSERT((sst == MLA_OK) == limits_valid(&lim), "mla_plan_workspace_size returned %s",
            mla_status_string(sst));
  fz_ws ws = ws_for(f, need, sst == MLA_OK);
  const mla_req_table *rt = fz_rare(f, 16) ? NULL : w->rt;
  const mla_batch *bp = fz_rare(f, 32) ? NULL : b;
  mla_plan plan;
  memset(&plan, 0, sizeof plan);
  rt_snap before = snap_take(w);
  mla_status st = CTX_CHK(w, mla_plan_build(w->ctx, rt, bp, &lim, H, ws.p, ws.bytes, &plan));
  snap_same(w, &before, "mla_plan_build (a plan never changes the table)");
  snap_free(&before);
  const int expect = sst == MLA_OK && ws.full && plan_should_work(w, rt, bp, &lim, H);
  FZ_ASSERT((st == MLA_OK) == expect, "mla_plan_build returned %s, the rules say %s: %s",
            mla_status_string(st), expect ? "MLA_OK" : "a failure", mla_ctx_last_error(w->ctx));
  if (st == MLA_OK) {
    FZ_COUNT(1);
    check_plan(w, b, &lim, H, &plan);
    run_absorbed(f, w, &plan);
  }

  /* DCP over this plan's keys (or over the batch's arrays, arbitrary). */
  {
    const int world_n = fz_rare(f, 8) ? fz_wild(f, 1, 4) : 1 + fz_pick(f, 4);
    const int rank = fz_rare(f, 8) ? fz_wild(f, 0, 3) : fz_pick(f, world_n > 0 ? world_n : 1);
    int bs;
    const int32_t *kl, *ip, *ix;
    int32_t *own_ip = NULL, *own_ix = NULL;
    int consistent;
    if (st == MLA_OK && b->mode != MLA_MODE_IDLE && !fz_rare(f, 4)) {
      bs = plan.batch_size;
      kl = plan.kv_lens;
      ip = plan.kv_indptr;
      ix = plan.kv_indices;
      consistent = 1;
    } else {
      /* Arbitrary lengths with an indptr of arbitrary (small) steps; the key
       * array holds every index the indptr can name. */
      bs = fz_pick(f, 5);
      kl = fb.seq_lens;
      own_ip = arr_alloc(bs + 1);
      own_ip[0] = fz_pick(f, 4) ? 0 : fz_int(f, -2, 3);
      for (int i = 0; i < bs; i++) {
        int32_t step = fz_int(f, -2, 12);
        if (fz_pick(f, 2) && kl[i] >= 0 && kl[i] <= 12) step = kl[i];
        own_ip[i + 1] = own_ip[i] + step;
      }
      int32_t mx = 0;
      for (int i = 0; i <= bs; i++) if (own_ip[i] > mx) mx = own_ip[i];
      own_ix = arr_alloc(mx + 16);
      for (int i = 0; i < mx + 16; i++) own_ix[i] = fz_pick(f, 16) ? fz_int(f, 0, 255) : -1;
      ip = own_ip;
      ix = own_ix;
      consistent = 0;
    }
    int64_t kv_sum = 0;
    for (int i = 0; i < bs; i++) if (kl[i] > 0) kv_sum += kl[i];
    kv_sum += fz_pick(f, 3);
    int max_bs = bs + fz_pick(f, 3), max_kv = (int)(kv_sum < INT32_MAX ? kv_sum : INT32_MAX);
    size_t dneed = 0;
    mla_status dst = CTX_CHK(w, mla_dcp_plan_workspace_size(w->ctx, max_bs, max_kv, &dneed));
    fz_ws dws = ws_for(f, dneed, dst == MLA_OK);
    mla_dcp_plan dp;
    mla_status s2 = CTX_CHK(w, mla_dcp_plan_build(w->ctx, bs, kl, ip, ix, rank, world_n, dws.p,
                                                  dws.bytes, &dp));
    if (consistent && dst == MLA_OK && dws.full && world_n >= 1 && rank >= 0 && rank < world_n)
      FZ_ASSERT(s2 == MLA_OK, "mla_dcp_plan_build of a plan's keys failed: %s",
                mla_ctx_last_error(w->ctx));
    if (s2 == MLA_OK) {
      FZ_COUNT(3);
      FZ_ASSERT(dp.batch_size == bs && dp.rank == rank && dp.world == world_n && dp.kv_indptr[0] == 0,
                "dcp plan header");
      for (int i = 0; i < bs; i++) {
        int32_t n = kl[i] > rank ? (kl[i] - rank - 1) / world_n + 1 : 0;
        FZ_ASSERT(dp.kv_lens[i] == n && dp.kv_indptr[i + 1] - dp.kv_indptr[i] == n,
                  "dcp request %d has %d local keys, expected %d", i, (int)dp.kv_lens[i], (int)n);
        for (int32_t j = 0; j < n; j++) {
          int32_t g = ix[ip[i] + rank + (int64_t)j * world_n];
          FZ_ASSERT(g >= 0 && dp.kv_indices[dp.kv_indptr[i] + j] == g / world_n,
                    "dcp request %d local key %d", i, (int)j);
        }
      }
    }
    ws_free(&dws);
    free(own_ip);
    free(own_ix);
  }

  /* Chunked prefix over the batch's ids and prefix lengths. */
  {
    int bs = b->batch_size;
    int cap = fz_rare(f, 8) ? fz_wild(f, 1, 64) : 1 + fz_pick(f, 64);
    int64_t total = 0;
    int valid = bs >= 0 && bs <= MAX_ARR && cap >= 1;
    for (int i = 0; valid && i < bs; i++) {
      int len = fb.req_ids[i] == MLA_REQ_PAD ? -1 : req_len(w, fb.req_ids[i]);
      if (fb.prefix_lens[i] < 0 || len < 0 || fb.prefix_lens[i] > len) valid = 0;
      else total += fb.prefix_lens[i];
    }
    int max_bs = (bs > 0 && bs <= MAX_ARR ? bs : 1) + fz_pick(f, 2);
    int max_pre = (int)(total > 0 ? total : 1) + fz_pick(f, 3);
    if (fz_rare(f, 8)) max_pre = fz_wild(f, 0, 8);
    size_t cneed = 0;
    mla_status cst = CTX_CHK(w, mla_chunk_plan_workspace_size(w->ctx, max_bs, max_pre, cap, &cneed));
    fz_ws cws = ws_for(f, cneed, cst == MLA_OK);
    const int32_t *ids = fz_rare(f, 16) || bs > MAX_ARR ? NULL : fb.req_ids;
    const int32_t *pre = fz_rare(f, 16) || bs > MAX_ARR ? NULL : fb.prefix_lens;
    mla_chunk_plan cp;
    mla_status s3 = CTX_CHK(w, mla_chunk_plan_build(w->ctx, fz_rare(f, 32) ? NULL : w->rt, bs, ids,
                                                    pre, cap, cws.p, cws.bytes, &cp));
    if (valid && bs <= max_bs && total <= max_pre && cst == MLA_OK && cws.full &&
        (bs == 0 || (ids && pre)))
      FZ_ASSERT(s3 == MLA_OK || s3 == MLA_ERR_INVALID_ARGUMENT /* rt = NULL */,
                "mla_chunk_plan_build within the workspace's limits failed: %s",
                mla_ctx_last_error(w->ctx));
    if (s3 == MLA_OK) {
      FZ_COUNT(4);
      FZ_ASSERT(valid, "mla_chunk_plan_build accepted an invalid batch");
      const int64_t cl = bs > 0 ? (cap / bs > 0 ? cap / bs : 1) : cap;
      int64_t mx = 0;
      for (int i = 0; i < bs; i++) if (fb.prefix_lens[i] > mx) mx = fb.prefix_lens[i];
      FZ_ASSERT(cp.batch_size == bs && cp.chunk_len == cl && cp.num_chunks == cdiv(mx, cl),
                "chunk plan header: %d chunks of %d", (int)cp.num_chunks, (int)cp.chunk_len);
      const int32_t *r2t;
      mla_req_table_data(w->rt, &r2t);
      FZ_ASSERT(cp.slot_indptr[0] == 0, "slot_indptr[0]");
      int64_t *seen = calloc((size_t)(bs > 0 ? bs : 1), sizeof(int64_t));
      FZ_ASSERT(seen, "harness calloc");
      for (int c = 0; c < cp.num_chunks; c++) {
        const int32_t *cu = cp.cu_seq_lens + (size_t)c * (bs + 1);
        int32_t cmx = 0;
        FZ_ASSERT(cu[0] == 0, "cu_seq_lens[%d][0]", c);
        for (int i = 0; i < bs; i++) {
          int32_t s = cp.starts[(size_t)c * bs + i], n = cp.lens[(size_t)c * bs + i];
          FZ_ASSERT(s == seen[i] && n >= 0 && n <= cl && s + n <= fb.prefix_lens[i] &&
                        cu[i + 1] - cu[i] == n,
                    "chunk %d request %d: [%d, +%d)", c, i, (int)s, (int)n);
          const int32_t *slots = cp.slots + cp.slot_indptr[c] + cu[i];
          for (int32_t j = 0; j < n; j++)
            FZ_ASSERT(slots[j] == r2t[(size_t)fb.req_ids[i] * w->max_context + s + j],
                      "chunk %d request %d slot %d", c, i, (int)j);
          seen[i] += n;
          if (n > cmx) cmx = n;
        }
        FZ_ASSERT(cp.max_lens[c] == cmx && cp.slot_indptr[c + 1] - cp.slot_indptr[c] == cu[bs],
                  "chunk %d totals", c);
      }
      for (int i = 0; i < bs; i++)
        FZ_ASSERT(seen[i] == fb.prefix_lens[i], "request %d: chunks cover %lld of %d", i,
                  (long long)seen[i], (int)fb.prefix_lens[i]);
      free(seen);
    }
    ws_free(&cws);
  }

  /* Multi-step draft decode over the batch's ids and lengths. */
  {
    int bs = b->batch_size;
    int ns = fz_rare(f, 8) ? fz_wild(f, 1, 4) : 1 + fz_pick(f, 4);
    int valid = bs >= 0 && bs <= MAX_ARR && ns >= 1;
    int64_t mc = 1; /* keys of the longest last step */
    for (int i = 0; valid && i < bs; i++) {
      int32_t s = fb.seq_lens[i];
      if (s < 0) { valid = 0; break; }
      if ((int64_t)s + ns > mc) mc = (int64_t)s + ns;
      if (fb.req_ids[i] == MLA_REQ_PAD) continue;
      int len = req_len(w, fb.req_ids[i]);
      if (len < 0 || (int64_t)s + ns > len) valid = 0;
    }
    int max_bs = (bs > 0 && bs <= MAX_ARR ? bs : 1) + fz_pick(f, 2);
    int64_t mc2 = mc + fz_pick(f, 3);
    int max_ctx = fz_rare(f, 8) ? fz_wild(f, 1, 64) : (int)(mc2 < INT32_MAX ? mc2 : INT32_MAX);
    size_t dneed = 0;
    mla_status dst = CTX_CHK(w, mla_draft_plan_workspace_size(w->ctx, max_bs, ns, max_ctx, &dneed));
    fz_ws dws = ws_for(f, dneed, dst == MLA_OK);
    mla_draft_plan dp;
    const int arrays = bs <= MAX_ARR;
    mla_status s4 = CTX_CHK(w, mla_draft_plan_build(w->ctx, w->rt, bs, arrays ? fb.req_ids : NULL,
                                                    arrays ? fb.seq_lens : NULL, ns, dws.p,
                                                    dws.bytes, &dp));
    if (valid && bs <= max_bs && mc <= max_ctx && dst == MLA_OK && dws.full)
      FZ_ASSERT(s4 == MLA_OK, "mla_draft_plan_build within the workspace's limits failed: %s",
                mla_ctx_last_error(w->ctx));
    if (s4 == MLA_OK) {
      FZ_COUNT(5);
      FZ_ASSERT(valid && dp.batch_size == bs && dp.num_steps == ns && dp.step_offset[0] == 0,
                "draft plan header / accepted an invalid batch");
      const int32_t *r2t;
      mla_req_table_data(w->rt, &r2t);
      for (int s = 0; s < ns; s++) {
        const int32_t *ip = dp.kv_indptr + (size_t)s * (bs + 1);
        const int32_t *ix = dp.kv_indices + dp.step_offset[s];
        FZ_ASSERT(ip[0] == 0 && dp.step_offset[s + 1] - dp.step_offset[s] == ip[bs],
                  "draft step %d offsets", s);
        for (int i = 0; i < bs; i++) {
          int64_t kv = (int64_t)fb.seq_lens[i] + s + 1;
          FZ_ASSERT(ip[i + 1] - ip[i] == kv, "draft step %d request %d has %d keys, expected %lld",
                    s, i, (int)(ip[i + 1] - ip[i]), (long long)kv);
          for (int64_t j = 0; j < kv; j++) {
            int32_t want = fb.req_ids[i] == MLA_REQ_PAD
                               ? 0
                               : r2t[(size_t)fb.req_ids[i] * w->max_context + j];
            FZ_ASSERT(ix[ip[i] + j] == want, "draft step %d request %d key %lld", s, i,
                      (long long)j);
          }
        }
      }
    }
    ws_free(&dws);
  }
  ws_free(&ws);
  free_batch(&fb);
}

/* ---- 4. direct calls with arbitrary arguments ----------------------------- */

/* A size argument: small and valid, invalid (negative), or huge; `huge` tells
 * the caller to pass NULL arrays (a huge valid size is a promise about the
 * caller's buffers, which the library cannot check). */
static int fz_size(fz *f, int hi, int *huge) {
  unsigned s = fz_u8(f);
  *huge = 0;
  if (s < 216) return fz_int(f, 0, hi);
  switch (s % 4) {
    case 0: return -1;
    case 1: return INT32_MIN;
    case 2: *huge = 1; return INT32_MAX;
    default: *huge = 1; return 1 << 24;
  }
}
/* A slot: mostly valid for the cache, sometimes not. */
static int32_t fz_slot(fz *f, const world *w) {
  int64_t ns = (int64_t)w->num_pages * w->page_size;
  return fz_wild(f, 0, (int)(ns - 1));
}

static void direct_cache(fz *f, world *w) {
  int huge;
  const int T = fz_size(f, 6, &huge);
  const int n = T > 0 && !huge ? T : 0;
  const int64_t ns = (int64_t)w->num_pages * w->page_size;
  int32_t *slots = arr_alloc(n);
  int all_ok = 1;
  for (int i = 0; i < n; i++) {
    slots[i] = fz_slot(f, w);
    if (slots[i] < 0 || slots[i] >= ns) all_ok = 0;
  }
  mla_dtype dt = fz_act_dtype(f);
  const int layer = fz_rare(f, 8) ? fz_wild(f, 0, w->num_layers - 1) : fz_pick(f, w->num_layers);
  const int layer_ok = layer >= 0 && layer < w->num_layers;
  float *c = malloc((size_t)(n > 0 ? n : 1) * MLA_LATENT * sizeof(float));
  float *r = malloc((size_t)(n > 0 ? n : 1) * MLA_ROPE * sizeof(float));
  float *c2 = malloc((size_t)(n > 0 ? n : 1) * MLA_LATENT * sizeof(float));
  float *r2 = malloc((size_t)(n > 0 ? n : 1) * MLA_ROPE * sizeof(float));
  FZ_ASSERT(c && r && c2 && r2, "harness malloc");
  const size_t es = is_act(dt) ? act_size(dt) : 4;
  for (int64_t i = 0; i < (int64_t)n * MLA_LATENT; i++) {
    float v = rng_val(&w->rng);
    if (is_act(dt)) put_act(dt, c, i, v); else c[i] = v;
  }
  for (int64_t i = 0; i < (int64_t)n * MLA_ROPE; i++) {
    float v = rng_val(&w->rng);
    if (is_act(dt)) put_act(dt, r, i, v); else r[i] = v;
  }
  if (fz_rare(f, 16) && n > 0) {
    put_act(MLA_DTYPE_F32, c, 0, NAN);
    w->cache_not_finite = 1;
  }
  (void)es;
  const int null_slots = huge || fz_rare(f, 16);
  const int null_c = huge || fz_rare(f, 16), null_r = huge || fz_rare(f, 16);
  mla_kv_cache *cache = fz_rare(f, 32) ? NULL : w->cache;

  void *raw = NULL;
  size_t rb = 0;
  mla_kv_cache_row_bytes(w->cache, &rb);
  mla_kv_cache_layer_data(w->cache, 0, &raw);
  unsigned char *before = malloc((size_t)ns * rb);
  FZ_ASSERT(before, "harness malloc");
  memcpy(before, raw, (size_t)ns * rb);

  mla_status st;
  if (cache)
    st = CACHE_CHK(w, mla_kv_cache_write(cache, layer, T, null_slots ? NULL : slots,
                                         null_c ? NULL : c, null_r ? NULL : r, dt));
  else
    st = chk(mla_kv_cache_write(NULL, layer, T, slots, c, r, dt), "write(NULL)", NULL);
  const int expect = cache && layer_ok && T >= 0 && !huge && is_act(dt) &&
                     (T == 0 || (!null_slots && !null_c && !null_r && all_ok));
  FZ_ASSERT((st == MLA_OK) == expect, "mla_kv_cache_write(T=%d, layer=%d, dtype=%d) returned %s",
            T, layer, (int)dt, mla_status_string(st));
  if (st != MLA_OK || layer != 0)
    FZ_ASSERT(memcmp(before, raw, (size_t)ns * rb) == 0, "failed cache write changed layer 0");
  free(before);

  if (st == MLA_OK && n > 0 && w->dtype != MLA_DTYPE_FP8_E4M3_BLOCK) {
    /* Read back as F32 and compare with the source, for slots written once
     * (duplicates: the last wins). Values are exact in bf16/f16 and, up to
     * the scale, in e4m3 at |x| <= 2 with scales 1 or 2. */
    FZ_ASSERT(CACHE_CHK(w, mla_kv_cache_read(w->cache, layer, n, slots, c2, r2, MLA_DTYPE_F32)) ==
                  MLA_OK,
              "read back");
    for (int i = 0; i < n; i++) {
      int last = 1;
      for (int j = i + 1; j < n; j++) if (slots[j] == slots[i]) last = 0;
      if (!last) continue;
      for (int d = 0; d < MLA_LATENT; d++) {
        float src = get_act(dt, c, (int64_t)i * MLA_LATENT + d), got = c2[(size_t)i * MLA_LATENT + d];
        FZ_ASSERT((isnan(src) && isnan(got)) || src == got,
                  "slot %d c[%d]: wrote %g, read %g", (int)slots[i], d, (double)src, (double)got);
      }
      for (int d = 0; d < MLA_ROPE; d++) {
        float src = get_act(dt, r, (int64_t)i * MLA_ROPE + d), got = r2[(size_t)i * MLA_ROPE + d];
        FZ_ASSERT(src == got, "slot %d r[%d]: wrote %g, read %g", (int)slots[i], d, (double)src,
                  (double)got);
      }
    }
  }

  /* Read with arbitrary arguments. */
  {
    mla_dtype rdt = fz_act_dtype(f);
    int null_co = fz_rare(f, 4), null_ro = fz_rare(f, 4);
    st = CACHE_CHK(w, mla_kv_cache_read(w->cache, layer, T, null_slots ? NULL : slots,
                                        null_co || huge ? NULL : c2, null_ro || huge ? NULL : r2, rdt));
    const int ok = layer_ok && T >= 0 && !huge && is_act(rdt) && (T == 0 || (!null_slots && all_ok));
    if (!ok) FZ_ASSERT(st != MLA_OK, "mla_kv_cache_read accepted bad arguments");
  }

  /* Gather (the MHA paths' read) must agree with read, bit for bit. */
  {
    mla_dtype gdt = fz_act_dtype(f);
    float *gc = malloc((size_t)(n > 0 ? n : 1) * MLA_LATENT * sizeof(float));
    float *gr = malloc((size_t)(n > 0 ? n : 1) * MLA_ROPE * sizeof(float));
    FZ_ASSERT(gc && gr, "harness malloc");
    st = CTX_CHK(w, mla_gather_latent(w->ctx, cache, layer, T, null_slots ? NULL : slots, gdt,
                                      huge ? NULL : gc, huge || fz_rare(f, 4) ? NULL : gr));
    if (!(cache && layer_ok && T >= 0 && !huge && is_act(gdt) && (T == 0 || (!null_slots && all_ok))))
      FZ_ASSERT(st != MLA_OK, "mla_gather_latent accepted bad arguments");
    if (st == MLA_OK && n > 0 && gdt == MLA_DTYPE_F32) {
      FZ_ASSERT(mla_kv_cache_read(w->cache, layer, n, slots, c2, NULL, MLA_DTYPE_F32) == MLA_OK,
                "read");
      FZ_ASSERT(memcmp(gc, c2, (size_t)n * MLA_LATENT * sizeof(float)) == 0,
                "mla_gather_latent and mla_kv_cache_read disagree");
    }
    free(gc);
    free(gr);
  }

  /* Copy rows between arbitrary slots. */
  {
    int huge2;
    const int R = fz_size(f, 4, &huge2);
    const int m = R > 0 && !huge2 ? R : 0;
    int32_t *src = arr_alloc(m), *dst = arr_alloc(m);
    int ok = 1, distinct = 1;
    for (int i = 0; i < m; i++) {
      src[i] = fz_slot(f, w);
      dst[i] = fz_slot(f, w);
      if (src[i] < 0 || src[i] >= ns || dst[i] < 0 || dst[i] >= ns) ok = 0;
    }
    for (int i = 0; i < m; i++)
      for (int j = 0; j < m; j++)
        if (dst[i] == src[j] || (i != j && dst[i] == dst[j])) distinct = 0;
    unsigned char *want = malloc((size_t)(m > 0 ? m : 1) * rb);
    FZ_ASSERT(want, "harness malloc");
    for (int i = 0; ok && i < m; i++) memcpy(want + (size_t)i * rb, (unsigned char *)raw + (size_t)src[i] * rb, rb);
    st = CACHE_CHK(w, mla_kv_cache_copy_rows(w->cache, R, huge2 ? NULL : src, huge2 ? NULL : dst));
    FZ_ASSERT((st == MLA_OK) == (R >= 0 && !huge2 && ok), "mla_kv_cache_copy_rows(%d) returned %s",
              R, mla_status_string(st));
    if (st == MLA_OK && distinct)
      for (int i = 0; i < m; i++)
        FZ_ASSERT(memcmp(want + (size_t)i * rb, (unsigned char *)raw + (size_t)dst[i] * rb, rb) == 0,
                  "copy_rows: row %d -> %d differs", (int)src[i], (int)dst[i]);
    free(want);
    free(src);
    free(dst);
  }

  /* Queries and scale with arbitrary arguments. */
  {
    void *d = NULL;
    size_t b2 = 0;
    mla_kv_cache_desc kd;
    CACHE_CHK(w, mla_kv_cache_layer_data(w->cache, layer, fz_rare(f, 8) ? NULL : &d));
    CACHE_CHK(w, mla_kv_cache_row_bytes(w->cache, fz_rare(f, 8) ? NULL : &b2));
    CACHE_CHK(w, mla_kv_cache_get_desc(w->cache, fz_rare(f, 8) ? NULL : &kd));
    FZ_ASSERT(mla_kv_cache_last_error(NULL) != NULL, "mla_kv_cache_last_error(NULL)");
    if (fz_rare(f, 4)) {
      float s = fz_float(f, 0.5f);
      st = CACHE_CHK(w, mla_kv_cache_set_fp8_scale(w->cache, layer, s));
      if (st == MLA_OK && s != 0.5f) w->cache_not_finite = 1; /* FLT_MAX: rows overflow */
      if (!(isfinite(s) && s > 0.0f && layer_ok)) FZ_ASSERT(st != MLA_OK, "set_fp8_scale(%g)", (double)s);
    }
  }
  free(slots);
  free(c);
  free(r);
  free(c2);
  free(r2);
}

static void direct_merge(fz *f, world *w) {
  int huge;
  static const int bad_n[] = {0, -1, INT32_MIN};
  const int n = fz_rare(f, 8) ? bad_n[fz_pick(f, 3)] : 1 + fz_pick(f, 3);
  const int T = fz_size(f, 4, &huge);
  const int H = fz_rare(f, 8) ? (fz_pick(f, 2) ? 0 : MLA_MAX_HEADS + 1) : 1 + fz_pick(f, 3);
  const int D = fz_rare(f, 8) ? (fz_pick(f, 2) ? 0 : -7) : 1 + fz_int(f, 0, 40);
  const mla_dtype dt = fz_act_dtype(f);
  const unsigned flags = fz_rare(f, 8) ? 2u : (unsigned)fz_pick(f, 2);
  const int shapes_ok = n >= 1 && n <= 3 && T >= 0 && !huge && H >= 1 && H <= 3 && D >= 1 && is_act(dt);
  const int64_t rows = shapes_ok ? (int64_t)T * H : 0, elems = rows * (D > 0 ? D : 0);
  void *o[3] = {NULL, NULL, NULL};
  float *l[3] = {NULL, NULL, NULL};
  int finite = 1, null_part = 0;
  for (int k = 0; k < 3; k++) {
    o[k] = malloc((size_t)(elems > 0 ? elems : 1) * 4);
    l[k] = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(float));
    FZ_ASSERT(o[k] && l[k], "harness malloc");
    for (int64_t i = 0; i < elems; i++) put_act(is_act(dt) ? dt : MLA_DTYPE_F32, o[k], i, rng_val(&w->rng));
    for (int64_t i = 0; i < rows; i++) {
      static const float sp[] = {-INFINITY, -INFINITY, 0.0f, 1.5f, -3.0f, 40.0f, -800.0f, NAN, INFINITY};
      int s = fz_pick(f, 16);
      l[k][i] = s < 9 ? sp[s] : rng_val(&w->rng) * 4.0f;
      if (isnan(l[k][i]) || l[k][i] == INFINITY) finite = 0;
    }
  }
  void *out = malloc((size_t)(elems > 0 ? elems : 1) * 4);
  float *lo = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(float));
  FZ_ASSERT(out && lo, "harness malloc");
  const void *op[3] = {o[0], o[1], o[2]};
  const float *lp[3] = {l[0], l[1], l[2]};
  if (n >= 1 && fz_rare(f, 16)) { op[fz_pick(f, n)] = NULL; null_part = 1; }
  if (n >= 1 && fz_rare(f, 16)) { lp[fz_pick(f, n)] = NULL; null_part = 1; }
  const int in_place = fz_rare(f, 4);
  void *dst = in_place ? o[0] : out;
  float *ldst = fz_rare(f, 4) ? NULL : (in_place ? l[0] : lo);
  /* reference before an in-place call overwrites part 0 */
  double *ref = malloc((size_t)(elems > 0 ? elems : 1) * sizeof(double));
  FZ_ASSERT(ref, "harness malloc");
  if (shapes_ok && finite)
    for (int64_t x = 0; x < rows; x++) {
      double mx = -INFINITY, ws = 0.0;
      for (int k = 0; k < n; k++) if (l[k][x] > mx) mx = l[k][x];
      for (int d = 0; d < D; d++) ref[x * D + d] = 0.0;
      if (mx == -INFINITY) continue;
      for (int k = 0; k < n; k++) {
        double wk = flags ? exp2(l[k][x] - mx) : exp(l[k][x] - mx);
        if (wk == 0.0) continue;
        ws += wk;
        for (int d = 0; d < D; d++) ref[x * D + d] += wk * get_act(dt, o[k], x * D + d);
      }
      for (int d = 0; d < D; d++) ref[x * D + d] /= ws;
    }
  const int null_arrays = huge || fz_rare(f, 32);
  mla_status st = CTX_CHK(w, mla_merge_states(w->ctx, n, T, H, D, dt, flags, null_arrays ? NULL : op,
                                              null_arrays ? NULL : lp, null_arrays ? NULL : dst, ldst));
  const int ok = shapes_ok && flags <= 1 && (T == 0 || (!null_arrays && !null_part));
  FZ_ASSERT((st == MLA_OK) == ok, "mla_merge_states(n=%d, T=%d, H=%d, D=%d) returned %s", n, T, H, D,
            mla_status_string(st));
  if (st == MLA_OK && finite) {
    FZ_COUNT(7);
    for (int64_t x = 0; x < rows; x++) {
      for (int d = 0; d < D; d++) {
        double got = get_act(dt, dst, x * D + d);
        double tol = dt == MLA_DTYPE_F32 ? 1e-5 : 1e-2;
        FZ_ASSERT(isfinite(got) && fabs(got - ref[x * D + d]) <= tol * (1.0 + fabs(ref[x * D + d])),
                  "merge row %lld dim %d: %g, reference %g", (long long)x, d, got, ref[x * D + d]);
      }
    }
  }
  for (int k = 0; k < 3; k++) {
    free(o[k]);
    free(l[k]);
  }
  free(out);
  free(lo);
  free(ref);
}

static void direct_ragged(fz *f, world *w) {
  mla_ragged_args a;
  memset(&a, 0, sizeof a);
  int huge;
  a.batch_size = fz_size(f, 3, &huge);
  a.num_heads = fz_rare(f, 8) ? (fz_pick(f, 2) ? 0 : MLA_MAX_HEADS + 1) : 1 + fz_pick(f, 4);
  a.num_kv_heads = fz_rare(f, 8) ? fz_pick(f, 4) : (fz_pick(f, 2) ? 1 : a.num_heads);
  a.qk_dim = fz_rare(f, 8) ? (fz_pick(f, 2) ? 0 : MLA_MAX_HEAD_DIM + 1) : 1 + fz_pick(f, 40);
  a.v_dim = fz_rare(f, 8) ? (fz_pick(f, 2) ? -1 : MLA_MAX_HEAD_DIM + 1) : 1 + fz_pick(f, 40);
  a.scale = fz_float(f, 0.125f);
  a.softcap = fz_pick(f, 4) ? 0.0f : fz_float(f, 5.0f);
  a.causal = fz_rare(f, 8) ? 2 : fz_pick(f, 2);
  a.flags = fz_rare(f, 8) ? 4u : (unsigned)fz_pick(f, 4);
  a.act_dtype = fz_act_dtype(f);
  const int bs = a.batch_size > 0 && !huge ? a.batch_size : 0;
  int32_t *qi = arr_alloc(bs + 1), *ki = arr_alloc(bs + 1);
  int monotone = 1;
  qi[0] = fz_rare(f, 8) ? 1 : 0;
  ki[0] = fz_rare(f, 16) ? -1 : 0;
  for (int i = 0; i < bs; i++) {
    qi[i + 1] = qi[i] + (fz_rare(f, 16) ? -1 : fz_pick(f, 7));
    ki[i + 1] = ki[i] + (fz_rare(f, 16) ? -2 : fz_pick(f, 9));
    if (qi[i + 1] < qi[i] || ki[i + 1] < ki[i]) monotone = 0;
  }
  int32_t mq = 0, mk = 0;
  for (int i = 0; i <= bs; i++) {
    if (qi[i] > mq) mq = qi[i];
    if (ki[i] > mk) mk = ki[i];
  }
  const int H = a.num_heads >= 1 && a.num_heads <= 4 ? a.num_heads : 1;
  const int Hkv = a.num_kv_heads >= 1 && a.num_kv_heads <= 4 ? a.num_kv_heads : 1;
  const int dq = a.qk_dim >= 1 && a.qk_dim <= 40 ? a.qk_dim : 1;
  const int dv = a.v_dim >= 1 && a.v_dim <= 40 ? a.v_dim : 1;
  const mla_dtype dt = is_act(a.act_dtype) ? a.act_dtype : MLA_DTYPE_F32;
  void *q = malloc((size_t)(mq + 1) * H * dq * 4), *k = malloc((size_t)(mk + 1) * Hkv * dq * 4);
  void *v = malloc((size_t)(mk + 1) * Hkv * dv * 4), *out = malloc((size_t)(mq + 1) * H * dv * 4);
  float *lse = malloc((size_t)(mq + 1) * H * sizeof(float));
  FZ_ASSERT(q && k && v && out && lse, "harness malloc");
  for (int64_t i = 0; i < (int64_t)(mq + 1) * H * dq; i++) put_act(dt, q, i, rng_val(&w->rng));
  for (int64_t i = 0; i < (int64_t)(mk + 1) * Hkv * dq; i++) put_act(dt, k, i, rng_val(&w->rng));
  for (int64_t i = 0; i < (int64_t)(mk + 1) * Hkv * dv; i++) put_act(dt, v, i, rng_val(&w->rng));
  a.qo_indptr = huge || fz_rare(f, 32) ? NULL : qi;
  a.kv_indptr = huge || fz_rare(f, 32) ? NULL : ki;
  a.q = fz_rare(f, 32) ? NULL : q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.lse = fz_rare(f, 4) ? NULL : lse;
  mla_status st = CTX_CHK(w, mla_attention_ragged(w->ctx, &a));
  const int shape_ok = a.batch_size >= 0 && !huge && a.num_heads >= 1 && a.num_heads <= MLA_MAX_HEADS &&
                       a.num_kv_heads >= 1 && a.num_heads % a.num_kv_heads == 0 &&
                       a.qk_dim >= 1 && a.qk_dim <= MLA_MAX_HEAD_DIM && a.v_dim >= 1 &&
                       a.v_dim <= MLA_MAX_HEAD_DIM && isfinite(a.scale) && a.scale > 0 &&
                       isfinite(a.softcap) && a.softcap >= 0 && (a.causal == 0 || a.causal == 1) &&
                       a.flags <= 3 && is_act(a.act_dtype);
  const int ok = shape_ok && (bs == 0 || (a.qo_indptr && a.kv_indptr && qi[0] == 0 && ki[0] == 0 &&
                                          monotone && (qi[bs] == 0 || a.q)));
  FZ_ASSERT((st == MLA_OK) == ok, "mla_attention_ragged(bs=%d, H=%d/%d, dims %d/%d) returned %s: %s",
            a.batch_size, a.num_heads, a.num_kv_heads, a.qk_dim, a.v_dim, mla_status_string(st),
            mla_ctx_last_error(w->ctx));
  /* Numbers are checked at sane scales only: at FLT_MAX-sized scales the
   * fp32 logits overflow, which the API cannot promise anything about. */
  const int sane = a.scale <= 1.0f && a.softcap <= 100.0f;
  if (st == MLA_OK && bs > 0 && qi[bs] > 0 && sane) {
    FZ_COUNT(6);
    const mla_dtype odt = (a.flags & MLA_FLAG_OUT_F32) ? MLA_DTYPE_F32 : dt;
    /* one (token, head) in float64 */
    const int64_t t = fz_int(f, 0, 255) % qi[bs];
    const int h = fz_pick(f, H), g = h / (H / Hkv);
    int i = 0;
    while (qi[i + 1] <= t) i++;
    const int64_t Q = qi[i + 1] - qi[i], K = ki[i + 1] - ki[i], r = t - qi[i];
    const int64_t last = a.causal ? K - Q + r : K - 1;
    const int64_t nk = last + 1 < K ? (last + 1 > 0 ? last + 1 : 0) : K;
    double ref[40] = {0}, mx = -INFINITY, den = 0.0, lse_ref = -INFINITY;
    double s[16];
    for (int64_t j = 0; j < nk; j++) {
      double acc = 0.0;
      for (int d = 0; d < dq; d++)
        acc += (double)get_act(dt, q, (t * H + h) * dq + d) * get_act(dt, k, ((ki[i] + j) * Hkv + g) * dq + d);
      s[j] = a.softcap > 0 ? a.softcap * tanh(a.scale * acc / a.softcap) : a.scale * acc;
      if (s[j] > mx) mx = s[j];
    }
    for (int64_t j = 0; j < nk; j++) den += exp(s[j] - mx);
    for (int64_t j = 0; j < nk; j++)
      for (int d = 0; d < dv; d++)
        ref[d] += exp(s[j] - mx) / den * get_act(dt, v, ((ki[i] + j) * Hkv + g) * dv + d);
    if (nk > 0) lse_ref = mx + log(den);
    const double tol = odt == MLA_DTYPE_F32 ? 2e-3 : 2e-2;
    for (int d = 0; d < dv; d++) {
      double o = get_act(odt, out, (t * H + h) * dv + d);
      FZ_ASSERT(fabs(o - ref[d]) <= tol * (1.0 + fabs(ref[d])),
                "ragged out[%lld][%d][%d] = %g, float64 reference %g", (long long)t, h, d, o, ref[d]);
    }
    if (a.lse) {
      double l = lse[t * H + h];
      if (a.flags & MLA_FLAG_LSE_BASE2) l *= log(2.0);
      FZ_ASSERT(nk == 0 ? l == -INFINITY : fabs(l - lse_ref) <= 1e-3 * (1.0 + fabs(lse_ref)),
                "ragged lse %g, reference %g", l, lse_ref);
    }
  }
  free(qi);
  free(ki);
  free(q);
  free(k);
  free(v);
  free(out);
  free(lse);
}

static void direct_misc(fz *f, world *w) {
  /* convert */
  {
    static const int dts[] = {MLA_DTYPE_F32, MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_F64,
                              MLA_DTYPE_FP8_E4M3, MLA_DTYPE_FP8_E4M3_BLOCK, 6, -1};
    int huge;
    int n = fz_size(f, 16, &huge);
    mla_dtype s = (mla_dtype)dts[fz_pick(f, 8)], d = (mla_dtype)dts[fz_pick(f, 8)];
    int m = n > 0 && !huge ? n : 0;
    unsigned char *src = malloc((size_t)m * 8 + 1), *dst = malloc((size_t)m * 8 + 1);
    FZ_ASSERT(src && dst, "harness malloc");
    for (int i = 0; i < m * 8; i++) src[i] = (unsigned char)fz_u8(f);
    int ok_t = (s <= MLA_DTYPE_F16 || s == MLA_DTYPE_F64) && (d <= MLA_DTYPE_F16 || d == MLA_DTYPE_F64) &&
               (int)s >= 0 && (int)d >= 0;
    mla_status st = chk(mla_convert(huge ? NULL : src, s, huge ? NULL : dst, d, n), "mla_convert", NULL);
    if (!(ok_t && n >= 0 && !huge)) FZ_ASSERT(st != MLA_OK, "mla_convert(%d -> %d, n=%d) accepted", (int)s, (int)d, n);
    free(src);
    free(dst);
  }
  /* expand_kv */
  {
    int huge;
    const int T = fz_size(f, 3, &huge);
    const int H = 1 + fz_pick(f, 2), nope = fz_rare(f, 8) ? (fz_pick(f, 2) ? 0 : -1) : 1 + fz_pick(f, 8),
              vd = fz_rare(f, 8) ? -1 : 1 + fz_pick(f, 8);
    const mla_dtype lt = fz_act_dtype(f), at = fz_act_dtype(f);
    const int n = T > 0 && !huge ? T : 0, np = nope > 0 ? nope : 1, vp = vd > 0 ? vd : 1;
    float *c = malloc((size_t)(n + 1) * MLA_LATENT * 4), *r = malloc((size_t)(n + 1) * MLA_ROPE * 4);
    float *wb = malloc((size_t)H * (np + vp) * MLA_LATENT * 4);
    float *ko = malloc((size_t)(n + 1) * H * (np + MLA_ROPE) * 4), *vo = malloc((size_t)(n + 1) * H * vp * 4);
    FZ_ASSERT(c && r && wb && ko && vo, "harness malloc");
    const mla_dtype lf = is_act(lt) ? lt : MLA_DTYPE_F32, af = is_act(at) ? at : MLA_DTYPE_F32;
    for (int64_t i = 0; i < (int64_t)n * MLA_LATENT; i++) put_act(lf, c, i, rng_val(&w->rng));
    for (int64_t i = 0; i < (int64_t)n * MLA_ROPE; i++) put_act(lf, r, i, rng_val(&w->rng));
    for (int64_t i = 0; i < (int64_t)H * (np + vp) * MLA_LATENT; i++) put_act(af, wb, i, rng_val(&w->rng) * 0.125f);
    mla_status st = CTX_CHK(w, mla_expand_kv(w->ctx, T, H, nope, vd, lt, at, huge ? NULL : c,
                                             huge ? NULL : r, huge ? NULL : wb, huge ? NULL : ko,
                                             huge ? NULL : vo));
    if (!(T >= 0 && !huge && nope >= 0 && vd >= 1 && is_act(lt) && is_act(at)))
      FZ_ASSERT(st != MLA_OK, "mla_expand_kv accepted bad arguments");
    if (st == MLA_OK)
      for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++)
          for (int d = 0; d < MLA_ROPE; d++)
            FZ_ASSERT(get_act(af, ko, ((int64_t)t * H + h) * (nope + MLA_ROPE) + nope + d) ==
                          get_act(lf, r, (int64_t)t * MLA_ROPE + d),
                      "mla_expand_kv: k rope part differs from r");
    free(c);
    free(r);
    free(wb);
    free(ko);
    free(vo);
  }
  /* context and status functions */
  {
    int v = 0;
    const char *name = NULL;
    mla_device dev;
    static const int th[] = {1, 2, -1, 1025, INT32_MIN, 2};
    int want = th[fz_pick(f, 6)];
    mla_status st = CTX_CHK(w, mla_ctx_set_threads(w->ctx, want));
    FZ_ASSERT((st == MLA_OK) == (want >= 0 && want <= 1024), "mla_ctx_set_threads(%d)", want);
    CTX_CHK(w, mla_ctx_get_threads(w->ctx, fz_rare(f, 4) ? NULL : &v));
    CTX_CHK(w, mla_ctx_cpu_isa(w->ctx, fz_rare(f, 4) ? NULL : &name));
    CTX_CHK(w, mla_ctx_get_device(w->ctx, fz_rare(f, 4) ? NULL : &dev));
    st = CTX_CHK(w, mla_ctx_set_stream(w->ctx, NULL));
    FZ_ASSERT(st == MLA_ERR_UNSUPPORTED, "mla_ctx_set_stream on a CPU context: %s", mla_status_string(st));
    CTX_CHK(w, mla_ctx_synchronize(w->ctx));
    FZ_ASSERT(mla_ctx_get_threads(NULL, &v) == MLA_ERR_INVALID_ARGUMENT, "get_threads(NULL)");
    FZ_ASSERT(mla_ctx_last_error(NULL) != NULL, "mla_ctx_last_error(NULL)");
    int sv = fz_wild(f, 0, 10);
    FZ_ASSERT(mla_status_string((mla_status)sv) != NULL, "mla_status_string(%d)", sv);
    mla_dtype_size((mla_dtype)fz_wild(f, 0, 5));
    mla_dtype_name((mla_dtype)fz_wild(f, 0, 5));
    mla_ctx_destroy(NULL);
    mla_kv_cache_destroy(NULL);
  }
}

/* ---- 5. device-built steps (mla_step_*) on the CPU context ----------------- */

/* Counters of the new phases (fuzz_replay prints fz_stats only; these are
 * printed at exit under FZ_STATS=1 too). */
static long fz_stats_x[6];
static const char *const fz_stat_x_names[6] = {"steps ok", "step attn ok", "graph steps ok",
                                               "graph fwd ok", "gather table ok", "pack rows ok"};
#define FZ_COUNT_X(k) (fz_stats_x[k]++)
static void print_stats_x(void) {
  for (int k = 0; k < 6; k++) printf("  %-15s %ld\n", fz_stat_x_names[k], fz_stats_x[k]);
}

static int is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

/* What the header says of a step descriptor: 1 valid, 0 invalid, -1 outside
 * what it says (the library also bounds max_kv_len by 2^30 and num_steps by
 * 16, which the header does not state). */
static int step_desc_state(const mla_step_desc *d) {
  const int ext = d->mode == MLA_MODE_EXTEND;
  if (d->mode != MLA_MODE_DECODE && d->mode != MLA_MODE_TARGET_VERIFY &&
      d->mode != MLA_MODE_DRAFT_EXTEND && !ext)
    return 0;
  if (d->batch_size < 1 || d->batch_size > 8192) return 0;
  if (d->mode == MLA_MODE_DECODE || ext ? d->num_draft_tokens != 0
                                        : d->num_draft_tokens < 1 || d->num_draft_tokens > 64)
    return 0;
  if (ext ? d->num_tokens < 1 || d->num_tokens > 65536 : d->num_tokens != 0) return 0;
  if (d->max_kv_len < 1) return 0;
  if (d->num_heads < 1 || d->num_heads > MLA_MAX_HEADS) return 0;
  if (!is_pow2(d->page_size) || d->page_size > MLA_MAX_PAGE_SIZE) return 0;
  if (d->num_sm < 0 || d->num_sm > 1024) return 0;
  if (d->num_steps < 0 || (d->num_steps > 0 && d->mode != MLA_MODE_DECODE)) return 0;
  if (d->step < 0 || d->step >= (d->num_steps > 0 ? d->num_steps : 1)) return 0;
  if (d->max_kv_len > (1 << 30) || d->num_steps > 16) return -1;
  if (ext && (int64_t)d->num_tokens * d->num_heads > 65535LL * 64) return -1; /* UNSUPPORTED */
  return 1;
}

static int step_q_len(const mla_step_desc *d) {
  return d->mode == MLA_MODE_DECODE ? 1 : d->mode == MLA_MODE_EXTEND ? d->num_tokens : d->num_draft_tokens;
}
/* kv_len = seq_len + extra: TARGET_VERIFY ndt, draft step k k + 1, else 0. */
static int64_t step_extra(const mla_step_desc *d, int k) {
  if (d->num_steps > 0) return (int64_t)k + 1;
  return d->mode == MLA_MODE_TARGET_VERIFY ? d->num_draft_tokens : 0;
}
/* kv length of a row, or -1 when its request id or length is out of range. */
static int64_t step_row_kv(const mla_step_desc *d, const mla_step_inputs *in, int64_t extra,
                           int32_t id, int32_t seq) {
  if (id != MLA_REQ_PAD && (id < 0 || id >= in->max_reqs)) return -1;
  if (seq < 0) return -1;
  const int64_t kv = (int64_t)seq + extra;
  return kv > d->max_kv_len ? -1 : kv;
}
/* Block-table entry m of a row with kv keys: the page of the slot at the
 * page's first position (page 0 for padding), MLA_BLOCK_TABLE_PAD past the
 * row, or -2 when that slot does not start a page of the cache. */
static int64_t step_page(const mla_step_desc *d, const mla_step_inputs *in, int64_t num_pages,
                         int32_t id, int64_t kv, int64_t m) {
  const int P = d->page_size;
  if (m * P >= kv) return MLA_BLOCK_TABLE_PAD;
  if (id == MLA_REQ_PAD) return 0;
  const int32_t slot = in->req_to_token[(int64_t)id * in->req_to_token_stride + m * P];
  if (slot < 0 || slot % P != 0 || slot / P >= num_pages) return -2;
  return slot / P;
}
/* Whether every row is in range (ids, lengths, page slots) at `extra`. */
static int step_rows_ok(const mla_step_desc *d, const mla_step_inputs *in, int64_t num_pages,
                        int64_t extra) {
  int64_t q_total = 0;
  for (int i = 0; i < d->batch_size; i++) {
    const int64_t kv = step_row_kv(d, in, extra, in->req_ids[i], in->seq_lens[i]);
    if (kv < 0) return 0;
    if (d->mode == MLA_MODE_EXTEND) { /* EXTEND: 0..kv queries, at most num_tokens in all */
      if (in->extend_lens[i] < 0 || in->extend_lens[i] > kv) return 0;
      q_total += in->extend_lens[i];
    }
    for (int64_t m = 0; m * d->page_size < kv; m++)
      if (step_page(d, in, num_pages, in->req_ids[i], kv, m) == -2) return 0;
  }
  return q_total <= d->num_tokens || d->mode != MLA_MODE_EXTEND;
}
/* The slot of key j of a row as a step reads it: through its block table. */
static int32_t step_slot(const mla_step_desc *d, const mla_step_inputs *in, int64_t num_pages,
                         int32_t id, int64_t kv, int64_t j) {
  const int64_t pg = step_page(d, in, num_pages, id, kv, j / d->page_size);
  return (int32_t)(pg * d->page_size + j % d->page_size);
}

/* One of a few values, picked by the input. The values must not read the
 * input themselves (their order of evaluation against the pick is not
 * sequenced). */
#define FZ_ONE_OF(f, ...) \
  ((const int32_t[]){__VA_ARGS__}[fz_pick((f), (int)(sizeof((int32_t[]){__VA_ARGS__}) / sizeof(int32_t)))])

typedef struct fz_step {
  mla_step_desc d;
  mla_step_inputs in;  /* what is passed (possibly hostile) */
  int32_t *ids, *seq;  /* [n] */
  int32_t *ext;        /* [n] EXTEND steps' extend lens */
  int n;
  int32_t *own_r2t;    /* a private request table [rows, stride], or NULL */
  int from_table;      /* in.req_to_token is the world's table */
} fz_step;

static void make_step(fz *f, world *w, fz_step *s) {
  memset(s, 0, sizeof *s);
  mla_step_desc *d = &s->d;
  s->from_table = fz_pick(f, 4) != 3;
  unsigned u = fz_u8(f);
  if (u < 240) {
    static const mla_mode m[] = {MLA_MODE_DECODE, MLA_MODE_TARGET_VERIFY, MLA_MODE_DRAFT_EXTEND,
                                 MLA_MODE_DECODE, MLA_MODE_EXTEND};
    d->mode = m[u % 5];
  } else {
    d->mode = (mla_mode)FZ_ONE_OF(f, MLA_MODE_IDLE, MLA_MODE_EXTEND, -1, 5, 1000, INT32_MIN);
  }
  u = fz_u8(f);
  if (u >= 192) { /* multi-step draft */
    if (u < 248) {
      d->num_steps = 1 + (int)(u % 4);
      if (!fz_rare(f, 8)) d->mode = MLA_MODE_DECODE;
    } else {
      d->num_steps = FZ_ONE_OF(f, 16, 17, -1, INT32_MAX, INT32_MIN, 2);
    }
  }
  u = fz_u8(f);
  if (d->mode == MLA_MODE_DECODE || d->mode == MLA_MODE_EXTEND)
    d->num_draft_tokens = u < 240 ? 0 : FZ_ONE_OF(f, 1, -1, 64, INT32_MIN);
  else
    d->num_draft_tokens = u < 232 ? 1 + (int)(u % 4) : FZ_ONE_OF(f, 0, -1, 64, 65, INT32_MAX, 63);
  u = fz_u8(f);
  d->batch_size = u < 232 ? 1 + (int)(u % 6)
                          : FZ_ONE_OF(f, 0, -1, 8192, 8193, INT32_MAX, INT32_MIN, 200, 1000);
  const int mc = s->from_table ? w->max_context : 1 + fz_pick(f, 64);
  u = fz_u8(f);
  if (u < 160) d->max_kv_len = mc;
  else if (u < 232) d->max_kv_len = 1 + (int)(u % (unsigned)mc);
  else d->max_kv_len = FZ_ONE_OF(f, 0, -1, INT32_MIN, 1 << 30, (1 << 30) + 1, INT32_MAX, mc + 1);
  u = fz_u8(f);
  d->num_heads = u < 224 ? 1 + (int)(u % 4) : FZ_ONE_OF(f, 0, -1, 1024, 1025, 64, 200, INT32_MAX);
  u = fz_u8(f);
  if (u < 232) {
    d->page_size = w->page_size;
  } else {
    const int32_t other = 1 << fz_pick(f, 9);
    d->page_size = FZ_ONE_OF(f, other, 0, 3, 512, -1, 256, INT32_MIN);
  }
  u = fz_u8(f);
  d->num_sm = u < 216 ? (int)(u % 9) : FZ_ONE_OF(f, 1024, 1025, -1, 4096, INT32_MAX, 16, 100);
  u = fz_u8(f);
  const int ns = d->num_steps > 0 && d->num_steps <= 16 ? d->num_steps : 1;
  d->step = u < 232 ? (int)(u % (unsigned)ns) : FZ_ONE_OF(f, d->num_steps, -1, ns, INT32_MAX, 1);

  /* The request table: the world's, or a private copy of it with a wider
   * stride and some page-start slots corrupted. A stride or max_reqs is only
   * ever larger than the buffer where the library must refuse it. */
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(w->rt, &r2t) == MLA_OK, "mla_req_table_data");
  int rows = w->max_reqs;
  if (s->from_table) {
    s->in.req_to_token = r2t;
    s->in.req_to_token_stride = w->max_context;
  } else {
    if (fz_rare(f, 4)) rows = 1 + fz_pick(f, w->max_reqs);
    const int64_t S = d->max_kv_len >= 1 && d->max_kv_len <= 256 ? d->max_kv_len + fz_pick(f, 3)
                                                                  : 1 + fz_pick(f, 64);
    s->own_r2t = calloc((size_t)rows * (size_t)S, sizeof(int32_t));
    FZ_ASSERT(s->own_r2t, "harness calloc");
    for (int r = 0; r < rows; r++)
      for (int64_t j = 0; j < S && j < w->max_context; j++)
        s->own_r2t[r * S + j] = r2t[(size_t)r * w->max_context + j];
    const int P = is_pow2(d->page_size) && d->page_size <= 256 ? d->page_size : 1;
    const int64_t nslots = (int64_t)w->num_pages * w->page_size;
    for (int k = fz_pick(f, 4); k > 0; k--) {
      const int r = fz_pick(f, rows);
      const int64_t pos = (fz_int(f, 0, (int)S - 1) / P) * P;
      int32_t *e = &s->own_r2t[r * S + pos];
      switch (fz_pick(f, 8)) {
        case 0: *e = *e < INT32_MAX ? *e + 1 : 0; break; /* not a page start (P > 1) */
        case 1: *e = (int32_t)(w->num_pages * P); break;  /* one page past the cache */
        case 2: *e = -P; break;
        case 3: *e = INT32_MIN; break;
        case 4: *e = INT32_MAX; break;
        case 5: *e = -1; break;
        default: *e = fz_pick(f, w->num_pages) * P; /* another page, in range */
          if (*e >= nslots) *e = 0;
          break;
      }
    }
    s->in.req_to_token = s->own_r2t;
    s->in.req_to_token_stride = S;
  }
  s->in.max_reqs = rows;
  u = fz_u8(f);
  if (u >= 224) {
    switch (u % 8) {
      case 0: s->in.req_to_token = NULL; break;
      case 1: s->in.req_to_token_stride = (int64_t)d->max_kv_len - 1; break;
      case 2: s->in.max_reqs = 0; break;
      case 3: s->in.max_reqs = -1; break;
      case 4: s->in.max_reqs = INT32_MIN; break;
      case 5: s->in.req_to_token_stride = -1; break;
      case 6: s->in.req_to_token_stride = INT64_MIN; break;
      default: s->in.max_reqs = rows - 1; break; /* fewer rows: the last one's id is out of range */
    }
  }

  /* Rows: mostly live requests at their length, padding, dead or foreign ids. */
  const int bs = d->batch_size;
  s->n = bs >= 1 && bs <= 8192 ? bs : MAX_ARR;
  s->ids = arr_alloc(s->n);
  s->seq = arr_alloc(s->n);
  const int64_t extra = step_extra(d, ns - 1);
  for (int i = 0; i < s->n; i++) {
    const int32_t id = fz_req(f, w);
    const int len = req_len(w, id);
    int32_t seq;
    if (id == MLA_REQ_PAD) seq = 1;
    else if (len >= extra) seq = fz_pick(f, 4) ? (int32_t)(len - extra) : fz_int(f, 0, (int)(len - extra));
    else seq = fz_int(f, 0, 8);
    if (fz_rare(f, 16)) {
      const int32_t past = d->max_kv_len < INT32_MAX ? d->max_kv_len + 1 : INT32_MAX;
      seq = FZ_ONE_OF(f, -1, d->max_kv_len, past, INT32_MAX, INT32_MIN, 0);
    }
    s->ids[i] = id;
    s->seq[i] = seq;
  }
  s->in.req_ids = fz_rare(f, 32) ? NULL : s->ids;
  s->in.seq_lens = fz_rare(f, 32) ? NULL : s->seq;
  /* EXTEND: each row's queries (mostly within its keys), then the token
   * bucket: mostly their sum or a little more, at times less (the batch is
   * refused) or a value the header rules out. Other modes ignore the lens. */
  s->ext = arr_alloc(s->n);
  int64_t sum = 0;
  for (int i = 0; i < s->n; i++) {
    const int64_t kv = s->seq[i] > 0 ? s->seq[i] : 0;
    s->ext[i] = fz_int(f, 0, (int)(kv < 6 ? kv : 6));
    if (fz_rare(f, 32)) s->ext[i] = FZ_ONE_OF(f, -1, INT32_MAX, INT32_MIN, 7);
    sum += s->ext[i] > 0 ? s->ext[i] : 0;
  }
  if (d->mode == MLA_MODE_EXTEND || fz_rare(f, 16)) s->in.extend_lens = fz_rare(f, 32) ? NULL : s->ext;
  if (d->mode == MLA_MODE_EXTEND) {
    u = fz_u8(f);
    const int64_t b = sum + (u < 200 ? (int64_t)(u % 4) : u < 232 ? -1 : 0);
    d->num_tokens = u < 232 ? (int32_t)(b >= 1 ? (b <= 65536 ? b : 65536) : 1)
                            : FZ_ONE_OF(f, 0, -1, 65537, INT32_MAX, INT32_MIN, 65536);
  } else if (fz_rare(f, 64)) {
    d->num_tokens = FZ_ONE_OF(f, 1, -1, 100); /* set outside EXTEND: refused */
  }
}

static void free_step(fz_step *s) {
  free(s->ids);
  free(s->seq);
  free(s->ext);
  free(s->own_r2t);
}

/* The split-schedule part count a step targets (mla.h at MLA_SCHED_BLOCK);
 * num_sm = 0 is the context's workers, known here only as a bound. */
static int step_parts(const mla_step_desc *d, int num_sm) {
  const int64_t tiles = cdiv((int64_t)step_q_len(d) * d->num_heads, MLA_SCHED_BLOCK);
  const int64_t p = num_sm / tiles;
  return p < 1 ? 1 : (int)p;
}

/* The metadata of step k of a successful prepare, entry by entry. */
static void check_step_meta(world *w, const fz_step *s, int k, const mla_step_metadata *m) {
  const mla_step_desc *d = &s->d;
  const int bs = d->batch_size, q = step_q_len(d), P = d->page_size;
  const int64_t W = cdiv(d->max_kv_len, P), extra = step_extra(d, k);
  FZ_ASSERT(m->batch_size == bs && m->q_len == q && m->block_table_width == W,
            "step %d metadata shape: bs %d q_len %d width %d, expected %d / %d / %lld", k,
            (int)m->batch_size, (int)m->q_len, (int)m->block_table_width, bs, q, (long long)W);
  FZ_ASSERT(m->qo_indptr && m->kv_lens && m->block_table && m->sched_meta && m->num_splits,
            "step %d metadata has a NULL array", k);
  int max_parts;
  if (d->num_sm > 0) {
    max_parts = d->num_sm;
    FZ_ASSERT(m->num_sm_parts == step_parts(d, d->num_sm),
              "step %d: num_sm_parts %d, expected max(1, %d / ceil(%d * %d / 64))", k,
              (int)m->num_sm_parts, (int)d->num_sm, q, (int)d->num_heads);
  } else {
    int th = 1;
    FZ_ASSERT(mla_ctx_get_threads(w->ctx, &th) == MLA_OK, "mla_ctx_get_threads");
    max_parts = step_parts(d, th > 0 ? th : 1);
  }
  int64_t q_run = 0;
  for (int i = 0; i <= bs; i++) {
    const int64_t want = d->mode == MLA_MODE_EXTEND ? q_run : (int64_t)i * q;
    FZ_ASSERT(m->qo_indptr[i] == want, "step %d qo_indptr[%d] = %d, expected %lld", k, i, (int)m->qo_indptr[i],
              (long long)want);
    if (i < bs && d->mode == MLA_MODE_EXTEND) q_run += s->ext[i];
  }
  for (int i = 0; i < bs; i++) {
    const int32_t id = s->ids[i];
    const int64_t kv = step_row_kv(d, &s->in, extra, id, s->seq[i]);
    FZ_ASSERT(kv >= 0 && m->kv_lens[i] == kv, "step %d row %d (id %d, seq %d): kv_len %d, expected %lld",
              k, i, (int)id, (int)s->seq[i], (int)m->kv_lens[i], (long long)kv);
    const int32_t *bt = m->block_table + (size_t)i * (size_t)W;
    for (int64_t j = 0; j < W; j++) {
      const int64_t want = step_page(d, &s->in, w->num_pages, id, kv, j);
      FZ_ASSERT(bt[j] == want, "step %d row %d (id %d, %lld keys) block table [%lld] = %d, expected %lld",
                k, i, (int)id, (long long)kv, (long long)j, (int)bt[j], (long long)want);
    }
  }
  check_schedule(bs, m->kv_lens, m->num_sm_parts, max_parts, m->sched_meta, m->num_splits,
                 "mla_step_prepare");
  FZ_ASSERT(m->num_splits[bs] <= m->max_splits, "step %d: %d splits, max_splits %d", k,
            (int)m->num_splits[bs], (int)m->max_splits);
}

/* The header: a step's metadata equals mla_plan_build's for the same batch
 * and num_sm. Compared where the plan's rules hold (live requests at most
 * their length, the table's geometry). */
static void compare_with_plan(world *w, const fz_step *s, int k, const mla_step_metadata *m) {
  const mla_step_desc *d = &s->d;
  const int bs = d->batch_size;
  /* (EXTEND steps size their schedule for the token bucket, a plan for the
   * batch's longest extend: their parts differ; test_step compares them) */
  if (!s->from_table || d->num_sm < 1 || bs > MAX_ARR || d->page_size != w->rt_page_size ||
      d->mode == MLA_MODE_EXTEND)
    return;
  int32_t seqk[MAX_ARR];
  mla_batch b;
  memset(&b, 0, sizeof b);
  b.mode = d->num_steps > 0 ? MLA_MODE_DECODE : d->mode;
  b.batch_size = bs;
  b.req_ids = s->ids;
  b.seq_lens = seqk;
  b.num_draft_tokens = d->num_draft_tokens;
  int64_t sum = 0;
  for (int i = 0; i < bs; i++) {
    seqk[i] = d->num_steps > 0 ? (int32_t)(s->seq[i] + k + 1) : s->seq[i];
    sum += m->kv_lens[i];
  }
  mla_plan_limits lim = {bs, bs * step_q_len(d), (int)(sum > 0 ? sum : 1), d->max_kv_len, d->page_size,
                         d->num_sm, 0};
  if (!plan_should_work(w, w->rt, &b, &lim, d->num_heads)) return;
  size_t need = 0;
  FZ_ASSERT(mla_plan_workspace_size(w->ctx, &lim, &need) == MLA_OK, "plan workspace size");
  void *ws = malloc(need ? need : 1);
  FZ_ASSERT(ws, "harness malloc");
  mla_plan p;
  mla_status st = CTX_CHK(w, mla_plan_build(w->ctx, w->rt, &b, &lim, d->num_heads, ws, need, &p));
  FZ_ASSERT(st == MLA_OK, "mla_plan_build of a step's batch failed: %s", mla_ctx_last_error(w->ctx));
  FZ_ASSERT(p.num_sm_parts == m->num_sm_parts, "step %d: %d schedule parts, the plan has %d", k,
            (int)m->num_sm_parts, (int)p.num_sm_parts);
  FZ_ASSERT(memcmp(p.sched_meta, m->sched_meta,
                   sizeof(int32_t) * MLA_SCHED_META_INTS * (size_t)p.num_sm_parts) == 0 &&
                memcmp(p.num_splits, m->num_splits, sizeof(int32_t) * (size_t)(bs + 1)) == 0 &&
                memcmp(p.kv_lens, m->kv_lens, sizeof(int32_t) * (size_t)bs) == 0,
            "step %d: schedule / kv_lens differ from mla_plan_build's", k);
  for (int i = 0; i < bs; i++)
    for (int j = 0; j < p.block_table_width; j++)
      FZ_ASSERT(p.block_table[(size_t)i * p.block_table_width + j] ==
                    m->block_table[(size_t)i * m->block_table_width + j],
                "step %d row %d block table [%d] differs from the plan's", k, i, j);
  free(ws);
}

/* mla_step_attention over a prepared step; one output row in float64. */
static void run_step_attention(fz *f, world *w, const fz_step *s, const fz_ws *ws, size_t need) {
  mla_step_desc d = s->d;
  const int steps = d.num_steps > 0 ? d.num_steps : 1;
  d.step = fz_pick(f, steps);
  const int H = d.num_heads, q = step_q_len(&d), ext = d.mode == MLA_MODE_EXTEND;
  const int64_t T = ext ? q : (int64_t)d.batch_size * q; /* EXTEND: the bucket's rows */
  int64_t written = T;                                    /* EXTEND: the real total */
  if (ext) {
    written = 0;
    for (int i = 0; i < d.batch_size; i++) written += s->ext[i];
  }
  mla_absorbed_args a;
  memset(&a, 0, sizeof a);
  if (H > 4 || T * H > 256) {
    /* Too large to allocate here: a head count other than the step's must
     * be refused (nothing is read or written). */
    a.num_heads = H % 4 + 1;
    a.scale = 0.1f;
    a.act_dtype = MLA_DTYPE_F32;
    mla_status st = CTX_CHK(w, mla_step_attention(w->ctx, &d, w->cache, 0, &a, ws->p, ws->bytes));
    FZ_ASSERT(st == MLA_ERR_INVALID_ARGUMENT, "mla_step_attention with num_heads %d != desc %d: %s",
              a.num_heads, H, mla_status_string(st));
    return;
  }
  a.num_heads = fz_rare(f, 16) ? H % 4 + 1 : H;
  const float sane_scale = 0.04f + 0.02f * (float)fz_pick(f, 8);
  a.scale = fz_float(f, sane_scale);
  /* bit 0 LSE_BASE2, bit 2 FP8_MATH (a permission the CPU ignores); 8 is unknown */
  a.flags = fz_rare(f, 8) ? 8u : fz_flags_absorbed((unsigned)fz_pick(f, 4));
  a.act_dtype = fz_act_dtype(f);
  if (fz_rare(f, 16)) a.q_stride_token = -1;
  const int layer = fz_rare(f, 8) ? fz_wild(f, 0, w->num_layers - 1) : fz_pick(f, w->num_layers);
  mla_kv_cache *cache = fz_rare(f, 32) ? NULL : w->cache;
  size_t bytes = ws->bytes;
  void *wp = ws->p;
  if (fz_rare(f, 16)) bytes = need - 1;
  if (fz_rare(f, 32)) wp = NULL;

  const size_t es = is_act(a.act_dtype) ? act_size(a.act_dtype) : 4;
  const int64_t nq = T * 4;
  void *qn = malloc((size_t)nq * MLA_LATENT * es), *qr = malloc((size_t)nq * MLA_ROPE * es);
  void *out = malloc((size_t)nq * MLA_LATENT * es);
  float *lse = malloc((size_t)nq * sizeof(float));
  FZ_ASSERT(qn && qr && out && lse, "harness malloc");
  if (is_act(a.act_dtype)) {
    for (int64_t i = 0; i < nq * MLA_LATENT; i++) put_act(a.act_dtype, qn, i, rng_val(&w->rng));
    for (int64_t i = 0; i < nq * MLA_ROPE; i++) put_act(a.act_dtype, qr, i, rng_val(&w->rng));
  }
  memset(out, 0xff, (size_t)nq * MLA_LATENT * es); /* NaN: must be overwritten */
  for (int64_t i = 0; i < nq; i++) lse[i] = NAN;
  a.q_nope = fz_rare(f, 32) ? NULL : qn;
  a.q_rope = fz_rare(f, 32) ? NULL : qr;
  a.out = fz_rare(f, 32) ? NULL : out;
  a.lse = fz_rare(f, 4) ? NULL : lse;

  mla_status st = CTX_CHK(w, mla_step_attention(w->ctx, &d, cache, layer, &a, wp, bytes));
  const int expect = cache && layer >= 0 && layer < w->num_layers && a.num_heads == H &&
                     is_act(a.act_dtype) && isfinite(a.scale) && a.scale > 0 && (a.flags & ~(MLA_FLAG_LSE_BASE2 | MLA_FLAG_FP8_MATH)) == 0 &&
                     a.q_stride_token >= 0 && a.q_nope && a.q_rope && a.out && wp && bytes >= need;
  FZ_ASSERT((st == MLA_OK) == expect, "mla_step_attention returned %s, expected %s: %s",
            mla_status_string(st), expect ? "MLA_OK" : "a failure", mla_ctx_last_error(w->ctx));
  if (st == MLA_OK && a.scale == sane_scale && !w->cache_not_finite) {
    FZ_COUNT_X(1);
    check_finite_out(a.act_dtype, out, a.lse, written * H, "mla_step_attention");
    if (written == 0) goto done; /* an EXTEND batch without queries */
    const int64_t t = fz_int(f, 0, 65535) % written;
    const int h = fz_pick(f, H);
    int i = (int)(t / q);
    int64_t Q = q, qi = t % q;
    if (ext) { /* the row holding query t, and t's place in it */
      int64_t t0 = 0;
      for (i = 0; t >= t0 + s->ext[i]; i++) t0 += s->ext[i];
      Q = s->ext[i], qi = t - t0;
    }
    const int64_t K = step_row_kv(&d, &s->in, step_extra(&d, d.step), s->ids[i], s->seq[i]);
    const int64_t nk = visible_keys(Q, K, qi, d.mode != MLA_MODE_DECODE);
    int32_t *slots = arr_alloc((int)(nk > 0 ? nk : 1));
    for (int64_t j = 0; j < nk; j++) slots[j] = step_slot(&d, &s->in, w->num_pages, s->ids[i], K, j);
    check_row_f64(w->cache, layer, &a, qn, qr, out, lse, t, h, nk, slots, "mla_step_attention");
    free(slots);
  }
done:
  free(qn);
  free(qr);
  free(out);
  free(lse);
}

static void run_step(fz *f, world *w) {
  fz_step s;
  make_step(f, w, &s);
  const mla_step_desc *d = &s.d;
  const int state = step_desc_state(d);
  size_t need = 0;
  if (fz_rare(f, 32)) {
    FZ_ASSERT(CTX_CHK(w, mla_step_workspace_size(w->ctx, NULL, &need)) == MLA_ERR_INVALID_ARGUMENT,
              "mla_step_workspace_size(desc = NULL)");
    FZ_ASSERT(CTX_CHK(w, mla_step_workspace_size(w->ctx, d, NULL)) == MLA_ERR_INVALID_ARGUMENT,
              "mla_step_workspace_size(bytes = NULL)");
    FZ_ASSERT(mla_step_workspace_size(NULL, d, &need) == MLA_ERR_INVALID_ARGUMENT, "ctx = NULL");
  }
  const mla_status sst = CTX_CHK(w, mla_step_workspace_size(w->ctx, d, &need));
  if (state >= 0)
    FZ_ASSERT((sst == MLA_OK) == (state == 1),
              "mla_step_workspace_size(mode %d bs %d ndt %d kv %d H %d P %d sm %d steps %d/%d) "
              "returned %s: %s",
              (int)d->mode, (int)d->batch_size, (int)d->num_draft_tokens, (int)d->max_kv_len,
              (int)d->num_heads, (int)d->page_size, (int)d->num_sm, (int)d->step,
              (int)d->num_steps, mla_status_string(sst), mla_ctx_last_error(w->ctx));
  /* Above WS_CAP the call must fail anyway: a small buffer keeps that cheap. */
  fz_ws ws = ws_for(f, need > WS_CAP ? (size_t)4096 : need, sst == MLA_OK);
  /* A pattern that a refused prepare must leave: all of a small workspace;
   * of a large one the head (the metadata arrays start there) and the tail,
   * which keeps multi-MiB workspaces cheap. */
  const size_t band = (size_t)64 << 10;
  const size_t head = ws.bytes < 2 * band ? ws.bytes : band;
  const size_t tail = ws.bytes - head < band ? ws.bytes - head : band;
  memset(ws.buf.p, 0xa5, head);
  memset((char *)ws.buf.p + ws.bytes - tail, 0xa5, tail);
  mla_kv_cache *cache = fz_rare(f, 32) ? NULL : w->cache;
  const mla_step_inputs *in = fz_rare(f, 32) ? NULL : &s.in;
  const mla_status st = CTX_CHK(w, mla_step_prepare(w->ctx, d, cache, in, ws.p, ws.bytes));

  /* The status the header gives: bad descriptor fields and arguments are
   * INVALID_ARGUMENT, a short workspace WORKSPACE_TOO_SMALL (which of the
   * two when both apply is not said), a row out of range OUT_OF_RANGE. */
  int expect = -2; /* an mla_status; -1: INVALID or TOO_SMALL; -2: not said */
  if (state == 0) {
    expect = MLA_ERR_INVALID_ARGUMENT;
  } else if (sst == MLA_OK) {
    const int bad = !cache || !in || !s.in.req_to_token || !s.in.req_ids || !s.in.seq_lens ||
                    (d->mode == MLA_MODE_EXTEND && !s.in.extend_lens) ||
                    s.in.max_reqs < 1 || s.in.req_to_token_stride < d->max_kv_len ||
                    d->page_size != w->page_size;
    const int small = ws.bytes < need;
    if (bad || !ws.p) expect = small ? -1 : MLA_ERR_INVALID_ARGUMENT;
    else if (small) expect = MLA_ERR_WORKSPACE_TOO_SMALL;
    else
      expect = step_rows_ok(d, &s.in, w->num_pages, step_extra(d, (d->num_steps > 0 ? d->num_steps : 1) - 1))
                   ? MLA_OK
                   : MLA_ERR_OUT_OF_RANGE;
  }
  if (expect == -1)
    FZ_ASSERT(st == MLA_ERR_INVALID_ARGUMENT || st == MLA_ERR_WORKSPACE_TOO_SMALL,
              "mla_step_prepare returned %s, expected INVALID_ARGUMENT or WORKSPACE_TOO_SMALL: %s",
              mla_status_string(st), mla_ctx_last_error(w->ctx));
  else if (expect >= 0)
    FZ_ASSERT((int)st == expect, "mla_step_prepare returned %s, expected %s: %s",
              mla_status_string(st), mla_status_string((mla_status)expect),
              mla_ctx_last_error(w->ctx));
  if (st != MLA_OK) {
    const unsigned char *b = ws.buf.p;
    for (size_t i = 0; i < ws.bytes; i++) {
      if (i == head) i = ws.bytes - tail;
      if (i >= ws.bytes) break;
      FZ_ASSERT(b[i] == 0xa5, "mla_step_prepare failed with %s but wrote byte %zu of the workspace",
                mla_status_string(st), i);
    }
  } else {
    FZ_COUNT_X(0);
    const int steps = d->num_steps > 0 ? d->num_steps : 1;
    for (int k = 0; k < steps; k++) {
      mla_step_desc dk = *d;
      dk.step = k;
      mla_step_metadata m;
      FZ_ASSERT(CTX_CHK(w, mla_step_get_metadata(w->ctx, &dk, ws.p, ws.bytes, &m)) == MLA_OK,
                "mla_step_get_metadata(step %d) after a successful prepare: %s", k,
                mla_ctx_last_error(w->ctx));
      check_step_meta(w, &s, k, &m);
      compare_with_plan(w, &s, k, &m);
    }
    if (fz_rare(f, 8)) {
      mla_step_desc dk = *d;
      mla_step_metadata m;
      FZ_ASSERT(CTX_CHK(w, mla_step_get_metadata(w->ctx, &dk, ws.p, ws.bytes, NULL)) ==
                    MLA_ERR_INVALID_ARGUMENT,
                "mla_step_get_metadata(out = NULL)");
      FZ_ASSERT(CTX_CHK(w, mla_step_get_metadata(w->ctx, &dk, ws.p, need - 1, &m)) ==
                    MLA_ERR_WORKSPACE_TOO_SMALL,
                "mla_step_get_metadata(bytes = need - 1)");
      dk.step = steps;
      FZ_ASSERT(CTX_CHK(w, mla_step_get_metadata(w->ctx, &dk, ws.p, ws.bytes, &m)) ==
                    MLA_ERR_INVALID_ARGUMENT,
                "mla_step_get_metadata(step = %d of %d)", steps, steps);
    }
    run_step_attention(f, w, &s, &ws, need);
  }
  ws_free(&ws);
  free_step(&s);
}

/* ---- 6. the backend's graph steps on the CPU context ------------------------ */
#define BE_CHK(be, call) chk((call), #call, mla_backend_last_error(be))

/* A backend descriptor with one field the library must refuse. */
static void hostile_backend_desc(fz *f, mla_backend_desc *d) {
  switch (fz_pick(f, 14)) {
    case 0: d->max_bs = FZ_ONE_OF(f, 0, -1, INT32_MIN); break;
    case 1: d->max_q_tokens = FZ_ONE_OF(f, 0, -1); break;
    case 2: d->max_context = FZ_ONE_OF(f, 0, -5); break;
    case 3: d->num_heads = FZ_ONE_OF(f, 0, -1, MLA_MAX_HEADS + 1); break;
    case 4: {
      static const float sv[] = {0.0f, -1.0f, NAN, INFINITY};
      d->scale = sv[fz_pick(f, 4)];
      break;
    }
    case 5: d->act_dtype = (mla_dtype)FZ_ONE_OF(f, MLA_DTYPE_FP8_E4M3, MLA_DTYPE_F64, -1, 6); break;
    case 6: d->extend_impl = (mla_extend_impl)FZ_ONE_OF(f, 2, -1); break;
    case 7: d->chunk_capacity = -1; break;
    case 8: d->num_sm = FZ_ONE_OF(f, -1, INT32_MIN); break;
    case 9: d->cache.num_layers = 0; break;
    case 10: d->cache.page_size = FZ_ONE_OF(f, 3, 0, 512); break;
    case 11: d->cache.num_pages = 1; break;
    case 12: d->max_reqs = FZ_ONE_OF(f, 0, -1); break;
    default:
      if (fz_pick(f, 2)) d->qk_nope_dim = MLA_MAX_HEAD_DIM; /* + 64 rope > the limit */
      else d->v_dim = FZ_ONE_OF(f, MLA_MAX_HEAD_DIM + 1, -1);
      break;
  }
}

static void run_backend(fz *f, world *w) {
  static const mla_dtype dts[] = {MLA_DTYPE_BF16, MLA_DTYPE_F16, MLA_DTYPE_FP8_E4M3,
                                  MLA_DTYPE_FP8_E4M3_BLOCK};
  static const mla_dtype acts[] = {MLA_DTYPE_BF16, MLA_DTYPE_F32, MLA_DTYPE_F16};
  mla_backend_desc bd;
  memset(&bd, 0, sizeof bd);
  bd.cache.num_layers = 1 + fz_pick(f, 2);
  bd.cache.num_pages = 2 + fz_pick(f, 11);
  bd.cache.page_size = 1 << fz_pick(f, 5);
  bd.cache.dtype = dts[fz_pick(f, 4)];
  bd.max_reqs = 1 + fz_pick(f, 4);
  bd.max_context = 1 + fz_pick(f, 24);
  bd.max_bs = 1 + fz_pick(f, 4);
  bd.max_q_tokens = 1 + fz_pick(f, 16);
  bd.num_heads = 1 + fz_pick(f, 4);
  bd.scale = 0.04f + 0.02f * (float)fz_pick(f, 8);
  bd.act_dtype = acts[fz_pick(f, 3)];
  bd.qk_nope_dim = 8; /* the MHA buffers stay small */
  bd.v_dim = 8;
  bd.extend_impl = fz_pick(f, 4) == 3 ? MLA_EXTEND_MHA_CHUNKED : MLA_EXTEND_ABSORBED;
  bd.chunk_capacity = 1 + fz_pick(f, 16);
  bd.num_sm = fz_pick(f, 9);
  if (fz_rare(f, 8)) {
    mla_backend_desc bad = bd;
    hostile_backend_desc(f, &bad);
    mla_backend *b = (mla_backend *)&bad; /* must be overwritten with NULL */
    mla_status st = CTX_CHK(w, mla_backend_create(w->ctx, &bad, &b));
    FZ_ASSERT(st != MLA_OK && b == NULL, "mla_backend_create accepted a bad descriptor (%s)",
              mla_status_string(st));
    FZ_ASSERT(CTX_CHK(w, mla_backend_create(w->ctx, NULL, &b)) != MLA_OK && b == NULL, "desc = NULL");
    FZ_ASSERT(CTX_CHK(w, mla_backend_create(w->ctx, &bd, NULL)) != MLA_OK, "out = NULL");
    FZ_ASSERT(mla_backend_create(NULL, &bd, &b) == MLA_ERR_INVALID_ARGUMENT && b == NULL, "ctx = NULL");
  }
  mla_backend *be = NULL;
  mla_status st = CTX_CHK(w, mla_backend_create(w->ctx, &bd, &be));
  FZ_ASSERT(st == MLA_OK && be, "mla_backend_create of a valid descriptor: %s", mla_ctx_last_error(w->ctx));
  mla_kv_cache *cache = NULL;
  mla_req_table *rt = NULL;
  FZ_ASSERT(BE_CHK(be, mla_backend_cache(be, &cache)) == MLA_OK && cache, "mla_backend_cache");
  FZ_ASSERT(BE_CHK(be, mla_backend_req_table(be, &rt)) == MLA_OK && rt, "mla_backend_req_table");
  if (fz_rare(f, 16)) {
    FZ_ASSERT(BE_CHK(be, mla_backend_cache(be, NULL)) == MLA_ERR_INVALID_ARGUMENT, "cache(NULL)");
    FZ_ASSERT(BE_CHK(be, mla_backend_req_table(be, NULL)) == MLA_ERR_INVALID_ARGUMENT, "req_table(NULL)");
  }
  const int P = bd.cache.page_size, H = bd.num_heads;
  const int64_t nslots = (int64_t)bd.cache.num_pages * P;

  /* Requests with rows in every layer. */
  for (int k = fz_pick(f, bd.max_reqs + 1); k > 0; k--) {
    int32_t id = -1;
    if (mla_req_add(rt, &id) != MLA_OK) break;
    int n = fz_int(f, 0, bd.max_context);
    int32_t *slots = arr_alloc(n);
    if (chk(mla_req_extend(rt, id, n, slots), "mla_req_extend", mla_req_table_last_error(rt)) ==
            MLA_OK &&
        n > 0) {
      float *c = malloc((size_t)n * MLA_LATENT * sizeof(float));
      float *r = malloc((size_t)n * MLA_ROPE * sizeof(float));
      FZ_ASSERT(c && r, "harness malloc");
      for (int l = 0; l < bd.cache.num_layers; l++) {
        for (int64_t i = 0; i < (int64_t)n * MLA_LATENT; i++) c[i] = rng_val(&w->rng);
        for (int64_t i = 0; i < (int64_t)n * MLA_ROPE; i++) r[i] = rng_val(&w->rng);
        FZ_ASSERT(mla_kv_cache_write(cache, l, n, slots, c, r, MLA_DTYPE_F32) == MLA_OK,
                  "writing the slots extend returned: %s", mla_kv_cache_last_error(cache));
      }
      free(c);
      free(r);
    }
    free(slots);
  }
  if (fz_rare(f, 8)) { /* a freed request: its id now reads page 0 */
    int32_t id = fz_pick(f, bd.max_reqs);
    mla_req_free(rt, id);
  }

  /* Before mla_backend_graph_init: nothing to step. */
  int32_t *g_ids = NULL, *g_seq = NULL;
  if (fz_rare(f, 8)) {
    FZ_ASSERT(BE_CHK(be, mla_backend_graph_inputs(be, &g_ids, &g_seq)) == MLA_ERR_BAD_STATE,
              "graph_inputs before graph_init");
    FZ_ASSERT(BE_CHK(be, mla_backend_graph_step(be, MLA_MODE_DECODE, 1, 0)) == MLA_ERR_BAD_STATE,
              "graph_step before graph_init");
  }
  /* Refused graph_init arguments, then a valid one. */
  for (int k = fz_rare(f, 4) ? 1 + fz_pick(f, 2) : 0; k > 0; k--) {
    int mb = 1, nd = 0;
    if (fz_pick(f, 2)) mb = FZ_ONE_OF(f, 0, -1, INT32_MIN, INT32_MAX, bd.max_bs + 1);
    else nd = FZ_ONE_OF(f, -1, 65, INT32_MAX, INT32_MIN);
    st = BE_CHK(be, mla_backend_graph_init(be, mb, nd));
    FZ_ASSERT(st == MLA_ERR_INVALID_ARGUMENT, "mla_backend_graph_init(%d, %d) returned %s", mb, nd,
              mla_status_string(st));
  }
  const int gmax = 1 + fz_pick(f, bd.max_bs);
  const int gndt = fz_rare(f, 16) ? 64 : fz_pick(f, 5);
  st = BE_CHK(be, mla_backend_graph_init(be, gmax, gndt));
  FZ_ASSERT(st == MLA_OK, "mla_backend_graph_init(%d, %d) of a backend with max_bs %d: %s", gmax, gndt,
            bd.max_bs, mla_backend_last_error(be));
  if (fz_rare(f, 8))
    FZ_ASSERT(BE_CHK(be, mla_backend_graph_init(be, gmax, gndt)) == MLA_ERR_BAD_STATE,
              "mla_backend_graph_init twice");
  if (fz_rare(f, 16)) {
    FZ_ASSERT(BE_CHK(be, mla_backend_graph_inputs(be, NULL, &g_seq)) == MLA_ERR_INVALID_ARGUMENT,
              "graph_inputs(req_ids = NULL)");
    FZ_ASSERT(BE_CHK(be, mla_backend_graph_inputs(be, &g_ids, NULL)) == MLA_ERR_INVALID_ARGUMENT,
              "graph_inputs(seq_lens = NULL)");
  }
  FZ_ASSERT(BE_CHK(be, mla_backend_graph_inputs(be, &g_ids, &g_seq)) == MLA_OK && g_ids && g_seq,
            "mla_backend_graph_inputs after graph_init");

  /* Per-step buffers for the largest step. */
  const mla_dtype at = bd.act_dtype;
  const size_t es = act_size(at);
  const int64_t TQ = bd.max_q_tokens;
  void *qn = malloc((size_t)TQ * H * MLA_LATENT * es), *qr = malloc((size_t)TQ * H * MLA_ROPE * es);
  void *out = malloc((size_t)TQ * H * MLA_LATENT * es);
  float *lse = malloc((size_t)TQ * H * sizeof(float));
  void *nc = malloc(3 * MLA_LATENT * es), *nr = malloc(3 * MLA_ROPE * es);
  FZ_ASSERT(qn && qr && out && lse && nc && nr, "harness malloc");
  const int32_t *r2t;
  FZ_ASSERT(mla_req_table_data(rt, &r2t) == MLA_OK, "mla_req_table_data");

  for (int round = 1 + fz_pick(f, 3); round > 0; round--) {
    unsigned u = fz_u8(f);
    mla_mode mode;
    if (u < 232) {
      static const mla_mode m[] = {MLA_MODE_DECODE, MLA_MODE_TARGET_VERIFY, MLA_MODE_DRAFT_EXTEND};
      mode = m[u % 3];
    } else {
      mode = (mla_mode)FZ_ONE_OF(f, MLA_MODE_IDLE, MLA_MODE_EXTEND, -1, 7);
    }
    u = fz_u8(f);
    const int bs = u < 232 ? 1 + (int)(u % (unsigned)gmax) : FZ_ONE_OF(f, 0, -1, gmax + 1, INT32_MAX);
    u = fz_u8(f);
    int ndt;
    if (mode == MLA_MODE_DECODE) ndt = u < 240 ? 0 : FZ_ONE_OF(f, 1, -1);
    else ndt = u < 232 ? 1 + (int)(u % (unsigned)(gndt > 0 ? gndt : 1)) : FZ_ONE_OF(f, 0, -1, gndt + 1, 65);

    /* The engine's writes into the fixed buffers (rows past bs stay). */
    const int extra = mode == MLA_MODE_TARGET_VERIFY ? ndt : 0;
    for (int i = 0; i < gmax && i < bs; i++) {
      unsigned s = fz_u8(f);
      int32_t id;
      if (s < 216) id = (int32_t)(s % (unsigned)bd.max_reqs);
      else id = FZ_ONE_OF(f, MLA_REQ_PAD, MLA_REQ_PAD, bd.max_reqs, -2, INT32_MAX, INT32_MIN);
      int len = -1;
      mla_req_length(rt, id, &len);
      int32_t seq = id == MLA_REQ_PAD ? 1 : len >= extra ? len - extra : fz_int(f, 0, 4);
      if (fz_pick(f, 4) == 0 && seq > 0) seq = fz_int(f, 0, seq);
      if (fz_rare(f, 16)) {
        const int32_t past = bd.max_context - extra + 1;
        seq = FZ_ONE_OF(f, -1, past, INT32_MAX, INT32_MIN);
      }
      g_ids[i] = id;
      g_seq[i] = seq;
    }
    FZ_ASSERT(BE_CHK(be, mla_backend_sync(be)) == MLA_OK, "mla_backend_sync on a CPU context");

    st = BE_CHK(be, mla_backend_graph_step(be, mode, bs, ndt));
    /* The step as the backend builds it: its table, geometry and inputs. */
    mla_step_desc d;
    memset(&d, 0, sizeof d);
    d.mode = mode;
    d.batch_size = bs;
    d.num_draft_tokens = ndt;
    d.max_kv_len = bd.max_context;
    d.num_heads = H;
    d.page_size = P;
    mla_step_inputs in = {r2t, bd.max_context, bd.max_reqs, g_ids, g_seq, NULL};
    const int args_ok = (mode == MLA_MODE_DECODE || mode == MLA_MODE_TARGET_VERIFY ||
                         mode == MLA_MODE_DRAFT_EXTEND) &&
                        bs >= 1 && bs <= gmax &&
                        (mode == MLA_MODE_DECODE ? ndt == 0 : ndt >= 1 && ndt <= gndt);
    const int q = mode == MLA_MODE_DECODE ? 1 : ndt;
    mla_status expect;
    if (mode == MLA_MODE_EXTEND && bs >= 1 && bs <= gmax)
      expect = MLA_ERR_BAD_STATE; /* EXTEND graph steps need mla_backend_graph_init_extend (not called here) */
    else if (!args_ok) expect = MLA_ERR_INVALID_ARGUMENT;
    else if ((int64_t)bs * q > bd.max_q_tokens) expect = MLA_ERR_CAPACITY;
    else expect = step_rows_ok(&d, &in, bd.cache.num_pages, extra) ? MLA_OK : MLA_ERR_OUT_OF_RANGE;
    FZ_ASSERT(st == expect, "mla_backend_graph_step(mode %d, bs %d, ndt %d) returned %s, expected %s: %s",
              (int)mode, bs, ndt, mla_status_string(st), mla_status_string(expect),
              mla_backend_last_error(be));

    mla_forward_args fa;
    memset(&fa, 0, sizeof fa);
    if (st != MLA_OK) {
      /* A refused step leaves nothing planned. */
      fa.out = out;
      fa.q_nope = qn;
      fa.q_rope = qr;
      st = BE_CHK(be, mla_backend_forward(be, &fa));
      FZ_ASSERT(st == MLA_ERR_BAD_STATE, "forward after a refused graph step returned %s",
                mla_status_string(st));
      continue;
    }
    FZ_COUNT_X(2);
    const int64_t T = (int64_t)bs * q;
    for (int64_t i = 0; i < T * H * MLA_LATENT; i++) put_act(at, qn, i, rng_val(&w->rng));
    for (int64_t i = 0; i < T * H * MLA_ROPE; i++) put_act(at, qr, i, rng_val(&w->rng));
    memset(out, 0xff, (size_t)T * H * MLA_LATENT * es);
    fa.layer = fz_rare(f, 8) ? fz_wild(f, 0, bd.cache.num_layers - 1) : fz_pick(f, bd.cache.num_layers);
    fa.num_new = fz_rare(f, 16) ? -1 : fz_pick(f, 4);
    int32_t new_slots[3];
    int slots_ok = 1;
    for (int i = 0; i < 3; i++) {
      new_slots[i] = fz_rare(f, 16) ? (int32_t)nslots : (int32_t)fz_int(f, 0, (int)nslots - 1);
      if (i < fa.num_new && new_slots[i] >= nslots) slots_ok = 0;
    }
    for (int64_t i = 0; i < 3 * MLA_LATENT; i++) put_act(at, nc, i, rng_val(&w->rng));
    for (int64_t i = 0; i < 3 * MLA_ROPE; i++) put_act(at, nr, i, rng_val(&w->rng));
    fa.new_slots = fz_rare(f, 32) ? NULL : new_slots;
    fa.new_c = nc;
    fa.new_r = nr;
    fa.q_nope = fz_rare(f, 32) ? NULL : qn;
    fa.q_rope = qr;
    fa.out = fz_rare(f, 32) ? NULL : out;
    fa.lse = fz_pick(f, 4) ? lse : NULL;
    fa.flags = fz_rare(f, 16) ? (unsigned)FZ_ONE_OF(f, 2, 8, INT32_MIN) : (unsigned)fz_pick(f, 2);
    const int null_args = fz_rare(f, 64);
    st = BE_CHK(be, mla_backend_forward(be, null_args ? NULL : &fa));
    const int fwd_ok = !null_args && fa.layer >= 0 && fa.layer < bd.cache.num_layers && fa.num_new >= 0 &&
                       fa.flags <= 1 && fa.q_nope && fa.q_rope && fa.out &&
                       (fa.num_new == 0 || (fa.new_slots && slots_ok));
    FZ_ASSERT((st == MLA_OK) == fwd_ok,
              "mla_backend_forward of a graph step returned %s, expected %s: %s", mla_status_string(st),
              fwd_ok ? "MLA_OK" : "a failure", mla_backend_last_error(be));
    if (st == MLA_OK) {
      FZ_COUNT_X(3);
      mla_absorbed_args a;
      memset(&a, 0, sizeof a);
      a.num_heads = H;
      a.scale = bd.scale;
      a.flags = fa.flags;
      a.act_dtype = at;
      a.lse = fa.lse;
      check_finite_out(at, out, fa.lse, T * H, "mla_backend_forward (graph step)");
      const int64_t t = fz_int(f, 0, 65535) % T;
      const int h = fz_pick(f, H), i = (int)(t / q);
      const int64_t K = step_row_kv(&d, &in, extra, g_ids[i], g_seq[i]);
      const int64_t nk = visible_keys(q, K, t % q, mode != MLA_MODE_DECODE);
      int32_t *slots = arr_alloc((int)(nk > 0 ? nk : 1));
      for (int64_t j = 0; j < nk; j++) slots[j] = step_slot(&d, &in, bd.cache.num_pages, g_ids[i], K, j);
      check_row_f64(cache, fa.layer, &a, qn, qr, out, lse, t, h, nk, slots,
                    "mla_backend_forward (graph step)");
      free(slots);
    }
    if (fz_rare(f, 8)) {
      const mla_plan *p = NULL;
      BE_CHK(be, mla_backend_get_plan(be, &p));
      int uses = -1;
      FZ_ASSERT(BE_CHK(be, mla_backend_uses_mha(be, &uses)) == MLA_OK && uses == 0,
                "a graph step uses the absorbed path");
    }
  }
  FZ_ASSERT(BE_CHK(be, mla_backend_sync(be)) == MLA_OK, "mla_backend_sync");
  FZ_ASSERT(mla_backend_sync(NULL) == MLA_ERR_INVALID_ARGUMENT, "sync(NULL)");
  FZ_ASSERT(mla_backend_graph_init(NULL, 1, 0) == MLA_ERR_INVALID_ARGUMENT, "graph_init(NULL)");
  FZ_ASSERT(mla_backend_graph_inputs(NULL, &g_ids, &g_seq) == MLA_ERR_INVALID_ARGUMENT, "graph_inputs(NULL)");
  FZ_ASSERT(mla_backend_graph_step(NULL, MLA_MODE_DECODE, 1, 0) == MLA_ERR_INVALID_ARGUMENT,
            "graph_step(NULL)");
  FZ_ASSERT(mla_backend_last_error(NULL) != NULL, "mla_backend_last_error(NULL)");
  free(qn);
  free(qr);
  free(out);
  free(lse);
  free(nc);
  free(nr);
  mla_backend_destroy(be);
  mla_backend_destroy(NULL);
}

/* ---- 7. the DCP merge over NCCL on the CPU context ------------------------- */
/* Never available on a CPU context (or without NCCL): every call answers
 * UNSUPPORTED (or INVALID_ARGUMENT for a missing ctx / bytes), whatever the
 * arguments, and never touches the communicator or the buffers (hostile,
 * non-NULL pointers included). */
static void run_dcp(fz *f, world *w) {
  static char junk[64];
  void *ptrs[] = {NULL, junk, (void *)(uintptr_t)0x10, (void *)(uintptr_t)UINTPTR_MAX};
  for (int round = 1 + fz_pick(f, 3); round > 0; round--) {
    const int world_n = FZ_ONE_OF(f, 2, 1, 0, -1, 128, 129, INT32_MAX);
    const int rank = FZ_ONE_OF(f, 0, 1, -1, 127, INT32_MIN);
    const int T = FZ_ONE_OF(f, 1, 0, -1, 7, INT32_MAX), Hh = FZ_ONE_OF(f, 16, 0, -3, 129);
    const int dim = FZ_ONE_OF(f, 512, 128, 0, -1, 100);
    const mla_dtype dt = (mla_dtype)FZ_ONE_OF(f, MLA_DTYPE_BF16, MLA_DTYPE_F32, MLA_DTYPE_F16,
                                              MLA_DTYPE_FP8_E4M3, -1, 77);
    size_t n = 12345;
    const int null_bytes = fz_rare(f, 8);
    mla_status st = CTX_CHK(w, mla_dcp_merge_workspace_size(w->ctx, world_n, T, Hh, dim, dt, null_bytes ? NULL : &n));
    FZ_ASSERT(st == MLA_ERR_UNSUPPORTED || st == MLA_ERR_INVALID_ARGUMENT,
              "mla_dcp_merge_workspace_size on a CPU context returned %s", mla_status_string(st));
    FZ_ASSERT(mla_dcp_merge_workspace_size(NULL, world_n, T, Hh, dim, dt, &n) == MLA_ERR_INVALID_ARGUMENT,
              "mla_dcp_merge_workspace_size(ctx = NULL)");
    void *comm = ptrs[fz_pick(f, 4)], *o = ptrs[fz_pick(f, 4)], *ws = ptrs[fz_pick(f, 4)], *out = ptrs[fz_pick(f, 4)];
    float *lse = ptrs[fz_pick(f, 4)], *lse_out = ptrs[fz_pick(f, 4)];
    st = CTX_CHK(w, mla_dcp_merge_nccl(w->ctx, comm, world_n, rank, T, Hh, dim, dt, o, lse, ws,
                                       (size_t)FZ_ONE_OF(f, 0, 64, INT32_MAX), out, lse_out));
    FZ_ASSERT(st == MLA_ERR_UNSUPPORTED || st == MLA_ERR_INVALID_ARGUMENT,
              "mla_dcp_merge_nccl on a CPU context returned %s", mla_status_string(st));
  }
}

/* EXTEND under DCP on the CPU: the gathered table (its layout checked on
 * success, nothing written on refusal) and pack_rows from the world's cache
 * into a small fresh cache (bytes equal the source rows on success, the
 * destination unchanged on refusal). */
static void run_dcp_gather(fz *f, world *w) {
  /* mla_dcp_gather_table */
  int32_t lens[8];
  const int bs = FZ_ONE_OF(f, 3, 0, 1, 8, -1);
  int lens_ok = 1;
  for (int i = 0; i < 8; i++) {
    lens[i] = FZ_ONE_OF(f, 0, 1, 5, 17, 40, -1, 1 << 30);
    if (i < bs && lens[i] < 0) lens_ok = 0;
  }
  const int world_n = FZ_ONE_OF(f, 2, 1, 3, 4, 128, 0, 129, -2);
  const int base = FZ_ONE_OF(f, 1, 4, 0, -1, INT32_MAX);
  const int64_t stride = FZ_ONE_OF(f, 48, 17, 0, 1);
  int32_t *table = fz_pick(f, 4) ? malloc(sizeof(int32_t) * 8 * 48) : NULL;
  if (table) memset(table, 0x7f, sizeof(int32_t) * 8 * 48);
  int32_t m = -7;
  const int null_lens = fz_rare(f, 8);
  mla_status st = CTX_CHK(w, mla_dcp_gather_table(w->ctx, bs, null_lens ? NULL : lens, world_n, base, stride, table,
                                                 fz_rare(f, 16) ? NULL : &m));
  if (st == MLA_OK) {
    FZ_COUNT_X(4);
    FZ_ASSERT(bs >= 0 && world_n >= 1 && world_n <= 128 && base >= 1 && (bs == 0 || (!null_lens && lens_ok)),
              "mla_dcp_gather_table accepted bs %d world %d base %d", bs, world_n, base);
    int64_t want = 0;
    for (int i = 0; i < bs; i++) want += lens[i] > 0 ? (lens[i] - 1) / world_n + 1 : 0;
    FZ_ASSERT(m == want, "rows_per_rank %d, expected %lld", (int)m, (long long)want);
    for (int i = 0; table && i < bs; i++)
      for (int64_t p = 0; p < stride; p++) {
        const int32_t v = table[i * stride + p];
        FZ_ASSERT(p < lens[i] ? v >= base + (int64_t)(p % world_n) * m && v < base + (int64_t)(p % world_n + 1) * m
                              : v == MLA_SLOT_UNUSED,
                  "table[%d][%lld] = %d", i, (long long)p, (int)v);
      }
  } else {
    FZ_ASSERT(st == MLA_ERR_INVALID_ARGUMENT || st == MLA_ERR_OUT_OF_RANGE, "mla_dcp_gather_table returned %s",
              mla_status_string(st));
    for (int k = 0; table && k < 8 * 48; k++) FZ_ASSERT(table[k] == 0x7f7f7f7f, "a refused gather_table wrote");
  }
  free(table);

  /* mla_kv_cache_pack_rows */
  mla_kv_cache_desc sd;
  FZ_ASSERT(mla_kv_cache_get_desc(w->cache, &sd) == MLA_OK, "get_desc");
  const int sl = fz_rare(f, 8) ? fz_wild(f, 0, w->num_layers - 1) : fz_pick(f, w->num_layers);
  const int same_dtype = fz_pick(f, 8) != 0, same_scale = fz_pick(f, 8) != 0;
  const mla_dtype ddt = same_dtype ? w->dtype : (mla_dtype)FZ_ONE_OF(f, MLA_DTYPE_BF16, MLA_DTYPE_FP8_E4M3);
  const int sl_ok = sl >= 0 && sl < w->num_layers;
  /* the source layer's scale (any other value when same_scale is 0) */
  const float src_scale = w->dtype == MLA_DTYPE_FP8_E4M3 && sl_ok ? sd.fp8_scales[sl] : 1.0f;
  const float scales[2] = {same_scale ? src_scale : src_scale * 2.0f, same_scale ? src_scale : src_scale * 2.0f};
  const int dpage = FZ_ONE_OF(f, 1, 2, 4), dpages = FZ_ONE_OF(f, 8, 2);
  mla_kv_cache_desc dd = {2, dpages, dpage, ddt, ddt == MLA_DTYPE_FP8_E4M3 ? scales : NULL};
  mla_kv_cache *dst = NULL;
  if (mla_kv_cache_create(w->ctx, &dd, &dst) != MLA_OK) return;
  int huge;
  const int n = fz_size(f, 6, &huge), nn = n > 0 && !huge ? n : 0;
  int32_t *slots = arr_alloc(nn);
  const int64_t ns = (int64_t)w->num_pages * w->page_size, dns = (int64_t)dpages * dpage;
  int slots_ok = 1;
  for (int i = 0; i < nn; i++) {
    slots[i] = fz_slot(f, w);
    slots_ok &= slots[i] >= 0 && slots[i] < ns;
  }
  const int dl = FZ_ONE_OF(f, 0, 1, 2, -1);
  const int first = FZ_ONE_OF(f, 4, 1, 0, 8, 15, -1, INT32_MAX);
  const int null_slots = fz_rare(f, 8);
  void *dd0 = NULL, *dd1 = NULL, *sdat = NULL;
  mla_kv_cache_layer_data(dst, 0, &dd0);
  mla_kv_cache_layer_data(dst, 1, &dd1);
  size_t rb = 0;
  mla_kv_cache_row_bytes(dst, &rb);
  memset(dd0, 0x5a, rb * (size_t)dns);
  memset(dd1, 0x5a, rb * (size_t)dns);
  st = chk(mla_kv_cache_pack_rows(w->cache, sl, n, null_slots ? NULL : slots, dst, dl, first), "pack_rows",
           mla_kv_cache_last_error(dst));
  const int valid = sl_ok && dl >= 0 && dl < 2 && n >= 0 && ddt == w->dtype &&
                    (w->dtype != MLA_DTYPE_FP8_E4M3 || same_scale) && first >= dpage &&
                    (int64_t)first + n <= dns && (n == 0 || (!huge && !null_slots && slots_ok));
  FZ_ASSERT((st == MLA_OK) == valid, "pack_rows returned %s, the model says %s", mla_status_string(st),
            valid ? "valid" : "invalid");
  if (st == MLA_OK && nn > 0) {
    FZ_COUNT_X(5);
    mla_kv_cache_layer_data(w->cache, sl, &sdat);
    unsigned char *to = (unsigned char *)(dl ? dd1 : dd0);
    for (int i = 0; i < nn; i++)
      FZ_ASSERT(!memcmp(to + (size_t)(first + i) * rb, (unsigned char *)sdat + (size_t)slots[i] * rb, rb),
                "pack_rows: row %d differs from its source", i);
  } else if (st != MLA_OK) {
    for (size_t k = 0; k < rb * (size_t)dns; k++)
      FZ_ASSERT(((unsigned char *)dd0)[k] == 0x5a && ((unsigned char *)dd1)[k] == 0x5a,
                "a refused pack_rows wrote the destination");
  }
  free(slots);
  mla_kv_cache_destroy(dst);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz f = {data, size, 0};
  static int stats_registered;
  if (!stats_registered) {
    const char *e = getenv("FZ_STATS");
    stats_registered = 1;
    if (e && e[0] == '1') atexit(print_stats_x);
  }
  world w;
  setup(&f, &w);
  table_ops(&f, &w);
  int rounds = 1 + fz_pick(&f, 3);
  for (int i = 0; i < rounds; i++) run_plans(&f, &w);
  int direct = fz_pick(&f, 16);
  if (direct & 1) direct_cache(&f, &w);
  if (direct & 2) direct_merge(&f, &w);
  if (direct & 4) direct_ragged(&f, &w);
  if (direct & 8) direct_misc(&f, &w);
  /* The new phases come last, so that older corpus inputs keep driving the
   * phases above as they did; an exhausted input runs both, with valid
   * choices. */
  unsigned later = fz_u8(&f);
  if ((later & 3) != 3)
    for (int i = 0, n = ((later >> 2) & 3) == 3 ? 2 : 1; i < n; i++) run_step(&f, &w);
  /* A backend costs a few MiB of workspaces (slow under ASan): 1 in 4. */
  if (((later >> 4) & 3) == 0) run_backend(&f, &w);
  if ((later >> 6) == 1) run_dcp(&f, &w);
  if ((later >> 6) == 2) run_dcp_gather(&f, &w);
  teardown(&w);
  return 0;
}
