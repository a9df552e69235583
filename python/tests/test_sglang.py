"""SglangMLABackend: sglang-shaped calls over plain numpy tensors, against the reference."""

import os
import subprocess
import sys

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import TOL

SCALE = 0.0722
H = 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Layer:
    """The two attributes of sglang's RadixAttention the backend reads."""

    def __init__(self, layer_id):
        self.layer_id, self.scaling = layer_id, SCALE


def _backend(ctx, **kw):
    args = dict(num_heads=H, num_layers=2, num_pages=48, page_size=16, scale=SCALE, max_reqs=8,
                max_context_len=160, dtype="f32", kv_cache_dtype="bf16", max_bs=4,
                max_num_tokens=128, num_draft_tokens=3, ctx=ctx)
    args.update(kw)
    return libmla.SglangMLABackend(**args)


class Model:
    """Random activations plus a float64 mirror of the cache (per layer and slot)."""

    def __init__(self, be, rng):
        self.be, self.rng, self.c, self.r = be, rng, {}, {}

    def latent(self, layer, slots):
        n = len(slots)
        kv = self.rng.standard_normal((n, 576)).astype(np.float32)  # sglang's [T, 576] k
        sc, sr = ref.stored(kv[:, :512], kv[:, 512:], "bf16")
        for i, s in enumerate(slots):
            self.c[(layer, int(s))], self.r[(layer, int(s))] = sc[i], sr[i]
        return kv

    def follow_fork(self, src, dst, n):
        """Copy-on-write gave dst fresh slots for some shared positions: mirror them."""
        for layer in range(2):
            for p in range(n):
                a, b = int(self.be.req_to_token[src, p]), int(self.be.req_to_token[dst, p])
                if (layer, a) in self.c:
                    self.c[(layer, b)], self.r[(layer, b)] = self.c[(layer, a)], self.r[(layer, a)]

    def ref_absorbed(self, layer, q, rids, q_lens, kv_lens, causal):
        qv = q.reshape(-1, H, 576).astype(np.float64)
        out, lses, t = [], [], 0
        for rid, ql, kl in zip(rids, q_lens, kv_lens):
            slots = self.be.req_to_token[rid, :kl]
            c = np.array([self.c[(layer, int(s))] for s in slots])
            r = np.array([self.r[(layer, int(s))] for s in slots])
            o, lse = ref.absorbed(qv[t:t + ql, :, :512], qv[t:t + ql, :, 512:], c, r, SCALE, causal)
            out.append(o)
            lses.append(lse)
            t += ql
        return np.concatenate(out).reshape(t, H * 512), np.concatenate(lses)


def test_decode_verify_draft_extend(ctx, rng):
    be = _backend(ctx)
    m = Model(be, rng)
    a, b = be.alloc_req(), be.alloc_req()
    # Prefill through the MHA path: q/k/v from the "model", latent rows stored alongside.
    seq = [30, 11]
    loc = np.concatenate([be.extend_req(a, 30), be.extend_req(b, 11)])
    fb = libmla.ForwardBatch(libmla.ForwardMode.EXTEND, [a, b], seq, out_cache_loc=loc,
                             extend_prefix_lens=[0, 0], extend_seq_lens=seq)
    md = be.init_forward_metadata(fb)
    assert md.uses_mha and be.forward_metadata is md
    T = 41
    for lid in range(2):
        kv = m.latent(lid, loc)
        q = rng.standard_normal((T, H * 192)).astype(np.float32)
        k = rng.standard_normal((T, H, 192)).astype(np.float32)
        v = rng.standard_normal((T, H, 128)).astype(np.float32)
        o = be.forward_extend(q, k, v, Layer(lid), fb, latent=kv)
        o_ref, _ = ref.ragged(q.reshape(T, H, 192).astype(np.float64), k.astype(np.float64),
                              v.astype(np.float64), [0, 30, 41], [0, 30, 41], SCALE, True)
        assert o.shape == (T, H * 128)
        ref.assert_close(o, o_ref.reshape(T, -1), *TOL["f32"], what="prefill")
    # Decode: q as sglang's [bs, H * 576] (strided path) and as q_nope + q_rope (one C call).
    loc = np.concatenate([be.extend_req(a, 1), be.extend_req(b, 1)])
    fb = libmla.ForwardBatch(libmla.ForwardMode.DECODE, [a, b], [31, 12], out_cache_loc=loc)
    be.init_forward_metadata(fb)
    for lid in range(2):
        kv = m.latent(lid, loc)
        q = rng.standard_normal((2, H * 576)).astype(np.float32)
        o1, lse1 = be.forward_decode(q, kv, None, Layer(lid), fb, return_lse=True)
        q3 = q.reshape(2, H, 576)
        o2 = be.forward_decode(np.ascontiguousarray(q3[..., :512]), kv[:, :512], None, lid, fb,
                               q_rope=np.ascontiguousarray(q3[..., 512:]), k_rope=kv[:, 512:])
        np.testing.assert_array_equal(o1, o2)
        o_ref, lse_ref = m.ref_absorbed(lid, q, [a, b], [1, 1], [31, 12], False)
        ref.assert_close(o1, o_ref, *TOL["f32"], what="decode")
        ref.assert_close(lse1, lse_ref, 1e-4, 1e-5, "decode lse")
    # Target verify with 3 draft tokens (seq_lens exclude them), via forward_extend.
    loc = np.concatenate([be.extend_req(a, 3), be.extend_req(b, 3)])

    class Spec:
        draft_token_num = 3

    fb = libmla.ForwardBatch("TARGET_VERIFY", [a, b], [31, 12], out_cache_loc=loc, spec_info=Spec())
    md = be.init_forward_metadata(fb)
    assert md.plan.num_q_tokens == 6 and not md.uses_mha
    kv = m.latent(0, loc)
    q = rng.standard_normal((6, H * 576)).astype(np.float32)
    o = be.forward_extend(q, kv, None, Layer(0), fb)
    o_ref, _ = m.ref_absorbed(0, q, [a, b], [3, 3], [34, 15], True)
    ref.assert_close(o, o_ref, *TOL["f32"], what="verify")
    # Accept 1 draft of a, 2 of b; then draft extend (sglang's DRAFT_EXTEND_V2 name) over them.
    be.truncate_req(a, 32)
    be.truncate_req(b, 14)

    class SglMode:  # an sglang ForwardMode member, matched by name
        name = "DRAFT_EXTEND_V2"

    fb = libmla.ForwardBatch(SglMode(), [a, b], [32, 14], extend_seq_lens=[1, 2], out_cache_loc=[])
    be.init_forward_metadata(fb)
    q = rng.standard_normal((3, H * 576)).astype(np.float32)
    o = be.forward_extend(q, None, None, Layer(0), fb, save_kv_cache=False)
    o_ref, _ = m.ref_absorbed(0, q, [a, b], [1, 2], [32, 14], True)
    ref.assert_close(o, o_ref, *TOL["f32"], what="draft extend")


