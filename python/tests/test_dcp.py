"""EXTEND under decode context parallel through the binding, on the CPU: N shards in one
process (KVCache.write_shard), each rank's rows packed into its block of a gathered cache
(KVCache.pack_rows, the local slots of its DcpPlan), and an "extend" Step over the gathered
cache with dcp_gather_table's table equals the same Step over one cache holding every key."""
import numpy as np
import pytest

import libmla

SCALE = 0.0721687836


@pytest.mark.parametrize("world,page,dtype", [(2, 16, "bf16"), (4, 8, "fp8"), (2, 4, "fp8_block")])
def test_dcp_extend_pooled_equals_single(ctx, rng, world, page, dtype):
    H, MC = 4, 400
    prefix = [0, 1, 150, 37, world - 1]
    ext = [5, 1, 40, 3, 2]
    seq = [p + e for p, e in zip(prefix, ext)]
    bs = len(seq)
    pages = 4 + sum(-(-k // page) + 1 for k in seq)
    scales = [0.375] if dtype == "fp8" else None
    whole = libmla.KVCache(ctx, 1, pages, page, dtype, fp8_scales=scales)
    shards = [libmla.KVCache(ctx, 1, pages, page // world, dtype, fp8_scales=scales) for _ in range(world)]
    rt = libmla.RequestTable(ctx, bs + 1, MC, num_pages=pages, page_size=page)
    ids = []
    for k in seq:
        rid = rt.add()
        slots = np.asarray(rt.extend(rid, k), np.int32)
        c = rng.standard_normal((k, 512)).astype(np.float32)
        r = rng.standard_normal((k, 64)).astype(np.float32)
        whole.write(0, slots, c, r)
        for rank, sh in enumerate(shards):
            sh.write_shard(0, slots, c, r, world, rank)
        ids.append(rid)
    r2t = rt.req_to_token
    # each rank's local slots (its DCP plan over the global keys), packed into its block
    kv_indptr = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
    kv_indices = np.concatenate([r2t[i, :k] for i, k in zip(ids, seq)]).astype(np.int32)
    table, m = libmla.dcp_gather_table(ctx, seq, world, table_stride=MC)
    assert table.shape == (bs, MC)
    assert m == sum(-(-k // world) for k in seq)  # rank 0's share: ceil(k / N) each
    gathered = libmla.KVCache(ctx, 1, 1 + world * m, 1, dtype, fp8_scales=scales)
    planner = libmla.DcpPlanner(ctx, max_bs=bs, max_kv_tokens=int(kv_indptr[-1]))
    for rank, sh in enumerate(shards):
        p = planner.build(seq, kv_indptr, kv_indices, rank, world)
        sh.pack_rows(0, p.kv_indices, gathered, 0, 1 + rank * m)
    # the gathered rows are the single cache's rows of the same positions, byte for byte
    gv, wv = gathered.layer_view(0), whole.layer_view(0)
    for i, (rid, k) in enumerate(zip(ids, seq)):
        np.testing.assert_array_equal(gv[table[i, :k]], wv[r2t[rid, :k]])
        assert (table[i, k:] == libmla.SLOT_UNUSED).all()
    # the EXTEND over both
    total = sum(ext)
    q = rng.standard_normal((total, H, 576)).astype(np.float32)
    outs = []
    for cache, req_to_token, rows, pg in ((whole, r2t, ids, page), (gathered, table, list(range(bs)), 1)):
        step = libmla.Step(ctx, "extend", batch_size=bs, num_heads=H, max_kv_len=MC, cache=cache,
                           num_tokens=total, scale=SCALE)
        step.prepare(cache, req_to_token, np.asarray(rows, np.int32), np.asarray(seq, np.int32),
                     extend_lens=np.asarray(ext, np.int32))
        outs.append(step.attention(cache, 0, q[..., :512], q[..., 512:], return_lse=True))
    (o1, l1), (o2, l2) = outs
    assert np.isfinite(o1).all()
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


def test_dcp_gather_refusals(ctx):
    with pytest.raises(libmla.MLAError, match="world"):
        libmla.dcp_gather_table(ctx, [3, 4], 0)
    with pytest.raises(libmla.MLAError, match="table_stride"):
        libmla.dcp_gather_table(ctx, [3, 40], 2, table_stride=8)
    a = libmla.KVCache(ctx, 1, 8, 4, "bf16")
    b = libmla.KVCache(ctx, 1, 8, 4, "fp8")
    with pytest.raises(libmla.MLAError, match="bf16 rows"):
        a.pack_rows(0, [4, 5], b, 0, 4)
    with pytest.raises(libmla.MLAError, match="page 0"):
        a.pack_rows(0, [4, 5], libmla.KVCache(ctx, 1, 8, 4, "bf16"), 0, 2)
    with pytest.raises(libmla.MLAError, match="world"):
        a.write_shard(0, [4], np.zeros((1, 512), np.float32), np.zeros((1, 64), np.float32), 3, 0)
