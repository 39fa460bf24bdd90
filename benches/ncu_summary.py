#!/usr/bin/env python3
"""Summarise an Nsight Compute CSV of kernel durations (`ncu --csv --print-units base --metrics
gpu__time_duration.sum`): kernels grouped by name, in order of total time, with launches, total
and mean µs, share of the phase, and the phase's sum. With --graph, the rows are whole graph
launches (`--graph-profiling graph`) and the table is one line per graph.

Usage: ncu_summary.py FILE.csv [TITLE]
"""
import csv
import sys
from collections import OrderedDict


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            yield r


def main():
    path = sys.argv[1]
    title = sys.argv[2] if len(sys.argv) > 2 else path
    groups = OrderedDict()
    total = 0.0
    n = 0
    for r in rows(path):
        name = r["Kernel Name"]
        # ncu prints base units (ns) with --print-units base.
        t = float(r["Metric Value"].replace(",", "")) / 1e3
        g = groups.setdefault(name, [0, 0.0])
        g[0] += 1
        g[1] += t
        total += t
        n += 1
    print(f"### {title}: {n} launches, {total:.1f} µs of device time\n")
    print("| kernel | launches | total µs | mean µs | share |")
    print("|---|---|---|---|---|")
    for name, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        short = name if len(name) <= 70 else name[:67] + "..."
        print(f"| `{short}` | {c} | {t:.1f} | {t / c:.2f} | {100 * t / max(total, 1e-9):.1f}% |")
    print()


if __name__ == "__main__":
    main()
