"""Attention kernels through the functional API, against the float64 reference."""

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import TOL, World, absorbed_reference

SCALE = 0.0722  # sglang passes 192^-0.5 * mscale^2; any positive value works


def _q(rng, T, H, dtype, dim=576):
    x = (rng.standard_normal((T, H, dim)) * 0.5).astype(np.float32)
    return ref.to_act(x, dtype), ref.round_act(x, dtype)


def _run_absorbed(ctx, w, p, q_act, dtype, strided):
    if strided:  # views of one [T, H, 576] tensor
        return libmla.attention_absorbed(ctx, w.cache, 0, p, q_act[..., :512], q_act[..., 512:],
                                         scale=SCALE, return_lse=True, dtype=dtype)
    qn = np.ascontiguousarray(q_act[..., :512])
    qr = np.ascontiguousarray(q_act[..., 512:])
    return libmla.attention_absorbed(ctx, w.cache, 0, p, qn, qr, scale=SCALE, return_lse=True,
                                     dtype=dtype)


@pytest.mark.parametrize("cache_dtype,act", [("bf16", "f32"), ("bf16", "bf16"), ("f16", "f16"),
                                             ("fp8", "bf16"), ("fp8_block", "f32")])
def test_decode(ctx, rng, cache_dtype, act):
    lens = [33, 1, 70]
    scales = [0.3, 1.0] if cache_dtype == "fp8" else None
    w = World(ctx, rng, lens, cache_dtype=cache_dtype, page_size=16, scales=scales)
    H = 8
    p = libmla.plan(ctx, w.rt, "decode", w.reqs, lens, num_heads=H)
    q_act, q = _q(rng, 3, H, act)
    o_ref, lse_ref = absorbed_reference(w, 0, w.reqs, [1, 1, 1], lens, q[..., :512], q[..., 512:],
                                        SCALE, False)
    atol, rtol = TOL[act]
    o_s, lse_s = _run_absorbed(ctx, w, p, q_act, act, strided=True)
    o_c, lse_c = _run_absorbed(ctx, w, p, q_act, act, strided=False)
    ref.assert_close(ref.from_act(o_c, act), o_ref, atol, rtol, "decode out")
    ref.assert_close(lse_c, lse_ref, 1e-4, 1e-5, "decode lse")
    # Strided q views give the same bits as contiguous copies.
    np.testing.assert_array_equal(o_s, o_c)
    np.testing.assert_array_equal(lse_s, lse_c)
    # Base-2 LSE.
    _, lse2 = libmla.attention_absorbed(ctx, w.cache, 0, p, q_act[..., :512], q_act[..., 512:],
                                        scale=SCALE, return_lse=True, lse_base2=True, dtype=act)
    ref.assert_close(lse2, lse_ref * ref.LOG2E, 1e-4, 1e-5, "lse base 2")


def test_verify_draft_extend_and_prefix(ctx, rng):
    H, act = 4, "f32"
    w = World(ctx, rng, [20, 45], page_size=8)
    atol, rtol = TOL[act]
    pl = libmla.Planner(ctx, max_bs=4, max_q_tokens=64, max_kv_tokens=512, max_context=256,
                        page_size=8)
    cases = [
        # mode, kwargs, q lens, kv lens
        ("target_verify", dict(seq_lens=[17, 42], num_draft_tokens=3), [3, 3], [20, 45]),
        ("draft_extend", dict(seq_lens=[20, 45], extend_lens=[2, 5]), [2, 5], [20, 45]),
        ("draft_extend", dict(seq_lens=[20, 45], num_draft_tokens=4), [4, 4], [20, 45]),
        ("extend", dict(seq_lens=[20, 45], prefix_lens=[12, 44]), [8, 1], [20, 45]),
        # More queries than keys: the first query sees nothing (o = 0, lse = -inf).
        ("draft_extend", dict(seq_lens=[2, 45], extend_lens=[3, 1]), [3, 1], [2, 45]),
    ]
    for mode, kw, q_lens, kv_lens in cases:
        p = pl.build(w.rt, mode, w.reqs, num_heads=H, **kw)
        assert p.causal
        q_act, q = _q(rng, sum(q_lens), H, act)
        o, lse = _run_absorbed(ctx, w, p, q_act, act, strided=True)
        o_ref, lse_ref = absorbed_reference(w, 0, w.reqs, q_lens, kv_lens, q[..., :512],
                                            q[..., 512:], SCALE, True)
        ref.assert_close(o, o_ref, atol, rtol, mode + " out")
        ref.assert_close(lse, lse_ref, 1e-4, 1e-5, mode + " lse")
    assert np.isneginf(lse[0]).all() and not o[0].any()


