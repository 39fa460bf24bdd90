#!/usr/bin/env bash
# Device calls for the workload benchmark and the GPU cost table (one phase per call, each under
# its own time limit: every benchmark child process pays NVRTC compilation of its kernels).
# Expects prebuilt binaries, xz-compressed, in out/carry, and the standard prompts copied to
# out/prompts (never committed):
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches --bins
#   strip + xz target/release/{bench-workload,bench-cost-table} into out/carry/
#   cp ../shared/prompts/*.jsonl out/prompts/
# Usage: benches/gpu_workload.sh pair|qwen3-8b [seconds]
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-pair}
LIMIT=${2:-560}
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export CUBECL_AUTOTUNE_LEVEL=minimal RUST_LOG=warn
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - start) )); }

case "$PHASE" in
pair)
    # The trained pair in f32 on the H200: measured (not implied) speedups, solo and team.
    timeout $(( $(left) - 150 )) out/bin/bench-workload --device cuda --dtype f32 \
        --target models/tiny-code-qwen3 --draft models/tiny-code-dspark --prompts out/prompts \
        --prompts-per-file 2 --max-new-tokens 96 --workloads solo,team --solo-requests 4 \
        --team-lanes 8 --team-requests 8 --sample-prompts 4 --sample-seeds 2 --gate-texts 2 \
        --out-md "$OUT/workload-pair.md" --out-json "$OUT/workload-pair.json" > "$OUT/workload-pair.log" 2>&1
    echo "workload pair exit $?"; tail -4 "$OUT/workload-pair.log"
    # Target verify-step cost table at Qwen3-8B shapes (random bf16 weights), γ = 7 grid.
    timeout $(( $(left) - 5 )) out/bin/bench-cost-table --device cuda --dtype bf16 --target random:qwen3-8b \
        --draft random --gamma 7 --lanes 1,4,16 --context 64 --warmup 2 --reps 3 --passes 1 \
        --machine "NVIDIA H200" --out "$OUT/cuda-qwen3-8b-bf16.json" > "$OUT/cost-table.md" 2> "$OUT/cost-table.log"
    echo "cost table exit $?"; cat "$OUT/cost-table.md" | head -40; tail -3 "$OUT/cost-table.log"
    ;;
qwen3-8b)
    # Qwen3-8B shapes, random bf16 weights: memory of each mode at the same KV budget (busy),
    # round costs (τ is meaningless with random weights).
    timeout $(( $(left) - 5 )) out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens 16 --workloads solo,busy \
        --solo-requests 1 --team-lanes 8 --busy-lanes 8 --sample-seeds 0 --gate-texts 1 --gate-text-tokens 32 \
        --out-md "$OUT/workload-8b.md" --out-json "$OUT/workload-8b.json" > "$OUT/workload-8b.log" 2>&1
    echo "workload 8b exit $?"; tail -6 "$OUT/workload-8b.log"
    ;;
esac
cat "$OUT"/*.md 2>/dev/null | head -80
