/* Helpers of the chunked-prefix MHA path: gather latent rows from the paged
 * cache (dequantized), and expand them to per-head k / v with kv_b_proj. */
#include "cpu.h"
#ifdef MLA_WITH_CUDA
#include "../cuda/expand.h"
#include "../cuda/runtime.h"
#endif

/* ---- mla_gather_latent ---------------------------------------------------- */

#define GATHER_ROWS 16

typedef struct ga_job {
  mla_cpu_rows rows;
  const int32_t *slots;
  mla_dtype dst;
  void *c_out, *r_out;
} ga_job;

static void gather_range(void *arg, int64_t b, int64_t e, int worker) {
  const ga_job *J = arg;
  (void)worker;
  float c[GATHER_ROWS * MLA_LATENT], r[GATHER_ROWS * MLA_ROPE];
  for (int64_t t0 = b; t0 < e; t0 += GATHER_ROWS) {
    const int n = e - t0 < GATHER_ROWS ? (int)(e - t0) : GATHER_ROWS;
    mla_cpu_load_rows(&J->rows, J->slots + t0, n, c, MLA_LATENT, r, MLA_ROPE);
    if (J->c_out) mla_store_f32(J->dst, J->c_out, t0 * MLA_LATENT, (int64_t)n * MLA_LATENT, c);
    if (J->r_out) mla_store_f32(J->dst, J->r_out, t0 * MLA_ROPE, (int64_t)n * MLA_ROPE, r);
  }
}

mla_status mla_gather_latent(mla_ctx *ctx, const mla_kv_cache *cache, int layer, int num_tokens,
                             const int32_t *slots /* [T] */, mla_dtype dst_dtype,
                             void *c_out /* [T, 512] or NULL */,
                             void *r_out /* [T, 64] or NULL */) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE_PTR(eb, cache);
  MLA_REQUIRE(eb, layer >= 0 && layer < cache->num_layers, MLA_ERR_OUT_OF_RANGE,
              "layer = %d, the cache has %d layers", layer, cache->num_layers);
  MLA_REQUIRE(eb, num_tokens >= 0, MLA_ERR_INVALID_ARGUMENT, "num_tokens = %d is negative",
              num_tokens);
  {
    mla_status st_ = mla_cpu_check_act(eb, __func__, "dst_dtype", dst_dtype);
    if (st_ != MLA_OK) return st_;
  }
  if (num_tokens == 0) return MLA_OK;
  if (cache->on_device) { /* device slots in, device rows out: the cache's kernel */
    mla_status st = mla_kv_cache_read(cache, layer, num_tokens, slots, c_out, r_out, dst_dtype);
    return st == MLA_OK ? st : mla_fail(eb, st, __func__, "%s", mla_kv_cache_last_error(cache));
  }
  MLA_REQUIRE_PTR(eb, slots);
  MLA_REQUIRE(eb, c_out || r_out, MLA_ERR_INVALID_ARGUMENT, "c_out and r_out are both NULL");
  for (int t = 0; t < num_tokens; t++)
    MLA_REQUIRE(eb, slots[t] >= 0 && slots[t] < cache->num_slots, MLA_ERR_OUT_OF_RANGE,
                "slots[%d] = %d outside the cache's [0, %lld)", t, (int)slots[t],
                (long long)cache->num_slots);
  ga_job J;
  mla_cpu_rows_init(&J.rows, cache, layer, mla_cpu_kernels_get());
  J.slots = slots;
  J.dst = dst_dtype;
  J.c_out = c_out;
  J.r_out = r_out;
  mla_parallel_for(ctx, num_tokens, 64, gather_range, &J);
  return MLA_OK;
}

/* ---- mla_expand_kv -------------------------------------------------------- */
/* Work item = (block of EX_TOKENS tokens, head). The token block is held
 * transposed (CT [512, rb]) so the scores kernel computes W rows x tokens:
 * out[j][t] = sum_d W[h, j, d] c[t, d] for a tile of EX_WROWS weight rows. */

#define EX_TOKENS 32
#define EX_WROWS 16
#define EX_MAX_WROWS (MLA_MAX_HEAD_DIM - MLA_ROPE + MLA_MAX_HEAD_DIM)

