"""The functional API: one Python object or function per part of the C API.

Handles (Context, KVCache, RequestTable, Backend) own their C object and free
it in close() (or when garbage collected); objects made from another keep it
alive. Every mla_status other than MLA_OK raises MLAError with the status and
the handle's last-error text; every tensor argument is checked in Python first
(ValueError naming the argument) so that no bad pointer reaches C.

Not thread-safe: use one Context per thread (a Context's scratch workspace
and last-error text are shared by every call made through it).
"""

import ctypes
import sys
import weakref

import numpy as np

from . import _lib
from ._lib import DType, Device, ExtendImpl, Mode, Status
from ._tensor import (Tensor, check, dtype_of, element_strides, empty_like_kind, inspect, int32_array,
                      itemsize, mla_dtype, mla_dtype_to_name, ptr_of)

_c = _lib.lib
_byref = ctypes.byref
_ACT = ("f32", "bf16", "f16")
_ACT_DTYPE = {"f32": int(DType.F32), "bf16": int(DType.BF16), "f16": int(DType.F16)}


class MLAError(RuntimeError):
    """A libmla call returned a status other than MLA_OK.

    Attributes: status (Status, or the raw int for an unknown value),
    status_name ("MLA_ERR_..."), function (the C function), message (the
    handle's last-error text, naming the bad argument).
    """

    def __init__(self, status, function, message=""):
        try:
            self.status = Status(status)
        except ValueError:
            self.status = int(status)
        self.status_name = _lib.status_string(status)
        self.function = function
        self.message = message or ""
        # C messages already start with the function's name; say it once.
        msg = self.message if self.message.startswith(function) else \
            ("%s: %s" % (function, self.message) if self.message else function)
        super().__init__("%s (%d): %s" % (self.status_name, int(status), msg))


def _text(p):
    return p.decode(errors="replace") if p else ""


def _raise(st, function, message):
    raise MLAError(st, function, message)


def _view_i32(ptr, shape, owner):
    """A read-only int32 numpy view of C memory that keeps `owner` alive."""
    n = 1
    for d in shape:
        n *= d
    if n == 0 or not ptr:
        a = np.empty(shape, dtype=np.int32)
    else:
        buf = (ctypes.c_int32 * n).from_address(ptr)
        buf._owner = owner
        a = np.frombuffer(buf, dtype=np.int32).reshape(shape)
    a.flags.writeable = False
    return a


def _handle_of(obj, cls, name, allow_none=False):
    """The C handle of a binding object passed as argument `name` (ValueError otherwise)."""
    if obj is None and allow_none:
        return None
    if not isinstance(obj, cls):
        raise ValueError("argument '%s': expected a libmla.%s, got %s"
                         % (name, cls.__name__, type(obj).__name__))
    return obj.handle


def _adopt(parent, child):
    """Record child as depending on parent: parent.close() closes the child first (a C handle
    must not outlive the handles it points to)."""
    if len(parent._children) > 64:
        parent._children = [w for w in parent._children if w() is not None]
    parent._children.append(weakref.ref(child))


def _close_children(obj):
    for wr in reversed(getattr(obj, "_children", ())):
        c = wr()
        if c is not None:
            c.close()
    obj._children = []


def _parse_device(device):
    if isinstance(device, Device):
        return device, 0
    s = str(device)
    if s == "cpu":
        return Device.CPU, 0
    if s == "cuda":
        return Device.CUDA, None
    if s.startswith("cuda:"):
        return Device.CUDA, int(s[5:])
    raise ValueError("device = %r: expected 'cpu', 'cuda' or 'cuda:N'" % (device,))


def _parse_mode(mode):
    if isinstance(mode, Mode):
        return mode
    if isinstance(mode, int):
        return Mode(mode)
    key = str(mode).upper()
    key = {"VERIFY": "TARGET_VERIFY", "PREFILL": "EXTEND"}.get(key, key)
    try:
        return Mode[key]
    except KeyError:
        raise ValueError("mode = %r: expected one of idle, decode, target_verify, draft_extend, "
                         "extend" % (mode,)) from None


def _cache_dtype(dtype):
    if isinstance(dtype, DType):
        return dtype
    s = str(dtype).replace("torch.", "").lower()
    table = {"bf16": DType.BF16, "bfloat16": DType.BF16, "f16": DType.F16, "float16": DType.F16,
             "fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3, "float8_e4m3fn": DType.FP8_E4M3,
             "fp8_block": DType.FP8_E4M3_BLOCK, "fp8_e4m3_block": DType.FP8_E4M3_BLOCK}
    if s not in table:
        raise ValueError("cache dtype = %r: expected 'bf16', 'f16', 'fp8' (e4m3, per-layer scale) "
                         "or 'fp8_block' (656-byte block-scaled rows)" % (dtype,))
    return table[s]


# ---- context -------------------------------------------------------------------------

_raw_stream_fn = None


def _torch_raw_stream():
    """A function device_index -> torch's current cudaStream_t there (an int), or None while
    torch is not imported. torch's private raw getter when present (it skips building a
    Stream object: about 1 us less per call), else the public current_stream()."""
    global _raw_stream_fn
    if _raw_stream_fn is not None:
        return _raw_stream_fn
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    if raw is None:
        def raw(index, _cs=torch.cuda.current_stream):
            return _cs(index).cuda_stream
    _raw_stream_fn = raw
    return raw


class _Handle:
    """What every wrapped C handle shares: context-manager and finaliser
    lifetime, the live-handle accessor, and turning a status into MLAError
    with the handle's own last-error text. Subclasses define close() and name
    their C last-error function in _LAST_ERROR."""

    _LAST_ERROR = None  # name of the mla_*_last_error function

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def handle(self):
        if not getattr(self, "_h", None):
            raise ValueError(f"the {type(self).__name__} is closed")
        return self._h

    def _check(self, st, function):
        if st:
            _raise(st, function, _text(getattr(_c, self._LAST_ERROR)(self._h)))

    @property
    def last_error(self):
        return _text(getattr(_c, self._LAST_ERROR)(self.handle))


class Context(_Handle):
    """mla_ctx: a device (CPU or CUDA), CPU worker threads and the last error.

    device: "cpu" (default), "cuda" or "cuda:N". num_threads: CPU workers
    (0 = every online CPU). stream (CUDA contexts): "torch" (default) makes
    each call run on torch's current CUDA stream of the tensors' device, an
    int is a cudaStream_t, None the legacy default stream.
    """

    _LAST_ERROR = "mla_ctx_last_error"

    def __init__(self, device="cpu", num_threads=0, device_id=None, stream="torch"):
        dev, idx = _parse_device(device)
        if device_id is None:
            device_id = idx or 0
        self.device = "cuda" if dev == Device.CUDA else "cpu"
        self.device_id = device_id if dev == Device.CUDA else None
        desc = _lib.CtxDesc(int(dev), int(num_threads), int(device_id))
        h = ctypes.c_void_p()
        st = _c.mla_ctx_create(_byref(desc), _byref(h))
        if st:
            # A failed create leaves no handle to hold a message: say it here.
            why = {
                Status.ERR_UNSUPPORTED: "this libmla (%s) was built without CUDA (MLA_CUDA=OFF)"
                % _lib.path,
                Status.ERR_DEVICE: "no usable CUDA device",
                Status.ERR_OUT_OF_RANGE: "device_id = %d is not a CUDA device" % device_id,
                Status.ERR_INVALID_ARGUMENT: "num_threads = %d (expected 0..1024) or device = %r"
                % (num_threads, device),
            }.get(st, "")
            _raise(st, "mla_ctx_create", why)
        self._h = h.value
        self._children = []
        self._ws = None  # scratch workspace (host numpy or device tensor), grown on demand
        self._ragged_ws = None  # attention_ragged's workspace="auto" (device, one counter)
        self._follow_torch = dev == Device.CUDA and stream == "torch"
        self._stream = None
        if dev == Device.CUDA and stream not in ("torch", None):
            self.set_stream(stream)

    # -- lifetime
    def close(self):
        """Destroy the context, after every cache, table and backend made from it."""
        _close_children(self)
        h, self._h = getattr(self, "_h", None), None
        if h:
            _c.mla_ctx_destroy(h)


    # -- queries

    @property
    def num_threads(self):
        n = ctypes.c_int()
        self._check(_c.mla_ctx_get_threads(self.handle, _byref(n)), "mla_ctx_get_threads")
        return n.value

    @num_threads.setter
    def num_threads(self, n):
        self._check(_c.mla_ctx_set_threads(self.handle, int(n)), "mla_ctx_set_threads")

    @property
    def cpu_isa(self):
        name = ctypes.c_char_p()
        self._check(_lib.fn("mla_ctx_cpu_isa")(self.handle, _byref(name)), "mla_ctx_cpu_isa")
        return _text(name.value)

    @property
    def is_cuda(self):
        return self.device == "cuda"

    def set_stream(self, stream):
        """CUDA contexts: launch on this cudaStream_t (an int, a torch.cuda.Stream, or None for
        the legacy default stream); stops following torch's current stream."""
        s = getattr(stream, "cuda_stream", stream)
        self._check(_c.mla_ctx_set_stream(self.handle, s or None), "mla_ctx_set_stream")
        self._stream = s or None
        self._follow_torch = False

    def synchronize(self):
        """Wait for the context's work; raises MLAError (OUT_OF_RANGE) for slots a device kernel
        skipped since the last call."""
        self._check(_c.mla_ctx_synchronize(self.handle), "mla_ctx_synchronize")

    # -- helpers for the calls
    def _before_launch(self, t):
        """CUDA contexts: follow torch's current stream of the tensor's device (t: a tensor
        or the binding's record of one)."""
        if not self._follow_torch or t is None:
            return
        obj = getattr(t, "obj", t) if isinstance(t, Tensor) else t
        get_device = getattr(obj, "get_device", None)
        if get_device is None:
            return
        raw = _torch_raw_stream()
        if raw is None:
            return
        s = raw(get_device())
        if s != self._stream:
            self._check(_c.mla_ctx_set_stream(self._h, s or None), "mla_ctx_set_stream")
            self._stream = s

    def _scratch(self, nbytes, like=None):
        """(pointer, size) of a workspace of at least nbytes, reused across calls."""
        ws = self._ws
        if ws is None or ws[1] < nbytes:
            n = max(int(nbytes), 4096)
            if self.device == "cuda":
                # Device workspace for the (future) CUDA kernels: a torch byte tensor.
                torch = sys.modules.get("torch")
                if torch is None:
                    raise ValueError("a CUDA context needs torch (imported) to allocate its device "
                                     "workspace")
                buf = torch.empty(n, dtype=torch.uint8, device="cuda:%d" % self.device_id)
                ptr = buf.data_ptr()
            else:
                buf = np.empty(n, dtype=np.uint8)
                ptr = buf.__array_interface__["data"][0]
            self._ws = ws = (ptr, n, buf)
        return ws[0], ws[1]

    def __repr__(self):
        if not getattr(self, "_h", None):
            return "<libmla.Context closed>"
        return "<libmla.Context %s threads=%d>" % (
            self.device if self.device == "cpu" else "cuda:%d" % self.device_id, self.num_threads)


# ---- KV cache -------------------------------------------------------------------------


