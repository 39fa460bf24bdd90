#!/usr/bin/env bash
# One device call: correctness on CUDA first (golden checks, f32 and bf16), then timings.
# Expects prebuilt binaries, xz-compressed to fit the transfer limit, in out/carry (built here
# in one invocation so features unify):
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda --all-targets \
#       -p dspark -p dspark-benches -p dspark-examples
#   out/carry/gpu_golden.xz   <- target/release/deps/gpu_golden-*
#   out/carry/bench-target.xz <- target/release/bench-target
set -uo pipefail
OUT=${OUT:-out/results}
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"

echo "== golden checks on CUDA"
out/bin/gpu_golden --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu_golden.log"

echo "== bf16 yardstick: transformers bf16 vs f32 on the golden target"
python3 benches/bf16_reference.py 2>&1 | tee "$OUT/bf16_reference.log"

echo "== target-only decode, Qwen3-8B shapes, random bf16 weights"
out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16,64 --context 128 --steps 20 2>&1 | tee "$OUT/bench_target.md"
