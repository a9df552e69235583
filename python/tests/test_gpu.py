"""The binding on a GPU with torch tensors (skipped without torch, a GPU, or a CUDA libmla).

libmla.Step (device-built decode / verify steps) against a torch float32
reference and against attention_absorbed over the host plan (bit for bit);
its metadata against the host plan; a decode step of two layers captured in a
torch.cuda.CUDAGraph and replayed after writing new request ids / lengths /
queries into the captured tensors, equal bit for bit to eager calls; ragged
prefill and merge through the functional API (xfail while the library answers
UNSUPPORTED for them on CUDA); an fp8 cache (likewise); the argument checks of
the CUDA paths. The references use float32 on the GPU (TF32 off).
"""

import math

import numpy as np
import pytest

import libmla
import reference as ref

torch = pytest.importorskip("torch", reason="skipped: torch is not importable")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA device for torch", allow_module_level=True)

SCALE = 0.0722
NUM_SM = 48  # split-schedule target shared by the step and the host plan


def _xfail_unsupported(e, what):
    if isinstance(e, libmla.MLAError) and e.status == libmla.Status.ERR_UNSUPPORTED:
        pytest.xfail("%s: the library answers UNSUPPORTED on CUDA contexts: %s" % (what, e))
    raise e


def close(got, want, atol, rtol, what):
    """|got - want| <= atol + rtol |want| elementwise (float32 on the GPU); -inf positions
    must match."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape, "%s: shape %s vs %s" % (what, tuple(got.shape),
                                                           tuple(want.shape))
    gi, wi = torch.isinf(got), torch.isinf(want)
    assert torch.equal(gi, wi), "%s: inf positions differ" % what
    assert not torch.isnan(got).any(), "%s: NaN in the result" % what
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    bound = atol + rtol * want[fin].abs()
    if err.numel() and not bool((err <= bound).all()):
        i = int(torch.argmax(err - bound))
        raise AssertionError("%s: max violation: got %g, want %g (atol %g rtol %g), max err %g"
                             % (what, float(got[fin][i]), float(want[fin][i]), atol, rtol,
                                float(err.max())))


class GpuWorld:
    """A CUDA cache + request table (host) with random latent rows in every layer, page
    order shuffled; the rows kept as float32 on the GPU for the reference."""

    def __init__(self, cctx, gen, lens, page_size, num_layers=2, max_reqs=None, max_context=None,
                 cache_dtype="bf16", fp8_scales=None):
        P = page_size
        self.max_context = max_context or (max(lens) + 64)
        self.max_reqs = max_reqs or len(lens) + 4
        pages = sum((n + P - 1) // P + 1 for n in lens) + 16
        self.cache = libmla.KVCache(cctx, num_layers, pages, P, cache_dtype, fp8_scales=fp8_scales)
        self.rt = libmla.RequestTable(cctx, self.max_reqs, self.max_context, cache=self.cache)
        tmp = [self.rt.add() for _ in range(3)]
        for i, t in enumerate(tmp):
            self.rt.extend(t, P * (i + 2))
        self.rt.free(tmp[1])
        self.rt.free(tmp[0])
        self.rt.free(tmp[2])
        self.reqs, self.lens = [], list(lens)
        self.kv = [dict() for _ in range(num_layers)]  # layer -> rid -> (c, r) float32 stored
        for n in lens:
            rid = self.rt.add()
            self.reqs.append(rid)
            slots = torch.from_numpy(self.rt.extend(rid, n)).cuda()
            for layer in range(num_layers):
                c = torch.randn(n, 512, generator=gen, device="cuda").to(torch.bfloat16)
                r = torch.randn(n, 64, generator=gen, device="cuda").to(torch.bfloat16)
                self.cache.write(layer, slots, c, r)
                if cache_dtype == "bf16":
                    self.kv[layer][rid] = (c.float(), r.float())
                else:  # what the cache stores: its own dequantized read-back
                    cs, rs = self.cache.read(layer, slots, "f32")
                    self.kv[layer][rid] = (cs, rs)
        self.r2t = torch.from_numpy(np.array(self.rt.req_to_token)).cuda()


def torch_reference(world, layer, rows, kv_lens, q_len, qn, qr, scale, causal):
    """float32 absorbed attention per row (padding rows: zeros / -inf, not compared)."""
    T, H = qn.shape[0], qn.shape[1]
    o = torch.zeros(T, H, 512, device="cuda")
    lse = torch.full((T, H), -math.inf, device="cuda")
    for i, (rid, kv) in enumerate(zip(rows, kv_lens)):
        rid, kv = int(rid), int(kv)
        if rid == libmla.REQ_PAD:
            continue
        c, r = world.kv[layer][rid]
        c, r = c[:kv], r[:kv]
        a, b = i * q_len, (i + 1) * q_len
        s = (torch.einsum("qhd,kd->qhk", qn[a:b].float(), c) +
             torch.einsum("qhd,kd->qhk", qr[a:b].float(), r)) * scale
        if causal:
            qi = torch.arange(q_len, device="cuda")[:, None, None]
            kj = torch.arange(kv, device="cuda")[None, None, :]
            s = s.masked_fill(kj > kv - q_len + qi, -math.inf)
        lse[a:b] = torch.logsumexp(s, dim=-1)
        o[a:b] = torch.einsum("qhk,kd->qhd", torch.softmax(s, dim=-1), c)
    return o, lse


def _batch(gen_np, world, bs, npad, extra):
    """Request ids (request 0 always, so the schedule splits it) and seq_lens, padding rows
    (REQ_PAD, seq_len 1) at random places."""
    others = list(gen_np.permutation(len(world.reqs) - 1)[:bs - npad - 1] + 1)
    rows = np.array([world.reqs[0]] + [world.reqs[i] for i in others] + [libmla.REQ_PAD] * npad,
                    np.int32)
    rows = rows[gen_np.permutation(bs)]
    seq = np.ones(bs, np.int32)
    for i, rid in enumerate(rows):
        if rid != libmla.REQ_PAD:
            n = world.lens[world.reqs.index(rid)] - extra
            seq[i] = n if rid == world.reqs[0] else gen_np.integers(max(n // 2, 1), n + 1)
    return rows, seq


@pytest.mark.parametrize("mode,ndt,H,P", [("decode", 0, 128, 64), ("decode", 0, 16, 16),
                                          ("target_verify", 2, 128, 64),
                                          ("target_verify", 2, 16, 32)])
def test_step_cuda_against_reference_and_plan(cctx, mode, ndt, H, P):
    gen = torch.Generator(device="cuda").manual_seed(7 + H + P + ndt)
    g = np.random.default_rng(100 + H + P + ndt)
    BS = 12
    lens = [1800] + [int(n) for n in g.integers(ndt + 2, 700, size=13)]
    w = GpuWorld(cctx, gen, lens, P)
    extra = ndt if mode == "target_verify" else 0
    step = libmla.Step(cctx, mode, batch_size=BS, num_heads=H, max_kv_len=w.max_context,
                       cache=w.cache, num_draft_tokens=ndt, num_sm=NUM_SM, scale=SCALE)
    rows, seq = _batch(g, w, BS, 2, extra)
    ids_d, seq_d = torch.from_numpy(rows).cuda(), torch.from_numpy(seq).cuda()
    step.prepare(w.cache, w.r2t, ids_d, seq_d)
    cctx.synchronize()
    # metadata: torch views of the workspace, equal to the host plan's arrays
    m = step.metadata()
    assert isinstance(m.kv_lens, torch.Tensor) and m.kv_lens.is_cuda
    p = libmla.plan(cctx, w.rt, mode, rows, seq, num_draft_tokens=ndt, num_heads=H,
                    num_sm=NUM_SM, max_context=w.max_context)
    arr = m.arrays()
    np.testing.assert_array_equal(arr["kv_lens"], seq + extra)
    for k in ("qo_indptr", "kv_lens", "sched_meta", "num_splits"):
        np.testing.assert_array_equal(arr[k], getattr(p, k), k)
    for i in range(BS):
        npg = (int(seq[i]) + extra + P - 1) // P
        np.testing.assert_array_equal(arr["block_table"][i, :npg], p.block_table[i, :npg])
        assert (arr["block_table"][i, npg:] == libmla.BLOCK_TABLE_PAD).all()

    q_len = step.q_len
    T = BS * q_len
    q = (torch.randn(T, H, 576, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    qn, qr = q[..., :512].contiguous(), q[..., 512:].contiguous()
    live = [i for i in range(BS) if rows[i] != libmla.REQ_PAD]
    qrows = torch.tensor([t for i in live for t in range(i * q_len, (i + 1) * q_len)],
                         device="cuda")
    for layer in (0, 1):
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(T, H, device="cuda")
        got = step.attention(w.cache, layer, qn, qr, out, lse)
        assert got[0] is out and got[1] is lse
        # host-plan path on the same GPU: the same bits
        o_p, l_p = libmla.attention_absorbed(cctx, w.cache, layer, p, qn, qr, scale=SCALE,
                                             return_lse=True)
        cctx.synchronize()
        assert torch.equal(out, o_p) and torch.equal(lse, l_p), "step vs plan, layer %d" % layer
        # strided views of one [T, H, 576] tensor give the same bits
        o_v = step.attention(w.cache, layer, q[..., :512], q[..., 512:])
        assert torch.equal(o_v, out)
        o_ref, l_ref = torch_reference(w, layer, rows, seq + extra, q_len, qn, qr, SCALE,
                                       mode != "decode")
        what = "%s H=%d P=%d layer %d" % (mode, H, P, layer)
        close(out[qrows], o_ref[qrows], 1e-2, 1.6e-2, what + " out")
        close(lse[qrows], l_ref[qrows], 2e-3, 1e-4, what + " lse")
    # base-2 lse and a non-default torch stream (followed by the binding)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _, l2 = step.attention(w.cache, 1, qn, qr, return_lse=True, lse_base2=True)
    s.synchronize()
    close(l2[qrows], lse[qrows] * ref.LOG2E, 1e-5, 1e-5, "lse base 2 on a side stream")
    cctx.synchronize()
    assert p.total_splits > BS, "the long request should have been split (test set-up)"


def test_step_cuda_graph_replay(cctx):
    """prepare + attention of 2 layers captured once, replayed with new inputs."""
    H, P, BS, L = 128, 64, 16, 2
    gen = torch.Generator(device="cuda").manual_seed(21)
    g = np.random.default_rng(21)
    lens = [2500] + [int(n) for n in g.integers(2, 900, size=23)]
    w = GpuWorld(cctx, gen, lens, P, num_layers=L)
    step = libmla.Step(cctx, "decode", batch_size=BS, num_heads=H, max_kv_len=w.max_context,
                       cache=w.cache, scale=SCALE)  # num_sm 0: the device's SMs
    ids = torch.zeros(BS, dtype=torch.int32, device="cuda")
    seq = torch.ones(BS, dtype=torch.int32, device="cuda")
    qn = torch.zeros(L, BS, H, 512, dtype=torch.bfloat16, device="cuda")
    qr = torch.zeros(L, BS, H, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(L, BS, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(L, BS, H, device="cuda")

    def load(npad):
        rows, sl = _batch(g, w, BS, npad, 0)
        ids.copy_(torch.from_numpy(rows))
        seq.copy_(torch.from_numpy(sl))
        qn.copy_((torch.randn(L, BS, H, 512, generator=gen, device="cuda") * 0.5).bfloat16())
        qr.copy_((torch.randn(L, BS, H, 64, generator=gen, device="cuda") * 0.5).bfloat16())
        return rows, sl

    def run(o, l_):
        step.prepare(w.cache, w.r2t, ids, seq)
        for layer in range(L):
            step.attention(w.cache, layer, qn[layer], qr[layer], o[layer], l_[layer])

    load(3)
    # warm up on a side stream (torch's recipe), then capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(out, lse)
    torch.cuda.current_stream().wait_stream(s)
    cctx.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out, lse)
    torch.cuda.synchronize()
    eo, el = torch.empty_like(out), torch.empty_like(lse)
    mismatches = []
    for it in range(12):
        rows, sl = load(int(g.integers(0, BS)))
        run(eo, el)  # eager, other outputs
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cctx.synchronize()  # no row was out of range
        if not (torch.equal(out, eo) and torch.equal(lse, el)):
            mismatches.append(it)
        if it == 0:  # the replayed graph computed the new batch, against the reference
            live = [i for i in range(BS) if rows[i] != libmla.REQ_PAD]
            for layer in range(L):
                o_ref, l_ref = torch_reference(w, layer, rows, sl, 1, qn[layer], qr[layer],
                                               SCALE, False)
                close(out[layer][live], o_ref[live], 1e-2, 1.6e-2, "graph out layer %d" % layer)
                close(lse[layer][live], l_ref[live], 2e-3, 1e-4, "graph lse layer %d" % layer)
    assert not mismatches, "replays %s differ from eager" % mismatches
    # An out-of-range request id written into the captured input: the row is emptied and
    # the next synchronize reports it.
    ids[1] = w.max_reqs + 5
    graph.replay()
    with pytest.raises(libmla.MLAError) as e:
        cctx.synchronize()
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
    assert not bool((out[:, 1] != 0).any()) and bool(torch.isneginf(lse[:, 1]).all())
    cctx.synchronize()  # reported once


def test_step_cuda_argument_checks(cctx):
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = GpuWorld(cctx, gen, [40, 17], 16, num_layers=1)
    step = libmla.Step(cctx, batch_size=2, num_heads=8, max_kv_len=w.max_context,
                       cache=w.cache, scale=SCALE)
    assert isinstance(step.workspace, torch.Tensor) and step.workspace.is_cuda
    ids = torch.tensor(w.reqs, dtype=torch.int32, device="cuda")
    seq = torch.tensor(w.lens, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="'req_ids'.*on cpu"):
        step.prepare(w.cache, w.r2t, ids.cpu(), seq)
    with pytest.raises(ValueError, match="'seq_lens'.*on cpu"):
        step.prepare(w.cache, w.r2t, ids, np.array(w.lens, np.int32))
    with pytest.raises(ValueError, match="'req_ids'.*dtype i64"):
        step.prepare(w.cache, w.r2t, ids.long(), seq)
    with pytest.raises(ValueError, match="'req_to_token'.*on cpu"):
        step.prepare(w.cache, w.r2t.cpu(), ids, seq)
    with pytest.raises(ValueError, match="'req_to_token'.*RequestTable"):
        step.prepare(w.cache, w.rt, ids, seq)
    with pytest.raises(ValueError, match="'workspace'.*on cpu"):
        libmla.Step(cctx, batch_size=2, num_heads=8, max_kv_len=w.max_context, cache=w.cache,
                    workspace=np.empty(1 << 20, np.uint8))
    step.prepare(w.cache, w.r2t, ids, seq)
    q = torch.zeros(2, 8, 576, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="'q_nope'.*on cpu"):
        step.attention(w.cache, 0, q[..., :512].cpu(), q[..., 512:])
    with pytest.raises(ValueError, match="'out'.*on cpu"):
        step.attention(w.cache, 0, q[..., :512], q[..., 512:],
                       out=torch.empty(2, 8, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'lse'.*dtype"):
        step.attention(w.cache, 0, q[..., :512], q[..., 512:],
                       lse=torch.empty(2, 8, dtype=torch.float16, device="cuda"))
    # A CPU cache on a CUDA step: refused by the library.
    hctx = libmla.Context(num_threads=1)
    hcache = libmla.KVCache(hctx, 1, 8, 16, "bf16")
    with pytest.raises(libmla.MLAError) as e:
        step.prepare(hcache, w.r2t, ids, seq)
    assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="'req_ids'.*cuda:1"):
            step.prepare(w.cache, w.r2t, ids.to("cuda:1"), seq)
    o = step.attention(w.cache, 0, q[..., :512], q[..., 512:])
    cctx.synchronize()
    assert o.is_cuda and torch.isfinite(o.float()).all()


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_block"])
def test_step_cuda_fp8_cache(cctx, cache_dtype):
    H, P, BS = 16, 64, 6
    gen = torch.Generator(device="cuda").manual_seed(31)
    g = np.random.default_rng(31)
    lens = [900] + [int(n) for n in g.integers(3, 400, size=7)]
    scales = [0.02, 0.05] if cache_dtype == "fp8" else None
    w = GpuWorld(cctx, gen, lens, P, cache_dtype=cache_dtype, fp8_scales=scales)
    step = libmla.Step(cctx, "decode", batch_size=BS, num_heads=H, max_kv_len=w.max_context,
                       cache=w.cache, num_sm=NUM_SM, scale=SCALE)
    rows, seq = _batch(g, w, BS, 1, 0)
    step.prepare(w.cache, w.r2t, torch.from_numpy(rows).cuda(), torch.from_numpy(seq).cuda())
    q = (torch.randn(BS, H, 576, generator=gen, device="cuda") * 0.5).bfloat16()
    try:
        o, lse = step.attention(w.cache, 1, q[..., :512], q[..., 512:], return_lse=True)
        cctx.synchronize()
    except libmla.MLAError as e:
        _xfail_unsupported(e, "%s cache attention" % cache_dtype)
    live = [i for i in range(BS) if rows[i] != libmla.REQ_PAD]
    o_ref, l_ref = torch_reference(w, 1, rows, seq, 1, q[..., :512], q[..., 512:], SCALE, False)
    # (the kernel may round the dequantized keys to bf16: a little looser than bf16 caches)
    close(o[live], o_ref[live], 1.5e-2, 2e-2, cache_dtype + " out")
    close(lse[live], l_ref[live], 5e-3, 1e-4, cache_dtype + " lse")


def _ragged_reference(q, k, v, qo, kv, scale, causal):
    T, H = q.shape[0], q.shape[1]
    o = torch.zeros(T, H, v.shape[2], device="cuda")
    lse = torch.full((T, H), -math.inf, device="cuda")
    G = H // k.shape[1]
    for i in range(len(qo) - 1):
        a, b, ka, kb = int(qo[i]), int(qo[i + 1]), int(kv[i]), int(kv[i + 1])
        if a == b:
            continue
        kk = k[ka:kb].float().repeat_interleave(G, dim=1)
        vv = v[ka:kb].float().repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), kk) * scale
        if causal:
            Q, K = b - a, kb - ka
            qi = torch.arange(Q, device="cuda")[:, None]
            kj = torch.arange(K, device="cuda")[None, :]
            s = s.masked_fill(kj > K - Q + qi, -math.inf)
        lse[a:b] = torch.logsumexp(s, dim=-1).T
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        o[a:b] = torch.einsum("hqk,khd->qhd", p, vv)
    return o, lse


def test_ragged_prefill_cuda(cctx):
    H, Hkv, Dqk, Dv = 16, 16, 192, 128
    gen = torch.Generator(device="cuda").manual_seed(41)
    q_lens, kv_lens = [37, 130, 1, 64, 200], [37, 130, 1, 100, 200]  # one with a prefix
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = (torch.randn(int(qo[-1]), H, Dqk, generator=gen, device="cuda") * 0.5).bfloat16()
    k = (torch.randn(int(kv[-1]), Hkv, Dqk, generator=gen, device="cuda") * 0.5).bfloat16()
    v = torch.randn(int(kv[-1]), Hkv, Dv, generator=gen, device="cuda").bfloat16()
    qo_d, kv_d = torch.from_numpy(qo).cuda(), torch.from_numpy(kv).cuda()
    try:
        o, lse = libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, causal=True,
                                         return_lse=True)
        cctx.synchronize()
    except libmla.MLAError as e:
        _xfail_unsupported(e, "ragged MHA")
    o_ref, l_ref = _ragged_reference(q, k, v, qo, kv, SCALE, True)
    close(o, o_ref, 1e-2, 1.6e-2, "ragged out")
    close(lse, l_ref, 2e-3, 1e-4, "ragged lse")
    # host index arrays are checked and copied; same bits
    o2 = libmla.attention_ragged(cctx, q, k, v, qo, kv, scale=SCALE, causal=True)
    cctx.synchronize()
    assert torch.equal(o2, o)
    # the workspace: none (fixed item order) and a caller's tensor give the same bits as "auto"
    need = libmla.ragged_workspace_size(cctx)
    assert need > 0
    o3 = libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, causal=True, workspace=None)
    ws = torch.full((need,), 0x5A, dtype=torch.uint8, device="cuda")
    o4 = libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, causal=True, workspace=ws)
    cctx.synchronize()
    assert torch.equal(o3, o) and torch.equal(o4, o)
    with pytest.raises(ValueError, match="'workspace'.*needs"):
        libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, workspace=ws[:need - 1])
    with pytest.raises(ValueError, match="'workspace'"):
        libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, workspace=ws.cpu())
    with pytest.raises(ValueError, match="'qo_indptr'.*ends at"):
        libmla.attention_ragged(cctx, q[:-1], k, v, qo, kv, scale=SCALE)
    with pytest.raises(ValueError, match="'kv_indptr'.*dtype i64"):
        libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d.long(), scale=SCALE)
    # non-causal, fp32 output (a partial state to merge)
    o32, l32 = libmla.attention_ragged(cctx, q, k, v, qo_d, kv_d, scale=SCALE, causal=False,
                                       out_f32=True, return_lse=True)
    cctx.synchronize()
    assert o32.dtype == torch.float32
    o_ref, l_ref = _ragged_reference(q, k, v, qo, kv, SCALE, False)
    close(o32, o_ref, 2e-3, 2e-3, "ragged out_f32 non-causal")
    close(l32, l_ref, 2e-3, 1e-4, "ragged lse non-causal")


def test_merge_states_cuda(cctx):
    T, H, D = 50, 16, 512
    gen = torch.Generator(device="cuda").manual_seed(51)
    o1 = torch.randn(T, H, D, generator=gen, device="cuda").bfloat16()
    o2 = torch.randn(T, H, D, generator=gen, device="cuda").bfloat16()
    l1 = torch.randn(T, H, generator=gen, device="cuda") * 3
    l2 = torch.randn(T, H, generator=gen, device="cuda") * 3
    l2[0] = -math.inf  # an empty side
    l1[1] = -math.inf
    l2[1] = -math.inf  # both sides empty: o = 0, lse = -inf
    try:
        o, lse = libmla.merge_states(cctx, [o1, o2], [l1, l2])
        cctx.synchronize()
    except libmla.MLAError as e:
        _xfail_unsupported(e, "merge_states")
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    z = w1 + w2
    o_ref = torch.where(z[..., None] > 0, (w1[..., None] * o1.float() + w2[..., None] * o2.float())
                        / z.clamp_min(1e-30)[..., None], torch.zeros(()).cuda())
    l_ref = torch.where(z > 0, m + torch.log(z.clamp_min(1e-30)), torch.full_like(z, -math.inf))
    close(o, o_ref, 1e-2, 1.6e-2, "merge out")
    close(lse, l_ref, 1e-4, 1e-5, "merge lse")
    assert not bool((o[1] != 0).any())
    # in place into the first state
    libmla.merge_states(cctx, [o1, o2], [l1, l2], out=o1, lse_out=l1)
    cctx.synchronize()
    assert torch.equal(o1, o) and torch.equal(l1, lse)
