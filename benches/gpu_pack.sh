#!/usr/bin/env bash
# Device calls for the draft round's packed readback (`dspark_kernels::tokens_and_confidence_logits`:
# the confidence kernel writes the tokens as f32 beside its logits, so a recorded round ends
# without a cast and a concatenation). Expects prebuilt binaries, xz-compressed, in out/carry
# (see benches/gpu_round.sh for the build): gpu_kernels and gpu_golden for `check`; bench-draft
# and bench-draft-base (the same bench built from the commit before, for the A/B) for `bench`.
#   check: gpu_kernels `confidence_logits_match_reference` (the packed form = the tokens as f32
#          and the same launch's logits, bit for bit); gpu_golden: the trained pair's greedy
#          speculative = target-only, the 8B-shape FP8 draft lossless and recorded rounds = op
#          by op, and the sampled device acceptance = the host chain.
#   bench: bench-draft γ = 7c FP8 + FP8 head and γ = 7c bf16, before and after, interleaved.
# Usage: benches/gpu_pack.sh check|bench
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 120 out/bin/gpu_kernels --test-threads=1 --nocapture confidence_logits_match_reference \
        > "$OUT/gpu_kernels-pack.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked" "$OUT/gpu_kernels-pack.log" | cut -c1-200
    timeout 300 out/bin/gpu_golden --test-threads=1 --nocapture trained_pair_greedy trained_pair_fp8 \
        qwen3_8b_shapes_fp8 qwen3_8b_shapes_recorded sampled_device_acceptance > "$OUT/gpu_golden-pack.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|tau|differ|lossless" "$OUT/gpu_golden-pack.log" | cut -c1-200
    ;;
bench)
    for bin in bench-draft-base bench-draft bench-draft-base bench-draft; do
        n=$((${n:-0} + 1))
        timeout 150 out/bin/$bin --layouts 7c --weights fp8h,bf16 --reps 30 --context 512 \
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
