"""SglangMLABackend: libmla shaped like sglang's MLA attention backends.

The method names and arguments follow sglang's attention-backend interface
(init_forward_metadata, forward_decode, forward_extend, the CUDA-graph
init/capture/replay hooks, a multi-step draft backend whose steps are built
in one call) over plain tensors, so an engine author can map one onto the other.
What differs, and why:

* libmla owns the KV cache and req_to_token (its request table with a page
  allocator); the engine asks it for slots (alloc_req / extend_req, the
  slots being out_cache_loc) instead of keeping its own pools.
* Metadata is read from host copies (seq_lens_cpu, extend_prefix_lens_cpu,
  ...) when the batch carries them: eager planning is host work. On a CUDA
  context the library then builds decode-type steps on the device (no host
  plan: forward_metadata.plan is a DevicePlan).
* CUDA graphs run over libmla's graph steps (mla_backend_graph_*): fixed,
  library-owned request-id / length inputs written by the capture / replay
  hooks outside the graph, and the metadata build recorded in the graph by
  the first layer's forward call of each pass. On a CPU context the same
  hooks and calls run eagerly (what CI tests). Padding rows are REQ_PAD rows
  with seq_len 1 that read only the reserved page 0 (their new latent rows
  go to the dummy slot 0). Besides DECODE / TARGET_VERIFY / fixed-window
  DRAFT_EXTEND, EXTEND (the paged absorbed prefill over a cached prefix)
  can be captured per token bucket (init_cuda_graph_state's
  max_extend_tokens; the hooks' num_tokens is the bucket).
* Multi-step drafts run over the C backend's draft steps
  (mla_backend_draft_*) on the same fixed inputs: one prepare builds every
  step, each step's forward selects its own.
"""

import enum
import sys

import numpy as np

from . import _lib
from ._lib import Mode
from ._tensor import inspect
from .api import (Backend, Context, DevicePlan, DraftPlanner, Planner, _BatchArgs,
                  attention_absorbed, mla_dtype, wrap_device_memory)


class ForwardMode(enum.IntEnum):
    """The forward modes (sglang's ForwardMode names; its objects are accepted too, by name)."""

    IDLE = 0
    DECODE = 1
    TARGET_VERIFY = 2
    DRAFT_EXTEND = 3
    EXTEND = 4

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend(self):
        return self == ForwardMode.EXTEND


def _mode_of(fm):
    """libmla Mode of a ForwardMode-like value (ours, sglang's by name, a Mode, or a string)."""
    if isinstance(fm, (ForwardMode, Mode)):
        return Mode(int(fm))
    name = str(getattr(fm, "name", fm)).upper()
    if name.startswith("FORWARDMODE."):
        name = name[12:]
    if name == "IDLE":
        return Mode.IDLE
    if name == "DECODE":
        return Mode.DECODE
    if name == "TARGET_VERIFY":
        return Mode.TARGET_VERIFY
    if name.startswith("DRAFT_EXTEND"):
        return Mode.DRAFT_EXTEND
    if name in ("EXTEND", "MIXED", "PREFILL"):
        return Mode.EXTEND  # MIXED: decode rows are 1-token extends over their prefix
    raise ValueError("forward_mode = %r: not a mode libmla serves" % (fm,))


class ForwardBatch:
    """The fields of sglang's ForwardBatch that the backend reads (plain tensors or lists).

    forward_mode, batch_size, req_pool_indices [bs], seq_lens [bs],
    out_cache_loc [new tokens] (slots of this step's tokens), and per mode:
    extend_prefix_lens / extend_seq_lens [bs] (EXTEND, DRAFT_EXTEND varlen),
    spec_info.draft_token_num or num_draft_tokens (TARGET_VERIFY, fixed
    DRAFT_EXTEND window). *_cpu twins are preferred when present.
    """

    def __init__(self, forward_mode, req_pool_indices=(), seq_lens=(), out_cache_loc=None,
                 batch_size=None, extend_prefix_lens=None, extend_seq_lens=None,
                 num_draft_tokens=None, spec_info=None, seq_lens_cpu=None,
                 extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None):
        self.forward_mode = forward_mode
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.seq_lens_cpu = seq_lens_cpu
        self.out_cache_loc = out_cache_loc
        self.batch_size = len(req_pool_indices) if batch_size is None else batch_size
        self.extend_prefix_lens = extend_prefix_lens
        self.extend_prefix_lens_cpu = extend_prefix_lens_cpu
        self.extend_seq_lens = extend_seq_lens
        self.extend_seq_lens_cpu = extend_seq_lens_cpu
        self.num_draft_tokens = num_draft_tokens
        self.spec_info = spec_info


def _host(x):
    """A host int32 numpy copy of a list / numpy array / (CPU or CUDA) torch tensor."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x.astype(np.int32, copy=False).reshape(-1)
    if hasattr(x, "data_ptr") and hasattr(x, "cpu"):
        x = x.cpu()
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x.tolist()).astype(np.int32).reshape(-1)
    return np.asarray(list(x), dtype=np.int64).astype(np.int32).reshape(-1)


def _field(fb, name):
    v = getattr(fb, name + "_cpu", None)
    return v if v is not None else getattr(fb, name, None)


def _contig(x):
    """A contiguous version of x (a copy only when x is a strided view)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if hasattr(x, "is_contiguous") and not x.is_contiguous():
        return x.contiguous()
    return x


def _cat_last(a, b):
    if isinstance(a, np.ndarray):
        return np.concatenate([a, b], axis=-1)
    torch = sys.modules["torch"]
    return torch.cat([a, b], dim=-1)


def _is_contig(x):
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    if hasattr(x, "is_contiguous"):
        return bool(x.is_contiguous())
    return inspect(x, "q").contiguous


class MLAMetadata:
    """What init_forward_metadata (or a CUDA-graph hook) leaves for the forward calls
    (forward_metadata).

    mode, batch_size, num_q_tokens, padded_rows, uses_mha; graph: the step runs as a graph
    step over the backend's fixed inputs (set by the CUDA-graph hooks). plan: the libmla
    Plan, carrying both families of host metadata a kernel might want (FlashInfer-style
    qo_indptr / kv_indptr / kv_indices, FlashMLA-style block_table / sched_meta / num_splits),
    or a DevicePlan (has_host_plan False: the step's shape, no arrays) when the library built
    the metadata on the device: CUDA decode-type steps and CUDA graph steps (the C backend
    keeps that metadata to itself). On a CPU context a graph step's plan is a host plan of
    the same padded batch, built alongside for inspection (the step equals it bit for bit;
    EXTEND graph steps: equal up to rounding, the step's split schedule being sized for the
    token bucket). num_q_tokens is the rows q and out hold: an EXTEND graph step's token
    bucket (its plan, on the CPU, has only the real extend tokens).
    """

    def __init__(self, mode, plan, uses_mha, padded_rows=0, graph=False, num_q_tokens=None):
        self.mode = mode
        self.plan = plan
        self.uses_mha = uses_mha
        self.padded_rows = padded_rows
        self.graph = graph
        self._tq = num_q_tokens

    @property
    def has_host_plan(self):
        return not getattr(self.plan, "on_device", False)

    @property
    def batch_size(self):
        return self.plan.batch_size

    @property
    def num_q_tokens(self):
        return self._tq if self._tq is not None else self.plan.num_q_tokens

    @property
    def block_kv_indices(self):
        """FlashMLA's name for the block table (ValueError without a host plan)."""
        return self.plan.block_table


