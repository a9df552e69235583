"""Loading libmla.so and describing its C API to ctypes.

Everything in this module mirrors include/mla.h: the constants, the enum
values, the struct layouts (ctypes.Structure, field for field, in header
order) and each function's argument and return types. The layout test
(python/tests/test_layout.py) compares these structures with what a C
compiler makes of the header, so a drift fails the tests instead of
corrupting memory.
"""

import ctypes
import ctypes.util
import enum
import os

# ---- constants (mla.h) -------------------------------------------------------

LATENT = 512  # MLA_LATENT: latent width = absorbed V width
ROPE = 64  # MLA_ROPE
ROW = 576  # MLA_ROW = LATENT + ROPE
FP8_BLOCK = 128  # MLA_FP8_BLOCK: values per fp32 scale in the block format
FP8_BLOCK_ROW_BYTES = 656  # MLA_FP8_BLOCK_ROW_BYTES
MAX_PAGE_SIZE = 256
MAX_HEADS = 1024
MAX_HEAD_DIM = 256
BLOCK_TABLE_PAD = -1
SLOT_UNUSED = 0
REQ_PAD = -1
SCHED_BLOCK = 64
SCHED_FIXED_OVERHEAD = 5
SCHED_NOCUT_DIV = 16  # a part may take q + q/16 blocks to keep every request whole (mla.h)
SCHED_META_INTS = 8
FLAG_LSE_BASE2 = 1
FLAG_OUT_F32 = 2
FLAG_FP8_MATH = 4  # absorbed attention: fp8 tensor-core math allowed (CUDA, per-tensor fp8 cache)
PLAN_PAGES_ONLY = 1  # mla_plan_limits.flags: no token-level kv_indices
VERSION_MAJOR = 0  # the header this binding was written against
VERSION_MINOR = 2


class Status(enum.IntEnum):
    """mla_status (values pinned by the C API)."""

    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_OUT_OF_RANGE = 2
    ERR_UNSUPPORTED = 3
    ERR_OUT_OF_MEMORY = 4
    ERR_CACHE_FULL = 5
    ERR_WORKSPACE_TOO_SMALL = 6
    ERR_CAPACITY = 7
    ERR_BAD_STATE = 8
    ERR_DEVICE = 9
    ERR_INTERNAL = 10


class DType(enum.IntEnum):
    """mla_dtype."""

    F32 = 0
    BF16 = 1
    F16 = 2
    FP8_E4M3 = 3
    FP8_E4M3_BLOCK = 4
    F64 = 5


class Device(enum.IntEnum):
    """mla_device."""

    CPU = 0
    CUDA = 1


class Mode(enum.IntEnum):
    """mla_mode: the forward mode of a batch."""

    IDLE = 0
    DECODE = 1
    TARGET_VERIFY = 2
    DRAFT_EXTEND = 3
    EXTEND = 4


class ExtendImpl(enum.IntEnum):
    """mla_extend_impl: how the backend runs EXTEND over a cached prefix."""

    ABSORBED = 0
    MHA_CHUNKED = 1


class Sched(enum.IntEnum):
    """Columns of one row of a plan's sched_meta [num_sm_parts, 8]."""

    BEGIN_REQ = 0
    BEGIN_TOK = 1
    END_REQ = 2
    END_TOK = 3
    BEGIN_SPLIT = 4
    NUM_REQS = 5


# ---- structs (field order and types exactly as in mla.h) ----------------------

_i32 = ctypes.c_int32
_int = ctypes.c_int
_enum = ctypes.c_int  # C enums with values 0..10 are int-sized on every ABI we target
_ptr = ctypes.c_void_p


class CtxDesc(ctypes.Structure):
    _fields_ = [("device", _enum), ("num_threads", _int), ("device_id", _int)]


class KVCacheDesc(ctypes.Structure):
    _fields_ = [
        ("num_layers", _int),
        ("num_pages", _int),
        ("page_size", _int),
        ("dtype", _enum),
        ("fp8_scales", _ptr),  # const float * [num_layers]
    ]


