/* The request table's device mirror and the staging ring (mirror.h). */
#include "mirror.h"

#include <stdlib.h>
#include <string.h>

#ifdef MLA_WITH_CUDA
#include "../cuda/runtime.h"

#define NBUF 2
#define STAGE_BYTES ((size_t)4 << 20)

void mla_mirror_free(mla_mirror *m) {
  if (!m) return;
  if (m->d_r2t) mla_cuda_free(m->d_r2t);
  for (int k = 0; k < NBUF; k++) {
    if (m->h_stage[k]) mla_cuda_host_free(m->h_stage[k]);
    if (m->d_stage[k]) mla_cuda_free(m->d_stage[k]);
    if (m->ev[k]) mla_cuda_event_destroy(m->ev[k]);
  }
  free(m->ids);
  free(m->lo);
  free(m->hi);
  memset(m, 0, sizeof *m);
}

mla_status mla_mirror_init(mla_mirror *m, mla_req_table *rt, mla_errbuf *eb) {
  memset(m, 0, sizeof *m);
  const size_t tab = (size_t)rt->max_reqs * (size_t)rt->max_context * sizeof(int32_t);
  int e = mla_cuda_malloc((void **)&m->d_r2t, tab);
  if (!e) e = mla_cuda_memset_async(m->d_r2t, 0, tab, NULL); /* MLA_SLOT_UNUSED */
  m->stage_bytes = STAGE_BYTES;
  for (int k = 0; k < NBUF && !e; k++) {
    e = mla_cuda_host_alloc(&m->h_stage[k], m->stage_bytes);
    if (!e) e = mla_cuda_malloc(&m->d_stage[k], m->stage_bytes);
    if (!e) e = mla_cuda_event_create(&m->ev[k]);
  }
  if (!e) e = mla_cuda_stream_sync(NULL); /* the memset, before any user stream reads the table */
  if (e) {
    mla_mirror_free(m);
    return mla_cuda_fail(eb, "mla_backend_create", "request-table mirror", e);
  }
  m->ids = malloc(sizeof(int32_t) * (size_t)rt->max_reqs);
  m->lo = malloc(sizeof(int32_t) * (size_t)rt->max_reqs);
  m->hi = malloc(sizeof(int32_t) * (size_t)rt->max_reqs);
  if (!m->ids || !m->lo || !m->hi) {
    mla_mirror_free(m);
    return mla_fail(eb, MLA_ERR_OUT_OF_MEMORY, "mla_backend_create", "request-table mirror scratch");
  }
  return MLA_OK;
}

/* The staging buffer to fill next, once the copy out of its last use is done
 * (blocks only when the host is NBUF flushes ahead of the stream). */
static int stage_begin(mla_mirror *m, void **host) {
  const int k = m->cur;
  if (m->ev_armed[k]) {
    int e = mla_cuda_event_sync(m->ev[k]);
    if (e) return e;
    m->ev_armed[k] = 0;
  }
  *host = m->h_stage[k];
  return 0;
}

/* Copies the first `bytes` of the current buffer to its device twin. */
static int stage_end(mla_mirror *m, size_t bytes, void *stream, void **dev) {
  const int k = m->cur;
  int e = mla_cuda_memcpy_async(m->d_stage[k], m->h_stage[k], bytes, stream);
  if (!e) e = mla_cuda_event_record(m->ev[k], stream);
  if (e) return e;
  m->ev_armed[k] = 1;
  *dev = m->d_stage[k];
  m->cur = (k + 1) % NBUF;
  return 0;
}

mla_status mla_mirror_stage(mla_mirror *m, const int32_t *src, int n, void *stream, const int32_t **dev,
                            mla_errbuf *eb) {
  const size_t bytes = sizeof(int32_t) * (size_t)(n > 0 ? n : 1);
  if (bytes > m->stage_bytes)
    return mla_fail(eb, MLA_ERR_CAPACITY, "mla_backend", "%d values exceed the staging buffer", n);
  void *h = NULL, *d = NULL;
  int e = stage_begin(m, &h);
  if (!e) {
    if (n > 0) memcpy(h, src, sizeof(int32_t) * (size_t)n);
    e = stage_end(m, bytes, stream, &d);
  }
  if (e) return mla_cuda_fail(eb, "mla_backend", "staging copy", e);
  *dev = d;
  return MLA_OK;
}

