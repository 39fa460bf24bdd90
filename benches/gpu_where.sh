#!/usr/bin/env bash
# Where the time of one recorded target step, one 8-row verify and one FP8 + FP8-head γ = 7
# proposal goes, per kernel under Nsight Compute (graph nodes), on whatever card the call gets:
# the per-role table of benches/ncu_layer.py for the step and the verify, the per-kernel table
# of benches/ncu_summary.py for the proposal. Expects bench-draft, xz-compressed, in out/carry.
# Usage: benches/gpu_where.sh
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
for phase in step verify; do
    timeout 200 "$NCU" --clock-control none --cache-control none --profile-from-start off --graph-profiling node \
        --metrics gpu__time_duration.sum --csv --print-units base --log-file "$OUT/ncu-$phase.csv" \
        out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights bf16 --reps 2 --warmup 3 \
        --context 512 --profile "$phase" > /dev/null 2> "$OUT/ncu-$phase.log"
    echo "ncu $phase exit $?"; python3 benches/ncu_layer.py "$OUT/ncu-$phase.csv" "$phase" | tee -a "$OUT/ncu.md"
done
ncu_fp8h_propose ncu-fp8h.csv | tee -a "$OUT/ncu.md"