class ReqTableDesc(ctypes.Structure):
    _fields_ = [("max_reqs", _int), ("max_context", _int), ("num_pages", _int), ("page_size", _int)]


class Batch(ctypes.Structure):
    _fields_ = [
        ("mode", _enum),
        ("batch_size", _i32),
        ("req_ids", _ptr),  # [bs]
        ("seq_lens", _ptr),  # [bs]
        ("extend_lens", _ptr),  # [bs] or NULL
        ("prefix_lens", _ptr),  # [bs] or NULL
        ("num_draft_tokens", _i32),
    ]


class PlanLimits(ctypes.Structure):
    _fields_ = [
        ("max_bs", _int),
        ("max_q_tokens", _int),
        ("max_kv_tokens", _int),
        ("max_context", _int),
        ("page_size", _int),
        ("num_sm", _int),
        ("flags", ctypes.c_uint),  # MLA_PLAN_*
    ]


class Plan(ctypes.Structure):
    _fields_ = [
        ("mode", _enum),
        ("batch_size", _i32),
        ("num_q_tokens", _i32),
        ("num_kv_tokens", _i32),
        ("max_q_len", _i32),
        ("max_kv_len", _i32),
        ("causal", _i32),
        ("page_size", _i32),
        ("block_table_width", _i32),
        ("num_heads", _i32),
        ("req_ids", _ptr),  # [bs]
        ("qo_indptr", _ptr),  # [bs+1]
        ("kv_indptr", _ptr),  # [bs+1]
        ("kv_lens", _ptr),  # [bs]
        ("kv_indices", _ptr),  # [num_kv_tokens]
        ("page_indptr", _ptr),  # [bs+1]
        ("page_indices", _ptr),  # [page_indptr[bs]]
        ("block_table", _ptr),  # [bs, block_table_width]
        ("num_sm_parts", _i32),
        ("sched_meta", _ptr),  # [num_sm_parts, 8]
        ("num_splits", _ptr),  # [bs+1]
        ("total_splits", _i32),
    ]


class ChunkPlan(ctypes.Structure):
    _fields_ = [
        ("batch_size", _i32),
        ("num_chunks", _i32),
        ("chunk_len", _i32),
        ("starts", _ptr),  # [num_chunks, bs]
        ("lens", _ptr),  # [num_chunks, bs]
        ("cu_seq_lens", _ptr),  # [num_chunks, bs+1]
        ("max_lens", _ptr),  # [num_chunks]
        ("slot_indptr", _ptr),  # [num_chunks+1]
        ("slots", _ptr),  # [slot_indptr[num_chunks]]
    ]


class DraftPlan(ctypes.Structure):
    _fields_ = [
        ("batch_size", _i32),
        ("num_steps", _i32),
        ("kv_indptr", _ptr),  # [num_steps, bs+1]
        ("kv_indices", _ptr),  # [step_offset[num_steps]]
        ("step_offset", _ptr),  # [num_steps+1]
    ]


class DcpPlan(ctypes.Structure):
    _fields_ = [
        ("batch_size", _i32),
        ("rank", _i32),
        ("world", _i32),
        ("kv_lens", _ptr),  # [bs]
        ("kv_indptr", _ptr),  # [bs+1]
        ("kv_indices", _ptr),  # [kv_indptr[bs]]
    ]


