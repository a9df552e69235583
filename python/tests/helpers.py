"""Test set-ups shared by several test files: a cache + request table filled with random
latent rows, and a float64 mirror of what the cache holds (slot -> stored row)."""

import numpy as np

import libmla
import reference as ref


class World:
    """A cache and request table with requests of given lengths, every position written."""

    def __init__(self, ctx, rng, lengths, cache_dtype="bf16", page_size=16, num_pages=None,
                 num_layers=2, max_reqs=8, max_context=256, scales=None, shuffle=True):
        self.ctx = ctx
        self.rng = rng
        self.cache_dtype = cache_dtype
        need = sum((n + page_size - 1) // page_size for n in lengths) + 4
        self.cache = libmla.KVCache(ctx, num_layers, num_pages or need * 2 + 2, page_size,
                                    cache_dtype, fp8_scales=scales)
        self.scales = self.cache.fp8_scales
        self.rt = libmla.RequestTable(ctx, max_reqs, max_context, cache=self.cache)
        # Shuffle the page allocator's order so block tables are not monotonic: take every
        # page once through a scratch request, then free it; slots then come in a different
        # order than a fresh table's.
        if shuffle:
            tmp = [self.rt.add() for _ in range(2)]
            self.rt.extend(tmp[0], page_size * 3)
            self.rt.extend(tmp[1], page_size * 2)
            self.rt.free(tmp[0])
        self.c = {}  # (layer, slot) -> stored c row (float64)
        self.r = {}
        self.reqs = []
        for n in lengths:
            rid = self.rt.add()
            self.reqs.append(rid)
            self.append(rid, n)

    def append(self, rid, n, scale_c=1.0):
        """Extend a request by n positions and write random rows there in every layer."""
        slots = self.rt.extend(rid, n)
        for layer in range(self.cache.num_layers):
            c = (self.rng.standard_normal((n, libmla.LATENT)) * scale_c).astype(np.float32)
            r = self.rng.standard_normal((n, libmla.ROPE)).astype(np.float32)
            self.cache.write(layer, slots, c, r)
            self.record(layer, slots, c, r)
        return slots

    def record(self, layer, slots, c, r):
        sc, sr = ref.stored(c, r, self.cache_dtype, self.scales[layer])
        for i, s in enumerate(slots):
            self.c[(layer, int(s))] = sc[i]
            self.r[(layer, int(s))] = sr[i]

    def rows(self, layer, rid, start, end):
        """Stored (c, r) of positions [start, end) of request rid."""
        slots = self.rt.req_to_token[rid, start:end]
        c = np.array([self.c[(layer, int(s))] for s in slots]).reshape(-1, libmla.LATENT)
        r = np.array([self.r[(layer, int(s))] for s in slots]).reshape(-1, libmla.ROPE)
        return c, r


def absorbed_reference(world, layer, rids, q_lens, kv_lens, q_nope, q_rope, scale, causal):
    """Reference over a batch: request i has q_lens[i] queries (rows in order) over its
    first kv_lens[i] positions."""
    T, H = q_nope.shape[0], q_nope.shape[1]
    o = np.zeros((T, H, libmla.LATENT))
    lse = np.zeros((T, H))
    t = 0
    for rid, ql, kl in zip(rids, q_lens, kv_lens):
        c, r = world.rows(layer, rid, 0, kl)
        o[t:t + ql], lse[t:t + ql] = ref.absorbed(q_nope[t:t + ql], q_rope[t:t + ql], c, r, scale,
                                                  causal)
        t += ql
    return o, lse


# Tolerances per output dtype for attention against the float64 reference (the
# reference is computed from the stored, i.e. already rounded, inputs).
TOL = {"f32": (2e-5, 2e-4), "bf16": (1e-2, 1.6e-2), "f16": (2e-3, 2e-3)}
