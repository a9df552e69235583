"""SglangMLABackend: libmla shaped like sglang's MLA attention backends.

The method names and arguments follow sglang's attention-backend interface
(init_forward_metadata, forward_decode, forward_extend, the CUDA-graph
init/capture/replay hooks, a multi-step draft backend with one plan per
step) over plain tensors, so an engine author can map one onto the other.
What differs, and why:

* libmla owns the KV cache and req_to_token (its request table with a page
  allocator); the engine asks it for slots (alloc_req / extend_req, the
  slots being out_cache_loc) instead of keeping its own pools.
* Metadata is read from host copies (seq_lens_cpu, extend_prefix_lens_cpu,
  ...) when the batch carries them: planning is host work.
* CUDA graphs: on the CPU the capture/replay hooks rebuild the plan (plain
  metadata). Real graph capture needs libmla's CUDA attention kernels, which
  are not built yet (a CUDA context answers MLA_ERR_UNSUPPORTED for
  attention); the hooks already pad batches the way a captured graph needs
  (padding rows are REQ_PAD rows reading only the reserved slot 0).
"""

import enum
import sys

import numpy as np

from . import _lib
from ._lib import Mode
from ._tensor import inspect
from .api import (Backend, Context, DraftPlanner, Planner, _BatchArgs, attention_absorbed,
                  mla_dtype)


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
    """What init_forward_metadata leaves for the forward calls (forward_metadata).

    plan: the libmla Plan; it carries both families of metadata a kernel
    might want: FlashInfer-style qo_indptr / kv_indptr / kv_indices and
    FlashMLA-style block_table / sched_meta (tile-scheduler metadata) /
    num_splits.
    """

    def __init__(self, mode, plan, uses_mha, padded_rows=0):
        self.mode = mode
        self.plan = plan
        self.uses_mha = uses_mha
        self.padded_rows = padded_rows

    @property
    def block_kv_indices(self):  # FlashMLA's name for the block table
        return self.plan.block_table


def _layer_id(layer):
    return int(getattr(layer, "layer_id", layer))


