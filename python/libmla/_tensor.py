"""Duck-typed tensors: numpy arrays and torch tensors without importing torch.

A tensor argument is accepted when it looks like one of:
  * a torch tensor: data_ptr(), dtype, device, is_contiguous(), shape
    (stride() is used when a call takes strided views);
  * a numpy array (or anything with __array_interface__);
  * a GPU array with __cuda_array_interface__ (cupy, numba): device memory.
Everything a C call would trust blindly (dtype, device, contiguity, shape,
writability) is checked here first, and a mismatch raises ValueError naming
the argument, so a wrong tensor never reaches the C side.
"""

import ctypes
import sys

import numpy as np

from ._lib import DType

# Canonical dtype names. numpy has no bfloat16: a uint16 array is taken as raw
# bf16 bits when the caller says so (dtype="bf16"); ml_dtypes.bfloat16 arrays
# are bf16 by name.
_NAME_TO_MLA = {"f32": DType.F32, "bf16": DType.BF16, "f16": DType.F16}
_ALIASES = {
    "float32": "f32", "f32": "f32", "float": "f32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "f16", "f16": "f16", "half": "f16",
    "int32": "i32", "int64": "i64", "int16": "i16", "uint16": "u16", "uint8": "u8", "int8": "i8",
    "float64": "f64", "double": "f64",
    "float8_e4m3fn": "fp8_e4m3", "bool": "bool",
}
_NAME_TO_NP = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32,
               "u8": np.uint8, "f64": np.float64, "i64": np.int64}
_TORCH_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i32": "int32",
                "u8": "uint8", "f64": "float64", "i64": "int64"}
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "i16": 2, "u16": 2, "u8": 1,
             "i8": 1, "f64": 8, "fp8_e4m3": 1, "bool": 1}

_dtype_cache = {}


def dtype_name(dt):
    """Canonical name ("f32", "bf16", "i32", ...) of a numpy/torch dtype or a string."""
    try:
        return _dtype_cache[dt]
    except (KeyError, TypeError):
        pass
    s = str(dt)
    if s.startswith("torch."):
        s = s[6:]
    name = _ALIASES.get(s, s)
    try:
        _dtype_cache[dt] = name
    except TypeError:
        pass
    return name


def mla_dtype(name, what="dtype"):
    """An activation dtype given as a string ("bf16", "float16"), a DType or a dtype object."""
    if isinstance(name, DType):
        return name
    if isinstance(name, int):
        return DType(name)
    n = dtype_name(name)
    if n == "fp8_e4m3" or n == "fp8":
        return DType.FP8_E4M3
    if n in ("fp8_e4m3_block", "fp8_block"):
        return DType.FP8_E4M3_BLOCK
    if n not in _NAME_TO_MLA:
        raise ValueError("%s = %r: expected 'f32', 'bf16' or 'f16'" % (what, name))
    return _NAME_TO_MLA[n]


def mla_dtype_to_name(t):
    return {DType.F32: "f32", DType.BF16: "bf16", DType.F16: "f16"}[DType(t)]


_addressof = ctypes.addressof
_char_from_buffer = ctypes.c_char.from_buffer
_ndarray = np.ndarray
_I32 = np.dtype(np.int32)