class KVCache(_Handle):
    """mla_kv_cache: the paged latent cache, num_layers x [num_pages * page_size, row] .

    dtype: "bf16", "f16", "fp8" (e4m3 with one fp32 scale per layer, fp8_scales)
    or "fp8_block" (656-byte rows: e4m3 latent in 128-value blocks with fp32
    scales, bf16 rope). Slot s lives in page s // page_size; page 0 is the
    reserved dummy page.
    """

    _LAST_ERROR = "mla_kv_cache_last_error"

    def __init__(self, ctx, num_layers, num_pages, page_size, dtype="bf16", fp8_scales=None):
        self.ctx = ctx
        self._owner = None
        t = _cache_dtype(dtype)
        scales = None
        if fp8_scales is not None:
            scales = np.ascontiguousarray(np.asarray(fp8_scales, dtype=np.float32).reshape(-1))
            if scales.shape[0] != num_layers:
                raise ValueError("argument 'fp8_scales': length %d, expected num_layers = %d"
                                 % (scales.shape[0], num_layers))
        desc = _lib.KVCacheDesc(int(num_layers), int(num_pages), int(page_size), int(t),
                                scales.__array_interface__["data"][0] if scales is not None else None)
        h = ctypes.c_void_p()
        ctx._check(_c.mla_kv_cache_create(ctx.handle, _byref(desc), _byref(h)), "mla_kv_cache_create")
        self._h = h.value
        self._children = []
        _adopt(ctx, self)
        self._read_desc()

    @classmethod
    def _borrow(cls, ctx, handle, owner):
        """Wrap a cache owned by another object (a Backend): never destroyed here."""
        self = cls.__new__(cls)
        self.ctx = ctx
        self._owner = owner
        self._h = handle
        self._children = []
        self._read_desc()
        return self

    def _read_desc(self):
        d = _lib.KVCacheDesc()
        self._check(_c.mla_kv_cache_get_desc(self._h, _byref(d)), "mla_kv_cache_get_desc")
        self.num_layers = d.num_layers
        self.num_pages = d.num_pages
        self.page_size = d.page_size
        self.dtype = DType(d.dtype)
        self.num_slots = d.num_pages * d.page_size
        n = ctypes.c_size_t()
        self._check(_c.mla_kv_cache_row_bytes(self._h, _byref(n)), "mla_kv_cache_row_bytes")
        self.row_bytes = n.value

    def close(self):
        """Destroy the cache (after the request tables attached to it)."""
        _close_children(self)
        h, self._h = getattr(self, "_h", None), None
        if h and self._owner is None:
            _c.mla_kv_cache_destroy(h)



    @property
    def fp8_scales(self):
        """Per-layer scales (1.0 unless set; meaningful for the "fp8" dtype only)."""
        d = _lib.KVCacheDesc()
        self._check(_c.mla_kv_cache_get_desc(self.handle, _byref(d)), "mla_kv_cache_get_desc")
        arr = (ctypes.c_float * self.num_layers).from_address(d.fp8_scales)
        return [float(x) for x in arr]

    def set_fp8_scale(self, layer, scale):
        self._check(_c.mla_kv_cache_set_fp8_scale(self.handle, int(layer), float(scale)),
                    "mla_kv_cache_set_fp8_scale")

    def layer_data(self, layer):
        """Address of one layer's raw storage [num_slots, row_bytes] (device memory for a CUDA
        context)."""
        p = ctypes.c_void_p()
        self._check(_c.mla_kv_cache_layer_data(self.handle, int(layer), _byref(p)),
                    "mla_kv_cache_layer_data")
        return p.value

    def layer_view(self, layer, writable=False):
        """CPU caches: one layer's bytes as a numpy uint8 array [num_slots, row_bytes] (a view,
        read-only unless writable=True)."""
        if self.ctx.device != "cpu":
            raise ValueError("layer_view: the cache is in CUDA device memory; use layer_data()")
        p = self.layer_data(layer)
        buf = (ctypes.c_uint8 * (self.num_slots * self.row_bytes)).from_address(p)
        buf._owner = self
        a = np.frombuffer(buf, dtype=np.uint8).reshape(self.num_slots, self.row_bytes)
        a.flags.writeable = bool(writable)
        return a

    def write(self, layer, slots, c, r, dtype=None):
        """Scatter rows: c[t] [T, 512] and r[t] [T, 64] go to slot slots[t], converted to the
        cache dtype. dtype: the dtype of c/r when it cannot be read from them ("bf16" for
        uint16 arrays holding raw bf16). CUDA caches: slots, c and r are device tensors and the
        call is asynchronous on the context's stream."""
        self._write(layer, slots, c, r, dtype, "slots", None)

    def write_shard(self, layer, global_slots, c, r, world, rank, dtype=None):
        """Decode context parallel: this rank's share of a write. global_slots are the
        allocator's slots; rows whose slot mod world != rank belong to other ranks and are
        skipped, the others go to local slot global // world (world: power of two 1..64)."""
        self._write(layer, global_slots, c, r, dtype, "global_slots", (int(world), int(rank)))

    def _write(self, layer, slots, c, r, dtype, slots_name, shard):
        ctx = self.ctx
        dev = ctx.device
        bf16 = dtype is not None and mla_dtype(dtype) == DType.BF16
        dn = dtype_of(c)
        if dn == "u16" and bf16:
            dn = "bf16"
        if dn not in _ACT:  # the full check says what is wrong
            check(c, "c", dtypes=_ACT, shape=(None, _lib.LATENT), device=dev, bf16=bf16)
        cp = ptr_of(c, "c", dtypes=(dn,), shape=(None, _lib.LATENT), device=dev, bf16=bf16)
        n = c.shape[0]
        rp = ptr_of(r, "r", dtypes=(dn,), shape=(n, _lib.ROPE), device=dev, bf16=bf16)
        t = _ACT_DTYPE[dn]
        if dtype is not None and mla_dtype(dtype) != t:
            raise ValueError("argument 'c': dtype %s, but dtype=%r was given" % (dn, dtype))
        if dev == "cpu":
            _, sp = int32_array(slots, slots_name, length=n)
        else:
            sp = ptr_of(slots, slots_name, dtypes=("i32",), shape=(n,), device=dev)
            ctx._before_launch(c)
        if shard is None:
            st, fn = _c.mla_kv_cache_write(self.handle, int(layer), n, sp, cp, rp, t), "mla_kv_cache_write"
        else:
            st = _c.mla_kv_cache_write_shard(self.handle, int(layer), n, sp, cp, rp, t, shard[0], shard[1])
            fn = "mla_kv_cache_write_shard"
        if st:
            self._check(st, fn)

    def pack_rows(self, layer, src_slots, dst, dst_layer, dst_first_slot):
        """Copy rows src_slots[i] of this cache's `layer` into consecutive slots dst_first_slot + i
        of `dst`'s dst_layer, bytes as stored (same dtype and, for fp8, the same layer scale;
        the range must avoid dst's page 0). EXTEND under DCP: each rank's rows into its block
        of the gathered cache (see dcp_gather_table). CPU: host slots; CUDA: a device tensor,
        asynchronous."""
        dh = _handle_of(dst, KVCache, "dst")
        dev = self.ctx.device
        if dev == "cpu":
            sa, sp = int32_array(src_slots, "src_slots")
            n = sa.shape[0]
        else:
            ts = check(src_slots, "src_slots", dtypes=("i32",), shape=(None,), device=dev)
            n, sp = ts.shape[0], ts.ptr
            self.ctx._before_launch(src_slots)
        st = _c.mla_kv_cache_pack_rows(self.handle, int(layer), n, sp or None, dh, int(dst_layer),
                                       int(dst_first_slot))
        if st:
            dst._check(st, "mla_kv_cache_pack_rows")

    def read(self, layer, slots, dtype="f32", *, c_out=None, r_out=None, parts="cr"):
        """Gather rows back, dequantized to dtype ("f32", "bf16", "f16"); returns (c, r) with
        c [T, 512] and r [T, 64] (None for a part not in `parts`). Outputs are allocated
        (numpy; torch on the slots' device for CUDA caches) unless given."""
        ctx = self.ctx
        dev = ctx.device
        t = mla_dtype(dtype)
        name = mla_dtype_to_name(t)
        if dev == "cpu":
            sa, sp = int32_array(slots, "slots")
            n = sa.shape[0]
            like = c_out if c_out is not None else r_out
        else:
            ts = check(slots, "slots", dtypes=("i32",), shape=(None,), device=dev)
            n, sp, like = ts.shape[0], ts.ptr, slots
        want_c = "c" in parts or c_out is not None
        want_r = "r" in parts or r_out is not None
        if not (want_c or want_r):
            raise ValueError("argument 'parts': name at least one of 'c' and 'r'")
        if want_c and c_out is None:
            c_out = empty_like_kind(like, (n, _lib.LATENT), name)
        if want_r and r_out is None:
            r_out = empty_like_kind(like, (n, _lib.ROPE), name)
        tc = check(c_out, "c_out", dtypes=(name,), shape=(n, _lib.LATENT), device=dev, writable=True,
                   bf16=True, allow_none=True)
        tr = check(r_out, "r_out", dtypes=(name,), shape=(n, _lib.ROPE), device=dev, writable=True,
                   bf16=True, allow_none=True)
        if dev != "cpu":
            ctx._before_launch(tc or tr)
        self._check(_c.mla_kv_cache_read(self.handle, int(layer), n, sp, tc.ptr if tc else None,
                                         tr.ptr if tr else None, int(t)), "mla_kv_cache_read")
        return c_out, r_out

    def copy_rows(self, src_slots, dst_slots):
        """Copy rows src_slots[i] -> dst_slots[i] in every layer (host index arrays, any cache)."""
        sa, sp = int32_array(src_slots, "src_slots")
        _, dp = int32_array(dst_slots, "dst_slots", length=sa.shape[0])
        self._check(_c.mla_kv_cache_copy_rows(self.handle, sa.shape[0], sp, dp),
                    "mla_kv_cache_copy_rows")

    def __repr__(self):
        return "<libmla.KVCache %s layers=%d pages=%d page_size=%d>" % (
            self.dtype.name.lower(), self.num_layers, self.num_pages, self.page_size)


# ---- request table --------------------------------------------------------------------


class RequestTable(_Handle):
    """mla_req_table: req_to_token [max_reqs, max_context] and the page allocator.

    With a cache attached, copy-on-write moves rows in every layer; num_pages
    and page_size default to the cache's.
    """

    _LAST_ERROR = "mla_req_table_last_error"

    def __init__(self, ctx, max_reqs, max_context, num_pages=None, page_size=None, cache=None):
        self.ctx = ctx
        self.cache = cache
        self._owner = None
        if cache is not None:
            num_pages = cache.num_pages if num_pages is None else num_pages
            page_size = cache.page_size if page_size is None else page_size
        if num_pages is None or page_size is None:
            raise ValueError("RequestTable: give num_pages and page_size, or a cache")
        desc = _lib.ReqTableDesc(int(max_reqs), int(max_context), int(num_pages), int(page_size))
        h = ctypes.c_void_p()
        ch = _handle_of(cache, KVCache, "cache", allow_none=True)
        ctx._check(_c.mla_req_table_create(ctx.handle, _byref(desc), ch, _byref(h)),
                   "mla_req_table_create")
        self._h = h.value
        _adopt(ctx, self)
        if cache is not None:
            _adopt(cache, self)
        self._read_desc()

    @classmethod
    def _borrow(cls, ctx, handle, owner, cache):
        self = cls.__new__(cls)
        self.ctx = ctx
        self.cache = cache
        self._owner = owner
        self._h = handle
        self._read_desc()
        return self

    def _read_desc(self):
        d = _lib.ReqTableDesc()
        self._check(_c.mla_req_table_get_desc(self._h, _byref(d)), "mla_req_table_get_desc")
        self.max_reqs, self.max_context = d.max_reqs, d.max_context
        self.num_pages, self.page_size = d.num_pages, d.page_size
        self._i = ctypes.c_int()
        self._i32 = ctypes.c_int32()

    def close(self):
        h, self._h = getattr(self, "_h", None), None
        if h and self._owner is None:
            _c.mla_req_table_destroy(h)



    def add(self):
        """A new empty request; returns its id (the lowest free one)."""
        self._check(_c.mla_req_add(self.handle, _byref(self._i32)), "mla_req_add")
        return self._i32.value

    def extend(self, req_id, n, out=None):
        """Append n positions; returns their slots (int32 [n]: this step's out_cache_loc).
        All-or-nothing: CACHE_FULL / CAPACITY change nothing."""
        n = int(n)
        if n < 0:
            raise ValueError("argument 'n' = %d is negative" % n)
        if out is None:
            out = np.empty(n, dtype=np.int32)
        t = check(out, "out", dtypes=("i32",), shape=(n,), device="cpu", writable=True)
        self._check(_c.mla_req_extend(self.handle, int(req_id), n, t.ptr or None), "mla_req_extend")
        return out

    def free(self, req_id):
        self._check(_c.mla_req_free(self.handle, int(req_id)), "mla_req_free")

    def fork(self, src_id, prefix_len):
        """A new request sharing positions [0, prefix_len) of src_id; returns its id."""
        self._check(_c.mla_req_fork(self.handle, int(src_id), int(prefix_len), _byref(self._i32)),
                    "mla_req_fork")
        return self._i32.value

    def truncate(self, req_id, new_len):
        self._check(_c.mla_req_truncate(self.handle, int(req_id), int(new_len)), "mla_req_truncate")

    def length(self, req_id):
        self._check(_c.mla_req_length(self.handle, int(req_id), _byref(self._i)), "mla_req_length")
        return self._i.value

    def is_live(self, req_id):
        self._check(_c.mla_req_is_live(self.handle, int(req_id), _byref(self._i)), "mla_req_is_live")
        return bool(self._i.value)

    @property
    def free_pages(self):
        self._check(_c.mla_req_table_free_pages(self.handle, _byref(self._i)),
                    "mla_req_table_free_pages")
        return self._i.value

    def page_refs(self, page):
        self._check(_c.mla_req_table_page_refs(self.handle, int(page), _byref(self._i)),
                    "mla_req_table_page_refs")
        return self._i.value

    @property
    def req_to_token(self):
        """Read-only numpy view int32 [max_reqs, max_context] of the live table (it follows
        later extends; MLA_SLOT_UNUSED past each request's length)."""
        p = ctypes.c_void_p()
        self._check(_c.mla_req_table_data(self.handle, _byref(p)), "mla_req_table_data")
        return _view_i32(p.value, (self.max_reqs, self.max_context), self)

    def slots(self, req_id, start=0, end=None):
        """Slots of positions [start, end) of one request (a copy)."""
        n = self.length(req_id)
        end = n if end is None else end
        return np.array(self.req_to_token[req_id, start:end])