class SglangMLABackend:
    """An MLA attention backend over libmla with sglang's method names.

    Geometry is DeepSeek's: kv_lora_rank 512, qk_rope_head_dim 64 (fixed by
    libmla); qk_nope_head_dim and v_head_dim (default 128/128) shape the MHA
    prefill path. scale is the model's softmax scale (sglang: layer.scaling).
    dtype is the activation dtype (q, latent rows, output): "bf16", "f16" or
    "f32"; kv_cache_dtype the cache's: "bf16", "f16", "fp8", "fp8_block".
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

    # ---- the pools (sglang: req_to_token_pool + token_to_kv_pool) -------------------------

    @property
    def req_to_token(self):
        """int32 [max_reqs, max_context] view: slot of each position of each request."""
        return self.req_table.req_to_token

    def alloc_req(self):
        return self.req_table.add()

    def free_req(self, req_id):
        self.req_table.free(req_id)

    def extend_req(self, req_id, n):
        """Append n positions to a request; returns their slots (this step's out_cache_loc)."""
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
        self.cache.write(_layer_id(layer), loc, c, r, dtype=self.dtype)

    def get_key_buffer(self, layer):
        """One layer's raw cache bytes [num_slots, row_bytes] (CPU: a numpy view)."""
        return self.cache.layer_view(_layer_id(layer))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

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
        object or the same fields as keywords."""
        b, padded = self._batch_from(forward_batch, forward_mode, req_pool_indices, seq_lens,
                                     extend_prefix_lens, extend_seq_lens, num_draft_tokens)
        return self._plan(b, padded)

    def _plan(self, b, padded):
        p = self.backend.plan(b.mode, batch_args=b)
        self.forward_metadata = MLAMetadata(p.mode, p, self.backend._uses_mha, padded)
        return self.forward_metadata

    # ---- CUDA graphs (CPU: plain metadata rebuild) ------------------------------------------

    def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None):
        """Fix the largest batch a graph is captured for. On the CPU there is nothing to
        preallocate beyond the plan workspace (sized at creation); with the CUDA kernels this
        is where the fixed device copies of the plan arrays would live."""
        if max_bs > self.max_bs or max_num_tokens > self.max_num_tokens:
            raise ValueError("init_cuda_graph_state: max_bs %d / max_num_tokens %d exceed the "
                             "backend's %d / %d" % (max_bs, max_num_tokens, self.max_bs,
                                                    self.max_num_tokens))
        self.cuda_graph_max_bs = int(max_bs)
        self.cuda_graph_max_num_tokens = int(max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens,
                                                 encoder_lens=None, forward_mode=None,
                                                 spec_info=None):
        """Capture-time metadata: the captured batch is dummy data, so every row is a padding
        row (REQ_PAD, seq_len = the fill value) of the captured size bs."""
        self._require_graph_state(bs)
        fill = self.get_cuda_graph_seq_len_fill_value()
        ndt = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        b, padded = self._batch_from(None, forward_mode or Mode.DECODE,
                                     np.full(bs, _lib.REQ_PAD, np.int32),
                                     np.full(bs, fill, np.int32), None, None, ndt)
        return self._plan(b, padded)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum=None, encoder_lens=None,
                                                forward_mode=None, spec_info=None,
                                                seq_lens_cpu=None, num_real=None):
        """Replay-time metadata for a captured size bs: rows past num_real (or past the given
        arrays, or with req id REQ_PAD) are padding rows."""
        self._require_graph_state(bs)
        ndt = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        b, padded = self._batch_from(None, forward_mode or Mode.DECODE, req_pool_indices,
                                     seq_lens_cpu if seq_lens_cpu is not None else seq_lens,
                                     None, None, ndt, pad_to=bs, num_real=num_real)
        if b.bs != bs and b.mode != Mode.IDLE:
            raise ValueError("replay: %d rows for a graph of batch size %d" % (b.bs, bs))
        return self._plan(b, padded)

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
                  out_cache_loc=None):
        md = self._meta()
        p = md.plan
        T, H = p.num_q_tokens, self.num_heads
        lid = _layer_id(layer)
        new = None
        if save_kv_cache and k is not None:
            loc = out_cache_loc if out_cache_loc is not None else forward_batch.out_cache_loc
            c, r = self._split_latent(k, k_rope)
            new = (loc if isinstance(loc, np.ndarray) and loc.dtype == np.int32 else _host(loc),
                   c, r)
        if q_rope is not None:
            q_nope, q_r = q.reshape(T, H, _lib.LATENT), q_rope.reshape(T, H, _lib.ROPE)
        else:
            qall = q.reshape(T, H, _lib.ROW)
            q_nope, q_r = qall[:, :, :_lib.LATENT], qall[:, :, _lib.LATENT:]
        if _is_contig(q_nope) and _is_contig(q_r):
            # One C call: the latent write, then attention.
            res = self.backend.forward(lid, new_slots=new[0] if new else None,
                                       new_c=new[1] if new else None, new_r=new[2] if new else None,
                                       q_nope=q_nope, q_rope=q_r, return_lse=return_lse)
        else:
            # q_nope / q_rope are strided views of one [T, H, 576] tensor: mla_forward_args has
            # no strides, so write the rows and call the kernel that takes them.
            if new:
                self.cache.write(lid, new[0], new[1], new[2], dtype=self.dtype)
            res = attention_absorbed(self.ctx, self.cache, lid, p, q_nope, q_r, scale=self.scaling,
                                     return_lse=return_lse, dtype=self.dtype)
        if return_lse:
            o, lse = res
            return o.reshape(T, H * _lib.LATENT), lse
        return res.reshape(T, H * _lib.LATENT)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, return_lse=False):
        """Decode: q [bs, H * 576] (or q_nope [bs, H, 512] with q_rope [bs, H, 64]); k this
        step's latent rows [bs, 576] (or [bs, 512] with k_rope [bs, 64]), written to
        forward_batch.out_cache_loc first; v is unused (MLA's V is the latent). Returns
        o [bs, H * 512] (and lse [bs, H] with return_lse, for DCP merging)."""
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, return_lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, *, latent=None, kv_b_proj=None, return_lse=False):
        """EXTEND, TARGET_VERIFY and DRAFT_EXTEND.

        Absorbed modes (verify, draft extend, extend over a prefix with
        extend_impl="absorbed"): as forward_decode. MHA (extend without prefix,
        or with extend_impl="mha_chunked"): q [T, H * (nope + 64)] (or q with
        q_rope), k [T, H, nope + 64] (or k with k_rope), v [T, H, v_dim];
        latent (c [T, 512], r [T, 64]) or [T, 576] are this step's latent rows
        to store (sglang's model stores them itself: then pass latent=None and
        use set_kv_buffer); kv_b_proj [H, nope + v_dim, 512] for chunked
        prefixes. Returns o [T, H * v_dim].
        """
        md = self._meta()
        if not md.uses_mha:
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                                  return_lse)
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
            new = dict(new_slots=_host(forward_batch.out_cache_loc), new_c=c, new_r=r)
        res = self.backend.forward(_layer_id(layer), q=_contig(q.reshape(T, H, dqk)),
                                   k=_contig(k.reshape(T, H, dqk)),
                                   v=_contig(v.reshape(T, H, self.v_head_dim)), kv_b_proj=kv_b_proj,
                                   return_lse=return_lse, **new)
        if return_lse:
            o, lse = res
            return o.reshape(T, H * self.v_head_dim), lse
        return res.reshape(T, H * self.v_head_dim)


class _DraftStep:
    """Step i of a multi-step draft: its own plan over the shared cache."""

    def __init__(self, parent, step):
        self.parent = parent
        self.step = step
        self.planner = Planner(parent.base.ctx, max_bs=parent.base.max_bs,
                               max_q_tokens=parent.base.max_bs,
                               max_kv_tokens=parent.base.max_bs * parent.base.max_context_len,
                               max_context=parent.base.max_context_len,
                               page_size=parent.base.page_size)
        self.forward_metadata = None

    def forward_decode(self, q, k, v, layer, forward_batch=None, save_kv_cache=True, q_rope=None,
                       k_rope=None, return_lse=False):
        """Step i's decode: one query per request over keys [0, seq_len + i + 1); k is the
        step's latent row per request, stored at forward_batch.out_cache_loc (or, when that
        is None, at position seq_len + i of each request)."""
        base = self.parent.base
        md = self.forward_metadata
        if md is None or not md.plan.valid:
            raise ValueError("no forward metadata: call init_forward_metadata first")
        loc = getattr(forward_batch, "out_cache_loc", None) if forward_batch is not None else None
        if loc is None and save_kv_cache and k is not None:
            loc = self.parent.step_slots(self.step)
        # The functional path over the shared cache: the base backend holds one plan (its
        # own step's), each draft step holds its own.
        return self._run(base, q, k, layer, save_kv_cache, q_rope, k_rope, return_lse, loc)

    def _run(self, base, q, k, layer, save_kv_cache, q_rope, k_rope, return_lse, loc):
        p = self.forward_metadata.plan
        T, H = p.num_q_tokens, base.num_heads
        lid = _layer_id(layer)
        if save_kv_cache and k is not None:
            c, r = base._split_latent(k, k_rope)
            base.cache.write(lid, _host(loc), c, r, dtype=base.dtype)
        if q_rope is not None:
            q_nope, q_r = q.reshape(T, H, _lib.LATENT), q_rope.reshape(T, H, _lib.ROPE)
        else:
            qall = q.reshape(T, H, _lib.ROW)
            q_nope, q_r = qall[:, :, :_lib.LATENT], qall[:, :, _lib.LATENT:]
        res = attention_absorbed(base.ctx, base.cache, lid, p, q_nope, q_r, scale=base.scaling,
                                 return_lse=return_lse, dtype=base.dtype)
        if return_lse:
            return res[0].reshape(T, H * _lib.LATENT), res[1]
        return res.reshape(T, H * _lib.LATENT)


class SglangMLAMultiStepDraftBackend:
    """Multi-step draft decode (EAGLE / MTP, topk = 1): one plan per step over the base
    backend's cache and request table, like sglang's list of per-step backends.

    Before init_forward_metadata, every request must hold its num_steps draft
    positions (extend it by num_steps: step i's token sits at position
    seq_len + i). Step i attends to keys [0, seq_len + i + 1).
    """

    def __init__(self, base, speculative_num_steps, topk=1):
        if topk != 1:
            raise ValueError("topk = %d: the multi-step draft backend supports topk = 1" % topk)
        self.base = base
        self.topk = topk
        self.speculative_num_steps = int(speculative_num_steps)
        self.attn_backends = [_DraftStep(self, i) for i in range(self.speculative_num_steps)]
        self.draft_planner = DraftPlanner(base.ctx, max_bs=base.max_bs,
                                          num_steps=self.speculative_num_steps,
                                          max_context=base.max_context_len)
        self.draft_plan = None
        self._req = self._seq = None
        self.cuda_graph_max_bs = None

    def init_forward_metadata(self, forward_batch=None, *, req_pool_indices=None, seq_lens=None):
        fb = forward_batch
        rid = _host(req_pool_indices if req_pool_indices is not None else fb.req_pool_indices)
        sl = _host(seq_lens if seq_lens is not None else _field(fb, "seq_lens"))
        self._build(rid, sl)

    def _build(self, rid, sl):
        self._req, self._seq = rid, sl
        real = rid != _lib.REQ_PAD
        for i, step in enumerate(self.attn_backends):
            p = step.planner.build(self.base.req_table, Mode.DECODE, rid,
                                   np.where(real, sl + i + 1, sl).astype(np.int32),
                                   num_heads=self.base.num_heads)
            step.forward_metadata = MLAMetadata(Mode.DECODE, p, False,
                                                int(np.count_nonzero(~real)))
        if real.all() and rid.shape[0]:
            # FlashInfer-style metadata of every step in one call (kv_indptr [steps, bs+1]).
            self.draft_plan = self.draft_planner.build(self.base.req_table, rid, sl)
        else:
            self.draft_plan = None

    def step_slots(self, i):
        """Slots of step i's tokens (position seq_len + i of each request; 0 for padding)."""
        rt = self.base.req_to_token
        out = np.zeros(self._req.shape[0], np.int32)
        for j, (r, s) in enumerate(zip(self._req, self._seq)):
            if r != _lib.REQ_PAD:
                out[j] = rt[r, s + i]
        return out

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        if max_bs > self.base.max_bs:
            raise ValueError("init_cuda_graph_state: max_bs %d exceeds %d" % (max_bs, self.base.max_bs))
        self.cuda_graph_max_bs = int(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch=None, *, bs=None):
        bs = bs if bs is not None else forward_batch.batch_size
        self._require(bs)
        self._build(np.full(bs, _lib.REQ_PAD, np.int32), np.ones(bs, np.int32))

    def init_forward_metadata_replay_cuda_graph(self, forward_batch=None, bs=None, *,
                                                req_pool_indices=None, seq_lens=None,
                                                num_real=None):
        fb = forward_batch
        rid = _host(req_pool_indices if req_pool_indices is not None else fb.req_pool_indices)
        sl = _host(seq_lens if seq_lens is not None else _field(fb, "seq_lens"))
        bs = bs if bs is not None else rid.shape[0]
        self._require(bs)
        if num_real is not None:
            rid, sl = rid[:num_real], sl[:num_real]
        n = bs - rid.shape[0]
        if n > 0:
            rid = np.concatenate([rid, np.full(n, _lib.REQ_PAD, np.int32)])
            sl = np.concatenate([sl, np.ones(n, np.int32)])
        self._build(rid.astype(np.int32), sl.astype(np.int32))

    def _require(self, bs):
        if self.cuda_graph_max_bs is None:
            raise ValueError("call init_cuda_graph_state first")
        if bs > self.cuda_graph_max_bs:
            raise ValueError("bs = %d exceeds the graph state's max_bs = %d"
                             % (bs, self.cuda_graph_max_bs))
