#!/usr/bin/env bash
# Device calls for the fused greedy Markov steps (`dspark_kernels::set_fused_markov`: each step
# the W2 product with an argmax epilogue, then one pick that writes the token and gathers the
# next W1 row; two launches a step instead of four). Expects prebuilt binaries, xz-compressed,
# in out/carry (see benches/gpu_round.sh for the build): gpu_kernels and gpu_golden for `check`,
# bench-draft for `bench`.
#   check: gpu_kernels `markov_greedy_matches_unfused` (fused = unfused tokens bit for bit: bf16,
#          FP8 per-row and block-scaled W2, the whole vocabulary and 16 384 mapped ids, 1–9
#          lanes, planted ties, NaN and a row with no candidate); then gpu_golden with the switch
#          on: the trained pair's greedy speculative = target-only with τ equal to the unfused
#          runs' (3.154 / 2.585 / 3.128 / 3.077 / 2.533), and at Qwen3-8B shapes the FP8 draft
#          lossless on 4 lanes and recorded rounds = op by op.
#   bench: bench-draft γ = 7c, FP8 + FP8 head, unfused against fused, one process for the whole
#          vocabulary and one for 16 384 ids, 30 repetitions; then γ = 7c and 16 with bf16
#          weights (issue 4's bf16 proposal).
# Usage: benches/gpu_markov.sh check|bench
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 150 out/bin/gpu_kernels --test-threads=1 --nocapture markov_greedy_matches_unfused \
        > "$OUT/gpu_kernels-markov.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked|markov_greedy" "$OUT/gpu_kernels-markov.log" | cut -c1-200
    DSPARK_GPU_SWITCHES=fused-markov timeout 420 out/bin/gpu_golden --test-threads=1 --nocapture trained_pair_greedy \
        trained_pair_fp8 qwen3_8b_shapes_fp8 qwen3_8b_shapes_recorded > "$OUT/gpu_golden-markov.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|kernel switch|tau|differ|lossless" "$OUT/gpu_golden-markov.log" | cut -c1-200
    ;;
bench)
    for vocab in 0 16384; do
        timeout 200 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab "$vocab" \
            --fused-markov off,on --reps 30 --context 512 \
            > "$OUT/bench_draft-markov-vocab$vocab.md" 2> "$OUT/bench_draft-markov-vocab$vocab.log"
        echo "bench-draft vocab $vocab exit $?"
        grep -E "^\| (fp8h|bf16)" "$OUT/bench_draft-markov-vocab$vocab.md" | cut -c1-220
    done
    timeout 200 out/bin/bench-draft --layouts 7c,16 --weights bf16 --fused-markov off,on --reps 20 --context 512 \
        > "$OUT/bench_draft-markov-bf16.md" 2> "$OUT/bench_draft-markov-bf16.log"
    echo "bench-draft bf16 exit $?"
    grep -E "^\| (fp8h|bf16)" "$OUT/bench_draft-markov-bf16.md" | cut -c1-220
    ;;
*)
    echo "usage: $0 check|bench" >&2
    exit 2
    ;;
esac
