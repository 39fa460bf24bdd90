#!/usr/bin/env bash
# Device calls for two kernel switches, on by default since `check` passed on the H100
# (2026-12-05-h100-switches.md); the phases still time them off against on:
#   - the tile padding: bf16 products of 17–24 rows launched as four activation tiles of 8 rows
#     instead of three (`dspark_kernels::set_tile_padding`; 0.8–1.0 ms off a 17–24-row
#     Qwen3-8B forward on the H100, 2026-12-05-h100-tiles.md);
#   - int views: a recorded forward's integer inputs taken as views of their buffer instead of
#     copies (`dspark_kernels::set_int_views`; 4–5 copy launches fewer per step and per round).
# Expects prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_round.sh for the
# build); the machine keeps out/bin between calls while it stays warm.
#   check: gpu_kernels, gpu_golden. Skinny GEMM batch invariance with the padding off and on
#          (rows of 17- and 24-row calls against one call of 130), the fused SwiGLU product
#          against plain burn; the Qwen3-8B-shaped engine with both switches on
#          (DSPARK_GPU_SWITCHES): alone = batched, speculative = target-only, windows of 1/8/17
#          rows = one forward; recorded forwards and rounds = op by op.
#   bench: bench-target. The target's step and windows of 8–32 rows, padding and views off and
#          on, one process each.
#   draft: bench-draft. The γ = 16 and γ = 7c rounds (verify windows of 17 and 8 rows) with
#          both switches off and on, one process each.
# Usage: benches/gpu_tiles.sh check|bench|draft
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

case "$PHASE" in
check)
    # One process per test: the reference of the 64-row SwiGLU case runs long on plain burn.
    for t in ${TILES_KERNEL_TESTS:-skinny_gemm_is_batch_invariant int_views_read_their_buffer linear_swiglu}; do
        timeout 100 out/bin/gpu_kernels --test-threads=1 --nocapture "$t" > "$OUT/gpu_kernels-tiles-$t.log" 2>&1
        echo "gpu_kernels $t exit $?"; grep -E "^test |test result|panicked|tile padding" "$OUT/gpu_kernels-tiles-$t.log" | cut -c1-160
    done
    DSPARK_GPU_SWITCHES=pad-tiles,int-views timeout 330 out/bin/gpu_golden --test-threads=1 --nocapture \
        qwen3_8b_shapes_are_batch_invariant recorded_forwards > "$OUT/gpu_golden-tiles.log" 2>&1
    echo "gpu_golden exit $?"
    grep -E "^test |test result|panicked|staged|differ|divergence|one-sync" "$OUT/gpu_golden-tiles.log" | cut -c1-160
    ;;
bench)
    for s in "off off" "on off" "off on" "on on"; do
        set -- $s
        timeout 80 out/bin/bench-target --lanes 1 --context 512 --steps 10 --windows 8,16,17,24,32 \
            --pad-tiles "$1" --int-views "$2" > "$OUT/bench_target-tiles-$1-$2.md" 2> /dev/null
        echo "bench-target pad $1 views $2 exit $?"; grep "| cuda" "$OUT/bench_target-tiles-$1-$2.md"
    done
    ;;
draft)
    for s in off on; do
        timeout 200 out/bin/bench-draft --layouts 16,7c --weights bf16,fp8h --reps 10 --context 512 \
            --pad-tiles "$s" --int-views "$s" > "$OUT/bench_draft-tiles-$s.md" 2> "$OUT/bench_draft-tiles-$s.log"
        echo "bench-draft switches $s exit $?"; grep "| cuda" "$OUT/bench_draft-tiles-$s.md" | cut -d'|' -f4,6,7,9-13,20-
    done
    ;;
esac