# ---- batches and plans ----------------------------------------------------------------


class _BatchArgs:
    """An mla_batch plus the int32 arrays its pointers point into."""

    __slots__ = ("c", "keep", "mode", "bs", "prefix_any")

    def __init__(self, mode, req_ids=None, seq_lens=None, extend_lens=None, prefix_lens=None,
                 num_draft_tokens=0):
        m = _parse_mode(mode)
        if m == Mode.IDLE and req_ids is None:
            req_ids, seq_lens = (), ()
        rid, rp = int32_array(req_ids, "req_ids")
        bs = rid.shape[0]
        sl, sp = int32_array(seq_lens, "seq_lens", length=bs)
        el, ep = int32_array(extend_lens, "extend_lens", length=bs, allow_none=True)
        pl, pp = int32_array(prefix_lens, "prefix_lens", length=bs, allow_none=True)
        self.c = _lib.Batch(int(m), bs, rp if bs else None, sp if bs else None,
                            ep if bs else None, pp if bs else None, int(num_draft_tokens or 0))
        self.keep = (rid, sl, el, pl)
        self.mode = m
        self.bs = bs
        self.prefix_any = bool(m == Mode.EXTEND and pl is not None and bs and pl.max() > 0)


def batch(mode, req_ids=None, seq_lens=None, extend_lens=None, prefix_lens=None,
          num_draft_tokens=0):
    """Describe a batch (mla_batch). Modes and lengths as in mla.h:
    DECODE seq_lens include this token; TARGET_VERIFY seq_lens exclude the
    num_draft_tokens drafts; DRAFT_EXTEND has extend_lens queries (or a fixed
    window of num_draft_tokens), keys = seq_lens; EXTEND has seq_lens -
    prefix_lens queries. A req_ids entry of REQ_PAD (-1) is a padding row."""
    return _BatchArgs(mode, req_ids, seq_lens, extend_lens, prefix_lens, num_draft_tokens)


class Plan:
    """A built mla_plan: scalars as attributes, arrays as read-only numpy views.

    The views point into the planner's (or backend's) workspace: the plan is
    valid until that planner builds its next plan (`valid` says; using a stale
    plan in a kernel raises ValueError).
    """

    _ARRAYS = ("req_ids", "qo_indptr", "kv_indptr", "kv_lens", "kv_indices", "page_indptr",
               "page_indices", "block_table", "sched_meta", "num_splits")

    def __init__(self, cplan, source, generation):
        self.c = cplan
        self._source = source
        self._generation = generation
        self._ws_need = {}  # num_heads -> attention workspace bytes
        p = cplan
        self.mode = Mode(p.mode)
        self.batch_size = p.batch_size
        self.num_q_tokens = p.num_q_tokens
        self.num_kv_tokens = p.num_kv_tokens
        self.max_q_len = p.max_q_len
        self.max_kv_len = p.max_kv_len
        self.causal = bool(p.causal)
        self.page_size = p.page_size
        self.block_table_width = p.block_table_width
        self.num_heads = p.num_heads
        self.num_sm_parts = p.num_sm_parts
        self.total_splits = p.total_splits

    @property
    def valid(self):
        return self._source._generation == self._generation

    def _require_valid(self, name="plan"):
        if not self.valid:
            raise ValueError("argument '%s': stale plan (its planner has built another plan since; "
                             "a plan's arrays live in the planner's workspace)" % name)

    def _arr(self, ptr, shape):
        self._require_valid()
        return _view_i32(ptr, shape, self._source)

    @property
    def req_ids(self):
        return self._arr(self.c.req_ids, (self.batch_size,))

    @property
    def qo_indptr(self):
        return self._arr(self.c.qo_indptr, (self.batch_size + 1,))

    @property
    def kv_indptr(self):
        return self._arr(self.c.kv_indptr, (self.batch_size + 1,))

    @property
    def kv_lens(self):
        return self._arr(self.c.kv_lens, (self.batch_size,))

    @property
    def kv_indices(self):
        return self._arr(self.c.kv_indices, (self.num_kv_tokens,))

    @property
    def page_indptr(self):
        return self._arr(self.c.page_indptr, (self.batch_size + 1,))

    @property
    def page_indices(self):
        n = int(self.page_indptr[-1]) if self.batch_size else 0
        return self._arr(self.c.page_indices, (n,))

    @property
    def block_table(self):
        return self._arr(self.c.block_table, (self.batch_size, self.block_table_width))

    @property
    def sched_meta(self):
        return self._arr(self.c.sched_meta, (self.num_sm_parts, _lib.SCHED_META_INTS))

    @property
    def num_splits(self):
        return self._arr(self.c.num_splits, (self.batch_size + 1,))

    def arrays(self):
        """Every array, as copies (a dict name -> numpy int32)."""
        return {k: np.array(getattr(self, k)) for k in self._ARRAYS}

    def __repr__(self):
        return "<libmla.Plan %s bs=%d q=%d kv=%d%s>" % (
            self.mode.name, self.batch_size, self.num_q_tokens, self.num_kv_tokens,
            "" if self.valid else " STALE")


class Planner:
    """Builds mla_plans into one workspace sized for fixed limits (mla_plan_limits).

    num_sm: split-schedule target (0 = the context's worker threads). Each
    build() invalidates the planner's previous plan.
    """

    def __init__(self, ctx, *, max_bs, max_q_tokens, max_kv_tokens, max_context, page_size,
                 num_sm=0):
        self.ctx = ctx
        if not num_sm:
            num_sm = ctx.num_threads
        self.limits = _lib.PlanLimits(int(max_bs), int(max_q_tokens), int(max_kv_tokens),
                                      int(max_context), int(page_size), int(num_sm))
        n = ctypes.c_size_t()
        ctx._check(_c.mla_plan_workspace_size(ctx.handle, _byref(self.limits), _byref(n)),
                   "mla_plan_workspace_size")
        self.workspace_bytes = n.value
        self._ws = np.empty(max(n.value, 1), dtype=np.uint8)  # host memory, as the API asks
        self._wp = self._ws.__array_interface__["data"][0]
        self._generation = 0

    def build(self, rt, mode, req_ids=None, seq_lens=None, extend_lens=None, prefix_lens=None,
              num_draft_tokens=0, *, num_heads, batch_args=None):
        """Plan a batch (see libmla.batch for the modes); rt may be None for IDLE."""
        b = batch_args or _BatchArgs(mode, req_ids, seq_lens, extend_lens, prefix_lens,
                                     num_draft_tokens)
        p = _lib.Plan()
        self._generation += 1  # even a failed build may have written into the workspace
        self.ctx._check(
            _c.mla_plan_build(self.ctx.handle, _handle_of(rt, RequestTable, "rt", allow_none=True),
                              _byref(b.c),
                              _byref(self.limits), int(num_heads), self._wp, self.workspace_bytes,
                              _byref(p)), "mla_plan_build")
        return Plan(p, self, self._generation)


def plan(ctx, rt, mode, req_ids=None, seq_lens=None, extend_lens=None, prefix_lens=None,
         num_draft_tokens=0, *, num_heads, max_bs=None, max_q_tokens=None, max_kv_tokens=None,
         max_context=None, num_sm=0):
    """One-off mla_plan_build with limits fitted to this batch (a new workspace each call;
    use a Planner on a hot path)."""
    b = _BatchArgs(mode, req_ids, seq_lens, extend_lens, prefix_lens, num_draft_tokens)
    rid, sl, el, pl = b.keep
    ndt = int(num_draft_tokens or 0)
    q = k = mk = 0
    for i in range(b.bs):
        s = int(sl[i])
        if b.mode == Mode.DECODE:
            qi, ki = 1, s
        elif b.mode == Mode.TARGET_VERIFY:
            qi, ki = ndt, s + ndt
        elif b.mode == Mode.DRAFT_EXTEND:
            qi, ki = (int(el[i]) if el is not None else ndt), s
        else:
            qi, ki = s - (int(pl[i]) if pl is not None else 0), s
        q += max(qi, 0)
        k += max(ki, 0)
        mk = max(mk, ki)
    page_size = rt.page_size if rt is not None else 1
    pl_ = Planner(ctx, max_bs=max_bs or max(b.bs, 1), max_q_tokens=max_q_tokens or max(q, 1),
                  max_kv_tokens=max_kv_tokens or max(k, 1), max_context=max_context or
                  (rt.max_context if rt is not None else max(mk, 1)), page_size=page_size,
                  num_sm=num_sm)
    return pl_.build(rt, b.mode, num_heads=num_heads, batch_args=b)


class ChunkPlan:
    """mla_chunk_plan: a cached prefix cut into chunks for chunked-prefix MHA."""

    def __init__(self, c, source, generation):
        self.c = c
        self._source = source
        self._generation = generation
        self.batch_size, self.num_chunks, self.chunk_len = c.batch_size, c.num_chunks, c.chunk_len

    @property
    def valid(self):
        return self._source._generation == self._generation

    def _arr(self, ptr, shape):
        if not self.valid:
            raise ValueError("stale chunk plan: its planner has built another plan since")
        return _view_i32(ptr, shape, self._source)

    @property
    def starts(self):
        return self._arr(self.c.starts, (self.num_chunks, self.batch_size))

    @property
    def lens(self):
        return self._arr(self.c.lens, (self.num_chunks, self.batch_size))

    @property
    def cu_seq_lens(self):
        return self._arr(self.c.cu_seq_lens, (self.num_chunks, self.batch_size + 1))

    @property
    def max_lens(self):
        return self._arr(self.c.max_lens, (self.num_chunks,))

    @property
    def slot_indptr(self):
        return self._arr(self.c.slot_indptr, (self.num_chunks + 1,))

    @property
    def slots(self):
        n = int(self.slot_indptr[-1]) if self.num_chunks else 0
        return self._arr(self.c.slots, (n,))

    def chunk_slots(self, chunk):
        ip = self.slot_indptr
        return self.slots[ip[chunk]:ip[chunk + 1]]


class ChunkPlanner:
    def __init__(self, ctx, *, max_bs, max_prefix_tokens, chunk_capacity):
        self.ctx = ctx
        self.chunk_capacity = int(chunk_capacity)
        n = ctypes.c_size_t()
        ctx._check(_c.mla_chunk_plan_workspace_size(ctx.handle, int(max_bs), int(max_prefix_tokens),
                                                    self.chunk_capacity, _byref(n)),
                   "mla_chunk_plan_workspace_size")
        self.workspace_bytes = n.value
        self._ws = np.empty(max(n.value, 1), dtype=np.uint8)
        self._wp = self._ws.__array_interface__["data"][0]
        self._generation = 0

    def build(self, rt, req_ids, prefix_lens):
        rid, rp = int32_array(req_ids, "req_ids")
        pl, pp = int32_array(prefix_lens, "prefix_lens", length=rid.shape[0])
        p = _lib.ChunkPlan()
        self._generation += 1
        self.ctx._check(_c.mla_chunk_plan_build(self.ctx.handle, _handle_of(rt, RequestTable, "rt"),
                                                rid.shape[0], rp, pp,
                                                self.chunk_capacity, self._wp, self.workspace_bytes,
                                                _byref(p)), "mla_chunk_plan_build")
        return ChunkPlan(p, self, self._generation)


class DraftPlan:
    """mla_draft_plan: multi-step draft decode metadata for all steps at once (step i: one
    query per request over keys [0, seq_len + i + 1))."""

    def __init__(self, c, source, generation):
        self.c = c
        self._source = source
        self._generation = generation
        self.batch_size, self.num_steps = c.batch_size, c.num_steps

    @property
    def valid(self):
        return self._source._generation == self._generation

    def _arr(self, ptr, shape):
        if not self.valid:
            raise ValueError("stale draft plan: its planner has built another plan since")
        return _view_i32(ptr, shape, self._source)

    @property
    def kv_indptr(self):
        return self._arr(self.c.kv_indptr, (self.num_steps, self.batch_size + 1))

    @property
    def step_offset(self):
        return self._arr(self.c.step_offset, (self.num_steps + 1,))

    @property
    def kv_indices(self):
        n = int(self.step_offset[-1]) if self.num_steps else 0
        return self._arr(self.c.kv_indices, (n,))

    def step(self, i):
        """(kv_indptr [bs+1], kv_indices) of step i."""
        off = self.step_offset
        return self.kv_indptr[i], self.kv_indices[off[i]:off[i + 1]]