typedef struct ex_job {
  const mla_cpu_kernels *k;
  int T, H, nope, dv;
  mla_dtype latent, act;
  const void *c, *r, *w;
  void *k_out, *v_out;
  int64_t tblocks;
  float *scratch;        /* the context's per-worker scratch */
  size_t scratch_floats; /* floats per worker */
} ex_job;

/* Floats expand_range carves from a worker's scratch (+16 for alignment). */
size_t mla_cpu_expand_scratch_floats(void) {
  return (size_t)MLA_LATENT * EX_TOKENS + (size_t)EX_WROWS * MLA_LATENT + (size_t)EX_WROWS * EX_TOKENS +
         (size_t)EX_TOKENS * EX_MAX_WROWS + MLA_LATENT + 16;
}

static void expand_range(void *arg, int64_t b, int64_t e, int worker) {
  const ex_job *J = arg;
  /* ~155 KiB of tiles from the context's per-worker scratch (not the
   * caller's stack); each piece is a multiple of 16 floats, so 64-byte
   * alignment carries over from the aligned start. */
  float *base = J->scratch + (size_t)worker * J->scratch_floats;
  float *CT = (float *)(((uintptr_t)base + 63) & ~(uintptr_t)63); /* [512, 32] */
  float *W = CT + MLA_LATENT * EX_TOKENS;                          /* [16, 512] */
  float *S = W + EX_WROWS * MLA_LATENT;                            /* [16, 32] */
  float *OUT = S + EX_WROWS * EX_TOKENS; /* [tokens, nope + v_dim] of one head */
  float *row = OUT + EX_TOKENS * EX_MAX_WROWS;                     /* [512] */
  const int kdim = J->nope + MLA_ROPE, wrows = J->nope + J->dv;
  int64_t loaded = -1; /* token block currently in CT */
  int nt = 0, rb = 0;
  for (int64_t x = b; x < e; x++) {
    /* items are token-block major, so consecutive items reuse CT */
    const int64_t tb = x / J->H;
    const int h = (int)(x % J->H);
    const int64_t t0 = tb * EX_TOKENS;
    if (tb != loaded) {
      nt = J->T - t0 < EX_TOKENS ? (int)(J->T - t0) : EX_TOKENS;
      rb = mla_cpu_round_up(nt, MLA_CPU_ROW_ALIGN);
      for (int t = 0; t < rb; t++) {
        if (t < nt) mla_cpu_load_act(J->k, J->latent, J->c, (t0 + t) * MLA_LATENT, MLA_LATENT, row);
        for (int d = 0; d < MLA_LATENT; d++) CT[(size_t)d * rb + t] = t < nt ? row[d] : 0.0f;
      }
      loaded = tb;
    }
    for (int j0 = 0; j0 < wrows; j0 += EX_WROWS) {
      const int n = wrows - j0 < EX_WROWS ? wrows - j0 : EX_WROWS;
      mla_cpu_load_act(J->k, J->act, J->w, ((int64_t)h * wrows + j0) * MLA_LATENT, n * MLA_LATENT,
                       W);
      J->k->qk(n, MLA_LATENT, W, MLA_LATENT, CT, rb, S, 0, NULL);
      for (int j = 0; j < n; j++)
        for (int t = 0; t < nt; t++) OUT[(size_t)t * wrows + j0 + j] = S[(size_t)j * rb + t];
    }
    for (int t = 0; t < nt; t++) {
      const int64_t kv_row = (t0 + t) * J->H + h;
      const float *o = OUT + (size_t)t * wrows;
      mla_store_f32(J->act, J->k_out, kv_row * kdim, J->nope, o);
      mla_store_f32(J->act, J->v_out, kv_row * J->dv, J->dv, o + J->nope);
      /* rope part: a copy of r[t] (bit-exact when latent and act dtypes agree) */
      mla_load_f32(J->latent, J->r, (t0 + t) * MLA_ROPE, MLA_ROPE, row);
      mla_store_f32(J->act, J->k_out, kv_row * kdim + J->nope, MLA_ROPE, row);
    }
  }
}