class AbsorbedArgs(ctypes.Structure):
    _fields_ = [
        ("num_heads", _int),
        ("scale", ctypes.c_float),
        ("flags", ctypes.c_uint),
        ("act_dtype", _enum),
        ("q_nope", _ptr),  # [Tq, H, 512] at the strides below
        ("q_rope", _ptr),  # [Tq, H, 64]
        ("q_stride_token", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("out", _ptr),  # [Tq, H, 512]
        ("lse", _ptr),  # [Tq, H] or NULL
    ]


class RaggedArgs(ctypes.Structure):
    _fields_ = [
        ("batch_size", _int),
        ("num_heads", _int),
        ("num_kv_heads", _int),
        ("qk_dim", _int),
        ("v_dim", _int),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("causal", _int),
        ("flags", ctypes.c_uint),
        ("act_dtype", _enum),
        ("qo_indptr", _ptr),  # [bs+1]
        ("kv_indptr", _ptr),  # [bs+1]
        ("q", _ptr),  # [Tq, H, qk_dim]
        ("k", _ptr),  # [Tk, Hkv, qk_dim]
        ("v", _ptr),  # [Tk, Hkv, v_dim]
        ("out", _ptr),  # [Tq, H, v_dim]
        ("lse", _ptr),  # [Tq, H] or NULL
        ("workspace", _ptr),  # optional, device: the dynamic item order's counter
        ("workspace_bytes", ctypes.c_size_t),
    ]


class BackendDesc(ctypes.Structure):
    _fields_ = [
        ("cache", KVCacheDesc),
        ("max_reqs", _int),
        ("max_context", _int),
        ("max_bs", _int),
        ("max_q_tokens", _int),
        ("num_heads", _int),
        ("scale", ctypes.c_float),
        ("act_dtype", _enum),
        ("qk_nope_dim", _int),
        ("v_dim", _int),
        ("extend_impl", _enum),
        ("chunk_capacity", _int),
        ("num_sm", _int),
    ]


class ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("layer", _int),
        ("num_new", _int),
        ("new_slots", _ptr),  # [num_new]
        ("new_c", _ptr),  # [num_new, 512]
        ("new_r", _ptr),  # [num_new, 64]
        ("q_nope", _ptr),  # [Tq, H, 512]
        ("q_rope", _ptr),  # [Tq, H, 64]
        ("q", _ptr),  # [Tq, H, nope+64]
        ("k", _ptr),  # [Tq, H, nope+64]
        ("v", _ptr),  # [Tq, H, v_dim]
        ("kv_b_proj", _ptr),  # [H, nope+v_dim, 512]
        ("out", _ptr),  # [Tq, H, 512] absorbed, [Tq, H, v_dim] MHA
        ("lse", _ptr),  # [Tq, H] or NULL
        ("flags", ctypes.c_uint),
    ]


class StepDesc(ctypes.Structure):
    _fields_ = [
        ("mode", _enum),
        ("batch_size", _i32),
        ("num_draft_tokens", _i32),
        ("max_kv_len", _i32),
        ("num_heads", _i32),
        ("page_size", _i32),
        ("num_sm", _i32),
        ("num_steps", _i32),
        ("step", _i32),
        ("dcp_world", _i32),
        ("dcp_rank", _i32),
        ("num_tokens", _i32),  # EXTEND steps: the token bucket
    ]


class StepInputs(ctypes.Structure):
    _fields_ = [
        ("req_to_token", _ptr),  # [max_reqs, req_to_token_stride]
        ("req_to_token_stride", ctypes.c_int64),
        ("max_reqs", _i32),
        ("req_ids", _ptr),  # [bs]
        ("seq_lens", _ptr),  # [bs]
        ("extend_lens", _ptr),  # [bs] EXTEND steps
    ]


class StepMetadata(ctypes.Structure):
    _fields_ = [
        ("batch_size", _i32),
        ("q_len", _i32),
        ("block_table_width", _i32),
        ("num_sm_parts", _i32),
        ("max_splits", _i32),
        ("qo_indptr", _ptr),  # [bs+1]
        ("kv_lens", _ptr),  # [bs]
        ("block_table", _ptr),  # [bs, block_table_width]
        ("sched_meta", _ptr),  # [num_sm_parts, 8]
        ("num_splits", _ptr),  # [bs+1]
    ]


