// Host helpers of the TMA versions (tmap.cu).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <string.h>

#include "../../src/cuda/decode.h"

cudaError_t make_kv_tmap(const mla_decode_params *p, CUtensorMap *map);
// Leading/stride byte offsets of the V view (K tile read as an MN-major B
// operand); the descriptor unit test picks them.
void decode_set_vview(uint32_t lbo, uint32_t sbo);
void decode_get_vview(uint32_t *lbo, uint32_t *sbo);

// Dev-only timing diagnostic: DECODE_NOLOAD=1 makes the TMA versions skip
// every K refill (results are wrong; the time is the compute pipeline alone).
int decode_noload(void);
// Dev-only timing diagnostic: DECODE_NOCOMBINE=1 makes v6+ skip the combine
// launch (split requests then have no output; the time is the split kernel's).
int decode_nocombine(void);
// Dev-only A/B switch: DECODE_PREFETCH=1 turns on the L2 tile prefetch of v9/v10
// (measured slower: 718 vs 557 us at H=128, 380 vs 310 us at H=16; off by default).
int decode_prefetch(void);

// Launchers of the ladder (decode_v*.cu); each runs the split kernel and the combine.
cudaError_t decode_v1_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v2_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v3_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v4_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v5_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v6_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v7_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v8_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v9_launch(const mla_decode_params *p, cudaStream_t stream);
cudaError_t decode_v10_launch(const mla_decode_params *p, cudaStream_t stream);
