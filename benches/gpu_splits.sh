#!/usr/bin/env bash
# Device calls for the skinny GEMMs' cuts along the reduction axis (issues 4 and 8): the plan
# tests first (every plan, bf16 and FP8, against float64 and for batch invariance), then every
# plan timed inside graphs on every Qwen3-8B / DSpark shape (`bench-kernels --plans-only`).
# Expects prebuilt binaries, xz-compressed, in out/carry (see gpu_graphs.sh for the build):
#   `sweep` needs gpu_kernels (target/release/deps/gpu_kernels-*) and bench-kernels.
# Usage: benches/gpu_splits.sh sweep
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-sweep}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
sweep)
    echo "== skinny GEMM kernels (every plan) against float64, batch invariance"
    timeout 200 out/bin/gpu_kernels --test-threads=1 --nocapture skinny_gemm fp8_gemm \
        > "$OUT/gpu_kernels-plans.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels-plans.log"
    grep -E "^plan .*rows=1:" "$OUT/gpu_kernels-plans.log" | head -20
    echo "== plans timed in graphs"
    timeout 300 out/bin/bench-kernels --device cuda --rows ${ROWS:-1,8,16,64} --iters 30 --fp8 --plans-only \
        --plans ${PLANS:-1x2,1x4,1x8,2x4,2x8,4x4,4x8,8x4,8x8} \
        > "$OUT/bench_kernels-plans.md" 2> "$OUT/bench_kernels-plans.log"
    echo "bench-kernels exit $?"; cat "$OUT/bench_kernels-plans.md"
    ;;
esac
