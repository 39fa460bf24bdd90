#!/usr/bin/env bash
# Device calls for the recorded-forward (CUDA graph) results (issues 4, 8, 6): first the
# correctness checks (recorded target windows, draft extensions and rounds against op by op at
# Qwen3-8B shapes; the golden, trained-pair and batch-invariance suites, which now replay
# graphs), then draft rounds and target steps with graphs on and off in one process, then the
# Qwen3-8B-shaped workload. Expects prebuilt binaries, xz-compressed, in out/carry:
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches \
#       -p dspark-kernels -p dspark --bins --test gpu_kernels --test gpu_golden
#   strip + xz: `tests` and `suite` need the gpu_golden test binary (target/release/deps/gpu_golden-*),
#   `kernels` bench-kernels and bench-target, `benches` bench-draft, `workloads` bench-workload
#   cp ../shared/prompts/*.jsonl out/prompts/   (for `workloads`)
# Usage: benches/gpu_graphs.sh tests|suite|kernels|benches|workloads|memory
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-tests}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
tests)
    echo "== the split paged attention and the graph-input writes against their references"
    [ -x out/bin/gpu_kernels ] && timeout 100 out/bin/gpu_kernels --test-threads=1 --nocapture paged_attention graph_input \
        > "$OUT/gpu_kernels-graphs.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked|rel err" "$OUT/gpu_kernels-graphs.log"
    echo "== recorded forwards against op by op (Qwen3-8B shapes)"
    timeout 300 out/bin/gpu_golden --test-threads=1 --nocapture ${GOLDEN_TESTS:-recorded_forwards trained_pair qwen3_8b} \
        > "$OUT/gpu_golden-recorded.log" 2>&1
    echo "gpu_golden recorded exit $?"
    grep -E "^test |test result|panicked|differ|tau|chi2|draft:" "$OUT/gpu_golden-recorded.log" | cut -c1-300
    ;;
suite)
    echo "== the GPU golden suite, replaying graphs"
    timeout 300 out/bin/gpu_golden --test-threads=1 --nocapture --skip recorded_forwards --skip sampled \
        > "$OUT/gpu_golden-suite.log" 2>&1
    echo "gpu_golden suite exit $?"
    grep -E "^test |test result|panicked|tau|divergence" "$OUT/gpu_golden-suite.log" | cut -c1-200
    ;;
kernels)
    # Kernel device times inside graphs (no launch floor) beside the host-timed calls; the small
    # kernels of a layer; target steps at 1, 16 and 64 lanes and verify windows, graphs on.
    timeout 200 out/bin/bench-kernels --device cuda --rows 1,8,64 --iters 30 ${KERNEL_TABLES:---fp8} --anatomy --context 512 \
        > "$OUT/bench_kernels-graphs.md" 2> "$OUT/bench_kernels-graphs.log"
    echo "bench-kernels exit $?"; cat "$OUT/bench_kernels-graphs.md"
    timeout 150 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16,64 --context ${CONTEXT:-16} --steps 10 \
        > "$OUT/bench_target-graphs.md" 2> "$OUT/bench_target-graphs.log"
    echo "bench-target exit $?"; cat "$OUT/bench_target-graphs.md"
    ;;
benches)
    timeout 400 out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c,16 --weights ${WEIGHTS:-bf16,fp8} \
        --graphs ${GRAPHS:-on,off} --context ${CONTEXT:-64} --reps 20 > "$OUT/bench_draft-graphs.md" 2> "$OUT/bench_draft-graphs.log"
    echo "bench-draft exit $?"; grep -E "graphs|WARN|warn" "$OUT/bench_draft-graphs.log" | head; cat "$OUT/bench_draft-graphs.md"
    ;;
workloads)
    timeout 300 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens 64 --workloads solo,team \
        --solo-requests 2 --team-lanes 8 --sample-seeds 1 --sample-prompts 2 --gate-texts 1 \
        --gate-text-tokens 32 --out-md "$OUT/workload-8b-graphs.md" --out-json "$OUT/workload-8b-graphs.json" \
        > "$OUT/workload-8b-graphs.log" 2>&1
    echo "workload exit $?"; grep -E "^\| (solo|team|busy) |peak memory|Gate" "$OUT/workload-8b-graphs.md"
    ;;
memory)
    # The memory bound with the graph limits and padded shapes (issue 6 item 3, issue 8 item 3):
    # team and busy workloads with an FP8 draft, then the team workload with the FP8 LM head;
    # the GPU cost table (issue 6 item 4) needs bench-cost-table in out/carry as well.
    for head in "" "--draft-fp8-head"; do
        name=workload-8b-memory${head:+-fp8h}
        workloads=team,busy; [ -n "$head" ] && workloads=team
        timeout 240 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 $head \
            --prompts out/prompts --prompts-per-file 1 --max-new-tokens 64 --workloads $workloads \
            --team-lanes 8 --busy-lanes 16 --sample-seeds 0 --gate-texts 1 --gate-text-tokens 32 \
            --out-md "$OUT/$name.md" --out-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "$name exit $?"; grep -E "^\| (solo|team|busy) |peak memory|Gate" "$OUT/$name.md"
    done
    if [ -x out/bin/bench-cost-table ]; then
        timeout 200 out/bin/bench-cost-table --device cuda --dtype bf16 --target random:qwen3-8b \
            --draft random --gamma 7 --lanes 1,4,16 --context 64 --warmup 2 --reps 3 --passes 1 \
            --machine "NVIDIA H200" --out "$OUT/cuda-qwen3-8b-bf16.json" > "$OUT/cost-table.md" 2> "$OUT/cost-table.log"
        echo "cost table exit $?"; head -30 "$OUT/cost-table.md"
    fi
    ;;
esac
