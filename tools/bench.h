/* `mla bench`: timing of the attention kernels against the machine's
 * measured peak (see bench.c). */
#ifndef MLA_TOOLS_BENCH_H
#define MLA_TOOLS_BENCH_H

/* argv holds the options after "bench". Returns the process exit status:
 * 0 = ran, 1 = a library call failed, 2 = bad usage or device not available. */
int bench_main(int argc, char **argv);

#endif /* MLA_TOOLS_BENCH_H */
