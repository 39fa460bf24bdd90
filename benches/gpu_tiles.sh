#!/usr/bin/env bash
# Device call for the tile padding (bf16 products of 17–24 rows launched as four activation tiles
# of 8 rows instead of three; `dspark_kernels::set_tile_padding`, off by default until this ran). Expects prebuilt binaries, xz-compressed, in out/carry:
# bench-target and the gpu_kernels and gpu_golden test binaries (see benches/gpu_round.sh).
#   1. correctness first: skinny GEMM batch invariance with the padding off and on (rows of
#      17-row calls against one call of 130) and the fused SwiGLU product; the Qwen3-8B-shaped
#      engine's batch invariance (the library's default);
#   2. the target's windows of 16–32 rows with and without the padding, in one process each.
set -uo pipefail
OUT=${OUT:-out/results}
. "$(dirname "$0")/gpu_env.sh"
timeout 120 out/bin/gpu_kernels --test-threads=1 --nocapture batch_invariant linear_swiglu \
    > "$OUT/gpu_kernels-tiles.log" 2>&1
echo "gpu_kernels exit $?"; grep -E "^test |test result|panicked" "$OUT/gpu_kernels-tiles.log" | cut -c1-160
timeout 120 out/bin/gpu_golden --test-threads=1 --nocapture qwen3_8b_shapes_are_batch_invariant \
    > "$OUT/gpu_golden-tiles.log" 2>&1
echo "gpu_golden exit $?"; grep -E "^test |test result|panicked|differ" "$OUT/gpu_golden-tiles.log" | cut -c1-160
for pad in on off; do
    timeout 80 out/bin/bench-target --lanes 1 --context 512 --steps 10 --windows 16,17,24,32 \
        --pad-tiles "$pad" > "$OUT/bench_target-tiles-$pad.md" 2> /dev/null
    echo "bench-target pad $pad exit $?"; grep "| cuda" "$OUT/bench_target-tiles-$pad.md"
done
