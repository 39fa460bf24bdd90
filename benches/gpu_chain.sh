#!/usr/bin/env bash
# Device calls for a layer's tail chained into one launch (`dspark_kernels::layer_tail`,
# `dspark-kernels/src/cuda/chain.rs`) and the attention merge folded into the split kernel for
# one-row lanes (`dspark_kernels::paged_attention_synced`), both off by default until these
# checks pass, with A/B switches (`--layer-chain`, `--attn-fold`;
# `DSPARK_GPU_SWITCHES=layer-chain,attn-fold`). Expects
# prebuilt binaries, xz-compressed, in out/carry (see benches/gpu_env.sh): gpu_kernels and
# gpu_golden for `check`, bench-target and bench-draft for `bench`, built with
#   CUDARC_CUDA_VERSION=13000 cargo build --release --features cuda -p dspark-benches \
#     -p dspark-kernels -p dspark --bin bench-target --bin bench-draft --test gpu_kernels --test gpu_golden
#   check: the kernels against the launches they replace, bit for bit (bf16 and FP8 tails at
#          Qwen3-8B widths, 1–16 rows, every norm cube size; the folded merge, twice on the same
#          counters) and the refactored bodies against their references; then the engine at
#          Qwen3-8B shapes with both on (recorded = op by op, alone = batched, speculative =
#          target-only, the FP8 draft lossless) and the trained pair's τ.
#   bench: bench-target (1 and 16 lanes, 8- and 16-row windows, 512 keys) and bench-draft (γ = 7c,
#          FP8 + FP8 head and bf16, 512 keys), both switches on against both off, interleaved,
#          one process each; bench-target also with the chain's prefetch depth at 8 and 1
#          chunks (`--chain-prefetch`; 2 the default).
#   all:   check, then bench.
#   one:   what one call of at most ten minutes holds: the kernel checks, the engine at Qwen3-8B
#          shapes and the trained pair, then bench-target on/off/on and bench-draft on/off (each
#          bench only while the call has time left).
# Every phase packs what it wrote under $OUT into one archive ($OUT/chain.tgz): a call returns
# only a few files.
# Usage: benches/gpu_chain.sh check|bench|all|one|short|last
set -uo pipefail
OUT=${OUT:-out/results}
PHASE=${1:-check}
. "$(dirname "$0")/gpu_env.sh"

check() {
    gpu_test gpu_kernels 240 gpu_kernels-chain.log layer_tail paged_attention_matches_reference \
        skinny_gemm_is_batch_invariant skinny_gemm_matches_reference rms_norm_kernels_match_reference \
        linear_add_rms_norm_matches_reference linear_swiglu_matches_reference linear_fp8 markov_greedy_matches_unfused
    grep -E "layer_tail rows (1|16) norm threads 1024|rel err vs plain" "$OUT/gpu_kernels-chain.log" | head -6
    DSPARK_GPU_SWITCHES=layer-chain,attn-fold gpu_test gpu_golden 420 gpu_golden-chain.log qwen3_8b \
        trained_pair_greedy trained_pair_fp8
    grep -E "kernel switch" "$OUT/gpu_golden-chain.log" | head -3
    echo "(${SECONDS} s into the call)"
}

bench() {
    local on="--layer-chain on --attn-fold on"
    for flags in "$on" "" "$on --chain-prefetch 8" "$on" "" "$on --chain-prefetch 1"; do
        # shellcheck disable=SC2086
        gpu_bench bench-target 120 --device cuda --dtype bf16 --lanes 1,16 --context 512 --steps 20 \
            --windows 8,16 $flags
        grep -E "^\| cuda .*\| (8|16) \|" "$OUT/$GPU_BENCH_RUNS-bench-target.md" | cut -c1-200
    done
    for flags in "$on" "" "$on"; do
        # shellcheck disable=SC2086
        gpu_bench bench-draft 150 --layouts 7c --weights fp8h,bf16 --reps 20 --context 512 $flags
    done
    echo "(${SECONDS} s into the call)"
}

