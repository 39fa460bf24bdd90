#!/usr/bin/env bash
# Device calls: where a draft round's and a target step's time goes (issues 4 and 8).
#   tests  the kernels changed for it against their references (split paged attention in
#          launches of ≤ 64 rows with keys in flight; the two-pass argmax; RMSNorm), the recorded
#          forwards against op by op, batch invariance and the FP8 draft's losslessness at
#          Qwen3-8B shapes, the trained pair's greedy equality (bf16 and FP8 drafts);
#   times  bench-draft (7c and 16, bf16 and fp8h, graphs on) with the host time inside each of
#          the library's spans (`--spans`), and bench-target at 1, 16 and 64 lanes (with
#          MTILES_AB=1, again at 1 and 16 lanes with one weight block per GEMM cube);
#   ncu    one phase of bench-draft (7c, graphs on) at a time inside a profiling window under
#          Nsight Compute: each kernel's device time (`--graph-profiling node`), and each
#          recorded graph's whole device time (`--graph-profiling graph`: kernels plus the gaps
#          between them). Caches are not flushed between kernels (`--cache-control none`), as
#          in a replay.
# Raw files are packed into $OUT/profile-raw-PHASES.tgz (a device call returns at most 8 files).
# Expects in out/carry (xz): gpu_kernels and gpu_golden (target/release/deps/*) for `tests`,
# bench-draft and bench-target for `times` and `ncu`.
#   memory the team workload's peak device memory, speculative (FP8 draft) vs target-only
#          (bench-workload, needs out/prompts).
#   gate   the workload benchmark's full gate (solo, team, busy) with the FP8 draft (SAMPLE_SEEDS=N adds
#          N sampled replies per prompt for SAMPLE_PROMPTS prompts; needs
#          out/prompts).
#   record the one-lane γ=7 round's recording, in several processes (PROCESSES, default 3).
# Usage: benches/gpu_profile.sh tests|times|ncu|memory|record|gate ...
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
RAW="$OUT/raw"; mkdir -p "$RAW"

for PHASE in "$@"; do case "$PHASE" in
tests)
    echo "== split paged attention, two-pass argmax, RMSNorm against their references"
    timeout 120 out/bin/gpu_kernels --test-threads=1 --nocapture ${KERNEL_TESTS:-paged_attention argmax rms_norm} > "$RAW/gpu_kernels.log" 2>&1
    echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked|rel err" "$RAW/gpu_kernels.log"
    echo "== recorded forwards = op by op, batch invariance, FP8 draft lossless (Qwen3-8B shapes); trained pair"
    [ -x out/bin/gpu_golden ] && timeout ${GOLDEN_TIMEOUT:-300} out/bin/gpu_golden --test-threads=1 --nocapture ${GOLDEN_TESTS:-recorded_forwards trained_pair qwen3_8b} \
        > "$RAW/gpu_golden.log" 2>&1
    echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|differ|tau|draft:" "$RAW/gpu_golden.log" | cut -c1-250
    ;;
times)
    echo "== bench-draft with host spans"
    timeout 240 out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c,16 --weights bf16,fp8h --reps 20 --spans \
        > "$OUT/bench_draft.md" 2> "$RAW/bench_draft.log"
    echo "bench-draft exit $?"; grep -E "^\| cuda|^\| device|^###|^\| .(propose|graph|target|extend)|wall" "$OUT/bench_draft.md"
    echo "== bench-target"
    timeout 150 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16,64 --context ${CONTEXT:-512} --steps 10 \
        > "$OUT/bench_target.md" 2> "$RAW/bench_target.log"
    echo "bench-target exit $?"; cat "$OUT/bench_target.md"
    if [ -n "${MTILES_AB:-}" ]; then
        echo "== bench-target, one weight block per GEMM cube (A/B of the two-block choice)"
        timeout 150 out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16 --context ${CONTEXT:-512} --steps 10 \
            --mtiles 1 > "$OUT/bench_target-1block.md" 2> "$RAW/bench_target-1block.log"
        echo "bench-target (1 block) exit $?"; cat "$OUT/bench_target-1block.md"
    fi
    ;;
