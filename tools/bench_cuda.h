/* `mla bench --device cuda` (bench_cuda.c): the CUDA decode path timed
 * through the public API. */
#ifndef MLA_TOOLS_BENCH_CUDA_H
#define MLA_TOOLS_BENCH_CUDA_H

/* argv holds the options after "bench". Returns the process exit status:
 * 0 = ran, 1 = a call failed, 2 = bad usage or no CUDA device / build. */
int bench_cuda_main(int argc, char **argv);

#endif /* MLA_TOOLS_BENCH_CUDA_H */
