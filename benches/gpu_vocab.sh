#!/usr/bin/env bash
# Device calls for the draft vocabulary (`DSparkDraft::restrict_vocab`, issue 8): a draft that
# proposes only K tokens reads only their LM-head rows and Markov `W2` rows.
# Expects prebuilt binaries, xz-compressed, in out/carry: gpu_golden and bench-draft (see
# benches/gpu_round.sh for the build).
#   check: gpu_golden `trained_pair_fp8`, `fp8_draft_sampled` and `qwen3_8b_shapes_fp8`: the trained
#          pair's draft (bf16; FP8 + FP8 head) restricted to 2048 of 4096 tokens gives
#          target-only greedy output (τ beside the whole vocabulary's); the golden pair's FP8
#          draft restricted to 64 of 512 tokens samples the target's distribution (χ²); the
#          Qwen3-8B-shaped FP8 + FP8-head draft, whole and restricted to 32 768 of 151 936
#          tokens, is lossless on 4 lanes.
#   bench: bench-draft, γ = 7c and 16, bf16 and FP8 + FP8 head, whole vocabulary against the
#          first 32 768 ids (one process); then γ = 7c FP8 + FP8 head at 16 384 and 65 536.
#   repeat: γ = 7c FP8 + FP8 head, whole vocabulary against 32 768 and 16 384 ids, 30
#          repetitions, in both orders (one process each), to tell the gain from noise.
# Usage: benches/gpu_vocab.sh check|bench|repeat
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 300 out/bin/gpu_golden --test-threads=1 --nocapture trained_pair_fp8 fp8_draft_sampled qwen3_8b_shapes_fp8 \
        > "$OUT/gpu_golden-vocab.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|tau|chi2|divergence|MiB" "$OUT/gpu_golden-vocab.log" | cut -c1-200
    ;;
bench)
    timeout 200 out/bin/bench-draft --layouts 7c,16 --weights fp8h,bf16 --draft-vocab 0,32768 --reps 10 \
        --context 512 > "$OUT/bench_draft-vocab.md" 2> "$OUT/bench_draft-vocab.log"
    echo "bench-draft exit $?"; grep "| cuda" "$OUT/bench_draft-vocab.md" | cut -d'|' -f4,6,8,9,10,13,22-
    timeout 100 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab 16384,65536 --reps 10 \
        --context 512 > "$OUT/bench_draft-vocab2.md" 2> "$OUT/bench_draft-vocab2.log"
    echo "bench-draft exit $?"; grep "| cuda" "$OUT/bench_draft-vocab2.md" | cut -d'|' -f4,6,8,9,10,13,22-
    ;;
repeat)
    for order in 0,32768,16384 16384,32768,0; do
        timeout 140 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab "$order" --reps 30 \
            --context 512 > "$OUT/bench_draft-vocab-${order//,/-}.md" 2> "$OUT/bench_draft-vocab-${order//,/-}.log"
        echo "bench-draft $order exit $?"
        grep "| cuda" "$OUT/bench_draft-vocab-${order//,/-}.md" | cut -d'|' -f4,6,8,9,10,13,22-
    done
    ;;
esac
