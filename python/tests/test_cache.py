"""KV cache (write / read / copy_rows / fp8) and request table through the binding."""

import numpy as np
import pytest

import libmla
import reference as ref
from helpers import World

CACHE_DTYPES = ["bf16", "f16", "fp8", "fp8_block"]


def _rows(rng, n, big=False):
    c = rng.standard_normal((n, libmla.LATENT)).astype(np.float32)
    r = rng.standard_normal((n, libmla.ROPE)).astype(np.float32)
    if big:  # saturation, subnormals, exact zeros, a zero block
        c[0, :8] = [1000.0, -1000.0, 1e-6, -3e-3, 0.0, 447.0, 449.0, 2 ** -9]
        c[1, 128:256] = 0.0
        r[0, :3] = [600.0, -1e-7, 0.0]
    return c, r


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("src", ["f32", "bf16", "f16"])
def test_write_read_round_trip(ctx, rng, cache_dtype, src):
    scales = [0.5, 2.0] if cache_dtype == "fp8" else None
    cache = libmla.KVCache(ctx, 2, 8, 4, cache_dtype, fp8_scales=scales)
    assert cache.row_bytes == {"bf16": 1152, "f16": 1152, "fp8": 576, "fp8_block": 656}[cache_dtype]
    n = 9
    slots = rng.permutation(np.arange(4, cache.num_slots, dtype=np.int32))[:n]
    c, r = _rows(rng, n, big=cache_dtype.startswith("fp8"))
    if cache_dtype == "f16":
        c[0, :8] = np.clip(c[0, :8], -60000, 60000)
    for layer in range(2):
        c_in, r_in = ref.to_act(c, src), ref.to_act(r, src)
        cache.write(layer, slots, c_in, r_in, dtype=src)
        cv, rv = ref.round_act(c, src), ref.round_act(r, src)
        scale = cache.fp8_scales[layer]
        want_c, want_r = ref.stored(cv, rv, cache_dtype, scale)
        got_c, got_r = cache.read(layer, slots)  # f32
        assert got_c.dtype == np.float32 and got_c.shape == (n, 512) and got_r.shape == (n, 64)
        np.testing.assert_array_equal(got_c.astype(np.float64), want_c)
        np.testing.assert_array_equal(got_r.astype(np.float64), want_r)
        # bf16 / f16 read-back round the dequantized values once more.
        gb, _ = cache.read(layer, slots, "bf16", parts="c")
        assert gb.dtype == np.uint16
        np.testing.assert_array_equal(gb, ref.f32_to_bf16_bits(want_c.astype(np.float32)))
        _, gh = cache.read(layer, slots, "f16", parts="r")
        np.testing.assert_array_equal(gh, want_r.astype(np.float32).astype(np.float16))


def test_raw_bytes_and_scales(ctx):
    cache = libmla.KVCache(ctx, 2, 4, 2, "fp8", fp8_scales=[1.0, 0.25])
    assert cache.fp8_scales == [1.0, 0.25]
    c = np.zeros((1, 512), np.float32)
    r = np.zeros((1, 64), np.float32)
    c[0, 0], c[0, 1], r[0, 0] = 1.0, -2.0, 448.0
    cache.write(0, [3], c, r)
    cache.write(1, [3], c, r)
    raw0 = cache.layer_view(0)
    assert raw0.shape == (8, 576) and not raw0.flags.writeable
    # e4m3fn: 1.0 = 0x38, -2.0 = 0xC0, 448 = 0x7E; layer 1 divides by 0.25 first (1/0.25 = 4 = 0x48,
    # 448/0.25 saturates to 448 = 0x7E).
    assert list(raw0[3, :2]) == [0x38, 0xC0] and raw0[3, 512] == 0x7E
    raw1 = cache.layer_view(1)
    assert raw1[3, 0] == 0x48 and raw1[3, 512] == 0x7E
    cache.set_fp8_scale(0, 2.0)
    assert cache.fp8_scales[0] == 2.0
    cache.write(0, [2], c, r)
    assert raw0[2, 0] == 0x30  # 1.0 / 2 = 0.5 = 0x30
    bf = libmla.KVCache(ctx, 1, 4, 2, "bf16")
    with pytest.raises(libmla.MLAError) as e:
        bf.set_fp8_scale(0, 2.0)
    assert e.value.status == libmla.Status.ERR_INVALID_ARGUMENT or e.value.status == \
        libmla.Status.ERR_UNSUPPORTED
    assert "fp8" in e.value.message
    bf.write(0, [5], c, r)
    row = bf.layer_view(0)[5].view(np.uint16)
    np.testing.assert_array_equal(row[:512], ref.f32_to_bf16_bits(c[0]))
    np.testing.assert_array_equal(row[512:], ref.f32_to_bf16_bits(r[0]))


