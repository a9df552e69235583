"""A float64 numpy reference for the binding's tests (shares nothing with libmla).

Rounding helpers model what the cache or an activation dtype stores (bf16,
f16, fp8 e4m3 with a scale); the attention references compute in float64
from those stored values, so the only differences left are the kernels'
fp32 arithmetic and the output's rounding.
"""

import numpy as np

LATENT, ROPE = 512, 64
LOG2E = 1.4426950408889634


# ---- storage formats ----------------------------------------------------------------------

def f32_to_bf16_bits(x):
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf16_bits_to_f64(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(x):
    """Values as bf16 stores them (float64 result)."""
    return bf16_bits_to_f64(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def round_f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def round_act(x, dtype):
    if dtype == "bf16":
        return round_bf16(x)
    if dtype == "f16":
        return round_f16(x)
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def to_act(x, dtype):
    """A float array in the activation dtype the binding takes (bf16 = uint16 bits)."""
    if dtype == "bf16":
        return f32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=np.float16 if dtype == "f16" else np.float32)


def from_act(a, dtype):
    return bf16_bits_to_f64(a) if dtype == "bf16" else np.asarray(a, dtype=np.float64)


def round_e4m3(y):
    """Round float32 values to the e4m3fn grid (saturate to +-448, nearest even, subnormals
    down to 2^-9); NaN stays NaN. float64 result."""
    y = np.asarray(y, dtype=np.float64)
    a = np.minimum(np.abs(y), 448.0)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, -6.0)  # below 2^-6 the grid is uniform (subnormals)
    quantum = np.exp2(e - 3)
    q = np.round(a / quantum) * quantum  # numpy rounds half to even
    q = np.minimum(q, 448.0)
    out = np.sign(y) * q
    out[np.isnan(y)] = np.nan
    return out


def quantize_fp8(x, scale):
    """What an fp8 per-tensor cache returns for x: e4m3(x / scale) * scale (the quotient
    rounded once, from its double value; the product in fp32)."""
    x = np.asarray(x, dtype=np.float32)
    s = np.float32(scale)
    q = round_e4m3(x.astype(np.float64) / np.float64(s))
    return (q.astype(np.float32) * s).astype(np.float64)


def quantize_fp8_block(c):
    """Block format latent: per 128 values scale = amax / 448 (1 when amax is 0)."""
    c = np.asarray(c, dtype=np.float32)
    out = np.empty(c.shape, dtype=np.float64)
    for b in range(LATENT // 128):
        x = c[:, b * 128:(b + 1) * 128]
        amax = np.abs(x).max(axis=1).astype(np.float32)
        s = np.where(amax == 0, np.float32(1.0), (amax / np.float32(448.0)).astype(np.float32))
        q = round_e4m3(x.astype(np.float64) / s[:, None].astype(np.float64))
        out[:, b * 128:(b + 1) * 128] = (q.astype(np.float32) * s[:, None]).astype(np.float64)
    return out


def stored(c, r, cache_dtype, scale=1.0):
    """(c, r) as the cache stores them, float64."""
    if cache_dtype == "bf16":
        return round_bf16(c), round_bf16(r)
    if cache_dtype == "f16":
        return round_f16(c), round_f16(r)
    if cache_dtype == "fp8":
        return quantize_fp8(c, scale), quantize_fp8(r, scale)
    if cache_dtype == "fp8_block":
        return quantize_fp8_block(c), round_bf16(r)
    raise ValueError(cache_dtype)


# ---- attention ----------------------------------------------------------------------------

def _softmax_rows(s):
    """(p, lse) of logits s [..., K] with -inf entries; rows with no finite entry: p = 0,
    lse = -inf."""
    m = np.max(s, axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    m = np.where(empty, 0.0, m)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
        lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(np.where(z[..., 0] > 0, z[..., 0], 1.0)),
                       -np.inf)
    return p, lse


def attend(q, k, v, scale, causal, softcap=0.0):
    """One request: q [Q, H, D], k [K, H, D], v [K, H, Dv] (float64, heads already matched);
    bottom-right causal. Returns (o [Q, H, Dv], lse [Q, H])."""
    Q, K = q.shape[0], k.shape[0]
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if causal:
        qi = np.arange(Q)[:, None]
        kj = np.arange(K)[None, :]
        s = np.where(kj <= K - Q + qi, s, -np.inf)
    p, lse = _softmax_rows(s)
    o = np.einsum("hqk,khd->qhd", p, v)
    return o, lse.T


def absorbed(q_nope, q_rope, c_rows, r_rows, scale, causal):
    """Absorbed MLA for one request: keys are latent rows c [K, 512] / r [K, 64], shared by
    every head; values are c."""
    H = q_nope.shape[1]
    K = c_rows.shape[0]
    q = np.concatenate([q_nope, q_rope], axis=-1)
    k = np.broadcast_to(np.concatenate([c_rows, r_rows], axis=-1)[:, None, :], (K, H, LATENT + ROPE))
    v = np.broadcast_to(c_rows[:, None, :], (K, H, LATENT))
    return attend(q, k, v, scale, causal)


def ragged(q, k, v, qo_indptr, kv_indptr, scale, causal, softcap=0.0):
    """Ragged MHA with grouped heads (q [Tq, H, D], k/v [Tk, Hkv, .])."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv
    o = np.zeros((q.shape[0], H, v.shape[2]))
    lse = np.full((q.shape[0], H), -np.inf)
    for i in range(len(qo_indptr) - 1):
        qs, qe = qo_indptr[i], qo_indptr[i + 1]
        ks, ke = kv_indptr[i], kv_indptr[i + 1]
        if qe == qs:
            continue
        kk = np.repeat(k[ks:ke], G, axis=1)
        vv = np.repeat(v[ks:ke], G, axis=1)
        o[qs:qe], lse[qs:qe] = attend(q[qs:qe], kk, vv, scale, causal, softcap)
    return o, lse


def merge(o_parts, lse_parts):
    lse = np.stack(lse_parts)  # [n, T, H]
    m = np.max(lse, axis=0)
    empty = ~np.isfinite(m)
    m = np.where(empty, 0.0, m)
    w = np.exp(lse - m)
    z = w.sum(axis=0)
    o = sum(w[i][..., None] * o_parts[i] for i in range(len(o_parts)))
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(z[..., None] > 0, o / np.where(z > 0, z, 1.0)[..., None], 0.0)
        out_lse = np.where(z > 0, m + np.log(np.where(z > 0, z, 1.0)), -np.inf)
    return o, out_lse


def assert_close(got, ref, atol, rtol, what=""):
    """Per element |got - ref| <= atol + rtol |ref|; -inf / NaN positions must match."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s vs %s" % (what, got.shape, ref.shape)
    inf_g, inf_r = np.isinf(got), np.isinf(ref)
    assert np.array_equal(inf_g, inf_r), "%s: inf positions differ" % what
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "%s: NaN positions differ" % what
    fin = np.isfinite(ref)
    err = np.abs(got[fin] - ref[fin])
    bound = atol + rtol * np.abs(ref[fin])
    if err.size and not np.all(err <= bound):
        i = int(np.argmax(err - bound))
        raise AssertionError("%s: max violation at flat %d: got %r, ref %r (atol %g, rtol %g); "
                             "max abs err %g" % (what, i, got[fin][i], ref[fin][i], atol, rtol,
                                                 err.max()))
