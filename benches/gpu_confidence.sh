#!/usr/bin/env bash
# Device calls for the confidence head on the device (`dspark_kernels::confidence_logits`,
# issue 8): a draft round reads back γ confidence logits a lane instead of its γ hidden rows, and
# the host makes no dot products after the read.
# Expects prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_round.sh for the
# build): gpu_kernels and gpu_golden for `check`, bench-draft for `bench`.
#   check: gpu_kernels `confidence_logits_match_reference` (the kernel against the plain-burn
#          body and f64, DSpark widths, 1–4 lanes of γ 7 and 16, with and without the Markov
#          term); gpu_golden at Qwen3-8B shapes (recorded draft rounds = op by op, confidences
#          bit for bit; the host head's confidences within 1e-5, the same drafts), the trained
#          pair's greedy speculative = target-only (bf16 and FP8 drafts), and the device
#          acceptance of sampled rounds.
#   bench: bench-draft γ = 7c, FP8 + FP8 head and bf16, whole vocabulary and 16 384 ids, the
#          head on the device against the host, 30 repetitions, one process; then the spans of
#          one proposal each way (`propose_finish` is the host's work after the read).
# Usage: benches/gpu_confidence.sh check|bench
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 120 out/bin/gpu_kernels --test-threads=1 --nocapture confidence_logits_match_reference \
        > "$OUT/gpu_kernels-confidence.log" 2>&1
    echo "gpu_kernels exit $?"
    grep -E "^test |test result|panicked" "$OUT/gpu_kernels-confidence.log" | cut -c1-200
    timeout 420 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b_shapes_recorded trained_pair \
        device_acceptance > "$OUT/gpu_golden-confidence.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|tau|differ|confidences" "$OUT/gpu_golden-confidence.log" | cut -c1-200
    ;;
bench)
    timeout 300 out/bin/bench-draft --layouts 7c --weights fp8h,bf16 --draft-vocab 0,16384 \
        --confidence device,host --reps 30 --context 512 > "$OUT/bench_draft-confidence.md" \
        2> "$OUT/bench_draft-confidence.log"
    echo "bench-draft exit $?"; grep "| cuda" "$OUT/bench_draft-confidence.md" | cut -d'|' -f4,6,8,9,10,13,22-
    timeout 150 out/bin/bench-draft --layouts 7c --weights fp8h --draft-vocab 16384 --confidence device,host \
        --reps 20 --context 512 --spans > "$OUT/bench_draft-confidence-spans.md" 2>> "$OUT/bench_draft-confidence.log"
    echo "bench-draft --spans exit $?"
    grep -E "span: propose \(|propose_finish|propose_readback|wall" "$OUT/bench_draft-confidence-spans.md" | head -12
    ;;
esac
