#!/usr/bin/env bash
# Where the one-launch Markov loop and the rest of a proposal spend their time, on whatever card
# the call gets. Expects bench-draft, xz-compressed, in out/carry (see benches/gpu_env.sh).
#   1. Each launch of one FP8 + FP8-head γ = 7 proposal (graph nodes): duration, DRAM bytes read
#      and grid, as CSV ($OUT/ncu-fp8h.csv) and summed per kernel.
#   2. The loop kernel alone, FP8 and then bf16 W2: speed of light, occupancy, warp states,
#      scheduler, instruction and memory sections, and the per-instruction SASS counters (top
#      stall sites), as text under $OUT.
# Usage: benches/gpu_loopprof.sh
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)

timeout 150 "$NCU" --clock-control none --profile-from-start off --graph-profiling node \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
    --csv --print-units base --log-file "$OUT/ncu-fp8h.csv" out/bin/bench-draft --device cuda --dtype bf16 \
    --layouts 7c --weights fp8h --reps 2 --warmup 3 --context 512 --profile propose > /dev/null 2>&1
echo "ncu propose exit $?"
python3 benches/ncu_summary.py "$OUT/ncu-fp8h.csv" "fp8h propose" | head -30

for weights in fp8h bf16; do
    timeout 150 "$NCU" --clock-control none --profile-from-start off --graph-profiling node \
        -k regex:markov_loop_kernel -c 1 --import-source no \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
        --section SourceCounters --print-details all -o "$OUT/loop-$weights" \
        out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights "$weights" --reps 2 \
        --warmup 3 --context 512 --profile propose > "$OUT/loop-$weights.txt" 2>&1
    echo "ncu loop $weights exit $?"
    "$NCU" -i "$OUT/loop-$weights.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/loop-$weights-sass.csv" 2> /dev/null
    echo "sass $weights exit $? ($(wc -l < "$OUT/loop-$weights-sass.csv") lines)"
    grep -E "Duration|Registers|Achieved Occupancy|Issued Warp|No Eligible|Stall|Executed Ipc|Memory Throughput" \
        "$OUT/loop-$weights.txt" | head -40
done