class _GraphStep:
    """The graph step a CUDA-graph hook set up: forward runs mla_backend_graph_step at the
    first layer of each pass (the layer id of the first forward call after the hook)."""

    __slots__ = ("mode", "bs", "ndt", "first_layer", "plan")

    def __init__(self, mode, bs, ndt):
        self.mode, self.bs, self.ndt = mode, bs, ndt
        self.first_layer = None
        self.plan = None  # the backend's DevicePlan of the last graph step run from here


def _layer_id(layer):
    return int(getattr(layer, "layer_id", layer))


_GRAPH_MODES = (Mode.DECODE, Mode.TARGET_VERIFY, Mode.DRAFT_EXTEND)


class SglangMLABackend:
    """An MLA attention backend over libmla with sglang's method names.

    Geometry is DeepSeek's: kv_lora_rank 512, qk_rope_head_dim 64 (fixed by
    libmla); qk_nope_head_dim and v_head_dim (default 128/128) shape the MHA
    prefill path. scale is the model's softmax scale (sglang: layer.scaling).
    dtype is the activation dtype (q, latent rows, output): "bf16", "f16" or
    "f32"; kv_cache_dtype the cache's: "bf16", "f16", "fp8", "fp8_block".
    device "cuda" (or ctx a CUDA Context): every tensor is a torch CUDA
    tensor on the context's device (out_cache_loc too) and the calls follow
    torch's current stream.
    """

    def __init__(self, *, num_heads, num_layers, num_pages, scale, max_reqs, max_context_len,
                 page_size=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                 v_head_dim=128, dtype="bf16", kv_cache_dtype="bf16", max_bs=None,
                 max_num_tokens=None, num_draft_tokens=0, extend_impl="absorbed",
                 chunk_capacity=0, fp8_scales=None, ctx=None, device="cpu", num_threads=0):
        if kv_lora_rank != _lib.LATENT or qk_rope_head_dim != _lib.ROPE:
            raise ValueError("kv_lora_rank = %d, qk_rope_head_dim = %d: libmla serves 512 / 64 "
                             "(DeepSeek-V2/V3 geometry)" % (kv_lora_rank, qk_rope_head_dim))
        self.ctx = ctx if ctx is not None else Context(device, num_threads=num_threads)
        self.device = self.ctx.device
        self.is_cuda = self.device == "cuda"
        self.max_bs = int(max_bs or max_reqs)
        self.max_num_tokens = int(max_num_tokens or max(self.max_bs * max(1, num_draft_tokens),
                                                        max_context_len))
        self.max_context_len = int(max_context_len)
        self.num_heads = self.num_local_heads = int(num_heads)
        self.scaling = float(scale)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = int(qk_nope_head_dim), int(v_head_dim)
        self.num_draft_tokens = int(num_draft_tokens)
        self.page_size = int(page_size)
        self.backend = Backend(
            self.ctx, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_heads=num_heads, scale=scale, max_reqs=max_reqs, max_context=max_context_len,
            max_bs=self.max_bs, max_q_tokens=self.max_num_tokens, cache_dtype=kv_cache_dtype,
            act_dtype=dtype, fp8_scales=fp8_scales, qk_nope_dim=qk_nope_head_dim,
            v_dim=v_head_dim, extend_impl=extend_impl, chunk_capacity=chunk_capacity)
        self.dtype = mla_dtype(dtype)
        self.cache = self.backend.cache
        self.req_table = self.backend.req_table
        self.forward_metadata = None
        self.cuda_graph_max_bs = None
        self.cuda_graph_req_pool_indices = self.cuda_graph_seq_lens = None
        self._gstep = None  # the graph step of the last CUDA-graph hook (None: eager metadata)
        self._gplanner = None  # CPU: host plans of graph steps, for inspection
        self._gplanner_ext = None  # CPU: host plans of EXTEND graph steps (token buckets)
        self.cuda_graph_extend_seq_lens = None  # EXTEND graphs' third fixed input
        self.cuda_graph_max_extend_tokens = 0  # EXTEND token buckets the graph state takes

    # ---- the pools (sglang: req_to_token_pool + token_to_kv_pool) -------------------------

    @property
    def req_to_token(self):
        """int32 [max_reqs, max_context] view: slot of each position of each request (host
        memory on every device: the table is host state, the backend keeps a device copy)."""
        return self.req_table.req_to_token

    def alloc_req(self):
        return self.req_table.add()

    def free_req(self, req_id):
        self.req_table.free(req_id)

    def extend_req(self, req_id, n):
        """Append n positions to a request; returns their slots (this step's out_cache_loc;
        host int32: a CUDA engine copies them to the device for forward)."""
        return self.req_table.extend(req_id, n)

    def fork_req(self, req_id, prefix_len):
        return self.req_table.fork(req_id, prefix_len)

    def truncate_req(self, req_id, new_len):
        """Roll back rejected draft tokens."""
        self.req_table.truncate(req_id, new_len)

    def set_kv_buffer(self, layer, loc, c, r=None):
        """Write latent rows (sglang: token_to_kv_pool.set_mla_kv_buffer). c [N, 512] with r
        [N, 64], or c [N, 576] holding both."""
        c, r = self._split_latent(c, r)
        self.cache.write(_layer_id(layer), self._slots(loc), c, r, dtype=self.dtype)

    def get_key_buffer(self, layer):
        """One layer's raw cache bytes [num_slots, row_bytes]: a numpy view on the CPU, a torch
        uint8 CUDA tensor viewing the device cache on CUDA (no copy)."""
        lid = _layer_id(layer)
        if self.is_cuda:
            c = self.cache
            return wrap_device_memory(c.layer_data(lid), (c.num_slots, c.row_bytes), "u8",
                                      self.ctx.device_id, c)
        return self.cache.layer_view(lid)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def _slots(self, loc):
        """out_cache_loc as the cache write takes it: host int32 on the CPU; on CUDA a device
        int32 tensor (a CUDA tensor of another integer type, sglang's int64 say, is converted
        on the device, which a graph capture records; host arrays are copied up)."""
        if not self.is_cuda:
            if isinstance(loc, np.ndarray) and loc.dtype == np.int32 and loc.ndim == 1:
                return loc
            return _host(loc)
        torch = sys.modules.get("torch")
        if getattr(loc, "is_cuda", False):
            if loc.dtype != torch.int32:
                loc = loc.to(torch.int32)
            return loc.reshape(-1)
        if torch is None:
            raise ValueError("argument 'out_cache_loc': a CUDA backend writes through device "
                             "slots: pass a torch CUDA tensor")
        return torch.from_numpy(np.array(_host(loc), np.int32)).to("cuda:%d" % self.ctx.device_id)

    # ---- metadata -----------------------------------------------------------------------

    def _batch_from(self, forward_batch, forward_mode, req_pool_indices, seq_lens, extend_prefix_lens,
                    extend_seq_lens, num_draft_tokens, pad_to=None, num_real=None):
        fb = forward_batch
        if fb is not None:
            forward_mode = fb.forward_mode if forward_mode is None else forward_mode
            req_pool_indices = fb.req_pool_indices if req_pool_indices is None else req_pool_indices
            seq_lens = _field(fb, "seq_lens") if seq_lens is None else seq_lens
            extend_prefix_lens = _field(fb, "extend_prefix_lens") if extend_prefix_lens is None \
                else extend_prefix_lens
            extend_seq_lens = _field(fb, "extend_seq_lens") if extend_seq_lens is None \
                else extend_seq_lens
            if num_draft_tokens is None:
                num_draft_tokens = getattr(fb, "num_draft_tokens", None)
                spec = getattr(fb, "spec_info", None)
                if num_draft_tokens is None and spec is not None:
                    num_draft_tokens = getattr(spec, "draft_token_num", None)
            bs = getattr(fb, "batch_size", None)
        else:
            bs = None
        if forward_mode is None:
            raise ValueError("init_forward_metadata: give a forward_batch or forward_mode")
        mode = _mode_of(forward_mode)
        rid = _host(req_pool_indices)
        sl = _host(seq_lens)
        if rid is None or sl is None:
            if mode != Mode.IDLE:
                raise ValueError("init_forward_metadata: req_pool_indices and seq_lens are required")
            rid = sl = np.zeros(0, np.int32)
        if bs is not None and bs < rid.shape[0]:
            rid, sl = rid[:bs], sl[:bs]
        pre, ext = _host(extend_prefix_lens), _host(extend_seq_lens)
        ndt = int(num_draft_tokens if num_draft_tokens is not None else self.num_draft_tokens)
        padded = 0
        if num_real is not None and num_real < rid.shape[0]:
            rid = rid.copy()
            rid[num_real:] = _lib.REQ_PAD
            sl = sl.copy()
            sl[num_real:] = self.get_cuda_graph_seq_len_fill_value()
        if pad_to is not None and rid.shape[0] < pad_to:
            n = pad_to - rid.shape[0]
            rid = np.concatenate([rid, np.full(n, _lib.REQ_PAD, np.int32)])
            sl = np.concatenate([sl, np.full(n, self.get_cuda_graph_seq_len_fill_value(), np.int32)])
        padded = int(np.count_nonzero(rid == _lib.REQ_PAD))
        if mode == Mode.IDLE or rid.shape[0] == 0:
            return _BatchArgs(Mode.IDLE), 0
        if mode == Mode.DECODE:
            return _BatchArgs(mode, rid, sl), padded
        if mode == Mode.TARGET_VERIFY:
            return _BatchArgs(mode, rid, sl, num_draft_tokens=ndt), padded
        if mode == Mode.DRAFT_EXTEND:
            return _BatchArgs(mode, rid, sl, extend_lens=ext, num_draft_tokens=ndt), padded
        if pre is not None and not pre.any():
            pre = None  # no prefix: the ragged MHA path
        return _BatchArgs(mode, rid, sl, extend_lens=ext, prefix_lens=pre), padded

    def init_forward_metadata(self, forward_batch=None, *, forward_mode=None, req_pool_indices=None,
                              seq_lens=None, extend_prefix_lens=None, extend_seq_lens=None,
                              num_draft_tokens=None):
        """Plan the step (once; every layer's forward reuses it). Takes a ForwardBatch-like
        object or the same fields as keywords. On CUDA the request ids and lengths are read
        on the host (a CUDA tensor is copied back: pass the *_cpu twins to avoid the sync);
        decode-type steps are then built on the device (forward_metadata.plan is a
        DevicePlan)."""
        b, padded = self._batch_from(forward_batch, forward_mode, req_pool_indices, seq_lens,
                                     extend_prefix_lens, extend_seq_lens, num_draft_tokens)
        return self._plan(b, padded)

    def _plan(self, b, padded):
        self._gstep = None
        p = self.backend.plan(b.mode, batch_args=b)
        self.forward_metadata = MLAMetadata(p.mode, p, self.backend._uses_mha, padded)
        return self.forward_metadata

    # ---- CUDA graphs ------------------------------------------------------------------------
    #
    # Over the C graph steps (mla_backend_graph_*): init_cuda_graph_state allocates the fixed
    # inputs (request ids and lengths, max_bs rows, library-owned) and the step workspace; each
    # hook writes the inputs (capture: every row padding; replay: the real rows, then padding)
    # and syncs the device copy of the request table, outside the graph; forward then runs
    # mla_backend_graph_step at the first layer of each pass (so a pass captured in a CUDA
    # graph contains the metadata build, which replays read from the inputs), then the layer.
    # On a CPU context the same calls run eagerly from host buffers.
    #
    # EXTEND graphs (opt-in: init_cuda_graph_state(max_extend_tokens=N), which runs
    # mla_backend_graph_init_extend) capture the paged absorbed prefill over the cached prefix
    # at a token bucket: a graph is keyed by (bs, num_tokens), q / out / out_cache_loc hold
    # num_tokens rows, and a third fixed input, the rows' extend lengths, says which rows own
    # which tokens (rows past the real total are left as they are; their new latent rows go to
    # the dummy slot 0).

    def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None, *,
                              max_draft_tokens=None, max_extend_tokens=None):
        """Allocate the graph buffers for batches up to max_bs rows (once; a later call may
        only ask for less). max_draft_tokens: the largest TARGET_VERIFY / DRAFT_EXTEND
        window a graph will take (default: the backend's num_draft_tokens, else
        max_num_tokens // max_bs when that exceeds 1). The fixed inputs are
        cuda_graph_req_pool_indices / cuda_graph_seq_lens (int32 [max_bs]: torch CUDA tensors
        viewing library memory on CUDA, numpy arrays on the CPU).

        max_extend_tokens (default None: no EXTEND graphs): also size EXTEND graph steps for
        token buckets up to this many query tokens (1..max_num_tokens of the backend; once,
        a later call may ask for less or leave it out); their extra fixed input is
        cuda_graph_extend_seq_lens (int32 [max_bs], same kind as the others)."""
        if max_bs > self.max_bs or max_num_tokens > self.max_num_tokens:
            raise ValueError("init_cuda_graph_state: max_bs %d / max_num_tokens %d exceed the "
                             "backend's %d / %d" % (max_bs, max_num_tokens, self.max_bs,
                                                    self.max_num_tokens))
        met = None if max_extend_tokens is None else int(max_extend_tokens)
        if met is not None and not 1 <= met <= self.max_num_tokens:
            raise ValueError("init_cuda_graph_state: max_extend_tokens = %d, expected 1..%d (the "
                             "backend's max_num_tokens)" % (met, self.max_num_tokens))
        if max_draft_tokens is None:
            max_draft_tokens = self.num_draft_tokens or (
                max_num_tokens // max_bs if max_bs > 0 and max_num_tokens // max_bs > 1 else 0)
        ndt = min(int(max_draft_tokens), 64)
        be = self.backend
        if be.graph_max_bs is None:
            be.graph_init(max_bs, ndt)
        elif max_bs > be.graph_max_bs or ndt > be.graph_max_draft_tokens:
            raise ValueError("init_cuda_graph_state: the graph buffers exist for max_bs %d and %d "
                             "draft tokens (they are allocated once)"
                             % (be.graph_max_bs, be.graph_max_draft_tokens))
        have = getattr(be, "graph_max_tokens", None)  # set by Backend.graph_init_extend
        if met is not None:
            if have is None:
                be.graph_init_extend(met)
            elif met > have:
                raise ValueError("init_cuda_graph_state: the EXTEND graph buffers exist for %d "
                                 "tokens (they are allocated once)" % have)
        self.cuda_graph_req_pool_indices, self.cuda_graph_seq_lens = be.graph_inputs()
        self.cuda_graph_extend_seq_lens = getattr(be, "_graph_extend_lens", None)
        if not self.is_cuda:
            if self._gplanner is None:
                gb, gq = be.graph_max_bs, be.graph_max_bs * max(be.graph_max_draft_tokens, 1)
                self._gplanner = Planner(self.ctx, max_bs=gb, max_q_tokens=gq,
                                         max_kv_tokens=gb * self.max_context_len,
                                         max_context=self.max_context_len,
                                         page_size=self.page_size)
            if met is not None and self._gplanner_ext is None:
                gb = be.graph_max_bs
                self._gplanner_ext = Planner(self.ctx, max_bs=gb, max_q_tokens=be.graph_max_tokens,
                                             max_kv_tokens=gb * self.max_context_len,
                                             max_context=self.max_context_len,
                                             page_size=self.page_size)
        self.cuda_graph_max_bs = int(max_bs)
        self.cuda_graph_max_num_tokens = int(max_num_tokens)
        if met is not None:  # (a later call without it keeps the buckets)
            self.cuda_graph_max_extend_tokens = met

    def _graph_mode(self, forward_mode, spec_info, num_tokens=None):
        """(mode, ndt) of a graph step; for EXTEND ndt is the token bucket num_tokens."""
        mode = _mode_of(forward_mode if forward_mode is not None else Mode.DECODE)
        if mode == Mode.EXTEND:
            lim = self.cuda_graph_max_extend_tokens
            if lim == 0:
                raise ValueError("forward_mode = EXTEND: CUDA graphs take decode, target_verify "
                                 "and draft_extend (a fixed window) steps, and extend steps "
                                 "after init_cuda_graph_state(..., max_extend_tokens=N)")
            if num_tokens is None:
                raise ValueError("an EXTEND graph is keyed by its token bucket: pass num_tokens")
            nt = int(num_tokens)
            if not 1 <= nt <= lim:
                raise ValueError("num_tokens = %d: the EXTEND graph state takes token buckets "
                                 "1..%d (init_cuda_graph_state's max_extend_tokens)" % (nt, lim))
            return mode, nt
        if mode != Mode.IDLE and mode not in _GRAPH_MODES:
            raise ValueError("forward_mode = %s: CUDA graphs take decode, target_verify and "
                             "draft_extend (a fixed window) steps" % mode.name)
        ndt = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        ndt = int(ndt if ndt is not None else self.num_draft_tokens)
        if mode in (Mode.TARGET_VERIFY, Mode.DRAFT_EXTEND) and not \
                1 <= ndt <= self.backend.graph_max_draft_tokens:
            raise ValueError("spec_info.draft_token_num = %d: the graph state takes 1..%d draft "
                             "tokens (init_cuda_graph_state's max_draft_tokens)"
                             % (ndt, self.backend.graph_max_draft_tokens))
        return mode, (0 if mode == Mode.DECODE else ndt)

    def _graph_md(self, mode, bs, ndt, rid, sl, ext=None):
        """Host plan of the padded batch (CPU: checks the rows, for inspection) or the step's
        DevicePlan (CUDA), and the metadata the forward calls run from."""
        if self.is_cuda:
            plan = DevicePlan(mode, bs, ndt, graph=True)
        elif mode == Mode.EXTEND:  # the same rows as an eager EXTEND over their prefixes
            plan = self._gplanner_ext.build(
                self.req_table, mode, num_heads=self.num_heads,
                batch_args=_BatchArgs(mode, rid, sl, extend_lens=ext, prefix_lens=sl - ext))
        else:
            plan = self._gplanner.build(self.req_table, mode, num_heads=self.num_heads,
                                        batch_args=_BatchArgs(mode, rid, sl, num_draft_tokens=ndt))
        return plan

    def _set_graph(self, mode, bs, ndt, plan, padded):
        self.backend.sync()
        self._gstep = _GraphStep(mode, bs, ndt)
        # an EXTEND step's q / out hold the whole token bucket
        self.forward_metadata = MLAMetadata(mode, plan, False, padded, graph=True,
                                            num_q_tokens=ndt if mode == Mode.EXTEND else None)
        return self.forward_metadata

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens,
                                                 encoder_lens=None, forward_mode=None,
                                                 spec_info=None):
        """Capture-time metadata, called before the captured pass (and its warm-up passes),
        outside the graph: the captured batch is dummy data, so every row of the fixed
        inputs' first bs becomes a padding row (REQ_PAD, seq_len 1; EXTEND: extend length 0).
        The captured pass's first forward call records the graph step. forward_mode EXTEND
        (after init_cuda_graph_state(max_extend_tokens=...)): num_tokens is the graph's token
        bucket, the rows q, k, out and out_cache_loc hold in its passes."""
        self._require_graph_state(bs)
        mode, ndt = self._graph_mode(forward_mode, spec_info, num_tokens)
        if mode == Mode.IDLE:
            return self._plan(_BatchArgs(Mode.IDLE), 0)
        fill = self.get_cuda_graph_seq_len_fill_value()
        rid, sl = np.full(bs, _lib.REQ_PAD, np.int32), np.full(bs, fill, np.int32)
        ext = np.zeros(bs, np.int32)
        plan = self._graph_md(mode, bs, ndt, rid, sl, ext)
        ids, seq = self.backend.graph_inputs()
        elens = self.cuda_graph_extend_seq_lens
        if self.is_cuda:
            ids[:bs].fill_(_lib.REQ_PAD)
            seq[:bs].fill_(fill)
            if mode == Mode.EXTEND:
                elens[:bs].fill_(0)
        else:
            ids[:bs], seq[:bs] = rid, sl
            if mode == Mode.EXTEND:
                elens[:bs] = ext
        return self._set_graph(mode, bs, ndt, plan, bs)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum=None, encoder_lens=None,
                                                forward_mode=None, spec_info=None,
                                                seq_lens_cpu=None, num_real=None, *,
                                                num_tokens=None, extend_seq_lens=None,
                                                extend_seq_lens_cpu=None, extend_prefix_lens=None,
                                                extend_prefix_lens_cpu=None):
        """Replay-time metadata for a captured size bs, before graph.replay(), outside the
        graph: the rows go into the fixed inputs, rows past num_real (or past the given
        arrays) become padding rows (REQ_PAD, seq_len 1; a REQ_PAD id in the arrays is one
        too), and the request table's device copy is synced. On CUDA, CUDA tensors are
        copied on the device (no host sync; seq_lens is preferred over seq_lens_cpu then), the
        rows are checked by the device (an out-of-range row is emptied and reported by
        ctx.synchronize()) and padded_rows counts the rows padded here only; on the CPU the
        rows are checked here.

        EXTEND graphs: num_tokens is the captured token bucket; seq_lens are the rows' kv
        lengths (prefix included) and extend_seq_lens their query tokens (or
        extend_prefix_lens, the extend lengths being seq_lens - extend_prefix_lens), in the
        order their tokens fill q (padding rows: extend length 0). Extend lengths adding up
        to more than num_tokens raise ValueError when known on the host; from device tensors
        such a batch is not attended and reported by ctx.synchronize()."""
        self._require_graph_state(bs)
        mode, ndt = self._graph_mode(forward_mode, spec_info, num_tokens)
        if mode == Mode.IDLE:
            return self._plan(_BatchArgs(Mode.IDLE), 0)
        ext_src = ext_cpu = pre_src = None
        if mode == Mode.EXTEND:
            ext_src, ext_cpu = extend_seq_lens, extend_seq_lens_cpu
            pre_src, pre_cpu = extend_prefix_lens, extend_prefix_lens_cpu
            if ext_src is None and ext_cpu is None:
                if pre_src is None and pre_cpu is None:
                    raise ValueError("an EXTEND replay needs extend_seq_lens (or "
                                     "extend_prefix_lens)")
                if pre_src is None or (not self.is_cuda and pre_cpu is not None):
                    pre_src = pre_cpu
        if self.is_cuda:
            sl_src = seq_lens if getattr(seq_lens, "is_cuda", False) or seq_lens_cpu is None \
                else seq_lens_cpu
            ext = None
            if mode == Mode.EXTEND:
                ext = ext_src if getattr(ext_src, "is_cuda", False) or ext_cpu is None \
                    else ext_cpu
                if ext is None:  # from the prefixes, on the side the lengths are
                    ext = self._ext_from_prefix(sl_src, pre_src)
                self._check_bucket_host(ext, num_real, bs, ndt)
            padded = self._write_device_inputs(bs, req_pool_indices, sl_src, num_real, ext)
            plan = self._graph_md(mode, bs, ndt, None, None)
        elif mode == Mode.EXTEND:
            rid, sl, ext, padded = self._extend_rows_host(
                bs, req_pool_indices, seq_lens_cpu if seq_lens_cpu is not None else seq_lens,
                ext_cpu if ext_cpu is not None else ext_src, pre_src, num_real, ndt)
            plan = self._graph_md(mode, bs, ndt, rid, sl, ext)  # checks the rows first
            ids, seq = self.backend.graph_inputs()
            ids[:bs], seq[:bs] = rid, sl
            self.cuda_graph_extend_seq_lens[:bs] = ext
        else:
            b, padded = self._batch_from(None, mode, req_pool_indices,
                                         seq_lens_cpu if seq_lens_cpu is not None else seq_lens,
                                         None, None, ndt, pad_to=bs, num_real=num_real)
            if b.bs != bs:
                raise ValueError("replay: %d rows for a graph of batch size %d" % (b.bs, bs))
            rid, sl = b.keep[0], b.keep[1]
            plan = self._graph_md(mode, bs, ndt, rid, sl)  # checks the rows first
            ids, seq = self.backend.graph_inputs()
            ids[:bs], seq[:bs] = rid, sl
        return self._set_graph(mode, bs, ndt, plan, padded)

    @staticmethod
    def _ext_from_prefix(seq_lens, prefix_lens):
        """Extend lengths seq_lens - prefix_lens (torch on the device when either is a CUDA
        tensor, else host int32)."""
        if getattr(seq_lens, "is_cuda", False) or getattr(prefix_lens, "is_cuda", False):
            torch = sys.modules["torch"]
            dev = seq_lens.device if getattr(seq_lens, "is_cuda", False) else prefix_lens.device

            def on(x):
                return x.to(dev) if hasattr(x, "to") and hasattr(x, "device") else \
                    torch.from_numpy(np.array(_host(x), np.int32)).to(dev)
            s, p = on(seq_lens).reshape(-1), on(prefix_lens).reshape(-1)
            return s.to(torch.int32) - p.to(torch.int32)
        return _host(seq_lens) - _host(prefix_lens)

    @staticmethod
    def _check_bucket_host(ext, num_real, bs, bucket):
        """Host extend lengths: the real rows' tokens must fit the bucket (device tensors are
        left to the device check)."""
        if ext is None or getattr(ext, "is_cuda", False):
            return
        e = _host(ext)
        n = bs if num_real is None else max(0, min(int(num_real), bs))
        e = e[:min(n, e.shape[0])]
        if (e < 0).any():
            raise ValueError("extend_seq_lens: a negative length")
        if int(e.sum()) > bucket:
            raise ValueError("extend_seq_lens add up to %d tokens: more than the graph's bucket "
                             "num_tokens = %d" % (int(e.sum()), bucket))

    def _extend_rows_host(self, bs, req_pool_indices, seq_lens, ext, prefix, num_real, bucket):
        """CPU: the padded host rows (ids, seq_lens, extend lens) of an EXTEND replay and the
        number of rows padded (REQ_PAD rows in the arrays included)."""
        rid, sl = _host(req_pool_indices), _host(seq_lens)
        e = _host(ext) if ext is not None else sl - _host(prefix)
        n = min(rid.shape[0], sl.shape[0], e.shape[0])
        if num_real is not None:
            n = max(0, min(int(num_real), n))
        if n > bs:
            raise ValueError("replay: %d rows for a graph of batch size %d" % (n, bs))
        fill = self.get_cuda_graph_seq_len_fill_value()
        out_r = np.full(bs, _lib.REQ_PAD, np.int32)
        out_s = np.full(bs, fill, np.int32)
        out_e = np.zeros(bs, np.int32)
        out_r[:n], out_s[:n], out_e[:n] = rid[:n], sl[:n], e[:n]
        pad = out_r == _lib.REQ_PAD
        out_s[pad], out_e[pad] = fill, 0
        if (out_e < 0).any() or (out_e > out_s).any():
            raise ValueError("extend_seq_lens: a row's extend length is outside 0..seq_len")
        if int(out_e.sum()) > bucket:
            raise ValueError("extend_seq_lens add up to %d tokens: more than the graph's bucket "
                             "num_tokens = %d" % (int(out_e.sum()), bucket))
        return out_r, out_s, out_e, int(np.count_nonzero(pad))

    def _write_device_inputs(self, bs, req_pool_indices, seq_lens, num_real, extend_lens=None):
        """CUDA: rows [0, n) from the engine's tensors, [n, bs) padding, enqueued on torch's
        current stream (extend_lens given: the EXTEND input too, 0 for padding rows and for
        REQ_PAD ids). Returns the number of rows padded here."""
        torch = sys.modules["torch"]
        ids, seq = self.backend.graph_inputs()
        n = bs if num_real is None else max(0, min(int(num_real), bs))

        def put(dst, src, name):
            if src is None:
                raise ValueError("argument '%s' is required" % name)
            if not getattr(src, "is_cuda", False):
                src = torch.from_numpy(np.array(_host(src), np.int32))
            src = src.reshape(-1)
            m = min(n, int(src.shape[0]))
            if m:
                dst[:m].copy_(src[:m])  # converts the dtype (sglang's int64) on the way
            return m

        m = min(put(ids, req_pool_indices, "req_pool_indices"), put(seq, seq_lens, "seq_lens"))
        if extend_lens is not None:
            el = self.cuda_graph_extend_seq_lens
            m = min(m, put(el, extend_lens, "extend_seq_lens"))
            if m:  # a REQ_PAD id in the arrays is a padding row: no tokens
                el[:m].masked_fill_(ids[:m] == _lib.REQ_PAD, 0)
            if m < bs:
                el[m:bs].fill_(0)
        if m < bs:
            ids[m:bs].fill_(_lib.REQ_PAD)
            seq[m:bs].fill_(self.get_cuda_graph_seq_len_fill_value())
        return bs - m

    def _run_graph_step(self, lid):
        """At the first layer of a pass (or when something else planned since): build the
        graph step's metadata from the fixed inputs (captured with the layers)."""
        g = self._gstep
        if g.first_layer is None:
            g.first_layer = lid
        if lid == g.first_layer or g.plan is None or self.backend._plan is not g.plan:
            g.plan = self.backend.graph_step(g.mode, g.bs, g.ndt)

    def _require_graph_state(self, bs):
        if self.cuda_graph_max_bs is None:
            raise ValueError("call init_cuda_graph_state first")
        if bs > self.cuda_graph_max_bs:
            raise ValueError("bs = %d exceeds the graph state's max_bs = %d"
                             % (bs, self.cuda_graph_max_bs))

    # ---- forward ----------------------------------------------------------------------------

    def _split_latent(self, k, k_rope):
        """(c [N, 512], r [N, 64]) contiguous, from k [N, (1,) 512] + k_rope, or k [N, (1,) 576]."""
        if k_rope is not None:
            return _contig(k.reshape(-1, _lib.LATENT)), _contig(k_rope.reshape(-1, _lib.ROPE))
        kall = k.reshape(-1, _lib.ROW)
        return _contig(kall[:, :_lib.LATENT]), _contig(kall[:, _lib.LATENT:])

    def _meta(self):
        md = self.forward_metadata
        if md is None or not md.plan.valid:
            raise ValueError("no forward metadata: call init_forward_metadata first")
        return md

    def _absorbed(self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, return_lse,
                  out_cache_loc=None, out=None, lse=None, md=None):
        # md given: a draft step's metadata, whose step the draft backend has selected already
        lid = _layer_id(layer)
        if md is None:
            md = self._meta()
            if md.graph:
                self._run_graph_step(lid)
        T, H = md.num_q_tokens, self.num_heads
        new = None
        if save_kv_cache and k is not None:
            loc = out_cache_loc if out_cache_loc is not None else forward_batch.out_cache_loc
            c, r = self._split_latent(k, k_rope)
            new = (self._slots(loc), c, r)
        if q_rope is not None:
            q_nope, q_r = q.reshape(T, H, _lib.LATENT), q_rope.reshape(T, H, _lib.ROPE)
        else:
            qall = q.reshape(T, H, _lib.ROW)
            q_nope, q_r = qall[:, :, :_lib.LATENT], qall[:, :, _lib.LATENT:]
        contig = _is_contig(q_nope) and _is_contig(q_r)
        if not contig and (md.graph or not md.has_host_plan):
            # A step built from device metadata runs through mla_backend_forward, which takes
            # no strides: contiguous copies (captured with the pass under a CUDA graph).
            q_nope, q_r, contig = _contig(q_nope), _contig(q_r), True
        o3 = None if out is None else out.reshape(T, H, _lib.LATENT)
        return_lse = return_lse or lse is not None
        if contig:
            # One C call: the latent write, then attention.
            res = self.backend.forward(lid, new_slots=new[0] if new else None,
                                       new_c=new[1] if new else None, new_r=new[2] if new else None,
                                       q_nope=q_nope, q_rope=q_r, out=o3, lse=lse,
                                       return_lse=return_lse)
        else:
            # q_nope / q_rope are strided views of one [T, H, 576] tensor: mla_forward_args has
            # no strides, so write the rows and call the kernel that takes them.
            if new:
                self.cache.write(lid, new[0], new[1], new[2], dtype=self.dtype)
            res = attention_absorbed(self.ctx, self.cache, lid, md.plan, q_nope, q_r,
                                     scale=self.scaling, out=o3, lse=lse, return_lse=return_lse,
                                     dtype=self.dtype)
        if return_lse:
            o, lse = res
            return o.reshape(T, H * _lib.LATENT), lse
        return res.reshape(T, H * _lib.LATENT)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, return_lse=False, out=None, lse=None):
        """Decode: q [bs, H * 576] (or q_nope [bs, H, 512] with q_rope [bs, H, 64]); k this
        step's latent rows [bs, 576] (or [bs, 512] with k_rope [bs, 64]), written to
        forward_batch.out_cache_loc first (padding rows: slot 0); v is unused (MLA's V is the
        latent). out [bs, H * 512] (or [bs, H, 512]) and lse [bs, H] fp32: optional outputs
        (fixed buffers under a CUDA graph). Returns o [bs, H * 512] (and lse [bs, H] with
        return_lse or lse=, for DCP merging)."""
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, return_lse,
                              out=out, lse=lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, *, latent=None, kv_b_proj=None, return_lse=False, out=None,
                       lse=None):
        """EXTEND, TARGET_VERIFY and DRAFT_EXTEND.

        Absorbed modes (verify, draft extend, extend over a prefix with
        extend_impl="absorbed"): as forward_decode. MHA (extend without prefix,
        or with extend_impl="mha_chunked"): q [T, H * (nope + 64)] (or q with
        q_rope), k [T, H, nope + 64] (or k with k_rope), v [T, H, v_dim];
        latent (c [T, 512], r [T, 64]) or [T, 576] are this step's latent rows
        to store (sglang's model stores them itself: then pass latent=None and
        use set_kv_buffer); kv_b_proj [H, nope + v_dim, 512] for chunked
        prefixes. Returns o [T, H * v_dim]. out / lse: optional outputs as in forward_decode.

        Under an EXTEND graph (the capture / replay hooks with forward_mode EXTEND) the step is
        the paged absorbed prefill whatever extend_impl is: absorbed q / k as above, T being
        the graph's token bucket (q, k, out and out_cache_loc hold that many rows; rows past
        the real tokens are left as they are, their latent rows go to slot 0).
        """
        md = self._meta()
        if not md.uses_mha:
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                                  return_lse, out=out, lse=lse)
        p = md.plan
        T, H = p.num_q_tokens, self.num_heads
        dqk = self.qk_nope_head_dim + _lib.ROPE
        if q_rope is not None:
            q = _cat_last(q.reshape(T, H, self.qk_nope_head_dim), q_rope.reshape(T, H, _lib.ROPE))
        if k_rope is not None:
            kr = k_rope.reshape(T, -1, _lib.ROPE)
            if kr.shape[1] == 1 and H > 1:  # one shared rope row per token, as DeepSeek's
                kr = np.broadcast_to(kr, (T, H, _lib.ROPE)) if isinstance(kr, np.ndarray) \
                    else kr.expand(T, H, _lib.ROPE)
            k = _cat_last(k.reshape(T, H, self.qk_nope_head_dim), kr)
        new = {}
        if save_kv_cache and latent is not None:
            if isinstance(latent, (tuple, list)):
                c, r = self._split_latent(latent[0], latent[1])
            else:
                c, r = self._split_latent(latent, None)
            new = dict(new_slots=self._slots(forward_batch.out_cache_loc), new_c=c, new_r=r)
        o3 = None if out is None else out.reshape(T, H, self.v_head_dim)
        res = self.backend.forward(_layer_id(layer), q=_contig(q.reshape(T, H, dqk)),
                                   k=_contig(k.reshape(T, H, dqk)),
                                   v=_contig(v.reshape(T, H, self.v_head_dim)), kv_b_proj=kv_b_proj,
                                   out=o3, lse=lse, return_lse=return_lse, **new)
        if return_lse or lse is not None:
            o, lse = res
            return o.reshape(T, H * self.v_head_dim), lse
        return res.reshape(T, H * self.v_head_dim)


