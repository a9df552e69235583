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

#endif