class DraftPlanner:
    def __init__(self, ctx, *, max_bs, num_steps, max_context):
        self.ctx = ctx
        n = ctypes.c_size_t()
        ctx._check(_c.mla_draft_plan_workspace_size(ctx.handle, int(max_bs), int(num_steps),
                                                    int(max_context), _byref(n)),
                   "mla_draft_plan_workspace_size")
        self.num_steps = int(num_steps)
        self.workspace_bytes = n.value
        self._ws = np.empty(max(n.value, 1), dtype=np.uint8)
        self._wp = self._ws.__array_interface__["data"][0]
        self._generation = 0

    def build(self, rt, req_ids, seq_lens, num_steps=None):
        rid, rp = int32_array(req_ids, "req_ids")
        sl, sp = int32_array(seq_lens, "seq_lens", length=rid.shape[0])
        p = _lib.DraftPlan()
        self._generation += 1
        self.ctx._check(_c.mla_draft_plan_build(
            self.ctx.handle, _handle_of(rt, RequestTable, "rt"), rid.shape[0], rp, sp,
            int(self.num_steps if num_steps is None else num_steps), self._wp, self.workspace_bytes,
            _byref(p)), "mla_draft_plan_build")
        return DraftPlan(p, self, self._generation)


class DcpPlan:
    """mla_dcp_plan: one rank's share of the keys under decode context parallelism."""

    def __init__(self, c, source, generation):
        self.c = c
        self._source = source
        self._generation = generation
        self.batch_size, self.rank, self.world = c.batch_size, c.rank, c.world

    @property
    def valid(self):
        return self._source._generation == self._generation

    def _arr(self, ptr, shape):
        if not self.valid:
            raise ValueError("stale DCP plan: its planner has built another plan since")
        return _view_i32(ptr, shape, self._source)

    @property
    def kv_lens(self):
        return self._arr(self.c.kv_lens, (self.batch_size,))

    @property
    def kv_indptr(self):
        return self._arr(self.c.kv_indptr, (self.batch_size + 1,))

    @property
    def kv_indices(self):
        n = int(self.kv_indptr[-1]) if self.batch_size else 0
        return self._arr(self.c.kv_indices, (n,))


class DcpPlanner:
    def __init__(self, ctx, *, max_bs, max_kv_tokens):
        self.ctx = ctx
        n = ctypes.c_size_t()
        ctx._check(_c.mla_dcp_plan_workspace_size(ctx.handle, int(max_bs), int(max_kv_tokens),
                                                  _byref(n)), "mla_dcp_plan_workspace_size")
        self.workspace_bytes = n.value
        self._ws = np.empty(max(n.value, 1), dtype=np.uint8)
        self._wp = self._ws.__array_interface__["data"][0]
        self._generation = 0

    def build(self, kv_lens, kv_indptr, kv_indices, rank, world):
        """kv_lens [bs], kv_indptr [bs+1], kv_indices [kv_indptr[bs]]: the global keys (e.g. a
        Plan's arrays)."""
        kl, kp = int32_array(kv_lens, "kv_lens")
        bs = kl.shape[0]
        ki, ip = int32_array(kv_indptr, "kv_indptr", length=bs + 1)
        kx, xp = int32_array(kv_indices, "kv_indices")
        if ki[0] != 0 or ki[-1] != kx.shape[0]:
            raise ValueError("argument 'kv_indptr': must start at 0 and end at len(kv_indices) = %d"
                             % kx.shape[0])
        p = _lib.DcpPlan()
        self._generation += 1
        self.ctx._check(_c.mla_dcp_plan_build(self.ctx.handle, bs, kp, ip, xp or None, int(rank),
                                              int(world), self._wp, self.workspace_bytes,
                                              _byref(p)), "mla_dcp_plan_build")
        return DcpPlan(p, self, self._generation)


def dcp_gather_table(ctx, kv_lens, world, *, base_slot=1, table_stride=None):
    """EXTEND under decode context parallel: the slot of every position of every request in the
    gathered cache the ranks pool their shards into (rank r's rows in the block [base_slot + r M,
    base_slot + (r+1) M), each request's positions r, r+N, ... in order: the local slots of rank
    r's DcpPlan). kv_lens [bs]: keys per request (prefix and new tokens). Returns (table
    [bs, table_stride] int32, MLA_SLOT_UNUSED past each length; rows_per_rank M). The gathered
    cache needs base_slot + world * M slots; run the EXTEND Step over it with the table as
    req_to_token and req_ids 0..bs-1."""
    kl, kp = int32_array(kv_lens, "kv_lens")
    bs = kl.shape[0]
    stride = int(table_stride) if table_stride is not None else max(int(kl.max()) if bs else 1, 1)
    table = np.empty((bs, stride), dtype=np.int32)
    m = ctypes.c_int32()
    ctx._check(_c.mla_dcp_gather_table(ctx.handle, bs, kp, int(world), int(base_slot), stride,
                                       table.ctypes.data if bs else None, _byref(m)),
               "mla_dcp_gather_table")
    return table, m.value


def dcp_plan(ctx, plan_, rank, world):
    """The DCP share of rank `rank` of a built Plan's keys (one-off workspace)."""
    pl = DcpPlanner(ctx, max_bs=max(plan_.batch_size, 1), max_kv_tokens=max(plan_.num_kv_tokens, 1))
    return pl.build(plan_.kv_lens, plan_.kv_indptr, plan_.kv_indices, rank, world)


# ---- kernels ------------------------------------------------------------------------------


def _act_of(t_dtype, dtype, name):
    """The activation dtype of a call: from the tensor, or the caller's dtype= for raw bf16."""
    if dtype is not None:
        d = mla_dtype(dtype)
        if mla_dtype_to_name(d) != t_dtype:
            raise ValueError("argument '%s': dtype %s, but dtype=%r was given" % (name, t_dtype, dtype))
        return d
    return mla_dtype(t_dtype)


def _flags(lse_base2, fp8_math=False):
    return (_lib.FLAG_LSE_BASE2 if lse_base2 else 0) | (_lib.FLAG_FP8_MATH if fp8_math else 0)


def _q_strides(tn, tr, name_n, name_r):
    """q_stride_token / q_stride_head shared by q_nope and q_rope (0 = contiguous defaults)."""
    if tn.contiguous and tr.contiguous:
        return 0, 0
    sn, sr = element_strides(tn), element_strides(tr)
    if sn is None or sr is None:
        raise ValueError("argument '%s': strided views are supported for numpy arrays and torch "
                         "tensors only" % name_n)
    T, H = tn.shape[0], tn.shape[1]
    for nm, st in ((name_n, sn), (name_r, sr)):
        if tn.shape[2] > 1 and st[2] != 1:
            raise ValueError("argument '%s': the last dimension must be contiguous (stride 1)" % nm)
    # A size-1 dimension's stride is never used; give it a value both agree on.
    tok = [s[0] for s in (sn, sr)]
    head = [s[1] for s in (sn, sr)]
    if T <= 1:
        tok = [H * 576, H * 576]
    if H <= 1:
        head = [576, 576]
    if tok[0] != tok[1] or head[0] != head[1]:
        raise ValueError("arguments '%s' and '%s': both must be contiguous, or views sharing one "
                         "token stride and one head stride (e.g. slices of one [T, H, 576] tensor)"
                         % (name_n, name_r))
    if tok[0] <= 0 or head[0] <= 0:
        raise ValueError("argument '%s': token and head strides must be positive" % name_n)
    return tok[0], head[0]


def attention_absorbed(ctx, cache, layer, plan_, q_nope, q_rope, *, scale, out=None, lse=None,
                       return_lse=False, lse_base2=False, fp8_math=False, dtype=None):
    """Absorbed MLA over the paged latent cache for every mode a plan describes.

    q_nope [Tq, H, 512] and q_rope [Tq, H, 64] (contiguous, or views sharing
    strides such as q[..., :512] and q[..., 512:] of one [Tq, H, 576] tensor);
    out [Tq, H, 512] in q's dtype; lse [Tq, H] fp32 (natural log unless
    lse_base2). fp8_math: MLA_FLAG_FP8_MATH, fp8 tensor-core math allowed
    (CUDA, per-tensor fp8 cache, more than 32 rows per request; exact
    elsewhere). Returns out, or (out, lse) when return_lse or lse is given.
    """
    if not isinstance(plan_, Plan):
        raise ValueError("argument 'plan': expected a libmla.Plan, got %s" % type(plan_).__name__)
    plan_._require_valid()
    dev = ctx.device
    tn = check(q_nope, "q_nope", dtypes=_ACT, shape=(plan_.num_q_tokens, None, _lib.LATENT),
               device=dev, contiguous=False, bf16=dtype is not None)
    act = _act_of(tn.dtype, dtype, "q_nope")
    T, H = tn.shape[0], tn.shape[1]
    bf = act == DType.BF16
    if tn.contiguous:  # the common case: skip the stride logic
        qr_ptr = ptr_of(q_rope, "q_rope", dtypes=(tn.dtype,), shape=(T, H, _lib.ROPE), device=dev,
                        bf16=bf) if _contiguous(q_rope) else None
    else:
        qr_ptr = None
    if qr_ptr is not None:
        st_tok = st_head = 0
    else:
        tr = check(q_rope, "q_rope", dtypes=(tn.dtype,), shape=(T, H, _lib.ROPE), device=dev,
                   contiguous=False, bf16=bf)
        st_tok, st_head = _q_strides(tn, tr, "q_nope", "q_rope")
        qr_ptr = tr.ptr
    if out is None:
        out = empty_like_kind(q_nope, (T, H, _lib.LATENT), tn.dtype)
    out_ptr = ptr_of(out, "out", dtypes=(tn.dtype,), shape=(T, H, _lib.LATENT), device=dev,
                     writable=True, bf16=bf)
    want_lse = return_lse or lse is not None
    if want_lse and lse is None:
        lse = empty_like_kind(q_nope, (T, H), "f32")
    lse_ptr = ptr_of(lse, "lse", dtypes=("f32",), shape=(T, H), device=dev, writable=True) \
        if lse is not None else None
    a = _lib.AbsorbedArgs(H, float(scale), _flags(lse_base2, fp8_math), int(act), tn.ptr, qr_ptr,
                          st_tok, st_head, out_ptr, lse_ptr)
    need = plan_._ws_need.get(H)
    if need is None:  # once per plan and head count
        n = ctypes.c_size_t()
        ctx._check(_c.mla_attention_absorbed_workspace_size(ctx.handle, _byref(plan_.c), H,
                                                            _byref(n)),
                   "mla_attention_absorbed_workspace_size")
        need = plan_._ws_need[H] = n.value
    wp, wn = ctx._scratch(need, q_nope)
    ctx._before_launch(tn)
    ch = _handle_of(cache, KVCache, "cache")
    ctx._check(_c.mla_attention_absorbed(ctx.handle, ch, int(layer), _byref(plan_.c),
                                         _byref(a), wp, wn), "mla_attention_absorbed")
    return (out, lse) if want_lse else out


def _contiguous(x):
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    f = getattr(x, "is_contiguous", None)
    return bool(f()) if f is not None else False


def _indptr(obj, name, bs=None):
    a, p = int32_array(obj, name, length=None if bs is None else bs + 1)
    if a.shape[0] < 1:
        raise ValueError("argument '%s': needs at least one entry" % name)
    if a[0] != 0 or (a.shape[0] > 1 and np.any(np.diff(a) < 0)):
        raise ValueError("argument '%s': must start at 0 and never decrease" % name)
    return a, p


def _on_device(x):
    """Whether x looks like device memory (a CUDA torch tensor or a __cuda_array_interface__
    object)."""
    if isinstance(x, (np.ndarray, list, tuple, range)) or x is None:
        return False
    return getattr(x, "is_cuda", False) is True or hasattr(x, "__cuda_array_interface__")


def _device_indptr(obj, name, bs):
    """A device int32 [bs+1] index array used in place: (pointer, bs)."""
    t = check(obj, name, dtypes=("i32",), shape=(None if bs is None else bs + 1,), device="cuda")
    if t.shape[0] < 1:
        raise ValueError("argument '%s': needs at least one entry" % name)
    return t.ptr, t.shape[0] - 1


def _upload_indptr(ctx, like, qa, ka):
    """Device copies of host-checked index arrays, kept on the context until its next such
    call (the kernel reads them asynchronously)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(like, "device"):
        raise ValueError("argument 'qo_indptr': a CUDA context reads the index arrays on the "
                         "device; pass CUDA int32 tensors (or torch tensors for q/k/v, so the "
                         "binding can copy host arrays)")
    qd = torch.from_numpy(np.ascontiguousarray(qa)).to(like.device)
    kd = torch.from_numpy(np.ascontiguousarray(ka)).to(like.device)
    ctx._indptr_keep = (qd, kd)
    return qd.data_ptr(), kd.data_ptr()


def ragged_workspace_size(ctx):
    """Bytes of attention_ragged's optional workspace on this context (0 on a CPU context)."""
    n = ctypes.c_size_t()
    ctx._check(_c.mla_attention_ragged_workspace_size(ctx.handle, _byref(n)),
               "mla_attention_ragged_workspace_size")
    return n.value


