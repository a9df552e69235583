/* Building blocks of the tests' paged "worlds": requests whose pages are
 * scattered and interleaved in a cache, the rows they own filled with random
 * values, the block table guarded past each request, and q in an activation
 * dtype. Each test keeps its own lengths, dtypes and oracle. */
#ifndef MLA_TEST_PAGED_WORLD_H
#define MLA_TEST_PAGED_WORLD_H

#include <stdint.h>

#include "mla.h"
#include "test_util.h"

/* Adds bs requests to an empty table and grows request i to kv_len[i] rows.
 * First npad padding requests take one page each and are freed in a shuffled
 * order, so the free list is scattered; then the requests grow in random
 * interleaved steps of 1..step_cap rows, so their pages alternate.
 * req_ids: [bs] out. Returns 0, or -1 after a failed check. */
int tu_grow_requests(tu_rng *r, mla_req_table *rt, int bs, const int *kv_len, int npad, int page_size,
                     int step_cap, int32_t *req_ids);

/* Writes c, r ~ N(0, 1) as f32 into the rows the requests own (layer 0; the
 * cache quantizes them) and returns what the cache then holds, each value
 * rounded to `operand` (MLA_DTYPE_F32: as read back), in request order:
 * *c_d [Tk + 1, 512], *r_d [Tk + 1, 64] (malloc'd; Tk = sum of kv_len may be
 * 0). maxkv: the table's row width (its max_context). Returns 0 or -1. */
int tu_fill_owned_rows(tu_rng *r, mla_kv_cache *cache, const mla_req_table *rt, int bs, const int32_t *req_ids,
                       const int *kv_len, int maxkv, mla_dtype operand, double **c_d, double **r_d);

/* Sets the plan's block-table entries past each request's pages to
 * TU_SENTINEL: a kernel that reads one goes out of range loudly. */
void tu_guard_block_table(mla_plan *plan, int bs, const int *kv_len, int page_size);

/* q for nq (token, head) rows in dtype act: *qn [nq + 1, 512], *qr [nq + 1, 64]
 * (malloc'd), values N(0, 1), first rounded to bf16 when bf16_values; and the
 * doubles the oracle reads: *qn_d, *qr_d (what the act-dtype arrays hold). */
void tu_make_q(tu_rng *r, mla_dtype act, int64_t nq, int bf16_values, void **qn, void **qr, double **qn_d,
               double **qr_d);

/* Softmax of one (query, head) row over its vis visible keys in float64:
 * p[j] = exp(s_j - max) / sum with s_j = scale (qn . c_j + qr . r_j).
 * qn [512], qr [64]; c [vis, 512], r [vis, 64] (the row's keys in order);
 * p [vis] out. Returns the natural-log lse (-inf when vis <= 0). */
double tu_row_softmax(const double *qn, const double *qr, const double *c, const double *r, int vis, double scale,
                      double *p);

/* bound[d] += unit * sum_j p[j] |c_j[d]|: how far rounding P to a type of unit
 * roundoff `unit` (2^-8 bf16, 2^-11 f16) before P.V can move each output
 * element. p [vis] (tu_row_softmax), c [vis, 512], bound [512]. */
void tu_p_round_bound(const double *p, const double *c, int vis, double unit, double *bound);

#endif
