"""libmla.Backend: every forward mode of a small serving sequence against the reference."""

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import TOL

SCALE = 0.0722
H, NOPE, VD = 4, 128, 128


class Mirror:
    """float64 copies of what the backend's cache holds, per (layer, slot)."""

    def __init__(self, be, cache_dtype):
        self.be, self.cache_dtype, self.c, self.r = be, cache_dtype, {}, {}

    def write(self, layer, slots, c, r, act):
        sc, sr = ref.stored(ref.round_act(c, act), ref.round_act(r, act), self.cache_dtype,
                            self.be.cache.fp8_scales[layer])
        for i, s in enumerate(slots):
            self.c[(layer, int(s))], self.r[(layer, int(s))] = sc[i], sr[i]

    def rows(self, layer, rid, n):
        slots = self.be.req_table.req_to_token[rid, :n]
        return (np.array([self.c[(layer, int(s))] for s in slots]),
                np.array([self.r[(layer, int(s))] for s in slots]))


def _latent(rng, n):
    return (rng.standard_normal((n, 512)).astype(np.float32),
            rng.standard_normal((n, 64)).astype(np.float32))


def _absorbed_step(rng, be, m, layer, act, rids, q_lens, kv_lens, new_slots, causal):
    T = sum(q_lens)
    c, r = _latent(rng, len(new_slots))
    m.write(layer, new_slots, c, r, act)
    q = (rng.standard_normal((T, H, 576)) * 0.5).astype(np.float32)
    qn, qr = ref.to_act(q[..., :512], act), ref.to_act(q[..., 512:], act)
    o, lse = be.forward(layer, new_slots=new_slots, new_c=ref.to_act(c, act),
                        new_r=ref.to_act(r, act), q_nope=qn, q_rope=qr, return_lse=True)
    qv = ref.round_act(q, act)
    o_ref = np.zeros((T, H, 512))
    lse_ref = np.zeros((T, H))
    t = 0
    for rid, ql, kl in zip(rids, q_lens, kv_lens):
        cc, rr = m.rows(layer, rid, kl)
        o_ref[t:t + ql], lse_ref[t:t + ql] = ref.absorbed(qv[t:t + ql, :, :512], qv[t:t + ql, :, 512:],
                                                          cc, rr, SCALE, causal)
        t += ql
    ref.assert_close(ref.from_act(o, act), o_ref, *TOL[act], what="out")
    ref.assert_close(lse, lse_ref, 1e-4, 1e-5, "lse")


def _mha_step(rng, be, m, layer, act, rids, seq, pre, new_slots, wkv=None):
    """EXTEND through MHA: this step's q/k/v; prefix keys (when any) expanded from the
    stored latent with kv_b_proj = wkv."""
    q_lens = [s - p for s, p in zip(seq, pre)]
    T = sum(q_lens)
    c, r = _latent(rng, T)
    m.write(layer, new_slots, c, r, act)
    q = (rng.standard_normal((T, H, NOPE + 64)) * 0.5).astype(np.float32)
    k = (rng.standard_normal((T, H, NOPE + 64)) * 0.5).astype(np.float32)
    v = rng.standard_normal((T, H, VD)).astype(np.float32)
    kw = {}
    if wkv is not None:
        kw["kv_b_proj"] = ref.to_act(wkv, act)
    o, lse = be.forward(layer, new_slots=new_slots, new_c=ref.to_act(c, act),
                        new_r=ref.to_act(r, act), q=ref.to_act(q, act), k=ref.to_act(k, act),
                        v=ref.to_act(v, act), return_lse=True, **kw)
    qv, kv_, vv = ref.round_act(q, act), ref.round_act(k, act), ref.round_act(v, act)
    o_ref = np.zeros((T, H, VD))
    lse_ref = np.zeros((T, H))
    t = 0
    for rid, ql, p in zip(rids, q_lens, pre):
        kk, vvv = kv_[t:t + ql], vv[t:t + ql]
        if p:
            cc, rr = m.rows(layer, rid, p)
            w = ref.round_act(wkv, act)
            kp = np.concatenate([np.einsum("tl,hnl->thn", cc, w[:, :NOPE]),
                                 np.broadcast_to(rr[:, None], (p, H, 64))], axis=-1)
            vp = np.einsum("tl,hnl->thn", cc, w[:, NOPE:])
            kk, vvv = np.concatenate([ref.round_act(kp, act), kk]), \
                np.concatenate([ref.round_act(vp, act), vvv])
        o_ref[t:t + ql], lse_ref[t:t + ql] = ref.attend(qv[t:t + ql], kk, vvv, SCALE, True)
        t += ql
    ref.assert_close(ref.from_act(o, act), o_ref, *TOL[act], what="mha out")
    ref.assert_close(lse, lse_ref, 2e-4, 2e-5, "mha lse")


@pytest.mark.parametrize("cache_dtype,act,impl", [("bf16", "f32", "absorbed"),
                                                  ("fp8_block", "bf16", "mha_chunked"),
                                                  ("fp8", "f32", "mha_chunked")])
