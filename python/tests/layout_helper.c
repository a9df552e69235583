/* Prints what the C compiler makes of include/mla.h: the size of every public
 * struct, the offset and size of each field, and the constants and enum
 * values the Python binding copies. test_layout.py compares this with the
 * ctypes structures of python/libmla/_lib.py, so a change to the header that
 * the binding does not follow fails the tests.
 *
 * Output lines:  struct NAME SIZE / field NAME FIELD OFFSET SIZE / const NAME VALUE */
#include <stddef.h>
#include <stdio.h>

#include <mla.h>

#define S(type) printf("struct %s %zu\n", #type, sizeof(type))
#define F(type, f) \
  printf("field %s %s %zu %zu\n", #type, #f, offsetof(type, f), sizeof(((type *)0)->f))
#define K(name) printf("const %s %lld\n", #name, (long long)(name))

int main(void) {
  S(mla_ctx_desc);
  F(mla_ctx_desc, device);
  F(mla_ctx_desc, num_threads);
  F(mla_ctx_desc, device_id);

  S(mla_kv_cache_desc);
  F(mla_kv_cache_desc, num_layers);
  F(mla_kv_cache_desc, num_pages);
  F(mla_kv_cache_desc, page_size);
  F(mla_kv_cache_desc, dtype);
  F(mla_kv_cache_desc, fp8_scales);

  S(mla_req_table_desc);
  F(mla_req_table_desc, max_reqs);
  F(mla_req_table_desc, max_context);
  F(mla_req_table_desc, num_pages);
  F(mla_req_table_desc, page_size);

  S(mla_batch);
  F(mla_batch, mode);
  F(mla_batch, batch_size);
  F(mla_batch, req_ids);
  F(mla_batch, seq_lens);
  F(mla_batch, extend_lens);
  F(mla_batch, prefix_lens);
  F(mla_batch, num_draft_tokens);

  S(mla_plan_limits);
  F(mla_plan_limits, max_bs);
  F(mla_plan_limits, max_q_tokens);
  F(mla_plan_limits, max_kv_tokens);
  F(mla_plan_limits, max_context);
  F(mla_plan_limits, page_size);
  F(mla_plan_limits, num_sm);
  F(mla_plan_limits, flags);

  S(mla_plan);
  F(mla_plan, mode);
  F(mla_plan, batch_size);
  F(mla_plan, num_q_tokens);
  F(mla_plan, num_kv_tokens);
  F(mla_plan, max_q_len);
  F(mla_plan, max_kv_len);
  F(mla_plan, causal);
  F(mla_plan, page_size);
  F(mla_plan, block_table_width);
  F(mla_plan, num_heads);
  F(mla_plan, req_ids);
  F(mla_plan, qo_indptr);
  F(mla_plan, kv_indptr);
  F(mla_plan, kv_lens);
  F(mla_plan, kv_indices);
  F(mla_plan, page_indptr);
  F(mla_plan, page_indices);
  F(mla_plan, block_table);
  F(mla_plan, num_sm_parts);
  F(mla_plan, sched_meta);
  F(mla_plan, num_splits);
  F(mla_plan, total_splits);

  S(mla_chunk_plan);
  F(mla_chunk_plan, batch_size);
  F(mla_chunk_plan, num_chunks);
  F(mla_chunk_plan, chunk_len);
  F(mla_chunk_plan, starts);
  F(mla_chunk_plan, lens);
  F(mla_chunk_plan, cu_seq_lens);
  F(mla_chunk_plan, max_lens);
  F(mla_chunk_plan, slot_indptr);
  F(mla_chunk_plan, slots);

  S(mla_draft_plan);
  F(mla_draft_plan, batch_size);
  F(mla_draft_plan, num_steps);
  F(mla_draft_plan, kv_indptr);
  F(mla_draft_plan, kv_indices);
  F(mla_draft_plan, step_offset);

  S(mla_dcp_plan);
  F(mla_dcp_plan, batch_size);
  F(mla_dcp_plan, rank);
  F(mla_dcp_plan, world);
  F(mla_dcp_plan, kv_lens);
  F(mla_dcp_plan, kv_indptr);
  F(mla_dcp_plan, kv_indices);

  S(mla_absorbed_args);
  F(mla_absorbed_args, num_heads);
  F(mla_absorbed_args, scale);
  F(mla_absorbed_args, flags);
  F(mla_absorbed_args, act_dtype);
  F(mla_absorbed_args, q_nope);
  F(mla_absorbed_args, q_rope);
  F(mla_absorbed_args, q_stride_token);
  F(mla_absorbed_args, q_stride_head);
  F(mla_absorbed_args, out);
  F(mla_absorbed_args, lse);

  S(mla_ragged_args);
  F(mla_ragged_args, batch_size);
  F(mla_ragged_args, num_heads);
  F(mla_ragged_args, num_kv_heads);
  F(mla_ragged_args, qk_dim);
  F(mla_ragged_args, v_dim);
  F(mla_ragged_args, scale);
  F(mla_ragged_args, softcap);
  F(mla_ragged_args, causal);
  F(mla_ragged_args, flags);
  F(mla_ragged_args, act_dtype);
  F(mla_ragged_args, qo_indptr);
  F(mla_ragged_args, kv_indptr);
  F(mla_ragged_args, q);
  F(mla_ragged_args, k);
  F(mla_ragged_args, v);
  F(mla_ragged_args, out);
  F(mla_ragged_args, lse);
  F(mla_ragged_args, workspace);
  F(mla_ragged_args, workspace_bytes);

  S(mla_backend_desc);
  F(mla_backend_desc, cache);
  F(mla_backend_desc, max_reqs);
  F(mla_backend_desc, max_context);
  F(mla_backend_desc, max_bs);
  F(mla_backend_desc, max_q_tokens);
  F(mla_backend_desc, num_heads);
  F(mla_backend_desc, scale);
  F(mla_backend_desc, act_dtype);
  F(mla_backend_desc, qk_nope_dim);
  F(mla_backend_desc, v_dim);
  F(mla_backend_desc, extend_impl);
  F(mla_backend_desc, chunk_capacity);
  F(mla_backend_desc, num_sm);

  S(mla_forward_args);
  F(mla_forward_args, layer);
  F(mla_forward_args, num_new);
  F(mla_forward_args, new_slots);
  F(mla_forward_args, new_c);
  F(mla_forward_args, new_r);
  F(mla_forward_args, q_nope);
  F(mla_forward_args, q_rope);
  F(mla_forward_args, q);
  F(mla_forward_args, k);
  F(mla_forward_args, v);
  F(mla_forward_args, kv_b_proj);
  F(mla_forward_args, out);
  F(mla_forward_args, lse);
  F(mla_forward_args, flags);

  /* Enum sizes: the binding passes enums as C int. */
  printf("enum mla_status %zu\n", sizeof(mla_status));
  printf("enum mla_dtype %zu\n", sizeof(mla_dtype));
  printf("enum mla_device %zu\n", sizeof(mla_device));
  printf("enum mla_mode %zu\n", sizeof(mla_mode));
  printf("enum mla_extend_impl %zu\n", sizeof(mla_extend_impl));

  S(mla_step_desc);
  F(mla_step_desc, mode);
  F(mla_step_desc, batch_size);
  F(mla_step_desc, num_draft_tokens);
  F(mla_step_desc, max_kv_len);
  F(mla_step_desc, num_heads);
  F(mla_step_desc, page_size);
  F(mla_step_desc, num_sm);
  F(mla_step_desc, num_steps);
  F(mla_step_desc, step);
  F(mla_step_desc, dcp_world);
  F(mla_step_desc, dcp_rank);
  F(mla_step_desc, num_tokens);

  S(mla_step_inputs);
  F(mla_step_inputs, req_to_token);
  F(mla_step_inputs, req_to_token_stride);
  F(mla_step_inputs, max_reqs);
  F(mla_step_inputs, req_ids);
  F(mla_step_inputs, seq_lens);
  F(mla_step_inputs, extend_lens);

  S(mla_step_metadata);
  F(mla_step_metadata, batch_size);
  F(mla_step_metadata, q_len);
  F(mla_step_metadata, block_table_width);
  F(mla_step_metadata, num_sm_parts);
  F(mla_step_metadata, max_splits);
  F(mla_step_metadata, qo_indptr);
  F(mla_step_metadata, kv_lens);
  F(mla_step_metadata, block_table);
  F(mla_step_metadata, sched_meta);
  F(mla_step_metadata, num_splits);

  K(MLA_VERSION_MAJOR);
  K(MLA_VERSION_MINOR);
  K(MLA_LATENT);
  K(MLA_ROPE);
  K(MLA_ROW);
  K(MLA_FP8_BLOCK);
  K(MLA_FP8_BLOCK_ROW_BYTES);
  K(MLA_MAX_PAGE_SIZE);
  K(MLA_MAX_HEADS);
  K(MLA_MAX_HEAD_DIM);
  K(MLA_BLOCK_TABLE_PAD);
  K(MLA_SLOT_UNUSED);
  K(MLA_REQ_PAD);
  K(MLA_SCHED_BLOCK);
  K(MLA_SCHED_FIXED_OVERHEAD);
  K(MLA_SCHED_NOCUT_DIV);
  K(MLA_SCHED_META_INTS);
  K(MLA_FLAG_LSE_BASE2);
  K(MLA_FLAG_OUT_F32);
  K(MLA_FLAG_FP8_MATH);
  K(MLA_PLAN_PAGES_ONLY);
  K(MLA_OK);
  K(MLA_ERR_INVALID_ARGUMENT);
  K(MLA_ERR_OUT_OF_RANGE);
  K(MLA_ERR_UNSUPPORTED);
  K(MLA_ERR_OUT_OF_MEMORY);
  K(MLA_ERR_CACHE_FULL);
  K(MLA_ERR_WORKSPACE_TOO_SMALL);
  K(MLA_ERR_CAPACITY);
  K(MLA_ERR_BAD_STATE);
  K(MLA_ERR_DEVICE);
  K(MLA_ERR_INTERNAL);
  K(MLA_DTYPE_F32);
  K(MLA_DTYPE_BF16);
  K(MLA_DTYPE_F16);
  K(MLA_DTYPE_FP8_E4M3);
  K(MLA_DTYPE_FP8_E4M3_BLOCK);
  K(MLA_DTYPE_F64);
  K(MLA_DEVICE_CPU);
  K(MLA_DEVICE_CUDA);
  K(MLA_MODE_IDLE);
  K(MLA_MODE_DECODE);
  K(MLA_MODE_TARGET_VERIFY);
  K(MLA_MODE_DRAFT_EXTEND);
  K(MLA_MODE_EXTEND);
  K(MLA_EXTEND_ABSORBED);
  K(MLA_EXTEND_MHA_CHUNKED);
  K(MLA_SCHED_BEGIN_REQ);
  K(MLA_SCHED_BEGIN_TOK);
  K(MLA_SCHED_END_REQ);
  K(MLA_SCHED_END_TOK);
  K(MLA_SCHED_BEGIN_SPLIT);
  K(MLA_SCHED_NUM_REQS);
  return 0;
}
