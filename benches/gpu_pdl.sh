#!/usr/bin/env bash
# Device calls for programmatic dependent launch in recorded graphs
# (`dspark_kernels::set_programmatic_launch`, `dspark-kernels/src/cuda/pdl.rs`). Expects prebuilt
# binaries, xz-compressed, in out/carry (see benches/gpu_env.sh): gpu_golden for `check`,
# bench-draft (and bench-draft-old, the build before, for `ab`) for the timings.
#   check: gpu_golden with the switch on: at Qwen3-8B shapes recorded forwards = op by op and
#          the FP8 draft lossless on 4 lanes (every round through recorded graphs with
#          programmatic edges), then the trained pair's greedy tests.
#   bench: bench-draft γ = 7c, FP8 + FP8 head, 20 repetitions: PDL trigger, off, on, off, trigger
#          (one process each: the switch applies to graphs recorded after it is set).
#   ab:    bench-draft-old against bench-draft with PDL off, then on (same layout).
# Every phase packs what it wrote under $OUT into one archive ($OUT/pdl.tgz): a call returns
# only a few files.
# Usage: benches/gpu_pdl.sh check|bench|ab|all
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

check() {
    DSPARK_GPU_SWITCHES=pdl gpu_test gpu_golden 240 gpu_golden-pdl.log qwen3_8b_shapes_recorded \
        qwen3_8b_shapes_fp8 trained_pair_greedy
    grep -E "kernel switch|PDL|programmatic" "$OUT/gpu_golden-pdl.log" | head -5
}

draft() {
    gpu_bench "$1" 150 --layouts 7c --weights fp8h --reps 20 --context 512 "${@:2}"
    grep -E "^PDL" "$OUT/$GPU_BENCH_RUNS-$1.md"
    echo "(${SECONDS} s into the call)"
}

case "$PHASE" in
check) check ;;
bench) for p in trigger off on off trigger; do draft bench-draft --pdl "$p"; done ;;
ab) draft bench-draft-old; draft bench-draft --pdl off; draft bench-draft --pdl on ;;
all) check; for p in off trigger; do draft bench-draft --pdl "$p"; done; draft bench-draft-old ;;
*)
    echo "usage: $0 check|bench|ab|all" >&2
    exit 2
    ;;
esac
tar czf /tmp/pdl.tgz -C "$OUT" . && rm -f "$OUT"/* && mv /tmp/pdl.tgz "$OUT"/