ncu)
    echo "== kernels of one phase (ncu: $NCU)"
    # weights:phase:modes (node: each kernel; graph: each whole replay)
    for spec in ${PHASES:-bf16:propose:node,graph fp8h:propose:node bf16:step:node,graph}; do
        IFS=: read -r w phase modes <<< "$spec"
        for mode in ${modes//,/ }; do
            name="ncu-$w-$phase-$mode"
            timeout 150 "$NCU" --clock-control none --cache-control ${CACHE:-none} --profile-from-start off \
                --graph-profiling $mode --metrics gpu__time_duration.sum --csv --print-units base \
                --log-file "$RAW/$name.csv" \
                out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights "$w" --reps 2 --warmup 3 \
                --profile "$phase" > /dev/null 2> "$RAW/$name.log"
            echo "ncu $w $phase $mode exit $?"
            python3 benches/ncu_summary.py "$RAW/$name.csv" "$w $phase ($mode)" >> "$OUT/ncu.md"
        done
    done
    grep -E "^###|^\| \`" "$OUT/ncu.md" | cut -c1-120 | head -${TOP:-80}
    ;;
record)
    # The one-lane γ=7 round recorded in separate processes (a recording failure is logged as a
    # warning "could not record this forward"; the round then runs op by op on that call).
    for i in $(seq 1 ${PROCESSES:-3}); do
        timeout 120 out/bin/bench-draft --device cuda --dtype bf16 --layouts 7c --weights bf16 --reps 10 \
            > "$RAW/record-$i.md" 2> "$RAW/record-$i.log"
        echo "process $i exit $?: $(grep -c 'could not record' "$RAW/record-$i.log") recording failures"
        grep -E "^\| cuda" "$RAW/record-$i.md" | cut -d'|' -f9-17
    done
    ;;
gate)
    # The workload benchmark's full gate at Qwen3-8B shapes (issue 6): solo, team (8 lanes) and
    # busy (16 lanes, KV budget nearly full), speculative with the FP8 draft against target-only.
    echo "== workload gate: solo, team, busy"
    timeout ${GATE_TIMEOUT:-420} out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens ${GATE_TOKENS:-48} --workloads solo,team,busy --solo-requests 2 \
        --team-lanes 8 --busy-lanes 16 --sample-seeds ${SAMPLE_SEEDS:-0} --sample-prompts ${SAMPLE_PROMPTS:-4} --gate-texts 1 --gate-text-tokens 32 \
        --out-md "$OUT/workload-gate.md" --out-json "$RAW/workload-gate.json" > "$RAW/workload-gate.log" 2>&1
    echo "workload exit $?"; grep -E "^\| (solo|team|busy) |peak memory|Gate" "$OUT/workload-gate.md" | cut -c1-400 | head -20
    ;;
memory)
    echo "== team workload's peak memory, speculative (FP8 draft) against target-only"
    timeout 200 out/bin/bench-workload --device cuda --dtype bf16 --shape qwen3-8b --draft-fp8 \
        --prompts out/prompts --prompts-per-file 1 --max-new-tokens 64 --workloads team --team-lanes 8 \
        --sample-seeds 0 --gate-texts 1 --gate-text-tokens 32 \
        --out-md "$OUT/workload-memory.md" --out-json "$RAW/workload-memory.json" > "$RAW/workload-memory.log" 2>&1
    echo "workload exit $?"; grep -E "^\| (team|busy) |peak memory|overhead" "$OUT/workload-memory.md" | head -20
    grep -E "memory after|MiB" "$RAW/workload-memory.log" | tail -20
    ;;
esac; done
# One archive per invocation (phases in the name): a second invocation in the same call keeps the first one's logs.
tar czf "$OUT/profile-raw-$(echo "$@" | tr " " "-").tgz" -C "$OUT" raw && rm -rf "$RAW"