def test_chunked_prefix_extend(ctx, rng):
    be = _backend(ctx, extend_impl="mha_chunked", chunk_capacity=8)
    m = Model(be, rng)
    a = be.alloc_req()
    loc = be.extend_req(a, 20)
    for lid in range(2):
        be.set_kv_buffer(Layer(lid), loc, m.latent(lid, loc))  # the model stores latent itself
    b = be.fork_req(a, 20)
    loc = be.extend_req(b, 5)
    assert be.req_to_token[b, 16] != be.req_to_token[a, 16]  # the shared last page was copied
    m.follow_fork(a, b, 20)
    fb = libmla.ForwardBatch(libmla.ForwardMode.EXTEND, [b], [25], out_cache_loc=loc,
                             extend_prefix_lens=[20], extend_seq_lens=[5])
    assert be.init_forward_metadata(fb).uses_mha
    kv = m.latent(1, loc)
    wkv = (rng.standard_normal((H, 256, 512)) * 0.04).astype(np.float32)
    q = rng.standard_normal((5, H, 128)).astype(np.float32)
    q_rope = rng.standard_normal((5, H, 64)).astype(np.float32)
    k = rng.standard_normal((5, H, 128)).astype(np.float32)
    k_rope = rng.standard_normal((5, 1, 64)).astype(np.float32)  # shared by the heads
    v = rng.standard_normal((5, H, 128)).astype(np.float32)
    o = be.forward_extend(q, k, v, Layer(1), fb, q_rope=q_rope, k_rope=k_rope, latent=kv,
                          kv_b_proj=wkv)
    slots = be.req_to_token[b, :20]
    c = np.array([m.c[(1, int(s))] for s in slots])
    r = np.array([m.r[(1, int(s))] for s in slots])
    w = wkv.astype(np.float64)
    kp = np.concatenate([np.einsum("tl,hnl->thn", c, w[:, :128]),
                         np.broadcast_to(r[:, None], (20, H, 64))], -1)
    vp = np.einsum("tl,hnl->thn", c, w[:, 128:])
    kk = np.concatenate([kp, np.concatenate([k, np.broadcast_to(k_rope, (5, H, 64))], -1)])
    vv = np.concatenate([vp, v])
    o_ref, _ = ref.attend(np.concatenate([q, q_rope], -1).astype(np.float64), kk, vv, SCALE, True)
    ref.assert_close(o, o_ref.reshape(5, -1), *TOL["f32"], what="chunked prefix")


def test_cuda_graph_metadata_with_padding(ctx, rng):
    be = _backend(ctx)
    m = Model(be, rng)
    reqs = [be.alloc_req() for _ in range(2)]
    for rid, n in zip(reqs, (17, 40)):
        loc = be.extend_req(rid, n)
        for lid in range(2):
            be.set_kv_buffer(lid, loc, m.latent(lid, loc))
    with pytest.raises(ValueError, match="init_cuda_graph_state"):
        be.init_forward_metadata_capture_cuda_graph(4, 4, None, None)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    md = be.init_forward_metadata_capture_cuda_graph(4, 4, np.zeros(4, np.int32),
                                                     np.ones(4, np.int32),
                                                     forward_mode=libmla.ForwardMode.DECODE)
    assert md.plan.batch_size == 4 and md.padded_rows == 4
    q = rng.standard_normal((4, H * 576)).astype(np.float32)
    be.forward_decode(q, None, None, 0, None, save_kv_cache=False)  # the "captured" call
    # Replay with 2 real rows (sglang pads req_pool_indices / seq_lens to the graph size).
    loc = np.array([be.extend_req(rid, 1)[0] for rid in reqs], np.int32)
    seq = np.array([18, 41, 1, 1], np.int32)
    md = be.init_forward_metadata_replay_cuda_graph(4, np.array(reqs + [0, 0], np.int32), seq,
                                                    seq_lens_cpu=seq, num_real=2)
    assert md.padded_rows == 2 and md.plan.num_q_tokens == 4
    kv = np.concatenate([m.latent(0, loc), np.zeros((2, 576), np.float32)])
    fb = libmla.ForwardBatch("decode", reqs, [18, 41], out_cache_loc=np.concatenate([loc, [0, 0]]))
    o = be.forward_decode(q, kv, None, 0, fb)
    o_ref, _ = m.ref_absorbed(0, q[:2], reqs, [1, 1], [18, 41], False)
    ref.assert_close(o[:2], o_ref, *TOL["f32"], what="graph replay real rows")
    # Same rows without padding give the same bits.
    be.init_forward_metadata(forward_mode="decode", req_pool_indices=reqs, seq_lens=[18, 41])
    fb2 = libmla.ForwardBatch("decode", reqs, [18, 41], out_cache_loc=loc)
    o2 = be.forward_decode(q[:2], kv[:2], None, 0, fb2)
    np.testing.assert_array_equal(o2, o[:2])
    with pytest.raises(ValueError, match="max_bs"):
        be.init_forward_metadata_replay_cuda_graph(5, reqs, [18, 41])
    # Target verify graphs: 3 drafts per row, one real row and one padding row.
    loc = be.extend_req(reqs[1], 3)

    class Spec:
        draft_token_num = 3

    md = be.init_forward_metadata_capture_cuda_graph(2, 6, None, None, forward_mode="TARGET_VERIFY",
                                                     spec_info=Spec())
    assert md.plan.num_q_tokens == 6 and list(md.plan.kv_lens) == [4, 4]
    md = be.init_forward_metadata_replay_cuda_graph(2, [reqs[1]], [41], forward_mode="TARGET_VERIFY",
                                                    spec_info=Spec())
    assert list(md.plan.kv_lens) == [44, 4] and md.padded_rows == 1
    kv = m.latent(0, loc)
    q = rng.standard_normal((6, H * 576)).astype(np.float32)
    fb = libmla.ForwardBatch("target_verify", [reqs[1]], [41],
                             out_cache_loc=np.concatenate([loc, [0, 0, 0]]))
    o = be.forward_extend(q, np.concatenate([kv, np.zeros((3, 576), np.float32)]), None, 0, fb)
    o_ref, _ = m.ref_absorbed(0, q[:3], [reqs[1]], [3], [44], True)
    ref.assert_close(o[:3], o_ref, *TOL["f32"], what="verify graph replay")


def test_multi_step_draft(ctx, rng):
    be = _backend(ctx)
    m = Model(be, rng)
    reqs = [be.alloc_req() for _ in range(3)]
    seq = [9, 33, 16]
    for rid, n in zip(reqs, seq):
        loc = be.extend_req(rid, n)
        be.set_kv_buffer(0, loc, m.latent(0, loc))
    steps = 3
    for rid in reqs:  # room for every draft token, allocated up front as sglang does
        be.extend_req(rid, steps)
    draft = libmla.SglangMLAMultiStepDraftBackend(be, speculative_num_steps=steps)
    draft.init_forward_metadata(libmla.ForwardBatch("decode", reqs, seq))
    for i, step in enumerate(draft.attn_backends):
        kv_lens = [s + i + 1 for s in seq]
        ip, ix = draft.draft_plan.step(i)  # the one-call draft plan agrees with the step plans
        np.testing.assert_array_equal(ip, step.forward_metadata.plan.kv_indptr)
        np.testing.assert_array_equal(ix, step.forward_metadata.plan.kv_indices)
        loc = draft.step_slots(i)
        np.testing.assert_array_equal(loc, [be.req_to_token[r, s + i] for r, s in zip(reqs, seq)])
        kv = m.latent(0, loc)
        q = rng.standard_normal((3, H * 576)).astype(np.float32)
        o = step.forward_decode(q, kv, None, Layer(0))
        o_ref, _ = m.ref_absorbed(0, q, reqs, [1, 1, 1], kv_lens, False)
        ref.assert_close(o, o_ref, *TOL["f32"], what="draft step %d" % i)
    # Graph-style replay with one padding row.
    draft.init_cuda_graph_state(4, 4)
    draft.init_forward_metadata_capture_cuda_graph(bs=4)
    draft.init_forward_metadata_replay_cuda_graph(bs=4, req_pool_indices=reqs, seq_lens=seq)
    p = draft.attn_backends[1].forward_metadata.plan
    # a padding row (seq_len 1) reads i + 2 keys of page 0 at step i, as the library's steps do
    assert p.batch_size == 4 and list(p.kv_lens) == [11, 35, 18, 3]
    with pytest.raises(ValueError, match="topk"):
        libmla.SglangMLAMultiStepDraftBackend(be, 2, topk=2)


