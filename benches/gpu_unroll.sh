#!/usr/bin/env bash
# Device call for the wide unroll (chunks in flight per warp for 17–32 rows: the choice, 2,
# against 4; results/2026-12-05-h100-unroll.md, where the build's own choice was 4). Expects prebuilt binaries, xz-compressed, in out/carry: bench-target and the
# gpu_kernels and gpu_golden test binaries (see benches/gpu_round.sh for the build command).
#   1. correctness first: the skinny GEMM tests (references, batch invariance, the plans) and
#      the Qwen3-8B-shaped engine's batch invariance (4 lanes of windows: 17–32 rows per product);
#   2. the target's windows of 8–32 rows with each cap, and with one weight block per cube.
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
timeout 200 out/bin/gpu_kernels --test-threads=1 --nocapture skinny_gemm fp8 > "$OUT/gpu_kernels-unroll.log" 2>&1
echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels-unroll.log" | cut -c1-160
timeout 200 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b_shapes_are_batch_invariant \
    > "$OUT/gpu_golden-unroll.log" 2>&1
echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|divergence|differ" "$OUT/gpu_golden-unroll.log" | cut -c1-160
for u in 2 4; do
    timeout 90 out/bin/bench-target --lanes 1 --context 512 --steps 10 --windows 8,16,17,24,32 \
        --unroll-wide "$u" > "$OUT/bench_target-unroll-$u.md" 2> "$OUT/bench_target-unroll-$u.log"
    echo "bench-target unroll $u exit $?"; grep "| cuda" "$OUT/bench_target-unroll-$u.md"
done
timeout 90 out/bin/bench-target --lanes 1 --context 512 --steps 10 --windows 17,24,32 --mtiles 1 \
    > "$OUT/bench_target-unroll-1block.md" 2> /dev/null
echo "bench-target 1 block exit $?"; grep "| cuda" "$OUT/bench_target-unroll-1block.md"
