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
    gpu_test gpu_kernels 150 gpu_kernels.log paged_attention_matches_reference
    gpu_test gpu_golden 330 gpu_golden.log batch_invariant trained_pair_greedy qwen3_8b_shapes_recorded
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
        gpu_bench $bin 120 --device cuda --dtype bf16 --lanes 1,16,64 --context 512 --steps 20 --windows 8,16,17
    done
    for bin in bench-draft-old bench-draft; do
        gpu_bench $bin 150 --layouts 7c,16 --weights fp8h,bf16 --reps 20 --context 512
    done
    ;;
*)
    echo "usage: $0 check|bench" >&2
    exit 2
    ;;
esac
