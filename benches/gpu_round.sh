#!/usr/bin/env bash
# Device calls for one-sync rounds (the verify queued behind the draft round, reading its drafts
# on the device, and the draft's context extended by the whole window behind it) and the round
# after the FP8 W2 block-count change (issues 4 and 8). Expects
# prebuilt binaries, xz-compressed, in out/carry: bench-draft, bench-target, bench-kernels, and
# the gpu_kernels and gpu_golden test binaries, built with
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches \
#     -p dspark-kernels -p dspark --bins --test gpu_kernels --test gpu_golden
#   check: the 8B-shaped engine (one-sync rounds on by default) bit for bit against target-only,
#          recorded = op by op, FP8 drafts, the trained pair; the skinny GEMM tests with the
#          chosen W2 block counts (2 for bf16, 1 for FP8).
#   bench: draft rounds (bf16 and FP8 + FP8 head, γ = 7c and 16, context 512) with the two-read
#          propose + verify pair and the one-read round; the target step at 1 and 16 lanes with 8- and
#          16-row windows; the W2 products by block count; an ncu listing of one FP8 proposal.
#   repeat: the γ = 7c one-read rounds again, bf16 and FP8 + FP8 head, 30 repetitions, in both
#          orders of the weights (one process each), to tell noise from a cost of the bf16 round.
# Usage: benches/gpu_round.sh check|bench|repeat
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 330 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b recorded fp8 trained_pair \
        > "$OUT/gpu_golden-round.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|one-sync|tau|chi2|divergence|differ" "$OUT/gpu_golden-round.log" | cut -c1-200
    timeout 200 out/bin/gpu_kernels --test-threads=1 --nocapture skinny_gemm fp8 > "$OUT/gpu_kernels-round.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels-round.log"
    ;;
bench)
    timeout 220 out/bin/bench-draft --layouts 7c,16 --weights bf16,fp8h --reps 10 --context 512 \
        > "$OUT/bench_draft-round.md" 2> "$OUT/bench_draft-round.log"
    echo "bench-draft exit $?"; grep "| cuda" "$OUT/bench_draft-round.md" | cut -d'|' -f4,6,9-13,20-
    timeout 120 out/bin/bench-target --lanes 1,16 --context 512 --steps 10 --windows 8,16 \
        > "$OUT/bench_target-round.md" 2> "$OUT/bench_target-round.log"
    echo "bench-target exit $?"; grep "| cuda" "$OUT/bench_target-round.md"
    timeout 100 out/bin/bench-kernels --device cuda --plans-only --fp8 --mtiles 1,2 --only "markov W2" \
        --rows 1,8,16 > "$OUT/plans-w2-round.md" 2> "$OUT/plans-w2-round.log"
    echo "W2 exit $?"; grep "^| markov" "$OUT/plans-w2-round.md"
    ncu_fp8h_propose ncu-fp8h-round.csv
    ;;
repeat)
    for order in bf16,fp8h fp8h,bf16; do
        timeout 150 out/bin/bench-draft --layouts 7c --weights "$order" --reps 30 --context 512 \
            > "$OUT/bench_draft-repeat-${order/,/-}.md" 2> "$OUT/bench_draft-repeat-${order/,/-}.log"
        echo "bench-draft $order exit $?"; grep "| cuda" "$OUT/bench_draft-repeat-${order/,/-}.md" | cut -d'|' -f4,6,9-13,20-
    done
    ;;
esac