def _nrows(x):
    return int(x.shape[0]) if hasattr(x, "shape") else len(x)


class _DraftStep:
    """Step i of a multi-step draft (sglang: attn_backends[i]): its forward runs the C
    backend's draft step i (mla_backend_draft_select) of the metadata that the parent built
    for every step at once (mla_backend_draft_prepare)."""

    def __init__(self, parent, step):
        self.parent = parent
        self.step = step
        self.forward_metadata = None
        self._planner = None

    @property
    def planner(self):
        """CPU contexts: the Planner of this step's host plan (built for inspection)."""
        if self._planner is None:
            b = self.parent.base
            self._planner = Planner(b.ctx, max_bs=b.max_bs, max_q_tokens=b.max_bs,
                                    max_kv_tokens=b.max_bs * b.max_context_len,
                                    max_context=b.max_context_len, page_size=b.page_size)
        return self._planner

    def forward_decode(self, q, k, v, layer, forward_batch=None, save_kv_cache=True, q_rope=None,
                       k_rope=None, return_lse=False, out=None, lse=None):
        """Step i's decode: one query per row over keys [0, seq_len + i + 1). q [bs, H * 576]
        (or q_nope [bs, H, 512] with q_rope [bs, H, 64]); k the step's latent row per row
        [bs, 576] (or [bs, 512] with k_rope [bs, 64]), stored at forward_batch.out_cache_loc
        first (padding rows: slot 0), or, without one, at position seq_len + i of each
        request (known on the host only: CPU contexts and CUDA eager steps given host rows;
        a CUDA graph pass needs out_cache_loc as a device tensor). v is unused. out / lse:
        optional outputs (fixed buffers under a CUDA graph). Returns o [bs, H * 512] (and
        lse [bs, H] with return_lse or lse=)."""
        par = self.parent
        lid = _layer_id(layer)
        md = par._enter(self.step, lid)
        loc = getattr(forward_batch, "out_cache_loc", None) if forward_batch is not None else None
        if loc is None and save_kv_cache and k is not None:
            loc = par.step_slots(self.step)
        return par.base._absorbed(q, k, lid, None, save_kv_cache, q_rope, k_rope, return_lse,
                                  out_cache_loc=loc, out=out, lse=lse, md=md)

    def step_metadata(self):
        """This step's device-built metadata (see SglangMLAMultiStepDraftBackend.step_metadata)."""
        return self.parent.step_metadata(self.step)


