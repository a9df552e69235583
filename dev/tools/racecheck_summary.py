#!/usr/bin/env python3
"""Count compute-sanitizer racecheck reports by (kind, access sites).

Reads a racecheck log (default "analysis" report or --racecheck-report
hazard) and prints each distinct pair of source sites with its number of
reports, most frequent first. Usage: racecheck_summary.py LOG
"""
import collections
import re
import sys


def main():
    lines = open(sys.argv[1]).read().split("\n")
    count = collections.Counter()
    site = re.compile(r"(Write|Read)\w* (?:access|Thread[^a]*?) at (?:.*? )?\S+?\+0x[0-9a-f]+ in (\S+:\d+)")
    for i, line in enumerate(lines):
        if "Error:" not in line or ("Race" not in line and "hazard" not in line):
            continue
        sites = []
        for j in range(i, min(i + 8, len(lines))):
            if j > i and "Error:" in lines[j]:
                break
            sites += [m.group(1) + "@" + m.group(2) for m in site.finditer(lines[j])]
        kind = re.search(r"Potential (\w+) hazard", line)
        count[(kind.group(1) if kind else "race", tuple(sites[:2]))] += 1
    for key, n in count.most_common():
        print(n, key[0], " vs ".join(key[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
