"""What a Python call adds on top of the C call it makes (CPU, measured, never asserted).

Method ("C work stubbed out"): the binding's call is timed with its C
function swapped for a C function of compatible signature that returns at
once, and that stub is also timed called directly through ctypes with an
argument struct filled once beforehand (the floor any Python caller pays).
The difference is exactly the binding's own work: argument checks, duck
typing, struct filling and the status check. Timings are medians of
interleaved rounds. The decode batch is b = 128 (one head, one key per
request); the Python side does not depend on heads or context length.

For scale, the real C call is timed too, directly and through the binding;
the difference of those two is dominated by the C call's own run-to-run
noise on a shared CPU, which is why the stubbed numbers are the measurement.
The numbers are printed in the run's summary ("libmla measurements").
"""

import ctypes
import statistics
import time

import numpy as np

import libmla
import libmla.api as api
from libmla import _lib
from conftest import REPORT

BS = 128


def _per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _compare(py, c, rounds=15, calls=40):
    tp, tc = [], []
    for _ in range(rounds):
        tp.append(_per_call(py, calls))
        tc.append(_per_call(c, calls))
    return statistics.median(tp) * 1e6, statistics.median(tc) * 1e6


class _Swap:
    """api._c with one function replaced (the module looks functions up on each call)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getattr__(self, n):
        return self.fn if n == self.name else getattr(_lib.lib, n)


def test_python_call_overhead():
    ctx = libmla.Context(num_threads=1)
    heads = 1
    be = libmla.Backend(ctx, num_layers=1, num_pages=BS * 2 + 2, page_size=1, num_heads=heads,
                        scale=0.1, max_reqs=BS, max_context=8, max_bs=BS, max_q_tokens=BS,
                        cache_dtype="bf16", act_dtype="bf16")
    rt = be.req_table
    rids = np.array([rt.add() for _ in range(BS)], np.int32)
    slots = np.array([rt.extend(r, 1)[0] for r in rids], np.int32)
    seq = np.ones(BS, np.int32)
    rng = np.random.default_rng(1)
    bits = lambda *s: libmla.f32_to_bf16(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    c, r = bits(BS, 512), bits(BS, 64)
    q = bits(BS, heads, 576)
    qn, qr = np.ascontiguousarray(q[..., :512]), np.ascontiguousarray(q[..., 512:])
    out = np.empty((BS, heads, 512), np.uint16)
    ptr = lambda x: x.__array_interface__["data"][0]  # noqa: E731
    lines = ["python call overhead, decode b=%d, CPU (method: the binding's C call swapped for "
             "a no-op C function, minus that no-op called directly via ctypes; see "
             "test_overhead.py):" % BS]

    # Backend.forward: KV write + attention in one C call (mla_backend_forward).
    be.plan("decode", rids, seq)
    a = _lib.ForwardArgs()
    a.layer, a.num_new, a.new_slots, a.new_c, a.new_r = 0, BS, ptr(slots), ptr(c), ptr(r)
    a.q_nope, a.q_rope, a.out = ptr(qn), ptr(qr), ptr(out)
    fwd, h, ref_a = _lib.lib.mla_backend_forward, be.handle, ctypes.byref(a)
    py = lambda: be.forward(0, new_slots=slots, new_c=c, new_r=r, q_nope=qn, q_rope=qr,  # noqa
                            out=out)
    assert fwd(h, ref_a) == 0
    real_py, real_c = _compare(py, lambda: fwd(h, ref_a))
    # The stub: mla_backend_uses_mha(be, int *) returns at once; it writes one int into the
    # struct's first field, which the next call sets again.
    stub = _lib.lib["mla_backend_uses_mha"]
    stub.restype, stub.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_lib.ForwardArgs)]
    be._fwd = stub
    tp, tc = _compare(py, lambda: stub(h, ref_a), calls=200)
    be._fwd = fwd
    lines.append("  Backend.forward:                      %5.2f us (%.2f us through the binding, "
                 "%.2f us the bare ctypes call)" % (tp - tc, tp, tc))

    # SglangMLABackend.forward_decode with q_nope/q_rope and k/k_rope (one backend call).
    sg = libmla.SglangMLABackend(num_heads=heads, num_layers=1, num_pages=BS * 2 + 2,
                                 page_size=1, scale=0.1, max_reqs=BS, max_context_len=8,
                                 max_bs=BS, max_num_tokens=BS, dtype="bf16", ctx=ctx)
    srids = np.array([sg.alloc_req() for _ in range(BS)], np.int32)
    sslots = np.array([sg.extend_req(x, 1)[0] for x in srids], np.int32)
    fb = libmla.ForwardBatch("decode", srids, seq, out_cache_loc=sslots)
    sg.init_forward_metadata(fb)
    sg.backend._fwd = stub
    tp, tc = _compare(lambda: sg.forward_decode(qn, c, None, 0, fb, q_rope=qr, k_rope=r),
                      lambda: stub(h, ref_a), calls=200)
    sg.backend._fwd = fwd
    lines.append("  SglangMLABackend.forward_decode:      %5.2f us (q_nope + q_rope, k + k_rope)"
                 % (tp - tc))

    # attention_absorbed (functional) on the same plan; stub: mla_ctx_synchronize(ctx), a
    # no-op on a CPU context (the x86-64 / AArch64 C ABIs ignore the extra arguments).
    plan = be.get_plan()
    aa = _lib.AbsorbedArgs(heads, 0.1, 0, int(libmla.DType.BF16), ptr(qn), ptr(qr), 0, 0,
                           ptr(out), None)
    att_types = _lib.PROTOTYPES["mla_attention_absorbed"][1]
    sync = _lib.lib["mla_ctx_synchronize"]
    sync.restype, sync.argtypes = ctypes.c_int, att_types
    libmla.attention_absorbed(ctx, be.cache, 0, plan, qn, qr, scale=0.1, out=out, dtype="bf16")
    wp, wn = ctx._scratch(0)
    ch, cache_h, pr, ar = ctx.handle, be.cache.handle, ctypes.byref(plan.c), ctypes.byref(aa)
    saved = api._c
    api._c = _Swap("mla_attention_absorbed", sync)
    try:
        tp, tc = _compare(lambda: libmla.attention_absorbed(ctx, be.cache, 0, plan, qn, qr,
                                                            scale=0.1, out=out, dtype="bf16"),
                          lambda: sync(ch, cache_h, 0, pr, ar, wp, wn), calls=200)
    finally:
        api._c = saved
    lines.append("  attention_absorbed:                   %5.2f us" % (tp - tc))

    # IDLE batch: the real C call does nothing, so no stub is needed.
    be.plan("idle")
    idle = ctypes.byref(_lib.ForwardArgs())
    tp, tc = _compare(lambda: be.forward(0), lambda: fwd(h, idle), calls=200)
    lines.append("  Backend.forward on an IDLE batch:     %5.2f us" % (tp - tc))
    lines.append("  for scale, the real mla_backend_forward of this batch (1 thread): %.0f us "
                 "direct, %.0f us through the binding" % (real_c, real_py))

    REPORT.extend(lines)
    for ln in lines:
        print(ln)
    assert real_c > 0 and tp > 0  # measured, not judged
