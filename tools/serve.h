/* `mla demo`, part 2: a serving simulation. A small DeepSeek-shaped layer
 * stack with random weights (real MLA dims: latent 512, rope 64, qk_nope 128,
 * v 128) serves requests that arrive over time, through one mla_backend:
 * prefill, prefix sharing (forked pages), continuous-batching decode,
 * speculative verify with rollback (or, with --spec, a multi-step draft and
 * one verify batch for every running request), and oracle checks of a
 * sampled layer. */
#ifndef MLA_TOOLS_SERVE_H
#define MLA_TOOLS_SERVE_H

#include <stdio.h>

#include "demo.h"

/* Returns the number of failed checks (0 = all passed), or -1 when the
 * library refused to run (the message is printed). */
int serve_run(const demo_opts *o, FILE *out);
/* The same with decode context parallel over dcp ranks (serve_dcp.h; 0 =
 * off, serve_run). */
int serve_run_dcp(const demo_opts *o, int dcp, FILE *out);
/* 1 when MLA_DEMO_DCP_HOST is set (not "0"): --dcp runs its ranks as CPU
 * contexts in one process, exchanging through host memory, to test the
 * flow on a machine without GPUs. */
int serve_dcp_host(void);

#endif
