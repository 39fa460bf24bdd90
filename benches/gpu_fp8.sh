#!/usr/bin/env bash
# Device calls for results/2026-12-03-h200-fp8.md (issue 8): the FP8 kernel against float64 and
# plain burn, FP8 drafts through the whole CUDA path (greedy equality, the sampled distribution,
# Qwen3-8B shapes), then the FP8 GEMM beside the bf16 one, draft rounds with bf16 / FP8 / FP8 +
# FP8-head drafts, and the Qwen3-8B-shaped workload with an FP8 draft (the memory bound of
# issue 6). Expects prebuilt binaries, xz-compressed, in out/carry:
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches \
#       -p dspark-kernels -p dspark --bins --test gpu_kernels --test gpu_golden
#   strip + xz: `tests` needs the gpu_kernels and gpu_golden test binaries
#   (target/release/deps/gpu_*-*), `benches` bench-kernels, bench-draft and bench-workload
#   cp ../shared/prompts/*.jsonl out/prompts/   (for `benches`)
# Usage: benches/gpu_fp8.sh tests|benches|workloads|busy
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-tests}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
tests)
    echo "== the FP8 kernel against float64 and plain burn; batch invariance"
    timeout 150 out/bin/gpu_kernels --test-threads=1 --nocapture fp8_gemm > "$OUT/gpu_kernels-fp8.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels-fp8.log"
    grep -E "rows=(1|64|130):" "$OUT/gpu_kernels-fp8.log" | head -30
    echo "== FP8 drafts through the CUDA path; the bf16 trained pair as before"
    timeout 250 out/bin/gpu_golden --test-threads=1 --nocapture fp8 trained_pair_greedy \
        > "$OUT/gpu_golden-fp8.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|tau|chi2|MiB|divergence" "$OUT/gpu_golden-fp8.log"
    ;;
benches)
    timeout 200 out/bin/bench-kernels --device cuda --fp8 --rows 1,8,16,64 --iters 30 \
        > "$OUT/bench_kernels-fp8.md" 2> "$OUT/bench_kernels-fp8.log"
    echo "bench-kernels exit $?"; cat "$OUT/bench_kernels-fp8.md"
    timeout 200 out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c,16 --weights bf16,fp8,fp8h \
        --context 64 --reps 20 > "$OUT/bench_draft-fp8.md" 2> "$OUT/bench_draft-fp8.log"
    echo "bench-draft exit $?"; grep -E "memory|quantised" "$OUT/bench_draft-fp8.log"; cat "$OUT/bench_draft-fp8.md"
    ;;
workloads)
    # Qwen3-8B shapes, random weights: the speculative engine's memory above target-only with an
    # FP8 draft drawn on the host (as an FP8 checkpoint loads), with and without the FP8 LM head.
    for head in "--draft-fp8-head" ""; do
        name=workload-8b-fp8${head:+h}
        timeout 240 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 $head \
            --prompts out/prompts --prompts-per-file 1 --max-new-tokens 32 --workloads solo,team \
            --solo-requests 2 --team-lanes 8 --sample-seeds 1 --sample-prompts 2 --gate-texts 1 \
            --gate-text-tokens 32 --out-md "$OUT/$name.md" --out-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "$name exit $?"; grep -E "draft in FP8" "$OUT/$name.log" | head -2
        grep -E "^\| (solo|team|busy) |peak memory|Gate" "$OUT/$name.md"
    done
    ;;
busy)
    # The busy workload alone (KV budget nearly full, 16 lanes) with the FP8 draft, gate without
    # sampled replies: what fits in the last minutes of a device session.
    timeout 140 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens 32 --workloads busy --busy-lanes 16 \
        --sample-seeds 0 --gate-texts 1 --gate-text-tokens 32 --out-md "$OUT/workload-8b-fp8-busy.md" \
        --out-json "$OUT/workload-8b-fp8-busy.json" > "$OUT/workload-8b-fp8-busy.log" 2>&1
    echo "busy exit $?"; grep -E "^\| busy |peak memory|Gate" "$OUT/workload-8b-fp8-busy.md"
    ;;
esac
