#!/usr/bin/env bash
# Why the draft's small FP8 products stream below the card's bandwidth: Nsight sections of the
# first layer's four FP8 products (q/k/v, o, gate/up with the SwiGLU epilogue, down) of one
# FP8 + FP8-head γ = 7 proposal (graph nodes): speed of light, launch, occupancy, warp states,
# scheduler, memory workload, and the per-instruction SASS counters (stall sites), as text and
# a report under $OUT. Expects bench-draft, xz-compressed, in out/carry (see benches/gpu_env.sh).
# Usage: benches/gpu_fp8prof.sh
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)

timeout 200 "$NCU" --clock-control none --profile-from-start off --graph-profiling node \
    -k regex:fp8_gemm_kernel -c 4 --import-source no \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --print-details all -o "$OUT/fp8prof" \
    out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights fp8h --reps 2 \
    --warmup 3 --context 512 --profile propose > "$OUT/fp8prof.txt" 2>&1
echo "ncu fp8 products exit $?"
"$NCU" -i "$OUT/fp8prof.ncu-rep" --page source --print-source sass --csv > "$OUT/fp8prof-sass.csv" 2> /dev/null
echo "sass exit $? ($(wc -l < "$OUT/fp8prof-sass.csv") lines)"
grep -E "fp8_gemm_kernel|Duration|Grid Size|Registers Per|Achieved Occupancy|Waves Per SM|DRAM Throughput|Memory Throughput|L2 Hit|No Eligible|Issued Warp" \
    "$OUT/fp8prof.txt" | cut -c1-120 | head -60
