/* Device side of mla_step_prepare (step.cu). Plain C. */
#ifndef MLA_CUDA_STEP_H
#define MLA_CUDA_STEP_H

#include <stdint.h>

#include "../plan/step_build.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest batch the schedule kernel takes (its kv lengths sit in shared
 * memory); src/plan/step.c refuses larger steps on every device. */
#define MLA_CUDA_STEP_MAX_BS 8192

/* Enqueues on `stream` (a cudaStream_t): one block per row builds its kv
 * length and block-table row; then one block turns EXTEND query counts into
 * qo_indptr and runs the split schedule over the lengths. Rows found out of
 * range get kv length 0 (and no queries) and are added to *bad (a device
 * int), as is an EXTEND batch over its token bound (then every row is
 * emptied). Between the two (not in EXTEND), a grid of blocks evaluates the
 * schedule's candidate budgets at once into sched_probe, which the schedule
 * block reads instead of trying them one after another. All pointers are
 * device memory. Returns 0 or a CUDA error. */
int mla_cuda_step_build(const mla_step_geom *g, const int32_t *req_to_token /* [max_reqs, stride] */,
                        const int32_t *req_ids /* [bs] */, const int32_t *seq_lens /* [bs] */,
                        const int32_t *extend_lens /* [bs] (EXTEND steps; else NULL) */,
                        int32_t *qo_indptr /* [bs+1] */, int32_t *kv_lens /* [bs] */,
                        int32_t *block_table /* [bs, width] */, int32_t *sched_meta /* [parts, 8] */,
                        int32_t *num_splits /* [bs+1] */,
                        int32_t *sched_probe /* [MLA_STEP_SCHED_PROBES, 3]: scratch */, int *bad, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_STEP_H */
