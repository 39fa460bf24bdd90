#!/usr/bin/env bash
# Device calls for the skinny GEMMs' cuts along the reduction axis (issues 4 and 8): the plan
# tests first (every plan, bf16 and FP8, against float64 and for batch invariance), then every
# plan timed inside graphs on every Qwen3-8B / DSpark shape (`bench-kernels --plans-only`).
# Expects prebuilt binaries, xz-compressed, in out/carry (see gpu_graphs.sh for the build):
#   `sweep` needs gpu_kernels (target/release/deps/gpu_kernels-*) and bench-kernels;
#   `check` needs gpu_golden, bench-cost-table and bench-workload (and out/prompts): the padded
#   verify windows against op by op at Qwen3-8B shapes, the GPU cost table with every shape
#   recorded, and the team workload's memory bound.
# Usage: benches/gpu_splits.sh sweep|check
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
check)
    timeout 100 out/bin/gpu_golden --test-threads=1 --nocapture recorded_forwards \
        > "$OUT/gpu_golden-recorded.log" 2>&1
    echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|differ" "$OUT/gpu_golden-recorded.log" | cut -c1-200
    timeout 200 out/bin/bench-cost-table --device cuda --dtype bf16 --target random:qwen3-8b --draft random \
        --gamma 7 --lanes 1,4,8 --context 64 --warmup 2 --reps 3 --passes 1 --machine "NVIDIA H200" \
        --out "$OUT/h200-qwen3-8b-bf16.json" > "$OUT/cost-table.md" 2> "$OUT/cost-table.log"
    echo "cost table exit $?"; head -30 "$OUT/cost-table.md"
    timeout 170 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens 64 --workloads team --team-lanes 8 \
        --sample-seeds 0 --gate-texts 1 --gate-text-tokens 32 \
        --out-md "$OUT/workload-8b-memory.md" --out-json "$OUT/workload-8b-memory.json" \
        > "$OUT/workload-8b-memory.log" 2>&1
    echo "workload exit $?"; grep -E "^\| (team|busy) |peak memory" "$OUT/workload-8b-memory.md"
    ;;
esac
