/* Raw row copy between two KV caches (mla_kv_cache_pack_rows on CUDA, and
 * the pack step of mla_dcp_gather_kv_nccl). C-callable; kv_pack.cu. */
#ifndef MLA_CUDA_KV_PACK_H
#define MLA_CUDA_KV_PACK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dst_rows [n, row_bytes] (consecutive rows) <- src_layer [src_num_slots,
 * row_bytes] at src_slots [n] (device int32). row_bytes must be a multiple
 * of 16 and both bases 16-byte aligned (every cache row format is). A slot
 * outside [0, src_num_slots) leaves its destination row untouched and is
 * counted into *bad. Returns 0 or a CUDA error code. */
int mla_cuda_kv_pack(const void *src_layer, int64_t src_num_slots, void *dst_rows, size_t row_bytes, int n,
                     const int32_t *src_slots, int *bad, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MLA_CUDA_KV_PACK_H */