def test_padding_rows(ctx, rng):
    w = World(ctx, rng, [10, 25], page_size=4)
    H = 2
    rids = [w.reqs[0], libmla.REQ_PAD, w.reqs[1]]
    p = libmla.plan(ctx, w.rt, "decode", rids, [10, 1, 25], num_heads=H)
    q_act, q = _q(rng, 3, H, "f32")
    o, lse = _run_absorbed(ctx, w, p, q_act, "f32", strided=False)
    o_ref, lse_ref = absorbed_reference(w, 0, [w.reqs[0], w.reqs[1]], [1, 1], [10, 25],
                                        q[[0, 2], :, :512], q[[0, 2], :, 512:], SCALE, False)
    ref.assert_close(o[[0, 2]], o_ref, *TOL["f32"], what="real rows")
    assert np.isfinite(o[1]).all()  # the padding row read the dummy slot only


@pytest.mark.parametrize("act", ["f32", "bf16"])
def test_ragged_mha(ctx, rng, act):
    H, Hkv, Dqk, Dv = 4, 2, 192, 128
    q_lens, kv_lens = [5, 1, 9, 0], [5, 7, 4, 3]  # K < Q, Q = 0 and prefix-style K > Q
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    Tq, Tk = qo[-1], kv[-1]
    q_act, q = _q(rng, Tq, H, act, Dqk)
    k_act, k = _q(rng, Tk, Hkv, act, Dqk)
    v_act, v = _q(rng, Tk, Hkv, act, Dv)
    atol, rtol = TOL[act]
    for causal in (True, False):
        for cap in (0.0, 5.0):
            o, lse = libmla.attention_ragged(ctx, q_act, k_act, v_act, qo, kv, scale=SCALE,
                                             causal=causal, softcap=cap, return_lse=True,
                                             dtype=act)
            o_ref, lse_ref = ref.ragged(q, k, v, qo, kv, SCALE, causal, cap)
            ref.assert_close(ref.from_act(o, act), o_ref, atol, rtol, "ragged causal=%s cap=%g"
                             % (causal, cap))
            ref.assert_close(lse, lse_ref, 1e-4, 1e-5, "ragged lse")
    # fp32 output of bf16 inputs (partial states to merge).
    o32 = libmla.attention_ragged(ctx, q_act, k_act, v_act, qo, kv, scale=SCALE, out_f32=True,
                                  dtype=act)
    assert o32.dtype == np.float32
    o_ref, _ = ref.ragged(q, k, v, qo, kv, SCALE, True)
    ref.assert_close(o32, o_ref, *TOL["f32"], what="ragged out_f32") if act == "f32" else \
        ref.assert_close(o32, o_ref, 2e-3, 2e-3, "ragged out_f32")
    # the optional workspace is a CUDA matter: none on a CPU context, and ignored there
    assert libmla.ragged_workspace_size(ctx) == 0
    o_nows = libmla.attention_ragged(ctx, q_act, k_act, v_act, qo, kv, scale=SCALE, dtype=act,
                                     workspace=None)
    o_auto = libmla.attention_ragged(ctx, q_act, k_act, v_act, qo, kv, scale=SCALE, dtype=act)
    assert np.array_equal(o_nows, o_auto)


