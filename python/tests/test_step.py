"""libmla.Step (mla_step_*) on a CPU context, against the host plan and the float64 reference.

The step's metadata equals what the Planner builds for the same batch (and what
req_to_token says, computed here), its attention equals attention_absorbed over
that plan bit for bit and the float64 reference within tolerance, for DECODE,
TARGET_VERIFY and DRAFT_EXTEND with padding rows, over fixed input arrays
rewritten in place between steps (as a captured CUDA graph reuses them). Then
the argument checks: ValueError naming the argument, MLAError for what the
library refuses, and nothing written by a refused prepare.
"""

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import TOL, World, absorbed_reference

SCALE = 0.0722
NUM_SM = 6  # split-schedule target of both the step and the plan
BS = 8


def _kv_extra(mode, ndt):
    return ndt if mode == "target_verify" else 0


def _batch(rng, w, mode, ndt, npad):
    """Request ids (live requests in random order, npad padding rows at random places) and
    seq_lens (padding rows 1); the long request 0 keeps its whole length so it is split."""
    live = [0] + list(1 + rng.permutation(len(w.reqs) - 1)[:BS - npad - 1])
    rows = np.array([w.reqs[i] for i in live] + [libmla.REQ_PAD] * npad, np.int32)
    rows = rows[rng.permutation(BS)]
    extra = _kv_extra(mode, ndt)
    seq = np.ones(BS, np.int32)
    for i, rid in enumerate(rows):
        if rid != libmla.REQ_PAD:
            n = w.rt.length(int(rid)) - extra
            seq[i] = n if rid == w.reqs[0] else rng.integers(max(n // 2, 1), n + 1)
    return rows, seq


def _q(rng, T, H, act):
    x = (rng.standard_normal((T, H, 576)) * 0.5).astype(np.float32)
    return ref.to_act(x, act), ref.round_act(x, act)


def _expected_block_table(w, rows, kv, width):
    """Page of each row's positions [jP, (j+1)P) from req_to_token (page 0 for padding)."""
    P = w.cache.page_size
    r2t = w.rt.req_to_token
    bt = np.full((len(rows), width), libmla.BLOCK_TABLE_PAD, np.int32)
    for i, (rid, n) in enumerate(zip(rows, kv)):
        for j in range((int(n) + P - 1) // P):
            bt[i, j] = 0 if rid == libmla.REQ_PAD else r2t[rid, j * P] // P
    return bt


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode,ndt", [("decode", 0), ("target_verify", 3), ("draft_extend", 2)])
def test_step_equals_plan_and_reference(ctx, rng, mode, ndt, page_size):
    H = 4
    # Request 0 longer than any part's share (at most ceil(total cost / parts) + overhead), so it is always cut.
    lens = [1200] + [int(n) for n in rng.integers(ndt + 2, 120, size=8)]
    w = World(ctx, rng, lens, page_size=page_size, max_reqs=12, max_context=1216)
    mc = w.rt.max_context
    step = libmla.Step(ctx, mode, batch_size=BS, num_heads=H, max_kv_len=mc, cache=w.cache,
                       num_draft_tokens=ndt, num_sm=NUM_SM, scale=SCALE)
    assert step.q_len == (1 if mode == "decode" else ndt) and step.page_size == page_size
    planner = libmla.Planner(ctx, max_bs=BS, max_q_tokens=BS * step.q_len, max_kv_tokens=BS * mc,
                             max_context=mc, page_size=page_size, num_sm=NUM_SM)
    # Fixed input arrays, rewritten in place every step (what a captured graph reads).
    ids, seq = np.zeros(BS, np.int32), np.zeros(BS, np.int32)
    # A strided req_to_token: rows of a wider array.
    wide = np.full((w.rt.max_reqs, mc + 24), -5, np.int32)
    causal = mode != "decode"
    extra = _kv_extra(mode, ndt)
    act = "f32"
    for rnd, npad in enumerate((0, 3, 5)):
        rows, lens_now = _batch(rng, w, mode, ndt, npad)
        ids[:], seq[:] = rows, lens_now
        wide[:, :mc] = w.rt.req_to_token
        r2t = w.rt if rnd == 0 else wide[:, :mc]  # a RequestTable, then a strided view
        step.prepare(w.cache, r2t, ids, seq)
        m = step.metadata()
        p = planner.build(w.rt, mode, ids, seq, num_draft_tokens=ndt, num_heads=H)
        what = "%s P=%d round %d" % (mode, page_size, rnd)
        assert (m.batch_size, m.q_len, m.num_sm_parts) == (BS, step.q_len, p.num_sm_parts), what
        assert m.block_table_width == (mc + page_size - 1) // page_size, what
        assert m.max_splits == BS + m.num_sm_parts, what
        kv = seq + extra
        np.testing.assert_array_equal(m.kv_lens, kv, what)
        np.testing.assert_array_equal(m.kv_lens, p.kv_lens, what)
        np.testing.assert_array_equal(m.qo_indptr, p.qo_indptr, what)
        np.testing.assert_array_equal(m.qo_indptr, np.arange(BS + 1) * step.q_len, what)
        np.testing.assert_array_equal(m.sched_meta, p.sched_meta, what)
        np.testing.assert_array_equal(m.num_splits, p.num_splits, what)
        bt = _expected_block_table(w, rows, kv, m.block_table_width)
        np.testing.assert_array_equal(m.block_table, bt, what)
        for i in range(BS):
            npg = (int(kv[i]) + page_size - 1) // page_size
            np.testing.assert_array_equal(m.block_table[i, :npg], p.block_table[i, :npg], what)
        if rnd == 0 and mode != "draft_extend":  # (2-query rows get fewer schedule parts)
            assert p.total_splits > BS, "the long request should be split (%s)" % what
        arrays = m.arrays()
        assert all(isinstance(v, np.ndarray) for v in arrays.values())

        # attention: step == plan path (bits), both against float64
        T = BS * step.q_len
        q_act, q = _q(rng, T, H, act)
        for layer in (0, 1):
            o_s, l_s = step.attention(w.cache, layer, q_act[..., :512], q_act[..., 512:],
                                      return_lse=True)
            o_p, l_p = libmla.attention_absorbed(ctx, w.cache, layer, p, q_act[..., :512],
                                                 q_act[..., 512:], scale=SCALE, return_lse=True)
            np.testing.assert_array_equal(o_s, o_p, what)
            np.testing.assert_array_equal(l_s, l_p, what)
            live = [i for i in range(BS) if rows[i] != libmla.REQ_PAD]
            qrows = np.concatenate([np.arange(i * step.q_len, (i + 1) * step.q_len) for i in live])
            o_ref, l_ref = absorbed_reference(w, layer, [int(rows[i]) for i in live],
                                              [step.q_len] * len(live), [int(kv[i]) for i in live],
                                              q[qrows, :, :512], q[qrows, :, 512:], SCALE, causal)
            ref.assert_close(o_s[qrows], o_ref, *TOL[act], what=what + " out")
            ref.assert_close(l_s[qrows], l_ref, 1e-4, 1e-5, what + " lse")
            pad_rows = [r for i in range(BS) if rows[i] == libmla.REQ_PAD
                        for r in range(i * step.q_len, (i + 1) * step.q_len)]
            assert np.isfinite(o_s[pad_rows]).all(), what  # padding rows read page 0 only


def test_step_bf16_strides_outputs(ctx, rng):
    """bf16 activations (numpy uint16 bits with dtype='bf16'), contiguous vs strided q,
    given outputs, base-2 lse and the Step's default scale vs an explicit one."""
    H, P = 16, 16
    w = World(ctx, rng, [90, 33, 150, 5], page_size=P, max_reqs=6, max_context=160)
    step = libmla.Step(ctx, "target_verify", batch_size=5, num_heads=H, max_kv_len=160,
                       page_size=P, num_draft_tokens=2, num_sm=4, scale=SCALE)
    ids = np.array([w.reqs[2], libmla.REQ_PAD, w.reqs[0], w.reqs[3], w.reqs[1]], np.int32)
    seq = np.array([148, 1, 80, 3, 31], np.int32)
    step.prepare(w.cache, w.rt.req_to_token, ids, seq)
    T = 5 * 2
    q_act, q = _q(rng, T, H, "bf16")
    qn, qr = np.ascontiguousarray(q_act[..., :512]), np.ascontiguousarray(q_act[..., 512:])
    out = np.empty((T, H, 512), np.uint16)
    lse = np.empty((T, H), np.float32)
    got = step.attention(w.cache, 1, qn, qr, out, lse, dtype="bf16")
    assert got[0] is out and got[1] is lse
    o_v, l_v = step.attention(w.cache, 1, q_act[..., :512], q_act[..., 512:], scale=SCALE,
                              return_lse=True, dtype="bf16")
    np.testing.assert_array_equal(o_v, out)
    np.testing.assert_array_equal(l_v, lse)
    _, l2 = step.attention(w.cache, 1, qn, qr, lse_base2=True, return_lse=True, dtype="bf16")
    np.testing.assert_allclose(l2, lse * ref.LOG2E, rtol=1e-5, atol=1e-5)
    p = libmla.plan(ctx, w.rt, "target_verify", ids, seq, num_draft_tokens=2, num_heads=H,
                    num_sm=4, max_context=160)
    o_p, l_p = libmla.attention_absorbed(ctx, w.cache, 1, p, qn, qr, scale=SCALE, return_lse=True,
                                         dtype="bf16")
    np.testing.assert_array_equal(o_p, out)
    np.testing.assert_array_equal(l_p, lse)
    live = [0, 2, 3, 4]
    qrows = np.array([r for i in live for r in (2 * i, 2 * i + 1)])
    o_ref, l_ref = absorbed_reference(w, 1, [int(ids[i]) for i in live], [2] * 4,
                                      [int(seq[i]) + 2 for i in live], q[qrows, :, :512],
                                      q[qrows, :, 512:], SCALE, True)
    ref.assert_close(ref.from_act(out, "bf16")[qrows], o_ref, *TOL["bf16"], what="bf16 verify")
    ref.assert_close(lse[qrows], l_ref, 1e-4, 1e-5, "bf16 verify lse")


class _FakeCudaArray:
    """Looks like device memory (__cuda_array_interface__); never dereferenced."""

    def __init__(self, shape, typestr="<i4"):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (0x1000, False), "version": 3, "strides": None}


def test_step_argument_checks(ctx, rng):
    H, P, mc = 2, 8, 64
    w = World(ctx, rng, [20, 9], page_size=P, max_reqs=4, max_context=mc)
    kw = dict(batch_size=3, num_heads=H, max_kv_len=mc, cache=w.cache, num_sm=2, scale=SCALE)
    # Descriptors the library refuses.
    for bad in (dict(mode="extend"), dict(mode="idle"), dict(num_heads=0),
                dict(num_heads=libmla.MAX_HEADS + 1), dict(batch_size=0), dict(max_kv_len=0),
                dict(mode="target_verify", num_draft_tokens=0),
                dict(mode="decode", num_draft_tokens=2), dict(num_sm=-1), dict(page_size=3)):
        args = dict(kw)
        args.update(bad)
        mode = args.pop("mode", "decode")
        with pytest.raises(libmla.MLAError) as e:
            libmla.Step(ctx, mode, **args)
        assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT, bad
        assert e.value.function == "mla_step_workspace_size"
    with pytest.raises(ValueError, match="mode"):
        libmla.Step(ctx, "sideways", **kw)
    with pytest.raises(ValueError, match="page_size"):
        libmla.Step(ctx, batch_size=3, num_heads=H, max_kv_len=mc)
    with pytest.raises(ValueError, match="'ctx'"):
        libmla.Step("cpu", batch_size=3, num_heads=H, max_kv_len=mc, page_size=P)
    step = libmla.Step(ctx, "decode", **kw)
    need = step.workspace_bytes
    with pytest.raises(ValueError, match="'workspace'.*bytes"):
        libmla.Step(ctx, workspace=np.empty(need - 1, np.uint8), **kw)
    ro = np.empty(need, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="'workspace'.*read-only"):
        libmla.Step(ctx, workspace=ro, **kw)
    with pytest.raises(ValueError, match="'workspace'.*on cuda"):
        libmla.Step(ctx, workspace=_FakeCudaArray((need,), "|u1"), **kw)
    with pytest.raises(ValueError, match="'workspace'.*contiguous"):
        libmla.Step(ctx, workspace=np.empty(2 * need, np.uint8)[::2], **kw)
    # A given workspace of another dtype is counted in bytes; the metadata views live in it.
    ws = np.zeros((need + 3) // 4, np.float32)
    s2 = libmla.Step(ctx, workspace=ws, **kw)
    assert s2.workspace is ws

    ids = np.array([w.reqs[1], libmla.REQ_PAD, w.reqs[0]], np.int32)
    seq = np.array([9, 1, 20], np.int32)
    r2t = w.rt.req_to_token
    step.prepare(w.cache, r2t, ids, seq)
    s2.prepare(w.cache, r2t, list(ids), [int(x) for x in seq])  # lists are converted
    np.testing.assert_array_equal(s2.metadata().block_table, step.metadata().block_table)
    good = np.array(step.workspace)
    bad_calls = [
        (dict(req_ids=ids.astype(np.float32)), "'req_ids'"),
        (dict(req_ids=ids[:2]), "'req_ids'.*length 2"),
        (dict(seq_lens=np.ones((3, 1), np.int32)), "'seq_lens'"),
        (dict(req_to_token=r2t.astype(np.int64)), "'req_to_token'.*dtype i64"),
        (dict(req_to_token=r2t[:, :mc - 1]), "'req_to_token'.*max_kv_len"),
        (dict(req_to_token=r2t[0]), "'req_to_token'.*shape"),
        (dict(req_to_token=np.asfortranarray(r2t)), "'req_to_token'.*contiguous"),
        (dict(req_to_token=_FakeCudaArray(r2t.shape)), "'req_to_token'.*on cuda"),
        (dict(cache=libmla.KVCache(ctx, 1, 8, 16, "bf16")), "'cache'.*page size 16"),
        (dict(cache="cache"), "'cache'"),
    ]
    for change, msg in bad_calls:
        a = dict(cache=w.cache, req_to_token=r2t, req_ids=ids, seq_lens=seq)
        a.update(change)
        with pytest.raises(ValueError, match=msg):
            step.prepare(a["cache"], a["req_to_token"], a["req_ids"], a["seq_lens"])
    # Out-of-range rows: the library's error, and the workspace as it was.
    for rid, n in ((4, 3), (-7, 3), (0, mc + 1), (0, -1)):
        bi, bs_ = ids.copy(), seq.copy()
        bi[0], bs_[0] = rid, n
        with pytest.raises(libmla.MLAError) as e:
            step.prepare(w.cache, r2t, bi, bs_)
        assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
        assert "row 0" in e.value.message
        np.testing.assert_array_equal(step.workspace, good)
    if P > 1:  # a slot that does not start a page
        bad_r2t = np.array(r2t)
        bad_r2t[w.reqs[0], 0] += 1
        with pytest.raises(libmla.MLAError) as e:
            step.prepare(w.cache, bad_r2t, ids, seq)
        assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
        np.testing.assert_array_equal(step.workspace, good)
    q = np.zeros((3, H, 576), np.float32)
    qn, qr = q[..., :512], q[..., 512:]
    att_bad = [
        (dict(q_nope=np.zeros((3, H + 1, 512), np.float32)), "'q_nope'.*shape"),
        (dict(q_nope=np.zeros((2, H, 512), np.float32)), "'q_nope'.*shape"),
        (dict(q_rope=np.zeros((3, H, 64), np.float16)), "'q_rope'.*dtype f16"),
        (dict(q_nope=np.zeros((3, H, 512), np.uint16)), "'q_nope'.*raw bf16"),
        (dict(q_nope=np.zeros((3, H, 512), np.float64)), "'q_nope'.*dtype f64"),
        (dict(q_nope=np.zeros((3, 512, H), np.float32).transpose(0, 2, 1)), "'q_nope'"),
        (dict(out=np.zeros((3, H, 512), np.float16)), "'out'.*dtype"),
        (dict(out=np.zeros((3, H, 64), np.float32)), "'out'.*shape"),
        (dict(lse=np.zeros((3, H), np.float64)), "'lse'.*dtype"),
        (dict(q_nope=_FakeCudaArray((3, H, 512), "<f4")), "'q_nope'.*on cuda"),
        (dict(cache=None), "'cache'"),
    ]
    for change, msg in att_bad:
        a = dict(cache=w.cache, q_nope=qn, q_rope=qr, out=None, lse=None)
        a.update(change)
        with pytest.raises(ValueError, match=msg):
            step.attention(a["cache"], 0, a["q_nope"], a["q_rope"], a["out"], a["lse"])
    ro_out = np.zeros((3, H, 512), np.float32)
    ro_out.flags.writeable = False
    with pytest.raises(ValueError, match="'out'.*read-only"):
        step.attention(w.cache, 0, qn, qr, ro_out)
    no_scale = libmla.Step(ctx, batch_size=3, num_heads=H, max_kv_len=mc, page_size=P)
    with pytest.raises(ValueError, match="'scale'"):
        no_scale.attention(w.cache, 0, qn, qr)
    with pytest.raises(libmla.MLAError) as e:
        step.attention(w.cache, 2, qn, qr)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
    o = step.attention(w.cache, 1, qn, qr)
    assert o.shape == (3, H, 512) and np.isfinite(o).all()


def test_step_draft_steps_equal_decode(ctx, rng):
    """Step(num_steps=N): one prepare builds N decode steps; step i equals a plain decode
    Step with seq_len + i + 1, metadata and output bit for bit."""
    H, N = 4, 3
    w = World(ctx, rng, [int(n) for n in rng.integers(N + 2, 200, size=6)], page_size=16, max_reqs=8,
              max_context=256)
    mc = w.rt.max_context
    ids = np.array(w.reqs + [libmla.REQ_PAD], np.int32)
    seq = np.array([w.rt.length(int(r)) - N for r in w.reqs] + [1], np.int32)
    draft = libmla.Step(ctx, "decode", batch_size=len(ids), num_heads=H, max_kv_len=mc, cache=w.cache,
                        num_sm=NUM_SM, scale=SCALE, num_steps=N)
    draft.prepare(w.cache, w.rt, ids, seq)
    q_act, _ = _q(rng, len(ids), H, "f32")
    for i in range(N):
        one = libmla.Step(ctx, "decode", batch_size=len(ids), num_heads=H, max_kv_len=mc, cache=w.cache,
                          num_sm=NUM_SM, scale=SCALE)
        one.prepare(w.cache, w.rt, ids, seq + i + 1)
        md, mo = draft.metadata(step=i), one.metadata()
        np.testing.assert_array_equal(md.kv_lens, mo.kv_lens)
        np.testing.assert_array_equal(md.block_table, mo.block_table)
        np.testing.assert_array_equal(md.sched_meta, mo.sched_meta)
        np.testing.assert_array_equal(md.num_splits, mo.num_splits)
        od = draft.attention(w.cache, 1, q_act[..., :512], q_act[..., 512:], step=i)
        oo = one.attention(w.cache, 1, q_act[..., :512], q_act[..., 512:])
        assert np.array_equal(od, oo), "draft step %d differs from the plain decode" % i
    with pytest.raises(ValueError, match="step"):
        draft.attention(w.cache, 0, q_act[..., :512], q_act[..., 512:], step=N)
    with pytest.raises(libmla.MLAError):  # draft steps are decode steps
        libmla.Step(ctx, "target_verify", batch_size=2, num_heads=H, max_kv_len=mc, page_size=16,
                    num_draft_tokens=2, num_steps=2)


@pytest.mark.parametrize("world_n", [2, 4])
def test_step_dcp_shards_merge_to_one_device(ctx, rng, world_n):
    """Decode context parallel on one CPU: rank caches (page size P / N) written with
    KVCache.write_shard-equivalent placement (slot mod N, slot / N), one Step per rank with
    dcp_world / dcp_rank, the ranks' (out, lse) merged: equals the single-cache step."""
    H, Pg = 4, 16
    lens = [1, world_n - 1 or 1, 90, 200, 17]
    w = World(ctx, rng, lens, page_size=Pg, num_layers=1, max_reqs=8, max_context=256, shuffle=False)
    mc = w.rt.max_context
    ranks = [libmla.KVCache(ctx, 1, w.cache.num_pages, Pg // world_n, "bf16") for _ in range(world_n)]
    r2t = w.rt.req_to_token
    for rid, n in zip(w.reqs, lens):
        slots = np.ascontiguousarray(r2t[rid, :n])
        c, r = w.cache.read(0, slots)
        for k in range(world_n):
            mine = slots % world_n == k
            if mine.any():
                ranks[k].write(0, np.ascontiguousarray(slots[mine] // world_n), np.ascontiguousarray(c[mine]),
                               np.ascontiguousarray(r[mine]))
    ids = np.array(w.reqs, np.int32)
    seq = np.array(lens, np.int32)
    q_act, _ = _q(rng, len(ids), H, "f32")
    one = libmla.Step(ctx, "decode", batch_size=len(ids), num_heads=H, max_kv_len=mc, cache=w.cache,
                      num_sm=NUM_SM, scale=SCALE)
    one.prepare(w.cache, w.rt, ids, seq)
    o_ref, l_ref = one.attention(w.cache, 0, q_act[..., :512], q_act[..., 512:], return_lse=True)
    outs, lses = [], []
    for k in range(world_n):
        st = libmla.Step(ctx, "decode", batch_size=len(ids), num_heads=H, max_kv_len=mc, cache=ranks[k],
                         num_sm=NUM_SM, scale=SCALE, dcp_world=world_n, dcp_rank=k)
        st.prepare(ranks[k], w.rt, ids, seq)
        kv = st.metadata().kv_lens
        np.testing.assert_array_equal(kv, [(n - k + world_n - 1) // world_n if n > k else 0 for n in lens])
        o, l = st.attention(ranks[k], 0, q_act[..., :512], q_act[..., 512:], return_lse=True)
        outs.append(o)
        lses.append(l)
    o_m, l_m = libmla.merge_states(ctx, outs, lses)
    np.testing.assert_allclose(o_m, o_ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(l_m, l_ref, rtol=0, atol=2e-5)


def test_step_extend_bucket_equals_reference(ctx, rng):
    """An "extend" step (the paged absorbed prefill a graph can capture): rows with extend
    lens under a token bucket; qo_indptr is their running sum, the attention matches the
    float64 reference on the real rows, rows past the total stay untouched, and the
    argument checks name extend_lens."""
    H, BUCKET = 3, 200
    lens = [int(n) for n in rng.integers(40, 300, size=7)]
    w = World(ctx, rng, lens, page_size=16, max_reqs=10, max_context=320)
    mc = w.rt.max_context
    step = libmla.Step(ctx, "extend", batch_size=BS, num_heads=H, max_kv_len=mc, cache=w.cache,
                       num_tokens=BUCKET, num_sm=NUM_SM, scale=SCALE)
    assert step.num_q_tokens == BUCKET and step.q_len == BUCKET
    ids, seq, ext = np.zeros(BS, np.int32), np.zeros(BS, np.int32), np.zeros(BS, np.int32)
    for rnd in range(3):
        live = list(rng.permutation(len(w.reqs))[:BS - 1])
        rows = [w.reqs[i] for i in live] + [libmla.REQ_PAD]
        for i, rid in enumerate(rows):
            seq[i] = 1 if rid == libmla.REQ_PAD else w.rt.length(int(rid))
            ext[i] = 0 if rid == libmla.REQ_PAD else rng.integers(0, min(int(seq[i]), 25) + 1)
        ids[:] = rows
        step.prepare(w.cache, w.rt, ids, seq, extend_lens=ext)
        m = step.metadata()
        np.testing.assert_array_equal(m.qo_indptr, np.concatenate([[0], np.cumsum(ext)]))
        np.testing.assert_array_equal(m.kv_lens, seq)
        total = int(ext.sum())
        q_act, q = _q(rng, BUCKET, H, "f32")
        out = np.full((BUCKET, H, 512), 7.0, np.float32)
        o, lse = step.attention(w.cache, 0, q_act[..., :512], q_act[..., 512:], out=out,
                                return_lse=True)
        assert (out[total:] == 7.0).all(), "rows past the extend total were written"
        keep = [i for i in range(BS) if rows[i] != libmla.REQ_PAD]
        qrows = np.concatenate([np.arange(m.qo_indptr[i], m.qo_indptr[i + 1]) for i in keep])
        o_ref, l_ref = absorbed_reference(w, 0, [int(rows[i]) for i in keep],
                                          [int(ext[i]) for i in keep], [int(seq[i]) for i in keep],
                                          q[qrows, :, :512], q[qrows, :, 512:], SCALE, True)
        ref.assert_close(o[qrows], o_ref, *TOL["f32"], what="extend step round %d" % rnd)
        ref.assert_close(lse[qrows], l_ref, 1e-4, 1e-5, "extend step lse round %d" % rnd)
    with pytest.raises(ValueError, match="extend_lens"):
        step.prepare(w.cache, w.rt, ids, seq)
    big = seq.copy()
    big[-1] = 0
    with pytest.raises(libmla.MLAError):  # the lens add up to more than the bucket
        step.prepare(w.cache, w.rt, ids, seq, extend_lens=big)
    dec = libmla.Step(ctx, "decode", batch_size=BS, num_heads=H, max_kv_len=mc, cache=w.cache)
    with pytest.raises(ValueError, match="extend_lens"):
        dec.prepare(w.cache, w.rt, ids, seq, extend_lens=ext)