one() {
    gpu_test gpu_kernels 150 gpu_kernels-chain.log layer_tail paged_attention_matches_reference \
        skinny_gemm_is_batch_invariant rms_norm_kernels_match_reference linear_fp8_swiglu_matches_reference
    grep -E "rel err vs plain" "$OUT/gpu_kernels-chain.log" | head -3
    DSPARK_GPU_SWITCHES=layer-chain,attn-fold gpu_test gpu_golden 240 gpu_golden-chain.log \
        qwen3_8b_shapes_are_batch_invariant qwen3_8b_shapes_fp8 trained_pair_greedy
    grep -E "chained layer tails|kernel switch" "$OUT/gpu_golden-chain.log" | head -4
    echo "(${SECONDS} s into the call)"
    local on="--layer-chain on --attn-fold on"
    for flags in "$on" "" "$on"; do
        [ "$SECONDS" -lt 430 ] || break
        # shellcheck disable=SC2086
        gpu_bench bench-target 60 --device cuda --dtype bf16 --lanes 1,16 --context 512 --steps 20 \
            --windows 8,16 $flags
        grep -E "^\| cuda .*\| (8|16) \|" "$OUT/$GPU_BENCH_RUNS-bench-target.md" | cut -c1-200
    done
    for flags in "$on" ""; do
        [ "$SECONDS" -lt 500 ] || break
        # shellcheck disable=SC2086
        gpu_bench bench-draft 60 --layouts 7c --weights fp8h,bf16 --reps 20 --context 512 $flags
    done
    echo "(${SECONDS} s into the call)"
}

# `one` trimmed to under five minutes: the kernel checks, the Qwen3-8B-shape engine test and
# the trained pair, then bench-target on/off and bench-draft on while there is time.
short() {
    gpu_test gpu_kernels 90 gpu_kernels-chain.log layer_tail paged_attention_matches_reference \
        skinny_gemm_is_batch_invariant rms_norm_kernels_match_reference
    grep -E "rel err vs plain" "$OUT/gpu_kernels-chain.log" | head -3
    DSPARK_GPU_SWITCHES=layer-chain,attn-fold gpu_test gpu_golden 110 gpu_golden-chain.log \
        qwen3_8b_shapes_are_batch_invariant trained_pair_greedy
    grep -E "chained layer tails" "$OUT/gpu_golden-chain.log" | head -2
    echo "(${SECONDS} s into the call)"
    local on="--layer-chain on --attn-fold on"
    for flags in "$on" ""; do
        [ "$SECONDS" -lt 200 ] || break
        # shellcheck disable=SC2086
        gpu_bench bench-target 45 --device cuda --dtype bf16 --lanes 1,16 --context 512 --steps 20 \
            --windows 8,16 $flags
        grep -E "^\| cuda .*\| (8|16) \|" "$OUT/$GPU_BENCH_RUNS-bench-target.md" | cut -c1-200
    done
    [ "$SECONDS" -lt 240 ] && gpu_bench bench-draft 60 --layouts 7c --weights fp8h,bf16 --reps 20 --context 512 $on
    echo "(${SECONDS} s into the call)"
}

# What about three minutes hold: the bf16 and FP8 tail and the fold against the separate
# launches, bench-target on/off at one lane, then the Qwen3-8B-shape engine test if time is left.
last() {
    gpu_test gpu_kernels 70 gpu_kernels-chain.log layer_tail paged_attention_matches_reference
    local on="--layer-chain on --attn-fold on"
    for flags in "$on" ""; do
        # shellcheck disable=SC2086
        gpu_bench bench-target 40 --device cuda --dtype bf16 --lanes 1 --context 512 --steps 20 --windows 8 $flags
        grep -E "^\| cuda .*\| 8 \|" "$OUT/$GPU_BENCH_RUNS-bench-target.md" | cut -c1-200
    done
    echo "(${SECONDS} s into the call)"
    local left=$((185 - SECONDS))
    [ "$left" -gt 40 ] && DSPARK_GPU_SWITCHES=layer-chain,attn-fold gpu_test gpu_golden "$left" \
        gpu_golden-chain.log qwen3_8b_shapes_are_batch_invariant
    grep -E "chained layer tails" "$OUT/gpu_golden-chain.log" | head -2
    echo "(${SECONDS} s into the call)"
}

case "$PHASE" in
check) check ;;
short) short ;;
last) last ;;
bench) bench ;;
one) one ;;
all)
    check
    bench
    ;;
*)
    echo "usage: $0 check|bench|all|one|short|last" >&2
    exit 2
    ;;
esac
tar czf /tmp/chain.tgz -C "$OUT" . && rm -f "$OUT"/* && mv /tmp/chain.tgz "$OUT"/
