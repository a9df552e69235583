#!/usr/bin/env python3
"""The split schedule's cost model against measured times (bench/RESULTS.md session 38).

Re-implements, for study only, the library's greedy walk (src/plan/step_build.h: parts
filled in request order up to q + piece cost, the smallest q that fits, FlashMLA's q when
that one cuts more, the cut-free q' <= q + q/16) and `mla bench --kv-spread`'s request
lengths (tools/bench_cuda.c bc_lens), then fits

    t = a * (cost of the busiest part) + k * (cut requests) + c

by least squares to the H=128 s_q 1 times of session 38 run 1, where a part's cost is the
sum over its pieces of (blocks, rounded up to pairs for the wide kernels) + C, plus Cp
for a piece of a cut request; C and Cp are searched on a grid. Then it prints what the
fitted model predicts for other schedules (pair units: 128-token blocks).

    python3 dev/tools/sched_model.py
"""

M64 = (1 << 64) - 1


def cdiv(a, b):
    return -(-a // b)


def bench_lens(b, sk, spread):
    """tools/bench_cuda.c bc_lens: uniform in sk (1 +- spread %), >= 64, seeded by (sk, spread)."""
    d = sk * spread // 100
    s = (0x6B76 * 1000003 + sk * 131 + spread) & M64
    out = []
    for _ in range(b):
        n = sk
        if d > 0:
            s = (s + 0x9E3779B97F4A7C15) & M64
            z = s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
            z ^= z >> 31
            n = sk - d + z % (2 * d + 1)
        out.append(max(64, n))
    return out


def walk(lens, parts, q, ov, nocut, unit=64):
    """Pieces per part as (blocks of 64 tokens, piece of a cut request), or None if q does not fit."""
    req, blk, out = 0, 0, []
    per = unit // 64
    for _ in range(parts):
        if req >= len(lens):
            break
        remain, took, segs = q + ov, 0, []
        while req < len(lens):
            rest = cdiv(lens[req], unit) - blk
            if remain >= rest + ov:
                remain -= rest + ov
                segs.append((cdiv(lens[req], 64) - blk * per, blk > 0))
                req, blk, took = req + 1, 0, took + 1
            elif nocut:
                if not took:
                    return None
                break
            else:
                if remain > ov:
                    blk += remain - ov
                    segs.append(((remain - ov) * per, True))
                break
        out.append(segs)
    return out if req >= len(lens) else None


def smallest(lo, hi, fits):
    """The smallest q in [lo, hi] with fits(q), fits being monotone and true at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi


def sched(lens, parts, ov=5, unit=64, div=16):
    """The library's q (mla_sb_sched_q) and its pieces."""
    units = [cdiv(n, unit) for n in lens]
    blocks, longest = sum(units), max(units)
    q_flash = cdiv(blocks + ov * len(lens), parts)
    hi = q_fit = smallest(min(max(1, cdiv(blocks, parts)), q_flash), q_flash,
                          lambda q: walk(lens, parts, q, ov, False, unit))

    def pieces(q):
        return sum(len(s) for s in walk(lens, parts, q, ov, False, unit))

    n = pieces(hi)
    if hi < q_flash and n > pieces(q_flash):
        hi, n = q_flash, pieces(q_flash)
    top = hi + hi // div
    if n > len(lens) and longest <= top and walk(lens, parts, top, ov, True, unit):
        q = smallest(max(q_fit, longest), top, lambda q: walk(lens, parts, q, ov, True, unit))
        return q, walk(lens, parts, q, ov, True, unit)
    return hi, walk(lens, parts, hi, ov, False, unit)


def busiest(parts_pieces, C, Cp, pair=True):
    return max(sum((cdiv(n, 2) * 2 if pair else n) + C + (Cp if cut else 0) for n, cut in segs)
               for segs in parts_pieces)


def cuts(parts_pieces):
    return sum(1 for segs in parts_pieces for n, cut in segs[-1:] if cut and segs)


# session 38 run 1 (H100, H=128, s_q 1, bf16, page 64): (b, s_k, spread %) -> µs at piece cost 5, 8, 12, 16
RUN1 = {
    (128, 8192, 50): (548.3, 549.25, 552.5, 557.7),
    (64, 8192, 50): (289.65, 290.3, 294.4, 299.0),
    (128, 4096, 90): (310.4, 314.2, 316.75, 322.1),
    (96, 8192, 0): (412.95, 415.0, 400.0, 399.55),
    (128, 8192, 0): (509.2, 508.9, 508.7, 509.5),
}


def lstsq3(rows, ys):
    """Least squares for y = a x0 + k x1 + c (normal equations, 3 x 3)."""
    A = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    n = 3
    for i in range(n):  # Gauss-Jordan
        p = max(range(i, n), key=lambda r: abs(A[r][i]))
        A[i], A[p], v[i], v[p] = A[p], A[i], v[p], v[i]
        for r in range(n):
            if r != i and A[i][i]:
                f = A[r][i] / A[i][i]
                A[r] = [x - f * y for x, y in zip(A[r], A[i])]
                v[r] -= f * v[i]
    return [v[i] / A[i][i] for i in range(n)]


def main():
    pts = []
    for (b, sk, sp), ts in RUN1.items():
        lens = bench_lens(b, sk, sp)
        for ov, t in zip((5, 8, 12, 16), ts):
            _, pp = sched(lens, 66, ov)
            pts.append(((b, sk, sp, ov), pp, t))
    best = None
    for C in range(16):
        for Cp in range(16):
            rows = [(busiest(pp, C, Cp), cuts(pp), 1.0) for _, pp, _ in pts]
            ys = [t for _, _, t in pts]
            coef = lstsq3(rows, ys)
            err = [y - (coef[0] * r[0] + coef[1] * r[1] + coef[2]) for r, y in zip(rows, ys)]
            rms = (sum(e * e for e in err) / len(err)) ** 0.5
            if best is None or rms < best[0]:
                best = (rms, C, Cp, coef, err)
    rms, C, Cp, (a, k, c), err = best
    print(f"fit: t = {a:.3f} us x busiest part + {k:.3f} us x cut requests + {c:.1f} us;"
          f" piece cost {C} blocks, +{Cp} for a cut request's piece; RMS {rms:.2f} us")
    for (key, _, t), e in zip(pts, err):
        print(f"  b={key[0]:3d} s_k={key[1]:5d} +-{key[2]:2d}% piece cost {key[3]:2d}: {t:6.1f} us, residual {e:+.1f}")

    def model(pp):
        return a * busiest(pp, C, Cp) + k * cuts(pp) + c

    print("model: library schedule (64-token blocks, piece cost 5) vs pair units (128 tokens, piece cost 2 / 3 pairs)")
    for b, sk, sp in [(128, 8192, 50), (64, 8192, 50), (128, 4096, 90), (128, 4096, 50), (64, 4096, 50),
                      (128, 8192, 25), (96, 8192, 0), (128, 8192, 0), (128, 16384, 50)]:
        lens = bench_lens(b, sk, sp)
        out = []
        for unit, ov in ((64, 5), (128, 2), (128, 3)):
            q, pp = sched(lens, 66, ov, unit)
            out.append(f"{unit}/{ov}: q {q} {model(pp):6.1f}")
        print(f"  b={b:3d} s_k={sk:5d} +-{sp:2d}%  " + "  ".join(out))


if __name__ == "__main__":
    main()