def _np_ptr(a):
    """Data pointer of a numpy array: via the buffer protocol when the array is writable
    and contiguous (about 3x cheaper than __array_interface__), else the interface."""
    try:
        return _addressof(_char_from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


class Tensor:
    """What the C call needs of one tensor argument."""

    __slots__ = ("obj", "ptr", "dtype", "shape", "strides", "device", "device_index", "contiguous",
                 "kind")

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n


def _is_torch(obj):
    return hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


def inspect(obj, name):
    """Read a tensor-like object; ValueError (naming `name`) when it is none."""
    t = Tensor()
    t.obj = obj
    if isinstance(obj, np.ndarray):
        # The common case, kept short: numpy arrays are host memory.
        t.kind = "numpy"
        t.contiguous = c = obj.flags.c_contiguous
        t.ptr = _np_ptr(obj) if c and obj.flags.writeable else obj.__array_interface__["data"][0]
        t.dtype = _dtype_cache.get(obj.dtype) or dtype_name(obj.dtype)
        t.shape = obj.shape
        t.strides = None
        t.device = "cpu"
        t.device_index = None
        return t
    if _is_torch(obj):
        t.kind = "torch"
        try:
            t.ptr = int(obj.data_ptr())
            t.dtype = dtype_name(obj.dtype)
            t.shape = tuple(obj.shape)
            t.contiguous = bool(obj.is_contiguous())
            dev = obj.device
        except Exception as e:  # a look-alike missing part of the protocol
            raise ValueError("argument '%s': not a usable tensor (%s)" % (name, e)) from None
        t.strides = None
        t.device = getattr(dev, "type", None) or str(dev).split(":")[0]
        t.device_index = getattr(dev, "index", None)
        return t
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        t.kind = "cuda_array"
        _from_interface(t, cai, name)
        t.device = "cuda"
        t.device_index = None
        return t
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        t.kind = "array_interface"
        _from_interface(t, ai, name)
        t.device = "cpu"
        t.device_index = None
        return t
    raise ValueError(
        "argument '%s': expected a numpy array or a torch tensor, got %s" % (name, type(obj).__name__)
    )


def _from_interface(t, ai, name):
    try:
        t.ptr = int(ai["data"][0] or 0)
        t.shape = tuple(int(d) for d in ai["shape"])
        dt = np.dtype(ai["typestr"])
        t.dtype = dtype_name(dt)
        st = ai.get("strides")
        if st is None:
            t.contiguous = True
        else:
            exp = dt.itemsize
            ok = True
            for d, s in zip(reversed(t.shape), reversed(st)):
                if d != 1 and s != exp:
                    ok = False
                exp *= d
            t.contiguous = ok
        t.strides = None
    except Exception as e:
        raise ValueError("argument '%s': malformed array interface (%s)" % (name, e)) from None


def element_strides(t):
    """Strides in elements (numpy strides are bytes; torch's stride() is elements)."""
    obj = t.obj
    if t.kind == "torch":
        return tuple(obj.stride())
    if t.kind == "numpy":
        size = obj.itemsize
        return tuple(s // size for s in obj.strides)
    return None


def _shape_str(shape):
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check(obj, name, *, dtypes, shape, device, writable=False, contiguous=True, bf16=False,
          allow_none=False):
    """Validate one tensor argument; returns its Tensor record (or None when
    allow_none and obj is None).

    dtypes: allowed canonical names (a uint16 array counts as "bf16" when
    bf16=True, i.e. when the caller declared bf16). shape: a tuple of ints or
    None (any size). device: "cpu" or "cuda".
    """
    if obj is None:
        if allow_none:
            return None
        raise ValueError("argument '%s' is required (got None)" % name)
    t = inspect(obj, name)
    if t.dtype == "u16" and bf16:
        t.dtype = "bf16"
    if t.dtype not in dtypes:
        hint = ""
        if t.dtype == "u16" and "bf16" in dtypes:
            hint = " (a uint16 array is taken as raw bf16 only with dtype='bf16')"
        raise ValueError("argument '%s': dtype %s, expected %s%s"
                         % (name, t.dtype, " or ".join(sorted(dtypes)), hint))
    if t.device != device:
        raise ValueError("argument '%s': tensor is on %s, this call needs %s memory"
                         % (name, t.device, device))
    if len(t.shape) != len(shape) or any(e is not None and e != d for e, d in zip(shape, t.shape)):
        raise ValueError("argument '%s': shape %s, expected %s"
                         % (name, _shape_str(t.shape), _shape_str(shape)))
    if contiguous and not t.contiguous:
        raise ValueError("argument '%s': must be contiguous (row-major); use "
                         "np.ascontiguousarray() / .contiguous()" % name)
    if writable and t.kind == "numpy" and not obj.flags.writeable:
        raise ValueError("argument '%s': array is read-only, an output must be writable" % name)
    if t.ptr == 0 and t.numel() > 0:
        raise ValueError("argument '%s': null data pointer" % name)
    return t


def dtype_of(obj):
    """Canonical dtype name of a numpy array / torch tensor (None for anything else)."""
    dt = getattr(obj, "dtype", None)
    if dt is None:
        return None
    return _dtype_cache.get(dt) or dtype_name(dt)


def _shape_ok(shape, spec):
    if len(shape) != len(spec):
        return False
    for d, e in zip(shape, spec):
        if e is not None and d != e:
            return False
    return True


def ptr_of(obj, name, *, dtypes, shape, device, writable=False, bf16=False):
    """check() for a contiguous tensor on a hot path, returning only its data pointer.

    numpy arrays and torch tensors that pass every check take a short path;
    anything else goes through check(), which raises the precise ValueError.
    """
    if type(obj) is _ndarray:
        dt = _dtype_cache.get(obj.dtype) or dtype_name(obj.dtype)
        if dt == "u16" and bf16:
            dt = "bf16"
        if (dt in dtypes and device == "cpu" and (obj.shape == shape or _shape_ok(obj.shape, shape))
                and obj.flags.c_contiguous and (not writable or obj.flags.writeable) and obj.size):
            return _np_ptr(obj)
    elif hasattr(obj, "data_ptr"):
        try:
            dt = _dtype_cache.get(obj.dtype) or dtype_name(obj.dtype)
            on = "cuda" if obj.is_cuda else ("cpu" if getattr(obj, "is_cpu", True) else None)
            if (dt in dtypes and on == device and
                    (obj.shape == shape or _shape_ok(tuple(obj.shape), shape)) and
                    obj.is_contiguous()):
                p = obj.data_ptr()
                if p:
                    return p
        except Exception:
            pass  # not quite a tensor: the full check says what is wrong
    return check(obj, name, dtypes=dtypes, shape=shape, device=device, writable=writable,
                 bf16=bf16).ptr


# ---- small helpers for index arrays and outputs --------------------------------------

def int32_array(obj, name, *, length=None, allow_none=False):
    """A host int32 vector for metadata arguments (request ids, lengths, slots).

    Lists, tuples and ranges are converted; int32 arrays are used as they are
    (no copy); other integer arrays (torch's default int64, say) are converted
    after a range check. Returns (array, pointer) with the array to keep alive.
    """
    if type(obj) is _ndarray and obj.dtype is _I32 and obj.ndim == 1 and obj.flags.c_contiguous:
        if length is not None and obj.shape[0] != length:
            raise ValueError("argument '%s': length %d, expected %d" % (name, obj.shape[0], length))
        return obj, _np_ptr(obj)
    if obj is None:
        if allow_none:
            return None, None
        raise ValueError("argument '%s' is required (got None)" % name)
    if isinstance(obj, np.ndarray) and obj.dtype == np.int32 and obj.ndim == 1 and \
            obj.flags.c_contiguous:
        a = obj
    elif isinstance(obj, (list, tuple, range)):
        try:
            a = np.asarray(obj, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("argument '%s': expected a sequence of integers" % name) from None
        a = _narrow(a, name)
    else:
        t = inspect(obj, name)
        if t.device != "cpu":
            raise ValueError("argument '%s': metadata must be host memory, got a %s tensor "
                             "(pass the CPU copy, e.g. seq_lens_cpu)" % (name, t.device))
        if t.dtype not in ("i32", "i64", "i16", "i8", "u8", "u16"):
            raise ValueError("argument '%s': dtype %s, expected an integer type" % (name, t.dtype))
        if t.kind == "numpy":
            a = obj
        elif t.kind == "torch":
            a = obj.numpy() if hasattr(obj, "numpy") else np.asarray(obj.tolist())
        else:
            a = np.asarray(obj)
        if a.ndim != 1:
            raise ValueError("argument '%s': shape %s, expected 1-D" % (name, _shape_str(a.shape)))
        if a.dtype != np.int32:
            a = _narrow(a, name)
        a = np.ascontiguousarray(a)
    if a.ndim != 1:
        raise ValueError("argument '%s': shape %s, expected 1-D" % (name, _shape_str(a.shape)))
    if length is not None and a.shape[0] != length:
        raise ValueError("argument '%s': length %d, expected %d" % (name, a.shape[0], length))
    return a, _np_ptr(a)


def _narrow(a, name):
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError("argument '%s': values do not fit int32" % name)
    return a.astype(np.int32)


def empty_like_kind(like, shape, dtype):
    """A new output tensor of `shape`/`dtype` of the same kind and device as
    `like` (torch stays torch, on its device; everything else gets numpy).
    numpy bf16 outputs are uint16 arrays of raw bf16 bits."""
    if like is not None and _is_torch(like):
        torch = sys.modules.get("torch")
        if torch is not None:
            return torch.empty(shape, dtype=getattr(torch, _TORCH_NAMES[dtype]), device=like.device)
    return np.empty(shape, dtype=_NAME_TO_NP[dtype])


def itemsize(name):
    return _ITEMSIZE[name]


def c_ptr_array(ptrs):
    """A C array of void* (for merge's list arguments)."""
    arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
    return arr