def test_copy_rows_and_errors(ctx, rng):
    cache = libmla.KVCache(ctx, 2, 4, 4, "bf16")
    c, r = _rows(rng, 3)
    for layer in range(2):
        cache.write(layer, [4, 5, 6], c, r)
    cache.copy_rows([4, 6], [9, 10])
    for layer in range(2):
        got, _ = cache.read(layer, [9, 10])
        np.testing.assert_array_equal(got, ref.round_bf16(c[[0, 2]]).astype(np.float32))
    before = cache.read(0, [4, 5, 6])[0].copy()
    # Out-of-range slot: nothing written, the message names the argument.
    with pytest.raises(libmla.MLAError) as e:
        cache.write(0, [4, 99, 6], c * 2, r)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
    assert "slots[1]" in e.value.message and "99" in str(e.value)
    np.testing.assert_array_equal(cache.read(0, [4, 5, 6])[0], before)
    with pytest.raises(libmla.MLAError) as e:
        cache.read(5, [4])
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE and "layer" in e.value.message
    with pytest.raises(ValueError, match="'dst_slots'"):
        cache.copy_rows([1, 2], [3])
    with pytest.raises(ValueError, match="'c'.*dtype f64"):
        cache.write(0, [4], np.zeros((1, 512)), np.zeros((1, 64)))
    with pytest.raises(ValueError, match="'r'.*shape"):
        cache.write(0, [4, 5], c[:2], r[:1])
    with pytest.raises(libmla.MLAError) as e:
        libmla.KVCache(ctx, 1, 4, 3, "bf16")
    assert "page_size" in e.value.message


def test_request_table(ctx, rng):
    P = 4
    cache = libmla.KVCache(ctx, 2, 10, P, "bf16")
    rt = libmla.RequestTable(ctx, 3, 40, cache=cache)
    assert (rt.num_pages, rt.page_size, rt.max_reqs, rt.max_context) == (10, P, 3, 40)
    free0 = rt.free_pages
    assert free0 == 9  # page 0 is reserved
    a = rt.add()
    s = rt.extend(a, 6)
    assert s.dtype == np.int32 and rt.length(a) == 6 and rt.is_live(a)
    view = rt.req_to_token
    assert view.shape == (3, 40) and not view.flags.writeable
    np.testing.assert_array_equal(view[a, :6], s)
    assert np.all(view[a, 6:] == libmla.SLOT_UNUSED)
    # Page-aligned: position p lives at offset p % P of its page.
    assert np.all(s % P == np.arange(6) % P)
    assert s[0] // P == s[3] // P and s[4] // P == s[5] // P
    assert rt.free_pages == free0 - 2
    # Writing data, forking, then copy-on-write when the fork extends into a shared page.
    c, r = _rows(rng, 6)
    for layer in range(2):
        cache.write(layer, s, c, r)
    b = rt.fork(a, 5)
    assert rt.length(b) == 5 and rt.page_refs(int(s[4] // P)) == 2
    nb = rt.extend(b, 1)  # position 5 of b: page 1 of b is shared -> copied first
    new_page = int(rt.req_to_token[b, 4] // P)
    assert new_page != s[4] // P and rt.page_refs(int(s[4] // P)) == 1
    got, _ = cache.read(1, [rt.req_to_token[b, 4]])
    np.testing.assert_array_equal(got[0], ref.round_bf16(c[4]).astype(np.float32))
    assert nb[0] // P == new_page
    # The view is live: it shows b's row now.
    assert view[b, 5] == nb[0]
    # Truncate releases whole pages past the new length.
    fp = rt.free_pages
    rt.truncate(a, 3)
    assert rt.length(a) == 3 and rt.free_pages == fp + 1
    # Errors: all-or-nothing CACHE_FULL, CAPACITY, BAD_STATE.
    fp = rt.free_pages
    with pytest.raises(libmla.MLAError) as e:
        rt.extend(a, 37)  # 40 positions fit max_context, not the free pages
    assert e.value.status == libmla.Status.ERR_CACHE_FULL
    assert rt.length(a) == 3 and rt.free_pages == fp
    with pytest.raises(libmla.MLAError) as e:
        rt.extend(a, 38)
    assert e.value.status == libmla.Status.ERR_CAPACITY and "max_context" in e.value.message
    rt.add()
    with pytest.raises(libmla.MLAError) as e:
        rt.add()
    assert e.value.status == libmla.Status.ERR_CAPACITY
    rt.free(b)
    assert not rt.is_live(b)
    with pytest.raises(libmla.MLAError) as e:
        rt.extend(b, 1)
    assert e.value.status == libmla.Status.ERR_BAD_STATE and e.value.message
    with pytest.raises(libmla.MLAError) as e:
        rt.length(7)
    assert e.value.status == libmla.Status.ERR_OUT_OF_RANGE
    with pytest.raises(ValueError, match="'n'"):
        rt.extend(a, -1)


def test_table_without_cache_and_mismatch(ctx):
    rt = libmla.RequestTable(ctx, 2, 8, num_pages=5, page_size=2)
    r = rt.add()
    assert list(rt.extend(r, 3)) == list(rt.req_to_token[r, :3])
    cache = libmla.KVCache(ctx, 1, 6, 2, "bf16")
    with pytest.raises(libmla.MLAError) as e:
        libmla.RequestTable(ctx, 2, 8, num_pages=5, page_size=2, cache=cache)
    assert "num_pages" in e.value.message
    with pytest.raises(ValueError, match="num_pages"):
        libmla.RequestTable(ctx, 2, 8)


def test_world_mirror(ctx, rng):
    # The helper's float64 mirror agrees with gather_latent (used by later tests).
    w = World(ctx, rng, [5, 17], cache_dtype="fp8_block", page_size=4)
    for layer in range(2):
        c, r = w.rows(layer, w.reqs[1], 0, 17)
        gc, gr = libmla.gather_latent(ctx, w.cache, layer, w.rt.req_to_token[w.reqs[1], :17])
        np.testing.assert_array_equal(gc.astype(np.float64), c)
        np.testing.assert_array_equal(gr.astype(np.float64), r)