def attention_ragged(ctx, q, k, v, qo_indptr, kv_indptr, *, scale, causal=True, softcap=0.0,
                     out=None, lse=None, return_lse=False, lse_base2=False, out_f32=False,
                     dtype=None, workspace="auto"):
    """Ragged MHA (prefill without prefix, prefix chunks): request i owns query rows
    [qo_indptr[i], qo_indptr[i+1]) and key rows [kv_indptr[i], kv_indptr[i+1]).

    q [Tq, H, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv] (Hkv divides H), out [Tq, H, Dv]
    (fp32 when out_f32), lse [Tq, H]. softcap > 0: s = cap * tanh(scale q.k / cap).
    Bottom-right causal. qo_indptr/kv_indptr: int32 [bs+1]; host arrays or lists on a CPU
    context. On a CUDA context the kernel reads them on the device: pass CUDA int32 tensors
    (used in place, graph-capturable; their contents cannot be checked on the host, a bad
    length is skipped by the kernel and reported by ctx.synchronize()), or host arrays, which
    are checked here and copied to the device on each call (needs torch).

    workspace (CUDA): "auto" (a small buffer the context keeps for its ragged calls, which
    use it in stream order), None (no workspace: the kernel's fixed item order), or a device tensor of
    at least ragged_workspace_size(ctx) bytes that no concurrent call uses. With one the
    kernel hands out its work items as SMs become free (same bits, faster on long causal
    sequences). Ignored on a CPU context.
    """
    dev = ctx.device
    tq = check(q, "q", dtypes=_ACT, shape=(None, None, None), device=dev, bf16=dtype is not None)
    act = _act_of(tq.dtype, dtype, "q")
    bf = act == DType.BF16
    Tq, H, Dqk = tq.shape
    tk = check(k, "k", dtypes=(tq.dtype,), shape=(None, None, Dqk), device=dev, bf16=bf)
    Tk, Hkv = tk.shape[0], tk.shape[1]
    tv = check(v, "v", dtypes=(tq.dtype,), shape=(Tk, Hkv, None), device=dev, bf16=bf)
    Dv = tv.shape[2]
    if dev == "cuda" and _on_device(qo_indptr):
        qp, bs = _device_indptr(qo_indptr, "qo_indptr", None)
        kp, _ = _device_indptr(kv_indptr, "kv_indptr", bs)
    else:
        qa, qp = _indptr(qo_indptr, "qo_indptr")
        bs = qa.shape[0] - 1
        ka, kp = _indptr(kv_indptr, "kv_indptr", bs)
        if qa[-1] != Tq:
            raise ValueError("argument 'qo_indptr': ends at %d, q has %d rows" % (qa[-1], Tq))
        if ka[-1] != Tk:
            raise ValueError("argument 'kv_indptr': ends at %d, k and v have %d rows" % (ka[-1], Tk))
        if dev == "cuda":  # checked on the host: copies on q's device for the kernel
            qp, kp = _upload_indptr(ctx, q, qa, ka)
    odt = "f32" if out_f32 else tq.dtype
    if out is None:
        out = empty_like_kind(q, (Tq, H, Dv), odt)
    to = check(out, "out", dtypes=(odt,), shape=(Tq, H, Dv), device=dev, writable=True, bf16=bf)
    want_lse = return_lse or lse is not None
    if want_lse and lse is None:
        lse = empty_like_kind(q, (Tq, H), "f32")
    tl = check(lse, "lse", dtypes=("f32",), shape=(Tq, H), device=dev, writable=True, allow_none=True)
    flags = _flags(lse_base2) | (_lib.FLAG_OUT_F32 if out_f32 else 0)
    wp, wn = None, 0
    if dev == "cuda" and workspace is not None:
        need = getattr(ctx, "_ragged_ws_need", None)
        if need is None:  # once per context
            need = ctx._ragged_ws_need = ragged_workspace_size(ctx)
        if isinstance(workspace, str):
            if workspace != "auto":
                raise ValueError("argument 'workspace': 'auto', None or a device tensor")
            # The context's own small buffer for these calls, apart from its scratch: a ragged
            # call zeroes it on the stream, which must never touch an absorbed call's workspace.
            buf = ctx._ragged_ws
            if buf is None:
                torch = sys.modules.get("torch")
                if torch is None:
                    raise ValueError("argument 'workspace': 'auto' on a CUDA context needs torch "
                                     "(imported); pass None or a device tensor")
                buf = ctx._ragged_ws = torch.empty(need, dtype=torch.uint8,
                                                   device="cuda:%d" % ctx.device_id)
            wp, wn = buf.data_ptr(), need
        else:
            tw = inspect(workspace, "workspace")
            if tw.device != "cuda" or not tw.contiguous:
                raise ValueError("argument 'workspace': must be a contiguous CUDA tensor")
            wp, wn = tw.ptr, tw.numel() * itemsize(tw.dtype)
            if wn < need:
                raise ValueError("argument 'workspace': %d bytes, needs %d" % (wn, need))
    a = _lib.RaggedArgs(bs, H, Hkv, Dqk, Dv, float(scale), float(softcap), 1 if causal else 0, flags,
                        int(act), qp, kp, tq.ptr, tk.ptr, tv.ptr, to.ptr, tl.ptr if tl else None, wp, wn)
    ctx._before_launch(tq)
    ctx._check(_c.mla_attention_ragged(ctx.handle, _byref(a)), "mla_attention_ragged")
    return (out, lse) if want_lse else out


def merge_states(ctx, o_parts, lse_parts, *, out=None, lse_out=None, lse_base2=False, dtype=None):
    """Merge partial attention states over the same queries by log-sum-exp.

    o_parts: n tensors [T, H, D] (one dtype); lse_parts: n fp32 [T, H]. out may
    be o_parts[0] and lse_out lse_parts[0] (in place). Returns (out, lse_out).
    """
    dev = ctx.device
    o_parts, lse_parts = list(o_parts), list(lse_parts)
    if not o_parts:
        raise ValueError("argument 'o_parts': needs at least one state")
    if len(lse_parts) != len(o_parts):
        raise ValueError("argument 'lse_parts': %d entries for %d o_parts" % (len(lse_parts), len(o_parts)))
    t0 = check(o_parts[0], "o_parts[0]", dtypes=_ACT, shape=(None, None, None), device=dev,
               bf16=dtype is not None)
    act = _act_of(t0.dtype, dtype, "o_parts[0]")
    bf = act == DType.BF16
    T, H, D = t0.shape
    ops = [t0.ptr]
    for i, o in enumerate(o_parts[1:], 1):
        ops.append(check(o, "o_parts[%d]" % i, dtypes=(t0.dtype,), shape=(T, H, D), device=dev,
                         bf16=bf).ptr)
    lps = [check(l, "lse_parts[%d]" % i, dtypes=("f32",), shape=(T, H), device=dev).ptr
           for i, l in enumerate(lse_parts)]
    if out is None:
        out = empty_like_kind(o_parts[0], (T, H, D), t0.dtype)
    if lse_out is None:
        lse_out = empty_like_kind(o_parts[0], (T, H), "f32")
    to = check(out, "out", dtypes=(t0.dtype,), shape=(T, H, D), device=dev, writable=True, bf16=bf)
    tl = check(lse_out, "lse_out", dtypes=("f32",), shape=(T, H), device=dev, writable=True)
    n = len(ops)
    oa = (ctypes.c_void_p * n)(*ops)
    la = (ctypes.c_void_p * n)(*lps)
    ctx._before_launch(t0)
    ctx._check(_c.mla_merge_states(ctx.handle, n, T, H, D, int(act), _flags(lse_base2), oa, la,
                                   to.ptr, tl.ptr), "mla_merge_states")
    return out, lse_out


def gather_latent(ctx, cache, layer, slots, dtype="f32", *, c_out=None, r_out=None, parts="cr"):
    """Latent rows of the given slots, dequantized: (c [T, 512], r [T, 64]) for the MHA paths."""
    dev = ctx.device
    t = mla_dtype(dtype)
    name = mla_dtype_to_name(t)
    if dev == "cpu":
        sa, sp = int32_array(slots, "slots")
        n, like = sa.shape[0], (c_out if c_out is not None else r_out)
    else:
        ts = check(slots, "slots", dtypes=("i32",), shape=(None,), device=dev)
        n, sp, like = ts.shape[0], ts.ptr, slots
    if ("c" in parts or c_out is not None) and c_out is None:
        c_out = empty_like_kind(like, (n, _lib.LATENT), name)
    if ("r" in parts or r_out is not None) and r_out is None:
        r_out = empty_like_kind(like, (n, _lib.ROPE), name)
    tc = check(c_out, "c_out", dtypes=(name,), shape=(n, _lib.LATENT), device=dev, writable=True,
               bf16=True, allow_none=True)
    tr = check(r_out, "r_out", dtypes=(name,), shape=(n, _lib.ROPE), device=dev, writable=True,
               bf16=True, allow_none=True)
    if tc is None and tr is None:
        raise ValueError("argument 'parts': name at least one of 'c' and 'r'")
    ctx._before_launch(tc or tr)
    ch = _handle_of(cache, KVCache, "cache")
    ctx._check(_c.mla_gather_latent(ctx.handle, ch, int(layer), n, sp,
                                    int(t), tc.ptr if tc else None, tr.ptr if tr else None),
               "mla_gather_latent")
    return c_out, r_out


def expand_kv(ctx, c, r, kv_b_proj, *, nope_dim=128, k_out=None, v_out=None, dtype=None,
              latent_dtype=None):
    """k/v expansion of chunked-prefix MHA: k[t,h] = [c[t] . w_kc[h], r[t]], v[t,h] = c[t] . w_vc[h].

    c [T, 512], r [T, 64] (latent dtype, fp32 keeps dequantized fp8 exact);
    kv_b_proj [H, nope_dim + v_dim, 512] (act dtype); returns (k [T, H, nope_dim + 64],
    v [T, H, v_dim]) in the act dtype.
    """
    dev = ctx.device
    tw = check(kv_b_proj, "kv_b_proj", dtypes=_ACT, shape=(None, None, _lib.LATENT), device=dev,
               bf16=dtype is not None)
    act = _act_of(tw.dtype, dtype, "kv_b_proj")
    H, rows = tw.shape[0], tw.shape[1]
    v_dim = rows - int(nope_dim)
    if nope_dim < 0 or v_dim < 1:
        raise ValueError("argument 'nope_dim' = %d: kv_b_proj has %d rows per head" % (nope_dim, rows))
    tc = check(c, "c", dtypes=_ACT, shape=(None, _lib.LATENT), device=dev,
               bf16=latent_dtype is not None)
    lat = _act_of(tc.dtype, latent_dtype, "c")
    T = tc.shape[0]
    trr = check(r, "r", dtypes=(tc.dtype,), shape=(T, _lib.ROPE), device=dev, bf16=lat == DType.BF16)
    if k_out is None:
        k_out = empty_like_kind(kv_b_proj, (T, H, nope_dim + _lib.ROPE), tw.dtype)
    if v_out is None:
        v_out = empty_like_kind(kv_b_proj, (T, H, v_dim), tw.dtype)
    bf = act == DType.BF16
    tk = check(k_out, "k_out", dtypes=(tw.dtype,), shape=(T, H, nope_dim + _lib.ROPE), device=dev,
               writable=True, bf16=bf)
    tv = check(v_out, "v_out", dtypes=(tw.dtype,), shape=(T, H, v_dim), device=dev, writable=True,
               bf16=bf)
    ctx._before_launch(tw)
    ctx._check(_c.mla_expand_kv(ctx.handle, T, H, int(nope_dim), v_dim, int(lat), int(act), tc.ptr,
                                trr.ptr, tw.ptr, tk.ptr, tv.ptr), "mla_expand_kv")
    return k_out, v_out


