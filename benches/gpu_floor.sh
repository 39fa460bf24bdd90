#!/usr/bin/env bash
# Device calls of results/2026-12-05-h100-floor.md: the floor of a one-row step's launch
# structure, where the step's time above it goes, and the two small-kernel switches it led to.
# Expects prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_round.sh for the build);
# each phase names the ones it runs (a call carries at most about three).
#   floor  bench-kernels --floor (bare streaming reads of the step's weight sizes and one-cube
#          launches, in graphs) and bench-target at one lane, 512 keys.     [bench-kernels, bench-target]
#   ncu    Nsight per role of one step and one 8-row verify (benches/ncu_layer.py), and the
#          duration Nsight gives a one-cube launch.                          [bench-draft, bench-kernels]
#   small  Nsight sections (launch, occupancy, warp state, scheduler, memory) of one row's norm,
#          K/V store, attention and combine in a recorded step.             [bench-draft]
#   chunk  bench-target and bench-draft with the fewest keys of an attention split at 32, 64,
#          128 (and 32 again).                                               [bench-target, bench-draft]
#   norm   the norm kernel test at every cube size, bench-target with 256, 1024, 512, 256, 1024
#          norm threads, and the 8B-shape gpu_golden tests with 1024.        [gpu_kernels, gpu_golden, bench-target]
#   draft  bench-draft γ = 7 FP8 + FP8 head with the default norm cube and with 256 threads.  [bench-draft]
# A call returns at most 8 files: the phases append to one file each.
# Usage: benches/gpu_floor.sh floor|ncu|small|chunk|norm|draft
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-floor}
. "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}

case "$PHASE" in
floor)
    timeout 200 out/bin/bench-kernels --device cuda --floor > "$OUT/floor.md" 2> "$OUT/floor.log"
    echo "floor exit $?"; grep -E "^\| (one-cube|the step|reads)|^\| [a-zA-Z/ ]+ \| [0-9.]+ \| [0-9]+ \| 8 \|" "$OUT/floor.md"
    timeout 120 out/bin/bench-target --device cuda --dtype bf16 --lanes 1 --context 512 --steps 20 \
        > "$OUT/bench_target.md" 2> "$OUT/bench_target.log"
    echo "bench-target exit $?"; cat "$OUT/bench_target.md"
    ;;
ncu)
    ncu_step_verify
    timeout 100 "$NCU" --clock-control none --cache-control none --graph-profiling node -k regex:tick_kernel \
        --launch-count 10 --metrics gpu__time_duration.sum --csv --print-units base --log-file "$OUT/ncu-tick.csv" \
        out/bin/bench-kernels --device cuda --floor --floor-cubes 528 > /dev/null 2>&1
    echo "ncu tick exit $?"; python3 benches/ncu_summary.py "$OUT/ncu-tick.csv" tick | head -8
    ;;
small)
    timeout 240 "$NCU" --clock-control none --cache-control none --profile-from-start off --graph-profiling node \
        -k "regex:rms_norm|paged_attention_mma|combine|qkv_store" --launch-skip 5 --launch-count 6 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights bf16 --reps 2 --warmup 3 \
        --context 512 --profile step > "$OUT/ncu-small.txt" 2>&1
    echo "ncu exit $?"
    grep -E "^  [a-z_]+_kernel|Duration|Registers Per|Occupancy|Block Size|Grid Size|Issued Warp|L2 Hit|SM Active" \
        "$OUT/ncu-small.txt" | head -80
    ;;
chunk)
    for c in 32 64 128 32; do
        timeout 100 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16 --context 512 --steps 20 \
            --windows 8,16 --attn-min-chunk "$c" >> "$OUT/bench_target-chunk.md" 2>> "$OUT/bench_target-chunk.log"
        echo "bench-target $c exit $?"; tail -n 12 "$OUT/bench_target-chunk.md" | grep "| cuda" | cut -d'|' -f5-9
    done
    for c in 32 64 128; do
        timeout 120 out/bin/bench-draft --layouts 7c --weights fp8h,bf16 --reps 20 --context 512 --attn-min-chunk "$c" \
            >> "$OUT/bench_draft-chunk.md" 2>> "$OUT/bench_draft-chunk.log"
        echo "bench-draft $c exit $?"; grep "| cuda" "$OUT/bench_draft-chunk.md" | tail -2 | cut -d'|' -f6,7,9,10,13,24-
    done
    ;;
norm)
    timeout 100 out/bin/gpu_kernels --test-threads=1 --nocapture rms_norm_kernels_match_reference \
        > "$OUT/gpu_kernels.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked|norm cube|d 4096 rows 1:" "$OUT/gpu_kernels.log"
    for t in 256 1024 512 256 1024; do
        timeout 100 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16 --context 512 --steps 20 \
            --windows 8,16 --norm-threads "$t" >> "$OUT/target.md" 2>> "$OUT/target.log"
        echo "bench-target $t exit $?"; tail -n 12 "$OUT/target.md" | grep "| cuda" | cut -d'|' -f5-9
    done
    DSPARK_GPU_SWITCHES=norm-threads-1024 timeout 200 out/bin/gpu_golden --test-threads=1 --nocapture \
        qwen3_8b_shapes_are_batch_invariant recorded_forwards trained_pair_greedy > "$OUT/gpu_golden.log" 2>&1
    echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|switch|differ|divergence|tau" "$OUT/gpu_golden.log" | cut -c1-160
    ;;
draft)
    for t in 1024 256; do
        timeout 80 out/bin/bench-draft --layouts 7c --weights fp8h --reps 20 --context 512 --norm-threads "$t" \
            >> "$OUT/draft.md" 2>> "$OUT/draft.log"
        echo "bench-draft $t exit $?"; grep "| cuda" "$OUT/draft.md" | tail -1 | cut -d'|' -f6,7,9,10,13,20,24-
    done
    ;;
esac
