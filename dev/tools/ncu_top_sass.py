#!/usr/bin/env python3
"""Top SASS lines of an Nsight Compute source page by warp stall samples.

Reads the CSV of `ncu --import REP --page source --csv --print-source sass`
on stdin (one row per SASS instruction) and prints the N lines with the most
"Warp Stall Sampling (All Samples)", with their stall-reason columns that are
nonzero, plus the totals per stall reason. Usage:
  ncu --import r.ncu-rep --page source --csv --print-source sass | ncu_top_sass.py [N]
"""
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rows = [r for r in csv.reader(sys.stdin)]
    # the header is the first row naming a stall-sampling column
    hi = next((i for i, r in enumerate(rows) if any("Sampling" in c for c in r)), None)
    if hi is None:
        print("no stall-sampling column; first rows:")
        for r in rows[:5]:
            print(r)
        return 1
    head = rows[hi]
    body = [r for r in rows[hi + 1:] if len(r) == len(head)]
    col_all = next(i for i, c in enumerate(head) if "Sampling (All" in c)
    col_src = next((i for i, c in enumerate(head) if c.strip() in ("Source", "# Source")), 1)
    col_addr = next((i for i, c in enumerate(head) if "Address" in c), 0)
    stall_cols = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != col_all]
    total = sum(num(r[col_all]) for r in body)
    print(f"{len(body)} SASS lines, {total:.0f} stall samples; columns: {len(head)}")
    sums = {head[i]: sum(num(r[i]) for r in body) for i in stall_cols}
    for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:16]:
        if v > 0:
            print(f"  {k}: {v:.0f} ({100 * v / max(total, 1):.1f} %)")
    body.sort(key=lambda r: -num(r[col_all]))
    for r in body[:n]:
        parts = [f"{head[i]}={r[i]}" for i in stall_cols if num(r[i]) > 0]
        print(f"{num(r[col_all]):7.0f} {100 * num(r[col_all]) / max(total, 1):5.1f}% {r[col_addr]} {r[col_src][:70]} | "
              + " ".join(parts[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