def convert(src, dst_dtype, *, out=None, src_dtype=None):
    """mla_convert on host arrays: F32/BF16/F16/F64 to F32/BF16/F16/F64 (round to nearest
    even). numpy bf16 is uint16 bits (say src_dtype="bf16" for a uint16 source)."""
    ts = check(src, "src", dtypes=("f32", "bf16", "f16", "f64"), shape=tuple(None for _ in
               inspect(src, "src").shape), device="cpu", bf16=src_dtype is not None)
    names = {"f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16, "f64": DType.F64}
    dname = {"float64": "f64", "f64": "f64"}.get(str(dst_dtype), None) or \
        mla_dtype_to_name(mla_dtype(dst_dtype))
    if out is None:
        out = empty_like_kind(src, ts.shape, dname)
    to = check(out, "out", dtypes=(dname,), shape=ts.shape, device="cpu", writable=True, bf16=True)
    st = _c.mla_convert(ts.ptr, int(names[ts.dtype]), to.ptr, int(names[dname]), ts.numel())
    if st:
        _raise(st, "mla_convert", "")
    return out


def bf16_to_f32(a):
    """Raw bf16 bits (uint16 array) to float32."""
    return convert(a, "f32", src_dtype="bf16")


def f32_to_bf16(a):
    """float32 (or f64/f16) to raw bf16 bits (uint16), rounding to nearest even."""
    return convert(np.ascontiguousarray(a), "bf16")


# ---- device-built steps (CUDA graphs) ---------------------------------------------------------


class StepMetadata:
    """What Step.prepare() built (mla_step_metadata): the step's shape as attributes and its
    int32 arrays as views into the step's workspace, overwritten by the next prepare():

      qo_indptr [bs+1], kv_lens [bs], block_table [bs, block_table_width],
      sched_meta [num_sm_parts, SCHED_META_INTS], num_splits [bs+1]

    CPU steps: read-only numpy views. CUDA steps: torch int32 tensors on the step's device
    (read them after the prepare on the same stream, e.g. to hand the block table to other
    kernels); None when the workspace is not a torch tensor, then `pointers` (name -> device
    address) is what there is.
    """

    _ARRAYS = ("qo_indptr", "kv_lens", "block_table", "sched_meta", "num_splits")

    def __init__(self, step, cm):
        self.batch_size = cm.batch_size
        self.q_len = cm.q_len
        self.block_table_width = cm.block_table_width
        self.num_sm_parts = cm.num_sm_parts
        self.max_splits = cm.max_splits
        bs, w = cm.batch_size, cm.block_table_width
        shapes = {"qo_indptr": (bs + 1,), "kv_lens": (bs,), "block_table": (bs, w),
                  "sched_meta": (cm.num_sm_parts, _lib.SCHED_META_INTS), "num_splits": (bs + 1,)}
        self.pointers = {k: getattr(cm, k) for k in self._ARRAYS}
        for k in self._ARRAYS:
            setattr(self, k, step._ws_view(self.pointers[k], shapes[k]))

    def arrays(self):
        """Every array as a host numpy copy (a dict; synchronizes with the device for CUDA)."""
        out = {}
        for k in self._ARRAYS:
            v = getattr(self, k)
            if v is None:
                raise ValueError("the step's workspace is not a torch tensor or numpy array: no "
                                 "views of its metadata (use .pointers)")
            out[k] = np.array(v.cpu().numpy() if hasattr(v, "cpu") else v)
        return out

    def __repr__(self):
        return "<libmla.StepMetadata bs=%d q_len=%d width=%d parts=%d>" % (
            self.batch_size, self.q_len, self.block_table_width, self.num_sm_parts)


class Step:
    """A decode-type step built where the kernels run (mla_step_*), for CUDA graphs.

    A Step fixes the step's shape (mode, batch_size rows, num_heads, page_size,
    max_kv_len, num_draft_tokens, num_sm) and owns (or is given) its workspace.
    Per step: prepare(cache, req_to_token, req_ids, seq_lens) once, then
    attention(cache, layer, q_nope, q_rope, out) per layer. On a CUDA context
    every tensor is device memory (torch CUDA tensors on the context's device)
    and both calls only enqueue kernels on torch's current stream: capture them
    in a torch.cuda.CUDAGraph and replay after writing new request ids / lengths
    into the same tensors. On a CPU context the same calls run on host arrays.

    mode: "decode", "target_verify" (num_draft_tokens queries per row, seq_lens
    exclude them), "draft_extend" (a fixed window of num_draft_tokens queries,
    keys = seq_lens) or "extend" (the paged absorbed prefill, capturable: row i
    has extend_lens[i] queries, given to prepare, and seq_lens[i] keys, prefix
    included; num_tokens is the bucket, the rows q / out hold, at or above the
    extend lens' sum). num_steps = N > 0 (decode only): one prepare builds N draft
    steps, step i attending seq_len + i + 1 keys; attention(..., step=i) runs one.
    dcp_world = N > 1, dcp_rank = r (decode only): decode context parallel, the
    cache being rank r's shard (page_size = the global page size / N) and
    req_to_token the global table; merge the ranks' (out, lse) with merge_states. A request id of REQ_PAD (-1) is a padding row (it reads
    page 0; give it seq_len 1). page_size defaults to cache's. num_sm: the
    split-schedule target (0 = the device's SMs; CPU: the workers). workspace:
    a contiguous tensor/array on the context's device of at least
    workspace_bytes bytes; allocated when not given (a torch uint8 tensor on
    CUDA, which needs torch imported; numpy on CPU).
    """

    def __init__(self, ctx, mode="decode", *, batch_size, num_heads, max_kv_len, page_size=None,
                 num_draft_tokens=0, num_sm=0, scale=None, cache=None, workspace=None,
                 num_steps=0, dcp_world=0, dcp_rank=0, num_tokens=0):
        if not isinstance(ctx, Context):
            raise ValueError("argument 'ctx': expected a libmla.Context, got %s" % type(ctx).__name__)
        if page_size is None:
            if cache is None:
                raise ValueError("Step: give page_size, or the cache (its page size is used)")
            _handle_of(cache, KVCache, "cache")
            page_size = cache.page_size
        self.ctx = ctx
        self.mode = _parse_mode(mode)
        self.desc = _lib.StepDesc(int(self.mode), int(batch_size), int(num_draft_tokens or 0),
                                  int(max_kv_len), int(num_heads), int(page_size), int(num_sm),
                                  int(num_steps), 0, int(dcp_world), int(dcp_rank),
                                  int(num_tokens or 0))
        self.num_steps = int(num_steps)
        self.dcp_world, self.dcp_rank = int(dcp_world), int(dcp_rank)
        n = ctypes.c_size_t()
        ctx._check(_c.mla_step_workspace_size(ctx.handle, _byref(self.desc), _byref(n)),
                   "mla_step_workspace_size")
        self.workspace_bytes = n.value
        self.batch_size, self.num_heads = int(batch_size), int(num_heads)
        self.page_size, self.max_kv_len = int(page_size), int(max_kv_len)
        self.num_draft_tokens, self.num_sm = int(num_draft_tokens or 0), int(num_sm)
        self.num_tokens = int(num_tokens or 0)
        if self.mode == Mode.EXTEND:  # the bucket: q / out hold num_tokens rows
            self.q_len, self.num_q_tokens = self.num_tokens, self.num_tokens
        else:
            self.q_len = 1 if self.mode == Mode.DECODE else self.num_draft_tokens
            self.num_q_tokens = self.batch_size * self.q_len
        self.scale = None if scale is None else float(scale)
        self._dev = ctx.device
        self._dev_index = ctx.device_id if ctx.device == "cuda" else None
        if workspace is None:
            if self._dev == "cuda":
                torch = sys.modules.get("torch")
                if torch is None:
                    raise ValueError("argument 'workspace': a CUDA step allocates its device "
                                     "workspace with torch; import torch or pass workspace=")
                workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8,
                                        device="cuda:%d" % self._dev_index)
            else:
                workspace = np.empty(self.workspace_bytes, dtype=np.uint8)
        t = inspect(workspace, "workspace")
        if t.device != self._dev:
            raise ValueError("argument 'workspace': tensor is on %s, this %s step needs %s memory"
                             % (t.device, self._dev, self._dev))
        self._same_device(workspace, "workspace")
        if not t.contiguous:
            raise ValueError("argument 'workspace': must be contiguous")
        try:
            nbytes = t.numel() * itemsize(t.dtype)
        except KeyError:
            raise ValueError("argument 'workspace': dtype %s has no known size" % t.dtype) from None
        if nbytes < self.workspace_bytes:
            raise ValueError("argument 'workspace': %d bytes, the step needs %d (workspace_bytes)"
                             % (nbytes, self.workspace_bytes))
        if t.kind == "numpy" and not workspace.flags.writeable:
            raise ValueError("argument 'workspace': array is read-only")
        self.workspace = workspace
        self._wp, self._wn = t.ptr, nbytes
        self._in = _lib.StepInputs()
        self._keep = None  # host arrays the last CPU prepare converted
        self._args = _lib.AbsorbedArgs()
        self._args.num_heads = self.num_heads
        self._att = _c.mla_step_attention
        self._acts = {}  # dtype= argument -> (name, DType)

    # -- checks

    def _same_device(self, obj, name):
        """CUDA steps: a torch tensor must be on the context's device (the index)."""
        if self._dev_index is not None:
            gd = getattr(obj, "get_device", None)
            if gd is not None and gd() != self._dev_index:
                raise ValueError("argument '%s': tensor is on cuda:%d, the context is on cuda:%d"
                                 % (name, gd(), self._dev_index))

    def _ws_view(self, ptr, shape):
        ws = self.workspace
        if self._dev == "cpu":
            if isinstance(ws, np.ndarray):
                return _view_i32(ptr, shape, ws)
            return _view_i32(ptr, shape, self)
        if not hasattr(ws, "data_ptr") or not hasattr(ws, "view"):
            return None
        n = 1
        for d in shape:
            n *= d
        try:
            import torch  # only reached with torch tensors in hand
            flat = ws.reshape(-1).view(torch.uint8)
            off = ptr - flat.data_ptr()
            return flat[off:off + 4 * n].view(torch.int32).view(shape)
        except Exception:  # an unusual workspace (odd storage offset): pointers only
            return None

    # -- the calls

    def prepare(self, cache, req_to_token, req_ids, seq_lens, extend_lens=None):
        """Build the step's metadata (once per step, before the layers).

        req_to_token [max_reqs, >= max_kv_len] int32 (rows may be strided, the
        last dimension contiguous; on CPU a RequestTable works too); req_ids
        [batch_size] and seq_lens [batch_size] int32. CUDA: device tensors, read
        when the kernels run (a captured graph reads what they hold at replay),
        rows found out of range are emptied and reported by ctx.synchronize().
        CPU: host arrays (lists are converted), out of range raises MLAError.
        extend_lens [batch_size] int32: an "extend" step's query tokens per row
        (required there, refused elsewhere).
        """
        ctx, dev, bs = self.ctx, self._dev, self.batch_size
        ch = _handle_of(cache, KVCache, "cache")
        if cache.page_size != self.page_size:
            raise ValueError("argument 'cache': page size %d, the step was made for %d"
                             % (cache.page_size, self.page_size))
        if isinstance(req_to_token, RequestTable):
            if dev != "cpu":
                raise ValueError("argument 'req_to_token': a RequestTable is host memory; a CUDA "
                                 "step takes a device copy of its req_to_token")
            req_to_token = req_to_token.req_to_token
        tt = check(req_to_token, "req_to_token", dtypes=("i32",), shape=(None, None), device=dev,
                   contiguous=False)
        self._same_device(req_to_token, "req_to_token")
        rows, cols = tt.shape
        if tt.contiguous:
            stride = cols
        else:
            st = element_strides(tt)
            if st is None or (cols > 1 and st[1] != 1) or st[0] < cols:
                raise ValueError("argument 'req_to_token': rows must be contiguous (last stride 1) "
                                 "and not overlap")
            stride = st[0]
        if rows < 1:
            raise ValueError("argument 'req_to_token': has no rows")
        if cols < self.max_kv_len:
            raise ValueError("argument 'req_to_token': shape [%d, %d], the step reads up to "
                             "max_kv_len = %d positions per row" % (rows, cols, self.max_kv_len))
        if (extend_lens is None) != (self.mode != Mode.EXTEND):
            raise ValueError("argument 'extend_lens': %s" % (
                "an extend step needs each row's query count" if extend_lens is None else
                "only an extend step takes it"))
        ep = None
        if dev == "cpu":
            ia, ip = int32_array(req_ids, "req_ids", length=bs)
            sa, sp = int32_array(seq_lens, "seq_lens", length=bs)
            ea = None
            if extend_lens is not None:
                ea, ep = int32_array(extend_lens, "extend_lens", length=bs)
            self._keep = (ia, sa, ea)
        else:
            ip = ptr_of(req_ids, "req_ids", dtypes=("i32",), shape=(bs,), device=dev)
            sp = ptr_of(seq_lens, "seq_lens", dtypes=("i32",), shape=(bs,), device=dev)
            self._same_device(req_ids, "req_ids")
            self._same_device(seq_lens, "seq_lens")
            if extend_lens is not None:
                ep = ptr_of(extend_lens, "extend_lens", dtypes=("i32",), shape=(bs,), device=dev)
                self._same_device(extend_lens, "extend_lens")
            ctx._before_launch(req_ids)
        i = self._in
        i.req_to_token, i.req_to_token_stride, i.max_reqs = tt.ptr, stride, rows
        i.req_ids, i.seq_lens, i.extend_lens = ip, sp, ep
        ctx._check(_c.mla_step_prepare(ctx.handle, _byref(self.desc), ch, _byref(i), self._wp,
                                       self._wn), "mla_step_prepare")

    def _act(self, q_nope, dtype):
        """(name, DType) of the activations: q_nope's dtype, or dtype= for raw bf16 bits."""
        if dtype is not None:
            r = self._acts.get(dtype)
            if r is None:
                d = mla_dtype(dtype)
                r = self._acts[dtype] = (mla_dtype_to_name(d), d)
            return r
        name = dtype_of(q_nope)
        if name not in _ACT_DTYPE:  # the full check says what is wrong
            check(q_nope, "q_nope", dtypes=_ACT, shape=(self.num_q_tokens, self.num_heads,
                                                         _lib.LATENT), device=self._dev,
                  contiguous=False)
        return name, _ACT_DTYPE[name]

    def _select(self, step):
        """Point the descriptor at draft step `step` (num_steps > 0; else 0)."""
        step = int(step)
        if step < 0 or step >= max(self.num_steps, 1):
            raise ValueError("argument 'step': %d, expected 0..%d" % (step, max(self.num_steps, 1) - 1))
        self.desc.step = step

    def attention(self, cache, layer, q_nope, q_rope, out=None, lse=None, *, scale=None,
                  return_lse=False, lse_base2=False, fp8_math=False, dtype=None, step=0):
        """One layer's absorbed attention over the prepared step.

        q_nope [bs * q_len, H, 512] and q_rope [bs * q_len, H, 64] (contiguous, or
        views sharing one token and one head stride such as q[..., :512] and
        q[..., 512:]); out [bs * q_len, H, 512] in q's dtype (allocated when not
        given; pass it when capturing a graph); lse [bs * q_len, H] fp32 (natural
        log unless lse_base2). Rows of padding requests hold what the padding row
        read. step: which draft step (Step(num_steps=N): step i attends seq_len + i + 1
        keys). fp8_math: MLA_FLAG_FP8_MATH (see attention_absorbed). Returns out, or
        (out, lse) when return_lse or lse is given.
        """
        self._select(step)
        dev = self._dev
        T, H = self.num_q_tokens, self.num_heads
        name, act = self._act(q_nope, dtype)
        dts = (name,)
        bf = act == DType.BF16
        try:  # the common case, contiguous q: the short checks
            qn = ptr_of(q_nope, "q_nope", dtypes=dts, shape=(T, H, _lib.LATENT), device=dev,
                        bf16=bf)
            qr = ptr_of(q_rope, "q_rope", dtypes=dts, shape=(T, H, _lib.ROPE), device=dev,
                        bf16=bf)
            st_tok = st_head = 0
        except ValueError:  # strided views, or a bad argument: the full checks say which
            tn = check(q_nope, "q_nope", dtypes=dts, shape=(T, H, _lib.LATENT), device=dev,
                       contiguous=False, bf16=bf)
            tr = check(q_rope, "q_rope", dtypes=dts, shape=(T, H, _lib.ROPE), device=dev,
                       contiguous=False, bf16=bf)
            st_tok, st_head = _q_strides(tn, tr, "q_nope", "q_rope")
            qn, qr = tn.ptr, tr.ptr
        if out is None:
            out = empty_like_kind(q_nope, (T, H, _lib.LATENT), name)
        op = ptr_of(out, "out", dtypes=dts, shape=(T, H, _lib.LATENT), device=dev, writable=True,
                    bf16=bf)
        want_lse = return_lse or lse is not None
        if want_lse and lse is None:
            lse = empty_like_kind(q_nope, (T, H), "f32")
        lp = ptr_of(lse, "lse", dtypes=("f32",), shape=(T, H), device=dev, writable=True) \
            if lse is not None else None
        if scale is None:
            scale = self.scale
            if scale is None:
                raise ValueError("argument 'scale' is required (or give the Step a scale)")
        ctx = self.ctx
        if self._dev_index is not None:
            d = self._dev_index
            for obj, nm in ((q_nope, "q_nope"), (q_rope, "q_rope"), (out, "out"), (lse, "lse")):
                gd = getattr(obj, "get_device", None)
                if gd is not None and gd() != d:
                    self._same_device(obj, nm)
            if ctx._follow_torch:  # torch's current stream on the step's device
                raw = _raw_stream_fn or _torch_raw_stream()
                if raw is not None:
                    s = raw(d)
                    if s != ctx._stream:
                        ctx._check(_c.mla_ctx_set_stream(ctx._h, s or None), "mla_ctx_set_stream")
                        ctx._stream = s
        a = self._args
        a.scale = scale
        a.flags = _flags(lse_base2, fp8_math)
        a.act_dtype = act
        a.q_nope, a.q_rope, a.q_stride_token, a.q_stride_head = qn, qr, st_tok, st_head
        a.out, a.lse = op, lp
        st = self._att(ctx.handle, _byref(self.desc), _handle_of(cache, KVCache, "cache"),
                       int(layer), _byref(a), self._wp, self._wn)
        if st:
            ctx._check(st, "mla_step_attention")
        return (out, lse) if want_lse else out

    def metadata(self, step=0):
        """The prepared metadata (StepMetadata: views into the workspace) of `step`."""
        self._select(step)
        m = _lib.StepMetadata()
        self.ctx._check(_c.mla_step_get_metadata(self.ctx.handle, _byref(self.desc), self._wp,
                                                 self._wn, _byref(m)), "mla_step_get_metadata")
        return StepMetadata(self, m)

    def __repr__(self):
        return "<libmla.Step %s %s bs=%d H=%d page=%d max_kv=%d%s>" % (
            self._dev, self.mode.name, self.batch_size, self.num_heads, self.page_size,
            self.max_kv_len, " ndt=%d" % self.num_draft_tokens if self.num_draft_tokens else "")