# Every struct the layout test checks against the C compiler, by C name.
STRUCTS = {
    "mla_ctx_desc": CtxDesc,
    "mla_kv_cache_desc": KVCacheDesc,
    "mla_req_table_desc": ReqTableDesc,
    "mla_batch": Batch,
    "mla_plan_limits": PlanLimits,
    "mla_plan": Plan,
    "mla_chunk_plan": ChunkPlan,
    "mla_draft_plan": DraftPlan,
    "mla_dcp_plan": DcpPlan,
    "mla_absorbed_args": AbsorbedArgs,
    "mla_ragged_args": RaggedArgs,
    "mla_backend_desc": BackendDesc,
    "mla_forward_args": ForwardArgs,
    "mla_step_desc": StepDesc,
    "mla_step_inputs": StepInputs,
    "mla_step_metadata": StepMetadata,
}

# ---- function prototypes -------------------------------------------------------

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_S = ctypes.c_int  # mla_status
_SZ = ctypes.POINTER(ctypes.c_size_t)
_PI = ctypes.POINTER(ctypes.c_int)
_PI32 = ctypes.POINTER(ctypes.c_int32)
_STR = ctypes.c_char_p

# name: (restype, argtypes). Pointers to data travel as c_void_p (plain ints).
PROTOTYPES = {
    "mla_version": (ctypes.c_uint, []),
    "mla_version_string": (_STR, []),
    "mla_status_string": (_STR, [_S]),
    "mla_dtype_size": (ctypes.c_size_t, [_enum]),
    "mla_dtype_name": (_STR, [_enum]),
    "mla_convert": (_S, [_P, _enum, _P, _enum, ctypes.c_int64]),
    # context
    "mla_ctx_create": (_S, [ctypes.POINTER(CtxDesc), _PP]),
    "mla_ctx_destroy": (None, [_P]),
    "mla_ctx_set_threads": (_S, [_P, _int]),
    "mla_ctx_get_threads": (_S, [_P, _PI]),
    "mla_ctx_cpu_isa": (_S, [_P, ctypes.POINTER(_STR)]),
    "mla_ctx_last_error": (_STR, [_P]),
    "mla_ctx_get_device": (_S, [_P, _PI]),
    "mla_ctx_set_stream": (_S, [_P, _P]),
    "mla_ctx_synchronize": (_S, [_P]),
    # KV cache
    "mla_kv_cache_create": (_S, [_P, ctypes.POINTER(KVCacheDesc), _PP]),
    "mla_kv_cache_destroy": (None, [_P]),
    "mla_kv_cache_last_error": (_STR, [_P]),
    "mla_kv_cache_get_desc": (_S, [_P, ctypes.POINTER(KVCacheDesc)]),
    "mla_kv_cache_row_bytes": (_S, [_P, _SZ]),
    "mla_kv_cache_layer_data": (_S, [_P, _int, _PP]),
    "mla_kv_cache_set_fp8_scale": (_S, [_P, _int, ctypes.c_float]),
    "mla_kv_cache_write": (_S, [_P, _int, _int, _P, _P, _P, _enum]),
    "mla_kv_cache_write_shard": (_S, [_P, _int, _int, _P, _P, _P, _enum, _int, _int]),
    "mla_kv_cache_read": (_S, [_P, _int, _int, _P, _P, _P, _enum]),
    "mla_kv_cache_copy_rows": (_S, [_P, _int, _P, _P]),
    # request table
    "mla_req_table_create": (_S, [_P, ctypes.POINTER(ReqTableDesc), _P, _PP]),
    "mla_req_table_destroy": (None, [_P]),
    "mla_req_table_last_error": (_STR, [_P]),
    "mla_req_table_get_desc": (_S, [_P, ctypes.POINTER(ReqTableDesc)]),
    "mla_req_add": (_S, [_P, _PI32]),
    "mla_req_extend": (_S, [_P, ctypes.c_int32, _int, _P]),
    "mla_req_free": (_S, [_P, ctypes.c_int32]),
    "mla_req_fork": (_S, [_P, ctypes.c_int32, _int, _PI32]),
    "mla_req_truncate": (_S, [_P, ctypes.c_int32, _int]),
    "mla_req_length": (_S, [_P, ctypes.c_int32, _PI]),
    "mla_req_is_live": (_S, [_P, ctypes.c_int32, _PI]),
    "mla_req_table_data": (_S, [_P, _PP]),
    "mla_req_table_free_pages": (_S, [_P, _PI]),
    "mla_req_table_page_refs": (_S, [_P, _int, _PI]),
    # plans
    "mla_plan_workspace_size": (_S, [_P, ctypes.POINTER(PlanLimits), _SZ]),
    "mla_plan_build": (
        _S,
        [_P, _P, ctypes.POINTER(Batch), ctypes.POINTER(PlanLimits), _int, _P, ctypes.c_size_t,
         ctypes.POINTER(Plan)],
    ),
    "mla_chunk_plan_workspace_size": (_S, [_P, _int, _int, _int, _SZ]),
    "mla_chunk_plan_build": (
        _S, [_P, _P, _int, _P, _P, _int, _P, ctypes.c_size_t, ctypes.POINTER(ChunkPlan)]),
    "mla_draft_plan_workspace_size": (_S, [_P, _int, _int, _int, _SZ]),
    "mla_draft_plan_build": (
        _S, [_P, _P, _int, _P, _P, _int, _P, ctypes.c_size_t, ctypes.POINTER(DraftPlan)]),
    "mla_dcp_plan_workspace_size": (_S, [_P, _int, _int, _SZ]),
    "mla_dcp_plan_build": (
        _S, [_P, _int, _P, _P, _P, _int, _int, _P, ctypes.c_size_t, ctypes.POINTER(DcpPlan)]),
    # kernels
    "mla_attention_absorbed_workspace_size": (_S, [_P, ctypes.POINTER(Plan), _int, _SZ]),
    "mla_attention_absorbed": (
        _S, [_P, _P, _int, ctypes.POINTER(Plan), ctypes.POINTER(AbsorbedArgs), _P, ctypes.c_size_t]),
    "mla_attention_ragged_workspace_size": (_S, [_P, _SZ]),
    "mla_attention_ragged": (_S, [_P, ctypes.POINTER(RaggedArgs)]),
    "mla_merge_states": (_S, [_P, _int, _int, _int, _int, _enum, ctypes.c_uint, _P, _P, _P, _P]),
    "mla_dcp_merge_workspace_size": (_S, [_P, _int, _int, _int, _int, _enum, _SZ]),
    "mla_dcp_merge_nccl": (_S, [_P, _P, _int, _int, _int, _int, _int, _enum, _P, _P, _P, ctypes.c_size_t, _P,
                                _P]),
    "mla_dcp_gather_table": (_S, [_P, _int, _P, _int, _int, ctypes.c_int64, _P, _PI32]),
    "mla_kv_cache_pack_rows": (_S, [_P, _int, _int, _P, _P, _int, _int]),
    "mla_dcp_gather_kv_nccl": (_S, [_P, _P, _int, _int, _P, _int, _int, _P, _int, _P, _int, _int]),
    "mla_gather_latent": (_S, [_P, _P, _int, _int, _P, _enum, _P, _P]),
    "mla_expand_kv": (_S, [_P, _int, _int, _int, _int, _enum, _enum, _P, _P, _P, _P, _P]),
    # device-built steps
    "mla_step_workspace_size": (_S, [_P, ctypes.POINTER(StepDesc), _SZ]),
    "mla_step_prepare": (
        _S, [_P, ctypes.POINTER(StepDesc), _P, ctypes.POINTER(StepInputs), _P, ctypes.c_size_t]),
    "mla_step_attention": (
        _S, [_P, ctypes.POINTER(StepDesc), _P, _int, ctypes.POINTER(AbsorbedArgs), _P, ctypes.c_size_t]),
    "mla_step_get_metadata": (
        _S, [_P, ctypes.POINTER(StepDesc), _P, ctypes.c_size_t, ctypes.POINTER(StepMetadata)]),
    # backend
    "mla_backend_create": (_S, [_P, ctypes.POINTER(BackendDesc), _PP]),
    "mla_backend_destroy": (None, [_P]),
    "mla_backend_last_error": (_STR, [_P]),
    "mla_backend_cache": (_S, [_P, _PP]),
    "mla_backend_req_table": (_S, [_P, _PP]),
    "mla_backend_plan": (_S, [_P, ctypes.POINTER(Batch)]),
    "mla_backend_get_plan": (_S, [_P, ctypes.POINTER(ctypes.POINTER(Plan))]),
    "mla_backend_forward": (_S, [_P, ctypes.POINTER(ForwardArgs)]),
    "mla_backend_uses_mha": (_S, [_P, _PI]),
    "mla_backend_graph_init": (_S, [_P, _int, _int]),
    "mla_backend_graph_inputs": (_S, [_P, _PP, _PP]),
    "mla_backend_graph_init_extend": (_S, [_P, _int, _PP]),
    "mla_backend_graph_step": (_S, [_P, _enum, _int, _int]),
    "mla_backend_sync": (_S, [_P]),
    "mla_backend_draft_init": (_S, [_P, _int]),
    "mla_backend_draft_prepare": (_S, [_P, _int, _int]),
    "mla_backend_draft_select": (_S, [_P, _int]),
    "mla_backend_step_metadata": (_S, [_P, ctypes.POINTER(StepMetadata)]),
}

