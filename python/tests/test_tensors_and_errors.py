"""Duck-typed tensors, argument checks (ValueError naming the argument), MLAError, loading."""

import os
import subprocess
import sys

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import World

PY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__

    def __eq__(self, o):
        return isinstance(o, _Dtype) and o.name == self.name

    def __hash__(self):
        return hash(self.name)


class _Dev:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index


class FakeTorch:
    """Looks like a torch tensor to the binding (data_ptr, dtype, device, is_contiguous,
    shape, stride), backed by a numpy array; `device` may lie to test the device check."""

    _names = {"float32": "float32", "float16": "float16", "uint16": "bfloat16", "int32": "int32",
              "float64": "float64"}

    def __init__(self, a, device="cpu"):
        self.a = a
        self.dtype = _Dtype(self._names[a.dtype.name])
        self.device = _Dev(device, 0 if device == "cuda" else None)
        self.shape = a.shape

    def data_ptr(self):
        return self.a.__array_interface__["data"][0]

    def is_contiguous(self):
        return self.a.flags.c_contiguous

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def __getitem__(self, k):
        return FakeTorch(self.a[k], self.device.type)

    def reshape(self, *shape):
        return FakeTorch(self.a.reshape(*shape), self.device.type)


@pytest.fixture
def world(ctx, rng):
    return World(ctx, rng, [12, 5], page_size=4, num_layers=1)


def test_torch_like_tensors_match_numpy(ctx, rng, world):
    p = libmla.plan(ctx, world.rt, "decode", world.reqs, [12, 5], num_heads=2)
    q = ref.to_act(rng.standard_normal((2, 2, 576)), "bf16")
    o_np = libmla.attention_absorbed(ctx, world.cache, 0, p, q[..., :512], q[..., 512:], scale=0.1,
                                     dtype="bf16")
    t = FakeTorch(q)  # torch.bfloat16 by name: no dtype= needed
    out = FakeTorch(np.zeros((2, 2, 512), np.uint16))
    r = libmla.attention_absorbed(ctx, world.cache, 0, p, t[..., :512], t[..., 512:], scale=0.1,
                                  out=out)
    assert r is out
    np.testing.assert_array_equal(out.a, o_np)


