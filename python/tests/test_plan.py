"""Plans through the binding: the arrays as numpy views, checked against req_to_token."""

import numpy as np
import pytest

import libmla
from helpers import World


def _expect(world, rids, q_lens, kv_lens):
    rt = world.rt.req_to_token
    P = world.cache.page_size
    kv_indices = np.concatenate([rt[r, :k] for r, k in zip(rids, kv_lens)])
    width = max((k + P - 1) // P for k in kv_lens)
    bt = np.full((len(rids), width), libmla.BLOCK_TABLE_PAD, np.int32)
    pages = []
    for i, (r, k) in enumerate(zip(rids, kv_lens)):
        n = (k + P - 1) // P
        bt[i, :n] = rt[r, np.arange(n) * P] // P
        pages += list(bt[i, :n])
    return dict(qo_indptr=np.concatenate([[0], np.cumsum(q_lens)]),
                kv_indptr=np.concatenate([[0], np.cumsum(kv_lens)]), kv_lens=np.array(kv_lens),
                kv_indices=kv_indices, block_table=bt, page_indices=np.array(pages),
                page_indptr=np.concatenate([[0], np.cumsum([(k + P - 1) // P for k in kv_lens])]))


def _check(p, exp, rids):
    np.testing.assert_array_equal(p.req_ids, rids)
    for k, v in exp.items():
        np.testing.assert_array_equal(getattr(p, k), v, err_msg=k)
    assert p.num_splits[-1] == p.total_splits and p.total_splits >= p.batch_size
    assert p.sched_meta.shape == (p.num_sm_parts, 8)
    # Every request's keys are covered by the split schedule (parts in order, no gaps).
    sm = p.sched_meta
    nonempty = sm[sm[:, libmla.Sched.NUM_REQS] > 0]
    assert nonempty[0, libmla.Sched.BEGIN_REQ] == 0 and nonempty[0, libmla.Sched.BEGIN_TOK] == 0
    assert nonempty[-1, libmla.Sched.END_REQ] == p.batch_size - 1
    assert nonempty[-1, libmla.Sched.END_TOK] == p.kv_lens[-1]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_modes(ctx, rng, page_size):
    w = World(ctx, rng, [40, 7, 130], page_size=page_size, num_layers=1)
    rids = w.reqs
    pl = libmla.Planner(ctx, max_bs=8, max_q_tokens=512, max_kv_tokens=2048, max_context=256,
                        page_size=page_size, num_sm=4)
    assert pl.workspace_bytes > 0
    # DECODE: seq_lens include this token.
    p = pl.build(w.rt, "decode", rids, [40, 7, 130], num_heads=16)
    assert (p.mode, p.batch_size, p.num_q_tokens, p.causal) == (libmla.Mode.DECODE, 3, 3, False)
    _check(p, _expect(w, rids, [1, 1, 1], [40, 7, 130]), rids)
    # TARGET_VERIFY: keys = seq_lens + ndt, causal.
    p = pl.build(w.rt, libmla.Mode.TARGET_VERIFY, rids, [37, 4, 127], num_draft_tokens=3,
                 num_heads=16)
    assert p.causal and p.num_q_tokens == 9 and p.max_q_len == 3
    _check(p, _expect(w, rids, [3, 3, 3], [40, 7, 130]), rids)
    # DRAFT_EXTEND varlen and fixed window.
    p = pl.build(w.rt, "draft_extend", rids, [40, 7, 130], extend_lens=[2, 1, 4], num_heads=16)
    _check(p, _expect(w, rids, [2, 1, 4], [40, 7, 130]), rids)
    p = pl.build(w.rt, "draft_extend", rids, [40, 7, 130], num_draft_tokens=2, num_heads=16)
    _check(p, _expect(w, rids, [2, 2, 2], [40, 7, 130]), rids)
    # EXTEND with and without prefix.
    p = pl.build(w.rt, "extend", rids, [40, 7, 130], prefix_lens=[30, 0, 100], num_heads=16)
    _check(p, _expect(w, rids, [10, 7, 30], [40, 7, 130]), rids)
    p = pl.build(w.rt, "extend", rids[:2], [20, 7], num_heads=16)
    _check(p, _expect(w, rids[:2], [20, 7], [20, 7]), rids[:2])
    # IDLE needs no table.
    p = pl.build(None, "idle", num_heads=16)
    assert p.batch_size == 0 and p.num_q_tokens == 0 and list(p.qo_indptr) == [0]


def test_padding_rows_and_stale_plans(ctx, rng):
    w = World(ctx, rng, [20, 9], page_size=4, num_layers=1)
    pl = libmla.Planner(ctx, max_bs=4, max_q_tokens=8, max_kv_tokens=256, max_context=64,
                        page_size=4, num_sm=2)
    rids = [w.reqs[0], libmla.REQ_PAD, w.reqs[1], libmla.REQ_PAD]
    p = pl.build(w.rt, "decode", rids, [20, 1, 9, 1], num_heads=4)
    ki = p.kv_indices
    ip = p.kv_indptr
    assert list(ki[ip[1]:ip[2]]) == [0] and list(ki[ip[3]:ip[4]]) == [0]
    np.testing.assert_array_equal(ki[ip[2]:ip[3]], w.rt.req_to_token[w.reqs[1], :9])
    assert p.block_table[1, 0] == 0 and np.all(p.block_table[1, 1:] == libmla.BLOCK_TABLE_PAD)
    views = p.kv_indices
    assert p.valid and not views.flags.writeable
    p2 = pl.build(w.rt, "decode", [w.reqs[1]], [9], num_heads=4)
    assert p2.valid and not p.valid and "STALE" in repr(p)
    with pytest.raises(ValueError, match="stale plan"):
        p.kv_indices
    q = np.zeros((4, 4, 576), np.float32)
    with pytest.raises(ValueError, match="stale plan"):
        libmla.attention_absorbed(ctx, w.cache, 0, p, q[..., :512], q[..., 512:], scale=0.1)
    # Library errors carry the table's / planner's message.
    with pytest.raises(libmla.MLAError) as e:
        pl.build(w.rt, "decode", [w.reqs[0]] * 5, [20] * 5, num_heads=4)
    assert e.value.status == libmla.Status.ERR_CAPACITY and "max_bs" in e.value.message
    with pytest.raises(libmla.MLAError) as e:
        pl.build(w.rt, "decode", [w.reqs[0]], [21], num_heads=4)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "req_ids[0]" in e.value.message
    with pytest.raises(libmla.MLAError) as e:
        pl.build(w.rt, "decode", [6], [1], num_heads=4)
    assert e.value.status == libmla.Status.ERR_BAD_STATE
    with pytest.raises(ValueError, match="'seq_lens'"):
        pl.build(w.rt, "decode", [0, 1], [3], num_heads=4)
    with pytest.raises(ValueError, match="mode"):
        pl.build(w.rt, "sideways", [0], [3], num_heads=4)
    # One-off plan with fitted limits.
    p3 = libmla.plan(ctx, w.rt, "target_verify", [w.reqs[0]], [17], num_draft_tokens=3,
                     num_heads=4)
    assert p3.num_q_tokens == 3 and p3.num_kv_tokens == 20


def test_chunk_plan(ctx, rng):
    w = World(ctx, rng, [50, 13, 31], page_size=8, num_layers=1)
    cp_ = libmla.ChunkPlanner(ctx, max_bs=4, max_prefix_tokens=200, chunk_capacity=30)
    pre = [50, 13, 31]
    cp = cp_.build(w.rt, w.reqs, pre)
    L = max(1, 30 // 3)
    assert cp.chunk_len == L and cp.num_chunks == -(-50 // L) and cp.batch_size == 3
    rt = w.rt.req_to_token
    for c in range(cp.num_chunks):
        lens = [max(0, min((c + 1) * L, p) - c * L) for p in pre]
        np.testing.assert_array_equal(cp.lens[c], lens)
        # An exhausted request's (empty) chunk starts at its prefix end.
        np.testing.assert_array_equal(cp.starts[c], [min(c * L, p) for p in pre])
        np.testing.assert_array_equal(cp.cu_seq_lens[c], np.concatenate([[0], np.cumsum(lens)]))
        assert cp.max_lens[c] == max(lens)
        exp = np.concatenate([rt[r, c * L:c * L + n] for r, n in zip(w.reqs, lens)])
        np.testing.assert_array_equal(cp.chunk_slots(c), exp)


def test_draft_and_dcp_plans(ctx, rng):
    w = World(ctx, rng, [12, 30], page_size=4, num_layers=1)
    seq = [9, 26]  # committed lengths; the requests hold 3 / 4 draft positions beyond
    dp = libmla.DraftPlanner(ctx, max_bs=4, num_steps=3, max_context=64).build(w.rt, w.reqs, seq)
    rt = w.rt.req_to_token
    assert dp.num_steps == 3 and dp.kv_indptr.shape == (3, 3)
    for i in range(3):
        ip, ix = dp.step(i)
        lens = [s + i + 1 for s in seq]
        np.testing.assert_array_equal(ip, np.concatenate([[0], np.cumsum(lens)]))
        np.testing.assert_array_equal(ix, np.concatenate([rt[r, :k] for r, k in zip(w.reqs, lens)]))
    with pytest.raises(libmla.MLAError) as e:
        libmla.DraftPlanner(ctx, max_bs=4, num_steps=4, max_context=64).build(w.rt, w.reqs, seq)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
    p = libmla.plan(ctx, w.rt, "decode", w.reqs, [12, 30], num_heads=2)
    for world in (1, 2, 3):
        for rank in range(world):
            d = libmla.dcp_plan(ctx, p, rank, world)
            lens = [len([q for q in range(k) if q % world == rank]) for k in (12, 30)]
            np.testing.assert_array_equal(d.kv_lens, lens)
            exp = np.concatenate([rt[r, [q for q in range(k) if q % world == rank]] // world
                                  for r, k in zip(w.reqs, (12, 30))])
            np.testing.assert_array_equal(d.kv_indices, exp)
    with pytest.raises(libmla.MLAError) as e:
        libmla.dcp_plan(ctx, p, 2, 2)
    assert "rank" in e.value.message