# ---- finding and loading the shared library ------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(os.path.dirname(_HERE))  # python/libmla -> repo root


def candidate_paths():
    """Where the library is looked for, in order: (description, path) pairs.

    1. $MLA_LIBRARY (a file path), if set: nothing else is tried then, so a
       test or an engine pins exactly the build it means.
    2. Next to the package: python/libmla/libmla.so, then python/libmla.so.
    3. The README's build directory: <repo>/build/libmla.so.
    4. The system search path (ctypes.util.find_library("mla"), then the
       bare soname for the dynamic loader's LD_LIBRARY_PATH / ld.so.cache).
    """
    env = os.environ.get("MLA_LIBRARY")
    if env:
        return [("$MLA_LIBRARY", env)]
    out = [
        ("next to the package", os.path.join(_HERE, "libmla.so")),
        ("next to the package", os.path.join(os.path.dirname(_HERE), "libmla.so")),
        ("the README's build directory", os.path.join(_REPO_ROOT, "build", "libmla.so")),
    ]
    found = ctypes.util.find_library("mla")
    if found:
        out.append(("the system path (find_library)", found))
    out.append(("the system path (dynamic loader)", "libmla.so.%d" % VERSION_MAJOR))
    out.append(("the system path (dynamic loader)", "libmla.so"))
    return out


