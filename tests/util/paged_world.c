/* Building blocks of the tests' paged worlds (paged_world.h). */
#include "paged_world.h"

#include <math.h>
#include <stdlib.h>

int tu_grow_requests(tu_rng *r, mla_req_table *rt, int bs, const int *kv_len, int npad, int page_size,
                     int step_cap, int32_t *req_ids) {
  int32_t *pad = malloc(sizeof(int32_t) * (size_t)(npad + 1));
  int *have = calloc((size_t)bs + 1, sizeof(int));
  int rc = 0;
  for (int p = 0; p < npad; p++) {
    mla_req_add(rt, &pad[p]);
    mla_req_extend(rt, pad[p], page_size, NULL);
  }
  tu_shuffle_i32(r, pad, npad);
  for (int p = 0; p < npad; p++) mla_req_free(rt, pad[p]);
  for (int i = 0; i < bs; i++) TU_STATUS(mla_req_add(rt, &req_ids[i]), MLA_OK);
  for (int left = 1; left && rc == 0;) {
    left = 0;
    for (int i = 0; i < bs; i++) {
      const int n = kv_len[i] - have[i];
      if (n <= 0) continue;
      const int step = tu_randint(r, 1, n < step_cap ? n : step_cap);
      if (mla_req_extend(rt, req_ids[i], step, NULL) != MLA_OK) {
        TU_CHECK(0, "mla_req_extend: %s", mla_req_table_last_error(rt));
        rc = -1;
        break;
      }
      have[i] += step;
      left |= have[i] < kv_len[i];
    }
  }
  free(pad);
  free(have);
  return rc;
}

int tu_fill_owned_rows(tu_rng *r, mla_kv_cache *cache, const mla_req_table *rt, int bs, const int32_t *req_ids,
                       const int *kv_len, int maxkv, mla_dtype operand, double **c_d, double **r_d) {
  int64_t tk = 0;
  for (int i = 0; i < bs; i++) tk += kv_len[i];
  const int32_t *r2t = NULL;
  mla_req_table_data(rt, &r2t);
  int32_t *slots = malloc(sizeof(int32_t) * (size_t)(tk + 1));
  int64_t k = 0;
  for (int i = 0; i < bs; i++)
    for (int j = 0; j < kv_len[i]; j++) slots[k++] = r2t[(size_t)req_ids[i] * (size_t)maxkv + (size_t)j];
  float *cf = malloc(sizeof(float) * (size_t)(tk + 1) * MLA_LATENT);
  float *rf = malloc(sizeof(float) * (size_t)(tk + 1) * MLA_ROPE);
  for (int64_t i = 0; i < tk * MLA_LATENT; i++) cf[i] = (float)tu_normal(r);
  for (int64_t i = 0; i < tk * MLA_ROPE; i++) rf[i] = (float)tu_normal(r);
  *c_d = malloc(sizeof(double) * (size_t)(tk + 1) * MLA_LATENT);
  *r_d = malloc(sizeof(double) * (size_t)(tk + 1) * MLA_ROPE);
  int rc = 0;
  if (tk > 0) {
    mla_status st = mla_kv_cache_write(cache, 0, (int)tk, slots, cf, rf, MLA_DTYPE_F32);
    TU_STATUS(st, MLA_OK);
    if (st == MLA_OK) {
      st = mla_kv_cache_read(cache, 0, (int)tk, slots, cf, rf, MLA_DTYPE_F32);
      TU_STATUS(st, MLA_OK);
    }
    rc = st == MLA_OK ? 0 : -1;
    for (int64_t i = 0; i < tk * MLA_LATENT; i++) (*c_d)[i] = tu_round_to(operand, cf[i]);
    for (int64_t i = 0; i < tk * MLA_ROPE; i++) (*r_d)[i] = tu_round_to(operand, rf[i]);
  }
  free(slots);
  free(cf);
  free(rf);
  return rc;
}

void tu_guard_block_table(mla_plan *plan, int bs, const int *kv_len, int page_size) {
  int32_t *bt = (int32_t *)plan->block_table;
  const int width = plan->block_table_width;
  for (int i = 0; i < bs; i++)
    for (int j = (kv_len[i] + page_size - 1) / page_size; j < width; j++) bt[(size_t)i * width + j] = TU_SENTINEL;
}

void tu_make_q(tu_rng *r, mla_dtype act, int64_t nq, int bf16_values, void **qn, void **qr, double **qn_d,
               double **qr_d) {
  const size_t es = tu_act_size(act);
  float *tmp = malloc(sizeof(float) * (size_t)(nq + 1) * MLA_LATENT);
  *qn = malloc(es * (size_t)(nq + 1) * MLA_LATENT);
  *qr = malloc(es * (size_t)(nq + 1) * MLA_ROPE);
  *qn_d = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_LATENT);
  *qr_d = malloc(sizeof(double) * (size_t)(nq + 1) * MLA_ROPE);
  void *dst[2] = {*qn, *qr};
  double *dst_d[2] = {*qn_d, *qr_d};
  const int64_t n[2] = {nq * MLA_LATENT, nq * MLA_ROPE};
  for (int part = 0; part < 2; part++) {
    if (bf16_values) tu_fill_bf16_normal(r, tmp, n[part], 1.0);
    else
      for (int64_t i = 0; i < n[part]; i++) tmp[i] = (float)tu_normal(r);
    tu_to_dtype(act, tmp, dst[part], n[part]);
    tu_from_dtype(act, dst[part], dst_d[part], n[part]);
  }
  free(tmp);
}

double tu_row_softmax(const double *qn, const double *qr, const double *c, const double *r, int vis, double scale,
                      double *p) {
  double mx = -INFINITY, sum = 0;
  for (int j = 0; j < vis; j++) {
    double a = 0;
    for (int d = 0; d < MLA_LATENT; d++) a += qn[d] * c[(size_t)j * MLA_LATENT + d];
    for (int d = 0; d < MLA_ROPE; d++) a += qr[d] * r[(size_t)j * MLA_ROPE + d];
    p[j] = a * scale;
    if (p[j] > mx) mx = p[j];
  }
  if (vis <= 0) return -INFINITY;
  for (int j = 0; j < vis; j++) sum += (p[j] = exp(p[j] - mx));
  for (int j = 0; j < vis; j++) p[j] /= sum;
  return mx + log(sum);
}

void tu_p_round_bound(const double *p, const double *c, int vis, double unit, double *bound) {
  for (int j = 0; j < vis; j++) {
    const double w = unit * p[j];
    for (int d = 0; d < MLA_LATENT; d++) bound[d] += w * fabs(c[(size_t)j * MLA_LATENT + d]);
  }
}