def test_geometry_and_state_errors(ctx):
    with pytest.raises(ValueError, match="kv_lora_rank"):
        _backend(ctx, kv_lora_rank=256)
    be = _backend(ctx)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        be.forward_decode(np.zeros((1, H * 576), np.float32), None, None, 0, None)
    with pytest.raises(ValueError, match="forward_mode"):
        be.init_forward_metadata(forward_mode="SPLIT_PREFILL", req_pool_indices=[0], seq_lens=[1])


def test_decode_example_runs():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "python", "examples", "decode_example.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "example OK" in r.stdout


def _graph_pair(ctx, **kw):
    """Two backends with one descriptor: the same request-table calls give the same slots."""
    args = dict(max_reqs=10, max_bs=6, num_pages=96, max_context_len=200)
    args.update(kw)
    return _backend(ctx, **args), _backend(ctx, **args)


def _twin_request(eager, graph, m, L, n):
    """A request of n cached tokens in both twins (same id, same slots), its latent rows written
    to every layer of both. Returns (request id, n)."""
    a = eager.alloc_req()
    assert graph.alloc_req() == a
    loc = eager.extend_req(a, n)
    np.testing.assert_array_equal(graph.extend_req(a, n), loc)
    for lid in range(L):
        kv = m.latent(lid, loc)
        eager.set_kv_buffer(Layer(lid), loc, kv)
        graph.set_kv_buffer(Layer(lid), loc, kv)
    return a, n


def test_cuda_graph_lifecycle_matches_eager_decode_loop(ctx, rng):
    """sglang's CUDA-graph lifecycle on the CPU (graph steps run eagerly from the fixed host
    inputs): capture per bucket, then a decode loop with requests joining and leaving, padded
    to buckets, with target-verify steps now and then. Each step's outputs equal a plain
    init_forward_metadata + forward_decode of the same padded batch on a twin backend bit for
    bit, and the float64 reference on the real rows."""
    eager, graph = _graph_pair(ctx)
    m = Model(eager, rng)  # one mirror: both caches get the same rows at the same slots
    L, NDT, BUCKETS = 2, 3, (2, 4, 6)

    class Spec:
        draft_token_num = NDT

    graph.init_cuda_graph_state(max_bs=6, max_num_tokens=6 * NDT)
    ids, seq = graph.cuda_graph_req_pool_indices, graph.cuda_graph_seq_lens
    assert ids.shape == (6,) and ids.dtype == np.int32 and seq.shape == (6,)
    assert list(ids) == [libmla.REQ_PAD] * 6 and list(seq) == [1] * 6  # padding until written
    # capture: per bucket and mode, the metadata hook, then two passes (warm-up + "capture");
    # the passes write dummy rows to slot 0 and read only page 0
    for mode, q_len in (("decode", 1), ("target_verify", NDT)):
        for bs in BUCKETS:
            md = graph.init_forward_metadata_capture_cuda_graph(
                bs, bs * q_len, np.zeros(bs, np.int32), np.ones(bs, np.int32),
                forward_mode=mode, spec_info=Spec() if q_len > 1 else None)
            assert md.graph and md.padded_rows == bs and md.num_q_tokens == bs * q_len
            assert list(ids[:bs]) == [libmla.REQ_PAD] * bs
            for _ in range(2):
                for lid in range(L):
                    q = rng.standard_normal((bs * q_len, H * 576)).astype(np.float32)
                    k = rng.standard_normal((bs * q_len, 576)).astype(np.float32)
                    fb = libmla.ForwardBatch(mode, ids[:bs], seq[:bs],
                                             out_cache_loc=np.zeros(bs * q_len, np.int32))
                    o = (graph.forward_decode if q_len == 1 else graph.forward_extend)(
                        q, k, None, Layer(lid), fb)
                    assert o.shape == (bs * q_len, H * 512) and np.isfinite(o).all()
                    p = graph.backend.get_plan()  # the forward ran the backend's graph step
                    assert p.graph and p.batch_size == bs and p.num_q_tokens == bs * q_len
    with pytest.raises(ValueError, match="draft_extend"):
        graph.init_forward_metadata_capture_cuda_graph(2, 2, None, None, forward_mode="extend")
    with pytest.raises(ValueError, match="takes 1..3 draft tokens"):
        Spec.draft_token_num = NDT + 1  # past the graph state's max_draft_tokens
        try:
            graph.init_forward_metadata_capture_cuda_graph(2, 8, None, None,
                                                           forward_mode="target_verify",
                                                           spec_info=Spec())
        finally:
            Spec.draft_token_num = NDT

    live = {}  # req id -> length
    order = []
    steps = verifies = mismatches = 0
    for step in range(24):
        while len(order) < 3 or (len(order) < 6 and rng.uniform() < 0.3):
            a, n = _twin_request(eager, graph, m, L, int(rng.integers(1, 120)))
            live[a] = n
            order.append(a)
        if len(order) > 3 and rng.uniform() < 0.3:
            rid = order.pop(int(rng.integers(0, len(order))))
            eager.free_req(rid)
            graph.free_req(rid)
            del live[rid]
        nreal = len(order)
        bs = min(b for b in BUCKETS if b >= nreal)
        verify = step % 5 == 4
        q_len = NDT if verify else 1
        mode = "target_verify" if verify else "decode"
        # this step's positions: one token per request, or NDT drafts to verify
        locs = []
        for rid in order:
            loc = eager.extend_req(rid, q_len)
            np.testing.assert_array_equal(graph.extend_req(rid, q_len), loc)
            locs.append(loc)
        kv_lens = [live[r] + q_len for r in order]
        seq_real = [live[r] + (0 if verify else 1) for r in order]  # verify: drafts excluded
        # sglang-style padded inputs: ids 0 and seq 1 past the real rows, slot 0 for them
        rid_pad = np.array(order + [0] * (bs - nreal), np.int32)
        seq_pad = np.array(seq_real + [1] * (bs - nreal), np.int32)
        loc_pad = np.concatenate(locs + [np.zeros((bs - nreal) * q_len, np.int32)]).astype(np.int32)
        md = graph.init_forward_metadata_replay_cuda_graph(
            bs, rid_pad, seq_pad, forward_mode=mode, spec_info=Spec() if verify else None,
            seq_lens_cpu=seq_pad, num_real=nreal)
        assert md.graph and md.padded_rows == bs - nreal
        assert list(ids[:bs]) == order + [libmla.REQ_PAD] * (bs - nreal)
        assert list(seq[:bs]) == seq_real + [1] * (bs - nreal)
        np.testing.assert_array_equal(md.plan.kv_lens[:nreal], kv_lens)  # CPU: host plan too
        # the same padded batch, planned eagerly
        eb = libmla.ForwardBatch(mode, np.array(order + [libmla.REQ_PAD] * (bs - nreal), np.int32),
                                 seq_pad, out_cache_loc=loc_pad, spec_info=Spec())
        eager.init_forward_metadata(eb)
        assert not eager.forward_metadata.graph
        gb = libmla.ForwardBatch(mode, rid_pad, seq_pad, out_cache_loc=loc_pad, spec_info=Spec())
        T = bs * q_len
        for lid in range(L):
            kv = np.concatenate([m.latent(lid, np.concatenate(locs)),
                                 rng.standard_normal((T - nreal * q_len, 576)).astype(np.float32)])
            q = rng.standard_normal((T, H * 576)).astype(np.float32)
            if step % 2:  # sglang's [T, H * 576] q (strided halves) and [T, 576] k
                fwd_e = eager.forward_decode if not verify else eager.forward_extend
                fwd_g = graph.forward_decode if not verify else graph.forward_extend
                oe, le = fwd_e(q, kv, None, Layer(lid), eb, return_lse=True)
                og, lg = fwd_g(q, kv, None, Layer(lid), gb, return_lse=True)
            else:  # q_nope + q_rope, k + k_rope (the one-call path)
                q3 = q.reshape(T, H, 576)
                parts = dict(q_rope=np.ascontiguousarray(q3[..., 512:]),
                             k_rope=np.ascontiguousarray(kv[:, 512:]), return_lse=True)
                qn, kc = np.ascontiguousarray(q3[..., :512]), np.ascontiguousarray(kv[:, :512])
                oe, le = eager.forward_decode(qn, kc, None, lid, eb, **parts)
                og, lg = graph.forward_decode(qn, kc, None, lid, gb, **parts)
            n = nreal * q_len
            if not (np.array_equal(oe[:n], og[:n]) and np.array_equal(le[:n], lg[:n])):
                mismatches += 1
            if step % 6 == 5 or verify:
                o_ref, l_ref = m.ref_absorbed(lid, q[:n], order, [q_len] * nreal, kv_lens, verify)
                ref.assert_close(og[:n], o_ref, *TOL["f32"], what="graph step %d layer %d" % (step, lid))
                ref.assert_close(lg[:n], l_ref, 1e-4, 1e-5, "graph lse step %d" % step)
        assert graph.backend.get_plan().graph
        for rid in order:
            if verify:  # accept one draft: the bonus token's position stays for the next step
                eager.truncate_req(rid, live[rid] + 1)
                graph.truncate_req(rid, live[rid] + 1)
            live[rid] += 1
        steps += 1
        verifies += verify
    assert mismatches == 0, "%d layer steps of the graph lifecycle differ from eager" % mismatches
    assert steps == 24 and verifies == 4
    # the graph-state checks
    with pytest.raises(ValueError, match="max_bs"):
        graph.init_forward_metadata_replay_cuda_graph(7, order, [1] * len(order))
    with pytest.raises(ValueError, match="allocated once"):
        graph.init_cuda_graph_state(6, 6 * NDT, max_draft_tokens=NDT + 1)
    graph.init_cuda_graph_state(4, 4)  # a smaller state over the same buffers
    with pytest.raises(ValueError, match="max_bs = 4"):
        graph.init_forward_metadata_capture_cuda_graph(6, 6, None, None)
    # a bad row is refused on the CPU before the inputs are written
    before = ids.copy()
    with pytest.raises(libmla.MLAError):
        graph.init_forward_metadata_replay_cuda_graph(2, [9, order[0]], [5, 1])  # 9: not live
    np.testing.assert_array_equal(ids, before)


