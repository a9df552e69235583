/* Context, worker pool and workspace carving (src/core). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "test_util.h"

typedef struct {
  atomic_int *hits;
  atomic_int bad_worker;
  int workers;
} cover_arg;

static void mark(void *v, int64_t b, int64_t e, int worker) {
  cover_arg *a = v;
  if (worker < 0 || worker >= a->workers) atomic_fetch_add(&a->bad_worker, 1);
  for (int64_t i = b; i < e; i++) atomic_fetch_add(&a->hits[i], 1);
}

int main(void) {
  tu_rng rng = {tu_seed("test_context", 11)};
  mla_ctx *ctx = NULL;
  TU_STATUS(mla_ctx_create(NULL, &ctx), MLA_OK);
  int n = 0;
  TU_STATUS(mla_ctx_get_threads(ctx, &n), MLA_OK);
  TU_CHECK(n >= 1, "threads = %d", n);

  /* parallel_for covers [0, n) exactly once for any size, grain and thread count. */
  int threads[] = {1, 2, 3, 8};
  for (int ti = 0; ti < 4; ti++) {
    TU_STATUS(mla_ctx_set_threads(ctx, threads[ti]), MLA_OK);
    int workers = mla_ctx_workers(ctx);
    TU_CHECK(workers == threads[ti], "workers %d != %d", workers, threads[ti]);
    for (int rep = 0; rep < 40; rep++) {
      int64_t len = tu_randint(&rng, 0, 5000);
      int64_t grain = tu_randint(&rng, 0, 300);
      atomic_int *hits = calloc((size_t)len + 1, sizeof *hits);
      cover_arg a = {hits, 0, workers};
      mla_parallel_for(ctx, len, grain, mark, &a);
      int bad = 0;
      for (int64_t i = 0; i < len; i++) bad += atomic_load(&hits[i]) != 1;
      TU_CHECK(bad == 0 && atomic_load(&a.bad_worker) == 0,
               "threads %d len %lld grain %lld: %d indices not covered once", threads[ti],
               (long long)len, (long long)grain, bad);
      free(hits);
    }
  }
  /* NULL ctx runs serially. */
  atomic_int h2[10] = {0};
  cover_arg a2 = {h2, 0, 1};
  mla_parallel_for(NULL, 10, 1, mark, &a2);
  TU_CHECK(atomic_load(&h2[9]) == 1, "serial parallel_for");

  /* Bad arguments. */
  TU_STATUS(mla_ctx_create(NULL, NULL), MLA_ERR_INVALID_ARGUMENT);
  mla_ctx_desc d = {MLA_DEVICE_CPU, -1, 0};
  mla_ctx *c2 = (mla_ctx *)&d;
  TU_STATUS(mla_ctx_create(&d, &c2), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(c2 == NULL, "output cleared on failure");
  d.num_threads = 1;
  d.device = (mla_device)7;
  TU_STATUS(mla_ctx_create(&d, &c2), MLA_ERR_INVALID_ARGUMENT);
  d.device = MLA_DEVICE_CUDA;
  /* A CUDA context: UNSUPPORTED without CUDA in the build, DEVICE without a
   * GPU, OK on a GPU machine. */
  mla_status cst = mla_ctx_create(&d, &c2);
  TU_CHECK(cst == MLA_ERR_UNSUPPORTED || cst == MLA_ERR_DEVICE || cst == MLA_OK, "CUDA ctx: %s",
           mla_status_string(cst));
  TU_CHECK((cst == MLA_OK) == (c2 != NULL), "handle only on success");
  if (cst == MLA_OK) {
    mla_device dev = MLA_DEVICE_CPU;
    TU_STATUS(mla_ctx_get_device(c2, &dev), MLA_OK);
    TU_CHECK(dev == MLA_DEVICE_CUDA, "device reported");
    TU_STATUS(mla_ctx_set_stream(c2, NULL), MLA_OK);
    TU_STATUS(mla_ctx_synchronize(c2), MLA_OK);
    mla_ctx_destroy(c2);
    c2 = NULL;
    d.device_id = 999;
    TU_STATUS(mla_ctx_create(&d, &c2), MLA_ERR_OUT_OF_RANGE);
    d.device_id = 0;
  }
  TU_STATUS(mla_ctx_set_stream(ctx, NULL), MLA_ERR_UNSUPPORTED);
  TU_STATUS(mla_ctx_synchronize(ctx), MLA_OK);
  TU_STATUS(mla_ctx_set_threads(ctx, -3), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(strstr(mla_ctx_last_error(ctx), "num_threads") != NULL, "last error names the argument: '%s'",
           mla_ctx_last_error(ctx));
  TU_STATUS(mla_ctx_set_threads(NULL, 1), MLA_ERR_INVALID_ARGUMENT);
  TU_STATUS(mla_ctx_get_threads(ctx, NULL), MLA_ERR_INVALID_ARGUMENT);
  TU_CHECK(mla_ctx_last_error(NULL) != NULL, "last error of NULL");
  mla_ctx_destroy(NULL);

  /* Workspace carving: count mode and carve mode agree, from any base alignment. */
  for (int rep = 0; rep < 50; rep++) {
    size_t sizes[6];
    mla_ws cnt = mla_ws_counter();
    for (int i = 0; i < 6; i++) {
      sizes[i] = (size_t)tu_randint(&rng, 0, 3000);
      TU_CHECK(mla_ws_take(&cnt, sizes[i]) == NULL, "count mode returns NULL");
    }
    size_t total = mla_ws_total(&cnt);
    char *buf = malloc(total + 64);
    size_t shift = (size_t)tu_randint(&rng, 0, 63);
    mla_ws w = mla_ws_over(buf + shift, total);
    char *prev_end = buf + shift;
    int ok = 1;
    for (int i = 0; i < 6; i++) {
      char *p = mla_ws_take(&w, sizes[i]);
      if (!p || ((uintptr_t)p % MLA_WS_ALIGN) != 0 || p < prev_end || p + sizes[i] > buf + shift + total) ok = 0;
      if (p) prev_end = p + sizes[i];
    }
    TU_CHECK(ok && !w.overflow, "carving within the counted size");
    /* One byte short at an aligned base must be reported. */
    if (cnt.used > 0) {
      char *aligned = (char *)(((uintptr_t)buf + MLA_WS_ALIGN - 1) & ~(uintptr_t)(MLA_WS_ALIGN - 1));
      mla_ws small = mla_ws_over(aligned, cnt.used - 1);
      for (int i = 0; i < 6; i++) mla_ws_take(&small, sizes[i]);
      TU_CHECK(small.overflow, "overflow not detected (need %zu, have %zu)", cnt.used, cnt.used - 1);
    }
    free(buf);
  }
  mla_ctx_destroy(ctx);
  return tu_finish("test_context");
}
