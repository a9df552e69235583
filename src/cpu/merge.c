/* Merge of partial attention states by their LSE (split-KV combine, chunked
 * prefix, decode context parallel), on the CPU.
 *
 * Per (token, head): m = max_k lse_k, w_k = exp(lse_k - m),
 * o = sum_k w_k o_k / sum_k w_k, lse = m + ln sum_k w_k, in double.
 * A side with lse = -inf is empty: it gets no weight and its o is never read,
 * so garbage (even NaN) there cannot leak; the same holds for a side whose
 * weight underflows to 0 in double (more than ~745 below the max). All sides empty: o = 0,
 * lse = -inf. An lse of +inf or NaN is not a state we can weigh: that row's
 * o and lse become NaN (propagated, never hidden).
 *
 * In place: every element of a row is read from all parts before the same
 * element of the output is written, and a row's lse is written last, so out
 * may be o_parts[k] (the same pointer) and lse_out may be lse_parts[k]. */
#include "cpu.h"

#define MERGE_CHUNK 256

typedef struct mg_job {
  int n, H, dim;
  mla_dtype act;
  int base2;
  const void *const *o;
  const float *const *lse;
  void *out;
  float *lse_out;
} mg_job;

static void merge_rows(void *arg, int64_t b, int64_t e, int worker) {
  const mg_job *J = arg;
  (void)worker;
  float buf[MERGE_CHUNK];
  double acc[MERGE_CHUNK];
  for (int64_t x = b; x < e; x++) {
    double mx = -INFINITY;
    int bad = 0;
    for (int k = 0; k < J->n; k++) {
      const double v = J->lse[k][x];
      if (isnan(v) || v == INFINITY) bad = 1;
      else if (v > mx) mx = v;
    }
    double wsum = 0.0, out_lse;
    for (int c0 = 0; c0 < J->dim; c0 += MERGE_CHUNK) {
      const int nc = J->dim - c0 < MERGE_CHUNK ? J->dim - c0 : MERGE_CHUNK;
      const int64_t off = x * J->dim + c0;
      if (bad || mx == -INFINITY) {
        for (int c = 0; c < nc; c++) buf[c] = bad ? NAN : 0.0f;
      } else {
        for (int c = 0; c < nc; c++) acc[c] = 0.0;
        wsum = 0.0;
        for (int k = 0; k < J->n; k++) {
          const double v = J->lse[k][x];
          const double w = J->base2 ? exp2(v - mx) : exp(v - mx);
          if (w == 0.0) continue; /* empty side (or one that cannot weigh): o unread */
          wsum += w;
          mla_load_f32(J->act, J->o[k], off, nc, buf);
          for (int c = 0; c < nc; c++) acc[c] += w * buf[c];
        }
        for (int c = 0; c < nc; c++) buf[c] = (float)(acc[c] / wsum);
      }
      mla_store_f32(J->act, J->out, off, nc, buf);
    }
    if (bad) {
      out_lse = NAN;
    } else if (mx == -INFINITY) {
      out_lse = -INFINITY;
    } else { /* wsum: from the chunk loop (dim >= 1, so it ran) */
      out_lse = mx + (J->base2 ? log2(wsum) : log(wsum));
    }
    if (J->lse_out) J->lse_out[x] = (float)out_lse;
  }
}

mla_status mla_cpu_merge_states(mla_ctx *ctx, int num_states, int num_tokens, int num_heads,
                                int head_dim, mla_dtype act_dtype, unsigned flags,
                                const void *const *o_parts /* n x [T, H, dim] */,
                                const float *const *lse_parts /* n x [T, H] */,
                                void *out /* [T, H, dim] */, float *lse_out /* [T, H] or NULL */) {
  if (!ctx) return MLA_ERR_INVALID_ARGUMENT;
  mla_errbuf *eb = &ctx->err;
  MLA_CPU_REQUIRE_CPU_CTX(eb, ctx);
  mla_clear_error(eb);
  MLA_REQUIRE(eb, num_states >= 1, MLA_ERR_INVALID_ARGUMENT, "num_states = %d, expected >= 1",
              num_states);
  MLA_REQUIRE(eb, num_tokens >= 0, MLA_ERR_INVALID_ARGUMENT, "num_tokens = %d is negative",
              num_tokens);
  MLA_REQUIRE(eb, num_heads >= 1 && num_heads <= MLA_MAX_HEADS, MLA_ERR_INVALID_ARGUMENT,
              "num_heads = %d, expected 1..%d", num_heads, MLA_MAX_HEADS);
  MLA_REQUIRE(eb, head_dim >= 1, MLA_ERR_INVALID_ARGUMENT, "head_dim = %d, expected >= 1",
              head_dim);
  {
    mla_status st_ = mla_cpu_check_act(eb, __func__, "act_dtype", act_dtype);
    if (st_ != MLA_OK) return st_;
  }
  MLA_REQUIRE(eb, (flags & ~MLA_FLAG_LSE_BASE2) == 0, MLA_ERR_INVALID_ARGUMENT,
              "flags = 0x%x has unknown bits", flags);
  if (num_tokens == 0) return MLA_OK;
  MLA_REQUIRE_PTR(eb, o_parts);
  MLA_REQUIRE_PTR(eb, lse_parts);
  MLA_REQUIRE_PTR(eb, out);
  for (int k = 0; k < num_states; k++) {
    MLA_REQUIRE(eb, o_parts[k] != NULL, MLA_ERR_INVALID_ARGUMENT, "o_parts[%d] is NULL", k);
    MLA_REQUIRE(eb, lse_parts[k] != NULL, MLA_ERR_INVALID_ARGUMENT, "lse_parts[%d] is NULL", k);
  }
  mg_job J = {num_states, num_heads, head_dim, act_dtype, (flags & MLA_FLAG_LSE_BASE2) != 0,
              o_parts, lse_parts, out, lse_out};
  const int64_t rows = (int64_t)num_tokens * num_heads;
  /* about 64 KiB of output per grain */
  int64_t grain = 16384 / head_dim;
  if (grain < 1) grain = 1;
  mla_parallel_for(ctx, rows, grain, merge_rows, &J);
  return MLA_OK;
}
