#!/usr/bin/env bash
# One device call for the kernels of dspark-kernels: correctness first (the GPU tests, against
# plain burn and a float64 host recomputation), then the skinny-GEMM timings beside cuBLAS on the
# same shapes, then the target-only decode step that uses the kernel. Each phase has its own time
# limit so that one slow phase cannot starve the others.
# Expects prebuilt binaries, xz-compressed, in out/carry:
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches --bins
#   CUDARC_CUDA_VERSION=13000 cargo test --release --features cuda -p dspark-kernels --test gpu_kernels --no-run
#   CUDARC_CUDA_VERSION=13000 cargo test --release --features cuda -p dspark --test gpu_golden --no-run
#   strip + xz target/release/{bench-kernels,bench-target} and the gpu_kernels (and, optionally,
#   gpu_golden) test binaries (target/release/deps/gpu_*-*) into out/carry/
# Usage: benches/gpu_kernels.sh [test seconds] [bench seconds] [decode seconds] [rows]
set -uo pipefail
OUT=${OUT:-out/results}
TEST_S=${1:-150}
BENCH_S=${2:-200}
DECODE_S=${3:-150}
ROWS=${4:-1,2,4,8,16,32,64}
mkdir -p "$OUT" out/bin
for f in out/carry/*.xz; do xz -dc "$f" > "out/bin/$(basename "$f" .xz)"; chmod +x "out/bin/$(basename "$f" .xz)"; done
export CUBECL_AUTOTUNE_LEVEL=minimal RUST_LOG=warn
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== GPU tests: kernels against plain burn and float64"
timeout "$TEST_S" out/bin/gpu_kernels --test-threads=1 --nocapture > "$OUT/gpu_kernels.log" 2>&1
echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked|error" "$OUT/gpu_kernels.log" | head -20

echo "== the trained pair in bf16 on CUDA through both kernels: speculative == target-only"
if [ -x out/bin/gpu_golden ]; then
    DSPARK_MODELS=$PWD/models DSPARK_GOLDEN=$PWD/dspark/tests/fixtures/golden timeout "$TEST_S" \
        out/bin/gpu_golden --test-threads=1 --nocapture cuda_bf16_trained_pair > "$OUT/gpu_golden_pair.log" 2>&1
    echo "gpu_golden (trained pair) exit $?"; grep -E "^test |test result|panicked|cuda bf16" "$OUT/gpu_golden_pair.log" | head -12
fi

echo "== skinny GEMM: kernel vs plain burn"
timeout "$BENCH_S" out/bin/bench-kernels --device cuda --rows "$ROWS" > "$OUT/bench_kernels.md" 2> "$OUT/bench_kernels.log"
echo "bench-kernels exit $?"; tail -3 "$OUT/bench_kernels.log"

echo "== cuBLAS on the same shapes"
timeout 90 python3 benches/cublas_gemm.py --rows "$ROWS" > "$OUT/cublas.md" 2> "$OUT/cublas.log"
echo "cublas exit $?"; tail -3 "$OUT/cublas.log"

echo "== target-only decode step, Qwen3-8B shapes, random bf16 weights (kernel on)"
timeout "$DECODE_S" out/bin/bench-target --device cuda --dtype bf16 --lanes 1,16 --context 8 --steps 10 \
    > "$OUT/bench_target.md" 2> "$OUT/bench_target.log"
echo "bench-target exit $?"; tail -3 "$OUT/bench_target.log"

echo; cat "$OUT/bench_kernels.md"; echo; cat "$OUT/cublas.md"; echo; cat "$OUT/bench_target.md"