class SglangMLAMultiStepDraftBackend:
    """Multi-step draft decode (EAGLE / MTP, topk = 1) over the base backend's cache and
    request table, shaped like sglang's multi-step draft backends: attn_backends[i] is step
    i's backend (forward_decode), init_forward_metadata builds every step's metadata in one
    call, and the CUDA-graph hooks work over the same fixed inputs.

    It runs on the C backend's draft steps (mla_backend_draft_*): the base backend's graph
    inputs (request ids, lengths before drafting; allocated on first use at the base's full
    max_bs with its num_draft_tokens, unless base.init_cuda_graph_state made them first) and
    a draft workspace for speculative_num_steps steps (1..16). init_forward_metadata writes
    the rows there and runs mla_backend_draft_prepare at once; each step's forward selects
    its step (mla_backend_draft_select), then runs the layer. Under the CUDA-graph hooks the
    prepare runs instead at the first forward call of each pass (step and layer of the first
    call after the hook), so a captured pass records it and each replay rebuilds every
    step's metadata from the inputs the replay hook wrote.

    Before init_forward_metadata (or a replay), every request must hold its num_steps draft
    positions (extend it by num_steps: step i's token sits at position seq_len + i). Step i
    attends keys [0, seq_len + i + 1); a padding row (REQ_PAD, seq_len 1) reads i + 2 keys
    of the reserved page 0. On a CPU context each step's forward_metadata.plan is also a host
    plan of that step (for inspection; the rows are checked against it before the inputs are
    written), and draft_plan the one-call mla_draft_plan of the batch (host_draft_plan,
    default on CPU only; eager batches without padding rows). Another plan on the base
    backend in between makes an eager draft's metadata stale (ValueError: call
    init_forward_metadata again); a graph pass rebuilds it.
    """

    def __init__(self, base, speculative_num_steps, topk=1, *, host_draft_plan=None):
        if topk != 1:
            raise ValueError("topk = %d: the multi-step draft backend supports topk = 1" % topk)
        n = int(speculative_num_steps)
        if not 1 <= n <= 16:
            raise ValueError("speculative_num_steps = %d, expected 1..16" % n)
        self.base = base
        self.topk = topk
        self.speculative_num_steps = n
        self.attn_backends = [_DraftStep(self, i) for i in range(n)]
        self.host_draft_plan = (not base.is_cuda) if host_draft_plan is None \
            else bool(host_draft_plan)
        self.draft_planner = DraftPlanner(base.ctx, max_bs=base.max_bs, num_steps=n,
                                          max_context=base.max_context_len) \
            if self.host_draft_plan else None
        self.draft_plan = None
        self.cuda_graph_max_bs = None
        self.cuda_graph_req_pool_indices = self.cuda_graph_seq_lens = None
        self._bs = 0  # rows of the current metadata (0: none)
        self._graph = False  # set by the CUDA-graph hooks: prepare at each pass's first call
        self._first = None  # (step, layer) of the first forward call after a graph hook
        self._plan = None  # the backend's DevicePlan of the last draft_prepare run from here
        self._req = self._seq = None  # host rows, where known

    # ---- buffers ----------------------------------------------------------------------------

    def _buffers(self):
        """The base backend's graph inputs, after making sure the graph and draft buffers
        exist."""
        b, be = self.base, self.base.backend
        if be.graph_max_bs is None:
            # Only what the base would ask for itself: every row, its verify window.
            be.graph_init(b.max_bs, min(b.num_draft_tokens, 64))
        if be.draft_max_steps is None:
            be.draft_init(self.speculative_num_steps)
        elif be.draft_max_steps < self.speculative_num_steps:
            raise ValueError("speculative_num_steps = %d: the backend's draft buffers hold %d "
                             "steps (they are allocated once)"
                             % (self.speculative_num_steps, be.draft_max_steps))
        return be.graph_inputs()

    def _host_plans(self, rid, sl):
        """CPU: each step's host plan (step i: seq_len + i + 1 keys, padding rows too, as the
        draft steps do). Raises MLAError for a row the steps cannot take (not live, too few
        positions) before anything is written."""
        H = self.base.num_heads
        return [st.planner.build(self.base.req_table, Mode.DECODE, rid,
                                 (sl + i + 1).astype(np.int32), num_heads=H)
                for i, st in enumerate(self.attn_backends)]

    def _set(self, bs, rid, sl, graph, padded, plans):
        self._bs, self._req, self._seq = bs, rid, sl
        self._graph, self._first, self._plan = graph, None, None
        for i, st in enumerate(self.attn_backends):
            p = plans[i] if plans is not None else DevicePlan(Mode.DECODE, bs, 0, graph=True)
            st.forward_metadata = MLAMetadata(Mode.DECODE, p, False, padded, graph=True)

    def _write_host(self, bs, rid, sl):
        """CPU: the rows into the fixed inputs; returns what was there (to restore)."""
        ids, seq = self.base.backend.graph_inputs()
        old = (ids[:bs].copy(), seq[:bs].copy())
        ids[:bs], seq[:bs] = rid, sl
        return old

    def _require_rows(self, bs):
        lim = self.base.backend.graph_max_bs
        if bs < 1 or bs > lim:
            raise ValueError("batch size %d: the draft steps take 1..%d rows (the backend's graph "
                             "inputs)" % (bs, lim))

    # ---- metadata ---------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch=None, *, req_pool_indices=None, seq_lens=None,
                              seq_lens_cpu=None):
        """Build every step's metadata in one call (mla_backend_draft_prepare) for the batch
        (req_pool_indices, seq_lens before drafting; REQ_PAD rows are padding, seq_len 1).
        Takes a ForwardBatch-like object or the fields as keywords. On CUDA, CUDA tensors are
        copied into the inputs on the device (no host sync); host arrays are copied up."""
        fb = forward_batch
        ids_src = req_pool_indices if req_pool_indices is not None else \
            getattr(fb, "req_pool_indices", None)
        if seq_lens is None and seq_lens_cpu is None and fb is not None:
            seq_lens = getattr(fb, "seq_lens", None)
            seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
        if ids_src is None or (seq_lens is None and seq_lens_cpu is None):
            raise ValueError("init_forward_metadata: req_pool_indices and seq_lens are required")
        bs = _nrows(ids_src)
        self._buffers()
        self._require_rows(bs)
        base, be = self.base, self.base.backend
        self._bs = 0
        self.draft_plan = None
        if not base.is_cuda:
            rid = _host(ids_src)
            sl = _host(seq_lens_cpu if seq_lens_cpu is not None else seq_lens)
            if sl.shape[0] != bs:
                raise ValueError("seq_lens: %d rows, req_pool_indices has %d" % (sl.shape[0], bs))
            plans = self._host_plans(rid, sl)
            old = self._write_host(bs, rid, sl)
            try:
                p = be.draft_prepare(bs, self.speculative_num_steps)
            except Exception:
                self._write_host(bs, old[0], old[1])
                raise
            padded = int(np.count_nonzero(rid == _lib.REQ_PAD))
        else:
            on_dev = getattr(seq_lens, "is_cuda", False)
            seq_src = seq_lens if on_dev or seq_lens_cpu is None else seq_lens_cpu
            if _nrows(seq_src) != bs:
                raise ValueError("seq_lens: %d rows, req_pool_indices has %d"
                                 % (_nrows(seq_src), bs))
            base._write_device_inputs(bs, ids_src, seq_src, None)
            plans = None
            # host copies of the rows where they come without a device sync
            rid = None if getattr(ids_src, "is_cuda", False) else _host(ids_src)
            host_sl = seq_lens_cpu if seq_lens_cpu is not None else (None if on_dev else seq_lens)
            sl = _host(host_sl)
            padded = int(np.count_nonzero(rid == _lib.REQ_PAD)) if rid is not None else 0
            be.sync()
            p = be.draft_prepare(bs, self.speculative_num_steps)
        self._set(bs, rid, sl, False, padded, plans)
        self._plan = p
        if self.host_draft_plan and rid is not None and sl is not None and \
                not (rid == _lib.REQ_PAD).any():
            # FlashInfer-style metadata of every step in one call (kv_indptr [steps, bs+1]).
            self.draft_plan = self.draft_planner.build(base.req_table, rid, sl)
        return self.attn_backends[0].forward_metadata

    def _enter(self, i, lid):
        """Before step i's layer lid: (graph passes) build every step at the pass's first
        call, then select step i. Returns the step's metadata."""
        if self._bs == 0:
            raise ValueError("no forward metadata: call init_forward_metadata first")
        be = self.base.backend
        if self._graph:
            key = (i, lid)
            if self._first is None:
                self._first = key
            if key == self._first or self._plan is None or be._plan is not self._plan:
                self._plan = be.draft_prepare(self._bs, self.speculative_num_steps)
        elif self._plan is None or be._plan is not self._plan:
            raise ValueError("stale draft metadata: the backend built another step since "
                             "init_forward_metadata (call it again)")
        if self._plan.step != i:
            be.draft_select(i)
        return self.attn_backends[i].forward_metadata

    def step_slots(self, i):
        """Slots of step i's tokens (position seq_len + i of each request; 0 for padding),
        host int32, from the host rows of the last metadata call."""
        if self._bs == 0:
            raise ValueError("no forward metadata: call init_forward_metadata first")
        if self._req is None or self._seq is None or (self._graph and self.base.is_cuda):
            raise ValueError("the rows are not known on the host here: pass "
                             "forward_batch.out_cache_loc (a device tensor under a CUDA graph)")
        rt = self.base.req_to_token
        out = np.zeros(self._bs, np.int32)
        for j, (r, s) in enumerate(zip(self._req, self._seq)):
            if r != _lib.REQ_PAD:
                out[j] = rt[r, s + i]
        return out

    def step_metadata(self, step):
        """Step `step`'s metadata as the library built it (Backend.step_metadata: qo_indptr,
        kv_lens, block_table, sched_meta, num_splits; numpy views on the CPU, torch int32
        tensors on CUDA, valid until the next prepare). Selects that step. After a graph hook
        it builds the steps from the inputs first unless a pass did (on CUDA: enqueued on
        the current stream, outside the graph, e.g. after a replay: the same metadata as
        the replay's)."""
        be = self.base.backend
        if self._bs == 0:
            raise ValueError("no forward metadata: call init_forward_metadata first")
        if self._plan is None or be._plan is not self._plan:
            if not self._graph:
                raise ValueError("stale draft metadata: the backend built another step since "
                                 "init_forward_metadata (call it again)")
            self._plan = be.draft_prepare(self._bs, self.speculative_num_steps)
        be.draft_select(step)
        return be.step_metadata()

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        """Make sure the fixed inputs (shared with the base backend: cuda_graph_req_pool_indices
        / cuda_graph_seq_lens) and the draft workspace exist, for batches up to max_bs rows."""
        if max_bs > self.base.max_bs:
            raise ValueError("init_cuda_graph_state: max_bs %d exceeds %d"
                             % (max_bs, self.base.max_bs))
        ids, seq = self._buffers()
        lim = self.base.backend.graph_max_bs
        if max_bs > lim:
            raise ValueError("init_cuda_graph_state: the graph buffers exist for max_bs %d (they "
                             "are allocated once)" % lim)
        self.cuda_graph_max_bs = int(max_bs)
        self.cuda_graph_req_pool_indices, self.cuda_graph_seq_lens = ids, seq

    def init_forward_metadata_capture_cuda_graph(self, forward_batch=None, *, bs=None):
        """Capture-time metadata (outside the graph, before the warm-up and captured passes):
        rows [0, bs) of the inputs become padding rows; each pass's first forward call then
        runs the draft prepare (recorded by a capture)."""
        bs = bs if bs is not None else forward_batch.batch_size
        self._require(bs)
        base = self.base
        ids, seq = base.backend.graph_inputs()
        rid, sl = np.full(bs, _lib.REQ_PAD, np.int32), np.ones(bs, np.int32)
        if base.is_cuda:
            ids[:bs].fill_(_lib.REQ_PAD)
            seq[:bs].fill_(1)
            plans = None
        else:
            plans = self._host_plans(rid, sl)
            ids[:bs], seq[:bs] = rid, sl
        base.backend.sync()
        self.draft_plan = None
        self._set(bs, rid, sl, True, bs, plans)
        return self.attn_backends[0].forward_metadata

    def init_forward_metadata_replay_cuda_graph(self, forward_batch=None, bs=None, *,
                                                req_pool_indices=None, seq_lens=None,
                                                seq_lens_cpu=None, num_real=None):
        """Replay-time metadata for a captured size bs (outside the graph, before replay()):
        the real rows go into the inputs, rows past num_real (or past the given arrays)
        become padding rows, and the request table's device copy is synced. On CUDA, CUDA
        tensors are copied on the device (no host sync; seq_lens is preferred over
        seq_lens_cpu then); on the CPU the rows are checked first (MLAError, inputs
        untouched)."""
        fb = forward_batch
        ids_src = req_pool_indices if req_pool_indices is not None else fb.req_pool_indices
        if seq_lens is None and seq_lens_cpu is None and fb is not None:
            seq_lens = getattr(fb, "seq_lens", None)
            seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
        bs = bs if bs is not None else _nrows(ids_src)
        self._require(bs)
        base = self.base
        if base.is_cuda:
            on_dev = getattr(seq_lens, "is_cuda", False)
            seq_src = seq_lens if on_dev or seq_lens_cpu is None else seq_lens_cpu
            padded = base._write_device_inputs(bs, ids_src, seq_src, num_real)
            rid = sl = plans = None
        else:
            b, padded = base._batch_from(None, Mode.DECODE, ids_src,
                                         seq_lens_cpu if seq_lens_cpu is not None else seq_lens,
                                         None, None, 0, pad_to=bs, num_real=num_real)
            if b.bs != bs:
                raise ValueError("replay: %d rows for a graph of batch size %d" % (b.bs, bs))
            rid, sl = b.keep[0], b.keep[1]
            plans = self._host_plans(rid, sl)  # checks the rows first
            self._write_host(bs, rid, sl)
        base.backend.sync()
        self.draft_plan = None
        self._set(bs, rid, sl, True, padded, plans)
        return self.attn_backends[0].forward_metadata

    def _require(self, bs):
        if self.cuda_graph_max_bs is None:
            raise ValueError("call init_cuda_graph_state first")
        if bs < 1:
            raise ValueError("bs = %d: a draft graph has at least one row" % bs)
        if bs > self.cuda_graph_max_bs:
            raise ValueError("bs = %d exceeds the graph state's max_bs = %d"
                             % (bs, self.cuda_graph_max_bs))