# ---- backend --------------------------------------------------------------------------------


class _CudaArray:
    """A __cuda_array_interface__ (version 2, no stream) over library-owned device memory, so
    torch can wrap it without a copy; torch keeps this object, hence `owner`, alive while the
    tensor lives."""

    def __init__(self, ptr, shape, typestr, owner):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (int(ptr), False), "strides": None, "version": 2}
        self._owner = owner


def wrap_device_memory(ptr, shape, dtype, device_index, owner):
    """A torch CUDA tensor viewing library-owned device memory (no copy): dtype "i32" or "u8".
    Needs torch imported; ValueError when torch would have copied."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise ValueError("library-owned device buffers are handed out as torch tensors: import "
                         "torch first")
    typestr = {"i32": "<i4", "u8": "|u1"}[dtype]
    t = torch.as_tensor(_CudaArray(ptr, shape, typestr, owner), device="cuda:%d" % device_index)
    if t.data_ptr() != int(ptr):  # as_tensor copied: the engine would write the wrong memory
        raise ValueError("torch copied a library-owned device buffer instead of wrapping it")
    return t


def _host_view_i32(ptr, n, owner):
    """A writable int32 numpy view [n] of library-owned host memory that keeps owner alive."""
    buf = (ctypes.c_int32 * n).from_address(ptr)
    buf._owner = owner
    return np.frombuffer(buf, dtype=np.int32)


class DevicePlan:
    """A planned step whose metadata was built on the device (mla_step_*): a CUDA backend's
    DECODE / TARGET_VERIFY / fixed-window DRAFT_EXTEND step, or a graph step (any device). It
    has the step's shape but no host arrays: mla_backend_get_plan answers UNSUPPORTED for it.

    mode, batch_size, q_len (queries per row), num_q_tokens, num_draft_tokens, graph (a
    graph step over the fixed inputs), on_device (True). Reading a host array (kv_lens,
    block_table, ...) raises ValueError."""

    on_device = True
    _ARRAYS = Plan._ARRAYS

    def __init__(self, mode, batch_size, num_draft_tokens, source=None, generation=0, graph=False):
        self.mode = Mode(mode)
        self.batch_size = int(batch_size)
        self.num_draft_tokens = int(num_draft_tokens) if self.mode != Mode.DECODE else 0
        self.q_len = 1 if self.mode == Mode.DECODE else self.num_draft_tokens
        self.max_q_len = self.q_len
        # (an EXTEND graph step: num_draft_tokens is the token bucket, all the rows q / out hold)
        self.num_q_tokens = self.q_len if self.mode == Mode.EXTEND else self.batch_size * self.q_len
        self.causal = self.mode != Mode.DECODE
        self.graph = bool(graph)
        self._source = source
        self._generation = generation

    @property
    def valid(self):
        return self._source is None or self._source._generation == self._generation

    def __getattr__(self, name):
        if name in DevicePlan._ARRAYS:
            raise ValueError("%s: this %s step's metadata was built on the device (mla_step_*); "
                             "there is no host plan to read" % (name, self.mode.name))
        raise AttributeError(name)

    def __repr__(self):
        return "<libmla.DevicePlan %s bs=%d q=%d%s%s>" % (
            self.mode.name, self.batch_size, self.num_q_tokens, " graph" if self.graph else "",
            "" if self.valid else " STALE")


class Backend(_Handle):
    """mla_backend: cache + request table + plan + workspaces, one forward call per layer.

    Flow per step: extend the requests in `req_table` (the slots returned are
    this step's out_cache_loc), plan() once, then forward() per layer (it
    writes this step's latent rows, then runs attention for the planned mode).

    CUDA contexts: plan() builds DECODE, TARGET_VERIFY and fixed-window
    DRAFT_EXTEND steps on the device (it returns a DevicePlan: no host
    arrays), EXTEND without prefix runs ragged MHA on the GPU; every tensor of
    forward() (new_slots too) is device memory, and the calls follow torch's
    current stream. CUDA graphs: graph_init() once, graph_inputs() (the fixed
    request-id / length buffers), then per step write them, sync() outside
    the graph, graph_step() + forward() per layer inside it. Multi-step draft
    decode over the same inputs: draft_init() once, then draft_prepare()
    (every step's metadata) and, per step, draft_select(i) + forward() per
    layer. step_metadata(): the device-built step's arrays.
    """

    _LAST_ERROR = "mla_backend_last_error"

    def __init__(self, ctx, *, num_layers, num_pages, page_size, num_heads, scale, max_reqs,
                 max_context, max_bs, max_q_tokens, cache_dtype="bf16", act_dtype="bf16",
                 fp8_scales=None, qk_nope_dim=128, v_dim=128, extend_impl="absorbed",
                 chunk_capacity=0, num_sm=0):
        self.ctx = ctx
        cd = _cache_dtype(cache_dtype)
        act = mla_dtype(act_dtype, "act_dtype")
        impl = {"absorbed": ExtendImpl.ABSORBED, "mha_chunked": ExtendImpl.MHA_CHUNKED,
                "chunked": ExtendImpl.MHA_CHUNKED}.get(extend_impl, extend_impl)
        if not isinstance(impl, int):
            raise ValueError("extend_impl = %r: expected 'absorbed' or 'mha_chunked'" % (extend_impl,))
        self._scales = None
        if fp8_scales is not None:
            self._scales = np.ascontiguousarray(np.asarray(fp8_scales, np.float32).reshape(-1))
            if self._scales.shape[0] != num_layers:
                raise ValueError("argument 'fp8_scales': length %d, expected num_layers = %d"
                                 % (self._scales.shape[0], num_layers))
        cdesc = _lib.KVCacheDesc(int(num_layers), int(num_pages), int(page_size), int(cd),
                                 self._scales.__array_interface__["data"][0]
                                 if self._scales is not None else None)
        d = _lib.BackendDesc(cdesc, int(max_reqs), int(max_context), int(max_bs), int(max_q_tokens),
                             int(num_heads), float(scale), int(act), int(qk_nope_dim), int(v_dim),
                             int(impl), int(chunk_capacity), int(num_sm))
        h = ctypes.c_void_p()
        ctx._check(_c.mla_backend_create(ctx.handle, _byref(d), _byref(h)), "mla_backend_create")
        self._h = h.value
        _adopt(ctx, self)
        self.num_layers, self.num_heads, self.scale = int(num_layers), int(num_heads), float(scale)
        self.act_dtype = act
        self._act = mla_dtype_to_name(act)
        self._acts = (self._act,)
        self._bf = act == DType.BF16
        self.qk_nope_dim = int(qk_nope_dim) or 128
        self.v_dim = int(v_dim) or 128
        self.extend_impl = ExtendImpl(impl)
        self.max_bs, self.max_q_tokens, self.max_context = int(max_bs), int(max_q_tokens), int(max_context)
        p = ctypes.c_void_p()
        self._check(_c.mla_backend_cache(self._h, _byref(p)), "mla_backend_cache")
        self.cache = KVCache._borrow(ctx, p.value, self)
        self._check(_c.mla_backend_req_table(self._h, _byref(p)), "mla_backend_req_table")
        self.req_table = RequestTable._borrow(ctx, p.value, self, self.cache)
        self._generation = 0
        self._plan = None
        self._tq = 0
        self._uses_mha = False
        self._chunked = False
        self._args = _lib.ForwardArgs()
        self._fwd = _c.mla_backend_forward
        self._pplan = ctypes.POINTER(_lib.Plan)()
        self._i = ctypes.c_int()
        self._cuda = ctx.device == "cuda"
        self.graph_max_bs = None  # set by graph_init
        self.graph_max_draft_tokens = None
        self._graph_inputs = None
        self.draft_max_steps = None  # set by draft_init

    def close(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            for o in (getattr(self, "cache", None), getattr(self, "req_table", None)):
                if o is not None:
                    o._h = None
            _c.mla_backend_destroy(h)

    def _follow_stream(self):
        """CUDA: launch on torch's current stream of the context's device (when the context
        follows torch and torch is imported)."""
        ctx = self.ctx
        if ctx._follow_torch:
            raw = _raw_stream_fn or _torch_raw_stream()
            if raw is not None:
                s = raw(ctx.device_id)
                if s != ctx._stream:
                    ctx._check(_c.mla_ctx_set_stream(ctx._h, s or None), "mla_ctx_set_stream")
                    ctx._stream = s

    def plan(self, mode, req_ids=None, seq_lens=None, extend_lens=None, prefix_lens=None,
             num_draft_tokens=0, *, batch_args=None):
        """Plan a batch (once per forward step, shared by all layers); returns the Plan (valid
        until the next plan() call), or a DevicePlan (no host arrays) for a step the library
        built on the device (CUDA decode-type steps)."""
        b = batch_args or _BatchArgs(mode, req_ids, seq_lens, extend_lens, prefix_lens,
                                     num_draft_tokens)
        self._generation += 1
        self._plan = None
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_plan(self.handle, _byref(b.c)), "mla_backend_plan")
        st = _c.mla_backend_get_plan(self._h, _byref(self._pplan))
        if st == Status.ERR_UNSUPPORTED:
            p = DevicePlan(b.mode, b.bs, b.c.num_draft_tokens, self, self._generation)
        else:
            self._check(st, "mla_backend_get_plan")
            p = Plan(_lib.Plan.from_buffer_copy(self._pplan.contents), self, self._generation)
        self._check(_c.mla_backend_uses_mha(self._h, _byref(self._i)), "mla_backend_uses_mha")
        self._uses_mha = bool(self._i.value)
        self._chunked = self._uses_mha and b.prefix_any
        self._tq = p.num_q_tokens
        self._plan = p
        return p

    def get_plan(self):
        if self._plan is None:
            raise MLAError(Status.ERR_BAD_STATE, "mla_backend_get_plan", "no plan: call plan() first")
        return self._plan

    @property
    def uses_mha(self):
        """Whether the planned batch runs through MHA (EXTEND without prefix, or chunked)."""
        self._check(_c.mla_backend_uses_mha(self.handle, _byref(self._i)), "mla_backend_uses_mha")
        return bool(self._i.value)

    # -- CUDA graphs (mla_backend_graph_*)

    def graph_init(self, max_bs, max_draft_tokens=0):
        """Allocate the graph buffers (once): fixed request-id / length inputs of max_bs rows
        (all padding rows to begin with) and a workspace for every step up to max_bs rows and
        max_draft_tokens queries per row (0: DECODE only)."""
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_graph_init(self.handle, int(max_bs), int(max_draft_tokens)),
                    "mla_backend_graph_init")
        self.graph_max_bs = int(max_bs)
        self.graph_max_draft_tokens = int(max_draft_tokens)
        self._graph_inputs = None

    def graph_inputs(self):
        """(req_ids, seq_lens): the fixed int32 [graph_max_bs] inputs of graph steps, owned by
        the library and wrapped without a copy: torch CUDA tensors on a CUDA context (needs
        torch imported), writable numpy arrays on a CPU context. Write row i of a step of
        batch size bs into [i] (padding rows: REQ_PAD, seq_len 1); seq_lens follow the mode as
        in mla_batch. Valid until the backend is closed."""
        if self._graph_inputs is None:
            ids, seq = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(_c.mla_backend_graph_inputs(self.handle, _byref(ids), _byref(seq)),
                        "mla_backend_graph_inputs")
            n = self.graph_max_bs
            pi, ps = ids.value, seq.value
            if self._cuda:
                self._graph_inputs = (wrap_device_memory(pi, (n,), "i32", self.ctx.device_id, self),
                                      wrap_device_memory(ps, (n,), "i32", self.ctx.device_id, self))
            else:
                self._graph_inputs = (_host_view_i32(pi, n, self), _host_view_i32(ps, n, self))
        return self._graph_inputs

    def graph_init_extend(self, max_tokens):
        """EXTEND graph steps (the paged absorbed prefill at a token bucket; once, after
        graph_init): sizes their workspace for buckets up to max_tokens and returns the third
        fixed input, extend_lens int32 [graph_max_bs] (zeros; a torch CUDA tensor on a CUDA
        context, a writable numpy array on a CPU one). Then graph_step("extend", bs, bucket)."""
        if self._cuda:
            self._follow_stream()
        p = ctypes.c_void_p()
        self._check(_c.mla_backend_graph_init_extend(self.handle, int(max_tokens), _byref(p)),
                    "mla_backend_graph_init_extend")
        n = self.graph_max_bs
        self.graph_max_tokens = int(max_tokens)
        if self._cuda:
            self._graph_extend_lens = wrap_device_memory(p.value, (n,), "i32", self.ctx.device_id, self)
        else:
            self._graph_extend_lens = _host_view_i32(p.value, n, self)
        return self._graph_extend_lens

    def graph_step(self, mode, batch_size, num_draft_tokens=0):
        """Build a step's metadata from the graph inputs' first batch_size rows (enqueued on
        CUDA: capture it with the layers' forward() calls); forward() then runs this step.
        mode: decode, target_verify or draft_extend (a window of num_draft_tokens), or extend
        (after graph_init_extend; num_draft_tokens is then the token bucket, the rows q and
        out hold). Returns the DevicePlan."""
        m = _parse_mode(mode)
        ndt = int(num_draft_tokens or 0)
        self._generation += 1
        self._plan = None
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_graph_step(self.handle, int(m), int(batch_size), ndt),
                    "mla_backend_graph_step")
        p = DevicePlan(m, batch_size, ndt, self, self._generation, graph=True)
        self._uses_mha = self._chunked = False
        self._tq = p.num_q_tokens
        self._plan = p
        return p

    # -- multi-step draft decode (mla_backend_draft_*), over the graph inputs

    def draft_init(self, max_steps):
        """Allocate the draft workspace (once, after graph_init): up to max_steps (1..16) draft
        steps of up to graph_max_bs rows each."""
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_draft_init(self.handle, int(max_steps)), "mla_backend_draft_init")
        self.draft_max_steps = int(max_steps)

    def draft_prepare(self, batch_size, num_steps):
        """Build the metadata of num_steps DECODE draft steps at once from the graph inputs'
        first batch_size rows (seq_lens: the lengths before drafting; step i attends
        seq_len + i + 1 keys, so every request must already hold those positions). Enqueued
        on CUDA, like graph_step: capture it with the steps' forward() calls. Step 0 is
        selected. Returns the DevicePlan (num_steps, step: the selected step)."""
        self._generation += 1
        self._plan = None
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_draft_prepare(self.handle, int(batch_size), int(num_steps)),
                    "mla_backend_draft_prepare")
        p = DevicePlan(Mode.DECODE, batch_size, 0, self, self._generation, graph=True)
        p.num_steps, p.step = int(num_steps), 0
        self._uses_mha = self._chunked = False
        self._tq = p.num_q_tokens
        self._plan = p
        return p

    def draft_select(self, step):
        """Make forward() run draft step `step` (0..num_steps-1) of the last draft_prepare: host
        state only, so each step's forward calls can be captured after it."""
        self._check(_c.mla_backend_draft_select(self.handle, int(step)), "mla_backend_draft_select")
        if self._plan is not None:
            self._plan.step = int(step)

    def step_metadata(self):
        """The metadata of the step built on the device (a CUDA decode-type plan, a graph step,
        or the selected draft step) as a StepMetadata: views into the backend's workspace
        (read-only numpy on a CPU context, torch int32 CUDA tensors on a CUDA one, which needs
        torch imported), overwritten by the next step built there. MLAError (ERR_BAD_STATE)
        when the current plan is a host plan."""
        m = _lib.StepMetadata()
        self._check(_c.mla_backend_step_metadata(self.handle, _byref(m)),
                    "mla_backend_step_metadata")
        return StepMetadata(self, m)

    def _ws_view(self, ptr, shape):
        """An int32 view of library-owned workspace memory (what StepMetadata asks for)."""
        if not self._cuda:
            return _view_i32(ptr, shape, self)
        n = 1
        for d in shape:
            n *= d
        if n == 0 or not ptr:
            torch = sys.modules.get("torch")
            if torch is None:
                raise ValueError("library-owned device buffers are handed out as torch tensors: "
                                 "import torch first")
            return torch.empty(shape, dtype=torch.int32, device="cuda:%d" % self.ctx.device_id)
        return wrap_device_memory(ptr, shape, "i32", self.ctx.device_id, self)

    def sync(self):
        """Bring the device copy of the request table up to date (enqueued on the current
        stream; a no-op on the CPU). Call it after changing the table and before replaying a
        graph, outside the captured region."""
        if self._cuda:
            self._follow_stream()
        self._check(_c.mla_backend_sync(self.handle), "mla_backend_sync")

    def forward(self, layer, *, new_slots=None, new_c=None, new_r=None, q_nope=None, q_rope=None,
                q=None, k=None, v=None, kv_b_proj=None, out=None, lse=None, return_lse=False,
                lse_base2=False, fp8_math=False):
        """Run one layer of the planned batch.

        new_slots [N] int32, new_c [N, 512], new_r [N, 64]: this step's latent
        rows, written before attention (omit when N = 0); new_slots is host
        memory on a CPU context, a device tensor on a CUDA one. Absorbed modes:
        q_nope [Tq, H, 512], q_rope [Tq, H, 64], out [Tq, H, 512]. MHA
        (uses_mha): q [Tq, H, nope+64], k [Tq, H, nope+64], v [Tq, H, v_dim],
        out [Tq, H, v_dim], plus kv_b_proj [H, nope+v_dim, 512] when chunked.
        lse [Tq, H] fp32. fp8_math: MLA_FLAG_FP8_MATH for the absorbed modes (see
        attention_absorbed; the MHA modes ignore it). Returns out, or (out, lse).
        """
        if self._plan is None:
            raise MLAError(Status.ERR_BAD_STATE, "mla_backend_forward", "no plan: call plan() first")
        dev = self.ctx.device
        acts, bf = self._acts, self._bf
        a = self._args
        a.layer = int(layer)
        a.flags = _flags(lse_base2, fp8_math)
        if new_slots is not None or new_c is not None or new_r is not None:
            if self._cuda:  # device slots, as the CUDA cache write reads them
                n = check(new_c, "new_c", dtypes=acts, shape=(None, _lib.LATENT), device=dev,
                          bf16=bf).shape[0]
                sp = ptr_of(new_slots, "new_slots", dtypes=("i32",), shape=(n,), device=dev)
            else:
                sa, sp = int32_array(new_slots, "new_slots")
                n = sa.shape[0]
            a.num_new = n
            a.new_slots = sp
            a.new_c = ptr_of(new_c, "new_c", dtypes=acts, shape=(n, _lib.LATENT), device=dev, bf16=bf)
            a.new_r = ptr_of(new_r, "new_r", dtypes=acts, shape=(n, _lib.ROPE), device=dev, bf16=bf)
        else:
            a.num_new = 0
            a.new_slots = a.new_c = a.new_r = None
        T, H = self._tq, self.num_heads
        a.lse = None
        want_lse = return_lse or lse is not None
        if T > 0:
            if self._uses_mha:
                dqk = self.qk_nope_dim + _lib.ROPE
                a.q_nope = a.q_rope = None
                a.q = ptr_of(q, "q", dtypes=acts, shape=(T, H, dqk), device=dev, bf16=bf)
                a.k = ptr_of(k, "k", dtypes=acts, shape=(T, H, dqk), device=dev, bf16=bf)
                a.v = ptr_of(v, "v", dtypes=acts, shape=(T, H, self.v_dim), device=dev, bf16=bf)
                a.kv_b_proj = ptr_of(kv_b_proj, "kv_b_proj", dtypes=acts,
                                     shape=(H, self.qk_nope_dim + self.v_dim, _lib.LATENT),
                                     device=dev, bf16=bf) if self._chunked else None
                like, dout = q, self.v_dim
            else:
                a.q = a.k = a.v = a.kv_b_proj = None
                a.q_nope = ptr_of(q_nope, "q_nope", dtypes=acts, shape=(T, H, _lib.LATENT),
                                  device=dev, bf16=bf)
                a.q_rope = ptr_of(q_rope, "q_rope", dtypes=acts, shape=(T, H, _lib.ROPE),
                                  device=dev, bf16=bf)
                like, dout = q_nope, _lib.LATENT
            if out is None:
                out = empty_like_kind(like, (T, H, dout), self._act)
            a.out = ptr_of(out, "out", dtypes=acts, shape=(T, H, dout), device=dev, writable=True,
                           bf16=bf)
            if want_lse:
                if lse is None:
                    lse = empty_like_kind(like, (T, H), "f32")
                a.lse = ptr_of(lse, "lse", dtypes=("f32",), shape=(T, H), device=dev,
                               writable=True)
        else:
            a.q_nope = a.q_rope = a.q = a.k = a.v = a.kv_b_proj = a.out = None
        if self._cuda:
            self._follow_stream()
        st = self._fwd(self.handle, _byref(a))
        if st:
            self._check(st, "mla_backend_forward")
        return (out, lse) if want_lse else out
