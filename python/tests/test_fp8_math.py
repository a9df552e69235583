"""fp8_math=True (MLA_FLAG_FP8_MATH) on a CPU context: a permission the CPU never uses, so
attention_absorbed, Step.attention and Backend.forward accept it and give the same bits as
without it, over a per-tensor fp8 cache in the shapes where CUDA would switch to fp8 math
(more than 32 rows per request, pages >= 8) and over a bf16 cache."""

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import World, absorbed_reference

SCALE = 0.0722


def _q(rng, T, H):
    x = (rng.standard_normal((T, H, 576)) * 0.5).astype(np.float32)
    return ref.to_act(x, "bf16"), ref.round_act(x, "bf16")


def test_constant():
    assert libmla.FLAG_FP8_MATH == 4
    assert libmla.FLAG_FP8_MATH not in (libmla.FLAG_LSE_BASE2, libmla.FLAG_OUT_F32)


@pytest.mark.parametrize("cache_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("mode,ndt", [("decode", 0), ("target_verify", 2), ("draft_extend", 4)])
def test_absorbed_and_step_same_bits(ctx, rng, cache_dtype, mode, ndt):
    H = 48  # > 32 rows per request at every query length
    lens = [150, ndt if mode == "target_verify" else 1, 63, 64, 65]  # keys per request
    w = World(ctx, rng, lens, cache_dtype=cache_dtype, page_size=16, max_reqs=8, max_context=160,
              scales=[0.02, 0.5] if cache_dtype == "fp8" else None)
    q_len = 1 if mode == "decode" else ndt
    seq = [n - ndt if mode == "target_verify" else n for n in lens]
    p = libmla.plan(ctx, w.rt, mode, w.reqs, seq, num_draft_tokens=ndt, num_heads=H)
    T = len(lens) * q_len
    q_act, q = _q(rng, T, H)
    qn, qr = q_act[..., :512], q_act[..., 512:]
    for base2 in (False, True):
        o0, l0 = libmla.attention_absorbed(ctx, w.cache, 0, p, qn, qr, scale=SCALE, return_lse=True,
                                           lse_base2=base2, dtype="bf16")
        o1, l1 = libmla.attention_absorbed(ctx, w.cache, 0, p, qn, qr, scale=SCALE, return_lse=True,
                                           lse_base2=base2, fp8_math=True, dtype="bf16")
        np.testing.assert_array_equal(o0.view(np.uint16), o1.view(np.uint16))
        np.testing.assert_array_equal(l0, l1)
    # and it is the exact answer (not a CPU fp8 emulation)
    causal = mode != "decode"
    o_ref, l_ref = absorbed_reference(w, 0, w.reqs, [q_len] * len(lens), lens, q[..., :512],
                                      q[..., 512:], SCALE, causal)
    ref.assert_close(ref.from_act(o1, "bf16"), o_ref, 1e-2, 1.6e-2, "fp8_math out")
    ref.assert_close(l1 / ref.LOG2E, l_ref, 1e-4, 1e-5, "fp8_math lse")

    step = libmla.Step(ctx, mode, batch_size=len(lens), num_heads=H, max_kv_len=w.rt.max_context,
                       cache=w.cache, num_draft_tokens=ndt, scale=SCALE)
    step.prepare(w.cache, w.rt, np.array(w.reqs, np.int32), np.array(seq, np.int32))
    s0, sl0 = step.attention(w.cache, 0, qn, qr, return_lse=True, lse_base2=True, dtype="bf16")
    s1, sl1 = step.attention(w.cache, 0, qn, qr, return_lse=True, lse_base2=True, fp8_math=True,
                             dtype="bf16")
    np.testing.assert_array_equal(s0.view(np.uint16), s1.view(np.uint16))
    np.testing.assert_array_equal(sl0, sl1)


def test_backend_forward_same_bits(ctx, rng):
    H, NOPE, VD = 40, 128, 128
    be = libmla.Backend(ctx, num_layers=1, num_pages=40, page_size=8, num_heads=H, scale=SCALE,
                        max_reqs=4, max_context=128, max_bs=4, max_q_tokens=96, cache_dtype="fp8",
                        act_dtype="f32", fp8_scales=[0.02])
    rt = be.req_table
    a, b = rt.add(), rt.add()
    slots = np.concatenate([rt.extend(a, 21), rt.extend(b, 9)])
    T = 30
    c = rng.standard_normal((T, 512)).astype(np.float32)
    r = rng.standard_normal((T, 64)).astype(np.float32)
    q = (rng.standard_normal((T, H, NOPE + 64)) * 0.5).astype(np.float32)
    k = (rng.standard_normal((T, H, NOPE + 64)) * 0.5).astype(np.float32)
    v = rng.standard_normal((T, H, VD)).astype(np.float32)
    # EXTEND without prefix: MHA, where the backend drops the flag
    be.plan("extend", [a, b], [21, 9])
    assert be.uses_mha
    o0, l0 = be.forward(0, new_slots=slots, new_c=c, new_r=r, q=q, k=k, v=v, return_lse=True)
    o1, l1 = be.forward(0, q=q, k=k, v=v, return_lse=True, fp8_math=True)
    np.testing.assert_array_equal(o0, o1)
    np.testing.assert_array_equal(l0, l1)
    # DECODE: absorbed
    slots = np.concatenate([rt.extend(a, 1), rt.extend(b, 1)])
    be.plan("decode", [a, b], [22, 10])
    assert not be.uses_mha
    qn = (rng.standard_normal((2, H, 512)) * 0.5).astype(np.float32)
    qr = (rng.standard_normal((2, H, 64)) * 0.5).astype(np.float32)
    o0, l0 = be.forward(0, new_slots=slots, new_c=c[:2], new_r=r[:2], q_nope=qn, q_rope=qr,
                        return_lse=True)
    o1, l1 = be.forward(0, q_nope=qn, q_rope=qr, return_lse=True, fp8_math=True)
    assert np.isfinite(o0).all()
    np.testing.assert_array_equal(o0, o1)
    np.testing.assert_array_equal(l0, l1)


def test_keyword_reaches_the_flags(ctx, rng, monkeypatch):
    """fp8_math=True sets the flag bit in the C call: with the constant swapped for an
    unknown bit, each entry point is refused by the library (and fp8_math=False is not)."""
    H = 40
    w = World(ctx, rng, [20, 9], cache_dtype="fp8", page_size=16, scales=[0.02, 0.5])
    p = libmla.plan(ctx, w.rt, "decode", w.reqs, [20, 9], num_heads=H)
    q = (rng.standard_normal((2, H, 576)) * 0.5).astype(np.float32)
    qn, qr = np.ascontiguousarray(q[..., :512]), np.ascontiguousarray(q[..., 512:])
    step = libmla.Step(ctx, "decode", batch_size=2, num_heads=H, max_kv_len=w.rt.max_context,
                       cache=w.cache, scale=SCALE)
    step.prepare(w.cache, w.rt, np.array(w.reqs, np.int32), np.array([20, 9], np.int32))
    monkeypatch.setattr(libmla._lib, "FLAG_FP8_MATH", 8)
    libmla.attention_absorbed(ctx, w.cache, 0, p, qn, qr, scale=SCALE, fp8_math=False)
    step.attention(w.cache, 0, qn, qr, fp8_math=False)
    for call in (lambda: libmla.attention_absorbed(ctx, w.cache, 0, p, qn, qr, scale=SCALE,
                                                   fp8_math=True),
                 lambda: step.attention(w.cache, 0, qn, qr, fp8_math=True)):
        with pytest.raises(libmla.MLAError) as e:
            call()
        assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT and "flags" in str(e.value)
