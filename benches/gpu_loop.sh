#!/usr/bin/env bash
# Device calls for the one-launch greedy Markov loop (`dspark_kernels::set_markov_loop`:
# a cube per SM for all γ steps, most of W2 kept in shared memory after step 0, a grid barrier
# between steps). Expects prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_env.sh):
# gpu_kernels and gpu_golden for `check`, bench-draft for `bench`.
#   check: gpu_kernels `markov_greedy_matches_unfused` (the loop's tokens = the unfused loop's bit
#          for bit, twice in a row: bf16, FP8 per-row and block-scaled W2, the whole vocabulary and
#          16 384 mapped ids, rank 256 and 128, 1–8 lanes, planted ties, NaN and a row with no
#          candidate); then gpu_golden with the switch on: the trained pair's greedy speculative
#          = target-only with the FP8 drafts' τ unchanged (3.128 / 3.077 / 2.533), and at
#          Qwen3-8B shapes the FP8 draft lossless on 4 lanes and recorded rounds = op by op.
#   bench: bench-draft γ = 7c and 16, FP8 + FP8 head, two-launch steps against the loop in one
#          process, twice (the second with the order reversed), 30 repetitions; then bf16 once.
#   min:   gpu_kernels' loop test and gpu_golden's FP8 tests with the loop on (the 8B-shape FP8
#          draft lossless on 4 lanes, the trained pair's FP8 drafts greedy equal), then `ncu`.
#   quick: bench-draft γ = 7c only, FP8 + FP8 head and bf16, two-launch steps against the loop
#          in one process each, 20 repetitions.
#   ab:    bench-draft-old (the previous build) against bench-draft, γ = 7c with the loop, 20
#          repetitions: FP8 + FP8 head old/new/new/old (so that drift shows), then bf16 old/new.
#   ncu:   the loop kernel's device time in one γ = 7 proposal (FP8 + FP8 head, then bf16) under
#          Nsight Compute, for each carried bench-draft* binary (e.g. bench-draft-old built from
#          the previous version beside bench-draft), one proposal each.
# Usage: benches/gpu_loop.sh check|min|bench|quick|ab|ncu|both
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

check() {
    gpu_test gpu_kernels 200 gpu_kernels-loop.log markov_greedy_matches_unfused
    grep -E "one-launch" "$OUT/gpu_kernels-loop.log" | cut -c1-160 | head -20
    DSPARK_GPU_SWITCHES=markov-loop gpu_test gpu_golden 300 gpu_golden-loop.log trained_pair_greedy \
        trained_pair_fp8 qwen3_8b_shapes_fp8 qwen3_8b_shapes_recorded
}

bench() {
    gpu_bench bench-draft 220 --layouts 7c,16 --weights fp8h --fused-markov on,loop --reps 30 --context 512
    gpu_bench bench-draft 220 --layouts 7c,16 --weights fp8h --fused-markov loop,on --reps 30 --context 512
    gpu_bench bench-draft 220 --layouts 7c,16 --weights bf16 --fused-markov on,loop --reps 20 --context 512
}

ncu_loop() {
    local ncu bin weights
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    for bin in out/bin/bench-draft*; do
        for weights in fp8h bf16; do
            timeout 150 "$ncu" --clock-control none --profile-from-start off --graph-profiling node \
                -k regex:markov_loop --metrics gpu__time_duration.sum --csv --print-units base \
                --log-file "$OUT/ncu-loop-$(basename "$bin")-$weights.csv" "$bin" --device cuda --dtype bf16 \
                --layouts 7c --weights "$weights" --reps 2 --warmup 3 --context 512 \
                --profile propose > /dev/null 2>&1
            echo "ncu $(basename "$bin") $weights exit $?"
            python3 benches/ncu_summary.py "$OUT/ncu-loop-$(basename "$bin")-$weights.csv" \
                "$(basename "$bin") $weights" | grep -E "^###|markov"
        done
    done
}

case "$PHASE" in
check) check ;;
bench) bench ;;
quick)
    gpu_bench bench-draft 150 --layouts 7c --weights fp8h --fused-markov on,loop --reps 20 --context 512
    gpu_bench bench-draft 150 --layouts 7c --weights bf16 --fused-markov on,loop --reps 20 --context 512
    ;;
ncu) ncu_loop ;;
ab)
    for bin in bench-draft-old bench-draft bench-draft bench-draft-old; do
        gpu_bench "$bin" 100 --layouts 7c --weights fp8h --fused-markov loop --reps 20 --context 512
    done
    for bin in bench-draft-old bench-draft; do
        gpu_bench "$bin" 100 --layouts 7c --weights bf16 --fused-markov loop --reps 20 --context 512
    done
    ;;
min)
    gpu_test gpu_kernels 200 gpu_kernels-loop.log markov_greedy_matches_unfused
    DSPARK_GPU_SWITCHES=markov-loop gpu_test gpu_golden 200 gpu_golden-loop.log trained_pair_fp8 qwen3_8b_shapes_fp8
    ncu_loop
    ;;
both) check; bench ;;
*)
    echo "usage: $0 check|min|bench|quick|ab|ncu|both" >&2
    exit 2
    ;;
esac
