#!/usr/bin/env bash
# Device calls for the tensor-core attention's cp.async staging (the next key block copied into
# a second shared buffer without passing through registers: 168 registers a thread instead of
# 246, three cubes an SM instead of two). Expects prebuilt binaries, xz-compressed, in out/carry:
# gpu_kernels and gpu_golden for `check`; bench-target, bench-draft and their `-old` builds (the
# commit before) for `bench`.
#   check: gpu_kernels `paged_attention_matches_reference` (float64 reference, every grouping
#          and each lane alone bit for bit, both split kernels); gpu_golden at Qwen3-8B shapes:
#          one forward = windows = batched, speculative = target-only, recorded = op by op, and
#          the trained pair's greedy speculative = target-only; then Nsight's launch statistics
#          of the split kernel in a 17-row verify (registers as the driver compiled them).
#   bench: bench-target (1, 16, 64 lanes; windows of 8, 16, 17 rows) and bench-draft (γ 7c and
#          16, bf16 and FP8 + FP8 head), old and new interleaved.
# Usage: benches/gpu_cpasync.sh check|bench
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 150 out/bin/gpu_kernels --test-threads=1 --nocapture paged_attention_matches_reference \
        > "$OUT/gpu_kernels.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked|rel err" "$OUT/gpu_kernels.log" | cut -c1-200
    timeout 330 out/bin/gpu_golden --test-threads=1 --nocapture batch_invariant trained_pair_greedy \
        qwen3_8b_shapes_recorded > "$OUT/gpu_golden.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|tau|differ|lossless" "$OUT/gpu_golden.log" | cut -c1-200
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 90 "$NCU" --clock-control none --cache-control none --profile-from-start off --graph-profiling node \
        -k regex:paged_attention --launch-count 2 --section LaunchStats --section Occupancy \
        --section SpeedOfLight out/bin/bench-draft --device cuda --dtype bf16 --layouts 16 --weights bf16 \
        --reps 1 --warmup 2 --context 512 --profile verify > "$OUT/ncu-verify-17.txt" 2> "$OUT/ncu-verify-17.log"
    echo "ncu exit $?"
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Grid Size" \
        "$OUT/ncu-verify-17.txt" | head -20
    ;;
bench)
    for bin in bench-target-old bench-target bench-target-old bench-target; do
        n=$((${n:-0} + 1))
        timeout 120 out/bin/$bin --device cuda --dtype bf16 --lanes 1,16,64 --context 512 --steps 20 \
            --windows 8,16,17 > "$OUT/$n-$bin.md" 2> "$OUT/$n-$bin.log"
        echo "$bin exit $?"
        grep -E "^\| cuda" "$OUT/$n-$bin.md" | cut -c1-200
    done
    for bin in bench-draft-old bench-draft; do
        n=$((n + 1))
        timeout 150 out/bin/$bin --layouts 7c,16 --weights fp8h,bf16 --reps 20 --context 512 \
            > "$OUT/$n-$bin.md" 2> "$OUT/$n-$bin.log"
        echo "$bin exit $?"
        grep -E "^\| cuda" "$OUT/$n-$bin.md" | cut -c1-260
    done
    ;;
*)
    echo "usage: $0 check|bench" >&2
    exit 2
    ;;
esac
