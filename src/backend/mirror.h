/* Device copy of a request table's req_to_token for CUDA backends, kept up
 * to date from the table's changed rows through page-locked staging
 * buffers (stream-ordered: a step already enqueued keeps reading the rows
 * it was planned with). Also stages small host arrays (request ids, lengths)
 * for the kernels. Everything is a no-op stub without CUDA. */
#ifndef MLA_BACKEND_MIRROR_H
#define MLA_BACKEND_MIRROR_H

#include <stddef.h>
#include <stdint.h>

#include "../cache/cache.h"

typedef struct mla_mirror {
  int32_t *d_r2t;         /* [max_reqs, max_context] device */
  void *h_stage[2];       /* page-locked host staging */
  void *d_stage[2];       /* device twins */
  void *ev[2];            /* set when the copy out of h_stage[k] is done */
  int ev_armed[2];
  size_t stage_bytes;
  int cur;                /* staging buffer being filled */
  size_t used;            /* bytes of it filled */
  int32_t *ids, *lo, *hi; /* [max_reqs] scratch for the dirty rows */
} mla_mirror;

/* Allocates the device table (all MLA_SLOT_UNUSED) and the staging; the
 * table's rows written so far are marked for the next sync. */
mla_status mla_mirror_init(mla_mirror *m, mla_req_table *rt, mla_errbuf *eb);
void mla_mirror_free(mla_mirror *m);
/* Enqueues the copy of every row changed since the last sync on stream. */
mla_status mla_mirror_sync(mla_mirror *m, mla_req_table *rt, void *stream, mla_errbuf *eb);
/* Copies n int32 values into staging and returns their device address
 * (valid for kernels enqueued on stream before the next-but-one flush). */
mla_status mla_mirror_stage(mla_mirror *m, const int32_t *src, int n, void *stream, const int32_t **dev,
                            mla_errbuf *eb);

/* Copies n int32 host values to the device array dst (through staging, in
 * stream order; returns once the host values are copied out). */
mla_status mla_mirror_upload(mla_mirror *m, int32_t *dst, const int32_t *src, int64_t n, void *stream,
                             mla_errbuf *eb);

#endif /* MLA_BACKEND_MIRROR_H */
