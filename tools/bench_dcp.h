/* `mla bench --dcp N` (bench_dcp.c): decode context parallel on N GPUs
 * (mla_step_* with dcp_world = N + mla_dcp_merge_nccl) against one GPU. */
#ifndef MLA_TOOLS_BENCH_DCP_H
#define MLA_TOOLS_BENCH_DCP_H

/* argv holds the options after "bench". Returns the process exit status:
 * 0 = ran, 1 = a call failed, 2 = bad usage or too few GPUs / no CUDA or
 * NCCL in the build. */
int bench_dcp_main(int argc, char **argv);

#endif /* MLA_TOOLS_BENCH_DCP_H */
