#!/usr/bin/env bash
# One device call: correctness on CUDA first (golden checks, f32 and bf16), then timings.
# Expects prebuilt, stripped binaries in out/bin (built here with CUDARC_CUDA_VERSION=13000):
#   out/bin/gpu_golden   (cargo test --release --features cuda -p dspark --test gpu_golden --no-run)
#   out/bin/bench-target (cargo build --release --features cuda -p dspark-benches)
set -uo pipefail
OUT=${OUT:-out/results}
mkdir -p "$OUT"
export DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"

echo "== golden checks on CUDA"
out/bin/gpu_golden --test-threads=1 --nocapture 2>&1 | tee "$OUT/gpu_golden.log"

echo "== bf16 yardstick: transformers bf16 vs f32 on the golden target"
python3 benches/bf16_reference.py 2>&1 | tee "$OUT/bf16_reference.log"

echo "== target-only decode, Qwen3-8B shapes, random bf16 weights"
out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16,64 --context 128 --steps 20 2>&1 | tee "$OUT/bench_target.md"
