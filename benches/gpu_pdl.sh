#!/usr/bin/env bash
# Device calls for programmatic dependent launch in recorded graphs
# (`dspark_kernels::set_programmatic_launch`, `dspark-kernels/src/cuda/pdl.rs`). Expects prebuilt
# binaries, xz-compressed, in out/carry (see benches/gpu_env.sh): gpu_golden for `check`,
# bench-draft (and bench-draft-old, the build before, for `ab`) for the timings.
#   check: gpu_golden with the switch on (then with `pdl-early`: products load their first
#          weights before the wait): at Qwen3-8B shapes recorded forwards = op by op and
#          the FP8 draft lossless on 4 lanes (every round through recorded graphs with
#          programmatic edges), then the trained pair's greedy tests.
#   bench: bench-draft γ = 7c, FP8 + FP8 head, 20 repetitions: PDL early, trigger, off, early
#          (one process each: the switch applies to graphs recorded after it is set).
#   ab:    bench-draft-old against bench-draft with PDL off, then on (same layout).
#   pipe:  bench-draft γ = 7c, FP8 + FP8 head: PDL early, pipelined products, PDL off, both,
#          PDL trigger (one process each), then, while the call has time left, gpu_golden's
#          recorded, FP8 and batch-invariance tests with `pdl-early` and with `pipelined`.
#   nopf:  bench-draft as in `pipe` with the products' L2 prefetch off (`--prefetch off`):
#          PDL early, off, trigger, early, off; the results packed into one archive.
# Usage: benches/gpu_pdl.sh check|bench|ab|all|pipe|nopf
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

check() {
    DSPARK_GPU_SWITCHES=pdl gpu_test gpu_golden 240 gpu_golden-pdl.log qwen3_8b_shapes_recorded \
        qwen3_8b_shapes_fp8 trained_pair_greedy
    grep -E "kernel switch|PDL|programmatic" "$OUT/gpu_golden-pdl.log" | head -5
    DSPARK_GPU_SWITCHES=pdl-early gpu_test gpu_golden 240 gpu_golden-pdl-early.log qwen3_8b_shapes_recorded \
        qwen3_8b_shapes_fp8 qwen3_8b_shapes_are_batch_invariant
}

draft() {
    gpu_bench "$1" 150 --layouts 7c --weights fp8h --reps 20 --context 512 "${@:2}"
    grep -E "^PDL" "$OUT/$GPU_BENCH_RUNS-$1.md"
    echo "(${SECONDS} s into the call)"
}

# gpu_golden's recorded = op by op, FP8 lossless and batch-invariance tests with switch $1, if
# the call has more than 200 s left of its 580 (SECONDS counts from the script's start).
checked() {
    if [ $((580 - SECONDS)) -lt 200 ]; then
        echo "no time left for gpu_golden with $1"
        return
    fi
    DSPARK_GPU_SWITCHES=$1 gpu_test gpu_golden $((570 - SECONDS)) "gpu_golden-$1.log" \
        qwen3_8b_shapes_recorded qwen3_8b_shapes_fp8 qwen3_8b_shapes_are_batch_invariant
}

case "$PHASE" in
check) check ;;
bench) for p in early trigger off early; do draft bench-draft --pdl "$p"; done ;;
ab) draft bench-draft-old; draft bench-draft --pdl off; draft bench-draft --pdl on ;;
pipe)
    draft bench-draft --pdl early
    draft bench-draft --pipeline on
    draft bench-draft --pdl off
    draft bench-draft --pdl early --pipeline on
    draft bench-draft --pdl trigger
    checked pdl-early
    checked pipelined
    ;;
nopf)
    draft bench-draft --pdl early --prefetch off
    draft bench-draft --pdl off
    draft bench-draft --pdl trigger --prefetch off
    draft bench-draft --pdl early --prefetch off
    draft bench-draft --pdl off
    tar czf /tmp/nopf.tgz -C "$OUT" . && rm -f "$OUT"/* && mv /tmp/nopf.tgz "$OUT"/
    ;;
all) check; for p in off early; do draft bench-draft --pdl "$p"; done; draft bench-draft-old ;;
*)
    echo "usage: $0 check|bench|ab|all" >&2
    exit 2
    ;;
esac
