"""A small serving loop through libmla.SglangMLABackend, on the CPU, self-checking.

    PYTHONPATH=python python3 python/examples/decode_example.py

A toy two-layer "model" with random weights produces the tensors an MLA
model hands its attention backend: prefill (EXTEND without prefix, the
ragged MHA path: q/k/v of 192/192/128 per head, k/v expanded from the
latent by kv_b_proj), then decode steps (absorbed MLA over the paged latent
cache: q [bs, H * 576], the step's latent row [bs, 576]), a CUDA-graph
style replay of a padded batch, and a multi-step draft with rollback. The
last decode step is checked against a float64 numpy reference; the script
ends with "example OK" (exit status 1 otherwise).
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import libmla  # noqa: E402

H, LAYERS, HIDDEN = 8, 2, 256
NOPE, ROPE_D, V = 128, 64, 128
SCALE = (NOPE + ROPE_D) ** -0.5
rng = np.random.default_rng(7)


class ToyLayer:
    """Random projections standing in for an MLA layer (what RadixAttention carries: layer_id,
    scaling) plus the weights that make its q / latent / k / v."""

    def __init__(self, layer_id):
        self.layer_id, self.scaling = layer_id, SCALE
        s = HIDDEN ** -0.5
        self.w_latent = (rng.standard_normal((HIDDEN, 576)) * s).astype(np.float32)
        self.w_q_absorbed = (rng.standard_normal((HIDDEN, H * 576)) * s).astype(np.float32)
        self.w_q_mha = (rng.standard_normal((HIDDEN, H * (NOPE + ROPE_D))) * s).astype(np.float32)
        self.kv_b_proj = (rng.standard_normal((H, NOPE + V, 512)) * 512 ** -0.5).astype(np.float32)


def main():
    be = libmla.SglangMLABackend(
        num_heads=H, num_layers=LAYERS, num_pages=64, page_size=16, scale=SCALE, max_reqs=8,
        max_context_len=256, dtype="f32", kv_cache_dtype="bf16", max_bs=4, max_num_tokens=256,
        num_threads=2)
    layers = [ToyLayer(i) for i in range(LAYERS)]
    print("libmla %s (%s), CPU kernels: %s" % (libmla.library_version, libmla.library_path,
                                               be.ctx.cpu_isa))

    # ---- prefill: EXTEND without prefix -> ragged MHA ----------------------------------------
    prompt = [37, 12, 64]
    reqs = [be.alloc_req() for _ in prompt]
    loc = np.concatenate([be.extend_req(r, n) for r, n in zip(reqs, prompt)])  # out_cache_loc
    fb = libmla.ForwardBatch(libmla.ForwardMode.EXTEND, reqs, prompt, out_cache_loc=loc,
                             extend_prefix_lens=[0] * 3, extend_seq_lens=prompt)
    be.init_forward_metadata(fb)
    T = sum(prompt)
    x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
    for L in layers:
        latent = x @ L.w_latent  # [T, 576]: c (512) then the rope part (64)
        # k/v of MHA are expanded from the latent (the functional API's expand_kv).
        k, v = libmla.expand_kv(be.ctx, np.ascontiguousarray(latent[:, :512]),
                                np.ascontiguousarray(latent[:, 512:]), L.kv_b_proj, nope_dim=NOPE)
        q = x @ L.w_q_mha
        o = be.forward_extend(q, k, v, L, fb, latent=latent)  # [T, H * 128]
        x = x + 0.01 * o[:, :HIDDEN]
    print("prefill: %d tokens in %d requests, out %s" % (T, len(reqs), o.shape))

    # ---- decode steps -------------------------------------------------------------------------
    seq = list(prompt)
    t0 = time.perf_counter()
    steps = 6
    for _ in range(steps):
        loc = np.array([be.extend_req(r, 1)[0] for r in reqs], np.int32)
        seq = [s + 1 for s in seq]
        fb = libmla.ForwardBatch(libmla.ForwardMode.DECODE, reqs, seq, out_cache_loc=loc)
        be.init_forward_metadata(fb)  # one plan per step, shared by the layers
        x = rng.standard_normal((len(reqs), HIDDEN)).astype(np.float32)
        for L in layers:
            q = x @ L.w_q_absorbed  # [bs, H * 576]
            kv = x @ L.w_latent  # [bs, 576]
            o = be.forward_decode(q, kv, None, L, fb)  # [bs, H * 512]
    dt = (time.perf_counter() - t0) / steps
    print("decode: %d steps, %.2f ms/step (%d layers, bs %d)" % (steps, dt * 1e3, LAYERS, len(reqs)))

    # Check the last layer's output against a float64 reference over the cache's rows.
    err = 0.0
    qh = q.reshape(len(reqs), H, 576).astype(np.float64)
    for i, (r, s) in enumerate(zip(reqs, seq)):
        c, rr = libmla.gather_latent(be.ctx, be.cache, L.layer_id, be.req_to_token[r, :s])
        keys = np.concatenate([c, rr], axis=1).astype(np.float64)  # [s, 576]
        logits = qh[i] @ keys.T * SCALE  # [H, s]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want = (p @ c.astype(np.float64)).reshape(-1)
        err = max(err, float(np.abs(o[i] - want).max()))
    print("decode vs float64 reference: max |err| = %.2e" % err)
    ok = err < 1e-3

    # ---- CUDA-graph style replay: a captured batch size of 4, 3 real rows + 1 padding row --------
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, None, None,
                                                forward_mode=libmla.ForwardMode.DECODE)
    md = be.init_forward_metadata_replay_cuda_graph(4, reqs, seq, num_real=3)
    q4 = np.concatenate([q, np.zeros((1, H * 576), np.float32)])
    o4 = be.forward_decode(q4, None, None, L, None, save_kv_cache=False)
    ok &= bool(np.array_equal(o4[:3], o))
    print("graph-style replay: %d padding row(s), real rows identical: %s"
          % (md.padded_rows, np.array_equal(o4[:3], o)))

    # ---- multi-step draft (2 steps), then reject the drafts -------------------------------------
    draft = libmla.SglangMLAMultiStepDraftBackend(be, speculative_num_steps=2)
    for r in reqs:
        be.extend_req(r, 2)  # room for both draft tokens
    draft.init_forward_metadata(req_pool_indices=reqs, seq_lens=seq)
    for step in draft.attn_backends:
        x = rng.standard_normal((len(reqs), HIDDEN)).astype(np.float32)
        L = layers[0]
        od = step.forward_decode(x @ L.w_q_absorbed, x @ L.w_latent, None, L)
    for r, s in zip(reqs, seq):
        be.truncate_req(r, s)  # all drafts rejected: roll back
    print("draft: 2 steps, plan kv_indptr per step %s, rolled back to %s"
          % (draft.draft_plan.kv_indptr.tolist(), [be.req_table.length(r) for r in reqs]))
    ok &= bool(np.isfinite(od).all())

    print("example OK" if ok else "example FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