mla_status mla_mirror_upload(mla_mirror *m, int32_t *dst, const int32_t *src, int64_t n, void *stream,
                             mla_errbuf *eb) {
  const int64_t cap = (int64_t)(m->stage_bytes / sizeof(int32_t));
  for (int64_t off = 0; off < n; off += cap) {
    const int64_t k = n - off < cap ? n - off : cap;
    void *h = NULL, *d = NULL;
    int e = stage_begin(m, &h);
    if (!e) {
      memcpy(h, src + off, sizeof(int32_t) * (size_t)k);
      e = stage_end(m, sizeof(int32_t) * (size_t)k, stream, &d);
    }
    if (!e) e = mla_cuda_memcpy_async(dst + off, d, sizeof(int32_t) * (size_t)k, stream);
    if (e) return mla_cuda_fail(eb, "mla_backend", "upload", e);
  }
  return MLA_OK;
}

/* Segment layout in a staging buffer: [cap] int64 dst offsets, [cap] int32
 * src offsets, [cap] int32 counts, then the values. */
#define SEG_CAP 4096

mla_status mla_mirror_sync(mla_mirror *m, mla_req_table *rt, void *stream, mla_errbuf *eb) {
  int n = 0;
  mla_req_table_take_dirty(rt, m->ids, m->lo, m->hi, &n);
  const size_t head = (size_t)SEG_CAP * (8 + 4 + 4);
  const size_t val_cap = (m->stage_bytes - head) / sizeof(int32_t);
  int k = 0;         /* row being copied */
  int32_t pos = n ? m->lo[0] : 0; /* next position of row k */
  while (k < n) {
    void *h = NULL, *d = NULL;
    int e = stage_begin(m, &h);
    if (e) return mla_cuda_fail(eb, "mla_backend", "staging wait", e);
    int64_t *dst_off = (int64_t *)h;
    int32_t *src_off = (int32_t *)(dst_off + SEG_CAP), *count = src_off + SEG_CAP, *vals = count + SEG_CAP;
    int segs = 0;
    size_t used = 0;
    while (k < n && segs < SEG_CAP && used < val_cap) {
      const int32_t id = m->ids[k];
      int32_t hi = m->hi[k];
      if (hi > rt->max_context) hi = rt->max_context;
      int64_t take = hi - pos;
      if (take > (int64_t)(val_cap - used)) take = (int64_t)(val_cap - used);
      if (take > 0) {
        const int64_t off = (int64_t)id * rt->max_context + pos;
        memcpy(vals + used, rt->req_to_token + off, sizeof(int32_t) * (size_t)take);
        dst_off[segs] = off;
        src_off[segs] = (int32_t)used;
        count[segs] = (int32_t)take;
        segs++;
        used += (size_t)take;
        pos += (int32_t)take;
      }
      if (pos >= hi && ++k < n) pos = m->lo[k];
    }
    /* The descriptors are at fixed offsets: copy them and the values used. */
    e = stage_end(m, head + sizeof(int32_t) * used, stream, &d);
    if (!e && segs) {
      const int64_t *d_dst = (const int64_t *)d;
      const int32_t *d_src = (const int32_t *)(d_dst + SEG_CAP), *d_cnt = d_src + SEG_CAP, *d_val = d_cnt + SEG_CAP;
      e = mla_cuda_scatter_segments(m->d_r2t, d_dst, d_src, d_cnt, d_val, segs, stream);
    }
    if (e) return mla_cuda_fail(eb, "mla_backend", "request-table sync", e);
  }
  return MLA_OK;
}

#else /* no CUDA: nothing to mirror */

mla_status mla_mirror_init(mla_mirror *m, mla_req_table *rt, mla_errbuf *eb) {
  (void)rt;
  memset(m, 0, sizeof *m);
  return mla_fail(eb, MLA_ERR_UNSUPPORTED, "mla_backend", "built without CUDA");
}
void mla_mirror_free(mla_mirror *m) { (void)m; }
mla_status mla_mirror_sync(mla_mirror *m, mla_req_table *rt, void *stream, mla_errbuf *eb) {
  (void)m;
  (void)rt;
  (void)stream;
  (void)eb;
  return MLA_OK;
}
mla_status mla_mirror_upload(mla_mirror *m, int32_t *dst, const int32_t *src, int64_t n, void *stream,
                             mla_errbuf *eb) {
  (void)m;
  (void)dst;
  (void)src;
  (void)n;
  (void)stream;
  return mla_fail(eb, MLA_ERR_UNSUPPORTED, "mla_backend", "built without CUDA");
}
mla_status mla_mirror_stage(mla_mirror *m, const int32_t *src, int n, void *stream, const int32_t **dev,
                            mla_errbuf *eb) {
  (void)m;
  (void)src;
  (void)n;
  (void)stream;
  *dev = NULL;
  return mla_fail(eb, MLA_ERR_UNSUPPORTED, "mla_backend", "built without CUDA");
}
#endif
