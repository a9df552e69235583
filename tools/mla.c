/* The `mla` command-line tool. Uses only the public API (and the oracle). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "demo.h"
#include "mla.h"
#include "serve.h"
#include "serve_dcp.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: mla <command> [options]\n"
          "\n"
          "commands:\n"
          "  demo        run one batch of every forward mode through the backend on the CPU,\n"
          "              check each against the float64 oracle and print a table; then\n"
          "              simulate serving a small DeepSeek-shaped model (requests arriving,\n"
          "              prefix sharing, continuous batching, speculative verify) with its\n"
          "              attention on a GPU when one is present (CUDA graphs for decode),\n"
          "              else on the CPU, checking a sampled layer against the oracle every\n"
          "              few steps\n"
          "  bench       time the CPU kernels against the measured peak\n"
          "              (mla bench --help for its options)\n"
          "  --help, -h  this text\n"
          "  --version   library version\n"
          "\n"
          "demo options:\n"
          "  --dtype D        cache dtype: bf16 (default), f16, fp8, fp8-block\n"
          "  --act D          activation dtype: bf16 (default), f16, f32\n"
          "  --page-size P    page size, power of two 1..256 (default 64)\n"
          "  --heads H        query heads 1..1024 (default: table 16, simulation 128)\n"
          "  --requests N     1..1024: table, requests per batch (default 4, at most 64 used);\n"
          "                   simulation, requests arriving over time (default 16)\n"
          "  --max-prompt N   longest prompt 1..8192 (default: table 300, simulation 160)\n"
          "  --threads N      CPU threads, 0 = all (default 0)\n"
          "  --no-sim         the table only\n"
          "  --layers N       simulation: layers 1..64 (default 3)\n"
          "  --steps N        simulation: decode steps 1..100000 (default 32)\n"
          "  --hidden N       simulation: model width 64..16384 (default 512)\n"
          "  --max-batch N    simulation: requests running at once 1..256 (default 8)\n"
          "  --draft-tokens N simulation: verify tokens per round 1..16, 1 = no verify (default 4)\n"
          "  --check-every N  simulation: oracle check every N steps (default 4)\n"
          "  --prefix-impl I  simulation: EXTEND with a shared prefix: absorbed (default) or chunked\n"
          "  --spec           simulation: speculative decoding for every running request: draft\n"
          "                   tokens with a one-layer draft model (multi-step draft), verify them\n"
          "                   in one TARGET_VERIFY batch, roll back the rejected ones\n"
          "  --spec-steps N   --spec: draft tokens per round 1..16 (default 3)\n"
          "  --device D       simulation: where attention runs: auto (default: a GPU when this build\n"
          "                   has CUDA and one is present, else the CPU), cpu, cuda\n"
          "  --no-graphs      simulation on CUDA: plan decode steps eagerly instead of replaying\n"
          "                   CUDA graphs\n"
          "  --dcp N          simulation: decode context parallel on N GPUs (power of two 2..8, at\n"
          "                   most the GPUs present; needs CUDA and NCCL, else exit status 2): each\n"
          "                   GPU holds its shard of the KV (position p on GPU p mod N); DECODE runs\n"
          "                   as DCP steps merged over NCCL, TARGET_VERIFY and prefix EXTEND as an\n"
          "                   EXTEND over the KV all-gathered over NCCL; page size x N <= 256; no\n"
          "                   CUDA graphs\n"
          "  --seed S         RNG seed (default 1)\n");
}

/* Parse a whole decimal integer within [lo, hi]. */
static int parse_int(const char *s, long lo, long hi, long *v) {
  if (!s || !*s) return 0;
  char *end = NULL;
  errno = 0;
  long x = strtol(s, &end, 10);
  if (errno || *end || x < lo || x > hi) return 0;
  *v = x;
  return 1;
}

static int parse_dtype(const char *s, mla_dtype *t, int cache) {
  if (!s) return 0;
  if (!strcmp(s, "bf16")) *t = MLA_DTYPE_BF16;
  else if (!strcmp(s, "f16") || !strcmp(s, "fp16")) *t = MLA_DTYPE_F16;
  else if (cache && (!strcmp(s, "fp8") || !strcmp(s, "fp8-e4m3"))) *t = MLA_DTYPE_FP8_E4M3;
  else if (cache && !strcmp(s, "fp8-block")) *t = MLA_DTYPE_FP8_E4M3_BLOCK;
  else if (!cache && (!strcmp(s, "f32") || !strcmp(s, "fp32"))) *t = MLA_DTYPE_F32;
  else return 0;
  return 1;
}

static int bad(const char *what, const char *value) {
  fprintf(stderr, "mla: invalid %s '%s'\n\n", what, value ? value : "(missing)");
  usage(stderr);
  return 2;
}

