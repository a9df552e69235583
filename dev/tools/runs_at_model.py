#!/usr/bin/env python3
"""The schedule trial's step 1 (src/cuda/step.cu runs_at) in two forms, checked equal.

For every request r of a batch and a budget Q, where the greedy walk's run from
request r's beginning closes (nb[r]; bs: at the end) and after how many parts
(steps[r]). `walk` is main's per-thread walk (visits followed request by
request, a binary search where cuts are sparse). `split` is the form of
dev/cuda/variants/s40-sched-warp-runs.patch: the same walk capped at 16 steps,
then, for runs still open, a scan of the following requests in order (on the
device: 32 per ballot, one warp per open run), each tested with a division for
its first visit, and the parts recomputed from the request the run closes at.

Random batches (mixed, uniform, short and zero lengths; piece costs 0-8) and
budgets; asserts both forms agree on every run and prints how many went open.

    python3 dev/tools/runs_at_model.py
"""
import random


def cdiv(a, b):
    return -((-a) // b)


def locate(C, bs, s):
    """Request r with C[r] <= s < C[r+1], or bs past the end."""
    lo, hi = 0, bs
    while lo < hi:
        mid = (lo + hi) >> 1
        if C[mid + 1] <= s:
            lo = mid + 1
        else:
            hi = mid
    return lo


def walk(C, bs, total, OV, Q, r, cap=None):
    """(land, steps), or ('open', q) once cap steps are taken (every request in (r, q) passed)."""
    base = C[r] + OV
    y, land, q, left = base + Q, bs, r + 1, cap
    while q < bs:
        if cap is not None:
            left -= 1
            if left < 0:
                return ('open', q)
        cq, cn = C[q], C[q + 1]
        if y >= cn:
            q = locate(C, bs, y)
            continue
        if y < cq:
            gap = cq - y
            y += (Q if gap <= Q else 2 * Q) if gap <= 2 * Q else cdiv(gap, Q) * Q
        if y <= min(cq + OV, cn - 1):
            land = q
            break
        q += 1
    steps = (y - base) // Q if land < bs else max(1, cdiv(total - base, Q))
    return (land, steps)


def split(C, bs, total, OV, Q, r):
    first = walk(C, bs, total, OV, Q, r, cap=16)
    if first[0] != 'open':
        return first
    base, land = C[r] + OV, bs
    for q in range(first[1], bs):
        cq, cn = C[q], C[q + 1]
        y = base + max(cdiv(cq - base, Q), 1) * Q  # the first visit at or past q's beginning
        if y <= min(cq + OV, cn - 1):
            land = q
            break
    return (land, max(1, cdiv(C[land] - C[r] - OV, Q)))


def main():
    rng = random.Random(1)
    runs = opened = 0
    for _ in range(3000):
        bs, OV, kind = rng.randint(1, 300), rng.choice([0, 1, 5, 5, 5, 8]), rng.randint(0, 3)
        if kind == 0:
            kv = [rng.choice([0, rng.randint(1, 5000)]) for _ in range(bs)]
        elif kind == 1:
            kv = [rng.randint(0, 20000) for _ in range(bs)]
        elif kind == 2:
            kv = [rng.randint(4096, 12288) for _ in range(bs)]
        else:
            kv = [rng.randint(0, 100) for _ in range(bs)]
        C = [0]
        for k in kv:
            C.append(C[-1] + cdiv(k, 64) + OV)
        total = C[-1]
        if total == 0:
            continue
        budgets = {rng.randint(1, total) for _ in range(3)} | {max(1, cdiv(total, rng.randint(1, 132)))}
        for Q in budgets:
            for r in range(bs):
                a, b = walk(C, bs, total, OV, Q, r), split(C, bs, total, OV, Q, r)
                assert a == b, (bs, OV, Q, r, a, b)
                runs += 1
                opened += walk(C, bs, total, OV, Q, r, cap=16)[0] == 'open'
    print(f"equal on {runs} runs ({opened} went past the 16-step walk)")


if __name__ == '__main__':
    main()
