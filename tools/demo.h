/* `mla demo`: one batch of every forward mode through the backend, each
 * checked against the float64 oracle. */
#ifndef MLA_TOOLS_DEMO_H
#define MLA_TOOLS_DEMO_H

#include <stdint.h>
#include <stdio.h>

#include "mla.h"

typedef struct demo_opts {
  mla_dtype cache_dtype; /* bf16, f16, fp8_e4m3, fp8_e4m3_block */
  mla_dtype act_dtype;   /* f32, bf16, f16 */
  int page_size;         /* power of two 1..256 */
  int heads;             /* local query heads */
  int requests;          /* requests in the batch */
  int max_prompt;        /* prompt lengths are drawn from [1, max_prompt] */
  int threads;           /* 0 = all CPUs */
  uint64_t seed;
} demo_opts;

void demo_default_opts(demo_opts *o);
/* Returns the number of failed checks (0 = all passed), or -1 when the
 * library refused to run (the message is printed). */
int demo_run(const demo_opts *o, FILE *out);

#endif