static int cmd_demo(int argc, char **argv) {
  demo_opts o;
  demo_default_opts(&o);
  int dcp = 0;
  for (int i = 0; i < argc; i++) {
    const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    long x;
    if (!strcmp(k, "--no-sim")) { /* the flags without a value */
      o.sim = 0;
      continue;
    }
    if (!strcmp(k, "--spec")) {
      o.spec = 1;
      continue;
    }
    if (!strcmp(k, "--no-graphs")) {
      o.no_graphs = 1;
      continue;
    }
    if (!strcmp(k, "--dtype")) {
      if (!parse_dtype(v, &o.cache_dtype, 1)) return bad("--dtype", v);
    } else if (!strcmp(k, "--act")) {
      if (!parse_dtype(v, &o.act_dtype, 0)) return bad("--act", v);
    } else if (!strcmp(k, "--page-size")) {
      if (!parse_int(v, 1, 256, &x) || (x & (x - 1))) return bad("--page-size", v);
      o.page_size = (int)x;
    } else if (!strcmp(k, "--heads")) {
      if (!parse_int(v, 1, 1024, &x)) return bad("--heads", v);
      o.heads = (int)x;
    } else if (!strcmp(k, "--requests")) {
      if (!parse_int(v, 1, 1024, &x)) return bad("--requests", v);
      o.requests = (int)x;
    } else if (!strcmp(k, "--max-prompt")) {
      if (!parse_int(v, 1, 8192, &x)) return bad("--max-prompt", v);
      o.max_prompt = (int)x;
    } else if (!strcmp(k, "--threads")) {
      if (!parse_int(v, 0, 1024, &x)) return bad("--threads", v);
      o.threads = (int)x;
    } else if (!strcmp(k, "--seed")) {
      if (!parse_int(v, 0, 2147483647L, &x)) return bad("--seed", v);
      o.seed = (uint64_t)x;
    } else if (!strcmp(k, "--layers")) {
      if (!parse_int(v, 1, 64, &x)) return bad("--layers", v);
      o.layers = (int)x;
    } else if (!strcmp(k, "--steps")) {
      if (!parse_int(v, 1, 100000, &x)) return bad("--steps", v);
      o.steps = (int)x;
    } else if (!strcmp(k, "--hidden")) {
      if (!parse_int(v, 64, 16384, &x)) return bad("--hidden", v);
      o.hidden = (int)x;
    } else if (!strcmp(k, "--max-batch")) {
      if (!parse_int(v, 1, 256, &x)) return bad("--max-batch", v);
      o.max_batch = (int)x;
    } else if (!strcmp(k, "--draft-tokens")) {
      if (!parse_int(v, 1, 16, &x)) return bad("--draft-tokens", v);
      o.draft_tokens = (int)x;
    } else if (!strcmp(k, "--check-every")) {
      if (!parse_int(v, 1, 100000, &x)) return bad("--check-every", v);
      o.check_every = (int)x;
    } else if (!strcmp(k, "--spec-steps")) {
      if (!parse_int(v, 1, 16, &x)) return bad("--spec-steps", v);
      o.spec_steps = (int)x;
    } else if (!strcmp(k, "--device")) {
      if (v && !strcmp(v, "auto")) o.device = 0;
      else if (v && !strcmp(v, "cpu")) o.device = 1;
      else if (v && !strcmp(v, "cuda")) o.device = 2;
      else return bad("--device", v);
    } else if (!strcmp(k, "--dcp")) {
      if (!parse_int(v, 2, SDCP_MAX_RANKS, &x) || (x & (x - 1))) return bad("--dcp", v);
      dcp = (int)x;
    } else if (!strcmp(k, "--prefix-impl")) {
      if (v && !strcmp(v, "absorbed")) o.prefix_impl = MLA_EXTEND_ABSORBED;
      else if (v && !strcmp(v, "chunked")) o.prefix_impl = MLA_EXTEND_MHA_CHUNKED;
      else return bad("--prefix-impl", v);
    } else {
      return bad("option", k);
    }
    i++; /* every option takes a value */
  }
  if (o.spec && !o.sim) return bad("option", "--spec with --no-sim (--spec is a simulation mode)");
  if (dcp) { /* refused before anything runs: exit status 2, as a bad option */
    char why[256] = "";
    const int host = serve_dcp_host();
    if (!o.sim) snprintf(why, sizeof why, "--dcp is a simulation mode (not with --no-sim)");
    else if (o.page_size * dcp > 256)
      snprintf(why, sizeof why, "page size %d x %d ranks = %d: the request table's page (at most 256)", o.page_size,
               dcp, o.page_size * dcp);
    else if (!host && o.device == 1) snprintf(why, sizeof why, "--device cpu: decode context parallel runs on GPUs");
    else if (!host && o.act_dtype == MLA_DTYPE_F32)
      snprintf(why, sizeof why, "--act f32: the GPU prefill kernels take bf16 or f16 activations");
    else if (!host) sdcp_available(dcp, why, sizeof why);
    if (why[0]) {
      fprintf(stderr, "mla demo: --dcp %d: %s\n", dcp, why);
      return 2;
    }
  }
  int failed = demo_run(&o, stdout);
  if (failed >= 0 && o.sim) {
    fflush(stdout);
    int sim_failed = serve_run_dcp(&o, dcp, stdout);
    failed = sim_failed < 0 ? -1 : failed + sim_failed;
  }
  if (failed < 0) return 1;
  return failed ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(cmd, "--version")) {
    printf("mla %s (libmla %s)\n", MLA_VERSION_NUMBER == mla_version() ? mla_version_string() : "?",
           mla_version_string());
    return 0;
  }
  if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
  if (!strcmp(cmd, "bench")) return bench_main(argc - 2, argv + 2);
  fprintf(stderr, "mla: unknown command '%s'\n\n", cmd);
  usage(stderr);
  return 2;
}
