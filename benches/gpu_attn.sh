#!/usr/bin/env bash
# Nsight sections of the paged attention split kernel in one recorded target step (1 row), one
# 8-row verify and one 17-row verify: launch, occupancy, warp states, scheduler, memory. Expects
# bench-draft, xz-compressed, in out/carry.
# Usage: benches/gpu_attn.sh
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
for run in "step 7c" "verify 7c" "verify 16"; do
    set -- $run
    timeout 150 "$NCU" --clock-control none --cache-control none --profile-from-start off --graph-profiling node \
        -k regex:paged_attention --launch-count 2 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        out/bin/bench-draft --device cuda --dtype bf16 --layouts "$2" --weights bf16 --reps 1 --warmup 2 \
        --context 512 --profile "$1" > "$OUT/attn-$1-$2.txt" 2> "$OUT/attn-$1-$2.log"
    echo "ncu $1 $2 exit $?"
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp|No Eligible|Stall|Block Limit|Grid Size|Block Size|Memory Throughput|L2 Hit|DRAM Throughput" \
        "$OUT/attn-$1-$2.txt" | head -40
done
