/* Shared helpers of libmla's tests (see test_util.h). Public API only: the
 * bf16/f16 conversions are written here again on purpose, so that a test
 * never checks the library with the library's own conversion code. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* tests/CMakeLists.txt defines MLA_GOLDEN_DIR for the test programs (and
 * ctest sets $MLA_GOLDEN_DIR), not for this library; without either, the
 * golden dir is found next to this source file (tests/util/../golden). */
#ifndef MLA_GOLDEN_DIR
#define MLA_GOLDEN_DIR NULL
#endif

int tu_passed = 0, tu_failed = 0;

int tu_finish(const char *name) {
  printf("%s: %d passed, %d failed\n", name ? name : "test", tu_passed, tu_failed);
  fflush(stdout);
  return tu_failed == 0 ? 0 : 1;
}

/* ---- RNG -------------------------------------------------------------------- */
uint64_t tu_seed(const char *test_name, uint64_t fallback) {
  uint64_t seed = fallback;
  const char *env = getenv("MLA_TEST_SEED");
  if (env && *env) {
    char *end;
    unsigned long long v = strtoull(env, &end, 0);
    if (*end == '\0') seed = (uint64_t)v;
    else fprintf(stderr, "%s: ignoring malformed MLA_TEST_SEED '%s'\n", test_name, env);
  }
  /* Rerun a failure with MLA_TEST_SEED=<this value>. */
  printf("%s: seed = %llu\n", test_name ? test_name : "test", (unsigned long long)seed);
  fflush(stdout);
  return seed;
}

/* splitmix64: every seed (0 included) gives a full-period, well-mixed stream. */
uint64_t tu_next(tu_rng *r) {
  uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r) { return (double)(tu_next(r) >> 11) * 0x1.0p-53; }

double tu_normal(tu_rng *r) {
  /* Box-Muller; 1 - u lies in (0, 1] so the log is finite. */
  const double u1 = 1.0 - tu_uniform(r);
  const double u2 = tu_uniform(r);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

int tu_randint(tu_rng *r, int lo, int hi) {
  if (hi <= lo) return lo;
  const uint64_t span = (uint64_t)((int64_t)hi - (int64_t)lo) + 1u;
  return (int)((int64_t)lo + (int64_t)(tu_next(r) % span)); /* bias < 2^-32: irrelevant here */
}

void tu_shuffle_i32(tu_rng *r, int32_t *a, int n) {
  for (int i = n - 1; i > 0; i--) { /* Fisher-Yates */
    int j = tu_randint(r, 0, i);
    int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

/* ---- bf16 / f16 bit conversions (round to nearest even) ------------------- */
static uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

static float bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

static uint16_t tu_f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
  u += 0x7FFFu + ((u >> 16) & 1u); /* carries into the exponent (and to inf) as it should */
  return (uint16_t)(u >> 16);
}

float tu_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static uint16_t tu_f32_to_f16(float x) {
  const uint32_t u = f32_bits(x);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;  /* NaN */
  if (a >= 0x477FF000u) return sign | 0x7C00u; /* >= 65520 (incl. inf) rounds to inf */
  if (a >= 0x38800000u) {                      /* >= 2^-14: normal half */
    uint32_t m = a - (112u << 23);               /* rebias 127 -> 15 */
    m += 0x0FFFu + ((m >> 13) & 1u);             /* nearest even on the 13 dropped bits */
    return (uint16_t)(sign | (m >> 13));
  }
  if (a <= 0x33000000u) return sign; /* <= 2^-25: 2^-25 is a tie that goes to even 0 */
  /* Subnormal half: value / 2^-24 with the implicit bit restored. */
  const uint32_t e = a >> 23; /* 102..112 here */
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e; /* 14..24 */
  uint32_t res = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (res & 1u))) res++; /* may reach 0x400: smallest normal */
  return (uint16_t)(sign | res);
}

