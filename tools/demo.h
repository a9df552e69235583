/* `mla demo`: (1) one batch of every forward mode through the backend, each
 * checked against the float64 oracle (demo.c); (2) a serving simulation over
 * a small DeepSeek-shaped layer stack (serve.c). */
#ifndef MLA_TOOLS_DEMO_H
#define MLA_TOOLS_DEMO_H

#include <stdint.h>
#include <stdio.h>

#include "mla.h"

typedef struct demo_opts {
  mla_dtype cache_dtype; /* bf16, f16, fp8_e4m3, fp8_e4m3_block */
  mla_dtype act_dtype;   /* f32, bf16, f16 */
  int page_size;         /* power of two 1..256 */
  /* 0 = the part's own default (table / simulation): */
  int heads;             /* local query heads (16 / 128) */
  int requests;          /* requests in the batch (4) / arriving requests (16) */
  int max_prompt;        /* prompt lengths are drawn from [1, max_prompt] (300 / 160) */
  int threads;           /* 0 = all CPUs */
  uint64_t seed;
  /* Serving simulation (serve.c). */
  int sim;               /* 0 = table only (--no-sim) */
  int layers;            /* layers of the stack */
  int steps;             /* decode steps */
  int hidden;            /* model width */
  int max_batch;         /* requests running at once */
  int draft_tokens;      /* speculative verify: query tokens per round */
  int check_every;       /* oracle check every this many steps */
  mla_extend_impl prefix_impl; /* EXTEND with a shared prefix: absorbed or chunked MHA */
  /* Speculative decoding (--spec): every running request drafts spec_steps
   * tokens with a cheap draft model each step, the target verifies them all
   * in one TARGET_VERIFY batch, the rejected ones are rolled back. */
  int spec;              /* 0 = plain decode steps plus one verifying request */
  int spec_steps;        /* draft tokens per round, 1..16 */
  /* Where the simulation's attention runs: 0 = a CUDA device when this build
   * has CUDA and a GPU is present, else the CPU; 1 = the CPU; 2 = CUDA (an
   * error without one). The table (demo.c) always runs on the CPU. */
  int device;
  int no_graphs;         /* CUDA: plan decode steps eagerly instead of replaying graphs */
} demo_opts;

void demo_default_opts(demo_opts *o);
/* The per-mode table. Returns the number of failed checks (0 = all passed),
 * or -1 when the library refused to run (the message is printed). */
int demo_run(const demo_opts *o, FILE *out);

#endif