@pytest.mark.parametrize("act", ["f32", "bf16"])
def test_merge(ctx, rng, act):
    T, H, D, n = 5, 3, 128, 3
    parts = [rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(n)]
    lses = [(rng.standard_normal((T, H)) * 3).astype(np.float32) for _ in range(n)]
    lses[1][0] = -np.inf  # an empty side
    for s in lses:
        s[2] = -np.inf  # every side empty on token 2
    o_act = [ref.to_act(x, act) for x in parts]
    o, lse = libmla.merge_states(ctx, o_act, lses, dtype=act)
    o_ref, lse_ref = ref.merge([ref.round_act(x, act) for x in parts], lses)
    ref.assert_close(ref.from_act(o, act), o_ref, *TOL[act], what="merge out")
    ref.assert_close(lse, lse_ref, 1e-5, 1e-6, "merge lse")
    assert not np.isnan(ref.from_act(o, act)).any() and not ref.from_act(o, act)[2].any()
    # In place, base 2.
    l2 = [x * np.float32(ref.LOG2E) for x in lses]
    o2, lse2 = libmla.merge_states(ctx, o_act, l2, lse_base2=True, dtype=act)
    o0 = o_act[0].copy()
    libmla.merge_states(ctx, [o0] + o_act[1:], l2, out=o0, lse_out=l2[0], lse_base2=True, dtype=act)
    np.testing.assert_array_equal(o0, o2)
    np.testing.assert_array_equal(l2[0], lse2)
    ref.assert_close(ref.from_act(o2, act), o_ref, *TOL[act], what="merge out base 2")
    ref.assert_close(lse2, lse_ref * ref.LOG2E, 1e-5, 1e-6, "merge lse base 2")


def test_gather_and_expand(ctx, rng):
    w = World(ctx, rng, [9], cache_dtype="fp8", page_size=4, scales=[0.05, 1.0])
    slots = w.rt.req_to_token[w.reqs[0], :9][::-1].copy()
    c, r = libmla.gather_latent(ctx, w.cache, 0, slots)
    c_ref = np.array([w.c[(0, int(s))] for s in slots])
    np.testing.assert_array_equal(c.astype(np.float64), c_ref)
    _, r16 = libmla.gather_latent(ctx, w.cache, 0, slots, "f16", parts="r")
    np.testing.assert_array_equal(r16, np.array([w.r[(0, int(s))] for s in slots]).astype(np.float16))
    H, nope, vd = 3, 32, 16
    wkv = (rng.standard_normal((H, nope + vd, 512)) * 0.05).astype(np.float32)
    k, v = libmla.expand_kv(ctx, c, r, wkv, nope_dim=nope)
    assert k.shape == (9, H, nope + 64) and v.shape == (9, H, vd)
    cd = c.astype(np.float64)
    k_ref = np.einsum("tl,hnl->thn", cd, wkv[:, :nope].astype(np.float64))
    v_ref = np.einsum("tl,hnl->thn", cd, wkv[:, nope:].astype(np.float64))
    ref.assert_close(k[..., :nope], k_ref, 1e-5, 1e-4, "expand k")
    np.testing.assert_array_equal(k[..., nope:], np.broadcast_to(r[:, None, :], (9, H, 64)))
    ref.assert_close(v, v_ref, 1e-5, 1e-4, "expand v")
    with pytest.raises(ValueError, match="'nope_dim'"):
        libmla.expand_kv(ctx, c, r, wkv, nope_dim=48)


def test_convert(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    x[:4] = [np.nan, np.inf, -0.0, 3.0e38]
    b = libmla.f32_to_bf16(x)
    np.testing.assert_array_equal(b[1:], ref.f32_to_bf16_bits(x)[1:])
    assert np.isnan(libmla.bf16_to_f32(b)[0])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(libmla.convert(x, "f16"), x.astype(np.float16))
    np.testing.assert_array_equal(libmla.convert(x[4:].astype(np.float64), "f32"), x[4:])