static double tu_f16_to_f64(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double v;
  if (e == 0) v = ldexp((double)m, -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = ldexp((double)(m | 0x400), e - 25);
  return (h & 0x8000) ? -v : v;
}

void tu_fill_bf16_normal(tu_rng *r, float *dst, int64_t n, double sigma) {
  for (int64_t i = 0; i < n; i++) dst[i] = tu_bf16_to_f32(tu_f32_to_bf16((float)(sigma * tu_normal(r))));
}

/* ---- hostile inputs ------------------------------------------------------ */
int tu_poison_cache(mla_kv_cache *cache) {
  mla_kv_cache_desc desc;
  size_t row = 0;
  if (!cache || mla_kv_cache_get_desc(cache, &desc) != MLA_OK ||
      mla_kv_cache_row_bytes(cache, &row) != MLA_OK) {
    fprintf(stderr, "tu_poison_cache: cannot query the cache\n");
    return -1;
  }
  const size_t bytes = (size_t)desc.num_pages * (size_t)desc.page_size * row;
  for (int l = 0; l < desc.num_layers; l++) {
    void *data = NULL;
    if (mla_kv_cache_layer_data(cache, l, &data) != MLA_OK || !data) {
      fprintf(stderr, "tu_poison_cache: no data for layer %d\n", l);
      return -1;
    }
    memset(data, 0xFF, bytes);
  }
  return 0;
}

void tu_poison(void *p, size_t bytes) {
  if (p) memset(p, 0xFF, bytes);
}

void tu_to_dtype(mla_dtype t, const float *src, void *dst, int64_t n) {
  switch (t) {
    case MLA_DTYPE_F32:
      memcpy(dst, src, sizeof(float) * (size_t)n);
      break;
    case MLA_DTYPE_BF16:
      for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = tu_f32_to_bf16(src[i]);
      break;
    case MLA_DTYPE_F16:
      for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = tu_f32_to_f16(src[i]);
      break;
    default:
      fprintf(stderr, "tu_to_dtype: unsupported dtype %d\n", (int)t);
      abort(); /* a test bug: stop loudly rather than compare garbage */
  }
}

void tu_from_dtype(mla_dtype t, const void *src, double *dst, int64_t n) {
  switch (t) {
    case MLA_DTYPE_F32:
      for (int64_t i = 0; i < n; i++) dst[i] = (double)((const float *)src)[i];
      break;
    case MLA_DTYPE_BF16:
      for (int64_t i = 0; i < n; i++) dst[i] = (double)tu_bf16_to_f32(((const uint16_t *)src)[i]);
      break;
    case MLA_DTYPE_F16:
      for (int64_t i = 0; i < n; i++) dst[i] = tu_f16_to_f64(((const uint16_t *)src)[i]);
      break;
    default:
      fprintf(stderr, "tu_from_dtype: unsupported dtype %d\n", (int)t);
      abort();
  }
}

const char *tu_golden_path(const char *name, char *buf, size_t len) {
  const char *dir = getenv("MLA_GOLDEN_DIR");
  char here[1024];
  if (!dir || !*dir) dir = MLA_GOLDEN_DIR;
  if (!dir) {
    /* __FILE__ = ".../tests/util/test_util.c": cut after ".../tests/". */
    const char *file = __FILE__, *util = strstr(file, "util/test_util.c");
    size_t cut = util ? (size_t)(util - file) : 0;
    if (util && cut + sizeof("golden") < sizeof(here)) {
      memcpy(here, file, cut);
      strcpy(here + cut, "golden");
      dir = here;
    } else {
      dir = "tests/golden";
    }
  }
  int n = (name && *name) ? snprintf(buf, len, "%s/%s", dir, name) : snprintf(buf, len, "%s", dir);
  if (n < 0 || (size_t)n >= len) {
    fprintf(stderr, "tu_golden_path: buffer of %zu bytes too small\n", len);
    if (len) buf[0] = '\0';
  }
  return buf;
}

int tu_all_poisoned(const void *p, size_t bytes) {
  const unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    if (b[i] != 0xFF) return 0;
  return 1;
}

size_t tu_act_size(mla_dtype t) { return t == MLA_DTYPE_F32 ? 4 : 2; }

double tu_round_to(mla_dtype t, double x) {
  if (t == MLA_DTYPE_BF16) return ref_round_bf16(x);
  if (t == MLA_DTYPE_F16) return ref_round_f16(x);
  return (double)(float)x;
}