def test_serving_sequence(ctx, rng, cache_dtype, act, impl):
    be = libmla.Backend(ctx, num_layers=2, num_pages=40, page_size=8, num_heads=H, scale=SCALE,
                        max_reqs=6, max_context=128, max_bs=4, max_q_tokens=96,
                        cache_dtype=cache_dtype, act_dtype=act,
                        fp8_scales=[0.5, 2.0] if cache_dtype == "fp8" else None,
                        extend_impl=impl, chunk_capacity=16)
    rt, m = be.req_table, Mirror(be, cache_dtype)
    wkv = (rng.standard_normal((H, NOPE + VD, 512)) * 0.04).astype(np.float32)
    a, b = rt.add(), rt.add()
    # 1. Prefill without prefix: ragged MHA.
    seq = [21, 9]
    slots = np.concatenate([rt.extend(a, 21), rt.extend(b, 9)])
    be.plan("extend", [a, b], seq)
    assert be.uses_mha
    for layer in range(2):
        _mha_step(rng, be, m, layer, act, [a, b], seq, [0, 0], slots)
    # 2. Decode one token.
    slots = np.concatenate([rt.extend(a, 1), rt.extend(b, 1)])
    p = be.plan("decode", [a, b], [22, 10])
    assert not be.uses_mha and p.num_q_tokens == 2 and be.get_plan() is p
    for layer in range(2):
        _absorbed_step(rng, be, m, layer, act, [a, b], [1, 1], [22, 10], slots, False)
    # 3. Target verify 3 drafts, then roll back 2 of them.
    slots = np.concatenate([rt.extend(a, 3), rt.extend(b, 3)])
    be.plan("target_verify", [a, b], [22, 10], num_draft_tokens=3)
    for layer in range(2):
        _absorbed_step(rng, be, m, layer, act, [a, b], [3, 3], [25, 13], slots, True)
    rt.truncate(a, 23)
    rt.truncate(b, 11)
    # 4. Draft extend (varlen): the accepted tokens again through the draft model.
    be.plan("draft_extend", [a, b], [23, 11], extend_lens=[2, 1])
    _absorbed_step(rng, be, m, 1, act, [a, b], [2, 1], [23, 11], [], True)
    # 5. Extend over a cached prefix (a forked request shares it), absorbed or chunked MHA.
    c = rt.fork(a, 16)
    slots = np.concatenate([rt.extend(c, 5), rt.extend(b, 4)])
    be.plan("extend", [c, b], [21, 15], prefix_lens=[16, 11])
    if impl == "absorbed":
        assert not be.uses_mha
        _absorbed_step(rng, be, m, 0, act, [c, b], [5, 4], [21, 15], slots, True)
    else:
        assert be.uses_mha
        _mha_step(rng, be, m, 0, act, [c, b], [21, 15], [16, 11], slots, wkv)
    # 6. IDLE: nothing to do, nothing touched.
    be.plan("idle")
    assert be.forward(0) is None


def test_errors(ctx, rng):
    be = libmla.Backend(ctx, num_layers=1, num_pages=8, page_size=4, num_heads=2, scale=0.1,
                        max_reqs=2, max_context=16, max_bs=2, max_q_tokens=16, act_dtype="bf16")
    with pytest.raises(libmla.MLAError) as e:
        be.forward(0)
    assert e.value.status == libmla.Status.ERR_BAD_STATE and "plan" in str(e.value)
    r = be.req_table.add()
    s = be.req_table.extend(r, 3)
    be.plan("decode", [r], [3])
    q = np.zeros((1, 2, 512), np.uint16)  # bf16 bits: the backend's act dtype says so
    qr = np.zeros((1, 2, 64), np.uint16)
    with pytest.raises(ValueError, match="'q_nope'.*shape"):
        be.forward(0, q_nope=np.zeros((2, 2, 512), np.uint16), q_rope=qr)
    with pytest.raises(ValueError, match="'q_rope'.*dtype f32"):
        be.forward(0, q_nope=q, q_rope=qr.astype(np.float32))
    with pytest.raises(ValueError, match="'q_rope' is required"):
        be.forward(0, q_nope=q)
    with pytest.raises(ValueError, match="'new_c'"):
        be.forward(0, new_slots=s[-1:], new_c=np.zeros((2, 512), np.uint16),
                   new_r=np.zeros((1, 64), np.uint16), q_nope=q, q_rope=qr)
    with pytest.raises(libmla.MLAError) as e:
        be.forward(3, q_nope=q, q_rope=qr)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "layer" in e.value.message
    with pytest.raises(libmla.MLAError) as e:
        be.forward(0, new_slots=[999], new_c=np.zeros((1, 512), np.uint16),
                   new_r=np.zeros((1, 64), np.uint16), q_nope=q, q_rope=qr)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "slots" in e.value.message
    o = be.forward(0, q_nope=q, q_rope=qr)
    assert o.dtype == np.uint16 and o.shape == (1, 2, 512)
    with pytest.raises(libmla.MLAError) as e:
        be.plan("decode", [r], [4])
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "req_ids[0]" in e.value.message
    with pytest.raises(libmla.MLAError):
        be.get_plan()  # a failed plan leaves none
    with pytest.raises(libmla.MLAError) as e:
        libmla.Backend(ctx, num_layers=1, num_pages=8, page_size=4, num_heads=0, scale=0.1,
                       max_reqs=2, max_context=16, max_bs=2, max_q_tokens=16)
    assert "num_heads" in e.value.message
    with pytest.raises(ValueError, match="extend_impl"):
        libmla.Backend(ctx, num_layers=1, num_pages=8, page_size=4, num_heads=1, scale=0.1,
                       max_reqs=2, max_context=16, max_bs=2, max_q_tokens=16, extend_impl="x")
    be.close()
    with pytest.raises(ValueError, match="closed"):
        be.plan("idle")