def test_cuda_graph_first_layer_rebuilds_step(ctx, rng):
    """The graph step runs at the first layer of each pass: a pass whose inputs changed
    in between (a replay) sees the new rows even though forward is called with the same
    metadata object, and an eager plan in between does not leak into the graph pass."""
    eager, graph = _graph_pair(ctx)
    m = Model(eager, rng)
    reqs = []
    for n in (40, 90):
        a = graph.alloc_req()
        assert eager.alloc_req() == a
        loc = graph.extend_req(a, n)
        eager.extend_req(a, n)
        for lid in range(2):
            kv = m.latent(lid, loc)
            graph.set_kv_buffer(lid, loc, kv)
            eager.set_kv_buffer(lid, loc, kv)
        reqs.append(a)
    graph.init_cuda_graph_state(2, 2)
    graph.init_forward_metadata_capture_cuda_graph(2, 2, None, None)
    q = rng.standard_normal((2, H * 576)).astype(np.float32)
    ids, seq = graph.cuda_graph_req_pool_indices, graph.cuda_graph_seq_lens
    # the engine writes the inputs itself (as a replay hook would), keeping the metadata
    ids[:2], seq[:2] = reqs, [40, 90]
    o1 = graph.forward_decode(q, None, None, 1, None, save_kv_cache=False)  # first layer: 1
    ids[:2], seq[:2] = reqs[::-1], [90, 40]
    o0 = graph.forward_decode(q, None, None, 0, None, save_kv_cache=False)  # same pass: no step
    o_ref, _ = m.ref_absorbed(0, q, reqs, [1, 1], [40, 90], False)
    ref.assert_close(o0, o_ref, *TOL["f32"], what="layer 0 in the pass begun with the old inputs")
    # a plan on the same backend between passes: the next pass's first layer rebuilds
    graph.backend.plan("decode", [reqs[0]], [40])
    o1b = graph.forward_decode(q, None, None, 1, None, save_kv_cache=False)
    o_ref, _ = m.ref_absorbed(1, q, reqs[::-1], [1, 1], [90, 40], False)
    ref.assert_close(o1b, o_ref, *TOL["f32"], what="new pass after a plan")
    assert not np.array_equal(o1, o1b)