def test_argument_checks_name_the_argument(ctx, rng, world):
    p = libmla.plan(ctx, world.rt, "decode", world.reqs, [12, 5], num_heads=2)
    q = rng.standard_normal((2, 2, 576)).astype(np.float32)
    qn, qr = np.ascontiguousarray(q[..., :512]), np.ascontiguousarray(q[..., 512:])
    call = lambda **kw: libmla.attention_absorbed(  # noqa: E731
        ctx, world.cache, 0, p, kw.pop("qn", qn), kw.pop("qr", qr), scale=0.1, **kw)
    cases = [
        (dict(qn=qn.astype(np.float64)), r"'q_nope'.*dtype f64"),
        (dict(qn=qn[:1]), r"'q_nope'.*shape \[1, 2, 512\], expected \[2, \*, 512\]"),
        (dict(qr=qr.astype(np.float16)), r"'q_rope'.*dtype f16, expected f32"),
        (dict(qr=qr[:, :1]), r"'q_rope'.*shape"),
        (dict(qn=[[0.0]]), r"'q_nope': expected a numpy array or a torch tensor, got list"),
        (dict(qn=qn.astype(np.uint16)), r"'q_nope'.*uint16 array is taken as raw bf16 only"),
        (dict(qn=FakeTorch(qn, "cuda")), r"'q_nope'.*on cuda, this call needs cpu"),
        (dict(out=np.zeros((2, 2, 512), np.float32)[:, :, ::-1]), r"'out'.*contiguous"),
        (dict(out=np.zeros((2, 2, 256), np.float32)), r"'out'.*shape"),
        (dict(lse=np.zeros((2, 2), np.float64)), r"'lse'.*dtype f64"),
        (dict(qn=np.zeros((2, 2, 1024), np.float32)[..., ::2], qr=qr), r"'q_nope'.*contiguous"
         r"|'q_nope' and 'q_rope'|last dimension"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call(**kw)
    ro = np.zeros((2, 2, 512), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="'out'.*read-only"):
        call(out=ro)
    # Mismatched strides between q_nope and q_rope views.
    q2 = np.zeros((2, 2, 600), np.float32)
    with pytest.raises(ValueError, match="'q_nope' and 'q_rope'"):
        call(qn=q2[..., :512], qr=qr)
    with pytest.raises(ValueError, match="'plan'"):
        libmla.attention_absorbed(ctx, world.cache, 0, "plan", qn, qr, scale=0.1)
    # Index arrays: host memory, integer, 1-D, fitting int32.
    with pytest.raises(ValueError, match="'slots'.*host memory"):
        world.cache.read(0, FakeTorch(np.zeros(2, np.int32), "cuda"))
    with pytest.raises(ValueError, match="'slots'.*integer"):
        world.cache.read(0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="'slots'.*int32"):
        world.cache.read(0, [2**40])
    with pytest.raises(ValueError, match="'qo_indptr'.*never decrease"):
        libmla.attention_ragged(ctx, qn, qn, qn, [0, 2, 1], [0, 1, 2], scale=0.1)
    with pytest.raises(ValueError, match="'kv_indptr'.*ends at 1"):
        libmla.attention_ragged(ctx, qn, qn, qn, [0, 1, 2], [0, 1, 1], scale=0.1)
    # int64 metadata (torch's default) is narrowed; values are checked by the library.
    world.cache.read(0, np.array([1, 2], np.int64))


def test_library_errors_raise_mlaerror(ctx, world):
    p = libmla.plan(ctx, world.rt, "decode", world.reqs, [12, 5], num_heads=2)
    q = np.zeros((2, 2, 576), np.float32)
    with pytest.raises(libmla.MLAError) as e:
        libmla.attention_absorbed(ctx, world.cache, 0, p, q[..., :512], q[..., 512:], scale=-1.0)
    err = e.value
    assert isinstance(err, RuntimeError)
    assert err.status == libmla.Status.ERR_INVALID_ARGUMENT and err.status_name == \
        "MLA_ERR_INVALID_ARGUMENT"
    assert err.function == "mla_attention_absorbed" and "scale" in err.message
    assert str(err).startswith("MLA_ERR_INVALID_ARGUMENT (1): mla_attention_absorbed")
    with pytest.raises(libmla.MLAError) as e:
        libmla.attention_absorbed(ctx, world.cache, 7, p, q[..., :512], q[..., 512:], scale=0.1)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "layer" in e.value.message
    with pytest.raises(libmla.MLAError) as e:
        ctx.num_threads = -3
    assert "num_threads" in e.value.message or e.value.status == libmla.Status.ERR_INVALID_ARGUMENT
    assert ctx.num_threads == 2


def test_cuda_context_is_reported():
    """This build's answer for a CUDA context: UNSUPPORTED (built without CUDA) or DEVICE (no
    GPU); with a GPU, the context works and attention reports UNSUPPORTED (not built yet)."""
    try:
        c = libmla.Context("cuda")
    except libmla.MLAError as e:
        assert e.status in (libmla.Status.ERR_UNSUPPORTED, libmla.Status.ERR_DEVICE)
        assert e.message  # the binding explains a failure the C API cannot describe
        return
    assert c.is_cuda
    with pytest.raises(libmla.MLAError) as e:
        c.cpu_isa
    assert e.value.status == libmla.Status.ERR_UNSUPPORTED


def _run_py(code, env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = PY_DIR
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_import_does_not_import_torch_and_reports_the_library():
    r = _run_py("import sys, libmla; print('torch' in sys.modules, libmla.library_version)", {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "False"
    assert r.stdout.split()[1] == libmla.library_version


def test_missing_library_message():
    r = _run_py("import libmla", {"MLA_LIBRARY": "/nonexistent/libmla.so"})
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "$MLA_LIBRARY: /nonexistent/libmla.so (no such file)" in \
        r.stderr and "cmake -S . -B build" in r.stderr
    # Without the variable the search order is listed: next to the package, build/, system.
    import libmla._lib as L
    saved = os.environ.pop("MLA_LIBRARY", None)
    try:
        where = [w for w, _ in L.candidate_paths()]
    finally:
        if saved is not None:
            os.environ["MLA_LIBRARY"] = saved
    assert where[0] == "next to the package" and "the README's build directory" in where
    assert any(w.startswith("the system path") for w in where)


def test_close_order_and_wrong_handles():
    c = libmla.Context(num_threads=1)
    cache = libmla.KVCache(c, 1, 4, 2, "bf16")
    rt = libmla.RequestTable(c, 2, 8, cache=cache)
    with pytest.raises(ValueError, match="'cache': expected a libmla.KVCache, got RequestTable"):
        libmla.gather_latent(c, rt, 0, [1])
    with pytest.raises(ValueError, match="'rt': expected a libmla.RequestTable"):
        libmla.plan(c, cache, "decode", [0], [1], num_heads=1, max_context=8)
    cache.close()  # closes the table attached to it first
    with pytest.raises(ValueError, match="RequestTable is closed"):
        rt.add()
    cache2 = libmla.KVCache(c, 1, 4, 2, "bf16")
    c.close()  # closes what was made from it
    with pytest.raises(ValueError, match="KVCache is closed"):
        cache2.read(0, [1])
    with pytest.raises(ValueError, match="Context is closed"):
        c.num_threads
