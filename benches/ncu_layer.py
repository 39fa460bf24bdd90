#!/usr/bin/env python3
"""Per-role durations of a decoder layer's launches from an Nsight Compute CSV of one target step
(`ncu --graph-profiling node --metrics gpu__time_duration.sum --csv --print-units base`).

Each skinny GEMM launch is named by its neighbours in launch order: the one before the K/V store
(or a prefetch) is the q/k/v product, the one after the attention combine the o projection,
a GEMM followed by a GEMM the gate/up product, and the one after it the down projection. Other
kernels keep their names. Prints launches, mean and total µs per role.

Usage: ncu_layer.py FILE.csv [TITLE]
"""
import csv
import re
import sys
from collections import OrderedDict


def launches(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    out = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            name = re.sub(r"_[0-9a-f]{8}$", "", r["Kernel Name"].split("(")[0].strip())
            out.append((name, float(r["Metric Value"].replace(",", "")) / 1e3))
    return out


def role(seq, i):
    name = seq[i][0]
    if not name.startswith("skinny_gemm"):
        return name
    prev = seq[i - 1][0] if i > 0 else ""
    nxt = seq[i + 1][0] if i + 1 < len(seq) else ""
    if prev.startswith("combine"):
        return "gemm: o"
    if nxt.startswith("qkv_store") or nxt.startswith("prefetch"):
        return "gemm: q/k/v"
    if nxt.startswith("skinny_gemm"):
        return "gemm: gate/up"
    if prev.startswith("skinny_gemm"):
        return "gemm: down"
    return "gemm: other"


def main():
    path = sys.argv[1]
    title = sys.argv[2] if len(sys.argv) > 2 else path
    seq = launches(path)
    groups = OrderedDict()
    for i, (_, t) in enumerate(seq):
        g = groups.setdefault(role(seq, i), [0, 0.0])
        g[0] += 1
        g[1] += t
    total = sum(t for _, t in seq)
    print(f"### {title}: {len(seq)} launches, {total:.1f} µs\n")
    print("| role | launches | mean µs | total µs |")
    print("|---|---|---|---|")
    for name, (c, t) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {c} | {t / c:.2f} | {t:.1f} |")
    print()


if __name__ == "__main__":
    main()
