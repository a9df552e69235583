/* Shared helpers of libmla's tests: a seeded RNG, check macros, hostile
 * inputs. Uses the public API only (plus the oracle in tests/ref). */
#ifndef MLA_TEST_UTIL_H
#define MLA_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>

#include "mla.h"
#include "ref.h"

/* ---- results ------------------------------------------------------------ */
/* Each test program counts checks and ends with tu_finish(), which prints
 * "N passed, M failed" and returns the process exit status. */
extern int tu_passed, tu_failed;
#define TU_CHECK(cond, ...)                                           \
  do {                                                                \
    if (cond) {                                                       \
      tu_passed++;                                                    \
    } else {                                                          \
      tu_failed++;                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
    }                                                                 \
  } while (0)
/* Check a call returns the expected status. */
#define TU_STATUS(expr, want)                                                        \
  do {                                                                               \
    mla_status tu_st_ = (expr);                                                      \
    TU_CHECK(tu_st_ == (want), "%s returned %s, expected %s", #expr,                \
             mla_status_string(tu_st_), mla_status_string(want));                  \
  } while (0)
int tu_finish(const char *name);

/* ---- RNG (splitmix64 / xoshiro-style; seed printed by tu_seed) ---------- */
typedef struct tu_rng {
  uint64_t s;
} tu_rng;
/* Seed from $MLA_TEST_SEED or `fallback`; prints "seed = N". */
uint64_t tu_seed(const char *test_name, uint64_t fallback);
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);             /* [0, 1) */
double tu_normal(tu_rng *r);              /* N(0, 1) */
int tu_randint(tu_rng *r, int lo, int hi); /* inclusive */
void tu_shuffle_i32(tu_rng *r, int32_t *a, int n);

/* Fill n bf16-representable values ~ N(0, sigma) as float. */
void tu_fill_bf16_normal(tu_rng *r, float *dst, int64_t n, double sigma);

/* ---- hostile inputs ------------------------------------------------------ */
#define TU_SENTINEL 2147480000 /* written into unused block-table / index entries */
/* Fill every row of every layer of the cache with 0xFF bytes, which is NaN in
 * each cache format (bf16, f16, e4m3 and the block scales). */
int tu_poison_cache(mla_kv_cache *cache);
/* Fill a buffer with 0xFF bytes (NaN for f32/bf16/f16 outputs). */
void tu_poison(void *p, size_t bytes);
/* 1 when every byte is still 0xFF (nothing wrote there). */
int tu_all_poisoned(const void *p, size_t bytes);
/* Bytes per element of an activation dtype (F32/BF16/F16). */
size_t tu_act_size(mla_dtype t);
/* x rounded to what dtype t (F32/BF16/F16) holds, by the oracle's rounding. */
double tu_round_to(mla_dtype t, double x);
/* A bf16 value (its bits) as float (exact). */
float tu_bf16_to_f32(uint16_t h);

/* Convert between float and an activation dtype buffer (F32/BF16/F16). */
void tu_to_dtype(mla_dtype t, const float *src, void *dst, int64_t n);
void tu_from_dtype(mla_dtype t, const void *src, double *dst, int64_t n);

/* Path of a golden case: $MLA_GOLDEN_DIR/<name> or MLA_GOLDEN_DIR (compiled in). */
const char *tu_golden_path(const char *name, char *buf, size_t len);
#endif