def test_cuda_graph_extend_buckets_match_eager(ctx, rng):
    """EXTEND graphs (the paged absorbed prefill over cached prefixes at a token bucket) on
    the CPU: capture per (bs, num_tokens) bucket, then rounds of requests extending by 0..12
    tokens, replayed through the hooks into the bucket that fits. Each round's real rows
    equal an eager init_forward_metadata + forward_extend of the same EXTEND batch on a twin
    backend (up to the split schedule, sized for the bucket in the graph step) and the
    float64 reference; the token rows past the real total are left untouched; the state's
    checks refuse what does not fit."""
    eager, graph = _graph_pair(ctx)
    m = Model(eager, rng)
    L, TMAX = 2, 64
    BUCKETS = ((2, 16), (4, 32), (6, 64))  # (bs, num_tokens)
    with pytest.raises(ValueError, match="max_extend_tokens"):
        graph.init_cuda_graph_state(max_bs=6, max_num_tokens=18, max_extend_tokens=129)
    graph.init_cuda_graph_state(max_bs=6, max_num_tokens=18, max_extend_tokens=TMAX)
    ids, seq = graph.cuda_graph_req_pool_indices, graph.cuda_graph_seq_lens
    ext_in = graph.cuda_graph_extend_seq_lens
    assert ext_in.shape == (6,) and ext_in.dtype == np.int32 and ext_in.flags.writeable
    assert list(ext_in) == [0] * 6 and graph.cuda_graph_max_extend_tokens == TMAX
    SENT = 7.0  # what the engine's output buffer held before: rows past the total keep it

    # capture: every row padding (no tokens), so no row of the bucket is attended
    for bs, nt in BUCKETS:
        md = graph.init_forward_metadata_capture_cuda_graph(
            bs, nt, np.zeros(bs, np.int32), np.ones(bs, np.int32), forward_mode="extend")
        assert md.graph and md.padded_rows == bs and md.num_q_tokens == nt
        assert md.plan.num_q_tokens == 0  # the CPU's host plan of the padded batch
        assert list(ids[:bs]) == [libmla.REQ_PAD] * bs and list(ext_in[:bs]) == [0] * bs
        for _ in range(2):
            for lid in range(L):
                out = np.full((nt, H * 512), SENT, np.float32)
                fb = libmla.ForwardBatch("extend", ids[:bs], seq[:bs],
                                         out_cache_loc=np.zeros(nt, np.int32))
                o = graph.forward_extend(rng.standard_normal((nt, H * 576)).astype(np.float32),
                                         rng.standard_normal((nt, 576)).astype(np.float32), None,
                                         Layer(lid), fb, out=out)
                assert o.shape == (nt, H * 512) and (out == SENT).all()
                p = graph.backend.get_plan()
                assert p.graph and p.mode == libmla.Mode.EXTEND and p.num_q_tokens == nt
    with pytest.raises(ValueError, match="1..64"):
        graph.init_forward_metadata_capture_cuda_graph(2, TMAX + 1, None, None,
                                                       forward_mode="extend")
    with pytest.raises(ValueError, match="num_tokens"):
        graph.init_forward_metadata_capture_cuda_graph(2, None, None, None, forward_mode="extend")

    # requests with cached prompts, in both twins
    live = {}
    for _ in range(5):
        a, n = _twin_request(eager, graph, m, L, int(rng.integers(1, 90)))
        live[a] = n
    rounds = 0
    for rnd in range(8):
        reqs = list(live)
        nreal = int(rng.integers(1, len(reqs) + 1))
        order = [reqs[i] for i in rng.permutation(len(reqs))[:nreal]]
        ext = [int(rng.integers(0 if rnd % 3 == 1 else 1, 13)) for _ in order]
        if rnd == 0:
            ext[0] = 0 if nreal > 1 else ext[0]  # a row without tokens among the real ones
        total = sum(ext)
        bs, nt = min((b, t) for b, t in BUCKETS if b >= nreal and t >= total)
        pre = [live[r] for r in order]
        locs = []
        for r, e in zip(order, ext):
            loc = eager.extend_req(r, e)
            np.testing.assert_array_equal(graph.extend_req(r, e), loc)
            locs.append(loc)
            live[r] += e
        sl = [live[r] for r in order]
        real_loc = np.concatenate(locs).astype(np.int32)
        # sglang-style padded arrays: ids 0 and seq 1 past the real rows (num_real says so)
        rid_pad = np.array(order + [0] * (bs - nreal), np.int32)
        seq_pad = np.array(sl + [1] * (bs - nreal), np.int32)
        ext_pad = np.array(ext + [5] * (bs - nreal), np.int32)  # ignored past num_real
        kw = dict(extend_seq_lens=ext_pad) if rnd % 2 == 0 else \
            dict(extend_prefix_lens_cpu=np.array(pre + [0] * (bs - nreal), np.int32))
        md = graph.init_forward_metadata_replay_cuda_graph(
            bs, rid_pad, seq_pad, forward_mode="extend", num_tokens=nt, num_real=nreal, **kw)
        assert md.graph and md.padded_rows == bs - nreal and md.num_q_tokens == nt
        assert md.plan.num_q_tokens == total  # the CPU's host plan: the real tokens only
        assert list(ids[:bs]) == order + [libmla.REQ_PAD] * (bs - nreal)
        assert list(seq[:bs]) == sl + [1] * (bs - nreal)
        assert list(ext_in[:bs]) == ext + [0] * (bs - nreal)
        loc_pad = np.concatenate([real_loc, np.zeros(nt - total, np.int32)])
        gb = libmla.ForwardBatch("extend", rid_pad, seq_pad, out_cache_loc=loc_pad)
        eb = libmla.ForwardBatch(libmla.ForwardMode.EXTEND, order, sl, out_cache_loc=real_loc,
                                 extend_prefix_lens=pre, extend_seq_lens=ext)
        assert not eager.init_forward_metadata(eb).uses_mha
        for lid in range(L):
            kv = np.concatenate([m.latent(lid, real_loc),
                                 rng.standard_normal((nt - total, 576)).astype(np.float32)])
            q = rng.standard_normal((nt, H * 576)).astype(np.float32)
            out = np.full((nt, H * 512), SENT, np.float32)
            lse = np.full((nt, H), SENT, np.float32)
            og, lg = graph.forward_extend(q, kv, None, Layer(lid), gb, out=out, lse=lse)
            assert og.shape == (nt, H * 512)
            assert (out[total:] == SENT).all() and (lse[total:] == SENT).all(), \
                "round %d: rows past the real total were written" % rnd
            assert graph.backend.get_plan().graph
            if total == 0:
                continue
            oe, le = eager.forward_extend(q[:total], kv[:total], None, Layer(lid), eb,
                                          return_lse=True)
            np.testing.assert_allclose(og[:total], oe, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(lg[:total], le, rtol=1e-6, atol=1e-5)
            keep = [i for i, e in enumerate(ext) if e > 0]
            o_ref, l_ref = m.ref_absorbed(lid, q[:total], [order[i] for i in keep],
                                          [ext[i] for i in keep], [sl[i] for i in keep], True)
            ref.assert_close(og[:total], o_ref, *TOL["f32"], what="extend graph round %d" % rnd)
            ref.assert_close(lg[:total], l_ref, 1e-4, 1e-5, "extend graph lse round %d" % rnd)
        rounds += 1
    assert rounds == 8

    # the state's checks
    r0 = list(live)[0]
    before = (ids.copy(), seq.copy(), ext_in.copy())
    with pytest.raises(ValueError, match="bucket"):  # more tokens than the bucket
        graph.init_forward_metadata_replay_cuda_graph(2, [r0], [live[r0]], forward_mode="extend",
                                                      num_tokens=16, extend_seq_lens=[17])
    with pytest.raises(ValueError, match="extend_seq_lens"):
        graph.init_forward_metadata_replay_cuda_graph(2, [r0], [live[r0]], forward_mode="extend",
                                                      num_tokens=16)
    with pytest.raises(ValueError, match="0..seq_len"):
        graph.init_forward_metadata_replay_cuda_graph(2, [r0], [3], forward_mode="extend",
                                                      num_tokens=16, extend_seq_lens=[4])
    with pytest.raises(libmla.MLAError):  # request 9 is not live: refused before any write
        graph.init_forward_metadata_replay_cuda_graph(2, [r0, 9], [live[r0], 5],
                                                      forward_mode="extend", num_tokens=16,
                                                      extend_seq_lens=[1, 1])
    for a, b in zip(before, (ids, seq, ext_in)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="allocated once"):
        graph.init_cuda_graph_state(6, 18, max_extend_tokens=TMAX + 1)
    graph.init_cuda_graph_state(6, 18)  # keeps the EXTEND buckets
    assert graph.cuda_graph_max_extend_tokens == TMAX
    # a state without EXTEND buckets refuses EXTEND graphs
    plain = _backend(ctx, max_reqs=4, max_bs=2, num_pages=16, max_context_len=64)
    plain.init_cuda_graph_state(2, 6)
    with pytest.raises(ValueError, match="max_extend_tokens"):
        plain.init_forward_metadata_capture_cuda_graph(2, 8, None, None, forward_mode="extend")


def test_backend_graph_calls(ctx, rng):
    """libmla.Backend's wrappers of mla_backend_graph_*: the fixed inputs as writable views of
    the library's buffers, graph steps as DevicePlans equal to the host-plan path, the
    library's refusals as MLAErrors."""
    be = libmla.Backend(ctx, num_layers=1, num_pages=16, page_size=16, num_heads=H, scale=SCALE,
                        max_reqs=4, max_context=64, max_bs=4, max_q_tokens=16, act_dtype="f32")
    for call in (be.graph_inputs, lambda: be.graph_step("decode", 1)):
        with pytest.raises(libmla.MLAError) as e:
            call()
        assert e.value.status == libmla.Status.ERR_BAD_STATE and "graph_init" in str(e.value)
    be.graph_init(4, 2)
    ids, seq = be.graph_inputs()
    assert be.graph_inputs()[0] is ids and ids.flags.writeable and ids.dtype == np.int32
    assert list(ids) == [libmla.REQ_PAD] * 4 and list(seq) == [1] * 4
    with pytest.raises(libmla.MLAError) as e:
        be.graph_init(4, 2)
    assert e.value.status == libmla.Status.ERR_BAD_STATE
    a = be.req_table.add()
    slots = be.req_table.extend(a, 20)
    be.cache.write(0, slots, rng.standard_normal((20, 512)).astype(np.float32),
                   rng.standard_normal((20, 64)).astype(np.float32))
    ids[0], seq[0] = a, 20  # row 1 stays a padding row
    be.sync()  # a no-op on the CPU
    p = be.graph_step("decode", 2)
    assert isinstance(p, libmla.api.DevicePlan) and p.graph and p.on_device
    assert p.num_q_tokens == 2 and be.get_plan() is p and p.valid
    with pytest.raises(ValueError, match="built on the device"):
        p.kv_lens
    qn = rng.standard_normal((2, H, 512)).astype(np.float32)
    qr = rng.standard_normal((2, H, 64)).astype(np.float32)
    o, lse = be.forward(0, q_nope=qn, q_rope=qr, return_lse=True)
    hp = be.plan("decode", [a, libmla.REQ_PAD], [20, 1])  # the same batch, planned on the host
    assert not p.valid and hp.valid and not getattr(hp, "on_device", False)
    o2, lse2 = be.forward(0, q_nope=qn, q_rope=qr, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    for args in (("decode", 5), ("target_verify", 1, 3), ("idle", 1)):
        with pytest.raises(libmla.MLAError) as e:
            be.graph_step(*args)
        assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT, args
    with pytest.raises(libmla.MLAError) as e:  # EXTEND graph steps need mla_backend_graph_init_extend
        be.graph_step("extend", 1)
    assert e.value.status == libmla.Status.ERR_BAD_STATE
    ids[0] = 9  # no such request row (max_reqs 4): the CPU step refuses it
    with pytest.raises(libmla.MLAError) as e:
        be.graph_step("decode", 1)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE

    # EXTEND graph steps: the paged absorbed prefill at a token bucket, equal (up to the
    # split the bucket's schedule makes) to the host plan of EXTEND over the same prefix.
    ext = be.graph_init_extend(12)
    assert ext.flags.writeable and list(ext) == [0] * 4
    new = be.req_table.extend(a, 5)  # 5 new tokens over the 20 cached
    be.cache.write(0, new, rng.standard_normal((5, 512)).astype(np.float32),
                   rng.standard_normal((5, 64)).astype(np.float32))
    ids[:2], seq[:2], ext[:2] = [a, libmla.REQ_PAD], [25, 1], [5, 0]
    p = be.graph_step("extend", 2, 12)
    assert p.num_q_tokens == 12 and p.graph
    qn = rng.standard_normal((12, H, 512)).astype(np.float32)
    qr = rng.standard_normal((12, H, 64)).astype(np.float32)
    out = np.full((12, H, 512), 3.0, np.float32)
    o, lse = be.forward(0, q_nope=qn, q_rope=qr, out=out, return_lse=True)
    assert (out[5:] == 3.0).all(), "rows past the extend total were written"
    be.plan("extend", [a], [25], prefix_lens=[20])
    o2, lse2 = be.forward(0, q_nope=qn[:5], q_rope=qr[:5], return_lse=True)
    np.testing.assert_allclose(o[:5], o2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[:5], lse2, rtol=1e-6, atol=1e-6)
    with pytest.raises(libmla.MLAError) as e:  # past the bucket graph_init_extend sized
        be.graph_step("extend", 2, 13)
    assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT


def _check_step_metadata(sm, hp, what):
    """The library's step metadata (views) against the host plan of the same step."""
    assert sm.batch_size == hp.batch_size and sm.q_len == 1, what
    assert not sm.kv_lens.flags.writeable, what
    np.testing.assert_array_equal(sm.kv_lens, hp.kv_lens, err_msg=what)
    np.testing.assert_array_equal(sm.qo_indptr, np.arange(hp.batch_size + 1), err_msg=what)
    w = hp.block_table.shape[1]
    np.testing.assert_array_equal(sm.block_table[:, :w], hp.block_table, err_msg=what)
    assert (sm.block_table[:, w:] == libmla.BLOCK_TABLE_PAD).all(), what
    np.testing.assert_array_equal(sm.num_splits, hp.num_splits, err_msg=what)
    np.testing.assert_array_equal(sm.sched_meta, hp.sched_meta, err_msg=what)


def test_multi_step_draft_rounds_match_plain_decode(ctx, rng):
    """The draft backend over the C draft steps (one mla_backend_draft_prepare for every
    step, a select per step), eagerly (init_forward_metadata) and through the CUDA-graph
    hooks run eagerly on the CPU, over rounds with requests joining and leaving, padded
    batches and random acceptance: every step's output on the real rows equals a plain
    SglangMLABackend decode of the same padded batch with seq_len + i + 1 on a twin backend
    bit for bit, the library's step metadata equals the host plan, and the real rows are
    close to the float64 reference."""
    graph, eager = _graph_pair(ctx)
    m = Model(eager, rng)
    L, STEPS, BUCKETS = 2, 3, (2, 4, 6)
    draft = libmla.SglangMLAMultiStepDraftBackend(graph, speculative_num_steps=STEPS)
    assert len(draft.attn_backends) == STEPS
    draft.init_cuda_graph_state(6, 6)
    ids, seq = draft.cuda_graph_req_pool_indices, draft.cuda_graph_seq_lens
    assert ids is graph.backend.graph_inputs()[0] and ids.shape == (6,)
    # capture per bucket: the hook, then two passes ("warm-up" + "captured") over every
    # step and layer; each pass begins with the draft prepare
    for bs in BUCKETS:
        md = draft.init_forward_metadata_capture_cuda_graph(bs=bs)
        assert md.graph and md.padded_rows == bs and md.num_q_tokens == bs
        assert list(ids[:bs]) == [libmla.REQ_PAD] * bs and list(seq[:bs]) == [1] * bs
        for _ in range(2):
            for i, st in enumerate(draft.attn_backends):
                for lid in range(L):
                    q = rng.standard_normal((bs, H * 576)).astype(np.float32)
                    k = rng.standard_normal((bs, 576)).astype(np.float32)
                    fb = libmla.ForwardBatch("decode", ids[:bs], seq[:bs],
                                             out_cache_loc=np.zeros(bs, np.int32))
                    o = st.forward_decode(q, k, None, Layer(lid), fb)
                    assert o.shape == (bs, H * 512) and np.isfinite(o).all()
                    p = graph.backend.get_plan()
                    assert p.graph and p.num_steps == STEPS and p.step == i and p.batch_size == bs
    live, order = {}, []
    mismatches, rounds, graph_rounds, padded_rounds, ref_checks = [], 0, 0, 0, 0
    for rnd in range(10):
        while len(order) < 2 or (len(order) < 6 and rng.uniform() < 0.35):
            a = eager.alloc_req()
            assert graph.alloc_req() == a
            n = int(rng.integers(1, 110))
            loc = eager.extend_req(a, n)
            np.testing.assert_array_equal(graph.extend_req(a, n), loc)
            for lid in range(L):
                kv = m.latent(lid, loc)
                eager.set_kv_buffer(lid, loc, kv)
                graph.set_kv_buffer(lid, loc, kv)
            live[a] = n
            order.append(a)
        if len(order) > 2 and rng.uniform() < 0.35:
            rid = order.pop(int(rng.integers(0, len(order))))
            eager.free_req(rid)
            graph.free_req(rid)
            del live[rid]
        nreal = len(order)
        bs = min(b for b in BUCKETS if b >= nreal)
        if rnd == 3:
            bs = 6  # at least one round with padding rows in each flow
        graph_mode = rnd % 2 == 1
        seq_real = [live[r] for r in order]
        dslots = []  # the drafts' slots, allocated up front
        for rid in order:
            loc = eager.extend_req(rid, STEPS)
            np.testing.assert_array_equal(graph.extend_req(rid, STEPS), loc)
            dslots.append(loc)
        ids_pad = np.array(order + [libmla.REQ_PAD] * (bs - nreal), np.int32)
        seq_pad = np.array(seq_real + [1] * (bs - nreal), np.int32)
        if graph_mode:  # sglang's padded replay arrays: id 0, seq 1 past the real rows
            md = draft.init_forward_metadata_replay_cuda_graph(
                bs=bs, req_pool_indices=np.array(order + [0] * (bs - nreal), np.int64),
                seq_lens=seq_pad.astype(np.int64), num_real=nreal)
            assert md.graph and draft.draft_plan is None
            graph_rounds += 1
        else:
            md = draft.init_forward_metadata(libmla.ForwardBatch("decode", ids_pad, seq_pad))
            assert (draft.draft_plan is None) == (bs > nreal)
        assert md.padded_rows == bs - nreal and md.num_q_tokens == bs
        np.testing.assert_array_equal(ids[:bs], ids_pad)
        np.testing.assert_array_equal(seq[:bs], seq_pad)
        padded_rounds += bs > nreal
        for i, st in enumerate(draft.attn_backends):
            hp = st.forward_metadata.plan  # CPU: the host plan of the step, for inspection
            np.testing.assert_array_equal(hp.kv_lens, seq_pad + i + 1)
            if draft.draft_plan is not None:  # the one-call host draft plan agrees
                ip, ix = draft.draft_plan.step(i)
                np.testing.assert_array_equal(ip, hp.kv_indptr)
                np.testing.assert_array_equal(ix, hp.kv_indices)
            loc_i = np.array([d[i] for d in dslots] + [0] * (bs - nreal), np.int32)
            np.testing.assert_array_equal(draft.step_slots(i), loc_i)
            # the twin: a plain decode of the same padded batch, step i's lengths
            eager.init_forward_metadata(forward_mode="decode", req_pool_indices=ids_pad,
                                        seq_lens=seq_pad + i + 1)
            efb = libmla.ForwardBatch("decode", ids_pad, seq_pad + i + 1, out_cache_loc=loc_i)
            dfb = libmla.ForwardBatch("decode", ids_pad, seq_pad, out_cache_loc=loc_i) \
                if (rnd + i) % 3 else None  # None: the draft stores at step_slots(i)
            for lid in range(L):
                kv = m.latent(lid, loc_i)
                q = rng.standard_normal((bs, H * 576)).astype(np.float32)
                if (rnd + i + lid) % 2:  # sglang's [bs, H * 576] q, [bs, 576] k
                    og, lg = st.forward_decode(q, kv, None, Layer(lid), dfb, return_lse=True)
                    oe, le = eager.forward_decode(q, kv, None, Layer(lid), efb, return_lse=True)
                else:  # q_nope + q_rope, k + k_rope; fixed output buffers
                    q3 = q.reshape(bs, H, 576)
                    qn = np.ascontiguousarray(q3[..., :512])
                    qr = np.ascontiguousarray(q3[..., 512:])
                    kc, kr = np.ascontiguousarray(kv[:, :512]), np.ascontiguousarray(kv[:, 512:])
                    og = np.full((bs, H * 512), np.nan, np.float32)
                    lg = np.full((bs, H), np.nan, np.float32)
                    r = st.forward_decode(qn, kc, None, lid, dfb, q_rope=qr, k_rope=kr, out=og,
                                          lse=lg)
                    assert np.shares_memory(r[0], og) and r[1] is lg
                    oe, le = eager.forward_decode(qn, kc, None, lid, efb, q_rope=qr, k_rope=kr,
                                                  return_lse=True)
                # Real rows: the same bits. Padding rows read page 0 only on both sides, but
                # not the same keys (the step reads slots [0, i + 2) of page 0 through the
                # block table, the host plan's kernel slot 0 i + 2 times through kv_indices).
                if not (np.array_equal(og[:nreal], oe[:nreal]) and
                        np.array_equal(lg[:nreal], le[:nreal])):
                    mismatches.append((rnd, i, lid))
                assert np.isfinite(og).all() and np.isfinite(lg).all()
                if rnd % 3 == 0 or i == STEPS - 1:
                    o_ref, l_ref = m.ref_absorbed(lid, q[:nreal], order, [1] * nreal,
                                                  [s + i + 1 for s in seq_real], False)
                    what = "draft round %d step %d layer %d" % (rnd, i, lid)
                    ref.assert_close(og[:nreal], o_ref, *TOL["f32"], what=what)
                    ref.assert_close(lg[:nreal], l_ref, 1e-4, 1e-5, what + " lse")
                    ref_checks += 1
            # the library's metadata of step i (this selects it; the next forward selects
            # its own)
            _check_step_metadata(st.step_metadata(), hp, "round %d step %d" % (rnd, i))
        # accept a random number of each request's drafts, roll back the rest
        for j, rid in enumerate(order):
            n = seq_real[j] + int(rng.integers(0, STEPS + 1))
            eager.truncate_req(rid, n)
            graph.truncate_req(rid, n)
            live[rid] = n
        rounds += 1
    assert not mismatches, "draft (round, step, layer) differing from plain decode: %s" % mismatches
    assert rounds == 10 and graph_rounds == 5 and padded_rounds >= 1 and ref_checks >= 20


def test_multi_step_draft_stale_rebuild_and_refusals(ctx, rng):
    """An eager draft made stale by another plan on the same backend is refused; a graph
    pass rebuilds every step at its first call (and after another plan). Rows the steps
    cannot take are refused before the inputs are written; shape and state errors."""
    be = _backend(ctx, max_bs=4)
    m = Model(be, rng)
    reqs = []
    for n in (20, 45):
        a = be.alloc_req()
        loc = be.extend_req(a, n)
        be.set_kv_buffer(0, loc, m.latent(0, loc))
        reqs.append(a)
    seq = [20, 45]
    with pytest.raises(ValueError, match="topk"):
        libmla.SglangMLAMultiStepDraftBackend(be, 2, topk=2)
    for n in (0, 17):
        with pytest.raises(ValueError, match="speculative_num_steps"):
            libmla.SglangMLAMultiStepDraftBackend(be, n)
    draft = libmla.SglangMLAMultiStepDraftBackend(be, 2)
    q = rng.standard_normal((2, H * 576)).astype(np.float32)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        draft.attn_backends[0].forward_decode(q, None, None, 0, save_kv_cache=False)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        draft.step_metadata(0)
    with pytest.raises(ValueError, match="init_cuda_graph_state"):
        draft.init_forward_metadata_capture_cuda_graph(bs=2)
    # the drafts' positions are not allocated yet: refused, the inputs untouched
    with pytest.raises(libmla.MLAError):
        draft.init_forward_metadata(req_pool_indices=reqs, seq_lens=seq)
    ids, seq_in = be.backend.graph_inputs()  # made on first use, at the base's max_bs
    assert be.backend.graph_max_bs == 4 and be.backend.draft_max_steps == 2
    assert list(ids) == [libmla.REQ_PAD] * 4 and list(seq_in) == [1] * 4
    for r in reqs:
        loc = be.extend_req(r, 2)
        be.set_kv_buffer(0, loc, m.latent(0, loc))  # the drafts' rows, stored up front here
    with pytest.raises(ValueError, match="1..4 rows"):
        draft.init_forward_metadata(req_pool_indices=reqs * 3, seq_lens=seq * 3)
    draft.init_forward_metadata(req_pool_indices=reqs, seq_lens=seq)
    o0 = draft.attn_backends[1].forward_decode(q, None, None, 0, save_kv_cache=False)
    o_ref, _ = m.ref_absorbed(0, q, reqs, [1, 1], [22, 47], False)
    ref.assert_close(o0, o_ref, *TOL["f32"], what="eager draft step 1")
    # another plan on the same backend makes the eager draft metadata stale
    be.init_forward_metadata(forward_mode="decode", req_pool_indices=reqs[:1], seq_lens=[20])
    with pytest.raises(ValueError, match="stale"):
        draft.attn_backends[1].forward_decode(q, None, None, 0, save_kv_cache=False)
    with pytest.raises(ValueError, match="stale"):
        draft.step_metadata(1)
    # a second draft backend wanting more steps than the draft buffers hold
    with pytest.raises(ValueError, match="allocated once"):
        libmla.SglangMLAMultiStepDraftBackend(be, 3).init_forward_metadata(
            req_pool_indices=reqs, seq_lens=seq)
    # graph passes: the first call after the hook builds the steps, later calls of the same
    # pass reuse them; another plan in between is rebuilt over
    draft.init_cuda_graph_state(4, 4)
    draft.init_forward_metadata_replay_cuda_graph(bs=2, req_pool_indices=reqs, seq_lens=seq)
    np.testing.assert_array_equal(draft.step_metadata(1).kv_lens, [22, 47])  # built for it
    os0 = draft.attn_backends[0].forward_decode(q, None, None, 0, save_kv_cache=False)  # first
    ids[:2] = reqs[::-1]  # written behind the hook's back: this pass keeps what it built
    seq_in[:2] = seq[::-1]
    oa = draft.attn_backends[1].forward_decode(q, None, None, 0, save_kv_cache=False)
    np.testing.assert_array_equal(oa, o0)
    be.init_forward_metadata(forward_mode="decode", req_pool_indices=reqs[:1], seq_lens=[20])
    ob = draft.attn_backends[1].forward_decode(q, None, None, 0, save_kv_cache=False)
    o_ref, _ = m.ref_absorbed(0, q, reqs[::-1], [1, 1], [47, 22], False)
    ref.assert_close(ob, o_ref, *TOL["f32"], what="a graph pass rebuilt after another plan")
    ids[:2], seq_in[:2] = reqs, seq
    os0b = draft.attn_backends[0].forward_decode(q, None, None, 0, save_kv_cache=False)
    np.testing.assert_array_equal(os0b, os0)  # the first call again: a new pass, rebuilt
    # a bad row through the replay hook: refused before the inputs are written
    before = (ids.copy(), seq_in.copy())
    for rid, s in ((7, 5), (reqs[0], 21)):  # 7: not live; 21 + 2 drafts > the request's 22
        with pytest.raises(libmla.MLAError):
            draft.init_forward_metadata_replay_cuda_graph(bs=2, req_pool_indices=[rid, reqs[1]],
                                                          seq_lens=[s, 45])
        np.testing.assert_array_equal(ids, before[0])
        np.testing.assert_array_equal(seq_in, before[1])
    with pytest.raises(ValueError, match="max_bs"):
        draft.init_forward_metadata_replay_cuda_graph(bs=5, req_pool_indices=reqs, seq_lens=seq)
    with pytest.raises(ValueError, match="max_bs"):
        draft.init_cuda_graph_state(5, 5)


def test_backend_draft_calls(ctx, rng):
    """libmla.Backend's wrappers of mla_backend_draft_* and mla_backend_step_metadata: draft
    steps equal plain DECODE plans with seq_len + i + 1 bit for bit, their metadata equals
    the host plan's, and the library's refusals are MLAErrors."""
    be = libmla.Backend(ctx, num_layers=1, num_pages=24, page_size=16, num_heads=H, scale=SCALE,
                        max_reqs=4, max_context=96, max_bs=4, max_q_tokens=16, act_dtype="f32")
    rt = be.req_table

    def status(call, want):
        with pytest.raises(libmla.MLAError) as e:
            call()
        assert e.value.status == want, (e.value, want)
        return str(e.value)

    assert "graph_init" in status(lambda: be.draft_init(3), libmla.Status.ERR_BAD_STATE)
    be.graph_init(4, 0)
    status(lambda: be.draft_init(17), libmla.Status.ERR_INVALID_ARGUMENT)
    status(lambda: be.draft_prepare(2, 1), libmla.Status.ERR_BAD_STATE)  # no draft buffers
    be.draft_init(3)
    assert be.draft_max_steps == 3
    status(lambda: be.draft_init(3), libmla.Status.ERR_BAD_STATE)
    status(lambda: be.draft_select(0), libmla.Status.ERR_BAD_STATE)
    reqs, seq = [], [33, 5, 70]
    for n in seq:
        a = rt.add()
        s = rt.extend(a, n + 3)
        be.cache.write(0, s, rng.standard_normal((n + 3, 512)).astype(np.float32),
                       rng.standard_normal((n + 3, 64)).astype(np.float32))
        reqs.append(a)
    ids, sl = be.graph_inputs()
    ids[:4] = reqs + [libmla.REQ_PAD]
    sl[:4] = seq + [1]
    p = be.draft_prepare(4, 3)
    assert isinstance(p, libmla.api.DevicePlan) and p.graph and p.num_steps == 3 and p.step == 0
    assert be.get_plan() is p and p.num_q_tokens == 4
    qs = [(rng.standard_normal((4, H, 512)).astype(np.float32),
           rng.standard_normal((4, H, 64)).astype(np.float32)) for _ in range(3)]
    outs, metas = [], []
    for i in range(3):
        be.draft_select(i)
        assert p.step == i
        outs.append(be.forward(0, q_nope=qs[i][0], q_rope=qs[i][1], return_lse=True))
        metas.append(be.step_metadata())
    planner = libmla.Planner(ctx, max_bs=4, max_q_tokens=4, max_kv_tokens=4 * 96, max_context=96,
                             page_size=16)
    for i in range(3):
        sk = np.array(seq + [1], np.int32) + i + 1
        _check_step_metadata(metas[i], planner.build(rt, "decode", ids[:4].copy(), sk,
                                                     num_heads=H), "step %d" % i)
        be.plan("decode", ids[:4].copy(), sk)
        status(be.step_metadata, libmla.Status.ERR_BAD_STATE)  # a host plan on the CPU
        o, lse = be.forward(0, q_nope=qs[i][0], q_rope=qs[i][1], return_lse=True)
        np.testing.assert_array_equal(outs[i][0], o)
        np.testing.assert_array_equal(outs[i][1], lse)
    status(lambda: be.draft_select(0), libmla.Status.ERR_BAD_STATE)  # the plan replaced them
    be.draft_prepare(2, 2)
    status(lambda: be.draft_select(2), libmla.Status.ERR_INVALID_ARGUMENT)
    status(lambda: be.draft_prepare(5, 2), libmla.Status.ERR_INVALID_ARGUMENT)
    status(lambda: be.draft_prepare(2, 4), libmla.Status.ERR_INVALID_ARGUMENT)
    # a graph step's metadata through the same call
    be.graph_step("decode", 3)
    sm = be.step_metadata()
    np.testing.assert_array_equal(sm.kv_lens, seq)
    ids[0] = 9  # no such request row: the CPU prepare refuses it
    status(lambda: be.draft_prepare(1, 1), libmla.Status.ERR_OUT_OF_RANGE)
