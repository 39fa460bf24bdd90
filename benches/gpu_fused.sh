#!/usr/bin/env bash
# Device calls for results/2026-12-03-h200-fused.md: correctness first (the GPU kernel tests,
# then batch invariance at Qwen3-8B shapes and the trained pair through the whole CUDA path), then
# the decode step, the draft round, and the workloads with the lossless gate. Each phase runs
# under its own time limit. Expects prebuilt binaries, xz-compressed, in out/carry:
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches \
#       -p dspark-kernels -p dspark --bins --test gpu_kernels --test gpu_golden
#   strip + xz target/release/{bench-target,bench-draft,bench-workload} and the gpu_kernels and
#   gpu_golden test binaries (target/release/deps/gpu_*-*) into out/carry/ (the carry limit of
#   64 MiB may need two calls: `tests` and `benches`)
#   cp ../shared/prompts/*.jsonl out/prompts/
# Usage: benches/gpu_fused.sh tests|benches|workloads
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-tests}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
tests)
    echo "== kernels against plain burn and float64 (fused kernels and argmax first: the GEMM tests are long)"
    timeout 100 out/bin/gpu_kernels --test-threads=1 --nocapture rms_norm qk_norm swiglu argmax paged lm_head \
        > "$OUT/gpu_kernels.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels.log"
    echo "== batch invariance at Qwen3-8B shapes; the trained pair through the CUDA path"
    timeout 150 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b trained_pair > "$OUT/gpu_golden.log" 2>&1
    echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|qwen3-8b shapes|tau" "$OUT/gpu_golden.log"
    ;;
benches)
    timeout 100 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16,64 --context 16 --steps 10 \
        --windows 8,16 > "$OUT/bench_target.md" 2> "$OUT/bench_target.log"
    echo "bench-target exit $?"; cat "$OUT/bench_target.md"
    timeout 150 out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c,16 --context 64 --reps 20 \
        > "$OUT/bench_draft.md" 2> "$OUT/bench_draft.log"
    echo "bench-draft exit $?"; grep memory "$OUT/bench_draft.log"; cat "$OUT/bench_draft.md"
    ;;
workloads)
    timeout 200 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --prompts out/prompts \
        --prompts-per-file 1 --max-new-tokens 32 --workloads solo,team,busy --solo-requests 2 --team-lanes 8 \
        --busy-lanes 16 --sample-seeds 1 --sample-prompts 2 --gate-texts 1 --gate-text-tokens 32 \
        --out-md "$OUT/workload-8b.md" --out-json "$OUT/workload-8b.json" > "$OUT/workload-8b.log" 2>&1
    echo "workload 8b exit $?"
    timeout 350 out/bin/bench-workload --device cuda --dtype bf16 --target models/tiny-code-qwen3 \
        --draft models/tiny-code-dspark --prompts out/prompts --prompts-per-file 4 --max-new-tokens 128 \
        --workloads solo,team,busy --solo-requests 8 --team-lanes 16 --team-requests 16 --busy-lanes 16 \
        --sample-prompts 8 --sample-seeds 8 --gate-texts 4 \
        --out-md "$OUT/workload-pair.md" --out-json "$OUT/workload-pair.json" > "$OUT/workload-pair.log" 2>&1
    echo "workload pair exit $?"
    cat "$OUT/workload-8b.md" "$OUT/workload-pair.md" 2>/dev/null | grep -E "^\| (solo|team|busy) |Gate|FAIL"
    ;;
esac
