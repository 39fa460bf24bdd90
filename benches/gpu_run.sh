#!/usr/bin/env bash
# One device call: the decode benchmark, then the CUDA golden checks, each under its own time
# limit so that one slow phase (first-use kernel compilation) cannot starve the other.
# Expects prebuilt binaries, xz-compressed to fit the transfer limit, in out/carry (built here
# in one invocation so features unify):
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda --all-targets \
#       -p dspark -p dspark-benches -p dspark-examples
#   out/carry/gpu_golden.xz   <- target/release/deps/gpu_golden-*
#   out/carry/bench-target.xz <- target/release/bench-target
# Usage: benches/gpu_run.sh [bench seconds] [golden seconds] [golden test filter...]
set -uo pipefail
OUT=${OUT:-out/results}
BENCH_S=${1:-320}
GOLDEN_S=${2:-240}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"

echo "== target-only decode, Qwen3-8B shapes, random bf16 weights"
timeout "$BENCH_S" out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16 --context 32 --steps 16 \
    > "$OUT/bench_target.md" 2> "$OUT/bench_target.log"
echo "bench exit $?"; cat "$OUT/bench_target.md"; tail -5 "$OUT/bench_target.log"

echo "== golden checks on CUDA"
timeout "$GOLDEN_S" out/bin/gpu_golden --test-threads=1 --nocapture "$@" 2>&1 | tee "$OUT/gpu_golden.log"
