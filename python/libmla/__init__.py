"""libmla: Multi-head Latent Attention for serving engines, from Python.

A pure-Python binding (ctypes) over the C library libmla.so. It finds the
library via $MLA_LIBRARY, next to the package, in the repository's build/
directory, or on the system path (ImportError listing what was tried when
none loads). numpy is required; torch is optional and never imported here:
torch tensors are recognised by duck typing (data_ptr(), dtype, device,
is_contiguous(), shape) as are numpy arrays (__array_interface__).

    import libmla
    ctx = libmla.Context()                       # CPU, all cores
    be = libmla.Backend(ctx, num_layers=1, num_pages=64, page_size=16, num_heads=8,
                        scale=0.1, max_reqs=8, max_context=512, max_bs=8,
                        max_q_tokens=512, cache_dtype="bf16", act_dtype="f32")

See python/README.md for the functional API, the Backend and
SglangMLABackend, Step (device-built decode steps for CUDA graphs), and
what runs on CUDA contexts.
"""

from . import _lib
from ._lib import (BLOCK_TABLE_PAD, FLAG_FP8_MATH, FLAG_LSE_BASE2, FLAG_OUT_F32, FP8_BLOCK,
                   FP8_BLOCK_ROW_BYTES, LATENT, MAX_HEAD_DIM, MAX_HEADS, MAX_PAGE_SIZE, REQ_PAD, ROPE,
                   ROW, SLOT_UNUSED, DType, Device, ExtendImpl, Mode, Sched, Status)
from .api import (Backend, ChunkPlan, ChunkPlanner, Context, DcpPlan, DcpPlanner, DevicePlan, DraftPlan,
                  DraftPlanner, KVCache, MLAError, Plan, Planner, RequestTable, Step, StepMetadata,
                  attention_absorbed, attention_ragged, batch, bf16_to_f32, convert, dcp_gather_table, dcp_plan,
                  expand_kv, f32_to_bf16, gather_latent, merge_states, plan, ragged_workspace_size)
from .sglang import ForwardBatch, ForwardMode, SglangMLABackend, SglangMLAMultiStepDraftBackend

__version__ = "%d.%d.0" % (_lib.VERSION_MAJOR, _lib.VERSION_MINOR)
library_path = _lib.path  # the libmla.so that was loaded
library_version = _lib.version  # its mla_version_string()

__all__ = [
    "Backend", "ChunkPlan", "ChunkPlanner", "Context", "DType", "DcpPlan", "DcpPlanner", "Device", "DevicePlan",
    "DraftPlan", "DraftPlanner", "ExtendImpl", "ForwardBatch", "ForwardMode", "KVCache", "MLAError",
    "Mode", "Plan", "Planner", "RequestTable", "Sched", "SglangMLABackend", "Step", "StepMetadata",
    "SglangMLAMultiStepDraftBackend", "Status", "attention_absorbed", "attention_ragged", "batch",
    "bf16_to_f32", "convert", "dcp_gather_table", "dcp_plan", "expand_kv", "f32_to_bf16", "gather_latent",
    "merge_states", "plan", "ragged_workspace_size", "LATENT", "ROPE", "ROW", "REQ_PAD", "SLOT_UNUSED", "BLOCK_TABLE_PAD",
    "FLAG_FP8_MATH", "FLAG_LSE_BASE2", "FLAG_OUT_F32", "FP8_BLOCK", "FP8_BLOCK_ROW_BYTES", "MAX_HEADS",
    "MAX_HEAD_DIM", "MAX_PAGE_SIZE", "library_path", "library_version",
]