mla_status mla_expand_kv(mla_ctx *ctx, int num_tokens, int num_heads, int nope_dim, int v_dim,
                         mla_dtype latent_dtype, mla_dtype act_dtype,
                         const void *c /* [T, 512] */,
                         const void *r /* [T, 64] */,
                         const void *kv_b_proj /* [H, nope+v_dim, 512] */,
                         void *k_out /* [T, H, nope+64] */, void *v_out /* [T, H, v_dim] */) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  mla_clear_error(eb);
  MLA_REQUIRE(eb, num_tokens >= 0, MLA_ERR_INVALID_ARGUMENT, "num_tokens = %d is negative",
              num_tokens);
  MLA_REQUIRE(eb, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  MLA_REQUIRE(eb, nope_dim >= 0 && nope_dim + MLA_ROPE <= MLA_MAX_HEAD_DIM,
              MLA_ERR_INVALID_ARGUMENT, "nope_dim = %d, expected 0..%d", nope_dim,
              MLA_MAX_HEAD_DIM - MLA_ROPE);
  MLA_REQUIRE(eb, v_dim >= 1 && v_dim <= MLA_MAX_HEAD_DIM, MLA_ERR_INVALID_ARGUMENT,
              "v_dim = %d, expected 1..%d", v_dim, MLA_MAX_HEAD_DIM);
  {
    mla_status st_ = mla_cpu_check_act(eb, __func__, "latent_dtype", latent_dtype);
    if (st_ == MLA_OK) st_ = mla_cpu_check_act(eb, __func__, "act_dtype", act_dtype);
    if (st_ != MLA_OK) return st_;
  }
  if (num_tokens == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, c);
  MLA_REQUIRE_PTR(eb, r);
  MLA_REQUIRE_PTR(eb, kv_b_proj);
  MLA_REQUIRE_PTR(eb, k_out);
  MLA_REQUIRE_PTR(eb, v_out);
  if (ctx->device == MLA_DEVICE_CUDA) {
#ifdef MLA_WITH_CUDA
    /* cuBLAS multiplies operands of one type: the latent rows come in the
     * activation dtype (gather them so; fp8 rows are exact in bf16 up to the
     * per-tensor scale's rounding). */
    MLA_REQUIRE(eb, latent_dtype == act_dtype, MLA_ERR_UNSUPPORTED,
                "latent_dtype %s differs from act_dtype %s: on a CUDA context both must be one dtype",
                mla_dtype_name(latent_dtype), mla_dtype_name(act_dtype));
    const void *ptrs[5] = {c, r, kv_b_proj, k_out, v_out};
    static const char *const names[5] = {"c", "r", "kv_b_proj", "k_out", "v_out"};
    for (int i = 0; i < 5; i++)
      MLA_REQUIRE(eb, mla_cuda_is_device_ptr(ptrs[i]), MLA_ERR_INVALID_ARGUMENT,
                  "%s is host memory; a CUDA context takes device pointers", names[i]);
    const char *why = mla_cuda_expand_kv(&ctx->blas, ctx->stream, num_tokens, num_heads, nope_dim, v_dim,
                                         (int)act_dtype, c, r, kv_b_proj, k_out, v_out);
    if (why) return mla_fail(eb, MLA_ERR_DEVICE, __func__, "%s", why);
    return MLA_OK;
#else
    return mla_fail(eb, MLA_ERR_UNSUPPORTED, __func__, "built without CUDA");
#endif
  }
  ex_job J;
  J.k = mla_cpu_kernels_get();
  J.T = num_tokens;
  J.H = num_heads;
  J.nope = nope_dim;
  J.dv = v_dim;
  J.scratch = ctx->cpu_scratch;
  J.scratch_floats = ctx->cpu_scratch_floats;
  J.latent = latent_dtype;
  J.act = act_dtype;
  J.c = c;
  J.r = r;
  J.w = kv_b_proj;
  J.k_out = k_out;
  J.v_out = v_out;
  J.tblocks = mla_cdiv(num_tokens, EX_TOKENS);
  mla_parallel_for(ctx, J.tblocks * num_heads, 1, expand_range, &J);
  return MLA_OK;
}