def _load():
    tried = []
    for where, path in candidate_paths():
        is_file_path = os.sep in path
        if is_file_path and not os.path.exists(path):
            tried.append("  %s: %s (no such file)" % (where, path))
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("  %s: %s (%s)" % (where, path, e))
    raise ImportError(
        "libmla: cannot load the shared library libmla.so. Build it with\n"
        "  cmake -S . -B build && cmake --build build -j 2\n"
        "from the repository root, or point MLA_LIBRARY at a libmla.so. Tried:\n" + "\n".join(tried)
    )


lib, path = _load()

_missing = []
for _name, (_res, _args) in PROTOTYPES.items():
    _fn = getattr(lib, _name, None)
    if _fn is None:
        # An older library: the binding loads, and the call says what is missing.
        _missing.append(_name)
        continue
    _fn.restype = _res
    _fn.argtypes = _args

version_number = lib.mla_version() if "mla_version" not in _missing else 0
if version_number // 10000 != VERSION_MAJOR:
    raise ImportError(
        "libmla: %s is version %d.%d.%d, this binding needs %d.x"
        % (path, version_number // 10000, version_number // 100 % 100, version_number % 100,
           VERSION_MAJOR)
    )
version = lib.mla_version_string().decode()
missing_functions = tuple(_missing)


def fn(name):
    """The ctypes function `name`, or an error naming the library that lacks it."""
    f = getattr(lib, name, None)
    if f is None or name in missing_functions:
        raise AttributeError("libmla: %s (version %s) has no function %s" % (path, version, name))
    return f


def status_string(st):
    return lib.mla_status_string(int(st)).decode()
