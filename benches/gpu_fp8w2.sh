#!/usr/bin/env bash
# Device calls for the FP8 Markov W2 (branch exp/fp8-w2; issue 8). Expects prebuilt binaries,
# xz-compressed, in out/carry (bench-kernels, bench-draft, and the gpu_kernels and gpu_golden
# test binaries; see benches/gpu_fp8.sh for the build).
#   check: the FP8 kernel with several weight blocks per cube and one warp per chunk against
#          one block and float64 (the W2 shape among them), and the bf16 skinny GEMM tests (the
#          unroll cap touches both kernels); FP8 drafts through the CUDA path at Qwen3-8B
#          shapes and on the trained pair (tau with the FP8 W2).
#   bench: W2 products in FP8 and bf16 by weight blocks per cube; the FP8 layer shapes with more
#          blocks per cube; draft rounds bf16 / FP8 + FP8 head at context 512; an ncu listing
#          of one FP8 + FP8-head proposal.
# Usage: benches/gpu_fp8w2.sh check|bench
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    timeout 300 out/bin/gpu_kernels --test-threads=1 --nocapture fp8 skinny_gemm > "$OUT/gpu_kernels-fp8w2.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked|blocks per cube" "$OUT/gpu_kernels-fp8w2.log"
    timeout 330 out/bin/gpu_golden --test-threads=1 --nocapture fp8 qwen3_8b trained_pair \
        > "$OUT/gpu_golden-fp8w2.log" 2>&1
    echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|tau|chi2|divergence|differ" "$OUT/gpu_golden-fp8w2.log"
    ;;
bench)
    timeout 100 out/bin/bench-kernels --device cuda --plans-only --fp8 --mtiles 1,2,4,8 --only "markov W2" \
        --rows 1,8,16 > "$OUT/plans-w2.md" 2> "$OUT/plans-w2.log"
    echo "W2 exit $?"; grep "^| markov" "$OUT/plans-w2.md"
    timeout 120 out/bin/bench-kernels --device cuda --plans-only --fp8 --mtiles 2,4 --plans 2x4 \
        --only "q/o,qkv,down,gate+up" --rows 8 > "$OUT/plans-layer.md" 2> "$OUT/plans-layer.log"
    echo "layer exit $?"; grep "^| [a-z]" "$OUT/plans-layer.md"
    timeout 200 out/bin/bench-draft --layouts 7c,16 --weights bf16,fp8h --reps 10 --context 512 \
        > "$OUT/bench_draft-fp8w2.md" 2> "$OUT/bench_draft-fp8w2.log"
    echo "bench-draft exit $?"; grep "| cuda" "$OUT/bench_draft-fp8w2.md" | cut -d'|' -f2-15,20-
    ncu_fp8h_propose ncu-fp8h.csv
    ;;
esac
